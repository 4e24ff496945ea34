//! The symmetric eigendecomposition of the decorrelation, `A = U diag(s) U^T`: faer's
//! algorithm (Householder tridiagonalisation, implicit QR on the tridiagonal matrix with the
//! rotations accumulated into `U`, the Householder sequence applied back), with a
//! tridiagonalisation for small matrices ([`super::tridiag`]) and a cheaper QR iteration. It
//! is about two fifths of a patch solve. The matrix is first divided by a power of two near its
//! largest entry, which is exact and keeps the sums of squares of the reduction in range.
//!
//! The QR sweeps are a chain of dependent divisions and square roots (one Givens rotation per
//! step), each followed by the rotation of two columns of `U`. faer makes the rotation in a
//! function of its own and dispatches each column update to SIMD code at run time; here the
//! whole iteration is one function compiled for the machine's SIMD level, so the updates of
//! `U` overlap the chain. The shifts and deflations are faer's, and so are the fused
//! multiply-adds of the updates of `U` (those of faer's SIMD path). Two things differ:
//! - the rotation is `c = p / r`, `s = -q / r` with `r = sqrt(p^2 + q^2)`, one square root
//!   and two independent divisions without a branch, where faer divides, takes a scaled
//!   `hypot` and divides again on one of two branches; faer's form remains for the rare
//!   arguments whose squares could overflow or lose precision to underflow. Its rounding
//!   differs from faer's by an ulp or so: the eigenvalues agree to about 1e-14 relative and
//!   the residual and orthogonality of the decomposition are as good or better;
//! - the rotations of `U` skip the rows where both of its columns are still zero: `U` starts
//!   as the identity, and column `j` has only reached the rows a sweep can have carried into
//!   it (after `s` sweeps, those above row `j + s`). The skipped products are exact zeros;
//! - the rotations go to `U` two at a time, one step behind the sweep, each pair in one pass
//!   over three columns, so that the middle one is loaded and stored once. Every element goes
//!   through the same operations in the same order.
//!
//! faer also tests every off-diagonal entry of the active block before every step with
//! `|e_i| < eps hypot(d_i, d_i+1)`, a square root per entry; where `|e_i|` is clearly above
//! `eps (|d_i| + |d_i+1|)`, which bounds the rounded right-hand side, the answer is known
//! without it, and the test is evaluated as faer does only near the threshold.

use faer::dyn_stack::{MemBuffer, MemStack};
use faer::linalg::evd::{self_adjoint_evd, self_adjoint_evd_scratch, ComputeEigenvectors};
use faer::reborrow::ReborrowMut;
use faer::traits::math_utils::{eps, hypot, min_positive};
use faer::{Mat, MatMut, MatRef, Par};

use super::tridiag::Tridiagonal;

/// Margin of the cheap deflation test: the rounded `eps hypot(a, b)` is below
/// `eps (a + b) (1 + 5u)`, and `1e-14` covers that and the rounding of the bound itself.
const BOUND_MARGIN: f64 = 1.0 + 1e-14;

/// `a = U diag(s) U^T` from the lower triangle of `a`, eigenvalues ascending; `None` when an
/// entry is not finite or the QR iteration does not converge.
pub(super) fn eigh(a: MatRef<'_, f64>) -> Option<(Vec<f64>, Mat<f64>)> {
    if a.nrows() < 3 {
        return faer_eigh(a);
    }
    pulp::Arch::new().dispatch(Eigh { a })
}

/// The argument of [`eigh`] as a SIMD operation: the reduction, the QR iteration and the
/// back-transformation all run under the machine's widest instruction set.
struct Eigh<'a> {
    a: MatRef<'a, f64>,
}

impl pulp::WithSimd for Eigh<'_> {
    type Output = Option<(Vec<f64>, Mat<f64>)>;

    #[inline(always)]
    fn with_simd<S: pulp::Simd>(self, _simd: S) -> Self::Output {
        let n = self.a.nrows();
        let mut t = Tridiagonal::new(self.a)?;
        let mut u = Mat::<f64>::zeros(n, n);
        qr_iteration(&mut t.diag, &mut t.offdiag, u.as_mut())?;
        t.apply(u.as_mut());
        let mut s = std::mem::take(&mut t.diag);
        s.iter_mut().for_each(|x| *x *= t.scale);
        Some((s, u))
    }
}

