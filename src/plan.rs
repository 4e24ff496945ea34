//! The divide-and-conquer plan of a frame: the output wavelength grid, its padded version,
//! bundles, sub-bundles and the patches (one sub-bundle by `nwavestep` output bins) that are
//! solved independently. Nothing here depends on pixels or on the backend.

use std::ops::Range;

use crate::error::{number, Error, Result};

/// User-level choices that shape the plan (gpu_specter / desispec option names).
#[derive(Clone, Debug, PartialEq)]
pub struct PlanOptions {
    /// Output grid `wmin, wmax, dw` (inclusive of wmax within half a bin).
    pub wmin: f64,
    pub wmax: f64,
    pub dw: f64,
    pub specmin: usize,
    pub nspec: usize,
    pub layout: PatchLayout,
}

impl PlanOptions {
    /// The defaults of gpu_specter and desispec for everything but the wavelength grid and the
    /// fiber range.
    pub fn new(wmin: f64, wmax: f64, dw: f64, specmin: usize, nspec: usize) -> Self {
        PlanOptions {
            wmin,
            wmax,
            dw,
            specmin,
            nspec,
            layout: PatchLayout::default(),
        }
    }
}

/// How a frame is cut into patches and how much each patch is padded: the choices that do not
/// depend on the PSF (a request carries them as they are, while its wavelength grid and fiber
/// range are resolved against the PSF).
#[derive(Clone, Debug, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct PatchLayout {
    pub bundlesize: usize,
    pub nsubbundles: usize,
    pub nwavestep: usize,
    pub wavepad: usize,
    pub wavepad_frac: f64,
    pub pixpad_frac: f64,
}

impl Default for PatchLayout {
    /// The defaults of gpu_specter and desispec.
    fn default() -> Self {
        PatchLayout {
            bundlesize: 25,
            nsubbundles: 5,
            nwavestep: 50,
            wavepad: 10,
            wavepad_frac: 0.2,
            pixpad_frac: 0.8,
        }
    }
}

/// Most wavelength bins a patch may solve (`nwavestep + 2 P`): the patch's normal equations
/// grow with its square and their factorisation with its cube, so a mistyped `--nwavestep`
/// or `--wavepad` would otherwise run for hours or exhaust memory. gpu_specter's defaults
/// solve 74 bins.
pub const MAX_PATCH_BINS: usize = 300;

/// Most output wavelength bins of a frame (a DESI camera has about 2300 at 0.8 A).
pub const MAX_OUTPUT_BINS: usize = 1_000_000;

impl PatchLayout {
    /// The effective padding `P = wavepad + floor(wavepad * wavepad_frac)`, `None` when it
    /// does not fit a `usize`.
    pub fn effective_wavepad(&self) -> Option<usize> {
        let extra = (self.wavepad as f64 * self.wavepad_frac).floor();
        if !(extra >= 0.0 && extra < usize::MAX as f64) {
            return None;
        }
        self.wavepad.checked_add(extra as usize)
    }

    /// Bins solved per patch, `nwavestep + 2 P`, `None` on overflow.
    pub fn nwavetot(&self) -> Option<usize> {
        let pad = self.effective_wavepad()?;
        pad.checked_mul(2)?.checked_add(self.nwavestep)
    }

    /// Checks every value and that a patch solves at most [`MAX_PATCH_BINS`] bins.
    pub fn check(&self) -> Result<()> {
        if self.bundlesize == 0 || self.nsubbundles == 0 || self.nwavestep == 0 {
            return Err(Error::config(
                "bundlesize, nsubbundles and nwavestep must be positive",
            ));
        }
        if self.bundlesize % self.nsubbundles != 0 {
            return Err(Error::config(format!(
                "bundlesize ({}) must be divisible by nsubbundles ({})",
                self.bundlesize, self.nsubbundles
            )));
        }
        let pixpad_ok = (0.0..=1.0).contains(&self.pixpad_frac);
        let wavepad_ok = self.wavepad_frac >= 0.0 && self.wavepad_frac.is_finite();
        if !(pixpad_ok && wavepad_ok) {
            return Err(Error::config(format!(
                "pixpad-frac ({}) must be in [0, 1] and wavepad-frac ({}) finite and non-negative",
                self.pixpad_frac, self.wavepad_frac
            )));
        }
        match self.nwavetot() {
            Some(n) if n <= MAX_PATCH_BINS => Ok(()),
            _ => Err(Error::config(format!(
                "nwavestep ({}) + 2 x padding (wavepad {} + wavepad-frac {}) must be at most {MAX_PATCH_BINS} bins per patch",
                self.nwavestep, self.wavepad, self.wavepad_frac
            ))),
        }
    }
}

