//! Colour scales of the quick-look picture: robust limits from percentiles, a perceptually
//! uniform map (viridis) for positive quantities, a diverging one for residuals, and the
//! colours of the MASK bits.

use plotters::style::RGBColor;

use crate::frame::specmask;

/// Bins without data (ivar 0) and pixels without weight.
pub const MISSING: RGBColor = RGBColor(150, 150, 150);

/// specmask COSMIC, set by `--reject-outliers`.
const COSMIC: u32 = 1 << 2;

/// The MASK colours in order of precedence, with the names shown in the legend.
pub const MASK_COLOURS: [(u32, &str, RGBColor); 4] = [
    (specmask::ALLBADPIX, "ALLBADPIX", RGBColor(214, 39, 40)),
    (specmask::SOMEBADPIX, "SOMEBADPIX", RGBColor(255, 153, 0)),
    (COSMIC, "COSMIC", RGBColor(23, 190, 207)),
    (specmask::BAD2DFIT, "BAD2DFIT", RGBColor(148, 103, 189)),
];
/// A bin without any MASK bit.
pub const MASK_CLEAR: RGBColor = RGBColor(235, 235, 235);
/// A bin with only bits other than those of [`MASK_COLOURS`].
pub const MASK_OTHER: RGBColor = RGBColor(0, 0, 0);

/// Viridis at ten evenly spaced points (matplotlib's values).
const VIRIDIS: [(u8, u8, u8); 10] = [
    (68, 1, 84),
    (72, 40, 120),
    (62, 74, 137),
    (49, 104, 142),
    (38, 130, 142),
    (31, 158, 137),
    (53, 183, 121),
    (109, 205, 89),
    (180, 222, 44),
    (253, 231, 37),
];

/// Blue, white, red (ColorBrewer's RdBu reversed) for signed values.
const DIVERGING: [(u8, u8, u8); 5] = [
    (33, 102, 172),
    (103, 169, 207),
    (247, 247, 247),
    (239, 138, 98),
    (178, 24, 43),
];

/// A linear scale from `lo` to `hi` onto a colour map; values outside are clipped.
#[derive(Clone, Copy, Debug)]
pub struct Scale {
    pub lo: f64,
    pub hi: f64,
    diverging: bool,
}

impl Scale {
    /// Viridis from the `lo_q` to the `hi_q` quantile of the finite `values`, `None` when
    /// there is none. A constant set gets a unit-wide scale around its value.
    pub fn percentiles(values: &[f64], lo_q: f64, hi_q: f64) -> Option<Scale> {
        let mut v: Vec<f64> = values.iter().copied().filter(|x| x.is_finite()).collect();
        if v.is_empty() {
            return None;
        }
        v.sort_by(f64::total_cmp);
        let at = |q: f64| v[((v.len() - 1) as f64 * q).round() as usize];
        Some(Scale::linear(at(lo_q), at(hi_q)))
    }

    /// Viridis from `lo` to `hi`.
    pub fn linear(lo: f64, hi: f64) -> Scale {
        let (lo, hi) = if hi > lo {
            (lo, hi)
        } else {
            (lo - 0.5, lo + 0.5)
        };
        Scale {
            lo,
            hi,
            diverging: false,
        }
    }

    /// Blue (`-limit`), white (0), red (`limit`).
    pub fn diverging(limit: f64) -> Scale {
        Scale {
            lo: -limit,
            hi: limit,
            diverging: true,
        }
    }

    /// The colour of `value`; [`MISSING`] for NaN.
    pub fn colour(&self, value: f64) -> RGBColor {
        if value.is_nan() {
            return MISSING;
        }
        let t = ((value - self.lo) / (self.hi - self.lo)).clamp(0.0, 1.0);
        if self.diverging {
            interpolate(&DIVERGING, t)
        } else {
            interpolate(&VIRIDIS, t)
        }
    }
}

/// The colour at `t` in 0..=1 along evenly spaced `stops`.
fn interpolate(stops: &[(u8, u8, u8)], t: f64) -> RGBColor {
    let x = t * (stops.len() - 1) as f64;
    let i = (x.floor() as usize).min(stops.len() - 2);
    let f = x - i as f64;
    let mix = |a: u8, b: u8| (f64::from(a) + f * (f64::from(b) - f64::from(a))).round() as u8;
    let (a, b) = (stops[i], stops[i + 1]);
    RGBColor(mix(a.0, b.0), mix(a.1, b.1), mix(a.2, b.2))
}

/// The colour of a bin's MASK value.
pub fn mask_colour(mask: u32) -> RGBColor {
    if mask == 0 {
        return MASK_CLEAR;
    }
    MASK_COLOURS
        .iter()
        .find(|(bit, _, _)| mask & bit != 0)
        .map_or(MASK_OTHER, |&(_, _, c)| c)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn percentiles_ignore_non_finite_values_and_clip_the_tails() {
        let mut v: Vec<f64> = (0..=100).map(f64::from).collect();
        v.push(f64::NAN);
        v.push(1e30);
        let s = Scale::percentiles(&v, 0.01, 0.99).unwrap();
        // 102 finite values: the 1st percentile is the value at index 1, the 99th at 100.
        assert_eq!((s.lo, s.hi), (1.0, 100.0));
        assert_eq!(s.colour(-5.0), s.colour(1.0));
        assert_eq!(s.colour(1e30), s.colour(100.0));
        assert_ne!(s.colour(1.0), s.colour(100.0));
        assert!(Scale::percentiles(&[f64::NAN], 0.01, 0.99).is_none());
    }

    #[test]
    fn scale_ends_are_the_maps_ends() {
        let s = Scale::linear(0.0, 1.0);
        assert_eq!(s.colour(0.0), RGBColor(68, 1, 84));
        assert_eq!(s.colour(1.0), RGBColor(253, 231, 37));
        assert_eq!(s.colour(f64::NAN), MISSING);
        let d = Scale::diverging(5.0);
        assert_eq!(d.colour(0.0), RGBColor(247, 247, 247));
        assert_eq!(d.colour(-9.0), RGBColor(33, 102, 172));
    }

    #[test]
    fn mask_colours_follow_precedence() {
        let all = specmask::ALLBADPIX | specmask::SOMEBADPIX;
        assert_eq!(mask_colour(all), MASK_COLOURS[0].2);
        assert_eq!(mask_colour(specmask::BAD2DFIT), MASK_COLOURS[3].2);
        assert_eq!(mask_colour(1 << 20), MASK_OTHER);
        assert_eq!(mask_colour(0), MASK_CLEAR);
    }
}
