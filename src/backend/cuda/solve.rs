//! The batched solve of a chunk of patches on the device (DESIGN "Solve of one patch", the
//! same steps as [`crate::backend::cpu`]):
//!
//! 1. spots of every bundle in the chunk from host-evaluated parameters;
//! 2. sparse assembly of icov, y, fluxweight (one thread block per column) and regularisation;
//! 3. batched Cholesky (cuSOLVER) of icov padded to one size: every patch gets `nblock` fiber
//!    blocks of `nwavetot` unknowns, unused leading blocks are zero columns whose regularised
//!    diagonal decouples them exactly; failures are re-assembled and retried with
//!    regularize 1e-4, and a second failure goes to the CPU reference for that patch;
//! 4. xflux by batched triangular solves; the core blocks of icov^-1 as `X^T X` with
//!    `X = L22^-1` (batched trsm, then one strided batched GEMM);
//! 5. per core block, the Jacobi inverse square root and R, ivar, flux, resolution;
//! 6. the model of each patch, chi2pix and the optional core model image.
//!
//! Only the core results (and the model boxes when asked) come back to the host.

use std::collections::BTreeMap;
use std::time::Instant;

use cudarc::cublas::sys as cublas_sys;
use cudarc::cusolver::sys as cusolver_sys;
use cudarc::driver::CudaEvent;
use rayon::prelude::*;

use super::device::{DevBuf, Device, PinnedBuf};
use super::error;
use super::kernels::{launch, Args, Kernels};
use crate::backend::cpu::{self, EIGEN_CLIP, RETRY_REGULARIZE};
use crate::backend::FrameInput;
use crate::error::{Error, Result};
use crate::extract::{ModelPatch, PatchGeometry, PatchResult, PatchStatus};
use crate::plan::Patch;
use crate::psf::{Corners, GaussHermitePsf, Spots};

/// Threads per block of the Jacobi kernel.
const JACOBI_THREADS: u32 = 256;

/// Time spent in each phase, summed over chunks (device phases from CUDA events, host phases
/// from the wall clock).
#[derive(Clone, Debug, Default)]
pub struct GpuTimings {
    /// `(phase, milliseconds)` in execution order.
    pub phases: Vec<(&'static str, f64)>,
    /// Wall time of the whole `extract` call, milliseconds.
    pub total_ms: f64,
    /// Peak device memory held by the backend's buffers during the call, bytes.
    pub peak_bytes: usize,
    /// Device memory in use (all of the process, libraries included) at the end of the
    /// largest chunk, bytes, from cuMemGetInfo.
    pub device_used_bytes: usize,
    pub chunks: usize,
    pub patches: usize,
    /// Patches whose first factorisation failed and that were retried with regularize 1e-4.
    pub retried: usize,
    /// Patches handed to the CPU reference after the retry failed too.
    pub cpu_fallback: usize,
    /// Largest number of Jacobi sweeps of any block.
    pub max_sweeps: i32,
}

impl GpuTimings {
    fn add(&mut self, phase: &'static str, ms: f64) {
        if let Some(p) = self.phases.iter_mut().find(|p| p.0 == phase) {
            p.1 += ms;
        } else {
            self.phases.push((phase, ms));
        }
    }
}

/// Shapes shared by every patch of a call.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Shape {
    pub nx: usize,
    pub ny: usize,
    pub nt: usize,
    pub nws: usize,
    pub wavepad: usize,
    pub ncore: usize,
    pub nblock: usize,
    pub nfull: usize,
    pub bundlesize: usize,
    pub ndiag: usize,
    pub stride: usize,
}

impl Shape {
    pub(crate) fn new(input: &FrameInput<'_>, patches: &[Patch]) -> Self {
        let plan = input.plan;
        let (ny, nx) = input.psf.spot_shape();
        let ncore = plan.options.bundlesize / plan.options.nsubbundles;
        let nblock = patches
            .iter()
            .map(|p| p.nspecpad())
            .max()
            .unwrap_or(ncore)
            .max(ncore);
        Shape {
            nx,
            ny,
            nt: plan.nwavetot,
            nws: plan.options.nwavestep,
            wavepad: plan.wavepad,
            ncore,
            nblock,
            nfull: plan.fullwave.len(),
            bundlesize: plan.options.bundlesize,
            ndiag: input.psf.hsizey,
            stride: 4 + input.psf.ngh(),
        }
    }

    pub(crate) fn m(&self) -> usize {
        self.nblock * self.nt
    }

