//! The CUDA backend: solves batches of patches on one NVIDIA GPU.
//!
//! Nothing CUDA is needed to build it: the driver, NVRTC, cuBLAS and cuSOLVER are loaded at
//! run time (cudarc's dynamic loading), and the kernels in `kernels/` are compiled by NVRTC
//! into CUBIN for the device's architecture when the backend is created (or come from the
//! kernel cache). The solve follows the CPU reference step by step (see `solve`); results agree
//! with it to rounding, except that the decorrelation takes the polar route where the CPU
//! diagonalises (the two agree to 1e-9 sigma or better).
//!
//! A frame is one chunk: each part of its host tables and image is built and uploaded once,
//! by the first wave that needs it, while the device runs the wave before; the device walks
//! its patches in waves of up to 800, through per-patch buffers reused from wave to wave
//! within the memory budget (`SPEX_GPU_MEMORY_GB`, by default a tenth of the device's memory
//! and at least 4 GB per backend, `tuning::memory_budget`). Every wave is queued before the
//! host reads any result, and each wave's results land in frame-sized buffers on the device,
//! so that on the default (Schur) route the device never waits for the host within a frame:
//! even the retry of failed factorisations is decided on the device. The host copies each
//! wave's results back and unpacks them while the device runs the waves after.
//! Device and pinned buffers are kept between calls (a process extracts frame after frame).
//!
//! The code is split by concern: `device` (context, streams, allocation and copies),
//! `buffers` (device and pinned memory owned), `shape` (the shapes of a frame's patches),
//! `workspace` (buffers kept between calls),
//! `staging` (host buffers of the transfers, pinned in the background), `tables` (host
//! tables of a frame and its waves), `launchers` (one typed launcher per kernel), `dense`
//! (factorisation and core covariance through cuSOLVER and cuBLAS), `schur` (the same by
//! per-fiber Schur complements), `decorrelate` (polar route and Jacobi fallback), `results`
//! (host-side results and the CPU fallback), `solve` (the steps of a wave in order), `reject`
//! (outlier rejection's passes over a solved frame),
//! `tuning` and `timings`.
//!
//! Tuning variables, for measurements rather than production, are read once when a backend is
//! created: `SPEX_GPU_WAVE` (most patches per wave) and those of `tuning` (`SPEX_GPU_SOLVE`,
//! `SPEX_GPU_COUPLING_MAX`, `SPEX_GPU_RETRY_CAPACITY`, `SPEX_GPU_DECORRELATE`,
//! `SPEX_GPU_JACOBI_THREADS`, `SPEX_GPU_JACOBI_TOL`).

mod buffers;
mod busy;
mod decorrelate;
mod dense;
mod device;
mod error;
mod kernels;
mod launchers;
mod reject;
mod results;
mod schur;
mod shape;
mod solve;
mod staging;
mod tables;
mod timings;
mod tuning;
mod workspace;

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Instant;

pub use decorrelate::BlockKind;
pub use kernels::{
    arch_name, built_in_archs, compile, nvrtc_version, prebuilt, resources, Origin, SOURCES,
};
pub use timings::GpuTimings;
pub use tuning::{Route, Solve, COUPLING_MAX};

use crate::backend::{Backend, FrameInput, Progress};
use crate::error::{Error, Result};
use crate::extract::PatchResult;
use crate::frame::FrameValues;
use crate::plan::Patch;
use device::Device;
use kernels::Kernels;
use launchers::{CoreIn, CoreOut, Gpu};
use shape::Shape;
use timings::PhaseClock;
use tuning::Tuning;

/// Solves patches on one CUDA device.
pub struct CudaBackend {
    dev: Device,
    kernels: Kernels,
    budget: usize,
    max_wave: Option<usize>,
    tuning: Tuning,
    timings: GpuTimings,
    workspace: workspace::Workspace,
    /// Host buffers of the frames' uploads, kept between calls.
    uploads: Option<tables::Uploads>,
    /// Whether the first frame pins its upload buffers for the frames after it (false for a
    /// backend that solves one frame: see [`Backend::one_frame_only`]).
    pin_uploads: bool,
    /// Its index among the backends of its device (0 for the first, then its siblings), and
    /// the count of them, shared.
    index: usize,
    siblings: Arc<AtomicUsize>,
    /// Threads of the backend's host work (frame tables, results): a pool of its own, so
    /// that this work, which the device waits for, does not queue behind the long tasks
    /// (reading, writing, checksums) that other frames put on rayon's global pool.
    host: Arc<rayon::ThreadPool>,
}

