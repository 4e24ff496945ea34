//! Decorrelation of one fiber (DESIGN step 4): `Q = C_bb^(-1/2)`, `s = Q 1`, `R = diag(s)^-1
//! Q`, `ivar = s^2`, `flux = R xflux`, and the resolution diagonals.
//!
//! From the Schur complement `S = C_bb^-1`, `Q = S^(1/2)`. Where a bin is masked, `cond(S)`
//! reaches 1e10, and the route decides the accuracy. The error of the flux in units of its
//! sigma is about `u cond(S)` through an eigendecomposition of `S` (its small eigenvalues carry
//! absolute errors of `u |S|`), but only `u sqrt(cond(S))` through the singular value
//! decomposition `G = U Sigma V^T` of the Cholesky factor `S = G G^T`, since `Q = U Sigma U^T`
//! is the symmetric polar factor of `G^T` and `cond(G) = sqrt(cond(S))`. The
//! eigendecomposition is about twice as fast, so it serves the well-conditioned blocks (all of
//! them on an unmasked frame) and the polar route the others.
//!
//! Every route gives `Q = U diag(g) U^T` with `U` orthogonal, and `Q` is kept as those factors
//! ([`Root`]): the outputs need `Q 1`, `Q xb` and the band of `Q` within the resolution's
//! half-width of the diagonal, `O(n^2)` each, where forming `Q` takes a product of `n^3`.

use faer::diag::Diag;
use faer::dyn_stack::{MemBuffer, MemStack};
use faer::linalg::svd::{svd, svd_scratch, ComputeSvdVectors};
use faer::{Mat, Par};

use super::cholesky::cholesky;
use super::dense::{clip_eigenvalues, column, eigh, EIGEN_CLIP};
use super::system::dot;
use crate::extract::PatchResult;

/// The largest `cond(S)` that takes the eigendecomposition of `S`: its flux error, about
/// `u cond(S) sqrt(n) / 2` sigma for `n = 74` bins, stays below 1e-11 sigma.
pub const EIGEN_MAX_COND: f64 = 1e4;

/// How a block's `Q` was computed.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Route {
    /// Eigendecomposition of the Schur complement.
    Eigen,
    /// Polar factor of its Cholesky factor, through its SVD.
    Polar,
}

/// A symmetric `Q = U diag(g) U^T`, kept as `U^T` and `g`.
pub(super) struct Root {
    /// `U^T`: column `r` is row `r` of `U`.
    ut: Mat<f64>,
    g: Vec<f64>,
}

impl Root {
    /// `U diag(f(s)) U^T`.
    fn new(s: &[f64], u: &Mat<f64>, f: impl Fn(f64) -> f64) -> Self {
        Root {
            ut: u.transpose().to_owned(),
            g: s.iter().map(|&v| f(v)).collect(),
        }
    }

    /// Order of `Q`.
    fn n(&self) -> usize {
        self.g.len()
    }

    /// `Q v = U (g * (U^T v))`.
    fn apply(&self, v: &[f64]) -> Vec<f64> {
        let n = self.n();
        let mut a = vec![0.0; n];
        for (r, &vr) in v.iter().enumerate() {
            for (a, &x) in a.iter_mut().zip(column(&self.ut, r)) {
                *a += x * vr;
            }
        }
        for (a, &g) in a.iter_mut().zip(&self.g) {
            *a *= g;
        }
        (0..n).map(|r| dot(column(&self.ut, r), &a)).collect()
    }

    /// `U[r][i] g[i]` for every `i`: the factors that row `r` of `Q` shares by all its
    /// entries, `Q[r][c] = sum_i U[r][i] g[i] U[c][i]`.
    fn weighted_row(&self, r: usize, out: &mut [f64]) {
        for ((o, &u), &g) in out.iter_mut().zip(column(&self.ut, r)).zip(&self.g) {
            *o = u * g;
        }
    }

