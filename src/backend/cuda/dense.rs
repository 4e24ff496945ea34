//! The dense route of steps 2-3 through cuSOLVER and cuBLAS: batched Cholesky of icov padded to
//! one size (every patch gets `nblock` fiber blocks of `nwavetot` unknowns; unused leading
//! blocks are zero columns whose regularised diagonal decouples them exactly), the retry of
//! failed factorisations with regularize 1e-4 (a second failure goes to the CPU reference),
//! xflux by batched triangular solves, and the core blocks of icov^-1 as `X^T X` with
//! `X = L22^-1` (batched trsm, then one strided batched GEMM).
//!
//! The assembly stores one triangle of icov, row-major entries `j2 >= j1` of each patch's
//! m x m matrix (kernels/assemble.cu), which read column-major is the lower triangle: every
//! library call here is told `CUBLAS_FILL_MODE_LOWER` and reads only that triangle and the
//! factor L it leaves there (potrf, potrs, and trsm on the trailing block L22). The other
//! triangle is never valid; potrsBatched uses it as workspace, and the GEMM that writes the
//! covariance blocks into `ws.icov` afterwards runs with beta 0, so it reads nothing there.

use cudarc::cublas::sys as cublas_sys;
use cudarc::cusolver::sys as cusolver_sys;

use super::buffers::DevBuf;
use super::device::Device;
use super::error;
use super::launchers::{self, Gpu};
use super::shape::Shape;
use super::tuning::Solve;
use super::workspace::{pointer_array, Region, Workspace};
use crate::backend::cpu::RETRY_REGULARIZE;
use crate::error::Result;
use crate::extract::PatchStatus;
use crate::plan::Patch;

/// Device arrays that queued library calls still read: dropped after the stream syncs (a free
/// would wait for them).
pub(crate) type Keep = Vec<Box<dyn std::any::Any>>;

/// The outcome of the factorisation of a wave's patches.
pub(crate) struct Factorization {
    pub status: Vec<PatchStatus>,
    /// 1 where a patch has no weight at all.
    pub masked: Vec<i32>,
    /// Patches whose factorisation failed twice: solved by the CPU reference.
    pub to_cpu: Vec<usize>,
    pub retried: usize,
}

/// Batched Cholesky of the patches `ids`; returns cuSOLVER's info per patch.
fn potrf(dev: &Device, sh: &Shape, icov: &DevBuf<f64>, ids: &[usize]) -> Result<Vec<i32>> {
    let m = sh.m();
    let ptrs = pointer_array(dev, icov.ptr, m * m, ids, "Cholesky pointer array")?;
    let info = dev.zeros::<i32>(ids.len(), "Cholesky info")?;
    // SAFETY: every pointer addresses an m x m matrix inside `icov`.
    let status = unsafe {
        cusolver_sys::cusolverDnDpotrfBatched(
            dev.cusolver()?,
            cusolver_sys::cublasFillMode_t::CUBLAS_FILL_MODE_LOWER,
            m as i32,
            ptrs.ptr as *mut *mut f64,
            m as i32,
            info.ptr as *mut i32,
            ids.len() as i32,
        )
    };
    error::cusolver(
        status,
        &format!(
            "cusolverDnDpotrfBatched of {} patches of order {m}",
            ids.len()
        ),
    )?;
    let mut host = vec![0i32; ids.len()];
    dev.copy_from(&mut host, &info, 0, "Cholesky info")?;
    dev.sync("Cholesky factorisation")?;
    Ok(host)
}

/// Factorises icov of the `n` live patches (`patches[i]`, for the log), re-assembling and
/// retrying the failures with regularize 1e-4 (DESIGN step 2).
pub(crate) fn factorize(
    g: Gpu<'_>,
    ws: &Workspace,
    patches: &[&Patch],
    region: Region,
    regularize: f64,
) -> Result<Factorization> {
    let (dev, n) = (g.dev, patches.len());
    let all: Vec<usize> = (0..n).collect();
    let info = potrf(dev, g.sh, ws.icov.get(), &all)?;
    let mut masked = vec![0i32; n];
    dev.copy_from(&mut masked, ws.masked.get(), 0, "masked flags")?;
    dev.sync("masked flags")?;
    let first = Attempt {
        patches,
        info: &info,
        masked,
        regularize,
    };
    retry_failures(g, ws, region, first, |failed| {
        let info2 = potrf(dev, g.sh, ws.icov.get(), failed)?;
        Ok(info2.iter().map(|&v| v == 0).collect())
    })
}

