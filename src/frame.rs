//! The extracted frame: stitching patch results into `[fiber, wave]` arrays, conversion to
//! photons per Angstrom, the desispec mask bits, and the FITS file (desispec `frame-*.fits`
//! layout) read and written atomically.

use std::ops::Range;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use ndarray::{s, Array, Array1, Array2, Array3, ArrayView2, Dimension, ShapeBuilder, Zip};

use crate::error::{Error, Result};
use crate::extract::{PatchResult, PatchStatus};
use crate::fits::Fits;
use crate::output::write_atomically;
use crate::plan::Plan;

mod header;
mod mask;
mod values;

pub use header::shorten_filename;
pub use mask::{specmask, Bad2dfit, BAD2DFIT_CHI2PIX};
pub use values::{FiberRows, FrameValues, PatchRow};

/// An extracted frame in memory.
#[derive(Clone, Debug, PartialEq)]
pub struct Frame {
    pub specmin: usize,
    /// Whether `specmin` is known: false for a file that records neither SPECMIN nor
    /// FIBERMIN (gpu_specter's frames), whose `specmin` then reads as 0.
    pub specmin_recorded: bool,
    pub nspec: usize,
    pub wave: Vec<f64>,
    /// Resolution diagonals on each side.
    pub ndiag: usize,
    /// `[fiber, wave]`, photons per Angstrom.
    pub flux: Array2<f64>,
    pub ivar: Array2<f64>,
    /// desispec specmask bits `[fiber, wave]`, written as uint32 like desispec's.
    pub mask: Array2<u32>,
    /// `[fiber, diagonal, wave]`, `2 ndiag + 1` diagonals.
    pub resolution: Array3<f64>,
    pub chi2pix: Array2<f64>,
    /// `[fiber, wave]`; not written to the file, kept for the mask and for tests.
    pub pixmask_fraction: Array2<f64>,
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

    /// `(first, last, step)` of the frame's own grid, for frames written without a requested
    /// grid.
    pub fn grid(&self) -> (f64, f64, f64) {
        let n = self.nwave();
        let step = if n > 1 {
            self.wave[1] - self.wave[0]
        } else {
            1.0
        };
        (self.wave[0], self.wave[n - 1], step)
    }

    /// Stitches patch results (in any order) into a frame, converts to photons per Angstrom
    /// and sets the mask. Every patch of the plan must be present exactly once.
    pub fn assemble(
        plan: &Plan,
        ndiag: usize,
        results: &[PatchResult],
    ) -> Result<(Frame, PatchCounts)> {
        Frame::assemble_with(plan, ndiag, results, None)
    }

    /// [`Frame::assemble`] into the frame's arrays `values` that the backend was given, where it
    /// may have placed the values of some results (those [`PatchResult::placed`]): the other
    /// results are stitched into them. A placed result without those arrays is an error.
    pub fn assemble_with(
        plan: &Plan,
        ndiag: usize,
        results: &[PatchResult],
        values: Option<FrameValues>,
    ) -> Result<(Frame, PatchCounts)> {
        let has_values = values.is_some();
        let mut values = match values {
            Some(v) => {
                v.check(plan, ndiag)?;
                v
            }
            None => FrameValues::zeros(plan, ndiag),
        };
        let (counts, by_fiber) = check_results(plan, ndiag, results, has_values)?;
        let nd = 2 * ndiag + 1;
        let specmin = values.specmin;
        // Each fiber's row of every array is filled by one task, from the patches covering it.
        values.par_rows(|f, mut rows| {
            for &i in &by_fiber[f] {
                let (r, patch) = (&results[i], &plan.patches[results[i].patch]);
                if !r.placed {
                    let local = specmin + f - patch.fibers.start;
                    rows.put(patch.waves.start, r.nwave, &r.row(local, nd));
                }
            }
        });
        let mut frame = Frame {
            specmin,
            specmin_recorded: true,
            nspec: plan.options.nspec,
            wave: plan.wave.clone(),
            ndiag,
            flux: values.flux,
            ivar: values.ivar,
            mask: Array2::zeros((plan.options.nspec, plan.nwave())),
            resolution: values.resolution,
            chi2pix: values.chi2pix,
            pixmask_fraction: values.pixmask_fraction,
        };
        frame.convert_to_per_angstrom(plan.options.dw);
        frame.set_mask(Bad2dfit::default());
        Ok((frame, counts))
    }

