//! The CPU backend: the reference implementation of the patch solve, in f64, one patch per
//! thread (rayon), sequential dense linear algebra (faer) inside a patch so that results do not
//! depend on the number of threads.
//!
//! For one patch with pixel values `p`, weights `ivar` and projection matrix `A` (one column per
//! fiber and padded wavelength bin):
//! 1. `icov = A^T diag(ivar) A`, `y = A^T diag(ivar) p`, `fluxweight = A^T ivar`;
//! 2. `icov += diag(alpha^2 + 1e-15)` with `alpha = minweight - fluxweight` where
//!    `fluxweight < minweight = 1e-4 max(fluxweight)`, else `regularize`;
//! 3. `icov = L L^T` (Cholesky), `xflux = icov^-1 y`;
//! 4. for each core fiber block `b`, `C_b = (icov^-1)_bb`, `Q_b = C_b^(-1/2)`, `s = Q_b 1`,
//!    `R_b = diag(s)^-1 Q_b`, `ivar = s^2`, `flux = R_b xflux_b`;
//! 5. pixmask fraction, chi2pix and the optional model from `A`, `xflux` and `flux`.
//!
//! With the core fibers ordered last, `C_bb` of the core only needs the trailing block of `L`:
//! `(icov^-1)_core = L_22^-T L_22^-1`.

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use faer::diag::Diag;
use faer::dyn_stack::{MemBuffer, MemStack};
use faer::linalg::cholesky::llt::factor::{
    cholesky_in_place, cholesky_in_place_scratch, LltRegularization,
};
use faer::linalg::evd::{self_adjoint_evd, self_adjoint_evd_scratch, ComputeEigenvectors};
use faer::linalg::matmul::matmul;
use faer::linalg::triangular_inverse::invert_lower_triangular;
use faer::linalg::triangular_solve::{
    solve_lower_triangular_in_place, solve_upper_triangular_in_place,
};
use faer::{Accum, Mat, MatRef, Par};
use rayon::prelude::*;

use crate::backend::{Backend, FrameInput, Progress};
use crate::error::{Error, Result};
use crate::extract::{ModelPatch, PatchGeometry, PatchResult, PatchStatus, SolveOptions};
use crate::image::Image;
use crate::plan::{Patch, Plan};
use crate::psf::Spots;

/// Regularisation of the retry after a failed Cholesky factorisation (gpu_specter's value).
pub const RETRY_REGULARIZE: f64 = 1e-4;
/// Eigenvalues below this fraction of the largest are clipped to it.
pub const EIGEN_CLIP: f64 = 1e-14;

/// Solves patches on CPU threads.
pub struct CpuBackend {
    pool: rayon::ThreadPool,
    threads: usize,
}

impl CpuBackend {
    /// A backend with `threads` worker threads (0: all available cores).
    pub fn new(threads: usize) -> Result<Self> {
        let pool = rayon::ThreadPoolBuilder::new()
            .num_threads(threads)
            .thread_name(|i| format!("spex-cpu-{i}"))
            .build()
            .map_err(|e| Error::config(format!("cannot start {threads} threads: {e}")))?;
        let threads = pool.current_num_threads();
        Ok(CpuBackend { pool, threads })
    }
}

impl Backend for CpuBackend {
    fn describe(&self) -> String {
        format!("cpu ({} threads)", self.threads)
    }

    fn sibling(&self) -> Result<Box<dyn Backend>> {
        Ok(Box::new(CpuBackend::new(self.threads)?))
    }