/// The first factorisation of a wave's patches.
struct Attempt<'a> {
    patches: &'a [&'a Patch],
    /// Nonzero where the factorisation failed.
    info: &'a [i32],
    /// Nonzero where a patch has no weight at all (its failure does not count).
    masked: Vec<i32>,
    regularize: f64,
}

impl Factorization {
    /// DESIGN step 2's outcome, the same on both routes, from each patch's verdicts (nonzero
    /// where a factorisation failed): those of the first factorisation (`first`) and, for the
    /// patches that failed it, of the retry with regularize 1e-4 (`last`; a patch that was not
    /// retried keeps its first verdict there). A failure of a patch without any weight
    /// (`masked`) does not count; a patch that failed twice goes to the CPU reference.
    pub(crate) fn from_verdicts(
        patches: &[&Patch],
        first: &[i32],
        last: &[i32],
        masked: Vec<i32>,
    ) -> Self {
        let n = patches.len();
        let mut status = vec![PatchStatus::Ok; n];
        let mut to_cpu = Vec::new();
        let mut retried = 0;
        for i in (0..n).filter(|&i| first[i] != 0 && masked[i] == 0) {
            retried += 1;
            let saved = last[i] == 0;
            tracing::debug!(
                "patch fibers {:?} bins {:?}: icov not positive definite (info {}); {}",
                patches[i].fibers,
                patches[i].waves,
                first[i],
                if saved {
                    format!("solved with regularize {RETRY_REGULARIZE}")
                } else {
                    "solved by the CPU reference".to_string()
                }
            );
            if saved {
                status[i] = PatchStatus::Regularized;
            } else {
                to_cpu.push(i);
            }
        }
        Factorization {
            status,
            masked,
            to_cpu,
            retried,
        }
    }
}

/// DESIGN step 2's retry on the dense route: the patches whose first factorisation failed are
/// assembled again with regularize 1e-4 and `retry` factorises them once more (given their
/// indices; it returns, for each, whether it succeeded). A first failure already under that
/// regularisation is not retried.
fn retry_failures(
    g: Gpu<'_>,
    ws: &Workspace,
    region: Region,
    first: Attempt<'_>,
    retry: impl FnOnce(&[usize]) -> Result<Vec<bool>>,
) -> Result<Factorization> {
    let n = first.patches.len();
    let failed: Vec<usize> = (0..n)
        .filter(|&i| first.info[i] != 0 && first.masked[i] == 0)
        .collect();
    let mut last = first.info.to_vec();
    if !failed.is_empty() && first.regularize != RETRY_REGULARIZE {
        // The list stays alive until the retry has synchronised.
        let _ids = reassemble_regularized(g, ws, region, &failed)?;
        for (&i, ok) in failed.iter().zip(retry(&failed)?) {
            last[i] = i32::from(!ok);
        }
    }
    Ok(Factorization::from_verdicts(
        first.patches,
        first.info,
        &last,
        first.masked,
    ))
}

/// Assembles the patches `failed` of the wave again with regularize 1e-4, for a second
/// factorisation; returns their list on the device. The assembly rewrites the whole stored
/// triangle of those patches, where a failed potrf left part of a factor.
fn reassemble_regularized(
    g: Gpu<'_>,
    ws: &Workspace,
    region: Region,
    failed: &[usize],
) -> Result<DevBuf<i32>> {
    let ids: Vec<i32> = failed.iter().map(|&i| i as i32).collect();
    let ids_dev = g.dev.upload(&ids, "retry patch list")?;
    launchers::assemble(
        g,
        failed.len(),
        Some(&ids_dev),
        ws,
        region,
        RETRY_REGULARIZE,
        Solve::Dense,
    )?;
    Ok(ids_dev)
}

/// xflux = icov^-1 y for the `n` factorised patches, into `ws.x`.
pub(crate) fn solve_flux(g: Gpu<'_>, ws: &Workspace, n: usize, keep: &mut Keep) -> Result<()> {
    let (dev, m) = (g.dev, g.sh.m());
    let all: Vec<usize> = (0..n).collect();
    dev.dtod(ws.x.get(), ws.y.get(), n * m)?;
    let a_ptrs = pointer_array(dev, ws.icov.get().ptr, m * m, &all, "solve pointer array")?;
    let b_ptrs = pointer_array(dev, ws.x.get().ptr, m, &all, "solve rhs pointer array")?;
    let solve_info = dev.zeros::<i32>(1, "solve info")?;
    // SAFETY: pointers address the factors and right-hand sides of every live patch.
    let st = unsafe {
        cusolver_sys::cusolverDnDpotrsBatched(
            dev.cusolver()?,
            cusolver_sys::cublasFillMode_t::CUBLAS_FILL_MODE_LOWER,
            m as i32,
            1,
            a_ptrs.ptr as *mut *mut f64,
            m as i32,
            b_ptrs.ptr as *mut *mut f64,
            m as i32,
            solve_info.ptr as *mut i32,
            n as i32,
        )
    };
    error::cusolver(st, &format!("cusolverDnDpotrsBatched of {n} patches"))?;
    keep.push(Box::new((a_ptrs, b_ptrs, solve_info)));
    Ok(())
}

