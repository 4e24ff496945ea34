//! The extracted frame: stitching patch results into `[fiber, wave]` arrays, conversion to
//! photons per Angstrom, the desispec mask bits, and the FITS file (desispec `frame-*.fits`
//! layout) read and written atomically.

use std::ops::Range;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use ndarray::{
    s, Array, Array1, Array2, Array3, ArrayView1, ArrayView2, ArrayViewMut1, ArrayViewMut2,
    Dimension, ShapeBuilder, Zip,
};

use crate::error::{Error, Result};
use crate::extract::{PatchResult, PatchStatus};
use crate::fits::Fits;
use crate::output::write_atomically;
use crate::plan::Plan;

/// desispec `specmask` bits set by extraction.
pub mod specmask {
    /// Some input pixels of the bin were masked (pixmask_fraction > 0.5).
    pub const SOMEBADPIX: u32 = 1 << 0;
    /// All input pixels of the bin were masked.
    pub const ALLBADPIX: u32 = 1 << 1;
    /// The 2-D model fits badly (chi2pix outlier).
    pub const BAD2DFIT: u32 = 1 << 7;
}

/// chi2pix above this flags BAD2DFIT (desispec 0.70.0's desi_extract_spectra, on both its
/// gpu_specter and specter paths).
pub const BAD2DFIT_CHI2PIX: f64 = 100.0;

/// An extracted frame in memory.
#[derive(Clone, Debug, PartialEq)]
pub struct Frame {
    pub specmin: usize,
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
        let nspec = plan.options.nspec;
        let specmin = plan.options.specmin;
        let nwave = plan.nwave();
        let nd = 2 * ndiag + 1;
        let mut frame = Frame {
            specmin,
            nspec,
            wave: plan.wave.clone(),
            ndiag,
            flux: Array2::zeros((nspec, nwave)),
            ivar: Array2::zeros((nspec, nwave)),
            mask: Array2::zeros((nspec, nwave)),
            resolution: Array3::zeros((nspec, nd, nwave)),
            chi2pix: Array2::zeros((nspec, nwave)),
            pixmask_fraction: Array2::zeros((nspec, nwave)),
        };
        let (counts, by_fiber) = check_results(plan, ndiag, results)?;
        // Each fiber's row of every array is filled by one task, from the patches covering it.
        Zip::indexed(frame.flux.rows_mut())
            .and(frame.ivar.rows_mut())
            .and(frame.chi2pix.rows_mut())
            .and(frame.pixmask_fraction.rows_mut())
            .and(frame.resolution.outer_iter_mut())
            .par_for_each(|f, flux, ivar, chi2, fraction, res| {
                let rows = FiberRows {
                    flux,
                    ivar,
                    chi2,
                    fraction,
                    res,
                };
                rows.fill(specmin + f, plan, &by_fiber[f], results);
            });
        frame.convert_to_per_angstrom(plan.options.dw);
        frame.set_mask();
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

    /// SOMEBADPIX, ALLBADPIX and BAD2DFIT, as desi_extract_spectra sets them.
    fn set_mask(&mut self) {
        let bins = Zip::from(&mut self.mask)
            .and(&self.pixmask_fraction)
            .and(&self.chi2pix);
        bins.for_each(|m, &fraction, &chi2| {
            *m = 0;
            if fraction > 0.5 {
                *m |= specmask::SOMEBADPIX;
            }
            if fraction >= 1.0 - 1e-12 {
                *m |= specmask::ALLBADPIX;
            }
            if chi2 > BAD2DFIT_CHI2PIX {
                *m |= specmask::BAD2DFIT;
            }
        });
    }

