//! A small safe layer over cfitsio (through `fitsio::sys`) for what spex reads and writes:
//! images by HDU name (plain or tile-compressed), header keywords and raw cards, vector table
//! columns, and whole-HDU copies with a row slice. Every error names the file and the HDU.

use std::ffi::{c_char, c_int, c_long, c_void, CStr, CString};
use std::path::{Path, PathBuf};

use fitsio::sys;

use crate::error::{Error, Result};

const READONLY: c_int = 0;
const ANY_HDU: c_int = -1;
const KEY_NO_EXIST: c_int = 202;
const FLEN_CARD: usize = 81;
const FLEN_VALUE: usize = 71;
const FLEN_ERRMSG: usize = 81;

/// Element types that cfitsio converts to and from.
pub trait Element: Copy + Default {
    /// cfitsio's `datatype` code (TFLOAT, TDOUBLE, TINT...).
    const DATATYPE: c_int;
    /// BITPIX of an image HDU written with this type.
    const BITPIX: c_int;
}

impl Element for f32 {
    const DATATYPE: c_int = 42;
    const BITPIX: c_int = -32;
}
impl Element for f64 {
    const DATATYPE: c_int = 82;
    const BITPIX: c_int = -64;
}
impl Element for i32 {
    const DATATYPE: c_int = 31;
    const BITPIX: c_int = 32;
}
impl Element for u8 {
    const DATATYPE: c_int = 11;
    const BITPIX: c_int = 8;
}

/// An open FITS file; closed (and flushed) on drop or by [`Fits::close`].
pub struct Fits {
    ptr: *mut sys::fitsfile,
    path: PathBuf,
    hdu: String,
}

// cfitsio handles are used by one thread at a time; spex never shares one.
unsafe impl Send for Fits {}

fn cstring(s: &str) -> CString {
    CString::new(s.replace('\0', " ")).unwrap_or_default()
}

fn buffer_to_string(buf: &[c_char]) -> String {
    // SAFETY: cfitsio always NUL-terminates the buffers it fills.
    unsafe { CStr::from_ptr(buf.as_ptr()) }
        .to_string_lossy()
        .trim_end()
        .to_string()
}

/// cfitsio's text for a status code, plus the first message of its error stack.
fn status_message(status: c_int) -> String {
    let mut text = [0 as c_char; FLEN_ERRMSG];
    unsafe { sys::ffgerr(status, text.as_mut_ptr()) };
    let mut message = buffer_to_string(&text);
    let mut detail = [0 as c_char; FLEN_ERRMSG];
    if unsafe { sys::ffgmsg(detail.as_mut_ptr()) } != 0 {
        let detail = buffer_to_string(&detail);
        if !detail.is_empty() && detail != message {
            message = format!("{message} ({detail})");
        }
    }
    unsafe { sys::ffcmsg() };
    message
}

impl Fits {
    /// Opens an existing file read-only.
    pub fn open(path: &Path) -> Result<Self> {
        if !path.exists() {
            return Err(Error::Fits {
                path: path.into(),
                what: "cannot open".into(),
                message: "no such file".into(),
            });
        }
        let name = cstring(&path.to_string_lossy());
        let mut ptr = std::ptr::null_mut();
        let mut status = 0;
        unsafe { sys::ffopen(&mut ptr, name.as_ptr(), READONLY, &mut status) };
        let fits = Fits {
            ptr,
            path: path.into(),
            hdu: "primary".into(),
        };
        fits.check(status, "cannot open")?;
        Ok(fits)
    }

    /// Creates a new file, replacing any file of that name.
    pub fn create(path: &Path) -> Result<Self> {
        if path.exists() {
            std::fs::remove_file(path).map_err(|source| Error::Io {
                path: path.into(),
                source,
            })?;
        }
        let name = cstring(&path.to_string_lossy());
        let mut ptr = std::ptr::null_mut();
        let mut status = 0;
        unsafe { sys::ffinit(&mut ptr, name.as_ptr(), &mut status) };
        let fits = Fits {
            ptr,
            path: path.into(),
            hdu: "primary".into(),
        };
        fits.check(status, "cannot create")?;
        Ok(fits)
    }

