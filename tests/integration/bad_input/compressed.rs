//! Tile-compressed inputs whose compression keywords are damaged: cfitsio trusts them (a
//! ZTILEn or RICE block size of 0 divides by zero, a huge ZDITHER0 indexes out of its table),
//! so spex checks them first, and such a file is one failed frame that names the HDU and the
//! keyword, never a signal that ends the run; a string column read as numbers is named too.

use super::*;

/// Rewrites the card of `key` in the header of HDU `extname` byte for byte, as a damaged or
/// hand-edited file holds it (cfitsio cannot be asked to edit a header it would refuse).
fn set_card(path: &Path, extname: &str, key: &str, value: &str) {
    let mut bytes = std::fs::read(path).expect("read the file");
    let name = format!("EXTNAME = '{extname}");
    let at = bytes
        .windows(name.len())
        .position(|w| w == name.as_bytes())
        .unwrap_or_else(|| panic!("no HDU {extname}"));
    let start = (0..=at / 2880)
        .rev()
        .map(|block| block * 2880)
        .find(|&s| bytes[s..].starts_with(b"XTENSION="))
        .expect("the HDU's first card");
    let keyword = format!("{key:<8}=");
    let card = (start..bytes.len())
        .step_by(80)
        .find(|&c| bytes[c..].starts_with(keyword.as_bytes()) || bytes[c..].starts_with(b"END "))
        .expect("the END card");
    assert!(
        !bytes[card..].starts_with(b"END "),
        "no {key} in HDU {extname}"
    );
    let new = format!("{keyword} {value:>20}");
    bytes[card..card + 80].copy_from_slice(format!("{new:<80}").as_bytes());
    std::fs::write(path, bytes).expect("write the file");
}

/// The preproc of the suite (GZIP_2 tiles of one row, lossless) with one card changed.
fn damaged_preproc(c: &Case, name: &str, hdu: &str, key: &str, value: &str) -> PathBuf {
    let path = c.copy(IMAGE, name);
    set_card(&path, hdu, key, value);
    path
}

/// A small image compressed as cfitsio compresses by default (RICE tiles of one row, the
/// floats quantized with SUBTRACTIVE_DITHER_1 and a ZDITHER0 seed) with one card changed.
fn damaged_rice_image(c: &Case, hdu: &str, key: &str, value: &str) -> PathBuf {
    let path = c.path("in.fits");
    write_image(&path, true, |r, _| 10.0 + r as f32, unit);
    set_card(&path, hdu, key, value);
    path
}

/// Extracting `input` fails with status 1 and one line naming it, the HDU and `needles`;
/// nothing is written.
fn refused(mut c: Case, input: &Path, hdu: &str, needles: &[&str]) {
    let psf = c.copy(PSF, "psf.fits");
    c.seal();
    let o = extract(input, &psf, &c.path("f.fits"), vec![]);
    let file = input.file_name().unwrap().to_str().unwrap();
    let hdu = format!("HDU {hdu}");
    let mut all = vec![file, hdu.as_str(), "tile compression"];
    all.extend(needles);
    expect(&o, 1, &all);
    c.unchanged_except(&[]);
}

#[test]
fn zero_tile_lengths_are_refused_not_divided_by() {
    for (hdu, key) in [("IMAGE", "ZTILE1"), ("IVAR", "ZTILE2"), ("MASK", "ZTILE2")] {
        let c = Case::new();
        let input = damaged_preproc(&c, "in.fits", hdu, key, "0");
        refused(c, &input, hdu, &[&format!("{key} = 0"), "tile length"]);
    }
}

#[test]
fn zero_or_fractional_rice_block_sizes_are_refused() {
    // 0.5 is read by cfitsio as the integer 0.
    for (hdu, value) in [("MASK", "0"), ("IMAGE", "0.5")] {
        let c = Case::new();
        let input = damaged_rice_image(&c, hdu, "ZVAL1", value);
        refused(c, &input, hdu, &["RICE block size ZVAL1 = 0"]);
    }
}

