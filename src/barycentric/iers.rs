//! The Earth's orientation the barycentric factor needs, UT1-UTC and the polar motion, as
//! astropy takes them from its IERS tables: the daily values of `iers.txt` (written by
//! `scripts/iers-table` from astropy-iers-data, with its provenance in its header),
//! interpolated linearly as astropy's `IERS.ut1_utc` and `IERS.pm_xy` do.
//!
//! Outside the table (before 2019-01-01 or after its last prediction) spex does what astropy
//! does after its own table under desispec's `freeze_iers`: UT1-UTC keeps the table's
//! nearest value and the polar motion falls back to astropy's 50-year mean
//! (0.035", 0.29"); the caller warns.

use std::sync::OnceLock;

/// The table, compiled in: "MJD UT1-UTC(s) PM_x(arcsec) PM_y(arcsec)" per line.
const TABLE: &str = include_str!("iers.txt");

/// astropy's `_DEFAULT_PM` (arcsec), the polar motion it takes outside its table.
const DEFAULT_PM_ARCSEC: (f64, f64) = (0.035, 0.29);
/// One arcsecond in radians, as astropy's unit conversion multiplies by it.
const ARCSEC: f64 = std::f64::consts::PI / 648_000.0;
/// The Julian date of MJD 0.
const MJD_ZERO: f64 = 2_400_000.5;

/// One day of the table.
struct Day {
    mjd: f64,
    ut1_utc: f64,
    pm_x: f64,
    pm_y: f64,
}

/// UT1-UTC and the polar motion at one UTC instant.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Orientation {
    /// UT1 - UTC, seconds.
    pub ut1_utc: f64,
    /// Polar motion x and y, radians.
    pub polar_motion: (f64, f64),
    /// Whether the instant lies inside the table (else the values are the fallback).
    pub tabulated: bool,
}

/// The first and last MJD of the table.
pub fn range() -> (f64, f64) {
    let days = days();
    (days[0].mjd, days[days.len() - 1].mjd)
}

/// The orientation at the UTC instant `jd1 + jd2` (astropy's two-part Julian date of the
/// time in UTC), computed with astropy's operations in astropy's order so that the values
/// are the same doubles.
pub fn at_utc(jd1: f64, jd2: f64) -> Orientation {
    let days = days();
    let mjd = (jd1 - MJD_ZERO + jd2).floor();
    let utc = jd1 - (MJD_ZERO + mjd) + jd2;
    // astropy's searchsorted(MJD, mjd, side="right") on consecutive days.
    let above = (mjd - days[0].mjd + 1.0).clamp(0.0, days.len() as f64) as usize;
    if above == 0 || above == days.len() {
        let end = &days[above.min(days.len() - 1)];
        return Orientation {
            ut1_utc: end.ut1_utc,
            polar_motion: (DEFAULT_PM_ARCSEC.0 * ARCSEC, DEFAULT_PM_ARCSEC.1 * ARCSEC),
            tabulated: false,
        };
    }
    let (d0, d1) = (&days[above - 1], &days[above]);
    let weight = (mjd - d0.mjd + utc) / (d1.mjd - d0.mjd);
    // A leap second between the two days shows as a jump of one second: taken out.
    let mut d_ut1 = d1.ut1_utc - d0.ut1_utc;
    d_ut1 -= d_ut1.round_ties_even();
    let pm_x = d0.pm_x + weight * (d1.pm_x - d0.pm_x);
    let pm_y = d0.pm_y + weight * (d1.pm_y - d0.pm_y);
    Orientation {
        ut1_utc: d0.ut1_utc + weight * d_ut1,
        polar_motion: (pm_x * ARCSEC, pm_y * ARCSEC),
        tabulated: true,
    }
}

/// The parsed table; it is part of the program, so a malformed one is a build defect that
/// the unit tests catch.
fn days() -> &'static [Day] {
    static DAYS: OnceLock<Vec<Day>> = OnceLock::new();
    DAYS.get_or_init(|| {
        TABLE
            .lines()
            .filter(|line| !line.starts_with('#'))
            .map(|line| {
                let v: Vec<f64> = line
                    .split_whitespace()
                    .map(|x| x.parse().expect("iers.txt holds numbers"))
                    .collect();
                assert_eq!(v.len(), 4, "iers.txt line {line:?}");
                Day {
                    mjd: v[0],
                    ut1_utc: v[1],
                    pm_x: v[2],
                    pm_y: v[3],
                }
            })
            .collect()
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_table_has_consecutive_days_from_2019() {
        let days = days();
        assert_eq!(days[0].mjd, 58484.0);
        assert!(days.windows(2).all(|w| w[1].mjd == w[0].mjd + 1.0));
        // UT1-UTC stays within the 0.9 s that leap seconds keep it in.
        assert!(days.iter().all(|d| d.ut1_utc.abs() < 0.9));
        assert!(
            range().1 >= 61_000.0,
            "the table reaches 2026: {:?}",
            range()
        );
    }

    #[test]
    fn midnight_gives_the_tabulated_day_and_noon_the_mean() {
        let d = &days()[100];
        let midnight = at_utc(MJD_ZERO, d.mjd);
        assert_eq!(midnight.ut1_utc, d.ut1_utc);
        assert_eq!(midnight.polar_motion.0, d.pm_x * ARCSEC);
        let next = &days()[101];
        let noon = at_utc(MJD_ZERO + 0.5, d.mjd);
        let mean = (d.ut1_utc + next.ut1_utc) / 2.0;
        assert!((noon.ut1_utc - mean).abs() < 1e-15, "{noon:?} vs {mean}");
        assert!(noon.tabulated);
    }

    #[test]
    fn outside_the_table_astropy_fallback_is_taken() {
        let (first, last) = range();
        let after = at_utc(MJD_ZERO, last + 10.0);
        assert!(!after.tabulated);
        assert_eq!(after.ut1_utc, days()[days().len() - 1].ut1_utc);
        assert_eq!(after.polar_motion, (0.035 * ARCSEC, 0.29 * ARCSEC));
        let before = at_utc(MJD_ZERO, first - 0.5);
        assert!(!before.tabulated);
        assert_eq!(before.ut1_utc, days()[0].ut1_utc);
    }
}
