//! Measures frames: parity of two extractions of the same input (gpu_specter's
//! `compare-frame` statistics), and pulls of an extraction against the simulation truth
//! convolved with the frame's own resolution matrix.

use std::fmt;
use std::path::Path;

use ndarray::Array2;

use crate::error::{number, Error, Result};
use crate::fits::Fits;
use crate::frame::{bin_widths, median, Frame};

/// Thresholds of `|f_a - f_b| / sqrt(var_a + var_b)` whose fractions are reported.
pub const PARITY_LEVELS: [f64; 6] = [1e-5, 1e-4, 1e-3, 1e-2, 1e-1, 1.0];

/// Parity statistics of two frames over bins where both have ivar > 0.
#[derive(Clone, Debug, PartialEq)]
pub struct Parity {
    /// Bins compared (ivar > 0 in both).
    pub nbins: usize,
    /// Bins where exactly one frame has ivar > 0.
    pub ivar_zero_mismatch: usize,
    /// Fraction of compared bins under each of [`PARITY_LEVELS`].
    pub flux_fractions: [f64; 6],
    pub flux_max: f64,
    /// Fraction of compared bins whose ivar agrees to the relative tolerance.
    pub ivar_fraction: f64,
    pub ivar_max_rel: f64,
    /// Fraction of compared bins whose resolution column agrees to the relative tolerance
    /// (difference over the column's largest element).
    pub resolution_fraction: f64,
    pub resolution_max_rel: f64,
    /// Fraction of compared bins whose chi2pix agrees to the relative tolerance.
    pub chi2pix_fraction: f64,
    pub rel_tolerance: f64,
}

/// Pass/fail limits for [`Parity`] (the defaults are those of the reference tests).
#[derive(Clone, Debug, PartialEq)]
pub struct ParityLimits {
    /// Minimum fraction of bins with `|df|/sigma < 1e-4`.
    pub min_fraction_1e4: f64,
    /// No bin may exceed this `|df|/sigma`.
    pub max_flux: f64,
    /// Minimum fraction of bins with ivar, resolution and chi2pix within `rel_tolerance`.
    pub min_rel_fraction: f64,
    pub rel_tolerance: f64,
}

impl Default for ParityLimits {
    fn default() -> Self {
        ParityLimits {
            min_fraction_1e4: 0.999,
            max_flux: 1e-2,
            min_rel_fraction: 0.999,
            rel_tolerance: 1e-4,
        }
    }
}

fn rel(a: f64, b: f64) -> f64 {
    let scale = a.abs().max(b.abs());
    if scale == 0.0 {
        0.0
    } else {
        (a - b).abs() / scale
    }
}

/// Why two frames cannot be compared bin by bin (shape, resolution width or wavelength grid
/// differ), `None` when they can. For a command line this is a failed comparison.
pub fn parity_mismatch(a: &Frame, b: &Frame) -> Option<String> {
    if let Some(why) =
        non_finite(a, "the first frame").or_else(|| non_finite(b, "the second frame"))
    {
        return Some(why);
    }
    // gpu_specter's frames record no first fiber: their fibers are taken as the other's.
    if a.specmin_recorded && b.specmin_recorded && a.specmin != b.specmin {
        return Some(format!(
            "frames hold different fibers: from {} vs from {}",
            a.specmin, b.specmin
        ));
    }
    grid_mismatch(b, a.nspec, &a.wave, a.ndiag)
}

/// Why `frame` (named `which`) cannot be measured: the number of NaN or infinite values in
/// its arrays, bins of ivar 0 included (a frame must hold none); `None` when it has none.
fn non_finite(frame: &Frame, which: &str) -> Option<String> {
    let count = |v: &mut dyn Iterator<Item = &f64>| v.filter(|x| !x.is_finite()).count();
    let counts = [
        ("WAVELENGTH", count(&mut frame.wave.iter())),
        ("FLUX", count(&mut frame.flux.iter())),
        ("IVAR", count(&mut frame.ivar.iter())),
        ("RESOLUTION", count(&mut frame.resolution.iter())),
        ("CHI2PIX", count(&mut frame.chi2pix.iter())),
    ];
    let bad: Vec<String> = counts
        .iter()
        .filter(|(_, n)| *n > 0)
        .map(|(name, n)| format!("{n} in {name}"))
        .collect();
    (!bad.is_empty()).then(|| format!("{which} holds NaN or infinite values: {}", bad.join(", ")))
}

