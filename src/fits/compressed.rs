//! The keywords of tile-compressed images (ZCMPTYPE, ZBITPIX, ZNAXISn, ZTILEn, ZVALn,
//! ZQUANTIZ, ZDITHER0), checked in the file's own header cards before cfitsio reads them.
//!
//! cfitsio parses these keywords as soon as it moves to, or past, a compressed HDU, and
//! trusts them: a ZTILEn of 0 divides by zero (SIGFPE) and a RICE block size (ZVAL1) of 0
//! does when the tiles are read, a ZDITHER0 near 2^31 overflows the C `int` that indexes its
//! table of random numbers (SIGSEGV). A signal ends the whole run, the good frames of a
//! `--list` with it; so [`check_file`] reads every HDU header of a file first, and a
//! compressed HDU whose keywords cfitsio cannot decompress safely is an error naming the HDU
//! and the keyword, as any damaged file is. The limits are those of cfitsio's `imcompress.c`
//! and of the FITS tiled-image convention. A header this scan cannot follow (a truncated
//! file, a damaged NAXISn) ends it quietly: cfitsio then reports the damage itself.

use std::io::{Read, Seek, SeekFrom};
use std::ops::RangeInclusive;
use std::path::Path;

use super::RECORD;
use crate::error::{Error, Result};

/// Headers are made of 80-byte cards, in records of [`RECORD`] bytes.
const CARD: usize = 80;
/// A header longer than this many blocks (28 MB) is not followed: damage, not a header.
const MAX_HEADER_BLOCKS: usize = 10_000;
/// cfitsio's MAX_COMPRESS_DIM.
const AXES: RangeInclusive<i64> = 1..=6;
/// The dither seeds of the convention (cfitsio's N_RANDOM random numbers): cfitsio adds the
/// seed to a tile's row number in a C `int`.
const DITHER_SEEDS: RangeInclusive<i64> = 1..=10_000;
/// Pixels of the largest tile: cfitsio sizes its tile buffers (up to 8 bytes a pixel) and a
/// RICE block's end in C `int`s.
const MAX_TILE_PIXELS: i64 = i32::MAX as i64 / 8;
/// The compressions cfitsio decompresses (ZCMPTYPE).
const COMPRESSIONS: &[&str] = &[
    "RICE_1",
    "RICE_ONE",
    "GZIP_1",
    "GZIP_2",
    "HCOMPRESS_1",
    "PLIO_1",
    "BZIP2_1",
    "NOCOMPRESS",
];
/// The quantizations of floating-point tiles (ZQUANTIZ).
const QUANTIZATIONS: &[&str] = &[
    "NONE",
    "NO_DITHER",
    "SUBTRACTIVE_DITHER_1",
    "SUBTRACTIVE_DITHER_2",
];
/// The byte counts of a RICE-compressed pixel (ZVAL2).
const RICE_BYTES: &[i64] = &[1, 2, 4, 8];
const BITPIX: &[i64] = &[8, 16, 32, 64, -32, -64];

/// Checks every tile-compressed HDU of the file at `path`. A file that cannot be opened or
/// read here is left to cfitsio, whose error says why.
pub(super) fn check_file(path: &Path) -> Result<()> {
    match std::fs::File::open(path) {
        Ok(file) => check(path, file),
        Err(_) => Ok(()),
    }
}

/// [`check_file`] for a file's bytes in memory (an inflated gzip file).
pub(super) fn check_bytes(path: &Path, bytes: &[u8]) -> Result<()> {
    check(path, std::io::Cursor::new(bytes))
}

fn check(path: &Path, mut reader: impl Read + Seek) -> Result<()> {
    let mut number = 1;
    while let Some(header) = Header::read(&mut reader) {
        if header.is_compressed_image() {
            header.check_compression().map_err(|message| Error::Fits {
                path: path.into(),
                what: format!("HDU {}", header.name(number)),
                message: format!("tile compression: {message}"),
            })?;
        }
        let Some(data) = header.data_bytes() else {
            break;
        };
        if reader.seek(SeekFrom::Current(data)).is_err() {
            break;
        }
        number += 1;
    }
    Ok(())
}

/// A keyword's value as written: a quoted string (quotes removed), or the text before the
/// comment (a number, T or F).
struct Value {
    text: String,
    quoted: bool,
}

impl Value {
    fn parse(field: &str) -> Value {
        let field = field.trim_start();
        let Some(rest) = field.strip_prefix('\'') else {
            let text = field.split('/').next().unwrap_or("").trim().to_string();
            return Value {
                text,
                quoted: false,
            };
        };
        // A quote inside a string is written twice.
        let mut text = String::new();
        let mut chars = rest.chars().peekable();
        while let Some(c) = chars.next() {
            if c == '\'' {
                if chars.peek() != Some(&'\'') {
                    break;
                }
                chars.next();
            }
            text.push(c);
        }
        Value {
            text: text.trim_end().to_string(),
            quoted: true,
        }
    }

