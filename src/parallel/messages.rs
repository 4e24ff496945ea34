//! What ranks send each other: the job's frame list, the frame header that a group's reader
//! broadcasts (the PSF and everything about the image but its pixels, which travel beside it
//! as raw f32 buffers of a pixel box), and the contribution each worker returns to the
//! writer (its patch results, or why it has none).
//!
//! Messages are serde values encoded with postcard, which writes an f64 as its 8
//! little-endian bytes: a result is bit for bit the same on the writer as on the worker that
//! computed it, which is what makes the output independent of the number of ranks. Decoding
//! runs the same `validate` as reading the value from its file, so a malformed message is an
//! error, never a panic or a frame built from inconsistent parts.
//!
//! Paths travel as their bytes ([`path_bytes`]): a Linux file name is any bytes but `/` and
//! NUL, not necessarily UTF-8, and serde's own encoding of a path refuses what is not.

use std::ops::Range;

use ndarray::{s, ArrayView2, ArrayViewMut2};
use serde::de::DeserializeOwned;
use serde::{Deserialize, Serialize};

use crate::error::{Error, Result};
use crate::extract::PatchResult;
use crate::frame::FrameValues;
use crate::image::Image;
use crate::pipeline::{ExtractRequest, Inputs};
use crate::psf::GaussHermitePsf;

/// Serde of a path as the bytes of its name (`#[serde(with = "path_bytes")]`), so that any
/// name Linux accepts travels, UTF-8 or not.
pub mod path_bytes {
    use std::ffi::OsString;
    use std::os::unix::ffi::{OsStrExt, OsStringExt};
    use std::path::{Path, PathBuf};

    use serde::{Deserialize, Deserializer, Serializer};

    pub fn serialize<S: Serializer>(path: &Path, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_bytes(path.as_os_str().as_bytes())
    }

    pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<PathBuf, D::Error> {
        let bytes: Vec<u8> = serde_bytes_vec(d)?;
        Ok(PathBuf::from(OsString::from_vec(bytes)))
    }

    /// Bytes written by `serialize_bytes`, through serde's byte-buffer visitor.
    fn serde_bytes_vec<'de, D: Deserializer<'de>>(d: D) -> Result<Vec<u8>, D::Error> {
        struct Bytes;
        impl serde::de::Visitor<'_> for Bytes {
            type Value = Vec<u8>;
            fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
                f.write_str("the bytes of a path")
            }
            fn visit_bytes<E: serde::de::Error>(self, v: &[u8]) -> Result<Vec<u8>, E> {
                Ok(v.to_vec())
            }
            fn visit_byte_buf<E: serde::de::Error>(self, v: Vec<u8>) -> Result<Vec<u8>, E> {
                Ok(v)
            }
        }
        d.deserialize_byte_buf(Bytes)
    }

    /// The same for an optional path.
    pub mod option {
        use super::*;

        pub fn serialize<S: Serializer>(path: &Option<PathBuf>, s: S) -> Result<S::Ok, S::Error> {
            #[derive(serde::Serialize)]
            struct Wrap<'a>(#[serde(with = "super")] &'a Path);
            match path {
                Some(p) => s.serialize_some(&Wrap(p)),
                None => s.serialize_none(),
            }
        }

        pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<Option<PathBuf>, D::Error> {
            #[derive(serde::Deserialize)]
            struct Wrap(#[serde(with = "super")] PathBuf);
            Ok(Option::<Wrap>::deserialize(d)?.map(|w| w.0))
        }
    }
}

/// A value that travels between ranks.
pub trait Message: Serialize + DeserializeOwned {
    /// Checks what the type promises beyond its encoding (array sizes, ranges).
    fn validate(&self) -> Result<()> {
        Ok(())
    }
}

/// Encodes a message.
pub fn encode<T: Message>(value: &T) -> Result<Vec<u8>> {
    postcard::to_stdvec(value).map_err(|e| Error::Message(format!("cannot encode: {e}")))
}

/// Decodes and validates a message written by [`encode`]; every byte must belong to it.
pub fn decode<T: Message>(bytes: &[u8]) -> Result<T> {
    let (value, rest): (T, &[u8]) =
        postcard::take_from_bytes(bytes).map_err(|e| Error::Message(e.to_string()))?;
    if !rest.is_empty() {
        return Err(Error::Message(format!("{} trailing bytes", rest.len())));
    }
    value.validate()?;
    Ok(value)
}

