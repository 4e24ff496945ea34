//! A small safe layer over cfitsio (through `fitsio::sys`) for what spex reads and writes:
//! images by HDU name (plain or tile-compressed), header keywords and raw cards, vector table
//! columns, and whole-HDU copies with a row slice. Every error names the file and the HDU,
//! and a failure of the operating system (a full disk, a permission) keeps its cause.
//!
//! File names are taken literally: `out[1].fits` is a file of that name, never cfitsio's
//! "HDU 1 of out.fits"; a new file whose name ends in `.gz` is compressed when closed, and a
//! gzip-compressed file is read from memory, inflated once. Every cfitsio function is called
//! from one place only, [`Fits::call`] or a free function beside it, each with the reason it
//! is sound.
//!
//! Submodules: `pixels` (image reads, by row ranges in parallel), `memory` (gzip files
//! inflated once and shared), `written` (new files built in memory, written once),
//! `checksum` (CHECKSUM/DATASUM), `gzip` (compression of written files), `desi` (what
//! desispec's files carry besides arrays), `table` (binary tables), `keywords` (header
//! keywords and cards), `compressed` (tile-compression keywords checked before cfitsio
//! trusts them).

use std::ffi::{c_char, c_int, c_long, CString};
use std::path::{Path, PathBuf};

use fitsio::sys;
use ndarray::{ArrayView, Dimension};

use crate::error::{Error, Result};

mod checksum;
mod compressed;
mod deflate;
mod desi;
mod gzip;
mod inflate;
mod keywords;
mod memory;
mod pixels;
mod table;
mod written;
pub use desi::fits_float;
pub use keywords::is_structural_card;
pub use memory::{inflate_gzip, inflate_in_chunks, is_gzip, KeepAlive};
pub use written::prepare_block;

/// FITS files are made of records of this many bytes: every header and data unit fills whole
/// records.
pub const RECORD: usize = 2880;

const READONLY: c_int = 0;
const ANY_HDU: c_int = -1;
const KEY_NO_EXIST: c_int = 202;
const FLEN_CARD: usize = 81;
const FLEN_VALUE: usize = 71;
const FLEN_ERRMSG: usize = 81;
/// For [`Fits::call_unless`]: any failure is the expected one.
const ANY_STATUS: c_int = c_int::MIN;
/// cfitsio's statuses of a failed file operation (FILE_NOT_OPENED 104 to SEEK_ERROR 116),
/// after which `errno` says why.
const OS_STATUSES: std::ops::RangeInclusive<c_int> = 104..=116;

/// Element types that cfitsio converts to and from.
pub trait Element: Copy + Default + Send + Sync + written::ToFits {
    /// cfitsio's `datatype` code (TFLOAT, TDOUBLE, TINT...).
    const DATATYPE: c_int;
    /// BITPIX of an image HDU written with this type.
    const BITPIX: c_int;
    /// The value undefined pixels are read as. cfitsio checks for undefined pixels only when
    /// this is not zero: NaN for floating types, so that the NaNs of a tile-compressed image
    /// (stored as ZBLANK integers) come back as NaN; zero for integers, which are read as
    /// stored.
    const UNDEFINED: Self;
}

impl Element for f32 {
    const DATATYPE: c_int = 42;
    const BITPIX: c_int = -32;
    const UNDEFINED: Self = f32::NAN;
}
impl Element for f64 {
    const DATATYPE: c_int = 82;
    const BITPIX: c_int = -64;
    const UNDEFINED: Self = f64::NAN;
}
impl Element for i32 {
    const DATATYPE: c_int = 31;
    const BITPIX: c_int = 32;
    const UNDEFINED: Self = 0;
}
impl Element for u8 {
    const DATATYPE: c_int = 11;
    const BITPIX: c_int = 8;
    const UNDEFINED: Self = 0;
}
impl Element for i64 {
    const DATATYPE: c_int = 81;
    const BITPIX: c_int = 64;
    const UNDEFINED: Self = 0;
}

