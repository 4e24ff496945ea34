//! The host tables of a frame, its one chunk: trace positions and spot corners of its
//! bundles, the PSF's Legendre coefficients, each patch's pixel box and the first spot of each
//! of its fiber blocks (from which the device writes its column table), and its image. They
//! are built wave by wave, each part once, straight into the frame-sized buffers they are
//! uploaded from (which become pinned), so that the host prepares a wave while the device
//! solves the one before.

use std::borrow::Cow;
use std::ops::Range;
use std::sync::Arc;
use std::time::Instant;

use cudarc::driver::{CudaContext, CudaEvent};
use ndarray::{s, ArrayViewMut1};
use rayon::prelude::*;

use super::shape::Shape;
use super::staging::Staging;
use crate::backend::FrameInput;
use crate::error::Result;
use crate::extract::{PatchGeometry, PatchResult, PatchStatus};
use crate::plan::Patch;
use crate::psf::{Corners, GaussHermitePsf, TraceTable};

/// The host buffers a frame is uploaded from: its image and its larger tables. They
/// become pinned once allowed (staging.rs), from a backend's first frame on where its sizes
/// can be told ahead ([`Uploads::pin_from_now`]), else after it; from pageable
/// memory the driver copies each upload through a buffer of its own before it returns, time
/// in which the host queues nothing.
pub(crate) struct Uploads {
    /// Two buffers of a strip of columns of the CCD, pixels then inverse variances, which
    /// the strips use in turn, and the end of the upload of the strip each holds. From pageable
    /// memory the driver copies an upload before the call returns; pinned, a buffer is reused
    /// once its upload is done. Pinning two strips rather than the whole CCD (136 MB for a
    /// DESI frame) shortens the stall that pinning causes in a backend's second frame.
    strips: [Staging<f32>; 2],
    in_flight: [Option<CudaEvent>; 2],
    /// Trace positions, then Legendre coefficients.
    reals: Staging<f64>,
    /// Spot corners, then the first spots of the fiber blocks.
    ints: Staging<i32>,
}

impl Uploads {
    pub(crate) fn new(ctx: &Arc<CudaContext>) -> Self {
        Uploads {
            strips: [Staging::new(ctx.clone()), Staging::new(ctx.clone())],
            in_flight: [None, None],
            reals: Staging::new(ctx.clone()),
            ints: Staging::new(ctx.clone()),
        }
    }

    /// Buffers that stay pageable, for the host-side tests of the tables.
    #[cfg(test)]
    pub(crate) fn pageable() -> Self {
        Uploads {
            strips: [Staging::pageable(), Staging::pageable()],
            in_flight: [None, None],
            reals: Staging::pageable(),
            ints: Staging::pageable(),
        }
    }

    /// Starts pinning the buffers in the background now, at the sizes given (values of the
    /// reals, the ints and a strip of the image), unless pinning was allowed before: a
    /// backend's first frame uploads from those whose pinning is done by the time it asks for
    /// them (the strips of its later waves), the others from pageable memory, without waiting.
    pub(crate) fn pin_from_now(&mut self, reals: usize, ints: usize, strip: usize) {
        if self.reals.pinning_allowed() {
            return;
        }
        tracing::debug!(
            "pinning uploads from the first frame: strip {strip}, reals {reals}, ints {ints} values"
        );
        for s in &mut self.strips {
            s.allow_pinning(strip);
            s.reserve(strip);
        }
        self.reals.allow_pinning(reals);
        self.reals.reserve(reals);
        self.ints.allow_pinning(ints);
        self.ints.reserve(ints);
    }

    /// Lets the buffers be pinned in the background from their next use on, each as large as
    /// the largest asked for so far.
    pub(crate) fn allow_pinning(&mut self) {
        let image = self.strips.iter().map(|s| s.largest()).max().unwrap_or(0);
        let (reals, ints) = (self.reals.largest(), self.ints.largest());
        tracing::debug!("largest uploads: strip {image}, reals {reals}, ints {ints} values");
        for s in &mut self.strips {
            s.allow_pinning(image);
        }
        self.reals.allow_pinning(reals);
        self.ints.allow_pinning(ints);
    }
}

