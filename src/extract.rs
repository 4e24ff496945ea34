//! What every backend shares about a patch: the options of the solve, the pixel box a patch
//! covers on the CCD, the order of its unknowns and the shape of its results.
//!
//! The solve itself (B&S eq. 4 and 17-19) is stated in DESIGN terms in [`crate::backend::cpu`],
//! the reference implementation; other backends must reproduce its results.

use std::ops::Range;

use serde::{Deserialize, Serialize};

use crate::frame::PatchRow;
use crate::plan::{Patch, Plan};
use crate::psf::Corners;

/// Options of the patch solve that do not change the plan.
#[derive(Clone, Debug, PartialEq)]
pub struct SolveOptions {
    /// Extra diagonal regularisation `alpha` of icov (`-r`), applied where a bin is well
    /// constrained; poorly constrained bins get `minweight - fluxweight`.
    pub regularize: f64,
    /// Fractional PSF model error used by chi2pix.
    pub psferr: f64,
    /// Whether to return model images of the patches (`-m`).
    pub model: bool,
    /// `--reject-outliers NSIGMA`: pixels beyond NSIGMA times the model's noise are
    /// rejected and the patch solved again (see [`crate::outliers`]); `None`: off.
    pub reject_outliers: Option<f64>,
}

/// How a patch was solved, for logs and statistics.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum PatchStatus {
    /// Solved as planned: the Schur-complement sweeps, or the dense Cholesky route where the
    /// CPU backend falls back to it (see [`crate::backend::cpu`]).
    Ok,
    /// Cholesky failed and succeeded again with `regularize = 1e-4`.
    Regularized,
    /// Cholesky failed twice; the clipped eigendecomposition was used.
    EigenFallback,
    /// No usable pixel: the values of [`PatchResult::unconstrained`] (flux 0, ivar of the
    /// regularisation alone, resolution the identity), as gpu_specter's solve leaves them.
    Masked,
    /// The patch is off the CCD: flux 0, ivar 0.
    OffImage,
    /// The solve produced NaN or infinity: flux 0, ivar 0.
    NonFinite,
}

/// A model image of one patch: `A_core flux_core` on its pixel box.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct ModelPatch {
    pub rows: Range<usize>,
    pub cols: Range<usize>,
    /// `[row][col]` over the box.
    pub data: Vec<f64>,
}

/// Core results of one patch: `nfiber` core fibers by `nwave` kept output bins, in photons
/// per bin (the frame converts to per Angstrom).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct PatchResult {
    /// Index of the patch in the plan.
    pub patch: usize,
    pub nfiber: usize,
    pub nwave: usize,
    /// Number of resolution diagonals on each side (`HSIZEY`).
    pub ndiag: usize,
    pub status: PatchStatus,
    /// `[fiber][wave]`.
    pub flux: Vec<f64>,
    pub ivar: Vec<f64>,
    /// `[fiber][2 ndiag + 1][wave]`, `Rdiags[k][j] = R[j - ndiag + k][j]`.
    pub resolution: Vec<f64>,
    pub pixmask_fraction: Vec<f64>,
    pub chi2pix: Vec<f64>,
    pub model: Option<ModelPatch>,
    /// `[fiber][wave]`: the fraction of each core spot on pixels rejected as outliers
    /// (empty when rejection is off).
    #[serde(default)]
    pub rejected: Vec<f64>,
    /// Pixels of the patch rejected as outliers.
    #[serde(default)]
    pub nrejected: usize,
    /// Times the patch was solved again after rejecting pixels.
    #[serde(default)]
    pub nresolves: usize,
    /// Whether the backend placed the values straight into the frame's arrays
    /// ([`crate::frame::FrameValues`], [`crate::backend::Backend::extract_into`]): flux, ivar,
    /// resolution, pixmask_fraction and chi2pix are then empty here. Such a result never
    /// leaves the process that holds those arrays.
    #[serde(default)]
    pub placed: bool,
}