/// Why `frame` is not a frame of `nspec` fibers on the grid `wave` with `ndiag` resolution
/// diagonals, `None` when it is.
fn grid_mismatch(frame: &Frame, nspec: usize, wave: &[f64], ndiag: usize) -> Option<String> {
    if frame.nspec != nspec || frame.nwave() != wave.len() || frame.ndiag != ndiag {
        return Some(format!(
            "frames differ in shape: {}x{} (ndiag {}) vs {}x{} (ndiag {})",
            nspec,
            wave.len(),
            ndiag,
            frame.nspec,
            frame.nwave(),
            frame.ndiag
        ));
    }
    if frame
        .wave
        .iter()
        .zip(wave)
        .any(|(x, y)| !((x - y).abs() <= 1e-6))
    {
        return Some("frames have different wavelength grids".into());
    }
    None
}

/// Compares two frames of the same shape.
pub fn parity(a: &Frame, b: &Frame, rel_tolerance: f64) -> Result<Parity> {
    if let Some(why) = parity_mismatch(a, b) {
        return Err(Error::config(why));
    }
    let (nw, nd) = (a.nwave(), a.resolution.dim().1);
    let mut counts = [0usize; 6];
    let (mut n, mut mismatch, mut fmax) = (0usize, 0usize, 0f64);
    let (mut ivar_ok, mut res_ok, mut chi_ok) = (0usize, 0usize, 0usize);
    let (mut ivar_max, mut res_max) = (0f64, 0f64);
    for f in 0..a.nspec {
        for j in 0..nw {
            let i = [f, j];
            let (ia, ib) = (a.ivar[i], b.ivar[i]);
            if (ia > 0.0) != (ib > 0.0) {
                mismatch += 1;
                continue;
            }
            if ia <= 0.0 {
                continue;
            }
            n += 1;
            let d = (a.flux[i] - b.flux[i]).abs() / (1.0 / ia + 1.0 / ib).sqrt();
            // A NaN in either frame fails the comparison rather than vanishing from it.
            fmax = if d.is_nan() {
                f64::INFINITY
            } else {
                fmax.max(d)
            };
            for (c, level) in counts.iter_mut().zip(PARITY_LEVELS) {
                if d < level {
                    *c += 1;
                }
            }
            let r = rel(ia, ib);
            ivar_max = ivar_max.max(r);
            ivar_ok += (r <= rel_tolerance) as usize;
            let col = |fr: &Frame, k: usize| fr.resolution[[f, k, j]];
            let scale = (0..nd).map(|k| col(a, k).abs()).fold(0.0, f64::max);
            let diff = (0..nd)
                .map(|k| (col(a, k) - col(b, k)).abs())
                .fold(0.0, f64::max);
            let r = if scale > 0.0 { diff / scale } else { diff };
            res_max = res_max.max(r);
            res_ok += (r <= rel_tolerance) as usize;
            chi_ok += (rel(a.chi2pix[i], b.chi2pix[i]) <= rel_tolerance) as usize;
        }
    }
    let frac = |c: usize| if n == 0 { 0.0 } else { c as f64 / n as f64 };
    Ok(Parity {
        nbins: n,
        ivar_zero_mismatch: mismatch,
        flux_fractions: counts.map(frac),
        flux_max: fmax,
        ivar_fraction: frac(ivar_ok),
        ivar_max_rel: ivar_max,
        resolution_fraction: frac(res_ok),
        resolution_max_rel: res_max,
        chi2pix_fraction: frac(chi_ok),
        rel_tolerance,
    })
}

impl Parity {
    /// The limits this comparison violates, as readable lines (empty when it passes).
    pub fn failures(&self, limits: &ParityLimits) -> Vec<String> {
        let mut out = Vec::new();
        if self.nbins == 0 {
            out.push("no bin with ivar > 0 in both frames".to_string());
        }
        if self.ivar_zero_mismatch > 0 {
            out.push(format!(
                "{} bins have ivar > 0 in one frame only",
                self.ivar_zero_mismatch
            ));
        }
        if self.flux_fractions[1] < limits.min_fraction_1e4 {
            out.push(format!(
                "only {:.4}% of bins have |df|/sigma < 1e-4 (need {:.4}%)",
                100.0 * self.flux_fractions[1],
                100.0 * limits.min_fraction_1e4
            ));
        }
        if self.flux_max > limits.max_flux {
            out.push(format!(
                "max |df|/sigma {:.3e} > {:.1e}",
                self.flux_max, limits.max_flux
            ));
        }
        for (name, f) in [
            ("ivar", self.ivar_fraction),
            ("resolution", self.resolution_fraction),
            ("chi2pix", self.chi2pix_fraction),
        ] {
            if f < limits.min_rel_fraction {
                out.push(format!(
                    "only {:.4}% of bins have {name} within {:.0e} (need {:.4}%)",
                    100.0 * f,
                    self.rel_tolerance,
                    100.0 * limits.min_rel_fraction
                ));
            }
        }
        out
    }
}

