//! desispec as the client of spex (issue 11): Python checks under tests/desispec/ run in the
//! pinned venv that scripts/desispec-env builds, against files and values spex makes here.
//!
//! The venv is built (or found) once per run; when it cannot be, every test fails with the
//! script's one-line reason. DESIMODEL points to an empty directory so that nothing here can
//! depend on desimodel's data.
//!
//! The tests of the integrated command line (desi_proc's job lines, simulated preproc files
//! read by desispec) are at the end, ignored until that command line exists.

use std::ffi::OsStr;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::OnceLock;

use spex::barycentric;
use spex::fits::Fits;
use spex::frame::Frame;
use spex::scores;

fn repo() -> &'static Path {
    Path::new(env!("CARGO_MANIFEST_DIR"))
}

fn data(name: &str) -> PathBuf {
    repo().join("tests/data").join(name)
}

/// A directory of this test binary's files, emptied once per run.
fn workdir() -> &'static Path {
    static DIR: OnceLock<PathBuf> = OnceLock::new();
    DIR.get_or_init(|| {
        let dir = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join("desispec-client");
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).expect("test work directory");
        dir
    })
}

struct Client {
    python: PathBuf,
    desimodel: PathBuf,
}

/// The venv's python (built by scripts/desispec-env on first use) and the empty DESIMODEL.
fn client() -> &'static Client {
    static CLIENT: OnceLock<Client> = OnceLock::new();
    CLIENT.get_or_init(|| {
        let script = repo().join("scripts/desispec-env");
        let out = Command::new(&script)
            .output()
            .unwrap_or_else(|e| panic!("cannot run {}: {e}", script.display()));
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(
            out.status.success(),
            "the desispec venv could not be built, so desispec cannot check spex's files: {}",
            stderr
                .lines()
                .rfind(|l| l.starts_with("desispec-env:"))
                .unwrap_or(&stderr)
        );
        let stdout = String::from_utf8_lossy(&out.stdout);
        let python = PathBuf::from(stdout.lines().last().unwrap_or_default().trim());
        assert!(
            python.is_file(),
            "scripts/desispec-env printed no python: {stdout}"
        );
        let desimodel = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join("desimodel-empty");
        std::fs::create_dir_all(&desimodel).expect("empty DESIMODEL directory");
        Client { python, desimodel }
    })
}

/// Runs tests/desispec/SCRIPT in the venv; panics with its output unless it exits 0.
fn python(script: &str, args: &[&OsStr]) -> String {
    let c = client();
    let out = Command::new(&c.python)
        .arg(repo().join("tests/desispec").join(script))
        .args(args)
        .env("DESIMODEL", &c.desimodel)
        .env("PYTHONDONTWRITEBYTECODE", "1")
        .env("PYTHONNOUSERSITE", "1")
        .env_remove("PYTHONPATH")
        .output()
        .unwrap_or_else(|e| panic!("cannot run {}: {e}", c.python.display()));
    let (stdout, stderr) = (
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr),
    );
    assert!(
        out.status.success(),
        "tests/desispec/{script} failed:\n{stdout}\n{stderr}"
    );
    println!("{stdout}");
    stdout
}

