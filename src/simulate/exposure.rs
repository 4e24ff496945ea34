//! What a simulated preproc file says about its exposure besides the pixels, in desispec's
//! terms: the IMAGE keywords that `desispec.io.read_image`, `Frame.vet()` and the barycentric
//! correction read (FLAVOR, OBSTYPE, NIGHT, MJD-OBS, pointing...), the four amplifiers with
//! their read noise (CCDSEC*, OBSRDN*, GAIN* and the READNOISE image of a desispec preproc),
//! and a FIBERMAP with the columns of desispec's `empty_fibermap` for the main survey.
//!
//! The values are those of a plausible dark-time exposure, fixed so that a simulation stays a
//! pure function of its options.

use crate::error::Result;
use crate::fits::Fits;

use super::{ObjType, Simulation};

/// The observing night and the start of the exposure (2020-12-15 06:00 UT, local midnight
/// at Kitt Peak).
pub const NIGHT: i64 = 20201214;
pub const MJD_OBS: f64 = 59198.25;
const DATE_OBS: &str = "2020-12-15T06:00:00.000";

/// Exposure time: the flux levels of the simulation are typical of a 900 s dark exposure.
pub const EXPTIME: f64 = 900.0;

/// Tile and pointing: a field that transits near local midnight in mid-December.
pub const TILEID: i64 = 1000;
pub const TILE_RA: f64 = 100.0;
pub const TILE_DEC: f64 = 30.0;

/// Fibers per spectrograph (FIBER = 500 x spectrograph + index on the CCD).
const FIBERS_PER_SPECTROGRAPH: i64 = 500;

/// The spectrograph number of a camera name such as 'r3' (0 when it has none).
pub fn spectrograph(camera: &str) -> i64 {
    camera.get(1..).and_then(|s| s.parse().ok()).unwrap_or(0)
}

/// The names of a DESI CCD's amplifiers.
pub const AMPLIFIERS: [char; 4] = ['A', 'B', 'C', 'D'];

/// The amplifiers of a DESI CCD: name and (rows, columns) quadrant, A and B on the lower
/// half, C and D on the upper half, as in desispec's CCDSEC keywords.
pub(super) fn amplifiers(nrows: usize, ncols: usize) -> [(char, [usize; 4]); 4] {
    let (hy, hx) = (nrows / 2, ncols / 2);
    [
        ('A', [0, hy, 0, hx]),
        ('B', [0, hy, hx, ncols]),
        ('C', [hy, nrows, 0, hx]),
        ('D', [hy, nrows, hx, ncols]),
    ]
}

/// Columns of the overscan (bias) section of the amplifier whose data start at column `c0`:
/// the simulation has no raw layout, so each half of the CCD gets a 100-column overscan past
/// the image's last column, in the coordinates desispec's BIASSEC keywords use. desispec reads
/// the BIASSEC keywords of a preproc header to know which amplifiers it has
/// (`desispec.preproc.get_amp_ids`, used by the sky fit's offsets, CTE correction and tsnr).
fn ncols_overscan(ncols: usize, c0: usize) -> std::ops::Range<usize> {
    let start = if c0 == 0 {
        ncols
    } else {
        ncols + OVERSCAN_COLUMNS
    };
    start..start + OVERSCAN_COLUMNS
}

/// Width of an amplifier's overscan, as on DESI's CCDs.
const OVERSCAN_COLUMNS: usize = 100;

