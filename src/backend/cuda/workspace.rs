//! Buffers and workspace of the batched solve: the device and pinned buffers kept by a
//! backend between waves and calls ([`Slot`]), the frame's uploaded tables and results, and
//! the region of the CCD a frame uploads. Their sizes follow from `shape`.

use std::sync::Arc;

use cudarc::driver::CudaContext;

use super::buffers::DevBuf;
use super::device::Device;
use super::shape::Shape;
use super::staging::Staging;
use super::tables::{FrameHost, PickedTables};
use crate::backend::FrameInput;
use crate::error::Result;

/// Device addresses `base + i * step` for `ids`, as a device array of pointers.
pub(crate) fn pointer_array(
    dev: &Device,
    base: u64,
    step: usize,
    ids: &[usize],
    what: &str,
) -> Result<DevBuf<u64>> {
    let host: Vec<u64> = ids.iter().map(|&i| base + (i * step * 8) as u64).collect();
    dev.upload(&host, what)
}

/// Device and pinned buffers, kept by the backend between waves and calls.
pub(crate) struct Workspace {
    /// The frame's uploaded tables and image.
    pub(crate) input: Inputs,
    /// Where the tables of the wave being queued start in `input`.
    pub(crate) view: TableView,
    /// The frame's results, gathered from the per-patch buffers after each wave.
    pub(crate) out: FrameOut,
    pub(crate) spots: Slot<f64>,
    /// Where the wave's spots start in `spots`: 0, but for a frame that keeps its spots for
    /// outlier rejection's re-solves, where each bundle's have a place of their own
    /// (`reject::spots_place`).
    pub(crate) spots_at: usize,
    /// The column tables of the wave's patches, `[patch][column]`: the spot of each column,
    /// -1 for none. Written on the device from the uploaded first spot of each fiber block
    /// (`launchers::column_table`).
    pub(crate) colspot: Slot<i32>,
    /// The bundle whose spots the wave before evaluated last, and the index in `spots` where
    /// they start; None at the start of a call (another frame's PSF) and when `spots` was
    /// allocated anew.
    pub(crate) last_spots: Option<(usize, usize)>,
    /// Patches the per-patch buffers are sized for, at least: the largest wave of the call,
    /// so that they are allocated once for all (a buffer replaced by a larger one is freed
    /// only at the end of the call, see `Device::retire`).
    pub(crate) patches: usize,
    pub(crate) icov: Slot<f64>,
    pub(crate) y: Slot<f64>,
    pub(crate) fw: Slot<f64>,
    pub(crate) diag0: Slot<f64>,
    pub(crate) pixmask: Slot<f64>,
    pub(crate) masked: Slot<i32>,
    pub(crate) x: Slot<f64>,
    pub(crate) xinv: Slot<f64>,
    pub(crate) fluxcol: Slot<f64>,
    pub(crate) sweeps: Slot<i32>,
    pub(crate) pbuf: Slot<f64>,
    pub(crate) end_factors: Slot<f64>,
    pub(crate) sv: Slot<f64>,
    pub(crate) sblocks: Slot<f64>,
    pub(crate) info: Slot<i32>,
    pub(crate) first_info: Slot<i32>,
    pub(crate) retry_ids: Slot<i32>,
    pub(crate) coupling: Slot<f64>,
    pub(crate) steps: Slot<i32>,
    pub(crate) model: Slot<f64>,
    pub(crate) chi2: Slot<f64>,
    /// The model boxes and pixel flags of outlier rejection.
    pub(crate) reject: super::reject::Boxes,
    /// Host buffers of the copies back of a wave's results (core arrays, model boxes), of its
    /// verdicts (polar steps, Jacobi sweeps, then on the Schur route those of the sweeps) and
    /// of its second-neighbour coupling, from the frame's results once the device has
    /// gathered them: the device never waits for the host.
    pub(crate) back: Staging<f64>,
    pub(crate) verdicts: Staging<i32>,
    pub(crate) coupling_back: Staging<f64>,
}

