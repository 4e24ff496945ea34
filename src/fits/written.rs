//! New FITS files, built in memory and written to disk once, when closed.
//!
//! cfitsio writing a frame to disk spends most of the write phase on one thread: it converts
//! every array to big-endian through its 2880-byte buffers and hands the file system a few
//! kilobytes at a time, then the checksums and the gzip compression read the file back.
//! Here cfitsio writes into a block of memory of its own (`ffimem`) and keeps what it is good
//! at, the headers and tables; the data unit of an image is laid out by cfitsio (the last
//! value written through it, the rest zero-filled) and then encoded straight into that
//! memory on the rank's cores. The checksums are summed from the same memory, and the closed
//! file goes to disk in pieces of [`WRITE_PIECE`] (plain) or deflated from memory
//! ([`super::gzip`]). The bytes are those cfitsio would have written to disk.

use std::ffi::c_void;
use std::io::Write;
use std::path::Path;
use std::sync::atomic::{AtomicUsize, Ordering};

use fitsio::sys;
use rayon::prelude::*;

use super::{failure_message, run, Element, Fits};
use crate::error::{Error, Result};

/// The least cfitsio grows its block by: a frame's 70 MB take a few moves of the block, not
/// one per 2880-byte record.
const GROWTH: usize = 32 << 20;

/// Bytes handed to the file system per write: one `write` of a whole frame (70 MB) took, at
/// random, 0.2-0.6 s of CPU in the kernel, pieces of this size 0.02 s every time.
const WRITE_PIECE: usize = 1 << 20;

/// Values encoded per task.
const VALUES_PER_TASK: usize = 1 << 16;

/// The block of memory a new file is written into. cfitsio keeps the addresses of both
/// fields and updates them when it moves the block (boxed: they must not move), grows it
/// through [`grow`] and never frees it (its `memkeep` driver): this does.
pub(super) struct Block {
    ptr: *mut c_void,
    size: usize,
}

// SAFETY: the block is only reached through the `Fits` that owns it, one thread at a time.
unsafe impl Send for Block {}

impl Drop for Block {
    fn drop(&mut self) {
        // SAFETY: null or a block `grow` allocated and cfitsio no longer uses (the handle is
        // closed before the `Fits` that owns this is dropped).
        unsafe { libmimalloc_sys::mi_free(self.ptr) };
    }
}

/// The size of the block of the last file built in memory: the first allocation of the next
/// one, so that a frame's block grows by no copy.
static LAST_BLOCK: AtomicUsize = AtomicUsize::new(0);

/// cfitsio's memory reallocation callback, on mimalloc, whose freed blocks the next frame's
/// write reuses: the C library's `realloc` gave each 70 MB frame fresh pages (17,000 page
/// faults per write, and on a node a `mmap` and `munmap` that every other thread's page faults
/// and device allocations wait for). A block starts as large as the last file's, and is
/// handed back unmoved while it holds what cfitsio asks for.
unsafe extern "C" fn grow(ptr: *mut c_void, size: usize) -> *mut c_void {
    // SAFETY: `ptr` is null or a block this function returned before.
    unsafe {
        if ptr.is_null() {
            if let Some(ahead) = take_ahead(size) {
                return ahead;
            }
            let least = LAST_BLOCK
                .load(Ordering::Relaxed)
                .max(EXPECTED.load(Ordering::Relaxed));
            return libmimalloc_sys::mi_malloc(size.max(least));
        }
        if size <= libmimalloc_sys::mi_usable_size(ptr) {
            return ptr;
        }
        #[cfg(test)]
        MOVES.with(|m| m.set(m.get() + 1));
        libmimalloc_sys::mi_realloc(ptr, size)
    }
}

#[cfg(test)]
thread_local! {
    /// Blocks this thread moved to grow them (cfitsio grows a block on the thread writing to
    /// it), for the tests.
    static MOVES: std::cell::Cell<usize> = const { std::cell::Cell::new(0) };
}

/// A block of [`prepare_block`], its pages mapped, for the next file built in memory.
static AHEAD: std::sync::Mutex<Option<Block>> = std::sync::Mutex::new(None);

/// The block the largest file announced to [`prepare_block`] needs: the least a new file's
/// block starts with, even before any file was closed.
static EXPECTED: AtomicUsize = AtomicUsize::new(0);

