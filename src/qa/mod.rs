//! The quick-look picture of an extracted frame (`spex qa`): one PNG that shows at a glance
//! whether an extraction went right. It owns what goes into the picture and where; the
//! colour scales live in [`scale`] and the drawing of each panel in [`panels`].
//!
//! Panels, top to bottom, each with the wavelength across and the fiber up:
//!
//! | panel | colour scale |
//! | --- | --- |
//! | FLUX | 1st to 99th percentile of the bins with ivar > 0 (grey: ivar 0) |
//! | IVAR | 1st to 99th percentile of the bins with ivar > 0 (grey: ivar 0) |
//! | MASK | one colour per specmask bit (ALLBADPIX, SOMEBADPIX, COSMIC, BAD2DFIT, others) |
//! | CHI2PIX | 0 to its 99th percentile (at least 2) |
//!
//! and a bottom row with, given a simulation truth, the histogram of the pulls (computed by
//! [`crate::compare::pull_values`]) against the unit Gaussian with their mean, standard
//! deviation and median |pull|, and, given the model image and the preproc, the residual
//! `(image - model) sqrt(ivar)` of a CCD region on the frame's traces.

mod panels;
mod scale;

use std::ops::Range;
use std::path::Path;

use ndarray::Array2;

use crate::compare::{Pulls, Truth};
use crate::error::{Error, Result};
use crate::fits::Fits;
use crate::frame::Frame;
use crate::image::Image;

/// Width of the picture in pixels.
pub const WIDTH: u32 = 1600;
/// Height of each of the four frame panels.
pub const MAP_HEIGHT: u32 = 240;
/// Height of the bottom row (pull histogram and residual image).
pub const BOTTOM_HEIGHT: u32 = 440;
/// CCD rows shown in the residual panel (at most): enough to see each spot's pixels.
pub const RESIDUAL_ROWS: usize = 300;

/// What one panel shows.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum PanelKind {
    Flux,
    Ivar,
    Mask,
    Chi2pix,
    Pulls,
    Residual,
}

/// Where a panel's data landed in the picture: its plotting area in pixels.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Panel {
    pub kind: PanelKind,
    pub x: Range<u32>,
    pub y: Range<u32>,
}

/// Everything one picture shows.
#[derive(Clone, Debug)]
pub struct QuickLook {
    /// The frame's file name, for the title.
    pub name: String,
    pub frame: Frame,
    /// Pulls against the truth, when one was given.
    pub pulls: Option<Vec<f64>>,
    /// The residual image of a CCD region, when the model and image were given.
    pub residual: Option<Residual>,
}

impl QuickLook {
    /// The picture of `frame` alone.
    pub fn new(name: impl Into<String>, frame: Frame) -> Self {
        QuickLook {
            name: name.into(),
            frame,
            pulls: None,
            residual: None,
        }
    }

    /// Adds the pulls against `truth`.
    pub fn with_truth(mut self, truth: &Truth) -> Result<Self> {
        self.pulls = Some(crate::compare::pull_values(&self.frame, truth)?);
        Ok(self)
    }

    /// The pull statistics shown in the histogram panel.
    pub fn pull_stats(&self) -> Option<Pulls> {
        self.pulls.as_deref().map(Pulls::from_values)
    }

    /// Draws the picture and writes it to `path` as a PNG (atomically, like every output of
    /// spex); returns where each panel's data went.
    pub fn write(&self, path: &Path) -> Result<Vec<Panel>> {
        let failed = |message: String| Error::Io {
            path: path.to_path_buf(),
            source: std::io::Error::other(message),
        };
        let (rgb, panels) = panels::render(self).map_err(|e| failed(format!("drawing: {e}")))?;
        let (w, h) = self.size();
        crate::output::write_atomically(path, |temp| {
            let file = std::fs::File::create(temp).map_err(|e| Error::Io {
                path: temp.to_path_buf(),
                source: e,
            })?;
            let mut encoder = png::Encoder::new(std::io::BufWriter::new(file), w, h);
            encoder.set_color(png::ColorType::Rgb);
            encoder.set_depth(png::BitDepth::Eight);
            let encoded = encoder
                .write_header()
                .and_then(|mut writer| writer.write_image_data(&rgb).and(writer.finish()));
            encoded.map_err(|e| failed(format!("writing the PNG: {e}")))
        })?;
        Ok(panels)
    }

