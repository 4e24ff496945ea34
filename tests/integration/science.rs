//! Capabilities beyond gpu_specter's: any fiber range, extracted as the full frame extracts it.

use std::path::Path;

use ndarray::s;
use spex::backend::cpu::CpuBackend;
use spex::backend::Progress;
use spex::fits::Fits;
use spex::frame::Frame;
use spex::pipeline::{self, ExtractRequest};
use spex::simulate::{simulate, SimulateOptions};

use crate::common::*;

/// Simulated fibers: the PSF's last two bundles, so that the last fiber of the PSF is among
/// them; the grid is short to keep the test quick.
const SIM_FIBERS: std::ops::Range<usize> = 450..500;
const GRID: (f64, f64, f64) = (6000.0, 6160.0, 0.8);

/// Writes a simulated preproc file of [`SIM_FIBERS`] into `dir`.
fn simulated_preproc(dir: &Path) -> std::path::PathBuf {
    let psf = psf_a();
    let img = dir.join("preproc.fits");
    let mut o = SimulateOptions::new(SIM_FIBERS, 5900.0, 6260.0);
    o.seed = 37;
    simulate(&psf, &o)
        .unwrap()
        .write(&img, &dir.join("truth.fits"))
        .unwrap();
    img
}

fn extract(img: &Path, out: &Path, specmin: usize, nspec: usize) -> Frame {
    let mut r = ExtractRequest::new(img, data("psf-r0-00067784.fits"), out);
    r.wavelength = Some(GRID);
    r.specmin = specmin;
    r.nspec = Some(nspec);
    let mut backend = CpuBackend::new(2).unwrap();
    pipeline::extract_frame(&r, &mut backend, &Progress::silent())
        .unwrap()
        .frame
}

/// One fiber, a range across a bundle boundary and the PSF's last fiber: every fiber's flux,
/// ivar, resolution, chi2pix and mask are those of the extraction of the whole bundles, bit
/// for bit (its sub-bundles are solved with the same neighbours and padding), and the
/// written frame holds exactly the requested fibers: NSPEC, FIBERMIN and the FIBERMAP rows.
#[test]
fn any_fiber_range_equals_the_full_extraction() {
    let dir = tempfile::tempdir().unwrap();
    let img = simulated_preproc(dir.path());
    let full = extract(&img, &dir.path().join("full.fits"), 450, 50);
    assert!(full.flux.iter().any(|&f| f != 0.0));
    for (specmin, nspec) in [(457, 1), (472, 6), (499, 1)] {
        let out = dir.path().join(format!("frame-{specmin}-{nspec}.fits"));
        let part = extract(&img, &out, specmin, nspec);
        let rows = specmin - 450..specmin - 450 + nspec;
        let case = format!("fibers {specmin}..{}", specmin + nspec);
        assert_eq!((part.specmin, part.nspec), (specmin, nspec), "{case}");
        assert_eq!(part.flux, full.flux.slice(s![rows.clone(), ..]), "{case}");
        assert_eq!(part.ivar, full.ivar.slice(s![rows.clone(), ..]), "{case}");
        assert_eq!(part.mask, full.mask.slice(s![rows.clone(), ..]), "{case}");
        assert_eq!(
            part.chi2pix,
            full.chi2pix.slice(s![rows.clone(), ..]),
            "{case}"
        );
        assert_eq!(
            part.resolution,
            full.resolution.slice(s![rows.clone(), .., ..]),
            "{case}"
        );

        let mut f = Fits::open(&out).unwrap();
        f.move_to_primary().unwrap();
        assert_eq!(f.key_i64("NSPEC").unwrap(), Some(nspec as i64), "{case}");
        assert_eq!(
            f.key_i64("SPECMIN").unwrap(),
            Some(specmin as i64),
            "{case}"
        );
        assert_eq!(
            f.key_i64("FIBERMIN").unwrap(),
            Some(specmin as i64),
            "{case}"
        );
        assert_eq!(
            f.image_shape().unwrap(),
            vec![nspec, full.nwave()],
            "{case}"
        );
        f.move_to("FIBERMAP").unwrap();
        assert_eq!(f.nrows().unwrap(), nspec, "{case}");
        let (_, fiber) = f.column::<i32>("FIBER").unwrap();
        let expect: Vec<i32> = (specmin as i32..(specmin + nspec) as i32).collect();
        assert_eq!(fiber, expect, "{case}");
    }
}

/// A range whose bundles would run past the PSF's fibers is refused with a message that says
/// so; a range inside them is not.
#[test]
fn a_range_past_the_psf_is_refused() {
    let psf = psf_a();
    let mut r = ExtractRequest::new("in.fits", "psf.fits", "out.fits");
    r.wavelength = Some(GRID);
    r.specmin = 498;
    r.nspec = Some(3);
    let err = r.plan(&psf).unwrap_err().to_string();
    assert!(err.contains("beyond the PSF"), "{err}");
    r.nspec = Some(2);
    assert!(r.plan(&psf).is_ok());
}