/// An open FITS file; closed (and flushed) on drop or by [`Fits::close`].
pub struct Fits {
    ptr: *mut sys::fitsfile,
    path: PathBuf,
    hdu: String,
    /// Compress the file with gzip when it is closed (a new file whose name ends in `.gz`).
    gzip: bool,
    /// Give every image HDU written from now on the places of its checksum keywords before
    /// its data ([`Fits::reserve_checksums`]).
    reserve_checksums: bool,
    /// The bytes of a file opened in memory, and the pointer and size cfitsio reads them
    /// through, kept as long as the handle (boxed: cfitsio keeps their addresses).
    memory: Option<Box<memory::Bytes>>,
    /// The block of memory a new file is built in (see `written`).
    written: Option<Box<written::Block>>,
}

// SAFETY: a cfitsio handle has no affinity to the thread that opened it (cfitsio is built
// reentrant), and `Fits` is not `Sync`: one thread at a time uses it through `&mut self`.
unsafe impl Send for Fits {}

/// A path as cfitsio takes it: its bytes, which need not be UTF-8 on Linux.
pub(super) fn path_cstring(path: &Path) -> CString {
    use std::os::unix::ffi::OsStrExt;
    CString::new(path.as_os_str().as_bytes()).unwrap_or_default()
}

fn cstring(s: &str) -> CString {
    CString::new(s.replace('\0', " ")).unwrap_or_default()
}

/// The text of a NUL-terminated buffer that cfitsio filled, trailing blanks removed.
fn buffer_to_string(buf: &[c_char]) -> String {
    let bytes: Vec<u8> = buf
        .iter()
        .map(|&c| c as u8)
        .take_while(|&b| b != 0)
        .collect();
    String::from_utf8_lossy(&bytes).trim_end().to_string()
}

/// Forgets cfitsio's stack of error messages (after an expected failure).
fn clear_messages() {
    init_cfitsio();
    // SAFETY: ffcmsg takes no argument and only empties cfitsio's message stack.
    unsafe { sys::ffcmsg() };
}

/// Creates cfitsio's global lock before spex takes it for the first time.
///
/// cfitsio makes that lock a recursive mutex on the first open of a file; until then it is
/// zeroed memory, which glibc takes as a plain mutex. The message stack's functions
/// (`ffcmsg`, `ffgmsg`) take the lock without creating it, and [`run`] empties the stack
/// before every call. If one thread held the plain lock there while another thread's first
/// open turned it into a recursive one, the lock was left held by the first thread with a
/// count below zero, and every later open in the process waited forever.
fn init_cfitsio() {
    static INIT: std::sync::Once = std::sync::Once::new();
    INIT.call_once(|| {
        // SAFETY: fits_init_cfitsio takes no argument; it creates the lock under a mutex of
        // its own, so a concurrent first open of a file through the `fitsio` crate is safe.
        let status = unsafe { sys::fits_init_cfitsio() };
        if status != 0 {
            tracing::warn!("cfitsio's initialisation returned status {status}");
        }
    });
}

/// cfitsio's text for a status code, plus the first message of its error stack, which is
/// emptied. That stack is one for the process: while another thread reads or writes a file
/// (the PSF is read beside the preproc) its calls may empty the stack first, and the message
/// then has the status text alone.
fn status_message(status: c_int) -> String {
    let mut text = [0 as c_char; FLEN_ERRMSG];
    // SAFETY: ffgerr writes at most FLEN_ERRMSG bytes, NUL included, into `text`.
    unsafe { sys::ffgerr(status, text.as_mut_ptr()) };
    let mut message = buffer_to_string(&text);
    let mut detail = [0 as c_char; FLEN_ERRMSG];
    // SAFETY: ffgmsg writes at most FLEN_ERRMSG bytes, NUL included, into `detail`.
    if unsafe { sys::ffgmsg(detail.as_mut_ptr()) } != 0 {
        let detail = buffer_to_string(&detail);
        if !detail.is_empty() && detail != message {
            message = format!("{message} ({detail})");
        }
    }
    clear_messages();
    message
}

