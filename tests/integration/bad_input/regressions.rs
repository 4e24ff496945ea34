//! Regression tests of the defects found by the first adversarial review, each named after
//! the defect it pins.

use super::files::{absurd_option, refused_options};
use super::*;

/// A 2000 x 200 block of NaN in a tile-compressed IMAGE fills whole tiles, which cfitsio read
/// as 0 without a null value: the bins got flux with ivar > 0. Every such bin must be masked.
#[test]
fn nan_block_in_compressed_image_is_flagged_not_extracted() {
    let mut c = Case::new();
    let (input, psf, out) = (
        c.path("nan.fits"),
        c.copy(PSF, "psf.fits"),
        c.path("f.fits"),
    );
    write_image(
        &input,
        true,
        |r, _| if r >= 600 { f32::NAN } else { 10.0 },
        unit,
    );
    c.seal();
    let o = extract(&input, &psf, &out, vec![]);
    expect(&o, 0, &[]);
    c.unchanged_except(&["f.fits"]);
    let frame = Frame::read(&out).unwrap();
    // no weight: only gpu_specter's regularisation, 1e-15 per bin, as desispec writes it
    assert!(
        frame.ivar.iter().all(|&v| v < 1e-14),
        "a bin of NaN pixels has ivar above the regularisation's"
    );
    assert!(frame.flux.iter().all(|&f| f == 0.0));
    assert!(frame.mask.iter().all(|&m| m & specmask::ALLBADPIX != 0));
}

#[test]
fn output_equal_to_input_is_refused() {
    let mut c = Case::new();
    let (input, psf) = (c.copy(IMAGE, "in.fits"), c.copy(PSF, "psf.fits"));
    c.seal();
    let o = extract(&input, &psf, &input, vec![]);
    expect(&o, 1, &["in.fits", "replace the input"]);
    c.unchanged_except(&[]);
}

#[test]
fn output_equal_to_psf_is_refused() {
    let mut c = Case::new();
    let (input, psf) = (c.copy(IMAGE, "in.fits"), c.copy(PSF, "psf.fits"));
    c.seal();
    let o = extract(&input, &psf, &psf, vec![]);
    expect(&o, 1, &["psf.fits", "replace the input"]);
    c.unchanged_except(&[]);
}

#[test]
fn model_equal_to_input_is_refused() {
    let mut c = Case::new();
    let (input, psf) = (c.copy(IMAGE, "in.fits"), c.copy(PSF, "psf.fits"));
    c.seal();
    let o = extract(&input, &psf, &c.path("f.fits"), args!["-m", &input]);
    expect(&o, 1, &["in.fits", "replace the input"]);
    c.unchanged_except(&[]);
}

#[test]
fn output_hard_link_to_input_is_refused() {
    let mut c = Case::new();
    let (input, psf) = (c.copy(IMAGE, "in.fits"), c.copy(PSF, "psf.fits"));
    std::fs::hard_link(&input, c.path("link.fits")).unwrap();
    c.seal();
    let o = extract(&input, &psf, &c.path("link.fits"), vec![]);
    expect(&o, 1, &["link.fits", "replace the input"]);
    c.unchanged_except(&[]);
}

#[test]
fn output_equal_to_model_is_refused() {
    let mut c = Case::new();
    let (input, psf) = (c.copy(IMAGE, "in.fits"), c.copy(PSF, "psf.fits"));
    c.seal();
    let out = c.path("f.fits");
    let o = extract(
        &input,
        &psf,
        &out,
        args!["-m", c.dir.path().join(".").join("f.fits")],
    );
    expect(&o, 1, &["f.fits", "written once"]);
    c.unchanged_except(&[]);
}

#[test]
fn character_device_output_is_not_replaced() {
    let mut c = Case::new();
    let (input, psf) = (c.copy(IMAGE, "in.fits"), c.copy(PSF, "psf.fits"));
    c.seal();
    let o = extract(&input, &psf, Path::new("/dev/null"), vec![]);
    expect(&o, 1, &["/dev/null", "not a regular file"]);
    use std::os::unix::fs::FileTypeExt;
    assert!(std::fs::metadata("/dev/null")
        .unwrap()
        .file_type()
        .is_char_device());
    c.unchanged_except(&[]);
}