/// Announces a file of about `bytes` to be built in memory, so that its block holds it from
/// the start, and with `map_ahead` has a thread allocate that block and map its pages, unless
/// a file as large was built before (whose freed block the next one reuses): a process's first
/// frame otherwise builds its file in fresh memory (on the developer machine 0.08-0.09 s
/// against 0.03 s for the next files of the same size). The caller starts it where the host
/// waits, as for the device's solve of the frame.
///
/// cfitsio grows a block by [`GROWTH`] bytes at a time up to the file's size, hence the
/// margin: a block of just the file's size was moved, a copy of 64 MB, once the file passed
/// 64 MB; and the first files a process writes at once, before any closed, each copied theirs
/// twice (5.6% of the CPU time of 30 frames on one GPU, perf on one H200).
pub fn prepare_block(bytes: usize, map_ahead: bool) {
    let bytes = bytes.max(GROWTH) + GROWTH;
    EXPECTED.fetch_max(bytes, Ordering::Relaxed);
    if map_ahead && LAST_BLOCK.load(Ordering::Relaxed) < bytes {
        std::thread::spawn(move || map_block(bytes));
    }
}

/// [`prepare_block`]'s thread: the block, its pages mapped, left in [`AHEAD`].
fn map_block(bytes: usize) {
    // SAFETY: a fresh allocation (null on failure), handed to `AHEAD`, whose `Block` frees it.
    let ptr = unsafe { libmimalloc_sys::mi_malloc(bytes) }.cast::<u8>();
    if ptr.is_null() {
        return;
    }
    for offset in (0..bytes).step_by(4096) {
        // SAFETY: within the `bytes` just allocated; a write maps the page.
        unsafe { ptr.add(offset).write_volatile(0) };
    }
    let block = Block {
        ptr: ptr.cast(),
        size: bytes,
    };
    *AHEAD.lock().unwrap_or_else(|p| p.into_inner()) = Some(block);
}

/// The block [`prepare_block`] made, if it holds `size` bytes (a smaller one is freed).
fn take_ahead(size: usize) -> Option<*mut c_void> {
    let block = AHEAD.lock().unwrap_or_else(|p| p.into_inner()).take()?;
    (block.size >= size).then(|| std::mem::ManuallyDrop::new(block).ptr)
}

impl Fits {
    /// A new, empty FITS file in memory, to be written to `path` when closed.
    pub(super) fn create_in_memory(path: &Path) -> Result<Fits> {
        // Empty: cfitsio takes the bytes of a block it is given for a file to append to.
        let mut block = Box::new(Block {
            ptr: std::ptr::null_mut(),
            size: 0,
        });
        let mut ptr = std::ptr::null_mut();
        // SAFETY: cfitsio stores the addresses of the block's two fields, which the box keeps
        // in place as long as the handle (the `Fits` owns both and closes the handle first).
        run(|status| unsafe {
            sys::ffimem(
                &mut ptr,
                &mut block.ptr,
                &mut block.size,
                GROWTH,
                Some(grow),
                status,
            );
        })
        .map_err(|(status, cause)| Error::Fits {
            path: path.into(),
            what: "cannot create".into(),
            message: failure_message(status, cause),
        })?;
        let mut fits = Fits::new(ptr, path);
        fits.written = Some(block);
        Ok(fits)
    }

    /// The bytes cfitsio has put in the block so far (all of the file after a flush); empty
    /// for a file not built in memory.
    pub(super) fn block(&self) -> &[u8] {
        match &self.written {
            // SAFETY: cfitsio keeps `size` bytes allocated at `ptr`, initialised up to the
            // file's size, and does not touch them while `self` is borrowed.
            Some(b) if !b.ptr.is_null() => unsafe {
                std::slice::from_raw_parts(b.ptr as *const u8, b.size)
            },
            _ => &[],
        }
    }

    /// [`Fits::block`], to be written into.
    fn block_mut(&mut self) -> &mut [u8] {
        match &mut self.written {
            // SAFETY: as in `block`; `&mut self` excludes any other use of the bytes.
            Some(b) if !b.ptr.is_null() => unsafe {
                std::slice::from_raw_parts_mut(b.ptr as *mut u8, b.size)
            },
            _ => &mut [],
        }
    }

    /// Writes cfitsio's buffers to the file and forgets them, so that cfitsio reads again
    /// whatever is changed behind it.
    fn flush_and_forget(&mut self) -> Result<()> {
        // SAFETY: a valid handle of a writable file.
        self.call("cannot flush", |ptr, status| unsafe {
            sys::ffflsh(ptr, 1, status);
        })
    }