/// A pool of `threads` threads for one backend's host work.
fn host_pool(threads: usize) -> Result<Arc<rayon::ThreadPool>> {
    rayon::ThreadPoolBuilder::new()
        .num_threads(threads)
        .thread_name(|i| format!("spex-cuda-host-{i}"))
        .build()
        .map(Arc::new)
        .map_err(|e| Error::Gpu(format!("cannot start the host threads of the backend: {e}")))
}

impl CudaBackend {
    /// Opens CUDA device `device` (an index among the visible devices) and compiles the
    /// kernels for it; its host work has as many threads as rayon's global pool.
    pub fn new(device: usize) -> Result<Self> {
        Self::with_host_threads(device, rayon::current_num_threads())
    }

    /// [`CudaBackend::new`] with `threads` threads for the host work. The backends of a rank
    /// share its cores: with a pool of all of them each, four GPUs with two frames in flight
    /// ran eight pools of 64 threads on 64 cores, and a frame's host results took 0.1-0.6 s
    /// instead of 10-20 ms.
    pub fn with_host_threads(device: usize, threads: usize) -> Result<Self> {
        let t0 = Instant::now();
        let arch = arch_name(device::compute_capability(device)?);
        // NVRTC needs no context: the kernels compile (or come from the cache) while the
        // context opens.
        let (cubins, opened) = std::thread::scope(|scope| {
            let compiling = scope.spawn(|| {
                let cubins = kernels::cubins_for(arch);
                (cubins, t0.elapsed().as_secs_f64())
            });
            let opened = Device::open(device).and_then(|dev| dev.bind().map(|()| dev));
            let t_open = t0.elapsed().as_secs_f64();
            let cubins = compiling
                .join()
                .unwrap_or_else(|_| (Err(Error::Gpu("NVRTC thread panicked".into())), 0.0));
            (cubins, opened.map(|dev| (dev, t_open)))
        });
        let (dev, t_open) = opened?;
        // the buffers of the copies back are pinned while the kernels load
        let workspace = workspace::Workspace::new(dev.ctx.clone());
        let (cubins, t_cubin) = cubins;
        let cubins = cubins?;
        let origin = kernels::describe_origins(cubins.iter().map(|c| c.1));
        let kernels = Kernels::load(&dev, arch, cubins)?;
        let t_kernels = t0.elapsed().as_secs_f64();
        let budget = tuning::memory_budget(dev.mem_info()?.1)?;
        let max_wave = std::env::var("SPEX_GPU_WAVE")
            .ok()
            .and_then(|v| v.trim().parse().ok());
        let tuning = Tuning::from_env()?;
        tracing::info!(
            "CUDA device {device}: {} (compute capability {}.{}), kernels for {} ({origin}); \
             ready in {t_kernels:.2} s (device {t_open:.2} s, CUBIN {t_cubin:.2} s)",
            dev.name,
            dev.arch.0,
            dev.arch.1,
            arch_name(dev.arch)
        );
        Ok(CudaBackend {
            workspace,
            dev,
            kernels,
            budget,
            max_wave,
            tuning,
            timings: GpuTimings::default(),
            uploads: None,
            pin_uploads: true,
            index: 0,
            siblings: Arc::new(AtomicUsize::new(1)),
            host: host_pool(threads.max(1))?,
        })
    }

    /// The backend's name in debug lines: `cuda:GPU.INDEX`, GPU the node's number.
    fn label(&self) -> String {
        format!("cuda:{}.{}", self.dev.node_gpu, self.index)
    }

