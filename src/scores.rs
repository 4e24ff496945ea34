//! The SCORES table of a frame: desispec's `compute_and_append_frame_scores(frame,
//! suffix="RAW")` as desi_extract_spectra calls it (desispec 0.70.0, `desispec/specscore.py`),
//! and its HDU as `desispec.io.write_frame` writes it.
//!
//! For the band X (b, r or z) whose top-hat range `[lo, hi)` is fixed per band (4000-5800,
//! 5800-7600, 7600-9800 A), three float64 columns, one row per fiber:
//!
//! ```text
//! SUM_RAW_COUNT_X    = sum_j flux_j                       over lo <= wave_j < hi
//! MEDIAN_RAW_COUNT_X = median_j (flux_j / dw_j)
//! MEDIAN_RAW_SNR_X   = median_j (sqrt(max(ivar_j, 0)) flux_j / sqrt(dw_j))
//! ```
//!
//! with `dw = numpy.gradient(wave)`. desi_extract_spectra passes `flux_per_angstrom=False`
//! although its flux is already per Angstrom, so the "counts" are sums and medians of the
//! per-Angstrom flux, further divided by `dw` for the median; spex reproduces that, since the
//! point is that the columns mean what they mean in every other DESI frame. The band is not
//! taken from the camera name: desispec detects it from the mean wavelength of the frame
//! ([`Band::detect`]), and so does [`raw_scores`].

use ndarray::{ArrayView1, Zip};

use crate::error::{Error, Result};
use crate::fits::Fits;
use crate::frame::{bin_widths, ExtraHdu, Frame};

/// A DESI spectrograph arm, as far as the scores are concerned.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Band {
    B,
    R,
    Z,
}

impl Band {
    /// desispec's `_auto_detect_camera`: b if the mean wavelength is at most 5800 A, z if it
    /// is at least 7600 A, r otherwise.
    pub fn detect(wave: &[f64]) -> Band {
        let mean = wave.iter().sum::<f64>() / wave.len().max(1) as f64;
        if mean <= Band::B.tophat().1 {
            Band::B
        } else if mean >= Band::Z.tophat().0 {
            Band::Z
        } else {
            Band::R
        }
    }

    /// The band of a camera name such as `r0` or `B3` (its first letter).
    pub fn from_camera(camera: &str) -> Option<Band> {
        match camera.chars().next()?.to_ascii_lowercase() {
            'b' => Some(Band::B),
            'r' => Some(Band::R),
            'z' => Some(Band::Z),
            _ => None,
        }
    }

    /// desispec's `tophat_wave`: the range `[lo, hi)` in Angstrom.
    pub fn tophat(self) -> (f64, f64) {
        match self {
            Band::B => (4000.0, 5800.0),
            Band::R => (5800.0, 7600.0),
            Band::Z => (7600.0, 9800.0),
        }
    }

    /// The upper-case letter used in column names.
    pub fn letter(self) -> char {
        match self {
            Band::B => 'B',
            Band::R => 'R',
            Band::Z => 'Z',
        }
    }
}

/// One float64 column of the SCORES table, with the comment desispec puts on its TTYPE card.
#[derive(Clone, Debug, PartialEq)]
pub struct ScoreColumn {
    pub name: String,
    pub comment: String,
    /// One value per fiber of the frame.
    pub values: Vec<f64>,
}

/// The columns of a SCORES table, in desispec's order.
#[derive(Clone, Debug, PartialEq)]
pub struct Scores {
    pub columns: Vec<ScoreColumn>,
}

/// The scores desi_extract_spectra appends to its frames: suffix RAW, the band detected from
/// the wavelengths, the flux taken as counts per bin (see the module documentation). `step`
/// is the grid's step, the width of the bin of a one-bin frame.
pub fn raw_scores(frame: &Frame, step: f64) -> Result<Scores> {
    frame_scores(frame, Band::detect(&frame.wave), "RAW", step)
}