/// Checks an output grid `wmin, wmax, dw`: finite, `dw > 0`, `wmax >= wmin`, and at most
/// [`MAX_OUTPUT_BINS`] bins.
pub fn check_grid(wmin: f64, wmax: f64, dw: f64) -> Result<()> {
    if !dw.is_finite() || !(dw > 0.0) {
        return Err(Error::config(format!(
            "wavelength step dw = {} must be finite and positive",
            number(dw)
        )));
    }
    let (lo, hi) = (number(wmin), number(wmax));
    if !wmin.is_finite() || !wmax.is_finite() || !(wmax >= wmin) {
        return Err(Error::config(format!(
            "wavelength range {lo}..{hi} is empty or not finite"
        )));
    }
    let nbins = (wmax - wmin) / dw + 1.5;
    if !(nbins <= MAX_OUTPUT_BINS as f64) {
        return Err(Error::config(format!(
            "{lo}..{hi} in steps of {} is more than {MAX_OUTPUT_BINS} wavelength bins",
            number(dw)
        )));
    }
    Ok(())
}

/// One patch: a sub-bundle of fibers by `nwavestep` output bins, with its padding.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Patch {
    /// Index of this patch in the plan (stable across ranks and backends).
    pub index: usize,
    /// First fiber of the bundle the patch belongs to (absolute fiber number).
    pub bundle_start: usize,
    /// Core fibers (absolute).
    pub fibers: Range<usize>,
    /// Fibers solved together: the core plus one neighbour on each side inside the bundle.
    pub padded_fibers: Range<usize>,
    /// Output bins written by this patch (indices of the output grid); the last patch of a
    /// row is narrower when `nwave` is not a multiple of `nwavestep`.
    pub waves: Range<usize>,
    /// First bin of the padded wavelength window, as an index of the padded grid.
    pub padded_wave_start: usize,
}

impl Patch {
    /// Number of fibers solved together.
    pub fn nspecpad(&self) -> usize {
        self.padded_fibers.len()
    }
}

/// The plan of a frame extraction.
#[derive(Clone, Debug)]
pub struct Plan {
    pub options: PlanOptions,
    /// Output wavelength grid.
    pub wave: Vec<f64>,
    /// Padded grid: `wavepad` bins before `wave`, `wave`, then `wavepad + nwavestep` bins.
    pub fullwave: Vec<f64>,
    /// Effective wavelength padding `P = wavepad + floor(wavepad * wavepad_frac)`.
    pub wavepad: usize,
    /// Bins solved per patch: `nwavestep + 2 P`.
    pub nwavetot: usize,
    pub patches: Vec<Patch>,
}

