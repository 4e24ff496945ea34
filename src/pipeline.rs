//! One frame, end to end: validate the request, read the inputs, plan, solve on a backend,
//! stitch and write. Each phase is a `tracing` span (and so an NVTX range under `nsys`) and
//! is timed for the log. The MPI layer calls the same phases, spread over ranks.

use std::ops::Range;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

use ndarray::Zip;
use rayon::prelude::*;
use serde::{Deserialize, Serialize};

use crate::backend::{Backend, FrameInput, Progress};
use crate::barycentric;
use crate::error::{number, Error, Result};
use crate::extract::{PatchResult, SolveOptions};
use crate::fits::Fits;
use crate::frame::{self, ExtraHdu, Frame, FrameMeta, FrameValues, PatchCounts};
use crate::image::{Image, MaskRule};
use crate::output;
use crate::plan::{PatchLayout, Plan, PlanOptions};
use crate::psf::{Corners, GaussHermitePsf, TraceTable, DEFAULT_PSFERR};
use crate::scores::ScoresHdu;

/// Set when the host process was interrupted (Ctrl-C in Python): frames not yet started fail
/// with [`Error::Interrupted`] instead of being extracted.
static INTERRUPTED: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);

/// Asks the frames not yet started to stop (`true`), or clears the request before a new job.
pub fn set_interrupted(on: bool) {
    INTERRUPTED.store(on, std::sync::atomic::Ordering::Relaxed);
}

/// Whether the host asked the frames to stop.
pub fn interrupted() -> bool {
    INTERRUPTED.load(std::sync::atomic::Ordering::Relaxed)
}

/// How far (Angstrom) the output grid may reach beyond the PSF's wavelength domain.
pub const WAVE_TOLERANCE: f64 = 5.0;

/// A validated extraction request for one frame.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct ExtractRequest {
    #[serde(with = "crate::parallel::messages::path_bytes")]
    pub input: PathBuf,
    #[serde(with = "crate::parallel::messages::path_bytes")]
    pub psf: PathBuf,
    #[serde(with = "crate::parallel::messages::path_bytes")]
    pub output: PathBuf,
    #[serde(with = "crate::parallel::messages::path_bytes::option")]
    pub model: Option<PathBuf>,
    /// The fibermap to copy and take the pointing from (`None`: the input's FIBERMAP HDU).
    #[serde(with = "crate::parallel::messages::path_bytes::option")]
    pub fibermap: Option<PathBuf>,
    /// `wmin, wmax, dw`; `None`: the PSF's domain at 0.8 A.
    pub wavelength: Option<(f64, f64, f64)>,
    pub specmin: usize,
    /// `None`: every fiber of the PSF from `specmin`.
    pub nspec: Option<usize>,
    pub regularize: f64,
    /// `None`: `PSFERR` of the PSF, else 0.01.
    pub psferr: Option<f64>,
    pub layout: PatchLayout,
    pub mask_rule: MaskRule,
    /// Extract on the grid divided by the exposure's barycentric correction factor.
    pub barycentric_correction: bool,
    /// Append desispec's SCORES HDU.
    pub scores: bool,
    /// `--reject-outliers NSIGMA` (see [`crate::outliers`]); `None`: off.
    #[serde(default)]
    pub reject_outliers: Option<f64>,
    /// Which bins get BAD2DFIT.
    pub bad2dfit: frame::Bad2dfit,
}

impl ExtractRequest {
    /// A request with the gpu_specter defaults.
    pub fn new(
        input: impl Into<PathBuf>,
        psf: impl Into<PathBuf>,
        output: impl Into<PathBuf>,
    ) -> Self {
        ExtractRequest {
            input: input.into(),
            psf: psf.into(),
            output: output.into(),
            model: None,
            fibermap: None,
            wavelength: None,
            specmin: 0,
            nspec: None,
            regularize: 0.0,
            psferr: None,
            layout: PatchLayout::default(),
            mask_rule: MaskRule::AnyBit,
            barycentric_correction: false,
            scores: false,
            reject_outliers: None,
            bad2dfit: frame::Bad2dfit::default(),
        }
    }

