//! Stand-in for `comm_mpi.rs` when spex is built without the `mpi` feature: one process,
//! whose collectives are identities, behind the same API.

use crate::error::Result;

/// Always false: without MPI every run is a single process.
pub fn launched() -> bool {
    false
}

/// A world of one rank.
pub struct Universe(());

impl Universe {
    /// The single process; exits with an error if a launcher started it as one of several
    /// ranks, which without MPI would each extract every frame and overwrite each other.
    pub fn init() -> Self {
        let ranks = ["OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "SLURM_STEP_NUM_TASKS"]
            .iter()
            .filter_map(|v| std::env::var(v).ok()?.parse::<usize>().ok())
            .max()
            .unwrap_or(1);
        if ranks > 1 {
            eprintln!(
                "spex: error: started as one of {ranks} ranks, but this spex was built without \
                 the `mpi` feature"
            );
            std::process::exit(1);
        }
        Universe(())
    }

    pub fn is_mpi(&self) -> bool {
        false
    }

    pub fn world(&self) -> Comm {
        Comm(())
    }

    /// Nothing to do: a panic ends the only process.
    pub fn abort_on_panic(&self, _rank: usize) {}
}

/// A group of one rank.
pub struct Comm(());

impl Comm {
    pub fn rank(&self) -> usize {
        0
    }

    pub fn size(&self) -> usize {
        1
    }

    pub fn split(&self, color: Option<u32>) -> Option<Comm> {
        color.map(|_| Comm(()))
    }

    pub fn split_shared(&self) -> Comm {
        Comm(())
    }

    pub fn broadcast_bytes(&self, _root: usize, _bytes: &mut Vec<u8>) -> Result<()> {
        Ok(())
    }

    pub fn broadcast_f32(&self, _root: usize, _buf: &mut [f32]) {}

    pub fn gather_bytes(&self, _root: usize, bytes: &[u8]) -> Result<Option<Vec<Vec<u8>>>> {
        Ok(Some(vec![bytes.to_vec()]))
    }

    pub fn wait_quietly(&self) {}

    pub fn all_max(&self, value: u64) -> u64 {
        value
    }

    pub fn all_sum(&self, value: u64) -> u64 {
        value
    }

    pub fn all_gather(&self, value: u64) -> Vec<u64> {
        vec![value]
    }

    pub fn abort(&self, code: i32) -> ! {
        std::process::exit(code)
    }
}

impl Comm {
    /// Refused: a host's communicator needs spex built with the `mpi` feature.
    ///
    /// # Safety
    /// Nothing is read from `handle`; the signature matches the MPI build's.
    pub unsafe fn from_fortran_handle(_handle: i32) -> Result<Comm> {
        Err(crate::error::Error::Mpi(
            "a communicator was given, but this spex was built without the `mpi` feature".into(),
        ))
    }
}

impl Comm {
    /// A group of this process alone.
    pub fn alone() -> Comm {
        Comm(())
    }
}
