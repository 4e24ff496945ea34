//! Steps 2-3 of the solve by per-fiber Schur complements (kernels/schur.cu): two block sweeps
//! over the fibers of every patch and one combine give each core block's Schur complement
//! S_b = C_bb^-1 (the input of the polar decorrelation) and xflux, in about a tenth of the
//! arithmetic of a dense Cholesky plus inverse and without its round trips through cuSOLVER.
//!
//! Failures follow DESIGN step 2 as on the dense route: a patch whose icov is not positive
//! definite is re-assembled with regularize 1e-4 and swept again, and a second failure goes to
//! the CPU reference. Unlike the dense route's, this retry is decided on the device, so that
//! the host queues a wave's steps without waiting for any of them; the verdicts come back
//! with the results. A patch whose second-neighbour coupling (dropped by the sweeps) exceeds
//! the tuning's bound also goes to the CPU reference, which solves it densely. The sweeps walk
//! the blocks in fiber order along the CCD (from the column table), not in storage order
//! (padding fibers first): in storage order a padding fiber and its core neighbour sit two
//! blocks apart, so the sweeps would drop a first-neighbour coupling. A padding fiber at an end
//! of the patch needs no Schur complement, only its flux: neither sweep steps onto it from the
//! other end, and a last kernel takes its flux from its block row.
//!
//! The assembly stores icov in band storage for this route (kernels/common.cuh): of each fiber
//! block's rows, the block itself (upper half), its coupling to the next fiber along the CCD
//! and to the one after (for the coupling check), a quarter of the dense matrix at DESI's 7
//! fibers per patch. A coupling block lies in the rows of the fiber first along the CCD; the
//! sweep from the right reads it row-wise, coalesced, and transposes it in shared memory.

use super::buffers::DevBuf;
use super::dense::Factorization;
use super::device::Device;
use super::kernels::{launch, Args};
use super::launchers::{self, Gpu};
use super::tuning::Solve;
use super::workspace::{Region, Workspace};
use crate::backend::cpu::RETRY_REGULARIZE;
use crate::error::Result;
use crate::plan::Patch;

/// Launches the sweeps, the combine and the flux of the padding fibers at the patches' ends
/// for `count` patches (`ids`, or the first `count`).
fn sweep(g: Gpu<'_>, ws: &Workspace, count: usize, ids: Option<&DevBuf<i32>>) -> Result<()> {
    let sh = g.sh;
    let (n, m, nb) = (sh.nt, sh.m(), sh.nblock);
    let big = (n + 1).div_ceil(8) * 8;
    let tiles = n.div_ceil(8) * 8;
    // the combine's and the end kernel's blocks: a matrix of tiles and a vector
    let (per_fiber_threads, per_fiber_smem) = ((4 * tiles) as u32, (tiles * (tiles + 4) + n) * 8);
    let ids_ptr = ids.map_or(0, |b| b.ptr);
    launch(
        g.dev,
        &g.k.schur_sweep,
        "schur_sweep_f64",
        (count as u32, 2, 1),
        (4 * big) as u32,
        (2 * big * (big + 4) + n + 32) * 8 + 4 * nb,
        Args::new()
            .ptr(ws.icov.get().ptr)
            .ptr(ws.y.get().ptr)
            .ptr(ids_ptr)
            .ptr(ws.colspot.get().ptr)
            .ptr(ws.view.corners)
            .i32(sh.nx as i32)
            .i32(m as i32)
            .i32(n as i32)
            .i32(nb as i32)
            .i32(sh.ncore as i32)
            .ptr(ws.sblocks.get().ptr)
            .ptr(ws.pbuf.get().ptr)
            .ptr(ws.end_factors.get().ptr)
            .ptr(ws.sv.get().ptr)
            .ptr(ws.info.get().ptr)
            .ptr(ws.coupling.get().ptr),
    )?;
    launch(
        g.dev,
        &g.k.schur_combine,
        "schur_combine_f64",
        (nb as u32, count as u32, 1),
        per_fiber_threads,
        per_fiber_smem,
        per_fiber_args(g, ws, ids_ptr)
            .ptr(ws.sv.get().ptr)
            .ptr(ws.sblocks.get().ptr)
            .ptr(ws.pbuf.get().ptr)
            .ptr(ws.x.get().ptr)
            .ptr(ws.info.get().ptr),
    )?;
    launch(
        g.dev,
        &g.k.schur_end_flux,
        "schur_end_flux_f64",
        (count as u32, 2, 1),
        per_fiber_threads,
        per_fiber_smem,
        per_fiber_args(g, ws, ids_ptr)
            .ptr(ws.end_factors.get().ptr)
            .ptr(ws.x.get().ptr),
    )
}