    /// A second backend on the same device: its own stream, library handles and buffers, the
    /// same kernels. Two of them solve two frames at once, so that one frame's host-side work
    /// (tables, transfers, results) overlaps the other's kernels.
    pub fn sibling(&self) -> Result<Self> {
        let dev = self.dev.sibling()?;
        Ok(CudaBackend {
            workspace: workspace::Workspace::new(dev.ctx.clone()),
            dev,
            kernels: self.kernels.clone(),
            budget: self.budget,
            max_wave: self.max_wave,
            tuning: self.tuning,
            timings: GpuTimings::default(),
            uploads: None,
            pin_uploads: self.pin_uploads,
            index: self.siblings.fetch_add(1, Ordering::Relaxed),
            siblings: Arc::clone(&self.siblings),
            host: host_pool(self.host.current_num_threads())?,
        })
    }

    /// Phase timings, waves and memory of the last `extract` call.
    pub fn timings(&self) -> &GpuTimings {
        &self.timings
    }

    /// Chooses the decorrelation route (for comparisons; the polar route is the default).
    pub fn set_route(&mut self, route: Route) {
        self.tuning.route = route;
    }

    /// Chooses the route of steps 2-3 (the Schur route by default; see [`Solve`]).
    pub fn set_solve(&mut self, solve: Solve) {
        self.tuning.solve = solve;
    }

    /// Sets the largest second-neighbour coupling the Schur route accepts; patches above it
    /// are solved densely by the CPU reference (for tests of that fallback).
    pub fn set_coupling_max(&mut self, max: f64) {
        self.tuning.coupling_max = max;
    }

    /// Sets how many failed patches of a wave the Schur route retries on the device; the
    /// others go to the CPU reference (for tests of that fallback; the default is 32).
    pub fn set_retry_capacity(&mut self, patches: usize) {
        self.tuning.retry_capacity = patches;
    }

    /// Fills icov with NaN before each wave's assembly, so that a kernel reading an entry the
    /// assembly did not write shows in the results (for tests).
    pub fn set_poison(&mut self, on: bool) {
        self.tuning.poison = on;
    }

    /// Limits the outlier test's list of taken pixels (for tests of the growth by rounds over
    /// the box, which a pass takes when its list is full; None: the default). The kernel holds
    /// it to its list's size.
    pub fn set_outlier_list(&mut self, pixels: Option<u32>) {
        self.tuning.outlier_list = pixels.unwrap_or(reject::TAKEN_LIST);
    }

    /// Limits the boxes whose outlier test grows from its maps in shared memory (for tests of
    /// the growth that evaluates each pixel it reaches, which a larger box takes; None: the
    /// default). The kernel holds it to the maps' room.
    pub fn set_outlier_maps(&mut self, pixels: Option<u32>) {
        self.tuning.outlier_maps = pixels.unwrap_or(reject::MAP_PIXELS);
    }

    /// Limits the slots of normal equations kept for outlier rejection's re-solves (for tests
    /// of the re-solves that assemble theirs again; None: the default).
    pub fn set_kept_slots(&mut self, slots: Option<usize>) {
        self.tuning.kept_slots = slots;
    }

    /// Limits the number of patches of a wave (for tests of the waves; the default follows the
    /// memory budget).
    pub fn set_max_wave(&mut self, patches: Option<usize>) {
        self.max_wave = patches;
    }

    /// Most patches per wave: at most [`MAX_WAVE`] (or the number set), and a wave's buffers
    /// must fit in the budget once the frame's `frame_bytes` (image, results) are held. A
    /// wave's spots are those of the bundles it touches: a share of a bundle's spots per
    /// patch, and two bundles more for the bundles a wave starts and ends within. Also the
    /// bytes of the budget such waves leave.
    fn wave_size(&self, sh: &Shape, frame_bytes: usize) -> (usize, usize) {
        let spots = sh.bundle_spot_bytes();
        let per = sh.bytes_per_patch(solve::route(self.tuning.solve, sh))
            + MODEL_BOX_BYTES
            + spots.div_ceil(sh.patches_per_bundle());
        let held = frame_bytes + 2 * spots;
        let fit = self.budget.saturating_sub(held) / per;
        let size = match self.max_wave {
            Some(max) => max.min(fit).max(1),
            None => fit.clamp(1, MAX_WAVE),
        };
        (size, self.budget.saturating_sub(held + size * per))
    }

