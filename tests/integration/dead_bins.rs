//! Bins that no usable pixel constrains (a masked amplifier region, a fully masked fiber) get
//! what desispec's default path writes for them, which is what gpu_specter's regularised solve
//! leaves: flux 0, IVAR from the regularisation alone (`1e-15 dw^2` for a patch without any
//! weight), RESOLUTION the identity, CHI2PIX 0. desispec's sky step averages RESOLUTION over
//! all fibers, so a zero row here would change every fiber's sky model.

use crate::common::*;
use spex::backend::cpu::{normal_equations, prior, solve_patch};
use spex::extract::{PatchResult, PatchStatus, SolveOptions};
use spex::frame::{gradient, specmask, Frame};
use spex::image::Image;
use spex::plan::{Plan, PlanOptions};
use spex::psf::GaussHermitePsf;

fn options(regularize: f64) -> SolveOptions {
    SolveOptions {
        regularize,
        psferr: 0.01,
        model: false,
        reject_outliers: None,
    }
}

/// 25 lit fibers, 6000-6400 A, and the plan that extracts them.
fn lit_bundle() -> (GaussHermitePsf, Plan, Image) {
    let psf = psf_a();
    let plan = Plan::new(PlanOptions::new(6000.0, 6400.0, 0.8, 0, 25)).unwrap();
    let mut image = blank_image(&psf);
    add_spots(&mut image, &psf, 0..25, &plan.fullwave, |_, _| 300.0);
    (psf, plan, image)
}

fn solve_all(psf: &GaussHermitePsf, plan: &Plan, image: &Image, reg: f64) -> Vec<PatchResult> {
    let spots = psf.spots(0..25, &plan.fullwave);
    plan.patches
        .iter()
        .map(|p| solve_patch(plan, p, &spots, image, &options(reg)))
        .collect()
}

/// Whether the resolution of fiber `f` at bin `j` is the identity's column.
fn identity_column(frame: &Frame, f: usize, j: usize) -> bool {
    (0..2 * frame.ndiag + 1)
        .all(|k| frame.resolution[[f, k, j]] == if k == frame.ndiag { 1.0 } else { 0.0 })
}

/// An amplifier masked from between fibers 9 and 10 to the right edge, above 6200 A: its fully
/// masked patches give gpu_specter's values in every bin, and no bin of the frame is left with
/// ivar 0 or a zero resolution column.
#[test]
fn masked_amplifier_gives_the_regularised_solution() {
    let (psf, plan, mut image) = lit_bundle();
    let (x9, y0) = psf.trace(9, &[6200.0]);
    let (x10, _) = psf.trace(10, &[6200.0]);
    let (xs, ys) = ((0.5 * (x9[0] + x10[0])) as usize, y0[0] as usize);
    image.ivar.slice_mut(ndarray::s![ys.., xs..]).fill(0.0);
    let results = solve_all(&psf, &plan, &image, 0.0);
    let masked: Vec<_> = results
        .iter()
        .filter(|r| r.status == PatchStatus::Masked)
        .collect();
    assert!(!masked.is_empty() && masked.len() < results.len());
    let (frame, _) = Frame::assemble(&plan, psf.hsizey, &results).unwrap();
    let dw = gradient(&frame.wave);
    let eps = f64::EPSILON;
    let mut checked = 0;
    for r in &masked {
        let patch = &plan.patches[r.patch];
        for f in patch.fibers.clone() {
            for j in patch.waves.clone() {
                // gpu_specter: icov = 1e-15 I, so ivar per bin 1e-15, times dw^2 per Angstrom
                let want = 1e-15 * dw[j] * dw[j];
                let ivar = frame.ivar[[f, j]];
                assert!(
                    (ivar - want).abs() <= 4.0 * eps * want,
                    "ivar {ivar} at {f}, {j}"
                );
                assert_eq!(frame.flux[[f, j]], 0.0);
                assert_eq!(frame.chi2pix[[f, j]], 0.0);
                assert!(identity_column(&frame, f, j), "resolution at {f}, {j}");
                assert_ne!(frame.mask[[f, j]] & specmask::SOMEBADPIX, 0);
                checked += 1;
            }
        }
    }
    // the masked quadrant holds 15 fibers over a fifth of the grid
    assert!(
        checked >= 15 * (frame.nwave() / 5),
        "{checked} bins checked"
    );
    assert!(frame.ivar.iter().all(|&v| v > 0.0), "a bin with ivar 0");
    for f in 0..frame.nspec {
        for j in 0..frame.nwave() {
            let mut column = (0..2 * frame.ndiag + 1).map(|k| frame.resolution[[f, k, j]]);
            assert!(column.any(|v| v != 0.0), "zero resolution at {f}, {j}");
        }
    }
}

