//! Outlier rejection on the device (`--reject-outliers`, see [`crate::outliers`]): the same
//! test and the same passes as the CPU's (`backend::cpu::reject`), over a frame's waves.
//!
//! Each wave keeps, beside its results, the model `A xflux` of each patch over its box (the
//! finalize step projects it for chi2pix) and, in the first pass, a flag per box pixel that
//! the test looks at (set by the projection, `project_f64` in kernels/finalize.cu). Right
//! after, in the wave's own queue, the device tests its patches (`outlier_test`: the CPU's
//! [`crate::outliers::find_outliers`], pixel for pixel) and gives the outliers weight zero in
//! a flag per box pixel (`rejected`), which the assembly and chi2pix read: in that patch only,
//! since boxes overlap and the image is shared. The host reads back only how many outliers
//! each patch had (and the sweeps' verdicts, which name the patches the CPU reference solves),
//! as soon as the device has passed the wave's test, and gathers the patches with new
//! outliers into re-solve waves (`resolves`), queued behind the others once a single wave is
//! left in flight, so that the host builds them while the device decorrelates the wave:
//! their tables, gathered on the host, and their results take free places among the frame's
//! (not those of the waves in flight), while their spots and model boxes stay where the first
//! pass left them (`Wave::picked`), so that the kernels find each patch's box and rejected
//! pixels there (with `-m`, a wave is finished before its patches are placed again: a re-solve
//! wave writes the model boxes between its patches'). A
//! re-solve is tested in turn, and so on until a test finds no outlier or [`MAX_RESOLVES`]
//! solves have been added, as on the CPU. A re-solve starts from the normal equations its
//! patch kept after the test, less the outliers' terms ([`kept`]). A wave's chi2pix and
//! decorrelation come after its test, only for its patches without outliers (only a patch's
//! last solution is kept). Only patches with new outliers are tested after a re-solve; a
//! patch the CPU reference solved (a failed or coupled one) was tested there already.

use std::collections::VecDeque;
use std::sync::Arc;
use std::time::Instant;

use cudarc::driver::CudaContext;

use super::device::Device;
use super::kernels;
use super::launchers::Gpu;
use super::schur;
use super::solve::{self, Queued, Sink};
use super::staging::Staging;
use super::tables::{FrameHost, Wave};
use super::tuning::Tuning;
use super::workspace::{Region, Slot, Workspace};
use crate::backend::{FrameInput, Progress};
use crate::error::{Error, Result};
use crate::extract::PatchResult;
use crate::outliers::{
    CONTRAST_NSIGMA, GROW_NSIGMA, MAX_RESOLVES, SHARP_EDGE, SHARP_FRACTION, SHARP_NSIGMA,
    UNTESTED_REACH,
};
use crate::plan::Patch;
use resolves::{Bounds, Merge, Pending, Resolve};

pub(crate) mod kept;
mod resolves;

/// The device's share of rejection: frame-sized arrays over every patch's box, in the order
/// of the waves' model boxes.
pub(crate) struct Boxes {
    /// Whether the frame being solved rejects outliers.
    on: bool,
    /// Whether the frame's spots stay on the device for its re-solves, each bundle's at a
    /// place of its own in `Workspace::spots` (`spots_place`).
    keep_spots: bool,
    /// Passes done before the one being queued (0: the first solve).
    pass: usize,
    /// The test's NSIGMA and the PSF error of its noise.
    limits: (f64, f64),
    /// Taken pixels the test's growth keeps in its list, and the largest box whose growth
    /// reads its maps (`Tuning::outlier_list`, `Tuning::outlier_maps`).
    list: u32,
    maps: u32,
    /// Where the wave being queued starts in the arrays.
    wave_at: usize,
    /// Where the wave being queued starts among the frame's live patches (in `counts`).
    live_at: usize,
    /// `A xflux` of each patch's last solution.
    fit: Slot<f64>,
    /// 1 where the test looks (pixels of the tested columns' spots).
    core: Slot<u8>,
    /// 1 where a pixel has weight zero in its patch.
    rejected: Slot<u8>,
    /// The outliers the last test of each live patch found.
    counts: Slot<i32>,
    /// Their host copy (pinned from the second frame on).
    counts_back: Staging<i32>,
    /// By place, as the counts: 1 for a patch of a re-solve wave whose solve is its last,
    /// which the test skips; read where the wave being queued mixes them with tested ones.
    untested: Slot<i32>,
    mixed: bool,
    /// The normal equations kept for the re-solves.
    pub(crate) kept: kept::Kept,
}

