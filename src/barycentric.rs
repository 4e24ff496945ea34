//! The barycentric wavelength correction of desi_extract_spectra: which header keywords give
//! the pointing and the time, and the multiplicative factor `f = 1 + v/c` computed as
//! astropy's `SkyCoord.radial_velocity_correction(kind="barycentric")` does for the KPNO site.
//!
//! desispec (0.70.0, `desispec.scripts.extract.barycentric_correction_multiplicative_factor`)
//! reads RA from TARGTRA, else SKYRA, TELRA, RA; DEC likewise; the UTC date MJD-OBS (else MJD)
//! plus EXPTIME/2 (mid-exposure); and calls `desispec.heliocentric`, which builds an ICRS
//! direction without distance and an astropy `Time` in UTC without location. astropy then
//! computes Wright & Eastman (2014) eq. 28 without the Shapiro delay and the star's motion:
//!
//! ```text
//! f = gamma (1 + beta . n) / (1 + gr / c),   beta = (v_earth + v_site) / c,
//! gamma = 1 / sqrt(1 - |beta|^2),            gr = -sum_body G M_body / (c d_body)
//! ```
//!
//! with `v_earth` the Earth's barycentric velocity (ERFA `epv00` at TDB), `v_site` the site's
//! GCRS velocity (Earth rotation: `c2i06a`, `era00`, `pom00`, `sp00`, `c2tcio`), `n` the
//! target direction, and `gr` summed over the Earth (distance from its centre to the site),
//! Moon (`moon98`), Jupiter (`plan94`) and Sun (`epv00`), each from the Earth's centre. The
//! ERFA routines come from the `sofars` crate, a Rust port of SOFA, the library ERFA is taken
//! from; the constants are astropy's.
//!
//! UT1-UTC (for the Earth rotation angle) and the polar motion come from the IERS table
//! astropy reads, shipped with spex (`iers`); every time is split into two-part Julian dates
//! as astropy's `Time` splits it, and the last steps are desispec's (`v` in km/s, divided by
//! c in km/s): the factor is then desispec's to the bit from 2019 on (after the table's end
//! too, where both fall back alike), which the tests check with desispec itself. Before 2019
//! spex warns and UT1-UTC is the table's first value, up to 0.9 s off: < 1e-10 in `f`.

use std::path::Path;

use sofars::{coords, eph, erst, pnp, ts};

use crate::error::{Error, Result};

mod iers;

/// KPNO, as `desispec.heliocentric.kpno` (WGS84 geodetic).
pub const KPNO_LATITUDE_DEG: f64 = 31.96403;
pub const KPNO_LONGITUDE_DEG: f64 = -111.59989;
pub const KPNO_HEIGHT_M: f64 = 2097.0;

/// Keywords tried in order, as desispec does.
pub const RA_KEYWORDS: [&str; 4] = ["TARGTRA", "SKYRA", "TELRA", "RA"];
pub const DEC_KEYWORDS: [&str; 4] = ["TARGTDEC", "SKYDEC", "TELDEC", "DEC"];
pub const MJD_KEYWORDS: [&str; 2] = ["MJD-OBS", "MJD"];

// astropy.constants (CODATA 2018, IAU 2015) and astropy.coordinates.earth.
const C: f64 = 299_792_458.0;
/// c in km/s, the value of astropy's `c.to(u.km / u.s)` that desispec divides by.
const C_KMS: f64 = 299_792.458;
const AU: f64 = 149_597_870_700.0;
const DAY: f64 = 86_400.0;
const GM_SUN: f64 = 1.327_124_4e20;
const GM_JUPITER: f64 = 1.266_865_3e17;
const GM_EARTH: f64 = 3.986_004e14;
const G: f64 = 6.6743e-11;
const MOON_MASS: f64 = 7.347_673_09e22;
/// Earth's rotation rate, rad/s (astropy's `OMEGA_EARTH`: 1.00273781191135448 cycle/day).
const OMEGA_EARTH: f64 = std::f64::consts::TAU * 1.002_737_811_911_354_5 / DAY;
/// ERFA's planet number of Jupiter for `plan94`.
const JUPITER: i32 = 5;
/// MJD zero point as a Julian date.
const MJD0: f64 = 2_400_000.5;