    /// Checks the option values of this request that need no input: each is in its range,
    /// the fiber range does not overflow, and a patch stays of a size that can be solved
    /// (see [`PatchLayout::check`]). An error here is a usage error ([`Error::Config`]);
    /// the job checks it once, before any rank reads or allocates anything.
    pub fn validate_options(&self) -> Result<()> {
        if !self.regularize.is_finite() || self.regularize < 0.0 {
            return Err(Error::config(format!(
                "regularize ({}) must be finite and >= 0",
                self.regularize
            )));
        }
        if let Some(e) = self.psferr {
            if !e.is_finite() || e < 0.0 {
                return Err(Error::config(format!(
                    "psferr ({e}) must be finite and >= 0"
                )));
            }
        }
        if let Some((wmin, wmax, dw)) = self.wavelength {
            crate::plan::check_grid(wmin, wmax, dw)?;
        }
        if let Some(k) = self.reject_outliers {
            if !(k.is_finite() && k > 0.0) {
                return Err(Error::config(format!(
                    "reject-outliers NSIGMA ({k}) must be finite and positive"
                )));
            }
        }
        let l = &self.layout;
        l.check()?;
        if let Some(nspec) = self.nspec {
            if nspec == 0 {
                return Err(Error::config("nspec must be positive"));
            }
            if self.specmin.checked_add(nspec).is_none() {
                return Err(Error::config(format!(
                    "specmin ({}) + nspec ({nspec}) is beyond any fiber number",
                    self.specmin
                )));
            }
        }
        Ok(())
    }

    /// Checks what can be checked before reading anything: the option values
    /// ([`ExtractRequest::validate_options`]) and the outputs (their directories exist, they
    /// are regular files if they exist, and none replaces an input or the other output).
    pub fn check_outputs(&self) -> Result<()> {
        self.validate_options()?;
        check_job_paths(std::slice::from_ref(self), None)
    }

    /// The grid asked for, `wmin, wmax, dw`: `-w`, else the PSF's domain at 0.8 A (what the
    /// frame's WAVEMIN, WAVEMAX, WAVESTEP and WAVELENGTH record).
    pub fn requested_grid(&self, psf: &GaussHermitePsf) -> (f64, f64, f64) {
        let (lo, hi) = psf.param_domain();
        self.wavelength.unwrap_or((lo, hi, 0.8))
    }

    /// The plan of this request for `psf` on the requested grid, checked against the PSF's
    /// fibers and wavelengths.
    pub fn plan(&self, psf: &GaussHermitePsf) -> Result<Plan> {
        self.plan_with(psf, 1.0)
    }

    /// The plan of this request for its inputs: on the requested grid divided by the
    /// barycentric correction factor, as desi_extract_spectra extracts.
    pub fn plan_for(&self, inputs: &Inputs) -> Result<Plan> {
        self.plan_with(&inputs.psf, inputs.heliocor)
    }

    fn plan_with(&self, psf: &GaussHermitePsf, heliocor: f64) -> Result<Plan> {
        self.validate_options()?;
        let (wmin, wmax, dw) = divided_grid(self.requested_grid(psf), heliocor);
        let (dlo, dhi) = psf.wave_domain();
        if wmin < dlo - WAVE_TOLERANCE || wmax > dhi + WAVE_TOLERANCE {
            return Err(Error::config(format!(
                "wavelength range {}..{} is outside the PSF's domain {dlo}..{dhi} ({})",
                number(wmin),
                number(wmax),
                psf.path.display()
            )));
        }
        if self.specmin >= psf.nfiber {
            return Err(Error::config(format!(
                "specmin {} is beyond the PSF's {} fibers",
                self.specmin, psf.nfiber
            )));
        }
        let nspec = self.nspec.unwrap_or(psf.nfiber - self.specmin);
        if self
            .specmin
            .checked_add(nspec)
            .is_none_or(|end| end > psf.nfiber)
        {
            return Err(Error::config(format!(
                "fibers {}..{} are beyond the PSF's {} fibers",
                self.specmin,
                self.specmin.saturating_add(nspec),
                psf.nfiber
            )));
        }
        let mut o = PlanOptions::new(wmin, wmax, dw, self.specmin, nspec);
        o.layout = self.layout.clone();
        let plan = Plan::new(o)?;
        // Any fiber range is solved inside whole bundles, as a full extraction solves it (the
        // GPU backend evaluates the spots of whole bundles).
        if plan.bundles().last().is_some_and(|b| b.end > psf.nfiber) {
            return Err(Error::config(format!(
                "fibers {}..{} lie in bundles of {} that end beyond the PSF's {} fibers",
                self.specmin,
                self.specmin + nspec,
                self.layout.bundlesize,
                psf.nfiber
            )));
        }
        Ok(plan)
    }

