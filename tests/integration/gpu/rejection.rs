//! Outlier rejection on the GPU (`--gpu --reject-outliers`) against the CPU's: the bundle of
//! `science::outlier_rejection_removes_unmasked_cosmics`, its cosmic-ray tracks all left out
//! of the MASK, extracted by both backends.

use spex::frame::Frame;
use spex::outliers;

use super::{assert_agree, backend, say};
use crate::science::{cosmic_preproc, solve_on};
use spex::backend::cpu::CpuBackend;
use spex::backend::cuda::{CudaBackend, Solve};
use spex::compare::{self, Truth};

/// Bins flagged as having lost pixels to rejection.
fn flagged(frame: &Frame) -> usize {
    frame
        .mask
        .iter()
        .filter(|&&m| m & outliers::REJECTED != 0)
        .count()
}

/// The GPU rejects the CPU's pixels in the CPU's patches, with as many extra solves, flags
/// the same bins and agrees with the CPU's flux, ivar, resolution, chi2pix and model as
/// without rejection; bins with |pull| > 5 drop 10x as on the CPU. The two backends' models
/// differ by rounding (about 1e-12 relative), so a pixel flips only if its pull lies within
/// about 1e-10 sigma of a threshold (5 or 2): with 1e5 tested pixels, a chance below 1e-4, so
/// the counts must be equal. Without tracks the GPU rejects no more than the CPU.
#[test]
#[ignore = "needs an NVIDIA GPU: run with --include-ignored on a GPU machine"]
fn gpu_rejects_the_pixels_the_cpu_rejects() {
    let dir = tempfile::tempdir().unwrap();
    let (hit, truth_path) = cosmic_preproc(dir.path(), "unmasked", 3000.0, 1.0);
    let truth = Truth::read(&truth_path, None).unwrap();
    let mut gpu = backend();
    let mut cpu = CpuBackend::new(2).unwrap();
    let (plain, _) = solve_on(&mut gpu, &hit, None, false);
    let (g_frame, g) = solve_on(&mut gpu, &hit, Some(5.0), true);
    let downdated = gpu.timings().downdated;
    let (c_frame, c) = solve_on(&mut cpu, &hit, Some(5.0), true);
    let count = |r: &[spex::extract::PatchResult]| -> (usize, usize, usize) {
        (
            r.iter().map(|r| r.nrejected).sum(),
            r.iter().filter(|r| r.nresolves > 0).count(),
            r.iter().map(|r| r.nresolves).sum(),
        )
    };
    say(&format!(
        "rejection: GPU {:?} CPU {:?} (pixels, patches solved again, extra solves); bins flagged GPU {} CPU {}",
        count(&g),
        count(&c),
        flagged(&g_frame),
        flagged(&c_frame)
    ));
    assert!(
        count(&c).0 > 0,
        "the CPU rejected nothing: the case lost its tracks"
    );
    for (a, b) in g.iter().zip(&c) {
        assert_eq!(
            (a.patch, a.nrejected, a.nresolves),
            (b.patch, b.nrejected, b.nresolves),
            "patch {}: rejected pixels and extra solves",
            b.patch
        );
        assert_eq!(a.rejected.len(), b.rejected.len(), "patch {}", b.patch);
        for (x, y) in a.rejected.iter().zip(&b.rejected) {
            assert!((x - y).abs() <= 1e-9, "patch {}: lost {x} vs {y}", b.patch);
        }
    }
    assert_eq!(g_frame.mask, c_frame.mask, "MASK of the two backends");
    assert_agree(&g, &c);
    // A re-solve starts from the normal equations its patch kept after its test, less the
    // rejected pixels' terms, where a slot was left for them (one for every other patch of
    // the frame: 13 here, fewer than the re-solves), and assembles them again where none was:
    // the run above did both. With no slot every re-solve assembles again, to the same pixels.
    say(&format!("re-solves from kept equations: {downdated}"));
    assert!(
        downdated > 0 && downdated < count(&g).2,
        "{downdated} of {} re-solves from kept equations",
        count(&g).2
    );
    // Each route below, as `gpu` is set up, must reject the CPU's pixels too.
    let matches_cpu = |gpu: &mut CudaBackend, what: &str| {
        let (frame, r) = solve_on(gpu, &hit, Some(5.0), true);
        say(&format!("{what}: {:?}", count(&r)));
        assert_eq!(count(&r), count(&c), "{what}");
        assert_eq!(frame.mask, c_frame.mask, "{what}");
        assert_agree(&r, &c);
    };
    gpu.set_kept_slots(Some(0));
    matches_cpu(&mut gpu, "every re-solve assembled again");
    assert_eq!(gpu.timings().downdated, 0);
    gpu.set_kept_slots(None);
    // In waves of at most four (8 waves of the 25 patches), on both routes of the solve: a
    // re-solve is a wave of the patches with new outliers gathered from the finished waves
    // (up to four, from several waves), whose tables and results take free places of the
    // finished waves', its patches' spots and boxes where their first solve left them.
    gpu.set_max_wave(Some(4));
    for solve in [Solve::Schur, Solve::Dense] {
        gpu.set_solve(solve);
        matches_cpu(&mut gpu, &format!("{solve:?} route in small waves"));
        assert!(gpu.timings().waves > 2, "{} waves", gpu.timings().waves);
    }
    gpu.set_solve(Solve::Schur);
    gpu.set_max_wave(None);
    // The test's growth by rounds over the box, which a pass takes where its list of taken
    // pixels is full (a long track, a large box): with no room in the list every pass with
    // outliers takes it, and must take the same pixels as the frontier.
    gpu.set_outlier_list(Some(0));
    matches_cpu(&mut gpu, "growth by rounds over the box");
    gpu.set_outlier_list(None);
    // The growth from the frontier without its maps in shared memory, which a box too large
    // for them takes: each pixel it reaches evaluated, a seed looked for around it.
    gpu.set_outlier_maps(Some(0));
    matches_cpu(&mut gpu, "growth without maps");
    gpu.set_outlier_maps(None);

    let before = compare::pulls(&plain, &truth).unwrap();
    let after = compare::pulls(&g_frame, &truth).unwrap();
    say(&format!(
        "GPU |pull| > 5: {} without rejection, {} with",
        before.over5, after.over5
    ));
    assert!(before.over5 >= 50, "{before}");
    assert!(10 * after.over5 <= before.over5, "{after}");

    let (quiet, _) = cosmic_preproc(dir.path(), "quiet", 0.0, 0.0);
    let (_, g) = solve_on(&mut gpu, &quiet, Some(5.0), false);
    let (_, c) = solve_on(&mut cpu, &quiet, Some(5.0), false);
    say(&format!(
        "no tracks: GPU {:?} CPU {:?}",
        count(&g),
        count(&c)
    ));
    assert!(count(&g).0 <= count(&c).0);
}