    fn extract(
        &mut self,
        input: FrameInput<'_>,
        patches: &[Patch],
        progress: &Progress,
    ) -> Result<Vec<PatchResult>> {
        // Spots are evaluated once per bundle: every patch lies inside one bundle.
        let mut by_bundle: BTreeMap<usize, Vec<usize>> = BTreeMap::new();
        for (i, p) in patches.iter().enumerate() {
            by_bundle.entry(p.bundle_start).or_default().push(i);
        }
        let mut results: Vec<Option<PatchResult>> = vec![None; patches.len()];
        let (mut spot_time, mut solve_time) = (Duration::ZERO, Duration::ZERO);
        self.pool.install(|| {
            for (&start, members) in &by_bundle {
                let _span = tracing::debug_span!("bundle", start).entered();
                // Only the fibers these patches solve: a rank may hold part of a bundle.
                let lo = members
                    .iter()
                    .map(|&i| patches[i].padded_fibers.start)
                    .min()
                    .unwrap_or(start);
                let hi = members
                    .iter()
                    .map(|&i| patches[i].padded_fibers.end)
                    .max()
                    .unwrap_or(start);
                let fibers = lo..hi;
                let t0 = Instant::now();
                let spots = {
                    let _range = nvtx::LocalRange::new(c"spots");
                    input.psf.spots(fibers, &input.plan.fullwave)
                };
                let t1 = Instant::now();
                spot_time += t1 - t0;
                let _range = nvtx::LocalRange::new(c"solve patches");
                let solved: Vec<(usize, PatchResult)> = members
                    .par_iter()
                    .map(|&i| {
                        let r = solve_patch(
                            input.plan,
                            &patches[i],
                            &spots,
                            input.image,
                            input.options,
                        );
                        progress.add(1);
                        (i, r)
                    })
                    .collect();
                solve_time += t1.elapsed();
                for (i, r) in solved {
                    results[i] = Some(r);
                }
            }
        });
        tracing::info!(
            "cpu: {} patches, spots {:.3} s, patch solves {:.3} s",
            patches.len(),
            spot_time.as_secs_f64(),
            solve_time.as_secs_f64()
        );
        Ok(results
            .into_iter()
            .map(|r| r.expect("every patch solved"))
            .collect())
    }
}

/// The projection matrix of a patch restricted to its pixel box, with the box's pixels.
struct PatchSystem {
    geom: PatchGeometry,
    ny: usize,
    nx: usize,
    /// Per column: the spot with zeros outside the box, `[col][ny * nx]`.
    a: Vec<f64>,
    /// Per column: CCD corner (x, y).
    corner: Vec<(i64, i64)>,
    /// Box pixels and weights, `[row][col]` of the box.
    pix: Vec<f64>,
    ivar: Vec<f64>,
}

impl PatchSystem {
    fn new(geom: PatchGeometry, spots: &Spots, image: &Image) -> Self {
        let (ny, nx) = (spots.corners.ny, spots.corners.nx);
        let size = ny * nx;
        let m = geom.nunknowns();
        let (r0, r1) = (geom.rows.start as i64, geom.rows.end as i64);
        let (c0, c1) = (geom.cols.start as i64, geom.cols.end as i64);
        let mut a = vec![0.0; m * size];
        let mut corner = Vec::with_capacity(m);
        for (b, &f) in geom.block_fibers.iter().enumerate() {
            for w in 0..geom.nwavetot {
                let j = b * geom.nwavetot + w;
                let (xc, yc) = spots.corners.corner(f, geom.wave0 + w);
                let (xc, yc) = (xc as i64, yc as i64);
                corner.push((xc, yc));
                let spot = spots.spot(f, geom.wave0 + w);
                let col = &mut a[j * size..(j + 1) * size];
                for iy in 0..ny {
                    let yy = yc + iy as i64;
                    if yy < r0 || yy >= r1 {
                        continue;
                    }
                    for ix in 0..nx {
                        let xx = xc + ix as i64;
                        if xx >= c0 && xx < c1 {
                            col[iy * nx + ix] = spot[iy * nx + ix];
                        }
                    }
                }
            }
        }
        let (h, w) = (geom.rows.len(), geom.cols.len());
        let mut pix = Vec::with_capacity(h * w);
        let mut ivar = Vec::with_capacity(h * w);
        for r in geom.rows.clone() {
            let row = r * image.ncols;
            pix.extend(
                image.pix[row + geom.cols.start..row + geom.cols.end]
                    .iter()
                    .map(|&v| v as f64),
            );
            ivar.extend(
                image.ivar[row + geom.cols.start..row + geom.cols.end]
                    .iter()
                    .map(|&v| v as f64),
            );
        }
        PatchSystem {
            geom,
            ny,
            nx,
            a,
            corner,
            pix,
            ivar,
        }
    }

    fn m(&self) -> usize {
        self.corner.len()
    }

    fn column(&self, j: usize) -> &[f64] {
        let size = self.ny * self.nx;
        &self.a[j * size..(j + 1) * size]
    }

    /// Calls `f(spot index, box index)` for every pixel of column `j`'s spot inside the box.
    #[inline]
    fn for_pixels(&self, j: usize, mut f: impl FnMut(usize, usize)) {
        let (xc, yc) = self.corner[j];
        let (r0, c0) = (self.geom.rows.start as i64, self.geom.cols.start as i64);
        let w = self.geom.cols.len() as i64;
        let ylo = (self.geom.rows.start as i64 - yc).max(0);
        let yhi = (self.geom.rows.end as i64 - yc).min(self.ny as i64);
        let xlo = (c0 - xc).max(0);
        let xhi = (self.geom.cols.end as i64 - xc).min(self.nx as i64);
        for iy in ylo..yhi {
            let brow = (yc + iy - r0) * w;
            for ix in xlo..xhi {
                f(
                    (iy * self.nx as i64 + ix) as usize,
                    (brow + xc + ix - c0) as usize,
                );
            }
        }
    }

