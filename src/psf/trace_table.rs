//! The trace positions and spot corners of a frame's fibers on its padded wavelength grid,
//! evaluated once where the frame is read: they depend only on the PSF and the plan, and the
//! GPU backend's host thread, which needs them for every spot of a frame, copies them from
//! here instead of evaluating them while the device waits.

use std::ops::Range;

use super::{Corners, GaussHermitePsf};

/// Trace positions and spot corners of `fibers` at every wavelength of `waves`.
#[derive(Clone, Debug, PartialEq)]
pub struct TraceTable {
    pub fibers: Range<usize>,
    /// The wavelengths evaluated, kept so that a table is only used for its own grid.
    waves: Vec<f64>,
    /// `[fiber][wave][x, y]`, fiber relative to `fibers.start`.
    xy: Vec<f64>,
    /// `[fiber][wave][column, row]` of each spot's lower-left pixel.
    corners: Vec<i32>,
    /// The least and greatest corner column of each fiber's spots.
    columns: Vec<(i32, i32)>,
}

impl TraceTable {
    /// Evaluates the traces of `fibers` at `waves` (as [`GaussHermitePsf::trace_into`] does).
    pub fn new(psf: &GaussHermitePsf, fibers: Range<usize>, waves: &[f64]) -> Self {
        let per_fiber = 2 * waves.len();
        let mut xy = vec![0.0; fibers.len() * per_fiber];
        let mut corners = vec![0; fibers.len() * per_fiber];
        for ((fiber, xy), c) in fibers
            .clone()
            .zip(xy.chunks_exact_mut(per_fiber))
            .zip(corners.chunks_exact_mut(per_fiber))
        {
            psf.trace_into(fiber, waves, xy, c);
        }
        let columns = corners
            .chunks_exact(per_fiber)
            .map(|c| {
                let xc = c.iter().step_by(2);
                let lo = xc.clone().copied().min().unwrap_or(0);
                (lo, xc.copied().max().unwrap_or(0))
            })
            .collect();
        TraceTable {
            fibers,
            waves: waves.to_vec(),
            xy,
            corners,
            columns,
        }
    }

    /// Whether the table was evaluated at `waves`: [`TraceTable::fiber`] answers for that grid.
    pub fn is_on(&self, waves: &[f64]) -> bool {
        self.waves == waves
    }

    /// The trace positions `[wave][x, y]` and spot corners `[wave][column, row]` of `fiber` on
    /// the table's grid ([`TraceTable::is_on`]), if the table holds the fiber.
    pub fn fiber(&self, fiber: usize) -> Option<(&[f64], &[i32])> {
        if !self.fibers.contains(&fiber) {
            return None;
        }
        let per_fiber = 2 * self.waves.len();
        let at =
            (fiber - self.fibers.start) * per_fiber..(fiber - self.fibers.start + 1) * per_fiber;
        Some((&self.xy[at.clone()], &self.corners[at]))
    }

    /// The least and greatest corner column of the spots of `fibers` at `waves`, if the table
    /// holds them all: what a GPU backend sizes its buffers of image columns from before it
    /// lays out a frame's patches.
    pub fn corner_columns(&self, fibers: Range<usize>, waves: &[f64]) -> Option<(i32, i32)> {
        let held = self.fibers.start <= fibers.start && fibers.end <= self.fibers.end;
        if !held || fibers.is_empty() || !self.is_on(waves) {
            return None;
        }
        let of = &self.columns[fibers.start - self.fibers.start..fibers.end - self.fibers.start];
        let lo = of.iter().map(|c| c.0).min()?;
        Some((lo, of.iter().map(|c| c.1).max()?))
    }

    /// The spot corners of every fiber of the table, for the layout of a frame's patches; the
    /// same as [`GaussHermitePsf::corners`] of its fibers and wavelengths.
    pub fn corners(&self, psf: &GaussHermitePsf) -> Corners {
        let (ny, nx) = psf.spot_shape();
        Corners {
            fibers: self.fibers.clone(),
            nwave: self.waves.len(),
            ny,
            nx,
            xc: self.corners.iter().step_by(2).copied().collect(),
            yc: self.corners.iter().skip(1).step_by(2).copied().collect(),
        }
    }
}

impl GaussHermitePsf {
    /// Trace positions of `fiber` at every wavelength of `waves`, `[wave][x, y]`, into `xy`,
    /// and its spots' corners, `[wave][column, row]`, into `corners`.
    pub fn trace_into(&self, fiber: usize, waves: &[f64], xy: &mut [f64], corners: &mut [i32]) {
        let (xs, ys) = self.trace(fiber, waves);
        for (((&x, &y), p), c) in xs
            .iter()
            .zip(&ys)
            .zip(xy.chunks_exact_mut(2))
            .zip(corners.chunks_exact_mut(2))
        {
            let (cx, cy) = self.corner_of(x, y);
            p.copy_from_slice(&[x, y]);
            c.copy_from_slice(&[cx, cy]);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn psf() -> GaussHermitePsf {
        let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/data");
        GaussHermitePsf::read(&dir.join("psf-r0-00051060.fits")).expect("test PSF")
    }

    #[test]
    fn a_table_holds_what_the_psf_evaluates_bit_for_bit() {
        let psf = psf();
        let waves: Vec<f64> = (0..37).map(|i| 5700.0 + 52.3 * i as f64).collect();
        let table = TraceTable::new(&psf, 20..31, &waves);
        assert_eq!(table.corners(&psf), psf.corners(20..31, &waves));
        for fiber in [20, 25, 30] {
            let (mut xy, mut c) = (vec![0.0; 2 * waves.len()], vec![0; 2 * waves.len()]);
            psf.trace_into(fiber, &waves, &mut xy, &mut c);
            let (txy, tc) = table.fiber(fiber).expect("held");
            let bits = |v: &[f64]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
            assert_eq!(bits(txy), bits(&xy), "fiber {fiber}");
            assert_eq!(tc, c, "fiber {fiber}");
            let (x, y) = psf.xy(fiber, waves[3]);
            assert_eq!((txy[6], txy[7]), (x, y));
        }
    }

    #[test]
    fn a_table_answers_only_for_its_fibers_and_grid() {
        let psf = psf();
        let waves = [6000.0, 6001.0, 6002.0];
        let table = TraceTable::new(&psf, 3..5, &waves);
        assert!(table.fiber(2).is_none());
        assert!(table.fiber(5).is_none());
        assert!(table.fiber(4).is_some());
        assert!(table.is_on(&waves));
        assert!(!table.is_on(&waves[..2]));
        assert!(!table.is_on(&[6000.0, 6001.0, 6002.5]));
        let c = table.corners(&psf);
        let c = &c;
        let xc = |f: usize| (0..3).map(move |w| c.corner(f - 3, w).0);
        let lo = xc(3).chain(xc(4)).min();
        let hi = xc(3).chain(xc(4)).max();
        assert_eq!(table.corner_columns(3..5, &waves), lo.zip(hi));
        assert_eq!(
            table.corner_columns(4..5, &waves),
            xc(4).min().zip(xc(4).max())
        );
        assert!(table.corner_columns(2..5, &waves).is_none());
        assert!(table.corner_columns(3..5, &waves[1..]).is_none());
    }
}