    /// The decorrelation matrices Q of `count` symmetric positive definite blocks of order `n`
    /// (row-major, back to back): Q = C^(-1/2) of covariance blocks, Q = S^(1/2) of precision
    /// blocks, by the decorrelation step of the current route; with each block's polar steps
    /// (0 for the Jacobi route, negative where the polar route handed the block to the Jacobi
    /// kernel). Exposed for residual and accuracy checks.
    pub fn decorrelation_batched(
        &mut self,
        blocks: &[f64],
        n: usize,
        kind: BlockKind,
    ) -> Result<(Vec<f64>, Vec<i32>)> {
        let count = blocks.len() / (n * n).max(1);
        if count * n * n != blocks.len() || n == 0 {
            return Err(Error::Gpu(format!(
                "{} values are not whole {n} x {n} matrices",
                blocks.len()
            )));
        }
        self.dev.bind()?;
        let sh = Shape {
            nx: 1,
            ny: 1,
            nt: n,
            nws: n,
            wavepad: 0,
            ncore: 1,
            nblock: 1,
            nfull: 0,
            bundlesize: 1,
            ndiag: 0,
        };
        let d = &self.dev;
        let cb = d.upload(blocks, "test matrices")?;
        let x = d.zeros::<f64>(count * n, "zero rhs")?;
        let nkeep = d.upload(&vec![0i32; count], "kept bins")?;
        let out = [
            d.alloc::<f64>(count * n, "flux")?,
            d.alloc::<f64>(count * n, "ivar")?,
            d.alloc::<f64>(count * n, "resolution")?,
            d.zeros::<f64>(count * n, "flux by column")?,
        ];
        let steps = d.zeros::<i32>(count, "polar steps")?;
        let sweeps = d.zeros::<i32>(count, "sweeps")?;
        let pbuf = d.alloc::<f64>(count * n * n, "parked polar factors")?;
        let q = d.alloc::<f64>(count * n * n, "inverse square roots")?;
        decorrelate::decorrelate(
            Gpu {
                dev: d,
                k: &self.kernels,
                sh: &sh,
            },
            &self.tuning,
            CoreIn {
                blocks: cb.ptr,
                count,
                xflux: x.ptr,
                nkeep: nkeep.ptr,
                skip: 0,
            },
            kind,
            decorrelate::Scratch {
                pbuf: &pbuf,
                factored: false,
                steps: &steps,
                sweeps: &sweeps,
            },
            CoreOut {
                flux: out[0].ptr,
                ivar: out[1].ptr,
                res: out[2].ptr,
                fluxcol: out[3].ptr,
            },
            q.ptr,
        )?;
        let mut qs = vec![0.0; count * n * n];
        let mut st = vec![0i32; count];
        d.copy_from(&mut qs, &q, 0, "inverse square roots")?;
        d.copy_from(&mut st, &steps, 0, "polar steps")?;
        d.sync("inverse square roots")?;
        d.free_retired();
        Ok((qs, st))
    }
}

impl Backend for CudaBackend {
    fn describe(&self) -> String {
        format!(
            "cuda:{} {} (sm_{}{})",
            self.dev.node_gpu, self.dev.name, self.dev.arch.0, self.dev.arch.1
        )
    }

    fn device(&self) -> Option<usize> {
        Some(self.dev.ordinal)
    }

    fn sibling(&self) -> Result<Box<dyn Backend>> {
        Ok(Box::new(CudaBackend::sibling(self)?))
    }

    fn one_frame_only(&mut self) {
        self.pin_uploads = false;
    }

    fn reuse(&mut self, threads: usize) -> Result<()> {
        self.pin_uploads = true;
        if threads.max(1) != self.host.current_num_threads() {
            self.host = host_pool(threads.max(1))?;
        }
        Ok(())
    }

