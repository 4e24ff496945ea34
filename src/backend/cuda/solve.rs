//! The batched solve of a chunk of patches on the device (DESIGN "Solve of one patch", the
//! same steps as [`crate::backend::cpu`]), as a sequence of named steps:
//!
//! 1. copies in: host tables and the chunk's image region, uploaded on the copy stream while
//!    the chunk before was solved (the compute stream only waits for them here);
//! 2. spots of every bundle in the chunk (`launchers::spots`), but for a bundle the chunk
//!    before evaluated last;
//! 3. assembly of icov (one triangle, icov being symmetric: dense for cuSOLVER on the dense
//!    route, the band of fiber blocks the sweeps read on the Schur route), y, fluxweight and
//!    regularisation (`launchers::assemble`);
//! 4. factorisation with its retry, xflux and the core covariance blocks C_bb through cuSOLVER
//!    and cuBLAS (`dense`), or, where second neighbours decouple, each core block's Schur
//!    complement S_b = C_bb^-1 and xflux by block sweeps over the fibers (`schur`);
//! 5. decorrelation of each core block (`decorrelate`: polar, Jacobi for the blocks it gives
//!    up on);
//! 6. the model of each patch, chi2pix and the optional core model image;
//! 7. copies out of the core arrays only, queued once the chunk before has been unpacked from
//!    the host buffers (while the device runs this chunk's kernels), on a stream of their own
//!    that runs them while the next chunk's kernels run, and the results on the host
//!    (`results`), unpacked once the next chunk's kernels are queued.

use std::time::Instant;

use cudarc::driver::CudaEvent;

use super::decorrelate::{self, BlockKind, Counts, Scratch};
use super::dense::{self, Factorization, Keep};
use super::launchers::{self, CoreIn, CoreOut, Gpu, TILE_MAX_ORDER};
use super::results::{self, Back};
use super::schur;
use super::tables::{ChunkHost, Uploads};
use super::timings::{GpuTimings, PhaseClock};
use super::tuning::{Solve, Tuning};
use super::workspace::{Region, Shape, Workspace};
use crate::backend::{FrameInput, Progress};
use crate::error::Result;
use crate::extract::PatchResult;
use crate::plan::Patch;

/// Sizes the chunk's buffers (kept between chunks) and waits for the upload of its inputs
/// (queued on the copy stream while the previous chunk was solved).
fn copy_in(g: Gpu<'_>, ws: &mut Workspace, host: &ChunkHost, solve: Solve) -> Result<()> {
    let (dev, sh) = (g.dev, g.sh);
    let n = host.live.len();
    let (m, ncore, nws) = (sh.m(), sh.ncore, sh.nws);
    if let Some((early, _)) = &ws.read_back {
        dev.compute_after(early)?;
    }
    if ws.spots.ensure(dev, host.nspots * sh.nx * sh.ny)? {
        ws.last_spots = None;
    }
    let size = ws.sized(n);
    ws.icov.ensure(dev, size * m * sh.icov_row_len(solve))?;
    ws.y.ensure(dev, size * m)?;
    ws.fw.ensure(dev, size * m)?;
    ws.diag0.ensure(dev, size * m)?;
    ws.pixmask.ensure(dev, size * ncore * nws)?;
    ws.masked.ensure(dev, size)?;
    ws.x.ensure(dev, size * m)?;
    ws.colspot.ensure(dev, size * m)?;
    dev.join_copies()?;
    launchers::column_table(g, ws, n)?;
    dev.zero_prefix(ws.pixmask.get(), n * ncore * nws)?;
    dev.zero_prefix(ws.masked.get(), n)
}