/// Live patches the device solves together, through the workspace's per-patch buffers: a
/// frame is one chunk (its tables and image uploaded once), walked in waves so that those
/// buffers stay within the memory budget, with no host synchronisation between waves.
#[derive(Clone, Debug, Default)]
pub(crate) struct Wave {
    /// Its patches, as indices into the frame's live patches.
    pub(crate) live: Range<usize>,
    /// The bundle slots of its patches, whose spots it evaluates.
    pub(crate) slots: Range<usize>,
    /// Its model boxes within the frame's (its box offsets start at 0).
    pub(crate) boxes: Range<usize>,
    /// The bundle slots whose traces were built for it (the others came with a wave before);
    /// emptied by its upload.
    pub(crate) traced: Vec<usize>,
    /// The columns of the CCD uploaded for it; emptied by its upload.
    pub(crate) strips: Vec<Range<usize>>,
    /// For a wave that solves again some patches of another (outlier rejection): those live
    /// patches, in order, whose tables and results take the first places of the other's
    /// (`live` starts where the other's does, `slots` and `boxes` too), which the other no
    /// longer needs once finished. Empty for a wave of the consecutive patches `live`.
    pub(crate) picked: Vec<usize>,
}

impl Wave {
    pub(crate) fn len(&self) -> usize {
        self.live.len()
    }

    /// The live patches it solves, in the order of its batch.
    pub(crate) fn patches(&self) -> Vec<usize> {
        if self.picked.is_empty() {
            self.live.clone().collect()
        } else {
            self.picked.clone()
        }
    }

    /// Its first live patch, whose model box is the first it writes.
    pub(crate) fn first_patch(&self) -> usize {
        self.picked.first().copied().unwrap_or(self.live.start)
    }

    /// Index of its first spot in the frame's tables (trace positions, corners).
    pub(crate) fn spot0(&self, sh: &Shape) -> usize {
        self.slots.start * sh.bundlesize * sh.nfull
    }

    /// Spots of its bundles.
    pub(crate) fn nspots(&self, sh: &Shape) -> usize {
        self.slots.len() * sh.bundlesize * sh.nfull
    }

    /// Where its results lie in the frame's arrays on the device.
    pub(crate) fn layout(&self, sh: &Shape) -> Layout {
        let blocks = self.live.start * sh.ncore..self.live.end * sh.ncore;
        Layout {
            patches: self.live.clone(),
            bins: blocks.start * sh.nws..blocks.end * sh.nws,
            blocks,
        }
    }
}

/// The per-patch tables of a wave of picked patches ([`FrameHost::picked_tables`]), as the
/// device reads them.
#[derive(Debug, Default, PartialEq)]
pub(crate) struct PickedTables {
    pub(crate) first_spots: Vec<i32>,
    pub(crate) boxes: Vec<i32>,
    pub(crate) nkeep: Vec<i32>,
    pub(crate) boxoff: Vec<i64>,
}

/// A wave's place in the frame's results: its patches (the Schur sweeps' verdicts), their
/// core blocks (polar steps, Jacobi sweeps) and their core bins (flux, ivar, pixmask,
/// chi2pix; the resolution has `nd` values per bin).
pub(crate) struct Layout {
    pub(crate) patches: Range<usize>,
    pub(crate) blocks: Range<usize>,
    pub(crate) bins: Range<usize>,
}