    /// `Q[r][c]`.
    #[cfg(test)]
    fn entry(&self, r: usize, c: usize) -> f64 {
        let mut ug = vec![0.0; self.n()];
        self.weighted_row(r, &mut ug);
        dot(&ug, column(&self.ut, c))
    }

    /// The row sums `Q 1` and the decorrelated flux `(Q xb)_r / (Q 1)_r` of every row.
    fn rows(&self, xb: &[f64]) -> (Vec<f64>, Vec<f64>) {
        let rowsum = self.apply(&vec![1.0; self.n()]);
        let flux = self
            .apply(xb)
            .iter()
            .zip(&rowsum)
            .map(|(q, norm)| q / norm)
            .collect();
        (rowsum, flux)
    }

    /// The decorrelated flux of every row of a fiber whose block of `xflux` is `xb`.
    pub(super) fn flux(&self, xb: &[f64]) -> Vec<f64> {
        self.rows(xb).1
    }

    /// `Q` itself.
    #[cfg(test)]
    pub(super) fn matrix(&self) -> Mat<f64> {
        Mat::from_fn(self.n(), self.n(), |r, c| self.entry(r, c))
    }
}

/// `Q = S^(1/2)` of a Schur complement; `None` when `S` is not numerically positive definite
/// or so ill-conditioned that the dense route would clip its eigenvalues.
pub(super) fn sqrt_of_schur(s: &Mat<f64>) -> Option<(Root, Route)> {
    let n = s.nrows();
    let (lam, u) = eigh(s.as_ref());
    let (lo, hi) = (lam[0], lam[n - 1]);
    if !(lo > 0.0) || !(hi.is_finite()) || lo < hi * EIGEN_CLIP {
        return None;
    }
    if hi <= EIGEN_MAX_COND * lo {
        return Some((Root::new(&lam, &u, f64::sqrt), Route::Eigen));
    }
    let mut g = s.clone();
    cholesky(&mut g).ok()?;
    let mut sigma = Diag::<f64>::zeros(n);
    let mut u = Mat::<f64>::zeros(n, n);
    let mut mem = MemBuffer::new(svd_scratch::<f64>(
        n,
        n,
        ComputeSvdVectors::Full,
        ComputeSvdVectors::No,
        Par::Seq,
        Default::default(),
    ));
    svd(
        g.as_ref(),
        sigma.as_mut(),
        Some(u.as_mut()),
        None,
        Par::Seq,
        MemStack::new(&mut mem),
        Default::default(),
    )
    .ok()?;
    let sigma: Vec<f64> = (0..n).map(|i| sigma[i]).collect();
    Some((Root::new(&sigma, &u, |v| v), Route::Polar))
}

/// `Q = C^(-1/2)` of a covariance block, eigenvalues clipped from below at `EIGEN_CLIP` of the
/// largest (the dense route).
pub(super) fn inverse_sqrt_of_covariance(c: &Mat<f64>) -> Root {
    let (mut s, u) = eigh(c.as_ref());
    clip_eigenvalues(&mut s);
    Root::new(&s, &u, |v| 1.0 / v.sqrt())
}

/// Where core fiber `c`'s outputs go and which of its `nt` bins are kept.
pub(super) struct CoreBins {
    /// First kept bin (the wavelength padding).
    pub p0: usize,
    /// Kept bins.
    pub nk: usize,
    /// Resolution diagonals on each side.
    pub ndiag: usize,
}

