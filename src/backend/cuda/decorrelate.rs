//! Step 4 of the solve on the device, the decorrelation of each core fiber block: the polar
//! route (kernels/polar.cu, Newton-Schulz on tensor cores) for every block, then the Jacobi
//! eigensolver (kernels/decorrelate.cu) for the blocks the polar route gave up on, with no
//! host round trip between them. The counts of both go to the backend's log line.

use super::buffers::DevBuf;
use super::launchers::{self, CoreIn, CoreOut, Gpu, TILE_MAX_ORDER};
use super::tuning::{Route, Tuning};
use crate::error::Result;

/// Scratch and verdicts of a decorrelation: `pbuf` (order^2 doubles per block), `steps` and
/// `sweeps` (one per block, zeroed by the caller). `factored`: `pbuf` already holds the
/// Cholesky factor of each precision block (the Schur combine's), so that the polar route does
/// not factorise the block again.
pub(crate) struct Scratch<'a> {
    pub pbuf: &'a DevBuf<f64>,
    pub factored: bool,
    pub steps: &'a DevBuf<i32>,
    pub sweeps: &'a DevBuf<i32>,
}

/// What the blocks of a decorrelation hold.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum BlockKind {
    /// Covariance blocks C_bb (of icov^-1).
    Covariance,
    /// Their inverses S_b = C_bb^-1, the Schur complements of icov.
    Precision,
}

/// Decorrelates the blocks of `input` into `out` (and Q into `qout` when not 0).
pub(crate) fn decorrelate(
    g: Gpu<'_>,
    tuning: &Tuning,
    input: CoreIn,
    kind: BlockKind,
    scratch: Scratch<'_>,
    out: CoreOut,
    qout: u64,
) -> Result<()> {
    let polar = tuning.route == Route::Polar && g.sh.nt.div_ceil(8) * 8 <= TILE_MAX_ORDER;
    debug_assert!(
        !scratch.factored || kind == BlockKind::Precision,
        "only precision blocks come with their Cholesky factors"
    );
    if polar {
        launchers::polar(
            g,
            input,
            kind == BlockKind::Covariance,
            scratch.factored,
            tuning.polar_tol,
            tuning.polar_max_steps,
            scratch.pbuf,
            out,
            scratch.steps,
            qout,
        )?;
    }
    launchers::jacobi(
        g,
        input,
        kind == BlockKind::Covariance,
        tuning.jacobi_tol,
        tuning.jacobi_threads,
        out,
        scratch.sweeps,
        qout,
        polar.then_some(scratch.steps),
    )
}

/// What the decorrelation of a wave did, from the verdicts copied back.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub(crate) struct Counts {
    pub polar: usize,
    pub max_steps: i32,
    pub fallback: usize,
    pub max_sweeps: i32,
}

impl Counts {
    pub(crate) fn new(steps: &[i32], sweeps: &[i32]) -> Self {
        Counts {
            polar: steps.iter().filter(|&&s| s > 0).count(),
            max_steps: steps.iter().copied().max().unwrap_or(0).max(0),
            fallback: steps.iter().filter(|&&s| s < 0).count(),
            max_sweeps: sweeps.iter().copied().max().unwrap_or(0),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn counts_tell_polar_blocks_from_fallbacks() {
        let c = Counts::new(&[9, 12, -1, 0, -2, 7], &[0, 0, 6, 5, 8, 0]);
        assert_eq!(
            c,
            Counts {
                polar: 3,
                max_steps: 12,
                fallback: 2,
                max_sweeps: 8
            }
        );
        assert_eq!(Counts::new(&[], &[]), Counts::default());
    }
}
