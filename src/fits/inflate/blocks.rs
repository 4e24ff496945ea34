//! Where deflate blocks start: the header of a dynamic Huffman block parsed at any bit, with
//! zlib's own checks (complete codes, an end-of-block code), which few bits in the middle of a
//! block pass.

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
        let byte = (self.pos / 8) as usize;
        let mut word = [0u8; 8];
        let have = (self.data.len() - byte).min(8);
        word[..have].copy_from_slice(&self.data[byte..byte + have]);
        let value = (u64::from_le_bytes(word) >> (self.pos % 8)) as u32 & ((1u32 << n) - 1);
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