#[test]
fn symlink_to_a_device_output_is_not_replaced() {
    let mut c = Case::new();
    let (input, psf) = (c.copy(IMAGE, "in.fits"), c.copy(PSF, "psf.fits"));
    std::os::unix::fs::symlink("/dev/null", c.path("null.fits")).unwrap();
    c.seal();
    let o = extract(&input, &psf, &c.path("null.fits"), vec![]);
    expect(&o, 1, &["null.fits", "not a regular file"]);
    assert!(std::fs::symlink_metadata(c.path("null.fits"))
        .unwrap()
        .file_type()
        .is_symlink());
    c.unchanged_except(&[]);
}

#[test]
fn directory_output_is_refused() {
    let mut c = Case::new();
    let (input, psf) = (c.copy(IMAGE, "in.fits"), c.copy(PSF, "psf.fits"));
    std::fs::create_dir(c.path("out.fits")).unwrap();
    std::fs::write(c.path("out.fits/keep"), b"keep").unwrap();
    c.seal();
    let o = extract(&input, &psf, &c.path("out.fits"), vec![]);
    expect(&o, 1, &["out.fits", "not a regular file"]);
    c.unchanged_except(&[]);
}

#[test]
fn test_with_missing_reference_leaves_no_output() {
    let mut c = Case::new();
    let (input, psf) = (c.copy(IMAGE, "in.fits"), c.copy(PSF, "psf.fits"));
    c.seal();
    let o = extract(
        &input,
        &psf,
        &c.path("f.fits"),
        args!["--test", c.path("ref.fits")],
    );
    expect(&o, 1, &["ref.fits"]);
    c.unchanged_except(&[]);
}

#[test]
fn test_with_reference_of_another_shape_leaves_no_output() {
    let mut c = Case::new();
    let (input, psf) = (c.copy(IMAGE, "in.fits"), c.copy(PSF, "psf.fits"));
    let reference = c.copy("reference-frame-bundle0.fits", "ref.fits");
    c.seal();
    let o = extract(&input, &psf, &c.path("f.fits"), args!["--test", &reference]);
    expect(&o, 1, &["ref.fits", "does not match"]);
    c.unchanged_except(&[]);
}

#[test]
fn model_on_full_disk_leaves_no_frame() {
    let disk = Tmpfs::mount(2048, false);
    let mut c = Case::new();
    let (input, psf) = (c.copy(IMAGE, "in.fits"), c.copy(PSF, "psf.fits"));
    c.seal();
    let (out, model) = (disk.path("f.fits"), disk.path("model.fits"));
    let o = extract(&input, &psf, &out, args!["-m", &model]);
    expect(&o, 1, &["model.fits", "No space left on device"]);
    assert!(
        bytes_of(disk.dir.path()).is_empty(),
        "files left on the full disk"
    );
    c.unchanged_except(&[]);
}

#[test]
fn full_disk_is_reported_as_no_space_left() {
    let disk = Tmpfs::mount(16, false);
    std::fs::write(disk.path("old.fits"), b"previous frame").unwrap();
    let mut c = Case::new();
    let (input, psf) = (c.copy(IMAGE, "in.fits"), c.copy(PSF, "psf.fits"));
    c.seal();
    let o = extract(&input, &psf, &disk.path("old.fits"), vec![]);
    expect(&o, 1, &["old.fits", "No space left on device"]);
    let left = bytes_of(disk.dir.path());
    assert_eq!(left.len(), 1, "{:?}", left.keys());
    assert_eq!(left["old.fits"], b"previous frame");
    c.unchanged_except(&[]);
}

#[test]
fn huge_nspec_does_not_overflow() {
    let mut c = Case::new();
    let (input, psf) = (c.copy(IMAGE, "in.fits"), c.copy(PSF, "psf.fits"));
    c.seal();
    let mut a = args!["-i", &input, "-p", &psf, "-o", c.path("f.fits")];
    a.extend(args![
        "-s",
        "25",
        "-n",
        "18446744073709551600",
        "--threads",
        "1"
    ]);
    let o = spex(a);
    expect(&o, 2, &["nspec"]);
    c.unchanged_except(&[]);
}

