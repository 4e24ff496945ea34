//! Inflating one large gzip member on several cores.
//!
//! A deflate stream is sequential twice over: its blocks are found only by decoding the ones
//! before them, and a block copies bytes from the 32 KiB decoded before it. desi_proc's
//! preprocs are one member deflated at level 9, which one core inflates in 0.4-0.5 s for a
//! full r frame, most of the time a single-frame run spends reading it. Here the member is cut
//! into chunks that are inflated at once:
//!
//! 1. Each chunk but the first starts at the first bit past its nominal byte where the header
//!    of a dynamic Huffman block parses (`blocks`).
//! 2. Each such chunk is inflated by libdeflate behind a made-up 32 KiB window (a stored
//!    block), twice, with two windows that encode their byte positions differently. A byte
//!    equal in both decodes is final; one that differs was copied, directly or through other
//!    copies, from the window, and its two values name the window byte. This gives each
//!    chunk's length and the bytes it copied; the decodes go to buffers each thread keeps. A
//!    chunk whose bytes outgrow 16 times its compressed ones (a preproc's masks and constant
//!    images, half of its bytes from its last 1.5% of compressed ones) is cut again at the
//!    block starts within it, into pieces measured alike.
//! 3. The chunks are inflated once more, straight into their places in the file's buffer, the
//!    even ones then the odd ones (a chunk's made-up window lands on the end of the chunk
//!    before it, which is decoded, or put back, afterwards).
//! 4. The windows become known in order, each chunk's last 32 KiB once the chunk before it is
//!    known; then the bytes copied from them are filled in, the chunks on all cores at once.
//!    A chunk that copies most of its bytes (a mask or a constant image: runs coded as copies
//!    of copies) is not listed byte by byte: only its last 32 KiB are found from its two
//!    decodes, and it is inflated again behind its real window instead of step 3, all such
//!    chunks at once.
//! 5. The result stands only if every chunk ended exactly where the next one starts and the
//!    last where the member's trailer starts, and its size and CRC-32 are the trailer's.
//!    Anything else (a block start that was not one, a file of several members, damage) gives
//!    `None`, and the caller inflates the file on one core, which also says what is wrong.
//!
//! On a full r preproc (272 MB from 98 MB) and 16 threads of an H200 machine this takes
//! 0.16-0.19 s, a process's first inflation included, against 0.56 s on one of its cores;
//! about three times the CPU time of one core, so the caller uses it only where a read is on
//! the critical path. Freshly allocated memory costs more than a decode when many threads
//! fault it in at once, hence the kept buffers, replaced rather than grown when too small, and
//! the third decode rather than a copy.

mod blocks;

use std::cell::RefCell;
use std::ops::{Range, RangeInclusive};

use flate2::Crc;
use rayon::prelude::*;

use blocks::first_block_start;

/// The largest distance a deflate block copies from.
const WINDOW: usize = 1 << 15;
/// A stored block holding a window: a header byte (not final, stored), LEN and NLEN.
const STORED: [u8; 5] = [0, 0x00, 0x80, 0xff, 0x7f];

/// Inflates the gzip member `gz` (header, deflate stream and trailer, nothing after it) in
/// chunks of about `chunk_bytes` compressed bytes on rayon's pool, into a buffer from `alloc`;
/// `None` when the stream cannot be split or is not what the trailer says.
pub(super) fn inflate(
    gz: &[u8],
    chunk_bytes: usize,
    alloc: impl FnOnce(usize) -> Option<Vec<u8>>,
) -> Option<Vec<u8>> {
    let t0 = std::time::Instant::now();
    let windows = Windows::new();
    let (chunks, trailer) = measure_chunks(gz, chunk_bytes, &windows)?;
    let t1 = t0.elapsed().as_secs_f64();
    let total: usize = chunks.iter().map(|c| c.len).sum();
    // Every window lies within the chunk before it; the trailer has the size modulo 2^32.
    let short = chunks.iter().rev().skip(1).any(|c| c.len < WINDOW);
    if short || total as u32 != trailer.size {
        return None;
    }
    let mut out = alloc(total)?;
    place_chunks(gz, &chunks, &windows.a, &mut out)?;
    let t2 = t0.elapsed().as_secs_f64();
    let crc = fill_windows(gz, &chunks, &mut out)?;
    let many = chunks
        .iter()
        .filter(|c| matches!(c.sources, Sources::Many(_)))
        .count();
    tracing::debug!(
        "{} chunks ({many} copying most of their bytes) on {} threads: measured in {t1:.3} s, \
         placed in {:.3} s, windows filled in {:.3} s",
        chunks.len(),
        rayon::current_num_threads(),
        t2 - t1,
        t0.elapsed().as_secs_f64() - t2,
    );
    (crc == trailer.crc).then_some(out)
}