    /// Options of the patch solve for `psf`.
    pub fn solve_options(&self, psf: &GaussHermitePsf) -> SolveOptions {
        SolveOptions {
            regularize: self.regularize,
            psferr: self.psferr.or(psf.psferr).unwrap_or(DEFAULT_PSFERR),
            model: self.model.is_some(),
            reject_outliers: self.reject_outliers,
        }
    }

    /// What the output file carries besides the arrays.
    pub fn frame_meta(&self, inputs: &Inputs) -> FrameMeta {
        FrameMeta {
            header: inputs.image.header.clone(),
            input: Some(self.input.clone()),
            psf: Some(self.psf.clone()),
            orig_psf: inputs.psf.orig_psf.clone(),
            fibermap_from: self
                .fibermap
                .clone()
                .or_else(|| inputs.image.has_fibermap.then(|| self.input.clone())),
            grid: Some(self.requested_grid(&inputs.psf)),
            heliocor: self.barycentric_correction.then_some(inputs.heliocor),
            extra_hdus: if self.scores {
                vec![Arc::new(ScoresHdu {
                    step: self.requested_grid(&inputs.psf).2,
                }) as Arc<dyn ExtraHdu>]
            } else {
                Vec::new()
            },
        }
    }
}

/// The extraction grid of the requested grid `wmin, wmax, dw` under a barycentric factor:
/// the requested grid divided by it, with as many bins, as desi_extract_spectra divides its
/// `arange`. Dividing `wmax` as well would gain or lose the last bin where `wmax + dw/2`
/// falls on a bin (`6000,6039.6,0.8`), and the frame could not carry the requested grid:
/// the divided grid ends on its last bin instead, half a bin from either count.
fn divided_grid((wmin, wmax, dw): (f64, f64, f64), heliocor: f64) -> (f64, f64, f64) {
    let nwave = ((wmax + 0.5 * dw - wmin) / dw).ceil();
    if heliocor == 1.0 || !(1.0..=crate::plan::MAX_OUTPUT_BINS as f64).contains(&nwave) {
        return (wmin / heliocor, wmax / heliocor, dw / heliocor);
    }
    let last = wmin + (nwave - 1.0) * dw;
    (wmin / heliocor, last / heliocor, dw / heliocor)
}

/// Refuses a job whose outputs would replace one of its inputs (image, PSF, the `--test`
/// `reference`) or one another, or cannot be written by a rename (see
/// [`output::check_paths`]). The job calls it once for all its frames, before any work.
pub fn check_job_paths(requests: &[ExtractRequest], reference: Option<&Path>) -> Result<()> {
    let mut inputs: Vec<&Path> = reference.into_iter().collect();
    let mut outputs = Vec::with_capacity(2 * requests.len());
    for r in requests {
        inputs.extend([r.input.as_path(), r.psf.as_path()]);
        inputs.extend(r.fibermap.as_deref());
        outputs.push(r.output.as_path());
        outputs.extend(r.model.as_deref());
    }
    output::check_paths(&inputs, &outputs)
}

/// Most worker threads a rank may ask for per core it can use: more only adds overhead, and a
/// mistyped count would start that many threads.
pub const MAX_THREADS_PER_CORE: usize = 4;

/// Checks `--threads` (0: the rank's share of the cores) against the `cores` of the node.
pub fn check_threads(threads: usize, cores: usize) -> Result<()> {
    let limit = MAX_THREADS_PER_CORE * cores.max(1);
    if threads > limit {
        return Err(Error::config(format!(
            "threads ({threads}) must be at most {limit} ({MAX_THREADS_PER_CORE} per core of the {cores} available)"
        )));
    }
    Ok(())
}