#[test]
fn max_wavepad_does_not_panic() {
    absurd_option(&["--wavepad", "18446744073709551615"], &["wavepad"]);
}

#[test]
fn compare_with_truth_outside_the_frame_grid_does_not_panic() {
    let mut c = Case::new();
    let frame = c.copy("reference-frame-bundle0.fits", "frame.fits");
    let truth = c.path("truth.fits");
    let mut f = spex::fits::Fits::create(&truth).unwrap();
    let wave: Vec<f64> = (0..20).map(|i| 9000.0 + 0.8 * i as f64).collect();
    f.write_image("WAVELENGTH", &[20], &wave).unwrap();
    f.write_image("FLUX", &[25, 20], &vec![1.0f64; 500])
        .unwrap();
    f.close().unwrap();
    c.seal();
    let o = spex(args!["compare", &frame, "--truth", &truth]);
    expect(&o, 3, &["comparison failed", "truth grid"]);
    c.unchanged_except(&[]);
}

#[test]
fn compare_of_frames_of_different_shapes_exits_3() {
    let mut c = Case::new();
    let a = c.copy("reference-frame-bundle0.fits", "a.fits");
    let mut small = Frame::read(&a).unwrap();
    small.nspec = 5;
    for v in [
        &mut small.flux,
        &mut small.ivar,
        &mut small.chi2pix,
        &mut small.pixmask_fraction,
    ] {
        *v = v.slice(ndarray::s![..5, ..]).to_owned();
    }
    small.mask = small.mask.slice(ndarray::s![..5, ..]).to_owned();
    small.resolution = small.resolution.slice(ndarray::s![..5, .., ..]).to_owned();
    small.write(&c.path("b.fits"), &Default::default()).unwrap();
    c.seal();
    let o = spex(args!["compare", &a, c.path("b.fits")]);
    expect(&o, 3, &["comparison failed", "differ in shape"]);
    c.unchanged_except(&[]);
}

#[test]
fn nwavestep_of_a_billion_is_refused_before_allocating() {
    absurd_option(&["--nwavestep", "1000000000"], &["nwavestep"]);
}

#[test]
fn nwavestep_in_exponent_notation_is_a_usage_error() {
    absurd_option(&["--nwavestep", "1e9"], &["--nwavestep", "1e9"]);
}

#[test]
fn wavepad_of_1e8_is_refused_before_allocating() {
    absurd_option(&["--wavepad", "100000000"], &["wavepad"]);
}

#[test]
fn nwavestep_2000_is_refused() {
    absurd_option(&["--nwavestep", "2000"], &["nwavestep (2000)"]);
}

#[test]
fn threads_100000_is_refused() {
    let grid = args!["-w", "6000,6040,0.8", "-s", "0", "-n", "25"];
    refused_options(
        [grid, args!["--threads", "100000"]].concat(),
        &["threads (100000)"],
    );
}

#[test]
fn bracketed_output_name_is_written_literally() {
    let mut c = Case::new();
    let (input, psf) = (c.copy(IMAGE, "in.fits"), c.copy(PSF, "psf.fits"));
    c.seal();
    let o = extract(&input, &psf, &c.path("out[1].fits"), vec![]);
    expect(&o, 0, &[]);
    c.unchanged_except(&["out[1].fits"]);
    assert_eq!(Frame::read(&c.path("out[1].fits")).unwrap().nspec, 25);
}

#[test]
fn gz_output_is_compressed() {
    let mut c = Case::new();
    let (input, psf) = (c.copy(IMAGE, "in.fits"), c.copy(PSF, "psf.fits"));
    c.seal();
    let o = extract(&input, &psf, &c.path("f.fits.gz"), vec![]);
    expect(&o, 0, &[]);
    c.unchanged_except(&["f.fits.gz"]);
    let bytes = std::fs::read(c.path("f.fits.gz")).unwrap();
    assert_eq!(&bytes[..2], &[0x1f, 0x8b], "not gzip");
    assert_eq!(Frame::read(&c.path("f.fits.gz")).unwrap().nspec, 25);
}

