//! Where deflate blocks start: the header of a dynamic Huffman block parsed at any bit, with
//! zlib's own checks (complete codes, an end-of-block code), which few bits in the middle of a
//! block pass.

use std::ops::Range;

/// Reads the bits of a byte slice as deflate orders them: from the lowest bit of each byte.
pub(super) struct Bits<'a> {
    pub data: &'a [u8],
    pub pos: u64,
    pub end: u64,
}

impl Bits<'_> {
    /// The next `n` (at most 25) bits as a number, the first one lowest.
    pub fn take(&mut self, n: u32) -> Option<u32> {
        if self.pos + u64::from(n) > self.end {
            return None;
        }
        let word = word_at(self.data, (self.pos / 8) as usize) as u64;
        let value = (word >> (self.pos % 8)) as u32 & ((1u32 << n) - 1);
        self.pos += u64::from(n);
        Some(value)
    }
}

/// A canonical Huffman code as deflate defines it, decoded a bit at a time (zlib's puff):
/// only block headers are decoded here, where clarity matters more than speed.
struct Code {
    /// Symbols of each length.
    count: [u16; 16],
    /// The symbols in code order.
    symbol: Vec<u16>,
}

impl Code {
    /// The code of these lengths; `None` unless it is complete, or when `single` is allowed,
    /// one symbol of one bit (zlib's deflate writes nothing else).
    fn new(lengths: &[u8], single: bool) -> Option<Code> {
        let mut count = [0u16; 16];
        for &len in lengths {
            count[usize::from(len)] += 1;
        }
        let mut left = 1i32;
        for &n in &count[1..] {
            left = 2 * left - i32::from(n);
            if left < 0 {
                return None;
            }
        }
        let used = lengths.len() - usize::from(count[0]);
        if used == 0 || (left != 0 && !(single && used == 1 && count[1] == 1)) {
            return None;
        }
        let mut next = [0usize; 16];
        for len in 1..15 {
            next[len + 1] = next[len] + usize::from(count[len]);
        }
        let mut symbol = vec![0u16; used];
        for (s, &len) in lengths.iter().enumerate().filter(|(_, &len)| len > 0) {
            symbol[next[usize::from(len)]] = s as u16;
            next[usize::from(len)] += 1;
        }
        count[0] = 0;
        Some(Code { count, symbol })
    }

    fn decode(&self, bits: &mut Bits) -> Option<u16> {
        let (mut code, mut first, mut index) = (0i32, 0i32, 0i32);
        for &n in &self.count[1..] {
            code |= bits.take(1)? as i32;
            let n = i32::from(n);
            if code - n < first {
                return Some(self.symbol[(index + code - first) as usize]);
            }
            index += n;
            first = (first + n) << 1;
            code <<= 1;
        }
        None
    }
}

/// The order in which a dynamic block lists the lengths of its code-length code.
const ORDER: [usize; 19] = [
    16, 17, 18, 0, 8, 7, 9, 6, 10, 5, 11, 4, 12, 3, 13, 2, 14, 1, 15,
];

/// Whether the header of a dynamic Huffman block that is not the last starts at bit `at`,
/// its three codes complete (or, for distances, of one symbol) and its end-of-block coded.
pub(super) fn block_starts_at(data: &[u8], at: u64, end: u64) -> bool {
    dynamic_header(&mut Bits { data, pos: at, end }).is_some()
}

/// The first bit of `bits` where [`block_starts_at`] holds. Each byte's bits are read once,
/// its eight positions screened by their block type at once and those of a dynamic block by
/// [`may_start`], before any is parsed: in a level-9 preproc the next block starts some
/// 130,000 bits past a chunk's nominal byte, and parsing at each of them was a tenth of the
/// CPU time of a chunked inflation.
pub(super) fn first_block_start(data: &[u8], bits: Range<u64>, end: u64) -> Option<u64> {
    let mut byte = (bits.start / 8) as usize;
    let mut skip = bits.start % 8;
    while 8 * (byte as u64) < bits.end {
        let word = word_at(data, byte);
        let low = word as u64;
        // the positions whose first three bits are 0, 0, 1: not final, dynamic
        let mut typed = (!low & !(low >> 1) & (low >> 2) & 0xff) >> skip << skip;
        while typed != 0 {
            let k = typed.trailing_zeros();
            typed &= typed - 1;
            let at = 8 * byte as u64 + u64::from(k);
            if at >= bits.end {
                return None;
            }
            if may_start(word, k) && block_starts_at(data, at, end) {
                return Some(at);
            }
        }
        byte += 1;
        skip = 0;
    }
    None
}