/// The lengths of `n` patches' waves of at most `size` each: a first wave a quarter as long as
/// the largest, which the device waits for the host to prepare, and a last one as short, whose
/// results the host unpacks once the device is done; between them waves as equal as can be,
/// each prepared while the device runs the one before and unpacked while it runs the next.
pub(crate) fn wave_lengths(n: usize, size: usize) -> Vec<usize> {
    let quarter = n.min(size).div_ceil(4).max(1);
    let first = quarter.min(n);
    let last = if n - first > size { quarter } else { 0 };
    let middle = n - first - last;
    let count = middle.div_ceil(size.max(1));
    let mut lengths = vec![first];
    lengths.extend((0..count).map(|i| middle / count + usize::from(i < middle % count)));
    lengths.push(last);
    lengths.retain(|&l| l > 0);
    lengths
}

/// A live patch: its position in the frame, its geometry and its bundle slot.
pub(crate) type Live = (usize, PatchGeometry, usize);

/// Host-side tables of a frame, built wave by wave ([`FrameHost::prepare_wave`]).
pub(crate) struct FrameHost {
    /// Patches of the frame that have pixels, with their geometry and bundle slot, in the
    /// order of the waves.
    pub(crate) live: Vec<Live>,
    /// Results of patches without pixels (off the CCD), by position in the frame.
    pub(crate) off: Vec<(usize, PatchResult)>,
    pub(crate) bundles: Vec<usize>,
    /// The waves with live patches, as prepared.
    pub(crate) waves: Vec<Wave>,
    /// The frame's patches in the waves planned, by position (some may have none live).
    planned: Vec<Range<usize>>,
    /// Spots of the frame's bundles: (bundle slot * bundlesize + fiber) * nfull + wave.
    pub(crate) nspots: usize,
    /// Values of the table of Legendre coefficients per fiber.
    pub(crate) coef_per_fiber: usize,
    pub(crate) boxes: Vec<i32>,
    pub(crate) nkeep: Vec<i32>,
    /// Each patch's model box within its wave's.
    pub(crate) boxoff: Vec<i64>,
    /// Each patch's model box within the frame's, where a wave that solves it again finds it.
    pub(crate) box_at: Vec<usize>,
    pub(crate) box_total: usize,
    /// The spot corners of each bundle slot traced so far, for the layout.
    corners: Vec<Option<Corners>>,
    /// The columns of the CCD uploaded so far, one range.
    cols: Option<Range<usize>>,
    /// Strips of the image packed so far.
    packed: usize,
    /// The buffers of the upload.
    pub(crate) buffers: Uploads,
    /// A backend's first frame: the sizes to pin its buffers at (reals, ints, a strip), once
    /// [`FrameHost::start_pinning`] is called.
    pin_first: Option<(usize, usize, usize)>,
    /// Whether a table or a strip of the image went from pageable memory.
    pub(crate) pageable: bool,
    /// Host time spent preparing the frame, milliseconds.
    pub(crate) prep_ms: f64,
    /// The part of it spent on traces, milliseconds.
    pub(crate) trace_ms: f64,
}

impl FrameHost {
    /// Starts pinning the upload buffers of a backend's first frame in the background (see
    /// [`Uploads::pin_from_now`]). Called once the frame's device buffers are allocated: an
    /// allocation waits for the pinnings under way in the process (the first frames of eight
    /// backends on a 4-GPU node spent 0.33-0.54 s allocating their spots while their uploads
    /// were being pinned).
    pub(crate) fn start_pinning(&mut self) {
        if let Some((reals, ints, strip)) = self.pin_first.take() {
            self.buffers.pin_from_now(reals, ints, strip);
        }
    }

