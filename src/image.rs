//! The preproc image: pixels, inverse variance and mask of one CCD frame (desispec's
//! `preproc-*.fits`), with the IMAGE header that is carried into the output frame.

use std::mem::MaybeUninit;
use std::path::{Path, PathBuf};

use ndarray::Array2;
use rayon::prelude::*;
use serde::{Deserialize, Serialize};

use crate::error::{Error, Result};
use crate::fits::{inflate_gzip, is_gzip, Fits, KeepAlive};

/// Which MASK bits make a pixel unusable.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum MaskRule {
    /// Any nonzero MASK value (gpu_specter's rule, the default).
    AnyBit,
    /// Only these bits (desispec production uses 767, which keeps BADREADNOISE pixels).
    Bits(u32),
}

impl MaskRule {
    /// The MASK bits that reject a pixel (any bit: all of them).
    fn bits(self) -> u32 {
        match self {
            MaskRule::AnyBit => u32::MAX,
            MaskRule::Bits(bits) => bits,
        }
    }
}

/// A CCD frame ready for extraction: `ivar` is zero wherever the pixel must not be used.
#[derive(Clone, Debug, Default, Serialize, Deserialize)]
pub struct Image {
    #[serde(with = "crate::parallel::messages::path_bytes")]
    pub path: PathBuf,
    /// The CCD shape, known even when the pixel arrays are not (see [`Image::without_pixels`]).
    pub nrows: usize,
    pub ncols: usize,
    /// Pixel values `[row, col]`, in standard (row-major) layout so that a row range is one
    /// contiguous slice. Never serialized: pixels travel as a box of their own.
    #[serde(skip)]
    pub pix: Array2<f32>,
    /// Inverse variance `[row, col]`, zero for masked pixels; same layout as `pix`.
    #[serde(skip)]
    pub ivar: Array2<f32>,
    /// Header cards of the IMAGE HDU (structural cards removed).
    pub header: Vec<String>,
    /// Whether the file has a FIBERMAP table to pass through.
    pub has_fibermap: bool,
    /// Pixels whose MASK rejected them.
    pub nmasked: usize,
    /// Pixels rejected because IMAGE or IVAR was NaN, infinite or (IVAR) negative.
    pub nnonfinite: usize,
    /// The FIBERMAP of a gzip-compressed file as a file of its own, held with the image so
    /// that the frame's later reads of it do not inflate the file again (`Fits::keep_part`).
    #[serde(skip)]
    pub kept_fibermap: KeepAlive,
}

/// Rows of IMAGE, IVAR and MASK read and masked together: three bands of a preproc's 4114
/// columns take 1.6 MB, within a core's L2 cache, so that the mask is applied to values
/// still in cache (a separate pass over the whole frame's arrays took, under a GPU run's
/// load, a tenth of its CPU time).
const BAND_ROWS: usize = 32;

/// IMAGE and IVAR of a preproc, the mask rule applied.
struct Masked {
    pix: Vec<f32>,
    ivar: Vec<f32>,
    nmasked: usize,
    nnonfinite: usize,
}

/// Reads IMAGE and IVAR of the file `open` opens, `(nrows, ncols)` each, and applies `rule`
/// with its MASK: rows split between `tasks` tasks on rayon's pool, each reading its rows
/// band by band through handles of its own.
fn read_masked(
    open: &(dyn Fn() -> Result<Fits> + Sync),
    (nrows, ncols): (usize, usize),
    tasks: usize,
    rule: MaskRule,
) -> Result<Masked> {
    let n = nrows * ncols;
    let fits = open()?;
    let mut pix = fits.uninit_buffer::<f32>(n, "cannot read IMAGE")?;
    let mut ivar = fits.uninit_buffer::<f32>(n, "cannot read IVAR")?;
    drop(fits);
    let part = nrows.div_ceil(tasks.max(1)).max(1) * ncols;
    let (nmasked, nnonfinite) = if part == 0 {
        (0, 0)
    } else {
        pix.spare_capacity_mut()[..n]
            .par_chunks_mut(part)
            .zip(ivar.spare_capacity_mut()[..n].par_chunks_mut(part))
            .enumerate()
            .map(|(k, (pix, ivar))| read_rows(open, k * part, ncols, (pix, ivar), rule))
            .try_reduce(|| (0, 0), |a, b| Ok((a.0 + b.0, a.1 + b.1)))?
    };
    // SAFETY: the parts covered all `n` values of both (n = nrows * ncols), and each was
    // written by a read that succeeded.
    unsafe {
        pix.set_len(n);
        ivar.set_len(n);
    }
    Ok(Masked {
        pix,
        ivar,
        nmasked,
        nnonfinite,
    })
}

