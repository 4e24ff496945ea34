//! The Schur-complement route of a patch solve: two block sweeps over the fibers of a
//! block-tridiagonal `icov` give the flux `xflux = icov^-1 y` and, for every core fiber `b`,
//! the Schur complement `S_b = C_bb^-1` of its block, without forming any inverse.
//!
//! In the fibers' order along the CCD, the forward sweep factors `icov = L L^T` block by block:
//! `Sigma_0 = A_00`, `Sigma_{k+1} = A_{k+1,k+1} - W^T W` with `W = L_k^-1 A_{k,k+1}` and
//! `L_k = chol(Sigma_k)`. `Sigma_k` is the Schur complement of the fibers left of `k`; the
//! backward sweep gives the mirror `Sigma'_k`, and `S_b = Sigma_b + Sigma'_b - A_bb`. For 7
//! fibers of 74 bins this is about a tenth of the work of a dense Cholesky factorisation plus
//! the core block of the inverse.

use faer::linalg::matmul::matmul;
use faer::linalg::matmul::triangular::{matmul as tri_matmul, BlockStructure};
use faer::linalg::triangular_solve::solve_lower_triangular_in_place;
use faer::{Accum, Mat, Par};

use super::cholesky::cholesky;
use super::dense::{column, column_mut};
use super::system::NormalEquations;
use crate::extract::PatchGeometry;

/// The flux and the core fibers' Schur complements.
pub(super) struct Sweeps {
    /// `icov^-1 y`, in the order of the unknowns.
    pub xflux: Vec<f64>,
    /// `S_b = C_bb^-1` of each core fiber, in the geometry's core order; on the lower
    /// triangle only (the upper one is left over from the sweeps).
    pub schur: Vec<Mat<f64>>,
}

/// Columns of `W` taken together by [`eliminate`].
const PANEL: usize = 16;

/// `W = L^-1 B` for a lower-triangular `L` (upper triangle zero), in place of `B` in `w`, and
/// `sigma -= W^T W` on the lower triangle.
///
/// `B` is a coupling of neighbouring fibers: bin `j` of one fiber overlaps only the bins of
/// the other within a spot's height, so column `j` of `B` is zero above a row close to `j`,
/// and so is column `j` of `W` (forward substitution of zeros). The columns go by panels of
/// [`PANEL`], each solved below its first nonzero row only, and the products of `W^T W` skip
/// those zero rows too.
fn eliminate(l: &Mat<f64>, w: &mut Mat<f64>, sigma: &mut Mat<f64>) {
    let (n, m) = (w.nrows(), w.ncols());
    // first row of each panel that may be nonzero
    let panels: Vec<(usize, usize, usize)> = (0..m)
        .step_by(PANEL)
        .map(|c0| {
            let c1 = (c0 + PANEL).min(m);
            let r0 = (c0..c1)
                .map(|j| {
                    super::dense::column(w, j)
                        .iter()
                        .position(|&v| v != 0.0)
                        .unwrap_or(n)
                })
                .min()
                .unwrap_or(n);
            (c0, c1, r0)
        })
        .collect();
    for &(c0, c1, r0) in &panels {
        if r0 < n {
            solve_lower_triangular_in_place(
                l.as_ref().submatrix(r0, r0, n - r0, n - r0),
                w.as_mut().submatrix_mut(r0, c0, n - r0, c1 - c0),
                Par::Seq,
            );
        }
    }
    for &(c0, c1, r0) in &panels {
        if r0 >= n {
            continue;
        }
        let rows = n - r0;
        let wp = w.as_ref().submatrix(r0, c0, rows, c1 - c0);
        if c0 > 0 {
            matmul(
                sigma.as_mut().submatrix_mut(c0, 0, c1 - c0, c0),
                Accum::Add,
                wp.transpose(),
                w.as_ref().submatrix(r0, 0, rows, c0),
                -1.0,
                Par::Seq,
            );
        }
        tri_matmul(
            sigma.as_mut().submatrix_mut(c0, c0, c1 - c0, c1 - c0),
            BlockStructure::TriangularLower,
            Accum::Add,
            wp.transpose(),
            BlockStructure::Rectangular,
            wp,
            BlockStructure::Rectangular,
            -1.0,
            Par::Seq,
        );
    }
}

