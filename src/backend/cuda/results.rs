//! Host side of the end of a wave: the core arrays copied back are cut into one
//! [`PatchResult`] per patch, and the patches the device could not factorise are solved by the
//! CPU reference (its eigendecomposition fallback included).

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicBool, Ordering};

use rayon::prelude::*;

use super::dense::Factorization;
use super::shape::Shape;
use super::tables::Live;
use crate::backend::cpu;
use crate::backend::FrameInput;
use crate::extract::{ModelPatch, PatchGeometry, PatchResult, PatchStatus};
use crate::frame::{FrameValues, PatchRow};
use crate::plan::Patch;
use crate::psf::Spots;

/// The core arrays of a wave as copied back, `per = patches * ncore * nwavestep`
/// values each (resolution `nd` times that), then the model boxes when asked.
pub(crate) struct Back<'a> {
    flux: &'a [f64],
    ivar: &'a [f64],
    mask: &'a [f64],
    chi2: &'a [f64],
    res: &'a [f64],
    model: &'a [f64],
}

impl<'a> Back<'a> {
    /// Values copied back for `per` core bins, resolution diagonals `nd` and the model boxes.
    pub(crate) fn len(per: usize, nd: usize, model: usize) -> usize {
        per * (4 + nd) + model
    }

    pub(crate) fn split(back: &'a [f64], per: usize, nd: usize) -> Self {
        let (flux, rest) = back.split_at(per);
        let (ivar, rest) = rest.split_at(per);
        let (mask, rest) = rest.split_at(per);
        let (chi2, rest) = rest.split_at(per);
        let (res, model) = rest.split_at(per * nd);
        Back {
            flux,
            ivar,
            mask,
            chi2,
            res,
            model,
        }
    }
}

