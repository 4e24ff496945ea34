//! Memory the CUDA backend owns: device buffers that count the bytes they hold (peak device
//! memory is a documented limit) and page-locked host buffers for the transfers.
//!
//! Buffers are plain `cuMemAlloc` allocations owned by [`DevBuf`]: the solve passes raw device
//! pointers to NVRTC kernels and to the batched cuBLAS/cuSOLVER routines, so a thin owner with
//! byte accounting serves better than a typed stream-tracked slice. [`Device`] allocates them
//! (and names the device in the error when memory runs out); this module only owns and frees.
//!
//! [`Device`]: super::device::Device

use std::marker::PhantomData;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

use cudarc::driver::{result as drv, sys as drv_sys};

use super::error;
use crate::error::Result;

/// Bytes of device memory held by this process's buffers, now and at most.
#[derive(Default, Debug)]
pub(crate) struct MemStats {
    current: AtomicUsize,
    peak: AtomicUsize,
}

impl MemStats {
    fn add(&self, n: usize) {
        let now = self.current.fetch_add(n, Ordering::Relaxed) + n;
        self.peak.fetch_max(now, Ordering::Relaxed);
    }

    fn sub(&self, n: usize) {
        self.current.fetch_sub(n, Ordering::Relaxed);
    }

    pub(crate) fn peak(&self) -> usize {
        self.peak.load(Ordering::Relaxed)
    }

    pub(crate) fn reset_peak(&self) {
        self.peak
            .store(self.current.load(Ordering::Relaxed), Ordering::Relaxed);
    }
}

/// Device memory of `len` values of `T`, freed on drop.
pub(crate) struct DevBuf<T> {
    pub ptr: drv_sys::CUdeviceptr,
    pub len: usize,
    bytes: usize,
    stats: Arc<MemStats>,
    _t: PhantomData<T>,
}

impl<T> DevBuf<T> {
    /// Takes ownership of `bytes` bytes at `ptr`, just allocated by `cuMemAlloc` for `len`
    /// values, and counts them in `stats` until the buffer is dropped.
    pub(super) fn adopt(
        ptr: drv_sys::CUdeviceptr,
        len: usize,
        bytes: usize,
        stats: Arc<MemStats>,
    ) -> Self {
        stats.add(bytes);
        DevBuf {
            ptr,
            len,
            bytes,
            stats,
            _t: PhantomData,
        }
    }

    /// The same memory as bytes.
    pub(super) fn erased(self) -> DevBuf<u8> {
        let b = std::mem::ManuallyDrop::new(self);
        DevBuf {
            ptr: b.ptr,
            len: b.bytes,
            bytes: b.bytes,
            // SAFETY: moved out of `b`, which is never dropped.
            stats: unsafe { std::ptr::read(&b.stats) },
            _t: PhantomData,
        }
    }

    /// Device address of element `i`.
    pub(crate) fn at(&self, i: usize) -> u64 {
        self.ptr + (i * std::mem::size_of::<T>()) as u64
    }
}

impl<T> Drop for DevBuf<T> {
    fn drop(&mut self) {
        // SAFETY: allocated by malloc_sync; cuMemFree waits for work that uses it.
        unsafe {
            let _ = drv::free_sync(self.ptr);
        }
        self.stats.sub(self.bytes);
    }
}

/// Page-locked host memory, for transfers that overlap with computation and run at full
/// bus speed.
pub(crate) struct PinnedBuf<T: Copy + Default> {
    ptr: *mut T,
    len: usize,
}

// SAFETY: the buffer is plain host memory owned by this value.
unsafe impl<T: Copy + Default + Send> Send for PinnedBuf<T> {}

impl<T: Copy + Default> PinnedBuf<T> {
    pub(crate) fn len(&self) -> usize {
        self.len
    }

    pub(crate) fn as_slice(&self) -> &[T] {
        // SAFETY: allocated and initialised in `new`.
        unsafe { std::slice::from_raw_parts(self.ptr, self.len) }
    }

    /// A new buffer, pinned after those asked for before it in this process: one pinning at
    /// a time. Pinning holds the process's memory map, which every device allocation also
    /// needs: on a 4 x H100 node, eight pinnings of 130 MB at once took 0.5-0.65 s, and a
    /// device allocation of another thread waited 150-200 ms for them (one pinning: 50-75 ms).
    pub(crate) fn new(len: usize) -> Result<Self> {
        static ONE_AT_A_TIME: std::sync::Mutex<()> = std::sync::Mutex::new(());
        let bytes = len.max(1) * std::mem::size_of::<T>();
        let turn = ONE_AT_A_TIME
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        // SAFETY: plain allocation; initialised below.
        let ptr = unsafe { drv::malloc_host(bytes, 0) }.map_err(error::driver(format!(
            "cannot allocate {:.1} MiB of pinned host memory",
            bytes as f64 / 1048576.0
        )))? as *mut T;
        drop(turn);
        // SAFETY: `ptr` holds `len` values of T.
        unsafe { std::slice::from_raw_parts_mut(ptr, len).fill(T::default()) };
        Ok(PinnedBuf { ptr, len })
    }

    pub(crate) fn as_mut_slice(&mut self) -> &mut [T] {
        // SAFETY: allocated and initialised in `new`.
        unsafe { std::slice::from_raw_parts_mut(self.ptr, self.len) }
    }
}

impl<T: Copy + Default> Drop for PinnedBuf<T> {
    fn drop(&mut self) {
        // SAFETY: allocated by malloc_host.
        unsafe {
            let _ = drv::free_host(self.ptr as *mut std::ffi::c_void);
        }
    }
}
