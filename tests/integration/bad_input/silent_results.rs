//! Inputs that used to give a frame with exit status 0 but wrong values: they must give the
//! frame of the equivalent well-formed input, or fail.

use super::*;

/// Extracts `input` with `extra` options into `name` in the case's directory: exit 0.
fn extract_ok(c: &Case, input: &Path, name: &str, extra: Vec<OsString>) -> Frame {
    let psf = c.path("psf.fits");
    if !psf.exists() {
        std::fs::copy(data(PSF), &psf).expect("copy PSF");
    }
    let o = extract(input, &psf, &c.path(name), extra);
    expect(&o, 0, &[]);
    Frame::read(&c.path(name)).expect("read the frame")
}

/// Asserts that two frames hold the same values, bit for bit (the same pixels extracted the
/// same way).
fn same_frame(a: &Frame, b: &Frame, what: &str) {
    assert_eq!(a.flux, b.flux, "{what}: FLUX");
    assert_eq!(a.ivar, b.ivar, "{what}: IVAR");
    assert_eq!(a.mask, b.mask, "{what}: MASK");
}

fn has_hdu(path: &Path, name: &str) -> bool {
    spex::fits::Fits::open(path)
        .map(|mut f| f.has_hdu(name))
        .unwrap_or(false)
}

#[test]
fn multi_member_gzip_input_reads_every_member() {
    let mut c = Case::new();
    let input = c.copy(IMAGE, "in.fits");
    let plain = std::fs::read(&input).unwrap();
    let fibermap = plain
        .windows(20)
        .position(|w| w == b"EXTNAME = 'FIBERMAP'")
        .expect("a FIBERMAP");
    // At the FIBERMAP's header (the frame lost its FIBERMAP), inside an HDU (MASK went
    // missing), and in three members.
    let block = fibermap / 2880 * 2880;
    let splits: [&[usize]; 3] = [&[block], &[plain.len() / 3], &[1000, plain.len() / 2]];
    let reference = extract_ok(&c, &input, "ref.fits", vec![]);
    for (k, cuts) in splits.iter().enumerate() {
        let mut gz = Vec::new();
        let mut start = 0;
        for &cut in cuts.iter().chain([&plain.len()]) {
            gz.extend(gzip_member(&plain[start..cut]));
            start = cut;
        }
        let name = format!("m{k}.fits.gz");
        std::fs::write(c.path(&name), gz).unwrap();
        let out = format!("f{k}.fits");
        let frame = extract_ok(&c, &c.path(&name), &out, vec![]);
        same_frame(&frame, &reference, &name);
        assert!(has_hdu(&c.path(&out), "FIBERMAP"), "{name}: no FIBERMAP");
    }
    c.seal();
}

/// Writes `key = 'value'` into HDU `hdu` of `path`.
fn write_key(path: &Path, hdu: &str, key: &str, value: &str) {
    let mut f = fitsio::FitsFile::edit(path).expect("open for edit");
    let h = f.hdu(hdu).expect("HDU");
    h.write_key(&mut f, key, value.to_string())
        .expect("write key");
}

#[test]
fn hduname_cards_do_not_replace_extname() {
    let c = Case::new();
    let input = c.copy(IMAGE, "in.fits");
    let reference = extract_ok(&c, &input, "ref.fits", vec![]);
    for (hdu, name) in [("IMAGE", "IVAR"), ("IVAR", "MASK"), ("MASK", "IMAGE")] {
        let edited = c.copy(IMAGE, &format!("{hdu}.fits"));
        write_key(&edited, hdu, "HDUNAME", name);
        let frame = extract_ok(&c, &edited, &format!("f-{hdu}.fits"), vec![]);
        same_frame(&frame, &reference, &format!("HDUNAME = '{name}' in {hdu}"));
    }
}

/// A 1000 x 330 preproc with unit IMAGE and IVAR and a MASK of `mask`'s values, stored as
/// float32 when `float`, else as int32.
fn image_with_mask(path: &Path, float: bool, mask: impl Fn(usize) -> f32) {
    use fitsio::images::{ImageDescription, ImageType};
    let (nrows, ncols) = (1000, 330);
    let mut f = fitsio::FitsFile::create(path).open().expect("create image");
    let dims = [nrows, ncols];
    let desc = |data_type| ImageDescription {
        data_type,
        dimensions: &dims,
    };
    for extname in ["IMAGE", "IVAR"] {
        let hdu = f.create_image(extname, &desc(ImageType::Float)).unwrap();
        hdu.write_image(&mut f, &vec![1f32; nrows * ncols]).unwrap();
    }
    let values: Vec<f32> = (0..nrows * ncols).map(|i| mask(i / ncols)).collect();
    if float {
        let hdu = f.create_image("MASK", &desc(ImageType::Float)).unwrap();
        hdu.write_image(&mut f, &values).unwrap();
    } else {
        let hdu = f.create_image("MASK", &desc(ImageType::Long)).unwrap();
        let ints: Vec<i32> = values.iter().map(|&v| v as i32).collect();
        hdu.write_image(&mut f, &ints).unwrap();
    }
}

