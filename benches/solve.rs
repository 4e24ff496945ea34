//! Time of one patch solve on the CPU (one thread), the unit of work of an extraction: a
//! sub-bundle of 5 fibers plus 2 neighbours by 50 + 2 x 12 wavelength bins; and of the spots
//! that the CPU backend evaluates for it, those of one fiber over the whole wavelength grid.

use std::path::Path;

use criterion::{criterion_group, criterion_main, Criterion};
use spex::backend::cpu::solve_patch;
use spex::extract::SolveOptions;
use spex::image::Image;
use spex::plan::{Plan, PlanOptions};
use spex::psf::GaussHermitePsf;

fn bench_patch(c: &mut Criterion) {
    let psf = GaussHermitePsf::read(
        &Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/data/psf-r0-00067784.fits"),
    )
    .expect("bundled PSF");
    let plan = Plan::new(PlanOptions::new(6000.0, 6400.0, 0.8, 0, 25)).expect("plan");
    let spots = psf.spots(0..25, &plan.fullwave);
    // a flat spectrum of 100 photons per bin in every fiber, unit weights
    let (ny, nx) = (psf.npix_y, psf.npix_x);
    let mut image = Image {
        path: "synthetic".into(),
        nrows: ny,
        ncols: nx,
        pix: ndarray::Array2::zeros((ny, nx)),
        ivar: ndarray::Array2::ones((ny, nx)),
        header: Vec::new(),
        has_fibermap: false,
        nmasked: 0,
        nnonfinite: 0,
        kept_fibermap: Default::default(),
    };
    let cs = &spots.corners;
    for f in 0..25 {
        for w in 0..plan.fullwave.len() {
            let (xc, yc) = cs.corner(f, w);
            for (i, v) in spots.spot(f, w).iter().enumerate() {
                let (y, x) = (yc as usize + i / cs.nx, xc as usize + i % cs.nx);
                image.pix[[y, x]] += (100.0 * v) as f32;
            }
        }
    }
    let options = SolveOptions {
        regularize: 0.0,
        psferr: 0.01,
        model: false,
        reject_outliers: None,
    };
    // a middle sub-bundle: the full 7 fibers x 74 bins = 518 unknowns
    let patch = plan
        .patches
        .iter()
        .find(|p| p.fibers.start == 10 && p.waves.start == 100)
        .expect("patch");
    c.bench_function("solve_patch 7x74", |b| {
        b.iter(|| solve_patch(&plan, patch, &spots, &image, &options))
    });
}

/// The spots of one fiber at every bin of a full r-camera grid (5760-7620 A at 0.8 A, with
/// the plan's padding), on one thread: a 25th of a bundle's spot evaluation.
fn bench_spots(c: &mut Criterion) {
    let psf = GaussHermitePsf::read(
        &Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/data/psf-r0-00067784.fits"),
    )
    .expect("bundled PSF");
    let plan = Plan::new(PlanOptions::new(5760.0, 7620.0, 0.8, 0, 25)).expect("plan");
    let mut spots = psf.spots(10..11, &plan.fullwave);
    c.bench_function("spots 1 fiber x full grid", |b| {
        b.iter(|| psf.spots_into(10..11, &plan.fullwave, &mut spots))
    });
}

criterion_group! {
    name = benches;
    config = Criterion::default().sample_size(20);
    targets = bench_patch, bench_spots
}
criterion_main!(benches);