    fn extract(
        &mut self,
        input: FrameInput<'_>,
        patches: &[Patch],
        progress: &Progress,
    ) -> Result<Vec<PatchResult>> {
        self.extract_on_host_pool(input, patches, progress, None)
    }

    fn extract_into(
        &mut self,
        input: FrameInput<'_>,
        patches: &[Patch],
        progress: &Progress,
        values: &mut FrameValues,
    ) -> Result<Vec<PatchResult>> {
        values.check(input.plan, input.psf.hsizey)?;
        self.extract_on_host_pool(input, patches, progress, Some(values))
    }
}

/// Most patches per wave, whatever the memory budget allows. The host prepares the first wave
/// while the device waits, so that smaller waves start it sooner; larger ones gained nothing
/// (full r frames on an H200: four waves of 1175 patches 58.1-58.3 ms per frame, six of 784
/// 57.5-58.7 ms).
const MAX_WAVE: usize = 800;

/// Device memory set aside per patch for its model box (8192 pixels of f64) when the budget
/// is shared out: in every wave, and for the frame's results when the models are asked.
const MODEL_BOX_BYTES: usize = 8 * 8192;

impl CudaBackend {
    /// Solves a frame's `patches` (ordered by bundle) as one chunk: each wave's tables and the
    /// columns of the CCD it adds are prepared and uploaded, and its steps queued, while the
    /// device runs the waves before; then each wave is finished in turn (its results copied
    /// back and unpacked while the device runs the waves after). `results` by position in
    /// `patches`, their values placed in `values` when given (not when rejecting outliers,
    /// whose re-solves read the values of the solves before); `started`: the call's start,
    /// for the host's milestones.
    #[allow(clippy::too_many_arguments)]
    fn solve_frame(
        &mut self,
        started: Instant,
        input: &FrameInput<'_>,
        sh: &Shape,
        patches: &[&Patch],
        host: &mut tables::FrameHost,
        results: &mut [Option<PatchResult>],
        values: Option<&mut FrameValues>,
        timings: &mut GpuTimings,
        progress: &Progress,
    ) -> Result<()> {
        // the stream's idle time counts from here: the first wave's tables and upload
        let mut called = PhaseClock::new(&self.dev);
        called.mark("call")?;
        let mut last_mark = called.idle_since(None, timings)?;
        // another frame, maybe another PSF: no spots carry over from the call before
        self.workspace.last_spots = None;
        let ws = &mut self.workspace;
        ws.input
            .ensure_frame(&self.dev, input, sh, host, patches.len())?;
        let n = patches.len();
        ws.out.ensure(&self.dev, sh, n)?;
        if self.pin_uploads {
            host.start_pinning();
        }
        timings.reached("frame buffers ready", started);
        let gpu = Gpu {
            dev: &self.dev,
            k: &self.kernels,
            sh,
        };
        let mut queued = Vec::with_capacity(host.nplanned());
        for pi in 0..host.nplanned() {
            let Some(wi) = host.prepare_wave(input, patches, sh, pi) else {
                continue;
            };
            let _r = nvtx::LocalRange::new(nvtx::Str::from_str_lossy(&format!(
                "wave of {} patches",
                host.waves[wi].len()
            )));
            // the host's milestones of the first wave, which the device waits for
            let first = timings.waves == 0;
            if first {
                timings.reached("first wave prepared", started);
            }
            let t_upload = Instant::now();
            ws.input.upload_wave(&self.dev, input, sh, host, wi)?;
            if first {
                timings.reached("first wave uploaded", started);
            }
            tracing::debug!(
                "wave {wi}: upload queued in {:.1} ms",
                t_upload.elapsed().as_secs_f64() * 1e3
            );
            if input.options.model {
                let kept = host.waves[wi].boxes.start;
                // The copies back of the waves queued before read the grown buffer: they
                // wait for its filling on the compute stream, not only for their own wave.
                if ws.out.model.grow_keeping(&self.dev, host.box_total, kept)? {
                    self.dev.back_after(None)?;
                }
            }
            queued.push(solve::queue_wave(
                gpu,
                &self.tuning,
                ws,
                input,
                patches,
                host,
                wi,
            )?);
            if first {
                timings.reached("first wave queued", started);
            }
            timings.waves += 1;
        }
        timings.reached("every wave queued", started);
        timings.add("host tables", host.prep_ms);
        let rejecting = input.options.reject_outliers.is_some();
        let mut sink = solve::Sink {
            results,
            values: values.filter(|_| !rejecting),
            last_mark: &mut last_mark,
            timings,
            progress,
        };
        if rejecting {
            let tuning = &self.tuning;
            reject::finish_frame(gpu, tuning, ws, input, patches, host, queued, &mut sink)?;
        } else {
            for q in queued {
                solve::finish_wave(gpu, ws, input, host, q, &mut sink)?;
            }
        }
        sink.timings.reached("every wave unpacked", started);
        Ok(())
    }

