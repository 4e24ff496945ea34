//! The batched solve of a chunk of patches on the device (DESIGN "Solve of one patch", the
//! same steps as [`crate::backend::cpu`]), as a sequence of named steps:
//!
//! 1. copies in: host tables and the chunk's image region, uploaded on the copy stream while
//!    the chunk before was solved (the compute stream only waits for them here);
//! 2. spots of every bundle in the chunk (`launchers::spots`);
//! 3. assembly of icov (one triangle, icov being symmetric), y, fluxweight and regularisation
//!    (`launchers::assemble`);
//! 4. factorisation with its retry, xflux and the core covariance blocks C_bb through cuSOLVER
//!    and cuBLAS (`dense`), or, where second neighbours decouple, each core block's Schur
//!    complement S_b = C_bb^-1 and xflux by block sweeps over the fibers (`schur`);
//! 5. decorrelation of each core block (`decorrelate`: polar, Jacobi for the blocks it gives
//!    up on);
//! 6. the model of each patch, chi2pix and the optional core model image;
//! 7. copies out of the core arrays only, and the results on the host (`results`).

use std::time::Instant;

use super::decorrelate::{self, BlockKind, Counts, Scratch};
use super::dense::{self, Factorization, Keep};
use super::launchers::{self, CoreIn, CoreOut, Gpu, TILE_MAX_ORDER};
use super::results::{self, Back};
use super::schur;
use super::staging::Staging;
use super::tables::ChunkHost;
use super::timings::{GpuTimings, PhaseClock};
use super::tuning::{Solve, Tuning};
use super::workspace::{Inputs, Region, Shape, Workspace};
use crate::backend::FrameInput;
use crate::error::{Error, Result};
use crate::extract::PatchResult;
use crate::plan::Patch;

/// Sizes the chunk's buffers (kept between chunks) and waits for the upload of its inputs
/// (queued on the copy stream while the previous chunk was solved).
fn copy_in(g: Gpu<'_>, ws: &mut Workspace, host: &ChunkHost) -> Result<()> {
    let (dev, sh) = (g.dev, g.sh);
    let n = host.live.len();
    let (m, ncore, nws) = (sh.m(), sh.ncore, sh.nws);
    ws.spots.ensure(dev, host.xy.len() / 2 * sh.nx * sh.ny)?;
    ws.icov.ensure(dev, n * m * m)?;
    ws.y.ensure(dev, n * m)?;
    ws.fw.ensure(dev, n * m)?;
    ws.diag0.ensure(dev, n * m)?;
    ws.pixmask.ensure(dev, n * ncore * nws)?;
    ws.masked.ensure(dev, n)?;
    ws.x.ensure(dev, n * m)?;
    dev.join_copies()?;
    dev.zero_prefix(ws.pixmask.get(), n * ncore * nws)?;
    dev.zero_prefix(ws.masked.get(), n)
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
    let nblocks = n * sh.ncore;
    let per = nblocks * sh.nws;
    ws.flux.ensure(dev, per)?;
    ws.ivar_out.ensure(dev, per)?;
    ws.res.ensure(dev, per * sh.nd())?;
    ws.fluxcol.ensure(dev, n * sh.m())?;
    ws.sweeps.ensure(dev, nblocks)?;
    ws.steps.ensure(dev, nblocks)?;
    ws.pbuf.ensure(dev, nblocks * sh.nt * sh.nt)?;
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
    ws.chi2.ensure(g.dev, n * g.sh.ncore * g.sh.nws)?;
    g.dev.zero_prefix(ws.model.get(), host.box_total)?;
    launchers::project(g, n, ws, ws.x.get())?;
    launchers::chi2pix(g, n, ws, region, input.options.psferr)?;
    if input.options.model {
        g.dev.zero_prefix(ws.model.get(), host.box_total)?;
        launchers::project(g, n, ws, ws.fluxcol.get())?;
    }
    Ok(())
}

