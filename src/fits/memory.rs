//! FITS files read from memory: a gzip-compressed file (desi_proc's `preproc-*.fits.gz`) is
//! inflated once, by libdeflate (in chunks on several cores where that pays, see `inflate`),
//! and then opened by as many read-only handles as there are threads reading it. cfitsio,
//! given the file itself, would inflate all of it again for every handle, on one thread each:
//! a frame's preproc is opened for its pixels, its header, its fibermap and the copy of the
//! fibermap into the frame.
//!
//! Inflated files are shared through a registry of weak references: while anything holds the
//! bytes of a file (an open handle), opening the same unchanged file again reuses them. Once
//! its pixels are read, a preproc's FIBERMAP alone is kept, as a file of its own (a
//! [`KeepAlive`] of the image), for the frame's writer and the barycentric correction.

use std::ffi::c_void;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, PoisonError, Weak};
use std::time::SystemTime;

use fitsio::sys;

use super::{cstring, failure_message, run, Fits, READONLY};
use crate::error::{Error, Result};

/// A file's bytes and the pointer and size through which cfitsio reads them.
pub(super) struct Bytes {
    bytes: Arc<Vec<u8>>,
    ptr: *mut c_void,
    size: usize,
}

// SAFETY: the pointer addresses the bytes this value keeps alive, which nobody writes.
unsafe impl Send for Bytes {}

/// Bytes inflated from a file (the part of it that [`Fits::keep_part`] keeps), alive while
/// someone holds this (the image read from the file, until its frame is written), so that
/// later opens of that part reuse them.
#[derive(Clone, Default)]
pub struct KeepAlive(pub Option<Arc<Vec<u8>>>);

impl std::fmt::Debug for KeepAlive {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match &self.0 {
            Some(bytes) => write!(f, "KeepAlive({} bytes)", bytes.len()),
            None => write!(f, "KeepAlive(none)"),
        }
    }
}

/// A file as it was when inflated: path, length and modification time.
type Identity = (PathBuf, u64, Option<SystemTime>);

/// Files inflated, and HDUs of them kept as files of their own ([`Fits::keep_part`]), by the
/// file's identity and the HDU's name ([`WHOLE`] for the whole file), while something holds
/// them.
static INFLATED: Mutex<Vec<(Part, Weak<Vec<u8>>)>> = Mutex::new(Vec::new());

/// A file's identity and the name of an HDU of it.
type Part = (Identity, String);

/// The name under which [`INFLATED`] keeps a whole file.
const WHOLE: &str = "";

fn identity(path: &Path) -> Option<Identity> {
    let meta = std::fs::metadata(path).ok()?;
    Some((path.into(), meta.len(), meta.modified().ok()))
}

/// The live bytes of `part` of the file `id`, forgetting those nobody holds any more.
fn lookup(id: &Identity, part: &str) -> Option<Arc<Vec<u8>>> {
    let mut table = INFLATED.lock().unwrap_or_else(PoisonError::into_inner);
    table.retain(|(_, weak)| weak.strong_count() > 0);
    table
        .iter()
        .find(|((known, name), _)| known == id && name == part)
        .and_then(|(_, weak)| weak.upgrade())
}

/// Lets later opens of `part` of the file `id` find `bytes` while they are held.
fn remember(id: Identity, part: &str, bytes: &Arc<Vec<u8>>) {
    let mut table = INFLATED.lock().unwrap_or_else(PoisonError::into_inner);
    table.push(((id, part.to_string()), Arc::downgrade(bytes)));
}

/// The contents of the gzip-compressed file at `path`, inflated (or as inflated before, while
/// they are held); `None` when the file is not gzip-compressed. Every member of the stream is
/// read (`gzip -dc` concatenates them; cfitsio would stop after the first), and a damaged
/// stream is an error naming the file.
pub fn inflate_gzip(path: &Path) -> Result<Option<Arc<Vec<u8>>>> {
    let id = identity(path);
    if let Some(bytes) = id.as_ref().and_then(|id| lookup(id, WHOLE)) {
        return Ok(Some(bytes));
    }
    let inflated = inflate_file(path)?.map(Arc::new);
    if let (Some(id), Some(bytes)) = (id, &inflated) {
        remember(id, WHOLE, bytes);
    }
    Ok(inflated)
}