/// With `-r`, a patch without weight gets `regularize^2 + 1e-15` on its diagonal, as in
/// gpu_specter (no bin counts as poorly constrained when the largest weight is 0).
#[test]
fn fully_masked_patch_takes_the_regularisation_given() {
    let (psf, plan, mut image) = lit_bundle();
    image.ivar.fill(0.0);
    for reg in [0.0, 1e-3] {
        let results = solve_all(&psf, &plan, &image, reg);
        let d = reg * reg + 1e-15;
        for r in &results {
            assert_eq!(r.status, PatchStatus::Masked);
            for &v in &r.ivar {
                assert!(
                    (v - d).abs() <= 4.0 * f64::EPSILON * d,
                    "ivar {v}, want {d}"
                );
            }
            assert!(r.flux.iter().chain(&r.chi2pix).all(|&v| v == 0.0));
            // every spot lies on masked pixels only
            assert!(r.pixmask_fraction.iter().all(|&v| (v - 1.0).abs() < 1e-12));
        }
    }
}

/// A fiber whose columns are all masked, between lit neighbours: its bins are decoupled from
/// the others, so its resolution is the identity and its ivar the prior of its patch,
/// `(1e-4 max fluxweight)^2 + 1e-15`, as gpu_specter gives.
#[test]
fn fully_masked_fiber_gets_the_prior_of_its_patch() {
    let (psf, plan, mut image) = lit_bundle();
    let dead = 12;
    let corners = psf.corners(dead..dead + 1, &plan.fullwave);
    let (lo, hi) = (0..plan.fullwave.len())
        .map(|w| corners.corner(0, w).0 as usize)
        .fold((usize::MAX, 0), |(a, b), x| (a.min(x), b.max(x)));
    let ncol = 2 * psf.hsizex + 1;
    image
        .ivar
        .slice_mut(ndarray::s![.., lo..hi + ncol])
        .fill(0.0);
    let spots = psf.spots(0..25, &plan.fullwave);
    let results = solve_all(&psf, &plan, &image, 0.0);
    let (frame, _) = Frame::assemble(&plan, psf.hsizey, &results).unwrap();
    let dw = gradient(&frame.wave);
    for (patch, r) in plan.patches.iter().zip(&results) {
        if !patch.fibers.contains(&dead) {
            continue;
        }
        let (geom, ne) = normal_equations(&plan, patch, &spots, &image).unwrap();
        let prior = prior(&ne.fluxweight, 0.0).unwrap();
        let block = geom.block_fibers.iter().position(|&b| b == dead).unwrap();
        assert_eq!(r.status, PatchStatus::Ok);
        for j in patch.waves.clone() {
            let jp = block * geom.nwavetot + plan.wavepad + j - patch.waves.start;
            let want = prior[jp] * dw[j] * dw[j];
            let ivar = frame.ivar[[dead, j]];
            assert!((ivar / want - 1.0).abs() < 1e-9, "ivar {ivar}, want {want}");
            for k in 0..2 * frame.ndiag + 1 {
                let want = if k == frame.ndiag { 1.0 } else { 0.0 };
                assert!((frame.resolution[[dead, k, j]] - want).abs() < 1e-9);
            }
        }
    }
}
