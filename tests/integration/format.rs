//! The frame and the model image as desispec writes them, read back with the `fitsio` crate:
//! HDU layout, desi_extract_spectra's keywords (shortened input names under the production
//! directory, ORIG_PSF, FIBERMIN, DEPNAM/DEPVER, HELIOCOR), the uint32 MASK, numpy's
//! WAVELENGTH, CHECKSUM/DATASUM on every HDU, the hook for SCORES, and the refusal to write a
//! frame holding non-finite values.

use std::path::Path;
use std::process::Command;
use std::sync::Arc;

use crate::common::data;
use fitsio::FitsFile;
use ndarray::{Array2, Array3};
use spex::error::Error;
use spex::fits::Fits;
use spex::frame::{ExtraHdu, Frame, FrameMeta};
use spex::plan::output_grid;

fn spex(args: &[&str], env: &[(&str, &str)]) -> std::process::Output {
    let mut c = Command::new(env!("CARGO_BIN_EXE_spex"));
    c.args(args).env_remove("SPEX_LOG");
    for var in ["DESI_SPECTRO_CALIB", "DESI_ROOT", "DESI_ROOT_READONLY"] {
        c.env_remove(var);
    }
    c.envs(env.iter().copied()).output().expect("spex runs")
}

fn key<T: fitsio::headers::ReadsKey>(f: &mut FitsFile, hdu: usize, name: &str) -> T {
    let h = f.hdu(hdu).unwrap();
    h.read_key::<T>(f, name)
        .unwrap_or_else(|e| panic!("HDU {hdu} keyword {name}: {e}"))
}

fn has_key(f: &mut FitsFile, hdu: usize, name: &str) -> bool {
    let h = f.hdu(hdu).unwrap();
    h.read_key::<String>(f, name).is_ok()
}

fn hdu_names(f: &mut FitsFile) -> Vec<String> {
    let n = f.num_hdus().unwrap();
    (0..n)
        .map(|i| {
            let h = f.hdu(i).unwrap();
            h.read_key::<String>(f, "EXTNAME").unwrap()
        })
        .collect()
}

fn all_checksums_valid(path: &Path) {
    let mut f = Fits::open(path).unwrap();
    let sums = f.verify_checksums().unwrap();
    assert!(!sums.is_empty());
    for (i, s) in sums.iter().enumerate() {
        assert_eq!(*s, (1, 1), "{}: HDU {i} DATASUM/CHECKSUM", path.display());
    }
}

