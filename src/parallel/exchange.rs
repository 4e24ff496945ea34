//! What ranks send each other, as flat buffers of 64-bit words: the frame header that the
//! reader broadcasts (the PSF and the image's shape and header; the pixels travel as raw f32
//! buffers beside it), and the contribution each worker returns to the writer (its patch
//! results, or why it has none).
//!
//! Floating-point values travel as their bit patterns, so a result is bit for bit the same on
//! the writer as on the worker that computed it: this is what makes the output independent of
//! the number of ranks. Decoding checks every length, so a malformed message is an error, not
//! a panic.

use std::ops::Range;
use std::path::PathBuf;

use crate::error::{Error, Result};
use crate::extract::{ModelPatch, PatchResult, PatchStatus};
use crate::image::Image;
use crate::psf::{GaussHermitePsf, Legendre};

/// A growing message.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Words(pub Vec<u64>);

impl Words {
    pub fn new() -> Self {
        Words(Vec::new())
    }

    pub fn u64(&mut self, v: u64) {
        self.0.push(v);
    }

    pub fn usize(&mut self, v: usize) {
        self.0.push(v as u64);
    }

    pub fn bool(&mut self, v: bool) {
        self.0.push(v as u64);
    }

    pub fn f64(&mut self, v: f64) {
        self.0.push(v.to_bits());
    }

    /// A length-prefixed slice.
    pub fn f64s(&mut self, v: &[f64]) {
        self.usize(v.len());
        self.0.extend(v.iter().map(|x| x.to_bits()));
    }

    /// A length-prefixed UTF-8 string, eight bytes per word.
    pub fn str(&mut self, s: &str) {
        self.usize(s.len());
        for chunk in s.as_bytes().chunks(8) {
            let mut b = [0u8; 8];
            b[..chunk.len()].copy_from_slice(chunk);
            self.0.push(u64::from_le_bytes(b));
        }
    }

    /// A length-prefixed nested message.
    pub fn words(&mut self, w: &[u64]) {
        self.usize(w.len());
        self.0.extend_from_slice(w);
    }

    pub fn into_inner(self) -> Vec<u64> {
        self.0
    }
}

/// Reads a message in the order it was written.
pub struct WordReader<'a> {
    words: &'a [u64],
    pos: usize,
}

impl<'a> WordReader<'a> {
    pub fn new(words: &'a [u64]) -> Self {
        WordReader { words, pos: 0 }
    }

    fn malformed(&self, what: &str) -> Error {
        Error::Mpi(format!(
            "malformed message: {what} at word {} of {}",
            self.pos,
            self.words.len()
        ))
    }

    fn take(&mut self, n: usize, what: &str) -> Result<&'a [u64]> {
        if n > self.words.len() - self.pos {
            return Err(self.malformed(what));
        }
        let s = &self.words[self.pos..self.pos + n];
        self.pos += n;
        Ok(s)
    }

    pub fn u64(&mut self) -> Result<u64> {
        Ok(self.take(1, "integer")?[0])
    }

    pub fn usize(&mut self) -> Result<usize> {
        let v = self.u64()?;
        usize::try_from(v).map_err(|_| self.malformed("size"))
    }

    pub fn bool(&mut self) -> Result<bool> {
        match self.u64()? {
            0 => Ok(false),
            1 => Ok(true),
            _ => Err(self.malformed("flag")),
        }
    }

    pub fn f64(&mut self) -> Result<f64> {
        Ok(f64::from_bits(self.u64()?))
    }

    pub fn f64s(&mut self) -> Result<Vec<f64>> {
        let n = self.usize()?;
        Ok(self
            .take(n, "array")?
            .iter()
            .map(|&b| f64::from_bits(b))
            .collect())
    }

    /// A length-prefixed array of exactly `n` values.
    pub fn f64s_of(&mut self, n: usize, what: &str) -> Result<Vec<f64>> {
        let v = self.f64s()?;
        if v.len() != n {
            return Err(self.malformed(what));
        }
        Ok(v)
    }

    pub fn str(&mut self) -> Result<String> {
        let len = self.usize()?;
        let words = self.take(len.div_ceil(8), "string")?;
        let mut bytes: Vec<u8> = words.iter().flat_map(|w| w.to_le_bytes()).collect();
        bytes.truncate(len);
        String::from_utf8(bytes).map_err(|_| self.malformed("string"))
    }

    pub fn words(&mut self) -> Result<&'a [u64]> {
        let n = self.usize()?;
        self.take(n, "nested message")
    }

    /// Whether every word was read.
    pub fn is_done(&self) -> bool {
        self.pos == self.words.len()
    }

    /// Fails unless every word was read.
    pub fn finish(&self) -> Result<()> {
        if self.is_done() {
            Ok(())
        } else {
            Err(self.malformed("trailing words"))
        }
    }
}

