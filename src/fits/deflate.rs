//! Deflate for a frame's bytes: literals and runs of one byte, under Huffman codes built for
//! each block.
//!
//! A frame is mostly float32 arrays (flux, ivar, chi2pix, the resolution's diagonals) whose
//! low bytes are noise: a general deflater spends most of its time looking for repeated
//! strings that are not there, and then codes bytes one by one anyway (miniz_oxide at level
//! 1: 0.5 s of CPU for a full frame's 70 MB). Here the search is left out. A block of
//! [`BLOCK`] bytes becomes literals and runs of one byte (copies at distance 1, for the
//! masks' zeros and the padding: zlib's `Z_RLE` strategy), coded with a Huffman code made
//! from the block's own counts; a block that would not shrink is stored. The frame comes out
//! about as small as at miniz_oxide's level 1, in a fraction of its time (see `gzip`).
//!
//! Only the encoder is here: any inflater reads its output, and the tests check it with two.

/// Bytes per block: large enough that a block's code tables (about 200 bytes) cost little,
/// small enough to follow the frame from one array to the next.
const BLOCK: usize = 128 << 10;

/// The longest run deflate codes as one copy.
const MAX_RUN: usize = 258;

/// Runs shorter than deflate's shortest copy stay literals.
const MIN_RUN: usize = 3;

/// The end-of-block symbol, and the first of the length symbols after it.
const END: usize = 256;

/// Longest code of the literal/length and distance alphabets, and of the code-length code.
const MAX_BITS: usize = 15;
const MAX_CL_BITS: usize = 7;

/// The order in which a block header gives the code-length code's lengths.
const CL_ORDER: [usize; 19] = [
    16, 17, 18, 0, 8, 7, 9, 6, 10, 5, 11, 4, 12, 3, 13, 2, 14, 1, 15,
];

/// Length symbols 257..=285: the shortest length of each and its count of extra bits.
const LENGTH_BASE: [u16; 29] = [
    3, 4, 5, 6, 7, 8, 9, 10, 11, 13, 15, 17, 19, 23, 27, 31, 35, 43, 51, 59, 67, 83, 99, 115, 131,
    163, 195, 227, 258,
];
const LENGTH_EXTRA: [u8; 29] = [
    0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2, 3, 3, 3, 3, 4, 4, 4, 4, 5, 5, 5, 5, 0,
];

/// Index into [`LENGTH_BASE`] of each copy length up to [`MAX_RUN`].
const LENGTH_CODE: [u8; MAX_RUN + 1] = {
    let mut table = [0u8; MAX_RUN + 1];
    let mut code = 0;
    let mut len = MIN_RUN;
    while len <= MAX_RUN {
        while code + 1 < LENGTH_BASE.len() && LENGTH_BASE[code + 1] as usize <= len {
            code += 1;
        }
        table[len] = code as u8;
        len += 1;
    }
    table
};

/// Deflates `chunk` on its own (no window before it): ended by a sync flush (an empty stored
/// block, so that the next chunk starts on a byte boundary), or by the final block if `last`.
pub(super) fn deflate_chunk(chunk: &[u8], last: bool) -> Vec<u8> {
    let mut bits = Bits::with_capacity(chunk.len());
    let blocks = chunk.len().div_ceil(BLOCK);
    let mut runs = Vec::new();
    for (k, block) in chunk.chunks(BLOCK).enumerate() {
        write_block(&mut bits, block, last && k + 1 == blocks, &mut runs);
    }
    if !last || blocks == 0 {
        // an empty stored block: the sync flush's marker, or the whole of an empty stream
        bits.put(u64::from(last), 1);
        bits.put(0, 2);
        bits.align();
        bits.bytes(&[0, 0, 0xff, 0xff]);
    }
    bits.finish()
}

/// Finds `block`'s runs: a byte followed by at least [`MIN_RUN`] copies of itself is the
/// byte, then copies of the byte before. Most of a frame's bytes differ from the next one, and
/// are passed eight at a time.
fn find_runs(block: &[u8], runs: &mut Vec<Run>) {
    runs.clear();
    let n = block.len();
    let mut i = 0;
    while i < n {
        while i + 9 <= n && !any_equal_to_next(&block[i..i + 9]) {
            i += 8;
        }
        if i == n {
            break;
        }
        let b = block[i];
        i += 1;
        loop {
            let same = block[i..]
                .iter()
                .take(MAX_RUN)
                .take_while(|&&x| x == b)
                .count();
            if same < MIN_RUN {
                break;
            }
            runs.push(Run {
                at: i as u32,
                len: same as u16,
            });
            i += same;
        }
    }
}