/// Whether `path` is a regular file that starts as a gzip stream does. Anything else (a FIFO
/// above all, whose opening would wait for a writer) is left to the open's own checks.
pub fn is_gzip(path: &Path) -> bool {
    if !std::fs::metadata(path).is_ok_and(|m| m.is_file()) {
        return false;
    }
    let mut magic = [0u8; 2];
    std::fs::File::open(path)
        .and_then(|mut f| std::io::Read::read_exact(&mut f, &mut magic))
        .is_ok_and(|()| magic == GZIP_MAGIC)
}

const GZIP_MAGIC: [u8; 2] = [0x1f, 0x8b];
/// The smallest gzip member: a 10-byte header, an empty deflate block and an 8-byte trailer.
const MIN_MEMBER: usize = 20;

/// [`inflate_gzip`] without the registry. The compressed bytes are read through a mapping of
/// the file, its pages mapped at once: reading 98 MB into fresh memory took 31-44 ms on a GPU
/// machine, mapping them from the page cache 2-3 ms. Like astropy's memory-mapped reads, this
/// expects the file not to be cut short while it is read. A file system that cannot map the
/// file has it read instead.
fn inflate_file(path: &Path) -> Result<Option<Vec<u8>>> {
    let t0 = std::time::Instant::now();
    let io = |source| Error::Io {
        path: path.into(),
        source,
    };
    let file = std::fs::File::open(path).map_err(io)?;
    // SAFETY: the mapping is read-only and private, and lives only through this call.
    let mapped = unsafe { memmap2::MmapOptions::new().populate().map(&file) };
    let read;
    let compressed: &[u8] = match &mapped {
        Ok(map) => map,
        Err(_) => {
            read = std::fs::read(path).map_err(io)?;
            &read
        }
    };
    if !compressed.starts_with(&GZIP_MAGIC) {
        return Ok(None);
    }
    let damaged = |why: &str| Error::Fits {
        path: path.into(),
        what: "cannot inflate".into(),
        message: format!("damaged gzip stream ({why})"),
    };
    if compressed.len() < MIN_MEMBER {
        return Err(damaged("truncated"));
    }
    let read_s = t0.elapsed().as_secs_f64();
    let alone = Inflating::start();
    let (inflated, how) = match alone.chunk_bytes(compressed.len()) {
        Some(chunk) => match super::inflate::inflate(compressed, chunk, populated) {
            Some(inflated) => (inflated, "in chunks"),
            None => (
                sequential(compressed).map_err(damaged)?,
                "on one core after chunks failed",
            ),
        },
        None => (sequential(compressed).map_err(damaged)?, "on one core"),
    };
    drop(alone);
    // The benchmarks (scripts/bench-desi-proc, bench-exposure) split a frame's read with this
    // line: its last number is the inflation's time.
    tracing::debug!(
        "{}: read {:.1} MB in {read_s:.3} s, inflated to {:.1} MB {how} in {:.3} s",
        path.display(),
        compressed.len() as f64 / 1e6,
        inflated.len() as f64 / 1e6,
        t0.elapsed().as_secs_f64() - read_s,
    );
    Ok(Some(inflated))
}

/// `len` bytes, their pages mapped on rayon's pool (see [`populate`]).
fn populated(len: usize) -> Option<Vec<u8>> {
    let mut out = zeroed(len.max(1))?;
    out.truncate(len);
    populate(&mut out);
    Some(out)
}

fn sequential(compressed: &[u8]) -> std::result::Result<Vec<u8>, &'static str> {
    inflate_members(compressed, size_hint(compressed))
}

/// Inflations under way in this process. Inflating in chunks (see `inflate`) costs about
/// three times the CPU time of one core's inflation, so only an inflation that runs alone,
/// whose frame everything else waits for, takes the pool's threads, and only where
/// [`inflate_in_chunks`] allows; `SPEX_INFLATE=serial` keeps every inflation on one core.
static INFLATING: AtomicUsize = AtomicUsize::new(0);

/// Whether this process may inflate in chunks.
static IN_CHUNKS: AtomicBool = AtomicBool::new(true);

/// Lets this process inflate files in chunks or not (a rank that reads frames ahead of its
/// solves is bound by its host's work, not by a read).
pub fn inflate_in_chunks(allowed: bool) {
    IN_CHUNKS.store(allowed, Ordering::SeqCst);
}

/// An inflation counted in [`INFLATING`] while this lives.
struct Inflating {
    alone: bool,
}

