//! Typed launchers, one per kernel of `kernels/`: each takes the buffers its kernel reads and
//! writes and fills in the argument list in the kernel's order, so that the steps of the solve
//! read as calls.

use super::buffers::DevBuf;
use super::device::Device;
use super::kernels::{launch, Args, Kernels};
use super::shape::Shape;
use super::tuning::Solve;
use super::workspace::{Region, Workspace};
use crate::backend::cpu::EIGEN_CLIP;
use crate::error::Result;
use crate::psf::GaussHermitePsf;

/// The device, its kernels and the shapes of a call: what every launch needs.
#[derive(Clone, Copy)]
pub(crate) struct Gpu<'a> {
    pub dev: &'a Device,
    pub k: &'a Kernels,
    pub sh: &'a Shape,
}

impl Args {
    /// The uploaded region of the CCD as the kernels take it: first row, first column, width.
    pub(crate) fn region(self, r: Region) -> Self {
        self.i32(r.row0 as i32)
            .i32(r.col0 as i32)
            .i32(r.width as i32)
    }

    /// A wave's normal equations as the assembly writes them and the store of kept
    /// equations copies them: icov, y, fluxweight, the unregularised diagonal, the masked
    /// weights.
    pub(crate) fn equations(self, ws: &Workspace) -> Self {
        self.ptr(ws.icov.get().ptr)
            .ptr(ws.y.get().ptr)
            .ptr(ws.fw.get().ptr)
            .ptr(ws.diag0.get().ptr)
            .ptr(ws.pixmask.get().ptr)
    }

    /// A patch's shape as the kernels that walk its spots over the image take it: m, the
    /// spot's nx and ny, nwavetot, ncore, wavepad, nwavestep.
    fn patch_shape(self, sh: &Shape) -> Self {
        self.i32(sh.m() as i32)
            .i32(sh.nx as i32)
            .i32(sh.ny as i32)
            .i32(sh.nt as i32)
            .i32(sh.ncore as i32)
            .i32(sh.wavepad as i32)
            .i32(sh.nws as i32)
    }
}

/// Where a decorrelation kernel writes, per core block: flux, ivar and resolution diagonals
/// (`nwavestep` each) and the core flux by column (for the core model).
#[derive(Clone, Copy)]
pub(crate) struct CoreOut {
    pub flux: u64,
    pub ivar: u64,
    pub res: u64,
    pub fluxcol: u64,
}

/// The covariance-side input of a decorrelation: `count` blocks of order `sh.nt`, the xflux
/// vectors of their patches and the kept bins per patch.
#[derive(Clone, Copy)]
pub(crate) struct CoreIn {
    pub blocks: u64,
    pub count: usize,
    pub xflux: u64,
    pub nkeep: u64,
    /// A count per patch, nonzero for a patch left out (one whose outlier test found outliers:
    /// only the solution of its re-solve is kept), or 0 to decorrelate every patch.
    pub skip: u64,
}

/// Spots evaluated by one block, one per warp.
const SPOTS_PER_BLOCK: usize = 4;

