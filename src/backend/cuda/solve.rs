//! The batched solve of a frame's patches on the device (DESIGN "Solve of one patch", the
//! same steps as [`crate::backend::cpu`]). A frame is one chunk: each part of its tables and
//! image is uploaded once, with the first wave that needs it (`Inputs::upload_wave`), and the
//! device walks its live patches in waves, each through the same per-patch buffers, as a
//! sequence of named steps:
//!
//! 1. copies in: the wave's column tables, once the compute stream has joined the upload of
//!    what the wave adds to the frame's tables and image;
//! 2. spots of every bundle in the wave (`launchers::spots`), but for a bundle the wave
//!    before evaluated last;
//! 3. assembly of icov (one triangle, icov being symmetric: dense for cuSOLVER on the dense
//!    route, the band of fiber blocks the sweeps read on the Schur route), y, fluxweight and
//!    regularisation (`launchers::assemble`);
//! 4. factorisation with its retry, xflux and the core covariance blocks C_bb through cuSOLVER
//!    and cuBLAS (`dense`), or, where second neighbours decouple, each core block's Schur
//!    complement S_b = C_bb^-1 and xflux by block sweeps over the fibers (`schur`);
//! 5. the model of each patch and chi2pix (and, when rejecting outliers, their test);
//! 6. decorrelation of each core block (`decorrelate`: polar, Jacobi for the blocks it gives
//!    up on), but for patches whose test found outliers, then the optional core model image;
//! 7. the wave's results gathered into the frame's (`gather`), on the device, so that the
//!    next wave reuses the buffers at once.
//!
//! Every wave is queued before the host looks at any result: on the default (Schur) route the
//! device never waits for the host within a frame. The host then copies each wave's results
//! back, on a stream of their own, once the device has gathered them, and unpacks them while
//! the device runs the waves after (`finish_wave`, `results`).

use std::time::Instant;

use cudarc::driver::CudaEvent;

use super::decorrelate::{self, BlockKind, Counts, Scratch};
use super::dense::{self, Factorization, Keep};
use super::launchers::{self, CoreIn, CoreOut, Gpu, TILE_MAX_ORDER};
use super::results::{self, Back, FallbackReason};
use super::schur;
use super::shape::Shape;
use super::tables::{FrameHost, Layout, Live};
use super::timings::{GpuTimings, PhaseClock};
use super::tuning::{Solve, Tuning};
use super::workspace::{Region, Workspace};
use crate::backend::{FrameInput, Progress};
use crate::error::Result;
use crate::extract::PatchResult;
use crate::frame::FrameValues;
use crate::plan::Patch;

