//! Simulated preproc frames with a known truth, for testing extractions end to end.
//!
//! A simulation draws a spectrum (photons per bin of the output grid) for each fiber of a
//! range, projects every bin through the PSF onto the CCD, and adds Poisson photon noise,
//! Gaussian read noise, cosmic-ray tracks and optionally a bad column. The result is written as
//! a preproc file (`IMAGE`, `IVAR`, `MASK`, `READNOISE`, `FIBERMAP`, with the keywords
//! desispec reads) that the extraction and `desispec.io.read_image` read like a real one,
//! plus a truth file (`WAVELENGTH`, `FLUX`) to measure the extraction against.
//!
//! Everything is a pure function of the PSF, the options and the seed: each random stream
//! (one per fiber for the spectra, one per CCD row for the noise, one for the cosmics) has its
//! own generator seeded from `(seed, stream, index)`, and the image is summed in fiber order,
//! so the output does not depend on the number of threads. A fiber's spectrum depends only on
//! the seed and its fiber number, so overlapping fiber ranges share their spectra.

use std::ops::Range;

use ndarray::{s, Array2, ArrayView2, Zip};
use rand::rngs::StdRng;
use rand::{RngExt, SeedableRng};
use rand_distr::{Distribution, Poisson, StandardNormal};
use rayon::prelude::*;
use tracing::{debug, info};

use crate::error::{Error, Result};
use crate::fits::Fits;
use crate::plan::output_grid;
use crate::psf::GaussHermitePsf;

mod cosmics;
mod exposure;
mod files;
mod spectra;
pub use exposure::FIBERMAP_COLUMNS;
use spectra::{fiber_spectrum, SkyLines};

/// MASK value of unusable pixels: outside the simulated region and on the bad column
/// (desispec's BAD bit).
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

/// What to simulate.
#[derive(Clone, Debug, PartialEq)]
pub struct SimulateOptions {
    /// Fibers given light (PSF fiber indices, `0..psf.nfiber`).
    pub fibers: Range<usize>,
    /// Wavelength grid of the truth, `output_grid(wmin, wmax, dw)`; it must lie inside the
    /// PSF's domain (the Legendre series must not be extrapolated).
    pub wmin: f64,
    pub wmax: f64,
    pub dw: f64,
    /// Seed of every random choice (spectra, noise, cosmics).
    pub seed: u64,
    /// Gaussian read noise (electrons rms per pixel).
    pub read_noise: f64,
    /// Add Poisson photon noise and read noise; without it IMAGE is the noiseless model
    /// (IVAR is the same either way).
    pub noise: bool,
    /// Cosmic-ray tracks per million pixels of the simulated region (0: none). The default, 50,
    /// is about what a 900 s exposure collects on a DESI CCD.
    pub cosmic_density: f64,
    /// A CCD column to mark bad (MASK 1, IVAR 0, with excess signal), as in the reference
    /// full-frame simulations.
    pub bad_column: Option<usize>,
    /// Give every fiber the night-sky spectrum (continuum and emission lines).
    pub sky: bool,
    /// Give the non-sky fibers an object spectrum (continuum and emission lines).
    pub objects: bool,
    /// Fraction of fibers that are sky fibers (only sky light, OBJTYPE 'SKY').
    pub sky_fraction: f64,
    /// Pixels of margin around the bounding box of the simulated spots; outside it the image is
    /// 0 and masked, as in the reference simulations.
    pub margin: usize,
    /// CAMERA keyword; `None` takes it from the PSF file (or 'r0' if the PSF does not say).
    pub camera: Option<String>,
    /// EXPID keyword.
    pub expid: i64,
    /// Fraction of the cosmic-ray tracks left out of the MASK, with the IVAR of the light
    /// beneath them (0: every track masked).
    pub unmasked_cosmics: f64,
}

impl SimulateOptions {
    /// The defaults (seed 0, 0.8 A bins, 3 e- read noise, noise, sky, objects, cosmics, 10% sky
    /// fibers, no bad column) for a fiber range and wavelength range.
    pub fn new(fibers: Range<usize>, wmin: f64, wmax: f64) -> Self {
        SimulateOptions {
            fibers,
            wmin,
            wmax,
            dw: 0.8,
            seed: 0,
            read_noise: 3.0,
            noise: true,
            cosmic_density: 50.0,
            bad_column: None,
            sky: true,
            objects: true,
            sky_fraction: 0.1,
            margin: 3,
            camera: None,
            expid: 1,
            unmasked_cosmics: 0.0,
        }
    }

