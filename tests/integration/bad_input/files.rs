//! Corrupted, truncated and compressed FITS inputs, and the files a run writes to.

use super::*;

/// An input (`in.fits`, the image, or `psf.fits`) broken by `damage`: exit 1, one line
/// naming it, nothing written.
fn damaged(name: &str, damage: impl FnOnce(&Path), needles: &[&str]) {
    let mut c = Case::new();
    let (input, psf) = (c.copy(IMAGE, "in.fits"), c.copy(PSF, "psf.fits"));
    damage(&c.path(name));
    c.seal();
    let o = extract(&input, &psf, &c.path("f.fits"), vec![]);
    let mut all = vec![name];
    all.extend_from_slice(needles);
    expect(&o, 1, &all);
    c.unchanged_except(&[]);
}

fn damaged_image(damage: impl FnOnce(&Path), needles: &[&str]) {
    damaged("in.fits", damage, needles);
}

fn damaged_psf(damage: impl FnOnce(&Path), needles: &[&str]) {
    damaged("psf.fits", damage, needles);
}

fn truncate(path: &Path, fraction: f64) {
    let len = std::fs::metadata(path).unwrap().len();
    let f = std::fs::OpenOptions::new().write(true).open(path).unwrap();
    f.set_len((len as f64 * fraction) as u64).unwrap();
}

#[test]
fn truncated_image_is_an_error() {
    damaged_image(|p| truncate(p, 0.5), &["cannot read image", "truncated"]);
}

#[test]
fn truncated_psf_is_an_error() {
    damaged_psf(|p| truncate(p, 0.5), &["HDU PSF", "past end of file"]);
}

#[test]
fn empty_image_file_is_an_error() {
    damaged_image(|p| truncate(p, 0.0), &["cannot open"]);
}

#[test]
fn garbled_image_header_is_an_error() {
    damaged_image(
        |p| {
            let mut b = std::fs::read(p).unwrap();
            b[..80].copy_from_slice(&[b'#'; 80]);
            std::fs::write(p, b).unwrap();
        },
        &["cannot open"],
    );
}

#[test]
fn text_file_as_psf_is_an_error() {
    damaged_psf(
        |p| std::fs::write(p, "not a FITS file\n".repeat(200)).unwrap(),
        &["cannot open", "not SIMPLE"],
    );
}

#[test]
fn image_given_as_psf_is_an_error() {
    damaged_psf(
        |p| std::fs::copy(data(IMAGE), p).map(|_| ()).unwrap(),
        &["HDU PSF", "missing"],
    );
}

#[test]
fn missing_input_is_an_error() {
    damaged_image(|p| std::fs::remove_file(p).unwrap(), &["No such file"]);
}

#[test]
fn directory_as_input_is_an_error() {
    damaged_image(
        |p| {
            std::fs::remove_file(p).unwrap();
            std::fs::create_dir(p).unwrap();
        },
        &["not a regular file"],
    );
}

#[test]
fn gzipped_input_is_read() {
    let mut c = Case::new();
    let psf = c.copy(PSF, "psf.fits");
    let input = c.path("in.fits.gz");
    std::fs::write(&input, gzip_member(&std::fs::read(data(IMAGE)).unwrap())).unwrap();
    c.seal();
    let o = extract(&input, &psf, &c.path("f.fits"), vec![]);
    expect(&o, 0, &[]);
    c.unchanged_except(&["f.fits"]);
    // the same frame as from the plain file
    let plain = tempfile::tempdir().unwrap();
    let o = extract(&data(IMAGE), &psf, &plain.path().join("f.fits"), vec![]);
    expect(&o, 0, &[]);
    assert_eq!(
        Frame::read(&c.path("f.fits")).unwrap(),
        Frame::read(&plain.path().join("f.fits")).unwrap(),
        "the gzipped input gives another frame"
    );
}