/// The CRC-32 and size (modulo 2^32) of the inflated member, as its trailer gives them.
#[derive(Clone, Copy)]
struct Trailer {
    crc: u32,
    size: u32,
}

/// A chunk of the stream: its bits, its place in the inflated file (`at`, known once every
/// chunk before it is measured), its length inflated and the bytes it copied from the window
/// before it.
struct Chunk {
    bits: Range<u64>,
    place: Place,
    at: usize,
    len: usize,
    sources: Sources,
}

impl Chunk {
    /// Its bytes' place in the inflated file.
    fn span(&self) -> Range<usize> {
        self.at..self.at + self.len
    }
}

/// Where a chunk lies in the member.
#[derive(Clone, Copy)]
struct Place {
    /// It starts the stream: at a byte, with nothing before it to copy from.
    first: bool,
    /// It ends the stream with the stream's own last block.
    last: bool,
}

/// Where the bytes of a chunk that came from the window before it were copied from.
enum Sources {
    /// (index in the chunk, window position) of each, in order: where they are few.
    Few(Vec<(u32, u16)>),
    /// Too many to list (a run of zeros that deflate codes as copies of copies): the chunk is
    /// inflated again behind its real window once that is known, and meanwhile its last
    /// bytes, the next chunk's window, are found from its two decodes.
    Many(Tails),
}

/// The last [`WINDOW`] bytes (or all, if fewer) of a chunk decoded behind windows A and B.
struct Tails {
    a: Vec<u8>,
    b: Vec<u8>,
}

/// What every measure of a chunk reads: the member, the most bytes a chunk can have (the
/// member's, reserved in the decode buffers), the made-up windows.
struct Member<'a> {
    gz: &'a [u8],
    room: usize,
    windows: &'a Windows,
}

/// What measuring a chunk gave.
enum Measured {
    Chunk(Chunk),
    /// Its bytes outgrew [`DENSE`] times its bits and the bytes allowed: it is to be cut into
    /// pieces.
    Dense,
}

/// The ratio of a chunk's bytes to its compressed bytes beyond which it is taken to copy many
/// from its window (a preproc's floats inflate to about 3 times their size, its masks and
/// constant images to hundreds).
const DENSE: usize = 16;

/// A dense chunk is cut into about this many pieces. A preproc's mask and constant images
/// inflate from its last 1.5% of compressed bytes: one chunk that held half of the file.
const PIECES: u64 = 32;

/// The buffers a thread inflates chunks into while measuring them: the deflate input, and the
/// decodes behind windows A and B. Kept from one chunk (and file) to the next.
#[derive(Default)]
struct Scratch {
    input: Vec<u8>,
    a: Vec<u8>,
    b: Vec<u8>,
}

thread_local! {
    static SCRATCH: RefCell<Scratch> = RefCell::new(Scratch::default());
}

impl Scratch {
    /// Frees the buffers that a mask-like chunk filled (tens of MB), which a thread of a
    /// long-lived process (a Python caller's) would otherwise keep; the usual ones stay.
    fn trim(&mut self) {
        const KEPT: usize = 32 << 20;
        for buf in [&mut self.input, &mut self.a, &mut self.b] {
            if buf.len() > KEPT {
                *buf = Vec::new();
            }
        }
    }
}

