//! `spex qa`: the quick-look PNG read back (its size, every panel drawn, the pull histogram
//! of a shifted truth), and the exit status and error line of bad input.

use std::collections::HashSet;
use std::path::Path;
use std::process::Output;

use crate::common::{data, path_str as s, run_spex as spex};
use spex::compare::Truth;
use spex::frame::{specmask, Frame};
use spex::image::{Image, MaskRule};
use spex::qa::{self, Panel, PanelKind, QuickLook, Residual};

/// Width, height and RGB pixels of a PNG.
fn read_png(path: &Path) -> (u32, u32, Vec<u8>) {
    let file = std::fs::File::open(path).expect("the picture exists");
    let mut reader = png::Decoder::new(file).read_info().expect("a PNG");
    let mut rgb = vec![0; reader.output_buffer_size()];
    let info = reader.next_frame(&mut rgb).expect("PNG data");
    assert_eq!(info.color_type, png::ColorType::Rgb);
    rgb.truncate(info.buffer_size());
    (info.width, info.height, rgb)
}

/// The colours of a panel's data area.
fn colours(rgb: &[u8], width: u32, panel: &Panel) -> Vec<[u8; 3]> {
    let mut out = Vec::new();
    for y in panel.y.clone() {
        for x in panel.x.clone() {
            let i = 3 * (y * width + x) as usize;
            out.push([rgb[i], rgb[i + 1], rgb[i + 2]]);
        }
    }
    out
}

fn distinct(c: &[[u8; 3]]) -> usize {
    c.iter().collect::<HashSet<_>>().len()
}

fn truth() -> Truth {
    Truth::read(&data("truth-bundle0.fits"), None).expect("bundled truth")
}

#[test]
fn every_panel_of_the_picture_is_drawn() {
    let dir = tempfile::tempdir().unwrap();
    let (frame_path, model) = (dir.path().join("frame.fits"), dir.path().join("model.fits"));
    let input = data("preproc-bundle0.fits");
    let o = spex(&[
        "-i",
        s(&input),
        "-p",
        s(&data("psf-r0-00067784.fits")),
        "-o",
        s(&frame_path),
        "-m",
        s(&model),
        "-w",
        "6000,6400,0.8",
        "-s",
        "0",
        "-n",
        "25",
    ]);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let mut frame = Frame::read(&frame_path).unwrap();
    // The extraction flags nothing: flag two stretches so that the MASK panel has content.
    frame
        .mask
        .slice_mut(ndarray::s![3, 100..150])
        .fill(specmask::SOMEBADPIX);
    frame
        .mask
        .slice_mut(ndarray::s![20, 300..])
        .fill(specmask::BAD2DFIT);
    let image = Image::read(&input, MaskRule::Bits(767)).unwrap();
    let model = qa::read_model(&model).unwrap();
    let mut picture = QuickLook::new("frame.fits", frame)
        .with_truth(&truth())
        .unwrap();
    picture.residual = Some(Residual::new(&image, &model).unwrap());
    let png = dir.path().join("qa.png");
    let panels = picture.write(&png).unwrap();

    let (w, h, rgb) = read_png(&png);
    assert_eq!((w, h), qa::picture_size(true));
    let kinds: Vec<PanelKind> = panels.iter().map(|p| p.kind).collect();
    use PanelKind as K;
    assert_eq!(
        kinds,
        [K::Flux, K::Ivar, K::Mask, K::Chi2pix, K::Pulls, K::Residual]
    );
    for panel in &panels {
        assert!(panel.x.end <= w && panel.y.end <= h, "{panel:?}");
        assert!(panel.x.len() > 300 && panel.y.len() > 100, "{panel:?}");
        let c = colours(&rgb, w, panel);
        match panel.kind {
            // No flag, SOMEBADPIX and BAD2DFIT: three colours, the flags in their rows.
            K::Mask => assert_eq!(distinct(&c), 3, "{panel:?}"),
            // Continuous scales: many colours, a few stand for nothing.
            _ => assert!(distinct(&c) > 20, "{panel:?}: {} colours", distinct(&c)),
        }
    }
    // The residual's region lies on the traces: the model is lit in every row of it.
    let r = picture.residual.as_ref().unwrap();
    assert_eq!(r.rows.len(), qa::RESIDUAL_ROWS);
    let (rms, n) = r.rms();
    assert!(
        n > r.values.len() / 2 && rms.is_finite(),
        "rms {rms} over {n}"
    );
}

