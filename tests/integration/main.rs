//! The integration tests of spex, one binary: each module drives the library or the built
//! `spex` binary on the bundled data (tests/data).
//!
//! - `bad_input`: what bad input and hostile surroundings get (exit status, one line, no
//!   leftovers, inputs untouched);
//! - `conditioning`: the CPU flux of ill-conditioned blocks against a double-double reference;
//! - `cli`: the command line end to end, exit codes and error lines;
//! - `format`: the frame, model and simulated preproc files as desispec writes and reads them;
//! - `extract`: physics and numerics of the CPU extraction against the reference cases;
//! - `mpi`: multi-rank runs under a real `mpiexec`;
//! - `desispec`: desispec itself (a pinned venv, `scripts/desispec-env`) reads spex's files;
//! - `qa`: the quick-look picture (`spex qa`) read back;
//! - `science`: capabilities beyond gpu_specter's (any fiber range, outlier rejection);
//! - `gpu`: the CUDA backend against the CPU (ignored without a GPU; `scripts/gpu-check`);
//! - `options`: the extraction options end to end, input protection, `--skip-existing` and
//!   SIGTERM in `--list` runs;
//! - `promises`: README promises no other module pins (pulls from the truth files
//!   computed here, the barycentric correction applied to the extraction);
//! - `scripts`: the scripts of `scripts/` parse.

mod bad_input;
mod cli;
mod common;
mod conditioning;
mod dead_bins;
mod desispec;
mod downstream;
mod extract;
mod format;
#[cfg(feature = "cuda")]
mod gpu;
// A spex built without the `mpi` feature has no multi-rank runs to test.
#[cfg(feature = "mpi")]
mod mpi;
mod options;
mod promises;
mod qa;
mod science;
mod scripts;
