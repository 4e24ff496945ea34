//! desispec downstream of spex: desispec's own steps after extraction (the bad-column mask,
//! fiberflat, sky, sframe, frames2spectra and coadd) run in the pinned venv
//! (scripts/desispec-env) on spex's frames of simulated exposures, each result checked
//! against the simulation's truth by tests/desispec/downstream.py.
//!
//! The exposures share one seed, so the flat and the science exposures share their fibers'
//! throughputs: a flat lamp, a science exposure with 30% sky fibers and a bad column, and the
//! same science exposure with amplifiers B and D masked, whose fibers past the amplifier
//! boundary (column 2057 of the bundled PSF) have no usable pixel. 50 fibers (225..274, the
//! two bundles about the boundary) over 1000 A of the r band keep the whole run to tens of
//! seconds.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::OnceLock;

use crate::common::{data, path_str, run_spex};

const GRID: &str = "6200.0,7200.0,0.8";
const SPECMIN: &str = "225";
const NSPEC: &str = "50";
const SEED: &str = "7";
/// A CCD column that the trace of a fiber of bundle 9 crosses.
const BAD_COLUMN: &str = "1900";

fn repo() -> &'static Path {
    Path::new(env!("CARGO_MANIFEST_DIR"))
}

/// This module's work directory, emptied once per run.
fn workdir() -> &'static Path {
    static DIR: OnceLock<PathBuf> = OnceLock::new();
    DIR.get_or_init(|| {
        let dir = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join("desispec-downstream");
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).expect("test work directory");
        dir
    })
}

/// The venv's python, built by scripts/desispec-env on first use; panics with the script's
/// one-line reason when it cannot be built.
fn venv_python() -> &'static Path {
    static PYTHON: OnceLock<PathBuf> = OnceLock::new();
    PYTHON.get_or_init(|| {
        let out = Command::new(repo().join("scripts/desispec-env"))
            .output()
            .expect("scripts/desispec-env runs");
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(
            out.status.success(),
            "the desispec venv could not be built: {}",
            stderr
                .lines()
                .rfind(|l| l.starts_with("desispec-env:"))
                .unwrap_or(&stderr)
        );
        let stdout = String::from_utf8_lossy(&out.stdout);
        PathBuf::from(stdout.lines().last().unwrap_or_default().trim())
    })
}

/// Runs tests/desispec/downstream.py with `args` in the venv, with an empty DESIMODEL (no
/// check may depend on desimodel's data); panics with its output unless it exits 0.
fn downstream(args: &[&str]) -> String {
    let desimodel = workdir().join("desimodel-empty");
    std::fs::create_dir_all(&desimodel).expect("empty DESIMODEL directory");
    let out = Command::new(venv_python())
        .arg(repo().join("tests/desispec/downstream.py"))
        .args(args)
        .env("DESIMODEL", &desimodel)
        .env("PYTHONDONTWRITEBYTECODE", "1")
        .env("PYTHONNOUSERSITE", "1")
        .env_remove("PYTHONPATH")
        .output()
        .expect("the venv's python runs");
    let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
    assert!(
        out.status.success(),
        "tests/desispec/downstream.py {args:?} failed:\n{stdout}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    println!("{stdout}");
    stdout
}

fn spex(args: &[&str]) {
    let out = run_spex(args);
    assert!(
        out.status.success(),
        "spex {args:?} failed:\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
}

/// Simulates exposure `name` with `extra` options and extracts it as desi_proc's r line
/// does (without the barycentric correction, so that the frame's grid is the truth's): writes
/// preproc-NAME, truth-NAME and frame-NAME in the work directory.
fn exposure(name: &str, extra: &[&str]) {
    let psf = data("psf-r0-00067784.fits");
    let dir = workdir();
    let file = |kind: &str| dir.join(format!("{kind}-{name}.fits"));
    let (preproc, truth, frame) = (file("preproc"), file("truth"), file("frame"));
    let mut args = vec![
        "simulate",
        "-p",
        path_str(&psf),
        "-o",
        path_str(&preproc),
        "--truth",
        path_str(&truth),
        "-w",
        GRID,
        "-s",
        SPECMIN,
        "-n",
        NSPEC,
        "--seed",
        SEED,
    ];
    args.extend(extra);
    spex(&args);
    spex(&[
        "-w",
        GRID,
        "-i",
        path_str(&preproc),
        "-p",
        path_str(&psf),
        "-o",
        path_str(&frame),
        "--psferr",
        "0.01",
        "-s",
        SPECMIN,
        "-n",
        NSPEC,
    ]);
}

/// The three exposures, simulated and extracted once per run.
fn exposures() -> &'static Path {
    static DONE: OnceLock<()> = OnceLock::new();
    DONE.get_or_init(|| {
        let science = ["--sky-fraction", "0.3", "--bad-column", BAD_COLUMN];
        exposure("flat", &["--flat"]);
        exposure("science", &science);
        let mut masked = science.to_vec();
        masked.extend(["--masked-amps", "B,D", "--expid", "2"]);
        exposure("masked", &masked);
    });
    workdir()
}

#[test]
fn badcolumn_mask_flags_the_fibers_that_cross_the_simulated_bad_column() {
    let dir = exposures();
    let psf = data("psf-r0-00067784.fits");
    let out = dir.join("frame-science-badcolumn.fits");
    let stdout = downstream(&[
        "badcolumn",
        path_str(&dir.join("frame-science.fits")),
        path_str(&psf),
        BAD_COLUMN,
        path_str(&out),
    ]);
    assert!(stdout.contains("badcolumn:"), "{stdout}");
}

#[test]
fn fiberflat_sky_sframe_and_coadd_of_spex_frames_match_the_simulation() {
    let dir = exposures();
    let stdout = downstream(&["chain", path_str(dir)]);
    for step in [
        "fiberflat:",
        "sky model:",
        "sframe targets:",
        "sframe ivar with/without",
        "coadd:",
    ] {
        assert!(stdout.contains(step), "no {step} line:\n{stdout}");
    }
}
