//! Promises of the README that no other module pins: the pulls of the reference cases
//! computed here from their truth files (made by a simulator that shares no code with spex),
//! and `--barycentric-correction` applied to the extraction itself.

use std::path::Path;
use std::process::Command;

use crate::common::data;
use spex::compare::Truth;
use spex::fits::Fits;
use spex::frame::Frame;

fn spex(args: &[&str]) {
    let o = Command::new(env!("CARGO_BIN_EXE_spex"))
        .args(args)
        .env_remove("SPEX_LOG")
        .output()
        .expect("spex runs");
    assert!(
        o.status.success(),
        "spex {args:?}:\n{}",
        String::from_utf8_lossy(&o.stderr)
    );
}

fn s(p: &Path) -> &str {
    p.to_str().unwrap()
}

/// Pulls of `frame` against `truth`: (flux dw - R t) sqrt(ivar) / dw for every bin whose row
/// of R lies inside the grid (all but `ndiag` bins at each end, whose rows reach columns the
/// frame does not hold), where R t is the truth convolved with the frame's resolution in
/// desispec's convention (diagonal k holds offset ndiag - k, indexed by column).
fn pulls(frame: &Frame, truth: &Truth) -> Vec<f64> {
    let dw = frame.wave[1] - frame.wave[0];
    let first = truth
        .wave
        .iter()
        .position(|w| (w - frame.wave[0]).abs() < 1e-6 * dw)
        .expect("the truth's grid holds the frame's");
    let nd = frame.ndiag as isize;
    let mut out = Vec::new();
    for f in 0..frame.nspec {
        let row = frame.specmin + f - truth.fibermin;
        for i in frame.ndiag..frame.nwave() - frame.ndiag {
            let mut rt = 0.0;
            for k in 0..2 * nd + 1 {
                let j = i as isize + nd - k;
                let t = truth.flux[[row, first + j as usize]];
                rt += frame.resolution[[f, k as usize, j as usize]] * t;
            }
            let ivar = frame.ivar[[f, i]];
            out.push((frame.flux[[f, i]] * dw - rt) * ivar.sqrt() / dw);
        }
    }
    out
}

/// The README: spex reaches the reference's pulls against the simulation truth (mean 0,
/// std 1). For N independent unit normals the mean's standard error is 1/sqrt(N) and the
/// standard deviation's sqrt(1/(2N)): both are held to 5 of those; and no |pull| exceeds 5,
/// which N = 12275 normals reach with probability 0.7%.
#[test]
fn pulls_of_the_reference_cases_against_their_truth() {
    let dir = tempfile::tempdir().unwrap();
    for (case, psf, w, specmin, fibermin) in [
        (0, "psf-r0-00067784.fits", "6000,6400,0.8", "0", 0),
        (1, "psf-r0-00051060.fits", "7000,7400,0.8", "25", 20),
    ] {
        let out = dir.path().join(format!("frame{case}.fits"));
        let input = data(&format!("preproc-bundle{case}.fits"));
        let psf = data(psf);
        spex(&[
            "-i",
            s(&input),
            "-p",
            s(&psf),
            "-o",
            s(&out),
            "-w",
            w,
            "-s",
            specmin,
            "-n",
            "25",
            "--loglevel",
            "warning",
        ]);
        let frame = Frame::read(&out).unwrap();
        let truth = Truth::read(&data(&format!("truth-bundle{case}.fits")), Some(fibermin));
        let p = pulls(&frame, &truth.unwrap());
        let n = p.len() as f64;
        assert_eq!(p.len(), 25 * (501 - 2 * frame.ndiag));
        let mean = p.iter().sum::<f64>() / n;
        let std = (p.iter().map(|x| (x - mean).powi(2)).sum::<f64>() / n).sqrt();
        let worst = p.iter().fold(0.0f64, |m, x| m.max(x.abs()));
        assert!(mean.abs() < 5.0 / n.sqrt(), "case {case}: mean pull {mean}");
        assert!(
            (std - 1.0).abs() < 5.0 * (0.5 / n).sqrt(),
            "case {case}: std of pulls {std}"
        );
        assert!(worst < 5.0, "case {case}: |pull| {worst}");
    }
}

/// A copy of reference case 0 with a pointing and a date in its IMAGE header.
fn image_with_pointing(path: &Path) {
    std::fs::copy(data("preproc-bundle0.fits"), path).unwrap();
    let mut f = fitsio::FitsFile::edit(path).expect("open the copy");
    let hdu = f.hdu("IMAGE").expect("IMAGE");
    hdu.write_key(&mut f, "TARGTRA", 150.0).unwrap();
    hdu.write_key(&mut f, "TARGTDEC", 20.0).unwrap();
    hdu.write_key(&mut f, "MJD-OBS", 59197.3).unwrap();
}

/// `--barycentric-correction` extracts on the requested grid divided by the exposure's
/// factor and writes the requested grid: its flux is that of an extraction asked for on the
/// divided grid, and not that of an extraction on the requested grid (the factor, ~1e-4 from
/// 1, moves the grid by about a bin at 6000 A).
#[test]
fn barycentric_correction_extracts_on_the_divided_grid() {
    let dir = tempfile::tempdir().unwrap();
    let input = dir.path().join("in.fits");
    image_with_pointing(&input);
    let psf = data("psf-r0-00067784.fits");
    let run = |name: &str, grid: &str, extra: &[&str]| {
        let out = dir.path().join(name);
        let mut args = vec!["-i", s(&input), "-p", s(&psf), "-o", s(&out)];
        args.extend(["-w", grid, "-s", "0", "-n", "25", "--loglevel", "warning"]);
        args.extend(extra);
        spex(&args);
        out
    };
    let corrected = run(
        "corrected.fits",
        "6000,6400,0.8",
        &["--barycentric-correction"],
    );
    let mut f = Fits::open(&corrected).unwrap();
    f.move_to("FLUX").unwrap();
    let h = f.key_f64("HELIOCOR").unwrap().expect("HELIOCOR written");
    assert!((h - 1.0).abs() > 1e-5, "a factor of {h} tests nothing");
    let divided = format!("{},{},{}", 6000.0 / h, 6400.0 / h, 0.8 / h);
    let on_divided = run("divided.fits", &divided, &[]);
    let plain = run("plain.fits", "6000,6400,0.8", &[]);
    let (a, b, c) = (
        Frame::read(&corrected).unwrap(),
        Frame::read(&on_divided).unwrap(),
        Frame::read(&plain).unwrap(),
    );
    assert_eq!(a.wave, c.wave, "the requested grid is written");
    // in units of the flux's error, the worst bin
    let sigma = |x: &Frame, y: &Frame| {
        let mut worst = 0.0f64;
        for ((i, &fx), &iv) in x.flux.indexed_iter().zip(&x.ivar) {
            worst = worst.max((fx - y.flux[i]).abs() * iv.sqrt());
        }
        worst
    };
    // the same solves; only HELIOCOR's printed digits may round the divided grid
    let same = sigma(&a, &b);
    assert!(same < 1e-6, "corrected vs divided grid: {same:e} sigma");
    let moved = sigma(&a, &c);
    assert!(
        moved > 1.0,
        "the correction moved no bin by a sigma ({moved:e})"
    );
}
