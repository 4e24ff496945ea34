//! The re-solve waves of outlier rejection: the patches whose test found new outliers,
//! gathered from the frame's finished waves into waves as large as the device's per-patch
//! buffers allow, so that their sweeps, decorrelation and assembly fill the device as the
//! first pass's waves do (a wave's own re-solves are a third of it or fewer).
//!
//! A re-solve wave is a [`Wave`] of picked live patches, in frame order: its tables and
//! results take free places among the frame's (those of finished waves), its bundle slots
//! and model boxes span those of its patches, which find their spots (kept on the device for
//! the frame), model boxes and rejected pixels where their first solve left them. Patches
//! whose next solve is the last of [`MAX_RESOLVES`] are not tested after it.
//!
//! Each wave pays its kernels' latency whatever its size: the sweeps and the decorrelation run
//! a patch's blocks in rounds over the device, and a wave of a few dozen patches takes a round
//! of each. So where the frame's spots stay on the device ([`Merge::Held`]), a wave mixes
//! patches whose solve is tested with those whose solve is the last (the test skips these),
//! and a run of fewer than half a wave's patches waits for the patches that the waves still
//! queued add. Without the spots kept, a wave's re-solves are queued at once and apart
//! ([`Merge::Apart`]): they evaluate their bundles' spots again, no more bundles than a
//! wave's.

use std::ops::Range;

use super::super::tables::{FrameHost, Wave};
use crate::outliers::MAX_RESOLVES;

/// What bounds a re-solve wave: its patches (the per-patch buffers are sized for the frame's
/// largest wave) and the span of its model boxes (the wave's model buffer, which the memory
/// budget sizes at `patches` boxes of `box_pixels`).
#[derive(Clone, Copy, Debug)]
pub(super) struct Bounds {
    pub(super) patches: usize,
    pub(super) span: usize,
}

/// The patches with new outliers not queued again yet, each with whether its next solve is
/// its last (not tested after it).
#[derive(Debug, Default)]
pub(super) struct Pending {
    patches: Vec<(usize, bool)>,
}

/// How re-solves go into waves (see the module's text).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Merge {
    /// Tested and last solves in waves of their own, every run queued.
    Apart,
    /// Tested and last solves mixed; runs of fewer than half a wave's patches wait, unless
    /// `all` (no wave queued will add to them).
    Held { all: bool },
}

impl Merge {
    /// Whether a run of `len` patches waits for more: under half a wave, while waves queued
    /// may add to it.
    fn holds(self, len: usize, bounds: Bounds) -> bool {
        self == Merge::Held { all: false } && 2 * len < bounds.patches
    }
}

/// A re-solve wave to queue: the patches of its `wave` whose solve is their last.
pub(super) struct Resolve {
    pub(super) last: Vec<usize>,
    pub(super) wave: Wave,
}

impl Pending {
    /// Adds live patch `li`, which has had `nresolves` re-solves queued, counting its next.
    pub(super) fn add(&mut self, li: usize, nresolves: usize) {
        self.patches.push((li, nresolves >= MAX_RESOLVES));
    }

    pub(super) fn len(&self) -> usize {
        self.patches.len()
    }

    /// Takes the pending patches into re-solve waves within `bounds`, placed among the
    /// frame's places where no wave of `busy.0` (queued, not finished) is, their model boxes
    /// clear of the boxes of the waves of `busy.1` (whose models are copied back after this
    /// wave overwrites them). Patches that find no such place, or whose run `merge` holds
    /// back, stay pending: a frame with no wave in flight places them all.
    pub(super) fn take(
        &mut self,
        host: &FrameHost,
        busy: (&[&Wave], &[&Wave]),
        bounds: Bounds,
        merge: Merge,
    ) -> Vec<Resolve> {
        let mut places: Vec<Range<usize>> = busy.0.iter().map(|w| w.live.clone()).collect();
        let boxes: Vec<Range<usize>> = busy.1.iter().map(|w| box_span(host, w)).collect();
        let all = std::mem::take(&mut self.patches);
        let pools: Vec<Vec<(usize, bool)>> = match merge {
            Merge::Apart => [false, true]
                .iter()
                .map(|&last| all.iter().copied().filter(|p| p.1 == last).collect())
                .collect(),
            Merge::Held { .. } => vec![all],
        };
        let mut out = Vec::new();
        for mut pool in pools {
            pool.sort_unstable();
            let sorted: Vec<usize> = pool.iter().map(|p| p.0).collect();
            for chunk in chunks(&sorted, bounds, |li| box_end(host, li) - host.box_at[li]) {
                let picked = sorted[chunk.clone()].to_vec();
                let span = host.box_at[picked[0]]..box_end(host, picked[picked.len() - 1]);
                let held = merge.holds(picked.len(), bounds);
                let place = free_place(&places, picked.len(), host.live.len());
                match place.filter(|_| !held && boxes.iter().all(|b| !overlap(b, &span))) {
                    Some(p) => {
                        places.push(p..p + picked.len());
                        out.push(Resolve {
                            last: pool[chunk].iter().filter(|p| p.1).map(|p| p.0).collect(),
                            wave: wave_of(host, picked, p),
                        });
                    }
                    None => self.patches.extend_from_slice(&pool[chunk]),
                }
            }
        }
        out
    }
}