impl Inflating {
    fn start() -> Self {
        let before = INFLATING.fetch_add(1, Ordering::SeqCst);
        Inflating { alone: before == 0 }
    }

    /// The compressed bytes per chunk, when `len` of them are to be inflated in chunks: four
    /// chunks per thread, for balance, and not under 512 KiB, where a chunk's setup would cost
    /// more than it saves.
    fn chunk_bytes(&self, len: usize) -> Option<usize> {
        let serial = std::env::var("SPEX_INFLATE").is_ok_and(|v| v == "serial");
        let free = self.alone && !serial && IN_CHUNKS.load(Ordering::SeqCst);
        chunk_bytes(free, rayon::current_num_threads(), len)
    }
}

/// [`Inflating::chunk_bytes`] for an inflation that may go in chunks (`free`) on `threads`.
fn chunk_bytes(free: bool, threads: usize, len: usize) -> Option<usize> {
    (free && threads >= 4 && len >= 4 << 20).then(|| (len / (4 * threads)).max(512 << 10))
}

impl Drop for Inflating {
    fn drop(&mut self) {
        INFLATING.fetch_sub(1, Ordering::SeqCst);
    }
}

/// The size of the inflated file if it is one member: the last trailer's ISIZE (the size
/// modulo 2^32), unless deflate's largest ratio (1032:1) says that it cannot be.
fn size_hint(compressed: &[u8]) -> usize {
    let trailer = &compressed[compressed.len() - 4..];
    let size = u32::from_le_bytes([trailer[0], trailer[1], trailer[2], trailer[3]]) as usize;
    if size == 0 || size / 1032 > compressed.len() {
        4 * compressed.len()
    } else {
        size
    }
}

/// Inflates every gzip member of `compressed` one after the other into one buffer, first
/// `hint` bytes long (exact for one member, so that the usual file is inflated in one call
/// into memory allocated once) and doubled whenever a member needs more room.
fn inflate_members(compressed: &[u8], hint: usize) -> std::result::Result<Vec<u8>, &'static str> {
    use libdeflate_sys::{
        libdeflate_alloc_decompressor, libdeflate_free_decompressor, libdeflate_gzip_decompress_ex,
        libdeflate_result_LIBDEFLATE_INSUFFICIENT_SPACE as NO_ROOM,
        libdeflate_result_LIBDEFLATE_SUCCESS as SUCCESS,
    };
    let mut out = zeroed(hint.max(1)).ok_or("cannot allocate its inflated size")?;
    populate(&mut out);
    let (mut read, mut written) = (0usize, 0usize);
    // SAFETY: allocates a decompressor (null on failure), freed below.
    let decompressor = unsafe { libdeflate_alloc_decompressor() };
    if decompressor.is_null() {
        return Err("cannot allocate a decompressor");
    }
    let result = loop {
        let rest = &compressed[read..];
        // Padding after the last member (zeros, as some tape tools write) ends the stream.
        if rest.iter().all(|&b| b == 0) {
            break Ok(());
        }
        let (mut used, mut made) = (0usize, 0usize);
        // SAFETY: the input and output pointers address `rest.len()` readable bytes and
        // `out.len() - written` writable bytes; libdeflate writes only within them and stores
        // the counts in the two out-parameters.
        let status = unsafe {
            libdeflate_gzip_decompress_ex(
                decompressor,
                rest.as_ptr().cast(),
                rest.len(),
                out[written..].as_mut_ptr().cast(),
                out.len() - written,
                &mut used,
                &mut made,
            )
        };
        match status {
            SUCCESS => {
                read += used;
                written += made;
            }
            NO_ROOM => {
                let grown = out.len().checked_mul(2).ok_or("too large")?;
                if out.try_reserve_exact(grown - out.len()).is_err() {
                    break Err("cannot allocate its inflated size");
                }
                out.resize(grown, 0);
            }
            _ => break Err("bad data"),
        }
    };
    // SAFETY: allocated above and not used after this.
    unsafe { libdeflate_free_decompressor(decompressor) };
    result?;
    out.truncate(written);
    Ok(out)
}