/// Whether one of the first 8 of these 9 bytes equals the byte after it.
#[inline(always)]
fn any_equal_to_next(bytes: &[u8]) -> bool {
    let word = |k: usize| u64::from_le_bytes(bytes[k..k + 8].try_into().expect("8 bytes"));
    let x = word(0) ^ word(1);
    const ONES: u64 = 0x0101_0101_0101_0101;
    x.wrapping_sub(ONES) & !x & (ONES << 7) != 0
}

/// A run that [`find_runs`] lists: `len` copies of the byte before, from byte `at` of the block.
#[derive(Clone, Copy)]
struct Run {
    at: u32,
    len: u16,
}

/// Symbol counts of a block, with its end-of-block symbol; its runs go to `runs`, so that
/// coding the block walks only its literals between them. Every byte is counted, then the
/// runs' copies taken off.
fn counts(block: &[u8], runs: &mut Vec<Run>) -> [u32; 286] {
    find_runs(block, runs);
    let mut freq = [0u32; 286];
    freq[..END].copy_from_slice(&histogram(block));
    for run in runs.iter() {
        let at = run.at as usize;
        freq[usize::from(block[at - 1])] -= u32::from(run.len);
        freq[END + 1 + usize::from(LENGTH_CODE[usize::from(run.len)])] += 1;
    }
    freq[END] += 1;
    freq
}

/// How often each byte value occurs in `bytes`, a table for each byte of a word, so that a
/// byte repeated every four (a float's exponent) does not wait for its own count.
fn histogram(bytes: &[u8]) -> [u32; 256] {
    let mut tables = [[0u32; 256]; 8];
    let mut words = bytes.chunks_exact(8);
    for word in words.by_ref() {
        let w = u64::from_le_bytes(word.try_into().expect("8 bytes"));
        for (k, table) in tables.iter_mut().enumerate() {
            table[((w >> (8 * k)) & 0xff) as usize] += 1;
        }
    }
    for &b in words.remainder() {
        tables[0][usize::from(b)] += 1;
    }
    let mut sum = [0u32; 256];
    for (b, s) in sum.iter_mut().enumerate() {
        *s = tables.iter().map(|t| t[b]).sum();
    }
    sum
}

/// Writes one block: coded with its own Huffman codes, or stored where that is smaller.
fn write_block(bits: &mut Bits, block: &[u8], last: bool, runs: &mut Vec<Run>) {
    let freq = counts(block, runs);
    let lit = Code::new(&freq, MAX_BITS);
    // One distance, 1 (code 0); a second code of one bit makes the code complete, as strict
    // inflaters want.
    let dist = Code::from_lengths(&[1, 1]);
    let header = Header::new(&lit.lengths, &dist.lengths);
    let data_bits: u64 = freq
        .iter()
        .enumerate()
        .map(|(s, &f)| u64::from(f) * (u64::from(lit.lengths[s]) + extra_bits(s)))
        .sum::<u64>()
        + freq[END + 1..].iter().map(|&f| u64::from(f)).sum::<u64>();
    let stored_bits = 8 * block.len() as u64 + 40 * block.len().div_ceil(0xffff) as u64;
    if 3 + header.bits() + data_bits >= stored_bits {
        write_stored(bits, block, last);
        return;
    }
    bits.put(u64::from(last), 1);
    bits.put(2, 2);
    header.write(bits);
    let (literals, run_bits) = token_bits(&lit, &dist);
    // Four codes of at most 14 bits fit beside the 7 bits that may be pending; 15 bits only
    // three.
    if lit.lengths[..END].iter().all(|&l| l <= 14) {
        bits.put_block::<4>(block, &literals, &run_bits, runs);
    } else {
        bits.put_block::<3>(block, &literals, &run_bits, runs);
    }
    bits.put(lit.codes[END], lit.lengths[END]);
}

