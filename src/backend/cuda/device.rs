//! One CUDA device: its context and streams, the cuBLAS and cuSOLVER handles bound to the
//! compute stream (created when first needed), the allocation of device buffers
//! (`buffers` owns them) and the copies between host and device.

use std::ops::Range;
use std::sync::Arc;

use cudarc::cublas::sys as cublas_sys;
use cudarc::cusolver::sys as cusolver_sys;
use cudarc::driver::{result as drv, sys as drv_sys, CudaContext, CudaEvent, CudaStream};

use super::buffers::{DevBuf, MemStats};
use super::busy::BusyLog;
use super::error;
use crate::error::{Error, Result};

/// Checks that a CUDA library can be loaded before anything calls into it (cudarc panics
/// on a missing library; spex reports it as an error instead).
fn require_library(present: bool, name: &str, file: &str) -> Result<()> {
    if present {
        Ok(())
    } else {
        Err(Error::Gpu(format!(
            "cannot load the {name} library ({file}): is CUDA installed and on LD_LIBRARY_PATH?"
        )))
    }
}

/// The CUDA driver, which every run loads (NVRTC is checked when a kernel must be compiled,
/// cuBLAS and cuSOLVER when the dense route first needs them).
pub(crate) fn check_libraries() -> Result<()> {
    // SAFETY: this only tries to open the shared library.
    unsafe { require_library(drv_sys::is_culib_present(), "CUDA driver", "libcuda.so") }
}

/// NVRTC, before the first compile: a binary with kernels built in for the device runs
/// without it.
pub(crate) fn require_nvrtc() -> Result<()> {
    // SAFETY: this only tries to open the shared library.
    let present = unsafe { cudarc::nvrtc::sys::is_culib_present() };
    require_library(present, "NVRTC", "libnvrtc.so")
}

/// The cuBLAS and cuSOLVER handles of a stream.
struct Libraries {
    cublas: cublas_sys::cublasHandle_t,
    cusolver: cusolver_sys::cusolverDnHandle_t,
}

impl Libraries {
    /// Creates both handles, bound to `stream`.
    fn open(stream: &CudaStream) -> Result<Self> {
        // SAFETY: these only try to open the shared libraries.
        unsafe {
            require_library(cublas_sys::is_culib_present(), "cuBLAS", "libcublas.so")?;
            require_library(
                cusolver_sys::is_culib_present(),
                "cuSOLVER",
                "libcusolver.so",
            )?;
        }
        let mut libs = Libraries {
            cublas: std::ptr::null_mut(),
            cusolver: std::ptr::null_mut(),
        };
        // SAFETY: plain handle creation; the stream outlives the handles (the device that
        // holds both drops the handles first). A handle created before a failure is
        // destroyed with `libs`.
        unsafe {
            error::cublas(
                cublas_sys::cublasCreate_v2(&mut libs.cublas),
                "cublasCreate",
            )?;
            error::cublas(
                cublas_sys::cublasSetStream_v2(libs.cublas, stream.cu_stream() as _),
                "cublasSetStream",
            )?;
            error::cusolver(
                cusolver_sys::cusolverDnCreate(&mut libs.cusolver),
                "cusolverDnCreate",
            )?;
            error::cusolver(
                cusolver_sys::cusolverDnSetStream(libs.cusolver, stream.cu_stream() as _),
                "cusolverDnSetStream",
            )?;
        }
        Ok(libs)
    }
}

impl Drop for Libraries {
    fn drop(&mut self) {
        // SAFETY: the handles were created in `open` (or are null) and are not used after this.
        unsafe {
            if !self.cusolver.is_null() {
                cusolver_sys::cusolverDnDestroy(self.cusolver);
            }
            if !self.cublas.is_null() {
                cublas_sys::cublasDestroy_v2(self.cublas);
            }
        }
    }
}