impl Simulation {
    /// The exposure and amplifier keywords of the IMAGE HDU.
    pub(super) fn write_exposure_keys(&self, fits: &mut Fits) -> Result<()> {
        let (flavor, obstype) = if self.options.flat {
            ("flat", "FLAT")
        } else {
            ("science", "SCIENCE")
        };
        fits.write_key_str("FLAVOR", flavor, "observation type")?;
        fits.write_key_str("OBSTYPE", obstype, "observation type")?;
        fits.write_key_i64("NIGHT", NIGHT, "night of the observation (YYYYMMDD)")?;
        fits.write_key_i64("TILEID", TILEID, "tile")?;
        fits.write_key_i64("SPECGRPH", spectrograph(&self.camera), "spectrograph")?;
        fits.write_key_str("DATE-OBS", DATE_OBS, "start of the exposure (UTC)")?;
        fits.write_key_f64("MJD-OBS", MJD_OBS, "start of the exposure (MJD)")?;
        fits.write_key_f64("EXPTIME", EXPTIME, "exposure time [s]")?;
        fits.write_key_f64("AIRMASS", 1.1, "airmass")?;
        for (key, value, what) in [
            ("TARGTRA", TILE_RA, "target right ascension [deg]"),
            ("TARGTDEC", TILE_DEC, "target declination [deg]"),
            ("SKYRA", TILE_RA, "sky right ascension [deg]"),
            ("SKYDEC", TILE_DEC, "sky declination [deg]"),
            ("TELRA", TILE_RA, "telescope right ascension [deg]"),
            ("TELDEC", TILE_DEC, "telescope declination [deg]"),
        ] {
            fits.write_key_f64(key, value, what)?;
        }
        let rdnoise = self.options.read_noise;
        for (amp, [r0, r1, c0, c1]) in amplifiers(self.nrows, self.ncols) {
            let sec = format!("[{}:{},{}:{}]", c0 + 1, c1, r0 + 1, r1);
            fits.write_key_str(&format!("CCDSEC{amp}"), &sec, "amplifier section")?;
            fits.write_key_str(&format!("DATASEC{amp}"), &sec, "data section (no prescan)")?;
            let overscan = ncols_overscan(self.ncols, c0);
            let bias = format!(
                "[{}:{},{}:{}]",
                overscan.start + 1,
                overscan.end,
                r0 + 1,
                r1
            );
            fits.write_key_str(&format!("BIASSEC{amp}"), &bias, "overscan section")?;
            fits.write_key_f64(&format!("GAIN{amp}"), 1.0, "e/ADU (gain applied to image)")?;
            fits.write_key_f64(
                &format!("OBSRDN{amp}"),
                rdnoise,
                "electrons (gain is applied)",
            )?;
        }
        Ok(())
    }

    /// The READNOISE image of a desispec preproc: each pixel the read noise (electrons rms)
    /// of its amplifier.
    pub(super) fn write_readnoise(&self, fits: &mut Fits) -> Result<()> {
        let mut readnoise = vec![0f32; self.nrows * self.ncols];
        for (_, [r0, r1, c0, c1]) in amplifiers(self.nrows, self.ncols) {
            for row in r0..r1 {
                readnoise[row * self.ncols + c0..row * self.ncols + c1]
                    .fill(self.options.read_noise as f32);
            }
        }
        fits.write_image("READNOISE", &[self.nrows, self.ncols], &readnoise)
    }