/// Step 2: the spots of the chunk's bundles. A bundle split between this chunk and the one
/// before, which evaluated its spots last, has them copied rather than evaluated again (a
/// chunk need not end with a bundle: a full frame's bundles have 235 patches each).
fn spots(g: Gpu<'_>, ws: &mut Workspace, input: &FrameInput<'_>, host: &ChunkHost) -> Result<()> {
    let sh = g.sh;
    let per_bundle = sh.bundlesize * sh.nfull;
    let size = sh.nx * sh.ny;
    let mut first = 0;
    if let Some((bundle, at)) = ws.last_spots.take() {
        if host.bundles.first() == Some(&bundle) {
            if at != 0 {
                let spots = ws.spots.get();
                g.dev.dtod_at(spots, 0, spots, at, per_bundle * size)?;
            }
            first = per_bundle;
        }
    }
    launchers::spots(g, input.psf, ws, first, host.nspots)?;
    if let Some(&last) = host.bundles.last() {
        ws.last_spots = Some((last, (host.bundles.len() - 1) * per_bundle * size));
    }
    Ok(())
}

/// Step 5 for the `n` live patches: flux, ivar and resolution of every core block, from the
/// blocks step 4 left (`kind`).
fn decorrelate_chunk(
    g: Gpu<'_>,
    tuning: &Tuning,
    ws: &mut Workspace,
    n: usize,
    kind: BlockKind,
) -> Result<()> {
    let (dev, sh) = (g.dev, g.sh);
    if let Some((_, all)) = &ws.read_back {
        dev.compute_after(all)?;
    }
    let nblocks = n * sh.ncore;
    // sizes for the call's largest chunk
    let size = ws.sized(n);
    let blocks = size * sh.ncore;
    ws.flux.ensure(dev, blocks * sh.nws)?;
    ws.ivar_out.ensure(dev, blocks * sh.nws)?;
    ws.res.ensure(dev, blocks * sh.nws * sh.nd())?;
    ws.fluxcol.ensure(dev, size * sh.m())?;
    ws.sweeps.ensure(dev, blocks)?;
    ws.steps.ensure(dev, blocks)?;
    ws.pbuf.ensure(dev, blocks * sh.nt * sh.nt)?;
    dev.zero_prefix(ws.fluxcol.get(), n * sh.m())?;
    dev.zero_prefix(ws.sweeps.get(), nblocks)?;
    dev.zero_prefix(ws.steps.get(), nblocks)?;
    decorrelate::decorrelate(
        g,
        tuning,
        CoreIn {
            blocks: match kind {
                BlockKind::Covariance => ws.icov.get().ptr,
                BlockKind::Precision => ws.sblocks.get().ptr,
            },
            count: nblocks,
            xflux: ws.x.get().ptr,
            nkeep: ws.input.nkeep.get().ptr,
        },
        kind,
        Scratch {
            pbuf: ws.pbuf.get(),
            factored: kind == BlockKind::Precision,
            steps: ws.steps.get(),
            sweeps: ws.sweeps.get(),
        },
        CoreOut {
            flux: ws.flux.get().ptr,
            ivar: ws.ivar_out.get().ptr,
            res: ws.res.get().ptr,
            fluxcol: ws.fluxcol.get().ptr,
        },
        0,
    )
}

/// Step 6: chi2pix from the model of xflux, and the model image of the core flux when asked.
fn finalize(
    g: Gpu<'_>,
    ws: &mut Workspace,
    host: &ChunkHost,
    region: Region,
    input: &FrameInput<'_>,
) -> Result<()> {
    let n = host.live.len();
    ws.model.ensure(g.dev, host.box_total)?;
    ws.chi2.ensure(g.dev, ws.sized(n) * g.sh.ncore * g.sh.nws)?;
    g.dev.zero_prefix(ws.model.get(), host.box_total)?;
    launchers::project(g, n, ws, ws.x.get())?;
    launchers::chi2pix(g, n, ws, region, input.options.psferr)?;
    if input.options.model {
        g.dev.zero_prefix(ws.model.get(), host.box_total)?;
        launchers::project(g, n, ws, ws.fluxcol.get())?;
    }
    Ok(())
}

