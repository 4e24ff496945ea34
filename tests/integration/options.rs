//! The extraction options end to end, as the README's table states them: the patch layout
//! and padding options change the answer below the noise, `--regularize` changes it,
//! `--mask-bits` chooses which MASK bits reject a pixel, `--skip-existing` leaves existing
//! outputs alone, outputs that would replace an input are refused, and SIGTERM ends a
//! `--list` run without leftovers.

use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};
use std::time::{Duration, Instant};

use crate::common::{data, extract_bundle0, path_str as s};
use crate::promises::changed_image;
use spex::frame::Frame;

const PSF: &str = "psf-r0-00067784.fits";
const IMAGE: &str = "preproc-bundle0.fits";

/// `spex` on bundle 0 at 6000-6200 A (two threads) with `extra` options.
fn extract(input: &Path, psf: &Path, out: &Path, extra: &[&str]) -> Output {
    extract_bundle0(input, psf, out, extra)
}

fn frame_with(dir: &Path, name: &str, input: &Path, extra: &[&str]) -> Frame {
    let out = dir.join(name);
    let o = extract(input, &data(PSF), &out, extra);
    assert!(
        o.status.success(),
        "{extra:?}: {}",
        String::from_utf8_lossy(&o.stderr)
    );
    Frame::read(&out).unwrap()
}

/// The largest flux difference of two frames in units of the first's error.
fn worst_sigma(a: &Frame, b: &Frame) -> f64 {
    let mut worst = 0.0f64;
    for ((i, &fa), &iv) in a.flux.indexed_iter().zip(&a.ivar) {
        worst = worst.max((fa - b.flux[i]).abs() * iv.sqrt());
    }
    worst
}

/// Each layout option is applied (the frame changes), and changes no bin by its error: the
/// patches only cut the same least-squares problem differently, which moves the bins near
/// patch edges (less padding, a different deconvolution there) by a fraction of their
/// noise (0.27 sigma with `--wavepad 5`, as measured).
#[test]
fn layout_options_are_applied_and_change_the_flux_below_the_noise() {
    let dir = tempfile::tempdir().unwrap();
    let input = data(IMAGE);
    let default = frame_with(dir.path(), "default.fits", &input, &[]);
    for extra in [
        &["--bundlesize", "5", "--nsubbundles", "1"][..],
        &["--nsubbundles", "25"],
        &["--nwavestep", "30"],
        &["--wavepad", "5"],
        &["--wavepad-frac", "0.5"],
        &["--pixpad-frac", "0.5"],
    ] {
        let other = frame_with(dir.path(), "other.fits", &input, extra);
        assert_ne!(other.flux, default.flux, "{extra:?} changed nothing");
        let worst = worst_sigma(&default, &other);
        assert!(worst < 1.0, "{extra:?}: {worst} sigma from the default");
    }
}

/// A positive `--regularize` adds to the diagonal of the normal equations: it pulls the flux
/// toward 0 and raises ivar, in every bin.
#[test]
fn positive_regularize_shrinks_the_flux_and_raises_ivar() {
    let dir = tempfile::tempdir().unwrap();
    let input = data(IMAGE);
    let default = frame_with(dir.path(), "default.fits", &input, &[]);
    let regular = frame_with(dir.path(), "reg.fits", &input, &["--regularize", "1"]);
    let shrunk: f64 = regular.flux.iter().map(|f| f.abs()).sum();
    let plain: f64 = default.flux.iter().map(|f| f.abs()).sum();
    assert!(shrunk < plain, "total |flux| {shrunk} against {plain}");
    let raised = regular
        .ivar
        .iter()
        .zip(&default.ivar)
        .filter(|(r, d)| r > d);
    assert!(raised.count() > default.ivar.len() / 2, "ivar not raised");
}

/// `--mask-bits`: the default (767) keeps pixels flagged only with BADREADNOISE (256), as
/// desispec does; `any` rejects them as gpu_specter does: the frames are those of the image
/// without the flag and of the image with ivar 0 on those pixels.
#[test]
fn mask_bits_choose_the_rejected_pixels() {
    let dir = tempfile::tempdir().unwrap();
    let block = |i: usize, ncols: usize| (900..1000).contains(&(i / ncols)) && i % 3 == 0;
    let path = |n: &str| dir.path().join(n);
    changed_image(&path("flagged.fits"), |_, _, mask, ncols| {
        (0..mask.len())
            .filter(|&i| block(i, ncols))
            .for_each(|i| mask[i] |= 256);
    });
    changed_image(&path("plain.fits"), |_, _, _, _| {});
    changed_image(&path("masked.fits"), |_, ivar, _, ncols| {
        (0..ivar.len())
            .filter(|&i| block(i, ncols))
            .for_each(|i| ivar[i] = 0.0);
    });
    let kept = frame_with(dir.path(), "a.fits", &path("flagged.fits"), &[]);
    let plain = frame_with(dir.path(), "b.fits", &path("plain.fits"), &[]);
    assert_eq!(kept, plain, "767 rejected BADREADNOISE");
    let any = frame_with(
        dir.path(),
        "c.fits",
        &path("flagged.fits"),
        &["--mask-bits", "any"],
    );
    let masked = frame_with(dir.path(), "d.fits", &path("masked.fits"), &[]);
    assert_eq!(any, masked, "`any` kept BADREADNOISE pixels");
    assert_ne!(any, kept);
}

