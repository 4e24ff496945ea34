//! Host side of the end of a wave: the core arrays copied back are cut into one
//! [`PatchResult`] per patch, and the patches the device could not factorise are solved by the
//! CPU reference (its eigendecomposition fallback included).

use std::collections::BTreeMap;

use rayon::prelude::*;

use super::dense::Factorization;
use super::shape::Shape;
use super::tables::Live;
use crate::backend::cpu;
use crate::backend::FrameInput;
use crate::extract::{ModelPatch, PatchGeometry, PatchResult, PatchStatus};
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
    };
    if core_model {
        let len = geom.rows.len() * geom.cols.len();
        r.model = Some(ModelPatch {
            rows: geom.rows.clone(),
            cols: geom.cols.clone(),
            data: back.model[boxoff..boxoff + len].to_vec(),
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
    r
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