/// The frames of a job, as rank 0 decided them (after `--skip-existing`).
impl Message for Vec<ExtractRequest> {}

impl Message for GaussHermitePsf {
    fn validate(&self) -> Result<()> {
        GaussHermitePsf::validate(self)
    }
}

impl Message for PatchResult {
    fn validate(&self) -> Result<()> {
        if self.placed {
            return Err(Error::Message(format!(
                "patch {}: its values stayed in the arrays of the process that solved it",
                self.patch
            )));
        }
        let n = self.nfiber * self.nwave;
        let sizes = [
            ("flux", self.flux.len(), n),
            ("ivar", self.ivar.len(), n),
            ("pixmask fraction", self.pixmask_fraction.len(), n),
            ("chi2pix", self.chi2pix.len(), n),
            (
                "resolution",
                self.resolution.len(),
                n * (2 * self.ndiag + 1),
            ),
        ];
        for (what, len, expected) in sizes {
            if len != expected {
                return Err(Error::Message(format!(
                    "patch {}: {what} has {len} values for {expected} bins",
                    self.patch
                )));
            }
        }
        if let Some(m) = &self.model {
            if m.data.len() != m.rows.len() * m.cols.len() {
                return Err(Error::Message(format!(
                    "patch {}: model of {} values for a {} x {} box",
                    self.patch,
                    m.data.len(),
                    m.rows.len(),
                    m.cols.len()
                )));
            }
        }
        Ok(())
    }
}

/// What the reader broadcasts about a frame before its pixels.
#[derive(Debug, Serialize, Deserialize)]
pub struct FrameHeader {
    pub psf: GaussHermitePsf,
    /// The image with empty `pix` and `ivar`.
    pub image: Image,
    /// The barycentric correction factor of the extraction grid.
    pub heliocor: f64,
    /// The CCD rows and columns that the frame's patches can use: only these pixels travel.
    pub rows: Range<usize>,
    pub cols: Range<usize>,
    /// Seconds the reader spent reading the frame.
    pub read_s: f64,
}

impl FrameHeader {
    /// The header of a frame that was read, without its pixels.
    pub fn new(inputs: &Inputs, (rows, cols): (Range<usize>, Range<usize>), read_s: f64) -> Self {
        FrameHeader {
            psf: inputs.psf.clone(),
            image: inputs.image.without_pixels(),
            heliocor: inputs.heliocor,
            rows,
            cols,
            read_s,
        }
    }

    /// Number of pixels of each of the two f32 arrays that follow the header.
    pub fn npix(&self) -> usize {
        self.rows.len() * self.cols.len()
    }
}

impl Message for FrameHeader {
    fn validate(&self) -> Result<()> {
        self.psf.validate()?;
        let (nrows, ncols) = (self.image.nrows, self.image.ncols);
        let inside = |r: &Range<usize>, n: usize| r.start <= r.end && r.end <= n;
        if !inside(&self.rows, nrows) || !inside(&self.cols, ncols) {
            return Err(Error::Message(format!(
                "pixel box {:?} x {:?} outside the {nrows} x {ncols} image",
                self.rows, self.cols
            )));
        }
        if !(self.heliocor.is_finite() && self.heliocor > 0.0) {
            return Err(Error::Message(format!(
                "barycentric correction factor {}",
                self.heliocor
            )));
        }
        Ok(())
    }
}

/// What one worker returns to the writer for one frame.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub enum Contribution {
    /// The worker solved its patches (possibly none). The first worker also forwards the frame
    /// header as it was broadcast, so that a writer that did not read the frame can assemble
    /// and write it.
    Solved {
        header: Option<Vec<u8>>,
        results: Vec<PatchResult>,
        /// The frame's arrays, where a worker that solved the whole frame in the writer's
        /// process placed its results' values ([`PatchResult::placed`]); they never travel.
        #[serde(skip)]
        placed: Option<Box<FrameValues>>,
        /// Seconds spent receiving the inputs and solving.
        recv_s: f64,
        solve_s: f64,
    },
    /// The worker failed on this frame; it printed why.
    Failed,
    /// The reader could not read the frame; nothing was solved.
    Skipped,
}

impl Message for Contribution {
    fn validate(&self) -> Result<()> {
        if let Contribution::Solved { results, .. } = self {
            results.iter().try_for_each(Message::validate)?;
        }
        Ok(())
    }
}

