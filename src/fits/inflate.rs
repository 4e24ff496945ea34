//! Inflating one large gzip member on several cores.
//!
//! desi_proc's preprocs are written by astropy as one gzip member without flush points, so
//! libdeflate inflates them on one core (a full r frame: 272 MB in ~0.34 s of a fast core,
//! after its pages are mapped). rapidgzip's two-stage method spreads such a member over
//! cores: deflate block boundaries are found speculatively in the compressed bytes, chunks
//! are decoded in parallel with an unknown 32 KiB window (back-references into it kept as
//! markers), and the markers are resolved with the previous chunk's last window. Here that
//! method is the `rapidgzip-core` crate's (zlib-rs behind it, no C to build).
//!
//! Speculation costs CPU: the marker path spends about four times libdeflate's CPU time per
//! byte (docs/benchmarks.md), so it is tried only for a large member, on a rank with enough
//! threads ([`MIN_BYTES`], [`MIN_THREADS`]) and while no other file inflates; and it is
//! abandoned as soon as the crate, which measures both paths on the first megabytes, settles
//! on plain sequential decoding (zlib-rs, slower than libdeflate on one core). Whatever this
//! path returns has been checked here against the member's CRC-32 (computed on rayon's pool)
//! and ISIZE, besides the crate's own checks; every failure returns `None` and the caller
//! inflates the file as before, so a damaged file gets the serial path's error.

use std::io::Read;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, OnceLock};

use flate2::Crc;
use rapidgzip_core::{Decoder, DecoderPath, DecoderPool};
use rayon::prelude::*;

/// Compressed bytes below which one core inflates in less time than the marker path takes
/// to start (its admission screen decodes the first megabytes twice).
pub const MIN_BYTES: usize = 16 << 20;

/// Threads below which the marker path cannot win: at about four times libdeflate's CPU time
/// per byte it needs more than four cores to be faster, and more to be worth the CPU taken
/// from the rank's other work.
pub const MIN_THREADS: usize = 8;

/// Whether a member of `compressed_len` bytes is worth inflating in parallel on `threads`
/// while `others` files are being inflated in the process. Only a lone file is: when a rank's
/// reader threads inflate several at once, the cores are already busy, and inflating each on
/// one core costs a quarter of the CPU time.
pub fn pays(compressed_len: usize, threads: usize, others: usize) -> bool {
    others == 0 && compressed_len >= MIN_BYTES && threads >= MIN_THREADS
}

/// Files being inflated in the process now, in parallel or not.
static INFLATING: AtomicUsize = AtomicUsize::new(0);

/// A file being inflated: counted in [`INFLATING`] while this lives.
pub struct Inflating(());

impl Inflating {
    /// Counts a file that starts inflating; with how many others were inflating then.
    pub fn start() -> (Self, usize) {
        (Self(()), INFLATING.fetch_add(1, Ordering::Relaxed))
    }
}

impl Drop for Inflating {
    fn drop(&mut self) {
        INFLATING.fetch_sub(1, Ordering::Relaxed);
    }
}

/// Whether the caller of [`inflate_one_member`] accepts the crate's sequential decoding.
#[derive(Clone, Copy, PartialEq, Eq)]
pub enum Sequential {
    /// Give up when the crate chooses it: libdeflate does the same work faster.
    GiveUp,
    /// Keep it (tests, which need the crate's output whatever path it chose on a busy
    /// machine).
    #[cfg(test)]
    Accept,
}

/// Inflates the single gzip member `compressed` into `out`, which is exactly its ISIZE long
/// (its pages mapped by the caller), on `threads` decoder threads; the number of bytes
/// written (`out.len()`) once verified, `None` if the parallel path gave up or failed.
pub fn inflate_one_member(
    compressed: &Arc<Vec<u8>>,
    out: &mut [u8],
    threads: usize,
    sequential: Sequential,
) -> Option<usize> {
    match try_inflate(compressed, out, threads, sequential) {
        Ok(path) => {
            tracing::debug!("inflated on {threads} threads ({path:?})");
            Some(out.len())
        }
        Err(why) => {
            tracing::debug!("parallel inflate gave up ({why}); inflating on one thread");
            None
        }
    }
}