/// Step 1: sizes the wave's buffers (kept between waves), points the launchers at its tables
/// and writes its column tables.
fn copy_in(
    g: Gpu<'_>,
    ws: &mut Workspace,
    host: &FrameHost,
    wi: usize,
    solve: Solve,
) -> Result<()> {
    let (dev, sh) = (g.dev, g.sh);
    let w = &host.waves[wi];
    let n = w.len();
    let (m, ncore, nws) = (sh.m(), sh.ncore, sh.nws);
    if ws.spots.ensure(dev, w.nspots(sh) * sh.nx * sh.ny)? {
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
    ws.view = ws.input.view(host, wi, sh);
    launchers::column_table(g, ws, n)?;
    dev.zero_prefix(ws.pixmask.get(), n * ncore * nws)?;
    dev.zero_prefix(ws.masked.get(), n)
}

/// Step 2: the spots of the wave's bundles. A bundle split between this wave and the one
/// before, which evaluated its spots last, has them copied rather than evaluated again (a
/// wave need not end with a bundle: a full frame's bundles have 235 patches each); where the
/// frame keeps its spots for outlier rejection they are in place already, and a wave solved
/// again finds all of its own there.
fn spots(
    g: Gpu<'_>,
    ws: &mut Workspace,
    input: &FrameInput<'_>,
    host: &FrameHost,
    wi: usize,
) -> Result<()> {
    let sh = g.sh;
    let w = &host.waves[wi];
    let bundles = &host.bundles[w.slots.clone()];
    let per_bundle = sh.bundlesize * sh.nfull;
    let size = sh.nx * sh.ny;
    let (at, evaluated) = super::reject::spots_place(ws, w.spot0(sh) * size);
    ws.spots_at = at;
    if evaluated {
        return Ok(());
    }
    let mut first = 0;
    if let Some((bundle, from)) = ws.last_spots.take() {
        if bundles.first() == Some(&bundle) {
            if from != at {
                let spots = ws.spots.get();
                g.dev.dtod_at(spots, at, spots, from, per_bundle * size)?;
            }
            first = per_bundle;
        }
    }
    launchers::spots(g, input.psf, ws, first, w.nspots(sh))?;
    if let Some(&last) = bundles.last() {
        ws.last_spots = Some((last, at + (bundles.len() - 1) * per_bundle * size));
    }
    Ok(())
}

/// Step 6 for the wave's patches: flux, ivar and resolution of every core block, from the
/// blocks step 4 left (`kind`), straight into the frame's results at the wave's place `at`;
/// a patch whose entry of `skip` (a count per patch, or 0 for none) is nonzero is left out.
fn decorrelate_wave(
    g: Gpu<'_>,
    tuning: &Tuning,
    ws: &mut Workspace,
    (at, skip): (&Layout, u64),
    kind: BlockKind,
) -> Result<()> {
    let (dev, sh) = (g.dev, g.sh);
    let (n, nblocks, c0) = (at.patches.len(), at.blocks.len(), at.bins.start);
    // sizes for the call's largest wave
    let size = ws.sized(n);
    let blocks = size * sh.ncore;
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
            nkeep: ws.view.nkeep,
            skip,
        },
        kind,
        Scratch {
            pbuf: ws.pbuf.get(),
            factored: kind == BlockKind::Precision,
            steps: ws.steps.get(),
            sweeps: ws.sweeps.get(),
        },
        CoreOut {
            flux: ws.out.flux.get().at(c0),
            ivar: ws.out.ivar.get().at(c0),
            res: ws.out.res.get().at(c0 * sh.nd()),
            fluxcol: ws.fluxcol.get().ptr,
        },
        0,
    )
}

/// Step 5: chi2pix from the model of xflux for the wave's `n` patches and their `boxes`
/// model values (the first `skip` belong to patches before them), and the outlier test of
/// their models when rejecting outliers. Returns the decorrelation's `skip` argument: the
/// test's counts, whose patches with outliers are solved again, or 0 where none ran.
fn finalize(
    g: Gpu<'_>,
    ws: &mut Workspace,
    (n, skip, boxes): (usize, usize, usize),
    region: Region,
    input: &FrameInput<'_>,
) -> Result<u64> {
    ws.model.ensure(g.dev, boxes)?;
    ws.chi2.ensure(g.dev, ws.sized(n) * g.sh.ncore * g.sh.nws)?;
    g.dev.zero_prefix(ws.model.get(), boxes)?;
    launchers::project(g, n, ws, ws.x.get(), ws.reject.core_ptr())?;
    let outliers = super::reject::keep_fit(g, ws, n, (skip, boxes), region)?;
    // after the test: a patch solved again gets its chi2pix from its last solve
    launchers::chi2pix(g, n, ws, region, input.options.psferr, outliers)?;
    Ok(outliers)
}

/// After step 6: the model image of the core flux, when asked, for the wave's `n` patches
/// and their `boxes` model values.
fn model_image(g: Gpu<'_>, ws: &Workspace, (n, boxes): (usize, usize)) -> Result<()> {
    g.dev.zero_prefix(ws.model.get(), boxes)?;
    launchers::project(g, n, ws, ws.fluxcol.get(), 0)
}