    /// Writes the data unit of the current image HDU, whose header is complete: through
    /// cfitsio for a file on disk; in memory, encoded on many cores, for a file built there.
    pub(super) fn write_data<T: Element>(&mut self, data: &[T]) -> Result<()> {
        let Some(&last) = data.last() else {
            return Ok(());
        };
        if self.written.is_none() {
            return self.write_values(1, data);
        }
        // cfitsio lays out the data unit: its last value, the fill after it and zeros before.
        self.write_values(data.len(), &[last])?;
        self.flush_and_forget()?;
        let (_, start, _) = self.hdu_addresses()?;
        let width = std::mem::size_of::<T>();
        let Some(unit) = self
            .block_mut()
            .get_mut(start..start + std::mem::size_of_val(data))
        else {
            return Err(self.error("cannot write image", "the data unit is not in memory"));
        };
        unit.par_chunks_mut(VALUES_PER_TASK * width)
            .zip(data.par_chunks(VALUES_PER_TASK))
            .for_each(|(bytes, values)| {
                for (out, v) in bytes.chunks_exact_mut(width).zip(values) {
                    v.to_fits(out);
                }
            });
        Ok(())
    }

    /// cfitsio's write of `values` from the 1-based `first` pixel of the current image.
    fn write_values<T: Element>(&mut self, first: usize, values: &[T]) -> Result<()> {
        // SAFETY: `values` holds `values.len()` elements of the type DATATYPE names; cfitsio
        // only reads them (its pointer is not const-qualified).
        self.call("cannot write image", |ptr, status| unsafe {
            sys::ffppr(
                ptr,
                T::DATATYPE,
                first as i64,
                values.len() as i64,
                values.as_ptr() as *mut c_void,
                status,
            );
        })
    }

    /// The size of the complete file: the end of its last HDU.
    fn file_size(&mut self) -> Result<usize> {
        let count = self.hdu_count()?;
        if count == 0 {
            return Ok(0);
        }
        self.move_to_index(count - 1)?;
        let (_, _, end) = self.hdu_addresses()?;
        Ok(end)
    }

    /// Closes a file built in memory and writes it to its path: in one write, or deflated
    /// ([`super::gzip`]) for a name that ends in `.gz`.
    pub(super) fn close_in_memory(&mut self) -> Result<()> {
        // The last HDU is completed (its fill written) before its end is read.
        // SAFETY: a valid handle of a writable file.
        self.call("cannot flush", |ptr, status| unsafe {
            sys::ffflus(ptr, status);
        })?;
        let size = self.file_size()?;
        self.close_handle()?;
        if let Some(b) = self.written.as_ref().filter(|b| !b.ptr.is_null()) {
            // SAFETY: a block `grow` allocated, still held by `b`.
            let usable = unsafe { libmimalloc_sys::mi_usable_size(b.ptr) };
            LAST_BLOCK.store(usable, Ordering::Relaxed);
        }
        let t0 = std::time::Instant::now();
        let Some(bytes) = self.block().get(..size) else {
            return Err(self.error("cannot close", "the file is not all in memory"));
        };
        let io = |source| Error::Io {
            path: self.path.clone(),
            source,
        };
        // Made anew, as cfitsio makes a file: not the temporary's own mode (0600) but the
        // process's default.
        let file = crate::output::creating(|| {
            match std::fs::remove_file(&self.path) {
                Err(e) if e.kind() != std::io::ErrorKind::NotFound => return Err(e),
                _ => {}
            }
            std::fs::File::create(&self.path)
        })
        .map_err(io)?;
        if self.gzip {
            return super::gzip::write_compressed(&self.path, bytes, file);
        }
        let mut file = file;
        for piece in bytes.chunks(WRITE_PIECE) {
            file.write_all(piece).map_err(io)?;
        }
        tracing::debug!(
            "{}: wrote {:.1} MB in {:.3} s",
            self.path.display(),
            bytes.len() as f64 / 1e6,
            t0.elapsed().as_secs_f64()
        );
        Ok(())
    }
}

/// The bytes of a FITS data unit, as cfitsio writes each element type: big-endian, and
/// unsigned 32-bit values offset by BZERO = 2^31.
pub trait ToFits: Copy {
    /// Writes this value's `size_of::<Self>()` bytes into `out`.
    fn to_fits(self, out: &mut [u8]);
}

macro_rules! big_endian {
    ($($t:ty),*) => {$(
        impl ToFits for $t {
            fn to_fits(self, out: &mut [u8]) {
                out.copy_from_slice(&self.to_be_bytes());
            }
        }
    )*};
}
big_endian!(f32, f64, i32, i64, u8);