/// A CUDA device with one stream, and the cuBLAS / cuSOLVER handles on it once the dense
/// route needs them: the Schur route never does, and creating the handles (which loads the
/// libraries' kernels) takes a good part of a process's start.
pub(crate) struct Device {
    pub ctx: Arc<CudaContext>,
    pub stream: Arc<CudaStream>,
    /// The stream of the uploads of a wave's inputs, which run while `stream` solves the
    /// waves before.
    copies: Arc<CudaStream>,
    /// The stream of the copies back of a wave's results, which run while `stream` solves
    /// the waves after.
    back: Arc<CudaStream>,
    libraries: std::cell::OnceCell<Libraries>,
    /// Buffers replaced by larger ones during a call, freed at its end
    /// ([`Device::free_retired`]): cuMemFree waits for the whole device, which stalled the
    /// work in flight wherever a backend's first call outgrew its first buffers.
    retired: std::cell::RefCell<Vec<DevBuf<u8>>>,
    pub ordinal: usize,
    /// The node's number of the GPU, for logs (see [`node_gpu`]).
    pub node_gpu: String,
    pub name: String,
    pub arch: (i32, i32),
    pub stats: Arc<MemStats>,
    /// When the device's compute streams ran waves, shared with its siblings.
    pub busy: Arc<BusyLog>,
}

/// The node's name of the GPU the driver numbers `ordinal` when `visible` is
/// `CUDA_VISIBLE_DEVICES`: its entry there if that is a number (a rank narrows the variable to
/// its own GPUs before the driver starts, so that its device 0 may be the node's GPU 2), else
/// the ordinal.
fn node_gpu(visible: Option<&str>, ordinal: usize) -> String {
    visible
        .and_then(|v| v.split(',').nth(ordinal))
        .and_then(|entry| entry.trim().parse::<usize>().ok())
        .unwrap_or(ordinal)
        .to_string()
}

// SAFETY: the handles are used from one thread at a time (`&mut CudaBackend`); the context
// is bound to the calling thread before each use.
unsafe impl Send for Device {}

/// The compute capability of device `ordinal`, without creating a context (the kernels can
/// then be compiled while the context and the libraries open); an error if the libraries
/// are missing or the device is not visible.
pub(crate) fn compute_capability(ordinal: usize) -> Result<(i32, i32)> {
    check_libraries()?;
    let count = CudaContext::device_count().map_err(error::driver("cannot count CUDA devices"))?;
    if ordinal >= count.max(0) as usize {
        return Err(Error::Gpu(format!(
            "CUDA device {ordinal} requested but {count} device(s) are visible (CUDA_VISIBLE_DEVICES={})",
            std::env::var("CUDA_VISIBLE_DEVICES").unwrap_or_else(|_| "unset".into())
        )));
    }
    let what = || error::driver(format!("device {ordinal}: compute capability"));
    let dev = drv::device::get(ordinal as i32).map_err(what())?;
    let attribute = |a| {
        // SAFETY: `dev` comes from cuDeviceGet.
        unsafe { drv::device::get_attribute(dev, a) }.map_err(what())
    };
    Ok((
        attribute(drv_sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR)?,
        attribute(drv_sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR)?,
    ))
}

/// Makes the threads that wait for device `ordinal` yield their core between polls
/// (`CU_CTX_SCHED_YIELD` on its primary context), before the context is made. By default
/// the driver spins while a process has fewer contexts than cores: the backends' waits for
/// their copies back then kept about 0.8 of a core busy through a 30-frame list. Yielding,
/// alternating with the default on one H200 machine (16 cores, 3 rounds): 30 plain frames'
/// loop 1.71-1.75 s against 1.81-1.86 s, 0.9-1.4 core-s less user time; desi_proc's form
/// 2.89-2.98 s against 2.88-3.08 s. A blocking wait (`CU_CTX_SCHED_BLOCKING_SYNC`) gave
/// 1.70-1.82 s, and its wake-ups cost a single frame's solve a few milliseconds.
fn yield_while_waiting(ordinal: usize) {
    const YIELD: std::ffi::c_uint = drv_sys::CUctx_flags::CU_CTX_SCHED_YIELD as std::ffi::c_uint;
    let Ok(ordinal) = i32::try_from(ordinal) else {
        return;
    };
    // Advice only: where the driver refuses, the waits stay as they are.
    let set = drv::init()
        .and_then(|()| drv::device::get(ordinal))
        .and_then(|dev| {
            // SAFETY: a plain driver call on a device handle from cuDeviceGet.
            unsafe { drv_sys::cuDevicePrimaryCtxSetFlags_v2(dev, YIELD) }.result()
        });
    if let Err(e) = set {
        tracing::debug!("device {ordinal}: the waits stay the driver's ({e:?})");
    }
}

