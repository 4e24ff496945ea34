//! Outlier pixels rejected by re-extraction (`--reject-outliers [NSIGMA]`): which pixels of a
//! solved patch are outliers, how many times a patch is solved again, and the MASK bit of
//! the bins that lost pixels.
//!
//! Cosmic rays that the preproc MASK misses put their charge into the flux of the bins they
//! cross. After a patch is solved, a pixel whose residual `p - m` (data minus the patch's
//! model `m = A xflux`) exceeds `NSIGMA` times the noise the model predicts is given weight
//! zero and the patch is solved again, at most [`MAX_RESOLVES`] times. The noise is the
//! model's, not the data's (a cosmic's own charge would otherwise hide it):
//! `var = rn2 + max(m, 0) + (psferr m)^2`, the read noise, the model's Poisson term and the
//! PSF error that chi2pix also allows for. The read-noise variance `rn2` is the patch's median
//! of `1/ivar - max(m, 0)`: a preproc's ivar is `1 / (rn2 + signal)`, and the median is not
//! moved by the few outliers.
//!
//! A pass rejects the positive outliers; only a pass that finds none rejects negative ones,
//! so that the dip a cosmic's pull leaves around it in the first fit is not taken for
//! outliers. A positive outlier also takes the pixels connected to it (the 8 neighbours,
//! and theirs in turn) whose pull exceeds [`GROW_NSIGMA`], the two thresholds of cosmic-ray
//! finders: a track that lies along a fiber's trace is partly absorbed by that fiber's flux,
//! so that only its brightest pixels stand out of the first fit, and rejecting them alone
//! left the rest of the track in the flux after the last pass. On a frame without cosmics a
//! pixel is beyond 2 sigma with probability 0.023, so a chance outlier takes 0.2 neighbours on
//! average.
//!
//! Three more rules of a positive pass end most of the passes that would follow it. Each later
//! pass used to find mostly clean pixels pushed past `NSIGMA` by track pixels the fit still
//! held: those outside the tested footprint, never tested, and those at a trace's centre that
//! the first fit absorbed. So a pass also takes
//! - untested pixels (weighted, outside the core footprint) connected to an outlier beyond
//!   [`GROW_NSIGMA`], within [`UNTESTED_REACH`] rows and columns of a seed;
//! - as seeds, sharp untested pixels: beyond [`SHARP_NSIGMA`], with the median pull of their 8
//!   neighbours below [`SHARP_FRACTION`] of their own (a track, not a spot's light from an
//!   unsolved bin), at least [`SHARP_EDGE`] pixels inside the box;
//! - the tested pixels next to an outlier whose pull exceeds the median pull of their own
//!   tested, untaken neighbours by [`CONTRAST_NSIGMA`] (a track's pixel that the fit absorbed
//!   stands out of its neighbours, not of the model).

use ndarray::Array2;

use crate::extract::PatchResult;
use crate::frame::Frame;
use crate::plan::Plan;

/// How many times a patch is solved again at most, after its first solve. With the first
/// pass's rules below a third re-solve was worth little on the simulated frames of
/// docs/benchmarks.md (bins beyond 5 sigma 0, 0, 0 and 7 with it, 0, 0, 0 and 8 without; the
/// pulls' std within 4e-4), while on the GPU each pass is a wave that the frame's end waits
/// for.
pub const MAX_RESOLVES: usize = 2;

/// Pull above which a pixel connected to a positive outlier is rejected with it.
pub const GROW_NSIGMA: f64 = 2.0;

/// Rows and columns from a seed within which untested pixels join its growth.
pub const UNTESTED_REACH: usize = 8;

/// Pull above which an untested pixel may be a seed, when it is sharp.
pub const SHARP_NSIGMA: f64 = 15.0;

/// A sharp pixel's neighbours' median pull is below this fraction of its own.
pub const SHARP_FRACTION: f64 = 0.2;

/// Pixels between a sharp seed and the box's edge at least, so that its 8 neighbours are in
/// the box and their light comes from bins the patch solves.
pub const SHARP_EDGE: usize = 3;