/// Copies the box `rows x cols` of an image into a dense row-major buffer: what travels.
pub fn pack_box(image: ArrayView2<f32>, rows: &Range<usize>, cols: &Range<usize>) -> Vec<f32> {
    // A sliced view iterates in logical order: row by row, each row left to right.
    image
        .slice(s![rows.clone(), cols.clone()])
        .iter()
        .copied()
        .collect()
}

/// Copies a dense box buffer (from [`pack_box`]) back into its place in an image.
pub fn unpack_box(
    packed: &[f32],
    mut image: ArrayViewMut2<f32>,
    rows: &Range<usize>,
    cols: &Range<usize>,
) -> Result<()> {
    let packed = ArrayView2::from_shape((rows.len(), cols.len()), packed)
        .map_err(|e| Error::Message(format!("pixel box of {} values: {e}", packed.len())))?;
    image
        .slice_mut(s![rows.clone(), cols.clone()])
        .assign(&packed);
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::extract::{ModelPatch, PatchStatus};
    use std::path::PathBuf;

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
            rejected: ramp(0.5),
            nrejected: 3,
            nresolves: 1,
            placed: false,
            model: model.then(|| ModelPatch {
                rows: 10..12,
                cols: 4..7,
                data: vec![1.0, -0.0, f64::MIN_POSITIVE, 3.0, 4.0, 1e300],
            }),
        }
    }

    fn bits(v: &[f64]) -> Vec<u64> {
        v.iter().map(|x| x.to_bits()).collect()
    }

    #[test]
    fn patch_results_round_trip_bit_for_bit() {
        for original in [result(7, false), result(8, true)] {
            let back: PatchResult = decode(&encode(&original).unwrap()).unwrap();
            assert_eq!(back, original);
            assert_eq!(bits(&back.chi2pix), bits(&original.chi2pix));
            assert_eq!(bits(&back.resolution), bits(&original.resolution));
        }
    }

    #[test]
    fn truncated_or_inconsistent_results_are_errors() {
        let bytes = encode(&result(1, true)).unwrap();
        for cut in [0, 3, 10, bytes.len() - 1] {
            assert!(
                decode::<PatchResult>(&bytes[..cut]).is_err(),
                "cut at {cut}"
            );
        }
        let mut longer = bytes.clone();
        longer.push(0);
        assert!(decode::<PatchResult>(&longer).is_err());
        let mut wrong = result(1, true);
        wrong.nfiber = 6;
        let e = decode::<PatchResult>(&encode(&wrong).unwrap()).unwrap_err();
        assert!(
            e.to_string().contains("flux has 15 values for 18 bins"),
            "{e}"
        );
        let mut wrong = result(1, true);
        wrong.model.as_mut().unwrap().cols = 4..9;
        assert!(decode::<PatchResult>(&encode(&wrong).unwrap()).is_err());
        // a result whose values are in its own process's frame arrays cannot travel
        let mut placed = result(1, false);
        placed.placed = true;
        let e = decode::<PatchResult>(&encode(&placed).unwrap()).unwrap_err();
        assert!(e.to_string().contains("stayed in the arrays"), "{e}");
    }

    #[test]
    fn contributions_round_trip() {
        for c in [
            Contribution::Failed,
            Contribution::Skipped,
            Contribution::Solved {
                header: Some(vec![1, 2, 3]),
                results: vec![result(0, false), result(1, true)],
                placed: None,
                recv_s: 0.5,
                solve_s: 1.25,
            },
            Contribution::Solved {
                header: None,
                results: vec![],
                placed: None,
                recv_s: 0.0,
                solve_s: 0.0,
            },
        ] {
            assert_eq!(decode::<Contribution>(&encode(&c).unwrap()).unwrap(), c);
        }
        assert!(decode::<Contribution>(&[]).is_err());
        assert!(decode::<Contribution>(&[9]).is_err());
    }

    #[test]
    fn boxes_pack_and_unpack() {
        let image = ndarray::Array2::from_shape_fn((4, 5), |(r, c)| (r * 5 + c) as f32);
        let packed = pack_box(image.view(), &(1..3), &(2..4));
        assert_eq!(packed, vec![7.0, 8.0, 12.0, 13.0]);
        let mut back = ndarray::Array2::zeros((4, 5));
        unpack_box(&packed, back.view_mut(), &(1..3), &(2..4)).unwrap();
        assert_eq!(back.iter().filter(|&&v| v != 0.0).count(), 4);
        assert_eq!((back[[1, 2]], back[[2, 3]]), (7.0, 13.0));
        assert!(unpack_box(&packed[1..], back.view_mut(), &(1..3), &(2..4)).is_err());
    }

    #[test]
    fn frame_lists_round_trip() {
        let mut second = ExtractRequest::new("a", "", "12345678");
        second.model = Some(PathBuf::from("m.fits"));
        second.wavelength = Some((5760.0, 7620.0, 0.8));
        let frames = vec![
            ExtractRequest::new(
                "preproc-r0-00001234.fits",
                "psf é.fits",
                "out/frame-r0-00001234.fits",
            ),
            second,
        ];
        let back: Vec<ExtractRequest> = decode(&encode(&frames).unwrap()).unwrap();
        assert_eq!(back, frames);
    }

    #[test]
    fn paths_that_are_not_utf8_travel_byte_for_byte() {
        use std::os::unix::ffi::OsStringExt;
        let latin1 = |name: &[u8]| PathBuf::from(std::ffi::OsString::from_vec(name.to_vec()));
        let mut request = ExtractRequest::new(
            latin1(b"d\xe9/in\xff.fits"),
            latin1(b"psf\xe9.fits"),
            latin1(b"out\xe9.fits"),
        );
        request.model = Some(latin1(b"m\xe9.fits"));
        let frames = vec![request];
        let back: Vec<ExtractRequest> = decode(&encode(&frames).unwrap()).unwrap();
        assert_eq!(back, frames);
        let mut image = test_image();
        image.path = latin1(b"in\xff.fits");
        let header = FrameHeader::new(&inputs(&test_psf(), &image), (1..3, 0..2), 0.5);
        let h: FrameHeader = decode(&encode(&header).unwrap()).unwrap();
        assert_eq!(h.image.path, image.path);
    }

    fn test_psf() -> GaussHermitePsf {
        let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/data");
        GaussHermitePsf::read(&dir.join("psf-r0-00067784.fits")).unwrap()
    }

    fn inputs(psf: &GaussHermitePsf, image: &Image) -> Inputs {
        Inputs {
            psf: psf.clone(),
            image: image.clone(),
            heliocor: 1.0 + 1e-5,
            traces: None,
        }
    }

    fn test_image() -> Image {
        let mut image = Image {
            path: "in.fits".into(),
            nrows: 3,
            ncols: 2,
            ..Image::default()
        };
        image.header = vec!["EXPID   =                 1234".into(), "".into()];
        image.has_fibermap = true;
        image.nmasked = 2;
        image
    }

    #[test]
    fn psf_and_frame_header_round_trip() {
        let (psf, image) = (test_psf(), test_image());
        let header = FrameHeader::new(&inputs(&psf, &image), (1..3, 0..2), 0.5);
        let h: FrameHeader = decode(&encode(&header).unwrap()).unwrap();
        assert_eq!((h.rows.clone(), h.cols.clone()), (1..3, 0..2));
        assert_eq!(h.npix(), 4);
        assert_eq!(h.image.header, image.header);
        assert_eq!(h.read_s, 0.5);
        assert!(h.image.has_fibermap && h.image.pix.is_empty());
        assert_eq!(
            (h.psf.nfiber, h.psf.hsizey, h.psf.psferr),
            (psf.nfiber, psf.hsizey, psf.psferr)
        );
        for fiber in [0, 7, psf.nfiber - 1] {
            for wave in [6000.0, 6200.3, 6400.0] {
                assert_eq!(h.psf.params(fiber, wave), psf.params(fiber, wave));
            }
        }
    }

    #[test]
    fn frame_headers_are_checked_like_files() {
        let (psf, image) = (test_psf(), test_image());
        let outside = FrameHeader::new(&inputs(&psf, &image), (1..4, 0..2), 0.5);
        assert!(decode::<FrameHeader>(&encode(&outside).unwrap()).is_err());
        // A PSF that its file reader would refuse is refused in a message too.
        let mut bad = FrameHeader::new(&inputs(&psf, &image), (1..3, 0..2), 0.5);
        bad.psf.gh.pop();
        let e = decode::<FrameHeader>(&encode(&bad).unwrap()).unwrap_err();
        assert!(e.to_string().contains("Gauss-Hermite"), "{e}");
        let mut bad = FrameHeader::new(&inputs(&psf, &image), (1..3, 0..2), 0.5);
        bad.psf.xtrace.coeff[3] = f64::NAN;
        assert!(decode::<FrameHeader>(&encode(&bad).unwrap()).is_err());
    }
}
