//! Bad input never corrupts or destroys data: the `spex` binary is run on corrupted,
//! truncated and compressed FITS files, NaN and Inf in its arrays, bad PSFs, absurd option
//! values, outputs that alias inputs or special files, unwritable places, a full disk,
//! signals during a write, `--list` edge cases and MPI runs with a failing rank.
//!
//! Every case runs in a directory of its own that holds its inputs, and asserts:
//! - the exit status;
//! - exactly one error line on stderr, naming the user's file (or option) and the problem
//!   (besides it only the log, clap's usage lines and an MPI launcher's own lines);
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
    /// Whether `mpiexec` ran it, whose own lines may follow spex's.
    launched: bool,
}

/// Runs `spex` (under `mpiexec -n ranks` when given) with a time limit.
fn run(ranks: Option<usize>, args: &[OsString], env: &[(&str, &str)]) -> Outcome {
    let exe = env!("CARGO_BIN_EXE_spex");
    let mut cmd = match ranks {
        None => Command::new(exe),
        Some(n) => {
            let mut c = crate::common::mpiexec(n);
            c.arg(exe);
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
        launched: ranks.is_some(),
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

/// A line of spex's log: a timestamp, behind `[rank R] ` under a launcher.
fn is_log_line(line: &str) -> bool {
    let line = match line.strip_prefix("[rank ") {
        Some(rest) => rest.split_once("] ").map_or("", |(_, l)| l),
        None => line,
    };
    let b = line.as_bytes();
    b.len() > 20 && b[..4].iter().all(u8::is_ascii_digit) && b[4] == b'-' && b[10] == b'T'
}

/// spex's error line: `spex: error:`, `spex: rank R: error:`, `spex: comparison failed:` (exit
/// status 3), or clap's `error:` for a usage error.
fn is_error_line(line: &str) -> bool {
    line.starts_with("error: ")
        || line.starts_with("spex: comparison failed: ")
        || (line.starts_with("spex: ") && line.contains(": error: "))
}

/// The count that ends a `--list` run with failed frames: `spex: N of M frames failed`.
fn is_list_summary(line: &str) -> bool {
    line.starts_with("spex: ") && line.ends_with(" frames failed")
}

/// Asserts the exit status, that no panic was printed, and what stderr holds besides the log:
/// - a failure (`code` not 0): exactly one error line, which holds every one of `needles`
///   (after it, clap's usage and hint lines for a usage error, the count of failed frames of
///   a `--list` run, and under a launcher the launcher's own lines); no other line;
/// - a success: no error line and no line outside the log; `needles`, if any, all in one
///   warning of the log.
fn expect(o: &Outcome, code: i32, needles: &[&str]) {
    assert_eq!(o.code, Some(code), "exit status; stderr:\n{}", o.stderr);
    for bad in ["panicked", "RUST_BACKTRACE", "stack backtrace"] {
        assert!(
            !o.stderr.contains(bad),
            "panic text in stderr:\n{}",
            o.stderr
        );
    }
    let lines: Vec<&str> = o.stderr.lines().filter(|l| !l.trim().is_empty()).collect();
    let errors: Vec<usize> = (0..lines.len())
        .filter(|&i| is_error_line(lines[i]))
        .collect();
    let holds = |l: &str| needles.iter().all(|n| l.contains(n));
    if code == 0 {
        assert!(
            errors.is_empty(),
            "an error line in a success:\n{}",
            o.stderr
        );
        let stray: Vec<&&str> = lines.iter().filter(|l| !is_log_line(l)).collect();
        assert!(stray.is_empty(), "lines outside the log: {stray:?}");
        if !needles.is_empty() {
            let warnings: Vec<&&str> = lines
                .iter()
                .filter(|l| l.contains(" WARN ") && holds(l))
                .collect();
            assert_eq!(
                warnings.len(),
                1,
                "one warning must hold all of {needles:?}:\n{}",
                o.stderr
            );
        }
        return;
    }
    assert!(
        !needles.is_empty(),
        "a failure must be checked for its cause"
    );
    assert_eq!(
        errors.len(),
        1,
        "exactly one error line expected:\n{}",
        o.stderr
    );
    let at = errors[0];
    assert!(
        holds(lines[at]),
        "the error line does not hold all of {needles:?}: {}",
        lines[at]
    );
    let usage = lines[at].starts_with("error: ");
    for (i, l) in lines.iter().enumerate() {
        let allowed =
            i == at || is_log_line(l) || (i > at && (usage || o.launched || is_list_summary(l)));
        assert!(allowed, "a line outside the log and the error: {l:?}");
    }
}

/// A rank killed by a signal cannot say why: the launcher's lines must name the rank and the
/// signal (besides the exit status and no panic text).
fn expect_launcher_report(o: &Outcome, code: i32, needles: &[&str]) {
    assert!(o.launched);
    assert_eq!(o.code, Some(code), "exit status; stderr:\n{}", o.stderr);
    assert!(!o.stderr.contains("panicked"), "{}", o.stderr);
    assert!(
        o.stderr
            .lines()
            .any(|l| needles.iter().all(|n| l.contains(n))),
        "no line of the launcher holds all of {needles:?}:\n{}",
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

/// The preproc of the suite with a pointing (TARGTRA 150, TARGTDEC `dec`) and a date
/// (MJD-OBS `mjd`) in the headers of `hdus`, for `--barycentric-correction`.
fn pointed_preproc(c: &Case, dec: f64, mjd: f64, hdus: &[&str]) -> PathBuf {
    let input = c.copy(IMAGE, "in.fits");
    let mut f = fitsio::FitsFile::edit(&input).expect("open the copy");
    for hdu in hdus {
        let h = f.hdu(*hdu).expect("HDU");
        for (key, value) in [("TARGTRA", 150.0f64), ("TARGTDEC", dec), ("MJD-OBS", mjd)] {
            h.write_key(&mut f, key, value).expect("write the pointing");
        }
    }
    input
}

/// `--barycentric-correction` of a preproc pointed as [`pointed_preproc`] says: fails with
/// status 1 and `needles`, writing nothing.
fn refused_pointing(dec: f64, mjd: f64, hdus: &[&str], needles: &[&str]) -> Outcome {
    let mut c = Case::new();
    let psf = c.copy(PSF, "psf.fits");
    let input = pointed_preproc(&c, dec, mjd, hdus);
    c.seal();
    let bary = args!["--barycentric-correction"];
    let o = extract(&input, &psf, &c.path("f.fits"), bary);
    expect(&o, 1, needles);
    c.unchanged_except(&[]);
    o
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

/// `bytes` as one gzip member (the system's `gzip`).
fn gzip_member(bytes: &[u8]) -> Vec<u8> {
    use std::io::Write;
    let mut child = Command::new("gzip")
        .arg("-c")
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .spawn()
        .expect("run gzip");
    let mut stdin = child.stdin.take().expect("stdin");
    let input = bytes.to_vec();
    let writer = std::thread::spawn(move || stdin.write_all(&input));
    let out = child.wait_with_output().expect("gzip output");
    writer.join().expect("writer").expect("write to gzip");
    assert!(out.status.success());
    out.stdout
}

// After the harness: the cases use its `args!` macro.
mod comparisons;
mod compressed;
mod data_loss;
mod files;
mod grids;
mod messages;
mod mpi;
mod regressions;
mod silent_results;
mod streams;