/// Runs the spex binary; panics with its output unless it exits 0.
fn spex(args: &[&OsStr]) {
    let out = Command::new(env!("CARGO_BIN_EXE_spex"))
        .args(args)
        .output()
        .expect("run spex");
    assert!(
        out.status.success(),
        "spex {args:?} failed:\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
}

fn card(key: &str, value: f64) -> String {
    format!("{key:<8}= {value:>20?} / test value")
}

/// 24 pointings over a year, each written with one of the keyword sets desispec accepts
/// (with decoys of lower precedence) so that the choice of keyword is compared too.
fn barycentric_cases() -> Vec<Vec<String>> {
    (0..24)
        .map(|i| {
            let x = i as f64;
            let ra = (x * 137.507_764) % 360.0;
            let dec = -30.0 + (x * 47.3) % 110.0;
            let mjd = 60_676.0 + 365.0 * x / 24.0 + 0.11 + 0.09 * (i % 5) as f64;
            let exptime = 300.0 + 60.0 * (i % 7) as f64;
            match i % 4 {
                0 => vec![
                    card("RA", ra + 1.0),
                    card("TARGTRA", ra),
                    card("DEC", dec - 1.0),
                    card("TARGTDEC", dec),
                    card("MJD", mjd + 0.5),
                    card("MJD-OBS", mjd),
                    card("EXPTIME", exptime),
                ],
                1 => vec![
                    card("TELRA", ra + 0.2),
                    card("SKYRA", ra),
                    card("TELDEC", dec + 0.2),
                    card("SKYDEC", dec),
                    card("MJD-OBS", mjd),
                    card("EXPTIME", exptime),
                ],
                2 => vec![
                    card("TELRA", ra),
                    card("TELDEC", dec),
                    card("MJD", mjd),
                    card("EXPTIME", exptime),
                ],
                _ => vec![card("RA", ra), card("DEC", dec), card("MJD-OBS", mjd)],
            }
        })
        .collect()
}

#[test]
fn barycentric_factor_matches_desispec_over_a_year() {
    let cases = barycentric_cases();
    let path = workdir().join("barycentric-cases.txt");
    let text: String = cases
        .iter()
        .map(|cards| format!("{}\nEND\n", cards.join("\n")))
        .collect();
    std::fs::write(&path, text).unwrap();
    let out = python("barycentric.py", &[path.as_os_str()]);
    let desispec: Vec<f64> = out
        .lines()
        .filter_map(|l| l.strip_prefix("factor "))
        .map(|v| v.parse().expect("a factor"))
        .collect();
    assert_eq!(desispec.len(), cases.len(), "one factor per case");
    let mut worst = 0.0f64;
    for (i, (cards, want)) in cases.iter().zip(&desispec).enumerate() {
        let got = barycentric::factor_from_header(cards, Path::new("case")).unwrap();
        let rel = (got / want - 1.0).abs();
        assert!(
            rel < 1e-9,
            "case {i} {cards:?}: spex {got:.15}, desispec {want:.15}"
        );
        worst = worst.max(rel);
    }
    // The velocities span the Earth's orbit: the cases are not all alike.
    let spread = desispec.iter().cloned().fold(f64::MIN, f64::max)
        - desispec.iter().cloned().fold(f64::MAX, f64::min);
    assert!(spread > 1e-4, "factors span only {spread:e}");
    println!(
        "barycentric factor: {} cases, largest relative difference from desispec {worst:.2e}",
        cases.len()
    );
}

/// A simulated r-camera preproc image of 25 fibers over desi_proc's r range.
fn simulated_preproc() -> &'static Path {
    static PREPROC: OnceLock<PathBuf> = OnceLock::new();
    PREPROC.get_or_init(|| {
        let (path, truth) = (
            workdir().join("preproc-r0-sim.fits"),
            workdir().join("truth-r0-sim.fits"),
        );
        let psf = data("psf-r0-00067784.fits");
        let args: [&OsStr; 11] = [
            "simulate".as_ref(),
            "-p".as_ref(),
            psf.as_os_str(),
            "-o".as_ref(),
            path.as_os_str(),
            "--truth".as_ref(),
            truth.as_os_str(),
            "-w".as_ref(),
            "5760.0,7620.0,0.8".as_ref(),
            "-n".as_ref(),
            "25".as_ref(),
        ];
        spex(&args);
        path
    })
}

/// A spex frame of 25 simulated fibers over desi_proc's r range (so that the r top-hat, with
/// signal everywhere, lies inside), with a SCORES HDU: the one spex wrote, or else the one
/// computed here from the frame as read back from the file.
fn spex_frame_with_scores() -> &'static Path {
    static FRAME: OnceLock<PathBuf> = OnceLock::new();
    FRAME.get_or_init(|| {
        let path = workdir().join("frame-r0.fits");
        let (input, psf) = (simulated_preproc(), data("psf-r0-00067784.fits"));
        let args: [&OsStr; 10] = [
            "-i".as_ref(),
            input.as_os_str(),
            "-p".as_ref(),
            psf.as_os_str(),
            "-o".as_ref(),
            path.as_os_str(),
            "-w".as_ref(),
            "5760.0,7620.0,0.8".as_ref(),
            "-n".as_ref(),
            "25".as_ref(),
        ];
        spex(&args);
        if !Fits::open(&path).unwrap().has_hdu("SCORES") {
            let frame = Frame::read(&path).unwrap();
            let s = scores::raw_scores(&frame).unwrap();
            let mut fits = Fits::open_rw(&path).unwrap();
            scores::append_scores_hdu(&mut fits, &s).unwrap();
            fits.close().unwrap();
        }
        path
    })
}

