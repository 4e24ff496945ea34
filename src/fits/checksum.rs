//! DATASUM and CHECKSUM of every HDU of a written file, as cfitsio's `fits_write_chksum`
//! writes them, but with the data sums computed in parallel from the file's bytes in memory
//! (see `written`): cfitsio reads each data unit back through its 2880-byte buffers, which
//! takes half the time of writing a frame.
//!
//! Both keywords follow the FITS checksum convention: the 32-bit ones' complement sum of the
//! big-endian words of the data unit (DATASUM, in decimal), and CHECKSUM, the ASCII encoding
//! (cfitsio's `ffesum`) of the complement of the whole HDU's sum, which makes that sum -0.
//! DATASUM has a plain comment, so that a frame gives the same bytes whatever the run
//! that wrote it (cfitsio stamps the time into the comments it writes).

use std::borrow::Cow;
use std::ffi::c_char;
use std::ops::Range;
use std::os::unix::fs::FileExt;

use fitsio::sys;
use rayon::prelude::*;

use super::Fits;
use crate::error::{Error, Result};

/// Bytes summed per task.
const CHUNK: usize = 1 << 20;

/// The ones' complement sum of two 32-bit sums.
fn add(a: u32, b: u32) -> u32 {
    let s = a as u64 + b as u64;
    ((s & 0xffff_ffff) + (s >> 32)) as u32
}

/// The ones' complement sum of `bytes` as big-endian 32-bit words, a last partial word padded
/// with zeros (the fill of a FITS data unit).
fn sum_words(bytes: &[u8]) -> u32 {
    let mut wide = 0u64;
    let mut words = bytes.chunks_exact(4);
    for w in &mut words {
        wide += u32::from_be_bytes([w[0], w[1], w[2], w[3]]) as u64;
    }
    let rest = words.remainder();
    if !rest.is_empty() {
        let mut last = [0u8; 4];
        last[..rest.len()].copy_from_slice(rest);
        wide += u32::from_be_bytes(last) as u64;
    }
    // fold the carries back in (at most 2^30 words per chunk: no overflow)
    while wide >> 32 != 0 {
        wide = (wide & 0xffff_ffff) + (wide >> 32);
    }
    wide as u32
}

/// [`sum_words`] of `bytes`, summed a chunk at a time on many cores. Chunks are whole words,
/// so their sums add up to the whole's.
fn sum_bytes(bytes: &[u8]) -> u32 {
    bytes.par_chunks(CHUNK).map(sum_words).reduce(|| 0, add)
}

impl Fits {
    /// Byte offsets of the current HDU: header start, data start, data end.
    pub(crate) fn hdu_addresses(&mut self) -> Result<(usize, usize, usize)> {
        let (mut head, mut data, mut end) = (0, 0, 0);
        // SAFETY: a valid handle on an existing HDU; three out-parameters.
        self.call("cannot locate the HDU", |ptr, status| unsafe {
            sys::ffghadll(ptr, &mut head, &mut data, &mut end, status);
        })?;
        Ok((head as usize, data as usize, end as usize))
    }

    /// CHECKSUM and DATASUM in the current HDU, to be filled in by
    /// [`Fits::write_checksums`].
    pub(super) fn write_checksum_places(&mut self) -> Result<()> {
        self.write_key_str("CHECKSUM", "0000000000000000", "HDU checksum")?;
        self.write_key_str("DATASUM", "0", "data unit checksum")
    }

    /// Writes cfitsio's buffers to the file.
    fn flush(&mut self) -> Result<()> {
        // SAFETY: a valid handle of a writable file.
        self.call("cannot flush", |ptr, status| unsafe {
            sys::ffflus(ptr, status);
        })
    }

    /// The bytes `range` of the file: from memory for a file built there, else read from
    /// the file on disk (after a flush).
    fn file_bytes(&self, range: Range<usize>) -> Result<Cow<'_, [u8]>> {
        let short = || {
            self.error(
                "cannot compute DATASUM",
                "the file is shorter than its HDUs",
            )
        };
        if self.written.is_some() {
            return self.block().get(range).map(Cow::Borrowed).ok_or_else(short);
        }
        let file = std::fs::File::open(&self.path).map_err(|e| self.io_error(e))?;
        let mut bytes = vec![0u8; range.len()];
        file.read_exact_at(&mut bytes, range.start as u64)
            .map_err(|e| match e.kind() {
                std::io::ErrorKind::UnexpectedEof => short(),
                _ => self.io_error(e),
            })?;
        Ok(Cow::Owned(bytes))
    }

    /// Computes and writes DATASUM and CHECKSUM in every HDU of the file, replacing stale
    /// values such as those of a copied table. Call it last: any later change to an HDU
    /// invalidates its CHECKSUM.
    pub fn write_checksums(&mut self) -> Result<()> {
        let count = self.hdu_count()?;
        // The final layout of every header first (the keywords' values keep their length);
        // where the places are reserved this moves nothing.
        for index in 0..count {
            self.move_to_index(index)?;
            self.write_checksum_places()?;
        }
        self.flush()?;
        let mut units = Vec::with_capacity(count);
        for index in 0..count {
            self.move_to_index(index)?;
            let (_, data, end) = self.hdu_addresses()?;
            units.push(data..end);
        }
        let datasums = units
            .into_iter()
            .map(|unit| Ok(sum_bytes(&self.file_bytes(unit)?)))
            .collect::<Result<Vec<u32>>>()?;
        for (index, datasum) in datasums.into_iter().enumerate() {
            self.move_to_index(index)?;
            self.write_key_str("DATASUM", &datasum.to_string(), "data unit checksum")?;
            self.flush()?;
            let (head, data, _) = self.hdu_addresses()?;
            let total = add(sum_words(&self.file_bytes(head..data)?), datasum);
            let mut ascii = [0 as c_char; 17];
            // SAFETY: cfitsio writes 16 characters and a NUL into `ascii`.
            unsafe { sys::ffesum(total as _, 1, ascii.as_mut_ptr()) };
            let encoded: String = ascii[..16].iter().map(|&c| c as u8 as char).collect();
            self.write_key_str("CHECKSUM", &encoded, "HDU checksum")?;
        }
        Ok(())
    }

    fn io_error(&self, source: std::io::Error) -> Error {
        Error::Io {
            path: self.path.clone(),
            source,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ones_complement_sums_wrap_their_carries() {
        assert_eq!(add(0xffff_ffff, 1), 1);
        assert_eq!(add(0x8000_0000, 0x8000_0000), 1);
        assert_eq!(sum_words(&[0xff; 8]), 0xffff_ffff);
        // a partial last word is padded with zeros
        assert_eq!(sum_words(&[0, 0, 0, 1, 2]), 0x0200_0001);
    }

    #[test]
    fn sums_by_chunks_are_the_sums_of_the_bytes() {
        let bytes: Vec<u8> = (0..3 * CHUNK + 7).map(|i| (i * 7919 % 251) as u8).collect();
        for range in [0..bytes.len(), 2880..2 * CHUNK + 5760, 8..8, 12..20] {
            let part = &bytes[range.clone()];
            assert_eq!(sum_bytes(part), sum_words(part), "bytes {range:?}");
        }
    }
}
