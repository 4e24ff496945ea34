//! Binary tables: reading numeric and string columns, creating tables and writing their
//! columns, and copying a table HDU from another file with a slice of its rows.

use std::ffi::{c_char, c_int, c_long, c_void, CString};

use fitsio::sys;

use super::{buffer_to_string, cstring, Element, Fits, ANY_STATUS};
use crate::error::Result;

const BINARY_TBL: c_int = 2;
/// cfitsio's type codes of numeric columns: TBYTE, TSBYTE, TSHORT, TINT32BIT, TFLOAT,
/// TLONGLONG, TDOUBLE and their unsigned and `int` variants.
const NUMERIC: &[c_int] = &[11, 12, 20, 21, 30, 31, 40, 41, 42, 80, 81, 82];

impl Fits {
    /// Number of rows of the current table HDU.
    pub fn nrows(&mut self) -> Result<usize> {
        let mut nrows: c_long = 0;
        // SAFETY: a valid handle and an out-parameter.
        self.call("not a table", |ptr, status| unsafe {
            sys::ffgnrw(ptr, &mut nrows, status);
        })?;
        Ok(nrows.max(0) as usize)
    }

    /// The number of column `name`, its cfitsio type code (negative for variable-length
    /// arrays), its repeat and its width.
    fn column_number(&mut self, name: &str) -> Result<(c_int, c_int, usize, usize)> {
        let mut cname = cstring(name).into_bytes_with_nul();
        let mut colnum = 0;
        // SAFETY: `cname` is NUL-terminated and only read (case-insensitive match).
        let found = self.call_unless(
            ANY_STATUS,
            &format!("column {name}"),
            |ptr, status| unsafe {
                sys::ffgcno(
                    ptr,
                    0,
                    cname.as_mut_ptr() as *mut c_char,
                    &mut colnum,
                    status,
                );
            },
        )?;
        if !found {
            return Err(self.error(&format!("column {name}"), "missing"));
        }
        let (mut typecode, mut repeat, mut width): (c_int, c_long, c_long) = (0, 0, 0);
        // SAFETY: a valid handle and three out-parameters.
        self.call(&format!("column {name}"), |ptr, status| unsafe {
            sys::ffgtcl(ptr, colnum, &mut typecode, &mut repeat, &mut width, status);
        })?;
        Ok((
            colnum,
            typecode,
            repeat.max(0) as usize,
            width.max(0) as usize,
        ))
    }

    /// Refuses a column whose values are not numbers (strings, logicals, bits, complex,
    /// variable-length arrays): cfitsio would read a string's characters as so many values
    /// and fail past the end of the table.
    fn require_numeric(&mut self, name: &str, colnum: c_int, typecode: c_int) -> Result<()> {
        if NUMERIC.contains(&typecode) {
            return Ok(());
        }
        let tform = self.key_str(&format!("TFORM{colnum}"))?.unwrap_or_default();
        Err(self.error(
            &format!("column {name}"),
            format!(
                "TFORM{colnum} = '{}' is not a column of numbers",
                tform.trim()
            ),
        ))
    }

    /// Reads a numeric (possibly vector) column: all rows, `repeat` values per row.
    pub fn column<T: Element>(&mut self, name: &str) -> Result<(usize, Vec<T>)> {
        let what = format!("cannot read column {name}");
        let (colnum, typecode, repeat, _) = self.column_number(name)?;
        self.require_numeric(name, colnum, typecode)?;
        let nrows = self.nrows()?;
        let n = nrows
            .checked_mul(repeat)
            .ok_or_else(|| self.error(&what, "too many values"))?;
        let mut data = self.buffer::<T>(n, &what)?;
        if n > 0 {
            let mut undefined = T::UNDEFINED;
            let mut anynul = 0;
            // SAFETY: `data` holds `n` elements of the type DATATYPE names, `undefined` is of
            // that type too, and both outlive the call.
            self.call(&what, |ptr, status| unsafe {
                sys::ffgcv(
                    ptr,
                    T::DATATYPE,
                    colnum,
                    1,
                    1,
                    n as i64,
                    &mut undefined as *mut T as *mut c_void,
                    data.as_mut_ptr() as *mut c_void,
                    &mut anynul,
                    status,
                );
            })?;
        }
        Ok((repeat, data))
    }

