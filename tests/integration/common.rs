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
        kept_fibermap: Default::default(),
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

/// Runs the built `spex` with `args` (no `SPEX_LOG` from the caller's environment).
pub fn run_spex(args: &[&str]) -> std::process::Output {
    std::process::Command::new(env!("CARGO_BIN_EXE_spex"))
        .args(args)
        .env_remove("SPEX_LOG")
        .output()
        .expect("spex runs")
}

/// A test path as the `&str` an argument list takes.
pub fn path_str(p: &std::path::Path) -> &str {
    p.to_str().expect("test paths are UTF-8")
}

/// `spex` on bundle 0 of reference case 0 (`input`, `psf`) at 6000-6200 A on two threads,
/// with `extra` options.
pub fn extract_bundle0(
    input: &std::path::Path,
    psf: &std::path::Path,
    out: &std::path::Path,
    extra: &[&str],
) -> std::process::Output {
    let mut args = vec![
        "-i",
        path_str(input),
        "-p",
        path_str(psf),
        "-o",
        path_str(out),
    ];
    args.extend([
        "-w",
        "6000,6200,0.8",
        "-s",
        "0",
        "-n",
        "25",
        "--threads",
        "2",
    ]);
    args.extend(extra);
    run_spex(&args)
}

/// `mpiexec` on PATH; the multi-rank tests fail, naming the packages, where there is none.
pub fn mpiexec_path() -> PathBuf {
    let found = std::env::var_os("PATH").and_then(|paths| {
        std::env::split_paths(&paths)
            .map(|p| p.join("mpiexec"))
            .find(|p| p.is_file())
    });
    found.unwrap_or_else(|| {
        panic!(
            "mpiexec not found on PATH: the multi-rank tests need an MPI launcher \
             (Debian/Ubuntu: apt-get install openmpi-bin libopenmpi-dev)"
        )
    })
}

/// The launcher line of the multi-rank tests, up to the program: `ranks` ranks as root,
/// oversubscribed and unbound (CI's 2 cores), shared-memory transfers without ptrace rights
/// (containers).
pub fn mpiexec(ranks: usize) -> std::process::Command {
    let mut c = std::process::Command::new(mpiexec_path());
    c.args([
        "--allow-run-as-root",
        "--oversubscribe",
        "--bind-to",
        "none",
    ])
    .args(["--mca", "btl_vader_single_copy_mechanism", "none"])
    .args(["-n", &ranks.to_string()]);
    c
}
