//! The library's error type: every failure names the file, HDU, patch or device it concerns.

use std::path::PathBuf;

/// Errors of the spex library. The binary adds context with `anyhow` at the edge.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// A FITS file could not be opened, read or written (cfitsio's message included).
    #[error("{path}: {what}: {message}")]
    Fits {
        path: PathBuf,
        what: String,
        message: String,
    },

    /// A PSF file that opened but does not describe a usable Gauss-Hermite PSF.
    #[error("{path}: invalid PSF: {message}")]
    Psf { path: PathBuf, message: String },

    /// A preproc image whose HDUs are inconsistent (shapes, types).
    #[error("{path}: invalid image: {message}")]
    Image { path: PathBuf, message: String },

    /// Extraction options that cannot work with the given inputs.
    #[error("invalid options: {0}")]
    Config(String),

    /// The GPU backend: driver, NVRTC, cuBLAS/cuSOLVER or device memory.
    #[error("GPU: {0}")]
    Gpu(String),

    /// MPI communication: a message that cannot be allocated or exchanged.
    #[error("MPI: {0}")]
    Mpi(String),

    /// A message from another rank that does not decode into what it claims to be.
    #[error("malformed message: {0}")]
    Message(String),

    /// A broken promise inside spex: a thread that panicked, a protocol step out of order,
    /// a failure injected by a test.
    #[error("internal error: {0}")]
    Internal(String),

    /// A frame whose FLUX, IVAR or RESOLUTION would hold NaN or infinity: it is not written.
    #[error(
        "{path}: {count} non-finite FLUX/IVAR/RESOLUTION values, the first at fiber {fiber}, bin {bin}; the frame is not written"
    )]
    NonFiniteFrame {
        path: PathBuf,
        count: usize,
        fiber: usize,
        bin: usize,
    },

    /// The host process asked the job to stop (Ctrl-C in Python) before this frame.
    #[error("interrupted")]
    Interrupted,

    /// Plain I/O outside cfitsio (renames, list files).
    #[error("{path}: {source}")]
    Io {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
}

/// Result alias of the library.
pub type Result<T, E = Error> = std::result::Result<T, E>;

impl Error {
    pub fn config(message: impl Into<String>) -> Self {
        Error::Config(message.into())
    }
}

/// A float for a message: its shortest exact digits, in exponent form outside 1e-4..1e16,
/// where the plain form runs to hundreds of digits (a step of 1e-300, an MJD of 1e300).
pub fn number(x: f64) -> String {
    if x == 0.0 || !x.is_finite() || (1e-4..1e16).contains(&x.abs()) {
        format!("{x}")
    } else {
        format!("{x:e}")
    }
}