#[test]
fn dither_seeds_outside_the_conventions_range_are_refused() {
    for seed in ["2147483647", "0", "10001"] {
        let c = Case::new();
        let input = damaged_rice_image(&c, "IVAR", "ZDITHER0", seed);
        refused(
            c,
            &input,
            "IVAR",
            &[&format!("ZDITHER0 = {seed}"), "1 to 10000"],
        );
    }
}

/// Headers cfitsio cannot parse are reported as what they are, not as a missing HDU.
#[test]
fn unparsable_compression_headers_say_which_keyword() {
    for (key, value, needle) in [
        (
            "ZCMPTYPE",
            "'FOO_1'",
            "ZCMPTYPE = 'FOO_1' is none of RICE_1",
        ),
        (
            "ZNAXIS1",
            "4115",
            "make 8256 tiles, the table has 4128 rows",
        ),
        ("ZTILE1", "-4114", "ZTILE1 = -4114"),
        ("ZBITPIX", "24", "ZBITPIX = 24"),
    ] {
        let c = Case::new();
        let input = damaged_preproc(&c, "in.fits", "IVAR", key, value);
        refused(c, &input, "IVAR", &[needle]);
    }
}

#[test]
fn a_damaged_gzipped_preproc_is_refused_alike() {
    let c = Case::new();
    let damaged = damaged_preproc(&c, "damaged.fits", "IMAGE", "ZTILE2", "0");
    let input = c.path("in.fits.gz");
    std::fs::write(&input, gzip_member(&std::fs::read(&damaged).unwrap())).unwrap();
    std::fs::remove_file(&damaged).unwrap();
    refused(c, &input, "IMAGE", &["ZTILE2 = 0"]);
}

/// In a `--list` run the damaged frame fails alone: the good frames are written.
#[test]
fn a_damaged_frame_of_a_list_leaves_the_others_written() {
    let mut c = Case::new();
    let psf = c.copy(PSF, "psf.fits");
    let good = c.copy(IMAGE, "good.fits");
    let bad = damaged_preproc(&c, "bad.fits", "MASK", "ZTILE1", "0");
    let lines: Vec<String> = [(&bad, "b.fits"), (&good, "a.fits")]
        .iter()
        .map(|(input, out)| {
            let (i, p) = (input.display(), psf.display());
            format!("{i} {p} {}", c.path(out).display())
        })
        .collect();
    let list = c.path("frames.txt");
    std::fs::write(&list, lines.join("\n") + "\n").unwrap();
    c.seal();
    let mut a = args!["--list", &list];
    a.extend(options());
    let o = spex(a);
    expect(&o, 1, &["bad.fits", "HDU MASK", "ZTILE1 = 0"]);
    assert!(
        o.stderr.lines().any(|l| l == "spex: 1 of 2 frames failed"),
        "{}",
        o.stderr
    );
    c.unchanged_except(&["a.fits"]);
    Frame::read(&c.path("a.fits")).expect("the good frame");
}

/// A FIBERMAP whose FIBER column holds strings: named with its TFORM, not "read past end".
#[test]
fn a_string_fiber_column_is_named() {
    let mut c = Case::new();
    let input = c.copy(IMAGE, "in.fits");
    // 'J' and '4A' are both 4 bytes: the table stays readable, its FIBER column is text.
    set_card(&input, "FIBERMAP", "TFORM1", "'4A'");
    let psf = c.copy(PSF, "psf.fits");
    c.seal();
    let o = extract(&input, &psf, &c.path("f.fits"), vec![]);
    expect(
        &o,
        1,
        &[
            "in.fits",
            "FIBERMAP",
            "column FIBER",
            "'4A'",
            "not a column of numbers",
        ],
    );
    c.unchanged_except(&[]);
}