impl Boxes {
    pub(crate) fn new(ctx: Arc<CudaContext>) -> Self {
        Boxes {
            on: false,
            keep_spots: false,
            pass: 0,
            limits: (0.0, 0.0),
            list: TAKEN_LIST,
            maps: MAP_PIXELS,
            wave_at: 0,
            live_at: 0,
            fit: Slot::new("model boxes of the outlier test"),
            core: Slot::new("tested pixels"),
            rejected: Slot::new("rejected pixels"),
            counts: Slot::new("outlier counts"),
            untested: Slot::new("untested re-solves"),
            mixed: false,
            counts_back: pinned_later(&ctx),
            kept: kept::Kept::new(ctx.clone()),
        }
    }

    /// Starts a frame: rejection at `nsigma` (None: off) with the noise's PSF error
    /// `psferr`, first pass; its spots kept for the re-solves where `keep_spots` (see
    /// [`keeps_spots`]); the test's growth sized by `tuning`.
    pub(crate) fn start(
        &mut self,
        nsigma: Option<f64>,
        psferr: f64,
        keep_spots: bool,
        tuning: &Tuning,
    ) {
        self.on = nsigma.is_some();
        self.list = tuning.outlier_list;
        self.maps = tuning.outlier_maps;
        self.limits = (nsigma.unwrap_or(0.0), psferr);
        self.keep_spots = self.on && keep_spots;
        self.pass = 0;
        self.mixed = false;
    }

    /// The device address of the wave's rejected-pixel flags, 0 (none) when rejection is off:
    /// the kernels' argument.
    pub(crate) fn rejected_ptr(&self) -> u64 {
        if self.on {
            self.rejected.get().at(self.wave_at)
        } else {
            0
        }
    }

    /// The flags that the assembly and chi2pix of the wave being queued read: none in its
    /// patches' first solve, whose boxes have none yet (a patch its test flags is solved
    /// again, and its first chi2pix is not kept). Reading them took the first solve's
    /// assembly 0.28 ms more on a full-width frame.
    pub(crate) fn weights_ptr(&self) -> u64 {
        if self.pass > 0 {
            self.rejected_ptr()
        } else {
            0
        }
    }

    /// Where the projection of the wave being queued flags the pixels the test looks at: in
    /// its patches' first solve (0: none).
    pub(crate) fn core_ptr(&self) -> u64 {
        if self.on && self.pass == 0 {
            self.core.get().at(self.wave_at)
        } else {
            0
        }
    }

    /// The assembly's arguments for the kept equations of the wave being queued (0 in its
    /// patches' first solve and where none are kept).
    pub(crate) fn kept_args(&self) -> (u64, u64) {
        if self.on {
            self.kept.args(self.pass > 0, self.live_at)
        } else {
            (0, 0)
        }
    }
}

/// Device bytes per patch of the frame-sized arrays when rejection is `on`, for a patch whose
/// model box takes `model_box` bytes (of f64): the model box again and two flags per pixel.
pub(crate) fn box_bytes(on: bool, model_box: usize) -> usize {
    if on {
        model_box + 2 * model_box / 8
    } else {
        0
    }
}

