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
    /// `S_b = C_bb^-1` of each core fiber, in the geometry's core order; full symmetric.
    pub schur: Vec<Mat<f64>>,
}

/// Columns of `W` taken together by [`eliminate`].
const PANEL: usize = 16;

/// `W = L^-1 B` for a lower-triangular `L` (upper triangle zero), and `sigma -= W^T W` on the
/// lower triangle; returns `W`.
///
/// `B` is a coupling of neighbouring fibers: bin `j` of one fiber overlaps only the bins of
/// the other within a spot's height, so column `j` of `B` is zero above a row close to `j`,
/// and so is column `j` of `W` (forward substitution of zeros). The columns go by panels of
/// [`PANEL`], each solved below its first nonzero row only, and the products of `W^T W` skip
/// those zero rows too.
fn eliminate(l: &Mat<f64>, b: Mat<f64>, sigma: &mut Mat<f64>) -> Mat<f64> {
    let (n, m) = (b.nrows(), b.ncols());
    let mut w = b;
    // first row of each panel that may be nonzero
    let panels: Vec<(usize, usize, usize)> = (0..m)
        .step_by(PANEL)
        .map(|c0| {
            let c1 = (c0 + PANEL).min(m);
            let r0 = (c0..c1)
                .map(|j| {
                    super::dense::column(&w, j)
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
    w
}

/// Runs both sweeps on the regularised blocks (`prior` added to the diagonal); `None` when a
/// block is not numerically positive definite.
pub(super) fn solve(ne: &NormalEquations, prior: &[f64], geom: &PatchGeometry) -> Option<Sweeps> {
    let nt = ne.nt;
    let nb = ne.order.len();
    let a: Vec<Mat<f64>> = ne
        .order
        .iter()
        .zip(&ne.diag)
        .map(|(&b, d)| {
            let mut d = d.clone();
            for w in 0..nt {
                d[(w, w)] += prior[b * nt + w];
            }
            d
        })
        .collect();
    let is_core: Vec<bool> = ne.order.iter().map(|&b| b >= geom.npad).collect();

    // Forward sweep: the block Cholesky factor and the left Schur complements.
    let mut l: Vec<Mat<f64>> = Vec::with_capacity(nb);
    let mut wt: Vec<Mat<f64>> = Vec::with_capacity(nb.saturating_sub(1));
    let mut left: Vec<Option<Mat<f64>>> = vec![None; nb];
    for k in 0..nb {
        let mut sigma = a[k].clone();
        if k > 0 {
            let w = eliminate(&l[k - 1], ne.sub[k - 1].transpose().to_owned(), &mut sigma);
            wt.push(w);
        }
        if is_core[k] {
            left[k] = Some(sigma.clone());
        }
        cholesky(&mut sigma).ok()?;
        l.push(sigma);
    }

    // Backward sweep, as far as the leftmost core fiber: the right Schur complements.
    let kmin = is_core.iter().position(|&c| c)?;
    let mut right: Vec<Option<Mat<f64>>> = vec![None; nb];
    let mut sigma = a[nb - 1].clone();
    for k in (kmin..nb).rev() {
        if is_core[k] {
            right[k] = Some(sigma.clone());
        }
        if k == kmin {
            break;
        }
        cholesky(&mut sigma).ok()?;
        let l = sigma;
        sigma = a[k - 1].clone();
        eliminate(&l, ne.sub[k - 1].to_owned(), &mut sigma);
    }

    let mut schur = vec![Mat::<f64>::zeros(0, 0); geom.ncore()];
    for k in 0..nb {
        if let (Some(sl), Some(sr)) = (&left[k], &right[k]) {
            schur[ne.order[k] - geom.npad] = combine(sl, sr, &a[k]);
        }
    }
    Some(Sweeps {
        xflux: flux(ne, &l, &wt),
        schur,
    })
}

/// `S = Sigma + Sigma' - A` from the lower triangles, mirrored into a full symmetric matrix.
fn combine(sl: &Mat<f64>, sr: &Mat<f64>, a: &Mat<f64>) -> Mat<f64> {
    let nt = a.nrows();
    let mut s = Mat::<f64>::zeros(nt, nt);
    let (cl, cr, ca) = (columns(sl), columns(sr), columns(a));
    for j in 0..nt {
        let out = column_mut(&mut s, j);
        // above the diagonal: row j of the lower triangles, the same sums as below it
        for (i, o) in out[..j].iter_mut().enumerate() {
            *o = cl[i][j] + cr[i][j] - ca[i][j];
        }
        let (l, r, a) = (&cl[j][j..], &cr[j][j..], &ca[j][j..]);
        for (((o, &l), &r), &a) in out[j..].iter_mut().zip(l).zip(r).zip(a) {
            *o = l + r - a;
        }
    }
    s
}

/// The columns of a matrix made by faer, as slices.
fn columns(m: &Mat<f64>) -> Vec<&[f64]> {
    (0..m.ncols()).map(|j| column(m, j)).collect()
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