#[test]
fn nan_in_a_float_mask_masks_the_pixel() {
    let c = Case::new();
    // NaN on every row, and on the rows of the upper half (bins masked and unmasked); the
    // frame equals that of an integer MASK with every bit set there.
    for (k, masked) in [(0, 0usize), (1, 500)] {
        let (float, int) = (
            c.path(&format!("float{k}.fits")),
            c.path(&format!("int{k}.fits")),
        );
        image_with_mask(&float, true, |r| if r >= masked { f32::NAN } else { 0.0 });
        image_with_mask(&int, false, |r| if r >= masked { -1.0 } else { 0.0 });
        for bits in [args!["--mask-bits", "767"], args![]] {
            let a = extract_ok(&c, &float, "a.fits", bits.clone());
            let b = extract_ok(&c, &int, "b.fits", bits.clone());
            same_frame(&a, &b, &format!("NaN MASK from row {masked}, {bits:?}"));
            // Fully masked bins: the regularisation's ivar alone (1e-15 dw^2).
            assert!(a.ivar.iter().any(|&v| v < 1e-14));
        }
    }
    // Integral float values are the bits they stand for.
    let (float, int) = (c.path("f.fits"), c.path("i.fits"));
    image_with_mask(&float, true, |r| if r % 3 == 0 { 4.0 } else { 0.0 });
    image_with_mask(&int, false, |r| if r % 3 == 0 { 4.0 } else { 0.0 });
    let a = extract_ok(&c, &float, "a.fits", args!["--mask-bits", "767"]);
    let b = extract_ok(&c, &int, "b.fits", args!["--mask-bits", "767"]);
    same_frame(&a, &b, "MASK 4 as float");
}

#[test]
fn chi2pix_of_a_huge_pixel_is_finite_and_flagged() {
    // With no PSF error a pixel's chi2 is its squared residual times its ivar: 1e50 for a
    // pixel of 1e25, beyond float32. Every 50th row of such pixels, across every trace, and
    // of 1e19 (1e38, just inside float32).
    let c = Case::new();
    for (k, value) in [1e25f32, 1e19].into_iter().enumerate() {
        let input = c.path(&format!("hot{k}.fits"));
        write_image(
            &input,
            false,
            |r, _| if r % 50 == 0 { value } else { 10.0 },
            unit,
        );
        let frame = extract_ok(&c, &input, &format!("f{k}.fits"), args!["--psferr", "0"]);
        let arrays = [&frame.flux, &frame.ivar, &frame.chi2pix];
        for (name, a) in ["FLUX", "IVAR", "CHI2PIX"].iter().zip(arrays) {
            assert!(
                a.iter().all(|x| x.is_finite()),
                "{value}: {name} not finite"
            );
        }
        assert!(frame.resolution.iter().all(|x| x.is_finite()));
        let bad = frame.chi2pix.iter().filter(|&&x| x > 1e30).count();
        let max = frame.chi2pix.iter().fold(0f64, |a, &b| a.max(b));
        assert!(
            bad > 0,
            "{value}: no bin sees the hot rows (max chi2pix {max})"
        );
        for (i, &x) in frame.chi2pix.indexed_iter() {
            if x > 1e30 {
                assert_ne!(frame.mask[i] & specmask::BAD2DFIT, 0, "bin {i:?}");
            }
        }
    }
}

#[test]
fn a_grid_of_one_bin_is_per_angstrom() {
    // One bin (wmax = wmin, or a step larger than the range) against the same bin of a grid
    // of two: the per-Angstrom conversion is what differed, by dw = 0.8 in flux and dw^2 in
    // ivar; the neighbouring bin changes the solution by far less (its spectral overlap with
    // the bin is deconvolved away).
    let c = Case::new();
    let input = c.copy(IMAGE, "in.fits");
    let psf = c.copy(PSF, "psf.fits");
    let on_grid = |name: &str, grid: &str| {
        let out = c.path(name);
        let o = spex(args![
            "-i",
            &input,
            "-p",
            &psf,
            "-o",
            &out,
            "-w",
            grid,
            "-n",
            "25",
            "--threads",
            "1"
        ]);
        expect(&o, 0, &[]);
        Frame::read(&out).expect("read the frame")
    };
    let two = on_grid("two.fits", "6020,6020.8,0.8");
    for (k, grid) in ["6020,6020,0.8", "6020,6020.3,0.8"].iter().enumerate() {
        let one = on_grid(&format!("one{k}.fits"), grid);
        assert_eq!(one.nwave(), 1);
        for f in 0..one.nspec {
            let flux = one.flux[[f, 0]] / two.flux[[f, 0]];
            let ivar = one.ivar[[f, 0]] / two.ivar[[f, 0]];
            assert!(
                (flux - 1.0).abs() < 0.02,
                "{grid} fiber {f}: flux ratio {flux}"
            );
            assert!(
                (ivar - 1.0).abs() < 0.04,
                "{grid} fiber {f}: ivar ratio {ivar}"
            );
        }
    }
}
