//! Outlier rejection on the device (`--reject-outliers`, see [`crate::outliers`]): the same
//! test and the same passes as the CPU's (`backend::cpu::reject`), over a frame's waves.
//!
//! Each wave keeps, beside its results, the model `A xflux` of each patch over its box (the
//! finalize step projects it for chi2pix) and, in the first pass, a flag per box pixel that
//! the test looks at (`core_pixels` in kernels/reject.cu). Once every wave is done the host
//! copies the models back, tests the patches with [`find_outliers`] against the frame's image
//! and gives the outliers weight zero in a flag per box pixel on the device (`rejected`),
//! which the assembly and chi2pix read: in that patch only, since boxes overlap and the image
//! is shared. The waves that hold a patch with new outliers are queued again, all of their
//! patches solved from scratch (an unchanged patch gets the same result), and so on until a
//! pass finds no outlier or [`MAX_RESOLVES`] solves have been added, as on the CPU. Only
//! patches with new outliers are tested in the next pass; a patch the CPU reference solved
//! (a failed or coupled one) was tested there already.

use std::ops::Range;

use rayon::prelude::*;

use super::buffers::DevBuf;
use super::device::Device;
use super::error;
use super::kernels;
use super::launchers::Gpu;
use super::solve::{self, Sink};
use super::tables::FrameHost;
use super::tuning::Tuning;
use super::workspace::{Slot, Workspace};
use crate::backend::{FrameInput, Progress};
use crate::error::Result;
use crate::extract::PatchResult;
use crate::image::Image;
use crate::outliers::{find_outliers, MAX_RESOLVES};
use crate::plan::Patch;

/// The device's share of rejection: frame-sized arrays over every patch's box, in the order
/// of the waves' model boxes.
pub(crate) struct Boxes {
    /// Whether the frame being solved rejects outliers.
    on: bool,
    /// Passes done before the one being queued (0: the first solve).
    pass: usize,
    /// Where the wave being queued starts in the arrays.
    wave_at: usize,
    /// `A xflux` of each patch's last solution.
    fit: Slot<f64>,
    /// 1 where the test looks (pixels of the tested columns' spots).
    core: Slot<u8>,
    /// 1 where a pixel has weight zero in its patch.
    rejected: Slot<u8>,
}

impl Boxes {
    pub(crate) fn new() -> Self {
        Boxes {
            on: false,
            pass: 0,
            wave_at: 0,
            fit: Slot::new("model boxes of the outlier test"),
            core: Slot::new("tested pixels"),
            rejected: Slot::new("rejected pixels"),
        }
    }

    /// Starts a frame: rejection on or off, first pass.
    pub(crate) fn start(&mut self, on: bool) {
        self.on = on;
        self.pass = 0;
    }

    /// The device address of the wave's rejected-pixel flags, 0 (none) when rejection is off:
    /// the kernels' argument.
    pub(crate) fn rejected_ptr(&self) -> u64 {
        if self.on {
            self.rejected.get().at(self.wave_at)
        } else {
            0
        }
    }
}

/// Before a wave's assembly: points the flags at the wave's boxes (`boxes` within the frame's,
/// `total` values so far); in the first pass, sizes the arrays and clears the wave's flags.
pub(crate) fn prepare_wave(
    dev: &Device,
    ws: &mut Workspace,
    boxes: std::ops::Range<usize>,
    total: usize,
) -> Result<()> {
    let b = &mut ws.reject;
    if !b.on {
        return Ok(());
    }
    b.wave_at = boxes.start;
    if b.pass == 0 {
        b.fit.grow_keeping(dev, total, boxes.start)?;
        b.core.grow_keeping(dev, total, boxes.start)?;
        b.rejected.grow_keeping(dev, total, boxes.start)?;
        for s in [b.core.get(), b.rejected.get()] {
            zero_range(dev, s, boxes.clone())?;
        }
    }
    Ok(())
}

/// Sets the flags `range` of `b` to zero, on the compute stream.
fn zero_range(dev: &Device, b: &DevBuf<u8>, range: std::ops::Range<usize>) -> Result<()> {
    assert!(range.end <= b.len);
    if range.is_empty() {
        return Ok(());
    }
    // SAFETY: the range lies inside the allocation.
    unsafe {
        cudarc::driver::result::memset_d8_async(b.at(range.start), 0, range.len(), dev.cu_stream())
    }
    .map_err(error::driver("cuMemsetD8Async"))
}

