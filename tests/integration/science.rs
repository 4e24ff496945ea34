//! Capabilities beyond gpu_specter's: any fiber range, extracted as the full frame extracts
//! it, and outlier pixels rejected by re-extraction.

use std::path::{Path, PathBuf};

use ndarray::s;
use spex::backend::cpu::CpuBackend;
use spex::backend::{Backend, FrameInput, Progress};
use spex::compare::{self, Truth};
use spex::extract::PatchResult;
use spex::fits::Fits;
use spex::frame::Frame;
use spex::outliers;
use spex::pipeline::{self, ExtractRequest};
use spex::simulate::{simulate, SimulateOptions};

use crate::common::*;

/// Simulated fibers: the PSF's last two bundles, so that the last fiber of the PSF is among
/// them; the grid is short to keep the test quick.
const SIM_FIBERS: std::ops::Range<usize> = 450..500;
const GRID: (f64, f64, f64) = (6000.0, 6160.0, 0.8);

/// Writes a simulated preproc file of [`SIM_FIBERS`] into `dir`.
fn simulated_preproc(dir: &Path) -> PathBuf {
    let psf = psf_a();
    let img = dir.join("preproc.fits");
    let mut o = SimulateOptions::new(SIM_FIBERS, 5900.0, 6260.0);
    o.seed = 37;
    simulate(&psf, &o)
        .unwrap()
        .write(&img, &dir.join("truth.fits"))
        .unwrap();
    img
}

fn extract(img: &Path, out: &Path, specmin: usize, nspec: usize) -> Frame {
    let mut r = ExtractRequest::new(img, data("psf-r0-00067784.fits"), out);
    r.wavelength = Some(GRID);
    r.specmin = specmin;
    r.nspec = Some(nspec);
    let mut backend = CpuBackend::new(2).unwrap();
    pipeline::extract_frame(&r, &mut backend, &Progress::silent())
        .unwrap()
        .frame
}

/// One fiber, a range across a bundle boundary and the PSF's last fiber: every fiber's flux,
/// ivar, resolution, chi2pix and mask are those of the extraction of the whole bundles, bit
/// for bit (its sub-bundles are solved with the same neighbours and padding), and the
/// written frame holds exactly the requested fibers: NSPEC, FIBERMIN and the FIBERMAP rows.
#[test]
fn any_fiber_range_equals_the_full_extraction() {
    let dir = tempfile::tempdir().unwrap();
    let img = simulated_preproc(dir.path());
    let full = extract(&img, &dir.path().join("full.fits"), 450, 50);
    assert!(full.flux.iter().any(|&f| f != 0.0));
    for (specmin, nspec) in [(457, 1), (472, 6), (499, 1)] {
        let out = dir.path().join(format!("frame-{specmin}-{nspec}.fits"));
        let part = extract(&img, &out, specmin, nspec);
        let rows = specmin - 450..specmin - 450 + nspec;
        let case = format!("fibers {specmin}..{}", specmin + nspec);
        assert_eq!((part.specmin, part.nspec), (specmin, nspec), "{case}");
        assert_eq!(part.flux, full.flux.slice(s![rows.clone(), ..]), "{case}");
        assert_eq!(part.ivar, full.ivar.slice(s![rows.clone(), ..]), "{case}");
        assert_eq!(part.mask, full.mask.slice(s![rows.clone(), ..]), "{case}");
        assert_eq!(
            part.chi2pix,
            full.chi2pix.slice(s![rows.clone(), ..]),
            "{case}"
        );
        assert_eq!(
            part.resolution,
            full.resolution.slice(s![rows.clone(), .., ..]),
            "{case}"
        );

        let mut f = Fits::open(&out).unwrap();
        f.move_to_primary().unwrap();
        assert_eq!(f.key_i64("NSPEC").unwrap(), Some(nspec as i64), "{case}");
        assert_eq!(
            f.key_i64("SPECMIN").unwrap(),
            Some(specmin as i64),
            "{case}"
        );
        assert_eq!(
            f.key_i64("FIBERMIN").unwrap(),
            Some(specmin as i64),
            "{case}"
        );
        assert_eq!(
            f.image_shape().unwrap(),
            vec![nspec, full.nwave()],
            "{case}"
        );
        f.move_to("FIBERMAP").unwrap();
        assert_eq!(f.nrows().unwrap(), nspec, "{case}");
        let (_, fiber) = f.column::<i32>("FIBER").unwrap();
        let expect: Vec<i32> = (specmin as i32..(specmin + nspec) as i32).collect();
        assert_eq!(fiber, expect, "{case}");
    }
}

/// A range whose bundles would run past the PSF's fibers is refused with a message that says
/// so; a range inside them is not.
#[test]
fn a_range_past_the_psf_is_refused() {
    let psf = psf_a();
    let mut r = ExtractRequest::new("in.fits", "psf.fits", "out.fits");
    r.wavelength = Some(GRID);
    r.specmin = 498;
    r.nspec = Some(3);
    let err = r.plan(&psf).unwrap_err().to_string();
    assert!(err.contains("beyond the PSF"), "{err}");
    r.nspec = Some(2);
    assert!(r.plan(&psf).is_ok());
}

