//! Reading the pixels of image HDUs, whole or by row ranges on many threads at once (each
//! range through a read-only handle of its own, which cfitsio shares with nothing).

use std::ffi::c_void;

use fitsio::sys;
use rayon::prelude::*;

use super::{Element, Fits};
use crate::error::Result;

impl Fits {
    /// The shape of the current image and its number of pixels.
    fn image_size(&mut self) -> Result<(Vec<usize>, usize)> {
        let shape = self.image_shape()?;
        let n = shape
            .iter()
            .try_fold(1usize, |a, &b| a.checked_mul(b))
            .ok_or_else(|| {
                self.error("cannot read image", format!("shape {shape:?} is too large"))
            })?;
        Ok((shape, n))
    }

    /// Reads the whole current image, converted to `T`, in C order. Undefined pixels
    /// (BLANK, or the NaNs of a tile-compressed floating image) read as [`Element::UNDEFINED`].
    pub fn read_image<T: Element>(&mut self) -> Result<(Vec<usize>, Vec<T>)> {
        let (shape, n) = self.image_size()?;
        let mut data = self.buffer::<T>(n, "cannot read image")?;
        self.read_pixels(0, &mut data)?;
        Ok((shape, data))
    }

    /// [`Fits::read_image`] of HDU `extname` of the file that `open` opens, by row ranges
    /// read at once through handles of their own: decompressing a tile-compressed DESI image
    /// is what takes the time, and cfitsio opens a file again for each read-only handle, so
    /// that the handles share nothing.
    pub fn read_image_parallel<T: Element + Send>(
        open: &(dyn Fn() -> Result<Fits> + Sync),
        extname: &str,
        pieces: usize,
    ) -> Result<(Vec<usize>, Vec<T>)> {
        let mut fits = open()?;
        fits.move_to(extname)?;
        let (shape, n) = fits.image_size()?;
        let mut data = fits.buffer::<T>(n, "cannot read image")?;
        drop(fits);
        let rows = shape.first().copied().unwrap_or(0).max(1);
        let row_len = n / rows;
        let piece = rows.div_ceil(pieces.max(1)).max(1) * row_len;
        if piece == 0 {
            return Ok((shape, data));
        }
        data.par_chunks_mut(piece)
            .enumerate()
            .try_for_each(|(k, part)| {
                let mut fits = open()?;
                fits.move_to(extname)?;
                fits.read_pixels(k * piece, part)
            })?;
        Ok((shape, data))
    }

    /// Reads `out.len()` pixels of the current image from pixel `first` (0-based, C order).
    fn read_pixels<T: Element>(&mut self, first: usize, out: &mut [T]) -> Result<()> {
        if out.is_empty() {
            return Ok(());
        }
        let mut undefined = T::UNDEFINED;
        let mut anynul = 0;
        // SAFETY: `out` holds `out.len()` elements of the type DATATYPE names, `undefined` is
        // of that type too, and both outlive the call.
        self.call("cannot read image", |ptr, status| unsafe {
            sys::ffgpv(
                ptr,
                T::DATATYPE,
                first as i64 + 1,
                out.len() as i64,
                &mut undefined as *mut T as *mut c_void,
                out.as_mut_ptr() as *mut c_void,
                &mut anynul,
                status,
            );
        })
    }
}