/// Runs one cfitsio call with a fresh status and `errno`, and returns the status with the
/// operating system's cause of a failed file operation ("No space left on device").
fn run(f: impl FnOnce(&mut c_int)) -> std::result::Result<(), (c_int, Option<std::io::Error>)> {
    let mut status = 0;
    // The messages of earlier, expected failures must not explain this one.
    clear_messages();
    errno::set_errno(errno::Errno(0));
    f(&mut status);
    if status == 0 {
        return Ok(());
    }
    let os = errno::errno().0;
    let cause =
        (OS_STATUSES.contains(&status) && os != 0).then(|| std::io::Error::from_raw_os_error(os));
    Err((status, cause))
}

/// The message of a failed call: cfitsio's, then the operating system's cause if any.
fn failure_message(status: c_int, cause: Option<std::io::Error>) -> String {
    let message = status_message(status);
    match cause {
        Some(cause) => format!("{cause} ({message})"),
        None => message,
    }
}

impl Fits {
    fn new(ptr: *mut sys::fitsfile, path: &Path) -> Self {
        Fits {
            ptr,
            path: path.into(),
            hdu: "primary".into(),
            gzip: false,
            reserve_checksums: false,
            memory: None,
            written: None,
        }
    }

    /// Opens an existing file read-only; its name is taken literally. A gzip-compressed file
    /// is inflated in memory once and shared while it is held (see `memory`).
    pub fn open(path: &Path) -> Result<Self> {
        let opened = |what: &str, message: String| Error::Fits {
            path: path.into(),
            what: what.into(),
            message,
        };
        match std::fs::metadata(path) {
            Err(e) => return Err(opened("cannot open", e.to_string())),
            Ok(m) if !m.is_file() => {
                return Err(opened("cannot open", "not a regular file".into()))
            }
            Ok(_) => {}
        }
        if is_gzip(path) {
            if let Some(bytes) = inflate_gzip(path)? {
                compressed::check_bytes(path, &bytes)?;
                return Fits::open_memory(path, bytes);
            }
        }
        compressed::check_file(path)?;
        let name = path_cstring(path);
        let mut ptr = std::ptr::null_mut();
        // SAFETY: `name` is NUL-terminated and outlives the call; cfitsio stores a handle in
        // `ptr` (null on failure) and only reads the name.
        run(|status| unsafe {
            sys::ffdkopn(&mut ptr, name.as_ptr(), READONLY, status);
        })
        .map_err(|(status, cause)| opened("cannot open", failure_message(status, cause)))?;
        Ok(Fits::new(ptr, path))
    }

    /// Creates a new file, replacing any file of that name (callers write to a temporary
    /// name of their own, see [`crate::output`]). The file is built in memory and written
    /// by [`Fits::close`] (see `written`); a name ending in `.gz` gets a gzip-compressed file.
    pub fn create(path: &Path) -> Result<Self> {
        let mut fits = Fits::create_in_memory(path)?;
        fits.gzip = crate::output::is_gzip_name(path);
        Ok(fits)
    }

    /// The file's path, for messages.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Runs one cfitsio call on this file's handle (`f` gets the handle and the status) and
    /// turns a failure into an error about the current HDU that says `what` failed.
    fn call(&self, what: &str, f: impl FnOnce(*mut sys::fitsfile, &mut c_int)) -> Result<()> {
        if self.ptr.is_null() {
            return Err(self.error(what, "the file is closed"));
        }
        run(|status| f(self.ptr, status))
            .map_err(|(status, cause)| self.error(what, failure_message(status, cause)))
    }

    /// Like [`Fits::call`], but a failure with status `expected` is `Ok(false)`, not an error.
    fn call_unless(
        &self,
        expected: c_int,
        what: &str,
        f: impl FnOnce(*mut sys::fitsfile, &mut c_int),
    ) -> Result<bool> {
        if self.ptr.is_null() {
            return Err(self.error(what, "the file is closed"));
        }
        match run(|status| f(self.ptr, status)) {
            Ok(()) => Ok(true),
            Err((status, _)) if status == expected || expected == ANY_STATUS => {
                clear_messages();
                Ok(false)
            }
            Err((status, cause)) => Err(self.error(what, failure_message(status, cause))),
        }
    }