/// Spots of `nspot` (fiber, wavelength) pairs from the trace positions and PSF coefficients
/// in the workspace.
pub(crate) fn spots(
    g: Gpu<'_>,
    psf: &GaussHermitePsf,
    ws: &Workspace,
    first: usize,
    nspot: usize,
) -> Result<()> {
    if first >= nspot {
        return Ok(());
    }
    let sh = g.sh;
    let (ngx, ngy) = (psf.ghdegx + 1, psf.ghdegy + 1);
    // per warp: edges and pixel integrals of both axes, the partial sums, the parameters
    let per_warp = (sh.nx + 1) * (1 + psf.ghdegx)
        + ngx * sh.nx
        + (sh.ny + 1) * (1 + psf.ghdegy)
        + ngy * sh.ny
        + ngx * sh.ny
        + 2
        + ngx * ngy;
    let (wmin, wmax) = psf.param_domain();
    launch(
        g.dev,
        &g.k.spots,
        "spots_f64",
        ((nspot - first).div_ceil(SPOTS_PER_BLOCK) as u32, 1, 1),
        32 * SPOTS_PER_BLOCK as u32,
        per_warp * SPOTS_PER_BLOCK * 8,
        Args::new()
            .ptr(ws.view.xy)
            .ptr(ws.view.coef)
            .ptr(ws.input.waves.get().ptr)
            .i32(first as i32)
            .i32(nspot as i32)
            .i32(sh.nfull as i32)
            .i32(psf.ghsigx.ncoef as i32)
            .f64(wmin)
            .f64(wmax)
            .i32(psf.ghdegx as i32)
            .i32(psf.ghdegy as i32)
            .i32(sh.nx as i32)
            .i32(sh.ny as i32)
            .ptr(ws.spots_ptr()),
    )
}

/// Columns of icov per block of the assembly, a warp each (`SPEX_COLUMNS` in
/// kernels/assemble.cu).
const ASSEMBLY_COLUMNS: usize = 4;

/// Assembly (and regularisation) of icov, y and fluxweight for the patches `ids` (all `n`
/// live patches when None). icov is symmetric and only one triangle is computed and stored,
/// each overlap once: densely for the dense route (row-major `j2 >= j1`, cuSOLVER's lower
/// triangle), in band storage for the Schur route (kernels/common.cuh).
pub(crate) fn assemble(
    g: Gpu<'_>,
    n: usize,
    ids: Option<&DevBuf<i32>>,
    ws: &Workspace,
    region: Region,
    reg: f64,
    solve: Solve,
) -> Result<()> {
    let sh = g.sh;
    let m = sh.m();
    let band = i32::from(solve == Solve::Schur);
    let size = sh.nx * sh.ny;
    let ids_ptr = ids.map_or(0, |b| b.ptr);
    let (kept_slots, kept) = ws.reject.kept_args();
    let args = Args::new()
        .ptr(ws.spots_ptr())
        .ptr(ws.view.corners)
        .ptr(ws.colspot.get().ptr)
        .ptr(ws.view.boxes)
        .ptr(ids_ptr)
        .ptr(ws.view.pix)
        .ptr(ws.view.ivar)
        .ptr(ws.view.boxoff)
        .ptr(ws.reject.weights_ptr())
        .region(region)
        .patch_shape(sh)
        .i32(band)
        .equations(ws)
        .ptr(kept_slots)
        .ptr(kept);
    // the patches that start from kept equations (a re-solve), then the others
    let kernels: &[(&_, &str)] = if kept_slots != 0 {
        &[
            (&g.k.downdate, "downdate_f64"),
            (&g.k.assemble, "assemble_f64"),
        ]
    } else {
        &[(&g.k.assemble, "assemble_f64")]
    };
    for (k, name) in kernels {
        launch(
            g.dev,
            k,
            name,
            (m.div_ceil(ASSEMBLY_COLUMNS) as u32, n as u32, 1),
            // a warp per column, the kernel's launch bounds
            32 * ASSEMBLY_COLUMNS as u32,
            // a weighted spot per warp
            ASSEMBLY_COLUMNS * size * 8,
            args.clone(),
        )?;
    }
    launch(
        g.dev,
        &g.k.regularize,
        "regularize_f64",
        (n as u32, 1, 1),
        256,
        0,
        Args::new()
            .ptr(ws.icov.get().ptr)
            .ptr(ws.fw.get().ptr)
            .ptr(ws.diag0.get().ptr)
            .ptr(ids_ptr)
            .i32(m as i32)
            .i32(sh.nt as i32)
            .i32(band)
            .f64(reg)
            .ptr(ws.masked.get().ptr),
    )
}