impl Device {
    /// Opens device `ordinal`, creates a stream and the cuBLAS / cuSOLVER handles. The
    /// ordinal comes checked from [`compute_capability`], which also loads the libraries.
    pub(crate) fn open(ordinal: usize) -> Result<Self> {
        yield_while_waiting(ordinal);
        let ctx = CudaContext::new(ordinal)
            .map_err(error::driver(format!("cannot open CUDA device {ordinal}")))?;
        Self::on_context(ctx, ordinal, None)
    }

    /// Another stream with its own library handles on the same context, so that a second
    /// frame can be solved while this device's stream works on the first. Memory statistics
    /// are its own.
    pub(crate) fn sibling(&self) -> Result<Self> {
        Self::on_context(self.ctx.clone(), self.ordinal, Some(self.busy.clone()))
    }

    /// A device's streams on `ctx`, keeping the device's log of its waves with its siblings
    /// (`busy`), or starting one.
    fn on_context(
        ctx: Arc<CudaContext>,
        ordinal: usize,
        busy: Option<Arc<BusyLog>>,
    ) -> Result<Self> {
        let name = ctx.name().unwrap_or_else(|_| "unknown GPU".into());
        let arch = ctx.compute_capability().map_err(error::driver(format!(
            "device {ordinal}: compute capability"
        )))?;
        let stream = ctx
            .new_stream()
            .map_err(error::driver("cannot create a stream"))?;
        let copies = ctx
            .new_stream()
            .map_err(error::driver("cannot create a stream"))?;
        let back = ctx
            .new_stream()
            .map_err(error::driver("cannot create a stream"))?;
        let node_gpu = node_gpu(
            std::env::var("CUDA_VISIBLE_DEVICES").ok().as_deref(),
            ordinal,
        );
        let busy = match busy {
            Some(busy) => busy,
            None => Arc::new(BusyLog::start(&ctx, &stream, &node_gpu)?),
        };
        Ok(Device {
            ctx,
            stream,
            copies,
            back,
            libraries: std::cell::OnceCell::new(),
            retired: std::cell::RefCell::new(Vec::new()),
            ordinal,
            node_gpu,
            name,
            arch,
            stats: Arc::new(MemStats::default()),
            busy,
        })
    }

    /// The cuBLAS and cuSOLVER handles on this device's stream, created on first use.
    fn libraries(&self) -> Result<&Libraries> {
        if let Some(libs) = self.libraries.get() {
            return Ok(libs);
        }
        let libs = Libraries::open(&self.stream)?;
        Ok(self.libraries.get_or_init(|| libs))
    }

    /// The cuBLAS handle on this device's stream.
    pub(crate) fn cublas(&self) -> Result<cublas_sys::cublasHandle_t> {
        self.libraries().map(|l| l.cublas)
    }

    /// The cuSOLVER handle on this device's stream.
    pub(crate) fn cusolver(&self) -> Result<cusolver_sys::cusolverDnHandle_t> {
        self.libraries().map(|l| l.cusolver)
    }

    /// Makes the context current on the calling thread.
    pub(crate) fn bind(&self) -> Result<()> {
        self.ctx
            .bind_to_thread()
            .map_err(error::driver("cannot bind the CUDA context"))
    }

    pub(crate) fn cu_stream(&self) -> drv_sys::CUstream {
        self.stream.cu_stream()
    }

    /// The most shared memory a block may ask for, in bytes.
    pub(crate) fn max_shared_per_block(&self) -> Result<usize> {
        let what = || error::driver(format!("device {}: shared memory", self.ordinal));
        let dev = drv::device::get(self.ordinal as i32).map_err(what())?;
        // SAFETY: `dev` comes from cuDeviceGet; a plain attribute query.
        let bytes = unsafe {
            drv::device::get_attribute(
                dev,
                drv_sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN,
            )
        }
        .map_err(what())?;
        Ok(bytes.max(0) as usize)
    }

