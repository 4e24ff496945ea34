//! Gzip compression of a written FITS file, on the rank's cores.
//!
//! desi_proc names its frames `.fits.gz`. cfitsio would compress such a file on one thread
//! when it closes it, which takes longer than extracting the frame on a GPU; instead the
//! plain file, built in memory (see `written`), is compressed here by independent chunks on
//! rayon's pool (the rank's cores), pigz's scheme: each chunk is deflated on its own, every
//! chunk but the last ended by a sync flush (an empty stored block, so that the next chunk
//! starts on a byte boundary), and the chunks are joined into one gzip member whose CRC-32
//! is combined from theirs. One member, not one per chunk: cfitsio reads only the first
//! member of a file, while astropy and fitsio read this one as any other.
//!
//! The chunks are deflated by `deflate`, literals and runs under each block's own Huffman
//! codes: on a frame it takes under a fifth of the CPU time of miniz_oxide's fastest level
//! (flate2's default backend, used before), for a file 4% larger (docs/benchmarks.md,
//! "desi_proc's form: the frame's deflate").

use std::io::Write;
use std::path::Path;

use flate2::Crc;
use rayon::prelude::*;

use super::deflate::deflate_chunk;
use crate::error::{Error, Result};

/// Plain bytes deflated per task: 70 tasks for a full frame, enough for a node's cores; a
/// chunk deflated without its predecessor's window loses almost nothing at this size.
const CHUNK: usize = 1 << 20;

/// gzip's header: magic, deflate, no flags, no time, fastest compression (XFL 4), Unix.
const HEADER: [u8; 10] = [0x1f, 0x8b, 8, 0, 0, 0, 0, 0, 4, 3];

/// Writes `plain`, the bytes of the file `path`, gzip-compressed into `file` (just created
/// at `path`).
pub(super) fn write_compressed(path: &Path, plain: &[u8], file: std::fs::File) -> Result<()> {
    let io = |source: std::io::Error| Error::Io {
        path: path.into(),
        source,
    };
    let t0 = std::time::Instant::now();
    let written = write_gzip(plain, std::io::BufWriter::new(file)).map_err(io)?;
    // The benchmarks (scripts/bench-desi-proc) split a frame's write with this line.
    tracing::debug!(
        "{}: deflated {:.1} MB to {:.1} MB in {:.3} s ({} threads)",
        path.display(),
        plain.len() as f64 / 1e6,
        written as f64 / 1e6,
        t0.elapsed().as_secs_f64(),
        rayon::current_num_threads(),
    );
    Ok(())
}

/// Replaces the plain file at `path` by its gzip compression.
#[cfg(test)]
pub(super) fn compress_in_place(path: &Path) -> Result<()> {
    let plain = std::fs::read(path).expect("a file to compress");
    let file = std::fs::File::create(path).expect("the file replaced");
    write_compressed(path, &plain, file)
}

/// A chunk deflated, with its place in the file and the CRC-32 of its plain bytes.
type Deflated = (usize, Vec<u8>, Crc);

/// Writes `plain` to `out` as one gzip member; returns the bytes written. The chunks are
/// deflated on rayon's pool and written in order by a thread of its own as they come, so
/// that writing the file overlaps deflating it.
fn write_gzip<W: Write + Send>(plain: &[u8], out: W) -> std::io::Result<usize> {
    let n = plain.len().div_ceil(CHUNK).max(1);
    let (sender, receiver) = std::sync::mpsc::channel::<Deflated>();
    std::thread::scope(|s| {
        let writer = s.spawn(move || write_in_order(receiver, n, out));
        (0..n).into_par_iter().for_each_with(sender, |sender, k| {
            let chunk = &plain[k * CHUNK..((k + 1) * CHUNK).min(plain.len())];
            let mut crc = Crc::new();
            crc.update(chunk);
            let deflated = deflate_chunk(chunk, k + 1 == n);
            // A writer gone has failed: its error is the one reported.
            let _ = sender.send((k, deflated, crc));
        });
        writer
            .join()
            .unwrap_or_else(|p| std::panic::resume_unwind(p))
    })
}

