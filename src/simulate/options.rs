//! What a simulation is asked for ([`SimulateOptions`]): the fibers and wavelength grid of
//! the truth, the seed, the noise and defects to add, and their validation against the PSF.

use std::ops::Range;

use crate::error::{Error, Result};
use crate::psf::GaussHermitePsf;

use super::exposure::AMPLIFIERS;
use super::MAX_COSMIC_DENSITY;

/// What to simulate.
#[derive(Clone, Debug, PartialEq)]
pub struct SimulateOptions {
    /// Fibers given light (PSF fiber indices, `0..psf.nfiber`).
    pub fibers: Range<usize>,
    /// Wavelength grid of the truth, `output_grid(wmin, wmax, dw)`; it must lie inside the
    /// PSF's domain (the Legendre series must not be extrapolated).
    pub wmin: f64,
    pub wmax: f64,
    pub dw: f64,
    /// Seed of every random choice (spectra, noise, cosmics).
    pub seed: u64,
    /// Gaussian read noise (electrons rms per pixel).
    pub read_noise: f64,
    /// Add Poisson photon noise and read noise; without it IMAGE is the noiseless model
    /// (IVAR is the same either way).
    pub noise: bool,
    /// Cosmic-ray tracks per million pixels of the simulated region (0: none). The default, 50,
    /// is about what a 900 s exposure collects on a DESI CCD.
    pub cosmic_density: f64,
    /// A CCD column to mark bad (MASK 1, IVAR 0, with excess signal), as in the reference
    /// full-frame simulations.
    pub bad_column: Option<usize>,
    /// Give every fiber the night-sky spectrum (continuum and emission lines).
    pub sky: bool,
    /// Give the non-sky fibers an object spectrum (continuum and emission lines).
    pub objects: bool,
    /// Fraction of fibers that are sky fibers (only sky light, OBJTYPE 'SKY').
    pub sky_fraction: f64,
    /// Pixels of margin around the bounding box of the simulated spots; outside it the image is
    /// 0 and masked, as in the reference simulations.
    pub margin: usize,
    /// CAMERA keyword; `None` takes it from the PSF file (or 'r0' if the PSF does not say).
    pub camera: Option<String>,
    /// EXPID keyword.
    pub expid: i64,
    /// Fraction of the cosmic-ray tracks left out of the MASK, with the IVAR of the light
    /// beneath them (0: every track masked).
    pub unmasked_cosmics: f64,
    /// A flat-lamp exposure instead of a science one: every fiber gets the same smooth lamp
    /// continuum times its throughput, without sky, objects or sky fibers (FLAVOR 'flat').
    pub flat: bool,
    /// Fibers (PSF indices) that receive no light: their truth is zero.
    pub dead_fibers: Vec<usize>,
    /// Amplifiers ('A' to 'D') whose pixels are all masked (BAD, IVAR 0), as in the preproc
    /// of an exposure with a failed amplifier.
    pub masked_amps: Vec<char>,
}

impl SimulateOptions {
    /// The defaults (seed 0, 0.8 A bins, 3 e- read noise, noise, sky, objects, cosmics, 10% sky
    /// fibers, no bad column) for a fiber range and wavelength range.
    pub fn new(fibers: Range<usize>, wmin: f64, wmax: f64) -> Self {
        SimulateOptions {
            fibers,
            wmin,
            wmax,
            dw: 0.8,
            seed: 0,
            read_noise: 3.0,
            noise: true,
            cosmic_density: 50.0,
            bad_column: None,
            sky: true,
            objects: true,
            sky_fraction: 0.1,
            margin: 3,
            camera: None,
            expid: 1,
            unmasked_cosmics: 0.0,
            flat: false,
            dead_fibers: Vec::new(),
            masked_amps: Vec::new(),
        }
    }

    /// Checks the options against the PSF, with a message that names the offending option.
    pub fn validate(&self, psf: &GaussHermitePsf) -> Result<()> {
        let (lo, hi) = psf.wave_domain();
        if self.fibers.is_empty() {
            return Err(Error::config(format!(
                "no fibers to simulate ({:?})",
                self.fibers
            )));
        }
        if self.fibers.end > psf.nfiber {
            return Err(Error::config(format!(
                "fibers {}..{} requested, the PSF describes fibers 0..{}",
                self.fibers.start, self.fibers.end, psf.nfiber
            )));
        }
        if !(self.dw.is_finite() && self.dw > 0.0) {
            return Err(Error::config(format!(
                "wavelength step {} must be positive",
                self.dw
            )));
        }
        if !(self.wmin.is_finite() && self.wmax.is_finite() && self.wmin <= self.wmax) {
            return Err(Error::config(format!(
                "wavelength range {}..{} is not an increasing range",
                self.wmin, self.wmax
            )));
        }
        // The grid's last bin may pass wmax by less than half a bin (numpy's arange
        // convention); that much extrapolation is harmless, more is refused.
        if self.wmin < lo || self.wmax > hi {
            return Err(Error::config(format!(
                "wavelength range {}..{} A is outside the PSF's domain {lo}..{hi} A",
                self.wmin, self.wmax
            )));
        }
        if !(self.read_noise.is_finite() && self.read_noise >= 0.0) {
            return Err(Error::config(format!(
                "read noise {} must be >= 0",
                self.read_noise
            )));
        }
        if !(self.cosmic_density >= 0.0 && self.cosmic_density <= MAX_COSMIC_DENSITY) {
            return Err(Error::config(format!(
                "cosmic-ray density {} must be in 0..={MAX_COSMIC_DENSITY} tracks per million pixels",
                self.cosmic_density
            )));
        }
        if !(0.0..=1.0).contains(&self.unmasked_cosmics) {
            return Err(Error::config(format!(
                "unmasked cosmic fraction {} must be in 0..1",
                self.unmasked_cosmics
            )));
        }
        if !(0.0..=1.0).contains(&self.sky_fraction) {
            return Err(Error::config(format!(
                "sky fiber fraction {} must be in 0..1",
                self.sky_fraction
            )));
        }
        if let Some(fiber) = self.dead_fibers.iter().find(|&&f| f >= psf.nfiber) {
            return Err(Error::config(format!(
                "dead fiber {fiber} is outside the PSF's fibers 0..{}",
                psf.nfiber
            )));
        }
        if let Some(amp) = self.masked_amps.iter().find(|a| !AMPLIFIERS.contains(a)) {
            return Err(Error::config(format!(
                "masked amplifier {amp:?} is not one of {AMPLIFIERS:?}"
            )));
        }
        if !self.sky && !self.objects && !self.flat {
            return Err(Error::config(
                "neither sky nor objects: nothing to simulate",
            ));
        }
        if let Some(column) = self.bad_column {
            if column >= psf.npix_x {
                return Err(Error::config(format!(
                    "bad column {column} is outside the CCD's {} columns",
                    psf.npix_x
                )));
            }
        }
        if psf.npix_x == 0 || psf.npix_y == 0 {
            return Err(Error::config(format!(
                "the PSF's CCD size {} x {} is empty",
                psf.npix_y, psf.npix_x
            )));
        }
        Ok(())
    }
}