    /// Checks the options against the PSF, with a message that names the offending option.
    pub fn validate(&self, psf: &GaussHermitePsf) -> Result<()> {
        let (lo, hi) = psf.wave_domain();
        if self.fibers.is_empty() {
            return Err(Error::config(format!(
                "no fibers to simulate ({:?})",
                self.fibers
            )));
        }
        if self.fibers.end > psf.nfiber {
            return Err(Error::config(format!(
                "fibers {}..{} requested, the PSF describes fibers 0..{}",
                self.fibers.start, self.fibers.end, psf.nfiber
            )));
        }
        if !(self.dw.is_finite() && self.dw > 0.0) {
            return Err(Error::config(format!(
                "wavelength step {} must be positive",
                self.dw
            )));
        }
        if !(self.wmin.is_finite() && self.wmax.is_finite() && self.wmin <= self.wmax) {
            return Err(Error::config(format!(
                "wavelength range {}..{} is not an increasing range",
                self.wmin, self.wmax
            )));
        }
        // The grid's last bin may pass wmax by less than half a bin (numpy's arange
        // convention); that much extrapolation is harmless, more is refused.
        if self.wmin < lo || self.wmax > hi {
            return Err(Error::config(format!(
                "wavelength range {}..{} A is outside the PSF's domain {lo}..{hi} A",
                self.wmin, self.wmax
            )));
        }
        if !(self.read_noise.is_finite() && self.read_noise >= 0.0) {
            return Err(Error::config(format!(
                "read noise {} must be >= 0",
                self.read_noise
            )));
        }
        if !(self.cosmic_density >= 0.0 && self.cosmic_density <= MAX_COSMIC_DENSITY) {
            return Err(Error::config(format!(
                "cosmic-ray density {} must be in 0..={MAX_COSMIC_DENSITY} tracks per million pixels",
                self.cosmic_density
            )));
        }
        if !(0.0..=1.0).contains(&self.unmasked_cosmics) {
            return Err(Error::config(format!(
                "unmasked cosmic fraction {} must be in 0..1",
                self.unmasked_cosmics
            )));
        }
        if !(0.0..=1.0).contains(&self.sky_fraction) {
            return Err(Error::config(format!(
                "sky fiber fraction {} must be in 0..1",
                self.sky_fraction
            )));
        }
        if !self.sky && !self.objects {
            return Err(Error::config(
                "neither sky nor objects: nothing to simulate",
            ));
        }
        if let Some(column) = self.bad_column {
            if column >= psf.npix_x {
                return Err(Error::config(format!(
                    "bad column {column} is outside the CCD's {} columns",
                    psf.npix_x
                )));
            }
        }
        if psf.npix_x == 0 || psf.npix_y == 0 {
            return Err(Error::config(format!(
                "the PSF's CCD size {} x {} is empty",
                psf.npix_y, psf.npix_x
            )));
        }
        Ok(())
    }
}

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

    // The region with signal: bounding box of every spot plus the margin, clipped to the CCD.
    let corners = psf.corners(fibers.clone(), &wave);
    let (ny, nx) = (corners.ny as i64, corners.nx as i64);
    let margin = opts.margin as i64;
    let clip =
        |lo: i64, hi: i64, n: usize| lo.clamp(0, n as i64) as usize..hi.clamp(0, n as i64) as usize;
    let xmin = corners.xc.iter().copied().min().unwrap_or(0) as i64;
    let xmax = corners.xc.iter().copied().max().unwrap_or(0) as i64 + nx;
    let ymin = corners.yc.iter().copied().min().unwrap_or(0) as i64;
    let ymax = corners.yc.iter().copied().max().unwrap_or(0) as i64 + ny;
    let rows = clip(ymin - margin, ymax + margin, nrows);
    let cols = clip(xmin - margin, xmax + margin, ncols);
    if rows.is_empty() || cols.is_empty() {
        return Err(Error::config(format!(
            "the spots of fibers {fibers:?} at {}..{} A all fall off the {nrows} x {ncols} CCD",
            opts.wmin, opts.wmax
        )));
    }
    let region = Region {
        rows: rows.clone(),
        cols: cols.clone(),
    };

    let model = project(psf, &fibers, &wave, &flux, &region);
    debug!(elapsed = ?start.elapsed(), "projected the truth");

    // Noise, and the mask of everything outside the region.
    let mut image = Array2::<f32>::zeros((nrows, ncols));
    let mut ivar = Array2::<f32>::zeros((nrows, ncols));
    let mut mask = Array2::from_elem((nrows, ncols), MASK_BAD);
    let read_var = opts.read_noise * opts.read_noise;
    let window = s![rows.clone(), cols.clone()];
    Zip::indexed(image.slice_mut(window).rows_mut())
        .and(ivar.slice_mut(window).rows_mut())
        .and(mask.slice_mut(window).rows_mut())
        .and(model.rows())
        .par_for_each(|i, mut image, mut ivar, mut mask, model| {
            let row = rows.start + i;
            let mut rng = stream_rng(opts.seed, STREAM_NOISE, row as u64);
            for (col, &m) in model.iter().enumerate() {
                let var = m + read_var;
                let value = if opts.noise {
                    let photons = if m > 0.0 {
                        Poisson::new(m).map(|p| p.sample(&mut rng)).unwrap_or(m)
                    } else {
                        0.0
                    };
                    let read: f64 = rng.sample(StandardNormal);
                    photons + opts.read_noise * read
                } else {
                    m
                };
                image[col] = value as f32;
                ivar[col] = if var > 0.0 { (1.0 / var) as f32 } else { 0.0 };
                mask[col] = 0;
            }
        });
    drop(model);

    let ncosmic = add_cosmics(&mut image, &mut ivar, &mut mask, &region, opts);
    if let Some(column) = opts.bad_column {
        if cols.contains(&column) {
            image
                .slice_mut(s![rows.clone(), column])
                .mapv_inplace(|v| v + BAD_COLUMN_EXCESS as f32);
        }
        mask.column_mut(column).mapv_inplace(|m| m | MASK_BAD);
        ivar.column_mut(column).fill(0.0);
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

/// The rectangle of the CCD that holds signal.
struct Region {
    rows: Range<usize>,
    cols: Range<usize>,
}

/// The spots of one fiber summed with their truth weights into the bounding box of that fiber.
struct Stripe {
    row0: i64,
    col0: i64,
    /// `[row - row0, col - col0]`.
    data: Array2<f64>,
}

/// The noiseless image of the region: sum over fibers and bins of truth times spot.
///
/// Fibers are evaluated in parallel, a chunk at a time (spots of one fiber over a whole frame
/// are a few MB), each into its own stripe; the stripes are then added row by row in fiber
/// order, so every pixel sums its contributions in the same order whatever the threads.
fn project(
    psf: &GaussHermitePsf,
    fibers: &Range<usize>,
    wave: &[f64],
    flux: &[f64],
    region: &Region,
) -> Array2<f64> {
    let (rw, cw) = (region.rows.len(), region.cols.len());
    let mut model = Array2::zeros((rw, cw));
    let nwave = wave.len();
    let chunk = 4 * rayon::current_num_threads().max(1);
    let all: Vec<usize> = fibers.clone().collect();
    for block in all.chunks(chunk) {
        let stripes: Vec<Stripe> = block
            .par_iter()
            .map(|&fiber| {
                let i = fiber - fibers.start;
                stripe(psf, fiber, wave, &flux[i * nwave..(i + 1) * nwave])
            })
            .collect();
        Zip::indexed(model.rows_mut()).par_for_each(|r, mut out| {
            let row = (region.rows.start + r) as i64;
            for s in &stripes {
                if row < s.row0 || row >= s.row0 + s.data.nrows() as i64 {
                    continue;
                }
                let src = s.data.row((row - s.row0) as usize);
                for (j, &v) in src.iter().enumerate() {
                    let col = s.col0 + j as i64 - region.cols.start as i64;
                    if col >= 0 && (col as usize) < cw {
                        out[col as usize] += v;
                    }
                }
            }
        });
    }
    model
}

fn stripe(psf: &GaussHermitePsf, fiber: usize, wave: &[f64], flux: &[f64]) -> Stripe {
    let spots = psf.spots(fiber..fiber + 1, wave);
    let c = &spots.corners;
    let (ny, nx) = (c.ny, c.nx);
    let col0 = c.xc.iter().copied().min().unwrap_or(0) as i64;
    let row0 = c.yc.iter().copied().min().unwrap_or(0) as i64;
    let ncols = (c.xc.iter().copied().max().unwrap_or(0) as i64 - col0) as usize + nx;
    let nrows = (c.yc.iter().copied().max().unwrap_or(0) as i64 - row0) as usize + ny;
    let mut data = Array2::zeros((nrows, ncols));
    for (iw, &t) in flux.iter().enumerate() {
        if t == 0.0 {
            continue;
        }
        let (xc, yc) = c.corner(0, iw);
        let (x0, y0) = ((xc as i64 - col0) as usize, (yc as i64 - row0) as usize);
        let spot = ArrayView2::from_shape((ny, nx), spots.spot(0, iw))
            .expect("a spot holds ny x nx values");
        data.slice_mut(s![y0..y0 + ny, x0..x0 + nx])
            .zip_mut_with(&spot, |o, &s| *o += t * s);
    }
    Stripe { row0, col0, data }
}

/// Adds cosmic-ray tracks inside the region: short straight segments (1.5 to 8 pixels, any
/// direction) that deposit hundreds to thousands of electrons per pixel; their pixels get
/// [`MASK_COSMIC`] and IVAR 0. Returns the number of tracks.
fn add_cosmics(
    image: &mut Array2<f32>,
    ivar: &mut Array2<f32>,
    mask: &mut Array2<i32>,
    region: &Region,
    opts: &SimulateOptions,
) -> usize {
    let area = (region.rows.len() * region.cols.len()) as f64;
    let expected = opts.cosmic_density * area * 1e-6;
    if expected <= 0.0 {
        return 0;
    }
    let mut rng = stream_rng(opts.seed, STREAM_COSMIC, 0);
    let ntrack = Poisson::new(expected)
        .map(|p| p.sample(&mut rng))
        .unwrap_or(expected)
        .round() as usize;
    let (r0, r1) = (region.rows.start as f64, region.rows.end as f64);
    let (c0, c1) = (region.cols.start as f64, region.cols.end as f64);
    let mut pixels: Vec<(i64, i64)> = Vec::with_capacity(16);
    let mut masking = cosmics::TrackMasking::new(opts.seed, opts.unmasked_cosmics);
    for _ in 0..ntrack {
        let masked = masking.next_is_masked();
        let x0 = rng.random_range(c0 - 0.5..c1 - 0.5);
        let y0 = rng.random_range(r0 - 0.5..r1 - 0.5);
        let angle: f64 = rng.random_range(0.0..std::f64::consts::PI);
        let length: f64 = rng.random_range(1.5..8.0);
        let charge: f64 = rng.random_range(300.0..3000.0);
        let (dx, dy) = (angle.cos(), angle.sin());
        let nstep = (4.0 * length).ceil() as usize;
        pixels.clear();
        for k in 0..=nstep {
            let t = length * k as f64 / nstep as f64;
            let p = ((x0 + t * dx).round() as i64, (y0 + t * dy).round() as i64);
            if !pixels.contains(&p) {
                pixels.push(p);
            }
        }
        for &(col, row) in &pixels {
            if col < 0 || row < 0 {
                continue;
            }
            let (col, row) = (col as usize, row as usize);
            if !region.rows.contains(&row) || !region.cols.contains(&col) {
                continue;
            }
            let i = [row, col];
            // Charge shared along the track, with some pixel-to-pixel variation.
            image[i] += (charge * rng.random_range(0.5..1.5)) as f32;
            if masked {
                ivar[i] = 0.0;
                mask[i] |= MASK_COSMIC;
            }
        }
    }
    ntrack
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
mod tests {
    use std::path::Path;

    use super::spectra::air_to_vacuum;
    use super::*;
    use crate::image::{Image, MaskRule};

    fn read_psf(name: &str) -> GaussHermitePsf {
        let path = Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("tests/data")
            .join(name);
        GaussHermitePsf::read(&path).expect("test PSF")
    }

    fn psf_a() -> GaussHermitePsf {
        read_psf("psf-r0-00067784.fits")
    }

    /// A few fibers over a short range: fast, and fully on the CCD.
    fn small(seed: u64) -> SimulateOptions {
        let mut o = SimulateOptions::new(10..14, 6250.0, 6350.0);
        o.seed = seed;
        o.cosmic_density = 2000.0;
        o.bad_column = None;
        o
    }

    #[test]
    fn same_seed_same_frame_whatever_the_threads() {
        let psf = psf_a();
        let opts = small(7);
        let run = |threads: usize| {
            rayon::ThreadPoolBuilder::new()
                .num_threads(threads)
                .build()
                .unwrap()
                .install(|| simulate(&psf, &opts).unwrap())
        };
        let a = run(1);
        let b = run(3);
        assert!(a.ncosmic > 0);
        assert_eq!(a.image, b.image);
        assert_eq!(a.ivar, b.ivar);
        assert_eq!(a.mask, b.mask);
        assert_eq!(a.flux, b.flux);
        assert_eq!(a.objtype, b.objtype);

        let c = simulate(&psf, &small(8)).unwrap();
        assert_ne!(a.flux, c.flux);
        let differ = a.image.iter().zip(&c.image).filter(|(x, y)| x != y).count();
        assert!(
            differ > a.rows.len() * a.cols.len() / 2,
            "only {differ} pixels differ"
        );
    }

    #[test]
    fn a_fiber_spectrum_depends_on_the_seed_and_fiber_only() {
        let psf = psf_a();
        let a = simulate(&psf, &small(3)).unwrap();
        let mut o = small(3);
        o.fibers = 12..17;
        let b = simulate(&psf, &o).unwrap();
        for fiber in 12..14 {
            assert_eq!(a.truth(fiber).unwrap(), b.truth(fiber).unwrap());
            assert_eq!(a.objtype[fiber], b.objtype[fiber]);
        }
        assert!(a.truth(9).is_none() && a.truth(14).is_none());
    }

    #[test]
    fn truth_is_realistic() {
        let psf = psf_a();
        let mut o = SimulateOptions::new(0..40, 6250.0, 6400.0);
        o.noise = false;
        o.cosmic_density = 0.0;
        let s = simulate(&psf, &o).unwrap();
        assert_eq!(s.flux.len(), 40 * s.wave.len());
        assert!(s.flux.iter().all(|v| v.is_finite() && *v >= 0.0));
        let nsky = s.objtype[0..40]
            .iter()
            .filter(|t| **t == ObjType::Sky)
            .count();
        assert!(nsky > 0 && nsky < 40, "{nsky} sky fibers");
        // [OI] 6300.30 A (air) is the brightest line of the range in every fiber.
        let line = air_to_vacuum(6300.30);
        let ibin = s.wave.iter().position(|w| (w - line).abs() <= 0.4).unwrap();
        for fiber in 0..40 {
            let t = s.truth(fiber).unwrap();
            let mut sorted = t.to_vec();
            sorted.sort_by(f64::total_cmp);
            let median = sorted[sorted.len() / 2];
            assert!(
                (10.0..1000.0).contains(&median),
                "fiber {fiber}: continuum {median}"
            );
            let peak = t[ibin.saturating_sub(1)..ibin + 2].iter().sum::<f64>();
            assert!(peak > 2000.0, "fiber {fiber}: [OI] {peak}");
            if s.objtype[fiber] == ObjType::Sky {
                // Sky fibers share one spectrum up to the fiber throughput.
                let t0 = s
                    .truth(s.objtype.iter().position(|t| *t == ObjType::Sky).unwrap())
                    .unwrap();
                let ratio = t[0] / t0[0];
                assert!(t.iter().zip(t0).all(|(a, b)| (a / b - ratio).abs() < 1e-9));
            }
        }
    }

    /// Spots are unit-normalised, so the noiseless image holds all of the truth except what
    /// falls off the CCD, which is computed here from the spots themselves.
    fn check_total(psf: &GaussHermitePsf, mut o: SimulateOptions) -> f64 {
        o.noise = false;
        o.cosmic_density = 0.0;
        let s = simulate(psf, &o).unwrap();
        let spots = psf.spots(o.fibers.clone(), &s.wave);
        let c = &spots.corners;
        let mut expected = 0.0;
        let mut lost = 0.0;
        for f in 0..o.fibers.len() {
            for w in 0..s.wave.len() {
                let (xc, yc) = c.corner(f, w);
                let t = s.flux[f * s.wave.len() + w];
                for iy in 0..c.ny {
                    for ix in 0..c.nx {
                        let (x, y) = (xc as i64 + ix as i64, yc as i64 + iy as i64);
                        let v = t * spots.spot(f, w)[iy * c.nx + ix];
                        if x >= 0 && y >= 0 && (x as usize) < s.ncols && (y as usize) < s.nrows {
                            expected += v;
                        } else {
                            lost += v;
                        }
                    }
                }
            }
        }
        let total: f64 = s.image.iter().map(|&v| v as f64).sum();
        let truth: f64 = s.flux.iter().sum();
        assert!(
            (expected + lost - truth).abs() < 1e-9 * truth,
            "spots are not unit-normalised"
        );
        assert!(
            (total - expected).abs() < 1e-6 * expected,
            "image {total} vs truth on the CCD {expected}"
        );
        lost / truth
    }

    #[test]
    fn noiseless_image_holds_the_truth() {
        let psf = psf_a();
        let lost = check_total(&psf, SimulateOptions::new(100..104, 6000.0, 6200.0));
        assert_eq!(lost, 0.0);
        // The first fibers at the blue end of the domain run off the CCD.
        let (lo, _) = psf.wave_domain();
        let lost = check_total(&psf, SimulateOptions::new(0..3, lo, lo + 60.0));
        assert!(lost > 0.0 && lost < 1.0, "lost fraction {lost}");
        let other = read_psf("psf-r0-00051060.fits");
        check_total(&other, SimulateOptions::new(250..253, 7400.0, 7500.0));
    }

    #[test]
    fn ivar_follows_the_model_and_the_region_is_masked_outside() {
        let psf = psf_a();
        let mut o = small(1);
        o.noise = false;
        o.cosmic_density = 0.0;
        let s = simulate(&psf, &o).unwrap();
        let rn2 = o.read_noise * o.read_noise;
        for row in 0..s.nrows {
            for col in 0..s.ncols {
                let i = [row, col];
                if s.rows.contains(&row) && s.cols.contains(&col) {
                    assert_eq!(s.mask[i], 0);
                    let expected = 1.0 / (s.image[i] as f64 + rn2);
                    assert!((s.ivar[i] as f64 - expected).abs() < 1e-6 * expected);
                } else {
                    assert_eq!((s.image[i], s.ivar[i], s.mask[i]), (0.0, 0.0, MASK_BAD));
                }
            }
        }
        // The margin holds only read noise: the spots are inside the box.
        let row = s.rows.start;
        assert!(s
            .image
            .slice(s![row, s.cols.clone()])
            .iter()
            .all(|&v| v == 0.0));
    }

    #[test]
    fn cosmics_and_bad_column_are_masked_where_they_are() {
        let psf = psf_a();
        let mut clean = small(5);
        clean.cosmic_density = 0.0;
        let a = simulate(&psf, &clean).unwrap();
        let mut dirty = small(5);
        dirty.bad_column = Some(a.cols.start + 7);
        let b = simulate(&psf, &dirty).unwrap();
        assert!(b.ncosmic > 0);
        let column = a.cols.start + 7;
        let mut ncosmic_pixels = 0;
        for (i, _) in a.image.indexed_iter() {
            let (row, col) = i;
            let inside = a.rows.contains(&row) && a.cols.contains(&col);
            if col == column {
                assert_eq!(b.mask[i] & MASK_BAD, MASK_BAD);
                assert_eq!(b.ivar[i], 0.0);
            }
            if b.mask[i] & MASK_COSMIC != 0 {
                assert!(inside);
                assert_eq!(b.ivar[i], 0.0);
                assert!(b.image[i] - a.image[i] >= 149.0);
                ncosmic_pixels += 1;
            } else if col != column {
                assert_eq!(
                    (a.image[i], a.ivar[i], a.mask[i]),
                    (b.image[i], b.ivar[i], b.mask[i])
                );
            }
        }
        assert!(
            ncosmic_pixels >= 2 * b.ncosmic,
            "{ncosmic_pixels} pixels for {} tracks",
            b.ncosmic
        );
    }

    #[test]
    fn written_files_read_back() {
        let psf = psf_a();
        let mut o = small(11);
        o.bad_column = Some(2000);
        let s = simulate(&psf, &o).unwrap();
        let dir = tempfile::tempdir().unwrap();
        let image_path = dir.path().join("preproc.fits");
        let truth_path = dir.path().join("truth.fits");
        s.write(&image_path, &truth_path).unwrap();
        let names: Vec<_> = std::fs::read_dir(dir.path())
            .unwrap()
            .map(|e| e.unwrap().file_name())
            .collect();
        assert_eq!(names.len(), 2, "{names:?}");

        let mut f = Fits::open(&image_path).unwrap();
        for (name, _) in [("IMAGE", 0), ("IVAR", 1), ("MASK", 2)] {
            f.move_to(name).unwrap();
            assert_eq!(f.image_shape().unwrap(), vec![psf.npix_y, psf.npix_x]);
        }
        f.move_to("IMAGE").unwrap();
        assert_eq!(f.key_str("CAMERA").unwrap().as_deref(), Some("r0"));
        assert_eq!(f.key_i64("SIMSEED").unwrap(), Some(11));
        // what desispec's read_image, Frame.vet() and the barycentric correction read
        assert_eq!(f.key_str("FLAVOR").unwrap().as_deref(), Some("science"));
        assert_eq!(f.key_str("OBSTYPE").unwrap().as_deref(), Some("SCIENCE"));
        for key in ["NIGHT", "EXPID", "TILEID"] {
            assert!(f.key_i64(key).unwrap().is_some(), "{key}");
        }
        for key in [
            "MJD-OBS", "EXPTIME", "TARGTRA", "TARGTDEC", "SKYRA", "TELDEC",
        ] {
            assert!(f.key_f64(key).unwrap().is_some(), "{key}");
        }
        for amp in ["A", "B", "C", "D"] {
            assert_eq!(f.key_f64(&format!("OBSRDN{amp}")).unwrap(), Some(3.0));
            assert!(f.key_str(&format!("CCDSEC{amp}")).unwrap().is_some());
        }
        assert_eq!(
            f.key_str("CCDSECD").unwrap().as_deref(),
            Some(
                format!(
                    "[{}:{},{}:{}]",
                    psf.npix_x / 2 + 1,
                    psf.npix_x,
                    psf.npix_y / 2 + 1,
                    psf.npix_y
                )
                .as_str()
            )
        );
        assert_eq!(
            f.key_str("SIMPSF").unwrap().as_deref(),
            Some("psf-r0-00067784.fits")
        );
        let (_, image) = f.read_image::<f32>().unwrap();
        assert_eq!(image, s.image.as_slice().unwrap());
        f.move_to("MASK").unwrap();
        assert_eq!(f.read_image::<i32>().unwrap().1, s.mask.as_slice().unwrap());
        f.move_to("READNOISE").unwrap();
        let (shape, readnoise) = f.read_image::<f32>().unwrap();
        assert_eq!(shape, vec![psf.npix_y, psf.npix_x]);
        assert!(readnoise.iter().all(|&r| r == 3.0));
        assert!(f.verify_checksums().unwrap().iter().all(|&c| c == (1, 1)));
        f.move_to("FIBERMAP").unwrap();
        assert_eq!(f.nrows().unwrap(), psf.nfiber);
        let (_, fiber) = f.column::<i32>("FIBER").unwrap();
        assert_eq!(fiber, (0..psf.nfiber as i32).collect::<Vec<_>>());
        let (_, targetid) = f.column::<i64>("TARGETID").unwrap();
        let mut unique = targetid.clone();
        unique.sort_unstable();
        unique.dedup();
        assert_eq!(unique.len(), psf.nfiber, "TARGETIDs are unique");
        // every column of desispec's empty_fibermap, in its order
        let cards = f.cards().unwrap();
        let ttypes: Vec<String> = cards
            .iter()
            .filter(|c| c.starts_with("TTYPE"))
            .map(|c| c.split('\'').nth(1).unwrap().trim().to_string())
            .collect();
        let expected: Vec<&str> = FIBERMAP_COLUMNS.iter().map(|c| c.0).collect();
        assert_eq!(ttypes, expected);
        let (_, ra) = f.column::<f64>("TARGET_RA").unwrap();
        assert!(ra.iter().all(|r| (r - 100.0).abs() < 2.0));
        let objtype = f.column_str("OBJTYPE").unwrap();
        let expected: Vec<&str> = s.objtype.iter().map(|t| t.as_str()).collect();
        assert_eq!(objtype, expected);

        let mut t = Fits::open(&truth_path).unwrap();
        t.move_to_primary().unwrap();
        assert_eq!(t.key_i64("FIBERMIN").unwrap(), Some(10));
        t.move_to("WAVELENGTH").unwrap();
        assert_eq!(
            t.read_image::<f64>().unwrap(),
            (vec![s.wave.len()], s.wave.clone())
        );
        t.move_to("FLUX").unwrap();
        assert_eq!(t.key_i64("FIBERMIN").unwrap(), Some(10));
        assert_eq!(
            t.read_image::<f64>().unwrap(),
            (vec![4, s.wave.len()], s.flux.clone())
        );

        // The extraction's reader accepts it and masks what the simulation masked.
        let img = Image::read(&image_path, MaskRule::AnyBit).unwrap();
        assert_eq!((img.nrows, img.ncols), (psf.npix_y, psf.npix_x));
        let nmasked = s.mask.iter().filter(|&&m| m != 0).count();
        assert_eq!(img.nmasked, nmasked);
        assert!(img.has_fibermap);
    }

    #[test]
    fn failed_write_leaves_nothing() {
        let psf = psf_a();
        let mut o = small(2);
        o.fibers = 0..1;
        o.wmax = 6260.0;
        let s = simulate(&psf, &o).unwrap();
        let dir = tempfile::tempdir().unwrap();
        let image_path = dir.path().join("preproc.fits");
        let truth_path = dir.path().join("missing").join("truth.fits");
        assert!(s.write(&image_path, &truth_path).is_err());
        assert_eq!(std::fs::read_dir(dir.path()).unwrap().count(), 0);
        assert!(matches!(
            s.write(&image_path, &image_path),
            Err(Error::Config(_))
        ));
    }

    type Change = Box<dyn Fn(&mut SimulateOptions)>;

    #[test]
    fn invalid_options_are_rejected() {
        let psf = psf_a();
        let (lo, hi) = psf.wave_domain();
        let base = SimulateOptions::new(0..5, 6000.0, 6100.0);
        let cases: Vec<(&str, Change)> = vec![
            ("below the domain", Box::new(move |o| o.wmin = lo - 10.0)),
            ("above the domain", Box::new(move |o| o.wmax = hi + 10.0)),
            (
                "reversed range",
                Box::new(|o| (o.wmin, o.wmax) = (6100.0, 6000.0)),
            ),
            ("NaN", Box::new(|o| o.wmin = f64::NAN)),
            ("zero step", Box::new(|o| o.dw = 0.0)),
            ("negative step", Box::new(|o| o.dw = -0.8)),
            ("fibers beyond the PSF", Box::new(|o| o.fibers = 498..501)),
            ("no fibers", Box::new(|o| o.fibers = 3..3)),
            ("negative read noise", Box::new(|o| o.read_noise = -1.0)),
            (
                "negative cosmic density",
                Box::new(|o| o.cosmic_density = -1.0),
            ),
            ("sky fraction", Box::new(|o| o.sky_fraction = 1.5)),
            ("bad column", Box::new(|o| o.bad_column = Some(5000))),
            ("nothing", Box::new(|o| (o.sky, o.objects) = (false, false))),
        ];
        for (what, change) in cases {
            let mut o = base.clone();
            change(&mut o);
            match simulate(&psf, &o) {
                Err(Error::Config(message)) => assert!(!message.is_empty()),
                other => panic!(
                    "{what}: expected a configuration error, got {:?}",
                    other.map(|s| s.fibers)
                ),
            }
        }
        // The whole domain is fine.
        let mut o = SimulateOptions::new(0..1, lo, hi);
        o.dw = 20.0;
        assert!(simulate(&psf, &o).is_ok());
    }
}
