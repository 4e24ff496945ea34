//! spex's errors as Python exceptions, with the program's messages: options raise ValueError,
//! files OSError (FileNotFoundError for a missing one), an interruption KeyboardInterrupt,
//! anything else RuntimeError.

use pyo3::exceptions::{PyKeyboardInterrupt, PyOSError, PyRuntimeError, PyValueError};
use pyo3::PyErr;
use spex::config::ConfigError;
use spex::Error;

/// Why a job did not run to the end, before it becomes a Python exception (built off the GIL).
#[derive(Debug)]
pub enum Failure {
    /// Options that cannot work (the program's exit status 2).
    Usage(String),
    /// An error of the library.
    Spex(Error),
    /// A file the job needs, with the operating system's cause.
    Io(std::io::Error),
    /// A job whose frames failed: the lines the ranks printed.
    Frames(String),
}

impl From<ConfigError> for Failure {
    fn from(e: ConfigError) -> Self {
        match e {
            ConfigError::Usage(m) => Failure::Usage(m),
            ConfigError::Input(e) => Failure::Spex(e),
        }
    }
}

impl From<Failure> for PyErr {
    fn from(f: Failure) -> PyErr {
        match f {
            Failure::Usage(m) => PyValueError::new_err(m),
            Failure::Spex(e) => spex_error(e),
            Failure::Io(e) => e.into(),
            Failure::Frames(m) => PyRuntimeError::new_err(m),
        }
    }
}

/// The Python exception of a library error.
pub fn spex_error(e: Error) -> PyErr {
    let message = e.to_string();
    match e {
        Error::Config(_) => PyValueError::new_err(message),
        Error::Io { source, .. } => std::io::Error::new(source.kind(), message).into(),
        Error::Fits { .. } | Error::Psf { .. } | Error::Image { .. } => PyOSError::new_err(message),
        Error::Interrupted => PyKeyboardInterrupt::new_err(message),
        _ => PyRuntimeError::new_err(message),
    }
}