/// Step 7: the wave's pixmask and chi2pix, verdicts (polar steps, Jacobi sweeps; the Schur
/// sweeps' come earlier, [`sweep_verdicts`]) and, when asked, model boxes, into the frame's
/// results at the wave's place (the decorrelation wrote flux, ivar and resolution there).
fn gather(g: Gpu<'_>, ws: &Workspace, host: &FrameHost, wi: usize, model: bool) -> Result<()> {
    let (dev, sh) = (g.dev, g.sh);
    let w = &host.waves[wi];
    let at = w.layout(sh);
    let (b0, nb) = (at.blocks.start, at.blocks.len());
    let (c0, per) = (at.bins.start, at.bins.len());
    let out = &ws.out;
    dev.dtod_at(out.pixmask.get(), c0, ws.pixmask.get(), 0, per)?;
    dev.dtod_at(out.chi2.get(), c0, ws.chi2.get(), 0, per)?;
    dev.dtod_at(out.steps.get(), b0, ws.steps.get(), 0, nb)?;
    dev.dtod_at(out.sweeps.get(), b0, ws.sweeps.get(), 0, nb)?;
    if model && !w.boxes.is_empty() {
        let (m0, len) = (w.boxes.start, w.boxes.len());
        // a wave solved again for outliers may start after its boxes' first patch
        let skip = host.first_box(w);
        dev.dtod_at(out.model.get(), m0 + skip, ws.model.get(), skip, len - skip)?;
    }
    Ok(())
}

/// The sweeps' verdicts of wave `wi` into the frame's, as soon as the sweeps are done: outlier
/// rejection reads them with the test's counts, before the wave's decorrelation (the patches
/// the CPU reference will solve are not solved again on the device).
fn sweep_verdicts(g: Gpu<'_>, ws: &Workspace, host: &FrameHost, wi: usize) -> Result<()> {
    let at = host.waves[wi].layout(g.sh);
    let (p0, n) = (at.patches.start, at.patches.len());
    let (dev, out) = (g.dev, &ws.out);
    dev.dtod_at(out.first_info.get(), p0, ws.first_info.get(), 0, n)?;
    dev.dtod_at(out.info.get(), p0, ws.info.get(), 0, n)?;
    dev.dtod_at(out.masked.get(), p0, ws.masked.get(), 0, n)?;
    dev.dtod_at(out.coupling.get(), p0, ws.coupling.get(), 0, n)
}