/// desi_proc's way: inputs under `$DESI_SPECTRO_REDUX/$SPECPROD`, a model image, the default
/// environment of a production. Everything desispec writes is there, with desispec's values.
#[test]
fn extracted_frame_has_desispecs_layout_and_keywords() {
    let dir = tempfile::tempdir().unwrap();
    let redux = dir.path().join("redux");
    let prod = redux.join("daily");
    std::fs::create_dir_all(prod.join("preproc")).unwrap();
    let (input, psf) = (
        prod.join("preproc/preproc-r0-00000001.fits"),
        prod.join("psf-r0-00000001.fits"),
    );
    std::os::unix::fs::symlink(data("preproc-bundle0.fits"), &input).unwrap();
    std::os::unix::fs::symlink(data("psf-r0-00067784.fits"), &psf).unwrap();
    let (out, model) = (dir.path().join("frame.fits"), dir.path().join("model.fits"));
    let s = |p: &Path| p.to_str().unwrap().to_string();
    let args = [
        "-i",
        &s(&input),
        "-p",
        &s(&psf),
        "-o",
        &s(&out),
        "-m",
        &s(&model),
        "-w",
        "6000,6400,0.8",
        "-s",
        "25",
        "-n",
        "25",
        "--threads",
        "2",
    ];
    let redux_s = s(&redux);
    let o = spex(
        &args,
        &[("DESI_SPECTRO_REDUX", &redux_s), ("SPECPROD", "daily")],
    );
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));

    let mut f = FitsFile::open(&out).unwrap();
    assert_eq!(
        hdu_names(&mut f),
        [
            "FLUX",
            "IVAR",
            "MASK",
            "WAVELENGTH",
            "RESOLUTION",
            "FIBERMAP",
            "CHI2PIX",
            "SCORES"
        ]
    );
    assert_eq!(key::<i64>(&mut f, 0, "NSPEC"), 25);
    // the requested values, read back bit for bit
    assert_eq!(
        key::<f64>(&mut f, 0, "WAVEMIN").to_bits(),
        6000f64.to_bits()
    );
    assert_eq!(
        key::<f64>(&mut f, 0, "WAVEMAX").to_bits(),
        6400f64.to_bits()
    );
    assert_eq!(
        key::<f64>(&mut f, 0, "WAVESTEP").to_bits(),
        0.8f64.to_bits()
    );
    assert_eq!(
        key::<String>(&mut f, 0, "IN_PSF"),
        "SPECPROD/psf-r0-00000001.fits"
    );
    assert_eq!(
        key::<String>(&mut f, 0, "IN_IMG"),
        "SPECPROD/preproc/preproc-r0-00000001.fits"
    );
    assert_eq!(
        key::<String>(&mut f, 0, "ORIG_PSF"),
        "SPECPROD/calibnight/20201214/psfnight-r0-20201214.fits",
        "the PSF's own IN_PSF"
    );
    assert_eq!(key::<i64>(&mut f, 0, "FIBERMIN"), 25);
    assert_eq!(
        key::<String>(&mut f, 0, "SPECTER"),
        env!("CARGO_PKG_VERSION"),
        "the extraction code's version, as desispec writes gpu_specter's"
    );
    assert_eq!(key::<String>(&mut f, 0, "BUNIT"), "electron/Angstrom");
    assert_eq!(key::<String>(&mut f, 0, "CAMERA"), "r0", "preproc header");
    assert!(
        !has_key(&mut f, 0, "HELIOCOR"),
        "no correction, no HELIOCOR"
    );
    let mut deps: Vec<(String, String)> = Vec::new();
    for i in 0..100 {
        let (name, version) = (format!("DEPNAM{i:02}"), format!("DEPVER{i:02}"));
        if !has_key(&mut f, 0, &name) {
            break;
        }
        deps.push((key(&mut f, 0, &name), key(&mut f, 0, &version)));
    }
    assert!(deps.contains(&("spex".into(), env!("CARGO_PKG_VERSION").into())));
    assert!(deps.contains(&("SPECPROD".into(), "daily".into())));
    assert!(deps.contains(&("DESI_ROOT".into(), "NOT_SET".into())));

    assert_eq!(key::<i64>(&mut f, 2, "BITPIX"), 32, "MASK");
    assert_eq!(key::<i64>(&mut f, 2, "BZERO"), 1 << 31, "MASK is uint32");
    let h = f.hdu("WAVELENGTH").unwrap();
    let wave: Vec<f64> = h.read_image(&mut f).unwrap();
    assert_eq!(wave, output_grid(6000.0, 6400.0, 0.8));
    let h = f.hdu("FIBERMAP").unwrap();
    let fibers: Vec<i32> = h.read_col(&mut f, "FIBER").unwrap();
    assert_eq!(fibers, (25..50).collect::<Vec<i32>>());
    all_checksums_valid(&out);

    // The model: float64, the frame's header, checksums.
    let mut m = FitsFile::open(&model).unwrap();
    assert_eq!(key::<i64>(&mut m, 0, "BITPIX"), -64);
    assert_eq!(key::<i64>(&mut m, 0, "NAXIS2"), 4128);
    assert_eq!(
        key::<String>(&mut m, 0, "IN_IMG"),
        key::<String>(&mut f, 0, "IN_IMG")
    );
    assert_eq!(key::<i64>(&mut m, 0, "FIBERMIN"), 25);
    all_checksums_valid(&model);
    // the written frame still reads as a frame
    let frame = Frame::read(&out).unwrap();
    assert_eq!((frame.specmin, frame.nspec, frame.nwave()), (25, 25, 501));
}

/// A small frame of `nspec` fibers on `wave`, with finite values.
fn small_frame(specmin: usize, wave: Vec<f64>) -> Frame {
    let (nspec, nw, ndiag) = (3, wave.len(), 1);
    let shape = (nspec, nw);
    // values numbered in row-major order: flux 0, 1, 2, ... and a mask cycling through 0-2
    let flux = Array2::from_shape_fn(shape, |(f, j)| (f * nw + j) as f64);
    let mask = Array2::from_shape_fn(shape, |(f, j)| match f * nw + j {
        1 => 1 << 31,
        i => (i % 3) as u32,
    });
    Frame {
        specmin,
        specmin_recorded: true,
        nspec,
        wave,
        ndiag,
        flux,
        ivar: Array2::ones(shape),
        mask,
        resolution: Array3::from_elem((nspec, 2 * ndiag + 1, nw), 0.5),
        chi2pix: Array2::ones(shape),
        pixmask_fraction: Array2::zeros(shape),
    }
}

