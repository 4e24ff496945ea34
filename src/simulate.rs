//! Simulated preproc frames with a known truth, for testing extractions end to end.
//!
//! A simulation draws a spectrum (photons per bin of the output grid) for each fiber of a
//! range, projects every bin through the PSF onto the CCD, and adds Poisson photon noise,
//! Gaussian read noise, cosmic-ray tracks and optionally a bad column or masked amplifiers; a
//! flat exposure gives every fiber the same lamp spectrum instead of sky and objects. The
//! result is written as a preproc file (`IMAGE`, `IVAR`, `MASK`, `READNOISE`, `FIBERMAP`,
//! with the keywords desispec reads) that the extraction and `desispec.io.read_image` read
//! like a real one, plus a truth file (`WAVELENGTH`, `FLUX`) to measure the extraction
//! against.
//!
//! Everything is a pure function of the PSF, the options and the seed: each random stream
//! (one per fiber for the spectra, one per CCD row for the noise, one for the cosmics) has its
//! own generator seeded from `(seed, stream, index)`, and the image is summed in fiber order,
//! so the output does not depend on the number of threads. A fiber's spectrum depends only on
//! the seed and its fiber number, so overlapping fiber ranges share their spectra.

use std::ops::Range;

use ndarray::{s, Array2};
use rand::rngs::StdRng;
use rand::SeedableRng;
use rayon::prelude::*;
use tracing::{debug, info};

use crate::error::Result;
use crate::fits::Fits;
use crate::plan::output_grid;
use crate::psf::GaussHermitePsf;

mod ccd;
mod cosmics;
mod exposure;
mod files;
mod options;
mod spectra;
use ccd::Region;
pub use exposure::FIBERMAP_COLUMNS;
pub use options::SimulateOptions;
use spectra::{fiber_spectrum, SkyLines};

/// MASK value of unusable pixels: outside the simulated region, on the bad column and on
/// masked amplifiers (desispec's BAD bit).
pub const MASK_BAD: i32 = 1;

/// Most cosmic-ray tracks per million pixels (one per ten pixels): more would only cover the
/// image with tracks, in a time that grows with the count.
pub const MAX_COSMIC_DENSITY: f64 = 1e5;

/// MASK value of cosmic-ray hits. This is the value the reference simulations use (desispec's
/// own COSMIC bit is 16); both are inside desispec's production mask 767, and the extraction
/// rejects any nonzero MASK by default, so either convention gives the same result.
pub const MASK_COSMIC: i32 = 8;

/// Extra signal (electrons) of the bad column inside the simulated region, so that an
/// extraction that ignores the mask visibly suffers from it.
const BAD_COLUMN_EXCESS: f64 = 300.0;

/// Random streams: a generator is seeded from `(seed, stream, index)`.
const STREAM_FIBER: u64 = 1;
const STREAM_NOISE: u64 = 2;
const STREAM_COSMIC: u64 = 3;

/// Kind of a fiber in the FIBERMAP.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ObjType {
    /// A sky fiber: night sky only.
    Sky,
    /// A target fiber (also used for fibers that were not simulated).
    Target,
}

impl ObjType {
    /// The FIBERMAP's OBJTYPE string.
    pub fn as_str(self) -> &'static str {
        match self {
            ObjType::Sky => "SKY",
            ObjType::Target => "TGT",
        }
    }
}

/// A simulated frame and its truth.
#[derive(Clone, Debug)]
pub struct Simulation {
    /// CCD size (rows = NPIX_Y, columns = NPIX_X of the PSF).
    pub nrows: usize,
    pub ncols: usize,
    /// Pixels, `[row, column]`.
    pub image: Array2<f32>,
    /// Inverse variance of the noiseless model plus read noise; 0 where masked.
    pub ivar: Array2<f32>,
    /// [`MASK_BAD`], [`MASK_COSMIC`] or 0.
    pub mask: Array2<i32>,
    /// CCD rows and columns that carry simulated signal (the bounding box of the spots plus
    /// the margin, clipped to the CCD); everything outside is masked.
    pub rows: Range<usize>,
    pub cols: Range<usize>,
    /// Number of cosmic-ray tracks.
    pub ncosmic: usize,
    /// Truth grid (A).
    pub wave: Vec<f64>,
    /// Fibers simulated; row `i` of `flux` is fiber `fibers.start + i`.
    pub fibers: Range<usize>,
    /// Truth, photons per bin, `[fiber][wave]`.
    pub flux: Vec<f64>,
    /// OBJTYPE of every PSF fiber (`0..psf.nfiber`).
    pub objtype: Vec<ObjType>,
    /// CAMERA keyword.
    pub camera: String,
    /// File name (without directories) of the PSF, for the headers.
    pub psf_name: String,
    /// The options the simulation was made with.
    pub options: SimulateOptions,
}

