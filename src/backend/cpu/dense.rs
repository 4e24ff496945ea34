//! The dense route of a patch solve: Cholesky of the whole regularised `icov`, a regularised
//! retry, and the clipped eigendecomposition of `icov` as the last resort. It gives the core
//! fibers' covariance blocks `C_bb` themselves. The Schur-complement route
//! ([`super::schur`]) falls back to it when a patch is not block-tridiagonal enough or one of
//! its block factorisations fails.
//!
//! With the core fibers ordered last, `C_bb` of the core only needs the trailing block of the
//! Cholesky factor `L`: `(icov^-1)_core = L_22^-T L_22^-1`.

use faer::linalg::matmul::matmul;
use faer::linalg::triangular_inverse::invert_lower_triangular;
use faer::linalg::triangular_solve::{
    solve_lower_triangular_in_place, solve_upper_triangular_in_place,
};
use faer::{Accum, Mat, MatRef, Par};

use super::cholesky::cholesky;
use super::system::prior;
use crate::extract::{PatchGeometry, PatchStatus};

/// Regularisation of the retry after a failed Cholesky factorisation (gpu_specter's value).
pub const RETRY_REGULARIZE: f64 = 1e-4;
/// Eigenvalues below this fraction of the largest are clipped to it.
pub const EIGEN_CLIP: f64 = 1e-14;

/// Adds the diagonal prior of step 2; returns false when no pixel constrains the patch.
pub(super) fn regularize(icov: &mut Mat<f64>, fluxweight: &[f64], regularize: f64) -> bool {
    let Some(d) = prior(fluxweight, regularize) else {
        return false;
    };
    for (j, v) in d.into_iter().enumerate() {
        icov[(j, j)] += v;
    }
    true
}

/// Symmetric eigendecomposition `a = U diag(s) U^T`, eigenvalues ascending; only the lower
/// triangle of `a` is read. Failure to converge leaves NaN, which the caller's finiteness
/// check reports.
pub(super) fn eigh(a: MatRef<'_, f64>) -> (Vec<f64>, Mat<f64>) {
    let n = a.nrows();
    super::eigen::eigh(a).unwrap_or_else(|| (vec![f64::NAN; n], Mat::zeros(n, n)))
}

/// `U diag(f(s)) U^T`.
pub(super) fn spectral(s: &[f64], u: &Mat<f64>, f: impl Fn(f64) -> f64) -> Mat<f64> {
    let n = s.len();
    let mut us = Mat::<f64>::zeros(n, n);
    for (j, &sj) in s.iter().enumerate() {
        let v = f(sj);
        for (o, &x) in column_mut(&mut us, j).iter_mut().zip(column(u, j)) {
            *o = x * v;
        }
    }
    let mut out = Mat::<f64>::zeros(n, n);
    matmul(
        out.as_mut(),
        Accum::Replace,
        us.as_ref(),
        u.transpose(),
        1.0,
        Par::Seq,
    );
    out
}

/// Column `j` of a matrix made by faer (contiguous columns), as a slice: loops over it
/// vectorise, where indexing element by element checks bounds at every step.
pub(super) fn column(a: &Mat<f64>, j: usize) -> &[f64] {
    a.col_as_slice(j)
}

/// [`column`], mutable.
pub(super) fn column_mut(a: &mut Mat<f64>, j: usize) -> &mut [f64] {
    a.col_as_slice_mut(j)
}

/// Eigenvalues clipped from below at `EIGEN_CLIP` times the largest.
pub(super) fn clip_eigenvalues(s: &mut [f64]) {
    let max = s.iter().cloned().fold(f64::MIN, f64::max);
    let floor = max * EIGEN_CLIP;
    s.iter_mut().for_each(|v| *v = v.max(floor));
}

/// The solution of the normal equations and the core fibers' covariance blocks.
pub(super) struct Solution {
    pub xflux: Vec<f64>,
    /// `C_bb` of each core fiber.
    pub blocks: Vec<Mat<f64>>,
    pub status: PatchStatus,
}