/// Wall time of each phase of a frame, for the log and the benchmarks.
#[derive(Clone, Debug, Default)]
pub struct Timings {
    pub phases: Vec<(&'static str, Duration)>,
}

impl Timings {
    /// Runs `f` inside a tracing span and an NVTX range named `name` (what `nsys` shows) and
    /// records its duration.
    pub fn time<T>(&mut self, name: &'static str, f: impl FnOnce() -> T) -> T {
        let span = tracing::info_span!("phase", name);
        let _entered = span.enter();
        let _range = nvtx::LocalRange::new(nvtx::Str::from_str_lossy(name));
        let t0 = Instant::now();
        let out = f();
        self.phases.push((name, t0.elapsed()));
        out
    }

    pub fn total(&self) -> Duration {
        self.phases.iter().map(|(_, d)| *d).sum()
    }

    pub fn get(&self, name: &str) -> Duration {
        self.phases
            .iter()
            .filter(|(n, _)| *n == name)
            .map(|(_, d)| *d)
            .sum()
    }
}

impl std::fmt::Display for Timings {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let parts: Vec<String> = self
            .phases
            .iter()
            .map(|(n, d)| format!("{n} {:.3} s", d.as_secs_f64()))
            .collect();
        write!(
            f,
            "{} (total {:.3} s)",
            parts.join(", "),
            self.total().as_secs_f64()
        )
    }
}

/// The inputs of one frame, read.
pub struct Inputs {
    pub psf: GaussHermitePsf,
    pub image: Image,
    /// The barycentric correction factor that divides the extraction grid (1 without
    /// `--barycentric-correction`).
    pub heliocor: f64,
    /// The traces of the plan's fibers on its padded grid, evaluated where the frame was read
    /// (None where it was received, or built otherwise): the GPU backend copies them.
    pub traces: Option<TraceTable>,
}

/// Reads the PSF and the image of a request, and the barycentric correction factor of the
/// exposure when it is asked for.
pub fn read_inputs(request: &ExtractRequest) -> Result<Inputs> {
    // The PSF is read while the image is (a .fits.gz preproc takes the longer to inflate).
    let (psf, image) = std::thread::scope(|s| {
        let psf = s.spawn(|| GaussHermitePsf::read(&request.psf));
        let image = Image::read(&request.input, request.mask_rule);
        (
            psf.join().unwrap_or_else(|p| std::panic::resume_unwind(p)),
            image,
        )
    });
    let (psf, image) = (psf?, image?);
    let heliocor = if request.barycentric_correction {
        barycentric_factor(request, &image)?
    } else {
        1.0
    };
    if (image.ncols, image.nrows) != (psf.npix_x, psf.npix_y) {
        tracing::warn!(
            "image {}x{} differs from the PSF's CCD {}x{}",
            image.ncols,
            image.nrows,
            psf.npix_x,
            psf.npix_y
        );
    }
    Ok(Inputs {
        psf,
        image,
        heliocor,
        traces: None,
    })
}

/// The barycentric correction factor of a frame, from the image header, else from the
/// fibermap's (`-f`, else the input's FIBERMAP HDU), as desi_extract_spectra chooses.
fn barycentric_factor(request: &ExtractRequest, image: &Image) -> Result<f64> {
    let fibermap = request
        .fibermap
        .clone()
        .or_else(|| image.has_fibermap.then(|| request.input.clone()));
    let fibermap_header = match &fibermap {
        Some(path) => {
            let mut fits = Fits::open_part(path, "FIBERMAP")?;
            Some((fits.cards()?, path))
        }
        None => None,
    };
    let factor = barycentric::factor_for_extraction(
        (&image.header, &request.input),
        fibermap_header
            .as_ref()
            .map(|(cards, path)| (cards.as_slice(), path.as_path())),
    )?;
    tracing::info!(
        "{}: barycentric correction factor {factor}",
        request.input.display()
    );
    Ok(factor)
}

/// What a finished frame reports.
#[derive(Clone, Debug)]
pub struct FrameReport {
    pub frame: Frame,
    pub counts: PatchCounts,
    pub timings: Timings,
}