#[test]
fn image_without_mask_hdu_is_an_error() {
    let mut c = Case::new();
    let psf = c.copy(PSF, "psf.fits");
    let input = c.path("in.fits");
    let mut f = spex::fits::Fits::create(&input).unwrap();
    f.write_image("IMAGE", &[10, 10], &[1.0f32; 100]).unwrap();
    f.write_image("IVAR", &[10, 10], &[1.0f32; 100]).unwrap();
    f.close().unwrap();
    c.seal();
    let o = extract(&input, &psf, &c.path("f.fits"), vec![]);
    expect(&o, 1, &["in.fits", "MASK", "missing"]);
    c.unchanged_except(&[]);
}

#[test]
fn ivar_of_another_shape_is_an_error() {
    let mut c = Case::new();
    let psf = c.copy(PSF, "psf.fits");
    let input = c.path("in.fits");
    let mut f = spex::fits::Fits::create(&input).unwrap();
    f.write_image("IMAGE", &[10, 10], &[1.0f32; 100]).unwrap();
    f.write_image("IVAR", &[10, 9], &[1.0f32; 90]).unwrap();
    f.write_image("MASK", &[10, 10], &[0i32; 100]).unwrap();
    f.close().unwrap();
    c.seal();
    let o = extract(&input, &psf, &c.path("f.fits"), vec![]);
    expect(&o, 1, &["in.fits", "IVAR has shape"]);
    c.unchanged_except(&[]);
}

// ---------------------------------------------------------------------------------------
// NaN and Inf in every array.
// ---------------------------------------------------------------------------------------

/// An image whose pixels in rows 700..900 (bundle 0 at 6000-6040 A) have `pix` and `ivar`:
/// the run succeeds and its frame is that of the same image with those pixels masked
/// (ivar 0), bin for bin. A bad pixel read as a value with its weight kept, or a NaN read
/// as 0, changes the flux of the bins it touches.
fn poisoned_image(compressed: bool, pix: f32, ivar: f32) {
    let mut c = Case::new();
    let (input, psf) = (c.path("in.fits"), c.copy(PSF, "psf.fits"));
    let masked = c.path("masked.fits");
    let bad = |r: usize| (700..900).contains(&r) && r % 7 == 0;
    write_image(
        &input,
        compressed,
        |r, _| if bad(r) { pix } else { 10.0 },
        |r, _| if bad(r) { ivar } else { 1.0 },
    );
    write_image(&masked, compressed, |_, _| 10.0, |r, _| f32::from(!bad(r)));
    c.seal();
    let o = extract(&input, &psf, &c.path("f.fits"), vec![]);
    expect(&o, 0, &[]);
    c.unchanged_except(&["f.fits"]);
    let frame = Frame::read(&c.path("f.fits")).unwrap();
    let o = extract(&masked, &psf, &c.path("m.fits"), vec![]);
    expect(&o, 0, &[]);
    let reference = Frame::read(&c.path("m.fits")).unwrap();
    assert!(
        reference.ivar.iter().any(|&v| v > 0.0),
        "the masked rows leave bins to compare"
    );
    assert!(frame.flux.iter().all(|f| f.is_finite()));
    assert_eq!(
        frame, reference,
        "the bad pixels are not masked like ivar 0"
    );
}

#[test]
fn nan_pixels_are_masked() {
    poisoned_image(false, f32::NAN, 1.0);
}

#[test]
fn nan_pixels_of_a_compressed_image_are_masked() {
    poisoned_image(true, f32::NAN, 1.0);
}

#[test]
fn infinite_pixels_are_masked() {
    poisoned_image(false, f32::INFINITY, 1.0);
}

#[test]
fn nan_ivar_is_masked() {
    poisoned_image(false, 10.0, f32::NAN);
}

#[test]
fn infinite_ivar_is_masked() {
    poisoned_image(false, 10.0, f32::INFINITY);
}

#[test]
fn negative_ivar_is_masked() {
    poisoned_image(false, 10.0, -1.0);
}