/// The 16 bytes of `data` from `byte` on as a number, zeros past its end.
fn word_at(data: &[u8], byte: usize) -> u128 {
    match data.get(byte..byte + 16) {
        Some(sixteen) => u128::from_le_bytes(sixteen.try_into().expect("16 bytes")),
        None => {
            let mut word = [0u8; 16];
            let tail = data.get(byte..).unwrap_or_default();
            word[..tail.len()].copy_from_slice(tail);
            u128::from_le_bytes(word)
        }
    }
}

/// The share of the code space of four code lengths (3 bits each, the first lowest), in
/// 128ths: 2^(7 - length) for each length but 0.
const SHARES: [u16; 4096] = {
    let mut table = [0u16; 4096];
    let mut x = 0;
    while x < 4096 {
        let mut i = 0;
        while i < 4 {
            let len = (x >> (3 * i)) & 7;
            if len > 0 {
                table[x] += 128 >> len;
            }
            i += 1;
        }
        x += 1;
    }
    table
};

/// Whether a dynamic block's header may start at bit `k` (below 8) of `word`: the tests of
/// [`dynamic_header`] that its first 74 bits decide. Its type, its counts of codes, and its
/// code-length code, which must be complete. A header that passes [`dynamic_header`] passes
/// these; about one position in 2400 of a preproc's compressed floats passes them too and is
/// parsed.
#[inline(always)]
fn may_start(word: u128, k: u32) -> bool {
    let head = (word as u64) >> k;
    if head & 7 != 0b100 || (head >> 3) & 31 > 29 || (head >> 8) & 31 > 29 {
        return false;
    }
    let ncode = ((head >> 13) & 15) as u32 + 4;
    let lengths = (word >> (17 + k)) as u64;
    // four lengths at a time, the last group cut to the lengths there are
    let mut kraft = 0;
    for i in (0..ncode).step_by(4) {
        let group = (lengths >> (3 * i)) & ((1 << (3 * (ncode - i).min(4))) - 1);
        kraft += u32::from(SHARES[group as usize]);
    }
    kraft == 128
}

fn dynamic_header(bits: &mut Bits) -> Option<()> {
    // BFINAL 0, then BTYPE 2, from the lowest bit
    if bits.take(3)? != 0b100 {
        return None;
    }
    let nlit = bits.take(5)? as usize + 257;
    let ndist = bits.take(5)? as usize + 1;
    let ncode = bits.take(4)? as usize + 4;
    if nlit > 286 || ndist > 30 {
        return None;
    }
    let mut lengths = [0u8; 19];
    for &k in &ORDER[..ncode] {
        lengths[k] = bits.take(3)? as u8;
    }
    let code_lengths = Code::new(&lengths, false)?;
    let mut lengths = [0u8; 286 + 30];
    let mut n = 0;
    while n < nlit + ndist {
        let (len, repeat) = match code_lengths.decode(bits)? {
            len @ 0..=15 => (len as u8, 1),
            16 if n > 0 => (lengths[n - 1], 3 + bits.take(2)?),
            17 => (0, 3 + bits.take(3)?),
            18 => (0, 11 + bits.take(7)?),
            _ => return None,
        };
        let repeat = repeat as usize;
        if n + repeat > nlit + ndist {
            return None;
        }
        lengths[n..n + repeat].fill(len);
        n += repeat;
    }
    if lengths[256] == 0 {
        return None;
    }
    Code::new(&lengths[..nlit], false)?;
    Code::new(&lengths[nlit..nlit + ndist], true)?;
    Some(())
}