/// Whether a frame that rejects outliers (`on`) keeps the spots of all its bundles,
/// `frame_spots` bytes, on the device for its re-solves rather than evaluating a wave's again
/// for each (3.6 ms of the full-width frame's 60 on an H100): where they take at most half of
/// the device memory `budget`, so that the waves keep most of the rest.
pub(crate) fn keeps_spots(on: bool, frame_spots: usize, budget: usize) -> bool {
    on && frame_spots <= budget / 2
}

/// Where a wave whose first spot is `spot0` values into the frame's spots puts them in
/// `Workspace::spots`, and whether they are there already: each bundle's at a place of its
/// own in a frame that keeps them, whose re-solves find them there; at the start otherwise.
pub(crate) fn spots_place(ws: &Workspace, spot0: usize) -> (usize, bool) {
    let b = &ws.reject;
    if b.keep_spots {
        (spot0, b.pass > 0)
    } else {
        (0, false)
    }
}

/// A host buffer of copies back, pinned in the background once a frame has used it.
fn pinned_later<T: Copy + Default + Send + 'static>(ctx: &Arc<CudaContext>) -> Staging<T> {
    let mut s = Staging::new(ctx.clone());
    s.allow_pinning(0);
    s
}

/// Before a wave's assembly: points the flags and counts at wave `w` of `host` (its boxes
/// within the frame's); in the first pass, sizes the arrays and clears the wave's flags. The
/// counts are sized for every patch of the frame from its first wave on: the host reads a
/// wave's counts on the stream of the copies back, which waits for that wave's work alone,
/// so a later wave must not move them into a larger buffer (a frame's first wave then read
/// zeros at times, and its patches were not solved again).
pub(crate) fn prepare_wave(
    dev: &Device,
    ws: &mut Workspace,
    w: &Wave,
    host: &FrameHost,
) -> Result<()> {
    let b = &mut ws.reject;
    if !b.on {
        return Ok(());
    }
    let boxes = w.boxes.clone();
    (b.wave_at, b.live_at) = (boxes.start, w.live.start);
    if b.pass == 0 {
        let total = host.box_total;
        b.fit.grow_keeping(dev, total, boxes.start)?;
        b.core.grow_keeping(dev, total, boxes.start)?;
        b.rejected.grow_keeping(dev, total, boxes.start)?;
        b.counts.grow_keeping(dev, host.npatches(), w.live.start)?;
        b.untested
            .grow_keeping(dev, host.npatches(), w.live.start)?;
        for s in [b.core.get(), b.rejected.get()] {
            dev.fill_range(s, boxes.clone(), 0)?;
        }
    }
    Ok(())
}

/// After the projection: keeps the wave's model values (`A xflux`, in `ws.model`) for the
/// test, those from `skip` to `len` (a wave solved again may start after its boxes' first
/// patch; the boxes of the patches between its own get zeros, which no test reads), and tests
/// the wave's `n` patches but after the last pass, keeping the equations of those with
/// outliers.
/// Returns the device address of the test's counts, nonzero for the patches solved again,
/// whose chi2pix and decorrelation wait for their last solve (0: no test ran, every patch is
/// kept).
pub(crate) fn keep_fit(
    g: Gpu<'_>,
    ws: &Workspace,
    n: usize,
    (skip, len): (usize, usize),
    region: Region,
) -> Result<u64> {
    let b = &ws.reject;
    if !b.on || len <= skip {
        return Ok(0);
    }
    let at = b.wave_at + skip;
    g.dev
        .dtod_at(b.fit.get(), at, ws.model.get(), skip, len - skip)?;
    if b.pass == MAX_RESOLVES {
        return Ok(0);
    }
    test(g, ws, n, region)?;
    let counts = b.counts.get().at(b.live_at);
    kept::Kept::keep(g, ws, n, b.live_at, counts)?;
    Ok(counts)
}

/// Threads of a block of `outlier_test` (`SPEX_TEST_THREADS` in kernels/reject.cu).
const TEST_THREADS: u32 = 1024;

