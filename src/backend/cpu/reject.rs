//! Outlier rejection inside the CPU patch solve (`--reject-outliers`): after a solve, the
//! outliers of [`crate::outliers::find_outliers`] get weight zero and the patch is solved
//! again, until a pass rejects nothing or [`MAX_RESOLVES`] solves have been added.
//!
//! A patch that rejects nothing costs one projection and one test of its pixels more than
//! without rejection, and its results keep their bits. A second pass does not assemble the
//! normal equations again: each rejected pixel's rank-one term `ivar a a^T` (and its share of
//! `y` and `fluxweight`) is taken out of them, a few hundred products where the assembly
//! takes every pixel of every spot. Only the last solution is decorrelated: the passes before
//! need the flux alone.

use super::system::{NormalEquations, PatchSystem};
use super::{decorrelate_sweeps, solve_flux, Decorrelation, RouteCounts, Solved};
use crate::extract::{PatchGeometry, SolveOptions};
use crate::outliers::{find_outliers, MAX_RESOLVES};

/// What rejection did to one patch.
#[derive(Clone, Debug, Default)]
pub(super) struct Rejection {
    /// Pixels given weight zero.
    pub nrejected: usize,
    /// Solves added.
    pub nresolves: usize,
    /// `A xflux` of the final solution over the box, where the last pass computed it: chi2pix
    /// needs it too.
    pub model: Option<Vec<f64>>,
}

/// Solves the patch whose normal equations are `ne`, rejects the outliers of the solution and
/// solves it again while a pass finds some: the final solution (`None` when the patch has no
/// usable pixel left) and what was done. `sys.ivar` keeps the rejected pixels at zero, for the
/// pixel mask, chi2pix and the model.
pub(super) fn reject_and_resolve(
    sys: &mut PatchSystem<'_>,
    mut ne: NormalEquations,
    core: &[bool],
    nsigma: f64,
    options: &SolveOptions,
    counts: &mut RouteCounts,
) -> (Option<Decorrelation>, Rejection) {
    let mut done = Rejection::default();
    let geom = sys.geom.clone();
    let Some(mut solved) = solve_flux(&ne, &geom, options, counts, &|| sys.normal_equations())
    else {
        return (None, done);
    };
    while done.nresolves < MAX_RESOLVES {
        let model = sys.project(solved.xflux(), 0..sys.m());
        let limits = (nsigma, options.psferr);
        let outliers = find_outliers(&sys.pix, &sys.ivar, &model, core, geom.cols.len(), limits);
        if outliers.is_empty() {
            done.model = Some(model);
            break;
        }
        downdate(sys, &mut ne, &outliers);
        for &p in &outliers {
            sys.ivar[p] = 0.0;
        }
        done.nrejected += outliers.len();
        done.nresolves += 1;
        match solve_flux(&ne, &geom, options, counts, &|| sys.normal_equations()) {
            Some(next) => solved = next,
            None => return (None, done),
        }
    }
    let projected = solved.xflux().to_vec();
    let solution = match solved {
        Solved::Sweeps(sweeps) => decorrelate_sweeps(sweeps, &ne, &geom, options, counts, &|| {
            sys.normal_equations()
        }),
        Solved::Decorrelated(d) => Some(d),
    };
    // the dense route, where a Schur complement had no usable root, solves anew
    if solution.as_ref().is_none_or(|d| d.xflux != projected) {
        done.model = None;
    }
    (solution, done)
}

/// Takes the terms of the box pixels `pixels` (still weighted in `sys.ivar`) out of `ne`:
/// `icov -= ivar a a^T`, `y -= ivar p a`, `fluxweight -= ivar a` for each, with the spots'
/// values `a` of every column that reaches the pixel, each product rounded as the assembly
/// rounds it. Bounds of far couplings stay (a coupling only shrinks when a pixel goes); exact
/// ones are downdated too.
fn downdate(sys: &PatchSystem<'_>, ne: &mut NormalEquations, pixels: &[usize]) {
    // the spot values of the columns that reach each pixel
    let mut reach: Vec<Vec<(usize, f64)>> = vec![Vec::new(); pixels.len()];
    let mut sorted: Vec<(usize, usize)> = pixels.iter().enumerate().map(|(i, &p)| (p, i)).collect();
    sorted.sort_unstable();
    for j in 0..sys.m() {
        let col = sys.column(j);
        sys.for_rows(j, |s, p, len| {
            let lo = sorted.partition_point(|&(q, _)| q < p);
            for &(q, i) in sorted[lo..].iter().take_while(|&&(q, _)| q < p + len) {
                let a = col[s + q - p];
                if a != 0.0 {
                    reach[i].push((j, a));
                }
            }
        });
    }
    let nt = ne.nt;
    let mut pos = vec![0; ne.order.len()];
    for (k, &b) in ne.order.iter().enumerate() {
        pos[b] = k;
    }
    for (&p, cols) in pixels.iter().zip(&reach) {
        let (iv, d) = (sys.ivar[p], sys.pix[p]);
        for (n, &(j1, a1)) in cols.iter().enumerate() {
            let w1 = a1 * iv;
            ne.y[j1] -= w1 * d;
            ne.fluxweight[j1] -= w1;
            for &(j2, a2) in &cols[n..] {
                let v = w1 * a2;
                let (k1, k2) = (pos[j1 / nt], pos[j2 / nt]);
                let (i1, i2) = (j1 % nt, j2 % nt);
                if k1 == k2 {
                    ne.diag[k1][(i1, i2)] -= v;
                    if i1 != i2 {
                        ne.diag[k1][(i2, i1)] -= v;
                    }
                } else if k2 == k1 + 1 {
                    ne.sub[k1][(i2, i1)] -= v;
                } else if k1 == k2 + 1 {
                    ne.sub[k2][(i1, i2)] -= v;
                } else if !ne.far_bounded {
                    downdate_far(&mut ne.far, j1, j2, v);
                }
            }
        }
    }
}

