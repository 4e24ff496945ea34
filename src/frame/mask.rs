//! The desispec `specmask` bits that extraction sets: SOMEBADPIX and ALLBADPIX from the
//! fraction of a bin's spot on masked pixels, BAD2DFIT from chi2pix by desispec 0.70.0's rule
//! or by the rule of its production tag (0.71, desispec PR #2612).
//!
//! ALLBADPIX is set where the fraction is 1 to within 1e-12 (a sum of a few hundred spot
//! values of at most 1 rounds by less than 1e-13), not where it equals 1.0 exactly as
//! desispec 0.70.0 asks of gpu_specter's fraction: that fraction is numpy's
//! `Apatch.T.dot(ivar == 0)`, a BLAS dgemv whose summation order is the BLAS kernel's and
//! the thread count's, so desispec's own bit changes from one CPU (or GPU) to another
//! (`scripts/pixmask-order` shows it); no order spex could pick agrees everywhere.

use std::str::FromStr;

use ndarray::{Array1, Axis, Zip};

use super::{median, Frame};

/// desispec `specmask` bits set by extraction.
pub mod specmask {
    /// Some input pixels of the bin were masked (pixmask_fraction > 0.5).
    pub const SOMEBADPIX: u32 = 1 << 0;
    /// All input pixels of the bin were masked.
    pub const ALLBADPIX: u32 = 1 << 1;
    /// The 2-D model fits badly (chi2pix outlier).
    pub const BAD2DFIT: u32 = 1 << 7;
}

/// chi2pix above this flags BAD2DFIT (desispec 0.70.0's desi_extract_spectra, on both its
/// gpu_specter and specter paths).
pub const BAD2DFIT_CHI2PIX: f64 = 100.0;

/// Which bins get BAD2DFIT (`--bad2dfit`).
#[derive(Clone, Copy, Debug, Default, PartialEq, serde::Serialize, serde::Deserialize)]
pub enum Bad2dfit {
    /// chi2pix > 100: desispec 0.70.0, the released version.
    #[default]
    Above100,
    /// chi2pix > `scale` times both the median over fibers at that wavelength and the median
    /// over wavelengths of that fiber (desispec 0.71's `get_chi2pix_mask`, scale 5): the
    /// medians follow the worse fits expected on bright sky lines and bright stars.
    Median(f64),
}

impl FromStr for Bad2dfit {
    type Err = String;

    /// `100` (desispec 0.70.0) or `median5` (desispec 0.71; `medianX` for another scale).
    fn from_str(s: &str) -> Result<Self, String> {
        if s == "100" {
            return Ok(Bad2dfit::Above100);
        }
        let scale = s
            .strip_prefix("median")
            .and_then(|x| x.parse::<f64>().ok())
            .filter(|x| x.is_finite() && *x > 0.0);
        scale.map(Bad2dfit::Median).ok_or_else(|| {
            format!("{s:?} is not a BAD2DFIT rule: 100 (desispec 0.70.0) or median5 (0.71)")
        })
    }
}

impl Bad2dfit {
    /// Whether each bin of `chi2pix` (`[fiber, wave]`) is a bad 2-D fit.
    fn flags(&self, chi2pix: &ndarray::Array2<f64>) -> ndarray::Array2<bool> {
        match *self {
            Bad2dfit::Above100 => chi2pix.mapv(|c| c > BAD2DFIT_CHI2PIX),
            Bad2dfit::Median(scale) => {
                let medians = |axis| -> Array1<f64> {
                    chi2pix
                        .lanes(axis)
                        .into_iter()
                        .map(|lane| median(lane.to_vec()))
                        .collect()
                };
                // over fibers, one per wavelength; over wavelengths, one per fiber
                let (by_wave, by_fiber) = (medians(Axis(0)), medians(Axis(1)));
                let mut bad = ndarray::Array2::from_elem(chi2pix.dim(), false);
                Zip::indexed(&mut bad)
                    .and(chi2pix)
                    .for_each(|(f, w), b, &c| {
                        *b = c > scale * by_wave[w] && c > scale * by_fiber[f];
                    });
                bad
            }
        }
    }
}

impl Frame {
    /// SOMEBADPIX, ALLBADPIX and BAD2DFIT (by `rule`), as desi_extract_spectra sets them.
    pub fn set_mask(&mut self, rule: Bad2dfit) {
        let bad2dfit = rule.flags(&self.chi2pix);
        let bins = Zip::from(&mut self.mask)
            .and(&self.pixmask_fraction)
            .and(&bad2dfit);
        bins.for_each(|m, &fraction, &bad| {
            *m = masked_pixel_bits(fraction);
            if bad {
                *m |= specmask::BAD2DFIT;
            }
        });
    }
}

/// SOMEBADPIX where over half of the bin's spot lies on masked pixels, ALLBADPIX where all of
/// it does up to rounding (see the module documentation).
fn masked_pixel_bits(fraction: f64) -> u32 {
    let mut bits = 0;
    if fraction > 0.5 {
        bits |= specmask::SOMEBADPIX;
    }
    if fraction >= 1.0 - 1e-12 {
        bits |= specmask::ALLBADPIX;
    }
    bits
}

#[cfg(test)]
mod tests {
    use super::*;
    use ndarray::Array2;

    /// A fully masked spot whose fraction BLAS rounded short of 1 (1 - 4 eps, the smallest of
    /// scripts/pixmask-order's) is ALLBADPIX; a spot with a pixel of weight 1e-9 left is not.
    #[test]
    fn allbadpix_is_every_pixel_masked_up_to_rounding() {
        let both = specmask::SOMEBADPIX | specmask::ALLBADPIX;
        assert_eq!(masked_pixel_bits(1.0), both);
        assert_eq!(masked_pixel_bits(1.0 - 4.0 * f64::EPSILON), both);
        assert_eq!(masked_pixel_bits(1.0 - 1e-9), specmask::SOMEBADPIX);
        assert_eq!(masked_pixel_bits(0.5), 0);
        assert_eq!(masked_pixel_bits(0.0), 0);
    }

    #[test]
    fn rules_parse_and_bad_ones_are_refused() {
        assert_eq!("100".parse(), Ok(Bad2dfit::Above100));
        assert_eq!("median5".parse(), Ok(Bad2dfit::Median(5.0)));
        for bad in ["median", "median-1", "mediannan", "50", ""] {
            assert!(bad.parse::<Bad2dfit>().is_err(), "{bad:?}");
        }
    }

    /// The median rule flags a bin only where it stands out along both axes: a bright sky line
    /// (a high column) and a bright fiber (a high row) are not flagged, their crossing with a
    /// further excess is; the fixed rule flags every bin over 100.
    #[test]
    fn median_rule_needs_an_outlier_along_both_axes() {
        let (nf, nw) = (5, 9);
        let mut chi2 = Array2::from_elem((nf, nw), 1.0);
        chi2.column_mut(3).fill(200.0); // sky line: every fiber
        chi2.row_mut(1).fill(200.0); // bright fiber: every wavelength
        chi2[[2, 6]] = 6.0; // an outlier in both directions
        chi2[[1, 3]] = 2000.0; // crossing of the line and the fiber, 10x both medians
        let bad = Bad2dfit::Median(5.0).flags(&chi2);
        let flagged: Vec<_> = bad
            .indexed_iter()
            .filter(|(_, &b)| b)
            .map(|(i, _)| i)
            .collect();
        assert_eq!(flagged, vec![(1, 3), (2, 6)]);
        let over100 = Bad2dfit::Above100.flags(&chi2);
        assert_eq!(over100.iter().filter(|&&b| b).count(), nf + nw - 1);
    }
}