impl PatchResult {
    /// Appends this result to a message.
    pub fn to_words(&self, w: &mut Words) {
        w.usize(self.patch);
        w.usize(self.nfiber);
        w.usize(self.nwave);
        w.usize(self.ndiag);
        w.u64(self.status.code() as u64);
        w.f64s(&self.flux);
        w.f64s(&self.ivar);
        w.f64s(&self.resolution);
        w.f64s(&self.pixmask_fraction);
        w.f64s(&self.chi2pix);
        match &self.model {
            None => w.bool(false),
            Some(m) => {
                w.bool(true);
                for v in [m.rows.start, m.rows.end, m.cols.start, m.cols.end] {
                    w.usize(v);
                }
                w.f64s(&m.data);
            }
        }
    }

    /// Reads a result written by [`PatchResult::to_words`], checking its array sizes.
    pub fn from_words(r: &mut WordReader<'_>) -> Result<Self> {
        let patch = r.usize()?;
        let nfiber = r.usize()?;
        let nwave = r.usize()?;
        let ndiag = r.usize()?;
        let code = r.u64()?;
        let status = u8::try_from(code)
            .ok()
            .and_then(PatchStatus::from_code)
            .ok_or_else(|| Error::Mpi(format!("malformed message: patch status {code}")))?;
        let n = nfiber * nwave;
        let flux = r.f64s_of(n, "flux")?;
        let ivar = r.f64s_of(n, "ivar")?;
        let resolution = r.f64s_of(n * (2 * ndiag + 1), "resolution")?;
        let pixmask_fraction = r.f64s_of(n, "pixmask fraction")?;
        let chi2pix = r.f64s_of(n, "chi2pix")?;
        let model = if r.bool()? {
            let (r0, r1, c0, c1) = (r.usize()?, r.usize()?, r.usize()?, r.usize()?);
            let size = r1.saturating_sub(r0) * c1.saturating_sub(c0);
            Some(ModelPatch {
                rows: r0..r1,
                cols: c0..c1,
                data: r.f64s_of(size, "model")?,
            })
        } else {
            None
        };
        Ok(PatchResult {
            patch,
            nfiber,
            nwave,
            ndiag,
            status,
            flux,
            ivar,
            resolution,
            pixmask_fraction,
            chi2pix,
            model,
        })
    }
}

fn legendre_to_words(l: &Legendre, w: &mut Words) {
    w.f64(l.wavemin);
    w.f64(l.wavemax);
    w.usize(l.ncoef);
    w.f64s(&l.coeff);
}

fn legendre_from_words(r: &mut WordReader<'_>) -> Result<Legendre> {
    Ok(Legendre {
        wavemin: r.f64()?,
        wavemax: r.f64()?,
        ncoef: r.usize()?,
        coeff: r.f64s()?,
    })
}