    /// Reads a string column, trailing blanks removed.
    pub fn column_str(&mut self, name: &str) -> Result<Vec<String>> {
        let what = format!("cannot read column {name}");
        let (colnum, _, repeat, _) = self.column_number(name)?;
        let nrows = self.nrows()?;
        let mut storage = vec![vec![0 as c_char; repeat + 1]; nrows];
        let mut pointers: Vec<*mut c_char> = storage.iter_mut().map(|s| s.as_mut_ptr()).collect();
        let mut nulval = [0 as c_char; 1];
        if nrows > 0 {
            let mut anynul = 0;
            // SAFETY: one buffer of `repeat + 1` bytes per row (the column width plus the
            // NUL), all alive through the call.
            self.call(&what, |ptr, status| unsafe {
                sys::ffgcvs(
                    ptr,
                    colnum,
                    1,
                    1,
                    nrows as i64,
                    nulval.as_mut_ptr(),
                    pointers.as_mut_ptr(),
                    &mut anynul,
                    status,
                );
            })?;
        }
        Ok(storage.iter().map(|s| buffer_to_string(s)).collect())
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
        self.hdu = name.to_string();
        let from = src.ptr;
        // SAFETY: `from` is the open handle of another file, alive while `src` is borrowed.
        self.call("cannot copy table", |ptr, status| unsafe {
            sys::ffcopy(from, ptr, 0, status);
        })?;
        let Some(rows) = rows else { return Ok(()) };
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
            self.delete_rows(rows.end + 1, nrows - rows.end)?;
        }
        if rows.start > 0 {
            self.delete_rows(1, rows.start)?;
        }
        Ok(())
    }

    /// Deletes `n` rows of the current table from row `first` (counted from 1).
    fn delete_rows(&mut self, first: usize, n: usize) -> Result<()> {
        // SAFETY: a valid handle; cfitsio checks the row range itself.
        self.call("cannot slice table", |ptr, status| unsafe {
            sys::ffdrow(ptr, first as i64, n as i64, status);
        })
    }

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
        // SAFETY: one NUL-terminated name and form per column, alive through the call and
        // only read; no units.
        self.call("cannot create table", |ptr, status| unsafe {
            sys::ffcrtb(
                ptr,
                BINARY_TBL,
                nrows as i64,
                columns.len() as c_int,
                name_ptrs.as_mut_ptr(),
                form_ptrs.as_mut_ptr(),
                std::ptr::null_mut(),
                cext.as_ptr(),
                status,
            );
        })
    }

    /// Writes `data` into the numeric column `name` of the current table, from the first row
    /// on (`repeat` values per row for vector columns).
    pub fn write_column<T: Element>(&mut self, name: &str, data: &[T]) -> Result<()> {
        let (colnum, _, _, _) = self.column_number(name)?;
        if data.is_empty() {
            return Ok(());
        }
        // SAFETY: `data` holds `data.len()` elements of the type DATATYPE names; cfitsio only
        // reads them.
        self.call(
            &format!("cannot write column {name}"),
            |ptr, status| unsafe {
                sys::ffpcl(
                    ptr,
                    T::DATATYPE,
                    colnum,
                    1,
                    1,
                    data.len() as i64,
                    data.as_ptr() as *mut c_void,
                    status,
                );
            },
        )
    }

    /// Writes one string per row into the character column `name` of the current table
    /// (cfitsio pads or truncates to the column width).
    pub fn write_column_str(&mut self, name: &str, data: &[&str]) -> Result<()> {
        let (colnum, _, _, _) = self.column_number(name)?;
        let strings: Vec<CString> = data.iter().map(|s| cstring(s)).collect();
        let mut pointers: Vec<*mut c_char> =
            strings.iter().map(|s| s.as_ptr() as *mut c_char).collect();
        if data.is_empty() {
            return Ok(());
        }
        // SAFETY: one NUL-terminated string per row, alive through the call and only read.
        self.call(
            &format!("cannot write column {name}"),
            |ptr, status| unsafe {
                sys::ffpcls(
                    ptr,
                    colnum,
                    1,
                    1,
                    data.len() as i64,
                    pointers.as_mut_ptr(),
                    status,
                );
            },
        )
    }
}
