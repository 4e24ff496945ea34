//! Cosmic-ray tracks that the preproc MASK misses (`spex simulate --unmasked-cosmics F`): a
//! fraction of the tracks is left out of the MASK and keeps the IVAR of the light beneath it,
//! as a track that preprocessing did not detect would, to test outlier rejection.

use rand::rngs::StdRng;
use rand::RngExt;

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
            rng: super::stream_rng(seed, STREAM_UNMASKED, 0),
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
