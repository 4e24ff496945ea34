//! The extracted frame: stitching patch results into `[fiber, wave]` arrays, conversion to
//! photons per Angstrom, the desispec mask bits, and the FITS file (desispec `frame-*.fits`
//! layout) read and written atomically.

use std::path::{Path, PathBuf};

use rayon::prelude::*;

use crate::error::{Error, Result};
use crate::extract::{PatchResult, PatchStatus};
use crate::fits::Fits;
use crate::output::write_atomically;
use crate::plan::Plan;

/// desispec `specmask` bits set by extraction.
pub mod specmask {
    /// Some input pixels of the bin were masked (pixmask_fraction > 0.5).
    pub const SOMEBADPIX: i32 = 1 << 0;
    /// All input pixels of the bin were masked.
    pub const ALLBADPIX: i32 = 1 << 1;
    /// The 2-D model fits badly (chi2pix outlier).
    pub const BAD2DFIT: i32 = 1 << 7;
}

/// chi2pix above this multiple of both its medians (over fibers and over wavelengths) flags
/// BAD2DFIT.
pub const BAD2DFIT_FACTOR: f64 = 5.0;

/// An extracted frame in memory.
#[derive(Clone, Debug, PartialEq)]
pub struct Frame {
    pub specmin: usize,
    pub nspec: usize,
    pub wave: Vec<f64>,
    /// Resolution diagonals on each side.
    pub ndiag: usize,
    /// `[fiber][wave]`, photons per Angstrom.
    pub flux: Vec<f64>,
    pub ivar: Vec<f64>,
    pub mask: Vec<i32>,
    /// `[fiber][2 ndiag + 1][wave]`.
    pub resolution: Vec<f64>,
    pub chi2pix: Vec<f64>,
    /// Not written to the file; kept for the mask and for tests.
    pub pixmask_fraction: Vec<f64>,
}

/// Counts of patch outcomes, for the log.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct PatchCounts {
    pub ok: usize,
    pub regularized: usize,
    pub eigen_fallback: usize,
    pub masked: usize,
    pub off_image: usize,
    pub non_finite: usize,
}

impl PatchCounts {
    pub fn total(&self) -> usize {
        self.ok
            + self.regularized
            + self.eigen_fallback
            + self.masked
            + self.off_image
            + self.non_finite
    }
}

impl Frame {
    /// Number of output bins.
    pub fn nwave(&self) -> usize {
        self.wave.len()
    }