    /// The frame of `patches` (ordered by bundle) in waves of at most `wave_max`: its sizes,
    /// and its buffers (grown if needed); no wave prepared yet.
    pub(crate) fn new(
        input: &FrameInput<'_>,
        patches: &[&Patch],
        sh: &Shape,
        mut buffers: Uploads,
        wave_max: usize,
    ) -> Self {
        let mut bundles: Vec<usize> = patches.iter().map(|p| p.bundle_start).collect();
        bundles.sort_unstable();
        bundles.dedup();
        let nspots = bundles.len() * sh.bundlesize * sh.nfull;
        let psf = input.psf;
        let coef_per_fiber = (2 + psf.ngh()) * psf.ghsigx.ncoef;
        let nfibers = bundles.len() * sh.bundlesize;
        let mut start = 0;
        let planned: Vec<Range<usize>> = wave_lengths(patches.len(), wave_max)
            .into_iter()
            .map(|len| {
                start += len;
                start - len..start
            })
            .collect();
        let (reals, ints) = (
            2 * nspots + nfibers * coef_per_fiber,
            2 * nspots + patches.len() * sh.nblock,
        );
        let pin_first = match buffers.reals.pinning_allowed() {
            true => None,
            false => largest_strip(input, patches, &planned, sh).map(|strip| (reals, ints, strip)),
        };
        buffers.reals.get(reals);
        buffers.ints.get(ints);
        let pageable = !(buffers.reals.is_pinned() && buffers.ints.is_pinned());
        FrameHost {
            live: Vec::with_capacity(patches.len()),
            pin_first,
            off: Vec::new(),
            corners: vec![None; bundles.len()],
            bundles,
            waves: Vec::new(),
            planned,
            nspots,
            coef_per_fiber,
            boxes: Vec::with_capacity(4 * patches.len()),
            nkeep: Vec::with_capacity(patches.len()),
            boxoff: Vec::with_capacity(patches.len()),
            box_at: Vec::with_capacity(patches.len()),
            box_total: 0,
            cols: None,
            packed: 0,
            buffers,
            pageable,
            prep_ms: 0.0,
            trace_ms: 0.0,
        }
    }

    /// Waves planned, live or not.
    pub(crate) fn nplanned(&self) -> usize {
        self.planned.len()
    }

    /// The frame's patches, live or not: a bound on its live patches before every wave is
    /// prepared.
    pub(crate) fn npatches(&self) -> usize {
        self.planned.last().map_or(0, |r| r.end)
    }

    /// Patches in the longest wave planned.
    pub(crate) fn largest_wave(&self) -> usize {
        self.planned.iter().map(|w| w.len()).max().unwrap_or(0)
    }

    /// Prepares planned wave `pi`: the traces of its bundles not traced yet, its patches' layout
    /// and tables, and the columns of the CCD it needs beyond those uploaded. Returns its index
    /// in `waves`, None if none of its patches has pixels.
    pub(crate) fn prepare_wave(
        &mut self,
        input: &FrameInput<'_>,
        patches: &[&Patch],
        sh: &Shape,
        pi: usize,
    ) -> Option<usize> {
        let t0 = Instant::now();
        let _r = nvtx::LocalRange::new(c"host tables");
        let range = self.planned[pi].clone();
        let slot = |p: &Patch| self.bundles.binary_search(&p.bundle_start).expect("listed");
        let slots = slot(patches[range.start])..slot(patches[range.end - 1]) + 1;
        let traced = self.trace(input, sh, slots.clone());
        let t_traces = t0.elapsed().as_secs_f64() * 1e3;
        self.trace_ms += t_traces;
        let live_start = self.live.len();
        self.lay_out(input, patches, sh, range);
        let live = live_start..self.live.len();
        if live.is_empty() {
            self.prep_ms += t0.elapsed().as_secs_f64() * 1e3;
            return None;
        }
        self.write_first_spots(sh, live.clone(), slots.start);
        let boxes = self.add_boxes(patches, live.clone());
        let strips = self.image_strips(live.clone());
        let ms = t0.elapsed().as_secs_f64() * 1e3;
        tracing::debug!(
            "host tables of {} patches: traces of {} bundles {t_traces:.1} ms, layout and image {:.1} ms",
            live.len(),
            traced.len(),
            ms - t_traces
        );
        self.prep_ms += ms;
        self.waves.push(Wave {
            live,
            slots,
            boxes,
            traced,
            strips,
            picked: Vec::new(),
        });
        Some(self.waves.len() - 1)
    }