/// Simulates a frame; see the module documentation.
pub fn simulate(psf: &GaussHermitePsf, opts: &SimulateOptions) -> Result<Simulation> {
    opts.validate(psf)?;
    let start = std::time::Instant::now();
    let wave = output_grid(opts.wmin, opts.wmax, opts.dw);
    let (nrows, ncols) = (psf.npix_y, psf.npix_x);
    let fibers = opts.fibers.clone();

    // Truth.
    let sky = SkyLines::new();
    let spectra: Vec<(ObjType, Vec<f64>)> = fibers
        .clone()
        .into_par_iter()
        .map(|fiber| fiber_spectrum(fiber, &wave, &sky, opts))
        .collect();
    let mut objtype = vec![ObjType::Target; psf.nfiber];
    let mut flux = Vec::with_capacity(fibers.len() * wave.len());
    for (fiber, (kind, spectrum)) in fibers.clone().zip(spectra) {
        objtype[fiber] = kind;
        flux.extend_from_slice(&spectrum);
    }

    let region = ccd::signal_region(psf, &fibers, &wave, opts)?;
    let model = ccd::project(psf, &fibers, &wave, &flux, &region);
    debug!(elapsed = ?start.elapsed(), "projected the truth");
    let (mut image, mut ivar, mut mask) = ccd::observe(&model, &region, nrows, ncols, opts);
    drop(model);
    let Region { rows, cols } = region.clone();

    let ncosmic = cosmics::add_cosmics(&mut image, &mut ivar, &mut mask, &region, opts);
    if let Some(column) = opts.bad_column {
        if cols.contains(&column) {
            image
                .slice_mut(s![rows.clone(), column])
                .mapv_inplace(|v| v + BAD_COLUMN_EXCESS as f32);
        }
        mask.column_mut(column).mapv_inplace(|m| m | MASK_BAD);
        ivar.column_mut(column).fill(0.0);
    }
    for (amp, [r0, r1, c0, c1]) in exposure::amplifiers(nrows, ncols) {
        if opts.masked_amps.contains(&amp) {
            let quadrant = s![r0..r1, c0..c1];
            mask.slice_mut(quadrant).mapv_inplace(|m| m | MASK_BAD);
            ivar.slice_mut(quadrant).fill(0.0);
        }
    }

    let camera = match &opts.camera {
        Some(camera) => camera.clone(),
        None => psf_camera(psf).unwrap_or_else(|| "r0".into()),
    };
    let psf_name = psf
        .path
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_default();
    info!(
        fibers = ?fibers,
        nwave = wave.len(),
        ncosmic,
        elapsed = ?start.elapsed(),
        "simulated frame"
    );
    Ok(Simulation {
        nrows,
        ncols,
        image,
        ivar,
        mask,
        rows,
        cols,
        ncosmic,
        wave,
        fibers,
        flux,
        objtype,
        camera,
        psf_name,
        options: opts.clone(),
    })
}

/// The CAMERA keyword of the PSF's table HDU, if any (specex writes it with extra quotes).
fn psf_camera(psf: &GaussHermitePsf) -> Option<String> {
    let mut fits = Fits::open(&psf.path).ok()?;
    fits.move_to("PSF").ok()?;
    let camera = fits.key_str("CAMERA").ok()??;
    let camera = camera.trim().trim_matches('\'').trim().to_string();
    (!camera.is_empty()).then_some(camera)
}

/// A generator for one random stream: the seed, the stream and the index are mixed with
/// SplitMix64 into the 256-bit seed, so neighbouring indices give unrelated streams.
fn stream_rng(seed: u64, stream: u64, index: u64) -> StdRng {
    let mut state = seed
        ^ stream.wrapping_mul(0xD1B5_4A32_D192_ED03)
        ^ index.wrapping_mul(0x9E37_79B9_7F4A_7C15);
    let mut bytes = [0u8; 32];
    for chunk in bytes.chunks_mut(8) {
        state = state.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = state;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^= z >> 31;
        chunk.copy_from_slice(&z.to_le_bytes());
    }
    StdRng::from_seed(bytes)
}

#[cfg(test)]
mod tests;