impl fmt::Display for Parity {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        writeln!(
            f,
            "bins compared: {} (ivar > 0 in one frame only: {})",
            self.nbins, self.ivar_zero_mismatch
        )?;
        writeln!(f, "|f_a - f_b| / sqrt(var_a + var_b):")?;
        for (level, frac) in PARITY_LEVELS.iter().zip(self.flux_fractions) {
            writeln!(f, "  < {level:<6.0e} {:>9.4}%", 100.0 * frac)?;
        }
        writeln!(f, "  max     {:.3e}", self.flux_max)?;
        let t = self.rel_tolerance;
        writeln!(
            f,
            "ivar within {t:.0e} (relative): {:.4}% (max {:.3e})",
            100.0 * self.ivar_fraction,
            self.ivar_max_rel
        )?;
        writeln!(
            f,
            "resolution within {t:.0e} (relative): {:.4}% (max {:.3e})",
            100.0 * self.resolution_fraction,
            self.resolution_max_rel
        )?;
        write!(
            f,
            "chi2pix within {t:.0e} (relative): {:.4}%",
            100.0 * self.chi2pix_fraction
        )
    }
}

/// Simulation truth: photons per bin on a grid aligned with the extraction grid.
#[derive(Clone, Debug)]
pub struct Truth {
    pub wave: Vec<f64>,
    /// First fiber of row 0.
    pub fibermin: usize,
    /// `[fiber, wave]`.
    pub flux: Array2<f64>,
}

impl Truth {
    /// Reads WAVELENGTH and FLUX; row 0 is fiber `fibermin`, or the file's FIBERMIN keyword, or 0.
    pub fn read(path: &Path, fibermin: Option<usize>) -> Result<Self> {
        let mut fits = Fits::open(path)?;
        fits.move_to("WAVELENGTH")?;
        let (_, wave) = fits.read_image::<f64>()?;
        fits.move_to("FLUX")?;
        let key = fits.key_i64("FIBERMIN")?;
        let (shape, flux) = fits.read_image::<f64>()?;
        if shape.len() != 2 || shape[1] != wave.len() {
            return Err(fits.error(
                "FLUX",
                format!("shape {shape:?} does not match WAVELENGTH ({})", wave.len()),
            ));
        }
        let flux = Array2::from_shape_vec((shape[0], shape[1]), flux)
            .map_err(|e| fits.error("FLUX", e.to_string()))?;
        Ok(Truth {
            wave,
            fibermin: fibermin.or(key.map(|k| k.max(0) as usize)).unwrap_or(0),
            flux,
        })
    }
}

/// Why the truth's grid cannot serve for `frame`'s pulls (it is too short, not increasing,
/// or does not contain the frame's first wavelength on one of its bins), `None` when it can.
pub fn truth_mismatch(frame: &Frame, truth: &Truth) -> Option<String> {
    if let Some(why) = non_finite(frame, "the frame") {
        return Some(why);
    }
    let (Some(&w0), Some(&t0), Some(&t1)) =
        (frame.wave.first(), truth.wave.first(), truth.wave.get(1))
    else {
        return Some("the frame or the truth has too few wavelength bins".into());
    };
    let dwt = t1 - t0;
    if !(dwt > 0.0) || !dwt.is_finite() {
        return Some("the truth's wavelength grid is not increasing".into());
    }
    let offset = ((w0 - t0) / dwt).round();
    let inside = offset >= 0.0 && offset < truth.wave.len() as f64;
    if !inside || !((truth.wave[offset as usize] - w0).abs() <= 1e-3 * dwt) {
        return Some(format!(
            "the truth grid {}..{} does not contain the frame's grid from {} on one of its bins",
            number(t0),
            number(truth.wave[truth.wave.len() - 1]),
            number(w0)
        ));
    }
    None
}

/// Pull statistics of a frame against the truth.
#[derive(Clone, Debug, PartialEq)]
pub struct Pulls {
    pub nbins: usize,
    pub mean: f64,
    pub std: f64,
    pub median_abs: f64,
    /// Bins with |pull| > 5.
    pub over5: usize,
    pub max_abs: f64,
}

