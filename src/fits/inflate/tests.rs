//! Tests of the chunked inflation: samples deflated by flate2 and by GNU gzip -9, damaged
//! members, the windows' code and the bits' shift.

use super::blocks::Bits;
use super::*;
use std::io::Write;

/// Bytes like a preproc's: noisy floats, a run of zeros, repeated text, and a long
/// stretch that deflate codes almost all as copies (a period of 4000 random bytes, one
/// byte in 61 changed), so that its blocks copy from far back through each other.
fn sample() -> Vec<u8> {
    let mut state = 7u64;
    let mut noise = |n: usize| -> Vec<u8> {
        (0..n / 4)
            .flat_map(|_| {
                state = state
                    .wrapping_mul(6364136223846793005)
                    .wrapping_add(1442695040888963407);
                (1.0f32 + (state >> 40) as f32 / 1e7).to_be_bytes()
            })
            .collect()
    };
    let mut plain = noise(600_000);
    plain.extend(std::iter::repeat_n(0u8, 700_000));
    let period = noise(4000);
    plain.extend((0..1_500_000).map(|i| period[i % 4000] ^ u8::from(i % 61 == 0)));
    plain.extend(noise(300_000));
    plain.extend(b"SIMPLE  =                    T / a header card, repeated ".repeat(9000));
    plain.extend(noise(200_001));
    plain
}

fn gzip(plain: &[u8]) -> Vec<u8> {
    let mut encoder = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::best());
    encoder.write_all(plain).unwrap();
    encoder.finish().unwrap()
}

/// Small enough to cut the sample into dozens of chunks, each longer than a window.
const CHUNK: usize = 64 << 10;

fn inflate_in(gz: &[u8], chunk_bytes: usize) -> Option<Vec<u8>> {
    inflate(gz, chunk_bytes, |len| Some(vec![0; len]))
}

/// That the stream `gz` really is cut in chunks of [`CHUNK`]: block starts were found in most.
fn assert_cut(gz: &[u8]) {
    let start = deflate_start(gz).unwrap();
    let stream = 8 * start as u64..8 * (gz.len() - 8) as u64;
    let starts = chunk_starts(gz, stream.clone(), CHUNK, stream.end);
    assert!(
        starts.len() > (gz.len() / CHUNK) / 2,
        "{} chunks",
        starts.len()
    );
}

#[test]
fn chunks_inflate_to_the_bytes_one_core_inflates() {
    let plain = sample();
    let gz = gzip(&plain);
    assert_cut(&gz);
    // chunks in the copied stretch take most bytes from their windows, others a few
    let (chunks, _) = measure_chunks(&gz, CHUNK, &Windows::new()).unwrap();
    assert!(chunks.iter().any(|c| matches!(c.sources, Sources::Many(_))));
    let few = |c: &Chunk| match &c.sources {
        Sources::Few(few) => few.len(),
        Sources::Many(_) => 0,
    };
    assert!(chunks.iter().any(|c| few(c) > 0));
    assert!(inflate_in(&gz, CHUNK).is_some_and(|out| out == plain));
    // and in a few chunks, or one (nothing to split)
    assert!(inflate_in(&gz, gz.len() / 3).is_some_and(|out| out == plain));
    assert!(inflate_in(&gz, gz.len()).is_none());
}

/// Noisy floats, then megabytes that deflate codes in far fewer than [`DENSE`] times fewer
/// bytes: a mask's zeros with a set byte here and there, then a period of 3000 random bytes
/// with one byte in 5001 changed (copies of copies from far back), then noise again.
fn dense_sample() -> Vec<u8> {
    let noise = sample();
    let mut plain = noise[..600_000].to_vec();
    let mut state = 11u64;
    let mut next = move || {
        state = state.wrapping_mul(6364136223846793005).wrapping_add(1);
        state >> 20
    };
    plain.extend((0..6_000_000).map(|_| match next() {
        r if r >> 34 == 0 => r as u8 | 1,
        _ => 0,
    }));
    let period: Vec<u8> = (0..3000).map(|_| next() as u8).collect();
    plain.extend((0..6_000_000).map(|i| period[i % 3000] ^ u8::from(i % 5001 == 0)));
    plain.extend(&noise[..300_000]);
    plain
}