/// The result of live patch `li` from the copied-back arrays. Each array is built once from
/// its rows (a frame's results are about 140 MB, fresh memory for the most part, that zeroing
/// first would write twice).
#[allow(clippy::too_many_arguments)]
fn patch_result(
    sh: &Shape,
    patch: &Patch,
    li: usize,
    geom: &PatchGeometry,
    back: &Back<'_>,
    boxoff: usize,
    status: PatchStatus,
    masked: bool,
    core_model: bool,
    regularize: f64,
) -> PatchResult {
    let (ncore, nws, nd) = (sh.ncore, sh.nws, sh.nd());
    let nk = patch.waves.len();
    debug_assert_eq!(
        patch.fibers.len(),
        ncore,
        "the plan's sub-bundles are equal"
    );
    // `per` rows of nws bins a core fiber (nk of them the patch's), fiber after fiber
    let rows = |v: &[f64], per: usize| -> Vec<f64> {
        let mut out = Vec::with_capacity(ncore * per * nk);
        for i in 0..ncore * per {
            out.extend_from_slice(&v[(li * ncore * per + i) * nws..][..nk]);
        }
        out
    };
    let pixmask_fraction = rows(back.mask, 1);
    if masked {
        return PatchResult::without_usable_pixels(patch, sh.ndiag, regularize, pixmask_fraction);
    }
    let mut r = PatchResult {
        patch: patch.index,
        nfiber: ncore,
        nwave: nk,
        ndiag: sh.ndiag,
        status,
        flux: rows(back.flux, 1),
        ivar: rows(back.ivar, 1),
        resolution: rows(back.res, nd),
        pixmask_fraction,
        chi2pix: rows(back.chi2, 1),
        model: None,
        rejected: Vec::new(),
        nrejected: 0,
        nresolves: 0,
        placed: false,
    };
    if core_model {
        r.model = Some(model_patch(geom, back, boxoff));
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
    r
}

/// The model box of a patch, at `boxoff` in the copied-back boxes.
fn model_patch(geom: &PatchGeometry, back: &Back<'_>, boxoff: usize) -> ModelPatch {
    let len = geom.rows.len() * geom.cols.len();
    ModelPatch {
        rows: geom.rows.clone(),
        cols: geom.cols.clone(),
        data: back.model[boxoff..boxoff + len].to_vec(),
    }
}

/// The results of a wave's patches (`patches`, with their tables `live` and model box offsets
/// `boxoff`) that the device solved, by position in the frame; a patch without any usable
/// pixel gets [`PatchResult::without_usable_pixels`] with the solve's `regularize`.
#[allow(clippy::too_many_arguments)]
pub(crate) fn unpack(
    sh: &Shape,
    patches: &[&Patch],
    live: &[Live],
    boxoff: &[i64],
    back: &Back<'_>,
    fact: &Factorization,
    core_model: bool,
    regularize: f64,
) -> Vec<(usize, PatchResult)> {
    live.par_iter()
        .enumerate()
        .filter(|(li, _)| !fact.to_cpu.contains(li))
        .map(|(li, (ci, geom, _))| {
            let r = patch_result(
                sh,
                patches[li],
                li,
                geom,
                back,
                boxoff[li] as usize,
                fact.status[li],
                fact.masked[li] != 0,
                core_model,
                regularize,
            );
            (*ci, r)
        })
        .collect()
}

/// [`unpack`], with the values of the patches solved on the device placed straight into the
/// frame's arrays `values`, row by row: their results are [`PatchResult::placed`]. A patch
/// without usable pixels, or with a value that is not finite, gets its result from `unpack`'s
/// rules instead, values and all: the frame's assembly stitches it over what was placed. So
/// does a patch with fibers beyond the frame's, which a value of theirs that is not finite
/// would turn all to zero.
#[allow(clippy::too_many_arguments)]
pub(crate) fn place(
    sh: &Shape,
    patches: &[&Patch],
    live: &[Live],
    boxoff: &[i64],
    back: &Back<'_>,
    fact: &Factorization,
    core_model: bool,
    regularize: f64,
    values: &mut FrameValues,
) -> Vec<(usize, PatchResult)> {
    let mut by_row = vec![Vec::new(); values.nspec()];
    let placed: Vec<bool> = (0..live.len())
        .map(|li| {
            let rows: Option<Vec<usize>> = patches[li]
                .fibers
                .clone()
                .map(|f| values.row_of(f))
                .collect();
            match rows {
                Some(rows) if !fact.to_cpu.contains(&li) && fact.masked[li] == 0 => {
                    rows.into_iter().for_each(|row| by_row[row].push(li));
                    true
                }
                _ => false,
            }
        })
        .collect();
    let finite: Vec<AtomicBool> = (0..live.len()).map(|_| AtomicBool::new(true)).collect();
    let (specmin, nd) = (values.specmin, sh.nd());
    values.par_rows(|row, mut rows| {
        for &li in &by_row[row] {
            let patch = patches[li];
            let (nk, local) = (patch.waves.len(), specmin + row - patch.fibers.start);
            let src = back_row(sh, back, li, local);
            if !src.is_finite(nk, nd) {
                finite[li].store(false, Ordering::Relaxed);
            }
            rows.put(patch.waves.start, nk, &src);
        }
    });
    live.par_iter()
        .enumerate()
        .filter(|(li, _)| !fact.to_cpu.contains(li))
        .map(|(li, (ci, geom, _))| {
            let boxoff = boxoff[li] as usize;
            let r = if placed[li] && finite[li].load(Ordering::Relaxed) {
                let mut r = PatchResult::placed(patches[li], sh.ndiag, fact.status[li]);
                r.model = core_model.then(|| model_patch(geom, back, boxoff));
                r
            } else {
                let masked = fact.masked[li] != 0;
                let (status, patch) = (fact.status[li], patches[li]);
                patch_result(
                    sh, patch, li, geom, back, boxoff, status, masked, core_model, regularize,
                )
            };
            (*ci, r)
        })
        .collect()
}

/// Core fiber `local` of live patch `li` in the copied-back arrays.
fn back_row<'a>(sh: &Shape, back: &Back<'a>, li: usize, local: usize) -> PatchRow<'a> {
    let row = li * sh.ncore + local;
    let at = row * sh.nws;
    PatchRow {
        flux: &back.flux[at..],
        ivar: &back.ivar[at..],
        chi2pix: &back.chi2[at..],
        fraction: &back.mask[at..],
        res: &back.res[row * sh.nd() * sh.nws..],
        res_stride: sh.nws,
    }
}

/// Why a patch leaves the device for the CPU reference.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum FallbackReason {
    /// Its factorisation failed, and again after the regularised retry.
    FailedTwice,
    /// The Schur route would drop a second-neighbour coupling over the tuning's bound; the
    /// CPU reference solves it by its dense route, as the CPU backend does such a patch.
    Coupled,
}

/// Solves a wave's patches `to_cpu` with the CPU reference; results by position in the frame.
pub(crate) fn cpu_fallback(
    input: &FrameInput<'_>,
    sh: &Shape,
    patches: &[&Patch],
    live: &[Live],
    bundles: &[usize],
    to_cpu: &[usize],
    reason: FallbackReason,
) -> Vec<(usize, PatchResult)> {
    let mut host_spots: BTreeMap<usize, Spots> = BTreeMap::new();
    let mut results = Vec::with_capacity(to_cpu.len());
    for &li in to_cpu {
        let (ci, _, slot) = &live[li];
        let patch = patches[li];
        let b = bundles[*slot];
        let spots = host_spots
            .entry(b)
            .or_insert_with(|| input.psf.spots(b..b + sh.bundlesize, &input.plan.fullwave));
        // a coupled patch is logged (debug) where the coupling check finds it, schur::outcome
        if reason == FallbackReason::FailedTwice {
            tracing::warn!(
                "patch fibers {:?} bins {:?}: Cholesky failed twice on the GPU, solved on the CPU",
                patch.fibers,
                patch.waves
            );
        }
        let r = cpu::solve_patch(input.plan, patch, spots, input.image, input.options);
        results.push((*ci, r));
    }
    results
}