    pub(crate) fn mc(&self) -> usize {
        self.ncore * self.nt
    }

    pub(crate) fn nd(&self) -> usize {
        2 * self.ndiag + 1
    }

    /// Device bytes per patch of the per-patch buffers (icov, X, C blocks, vectors, outputs),
    /// without the model boxes.
    pub(crate) fn bytes_per_patch(&self) -> usize {
        let (m, mc, nt) = (self.m(), self.mc(), self.nt);
        8 * (m * m
            + mc * mc
            + self.ncore * nt * nt
            + 6 * m
            + self.ncore * self.nws * (4 + self.nd()))
            + 4 * m
            + 64
    }
}

/// CUDA events around the phases of a chunk.
struct PhaseClock<'a> {
    dev: &'a Device,
    marks: Vec<(&'static str, CudaEvent)>,
}

impl<'a> PhaseClock<'a> {
    fn new(dev: &'a Device) -> Self {
        PhaseClock {
            dev,
            marks: Vec::new(),
        }
    }

    /// Marks the end of phase `name` (its start is the previous mark).
    fn mark(&mut self, name: &'static str) -> Result<()> {
        let ev = self
            .dev
            .ctx
            .new_event(Some(cudarc::driver::sys::CUevent_flags::CU_EVENT_DEFAULT))
            .map_err(error::driver("cuEventCreate"))?;
        ev.record(&self.dev.stream)
            .map_err(error::driver("cuEventRecord"))?;
        self.marks.push((name, ev));
        Ok(())
    }

    /// Adds the elapsed times to `t` (after the stream has been synchronised).
    fn collect(&self, t: &mut GpuTimings) -> Result<()> {
        for w in self.marks.windows(2) {
            let ms = w[0]
                .1
                .elapsed_ms(&w[1].1)
                .map_err(error::driver("cuEventElapsedTime"))?;
            t.add(w[1].0, ms as f64);
        }
        Ok(())
    }
}

/// Host-side tables of a chunk.
struct ChunkHost {
    /// Patches of the chunk that have pixels, with their geometry and bundle slot.
    live: Vec<(usize, PatchGeometry, usize)>,
    /// Results of patches without pixels (off the CCD), by position in the chunk.
    off: Vec<(usize, PatchResult)>,
    bundles: Vec<usize>,
    params: Vec<f64>,
    corners: Vec<i32>,
    colspot: Vec<i32>,
    boxes: Vec<i32>,
    nkeep: Vec<i32>,
    boxoff: Vec<i64>,
    box_total: usize,
    region: (usize, usize, usize, usize),
}

/// Spot parameters and corners of a bundle on the padded grid.
fn bundle_params(
    psf: &GaussHermitePsf,
    fibers: std::ops::Range<usize>,
    waves: &[f64],
    stride: usize,
) -> (Vec<f64>, Corners) {
    let params = psf.params_flat(fibers.clone(), waves);
    let n = params.len() / stride;
    let (ny, nx) = psf.spot_shape();
    let mut xc = Vec::with_capacity(n);
    let mut yc = Vec::with_capacity(n);
    for s in 0..n {
        let (x, y) = psf.corner_of(params[s * stride], params[s * stride + 1]);
        xc.push(x);
        yc.push(y);
    }
    let corners = Corners {
        fibers,
        nwave: waves.len(),
        ny,
        nx,
        xc,
        yc,
    };
    (params, corners)
}