/// Pull above the median of its neighbours' at which a tested pixel next to an outlier goes
/// with it.
pub const CONTRAST_NSIGMA: f64 = 8.0;

/// Default `NSIGMA` of `--reject-outliers` given without a value.
pub const DEFAULT_NSIGMA: f64 = 5.0;

/// MASK bit of a bin whose spot lost pixels to outlier rejection: desispec's specmask
/// `COSMIC` (bit 2, "input pixels included a masked cosmic"), which its extraction never
/// sets. A bin that lost more than half of its spot also gets SOMEBADPIX, as for masked pixels.
pub const REJECTED: u32 = 1 << 2;

/// The outliers of one pass over a solved patch, as indices of its pixels; the caller gives
/// them weight zero. `pix`, `ivar` and `model` are the patch's pixels, row by row of a box
/// `width` pixels wide; only the pixels that `core` marks are tested: those of the core
/// fibers' spots away from the box's edges, which also see light of bins and fibers that the
/// patch does not solve.
///
/// The GPU backend runs the same test on the device (`outlier_test` in kernels/reject.cu),
/// operation for operation, so that both reject the same pixels: a change here goes there too.
pub fn find_outliers(
    pix: &[f64],
    ivar: &[f64],
    model: &[f64],
    core: &[bool],
    width: usize,
    limits: (f64, f64),
) -> Vec<usize> {
    let (nsigma, psferr) = limits;
    let Some(rn2) = read_noise_variance(ivar, model) else {
        return Vec::new();
    };
    let b = Pulls::new(pix, ivar, model, core, width, (rn2, psferr));
    let seeds: Vec<usize> = (0..b.len())
        .filter(|&p| (b.tested(p) && b.pull[p] > nsigma) || b.sharp(p))
        .collect();
    if seeds.is_empty() {
        return (0..b.len())
            .filter(|&p| b.tested(p) && b.pull[p] < -nsigma)
            .collect();
    }
    let near = b.near(&seeds, UNTESTED_REACH);
    let mut out = grow(seeds, &b, |p| {
        b.weighted(p) && (core[p] || near[p]) && b.pull[p] > GROW_NSIGMA
    });
    let contrast = b.contrast(&out);
    out.extend(contrast);
    out
}

/// The pulls of a patch's box and what the rules ask of its pixels.
struct Pulls<'a> {
    pull: Vec<f64>,
    ivar: &'a [f64],
    core: &'a [bool],
    width: usize,
    height: usize,
}

impl<'a> Pulls<'a> {
    fn new(
        pix: &[f64],
        ivar: &'a [f64],
        model: &[f64],
        core: &'a [bool],
        width: usize,
        (rn2, psferr): (f64, f64),
    ) -> Self {
        let pull = pix
            .iter()
            .zip(model)
            .map(|(&d, &m)| {
                let var = rn2 + m.max(0.0) + (psferr * m) * (psferr * m);
                (d - m) / var.sqrt()
            })
            .collect();
        let height = pix.len() / width;
        Pulls {
            pull,
            ivar,
            core,
            width,
            height,
        }
    }

    fn len(&self) -> usize {
        self.pull.len()
    }

    fn weighted(&self, p: usize) -> bool {
        self.ivar[p] > 0.0
    }

    fn tested(&self, p: usize) -> bool {
        self.core[p] && self.weighted(p)
    }

