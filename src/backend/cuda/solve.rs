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
use cudarc::driver::{CudaContext, CudaEvent};
use rayon::prelude::*;

use super::device::{DevBuf, Device, PinSlot, PinnedBuf, Slot};
use super::error;
use super::kernels::{launch, Args, Kernels};
use crate::backend::cpu::{self, EIGEN_CLIP, RETRY_REGULARIZE};
use crate::backend::FrameInput;
use crate::error::{Error, Result};
use crate::extract::{ModelPatch, PatchGeometry, PatchResult, PatchStatus};
use crate::plan::Patch;
use crate::psf::{Corners, GaussHermitePsf, Spots};

/// Jacobi rotations are skipped where `|a_pq| <= tol sqrt(a_pp a_qq)`. 1e-14 keeps the
/// decorrelation within rounding of an exact eigendecomposition for the extraction's
/// purposes (`SPEX_GPU_JACOBI_TOL` overrides it, for tuning).
fn jacobi_tol() -> f64 {
    std::env::var("SPEX_GPU_JACOBI_TOL")
        .ok()
        .and_then(|v| v.trim().parse().ok())
        .unwrap_or(1e-14)
}

/// About how many threads a block of the Jacobi kernel has (`SPEX_GPU_JACOBI_THREADS`
/// overrides it, for tuning).
fn jacobi_threads() -> u32 {
    std::env::var("SPEX_GPU_JACOBI_THREADS")
        .ok()
        .and_then(|v| v.trim().parse().ok())
        .unwrap_or(512)
}

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
}

