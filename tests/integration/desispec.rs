//! desispec as the client of spex (issue 11): Python checks under tests/desispec/ run in the
//! pinned venv that scripts/desispec-env builds, against files and values spex makes here.
//!
//! The venv is built (or found) once per run; when it cannot be, every test fails with the
//! script's one-line reason. DESIMODEL points to an empty directory so that nothing here can
//! depend on desimodel's data.
//!
//! desi_proc's job lines run for the b, r and z ranges: the b and z PSFs are the bundled r
//! PSF with its wavelength domain moved (see `camera_psf`).

use std::ffi::OsStr;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::OnceLock;

use spex::barycentric;
use spex::fits::Fits;

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

/// `n` pointings spread over `days` days from `first_mjd`, each written with one of the
/// keyword sets desispec accepts (with decoys of lower precedence) so that the choice of
/// keyword is compared too.
fn barycentric_cases(first_mjd: f64, days: f64, n: usize) -> Vec<Vec<String>> {
    (0..n)
        .map(|i| {
            let x = i as f64;
            let ra = (x * 137.507_764) % 360.0;
            let dec = -30.0 + (x * 47.3) % 110.0;
            let mjd = first_mjd + days * x / n as f64 + 0.11 + 0.09 * (i % 5) as f64;
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

/// desispec's factor for each case (tests/desispec/barycentric.py), and spex's.
fn barycentric_factors(cases: &[Vec<String>], name: &str) -> Vec<(f64, f64)> {
    let path = workdir().join(format!("barycentric-{name}.txt"));
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
    cases
        .iter()
        .zip(desispec)
        .map(|(cards, want)| {
            let got = barycentric::factor_from_header(cards, Path::new("case")).unwrap();
            (got, want)
        })
        .collect()
}

/// Inside spex's IERS table (2019 to its last prediction) the factor is desispec's to the
/// bit: over 2025 (final Earth orientation values), over the table's predictions (2026-10 on)
/// and after its end, where spex falls back as astropy does after its own.
#[test]
fn barycentric_factor_is_desispec_to_the_bit() {
    let mut cases = barycentric_cases(60_676.0, 365.0, 24);
    cases.extend(barycentric_cases(61_340.0, 360.0, 8));
    cases.extend(barycentric_cases(61_710.0, 700.0, 4));
    let factors = barycentric_factors(&cases, "bits");
    for (i, (cards, (got, want))) in cases.iter().zip(&factors).enumerate() {
        assert_eq!(
            got.to_bits(),
            want.to_bits(),
            "case {i} {cards:?}: spex {got:?}, desispec {want:?}"
        );
    }
    // The velocities span the Earth's orbit: the cases are not all alike.
    let wants = factors.iter().map(|f| f.1);
    let spread = wants.clone().fold(f64::MIN, f64::max) - wants.fold(f64::MAX, f64::min);
    assert!(spread > 1e-4, "factors span only {spread:e}");
    println!(
        "barycentric factor: {} cases, all desispec's to the bit",
        cases.len()
    );
}

/// Before spex's IERS table (2019-01-01) UT1-UTC is the table's first value, not the date's:
/// |UT1-UTC| < 0.9 s turns the site's rotation velocity (394 m/s at Kitt Peak) by at most
/// 0.9 s x 7.29e-5 rad/s = 6.6e-5 rad, 0.026 m/s or 8.7e-11 in the factor.
#[test]
fn barycentric_factor_before_the_iers_table_is_within_its_bound() {
    let cases = barycentric_cases(57_000.0, 1_400.0, 8);
    let factors = barycentric_factors(&cases, "before");
    let worst = factors
        .iter()
        .map(|(got, want)| (got / want - 1.0).abs())
        .fold(0.0, f64::max);
    assert!(worst < 1e-10, "largest relative difference {worst:.2e}");
    println!("barycentric factor before 2019: largest relative difference {worst:.2e}");
}

/// desi_proc's cameras: the name, the wavelength grid of its extraction line and its psferr.
const CAMERAS: [(&str, &str, &str); 3] = [
    ("b0", "3600.0,5800.0,0.8", "0.04"),
    ("r0", "5760.0,7620.0,0.8", "0.01"),
    ("z0", "7520.0,9824.0,0.8", "0.01"),
];

/// A PSF for `camera`: the bundled r-camera PSF for r0, otherwise the same PSF with its
/// wavelength domain moved to cover that camera's range (its traces are Legendre series on
/// the domain, so they land on the same CCD pixels) and CAMERA set, so that the b and z job
/// lines run on a real PSF's spots.
fn camera_psf(camera: &str) -> PathBuf {
    let r = data("psf-r0-00067784.fits");
    let domain = match camera {
        "r0" => return r,
        "b0" => (3500.0, 5900.0),
        _ => (7450.0, 9900.0),
    };
    let path = workdir().join(format!("psf-{camera}-synthetic.fits"));
    std::fs::copy(&r, &path).unwrap();
    let mut fits = Fits::open_rw(&path).unwrap();
    for hdu in ["PSF", "XTRACE", "YTRACE"] {
        fits.move_to(hdu).unwrap();
        fits.write_key_f64_exact("WAVEMIN", domain.0, "").unwrap();
        fits.write_key_f64_exact("WAVEMAX", domain.1, "").unwrap();
    }
    fits.move_to("PSF").unwrap();
    fits.write_key_str("CAMERA", camera, "").unwrap();
    fits.close().unwrap();
    path
}

/// A simulated preproc image of 25 fibers over desi_proc's range for `camera`, and its PSF.
fn simulated_preproc(camera: &str) -> (PathBuf, PathBuf) {
    static PREPROCS: OnceLock<Vec<(PathBuf, PathBuf)>> = OnceLock::new();
    let all = PREPROCS.get_or_init(|| {
        CAMERAS
            .iter()
            .map(|&(camera, grid, _)| {
                let psf = camera_psf(camera);
                let path = workdir().join(format!("preproc-{camera}-sim.fits"));
                let truth = workdir().join(format!("truth-{camera}-sim.fits"));
                let args: [&OsStr; 11] = [
                    "simulate".as_ref(),
                    "-p".as_ref(),
                    psf.as_os_str(),
                    "-o".as_ref(),
                    path.as_os_str(),
                    "--truth".as_ref(),
                    truth.as_os_str(),
                    "-w".as_ref(),
                    grid.as_ref(),
                    "-n".as_ref(),
                    "25".as_ref(),
                ];
                spex(&args);
                (path, psf)
            })
            .collect()
    });
    let k = CAMERAS.iter().position(|c| c.0 == camera).unwrap();
    all[k].clone()
}

/// A spex frame of 25 simulated fibers over desi_proc's r range (so that the r top-hat, with
/// signal everywhere, lies inside); spex writes its SCORES HDU.
fn spex_frame_with_scores() -> &'static Path {
    static FRAME: OnceLock<PathBuf> = OnceLock::new();
    FRAME.get_or_init(|| {
        let path = workdir().join("frame-r0.fits");
        let (input, psf) = simulated_preproc("r0");
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
        assert!(
            Fits::open(&path).unwrap().has_hdu("SCORES"),
            "{}: no SCORES HDU",
            path.display()
        );
        path
    })
}

#[test]
fn desispec_reads_a_spex_frame_and_its_scores_match() {
    let path = spex_frame_with_scores();
    let out = python("frame_scores.py", &[path.as_os_str()]);
    assert!(out.contains("MEDIAN_RAW_SNR_R"), "{out}");
}

/// desi_proc's extraction line for `camera` with the program name replaced (`--nspec 25`
/// added to keep the test short), writing `name` in the work directory.
fn job_line(camera: &str, name: &str, extra: &[&str]) -> PathBuf {
    let (preproc, psf) = simulated_preproc(camera);
    let &(_, grid, psferr) = CAMERAS.iter().find(|c| c.0 == camera).unwrap();
    let out = workdir().join(name);
    let mut args: Vec<&OsStr> = vec![
        "-w".as_ref(),
        grid.as_ref(),
        "-i".as_ref(),
        preproc.as_os_str(),
        "-p".as_ref(),
        psf.as_os_str(),
        "-o".as_ref(),
        out.as_os_str(),
        "--psferr".as_ref(),
        psferr.as_ref(),
        "--nspec".as_ref(),
        "25".as_ref(),
    ];
    args.extend(extra.iter().map(|a| OsStr::new(*a)));
    spex(&args);
    out
}

#[test]
fn desispec_reads_spex_simulated_preproc() {
    for (camera, _, _) in CAMERAS {
        let (preproc, _) = simulated_preproc(camera);
        python("pipeline.py", &["read-image".as_ref(), preproc.as_os_str()]);
    }
}

/// desi_proc's science and sky lines carry --barycentric-correction, its flat line does not;
/// each runs with and without --no-gpu (without it a usable GPU is used), for the b, r and z
/// ranges, and desispec must take every frame for its own.
#[test]
fn desi_proc_job_lines_through_spex_write_desispec_frames() {
    let lines: [(&str, bool); 3] = [("science", true), ("sky", true), ("flat", false)];
    for (camera, grid, _) in CAMERAS {
        let (preproc, _) = simulated_preproc(camera);
        for (kind, barycentric) in lines {
            for gpu in ["cpu", "any"] {
                let mut extra = Vec::new();
                if gpu == "cpu" {
                    extra.push("--no-gpu");
                }
                if barycentric {
                    extra.push("--barycentric-correction");
                }
                let name = format!("frame-{camera}-{kind}-{gpu}.fits.gz");
                let frame = job_line(camera, &name, &extra);
                let mut args: Vec<&OsStr> = vec![
                    "job-line".as_ref(),
                    frame.as_os_str(),
                    preproc.as_os_str(),
                    grid.as_ref(),
                ];
                if barycentric {
                    args.push("--barycentric".as_ref());
                }
                python("pipeline.py", &args);
            }
        }
    }
}

/// A .fits.gz frame (deflated by chunks, several for 25 fibers) is one gzip member that
/// astropy and cfitsio (through fitsio) both read as the plain frame.
#[test]
fn astropy_and_fitsio_read_a_spex_fits_gz_frame_whole() {
    let gz = job_line("r0", "frame-r0-readers.fits.gz", &["--no-gpu"]);
    let plain = job_line("r0", "frame-r0-readers.fits", &["--no-gpu"]);
    assert!(
        std::fs::metadata(&plain).unwrap().len() > 2 << 20,
        "the frame spans several 1 MiB chunks"
    );
    let out = python("gzip_readers.py", &[gz.as_os_str(), plain.as_os_str()]);
    assert!(out.contains("astropy and fitsio read"), "{out}");
}

#[test]
fn frames2spectra_combines_a_spex_frame_with_a_desispec_frame() {
    let frame = job_line(
        "r0",
        "frame-r0-for-spectra.fits",
        &["--barycentric-correction"],
    );
    let dir = workdir().join("frames2spectra");
    std::fs::create_dir_all(&dir).unwrap();
    python("frames2spectra.py", &[frame.as_os_str(), dir.as_os_str()]);
}