/// [`read_masked`]'s task: the values from `first` into `pix` and `ivar`, band by band.
fn read_rows(
    open: &(dyn Fn() -> Result<Fits> + Sync),
    first: usize,
    ncols: usize,
    (pix, ivar): (&mut [MaybeUninit<f32>], &mut [MaybeUninit<f32>]),
    rule: MaskRule,
) -> Result<(usize, usize)> {
    let hdu = |name: &str| -> Result<Fits> {
        let mut fits = open()?;
        fits.move_to(name)?;
        Ok(fits)
    };
    let (mut image, mut weights, mut mask) = (hdu("IMAGE")?, hdu("IVAR")?, hdu("MASK")?);
    let mut bits = MaskBand::new(&mut mask)?;
    let band = BAND_ROWS * ncols;
    let mut counts = (0, 0);
    for (b, (p, v)) in pix.chunks_mut(band).zip(ivar.chunks_mut(band)).enumerate() {
        let at = first + b * band;
        let p = image.read_into(at, p)?;
        let v = weights.read_into(at, v)?;
        let m = bits.read(&mut mask, at, p.len())?;
        let (masked, nonfinite) = mask_chunk(p, v, m, rule.bits());
        counts = (counts.0 + masked, counts.1 + nonfinite);
    }
    Ok(counts)
}

/// An error unless the data of the current HDU `name` lie within the file's `size` bytes
/// (when known), its last record's padding aside: a truncated preproc is said to be one before
/// any of its HDUs is read.
fn complete(fits: &mut Fits, path: &Path, name: &str, size: Option<usize>) -> Result<()> {
    let Some(size) = size else { return Ok(()) };
    let (_, _, end) = fits.hdu_addresses()?;
    if size + crate::fits::RECORD > end {
        return Ok(());
    }
    Err(Error::Image {
        path: path.into(),
        message: format!(
            "cannot read image: HDU {name} ends at byte {end} of a file of {size} bytes \
             (truncated?)"
        ),
    })
}

/// A band of MASK as integers, in buffers kept from band to band. A floating-point MASK
/// (not what desispec writes, but a FITS file may hold one) is read as float64, which holds
/// every 32-bit integer exactly, and its NaN or infinite pixels get every bit set: converted
/// as cfitsio converts them, they would read as 0, unmasked.
struct MaskBand {
    float: bool,
    bits: Vec<i32>,
    values: Vec<f64>,
}

impl MaskBand {
    fn new(mask: &mut Fits) -> Result<Self> {
        Ok(MaskBand {
            float: mask.image_is_float()?,
            bits: Vec::new(),
            values: Vec::new(),
        })
    }

    /// `len` values of `mask` from value `first`.
    fn read(&mut self, mask: &mut Fits, first: usize, len: usize) -> Result<&[i32]> {
        self.bits.clear();
        self.bits.reserve(len);
        if !self.float {
            return Ok(mask.read_into(first, &mut self.bits.spare_capacity_mut()[..len])?);
        }
        self.values.clear();
        self.values.reserve(len);
        let values = mask.read_into(first, &mut self.values.spare_capacity_mut()[..len])?;
        let as_bits = |m: &f64| if m.is_finite() { *m as i64 as i32 } else { -1 };
        self.bits.extend(values.iter().map(as_bits));
        Ok(&self.bits)
    }
}

