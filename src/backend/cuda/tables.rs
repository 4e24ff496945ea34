//! The host tables of a frame, its one chunk: trace positions and spot corners of its
//! bundles, the PSF's Legendre coefficients, each patch's pixel box and the first spot of each
//! of its fiber blocks (from which the device writes its column table), its image region, and
//! the waves in which the device walks its patches. Built once per frame, the larger ones
//! straight into the buffers they are uploaded from, which become pinned.

use std::ops::Range;

use std::sync::Arc;
use std::time::Instant;

use cudarc::driver::CudaContext;
use ndarray::{s, ArrayViewMut1};
use rayon::prelude::*;

use super::staging::Staging;
use super::workspace::Shape;
use crate::backend::FrameInput;
use crate::error::Result;
use crate::extract::{PatchGeometry, PatchResult, PatchStatus};
use crate::plan::Patch;
use crate::psf::{Corners, GaussHermitePsf};

/// The host buffers a frame is uploaded from: its image region and its larger tables. They
/// become pinned once allowed (staging.rs), after a backend's first frame; from pageable
/// memory the driver copies each upload through a buffer of its own before it returns, time
/// in which the host queues nothing.
pub(crate) struct Uploads {
    /// Pixels, then inverse variances, row by row.
    image: Staging<f32>,
    /// Trace positions, then Legendre coefficients.
    reals: Staging<f64>,
    /// Spot corners, then the first spots of the fiber blocks.
    ints: Staging<i32>,
}

impl Uploads {
    pub(crate) fn new(ctx: &Arc<CudaContext>) -> Self {
        Uploads {
            image: Staging::new(ctx.clone()),
            reals: Staging::new(ctx.clone()),
            ints: Staging::new(ctx.clone()),
        }
    }

    /// Whether the buffers of the last use are pinned (`image`: whether it was used).
    fn is_pinned(&self, image: bool) -> bool {
        self.reals.is_pinned() && self.ints.is_pinned() && (!image || self.image.is_pinned())
    }

    /// Lets the buffers be pinned in the background from their next use on, each as large as
    /// the largest asked for so far.
    pub(crate) fn allow_pinning(&mut self) {
        let (image, reals, ints) = (
            self.image.largest(),
            self.reals.largest(),
            self.ints.largest(),
        );
        tracing::debug!("largest uploads: image {image}, reals {reals}, ints {ints} values");
        self.image.allow_pinning(image);
        self.reals.allow_pinning(reals);
        self.ints.allow_pinning(ints);
    }
}

/// Live patches the device solves together, through the workspace's per-patch buffers: a
/// frame is one chunk (one upload, tables built once), walked in waves so that those buffers
/// stay within the memory budget, with no host synchronisation between waves.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct Wave {
    /// Its patches, as indices into the frame's live patches.
    pub(crate) live: Range<usize>,
    /// The bundle slots of its patches, whose spots it evaluates.
    pub(crate) slots: Range<usize>,
    /// Its model boxes within the frame's (its box offsets start at 0).
    pub(crate) boxes: Range<usize>,
}

impl Wave {
    pub(crate) fn len(&self) -> usize {
        self.live.len()
    }

    /// Index of its first spot in the frame's tables (trace positions, corners).
    pub(crate) fn spot0(&self, sh: &Shape) -> usize {
        self.slots.start * sh.bundlesize * sh.nfull
    }

    /// Spots of its bundles.
    pub(crate) fn nspots(&self, sh: &Shape) -> usize {
        self.slots.len() * sh.bundlesize * sh.nfull
    }
}

/// The lengths of `n` patches' waves of at most `size` each, as equal as can be.
pub(crate) fn wave_lengths(n: usize, size: usize) -> Vec<usize> {
    let count = n.div_ceil(size.max(1));
    (0..count)
        .map(|i| n / count + usize::from(i < n % count))
        .collect()
}