/// Step 7 on the device: the core arrays (and the model boxes when asked) into the pinned
/// buffer `ws.back`, and the decorrelation's verdicts (polar steps, Jacobi sweeps) into host
/// vectors, valid once the stream has synchronised.
fn copy_out(
    g: Gpu<'_>,
    ws: &mut Workspace,
    host: &ChunkHost,
    model: bool,
) -> Result<(Vec<i32>, Vec<i32>)> {
    let (dev, sh) = (g.dev, g.sh);
    let nblocks = host.live.len() * sh.ncore;
    let per = nblocks * sh.nws;
    let nback = Back::len(per, sh.nd(), if model { host.box_total } else { 0 });
    {
        let s = ws.back.get(nback);
        let (a, rest) = s.split_at_mut(per);
        dev.copy_from(a, ws.flux.get(), 0, "flux")?;
        let (a, rest) = rest.split_at_mut(per);
        dev.copy_from(a, ws.ivar_out.get(), 0, "ivar")?;
        let (a, rest) = rest.split_at_mut(per);
        dev.copy_from(a, ws.pixmask.get(), 0, "pixmask fraction")?;
        let (a, rest) = rest.split_at_mut(per);
        dev.copy_from(a, ws.chi2.get(), 0, "chi2pix")?;
        let (a, rest) = rest.split_at_mut(per * sh.nd());
        dev.copy_from(a, ws.res.get(), 0, "resolution")?;
        if model {
            dev.copy_from(rest, ws.model.get(), 0, "model")?;
        }
    }
    let mut steps = vec![0i32; nblocks];
    let mut sweeps = vec![0i32; nblocks];
    dev.copy_from(&mut steps, ws.steps.get(), 0, "polar steps")?;
    dev.copy_from(&mut sweeps, ws.sweeps.get(), 0, "Jacobi sweeps")?;
    Ok((steps, sweeps))
}

/// The route of steps 2-3 for blocks of the shape `sh`: the Schur sweeps need their blocks
/// (plus a column) within the tile kernels' largest order, else the dense route.
pub(crate) fn route(solve: Solve, sh: &Shape) -> Solve {
    match solve {
        Solve::Schur if (sh.nt + 1).div_ceil(8) * 8 > TILE_MAX_ORDER => Solve::Dense,
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
    ws.xinv.ensure(g.dev, n * g.sh.mc() * g.sh.mc())?;
    let fact = dense::factorize(g, ws, live, region, input.options.regularize)?;
    clock.mark("factorize")?;
    dense::solve_flux(g, ws, n, keep)?;
    clock.mark("solve")?;
    dense::core_covariance(g, ws, n, keep)?;
    clock.mark("inverse")?;
    Ok(fact)
}

/// Solves one prepared chunk, whose inputs were uploaded into `ws.input`; results in the
/// order of `chunk`, and the chunk's image buffer back for reuse. `upload_next` queues the
/// next chunk's inputs into `ws.next` once the device has this chunk's work in hand.
#[allow(clippy::too_many_arguments)]
pub(crate) fn solve_chunk(
    g: Gpu<'_>,
    tuning: &Tuning,
    ws: &mut Workspace,
    input: &FrameInput<'_>,
    chunk: &[&Patch],
    mut host: ChunkHost,
    upload_next: impl FnOnce(&mut Inputs) -> Result<()>,
    timings: &mut GpuTimings,
) -> Result<(Vec<PatchResult>, Staging<f32>)> {
    timings.add("host tables", host.prep_ms);
    let mut results: Vec<Option<PatchResult>> = vec![None; chunk.len()];
    for (i, r) in std::mem::take(&mut host.off) {
        results[i] = Some(r);
    }
    let n = host.live.len();
    if n > 0 {
        let live = Live {
            input,
            chunk,
            host: &host,
        };
        solve_live(g, tuning, ws, live, upload_next, timings, &mut results)?;
    } else {
        upload_next(&mut ws.next)?;
    }
    let results = results
        .into_iter()
        .map(|r| r.ok_or_else(|| Error::Gpu("internal: a patch of the chunk has no result".into())))
        .collect::<Result<Vec<_>>>()?;
    Ok((results, host.image))
}

/// A chunk with live patches: the frame, the chunk's patches and its host tables.
struct Live<'a, 'f> {
    input: &'a FrameInput<'f>,
    chunk: &'a [&'a Patch],
    host: &'a ChunkHost,
}

