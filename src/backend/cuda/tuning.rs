//! Tuning of the CUDA backend: which route each step takes and its thresholds, read once per
//! backend.

use crate::error::{Error, Result};

/// Least default memory budget of a backend, in bytes.
const LEAST_BUDGET: usize = 4_000_000_000;

/// Backends that the default budget lets share one device of 40 GB or more, as processes or
/// threads: a tenth of its memory each, at least [`LEAST_BUDGET`] (4.2 GB on a 40 GB A100, 8.5
/// GB on an 80 GB H100, 14 GB on an H200). Only outlier rejection uses more than 4 GB: where the budget holds
/// them, it keeps a full frame's spots and the normal equations of its patches with outliers
/// for their re-solves (a frame without it takes about 2.5 GB).
const BACKENDS_PER_DEVICE: usize = 10;

/// The device memory a backend's buffers may take on a device of `total` bytes:
/// `SPEX_GPU_MEMORY_GB` when set, else the default share.
pub(crate) fn memory_budget(total: usize) -> Result<usize> {
    const NAME: &str = "SPEX_GPU_MEMORY_GB";
    if std::env::var_os(NAME).is_none() {
        return Ok(default_budget(total));
    }
    let gb: f64 = var(NAME, 0.0)?;
    Ok((gb * 1e9) as usize)
}

/// The environment variable `name` read as a `T`, `default` when it is not set.
fn var<T: std::str::FromStr>(name: &str, default: T) -> Result<T> {
    match std::env::var(name) {
        Ok(v) => v
            .trim()
            .parse()
            .map_err(|_| Error::Gpu(format!("{name}={v:?} cannot be read"))),
        Err(_) => Ok(default),
    }
}

fn default_budget(total: usize) -> usize {
    (total / BACKENDS_PER_DEVICE).max(LEAST_BUDGET)
}

/// Which kernel decorrelates the blocks.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Route {
    /// The polar route, the Jacobi kernel for the blocks it gives up on.
    Polar,
    /// The Jacobi kernel for every block (the route before the polar one; for comparisons).
    Jacobi,
}

/// How steps 2-3 (factorisation, xflux, core blocks) run.
///
/// The Schur route assumes icov block-tridiagonal in fiber order along the CCD, which holds
/// on the r-camera PSFs of the test data: fibers two apart couple only through their stamps'
/// tails, at most 4.8e-13 relative on a full simulated frame of PSF r0-00067784 and 4.2e-12 on
/// one of r0-00051060 (5 of its 4700 patches over 1e-12, all in its first bundle). It is the
/// default (about a third of the dense route's time for steps 2-3); a patch whose
/// second-neighbour coupling exceeds `coupling_max` ([`COUPLING_MAX`]) goes to the CPU
/// reference, which solves it densely.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Solve {
    /// Dense Cholesky, xflux and core covariance blocks through cuSOLVER and cuBLAS (`dense`).
    Dense,
    /// Per-fiber Schur complements (`schur`), where second neighbours decouple.
    Schur,
}

/// The largest relative second-neighbour coupling the Schur route drops by default. Dropping a
/// coupling `delta` moves a flux by about `delta` times the signal-to-noise ratio of the
/// fibers it couples, in units of its sigma (the CPU backend's `FAR_COUPLING_LIMIT`): at most
/// 1e-8 sigma up to a signal-to-noise ratio of 100 per bin, 1e-7 at 1000, well under the 1e-6
/// sigma to which the GPU and CPU backends agree. The CPU backend keeps couplings over 1e-12
/// (its dense route); at the CPU's bound the GPU sent the patches over it to the CPU reference,
/// about 5 per full frame of PSF r0-00051060, whose host results then took 100-166 ms.
pub const COUPLING_MAX: f64 = 1e-10;

