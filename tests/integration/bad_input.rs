//! Bad input never corrupts or destroys data: the `spex` binary is run on corrupted,
//! truncated and compressed FITS files, NaN and Inf in its arrays, bad PSFs, absurd option
//! values, outputs that alias inputs or special files, unwritable places, a full disk,
//! signals during a write, `--list` edge cases and MPI runs with a failing rank.
//!
//! Every case runs in a directory of its own that holds its inputs, and asserts:
//! - the exit status;
//! - one line of stderr that names the user's file (or option) and the problem;
//! - no panic text;
//! - no file left behind, hidden temporaries included (only the outputs of a success);
//! - every file that was there before is byte-identical afterwards.
//!
//! Each defect found by the adversarial review that motivated this suite has a regression
//! test named after it. The full-disk cases mount a small tmpfs, which needs root (the
//! machines that run this suite are root); they fail, saying so, where mounting is refused.

use std::collections::BTreeMap;
use std::ffi::OsString;
use std::io::Read;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use crate::common::data;
use spex::frame::{specmask, Frame};

const PSF: &str = "psf-r0-00067784.fits";
const IMAGE: &str = "preproc-bundle0.fits";
/// Longest any case may run: a hang is a failure.
const TIMEOUT: Duration = Duration::from_secs(120);

/// A directory of its own for one case, with a record of what it held before the run.
struct Case {
    dir: tempfile::TempDir,
    before: BTreeMap<String, Vec<u8>>,
}

impl Case {
    fn new() -> Self {
        Case {
            dir: tempfile::tempdir().expect("temporary directory"),
            before: BTreeMap::new(),
        }
    }

    fn path(&self, name: &str) -> PathBuf {
        self.dir.path().join(name)
    }

    /// Copies a file of tests/data into the case's directory.
    fn copy(&self, name: &str, to: &str) -> PathBuf {
        let path = self.path(to);
        std::fs::copy(data(name), &path).expect("copy test data");
        path
    }

    /// Every file of the directory (hidden ones included) with its bytes.
    fn files(&self) -> BTreeMap<String, Vec<u8>> {
        files_of(self.dir.path())
    }

    /// Records the directory as it is before the run.
    fn seal(&mut self) {
        self.before = self.files();
    }

    /// Asserts that the directory holds what it held before, byte for byte, plus exactly
    /// the `created` files.
    fn unchanged_except(&self, created: &[&str]) {
        let after = self.files();
        for (name, bytes) in &self.before {
            let now = after.get(name);
            assert!(now.is_some(), "{name} was removed");
            assert!(now == Some(bytes), "{name} was modified");
        }
        let mut new: Vec<&String> = after
            .keys()
            .filter(|k| !self.before.contains_key(*k))
            .collect();
        new.sort();
        let mut want: Vec<&str> = created.to_vec();
        want.sort();
        assert_eq!(
            new.iter().map(|s| s.as_str()).collect::<Vec<_>>(),
            want,
            "files left in the directory"
        );
    }
}

fn files_of(dir: &Path) -> BTreeMap<String, Vec<u8>> {
    let mut out = BTreeMap::new();
    for entry in std::fs::read_dir(dir).expect("list directory") {
        let entry = entry.expect("entry");
        let name = entry.file_name().to_string_lossy().into_owned();
        let kind = entry.file_type().expect("file type");
        if kind.is_dir() {
            for (sub, bytes) in files_of(&entry.path()) {
                out.insert(format!("{name}/{sub}"), bytes);
            }
        } else if kind.is_file() {
            out.insert(name, std::fs::read(entry.path()).expect("read file"));
        } else {
            out.insert(name, b"<special>".to_vec());
        }
    }
    out
}

/// How a run ended.
struct Outcome {
    code: Option<i32>,
    stderr: String,
}

/// Runs `spex` (under `mpiexec -n ranks` when given) with a time limit.
fn run(ranks: Option<usize>, args: &[OsString], env: &[(&str, &str)]) -> Outcome {
    let exe = env!("CARGO_BIN_EXE_spex");
    let mut cmd = match ranks {
        None => Command::new(exe),
        Some(n) => {
            let mut c = Command::new("mpiexec");
            c.args([
                "--allow-run-as-root",
                "--oversubscribe",
                "--bind-to",
                "none",
            ])
            .args(["--mca", "btl_vader_single_copy_mechanism", "none"])
            .args(["-n", &n.to_string(), exe]);
            c
        }
    };
    let mut child = cmd
        .args(args)
        .envs(env.iter().copied())
        .env_remove("SPEX_LOG")
        .env_remove("DESI_NO_GPU")
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .expect("cannot start spex (or mpiexec, which the MPI cases need)");
    let stderr = read_in_background(child.stderr.take().expect("stderr"));
    let t0 = Instant::now();
    let status = loop {
        if let Some(s) = child.try_wait().expect("wait") {
            break s;
        }
        if t0.elapsed() > TIMEOUT {
            let _ = child.kill();
            panic!("spex {args:?} did not finish in {TIMEOUT:?}");
        }
        std::thread::sleep(Duration::from_millis(20));
    };
    Outcome {
        code: status.code(),
        stderr: stderr.join().expect("stderr reader"),
    }
}