/// faer's eigendecomposition itself, for orders below 3 (closed forms in faer).
fn faer_eigh(a: MatRef<'_, f64>) -> Option<(Vec<f64>, Mat<f64>)> {
    let n = a.nrows();
    let mut s = faer::diag::Diag::<f64>::zeros(n);
    let mut u = Mat::<f64>::zeros(n, n);
    let mut mem = MemBuffer::new(self_adjoint_evd_scratch::<f64>(
        n,
        ComputeEigenvectors::Yes,
        Par::Seq,
        Default::default(),
    ));
    self_adjoint_evd(
        a,
        s.as_mut(),
        Some(u.as_mut()),
        Par::Seq,
        MemStack::new(&mut mem),
        Default::default(),
    )
    .ok()?;
    Some(((0..n).map(|i| s[i]).collect(), u))
}

/// faer's `tridiag_evd::qr_algorithm` for matrices of order 3 and more, the eigenvectors of
/// the tridiagonal matrix into `u`; `None` when it does not converge.
#[inline(always)]
fn qr_iteration(diag: &mut [f64], offdiag: &mut [f64], mut u: MatMut<'_, f64>) -> Option<()> {
    let n = diag.len();
    u.fill(0.0);
    u.rb_mut().diagonal_mut().fill(1.0);
    let max = diag
        .iter()
        .chain(offdiag.iter())
        .fold(0.0f64, |m, &v| m.max(v.abs()));
    if max == 0.0 {
        return Some(());
    }
    let max_inv = max.recip();
    diag.iter_mut().for_each(|x| *x *= max_inv);
    offdiag.iter_mut().for_each(|x| *x *= max_inv);
    let (eps, sml) = (eps::<f64>(), min_positive::<f64>());
    let (mut start, mut end) = (0, n - 1);
    // per column of `U`, the rows that may hold nonzeros
    let mut rows: Vec<(usize, usize)> = (0..n).map(|j| (j, j + 1)).collect();
    let max_iters = 32usize.saturating_mul(n).saturating_mul(n);
    let mut converged = false;
    for iter in 0..max_iters {
        for i in start..end {
            if deflates(offdiag[i], diag[i], diag[i + 1], eps, sml) {
                offdiag[i] = 0.0;
            }
        }
        while end > 0 && offdiag[end - 1] == 0.0 {
            end -= 1;
        }
        if end == 0 {
            converged = true;
            break;
        }
        if iter + 1 == max_iters {
            break;
        }
        start = end - 1;
        while start > 0 && offdiag[start - 1] != 0.0 {
            start -= 1;
        }
        sweep(diag, offdiag, start, end, u.rb_mut(), &mut rows);
    }
    if !converged {
        return None;
    }
    sort(diag, u.rb_mut());
    diag.iter_mut().for_each(|x| *x *= max);
    Some(())
}

/// faer's deflation test `|e| < sml || |e| < eps hypot(a, b)`, without the square root
/// where `|e|` is clearly above `eps (|a| + |b|)`, which bounds `hypot(a, b)`.
#[inline(always)]
fn deflates(e: f64, a: f64, b: f64, eps: f64, sml: f64) -> bool {
    let ae = e.abs();
    if ae >= sml && ae >= eps * (a.abs() + b.abs()) * BOUND_MARGIN {
        return false;
    }
    ae < sml || ae < eps * hypot(&a, &b)
}