    /// Solves the patches with the CPU reference: blocks of `sh.nt` bins are beyond what
    /// the device's shared memory allows its decorrelation kernels.
    fn extract_on_cpu(
        &mut self,
        input: FrameInput<'_>,
        patches: &[Patch],
        progress: &Progress,
        sh: &Shape,
    ) -> Result<Vec<PatchResult>> {
        tracing::warn!(
            "patches of {} bins are too large for the decorrelation kernels of {}: solved on \
             the CPU (fewer --nwavestep or --wavepad bins keep them on the GPU)",
            sh.nt,
            self.dev.name
        );
        self.timings = GpuTimings {
            patches: patches.len(),
            cpu_fallback: patches.len(),
            ..GpuTimings::default()
        };
        let threads = self.host.current_num_threads();
        crate::backend::cpu::CpuBackend::new(threads)?.extract(input, patches, progress)
    }

    /// [`CudaBackend::extract_on_device`] on the backend's host pool, so that the parallel
    /// host work of the call runs there.
    fn extract_on_host_pool(
        &mut self,
        input: FrameInput<'_>,
        patches: &[Patch],
        progress: &Progress,
        values: Option<&mut FrameValues>,
    ) -> Result<Vec<PatchResult>> {
        let pool = Arc::clone(&self.host);
        pool.install(|| {
            // debug lines name the backend, which tells apart the frames in flight
            let _backend = tracing::debug_span!("backend", id = %self.label()).entered();
            self.extract_on_device(input, patches, progress, values)
        })
    }