/// With a barycentric factor the extraction runs on the corrected grid, but the file records
/// the requested one: WAVELENGTH is numpy's arange of `wmin, wmax, dw` and HELIOCOR the
/// factor, exactly.
#[test]
fn heliocor_and_the_requested_grid() {
    let dir = tempfile::tempdir().unwrap();
    let (wmin, wmax, dw) = (5760.0, 5790.0, 0.8);
    let factor = 1.000_123_456_789_012_3;
    let corrected = output_grid(wmin / factor, wmax / factor, dw / factor);
    let frame = small_frame(0, corrected.clone());
    let mut meta = FrameMeta {
        grid: Some((wmin, wmax, dw)),
        heliocor: Some(factor),
        ..FrameMeta::default()
    };
    let path = dir.path().join("frame.fits");
    frame.write(&path, &meta).unwrap();
    let mut f = FitsFile::open(&path).unwrap();
    assert_eq!(
        key::<f64>(&mut f, 0, "HELIOCOR").to_bits(),
        factor.to_bits()
    );
    assert_eq!(key::<f64>(&mut f, 0, "WAVEMIN").to_bits(), wmin.to_bits());
    let h = f.hdu("WAVELENGTH").unwrap();
    let wave: Vec<f64> = h.read_image(&mut f).unwrap();
    assert_eq!(wave, output_grid(wmin, wmax, dw));
    assert_ne!(wave, corrected);
    let h = f.hdu("MASK").unwrap();
    let mask: Vec<u32> = h.read_image(&mut f).unwrap();
    assert_eq!(
        mask,
        frame.mask.iter().copied().collect::<Vec<_>>(),
        "uint32 values above 2^31 survive"
    );
    assert_eq!(Frame::read(&path).unwrap().mask, frame.mask);
    all_checksums_valid(&path);

    // a factor of 1 writes no HELIOCOR
    meta.heliocor = Some(1.0);
    frame.write(&path, &meta).unwrap();
    let mut f = FitsFile::open(&path).unwrap();
    assert!(!has_key(&mut f, 0, "HELIOCOR"));

    // a requested grid with another number of bins is refused, and nothing is written
    meta.grid = Some((wmin, wmax + 8.0, dw));
    let other = dir.path().join("other.fits");
    assert!(matches!(frame.write(&other, &meta), Err(Error::Config(_))));
    assert!(!other.exists());
}

/// FIBERMIN is the smallest FIBER of the copied FIBERMAP rows, whose CHECKSUM/DATASUM are
/// recomputed after the rows are cut.
#[test]
fn copied_fibermap_gives_fibermin_and_fresh_checksums() {
    let dir = tempfile::tempdir().unwrap();
    let frame = small_frame(100, output_grid(6000.0, 6004.0, 0.8));
    let meta = FrameMeta {
        fibermap_from: Some(data("preproc-bundle0.fits")),
        ..FrameMeta::default()
    };
    let path = dir.path().join("frame.fits");
    frame.write(&path, &meta).unwrap();
    let mut f = FitsFile::open(&path).unwrap();
    assert_eq!(key::<i64>(&mut f, 0, "FIBERMIN"), 100);
    let h = f.hdu("FIBERMAP").unwrap();
    let fibers: Vec<i32> = h.read_col(&mut f, "FIBER").unwrap();
    assert_eq!(fibers, vec![100, 101, 102]);
    all_checksums_valid(&path);
}

/// A SCORES-like table written through the hook lands after CHI2PIX, with its checksum.
#[derive(Debug)]
struct Scores;

impl ExtraHdu for Scores {
    fn write(&self, fits: &mut Fits, frame: &Frame) -> spex::error::Result<()> {
        fits.create_table("SCORES", &[("TARGETID", "K")], frame.nspec)?;
        let ids: Vec<i64> = (0..frame.nspec as i64).collect();
        fits.write_column("TARGETID", &ids)
    }
}

#[test]
fn extra_hdus_follow_chi2pix() {
    let dir = tempfile::tempdir().unwrap();
    let frame = small_frame(0, output_grid(6000.0, 6004.0, 0.8));
    let meta = FrameMeta {
        extra_hdus: vec![Arc::new(Scores)],
        ..FrameMeta::default()
    };
    let path = dir.path().join("frame.fits");
    frame.write(&path, &meta).unwrap();
    let mut f = FitsFile::open(&path).unwrap();
    let names = hdu_names(&mut f);
    assert_eq!(names[names.len() - 2..], ["CHI2PIX", "SCORES"]);
    all_checksums_valid(&path);
}

/// NaN or infinity in FLUX or IVAR (also a finite double beyond float32's range) stops the
/// write: the error counts them and names the first fiber and bin; no file appears.
#[test]
fn non_finite_frame_is_not_written() {
    let dir = tempfile::tempdir().unwrap();
    let mut frame = small_frame(50, output_grid(6000.0, 6004.0, 0.8));
    frame.ivar[[1, 3]] = f64::INFINITY;
    frame.flux[[2, 1]] = f64::NAN;
    frame.flux[[2, 2]] = 1e300;
    let path = dir.path().join("frame.fits");
    match frame.write(&path, &FrameMeta::default()) {
        Err(Error::NonFiniteFrame {
            count, fiber, bin, ..
        }) => assert_eq!((count, fiber, bin), (3, 51, 3)),
        other => panic!("expected a non-finite error, got {other:?}"),
    }
    assert_eq!(std::fs::read_dir(dir.path()).unwrap().count(), 0);
}