    /// Stitches patch results (in any order) into a frame, converts to photons per Angstrom
    /// and sets the mask. Every patch of the plan must be present exactly once.
    pub fn assemble(
        plan: &Plan,
        ndiag: usize,
        results: &[PatchResult],
    ) -> Result<(Frame, PatchCounts)> {
        let nspec = plan.options.nspec;
        let specmin = plan.options.specmin;
        let nwave = plan.nwave();
        let nd = 2 * ndiag + 1;
        let mut frame = Frame {
            specmin,
            nspec,
            wave: plan.wave.clone(),
            ndiag,
            flux: vec![0.0; nspec * nwave],
            ivar: vec![0.0; nspec * nwave],
            mask: vec![0; nspec * nwave],
            resolution: vec![0.0; nspec * nd * nwave],
            chi2pix: vec![0.0; nspec * nwave],
            pixmask_fraction: vec![0.0; nspec * nwave],
        };
        let mut seen = vec![false; plan.patches.len()];
        let mut counts = PatchCounts::default();
        for r in results {
            let patch = plan
                .patches
                .get(r.patch)
                .ok_or_else(|| Error::config(format!("result for unknown patch {}", r.patch)))?;
            if std::mem::replace(&mut seen[r.patch], true) {
                return Err(Error::config(format!("patch {} solved twice", r.patch)));
            }
            if r.nfiber != patch.fibers.len() || r.nwave != patch.waves.len() || r.ndiag != ndiag {
                return Err(Error::config(format!(
                    "patch {} result has the wrong shape",
                    r.patch
                )));
            }
            match r.status {
                PatchStatus::Ok => counts.ok += 1,
                PatchStatus::Regularized => counts.regularized += 1,
                PatchStatus::EigenFallback => counts.eigen_fallback += 1,
                PatchStatus::Masked => counts.masked += 1,
                PatchStatus::OffImage => counts.off_image += 1,
                PatchStatus::NonFinite => counts.non_finite += 1,
            }
            let nk = r.nwave;
            for (c, fiber) in patch.fibers.clone().enumerate() {
                let f = fiber - specmin;
                let dst = f * nwave + patch.waves.start;
                let src = c * nk;
                frame.flux[dst..dst + nk].copy_from_slice(&r.flux[src..src + nk]);
                frame.ivar[dst..dst + nk].copy_from_slice(&r.ivar[src..src + nk]);
                frame.chi2pix[dst..dst + nk].copy_from_slice(&r.chi2pix[src..src + nk]);
                frame.pixmask_fraction[dst..dst + nk]
                    .copy_from_slice(&r.pixmask_fraction[src..src + nk]);
                for k in 0..nd {
                    let dst = (f * nd + k) * nwave + patch.waves.start;
                    let src = (c * nd + k) * nk;
                    frame.resolution[dst..dst + nk].copy_from_slice(&r.resolution[src..src + nk]);
                }
            }
        }
        if let Some(missing) = seen.iter().position(|s| !s) {
            return Err(Error::config(format!(
                "patch {missing} (fibers {:?}, bins {:?}) has no result",
                plan.patches[missing].fibers, plan.patches[missing].waves
            )));
        }
        frame.convert_to_per_angstrom();
        frame.set_mask();
        Ok((frame, counts))
    }

    /// flux /= dw, ivar *= dw^2 with dw the gradient of the output grid.
    fn convert_to_per_angstrom(&mut self) {
        let dw = gradient(&self.wave);
        let nwave = self.nwave();
        for f in 0..self.nspec {
            for (j, &d) in dw.iter().enumerate() {
                self.flux[f * nwave + j] /= d;
                self.ivar[f * nwave + j] *= d * d;
            }
        }
    }

    /// SOMEBADPIX, ALLBADPIX and BAD2DFIT.
    fn set_mask(&mut self) {
        let nwave = self.nwave();
        let median_over_fibers: Vec<f64> = (0..nwave)
            .into_par_iter()
            .map(|j| {
                median(
                    (0..self.nspec)
                        .map(|f| self.chi2pix[f * nwave + j])
                        .collect(),
                )
            })
            .collect();
        let median_over_waves: Vec<f64> = (0..self.nspec)
            .into_par_iter()
            .map(|f| median(self.chi2pix[f * nwave..(f + 1) * nwave].to_vec()))
            .collect();
        for f in 0..self.nspec {
            for j in 0..nwave {
                let i = f * nwave + j;
                let mut m = 0;
                if self.pixmask_fraction[i] > 0.5 {
                    m |= specmask::SOMEBADPIX;
                }
                if self.pixmask_fraction[i] >= 1.0 - 1e-12 {
                    m |= specmask::ALLBADPIX;
                }
                let c = self.chi2pix[i];
                if c > BAD2DFIT_FACTOR * median_over_fibers[j]
                    && c > BAD2DFIT_FACTOR * median_over_waves[f]
                {
                    m |= specmask::BAD2DFIT;
                }
                self.mask[i] = m;
            }
        }
    }

    /// Writes the frame atomically: a temporary file in the same directory, renamed into place
    /// only when complete. `meta` supplies the header and the FIBERMAP source.
    pub fn write(&self, path: &Path, meta: &FrameMeta) -> Result<()> {
        write_atomically(path, |tmp| self.write_to(tmp, meta))
    }