    /// The FIBERMAP: one row per fiber of the PSF, with every column of desispec's
    /// `empty_fibermap` for the main survey; sky fibers are OBJTYPE 'SKY' with the SKY
    /// targeting bit, the others emission-line galaxy targets spread over the field.
    pub(super) fn write_fibermap(&self, fits: &mut Fits) -> Result<()> {
        let n = self.objtype.len();
        let columns: Vec<(&str, &str)> = FIBERMAP_COLUMNS.iter().map(|c| (c.0, c.1)).collect();
        fits.create_table("FIBERMAP", &columns, n)?;
        for (i, (_, _, unit)) in FIBERMAP_COLUMNS.iter().enumerate() {
            if !unit.is_empty() {
                fits.write_key_str(&format!("TUNIT{}", i + 1), unit, "")?;
            }
        }
        for (key, value) in [("SURVEY", "main"), ("PROGRAM", "dark"), ("FAPRGRM", "dark")] {
            fits.write_key_str(key, value, "")?;
        }
        fits.write_key_i64("TILEID", TILEID, "tile")?;
        fits.write_key_f64("TILERA", TILE_RA, "tile right ascension [deg]")?;
        fits.write_key_f64("TILEDEC", TILE_DEC, "tile declination [deg]")?;

        let sp = spectrograph(&self.camera);
        let index: Vec<i64> = (0..n as i64).collect();
        let sky: Vec<bool> = self.objtype.iter().map(|t| *t == ObjType::Sky).collect();
        let ints = |f: &dyn Fn(usize) -> i64| (0..n).map(f).collect::<Vec<i64>>();
        let fiber = ints(&|i| FIBERS_PER_SPECTROGRAPH * sp + index[i]);
        // Targets on a ring pattern within 1.5 deg of the tile centre, deterministic.
        let (ra, dec): (Vec<f64>, Vec<f64>) = (0..n)
            .map(|i| {
                let r = 1.5 * ((i as f64 + 0.5) / n as f64).sqrt();
                let a = i as f64 * 2.399_963_229_728_653; // golden angle
                let dec = TILE_DEC + r * a.sin();
                let ra = TILE_RA + r * a.cos() / dec.to_radians().cos();
                (ra, dec)
            })
            .unzip();
        fits.write_column(
            "TARGETID",
            &ints(&|i| 39_627_000_000_000 + fiber[i] + if sky[i] { 1 << 40 } else { 0 }),
        )?;
        fits.write_column("PETAL_LOC", &ints(&|_| sp))?;
        fits.write_column("DEVICE_LOC", &index)?;
        fits.write_column("LOCATION", &ints(&|i| 1000 * sp + index[i]))?;
        fits.write_column("FIBER", &fiber)?;
        let objtype: Vec<&str> = self.objtype.iter().map(|t| t.as_str()).collect();
        fits.write_column_str("OBJTYPE", &objtype)?;
        for name in ["TARGET_RA", "PLATE_RA", "FIBER_RA"] {
            fits.write_column(name, &ra)?;
        }
        for name in ["TARGET_DEC", "PLATE_DEC", "FIBER_DEC"] {
            fits.write_column(name, &dec)?;
        }
        let desiname: Vec<String> = ra
            .iter()
            .zip(&dec)
            .map(|(r, d)| format!("DESI J{r:08.4}{d:+08.4}"))
            .collect();
        let desiname: Vec<&str> = desiname.iter().map(|s| s.as_str()).collect();
        fits.write_column_str("DESINAME", &desiname)?;
        // SKY is bit 32 of desi_mask, ELG bit 1; fiberassign types: 1 science, 4 sky.
        fits.write_column("DESI_TARGET", &ints(&|i| if sky[i] { 1 << 32 } else { 2 }))?;
        fits.write_column("FA_TARGET", &ints(&|i| if sky[i] { 1 << 32 } else { 2 }))?;
        fits.write_column("FA_TYPE", &ints(&|i| if sky[i] { 4 } else { 1 }))?;
        fits.write_column("PRIORITY", &ints(&|i| if sky[i] { 0 } else { 3000 }))?;
        fits.write_column("PRIORITY_INIT", &ints(&|i| if sky[i] { 0 } else { 3000 }))?;
        fits.write_column("NUMOBS_INIT", &ints(&|i| if sky[i] { 0 } else { 1 }))?;
        fits.write_column("OBSCONDITIONS", &ints(&|_| 1))?;
        fits.write_column("RELEASE", &ints(&|_| 9010))?;
        fits.write_column("NUM_ITER", &ints(&|_| 2))?;
        let subpriority: Vec<f64> = (0..n).map(|i| (i as f64 * 0.618_034) % 1.0).collect();
        fits.write_column("SUBPRIORITY", &subpriority)?;
        let morph: Vec<&str> = sky.iter().map(|&s| if s { "" } else { "EXP" }).collect();
        fits.write_column_str("MORPHTYPE", &morph)?;
        fits.write_column_str("PHOTSYS", &vec!["S"; n])?;
        fits.write_column_str("BRICKNAME", &vec!["1000p300"; n])?;
        let (x, y): (Vec<f64>, Vec<f64>) = (0..n)
            .map(|i| {
                let a = i as f64 / n as f64 * std::f64::consts::FRAC_PI_4;
                (400.0 * a.cos(), 400.0 * a.sin())
            })
            .unzip();
        fits.write_column("FIBERASSIGN_X", &x)?;
        fits.write_column("FIBERASSIGN_Y", &y)?;
        fits.write_column("FIBER_X", &x)?;
        fits.write_column("FIBER_Y", &y)?;
        fits.write_column("LAMBDA_REF", &vec![5400.0f64; n])?;
        fits.write_column("REF_EPOCH", &vec![2015.5f64; n])?;
        fits.write_column("EBV", &vec![0.01f64; n])?;
        fits.write_column("EXPTIME", &vec![EXPTIME; n])
    }
}

