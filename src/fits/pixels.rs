//! Reading the pixels of image HDUs, whole or by ranges of values: a reader that splits an
//! image between threads reads each range through a read-only handle of its own, which
//! cfitsio shares with nothing.

use std::ffi::c_void;
use std::mem::MaybeUninit;

use fitsio::sys;

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
        let check = self.may_hold_undefined()?;
        let mut data = self.uninit_buffer::<T>(n, "cannot read image")?;
        self.read_pixels(0, &mut data.spare_capacity_mut()[..n], check)?;
        // SAFETY: the read that succeeded wrote all `n` values.
        unsafe { data.set_len(n) };
        Ok((shape, data))
    }

    /// Reads `out.len()` values of the current image from value `first` (0-based, C order)
    /// into `out` and returns them, undefined pixels as [`Fits::read_image`] gives them: a
    /// band of rows of an image read band by band into a buffer of the whole.
    pub fn read_into<'a, T: Element>(
        &mut self,
        first: usize,
        out: &'a mut [MaybeUninit<T>],
    ) -> Result<&'a mut [T]> {
        let check = self.may_hold_undefined()?;
        self.read_pixels(first, out, check)?;
        // SAFETY: the read that succeeded wrote every value of `out`, whose elements have
        // the layout of `T`.
        Ok(unsafe { &mut *(out as *mut [MaybeUninit<T>] as *mut [T]) })
    }

    /// Whether the current image holds floating-point values (BITPIX, or ZBITPIX of a
    /// tile-compressed image, negative).
    pub fn image_is_float(&mut self) -> Result<bool> {
        let mut bitpix = 0;
        // SAFETY: a valid handle on an image HDU; one out-parameter.
        self.call("cannot read the image type", |ptr, status| unsafe {
            sys::ffgidt(ptr, &mut bitpix, status);
        })?;
        Ok(bitpix < 0)
    }

    /// Whether cfitsio must look for undefined pixels in the current image: a tile-compressed
    /// image (whose undefined pixels read as 0 unless asked for) or one of integers (BLANK).
    /// A plain floating-point image needs no look: its undefined pixels are NaN and stay NaN
    /// as read, and cfitsio's pass over every value to find them took a fifth of the time of
    /// reading a preproc image (`cargo bench --bench frame`).
    fn may_hold_undefined(&mut self) -> Result<bool> {
        let mut bitpix = 0;
        // SAFETY: a valid handle on an image HDU; one out-parameter.
        self.call("cannot read the image type", |ptr, status| unsafe {
            sys::ffgidt(ptr, &mut bitpix, status);
        })?;
        let mut compressed = 0;
        // SAFETY: as above; the function only reads the HDU's header.
        self.call("cannot read the image type", |ptr, status| unsafe {
            compressed = sys::fits_is_compressed_image(ptr, status);
        })?;
        Ok(compressed != 0 || bitpix > 0)
    }

    /// [`Fits::read_image`] of HDU `extname` of the file that `open` opens, by `pieces` row
    /// ranges each read with [`Fits::read_into`] through a handle of its own, as the readers
    /// of a preproc split it between their threads.
    #[cfg(test)]
    pub(crate) fn read_image_in_pieces<T: Element>(
        open: &(dyn Fn() -> Result<Fits> + Sync),
        extname: &str,
        pieces: usize,
    ) -> Result<(Vec<usize>, Vec<T>)> {
        let mut fits = open()?;
        fits.move_to(extname)?;
        let (shape, n) = fits.image_size()?;
        let rows = shape.first().copied().unwrap_or(0).max(1);
        let piece = (rows.div_ceil(pieces.max(1)) * (n / rows)).max(1);
        let mut data = Vec::with_capacity(n);
        for first in (0..n).step_by(piece) {
            let len = piece.min(n - first);
            let mut part = Vec::with_capacity(len);
            let mut fits = open()?;
            fits.move_to(extname)?;
            data.extend_from_slice(fits.read_into(first, &mut part.spare_capacity_mut()[..len])?);
        }
        Ok((shape, data))
    }

    /// Reads `out.len()` pixels of the current image from pixel `first` (0-based, C order)
    /// into `out`, every value of which is written when it succeeds; its undefined pixels as
    /// [`Element::UNDEFINED`] if `check` (see [`Fits::may_hold_undefined`]).
    fn read_pixels<T: Element>(
        &mut self,
        first: usize,
        out: &mut [MaybeUninit<T>],
        check: bool,
    ) -> Result<()> {
        if out.is_empty() {
            return Ok(());
        }
        // a null value of 0 tells cfitsio not to look for undefined pixels
        let mut undefined = if check { T::UNDEFINED } else { T::default() };
        let mut anynul = 0;
        // SAFETY: `out` has room for `out.len()` elements of the type DATATYPE names, which
        // cfitsio writes; `undefined` is of that type too, and both outlive the call.
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn undefined_pixels_read_as_nan_with_or_without_cfitsio_looking() {
        // Plain floats hold their NaN as such (no look for undefined pixels); integers with
        // BLANK need the look, which turns BLANK into NaN.
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("u.fits");
        let mut f = Fits::create(&path).unwrap();
        f.write_image(
            "FLOAT",
            &[2, 3],
            &[1.0f32, f32::NAN, 3.0, 4.0, 5.0, f32::NAN],
        )
        .unwrap();
        f.write_image("INT", &[2, 3], &[7i32, -1, 9, -1, 11, 12])
            .unwrap();
        f.write_key_i64("BLANK", -1, "undefined").unwrap();
        f.close().unwrap();
        let open = || Fits::open(&path);
        for (hdu, look, nan_at) in [("FLOAT", false, [1, 5]), ("INT", true, [1, 3])] {
            let mut fits = open().unwrap();
            fits.move_to(hdu).unwrap();
            assert_eq!(fits.may_hold_undefined().unwrap(), look, "{hdu}");
            let (_, whole) = fits.read_image::<f32>().unwrap();
            let (_, parts) = Fits::read_image_in_pieces::<f32>(&open, hdu, 2).unwrap();
            for values in [whole, parts] {
                let nans: Vec<usize> = (0..6).filter(|&i| values[i].is_nan()).collect();
                assert_eq!(nans, nan_at, "{hdu}: {values:?}");
                assert_eq!(values[0] + values[2], if look { 16.0 } else { 4.0 });
            }
        }
    }
}