/// The most taken pixels the test's growth keeps in its list (`SPEX_TAKEN_LIST` in
/// kernels/reject.cu, the size of its array in shared memory).
pub(crate) const TAKEN_LIST: u32 = 4096;

/// The largest box whose pixels the test's growth claims in its bitmap
/// (`SPEX_CLAIM_PIXELS` in kernels/reject.cu).
const CLAIM_PIXELS: u32 = 65536;

/// Bytes of dynamic shared memory of a block of `outlier_test` (`SPEX_TEST_SHARED` in
/// kernels/reject.cu): its growth's list, bitmap and maps, under the 48 KB that leave the SM
/// most of its L1. With its 6.3 KB of static memory, two blocks share an SM.
const TEST_SHARED: usize = 40960;

/// The largest box whose growth reads its maps in the shared memory left (`SPEX_MAP_PIXELS`
/// in kernels/reject.cu): a full r frame's boxes hold 5700-7900 pixels.
pub(crate) const MAP_PIXELS: u32 = (TEST_SHARED as u32 - TAKEN_LIST * 4 - CLAIM_PIXELS / 8) / 2;

// The maps of the largest full r box fit, within the 48 KB a block has without opting in.
const _: () = assert!(MAP_PIXELS >= 7936 && TEST_SHARED <= 48 << 10);

/// The outlier test of the wave's `n` patches on their model boxes, a block each: outliers
/// flagged in `rejected`, how many in `counts`.
fn test(g: Gpu<'_>, ws: &Workspace, n: usize, region: Region) -> Result<()> {
    let b = &ws.reject;
    let (nsigma, psferr) = b.limits;
    kernels::launch(
        g.dev,
        &g.k.outlier_test,
        "outlier_test",
        (n as u32, 1, 1),
        TEST_THREADS,
        TEST_SHARED,
        kernels::Args::new()
            .ptr(b.fit.get().at(b.wave_at))
            .ptr(b.core.get().at(b.wave_at))
            .ptr(b.rejected.get().at(b.wave_at))
            .ptr(ws.view.boxes)
            .ptr(ws.view.boxoff)
            .ptr(ws.view.pix)
            .ptr(ws.view.ivar)
            .region(region)
            .f64(nsigma)
            .f64(psferr)
            .f64(GROW_NSIGMA)
            .f64(SHARP_NSIGMA)
            .f64(SHARP_FRACTION)
            .f64(CONTRAST_NSIGMA)
            .i32(UNTESTED_REACH as i32)
            .i32(SHARP_EDGE as i32)
            .i32(b.list as i32)
            .i32(b.maps as i32)
            .ptr(b.counts.get().at(b.live_at))
            .ptr(if b.mixed {
                b.untested.get().at(b.live_at)
            } else {
                0
            }),
    )
}

/// What rejection did to one live patch, as `backend::cpu::reject` reports it.
#[derive(Clone, Debug, Default)]
struct Done {
    nrejected: usize,
    nresolves: usize,
    /// The slot of the equations its next solve starts from (None: assembled again).
    kept: Option<i32>,
    /// The masked fraction of each core spot after the first solve.
    before: Vec<f64>,
}

impl Done {
    /// A test found `n` new outliers; its next solve starts from kept equations `slot` (-1:
    /// none).
    fn found(&mut self, n: usize, slot: i32) {
        self.kept = (slot >= 0).then_some(slot);
        self.nrejected += n;
        self.nresolves += 1;
    }
}

/// A wave queued on the device and what its results go through once finished.
struct InFlight<'a> {
    queued: Queued<'a>,
    /// Whether it is its patches' first solve.
    first: bool,
    /// The live patches it solves that are tested after this solve (none in a wave of last
    /// solves).
    tested: Vec<usize>,
}