/// desispec.io.fibermap's `fibermap_columns` with provenance 'empty' (what
/// `empty_fibermap(survey='main')` and `assemble_fibermap` give): name, TFORM, unit.
pub const FIBERMAP_COLUMNS: [(&str, &str, &str); 71] = [
    ("TARGETID", "K", ""),
    ("PETAL_LOC", "I", ""),
    ("DEVICE_LOC", "J", ""),
    ("LOCATION", "K", ""),
    ("FIBER", "J", ""),
    ("FIBERSTATUS", "J", ""),
    ("TARGET_RA", "D", "deg"),
    ("TARGET_DEC", "D", "deg"),
    ("DESINAME", "22A", ""),
    ("PMRA", "E", "mas yr-1"),
    ("PMDEC", "E", "mas yr-1"),
    ("REF_EPOCH", "E", "yr"),
    ("LAMBDA_REF", "E", "Angstrom"),
    ("FA_TARGET", "K", ""),
    ("FA_TYPE", "B", ""),
    ("OBJTYPE", "3A", ""),
    ("FIBERASSIGN_X", "E", "mm"),
    ("FIBERASSIGN_Y", "E", "mm"),
    ("PRIORITY", "J", ""),
    ("SUBPRIORITY", "D", ""),
    ("OBSCONDITIONS", "J", ""),
    ("RELEASE", "I", ""),
    ("BRICKNAME", "8A", ""),
    ("BRICKID", "J", ""),
    ("BRICK_OBJID", "J", ""),
    ("MORPHTYPE", "4A", ""),
    ("EBV", "E", "mag"),
    ("FLUX_G", "E", "nanomaggy"),
    ("FLUX_R", "E", "nanomaggy"),
    ("FLUX_Z", "E", "nanomaggy"),
    ("FLUX_W1", "E", "nanomaggy"),
    ("FLUX_W2", "E", "nanomaggy"),
    ("FLUX_IVAR_G", "E", "nanomaggy^-2"),
    ("FLUX_IVAR_R", "E", "nanomaggy^-2"),
    ("FLUX_IVAR_Z", "E", "nanomaggy^-2"),
    ("FLUX_IVAR_W1", "E", "nanomaggy^-2"),
    ("FLUX_IVAR_W2", "E", "nanomaggy^-2"),
    ("FIBERFLUX_G", "E", "nanomaggy"),
    ("FIBERFLUX_R", "E", "nanomaggy"),
    ("FIBERFLUX_Z", "E", "nanomaggy"),
    ("FIBERTOTFLUX_G", "E", "nanomaggy"),
    ("FIBERTOTFLUX_R", "E", "nanomaggy"),
    ("FIBERTOTFLUX_Z", "E", "nanomaggy"),
    ("MASKBITS", "I", ""),
    ("SERSIC", "E", ""),
    ("SHAPE_R", "E", "arcsec"),
    ("SHAPE_E1", "E", ""),
    ("SHAPE_E2", "E", ""),
    ("REF_ID", "K", ""),
    ("REF_CAT", "2A", ""),
    ("GAIA_PHOT_G_MEAN_MAG", "E", "mag"),
    ("GAIA_PHOT_BP_MEAN_MAG", "E", "mag"),
    ("GAIA_PHOT_RP_MEAN_MAG", "E", "mag"),
    ("PARALLAX", "E", "mas"),
    ("PHOTSYS", "1A", ""),
    ("PRIORITY_INIT", "K", ""),
    ("NUMOBS_INIT", "K", ""),
    ("DESI_TARGET", "K", ""),
    ("BGS_TARGET", "K", ""),
    ("MWS_TARGET", "K", ""),
    ("SCND_TARGET", "K", ""),
    ("PLATE_RA", "D", "deg"),
    ("PLATE_DEC", "D", "deg"),
    ("NUM_ITER", "K", ""),
    ("FIBER_X", "D", "mm"),
    ("FIBER_Y", "D", "mm"),
    ("DELTA_X", "D", "mm"),
    ("DELTA_Y", "D", "mm"),
    ("FIBER_RA", "D", "deg"),
    ("FIBER_DEC", "D", "deg"),
    ("EXPTIME", "D", "s"),
];
