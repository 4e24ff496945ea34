//! The CPU backend: the reference implementation of the patch solve, in f64, one patch per
//! thread (rayon), sequential dense linear algebra (faer) inside a patch so that results do not
//! depend on the number of threads.
//!
//! For one patch with pixel values `p`, weights `ivar` and projection matrix `A` (one column per
//! fiber and padded wavelength bin):
//! 1. `icov = A^T diag(ivar) A`, `y = A^T diag(ivar) p`, `fluxweight = A^T ivar`
//!    ([`system`]), kept by fiber block: `icov` is block-tridiagonal in the fibers' order;
//! 2. `icov += diag(alpha^2 + 1e-15)` with `alpha = minweight - fluxweight` where
//!    `fluxweight < minweight = 1e-4 max(fluxweight)`, else `regularize`;
//! 3. two block sweeps give `xflux = icov^-1 y` and each core fiber's Schur complement
//!    `S_b = C_bb^-1`, where `C = icov^-1` is never formed ([`schur`]);
//! 4. for each core fiber `Q_b = C_bb^(-1/2) = S_b^(1/2)`, `s = Q_b 1`, `R_b = diag(s)^-1
//!    Q_b`, `ivar = s^2`, `flux = R_b xflux_b` ([`decorrelate`]);
//! 5. pixmask fraction, chi2pix and the optional model from `A`, `xflux` and `flux`.
//!
//! The dense route ([`dense`]: Cholesky of the whole `icov`, the covariance blocks from its
//! trailing triangular inverse, a regularised retry and a clipped eigendecomposition) takes
//! over where the couplings beyond neighbouring fibers are not negligible
//! ([`FAR_COUPLING_LIMIT`]) or a block of the sweeps is not positive definite.

mod cholesky;
mod decorrelate;
mod dense;
mod eigen;
mod reject;
mod schur;
mod system;
mod tridiag;

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use rayon::prelude::*;

use crate::backend::{Backend, FrameInput, Progress};
use crate::error::{Error, Result};
use crate::extract::{ModelPatch, PatchGeometry, PatchResult, PatchStatus, SolveOptions};
use crate::image::Image;
use crate::plan::{Patch, Plan};
use crate::psf::Spots;
pub use decorrelate::EIGEN_MAX_COND;
use decorrelate::{CoreBins, Root, Route};
pub use dense::{EIGEN_CLIP, RETRY_REGULARIZE};
pub use system::{prior, NormalEquations};

/// The largest coupling beyond neighbouring fibers, relative to the diagonal
/// (`|a_ij| / sqrt(a_ii a_jj)`), that the Schur-complement route drops. Dropping a coupling
/// `delta` moves a flux by about `delta` times the signal-to-noise ratio of the fibers it
/// couples, in units of its sigma: below 1e-10 sigma up to a signal-to-noise ratio of 100 per
/// bin. The spots' tails give at most about 5e-14 on DESI PSFs.
pub const FAR_COUPLING_LIMIT: f64 = 1e-12;

/// Solves patches on CPU threads.
pub struct CpuBackend {
    pool: rayon::ThreadPool,
    threads: usize,
    /// The spots of the bundle being solved. Kept from bundle to bundle and frame to frame:
    /// a bundle's table is tens of megabytes, whose fresh pages the kernel would otherwise
    /// zero for every bundle.
    spots: Spots,
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
        Ok(CpuBackend {
            pool,
            threads,
            spots: Spots::default(),
        })
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
        let mut counts = RouteCounts::default();
        let spots = &mut self.spots;
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
                {
                    let _range = nvtx::LocalRange::new(c"spots");
                    input.psf.spots_into(fibers, &input.plan.fullwave, spots);
                }
                let spots = &*spots;
                let t1 = Instant::now();
                spot_time += t1 - t0;
                let _range = nvtx::LocalRange::new(c"solve patches");
                let solved: Vec<(usize, PatchResult, RouteCounts)> = members
                    .par_iter()
                    .map(|&i| {
                        let mut c = RouteCounts::default();
                        let r = solve_patch_counted(
                            input.plan,
                            &patches[i],
                            spots,
                            input.image,
                            input.options,
                            &mut c,
                        );
                        progress.add(1);
                        (i, r, c)
                    })
                    .collect();
                solve_time += t1.elapsed();
                for (i, r, c) in solved {
                    results[i] = Some(r);
                    counts += c;
                }
            }
        });
        tracing::info!(
            "cpu: {} patches ({} by the dense route, {} fibers decorrelated by the polar route), spots {:.3} s, patch solves {:.3} s",
            patches.len(),
            counts.dense,
            counts.polar,
            spot_time.as_secs_f64(),
            solve_time.as_secs_f64()
        );
        Ok(results
            .into_iter()
            .map(|r| r.expect("every patch solved"))
            .collect())
    }
}