/// One implicit QR step with Wilkinson's shift on the unreduced block `start..=end`, as
/// faer takes it; `rows[j]` bounds the nonzero rows of column `j` of `U`.
#[inline(always)]
fn sweep(
    diag: &mut [f64],
    offdiag: &mut [f64],
    start: usize,
    end: usize,
    mut u: MatMut<'_, f64>,
    rows: &mut [(usize, usize)],
) {
    let td = (diag[end - 1] - diag[end]) * 0.5;
    let e = offdiag[end - 1];
    let mut mu = diag[end];
    if td == 0.0 {
        mu -= e.abs();
    } else if e != 0.0 {
        let e2 = e * e;
        let h = hypot(&td, &e);
        let h = if td > 0.0 { h } else { -h };
        if e2 == 0.0 {
            mu -= e / ((td + h) / e);
        } else {
            mu -= e2 / (td + h);
        }
    }
    let mut x = diag[start] - mu;
    let mut z = offdiag[start];
    let mut k = start;
    let mut pending = None;
    while k < end && z != 0.0 {
        let (c, s) = make_givens(x, z);
        let sdk = s * diag[k] + c * offdiag[k];
        let dkp1 = s * offdiag[k] + c * diag[k + 1];
        diag[k] = c * (c * diag[k] - s * offdiag[k]) - s * (c * offdiag[k] - s * diag[k + 1]);
        diag[k + 1] = s * sdk + c * dkp1;
        offdiag[k] = c * sdk - s * dkp1;
        if k > start {
            offdiag[k - 1] = c * offdiag[k - 1] - s * z;
        }
        x = offdiag[k];
        if k < end - 1 {
            z = -s * offdiag[k + 1];
            offdiag[k + 1] *= c;
        }
        // rotations go to `U` two at a time, each pair in one pass over three columns
        pending = match pending {
            None => Some((c, s)),
            Some(first) => {
                rotate_pair(u.rb_mut(), k - 1, first, (c, s), rows);
                None
            }
        };
        k += 1;
    }
    if let Some((c, s)) = pending {
        let k = k - 1;
        let (lo, hi) = (rows[k].0.min(rows[k + 1].0), rows[k].1.max(rows[k + 1].1));
        (rows[k], rows[k + 1]) = ((lo, hi), (lo, hi));
        let [uk, uk1] = columns(u.subcols_mut(k, 2));
        rotate(&mut uk1[lo..hi], &mut uk[lo..hi], c, s);
    }
}

/// The rotation `first` of columns `(k, k + 1)` of `U`, then `second` of columns `(k + 1, k +
/// 2)`, in one pass over the rows: each element goes through the operations of [`rotate`] in
/// the same order, and the middle column is loaded and stored once. Over the rows where
/// either rotation may meet a nonzero (`rows`, updated); `first` there meets zeros only,
/// which stay zeros.
#[inline(always)]
fn rotate_pair(
    u: MatMut<'_, f64>,
    k: usize,
    first: (f64, f64),
    second: (f64, f64),
    rows: &mut [(usize, usize)],
) {
    let (lo, hi) = rows[k..k + 3]
        .iter()
        .fold((usize::MAX, 0), |(lo, hi), r| (lo.min(r.0), hi.max(r.1)));
    rows[k..k + 3].iter_mut().for_each(|r| *r = (lo, hi));
    let [u0, u1, u2] = columns(u.subcols_mut(k, 3));
    let ((c1, s1), (c2, s2)) = (first, second);
    for ((a, b), d) in u0[lo..hi]
        .iter_mut()
        .zip(u1[lo..hi].iter_mut())
        .zip(u2[lo..hi].iter_mut())
    {
        let (xv, yv) = (*b, *a);
        let mid = s1.mul_add(yv, xv * c1);
        *a = (-s1).mul_add(xv, yv * c1);
        let (xv, yv) = (*d, mid);
        *d = s2.mul_add(yv, xv * c2);
        *b = (-s2).mul_add(xv, yv * c2);
    }
}

/// The columns of `u` as slices.
#[inline(always)]
fn columns<const N: usize>(u: MatMut<'_, f64>) -> [&mut [f64]; N] {
    let mut cols = u.col_iter_mut().map(|c| match c.try_as_col_major_mut() {
        Some(c) => c.as_slice_mut(),
        None => unreachable!("the columns of a new matrix are contiguous"),
    });
    std::array::from_fn(|_| cols.next().expect("N columns"))
}