    /// flux /= dw, ivar *= dw^2 with dw the gradient of the output grid, or the grid's `step`
    /// for a grid of one bin (whose gradient is not defined: numpy's raises).
    fn convert_to_per_angstrom(&mut self, step: f64) {
        let dw = match self.nwave() {
            1 => Array1::from(vec![step]),
            _ => Array1::from(gradient(&self.wave)),
        };
        // dw broadcasts along the wavelength axis, the last one.
        self.flux /= &dw;
        self.ivar *= &dw.mapv(|d| d * d);
    }

    /// About the bytes of the file [`Frame::write`] makes of `plan`'s frame with `ndiag`
    /// diagonals each side: its arrays, and a megabyte for the tables and headers.
    pub fn file_bytes(plan: &Plan, ndiag: usize) -> usize {
        let (nspec, nwave) = (plan.options.nspec, plan.nwave());
        // FLUX, IVAR, MASK and CHI2PIX, RESOLUTION (4 bytes a value), WAVELENGTH (8)
        4 * nspec * nwave * (4 + 2 * ndiag + 1) + 8 * nwave + (1 << 20)
    }

    /// Writes the frame atomically: a temporary file in the same directory, renamed into place
    /// only when complete. `meta` supplies the header and the FIBERMAP source. A frame with a
    /// non-finite FLUX, IVAR or RESOLUTION value (after conversion to float32) is refused
    /// before anything is written: downstream steps would silently propagate it. CHI2PIX, a
    /// goodness of fit, saturates at float32's largest value instead of overflowing to
    /// infinity (a pixel of 1e25 with no PSF error gives 1e50); such a bin has BAD2DFIT.
    pub fn write(&self, path: &Path, meta: &FrameMeta) -> Result<()> {
        let t0 = std::time::Instant::now();
        let flux = f32s(&self.flux);
        let ivar = f32s(&self.ivar);
        let resolution = f32s(&self.resolution);
        let chi2pix = Zip::from(&self.chi2pix).par_map_collect(|&x| match x.is_nan() {
            true => f32::NAN,
            false => x.min(f32::MAX as f64) as f32,
        });
        self.check_finite(path, &[&flux, &ivar, &chi2pix])?;
        self.check_finite_resolution(path, &resolution)?;
        // With the lines of `fits`, these split a frame's write in the debug log.
        tracing::debug!(
            "{}: arrays converted in {:.3} s",
            path.display(),
            t0.elapsed().as_secs_f64()
        );
        write_atomically(path, |tmp| {
            self.write_to(tmp, meta, [&flux, &ivar, &chi2pix], &resolution)
        })
    }

    /// The error for the first non-finite value of `arrays` (`[fiber, bin]` each), with the
    /// count of them all.
    fn check_finite(&self, path: &Path, arrays: &[&Array2<f32>]) -> Result<()> {
        if arrays.iter().all(|v| all_finite(v)) {
            return Ok(());
        }
        let count: usize = arrays
            .iter()
            .map(|v| v.iter().filter(|x| !x.is_finite()).count())
            .sum();
        // the first bin, in (fiber, bin) order, where any of the arrays is not finite
        let (fiber, bin) = arrays
            .iter()
            .filter_map(|v| v.indexed_iter().find(|(_, x)| !x.is_finite()))
            .map(|(first, _)| first)
            .min()
            .unwrap_or((0, 0));
        Err(Error::NonFiniteFrame {
            path: path.into(),
            count,
            fiber: self.specmin + fiber,
            bin,
        })
    }