#[test]
fn a_dense_chunk_is_inflated_in_pieces() {
    let plain = dense_sample();
    let gz = gzip(&plain);
    let start = deflate_start(&gz).unwrap();
    let stream = 8 * start as u64..8 * (gz.len() - 8) as u64;
    let chunk_bytes = gz.len() / 4;
    let nominal = chunk_starts(&gz, stream.clone(), chunk_bytes, stream.end).len();
    let (chunks, _) = measure_chunks(&gz, chunk_bytes, &Windows::new()).unwrap();
    // the dense chunk became pieces of a block or a few (deflate's blocks of such bytes are
    // megabytes long), the periodic ones copying most of their bytes from their windows
    let many = chunks
        .iter()
        .filter(|c| matches!(c.sources, Sources::Many(_)))
        .count();
    assert!(chunks.len() >= nominal + 3, "{} of {nominal}", chunks.len());
    assert!(many >= 2, "{many} of {} chunks", chunks.len());
    assert!(chunks.iter().all(|c| c.len < 12_000_000 / 2));
    assert!(chunks.iter().rev().skip(1).all(|c| c.len >= WINDOW));
    assert!(inflate_in(&gz, chunk_bytes).is_some_and(|out| out == plain));
}

#[test]
fn a_member_written_by_gzip_9_is_cut_and_inflated() {
    // desi_proc's preprocs come from zlib's deflate at level 9 (astropy through Python's
    // gzip module), whose blocks GNU gzip -9 writes alike.
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("sample");
    let gzip_9 = |plain: &[u8]| {
        std::fs::write(&path, plain).unwrap();
        let out = std::process::Command::new("gzip")
            .args(["-9", "-c"])
            .arg(&path)
            .output()
            .expect("gzip (a Debian essential package) runs");
        assert!(out.status.success());
        out.stdout
    };
    let plain = sample();
    let gz = gzip_9(&plain);
    assert_cut(&gz);
    assert!(inflate_in(&gz, CHUNK).is_some_and(|out| out == plain));
    let plain = dense_sample();
    let gz = gzip_9(&plain);
    assert!(inflate_in(&gz, gz.len() / 4).is_some_and(|out| out == plain));
}

#[test]
fn a_damaged_or_longer_stream_is_refused() {
    let plain = sample();
    let gz = gzip(&plain);
    let mut damaged = gz.clone();
    damaged[gz.len() / 2] ^= 0x10;
    assert!(
        inflate_in(&damaged, CHUNK).is_none(),
        "a bit flipped mid-stream"
    );
    let mut wrong_crc = gz.clone();
    let at = gz.len() - 8;
    wrong_crc[at] ^= 1;
    assert!(
        inflate_in(&wrong_crc, CHUNK).is_none(),
        "the trailer's CRC changed"
    );
    let mut truncated = gz[..gz.len() / 2].to_vec();
    truncated.extend_from_slice(&gz[gz.len() - 8..]);
    assert!(
        inflate_in(&truncated, CHUNK).is_none(),
        "the second half lost"
    );
    let mut two = gz.clone();
    two.extend(gzip(b"a second member"));
    assert!(inflate_in(&two, CHUNK).is_none(), "two members");
}

#[test]
fn every_window_position_is_named_by_its_two_bytes() {
    let windows = Windows::new();
    for j in 0..WINDOW {
        assert_ne!(windows.a[j], windows.b[j]);
        assert_eq!(window_position(windows.a[j], windows.b[j]), Some(j as u16));
    }
}