    /// Free and total device memory in bytes.
    pub(crate) fn mem_info(&self) -> Result<(usize, usize)> {
        drv::mem_get_info().map_err(error::driver("cuMemGetInfo"))
    }

    /// Allocates `len` elements of uninitialised device memory.
    pub(crate) fn alloc<T>(&self, len: usize, what: &str) -> Result<DevBuf<T>> {
        let bytes = (len.max(1)) * std::mem::size_of::<T>();
        // SAFETY: a plain allocation in the bound context.
        match unsafe { drv::malloc_sync(bytes) } {
            Ok(ptr) => Ok(DevBuf::adopt(ptr, len, bytes, self.stats.clone())),
            Err(e) => {
                let (free, total) = self.mem_info().unwrap_or((0, 0));
                Err(Error::Gpu(format!(
                    "device {} ({}): cannot allocate {what}: {:.1} MiB requested, {:.1} MiB free of {:.1} MiB ({e:?})",
                    self.ordinal,
                    self.name,
                    bytes as f64 / 1048576.0,
                    free as f64 / 1048576.0,
                    total as f64 / 1048576.0
                )))
            }
        }
    }

    /// Keeps `b` until [`Device::free_retired`]: freeing it now would wait for the device.
    pub(crate) fn retire<T>(&self, b: DevBuf<T>) {
        self.retired.borrow_mut().push(b.erased());
    }

    /// Frees the buffers retired during a call, once the device is done with them.
    pub(crate) fn free_retired(&self) {
        self.retired.borrow_mut().clear();
    }

    /// Allocates device memory set to zero bytes.
    pub(crate) fn zeros<T>(&self, len: usize, what: &str) -> Result<DevBuf<T>> {
        let b = self.alloc::<T>(len, what)?;
        self.memset_zero(&b)?;
        Ok(b)
    }

    pub(crate) fn memset_zero<T>(&self, b: &DevBuf<T>) -> Result<()> {
        self.zero_prefix(b, b.len)
    }

    /// Sets the first `len` values of `b` to zero bytes.
    pub(crate) fn zero_prefix<T>(&self, b: &DevBuf<T>, len: usize) -> Result<()> {
        self.fill_prefix(b, len, 0)
    }

    /// Sets every byte of the first `len` values of `b` to `byte`.
    pub(crate) fn fill_prefix<T>(&self, b: &DevBuf<T>, len: usize, byte: u8) -> Result<()> {
        self.fill_range(b, 0..len, byte)
    }

    /// Sets every byte of the values `range` of `b` to `byte`.
    pub(crate) fn fill_range<T>(&self, b: &DevBuf<T>, range: Range<usize>, byte: u8) -> Result<()> {
        assert!(range.end <= b.len);
        if range.is_empty() {
            return Ok(());
        }
        // SAFETY: the range lies inside the allocation.
        unsafe {
            drv::memset_d8_async(
                b.at(range.start),
                byte,
                range.len() * std::mem::size_of::<T>(),
                self.cu_stream(),
            )
        }
        .map_err(error::driver("cuMemsetD8Async"))
    }

    /// Allocates and fills a device buffer from host data (stream-ordered; pageable host
    /// memory is staged by the driver before the call returns).
    pub(crate) fn upload<T: Copy>(&self, host: &[T], what: &str) -> Result<DevBuf<T>> {
        let b = self.alloc::<T>(host.len(), what)?;
        self.copy_to(&b, host, what)?;
        Ok(b)
    }

    /// Copies host data into the start of a device buffer.
    pub(crate) fn copy_to<T: Copy>(&self, b: &DevBuf<T>, host: &[T], what: &str) -> Result<()> {
        self.copy_to_at(b, 0, host, what)
    }

    /// [`Device::copy_to`] from index `offset` of `b` on, on the compute stream.
    pub(crate) fn copy_to_at<T: Copy>(
        &self,
        b: &DevBuf<T>,
        offset: usize,
        host: &[T],
        what: &str,
    ) -> Result<()> {
        htod(b, offset, host, self.cu_stream(), what)
    }

