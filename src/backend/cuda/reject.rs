//! Outlier rejection on the device (`--reject-outliers`, see [`crate::outliers`]): the same
//! test and the same passes as the CPU's (`backend::cpu::reject`), over a frame's waves.
//!
//! Each wave keeps, beside its results, the model `A xflux` of each patch over its box (the
//! finalize step projects it for chi2pix) and, in the first pass, a flag per box pixel that
//! the test looks at (`core_pixels` in kernels/reject.cu). Right after, in the wave's own
//! queue, the device tests its patches (`outlier_test`: the CPU's
//! [`crate::outliers::find_outliers`], pixel for pixel) and gives the outliers weight zero in
//! a flag per box pixel (`rejected`), which the assembly and chi2pix read: in that patch only,
//! since boxes overlap and the image is shared. The host reads back only how many outliers
//! each patch had, once the wave is finished (while the device runs the waves queued after
//! it), and solves the wave again behind the others by a wave of its patches with new
//! outliers alone: their tables, gathered on the host, and their results take the first
//! places of the finished wave's (`Wave::picked`), while its spots and model boxes stay where
//! they were, so that the kernels find each patch's box and rejected pixels where the first
//! pass left them. Its re-solve is tested in turn, and so on until a test finds no outlier or
//! [`MAX_RESOLVES`] solves have been added, as on the CPU. The wave is decorrelated after its
//! test, only for its patches without outliers (only a patch's last solution is kept). Only patches with new outliers are
//! tested after a re-solve; a patch the CPU reference solved (a failed or coupled one) was
//! tested there already.

use std::collections::VecDeque;
use std::sync::Arc;
use std::time::Instant;

use cudarc::driver::CudaContext;

use super::device::Device;
use super::kernels;
use super::launchers::Gpu;
use super::solve::{self, Queued, Sink};
use super::staging::Staging;
use super::tables::{FrameHost, Wave};
use super::tuning::Tuning;
use super::workspace::{Region, Slot, Workspace};
use crate::backend::{FrameInput, Progress};
use crate::error::Result;
use crate::extract::PatchResult;
use crate::outliers::{GROW_NSIGMA, MAX_RESOLVES};
use crate::plan::Patch;

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
}

impl Boxes {
    pub(crate) fn new(ctx: Arc<CudaContext>) -> Self {
        Boxes {
            on: false,
            keep_spots: false,
            pass: 0,
            limits: (0.0, 0.0),
            wave_at: 0,
            live_at: 0,
            fit: Slot::new("model boxes of the outlier test"),
            core: Slot::new("tested pixels"),
            rejected: Slot::new("rejected pixels"),
            counts: Slot::new("outlier counts"),
            counts_back: pinned_later(&ctx),
        }
    }

    /// Starts a frame: rejection at `nsigma` (None: off) with the noise's PSF error
    /// `psferr`, first pass; its spots kept for the re-solves where `keep_spots` (see
    /// [`keeps_spots`]).
    pub(crate) fn start(&mut self, nsigma: Option<f64>, psferr: f64, keep_spots: bool) {
        self.on = nsigma.is_some();
        self.limits = (nsigma.unwrap_or(0.0), psferr);
        self.keep_spots = self.on && keep_spots;
        self.pass = 0;
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
        for s in [b.core.get(), b.rejected.get()] {
            dev.fill_range(s, boxes.clone(), 0)?;
        }
    }
    Ok(())
}

/// After chi2pix: keeps the wave's model values (`A xflux`, in `ws.model`) for the test, those
/// from `skip` to `len` (a wave solved again may start after its boxes' first patch; the boxes
/// of the patches between its own get zeros, which no test reads), in the first pass flags
/// the pixels the test looks at, and tests the wave's `n` patches but after the last pass.
/// Returns the device address of the test's counts, nonzero for the patches solved again,
/// whose decorrelation waits for their last solve (0: no test ran, every patch is kept).
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
    if b.pass == 0 {
        flag_tested_pixels(g, ws, n)?;
    }
    if b.pass == MAX_RESOLVES {
        return Ok(0);
    }
    test(g, ws, n, region)?;
    Ok(b.counts.get().at(b.live_at))
}