/// Fills flux, ivar and the resolution diagonals of core fiber `c` from its `Q` and its
/// block `xb` of `xflux`.
#[inline(always)]
pub(super) fn fill_fiber(
    result: &mut PatchResult,
    c: usize,
    q: &Root,
    xb: &[f64],
    bins: &CoreBins,
) {
    let nt = q.n();
    let CoreBins { p0, nk, ndiag } = *bins;
    let nd = 2 * ndiag + 1;
    let (rowsum, flux) = q.rows(xb);
    for j in 0..nk {
        let norm = rowsum[p0 + j];
        result.flux[c * nk + j] = flux[p0 + j];
        result.ivar[c * nk + j] = norm * norm;
    }
    // Rdiags[k][j] = R[r][p0 + j] with r = p0 + j - ndiag + k; R's rows are Q's rows over
    // their sums. Row by row of `Q`, for all of its entries in the band at once.
    let mut ug = vec![0.0; nt];
    for r in p0.saturating_sub(ndiag)..(p0 + nk + ndiag).min(nt) {
        q.weighted_row(r, &mut ug);
        let rows = r.saturating_sub(ndiag).max(p0)..(r + ndiag + 1).min(p0 + nk);
        for row in rows {
            let (j, k) = (row - p0, r + ndiag - row);
            result.resolution[(c * nd + k) * nk + j] = dot(&ug, column(&q.ut, row)) / rowsum[r];
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use faer::linalg::matmul::matmul;
    use faer::Accum;

    fn product(a: &Mat<f64>, b: &Mat<f64>) -> Mat<f64> {
        let mut out = Mat::<f64>::zeros(a.nrows(), b.ncols());
        matmul(
            out.as_mut(),
            Accum::Replace,
            a.as_ref(),
            b.as_ref(),
            1.0,
            Par::Seq,
        );
        out
    }

    /// A covariance-like SPD block: a smooth kernel plus a diagonal; `weak` bins get a tiny
    /// diagonal only, as masked bins do.
    fn block(n: usize, weak: &[usize]) -> Mat<f64> {
        Mat::<f64>::from_fn(n, n, |i, j| {
            if weak.contains(&i) || weak.contains(&j) {
                return if i == j { 1e-9 } else { 0.0 };
            }
            let d = i as f64 - j as f64;
            (-(d * d) / 8.0).exp() + if i == j { 0.05 } else { 0.0 }
        })
    }

    /// The inverse square root from the eigendecomposition satisfies Q C Q = I.
    #[test]
    fn inverse_square_root_residual_is_small() {
        let n = 74;
        let c = block(n, &[]);
        let q = inverse_sqrt_of_covariance(&c).matrix();
        let qcq = product(&product(&q, &c), &q);
        let (s, _) = eigh(c.as_ref());
        let cond = s[n - 1] / s[0];
        for i in 0..n {
            for j in 0..n {
                let expect = if i == j { 1.0 } else { 0.0 };
                let err = (qcq[(i, j)] - expect).abs();
                assert!(
                    err < 100.0 * n as f64 * f64::EPSILON * cond.sqrt(),
                    "residual {err:e} at ({i}, {j})"
                );
            }
        }
    }

    /// Both routes give a symmetric square root: Q Q = S, to rounding relative to |S|.
    #[test]
    fn square_root_of_schur_complement_squares_back() {
        let n = 74;
        for (weak, route) in [(vec![], Route::Eigen), (vec![10, 11], Route::Polar)] {
            let s = block(n, &weak);
            let (q, got) = sqrt_of_schur(&s).unwrap();
            let q = q.matrix();
            assert_eq!(got, route);
            let qq = product(&q, &q);
            let scale = (0..n).map(|i| s[(i, i)]).fold(0.0, f64::max);
            for i in 0..n {
                for j in 0..n {
                    assert!((q[(i, j)] - q[(j, i)]).abs() < 1e-14 * scale.sqrt());
                    let err = (qq[(i, j)] - s[(i, j)]).abs();
                    assert!(
                        err < 100.0 * n as f64 * f64::EPSILON * scale,
                        "{route:?}: |QQ - S| = {err:e} at ({i}, {j})"
                    );
                }
            }
        }
    }

    /// A block that is not positive definite is refused, for the dense route to handle.
    #[test]
    fn indefinite_schur_complement_is_refused() {
        let mut s = block(8, &[]);
        s[(3, 3)] = -1.0;
        assert!(sqrt_of_schur(&s).is_none());
    }
}