impl Plan {
    /// Validates the options and lays out every patch of the frame.
    pub fn new(options: PlanOptions) -> Result<Self> {
        let o = &options;
        let l = &o.layout;
        check_grid(o.wmin, o.wmax, o.dw)?;
        l.check()?;
        if o.nspec == 0 || o.specmin.checked_add(o.nspec).is_none() {
            return Err(Error::config(format!(
                "nspec ({}) must be positive and specmin ({}) + nspec a fiber number",
                o.nspec, o.specmin
            )));
        }
        let covering = covering_bundles(o.specmin..o.specmin + o.nspec, l.bundlesize)
            .ok_or_else(|| Error::config("the bundles of the fiber range overflow"))?;
        let wave = output_grid(o.wmin, o.wmax, o.dw);
        let wavepad = l
            .effective_wavepad()
            .ok_or_else(|| Error::config("wavelength padding overflows"))?;
        let fullwave = padded_grid(&wave, o.dw, wavepad, l.nwavestep);
        let nwave = wave.len();

        let nper = l.bundlesize / l.nsubbundles;
        let mut patches = Vec::new();
        let wanted = o.specmin..o.specmin + o.nspec;
        for bundle_start in covering.step_by(l.bundlesize) {
            let bundle_end = bundle_start + l.bundlesize;
            for sub in (bundle_start..bundle_end).step_by(nper) {
                let fibers = sub..sub + nper;
                // A sub-bundle without a requested fiber is not solved; one with some is
                // solved whole, with the neighbours of a full extraction.
                if fibers.end <= wanted.start || fibers.start >= wanted.end {
                    continue;
                }
                let lo = if sub == bundle_start { sub } else { sub - 1 };
                let hi = if fibers.end == bundle_end {
                    fibers.end
                } else {
                    fibers.end + 1
                };
                for start in (0..nwave).step_by(l.nwavestep) {
                    patches.push(Patch {
                        index: patches.len(),
                        bundle_start,
                        fibers: fibers.clone(),
                        padded_fibers: lo..hi,
                        waves: start..(start + l.nwavestep).min(nwave),
                        padded_wave_start: start,
                    });
                }
            }
        }
        Ok(Plan {
            nwavetot: l.nwavestep + 2 * wavepad,
            wavepad,
            wave,
            fullwave,
            patches,
            options,
        })
    }

    /// Number of output bins.
    pub fn nwave(&self) -> usize {
        self.wave.len()
    }

    /// Fibers of the frame (the requested ones).
    pub fn fibers(&self) -> Range<usize> {
        self.options.specmin..self.options.specmin + self.options.nspec
    }

    /// Fibers whose spots the patches use: the requested fibers' sub-bundles with their
    /// neighbours, inside the bundles that cover the requested fibers.
    pub fn solved_fibers(&self) -> Range<usize> {
        let lo = self.patches.iter().map(|p| p.padded_fibers.start).min();
        let hi = self.patches.iter().map(|p| p.padded_fibers.end).max();
        lo.unwrap_or(0)..hi.unwrap_or(0)
    }

    /// Bundles that cover the frame's fibers, as absolute fiber ranges: bundles start at
    /// multiples of `bundlesize`, as in a full extraction.
    pub fn bundles(&self) -> Vec<Range<usize>> {
        let o = &self.options;
        let bs = o.layout.bundlesize;
        covering_bundles(self.fibers(), bs)
            .map_or_else(Vec::new, |c| c.step_by(bs).map(|s| s..s + bs).collect())
    }

    /// One line for logs: fibers, output grid and number of patches.
    pub fn summary(&self) -> String {
        format!(
            "fibers {}..{}, {} bins {:.1}..{:.1} A, {} patches",
            self.options.specmin,
            self.options.specmin + self.options.nspec,
            self.nwave(),
            self.wave[0],
            self.wave[self.nwave() - 1],
            self.patches.len()
        )
    }

    /// The padded-grid wavelengths solved by a patch.
    pub fn patch_waves(&self, patch: &Patch) -> Range<usize> {
        patch.padded_wave_start..patch.padded_wave_start + self.nwavetot
    }
}

/// The fibers of the bundles that hold `fibers`: from the bundle boundary at or below its
/// start to the one at or above its end (`None` on overflow).
fn covering_bundles(fibers: Range<usize>, bundlesize: usize) -> Option<Range<usize>> {
    let start = fibers.start / bundlesize * bundlesize;
    let end = fibers.end.checked_next_multiple_of(bundlesize)?;
    Some(start..end)
}

/// The output grid exactly as desispec builds it, `np.arange(wmin, wmax + 0.5*dw, dw)`: numpy
/// takes `ceil((stop - wmin) / dw)` values, sets the first two to `wmin` and `wmin + dw` and
/// fills the rest with `wmin + i * delta`, where `delta = (wmin + dw) - wmin` is the step as
/// rounded at `wmin` (0.8000000000001819 for 5760 + 0.8). Frames compare their WAVELENGTH
/// arrays for equality downstream, so the rounding must be numpy's, bit for bit.
pub fn output_grid(wmin: f64, wmax: f64, dw: f64) -> Vec<f64> {
    let stop = wmax + 0.5 * dw;
    let n = ((stop - wmin) / dw).ceil().max(0.0) as usize;
    let second = wmin + dw;
    let delta = second - wmin;
    (0..n)
        .map(|i| match i {
            0 => wmin,
            1 => second,
            _ => wmin + i as f64 * delta,
        })
        .collect()
}

