//! The patches a full frame of PSF r0-00051060 sent from the GPU to the CPU reference.
//!
//! Fibers 0-24 of that PSF over DESI's r grid (5760-7620 A) have a few patches whose
//! second-neighbour coupling exceeds 1e-12 relative (1.3e-12 to 4.2e-12): the CPU backend
//! solves them by its dense route, without a regularised retry. The GPU's Schur route used to
//! hand them to the CPU reference at the same bound (under a warning that their Cholesky
//! factorisation had failed twice, which it had not); it now drops couplings up to
//! `cuda::COUPLING_MAX` and keeps them on the device, within the usual agreement with the CPU.

use spex::backend::cuda;
use spex::backend::FrameInput;
use spex::plan::{Plan, PlanOptions};
use spex::psf::GaussHermitePsf;
use spex::simulate::{simulate, SimulateOptions};

use super::{backend, say, solve_both, solve_options};

#[test]
#[ignore = "needs an NVIDIA GPU: run with --include-ignored on a GPU machine"]
fn psf_51060_patches_stay_on_the_gpu() {
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
        "psf-r0-00051060 fibers 0-24: {} patches, {} retried on the device, {} to the CPU ({} coupled), largest coupling {:.1e}",
        t.patches, t.retried, t.cpu_fallback, t.coupled, t.max_coupling
    ));
    // the case holds the patches that the CPU backend's bound sends to its dense route
    assert!(
        t.max_coupling > 1e-12,
        "largest coupling {:.1e}: the case lost its coupled patches",
        t.max_coupling
    );
    assert!(t.max_coupling <= cuda::COUPLING_MAX);
    assert_eq!(t.retried, 0, "a factorisation failed on the device");
    assert_eq!(t.cpu_fallback, 0, "patches left the device");
    super::assert_agree(&g, &cpu);
}
