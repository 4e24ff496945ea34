//! Householder reduction of a symmetric matrix to tridiagonal form, `A = H T H^T`, and the
//! product `H V` that turns the eigenvectors `V` of `T` into those of `A`: the first and the
//! last step of [`super::eigen::eigh`].
//!
//! The decorrelation reduces blocks of order 74, which fit in the first-level cache. There an
//! unblocked reduction of the whole matrix (both triangles) does best: each step applies the
//! rank-2 correction of its reflector to the trailing matrix column by column and multiplies
//! each column, still in cache, by the next step's reflector. Columns are padded to a
//! multiple of eight rows and every loop starts at a multiple of eight, with the vectors zero
//! outside the rows of the step, so that the loops have no remainders, and the products are
//! fused multiply-adds. On a block of order 74 it takes about 60 us where faer's blocked
//! reduction, which `eigh` used before, takes 110 us; the product `H V` is faer's blocked
//! one, from the same reflectors.
//!
//! The sums run over sixteen interleaved partial sums in a fixed order and every update is
//! elementwise, so the results do not depend on the machine's SIMD width.

use faer::dyn_stack::{MemBuffer, MemStack};
use faer::linalg::householder::{
    apply_block_householder_sequence_on_the_left_in_place_scratch,
    apply_block_householder_sequence_on_the_left_in_place_with_conj, upgrade_householder_factor,
};
use faer::linalg::qr::no_pivoting::factor::recommended_block_size;
use faer::{Conj, Mat, MatMut, MatRef, Par};

use super::system::total;

/// Rows of a padded column are a multiple of this, and so is the first row of every loop.
const LANES: usize = 8;

/// A symmetric matrix reduced to tridiagonal form, with the reflectors of `H`.
pub(super) struct Tridiagonal {
    /// Diagonal of `T`.
    pub diag: Vec<f64>,
    /// Subdiagonal of `T`, then a zero: as long as `diag`.
    pub offdiag: Vec<f64>,
    /// The padded columns (`ld` rows each): column `k` holds below row `k + 1` the reflector
    /// `v_k` of step `k` without its leading one (row `k + 1`), so that `H = H_0 H_1 ...
    /// H_(n-2)` with `H_k = I - tau_k v_k v_k^T`.
    a: Vec<f64>,
    ld: usize,
    tau: Vec<f64>,
    /// The power of two the matrix was divided by: `T`'s eigenvalues times `scale` are the
    /// matrix's.
    pub scale: f64,
}

impl Tridiagonal {
    /// Reduces the symmetric matrix whose lower triangle is `a`, divided first by a power of
    /// two near its largest entry ([`Self::scale`]): exactly, and so that the norms can be
    /// plain sums of squares. `None` when an entry is not finite.
    #[inline(always)]
    pub fn new(a: MatRef<'_, f64>) -> Option<Self> {
        let n = a.nrows();
        let ld = n.div_ceil(LANES) * LANES;
        let mut m = vec![0.0; ld * n];
        for j in 0..n {
            for (i, &v) in a.col(j).iter().enumerate().skip(j) {
                m[j * ld + i] = v;
                m[i * ld + j] = v;
            }
        }
        // the largest magnitude, and a sum that is NaN where an entry is not finite, by lanes
        let (mut max, mut poison) = ([0.0f64; LANES], [0.0f64; LANES]);
        for c in m.chunks_exact(LANES) {
            for i in 0..LANES {
                max[i] = max[i].max(c[i].abs());
                poison[i] += c[i] * 0.0;
            }
        }
        if poison.iter().any(|&p| p != 0.0) {
            return None;
        }
        let max = max.iter().fold(0.0f64, |a, &b| a.max(b));
        let scale = if max > 0.0 {
            2f64.powi(max.log2().round().clamp(-1000.0, 1000.0) as i32)
        } else {
            1.0
        };
        let inv = 1.0 / scale;
        m.iter_mut().for_each(|v| *v *= inv);
        let mut t = Tridiagonal {
            diag: vec![0.0; n],
            offdiag: vec![0.0; n],
            a: m,
            ld,
            tau: vec![0.0; n],
            scale,
        };
        if n >= 2 {
            t.reduce();
        }
        for k in 0..n {
            t.diag[k] = t.a[k * ld + k];
        }
        Some(t)
    }

