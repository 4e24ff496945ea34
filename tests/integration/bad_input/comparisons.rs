//! `spex compare` and `--test` must fail on what they cannot measure: NaN in either frame
//! (bins of ivar 0 included), frames of other fibers, NaN limits, no bin to measure.

use super::*;

const REFERENCE: &str = "reference-frame-bundle0.fits";

/// A copy of the reference frame with `values` at the start of HDU `hdu`.
fn damaged_copy(c: &Case, name: &str, hdu: &str, values: &[f64]) -> PathBuf {
    let path = c.copy(REFERENCE, name);
    edit_image(&path, hdu, values);
    path
}

#[test]
fn nan_in_any_array_of_either_frame_fails_the_comparison() {
    let mut c = Case::new();
    let good = c.copy(REFERENCE, "good.fits");
    // ivar 0 with a NaN flux in the same bin: a bin no comparison looks at.
    let masked = c.copy(REFERENCE, "masked.fits");
    edit_image(&masked, "IVAR", &[0.0]);
    edit_image(&masked, "FLUX", &[f64::NAN]);
    let copies = [
        damaged_copy(&c, "res.fits", "RESOLUTION", &[f64::NAN]),
        damaged_copy(&c, "chi.fits", "CHI2PIX", &[f64::NAN]),
        damaged_copy(&c, "inf.fits", "CHI2PIX", &[f64::INFINITY]),
        masked,
    ];
    c.seal();
    for bad in &copies {
        for (a, b) in [(&good, bad), (bad, &good)] {
            let o = spex(args!["compare", a, b]);
            expect(&o, 3, &["comparison failed", "NaN or infinite"]);
        }
    }
    c.unchanged_except(&[]);
}

#[test]
fn test_against_a_reference_holding_nan_fails() {
    let mut c = Case::new();
    let (input, psf) = (c.copy(IMAGE, "in.fits"), c.copy(PSF, "psf.fits"));
    let reference = damaged_copy(&c, "ref.fits", "CHI2PIX", &[f64::NAN]);
    c.seal();
    let o = extract(&input, &psf, &c.path("f.fits"), args!["--test", &reference]);
    assert_ne!(o.code, Some(0), "{}", o.stderr);
    expect(&o, o.code.unwrap_or(0), &["ref.fits", "NaN or infinite"]);
    c.unchanged_except(&[]);
}

#[test]
fn frames_of_other_fibers_fail_the_comparison() {
    let mut c = Case::new();
    let a = c.copy(REFERENCE, "a.fits");
    let b = c.copy(REFERENCE, "b.fits");
    for (name, value) in [("b.fits", 25i64), ("a.fits", 1)] {
        let mut f = fitsio::FitsFile::edit(c.path(name)).unwrap();
        let h = f.hdu("FLUX").unwrap();
        h.write_key(&mut f, "SPECMIN", value).unwrap();
    }
    c.seal();
    let o = spex(args!["compare", &a, &b]);
    expect(&o, 3, &["comparison failed", "different fibers"]);
    c.unchanged_except(&[]);
}

#[test]
fn nan_and_negative_limits_are_usage_errors() {
    let mut c = Case::new();
    let a = c.copy(REFERENCE, "a.fits");
    c.seal();
    for limit in [
        "--max-dflux=nan",
        "--min-fraction=nan",
        "--rel-tolerance=-1",
        "--max-mean=nan",
        "--max-std=inf",
        "--median-range=nan,1",
        "--median-range=0.7,0.6",
    ] {
        let o = spex(args!["compare", &a, &a, limit]);
        expect(&o, 2, &[limit.split('=').next().unwrap()]);
    }
    c.unchanged_except(&[]);
}

#[test]
fn a_frame_without_a_bin_to_measure_fails_the_comparison_with_truth() {
    let mut c = Case::new();
    let frame = c.copy(REFERENCE, "frame.fits");
    let truth = c.copy("truth-bundle0.fits", "truth.fits");
    let other = c.copy("truth-bundle0.fits", "other.fits");
    // every bin of ivar 0; and a truth of fibers far from the frame's
    let (nspec, nwave) = {
        let f = Frame::read(&frame).unwrap();
        (f.nspec, f.nwave())
    };
    let zeros = c.copy(REFERENCE, "zeros.fits");
    edit_image(&zeros, "IVAR", &vec![0.0; nspec * nwave]);
    c.seal();
    let o = spex(args!["compare", &zeros, "--truth", &truth]);
    expect(&o, 3, &["comparison failed", "no bin"]);
    let o = spex(args![
        "compare",
        &frame,
        "--truth",
        &other,
        "--truth-fibermin",
        "400"
    ]);
    expect(&o, 3, &["comparison failed", "no bin"]);
    c.unchanged_except(&[]);
}