/// The model boxes of live patch `li` end here in the frame's.
fn box_end(host: &FrameHost, li: usize) -> usize {
    let g = &host.live[li].1;
    host.box_at[li] + g.rows.len() * g.cols.len()
}

/// The model boxes wave `w` writes, within the frame's.
fn box_span(host: &FrameHost, w: &Wave) -> Range<usize> {
    w.boxes.start + host.first_box(w)..w.boxes.end
}

fn overlap(a: &Range<usize>, b: &Range<usize>) -> bool {
    a.start < b.end && b.start < a.end
}

/// Splits the sorted live patches `sorted` into consecutive runs within `bounds`, each
/// patch's model box taking `npixels` (a patch larger than the span bound makes a run alone).
fn chunks(sorted: &[usize], bounds: Bounds, npixels: impl Fn(usize) -> usize) -> Vec<Range<usize>> {
    let mut runs = Vec::new();
    let mut start = 0;
    let mut span = 0;
    for (i, &li) in sorted.iter().enumerate() {
        let px = npixels(li);
        let full = i - start >= bounds.patches.max(1) || span + px > bounds.span;
        if i > start && full {
            runs.push(start..i);
            (start, span) = (i, 0);
        }
        span += px;
    }
    if start < sorted.len() {
        runs.push(start..sorted.len());
    }
    runs
}

/// The first place `p` of the frame's `total` such that `p..p + n` meets none of `taken`.
fn free_place(taken: &[Range<usize>], n: usize, total: usize) -> Option<usize> {
    let starts = std::iter::once(0).chain(taken.iter().map(|r| r.end));
    starts
        .filter(|&p| p + n <= total)
        .filter(|&p| taken.iter().all(|r| !overlap(r, &(p..p + n))))
        .min()
}

/// The wave that solves again the live patches `picked` (sorted) at places `p..`: its bundle
/// slots and model boxes from its first patch's to its last's.
fn wave_of(host: &FrameHost, picked: Vec<usize>, p: usize) -> Wave {
    let (first, last) = (picked[0], picked[picked.len() - 1]);
    Wave {
        live: p..p + picked.len(),
        slots: host.live[first].2..host.live[last].2 + 1,
        boxes: host.box_at[first]..box_end(host, last),
        traced: Vec::new(),
        strips: Vec::new(),
        picked,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Runs stay within both bounds, in order, and cover every patch once; a patch whose box
    /// alone passes the span bound is a run of its own.
    #[test]
    fn runs_keep_within_the_patch_and_span_bounds() {
        let sorted: Vec<usize> = (0..10).collect();
        let bounds = Bounds {
            patches: 4,
            span: 25,
        };
        assert_eq!(
            chunks(&sorted, bounds, |_| 10),
            [0..2, 2..4, 4..6, 6..8, 8..10]
        );
        let wide = Bounds {
            span: 1000,
            ..bounds
        };
        assert_eq!(chunks(&sorted, wide, |_| 10), [0..4, 4..8, 8..10]);
        assert_eq!(
            chunks(&sorted, bounds, |li| if li == 3 { 40 } else { 5 }),
            [0..3, 3..4, 4..8, 8..10]
        );
        assert!(chunks(&[], bounds, |_| 10).is_empty());
    }

    /// A re-solve wave takes the first places that no wave in flight holds, within the
    /// frame's.
    #[test]
    fn a_resolve_takes_the_first_free_places() {
        assert_eq!(free_place(&[], 5, 10), Some(0));
        let one: Vec<Range<usize>> = std::iter::once(0..3).collect();
        assert_eq!(free_place(&one, 5, 10), Some(3));
        assert_eq!(free_place(&[2..4, 9..10], 5, 10), Some(4));
        assert_eq!(free_place(&[2..4, 8..10], 5, 10), None);
        let one: Vec<Range<usize>> = std::iter::once(4..6).collect();
        assert_eq!(free_place(&one, 4, 10), Some(0));
        assert_eq!(free_place(&[], 11, 10), None);
    }

    /// Runs under half a wave wait while waves are queued, and never once none is, nor where
    /// waves stay apart.
    #[test]
    fn small_runs_wait_for_the_waves_queued() {
        let bounds = Bounds {
            patches: 800,
            span: 1 << 30,
        };
        let queued = Merge::Held { all: false };
        assert!(queued.holds(399, bounds));
        assert!(!queued.holds(400, bounds));
        assert!(!Merge::Held { all: true }.holds(13, bounds));
        assert!(!Merge::Apart.holds(13, bounds));
    }

    /// Whether a pending patch's next solve is its last.
    #[test]
    fn pending_patches_know_their_last_solve() {
        let mut p = Pending::default();
        p.add(3, 1);
        p.add(1, MAX_RESOLVES - 1);
        p.add(2, MAX_RESOLVES);
        assert_eq!(
            (p.patches.clone(), p.len()),
            (vec![(3, false), (1, false), (2, true)], 3)
        );
    }
}