    /// The file's path, for messages.
    pub fn path(&self) -> &Path {
        &self.path
    }

    fn check(&self, status: c_int, what: &str) -> Result<()> {
        if status == 0 {
            return Ok(());
        }
        Err(self.error(what, status_message(status)))
    }

    /// An error about the current HDU of this file.
    pub fn error(&self, what: &str, message: impl Into<String>) -> Error {
        Error::Fits {
            path: self.path.clone(),
            what: format!("HDU {}: {what}", self.hdu),
            message: message.into(),
        }
    }

    /// Moves to the HDU whose EXTNAME (or HDUNAME) is `name`.
    pub fn move_to(&mut self, name: &str) -> Result<()> {
        let mut cname = cstring(name).into_bytes_with_nul();
        let mut status = 0;
        unsafe {
            sys::ffmnhd(
                self.ptr,
                ANY_HDU,
                cname.as_mut_ptr() as *mut c_char,
                0,
                &mut status,
            )
        };
        if status != 0 {
            unsafe { sys::ffcmsg() };
            return Err(Error::Fits {
                path: self.path.clone(),
                what: format!("HDU {name}"),
                message: "missing".into(),
            });
        }
        self.hdu = name.to_string();
        Ok(())
    }

    /// Whether the file has an HDU named `name` (the current HDU changes if it does).
    pub fn has_hdu(&mut self, name: &str) -> bool {
        self.move_to(name).is_ok()
    }

    /// Moves to the primary HDU.
    pub fn move_to_primary(&mut self) -> Result<()> {
        let mut status = 0;
        let mut hdutype = 0;
        unsafe { sys::ffmahd(self.ptr, 1, &mut hdutype, &mut status) };
        self.hdu = "primary".into();
        self.check(status, "cannot move")
    }

    /// Reads a keyword of the current HDU as f64; `None` if absent.
    pub fn key_f64(&mut self, key: &str) -> Result<Option<f64>> {
        let ckey = cstring(key);
        let mut value = 0f64;
        let mut status = 0;
        unsafe {
            sys::ffgkyd(
                self.ptr,
                ckey.as_ptr(),
                &mut value,
                std::ptr::null_mut(),
                &mut status,
            )
        };
        if status == KEY_NO_EXIST {
            unsafe { sys::ffcmsg() };
            return Ok(None);
        }
        self.check(status, &format!("keyword {key}"))?;
        Ok(Some(value))
    }

    /// Reads a keyword of the current HDU as an integer; `None` if absent.
    pub fn key_i64(&mut self, key: &str) -> Result<Option<i64>> {
        let ckey = cstring(key);
        let mut value: c_long = 0;
        let mut status = 0;
        unsafe {
            sys::ffgkyj(
                self.ptr,
                ckey.as_ptr(),
                &mut value,
                std::ptr::null_mut(),
                &mut status,
            )
        };
        if status == KEY_NO_EXIST {
            unsafe { sys::ffcmsg() };
            return Ok(None);
        }
        self.check(status, &format!("keyword {key}"))?;
        Ok(Some(value as i64))
    }

    /// Reads a string keyword of the current HDU; `None` if absent.
    pub fn key_str(&mut self, key: &str) -> Result<Option<String>> {
        let ckey = cstring(key);
        let mut value = [0 as c_char; FLEN_VALUE];
        let mut status = 0;
        unsafe {
            sys::ffgkys(
                self.ptr,
                ckey.as_ptr(),
                value.as_mut_ptr(),
                std::ptr::null_mut(),
                &mut status,
            )
        };
        if status == KEY_NO_EXIST {
            unsafe { sys::ffcmsg() };
            return Ok(None);
        }
        self.check(status, &format!("keyword {key}"))?;
        Ok(Some(buffer_to_string(&value)))
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
        let mut nexist = 0;
        let mut nmore = 0;
        let mut status = 0;
        unsafe { sys::ffghsp(self.ptr, &mut nexist, &mut nmore, &mut status) };
        self.check(status, "cannot read header")?;
        let mut cards = Vec::with_capacity(nexist as usize);
        for i in 1..=nexist {
            let mut card = [0 as c_char; FLEN_CARD];
            unsafe { sys::ffgrec(self.ptr, i, card.as_mut_ptr(), &mut status) };
            self.check(status, "cannot read header")?;
            cards.push(buffer_to_string(&card));
        }
        Ok(cards)
    }