impl Shape {
    pub(crate) fn new(input: &FrameInput<'_>, patches: &[Patch]) -> Self {
        let plan = input.plan;
        let (ny, nx) = input.psf.spot_shape();
        let ncore = plan.options.layout.bundlesize / plan.options.layout.nsubbundles;
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
            nws: plan.options.layout.nwavestep,
            wavepad: plan.wavepad,
            ncore,
            nblock,
            nfull: plan.fullwave.len(),
            bundlesize: plan.options.layout.bundlesize,
            ndiag: input.psf.hsizey,
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

    /// Device bytes per patch of the per-patch buffers (icov, which later holds the covariance
    /// blocks, L22^-1, vectors, outputs), without the model boxes.
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
pub(crate) struct ChunkHost {
    /// Patches of the chunk that have pixels, with their geometry and bundle slot.
    live: Vec<(usize, PatchGeometry, usize)>,
    /// Results of patches without pixels (off the CCD), by position in the chunk.
    off: Vec<(usize, PatchResult)>,
    bundles: Vec<usize>,
    /// Trace positions `[spot][x, y]`, spot = (bundle slot * bundlesize + fiber) * nfull + wave.
    xy: Vec<f64>,
    /// Legendre coefficients of GHSIGX, GHSIGY and the GH-i-j, `[fiber][param][k]`.
    coef: Vec<f64>,
    corners: Vec<i32>,
    colspot: Vec<i32>,
    boxes: Vec<i32>,
    nkeep: Vec<i32>,
    boxoff: Vec<i64>,
    box_total: usize,
    region: (usize, usize, usize, usize),
    /// The image region: pixels, then inverse variances, row by row (pinned, for the upload).
    image: Option<PinnedBuf<f32>>,
    /// Host time spent preparing the chunk, milliseconds.
    prep_ms: f64,
}

/// Trace positions of one fiber on the padded grid, with the spots' corners.
fn fiber_trace(
    psf: &GaussHermitePsf,
    fiber: usize,
    waves: &[f64],
) -> (Vec<f64>, Vec<i32>, Vec<i32>) {
    let mut xy = Vec::with_capacity(2 * waves.len());
    let mut xc = Vec::with_capacity(waves.len());
    let mut yc = Vec::with_capacity(waves.len());
    for &w in waves {
        let (x, y) = psf.xy(fiber, w);
        let (cx, cy) = psf.corner_of(x, y);
        xy.extend_from_slice(&[x, y]);
        xc.push(cx);
        yc.push(cy);
    }
    (xy, xc, yc)
}

/// Builds the host tables of a chunk and packs its image region into `pinned` (grown if
/// needed). Runs on a helper thread while the device solves the previous chunk.
pub(crate) fn prepare(
    input: &FrameInput<'_>,
    chunk: &[&Patch],
    sh: &Shape,
    ctx: &CudaContext,
    pinned: Option<PinnedBuf<f32>>,
) -> Result<ChunkHost> {
    let t0 = Instant::now();
    let _r = nvtx::LocalRange::new(c"host tables");
    let plan = input.plan;
    let psf = input.psf;
    let mut bundles: Vec<usize> = chunk.iter().map(|p| p.bundle_start).collect();
    bundles.sort_unstable();
    bundles.dedup();
    let fibers: Vec<usize> = bundles.iter().flat_map(|&b| b..b + sh.bundlesize).collect();
    let traces: Vec<(Vec<f64>, Vec<i32>, Vec<i32>)> = fibers
        .par_iter()
        .map(|&f| fiber_trace(psf, f, &plan.fullwave))
        .collect();
    let (ny, nx) = psf.spot_shape();
    let per_bundle: Vec<Corners> = bundles
        .iter()
        .enumerate()
        .map(|(slot, &b)| {
            let t = &traces[slot * sh.bundlesize..(slot + 1) * sh.bundlesize];
            Corners {
                fibers: b..b + sh.bundlesize,
                nwave: plan.fullwave.len(),
                ny,
                nx,
                xc: t.iter().flat_map(|x| x.1.iter().copied()).collect(),
                yc: t.iter().flat_map(|x| x.2.iter().copied()).collect(),
            }
        })
        .collect();
    let ccd = (input.image.nrows, input.image.ncols);
    let m = sh.m();
    let mut live = Vec::new();
    let mut off = Vec::new();
    for (i, p) in chunk.iter().enumerate() {
        let slot = bundles
            .binary_search(&p.bundle_start)
            .expect("bundle listed");
        let geom = PatchGeometry::new(plan, p, &per_bundle[slot], ccd);
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
    let mut xy = Vec::with_capacity(fibers.len() * sh.nfull * 2);
    let mut corners = Vec::with_capacity(fibers.len() * sh.nfull * 2);
    for (t, x, y) in &traces {
        xy.extend_from_slice(t);
        for (a, b) in x.iter().zip(y) {
            corners.push(*a);
            corners.push(*b);
        }
    }
    let ncoef = psf.ghsigx.ncoef;
    let mut coef = Vec::with_capacity(fibers.len() * (2 + psf.ngh()) * ncoef);
    for &f in &fibers {
        for l in [&psf.ghsigx, &psf.ghsigy].into_iter().chain(psf.gh.iter()) {
            coef.extend_from_slice(&l.coeff[f * ncoef..(f + 1) * ncoef]);
        }
    }
    // the image region, pixels then inverse variances
    let image = if live.is_empty() {
        pinned
    } else {
        let img = input.image;
        let (r0, r1, c0, c1) = region;
        let npix = (r1 - r0) * (c1 - c0);
        let mut buf = match pinned {
            Some(b) if b.len() >= 2 * npix => b,
            other => {
                drop(other);
                ctx.bind_to_thread()
                    .map_err(error::driver("cannot bind the CUDA context"))?;
                PinnedBuf::new(2 * npix)?
            }
        };
        let (pp, pv) = buf.as_mut_slice()[..2 * npix].split_at_mut(npix);
        let w = c1 - c0;
        pp.par_chunks_mut(w)
            .zip(pv.par_chunks_mut(w))
            .enumerate()
            .for_each(|(r, (dp, dv))| {
                let row = (r0 + r) * img.ncols;
                dp.copy_from_slice(&img.pix[row + c0..row + c1]);
                dv.copy_from_slice(&img.ivar[row + c0..row + c1]);
            });
        Some(buf)
    };
    Ok(ChunkHost {
        live,
        off,
        bundles,
        xy,
        coef,
        corners,
        colspot,
        boxes,
        nkeep,
        boxoff,
        box_total,
        region,
        image,
        prep_ms: t0.elapsed().as_secs_f64() * 1e3,
    })
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

/// Device and pinned buffers, kept by the backend between chunks and calls.
pub(crate) struct Workspace {
    xy: Slot<f64>,
    coef: Slot<f64>,
    waves: Slot<f64>,
    spots: Slot<f64>,
    corners: Slot<i32>,
    colspot: Slot<i32>,
    boxes: Slot<i32>,
    nkeep: Slot<i32>,
    boxoff: Slot<i64>,
    pix: Slot<f32>,
    ivar: Slot<f32>,
    icov: Slot<f64>,
    y: Slot<f64>,
    fw: Slot<f64>,
    diag0: Slot<f64>,
    pixmask: Slot<f64>,
    masked: Slot<i32>,
    x: Slot<f64>,
    xinv: Slot<f64>,
    flux: Slot<f64>,
    ivar_out: Slot<f64>,
    res: Slot<f64>,
    fluxcol: Slot<f64>,
    sweeps: Slot<i32>,
    model: Slot<f64>,
    chi2: Slot<f64>,
    back: PinSlot<f64>,
}

impl Workspace {
    pub(crate) fn new() -> Self {
        Workspace {
            xy: Slot::new("trace positions"),
            coef: Slot::new("PSF coefficients"),
            waves: Slot::new("wavelength grid"),
            spots: Slot::new("spots"),
            corners: Slot::new("spot corners"),
            colspot: Slot::new("column table"),
            boxes: Slot::new("pixel boxes"),
            nkeep: Slot::new("kept bins"),
            boxoff: Slot::new("box offsets"),
            pix: Slot::new("image pixels"),
            ivar: Slot::new("image inverse variance"),
            icov: Slot::new("icov"),
            y: Slot::new("y"),
            fw: Slot::new("fluxweight"),
            diag0: Slot::new("icov diagonal"),
            pixmask: Slot::new("pixmask fraction"),
            masked: Slot::new("masked flags"),
            x: Slot::new("xflux"),
            xinv: Slot::new("inverse Cholesky blocks"),
            flux: Slot::new("flux"),
            ivar_out: Slot::new("ivar"),
            res: Slot::new("resolution"),
            fluxcol: Slot::new("core flux by column"),
            sweeps: Slot::new("Jacobi sweeps"),
            model: Slot::new("patch models"),
            chi2: Slot::new("chi2pix"),
            back: PinSlot::new(),
        }
    }

    /// Frees every buffer.
    pub(crate) fn release(&mut self) {
        *self = Workspace::new();
    }
}

/// The region of the CCD uploaded for a chunk: rows, columns.
#[derive(Clone, Copy)]
struct Region {
    row0: usize,
    col0: usize,
    width: usize,
}

/// Launches assembly (and regularisation) for `ids` (all `n` live patches when None).
#[allow(clippy::too_many_arguments)]
fn assemble(
    dev: &Device,
    k: &Kernels,
    sh: &Shape,
    n: usize,
    ids: Option<&DevBuf<i32>>,
    ws: &Workspace,
    region: Region,
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
            .ptr(ws.spots.get().ptr)
            .ptr(ws.corners.get().ptr)
            .ptr(ws.colspot.get().ptr)
            .ptr(ws.boxes.get().ptr)
            .ptr(ids_ptr)
            .ptr(ws.pix.get().ptr)
            .ptr(ws.ivar.get().ptr)
            .i32(region.row0 as i32)
            .i32(region.col0 as i32)
            .i32(region.width as i32)
            .i32(m as i32)
            .i32(sh.nx as i32)
            .i32(sh.ny as i32)
            .i32(sh.nt as i32)
            .i32(sh.ncore as i32)
            .i32(sh.wavepad as i32)
            .i32(sh.nws as i32)
            .ptr(ws.icov.get().ptr)
            .ptr(ws.y.get().ptr)
            .ptr(ws.fw.get().ptr)
            .ptr(ws.diag0.get().ptr)
            .ptr(ws.pixmask.get().ptr),
    )?;
    launch(
        dev,
        &k.regularize,
        "regularize_f64",
        (n as u32, 1, 1),
        256,
        0,
        Args::new()
            .ptr(ws.icov.get().ptr)
            .ptr(ws.fw.get().ptr)
            .ptr(ws.diag0.get().ptr)
            .ptr(ids_ptr)
            .i32(m as i32)
            .f64(reg)
            .ptr(ws.masked.get().ptr),
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

/// Solves one prepared chunk; results in the order of `chunk`, and the chunk's pinned image
/// buffer back for reuse.
#[allow(clippy::too_many_arguments)]
pub(crate) fn solve_chunk(
    dev: &Device,
    k: &Kernels,
    ws: &mut Workspace,
    input: &FrameInput<'_>,
    chunk: &[&Patch],
    mut host: ChunkHost,
    sh: &Shape,
    timings: &mut GpuTimings,
) -> Result<(Vec<PatchResult>, Option<PinnedBuf<f32>>)> {
    timings.add("host tables", host.prep_ms);
    let pinned = host.image.take();
    let mut results: Vec<Option<PatchResult>> = vec![None; chunk.len()];
    for (i, r) in std::mem::take(&mut host.off) {
        results[i] = Some(r);
    }
    let n = host.live.len();
    if n == 0 {
        let results = results
            .into_iter()
            .map(|r| r.expect("off-image result"))
            .collect();
        return Ok((results, pinned));
    }
    let pinned = pinned.expect("a chunk with pixels has its image packed");
    let (m, mc, nt, nws, ncore, nd) = (sh.m(), sh.mc(), sh.nt, sh.nws, sh.ncore, sh.nd());
    let k0 = m - mc;
    let img = input.image;
    let (r0, r1, c0, c1) = host.region;
    let (rh, rw) = (r1 - r0, c1 - c0);
    let npix = rh * rw;
    let region = Region {
        row0: r0,
        col0: c0,
        width: rw,
    };

    let mut clock = PhaseClock::new(dev);
    clock.mark("start")?;
    let copies = nvtx::LocalRange::new(c"copies in");
    let nspot = host.xy.len() / 2;
    let size = sh.nx * sh.ny;
    ws.spots.ensure(dev, nspot * size)?;
    ws.xy.ensure(dev, host.xy.len())?;
    ws.coef.ensure(dev, host.coef.len())?;
    ws.waves.ensure(dev, input.plan.fullwave.len())?;
    ws.corners.ensure(dev, host.corners.len())?;
    ws.colspot.ensure(dev, host.colspot.len())?;
    ws.boxes.ensure(dev, host.boxes.len())?;
    ws.nkeep.ensure(dev, n)?;
    ws.boxoff.ensure(dev, n)?;
    ws.pix.ensure(dev, npix)?;
    ws.ivar.ensure(dev, npix)?;
    ws.icov.ensure(dev, n * m * m)?;
    ws.y.ensure(dev, n * m)?;
    ws.fw.ensure(dev, n * m)?;
    ws.diag0.ensure(dev, n * m)?;
    ws.pixmask.ensure(dev, n * ncore * nws)?;
    ws.masked.ensure(dev, n)?;
    dev.copy_to(ws.xy.get(), &host.xy, "trace positions")?;
    dev.copy_to(ws.coef.get(), &host.coef, "PSF coefficients")?;
    dev.copy_to(ws.waves.get(), &input.plan.fullwave, "wavelength grid")?;
    dev.copy_to(ws.corners.get(), &host.corners, "spot corners")?;
    dev.copy_to(ws.colspot.get(), &host.colspot, "column table")?;
    dev.copy_to(ws.boxes.get(), &host.boxes, "pixel boxes")?;
    dev.copy_to(ws.nkeep.get(), &host.nkeep, "kept bins")?;
    dev.copy_to(ws.boxoff.get(), &host.boxoff, "box offsets")?;
    let (pp, pv) = pinned.as_slice()[..2 * npix].split_at(npix);
    dev.copy_to(ws.pix.get(), pp, "image pixels")?;
    dev.copy_to(ws.ivar.get(), pv, "image inverse variance")?;
    dev.zero_prefix(ws.pixmask.get(), n * ncore * nws)?;
    dev.zero_prefix(ws.masked.get(), n)?;
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
            + 2
            + ngx * ngy
            + 32;
        let (wmin, wmax) = psf.param_domain();
        launch(
            dev,
            &k.spots,
            "spots_f64",
            (nspot as u32, 1, 1),
            128,
            smem * 8,
            Args::new()
                .ptr(ws.xy.get().ptr)
                .ptr(ws.coef.get().ptr)
                .ptr(ws.waves.get().ptr)
                .i32(nspot as i32)
                .i32(sh.nfull as i32)
                .i32(psf.ghsigx.ncoef as i32)
                .f64(wmin)
                .f64(wmax)
                .i32(psf.ghdegx as i32)
                .i32(psf.ghdegy as i32)
                .i32(sh.nx as i32)
                .i32(sh.ny as i32)
                .ptr(ws.spots.get().ptr),
        )?;
    }
    clock.mark("spots")?;
    {
        let _r = nvtx::LocalRange::new(c"assemble");
        assemble(dev, k, sh, n, None, ws, region, input.options.regularize)?;
    }
    clock.mark("assemble")?;

    // Factorisation, with the retry of DESIGN step 2 for the patches that fail.
    let fact = nvtx::LocalRange::new(c"factorize");
    let all: Vec<usize> = (0..n).collect();
    let info = factorize(dev, sh, ws.icov.get(), &all)?;
    let mut masked = vec![0i32; n];
    dev.copy_from(&mut masked, ws.masked.get(), 0, "masked flags")?;
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
                ws,
                region,
                RETRY_REGULARIZE,
            )?;
            let info2 = factorize(dev, sh, ws.icov.get(), &failed)?;
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
    ws.x.ensure(dev, n * m)?;
    dev.dtod(ws.x.get(), ws.y.get(), n * m)?;
    let a_ptrs = pointer_array(dev, ws.icov.get().ptr, m * m, &all, "solve pointer array")?;
    let b_ptrs = pointer_array(dev, ws.x.get().ptr, m, &all, "solve rhs pointer array")?;
    let solve_info = dev.zeros::<i32>(1, "solve info")?;
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
            solve_info.ptr as *mut i32,
            n as i32,
        )
    };
    error::cusolver(st, &format!("cusolverDnDpotrsBatched of {n} patches"))?;
    drop(solve);
    clock.mark("solve")?;

    // Core blocks of icov^-1: X = L22^-1 (trsm on the identity), C_b = X_b^T X_b.
    let inv = nvtx::LocalRange::new(c"inverse");
    ws.xinv.ensure(dev, n * mc * mc)?;
    let xinv = ws.xinv.get();
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
        .map(|i| ws.icov.get().at(i * m * m + k0 * m + k0))
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
                // icov is no longer needed: the covariance blocks take its place
                ws.icov.get().ptr as *mut f64,
                nt as i32,
                (nt * nt) as i64,
                (n * ncore) as i32,
            ),
            &format!("cublasDgemmStridedBatched of {} blocks", n * ncore),
        )?;
    }
    drop(inv);
    clock.mark("inverse")?;

    // Decorrelation.
    let dec = nvtx::LocalRange::new(c"decorrelate");
    let per = n * ncore * nws;
    ws.flux.ensure(dev, per)?;
    ws.ivar_out.ensure(dev, per)?;
    ws.res.ensure(dev, per * nd)?;
    ws.fluxcol.ensure(dev, n * m)?;
    ws.sweeps.ensure(dev, n * ncore)?;
    dev.zero_prefix(ws.fluxcol.get(), n * m)?;
    dev.zero_prefix(ws.sweeps.get(), n * ncore)?;
    decorrelate(
        dev,
        k,
        sh,
        n * ncore,
        ws.icov.get(),
        ws.x.get(),
        ws.nkeep.get(),
        ws.flux.get(),
        ws.ivar_out.get(),
        ws.res.get(),
        ws.fluxcol.get(),
        ws.sweeps.get(),
        0,
    )?;
    drop(dec);
    clock.mark("decorrelate")?;

    // chi2pix from the model of xflux, and the optional model image of the core.
    let fin = nvtx::LocalRange::new(c"finalize");
    ws.model.ensure(dev, host.box_total)?;
    ws.chi2.ensure(dev, per)?;
    let model = ws.model.get();
    let project = |xv: &DevBuf<f64>| {
        launch(
            dev,
            &k.project,
            "project_f64",
            (m as u32, n as u32, 1),
            64,
            0,
            Args::new()
                .ptr(ws.spots.get().ptr)
                .ptr(ws.corners.get().ptr)
                .ptr(ws.colspot.get().ptr)
                .ptr(ws.boxes.get().ptr)
                .ptr(ws.boxoff.get().ptr)
                .ptr(xv.ptr)
                .i32(m as i32)
                .i32(sh.nx as i32)
                .i32(sh.ny as i32)
                .ptr(model.ptr),
        )
    };
    dev.zero_prefix(model, host.box_total)?;
    project(ws.x.get())?;
    launch(
        dev,
        &k.chi2pix,
        "chi2pix_f64",
        ((ncore * nws) as u32, n as u32, 1),
        64,
        0,
        Args::new()
            .ptr(ws.spots.get().ptr)
            .ptr(ws.corners.get().ptr)
            .ptr(ws.colspot.get().ptr)
            .ptr(ws.boxes.get().ptr)
            .ptr(ws.boxoff.get().ptr)
            .ptr(model.ptr)
            .ptr(ws.pix.get().ptr)
            .ptr(ws.ivar.get().ptr)
            .i32(region.row0 as i32)
            .i32(region.col0 as i32)
            .i32(region.width as i32)
            .ptr(ws.nkeep.get().ptr)
            .i32(m as i32)
            .i32(sh.nx as i32)
            .i32(sh.ny as i32)
            .i32(nt as i32)
            .i32(ncore as i32)
            .i32(sh.wavepad as i32)
            .i32(nws as i32)
            .f64(input.options.psferr)
            .ptr(ws.chi2.get().ptr),
    )?;
    let core_model = input.options.model;
    if core_model {
        dev.zero_prefix(model, host.box_total)?;
        project(ws.fluxcol.get())?;
    }
    drop(fin);
    clock.mark("finalize")?;

    // Copies back: core arrays only (and the model boxes when asked).
    let out = nvtx::LocalRange::new(c"copies out");
    let nback = per * (4 + nd) + if core_model { host.box_total } else { 0 };
    {
        let s = ws.back.get(nback)?;
        let (a, rest) = s.split_at_mut(per);
        dev.copy_from(a, ws.flux.get(), 0, "flux")?;
        let (a, rest) = rest.split_at_mut(per);
        dev.copy_from(a, ws.ivar_out.get(), 0, "ivar")?;
        let (a, rest) = rest.split_at_mut(per);
        dev.copy_from(a, ws.pixmask.get(), 0, "pixmask fraction")?;
        let (a, rest) = rest.split_at_mut(per);
        dev.copy_from(a, ws.chi2.get(), 0, "chi2pix")?;
        let (a, rest) = rest.split_at_mut(per * nd);
        dev.copy_from(a, ws.res.get(), 0, "resolution")?;
        if core_model {
            dev.copy_from(rest, model, 0, "model")?;
        }
    }
    let mut sweeps_host = vec![0i32; n * ncore];
    dev.copy_from(&mut sweeps_host, ws.sweeps.get(), 0, "Jacobi sweeps")?;
    clock.mark("copies out")?;
    dev.sync("chunk results")?;
    drop(out);
    drop((a_ptrs, b_ptrs, solve_info, l_ptrs, x_ptrs));
    clock.collect(timings)?;
    timings.max_sweeps = timings
        .max_sweeps
        .max(sweeps_host.iter().copied().max().unwrap_or(0));
    if let Ok((free, total)) = dev.mem_info() {
        timings.device_used_bytes = timings.device_used_bytes.max(total - free);
    }

    let t_res = Instant::now();
    let back: &[f64] = ws.back.get(nback)?;
    let (bflux, rest) = back.split_at(per);
    let (bivar, rest) = rest.split_at(per);
    let (bmask, rest) = rest.split_at(per);
    let (bchi2, rest) = rest.split_at(per);
    let (bres, bmodel) = rest.split_at(per * nd);
    let boxoff = &host.boxoff;
    let solved: Vec<(usize, PatchResult)> = host
        .live
        .par_iter()
        .enumerate()
        .filter(|(li, _)| !to_cpu.contains(li))
        .map(|(li, (ci, geom, _))| {
            let patch = chunk[*ci];
            let nk = patch.waves.len();
            let mut r = PatchResult::empty(patch, sh.ndiag, status[li]);
            for c in 0..ncore {
                let o = (li * ncore + c) * nws;
                r.pixmask_fraction[c * nk..(c + 1) * nk].copy_from_slice(&bmask[o..o + nk]);
            }
            if masked[li] != 0 {
                r.status = PatchStatus::Masked;
                return (*ci, r);
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
                let o = boxoff[li] as usize;
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
            (*ci, r)
        })
        .collect();
    for (ci, r) in solved {
        results[ci] = Some(r);
    }
    // Patches whose factorisation failed twice: the CPU reference, eigendecomposition fallback
    // included.
    let mut host_spots: BTreeMap<usize, Spots> = BTreeMap::new();
    for &li in &to_cpu {
        let (ci, _, slot) = &host.live[li];
        let patch = chunk[*ci];
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
    }
    timings.add("host results", t_res.elapsed().as_secs_f64() * 1e3);
    let results = results
        .into_iter()
        .map(|r| r.ok_or_else(|| Error::Gpu("internal: a patch of the chunk has no result".into())))
        .collect::<Result<Vec<_>>>()?;
    Ok((results, Some(pinned)))
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
    let ints = 2 * npair + 2 + npair * (npair + 1);
    let smem = (2 * n * n + 2 * npair + 2 * n + 32) * 8 + ints * 4;
    let rows = (jacobi_threads() / npair as u32).max(1);
    launch(
        dev,
        &k.decorrelate,
        "decorrelate_f64",
        (nblocks as u32, 1, 1),
        (npair as u32, rows),
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
            .f64(jacobi_tol())
            .ptr(flux.ptr)
            .ptr(ivar.ptr)
            .ptr(res.ptr)
            .ptr(fluxcol.ptr)
            .ptr(sweeps.ptr)
            .ptr(qout),
    )
}