impl Workspace {
    pub(crate) fn new(ctx: Arc<CudaContext>) -> Self {
        Workspace {
            input: Inputs::new(),
            view: TableView::default(),
            out: FrameOut::new(),
            spots: Slot::new("spots"),
            spots_at: 0,
            colspot: Slot::new("column table"),
            last_spots: None,
            patches: 0,
            icov: Slot::new("icov"),
            y: Slot::new("y"),
            fw: Slot::new("fluxweight"),
            diag0: Slot::new("icov diagonal"),
            pixmask: Slot::new("pixmask fraction"),
            masked: Slot::new("masked flags"),
            x: Slot::new("xflux"),
            xinv: Slot::new("inverse Cholesky blocks"),
            fluxcol: Slot::new("core flux by column"),
            sweeps: Slot::new("Jacobi sweeps"),
            pbuf: Slot::new("parked polar factors"),
            end_factors: Slot::new("end fibers' factors"),
            sv: Slot::new("Schur sweep right-hand sides"),
            sblocks: Slot::new("Schur complements"),
            info: Slot::new("sweep verdicts"),
            first_info: Slot::new("first sweep verdicts"),
            retry_ids: Slot::new("retry list"),
            coupling: Slot::new("second-neighbour coupling"),
            steps: Slot::new("polar steps"),
            model: Slot::new("patch models"),
            chi2: Slot::new("chi2pix"),
            reject: super::reject::Boxes::new(ctx.clone()),
            back: pinned_from_the_start(Staging::new(ctx.clone()), EARLY_BACK),
            verdicts: pinned_from_the_start(Staging::new(ctx.clone()), EARLY_VERDICTS),
            coupling_back: pinned_from_the_start(Staging::new(ctx.clone()), EARLY_COUPLING),
        }
    }

    /// The device address of the wave's first spot, which the kernels count its spots from.
    pub(crate) fn spots_ptr(&self) -> u64 {
        self.spots.get().at(self.spots_at)
    }

    /// Patches to size the per-patch buffers of a wave of `n` for.
    pub(crate) fn sized(&self, n: usize) -> usize {
        n.max(self.patches)
    }
}

/// Device buffers of a frame's inputs: its host tables and the CCD image, each part uploaded
/// once, with the first wave that needs it.
pub(crate) struct Inputs {
    pub(crate) xy: Slot<f64>,
    pub(crate) coef: Slot<f64>,
    pub(crate) waves: Slot<f64>,
    pub(crate) corners: Slot<i32>,
    pub(crate) first_spots: Slot<i32>,
    pub(crate) boxes: Slot<i32>,
    pub(crate) nkeep: Slot<i32>,
    pub(crate) boxoff: Slot<i64>,
    pub(crate) pix: Slot<f32>,
    pub(crate) ivar: Slot<f32>,
    /// A strip of columns of the image on its way into `pix` or `ivar` (the copy stream
    /// places one before it uploads the next).
    pub(crate) strip: Slot<f32>,
}

impl Inputs {
    fn new() -> Self {
        Inputs {
            xy: Slot::new("trace positions"),
            coef: Slot::new("PSF coefficients"),
            waves: Slot::new("wavelength grid"),
            corners: Slot::new("spot corners"),
            first_spots: Slot::new("first spots of the fiber blocks"),
            boxes: Slot::new("pixel boxes"),
            nkeep: Slot::new("kept bins"),
            boxoff: Slot::new("box offsets"),
            pix: Slot::new("image pixels"),
            ivar: Slot::new("image inverse variance"),
            strip: Slot::new("image strip"),
        }
    }