/// Pass/fail limits for [`Pulls`] (defaults: the reference acceptance bounds).
#[derive(Clone, Debug, PartialEq)]
pub struct PullLimits {
    pub max_abs_mean: f64,
    pub max_std: f64,
    pub median_abs: (f64, f64),
}

impl Default for PullLimits {
    fn default() -> Self {
        PullLimits {
            max_abs_mean: 0.01,
            max_std: 1.02,
            median_abs: (0.66, 0.70),
        }
    }
}

/// Pull statistics of a frame against the truth (see [`pull_values`]).
pub fn pulls(frame: &Frame, truth: &Truth) -> Result<Pulls> {
    Ok(Pulls::from_values(&pull_values(frame, truth)?))
}

/// `pull = (flux dw - R t) sqrt(ivar) / dw` over the frame's bins with ivar > 0, where `R t`
/// is the truth convolved with the frame's resolution diagonals:
/// `(R t)[i] = sum_k Rdiags[k][j] t[j]`, `j = i + ndiag - k`. Near the ends of the grid the
/// truth beyond the frame still leaks in; its column of R is taken as the nearest column of
/// the frame (the convention of the reference figures). Fiber by fiber, bin by bin; an error
/// when no bin overlaps the truth.
pub fn pull_values(frame: &Frame, truth: &Truth) -> Result<Vec<f64>> {
    let nw = frame.nwave();
    if let Some(why) = truth_mismatch(frame, truth) {
        return Err(Error::config(why));
    }
    let dwt = truth.wave[1] - truth.wave[0];
    let offset = ((frame.wave[0] - truth.wave[0]) / dwt).round() as i64;
    let offset = offset as usize;
    // The truth's bins are the frame's: their step is the width of a one-bin frame's bin.
    let dw = bin_widths(&frame.wave, dwt);
    let (nd, ndiag) = (frame.resolution.dim().1, frame.ndiag as i64);
    let mut values = Vec::new();
    for f in 0..frame.nspec {
        let fiber = frame.specmin + f;
        let Some(t) = fiber
            .checked_sub(truth.fibermin)
            .filter(|&row| row < truth.flux.nrows())
            .map(|row| truth.flux.row(row))
        else {
            continue;
        };
        for i in 0..nw {
            let ivar = frame.ivar[[f, i]];
            if ivar <= 0.0 {
                continue;
            }
            let mut rt = 0.0;
            let mut complete = true;
            for k in 0..nd as i64 {
                let col = i as i64 + ndiag - k;
                let ti = offset as i64 + col;
                if ti < 0 || ti >= t.len() as i64 {
                    complete = false;
                    break;
                }
                let rcol = col.clamp(0, nw as i64 - 1) as usize;
                rt += frame.resolution[[f, k as usize, rcol]] * t[ti as usize];
            }
            if complete {
                values.push((frame.flux[[f, i]] * dw[i] - rt) * ivar.sqrt() / dw[i]);
            }
        }
    }
    if values.is_empty() {
        return Err(Error::config("no bin of the frame overlaps the truth"));
    }
    Ok(values)
}

impl Pulls {
    /// The statistics of a non-empty set of pulls.
    pub fn from_values(values: &[f64]) -> Pulls {
        let n = values.len() as f64;
        let mean = values.iter().sum::<f64>() / n;
        let std = (values.iter().map(|v| (v - mean).powi(2)).sum::<f64>() / n).sqrt();
        let abs: Vec<f64> = values.iter().map(|v| v.abs()).collect();
        Pulls {
            nbins: values.len(),
            mean,
            std,
            median_abs: median(abs.clone()),
            over5: abs.iter().filter(|&&v| v > 5.0).count(),
            max_abs: abs.iter().cloned().fold(0.0, f64::max),
        }
    }

    /// The limits this violates, as readable lines (empty when it passes).
    pub fn failures(&self, limits: &PullLimits) -> Vec<String> {
        let mut out = Vec::new();
        if self.mean.abs() > limits.max_abs_mean {
            out.push(format!(
                "|mean pull| {} > {}",
                statistic(self.mean.abs()),
                number(limits.max_abs_mean)
            ));
        }
        if self.std > limits.max_std {
            let (std, max) = (statistic(self.std), number(limits.max_std));
            out.push(format!("std of pull {std} > {max}"));
        }
        let (lo, hi) = (number(limits.median_abs.0), number(limits.median_abs.1));
        if !(limits.median_abs.0..=limits.median_abs.1).contains(&self.median_abs) {
            out.push(format!(
                "median |pull| {} outside {lo}..{hi}",
                statistic(self.median_abs)
            ));
        }
        out
    }
}