/// A box of CCD rows and columns.
pub type PixelBox = (Range<usize>, Range<usize>);

/// Reads a frame and checks what can be checked before anyone solves (the output directory,
/// the inputs, the plan); returns the inputs and the box of pixels the plan's patches can use.
pub fn read_frame(request: &ExtractRequest) -> Result<(Inputs, PixelBox)> {
    let _range = nvtx::LocalRange::new(c"read");
    if interrupted() {
        return Err(Error::Interrupted);
    }
    request.check_outputs()?;
    let mut inputs = read_inputs(request)?;
    let plan = request.plan_for(&inputs)?;
    warn_unusable_fibers(&inputs.psf, &plan, &inputs.image);
    let traces = TraceTable::new(&inputs.psf, plan.solved_fibers(), &plan.fullwave);
    let pixel_box = plan_box(&traces.corners(&inputs.psf), &inputs);
    inputs.traces = Some(traces);
    Ok((inputs, pixel_box))
}

/// The CCD box covered by every spot of `corners` (those of every fiber of the plan on its
/// padded wavelength grid), clipped to the image. Patch pixel boxes lie inside it, so workers
/// need no other pixel: a frame of a few bundles or a short wavelength range broadcasts a
/// small part of the CCD.
fn plan_box(corners: &Corners, inputs: &Inputs) -> PixelBox {
    let (ny, nx) = (corners.ny as i64, corners.nx as i64);
    let bounds = |v: &[i32], n: i64, limit: usize| -> Range<usize> {
        let lo = v.iter().copied().min().map_or(0, i64::from);
        let hi = v.iter().copied().max().map_or(0, |m| i64::from(m) + n);
        let clip = |x: i64| x.clamp(0, limit as i64) as usize;
        clip(lo)..clip(hi).max(clip(lo))
    };
    (
        bounds(&corners.yc, ny, inputs.image.nrows),
        bounds(&corners.xc, nx, inputs.image.ncols),
    )
}

/// Solves the patches `block` of the frame's plan on `backend`. `values`, the frame's arrays
/// all zero ([`frame_values`]), are given when this process assembles the frame: with every
/// patch the backend may place its results' values there ([`Backend::extract_into`]), and
/// they come back for the assembly, which stitches the other results into them.
pub fn solve(
    request: &ExtractRequest,
    inputs: &Inputs,
    plan: &Plan,
    block: Range<usize>,
    backend: &mut dyn Backend,
    progress: &Progress,
    values: Option<FrameValues>,
) -> Result<(Vec<PatchResult>, Option<FrameValues>)> {
    let _range = nvtx::LocalRange::new(c"extract");
    let options = request.solve_options(&inputs.psf);
    let whole = block.len() == plan.patches.len();
    let patches = &plan.patches[block];
    let input = FrameInput::new(plan, &inputs.psf, &inputs.image, &options)
        .with_traces(inputs.traces.as_ref());
    progress.start(patches.len());
    match values.filter(|_| whole) {
        None => Ok((backend.extract(input, patches, progress)?, None)),
        Some(mut values) => {
            let results = backend.extract_into(input, patches, progress, &mut values)?;
            Ok((results, Some(values)))
        }
    }
}

/// The arrays of the frame `request` makes of `inputs`, all zero, for [`solve`], where no plan
/// is at hand: a reader that runs ahead of the solves makes them, so that their memory is not
/// cleared in a frame's solve. `None` when no plan can be made (the solve then says why).
pub fn frame_values(request: &ExtractRequest, inputs: &Inputs) -> Option<FrameValues> {
    let plan = request.plan_for(inputs).ok()?;
    Some(FrameValues::zeros(&plan, inputs.psf.hsizey))
}

/// Announces the file of `plan`'s frame, built in memory at its write after the solve, and
/// with `map_ahead` maps its memory on a thread of its own meanwhile
/// ([`crate::fits::prepare_block`]): a process's first frame would build its file in fresh
/// memory.
pub fn prepare_write(plan: &Plan, inputs: &Inputs, map_ahead: bool) {
    crate::fits::prepare_block(Frame::file_bytes(plan, inputs.psf.hsizey), map_ahead);
}