/// Queues the copies back of wave `wi`'s results from the frame's, on the stream of the copies
/// back once the device has gathered them: the core arrays (and the model boxes when asked)
/// into `ws.back`, the verdicts into `ws.verdicts` and `ws.coupling_back`. Returns the events
/// at the start and the end of the copies; the host buffers are valid once the device has
/// passed the second.
fn copy_back(
    g: Gpu<'_>,
    ws: &mut Workspace,
    host: &FrameHost,
    q: &Queued<'_>,
    model: bool,
) -> Result<(CudaEvent, CudaEvent)> {
    let (dev, sh) = (g.dev, g.sh);
    let w = &host.waves[q.wave];
    let at = w.layout(sh);
    let (p0, n) = (at.patches.start, at.patches.len());
    let (b0, nblocks) = (at.blocks.start, at.blocks.len());
    let (c0, per) = (at.bins.start, at.bins.len());
    dev.back_after(q.clock.last())?;
    let start = dev.back_event()?;
    let nback = Back::len(per, sh.nd(), if model { w.boxes.len() } else { 0 });
    let s = ws.back.get(nback);
    let (flux, rest) = s.split_at_mut(per);
    let (ivar, rest) = rest.split_at_mut(per);
    let (pixmask, rest) = rest.split_at_mut(per);
    let (chi2, rest) = rest.split_at_mut(per);
    let (res, boxes) = rest.split_at_mut(per * sh.nd());
    let out = &ws.out;
    dev.copy_back(flux, out.flux.get(), c0, "flux")?;
    dev.copy_back(ivar, out.ivar.get(), c0, "ivar")?;
    dev.copy_back(pixmask, out.pixmask.get(), c0, "pixmask fraction")?;
    dev.copy_back(chi2, out.chi2.get(), c0, "chi2pix")?;
    dev.copy_back(res, out.res.get(), c0 * sh.nd(), "resolution")?;
    if model {
        dev.copy_back(boxes, out.model.get(), w.boxes.start, "model")?;
    }
    let nsweep = q.steps.verdicts_per_patch() * n;
    let v = ws.verdicts.get(2 * nblocks + nsweep);
    let (polar, rest) = v.split_at_mut(nblocks);
    let (jacobi, sweeps) = rest.split_at_mut(nblocks);
    dev.copy_back(polar, out.steps.get(), b0, "polar steps")?;
    dev.copy_back(jacobi, out.sweeps.get(), b0, "Jacobi sweeps")?;
    if let Steps::Schur { .. } = q.steps {
        let from = schur::DeviceVerdicts {
            first: out.first_info.get(),
            last: out.info.get(),
            masked: out.masked.get(),
            coupling: out.coupling.get(),
        };
        from.copy(dev, p0, sweeps, ws.coupling_back.get(n))?;
    }
    Ok((start, dev.back_event()?))
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

/// Where finished waves go: the call's results by patch, its timings, and the progress of the
/// call.
pub(crate) struct Sink<'s> {
    pub(crate) results: &'s mut [Option<PatchResult>],
    /// The frame's arrays, where the results' values go straight when the call was given them
    /// ([`results::Unpacking::place`]).
    pub(crate) values: Option<&'s mut FrameValues>,
    /// The last mark of the wave finished before, for the device's idle time between waves.
    pub(crate) last_mark: &'s mut Option<CudaEvent>,
    pub(crate) timings: &'s mut GpuTimings,
    pub(crate) progress: &'s Progress,
}

/// How steps 2-3 of a wave went: known at once on the dense route, whose library calls the
/// host waits for; on the Schur route decided on the device and read once the wave is done.
pub(crate) enum Steps {
    Dense(Factorization),
    Schur {
        /// Failed patches the device retried at most.
        capacity: usize,
        coupling_max: f64,
    },
}

impl Steps {
    /// Values per patch copied back after the decorrelation's verdicts.
    fn verdicts_per_patch(&self) -> usize {
        match self {
            Steps::Dense(_) => 0,
            Steps::Schur { .. } => schur::VERDICTS_PER_PATCH,
        }
    }
}

/// A wave whose work is queued on the device, with what its results need once the device has
/// passed its last mark.
pub(crate) struct Queued<'a> {
    wave: usize,
    /// The wave's patches, in the order of the device's batch.
    live: Vec<&'a Patch>,
    steps: Steps,
    /// Device arrays that queued library calls still read.
    keep: Keep,
    clock: PhaseClock<'a>,
}

impl Queued<'_> {
    /// The wave it solves, in its frame's `waves`.
    pub(crate) fn wave(&self) -> usize {
        self.wave
    }

    /// Where the device has tested the wave's patches for outliers and kept their equations
    /// (the end of its finalize step), before their decorrelation.
    pub(crate) fn tested(&self) -> Option<&CudaEvent> {
        self.clock.first_of("finalize")
    }

    /// The live patches of the wave that the CPU reference solves, from the sweeps' verdicts
    /// (the frame's, `verdicts` as [`schur::DeviceVerdicts::copy`] copies them, and
    /// `coupling`) or the dense route's factorisation, in the order of the wave's batch.
    pub(crate) fn to_cpu(&self, verdicts: &[i32], coupling: &[f64]) -> Vec<usize> {
        match &self.steps {
            Steps::Schur { coupling_max, .. } => {
                schur::cpu_patches(verdicts, coupling, *coupling_max)
            }
            Steps::Dense(fact) => fact.to_cpu.clone(),
        }
    }

    /// Whether the wave's patches took the Schur route (whose verdicts are on the device).
    pub(crate) fn on_schur_route(&self) -> bool {
        matches!(self.steps, Steps::Schur { .. })
    }
}

