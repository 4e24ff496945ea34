//! The extension module `spex._spex`: a thin edge over the spex library for Python, beside
//! the `spex` program's `main`. It turns Python's arguments into the same job configuration
//! the program builds, runs the same parallel layer outside the GIL, and turns the outcome into
//! Python values and exceptions. The pure-Python package `spex` (python/spex) wraps it with
//! desispec's and gpu_specter's signatures.

mod arrays;
mod errors;
mod job;
mod logging;
mod timing;

use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;

// The program's allocator, for the same reason (see its main.rs): the patch solves allocate
// and free megabyte-sized matrices at a high rate. It serves Rust's allocations only; Python
// keeps its own.
#[global_allocator]
static GLOBAL: mimalloc::MiMalloc = mimalloc::MiMalloc;

/// mimalloc's `purge_delay` option: its index in `mi_option_e` (the same in mimalloc 2 and 3).
const MI_OPTION_PURGE_DELAY: libmimalloc_sys::mi_option_t = 15;

#[pymodule]
fn _spex(m: &Bound<'_, PyModule>) -> PyResult<()> {
    // Freed pages stay mapped, as in the program, unless MIMALLOC_PURGE_DELAY says otherwise.
    if std::env::var_os("MIMALLOC_PURGE_DELAY").is_none() {
        // SAFETY: sets one of the allocator's options, which it reads when it next purges.
        unsafe { libmimalloc_sys::mi_option_set(MI_OPTION_PURGE_DELAY, -1) };
    }
    // A Python process extracts again and again: its GPU backends stay open between calls,
    // unless the environment says otherwise (a process that shares its GPUs with others).
    spex::backend::shelf::keep_between_jobs(keep_from_env()?);
    m.add("__version__", env!("CARGO_PKG_VERSION"))?;
    m.add_function(wrap_pyfunction!(job::run_job, m)?)?;
    m.add_function(wrap_pyfunction!(arrays::extract_arrays, m)?)?;
    m.add_function(wrap_pyfunction!(keep_devices, m)?)?;
    m.add_function(wrap_pyfunction!(release_devices, m)?)?;
    m.add_class::<arrays::Psf>()?;
    Ok(())
}

/// Whether the import keeps GPU backends open between calls: `SPEX_KEEP_DEVICES`, 1 (the
/// default) or 0.
fn keep_from_env() -> PyResult<bool> {
    match std::env::var("SPEX_KEEP_DEVICES").as_deref() {
        Err(std::env::VarError::NotPresent) | Ok("1") => Ok(true),
        Ok("0") => Ok(false),
        Ok(v) => Err(PyValueError::new_err(format!(
            "SPEX_KEEP_DEVICES={v:?}: expected 0 (close GPU backends after each call) or 1 \
             (keep them open)"
        ))),
        Err(e) => Err(PyValueError::new_err(format!("SPEX_KEEP_DEVICES: {e}"))),
    }
}

/// Whether the GPU backends of later calls stay open after them (on from the import unless
/// `SPEX_KEEP_DEVICES=0`); `False` also frees those open now. Returns the setting before.
#[pyfunction]
fn keep_devices(py: Python<'_>, on: bool) -> bool {
    py.detach(|| spex::backend::shelf::keep_between_jobs(on))
}

/// Frees the GPU backends kept open between calls (their device memory, pinned host memory
/// and CUDA contexts); returns how many there were. Later calls open them again.
#[pyfunction]
fn release_devices(py: Python<'_>) -> usize {
    py.detach(spex::backend::shelf::release)
}
