//! The Gauss-Hermite PSF of DESI (specex `PSFTYPE = GAUSS-HERMITE`, `PSFVER = 3`): the model's
//! parameters and shape, with its roles in submodules: `read` reads and validates the file,
//! `trace` evaluates the Legendre-parameterised traces and spot corners, `spot` evaluates
//! pixel-integrated spots.
//!
//! A spot of fiber `f` at wavelength `w` is `ny = 2 HSIZEY + 1` rows by `nx = 2 HSIZEX + 1`
//! columns whose lower-left pixel on the CCD is `(floor(X - HSIZEX + 0.5), floor(Y - HSIZEY +
//! 0.5))`. Its value is `sum_ij GH-i-j pGHy[j][iy] pGHx[i][ix]`, clipped at zero and normalised
//! to unit sum, where `pGH` are Gauss-Hermite functions integrated over each pixel. The TAIL*
//! parameters are not used (as in gpu_specter): a PSF whose TAILAMP is not zero gets a
//! warning when it is read.

mod read;
mod spot;
mod trace;
mod trace_table;

#[cfg(test)]
mod tests;

use std::path::PathBuf;

use serde::{Deserialize, Serialize};

pub use spot::{
    exp_nonpositive, gauss_edge, hermite_values, pixel_gauss_hermite, GaussEdge, Spots,
};
pub use trace::{legendre_values, Corners, Legendre};
pub use trace_table::TraceTable;

/// Default fractional PSF error for chi2pix when the PSF does not give `PSFERR`.
pub const DEFAULT_PSFERR: f64 = 0.01;

/// The shape parameters of one spot: centre, Gaussian widths and the Gauss-Hermite
/// coefficients `gh[i * (ghdegy + 1) + j]` of `GH-i-j`.
#[derive(Clone, Debug, PartialEq)]
pub struct SpotParams {
    pub x: f64,
    pub y: f64,
    pub sigx: f64,
    pub sigy: f64,
    pub gh: Vec<f64>,
}

/// Largest spot half size (HSIZEX, HSIZEY) accepted; DESI PSFs use 8 and 5.
const MAX_HSIZE: usize = 64;

/// Largest Gauss-Hermite degree accepted; DESI PSFs use 6.
const MAX_GHDEG: usize = 20;

/// A Gauss-Hermite PSF as read from a specex file.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct GaussHermitePsf {
    #[serde(with = "crate::parallel::messages::path_bytes")]
    pub path: PathBuf,
    /// Number of fibers described (FIBERMAX - FIBERMIN + 1).
    pub nfiber: usize,
    pub hsizex: usize,
    pub hsizey: usize,
    pub ghdegx: usize,
    pub ghdegy: usize,
    pub legdeg: usize,
    /// CCD size (columns, rows) the PSF was fitted on.
    pub npix_x: usize,
    pub npix_y: usize,
    /// `PSFERR` of the file, if any.
    pub psferr: Option<f64>,
    /// The PSF's own IN_PSF keyword (the PSF it was derived from), carried into the frame as
    /// ORIG_PSF.
    pub orig_psf: Option<String>,
    /// Largest |coefficient| of TAILAMP (0 when the table has no TAILAMP): the amplitude of
    /// the power-law tails that spex does not model.
    pub tail_amplitude: f64,
    pub xtrace: Legendre,
    pub ytrace: Legendre,
    /// `GHSIGX`, `GHSIGY` and the `GH-i-j`, on the PSF table's wavelength domain.
    pub ghsigx: Legendre,
    pub ghsigy: Legendre,
    pub gh: Vec<Legendre>,
}

impl GaussHermitePsf {
    /// Spot size (ny, nx).
    pub fn spot_shape(&self) -> (usize, usize) {
        (2 * self.hsizey + 1, 2 * self.hsizex + 1)
    }

    /// Number of Gauss-Hermite coefficients per spot.
    pub fn ngh(&self) -> usize {
        (self.ghdegx + 1) * (self.ghdegy + 1)
    }

    /// Wavelength domain on which every parameter (traces included) is defined.
    pub fn wave_domain(&self) -> (f64, f64) {
        let lo = self
            .ghsigx
            .wavemin
            .max(self.xtrace.wavemin)
            .max(self.ytrace.wavemin);
        let hi = self
            .ghsigx
            .wavemax
            .min(self.xtrace.wavemax)
            .min(self.ytrace.wavemax);
        (lo, hi)
    }

    /// The PSF table's own wavelength domain (WAVEMIN, WAVEMAX of the PSF HDU).
    pub fn param_domain(&self) -> (f64, f64) {
        (self.ghsigx.wavemin, self.ghsigx.wavemax)
    }
}