fn try_inflate(
    compressed: &Arc<Vec<u8>>,
    out: &mut [u8],
    threads: usize,
    sequential: Sequential,
) -> Result<DecoderPath, String> {
    let decode = |e: &dyn std::fmt::Display| e.to_string();
    let mut builder = Decoder::builder()
        .decoder_threads(threads.max(1))
        .expected_uncompressed_size(Some(out.len() as u64));
    if let Some(pool) = shared_pool() {
        builder = builder.decoder_pool(pool);
    }
    let decoder = builder.build().map_err(|e| decode(&e))?;
    let mut reader = decoder
        .reader(Arc::clone(compressed))
        .map_err(|e| decode(&e))?;
    let (mut written, mut chosen) = (0, sequential != Sequential::GiveUp);
    while written < out.len() {
        let n = reader.read(&mut out[written..]).map_err(|e| decode(&e))?;
        if n == 0 {
            break;
        }
        if !chosen {
            // The crate chooses its path on the first megabytes, as their bytes come.
            match reader.stats().path {
                DecoderPath::Sequential => return Err("the decoder chose one thread".into()),
                DecoderPath::Starting | DecoderPath::MarkerAdmission => {}
                _ => chosen = true,
            }
        }
        written += n;
    }
    let path = reader.stats().path;
    let report = reader.finish().map_err(|e| decode(&e))?;
    if written != out.len() || report.member_count != 1 {
        return Err(format!(
            "{written} bytes in {} members, not one member of {}",
            report.member_count,
            out.len()
        ));
    }
    if !matches_trailer(compressed, out) {
        return Err("CRC-32 or size differs from the trailer's".into());
    }
    Ok(path)
}

/// Whether `inflated` has the CRC-32 and ISIZE of the trailer that ends `compressed`.
pub fn matches_trailer(compressed: &[u8], inflated: &[u8]) -> bool {
    let Some(trailer) = compressed.len().checked_sub(8).map(|at| &compressed[at..]) else {
        return false;
    };
    let word = |at: usize| {
        u32::from_le_bytes([
            trailer[at],
            trailer[at + 1],
            trailer[at + 2],
            trailer[at + 3],
        ])
    };
    word(4) == inflated.len() as u32 && word(0) == crc32(inflated)
}

/// The CRC-32 of `bytes`, computed by chunks on rayon's pool and combined.
fn crc32(bytes: &[u8]) -> u32 {
    const CHUNK: usize = 4 << 20;
    bytes
        .par_chunks(CHUNK)
        .map(|chunk| {
            let mut crc = Crc::new();
            crc.update(chunk);
            crc
        })
        .reduce(Crc::new, |mut a, b| {
            a.combine(&b);
            a
        })
        .sum()
}

/// The process's decoder pool, sized by rayon's pool (the rank's threads) when first used:
/// every file inflated at once (a rank's reader threads) shares that budget of decoder
/// threads instead of each taking as many. `None` for a pool of no thread.
fn shared_pool() -> Option<DecoderPool> {
    static POOL: OnceLock<Option<DecoderPool>> = OnceLock::new();
    POOL.get_or_init(|| {
        DecoderPool::builder()
            .workers(rayon::current_num_threads())
            .build()
            .ok()
    })
    .clone()
}

#[cfg(test)]
mod tests {
    use super::*;
    use flate2::write::GzEncoder;
    use flate2::Compression;
    use std::io::Write;

    /// A xorshift stream: noise that deflate cannot predict.
    fn noise(seed: u64) -> impl FnMut() -> u64 {
        let mut x = seed | 1;
        move || {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x
        }
    }

    /// A FITS image's bytes: big-endian f32 of a smooth signal plus noise in the low bits,
    /// as a preproc's IMAGE, which deflate shrinks by a third or so.
    fn fits_like(len: usize, seed: u64) -> Vec<u8> {
        let mut next = noise(seed);
        (0..len / 4)
            .flat_map(|i| {
                let smooth = 1000.0 + 40.0 * (i as f32 / 300.0).sin();
                let value = smooth + (next() % 1000) as f32 / 100.0;
                value.to_be_bytes()
            })
            .collect()
    }