/// Appends a PSF to a message (about 1 MB for a DESI PSF: every rank gets it from the reader
/// rather than opening the file itself).
pub fn psf_to_words(psf: &GaussHermitePsf, w: &mut Words) {
    w.str(&psf.path.to_string_lossy());
    for v in [
        psf.nfiber, psf.hsizex, psf.hsizey, psf.ghdegx, psf.ghdegy, psf.legdeg, psf.npix_x,
        psf.npix_y,
    ] {
        w.usize(v);
    }
    w.bool(psf.psferr.is_some());
    w.f64(psf.psferr.unwrap_or(0.0));
    w.bool(psf.orig_psf.is_some());
    w.str(psf.orig_psf.as_deref().unwrap_or(""));
    w.f64(psf.tail_amplitude);
    for l in [&psf.xtrace, &psf.ytrace, &psf.ghsigx, &psf.ghsigy] {
        legendre_to_words(l, w);
    }
    w.usize(psf.gh.len());
    for l in &psf.gh {
        legendre_to_words(l, w);
    }
}

/// Reads a PSF written by [`psf_to_words`].
pub fn psf_from_words(r: &mut WordReader<'_>) -> Result<GaussHermitePsf> {
    let path = PathBuf::from(r.str()?);
    let mut n = [0usize; 8];
    for v in &mut n {
        *v = r.usize()?;
    }
    let [nfiber, hsizex, hsizey, ghdegx, ghdegy, legdeg, npix_x, npix_y] = n;
    let has_psferr = r.bool()?;
    let psferr = r.f64()?;
    let has_orig_psf = r.bool()?;
    let orig_psf = r.str()?;
    let tail_amplitude = r.f64()?;
    let xtrace = legendre_from_words(r)?;
    let ytrace = legendre_from_words(r)?;
    let ghsigx = legendre_from_words(r)?;
    let ghsigy = legendre_from_words(r)?;
    let ngh = r.usize()?;
    if ngh != (ghdegx + 1) * (ghdegy + 1) {
        return Err(Error::Mpi(format!(
            "malformed message: {ngh} Gauss-Hermite terms for degrees {ghdegx}, {ghdegy}"
        )));
    }
    let gh = (0..ngh)
        .map(|_| legendre_from_words(r))
        .collect::<Result<Vec<_>>>()?;
    for l in [&xtrace, &ytrace, &ghsigx, &ghsigy].into_iter().chain(&gh) {
        if l.ncoef == 0 || l.coeff.len() != nfiber * l.ncoef {
            return Err(Error::Mpi(
                "malformed message: PSF coefficients do not match its fibers".into(),
            ));
        }
    }
    Ok(GaussHermitePsf {
        path,
        nfiber,
        hsizex,
        hsizey,
        ghdegx,
        ghdegy,
        legdeg,
        npix_x,
        npix_y,
        psferr: has_psferr.then_some(psferr),
        orig_psf: has_orig_psf.then_some(orig_psf),
        tail_amplitude,
        xtrace,
        ytrace,
        ghsigx,
        ghsigy,
        gh,
    })
}

/// What the reader broadcasts about a frame before its pixels: the PSF and everything about
/// the image except the pixel arrays, which follow as raw f32 buffers of the pixel box.
pub struct FrameHeader {
    pub psf: GaussHermitePsf,
    /// The image with empty `pix` and `ivar`.
    pub image: Image,
    /// The CCD rows and columns that the frame's patches can use: only these pixels travel.
    pub rows: Range<usize>,
    pub cols: Range<usize>,
    /// Seconds the reader spent reading the frame.
    pub read_s: f64,
}

impl FrameHeader {
    /// Encodes the header of a frame that was read.
    pub fn to_words(
        psf: &GaussHermitePsf,
        image: &Image,
        (rows, cols): (Range<usize>, Range<usize>),
        read_s: f64,
    ) -> Vec<u64> {
        let mut w = Words::new();
        psf_to_words(psf, &mut w);
        for v in [rows.start, rows.end, cols.start, cols.end] {
            w.usize(v);
        }
        w.str(&image.path.to_string_lossy());
        w.usize(image.nrows);
        w.usize(image.ncols);
        w.usize(image.header.len());
        for card in &image.header {
            w.str(card);
        }
        w.bool(image.has_fibermap);
        w.usize(image.nmasked);
        w.usize(image.nnonfinite);
        w.f64(read_s);
        w.into_inner()
    }