    /// The `n - 1` steps (the last one, of a single entry, reflects nothing): after step `k`
    /// the trailing matrix is `a[k+1.., k+1..]`, and column `k` stores `v_k`.
    #[inline(always)]
    fn reduce(&mut self) {
        let (n, ld) = (self.diag.len(), self.ld);
        // v, p = tau A22 v and w over the rows of a step, zero elsewhere
        let (mut v, mut p, mut w, mut next) =
            (vec![0.0; ld], vec![0.0; ld], vec![0.0; ld], vec![0.0; ld]);
        let mut tau = self.reflect(0, &mut v);
        for c in 1..n {
            p[c] = tau * dot(&self.a[c * ld..(c + 1) * ld], &v);
        }
        for k in 0..n - 1 {
            let lo = (k + 1) / LANES * LANES;
            // w = p - (tau / 2) (p . v) v; the rank-2 correction is v w^T + w v^T
            let half = 0.5 * tau * dot(&p[lo..], &v[lo..]);
            for r in lo..ld {
                w[r] = p[r] - half * v[r];
            }
            let col = k + 1;
            rank2(
                &mut self.a[col * ld + lo..(col + 1) * ld],
                &v[lo..],
                &w[lo..],
                v[col],
                w[col],
            );
            let next_tau = if k + 2 < n {
                self.reflect(k + 1, &mut next)
            } else {
                0.0
            };
            p[col] = 0.0;
            for c in k + 2..n {
                let col = &mut self.a[c * ld + lo..(c + 1) * ld];
                let (vc, wc) = (v[c], w[c]);
                rank2(col, &v[lo..], &w[lo..], vc, wc);
                p[c] = next_tau * dot(col, &next[lo..]);
            }
            self.store(k, &v);
            self.tau[k] = tau;
            tau = next_tau;
            std::mem::swap(&mut v, &mut next);
            next[lo..].iter_mut().for_each(|x| *x = 0.0);
        }
    }

    /// The reflector into `v` (zero outside rows `k + 1..n`) that takes column `k` below the
    /// diagonal to `(beta, 0, ...)`, `beta` stored as subdiagonal entry `k` of `T`; its `tau`.
    #[inline(always)]
    fn reflect(&mut self, k: usize, v: &mut [f64]) -> f64 {
        let (n, ld) = (self.diag.len(), self.ld);
        let x = &self.a[k * ld + k + 1..k * ld + n];
        let (alpha, rest) = (x[0], &x[1..]);
        let sigma: f64 = rest.iter().map(|&x| x * x).sum();
        v[k + 1] = 1.0;
        if sigma == 0.0 {
            self.offdiag[k] = alpha;
            v[k + 2..n].iter_mut().for_each(|v| *v = 0.0);
            return 0.0;
        }
        let mu = (alpha * alpha + sigma).sqrt();
        let beta = if alpha >= 0.0 { -mu } else { mu };
        let scale = 1.0 / (alpha - beta);
        for (v, &x) in v[k + 2..n].iter_mut().zip(rest) {
            *v = x * scale;
        }
        self.offdiag[k] = beta;
        (beta - alpha) / beta
    }

    /// Keeps `v_k` below row `k + 1` of column `k`.
    #[inline(always)]
    fn store(&mut self, k: usize, v: &[f64]) {
        let (n, ld) = (self.diag.len(), self.ld);
        self.a[k * ld + k + 2..k * ld + n].copy_from_slice(&v[k + 2..n]);
    }

    /// `u = H u`: the eigenvectors of `T` in the columns of `u` become those of `A`.
    pub fn apply(&self, u: MatMut<'_, f64>) {
        let n = self.diag.len();
        if n < 2 {
            return;
        }
        let essentials = MatRef::from_column_major_slice_with_stride(&self.a, n, n, self.ld)
            .submatrix(1, 0, n - 1, n - 1);
        let bs = recommended_block_size::<f64>(n, n);
        let factor = self.block_factor(essentials, bs);
        let mut mem = MemBuffer::new(
            apply_block_householder_sequence_on_the_left_in_place_scratch::<f64>(n - 1, bs, n),
        );
        apply_block_householder_sequence_on_the_left_in_place_with_conj(
            essentials,
            factor.as_ref(),
            Conj::No,
            u.subrows_mut(1, n - 1),
            Par::Seq,
            MemStack::new(&mut mem),
        );
    }