    /// Writes the frame atomically: a temporary file in the same directory, renamed into place
    /// only when complete. `meta` supplies the header and the FIBERMAP source. A frame with a
    /// non-finite FLUX, IVAR or RESOLUTION value (after conversion to float32) is refused
    /// before anything is written: downstream steps would silently propagate it. CHI2PIX, a
    /// goodness of fit, saturates at float32's largest value instead of overflowing to
    /// infinity (a pixel of 1e25 with no PSF error gives 1e50); such a bin has BAD2DFIT.
    pub fn write(&self, path: &Path, meta: &FrameMeta) -> Result<()> {
        let flux = f32s(&self.flux);
        let ivar = f32s(&self.ivar);
        let resolution = f32s(&self.resolution);
        let chi2pix = Zip::from(&self.chi2pix).par_map_collect(|&x| match x.is_nan() {
            true => f32::NAN,
            false => x.min(f32::MAX as f64) as f32,
        });
        self.check_finite(path, &[&flux, &ivar, &chi2pix])?;
        self.check_finite_resolution(path, &resolution)?;
        write_atomically(path, |tmp| {
            self.write_to(tmp, meta, [&flux, &ivar, &chi2pix], &resolution)
        })
    }

    /// The error for the first non-finite value of `arrays` (`[fiber, bin]` each), with the
    /// count of them all.
    fn check_finite(&self, path: &Path, arrays: &[&Array2<f32>]) -> Result<()> {
        let count: usize = arrays
            .iter()
            .map(|v| v.iter().filter(|x| !x.is_finite()).count())
            .sum();
        if count == 0 {
            return Ok(());
        }
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
            let mut input = Fits::open(src)?;
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

/// Environment variables whose values desiutil.depend records in DEPNAMnn/DEPVERnn.
const DEPEND_ENVVARS: [&str; 8] = [
    "DESI_ROOT",
    "DESI_SPECTRO_DATA",
    "DESI_SPECTRO_REDUX",
    "SPECPROD",
    "DESI_SPECTRO_CALIB",
    "DESI_BASIS_TEMPLATES",
    "DESI_TARGET",
    "DESIMODEL",
];

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
        let mut input = Fits::open(src)?;
        input.move_to("FIBERMAP")?;
        let (_, fibers) = input.column::<i64>("FIBER")?;
        let fibers = fibers.get(rows.clone()).ok_or_else(|| {
            input.error(
                "FIBER",
                format!("rows {rows:?} requested, the table has {}", fibers.len()),
            )
        })?;
        Ok(Some((src.clone(), fibers.to_vec())))
    }

    /// The header of FLUX (and of the model image): the preproc header, then what
    /// desi_extract_spectra adds, in its order.
    fn write_header(&self, fits: &mut Fits, frame: &Frame, fibermin: i64) -> Result<()> {
        for card in &self.header {
            fits.write_card(card)?;
        }
        if let Some(f) = self.heliocor.filter(|&f| f != 1.0) {
            fits.write_key_f64_exact("HELIOCOR", f, "barycentric correction factor")?;
        }
        let (wmin, wmax, dw) = self.grid.unwrap_or_else(|| frame.grid());
        fits.write_key_i64("NSPEC", frame.nspec as i64, "Number of spectra")?;
        fits.write_key_f64_exact("WAVEMIN", wmin, "First wavelength [Angstroms]")?;
        fits.write_key_f64_exact("WAVEMAX", wmax, "Last wavelength [Angstroms]")?;
        fits.write_key_f64_exact("WAVESTEP", dw, "Wavelength step size [Angstroms]")?;
        let env = |k: &str| std::env::var(k).ok();
        if let Some(p) = &self.psf {
            let name = shorten_filename(&p.to_string_lossy(), &env);
            fits.write_key_long_str("IN_PSF", &name, "Input spectral PSF")?;
        }
        if let Some(p) = &self.input {
            let name = shorten_filename(&p.to_string_lossy(), &env);
            fits.write_key_long_str("IN_IMG", &name, "")?;
        }
        set_dependency(fits, "spex", env!("CARGO_PKG_VERSION"))?;
        for var in DEPEND_ENVVARS {
            set_dependency(fits, var, &env(var).unwrap_or_else(|| "NOT_SET".into()))?;
        }
        if let Some(orig) = &self.orig_psf {
            fits.write_key_long_str("ORIG_PSF", orig, "")?;
        }
        fits.write_key_i64("FIBERMIN", fibermin, "")?;
        fits.write_key_i64("SPECMIN", frame.specmin as i64, "first spectrum")
    }
}