/// Host-side tables of a frame.
pub(crate) struct FrameHost {
    /// Patches of the frame that have pixels, with their geometry and bundle slot, in the
    /// order of the waves.
    pub(crate) live: Vec<(usize, PatchGeometry, usize)>,
    /// Results of patches without pixels (off the CCD), by position in the call.
    pub(crate) off: Vec<(usize, PatchResult)>,
    pub(crate) bundles: Vec<usize>,
    pub(crate) waves: Vec<Wave>,
    /// Spots of the frame's bundles: (bundle slot * bundlesize + fiber) * nfull + wave.
    pub(crate) nspots: usize,
    /// Values in the table of Legendre coefficients.
    coef_len: usize,
    /// Values in the table of first spots (a fiber block per live patch each).
    nfirst: usize,
    pub(crate) boxes: Vec<i32>,
    pub(crate) nkeep: Vec<i32>,
    /// Each patch's model box within its wave's.
    pub(crate) boxoff: Vec<i64>,
    pub(crate) box_total: usize,
    /// Rows and columns of the CCD uploaded: whole rows, so that they are one slice of the
    /// frame's arrays.
    pub(crate) region: (usize, usize, usize, usize),
    /// Whether the image region was packed into the pinned buffer of `buffers`; else it is
    /// uploaded straight from the frame's arrays.
    pub(crate) image_packed: bool,
    /// The buffers of the upload.
    pub(crate) buffers: Uploads,
    /// Whether the upload goes from pinned buffers only.
    pub(crate) pinned: bool,
    /// Host time spent preparing the frame, milliseconds.
    pub(crate) prep_ms: f64,
}

impl FrameHost {
    /// Trace positions `[spot][x, y]`.
    pub(crate) fn xy(&self) -> &[f64] {
        &self.reals()[..2 * self.nspots]
    }

    /// Legendre coefficients of GHSIGX, GHSIGY and the GH-i-j, `[fiber][param][k]`.
    pub(crate) fn coef(&self) -> &[f64] {
        &self.reals()[2 * self.nspots..]
    }

    /// Spot corners `[spot][column, row]`.
    pub(crate) fn corners(&self) -> &[i32] {
        &self.ints()[..2 * self.nspots]
    }

    /// The first spot of each fiber block `[live patch][block]`, counted from its wave's first
    /// spot, -1 for none: the device expands it into the column tables (`column_table`,
    /// kernels/assemble.cu).
    pub(crate) fn first_spots(&self) -> &[i32] {
        &self.ints()[2 * self.nspots..]
    }

    fn reals(&self) -> &[f64] {
        self.buffers.reals.current(2 * self.nspots + self.coef_len)
    }

    fn ints(&self) -> &[i32] {
        let len = 2 * self.nspots + self.nfirst;
        self.buffers.ints.current(len)
    }

    /// Values of each of the image region's arrays.
    pub(crate) fn npix(&self) -> usize {
        let (r0, r1, c0, c1) = self.region;
        (r1 - r0) * (c1 - c0)
    }

    /// The image region's pixels and inverse variances, from the pinned buffer they were
    /// packed into, or else from the frame's arrays.
    pub(crate) fn image<'a>(&'a self, input: &'a FrameInput<'_>) -> (&'a [f32], &'a [f32]) {
        let npix = self.npix();
        if self.image_packed {
            return self.buffers.image.current(2 * npix).split_at(npix);
        }
        let rows = |a: &'a ndarray::Array2<f32>| {
            let all = a.as_slice().expect("images are kept in standard layout");
            &all[self.region.0 * a.ncols()..][..npix]
        };
        (rows(&input.image.pix), rows(&input.image.ivar))
    }
}

/// Trace positions of one fiber on the padded grid, `[wave][x, y]`, into `xy`, and its
/// spots' corners, `[wave][column, row]`, into `corners`.
fn fiber_trace(
    psf: &GaussHermitePsf,
    fiber: usize,
    waves: &[f64],
    xy: &mut [f64],
    corners: &mut [i32],
) {
    let (xs, ys) = psf.trace(fiber, waves);
    for (((&x, &y), p), c) in xs
        .iter()
        .zip(&ys)
        .zip(xy.chunks_exact_mut(2))
        .zip(corners.chunks_exact_mut(2))
    {
        let (cx, cy) = psf.corner_of(x, y);
        p.copy_from_slice(&[x, y]);
        c.copy_from_slice(&[cx, cy]);
    }
}

/// The trace positions and spot corners of `fibers` (`[fiber][wave][2]` each), in parallel,
/// straight into the tables that go to the device.
fn traces(
    psf: &GaussHermitePsf,
    fibers: &[usize],
    waves: &[f64],
    xy: &mut [f64],
    corners: &mut [i32],
) {
    let per = 2 * waves.len();
    xy.par_chunks_mut(per)
        .zip(corners.par_chunks_mut(per))
        .zip(fibers)
        .for_each(|((xy, c), &f)| fiber_trace(psf, f, waves, xy, c));
}