    /// The value as cfitsio reads it into an integer: a floating-point value is truncated.
    fn integer(&self) -> Option<i64> {
        if self.quoted {
            return None;
        }
        let text = self.text.replace(['D', 'd'], "E");
        if let Ok(n) = text.parse::<i64>() {
            return Some(n);
        }
        let x = text.parse::<f64>().ok()?;
        (x.is_finite() && x.abs() < i64::MAX as f64).then_some(x.trunc() as i64)
    }

    fn float(&self) -> Option<f64> {
        (!self.quoted)
            .then(|| self.text.replace(['D', 'd'], "E").parse::<f64>().ok())
            .flatten()
    }
}

/// The keywords of one HDU header, in order.
struct Header {
    cards: Vec<(String, Value)>,
}

impl Header {
    /// The next header of the file, the reader left at its data; `None` at the end of the
    /// file or where no END card ends it.
    fn read(reader: &mut impl Read) -> Option<Header> {
        let mut cards = Vec::new();
        let mut block = vec![0u8; RECORD];
        for _ in 0..MAX_HEADER_BLOCKS {
            reader.read_exact(&mut block).ok()?;
            for card in block.chunks(CARD) {
                let card = String::from_utf8_lossy(card);
                let key = card.get(..8).unwrap_or("").trim_end();
                if key == "END" {
                    return Some(Header { cards });
                }
                if card.get(8..10) == Some("= ") {
                    cards.push((key.to_string(), Value::parse(&card[10..])));
                }
            }
        }
        None
    }

    /// A keyword's first value, as cfitsio finds it.
    fn get(&self, key: &str) -> Option<&Value> {
        self.cards.iter().find(|(k, _)| k == key).map(|(_, v)| v)
    }

    fn string(&self, key: &str) -> Option<&str> {
        self.get(key).map(|v| v.text.as_str())
    }

    /// An integer keyword; an error if it is there but not a number.
    fn integer(&self, key: &str) -> std::result::Result<Option<i64>, String> {
        match self.get(key) {
            None => Ok(None),
            Some(v) => v
                .integer()
                .map(Some)
                .ok_or_else(|| format!("{key} = {} is not an integer", shown(v))),
        }
    }

    fn required(&self, key: &str) -> std::result::Result<i64, String> {
        self.integer(key)?
            .ok_or_else(|| format!("{key} is missing"))
    }

    /// The HDU's EXTNAME, or its number (from 1) in the file.
    fn name(&self, number: usize) -> String {
        match self.string("EXTNAME") {
            Some(name) if !name.trim().is_empty() => name.trim().to_string(),
            _ => number.to_string(),
        }
    }

    /// cfitsio's test: a binary table whose ZIMAGE value starts with T.
    fn is_compressed_image(&self) -> bool {
        self.string("XTENSION").map(str::trim) == Some("BINTABLE")
            && self
                .get("ZIMAGE")
                .is_some_and(|v| !v.quoted && v.text.starts_with('T'))
    }

    /// Bytes of the HDU's data, whole blocks; `None` where the header does not say.
    fn data_bytes(&self) -> Option<i64> {
        let int = |key: &str| self.get(key).and_then(Value::integer);
        let naxis = int("NAXIS")?;
        if naxis == 0 {
            return Some(0);
        }
        let mut elements: i64 = 1;
        for i in 1..=naxis {
            elements = elements.checked_mul(int(&format!("NAXIS{i}")).filter(|&n| n >= 0)?)?;
        }
        let (pcount, gcount) = (int("PCOUNT").unwrap_or(0), int("GCOUNT").unwrap_or(1));
        let bytes = (int("BITPIX")?.abs() / 8)
            .checked_mul(gcount)?
            .checked_mul(pcount.checked_add(elements)?)?;
        let block = RECORD as i64;
        (bytes >= 0).then_some(())?;
        Some(bytes.checked_add(block - 1)? / block * block)
    }