/// Finishes the frame's `queued` waves (the first solve of each) and solves again the
/// patches whose test found new outliers: the device has tested them in each wave's queue,
/// the host reads how many outliers each had once the wave is finished, while the device
/// runs the waves queued after it, and gathers them from the finished waves into re-solve
/// waves (`resolves`) queued behind those still running, so that the device never waits for
/// the test of the whole frame. A patch is tested after each of its solves but the last of
/// [`MAX_RESOLVES`] re-solves, as on the CPU; once its last solve is finished, each
/// device-solved patch gets its rejection counts and the fraction of each core spot it lost.
#[allow(clippy::too_many_arguments)]
pub(crate) fn finish_frame<'a>(
    g: Gpu<'a>,
    tuning: &Tuning,
    ws: &mut Workspace,
    input: &FrameInput<'_>,
    patches: &[&'a Patch],
    host: &mut FrameHost,
    queued: Vec<Queued<'a>>,
    sink: &mut Sink<'_>,
) -> Result<()> {
    let planned = host.waves.len();
    let ci: Vec<usize> = host.live.iter().map(|l| l.0).collect();
    let largest = host.largest_wave();
    ws.reject.counts_back.get(largest);
    let bounds = Bounds {
        patches: largest,
        span: largest * (super::MODEL_BOX_BYTES / 8),
    };
    let ahead = gather_ahead(ws.reject.keep_spots);
    let mut done = vec![Done::default(); ci.len()];
    let mut pending = Pending::default();
    let mut fifo = first_solves(queued, host);
    let (mut test_ms, mut queue_ms) = (0.0, 0.0);
    while let Some(f) = fifo.pop_front() {
        let wi = f.queued.wave();
        // the test's counts as soon as the device has passed it, so that the re-solves are
        // queued while the device decorrelates the wave
        let t_test = Instant::now();
        let Tested {
            changed,
            on_device: tested,
        } = read_counts(g.dev, ws, &host.waves[wi], &f.queued, &f.tested)?;
        for &(li, n, slot) in &changed {
            done[li].found(n, slot);
            pending.add(li, done[li].nresolves);
        }
        let round_test_ms = t_test.elapsed().as_secs_f64() * 1e3;
        test_ms += round_test_ms;
        // A wave whose model boxes are copied back is finished first: a re-solve wave zeroes
        // the boxes between its patches'. Otherwise it holds its places until it is.
        let mut unfinished = Some(f.queued);
        let mut finish_ms = 0.0;
        if input.options.model {
            if let Some(q) = unfinished.take() {
                finish_ms = finish(g, ws, input, host, q, sink, f.first)?;
            }
        }
        let t_queue = Instant::now();
        let mut resolves = Vec::new();
        if pending.len() >= bounds.patches || fifo.len() <= ahead {
            let queued: Vec<&Wave> = fifo.iter().map(|f| &host.waves[f.queued.wave()]).collect();
            let this = unfinished.as_ref().map(|_| &host.waves[wi]);
            let places: Vec<&Wave> = queued.iter().copied().chain(this).collect();
            let merge = if ws.reject.keep_spots {
                Merge::Held {
                    all: queued.is_empty(),
                }
            } else {
                Merge::Apart
            };
            resolves = pending.take(host, (&places, &queued), bounds, merge);
            // with no other wave in flight, the places of this one once it is finished
            if resolves.is_empty() && pending.len() > 0 && queued.is_empty() {
                if let Some(q) = unfinished.take() {
                    finish_ms = finish(g, ws, input, host, q, sink, f.first)?;
                }
                resolves = pending.take(host, (&[], &[]), bounds, merge);
            }
        }
        let sizes: Vec<usize> = resolves.iter().map(|r| r.wave.len()).collect();
        for r in resolves {
            let (again, downdated) = queue_again(g, tuning, ws, input, patches, host, (r, &done))?;
            sink.timings.downdated += downdated;
            fifo.push_back(again);
        }
        let round_queue_ms = t_queue.elapsed().as_secs_f64() * 1e3;
        queue_ms += round_queue_ms;
        if let Some(q) = unfinished.take() {
            finish_ms = finish(g, ws, input, host, q, sink, f.first)?;
        }
        let first_tested = f.first.then_some(f.tested.as_slice());
        settle_wave(
            sink.results,
            &host.waves[wi],
            first_tested,
            &changed,
            &ci,
            &mut done,
        );
        tracing::debug!(
            "outliers of wave {wi}: {} patches tested, {} with new outliers, {} pending; counts read in {round_test_ms:.2} ms, re-solve waves of {sizes:?} queued in {round_queue_ms:.2} ms; finished in {finish_ms:.2} ms",
            tested.len(),
            changed.len(),
            pending.len(),
        );
    }
    if pending.len() > 0 {
        return Err(Error::Gpu(format!(
            "{} patches with outliers found no place to be solved again",
            pending.len()
        )));
    }
    host.waves.truncate(planned);
    sink.timings.add("outlier counts", test_ms);
    sink.timings.add("rejection queue", queue_ms);
    Ok(())
}