/// After chi2pix: keeps the wave's `len` model values (`A xflux`, in `ws.model`) for the test
/// and, in the first pass, flags the pixels it looks at.
pub(crate) fn keep_fit(g: Gpu<'_>, ws: &Workspace, n: usize, len: usize) -> Result<()> {
    let b = &ws.reject;
    if !b.on || len == 0 {
        return Ok(());
    }
    g.dev
        .dtod_at(b.fit.get(), b.wave_at, ws.model.get(), 0, len)?;
    if b.pass > 0 {
        return Ok(());
    }
    let sh = g.sh;
    kernels::launch(
        g.dev,
        &g.k.core_pixels,
        "core_pixels",
        (sh.m() as u32, n as u32, 1),
        64,
        0,
        kernels::Args::new()
            .ptr(ws.spots.get().ptr)
            .ptr(ws.view.corners)
            .ptr(ws.colspot.get().ptr)
            .ptr(ws.view.boxes)
            .ptr(ws.view.boxoff)
            .i32(sh.m() as i32)
            .i32(sh.nx as i32)
            .i32(sh.ny as i32)
            .i32(sh.nt as i32)
            .i32(sh.ncore as i32)
            .i32(sh.wavepad as i32)
            .ptr(b.core.get().at(b.wave_at)),
    )
}

/// What rejection did to one live patch, as `backend::cpu::reject` reports it.
#[derive(Clone, Debug, Default)]
struct Done {
    nrejected: usize,
    nresolves: usize,
}

/// The passes after the first solve of a frame whose waves are all finished (`sink` holds
/// their results): test, flag, solve again the waves with new outliers, at most
/// [`MAX_RESOLVES`] times; then each device-solved patch's rejection counts and the fraction
/// of each core spot it lost, as the CPU path sets them.
#[allow(clippy::too_many_arguments)]
pub(crate) fn resolve<'a>(
    g: Gpu<'a>,
    tuning: &Tuning,
    ws: &mut Workspace,
    input: &FrameInput<'_>,
    patches: &[&'a Patch],
    host: &FrameHost,
    nsigma: f64,
    sink: &mut Sink<'_>,
) -> Result<()> {
    if host.live.is_empty() {
        return Ok(());
    }
    let frame = Frame::new(host, input.image);
    let mut rejected = vec![0u8; host.box_total];
    let mut core = vec![0u8; host.box_total];
    g.dev
        .copy_from(&mut core, ws.reject.core.get(), 0, "tested pixels")?;
    let before: Vec<Vec<f64>> = frame
        .ci
        .iter()
        .map(|&ci| pixmask_of(sink.results, ci))
        .collect();
    let mut done = vec![Done::default(); frame.ci.len()];
    let mut active = on_device(&frame, sink.results, (0..frame.ci.len()).collect());
    let mut fit = vec![0.0; host.box_total];
    let limits = (nsigma, input.options.psferr);
    for _ in 0..MAX_RESOLVES {
        if active.is_empty() {
            break;
        }
        g.dev
            .copy_from(&mut fit, ws.reject.fit.get(), 0, "model boxes")?;
        g.dev.sync("model boxes of the outlier test")?;
        let found: Vec<(usize, Vec<usize>)> = active
            .par_iter()
            .map(|&li| (li, frame.outliers(li, (&fit, &core, &rejected), limits)))
            .filter(|(_, o)| !o.is_empty())
            .collect();
        for (li, outliers) in &found {
            for &p in outliers {
                rejected[frame.at[*li] + p] = 1;
            }
            done[*li].nrejected += outliers.len();
            done[*li].nresolves += 1;
        }
        let changed: Vec<usize> = found.into_iter().map(|(li, _)| li).collect();
        if changed.is_empty() {
            break;
        }
        g.dev
            .copy_to(ws.reject.rejected.get(), &rejected, "rejected pixels")?;
        ws.reject.pass += 1;
        solve_again(g, tuning, ws, input, patches, host, &changed, sink)?;
        active = on_device(&frame, sink.results, changed);
    }
    for (li, d) in done.iter().enumerate() {
        let r = sink.results[frame.ci[li]].as_mut();
        if let Some(r) = r.filter(|r| r.rejected.is_empty()) {
            r.rejected = lost(&r.pixmask_fraction, &before[li]);
            (r.nrejected, r.nresolves) = (d.nrejected, d.nresolves);
        }
    }
    Ok(())
}

/// Queues again the waves of the live patches `changed` (sorted), then finishes them: their
/// results replace the ones before.
#[allow(clippy::too_many_arguments)]
fn solve_again<'a>(
    g: Gpu<'a>,
    tuning: &Tuning,
    ws: &mut Workspace,
    input: &FrameInput<'_>,
    patches: &[&'a Patch],
    host: &FrameHost,
    changed: &[usize],
    sink: &mut Sink<'_>,
) -> Result<()> {
    let waves = waves_of(host.waves.iter().map(|w| w.live.clone()), changed);
    let mut queued = Vec::with_capacity(waves.len());
    for &wi in &waves {
        queued.push(solve::queue_wave(g, tuning, ws, input, patches, host, wi)?);
    }
    // the call's progress counted these patches once already
    let silent = Progress::silent();
    let mut again = Sink {
        results: &mut *sink.results,
        last_mark: &mut *sink.last_mark,
        timings: &mut *sink.timings,
        progress: &silent,
    };
    for q in queued {
        solve::finish_wave(g, ws, input, host, q, &mut again)?;
    }
    Ok(())
}