/// What desispec reads from a header: the ICRS direction and the UTC mid-exposure date.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Pointing {
    pub ra_deg: f64,
    pub dec_deg: f64,
    /// MJD-OBS (or MJD) + EXPTIME / 2, UTC.
    pub mjd: f64,
}

impl Pointing {
    /// Reads the pointing as desispec's `barycentric_correction_multiplicative_factor` does;
    /// `path` names the file in errors.
    pub fn from_header(cards: &[String], path: &Path) -> Result<Pointing> {
        let ra = first_number(cards, &RA_KEYWORDS, path)?;
        let dec = first_number(cards, &DEC_KEYWORDS, path)?;
        // astropy refuses a latitude outside -90..90 degrees; a correction computed from one
        // would be silently wrong.
        if !(-90.0..=90.0).contains(&dec) {
            return Err(missing(
                path,
                &format!("declination {dec} is outside -90..90 degrees"),
            ));
        }
        let mjd = first_number(cards, &MJD_KEYWORDS, path)?;
        let exptime = match header_value(cards, "EXPTIME") {
            None => 0.0,
            Some(v) => number(v, "EXPTIME", path)?,
        };
        Ok(Pointing {
            ra_deg: ra,
            dec_deg: dec,
            mjd: mjd + exptime / 2.0 / 3600.0 / 24.0,
        })
    }

    /// The multiplicative factor `1 + v/c` (see the module documentation).
    pub fn factor(&self) -> Result<f64> {
        multiplicative_factor(self.ra_deg, self.dec_deg, self.mjd)
    }
}

/// desispec's `barycentric_correction_multiplicative_factor(header)`.
pub fn factor_from_header(cards: &[String], path: &Path) -> Result<f64> {
    let p = Pointing::from_header(cards, path)?;
    compute(p.ra_deg, p.dec_deg, p.mjd).map_err(|message| missing(path, &message))
}

/// desi_extract_spectra's choice of header: the preproc's when it has RA or TARGTRA, else
/// the fibermap's (early commissioning data), else an error. Each header comes with the path
/// of its file, for errors.
pub fn factor_for_extraction(
    image: (&[String], &Path),
    fibermap: Option<(&[String], &Path)>,
) -> Result<f64> {
    let has_ra = |cards: &[String]| {
        header_value(cards, "RA").is_some() || header_value(cards, "TARGTRA").is_some()
    };
    if has_ra(image.0) {
        return factor_from_header(image.0, image.1);
    }
    match fibermap {
        Some((cards, path)) if has_ra(cards) => factor_from_header(cards, path),
        _ => Err(missing(
            image.1,
            "no TARGTRA nor RA keyword in the image header nor in the fibermap's",
        )),
    }
}

/// `1 + v/c` for an ICRS direction (degrees) seen from KPNO at a UTC date (MJD): astropy's
/// barycentric `radial_velocity_correction` divided by c, plus one. Fails only for dates
/// outside ERFA's Earth ephemeris (1900-2100).
pub fn multiplicative_factor(ra_deg: f64, dec_deg: f64, mjd_utc: f64) -> Result<f64> {
    compute(ra_deg, dec_deg, mjd_utc).map_err(Error::Config)
}

