//! The FLUX header of a frame: the keywords desi_extract_spectra adds to the preproc
//! header (grid, SPECTER, input files shortened as desispec.io does, desiutil.depend's
//! DEPNAMnn/DEPVERnn, ORIG_PSF, FIBERMIN), in its order, and spex's own SPECMIN.

use std::path::Path;

use super::{Frame, FrameMeta};
use crate::error::Result;
use crate::fits::Fits;

/// Environment variables whose values desiutil.depend records in DEPNAMnn/DEPVERnn.
const DEPEND_ENVVARS: [&str; 8] = [
    "DESI_ROOT",
    "DESI_SPECTRO_DATA",
    "DESI_SPECTRO_REDUX",
    "SPECPROD",
    "DESI_SPECTRO_CALIB",
    "DESI_BASIS_TEMPLATES",
    "DESI_TARGET",
    "DESIMODEL",
];

/// The comment of SPECTER, the extraction code's version: desispec writes gpu_specter's
/// repository there; spex writes its own (Cargo.toml's `repository`, its name when unset).
const SPECTER_COMMENT: &str = match env!("CARGO_PKG_REPOSITORY").as_bytes() {
    [] => env!("CARGO_PKG_NAME"),
    _ => env!("CARGO_PKG_REPOSITORY"),
};

impl FrameMeta {
    /// The header of FLUX (and of the model image): the preproc header, then what
    /// desi_extract_spectra adds, in its order.
    pub(super) fn write_header(&self, fits: &mut Fits, frame: &Frame, fibermin: i64) -> Result<()> {
        for card in &self.header {
            fits.write_card(card)?;
        }
        if let Some(f) = self.heliocor.filter(|&f| f != 1.0) {
            fits.write_key_f64_exact("HELIOCOR", f, "barycentric correction factor")?;
        }
        let (wmin, wmax, dw) = self.grid.unwrap_or_else(|| frame.grid());
        fits.write_key_i64("NSPEC", frame.nspec as i64, "Number of spectra")?;
        fits.write_key_f64_exact("WAVEMIN", wmin, "First wavelength [Angstroms]")?;
        fits.write_key_f64_exact("WAVEMAX", wmax, "Last wavelength [Angstroms]")?;
        fits.write_key_f64_exact("WAVESTEP", dw, "Wavelength step size [Angstroms]")?;
        fits.write_key_str("SPECTER", env!("CARGO_PKG_VERSION"), SPECTER_COMMENT)?;
        let env = |k: &str| std::env::var(k).ok();
        if let Some(p) = &self.psf {
            let name = shorten_filename(&p.to_string_lossy(), &env);
            fits.write_key_long_str("IN_PSF", &name, "Input spectral PSF")?;
        }
        if let Some(p) = &self.input {
            let name = shorten_filename(&p.to_string_lossy(), &env);
            fits.write_key_long_str("IN_IMG", &name, "")?;
        }
        set_dependency(fits, "spex", env!("CARGO_PKG_VERSION"))?;
        for var in DEPEND_ENVVARS {
            set_dependency(fits, var, &env(var).unwrap_or_else(|| "NOT_SET".into()))?;
        }
        if let Some(orig) = &self.orig_psf {
            fits.write_key_long_str("ORIG_PSF", orig, "")?;
        }
        fits.write_key_i64("FIBERMIN", fibermin, "")?;
        fits.write_key_i64("SPECMIN", frame.specmin as i64, "first spectrum")
    }
}

/// desiutil.depend's `setdep`: the version of `name` goes into the DEPVERnn of its DEPNAMnn,
/// or into the first free DEPNAMnn/DEPVERnn pair.
fn set_dependency(fits: &mut Fits, name: &str, version: &str) -> Result<()> {
    for i in 0..100 {
        let (namekey, verkey) = (format!("DEPNAM{i:02}"), format!("DEPVER{i:02}"));
        match fits.key_str(&namekey)? {
            Some(n) if n != name => continue,
            Some(_) => return fits.write_key_long_str(&verkey, version, ""),
            None => {
                fits.write_key_str(&namekey, name, "")?;
                return fits.write_key_long_str(&verkey, version, "");
            }
        }
    }
    Err(fits.error("DEPNAMnn", format!("no free DEPNAMnn keyword for {name}")))
}