/// How the patches of a batch were solved, beyond their status: for the log.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
struct RouteCounts {
    /// Patches solved by the dense route.
    dense: usize,
    /// Fibers decorrelated through the polar factor (ill-conditioned blocks).
    polar: usize,
}

impl std::ops::AddAssign for RouteCounts {
    fn add_assign(&mut self, o: Self) {
        self.dense += o.dense;
        self.polar += o.polar;
    }
}

/// The normal equations of a patch as the solve builds them (not yet regularised), with its
/// geometry; `None` for a patch off the CCD. For tests against other implementations.
pub fn normal_equations(
    plan: &Plan,
    patch: &Patch,
    spots: &Spots,
    image: &Image,
) -> Option<(PatchGeometry, NormalEquations)> {
    let geom = PatchGeometry::new(plan, patch, &spots.corners, (image.nrows, image.ncols));
    if geom.is_empty() {
        return None;
    }
    let sys = system::PatchSystem::new(geom, spots, image);
    let ne = sys.normal_equations();
    Some((sys.geom, ne))
}

/// The flux and the decorrelation matrices `Q_b` of the core fibers.
struct Decorrelation {
    xflux: Vec<f64>,
    q: Vec<Root>,
    status: PatchStatus,
}

/// Steps 2-4 up to the `Q_b`: the Schur-complement route where it applies, else the dense
/// route; `None` when no pixel constrains the patch. Where `ne` holds bounds of the far
/// couplings only (`far_bounded`), `exact` gives the normal equations with the couplings
/// themselves, for the bounds that do not show them negligible and for the dense route.
fn decorrelation(
    ne: &NormalEquations,
    geom: &PatchGeometry,
    options: &SolveOptions,
    counts: &mut RouteCounts,
    exact: &dyn Fn() -> NormalEquations,
) -> Option<Decorrelation> {
    match solve_flux(ne, geom, options, counts, exact)? {
        Solved::Sweeps(sweeps) => decorrelate_sweeps(sweeps, ne, geom, options, counts, exact),
        Solved::Decorrelated(d) => Some(d),
    }
}

/// A patch's system solved up to its flux: the Schur route's sweeps, whose `Q_b` are not
/// taken yet (outlier rejection takes them of the last solution only), or the dense route's
/// whole solution.
enum Solved {
    Sweeps(schur::Sweeps),
    Decorrelated(Decorrelation),
}

impl Solved {
    fn xflux(&self) -> &[f64] {
        match self {
            Solved::Sweeps(s) => &s.xflux,
            Solved::Decorrelated(d) => &d.xflux,
        }
    }
}

/// Steps 2-3 of [`decorrelation`]: the sweeps where the far couplings are negligible and the
/// blocks positive definite, else the dense route's solution.
fn solve_flux(
    ne: &NormalEquations,
    geom: &PatchGeometry,
    options: &SolveOptions,
    counts: &mut RouteCounts,
    exact: &dyn Fn() -> NormalEquations,
) -> Option<Solved> {
    let prior = prior(&ne.fluxweight, options.regularize)?;
    let coupling = ne.far_coupling(&prior);
    if ne.far_bounded && coupling > FAR_COUPLING_LIMIT {
        tracing::debug!("far fiber coupling bounded by {coupling:.1e}: exact couplings");
        return solve_flux(&exact(), geom, options, counts, exact);
    }
    if coupling <= FAR_COUPLING_LIMIT {
        if let Some(sweeps) = schur::solve(ne, &prior, geom) {
            return Some(Solved::Sweeps(sweeps));
        }
    } else {
        tracing::debug!("far fiber coupling {coupling:.1e}: dense route");
    }
    dense_route(ne, geom, options, counts, exact).map(Solved::Decorrelated)
}