/// Subtracts `v` from the exact far coupling of unknowns `j1` and `j2`, listed in either order.
fn downdate_far(far: &mut [(usize, usize, f64)], j1: usize, j2: usize, v: f64) {
    if let Some(e) = far
        .iter_mut()
        .find(|e| (e.0, e.1) == (j1, j2) || (e.0, e.1) == (j2, j1))
    {
        e.2 -= v;
    }
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

#[cfg(test)]
mod tests {
    use std::path::PathBuf;

    use ndarray::Array2;

    use super::*;
    use crate::image::Image;
    use crate::plan::{Plan, PlanOptions};
    use crate::psf::GaussHermitePsf;

    /// The largest difference of two normal equations' entries (blocks, far couplings, `y`,
    /// `fluxweight`), relative to the largest entry of each.
    fn difference(a: &NormalEquations, b: &NormalEquations) -> f64 {
        let rel = |x: &[f64], y: &[f64]| {
            let scale = x.iter().fold(0.0f64, |s, v| s.max(v.abs()));
            x.iter()
                .zip(y)
                .fold(0.0f64, |d, (u, v)| d.max((u - v).abs() / scale))
        };
        let mats = |v: &[faer::Mat<f64>]| -> Vec<f64> {
            v.iter()
                .flat_map(|m| {
                    (0..m.ncols()).flat_map(move |j| (0..m.nrows()).map(move |i| m[(i, j)]))
                })
                .collect()
        };
        // far couplings by pair; one the removed pixels alone made is gone from `b`
        let keys: std::collections::BTreeSet<(usize, usize)> =
            a.far.iter().chain(&b.far).map(|e| (e.0, e.1)).collect();
        let far = |v: &[(usize, usize, f64)]| -> Vec<f64> {
            let m: std::collections::BTreeMap<_, _> = v.iter().map(|e| ((e.0, e.1), e.2)).collect();
            keys.iter()
                .map(|k| m.get(k).copied().unwrap_or(0.0))
                .collect()
        };
        assert_eq!(a.order, b.order);
        [
            rel(&mats(&a.diag), &mats(&b.diag)),
            rel(&mats(&a.sub), &mats(&b.sub)),
            rel(&far(&a.far), &far(&b.far)),
            rel(&a.y, &b.y),
            rel(&a.fluxweight, &b.fluxweight),
        ]
        .into_iter()
        .fold(0.0, f64::max)
    }

    /// Downdating the normal equations by some pixels of a patch gives those assembled without
    /// them, to rounding: every entry is a sum of at most a spot's pixels (11 x 17 here), each
    /// product rounded once, so the two differ by a few times 187 ulps of the largest entry.
    #[test]
    fn downdate_equals_the_assembly_without_the_pixels() {
        let psf = GaussHermitePsf::read(&PathBuf::from("tests/data/psf-r0-00067784.fits"))
            .expect("bundled PSF");
        let plan = Plan::new(PlanOptions::new(6000.0, 6100.0, 0.8, 0, 25)).unwrap();
        let spots = psf.spots(0..25, &plan.fullwave);
        let shape = (psf.npix_y, psf.npix_x);
        let image = Image {
            path: PathBuf::from("synthetic"),
            nrows: shape.0,
            ncols: shape.1,
            pix: Array2::from_shape_fn(shape, |(r, c)| ((r * 31 + c * 17) % 97) as f32),
            ivar: Array2::from_shape_fn(shape, |(r, c)| 0.01 + ((r + c) % 13) as f32 * 1e-3),
            header: Vec::new(),
            has_fibermap: false,
            nmasked: 0,
            nnonfinite: 0,
            kept_fibermap: Default::default(),
        };
        let patch = &plan.patches[plan.patches.len() / 2];
        let geom = PatchGeometry::new(&plan, patch, &spots.corners, shape);
        let sys = PatchSystem::new(geom.clone(), &spots, &image);
        // a run of pixels along a row and a scatter over the box, some shared by many spots
        let n = sys.pix.len();
        let pixels: Vec<usize> = (n / 2..n / 2 + 9).chain((0..n).step_by(n / 40)).collect();
        for exact in [false, true] {
            let mut ne = if exact {
                sys.normal_equations()
            } else {
                sys.normal_equations_bounded()
            };
            downdate(&sys, &mut ne, &pixels);
            let (r0, c0, w) = (geom.rows.start, geom.cols.start, geom.cols.len());
            let mut masked = image.clone();
            for &p in &pixels {
                masked.ivar[[r0 + p / w, c0 + p % w]] = 0.0;
            }
            let without = PatchSystem::new(geom.clone(), &spots, &masked);
            let want = if exact {
                without.normal_equations()
            } else {
                without.normal_equations_bounded()
            };
            if !exact {
                // bounds stay bounds: at least the bounds of the assembly without the pixels
                for (a, b) in ne.far.iter().zip(&want.far) {
                    assert!(a.2 >= b.2, "far bound {} below {}", a.2, b.2);
                }
                ne.far = want.far.clone();
            }
            let d = difference(&ne, &want);
            assert!(
                d < 187.0 * 4.0 * f64::EPSILON,
                "exact {exact}: difference {d:.1e}"
            );
            assert!(difference(&sys.normal_equations(), &want) > 1e-6);
        }
    }
}
