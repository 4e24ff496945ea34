use super::*;
use std::io::Read;

/// Inflates a raw deflate stream with miniz_oxide (flate2).
fn miniz(deflated: &[u8]) -> Vec<u8> {
    let mut out = Vec::new();
    flate2::read::DeflateDecoder::new(deflated)
        .read_to_end(&mut out)
        .expect("miniz_oxide inflates it");
    out
}

/// Inflates a raw deflate stream with libdeflate, which checks that codes are complete.
fn libdeflate(deflated: &[u8], len: usize) -> Vec<u8> {
    use libdeflate_sys::*;
    let mut out = vec![0u8; len];
    let mut made = 0usize;
    // SAFETY: the buffers are valid for the lengths given; the decompressor is freed below.
    let status = unsafe {
        let d = libdeflate_alloc_decompressor();
        assert!(!d.is_null());
        let status = libdeflate_deflate_decompress(
            d,
            deflated.as_ptr().cast(),
            deflated.len(),
            out.as_mut_ptr().cast(),
            len,
            &mut made,
        );
        libdeflate_free_decompressor(d);
        status
    };
    assert_eq!(status, libdeflate_result_LIBDEFLATE_SUCCESS);
    out.truncate(made);
    out
}

fn round_trip(plain: &[u8]) -> usize {
    let deflated = deflate_chunk(plain, true);
    assert_eq!(
        miniz(&deflated),
        plain,
        "miniz_oxide, {} bytes",
        plain.len()
    );
    assert_eq!(libdeflate(&deflated, plain.len()), plain, "libdeflate");
    deflated.len()
}

/// A generator of noise for the samples.
struct Noise(u64);

impl Noise {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }
}

/// Big-endian float32 values around 100 with noise, as a frame's flux: the exponent and high
/// mantissa bytes repeat, the low ones are noise.
fn floats(n: usize, noise: &mut Noise) -> Vec<u8> {
    (0..n)
        .flat_map(|_| {
            let x = 100.0f32 + (noise.next() % 10_000) as f32 / 1000.0;
            x.to_be_bytes()
        })
        .collect()
}

#[test]
fn floats_shrink_and_inflate_to_themselves() {
    let mut noise = Noise(7);
    let plain = floats(300_000, &mut noise);
    let size = round_trip(&plain);
    assert!(size < plain.len() * 9 / 10, "{size} of {}", plain.len());
}

#[test]
fn runs_of_every_length_become_copies() {
    let mut noise = Noise(11);
    let mut plain = Vec::new();
    // runs of 1..=600 bytes (longer than one copy), separated by noise
    for run in 1..=600usize {
        plain.extend(std::iter::repeat_n((run % 7) as u8, run));
        plain.push((noise.next() % 256) as u8);
    }
    round_trip(&plain);
    // a megabyte of zeros costs almost nothing
    let zeros = vec![0u8; 1 << 20];
    assert!(round_trip(&zeros) < 5_000);
}

#[test]
fn noise_is_stored_and_small_inputs_survive() {
    let mut noise = Noise(3);
    let random: Vec<u8> = (0..200_000).map(|_| noise.next() as u8).collect();
    let size = round_trip(&random);
    // stored blocks: 5 bytes of framing per 65535 bytes
    assert!(size <= random.len() + 5 * 8, "{size}");
    for plain in [
        vec![],
        vec![42],
        vec![1, 1],
        vec![9, 9, 9, 9],
        b"abcabc".to_vec(),
    ] {
        round_trip(&plain);
    }
}

#[test]
fn skewed_counts_keep_codes_within_the_limit_and_complete() {
    // Fibonacci counts: an unlimited Huffman code would be 30 deep
    let mut freq = vec![0u32; 286];
    let (mut a, mut b) = (1u32, 1u32);
    for f in freq.iter_mut().take(30) {
        *f = a;
        (a, b) = (b, a + b);
    }
    for limit in [MAX_CL_BITS, MAX_BITS] {
        let lengths = huffman_lengths(&freq, limit);
        assert!(lengths.iter().all(|&l| usize::from(l) <= limit));
        let kraft: f64 = lengths
            .iter()
            .filter(|&&l| l > 0)
            .map(|&l| 0.5f64.powi(i32::from(l)))
            .sum();
        assert_eq!(kraft, 1.0, "limit {limit}");
        // the most frequent symbol has the shortest code
        assert_eq!(
            lengths[29],
            *lengths.iter().filter(|&&l| l > 0).min().unwrap()
        );
    }
    // bytes with those counts inflate back
    let plain: Vec<u8> = (0..20u8)
        .flat_map(|s| std::iter::repeat_n(s * 2 + 1, freq[usize::from(s)] as usize))
        .collect();
    round_trip(&plain);
    // one symbol alone still gets a complete code of two
    let lengths = huffman_lengths(&[0, 5, 0], 7);
    assert_eq!(lengths.iter().filter(|&&l| l == 1).count(), 2);
}

#[test]
fn chunks_end_on_a_sync_flush_and_join_into_one_stream() {
    let mut noise = Noise(5);
    let mut plain = floats(100_000, &mut noise);
    plain.extend(vec![0u8; 70_000]);
    let (a, b) = plain.split_at(250_001);
    let first = deflate_chunk(a, false);
    assert_eq!(first[first.len() - 4..], [0, 0, 0xff, 0xff]);
    let joined = [first, deflate_chunk(b, true)].concat();
    assert_eq!(miniz(&joined), plain);
    assert_eq!(libdeflate(&joined, plain.len()), plain);
}

/// The longest literal code of `plain` as one block.
fn longest_literal_code(plain: &[u8]) -> u8 {
    let freq = counts(plain, &mut Vec::new());
    let lit = Code::new(&freq, MAX_BITS);
    lit.lengths[..END].iter().copied().max().unwrap_or(0)
}

#[test]
fn literals_go_four_to_a_store_unless_a_code_takes_fifteen_bits() {
    // a frame's floats: codes of at most 14 bits, four literals to a store
    let mut noise = Noise(13);
    let floats = floats(BLOCK / 4, &mut noise);
    assert!(longest_literal_code(&floats) <= 14);
    round_trip(&floats);
    // bytes 100 + k 2^k times (k = 4..15), shuffled, and bytes 0..8 twice each, side by side:
    // those get 15-bit codes, three literals to a store
    let mut plain: Vec<u8> = (4..16u8)
        .flat_map(|k| std::iter::repeat_n(100 + k, 1 << k))
        .collect();
    for i in (1..plain.len()).rev() {
        plain.swap(i, (noise.next() % (i as u64 + 1)) as usize);
    }
    plain.splice(30_001..30_001, (0..16).map(|i| i % 8));
    assert!(plain.len() <= BLOCK);
    assert_eq!(longest_literal_code(&plain), 15);
    round_trip(&plain);
}