/// Threads of a block of `outlier_test` (`SPEX_TEST_THREADS` in kernels/reject.cu).
const TEST_THREADS: u32 = 256;

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
        0,
        kernels::Args::new()
            .ptr(b.fit.get().at(b.wave_at))
            .ptr(b.core.get().at(b.wave_at))
            .ptr(b.rejected.get().at(b.wave_at))
            .ptr(ws.view.boxes)
            .ptr(ws.view.boxoff)
            .ptr(ws.view.pix)
            .ptr(ws.view.ivar)
            .i32(region.row0 as i32)
            .i32(region.col0 as i32)
            .i32(region.width as i32)
            .f64(nsigma)
            .f64(psferr)
            .f64(GROW_NSIGMA)
            .ptr(b.counts.get().at(b.live_at)),
    )
}

/// Flags the pixels of the wave's `n` boxes that the test looks at.
fn flag_tested_pixels(g: Gpu<'_>, ws: &Workspace, n: usize) -> Result<()> {
    let b = &ws.reject;
    let sh = g.sh;
    kernels::launch(
        g.dev,
        &g.k.core_pixels,
        "core_pixels",
        (sh.m() as u32, n as u32, 1),
        64,
        0,
        kernels::Args::new()
            .ptr(ws.spots_ptr())
            .ptr(ws.view.corners)
            .ptr(ws.colspot.get().ptr)
            .ptr(ws.view.boxes)
            .ptr(ws.view.boxoff)
            .i32(sh.m() as i32)
            .i32(sh.nx as i32)
            .i32(sh.ny as i32)
            .i32(sh.nt as i32)
            .i32(sh.ncore as i32)
            .i32(sh.wavepad as i32)
            .ptr(b.core.get().at(b.wave_at)),
    )
}

/// What rejection did to one live patch, as `backend::cpu::reject` reports it.
#[derive(Clone, Debug, Default)]
struct Done {
    nrejected: usize,
    nresolves: usize,
    /// The masked fraction of each core spot after the first solve.
    before: Vec<f64>,
}

/// A wave queued on the device and what its results go through once finished.
struct InFlight<'a> {
    queued: Queued<'a>,
    /// Re-solves its patches had before it (0: the frame's first solve).
    pass: usize,
    /// The live patches with new outliers it solves again (all of the wave in the first pass).
    tested: Vec<usize>,
}