/// The writer's side of [`write_gzip`]: header, the `n` chunks in order (those that come
/// early wait), trailer. Without all `n` (a deflate panicked) it stops without a trailer.
fn write_in_order(
    chunks: std::sync::mpsc::Receiver<Deflated>,
    n: usize,
    mut out: impl Write,
) -> std::io::Result<usize> {
    out.write_all(&HEADER)?;
    let mut written = HEADER.len();
    let mut crc = Crc::new();
    let mut early = std::collections::BTreeMap::new();
    let mut next = 0;
    for (k, deflated, part) in chunks {
        early.insert(k, (deflated, part));
        while let Some((deflated, part)) = early.remove(&next) {
            out.write_all(&deflated)?;
            written += deflated.len();
            crc.combine(&part);
            next += 1;
        }
    }
    if next == n {
        out.write_all(&crc.sum().to_le_bytes())?;
        out.write_all(&crc.amount().to_le_bytes())?;
        out.flush()?;
        written += 8;
    }
    Ok(written)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Read;

    /// Bytes that deflate neither trivially nor not at all: a noisy ramp over 16 values.
    fn sample(len: usize) -> Vec<u8> {
        let mut state = 12345u32;
        (0..len)
            .map(|i| {
                state = state.wrapping_mul(1_103_515_245).wrapping_add(12345);
                (i / 7 % 16) as u8 ^ ((state >> 28) as u8)
            })
            .collect()
    }

    fn gzip_of(plain: &[u8]) -> Vec<u8> {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("x.fits.gz");
        std::fs::write(&path, plain).unwrap();
        compress_in_place(&path).unwrap();
        std::fs::read(&path).unwrap()
    }

    #[test]
    fn chunks_join_into_one_member_that_inflates_to_the_plain_bytes() {
        // empty, under a chunk, a chunk exactly, and several chunks with a partial last one
        for len in [0, 1000, CHUNK, 3 * CHUNK + 12345] {
            let plain = sample(len);
            let gz = gzip_of(&plain);
            // one member: a single-member decoder reads it all and nothing is left after it
            let mut decoder = flate2::read::GzDecoder::new(&gz[..]);
            let mut inflated = Vec::new();
            decoder.read_to_end(&mut inflated).unwrap();
            assert_eq!(inflated, plain, "{len} bytes");
            let trailer = &gz[gz.len() - 4..];
            assert_eq!(u32::from_le_bytes(trailer.try_into().unwrap()), len as u32);
            // and it does compress
            assert!(
                len < CHUNK || gz.len() < plain.len(),
                "{len}: {} bytes",
                gz.len()
            );
        }
    }

    #[test]
    fn a_sync_flush_ends_every_chunk_but_the_last_and_the_crc_is_the_whole_files() {
        let plain = sample(2 * CHUNK + 1);
        let first = deflate_chunk(&plain[..CHUNK], false);
        assert_eq!(first[first.len() - 4..], [0, 0, 0xff, 0xff]);
        let mut gz = Vec::new();
        let written = write_gzip(&plain, &mut gz).expect("write_gzip");
        assert_eq!(written, gz.len());
        assert_eq!(gz[HEADER.len()..HEADER.len() + first.len()], first);
        let mut whole = Crc::new();
        whole.update(&plain);
        assert_eq!(gz[gz.len() - 8..gz.len() - 4], whole.sum().to_le_bytes());
    }

    #[test]
    fn a_failing_writer_is_the_error() {
        struct Full;
        impl Write for Full {
            fn write(&mut self, _: &[u8]) -> std::io::Result<usize> {
                Err(std::io::Error::other("disk full"))
            }
            fn flush(&mut self) -> std::io::Result<()> {
                Ok(())
            }
        }
        match write_gzip(&sample(3 * CHUNK), Full) {
            Err(e) => assert_eq!(e.to_string(), "disk full"),
            Ok(_) => panic!("the writer's error is lost"),
        }
    }
}
