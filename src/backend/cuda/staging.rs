//! Host buffers for transfers, page-locked once they can be: pinning host memory costs about
//! a millisecond per megabyte on the machines measured (some 190 ms for the buffers of a
//! full frame), which a process's first frame should not wait for. A [`Staging`] buffer is
//! pageable (the driver stages its copies) until a background thread has pinned one of the
//! size asked; from then on the transfers go at full bus speed and overlap with the kernels.
//! Pinning starts only once [`Staging::allow_pinning`] has been called, which the backend
//! does for its upload buffers after its first frame: while it runs, the driver work of
//! pinning them delays that frame's launches, and a process of one frame would gain nothing
//! from it.

use std::sync::Arc;
use std::thread::JoinHandle;

use cudarc::driver::CudaContext;

use super::device::PinnedBuf;
use super::error;
use crate::error::Result;

/// A host buffer for transfers that becomes pinned in the background.
pub(crate) struct Staging<T: Copy + Default + Send + 'static> {
    ctx: Arc<CudaContext>,
    pinned: Option<PinnedBuf<T>>,
    pageable: Vec<T>,
    /// A pinning under way, and the length asked.
    pending: Option<(usize, JoinHandle<Result<PinnedBuf<T>>>)>,
    /// Whether the last [`Staging::get`] gave the pinned buffer.
    on_pinned: bool,
    /// Whether a buffer may be pinned.
    pinning: bool,
}

impl<T: Copy + Default + Send + 'static> Staging<T> {
    pub(crate) fn new(ctx: Arc<CudaContext>) -> Self {
        Staging {
            ctx,
            pinned: None,
            pageable: Vec::new(),
            pending: None,
            on_pinned: false,
            pinning: false,
        }
    }

    /// Lets the next [`Staging::get`] or [`Staging::reserve`] start pinning a buffer.
    pub(crate) fn allow_pinning(&mut self) {
        self.pinning = true;
    }

    /// A buffer of `len` values (contents unspecified): the pinned one if it is large enough,
    /// else a pageable one, and then (once pinning is allowed) a pinned one of `len` is asked
    /// for the next time.
    pub(crate) fn get(&mut self, len: usize) -> &mut [T] {
        self.adopt_finished();
        self.on_pinned = self.pinned.as_ref().is_some_and(|p| p.len() >= len);
        if self.on_pinned {
            self.pageable = Vec::new();
            return &mut self.pinned.as_mut().expect("checked above").as_mut_slice()[..len];
        }
        if self.pending.is_none() && self.pinning {
            self.pin_later(len);
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
        let coming = self.pending.as_ref().is_some_and(|(n, _)| *n >= len);
        if !pinned && !coming && self.pending.is_none() && self.pinning {
            self.pin_later(len);
        }
    }

    /// The first `len` values of the buffer that the last [`Staging::get`] gave.
    pub(crate) fn current(&self, len: usize) -> &[T] {
        match (&self.pinned, self.on_pinned) {
            (Some(p), true) => &p.as_slice()[..len],
            _ => &self.pageable[..len],
        }
    }

    /// Whether the buffer of the last [`Staging::get`] is pinned.
    pub(crate) fn is_pinned(&self) -> bool {
        self.on_pinned
    }

    /// Starts pinning a buffer of `len` values on a thread of its own.
    fn pin_later(&mut self, len: usize) {
        let ctx = self.ctx.clone();
        let pinning = std::thread::spawn(move || {
            ctx.bind_to_thread()
                .map_err(error::driver("cannot bind the CUDA context"))?;
            PinnedBuf::new(len)
        });
        self.pending = Some((len, pinning));
    }

    /// Takes the pinned buffer of a finished pinning (a failed one leaves the buffer
    /// pageable, with a warning: transfers are slower, results the same).
    fn adopt_finished(&mut self) {
        if !self.pending.as_ref().is_some_and(|(_, h)| h.is_finished()) {
            return;
        }
        let (len, pinning) = self.pending.take().expect("checked above");
        match pinning.join() {
            Ok(Ok(buf)) => self.pinned = Some(buf),
            Ok(Err(e)) => tracing::warn!("{e}; host buffers stay pageable"),
            Err(_) => tracing::warn!("pinning {len} values of host memory panicked"),
        }
    }
}

impl<T: Copy + Default + Send + 'static> Drop for Staging<T> {
    fn drop(&mut self) {
        // A pinning under way ends before the context can go.
        if let Some((_, pinning)) = self.pending.take() {
            let _ = pinning.join();
        }
    }
}