    /// Sizes the buffers for the frame `host` of `npatches` patches and uploads its
    /// wavelength grid.
    pub(crate) fn ensure_frame(
        &mut self,
        dev: &Device,
        input: &FrameInput<'_>,
        sh: &Shape,
        host: &FrameHost,
        npatches: usize,
    ) -> Result<()> {
        let (spots, coef) = host.table_lens(sh);
        let npix = input.image.nrows * input.image.ncols;
        self.xy.ensure(dev, spots)?;
        self.coef.ensure(dev, coef)?;
        self.waves.ensure(dev, input.plan.fullwave.len())?;
        self.corners.ensure(dev, spots)?;
        self.first_spots.ensure(dev, npatches * sh.nblock)?;
        self.boxes.ensure(dev, 4 * npatches)?;
        self.nkeep.ensure(dev, npatches)?;
        self.boxoff.ensure(dev, npatches)?;
        self.pix.ensure(dev, npix)?;
        self.ivar.ensure(dev, npix)?;
        dev.upload_at(self.waves.get(), 0, &input.plan.fullwave, "wavelength grid")
    }

    /// Queues the upload of what wave `wi` of `host` adds to the frame's tables and image on
    /// the copy stream: the traces of its new bundles, its patches' tables, its new columns.
    /// The compute stream must [`Device::join_copies`] before it reads them; `host`'s pinned
    /// buffers must live until then.
    pub(crate) fn upload_wave(
        &mut self,
        dev: &Device,
        input: &FrameInput<'_>,
        sh: &Shape,
        host: &mut FrameHost,
        wi: usize,
    ) -> Result<()> {
        // what is uploaded once, here, is taken; the rest of the wave stays for its results
        let wave = &mut host.waves[wi];
        let (traced, strips) = (
            std::mem::take(&mut wave.traced),
            std::mem::take(&mut wave.strips),
        );
        let live = wave.live.clone();
        for &slot in &traced {
            let (at, xy) = host.xy(sh, slot);
            dev.upload_at(self.xy.get(), at, xy, "trace positions")?;
            let (at, corners) = host.corners(sh, slot);
            dev.upload_at(self.corners.get(), at, corners, "spot corners")?;
            let (at, coef) = host.coef(sh, slot);
            dev.upload_at(self.coef.get(), at, coef, "PSF coefficients")?;
        }
        let (p0, p1) = (live.start, live.end);
        let first = host.first_spots(sh, live);
        dev.upload_at(self.first_spots.get(), p0 * sh.nblock, first, "first spots")?;
        let boxes = &host.boxes[4 * p0..4 * p1];
        dev.upload_at(self.boxes.get(), 4 * p0, boxes, "pixel boxes")?;
        dev.upload_at(self.nkeep.get(), p0, &host.nkeep[p0..p1], "kept bins")?;
        dev.upload_at(self.boxoff.get(), p0, &host.boxoff[p0..p1], "box offsets")?;
        let ncols = input.image.ncols;
        let widest = strips.iter().map(|c| c.len()).max().unwrap_or(0);
        self.strip
            .ensure(dev, (input.image.nrows * widest).max(1))?;
        for cols in strips {
            let (pix, ivar) = host.pack_strip(input, cols.clone())?;
            let scratch = self.strip.get();
            dev.upload_columns(self.pix.get(), scratch, pix, ncols, cols.clone(), "pixels")?;
            dev.upload_columns(
                self.ivar.get(),
                scratch,
                ivar,
                ncols,
                cols,
                "inverse variance",
            )?;
            host.uploaded(dev.copies_event()?);
        }
        Ok(())
    }

    /// Queues the upload of the tables of a wave of picked patches (`tables`) at live patch
    /// `p0` on, on the copy stream, over those of the finished wave whose places it takes.
    pub(crate) fn upload_picked(
        &mut self,
        dev: &Device,
        sh: &Shape,
        p0: usize,
        tables: &PickedTables,
    ) -> Result<()> {
        let t = tables;
        let at = p0 * sh.nblock;
        dev.upload_at(self.first_spots.get(), at, &t.first_spots, "first spots")?;
        dev.upload_at(self.boxes.get(), 4 * p0, &t.boxes, "pixel boxes")?;
        dev.upload_at(self.nkeep.get(), p0, &t.nkeep, "kept bins")?;
        dev.upload_at(self.boxoff.get(), p0, &t.boxoff, "box offsets")
    }

