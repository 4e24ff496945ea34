//! A whole frame's values placed by the device's unpacking straight into the frame's arrays
//! (`Backend::extract_into`) make the frame that its results stitched after the call make.

use spex::frame::{Frame, FrameValues};

use super::*;

/// Flux, ivar, resolution and pixmask_fraction bit for bit; chi2pix, whose model sums are
/// atomic adds on the device in an order that varies from call to call, to 1e-12.
fn assert_same_frame(a: &Frame, b: &Frame) {
    let bits = |v: &ndarray::ArrayD<f64>| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
    let pairs = [
        ("flux", &a.flux, &b.flux),
        ("ivar", &a.ivar, &b.ivar),
        ("pixmask_fraction", &a.pixmask_fraction, &b.pixmask_fraction),
    ];
    for (what, x, y) in pairs {
        let (x, y) = (x.clone().into_dyn(), y.clone().into_dyn());
        assert!(bits(&x) == bits(&y), "{what} differs");
    }
    let (x, y) = (
        a.resolution.clone().into_dyn(),
        b.resolution.clone().into_dyn(),
    );
    assert!(bits(&x) == bits(&y), "resolution differs");
    for (x, y) in a.chi2pix.iter().zip(&b.chi2pix) {
        assert!(
            (x - y).abs() <= 1e-12 * x.abs().max(1.0),
            "chi2pix {x} vs {y}"
        );
    }
    assert_eq!(a.mask, b.mask);
}

#[test]
#[ignore = "needs an NVIDIA GPU: run with --include-ignored on a GPU machine"]
fn values_placed_on_unpacking_make_the_stitched_frame() {
    let mut gpu = backend();
    let psf = psf();
    // 23 fibers from fiber 1: the first and last sub-bundles hold fibers beyond the frame's;
    // a masked amplifier region leaves patches without a usable pixel
    let plan = Plan::new(PlanOptions::new(6000.0, 6200.0, 0.8, 1, 23)).unwrap();
    let image = masked_amplifier_image(&psf, &plan, 4);
    let ndiag = psf.hsizey;
    for (model, wave) in [(false, None), (true, Some(4))] {
        let options = solve_options(0.0, model);
        let input = FrameInput::new(&plan, &psf, &image, &options);
        gpu.set_max_wave(wave);
        let all = gpu
            .extract(input, &plan.patches, &Progress::silent())
            .unwrap();
        let (stitched, counts) = Frame::assemble(&plan, ndiag, &all).unwrap();
        let mut values = FrameValues::zeros(&plan, ndiag);
        let some = gpu
            .extract_into(input, &plan.patches, &Progress::silent(), &mut values)
            .unwrap();
        gpu.set_max_wave(None);
        let on_cpu = gpu.timings().cpu_fallback;
        let placed = some.iter().filter(|r| r.placed).count();
        // placeable: solved on the device, with a usable pixel, every fiber the frame's
        let placeable = some
            .iter()
            .filter(|r| {
                let fibers = &plan.patches[r.patch].fibers;
                fibers.start >= 1 && fibers.end <= 24 && r.status != PatchStatus::Masked
            })
            .count();
        say(&format!(
            "{placed} of {} patches placed ({placeable} placeable, {on_cpu} solved on the \
             CPU), {} masked",
            some.len(),
            counts.masked
        ));
        assert!(counts.masked > 0 && placed > 0);
        assert!(placed <= placeable && placed + on_cpu >= placeable);
        for r in &some {
            let fibers = &plan.patches[r.patch].fibers;
            if r.placed {
                assert!(fibers.start >= 1 && fibers.end <= 24, "patch {}", r.patch);
                assert!(r.flux.is_empty() && r.status != PatchStatus::Masked);
            }
            assert_eq!(r.model.is_some(), model && r.status != PatchStatus::Masked);
        }
        let (frame, placed_counts) =
            Frame::assemble_with(&plan, ndiag, &some, Some(values)).unwrap();
        assert_eq!(placed_counts, counts);
        assert_same_frame(&frame, &stitched);
    }
}