/// desispec's `compute_frame_scores(frame, band, suffix, flux_per_angstrom=False)`. Fails
/// when no wavelength of the frame lies in the band's top-hat range, as desispec does. A
/// frame of one bin, where desispec's `numpy.gradient` raises, has bins `step` wide.
pub fn frame_scores(frame: &Frame, band: Band, suffix: &str, step: f64) -> Result<Scores> {
    let (lo, hi) = band.tophat();
    let inside: Vec<usize> = (0..frame.nwave())
        .filter(|&j| frame.wave[j] >= lo && frame.wave[j] < hi)
        .collect();
    if inside.is_empty() {
        return Err(Error::config(format!(
            "scores: no wavelength of the frame lies in the {lo},{hi} A range of band {}",
            band.letter()
        )));
    }
    let dw = bin_widths(&frame.wave, step);
    let range = format!("in wave. range {lo},{hi}A");
    let name = |kind: &str, quantity: &str| format!("{kind}_{suffix}_{quantity}_{}", band.letter());
    type PerFiber<'a> = &'a (dyn Fn(ArrayView1<f64>, ArrayView1<f64>) -> f64 + Sync);
    let column = |name: String, comment: String, per_fiber: PerFiber| {
        // fiber by fiber on many cores: a full frame's medians take tens of ms on one
        let values = Zip::from(frame.flux.rows())
            .and(frame.ivar.rows())
            .par_map_collect(per_fiber)
            .to_vec();
        ScoreColumn {
            name,
            comment,
            values,
        }
    };
    let sum = column(
        name("SUM", "COUNT"),
        format!("sum counts {range}"),
        &|flux, _| inside.iter().map(|&j| flux[j]).sum(),
    );
    let median_count = column(
        name("MEDIAN", "COUNT"),
        format!("median counts/A {range}"),
        &|flux, _| median_of(inside.iter().map(|&j| flux[j] / dw[j]).collect()),
    );
    let median_snr = column(
        name("MEDIAN", "SNR"),
        format!("median SNR/sqrt(A) {range}"),
        &|flux, ivar| {
            median_of(
                inside
                    .iter()
                    .map(|&j| ivar[j].max(0.0).sqrt() * flux[j] / dw[j].sqrt())
                    .collect(),
            )
        },
    );
    Ok(Scores {
        columns: vec![sum, median_count, median_snr],
    })
}

/// numpy's median: NaN if any value is NaN, the mean of the two middle values for an even
/// count.
fn median_of(values: Vec<f64>) -> f64 {
    if values.iter().any(|v| v.is_nan()) {
        return f64::NAN;
    }
    crate::frame::median(values)
}

/// The SCORES HDU as an extra HDU of a written frame: computed from the frame in memory
/// (in f64, before the cast to f32 of its arrays), as desispec computes it before writing.
#[derive(Debug)]
pub struct ScoresHdu {
    /// The step of the frame's grid (WAVESTEP).
    pub step: f64,
}

impl ExtraHdu for ScoresHdu {
    fn write(&self, fits: &mut Fits, frame: &Frame) -> Result<()> {
        append_scores_hdu(fits, &raw_scores(frame, self.step)?)
    }
}