fn prepare(input: &FrameInput<'_>, chunk: &[&Patch], sh: &Shape) -> ChunkHost {
    let plan = input.plan;
    let mut bundles: Vec<usize> = chunk.iter().map(|p| p.bundle_start).collect();
    bundles.sort_unstable();
    bundles.dedup();
    let per_bundle: Vec<(Vec<f64>, Corners)> = bundles
        .par_iter()
        .map(|&b| bundle_params(input.psf, b..b + sh.bundlesize, &plan.fullwave, sh.stride))
        .collect();
    let ccd = (input.image.nrows, input.image.ncols);
    let m = sh.m();
    let mut live = Vec::new();
    let mut off = Vec::new();
    for (i, p) in chunk.iter().enumerate() {
        let slot = bundles
            .binary_search(&p.bundle_start)
            .expect("bundle listed");
        let geom = PatchGeometry::new(plan, p, &per_bundle[slot].1, ccd);
        if geom.is_empty() {
            off.push((i, PatchResult::empty(p, sh.ndiag, PatchStatus::OffImage)));
        } else {
            live.push((i, geom, slot));
        }
    }
    let mut colspot = vec![-1i32; live.len() * m];
    let mut boxes = Vec::with_capacity(live.len() * 4);
    let mut nkeep = Vec::with_capacity(live.len());
    let mut boxoff = Vec::with_capacity(live.len());
    let mut box_total = 0usize;
    let mut region = (usize::MAX, 0, usize::MAX, 0);
    for (k, (i, g, slot)) in live.iter().enumerate() {
        let nb = g.block_fibers.len();
        let lead = sh.nblock - nb;
        for (b, &f) in g.block_fibers.iter().enumerate() {
            let base = (slot * sh.bundlesize + f) * sh.nfull + g.wave0;
            for w in 0..sh.nt {
                colspot[k * m + (lead + b) * sh.nt + w] = (base + w) as i32;
            }
        }
        boxes.extend_from_slice(&[
            g.rows.start as i32,
            g.rows.end as i32,
            g.cols.start as i32,
            g.cols.end as i32,
        ]);
        nkeep.push(chunk[*i].waves.len() as i32);
        boxoff.push(box_total as i64);
        box_total += g.rows.len() * g.cols.len();
        region = (
            region.0.min(g.rows.start),
            region.1.max(g.rows.end),
            region.2.min(g.cols.start),
            region.3.max(g.cols.end),
        );
    }
    let mut params = Vec::with_capacity(bundles.len() * sh.bundlesize * sh.nfull * sh.stride);
    let mut corners = Vec::with_capacity(bundles.len() * sh.bundlesize * sh.nfull * 2);
    for (p, c) in &per_bundle {
        params.extend_from_slice(p);
        for (x, y) in c.xc.iter().zip(&c.yc) {
            corners.push(*x);
            corners.push(*y);
        }
    }
    ChunkHost {
        live,
        off,
        bundles,
        params,
        corners,
        colspot,
        boxes,
        nkeep,
        boxoff,
        box_total,
        region,
    }
}

/// Device addresses `base + i * step` for `ids`, as a device array of pointers.
fn pointer_array(
    dev: &Device,
    base: u64,
    step: usize,
    ids: &[usize],
    what: &str,
) -> Result<DevBuf<u64>> {
    let host: Vec<u64> = ids.iter().map(|&i| base + (i * step * 8) as u64).collect();
    dev.upload(&host, what)
}

/// Launches assembly (and regularisation) for `patch_ids` (all live patches when None).
#[allow(clippy::too_many_arguments)]
fn assemble(
    dev: &Device,
    k: &Kernels,
    sh: &Shape,
    n: usize,
    ids: Option<&DevBuf<i32>>,
    bufs: &ChunkDev,
    reg: f64,
) -> Result<()> {
    let m = sh.m();
    let size = sh.nx * sh.ny;
    let ids_ptr = ids.map_or(0, |b| b.ptr);
    launch(
        dev,
        &k.assemble,
        "assemble_f64",
        (m as u32, n as u32, 1),
        128,
        (size + m + 32) * 8,
        Args::new()
            .ptr(bufs.spots.ptr)
            .ptr(bufs.corners.ptr)
            .ptr(bufs.colspot.ptr)
            .ptr(bufs.boxes.ptr)
            .ptr(ids_ptr)
            .ptr(bufs.pix.ptr)
            .ptr(bufs.ivar.ptr)
            .i32(bufs.region.0 as i32)
            .i32(bufs.region.2 as i32)
            .i32((bufs.region.3 - bufs.region.2) as i32)
            .i32(m as i32)
            .i32(sh.nx as i32)
            .i32(sh.ny as i32)
            .i32(sh.nt as i32)
            .i32(sh.ncore as i32)
            .i32(sh.wavepad as i32)
            .i32(sh.nws as i32)
            .ptr(bufs.icov.ptr)
            .ptr(bufs.y.ptr)
            .ptr(bufs.fw.ptr)
            .ptr(bufs.diag0.ptr)
            .ptr(bufs.pixmask.ptr),
    )?;
    launch(
        dev,
        &k.regularize,
        "regularize_f64",
        (n as u32, 1, 1),
        256,
        0,
        Args::new()
            .ptr(bufs.icov.ptr)
            .ptr(bufs.fw.ptr)
            .ptr(bufs.diag0.ptr)
            .ptr(ids_ptr)
            .i32(m as i32)
            .f64(reg)
            .ptr(bufs.masked.ptr),
    )
}