impl PatchResult {
    /// An all-zero result (flux 0, ivar 0) for a patch that could not be solved.
    pub fn empty(patch: &Patch, ndiag: usize, status: PatchStatus) -> Self {
        let (nf, nw) = (patch.fibers.len(), patch.waves.len());
        PatchResult {
            patch: patch.index,
            nfiber: nf,
            nwave: nw,
            ndiag,
            status,
            flux: vec![0.0; nf * nw],
            ivar: vec![0.0; nf * nw],
            resolution: vec![0.0; nf * (2 * ndiag + 1) * nw],
            pixmask_fraction: vec![0.0; nf * nw],
            chi2pix: vec![0.0; nf * nw],
            model: None,
            rejected: Vec::new(),
            nrejected: 0,
            nresolves: 0,
            placed: false,
        }
    }

    /// The result of a patch whose values the backend placed in the frame's arrays.
    pub fn placed(patch: &Patch, ndiag: usize, status: PatchStatus) -> Self {
        PatchResult {
            patch: patch.index,
            nfiber: patch.fibers.len(),
            nwave: patch.waves.len(),
            ndiag,
            status,
            flux: Vec::new(),
            ivar: Vec::new(),
            resolution: Vec::new(),
            pixmask_fraction: Vec::new(),
            chi2pix: Vec::new(),
            model: None,
            rejected: Vec::new(),
            nrejected: 0,
            nresolves: 0,
            placed: true,
        }
    }

    /// The result of a patch whose normal equations are all zero, given its core bins'
    /// `pixmask_fraction`. Where every core bin's spot lies on masked pixels, the pixels exist
    /// but none is usable: [`PatchResult::unconstrained`], as desispec writes them. Where a
    /// spot reaches no pixel at all (a PSF of zero width), there is nothing to regularise:
    /// ivar 0, which the frame flags ALLBADPIX with a warning.
    pub fn without_usable_pixels(
        patch: &Patch,
        ndiag: usize,
        regularize: f64,
        pixmask_fraction: Vec<f64>,
    ) -> Self {
        let masked = pixmask_fraction.iter().all(|&f| f > 0.5);
        let mut r = if masked {
            PatchResult::unconstrained(patch, ndiag, regularize)
        } else {
            PatchResult::empty(patch, ndiag, PatchStatus::Masked)
        };
        r.pixmask_fraction = pixmask_fraction;
        r
    }

    /// What gpu_specter's regularised solve leaves for a patch that no usable pixel
    /// constrains (every `fluxweight` 0, so `minweight` is 0 and no bin counts as poorly
    /// constrained): `icov = d I` with `d = regularize^2 + 1e-15`, `xflux = 0`, each fiber's
    /// covariance block `C_b = I / d`, `Q_b = C_b^(-1/2)` diagonal, `R` the identity and
    /// `ivar = Q_jj^2`, computed in gpu_specter's order of operations (the inverse of the
    /// eigenvalue, the eigenvalue of `C_b`, `sqrt(1 / w)`, squared) so that it is the same
    /// value. desispec writes these bins as they come (IVAR `1e-15 dw^2`, RESOLUTION the
    /// identity): its sky step averages RESOLUTION over all fibers, so zero rows here would
    /// change the sky model of every fiber. chi2pix is 0 (no pixel counts) and the model 0.
    pub fn unconstrained(patch: &Patch, ndiag: usize, regularize: f64) -> Self {
        let mut r = PatchResult::empty(patch, ndiag, PatchStatus::Masked);
        let d = regularize * regularize + 1e-15;
        let w = 1.0 / d;
        let q = (1.0 / w).sqrt();
        r.ivar.fill(q * q);
        let (nd, nk) = (2 * ndiag + 1, r.nwave);
        for c in 0..r.nfiber {
            r.resolution[(c * nd + ndiag) * nk..(c * nd + ndiag + 1) * nk].fill(1.0);
        }
        r
    }