    pub fn from_words(words: &[u64]) -> Result<Self> {
        let mut r = WordReader::new(words);
        let psf = psf_from_words(&mut r)?;
        let (r0, r1, c0, c1) = (r.usize()?, r.usize()?, r.usize()?, r.usize()?);
        let path = PathBuf::from(r.str()?);
        let nrows = r.usize()?;
        let ncols = r.usize()?;
        let ncards = r.usize()?;
        let header = (0..ncards).map(|_| r.str()).collect::<Result<Vec<_>>>()?;
        let image = Image {
            path,
            nrows,
            ncols,
            pix: Vec::new(),
            ivar: Vec::new(),
            header,
            has_fibermap: r.bool()?,
            nmasked: r.usize()?,
            nnonfinite: r.usize()?,
        };
        let read_s = r.f64()?;
        r.finish()?;
        if r0 > r1 || r1 > nrows || c0 > c1 || c1 > ncols {
            return Err(Error::Mpi(format!(
                "malformed message: pixel box {r0}..{r1} x {c0}..{c1} outside {nrows} x {ncols}"
            )));
        }
        Ok(FrameHeader {
            psf,
            image,
            rows: r0..r1,
            cols: c0..c1,
            read_s,
        })
    }

    /// Number of pixels of each of the two f32 arrays that follow the header.
    pub fn npix(&self) -> usize {
        self.rows.len() * self.cols.len()
    }
}

/// Copies the box `rows x cols` of a row-major image of width `ncols` into a dense buffer.
pub fn pack_box(image: &[f32], ncols: usize, rows: &Range<usize>, cols: &Range<usize>) -> Vec<f32> {
    let mut out = Vec::with_capacity(rows.len() * cols.len());
    for r in rows.clone() {
        out.extend_from_slice(&image[r * ncols + cols.start..r * ncols + cols.end]);
    }
    out
}

/// Copies a dense box buffer back into a row-major image of width `ncols`.
pub fn unpack_box(
    packed: &[f32],
    image: &mut [f32],
    ncols: usize,
    rows: &Range<usize>,
    cols: &Range<usize>,
) {
    let w = cols.len();
    for (i, r) in rows.clone().enumerate() {
        image[r * ncols + cols.start..r * ncols + cols.end]
            .copy_from_slice(&packed[i * w..(i + 1) * w]);
    }
}

/// What one worker returns to the writer for one frame.
#[derive(Clone, Debug, PartialEq)]
pub enum Contribution {
    /// The worker solved its patches (possibly none). The first worker also forwards the frame
    /// header, so that a writer that did not read the frame can assemble and write it.
    Solved {
        header: Option<Vec<u64>>,
        results: Vec<PatchResult>,
        /// Seconds spent receiving the inputs and solving.
        recv_s: f64,
        solve_s: f64,
    },
    /// The worker failed on this frame; it printed why.
    Failed,
    /// The reader could not read the frame; nothing was solved.
    Skipped,
}

const SOLVED: u64 = 1;
const FAILED: u64 = 2;
const SKIPPED: u64 = 3;

impl Contribution {
    pub fn to_words(&self) -> Vec<u64> {
        let mut w = Words::new();
        match self {
            Contribution::Solved {
                header,
                results,
                recv_s,
                solve_s,
            } => {
                w.u64(SOLVED);
                w.bool(header.is_some());
                if let Some(h) = header {
                    w.words(h);
                }
                w.f64(*recv_s);
                w.f64(*solve_s);
                w.usize(results.len());
                for r in results {
                    r.to_words(&mut w);
                }
            }
            Contribution::Failed => w.u64(FAILED),
            Contribution::Skipped => w.u64(SKIPPED),
        }
        w.into_inner()
    }