/// The frame's waves as first queued, each tested after its solve.
fn first_solves<'a>(queued: Vec<Queued<'a>>, host: &FrameHost) -> VecDeque<InFlight<'a>> {
    let first = |queued: Queued<'a>| {
        let tested = host.waves[queued.wave()].live.clone().collect();
        InFlight {
            queued,
            first: true,
            tested,
        }
    };
    queued.into_iter().map(first).collect()
}

/// Once `wave` is finished, while the device runs the waves queued: after its first solve,
/// the masked fractions before rejection of its `first_tested` patches; then the results of
/// its patches solved for the last time (those without new outliers, `changed`).
fn settle_wave(
    results: &mut [Option<PatchResult>],
    wave: &Wave,
    first_tested: Option<&[usize]>,
    changed: &[(usize, usize, i32)],
    ci: &[usize],
    done: &mut [Done],
) {
    for &li in first_tested.unwrap_or_default() {
        done[li].before = pixmask_of(results, ci[li]);
    }
    let mut again: Vec<usize> = changed.iter().map(|c| c.0).collect();
    again.sort_unstable();
    for li in wave.patches() {
        if again.binary_search(&li).is_err() {
            settle(results, ci[li], &done[li]);
        }
    }
}

/// Waves still in flight at which the patches pending a re-solve are queued (besides when
/// they fill a wave): one, so that the device runs it while the host queues them. With none
/// left the device waits for the host at each pass, with two or more the re-solves of the
/// last waves are fewer and smaller: both took longer on the full-width frame
/// (docs/benchmarks.md, "Outlier rejection"). A frame without its spots on the device
/// re-solves each wave's patches at once, as a re-solve evaluates its bundles' spots again,
/// for no more bundles than a wave's.
fn gather_ahead(keep_spots: bool) -> usize {
    if keep_spots {
        1
    } else {
        usize::MAX
    }
}

/// Finishes a queued wave into `sink`; a wave solved again adds no progress (its patches were
/// counted by their first solve). Returns how long the host waited and worked, in ms.
fn finish(
    g: Gpu<'_>,
    ws: &mut Workspace,
    input: &FrameInput<'_>,
    host: &FrameHost,
    q: Queued<'_>,
    sink: &mut Sink<'_>,
    first: bool,
) -> Result<f64> {
    let t0 = Instant::now();
    if first {
        solve::finish_wave(g, ws, input, host, q, sink)?;
    } else {
        let silent = Progress::silent();
        let mut again = Sink {
            results: &mut *sink.results,
            values: None,
            last_mark: &mut *sink.last_mark,
            timings: &mut *sink.timings,
            progress: &silent,
        };
        solve::finish_wave(g, ws, input, host, q, &mut again)?;
    }
    Ok(t0.elapsed().as_secs_f64() * 1e3)
}