/// The chunks of `gz`, each inflated twice, and its trailer.
fn measure_chunks(
    gz: &[u8],
    chunk_bytes: usize,
    windows: &Windows,
) -> Option<(Vec<Chunk>, Trailer)> {
    let start = deflate_start(gz)?;
    let end = gz.len() - 8;
    let word = |at: usize| u32::from_le_bytes([gz[at], gz[at + 1], gz[at + 2], gz[at + 3]]);
    let trailer = Trailer {
        crc: word(end),
        size: word(end + 4),
    };
    let t0 = std::time::Instant::now();
    let stream = 8 * start as u64..8 * end as u64;
    let starts = chunk_starts(gz, stream.clone(), chunk_bytes.max(1), stream.end);
    if starts.len() < 2 {
        return None;
    }
    let t_found = t0.elapsed().as_secs_f64();
    let bits = |k: usize| starts.get(k).copied().unwrap_or(stream.end);
    let place = |k: usize| Place {
        first: k == 0,
        last: k + 1 == starts.len(),
    };
    // A chunk's bytes: at most the member's (modulo 2^32, as the trailer has them).
    let member = Member {
        gz,
        room: usize::try_from(trailer.size).ok()?,
        windows,
    };
    // Every chunk, a dense one only until it outgrows DENSE times its bits; then the pieces
    // of the dense ones all at once (measured within the first pass, they waited there for
    // threads busy with whole chunks).
    let measured = (0..starts.len())
        .into_par_iter()
        .map(|k| {
            let (bits, place) = (bits(k)..bits(k + 1), place(k));
            let measured = measure_with_scratch(&member, bits.clone(), place, Some(0));
            measured.map(|m| (bits, place, m))
        })
        .collect::<Option<Vec<_>>>()?;
    let t_first = t0.elapsed().as_secs_f64();
    // a piece no larger than a chunk of noisy floats
    let (mut chunks, dense, pieces) = cut_dense(&member, measured, 4 * chunk_bytes)?;
    tracing::debug!(
        "{} chunks found in {t_found:.3} s, measured in {:.3} s; {dense} dense cut into \
         {pieces} pieces, measured in {:.3} s",
        starts.len(),
        t_first - t_found,
        t0.elapsed().as_secs_f64() - t_first,
    );
    let mut at = 0;
    for chunk in &mut chunks {
        chunk.at = at;
        at += chunk.len;
    }
    Some((chunks, trailer))
}

/// The chunks `measured` (with their bits and places) in order, each dense one replaced by its
/// pieces (at most `most` bytes each where the blocks allow), the dense ones cut at once; and
/// how many dense chunks there were and how many pieces they gave.
fn cut_dense(
    member: &Member<'_>,
    measured: Vec<(Range<u64>, Place, Measured)>,
    most: usize,
) -> Option<(Vec<Chunk>, usize, usize)> {
    let whole = measured.len();
    let dense = measured
        .iter()
        .filter(|(_, _, m)| matches!(m, Measured::Dense))
        .count();
    let parts = measured
        .into_par_iter()
        .map(|(bits, place, measured)| match measured {
            Measured::Chunk(chunk) => Some(vec![chunk]),
            Measured::Dense => measure_cut(member, bits, place, most),
        })
        .collect::<Option<Vec<Vec<Chunk>>>>()?;
    let chunks: Vec<Chunk> = parts.into_iter().flatten().collect();
    let pieces = chunks.len() + dense - whole;
    Some((chunks, dense, pieces))
}

/// [`measure`] with the calling thread's kept buffers, freed again if a chunk outgrew them.
fn measure_with_scratch(
    member: &Member<'_>,
    bits: Range<u64>,
    place: Place,
    cap: Option<usize>,
) -> Option<Measured> {
    SCRATCH.with(|s| {
        let mut scratch = s.borrow_mut();
        let measured = measure(member, bits, place, cap, &mut scratch);
        scratch.trim();
        measured
    })
}

/// The pieces of the dense chunk at `bits` (at `place`): cut at the first block starts past
/// [`PIECES`] nominal bytes. Inflated one after the other behind their real windows, a
/// preproc's dense chunks took most of the time of the whole.
fn pieces_of(gz: &[u8], bits: Range<u64>, place: Place) -> Vec<(Range<u64>, Place)> {
    let step = ((bits.end - bits.start) / 8 / PIECES).max(1) as usize;
    let stream_end = 8 * (gz.len() - 8) as u64;
    let starts = chunk_starts(gz, bits.clone(), step, stream_end);
    let bound = |j: usize| starts.get(j).copied().unwrap_or(bits.end);
    (0..starts.len())
        .map(|j| {
            let last = place.last && j + 1 == starts.len();
            (bound(j)..bound(j + 1), Place { first: false, last })
        })
        .collect()
}