/// The output grid with `pad` bins before it and `pad + nwavestep` bins after it, so that the
/// last, partial patch of a row still has a full padded window. Built as gpu_specter builds
/// it (`wavelo = arange(pad)*dw - (max + dw) + wmin`, `wavehi = wave[-1] + (1 + arange)*dw`),
/// so that the spots of the padding bins are evaluated at the same wavelengths.
pub fn padded_grid(wave: &[f64], dw: f64, pad: usize, nwavestep: usize) -> Vec<f64> {
    let wmin = wave[0];
    let wlast = wave[wave.len() - 1];
    let mut full = Vec::with_capacity(wave.len() + 2 * pad + nwavestep);
    if pad > 0 {
        let below = (pad - 1) as f64 * dw + dw;
        full.extend((0..pad).map(|i| (i as f64 * dw - below) + wmin));
    }
    full.extend_from_slice(wave);
    full.extend((0..pad + nwavestep).map(|i| wlast + (1.0 + i as f64) * dw));
    full
}

#[cfg(test)]
mod tests {
    use super::*;

    fn plan(nwave_end: f64) -> Plan {
        Plan::new(PlanOptions::new(6000.0, nwave_end, 0.8, 25, 50)).unwrap()
    }

    /// Values of `np.arange(wmin, wmax + 0.5*dw, dw)` from numpy 2.4.6 for desi_proc's three
    /// camera ranges: the length, element 1000 and the last element, as IEEE-754 bits.
    /// `(wmin, wmax, dw)`, length, bits of element 1000, bits of the last element.
    type ArangeCase = ((f64, f64, f64), usize, u64, u64);
    const NUMPY_ARANGE: [ArangeCase; 3] = [
        (
            (3600.0, 5800.0, 0.8),
            2751,
            0x40b13000000000c8,
            0x40b6a80000000226,
        ),
        (
            (5760.0, 7620.0, 0.8),
            2326,
            0x40b9a000000000c8,
            0x40bdc400000001d1,
        ),
        (
            (7520.0, 9824.0, 0.8),
            2881,
            0x40c0400000000064,
            0x40c3300000000120,
        ),
    ];

    #[test]
    fn grid_is_numpy_arange_bit_for_bit() {
        for ((wmin, wmax, dw), n, at1000, last) in NUMPY_ARANGE {
            let w = output_grid(wmin, wmax, dw);
            assert_eq!(w.len(), n, "{wmin},{wmax},{dw}");
            assert_eq!(w[1000].to_bits(), at1000, "{wmin},{wmax},{dw}: w[1000]");
            assert_eq!(w[n - 1].to_bits(), last, "{wmin},{wmax},{dw}: last");
            // the naive wmin + i*dw would not do: numpy's step is rounded at wmin
            assert_ne!((wmin + 1000.0 * dw).to_bits(), at1000);
        }
        let w = output_grid(6000.0, 6400.0, 0.8);
        assert_eq!(w.len(), 501);
        assert!((w[500] - 6400.0).abs() < 1e-9);
        assert_eq!(output_grid(6000.0, 6000.0, 0.8), vec![6000.0]);
    }

    #[test]
    fn padded_grid_is_uniform() {
        let p = plan(6400.0);
        assert_eq!(p.wavepad, 12);
        assert_eq!(p.fullwave.len(), 501 + 12 + 12 + 50);
        for pair in p.fullwave.windows(2) {
            assert!((pair[1] - pair[0] - 0.8).abs() < 1e-9);
        }
        assert!((p.fullwave[12] - 6000.0).abs() < 1e-12);
    }

    #[test]
    fn patches_pad_fibers_inside_bundles_only() {
        let p = plan(6400.0);
        // 2 bundles x 5 sub-bundles x 11 wave steps (501 bins / 50)
        assert_eq!(p.patches.len(), 2 * 5 * 11);
        let first = &p.patches[0];
        assert_eq!(first.fibers, 25..30);
        assert_eq!(first.padded_fibers, 25..31);
        let middle = p.patches.iter().find(|q| q.fibers.start == 35).unwrap();
        assert_eq!(middle.padded_fibers, 34..41);
        let last_sub = p.patches.iter().find(|q| q.fibers.start == 45).unwrap();
        assert_eq!(last_sub.padded_fibers, 44..50);
        let second_bundle = p.patches.iter().find(|q| q.fibers.start == 50).unwrap();
        assert_eq!(second_bundle.padded_fibers, 50..56);
    }