/// A block's literals' and runs' bits under its codes, ready for [`Bits::put_block`]: the
/// bits in the low 32, their count above. A run is its length's code, the length's extra
/// bits and the code of distance 1.
fn token_bits(lit: &Code, dist: &Code) -> ([u64; 256], [u64; MAX_RUN + 1]) {
    let mut literals = [0u64; 256];
    for (b, entry) in literals.iter_mut().enumerate() {
        *entry = lit.codes[b] | u64::from(lit.lengths[b]) << 32;
    }
    let mut runs = [0u64; MAX_RUN + 1];
    for (same, entry) in runs.iter_mut().enumerate().skip(MIN_RUN) {
        let code = usize::from(LENGTH_CODE[same]);
        let sym = END + 1 + code;
        let (n_code, n_extra) = (u64::from(lit.lengths[sym]), u64::from(LENGTH_EXTRA[code]));
        let extra = (same - usize::from(LENGTH_BASE[code])) as u64;
        let bits = lit.codes[sym] | extra << n_code | dist.codes[0] << (n_code + n_extra);
        *entry = bits | (n_code + n_extra + u64::from(dist.lengths[0])) << 32;
    }
    (literals, runs)
}

/// Extra bits of literal/length symbol `s`.
fn extra_bits(s: usize) -> u64 {
    if s > END {
        u64::from(LENGTH_EXTRA[s - END - 1])
    } else {
        0
    }
}

/// `block` as stored blocks of at most 65535 bytes.
fn write_stored(bits: &mut Bits, block: &[u8], last: bool) {
    let pieces = block.len().div_ceil(0xffff);
    for (k, piece) in block.chunks(0xffff).enumerate() {
        bits.put(u64::from(last && k + 1 == pieces), 1);
        bits.put(0, 2);
        bits.align();
        let len = piece.len() as u16;
        bits.bytes(&len.to_le_bytes());
        bits.bytes(&(!len).to_le_bytes());
        bits.bytes(piece);
    }
}

/// A dynamic block's header: its two codes' lengths, run-length coded under the code-length
/// code.
struct Header {
    nlit: usize,
    ndist: usize,
    /// The code-length symbols with their extra bits (count, value).
    symbols: Vec<(u8, u8, u8)>,
    cl: Code,
    ncl: usize,
}

impl Header {
    fn new(lit: &[u8], dist: &[u8]) -> Self {
        let nlit = lit
            .iter()
            .rposition(|&l| l > 0)
            .map_or(0, |p| p + 1)
            .max(257);
        let ndist = dist
            .iter()
            .rposition(|&l| l > 0)
            .map_or(0, |p| p + 1)
            .max(1);
        let lengths: Vec<u8> = lit[..nlit].iter().chain(&dist[..ndist]).copied().collect();
        let symbols = run_length(&lengths);
        let mut freq = [0u32; 19];
        for &(s, _, _) in &symbols {
            freq[usize::from(s)] += 1;
        }
        let cl = Code::new(&freq, MAX_CL_BITS);
        let ncl = CL_ORDER
            .iter()
            .rposition(|&s| cl.lengths[s] > 0)
            .map_or(0, |p| p + 1)
            .max(4);
        Header {
            nlit,
            ndist,
            symbols,
            cl,
            ncl,
        }
    }

    fn bits(&self) -> u64 {
        let coded: u64 = self
            .symbols
            .iter()
            .map(|&(s, n, _)| u64::from(self.cl.lengths[usize::from(s)]) + u64::from(n))
            .sum();
        14 + 3 * self.ncl as u64 + coded
    }

    fn write(&self, bits: &mut Bits) {
        bits.put((self.nlit - 257) as u64, 5);
        bits.put((self.ndist - 1) as u64, 5);
        bits.put((self.ncl - 4) as u64, 4);
        for &s in &CL_ORDER[..self.ncl] {
            bits.put(u64::from(self.cl.lengths[s]), 3);
        }
        for &(s, n, v) in &self.symbols {
            let s = usize::from(s);
            bits.put(self.cl.codes[s], self.cl.lengths[s]);
            bits.put(u64::from(v), n);
        }
    }
}

/// Code lengths as deflate's code-length symbols: 0-15 a length, 16 the last one repeated
/// 3-6 times, 17 and 18 runs of 3-10 and 11-138 zeros.
fn run_length(lengths: &[u8]) -> Vec<(u8, u8, u8)> {
    let mut out = Vec::new();
    let mut i = 0;
    while i < lengths.len() {
        let l = lengths[i];
        let same = lengths[i..].iter().take_while(|&&x| x == l).count();
        i += same;
        let mut left = same;
        if l == 0 {
            while left >= 11 {
                let n = left.min(138);
                out.push((18, 7, (n - 11) as u8));
                left -= n;
            }
            if left >= 3 {
                out.push((17, 3, (left - 3) as u8));
                left = 0;
            }
        } else {
            out.push((l, 0, 0));
            left -= 1;
            while left >= 3 {
                let n = left.min(6);
                out.push((16, 2, (n - 3) as u8));
                left -= n;
            }
        }
        out.extend(std::iter::repeat_n((l, 0, 0), left));
    }
    out
}