    /// [`Backend::extract`] on a thread of the backend's host pool (the device is bound to it
    /// here); the values placed in `values` when given ([`Backend::extract_into`]).
    fn extract_on_device(
        &mut self,
        input: FrameInput<'_>,
        patches: &[Patch],
        progress: &Progress,
        values: Option<&mut FrameValues>,
    ) -> Result<Vec<PatchResult>> {
        let t0 = Instant::now();
        self.dev.bind()?;
        self.dev.stats.reset_peak();
        let mut timings = GpuTimings::default();
        if patches.is_empty() {
            self.timings = timings;
            return Ok(Vec::new());
        }
        let sh = Shape::new(&input, patches);
        if launchers::jacobi_smem(sh.nt) > self.dev.max_shared_per_block()? {
            return self.extract_on_cpu(input, patches, progress, &sh);
        }
        let order = frame_order(patches);
        let ordered: Vec<&Patch> = order.iter().map(|&i| &patches[i]).collect();
        let image_bytes = 8 * input.image.nrows * input.image.ncols;
        let out_bytes = workspace::FrameOut::bytes_per_patch(&sh)
            + if input.options.model {
                MODEL_BOX_BYTES
            } else {
                0
            }
            + reject::box_bytes(input.options.reject_outliers.is_some(), MODEL_BOX_BYTES);
        // trace positions (two f64) and spot corners (two i32) of every spot of the bundles
        let nbundles = bundles_per_wave(&ordered, ordered.len());
        let tables = 24 * nbundles * sh.bundlesize * sh.nfull;
        let rejecting = input.options.reject_outliers.is_some();
        let frame_spots = nbundles * sh.bundle_spot_bytes();
        let keep_spots = reject::keeps_spots(rejecting, frame_spots, self.budget);
        let (nsigma, psferr) = (input.options.reject_outliers, input.options.psferr);
        self.workspace
            .reject
            .start(nsigma, psferr, keep_spots, &self.tuning);
        let kept = if keep_spots { frame_spots } else { 0 };
        let (size, left) =
            self.wave_size(&sh, image_bytes + tables + kept + patches.len() * out_bytes);
        // the normal equations kept for re-solves take what the waves leave of the budget
        let route = solve::route(self.tuning.solve, &sh);
        let slot_len = reject::kept::slot_len(&sh, route);
        let slots = reject::kept::capacity(rejecting, route, patches.len(), 8 * slot_len, left)
            .min(self.tuning.kept_slots.unwrap_or(usize::MAX));
        tracing::debug!(
            "waves of {size} patches leave {:.2} GB of the budget: {slots} slots of kept equations ({:.2} MB each)",
            left as f64 / 1e9,
            (8 * slot_len) as f64 / 1e6
        );
        let buffers = self
            .uploads
            .take()
            .unwrap_or_else(|| tables::Uploads::new(&self.dev.ctx));
        let mut host = tables::FrameHost::new(&input, &ordered, &sh, buffers, size);
        timings.reached("tables laid out", t0);
        self.reserve_waves(&sh, host.largest_wave());
        timings.reached("buffers reserved", t0);
        // The spots of the most bundles a wave can touch, allocated once: a buffer that grew
        // from wave to wave would hold its outgrown sizes until the frame's end.
        let spots = if keep_spots {
            frame_spots / 8
        } else {
            bundles_per_wave(&ordered, host.largest_wave()) * sh.bundle_spot_bytes() / 8
        };
        if self.workspace.spots.ensure(&self.dev, spots)? {
            self.workspace.last_spots = None;
        }
        let npatches = host.npatches();
        self.workspace
            .reject
            .kept
            .start(&self.dev, slots, slot_len, npatches)?;
        // by position in the frame's order
        let mut results: Vec<Option<PatchResult>> = vec![None; patches.len()];
        timings.reached("frame set up", t0);
        let solved = self.solve_frame(
            t0,
            &input,
            &sh,
            &ordered,
            &mut host,
            &mut results,
            values,
            &mut timings,
            progress,
        );
        // the buffers only grow within a frame and go after it: the device's use now is the
        // frame's peak
        if let Ok((free, total)) = self.dev.mem_info() {
            timings.device_used_bytes = total - free;
        }
        timings.pageable_upload = host.pageable;
        progress.add(host.off.len());
        for (i, r) in std::mem::take(&mut host.off) {
            results[i] = Some(r);
        }
        if solved.is_err() {
            // queued work may still read host buffers that go now
            let _ = self.dev.sync_copies();
            let _ = self.dev.sync_back();
            let _ = self.dev.sync("after a failed wave");
        }
        // every wave is done (or the device synchronised above)
        self.dev.free_retired();
        timings.reached("retired buffers freed", t0);
        let mut buffers = host.buffers;
        solved?;
        // later frames upload from pinned buffers, pinned in the background
        buffers.allow_pinning();
        self.uploads = Some(buffers);
        self.dev.bind()?;
        timings.patches = patches.len();
        timings.peak_bytes = self.dev.stats.peak();
        timings.total_ms = t0.elapsed().as_secs_f64() * 1e3;
        timings.add_critical_path(t0);
        self.log_call(&timings, &sh);
        self.timings = timings;
        // from the frame's order back to the call's
        let mut by_call: Vec<Option<PatchResult>> = vec![None; patches.len()];
        for (r, &i) in results.into_iter().zip(&order) {
            by_call[i] = r;
        }
        by_call
            .into_iter()
            .map(|r| r.ok_or_else(|| Error::Gpu("internal: a patch has no result".into())))
            .collect()
    }

