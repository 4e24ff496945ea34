//! Host buffers for transfers, page-locked once they can be: pinning host memory takes tens
//! to hundreds of milliseconds for the buffers of a full frame (about 75 MB of uploads: 27-713
//! ms on H200 machines, by how busy the driver is; see `buffers::PinnedBuf`), which no frame
//! should wait for. A [`Staging`] buffer is pageable (the driver
//! stages its copies, and the host waits for each) until a background thread has pinned one
//! of the size asked; from then on the transfers go at full bus speed and overlap with the
//! kernels.
//!
//! Small buffers whose size can be told in advance (the copies back) start pinning when the
//! backend starts ([`Staging::pin_now`]), while it loads its kernels, and their first use
//! waits for that pinning. The others (the uploads) are pinned once
//! [`Staging::allow_pinning`] has been called: pinning them all when the backend starts
//! delayed its start by more than the first frame gained (workspace.rs, `EARLY_BACK`). The
//! backend allows it when its first frame's sizes are known, if they can be told before the
//! frame is laid out (tables.rs, `Uploads::pin_from_now`), else after its first frame.

use std::sync::Arc;
use std::thread::JoinHandle;

use cudarc::driver::CudaContext;

use super::buffers::PinnedBuf;
use crate::error::Result;

/// A host buffer for transfers that becomes pinned in the background.
pub(crate) struct Staging<T: Copy + Default + Send + 'static> {
    /// The context buffers are pinned in; without one (host-side tests) they stay pageable.
    ctx: Option<Arc<CudaContext>>,
    pinned: Option<PinnedBuf<T>>,
    pageable: Vec<T>,
    /// A pinning under way.
    pending: Option<Pinning<T>>,
    /// Whether the last [`Staging::get`] gave the pinned buffer.
    on_pinned: bool,
    /// Whether a buffer may be pinned when one larger than the pinned one is asked for.
    pinning: bool,
    /// The least length to pin (see [`Staging::allow_pinning`]).
    pin_at_least: usize,
    /// The largest length [`Staging::get`] was asked for.
    largest: usize,
}

/// A pinning on a thread of its own.
struct Pinning<T: Copy + Default> {
    len: usize,
    /// Started by [`Staging::pin_now`]: the first use waits for it.
    early: bool,
    thread: JoinHandle<Result<PinnedBuf<T>>>,
}