#[test]
fn sigterm_during_write_leaves_no_temporary() {
    interrupted_write("TERM", 143);
}

#[test]
fn sigint_during_write_leaves_no_temporary() {
    interrupted_write("INT", 130);
}

/// Starts an extraction with a model image (a 68 MB write), sends `signal` as soon as a
/// temporary file appears, and checks the exit status and that nothing is left.
pub(super) fn interrupted_write(signal: &str, code: i32) {
    let mut c = Case::new();
    let (input, psf) = (c.copy(IMAGE, "in.fits"), c.copy(PSF, "psf.fits"));
    std::fs::write(c.path("f.fits"), b"previous frame").unwrap();
    c.seal();
    let mut a = args!["-i", &input, "-p", &psf, "-o", c.path("f.fits")];
    a.extend(options());
    a.extend(args!["-m", c.path("model.fits")]);
    let mut child = Command::new(env!("CARGO_BIN_EXE_spex"))
        .args(&a)
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let stderr = read_in_background(child.stderr.take().unwrap());
    let t0 = Instant::now();
    let hidden = |dir: &Path| {
        std::fs::read_dir(dir)
            .unwrap()
            .any(|e| e.unwrap().file_name().to_string_lossy().starts_with('.'))
    };
    while !hidden(c.dir.path()) {
        assert!(
            child.try_wait().unwrap().is_none(),
            "spex ended before writing"
        );
        assert!(t0.elapsed() < TIMEOUT, "no temporary file appeared");
        std::thread::sleep(Duration::from_millis(1));
    }
    let killed = Command::new("kill")
        .args([format!("-{signal}"), child.id().to_string()])
        .status()
        .unwrap();
    assert!(killed.success());
    let status = child.wait().unwrap();
    let o = Outcome {
        code: status.code(),
        stderr: stderr.join().unwrap(),
        launched: false,
    };
    expect(&o, code, &[&format!("SIG{signal}"), "removed"]);
    c.unchanged_except(&[]);
}

#[test]
fn duplicate_output_in_list_is_refused_before_any_work() {
    let mut c = Case::new();
    let (input, psf) = (c.copy(IMAGE, "in.fits"), c.copy(PSF, "psf.fits"));
    let list = c.path("frames.txt");
    let out = c.path("f.fits");
    let line = format!("{} {} {}\n", input.display(), psf.display(), out.display());
    std::fs::write(&list, format!("{line}{line}")).unwrap();
    c.seal();
    let mut a = args!["--list", &list];
    a.extend(options());
    let o = spex(a);
    expect(&o, 1, &["f.fits", "written once"]);
    c.unchanged_except(&[]);
}

#[test]
fn usage_errors_exit_2_before_reading_inputs() {
    let mut c = Case::new();
    c.seal();
    let mut a = args![
        "-i",
        c.path("missing.fits"),
        "-p",
        c.path("missing-psf.fits")
    ];
    a.extend(args!["-o", c.path("f.fits"), "-s", "0", "-n", "0"]);
    let o = spex(a);
    expect(&o, 2, &["nspec must be positive"]);
    assert!(
        !o.stderr.contains("missing.fits"),
        "inputs were read: {}",
        o.stderr
    );
    c.unchanged_except(&[]);
}

#[test]
fn infinite_dw_is_reported_as_not_finite() {
    let mut c = Case::new();
    c.seal();
    let a = args![
        "-i",
        "a.fits",
        "-p",
        "b.fits",
        "-o",
        c.path("f.fits"),
        "-w",
        "6000,6400,inf"
    ];
    let o = spex(a);
    expect(&o, 2, &["dw must be finite"]);
    c.unchanged_except(&[]);
}

