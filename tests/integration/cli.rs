//! The `spex` binary as a user meets it: the reference case end to end with `--test`, the
//! output file layout, and one clear error (and no output file) for each kind of bad input.

use std::path::{Path, PathBuf};
use std::process::Command;

use crate::common::{data, path_str as s, run_spex as spex};
use spex::fits::Fits;

fn bundle0_args<'a>(input: &'a str, psf: &'a str, output: &'a str) -> Vec<&'a str> {
    vec![
        "-i",
        input,
        "-p",
        psf,
        "-o",
        output,
        "-w",
        "6000,6400,0.8",
        "-s",
        "0",
        "-n",
        "25",
        "--threads",
        "2",
    ]
}

#[test]
fn reference_case_end_to_end_with_test_and_model() {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("frame.fits");
    let model = dir.path().join("model.fits");
    let (input, psf, reference) = (
        data("preproc-bundle0.fits"),
        data("psf-r0-00067784.fits"),
        data("reference-frame-bundle0.fits"),
    );
    let mut args = bundle0_args(s(&input), s(&psf), s(&out));
    args.extend(["-m", s(&model), "--test", s(&reference)]);
    let o = spex(&args);
    let stdout = String::from_utf8_lossy(&o.stdout);
    assert!(
        o.status.success(),
        "stderr: {}",
        String::from_utf8_lossy(&o.stderr)
    );
    assert!(stdout.contains("< 1e-4"), "{stdout}");

    let mut f = Fits::open(&out).unwrap();
    f.move_to("FLUX").unwrap();
    assert_eq!(f.image_shape().unwrap(), vec![25, 501]);
    assert_eq!(f.key_i64("NSPEC").unwrap(), Some(25));
    assert_eq!(f.key_i64("SPECMIN").unwrap(), Some(0));
    assert_eq!(
        f.key_str("BUNIT").unwrap().as_deref(),
        Some("electron/Angstrom")
    );
    assert_eq!(
        f.key_str("CAMERA").unwrap().as_deref(),
        Some("r0"),
        "IMAGE header passed through"
    );
    assert!((f.key_f64("WAVEMIN").unwrap().unwrap() - 6000.0).abs() < 1e-9);
    assert!((f.key_f64("WAVEMAX").unwrap().unwrap() - 6400.0).abs() < 1e-6);
    for (hdu, shape) in [
        ("IVAR", vec![25, 501]),
        ("MASK", vec![25, 501]),
        ("WAVELENGTH", vec![501]),
        ("RESOLUTION", vec![25, 11, 501]),
        ("CHI2PIX", vec![25, 501]),
    ] {
        f.move_to(hdu).unwrap();
        assert_eq!(f.image_shape().unwrap(), shape, "{hdu}");
    }
    f.move_to("FIBERMAP").unwrap();
    assert_eq!(
        f.nrows().unwrap(),
        25,
        "FIBERMAP sliced to the extracted fibers"
    );
    let (_, fibers) = f.column::<i32>("FIBER").unwrap();
    assert_eq!(fibers, (0..25).collect::<Vec<i32>>());

    let mut m = Fits::open(&model).unwrap();
    m.move_to("MODEL").unwrap();
    assert_eq!(m.image_shape().unwrap(), vec![4128, 4114]);
    let (_, model) = m.read_image::<f64>().unwrap();
    assert_model_fits_the_image(&model, &input, &psf);
    // nothing but the two outputs was left in the directory
    assert_eq!(std::fs::read_dir(dir.path()).unwrap().count(), 2);
}

