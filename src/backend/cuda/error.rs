//! Conversion of CUDA driver, NVRTC, cuBLAS and cuSOLVER failures into [`Error::Gpu`] with
//! the operation that failed in the message.

use cudarc::cublas::sys::cublasStatus_t;
use cudarc::cusolver::sys::cusolverStatus_t;
use cudarc::driver::DriverError;

use crate::error::Error;

/// Adds what was being done to a driver error.
pub(crate) fn driver(what: impl std::fmt::Display) -> impl FnOnce(DriverError) -> Error {
    move |e| Error::Gpu(format!("{what}: CUDA driver error {e:?}"))
}

/// Checks a cuBLAS status.
pub(crate) fn cublas(status: cublasStatus_t, what: &str) -> crate::Result<()> {
    if status == cublasStatus_t::CUBLAS_STATUS_SUCCESS {
        Ok(())
    } else {
        Err(Error::Gpu(format!("{what}: cuBLAS returned {status:?}")))
    }
}

/// Checks a cuSOLVER status.
pub(crate) fn cusolver(status: cusolverStatus_t, what: &str) -> crate::Result<()> {
    if status == cusolverStatus_t::CUSOLVER_STATUS_SUCCESS {
        Ok(())
    } else {
        Err(Error::Gpu(format!("{what}: cuSOLVER returned {status:?}")))
    }
}