/// The measured `pieces` of one dense chunk, a piece shorter than a window (a block of noise
/// before a mask) joined to the next one (or the last to the one before), measured again.
fn joined(member: &Member<'_>, mut pieces: Vec<Chunk>) -> Option<Vec<Chunk>> {
    let mut j = 0;
    while j + 1 < pieces.len() {
        let ends_short = j + 2 == pieces.len() && pieces[j + 1].len < WINDOW;
        if pieces[j].len >= WINDOW && (!ends_short || pieces[j + 1].place.last) {
            j += 1;
            continue;
        }
        let next = pieces.remove(j + 1);
        let bits = pieces[j].bits.start..next.bits.end;
        pieces[j] = match measure_with_scratch(member, bits, next.place, None)? {
            Measured::Chunk(chunk) => chunk,
            Measured::Dense => return None,
        };
    }
    Some(pieces)
}

/// A piece of a dense chunk, measured, or if its bytes outgrow `most` (a mask's megabytes
/// from a few kilobytes), cut again.
fn measure_piece(
    member: &Member<'_>,
    bits: Range<u64>,
    place: Place,
    most: usize,
) -> Option<Vec<Chunk>> {
    match measure_with_scratch(member, bits.clone(), place, Some(most))? {
        Measured::Chunk(chunk) => Some(vec![chunk]),
        Measured::Dense => measure_cut(member, bits, place, most),
    }
}

/// The dense stretch `bits` (at `place`) cut at the block starts within it, its pieces
/// measured at once (each cut again if it outgrows `most`); measured whole where no block
/// starts within it.
fn measure_cut(
    member: &Member<'_>,
    bits: Range<u64>,
    place: Place,
    most: usize,
) -> Option<Vec<Chunk>> {
    let cuts = pieces_of(member.gz, bits.clone(), place);
    if cuts.len() < 2 {
        return match measure_with_scratch(member, bits, place, None)? {
            Measured::Chunk(chunk) => Some(vec![chunk]),
            Measured::Dense => None,
        };
    }
    let pieces = cuts
        .into_par_iter()
        .map(|(bits, place)| measure_piece(member, bits, place, most))
        .collect::<Option<Vec<Vec<Chunk>>>>()?;
    joined(member, pieces.into_iter().flatten().collect())
}

/// Where the deflate stream of the gzip member `gz` starts, past its header's optional fields.
fn deflate_start(gz: &[u8]) -> Option<usize> {
    const MAGIC_DEFLATE: [u8; 3] = [0x1f, 0x8b, 8];
    let (text, hcrc, extra, name, comment) = (1u8, 2u8, 4u8, 8u8, 16u8);
    if gz.len() < 18
        || gz[..3] != MAGIC_DEFLATE
        || gz[3] & !(text | hcrc | extra | name | comment) != 0
    {
        return None;
    }
    let flags = gz[3];
    let mut at = 10;
    if flags & extra != 0 {
        at += 2 + u16::from_le_bytes([*gz.get(at)?, *gz.get(at + 1)?]) as usize;
    }
    for field in [name, comment] {
        if flags & field != 0 {
            at += gz.get(at..)?.iter().position(|&b| b == 0)? + 1;
        }
    }
    if flags & hcrc != 0 {
        at += 2;
    }
    (at + 8 < gz.len()).then_some(at)
}

/// The bit where each chunk of the stretch `bits` starts: the first at its start, each other
/// at the first block header (parsed up to `stream_end`) found past a multiple of
/// `chunk_bytes` from it, before the next multiple.
fn chunk_starts(gz: &[u8], bits: Range<u64>, chunk_bytes: usize, stream_end: u64) -> Vec<u64> {
    let nominal: Vec<u64> = (bits.start..bits.end)
        .step_by(8 * chunk_bytes)
        .map(|bit| bit / 8 * 8)
        .collect();
    let found: Vec<Option<u64>> = nominal
        .par_iter()
        .enumerate()
        .map(|(k, &from)| {
            if k == 0 {
                return Some(bits.start);
            }
            let to = nominal.get(k + 1).copied().unwrap_or(bits.end);
            first_block_start(gz, from..to, stream_end)
        })
        .collect();
    found.into_iter().flatten().collect()
}

