//! The CCD image of a simulation: the rectangle that holds signal, the noiseless projection
//! of the truth through the PSF, and the photon and read noise drawn on it.

use std::ops::Range;

use ndarray::{s, Array2, ArrayView2, Zip};
use rand::RngExt;
use rand_distr::{Distribution, Poisson, StandardNormal};
use rayon::prelude::*;

use crate::error::{Error, Result};
use crate::psf::GaussHermitePsf;

use super::{stream_rng, SimulateOptions, MASK_BAD, STREAM_NOISE};

/// The rectangle of the CCD that holds signal.
#[derive(Clone, Debug)]
pub(super) struct Region {
    pub(super) rows: Range<usize>,
    pub(super) cols: Range<usize>,
}

/// The region with signal: the bounding box of every spot plus the margin, clipped to the CCD;
/// an error when no spot reaches the CCD.
pub(super) fn signal_region(
    psf: &GaussHermitePsf,
    fibers: &Range<usize>,
    wave: &[f64],
    opts: &SimulateOptions,
) -> Result<Region> {
    let (nrows, ncols) = (psf.npix_y, psf.npix_x);
    let corners = psf.corners(fibers.clone(), wave);
    let (ny, nx) = (corners.ny as i64, corners.nx as i64);
    let margin = opts.margin as i64;
    let clip =
        |lo: i64, hi: i64, n: usize| lo.clamp(0, n as i64) as usize..hi.clamp(0, n as i64) as usize;
    let xmin = corners.xc.iter().copied().min().unwrap_or(0) as i64;
    let xmax = corners.xc.iter().copied().max().unwrap_or(0) as i64 + nx;
    let ymin = corners.yc.iter().copied().min().unwrap_or(0) as i64;
    let ymax = corners.yc.iter().copied().max().unwrap_or(0) as i64 + ny;
    let rows = clip(ymin - margin, ymax + margin, nrows);
    let cols = clip(xmin - margin, xmax + margin, ncols);
    if rows.is_empty() || cols.is_empty() {
        return Err(Error::config(format!(
            "the spots of fibers {fibers:?} at {}..{} A all fall off the {nrows} x {ncols} CCD",
            opts.wmin, opts.wmax
        )));
    }
    Ok(Region { rows, cols })
}

/// IMAGE, IVAR and MASK of a `nrows x ncols` CCD from the noiseless `model` of the region:
/// Poisson photon noise and Gaussian read noise (unless `opts.noise` is off) drawn from one
/// stream per CCD row, IVAR of the model plus read noise, and everything outside the region
/// masked.
pub(super) fn observe(
    model: &Array2<f64>,
    region: &Region,
    nrows: usize,
    ncols: usize,
    opts: &SimulateOptions,
) -> (Array2<f32>, Array2<f32>, Array2<i32>) {
    let Region { rows, cols } = region;
    let mut image = Array2::<f32>::zeros((nrows, ncols));
    let mut ivar = Array2::<f32>::zeros((nrows, ncols));
    let mut mask = Array2::from_elem((nrows, ncols), MASK_BAD);
    let read_var = opts.read_noise * opts.read_noise;
    let window = s![rows.clone(), cols.clone()];
    Zip::indexed(image.slice_mut(window).rows_mut())
        .and(ivar.slice_mut(window).rows_mut())
        .and(mask.slice_mut(window).rows_mut())
        .and(model.rows())
        .par_for_each(|i, mut image, mut ivar, mut mask, model| {
            let row = rows.start + i;
            let mut rng = stream_rng(opts.seed, STREAM_NOISE, row as u64);
            for (col, &m) in model.iter().enumerate() {
                let var = m + read_var;
                let value = if opts.noise {
                    let photons = if m > 0.0 {
                        Poisson::new(m).map(|p| p.sample(&mut rng)).unwrap_or(m)
                    } else {
                        0.0
                    };
                    let read: f64 = rng.sample(StandardNormal);
                    photons + opts.read_noise * read
                } else {
                    m
                };
                image[col] = value as f32;
                ivar[col] = if var > 0.0 { (1.0 / var) as f32 } else { 0.0 };
                mask[col] = 0;
            }
        });
    (image, ivar, mask)
}

/// The spots of one fiber summed with their truth weights into the bounding box of that fiber.
struct Stripe {
    row0: i64,
    col0: i64,
    /// `[row - row0, col - col0]`.
    data: Array2<f64>,
}

/// The noiseless image of the region: sum over fibers and bins of truth times spot.
///
/// Fibers are evaluated in parallel, a chunk at a time (spots of one fiber over a whole frame
/// are a few MB), each into its own stripe; the stripes are then added row by row in fiber
/// order, so every pixel sums its contributions in the same order whatever the threads.
pub(super) fn project(
    psf: &GaussHermitePsf,
    fibers: &Range<usize>,
    wave: &[f64],
    flux: &[f64],
    region: &Region,
) -> Array2<f64> {
    let (rw, cw) = (region.rows.len(), region.cols.len());
    let mut model = Array2::zeros((rw, cw));
    let nwave = wave.len();
    let chunk = 4 * rayon::current_num_threads().max(1);
    let all: Vec<usize> = fibers.clone().collect();
    for block in all.chunks(chunk) {
        let stripes: Vec<Stripe> = block
            .par_iter()
            .map(|&fiber| {
                let i = fiber - fibers.start;
                stripe(psf, fiber, wave, &flux[i * nwave..(i + 1) * nwave])
            })
            .collect();
        Zip::indexed(model.rows_mut()).par_for_each(|r, mut out| {
            let row = (region.rows.start + r) as i64;
            for s in &stripes {
                if row < s.row0 || row >= s.row0 + s.data.nrows() as i64 {
                    continue;
                }
                let src = s.data.row((row - s.row0) as usize);
                for (j, &v) in src.iter().enumerate() {
                    let col = s.col0 + j as i64 - region.cols.start as i64;
                    if col >= 0 && (col as usize) < cw {
                        out[col as usize] += v;
                    }
                }
            }
        });
    }
    model
}

fn stripe(psf: &GaussHermitePsf, fiber: usize, wave: &[f64], flux: &[f64]) -> Stripe {
    let spots = psf.spots(fiber..fiber + 1, wave);
    let c = &spots.corners;
    let (ny, nx) = (c.ny, c.nx);
    let col0 = c.xc.iter().copied().min().unwrap_or(0) as i64;
    let row0 = c.yc.iter().copied().min().unwrap_or(0) as i64;
    let ncols = (c.xc.iter().copied().max().unwrap_or(0) as i64 - col0) as usize + nx;
    let nrows = (c.yc.iter().copied().max().unwrap_or(0) as i64 - row0) as usize + ny;
    let mut data = Array2::zeros((nrows, ncols));
    for (iw, &t) in flux.iter().enumerate() {
        if t == 0.0 {
            continue;
        }
        let (xc, yc) = c.corner(0, iw);
        let (x0, y0) = ((xc as i64 - col0) as usize, (yc as i64 - row0) as usize);
        let spot = ArrayView2::from_shape((ny, nx), spots.spot(0, iw))
            .expect("a spot holds ny x nx values");
        data.slice_mut(s![y0..y0 + ny, x0..x0 + nx])
            .zip_mut_with(&spot, |o, &s| *o += t * s);
    }
    Stripe { row0, col0, data }
}