    /// [`Frame::check_finite`] of the `[fiber, diagonal, bin]` RESOLUTION.
    fn check_finite_resolution(&self, path: &Path, resolution: &Array3<f32>) -> Result<()> {
        if all_finite(resolution) {
            return Ok(());
        }
        let count = resolution.iter().filter(|x| !x.is_finite()).count();
        match resolution.indexed_iter().find(|(_, x)| !x.is_finite()) {
            None => Ok(()),
            Some(((fiber, _, bin), _)) => Err(Error::NonFiniteFrame {
                path: path.into(),
                count,
                fiber: self.specmin + fiber,
                bin,
            }),
        }
    }

    fn write_to(
        &self,
        path: &Path,
        meta: &FrameMeta,
        [flux, ivar, chi2pix]: [&Array2<f32>; 3],
        resolution: &Array3<f32>,
    ) -> Result<()> {
        let (ns, nw) = (self.nspec, self.nwave());
        let wave = meta.output_wave(self)?;
        let fibermap = meta.fibermap_rows(self.specmin..self.specmin + ns)?;
        let fibermin = fibermap
            .as_ref()
            .and_then(|(_, fibers)| fibers.iter().copied().min())
            .unwrap_or(self.specmin as i64);

        let t0 = std::time::Instant::now();
        let mut fits = Fits::create(path)?;
        fits.reserve_checksums();
        let bunit = |unit: &'static str| move |f: &mut Fits| f.write_key_str("BUNIT", unit, "");
        fits.write_array_with("FLUX", flux.view(), |f| {
            meta.write_header(f, self, fibermin)?;
            bunit("electron/Angstrom")(f)
        })?;
        fits.write_array_with("IVAR", ivar.view(), bunit("Angstrom^2/electron^2"))?;
        fits.write_array("MASK", self.mask.view())?;
        fits.write_image_with("WAVELENGTH", &[nw], &wave, bunit("Angstrom"))?;
        fits.write_array("RESOLUTION", resolution.view())?;
        if let Some((src, _)) = &fibermap {
            let mut input = Fits::open_part(src, "FIBERMAP")?;
            fits.copy_table(
                &mut input,
                "FIBERMAP",
                Some(self.specmin..self.specmin + ns),
            )?;
        }
        fits.write_array("CHI2PIX", chi2pix.view())?;
        for hdu in &meta.extra_hdus {
            hdu.write(&mut fits, self)?;
        }
        fits.write_checksums()?;
        tracing::debug!(
            "{}: HDUs and checksums in memory in {:.3} s",
            path.display(),
            t0.elapsed().as_secs_f64()
        );
        fits.close()
    }

    /// Reads a frame written by spex, gpu_specter or desispec (FLUX, IVAR, MASK, WAVELENGTH,
    /// RESOLUTION; CHI2PIX if present).
    pub fn read(path: &Path) -> Result<Frame> {
        let mut fits = Fits::open(path)?;
        fits.move_to("FLUX")?;
        let recorded = match fits.key_i64("SPECMIN")? {
            Some(v) => Some(v),
            None => fits.key_i64("FIBERMIN")?,
        };
        let specmin = recorded.unwrap_or(0).max(0) as usize;
        let (shape, flux) = fits.read_image::<f64>()?;
        if shape.len() != 2 {
            return Err(fits.error("FLUX", format!("shape {shape:?} is not [nspec, nwave]")));
        }
        let (nspec, nwave) = (shape[0], shape[1]);
        let flux = shaped(&fits, "FLUX", (nspec, nwave), flux)?;
        let read = |fits: &mut Fits, name: &str| -> Result<Array2<f64>> {
            fits.move_to(name)?;
            let (s, v) = fits.read_image::<f64>()?;
            if s != [nspec, nwave] {
                return Err(fits.error(name, format!("shape {s:?}, expected [{nspec}, {nwave}]")));
            }
            shaped(fits, name, (nspec, nwave), v)
        };
        let ivar = read(&mut fits, "IVAR")?;
        fits.move_to("WAVELENGTH")?;
        let (ws, wave) = fits.read_image::<f64>()?;
        if ws != [nwave] {
            return Err(fits.error("WAVELENGTH", format!("shape {ws:?}, expected [{nwave}]")));
        }
        fits.move_to("MASK")?;
        let (ms, mask) = fits.read_image::<u32>()?;
        if ms != [nspec, nwave] {
            return Err(fits.error("MASK", format!("shape {ms:?}, expected [{nspec}, {nwave}]")));
        }
        let mask = shaped(&fits, "MASK", (nspec, nwave), mask)?;
        fits.move_to("RESOLUTION")?;
        let (rs, resolution) = fits.read_image::<f64>()?;
        if rs.len() != 3 || rs[0] != nspec || rs[2] != nwave || rs[1] % 2 == 0 {
            return Err(fits.error("RESOLUTION", format!("shape {rs:?} does not match FLUX")));
        }
        let resolution = shaped(&fits, "RESOLUTION", (nspec, rs[1], nwave), resolution)?;
        let chi2pix = if fits.has_hdu("CHI2PIX") {
            read(&mut fits, "CHI2PIX")?
        } else {
            Array2::zeros((nspec, nwave))
        };
        Ok(Frame {
            specmin,
            specmin_recorded: recorded.is_some(),
            nspec,
            ndiag: rs[1] / 2,
            wave,
            flux,
            ivar,
            mask,
            resolution,
            chi2pix,
            pixmask_fraction: Array2::zeros((nspec, nwave)),
        })
    }
}