/// Zeroes the inverse variance of the pixels the mask rules out, and both values of the
/// pixels that are not finite or have a negative inverse variance; returns the numbers of
/// each (17 million pixels per DESI frame: in parallel, by rows of 64 KiB).
fn apply_mask(pix: &mut [f32], ivar: &mut [f32], mask: &[i32], rule: MaskRule) -> (usize, usize) {
    const CHUNK: usize = 16384;
    pix.par_chunks_mut(CHUNK)
        .zip(ivar.par_chunks_mut(CHUNK))
        .zip(mask.par_chunks(CHUNK))
        .map(|((pix, ivar), mask)| mask_chunk(pix, ivar, mask, rule.bits()))
        .reduce(|| (0, 0), |a, b| (a.0 + b.0, a.1 + b.1))
}

/// [`apply_mask`] on one chunk, `bits` the MASK bits that reject a pixel: the counts of
/// masked and non-finite pixels. Written without branches, its tests on the values' bits
/// and its counts in 32 bits (a chunk is a band of rows), so that the compiler runs it in
/// SIMD lanes: a preproc's 17 million pixels one at a time took 40% of its read's CPU time.
fn mask_chunk(pix: &mut [f32], ivar: &mut [f32], mask: &[i32], bits: u32) -> (usize, usize) {
    const EXPONENT: u32 = 0x7f80_0000;
    let (mut nmasked, mut nnonfinite) = (0u32, 0u32);
    for ((p, v), &m) in pix.iter_mut().zip(ivar.iter_mut()).zip(mask) {
        let (pb, vb) = (p.to_bits(), v.to_bits());
        // finite: an exponent that is not all ones; an ivar of -0 counts as 0, any other
        // sign bit (a negative ivar or a NaN's) rejects the pixel
        let pix_finite = pb & EXPONENT != EXPONENT;
        let ivar_usable = (vb & EXPONENT != EXPONENT) & ((vb >> 31 == 0) | (vb << 1 == 0));
        let nonfinite = !(pix_finite & ivar_usable);
        let masked = !nonfinite & ((m as u32) & bits != 0);
        *p = f32::from_bits(if nonfinite { 0 } else { pb });
        *v = f32::from_bits(if nonfinite | masked { 0 } else { vb });
        nnonfinite += u32::from(nonfinite);
        nmasked += u32::from(masked);
    }
    (nmasked as usize, nnonfinite as usize)
}

impl Image {
    /// Everything but the pixel arrays, which stay empty: what other ranks are told of an
    /// image before its pixels follow.
    pub fn without_pixels(&self) -> Image {
        Image {
            path: self.path.clone(),
            header: self.header.clone(),
            pix: Array2::default((0, 0)),
            ivar: Array2::default((0, 0)),
            kept_fibermap: KeepAlive::default(),
            ..*self
        }
    }