    /// The values of core fiber `local` (of a result that holds them), with `nd` resolution
    /// diagonals.
    pub fn row(&self, local: usize, nd: usize) -> PatchRow<'_> {
        let nw = self.nwave;
        PatchRow {
            flux: &self.flux[local * nw..],
            ivar: &self.ivar[local * nw..],
            chi2pix: &self.chi2pix[local * nw..],
            fraction: &self.pixmask_fraction[local * nw..],
            res: &self.resolution[local * nd * nw..],
            res_stride: nw,
        }
    }

    /// Whether every output value is finite.
    pub fn is_finite(&self) -> bool {
        [
            &self.flux,
            &self.ivar,
            &self.resolution,
            &self.chi2pix,
            &self.pixmask_fraction,
        ]
        .iter()
        .all(|v| v.iter().all(|x| x.is_finite()))
    }
}

/// The CCD pixels a patch uses and the order of its unknowns.
///
/// Unknowns are ordered fiber block by fiber block, each block `nwavetot` bins long, with the
/// padding fibers first and the core fibers last: the core blocks of `icov^-1` then depend
/// only on the trailing block of the Cholesky factor.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PatchGeometry {
    /// CCD rows kept (pixpad trimmed, clipped to the CCD); may be empty.
    pub rows: Range<usize>,
    /// CCD columns covered by any spot of the patch (clipped to the CCD).
    pub cols: Range<usize>,
    /// Fibers of each block relative to the spots' first fiber: padding fibers, then core.
    pub block_fibers: Vec<usize>,
    /// Number of leading padding blocks.
    pub npad: usize,
    /// First padded-grid wavelength index of the patch.
    pub wave0: usize,
    pub nwavetot: usize,
}

impl PatchGeometry {
    /// Lays out a patch on the CCD from its spots' corners (DESIGN "Pixels of a patch").
    pub fn new(plan: &Plan, patch: &Patch, spots: &Corners, ccd: (usize, usize)) -> Self {
        let f0 = spots.fibers.start;
        let waves = plan.patch_waves(patch);
        let core_waves =
            waves.start + plan.wavepad..waves.start + plan.wavepad + plan.options.layout.nwavestep;
        let (ny, nx) = (spots.ny as i64, spots.nx as i64);

        let mut x = (i64::MAX, i64::MIN);
        let mut ypad = (i64::MAX, i64::MIN);
        let mut ycore = (i64::MAX, i64::MIN);
        for f in patch.padded_fibers.clone() {
            for w in waves.clone() {
                let (xc, yc) = spots.corner(f - f0, w);
                let (xc, yc) = (xc as i64, yc as i64);
                x = (x.0.min(xc), x.1.max(xc + nx));
                ypad = (ypad.0.min(yc), ypad.1.max(yc + ny));
                if core_waves.contains(&w) {
                    ycore = (ycore.0.min(yc), ycore.1.max(yc + ny));
                }
            }
        }
        let frac = plan.options.layout.pixpad_frac;
        let lo = ((ycore.0 - ypad.0) as f64 * (1.0 - frac)).floor() as i64;
        let hi = ((ycore.1 - ypad.0) as f64 + (ypad.1 - ycore.1) as f64 * frac).floor() as i64;
        let clip = |a: i64, b: i64, n: usize| -> Range<usize> {
            let a = a.clamp(0, n as i64) as usize;
            let b = b.clamp(0, n as i64) as usize;
            a..b.max(a)
        };
        let rows = clip(ypad.0 + lo, ypad.0 + hi, ccd.0);
        let cols = clip(x.0, x.1, ccd.1);

        let core = patch.fibers.start - f0..patch.fibers.end - f0;
        let mut block_fibers: Vec<usize> = (patch.padded_fibers.start - f0
            ..patch.padded_fibers.end - f0)
            .filter(|f| !core.contains(f))
            .collect();
        let npad = block_fibers.len();
        block_fibers.extend(core);
        PatchGeometry {
            rows,
            cols,
            block_fibers,
            npad,
            wave0: waves.start,
            nwavetot: plan.nwavetot,
        }
    }

    /// Number of unknowns.
    pub fn nunknowns(&self) -> usize {
        self.block_fibers.len() * self.nwavetot
    }

    /// Number of core fibers.
    pub fn ncore(&self) -> usize {
        self.block_fibers.len() - self.npad
    }

    /// Whether the box has no pixel.
    pub fn is_empty(&self) -> bool {
        self.rows.is_empty() || self.cols.is_empty()
    }
}