/// Finishes the frame's `queued` waves (the first solve of each) and solves again, as soon as
/// a wave is finished, its patches with new outliers: the device has tested them in the
/// wave's queue, the host reads how many outliers each had while the device runs the waves
/// queued after it, and queues their re-solve behind them, so that the device never waits
/// for the test of the whole frame. A patch is tested after each of its solves but the last
/// of [`MAX_RESOLVES`] re-solves, as on the CPU; then each device-solved patch gets its
/// rejection counts and the fraction of each core spot it lost.
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
    let largest = host.waves.iter().map(Wave::len).max().unwrap_or(0);
    ws.reject.counts_back.get(largest);
    let mut done = vec![Done::default(); ci.len()];
    let mut fifo: VecDeque<InFlight<'a>> = queued
        .into_iter()
        .map(|q| {
            let tested = host.waves[q.wave()].live.clone().collect();
            InFlight {
                queued: q,
                pass: 0,
                tested,
            }
        })
        .collect();
    let (mut test_ms, mut queue_ms) = (0.0, 0.0);
    while let Some(f) = fifo.pop_front() {
        let wi = f.queued.wave();
        let t_finish = Instant::now();
        finish(g, ws, input, host, f.queued, sink, f.pass == 0)?;
        let finish_ms = t_finish.elapsed().as_secs_f64() * 1e3;
        if f.pass == 0 {
            for li in f.tested.iter().copied() {
                done[li].before = pixmask_of(sink.results, ci[li]);
            }
        }
        if f.pass == MAX_RESOLVES {
            continue;
        }
        let t_test = Instant::now();
        let tested = on_device(&ci, sink.results, f.tested);
        let changed = read_counts(g.dev, ws, &host.waves[wi], &tested)?;
        for (li, n) in &changed {
            done[*li].nrejected += n;
            done[*li].nresolves += 1;
        }
        let round_test_ms = t_test.elapsed().as_secs_f64() * 1e3;
        test_ms += round_test_ms;
        let changed: Vec<usize> = changed.into_iter().map(|(li, _)| li).collect();
        let t_queue = Instant::now();
        let nchanged = changed.len();
        // the waves queued from now on are solved again
        ws.reject.pass = f.pass + 1;
        if let Some(again) = queue_again(g, tuning, ws, input, patches, host, wi, &changed)? {
            fifo.push_back(InFlight {
                queued: again,
                pass: f.pass + 1,
                tested: changed,
            });
        }
        let round_queue_ms = t_queue.elapsed().as_secs_f64() * 1e3;
        queue_ms += round_queue_ms;
        tracing::debug!(
            "outliers of wave {wi}, pass {}: {} patches tested, {nchanged} with new outliers; finished in {finish_ms:.2} ms, counts read in {round_test_ms:.2} ms, next pass queued in {round_queue_ms:.2} ms",
            f.pass,
            tested.len(),
        );
    }
    host.waves.truncate(planned);
    for (li, d) in done.iter().enumerate() {
        let r = sink.results[ci[li]].as_mut();
        if let Some(r) = r.filter(|r| r.rejected.is_empty()) {
            r.rejected = lost(&r.pixmask_fraction, &d.before);
            (r.nrejected, r.nresolves) = (d.nrejected, d.nresolves);
        }
    }
    sink.timings.add("outlier counts", test_ms);
    sink.timings.add("rejection queue", queue_ms);
    Ok(())
}

/// Finishes a queued wave into `sink`; a wave solved again adds no progress (its patches were
/// counted by their first solve).
fn finish(
    g: Gpu<'_>,
    ws: &mut Workspace,
    input: &FrameInput<'_>,
    host: &FrameHost,
    q: Queued<'_>,
    sink: &mut Sink<'_>,
    first: bool,
) -> Result<()> {
    if first {
        return solve::finish_wave(g, ws, input, host, q, sink);
    }
    let silent = Progress::silent();
    let mut again = Sink {
        results: &mut *sink.results,
        last_mark: &mut *sink.last_mark,
        timings: &mut *sink.timings,
        progress: &silent,
    };
    solve::finish_wave(g, ws, input, host, q, &mut again)
}

/// The patches of `tested` (live patches of the finished wave `w`) whose test on the device
/// found outliers, and how many, in the order of the wave's batch: the wave's counts copied
/// back on the stream of the copies back, which the wave's finish has taken past its test.
fn read_counts(
    dev: &Device,
    ws: &mut Workspace,
    w: &Wave,
    tested: &[usize],
) -> Result<Vec<(usize, usize)>> {
    if tested.is_empty() {
        return Ok(Vec::new());
    }
    let b = &mut ws.reject;
    let n = w.len();
    let back = b.counts_back.current_mut(n);
    dev.copy_back(back, b.counts.get(), w.live.start, "outlier counts")?;
    dev.sync_back()?;
    let mut sorted = tested.to_vec();
    sorted.sort_unstable();
    let counts = b.counts_back.current(n);
    Ok(w.patches()
        .into_iter()
        .zip(counts)
        .filter(|&(li, &c)| c > 0 && sorted.binary_search(&li).is_ok())
        .map(|(li, &c)| (li, c as usize))
        .collect())
}