    /// Shape of the current image HDU in C order (slowest axis first).
    pub fn image_shape(&mut self) -> Result<Vec<usize>> {
        let mut naxis = 0;
        let mut status = 0;
        unsafe { sys::ffgidm(self.ptr, &mut naxis, &mut status) };
        self.check(status, "not an image")?;
        let mut naxes = vec![0 as c_long; naxis.max(1) as usize];
        unsafe { sys::ffgisz(self.ptr, naxis, naxes.as_mut_ptr(), &mut status) };
        self.check(status, "not an image")?;
        naxes.truncate(naxis as usize);
        Ok(naxes.iter().rev().map(|&n| n as usize).collect())
    }

    /// Reads the whole current image, converted to `T`, in C order.
    pub fn read_image<T: Element>(&mut self) -> Result<(Vec<usize>, Vec<T>)> {
        let shape = self.image_shape()?;
        let n: usize = shape.iter().product();
        let mut data = vec![T::default(); n];
        let mut status = 0;
        let mut anynul = 0;
        if n > 0 {
            unsafe {
                sys::ffgpv(
                    self.ptr,
                    T::DATATYPE,
                    1,
                    n as i64,
                    std::ptr::null_mut(),
                    data.as_mut_ptr() as *mut c_void,
                    &mut anynul,
                    &mut status,
                )
            };
        }
        self.check(status, "cannot read image")?;
        Ok((shape, data))
    }

    /// Number of rows of the current table HDU.
    pub fn nrows(&mut self) -> Result<usize> {
        let mut nrows: c_long = 0;
        let mut status = 0;
        unsafe { sys::ffgnrw(self.ptr, &mut nrows, &mut status) };
        self.check(status, "not a table")?;
        Ok(nrows as usize)
    }

    fn column_number(&mut self, name: &str) -> Result<(c_int, usize, usize)> {
        let mut cname = cstring(name).into_bytes_with_nul();
        let mut colnum = 0;
        let mut status = 0;
        unsafe {
            sys::ffgcno(
                self.ptr,
                0,
                cname.as_mut_ptr() as *mut c_char,
                &mut colnum,
                &mut status,
            )
        };
        if status != 0 {
            unsafe { sys::ffcmsg() };
            return Err(self.error(&format!("column {name}"), "missing"));
        }
        let mut typecode = 0;
        let mut repeat: c_long = 0;
        let mut width: c_long = 0;
        unsafe {
            sys::ffgtcl(
                self.ptr,
                colnum,
                &mut typecode,
                &mut repeat,
                &mut width,
                &mut status,
            )
        };
        self.check(status, &format!("column {name}"))?;
        Ok((colnum, repeat as usize, width as usize))
    }

    /// Reads a numeric (possibly vector) column: all rows, `repeat` values per row.
    pub fn column<T: Element>(&mut self, name: &str) -> Result<(usize, Vec<T>)> {
        let (colnum, repeat, _) = self.column_number(name)?;
        let nrows = self.nrows()?;
        let n = nrows * repeat;
        let mut data = vec![T::default(); n];
        let mut status = 0;
        let mut anynul = 0;
        if n > 0 {
            unsafe {
                sys::ffgcv(
                    self.ptr,
                    T::DATATYPE,
                    colnum,
                    1,
                    1,
                    n as i64,
                    std::ptr::null_mut(),
                    data.as_mut_ptr() as *mut c_void,
                    &mut anynul,
                    &mut status,
                )
            };
        }
        self.check(status, &format!("cannot read column {name}"))?;
        Ok((repeat, data))
    }