/// The arguments the combine and the end fibers' kernel start with: icov, y, the patch list,
/// the column table and the shape.
fn per_fiber_args(g: Gpu<'_>, ws: &Workspace, ids_ptr: u64) -> Args {
    let sh = g.sh;
    Args::new()
        .ptr(ws.icov.get().ptr)
        .ptr(ws.y.get().ptr)
        .ptr(ids_ptr)
        .ptr(ws.colspot.get().ptr)
        .i32(sh.m() as i32)
        .i32(sh.nt as i32)
        .i32(sh.nblock as i32)
        .i32(sh.ncore as i32)
}

/// Allocates the sweeps' buffers for `n` patches, and the retry list for up to `capacity`.
pub(crate) fn ensure(g: Gpu<'_>, ws: &mut Workspace, n: usize, capacity: usize) -> Result<()> {
    let sh = g.sh;
    let (nt, nb) = (sh.nt, sh.nblock);
    let n = ws.sized(n);
    ws.end_factors.ensure(g.dev, n * 2 * nt * nt)?;
    ws.sv.ensure(g.dev, n * 2 * nb * nt)?;
    // the core blocks' updates from the left, then their complements
    ws.sblocks.ensure(g.dev, n * sh.ncore * nt * nt)?;
    // their updates from the right, then the combine's Cholesky factors of the complements,
    // which the polar route starts from
    ws.pbuf.ensure(g.dev, n * sh.ncore * nt * nt)?;
    ws.info.ensure(g.dev, n)?;
    ws.first_info.ensure(g.dev, n)?;
    ws.retry_ids.ensure(g.dev, capacity.max(1))?;
    ws.coupling.ensure(g.dev, n)?;
    Ok(())
}

/// The patches of a wave the device retries at most: the retry's kernels are queued before
/// the verdicts are known, over a list of this length drawn up on the device (blocks past its
/// end return at once). Failures are rare, none on the test frames; those past the capacity go
/// to the CPU reference.
pub(crate) fn retry_capacity(tuning: usize, n: usize, regularize: f64) -> usize {
    if regularize == RETRY_REGULARIZE {
        0
    } else {
        tuning.min(n)
    }
}

/// Queues the sweeps of the wave's `n` patches and DESIGN step 2's retry of their
/// failures, without waiting for a verdict: the device lists up to `capacity` failed patches,
/// assembles them again with regularize 1e-4 and sweeps them once more. Their verdicts come
/// back with the wave's results ([`DeviceVerdicts`], [`outcome`]).
pub(crate) fn factorize(
    g: Gpu<'_>,
    ws: &Workspace,
    n: usize,
    region: Region,
    capacity: usize,
) -> Result<()> {
    g.dev.zero_prefix(ws.info.get(), n)?;
    sweep(g, ws, n, None)?;
    launch(
        g.dev,
        &g.k.schur_retry_list,
        "schur_retry_list",
        (1, 1, 1),
        1024,
        0,
        Args::new()
            .ptr(ws.info.get().ptr)
            .ptr(ws.masked.get().ptr)
            .i32(n as i32)
            .i32(capacity as i32)
            .ptr(ws.first_info.get().ptr)
            .ptr(ws.retry_ids.get().ptr),
    )?;
    if capacity > 0 {
        let ids = ws.retry_ids.get();
        let reg = RETRY_REGULARIZE;
        launchers::assemble(g, capacity, Some(ids), ws, region, reg, Solve::Schur)?;
        sweep(g, ws, capacity, Some(ids))?;
    }
    Ok(())
}

/// Values per live patch in the host buffer of the sweeps' verdicts: the first verdict, the
/// last, the masked flag.
pub(crate) const VERDICTS_PER_PATCH: usize = 3;

/// The device arrays of the sweeps' verdicts, in the order of their host buffer, and the
/// second-neighbour coupling.
pub(crate) struct DeviceVerdicts<'a> {
    pub first: &'a DevBuf<i32>,
    pub last: &'a DevBuf<i32>,
    pub masked: &'a DevBuf<i32>,
    pub coupling: &'a DevBuf<f64>,
}

impl DeviceVerdicts<'_> {
    /// Queues the copies of the verdicts of `n` patches from patch `p0` on into `verdicts`
    /// ([`VERDICTS_PER_PATCH`] `n` values) and of their coupling into `coupling`, on the
    /// stream of the copies back.
    pub(crate) fn copy(
        &self,
        dev: &Device,
        p0: usize,
        verdicts: &mut [i32],
        coupling: &mut [f64],
    ) -> Result<()> {
        let n = coupling.len();
        let (first, rest) = verdicts.split_at_mut(n);
        let (last, masked) = rest.split_at_mut(n);
        dev.copy_back(first, self.first, p0, "first sweep verdicts")?;
        dev.copy_back(last, self.last, p0, "sweep verdicts")?;
        dev.copy_back(masked, self.masked, p0, "masked flags")?;
        dev.copy_back(coupling, self.coupling, p0, "second-neighbour coupling")
    }
}

