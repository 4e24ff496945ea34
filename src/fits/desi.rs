//! What desispec's files carry besides the arrays: unsigned 32-bit images (MASK), keyword
//! values written exactly (shortest round-trip floats, long strings), the check of
//! CHECKSUM/DATASUM, and read-write access with keyword comments for tables appended to a written file (SCORES).

use std::ffi::c_int;
use std::path::Path;

use fitsio::sys;

use super::{cstring, failure_message, run, Element, Fits};
use crate::error::{Error, Result};

const READWRITE: c_int = 1;

impl Element for u32 {
    /// TUINT: cfitsio stores it as BITPIX 32 with BZERO 2^31, as astropy writes uint32.
    const DATATYPE: c_int = 30;
    /// ULONG_IMG.
    const BITPIX: c_int = 40;
    const UNDEFINED: Self = 0;
}

/// A float as a FITS value that reads back to the same bits: the shortest round-trip digits
/// (what Python's `repr`, and so astropy, writes), with a decimal point and an upper-case
/// exponent as FITS requires.
pub fn fits_float(v: f64) -> String {
    let s = format!("{v:?}");
    match s.split_once('e') {
        Some((mantissa, exponent)) if mantissa.contains('.') => format!("{mantissa}E{exponent}"),
        Some((mantissa, exponent)) => format!("{mantissa}.0E{exponent}"),
        None => s,
    }
}

impl Fits {
    /// Opens an existing file for reading and writing (its name taken literally); HDUs
    /// created then are appended at its end.
    pub fn open_rw(path: &Path) -> Result<Self> {
        let name = super::path_cstring(path);
        let mut ptr = std::ptr::null_mut();
        // SAFETY: `name` is NUL-terminated and outlives the call; cfitsio stores a handle in
        // `ptr` (null on failure) and only reads the name.
        run(|status| unsafe {
            sys::ffdkopn(&mut ptr, name.as_ptr(), READWRITE, status);
        })
        .map_err(|(status, cause)| Error::Fits {
            path: path.into(),
            what: "cannot open for writing".into(),
            message: failure_message(status, cause),
        })?;
        Ok(Fits::new(ptr, path))
    }

    /// Replaces the comment of an existing keyword of the current HDU (a column's TTYPE card,
    /// for instance).
    pub fn set_key_comment(&mut self, key: &str, comment: &str) -> Result<()> {
        let (k, c) = (cstring(key), cstring(comment));
        let what = format!("cannot write the comment of keyword {key}");
        // SAFETY: `k` and `c` are NUL-terminated and outlive the call; cfitsio copies them.
        self.call(&what, |ptr, status| unsafe {
            sys::ffmcom(ptr, k.as_ptr(), c.as_ptr(), status);
        })
    }

    /// Writes (or replaces) a floating-point keyword whose value reads back bit for bit
    /// (cfitsio's own formatting keeps 15 significant digits).
    pub fn write_key_f64_exact(&mut self, key: &str, value: f64, comment: &str) -> Result<()> {
        let what = format!("cannot write keyword {key}");
        if !value.is_finite() {
            return Err(self.error(&what, format!("{value} is not a FITS number")));
        }
        let mut card = format!("{key:<8}= {:>20} / {comment}", fits_float(value));
        card.truncate(80);
        let (k, c) = (cstring(key), cstring(&card));
        // SAFETY: `k` and `c` are NUL-terminated and outlive the call; cfitsio copies them.
        self.call(&what, |ptr, status| unsafe {
            sys::ffucrd(ptr, k.as_ptr(), c.as_ptr(), status);
        })
    }

    /// Writes (or replaces) a string keyword of any length: values over 68 characters are
    /// continued on CONTINUE cards (the long-string convention astropy and fitsio read).
    pub fn write_key_long_str(&mut self, key: &str, value: &str, comment: &str) -> Result<()> {
        let (k, v, c) = (cstring(key), cstring(value), cstring(comment));
        // SAFETY: the three strings are NUL-terminated and outlive the call; cfitsio copies
        // them.
        self.call(
            &format!("cannot write keyword {key}"),
            |ptr, status| unsafe {
                sys::ffukls(ptr, k.as_ptr(), v.as_ptr(), c.as_ptr(), status);
            },
        )
    }

    /// Number of HDUs in the file.
    pub fn hdu_count(&mut self) -> Result<usize> {
        let mut n = 0;
        // SAFETY: a valid handle and an out-parameter that lives through the call.
        self.call("cannot count HDUs", |ptr, status| unsafe {
            sys::ffthdu(ptr, &mut n, status);
        })?;
        Ok(n as usize)
    }

    /// Moves to HDU number `index` (0: the primary HDU).
    pub fn move_to_index(&mut self, index: usize) -> Result<()> {
        let mut hdutype = 0;
        self.hdu = format!("#{index}");
        // SAFETY: a valid handle and an out-parameter; cfitsio reports a bad index through
        // `status`.
        self.call("cannot move", |ptr, status| unsafe {
            sys::ffmahd(ptr, index as c_int + 1, &mut hdutype, status);
        })
    }

    /// Verifies CHECKSUM and DATASUM of every HDU (cfitsio's `fits_verify_chksum`): for each
    /// HDU, `(data, hdu)` with 1 correct, 0 missing, -1 wrong.
    pub fn verify_checksums(&mut self) -> Result<Vec<(i32, i32)>> {
        let mut out = Vec::new();
        for index in 0..self.hdu_count()? {
            self.move_to_index(index)?;
            let (mut data, mut hdu) = (0, 0);
            // SAFETY: a valid handle on an existing HDU; the two integers are out-parameters.
            self.call("cannot verify CHECKSUM", |ptr, status| unsafe {
                sys::ffvcks(ptr, &mut data, &mut hdu, status);
            })?;
            out.push((data, hdu));
        }
        Ok(out)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn floats_are_written_as_python_repr_and_read_back_exactly() {
        assert_eq!(fits_float(0.8), "0.8");
        assert_eq!(fits_float(5760.0), "5760.0");
        assert_eq!(fits_float(1e-7), "1.0E-7");
        assert_eq!(fits_float(1.5e300), "1.5E300");
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("k.fits");
        let values = [
            0.8,
            1.000_123_456_789_012_3,
            1e-7,
            7620.000000000423,
            -3.25e-210,
        ];
        let mut f = Fits::create(&path).unwrap();
        f.write_image::<f32>("X", &[1], &[0.0]).unwrap();
        for (i, &v) in values.iter().enumerate() {
            f.write_key_f64_exact(&format!("V{i}"), v, "value").unwrap();
        }
        f.write_key_f64_exact("V0", 0.5, "replaced in place")
            .unwrap();
        let long = "x".repeat(150);
        f.write_key_long_str("LONG", &long, "").unwrap();
        f.close().unwrap();
        let mut f = Fits::open(&path).unwrap();
        assert_eq!(f.key_f64("V0").unwrap(), Some(0.5));
        for (i, &v) in values.iter().enumerate().skip(1) {
            assert_eq!(
                f.key_f64(&format!("V{i}")).unwrap().map(f64::to_bits),
                Some(v.to_bits())
            );
        }
        let cards = f.cards().unwrap();
        assert_eq!(cards.iter().filter(|c| c.starts_with("V0 ")).count(), 1);
        assert!(
            cards.iter().any(|c| c.starts_with("CONTINUE")),
            "long string continued"
        );
    }
}