    /// Where the tables of wave `wi` of `host` start.
    pub(crate) fn view(&self, host: &FrameHost, wi: usize, sh: &Shape) -> TableView {
        let w = &host.waves[wi];
        let spot0 = w.spot0(sh);
        let coef_per_fiber = host.coef_per_fiber;
        let (p0, nb) = (w.live.start, sh.nblock);
        TableView {
            xy: self.xy.get().at(2 * spot0),
            coef: self
                .coef
                .get()
                .at(w.slots.start * sh.bundlesize * coef_per_fiber),
            corners: self.corners.get().at(2 * spot0),
            first_spots: self.first_spots.get().at(p0 * nb),
            boxes: self.boxes.get().at(4 * p0),
            nkeep: self.nkeep.get().at(p0),
            boxoff: self.boxoff.get().at(p0),
            pix: self.pix.get().ptr,
            ivar: self.ivar.get().ptr,
        }
    }
}

/// Device addresses of the tables of the wave being queued (`Inputs::view`): its kernels
/// index them from its first patch and its first bundle's first spot.
#[derive(Clone, Copy, Debug, Default)]
pub(crate) struct TableView {
    pub(crate) xy: u64,
    pub(crate) coef: u64,
    pub(crate) corners: u64,
    pub(crate) first_spots: u64,
    pub(crate) boxes: u64,
    pub(crate) nkeep: u64,
    pub(crate) boxoff: u64,
    pub(crate) pix: u64,
    pub(crate) ivar: u64,
}

/// The frame's results on the device: each wave's core arrays, model boxes and verdicts are
/// gathered here (`solve::gather`), so that the next wave may reuse the per-patch buffers at
/// once and the host copies the results back at its own pace.
pub(crate) struct FrameOut {
    pub(crate) flux: Slot<f64>,
    pub(crate) ivar: Slot<f64>,
    pub(crate) pixmask: Slot<f64>,
    pub(crate) chi2: Slot<f64>,
    pub(crate) res: Slot<f64>,
    pub(crate) model: Slot<f64>,
    pub(crate) steps: Slot<i32>,
    pub(crate) sweeps: Slot<i32>,
    pub(crate) first_info: Slot<i32>,
    pub(crate) info: Slot<i32>,
    pub(crate) masked: Slot<i32>,
    pub(crate) coupling: Slot<f64>,
}

impl FrameOut {
    fn new() -> Self {
        FrameOut {
            flux: Slot::new("frame flux"),
            ivar: Slot::new("frame ivar"),
            pixmask: Slot::new("frame pixmask fraction"),
            chi2: Slot::new("frame chi2pix"),
            res: Slot::new("frame resolution"),
            model: Slot::new("frame model boxes"),
            steps: Slot::new("frame polar steps"),
            sweeps: Slot::new("frame Jacobi sweeps"),
            first_info: Slot::new("frame first sweep verdicts"),
            info: Slot::new("frame sweep verdicts"),
            masked: Slot::new("frame masked flags"),
            coupling: Slot::new("frame second-neighbour coupling"),
        }
    }

    /// Sizes the buffers for `n` live patches; the model boxes, when asked, grow with the
    /// waves (`Slot::grow_keeping`).
    pub(crate) fn ensure(&mut self, dev: &Device, sh: &Shape, n: usize) -> Result<()> {
        let (blocks, per) = (n * sh.ncore, n * sh.ncore * sh.nws);
        for b in [
            &mut self.flux,
            &mut self.ivar,
            &mut self.pixmask,
            &mut self.chi2,
        ] {
            b.ensure(dev, per)?;
        }
        self.res.ensure(dev, per * sh.nd())?;
        self.steps.ensure(dev, blocks)?;
        self.sweeps.ensure(dev, blocks)?;
        for b in [&mut self.first_info, &mut self.info, &mut self.masked] {
            b.ensure(dev, n)?;
        }
        self.coupling.ensure(dev, n)?;
        Ok(())
    }