/// The frame's image as the kernels index it: the whole CCD.
fn region_of(input: &FrameInput<'_>) -> Region {
    Region {
        row0: 0,
        col0: 0,
        width: input.image.ncols,
    }
}

/// Queues steps 1-7 of wave `wi` of the frame `host`, whose tables and image are uploaded into
/// `ws.input`; `patches` are the frame's, in the order of its tables.
pub(crate) fn queue_wave<'a>(
    g: Gpu<'a>,
    tuning: &Tuning,
    ws: &mut Workspace,
    input: &FrameInput<'_>,
    patches: &[&'a Patch],
    host: &FrameHost,
    wi: usize,
) -> Result<Queued<'a>> {
    let w = &host.waves[wi];
    let n = w.len();
    let region = region_of(input);
    let live: Vec<&Patch> = w
        .patches()
        .into_iter()
        .map(|li| patches[host.live[li].0])
        .collect();
    let solve = route(tuning.solve, g.sh);
    let mut clock = PhaseClock::new(g.dev);
    clock.mark("start")?;
    copy_in(g, ws, host, wi, solve)?;
    clock.mark("copies in")?;
    spots(g, ws, input, host, wi)?;
    clock.mark("spots")?;
    if tuning.poison {
        // all bits set: a NaN
        let len = n * g.sh.m() * g.sh.icov_row_len(solve);
        g.dev.fill_prefix(ws.icov.get(), len, 0xff)?;
    }
    let reg = input.options.regularize;
    super::reject::prepare_wave(g.dev, ws, w, host)?;
    launchers::assemble(g, n, None, ws, region, reg, solve)?;
    clock.mark("assemble")?;
    let mut keep = Keep::new();
    let (steps, kind) = match solve {
        Solve::Schur => {
            let capacity = schur::retry_capacity(tuning.retry_capacity, n, reg);
            schur::ensure(g, ws, n, capacity)?;
            schur::factorize(g, ws, n, region, capacity)?;
            sweep_verdicts(g, ws, host, wi)?;
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
    // a wave solved again for outliers may start after its boxes' first patch
    let skip = host.first_box(w);
    let resolved = finalize(g, ws, (n, skip, w.boxes.len()), region, input)?;
    clock.mark("finalize")?;
    decorrelate_wave(g, tuning, ws, (&w.layout(g.sh), resolved), kind)?;
    clock.mark("decorrelate")?;
    if input.options.model {
        model_image(g, ws, (n, w.boxes.len()))?;
        clock.mark("finalize")?;
    }
    gather(g, ws, host, wi, input.options.model)?;
    clock.mark("gather")?;
    Ok(Queued {
        wave: wi,
        live,
        steps,
        keep,
        clock,
    })
}

/// Finishes a queued wave: its results copied back once the device has gathered them, its
/// counters and phase times, then one result per patch (by the CPU reference for those the
/// device handed over).
pub(crate) fn finish_wave(
    g: Gpu<'_>,
    ws: &mut Workspace,
    input: &FrameInput<'_>,
    host: &FrameHost,
    q: Queued<'_>,
    sink: &mut Sink<'_>,
) -> Result<()> {
    let (start, end) = copy_back(g, ws, host, &q, input.options.model)?;
    end.synchronize()
        .map_err(super::error::driver("wait for the copies back"))?;
    sink.timings.last_back = Some(Instant::now());
    let copies_ms = start
        .elapsed_ms(&end)
        .map_err(super::error::driver("cuEventElapsedTime"))?;
    drop(q.keep);
    let (sh, model) = (g.sh, input.options.model);
    let w = &host.waves[q.wave];
    let at = w.layout(sh);
    let (n, nblocks, per) = (at.patches.len(), at.blocks.len(), at.bins.len());
    let verdicts = ws
        .verdicts
        .current(2 * nblocks + q.steps.verdicts_per_patch() * n);
    let (polar, rest) = verdicts.split_at(nblocks);
    let (jacobi, sweeps) = rest.split_at(nblocks);
    let counts = Counts::new(polar, jacobi);
    let t = &mut *sink.timings;
    q.clock.collect(t)?;
    if let (Some(from), Some(to)) = (q.clock.first_of("copies in"), q.clock.last()) {
        g.dev.busy.record(from, to)?;
    }
    t.add("copies out", copies_ms as f64);
    *sink.last_mark = q.clock.idle_since(sink.last_mark.take(), t)?;
    let (fact, coupled) = match q.steps {
        Steps::Schur {
            capacity,
            coupling_max,
        } => {
            let coupling = ws.coupling_back.current(n);
            let (fact, c) = schur::outcome(&q.live, sweeps, coupling, capacity, coupling_max);
            t.max_coupling = t.max_coupling.max(c.largest);
            (fact, c.patches)
        }
        Steps::Dense(fact) => {
            t.dense_route = true;
            (fact, 0)
        }
    };
    t.retried += fact.retried;
    t.polar_blocks += counts.polar;
    t.polar_fallback += counts.fallback;
    t.max_polar_steps = t.max_polar_steps.max(counts.max_steps);
    t.max_sweeps = t.max_sweeps.max(counts.max_sweeps);

    let t_res = Instant::now();
    let nback = Back::len(per, sh.nd(), if model { w.boxes.len() } else { 0 });
    let back = Back::split(ws.back.current(nback), per, sh.nd());
    let (live, boxoff) = host.wave_patches(q.wave);
    let live = &live[..];
    let reg = input.options.regularize;
    let unpacking = results::Unpacking {
        sh,
        patches: &q.live,
        live,
        boxoff: &boxoff,
        back: &back,
        fact: &fact,
        core_model: model,
        regularize: reg,
    };
    let solved = match sink.values.as_deref_mut() {
        Some(values) => unpacking.place(values),
        None => unpacking.unpack(),
    };
    // schur::outcome lists the coupled patches after the failed ones
    let (failed, coupled) = fact.to_cpu.split_at(fact.to_cpu.len() - coupled);
    let (failed, coupled) = (
        not_on_cpu_yet(failed, live, sink),
        not_on_cpu_yet(coupled, live, sink),
    );
    sink.timings.cpu_fallback += failed.len() + coupled.len();
    sink.timings.coupled += coupled.len();
    let fallback =
        |ids, why| results::cpu_fallback(input, sh, &q.live, live, &host.bundles, ids, why);
    let failed = fallback(&failed, FallbackReason::FailedTwice);
    let coupled = fallback(&coupled, FallbackReason::Coupled);
    for (ci, r) in solved.into_iter().chain(failed).chain(coupled) {
        sink.results[ci] = Some(r);
    }
    sink.timings
        .add("host results", t_res.elapsed().as_secs_f64() * 1e3);
    sink.progress.add(n);
    Ok(())
}

/// The patches of `ids` (in the wave's `live`) that the CPU reference has not solved yet in
/// this call: a wave solved again for outliers holds patches it solved (and tested for
/// outliers: their `rejected` is set) the first time, whose result stands and which the log
/// counts once.
fn not_on_cpu_yet(ids: &[usize], live: &[Live], sink: &Sink<'_>) -> Vec<usize> {
    ids.iter()
        .copied()
        .filter(|&i| {
            sink.results[live[i].0]
                .as_ref()
                .is_none_or(|r| r.rejected.is_empty())
        })
        .collect()
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