/// The values of an HDU, read in row-major order, as an array of `shape`.
fn shaped<T, Sh: ShapeBuilder<Dim = D>, D: Dimension>(
    fits: &Fits,
    name: &str,
    shape: Sh,
    values: Vec<T>,
) -> Result<Array<T, D>> {
    Array::from_shape_vec(shape, values).map_err(|e| fits.error(name, e.to_string()))
}

/// An HDU appended to the frame after CHI2PIX: desispec puts its SCORES table there.
/// Implementations write one complete HDU into `fits` (positioned after the last HDU).
pub trait ExtraHdu: std::fmt::Debug + Send + Sync {
    fn write(&self, fits: &mut Fits, frame: &Frame) -> Result<()>;
}

/// What the output file carries besides the arrays.
#[derive(Clone, Debug, Default)]
pub struct FrameMeta {
    /// Header cards of the input IMAGE, copied into FLUX (desispec carries the whole preproc
    /// header through, then adds its own keywords).
    pub header: Vec<String>,
    /// The preproc and PSF paths as given: IN_IMG and IN_PSF, shortened as desispec does.
    pub input: Option<PathBuf>,
    pub psf: Option<PathBuf>,
    /// The PSF's own IN_PSF keyword (the PSF it was derived from): ORIG_PSF.
    pub orig_psf: Option<String>,
    /// File whose FIBERMAP is copied (rows of the extracted fibers), if it has one.
    pub fibermap_from: Option<PathBuf>,
    /// The requested grid `wmin, wmax, dw` (before any barycentric correction): WAVEMIN,
    /// WAVEMAX, WAVESTEP exactly as given and WAVELENGTH = numpy's arange of it. `None`: the
    /// frame's own grid.
    pub grid: Option<(f64, f64, f64)>,
    /// Barycentric correction factor applied to the extraction grid, written as HELIOCOR when
    /// it is not 1.
    pub heliocor: Option<f64>,
    /// HDUs appended after CHI2PIX, in order (the SCORES table).
    pub extra_hdus: Vec<Arc<dyn ExtraHdu>>,
}

impl FrameMeta {
    /// The WAVELENGTH array: numpy's arange of the requested grid, which must have as many
    /// bins as the frame (a barycentric factor could change the count by one at an edge).
    pub fn output_wave(&self, frame: &Frame) -> Result<Vec<f64>> {
        let Some((wmin, wmax, dw)) = self.grid else {
            return Ok(frame.wave.clone());
        };
        let wave = crate::plan::output_grid(wmin, wmax, dw);
        if wave.len() != frame.nwave() {
            return Err(Error::config(format!(
                "the requested grid {wmin},{wmax},{dw} has {} bins, the extraction {}",
                wave.len(),
                frame.nwave()
            )));
        }
        Ok(wave)
    }