/// A canonical Huffman code: each symbol's length and its code, bit-reversed for deflate's
/// least-significant-bit-first stream.
struct Code {
    lengths: Vec<u8>,
    codes: Vec<u64>,
}

impl Code {
    /// The code of a symbol count, no code longer than `limit` bits.
    fn new(freq: &[u32], limit: usize) -> Self {
        Code::from_lengths(&huffman_lengths(freq, limit))
    }

    fn from_lengths(lengths: &[u8]) -> Self {
        let mut per_length = [0u32; MAX_BITS + 1];
        for &l in lengths.iter().filter(|&&l| l > 0) {
            per_length[usize::from(l)] += 1;
        }
        let mut next = [0u32; MAX_BITS + 1];
        for l in 1..=MAX_BITS {
            next[l] = (next[l - 1] + per_length[l - 1]) << 1;
        }
        let codes = lengths
            .iter()
            .map(|&l| {
                if l == 0 {
                    return 0;
                }
                let code = next[usize::from(l)];
                next[usize::from(l)] += 1;
                u64::from(code.reverse_bits() >> (32 - u32::from(l)))
            })
            .collect();
        Code {
            lengths: lengths.to_vec(),
            codes,
        }
    }
}

/// Huffman code lengths of `freq`, none longer than `limit`: the optimal tree, its deeper
/// leaves then moved up as miniz and zlib do (a leaf at the limit goes, a shallower one
/// splits in two) until the lengths form a complete code again. At least two symbols get a
/// length, so that the code is complete.
fn huffman_lengths(freq: &[u32], limit: usize) -> Vec<u8> {
    let mut used: Vec<usize> = (0..freq.len()).filter(|&s| freq[s] > 0).collect();
    for s in 0..freq.len() {
        if used.len() >= 2 {
            break;
        }
        if freq[s] == 0 {
            used.push(s);
        }
    }
    used.sort_by_key(|&s| (freq[s], s));
    let depths = leaf_depths(&used.iter().map(|&s| u64::from(freq[s])).collect::<Vec<_>>());
    let mut per_depth = vec![0u32; limit + 1];
    for &d in &depths {
        per_depth[d.min(limit)] += 1;
    }
    let units = |per_depth: &[u32]| -> u64 {
        (1..=limit)
            .map(|d| u64::from(per_depth[d]) << (limit - d))
            .sum()
    };
    let mut total = units(&per_depth);
    while total > 1 << limit {
        per_depth[limit] -= 1;
        if let Some(d) = (1..limit).rev().find(|&d| per_depth[d] > 0) {
            per_depth[d] -= 1;
            per_depth[d + 1] += 2;
        }
        total -= 1;
    }
    // The rarest symbols (first in `used`) take the longest codes.
    let mut lengths = vec![0u8; freq.len()];
    let mut next = used.iter();
    for d in (1..=limit).rev() {
        for &s in next.by_ref().take(per_depth[d] as usize) {
            lengths[s] = d as u8;
        }
    }
    lengths
}

/// Depths of the leaves of a Huffman tree over `weights` (ascending, at least two): two
/// queues, the leaves and the inner nodes, which are made in ascending weight.
fn leaf_depths(weights: &[u64]) -> Vec<usize> {
    let n = weights.len();
    let mut weight = weights.to_vec();
    let mut parent = vec![0usize; 2 * n - 1];
    let (mut leaf, mut inner) = (0, n);
    for node in n..2 * n - 1 {
        let mut pick = || {
            let take_leaf = leaf < n && (inner >= node || weight[leaf] <= weight[inner]);
            let k = if take_leaf { leaf } else { inner };
            if take_leaf {
                leaf += 1;
            } else {
                inner += 1;
            }
            k
        };
        let (a, b) = (pick(), pick());
        weight.push(weight[a] + weight[b]);
        parent[a] = node;
        parent[b] = node;
    }
    let mut depth = vec![0usize; 2 * n - 1];
    for k in (0..2 * n - 2).rev() {
        depth[k] = depth[parent[k]] + 1;
    }
    depth.truncate(n);
    depth
}