/// Step 7, on the stream of the copies back once the chunk's kernels are done, while the
/// compute stream goes on with the next chunk: the core arrays (and the model boxes when
/// asked) into the pinned buffer `ws.back`, and the verdicts (polar steps, Jacobi sweeps, then
/// on the Schur route those of the sweeps and the coupling) into `ws.verdicts` and
/// `ws.coupling_back`. What the next chunk writes first comes back first (`ws.read_back`).
/// Returns the events at the start and the end of the copies; the host buffers are valid once
/// the device has passed the second.
fn copy_out(
    g: Gpu<'_>,
    ws: &mut Workspace,
    host: &ChunkHost,
    model: bool,
    steps: &Steps,
) -> Result<(CudaEvent, CudaEvent)> {
    let (dev, sh) = (g.dev, g.sh);
    let n = host.live.len();
    let nblocks = n * sh.ncore;
    let per = nblocks * sh.nws;
    dev.back_after_compute()?;
    let start = dev.back_event()?;
    let nback = Back::len(per, sh.nd(), if model { host.box_total } else { 0 });
    let s = ws.back.get(nback);
    let (flux, rest) = s.split_at_mut(per);
    let (ivar, rest) = rest.split_at_mut(per);
    let (pixmask, rest) = rest.split_at_mut(per);
    let (chi2, rest) = rest.split_at_mut(per);
    let (res, boxes) = rest.split_at_mut(per * sh.nd());
    let nsweep = steps.verdicts_per_patch() * n;
    let v = ws.verdicts.get(2 * nblocks + nsweep);
    let (polar, rest) = v.split_at_mut(nblocks);
    let (jacobi, sweeps) = rest.split_at_mut(nblocks);
    dev.copy_back(pixmask, ws.pixmask.get(), "pixmask fraction")?;
    if let Steps::Schur { .. } = steps {
        let from = schur::DeviceVerdicts {
            first: ws.first_info.get(),
            last: ws.info.get(),
            masked: ws.masked.get(),
            coupling: ws.coupling.get(),
        };
        from.copy(dev, sweeps, ws.coupling_back.get(n))?;
    }
    let early = dev.back_event()?;
    dev.copy_back(flux, ws.flux.get(), "flux")?;
    dev.copy_back(ivar, ws.ivar_out.get(), "ivar")?;
    dev.copy_back(chi2, ws.chi2.get(), "chi2pix")?;
    dev.copy_back(res, ws.res.get(), "resolution")?;
    if model {
        dev.copy_back(boxes, ws.model.get(), "model")?;
    }
    dev.copy_back(polar, ws.steps.get(), "polar steps")?;
    dev.copy_back(jacobi, ws.sweeps.get(), "Jacobi sweeps")?;
    // the end, for the host and for the next chunk's decorrelation (an event each)
    let done = dev.back_event()?;
    ws.read_back = Some((early, dev.back_event()?));
    Ok((start, done))
}

/// Most fibers per patch on the Schur route: its assembly finds each fiber's neighbours along
/// the CCD with a lane of a warp per fiber (`next_fiber_spot` in kernels/common.cuh).
const SCHUR_MAX_FIBERS: usize = 32;

/// The route of steps 2-3 for blocks of the shape `sh`: the Schur sweeps need their blocks
/// (plus a column) within the tile kernels' largest order and at most [`SCHUR_MAX_FIBERS`]
/// fibers per patch, else the dense route.
pub(crate) fn route(solve: Solve, sh: &Shape) -> Solve {
    let tiles_fit = (sh.nt + 1).div_ceil(8) * 8 <= TILE_MAX_ORDER;
    match solve {
        Solve::Schur if !tiles_fit || sh.nblock > SCHUR_MAX_FIBERS => Solve::Dense,
        other => other,
    }
}