impl<T: Copy + Default + Send + 'static> Staging<T> {
    pub(crate) fn new(ctx: Arc<CudaContext>) -> Self {
        Self::in_context(Some(ctx))
    }

    /// A buffer that stays pageable, for the host-side tests of what fills it.
    #[cfg(test)]
    pub(crate) fn pageable() -> Self {
        Self::in_context(None)
    }

    fn in_context(ctx: Option<Arc<CudaContext>>) -> Self {
        Staging {
            ctx,
            pinned: None,
            pageable: Vec::new(),
            pending: None,
            on_pinned: false,
            pinning: false,
            pin_at_least: 0,
            largest: 0,
        }
    }

    /// Lets the next [`Staging::get`] or [`Staging::reserve`] start pinning a buffer, of at
    /// least `len` values: a buffer is pinned at the largest size it was asked for, so that a
    /// frame larger than the one it was pinned for does not make it pageable and pin it
    /// again (which showed as 5-10 ms stalls of the host in a
    /// backend's second to fourth frames).
    pub(crate) fn allow_pinning(&mut self, len: usize) {
        self.pinning = true;
        self.pin_at_least = self.pin_at_least.max(len);
    }

    /// Whether [`Staging::allow_pinning`] was called.
    pub(crate) fn pinning_allowed(&self) -> bool {
        self.pinning
    }

    /// The largest length [`Staging::get`] was asked for so far.
    pub(crate) fn largest(&self) -> usize {
        self.largest
    }

    /// A buffer of `len` values (contents unspecified): the pinned one if it is large enough,
    /// else a pageable one, and then (once pinning is allowed) a pinned one of `len` is asked
    /// for the next time. An early pinning under way is waited for.
    pub(crate) fn get(&mut self, len: usize) -> &mut [T] {
        self.largest = self.largest.max(len);
        if self.pending.as_ref().is_some_and(|p| p.early) {
            self.wait_pinned();
        }
        self.adopt_finished();
        self.on_pinned = self.pinned.as_ref().is_some_and(|p| p.len() >= len);
        if self.on_pinned {
            self.pageable = Vec::new();
            return &mut self.pinned.as_mut().expect("checked above").as_mut_slice()[..len];
        }
        if self.pending.is_none() && self.pinning {
            self.pin_later(len, false);
        }
        if self.pageable.len() < len {
            self.pageable = vec![T::default(); len];
        }
        &mut self.pageable[..len]
    }

    /// Starts pinning a buffer of `len` values now, if none that large is pinned or on its
    /// way, so that it is ready by the time [`Staging::get`] asks for it.
    pub(crate) fn reserve(&mut self, len: usize) {
        self.adopt_finished();
        let pinned = self.pinned.as_ref().is_some_and(|p| p.len() >= len);
        if !pinned && self.pending.is_none() && self.pinning {
            self.pin_later(len, false);
        }
    }

    /// Starts pinning a buffer of `len` values now, whether or not pinning is allowed yet,
    /// unless one is pinned or on its way: for a buffer whose size can be told before its
    /// first use, which waits for it.
    pub(crate) fn pin_now(&mut self, len: usize) {
        if self.pinned.is_none() && self.pending.is_none() {
            self.pin_later(len, true);
        }
    }

    /// The first `len` values of the buffer that the last [`Staging::get`] gave.
    pub(crate) fn current(&self, len: usize) -> &[T] {
        match (&self.pinned, self.on_pinned) {
            (Some(p), true) => &p.as_slice()[..len],
            _ => &self.pageable[..len],
        }
    }

    /// Part `k` of the table of parts of `per` values that starts at value `at` of the buffer
    /// that the last [`Staging::get`] gave, and where the part starts in that table.
    pub(crate) fn part(&self, at: usize, k: usize, per: usize) -> (usize, &[T]) {
        (k * per, &self.current(at + (k + 1) * per)[at + k * per..])
    }

    /// The first `len` values of the buffer that the last [`Staging::get`] gave, to write.
    pub(crate) fn current_mut(&mut self, len: usize) -> &mut [T] {
        match (&mut self.pinned, self.on_pinned) {
            (Some(p), true) => &mut p.as_mut_slice()[..len],
            _ => &mut self.pageable[..len],
        }
    }

    /// Whether the buffer of the last [`Staging::get`] is pinned.
    pub(crate) fn is_pinned(&self) -> bool {
        self.on_pinned
    }

    /// Starts pinning a buffer of `len` values on a thread of its own.
    fn pin_later(&mut self, len: usize, early: bool) {
        let len = len.max(self.pin_at_least);
        let Some(ctx) = self.ctx.clone() else {
            return;
        };
        let thread = std::thread::spawn(move || PinnedBuf::new(&ctx, len));
        self.pending = Some(Pinning { len, early, thread });
    }

    /// Waits for a pinning under way and takes its buffer.
    fn wait_pinned(&mut self) {
        if let Some(pending) = self.pending.take() {
            self.adopt(pending);
        }
    }

    /// Takes the pinned buffer of a finished pinning.
    fn adopt_finished(&mut self) {
        if self
            .pending
            .as_ref()
            .is_some_and(|p| p.thread.is_finished())
        {
            let pending = self.pending.take().expect("checked above");
            self.adopt(pending);
        }
    }

    /// Takes the buffer of a pinning, once finished (a failed one leaves the buffer pageable,
    /// with a warning: transfers are slower, results the same).
    fn adopt(&mut self, pending: Pinning<T>) {
        match pending.thread.join() {
            Ok(Ok(buf)) => self.pinned = Some(buf),
            Ok(Err(e)) => tracing::warn!("{e}; host buffers stay pageable"),
            Err(_) => tracing::warn!("pinning {} values of host memory panicked", pending.len),
        }
    }
}

impl<T: Copy + Default + Send + 'static> Drop for Staging<T> {
    fn drop(&mut self) {
        // A pinning under way ends before the context can go.
        if let Some(pending) = self.pending.take() {
            let _ = pending.thread.join();
        }
    }
}