    pub fn from_words(words: &[u64]) -> Result<Self> {
        let mut r = WordReader::new(words);
        let c = match r.u64()? {
            SOLVED => {
                let header = if r.bool()? {
                    Some(r.words()?.to_vec())
                } else {
                    None
                };
                let recv_s = r.f64()?;
                let solve_s = r.f64()?;
                let n = r.usize()?;
                // Each result takes at least a dozen words: bound the allocation by the message.
                let mut results = Vec::with_capacity(n.min(words.len() / 12));
                for _ in 0..n {
                    results.push(PatchResult::from_words(&mut r)?);
                }
                Contribution::Solved {
                    header,
                    results,
                    recv_s,
                    solve_s,
                }
            }
            FAILED => Contribution::Failed,
            SKIPPED => Contribution::Skipped,
            k => {
                return Err(Error::Mpi(format!(
                    "malformed message: contribution kind {k}"
                )))
            }
        };
        r.finish()?;
        Ok(c)
    }
}

/// The files of one frame: input image, PSF, output frame and optional model image.
pub type FrameFiles = (PathBuf, PathBuf, PathBuf, Option<PathBuf>);

/// Encodes a list of frames for the broadcast of the run's work.
pub fn frames_to_words(frames: &[FrameFiles]) -> Vec<u64> {
    let mut w = Words::new();
    w.usize(frames.len());
    for (i, p, o, m) in frames {
        for path in [i, p, o] {
            w.str(&path.to_string_lossy());
        }
        w.bool(m.is_some());
        w.str(&m.as_ref().map(|m| m.to_string_lossy()).unwrap_or_default());
    }
    w.into_inner()
}

