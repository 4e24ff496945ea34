//! Outlier rejection inside the CPU patch solve (`--reject-outliers`): after a solve, the
//! outliers of [`crate::outliers::reject_pass`] get weight zero and the patch is solved again,
//! until a pass rejects nothing or [`MAX_RESOLVES`] solves have been added.

use super::system::PatchSystem;
use super::{decorrelation, Decorrelation, RouteCounts};
use crate::extract::{PatchGeometry, SolveOptions};
use crate::outliers::{reject_pass, MAX_RESOLVES};

/// What rejection did to one patch.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub(super) struct Rejection {
    /// Pixels given weight zero.
    pub nrejected: usize,
    /// Solves added.
    pub nresolves: usize,
}

/// Rejects the outliers of `solution` and solves the patch again while a pass finds some:
/// the final solution (`None` when the patch has no usable pixel left) and what was done.
/// `sys.ivar` keeps the rejected pixels at zero, for the pixel mask, chi2pix and the model.
pub(super) fn reject_and_resolve(
    sys: &mut PatchSystem<'_>,
    core: &[bool],
    mut solution: Decorrelation,
    nsigma: f64,
    options: &SolveOptions,
    counts: &mut RouteCounts,
) -> (Option<Decorrelation>, Rejection) {
    let mut done = Rejection::default();
    let geom = sys.geom.clone();
    for _ in 0..MAX_RESOLVES {
        let model = sys.project(&solution.xflux, 0..sys.m());
        let n = reject_pass(
            &sys.pix,
            &mut sys.ivar,
            &model,
            core,
            nsigma,
            options.psferr,
        );
        if n == 0 {
            break;
        }
        done.nrejected += n;
        done.nresolves += 1;
        let ne = sys.normal_equations_bounded();
        let exact = || sys.normal_equations();
        match decorrelation(&ne, &geom, options, counts, &exact) {
            Some(next) => solution = next,
            None => return (None, done),
        }
    }
    (Some(solution), done)
}

/// The columns whose spots' pixels are tested: the core fibers' bins but the outer half of
/// the padding (`p0` bins) on each side. A pixel there gets light only from bins the patch
/// solves, as long as half the padding spans more CCD rows than half a spot (6 bins of 0.8 A
/// and 5 rows on DESI PSFs); and a track in the padding rows, which the next patch tests as
/// its core, is tested here too, where it would pull the padding bins next to the core.
pub(super) fn tested_columns(geom: &PatchGeometry, p0: usize) -> impl Iterator<Item = usize> {
    let (nt, npad) = (geom.nwavetot, geom.npad);
    (npad..geom.block_fibers.len())
        .flat_map(move |b| (p0 / 2..nt - p0 / 2).map(move |j| b * nt + j))
}

/// The box pixels where the spots of `columns` are not zero.
pub(super) fn core_pixels(
    sys: &PatchSystem<'_>,
    columns: impl Iterator<Item = usize>,
) -> Vec<bool> {
    let mut core = vec![false; sys.pix.len()];
    for j in columns {
        let spot = sys.column(j);
        sys.for_rows(j, |s, p, len| {
            for (c, &a) in core[p..p + len].iter_mut().zip(&spot[s..s + len]) {
                *c |= a > 0.0;
            }
        });
    }
    core
}