/// The core blocks of icov^-1 of the `n` factorised patches: X = L22^-1 by a triangular solve
/// on the identity, then C_b = X_b^T X_b into `ws.icov` (no longer needed), `nt x nt` per
/// (patch, core fiber).
pub(crate) fn core_covariance(g: Gpu<'_>, ws: &Workspace, n: usize, keep: &mut Keep) -> Result<()> {
    let (dev, sh) = (g.dev, g.sh);
    let (m, mc, nt, ncore) = (sh.m(), sh.mc(), sh.nt, sh.ncore);
    let k0 = m - mc;
    let xinv = ws.xinv.get();
    launchers::eye(g, xinv, mc, n)?;
    let l_ptrs: Vec<u64> = (0..n)
        .map(|i| ws.icov.get().at(i * m * m + k0 * m + k0))
        .collect();
    let l_ptrs = dev.upload(&l_ptrs, "trsm pointer array")?;
    let all: Vec<usize> = (0..n).collect();
    let x_ptrs = pointer_array(dev, xinv.ptr, mc * mc, &all, "trsm rhs pointer array")?;
    let one = 1.0f64;
    let zero = 0.0f64;
    // SAFETY: every pointer addresses an mc x mc block (lda m) or matrix (ld mc).
    unsafe {
        error::cublas(
            cublas_sys::cublasDtrsmBatched(
                dev.cublas()?,
                cublas_sys::cublasSideMode_t::CUBLAS_SIDE_LEFT,
                cublas_sys::cublasFillMode_t::CUBLAS_FILL_MODE_LOWER,
                cublas_sys::cublasOperation_t::CUBLAS_OP_N,
                cublas_sys::cublasDiagType_t::CUBLAS_DIAG_NON_UNIT,
                mc as i32,
                mc as i32,
                &one,
                l_ptrs.ptr as *const *const f64,
                m as i32,
                x_ptrs.ptr as *const *mut f64,
                mc as i32,
                n as i32,
            ),
            &format!("cublasDtrsmBatched of {n} blocks of order {mc}"),
        )?;
    }
    keep.push(Box::new((l_ptrs, x_ptrs)));
    // SAFETY: consecutive (patch, core block) pairs are nt * mc apart in `xinv`.
    unsafe {
        error::cublas(
            cublas_sys::cublasDgemmStridedBatched(
                dev.cublas()?,
                cublas_sys::cublasOperation_t::CUBLAS_OP_T,
                cublas_sys::cublasOperation_t::CUBLAS_OP_N,
                nt as i32,
                nt as i32,
                mc as i32,
                &one,
                xinv.ptr as *const f64,
                mc as i32,
                (nt * mc) as i64,
                xinv.ptr as *const f64,
                mc as i32,
                (nt * mc) as i64,
                &zero,
                ws.icov.get().ptr as *mut f64,
                nt as i32,
                (nt * nt) as i64,
                (n * ncore) as i32,
            ),
            &format!("cublasDgemmStridedBatched of {} blocks", n * ncore),
        )
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use crate::plan::{Plan, PlanOptions};

    /// A plan of one bundle, for patches to name in the outcome of a wave.
    pub(crate) fn bundle_plan() -> Plan {
        Plan::new(PlanOptions::new(6000.0, 6400.0, 0.8, 0, 25)).unwrap()
    }

    #[test]
    fn outcome_counts_failures_with_weight_and_sends_second_failures_to_the_cpu() {
        let plan = bundle_plan();
        let patches: Vec<&Patch> = plan.patches.iter().take(5).collect();
        // 0 fine; 1 saved by the retry; 2 failed twice; 3 without weight; 4 failed, not retried
        let first = [0, 1, 1, 1, 2];
        let last = [0, 0, 1, 1, 2];
        let f = Factorization::from_verdicts(&patches, &first, &last, vec![0, 0, 0, 1, 0]);
        assert_eq!(
            f.status,
            [
                PatchStatus::Ok,
                PatchStatus::Regularized,
                PatchStatus::Ok,
                PatchStatus::Ok,
                PatchStatus::Ok
            ]
        );
        assert_eq!(f.to_cpu, [2, 4]);
        assert_eq!(f.retried, 3);
        assert_eq!(f.masked, [0, 0, 0, 1, 0]);
    }
}