/// The model image reproduces the preproc image where the extraction looked. Inside the
/// traces of fibers 1-23 over 6100-6300 A (away from the light of the simulated fibers and
/// wavelengths that the extraction leaves out), the residuals' chi2 per usable pixel is that
/// of the noise, ~1 (a model that misses the spots by a tenth of their light is far above),
/// and the model holds the image's light to a few percent (cosmic rays are masked).
fn assert_model_fits_the_image(model: &[f64], input: &Path, psf: &Path) {
    let psf = spex::psf::GaussHermitePsf::read(psf).unwrap();
    let mut f = Fits::open(input).unwrap();
    f.move_to("IMAGE").unwrap();
    let (shape, pix) = f.read_image::<f32>().unwrap();
    f.move_to("IVAR").unwrap();
    let (_, ivar) = f.read_image::<f32>().unwrap();
    let ncols = shape[1];
    let (_, y0) = psf.xy(12, 6100.0);
    let (_, y1) = psf.xy(12, 6300.0);
    let (mut chi2, mut n, mut light, mut modelled) = (0.0, 0usize, 0.0, 0.0);
    for y in y0.round() as usize..y1.round() as usize {
        let wave = 6100.0 + 200.0 * (y as f64 - y0) / (y1 - y0);
        let x0 = psf.xy(1, wave).0.round() as usize - 3;
        let x1 = psf.xy(23, wave).0.round() as usize + 3;
        for i in y * ncols + x0..y * ncols + x1 {
            if ivar[i] > 0.0 {
                chi2 += (pix[i] as f64 - model[i]).powi(2) * ivar[i] as f64;
                n += 1;
                light += pix[i] as f64;
                modelled += model[i];
            }
        }
    }
    assert!(n > 10_000, "the check covers {n} pixels");
    let per_pixel = chi2 / n as f64;
    assert!(
        (0.5..2.0).contains(&per_pixel),
        "chi2 per pixel of the model {per_pixel}"
    );
    assert!(
        (modelled / light - 1.0).abs() < 0.05,
        "the model holds {modelled} of the image's {light} electrons"
    );
}

/// Runs a failing extraction and checks: non-zero exit, one error line that mentions
/// `needle`, and neither the output `frame.fits` nor a temporary of it left in `dir`.
fn assert_fails(args: &[&str], dir: &Path, needle: &str) {
    let o = spex(args);
    let stderr = String::from_utf8_lossy(&o.stderr);
    assert!(!o.status.success(), "succeeded: {args:?}");
    let errors: Vec<&str> = stderr.lines().filter(|l| l.contains("error")).collect();
    assert_eq!(errors.len(), 1, "expected one error line, got:\n{stderr}");
    assert!(
        errors[0].contains(needle),
        "error line {:?} does not mention {needle:?}",
        errors[0]
    );
    let left: Vec<PathBuf> = std::fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| {
            p.file_name()
                .unwrap()
                .to_string_lossy()
                .contains("frame.fits")
        })
        .collect();
    assert!(left.is_empty(), "files left: {left:?}");
}

/// Writes a small preproc-like file; `ivar_shape` and `with_mask` make it inconsistent.
fn write_bad_image(path: &Path, ivar_shape: [usize; 2], with_mask: bool) {
    let mut f = Fits::create(path).unwrap();
    f.write_image::<f32>("IMAGE", &[10, 10], &[1.0; 100])
        .unwrap();
    let n = ivar_shape[0] * ivar_shape[1];
    f.write_image::<f32>("IVAR", &ivar_shape, &vec![1.0; n])
        .unwrap();
    if with_mask {
        f.write_image::<i32>("MASK", &[10, 10], &[0; 100]).unwrap();
    }
    f.close().unwrap();
}