    /// Reads IMAGE, IVAR and MASK (plain or tile-compressed) and applies the mask rule.
    ///
    /// The rows are split between the rank's threads, each reading the three HDUs of its rows
    /// band by band through file handles of its own (cfitsio is built reentrant and shares
    /// nothing between read-only handles): reading a frame is mostly decompression (DESI's
    /// preprocs are tile-compressed) or byte swapping, and it limits a node's throughput once
    /// extraction runs on GPUs.
    pub fn read(path: &Path, rule: MaskRule) -> Result<Self> {
        // A gzip-compressed file is inflated once, here; while the image holds the bytes,
        // every handle `Fits::open` gives on the file reads them.
        let gzip = is_gzip(path);
        let inflated = if gzip { inflate_gzip(path)? } else { None };
        let open = || Fits::open(path);
        let mut fits = open()?;
        fits.move_to("IMAGE")?;
        let header = fits
            .cards()?
            .into_iter()
            .filter(|c| !crate::fits::is_structural_card(c))
            .collect();
        let shape = fits.image_shape()?;
        if shape.len() != 2 || shape[0] == 0 || shape[1] == 0 {
            return Err(Error::Image {
                path: path.into(),
                message: format!("IMAGE has shape {shape:?}, expected a 2-D image"),
            });
        }
        // cfitsio inflates a gzip-compressed file whole for every handle that opens it: one
        // handle per HDU for one that could not be inflated here.
        let pieces = if gzip && inflated.is_none() {
            1
        } else {
            rayon::current_num_threads()
        };
        let size = match &inflated {
            Some(bytes) => Some(bytes.len()),
            None if gzip => None,
            None => std::fs::metadata(path).ok().map(|m| m.len() as usize),
        };
        for name in ["IMAGE", "IVAR", "MASK"] {
            fits.move_to(name)?;
            complete(&mut fits, path, name, size)?;
            let s = fits.image_shape()?;
            if s != shape {
                return Err(Error::Image {
                    path: path.into(),
                    message: format!("{name} has shape {s:?} but IMAGE has {shape:?}"),
                });
            }
        }
        let dim = (shape[0], shape[1]);
        let Masked {
            pix,
            ivar,
            nmasked,
            nnonfinite,
        } = read_masked(&open, dim, pieces, rule)?;
        let has_fibermap = fits.has_hdu("FIBERMAP");
        // Only the FIBERMAP is read again (by the frame's writer): the rest of an inflated
        // file is let go with this call.
        let kept = match (&inflated, has_fibermap) {
            (Some(_), true) => fits.keep_part("FIBERMAP")?,
            _ => KeepAlive::default(),
        };
        if nnonfinite > 0 {
            tracing::warn!(
                "{}: {nnonfinite} pixels with non-finite IMAGE/IVAR or negative IVAR treated as masked",
                path.display()
            );
        }
        let as_array = |v: Vec<f32>| {
            Array2::from_shape_vec(dim, v).map_err(|e| Error::Image {
                path: path.into(),
                message: format!("pixel count does not match the shape {shape:?}: {e}"),
            })
        };
        Ok(Image {
            path: path.into(),
            nrows: shape[0],
            ncols: shape[1],
            pix: as_array(pix)?,
            ivar: as_array(ivar)?,
            header,
            has_fibermap,
            nmasked,
            nnonfinite,
            kept_fibermap: kept,
        })
    }
}