    /// Traces the bundle slots of `slots` not traced yet, straight into the tables: trace
    /// positions and corners of every spot, Legendre coefficients of every fiber. Returns them.
    fn trace(&mut self, input: &FrameInput<'_>, sh: &Shape, slots: Range<usize>) -> Vec<usize> {
        let new: Vec<usize> = slots.filter(|&s| self.corners[s].is_none()).collect();
        if new.is_empty() {
            return new;
        }
        let psf = input.psf;
        let ahead = input.traces.filter(|t| t.is_on(&input.plan.fullwave));
        let per_fiber = 2 * sh.nfull;
        let (spots, coefs) = self.table_lens(sh);
        let (xy, coef) = self
            .buffers
            .reals
            .current_mut(spots + coefs)
            .split_at_mut(spots);
        let corners = self.buffers.ints.current_mut(spots);
        let bundles = &self.bundles;
        let fiber_of = |i: usize| bundles[i / sh.bundlesize] + i % sh.bundlesize;
        let wanted = |i: &usize| new.contains(&(i / sh.bundlesize));
        xy.par_chunks_mut(per_fiber)
            .zip(corners.par_chunks_mut(per_fiber))
            .enumerate()
            .filter(|(i, _)| wanted(i))
            .for_each(|(i, (xy, c))| fiber_trace(input, ahead, fiber_of(i), xy, c));
        for (i, c) in coef.chunks_exact_mut(self.coef_per_fiber).enumerate() {
            if wanted(&i) {
                coefficients(psf, fiber_of(i), c);
            }
        }
        let per_bundle = sh.bundlesize * per_fiber;
        for &s in &new {
            let c = &corners[s * per_bundle..(s + 1) * per_bundle];
            self.corners[s] = Some(bundle_corners(c, self.bundles[s], sh, psf.spot_shape()));
        }
        new
    }

    /// Lays out the patches `range` of the frame on the CCD: the live ones (with pixels) join
    /// `live`, the results of the others `off`.
    fn lay_out(
        &mut self,
        input: &FrameInput<'_>,
        patches: &[&Patch],
        sh: &Shape,
        range: Range<usize>,
    ) {
        let ccd = (input.image.nrows, input.image.ncols);
        let (bundles, corners) = (&self.bundles, &self.corners);
        let laid_out: Vec<Live> = range
            .into_par_iter()
            .map(|i| {
                let p = patches[i];
                let slot = bundles.binary_search(&p.bundle_start).expect("listed");
                let c = corners[slot].as_ref().expect("traced");
                (i, PatchGeometry::new(input.plan, p, c, ccd), slot)
            })
            .collect();
        for (i, g, slot) in laid_out {
            if g.is_empty() {
                let r = PatchResult::empty(patches[i], sh.ndiag, PatchStatus::OffImage);
                self.off.push((i, r));
            } else {
                self.live.push((i, g, slot));
            }
        }
    }

    /// The first spot of each fiber block of the live patches `live`, counted from the first
    /// spot of bundle slot `slot0`, -1 for none.
    fn write_first_spots(&mut self, sh: &Shape, live: Range<usize>, slot0: usize) {
        let at = 2 * self.nspots + live.start * sh.nblock;
        let len = live.len() * sh.nblock;
        let ints = self.buffers.ints.current_mut(at + len);
        fill_first_spots(&self.live[live], sh, slot0, &mut ints[at..]);
    }