    /// `icov = A^T W A` (full symmetric), `y = A^T W p`, `fluxweight = A^T W 1`.
    fn normal_equations(&self) -> (Mat<f64>, Vec<f64>, Vec<f64>) {
        let m = self.m();
        let size = self.ny * self.nx;
        let nx = self.nx as i64;
        let ny = self.ny as i64;
        // weighted columns ws = W a, over the spot's own frame
        let mut ws = vec![0.0; m * size];
        let mut y = vec![0.0; m];
        let mut fw = vec![0.0; m];
        for j in 0..m {
            let col = self.column(j);
            let out = &mut ws[j * size..(j + 1) * size];
            let (mut sy, mut sw) = (0.0, 0.0);
            self.for_pixels(j, |s, p| {
                let v = col[s] * self.ivar[p];
                out[s] = v;
                sy += v * self.pix[p];
                sw += v;
            });
            y[j] = sy;
            fw[j] = sw;
        }
        let mut icov = Mat::<f64>::zeros(m, m);
        for j1 in 0..m {
            let (x1, y1) = self.corner[j1];
            let w1 = &ws[j1 * size..(j1 + 1) * size];
            for j2 in j1..m {
                let (x2, y2) = self.corner[j2];
                let (dx, dy) = (x2 - x1, y2 - y1);
                if dx.abs() >= nx || dy.abs() >= ny {
                    continue;
                }
                let a2 = self.column(j2);
                // overlap in spot-1 coordinates
                let (ylo, yhi) = (dy.max(0), (ny + dy).min(ny));
                let (xlo, xhi) = (dx.max(0), (nx + dx).min(nx));
                let mut sum = 0.0;
                for iy in ylo..yhi {
                    let o1 = (iy * nx) as usize;
                    let o2 = ((iy - dy) * nx - dx) as usize;
                    for ix in xlo as usize..xhi as usize {
                        sum += w1[o1 + ix] * a2[o2 + ix];
                    }
                }
                icov[(j1, j2)] = sum;
                icov[(j2, j1)] = sum;
            }
        }
        (icov, y, fw)
    }

    /// `A x` over the box.
    fn project(&self, x: &[f64], columns: impl Iterator<Item = usize>) -> Vec<f64> {
        let mut model = vec![0.0; self.pix.len()];
        for j in columns {
            if x[j] == 0.0 {
                continue;
            }
            let col = self.column(j);
            self.for_pixels(j, |s, p| model[p] += col[s] * x[j]);
        }
        model
    }
}

/// Adds the diagonal prior of step 2; returns false when no pixel constrains the patch.
fn regularize(icov: &mut Mat<f64>, fluxweight: &[f64], regularize: f64) -> bool {
    let maxw = fluxweight.iter().cloned().fold(0.0, f64::max);
    if !(maxw > 0.0) {
        return false;
    }
    let minweight = 1e-4 * maxw;
    for (j, &fw) in fluxweight.iter().enumerate() {
        let alpha = if fw < minweight {
            minweight - fw
        } else {
            regularize
        };
        icov[(j, j)] += alpha * alpha + 1e-15;
    }
    true
}

/// In-place lower Cholesky factor; `Err(pivot)` when `a` is not numerically positive definite.
fn cholesky(a: &mut Mat<f64>) -> std::result::Result<(), usize> {
    let n = a.nrows();
    let mut mem = MemBuffer::new(cholesky_in_place_scratch::<f64>(
        n,
        Par::Seq,
        Default::default(),
    ));
    let result = cholesky_in_place(
        a.as_mut(),
        LltRegularization::default(),
        Par::Seq,
        MemStack::new(&mut mem),
        Default::default(),
    );
    match result {
        Ok(_) => {
            // faer leaves the strict upper triangle untouched; clear it so `a` is L.
            for j in 1..n {
                for i in 0..j {
                    a[(i, j)] = 0.0;
                }
            }
            Ok(())
        }
        Err(faer::linalg::cholesky::llt::factor::LltError::NonPositivePivot { index }) => {
            Err(index)
        }
    }
}