    /// [`Device::copy_to`] from index `offset` of `b` on, on the copy stream: it runs while
    /// the compute stream works, and the compute stream sees it after
    /// [`Device::join_copies`]. A pinned `host` must live until then.
    pub(crate) fn upload_at<T: Copy>(
        &self,
        b: &DevBuf<T>,
        offset: usize,
        host: &[T],
        what: &str,
    ) -> Result<()> {
        htod(b, offset, host, self.copies.cu_stream(), what)
    }

    /// Uploads `strip`, columns `cols` of every row of an image of `ncols` columns packed row
    /// after row, into its place in `image`, on the copy stream: in one piece into `scratch`,
    /// then across on the device (from pageable memory, a copy of the rows one by one into
    /// place took the host several times longer).
    pub(crate) fn upload_columns(
        &self,
        image: &DevBuf<f32>,
        scratch: &DevBuf<f32>,
        strip: &[f32],
        ncols: usize,
        cols: Range<usize>,
        what: &str,
    ) -> Result<()> {
        let width = cols.len();
        if strip.is_empty() || width == 0 {
            return Ok(());
        }
        let rows = strip.len() / width;
        assert!(rows * width == strip.len() && cols.end <= ncols && rows * ncols <= image.len);
        self.upload_at(scratch, 0, strip, what)?;
        let copy = drv_sys::CUDA_MEMCPY2D {
            srcXInBytes: 0,
            srcY: 0,
            srcMemoryType: drv_sys::CUmemorytype::CU_MEMORYTYPE_DEVICE,
            srcHost: std::ptr::null(),
            srcDevice: scratch.ptr,
            srcArray: std::ptr::null_mut(),
            srcPitch: width * 4,
            dstXInBytes: cols.start * 4,
            dstY: 0,
            dstMemoryType: drv_sys::CUmemorytype::CU_MEMORYTYPE_DEVICE,
            dstHost: std::ptr::null_mut(),
            dstDevice: image.ptr,
            dstArray: std::ptr::null_mut(),
            dstPitch: ncols * 4,
            WidthInBytes: width * 4,
            Height: rows,
        };
        // SAFETY: the rectangle lies within both buffers (checked above and by upload_at).
        unsafe { drv_sys::cuMemcpy2DAsync_v2(&copy, self.copies.cu_stream()) }
            .result()
            .map_err(error::driver(format!("placing {what} on the device")))
    }

    /// An event at the uploads queued so far.
    pub(crate) fn copies_event(&self) -> Result<CudaEvent> {
        self.copies
            .record_event(None)
            .map_err(error::driver("cuEventRecord"))
    }

    /// Waits for the uploads queued so far (before their host buffers may go).
    pub(crate) fn sync_copies(&self) -> Result<()> {
        self.copies
            .synchronize()
            .map_err(error::driver(format!("device {}: uploads", self.ordinal)))
    }

    /// Makes the compute stream wait for the uploads queued so far.
    pub(crate) fn join_copies(&self) -> Result<()> {
        self.stream
            .join(&self.copies)
            .map_err(error::driver("wait for the uploads"))
    }

    /// Makes the stream of the copies back wait for `event` (of the compute stream), or for
    /// all the work queued on the compute stream so far.
    pub(crate) fn back_after(&self, event: Option<&CudaEvent>) -> Result<()> {
        match event {
            Some(e) => self.back.wait(e),
            None => self.back.join(&self.stream),
        }
        .map_err(error::driver("copies back after the kernels"))
    }

    /// [`Device::copy_from`] (from index `offset` of `b`) on the stream of the copies back;
    /// the host buffer must live until a [`Device::back_event`] recorded after it has passed.
    pub(crate) fn copy_back<T: Copy>(
        &self,
        host: &mut [T],
        b: &DevBuf<T>,
        offset: usize,
        what: &str,
    ) -> Result<()> {
        dtoh(host, b, offset, self.back.cu_stream(), what)
    }

    /// An event (with timing) at the work queued so far on the stream of the copies back.
    pub(crate) fn back_event(&self) -> Result<CudaEvent> {
        self.back
            .record_event(Some(drv_sys::CUevent_flags::CU_EVENT_DEFAULT))
            .map_err(error::driver("cuEventRecord"))
    }