/// Step 4 on the dense route: factorisation with its retry, xflux, then the covariance blocks
/// C_bb into `ws.icov`.
fn dense_steps(
    g: Gpu<'_>,
    ws: &mut Workspace,
    live: &[&Patch],
    region: Region,
    input: &FrameInput<'_>,
    clock: &mut PhaseClock<'_>,
    keep: &mut Keep,
) -> Result<Factorization> {
    let n = live.len();
    ws.xinv.ensure(g.dev, ws.sized(n) * g.sh.mc() * g.sh.mc())?;
    let fact = dense::factorize(g, ws, live, region, input.options.regularize)?;
    clock.mark("factorize")?;
    dense::solve_flux(g, ws, n, keep)?;
    clock.mark("solve")?;
    dense::core_covariance(g, ws, n, keep)?;
    clock.mark("inverse")?;
    Ok(fact)
}

/// A chunk of patches: the patches and their positions in the call's results.
pub(crate) struct Chunk<'a> {
    pub(crate) patches: &'a [&'a Patch],
    pub(crate) ids: &'a [usize],
}

/// Where finished chunks go: the call's results by patch, its timings, the upload buffers
/// free again, and the progress of the call.
pub(crate) struct Sink<'s> {
    pub(crate) results: &'s mut [Option<PatchResult>],
    /// The last mark of the chunk finished before, for the device's idle time between chunks.
    pub(crate) last_mark: &'s mut Option<CudaEvent>,
    pub(crate) timings: &'s mut GpuTimings,
    pub(crate) uploads: &'s mut Vec<Uploads>,
    pub(crate) progress: &'s Progress,
}

/// How steps 2-3 of a chunk went: known at once on the dense route, whose library calls the
/// host waits for; on the Schur route decided on the device and read once the chunk is done.
pub(crate) enum Steps {
    Dense(Factorization),
    Schur {
        /// Failed patches the device retried at most.
        capacity: usize,
        coupling_max: f64,
    },
}

impl Steps {
    /// Values per live patch copied back after the decorrelation's verdicts.
    fn verdicts_per_patch(&self) -> usize {
        match self {
            Steps::Dense(_) => 0,
            Steps::Schur { .. } => schur::VERDICTS_PER_PATCH,
        }
    }
}

/// A chunk whose work is queued on the device, with what its results need once the device
/// has passed its last mark.
pub(crate) struct Pending<'a> {
    chunk: Chunk<'a>,
    /// The chunk's live patches, in the order of the device's batch.
    live: Vec<&'a Patch>,
    host: ChunkHost,
    steps: Steps,
    /// Device arrays that queued library calls still read.
    keep: Keep,
    clock: PhaseClock<'a>,
    /// The start and the end of its copies back, once queued.
    copies: Option<(CudaEvent, CudaEvent)>,
}

/// Queues the solve of one prepared chunk, whose inputs were uploaded into `ws.input`. Once
/// the device has the chunk's kernels in hand, the chunk before (`previous`) is finished while
/// the device runs this one, this chunk's copies back are queued into the host buffers the
/// chunk before has left, `next` gives the next chunk's host tables (prepared on another
/// thread meanwhile) and its inputs are queued for upload into `ws.next`, which the chunk
/// before held. Returns this chunk in flight, if it has live patches, and the next
/// chunk's tables.
#[allow(clippy::too_many_arguments)]
pub(crate) fn solve_chunk<'a>(
    g: Gpu<'a>,
    tuning: &Tuning,
    ws: &mut Workspace,
    input: &FrameInput<'_>,
    chunk: Chunk<'a>,
    mut host: ChunkHost,
    previous: Option<Pending<'a>>,
    next: impl FnOnce() -> Result<Option<ChunkHost>>,
    sink: &mut Sink<'_>,
) -> Result<(Option<Pending<'a>>, Option<ChunkHost>)> {
    sink.timings.add("host tables", host.prep_ms);
    sink.timings.pageable_chunks += usize::from(!host.pinned);
    for (i, r) in std::mem::take(&mut host.off) {
        sink.results[chunk.ids[i]] = Some(r);
    }
    let mut pending = if host.live.is_empty() {
        // no kernel waits for the chunk's upload, which may still read these (pinned) buffers
        g.dev.sync_copies()?;
        sink.uploads.push(host.buffers);
        sink.progress.add(chunk.patches.len());
        None
    } else {
        Some(solve_live(g, tuning, ws, input, chunk, host)?)
    };
    let t_queued = Instant::now();
    if let Some(p) = previous {
        finish(g, ws, input, p, sink)?;
    }
    if let Some(p) = &mut pending {
        p.copies = Some(copy_out(g, ws, &p.host, input.options.model, &p.steps)?);
    }
    let t_finished = Instant::now();
    let next = next()?;
    let t_tables = Instant::now();
    if let Some(h) = &next {
        ws.next.upload(g.dev, input, h)?;
    }
    tracing::debug!(
        "chunk queued; host finished the chunk before in {:.1} ms, then waited {:.1} ms for the next chunk's tables and queued its upload in {:.1} ms",
        (t_finished - t_queued).as_secs_f64() * 1e3,
        (t_tables - t_finished).as_secs_f64() * 1e3,
        t_tables.elapsed().as_secs_f64() * 1e3
    );
    Ok((pending, next))
}