/// A run over a `--list` that writes each frame; with `--skip-existing` a frame whose output
/// exists is not extracted and its file is left as it was.
#[test]
fn skip_existing_leaves_existing_outputs() {
    let dir = tempfile::tempdir().unwrap();
    let (input, psf) = (data(IMAGE), data(PSF));
    let (a, b) = (dir.path().join("a.fits"), dir.path().join("b.fits"));
    std::fs::write(&a, b"an earlier frame").unwrap();
    let list = dir.path().join("frames.txt");
    std::fs::write(
        &list,
        format!(
            "{0} {1} {2}\n{0} {1} {3}\n",
            s(&input),
            s(&psf),
            s(&a),
            s(&b)
        ),
    )
    .unwrap();
    let o = Command::new(env!("CARGO_BIN_EXE_spex"))
        .args(["extract", "--list", s(&list), "--skip-existing", "-n", "25"])
        .args(["-w", "6000,6200,0.8", "--threads", "2"])
        .output()
        .unwrap();
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    assert_eq!(std::fs::read(&a).unwrap(), b"an earlier frame");
    assert_eq!(Frame::read(&b).unwrap().nspec, 25);
}

/// An output that is an input, or a link to a directory, is refused before any work: exit
/// status 1, one error line naming it, the input unchanged.
#[test]
fn outputs_that_would_replace_inputs_are_refused() {
    let dir = tempfile::tempdir().unwrap();
    let copy = |from: PathBuf, to: &str| {
        let p = dir.path().join(to);
        std::fs::copy(from, &p).unwrap();
        p
    };
    let (input, psf) = (data(IMAGE), copy(data(PSF), "psf.fits"));
    let reference = copy(data("reference-frame-bundle0.fits"), "ref.fits");
    let fibermap = copy(data("preproc-bundle1.fits"), "fm.fits");
    std::fs::create_dir(dir.path().join("d")).unwrap();
    let link = dir.path().join("link.fits");
    std::os::unix::fs::symlink(dir.path().join("d"), &link).unwrap();
    let out = dir.path().join("f.fits");
    let cases: [(&Path, Vec<&str>, &str); 4] = [
        (
            &reference,
            vec!["--test", s(&reference)],
            "replace the input",
        ),
        (&out, vec!["-m", s(&psf)], "replace the input"),
        (&link, vec![], "not a regular file"),
        (&fibermap, vec!["-f", s(&fibermap)], "replace the input"),
    ];
    for (output, extra, why) in cases {
        let before: Vec<Vec<u8>> = [&psf, &reference, &fibermap]
            .iter()
            .map(|p| std::fs::read(p).unwrap())
            .collect();
        let o = extract(&input, &psf, output, &extra);
        let stderr = String::from_utf8_lossy(&o.stderr);
        assert_eq!(o.status.code(), Some(1), "{extra:?}: {stderr}");
        let errors: Vec<&str> = stderr.lines().filter(|l| l.starts_with("spex: ")).collect();
        assert_eq!(errors.len(), 1, "{stderr}");
        assert!(errors[0].contains(why), "{}", errors[0]);
        let after: Vec<Vec<u8>> = [&psf, &reference, &fibermap]
            .iter()
            .map(|p| std::fs::read(p).unwrap())
            .collect();
        assert!(before == after, "{extra:?}: an input changed");
        assert!(!out.exists());
    }
}

/// SIGTERM during a `--list` run: status 143, the signal named, no output or temporary left
/// (the frames written before it stay, whole).
#[test]
fn sigterm_ends_a_list_run_without_leftovers() {
    let dir = tempfile::tempdir().unwrap();
    let (input, psf) = (data(IMAGE), data(PSF));
    let out = dir.path().join("out");
    std::fs::create_dir(&out).unwrap();
    let list: String = (0..20)
        .map(|k| format!("{} {} {}/f{k}.fits\n", s(&input), s(&psf), s(&out)))
        .collect();
    std::fs::write(dir.path().join("frames.txt"), list).unwrap();
    let mut child = Command::new(env!("CARGO_BIN_EXE_spex"))
        .args(["extract", "--list", s(&dir.path().join("frames.txt"))])
        .args(["-n", "25", "-w", "6000,6200,0.8", "--threads", "2"])
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let t0 = Instant::now();
    let hidden = || {
        std::fs::read_dir(&out)
            .unwrap()
            .any(|e| e.unwrap().file_name().to_string_lossy().starts_with('.'))
    };
    while !hidden() {
        assert!(child.try_wait().unwrap().is_none(), "spex ended first");
        assert!(t0.elapsed() < Duration::from_secs(120), "no temporary file");
        std::thread::sleep(Duration::from_millis(1));
    }
    let killed = Command::new("kill")
        .args(["-TERM", &child.id().to_string()])
        .status()
        .unwrap();
    assert!(killed.success());
    let o = child.wait_with_output().unwrap();
    let stderr = String::from_utf8_lossy(&o.stderr);
    assert_eq!(o.status.code(), Some(143), "{stderr}");
    assert!(stderr.contains("stopped by SIGTERM"), "{stderr}");
    for entry in std::fs::read_dir(&out).unwrap() {
        let path = entry.unwrap().path();
        let name = path.file_name().unwrap().to_string_lossy().into_owned();
        assert!(!name.starts_with('.'), "temporary {name} left");
        assert_eq!(Frame::read(&path).unwrap().nspec, 25, "{name}");
    }
}