#[test]
fn pull_histogram_of_a_shifted_truth_differs() {
    let dir = tempfile::tempdir().unwrap();
    let frame = Frame::read(&data("reference-frame-bundle0.fits")).unwrap();
    let truth = truth();
    // Three times the median sigma of a bin (photons per bin): every pull grows, half of them
    // by at least 3, so that their mean grows by at least 1.5.
    let dw = frame.wave[1] - frame.wave[0];
    let sigmas: Vec<f64> = frame
        .ivar
        .iter()
        .filter(|&&iv| iv > 0.0)
        .map(|iv| dw / iv.sqrt())
        .collect();
    let shift = 3.0 * spex::frame::median(sigmas);
    let mut shifted = truth.clone();
    shifted.flux -= shift;

    let draw = |truth: &Truth, name: &str| {
        let picture = QuickLook::new(name, frame.clone())
            .with_truth(truth)
            .unwrap();
        let path = dir.path().join(name);
        let panels = picture.write(&path).unwrap();
        let (w, h, rgb) = read_png(&path);
        assert_eq!((w, h), qa::picture_size(true));
        let hist = panels.into_iter().find(|p| p.kind == PanelKind::Pulls);
        let pixels = colours(&rgb, w, &hist.expect("a pull histogram"));
        (picture.pull_stats().unwrap(), pixels)
    };
    let (base, base_pixels) = draw(&truth, "base.png");
    let (moved, moved_pixels) = draw(&shifted, "shifted.png");
    assert!(
        base.mean.abs() < 0.01 && (base.std - 1.0).abs() < 0.02,
        "{base}"
    );
    assert!(moved.mean - base.mean >= 1.5, "{base}\n{moved}");
    let differ = base_pixels
        .iter()
        .zip(&moved_pixels)
        .filter(|(a, b)| a != b)
        .count();
    // The bars cover about a fifth of the panel (the unit area of the Gaussian in a panel of
    // 12 x 0.46 units); moved by 3 units, most of them change place.
    assert!(
        differ * 20 > base_pixels.len(),
        "{differ} of {} pixels differ",
        base_pixels.len()
    );
}

#[test]
fn command_writes_the_picture_and_prints_the_pulls() {
    let dir = tempfile::tempdir().unwrap();
    let png = dir.path().join("qa.png");
    let frame = data("reference-frame-bundle0.fits");
    let truth = data("truth-bundle0.fits");
    let o = spex(&["qa", s(&frame), "--truth", s(&truth), "-o", s(&png)]);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let stdout = String::from_utf8_lossy(&o.stdout);
    assert!(stdout.contains("mean pull:"), "{stdout}");
    let (w, h, _) = read_png(&png);
    assert_eq!((w, h), qa::picture_size(true));

    let plain = dir.path().join("plain.png");
    let o = spex(&["qa", s(&frame), "-o", s(&plain)]);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let (w, h, _) = read_png(&plain);
    assert_eq!((w, h), qa::picture_size(false));
}

/// Exit status 1, one line of stderr that names `file`, and no picture.
fn assert_fails_on(o: &Output, file: &Path, png: &Path) {
    let stderr = String::from_utf8_lossy(&o.stderr);
    assert_eq!(o.status.code(), Some(1), "{stderr}");
    assert_eq!(stderr.lines().count(), 1, "{stderr}");
    assert!(stderr.contains(s(file)), "{stderr}");
    assert!(!stderr.contains("panicked"), "{stderr}");
    assert!(!png.exists());
}

#[test]
fn missing_or_malformed_frames_exit_1_naming_the_file() {
    let dir = tempfile::tempdir().unwrap();
    let png = dir.path().join("qa.png");
    let missing = dir.path().join("no-such-frame.fits");
    assert_fails_on(&spex(&["qa", s(&missing), "-o", s(&png)]), &missing, &png);
    // A FITS file that is not a frame (a PSF has no FLUX HDU).
    let psf = data("psf-r0-00067784.fits");
    assert_fails_on(&spex(&["qa", s(&psf), "-o", s(&png)]), &psf, &png);
    let text = dir.path().join("frame.fits");
    std::fs::write(&text, "not a FITS file\n").unwrap();
    assert_fails_on(&spex(&["qa", s(&text), "-o", s(&png)]), &text, &png);
    assert_eq!(std::fs::read_dir(dir.path()).unwrap().count(), 1);
}

#[test]
fn usage_errors_exit_2() {
    let frame = data("reference-frame-bundle0.fits");
    for args in [
        vec!["qa", s(&frame)],
        vec!["qa", s(&frame), "-o", "q.png", "--model", "m.fits"],
        vec!["qa", s(&frame), "-o", "q.png", "--mask-bits", "some"],
    ] {
        let o = spex(&args);
        assert_eq!(o.status.code(), Some(2), "{args:?}");
    }
}