#[test]
fn nan_in_psf_trace_is_an_error() {
    damaged_psf(
        |p| edit_image(p, "YTRACE", &[f64::NAN]),
        &["YTRACE", "non-finite"],
    );
}

#[test]
fn infinite_gauss_hermite_coefficient_is_an_error() {
    damaged_psf(
        |p| {
            let row = psf_row(p, "GH-0-0");
            edit_column(p, "PSF", "COEFF", row, 1, &[f64::INFINITY]);
        },
        &["GH-0-0", "non-finite"],
    );
}

#[test]
fn nan_in_frame_under_compare_fails_the_comparison_without_panic() {
    let mut c = Case::new();
    let a = c.copy("reference-frame-bundle0.fits", "a.fits");
    // spex never writes such a frame: put the NaN into a copy of a good one.
    let b = c.copy("reference-frame-bundle0.fits", "b.fits");
    let mut flux = vec![1.0; 11];
    flux[10] = f64::NAN;
    edit_image(&b, "FLUX", &flux);
    c.seal();
    let o = spex(args!["compare", &a, c.path("b.fits")]);
    expect(&o, 3, &["comparison failed"]);
    c.unchanged_except(&[]);
}

// ---------------------------------------------------------------------------------------
// Absurd option values, unwritable places, --list and simulate edge cases.
// ---------------------------------------------------------------------------------------

/// Options that can be judged without reading anything: `-i`, `-p`, `-o` of a case and
/// `args`, a usage error (status 2) holding `needles`, and nothing written.
pub(super) fn refused_options(args: Vec<OsString>, needles: &[&str]) {
    let mut c = Case::new();
    let (input, psf) = (c.copy(IMAGE, "in.fits"), c.copy(PSF, "psf.fits"));
    c.seal();
    let mut a = args!["-i", &input, "-p", &psf, "-o", c.path("f.fits")];
    a.extend(args);
    let o = spex(a);
    expect(&o, 2, needles);
    c.unchanged_except(&[]);
}

/// [`refused_options`] of the suite's options and `extra`.
pub(super) fn absurd_option(extra: &[&str], needles: &[&str]) {
    let mut a = options();
    a.extend(extra.iter().map(OsString::from));
    refused_options(a, needles);
}

#[test]
fn absurd_option_values_are_refused() {
    for (extra, needles) in [
        (&["--regularize=-1"][..], &["regularize"][..]),
        (&["--regularize", "nan"], &["regularize"]),
        (&["--psferr", "inf"], &["psferr"]),
        (&["--wavepad-frac", "1e300"], &["wavepad"]),
        (&["--pixpad-frac", "2"], &["pixpad-frac"]),
        (&["--nsubbundles", "7"], &["nsubbundles (7)"]),
    ] {
        absurd_option(extra, needles);
    }
}

#[test]
fn wavelength_grid_of_too_many_bins_is_refused() {
    refused_options(args!["-w", "1,1e300,0.8", "-n", "25"], &["wavelength bins"]);
}

#[test]
fn unwritable_directory_is_reported_with_its_cause() {
    let disk = Tmpfs::mount(64, true);
    let mut c = Case::new();
    let (input, psf) = (c.copy(IMAGE, "in.fits"), c.copy(PSF, "psf.fits"));
    c.seal();
    let o = extract(&input, &psf, &disk.path("f.fits"), vec![]);
    expect(&o, 1, &["f.fits", "Read-only file system"]);
    assert!(!o.stderr.contains("already exists"));
    assert!(bytes_of(disk.dir.path()).is_empty());
    c.unchanged_except(&[]);
}

#[test]
fn missing_output_directory_is_refused_before_reading() {
    let mut c = Case::new();
    let (input, psf) = (c.copy(IMAGE, "in.fits"), c.copy(PSF, "psf.fits"));
    c.seal();
    let o = extract(&input, &psf, &c.path("nowhere/f.fits"), vec![]);
    expect(
        &o,
        1,
        &["nowhere/f.fits", "output directory does not exist"],
    );
    c.unchanged_except(&[]);
}