/// Maps the pages of `buf` on rayon's pool before one thread inflates into it: the first write
/// to each fresh page would fault on the inflating thread, a third of its time (0.48 s of CPU
/// for a full r preproc, 0.34 s with its pages mapped beforehand, which costs 0.14 s spread
/// over the rank's threads). A hint only: a kernel without `MADV_POPULATE_WRITE` (before
/// Linux 5.14) refuses it and the pages fault as before.
///
/// The pages are mapped [`POPULATED`] bytes per call, whatever the threads: each call holds
/// the process's memory map, which the CUDA driver waits for whenever it maps memory. A
/// reader alone on its thread mapped a preproc in four calls of 68 MB, and eight readers at
/// once made a GPU's start take 0.45-0.48 s instead of 0.32-0.33 s (one H200 machine).
///
/// A thread alone (a reader that reads ahead, on a pool of one thread) maps nothing: it would
/// map the pages itself, sparing no time, and its calls, 68 a preproc, kept the memory map
/// held while two dozen readers inflated at once, so that the backends' device buffers and
/// pinned uploads waited for it. Left to fault (a fault takes no hold of the whole map on
/// Linux 6.4 and later), 30 frames in desi_proc's form on a host of 2 H200 and 32 cores:
/// the backends ready after 0.32-0.36 s instead of 0.50-0.53 s on one GPU, their first
/// frames' host work before their first wave 27-74 ms instead of 260-330 ms, a preproc
/// inflated in 0.53-0.56 s instead of 0.61-0.69 s, the whole list 2.52-2.59 s instead of
/// 2.71-2.73 s (2.17-2.25 s instead of 2.42-2.61 s on two GPUs).
#[cfg(target_os = "linux")]
fn populate(buf: &mut [u8]) {
    use rayon::prelude::*;
    const PAGE: usize = 4096;
    let start = (buf.as_mut_ptr() as usize).next_multiple_of(PAGE);
    let end = (buf.as_mut_ptr() as usize + buf.len()) / PAGE * PAGE;
    if end <= start || rayon::current_num_threads() < 2 {
        return;
    }
    (start..end)
        .into_par_iter()
        .step_by(POPULATED)
        .for_each(|from| {
            // SAFETY: the pages [from, from + len) lie within `buf`, borrowed mutably here, and
            // the advice maps them writable without changing any byte; its failure is harmless.
            unsafe {
                libc::madvise(
                    from as *mut c_void,
                    POPULATED.min(end - from),
                    libc::MADV_POPULATE_WRITE,
                )
            };
        });
}

#[cfg(not(target_os = "linux"))]
fn populate(_: &mut [u8]) {}

/// Bytes whose pages [`populate`] maps in one call (a multiple of the page).
const POPULATED: usize = 4 << 20;

/// `len` zero bytes, `None` if they cannot be allocated. Zeroed memory comes from the system
/// untouched, so that a size read from a damaged trailer costs nothing until written.
fn zeroed(len: usize) -> Option<Vec<u8>> {
    let layout = std::alloc::Layout::array::<u8>(len).ok()?;
    // SAFETY: `layout` has a nonzero size (`len` > 0, checked by the caller).
    let ptr = unsafe { std::alloc::alloc_zeroed(layout) };
    if ptr.is_null() {
        return None;
    }
    // SAFETY: `ptr` was allocated by the global allocator with this layout (capacity `len`)
    // and its `len` bytes are initialised (zero).
    Some(unsafe { Vec::from_raw_parts(ptr, len, len) })
}

impl Fits {
    /// Opens the FITS file whose bytes are `bytes` read-only, `path` naming it in messages.
    pub fn open_memory(path: &Path, bytes: Arc<Vec<u8>>) -> Result<Self> {
        let mut memory = Box::new(Bytes {
            ptr: bytes.as_ptr() as *mut c_void,
            size: bytes.len(),
            bytes,
        });
        let name = cstring(&path.to_string_lossy());
        let mut ptr = std::ptr::null_mut();
        // SAFETY: `name` is NUL-terminated and outlives the call; cfitsio keeps the addresses
        // of `memory.ptr` and `memory.size`, which the box keeps in place for as long as the
        // handle (the returned value owns both), and reads the bytes only (read-only mode,
        // no reallocation function).
        run(|status| unsafe {
            sys::ffomem(
                &mut ptr,
                name.as_ptr(),
                READONLY,
                &mut memory.ptr,
                &mut memory.size,
                0,
                None,
                status,
            );
        })
        .map_err(|(status, cause)| Error::Fits {
            path: path.into(),
            what: "cannot open".into(),
            message: failure_message(status, cause),
        })?;
        let mut fits = Fits::new(ptr, path);
        fits.memory = Some(memory);
        Ok(fits)
    }

