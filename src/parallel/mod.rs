//! The SPMD layer: the same binary runs as every rank of an MPI job (`srun`, `mpiexec`) or as
//! one process, and this module decides what each rank does.
//!
//! - [`layout`]: ranks, nodes, node-local ranks, threads per rank, the frame groups and the
//!   roles of their ranks (reader, writer, workers), the split of a frame's patches and the
//!   rank-to-GPU mapping;
//! - [`exchange`]: the flat word buffers that carry headers and patch results between ranks;
//! - [`exposure`]: the loop over frames (one or a whole exposure) with its error protocol;
//! - `overlap`: the same loop for a frame group of one rank under `--async-io`, whose reading,
//!   solving and writing overlap on threads;
//! - `Comm`/`Universe`: the communication primitives, through MPI when a launcher started
//!   the process (the only user of the `mpi` crate), otherwise a world of one rank. Built
//!   without the `mpi` feature a serial stand-in with the same API takes their place, so
//!   nothing else carries a `cfg`.
//!
//! In each frame group one rank reads each of the group's frames and broadcasts host buffers;
//! results come back to the group's writer by patch index, so the output is the same for any
//! number of groups, ranks and threads.

pub mod exchange;
pub mod exposure;
pub mod layout;
mod overlap;

#[cfg(feature = "mpi")]
#[path = "comm_mpi.rs"]
mod comm;
#[cfg(not(feature = "mpi"))]
#[path = "comm_serial.rs"]
mod comm;

pub use comm::{launched, Comm, Universe};
pub use layout::{device_for, devices_for, Group, Layout, Roles};

/// Prints one line on stderr in a single write, so that lines of several ranks sharing the
/// launcher's stderr never interleave within a line (`eprintln!` may write in pieces).
pub fn print_line(line: &str) {
    use std::io::Write;
    let mut text = String::with_capacity(line.len() + 1);
    text.push_str(line);
    text.push('\n');
    let _ = std::io::stderr().write_all(text.as_bytes());
}