/// desispec.io.shorten_filename: a path under `$DESI_SPECTRO_CALIB` becomes `SPCALIB/...`,
/// one under the production directory (`$DESI_SPECTRO_REDUX/$SPECPROD`, or its read-only
/// copy under `$DESI_ROOT_READONLY`) `SPECPROD/...`; anything else is kept as given. `env`
/// looks up environment variables.
pub fn shorten_filename(name: &str, env: &dyn Fn(&str) -> Option<String>) -> String {
    if let Some(calib) = env("DESI_SPECTRO_CALIB") {
        if name.starts_with(&calib) {
            return name.replacen(&calib, "SPCALIB", 1);
        }
    }
    let Some(prod) = specprod_root(env) else {
        return name.to_string();
    };
    for root in [prod.clone(), readonly_path(&prod, env)] {
        if name.starts_with(&root) {
            return name.replacen(&root, "SPECPROD", 1);
        }
    }
    name.to_string()
}

/// desispec.io.specprod_root: `$SPECPROD` if it is a path, else under `$DESI_SPECTRO_REDUX`
/// (or `$DESI_ROOT/spectro/redux`); `None` when the variables are not set.
fn specprod_root(env: &dyn Fn(&str) -> Option<String>) -> Option<String> {
    let specprod = env("SPECPROD")?;
    if specprod.contains('/') {
        return Some(specprod);
    }
    match env("DESI_SPECTRO_REDUX") {
        Some(redux) => Some(path_join(&redux, &specprod)),
        None => Some(path_join(
            &path_join(&env("DESI_ROOT")?, "spectro/redux"),
            &specprod,
        )),
    }
}

/// desispec.io.meta.get_readonly_filepath: `$DESI_ROOT` replaced by `$DESI_ROOT_READONLY`
/// when that directory exists.
fn readonly_path(path: &str, env: &dyn Fn(&str) -> Option<String>) -> String {
    let Some(root) = env("DESI_ROOT") else {
        return path.to_string();
    };
    let readonly = env("DESI_ROOT_READONLY")
        .filter(|r| Path::new(r).exists())
        .unwrap_or_else(|| root.clone());
    if path.starts_with(&root) && root != readonly {
        path.replacen(&root, &readonly, 1)
    } else {
        path.to_string()
    }
}

/// Python's `os.path.join` of two components.
fn path_join(a: &str, b: &str) -> String {
    if b.starts_with('/') || a.is_empty() {
        b.to_string()
    } else if a.ends_with('/') {
        format!("{a}{b}")
    } else {
        format!("{a}/{b}")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn environment<'a>(vars: &'a [(&'a str, &'a str)]) -> impl Fn(&str) -> Option<String> + 'a {
        move |k| {
            vars.iter()
                .find(|(n, _)| *n == k)
                .map(|(_, v)| v.to_string())
        }
    }

    #[test]
    fn file_names_are_shortened_as_desispec_does() {
        let prod = [
            ("DESI_SPECTRO_REDUX", "/global/redux"),
            ("SPECPROD", "daily"),
        ];
        let env = environment(&prod);
        assert_eq!(
            shorten_filename("/global/redux/daily/preproc/p.fits", &env),
            "SPECPROD/preproc/p.fits"
        );
        assert_eq!(
            shorten_filename("/elsewhere/p.fits", &env),
            "/elsewhere/p.fits"
        );
        assert_eq!(shorten_filename("relative/p.fits", &env), "relative/p.fits");
        // without SPECPROD nothing is replaced
        let env = environment(&prod[..1]);
        assert_eq!(
            shorten_filename("/global/redux/daily/p.fits", &env),
            "/global/redux/daily/p.fits"
        );
        // calibrations first; SPECPROD as a path; $DESI_ROOT/spectro/redux by default
        let vars = [
            ("DESI_SPECTRO_CALIB", "/cal"),
            ("SPECPROD", "/my/prod/"),
            ("DESI_ROOT", "/desi"),
        ];
        let env = environment(&vars);
        assert_eq!(shorten_filename("/cal/psf.fits", &env), "SPCALIB/psf.fits");
        assert_eq!(shorten_filename("/my/prod/x.fits", &env), "SPECPRODx.fits");
        let vars = [("DESI_ROOT", "/desi"), ("SPECPROD", "loa")];
        let env = environment(&vars);
        assert_eq!(
            shorten_filename("/desi/spectro/redux/loa/x.fits", &env),
            "SPECPROD/x.fits"
        );
        // the read-only copy of the production, when that directory exists
        let ro = std::env::temp_dir();
        let ro = ro.to_str().unwrap();
        let vars = [
            ("DESI_ROOT", "/desi"),
            ("DESI_ROOT_READONLY", ro),
            ("SPECPROD", "loa"),
        ];
        let env = environment(&vars);
        let name = format!("{}/x.fits", path_join(ro, "spectro/redux/loa"));
        assert_eq!(shorten_filename(&name, &env), "SPECPROD/x.fits");
    }
}