/// desiutil.depend's `setdep`: the version of `name` goes into the DEPVERnn of its DEPNAMnn,
/// or into the first free DEPNAMnn/DEPVERnn pair.
fn set_dependency(fits: &mut Fits, name: &str, version: &str) -> Result<()> {
    for i in 0..100 {
        let (namekey, verkey) = (format!("DEPNAM{i:02}"), format!("DEPVER{i:02}"));
        match fits.key_str(&namekey)? {
            Some(n) if n != name => continue,
            Some(_) => return fits.write_key_long_str(&verkey, version, ""),
            None => {
                fits.write_key_str(&namekey, name, "")?;
                return fits.write_key_long_str(&verkey, version, "");
            }
        }
    }
    Err(fits.error("DEPNAMnn", format!("no free DEPNAMnn keyword for {name}")))
}

/// desispec.io.shorten_filename: a path under `$DESI_SPECTRO_CALIB` becomes `SPCALIB/...`,
/// one under the production directory (`$DESI_SPECTRO_REDUX/$SPECPROD`, or its read-only
/// copy under `$DESI_ROOT_READONLY`) `SPECPROD/...`; anything else is kept as given. `env`
/// looks up environment variables.
pub fn shorten_filename(name: &str, env: &dyn Fn(&str) -> Option<String>) -> String {
    if let Some(calib) = env("DESI_SPECTRO_CALIB") {
        if name.starts_with(&calib) {
            return name.replacen(&calib, "SPCALIB", 1);
        }
    }
    let Some(prod) = specprod_root(env) else {
        return name.to_string();
    };
    for root in [prod.clone(), readonly_path(&prod, env)] {
        if name.starts_with(&root) {
            return name.replacen(&root, "SPECPROD", 1);
        }
    }
    name.to_string()
}

/// desispec.io.specprod_root: `$SPECPROD` if it is a path, else under `$DESI_SPECTRO_REDUX`
/// (or `$DESI_ROOT/spectro/redux`); `None` when the variables are not set.
fn specprod_root(env: &dyn Fn(&str) -> Option<String>) -> Option<String> {
    let specprod = env("SPECPROD")?;
    if specprod.contains('/') {
        return Some(specprod);
    }
    match env("DESI_SPECTRO_REDUX") {
        Some(redux) => Some(path_join(&redux, &specprod)),
        None => Some(path_join(
            &path_join(&env("DESI_ROOT")?, "spectro/redux"),
            &specprod,
        )),
    }
}

/// desispec.io.meta.get_readonly_filepath: `$DESI_ROOT` replaced by `$DESI_ROOT_READONLY`
/// when that directory exists.
fn readonly_path(path: &str, env: &dyn Fn(&str) -> Option<String>) -> String {
    let Some(root) = env("DESI_ROOT") else {
        return path.to_string();
    };
    let readonly = env("DESI_ROOT_READONLY")
        .filter(|r| Path::new(r).exists())
        .unwrap_or_else(|| root.clone());
    if path.starts_with(&root) && root != readonly {
        path.replacen(&root, &readonly, 1)
    } else {
        path.to_string()
    }
}

/// Python's `os.path.join` of two components.
fn path_join(a: &str, b: &str) -> String {
    if b.starts_with('/') || a.is_empty() {
        b.to_string()
    } else if a.ends_with('/') {
        format!("{a}{b}")
    } else {
        format!("{a}/{b}")
    }
}

/// One fiber's rows of the frame's arrays, filled from the patch results covering it.
struct FiberRows<'a> {
    flux: ArrayViewMut1<'a, f64>,
    ivar: ArrayViewMut1<'a, f64>,
    chi2: ArrayViewMut1<'a, f64>,
    fraction: ArrayViewMut1<'a, f64>,
    /// `[diagonal, wave]`.
    res: ArrayViewMut2<'a, f64>,
}