fn compute(ra_deg: f64, dec_deg: f64, mjd_utc: f64) -> std::result::Result<f64, String> {
    let t = Times::from_utc_mjd(mjd_utc)?;
    if !t.orientation.tabulated {
        let (first, last) = iers::range();
        tracing::warn!(
            "MJD {} is outside spex's IERS table (MJD {first}-{last}): UT1-UTC held at \
             the table's nearest value and the polar motion at astropy's 50-year mean, as \
             astropy does outside its own table; the barycentric factor may then differ from \
             desispec's by up to 1e-10",
            crate::error::number(mjd_utc)
        );
    }
    let (earth_helio, earth_bary) = eph::epv00(t.tdb.0, t.tdb.1).ok_or_else(|| {
        format!(
            "MJD {} is outside 1900-2100, the range of the Earth ephemeris",
            crate::error::number(mjd_utc)
        )
    })?;
    let (site_pos, site_vel) = site_gcrs(&t);
    let beta: [f64; 3] = std::array::from_fn(|i| (earth_bary[1][i] * AU / DAY + site_vel[i]) / C);
    let gamma = 1.0 / (1.0 - dot(&beta, &beta)).sqrt();
    let (ra, dec) = (ra_deg.to_radians(), dec_deg.to_radians());
    let n = [dec.cos() * ra.cos(), dec.cos() * ra.sin(), dec.sin()];
    let gr = gravitational_redshift(&t, &earth_helio[0], &earth_bary[0], &site_pos)?;
    let zb = gamma * (1.0 + dot(&beta, &n)) / (1.0 + gr / C);
    // astropy returns (zb - 1) c in m/s; desispec converts it to km/s (astropy multiplies by
    // 0.001) and divides by c in km/s: each rounding can move the last bit of the factor.
    let v_kms = (zb - 1.0) * C * 0.001;
    Ok(1.0 + v_kms / C_KMS)
}

/// One UTC instant in the time scales the ERFA routines take, as two-part Julian dates split
/// as astropy's `Time` splits them (the split changes ERFA's rounding, hence the last bit of
/// the factor), with the Earth's orientation at that instant.
struct Times {
    ut1: (f64, f64),
    tt: (f64, f64),
    tdb: (f64, f64),
    orientation: iers::Orientation,
}

impl Times {
    /// astropy's `Time(mjd, format="mjd")` in UTC converted as `Time._set_scale` does: UTC ->
    /// TAI -> TT (leap seconds from ERFA's table), TT -> TDB with the geocentric `dtdb` (the
    /// time has no location), UTC -> UT1 with UT1-UTC from the IERS table; each chain's
    /// result normalised by `day_frac`.
    fn from_utc_mjd(mjd: f64) -> std::result::Result<Times, String> {
        let bad = |status: i32| {
            format!(
                "MJD {}: not a valid UTC date (ERFA status {status})",
                crate::error::number(mjd)
            )
        };
        let (day, frac) = day_frac(mjd, 0.0);
        let utc = day_frac(day + MJD0, frac);
        let tai = ts::utctai(utc.0, utc.1).map_err(bad)?;
        let tt = ts::taitt(tai.0, tai.1).map_err(bad)?;
        // dtdb's UT only enters with the site's distance from the Earth's axis, zero here.
        let dtr = ts::dtdb(tt.0, tt.1, 0.0, 0.0, 0.0, 0.0);
        let tdb = ts::tttdb(tt.0, tt.1, dtr).map_err(bad)?;
        let orientation = iers::at_utc(utc.0, utc.1);
        let ut1 = ts::utcut1(utc.0, utc.1, orientation.ut1_utc).map_err(bad)?;
        Ok(Times {
            ut1: day_frac(ut1.0, ut1.1),
            tt: day_frac(tt.0, tt.1),
            tdb: day_frac(tdb.0, tdb.1),
            orientation,
        })
    }
}

/// astropy's `day_frac(val1, val2)`: the exact sum as an integer day and a fraction within
/// -0.5..0.5 (error-free transformations, the integer rounded to even).
fn day_frac(val1: f64, val2: f64) -> (f64, f64) {
    let (sum, err) = two_sum(val1, val2);
    let mut day = sum.round_ties_even();
    let (frac, check) = two_sum(sum - day, err);
    // numpy's sign: 0 for 0.
    let sign = if check == 0.0 { 0.0 } else { check.signum() };
    day += if frac * sign != 0.5 {
        frac.round_ties_even()
    } else {
        (frac + 2.0 * check).round_ties_even()
    };
    (day, sum - day + err)
}