/// The column tables of a wave's `n` patches from the first spot of each fiber block.
pub(crate) fn column_table(g: Gpu<'_>, ws: &Workspace, n: usize) -> Result<()> {
    let (nb, nt) = (g.sh.nblock, g.sh.nt);
    let total = n * nb * nt;
    if total == 0 {
        return Ok(());
    }
    launch(
        g.dev,
        &g.k.column_table,
        "column_table",
        (total.div_ceil(256).min(65535) as u32, 1, 1),
        256,
        0,
        Args::new()
            .ptr(ws.view.first_spots)
            .i32(nb as i32)
            .i32(nt as i32)
            .i32(n as i32)
            .ptr(ws.colspot.get().ptr),
    )
}

/// `count` identity matrices of order `n` into `x`.
pub(crate) fn eye(g: Gpu<'_>, x: &DevBuf<f64>, n: usize, count: usize) -> Result<()> {
    launch(
        g.dev,
        &g.k.eye,
        "eye_f64",
        (((count * n * n).div_ceil(256)).min(65535 * 8) as u32, 1, 1),
        256,
        0,
        Args::new().ptr(x.ptr).i32(n as i32).i64(count as i64),
    )
}

/// Largest order, rounded up to 8 x 8 tiles, of the tile kernels (8 `SPEX_TILES` in
/// kernels/tiles.cuh): the polar decorrelation and the Schur sweeps, whose order is the block's
/// plus one, run up to it; larger blocks take the Jacobi and dense routes.
pub(crate) const TILE_MAX_ORDER: usize = 80;

/// Shared memory of the Jacobi kernel for blocks of order `n`: every block size the GPU
/// decorrelates must fit it, as the route of last resort.
pub(crate) fn jacobi_smem(n: usize) -> usize {
    let npair = n.div_ceil(2);
    let ints = 2 * npair + 2 + npair * (npair + 1);
    (2 * n * n + 2 * npair + 2 * n + 32) * 8 + ints * 4
}

/// Shared memory of the polar kernel for blocks of order `n`.
fn polar_smem(n: usize) -> usize {
    let nn = n.div_ceil(8) * 8;
    (2 * nn * (nn + 4) + 2 * n + 32) * 8
}

/// The polar decorrelation of the blocks of `input` (C when `from_cov`, else S = C^-1).
/// `steps` gets each block's number of steps, or a negative verdict; `pbuf` holds `n * n`
/// doubles per block of scratch, or, when `factored` (S only), each block's Cholesky factor,
/// which the kernel then starts from.
#[allow(clippy::too_many_arguments)]
pub(crate) fn polar(
    g: Gpu<'_>,
    input: CoreIn,
    from_cov: bool,
    factored: bool,
    tol: f64,
    max_steps: usize,
    pbuf: &DevBuf<f64>,
    out: CoreOut,
    steps: &DevBuf<i32>,
    qout: u64,
) -> Result<()> {
    let sh = g.sh;
    let n = sh.nt;
    launch(
        g.dev,
        &g.k.polar,
        "polar_f64",
        (input.count as u32, 1, 1),
        (4 * n.div_ceil(8) * 8) as u32,
        polar_smem(n),
        Args::new()
            .ptr(input.blocks)
            .i32(from_cov as i32)
            .i32(factored as i32)
            .ptr(input.xflux)
            .ptr(input.nkeep)
            .i32(n as i32)
            .i32(sh.m() as i32)
            .i32(sh.ncore as i32)
            .i32(sh.wavepad as i32)
            .i32(sh.nws as i32)
            .i32(sh.ndiag as i32)
            .f64(tol)
            .i32(max_steps as i32)
            .ptr(pbuf.ptr)
            .ptr(out.flux)
            .ptr(out.ivar)
            .ptr(out.res)
            .ptr(out.fluxcol)
            .ptr(steps.ptr)
            .ptr(qout)
            .ptr(input.skip),
    )
}

