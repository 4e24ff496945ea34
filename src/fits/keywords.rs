//! Header keywords: reading them (typed, or as raw cards), writing them, and which cards
//! describe an HDU's structure rather than its content.

use std::ffi::{c_char, c_int, c_long, c_void};

use fitsio::sys;

use super::{buffer_to_string, cstring, Element, Fits, FLEN_CARD, FLEN_VALUE, KEY_NO_EXIST};
use crate::error::Result;

impl Fits {
    /// Reads a keyword of the current HDU as f64; `None` if absent.
    pub fn key_f64(&mut self, key: &str) -> Result<Option<f64>> {
        let ckey = cstring(key);
        let mut value = 0f64;
        // SAFETY: NUL-terminated key, an out-parameter for the value, no comment wanted.
        let found = self.call_unless(
            KEY_NO_EXIST,
            &format!("keyword {key}"),
            |ptr, status| unsafe {
                sys::ffgkyd(ptr, ckey.as_ptr(), &mut value, std::ptr::null_mut(), status);
            },
        )?;
        Ok(found.then_some(value))
    }

    /// Reads a keyword of the current HDU as an integer; `None` if absent.
    pub fn key_i64(&mut self, key: &str) -> Result<Option<i64>> {
        let ckey = cstring(key);
        let mut value: c_long = 0;
        // SAFETY: NUL-terminated key, an out-parameter for the value, no comment wanted.
        let found = self.call_unless(
            KEY_NO_EXIST,
            &format!("keyword {key}"),
            |ptr, status| unsafe {
                sys::ffgkyj(ptr, ckey.as_ptr(), &mut value, std::ptr::null_mut(), status);
            },
        )?;
        Ok(found.then_some(value as i64))
    }

    /// Reads a string keyword of the current HDU; `None` if absent.
    pub fn key_str(&mut self, key: &str) -> Result<Option<String>> {
        let ckey = cstring(key);
        let mut value = [0 as c_char; FLEN_VALUE];
        // SAFETY: NUL-terminated key; cfitsio writes at most FLEN_VALUE bytes into `value`.
        let found = self.call_unless(
            KEY_NO_EXIST,
            &format!("keyword {key}"),
            |ptr, status| unsafe {
                sys::ffgkys(
                    ptr,
                    ckey.as_ptr(),
                    value.as_mut_ptr(),
                    std::ptr::null_mut(),
                    status,
                );
            },
        )?;
        Ok(found.then(|| buffer_to_string(&value)))
    }

    /// A required keyword, with an error naming it when absent.
    pub fn require_f64(&mut self, key: &str) -> Result<f64> {
        self.key_f64(key)?
            .ok_or_else(|| self.error(&format!("keyword {key}"), "missing"))
    }

    /// A required integer keyword, with an error naming it when absent.
    pub fn require_i64(&mut self, key: &str) -> Result<i64> {
        self.key_i64(key)?
            .ok_or_else(|| self.error(&format!("keyword {key}"), "missing"))
    }

    /// All 80-character header cards of the current HDU, in order.
    pub fn cards(&mut self) -> Result<Vec<String>> {
        let (mut nexist, mut nmore) = (0, 0);
        // SAFETY: a valid handle and two out-parameters.
        self.call("cannot read header", |ptr, status| unsafe {
            sys::ffghsp(ptr, &mut nexist, &mut nmore, status);
        })?;
        (1..=nexist).map(|i| self.card(i)).collect()
    }

    /// Header card number `i` (from 1) of the current HDU.
    fn card(&self, i: c_int) -> Result<String> {
        let mut card = [0 as c_char; FLEN_CARD];
        // SAFETY: cfitsio writes at most FLEN_CARD bytes, NUL included, into `card`.
        self.call("cannot read header", |ptr, status| unsafe {
            sys::ffgrec(ptr, i, card.as_mut_ptr(), status);
        })?;
        Ok(buffer_to_string(&card))
    }