    /// Sizes the per-patch buffers for waves of `largest` patches, and starts pinning the host
    /// buffers of their copies back: the first wave's come after its solve, time enough (the
    /// model boxes, when asked, may need larger ones later).
    fn reserve_waves(&mut self, sh: &Shape, largest: usize) {
        let ws = &mut self.workspace;
        ws.patches = largest;
        ws.back
            .reserve(results::Back::len(largest * sh.ncore * sh.nws, sh.nd(), 0));
        ws.verdicts
            .reserve((2 * sh.ncore + schur::VERDICTS_PER_PATCH) * largest);
        ws.coupling_back.reserve(largest);
    }

    /// The log line of a call: its time by phase, its routes and counters, its memory; and at
    /// debug level the host's milestones.
    fn log_call(&self, timings: &GpuTimings, sh: &Shape) {
        tracing::debug!(
            "host {}",
            timings
                .milestones
                .iter()
                .map(|(step, ms)| format!("{step} at {ms:.1} ms"))
                .collect::<Vec<_>>()
                .join(", ")
        );
        tracing::info!(
            "cuda: {} patches in {:.1} ms ({} waves, {} uploads; {}); {:?} route, {} patches coupled to second neighbours (largest coupling {:.1e}); {} patches solved on the CPU ({} coupled, {} after a failed retry; {} retried on the device); decorrelation: {} blocks polar (at most {} steps), {} by Jacobi after the polar route gave up; peak device memory {:.2} GB (process {:.2} GB)",
            timings.patches,
            timings.total_ms,
            timings.waves,
            if timings.pageable_upload { "pageable" } else { "pinned" },
            timings
                .phases
                .iter()
                .map(|(n, ms)| format!("{n} {ms:.1}"))
                .collect::<Vec<_>>()
                .join(", "),
            solve::route(self.tuning.solve, sh),
            timings.coupled,
            timings.max_coupling,
            timings.cpu_fallback,
            timings.coupled,
            timings.cpu_fallback - timings.coupled,
            timings.retried,
            timings.polar_blocks,
            timings.max_polar_steps,
            timings.polar_fallback,
            timings.peak_bytes as f64 / 1e9,
            timings.device_used_bytes as f64 / 1e9
        );
    }
}

/// The positions of `patches` in the frame's order: the patches of a bundle together, so that
/// a wave evaluates the spots of few bundles.
/// The most bundles that `largest` consecutive patches of `ordered` (the frame's order, by
/// bundle) touch: a bound on the bundles of any wave.
fn bundles_per_wave(ordered: &[&Patch], largest: usize) -> usize {
    let mut rank = Vec::with_capacity(ordered.len());
    for (i, p) in ordered.iter().enumerate() {
        let new = i == 0 || p.bundle_start != ordered[i - 1].bundle_start;
        rank.push(rank.last().map_or(0, |&r: &usize| r + usize::from(new)));
    }
    let span = largest.clamp(1, ordered.len().max(1));
    rank.windows(span)
        .map(|w| w[w.len() - 1] - w[0] + 1)
        .max()
        .unwrap_or(1)
}

fn frame_order(patches: &[Patch]) -> Vec<usize> {
    let mut order: BTreeMap<(usize, usize), usize> = BTreeMap::new();
    for (i, p) in patches.iter().enumerate() {
        order.insert((p.bundle_start, p.index), i);
    }
    order.into_values().collect()
}

/// Number of CUDA devices this process sees (after `CUDA_VISIBLE_DEVICES`): the MPI layer maps
/// ranks to them. An error when the CUDA libraries cannot be loaded.
pub fn device_count() -> Result<usize> {
    device::check_libraries()?;
    let n = cudarc::driver::CudaContext::device_count()
        .map_err(error::driver("cannot count CUDA devices"))?;
    Ok(n.max(0) as usize)
}

/// Whether this process has not started the CUDA driver yet, so that `CUDA_VISIBLE_DEVICES`
/// still decides which devices it will show. False when the driver cannot be loaded.
pub fn driver_unstarted() -> bool {
    use cudarc::driver::sys::cudaError_enum::CUDA_ERROR_NOT_INITIALIZED;
    device::check_libraries().is_ok()
        && matches!(
            cudarc::driver::result::device::get_count(),
            Err(e) if e.0 == CUDA_ERROR_NOT_INITIALIZED
        )
}