/// Batched Cholesky of the patches `ids`; returns cuSOLVER's info per patch.
fn factorize(dev: &Device, sh: &Shape, icov: &DevBuf<f64>, ids: &[usize]) -> Result<Vec<i32>> {
    let m = sh.m();
    let ptrs = pointer_array(dev, icov.ptr, m * m, ids, "Cholesky pointer array")?;
    let info = dev.zeros::<i32>(ids.len(), "Cholesky info")?;
    // SAFETY: every pointer addresses an m x m matrix inside `icov`.
    let status = unsafe {
        cusolver_sys::cusolverDnDpotrfBatched(
            dev.cusolver,
            cusolver_sys::cublasFillMode_t::CUBLAS_FILL_MODE_LOWER,
            m as i32,
            ptrs.ptr as *mut *mut f64,
            m as i32,
            info.ptr as *mut i32,
            ids.len() as i32,
        )
    };
    error::cusolver(
        status,
        &format!(
            "cusolverDnDpotrfBatched of {} patches of order {m}",
            ids.len()
        ),
    )?;
    let mut host = vec![0i32; ids.len()];
    dev.copy_from(&mut host, &info, 0, "Cholesky info")?;
    dev.sync("Cholesky factorisation")?;
    Ok(host)
}

/// Device buffers of a chunk.
struct ChunkDev {
    region: (usize, usize, usize, usize),
    spots: DevBuf<f64>,
    corners: DevBuf<i32>,
    colspot: DevBuf<i32>,
    boxes: DevBuf<i32>,
    pix: DevBuf<f32>,
    ivar: DevBuf<f32>,
    icov: DevBuf<f64>,
    y: DevBuf<f64>,
    fw: DevBuf<f64>,
    diag0: DevBuf<f64>,
    pixmask: DevBuf<f64>,
    masked: DevBuf<i32>,
}