    /// An error about the current HDU of this file.
    pub fn error(&self, what: &str, message: impl Into<String>) -> Error {
        Error::Fits {
            path: self.path.clone(),
            what: format!("HDU {}: {what}", self.hdu),
            message: message.into(),
        }
    }

    /// Moves to the HDU whose EXTNAME is `name`, as astropy and desispec find HDUs. cfitsio's
    /// own search also matches HDUNAME, so that an IMAGE HDU with `HDUNAME = 'IVAR'` would
    /// be read as the IVAR: the HDU it finds is accepted only if its EXTNAME is `name`,
    /// else every HDU is looked at in turn, and an HDU that cfitsio cannot read on the way
    /// (a damaged compression header) is reported as such, not as a missing HDU.
    pub fn move_to(&mut self, name: &str) -> Result<()> {
        let mut cname = cstring(name).into_bytes_with_nul();
        // SAFETY: `cname` is NUL-terminated and outlives the call; cfitsio only reads it
        // (its `char *` is not const-qualified).
        let found = self.call_unless(ANY_STATUS, "cannot move", |ptr, status| unsafe {
            sys::ffmnhd(ptr, ANY_HDU, cname.as_mut_ptr() as *mut c_char, 0, status);
        })?;
        if found && self.extname_is(name)? {
            self.hdu = name.to_string();
            return Ok(());
        }
        self.scan_for(name)
    }

    /// Whether the current HDU's EXTNAME is `name` (blanks and case ignored, as in FITS).
    fn extname_is(&mut self, name: &str) -> Result<bool> {
        Ok(self
            .key_str("EXTNAME")?
            .is_some_and(|e| e.trim().eq_ignore_ascii_case(name.trim())))
    }

    /// [`Fits::move_to`] by looking at every HDU's EXTNAME in turn.
    fn scan_for(&mut self, name: &str) -> Result<()> {
        let hdu_error = |path: &Path, message: String| Error::Fits {
            path: path.into(),
            what: format!("HDU {name}"),
            message,
        };
        let mut count = 0;
        // SAFETY: a valid handle and an out-parameter.
        run(|status| unsafe {
            sys::ffthdu(self.ptr, &mut count, status);
        })
        .map_err(|(s, c)| hdu_error(&self.path, failure_message(s, c)))?;
        for number in 1..=count {
            let mut hdutype = 0;
            // SAFETY: a valid handle, an HDU number within the file, one out-parameter.
            run(|status| unsafe {
                sys::ffmahd(self.ptr, number, &mut hdutype, status);
            })
            .map_err(|(s, c)| {
                let why = failure_message(s, c);
                hdu_error(&self.path, format!("cannot read HDU {number}: {why}"))
            })?;
            if self.extname_is(name)? {
                self.hdu = name.to_string();
                return Ok(());
            }
        }
        Err(hdu_error(&self.path, "missing".into()))
    }

    /// Whether the file has an HDU named `name` (the current HDU changes if it does).
    pub fn has_hdu(&mut self, name: &str) -> bool {
        self.move_to(name).is_ok()
    }

    /// Moves to the primary HDU.
    pub fn move_to_primary(&mut self) -> Result<()> {
        let mut hdutype = 0;
        self.hdu = "primary".into();
        // SAFETY: a valid handle and an out-parameter that lives through the call.
        self.call("cannot move", |ptr, status| unsafe {
            sys::ffmahd(ptr, 1, &mut hdutype, status);
        })
    }

