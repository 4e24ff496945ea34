//! The host tables of a chunk of patches: trace positions and spot corners of its bundles,
//! the PSF's Legendre coefficients, each patch's pixel box and the first spot of each of its
//! fiber blocks (from which the device writes its column table), and its image region. Built
//! on a helper thread while the device solves the previous chunk, the larger ones straight
//! into the buffers they are uploaded from, which become pinned.

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

/// The host buffers a chunk is uploaded from: its image region and its larger tables. They
/// become pinned once allowed (staging.rs), after a backend's first frame; from pageable
/// memory the driver copies each upload through a buffer of its own before it returns, which
/// took about 1 ms of the host's time per chunk of a full frame for the tables alone, time
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

    /// Lets the buffers of `pool`, which serve the chunks in turn, be pinned in the
    /// background from their next use on, each as large as the largest of its kind so far.
    pub(crate) fn allow_pinning(pool: &mut [Uploads]) {
        let largest = |f: fn(&Uploads) -> usize| pool.iter().map(f).max().unwrap_or(0);
        let image = largest(|u| u.image.largest());
        let reals = largest(|u| u.reals.largest());
        let ints = largest(|u| u.ints.largest());
        tracing::debug!("largest uploads: image {image}, reals {reals}, ints {ints} values");
        for u in pool {
            u.image.allow_pinning(image);
            u.reals.allow_pinning(reals);
            u.ints.allow_pinning(ints);
        }
    }
}

/// Host-side tables of a chunk.
pub(crate) struct ChunkHost {
    /// Patches of the chunk that have pixels, with their geometry and bundle slot.
    pub(crate) live: Vec<(usize, PatchGeometry, usize)>,
    /// Results of patches without pixels (off the CCD), by position in the chunk.
    pub(crate) off: Vec<(usize, PatchResult)>,
    pub(crate) bundles: Vec<usize>,
    /// Spots of the chunk's bundles: (bundle slot * bundlesize + fiber) * nfull + wave.
    pub(crate) nspots: usize,
    /// Values in the table of Legendre coefficients.
    coef_len: usize,
    /// Values in the table of first spots (a fiber block per live patch each).
    nfirst: usize,
    pub(crate) boxes: Vec<i32>,
    pub(crate) nkeep: Vec<i32>,
    pub(crate) boxoff: Vec<i64>,
    pub(crate) box_total: usize,
    pub(crate) region: (usize, usize, usize, usize),
    /// The buffers of the upload (the image unused when no patch has pixels).
    pub(crate) buffers: Uploads,
    /// Whether the upload goes from pinned buffers only.
    pub(crate) pinned: bool,
    /// Host time spent preparing the chunk, milliseconds.
    pub(crate) prep_ms: f64,
}

impl ChunkHost {
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

    /// The first spot of each fiber block `[live patch][block]`, -1 for none: the device
    /// expands it into the column tables (`column_table`, kernels/assemble.cu).
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