    /// Reads a string column, trailing blanks removed.
    pub fn column_str(&mut self, name: &str) -> Result<Vec<String>> {
        let (colnum, repeat, _) = self.column_number(name)?;
        let nrows = self.nrows()?;
        let mut storage = vec![vec![0 as c_char; repeat + 1]; nrows];
        let mut pointers: Vec<*mut c_char> = storage.iter_mut().map(|s| s.as_mut_ptr()).collect();
        let mut status = 0;
        let mut anynul = 0;
        let mut nulval = [0 as c_char; 1];
        if nrows > 0 {
            unsafe {
                sys::ffgcvs(
                    self.ptr,
                    colnum,
                    1,
                    1,
                    nrows as i64,
                    nulval.as_mut_ptr(),
                    pointers.as_mut_ptr(),
                    &mut anynul,
                    &mut status,
                )
            };
        }
        self.check(status, &format!("cannot read column {name}"))?;
        Ok(storage.iter().map(|s| buffer_to_string(s)).collect())
    }

    /// Appends an image HDU (the primary one if the file is empty) and writes `data` into it.
    pub fn write_image<T: Element>(
        &mut self,
        extname: &str,
        shape: &[usize],
        data: &[T],
    ) -> Result<()> {
        assert_eq!(
            shape.iter().product::<usize>(),
            data.len(),
            "image shape and data disagree"
        );
        self.hdu = extname.to_string();
        let mut naxes: Vec<c_long> = shape.iter().rev().map(|&n| n as c_long).collect();
        let mut status = 0;
        unsafe {
            sys::ffcrim(
                self.ptr,
                T::BITPIX,
                naxes.len() as c_int,
                naxes.as_mut_ptr(),
                &mut status,
            )
        };
        self.check(status, "cannot create image")?;
        self.write_key_str("EXTNAME", extname, "")?;
        if !data.is_empty() {
            unsafe {
                sys::ffppr(
                    self.ptr,
                    T::DATATYPE,
                    1,
                    data.len() as i64,
                    data.as_ptr() as *mut c_void,
                    &mut status,
                )
            };
        }
        self.check(status, "cannot write image")
    }

    /// Writes (or replaces) a string keyword in the current HDU.
    pub fn write_key_str(&mut self, key: &str, value: &str, comment: &str) -> Result<()> {
        let (k, v, c) = (cstring(key), cstring(value), cstring(comment));
        let mut status = 0;
        unsafe { sys::ffukys(self.ptr, k.as_ptr(), v.as_ptr(), c.as_ptr(), &mut status) };
        self.check(status, &format!("cannot write keyword {key}"))
    }

    /// Writes (or replaces) a floating-point keyword in the current HDU.
    pub fn write_key_f64(&mut self, key: &str, value: f64, comment: &str) -> Result<()> {
        let (k, c) = (cstring(key), cstring(comment));
        let mut v = value;
        let mut status = 0;
        unsafe {
            sys::ffuky(
                self.ptr,
                82,
                k.as_ptr(),
                &mut v as *mut f64 as *mut c_void,
                c.as_ptr(),
                &mut status,
            )
        };
        self.check(status, &format!("cannot write keyword {key}"))
    }

    /// Writes (or replaces) an integer keyword in the current HDU.
    pub fn write_key_i64(&mut self, key: &str, value: i64, comment: &str) -> Result<()> {
        let (k, c) = (cstring(key), cstring(comment));
        let mut v = value;
        let mut status = 0;
        unsafe {
            sys::ffuky(
                self.ptr,
                81,
                k.as_ptr(),
                &mut v as *mut i64 as *mut c_void,
                c.as_ptr(),
                &mut status,
            )
        };
        self.check(status, &format!("cannot write keyword {key}"))
    }

    /// Appends a raw 80-character card to the current HDU.
    pub fn write_card(&mut self, card: &str) -> Result<()> {
        let c = cstring(card);
        let mut status = 0;
        unsafe { sys::ffprec(self.ptr, c.as_ptr(), &mut status) };
        self.check(status, "cannot write header card")
    }