/// The live patches of a chunk, in the order of the device's batch.
fn live_patches<'a>(chunk: &Chunk<'a>, host: &ChunkHost) -> Vec<&'a Patch> {
    host.live
        .iter()
        .map(|(ci, _, _)| chunk.patches[*ci])
        .collect()
}

/// The steps of [`solve_chunk`] for a chunk with live patches up to its copies back, queued
/// on the device.
fn solve_live<'a>(
    g: Gpu<'a>,
    tuning: &Tuning,
    ws: &mut Workspace,
    input: &FrameInput<'_>,
    chunk: Chunk<'a>,
    host: ChunkHost,
) -> Result<Pending<'a>> {
    let n = host.live.len();
    let region = Region {
        row0: host.region.0,
        col0: host.region.2,
        width: host.region.3 - host.region.2,
    };
    let live = live_patches(&chunk, &host);
    let solve = route(tuning.solve, g.sh);
    let mut clock = PhaseClock::new(g.dev);
    clock.mark("start")?;
    copy_in(g, ws, &host, solve)?;
    clock.mark("copies in")?;
    spots(g, ws, input, &host)?;
    clock.mark("spots")?;
    if tuning.poison {
        // all bits set: a NaN
        let len = n * g.sh.m() * g.sh.icov_row_len(solve);
        g.dev.fill_prefix(ws.icov.get(), len, 0xff)?;
    }
    let reg = input.options.regularize;
    launchers::assemble(g, n, None, ws, region, reg, solve)?;
    clock.mark("assemble")?;
    let mut keep = Keep::new();
    let (steps, kind) = match solve {
        Solve::Schur => {
            let capacity = schur::retry_capacity(tuning.retry_capacity, n, reg);
            schur::ensure(g, ws, n, capacity)?;
            schur::factorize(g, ws, n, region, capacity)?;
            clock.mark("sweeps")?;
            let steps = Steps::Schur {
                capacity,
                coupling_max: tuning.coupling_max,
            };
            (steps, BlockKind::Precision)
        }
        Solve::Dense => (
            Steps::Dense(dense_steps(
                g, ws, &live, region, input, &mut clock, &mut keep,
            )?),
            BlockKind::Covariance,
        ),
    };
    decorrelate_chunk(g, tuning, ws, n, kind)?;
    clock.mark("decorrelate")?;
    finalize(g, ws, &host, region, input)?;
    clock.mark("finalize")?;
    Ok(Pending {
        chunk,
        live,
        host,
        steps,
        keep,
        clock,
        copies: None,
    })
}