    /// The checks of cfitsio's `imcomp_get_compressed_image_par`, plus the limits it
    /// assumes without checking.
    fn check_compression(&self) -> std::result::Result<(), String> {
        let kind = self.string("ZCMPTYPE").ok_or("ZCMPTYPE is missing")?;
        let kind = COMPRESSIONS
            .iter()
            .find(|c| c.eq_ignore_ascii_case(kind.trim()))
            .ok_or_else(|| format!("ZCMPTYPE = '{kind}' is none of {}", COMPRESSIONS.join(", ")))?;
        let bitpix = self.required("ZBITPIX")?;
        if !BITPIX.contains(&bitpix) {
            return Err(format!(
                "ZBITPIX = {bitpix} is none of 8, 16, 32, 64, -32, -64"
            ));
        }
        self.check_tiles()?;
        self.check_quantization()?;
        match *kind {
            "RICE_1" | "RICE_ONE" => self.check_rice(),
            "HCOMPRESS_1" => self.check_hcompress(),
            _ => Ok(()),
        }
    }

    /// The image's axes and tiles, and that the table has one row a tile.
    fn check_tiles(&self) -> std::result::Result<(), String> {
        let naxis = self.required("ZNAXIS")?;
        if !AXES.contains(&naxis) {
            return Err(format!("ZNAXIS = {naxis} is not 1 to {}", AXES.end()));
        }
        let (mut tiles, mut tile_pixels) = (1i64, 1i64);
        for i in 1..=naxis {
            let length = self.required(&format!("ZNAXIS{i}"))?;
            if length < 1 {
                return Err(format!("ZNAXIS{i} = {length} is not an axis length"));
            }
            let default = if i == 1 { length } else { 1 };
            let tile = self.integer(&format!("ZTILE{i}"))?.unwrap_or(default);
            if tile < 1 {
                return Err(format!(
                    "ZTILE{i} = {tile} is not a tile length (1 or more)"
                ));
            }
            tiles = tiles.saturating_mul((length - 1) / tile + 1);
            tile_pixels = tile_pixels.saturating_mul(tile);
        }
        if tile_pixels > MAX_TILE_PIXELS {
            return Err(format!(
                "tiles of {tile_pixels} pixels (ZTILEn) are more than cfitsio decompresses \
                 ({MAX_TILE_PIXELS})"
            ));
        }
        let rows = self.integer("NAXIS2")?.unwrap_or(0);
        if tiles != rows {
            return Err(format!(
                "ZNAXISn and ZTILEn make {tiles} tiles, the table has {rows} rows (NAXIS2)"
            ));
        }
        Ok(())
    }

    fn check_quantization(&self) -> std::result::Result<(), String> {
        if let Some(method) = self.string("ZQUANTIZ") {
            if !QUANTIZATIONS
                .iter()
                .any(|q| q.eq_ignore_ascii_case(method.trim()))
            {
                return Err(format!(
                    "ZQUANTIZ = '{method}' is none of {}",
                    QUANTIZATIONS.join(", ")
                ));
            }
        }
        match self.integer("ZDITHER0")? {
            Some(seed) if !DITHER_SEEDS.contains(&seed) => Err(format!(
                "ZDITHER0 = {seed} is not a dither seed ({} to {})",
                DITHER_SEEDS.start(),
                DITHER_SEEDS.end()
            )),
            _ => Ok(()),
        }
    }

    /// RICE's block size (ZVAL1) and bytes a pixel (ZVAL2, 4 by default), which cfitsio
    /// swaps when an old file wrote them the other way round.
    fn check_rice(&self) -> std::result::Result<(), String> {
        let mut block = self.required("ZVAL1")?;
        let old = self.string("ZNAME2").map(str::trim) == Some("NOISEBIT");
        let mut bytes = match old {
            true => 4,
            false => self.integer("ZVAL2")?.unwrap_or(4),
        };
        if block < 16 && bytes > 8 {
            std::mem::swap(&mut block, &mut bytes);
        }
        if !(1..=MAX_TILE_PIXELS).contains(&block) {
            return Err(format!(
                "the RICE block size ZVAL1 = {block} is not 1 to {MAX_TILE_PIXELS}"
            ));
        }
        if !RICE_BYTES.contains(&bytes) {
            return Err(format!(
                "the RICE bytes a pixel ZVAL2 = {bytes} is none of 1, 2, 4, 8"
            ));
        }
        Ok(())
    }

    fn check_hcompress(&self) -> std::result::Result<(), String> {
        let scale = self
            .get("ZVAL1")
            .ok_or("ZVAL1 (HCOMPRESS's scale) is missing")?;
        match scale.float() {
            Some(s) if s.is_finite() => Ok(()),
            _ => Err(format!(
                "HCOMPRESS's scale ZVAL1 = {} is not a finite number",
                shown(scale)
            )),
        }
    }
}