    /// The FIBERMAP source and the FIBER values of `rows`, when there is a FIBERMAP.
    fn fibermap_rows(&self, rows: Range<usize>) -> Result<Option<(PathBuf, Vec<i64>)>> {
        let Some(src) = &self.fibermap_from else {
            return Ok(None);
        };
        let mut input = Fits::open_part(src, "FIBERMAP")?;
        let (_, fibers) = input.column::<i64>("FIBER")?;
        let fibers = fibers.get(rows.clone()).ok_or_else(|| {
            input.error(
                "FIBER",
                format!("rows {rows:?} requested, the table has {}", fibers.len()),
            )
        })?;
        Ok(Some((src.clone(), fibers.to_vec())))
    }
}

/// Checks that every patch of `plan` has exactly one result of its shape (or placed in the
/// frame's arrays, when they came with the results: `has_values`); the outcome counts, and for
/// each fiber of the frame the results that cover it.
fn check_results(
    plan: &Plan,
    ndiag: usize,
    results: &[PatchResult],
    has_values: bool,
) -> Result<(PatchCounts, Vec<Vec<usize>>)> {
    let specmin = plan.options.specmin;
    let nd = 2 * ndiag + 1;
    let mut seen = vec![false; plan.patches.len()];
    let mut counts = PatchCounts::default();
    let mut by_fiber = vec![Vec::new(); plan.options.nspec];
    for (i, r) in results.iter().enumerate() {
        let patch = plan
            .patches
            .get(r.patch)
            .ok_or_else(|| Error::config(format!("result for unknown patch {}", r.patch)))?;
        if std::mem::replace(&mut seen[r.patch], true) {
            return Err(Error::config(format!("patch {} solved twice", r.patch)));
        }
        if r.placed && !has_values {
            return Err(Error::Internal(format!(
                "patch {}: its values were placed in arrays that did not come with it",
                r.patch
            )));
        }
        let (nf, nw) = (patch.fibers.len(), patch.waves.len());
        let sizes = r.placed
            || [&r.flux, &r.ivar, &r.chi2pix, &r.pixmask_fraction]
                .iter()
                .all(|v| v.len() == nf * nw)
                && r.resolution.len() == nf * nd * nw;
        if r.nfiber != nf || r.nwave != nw || r.ndiag != ndiag || !sizes {
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
        // A patch's sub-bundle may hold fibers outside the frame's range: not kept.
        for f in patch.fibers.clone() {
            if let Some(ids) = f.checked_sub(specmin).and_then(|k| by_fiber.get_mut(k)) {
                ids.push(i);
            }
        }
    }
    if let Some(missing) = seen.iter().position(|s| !s) {
        return Err(Error::config(format!(
            "patch {missing} (fibers {:?}, bins {:?}) has no result",
            plan.patches[missing].fibers, plan.patches[missing].waves
        )));
    }
    Ok((counts, by_fiber))
}

/// Whether every value of `v` is finite, looked at on many cores (the common case of a
/// frame's check: a full frame holds 16 million values). Each value of a chunk is looked at
/// (no early end), so that the test runs in SIMD lanes: one value at a time it took a tenth
/// of a frame's write (`cargo bench --bench frame`).
fn all_finite<D: Dimension>(v: &Array<f32, D>) -> bool {
    use rayon::prelude::*;
    let finite = |c: &[f32]| c.iter().fold(true, |all, x| all & x.is_finite());
    match v.as_slice() {
        Some(values) => values.par_chunks(1 << 16).all(finite),
        None => v.iter().all(|x| x.is_finite()),
    }
}

/// `v` in float32, as written; each value is written once (no zeroing of the copy first).
fn f32s<D: Dimension>(v: &Array<f64, D>) -> Array<f32, D> {
    Zip::from(v).par_map_collect(|&x| x as f32)
}

/// Writes a model image (`-m`) as desi_extract_spectra does: the CCD-sized float64 image in
/// the primary HDU with the frame's header (BUNIT electron: the model is per pixel).
pub fn write_model(
    path: &Path,
    model: ArrayView2<f64>,
    frame: &Frame,
    meta: &FrameMeta,
) -> Result<()> {
    let fibermin = meta
        .fibermap_rows(frame.specmin..frame.specmin + frame.nspec)?
        .and_then(|(_, fibers)| fibers.iter().copied().min())
        .unwrap_or(frame.specmin as i64);
    write_atomically(path, |tmp| {
        let mut fits = Fits::create(tmp)?;
        fits.reserve_checksums();
        fits.write_array_with("MODEL", model, |f| {
            meta.write_header(f, frame, fibermin)?;
            f.write_key_str("BUNIT", "electron", "")
        })?;
        fits.write_checksums()?;
        fits.close()
    })
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

/// The width of each bin of a grid in Angstrom: numpy's `gradient`, or `step` for a grid of
/// one bin, whose gradient is not defined (numpy's raises) and whose width is the step it
/// was built with.
pub fn bin_widths(wave: &[f64], step: f64) -> Vec<f64> {
    match wave.len() {
        1 => vec![step],
        _ => gradient(wave),
    }
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

/// Sums patch model images into a CCD-sized `[row, col]` image.
pub fn model_image(shape: (usize, usize), results: &[PatchResult]) -> Result<Array2<f64>> {
    let mut image = Array2::zeros(shape);
    for m in results.iter().filter_map(|r| r.model.as_ref()) {
        let patch = ArrayView2::from_shape((m.rows.len(), m.cols.len()), &m.data)
            .map_err(|e| Error::Internal(format!("model of a patch: {e}")))?;
        let (rows, cols) = (m.rows.clone(), m.cols.clone());
        if rows.end > shape.0 || cols.end > shape.1 {
            return Err(Error::Internal(format!(
                "patch model box {rows:?} x {cols:?} outside the {shape:?} image"
            )));
        }
        image
            .slice_mut(s![rows, cols])
            .zip_mut_with(&patch, |d, &v| *d += v);
    }
    Ok(image)
}

#[cfg(test)]
mod tests {
    use super::values::tests::numbered_results;
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

    /// Stitches `results` of `plan` and checks where a patch's values went: flux per
    /// Angstrom at its first bin, and resolution diagonals of its first two fibers.
    fn assert_stitched(plan: &Plan, ndiag: usize, results: &[PatchResult]) {
        let (frame, _) = Frame::assemble(plan, ndiag, results).unwrap();
        let nd = 2 * ndiag + 1;
        for p in [&plan.patches[plan.patches.len() / 2], &plan.patches[1]] {
            let (f, w) = (p.fibers.start - plan.options.specmin, p.waves.start);
            let r = &results[p.index];
            let dw = frame.wave[w + 1] - frame.wave[w];
            assert!((frame.flux[[f, w]] - r.flux[0] / dw).abs() < 1e-6 * r.flux[0]);
            let nw = p.waves.len();
            assert_eq!(frame.resolution[[f, 3, w + 1]], r.resolution[3 * nw + 1]);
            assert_eq!(frame.resolution[[f + 1, 2, w]], r.resolution[(nd + 2) * nw]);
        }
    }

    #[test]
    fn each_value_lands_in_its_bin() {
        use crate::plan::PlanOptions;
        let plan = Plan::new(PlanOptions::new(6000.0, 6400.0, 0.8, 25, 50)).unwrap();
        assert_stitched(&plan, 5, &numbered_results(&plan, 5));
    }

    /// Stitching a full r frame's patch results: prints the time of each round (run with
    /// `--ignored --nocapture`) and checks where the values went.
    #[test]
    #[ignore = "a timing: run with --ignored --nocapture"]
    fn assembly_of_a_full_frame() {
        use crate::plan::PlanOptions;
        let plan = Plan::new(PlanOptions::new(5760.0, 7620.0, 0.8, 0, 500)).unwrap();
        let ndiag = 5;
        let results = numbered_results(&plan, ndiag);
        for round in 0..12 {
            let t0 = std::time::Instant::now();
            let (frame, _) = Frame::assemble(&plan, ndiag, &results).unwrap();
            println!("round {round}: {:.1} ms", t0.elapsed().as_secs_f64() * 1e3);
            drop(frame);
        }
        assert_stitched(&plan, ndiag, &results);
    }
}