/// The two made-up windows: at position j, `a` holds j's low byte and `b` holds `a + (j >> 8)
/// + 1` (mod 256), which differs from `a` everywhere and with it gives j back.
struct Windows {
    a: Vec<u8>,
    b: Vec<u8>,
}

impl Windows {
    fn new() -> Self {
        let a: Vec<u8> = (0..WINDOW).map(|j| j as u8).collect();
        let b = (0..WINDOW)
            .map(|j| (j as u8).wrapping_add((j >> 8) as u8).wrapping_add(1))
            .collect();
        Windows { a, b }
    }
}

/// The window position that a byte decoded as `a` behind window A and as `b` behind window B
/// was copied from.
fn window_position(a: u8, b: u8) -> Option<u16> {
    let high = b.wrapping_sub(a).wrapping_sub(1);
    (high < 128).then_some(u16::from(high) << 8 | u16::from(a))
}

/// Inflates the bits `bits` of `gz` into `scratch`, the first chunk once, any other twice, for
/// its length and the bytes it copied from its window (at most the member's, reserved);
/// [`Measured::Dense`] as soon as its bytes outgrow both [`DENSE`] times its bits and `cap`
/// (`None`: it is not to be cut).
fn measure(
    member: &Member<'_>,
    bits: Range<u64>,
    place: Place,
    cap: Option<usize>,
    scratch: &mut Scratch,
) -> Option<Measured> {
    let Member { gz, room, windows } = *member;
    let Scratch { input, a, b } = scratch;
    let used = shifted_into(input, gz, bits.clone(), place);
    let chunk = |len, sources| {
        Some(Measured::Chunk(Chunk {
            bits: bits.clone(),
            place,
            at: 0,
            len,
            sources,
        }))
    };
    if place.first {
        return match decompress_into(input, a, room, usize::MAX, &used) {
            Decoded::Done => chunk(a.len(), Sources::Few(Vec::new())),
            _ => None,
        };
    }
    input[STORED.len()..STORED.len() + WINDOW].copy_from_slice(&windows.a);
    // Bytes many times the bits that code them are long copies: such a chunk is cut into
    // pieces before it is inflated to its end.
    let limit = cap.map_or(usize::MAX, |cap| WINDOW + cap.max(DENSE * input.len()));
    match decompress_into(input, a, room + WINDOW, limit, &used) {
        Decoded::Done => {}
        Decoded::OverLimit => return Some(Measured::Dense),
        Decoded::Bad => return None,
    }
    input[STORED.len()..STORED.len() + WINDOW].copy_from_slice(&windows.b);
    if !matches!(
        decompress_into(input, b, a.len(), usize::MAX, &used),
        Decoded::Done
    ) || b.len() != a.len()
    {
        return None;
    }
    chunk(a.len() - WINDOW, sources(&a[WINDOW..], &b[WINDOW..])?)
}

/// Where each byte that differs between `a` and `b` was copied from.
fn sources(a: &[u8], b: &[u8]) -> Option<Sources> {
    // Runs compared as slices (memcmp), then the bytes of those that differ.
    const RUN: usize = 64;
    let runs = || {
        a.chunks(RUN)
            .zip(b.chunks(RUN))
            .enumerate()
            .filter(|(_, (x, y))| x != y)
    };
    if 4 * runs().count() > a.len() / RUN {
        let tail = a.len().saturating_sub(WINDOW);
        return Some(Sources::Many(Tails {
            a: a[tail..].to_vec(),
            b: b[tail..].to_vec(),
        }));
    }
    // Counted first: a list grown by pushes reallocated and faulted in fresh pages at every
    // doubling, a fifth of a process's first chunked inflation.
    let differ = |(x, y): (&[u8], &[u8])| x.iter().zip(y).filter(|(x, y)| x != y).count();
    let mut few = Vec::with_capacity(runs().map(|(_, xy)| differ(xy)).sum());
    for (run, (x, y)) in runs() {
        for (i, (&x, &y)) in x.iter().zip(y).enumerate().filter(|(_, (x, y))| x != y) {
            few.push(((run * RUN + i) as u32, window_position(x, y)?));
        }
    }
    Some(Sources::Few(few))
}