    /// Appends a copy of `src`'s HDU `name` to this file, keeping only the table rows in
    /// `rows` (all rows when `None`).
    pub fn copy_table(
        &mut self,
        src: &mut Fits,
        name: &str,
        rows: Option<std::ops::Range<usize>>,
    ) -> Result<()> {
        src.move_to(name)?;
        let mut status = 0;
        unsafe { sys::ffcopy(src.ptr, self.ptr, 0, &mut status) };
        self.hdu = name.to_string();
        self.check(status, "cannot copy table")?;
        if let Some(rows) = rows {
            let nrows = self.nrows()?;
            if rows.end > nrows {
                return Err(self.error(
                    "cannot slice table",
                    format!(
                        "rows {}..{} requested, the table has {nrows}",
                        rows.start, rows.end
                    ),
                ));
            }
            if rows.end < nrows {
                unsafe {
                    sys::ffdrow(
                        self.ptr,
                        rows.end as i64 + 1,
                        (nrows - rows.end) as i64,
                        &mut status,
                    )
                };
            }
            if rows.start > 0 {
                unsafe { sys::ffdrow(self.ptr, 1, rows.start as i64, &mut status) };
            }
            self.check(status, "cannot slice table")?;
        }
        Ok(())
    }

    /// Closes the file, reporting any error of the final flush.
    pub fn close(mut self) -> Result<()> {
        let mut status = 0;
        unsafe { sys::ffclos(self.ptr, &mut status) };
        self.ptr = std::ptr::null_mut();
        self.check(status, "cannot close")
    }
}

impl Drop for Fits {
    fn drop(&mut self) {
        if !self.ptr.is_null() {
            let mut status = 0;
            unsafe { sys::ffclos(self.ptr, &mut status) };
        }
    }
}

