//! The shapes shared by every patch of a frame (spot, patch, fiber blocks, bins, resolution
//! band) and what follows from them: matrix orders and the device bytes a patch needs. Both
//! the host tables (`tables`) and the device buffers (`workspace`) are sized from them.

use super::tuning::Solve;
use crate::backend::FrameInput;
use crate::plan::Patch;

/// Shapes shared by every patch of a call.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Shape {
    pub nx: usize,
    pub ny: usize,
    pub nt: usize,
    pub nws: usize,
    pub wavepad: usize,
    pub ncore: usize,
    pub nblock: usize,
    pub nfull: usize,
    pub bundlesize: usize,
    pub ndiag: usize,
}

impl Shape {
    pub(crate) fn new(input: &FrameInput<'_>, patches: &[Patch]) -> Self {
        let plan = input.plan;
        let (ny, nx) = input.psf.spot_shape();
        let ncore = plan.options.layout.bundlesize / plan.options.layout.nsubbundles;
        let nblock = patches
            .iter()
            .map(|p| p.nspecpad())
            .max()
            .unwrap_or(ncore)
            .max(ncore);
        Shape {
            nx,
            ny,
            nt: plan.nwavetot,
            nws: plan.options.layout.nwavestep,
            wavepad: plan.wavepad,
            ncore,
            nblock,
            nfull: plan.fullwave.len(),
            bundlesize: plan.options.layout.bundlesize,
            ndiag: input.psf.hsizey,
        }
    }

    pub(crate) fn m(&self) -> usize {
        self.nblock * self.nt
    }

    pub(crate) fn mc(&self) -> usize {
        self.ncore * self.nt
    }

    pub(crate) fn nd(&self) -> usize {
        2 * self.ndiag + 1
    }

    /// Doubles per stored row of a patch's icov (kernels/common.cuh): m on the dense route,
    /// which hands the whole matrix to cuSOLVER; on the Schur route the band of
    /// [`BAND_BLOCKS`] fiber blocks that the sweeps and the coupling check read.
    pub(crate) fn icov_row_len(&self, solve: Solve) -> usize {
        match solve {
            Solve::Dense => self.m(),
            Solve::Schur => BAND_BLOCKS * self.nt,
        }
    }

    /// Device bytes per patch of the per-patch buffers (icov, which on the dense route later
    /// holds the covariance blocks; L22^-1 on the dense route, the complements, the end
    /// fibers' factors and the sweeps' vectors on the Schur route; the parked polar factors,
    /// vectors, pixmask and chi2pix), without the model boxes.
    /// Device bytes of one bundle's spots: each of its fibers on the padded grid.
    pub(crate) fn bundle_spot_bytes(&self) -> usize {
        8 * self.bundlesize * self.nfull * self.ny * self.nx
    }

    /// Patches that share one bundle's spots: its sub-bundles times the patches along the
    /// grid (at least 1).
    pub(crate) fn patches_per_bundle(&self) -> usize {
        let along = self.nfull.saturating_sub(2 * self.wavepad) / self.nws.max(1);
        (self.bundlesize / self.ncore.max(1)).max(1) * along.max(1)
    }

    pub(crate) fn bytes_per_patch(&self, solve: Solve) -> usize {
        let (m, mc, nt) = (self.m(), self.mc(), self.nt);
        let route = match solve {
            Solve::Dense => mc * mc,
            Solve::Schur => self.ncore * nt * nt + 2 * nt * nt + 2 * self.nblock * nt,
        };
        let icov = m * self.icov_row_len(solve);
        8 * (icov + route + self.ncore * nt * nt + 6 * m + 2 * self.ncore * self.nws) + 4 * m + 64
    }
}

/// Fiber blocks per stored row of icov on the Schur route, `SPEX_BAND_BLOCKS` in
/// kernels/common.cuh: the fiber's own block and those of the next two fibers along the CCD.
pub(crate) const BAND_BLOCKS: usize = 3;