/// Fills `dst` with the bits of `src` from bit `shift` (0-7) of its first byte on: byte `i`
/// takes the high bits of `src[i]` and the low bits of `src[i + 1]` (zero past the end).
/// Eight bytes at a time as one little-endian word: a chunk's compressed bytes are moved before
/// its measure and again before its placement, and byte by byte this took a tenth of a chunked
/// inflation's CPU time.
fn shift_down(dst: &mut [u8], src: &[u8], shift: u32) {
    if shift == 0 {
        dst.copy_from_slice(&src[..dst.len()]);
        return;
    }
    // the words whose next byte is in `src`
    let words = dst.len().min(src.len().saturating_sub(1)) / 8;
    for (w, out) in dst.chunks_exact_mut(8).take(words).enumerate() {
        let at = 8 * w;
        let mut word = [0u8; 8];
        word.copy_from_slice(&src[at..at + 8]);
        let bits = u64::from_le_bytes(word) >> shift | u64::from(src[at + 8]) << (64 - shift);
        out.copy_from_slice(&bits.to_le_bytes());
    }
    for i in 8 * words..dst.len() {
        let high = src.get(i + 1).map_or(0, |&h| h << (8 - shift));
        dst[i] = src[i] >> shift | high;
    }
}

/// Puts into `input` the bits `bits` of `gz` moved to start on a byte, after room for a stored
/// block holding a window unless the chunk is the first, and followed by an empty last block
/// unless it is the last; returns how many bytes of it a right decode reads.
fn shifted_into(
    input: &mut Vec<u8>,
    gz: &[u8],
    bits: Range<u64>,
    place: Place,
) -> RangeInclusive<usize> {
    let prefix = if place.first {
        0
    } else {
        STORED.len() + WINDOW
    };
    let (from, nbits) = (bits.start, (bits.end - bits.start) as usize);
    // BFINAL 1, BTYPE 1 (fixed codes), then the end of block: seven zero bits
    let ending = if place.last { 0 } else { 10 };
    input.clear();
    input.resize(prefix + (nbits + ending).div_ceil(8), 0);
    input[..prefix.min(STORED.len())].copy_from_slice(&STORED[..prefix.min(STORED.len())]);
    let body = &mut input[prefix..];
    shift_down(
        &mut body[..nbits.div_ceil(8)],
        &gz[(from / 8) as usize..],
        (from % 8) as u32,
    );
    if nbits % 8 != 0 {
        body[nbits / 8] &= (1u8 << (nbits % 8)) - 1;
    }
    if !place.last {
        body[nbits / 8] |= 0b011 << (nbits % 8);
        if nbits % 8 > 5 {
            body[nbits / 8 + 1] |= 0b011 >> (8 - nbits % 8);
        }
        return input.len()..=input.len();
    }
    // The stream's own last block ends within its last byte.
    prefix + nbits.saturating_sub(7).div_ceil(8)..=prefix + nbits.div_ceil(8)
}

/// A libdeflate decompressor, freed when dropped.
struct Decompressor(*mut libdeflate_sys::libdeflate_decompressor);

impl Decompressor {
    fn new() -> Option<Self> {
        // SAFETY: allocates a decompressor (null on failure), freed by `drop`.
        let d = unsafe { libdeflate_sys::libdeflate_alloc_decompressor() };
        (!d.is_null()).then_some(Decompressor(d))
    }

    /// Inflates the raw deflate stream `input` into `out` (at most `room` bytes, `out` having
    /// room for them); `Err(true)` when they are too few, `Err(false)` when the stream is bad
    /// or a number of bytes outside `used` was read.
    fn run(
        &self,
        input: &[u8],
        out: *mut u8,
        room: usize,
        used: &RangeInclusive<usize>,
    ) -> Result<usize, bool> {
        use libdeflate_sys::libdeflate_result_LIBDEFLATE_INSUFFICIENT_SPACE as NO_ROOM;
        use libdeflate_sys::libdeflate_result_LIBDEFLATE_SUCCESS as SUCCESS;
        let (mut read, mut made) = (0usize, 0usize);
        // SAFETY: the pointers address `input.len()` readable bytes and `room` writable ones
        // (the caller's promise); libdeflate writes only within them and stores the counts.
        let status = unsafe {
            libdeflate_sys::libdeflate_deflate_decompress_ex(
                self.0,
                input.as_ptr().cast(),
                input.len(),
                out.cast(),
                room,
                &mut read,
                &mut made,
            )
        };
        match status {
            SUCCESS if used.contains(&read) => Ok(made),
            NO_ROOM => Err(true),
            _ => Err(false),
        }
    }
}

