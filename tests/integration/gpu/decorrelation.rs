//! The decorrelation's square roots on the device, block by block: the residuals of both
//! routes on random symmetric positive definite blocks, and the polar route's flux on
//! ill-conditioned blocks against a double-double reference.

use super::*;

/// A random symmetric positive definite matrix with eigenvalues spread over `decades`.
fn random_spd(n: usize, decades: f64, rng: &mut rand::rngs::StdRng) -> Vec<f64> {
    // random orthogonal matrix by modified Gram-Schmidt
    let normal = Normal::new(0.0, 1.0).unwrap();
    let mut q: Vec<Vec<f64>> = (0..n)
        .map(|_| (0..n).map(|_| normal.sample(rng)).collect())
        .collect();
    for i in 0..n {
        for j in 0..i {
            let (head, tail) = q.split_at_mut(i);
            let (qi, qj) = (&mut tail[0], &head[j]);
            let d: f64 = qi.iter().zip(qj).map(|(a, b)| a * b).sum();
            qi.iter_mut().zip(qj).for_each(|(a, b)| *a -= d * b);
        }
        let norm = q[i].iter().map(|v| v * v).sum::<f64>().sqrt();
        q[i].iter_mut().for_each(|v| *v /= norm);
    }
    let lam: Vec<f64> = (0..n)
        .map(|i| 10f64.powf(-decades * i as f64 / (n - 1) as f64) * 3.7)
        .collect();
    let mut a = vec![0.0; n * n];
    for r in 0..n {
        for c in 0..n {
            a[r * n + c] = (0..n).map(|k| q[k][r] * lam[k] * q[k][c]).sum();
        }
    }
    for r in 0..n {
        for c in 0..r {
            let v = 0.5 * (a[r * n + c] + a[c * n + r]);
            a[r * n + c] = v;
            a[c * n + r] = v;
        }
    }
    a
}

/// Largest |entry| of the product a b of two n x n row-major matrices minus `minus` (n x n).
fn product_error(a: &[f64], b: &[f64], minus: &[f64], n: usize) -> f64 {
    let mut worst = 0f64;
    for i in 0..n {
        for k in 0..n {
            let v: f64 = (0..n).map(|l| a[i * n + l] * b[l * n + k]).sum();
            worst = worst.max((v - minus[i * n + k]).abs());
        }
    }
    worst
}

fn eye(n: usize) -> Vec<f64> {
    (0..n * n)
        .map(|i| if i / n == i % n { 1.0 } else { 0.0 })
        .collect()
}

#[test]
#[ignore = "needs an NVIDIA GPU: run with --include-ignored on a GPU machine"]
fn decorrelation_residuals_on_both_routes() {
    let mut gpu = backend();
    let mut rng = rand::rngs::StdRng::seed_from_u64(11);
    for route in [cuda::Route::Polar, cuda::Route::Jacobi] {
        gpu.set_route(route);
        for kind in [cuda::BlockKind::Covariance, cuda::BlockKind::Precision] {
            for n in [74usize, 31, 9] {
                for decades in [0.5, 4.0, 8.0] {
                    let count = 40;
                    let mats: Vec<f64> = (0..count)
                        .flat_map(|_| random_spd(n, decades, &mut rng))
                        .collect();
                    let (qs, steps) = gpu.decorrelation_batched(&mats, n, kind).unwrap();
                    let mut worst = 0f64;
                    for b in 0..count {
                        let a = &mats[b * n * n..(b + 1) * n * n];
                        let q = &qs[b * n * n..(b + 1) * n * n];
                        for i in 0..n {
                            for k in 0..i {
                                let scale = q[i * n + i].abs().max(q[k * n + k].abs());
                                assert!((q[i * n + k] - q[k * n + i]).abs() <= 1e-12 * scale);
                            }
                        }
                        worst = worst.max(match kind {
                            // Q C Q = I
                            cuda::BlockKind::Covariance => {
                                let mut qc = vec![0.0; n * n];
                                for i in 0..n {
                                    for k in 0..n {
                                        qc[i * n + k] =
                                            (0..n).map(|l| q[i * n + l] * a[l * n + k]).sum();
                                    }
                                }
                                product_error(&qc, q, &eye(n), n)
                            }
                            // Q Q = S, relative to the largest entry of S
                            cuda::BlockKind::Precision => {
                                let smax = a.iter().fold(0f64, |m, v| m.max(v.abs()));
                                product_error(q, q, a, n) / smax
                            }
                        });
                    }
                    let max_steps = steps.iter().copied().max().unwrap_or(0);
                    say(&format!(
                        "{route:?} {kind:?} n {n}, condition 1e{decades}: residual {worst:.2e}, polar steps at most {max_steps}"
                    ));
                    match route {
                        cuda::Route::Polar => assert!(
                            steps.iter().all(|&s| s > 0),
                            "the polar route gave up on a well-posed block: {steps:?}"
                        ),
                        cuda::Route::Jacobi => assert!(steps.iter().all(|&s| s == 0)),
                    }
                    let bound = match kind {
                        cuda::BlockKind::Covariance => 1e-9 * 10f64.powf(decades / 2.0).max(1.0),
                        cuda::BlockKind::Precision => 1e-12,
                    };
                    assert!(worst < bound, "residual {worst} over {bound}");
                }
            }
        }
    }
    gpu.set_route(cuda::Route::Polar);
}

