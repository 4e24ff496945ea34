//! GPU backends kept between the jobs of a process (`backend::shelf`, on in the Python
//! package): a backend dropped after its job serves the next on its device, with the same
//! results, and a second backend is opened while the first is in use.

use std::time::Instant;

use spex::backend::{self, shelf, BackendKind, FrameInput, Progress};
use spex::plan::{Plan, PlanOptions};

use super::{assert_agree, cpu_results, psf, say, solve_options, synthetic_image};

#[test]
#[ignore = "needs an NVIDIA GPU: run with --include-ignored on a GPU machine"]
fn a_kept_backend_solves_the_next_job_alike() {
    let psf = psf();
    let plan = Plan::new(PlanOptions::new(6000.0, 6100.0, 0.8, 0, 25)).unwrap();
    let image = synthetic_image(&psf, &plan, 9);
    let options = solve_options(0.0, false);
    let input = FrameInput::new(&plan, &psf, &image, &options);
    let cpu = cpu_results(input);
    let open = |threads: usize| {
        let t0 = Instant::now();
        let b = backend::create(BackendKind::Cuda, threads, 0).expect("CUDA device 0");
        (b, t0.elapsed().as_secs_f64())
    };
    shelf::keep_between_jobs(true);
    let before = shelf::kept();
    let (mut first, t_first) = open(2);
    let solved = first.extract(input, &plan.patches, &Progress::silent());
    assert_agree(&solved.expect("first job"), &cpu);
    drop(first);
    assert_eq!(shelf::kept(), before + 1, "kept after its job");
    let (mut again, t_again) = open(3);
    assert_eq!(shelf::kept(), before, "taken for the second job");
    let (mut other, _) = open(3);
    let solved = again.extract(input, &plan.patches, &Progress::silent());
    assert_agree(&solved.expect("the kept backend's job"), &cpu);
    let solved = other.extract(input, &plan.patches, &Progress::silent());
    assert_agree(&solved.expect("a second backend's job"), &cpu);
    drop((again, other));
    assert_eq!(shelf::kept(), before + 2);
    say(&format!(
        "backend opened in {:.3} s, taken kept in {:.4} s",
        t_first, t_again
    ));
    shelf::keep_between_jobs(false);
    assert_eq!(shelf::kept(), 0);
}