/// Stitches the results of every patch of `plan` into a frame, over the values `placed` in
/// its arrays by the backend when it did.
///
/// Under a barycentric correction the frame carries the requested grid, as desispec's does,
/// while its flux stays per Angstrom of the extraction grid.
pub fn assemble(
    request: &ExtractRequest,
    plan: &Plan,
    inputs: &Inputs,
    results: &[PatchResult],
    placed: Option<FrameValues>,
    timings: &mut Timings,
) -> Result<(Frame, PatchCounts)> {
    let ndiag = inputs.psf.hsizey;
    let (mut frame, counts) = timings.time("assemble", || {
        Frame::assemble_with(plan, ndiag, results, placed)
    })?;
    log_counts(&counts);
    if request.bad2dfit != frame::Bad2dfit::default() {
        frame.set_mask(request.bad2dfit);
    }
    flag_bins_without_data(&mut frame, &request.output);
    if request.reject_outliers.is_some() {
        crate::outliers::log_rejection(&mut frame, plan, results);
    }
    if inputs.heliocor != 1.0 {
        frame.wave = request.frame_meta(inputs).output_wave(&frame)?;
    }
    Ok((frame, counts))
}

/// Writes the frame and, if requested, the model image of the patch results: the two appear
/// together or not at all.
pub fn write(
    request: &ExtractRequest,
    inputs: &Inputs,
    frame: &Frame,
    results: &[PatchResult],
    timings: &mut Timings,
) -> Result<()> {
    stage(request, inputs, frame, results, timings)?.commit()
}

/// [`write`] without the final rename: the frame and model under their temporary names, for
/// ranks that agree before the files appear.
pub fn stage(
    request: &ExtractRequest,
    inputs: &Inputs,
    frame: &Frame,
    results: &[PatchResult],
    timings: &mut Timings,
) -> Result<output::StagedSet> {
    let staged = timings.time("write", || -> Result<output::StagedSet> {
        let meta = request.frame_meta(inputs);
        let mut targets = vec![request.output.as_path()];
        targets.extend(request.model.as_deref());
        output::stage_together(&targets, |tmp| {
            frame.write(tmp[0], &meta)?;
            if let Some(path) = tmp.get(1) {
                let shape = (inputs.image.nrows, inputs.image.ncols);
                let model = frame::model_image(shape, results)?;
                frame::write_model(path, model.view(), frame, &meta)?;
            }
            Ok(())
        })
    })?;
    // Recorded when staged: what remains, the rename, takes no measurable time.
    note_written(&request.output, timings);
    Ok(staged)
}

/// A frame this process wrote, as [`take_written_frames`] returns it.
#[derive(Clone, Debug)]
pub struct WrittenFrame {
    pub output: PathBuf,
    /// Its phases, in order, on the rank that wrote it.
    pub timings: Timings,
    /// When its write ended.
    pub written_at: std::time::SystemTime,
}

/// The frames written since [`record_written_frames`] turned recording on: a host process
/// (the Python package's `timing` argument) reads the phases of the frames of its call here,
/// since they are measured on whichever rank writes a frame.
static WRITTEN: std::sync::Mutex<Option<Vec<WrittenFrame>>> = std::sync::Mutex::new(None);

/// Starts recording the frames this process writes (forgetting those recorded before), or
/// stops (`false`).
pub fn record_written_frames(on: bool) {
    *WRITTEN
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner) = on.then(Vec::new);
}

/// The frames recorded since recording started, which goes on with an empty record.
pub fn take_written_frames() -> Vec<WrittenFrame> {
    WRITTEN
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
        .as_mut()
        .map(std::mem::take)
        .unwrap_or_default()
}

fn note_written(output: &Path, timings: &Timings) {
    let mut written = WRITTEN
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner);
    if let Some(frames) = written.as_mut() {
        frames.push(WrittenFrame {
            output: output.to_path_buf(),
            timings: timings.clone(),
            written_at: std::time::SystemTime::now(),
        });
    }
}