/// The steps of [`solve_chunk`] for the live patches of a chunk.
fn solve_live(
    g: Gpu<'_>,
    tuning: &Tuning,
    ws: &mut Workspace,
    Live { input, chunk, host }: Live<'_, '_>,
    upload_next: impl FnOnce(&mut Inputs) -> Result<()>,
    timings: &mut GpuTimings,
    results: &mut [Option<PatchResult>],
) -> Result<()> {
    let n = host.live.len();
    let region = Region {
        row0: host.region.0,
        col0: host.region.2,
        width: host.region.3 - host.region.2,
    };
    let live: Vec<&Patch> = host.live.iter().map(|(ci, _, _)| chunk[*ci]).collect();
    let mut clock = PhaseClock::new(g.dev);
    clock.mark("start")?;
    copy_in(g, ws, host)?;
    clock.mark("copies in")?;
    launchers::spots(g, input.psf, ws, host.xy.len() / 2)?;
    clock.mark("spots")?;
    launchers::assemble(g, n, None, ws, region, input.options.regularize)?;
    clock.mark("assemble")?;
    let mut keep = Keep::new();
    let (fact, kind) = match route(tuning.solve, g.sh) {
        Solve::Schur => {
            schur::ensure(g, ws, n)?;
            let (fact, coupled) = schur::factorize(
                g,
                ws,
                &live,
                region,
                input.options.regularize,
                tuning.coupling_max,
            )?;
            clock.mark("sweeps")?;
            timings.coupled += coupled.patches;
            timings.max_coupling = timings.max_coupling.max(coupled.largest);
            (fact, BlockKind::Precision)
        }
        Solve::Dense => {
            timings.dense_route = true;
            (
                dense_steps(g, ws, &live, region, input, &mut clock, &mut keep)?,
                BlockKind::Covariance,
            )
        }
    };
    decorrelate_chunk(g, tuning, ws, n, kind)?;
    clock.mark("decorrelate")?;
    finalize(g, ws, host, region, input)?;
    clock.mark("finalize")?;
    let (steps, sweeps) = copy_out(g, ws, host, input.options.model)?;
    clock.mark("copies out")?;
    upload_next(&mut ws.next)?;
    g.dev.sync("chunk results")?;
    drop(keep);
    let counts = Counts::new(&steps, &sweeps);
    clock.collect(timings)?;
    timings.retried += fact.retried;
    timings.cpu_fallback += fact.to_cpu.len();
    timings.polar_blocks += counts.polar;
    timings.polar_fallback += counts.fallback;
    timings.max_polar_steps = timings.max_polar_steps.max(counts.max_steps);
    timings.max_sweeps = timings.max_sweeps.max(counts.max_sweeps);
    if let Ok((free, total)) = g.dev.mem_info() {
        timings.device_used_bytes = timings.device_used_bytes.max(total - free);
    }

    let t_res = Instant::now();
    let (sh, model) = (g.sh, input.options.model);
    let per = n * sh.ncore * sh.nws;
    let nback = Back::len(per, sh.nd(), if model { host.box_total } else { 0 });
    let back = Back::split(ws.back.current(nback), per, sh.nd());
    results::unpack(sh, chunk, host, &back, &fact, model, results);
    results::cpu_fallback(input, sh, chunk, host, &fact.to_cpu, results);
    timings.add("host results", t_res.elapsed().as_secs_f64() * 1e3);
    Ok(())
}