/// Whether a header card belongs to the structure of its HDU (axes, compression, checksums)
/// rather than to its content, and so must not be copied into another HDU.
pub fn is_structural_card(card: &str) -> bool {
    let key = card.get(..8).unwrap_or(card).trim_end();
    const EXACT: &[&str] = &[
        "SIMPLE", "BITPIX", "NAXIS", "EXTEND", "XTENSION", "PCOUNT", "GCOUNT", "EXTNAME", "BSCALE",
        "BZERO", "CHECKSUM", "DATASUM", "TFIELDS", "THEAP", "END", "",
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

impl Element for i64 {
    const DATATYPE: c_int = 81;
    const BITPIX: c_int = 64;
}

const BINARY_TBL: c_int = 2;

impl Fits {
    /// Appends a binary table HDU of `nrows` rows with the given columns (`(TTYPE, TFORM)`,
    /// e.g. `("FIBER", "J")`, `("OBJTYPE", "3A")`); fill it with [`Fits::write_column`] and
    /// [`Fits::write_column_str`].
    pub fn create_table(
        &mut self,
        extname: &str,
        columns: &[(&str, &str)],
        nrows: usize,
    ) -> Result<()> {
        self.hdu = extname.to_string();
        let names: Vec<CString> = columns.iter().map(|(n, _)| cstring(n)).collect();
        let forms: Vec<CString> = columns.iter().map(|(_, f)| cstring(f)).collect();
        // cfitsio takes `char **` but does not modify the strings.
        let mut name_ptrs: Vec<*mut c_char> =
            names.iter().map(|s| s.as_ptr() as *mut c_char).collect();
        let mut form_ptrs: Vec<*mut c_char> =
            forms.iter().map(|s| s.as_ptr() as *mut c_char).collect();
        let cext = cstring(extname);
        let mut status = 0;
        unsafe {
            sys::ffcrtb(
                self.ptr,
                BINARY_TBL,
                nrows as i64,
                columns.len() as c_int,
                name_ptrs.as_mut_ptr(),
                form_ptrs.as_mut_ptr(),
                std::ptr::null_mut(),
                cext.as_ptr(),
                &mut status,
            )
        };
        self.check(status, "cannot create table")
    }

    /// Writes `data` into the numeric column `name` of the current table, from the first row
    /// on (`repeat` values per row for vector columns).
    pub fn write_column<T: Element>(&mut self, name: &str, data: &[T]) -> Result<()> {
        let (colnum, _, _) = self.column_number(name)?;
        let mut status = 0;
        if !data.is_empty() {
            unsafe {
                sys::ffpcl(
                    self.ptr,
                    T::DATATYPE,
                    colnum,
                    1,
                    1,
                    data.len() as i64,
                    data.as_ptr() as *mut c_void,
                    &mut status,
                )
            };
        }
        self.check(status, &format!("cannot write column {name}"))
    }

    /// Writes one string per row into the character column `name` of the current table
    /// (cfitsio pads or truncates to the column width).
    pub fn write_column_str(&mut self, name: &str, data: &[&str]) -> Result<()> {
        let (colnum, _, _) = self.column_number(name)?;
        let strings: Vec<CString> = data.iter().map(|s| cstring(s)).collect();
        let mut pointers: Vec<*mut c_char> =
            strings.iter().map(|s| s.as_ptr() as *mut c_char).collect();
        let mut status = 0;
        if !data.is_empty() {
            unsafe {
                sys::ffpcls(
                    self.ptr,
                    colnum,
                    1,
                    1,
                    data.len() as i64,
                    pointers.as_mut_ptr(),
                    &mut status,
                )
            };
        }
        self.check(status, &format!("cannot write column {name}"))
    }
}

// Read-write access and keyword comments, for tables appended to a written file (SCORES).

const READWRITE: c_int = 1;

impl Fits {
    /// Opens an existing file for reading and writing; HDUs created then are appended at its
    /// end.
    pub fn open_rw(path: &Path) -> Result<Self> {
        let name = cstring(&path.to_string_lossy());
        let mut ptr = std::ptr::null_mut();
        let mut status = 0;
        unsafe { sys::ffopen(&mut ptr, name.as_ptr(), READWRITE, &mut status) };
        let fits = Fits {
            ptr,
            path: path.into(),
            hdu: "primary".into(),
        };
        fits.check(status, "cannot open for writing")?;
        Ok(fits)
    }

    /// Replaces the comment of an existing keyword of the current HDU (a column's TTYPE card,
    /// for instance).
    pub fn set_key_comment(&mut self, key: &str, comment: &str) -> Result<()> {
        let (k, c) = (cstring(key), cstring(comment));
        let mut status = 0;
        unsafe { sys::ffmcom(self.ptr, k.as_ptr(), c.as_ptr(), &mut status) };
        self.check(
            status,
            &format!("cannot write the comment of keyword {key}"),
        )
    }
}

// ---------------------------------------------------------------------------------------------
// What desispec's files carry besides the arrays: unsigned 32-bit images (MASK), keyword values
// written exactly (shortest round-trip floats, long strings), and CHECKSUM/DATASUM.

impl Element for u32 {
    /// TUINT: cfitsio stores it as BITPIX 32 with BZERO 2^31, as astropy writes uint32.
    const DATATYPE: c_int = 30;
    /// ULONG_IMG.
    const BITPIX: c_int = 40;
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
    /// Writes (or replaces) a floating-point keyword whose value reads back bit for bit
    /// (cfitsio's own formatting keeps 15 significant digits).
    pub fn write_key_f64_exact(&mut self, key: &str, value: f64, comment: &str) -> Result<()> {
        if !value.is_finite() {
            return Err(self.error(
                &format!("cannot write keyword {key}"),
                format!("{value} is not a FITS number"),
            ));
        }
        let mut card = format!("{key:<8}= {:>20} / {comment}", fits_float(value));
        card.truncate(80);
        let (k, c) = (cstring(key), cstring(&card));
        let mut status = 0;
        // SAFETY: `k` and `c` are NUL-terminated and outlive the call; cfitsio copies them.
        unsafe { sys::ffucrd(self.ptr, k.as_ptr(), c.as_ptr(), &mut status) };
        self.check(status, &format!("cannot write keyword {key}"))
    }

    /// Writes (or replaces) a string keyword of any length: values over 68 characters are
    /// continued on CONTINUE cards (the long-string convention astropy and fitsio read).
    pub fn write_key_long_str(&mut self, key: &str, value: &str, comment: &str) -> Result<()> {
        let (k, v, c) = (cstring(key), cstring(value), cstring(comment));
        let mut status = 0;
        // SAFETY: the three strings are NUL-terminated and outlive the call; cfitsio copies them.
        unsafe { sys::ffukls(self.ptr, k.as_ptr(), v.as_ptr(), c.as_ptr(), &mut status) };
        self.check(status, &format!("cannot write keyword {key}"))
    }

    /// Number of HDUs in the file.
    pub fn hdu_count(&mut self) -> Result<usize> {
        let mut n = 0;
        let mut status = 0;
        // SAFETY: `self.ptr` is an open file; `n` and `status` are valid for writes.
        unsafe { sys::ffthdu(self.ptr, &mut n, &mut status) };
        self.check(status, "cannot count HDUs")?;
        Ok(n as usize)
    }

    /// Moves to HDU number `index` (0: the primary HDU).
    pub fn move_to_index(&mut self, index: usize) -> Result<()> {
        let mut status = 0;
        let mut hdutype = 0;
        // SAFETY: `self.ptr` is an open file; cfitsio reports a bad index through `status`.
        unsafe { sys::ffmahd(self.ptr, index as c_int + 1, &mut hdutype, &mut status) };
        self.hdu = format!("#{index}");
        self.check(status, "cannot move")
    }

    /// Computes and writes DATASUM and CHECKSUM in every HDU of the file (cfitsio's
    /// `fits_write_chksum`), replacing stale values such as those of a copied table. Call it
    /// last: any later change to an HDU invalidates its CHECKSUM.
    ///
    /// DATASUM is computed first and written with a plain comment, CHECKSUM zeroed: cfitsio
    /// then only completes CHECKSUM, instead of stamping the time into both comments, and the
    /// same frame gives the same bytes whatever the run that wrote it.
    pub fn write_checksums(&mut self) -> Result<()> {
        for index in 0..self.hdu_count()? {
            self.move_to_index(index)?;
            self.write_key_str("CHECKSUM", "0000000000000000", "HDU checksum")?;
            let (mut datasum, mut hdusum, mut status) = (0, 0, 0);
            // SAFETY: `self.ptr` is an open file positioned on an existing HDU; the sums and
            // `status` are valid for writes.
            unsafe { sys::ffgcks(self.ptr, &mut datasum, &mut hdusum, &mut status) };
            self.check(status, "cannot compute DATASUM")?;
            self.write_key_str("DATASUM", &datasum.to_string(), "data unit checksum")?;
            let mut status = 0;
            // SAFETY: `self.ptr` is an open, writable file positioned on an existing HDU.
            unsafe { sys::ffpcks(self.ptr, &mut status) };
            self.check(status, "cannot write CHECKSUM")?;
        }
        Ok(())
    }

    /// Verifies CHECKSUM and DATASUM of every HDU (cfitsio's `fits_verify_chksum`): for each
    /// HDU, `(data, hdu)` with 1 correct, 0 missing, -1 wrong.
    pub fn verify_checksums(&mut self) -> Result<Vec<(i32, i32)>> {
        let mut out = Vec::new();
        for index in 0..self.hdu_count()? {
            self.move_to_index(index)?;
            let (mut data, mut hdu, mut status) = (0, 0, 0);
            // SAFETY: `self.ptr` is an open file positioned on an existing HDU; the three
            // integers are valid for writes.
            unsafe { sys::ffvcks(self.ptr, &mut data, &mut hdu, &mut status) };
            self.check(status, "cannot verify CHECKSUM")?;
            out.push((data, hdu));
        }
        Ok(out)
    }
}

#[cfg(test)]
mod exact_value_tests {
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