/// Runs both sweeps on the regularised blocks (`prior` added to the diagonal); `None` when a
/// block is not numerically positive definite.
pub(super) fn solve(ne: &NormalEquations, prior: &[f64], geom: &PatchGeometry) -> Option<Sweeps> {
    let (nt, nb) = (ne.nt, ne.order.len());
    let is_core: Vec<bool> = ne.order.iter().map(|&b| b >= geom.npad).collect();
    let prior_of = |k: usize| &prior[ne.order[k] * nt..(ne.order[k] + 1) * nt];

    // Forward sweep: the block Cholesky factor, and the left Schur complements of the core
    // fibers, which become their `S`.
    let mut l: Vec<Mat<f64>> = Vec::with_capacity(nb);
    let mut wt: Vec<Mat<f64>> = Vec::with_capacity(nb.saturating_sub(1));
    let mut schur: Vec<Option<Mat<f64>>> = vec![None; nb];
    for k in 0..nb {
        let mut sigma = regularised(&ne.diag[k], prior_of(k));
        if k > 0 {
            let mut w = ne.sub[k - 1].transpose().to_owned();
            eliminate(&l[k - 1], &mut w, &mut sigma);
            wt.push(w);
        }
        if is_core[k] {
            schur[k] = Some(sigma.clone());
        }
        cholesky(&mut sigma).ok()?;
        l.push(sigma);
    }

    // Backward sweep, as far as the leftmost core fiber: each right Schur complement goes
    // into its fiber's `S` as soon as it is known.
    let kmin = is_core.iter().position(|&c| c)?;
    let mut sigma = regularised(&ne.diag[nb - 1], prior_of(nb - 1));
    let mut w = Mat::<f64>::zeros(nt, nt);
    for k in (kmin..nb).rev() {
        if let Some(s) = &mut schur[k] {
            combine(s, &sigma, &ne.diag[k], prior_of(k));
        }
        if k == kmin {
            break;
        }
        cholesky(&mut sigma).ok()?;
        let mut next = regularised(&ne.diag[k - 1], prior_of(k - 1));
        w.copy_from(&ne.sub[k - 1]);
        eliminate(&sigma, &mut w, &mut next);
        sigma = next;
    }

    let mut out = vec![Mat::<f64>::zeros(0, 0); geom.ncore()];
    for (k, s) in schur.into_iter().enumerate() {
        if let Some(s) = s {
            out[ne.order[k] - geom.npad] = s;
        }
    }
    Some(Sweeps {
        xflux: flux(ne, &l, &wt),
        schur: out,
    })
}

/// A diagonal block of `icov` with the prior added to its diagonal.
fn regularised(d: &Mat<f64>, prior: &[f64]) -> Mat<f64> {
    let mut a = d.clone();
    for (w, &p) in prior.iter().enumerate() {
        a[(w, w)] += p;
    }
    a
}

/// `S = Sigma + Sigma' - A` on the lower triangle, in place of `Sigma`; `A` is the block `d`
/// of `icov` plus the prior on its diagonal (added first, as [`regularised`] does).
fn combine(s: &mut Mat<f64>, right: &Mat<f64>, d: &Mat<f64>, prior: &[f64]) {
    for (j, &p) in prior.iter().enumerate() {
        let (r, a) = (&column(right, j)[j..], &column(d, j)[j..]);
        let out = &mut column_mut(s, j)[j..];
        out[0] = out[0] + r[0] - (a[0] + p);
        for ((o, &r), &a) in out.iter_mut().zip(r).zip(a).skip(1) {
            *o = *o + r - a;
        }
    }
}

/// `icov^-1 y` from the block factor: `L z = y` forward, `L^T x = z` backward.
fn flux(ne: &NormalEquations, l: &[Mat<f64>], wt: &[Mat<f64>]) -> Vec<f64> {
    let nt = ne.nt;
    let nb = l.len();
    let block = |k: usize| Mat::<f64>::from_fn(nt, 1, |i, _| ne.y[ne.order[k] * nt + i]);
    let mut z: Vec<Mat<f64>> = Vec::with_capacity(nb);
    for k in 0..nb {
        let mut zk = block(k);
        if k > 0 {
            faer::linalg::matmul::matmul(
                zk.as_mut(),
                Accum::Add,
                wt[k - 1].transpose(),
                z[k - 1].as_ref(),
                -1.0,
                Par::Seq,
            );
        }
        solve_lower_triangular_in_place(l[k].as_ref(), zk.as_mut(), Par::Seq);
        z.push(zk);
    }
    let mut xflux = vec![0.0; ne.nunknowns()];
    let mut next: Option<Mat<f64>> = None;
    for k in (0..nb).rev() {
        let mut xk = z[k].clone();
        if let Some(xn) = &next {
            faer::linalg::matmul::matmul(
                xk.as_mut(),
                Accum::Add,
                wt[k].as_ref(),
                xn.as_ref(),
                -1.0,
                Par::Seq,
            );
        }
        faer::linalg::triangular_solve::solve_upper_triangular_in_place(
            l[k].transpose(),
            xk.as_mut(),
            Par::Seq,
        );
        let o = ne.order[k] * nt;
        for i in 0..nt {
            xflux[o + i] = xk[(i, 0)];
        }
        next = Some(xk);
    }
    xflux
}