/// The backend's tuning, read once per backend from the environment (for measurements rather
/// than production): `SPEX_GPU_SOLVE` (`schur`, the default, or `dense`), `SPEX_GPU_COUPLING_MAX` (largest
/// relative second-neighbour coupling the Schur route accepts, default [`COUPLING_MAX`]),
/// `SPEX_GPU_RETRY_CAPACITY` (patches per wave the Schur route retries on the device, default
/// 32),
/// `SPEX_GPU_DECORRELATE` (`polar` or `jacobi`), `SPEX_GPU_JACOBI_THREADS` (threads per Jacobi
/// block, default 512) and `SPEX_GPU_JACOBI_TOL` (rotation threshold, default 1e-14).
#[derive(Clone, Copy, Debug)]
pub(crate) struct Tuning {
    pub solve: Solve,
    pub coupling_max: f64,
    /// Patches of a wave whose failed sweeps the device retries (`schur::retry_capacity`).
    pub retry_capacity: usize,
    pub route: Route,
    /// The polar iteration stops one step after `||X^T X - I||_F = e` falls under this: that
    /// step leaves about `0.75 e^2`, under 1e-14, which is the rounding of the products.
    pub polar_tol: f64,
    /// Steps after which a block is handed to the Jacobi kernel; 1e10-conditioned blocks take
    /// about 17.
    pub polar_max_steps: usize,
    /// Jacobi rotations are skipped where `|a_pq| <= tol sqrt(a_pp a_qq)`: that leaves a
    /// relative perturbation of C near tol.
    pub jacobi_tol: f64,
    pub jacobi_threads: u32,
    /// Fill icov with NaN before each wave's assembly (for tests: an entry that a kernel
    /// reads but the assembly did not write then shows in the results).
    pub poison: bool,
    /// Taken pixels the outlier test's growth keeps in its list (at most
    /// [`super::reject::TAKEN_LIST`]); a pass that takes more grows by rounds over its box.
    pub outlier_list: u32,
    /// Box pixels up to which the outlier test's growth reads its maps (at most
    /// [`super::reject::MAP_PIXELS`]); a larger box evaluates each pixel it reaches.
    pub outlier_maps: u32,
    /// Most slots of normal equations kept for outlier rejection's re-solves (None: as the
    /// frame and the memory budget allow, `reject::kept::capacity`); a re-solve without one
    /// assembles its equations again.
    pub kept_slots: Option<usize>,
}

impl Tuning {
    pub(crate) fn from_env() -> Result<Self> {
        let solve = match std::env::var("SPEX_GPU_SOLVE").as_deref() {
            Ok("dense") => Solve::Dense,
            Err(_) | Ok("schur") => Solve::Schur,
            Ok(v) => {
                return Err(Error::Gpu(format!(
                    "SPEX_GPU_SOLVE={v:?}: expected schur or dense"
                )))
            }
        };
        let route = match std::env::var("SPEX_GPU_DECORRELATE").as_deref() {
            Err(_) | Ok("polar") => Route::Polar,
            Ok("jacobi") => Route::Jacobi,
            Ok(v) => {
                return Err(Error::Gpu(format!(
                    "SPEX_GPU_DECORRELATE={v:?}: expected polar or jacobi"
                )))
            }
        };
        Ok(Tuning {
            solve,
            coupling_max: var("SPEX_GPU_COUPLING_MAX", COUPLING_MAX)?,
            retry_capacity: var("SPEX_GPU_RETRY_CAPACITY", 32)?,
            route,
            polar_tol: 1e-7,
            polar_max_steps: 40,
            jacobi_tol: var("SPEX_GPU_JACOBI_TOL", 1e-14)?,
            jacobi_threads: var("SPEX_GPU_JACOBI_THREADS", 512)?,
            poison: false,
            outlier_list: super::reject::TAKEN_LIST,
            outlier_maps: super::reject::MAP_PIXELS,
            kept_slots: None,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A tenth of the device's memory, never under 4 GB.
    #[test]
    fn the_default_budget_is_a_tenth_of_the_device() {
        assert_eq!(default_budget(42_400_000_000), 4_240_000_000);
        assert_eq!(default_budget(85_000_000_000), 8_500_000_000);
        assert_eq!(default_budget(150_000_000_000), 15_000_000_000);
        assert_eq!(default_budget(16_000_000_000), 4_000_000_000);
        assert_eq!(default_budget(0), 4_000_000_000);
    }
}
