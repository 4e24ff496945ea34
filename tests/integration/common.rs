//! Helpers shared by the integration tests: paths of the bundled data and synthetic images.

use std::path::PathBuf;

use ndarray::Array2;
use spex::image::Image;
use spex::psf::GaussHermitePsf;

/// A file of the bundled data: tests/data of the source tree, or `SPEX_TEST_DATA`, which lets
/// a copied test binary find its data away from the source tree (scripts/gpu-check).
pub fn data(name: &str) -> PathBuf {
    std::env::var("SPEX_TEST_DATA")
        .map(PathBuf::from)
        .unwrap_or_else(|_| PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/data"))
        .join(name)
}

pub fn psf_a() -> GaussHermitePsf {
    GaussHermitePsf::read(&data("psf-r0-00067784.fits")).expect("bundled PSF")
}

/// A blank CCD image of the PSF's size with unit inverse variance.
pub fn blank_image(psf: &GaussHermitePsf) -> Image {
    let shape = (psf.npix_y, psf.npix_x);
    Image {
        path: PathBuf::from("synthetic"),
        nrows: psf.npix_y,
        ncols: psf.npix_x,
        pix: Array2::zeros(shape),
        ivar: Array2::ones(shape),
        header: Vec::new(),
        has_fibermap: false,
        nmasked: 0,
        nnonfinite: 0,
        inflated: Default::default(),
    }
}

/// Adds `flux(fiber, wave index) * spot` to the image for the given fibers and waves.
pub fn add_spots(
    image: &mut Image,
    psf: &GaussHermitePsf,
    fibers: std::ops::Range<usize>,
    waves: &[f64],
    flux: impl Fn(usize, usize) -> f64,
) {
    let spots = psf.spots(fibers.clone(), waves);
    let c = &spots.corners;
    for (fi, fiber) in fibers.enumerate() {
        for w in 0..waves.len() {
            let (xc, yc) = c.corner(fi, w);
            let s = spots.spot(fi, w);
            let amp = flux(fiber, w);
            for iy in 0..c.ny {
                for ix in 0..c.nx {
                    let (y, x) = (yc as usize + iy, xc as usize + ix);
                    image.pix[[y, x]] += (amp * s[iy * c.nx + ix]) as f32;
                }
            }
        }
    }
}