/// Solves one chunk; results in the order of `chunk`.
pub(crate) fn solve_chunk(
    dev: &Device,
    k: &Kernels,
    input: &FrameInput<'_>,
    chunk: &[&Patch],
    sh: &Shape,
    timings: &mut GpuTimings,
) -> Result<Vec<PatchResult>> {
    let t_host = Instant::now();
    let host = {
        let _r = nvtx::LocalRange::new(c"host tables");
        prepare(input, chunk, sh)
    };
    timings.add("host tables", t_host.elapsed().as_secs_f64() * 1e3);
    let mut results: Vec<Option<PatchResult>> = vec![None; chunk.len()];
    for (i, r) in host.off {
        results[i] = Some(r);
    }
    let n = host.live.len();
    if n == 0 {
        return Ok(results
            .into_iter()
            .map(|r| r.expect("off-image result"))
            .collect());
    }
    let (m, mc, nt, nws, ncore, nd) = (sh.m(), sh.mc(), sh.nt, sh.nws, sh.ncore, sh.nd());
    let k0 = m - mc;
    let img = input.image;
    let region = host.region;
    let (rh, rw) = (region.1 - region.0, region.3 - region.2);

    let mut clock = PhaseClock::new(dev);
    clock.mark("start")?;
    // Uploads: the image region through pinned buffers, the tables directly.
    let t_pack = Instant::now();
    let copies = nvtx::LocalRange::new(c"copies in");
    let mut pin_pix = PinnedBuf::<f32>::new(rh * rw)?;
    let mut pin_ivar = PinnedBuf::<f32>::new(rh * rw)?;
    {
        let (pp, pv) = (pin_pix.as_mut_slice(), pin_ivar.as_mut_slice());
        pp.par_chunks_mut(rw)
            .zip(pv.par_chunks_mut(rw))
            .enumerate()
            .for_each(|(r, (dp, dv))| {
                let row = (region.0 + r) * img.ncols;
                dp.copy_from_slice(&img.pix[row + region.2..row + region.3]);
                dv.copy_from_slice(&img.ivar[row + region.2..row + region.3]);
            });
    }
    timings.add("host tables", t_pack.elapsed().as_secs_f64() * 1e3);
    let nspot = host.params.len() / sh.stride;
    let size = sh.nx * sh.ny;
    let bufs = ChunkDev {
        region,
        spots: dev.alloc(nspot * size, "spots")?,
        corners: dev.upload(&host.corners, "spot corners")?,
        colspot: dev.upload(&host.colspot, "column table")?,
        boxes: dev.upload(&host.boxes, "pixel boxes")?,
        pix: dev.upload(pin_pix.as_slice(), "image pixels")?,
        ivar: dev.upload(pin_ivar.as_slice(), "image inverse variance")?,
        icov: dev.alloc(n * m * m, &format!("icov of {n} patches of order {m}"))?,
        y: dev.alloc(n * m, "y")?,
        fw: dev.alloc(n * m, "fluxweight")?,
        diag0: dev.alloc(n * m, "icov diagonal")?,
        pixmask: dev.zeros(n * ncore * nws, "pixmask fraction")?,
        masked: dev.zeros(n, "masked flags")?,
    };
    let params = dev.upload(&host.params, "spot parameters")?;
    let nkeep = dev.upload(&host.nkeep, "kept bins")?;
    let boxoff = dev.upload(&host.boxoff, "box offsets")?;
    drop(copies);
    clock.mark("copies in")?;

    {
        let _r = nvtx::LocalRange::new(c"spots");
        let psf = input.psf;
        let (ngx, ngy) = (psf.ghdegx + 1, psf.ghdegy + 1);
        let smem = (sh.nx + 1) * (1 + psf.ghdegx)
            + ngx * sh.nx
            + (sh.ny + 1) * (1 + psf.ghdegy)
            + ngy * sh.ny
            + ngx * sh.ny
            + ngx * ngy
            + 32;
        launch(
            dev,
            &k.spots,
            "spots_f64",
            (nspot as u32, 1, 1),
            128,
            smem * 8,
            Args::new()
                .ptr(params.ptr)
                .i32(nspot as i32)
                .i32(sh.stride as i32)
                .i32(psf.ghdegx as i32)
                .i32(psf.ghdegy as i32)
                .i32(sh.nx as i32)
                .i32(sh.ny as i32)
                .ptr(bufs.spots.ptr),
        )?;
    }
    clock.mark("spots")?;
    {
        let _r = nvtx::LocalRange::new(c"assemble");
        assemble(dev, k, sh, n, None, &bufs, input.options.regularize)?;
    }
    clock.mark("assemble")?;

    // Factorisation, with the retry of DESIGN step 2 for the patches that fail.
    let fact = nvtx::LocalRange::new(c"factorize");
    let all: Vec<usize> = (0..n).collect();
    let info = factorize(dev, sh, &bufs.icov, &all)?;
    let mut masked = vec![0i32; n];
    dev.copy_from(&mut masked, &bufs.masked, 0, "masked flags")?;
    dev.sync("masked flags")?;
    let failed: Vec<usize> = (0..n).filter(|&i| info[i] != 0 && masked[i] == 0).collect();
    let mut status = vec![PatchStatus::Ok; n];
    let mut to_cpu = Vec::new();
    if !failed.is_empty() {
        timings.retried += failed.len();
        for &i in &failed {
            let p = chunk[host.live[i].0];
            tracing::debug!(
                "patch fibers {:?} bins {:?}: Cholesky failed (minor {}), retrying with regularize {RETRY_REGULARIZE}",
                p.fibers,
                p.waves,
                info[i]
            );
        }
        if input.options.regularize == RETRY_REGULARIZE {
            to_cpu = failed;
        } else {
            let ids: Vec<i32> = failed.iter().map(|&i| i as i32).collect();
            let ids_dev = dev.upload(&ids, "retry patch list")?;
            assemble(
                dev,
                k,
                sh,
                failed.len(),
                Some(&ids_dev),
                &bufs,
                RETRY_REGULARIZE,
            )?;
            let info2 = factorize(dev, sh, &bufs.icov, &failed)?;
            for (j, &i) in failed.iter().enumerate() {
                if info2[j] == 0 {
                    status[i] = PatchStatus::Regularized;
                } else {
                    to_cpu.push(i);
                }
            }
        }
        timings.cpu_fallback += to_cpu.len();
    }
    drop(fact);
    clock.mark("factorize")?;

    // xflux = icov^-1 y.
    let solve = nvtx::LocalRange::new(c"solve");
    let x = dev.alloc::<f64>(n * m, "xflux")?;
    dev.dtod(&x, &bufs.y)?;
    {
        let a_ptrs = pointer_array(dev, bufs.icov.ptr, m * m, &all, "solve pointer array")?;
        let b_ptrs = pointer_array(dev, x.ptr, m, &all, "solve rhs pointer array")?;
        let info = dev.zeros::<i32>(1, "solve info")?;
        // SAFETY: pointers address the factors and right-hand sides of every live patch.
        let st = unsafe {
            cusolver_sys::cusolverDnDpotrsBatched(
                dev.cusolver,
                cusolver_sys::cublasFillMode_t::CUBLAS_FILL_MODE_LOWER,
                m as i32,
                1,
                a_ptrs.ptr as *mut *mut f64,
                m as i32,
                b_ptrs.ptr as *mut *mut f64,
                m as i32,
                info.ptr as *mut i32,
                n as i32,
            )
        };
        error::cusolver(st, &format!("cusolverDnDpotrsBatched of {n} patches"))?;
        dev.sync("triangular solves")?;
    }
    drop(solve);
    clock.mark("solve")?;

    // Core blocks of icov^-1: X = L22^-1 (trsm on the identity), C_b = X_b^T X_b.
    let inv = nvtx::LocalRange::new(c"inverse");
    let cblocks = {
        let xinv =
            dev.alloc::<f64>(n * mc * mc, &format!("L22^-1 of {n} patches of order {mc}"))?;
        launch(
            dev,
            &k.eye,
            "eye_f64",
            (((n * mc * mc).div_ceil(256)).min(65535 * 8) as u32, 1, 1),
            256,
            0,
            Args::new().ptr(xinv.ptr).i32(mc as i32).i64(n as i64),
        )?;
        let l_ptrs: Vec<u64> = (0..n)
            .map(|i| bufs.icov.at(i * m * m + k0 * m + k0))
            .collect();
        let l_ptrs = dev.upload(&l_ptrs, "trsm pointer array")?;
        let x_ptrs = pointer_array(dev, xinv.ptr, mc * mc, &all, "trsm rhs pointer array")?;
        let one = 1.0f64;
        let zero = 0.0f64;
        // SAFETY: every pointer addresses an mc x mc block (lda m) or matrix (ld mc).
        unsafe {
            error::cublas(
                cublas_sys::cublasDtrsmBatched(
                    dev.cublas,
                    cublas_sys::cublasSideMode_t::CUBLAS_SIDE_LEFT,
                    cublas_sys::cublasFillMode_t::CUBLAS_FILL_MODE_LOWER,
                    cublas_sys::cublasOperation_t::CUBLAS_OP_N,
                    cublas_sys::cublasDiagType_t::CUBLAS_DIAG_NON_UNIT,
                    mc as i32,
                    mc as i32,
                    &one,
                    l_ptrs.ptr as *const *const f64,
                    m as i32,
                    x_ptrs.ptr as *const *mut f64,
                    mc as i32,
                    n as i32,
                ),
                &format!("cublasDtrsmBatched of {n} blocks of order {mc}"),
            )?;
        }
        let cb = dev.alloc::<f64>(n * ncore * nt * nt, "covariance blocks")?;
        // SAFETY: consecutive (patch, core block) pairs are nt * mc apart in `xinv`.
        unsafe {
            error::cublas(
                cublas_sys::cublasDgemmStridedBatched(
                    dev.cublas,
                    cublas_sys::cublasOperation_t::CUBLAS_OP_T,
                    cublas_sys::cublasOperation_t::CUBLAS_OP_N,
                    nt as i32,
                    nt as i32,
                    mc as i32,
                    &one,
                    xinv.ptr as *const f64,
                    mc as i32,
                    (nt * mc) as i64,
                    xinv.ptr as *const f64,
                    mc as i32,
                    (nt * mc) as i64,
                    &zero,
                    cb.ptr as *mut f64,
                    nt as i32,
                    (nt * nt) as i64,
                    (n * ncore) as i32,
                ),
                &format!("cublasDgemmStridedBatched of {} blocks", n * ncore),
            )?;
        }
        dev.sync("covariance blocks")?;
        cb
    };
    drop(inv);
    clock.mark("inverse")?;

    // Decorrelation.
    let dec = nvtx::LocalRange::new(c"decorrelate");
    let flux = dev.alloc::<f64>(n * ncore * nws, "flux")?;
    let ivar = dev.alloc::<f64>(n * ncore * nws, "ivar")?;
    let res = dev.alloc::<f64>(n * ncore * nd * nws, "resolution")?;
    let fluxcol = dev.zeros::<f64>(n * m, "core flux by column")?;
    let sweeps = dev.zeros::<i32>(n * ncore, "Jacobi sweeps")?;
    decorrelate(
        dev,
        k,
        sh,
        n * ncore,
        &cblocks,
        &x,
        &nkeep,
        &flux,
        &ivar,
        &res,
        &fluxcol,
        &sweeps,
        0,
    )?;
    drop(cblocks);
    drop(dec);
    clock.mark("decorrelate")?;

    // chi2pix from the model of xflux, and the optional model image of the core.
    let fin = nvtx::LocalRange::new(c"finalize");
    let model = dev.zeros::<f64>(host.box_total, "patch models")?;
    let project = |xv: &DevBuf<f64>, out: &DevBuf<f64>| {
        launch(
            dev,
            &k.project,
            "project_f64",
            (m as u32, n as u32, 1),
            64,
            0,
            Args::new()
                .ptr(bufs.spots.ptr)
                .ptr(bufs.corners.ptr)
                .ptr(bufs.colspot.ptr)
                .ptr(bufs.boxes.ptr)
                .ptr(boxoff.ptr)
                .ptr(xv.ptr)
                .i32(m as i32)
                .i32(sh.nx as i32)
                .i32(sh.ny as i32)
                .ptr(out.ptr),
        )
    };
    project(&x, &model)?;
    let chi2 = dev.alloc::<f64>(n * ncore * nws, "chi2pix")?;
    launch(
        dev,
        &k.chi2pix,
        "chi2pix_f64",
        ((ncore * nws) as u32, n as u32, 1),
        64,
        0,
        Args::new()
            .ptr(bufs.spots.ptr)
            .ptr(bufs.corners.ptr)
            .ptr(bufs.colspot.ptr)
            .ptr(bufs.boxes.ptr)
            .ptr(boxoff.ptr)
            .ptr(model.ptr)
            .ptr(bufs.pix.ptr)
            .ptr(bufs.ivar.ptr)
            .i32(region.0 as i32)
            .i32(region.2 as i32)
            .i32(rw as i32)
            .ptr(nkeep.ptr)
            .i32(m as i32)
            .i32(sh.nx as i32)
            .i32(sh.ny as i32)
            .i32(nt as i32)
            .i32(ncore as i32)
            .i32(sh.wavepad as i32)
            .i32(nws as i32)
            .f64(input.options.psferr)
            .ptr(chi2.ptr),
    )?;
    let core_model = if input.options.model {
        dev.memset_zero(&model)?;
        project(&fluxcol, &model)?;
        true
    } else {
        false
    };
    drop(fin);
    clock.mark("finalize")?;

    // Copies back: core arrays only (and the model boxes when asked).
    let out = nvtx::LocalRange::new(c"copies out");
    let per = n * ncore * nws;
    let mut back =
        PinnedBuf::<f64>::new(per * (4 + nd) + if core_model { host.box_total } else { 0 })?;
    {
        let s = back.as_mut_slice();
        let (a, rest) = s.split_at_mut(per);
        dev.copy_from(a, &flux, 0, "flux")?;
        let (a, rest) = rest.split_at_mut(per);
        dev.copy_from(a, &ivar, 0, "ivar")?;
        let (a, rest) = rest.split_at_mut(per);
        dev.copy_from(a, &bufs.pixmask, 0, "pixmask fraction")?;
        let (a, rest) = rest.split_at_mut(per);
        dev.copy_from(a, &chi2, 0, "chi2pix")?;
        let (a, rest) = rest.split_at_mut(per * nd);
        dev.copy_from(a, &res, 0, "resolution")?;
        if core_model {
            dev.copy_from(rest, &model, 0, "model")?;
        }
    }
    let mut sweeps_host = vec![0i32; n * ncore];
    dev.copy_from(&mut sweeps_host, &sweeps, 0, "Jacobi sweeps")?;
    clock.mark("copies out")?;
    dev.sync("chunk results")?;
    drop(out);
    clock.collect(timings)?;
    timings.max_sweeps = timings
        .max_sweeps
        .max(sweeps_host.iter().copied().max().unwrap_or(0));
    if let Ok((free, total)) = dev.mem_info() {
        timings.device_used_bytes = timings.device_used_bytes.max(total - free);
    }

    let t_res = Instant::now();
    let back = back.as_slice();
    let (bflux, rest) = back.split_at(per);
    let (bivar, rest) = rest.split_at(per);
    let (bmask, rest) = rest.split_at(per);
    let (bchi2, rest) = rest.split_at(per);
    let (bres, bmodel) = rest.split_at(per * nd);
    let mut host_spots: BTreeMap<usize, Spots> = BTreeMap::new();
    for (li, (ci, geom, slot)) in host.live.iter().enumerate() {
        let patch = chunk[*ci];
        if to_cpu.contains(&li) {
            let b = host.bundles[*slot];
            let spots = host_spots
                .entry(b)
                .or_insert_with(|| input.psf.spots(b..b + sh.bundlesize, &input.plan.fullwave));
            tracing::warn!(
                "patch fibers {:?} bins {:?}: Cholesky failed twice on the GPU, solved on the CPU",
                patch.fibers,
                patch.waves
            );
            results[*ci] = Some(cpu::solve_patch(
                input.plan,
                patch,
                spots,
                img,
                input.options,
            ));
            continue;
        }
        let nk = patch.waves.len();
        let mut r = PatchResult::empty(patch, sh.ndiag, status[li]);
        for c in 0..ncore {
            let o = (li * ncore + c) * nws;
            r.pixmask_fraction[c * nk..(c + 1) * nk].copy_from_slice(&bmask[o..o + nk]);
        }
        if masked[li] != 0 {
            r.status = PatchStatus::Masked;
            results[*ci] = Some(r);
            continue;
        }
        for c in 0..ncore {
            let o = (li * ncore + c) * nws;
            r.flux[c * nk..(c + 1) * nk].copy_from_slice(&bflux[o..o + nk]);
            r.ivar[c * nk..(c + 1) * nk].copy_from_slice(&bivar[o..o + nk]);
            r.chi2pix[c * nk..(c + 1) * nk].copy_from_slice(&bchi2[o..o + nk]);
            for d in 0..nd {
                let o = ((li * ncore + c) * nd + d) * nws;
                r.resolution[(c * nd + d) * nk..(c * nd + d + 1) * nk]
                    .copy_from_slice(&bres[o..o + nk]);
            }
        }
        if core_model {
            let o = host.boxoff[li] as usize;
            let len = geom.rows.len() * geom.cols.len();
            r.model = Some(ModelPatch {
                rows: geom.rows.clone(),
                cols: geom.cols.clone(),
                data: bmodel[o..o + len].to_vec(),
            });
        }
        if !r.is_finite() {
            tracing::warn!(
                "patch fibers {:?} bins {:?}: non-finite solution, flux and ivar set to 0",
                patch.fibers,
                patch.waves
            );
            let mut empty = PatchResult::empty(patch, sh.ndiag, PatchStatus::NonFinite);
            empty.pixmask_fraction = r.pixmask_fraction;
            r = empty;
        }
        results[*ci] = Some(r);
    }
    timings.add("host results", t_res.elapsed().as_secs_f64() * 1e3);
    results
        .into_iter()
        .map(|r| r.ok_or_else(|| Error::Gpu("internal: a patch of the chunk has no result".into())))
        .collect()
}

