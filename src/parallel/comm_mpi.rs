//! Communication through MPI (rsmpi): the only module that uses the `mpi` crate. Built without
//! the `mpi` feature, `comm_serial.rs` takes its place with the same API for one process.
//!
//! MPI is initialised only when a launcher started this process (`srun`, `mpiexec`): a plain
//! `spex` on a laptop or a login node never touches the MPI library. Every buffer is a host
//! buffer: the MPI of the GPU machines is not CUDA-aware.

use mpi::collective::SystemOperation;
use mpi::datatype::PartitionMut;
use mpi::environment::Threading;
use mpi::topology::{Color, SimpleCommunicator};
use mpi::traits::*;

use crate::error::{Error, Result};

/// Environment variables that MPI launchers set in the processes they start: Open MPI
/// (`mpiexec`), PMIx and PMI (Slurm's `srun --mpi=...`, MPICH, Cray MPICH), Intel MPI and
/// MVAPICH, and Slurm job steps in general.
const LAUNCHER_VARIABLES: &[&str] = &[
    "OMPI_COMM_WORLD_SIZE",
    "PMIX_RANK",
    "PMI_RANK",
    "PMI_SIZE",
    "MPI_LOCALNRANKS",
    "MV2_COMM_WORLD_SIZE",
    "SLURM_PROCID",
];

/// Whether a launcher started this process; `SPEX_MPI=1` or `0` overrides the detection.
pub fn launched() -> bool {
    match std::env::var("SPEX_MPI").ok().as_deref() {
        Some("1") => true,
        Some("0") => false,
        _ => LAUNCHER_VARIABLES
            .iter()
            .any(|v| std::env::var_os(v).is_some()),
    }
}

/// The MPI environment of the process: finalises MPI when dropped, after every [`Comm`].
pub struct Universe {
    mpi: Option<mpi::environment::Universe>,
}

impl Universe {
    /// Initialises MPI if a launcher started this process; otherwise a world of one rank.
    pub fn init() -> Self {
        if !launched() {
            return Universe { mpi: None };
        }
        // Worker threads (rayon, CUDA streams) never call MPI: only the main thread does.
        let mpi = mpi::initialize_with_threading(Threading::Funneled).map(|(u, _)| u);
        Universe { mpi }
    }

    /// Whether MPI is in use.
    pub fn is_mpi(&self) -> bool {
        self.mpi.is_some()
    }

    /// All ranks of the job.
    pub fn world(&self) -> Comm {
        Comm(self.mpi.as_ref().map(|u| u.world()))
    }

    /// Makes a panic on any thread print one line naming the rank and abort the whole job, so
    /// that the other ranks do not wait forever for this one.
    pub fn abort_on_panic(&self, rank: usize) {
        if self.mpi.is_none() {
            return;
        }
        std::panic::set_hook(Box::new(move |info| {
            let message = info
                .payload()
                .downcast_ref::<&str>()
                .map(|s| s.to_string())
                .or_else(|| info.payload().downcast_ref::<String>().cloned())
                .unwrap_or_else(|| "panic".into());
            let place = info
                .location()
                .map(|l| format!(" ({}:{})", l.file(), l.line()))
                .unwrap_or_default();
            super::print_line(&format!("spex: rank {rank}: error: {message}{place}"));
            SimpleCommunicator::world().abort(1)
        }));
    }
}

/// A communicator: a group of ranks that take part in collective operations together. Every
/// collective must be called by every rank of the group in the same order.
pub struct Comm(Option<SimpleCommunicator>);

/// Largest number of elements of one MPI call (MPI counts and displacements are C ints).
const MAX_COUNT: usize = i32::MAX as usize;

impl Comm {
    pub fn rank(&self) -> usize {
        self.0.as_ref().map_or(0, |c| c.rank() as usize)
    }

    pub fn size(&self) -> usize {
        self.0.as_ref().map_or(1, |c| c.size() as usize)
    }

