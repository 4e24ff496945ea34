//! The frame's values in photons per bin, before the conversion per Angstrom: the arrays that
//! the patch results are stitched into, fiber row by fiber row.
//!
//! The frame's assembly stitches the results it is handed. A backend that solves a whole
//! frame in one process may instead place each patch's values here as it unpacks them from
//! its own buffers ([`crate::backend::Backend::extract_into`]): a full frame's results are
//! about 140 MB, which built patch by patch and then copied into the frame were written twice,
//! in fresh memory for the most part, and read twice.

use ndarray::{Array2, Array3, Zip};
use rayon::prelude::*;

use crate::error::{Error, Result};
use crate::plan::Plan;

/// `[fiber, wave]` arrays of a frame (`[fiber, diagonal, wave]` for the resolution), fiber 0
/// being `specmin`, in photons per bin.
#[derive(Clone, Debug, PartialEq)]
pub struct FrameValues {
    pub specmin: usize,
    pub flux: Array2<f64>,
    pub ivar: Array2<f64>,
    pub chi2pix: Array2<f64>,
    pub pixmask_fraction: Array2<f64>,
    /// `2 ndiag + 1` diagonals.
    pub resolution: Array3<f64>,
}

impl FrameValues {
    /// All zero, for `plan`'s frame with `ndiag` resolution diagonals each side. Each value is
    /// written, on rayon's pool, where a zeroed allocation of fresh memory would leave its
    /// pages to be faulted in by their first writer: a backend's unpacking, on the device's
    /// critical path.
    pub fn zeros(plan: &Plan, ndiag: usize) -> Self {
        let (nspec, nwave, nd) = (plan.options.nspec, plan.nwave(), 2 * ndiag + 1);
        let written = |n: usize| -> Vec<f64> { (0..n).into_par_iter().map(|_| 0.0).collect() };
        let flat = || Array2::from_shape_vec((nspec, nwave), written(nspec * nwave));
        let cube = Array3::from_shape_vec((nspec, nd, nwave), written(nspec * nd * nwave));
        let shaped = "the values of the frame's shape";
        FrameValues {
            specmin: plan.options.specmin,
            flux: flat().expect(shaped),
            ivar: flat().expect(shaped),
            chi2pix: flat().expect(shaped),
            pixmask_fraction: flat().expect(shaped),
            resolution: cube.expect(shaped),
        }
    }

    /// An error unless the arrays have the shape of `plan`'s frame with `ndiag` diagonals
    /// each side.
    pub fn check(&self, plan: &Plan, ndiag: usize) -> Result<()> {
        let (nspec, nwave) = (plan.options.nspec, plan.nwave());
        let flat = [
            &self.flux,
            &self.ivar,
            &self.chi2pix,
            &self.pixmask_fraction,
        ];
        let shaped = flat.iter().all(|a| a.dim() == (nspec, nwave))
            && self.resolution.dim() == (nspec, 2 * ndiag + 1, nwave)
            && self.specmin == plan.options.specmin;
        if !shaped {
            return Err(Error::Internal(format!(
                "frame arrays of {} fibers from {} x {} bins placed for a frame of {nspec} \
                 fibers from {} x {nwave} bins",
                self.nspec(),
                self.specmin,
                self.flux.ncols(),
                plan.options.specmin
            )));
        }
        Ok(())
    }

    /// Number of fibers.
    pub fn nspec(&self) -> usize {
        self.flux.nrows()
    }

    /// The row of fiber `fiber` (absolute, as a patch names it), if the frame holds it.
    pub fn row_of(&self, fiber: usize) -> Option<usize> {
        fiber
            .checked_sub(self.specmin)
            .filter(|&k| k < self.nspec())
    }