/// Steps 2-4 up to the covariance blocks: Cholesky, a regularised retry, then the clipped
/// eigendecomposition of icov as the last resort. `icov` is not yet regularised; `None` when
/// no pixel constrains the patch.
pub(super) fn solve(
    icov: &Mat<f64>,
    y: &[f64],
    fw: &[f64],
    geom: &PatchGeometry,
    reg: f64,
) -> Option<Solution> {
    let nt = geom.nwavetot;
    let m = icov.nrows();
    let k0 = geom.npad * nt;
    let mc = m - k0;
    let attempts = [
        (reg, PatchStatus::Ok),
        (RETRY_REGULARIZE, PatchStatus::Regularized),
    ];
    for (alpha, status) in attempts {
        if status == PatchStatus::Regularized && reg == RETRY_REGULARIZE {
            break;
        }
        let mut l = icov.clone();
        if !regularize(&mut l, fw, alpha) {
            return None;
        }
        if cholesky(&mut l).is_err() {
            continue;
        }
        let mut x = Mat::<f64>::from_fn(m, 1, |i, _| y[i]);
        solve_lower_triangular_in_place(l.as_ref(), x.as_mut(), Par::Seq);
        solve_upper_triangular_in_place(l.transpose(), x.as_mut(), Par::Seq);
        let mut linv = Mat::<f64>::zeros(mc, mc);
        invert_lower_triangular(
            linv.as_mut(),
            l.as_ref().submatrix(k0, k0, mc, mc),
            Par::Seq,
        );
        let blocks = (0..geom.ncore())
            .map(|c| {
                let xb = linv.as_ref().submatrix(c * nt, c * nt, mc - c * nt, nt);
                let mut cb = Mat::<f64>::zeros(nt, nt);
                matmul(
                    cb.as_mut(),
                    Accum::Replace,
                    xb.transpose(),
                    xb,
                    1.0,
                    Par::Seq,
                );
                cb
            })
            .collect();
        return Some(Solution {
            xflux: (0..m).map(|i| x[(i, 0)]).collect(),
            blocks,
            status,
        });
    }
    // Last resort: clipped eigendecomposition of the regularised icov.
    let mut a = icov.clone();
    if !regularize(&mut a, fw, reg) {
        return None;
    }
    let (mut s, u) = eigh(a.as_ref());
    clip_eigenvalues(&mut s);
    let c = spectral(&s, &u, |v| 1.0 / v);
    let xflux = (0..m)
        .map(|i| (0..m).map(|k| c[(i, k)] * y[k]).sum())
        .collect();
    let blocks = (0..geom.ncore())
        .map(|b| {
            let o = k0 + b * nt;
            c.as_ref().submatrix(o, o, nt, nt).to_owned()
        })
        .collect();
    Some(Solution {
        xflux,
        blocks,
        status: PatchStatus::EigenFallback,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    pub(crate) fn geometry(n: usize) -> PatchGeometry {
        PatchGeometry {
            rows: 0..1,
            cols: 0..1,
            block_fibers: vec![0],
            npad: 0,
            wave0: 0,
            nwavetot: n,
        }
    }

    /// An SPD system takes the Cholesky route and its covariance block is the inverse.
    #[test]
    fn spd_system_uses_cholesky_and_inverts_exactly() {
        let a = Mat::<f64>::from_fn(3, 3, |i, j| if i == j { 4.0 } else { 1.0 });
        let s = solve(&a, &[1.0, 2.0, 3.0], &[1.0; 3], &geometry(3), 0.0).unwrap();
        assert_eq!(s.status, PatchStatus::Ok);
        let mut prod = Mat::<f64>::zeros(3, 3);
        matmul(
            prod.as_mut(),
            Accum::Replace,
            a.as_ref(),
            s.blocks[0].as_ref(),
            1.0,
            Par::Seq,
        );
        for i in 0..3 {
            for j in 0..3 {
                let expect = if i == j { 1.0 } else { 0.0 };
                assert!(
                    (prod[(i, j)] - expect).abs() < 1e-10,
                    "A C != I at ({i}, {j})"
                );
            }
            let ax: f64 = (0..3).map(|k| a[(i, k)] * s.xflux[k]).sum();
            assert!((ax - [1.0, 2.0, 3.0][i]).abs() < 1e-12);
        }
    }

    /// An indefinite icov defeats Cholesky twice and falls back to the clipped
    /// eigendecomposition, which still returns finite values.
    #[test]
    fn indefinite_system_falls_back_to_clipped_eigendecomposition() {
        let a = Mat::<f64>::from_fn(2, 2, |i, j| if i == j { 1.0 } else { 2.0 });
        let s = solve(&a, &[1.0, -1.0], &[1.0; 2], &geometry(2), 0.0).unwrap();
        assert_eq!(s.status, PatchStatus::EigenFallback);
        assert!(s.xflux.iter().all(|v| v.is_finite()));
        assert!(s.blocks[0]
            .col_iter()
            .all(|c| c.iter().all(|v| v.is_finite())));
    }

    /// No constraint at all (zero fluxweight) is reported, not solved.
    #[test]
    fn unconstrained_system_is_reported_as_masked() {
        let a = Mat::<f64>::zeros(2, 2);
        assert!(solve(&a, &[0.0; 2], &[0.0; 2], &geometry(2), 0.0).is_none());
    }
}
