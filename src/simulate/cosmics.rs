//! Cosmic-ray tracks on a simulated CCD, and those that the preproc MASK misses (`spex
//! simulate --unmasked-cosmics F`): a fraction of the tracks is left out of the MASK and keeps
//! the IVAR of the light beneath it, as a track that preprocessing did not detect would, to
//! test outlier rejection.

use ndarray::Array2;
use rand::rngs::StdRng;
use rand::RngExt;
use rand_distr::{Distribution, Poisson};

use super::ccd::Region;
use super::{stream_rng, SimulateOptions, MASK_COSMIC, STREAM_COSMIC};

/// Random stream of the choice of unmasked tracks: its own, so that the tracks themselves
/// (positions, charges) do not depend on the fraction.
const STREAM_UNMASKED: u64 = 4;

/// Chooses, track after track, whether a track is masked.
pub(super) struct TrackMasking {
    rng: StdRng,
    unmasked: f64,
}

impl TrackMasking {
    /// For a simulation's seed and the fraction of tracks to leave out of the MASK.
    pub(super) fn new(seed: u64, unmasked: f64) -> Self {
        TrackMasking {
            rng: stream_rng(seed, STREAM_UNMASKED, 0),
            unmasked,
        }
    }

    /// Whether the next track is masked (MASK bit and IVAR 0).
    pub(super) fn next_is_masked(&mut self) -> bool {
        if self.unmasked <= 0.0 {
            return true;
        }
        self.rng.random_range(0.0..1.0) >= self.unmasked
    }
}

/// Adds cosmic-ray tracks inside the region: short straight segments (1.5 to 8 pixels, any
/// direction) that deposit hundreds to thousands of electrons per pixel; their pixels get
/// [`MASK_COSMIC`] and IVAR 0. Returns the number of tracks.
pub(super) fn add_cosmics(
    image: &mut Array2<f32>,
    ivar: &mut Array2<f32>,
    mask: &mut Array2<i32>,
    region: &Region,
    opts: &SimulateOptions,
) -> usize {
    let area = (region.rows.len() * region.cols.len()) as f64;
    let expected = opts.cosmic_density * area * 1e-6;
    if expected <= 0.0 {
        return 0;
    }
    let mut rng = stream_rng(opts.seed, STREAM_COSMIC, 0);
    let ntrack = Poisson::new(expected)
        .map(|p| p.sample(&mut rng))
        .unwrap_or(expected)
        .round() as usize;
    let (r0, r1) = (region.rows.start as f64, region.rows.end as f64);
    let (c0, c1) = (region.cols.start as f64, region.cols.end as f64);
    let mut pixels: Vec<(i64, i64)> = Vec::with_capacity(16);
    let mut masking = TrackMasking::new(opts.seed, opts.unmasked_cosmics);
    for _ in 0..ntrack {
        let masked = masking.next_is_masked();
        let x0 = rng.random_range(c0 - 0.5..c1 - 0.5);
        let y0 = rng.random_range(r0 - 0.5..r1 - 0.5);
        let angle: f64 = rng.random_range(0.0..std::f64::consts::PI);
        let length: f64 = rng.random_range(1.5..8.0);
        let charge: f64 = rng.random_range(300.0..3000.0);
        let (dx, dy) = (angle.cos(), angle.sin());
        let nstep = (4.0 * length).ceil() as usize;
        pixels.clear();
        for k in 0..=nstep {
            let t = length * k as f64 / nstep as f64;
            let p = ((x0 + t * dx).round() as i64, (y0 + t * dy).round() as i64);
            if !pixels.contains(&p) {
                pixels.push(p);
            }
        }
        for &(col, row) in &pixels {
            if col < 0 || row < 0 {
                continue;
            }
            let (col, row) = (col as usize, row as usize);
            if !region.rows.contains(&row) || !region.cols.contains(&col) {
                continue;
            }
            let i = [row, col];
            // Charge shared along the track, with some pixel-to-pixel variation.
            image[i] += (charge * rng.random_range(0.5..1.5)) as f32;
            if masked {
                ivar[i] = 0.0;
                mask[i] |= MASK_COSMIC;
            }
        }
    }
    ntrack
}