/// Symmetric eigendecomposition `a = U diag(s) U^T`, eigenvalues ascending.
fn eigh(a: MatRef<'_, f64>) -> (Vec<f64>, Mat<f64>) {
    let n = a.nrows();
    let mut s = Diag::<f64>::zeros(n);
    let mut u = Mat::<f64>::zeros(n, n);
    let mut mem = MemBuffer::new(self_adjoint_evd_scratch::<f64>(
        n,
        ComputeEigenvectors::Yes,
        Par::Seq,
        Default::default(),
    ));
    // Failure to converge leaves NaN, which the caller's finiteness check reports.
    if self_adjoint_evd(
        a,
        s.as_mut(),
        Some(u.as_mut()),
        Par::Seq,
        MemStack::new(&mut mem),
        Default::default(),
    )
    .is_err()
    {
        return (vec![f64::NAN; n], u);
    }
    ((0..n).map(|i| s[i]).collect(), u)
}

/// `U diag(f(s)) U^T`.
fn spectral(s: &[f64], u: &Mat<f64>, f: impl Fn(f64) -> f64) -> Mat<f64> {
    let n = s.len();
    let mut us = u.clone();
    for (j, &sj) in s.iter().enumerate() {
        let v = f(sj);
        for i in 0..n {
            us[(i, j)] *= v;
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

/// Eigenvalues clipped from below at `EIGEN_CLIP` times the largest.
fn clip_eigenvalues(s: &mut [f64]) {
    let max = s.iter().cloned().fold(f64::MIN, f64::max);
    let floor = max * EIGEN_CLIP;
    s.iter_mut().for_each(|v| *v = v.max(floor));
}

/// The solution of the normal equations and the core fibers' covariance blocks.
struct Solution {
    xflux: Vec<f64>,
    /// `C_b` of each core fiber.
    blocks: Vec<Mat<f64>>,
    status: PatchStatus,
}

/// Steps 2-4 up to the covariance blocks: Cholesky, a regularised retry, then the clipped
/// eigendecomposition of icov as the last resort.
fn solve_normal_equations(
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

/// Solves one patch completely; numerical trouble is reported in the result's status.
pub fn solve_patch(
    plan: &Plan,
    patch: &Patch,
    spots: &Spots,
    image: &Image,
    options: &SolveOptions,
) -> PatchResult {
    let ndiag = spots.corners.ny / 2;
    let geom = PatchGeometry::new(plan, patch, &spots.corners, (image.nrows, image.ncols));
    if geom.is_empty() {
        return PatchResult::empty(patch, ndiag, PatchStatus::OffImage);
    }
    let sys = PatchSystem::new(geom, spots, image);
    let geom = &sys.geom;
    let (nt, p0, nk) = (geom.nwavetot, plan.wavepad, patch.waves.len());
    let ncore = geom.ncore();
    let core_col = |c: usize, j: usize| (geom.npad + c) * nt + p0 + j;

    // pixmask_fraction: the fraction of each core spot that falls on masked pixels.
    let mut result = PatchResult::empty(patch, ndiag, PatchStatus::Ok);
    for c in 0..ncore {
        for j in 0..nk {
            let col = sys.column(core_col(c, j));
            let mut masked = 0.0;
            sys.for_pixels(core_col(c, j), |s, p| {
                if sys.ivar[p] == 0.0 {
                    masked += col[s];
                }
            });
            result.pixmask_fraction[c * nk + j] = masked;
        }
    }

    let (icov, y, fw) = sys.normal_equations();
    let Some(solution) = solve_normal_equations(&icov, &y, &fw, geom, options.regularize) else {
        result.status = PatchStatus::Masked;
        return result;
    };
    let xflux = &solution.xflux;
    result.status = solution.status;
    match solution.status {
        PatchStatus::Regularized => tracing::warn!(
            "patch fibers {:?} bins {:?}: Cholesky failed, solved with regularize = {RETRY_REGULARIZE}",
            patch.fibers,
            patch.waves
        ),
        PatchStatus::EigenFallback => tracing::warn!(
            "patch fibers {:?} bins {:?}: Cholesky failed twice, solved by clipped eigendecomposition",
            patch.fibers,
            patch.waves
        ),
        _ => {}
    }

    // Step 4: decorrelate each core fiber. The model image covers every core bin of the
    // patch, also those of the last patch of a row that lie past the last output bin (as
    // gpu_specter's does), so their flux is computed too when a model is asked for.
    let nd = 2 * ndiag + 1;
    let nmodel = if options.model {
        plan.options.layout.nwavestep
    } else {
        nk
    };
    let mut flux_full = vec![0.0; ncore * nmodel];
    for (c, cb) in solution.blocks.iter().enumerate() {
        let (mut s, u) = eigh(cb.as_ref());
        clip_eigenvalues(&mut s);
        let q = spectral(&s, &u, |v| 1.0 / v.sqrt());
        let xb = &xflux[(geom.npad + c) * nt..(geom.npad + c + 1) * nt];
        for j in 0..nmodel {
            let row = p0 + j;
            let norm: f64 = (0..nt).map(|k| q[(row, k)]).sum();
            let flux: f64 = (0..nt).map(|k| q[(row, k)] * xb[k]).sum::<f64>() / norm;
            flux_full[c * nmodel + j] = flux;
            if j >= nk {
                continue;
            }
            result.flux[c * nk + j] = flux;
            result.ivar[c * nk + j] = norm * norm;
            for k in 0..nd {
                // Rdiags[k][j] = R[j - ndiag + k][j]; R's rows are Q's rows over their sums.
                let r = (row + k) as i64 - ndiag as i64;
                if r >= 0 && (r as usize) < nt {
                    let r = r as usize;
                    let rsum: f64 = (0..nt).map(|kk| q[(r, kk)]).sum();
                    result.resolution[(c * nd + k) * nk + j] = q[(r, row)] / rsum;
                }
            }
        }
    }

    // Step 7: chi2pix from the deconvolved model over the whole patch.
    let model = sys.project(xflux, 0..sys.m());
    let weight: Vec<f64> = model
        .iter()
        .zip(&sys.ivar)
        .map(|(&m, &iv)| {
            if iv > 0.0 {
                let e = options.psferr * m + 1e-32;
                1.0 / (e * e + 1.0 / iv)
            } else {
                0.0
            }
        })
        .collect();
    for c in 0..ncore {
        for j in 0..nk {
            let jc = core_col(c, j);
            let col = sys.column(jc);
            let (mut num, mut den) = (0.0, 0.0);
            sys.for_pixels(jc, |s, p| {
                let d = sys.pix[p] - model[p];
                num += col[s] * d * d * weight[p];
                if weight[p] > 0.0 {
                    den += col[s];
                }
            });
            result.chi2pix[c * nk + j] = if den > 0.0 { num / den } else { 0.0 };
        }
    }

    if options.model {
        let mut x = vec![0.0; sys.m()];
        for c in 0..ncore {
            for j in 0..nmodel {
                x[core_col(c, j)] = flux_full[c * nmodel + j];
            }
        }
        let cols = (0..ncore).flat_map(|c| (0..nmodel).map(move |j| core_col(c, j)));
        result.model = Some(ModelPatch {
            rows: geom.rows.clone(),
            cols: geom.cols.clone(),
            data: sys.project(&x, cols),
        });
    }

    if !result.is_finite() {
        tracing::warn!(
            "patch fibers {:?} bins {:?}: non-finite solution, flux and ivar set to 0",
            patch.fibers,
            patch.waves
        );
        let mut empty = PatchResult::empty(patch, ndiag, PatchStatus::NonFinite);
        empty.pixmask_fraction = result.pixmask_fraction;
        return empty;
    }
    result
}

#[cfg(test)]
mod tests {
    use super::*;

    fn geometry(n: usize) -> PatchGeometry {
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
        let s = solve_normal_equations(&a, &[1.0, 2.0, 3.0], &[1.0; 3], &geometry(3), 0.0).unwrap();
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
        let s = solve_normal_equations(&a, &[1.0, -1.0], &[1.0; 2], &geometry(2), 0.0).unwrap();
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
        assert!(solve_normal_equations(&a, &[0.0; 2], &[0.0; 2], &geometry(2), 0.0).is_none());
    }

    /// The inverse square root from the eigendecomposition satisfies Q C Q = I.
    #[test]
    fn inverse_square_root_residual_is_small() {
        let n = 74;
        // a covariance-like SPD block: smooth kernel plus a diagonal
        let c = Mat::<f64>::from_fn(n, n, |i, j| {
            let d = i as f64 - j as f64;
            (-(d * d) / 8.0).exp() + if i == j { 0.05 } else { 0.0 }
        });
        let (mut s, u) = eigh(c.as_ref());
        clip_eigenvalues(&mut s);
        let q = spectral(&s, &u, |v| 1.0 / v.sqrt());
        let mut qc = Mat::<f64>::zeros(n, n);
        matmul(
            qc.as_mut(),
            Accum::Replace,
            q.as_ref(),
            c.as_ref(),
            1.0,
            Par::Seq,
        );
        let mut qcq = Mat::<f64>::zeros(n, n);
        matmul(
            qcq.as_mut(),
            Accum::Replace,
            qc.as_ref(),
            q.as_ref(),
            1.0,
            Par::Seq,
        );
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
}