    /// Bytes that deflate leaves in stored blocks (noise) between stretches it compresses
    /// well (a FITS-like image), each `stretch` bytes long.
    fn stored_and_compressible(len: usize, stretch: usize) -> Vec<u8> {
        let mut next = noise(7);
        let image = fits_like(stretch, 3);
        let mut out = Vec::with_capacity(len);
        while out.len() < len {
            out.extend((0..stretch / 8).flat_map(|_| next().to_le_bytes()));
            out.extend_from_slice(&image);
        }
        out.truncate(len);
        out
    }

    fn gzip(data: &[u8], level: u32) -> Vec<u8> {
        let mut encoder = GzEncoder::new(Vec::new(), Compression::new(level));
        encoder.write_all(data).unwrap();
        encoder.finish().unwrap()
    }

    /// The member inflated by this module's path, or `None` where it gave up.
    fn inflate(compressed: Vec<u8>, len: usize) -> Option<Vec<u8>> {
        let mut out = vec![0u8; len];
        let compressed = Arc::new(compressed);
        inflate_one_member(&compressed, &mut out, 2, Sequential::Accept).map(|n| {
            out.truncate(n);
            out
        })
    }

    #[test]
    fn a_member_inflates_to_its_bytes_at_levels_1_6_and_9() {
        let data = fits_like(6 << 20, 1);
        for level in [1, 6, 9] {
            let inflated = inflate(gzip(&data, level), data.len());
            assert!(inflated == Some(data.clone()), "level {level}");
        }
    }

    #[test]
    fn a_member_of_long_stored_blocks_inflates_to_its_bytes() {
        let data = stored_and_compressible(8 << 20, 1 << 20);
        let compressed = gzip(&data, 6);
        // The noise stays stored: the member is more than half the data.
        assert!(compressed.len() > data.len() / 2);
        assert!(inflate(compressed, data.len()) == Some(data));
    }

    #[test]
    fn a_member_larger_than_the_parallel_threshold_inflates_to_its_bytes() {
        // Compressed beyond MIN_BYTES, so the decoder may take its marker path.
        let data = stored_and_compressible(MIN_BYTES * 3 / 2, 256 << 10);
        let compressed = gzip(&data, 1);
        assert!(compressed.len() >= MIN_BYTES);
        assert!(inflate(compressed, data.len()) == Some(data));
    }

    #[test]
    fn a_damaged_or_truncated_member_or_two_members_give_up() {
        let data = fits_like(2 << 20, 2);
        let good = gzip(&data, 6);
        let mut flipped = good.clone();
        flipped[good.len() / 2] ^= 0x10;
        assert!(inflate(flipped, data.len()).is_none(), "a flipped bit");
        let truncated = good[..good.len() - 1000].to_vec();
        assert!(inflate(truncated, data.len()).is_none(), "truncated");
        let mut crc = good.clone();
        let at = crc.len() - 8;
        crc[at] ^= 1;
        assert!(inflate(crc, data.len()).is_none(), "a wrong CRC-32");
        // Two members: the last trailer's size is the second's alone.
        let second = gzip(&data[..1000], 6);
        let two = [good.as_slice(), &second].concat();
        assert!(inflate(two, 1000).is_none(), "two members");
    }

    #[test]
    fn the_crc_combined_on_the_pool_is_the_members() {
        let data = fits_like((9 << 20) + 3, 5);
        let compressed = gzip(&data, 1);
        assert!(matches_trailer(&compressed, &data));
        let mut changed = data.clone();
        changed[5 << 20] ^= 1;
        assert!(!matches_trailer(&compressed, &changed));
        assert!(!matches_trailer(&compressed, &data[1..]));
        assert!(!matches_trailer(&compressed[..7], &data));
    }

    #[test]
    fn the_parallel_path_is_taken_only_where_it_pays() {
        assert!(pays(MIN_BYTES, MIN_THREADS, 0));
        assert!(!pays(MIN_BYTES - 1, 64, 0));
        assert!(!pays(1 << 30, MIN_THREADS - 1, 0));
        assert!(!pays(1 << 30, 64, 1), "another file inflating");
    }

    #[test]
    fn files_inflating_are_counted_while_they_inflate() {
        let (first, _) = Inflating::start();
        let (second, others) = Inflating::start();
        assert!(others >= 1, "the first is counted");
        drop((first, second));
    }
}