/// Extended-precision (double-double) references of the decorrelation.
mod reference {
    use twofloat::TwoFloat;

    type Dd = TwoFloat;

    fn dd(v: f64) -> Dd {
        Dd::from(v)
    }

    /// Eigenvalues and eigenvectors (columns of V, row-major) of a symmetric matrix by cyclic
    /// Jacobi in double-double: accurate far beyond f64 for any conditioning.
    pub fn eigh(a: &[f64], n: usize) -> (Vec<Dd>, Vec<Dd>) {
        let mut a: Vec<Dd> = a.iter().map(|&v| dd(v)).collect();
        let mut v: Vec<Dd> = (0..n * n)
            .map(|i| dd(if i / n == i % n { 1.0 } else { 0.0 }))
            .collect();
        for _sweep in 0..40 {
            let mut rotated = false;
            for p in 0..n {
                for q in p + 1..n {
                    let apq = a[p * n + q];
                    let scale = (a[p * n + p] * a[q * n + q]).abs().sqrt();
                    if apq.abs() <= scale * 1e-31 || apq == dd(0.0) {
                        continue;
                    }
                    rotated = true;
                    let theta = (a[q * n + q] - a[p * n + p]) / (apq * 2.0);
                    let mut t = dd(1.0) / (theta.abs() + (theta * theta + 1.0).sqrt());
                    if theta < dd(0.0) {
                        t = -t;
                    }
                    let c = dd(1.0) / (t * t + 1.0).sqrt();
                    let s = t * c;
                    for k in 0..n {
                        let (akp, akq) = (a[k * n + p], a[k * n + q]);
                        a[k * n + p] = c * akp - s * akq;
                        a[k * n + q] = s * akp + c * akq;
                    }
                    for k in 0..n {
                        let (apk, aqk) = (a[p * n + k], a[q * n + k]);
                        a[p * n + k] = c * apk - s * aqk;
                        a[q * n + k] = s * apk + c * aqk;
                    }
                    for k in 0..n {
                        let (vkp, vkq) = (v[k * n + p], v[k * n + q]);
                        v[k * n + p] = c * vkp - s * vkq;
                        v[k * n + q] = s * vkp + c * vkq;
                    }
                }
            }
            if !rotated {
                break;
            }
        }
        ((0..n).map(|i| a[i * n + i]).collect(), v)
    }

    /// V f(Lambda) V^T.
    pub fn spectral(lam: &[Dd], v: &[Dd], n: usize, f: impl Fn(Dd) -> Dd) -> Vec<Dd> {
        let fl: Vec<Dd> = lam.iter().map(|&l| f(l)).collect();
        let mut out = vec![dd(0.0); n * n];
        for i in 0..n {
            for k in 0..n {
                let mut s = dd(0.0);
                for l in 0..n {
                    s += v[i * n + l] * fl[l] * v[k * n + l];
                }
                out[i * n + k] = s;
            }
        }
        out
    }

    /// Flux (Q x)_j / rowsum_j and rowsum_j (= 1 / sigma_j) of every row.
    pub fn flux(q: &[Dd], x: &[f64], n: usize) -> Vec<(Dd, Dd)> {
        (0..n)
            .map(|j| {
                let mut num = dd(0.0);
                let mut norm = dd(0.0);
                for k in 0..n {
                    num += q[j * n + k] * x[k];
                    norm += q[j * n + k];
                }
                (num / norm, norm)
            })
            .collect()
    }