    /// Writes (or replaces) a string keyword in the current HDU.
    pub fn write_key_str(&mut self, key: &str, value: &str, comment: &str) -> Result<()> {
        let (k, v, c) = (cstring(key), cstring(value), cstring(comment));
        // SAFETY: three NUL-terminated strings that cfitsio only reads.
        self.call(
            &format!("cannot write keyword {key}"),
            |ptr, status| unsafe {
                sys::ffukys(ptr, k.as_ptr(), v.as_ptr(), c.as_ptr(), status);
            },
        )
    }

    /// Writes (or replaces) a floating-point keyword in the current HDU.
    pub fn write_key_f64(&mut self, key: &str, value: f64, comment: &str) -> Result<()> {
        self.update_key(key, value, comment)
    }

    /// Writes (or replaces) an integer keyword in the current HDU.
    pub fn write_key_i64(&mut self, key: &str, value: i64, comment: &str) -> Result<()> {
        self.update_key(key, value, comment)
    }

    fn update_key<T: Element>(&mut self, key: &str, value: T, comment: &str) -> Result<()> {
        let (k, c) = (cstring(key), cstring(comment));
        let mut v = value;
        // SAFETY: `v` is of the type DATATYPE names; key and comment are NUL-terminated.
        self.call(
            &format!("cannot write keyword {key}"),
            |ptr, status| unsafe {
                sys::ffuky(
                    ptr,
                    T::DATATYPE,
                    k.as_ptr(),
                    &mut v as *mut T as *mut c_void,
                    c.as_ptr(),
                    status,
                );
            },
        )
    }

    /// Appends a raw 80-character card to the current HDU.
    pub fn write_card(&mut self, card: &str) -> Result<()> {
        let c = cstring(card);
        // SAFETY: a NUL-terminated card that cfitsio only reads.
        self.call("cannot write header card", |ptr, status| unsafe {
            sys::ffprec(ptr, c.as_ptr(), status);
        })
    }
}

/// Whether a header card belongs to the structure of its HDU (axes, compression, checksums)
/// rather than to its content, and so must not be copied into another HDU.
pub fn is_structural_card(card: &str) -> bool {
    let key = card.get(..8).unwrap_or(card).trim_end();
    const EXACT: &[&str] = &[
        "SIMPLE", "BITPIX", "NAXIS", "EXTEND", "XTENSION", "PCOUNT", "GCOUNT", "EXTNAME", "BSCALE",
        "BZERO", "BLANK", "CHECKSUM", "DATASUM", "TFIELDS", "THEAP", "END", "",
    ];
    EXACT.contains(&key)
        || (key.starts_with("NAXIS") && key[5..].chars().all(|c| c.is_ascii_digit()))
        || is_compression_key(key)
        || [
            "TTYPE", "TFORM", "TUNIT", "TDIM", "TNULL", "TSCAL", "TZERO", "TDISP",
        ]
        .iter()
        .any(|p| key.starts_with(p) && key[p.len()..].chars().all(|c| c.is_ascii_digit()))
}

/// Keywords of cfitsio's tile compression, which describe the stored table, not the image.
fn is_compression_key(key: &str) -> bool {
    const FIXED: &[&str] = &[
        "ZIMAGE", "ZBITPIX", "ZCMPTYPE", "ZSIMPLE", "ZEXTEND", "ZBLOCKED", "ZPCOUNT", "ZGCOUNT",
        "ZHECKSUM", "ZDATASUM", "ZQUANTIZ", "ZDITHER0", "ZTENSION", "ZMASKCMP", "ZBLANK", "ZSCALE",
        "ZZERO",
    ];
    const INDEXED: &[&str] = &["ZNAXIS", "ZTILE", "ZNAME", "ZVAL"];
    FIXED.contains(&key)
        || INDEXED
            .iter()
            .any(|p| key.starts_with(p) && key[p.len()..].chars().all(|c| c.is_ascii_digit()))
}
