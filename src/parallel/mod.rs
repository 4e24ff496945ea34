//! The SPMD layer: the same binary runs as every rank of an MPI job (`srun`, `mpiexec`) or as
//! one process, and this module decides what each rank does with a [`JobConfig`].
//!
//! - [`job`]: the job's run over frame groups and the final vote;
//! - `collective`: the loop of a frame group of several ranks (read and broadcast, solve,
//!   gather, write);
//! - `overlap`: the loop of a frame group of one rank under `--async-io`, whose reading,
//!   solving and writing overlap on threads;
//! - `phases`: what both loops do to a frame around `pipeline`'s phases (a worker's share,
//!   the writer's assembly, check, write and count);
//! - [`layout`] and `devices`: ranks, nodes, threads, frame groups and roles, the split of a
//!   frame's patches, the rank-to-GPU mapping, starting backends, and their logging;
//! - `visible`: which GPUs the CUDA driver shows a rank (only its own, when it can);
//! - `messages`: what ranks send each other, through serde;
//! - [`startup`]: the ranks' agreement on their configuration before any other collective;
//! - `Comm`/`Universe`: the communication primitives, through MPI when a launcher started
//!   the process (the only user of the `mpi` crate), otherwise a world of one rank. Built
//!   without the `mpi` feature a serial stand-in with the same API takes their place, so
//!   nothing else carries a `cfg`.
//!
//! In each frame group one rank reads each of the group's frames and broadcasts host buffers;
//! results come back to the group's writer by patch index, so the output is the same for any
//! number of groups, ranks and threads.
//!
//! [`JobConfig`]: crate::config::JobConfig

mod collective;
mod devices;
pub mod job;
pub mod layout;
pub mod messages;
mod overlap;
mod phases;
pub mod startup;
mod visible;
pub use visible::node_has_gpus;

#[cfg(feature = "mpi")]
#[path = "comm_mpi.rs"]
mod comm;
#[cfg(not(feature = "mpi"))]
#[path = "comm_serial.rs"]
mod comm;

pub use comm::{launched, Comm, Universe};
pub use layout::{device_for, devices_for, Group, Layout, Roles};

use crate::backend::Progress;
use crate::error::Result;
use crate::frame::Frame;
use crate::pipeline::ExtractRequest;

/// A check of each assembled frame before it is written (`--test`): `Ok(true)` passes,
/// `Ok(false)` is outside its limits (the frame is written and counted), an error fails the
/// frame, which is then not written.
pub type FrameCheck<'a> = dyn Fn(&ExtractRequest, &Frame) -> Result<bool> + Sync + 'a;

/// What the binary's edge lends the parallel layer.
pub struct Hooks<'a> {
    /// Makes the progress display of rank 0's own patches.
    pub progress: &'a dyn Fn() -> Progress,
    pub check: Option<&'a FrameCheck<'a>>,
}

/// What became of a job's frames, the same on every rank.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct JobOutcome {
    /// Frames the job had to extract (after `--skip-existing`).
    pub frames: usize,
    pub written: usize,
    pub failed: usize,
    /// Frames written whose check found them outside its limits.
    pub comparison_failed: usize,
}

/// The lines [`print_line`] printed since [`capture_lines`] started a capture (`None`: no
/// capture): a host process raises them as its exception's message.
static CAPTURED: std::sync::Mutex<Option<Vec<String>>> = std::sync::Mutex::new(None);

fn captured() -> std::sync::MutexGuard<'static, Option<Vec<String>>> {
    CAPTURED
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
}

/// Starts keeping the lines that [`print_line`] prints (they are still printed), dropping
/// those kept before.
pub fn capture_lines() {
    *captured() = Some(Vec::new());
}

/// The lines kept since [`capture_lines`], ending the capture.
pub fn take_captured_lines() -> Vec<String> {
    captured().take().unwrap_or_default()
}

/// Prints one line on stderr in a single write, so that lines of several ranks sharing the
/// launcher's stderr never interleave within a line (`eprintln!` may write in pieces).
pub fn print_line(line: &str) {
    use std::io::Write;
    if let Some(lines) = captured().as_mut() {
        lines.push(line.to_string());
    }
    let mut text = String::with_capacity(line.len() + 1);
    text.push_str(line);
    text.push('\n');
    let _ = std::io::stderr().write_all(text.as_bytes());
}