    /// The 8 neighbours of `p` within the box.
    fn around(&self, p: usize) -> impl Iterator<Item = usize> + '_ {
        let (r, c) = (p / self.width, p % self.width);
        let rows = r.saturating_sub(1)..=(r + 1).min(self.height - 1);
        let cols = c.saturating_sub(1)..=(c + 1).min(self.width - 1);
        rows.flat_map(move |r| cols.clone().map(move |c| r * self.width + c))
            .filter(move |&q| q != p)
    }

    /// An untested pixel that is a seed: far beyond the tested threshold, far above its
    /// neighbours, and away from the box's edges.
    fn sharp(&self, p: usize) -> bool {
        let (r, c) = (p / self.width, p % self.width);
        let inside = |i: usize, n: usize| i >= SHARP_EDGE && i + SHARP_EDGE < n;
        if self.core[p] || !self.weighted(p) || self.pull[p] <= SHARP_NSIGMA {
            return false;
        }
        if !inside(r, self.height) || !inside(c, self.width) {
            return false;
        }
        let others = self.around(p).filter(|&q| self.weighted(q));
        median(others.map(|q| self.pull[q]).collect())
            .is_some_and(|m| m < SHARP_FRACTION * self.pull[p])
    }

    /// Whether each pixel lies within `reach` rows and columns of one of `seeds`.
    fn near(&self, seeds: &[usize], reach: usize) -> Vec<bool> {
        let mut near = vec![false; self.len()];
        for &s in seeds {
            let (r, c) = (s / self.width, s % self.width);
            let rows = r.saturating_sub(reach)..=(r + reach).min(self.height - 1);
            for rr in rows {
                let cols = c.saturating_sub(reach)..=(c + reach).min(self.width - 1);
                near[rr * self.width + cols.start()..=rr * self.width + cols.end()].fill(true);
            }
        }
        near
    }

    /// The tested pixels next to `taken` ones that stand out of their tested, untaken
    /// neighbours by [`CONTRAST_NSIGMA`]; each is judged against `taken` alone, so that the
    /// order does not matter.
    fn contrast(&self, taken: &[usize]) -> Vec<usize> {
        let mut is_taken = vec![false; self.len()];
        for &p in taken {
            is_taken[p] = true;
        }
        let free = |q: usize| self.tested(q) && !is_taken[q];
        (0..self.len())
            .filter(|&p| free(p) && self.around(p).any(|q| is_taken[q]))
            .filter(|&p| {
                let others = self.around(p).filter(|&q| free(q));
                median(others.map(|q| self.pull[q]).collect())
                    .is_some_and(|m| self.pull[p] - m > CONTRAST_NSIGMA)
            })
            .collect()
    }
}

/// [`crate::frame::median`] of a few values (the mean of the middle two for an even count,
/// as the device's test takes it), `None` for none.
fn median(v: Vec<f64>) -> Option<f64> {
    (!v.is_empty()).then(|| crate::frame::median(v))
}

/// `seeds` with every pixel connected to them through 8-neighbours that `takes`: a flood
/// fill over the box.
fn grow(seeds: Vec<usize>, b: &Pulls<'_>, takes: impl Fn(usize) -> bool) -> Vec<usize> {
    let mut taken: std::collections::HashSet<usize> = seeds.iter().copied().collect();
    let mut out = seeds.clone();
    let mut stack = seeds;
    while let Some(p) = stack.pop() {
        for q in b.around(p) {
            if !taken.contains(&q) && takes(q) {
                taken.insert(q);
                out.push(q);
                stack.push(q);
            }
        }
    }
    out
}

/// The median of `1/ivar - max(m, 0)` over the pixels with weight, at least 0; `None` when
/// no pixel has weight.
fn read_noise_variance(ivar: &[f64], model: &[f64]) -> Option<f64> {
    let mut v: Vec<f64> = ivar
        .iter()
        .zip(model)
        .filter(|(&iv, _)| iv > 0.0)
        .map(|(&iv, &m)| 1.0 / iv - m.max(0.0))
        .collect();
    if v.is_empty() {
        return None;
    }
    let mid = v.len() / 2;
    let (_, median, _) = v.select_nth_unstable_by(mid, f64::total_cmp);
    Some(median.max(0.0))
}