/// A value as the header writes it, strings in quotes.
fn shown(v: &Value) -> String {
    match v.quoted {
        true => format!("'{}'", v.text),
        false => v.text.clone(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn header(cards: &[(&str, &str)]) -> Header {
        Header {
            cards: cards
                .iter()
                .map(|(k, v)| (k.to_string(), Value::parse(v)))
                .collect(),
        }
    }

    /// The keywords of a 1000 x 330 float image compressed by rows with RICE.
    fn rice_rows() -> Vec<(&'static str, &'static str)> {
        vec![
            ("XTENSION", "'BINTABLE'"),
            ("NAXIS2", "1000"),
            ("ZIMAGE", "T"),
            ("ZCMPTYPE", "'RICE_1  '"),
            ("ZBITPIX", "-32"),
            ("ZNAXIS", "2"),
            ("ZNAXIS1", "330"),
            ("ZNAXIS2", "1000"),
            ("ZTILE1", "330"),
            ("ZTILE2", "1"),
            ("ZVAL1", "32 / BLOCKSIZE"),
            ("ZVAL2", "4"),
            ("ZQUANTIZ", "'SUBTRACTIVE_DITHER_1'"),
            ("ZDITHER0", "1234"),
        ]
    }

    fn with(key: &'static str, value: &'static str) -> Header {
        let mut cards = rice_rows();
        cards.iter_mut().find(|(k, _)| *k == key).unwrap().1 = value;
        header(&cards)
    }

    #[test]
    fn a_valid_header_passes_and_each_bad_keyword_is_named() {
        assert!(header(&rice_rows()).is_compressed_image());
        assert_eq!(header(&rice_rows()).check_compression(), Ok(()));
        for (key, value, needle) in [
            ("ZTILE1", "0", "ZTILE1 = 0"),
            ("ZTILE2", "0.5", "ZTILE2 = 0"),
            ("ZTILE2", "-3", "ZTILE2 = -3"),
            ("ZTILE1", "'x'", "ZTILE1 = 'x' is not an integer"),
            ("ZVAL1", "0", "ZVAL1 = 0"),
            ("ZVAL2", "3", "ZVAL2 = 3"),
            ("ZDITHER0", "2147483647", "ZDITHER0 = 2147483647"),
            ("ZDITHER0", "0", "ZDITHER0 = 0"),
            ("ZCMPTYPE", "'FOO_1'", "ZCMPTYPE = 'FOO_1'"),
            ("ZBITPIX", "12", "ZBITPIX = 12"),
            ("ZNAXIS", "7", "ZNAXIS = 7"),
            ("ZNAXIS1", "331", "make 2000 tiles"),
            ("ZQUANTIZ", "'DITHER'", "ZQUANTIZ = 'DITHER'"),
            ("ZTILE1", "1000000000", "pixels"),
        ] {
            let message = with(key, value).check_compression().unwrap_err();
            assert!(message.contains(needle), "{key} = {value}: {message}");
        }
    }

    #[test]
    fn old_rice_order_and_defaults_are_cfitsios() {
        // Block size and bytes a pixel written the other way round are swapped back.
        let mut cards = rice_rows();
        cards.retain(|(k, _)| !k.starts_with("ZVAL"));
        cards.extend([("ZVAL1", "4"), ("ZVAL2", "32")]);
        assert_eq!(header(&cards).check_compression(), Ok(()));
        // ZTILE1 defaults to the row, ZTILE2 to 1; ZDITHER0 and ZQUANTIZ may be absent.
        let mut cards = rice_rows();
        cards.retain(|(k, _)| !k.starts_with("ZTILE") && !k.starts_with("ZDITHER"));
        cards.retain(|(k, _)| *k != "ZQUANTIZ");
        assert_eq!(header(&cards).check_compression(), Ok(()));
    }

    #[test]
    fn hcompress_needs_a_finite_scale() {
        let mut cards = rice_rows();
        cards.retain(|(k, _)| !k.starts_with("ZVAL") && *k != "ZCMPTYPE");
        cards.push(("ZCMPTYPE", "'HCOMPRESS_1'"));
        cards.push(("ZVAL1", "'x'"));
        let message = header(&cards).check_compression().unwrap_err();
        assert!(message.contains("scale ZVAL1 = 'x'"), "{message}");
        *cards.last_mut().unwrap() = ("ZVAL1", "2.5");
        assert_eq!(header(&cards).check_compression(), Ok(()));
    }

    #[test]
    fn values_parse_as_cfitsio_reads_them() {
        let v = Value::parse(" 'it''s a name' / comment");
        assert_eq!((v.text.as_str(), v.quoted), ("it's a name", true));
        assert_eq!(Value::parse("  42 / c").integer(), Some(42));
        assert_eq!(Value::parse("1.9D1").integer(), Some(19));
        assert_eq!(Value::parse("1e300").integer(), None);
        assert_eq!(Value::parse("'7'").integer(), None);
    }
}