/// The waves (by index, ascending) whose live ranges hold one of `patches` (sorted).
fn waves_of(waves: impl Iterator<Item = std::ops::Range<usize>>, patches: &[usize]) -> Vec<usize> {
    waves
        .enumerate()
        .filter(|(_, live)| {
            let i = patches.partition_point(|&li| li < live.start);
            patches.get(i).is_some_and(|li| live.contains(li))
        })
        .map(|(wi, _)| wi)
        .collect()
}

/// The live patches of `candidates` that the device solved: the CPU reference tested those
/// it solved itself (their `rejected` is set).
fn on_device(frame: &Frame, results: &[Option<PatchResult>], candidates: Vec<usize>) -> Vec<usize> {
    candidates
        .into_iter()
        .filter(|&li| {
            results[frame.ci[li]]
                .as_ref()
                .is_some_and(|r| r.rejected.is_empty())
        })
        .collect()
}

fn pixmask_of(results: &[Option<PatchResult>], ci: usize) -> Vec<f64> {
    results[ci]
        .as_ref()
        .map_or_else(Vec::new, |r| r.pixmask_fraction.clone())
}

/// The fraction of each core spot that rejection took: the masked fraction now less the one
/// before (zero where a patch has no fraction before, one without pixels).
fn lost(now: &[f64], before: &[f64]) -> Vec<f64> {
    now.iter()
        .enumerate()
        .map(|(i, a)| before.get(i).map_or(0.0, |b| (a - b).max(0.0)))
        .collect()
}

/// The live patches of a frame as the test sees them.
struct Frame<'f> {
    /// Position in the frame's results, per live patch.
    ci: Vec<usize>,
    /// Start of each live patch's box in the frame-sized arrays.
    at: Vec<usize>,
    /// Each live patch's box: its rows and columns of the CCD.
    boxes: Vec<(Range<usize>, Range<usize>)>,
    image: &'f Image,
}

impl<'f> Frame<'f> {
    fn new(host: &FrameHost, image: &'f Image) -> Self {
        let mut at = vec![0; host.live.len()];
        for w in &host.waves {
            for li in w.live.clone() {
                at[li] = w.boxes.start + host.boxoff[li] as usize;
            }
        }
        Frame {
            ci: host.live.iter().map(|l| l.0).collect(),
            at,
            boxes: host
                .live
                .iter()
                .map(|l| (l.1.rows.clone(), l.1.cols.clone()))
                .collect(),
            image,
        }
    }

    /// The outliers of live patch `li` (box pixel indices) against the model boxes `fit`,
    /// testing the pixels `core` flags and not those `rejected` already.
    fn outliers(
        &self,
        li: usize,
        arrays: (&[f64], &[u8], &[u8]),
        limits: (f64, f64),
    ) -> Vec<usize> {
        let (fit, core, rejected) = arrays;
        let (rows, cols) = self.boxes[li].clone();
        let (len, width) = (rows.len() * cols.len(), cols.len());
        let at = self.at[li];
        let window = ndarray::s![rows, cols];
        let pix: Vec<f64> = self
            .image
            .pix
            .slice(window)
            .iter()
            .map(|&v| v as f64)
            .collect();
        let ivar: Vec<f64> = self
            .image
            .ivar
            .slice(window)
            .iter()
            .zip(&rejected[at..at + len])
            .map(|(&v, &r)| if r != 0 { 0.0 } else { v as f64 })
            .collect();
        let tested: Vec<bool> = core[at..at + len].iter().map(|&c| c != 0).collect();
        find_outliers(&pix, &ivar, &fit[at..at + len], &tested, width, limits)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A wave is solved again when it holds a changed patch, whichever of its patches.
    #[test]
    fn only_the_waves_of_changed_patches_are_solved_again() {
        let waves = || [0..4, 4..8, 8..12, 12..13].into_iter();
        assert_eq!(waves_of(waves(), &[1, 2, 12]), [0, 3]);
        assert_eq!(waves_of(waves(), &[7, 8]), [1, 2]);
        assert_eq!(waves_of(waves(), &[4]), [1]);
        assert!(waves_of(waves(), &[]).is_empty());
    }

    /// The fraction lost is the growth of the masked fraction, none for a patch without one
    /// before.
    #[test]
    fn rejection_takes_the_growth_of_the_masked_fraction() {
        assert_eq!(
            lost(&[0.5, 0.25, 0.0], &[0.25, 0.25, 0.0]),
            [0.25, 0.0, 0.0]
        );
        assert_eq!(lost(&[1.0, 1.0], &[]), [0.0, 0.0]);
    }
}
