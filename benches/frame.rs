//! The host's share of every frame around the extraction, which a GPU run repeats at a few
//! times the device's pace: reading a full r-camera preproc image (IMAGE, IVAR, MASK of
//! 4128 x 4114 pixels, uncompressed) with its mask rule, and writing a full r frame (500
//! fibers x 2326 bins, 11 resolution diagonals) as desispec's `frame-*.fits`, checksums
//! included, plain and gzip-compressed (desi_proc's `.fits.gz`). Each is repeated in one
//! process, as a multi-frame run does, so that the allocator's reuse of frame-sized buffers
//! counts.

use criterion::{criterion_group, criterion_main, Criterion};
use ndarray::{Array2, Array3};
use spex::fits::Fits;
use spex::frame::{Frame, FrameMeta};
use spex::image::{Image, MaskRule};

// as in the spex binary
#[global_allocator]
static GLOBAL: mimalloc::MiMalloc = mimalloc::MiMalloc;

fn full_frame() -> Frame {
    let (nspec, nwave, ndiag) = (500, 2326, 5);
    let wave: Vec<f64> = (0..nwave).map(|i| 5760.0 + 0.8 * i as f64).collect();
    let smooth = |f: usize, w: usize| 100.0 + (f as f64 * 0.37 + w as f64 * 0.011).sin();
    Frame {
        specmin: 0,
        specmin_recorded: true,
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
    for suffix in ["fits", "fits.gz"] {
        group.bench_function(format!("write full r frame .{suffix}"), |b| {
            b.iter(|| {
                k += 1;
                let path = dir.path().join(format!("frame-{}.{suffix}", k % 4));
                frame.write(&path, &meta).expect("frame written");
            })
        });
    }
    group.finish();
}

/// A preproc image of the r camera's size: a smooth sky with a few masked pixels.
fn write_preproc(path: &std::path::Path) {
    let (ny, nx) = (4128, 4114);
    let pix: Vec<f32> = (0..ny * nx)
        .map(|i| 10.0 + (i % 977) as f32 * 0.01)
        .collect();
    let ivar: Vec<f32> = pix.iter().map(|p| 1.0 / (p + 9.0)).collect();
    let mask: Vec<i32> = (0..ny * nx).map(|i| i32::from(i % 10007 == 0)).collect();
    let mut f = Fits::create(path).expect("preproc created");
    f.write_image("IMAGE", &[ny, nx], &pix).expect("IMAGE");
    f.write_image("IVAR", &[ny, nx], &ivar).expect("IVAR");
    f.write_image("MASK", &[ny, nx], &mask).expect("MASK");
    f.close().expect("preproc closed");
}

fn bench_read(c: &mut Criterion) {
    let dir = tempfile::tempdir().expect("temporary directory");
    let path = dir.path().join("preproc.fits");
    write_preproc(&path);
    let mut group = c.benchmark_group("frame");
    group.sample_size(10);
    group.bench_function("read full r preproc", |b| {
        b.iter(|| Image::read(&path, MaskRule::Bits(767)).expect("preproc read"))
    });
    group.finish();
}

criterion_group!(benches, bench_read, bench_write);
criterion_main!(benches);