    /// Keeps HDU `name` of this file, opened from inflated bytes, as a file of its own (a
    /// bare primary HDU, then that HDU's bytes) for [`Fits::open_part`], while the value
    /// returned lives; nothing for a file read from disk. A frame's writer copies its
    /// preproc's FIBERMAP long after the pixels were read: holding the whole inflated preproc
    /// (272 MB) until then made up a third of a reading-ahead rank's peak memory.
    pub fn keep_part(&mut self, name: &str) -> Result<KeepAlive> {
        let Some(bytes) = self.memory.as_ref().map(|m| Arc::clone(&m.bytes)) else {
            return Ok(KeepAlive::default());
        };
        self.move_to(name)?;
        let (head, _, end) = self.hdu_addresses()?;
        let Some(hdu) = bytes.get(head..end) else {
            return Err(self.error("cannot locate", format!("{name} lies outside the file")));
        };
        let mut part = bare_primary();
        part.extend_from_slice(hdu);
        let part = Arc::new(part);
        if let Some(id) = identity(&self.path) {
            remember(id, name, &part);
        }
        Ok(KeepAlive(Some(part)))
    }

    /// The file at `path` positioned at its HDU `name`: the part of it kept by
    /// [`Fits::keep_part`] while there is one, else the file itself.
    pub fn open_part(path: &Path, name: &str) -> Result<Self> {
        let kept = identity(path).and_then(|id| lookup(&id, name));
        let mut fits = match kept {
            Some(part) => Fits::open_memory(path, part)?,
            None => Fits::open(path)?,
        };
        fits.move_to(name)?;
        Ok(fits)
    }
}