    /// Calls `fill(row, rows)` for every fiber row of the frame, on rayon's pool: each row of
    /// every array is written by one task.
    pub fn par_rows(&mut self, fill: impl Fn(usize, FiberRows<'_>) + Sync + Send) {
        let contiguous = "a row of the frame's arrays is contiguous";
        Zip::indexed(self.flux.rows_mut())
            .and(self.ivar.rows_mut())
            .and(self.chi2pix.rows_mut())
            .and(self.pixmask_fraction.rows_mut())
            .and(self.resolution.outer_iter_mut())
            .par_for_each(|row, mut flux, mut ivar, mut chi2, mut fraction, mut res| {
                let rows = FiberRows {
                    nd: res.nrows(),
                    flux: flux.as_slice_mut().expect(contiguous),
                    ivar: ivar.as_slice_mut().expect(contiguous),
                    chi2pix: chi2.as_slice_mut().expect(contiguous),
                    fraction: fraction.as_slice_mut().expect(contiguous),
                    res: res.as_slice_mut().expect(contiguous),
                };
                fill(row, rows);
            });
    }
}

/// One fiber's rows of the frame's arrays. The frame's arrays are in standard layout, so these
/// are plain slices: ndarray's slicing of some 350,000 rows of 50 values a full frame cost
/// more than the copies.
pub struct FiberRows<'a> {
    /// Resolution diagonals.
    nd: usize,
    flux: &'a mut [f64],
    ivar: &'a mut [f64],
    chi2pix: &'a mut [f64],
    fraction: &'a mut [f64],
    /// `[diagonal, wave]`.
    res: &'a mut [f64],
}

/// One fiber's values over one patch's bins, wherever they are kept.
pub struct PatchRow<'s> {
    pub flux: &'s [f64],
    pub ivar: &'s [f64],
    pub chi2pix: &'s [f64],
    pub fraction: &'s [f64],
    /// Diagonal `d` starts at `d * res_stride`.
    pub res: &'s [f64],
    pub res_stride: usize,
}

impl PatchRow<'_> {
    /// Whether every value of the row's `nw` bins is finite. Each value is looked at (no early
    /// end), so that the test runs in SIMD lanes: almost every row is all finite.
    pub fn is_finite(&self, nw: usize, nd: usize) -> bool {
        let finite = |v: &[f64]| v[..nw].iter().fold(true, |all, x| all & x.is_finite());
        [self.flux, self.ivar, self.chi2pix, self.fraction]
            .into_iter()
            .all(finite)
            && (0..nd).all(|d| finite(&self.res[d * self.res_stride..]))
    }
}

impl FiberRows<'_> {
    /// Copies `src`'s `nw` bins into bins `w0..w0 + nw` of each array.
    pub fn put(&mut self, w0: usize, nw: usize, src: &PatchRow<'_>) {
        let pairs: [(&mut [f64], &[f64]); 4] = [
            (&mut *self.flux, src.flux),
            (&mut *self.ivar, src.ivar),
            (&mut *self.chi2pix, src.chi2pix),
            (&mut *self.fraction, src.fraction),
        ];
        for (dst, from) in pairs {
            dst[w0..w0 + nw].copy_from_slice(&from[..nw]);
        }
        let nwave = self.flux.len();
        for d in 0..self.nd {
            self.res[d * nwave + w0..][..nw].copy_from_slice(&src.res[d * src.res_stride..][..nw]);
        }
    }
}

#[cfg(test)]
pub(super) mod tests {
    use super::*;
    use crate::extract::{PatchResult, PatchStatus};
    use crate::frame::Frame;
    use crate::plan::PlanOptions;

    /// Results of every patch of `plan`, each value its own (the fractions aside).
    pub(in crate::frame) fn numbered_results(plan: &Plan, ndiag: usize) -> Vec<PatchResult> {
        plan.patches
            .iter()
            .map(|p| {
                let mut r = PatchResult::empty(p, ndiag, PatchStatus::Ok);
                let base = ((p.index + 1) * 100_000) as f64;
                let arrays = [&mut r.flux, &mut r.ivar, &mut r.chi2pix];
                for (a, v) in arrays.into_iter().enumerate() {
                    for (k, x) in v.iter_mut().enumerate() {
                        *x = base + (a * 10_000 + k) as f64;
                    }
                }
                for (k, x) in r.pixmask_fraction.iter_mut().enumerate() {
                    *x = (k % 7) as f64 / 10.0;
                }
                for (k, x) in r.resolution.iter_mut().enumerate() {
                    *x = base + 0.5 + k as f64;
                }
                r
            })
            .collect()
    }