/// A simulated bundle with many cosmic-ray tracks (`density` per million pixels), all or none
/// of them left out of the MASK.
pub(crate) fn cosmic_preproc(
    dir: &Path,
    name: &str,
    density: f64,
    unmasked: f64,
) -> (PathBuf, PathBuf) {
    let img = dir.join(format!("{name}.fits"));
    let truth = dir.join(format!("{name}-truth.fits"));
    let mut o = SimulateOptions::new(450..475, 5900.0, 6260.0);
    o.seed = 38;
    o.cosmic_density = density;
    o.unmasked_cosmics = unmasked;
    simulate(&psf_a(), &o).unwrap().write(&img, &truth).unwrap();
    (img, truth)
}

/// The CPU extraction of one bundle of `img`, with rejection at `nsigma` or without: the
/// frame (bins that lost pixels flagged) and the patch results.
fn solve(img: &Path, nsigma: Option<f64>) -> (Frame, Vec<PatchResult>) {
    solve_on(&mut CpuBackend::new(2).unwrap(), img, nsigma, false)
}

/// [`solve`] on `backend`, with the patches' models when `model`.
pub(crate) fn solve_on(
    backend: &mut dyn Backend,
    img: &Path,
    nsigma: Option<f64>,
    model: bool,
) -> (Frame, Vec<PatchResult>) {
    let mut r = ExtractRequest::new(img, data("psf-r0-00067784.fits"), "unused.fits");
    r.wavelength = Some(GRID);
    r.specmin = 450;
    r.nspec = Some(25);
    r.reject_outliers = nsigma;
    r.model = model.then(|| PathBuf::from("unused-model.fits"));
    let inputs = pipeline::read_inputs(&r).unwrap();
    let plan = r.plan(&inputs.psf).unwrap();
    let options = r.solve_options(&inputs.psf);
    let input = FrameInput::new(&plan, &inputs.psf, &inputs.image, &options);
    let results = backend
        .extract(input, &plan.patches, &Progress::silent())
        .unwrap();
    let (mut frame, _) = Frame::assemble(&plan, inputs.psf.hsizey, &results).unwrap();
    outliers::flag_rejected_bins(&mut frame, &plan, &results);
    (frame, results)
}

/// `frame` without the bins that `flagged` marks as having lost pixels (ivar 0: pulls skip
/// them).
fn without_flagged(frame: &Frame, flagged: &Frame) -> Frame {
    let mut f = frame.clone();
    for (iv, &m) in f.ivar.iter_mut().zip(&flagged.mask) {
        if m & outliers::REJECTED != 0 {
            *iv = 0.0;
        }
    }
    f
}

/// Tracks missed by the MASK: the patches that reject nothing are those of the run without
/// rejection, bit for bit; rejection at 5 sigma leaves at least 10x fewer bins with
/// |pull| > 5, and the other bins' pulls are those of the extraction in which every track is
/// masked (the same noise: only pixels that one run weights and the other does not differ).
/// Without tracks, rejection takes no more pixels than Gaussian noise puts beyond 5 sigma,
/// and the patches that reject nothing are those of the run without rejection, bit for bit.
#[test]
fn outlier_rejection_removes_unmasked_cosmics() {
    let dir = tempfile::tempdir().unwrap();
    let (hit, truth_path) = cosmic_preproc(dir.path(), "unmasked", 3000.0, 1.0);
    let (masked, _) = cosmic_preproc(dir.path(), "masked", 3000.0, 0.0);
    let truth = Truth::read(&truth_path, None).unwrap();
    let (plain, _) = solve(&hit, None);
    let (cleaned, results) = solve(&hit, Some(5.0));
    let (reference, _) = solve(&masked, None);
    let before = compare::pulls(&plain, &truth).unwrap();
    let after = compare::pulls(&cleaned, &truth).unwrap();
    let nrejected: usize = results.iter().map(|r| r.nrejected).sum();
    assert!(nrejected > 0 && before.over5 >= 50, "{before}");
    assert!(
        10 * after.over5 <= before.over5,
        "|pull| > 5: {} without rejection, {} with",
        before.over5,
        after.over5
    );
    let elsewhere = compare::pulls(&without_flagged(&cleaned, &cleaned), &truth).unwrap();
    let ideal = compare::pulls(&without_flagged(&reference, &cleaned), &truth).unwrap();
    // The mean and the std of N pulls scatter by 1/sqrt(N) and 1/sqrt(2N): the two runs share
    // their noise, so a tenth of that bounds what the few differently weighted pixels move.
    let n = ideal.nbins as f64;
    assert!(
        (elsewhere.mean - ideal.mean).abs() <= 0.1 / n.sqrt()
            && (elsewhere.std - ideal.std).abs() <= 0.1 / (2.0 * n).sqrt(),
        "unflagged bins with rejection:\n{elsewhere}\nwith every track masked:\n{ideal}"
    );

    // No tracks: a pixel is beyond 5 sigma with probability 5.7e-7; the patches solve about
    // 1e5 pixels, so 0.06 are expected and 3 or more would happen once in 4e4 runs.
    let (quiet, _) = cosmic_preproc(dir.path(), "quiet", 0.0, 0.0);
    let (_, results) = solve(&quiet, Some(5.0));
    let nrejected: usize = results.iter().map(|r| r.nrejected).sum();
    assert!(
        nrejected <= 2,
        "{nrejected} pixels rejected without cosmics"
    );
    // A patch that rejects nothing keeps the bits of the run without rejection.
    let (_, plain_results) = solve(&quiet, None);
    for (r, p) in results.iter().zip(&plain_results) {
        if r.nresolves == 0 {
            let mut r = r.clone();
            assert!(r.rejected.iter().all(|&f| f == 0.0));
            r.rejected.clone_from(&p.rejected);
            assert_eq!(&r, p, "patch {} rejected nothing", p.patch);
        }
    }
}