#[test]
fn simulate_with_huge_cosmic_density_does_not_hang() {
    let mut c = Case::new();
    let psf = c.copy(PSF, "psf.fits");
    c.seal();
    let t0 = Instant::now();
    let o = spex(args![
        "simulate",
        "-p",
        &psf,
        "-o",
        c.path("img.fits"),
        "--truth",
        c.path("t.fits"),
        "-w",
        "6000,6040,0.8",
        "-n",
        "25",
        "--cosmic-density",
        "1e12"
    ]);
    assert!(t0.elapsed() < Duration::from_secs(30));
    expect(&o, 2, &["cosmic-ray density"]);
    c.unchanged_except(&[]);
}

#[test]
fn psf_traces_off_the_ccd_warn_and_set_allbadpix() {
    let mut c = Case::new();
    let (input, psf) = (c.copy(IMAGE, "in.fits"), c.copy(PSF, "psf.fits"));
    // XTRACE of fibers 0-24: move their constant terms 10000 pixels off the CCD.
    let mut f = spex::fits::Fits::open(&psf).unwrap();
    f.move_to("XTRACE").unwrap();
    let (shape, mut x) = f.read_image::<f64>().unwrap();
    drop(f);
    for fiber in 0..25 {
        x[fiber * shape[1]] += 10000.0;
    }
    edit_image(&psf, "XTRACE", &x[..25 * shape[1]]);
    c.seal();
    let o = extract(&input, &psf, &c.path("f.fits"), vec![]);
    expect(&o, 0, &["psf.fits", "fibers 0-24", "leave the"]);
    c.unchanged_except(&["f.fits"]);
    let frame = Frame::read(&c.path("f.fits")).unwrap();
    for (i, &v) in frame.ivar.indexed_iter() {
        assert_eq!(v, 0.0);
        assert_ne!(frame.mask[i] & specmask::ALLBADPIX, 0, "bin {i:?}");
    }
}

#[test]
fn psf_with_zero_gauss_hermite_sigma_warns_and_flags_bins() {
    let mut c = Case::new();
    let (input, psf) = (c.copy(IMAGE, "in.fits"), c.copy(PSF, "psf.fits"));
    let row = psf_row(&psf, "GHSIGX");
    let mut f = spex::fits::Fits::open(&psf).unwrap();
    let legdeg = {
        f.move_to("PSF").unwrap();
        f.require_i64("LEGDEG").unwrap() as usize
    };
    drop(f);
    edit_column(&psf, "PSF", "COEFF", row, 1, &vec![0.0; 25 * (legdeg + 1)]);
    c.seal();
    let o = extract(&input, &psf, &c.path("f.fits"), vec![]);
    expect(&o, 0, &["psf.fits", "sigma"]);
    c.unchanged_except(&["f.fits"]);
    // Every fiber of the bundle has a PSF of zero width: no pixel constrains any bin.
    let frame = Frame::read(&c.path("f.fits")).unwrap();
    for (i, &m) in frame.mask.indexed_iter() {
        assert_ne!(m & specmask::ALLBADPIX, 0, "bin {i:?}");
    }
    assert!(frame.flux.iter().all(|f| f.is_finite()));
}

#[test]
fn mpi_run_with_one_failing_rank_leaves_no_output() {
    let mut c = Case::new();
    let (input, psf) = (c.copy(IMAGE, "in.fits"), c.copy(PSF, "psf.fits"));
    c.seal();
    let mut a = args!["-i", &input, "-p", &psf, "-o", c.path("f.fits")];
    a.extend(options());
    let o = run(Some(2), &a, &[("SPEX_TEST_FAULT", "error@1")]);
    expect(&o, 1, &["rank 1", "in.fits", "SPEX_TEST_FAULT"]);
    c.unchanged_except(&[]);
}

#[test]
fn mpi_run_with_one_aborting_rank_leaves_no_output() {
    let mut c = Case::new();
    let (input, psf) = (c.copy(IMAGE, "in.fits"), c.copy(PSF, "psf.fits"));
    c.seal();
    let mut a = args!["-i", &input, "-p", &psf, "-o", c.path("f.fits")];
    a.extend(options());
    let o = run(Some(2), &a, &[("SPEX_TEST_FAULT", "abort@1")]);
    // 128 + SIGABRT, as the launcher passes it on
    expect_launcher_report(&o, 134, &["rank 1", "signal 6"]);
    c.unchanged_except(&[]);
}
