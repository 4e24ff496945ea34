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

use ndarray::Array2;

use crate::extract::PatchResult;
use crate::frame::Frame;
use crate::plan::Plan;

/// How many times a patch is solved again at most, after its first solve.
pub const MAX_RESOLVES: usize = 3;

/// Pull above which a pixel connected to a positive outlier is rejected with it.
pub const GROW_NSIGMA: f64 = 2.0;

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
    let pull = |p: usize| {
        let m = model[p];
        let var = rn2 + m.max(0.0) + (psferr * m) * (psferr * m);
        (pix[p] - m) / var.sqrt()
    };
    let tested = |p: usize| core[p] && ivar[p] > 0.0;
    let high: Vec<usize> = (0..pix.len())
        .filter(|&p| tested(p) && pull(p) > nsigma)
        .collect();
    if high.is_empty() {
        return (0..pix.len())
            .filter(|&p| tested(p) && pull(p) < -nsigma)
            .collect();
    }
    grow(high, width, pix.len(), |p| {
        tested(p) && pull(p) > GROW_NSIGMA
    })
}

/// `seeds` with every pixel connected to them through 8-neighbours that `takes`: a flood
/// fill over a box of `len` pixels, `width` wide.
fn grow(seeds: Vec<usize>, width: usize, len: usize, takes: impl Fn(usize) -> bool) -> Vec<usize> {
    let mut taken: std::collections::HashSet<usize> = seeds.iter().copied().collect();
    let mut out = seeds.clone();
    let mut stack = seeds;
    while let Some(p) = stack.pop() {
        let (r, c) = (p / width, p % width);
        let rows = r.saturating_sub(1)..=r + 1;
        let cols = c.saturating_sub(1)..=(c + 1).min(width - 1);
        let around = rows.flat_map(|r| cols.clone().map(move |c| r * width + c));
        for q in around.filter(|&q| q < len) {
            if q != p && !taken.contains(&q) && takes(q) {
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
}
