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

use cudarc::driver::{result as drv, sys as drv_sys, CudaContext};

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
///
/// The memory is the process's own mapping, advised to huge pages and touched before the
/// driver registers it (`cuMemHostRegister`). The driver's own pinned allocation
/// (`cuMemHostAlloc`) maps its pages into the process while holding the process's memory map,
/// so the page faults and device allocations of every other thread waited for it: on H200
/// machines, 40-92 ms while 75-150 MB were allocated, against 2-7 ms (page faults) and 3-5 ms
/// (allocations, one of 93 ms) while as much was registered. A backend's first frame, whose
/// uploads are pinned while its first waves are set up, lost some 60 ms that way.
pub(crate) struct PinnedBuf<T: Copy + Default> {
    ptr: *mut T,
    len: usize,
    /// Bytes mapped: `len` values rounded up to whole huge pages.
    mapped: usize,
    /// The context it is registered with, bound again to unregister it.
    ctx: Arc<CudaContext>,
}

// SAFETY: the buffer is plain host memory owned by this value.
unsafe impl<T: Copy + Default + Send> Send for PinnedBuf<T> {}

/// The size of a transparent huge page on x86-64 and aarch64 with 4 KiB base pages.
const HUGE_PAGE: usize = 2 << 20;

impl<T: Copy + Default> PinnedBuf<T> {
    pub(crate) fn len(&self) -> usize {
        self.len
    }

    pub(crate) fn as_slice(&self) -> &[T] {
        // SAFETY: mapped and initialised in `new`.
        unsafe { std::slice::from_raw_parts(self.ptr, self.len) }
    }

    /// A new buffer, registered with `ctx` after those asked for before it in this process:
    /// one registration at a time (eight pinnings at once on a 4 x H100 node, by the driver's
    /// allocation, took 0.5-0.65 s against 50-75 ms for one).
    pub(crate) fn new(ctx: &Arc<CudaContext>, len: usize) -> Result<Self> {
        static ONE_AT_A_TIME: std::sync::Mutex<()> = std::sync::Mutex::new(());
        let bytes = len.max(1) * std::mem::size_of::<T>();
        let mapped = bytes.div_ceil(HUGE_PAGE) * HUGE_PAGE;
        let what = || format!("{:.1} MiB of pinned host memory", bytes as f64 / 1048576.0);
        // SAFETY: a fresh private anonymous mapping, owned by the value returned.
        let ptr = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                mapped,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
                -1,
                0,
            )
        };
        if ptr == libc::MAP_FAILED {
            let e = std::io::Error::last_os_error();
            return Err(crate::error::Error::Gpu(format!(
                "cannot map {}: {e}",
                what()
            )));
        }
        // Huge pages where the host gives them (advice only: without, the pages are small).
        // SAFETY: the range is the mapping made above.
        unsafe { libc::madvise(ptr, mapped, libc::MADV_HUGEPAGE) };
        // The pages are faulted in here, by this thread alone, before the driver locks them.
        // SAFETY: the mapping holds `len` values of T.
        unsafe { std::slice::from_raw_parts_mut(ptr as *mut T, len).fill(T::default()) };
        let turn = ONE_AT_A_TIME
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        let registered = ctx.bind_to_thread().and_then(|()| {
            // SAFETY: the range is mapped and outlives the registration (undone in `drop`).
            unsafe { drv_sys::cuMemHostRegister_v2(ptr, mapped, 0) }.result()
        });
        drop(turn);
        match registered {
            Ok(()) => Ok(PinnedBuf {
                ptr: ptr as *mut T,
                len,
                mapped,
                ctx: ctx.clone(),
            }),
            Err(e) => {
                // SAFETY: the mapping made above, not registered.
                unsafe { libc::munmap(ptr, mapped) };
                Err(error::driver(format!("cannot pin {}", what()))(e))
            }
        }
    }

    pub(crate) fn as_mut_slice(&mut self) -> &mut [T] {
        // SAFETY: mapped in `new` (and initialised there before any read).
        unsafe { std::slice::from_raw_parts_mut(self.ptr, self.len) }
    }
}

impl<T: Copy + Default> Drop for PinnedBuf<T> {
    fn drop(&mut self) {
        let ptr = self.ptr as *mut std::ffi::c_void;
        let _ = self.ctx.bind_to_thread();
        // SAFETY: registered and mapped in `new`, and no transfer uses it any more.
        unsafe {
            let _ = drv_sys::cuMemHostUnregister(ptr);
            libc::munmap(ptr, self.mapped);
        }
    }
}