#[test]
fn bad_inputs_give_one_clear_error_and_no_output() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let out = d.join("frame.fits");
    let (input, psf) = (data("preproc-bundle0.fits"), data("psf-r0-00067784.fits"));
    let (i, p, o) = (s(&input), s(&psf), s(&out));

    assert_fails(
        &bundle0_args("/no/such/preproc.fits", p, o),
        d,
        "/no/such/preproc.fits",
    );
    assert_fails(
        &bundle0_args(i, "/no/such/psf.fits", o),
        d,
        "/no/such/psf.fits",
    );
    // a PSF given as the image: no IMAGE HDU
    assert_fails(&bundle0_args(p, p, o), d, "IMAGE");
    // an image given as the PSF: no PSF table
    assert_fails(&bundle0_args(i, i, o), d, "PSF");

    let bad = d.join("bad.fits");
    write_bad_image(&bad, [10, 12], true);
    assert_fails(&bundle0_args(s(&bad), p, o), d, "IVAR has shape");
    write_bad_image(&bad, [10, 10], false);
    assert_fails(&bundle0_args(s(&bad), p, o), d, "MASK");
    std::fs::remove_file(&bad).unwrap();

    let with = |extra: &[&'static str]| {
        let mut a = vec!["-i", i, "-p", p, "-o", o, "--threads", "1"];
        a.extend_from_slice(extra);
        a
    };
    assert_fails(
        &with(&["-w", "3000,4000,0.8", "-n", "25"]),
        d,
        "outside the PSF",
    );
    assert_fails(
        &with(&["-w", "6000,6400,0.8", "-s", "475", "-n", "50"]),
        d,
        "beyond the PSF",
    );
    assert_fails(&with(&["-w", "6000,6400,0.8", "-n", "0"]), d, "nspec");
    assert_fails(
        &with(&["-w", "6000,6400,0.8", "-n", "25", "--nsubbundles", "4"]),
        d,
        "divisible",
    );
    assert_fails(
        &with(&["-w", "6000,6400,0", "-n", "25"]),
        d,
        "dw must be positive",
    );
    assert_fails(
        &with(&["-w", "6000,6400,-0.8", "-n", "25"]),
        d,
        "dw must be positive",
    );
    let missing_dir = d.join("no-such-dir/frame.fits");
    assert_fails(
        &[
            "-i",
            i,
            "-p",
            p,
            "-o",
            s(&missing_dir),
            "-w",
            "6000,6400,0.8",
            "-n",
            "25",
        ],
        d,
        "output directory does not exist",
    );
}

#[test]
fn psf_without_a_parameter_is_rejected_by_name() {
    let dir = tempfile::tempdir().unwrap();
    let broken = dir.path().join("psf.fits");
    std::fs::copy(data("psf-r0-00067784.fits"), &broken).unwrap();
    {
        let mut f = fitsio::FitsFile::edit(&broken).unwrap();
        let hdu = f.hdu("PSF").unwrap();
        hdu.delete_column(&mut f, "COEFF").unwrap();
    }
    let out = dir.path().join("frame.fits");
    let i = data("preproc-bundle0.fits");
    assert_fails(
        &bundle0_args(s(&i), s(&broken), s(&out)),
        dir.path(),
        "column COEFF",
    );
}

#[test]
fn compare_exits_3_outside_limits() {
    let (a, t) = (
        data("reference-frame-bundle0.fits"),
        data("truth-bundle0.fits"),
    );
    // two extractions of the same input that agree: spex's frame and gpu_specter's
    let dir = tempfile::tempdir().unwrap();
    let ours = dir.path().join("ours.fits");
    let (input, psf) = (data("preproc-bundle0.fits"), data("psf-r0-00067784.fits"));
    let o = spex(&bundle0_args(s(&input), s(&psf), s(&ours)));
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let o = spex(&["compare", s(&ours), s(&a)]);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    assert!(String::from_utf8_lossy(&o.stdout).contains("bins compared: 12525"));
    let o = spex(&["compare", s(&a), "--truth", s(&t)]);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    assert!(String::from_utf8_lossy(&o.stdout).contains("median |pull|"));
    // an impossible bound fails with status 3
    let o = spex(&["compare", s(&a), "--truth", s(&t), "--max-std", "0.5"]);
    assert_eq!(o.status.code(), Some(3));
    // a frame whose flux moved by a tenth of a sigma in one bin fails parity
    let moved = dir.path().join("moved.fits");
    let mut frame = spex::frame::Frame::read(&a).unwrap();
    let bin = [1, 100];
    frame.flux[bin] += 0.1 / frame.ivar[bin].sqrt();
    frame.write(&moved, &Default::default()).unwrap();
    let o = spex(&["compare", s(&a), s(&moved)]);
    assert_eq!(
        o.status.code(),
        Some(3),
        "{}",
        String::from_utf8_lossy(&o.stderr)
    );
    assert!(String::from_utf8_lossy(&o.stderr).contains("max |df|/sigma"));
    // frames of different grids fail the comparison
    let b = data("reference-frame-bundle1.fits");
    let o = spex(&["compare", s(&a), s(&b)]);
    assert_eq!(o.status.code(), Some(3));
    assert!(String::from_utf8_lossy(&o.stderr).contains("different wavelength grids"));
}