    fn write_to(&self, path: &Path, meta: &FrameMeta) -> Result<()> {
        let mut fits = Fits::create(path)?;
        let (ns, nw, nd) = (self.nspec, self.nwave(), 2 * self.ndiag + 1);
        let f32s = |v: &[f64]| v.iter().map(|&x| x as f32).collect::<Vec<f32>>();

        fits.write_image("FLUX", &[ns, nw], &f32s(&self.flux))?;
        for card in &meta.header {
            fits.write_card(card)?;
        }
        fits.write_key_i64("NSPEC", ns as i64, "number of spectra")?;
        fits.write_key_i64("SPECMIN", self.specmin as i64, "first spectrum")?;
        fits.write_key_f64("WAVEMIN", self.wave[0], "first wavelength [Angstrom]")?;
        fits.write_key_f64("WAVEMAX", self.wave[nw - 1], "last wavelength [Angstrom]")?;
        fits.write_key_f64(
            "WAVESTEP",
            gradient(&self.wave)[0],
            "wavelength step [Angstrom]",
        )?;
        fits.write_key_str("BUNIT", "electron/Angstrom", "")?;
        fits.write_key_str("SPEXVER", env!("CARGO_PKG_VERSION"), "spex version")?;
        if let Some(p) = &meta.input {
            fits.write_key_str("IN_IMG", &file_name(p), "input preproc image")?;
        }
        if let Some(p) = &meta.psf {
            fits.write_key_str("IN_PSF", &file_name(p), "input PSF")?;
        }
        fits.write_image("IVAR", &[ns, nw], &f32s(&self.ivar))?;
        fits.write_key_str("BUNIT", "Angstrom^2/electron^2", "")?;
        fits.write_image("MASK", &[ns, nw], &self.mask)?;
        fits.write_image("WAVELENGTH", &[nw], &self.wave)?;
        fits.write_key_str("BUNIT", "Angstrom", "")?;
        fits.write_image("RESOLUTION", &[ns, nd, nw], &f32s(&self.resolution))?;
        if let Some(src) = &meta.fibermap_from {
            let mut input = Fits::open(src)?;
            fits.copy_table(
                &mut input,
                "FIBERMAP",
                Some(self.specmin..self.specmin + ns),
            )?;
        }
        fits.write_image("CHI2PIX", &[ns, nw], &f32s(&self.chi2pix))?;
        fits.close()
    }

    /// Reads a frame written by spex, gpu_specter or desispec (FLUX, IVAR, MASK, WAVELENGTH,
    /// RESOLUTION; CHI2PIX if present).
    pub fn read(path: &Path) -> Result<Frame> {
        let mut fits = Fits::open(path)?;
        fits.move_to("FLUX")?;
        let specmin = fits.key_i64("SPECMIN")?.unwrap_or(0).max(0) as usize;
        let (shape, flux) = fits.read_image::<f64>()?;
        if shape.len() != 2 {
            return Err(fits.error("FLUX", format!("shape {shape:?} is not [nspec, nwave]")));
        }
        let (nspec, nwave) = (shape[0], shape[1]);
        let read = |fits: &mut Fits, name: &str, want: &[usize]| -> Result<Vec<f64>> {
            fits.move_to(name)?;
            let (s, v) = fits.read_image::<f64>()?;
            if s != want {
                return Err(fits.error(name, format!("shape {s:?}, expected {want:?}")));
            }
            Ok(v)
        };
        let ivar = read(&mut fits, "IVAR", &[nspec, nwave])?;
        let wave = read(&mut fits, "WAVELENGTH", &[nwave])?;
        let mask: Vec<i32> = read(&mut fits, "MASK", &[nspec, nwave])?
            .into_iter()
            .map(|m| m as i32)
            .collect();
        fits.move_to("RESOLUTION")?;
        let (rs, resolution) = fits.read_image::<f64>()?;
        if rs.len() != 3 || rs[0] != nspec || rs[2] != nwave || rs[1] % 2 == 0 {
            return Err(fits.error("RESOLUTION", format!("shape {rs:?} does not match FLUX")));
        }
        let chi2pix = if fits.has_hdu("CHI2PIX") {
            read(&mut fits, "CHI2PIX", &[nspec, nwave])?
        } else {
            vec![0.0; nspec * nwave]
        };
        Ok(Frame {
            specmin,
            nspec,
            ndiag: rs[1] / 2,
            wave,
            flux,
            ivar,
            mask,
            resolution,
            chi2pix,
            pixmask_fraction: vec![0.0; nspec * nwave],
        })
    }
}