/// Finishes a chunk once the device has passed its last mark: counters and phase times, then
/// one result per patch (by the CPU reference for those the device handed over), and its
/// upload buffers back to the free ones.
pub(crate) fn finish(
    g: Gpu<'_>,
    ws: &Workspace,
    input: &FrameInput<'_>,
    p: Pending<'_>,
    sink: &mut Sink<'_>,
) -> Result<()> {
    p.clock.wait_last()?;
    let copies_ms = match &p.copies {
        Some((start, end)) => {
            end.synchronize()
                .map_err(super::error::driver("wait for the copies back"))?;
            start
                .elapsed_ms(end)
                .map_err(super::error::driver("cuEventElapsedTime"))?
        }
        None => 0.0,
    };
    drop(p.keep);
    let (sh, model) = (g.sh, input.options.model);
    let n = p.host.live.len();
    let nblocks = n * sh.ncore;
    let verdicts = ws
        .verdicts
        .current(2 * nblocks + p.steps.verdicts_per_patch() * n);
    let (polar, rest) = verdicts.split_at(nblocks);
    let (jacobi, sweeps) = rest.split_at(nblocks);
    let counts = Counts::new(polar, jacobi);
    let t = &mut *sink.timings;
    p.clock.collect(t)?;
    t.add("copies out", copies_ms as f64);
    *sink.last_mark = p.clock.idle_since(sink.last_mark.take(), t)?;
    let fact = match p.steps {
        Steps::Schur {
            capacity,
            coupling_max,
        } => {
            let coupling = ws.coupling_back.current(n);
            let (fact, c) = schur::outcome(&p.live, sweeps, coupling, capacity, coupling_max);
            t.coupled += c.patches;
            t.max_coupling = t.max_coupling.max(c.largest);
            fact
        }
        Steps::Dense(fact) => {
            t.dense_route = true;
            fact
        }
    };
    t.retried += fact.retried;
    t.cpu_fallback += fact.to_cpu.len();
    t.polar_blocks += counts.polar;
    t.polar_fallback += counts.fallback;
    t.max_polar_steps = t.max_polar_steps.max(counts.max_steps);
    t.max_sweeps = t.max_sweeps.max(counts.max_sweeps);
    if let Ok((free, total)) = g.dev.mem_info() {
        t.device_used_bytes = t.device_used_bytes.max(total - free);
    }

    let t_res = Instant::now();
    let per = nblocks * sh.nws;
    let nback = Back::len(per, sh.nd(), if model { p.host.box_total } else { 0 });
    let back = Back::split(ws.back.current(nback), per, sh.nd());
    let (patches, host, fact) = (p.chunk.patches, &p.host, &fact);
    let solved = results::unpack(sh, patches, host, &back, fact, model);
    let fallback = results::cpu_fallback(input, sh, patches, host, &fact.to_cpu);
    for (ci, r) in solved.into_iter().chain(fallback) {
        sink.results[p.chunk.ids[ci]] = Some(r);
    }
    sink.timings
        .add("host results", t_res.elapsed().as_secs_f64() * 1e3);
    sink.uploads.push(p.host.buffers);
    sink.progress.add(p.chunk.patches.len());
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn shape(nt: usize, nblock: usize) -> Shape {
        Shape {
            nx: 17,
            ny: 11,
            nt,
            nws: 50,
            wavepad: 12,
            ncore: nblock - 2,
            nblock,
            nfull: 2400,
            bundlesize: 25,
            ndiag: 5,
        }
    }

    #[test]
    fn schur_route_needs_blocks_and_fibers_within_its_kernels() {
        assert_eq!(route(Solve::Schur, &shape(74, 7)), Solve::Schur);
        assert_eq!(route(Solve::Schur, &shape(79, 32)), Solve::Schur);
        assert_eq!(route(Solve::Schur, &shape(80, 7)), Solve::Dense);
        assert_eq!(route(Solve::Schur, &shape(74, 33)), Solve::Dense);
        assert_eq!(route(Solve::Dense, &shape(74, 7)), Solve::Dense);
    }
}
