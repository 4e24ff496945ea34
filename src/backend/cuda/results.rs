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

/// A finished wave's copied-back arrays and what cutting them into results needs: the wave's
/// `patches`, their tables `live` and model box offsets `boxoff`, how their factorisation went,
/// whether model boxes were asked for and the solve's `regularize`.
pub(crate) struct Unpacking<'w> {
    pub(crate) sh: &'w Shape,
    pub(crate) patches: &'w [&'w Patch],
    pub(crate) live: &'w [Live],
    pub(crate) boxoff: &'w [i64],
    pub(crate) back: &'w Back<'w>,
    pub(crate) fact: &'w Factorization,
    pub(crate) core_model: bool,
    pub(crate) regularize: f64,
}

impl Unpacking<'_> {
    /// The result of live patch `li`, values and all. Each array is built once from its rows
    /// (a frame's results are about 140 MB, fresh memory for the most part, that zeroing first
    /// would write twice). A patch without any usable pixel gets
    /// [`PatchResult::without_usable_pixels`].
    fn result(&self, li: usize, geom: &PatchGeometry) -> PatchResult {
        let (sh, back, patch) = (self.sh, self.back, self.patches[li]);
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
        if self.fact.masked[li] != 0 {
            return PatchResult::without_usable_pixels(
                patch,
                sh.ndiag,
                self.regularize,
                pixmask_fraction,
            );
        }
        let mut r = PatchResult {
            patch: patch.index,
            nfiber: ncore,
            nwave: nk,
            ndiag: sh.ndiag,
            status: self.fact.status[li],
            flux: rows(back.flux, 1),
            ivar: rows(back.ivar, 1),
            resolution: rows(back.res, nd),
            pixmask_fraction,
            chi2pix: rows(back.chi2, 1),
            model: self.model(li, geom),
            rejected: Vec::new(),
            nrejected: 0,
            nresolves: 0,
            placed: false,
        };
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

    /// The model box of live patch `li`, when asked for.
    fn model(&self, li: usize, geom: &PatchGeometry) -> Option<ModelPatch> {
        let at = self.boxoff[li] as usize;
        let len = geom.rows.len() * geom.cols.len();
        self.core_model.then(|| ModelPatch {
            rows: geom.rows.clone(),
            cols: geom.cols.clone(),
            data: self.back.model[at..at + len].to_vec(),
        })
    }

    /// The live patches the device solved (not those it leaves to the CPU), with their
    /// positions in the wave.
    fn solved(&self) -> impl ParallelIterator<Item = (usize, &Live)> + '_ {
        let to_cpu = &self.fact.to_cpu;
        self.live
            .par_iter()
            .enumerate()
            .filter(move |(li, _)| !to_cpu.contains(li))
    }

    /// The results of the patches the device solved, by position in the frame.
    pub(crate) fn unpack(&self) -> Vec<(usize, PatchResult)> {
        self.solved()
            .map(|(li, (ci, geom, _))| (*ci, self.result(li, geom)))
            .collect()
    }

    /// [`Unpacking::unpack`], with the values of the patches solved on the device placed
    /// straight into the frame's arrays `values`, row by row: their results are
    /// [`PatchResult::placed`]. A patch without usable pixels, or with a value that is not
    /// finite, gets its result as `unpack` gives it instead, values and all: the frame's
    /// assembly stitches it over what was placed. So does a patch with fibers beyond the
    /// frame's, which a value of theirs that is not finite would turn all to zero.
    pub(crate) fn place(&self, values: &mut FrameValues) -> Vec<(usize, PatchResult)> {
        let (fact, patches) = (self.fact, self.patches);
        let mut by_row = vec![Vec::new(); values.nspec()];
        let placed: Vec<bool> = (0..self.live.len())
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
        let finite: Vec<AtomicBool> = placed.iter().map(|_| AtomicBool::new(true)).collect();
        let (specmin, nd) = (values.specmin, self.sh.nd());
        values.par_rows(|row, mut rows| {
            for &li in &by_row[row] {
                let patch = patches[li];
                let (nk, local) = (patch.waves.len(), specmin + row - patch.fibers.start);
                let src = back_row(self.sh, self.back, li, local);
                if !src.is_finite(nk, nd) {
                    finite[li].store(false, Ordering::Relaxed);
                }
                rows.put(patch.waves.start, nk, &src);
            }
        });
        self.solved()
            .map(|(li, (ci, geom, _))| {
                let r = if placed[li] && finite[li].load(Ordering::Relaxed) {
                    let mut r = PatchResult::placed(patches[li], self.sh.ndiag, fact.status[li]);
                    r.model = self.model(li, geom);
                    r
                } else {
                    self.result(li, geom)
                };
                (*ci, r)
            })
            .collect()
    }
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