    /// Appends the pixel boxes, kept bins and model box offsets of the live patches `live`;
    /// returns the range of their model boxes in the frame's.
    fn add_boxes(&mut self, patches: &[&Patch], live: Range<usize>) -> Range<usize> {
        let start = self.box_total;
        for (i, g, _) in &self.live[live] {
            self.boxes.extend_from_slice(&[
                g.rows.start as i32,
                g.rows.end as i32,
                g.cols.start as i32,
                g.cols.end as i32,
            ]);
            self.nkeep.push(patches[*i].waves.len() as i32);
            self.boxoff.push((self.box_total - start) as i64);
            self.box_at.push(self.box_total);
            self.box_total += g.rows.len() * g.cols.len();
        }
        start..self.box_total
    }

    /// The columns of the CCD the live patches `live` need beyond those uploaded.
    fn image_strips(&mut self, live: Range<usize>) -> Vec<Range<usize>> {
        let cols = self.live[live].iter().map(|(_, g, _)| &g.cols);
        let start = cols.clone().map(|c| c.start).min().unwrap_or(0);
        let need = start..cols.map(|c| c.end).max().unwrap_or(0);
        let (cols, strips) = new_columns(self.cols.clone(), need);
        self.cols = Some(cols);
        strips
    }

    /// Trace positions `[spot][x, y]` of the spots of bundle slot `slot`, and where they
    /// start in the frame's table.
    pub(crate) fn xy(&self, sh: &Shape, slot: usize) -> (usize, &[f64]) {
        self.buffers
            .reals
            .part(0, slot, 2 * sh.bundlesize * sh.nfull)
    }

    /// Legendre coefficients of GHSIGX, GHSIGY and the GH-i-j, `[fiber][param][k]`, of the
    /// fibers of bundle slot `slot`, and where they start in the frame's table.
    pub(crate) fn coef(&self, sh: &Shape, slot: usize) -> (usize, &[f64]) {
        let per = sh.bundlesize * self.coef_per_fiber;
        self.buffers.reals.part(2 * self.nspots, slot, per)
    }

    /// Spot corners `[spot][column, row]` of bundle slot `slot`, and where they start.
    pub(crate) fn corners(&self, sh: &Shape, slot: usize) -> (usize, &[i32]) {
        self.buffers
            .ints
            .part(0, slot, 2 * sh.bundlesize * sh.nfull)
    }

    /// The first spot of each fiber block `[live patch][block]` of the live patches `live`,
    /// counted from their wave's first spot, -1 for none: the device expands it into the
    /// column tables (`column_table`, kernels/assemble.cu).
    pub(crate) fn first_spots(&self, sh: &Shape, live: Range<usize>) -> &[i32] {
        let at = 2 * self.nspots;
        let ints = self.buffers.ints.current(at + live.end * sh.nblock);
        &ints[at + live.start * sh.nblock..]
    }

    /// The tables of wave `wi`'s patches, in the order of its batch: their live entries and
    /// model box offsets (within the wave's boxes).
    pub(crate) fn wave_patches(&self, wi: usize) -> (Cow<'_, [Live]>, Cow<'_, [i64]>) {
        let w = &self.waves[wi];
        if w.picked.is_empty() {
            let live = w.live.clone();
            return (
                Cow::Borrowed(&self.live[live.clone()]),
                Cow::Borrowed(&self.boxoff[live]),
            );
        }
        let live = w.picked.iter().map(|&li| self.live[li].clone()).collect();
        let boxoff = w.picked.iter().map(|&li| self.picked_box(w, li)).collect();
        (Cow::Owned(live), Cow::Owned(boxoff))
    }

    /// Where the model box of live patch `li` starts within the boxes of wave `w`, which
    /// solves it (again).
    fn picked_box(&self, w: &Wave, li: usize) -> i64 {
        (self.box_at[li] - w.boxes.start) as i64
    }

    /// Where the first model box that wave `w` writes starts within its boxes: 0 but for a
    /// wave that solves again patches of one before, whose boxes may start earlier.
    pub(crate) fn first_box(&self, w: &Wave) -> usize {
        self.box_at[w.first_patch()] - w.boxes.start
    }

