//! Time to write a full r frame (500 fibers x 2326 bins, 11 resolution diagonals) as
//! desispec's `frame-*.fits`, checksums included: the writer's share of every frame, which
//! a GPU run repeats for each frame at a few times the device's pace. Frames are written one
//! after another into the same directory, as a multi-frame run does, so that the allocator's
//! reuse of the frame-sized buffers counts.

use criterion::{criterion_group, criterion_main, Criterion};
use ndarray::{Array2, Array3};
use spex::frame::{Frame, FrameMeta};

// as in the spex binary
#[global_allocator]
static GLOBAL: mimalloc::MiMalloc = mimalloc::MiMalloc;

fn full_frame() -> Frame {
    let (nspec, nwave, ndiag) = (500, 2326, 5);
    let wave: Vec<f64> = (0..nwave).map(|i| 5760.0 + 0.8 * i as f64).collect();
    let smooth = |f: usize, w: usize| 100.0 + (f as f64 * 0.37 + w as f64 * 0.011).sin();
    Frame {
        specmin: 0,
        nspec,
        wave,
        ndiag,
        flux: Array2::from_shape_fn((nspec, nwave), |(f, w)| smooth(f, w)),
        ivar: Array2::from_shape_fn((nspec, nwave), |(f, w)| 0.01 / smooth(f, w)),
        mask: Array2::zeros((nspec, nwave)),
        resolution: Array3::from_shape_fn((nspec, 2 * ndiag + 1, nwave), |(f, d, w)| {
            smooth(f, w) * 1e-3 * (d + 1) as f64
        }),
        chi2pix: Array2::from_shape_fn((nspec, nwave), |(f, w)| smooth(f, w) * 1e-2),
        pixmask_fraction: Array2::zeros((nspec, nwave)),
    }
}

fn bench_write(c: &mut Criterion) {
    let frame = full_frame();
    let meta = FrameMeta::default();
    let dir = tempfile::tempdir().expect("temporary directory");
    let mut k = 0;
    let mut group = c.benchmark_group("frame");
    group.sample_size(10);
    group.bench_function("write full r frame", |b| {
        b.iter(|| {
            k += 1;
            let path = dir.path().join(format!("frame-{}.fits", k % 4));
            frame.write(&path, &meta).expect("frame written");
        })
    });
    group.finish();
}

criterion_group!(benches, bench_write);
criterion_main!(benches);