    /// Places the values of the results `chosen` picks as a backend does, and leaves them
    /// without values.
    fn place(
        plan: &Plan,
        ndiag: usize,
        results: &mut [PatchResult],
        chosen: impl Fn(&PatchResult) -> bool + Sync,
    ) -> FrameValues {
        let mut values = FrameValues::zeros(plan, ndiag);
        let nd = 2 * ndiag + 1;
        let specmin = values.specmin;
        values.par_rows(|row, mut rows| {
            for r in results.iter().filter(|r| chosen(r)) {
                let patch = &plan.patches[r.patch];
                if patch.fibers.contains(&(specmin + row)) {
                    let local = specmin + row - patch.fibers.start;
                    rows.put(patch.waves.start, r.nwave, &r.row(local, nd));
                }
            }
        });
        for r in results.iter_mut().filter(|r| chosen(r)) {
            let (patch, status) = (&plan.patches[r.patch], r.status);
            *r = PatchResult::placed(patch, ndiag, status);
        }
        values
    }

    #[test]
    fn placed_values_give_the_frame_that_stitched_ones_give() {
        // 23 fibers: the last sub-bundle's patches hold fibers beyond the frame's
        let plan = Plan::new(PlanOptions::new(6000.0, 6200.0, 0.8, 1, 23)).unwrap();
        let ndiag = 3;
        let all = numbered_results(&plan, ndiag);
        let (stitched, counts) = Frame::assemble(&plan, ndiag, &all).unwrap();
        for every in [1, 2, 3] {
            let mut some = all.clone();
            let values = place(&plan, ndiag, &mut some, |r| r.patch % every == 0);
            assert!(some.iter().any(|r| r.placed && r.flux.is_empty()));
            let (placed, placed_counts) =
                Frame::assemble_with(&plan, ndiag, &some, Some(values)).unwrap();
            assert_eq!(placed, stitched, "every {every}th patch placed");
            assert_eq!(placed_counts, counts);
        }
        assert!(stitched.flux.iter().all(|&v| v != 0.0));
        assert!(stitched.resolution.iter().all(|&v| v != 0.0));
    }

    #[test]
    fn a_result_with_values_overrides_what_was_placed_for_it() {
        // a backend places a patch, then finds a value that is not finite and hands its
        // result over with values (zero flux and ivar) after all
        let plan = Plan::new(PlanOptions::new(6000.0, 6100.0, 0.8, 0, 25)).unwrap();
        let ndiag = 2;
        let mut all = numbered_results(&plan, ndiag);
        let values = place(&plan, ndiag, &mut all.clone(), |_| true);
        let patch = &plan.patches[1];
        for (i, r) in all.iter_mut().enumerate() {
            *r = if i == 1 {
                PatchResult::empty(patch, ndiag, PatchStatus::NonFinite)
            } else {
                PatchResult::placed(&plan.patches[i], ndiag, r.status)
            };
        }
        let (frame, counts) = Frame::assemble_with(&plan, ndiag, &all, Some(values)).unwrap();
        assert_eq!(counts.non_finite, 1);
        let (f, w) = (patch.fibers.start, patch.waves.start);
        assert_eq!(frame.flux[[f, w]], 0.0);
        assert_eq!(frame.ivar[[f + 1, w + 1]], 0.0);
        assert_ne!(frame.flux[[f, patch.waves.end]], 0.0);
    }

    #[test]
    fn placed_results_need_their_arrays_of_the_frames_shape() {
        let plan = Plan::new(PlanOptions::new(6000.0, 6100.0, 0.8, 0, 25)).unwrap();
        let ndiag = 2;
        let mut all = numbered_results(&plan, ndiag);
        let values = place(&plan, ndiag, &mut all, |r| r.patch == 0);
        let e = Frame::assemble(&plan, ndiag, &all).unwrap_err();
        assert!(e.to_string().contains("did not come with it"), "{e}");
        let e = Frame::assemble_with(&plan, ndiag + 1, &all, Some(values.clone())).unwrap_err();
        assert!(e.to_string().contains("placed for a frame"), "{e}");
        let other = Plan::new(PlanOptions::new(6000.0, 6100.0, 0.8, 5, 20)).unwrap();
        assert!(values.check(&other, ndiag).is_err());
        assert!(values.check(&plan, ndiag).is_ok());
    }
}