/// Launches the Jacobi decorrelation on `nblocks` covariance blocks of order `sh.nt`.
#[allow(clippy::too_many_arguments)]
pub(crate) fn decorrelate(
    dev: &Device,
    k: &Kernels,
    sh: &Shape,
    nblocks: usize,
    cblocks: &DevBuf<f64>,
    xflux: &DevBuf<f64>,
    nkeep: &DevBuf<i32>,
    flux: &DevBuf<f64>,
    ivar: &DevBuf<f64>,
    res: &DevBuf<f64>,
    fluxcol: &DevBuf<f64>,
    sweeps: &DevBuf<i32>,
    qout: u64,
) -> Result<()> {
    let n = sh.nt;
    let npair = n.div_ceil(2);
    let smem = (2 * n * n + 2 * npair + 2 * n + 32 + (2 * npair + 2).div_ceil(2)) * 8;
    launch(
        dev,
        &k.decorrelate,
        "decorrelate_f64",
        (nblocks as u32, 1, 1),
        JACOBI_THREADS,
        smem,
        Args::new()
            .ptr(cblocks.ptr)
            .ptr(xflux.ptr)
            .ptr(nkeep.ptr)
            .i32(n as i32)
            .i32(sh.m() as i32)
            .i32(sh.ncore as i32)
            .i32(sh.wavepad as i32)
            .i32(sh.nws as i32)
            .i32(sh.ndiag as i32)
            .f64(EIGEN_CLIP)
            .ptr(flux.ptr)
            .ptr(ivar.ptr)
            .ptr(res.ptr)
            .ptr(fluxcol.ptr)
            .ptr(sweeps.ptr)
            .ptr(qout),
    )
}