#[test]
fn shifted_bits_keep_their_order_and_end_in_an_empty_last_block() {
    let data: Vec<u8> = (0..64u32).map(|i| (i * 37 + 11) as u8).collect();
    for (from, to) in [
        (0, 64),
        (3, 200),
        (13, 13 + 8 * 20 + 7),
        (70, 71),
        (13, 512),
        (8, 512),
    ] {
        let mut out = Vec::new();
        let place = Place {
            first: true,
            last: false,
        };
        let used = shifted_into(&mut out, &data, from..to, place);
        assert_eq!(used, out.len()..=out.len());
        let mut original = Bits {
            data: &data,
            pos: from,
            end: 8 * 64,
        };
        let mut moved = Bits {
            data: &out,
            pos: 0,
            end: 8 * out.len() as u64,
        };
        for _ in from..to {
            assert_eq!(moved.take(1), original.take(1), "bits {from}..{to}");
        }
        // BFINAL 1, BTYPE 1, seven zero bits, then nothing but padding
        assert_eq!(moved.take(3), Some(0b011));
        assert_eq!(moved.take(7), Some(0));
        while let Some(bit) = moved.take(1) {
            assert_eq!(bit, 0);
        }
    }
}

#[test]
fn bits_shifted_by_words_are_the_bits_shifted_byte_by_byte() {
    let src: Vec<u8> = (0..41u32).map(|i| (i * 101 + 7) as u8).collect();
    for shift in 0..8u32 {
        for len in 0..src.len() {
            for end in len.max(1)..=src.len() {
                let src = &src[..end];
                let mut dst = vec![0xaa; len];
                shift_down(&mut dst, src, shift);
                let expected: Vec<u8> = (0..len)
                    .map(|i| match shift {
                        0 => src[i],
                        _ => src[i] >> shift | src.get(i + 1).map_or(0, |&h| h << (8 - shift)),
                    })
                    .collect();
                assert_eq!(dst, expected, "shift {shift}, {len} of {end} bytes");
            }
        }
    }
}

#[test]
fn the_screened_search_finds_the_blocks_the_parse_finds() {
    let gz = gzip(&sample());
    let start = deflate_start(&gz).unwrap();
    let end = 8 * (gz.len() - 8) as u64;
    // every block start of the first 40 KiB of the stream, bit by bit
    let stretch = 8 * start as u64..8 * (start + (40 << 10)) as u64;
    let parsed: Vec<u64> = stretch
        .clone()
        .filter(|&bit| blocks::block_starts_at(&gz, bit, end))
        .collect();
    assert!(parsed.len() >= 2, "{} block starts", parsed.len());
    // the search, from every nominal byte around them, stops at the first
    let mut from = stretch.start;
    while from < stretch.end {
        let expected = parsed.iter().copied().find(|&b| b >= from);
        assert_eq!(
            blocks::first_block_start(&gz, from..stretch.end, end),
            expected,
            "from bit {from}"
        );
        from += 997;
    }
}

#[test]
fn a_decode_that_outgrows_its_room_is_made_whole_in_larger_buffers() {
    let plain = sample();
    let mut encoder = flate2::write::DeflateEncoder::new(Vec::new(), flate2::Compression::fast());
    encoder.write_all(&plain).unwrap();
    let raw = encoder.finish().unwrap();
    let used = raw.len()..=raw.len();
    let mut out = vec![1u8; 10];
    let decoded = decompress_into(&raw, &mut out, 1000, usize::MAX, &used);
    assert!(matches!(decoded, Decoded::Done));
    assert!(out == plain, "{} bytes of {}", out.len(), plain.len());
    let capped = decompress_into(&raw, &mut out, 1000, plain.len() / 2, &used);
    assert!(matches!(capped, Decoded::OverLimit));
    let cut = raw.len() - 1..=raw.len() - 1;
    assert!(matches!(
        decompress_into(&raw, &mut out, plain.len(), usize::MAX, &cut),
        Decoded::Bad
    ));
}