    #[test]
    fn any_fiber_range_solves_its_sub_bundles_as_the_full_frame_does() {
        let full = Plan::new(PlanOptions::new(6000.0, 6400.0, 0.8, 0, 75)).unwrap();
        for (specmin, nspec) in [(7, 1), (22, 6), (74, 1), (3, 25), (0, 75)] {
            let p = Plan::new(PlanOptions::new(6000.0, 6400.0, 0.8, specmin, nspec)).unwrap();
            let wanted = specmin..specmin + nspec;
            // the patches are exactly the full plan's patches whose core meets the range
            let expect: Vec<_> = full
                .patches
                .iter()
                .filter(|q| q.fibers.start < wanted.end && wanted.start < q.fibers.end)
                .collect();
            assert_eq!(p.patches.len(), expect.len(), "{wanted:?}");
            for (q, e) in p.patches.iter().zip(expect) {
                assert_eq!(
                    (&q.fibers, &q.padded_fibers, q.bundle_start, &q.waves),
                    (&e.fibers, &e.padded_fibers, e.bundle_start, &e.waves)
                );
            }
            assert_eq!(p.fibers(), wanted);
            let covered = p.bundles();
            assert!(covered[0].start <= specmin && covered.last().unwrap().end >= wanted.end);
            assert!(covered.iter().all(|b| b.start % 25 == 0 && b.len() == 25));
        }
        let crossing = Plan::new(PlanOptions::new(6000.0, 6400.0, 0.8, 22, 6)).unwrap();
        assert_eq!(crossing.bundles(), vec![0..25, 25..50]);
        assert_eq!(crossing.solved_fibers(), 19..31);
    }

    #[test]
    fn last_patch_of_a_row_is_partial() {
        let p = plan(6400.0);
        let row: Vec<_> = p.patches.iter().filter(|q| q.fibers.start == 25).collect();
        assert_eq!(row.len(), 11);
        assert_eq!(row[10].waves, 500..501);
        assert_eq!(p.patch_waves(row[10]), 500..574);
        assert!(p.patch_waves(row[10]).end <= p.fullwave.len());
        // bins are covered exactly once
        let covered: usize = row.iter().map(|q| q.waves.len()).sum();
        assert_eq!(covered, 501);
    }

    #[test]
    fn patch_size_and_padding_are_bounded_without_overflow() {
        let mut l = PatchLayout::default();
        assert_eq!(l.nwavetot(), Some(74));
        assert!(l.check().is_ok());
        l.wavepad = usize::MAX;
        assert_eq!(l.nwavetot(), None);
        assert!(l.check().is_err());
        l = PatchLayout::default();
        l.nwavestep = MAX_PATCH_BINS - 2 * 12 + 1;
        assert!(l.check().is_err());
        l.nwavestep -= 1;
        assert!(l.check().is_ok());
        l.wavepad_frac = 1e300;
        assert!(l.check().is_err());
        assert!(check_grid(6000.0, 6400.0, f64::INFINITY).is_err());
        assert!(check_grid(1.0, 1e300, 0.8).is_err());
        assert!(check_grid(6000.0, 6400.0, 0.8).is_ok());
    }

    #[test]
    fn invalid_options_are_rejected() {
        let base = PlanOptions::new(6000.0, 6400.0, 0.8, 0, 25);
        let mut o = base.clone();
        o.dw = 0.0;
        assert!(Plan::new(o).is_err());
        let mut o = base.clone();
        o.nspec = 0;
        assert!(Plan::new(o).is_err());
        let mut o = base.clone();
        o.specmin = usize::MAX - 3;
        assert!(Plan::new(o).is_err());
        let mut o = base.clone();
        o.layout.nsubbundles = 4;
        assert!(Plan::new(o).is_err());
        let mut o = base;
        o.wmax = 5000.0;
        assert!(Plan::new(o).is_err());
    }
}
