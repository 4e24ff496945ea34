//! The patches a full frame of PSF r0-00051060 sends from the GPU to the CPU reference.
//!
//! Fibers 0-24 of that PSF over DESI's r grid (5760-7620 A) have a few patches, at the red end
//! of the grid, whose second-neighbour coupling exceeds the bound of the Schur route (1e-12
//! relative). The CPU backend solves them by its dense route without a regularised retry;
//! the GPU hands them to the CPU reference, which they used to leave under a warning that
//! their Cholesky factorisation had failed twice. These tests pin that no factorisation fails
//! on the device there, and that the only patches that leave it are the coupled ones.

use spex::backend::FrameInput;
use spex::plan::{Plan, PlanOptions};
use spex::psf::GaussHermitePsf;
use spex::simulate::{simulate, SimulateOptions};

use super::{backend, say, solve_both, solve_options};

#[test]
#[ignore = "needs an NVIDIA GPU: run with --include-ignored on a GPU machine"]
fn psf_51060_patches_leave_the_gpu_only_for_their_coupling() {
    let psf = GaussHermitePsf::read(&crate::common::data("psf-r0-00051060.fits")).expect("PSF");
    let plan = Plan::new(PlanOptions::new(5760.0, 7620.0, 0.8, 0, 25)).unwrap();
    let mut o = SimulateOptions::new(plan.fibers(), 5760.0, 7620.0);
    o.seed = 1;
    let image = simulate(&psf, &o).expect("simulation").to_image();
    let options = solve_options(0.0, false);
    let input = FrameInput::new(&plan, &psf, &image, &options);
    let mut gpu = backend();
    let (g, cpu) = solve_both(&mut gpu, input);
    let t = gpu.timings().clone();
    say(&format!(
        "psf-r0-00051060 fibers 0-24: {} patches, {} retried on the device, {} to the CPU ({} coupled, largest coupling {:.1e})",
        t.patches, t.retried, t.cpu_fallback, t.coupled, t.max_coupling
    ));
    assert_eq!(t.retried, 0, "a factorisation failed on the device");
    assert_eq!(
        t.cpu_fallback, t.coupled,
        "patches left the device for another reason than their coupling"
    );
    super::assert_agree(&g, &cpu);
}