#[test]
fn desispec_reads_a_spex_frame_and_its_scores_match() {
    let path = spex_frame_with_scores();
    let out = python("frame_scores.py", &[path.as_os_str()]);
    assert!(out.contains("MEDIAN_RAW_SNR_R"), "{out}");
}

// The integrated command line of issue 11: these run `spex simulate` and desi_proc's job
// lines and wait for the options and the file contents that the integration brings
// (--barycentric-correction, --no-scores, SCORES written by the frame writer, CHECKSUM,
// gzip, uint32 MASK, a simulated preproc with FLAVOR, TILEID, read noise per amplifier,
// pointing keywords and a FIBERMAP with desispec's columns).

/// desi_proc's extraction line with the program name replaced (`--nspec 25` added to keep
/// the test short), writing `name` in the work directory.
fn job_line(name: &str, extra: &[&str]) -> PathBuf {
    let (preproc, psf) = (simulated_preproc(), data("psf-r0-00067784.fits"));
    let out = workdir().join(name);
    let mut args: Vec<&OsStr> = vec![
        "-w".as_ref(),
        "5760.0,7620.0,0.8".as_ref(),
        "-i".as_ref(),
        preproc.as_os_str(),
        "-p".as_ref(),
        psf.as_os_str(),
        "-o".as_ref(),
        out.as_os_str(),
        "--psferr".as_ref(),
        "0.01".as_ref(),
        "--nspec".as_ref(),
        "25".as_ref(),
    ];
    args.extend(extra.iter().map(|a| OsStr::new(*a)));
    spex(&args);
    out
}

#[test]
#[ignore = "needs the integrated command line of issue 11"]
fn desispec_reads_spex_simulated_preproc() {
    let preproc = simulated_preproc();
    python("pipeline.py", &["read-image".as_ref(), preproc.as_os_str()]);
}

#[test]
#[ignore = "needs the integrated command line of issue 11"]
fn desi_proc_job_lines_through_spex_write_desispec_frames() {
    let preproc = simulated_preproc();
    // science and sky lines carry --barycentric-correction, the flat line does not; each
    // with and without --no-gpu (the GPU is used when one is usable)
    let lines: [(&str, &[&str], bool); 4] = [
        (
            "frame-r0-science.fits.gz",
            &["--no-gpu", "--barycentric-correction"],
            true,
        ),
        ("frame-r0-sky.fits.gz", &["--barycentric-correction"], true),
        ("frame-r0-flat-cpu.fits.gz", &["--no-gpu"], false),
        ("frame-r0-flat.fits.gz", &[], false),
    ];
    for (name, extra, barycentric) in lines {
        let frame = job_line(name, extra);
        let mut args: Vec<&OsStr> = vec![
            "job-line".as_ref(),
            frame.as_os_str(),
            preproc.as_os_str(),
            "5760.0,7620.0,0.8".as_ref(),
        ];
        if barycentric {
            args.push("--barycentric".as_ref());
        }
        python("pipeline.py", &args);
    }
}

#[test]
#[ignore = "needs the integrated command line of issue 11"]
fn frames2spectra_combines_a_spex_frame_with_a_desispec_frame() {
    let frame = job_line("frame-r0-for-spectra.fits", &["--barycentric-correction"]);
    let dir = workdir().join("frames2spectra");
    std::fs::create_dir_all(&dir).unwrap();
    python("frames2spectra.py", &[frame.as_os_str(), dir.as_os_str()]);
}