impl ToFits for u32 {
    fn to_fits(self, out: &mut [u8]) {
        out.copy_from_slice(&(self ^ 0x8000_0000).to_be_bytes());
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::fits::{inflate_gzip, path_cstring};

    #[test]
    fn an_announced_file_is_built_in_a_block_that_never_moves() {
        // 80 MB of values: cfitsio grows its block past 32, 64 and 96 MB
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("large.fits");
        let values = vec![1.5f32; 20 << 20];
        prepare_block(4 * values.len() + (1 << 20), false);
        let moved = MOVES.with(|m| m.get());
        let mut f = Fits::create(&path).unwrap();
        f.write_image("VALUES", &[values.len()], &values).unwrap();
        f.close().unwrap();
        assert_eq!(MOVES.with(|m| m.get()), moved, "the block was moved");
        let (_, back) = Fits::open(&path).unwrap().read_image::<f32>().unwrap();
        assert!(back == values);
    }

    /// A file that cfitsio writes on disk itself, values and all: the reference.
    fn create_on_disk(path: &Path) -> Fits {
        let name = path_cstring(path);
        let mut ptr = std::ptr::null_mut();
        // SAFETY: `name` is NUL-terminated and outlives the call; cfitsio stores a handle.
        run(|status| unsafe {
            sys::ffdkinit(&mut ptr, name.as_ptr(), status);
        })
        .expect("a file created by cfitsio");
        Fits::new(ptr, path)
    }

    /// One image HDU of every element type, with the values that conversions get wrong
    /// (signs, extremes, NaN, BZERO's offset) and sizes that end inside and on a 2880-byte
    /// record; then a table, so that an image is not the last HDU.
    fn write_hdus(fits: &mut Fits) {
        let n = 2880 / 4 * 3 + 5;
        let f32s: Vec<f32> = (0..n).map(|i| (i as f32 - 7.5) * 1.25e-3).collect();
        let mut f32s_odd = f32s.clone();
        f32s_odd[3] = f32::NAN;
        f32s_odd[4] = f32::MAX;
        let f64s: Vec<f64> = (0..n).map(|i| -(i as f64).sqrt() * 1e300).collect();
        let i32s: Vec<i32> = (0..n)
            .map(|i| {
                (i as i32)
                    .wrapping_mul(2_654_435)
                    .wrapping_sub(1_000_000_000)
            })
            .collect();
        let u32s: Vec<u32> = (0..n)
            .map(|i| (i as u32).wrapping_mul(0x9e37_79b9))
            .collect();
        let i64s: Vec<i64> = (0..n).map(|i| i as i64 * -3_000_000_007).collect();
        let u8s: Vec<u8> = (0..2880).map(|i| (i * 7) as u8).collect();
        fits.reserve_checksums();
        fits.write_image_with("FLUX", &[5, n / 5], &f32s[..n / 5 * 5], |f| {
            f.write_key_str("BUNIT", "electron/Angstrom", "")
        })
        .unwrap();
        fits.write_image("ODD", &[n], &f32s_odd).unwrap();
        fits.write_image("F64", &[n], &f64s).unwrap();
        fits.write_image("I32", &[n], &i32s).unwrap();
        fits.write_image("MASK", &[n], &u32s).unwrap();
        fits.write_image("I64", &[n], &i64s).unwrap();
        fits.write_image("U8", &[2880], &u8s).unwrap();
        fits.write_image::<f32>("EMPTY", &[0], &[]).unwrap();
        fits.create_table("T", &[("A", "D")], 3).unwrap();
        fits.write_column("A", &[1.0, 2.0, 3.0]).unwrap();
        fits.write_checksums().unwrap();
    }

    #[test]
    fn a_file_built_in_memory_has_the_bytes_cfitsio_writes_to_disk() {
        let dir = tempfile::tempdir().unwrap();
        let (disk, memory) = (dir.path().join("disk.fits"), dir.path().join("memory.fits"));
        let mut reference = create_on_disk(&disk);
        write_hdus(&mut reference);
        reference.close().unwrap();
        let mut fits = Fits::create(&memory).unwrap();
        assert!(fits.written.is_some());
        write_hdus(&mut fits);
        fits.close().unwrap();
        let (expected, got) = (
            std::fs::read(&disk).unwrap(),
            std::fs::read(&memory).unwrap(),
        );
        assert_eq!(got.len() % 2880, 0);
        assert_eq!(got.len(), expected.len());
        assert!(got == expected, "the files differ");
        let mut fits = Fits::open(&memory).unwrap();
        let verified = fits.verify_checksums().unwrap();
        assert!(verified.iter().all(|&v| v == (1, 1)), "{verified:?}");
    }

    /// The bytes of [`write_hdus`]' file as cfitsio writes it to disk, in `dir`.
    fn written_on_disk(dir: &Path) -> Vec<u8> {
        let disk = dir.join("disk.fits");
        let mut reference = create_on_disk(&disk);
        write_hdus(&mut reference);
        reference.close().unwrap();
        std::fs::read(&disk).unwrap()
    }

    #[test]
    fn a_file_built_after_a_larger_one_has_the_bytes_cfitsio_writes_to_disk() {
        // The larger file's block, freed, is likely the one the next file starts in: its HDUs
        // must not show through.
        let dir = tempfile::tempdir().unwrap();
        let expected = written_on_disk(dir.path());
        for k in 0..3 {
            let mut large = Fits::create(&dir.path().join(format!("large-{k}.fits"))).unwrap();
            write_hdus(&mut large);
            large
                .write_image("ONES", &[1 << 20], &vec![-1i32; 1 << 20])
                .unwrap();
            large.close().unwrap();
            let memory = dir.path().join(format!("memory-{k}.fits"));
            let mut fits = Fits::create(&memory).unwrap();
            write_hdus(&mut fits);
            fits.close().unwrap();
            assert!(
                std::fs::read(&memory).unwrap() == expected,
                "file {k} differs"
            );
        }
    }

    #[test]
    fn a_prepared_block_is_taken_by_the_next_file() {
        let dir = tempfile::tempdir().unwrap();
        let expected = written_on_disk(dir.path());
        // larger than any file of these tests, so that one is made (here, not on a thread)
        map_block(2 * GROWTH);
        let memory = dir.path().join("memory.fits");
        let mut fits = Fits::create(&memory).unwrap();
        write_hdus(&mut fits);
        fits.close().unwrap();
        assert!(std::fs::read(&memory).unwrap() == expected);
        // this file took it, or another test's that started meanwhile
        assert!(
            AHEAD.lock().unwrap().is_none(),
            "the prepared block is left"
        );
    }

    #[test]
    fn a_gz_name_gets_the_same_file_compressed() {
        let dir = tempfile::tempdir().unwrap();
        let (plain, gz) = (dir.path().join("f.fits"), dir.path().join("f.fits.gz"));
        for path in [&plain, &gz] {
            let mut fits = Fits::create(path).unwrap();
            write_hdus(&mut fits);
            fits.close().unwrap();
        }
        let inflated = inflate_gzip(&gz).unwrap().expect("a gzip file");
        assert_eq!(*inflated, std::fs::read(&plain).unwrap());
    }

    #[test]
    fn a_file_dropped_unclosed_is_not_written() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("f.fits");
        let mut fits = Fits::create(&path).unwrap();
        fits.write_image("A", &[3], &[1.0f32, 2.0, 3.0]).unwrap();
        drop(fits);
        assert!(!path.exists());
    }

