//! A simulation's outputs: the in-memory extraction input, the truth of a fiber, and the
//! preproc and truth files written together (both or neither).

use std::path::{Path, PathBuf};

use tracing::info;

use super::Simulation;
use crate::error::Result;
use crate::fits::Fits;

impl Simulation {
    /// The simulated frame as an extraction input, without a round trip through a file
    /// (masked pixels already carry IVAR 0).
    pub fn to_image(&self) -> crate::image::Image {
        let nmasked = self.mask.iter().filter(|&&m| m != 0).count();
        crate::image::Image {
            path: PathBuf::from("simulated"),
            nrows: self.nrows,
            ncols: self.ncols,
            pix: self.image.clone(),
            ivar: self.ivar.clone(),
            header: Vec::new(),
            has_fibermap: false,
            nmasked,
            nnonfinite: 0,
            kept_fibermap: Default::default(),
        }
    }

    /// The truth of fiber `fiber` (absolute), photons per bin.
    pub fn truth(&self, fiber: usize) -> Option<&[f64]> {
        if !self.fibers.contains(&fiber) {
            return None;
        }
        let n = self.wave.len();
        let i = fiber - self.fibers.start;
        Some(&self.flux[i * n..(i + 1) * n])
    }

    /// Writes the preproc image and the truth. Each file is written under a temporary name
    /// in its directory and renamed into place once complete; on any error neither output is
    /// left behind (a file already renamed is removed again), so a pair on disk is always
    /// complete and consistent.
    pub fn write(&self, image_path: &Path, truth_path: &Path) -> Result<()> {
        crate::output::write_together(&[image_path, truth_path], |tmp| {
            self.write_image(tmp[0])?;
            self.write_truth(tmp[1])
        })?;
        info!(image = %image_path.display(), truth = %truth_path.display(), "wrote simulation");
        Ok(())
    }

    /// Keywords shared by the IMAGE header and the truth headers.
    fn write_provenance(&self, fits: &mut Fits) -> Result<()> {
        let o = &self.options;
        fits.write_key_str("CAMERA", &self.camera, "camera")?;
        fits.write_key_i64("EXPID", o.expid, "exposure number")?;
        match i64::try_from(o.seed) {
            Ok(seed) => fits.write_key_i64("SIMSEED", seed, "simulation seed")?,
            Err(_) => fits.write_key_str("SIMSEED", &o.seed.to_string(), "simulation seed")?,
        }
        fits.write_key_str("SIMPSF", &self.psf_name, "PSF used for the simulation")?;
        fits.write_key_i64("SIMFIB0", self.fibers.start as i64, "first simulated fiber")?;
        fits.write_key_i64(
            "SIMNFIB",
            self.fibers.len() as i64,
            "number of simulated fibers",
        )?;
        fits.write_key_f64(
            "SIMWMIN",
            self.wave.first().copied().unwrap_or(o.wmin),
            "first truth wavelength [A]",
        )?;
        fits.write_key_f64(
            "SIMWMAX",
            self.wave.last().copied().unwrap_or(o.wmax),
            "last truth wavelength [A]",
        )?;
        fits.write_key_f64("SIMDW", o.dw, "truth bin width [A]")?;
        fits.write_key_str(
            "SIMCODE",
            concat!("spex ", env!("CARGO_PKG_VERSION")),
            "simulation program",
        )
    }

    fn write_image(&self, path: &Path) -> Result<()> {
        let mut fits = Fits::create(path)?;
        fits.reserve_checksums();
        fits.write_array_with("IMAGE", self.image.view(), |f| self.write_image_keys(f))?;
        fits.write_array("IVAR", self.ivar.view())?;
        fits.write_array("MASK", self.mask.view())?;
        self.write_readnoise(&mut fits)?;
        self.write_fibermap(&mut fits)?;
        fits.write_checksums()?;
        fits.close()
    }

    /// The keywords of IMAGE: units, provenance, exposure and how it was simulated.
    fn write_image_keys(&self, fits: &mut Fits) -> Result<()> {
        let o = &self.options;
        fits.write_key_str("BUNIT", "electron", "")?;
        self.write_provenance(fits)?;
        self.write_exposure_keys(fits)?;
        fits.write_key_str("DETECTOR", "sim", "simulated frame")?;
        fits.write_key_f64("SIMRDN", o.read_noise, "read noise [electron]")?;
        fits.write_card(&format!(
            "{:<8}= {:>20} / {}",
            "SIMNOISE",
            if o.noise { "T" } else { "F" },
            "Poisson and read noise added"
        ))?;
        fits.write_key_f64(
            "SIMCOSMD",
            o.cosmic_density,
            "cosmic tracks per million pixels",
        )?;
        fits.write_key_i64("SIMNCOSM", self.ncosmic as i64, "number of cosmic tracks")?;
        fits.write_key_i64(
            "SIMBADC",
            o.bad_column.map_or(-1, |c| c as i64),
            "bad column (-1: none)",
        )?;
        self.write_defect_keys(fits)?;
        fits.write_key_i64("SIMROW0", self.rows.start as i64, "first row with signal")?;
        fits.write_key_i64(
            "SIMROW1",
            self.rows.end as i64,
            "end of the rows with signal",
        )?;
        fits.write_key_i64(
            "SIMCOL0",
            self.cols.start as i64,
            "first column with signal",
        )?;
        fits.write_key_i64(
            "SIMCOL1",
            self.cols.end as i64,
            "end of the columns with signal",
        )
    }

    /// The keywords of the options that change what kind of exposure this is, written only
    /// when used (so a default simulation's header is that of earlier versions).
    fn write_defect_keys(&self, fits: &mut Fits) -> Result<()> {
        let o = &self.options;
        if o.flat {
            fits.write_card(&format!(
                "{:<8}= {:>20} / {}",
                "SIMFLAT", "T", "flat lamp instead of sky and objects"
            ))?;
        }
        if !o.dead_fibers.is_empty() {
            let list: Vec<String> = o.dead_fibers.iter().map(|f| f.to_string()).collect();
            fits.write_key_str("SIMDEAD", &list.join(","), "fibers without light")?;
        }
        if !o.masked_amps.is_empty() {
            let list: Vec<String> = o.masked_amps.iter().map(|a| a.to_string()).collect();
            fits.write_key_str("SIMMAMP", &list.join(","), "masked amplifiers")?;
        }
        Ok(())
    }

    fn write_truth(&self, path: &Path) -> Result<()> {
        let mut fits = Fits::create(path)?;
        // Both HDUs carry the fiber range and the provenance.
        let keys = |fits: &mut Fits| -> Result<()> {
            fits.write_key_i64(
                "FIBERMIN",
                self.fibers.start as i64,
                "fiber of the first FLUX row",
            )?;
            self.write_provenance(fits)
        };
        fits.write_image("WAVELENGTH", &[self.wave.len()], &self.wave)?;
        fits.write_key_str("BUNIT", "Angstrom", "")?;
        keys(&mut fits)?;
        fits.write_image("FLUX", &[self.fibers.len(), self.wave.len()], &self.flux)?;
        fits.write_key_str("BUNIT", "photon", "photons per bin")?;
        keys(&mut fits)?;
        fits.close()
    }
}