/// The patches of `tested` (live patches of wave `w`, queued as `q`) whose test on the device
/// found outliers, how many and the slot of their kept equations, in the order of the wave's
/// batch; and the patches of `tested` that the device solved (the CPU reference tests those it
/// solves itself, the failed and the coupled: the sweeps' verdicts tell them). Read on the
/// stream of the copies back once the device has passed the wave's test, before its
/// decorrelation.
fn read_counts(
    dev: &Device,
    ws: &mut Workspace,
    w: &Wave,
    q: &Queued<'_>,
    tested: &[usize],
) -> Result<Tested> {
    if tested.is_empty() {
        return Ok(Tested::default());
    }
    let n = w.len();
    dev.back_after(q.tested())?;
    let mut verdicts = vec![0; schur::VERDICTS_PER_PATCH * n];
    let mut coupling = vec![0.0; n];
    if q.on_schur_route() {
        let out = &ws.out;
        let from = schur::DeviceVerdicts {
            first: out.first_info.get(),
            last: out.info.get(),
            masked: out.masked.get(),
            coupling: out.coupling.get(),
        };
        from.copy(dev, w.live.start, &mut verdicts, &mut coupling)?;
    }
    let b = &mut ws.reject;
    let back = b.counts_back.current_mut(n);
    dev.copy_back(back, b.counts.get(), w.live.start, "outlier counts")?;
    b.kept.copy_back(dev, w.live.start, n)?;
    dev.sync_back()?;
    let batch = w.patches();
    let to_cpu: Vec<usize> = q
        .to_cpu(&verdicts, &coupling)
        .into_iter()
        .map(|i| batch[i])
        .collect();
    let mut sorted: Vec<usize> = tested
        .iter()
        .copied()
        .filter(|li| !to_cpu.contains(li))
        .collect();
    sorted.sort_unstable();
    let counts = b.counts_back.current(n);
    let changed = batch
        .into_iter()
        .zip(counts)
        .enumerate()
        .filter(|&(_, (li, &c))| c > 0 && sorted.binary_search(&li).is_ok())
        .map(|(i, (li, &c))| (li, c as usize, b.kept.read(i)))
        .collect();
    Ok(Tested {
        changed,
        on_device: sorted,
    })
}

/// What the test of a wave found ([`read_counts`]).
#[derive(Default)]
struct Tested {
    /// The patches with new outliers: live patch, outliers, slot of its kept equations (-1
    /// for none).
    changed: Vec<(usize, usize, i32)>,
    /// The live patches tested on the device.
    on_device: Vec<usize>,
}

/// Queues the re-solve wave `r`, appended to `host.waves`: its tables, gathered on the host,
/// the slots of its patches' kept equations (`done`) and, where it mixes tested and last
/// solves, the flags of the last ones, uploaded to its places, which no wave in flight holds.
/// Returns it in flight, and how many of its patches start from kept equations.
#[allow(clippy::too_many_arguments)]
fn queue_again<'a>(
    g: Gpu<'a>,
    tuning: &Tuning,
    ws: &mut Workspace,
    input: &FrameInput<'_>,
    patches: &[&'a Patch],
    host: &mut FrameHost,
    (r, done): (Resolve, &[Done]),
) -> Result<(InFlight<'a>, usize)> {
    let again = r.wave;
    let picked = &again.picked;
    let tested: Vec<usize> = picked
        .iter()
        .copied()
        .filter(|li| !r.last.contains(li))
        .collect();
    // the waves queued from now on are solved again; a test skips the last solves
    ws.reject.pass = if tested.is_empty() { MAX_RESOLVES } else { 1 };
    ws.reject.mixed = !tested.is_empty() && !r.last.is_empty();
    if ws.reject.mixed {
        let last: Vec<i32> = picked.iter().map(|li| r.last.contains(li) as i32).collect();
        let at = again.live.start;
        g.dev
            .upload_at(ws.reject.untested.get(), at, &last, "untested re-solves")?;
    }
    let kept: Vec<i32> = picked
        .iter()
        .map(|&li| done[li].kept.unwrap_or(-1))
        .collect();
    let tables = host.picked_tables(g.sh, &again);
    ws.input
        .upload_picked(g.dev, g.sh, again.live.start, &tables)?;
    ws.reject.kept.upload(g.dev, again.live.start, &kept)?;
    host.waves.push(again);
    let wi = host.waves.len() - 1;
    let queued = solve::queue_wave(g, tuning, ws, input, patches, host, wi)?;
    let again = InFlight {
        queued,
        first: false,
        tested,
    };
    Ok((again, kept.iter().filter(|&&s| s >= 0).count()))
}