/// The patches (indices in the wave's batch, ascending) that the CPU reference solves, from
/// a wave's verdicts and coupling: those with weight that failed twice, or whose coupling is
/// over `coupling_max` (NaN included). The one definition: [`outcome`] takes its coupled
/// patches from here.
pub(crate) fn cpu_patches(verdicts: &[i32], coupling: &[f64], coupling_max: f64) -> Vec<usize> {
    let n = coupling.len();
    let (first, rest) = verdicts.split_at(n);
    let (last, masked) = rest.split_at(n);
    (0..n)
        .filter(|&i| masked[i] == 0)
        .filter(|&i| (first[i] != 0 && last[i] != 0) || !(coupling[i] <= coupling_max))
        .collect()
}

/// Second-neighbour coupling of a wave: patches over the bound, and the largest of all.
pub(crate) struct Coupling {
    pub patches: usize,
    pub largest: f64,
}

/// The outcome of the sweeps of a wave's `patches` from the verdicts copied back
/// ([`DeviceVerdicts`]) once the device is done with the wave: DESIGN step 2 as on the dense
/// route, then the coupling check, which sends the patches beyond `coupling_max` to the CPU
/// reference as well.
pub(crate) fn outcome(
    patches: &[&Patch],
    verdicts: &[i32],
    coupling: &[f64],
    capacity: usize,
    coupling_max: f64,
) -> (Factorization, Coupling) {
    let n = patches.len();
    let (first, rest) = verdicts.split_at(n);
    let (last, masked) = rest.split_at(n);
    let mut fact = Factorization::from_verdicts(patches, first, last, masked.to_vec());
    if capacity > 0 && fact.retried > capacity {
        tracing::warn!(
            "{} patches of a wave were not positive definite; the device retried {capacity} of them, the CPU reference solves the others",
            fact.retried
        );
    }
    // the CPU's patches less those that failed twice: the coupled ones
    let coupled: Vec<usize> = cpu_patches(verdicts, coupling, coupling_max)
        .into_iter()
        .filter(|i| !fact.to_cpu.contains(i))
        .collect();
    for &i in &coupled {
        tracing::debug!(
            "patch fibers {:?} bins {:?}: second-neighbour coupling {:.1e} over {coupling_max:.0e}, solved densely on the CPU",
            patches[i].fibers,
            patches[i].waves,
            coupling[i]
        );
    }
    let largest = (0..n)
        .filter(|&i| fact.masked[i] == 0)
        .map(|i| coupling[i])
        .fold(0f64, f64::max);
    fact.to_cpu.extend(&coupled);
    (
        fact,
        Coupling {
            patches: coupled.len(),
            largest,
        },
    )
}

#[cfg(test)]
mod tests {
    use super::super::dense::tests::bundle_plan;
    use super::*;
    use crate::extract::PatchStatus;

    #[test]
    fn outcome_sends_failures_and_coupled_patches_to_the_cpu() {
        let plan = bundle_plan();
        let patches: Vec<&Patch> = plan.patches.iter().take(5).collect();
        // first verdicts, last verdicts, masked flags
        let verdicts = [
            [0, 1, 0, 0, 1], // 1 and 4 failed
            [0, 0, 0, 0, 1], // 1 saved by the retry, 4 not
            [0, 0, 0, 1, 0], // 3 without weight
        ]
        .concat();
        // 2 is over the bound, 3 would be but has no weight; NaN counts as coupled
        let coupling = [1e-15, 1e-14, 1e-10, 1e-3, f64::NAN];
        let (f, c) = outcome(&patches, &verdicts, &coupling, 32, 1e-12);
        assert_eq!(f.status[1], PatchStatus::Regularized);
        assert_eq!(f.retried, 2);
        assert_eq!(f.to_cpu, [4, 2]);
        assert_eq!(c.patches, 1);
        assert_eq!(c.largest, 1e-10);
        assert_eq!(cpu_patches(&verdicts, &coupling, 1e-12), [2, 4]);
    }

    #[test]
    fn no_device_retry_under_the_retry_regularisation() {
        assert_eq!(retry_capacity(32, 800, RETRY_REGULARIZE), 0);
        assert_eq!(retry_capacity(32, 800, 0.0), 32);
        assert_eq!(retry_capacity(32, 5, 0.0), 5);
    }
}