/// Sets [`REJECTED`] on the frame's bins whose spot lost pixels to rejection (the patch
/// results' `rejected` fractions), for the fibers the frame holds. Returns the number of
/// bins flagged.
pub fn flag_rejected_bins(frame: &mut Frame, plan: &Plan, results: &[PatchResult]) -> usize {
    let mut flagged = Array2::<bool>::from_elem(frame.mask.dim(), false);
    for r in results.iter().filter(|r| !r.rejected.is_empty()) {
        let patch = &plan.patches[r.patch];
        for (c, fiber) in patch.fibers.clone().enumerate() {
            let Some(row) = fiber
                .checked_sub(frame.specmin)
                .filter(|&f| f < frame.nspec)
            else {
                continue;
            };
            for (j, w) in patch.waves.clone().enumerate() {
                if r.rejected[c * r.nwave + j] > 0.0 {
                    flagged[[row, w]] = true;
                }
            }
        }
    }
    let mut n = 0;
    for (m, &f) in frame.mask.iter_mut().zip(&flagged) {
        if f {
            *m |= REJECTED;
            n += 1;
        }
    }
    n
}

/// Flags the bins that lost pixels ([`flag_rejected_bins`]) and logs the frame's rejected
/// pixels, re-solved patches and flagged bins.
pub fn log_rejection(frame: &mut Frame, plan: &Plan, results: &[PatchResult]) {
    let bins = flag_rejected_bins(frame, plan, results);
    let pixels: usize = results.iter().map(|r| r.nrejected).sum();
    let resolved = results.iter().filter(|r| r.nresolves > 0).count();
    let passes: usize = results.iter().map(|r| r.nresolves).sum();
    tracing::info!(
        "outliers: {pixels} pixels rejected, {resolved} of {} patches solved again ({passes} extra solves), {bins} bins flagged COSMIC",
        results.len()
    );
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Pixels on a flat model with read noise 3: a pixel 6 sigma high is rejected, one 4
    /// sigma high is not, and a low pixel waits for a pass without high ones.
    #[test]
    fn a_pass_rejects_high_pixels_first() {
        let n = 101;
        let model = vec![16.0; n];
        let var: f64 = 9.0 + 16.0;
        let mut ivar = vec![1.0 / var; n];
        let mut core = vec![true; n];
        let mut pix = model.clone();
        pix[3] += 6.0 * var.sqrt();
        // outside the core footprint a pixel is never tested
        pix[50] += 100.0 * var.sqrt();
        core[50] = false;
        pix[7] += 4.0 * var.sqrt();
        pix[9] -= 6.0 * var.sqrt();
        assert_eq!(
            find_outliers(&pix, &ivar, &model, &core, n, (5.0, 0.0)),
            [3]
        );
        ivar[3] = 0.0;
        assert_eq!(
            find_outliers(&pix, &ivar, &model, &core, n, (5.0, 0.0)),
            [9]
        );
        ivar[9] = 0.0;
        assert!(find_outliers(&pix, &ivar, &model, &core, n, (5.0, 0.0)).is_empty());
    }

    /// The noise is the model's: a pixel whose own ivar is tiny (its data's Poisson term
    /// included the cosmic) is still rejected.
    #[test]
    fn the_noise_is_the_models_not_the_datas() {
        let model = vec![4.0; 11];
        let mut ivar = vec![1.0 / 13.0; 11];
        let core = vec![true; 11];
        let mut pix = model.clone();
        pix[5] = 2000.0;
        ivar[5] = 1.0 / 2009.0;
        assert_eq!(
            find_outliers(&pix, &ivar, &model, &core, 11, (5.0, 0.01)),
            [5]
        );
        assert_eq!(read_noise_variance(&[1.0 / 13.0; 3], &[4.0; 3]), Some(9.0));
    }

    /// A positive outlier takes the pixels connected to it beyond 2 sigma (a chain of them,
    /// diagonals included), not a pixel below 2 sigma next to it nor one beyond 2 sigma
    /// that no chain reaches.
    #[test]
    fn an_outlier_takes_its_connected_pixels_beyond_two_sigma() {
        let (w, h) = (8, 6);
        let model = vec![16.0; w * h];
        let var: f64 = 9.0 + 16.0;
        let ivar = vec![1.0 / var; w * h];
        let core = vec![true; w * h];
        let mut pix = model.clone();
        let mut set = |r: usize, c: usize, pull: f64| pix[r * w + c] += pull * var.sqrt();
        set(2, 2, 6.0);
        set(3, 3, 3.0); // diagonal neighbour
        set(4, 3, 2.5); // its neighbour
        set(2, 1, 1.5); // next to the outlier, below 2 sigma
        set(0, 7, 3.0); // beyond 2 sigma, unconnected
        let mut found = find_outliers(&pix, &ivar, &model, &core, w, (5.0, 0.0));
        found.sort_unstable();
        assert_eq!(found, [2 * w + 2, 3 * w + 3, 4 * w + 3]);
    }

    /// A flat box of `w` x `h` pixels with read noise 3 on a model of 16, every pixel tested
    /// but where `core` says otherwise, and a setter of pulls.
    struct Flat {
        w: usize,
        model: Vec<f64>,
        ivar: Vec<f64>,
        core: Vec<bool>,
        pix: Vec<f64>,
    }

    impl Flat {
        fn new(w: usize, h: usize) -> Self {
            let model = vec![16.0; w * h];
            Flat {
                w,
                ivar: vec![1.0 / 25.0; w * h],
                core: vec![true; w * h],
                pix: model.clone(),
                model,
            }
        }
        fn set(&mut self, r: usize, c: usize, pull: f64) {
            self.pix[r * self.w + c] = 16.0 + pull * 5.0;
        }
        fn outliers(&self) -> Vec<usize> {
            let (b, w) = (self, self.w);
            let mut found = find_outliers(&b.pix, &b.ivar, &b.model, &b.core, w, (5.0, 0.0));
            found.sort_unstable();
            found
        }
    }

    /// Untested pixels join a seed's growth within reach of it, not beyond.
    #[test]
    fn growth_takes_untested_pixels_near_a_seed() {
        let mut b = Flat::new(30, 6);
        for p in 0..30 * 6 {
            b.core[p] = p % 30 < 10;
        }
        b.set(2, 8, 6.0);
        for c in 9..22 {
            b.set(2, c, 3.0);
        }
        let reach = (8 + UNTESTED_REACH).min(29);
        let want: Vec<usize> = (8..=reach).map(|c| 2 * 30 + c).collect();
        assert_eq!(b.outliers(), want);
        // without the seed nothing is tested beyond 5 sigma: no outlier
        b.set(2, 8, 0.0);
        assert!(b.outliers().is_empty());
    }

    /// An untested pixel far beyond 5 sigma is a seed when it stands alone, not when its
    /// neighbours share its light, nor near the box's edge.
    #[test]
    fn a_sharp_untested_pixel_is_a_seed() {
        let mut b = Flat::new(12, 12);
        b.core = vec![false; 144];
        b.set(6, 6, 20.0);
        assert_eq!(b.outliers(), [6 * 12 + 6]);
        for (r, c) in [(5, 5), (5, 6), (5, 7), (6, 5), (6, 7)] {
            b.set(r, c, 5.0);
        }
        assert!(b.outliers().is_empty(), "a broad bump is not sharp");
        let mut b = Flat::new(12, 12);
        b.core = vec![false; 144];
        b.set(SHARP_EDGE - 1, 6, 20.0);
        assert!(b.outliers().is_empty(), "too near the edge");
    }

    /// A tested pixel next to an outlier is taken when it stands out of its other tested
    /// neighbours by more than 8 sigma, though its own pull is small.
    #[test]
    fn a_neighbour_standing_out_of_its_own_goes_with_an_outlier() {
        let around = [(2, 3), (2, 4), (2, 5), (3, 5), (4, 3), (4, 4), (4, 5)];
        for (low, taken) in [(-8.0, true), (-6.0, false)] {
            let mut b = Flat::new(8, 8);
            b.set(3, 3, 6.0);
            b.set(3, 4, 1.0);
            for (r, c) in around {
                b.set(r, c, low);
            }
            let want: &[usize] = if taken {
                &[3 * 8 + 3, 3 * 8 + 4]
            } else {
                &[3 * 8 + 3]
            };
            assert_eq!(b.outliers(), want, "neighbours at {low}");
        }
        assert_eq!(median(vec![3.0, -1.0, 2.0, 0.0]), Some(1.0));
        assert_eq!(median(vec![]), None);
    }
}