fn read_in_background(mut pipe: impl Read + Send + 'static) -> std::thread::JoinHandle<String> {
    std::thread::spawn(move || {
        let mut s = String::new();
        let _ = pipe.read_to_string(&mut s);
        s
    })
}

fn spex(args: Vec<OsString>) -> Outcome {
    run(None, &args, &[])
}

/// Arguments from strings and paths.
macro_rules! args {
    ($($a:expr),* $(,)?) => { vec![$(OsString::from($a)),*] };
}

/// The extraction options of every case: bundle 0, 51 bins, one thread.
fn options() -> Vec<OsString> {
    args![
        "-w",
        "6000,6040,0.8",
        "-s",
        "0",
        "-n",
        "25",
        "--threads",
        "1"
    ]
}

fn extract(input: &Path, psf: &Path, output: &Path, extra: Vec<OsString>) -> Outcome {
    let mut a = args!["-i", input, "-p", psf, "-o", output];
    a.extend(options());
    a.extend(extra);
    spex(a)
}

/// Asserts the exit status, that no panic was printed, and that one line of stderr holds
/// every one of `needles`.
fn expect(o: &Outcome, code: i32, needles: &[&str]) {
    assert_eq!(o.code, Some(code), "exit status; stderr:\n{}", o.stderr);
    for bad in ["panicked", "RUST_BACKTRACE", "stack backtrace"] {
        assert!(
            !o.stderr.contains(bad),
            "panic text in stderr:\n{}",
            o.stderr
        );
    }
    if needles.is_empty() {
        return;
    }
    assert!(
        o.stderr
            .lines()
            .any(|l| needles.iter().all(|n| l.contains(n))),
        "no line of stderr holds all of {needles:?}:\n{}",
        o.stderr
    );
}

/// cfitsio's value for undefined floating pixels: NaNs are written as this through
/// `ffppne`, which is how fpack and astropy store them in compressed tiles.
const FLOAT_NULL: f32 = -9.11912e-36;

/// Writes a small preproc image (1000 x 330 pixels, enough for bundle 0 at 6000-6040 A):
/// IMAGE and IVAR from the closures (NaN allowed), MASK 0; tile-compressed if asked.
fn write_image(
    path: &Path,
    compressed: bool,
    pix: impl Fn(usize, usize) -> f32,
    ivar: impl Fn(usize, usize) -> f32,
) {
    use fitsio::images::{ImageDescription, ImageType};
    let (nrows, ncols) = (1000, 330);
    let name = match compressed {
        true => format!("{}[compress]", path.display()),
        false => path.display().to_string(),
    };
    let mut f = fitsio::FitsFile::create(&name)
        .open()
        .expect("create image");
    let float = ImageDescription {
        data_type: ImageType::Float,
        dimensions: &[nrows, ncols],
    };
    for (extname, values) in [("IMAGE", &pix as &dyn Fn(_, _) -> f32), ("IVAR", &ivar)] {
        f.create_image(extname, &float).expect("create HDU");
        let mut v: Vec<f32> = (0..nrows * ncols)
            .map(|i| values(i / ncols, i % ncols))
            .map(|x| if x.is_nan() { FLOAT_NULL } else { x })
            .collect();
        let mut status = 0;
        // SAFETY: the file is open on the image just created, of `v.len()` pixels.
        unsafe {
            fitsio::sys::ffppne(
                f.as_raw(),
                1,
                1,
                v.len() as i64,
                v.as_mut_ptr(),
                FLOAT_NULL,
                &mut status,
            )
        };
        assert_eq!(status, 0, "writing {extname}");
    }
    let int = ImageDescription {
        data_type: ImageType::Long,
        dimensions: &[nrows, ncols],
    };
    let hdu = f.create_image("MASK", &int).expect("create MASK");
    hdu.write_image(&mut f, &vec![0i32; nrows * ncols])
        .expect("write MASK");
}

fn unit(_: usize, _: usize) -> f32 {
    1.0
}