impl Image {
    /// An image a host process holds in memory (numpy arrays in Python), named `label` in
    /// messages: the mask rule applied to `mask` as [`Image::read`] applies it to MASK, and
    /// non-finite pixels treated the same way. Without a mask, only non-finite pixels are
    /// rejected.
    pub fn from_arrays(
        label: impl Into<PathBuf>,
        mut pix: Array2<f32>,
        mut ivar: Array2<f32>,
        mask: Option<&[i32]>,
        rule: MaskRule,
    ) -> Result<Self> {
        let path = label.into();
        let shape = pix.dim();
        if ivar.dim() != shape || mask.is_some_and(|m| m.len() != shape.0 * shape.1) {
            return Err(Error::Image {
                path,
                message: format!("image, ivar and mask differ in shape (image {shape:?})"),
            });
        }
        let (Some(p), Some(v)) = (pix.as_slice_mut(), ivar.as_slice_mut()) else {
            return Err(Error::Internal(
                "image arrays not in standard layout".into(),
            ));
        };
        let zeros;
        let mask = match mask {
            Some(m) => m,
            None => {
                zeros = vec![0; p.len()];
                &zeros
            }
        };
        let (nmasked, nnonfinite) = apply_mask(p, v, mask, rule);
        Ok(Image {
            path,
            nrows: shape.0,
            ncols: shape.1,
            pix,
            ivar,
            header: Vec::new(),
            has_fibermap: false,
            nmasked,
            nnonfinite,
            kept_fibermap: KeepAlive::default(),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_gzip_compressed_preproc_reads_as_the_plain_one() {
        // One handle per HDU for a file cfitsio must inflate, row ranges for the others: the
        // same pixels either way.
        let dir = tempfile::tempdir().unwrap();
        let (plain, gz) = (dir.path().join("p.fits"), dir.path().join("p.fits.gz"));
        let pix = [1.0, 2.0, 3.0, 4.0, 5.0, 6.0];
        let ivar = [1.0, 0.5, 0.25, 2.0, 1.0, 4.0];
        let mask = [0, 0, 0, 0, 256, 8];
        write(&plain, &pix, &ivar, &mask);
        write(&gz, &pix, &ivar, &mask);
        assert!(is_gzip(&gz) && !is_gzip(&plain));
        let (a, b) = (
            Image::read(&plain, MaskRule::Bits(767)).unwrap(),
            Image::read(&gz, MaskRule::Bits(767)).unwrap(),
        );
        assert!(a.pix == b.pix && a.ivar == b.ivar);
        assert_eq!(b.pix.as_slice().unwrap(), &pix);
    }

    #[test]
    fn a_compressed_preproc_keeps_only_its_fibermap_once_read() {
        let dir = tempfile::tempdir().unwrap();
        let gz = dir.path().join("f.fits.gz");
        let pix = [1.0f32; 6];
        let mut f = Fits::create(&gz).unwrap();
        f.write_image("IMAGE", &[2, 3], &pix).unwrap();
        f.write_image("IVAR", &[2, 3], &pix).unwrap();
        f.write_image("MASK", &[2, 3], &[0i32; 6]).unwrap();
        f.write_image("EXTRA", &[100, 100], &[2f32; 10_000])
            .unwrap();
        f.create_table("FIBERMAP", &[("FIBER", "1J")], 3).unwrap();
        f.write_column("FIBER", &[7i32, 8, 9]).unwrap();
        f.close().unwrap();
        let image = Image::read(&gz, MaskRule::AnyBit).unwrap();
        assert!(image.has_fibermap);
        // a bare primary HDU and the table's header and data: three FITS records
        let kept = image.kept_fibermap.0.as_ref().expect("the FIBERMAP kept");
        assert_eq!(kept.len(), 3 * crate::fits::RECORD);
        let mut fibermap = Fits::open_part(&gz, "FIBERMAP").unwrap();
        assert_eq!(fibermap.column::<i64>("FIBER").unwrap().1, [7, 8, 9]);
        // without a FIBERMAP, nothing is kept
        write(&gz, &pix, &pix, &[0; 6]);
        let image = Image::read(&gz, MaskRule::AnyBit).unwrap();
        assert!(!image.has_fibermap && image.kept_fibermap.0.is_none());
    }

    fn write(path: &Path, pix: &[f32], ivar: &[f32], mask: &[i32]) {
        let mut f = Fits::create(path).unwrap();
        f.write_image("IMAGE", &[2, 3], pix).unwrap();
        f.write_key_str("CAMERA", "b1", "").unwrap();
        f.write_image("IVAR", &[2, 3], ivar).unwrap();
        f.write_image("MASK", &[2, 3], mask).unwrap();
        f.close().unwrap();
    }

    #[test]
    fn masks_and_non_finite_pixels_zero_the_weights() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("img.fits");
        let pix = [1.0, f32::NAN, 3.0, 4.0, 5.0, 6.0];
        let ivar = [1.0, 1.0, f32::INFINITY, -1.0, 1.0, 1.0];
        let mask = [0, 0, 0, 0, 256, 8];
        write(&path, &pix, &ivar, &mask);

        let any = Image::read(&path, MaskRule::AnyBit).unwrap();
        assert_eq!((any.nrows, any.ncols), (2, 3));
        assert_eq!(any.ivar, ndarray::array![[1.0, 0.0, 0.0], [0.0, 0.0, 0.0]]);
        assert_eq!(any.pix[[0, 1]], 0.0, "NaN pixel replaced");
        assert_eq!((any.nnonfinite, any.nmasked), (3, 2));
        assert!(any.header.iter().any(|c| c.starts_with("CAMERA")));
        assert!(!any.header.iter().any(|c| c.starts_with("NAXIS")));
        assert!(!any.has_fibermap);

        // desispec's production rule keeps BADREADNOISE (256) pixels
        let prod = Image::read(&path, MaskRule::Bits(767)).unwrap();
        assert_eq!(prod.ivar, ndarray::array![[1.0, 0.0, 0.0], [0.0, 1.0, 0.0]]);
    }

    /// Reads a 100 x 7 image in bands of rows split between 1, 3 and 16 tasks (rayon pools
    /// of those sizes), with an integer and a floating-point MASK: every pixel as
    /// [`apply_mask`] treats the whole arrays.
    #[test]
    fn bands_of_rows_on_any_number_of_tasks_mask_every_pixel() {
        let (nrows, ncols) = (100, 7);
        let n = nrows * ncols;
        let pix: Vec<f32> = (0..n)
            .map(|i| if i % 41 == 3 { f32::NAN } else { i as f32 })
            .collect();
        let ivar: Vec<f32> = (0..n)
            .map(|i| match i % 53 {
                5 => f32::INFINITY,
                6 => -1.0,
                _ => 1.0 + i as f32,
            })
            .collect();
        let mask: Vec<i32> = (0..n).map(|i| [0, 0, 256, 8, 0][i % 5]).collect();
        let (mut p, mut v) = (pix.clone(), ivar.clone());
        let counts = apply_mask(&mut p, &mut v, &mask, MaskRule::Bits(767));
        assert!(counts.0 > 0 && counts.1 > 0);
        let dir = tempfile::tempdir().unwrap();
        let (ints, floats) = (dir.path().join("i.fits"), dir.path().join("f.fits"));
        let mut f = Fits::create(&ints).unwrap();
        f.write_image("IMAGE", &[nrows, ncols], &pix).unwrap();
        f.write_image("IVAR", &[nrows, ncols], &ivar).unwrap();
        f.write_image("MASK", &[nrows, ncols], &mask).unwrap();
        f.close().unwrap();
        // the same bits as float64, and a NaN that rejects its pixel
        let mut fmask: Vec<f64> = mask.iter().map(|&m| m as f64).collect();
        fmask[1] = f64::NAN;
        let mut f = Fits::create(&floats).unwrap();
        f.write_image("IMAGE", &[nrows, ncols], &pix).unwrap();
        f.write_image("IVAR", &[nrows, ncols], &ivar).unwrap();
        f.write_image("MASK", &[nrows, ncols], &fmask).unwrap();
        f.close().unwrap();
        for threads in [1, 3, 16] {
            let pool = rayon::ThreadPoolBuilder::new()
                .num_threads(threads)
                .build()
                .unwrap();
            let img = pool.install(|| Image::read(&ints, MaskRule::Bits(767)).unwrap());
            assert_eq!(img.pix.as_slice().unwrap(), &p[..], "{threads} tasks");
            assert_eq!(img.ivar.as_slice().unwrap(), &v[..], "{threads} tasks");
            assert_eq!((img.nmasked, img.nnonfinite), counts);
            let img = pool.install(|| Image::read(&floats, MaskRule::Bits(767)).unwrap());
            assert_eq!(img.ivar[[0, 1]], 0.0, "NaN MASK value rejects its pixel");
            assert_eq!(img.ivar.as_slice().unwrap()[2..], v[2..]);
            assert_eq!(img.nmasked, counts.0 + 1);
        }
    }

    #[test]
    fn compressed_reference_image_reads_with_its_fibermap() {
        let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/data/preproc-bundle0.fits");
        let img = Image::read(&path, MaskRule::AnyBit).unwrap();
        assert_eq!((img.nrows, img.ncols), (4128, 4114));
        assert!(img.has_fibermap);
        assert!(img.nmasked > 0);
        assert!(!img
            .header
            .iter()
            .any(|c| c.starts_with("ZIMAGE") || c.starts_with("ZBITPIX")));
    }

    /// Writes IMAGE (NaN where `is_nan(row, col)`), IVAR and MASK as tile-compressed HDUs
    /// (cfitsio's default: quantized RICE for floating images, one tile per row).
    fn write_compressed_with_nans(
        path: &Path,
        (nrows, ncols): (usize, usize),
        is_nan: impl Fn(usize, usize) -> bool,
    ) {
        use fitsio::images::{ImageDescription, ImageType};
        let mut pix: Vec<f32> = (0..nrows * ncols)
            .map(|i| match is_nan(i / ncols, i % ncols) {
                true => f32::NAN,
                false => 100.0 + (i % 17) as f32,
            })
            .collect();
        let name = format!("{}[compress]", path.display());
        let mut f = fitsio::FitsFile::create(&name).open().unwrap();
        for (extname, kind) in [
            ("IMAGE", ImageType::Float),
            ("IVAR", ImageType::Float),
            ("MASK", ImageType::Long),
        ] {
            let desc = ImageDescription {
                data_type: kind,
                dimensions: &[nrows, ncols],
            };
            let hdu = f.create_image(extname, &desc).unwrap();
            match extname {
                "MASK" => hdu.write_image(&mut f, &vec![0i32; nrows * ncols]).unwrap(),
                "IVAR" => hdu
                    .write_image(&mut f, &vec![1.0f32; nrows * ncols])
                    .unwrap(),
                _ => write_with_nulls(&mut f, &mut pix),
            }
        }
    }

    /// Writes a float image the way fpack and astropy do: NaNs become cfitsio's null value,
    /// which the compressed tiles store as ZBLANK (a plain write would quantize them).
    fn write_with_nulls(f: &mut fitsio::FitsFile, pix: &mut [f32]) {
        const FLOAT_NULL: f32 = -9.11912e-36;
        for p in pix.iter_mut().filter(|p| p.is_nan()) {
            *p = FLOAT_NULL;
        }
        let mut status = 0;
        // SAFETY: an open file positioned on the image just created, `pix` alive and of its
        // size.
        unsafe {
            fitsio::sys::ffppne(
                f.as_raw(),
                1,
                1,
                pix.len() as i64,
                pix.as_mut_ptr(),
                FLOAT_NULL,
                &mut status,
            )
        };
        assert_eq!(status, 0);
    }

    /// A block of 2000 x 200 NaNs fills whole tiles, which cfitsio reads as zeros unless it
    /// is given a null value; the rows below it hold NaNs in part of their tile.
    #[test]
    fn every_nan_of_a_large_block_in_a_compressed_image_is_flagged() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("nan-block.fits");
        let shape = (2100, 200);
        let in_block = |r: usize, c: usize| r < 2000 || (r < 2050 && c < 80);
        write_compressed_with_nans(&path, shape, in_block);
        let mut f = Fits::open(&path).unwrap();
        f.move_to("IMAGE").unwrap();
        assert_eq!(f.key_str("ZCMPTYPE").unwrap().as_deref(), Some("RICE_1"));

        let img = Image::read(&path, MaskRule::AnyBit).unwrap();
        assert_eq!(img.nnonfinite, 2000 * 200 + 50 * 80);
        for r in 0..shape.0 {
            for c in 0..shape.1 {
                assert_eq!(img.ivar[[r, c]] == 0.0, in_block(r, c), "pixel ({r}, {c})");
                assert!(img.pix[[r, c]].is_finite());
            }
        }
    }
}