    /// Device bytes per live patch.
    pub(crate) fn bytes_per_patch(sh: &Shape) -> usize {
        8 * sh.ncore * sh.nws * (4 + sh.nd()) + 4 * (2 * sh.ncore + 3) + 8
    }
}

/// The buffers of the copies back may be pinned at any time: they start being pinned when
/// the backend starts, at `early` values, and are reserved again when a call starts, which
/// pins them anew when a call needs more (pinned, a full frame's copies back take 3 ms
/// instead of 24-53 on an H100's host).
fn pinned_from_the_start<T: Copy + Default + Send + 'static>(
    mut back: Staging<T>,
    early: usize,
) -> Staging<T> {
    back.allow_pinning(0);
    back.pin_now(early);
    back
}

/// Values of the copies back pinned when a backend starts: those of a wave of 800 patches
/// (the most, `MAX_WAVE`) of DESI's sub-bundles, 5 fibers x 50 bins, with 11 resolution
/// diagonals (3.0 million), and a margin. Pinned only once the first call had reserved them,
/// these 22 MB held up the start of a full r frame by the time their pinning took: a
/// single-frame run's extraction took 81-95 ms (median 84) on an H100 against 66-84 ms
/// (median 70) with them pinned early, and the whole run was no longer (the pinning overlaps
/// the loading of the kernels). Pinning the upload buffers early as well (about 110 MB)
/// brought the extraction to 59-75 ms but made the backend start 0.06 s later, and the run
/// longer.
const EARLY_BACK: usize = 3_200_000;
/// Verdicts of a wave of 800 patches of 5 fibers, with a margin (see `EARLY_BACK`).
const EARLY_VERDICTS: usize = 16_384;
/// Second-neighbour couplings of a wave of 800 patches, with a margin.
const EARLY_COUPLING: usize = 1024;

/// The region of the CCD uploaded for a frame: its first row and column, its width.
#[derive(Clone, Copy)]
pub(crate) struct Region {
    pub(crate) row0: usize,
    pub(crate) col0: usize,
    pub(crate) width: usize,
}

/// A device buffer kept between waves and calls, grown when a larger one is needed: large
/// allocations and frees synchronise the device and cost milliseconds each.
pub(crate) struct Slot<T> {
    buf: Option<DevBuf<T>>,
    what: &'static str,
}

impl<T> Slot<T> {
    pub(crate) const fn new(what: &'static str) -> Self {
        Slot { buf: None, what }
    }

    /// Makes the buffer hold at least `len` values; returns whether it was allocated anew,
    /// which loses its contents (a grown buffer does not keep them).
    pub(crate) fn ensure(&mut self, dev: &Device, len: usize) -> Result<bool> {
        if self.buf.as_ref().is_none_or(|b| b.len < len) {
            if let Some(old) = self.buf.take() {
                dev.retire(old);
            }
            self.buf = Some(dev.alloc(len, self.what)?);
            return Ok(true);
        }
        Ok(false)
    }

    /// Makes the buffer hold at least `len` values, keeping the first `kept` (a grown buffer
    /// is twice as large at least, and filled from the old one on the compute stream); true
    /// when it grew.
    pub(crate) fn grow_keeping(&mut self, dev: &Device, len: usize, kept: usize) -> Result<bool> {
        let old_len = self.buf.as_ref().map_or(0, |b| b.len);
        if old_len >= len {
            return Ok(false);
        }
        let new = dev.alloc(len.max(2 * old_len), self.what)?;
        if let Some(old) = self.buf.take() {
            dev.dtod(&new, &old, kept.min(old_len))?;
            dev.retire(old);
        }
        self.buf = Some(new);
        Ok(true)
    }

    pub(crate) fn get(&self) -> &DevBuf<T> {
        self.buf.as_ref().expect("Slot::ensure before Slot::get")
    }
}