/// Overwrites `values` in the numeric column `column` of HDU `hdu`, row `row`, from element
/// `first` (all counted from 1), through cfitsio.
fn edit_column(path: &Path, hdu: &str, column: &str, row: i64, first: i64, values: &[f64]) {
    let mut f = fitsio::FitsFile::edit(path).expect("open for edit");
    f.hdu(hdu).expect("HDU");
    let mut cname = std::ffi::CString::new(column)
        .unwrap()
        .into_bytes_with_nul();
    let (mut colnum, mut status) = (0, 0);
    let mut v = values.to_vec();
    // SAFETY: an open file positioned on `hdu`; NUL-terminated column name; `v` alive.
    unsafe {
        let ptr = f.as_raw();
        fitsio::sys::ffgcno(ptr, 0, cname.as_mut_ptr().cast(), &mut colnum, &mut status);
        fitsio::sys::ffpcld(
            ptr,
            colnum,
            row,
            first,
            v.len() as i64,
            v.as_mut_ptr(),
            &mut status,
        );
    }
    assert_eq!(status, 0, "editing {column}");
}

/// Overwrites the first `values.len()` values of image HDU `hdu`.
fn edit_image(path: &Path, hdu: &str, values: &[f64]) {
    let mut f = fitsio::FitsFile::edit(path).expect("open for edit");
    let h = f.hdu(hdu).expect("HDU");
    h.write_section(&mut f, 0, values.len(), values)
        .expect("write image");
}

/// The row of parameter `param` in the PSF table (counted from 1).
fn psf_row(path: &Path, param: &str) -> i64 {
    let mut f = spex::fits::Fits::open(path).unwrap();
    f.move_to("PSF").unwrap();
    let names = f.column_str("PARAM").unwrap();
    names.iter().position(|n| n.trim() == param).unwrap() as i64 + 1
}

/// A small tmpfs of `kib` KiB mounted on a new directory, unmounted on drop.
struct Tmpfs {
    dir: tempfile::TempDir,
}

impl Tmpfs {
    fn mount(kib: usize, read_only: bool) -> Self {
        let dir = tempfile::tempdir().unwrap();
        let mut opts = format!("size={}k", kib);
        if read_only {
            opts.push_str(",ro");
        }
        let status = Command::new("mount")
            .args(["-t", "tmpfs", "-o", &opts, "tmpfs"])
            .arg(dir.path())
            .status()
            .expect("run mount");
        assert!(
            status.success(),
            "cannot mount a tmpfs (the full-disk cases need root): {status}"
        );
        Tmpfs { dir }
    }

    fn path(&self, name: &str) -> PathBuf {
        self.dir.path().join(name)
    }
}

impl Drop for Tmpfs {
    fn drop(&mut self) {
        let _ = Command::new("umount").arg(self.dir.path()).status();
    }
}

fn bytes_of(dir: &Path) -> BTreeMap<String, Vec<u8>> {
    files_of(dir)
}

// ---------------------------------------------------------------------------------------
// Regression tests of the defects, named after them.
// ---------------------------------------------------------------------------------------

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
    assert!(
        frame.ivar.iter().all(|&v| v == 0.0),
        "a bin of NaN pixels has ivar > 0"
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
    let mut c = Case::new();
    let (input, psf) = (c.copy(IMAGE, "in.fits"), c.copy(PSF, "psf.fits"));
    c.seal();
    let mut a = args!["-i", &input, "-p", &psf, "-o", c.path("f.fits")];
    a.extend(args![
        "-w",
        "6000,6040,0.8",
        "-s",
        "0",
        "-n",
        "25",
        "--threads",
        "100000"
    ]);
    let o = spex(a);
    expect(&o, 2, &["threads (100000)"]);
    c.unchanged_except(&[]);
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
fn interrupted_write(signal: &str, code: i32) {
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
    };
    expect(&o, code, &[]);
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
    a.extend(args!["-o", c.path("f.fits"), "-s", "0", "-n", "30"]);
    let o = spex(a);
    expect(&o, 2, &["nspec (30)", "bundlesize"]);
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
    expect(&o, 1, &["cosmic-ray density"]);
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
    let frame = Frame::read(&c.path("f.fits")).unwrap();
    for (i, &v) in frame.ivar.indexed_iter() {
        assert!(
            v > 0.0 || frame.mask[i] & specmask::ALLBADPIX != 0,
            "bin {i:?}"
        );
    }
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
    assert_ne!(o.code, Some(0), "{}", o.stderr);
    assert!(!o.stderr.contains("panicked"));
    c.unchanged_except(&[]);
}

// ---------------------------------------------------------------------------------------
// Corrupted, truncated and compressed FITS.
// ---------------------------------------------------------------------------------------

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
    damaged_image(|p| truncate(p, 0.5), &[]);
}