/// `--gpu` where no CUDA driver can be loaded fails at once with one line naming what is
/// missing. On a machine whose driver loads from the system's paths all the same, the run
/// must succeed on the GPU and say so; anything else fails the test.
#[test]
fn gpu_without_a_driver_is_one_clear_error() {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("frame.fits");
    let (input, psf) = (data("preproc-bundle0.fits"), data("psf-r0-00067784.fits"));
    let mut args = bundle0_args(s(&input), s(&psf), s(&out));
    args.push("--gpu");
    let o = Command::new(env!("CARGO_BIN_EXE_spex"))
        .args(&args)
        .env("LD_LIBRARY_PATH", dir.path())
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&o.stderr);
    if o.status.success() {
        // The driver loaded from the system's paths and a GPU ran the frame: the log must
        // name it as the backend (README: "The log names the backend that ran").
        assert!(stderr.contains("extracts on cuda:"), "{stderr}");
        assert!(out.exists());
        return;
    }
    assert_eq!(o.status.code(), Some(1));
    assert!(
        stderr.contains("GPU: cannot load the CUDA driver library"),
        "{stderr}"
    );
    assert!(!out.exists());
}

/// desi_proc's science line on an image whose header has no pointing or date: one line names
/// the file and the missing keyword, the status is 1 and no frame is written.
#[test]
fn barycentric_correction_without_its_keywords_names_the_file_and_the_keyword() {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("frame.fits");
    let (input, psf) = (data("preproc-bundle0.fits"), data("psf-r0-00067784.fits"));
    let mut args = bundle0_args(s(&input), s(&psf), s(&out));
    args.extend(["--barycentric-correction", "--no-gpu"]);
    let o = spex(&args);
    assert_eq!(
        o.status.code(),
        Some(1),
        "{}",
        String::from_utf8_lossy(&o.stderr)
    );
    assert_fails(&args, dir.path(), "preproc-bundle0.fits");
    let stderr = String::from_utf8_lossy(&o.stderr);
    let line = stderr.lines().find(|l| l.contains("error")).unwrap_or("");
    assert!(
        ["TARGTRA", "MJD", "RA"].iter().any(|k| line.contains(k)),
        "the error line names no keyword: {line}"
    );
}

/// `-f` takes the fibermap from another file: its rows are the ones copied into the frame.
#[test]
fn fibermap_option_takes_the_fibermap_of_another_file() {
    use fitsio::tables::{ColumnDataType, ColumnDescription};
    let dir = tempfile::tempdir().unwrap();
    let (out, fibermap) = (
        dir.path().join("frame.fits"),
        dir.path().join("fibermap.fits"),
    );
    {
        let mut f = fitsio::FitsFile::create(&fibermap).open().unwrap();
        let columns = ["FIBER", "TARGETID"].map(|name| {
            ColumnDescription::new(name)
                .with_type(ColumnDataType::Long)
                .create()
                .unwrap()
        });
        let h = f.create_table("FIBERMAP", &columns).unwrap();
        let fibers: Vec<i64> = (0..500).collect();
        let targets: Vec<i64> = fibers.iter().map(|f| 7_000_000 + f).collect();
        h.write_col(&mut f, "FIBER", &fibers).unwrap();
        h.write_col(&mut f, "TARGETID", &targets).unwrap();
    }
    let (input, psf) = (data("preproc-bundle0.fits"), data("psf-r0-00067784.fits"));
    let mut args = bundle0_args(s(&input), s(&psf), s(&out));
    args.extend(["-f", s(&fibermap), "--no-gpu"]);
    let o = spex(&args);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let mut f = fitsio::FitsFile::open(&out).unwrap();
    let h = f.hdu("FIBERMAP").unwrap();
    let targets: Vec<i64> = h.read_col(&mut f, "TARGETID").unwrap();
    assert_eq!(targets, (7_000_000..7_000_025).collect::<Vec<i64>>());
}