    /// Width and height of the picture in pixels.
    pub fn size(&self) -> (u32, u32) {
        picture_size(self.pulls.is_some() || self.residual.is_some())
    }
}

/// Width and height of a picture, with or without its bottom row.
pub fn picture_size(bottom_row: bool) -> (u32, u32) {
    let maps = 4 * MAP_HEIGHT + panels::HEADER_HEIGHT;
    (WIDTH, maps + if bottom_row { BOTTOM_HEIGHT } else { 0 })
}

/// `(image - model) sqrt(ivar)` over a CCD region, NaN where the pixel has ivar 0.
#[derive(Clone, Debug)]
pub struct Residual {
    /// CCD rows (along the wavelength) and columns (across the fibers) of the region.
    pub rows: Range<usize>,
    pub cols: Range<usize>,
    /// `[row, column]` of the region.
    pub values: Array2<f64>,
}

impl Residual {
    /// The residual of `image` against `model` over the columns that the model covers and
    /// [`RESIDUAL_ROWS`] rows at the middle of the rows it covers: the frame's traces.
    pub fn new(image: &Image, model: &Array2<f64>) -> Result<Self> {
        let (nrows, ncols) = model.dim();
        if (nrows, ncols) != (image.nrows, image.ncols) {
            return Err(Error::Image {
                path: image.path.clone(),
                message: format!(
                    "{}x{} pixels, but the model image has {nrows}x{ncols}",
                    image.nrows, image.ncols
                ),
            });
        }
        let covered = |n: usize, lit: &dyn Fn(usize) -> bool| -> Option<Range<usize>> {
            let first = (0..n).find(|&i| lit(i))?;
            let last = (0..n).rev().find(|&i| lit(i))?;
            Some(first..last + 1)
        };
        let row_lit = |r: usize| model.row(r).iter().any(|&v| v != 0.0);
        let col_lit = |c: usize| model.column(c).iter().any(|&v| v != 0.0);
        let (Some(all_rows), Some(cols)) = (covered(nrows, &row_lit), covered(ncols, &col_lit))
        else {
            return Err(Error::Image {
                path: image.path.clone(),
                message: "the model image is zero everywhere: no trace to show".into(),
            });
        };
        let half = RESIDUAL_ROWS.min(all_rows.len()) / 2;
        let middle = (all_rows.start + all_rows.end) / 2;
        let rows = middle - half..middle + half.max(1);
        let values = Array2::from_shape_fn((rows.len(), cols.len()), |(i, j)| {
            let (r, c) = (rows.start + i, cols.start + j);
            let ivar = f64::from(image.ivar[[r, c]]);
            if ivar > 0.0 {
                (f64::from(image.pix[[r, c]]) - model[[r, c]]) * ivar.sqrt()
            } else {
                f64::NAN
            }
        });
        Ok(Residual { rows, cols, values })
    }

    /// Root mean square of the residual over the pixels with ivar > 0 and their number
    /// (0 and 0 when there is none).
    pub fn rms(&self) -> (f64, usize) {
        let used: Vec<f64> = self
            .values
            .iter()
            .copied()
            .filter(|v| !v.is_nan())
            .collect();
        let n = used.len();
        if n == 0 {
            return (0.0, 0);
        }
        let rms = (used.iter().map(|v| v * v).sum::<f64>() / n as f64).sqrt();
        (rms, n)
    }
}

/// Reads a model image written by `spex extract -m` (the CCD image in the primary HDU).
pub fn read_model(path: &Path) -> Result<Array2<f64>> {
    let mut fits = Fits::open(path)?;
    fits.move_to_primary()?;
    let (shape, values) = fits.read_image::<f64>()?;
    if shape.len() != 2 {
        return Err(fits.error("primary HDU", format!("shape {shape:?} is not a CCD image")));
    }
    Array2::from_shape_vec((shape[0], shape[1]), values)
        .map_err(|e| fits.error("primary HDU", e.to_string()))
}