impl FiberRows<'_> {
    /// Copies row `fiber` of each result in `ids` (of `results`, checked to have their
    /// patch's shape) into the patch's bins.
    fn fill(mut self, fiber: usize, plan: &Plan, ids: &[usize], results: &[PatchResult]) {
        fn row(v: &[f64], i: usize, n: usize) -> ArrayView1<'_, f64> {
            ArrayView1::from(&v[i * n..][..n])
        }
        for &i in ids {
            let (r, patch) = (&results[i], &plan.patches[results[i].patch]);
            let (waves, local, nw) = (patch.waves.clone(), fiber - patch.fibers.start, r.nwave);
            let pairs = [
                (&mut self.flux, &r.flux),
                (&mut self.ivar, &r.ivar),
                (&mut self.chi2, &r.chi2pix),
                (&mut self.fraction, &r.pixmask_fraction),
            ];
            for (dst, src) in pairs {
                dst.slice_mut(s![waves.clone()])
                    .assign(&row(src, local, nw));
            }
            let nd = self.res.nrows();
            for d in 0..nd {
                self.res.slice_mut(s![d, waves.clone()]).assign(&row(
                    &r.resolution,
                    local * nd + d,
                    nw,
                ));
            }
        }
    }
}

/// Checks that every patch of `plan` has exactly one result of its shape; the outcome counts,
/// and for each fiber of the frame the results that cover it.
fn check_results(
    plan: &Plan,
    ndiag: usize,
    results: &[PatchResult],
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
        let (nf, nw) = (patch.fibers.len(), patch.waves.len());
        let sizes = [&r.flux, &r.ivar, &r.chi2pix, &r.pixmask_fraction]
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
        for f in patch.fibers.clone() {
            by_fiber[f - specmin].push(i);
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
    use super::*;

    #[test]
    fn median_of_odd_even_and_empty() {
        assert_eq!(median(vec![3.0, 1.0, 2.0]), 2.0);
        assert_eq!(median(vec![4.0, 1.0, 3.0, 2.0]), 2.5);
        assert_eq!(median(vec![5.0]), 5.0);
        assert_eq!(median(vec![]), 0.0);
    }

    fn environment<'a>(vars: &'a [(&'a str, &'a str)]) -> impl Fn(&str) -> Option<String> + 'a {
        move |k| {
            vars.iter()
                .find(|(n, _)| *n == k)
                .map(|(_, v)| v.to_string())
        }
    }

    #[test]
    fn file_names_are_shortened_as_desispec_does() {
        let prod = [
            ("DESI_SPECTRO_REDUX", "/global/redux"),
            ("SPECPROD", "daily"),
        ];
        let env = environment(&prod);
        assert_eq!(
            shorten_filename("/global/redux/daily/preproc/p.fits", &env),
            "SPECPROD/preproc/p.fits"
        );
        assert_eq!(
            shorten_filename("/elsewhere/p.fits", &env),
            "/elsewhere/p.fits"
        );
        assert_eq!(shorten_filename("relative/p.fits", &env), "relative/p.fits");
        // without SPECPROD nothing is replaced
        let env = environment(&prod[..1]);
        assert_eq!(
            shorten_filename("/global/redux/daily/p.fits", &env),
            "/global/redux/daily/p.fits"
        );
        // calibrations first; SPECPROD as a path; $DESI_ROOT/spectro/redux by default
        let vars = [
            ("DESI_SPECTRO_CALIB", "/cal"),
            ("SPECPROD", "/my/prod/"),
            ("DESI_ROOT", "/desi"),
        ];
        let env = environment(&vars);
        assert_eq!(shorten_filename("/cal/psf.fits", &env), "SPCALIB/psf.fits");
        assert_eq!(shorten_filename("/my/prod/x.fits", &env), "SPECPRODx.fits");
        let vars = [("DESI_ROOT", "/desi"), ("SPECPROD", "loa")];
        let env = environment(&vars);
        assert_eq!(
            shorten_filename("/desi/spectro/redux/loa/x.fits", &env),
            "SPECPROD/x.fits"
        );
        // the read-only copy of the production, when that directory exists
        let ro = std::env::temp_dir();
        let ro = ro.to_str().unwrap();
        let vars = [
            ("DESI_ROOT", "/desi"),
            ("DESI_ROOT_READONLY", ro),
            ("SPECPROD", "loa"),
        ];
        let env = environment(&vars);
        let name = format!("{}/x.fits", path_join(ro, "spectro/redux/loa"));
        assert_eq!(shorten_filename(&name, &env), "SPECPROD/x.fits");
    }

    #[test]
    fn gradient_is_one_sided_at_the_ends() {
        assert_eq!(gradient(&[1.0, 2.0, 4.0, 7.0]), vec![1.0, 1.5, 2.5, 3.0]);
    }
}