    /// Waits for the copies back queued so far.
    pub(crate) fn sync_back(&self) -> Result<()> {
        self.back.synchronize().map_err(error::driver(format!(
            "device {}: copies back",
            self.ordinal
        )))
    }

    /// Copies the start of a device buffer into host memory; completes at the next
    /// [`Device::sync`].
    pub(crate) fn copy_from<T: Copy>(
        &self,
        host: &mut [T],
        b: &DevBuf<T>,
        offset: usize,
        what: &str,
    ) -> Result<()> {
        dtoh(host, b, offset, self.cu_stream(), what)
    }

    /// Copies the first `len` values of `src` into `dst`.
    pub(crate) fn dtod<T>(&self, dst: &DevBuf<T>, src: &DevBuf<T>, len: usize) -> Result<()> {
        self.dtod_at(dst, 0, src, 0, len)
    }

    /// Copies `len` values of `src` from index `src_at` on into `dst` from index `dst_at` on;
    /// within one buffer, the two ranges must not overlap.
    pub(crate) fn dtod_at<T>(
        &self,
        dst: &DevBuf<T>,
        dst_at: usize,
        src: &DevBuf<T>,
        src_at: usize,
        len: usize,
    ) -> Result<()> {
        assert!(src_at + len <= src.len && dst_at + len <= dst.len);
        assert!(dst.ptr != src.ptr || src_at + len <= dst_at || dst_at + len <= src_at);
        // SAFETY: both ranges lie within their buffers and do not overlap.
        unsafe {
            drv::memcpy_dtod_async(
                dst.at(dst_at),
                src.at(src_at),
                len * std::mem::size_of::<T>(),
                self.cu_stream(),
            )
        }
        .map_err(error::driver("device-to-device copy"))
    }

    /// Waits for everything queued on the stream.
    pub(crate) fn sync(&self, what: &str) -> Result<()> {
        self.stream
            .synchronize()
            .map_err(error::driver(format!("device {}: {what}", self.ordinal)))
    }
}

impl Drop for Device {
    fn drop(&mut self) {
        // The library handles go while the context is bound and the stream idle.
        let _ = self.ctx.bind_to_thread();
        let _ = self.copies.synchronize();
        let _ = self.back.synchronize();
        let _ = self.stream.synchronize();
        drop(self.libraries.take());
    }
}

/// Copies `host` into `b` from index `offset` on, on `stream`.
fn htod<T: Copy>(
    b: &DevBuf<T>,
    offset: usize,
    host: &[T],
    stream: drv_sys::CUstream,
    what: &str,
) -> Result<()> {
    assert!(offset + host.len() <= b.len);
    if host.is_empty() {
        return Ok(());
    }
    // SAFETY: sizes checked above; the host slice lives until the copy has been staged
    // (pageable) or until the stream has passed it (pinned, see PinnedBuf).
    unsafe { drv::memcpy_htod_async(b.at(offset), host, stream) }
        .map_err(error::driver(format!("copy of {what} to the device")))
}

/// Copies `host.len()` values of `b` from index `offset` on into `host` on `stream`.
fn dtoh<T: Copy>(
    host: &mut [T],
    b: &DevBuf<T>,
    offset: usize,
    stream: drv_sys::CUstream,
    what: &str,
) -> Result<()> {
    assert!(offset + host.len() <= b.len);
    if host.is_empty() {
        return Ok(());
    }
    // SAFETY: bounds checked; the caller keeps `host` alive until the stream has passed the
    // copy.
    unsafe { drv::memcpy_dtoh_async(host, b.at(offset), stream) }
        .map_err(error::driver(format!("copy of {what} from the device")))
}

#[cfg(test)]
mod tests {
    use super::node_gpu;

    #[test]
    fn a_device_is_named_by_the_node_s_number_of_its_gpu() {
        assert_eq!(node_gpu(Some("2"), 0), "2");
        assert_eq!(node_gpu(Some("3, 1"), 1), "1");
        assert_eq!(node_gpu(None, 1), "1");
        // UUIDs, or fewer entries than devices: the driver's ordinal
        assert_eq!(node_gpu(Some("GPU-8746"), 0), "0");
        assert_eq!(node_gpu(Some("2"), 1), "1");
    }
}