#[test]
fn truncated_psf_is_an_error() {
    damaged_psf(|p| truncate(p, 0.5), &[]);
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
        &[],
    );
}

#[test]
fn image_given_as_psf_is_an_error() {
    damaged_psf(|p| std::fs::copy(data(IMAGE), p).map(|_| ()).unwrap(), &[]);
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
    let gz = Command::new("gzip")
        .args(["-c"])
        .arg(data(IMAGE))
        .stdout(std::fs::File::create(&input).unwrap())
        .status()
        .expect("gzip");
    assert!(gz.success());
    c.seal();
    let o = extract(&input, &psf, &c.path("f.fits"), vec![]);
    expect(&o, 0, &[]);
    c.unchanged_except(&["f.fits"]);
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
/// the run succeeds and every bin is finite.
fn poisoned_image(compressed: bool, pix: f32, ivar: f32) {
    let mut c = Case::new();
    let (input, psf) = (c.path("in.fits"), c.copy(PSF, "psf.fits"));
    let bad = |r: usize| (700..900).contains(&r) && r % 7 == 0;
    write_image(
        &input,
        compressed,
        |r, _| if bad(r) { pix } else { 10.0 },
        |r, _| if bad(r) { ivar } else { 1.0 },
    );
    c.seal();
    let o = extract(&input, &psf, &c.path("f.fits"), vec![]);
    expect(&o, 0, &[]);
    c.unchanged_except(&["f.fits"]);
    let frame = Frame::read(&c.path("f.fits")).unwrap();
    let resolution = frame.resolution.view().into_dyn();
    let arrays = [&frame.flux, &frame.ivar, &frame.chi2pix].map(|a| a.view().into_dyn());
    for v in arrays.iter().chain([&resolution]) {
        assert!(
            v.iter().all(|x| x.is_finite()),
            "non-finite value in the frame"
        );
    }
    assert!(frame.ivar.iter().any(|&v| v > 0.0));
    assert!(frame.flux.iter().all(|f| f.abs() < 1e6), "absurd flux");
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

/// An option value that can be judged without reading anything: usage error, status 2.
fn absurd_option(extra: &[&str], needles: &[&str]) {
    let mut c = Case::new();
    let (input, psf) = (c.copy(IMAGE, "in.fits"), c.copy(PSF, "psf.fits"));
    c.seal();
    let extra: Vec<OsString> = extra.iter().map(OsString::from).collect();
    let o = extract(&input, &psf, &c.path("f.fits"), extra);
    expect(&o, 2, needles);
    c.unchanged_except(&[]);
}

#[test]
fn negative_regularize_is_refused() {
    absurd_option(&["--regularize=-1"], &["regularize"]);
}

#[test]
fn nan_regularize_is_refused() {
    absurd_option(&["--regularize", "nan"], &["regularize"]);
}

#[test]
fn infinite_psferr_is_refused() {
    absurd_option(&["--psferr", "inf"], &["psferr"]);
}

#[test]
fn huge_wavepad_frac_is_refused() {
    absurd_option(&["--wavepad-frac", "1e300"], &["wavepad"]);
}

#[test]
fn pixpad_frac_above_one_is_refused() {
    absurd_option(&["--pixpad-frac", "2"], &["pixpad-frac"]);
}

#[test]
fn nsubbundles_not_dividing_the_bundle_is_refused() {
    absurd_option(&["--nsubbundles", "7"], &["nsubbundles (7)"]);
}

#[test]
fn wavelength_grid_of_too_many_bins_is_refused() {
    let mut c = Case::new();
    let (input, psf) = (c.copy(IMAGE, "in.fits"), c.copy(PSF, "psf.fits"));
    c.seal();
    let o = spex(args![
        "-i",
        &input,
        "-p",
        &psf,
        "-o",
        c.path("f.fits"),
        "-w",
        "1,1e300,0.8",
        "-n",
        "25"
    ]);
    expect(&o, 2, &["wavelength bins"]);
    c.unchanged_except(&[]);
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

#[test]
fn list_line_of_two_words_is_refused() {
    let mut c = Case::new();
    let list = c.path("frames.txt");
    std::fs::write(&list, "a.fits psf.fits\n").unwrap();
    c.seal();
    let o = spex(args!["--list", &list]);
    expect(&o, 1, &["frames.txt", "line 1"]);
    c.unchanged_except(&[]);
}

#[test]
fn empty_list_is_refused() {
    let mut c = Case::new();
    let list = c.path("frames.txt");
    std::fs::write(&list, "# nothing\n\n").unwrap();
    c.seal();
    let o = spex(args!["--list", &list]);
    expect(&o, 1, &["frames.txt", "no frame"]);
    c.unchanged_except(&[]);
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