/// The Legendre coefficients of GHSIGX, GHSIGY and the GH-i-j of `fibers`, `[fiber][param][k]`.
fn coefficients(psf: &GaussHermitePsf, fibers: &[usize], coef: &mut [f64]) {
    let ncoef = psf.ghsigx.ncoef;
    let params = [&psf.ghsigx, &psf.ghsigy].into_iter().chain(psf.gh.iter());
    let per_fiber = params.clone().count() * ncoef;
    for (&f, out) in fibers.iter().zip(coef.chunks_exact_mut(per_fiber)) {
        for (l, o) in params.clone().zip(out.chunks_exact_mut(ncoef)) {
            o.copy_from_slice(&l.coeff[f * ncoef..(f + 1) * ncoef]);
        }
    }
}

/// The corners of each bundle's spots, for the patches' layout, from the frame's table of
/// corners (`[fiber][wave][column, row]`, bundle after bundle).
fn bundle_corners(
    corners: &[i32],
    bundles: &[usize],
    sh: &Shape,
    (ny, nx): (usize, usize),
) -> Vec<Corners> {
    let per = 2 * sh.nfull * sh.bundlesize;
    bundles
        .par_iter()
        .zip(corners.par_chunks(per))
        .map(|(&b, c)| Corners {
            fibers: b..b + sh.bundlesize,
            nwave: sh.nfull,
            ny,
            nx,
            xc: c.iter().step_by(2).copied().collect(),
            yc: c.iter().skip(1).step_by(2).copied().collect(),
        })
        .collect()
}

/// Builds the host tables of a frame's `patches` (ordered by bundle), the larger ones and its
/// image region into `buffers` (grown if needed), with its live patches in waves of at most
/// `wave_max`.
pub(crate) fn prepare(
    input: &FrameInput<'_>,
    patches: &[&Patch],
    sh: &Shape,
    mut buffers: Uploads,
    wave_max: usize,
) -> Result<FrameHost> {
    let t0 = Instant::now();
    let _r = nvtx::LocalRange::new(c"host tables");
    let plan = input.plan;
    let psf = input.psf;
    let mut bundles: Vec<usize> = patches.iter().map(|p| p.bundle_start).collect();
    bundles.sort_unstable();
    bundles.dedup();
    let fibers: Vec<usize> = bundles.iter().flat_map(|&b| b..b + sh.bundlesize).collect();
    let nspots = fibers.len() * plan.fullwave.len();
    let coef_len = fibers.len() * (2 + psf.ngh()) * psf.ghsigx.ncoef;
    // corners, then room for the first spots of each patch's fiber blocks
    let ints = buffers.ints.get(2 * nspots + patches.len() * sh.nblock);
    let (corners, first) = ints.split_at_mut(2 * nspots);
    let (xy, coef) = buffers
        .reals
        .get(2 * nspots + coef_len)
        .split_at_mut(2 * nspots);
    traces(psf, &fibers, &plan.fullwave, xy, corners);
    coefficients(psf, &fibers, coef);
    let per_bundle = bundle_corners(corners, &bundles, sh, psf.spot_shape());
    let t_traces = t0.elapsed().as_secs_f64() * 1e3;
    let (live, off) = layout(input, patches, sh, &bundles, &per_bundle);
    let mut waves = split_into_waves(&live, wave_max);
    let nfirst = live.len() * sh.nblock;
    first_spots(&live, &waves, sh, &mut first[..nfirst]);
    let boxes = Boxes::new(&live, &mut waves, patches);
    let t_tables = t0.elapsed().as_secs_f64() * 1e3;
    let region = match boxes.rows {
        Some((r0, r1)) => (r0, r1, 0, input.image.ncols),
        None => (0, 0, 0, 0),
    };
    let image_packed = !live.is_empty() && pack_image(input, region, &mut buffers.image);
    let pinned = buffers.is_pinned(image_packed);
    let prep_ms = t0.elapsed().as_secs_f64() * 1e3;
    tracing::debug!(
        "host tables of {} patches in {} waves: traces {t_traces:.1} ms, layout {:.1} ms, \
         image {:.1} ms ({})",
        patches.len(),
        waves.len(),
        t_tables - t_traces,
        prep_ms - t_tables,
        if pinned { "pinned" } else { "pageable" }
    );
    Ok(FrameHost {
        live,
        off,
        bundles,
        waves,
        nspots,
        coef_len,
        nfirst,
        boxes: boxes.boxes,
        nkeep: boxes.nkeep,
        boxoff: boxes.boxoff,
        box_total: boxes.total,
        region,
        image_packed,
        buffers,
        pinned,
        prep_ms,
    })
}

/// A live patch: its position in the call, its geometry and its bundle slot.
type Live = (usize, PatchGeometry, usize);