    #[test]
    fn a_file_replaces_its_temporary_with_the_mode_of_a_new_file() {
        use std::os::unix::fs::PermissionsExt;
        let dir = tempfile::tempdir().unwrap();
        // a temporary as `output` makes them: private to its owner
        let temp = tempfile::Builder::new().tempfile_in(dir.path()).unwrap();
        let path = temp.into_temp_path().keep().unwrap();
        let mut fits = Fits::create(&path).unwrap();
        fits.write_image("A", &[3], &[1.0f32, 2.0, 3.0]).unwrap();
        fits.close().unwrap();
        let fresh = dir.path().join("fresh");
        std::fs::File::create(&fresh).unwrap();
        let mode = |p: &Path| std::fs::metadata(p).unwrap().permissions().mode() & 0o777;
        assert_eq!(mode(&path), mode(&fresh));
    }

    #[test]
    fn values_are_encoded_as_cfitsio_stores_them() {
        let mut out = [0u8; 4];
        1.0f32.to_fits(&mut out);
        assert_eq!(out, [0x3f, 0x80, 0, 0]);
        // uint32 is stored as int32 with BZERO = 2^31: 0 is -2^31, 2^32 - 1 is 2^31 - 1
        0u32.to_fits(&mut out);
        assert_eq!(out, [0x80, 0, 0, 0]);
        u32::MAX.to_fits(&mut out);
        assert_eq!(out, [0x7f, 0xff, 0xff, 0xff]);
        let mut wide = [0u8; 8];
        (-2i64).to_fits(&mut wide);
        assert_eq!(wide, [0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xfe]);
    }
}