impl Drop for Decompressor {
    fn drop(&mut self) {
        // SAFETY: allocated by libdeflate_alloc_decompressor, not used after this.
        unsafe { libdeflate_sys::libdeflate_free_decompressor(self.0) }
    }
}

/// How a decode into a buffer ended.
enum Decoded {
    Done,
    /// It needed more bytes than its limit.
    OverLimit,
    /// The stream is bad, or ends elsewhere than it should.
    Bad,
}

/// Inflates `input` into `out`, with room for at least `room` bytes (reserved, untouched until
/// written, and kept by `out` for the next chunk), growing it as needed up to `limit` bytes.
fn decompress_into(
    input: &[u8],
    out: &mut Vec<u8>,
    room: usize,
    limit: usize,
    used: &RangeInclusive<usize>,
) -> Decoded {
    let Some(decompressor) = Decompressor::new() else {
        return Decoded::Bad;
    };
    out.clear();
    let want = room.min(limit);
    if out.capacity() < want {
        replace_empty(out, want);
    }
    loop {
        let room = out.capacity().min(limit);
        match decompressor.run(input, out.as_mut_ptr(), room, used) {
            Ok(made) => {
                // SAFETY: libdeflate wrote the first `made` (<= capacity) bytes.
                unsafe { out.set_len(made) };
                return Decoded::Done;
            }
            Err(true) if room == limit => return Decoded::OverLimit,
            Err(true) => replace_empty(out, 2 * out.capacity()),
            Err(false) => return Decoded::Bad,
        }
    }
}

/// Gives the empty `out` room for `capacity` bytes in a new buffer rather than a grown one:
/// growing copies all the capacity the old one had (the allocator does not know it was
/// cleared), and sixteen threads doing so at once, each through a fresh mapping, made a
/// process's first chunked inflation take 1.5-3.4 s instead of 0.6 s with 16 threads on two
/// cores. The old buffer goes first, so that the two are never held at once.
fn replace_empty(out: &mut Vec<u8>, capacity: usize) {
    *out = Vec::new();
    *out = Vec::with_capacity(capacity);
}

/// Inflates each chunk a third time, behind window A, straight into its place in `out`: the
/// even chunks, then the odd ones, whose made-up windows land on the ends of the even ones,
/// put back afterwards.
fn place_chunks(gz: &[u8], chunks: &[Chunk], window: &[u8], out: &mut [u8]) -> Option<()> {
    let mut kept = Vec::new();
    for parity in [0, 1] {
        if parity == 1 {
            kept = (1..chunks.len())
                .step_by(2)
                .map(|k| out[chunks[k].at - WINDOW..chunks[k].at].to_vec())
                .collect();
        }
        // Those with many bytes copied from their windows are inflated later, behind their
        // real windows.
        let listed = (parity..chunks.len())
            .step_by(2)
            .filter(|&k| matches!(chunks[k].sources, Sources::Few(_)));
        let spans = listed.map(|k| {
            let before = if chunks[k].place.first { 0 } else { WINDOW };
            (k, chunks[k].at - before..chunks[k].span().end)
        });
        regions(out, spans)
            .into_par_iter()
            .try_for_each(|(k, region)| inflate_behind(gz, &chunks[k], window, region))?;
    }
    for (k, tail) in (1..chunks.len()).step_by(2).zip(kept) {
        out[chunks[k].at - WINDOW..chunks[k].at].copy_from_slice(&tail);
    }
    Some(())
}