    /// Splits into groups by `color` (ranks passing `None` get no group); ranks keep their order.
    pub fn split(&self, color: Option<u32>) -> Option<Comm> {
        match &self.0 {
            None => color.map(|_| Comm(None)),
            Some(c) => {
                let color = match color {
                    Some(v) => Color::with_value(v as i32),
                    None => Color::undefined(),
                };
                c.split_by_color(color).map(|c| Comm(Some(c)))
            }
        }
    }

    /// The ranks of this node (those that can share memory).
    pub fn split_shared(&self) -> Comm {
        Comm(self.0.as_ref().map(|c| c.split_shared(c.rank())))
    }

    /// Broadcasts a message of any length from `root`.
    pub fn broadcast_bytes(&self, root: usize, bytes: &mut Vec<u8>) -> Result<()> {
        let Some(c) = &self.0 else { return Ok(()) };
        let mut len = bytes.len() as u64;
        c.process_at_rank(root as i32).broadcast_into(&mut len);
        if c.rank() as usize != root {
            let len = usize::try_from(len).map_err(|_| Error::Mpi("message too long".into()))?;
            bytes.clear();
            bytes
                .try_reserve_exact(len)
                .map_err(|_| out_of_memory(len))?;
            bytes.resize(len, 0);
        }
        for chunk in bytes.chunks_mut(MAX_COUNT) {
            c.process_at_rank(root as i32).broadcast_into(chunk);
        }
        Ok(())
    }

    /// Broadcasts a buffer whose length every rank knows.
    pub fn broadcast_f32(&self, root: usize, buf: &mut [f32]) {
        let Some(c) = &self.0 else { return };
        for chunk in buf.chunks_mut(MAX_COUNT) {
            c.process_at_rank(root as i32).broadcast_into(chunk);
        }
    }

    /// Gathers every rank's message on `root`, in rank order (`None` on the other ranks).
    /// Messages may have any length: large ones go in rounds of at most `i32::MAX` bytes.
    pub fn gather_bytes(&self, root: usize, bytes: &[u8]) -> Result<Option<Vec<Vec<u8>>>> {
        let Some(c) = &self.0 else {
            return Ok(Some(vec![bytes.to_vec()]));
        };
        let size = c.size() as usize;
        let me = c.rank() as usize;
        let proc = c.process_at_rank(root as i32);
        let len = bytes.len() as u64;
        let mut lens = vec![0u64; if me == root { size } else { 0 }];
        if me == root {
            proc.gather_into_root(&len, &mut lens[..]);
        } else {
            proc.gather_into(&len);
        }
        let longest = self.all_max(len) as usize;
        // Bytes per rank per round, so that a round's total fits a C int.
        let per_round = (MAX_COUNT / size).max(1);
        let rounds = longest.div_ceil(per_round);
        let mut out: Vec<Vec<u8>> = Vec::new();
        if me == root {
            for &l in &lens {
                let l = l as usize;
                let mut v = Vec::new();
                v.try_reserve_exact(l).map_err(|_| out_of_memory(l))?;
                out.push(v);
            }
        }
        for round in 0..rounds {
            let piece = |l: usize| {
                let start = (round * per_round).min(l);
                start..(start + per_round).min(l)
            };
            let mine = &bytes[piece(bytes.len())];
            if me == root {
                let counts: Vec<i32> = lens
                    .iter()
                    .map(|&l| piece(l as usize).len() as i32)
                    .collect();
                let displs: Vec<i32> = counts
                    .iter()
                    .scan(0i32, |acc, &n| {
                        let d = *acc;
                        *acc += n;
                        Some(d)
                    })
                    .collect();
                let total: usize = counts.iter().map(|&n| n as usize).sum();
                let mut buf = vec![0u8; total];
                {
                    let mut part = PartitionMut::new(&mut buf[..], &counts[..], &displs[..]);
                    proc.gather_varcount_into_root(mine, &mut part);
                }
                for (r, v) in out.iter_mut().enumerate() {
                    let d = displs[r] as usize;
                    v.extend_from_slice(&buf[d..d + counts[r] as usize]);
                }
            } else {
                proc.gather_varcount_into(mine);
            }
        }
        Ok((me == root).then_some(out))
    }