/// Queues again the live patches `changed` (sorted) of wave `wi` of `host`, a wave of their
/// own appended to `host.waves` whose tables take the first places of `wi`'s (None if there
/// are none).
#[allow(clippy::too_many_arguments)]
fn queue_again<'a>(
    g: Gpu<'a>,
    tuning: &Tuning,
    ws: &mut Workspace,
    input: &FrameInput<'_>,
    patches: &[&'a Patch],
    host: &mut FrameHost,
    wi: usize,
    changed: &[usize],
) -> Result<Option<Queued<'a>>> {
    let npixels = |li: usize| {
        let g = &host.live[li].1;
        g.rows.len() * g.cols.len()
    };
    let Some(again) = pick(&host.waves[wi], changed, npixels, &host.boxoff) else {
        return Ok(None);
    };
    // wave wi is finished: the device has read its tables, which these replace
    let tables = host.picked_tables(g.sh, &again.picked);
    ws.input
        .upload_picked(g.dev, g.sh, again.live.start, &tables)?;
    host.waves.push(again);
    let again = host.waves.len() - 1;
    solve::queue_wave(g, tuning, ws, input, patches, host, again).map(Some)
}

/// The wave that solves again the patches of `changed` (sorted) that wave `w` solved, None if
/// it holds none: their tables and results at the first places of `w`'s, its bundle slots and
/// the start of its model boxes `w`'s (the kernels count spots and box offsets `boxoff` from
/// there), its boxes ending with its last patch's, of `npixels` pixels.
fn pick(
    w: &Wave,
    changed: &[usize],
    npixels: impl Fn(usize) -> usize,
    boxoff: &[i64],
) -> Option<Wave> {
    let solved = w.patches();
    let picked: Vec<usize> = changed
        .iter()
        .copied()
        .filter(|li| solved.binary_search(li).is_ok())
        .collect();
    let &last = picked.last()?;
    let end = w.boxes.start + boxoff[last] as usize + npixels(last);
    Some(Wave {
        live: w.live.start..w.live.start + picked.len(),
        slots: w.slots.clone(),
        boxes: w.boxes.start..end,
        traced: Vec::new(),
        strips: Vec::new(),
        picked,
    })
}

/// The live patches of `candidates` that the device solved: the CPU reference tested those
/// it solved itself (their `rejected` is set).
fn on_device(ci: &[usize], results: &[Option<PatchResult>], candidates: Vec<usize>) -> Vec<usize> {
    candidates
        .into_iter()
        .filter(|&li| {
            results[ci[li]]
                .as_ref()
                .is_some_and(|r| r.rejected.is_empty())
        })
        .collect()
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

    /// A wave is solved again over its changed patches alone, in the first places of the wave
    /// before, its tables still from that wave's first bundle and model box; a wave without
    /// changed patches is not.
    #[test]
    fn a_wave_is_solved_again_over_its_changed_patches_alone() {
        // patches of 10 pixels; the wave holds patches 4-7, its boxes from 100 on
        let w = Wave {
            live: 4..8,
            slots: 1..3,
            boxes: 100..140,
            ..Wave::default()
        };
        let boxoff = [0, 10, 20, 30, 0, 10, 20, 30];
        let cut = pick(&w, &[1, 5, 7, 9], |_| 10, &boxoff).expect("holds 5 and 7");
        assert_eq!(cut.patches(), [5, 7]);
        assert_eq!((cut.live.clone(), cut.slots.clone()), (4..6, 1..3));
        assert_eq!((cut.boxes.clone(), cut.first_patch()), (100..140, 5));
        // solved again from that wave: only its patches count
        let again = pick(&cut, &[6, 7], |_| 10, &boxoff).expect("holds 7");
        assert_eq!(
            (again.patches(), again.live, again.boxes),
            (vec![7], 4..5, 100..140)
        );
        let cut = pick(&w, &[5], |_| 10, &boxoff).expect("holds 5");
        assert_eq!((cut.live, cut.boxes), (4..5, 100..120));
        assert!(pick(&w, &[0, 3, 8], |_| 10, &boxoff).is_none());
        assert!(pick(&w, &[], |_| 10, &boxoff).is_none());
    }

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