    /// The device tables of the patches of `w`, a wave that solves again the live patches
    /// `w.picked` (of one wave or several), gathered in that order: their first spots
    /// (counted from `w`'s first spot), pixel boxes, kept bins and model box offsets (within
    /// `w`'s boxes).
    pub(crate) fn picked_tables(&self, sh: &Shape, w: &Wave) -> PickedTables {
        let nb = sh.nblock;
        let mut t = PickedTables {
            first_spots: vec![0; w.picked.len() * nb],
            ..PickedTables::default()
        };
        for (k, &li) in w.picked.iter().enumerate() {
            let first = &mut t.first_spots[k * nb..(k + 1) * nb];
            fill_first_spots(&self.live[li..li + 1], sh, w.slots.start, first);
            t.boxes.extend_from_slice(&self.boxes[4 * li..4 * li + 4]);
            t.nkeep.push(self.nkeep[li]);
            t.boxoff.push(self.picked_box(w, li));
        }
        t
    }

    /// Values of the frame's table of trace positions (or corners), and of its table of
    /// Legendre coefficients.
    pub(crate) fn table_lens(&self, sh: &Shape) -> (usize, usize) {
        let nfibers = self.bundles.len() * sh.bundlesize;
        (2 * self.nspots, nfibers * self.coef_per_fiber)
    }

    /// The pixels and inverse variances of columns `cols`, row by row, packed into the next
    /// strip buffer once its last upload is done. Upload them, then [`FrameHost::uploaded`].
    pub(crate) fn pack_strip(
        &mut self,
        input: &FrameInput<'_>,
        cols: Range<usize>,
    ) -> Result<(&[f32], &[f32])> {
        let img = input.image;
        let len = img.nrows * cols.len();
        let b = self.packed % 2;
        self.packed += 1;
        if let Some(done) = self.buffers.in_flight[b].take() {
            done.synchronize()
                .map_err(super::error::driver("wait for the upload of a strip"))?;
        }
        let buf = &mut self.buffers.strips[b];
        buf.get(2 * len);
        self.pageable |= !buf.is_pinned();
        let (pp, pv) = buf.current_mut(2 * len).split_at_mut(len);
        pack_columns(&img.pix, pp, cols.clone());
        pack_columns(&img.ivar, pv, cols);
        Ok((pp, pv))
    }

    /// Notes the end of the upload of the strip packed last.
    pub(crate) fn uploaded(&mut self, done: CudaEvent) {
        let last = self.packed.checked_sub(1).expect("a strip was packed") % 2;
        self.buffers.in_flight[last] = Some(done);
    }
}

/// Trace positions of one fiber on the padded grid, `[wave][x, y]`, into `xy`, and its
/// spots' corners, `[wave][column, row]`, into `corners`: copied from the traces evaluated
/// ahead on that grid if they hold the fiber, else evaluated (the same function, so the same
/// values).
fn fiber_trace(
    input: &FrameInput<'_>,
    ahead: Option<&TraceTable>,
    fiber: usize,
    xy: &mut [f64],
    corners: &mut [i32],
) {
    let waves = &input.plan.fullwave;
    match ahead.and_then(|t| t.fiber(fiber)) {
        Some((txy, tc)) => {
            xy.copy_from_slice(txy);
            corners.copy_from_slice(tc);
        }
        None => input.psf.trace_into(fiber, waves, xy, corners),
    }
}