/// Step 4 on the Schur route: the `Q_b` of the sweeps' Schur complements, else (a complement
/// without a usable root) the dense route.
fn decorrelate_sweeps(
    sweeps: schur::Sweeps,
    ne: &NormalEquations,
    geom: &PatchGeometry,
    options: &SolveOptions,
    counts: &mut RouteCounts,
    exact: &dyn Fn() -> NormalEquations,
) -> Option<Decorrelation> {
    let roots: Option<Vec<(Root, Route)>> = sweeps
        .schur
        .iter()
        .map(decorrelate::sqrt_of_schur)
        .collect();
    if let Some(roots) = roots {
        counts.polar += roots.iter().filter(|(_, r)| *r == Route::Polar).count();
        return Some(Decorrelation {
            xflux: sweeps.xflux,
            q: roots.into_iter().map(|(q, _)| q).collect(),
            status: PatchStatus::Ok,
        });
    }
    dense_route(ne, geom, options, counts, exact)
}

/// Steps 2-4 by the dense route, on the exact normal equations.
fn dense_route(
    ne: &NormalEquations,
    geom: &PatchGeometry,
    options: &SolveOptions,
    counts: &mut RouteCounts,
    exact: &dyn Fn() -> NormalEquations,
) -> Option<Decorrelation> {
    counts.dense += 1;
    let exact_ne;
    let ne = if ne.far_bounded {
        exact_ne = exact();
        &exact_ne
    } else {
        ne
    };
    let solution = dense::solve(&ne.dense(), &ne.y, &ne.fluxweight, geom, options.regularize)?;
    Some(Decorrelation {
        xflux: solution.xflux,
        q: solution
            .blocks
            .iter()
            .map(decorrelate::inverse_sqrt_of_covariance)
            .collect(),
        status: solution.status,
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
    solve_patch_counted(
        plan,
        patch,
        spots,
        image,
        options,
        &mut RouteCounts::default(),
    )
}

/// [`solve_patch`], counting the routes taken. Runs under the widest SIMD instruction set
/// of the machine (`pulp`), which the pixel loops it inlines then use; their sums have a fixed
/// order, so the results do not depend on that choice.
fn solve_patch_counted(
    plan: &Plan,
    patch: &Patch,
    spots: &Spots,
    image: &Image,
    options: &SolveOptions,
    counts: &mut RouteCounts,
) -> PatchResult {
    pulp::Arch::new().dispatch(PatchSolve {
        plan,
        patch,
        spots,
        image,
        options,
        counts,
    })
}

/// The arguments of [`solve_one`] as a SIMD operation.
struct PatchSolve<'a> {
    plan: &'a Plan,
    patch: &'a Patch,
    spots: &'a Spots,
    image: &'a Image,
    options: &'a SolveOptions,
    counts: &'a mut RouteCounts,
}

impl pulp::WithSimd for PatchSolve<'_> {
    type Output = PatchResult;

    #[inline(always)]
    fn with_simd<S: pulp::Simd>(self, _simd: S) -> PatchResult {
        solve_one(
            self.plan,
            self.patch,
            self.spots,
            self.image,
            self.options,
            self.counts,
        )
    }
}