/// A primary HDU without data, which a FITS file must start with.
fn bare_primary() -> Vec<u8> {
    let cards = [
        "SIMPLE  =                    T",
        "BITPIX  =                    8",
        "NAXIS   =                    0",
        "EXTEND  =                    T",
        "END",
    ];
    let mut block: Vec<u8> = cards
        .iter()
        .flat_map(|c| format!("{c:<80}").into_bytes())
        .collect();
    block.resize(super::RECORD, b' ');
    block
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_inflation_goes_in_chunks_alone_on_four_threads_or_more_and_from_4_mib() {
        let mib = 1 << 20;
        assert_eq!(chunk_bytes(true, 16, 98 * mib), Some(98 * mib / 64));
        assert_eq!(chunk_bytes(true, 64, 98 * mib), Some(512 << 10));
        assert_eq!(chunk_bytes(false, 16, 98 * mib), None);
        assert_eq!(chunk_bytes(true, 3, 98 * mib), None);
        assert_eq!(chunk_bytes(true, 16, 4 * mib - 1), None);
    }

    /// Pages of `buf` (page-aligned) in memory.
    #[cfg(target_os = "linux")]
    fn resident(buf: &[u8]) -> usize {
        let mut pages = vec![0u8; buf.len().div_ceil(4096)];
        // SAFETY: `buf` is a page-aligned mapping of `buf.len()` bytes, `pages` one byte a page.
        let status =
            unsafe { libc::mincore(buf.as_ptr() as *mut c_void, buf.len(), pages.as_mut_ptr()) };
        assert_eq!(status, 0, "mincore: {}", std::io::Error::last_os_error());
        pages.iter().filter(|&&p| p & 1 == 1).count()
    }

    #[cfg(target_os = "linux")]
    #[test]
    fn pages_are_mapped_ahead_on_a_pool_and_left_to_fault_on_a_thread_alone() {
        let len = 8 << 20;
        let pool = |n| {
            rayon::ThreadPoolBuilder::new()
                .num_threads(n)
                .build()
                .expect("pool")
        };
        // fresh anonymous memory, none of its pages mapped yet
        let fresh = || memmap2::MmapMut::map_anon(len).expect("an anonymous mapping");
        let mut alone = fresh();
        pool(1).install(|| populate(&mut alone));
        assert_eq!(resident(&alone), 0);
        let mut shared = fresh();
        pool(2).install(|| populate(&mut shared));
        // as many pages as the kernel's advice maps by itself (none before Linux 5.14)
        let mut direct = fresh();
        // SAFETY: `direct` is a mapping of `len` bytes; the advice changes no byte.
        unsafe { libc::madvise(direct.as_mut_ptr().cast(), len, libc::MADV_POPULATE_WRITE) };
        assert_eq!(resident(&shared), resident(&direct));
        assert!(resident(&direct) == 0 || resident(&direct) == len / 4096);
    }

    #[test]
    fn mapping_pages_ahead_changes_no_byte() {
        let mut fresh = zeroed(3 << 20).expect("3 MiB");
        populate(&mut fresh[1..]);
        assert!(fresh.iter().all(|&b| b == 0));
        let mut written: Vec<u8> = (0..3_000_001u32).map(|i| (i % 251) as u8).collect();
        let copy = written.clone();
        populate(&mut written);
        assert_eq!(written, copy);
    }

    #[test]
    fn a_file_that_cannot_be_mapped_is_read() {
        // procfs files have no mapping; their bytes are no gzip stream
        let status = Path::new("/proc/self/status");
        // SAFETY: a read-only mapping, dropped at once if the kernel makes one.
        assert!(std::fs::File::open(status)
            .and_then(|f| unsafe { memmap2::MmapOptions::new().map(&f) })
            .is_err());
        assert!(matches!(inflate_file(status), Ok(None)));
    }

    #[test]
    fn a_kept_part_outlives_the_rest_of_its_file_and_reads_as_the_whole_did() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("p.fits.gz");
        let mut f = Fits::create(&path).unwrap();
        f.write_image("IMAGE", &[2, 2], &[1f32, 2.0, 3.0, 4.0])
            .unwrap();
        f.write_image("IVAR", &[1, 3], &[5f32, 6.0, 7.0]).unwrap();
        f.close().unwrap();
        let whole = inflate_gzip(&path).unwrap().expect("inflated");
        let kept = {
            let mut opened = Fits::open(&path).unwrap();
            opened.keep_part("IVAR").unwrap()
        };
        let weak = Arc::downgrade(&whole);
        drop(whole);
        assert_eq!(weak.strong_count(), 0, "the rest of the file is let go");
        let mut part = Fits::open_part(&path, "IVAR").unwrap();
        assert_eq!(part.read_image::<f32>().unwrap().1, [5.0, 6.0, 7.0]);
        let bytes = kept.0.as_ref().expect("a part");
        assert_eq!(
            bytes.len(),
            3 * crate::fits::RECORD,
            "a bare primary HDU, IVAR's header and its data, a block each"
        );
        let id = identity(&path).unwrap();
        assert!(
            lookup(&id, WHOLE).is_none(),
            "the part read without inflating the file again"
        );
        drop((part, kept));
        // no part kept (or another HDU asked for): the file itself
        let mut again = Fits::open_part(&path, "IMAGE").unwrap();
        assert_eq!(again.read_image::<f32>().unwrap().1, [1.0, 2.0, 3.0, 4.0]);
        // a file read from disk keeps nothing
        let plain = dir.path().join("p.fits");
        let mut f = Fits::create(&plain).unwrap();
        f.write_image("IMAGE", &[1, 1], &[9f32]).unwrap();
        f.close().unwrap();
        assert!(Fits::open(&plain)
            .unwrap()
            .keep_part("IMAGE")
            .unwrap()
            .0
            .is_none());
    }

    #[test]
    fn an_inflated_file_is_shared_while_held_and_inflated_again_when_it_changed() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("x.fits.gz");
        let mut f = Fits::create(&path).unwrap();
        f.write_image("IMAGE", &[2, 2], &[1f32, 2.0, 3.0, 4.0])
            .unwrap();
        f.close().unwrap();
        assert!(is_gzip(&path));
        let a = inflate_gzip(&path).unwrap().expect("inflated");
        let b = inflate_gzip(&path).unwrap().expect("inflated");
        assert!(Arc::ptr_eq(&a, &b), "a held file is inflated once");
        let mut opened = Fits::open(&path).unwrap();
        opened.move_to("IMAGE").unwrap();
        assert_eq!(opened.read_image::<f32>().unwrap().1, [1.0, 2.0, 3.0, 4.0]);
        drop((a, b, opened));
        // rewritten with other pixels (and so another size or time): read afresh
        std::thread::sleep(std::time::Duration::from_millis(20));
        let mut f = Fits::create(&path).unwrap();
        f.write_image("IMAGE", &[1, 3], &[5f32, 6.0, 7.0]).unwrap();
        f.close().unwrap();
        let mut opened = Fits::open(&path).unwrap();
        opened.move_to("IMAGE").unwrap();
        assert_eq!(opened.read_image::<f32>().unwrap().1, [5.0, 6.0, 7.0]);
    }
}