/// Values of the largest strip of the image (pixels and inverse variances) that the waves
/// `planned` of `patches` can ask for, from the traces evaluated ahead (None without them): the
/// columns of a wave's patches' fibers' spots, which hold its strip as long as its columns
/// meet those uploaded before (waves go bundle after bundle, across the CCD); a larger strip
/// would go from pageable memory and pin a larger buffer for the next.
fn largest_strip(
    input: &FrameInput<'_>,
    patches: &[&Patch],
    planned: &[Range<usize>],
    sh: &Shape,
) -> Option<usize> {
    let traces = input.traces?;
    let waves = &input.plan.fullwave;
    let mut spans = Vec::with_capacity(planned.len());
    for wave in planned.iter().filter(|w| !w.is_empty()) {
        let of = &patches[wave.clone()];
        let first = of.iter().map(|p| p.padded_fibers.start).min()?;
        let last = of.iter().map(|p| p.padded_fibers.end).max()?;
        spans.push(traces.corner_columns(first..last, waves)?);
    }
    let widest = spans
        .iter()
        .map(|(lo, hi)| (hi - lo) as usize + sh.nx)
        .max()?;
    Some(2 * input.image.nrows * widest.min(input.image.ncols))
}

/// The Legendre coefficients of GHSIGX, GHSIGY and the GH-i-j of `fiber`, `[param][k]`.
fn coefficients(psf: &GaussHermitePsf, fiber: usize, coef: &mut [f64]) {
    let ncoef = psf.ghsigx.ncoef;
    let params = [&psf.ghsigx, &psf.ghsigy].into_iter().chain(psf.gh.iter());
    for (l, o) in params.zip(coef.chunks_exact_mut(ncoef)) {
        o.copy_from_slice(&l.coeff[fiber * ncoef..(fiber + 1) * ncoef]);
    }
}

/// The corners of a bundle's spots, for the patches' layout, from its part of the table of
/// corners (`[fiber][wave][column, row]`).
fn bundle_corners(corners: &[i32], bundle: usize, sh: &Shape, (ny, nx): (usize, usize)) -> Corners {
    Corners {
        fibers: bundle..bundle + sh.bundlesize,
        nwave: sh.nfull,
        ny,
        nx,
        xc: corners.iter().step_by(2).copied().collect(),
        yc: corners.iter().skip(1).step_by(2).copied().collect(),
    }
}

/// Writes the first spot of each fiber block of `live` into `first` (`[patch][block]`),
/// counted from the first spot of bundle slot `slot0`, -1 for none.
fn fill_first_spots(live: &[Live], sh: &Shape, slot0: usize, first: &mut [i32]) {
    for (fs, (_, g, slot)) in first.chunks_mut(sh.nblock).zip(live) {
        fs.fill(-1);
        let lead = sh.nblock - g.block_fibers.len();
        let slot = slot - slot0;
        for (b, &f) in g.block_fibers.iter().enumerate() {
            fs[lead + b] = ((slot * sh.bundlesize + f) * sh.nfull + g.wave0) as i32;
        }
    }
}

/// The columns uploaded once `need` is, from `uploaded` (one range: a gap between them is
/// filled), and the strips that adds.
fn new_columns(
    uploaded: Option<Range<usize>>,
    need: Range<usize>,
) -> (Range<usize>, Vec<Range<usize>>) {
    match uploaded {
        None => (need.clone(), vec![need]),
        Some(u) => {
            let all = u.start.min(need.start)..u.end.max(need.end);
            let strips = [all.start..u.start, u.end..all.end];
            (all, strips.into_iter().filter(|s| !s.is_empty()).collect())
        }
    }
}

/// Copies columns `cols` of every row of `image` into `out`, row after row: as slices, where
/// the image's rows are contiguous (an image's arrays are in standard layout), rather than by
/// ndarray's assignment, value by value (5% of a GPU run's CPU time, 30 plain frames on one
/// H200).
fn pack_columns(image: &ndarray::Array2<f32>, out: &mut [f32], cols: Range<usize>) {
    out.par_chunks_mut(cols.len())
        .zip(image.axis_iter(ndarray::Axis(0)).into_par_iter())
        .for_each(|(o, row)| match row.as_slice() {
            Some(row) => o.copy_from_slice(&row[cols.clone()]),
            None => ArrayViewMut1::from(o).assign(&row.slice(s![cols.clone()])),
        });
}

#[cfg(test)]
#[path = "tables_tests.rs"]
mod tests;