/// Lays out every patch on the CCD: the live ones (with pixels), and the results of the
/// others, by position in `patches`.
fn layout(
    input: &FrameInput<'_>,
    patches: &[&Patch],
    sh: &Shape,
    bundles: &[usize],
    per_bundle: &[Corners],
) -> (Vec<Live>, Vec<(usize, PatchResult)>) {
    let ccd = (input.image.nrows, input.image.ncols);
    let laid_out: Vec<Live> = patches
        .par_iter()
        .enumerate()
        .map(|(i, p)| {
            let slot = bundles
                .binary_search(&p.bundle_start)
                .expect("bundle listed");
            let g = PatchGeometry::new(input.plan, p, &per_bundle[slot], ccd);
            (i, g, slot)
        })
        .collect();
    let (live, empty): (Vec<_>, Vec<_>) = laid_out.into_iter().partition(|(_, g, _)| !g.is_empty());
    let off = empty
        .into_iter()
        .map(|(i, _, _)| {
            let r = PatchResult::empty(patches[i], sh.ndiag, PatchStatus::OffImage);
            (i, r)
        })
        .collect();
    (live, off)
}

/// The live patches in waves of at most `wave_max`, as equal as can be.
fn split_into_waves(live: &[Live], wave_max: usize) -> Vec<Wave> {
    let mut start = 0;
    wave_lengths(live.len(), wave_max)
        .into_iter()
        .map(|len| {
            let range = start..start + len;
            start += len;
            let slots = live[range.clone()].iter().map(|l| l.2);
            let (lo, hi) = (slots.clone().min(), slots.max());
            Wave {
                live: range,
                slots: lo.unwrap_or(0)..hi.map_or(0, |h| h + 1),
                boxes: 0..0,
            }
        })
        .collect()
}

/// The first spot of each fiber block of the live patches, counted from their wave's first
/// spot, -1 for none.
fn first_spots(live: &[Live], waves: &[Wave], sh: &Shape, first: &mut [i32]) {
    first.fill(-1);
    for w in waves {
        let rows = first[w.live.start * sh.nblock..w.live.end * sh.nblock].chunks_mut(sh.nblock);
        for (fs, (_, g, slot)) in rows.zip(&live[w.live.clone()]) {
            let lead = sh.nblock - g.block_fibers.len();
            let slot = slot - w.slots.start;
            for (b, &f) in g.block_fibers.iter().enumerate() {
                fs[lead + b] = ((slot * sh.bundlesize + f) * sh.nfull + g.wave0) as i32;
            }
        }
    }
}

/// The pixel boxes of the live patches, their kept bins and model boxes, and the rows of the
/// CCD they cover (None without live patches).
struct Boxes {
    boxes: Vec<i32>,
    nkeep: Vec<i32>,
    boxoff: Vec<i64>,
    total: usize,
    rows: Option<(usize, usize)>,
}

impl Boxes {
    /// Also sets each wave's range of model boxes.
    fn new(live: &[Live], waves: &mut [Wave], patches: &[&Patch]) -> Self {
        let mut b = Boxes {
            boxes: Vec::with_capacity(live.len() * 4),
            nkeep: Vec::with_capacity(live.len()),
            boxoff: Vec::with_capacity(live.len()),
            total: 0,
            rows: None,
        };
        for w in waves {
            let start = b.total;
            for (i, g, _) in &live[w.live.clone()] {
                b.boxes.extend_from_slice(&[
                    g.rows.start as i32,
                    g.rows.end as i32,
                    g.cols.start as i32,
                    g.cols.end as i32,
                ]);
                b.nkeep.push(patches[*i].waves.len() as i32);
                b.boxoff.push((b.total - start) as i64);
                b.total += g.rows.len() * g.cols.len();
                let (r0, r1) = b.rows.unwrap_or((g.rows.start, g.rows.end));
                b.rows = Some((r0.min(g.rows.start), r1.max(g.rows.end)));
            }
            w.boxes = start..b.total;
        }
        b
    }
}