/// Deflate's bit stream: bits go in from the least significant end. `out` is sized ahead
/// (see [`Bits::with_capacity`]) so that each put stores 8 bytes without a check of room.
struct Bits {
    out: Vec<u8>,
    /// Bytes complete in `out`.
    pos: usize,
    /// Bits not yet complete, fewer than 8 between puts.
    acc: u64,
    len: u32,
}

impl Bits {
    /// A stream for the deflate of `plain` bytes: at most stored blocks' size (a dynamic
    /// block is written only where smaller), their framing (5 bytes per 65535), the flush,
    /// and a store's slack.
    fn with_capacity(plain: usize) -> Self {
        Bits {
            out: vec![0; plain + plain / 1024 + 256],
            pos: 0,
            acc: 0,
            len: 0,
        }
    }

    /// Appends the `n` bits of `value` (below `2^n`, `n` at most 32).
    #[inline(always)]
    fn put(&mut self, value: u64, n: u8) {
        self.acc |= value << self.len;
        self.len += u32::from(n);
        self.out[self.pos..self.pos + 8].copy_from_slice(&self.acc.to_le_bytes());
        let bytes = self.len / 8;
        self.pos += bytes as usize;
        self.acc >>= 8 * bytes;
        self.len %= 8;
    }

    /// Puts `block`'s literals and `runs`, their bits from [`token_bits`]: the hot loop, its
    /// state in registers. Literals go `G` at a time, `G` codes and the at most 7 bits pending
    /// fitting in the accumulator before it is stored.
    fn put_block<const G: usize>(
        &mut self,
        block: &[u8],
        literals: &[u64; 256],
        run_bits: &[u64; MAX_RUN + 1],
        runs: &[Run],
    ) {
        let (mut acc, mut len, mut pos) = (self.acc, u64::from(self.len), self.pos);
        let out = &mut self.out[..];
        let mut i = 0;
        for run in runs {
            let at = run.at as usize;
            put_literals::<G>(out, &mut pos, &mut acc, &mut len, literals, &block[i..at]);
            add(&mut acc, &mut len, run_bits[usize::from(run.len)]);
            store(out, &mut pos, &mut acc, &mut len);
            i = at + usize::from(run.len);
        }
        put_literals::<G>(out, &mut pos, &mut acc, &mut len, literals, &block[i..]);
        (self.acc, self.len, self.pos) = (acc, len as u32, pos);
    }

    /// Pads to a byte boundary with zeros.
    fn align(&mut self) {
        if self.len > 0 {
            self.put(0, (8 - self.len) as u8);
        }
    }

    /// Appends whole bytes, after [`Bits::align`].
    fn bytes(&mut self, bytes: &[u8]) {
        debug_assert_eq!(self.len, 0);
        self.out[self.pos..self.pos + bytes.len()].copy_from_slice(bytes);
        self.pos += bytes.len();
    }

    fn finish(mut self) -> Vec<u8> {
        self.align();
        self.out.truncate(self.pos);
        self.out
    }
}

/// Puts `bytes` as literals, `G` codes to a store (see [`Bits::put_block`]).
#[inline(always)]
fn put_literals<const G: usize>(
    out: &mut [u8],
    pos: &mut usize,
    acc: &mut u64,
    len: &mut u64,
    literals: &[u64; 256],
    bytes: &[u8],
) {
    let mut groups = bytes.chunks_exact(G);
    for group in groups.by_ref() {
        for &b in group {
            add(acc, len, literals[usize::from(b)]);
        }
        store(out, pos, acc, len);
    }
    for &b in groups.remainder() {
        add(acc, len, literals[usize::from(b)]);
        store(out, pos, acc, len);
    }
}

/// Adds a code from [`token_bits`] to the bits pending.
#[inline(always)]
fn add(acc: &mut u64, len: &mut u64, entry: u64) {
    *acc |= (entry & 0xffff_ffff) << *len;
    *len += entry >> 32;
}

/// Stores the pending bits' 8 bytes at `pos` and moves on by their whole bytes.
#[inline(always)]
fn store(out: &mut [u8], pos: &mut usize, acc: &mut u64, len: &mut u64) {
    out[*pos..*pos + 8].copy_from_slice(&acc.to_le_bytes());
    let bytes = *len / 8;
    *pos += bytes as usize;
    *acc >>= 8 * bytes;
    *len %= 8;
}

#[cfg(test)]
mod tests;