    /// Waits until every rank of the group has arrived here, sleeping rather than spinning.
    ///
    /// MPI implementations busy-poll inside blocking collectives. Ranks that wait for a
    /// reader, a writer or a slower worker would then burn the cores the busy ranks need
    /// whenever ranks outnumber cores (threads, oversubscription, MPS). Calling this before a
    /// collective in which ranks may wait long moves the waiting into a non-blocking barrier
    /// polled every few milliseconds; the collective itself then starts with everyone present.
    pub fn wait_quietly(&self) {
        let Some(c) = &self.0 else { return };
        let mut request = c.immediate_barrier();
        let mut pause = std::time::Duration::from_micros(20);
        loop {
            match request.test() {
                Ok(_) => return,
                Err(r) => request = r,
            }
            std::thread::sleep(pause);
            pause = (pause * 2).min(std::time::Duration::from_millis(2));
        }
    }

    /// The largest of every rank's `value`.
    pub fn all_max(&self, value: u64) -> u64 {
        let Some(c) = &self.0 else { return value };
        let mut out = 0u64;
        c.all_reduce_into(&value, &mut out, SystemOperation::max());
        out
    }

    /// The sum of every rank's `value`.
    pub fn all_sum(&self, value: u64) -> u64 {
        let Some(c) = &self.0 else { return value };
        let mut out = 0u64;
        c.all_reduce_into(&value, &mut out, SystemOperation::sum());
        out
    }

    /// Every rank's `value`, on every rank.
    pub fn all_gather(&self, value: u64) -> Vec<u64> {
        let Some(c) = &self.0 else { return vec![value] };
        let mut out = vec![0u64; c.size() as usize];
        c.all_gather_into(&value, &mut out[..]);
        out
    }

    /// Ends the whole job with exit status `code`: the way out when ranks are out of step and
    /// a collective would wait forever.
    pub fn abort(&self, code: i32) -> ! {
        match &self.0 {
            Some(c) => c.abort(code),
            None => std::process::exit(code),
        }
    }
}

fn out_of_memory(bytes: usize) -> Error {
    Error::Mpi(format!(
        "out of memory: cannot allocate {:.1} MB for a message",
        bytes as f64 / 1e6
    ))
}

impl Comm {
    /// A communicator of a host process, from its Fortran handle (`comm.py2f()` in mpi4py,
    /// an integer under every MPI implementation, unlike the C handle): spex works on its own duplicate, freed when the returned `Comm` drops, so the
    /// host's communicator and its pending messages are untouched. Collective over the
    /// host's communicator.
    ///
    /// # Safety
    /// `handle` must be a valid intracommunicator handle of the MPI library spex is linked
    /// with, and MPI must stay initialised while the returned `Comm` lives.
    pub unsafe fn from_fortran_handle(handle: i32) -> Result<Comm> {
        let mut initialized = 0;
        mpi::ffi::MPI_Initialized(&mut initialized);
        if initialized == 0 {
            return Err(Error::Mpi(
                "a communicator was given but MPI is not initialised".into(),
            ));
        }
        let host = mpi::ffi::MPI_Comm_f2c(handle);
        let mut dup = std::mem::zeroed::<mpi::ffi::MPI_Comm>();
        let status = mpi::ffi::MPI_Comm_dup(host, &mut dup);
        if status != 0 {
            return Err(Error::Mpi(format!(
                "cannot duplicate the host's communicator (MPI error {status})"
            )));
        }
        use mpi::raw::FromRaw;
        Ok(Comm(Some(SimpleCommunicator::from_raw(dup))))
    }
}

impl Comm {
    /// A group of this process alone, without MPI: what a host process that passes no
    /// communicator gets, even when a launcher started it.
    pub fn alone() -> Comm {
        Comm(None)
    }
}