/// Shewchuk's two-sum: `a + b` rounded and its exact error.
fn two_sum(a: f64, b: f64) -> (f64, f64) {
    let x = a + b;
    let eb = x - a;
    let ea = x - eb;
    (x, (a - ea) + (b - eb))
}

/// The site's GCRS position (m) and velocity (m/s): astropy's `EarthLocation.get_gcrs_posvel`
/// through CIRS, with the Earth rotation angle at UT1 and the polar motion of the IERS table.
fn site_gcrs(t: &Times) -> ([f64; 3], [f64; 3]) {
    let gcrs_to_cirs = pnp::c2i06a(t.tt.0, t.tt.1);
    let sp = pnp::sp00(t.tt.0, t.tt.1);
    let (xp, yp) = t.orientation.polar_motion;
    let pom = pnp::pom00(xp, yp, sp);
    let era = erst::era00(t.ut1.0, t.ut1.1);
    let identity = [[1.0, 0.0, 0.0], [0.0, 1.0, 0.0], [0.0, 0.0, 1.0]];
    let cirs_to_itrs = pnp::c2tcio(&identity, era, &pom);
    let itrs = site_itrs();
    // GCRS = gcrs_to_cirs^T cirs_to_itrs^T ITRS
    let cirs: [f64; 3] =
        std::array::from_fn(|i| (0..3).map(|k| cirs_to_itrs[k][i] * itrs[k]).sum());
    let pos: [f64; 3] = std::array::from_fn(|i| (0..3).map(|k| gcrs_to_cirs[k][i] * cirs[k]).sum());
    // The rotation axis (CIRS z) in GCRS, times the rotation rate, crossed with the position.
    let axis: [f64; 3] = std::array::from_fn(|i| gcrs_to_cirs[2][i] * OMEGA_EARTH);
    (pos, cross(&axis, &pos))
}

/// KPNO's ITRS position (m) on the WGS84 ellipsoid (ERFA `gd2gc`).
fn site_itrs() -> [f64; 3] {
    const WGS84: i32 = 1;
    coords::gd2gc(
        WGS84,
        KPNO_LONGITUDE_DEG.to_radians(),
        KPNO_LATITUDE_DEG.to_radians(),
        KPNO_HEIGHT_M,
    )
    .expect("KPNO's geodetic coordinates are valid")
}

/// astropy's `EarthLocation.gravitational_redshift` (m/s): Sun, Jupiter and Moon at their
/// distance from the Earth's centre, the Earth at the site's distance from it; summed from
/// the smallest term up, as astropy does.
fn gravitational_redshift(
    t: &Times,
    earth_helio: &[f64; 3],
    earth_bary: &[f64; 3],
    site: &[f64; 3],
) -> std::result::Result<f64, String> {
    let sun: [f64; 3] = std::array::from_fn(|i| earth_bary[i] - earth_helio[i]);
    let (jupiter_helio, _) = eph::plan94(t.tdb.0, t.tdb.1, JUPITER)
        .map_err(|s| format!("ERFA plan94 failed with status {s}"))?;
    let jupiter: [f64; 3] = std::array::from_fn(|i| jupiter_helio[0][i] + sun[i]);
    let moon_geo = eph::moon98(t.tdb.0, t.tdb.1);
    let moon: [f64; 3] = std::array::from_fn(|i| moon_geo[0][i] + earth_bary[i]);
    let distance_m = |body: &[f64; 3]| {
        let d: [f64; 3] = std::array::from_fn(|i| body[i] - earth_bary[i]);
        dot(&d, &d).sqrt() * AU
    };
    let terms = [
        GM_EARTH / dot(site, site).sqrt(),
        G * MOON_MASS / distance_m(&moon),
        GM_JUPITER / distance_m(&jupiter),
        GM_SUN / distance_m(&sun),
    ];
    Ok(terms.iter().fold(0.0, |sum, gm_over_d| sum - gm_over_d / C))
}