    /// Shape of the current image HDU in C order (slowest axis first).
    pub fn image_shape(&mut self) -> Result<Vec<usize>> {
        let mut naxis = 0;
        // SAFETY: a valid handle and an out-parameter.
        self.call("not an image", |ptr, status| unsafe {
            sys::ffgidm(ptr, &mut naxis, status);
        })?;
        let mut naxes = vec![0 as c_long; naxis.max(1) as usize];
        // SAFETY: `naxes` holds at least `naxis` elements, the most cfitsio writes.
        self.call("not an image", |ptr, status| unsafe {
            sys::ffgisz(ptr, naxis, naxes.as_mut_ptr(), status);
        })?;
        naxes.truncate(naxis.max(0) as usize);
        if naxes.iter().any(|&n| n < 0) {
            return Err(self.error("not an image", format!("negative axis length {naxes:?}")));
        }
        Ok(naxes.iter().rev().map(|&n| n as usize).collect())
    }

    /// A zeroed buffer of `n` elements, or an error instead of an abort when a corrupt header
    /// asks for more memory than there is.
    fn buffer<T: Element>(&self, n: usize, what: &str) -> Result<Vec<T>> {
        let mut data = self.uninit_buffer(n, what)?;
        data.resize(n, T::default());
        Ok(data)
    }

    /// An empty buffer with room for `n` elements, or an error as [`Fits::buffer`] gives.
    pub(crate) fn uninit_buffer<T: Element>(&self, n: usize, what: &str) -> Result<Vec<T>> {
        let mut data = Vec::new();
        data.try_reserve_exact(n)
            .map_err(|_| self.error(what, format!("{n} elements do not fit in memory")))?;
        Ok(data)
    }

    /// Appends an image HDU holding `array`, its axes in FITS order (the last axis varies
    /// fastest, as in numpy).
    pub fn write_array<T: Element, D: Dimension>(
        &mut self,
        extname: &str,
        array: ArrayView<T, D>,
    ) -> Result<()> {
        self.write_array_with(extname, array, |_| Ok(()))
    }

    /// [`Fits::write_array`] with the keywords `header` writes in the new HDU before its data.
    pub fn write_array_with<T: Element, D: Dimension>(
        &mut self,
        extname: &str,
        array: ArrayView<T, D>,
        header: impl FnOnce(&mut Fits) -> Result<()>,
    ) -> Result<()> {
        let values = array.as_standard_layout();
        let values = values
            .as_slice()
            .expect("an array in standard layout is one slice");
        self.write_image_with(extname, array.shape(), values, header)
    }

    /// Appends an image HDU (the primary one if the file is empty) and writes `data` into it.
    pub fn write_image<T: Element>(
        &mut self,
        extname: &str,
        shape: &[usize],
        data: &[T],
    ) -> Result<()> {
        self.write_image_with(extname, shape, data, |_| Ok(()))
    }

    /// From now on, every image HDU gets CHECKSUM and DATASUM (placeholders that
    /// [`Fits::write_checksums`] fills in) after its other keywords and before its data.
    pub fn reserve_checksums(&mut self) {
        self.reserve_checksums = true;
    }

    /// [`Fits::write_image`] with the keywords `header` writes (and the checksums' places, see
    /// [`Fits::reserve_checksums`]) before the data: a keyword added after the data makes
    /// cfitsio move the data of this HDU and of every later one to grow the header.
    pub fn write_image_with<T: Element>(
        &mut self,
        extname: &str,
        shape: &[usize],
        data: &[T],
        header: impl FnOnce(&mut Fits) -> Result<()>,
    ) -> Result<()> {
        assert_eq!(
            shape.iter().product::<usize>(),
            data.len(),
            "image shape and data disagree"
        );
        self.hdu = extname.to_string();
        let mut naxes: Vec<c_long> = shape.iter().rev().map(|&n| n as c_long).collect();
        // SAFETY: `naxes` holds the `naxes.len()` axis lengths cfitsio reads.
        self.call("cannot create image", |ptr, status| unsafe {
            sys::ffcrim(
                ptr,
                T::BITPIX,
                naxes.len() as c_int,
                naxes.as_mut_ptr(),
                status,
            );
        })?;
        self.write_key_str("EXTNAME", extname, "")?;
        header(self)?;
        if self.reserve_checksums {
            self.write_checksum_places()?;
        }
        self.write_data(data)
    }