/// The Jacobi decorrelation of the blocks of `input` (C when `from_cov`, else S = C^-1): all
/// of them, or only those whose entry of `only_failed` is negative.
#[allow(clippy::too_many_arguments)]
pub(crate) fn jacobi(
    g: Gpu<'_>,
    input: CoreIn,
    from_cov: bool,
    tol: f64,
    threads: u32,
    out: CoreOut,
    sweeps: &DevBuf<i32>,
    qout: u64,
    only_failed: Option<&DevBuf<i32>>,
) -> Result<()> {
    let sh = g.sh;
    let n = sh.nt;
    let npair = n.div_ceil(2);
    let smem = jacobi_smem(n);
    let rows = (threads / npair as u32).max(1);
    launch(
        g.dev,
        &g.k.decorrelate,
        "decorrelate_f64",
        (input.count as u32, 1, 1),
        (npair as u32, rows),
        smem,
        Args::new()
            .ptr(input.blocks)
            .ptr(input.xflux)
            .ptr(input.nkeep)
            .i32(from_cov as i32)
            .i32(n as i32)
            .i32(sh.m() as i32)
            .i32(sh.ncore as i32)
            .i32(sh.wavepad as i32)
            .i32(sh.nws as i32)
            .i32(sh.ndiag as i32)
            .f64(EIGEN_CLIP)
            .f64(tol)
            .ptr(out.flux)
            .ptr(out.ivar)
            .ptr(out.res)
            .ptr(out.fluxcol)
            .ptr(sweeps.ptr)
            .ptr(qout)
            .ptr(only_failed.map_or(0, |b| b.ptr))
            .ptr(input.skip),
    )
}

/// Adds A x of the `n` patches into their model boxes.
pub(crate) fn project(
    g: Gpu<'_>,
    n: usize,
    ws: &Workspace,
    x: &DevBuf<f64>,
    core: u64,
) -> Result<()> {
    let sh = g.sh;
    let m = sh.m();
    launch(
        g.dev,
        &g.k.project,
        "project_f64",
        (m as u32, n as u32, 1),
        64,
        0,
        Args::new()
            .ptr(ws.spots_ptr())
            .ptr(ws.view.corners)
            .ptr(ws.colspot.get().ptr)
            .ptr(ws.view.boxes)
            .ptr(ws.view.boxoff)
            .ptr(x.ptr)
            .i32(m as i32)
            .i32(sh.nx as i32)
            .i32(sh.ny as i32)
            .ptr(ws.model.get().ptr)
            .ptr(core)
            .i32(sh.nt as i32)
            .i32(sh.ncore as i32)
            .i32(sh.wavepad as i32),
    )
}

/// Core bins per block of chi2pix, a warp each (`SPEX_CHI2_BINS` in kernels/finalize.cu).
const CHI2_BINS: usize = 8;

/// chi2pix of the core bins of the `n` patches against their model boxes.
pub(crate) fn chi2pix(
    g: Gpu<'_>,
    n: usize,
    ws: &Workspace,
    region: Region,
    psferr: f64,
    outliers: u64,
) -> Result<()> {
    let sh = g.sh;
    launch(
        g.dev,
        &g.k.chi2pix,
        "chi2pix_f64",
        ((sh.ncore * sh.nws).div_ceil(CHI2_BINS) as u32, n as u32, 1),
        (CHI2_BINS * 32) as u32,
        0,
        Args::new()
            .ptr(ws.spots_ptr())
            .ptr(ws.view.corners)
            .ptr(ws.colspot.get().ptr)
            .ptr(ws.view.boxes)
            .ptr(ws.view.boxoff)
            .ptr(ws.model.get().ptr)
            .ptr(ws.view.pix)
            .ptr(ws.view.ivar)
            .ptr(ws.reject.weights_ptr())
            .region(region)
            .ptr(ws.view.nkeep)
            .patch_shape(sh)
            .f64(psferr)
            .ptr(outliers)
            .ptr(ws.chi2.get().ptr),
    )
}