fn dot(a: &[f64; 3], b: &[f64; 3]) -> f64 {
    a[0] * b[0] + a[1] * b[1] + a[2] * b[2]
}

fn cross(a: &[f64; 3], b: &[f64; 3]) -> [f64; 3] {
    [
        a[1] * b[2] - a[2] * b[1],
        a[2] * b[0] - a[0] * b[2],
        a[0] * b[1] - a[1] * b[0],
    ]
}

/// The value field of the first card whose keyword is `key` (what astropy's `key in header`
/// and `header[key]` find), trimmed, without its comment; `None` if no card has the keyword.
pub fn header_value<'a>(cards: &'a [String], key: &str) -> Option<&'a str> {
    cards.iter().find_map(|card| {
        let name = card.get(..8).unwrap_or(card).trim_end();
        if name != key {
            return None;
        }
        let field = card.get(8..).unwrap_or("");
        Some(
            match field.strip_prefix("= ").or_else(|| field.strip_prefix('=')) {
                Some(value) => strip_comment(value).trim(),
                None => "",
            },
        )
    })
}

/// A value field without its `/ comment` (a `/` inside a quoted string is not a comment).
fn strip_comment(value: &str) -> &str {
    let mut in_string = false;
    for (i, ch) in value.char_indices() {
        match ch {
            '\'' => in_string = !in_string,
            '/' if !in_string => return &value[..i],
            _ => {}
        }
    }
    value
}

/// The first of `keys` present in the header, as a number.
fn first_number(cards: &[String], keys: &[&str], path: &Path) -> Result<f64> {
    for key in keys {
        if let Some(value) = header_value(cards, key) {
            return number(value, key, path);
        }
    }
    let (last, others) = keys.split_last().expect("keyword list is not empty");
    Err(missing(
        path,
        &format!("no {} nor {last} keyword in the header", others.join(", ")),
    ))
}

/// A numeric card value (FITS allows a `D` exponent).
fn number(value: &str, key: &str, path: &Path) -> Result<f64> {
    value
        .replace(['D', 'd'], "E")
        .parse::<f64>()
        .ok()
        .filter(|v| v.is_finite())
        .ok_or_else(|| {
            missing(
                path,
                &format!("keyword {key} has the value {value:?}, not a finite number"),
            )
        })
}