/// Copies the image region `(row0, row1, col0, col1)` of whole rows into the pinned buffer of
/// `image`, pixels then inverse variances, when one is pinned and large enough; else starts
/// pinning one (once allowed) and returns false: the driver then uploads from the frame's
/// arrays as it would from a copy of them, and a first frame does not wait for the copy.
fn pack_image(
    input: &FrameInput<'_>,
    region: (usize, usize, usize, usize),
    image: &mut Staging<f32>,
) -> bool {
    let img = input.image;
    let (r0, r1, c0, c1) = region;
    debug_assert!(c0 == 0 && c1 == img.ncols, "whole rows");
    let npix = (r1 - r0) * (c1 - c0);
    if !image.has_pinned(2 * npix) {
        image.reserve(2 * npix);
        return false;
    }
    let (pp, pv) = image.get(2 * npix).split_at_mut(npix);
    let w = c1 - c0;
    let (pix, ivar) = (
        img.pix.slice(s![r0..r1, ..]),
        img.ivar.slice(s![r0..r1, ..]),
    );
    pp.par_chunks_mut(w)
        .zip(pv.par_chunks_mut(w))
        .enumerate()
        .for_each(|(r, (dp, dv))| {
            ArrayViewMut1::from(dp).assign(&pix.row(r));
            ArrayViewMut1::from(dv).assign(&ivar.row(r));
        });
    true
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::plan::{Plan, PlanOptions};

    fn shape() -> Shape {
        Shape {
            nx: 3,
            ny: 3,
            nt: 4,
            nws: 2,
            wavepad: 1,
            ncore: 2,
            nblock: 3,
            nfull: 10,
            bundlesize: 4,
            ndiag: 1,
        }
    }

    /// Twelve live patches, four per bundle slot 0, 1 and 2, with boxes of 2 x (1 + i) pixels
    /// at rows 10 + i.
    fn live() -> Vec<Live> {
        (0..12)
            .map(|i| {
                let g = PatchGeometry {
                    rows: 10 + i..12 + i,
                    cols: 0..1 + i,
                    block_fibers: if i % 2 == 0 {
                        vec![1, 2]
                    } else {
                        vec![0, 1, 2]
                    },
                    npad: 1,
                    wave0: i,
                    nwavetot: 4,
                };
                (20 + i, g, i / 4)
            })
            .collect()
    }

    #[test]
    fn waves_are_as_equal_as_can_be_within_the_size() {
        assert_eq!(wave_lengths(4700, 800), [784, 784, 783, 783, 783, 783]);
        assert_eq!(wave_lengths(12, 5), [4, 4, 4]);
        assert_eq!(wave_lengths(3, 10), [3]);
        assert!(wave_lengths(0, 10).is_empty());
        for (n, size) in [(4700, 1567), (11, 3), (1, 1), (7, 2)] {
            let l = wave_lengths(n, size);
            assert_eq!(l.iter().sum::<usize>(), n);
            assert!(l.iter().all(|&x| x > 0 && x <= size), "{l:?}");
            assert!(l.iter().max().unwrap() - l.iter().min().unwrap() <= 1);
        }
    }

    #[test]
    fn a_waves_tables_count_from_its_first_bundle_and_box() {
        let (sh, live) = (shape(), live());
        let mut waves = split_into_waves(&live, 5);
        let ranges: Vec<_> = waves
            .iter()
            .map(|w| (w.live.clone(), w.slots.clone()))
            .collect();
        assert_eq!(ranges, [(0..4, 0..1), (4..8, 1..2), (8..12, 2..3)]);
        assert_eq!(waves[2].spot0(&sh), 2 * 4 * 10);
        assert_eq!(waves[1].nspots(&sh), 4 * 10);

        let mut first = vec![0; live.len() * sh.nblock];
        first_spots(&live, &waves, &sh, &mut first);
        // patch 4 (wave 1, its slot the wave's first): two blocks, one leading -1
        assert_eq!(first[12..15], [-1, 10 + 4, 2 * 10 + 4]);
        // patch 9 (wave 2): three blocks, fiber f at f * nfull + wave0 within the wave
        assert_eq!(first[27..30], [9, 10 + 9, 2 * 10 + 9]);

        let plan = Plan::new(PlanOptions::new(6000.0, 6400.0, 0.8, 0, 25)).unwrap();
        let patches: Vec<&Patch> = plan.patches.iter().take(32).collect();
        let b = Boxes::new(&live, &mut waves, &patches);
        // boxes of 2 (1 + i) pixels: wave 1 holds patches 4-7, 10 + 12 + 14 + 16 values
        assert_eq!(waves[1].boxes, 20..72);
        assert_eq!(b.boxoff[4..8], [0, 10, 22, 36]);
        assert_eq!(b.boxoff[0], 0);
        assert_eq!(b.total, (0..12).map(|i| 2 * (1 + i)).sum::<usize>());
        assert_eq!(b.rows, Some((10, 23)));
        assert_eq!(b.boxes[4 * 5..4 * 6], [15, 17, 0, 6]);
        assert_eq!(b.nkeep[5], patches[25].waves.len() as i32);
    }
}