/// The Givens rotation `(c, s)` with `c p - s q = r`, `s p + c q = 0` of faer's
/// `JacobiRotation::make_givens(p, q)`, `r >= 0`: `c = p / r`, `s = -q / r`, one square root
/// and two independent divisions. Where `p^2 + q^2` could overflow or be spoiled by underflow
/// (not on the scaled matrices of the iteration in practice), faer's own scaled form.
#[inline(always)]
fn make_givens(p: f64, q: f64) -> (f64, f64) {
    let r2 = p.mul_add(p, q * q);
    if r2 > SQUARES_MIN && r2 < SQUARES_MAX {
        let r = r2.sqrt();
        (p / r, -q / r)
    } else {
        make_givens_scaled(p, q)
    }
}

/// The range of `p^2 + q^2` where [`make_givens`] takes the square root directly: far from
/// overflow, and far enough above the subnormals that the rounding of the squares is the
/// usual relative one.
const SQUARES_MIN: f64 = 1e-290;
const SQUARES_MAX: f64 = 1e290;

/// faer's `JacobiRotation::make_givens(p, q)`: `(c, s)` with `c p - s q = r`, `s p + c q = 0`.
#[inline(never)]
fn make_givens_scaled(p: f64, q: f64) -> (f64, f64) {
    if q == 0.0 {
        (if p < 0.0 { -1.0 } else { 1.0 }, 0.0)
    } else if p == 0.0 {
        (0.0, if q < 0.0 { 1.0 } else { -1.0 })
    } else if p.abs() > q.abs() {
        let t = q / p;
        let mut u = hypot(&t, &1.0);
        if p < 0.0 {
            u = -u;
        }
        let c = 1.0 / u;
        (c, -t * c)
    } else {
        let t = p / q;
        let mut u = hypot(&t, &1.0);
        if q < 0.0 {
            u = -u;
        }
        let s = -(1.0 / u);
        (-t * s, s)
    }
}

/// Columns `k + 1` and `k` of `U` times the rotation, as faer's SIMD path computes it
/// (`apply_on_the_right_in_place`): `x' = c x + s y`, `y' = c y - s x`, each a fused
/// multiply-add onto the rounded product with `c`.
#[inline(always)]
fn rotate(x: &mut [f64], y: &mut [f64], c: f64, s: f64) {
    if c == 1.0 && s == 0.0 {
        return;
    }
    for (x, y) in x.iter_mut().zip(y.iter_mut()) {
        let (xv, yv) = (*x, *y);
        *x = s.mul_add(yv, xv * c);
        *y = (-s).mul_add(xv, yv * c);
    }
}

/// Eigenvalues ascending by selection, swapping the columns of `u` along, as faer does.
fn sort(diag: &mut [f64], mut u: MatMut<'_, f64>) {
    let n = diag.len();
    for i in 0..n - 1 {
        let mut idx = i;
        let mut min = diag[i];
        for k in i + 1..n {
            if diag[k] < min {
                idx = k;
                min = diag[k];
            }
        }
        if idx != i {
            diag.swap(i, idx);
            faer::perm::swap_cols_idx(u.rb_mut(), i, idx);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The direct rotation and faer's scaled one agree to rounding, over magnitudes from
    /// those of the iteration to the extremes that take the scaled form.
    #[test]
    fn givens_rotations_agree_with_the_scaled_form() {
        let values = [
            1.0, -1.0, 0.3, -2.5e-3, 7.0e-9, -1e-17, 1e-150, -3e-160, 1e160, 2.0, -0.0, 0.0,
        ];
        for &p in &values {
            for &q in &values {
                let (c, s) = make_givens(p, q);
                let (cf, sf) = make_givens_scaled(p, q);
                assert!(
                    (c - cf).abs() <= 4.0 * f64::EPSILON,
                    "c({p}, {q}) = {c} vs {cf}"
                );
                assert!(
                    (s - sf).abs() <= 4.0 * f64::EPSILON,
                    "s({p}, {q}) = {s} vs {sf}"
                );
                assert!((c.mul_add(c, s * s) - 1.0).abs() <= 4.0 * f64::EPSILON);
                let scale = p.abs().max(q.abs());
                assert!((s * p + c * q).abs() <= 4.0 * f64::EPSILON * scale);
            }
        }
    }
}