/// Bins that no usable pixel constrains (ivar 0 while their spot was not counted as masked:
/// a trace off the CCD, a spot of zero width, a non-finite patch) get what desispec's
/// extraction sets for bins without input pixels: pixmask fraction 1, SOMEBADPIX and
/// ALLBADPIX. Returns their number, also logged as a warning with the fibers concerned.
pub fn flag_bins_without_data(frame: &mut Frame, output: &Path) -> usize {
    let mut fibers = Vec::new();
    let mut nbins = 0;
    let rows = Zip::indexed(frame.ivar.rows())
        .and(frame.pixmask_fraction.rows_mut())
        .and(frame.mask.rows_mut());
    rows.for_each(|f, ivar, fraction, mask| {
        let mut any = false;
        Zip::from(ivar)
            .and(fraction)
            .and(mask)
            .for_each(|&v, fraction, mask| {
                if v == 0.0 && *fraction < 1.0 {
                    *fraction = 1.0;
                    *mask |= frame::specmask::SOMEBADPIX | frame::specmask::ALLBADPIX;
                    nbins += 1;
                    any = true;
                }
            });
        if any {
            fibers.push(frame.specmin + f);
        }
    });
    if nbins > 0 {
        tracing::warn!(
            "{}: {nbins} bins of fibers {} have no usable pixel (trace off the CCD, PSF of zero width or a failed patch): ivar 0, MASK ALLBADPIX",
            output.display(),
            fiber_ranges(&fibers)
        );
    }
    nbins
}

/// Sorted fiber numbers as `0-24, 30, 40-49`.
fn fiber_ranges(fibers: &[usize]) -> String {
    let mut parts: Vec<String> = Vec::new();
    let mut i = 0;
    while i < fibers.len() {
        let mut j = i;
        while j + 1 < fibers.len() && fibers[j + 1] == fibers[j] + 1 {
            j += 1;
        }
        parts.push(match j > i {
            true => format!("{}-{}", fibers[i], fibers[j]),
            false => fibers[i].to_string(),
        });
        i = j + 1;
    }
    parts.join(", ")
}

/// Warns about fibers of the plan that the PSF cannot put on the image: a trace that stays
/// off the CCD, or a Gauss-Hermite width that is not positive, over part of the output grid.
/// Returns the fibers concerned.
pub fn warn_unusable_fibers(psf: &GaussHermitePsf, plan: &Plan, image: &Image) -> Vec<usize> {
    let (hx, hy) = (psf.hsizex as f64, psf.hsizey as f64);
    let (nx, ny) = (image.ncols as f64, image.nrows as f64);
    // (off the CCD somewhere, flat somewhere) per fiber: four series at every output bin, some
    // five million evaluations a full frame, several wavelengths at a time (one at a time,
    // this took a tenth of a GPU run's CPU time)
    let verdicts: Vec<(usize, bool, bool)> = plan
        .fibers()
        .into_par_iter()
        .map(|fiber| {
            let (x, y) = psf.trace(fiber, &plan.wave);
            let mut sx = vec![0.0; plan.wave.len()];
            let mut sy = vec![0.0; plan.wave.len()];
            psf.ghsigx.eval_many(fiber, &plan.wave, &mut sx);
            psf.ghsigy.eval_many(fiber, &plan.wave, &mut sy);
            let on = |x: f64, y: f64| {
                x + hx >= -0.5 && x - hx <= nx - 0.5 && y + hy >= -0.5 && y - hy <= ny - 0.5
            };
            let any_off = x.iter().zip(&y).any(|(&x, &y)| !on(x, y));
            let shaped =
                |sx: f64, sy: f64| sx > 0.0 && sy > 0.0 && sx.is_finite() && sy.is_finite();
            let any_flat = sx.iter().zip(&sy).any(|(&sx, &sy)| !shaped(sx, sy));
            (fiber, any_off, any_flat)
        })
        .collect();
    let mut off: Vec<usize> = verdicts.iter().filter(|v| v.1).map(|v| v.0).collect();
    let flat: Vec<usize> = verdicts.iter().filter(|v| v.2).map(|v| v.0).collect();
    if !off.is_empty() {
        tracing::warn!(
            "{}: the traces of fibers {} leave the {}x{} CCD within the output grid",
            psf.path.display(),
            fiber_ranges(&off),
            image.ncols,
            image.nrows
        );
    }
    if !flat.is_empty() {
        tracing::warn!(
            "{}: fibers {} have a Gauss-Hermite sigma (GHSIGX/GHSIGY) that is not positive within the output grid",
            psf.path.display(),
            fiber_ranges(&flat)
        );
    }
    off.extend(flat);
    off.sort_unstable();
    off.dedup();
    off
}