/// Gives the device-solved patch `ci`, whose last solve is finished, its rejection counts and
/// the fraction of each core spot it lost (a patch the CPU reference solved has its own). Done
/// as each wave is finished, while the device runs the next: for all patches at the frame's
/// end it took 1.0-1.2 ms that the device did not hide (1700 patches, an H200's host).
fn settle(results: &mut [Option<PatchResult>], ci: usize, d: &Done) {
    if let Some(r) = results[ci].as_mut().filter(|r| r.rejected.is_empty()) {
        r.rejected = lost(&r.pixmask_fraction, &d.before);
        (r.nrejected, r.nresolves) = (d.nrejected, d.nresolves);
    }
}

fn pixmask_of(results: &[Option<PatchResult>], ci: usize) -> Vec<f64> {
    results[ci]
        .as_ref()
        .map_or_else(Vec::new, |r| r.pixmask_fraction.clone())
}

/// The fraction of each core spot that rejection took: the masked fraction now less the one
/// before (zero where a patch has no fraction before, one without pixels).
fn lost(now: &[f64], before: &[f64]) -> Vec<f64> {
    now.iter()
        .enumerate()
        .map(|(i, a)| before.get(i).map_or(0.0, |b| (a - b).max(0.0)))
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A frame keeps its spots for the re-solves only when it rejects outliers and they take
    /// at most half of the memory budget (a full-width frame of 801 bins: 0.65 GB of 4).
    #[test]
    fn spots_are_kept_where_half_the_budget_holds_them() {
        let gb = 1_000_000_000;
        assert!(keeps_spots(true, 654_000_000, 4 * gb));
        assert!(keeps_spots(true, 2 * gb, 4 * gb));
        assert!(!keeps_spots(true, 2 * gb + 1, 4 * gb));
        assert!(!keeps_spots(false, 654_000_000, 4 * gb));
    }

    /// The sizes the host gives `outlier_test` are those kernels/reject.cu assumes: a kernel
    /// given less shared memory than it lays out would write past its end.
    #[test]
    fn the_tests_sizes_are_the_kernels() {
        let source = include_str!(concat!(env!("CARGO_MANIFEST_DIR"), "/kernels/reject.cu"));
        let define = |name: &str| -> u32 {
            let line = format!("#define {name} ");
            let at = source
                .find(&line)
                .unwrap_or_else(|| panic!("{name} defined"))
                + line.len();
            let value = source[at..].split_whitespace().next().expect("a value");
            value.parse().unwrap_or_else(|_| panic!("{name} = {value}"))
        };
        assert_eq!(define("SPEX_TEST_THREADS"), TEST_THREADS);
        assert_eq!(define("SPEX_TAKEN_LIST"), TAKEN_LIST);
        assert_eq!(define("SPEX_CLAIM_PIXELS"), CLAIM_PIXELS);
        assert_eq!(define("SPEX_TEST_SHARED") as usize, TEST_SHARED);
    }

    /// The fraction lost is the growth of the masked fraction, none for a patch without one
    /// before.
    #[test]
    fn rejection_takes_the_growth_of_the_masked_fraction() {
        assert_eq!(
            lost(&[0.5, 0.25, 0.0], &[0.25, 0.25, 0.0]),
            [0.25, 0.0, 0.0]
        );
        assert_eq!(lost(&[1.0, 1.0], &[]), [0.0, 0.0]);
    }
}
