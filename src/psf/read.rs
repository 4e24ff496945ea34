//! Reading a specex PSF file into a [`GaussHermitePsf`] and checking what the model relies on.

use std::path::Path;

use super::{GaussHermitePsf, Legendre, MAX_GHDEG, MAX_HSIZE};
use crate::error::{Error, Result};
use crate::fits::Fits;

impl GaussHermitePsf {
    /// Reads and validates a PSF file.
    pub fn read(path: &Path) -> Result<Self> {
        let mut fits = Fits::open(path)?;
        let bad = |message: String| Error::Psf {
            path: path.into(),
            message,
        };

        fits.move_to("PSF")?;
        if let Some(kind) = fits.key_str("PSFTYPE")? {
            if kind.trim() != "GAUSS-HERMITE" {
                return Err(bad(format!(
                    "PSFTYPE is {kind:?}; spex reads GAUSS-HERMITE PSFs"
                )));
            }
        }
        let wavemin = fits.require_f64("WAVEMIN")?;
        let wavemax = fits.require_f64("WAVEMAX")?;
        let key = |fits: &mut Fits, k: &str| -> Result<usize> {
            let v = fits.require_i64(k)?;
            usize::try_from(v).map_err(|_| bad(format!("{k} = {v} is negative")))
        };
        let legdeg = key(&mut fits, "LEGDEG")?;
        let ghdegx = key(&mut fits, "GHDEGX")?;
        let ghdegy = key(&mut fits, "GHDEGY")?;
        let hsizex = key(&mut fits, "HSIZEX")?;
        let hsizey = key(&mut fits, "HSIZEY")?;
        let npix_x = key(&mut fits, "NPIX_X")?;
        let npix_y = key(&mut fits, "NPIX_Y")?;
        let psferr = fits.key_f64("PSFERR")?;
        let orig_psf = fits.key_str("IN_PSF")?;
        // Bounds first: the degrees size the parameter lookups below.
        if ghdegx > MAX_GHDEG || ghdegy > MAX_GHDEG {
            return Err(bad(format!(
                "Gauss-Hermite degrees {ghdegx}, {ghdegy} above {MAX_GHDEG}"
            )));
        }

        let names = fits.column_str("PARAM")?;
        let (repeat, coeff) = fits.column::<f64>("COEFF")?;
        let ncoef = legdeg + 1;
        if repeat == 0 || repeat % ncoef != 0 {
            return Err(bad(format!(
                "COEFF has {repeat} values per row, not a multiple of LEGDEG+1 = {ncoef}"
            )));
        }
        let nfiber = repeat / ncoef;
        let param = |name: &str| -> Result<Legendre> {
            let row = names
                .iter()
                .position(|n| n.trim() == name)
                .ok_or_else(|| bad(format!("parameter {name} missing from the PSF table")))?;
            Ok(Legendre {
                wavemin,
                wavemax,
                ncoef,
                coeff: coeff[row * repeat..(row + 1) * repeat].to_vec(),
            })
        };
        let tail_amplitude = names
            .iter()
            .any(|n| n.trim() == "TAILAMP")
            .then(|| param("TAILAMP"))
            .transpose()?
            .map_or(0.0, |t| {
                t.coeff.iter().fold(0.0, |m, c| f64::max(m, c.abs()))
            });
        if tail_amplitude != 0.0 {
            tracing::warn!(
                "{}: TAILAMP is not zero (up to {tail_amplitude:.3e}); PSF tails are not modelled",
                path.display()
            );
        }
        let ghsigx = param("GHSIGX")?;
        let ghsigy = param("GHSIGY")?;
        let mut gh = Vec::with_capacity((ghdegx + 1) * (ghdegy + 1));
        for i in 0..=ghdegx {
            for j in 0..=ghdegy {
                gh.push(param(&format!("GH-{i}-{j}"))?);
            }
        }

        let mut trace = |name: &str| -> Result<Legendre> {
            fits.move_to(name)?;
            let wmin = fits.require_f64("WAVEMIN")?;
            let wmax = fits.require_f64("WAVEMAX")?;
            let (shape, data) = fits.read_image::<f64>()?;
            if shape.len() != 2 || shape[0] != nfiber || shape[1] == 0 {
                return Err(bad(format!(
                    "{name} has shape {shape:?}, expected [{nfiber}, ncoef]"
                )));
            }
            Ok(Legendre {
                wavemin: wmin,
                wavemax: wmax,
                ncoef: shape[1],
                coeff: data,
            })
        };
        let xtrace = trace("XTRACE")?;
        let ytrace = trace("YTRACE")?;

        let psf = GaussHermitePsf {
            path: path.into(),
            nfiber,
            hsizex,
            hsizey,
            ghdegx,
            ghdegy,
            legdeg,
            npix_x,
            npix_y,
            psferr,
            orig_psf,
            tail_amplitude,
            xtrace,
            ytrace,
            ghsigx,
            ghsigy,
            gh,
        };
        psf.validate()?;
        Ok(psf)
    }

    /// Checks what the model relies on, whether the PSF comes from its file or from another
    /// rank: spot sizes, degrees, one series per Gauss-Hermite term, and finite coefficients
    /// for every fiber on a non-empty wavelength domain.
    pub fn validate(&self) -> Result<()> {
        let bad = |message: String| Error::Psf {
            path: self.path.clone(),
            message,
        };
        let (hx, hy) = (self.hsizex, self.hsizey);
        if !(1..=MAX_HSIZE).contains(&hx) || !(1..=MAX_HSIZE).contains(&hy) {
            return Err(bad(format!(
                "spot half sizes HSIZEX {hx}, HSIZEY {hy} out of range 1..{MAX_HSIZE}"
            )));
        }
        if self.ghdegx > MAX_GHDEG || self.ghdegy > MAX_GHDEG {
            return Err(bad(format!(
                "Gauss-Hermite degrees {}, {} above {MAX_GHDEG}",
                self.ghdegx, self.ghdegy
            )));
        }
        if self.gh.len() != self.ngh() {
            return Err(bad(format!(
                "{} Gauss-Hermite terms for degrees {}, {}",
                self.gh.len(),
                self.ghdegx,
                self.ghdegy
            )));
        }
        if self.nfiber == 0 {
            return Err(bad("no fibers".into()));
        }
        let named = [
            ("XTRACE".to_string(), &self.xtrace),
            ("YTRACE".to_string(), &self.ytrace),
            ("GHSIGX".to_string(), &self.ghsigx),
            ("GHSIGY".to_string(), &self.ghsigy),
        ];
        let gh = self.gh.iter().enumerate().map(|(k, l)| {
            let (i, j) = (k / (self.ghdegy + 1), k % (self.ghdegy + 1));
            (format!("GH-{i}-{j}"), l)
        });
        for (name, l) in named.into_iter().chain(gh) {
            if !(l.wavemax > l.wavemin) {
                return Err(bad(format!(
                    "{name} WAVEMAX {} <= WAVEMIN {}",
                    l.wavemax, l.wavemin
                )));
            }
            if l.ncoef == 0 || l.coeff.len() != self.nfiber * l.ncoef {
                return Err(bad(format!(
                    "{name} has {} coefficients for {} fibers of degree {}",
                    l.coeff.len(),
                    self.nfiber,
                    l.ncoef as i64 - 1
                )));
            }
            if l.coeff.iter().any(|v| !v.is_finite()) {
                return Err(bad(format!("{name} has non-finite coefficients")));
            }
        }
        Ok(())
    }
}