/// Inflates `chunk` behind `window` (unless it is the first) into `region`, which it must fill.
fn inflate_behind(gz: &[u8], chunk: &Chunk, window: &[u8], region: &mut [u8]) -> Option<()> {
    SCRATCH.with(|scratch| {
        let input = &mut scratch.borrow_mut().input;
        let used = shifted_into(input, gz, chunk.bits.clone(), chunk.place);
        if !chunk.place.first {
            input[STORED.len()..STORED.len() + WINDOW].copy_from_slice(window);
        }
        let decompressor = Decompressor::new()?;
        let made = decompressor
            .run(input, region.as_mut_ptr(), region.len(), &used)
            .ok()?;
        (made == region.len()).then_some(())
    })
}

/// `out` cut into the disjoint, ordered `spans`, each with its chunk.
fn regions(
    out: &mut [u8],
    spans: impl Iterator<Item = (usize, Range<usize>)>,
) -> Vec<(usize, &mut [u8])> {
    let (mut rest, mut offset) = (out, 0);
    let mut regions = Vec::new();
    for (k, span) in spans {
        let (_, from) = std::mem::take(&mut rest).split_at_mut(span.start - offset);
        let (region, tail) = from.split_at_mut(span.len());
        regions.push((k, region));
        (rest, offset) = (tail, span.end);
    }
    regions
}

/// Fills in the bytes each chunk copied from the window before it: each chunk's last
/// [`WINDOW`] bytes in order (the next chunk's window), then the rest of every chunk at once,
/// a chunk with many copied bytes inflated again behind its real window (the even ones, then
/// the odd ones: each writes its window again, the end of the chunk before it, as it already
/// is). Returns the CRC-32 of the whole.
fn fill_windows(gz: &[u8], chunks: &[Chunk], out: &mut [u8]) -> Option<u32> {
    let tail = |c: &Chunk| c.len - c.len.min(WINDOW)..c.len;
    let mut windows = Vec::with_capacity(chunks.len());
    for chunk in chunks {
        let window = out[chunk.at.saturating_sub(WINDOW)..chunk.at].to_vec();
        let part = &mut out[chunk.span()];
        match &chunk.sources {
            Sources::Few(few) => fill(part, few, &window, tail(chunk)),
            Sources::Many(tails) => resolve(&mut part[tail(chunk)], tails, &window)?,
        }
        windows.push(window);
    }
    for parity in [0, 1] {
        let spans = chunks
            .iter()
            .enumerate()
            .filter_map(|(k, c)| match c.sources {
                Sources::Few(_) if parity == 0 => Some((k, c.at..c.at + tail(c).start)),
                Sources::Many(_) if k % 2 == parity => Some((k, c.at - WINDOW..c.span().end)),
                _ => None,
            });
        regions(out, spans)
            .into_par_iter()
            .try_for_each(|(k, region)| match &chunks[k].sources {
                Sources::Few(few) => {
                    fill(region, few, &windows[k], 0..region.len());
                    Some(())
                }
                Sources::Many(_) => inflate_behind(gz, &chunks[k], &windows[k], region),
            })?;
    }
    let spans = chunks.iter().enumerate().map(|(k, c)| (k, c.span()));
    let sums: Vec<Crc> = regions(out, spans)
        .into_par_iter()
        .map(|(_, part)| {
            let mut sum = Crc::new();
            sum.update(part);
            sum
        })
        .collect();
    let mut whole = Crc::new();
    sums.iter().for_each(|sum| whole.combine(sum));
    Some(whole.sum())
}

/// Writes into `part` the bytes that `tails` decoded: as they are where both decodes agree,
/// else the byte of `window` they name.
fn resolve(part: &mut [u8], tails: &Tails, window: &[u8]) -> Option<()> {
    for ((byte, &a), &b) in part.iter_mut().zip(&tails.a).zip(&tails.b) {
        *byte = if a == b {
            a
        } else {
            window[usize::from(window_position(a, b)?)]
        };
    }
    Some(())
}

/// Fills in the bytes of `part` within `range` that `few` says were copied from `window` (the
/// [`WINDOW`] bytes before it; the first chunk copies nothing).
fn fill(part: &mut [u8], few: &[(u32, u16)], window: &[u8], range: Range<usize>) {
    let from = few.partition_point(|&(i, _)| (i as usize) < range.start);
    for &(i, source) in few[from..]
        .iter()
        .take_while(|&&(i, _)| (i as usize) < range.end)
    {
        part[i as usize] = window[usize::from(source)];
    }
}

#[cfg(test)]
mod tests;
