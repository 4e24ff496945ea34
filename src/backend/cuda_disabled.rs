//! Stand-in for the CUDA backend when spex is built without the `cuda` feature.

use crate::backend::{Backend, FrameInput, Progress};
use crate::error::{Error, Result};
use crate::extract::PatchResult;
use crate::plan::Patch;

/// Number of CUDA devices this process sees: none without the `cuda` feature.
pub fn device_count() -> Result<usize> {
    Ok(0)
}

/// Without the `cuda` feature there is no driver to start.
pub fn driver_unstarted() -> bool {
    false
}

/// Never constructed: [`CudaBackend::new`] always fails.
pub struct CudaBackend(());

impl CudaBackend {
    pub fn new(device: usize) -> Result<Self> {
        Self::with_host_threads(device, 1)
    }

    pub fn with_host_threads(_device: usize, _threads: usize) -> Result<Self> {
        Err(Error::Gpu(
            "this spex was built without the `cuda` feature".into(),
        ))
    }
}

impl Backend for CudaBackend {
    fn describe(&self) -> String {
        unreachable!("CudaBackend cannot be constructed without the cuda feature")
    }

    fn sibling(&self) -> Result<Box<dyn Backend>> {
        unreachable!("CudaBackend cannot be constructed without the cuda feature")
    }

    fn extract(
        &mut self,
        _: FrameInput<'_>,
        _: &[Patch],
        _: &Progress,
    ) -> Result<Vec<PatchResult>> {
        unreachable!("CudaBackend cannot be constructed without the cuda feature")
    }
}