fn missing(path: &Path, message: &str) -> Error {
    Error::Fits {
        path: path.into(),
        what: "barycentric correction".into(),
        message: message.into(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn card(key: &str, value: &str) -> String {
        format!("{key:<8}= {value:>20} / a comment")
    }

    fn header(cards: &[(&str, &str)]) -> Vec<String> {
        cards.iter().map(|(k, v)| card(k, v)).collect()
    }

    #[test]
    fn keywords_are_taken_in_desispec_order() {
        let path = Path::new("preproc.fits");
        let h = header(&[
            ("RA", "10.0"),
            ("TELRA", "20.0"),
            ("SKYDEC", "-5.5"),
            ("DEC", "3.0"),
            ("MJD", "60000.0"),
            ("MJD-OBS", "60001.0"),
            ("EXPTIME", "1.2D3"),
        ]);
        let p = Pointing::from_header(&h, path).unwrap();
        assert_eq!(p.ra_deg, 20.0, "TELRA before RA");
        assert_eq!(p.dec_deg, -5.5, "SKYDEC before DEC");
        assert_eq!(
            p.mjd,
            60001.0 + 600.0 / 86400.0,
            "MJD-OBS plus half EXPTIME"
        );
        let no_exptime = header(&[("RA", "1"), ("DEC", "2"), ("MJD", "60000.25")]);
        assert_eq!(
            Pointing::from_header(&no_exptime, path).unwrap().mjd,
            60000.25
        );
    }

    #[test]
    fn a_missing_or_non_numeric_keyword_names_the_file_and_the_keyword() {
        let path = Path::new("some/preproc-r0.fits");
        let no_mjd = header(&[("TARGTRA", "1"), ("TARGTDEC", "2")]);
        let err = factor_from_header(&no_mjd, path).unwrap_err().to_string();
        assert!(
            err.contains("some/preproc-r0.fits") && err.contains("MJD-OBS"),
            "{err}"
        );
        let text_ra = header(&[("RA", "'10:00:00'"), ("DEC", "2"), ("MJD", "60000")]);
        let err = factor_from_header(&text_ra, path).unwrap_err().to_string();
        assert!(err.contains("keyword RA"), "{err}");
    }

    #[test]
    fn extraction_falls_back_to_the_fibermap_header_only_without_ra() {
        let (img, fm) = (Path::new("img.fits"), Path::new("fibermap.fits"));
        let fibermap = header(&[("TARGTRA", "150"), ("TARGTDEC", "2"), ("MJD-OBS", "60100")]);
        let skyra_only = header(&[("SKYRA", "150"), ("SKYDEC", "2"), ("MJD-OBS", "60100")]);
        let from_fibermap =
            factor_for_extraction((&skyra_only, img), Some((&fibermap, fm))).unwrap();
        assert_eq!(from_fibermap, factor_from_header(&fibermap, fm).unwrap());
        let err = factor_for_extraction((&skyra_only, img), None).unwrap_err();
        assert!(err.to_string().contains("img.fits"), "{err}");
        // an image header with RA is used even when its MJD is missing
        let no_mjd = header(&[("RA", "150"), ("DEC", "2")]);
        let err = factor_for_extraction((&no_mjd, img), Some((&fibermap, fm))).unwrap_err();
        assert!(err.to_string().contains("MJD"), "{err}");
    }

    #[test]
    fn values_and_comments_are_parsed_as_fits_cards() {
        let cards = vec![
            "OBJECT  = 'a/b     '           / slash inside a string".to_string(),
            "TELRA   =             150.125 / degrees".to_string(),
            "EMPTY   =".to_string(),
        ];
        assert_eq!(header_value(&cards, "OBJECT"), Some("'a/b     '"));
        assert_eq!(header_value(&cards, "TELRA"), Some("150.125"));
        assert_eq!(header_value(&cards, "EMPTY"), Some(""));
        assert_eq!(header_value(&cards, "RA"), None);
    }

    #[test]
    fn dates_outside_the_ephemeris_are_errors_naming_the_file() {
        let h = header(&[("RA", "1"), ("DEC", "2"), ("MJD", "-40000")]);
        let err = factor_from_header(&h, Path::new("old.fits"))
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("old.fits") && err.contains("1900-2100"),
            "{err}"
        );
    }

    #[test]
    fn the_factor_follows_the_earth_orbit() {
        // Towards the ecliptic pole the orbital velocity is perpendicular to the line of
        // sight; in the ecliptic it reaches about +-30 km/s over the year.
        let pole = multiplicative_factor(270.0, 66.56, 60000.0).unwrap();
        assert!((pole - 1.0).abs() * C < 1.5e3, "{}", (pole - 1.0) * C);
        let extremes: Vec<f64> = (0..12)
            .map(|m| {
                (multiplicative_factor(0.0, 0.0, 60000.0 + 30.0 * m as f64).unwrap() - 1.0) * C
            })
            .collect();
        let max = extremes.iter().cloned().fold(f64::MIN, f64::max);
        let min = extremes.iter().cloned().fold(f64::MAX, f64::min);
        assert!(
            max > 25e3 && max < 31e3 && min < -25e3 && min > -31e3,
            "{extremes:?}"
        );
    }
}