    /// The image region, `npix` pixels then as many inverse variances.
    pub(crate) fn image(&self, npix: usize) -> &[f32] {
        self.buffers.image.current(2 * npix)
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

/// The corners of each bundle's spots, for the patches' layout, from the chunk's table of
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

/// Builds the host tables of a chunk, the larger ones and its image region into `buffers`
/// (grown if needed). Runs on a helper thread while the device solves the previous chunk.
pub(crate) fn prepare(
    input: &FrameInput<'_>,
    chunk: &[&Patch],
    sh: &Shape,
    mut buffers: Uploads,
) -> Result<ChunkHost> {
    let t0 = Instant::now();
    let _r = nvtx::LocalRange::new(c"host tables");
    let plan = input.plan;
    let psf = input.psf;
    let mut bundles: Vec<usize> = chunk.iter().map(|p| p.bundle_start).collect();
    bundles.sort_unstable();
    bundles.dedup();
    let fibers: Vec<usize> = bundles.iter().flat_map(|&b| b..b + sh.bundlesize).collect();
    let nspots = fibers.len() * plan.fullwave.len();
    let coef_len = fibers.len() * (2 + psf.ngh()) * psf.ghsigx.ncoef;
    // corners, then room for the first spots of each patch's fiber blocks
    let ints = buffers.ints.get(2 * nspots + chunk.len() * sh.nblock);
    let (corners, first) = ints.split_at_mut(2 * nspots);
    let (xy, coef) = buffers
        .reals
        .get(2 * nspots + coef_len)
        .split_at_mut(2 * nspots);
    traces(psf, &fibers, &plan.fullwave, xy, corners);
    coefficients(psf, &fibers, coef);
    let per_bundle = bundle_corners(corners, &bundles, sh, psf.spot_shape());
    let t_traces = t0.elapsed().as_secs_f64() * 1e3;
    let ccd = (input.image.nrows, input.image.ncols);
    let laid_out: Vec<(usize, PatchGeometry, usize)> = chunk
        .par_iter()
        .enumerate()
        .map(|(i, p)| {
            let slot = bundles
                .binary_search(&p.bundle_start)
                .expect("bundle listed");
            (i, PatchGeometry::new(plan, p, &per_bundle[slot], ccd), slot)
        })
        .collect();
    let (live, empty): (Vec<_>, Vec<_>) = laid_out.into_iter().partition(|(_, g, _)| !g.is_empty());
    let off: Vec<(usize, PatchResult)> = empty
        .into_iter()
        .map(|(i, _, _)| {
            let r = PatchResult::empty(chunk[i], sh.ndiag, PatchStatus::OffImage);
            (i, r)
        })
        .collect();
    let nfirst = live.len() * sh.nblock;
    let first = &mut first[..nfirst];
    first.fill(-1);
    for (fs, (_, g, slot)) in first.chunks_mut(sh.nblock).zip(&live) {
        let lead = sh.nblock - g.block_fibers.len();
        for (b, &f) in g.block_fibers.iter().enumerate() {
            fs[lead + b] = ((slot * sh.bundlesize + f) * sh.nfull + g.wave0) as i32;
        }
    }
    let mut boxes = Vec::with_capacity(live.len() * 4);
    let mut nkeep = Vec::with_capacity(live.len());
    let mut boxoff = Vec::with_capacity(live.len());
    let mut box_total = 0usize;
    let mut region = (usize::MAX, 0, usize::MAX, 0);
    for (i, g, _) in &live {
        boxes.extend_from_slice(&[
            g.rows.start as i32,
            g.rows.end as i32,
            g.cols.start as i32,
            g.cols.end as i32,
        ]);
        nkeep.push(chunk[*i].waves.len() as i32);
        boxoff.push(box_total as i64);
        box_total += g.rows.len() * g.cols.len();
        region = (
            region.0.min(g.rows.start),
            region.1.max(g.rows.end),
            region.2.min(g.cols.start),
            region.3.max(g.cols.end),
        );
    }
    let t_tables = t0.elapsed().as_secs_f64() * 1e3;
    // the image region, pixels then inverse variances
    if !live.is_empty() {
        pack_image(input, region, &mut buffers.image);
    }
    let pinned = buffers.is_pinned(!live.is_empty());
    let prep_ms = t0.elapsed().as_secs_f64() * 1e3;
    tracing::debug!(
        "host tables of {} patches: traces {t_traces:.1} ms, layout {:.1} ms, image {:.1} ms \
         ({})",
        chunk.len(),
        t_tables - t_traces,
        prep_ms - t_tables,
        if pinned { "pinned" } else { "pageable" }
    );
    Ok(ChunkHost {
        live,
        off,
        bundles,
        nspots,
        coef_len,
        nfirst,
        boxes,
        nkeep,
        boxoff,
        box_total,
        region,
        buffers,
        pinned,
        prep_ms,
    })
}

/// Copies the image region `(row0, row1, col0, col1)` into `image`, pixels then inverse
/// variances row by row.
fn pack_image(
    input: &FrameInput<'_>,
    region: (usize, usize, usize, usize),
    image: &mut Staging<f32>,
) {
    let img = input.image;
    let (r0, r1, c0, c1) = region;
    let npix = (r1 - r0) * (c1 - c0);
    let (pp, pv) = image.get(2 * npix).split_at_mut(npix);
    let w = c1 - c0;
    let (pix, ivar) = (
        img.pix.slice(s![r0..r1, c0..c1]),
        img.ivar.slice(s![r0..r1, c0..c1]),
    );
    pp.par_chunks_mut(w)
        .zip(pv.par_chunks_mut(w))
        .enumerate()
        .for_each(|(r, (dp, dv))| {
            ArrayViewMut1::from(dp).assign(&pix.row(r));
            ArrayViewMut1::from(dv).assign(&ivar.row(r));
        });
}