/// Appends the SCORES binary table (float64 columns, the comments on their TTYPE cards, no
/// units) at the end of an open file, as `desispec.io.write_frame` writes `frame.scores`.
pub fn append_scores_hdu(fits: &mut Fits, scores: &Scores) -> Result<()> {
    let nrows = scores.columns.first().map_or(0, |c| c.values.len());
    if let Some(bad) = scores.columns.iter().find(|c| c.values.len() != nrows) {
        return Err(Error::config(format!(
            "scores: column {} has {} rows, the first column {nrows}",
            bad.name,
            bad.values.len()
        )));
    }
    let layout: Vec<(&str, &str)> = scores
        .columns
        .iter()
        .map(|c| (c.name.as_str(), "D"))
        .collect();
    fits.create_table("SCORES", &layout, nrows)?;
    for (i, column) in scores.columns.iter().enumerate() {
        fits.write_column(&column.name, &column.values)?;
        fits.set_key_comment(&format!("TTYPE{}", i + 1), &column.comment)?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn frame(wave: Vec<f64>, flux: Vec<f64>, ivar: Vec<f64>) -> Frame {
        let (nspec, nwave) = (flux.len() / wave.len(), wave.len());
        Frame {
            specmin: 0,
            specmin_recorded: true,
            nspec,
            wave,
            ndiag: 0,
            flux: ndarray::Array2::from_shape_vec((nspec, nwave), flux).unwrap(),
            ivar: ndarray::Array2::from_shape_vec((nspec, nwave), ivar).unwrap(),
            mask: ndarray::Array2::zeros((nspec, nwave)),
            resolution: ndarray::Array3::ones((nspec, 1, nwave)),
            chi2pix: ndarray::Array2::zeros((nspec, nwave)),
            pixmask_fraction: ndarray::Array2::zeros((nspec, nwave)),
        }
    }

    #[test]
    fn bands_are_detected_from_the_mean_wavelength_as_desispec_does() {
        assert_eq!(Band::detect(&[3600.0, 5800.0]), Band::B);
        assert_eq!(Band::detect(&[5760.0, 7620.0]), Band::R);
        assert_eq!(Band::detect(&[7520.0, 9824.0]), Band::Z);
        assert_eq!(Band::detect(&[5800.0, 5800.0]), Band::B, "5800 itself is b");
        assert_eq!(Band::detect(&[7600.0, 7600.0]), Band::Z, "7600 itself is z");
        assert_eq!(Band::from_camera("z7"), Some(Band::Z));
        assert_eq!(Band::from_camera("x1"), None);
    }

    #[test]
    fn sums_and_medians_cover_the_half_open_tophat_only() {
        // bins at 5798, 5800, 5802, 5804 and 7600: the first and the last are outside r
        let wave = vec![5798.0, 5800.0, 5802.0, 5804.0, 7600.0];
        let flux = vec![100.0, 1.0, 2.0, 4.0, 100.0];
        let ivar = vec![1.0, 4.0, -1.0, 1.0, 1.0];
        let s = raw_scores(&frame(wave, flux, ivar), 2.0).unwrap();
        let names: Vec<&str> = s.columns.iter().map(|c| c.name.as_str()).collect();
        assert_eq!(
            names,
            ["SUM_RAW_COUNT_R", "MEDIAN_RAW_COUNT_R", "MEDIAN_RAW_SNR_R"]
        );
        assert_eq!(s.columns[0].values, vec![7.0]);
        // dw = gradient = [2, 2, 2, 899, 1796]: flux/dw inside = 0.5, 1, 4/899
        assert_eq!(s.columns[1].values, vec![0.5]);
        // sqrt(ivar) flux / sqrt(dw): 2/sqrt(2), 0 (negative ivar), 4/sqrt(899)
        assert_eq!(s.columns[2].values, vec![4.0 / 899f64.sqrt()]);
        assert_eq!(
            s.columns[2].comment,
            "median SNR/sqrt(A) in wave. range 5800,7600A"
        );
    }

    #[test]
    fn a_one_bin_frame_has_bins_of_the_grid_step() {
        // numpy's gradient of one bin is not defined: the bin is the step wide, as the
        // bins of the same grid extended by one more are.
        let one = frame(vec![6000.0], vec![8.0], vec![4.0]);
        let two = frame(vec![6000.0, 6000.8], vec![8.0, 8.0], vec![4.0, 4.0]);
        let (a, b) = (
            raw_scores(&one, 0.8).unwrap(),
            raw_scores(&two, 0.8).unwrap(),
        );
        assert_eq!(a.columns[0].values, vec![8.0]);
        // the two-bin grid's step is 6000.8 - 6000, exact to the rounding of 6000.8
        let tolerance = f64::EPSILON * 6000.8 / 0.8;
        for (x, y) in a.columns[1..].iter().zip(&b.columns[1..]) {
            let (x, y) = (x.values[0], y.values[0]);
            assert!(
                x.is_finite() && (x - y).abs() <= tolerance * y.abs(),
                "{x} {y}"
            );
        }
    }

    #[test]
    fn a_frame_outside_the_band_is_an_error_and_nan_propagates() {
        let f = frame(vec![4000.0, 4001.0], vec![1.0, 2.0], vec![1.0, 1.0]);
        assert!(frame_scores(&f, Band::Z, "RAW", 1.0).is_err());
        let f = frame(vec![4000.0, 4001.0], vec![f64::NAN, 2.0], vec![1.0, 1.0]);
        let s = raw_scores(&f, 1.0).unwrap();
        assert!(s.columns.iter().all(|c| c.values[0].is_nan()));
    }

    #[test]
    fn the_scores_hdu_is_a_float64_table_with_commented_columns() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("scores.fits");
        let f = frame(
            vec![6000.0, 6001.0, 6002.0],
            vec![1.0, 2.0, 3.0, 4.0, 5.0, 6.0],
            vec![1.0; 6],
        );
        let s = raw_scores(&f, 1.0).unwrap();
        let mut fits = Fits::create(&path).unwrap();
        fits.write_image("FLUX", &[2, 3], &[0f32; 6]).unwrap();
        append_scores_hdu(&mut fits, &s).unwrap();
        fits.close().unwrap();

        let mut fits = Fits::open(&path).unwrap();
        fits.move_to("SCORES").unwrap();
        let (repeat, sums) = fits.column::<f64>("SUM_RAW_COUNT_R").unwrap();
        assert_eq!((repeat, sums), (1, vec![6.0, 15.0]));
        let cards = fits.cards().unwrap();
        assert!(
            cards.iter().any(|c| c.starts_with("TFORM1  = 'D")),
            "{cards:?}"
        );
        assert!(cards
            .iter()
            .any(|c| c.starts_with("TTYPE1  = 'SUM_RAW_COUNT_R'") && c.contains("sum counts")));
        assert!(!cards.iter().any(|c| c.starts_with("TUNIT")));
    }
}
