//! The extension module `spex._spex`: a thin edge over the spex library for Python, beside
//! the `spex` program's `main`. It turns Python's arguments into the same job configuration
//! the program builds, runs the same parallel layer outside the GIL, and turns the outcome into
//! Python values and exceptions. The pure-Python package `spex` (python/spex) wraps it with
//! desispec's and gpu_specter's signatures.

mod arrays;
mod errors;
mod job;
mod logging;

use pyo3::prelude::*;

#[pymodule]
fn _spex(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add("__version__", env!("CARGO_PKG_VERSION"))?;
    m.add_function(wrap_pyfunction!(job::run_job, m)?)?;
    m.add_function(wrap_pyfunction!(arrays::extract_arrays, m)?)?;
    m.add_class::<arrays::Psf>()?;
    Ok(())
}