/// What the output file carries besides the arrays.
#[derive(Clone, Debug, Default)]
pub struct FrameMeta {
    /// Header cards of the input IMAGE, copied into FLUX.
    pub header: Vec<String>,
    pub input: Option<PathBuf>,
    pub psf: Option<PathBuf>,
    /// File whose FIBERMAP is copied (rows of the extracted fibers), if it has one.
    pub fibermap_from: Option<PathBuf>,
}

/// Writes a model image (`-m`): a CCD-sized f32 image named MODEL with the input's header.
pub fn write_model(
    path: &Path,
    shape: (usize, usize),
    model: &[f64],
    header: &[String],
) -> Result<()> {
    write_atomically(path, |tmp| {
        let mut fits = Fits::create(tmp)?;
        let data: Vec<f32> = model.iter().map(|&v| v as f32).collect();
        fits.write_image("MODEL", &[shape.0, shape.1], &data)?;
        for card in header {
            fits.write_card(card)?;
        }
        fits.close()
    })
}

fn file_name(p: &Path) -> String {
    p.file_name()
        .map(|s| s.to_string_lossy().into_owned())
        .unwrap_or_default()
}

/// numpy's `gradient` of a 1-D grid (one-sided at the ends).
pub fn gradient(x: &[f64]) -> Vec<f64> {
    let n = x.len();
    if n < 2 {
        return vec![1.0; n];
    }
    (0..n)
        .map(|i| {
            if i == 0 {
                x[1] - x[0]
            } else if i == n - 1 {
                x[n - 1] - x[n - 2]
            } else {
                (x[i + 1] - x[i - 1]) / 2.0
            }
        })
        .collect()
}

/// Median (mean of the two middle values for an even count); 0 for no values. Selection
/// instead of a full sort: the mask needs one median per fiber and per wavelength bin.
pub fn median(mut v: Vec<f64>) -> f64 {
    let n = v.len();
    if n == 0 {
        return 0.0;
    }
    let (lower, &mut upper, _) = v.select_nth_unstable_by(n / 2, |a, b| a.total_cmp(b));
    if n % 2 == 1 {
        upper
    } else {
        let below = lower.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
        0.5 * (below + upper)
    }
}

/// Sums patch model images into a CCD-sized image.
pub fn model_image(shape: (usize, usize), results: &[PatchResult]) -> Vec<f64> {
    let mut image = vec![0.0; shape.0 * shape.1];
    for m in results.iter().filter_map(|r| r.model.as_ref()) {
        let w = m.cols.len();
        for (i, r) in m.rows.clone().enumerate() {
            let row = &mut image[r * shape.1 + m.cols.start..r * shape.1 + m.cols.end];
            for (dst, src) in row.iter_mut().zip(&m.data[i * w..(i + 1) * w]) {
                *dst += src;
            }
        }
    }
    image
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn median_of_odd_even_and_empty() {
        assert_eq!(median(vec![3.0, 1.0, 2.0]), 2.0);
        assert_eq!(median(vec![4.0, 1.0, 3.0, 2.0]), 2.5);
        assert_eq!(median(vec![5.0]), 5.0);
        assert_eq!(median(vec![]), 0.0);
    }

    #[test]
    fn gradient_is_one_sided_at_the_ends() {
        assert_eq!(gradient(&[1.0, 2.0, 4.0, 7.0]), vec![1.0, 1.5, 2.5, 3.0]);
    }
}
