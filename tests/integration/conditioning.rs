//! Accuracy of the CPU solve on ill-conditioned fiber blocks: a patch with masked pixels under
//! a few bins, whose covariance blocks reach condition numbers of 1e8-1e10, against the same
//! solve in double-double arithmetic (about 32 digits) from the same f64 normal equations.
//!
//! The tolerance follows from the route: through the polar factor of `chol(S_b)` the flux is
//! off by about `u sqrt(cond) |x|` sigma, with `u` the f64 unit roundoff and `|x| ~ sqrt(nt)`
//! the size of the noise of the deconvolved flux block in units of its covariance; through the
//! eigendecomposition of `S_b` (blocks with `cond <= EIGEN_MAX_COND`) by about `u cond |x| / 2`.
//! For `cond <= 1e10` and `nt = 74` both stay below the 1e-10 sigma that the extraction
//! promises.

use crate::common::*;
use rand::SeedableRng;
use rand_distr::{Distribution, Normal};
use spex::backend::cpu::{normal_equations, prior, solve_patch, EIGEN_MAX_COND};
use spex::extract::{PatchStatus, SolveOptions};
use spex::plan::{Plan, PlanOptions};
use twofloat::TwoFloat;

type Dd = TwoFloat;

fn dd(v: f64) -> Dd {
    Dd::from(v)
}

/// Lower Cholesky factor of a symmetric positive definite matrix, `[row][col]`.
fn cholesky(a: &[Vec<Dd>]) -> Vec<Vec<Dd>> {
    let n = a.len();
    let mut l = vec![vec![dd(0.0); n]; n];
    for j in 0..n {
        let mut d = a[j][j];
        for k in 0..j {
            d -= l[j][k] * l[j][k];
        }
        assert!(d > 0.0, "reference Cholesky: pivot {j} is not positive");
        let d = d.sqrt();
        l[j][j] = d;
        for i in j + 1..n {
            let mut s = a[i][j];
            for k in 0..j {
                s -= l[i][k] * l[j][k];
            }
            l[i][j] = s / d;
        }
    }
    l
}

/// `icov^-1 y` from its Cholesky factor.
fn solve(l: &[Vec<Dd>], y: &[Dd]) -> Vec<Dd> {
    let n = l.len();
    let mut z = y.to_vec();
    for i in 0..n {
        for k in 0..i {
            let zk = z[k];
            z[i] -= l[i][k] * zk;
        }
        z[i] /= l[i][i];
    }
    for i in (0..n).rev() {
        for k in i + 1..n {
            let zk = z[k];
            z[i] -= l[k][i] * zk;
        }
        z[i] /= l[i][i];
    }
    z
}

/// The diagonal blocks `C_bb` of `icov^-1` for the blocks from `k0` on (the trailing ones), of
/// size `nt`: with `X = L_22^-1`, `C_22 = X^T X`.
fn trailing_blocks(l: &[Vec<Dd>], k0: usize, nt: usize) -> Vec<Vec<Vec<Dd>>> {
    let n = l.len();
    let mc = n - k0;
    // X = L_22^-1, lower triangular, column by column
    let mut x = vec![vec![dd(0.0); mc]; mc];
    for j in 0..mc {
        x[j][j] = dd(1.0) / l[k0 + j][k0 + j];
        for i in j + 1..mc {
            let mut s = dd(0.0);
            for k in j..i {
                s += l[k0 + i][k0 + k] * x[k][j];
            }
            x[i][j] = -s / l[k0 + i][k0 + i];
        }
    }
    (0..mc / nt)
        .map(|b| {
            let o = b * nt;
            let mut c = vec![vec![dd(0.0); nt]; nt];
            for i in 0..nt {
                for j in 0..=i {
                    let mut s = dd(0.0);
                    for k in o + i.max(j)..mc {
                        s += x[k][o + i] * x[k][o + j];
                    }
                    c[i][j] = s;
                    c[j][i] = s;
                }
            }
            c
        })
        .collect()
}

/// Eigenvalues and eigenvectors (columns of `v`) of a symmetric matrix by cyclic Jacobi,
/// iterated until every off-diagonal entry is below 1e-30 of the geometric mean of its
/// diagonal entries (Jacobi's relative accuracy on graded matrices).
fn jacobi(a: &[Vec<Dd>]) -> (Vec<Dd>, Vec<Vec<Dd>>) {
    let n = a.len();
    let mut a = a.to_vec();
    let mut v: Vec<Vec<Dd>> = (0..n)
        .map(|i| (0..n).map(|j| dd(if i == j { 1.0 } else { 0.0 })).collect())
        .collect();
    for _sweep in 0..40 {
        let mut rotated = false;
        for p in 0..n {
            for q in p + 1..n {
                let apq = a[p][q];
                if apq.abs() <= (a[p][p] * a[q][q]).abs().sqrt() * 1e-30 {
                    continue;
                }
                rotated = true;
                let theta = (a[q][q] - a[p][p]) / (dd(2.0) * apq);
                let t = dd(theta.signum().hi()) / (theta.abs() + (theta * theta + 1.0).sqrt());
                let c = dd(1.0) / (t * t + 1.0).sqrt();
                let s = t * c;
                for k in 0..n {
                    let (akp, akq) = (a[k][p], a[k][q]);
                    a[k][p] = c * akp - s * akq;
                    a[k][q] = s * akp + c * akq;
                }
                for k in 0..n {
                    let (apk, aqk) = (a[p][k], a[q][k]);
                    a[p][k] = c * apk - s * aqk;
                    a[q][k] = s * apk + c * aqk;
                }
                for row in v.iter_mut() {
                    let (vp, vq) = (row[p], row[q]);
                    row[p] = c * vp - s * vq;
                    row[q] = s * vp + c * vq;
                }
            }
        }
        if !rotated {
            return ((0..n).map(|i| a[i][i]).collect(), v);
        }
    }
    panic!("reference Jacobi did not converge");
}

