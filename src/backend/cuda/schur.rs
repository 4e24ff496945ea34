//! Steps 2-3 of the solve by per-fiber Schur complements (kernels/schur.cu): two block sweeps
//! over the fibers of every patch and one combine give each core block's Schur complement
//! S_b = C_bb^-1 (the input of the polar decorrelation) and xflux, in about a tenth of the
//! arithmetic of a dense Cholesky plus inverse and without its round trips through cuSOLVER.
//!
//! Failures follow DESIGN step 2 as on the dense route: a patch whose icov is not positive
//! definite is re-assembled with regularize 1e-4 and swept again, and a second failure goes to
//! the CPU reference. A patch whose second-neighbour coupling (dropped by the sweeps) exceeds
//! the tuning's bound also goes to the CPU reference, which solves it densely. The sweeps walk
//! the blocks in fiber order along the CCD (from the column table), not in storage order
//! (padding fibers first): in storage order a padding fiber and its core neighbour sit two
//! blocks apart, so the sweeps would drop a first-neighbour coupling.
//!
//! The kernels read icov only in the triangle the assembly stores (row-major `j2 >= j1`, the
//! dense route's cuSOLVER lower triangle): a block in the other triangle is read as its stored
//! transpose, row-wise for coalesced loads, and transposed in shared memory.

use super::dense::{retry_failures, Attempt, Factorization};
use super::device::DevBuf;
use super::kernels::{launch, Args};
use super::launchers::Gpu;
use super::workspace::{Region, Workspace};
use crate::error::Result;
use crate::plan::Patch;

/// Launches the sweeps and the combine for `count` patches (`ids`, or the first `count`).
fn sweep(g: Gpu<'_>, ws: &Workspace, count: usize, ids: Option<&DevBuf<i32>>) -> Result<()> {
    let sh = g.sh;
    let (n, m, nb) = (sh.nt, sh.m(), sh.nblock);
    let big = (n + 1).div_ceil(8) * 8;
    let tiles = n.div_ceil(8) * 8;
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
            .ptr(ws.input.colspot.get().ptr)
            .i32(m as i32)
            .i32(n as i32)
            .i32(nb as i32)
            .ptr(ws.su.get().ptr)
            .ptr(ws.sv.get().ptr)
            .ptr(ws.info.get().ptr)
            .ptr(ws.coupling.get().ptr),
    )?;
    launch(
        g.dev,
        &g.k.schur_combine,
        "schur_combine_f64",
        (nb as u32, count as u32, 1),
        (4 * tiles) as u32,
        (tiles * (tiles + 4) + n) * 8,
        Args::new()
            .ptr(ws.icov.get().ptr)
            .ptr(ws.y.get().ptr)
            .ptr(ids_ptr)
            .i32(m as i32)
            .i32(n as i32)
            .i32(nb as i32)
            .i32(sh.ncore as i32)
            .ptr(ws.su.get().ptr)
            .ptr(ws.sv.get().ptr)
            .ptr(ws.sblocks.get().ptr)
            .ptr(ws.pbuf.get().ptr)
            .ptr(ws.x.get().ptr)
            .ptr(ws.info.get().ptr),
    )
}

/// Allocates the sweeps' buffers for `n` patches.
pub(crate) fn ensure(g: Gpu<'_>, ws: &mut Workspace, n: usize) -> Result<()> {
    let sh = g.sh;
    let (nt, nb) = (sh.nt, sh.nblock);
    ws.su.ensure(g.dev, n * 2 * nb * nt * nt)?;
    ws.sv.ensure(g.dev, n * 2 * nb * nt)?;
    ws.sblocks.ensure(g.dev, n * sh.ncore * nt * nt)?;
    // the combine's Cholesky factors of the core blocks, which the polar route starts from
    ws.pbuf.ensure(g.dev, n * sh.ncore * nt * nt)?;
    ws.info.ensure(g.dev, n)?;
    ws.coupling.ensure(g.dev, n)?;
    Ok(())
}

/// Second-neighbour coupling of a chunk: patches over the bound, and the largest of all.
pub(crate) struct Coupling {
    pub patches: usize,
    pub largest: f64,
}

/// The sweeps of the `patches` (the chunk's live ones), with the retry of failures and the
/// coupling check; patches beyond `coupling_max` go to the CPU reference.
pub(crate) fn factorize(
    g: Gpu<'_>,
    ws: &Workspace,
    patches: &[&Patch],
    region: Region,
    regularize: f64,
    coupling_max: f64,
) -> Result<(Factorization, Coupling)> {
    let (dev, n) = (g.dev, patches.len());
    dev.zero_prefix(ws.info.get(), n)?;
    sweep(g, ws, n, None)?;
    let mut info = vec![0i32; n];
    let mut masked = vec![0i32; n];
    let mut coupling = vec![0f64; n];
    dev.copy_from(&mut info, ws.info.get(), 0, "sweep verdicts")?;
    dev.copy_from(&mut masked, ws.masked.get(), 0, "masked flags")?;
    dev.copy_from(
        &mut coupling,
        ws.coupling.get(),
        0,
        "second-neighbour coupling",
    )?;
    dev.sync("Schur sweeps")?;
    let first = Attempt {
        patches,
        info: &info,
        masked,
        regularize,
    };
    let mut fact = retry_failures(g, ws, region, first, |failed, ids| {
        let mut again = vec![0i32; n];
        dev.zero_prefix(ws.info.get(), n)?;
        sweep(g, ws, failed.len(), Some(ids))?;
        dev.copy_from(&mut again, ws.info.get(), 0, "sweep verdicts")?;
        dev.sync("Schur sweeps of the retried patches")?;
        Ok(failed.iter().map(|&i| again[i] == 0).collect())
    })?;
    let (masked, to_cpu) = (&fact.masked, &fact.to_cpu);
    let coupled: Vec<usize> = (0..n)
        .filter(|&i| masked[i] == 0 && !to_cpu.contains(&i) && !(coupling[i] <= coupling_max))
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
        .filter(|&i| masked[i] == 0)
        .map(|i| coupling[i])
        .fold(0f64, f64::max);
    fact.to_cpu.extend(&coupled);
    Ok((
        fact,
        Coupling {
            patches: coupled.len(),
            largest,
        },
    ))
}
