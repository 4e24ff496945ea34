//! The normal equations that a patch with outliers keeps for its next solve. Right after a
//! wave's test, before the next wave's assembly overwrites the wave's buffers, the device
//! copies each such patch's icov, y, fluxweight, unregularised diagonal and masked weights
//! into a slot of a frame-sized store (`keep_equations` in kernels/reject.cu); the re-solve
//! starts from them and subtracts the terms of the pixels the test rejected
//! (`downdate_f64` in kernels/assemble.cu), as the CPU backend downdates its own, instead of
//! assembling them again from every pixel of the patch: a test rejects about 56 pixels of a
//! patch's thousands. On a 500 x 801-bin frame (an H200) the re-solves' assembly took 2.1 ms
//! of its 31; the downdate takes 0.8 ms and the copies into the store 0.45 ms. The store takes
//! what the waves leave of the memory budget ([`capacity`]).
//!
//! Slots are taken in the waves' order (`kept_slots`), which the device's timing does not
//! change, and none is used twice within a frame; a patch that finds none left is assembled
//! again, with the same result to rounding. The dense route keeps nothing: cuSOLVER factors
//! icov in place.

use std::sync::Arc;

use cudarc::driver::CudaContext;

use super::super::device::Device;
use super::super::kernels::{launch, Args};
use super::super::launchers::Gpu;
use super::super::shape::Shape;
use super::super::staging::Staging;
use super::super::tuning::Solve;
use super::super::workspace::{Slot, Workspace};
use crate::error::Result;

/// The store of a frame's kept equations and the slot of each patch.
pub(crate) struct Kept {
    /// Slots of the frame's store (0: every re-solve is assembled again).
    capacity: usize,
    /// Doubles per slot (`KeptLayout` in kernels/common.cuh).
    len: usize,
    store: Slot<f64>,
    /// By place, as the outlier counts: the slot each patch took after its last test, -1 for
    /// none; a re-solve wave's own places hold the slots its patches start from.
    slots: Slot<i32>,
    /// Slots taken so far in the frame.
    taken: Slot<i32>,
    back: Staging<i32>,
}

/// Doubles a patch keeps: icov's stored rows, y, fluxweight and diag0, the core spots' masked
/// weights, the list of the pixels rejected since (`KeptLayout` in kernels/common.cuh).
pub(crate) fn slot_len(sh: &Shape, solve: Solve) -> usize {
    let m = sh.m();
    m * sh.icov_row_len(solve) + 3 * m + sh.ncore * sh.nws + 1 + KEPT_LIST
}

/// The most rejected pixels a slot lists (`SPEX_KEPT_LIST` in kernels/common.cuh).
const KEPT_LIST: usize = 512;

/// Slots for a frame of `npatches` that rejects outliers (`on`) on the `solve` route, a slot
/// taking `slot_bytes`: one for every other patch (a third of them see a cosmic ray at DESI's
/// density in a 1200 s exposure, and few are solved a third time), within the `left` bytes of
/// the memory budget that the waves leave (waves made smaller for them cost more than the
/// downdate saves: a full r frame took 97.8 ms instead of 79.6 with a quarter of 4 GB for
/// them); none on the dense route.
pub(crate) fn capacity(
    on: bool,
    solve: Solve,
    npatches: usize,
    slot_bytes: usize,
    left: usize,
) -> usize {
    if !on || solve == Solve::Dense || slot_bytes == 0 {
        return 0;
    }
    npatches.div_ceil(2).min(left / slot_bytes)
}

impl Kept {
    pub(crate) fn new(ctx: Arc<CudaContext>) -> Self {
        let mut back = Staging::new(ctx);
        back.allow_pinning(0);
        Kept {
            capacity: 0,
            len: 0,
            store: Slot::new("kept normal equations"),
            slots: Slot::new("kept equations' slots"),
            taken: Slot::new("kept equations taken"),
            back,
        }
    }

    /// Starts a frame of `npatches` with `capacity` slots of `len` doubles, none taken.
    pub(crate) fn start(
        &mut self,
        dev: &Device,
        capacity: usize,
        len: usize,
        npatches: usize,
    ) -> Result<()> {
        (self.capacity, self.len) = (capacity, len);
        if capacity == 0 {
            return Ok(());
        }
        self.store.ensure(dev, capacity * len)?;
        self.slots.ensure(dev, npatches)?;
        self.taken.ensure(dev, 1)?;
        dev.fill_prefix(self.taken.get(), 1, 0)
    }