/// A patch of 7 fibers x 74 bins with 100 photons per bin plus noise, read noise 3 e-, and
/// the pixels under a few bins of two core fibers masked.
#[test]
fn ill_conditioned_blocks_match_a_double_double_reference() {
    let psf = psf_a();
    let plan = Plan::new(PlanOptions::new(6000.0, 6400.0, 0.8, 0, 25)).unwrap();
    let spots = psf.spots(0..25, &plan.fullwave);
    let patch = plan
        .patches
        .iter()
        .find(|p| p.fibers.start == 10 && p.waves.start == 100)
        .unwrap()
        .clone();
    let mut image = blank_image(&psf);
    add_spots(&mut image, &psf, 0..25, &plan.fullwave, |_, _| 100.0);
    let mut rng = rand::rngs::StdRng::seed_from_u64(7);
    let unit = Normal::new(0.0, 1.0).unwrap();
    for (p, iv) in image.pix.iter_mut().zip(image.ivar.iter_mut()) {
        let var = p.max(0.0) as f64 + 9.0;
        *p += (var.sqrt() * unit.sample(&mut rng)) as f32;
        *iv = (1.0 / var) as f32;
    }
    // mask the rows under bins 30-31 of the patch, over core fibers 12 and 13
    let c = &spots.corners;
    let w = plan.patch_waves(&patch).start + 30;
    let (x12, y12) = c.corner(12, w);
    let (x13, _) = c.corner(13, w);
    for y in y12 as usize + 1..y12 as usize + c.ny {
        for x in x12 as usize..x13 as usize + c.nx {
            image.ivar[[y, x]] = 0.0;
        }
    }

    let options = SolveOptions {
        regularize: 0.0,
        psferr: 0.01,
        model: false,
        reject_outliers: None,
    };
    let result = solve_patch(&plan, &patch, &spots, &image, &options);
    assert_eq!(result.status, PatchStatus::Ok);

    // the reference, from the same f64 normal equations
    let (geom, ne) = normal_equations(&plan, &patch, &spots, &image).unwrap();
    let prior = prior(&ne.fluxweight, options.regularize).unwrap();
    let icov = ne.dense();
    let m = ne.nunknowns();
    let a: Vec<Vec<Dd>> = (0..m)
        .map(|i| {
            (0..m)
                .map(|j| dd(icov[(i, j)]) + if i == j { dd(prior[i]) } else { dd(0.0) })
                .collect()
        })
        .collect();
    let l = cholesky(&a);
    let y: Vec<Dd> = ne.y.iter().map(|&v| dd(v)).collect();
    let xflux = solve(&l, &y);
    let nt = geom.nwavetot;
    let blocks = trailing_blocks(&l, geom.npad * nt, nt);

    let (p0, nk) = (plan.wavepad, patch.waves.len());
    let mut worst_cond: f64 = 0.0;
    for (cf, cb) in blocks.iter().enumerate() {
        let (lam, v) = jacobi(cb);
        let (lo, hi) = lam.iter().fold((f64::MAX, 0.0f64), |(lo, hi), l| {
            (lo.min(l.hi()), hi.max(l.hi()))
        });
        let cond = hi / lo;
        worst_cond = worst_cond.max(cond);
        let xb = &xflux[(geom.npad + cf) * nt..(geom.npad + cf + 1) * nt];
        // Q = C^-1/2 = V diag(lam^-1/2) V^T; flux_j = (Q x)_j / (Q 1)_j, sigma_j = 1 / (Q 1)_j
        let w: Vec<Vec<Dd>> = v
            .iter()
            .map(|row| row.iter().zip(&lam).map(|(&e, &l)| e / l.sqrt()).collect())
            .collect();
        let tol = f64::EPSILON / 2.0
            * (nt as f64).sqrt()
            * if cond <= EIGEN_MAX_COND {
                cond / 2.0
            } else {
                cond.sqrt()
            };
        assert!(
            tol <= 1e-10,
            "fiber {cf}: cond {cond:.2e} is outside the tested range"
        );
        for j in 0..nk {
            let row = p0 + j;
            let (mut qx, mut q1) = (dd(0.0), dd(0.0));
            for k in 0..nt {
                let mut q = dd(0.0);
                for (e, wk) in v[row].iter().zip(&w[k]) {
                    q += *e * *wk;
                }
                qx += q * xb[k];
                q1 += q;
            }
            let flux = qx / q1;
            let got = result.flux[cf * nk + j];
            let err = ((dd(got) - flux) * q1).abs().hi();
            assert!(
                err <= tol,
                "fiber {cf} bin {j}: flux {got} vs {} off by {err:.2e} sigma (tolerance {tol:.2e}, cond {cond:.2e})",
                flux.hi()
            );
        }
    }
    assert!(
        (1e8..=1e10).contains(&worst_cond),
        "the masked bins should give a block of condition 1e8-1e10, not {worst_cond:.2e}"
    );
}
