//! Backends solve batches of patches. The CPU backend is the reference and always present;
//! the CUDA backend is compiled with the `cuda` feature and otherwise replaced by a module of
//! the same name whose constructor reports that it is missing, so callers carry no `cfg`.

use std::sync::atomic::{AtomicUsize, Ordering};

use crate::error::Result;
use crate::extract::{PatchResult, SolveOptions};
use crate::frame::FrameValues;
use crate::image::Image;
use crate::plan::{Patch, Plan};
use crate::psf::{GaussHermitePsf, TraceTable};

pub mod cpu;
#[cfg(feature = "cuda")]
pub mod cuda;
#[cfg(not(feature = "cuda"))]
#[path = "cuda_disabled.rs"]
pub mod cuda;
pub mod shelf;

/// Everything a backend needs to solve patches of one frame.
///
/// Under MPI a rank that did not read the frame receives only the box of pixels that the
/// frame's spots can touch: elsewhere `image` is zero. Backends read pixels only inside a
/// patch's [`crate::extract::PatchGeometry`], which lies within that box.
#[derive(Clone, Copy)]
pub struct FrameInput<'a> {
    pub plan: &'a Plan,
    pub psf: &'a GaussHermitePsf,
    pub image: &'a Image,
    pub options: &'a SolveOptions,
    /// The traces of the frame's fibers on the plan's padded grid, if evaluated ahead (where
    /// the frame was read); a backend evaluates those it needs and does not find here.
    pub traces: Option<&'a TraceTable>,
}

impl<'a> FrameInput<'a> {
    pub fn new(
        plan: &'a Plan,
        psf: &'a GaussHermitePsf,
        image: &'a Image,
        options: &'a SolveOptions,
    ) -> Self {
        FrameInput {
            plan,
            psf,
            image,
            options,
            traces: None,
        }
    }

    /// The same input with the traces evaluated ahead, if any.
    pub fn with_traces(self, traces: Option<&'a TraceTable>) -> Self {
        FrameInput { traces, ..self }
    }
}

/// A thread-safe counter of solved patches that drives the progress display.
pub struct Progress {
    done: AtomicUsize,
    total: AtomicUsize,
    callback: Box<dyn Fn(usize, usize) + Send + Sync>,
}

impl Progress {
    /// A counter that calls `callback(done, total)` whenever patches finish.
    pub fn new(callback: impl Fn(usize, usize) + Send + Sync + 'static) -> Self {
        Progress {
            done: AtomicUsize::new(0),
            total: AtomicUsize::new(0),
            callback: Box::new(callback),
        }
    }

    /// A counter that reports nowhere.
    pub fn silent() -> Self {
        Progress::new(|_, _| {})
    }

    /// Starts a new count of `total` patches.
    pub fn start(&self, total: usize) {
        self.done.store(0, Ordering::Relaxed);
        self.total.store(total, Ordering::Relaxed);
        (self.callback)(0, total);
    }

    /// Records `n` more finished patches.
    pub fn add(&self, n: usize) {
        let done = self.done.fetch_add(n, Ordering::Relaxed) + n;
        (self.callback)(done, self.total.load(Ordering::Relaxed));
    }

    pub fn done(&self) -> usize {
        self.done.load(Ordering::Relaxed)
    }
}

/// A device that solves patches. Backends move between threads: a rank may solve several
/// frames at once, each on its own backend.
pub trait Backend: Send {
    /// A short description for logs ("cpu (8 threads)", "cuda:0 NVIDIA H100").
    fn describe(&self) -> String;

    /// The CUDA device it drives, if any.
    fn device(&self) -> Option<usize> {
        None
    }

    /// Another backend on the same device, to solve a second frame at the same time.
    fn sibling(&self) -> Result<Box<dyn Backend>>;

    /// Says that this backend solves (its share of) one frame and no other. A GPU backend
    /// then leaves its upload buffers pageable: pinning them serves the frames after the
    /// first, and in desi_proc's line the driver's pinning of 75 MB held up the frame's first
    /// wave until 41-49 ms into the solve, against 10-14 ms without it (one H200 machine).
    fn one_frame_only(&mut self) {}

    /// Readies a backend kept from an earlier job ([`shelf`]) for another: `threads` threads
    /// for its host work (the new job's share of the cores), and what
    /// [`Backend::one_frame_only`] said no longer holds.
    fn reuse(&mut self, _threads: usize) -> Result<()> {
        Ok(())
    }

    /// Solves `patches` (any subset of the plan, in any order) and returns one result per
    /// patch, in the same order.
    fn extract(
        &mut self,
        input: FrameInput<'_>,
        patches: &[Patch],
        progress: &Progress,
    ) -> Result<Vec<PatchResult>>;

    /// [`Backend::extract`] of a whole frame's `patches` whose values the backend may place
    /// straight into `values` (the frame's arrays, all zero) as it unpacks them: those results
    /// are [`PatchResult::placed`] and hold no values. By default none is placed.
    fn extract_into(
        &mut self,
        input: FrameInput<'_>,
        patches: &[Patch],
        progress: &Progress,
        values: &mut FrameValues,
    ) -> Result<Vec<PatchResult>> {
        let _ = values;
        self.extract(input, patches, progress)
    }
}

/// Which backend to build.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum BackendKind {
    Cpu,
    Cuda,
}

/// Builds a backend: `threads` CPU threads, or the CUDA device `device` with `threads`
/// threads for its host work. While [`shelf::keeping`], a CUDA backend kept from an earlier
/// job of the process serves instead of a new one, and this one is kept after its job.
pub fn create(kind: BackendKind, threads: usize, device: usize) -> Result<Box<dyn Backend>> {
    match kind {
        BackendKind::Cpu => Ok(Box::new(cpu::CpuBackend::new(threads)?)),
        BackendKind::Cuda => {
            if let Some(kept) = shelf::take(device, threads)? {
                return Ok(kept);
            }
            let opened = Box::new(cuda::CudaBackend::with_host_threads(device, threads)?);
            Ok(if shelf::keeping() {
                shelf::wrap(threads, opened)
            } else {
                opened
            })
        }
    }
}