    pub fn to_f64(v: Dd) -> f64 {
        v.hi() + v.lo()
    }
}

/// Largest flux error, in sigma, of the decorrelation `q` (f64, row-major) against the
/// reference fluxes of `x`.
fn flux_error_sigma(
    q: &[f64],
    x: &[f64],
    reference: &[(twofloat::TwoFloat, twofloat::TwoFloat)],
) -> f64 {
    let n = x.len();
    (0..n)
        .map(|j| {
            let row = &q[j * n..(j + 1) * n];
            let norm: f64 = row.iter().sum();
            let f = row.iter().zip(x).map(|(a, b)| a * b).sum::<f64>() / norm;
            let (fr, nr) = reference[j];
            ((f - reference::to_f64(fr)) * reference::to_f64(nr)).abs()
        })
        .fold(0f64, f64::max)
}

#[test]
#[ignore = "needs an NVIDIA GPU: run with --include-ignored on a GPU machine"]
fn polar_route_is_accurate_on_ill_conditioned_blocks() {
    // Precision blocks S = C^-1 of order 74 whose condition numbers reach 1e8-1e10 the way a
    // patch's do: a well-conditioned core with a few bins of almost no weight (masked pixels).
    let mut gpu = backend();
    let mut rng = rand::rngs::StdRng::seed_from_u64(29);
    let normal = Normal::new(0.0, 1.0).unwrap();
    let n = 74;
    let mut blocks = Vec::new();
    for (decades, masked, weight) in [
        (3.0, 2, 3e-3),
        (4.0, 3, 1e-3),
        (4.0, 5, 3e-4),
        (5.0, 3, 1e-3),
    ] {
        let mut s = random_spd(n, decades, &mut rng);
        let bins: Vec<usize> = (0..masked).map(|k| 10 + 17 * k).collect();
        for i in 0..n {
            for k in 0..n {
                let di = if bins.contains(&i) { weight } else { 1.0 };
                let dk = if bins.contains(&k) { weight } else { 1.0 };
                s[i * n + k] *= di * dk;
            }
        }
        blocks.push(s);
    }
    let mats: Vec<f64> = blocks.concat();
    let (q_polar, steps) = gpu
        .decorrelation_batched(&mats, n, cuda::BlockKind::Precision)
        .unwrap();
    gpu.set_route(cuda::Route::Jacobi);
    let (q_jacobi, _) = gpu
        .decorrelation_batched(&mats, n, cuda::BlockKind::Precision)
        .unwrap();
    gpu.set_route(cuda::Route::Polar);
    let mut worst_cond = 0f64;
    for (b, s) in blocks.iter().enumerate() {
        let (lam, v) = reference::eigh(s, n);
        let (lo, hi) = lam.iter().fold((f64::MAX, 0f64), |(lo, hi), &l| {
            let l = reference::to_f64(l);
            (lo.min(l), hi.max(l))
        });
        let cond = hi / lo;
        worst_cond = worst_cond.max(cond);
        let q_ref = reference::spectral(&lam, &v, n, |l| l.sqrt());
        // a spectrum with a signal to noise of about 100 per bin
        let sigma: Vec<f64> = reference::flux(&q_ref, &vec![0.0; n], n)
            .iter()
            .map(|&(_, norm)| 1.0 / reference::to_f64(norm))
            .collect();
        let mut sorted = sigma.clone();
        sorted.sort_by(f64::total_cmp);
        let typical = sorted[n / 2];
        let x: Vec<f64> = (0..n)
            .map(|_| 100.0 * typical * (1.0 + 0.3 * normal.sample(&mut rng)))
            .collect();
        let fref = reference::flux(&q_ref, &x, n);
        let block = b * n * n..(b + 1) * n * n;
        let e_polar = flux_error_sigma(&q_polar[block.clone()], &x, &fref);
        let e_jacobi = flux_error_sigma(&q_jacobi[block], &x, &fref);
        say(&format!(
            "block {b}: condition {cond:.1e}, polar steps {}: flux error {e_polar:.1e} sigma (Jacobi {e_jacobi:.1e} sigma)",
            steps[b]
        ));
        assert!(steps[b] > 0, "the polar route gave up on block {b}");
        assert!(
            e_polar <= 1e-10,
            "block {b}: polar flux off by {e_polar} sigma"
        );
    }
    assert!(
        worst_cond >= 1e8,
        "the blocks are not ill-conditioned: {worst_cond:.1e}"
    );
}