/// Decodes [`frames_to_words`].
pub fn frames_from_words(words: &[u64]) -> Result<Vec<FrameFiles>> {
    let mut r = WordReader::new(words);
    let n = r.usize()?;
    let mut frames = Vec::with_capacity(n.min(words.len()));
    for _ in 0..n {
        let i = PathBuf::from(r.str()?);
        let p = PathBuf::from(r.str()?);
        let o = PathBuf::from(r.str()?);
        let has_model = r.bool()?;
        let m = r.str()?;
        frames.push((i, p, o, has_model.then(|| PathBuf::from(m))));
    }
    r.finish()?;
    Ok(frames)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn result(patch: usize, model: bool) -> PatchResult {
        let (nfiber, nwave, ndiag) = (5, 3, 2);
        let n = nfiber * nwave;
        let ramp = |k: f64| (0..n).map(|i| k * i as f64 - 0.25).collect::<Vec<_>>();
        PatchResult {
            patch,
            nfiber,
            nwave,
            ndiag,
            status: PatchStatus::Regularized,
            flux: ramp(1.5),
            ivar: ramp(0.1),
            resolution: (0..n * (2 * ndiag + 1)).map(|i| (i as f64).sin()).collect(),
            pixmask_fraction: ramp(0.01),
            chi2pix: ramp(1e-300),
            model: model.then(|| ModelPatch {
                rows: 10..12,
                cols: 4..7,
                data: vec![1.0, -0.0, f64::MIN_POSITIVE, 3.0, 4.0, 1e300],
            }),
        }
    }

    #[test]
    fn patch_results_round_trip_bit_for_bit() {
        let mut w = Words::new();
        let originals = [result(7, false), result(8, true)];
        for r in &originals {
            r.to_words(&mut w);
        }
        let words = w.into_inner();
        let mut r = WordReader::new(&words);
        for original in &originals {
            let back = PatchResult::from_words(&mut r).unwrap();
            assert_eq!(&back, original);
            let bits = |v: &[f64]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
            assert_eq!(bits(&back.chi2pix), bits(&original.chi2pix));
        }
        r.finish().unwrap();
    }

    #[test]
    fn truncated_or_corrupt_results_are_errors() {
        let mut w = Words::new();
        result(1, true).to_words(&mut w);
        let words = w.into_inner();
        for cut in [0, 3, 10, words.len() - 1] {
            assert!(PatchResult::from_words(&mut WordReader::new(&words[..cut])).is_err());
        }
        let mut bad = words.clone();
        bad[4] = 99; // status code
        assert!(PatchResult::from_words(&mut WordReader::new(&bad)).is_err());
        let mut bad = words;
        bad[1] = 6; // nfiber no longer matches the arrays
        assert!(PatchResult::from_words(&mut WordReader::new(&bad)).is_err());
    }

    #[test]
    fn contributions_round_trip() {
        for c in [
            Contribution::Failed,
            Contribution::Skipped,
            Contribution::Solved {
                header: Some(vec![1, 2, 3]),
                results: vec![result(0, false), result(1, true)],
                recv_s: 0.5,
                solve_s: 1.25,
            },
            Contribution::Solved {
                header: None,
                results: vec![],
                recv_s: 0.0,
                solve_s: 0.0,
            },
        ] {
            assert_eq!(Contribution::from_words(&c.to_words()).unwrap(), c);
        }
        assert!(Contribution::from_words(&[]).is_err());
        assert!(Contribution::from_words(&[9]).is_err());
        assert!(Contribution::from_words(&[FAILED, 0]).is_err());
    }

    #[test]
    fn boxes_pack_and_unpack() {
        let image: Vec<f32> = (0..20).map(|v| v as f32).collect(); // 4 rows x 5 columns
        let packed = pack_box(&image, 5, &(1..3), &(2..4));
        assert_eq!(packed, vec![7.0, 8.0, 12.0, 13.0]);
        let mut back = vec![0.0; 20];
        unpack_box(&packed, &mut back, 5, &(1..3), &(2..4));
        assert_eq!(back.iter().filter(|&&v| v != 0.0).count(), 4);
        assert_eq!((back[7], back[13]), (7.0, 13.0));
    }

    #[test]
    fn strings_and_frame_lists_round_trip() {
        let frames = vec![
            (
                PathBuf::from("preproc-r0-00001234.fits"),
                PathBuf::from("psf é.fits"),
                PathBuf::from("out/frame-r0-00001234.fits"),
                None,
            ),
            (
                "a".into(),
                "".into(),
                "12345678".into(),
                Some("m.fits".into()),
            ),
        ];
        assert_eq!(
            frames_from_words(&frames_to_words(&frames)).unwrap(),
            frames
        );
    }

    #[test]
    fn psf_and_frame_header_round_trip() {
        let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/data");
        let psf = GaussHermitePsf::read(&dir.join("psf-r0-00067784.fits")).unwrap();
        let image = Image {
            path: "in.fits".into(),
            nrows: 3,
            ncols: 2,
            pix: vec![0.0; 6],
            ivar: vec![1.0; 6],
            header: vec!["EXPID   =                 1234".into(), "".into()],
            has_fibermap: true,
            nmasked: 2,
            nnonfinite: 1,
        };
        let h = FrameHeader::from_words(&FrameHeader::to_words(&psf, &image, (1..3, 0..2), 0.5))
            .unwrap();
        assert_eq!((h.rows.clone(), h.cols.clone()), (1..3, 0..2));
        assert_eq!(h.npix(), 4);
        let bad = FrameHeader::to_words(&psf, &image, (1..4, 0..2), 0.5);
        assert!(FrameHeader::from_words(&bad).is_err());
        assert_eq!(h.image.header, image.header);
        assert_eq!(h.read_s, 0.5);
        assert!(h.image.has_fibermap && h.image.pix.is_empty());
        assert_eq!(
            (h.psf.nfiber, h.psf.hsizey, h.psf.psferr),
            (psf.nfiber, psf.hsizey, psf.psferr)
        );
        let w = [6000.0, 6200.3, 6400.0];
        for fiber in [0, 7, psf.nfiber - 1] {
            for &wave in &w {
                assert_eq!(h.psf.params(fiber, wave), psf.params(fiber, wave));
            }
        }
    }
}