    /// Closes the handle once; later calls do nothing.
    fn close_handle(&mut self) -> Result<()> {
        if self.ptr.is_null() {
            return Ok(());
        }
        // SAFETY: the handle is open; it is never used again once `ptr` is null.
        let closed = self.call("cannot close", |ptr, status| unsafe {
            sys::ffclos(ptr, status);
        });
        self.ptr = std::ptr::null_mut();
        closed
    }

    /// Closes the file, reporting any error of the final flush; a new file is written to
    /// disk then (compressed if its name ends in `.gz`).
    pub fn close(mut self) -> Result<()> {
        match self.written {
            Some(_) => self.close_in_memory(),
            None => self.close_handle(),
        }
    }
}

impl Drop for Fits {
    fn drop(&mut self) {
        let _ = self.close_handle();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    extern "C" {
        /// cfitsio's own flag, 1 until its first initialisation (cfileio.c).
        static need_to_initialize: c_int;
    }

    /// Run alone in a fresh process by the test below, so that nothing else has touched
    /// cfitsio: by the time `run` makes its call, cfitsio's lock must exist, though the
    /// message stack was emptied under it before any file was opened.
    #[test]
    #[ignore = "run in a process of its own by cfitsio_lock_exists_before_spex_first_takes_it"]
    fn fresh_process_first_call() {
        let mut initialised = false;
        // SAFETY: a plain read of an int that cfitsio writes once, under its lock, on this
        // thread (nothing else runs cfitsio in this process).
        run(|_| initialised = unsafe { need_to_initialize } == 0).unwrap();
        assert!(
            initialised,
            "spex took cfitsio's lock before cfitsio created it"
        );
    }

    #[test]
    fn cfitsio_lock_exists_before_spex_first_takes_it() {
        let out = std::process::Command::new(std::env::current_exe().unwrap())
            .args(["--exact", "fits::tests::fresh_process_first_call"])
            .args(["--ignored", "--test-threads=1"])
            .output()
            .unwrap();
        let stdout = String::from_utf8_lossy(&out.stdout);
        assert!(
            out.status.success() && stdout.contains("1 passed"),
            "{stdout}{}",
            String::from_utf8_lossy(&out.stderr)
        );
    }

    #[test]
    fn images_read_by_row_ranges_equal_whole_reads() {
        // A tile-compressed DESI preproc, read in uneven pieces (from the file, and from its
        // gzip compression inflated in memory) and whole.
        let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/data/preproc-bundle0.fits");
        let dir = tempfile::tempdir().unwrap();
        let gz = dir.path().join("p.fits.gz");
        std::fs::copy(&path, &gz).unwrap();
        gzip::compress_in_place(&gz).unwrap();
        let inflated = inflate_gzip(&gz).unwrap().expect("a gzip file");
        assert_eq!(*inflated, std::fs::read(&path).unwrap());
        assert!(inflate_gzip(&path).unwrap().is_none());
        let from_file = || Fits::open(&path);
        let from_memory = || Fits::open_memory(&gz, inflated.clone());
        let opens: [&(dyn Fn() -> Result<Fits> + Sync); 2] = [&from_file, &from_memory];
        for ((hdu, pieces), open) in [("IMAGE", 7), ("IVAR", 1), ("MASK", 64)]
            .into_iter()
            .flat_map(|h| opens.iter().map(move |o| (h, *o)))
        {
            let mut fits = Fits::open(&path).unwrap();
            fits.move_to(hdu).unwrap();
            if hdu == "MASK" {
                let whole = fits.read_image::<i32>().unwrap();
                let parts = Fits::read_image_in_pieces::<i32>(open, hdu, pieces).unwrap();
                assert_eq!(parts, whole);
            } else {
                let (shape, whole) = fits.read_image::<f32>().unwrap();
                let (s, parts) = Fits::read_image_in_pieces::<f32>(open, hdu, pieces).unwrap();
                assert_eq!(s, shape);
                assert!(whole
                    .iter()
                    .zip(&parts)
                    .all(|(a, b)| a.to_bits() == b.to_bits()));
                assert_eq!(whole.len(), parts.len());
            }
        }
    }
}