    /// The kernels' arguments of a wave whose places start at `live_at`: its slots and the
    /// store, for a re-solve (`resolve`) of a frame that keeps equations; 0 (assemble every
    /// patch) otherwise.
    pub(crate) fn args(&self, resolve: bool, live_at: usize) -> (u64, u64) {
        if resolve && self.capacity > 0 {
            (self.slots.get().at(live_at), self.store.get().ptr)
        } else {
            (0, 0)
        }
    }

    /// After the test of the wave's `n` patches at places from `live_at`, whose counts are at
    /// `counts`: slots for those with outliers, and their equations copied there.
    pub(crate) fn keep(
        g: Gpu<'_>,
        ws: &Workspace,
        n: usize,
        live_at: usize,
        counts: u64,
    ) -> Result<()> {
        let k = &ws.reject.kept;
        if k.capacity == 0 {
            return Ok(());
        }
        let slots = k.slots.get().at(live_at);
        launch(
            g.dev,
            &g.k.kept_slots,
            "kept_slots",
            (1, 1, 1),
            1024,
            0,
            Args::new()
                .ptr(counts)
                .i32(n as i32)
                .i32(k.capacity as i32)
                .ptr(k.taken.get().ptr)
                .ptr(slots),
        )?;
        // slots are kept on the Schur route alone (`capacity`)
        let solve = Solve::Schur;
        let sh = g.sh;
        launch(
            g.dev,
            &g.k.keep_equations,
            "keep_equations",
            (COPY_BLOCKS, n as u32, 1),
            256,
            0,
            Args::new()
                .ptr(slots)
                .equations(ws)
                .ptr(ws.reject.rejected_ptr())
                .ptr(ws.view.boxes)
                .ptr(ws.view.boxoff)
                .i32(sh.m() as i32)
                .i32(sh.icov_row_len(solve) as i32)
                .i32((sh.ncore * sh.nws) as i32)
                .ptr(k.store.get().ptr),
        )
    }

    /// Queues the copy back of the slots of the `n` places from `live_at` on the stream of the
    /// copies back (read them with [`Kept::read`] once it is synchronised).
    pub(crate) fn copy_back(&mut self, dev: &Device, live_at: usize, n: usize) -> Result<()> {
        if self.capacity == 0 {
            return Ok(());
        }
        let back = self.back.get(n);
        dev.copy_back(back, self.slots.get(), live_at, "kept equations' slots")
    }

    /// The slot of place `i` of those [`Kept::copy_back`] copied, -1 for none.
    pub(crate) fn read(&self, i: usize) -> i32 {
        if self.capacity == 0 {
            return -1;
        }
        self.back.current(i + 1)[i]
    }

    /// Gives a re-solve wave's places from `live_at` the slots its patches start from.
    pub(crate) fn upload(&self, dev: &Device, live_at: usize, slots: &[i32]) -> Result<()> {
        if self.capacity == 0 || slots.is_empty() {
            return Ok(());
        }
        dev.upload_at(self.slots.get(), live_at, slots, "kept equations' slots")
    }
}

/// Blocks along a patch of `keep_equations` (a patch of the full-width frame keeps about
/// 0.4 MB).
const COPY_BLOCKS: u32 = 32;

#[cfg(test)]
mod tests {
    use super::*;

    /// Every other patch of a frame gets a slot, within what the waves leave of the budget,
    /// and none on the dense route or without rejection.
    #[test]
    fn slots_for_half_the_patches_within_what_the_waves_leave() {
        let mb = 1_000_000;
        assert_eq!(capacity(true, Solve::Schur, 1701, 400_000, 1000 * mb), 851);
        assert_eq!(capacity(true, Solve::Schur, 4700, 400_000, 1000 * mb), 2350);
        assert_eq!(capacity(true, Solve::Schur, 4700, 400_000, 100 * mb), 250);
        assert_eq!(capacity(true, Solve::Schur, 4700, 400_000, 0), 0);
        assert_eq!(capacity(true, Solve::Dense, 4700, 400_000, 1000 * mb), 0);
        assert_eq!(capacity(false, Solve::Schur, 4700, 400_000, 1000 * mb), 0);
    }
}