    /// The triangular factors of the blocks of `bs` reflectors, as faer's reduction leaves
    /// them: its reflectors are `I - v v^T / t` with `t = 1 / tau`. `upgrade_householder_factor`
    /// is the function faer's own reduction builds them with; it is public but left out of
    /// faer's documentation, so a faer upgrade should be checked against the reduction test.
    fn block_factor(&self, essentials: MatRef<'_, f64>, bs: usize) -> Mat<f64> {
        let n = essentials.ncols();
        let mut factor = Mat::<f64>::zeros(bs, n);
        let mut j = 0;
        while j < n {
            let b = bs.min(n - j);
            let mut block = factor.as_mut().submatrix_mut(0, j, b, b);
            for k in 0..b {
                block[(k, k)] = 1.0 / self.tau[j + k];
            }
            upgrade_householder_factor(block, essentials.submatrix(j, j, n - j, b), b, 1, Par::Seq);
            j += b;
        }
        factor
    }
}

/// One column of the rank-2 correction, `col -= v wc + w vc`, as two fused multiply-adds.
#[inline(always)]
fn rank2(col: &mut [f64], v: &[f64], w: &[f64], vc: f64, wc: f64) {
    let len = col.len();
    let (v, w) = (&v[..len], &w[..len]);
    for i in 0..len {
        col[i] = (-v[i]).mul_add(wc, (-w[i]).mul_add(vc, col[i]));
    }
}

/// `a . b` over a multiple of [`LANES`] entries by fused multiply-adds, in two sets of eight
/// partial sums (even and odd chunks) so that consecutive chunks do not wait on each other.
#[inline(always)]
fn dot(a: &[f64], b: &[f64]) -> f64 {
    let (mut acc, mut odd) = ([0.0f64; LANES], [0.0f64; LANES]);
    let (ac, bc) = (a.chunks_exact(2 * LANES), b.chunks_exact(2 * LANES));
    let (ar, br) = (ac.remainder(), bc.remainder());
    for (a, b) in ac.zip(bc) {
        let (a0, b0) = (lanes(&a[..LANES]), lanes(&b[..LANES]));
        let (a1, b1) = (lanes(&a[LANES..]), lanes(&b[LANES..]));
        for i in 0..LANES {
            acc[i] = a0[i].mul_add(b0[i], acc[i]);
            odd[i] = a1[i].mul_add(b1[i], odd[i]);
        }
    }
    if !ar.is_empty() {
        let (a, b) = (lanes(ar), lanes(br));
        for i in 0..LANES {
            acc[i] = a[i].mul_add(b[i], acc[i]);
        }
    }
    for i in 0..LANES {
        acc[i] += odd[i];
    }
    total(acc)
}

/// A chunk of [`LANES`] values as an array, which the compiler keeps in vector registers.
#[inline(always)]
fn lanes(x: &[f64]) -> &[f64; LANES] {
    x.try_into().expect("a chunk of LANES values")
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `H T H^T` gives back the matrix, and `H` is orthogonal.
    #[test]
    fn reduction_reconstructs_the_matrix() {
        for n in [1, 2, 3, 4, 8, 9, 17, 74] {
            let a = Mat::<f64>::from_fn(n, n, |i, j| {
                let d = i as f64 - j as f64;
                (-(d * d) / 8.0).exp() * (1.0 + 0.1 * ((i + j) as f64).sin())
                    + if i == j { 1.0 } else { 0.0 }
            });
            let t = Tridiagonal::new(a.as_ref()).expect("finite entries");
            let mut h = Mat::<f64>::identity(n, n);
            t.apply(h.as_mut());
            let tri = Mat::<f64>::from_fn(n, n, |i, j| match i.abs_diff(j) {
                0 => t.diag[i],
                1 => t.offdiag[i.min(j)],
                _ => 0.0,
            });
            let back = &h * &tri * h.transpose() * t.scale;
            let hth = h.transpose() * &h;
            for i in 0..n {
                for j in 0..n {
                    let err = (back[(i, j)] - a[(i, j)]).abs();
                    assert!(
                        err < 1e-14 * n as f64,
                        "n {n}: |H T H^T - A| = {err:e} at ({i}, {j})"
                    );
                    let orth = (hth[(i, j)] - if i == j { 1.0 } else { 0.0 }).abs();
                    assert!(orth < 1e-14 * n as f64, "n {n}: |H^T H - I| = {orth:e}");
                }
            }
        }
    }
}