#[test]
fn list_with_one_missing_input_writes_the_other_frames() {
    let mut c = Case::new();
    let (input, psf) = (c.copy(IMAGE, "in.fits"), c.copy(PSF, "psf.fits"));
    let list = c.path("frames.txt");
    std::fs::write(
        &list,
        format!(
            "# two frames\n{i} {p} {o1}\n{m} {p} {o2}\n",
            i = input.display(),
            p = psf.display(),
            m = c.path("missing.fits").display(),
            o1 = c.path("a.fits").display(),
            o2 = c.path("b.fits").display(),
        ),
    )
    .unwrap();
    c.seal();
    let mut a = args!["--list", &list];
    a.extend(options());
    let o = spex(a);
    expect(&o, 1, &["missing.fits", "No such file"]);
    c.unchanged_except(&["a.fits"]);
}

/// A `--list` file holding `text` fails with status 1 naming it and `needle`.
fn refused_list(text: &str, needle: &str) {
    let mut c = Case::new();
    let list = c.path("frames.txt");
    std::fs::write(&list, text).unwrap();
    c.seal();
    let o = spex(args!["--list", &list]);
    expect(&o, 1, &["frames.txt", needle]);
    c.unchanged_except(&[]);
}

#[test]
fn list_line_of_two_words_is_refused() {
    refused_list("a.fits psf.fits\n", "line 1");
}

#[test]
fn empty_list_is_refused() {
    refused_list("# nothing\n\n", "no frame");
}

#[test]
fn missing_list_is_an_error() {
    let mut c = Case::new();
    c.seal();
    let o = spex(args!["--list", c.path("frames.txt")]);
    expect(&o, 1, &["frames.txt", "No such file"]);
    c.unchanged_except(&[]);
}

#[test]
fn simulate_output_equal_to_psf_is_refused() {
    let mut c = Case::new();
    let psf = c.copy(PSF, "psf.fits");
    c.seal();
    let o = spex(args![
        "simulate",
        "-p",
        &psf,
        "-o",
        &psf,
        "--truth",
        c.path("t.fits"),
        "-w",
        "6000,6040,0.8"
    ]);
    expect(&o, 1, &["psf.fits", "replace the input"]);
    c.unchanged_except(&[]);
}

#[test]
fn simulate_truth_equal_to_image_is_refused() {
    let mut c = Case::new();
    let psf = c.copy(PSF, "psf.fits");
    c.seal();
    let o = spex(args![
        "simulate",
        "-p",
        &psf,
        "-o",
        c.path("img.fits"),
        "--truth",
        c.path("img.fits"),
        "-w",
        "6000,6040,0.8"
    ]);
    expect(&o, 1, &["img.fits", "written once"]);
    c.unchanged_except(&[]);
}

#[test]
fn compare_of_a_missing_frame_is_an_error() {
    let mut c = Case::new();
    let a = c.copy("reference-frame-bundle0.fits", "a.fits");
    c.seal();
    let o = spex(args!["compare", &a, c.path("b.fits")]);
    expect(&o, 1, &["b.fits", "No such file"]);
    c.unchanged_except(&[]);
}

#[test]
fn name_of_the_user_file_not_the_temporary_in_errors() {
    let disk = Tmpfs::mount(16, false);
    let mut c = Case::new();
    let (input, psf) = (c.copy(IMAGE, "in.fits"), c.copy(PSF, "psf.fits"));
    c.seal();
    let o = extract(&input, &psf, &disk.path("frame.fits"), vec![]);
    expect(&o, 1, &["frame.fits"]);
    assert!(
        !o.stderr.contains(".frame."),
        "a temporary name in: {}",
        o.stderr
    );
    assert!(bytes_of(disk.dir.path()).is_empty());
    c.unchanged_except(&[]);
}
