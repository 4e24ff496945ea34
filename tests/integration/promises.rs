//! Promises of the README that no other module pins: the pulls of the reference cases
//! computed here from their truth files (made by a simulator that shares no code with spex),
//! `--barycentric-correction` applied to the extraction itself, `--psferr`'s default,
//! `--no-scores`, `--test` outside its limits, the default grid, the MASK bits
//! SOMEBADPIX and BAD2DFIT, and the pulls that `scripts/demo` promises.

use std::path::Path;

use crate::common::{self, data, path_str as s, run_spex};
use spex::compare::Truth;
use spex::fits::Fits;
use spex::frame::Frame;

fn spex(args: &[&str]) {
    let o = run_spex(args);
    assert!(
        o.status.success(),
        "spex {args:?}:\n{}",
        String::from_utf8_lossy(&o.stderr)
    );
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

/// Runs `spex` on bundle 0 of reference case 0 (`input` and `psf`), 6000-6200 A, with
/// `extra` options, and returns its exit status and stderr.
fn extract_bundle0(input: &Path, psf: &Path, out: &Path, extra: &[&str]) -> (Option<i32>, String) {
    let o = common::extract_bundle0(input, psf, out, extra);
    (
        o.status.code(),
        String::from_utf8_lossy(&o.stderr).into_owned(),
    )
}

/// `--psferr` defaults to the PSF's PSFERR (else 0.01), and `--no-scores` leaves out the
/// SCORES HDU that is otherwise written.
#[test]
fn psferr_defaults_to_the_psf_and_no_scores_drops_the_scores() {
    let dir = tempfile::tempdir().unwrap();
    let input = data("preproc-bundle0.fits");
    let (psf, with_psferr) = (data("psf-r0-00067784.fits"), dir.path().join("psf.fits"));
    std::fs::copy(&psf, &with_psferr).unwrap();
    let mut f = fitsio::FitsFile::edit(&with_psferr).unwrap();
    let hdu = f.hdu("PSF").unwrap();
    hdu.write_key(&mut f, "PSFERR", 0.05).unwrap();
    drop(f);
    let run = |name: &str, psf: &Path, extra: &[&str]| {
        let out = dir.path().join(name);
        let (code, stderr) = extract_bundle0(&input, psf, &out, extra);
        assert_eq!(code, Some(0), "{stderr}");
        out
    };
    let from_psf = run("a.fits", &with_psferr, &[]);
    let given = run("b.fits", &psf, &["--psferr", "0.05", "--no-scores"]);
    let default = run("c.fits", &psf, &[]);
    let chi2 = |p: &Path| Frame::read(p).unwrap().chi2pix;
    assert_eq!(chi2(&from_psf), chi2(&given), "PSFERR of the PSF not used");
    assert_ne!(chi2(&from_psf), chi2(&default), "psferr changes nothing");
    assert!(Fits::open(&from_psf).unwrap().has_hdu("SCORES"));
    assert!(!Fits::open(&given).unwrap().has_hdu("SCORES"));
}

/// `--test` with a reference outside the parity limits (one bin moved by a tenth of a sigma)
/// exits with status 3.
#[test]
fn test_outside_its_limits_exits_3() {
    let dir = tempfile::tempdir().unwrap();
    let (input, psf) = (data("preproc-bundle0.fits"), data("psf-r0-00067784.fits"));
    let good = dir.path().join("good.fits");
    let (code, stderr) = extract_bundle0(&input, &psf, &good, &[]);
    assert_eq!(code, Some(0), "{stderr}");
    let mut frame = Frame::read(&good).unwrap();
    frame.flux[[3, 100]] += 0.1 / frame.ivar[[3, 100]].sqrt();
    let moved = dir.path().join("moved.fits");
    frame.write(&moved, &Default::default()).unwrap();
    let out = dir.path().join("f.fits");
    let (code, stderr) = extract_bundle0(&input, &psf, &out, &["--test", s(&moved)]);
    assert_eq!(code, Some(3), "{stderr}");
    assert!(stderr.contains("max |df|/sigma"), "{stderr}");
    let (code, stderr) = extract_bundle0(&input, &psf, &out, &["--test", s(&good)]);
    assert_eq!(code, Some(0), "{stderr}");
}

/// Without `-w` the grid is the PSF's wavelength range at 0.8 A, numpy's
/// `arange(wmin, wmax + dw/2, dw)` (whose bits the `desispec` tests compare with numpy's).
#[test]
fn default_grid_is_the_psf_range() {
    let dir = tempfile::tempdir().unwrap();
    let (input, psf) = (data("preproc-bundle0.fits"), data("psf-r0-00067784.fits"));
    let out = dir.path().join("f.fits");
    spex(&[
        "-i",
        s(&input),
        "-p",
        s(&psf),
        "-o",
        s(&out),
        "-s",
        "0",
        "-n",
        "25",
        "--loglevel",
        "warning",
    ]);
    let (wmin, wmax) = spex::psf::GaussHermitePsf::read(&psf)
        .unwrap()
        .param_domain();
    let wave = Frame::read(&out).unwrap().wave;
    let n = ((wmax + 0.4 - wmin) / 0.8).ceil() as usize;
    assert_eq!((wave.len(), wave[0]), (n, wmin), "grid of {wmin}..{wmax}");
    // numpy steps by (wmin + dw) - wmin, which differs from dw by up to an ulp of wmin
    let ulp = wmax * f64::EPSILON;
    for (i, w) in wave.iter().enumerate() {
        let off = (w - (wmin + i as f64 * 0.8)).abs();
        assert!(off <= (i + 1) as f64 * ulp, "bin {i}: {w}");
    }
}

/// A copy of reference case 0, uncompressed, with `change` applied to its IMAGE, IVAR and
/// MASK (and the row length).
pub fn changed_image(path: &Path, change: impl Fn(&mut [f32], &mut [f32], &mut [i32], usize)) {
    let mut f = Fits::open(&data("preproc-bundle0.fits")).unwrap();
    let mut read = |hdu: &str| {
        f.move_to(hdu).unwrap();
        f.read_image::<f32>().unwrap()
    };
    let (shape, mut pix) = read("IMAGE");
    let (_, mut ivar) = read("IVAR");
    f.move_to("MASK").unwrap();
    let (_, mut mask) = f.read_image::<i32>().unwrap();
    change(&mut pix, &mut ivar, &mut mask, shape[1]);
    let mut out = Fits::create(path).unwrap();
    out.write_image::<f32>("IMAGE", &shape, &pix).unwrap();
    out.write_image::<f32>("IVAR", &shape, &ivar).unwrap();
    out.write_image::<i32>("MASK", &shape, &mask).unwrap();
    out.close().unwrap();
}

/// MASK as the README states it: BAD2DFIT exactly where chi2pix > 100 (a hot spot left
/// unmasked on fiber 12's trace), SOMEBADPIX where over half of a bin's pixels are masked
/// (the left half of fiber 5's trace and its centre, over 6100-6150 A), neither on a fiber
/// that neither touches.
#[test]
fn mask_bits_follow_chi2pix_and_masked_pixels() {
    use spex::frame::specmask::{ALLBADPIX, BAD2DFIT, SOMEBADPIX};
    let dir = tempfile::tempdir().unwrap();
    let psf_path = data("psf-r0-00067784.fits");
    let psf = spex::psf::GaussHermitePsf::read(&psf_path).unwrap();
    let input = dir.path().join("in.fits");
    let hot = psf.xy(12, 6050.0);
    let (lo, hi) = (psf.xy(5, 6100.0).1 as usize, psf.xy(5, 6150.0).1 as usize);
    changed_image(&input, |pix, ivar, _, ncols| {
        let (x, y) = (hot.0.round() as usize, hot.1.round() as usize);
        for i in [y * ncols + x, y * ncols + x + 1, (y + 1) * ncols + x] {
            pix[i] += 5e4;
        }
        for y in lo..hi {
            let xc = psf
                .xy(5, 6100.0 + 50.0 * (y - lo) as f64 / (hi - lo) as f64)
                .0;
            for x in xc.round() as usize - 6..=xc.round() as usize {
                ivar[y * ncols + x] = 0.0;
            }
        }
    });
    let out = dir.path().join("f.fits");
    let (code, stderr) = extract_bundle0(&input, &psf_path, &out, &[]);
    assert_eq!(code, Some(0), "{stderr}");
    let frame = Frame::read(&out).unwrap();
    let mut bad_fits = 0;
    for (i, &m) in frame.mask.indexed_iter() {
        let chi2 = frame.chi2pix[i];
        assert_eq!(m & BAD2DFIT != 0, chi2 > 100.0, "bin {i:?}: chi2pix {chi2}");
        bad_fits += (m & BAD2DFIT != 0) as usize;
    }
    assert!(bad_fits > 0, "the hot spot left no bin with chi2pix > 100");
    let bin = |w: f64| frame.wave.iter().position(|&x| x >= w).unwrap();
    for j in bin(6110.0)..bin(6140.0) {
        let m = frame.mask[[5, j]];
        assert_eq!(m & (SOMEBADPIX | ALLBADPIX), SOMEBADPIX, "fiber 5 bin {j}");
    }
    assert!(frame.mask.row(20).iter().all(|&m| m == 0), "fiber 20");
}

/// `scripts/demo`'s promise, with its commands: 50 fibers of the r camera simulated from
/// the bundled PSF (seed 1, 5760-7620 A), extracted, and compared with the truth give pull
/// mean ~0, std ~1 and median |pull| ~0.67. Over N unit normals the standard errors are
/// 1/sqrt(N) (mean), sqrt(1/(2N)) (std) and sqrt(1/(4N)) / (2 phi(0.6745)) (median of |z|,
/// 0.6745): each is held to 5 of them.
#[test]
fn demo_reaches_the_promised_pulls() {
    let dir = tempfile::tempdir().unwrap();
    let path = |n: &str| dir.path().join(n);
    let psf = data("psf-r0-00067784.fits");
    let (image, truth, frame) = (path("preproc.fits"), path("truth.fits"), path("frame.fits"));
    let wave = "5760,7620,0.8";
    spex(&[
        "simulate",
        "-p",
        s(&psf),
        "-o",
        s(&image),
        "--truth",
        s(&truth),
        "-w",
        wave,
        "-s",
        "0",
        "-n",
        "50",
        "--seed",
        "1",
        "--loglevel",
        "warning",
    ]);
    spex(&[
        "extract",
        "-i",
        s(&image),
        "-p",
        s(&psf),
        "-o",
        s(&frame),
        "-w",
        wave,
        "-s",
        "0",
        "-n",
        "50",
        "--loglevel",
        "warning",
    ]);
    let pulls = spex::compare::pulls(
        &Frame::read(&frame).unwrap(),
        &Truth::read(&truth, None).unwrap(),
    )
    .unwrap();
    let n = pulls.nbins as f64;
    assert!(n > 50.0 * 2300.0, "{} bins compared", pulls.nbins);
    let density = 2.0 * (-0.6745f64.powi(2) / 2.0).exp() / (2.0 * std::f64::consts::PI).sqrt();
    let limits = [
        ("mean", pulls.mean, 0.0, 1.0 / n.sqrt()),
        ("std", pulls.std, 1.0, (0.5 / n).sqrt()),
        (
            "median |pull|",
            pulls.median_abs,
            0.6745,
            (0.25 / n).sqrt() / density,
        ),
    ];
    for (name, got, want, error) in limits {
        assert!(
            (got - want).abs() < 5.0 * error,
            "{name} {got} (want {want} within {})",
            5.0 * error
        );
    }
}