#[inline(always)]
fn solve_one(
    plan: &Plan,
    patch: &Patch,
    spots: &Spots,
    image: &Image,
    options: &SolveOptions,
    counts: &mut RouteCounts,
) -> PatchResult {
    let ndiag = spots.corners.ny / 2;
    let geom = PatchGeometry::new(plan, patch, &spots.corners, (image.nrows, image.ncols));
    if geom.is_empty() {
        return PatchResult::empty(patch, ndiag, PatchStatus::OffImage);
    }
    let mut sys = system::PatchSystem::new(geom, spots, image);
    let geom = &sys.geom.clone();
    let (nt, p0, nk) = (geom.nwavetot, plan.wavepad, patch.waves.len());
    let ncore = geom.ncore();
    let core_col = |c: usize, j: usize| (geom.npad + c) * nt + p0 + j;

    let mut result = PatchResult::empty(patch, ndiag, PatchStatus::Ok);
    pixmask_fraction(&sys, &mut result, ncore, nk, core_col);

    let ne = sys.normal_equations_bounded();
    // the model of the final solution, where outlier rejection computed it
    let mut model = None;
    let solution = match options.reject_outliers {
        None => decorrelation(&ne, geom, options, counts, &|| sys.normal_equations()),
        Some(nsigma) => {
            let before = result.pixmask_fraction.clone();
            let core = reject::core_pixels(&sys, reject::tested_columns(geom, p0));
            let (last, done) =
                reject::reject_and_resolve(&mut sys, ne, &core, nsigma, options, counts);
            // Rejected pixels count as masked ones; the bins whose fraction grew lost pixels.
            pixmask_fraction(&sys, &mut result, ncore, nk, core_col);
            result.rejected = result
                .pixmask_fraction
                .iter()
                .zip(&before)
                .map(|(a, b)| a - b)
                .collect();
            (result.nrejected, result.nresolves) = (done.nrejected, done.nresolves);
            model = done.model;
            last
        }
    };
    let Some(solution) = solution else {
        let fraction = result.pixmask_fraction;
        let mut masked =
            PatchResult::without_usable_pixels(patch, ndiag, options.regularize, fraction);
        (masked.rejected, masked.nrejected) = (result.rejected, result.nrejected);
        masked.nresolves = result.nresolves;
        return masked;
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

    // Step 4: decorrelate each core fiber.
    let bins = CoreBins { p0, nk, ndiag };
    for (c, q) in solution.q.iter().enumerate() {
        let xb = &xflux[(geom.npad + c) * nt..(geom.npad + c + 1) * nt];
        decorrelate::fill_fiber(&mut result, c, q, xb, &bins);
    }

    let model = model.unwrap_or_else(|| sys.project(xflux, 0..sys.m()));
    chi2pix(&sys, &model, options, &mut result, ncore, nk, core_col);

    if options.model {
        // The model covers every core bin of the patch, also those of the last patch of a
        // row that lie past the last output bin, as gpu_specter's does.
        let nmodel = plan.options.layout.nwavestep;
        let mut x = vec![0.0; sys.m()];
        for (c, q) in solution.q.iter().enumerate() {
            let xb = &xflux[(geom.npad + c) * nt..(geom.npad + c + 1) * nt];
            let flux = q.flux(xb);
            for j in 0..nmodel {
                x[core_col(c, j)] = flux[p0 + j];
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
        (empty.rejected, empty.nrejected) = (result.rejected, result.nrejected);
        empty.nresolves = result.nresolves;
        return empty;
    }
    result
}

/// Step 6: the fraction of each core spot that falls on masked pixels.
#[inline(always)]
fn pixmask_fraction(
    sys: &system::PatchSystem<'_>,
    result: &mut PatchResult,
    ncore: usize,
    nk: usize,
    core_col: impl Fn(usize, usize) -> usize,
) {
    for c in 0..ncore {
        for j in 0..nk {
            let col = sys.column(core_col(c, j));
            let mut masked = 0.0;
            sys.for_rows(core_col(c, j), |s, p, len| {
                for (&a, &iv) in col[s..s + len].iter().zip(&sys.ivar[p..p + len]) {
                    if iv == 0.0 {
                        masked += a;
                    }
                }
            });
            result.pixmask_fraction[c * nk + j] = masked;
        }
    }
}

/// Step 7: chi2pix from the deconvolved model `A xflux` over the whole patch.
#[inline(always)]
fn chi2pix(
    sys: &system::PatchSystem<'_>,
    model: &[f64],
    options: &SolveOptions,
    result: &mut PatchResult,
    ncore: usize,
    nk: usize,
    core_col: impl Fn(usize, usize) -> usize,
) {
    // per pixel: the weighted squared residual and whether the pixel counts
    let (mut chi, mut used) = (vec![0.0; model.len()], vec![0.0; model.len()]);
    for (p, (&m, &iv)) in model.iter().zip(&sys.ivar).enumerate() {
        if iv > 0.0 {
            let e = options.psferr * m + 1e-32;
            let w = 1.0 / (e * e + 1.0 / iv);
            let d = sys.pix[p] - m;
            chi[p] = d * d * w;
            used[p] = if w > 0.0 { 1.0 } else { 0.0 };
        }
    }
    for c in 0..ncore {
        for j in 0..nk {
            let jc = core_col(c, j);
            let col = sys.column(jc);
            let (mut num, mut den) = (0.0, 0.0);
            sys.for_rows(jc, |s, p, len| {
                num += system::dot(&col[s..s + len], &chi[p..p + len]);
                den += system::dot(&col[s..s + len], &used[p..p + len]);
            });
            result.chi2pix[c * nk + j] = if den > 0.0 { num / den } else { 0.0 };
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use faer::Mat;

    /// Normal equations of 3 fibers x `nt` bins in the order (pad, core, core), along the CCD
    /// (core, pad, core): a banded SPD matrix with neighbour coupling `c` and a coupling
    /// `far` between the two outer fibers.
    fn system(nt: usize, c: f64, far: f64) -> (NormalEquations, PatchGeometry) {
        let band = |i: usize, j: usize| {
            let d = i.abs_diff(j) as f64;
            if d > 3.0 {
                0.0
            } else {
                (-(d * d) / 2.0).exp() + if i == j { 0.2 } else { 0.0 }
            }
        };
        let coupling = |i: usize, j: usize| if i == j { c } else { 0.0 };
        let m = 3 * nt;
        let ne = NormalEquations {
            nt,
            // block 1 (core) leftmost, then the padding fiber, then block 2 (core)
            order: vec![1, 0, 2],
            diag: vec![Mat::from_fn(nt, nt, band); 3],
            sub: vec![Mat::from_fn(nt, nt, coupling); 2],
            far: (0..nt).map(|w| (nt + w, 2 * nt + w, far)).collect(),
            far_bounded: false,
            y: (0..m).map(|i| 1.0 + (i as f64 * 0.37).sin()).collect(),
            fluxweight: vec![1.0; m],
        };
        let geom = PatchGeometry {
            rows: 0..1,
            cols: 0..1,
            block_fibers: vec![1, 0, 2],
            npad: 1,
            wave0: 0,
            nwavetot: nt,
        };
        (ne, geom)
    }

    fn options() -> SolveOptions {
        SolveOptions {
            regularize: 0.0,
            psferr: 0.0,
            model: false,
            reject_outliers: None,
        }
    }

    /// The sweeps give the flux and the core blocks' `Q` of the dense route, to rounding.
    #[test]
    fn schur_route_matches_dense_route() {
        let (ne, geom) = system(12, 0.05, 0.0);
        let mut counts = RouteCounts::default();
        let schur = decorrelation(&ne, &geom, &options(), &mut counts, &|| ne.clone()).unwrap();
        assert_eq!(counts.dense, 0);
        let dense = dense::solve(&ne.dense(), &ne.y, &ne.fluxweight, &geom, 0.0).unwrap();
        for (a, b) in schur.xflux.iter().zip(&dense.xflux) {
            assert!((a - b).abs() < 1e-12 * b.abs().max(1.0), "xflux {a} vs {b}");
        }
        for (q, c) in schur.q.iter().zip(&dense.blocks) {
            let (q, qd) = (
                q.matrix(),
                decorrelate::inverse_sqrt_of_covariance(c).matrix(),
            );
            for i in 0..q.nrows() {
                for j in 0..q.ncols() {
                    assert!(
                        (q[(i, j)] - qd[(i, j)]).abs() < 1e-12,
                        "Q differs at ({i}, {j})"
                    );
                }
            }
        }
    }

    /// A coupling of fibers that are not neighbours above the limit sends the patch to the
    /// dense route; below it, the sweeps drop it.
    #[test]
    fn far_coupling_above_the_limit_takes_the_dense_route() {
        for (far, dense) in [(1e-3, 1), (1e-15, 0)] {
            let (ne, geom) = system(6, 0.05, far);
            let mut counts = RouteCounts::default();
            let d = decorrelation(&ne, &geom, &options(), &mut counts, &|| ne.clone()).unwrap();
            assert_eq!(counts.dense, dense, "far coupling {far}");
            assert_eq!(d.status, PatchStatus::Ok);
        }
    }
}