fn log_counts(c: &PatchCounts) {
    tracing::info!(
        "patches: {} solved, {} regularized retry, {} eigen fallback, {} fully masked, {} off the CCD, {} non-finite",
        c.ok,
        c.regularized,
        c.eigen_fallback,
        c.masked,
        c.off_image,
        c.non_finite
    );
}

/// Extracts a frame whose inputs a host process holds in memory: plan, solve every patch on
/// `backend`, stitch, as [`extract_frame`] does between its read and its write.
pub fn extract_in_memory(
    request: &ExtractRequest,
    inputs: &Inputs,
    backend: &mut dyn Backend,
) -> Result<(Frame, PatchCounts)> {
    extract_in_memory_timed(request, inputs, backend, &mut Timings::default())
}

/// [`extract_in_memory`], with the time of its phases (plan and solve as "solve", then
/// "assemble") added to `timings`.
pub fn extract_in_memory_timed(
    request: &ExtractRequest,
    inputs: &Inputs,
    backend: &mut dyn Backend,
    timings: &mut Timings,
) -> Result<(Frame, PatchCounts)> {
    if interrupted() {
        return Err(Error::Interrupted);
    }
    let results = timings.time("solve", || {
        let plan = request.plan_for(inputs)?;
        let all = 0..plan.patches.len();
        let values = Some(FrameValues::zeros(&plan, inputs.psf.hsizey));
        let solved = solve(
            request,
            inputs,
            &plan,
            all,
            backend,
            &Progress::silent(),
            values,
        )?;
        Ok::<_, Error>((plan, solved))
    });
    let (plan, (results, placed)) = results?;
    assemble(request, &plan, inputs, &results, placed, timings)
}

/// Extracts one frame in this process: read, plan, solve every patch on `backend`, write.
pub fn extract_frame(
    request: &ExtractRequest,
    backend: &mut dyn Backend,
    progress: &Progress,
) -> Result<FrameReport> {
    let mut timings = Timings::default();
    let (inputs, _) = timings.time("read", || read_frame(request))?;
    let plan = request.plan_for(&inputs)?;
    tracing::info!(
        "{}: {} on {}",
        request.input.display(),
        plan.summary(),
        backend.describe()
    );
    prepare_write(&plan, &inputs, true);
    let all = 0..plan.patches.len();
    let (results, placed) = timings.time("solve", || {
        let values = Some(FrameValues::zeros(&plan, inputs.psf.hsizey));
        solve(request, &inputs, &plan, all, backend, progress, values)
    })?;
    let (frame, counts) = assemble(request, &plan, &inputs, &results, placed, &mut timings)?;
    write(request, &inputs, &frame, &results, &mut timings)?;
    tracing::info!("{}: {timings}", request.output.display());
    Ok(FrameReport {
        frame,
        counts,
        timings,
    })
}

#[cfg(test)]
mod written_frames_tests {
    use super::*;

    fn written(path: &Path) -> Vec<WrittenFrame> {
        take_written_frames()
            .into_iter()
            .filter(|w| w.output == path)
            .collect()
    }

    #[test]
    fn frames_are_recorded_only_while_asked() {
        let path = Path::new("written-frames-test.fits");
        let timings = Timings {
            phases: vec![("write", Duration::from_millis(3))],
        };
        record_written_frames(true);
        note_written(path, &timings);
        let got = written(path);
        assert_eq!(got.len(), 1);
        assert_eq!(got[0].timings.get("write"), Duration::from_millis(3));
        assert!(written(path).is_empty(), "taken frames are forgotten");
        record_written_frames(false);
        note_written(path, &timings);
        record_written_frames(true);
        assert!(
            written(path).is_empty(),
            "a frame written while off is not recorded"
        );
        record_written_frames(false);
    }
}