impl fmt::Display for Pulls {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        writeln!(f, "bins: {}", self.nbins)?;
        writeln!(f, "mean pull: {:+.4}", self.mean)?;
        writeln!(f, "std of pull: {:.4}", self.std)?;
        writeln!(
            f,
            "median |pull|: {:.4} (Gaussian: 0.6745)",
            self.median_abs
        )?;
        write!(f, "|pull| > 5: {} (max {:.2})", self.over5, self.max_abs)
    }
}

/// Agreement of two backends on the same patches, in f64 before any rounding to the file's
/// f32: `|f_a - f_b| sqrt(ivar_b)` per bin, relative ivar and chi2pix, absolute resolution
/// and pixmask differences, and patches whose status differs.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Agreement {
    pub bins: usize,
    pub max_dflux_sigma: f64,
    pub max_ivar_rel: f64,
    pub max_resolution_abs: f64,
    pub max_chi2pix_rel: f64,
    pub max_pixmask_abs: f64,
    pub status_mismatches: usize,
}

/// Compares two backends' results for the same patches (matched by patch index).
pub fn agreement(
    a: &[crate::extract::PatchResult],
    b: &[crate::extract::PatchResult],
) -> Result<Agreement> {
    let mut by_index = std::collections::HashMap::new();
    for r in b {
        by_index.insert(r.patch, r);
    }
    let mut out = Agreement::default();
    for ra in a {
        let rb = by_index.get(&ra.patch).ok_or_else(|| {
            Error::config(format!("patch {} solved by one backend only", ra.patch))
        })?;
        if ra.status != rb.status {
            out.status_mismatches += 1;
        }
        if ra.flux.len() != rb.flux.len() || ra.resolution.len() != rb.resolution.len() {
            return Err(Error::config(format!(
                "patch {} results differ in shape",
                ra.patch
            )));
        }
        for i in 0..ra.flux.len() {
            out.bins += 1;
            out.max_dflux_sigma = out
                .max_dflux_sigma
                .max((ra.flux[i] - rb.flux[i]).abs() * rb.ivar[i].sqrt());
            out.max_ivar_rel = out.max_ivar_rel.max(rel(ra.ivar[i], rb.ivar[i]));
            out.max_chi2pix_rel = out.max_chi2pix_rel.max(rel(ra.chi2pix[i], rb.chi2pix[i]));
            out.max_pixmask_abs = out
                .max_pixmask_abs
                .max((ra.pixmask_fraction[i] - rb.pixmask_fraction[i]).abs());
        }
        for (x, y) in ra.resolution.iter().zip(&rb.resolution) {
            out.max_resolution_abs = out.max_resolution_abs.max((x - y).abs());
        }
    }
    Ok(out)
}

impl Agreement {
    /// The limits violated for a tolerance `tol` (1e-6 for GPU vs CPU), as readable lines.
    pub fn failures(&self, tol: f64) -> Vec<String> {
        let mut out = Vec::new();
        for (name, v) in [
            ("|df|/sigma", self.max_dflux_sigma),
            ("ivar (relative)", self.max_ivar_rel),
            ("resolution", self.max_resolution_abs),
            ("chi2pix (relative)", self.max_chi2pix_rel),
            ("pixmask fraction", self.max_pixmask_abs),
        ] {
            if !(v < tol) {
                out.push(format!("max {name} difference {v:.3e} >= {tol:.0e}"));
            }
        }
        if self.status_mismatches > 0 {
            out.push(format!(
                "{} patches differ in status",
                self.status_mismatches
            ));
        }
        out
    }
}

impl fmt::Display for Agreement {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{} bins: max |df|/sigma {:.3e}, ivar {:.3e} (rel), resolution {:.3e} (abs), chi2pix {:.3e} (rel), pixmask {:.3e} (abs), status mismatches {}",
            self.bins,
            self.max_dflux_sigma,
            self.max_ivar_rel,
            self.max_resolution_abs,
            self.max_chi2pix_rel,
            self.max_pixmask_abs,
            self.status_mismatches
        )
    }
}

/// A statistic for a message: four decimals, or [`number`]'s short form when those would run
/// to hundreds of digits.
fn statistic(x: f64) -> String {
    match x.abs() < 1e16 {
        true => format!("{x:.4}"),
        false => number(x),
    }
}
