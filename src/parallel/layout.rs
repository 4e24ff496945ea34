//! Who does what: the rank layout of a run (ranks, nodes, node-local ranks, threads per rank),
//! the roles of the ranks (reader, writer, workers), the split of a frame's patches over the
//! workers and the mapping of a rank to a GPU. Pure functions of a few numbers, so that every
//! rank computes the same answer without talking to the others.

use std::ops::Range;

use super::Comm;
use crate::error::{Error, Result};

/// Where this rank sits in the job.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Layout {
    /// Rank in the world communicator.
    pub rank: usize,
    /// Number of ranks in the job.
    pub size: usize,
    /// Rank among the ranks of this node (shared-memory communicator).
    pub local_rank: usize,
    /// Number of ranks on this node.
    pub local_size: usize,
    /// Number of nodes of the job.
    pub nodes: usize,
    /// Worker threads of this rank's CPU backend.
    pub threads: usize,
    /// Host name of this rank.
    pub host: String,
    /// Whether spex runs under an MPI launcher (errors then name the rank).
    pub launched: bool,
}

impl Layout {
    /// The layout of a process that runs alone.
    pub fn single(threads: usize) -> Self {
        Layout {
            rank: 0,
            size: 1,
            local_rank: 0,
            local_size: 1,
            nodes: 1,
            threads,
            host: hostname(),
            launched: false,
        }
    }

    /// Finds this rank's place (collective over `world`): node-local rank from a
    /// shared-memory split, node count, and the threads of its CPU backend (`requested`, or
    /// [`default_threads`] when 0).
    pub fn discover(world: &Comm, launched: bool, requested: usize) -> Self {
        let node = world.split_shared();
        let (local_rank, local_size) = (node.rank(), node.size());
        let nodes = world.all_sum((local_rank == 0) as u64) as usize;
        let threads = if requested > 0 {
            requested
        } else {
            let (affinity, online) = cpu_counts();
            default_threads(affinity, online, local_size)
        };
        Layout {
            rank: world.rank(),
            size: world.size(),
            local_rank,
            local_size,
            nodes,
            threads,
            host: hostname(),
            launched,
        }
    }

    /// The start of an error line: `spex: rank R: error:` under a launcher, so that the
    /// interleaved stderr of many ranks says which rank failed; `spex: error:` alone.
    pub fn error_prefix(&self) -> String {
        if self.launched {
            format!("spex: rank {}: error:", self.rank)
        } else {
            "spex: error:".to_string()
        }
    }
}

/// The tasks of the ranks for a run of frames.
///
/// Without `--async-io` (or with fewer than 3 ranks) rank 0 reads each frame, every rank
/// (rank 0 included) solves a share of it, and rank 0 writes it. With `--async-io` rank 0 only
/// reads and rank 1 only writes, so that reading frame k+1 and writing frame k-1 overlap the
/// extraction of frame k on ranks 2 and up.
///
/// Frame groups (`--frame-groups N`, with dedicated I/O ranks only) split the workers into N
/// contiguous groups and give frame k of the list to group k mod N alone: the per-frame costs
/// that do not shrink with more workers (the broadcast of the pixels, host-side tables, the
/// gather) are then paid by one group while the others solve their own frames.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Roles {
    pub reader: usize,
    pub writer: usize,
    /// World ranks that solve patches; worker `i` is world rank `workers.start + i`.
    pub workers: Range<usize>,
    /// Number of frame groups the workers form (1: every worker takes part in every frame).
    pub groups: usize,
}

impl Roles {
    /// The roles for `size` ranks; `async_io` is honoured only from 3 ranks on.
    pub fn new(size: usize, async_io: bool) -> Self {
        if async_io && size >= 3 {
            Roles {
                reader: 0,
                writer: 1,
                workers: 2..size,
                groups: 1,
            }
        } else {
            Roles {
                reader: 0,
                writer: 0,
                workers: 0..size.max(1),
                groups: 1,
            }
        }
    }

    /// The roles for `size` ranks with the workers split into `groups` frame groups: an error
    /// (the same on every rank) unless dedicated I/O ranks leave at least one worker per group.
    pub fn grouped(size: usize, async_io: bool, groups: usize) -> Result<Self> {
        let roles = Roles::new(size, async_io);
        if groups <= 1 {
            return Ok(roles);
        }
        if !async_io {
            return Err(Error::config(format!(
                "--frame-groups {groups} needs --async-io: without dedicated reader and writer \
                 ranks every rank takes part in every frame"
            )));
        }
        if !roles.is_async() {
            return Err(Error::config(format!(
                "--frame-groups {groups} needs --async-io on 3 or more ranks ({size} here)"
            )));
        }
        if groups > roles.nworkers() {
            return Err(Error::config(format!(
                "--frame-groups {groups} is more than the {} worker ranks ({size} ranks less \
                 the reader and the writer)",
                roles.nworkers()
            )));
        }
        Ok(Roles { groups, ..roles })
    }

    /// Whether reading and writing run on their own ranks.
    pub fn is_async(&self) -> bool {
        self.reader != self.writer
    }

    pub fn nworkers(&self) -> usize {
        self.workers.len()
    }

    /// Index of world rank `rank` among the workers, if it is one.
    pub fn worker_index(&self, rank: usize) -> Option<usize> {
        self.workers
            .contains(&rank)
            .then(|| rank - self.workers.start)
    }

    /// The world ranks of frame group `group`: a contiguous, balanced block of the workers.
    pub fn group_workers(&self, group: usize) -> Range<usize> {
        let block = patch_block(self.nworkers(), self.groups, group);
        self.workers.start + block.start..self.workers.start + block.end
    }

    /// The frame group of world rank `rank`, if it is a worker.
    pub fn group_of(&self, rank: usize) -> Option<usize> {
        self.worker_index(rank)?;
        (0..self.groups).find(|&g| self.group_workers(g).contains(&rank))
    }

    /// The group that handles frame `k` of the list.
    pub fn group_of_frame(&self, k: usize) -> usize {
        k % self.groups.max(1)
    }

    /// One line for the log.
    pub fn describe(&self) -> String {
        let w = if self.workers.len() == 1 {
            format!("rank {} extracts", self.workers.start)
        } else {
            format!(
                "ranks {}-{} extract",
                self.workers.start,
                self.workers.end - 1
            )
        };
        let w = if self.groups > 1 {
            let groups: Vec<String> = (0..self.groups)
                .map(|g| {
                    let r = self.group_workers(g);
                    if r.len() == 1 {
                        r.start.to_string()
                    } else {
                        format!("{}-{}", r.start, r.end - 1)
                    }
                })
                .collect();
            format!(
                "{w} in {} frame groups ({})",
                self.groups,
                groups.join(", ")
            )
        } else {
            w
        };
        if self.is_async() {
            format!(
                "rank {} reads, rank {} writes, {w}",
                self.reader, self.writer
            )
        } else {
            format!("rank {} reads and writes, {w}", self.reader)
        }
    }
}

/// The patches of worker `worker` out of `nworkers`: a contiguous, balanced block of the plan's
/// patch list (blocks differ by at most one patch).
///
/// The plan lists patches sub-bundle by sub-bundle, so a block holds whole sub-bundles except
/// at most one partial sub-bundle at each end: spots are evaluated per sub-bundle and reused
/// across its patches, and a split sub-bundle costs one extra spot evaluation of its few fibers,
/// which is less than the idle time an uneven split by whole sub-bundles would cost whenever
/// the sub-bundles do not divide evenly over the ranks. The frame is assembled by patch index,
/// so the output does not depend on the split.
pub fn patch_block(npatches: usize, nworkers: usize, worker: usize) -> Range<usize> {
    let nworkers = nworkers.max(1);
    let start = |w: usize| w * npatches / nworkers;
    start(worker)..start(worker + 1)
}

/// The GPU of a rank: node-local rank modulo the devices it sees (`None` without devices).
/// Ranks of one node share the devices round robin, several ranks per GPU under CUDA MPS.
pub fn device_for(local_rank: usize, ndevices: usize) -> Option<usize> {
    (ndevices > 0).then(|| local_rank % ndevices)
}

/// Worker threads per rank when the user did not choose (`--threads 0`).
///
/// A launcher that binds ranks to cores (`srun --cpu-bind=cores -c N`, Open MPI's default for
/// few ranks) leaves each rank an affinity mask narrower than the node: use all of it. An
/// unbound rank sees the whole node: share the cores among the node's `local_size` ranks so
/// that they do not oversubscribe it.
pub fn default_threads(affinity_cpus: usize, online_cpus: usize, local_size: usize) -> usize {
    let affinity_cpus = affinity_cpus.max(1);
    if affinity_cpus < online_cpus {
        affinity_cpus
    } else {
        (affinity_cpus / local_size.max(1)).max(1)
    }
}

/// CPUs this process may run on and CPUs online on the node.
pub fn cpu_counts() -> (usize, usize) {
    let affinity = std::thread::available_parallelism()
        .map(|n| n.get())
        .unwrap_or(1);
    // SAFETY: sysconf only reads a system constant.
    let online = unsafe { libc::sysconf(libc::_SC_NPROCESSORS_ONLN) };
    let online = usize::try_from(online).unwrap_or(affinity).max(1);
    (affinity, online)
}

/// The host name (for the layout log), or `?` if unknown.
pub fn hostname() -> String {
    std::fs::read_to_string("/proc/sys/kernel/hostname")
        .map(|s| s.trim().to_string())
        .ok()
        .filter(|s| !s.is_empty())
        .or_else(|| std::env::var("HOSTNAME").ok())
        .unwrap_or_else(|| "?".into())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn blocks_cover_every_patch_once_and_are_balanced() {
        for npatches in [0, 1, 5, 55, 4700] {
            for nworkers in 1..=9 {
                let blocks: Vec<_> = (0..nworkers)
                    .map(|w| patch_block(npatches, nworkers, w))
                    .collect();
                assert_eq!(blocks[0].start, 0);
                assert_eq!(blocks[nworkers - 1].end, npatches);
                for pair in blocks.windows(2) {
                    assert_eq!(pair[0].end, pair[1].start);
                }
                let (lo, hi) = blocks.iter().fold((usize::MAX, 0), |(lo, hi), b| {
                    (lo.min(b.len()), hi.max(b.len()))
                });
                assert!(hi - lo <= 1, "{npatches} over {nworkers}: {blocks:?}");
            }
        }
    }

    #[test]
    fn roles_use_dedicated_io_ranks_only_from_three_ranks() {
        let r = Roles::new(1, true);
        assert!(!r.is_async());
        assert_eq!(r.workers, 0..1);
        let r = Roles::new(2, true);
        assert!(!r.is_async());
        assert_eq!(r.workers, 0..2);
        let r = Roles::new(4, true);
        assert!(r.is_async());
        assert_eq!((r.reader, r.writer, r.workers.clone()), (0, 1, 2..4));
        assert_eq!(r.worker_index(1), None);
        assert_eq!(r.worker_index(3), Some(1));
        let r = Roles::new(4, false);
        assert_eq!(r.worker_index(0), Some(0));
        assert_eq!(r.describe(), "rank 0 reads and writes, ranks 0-3 extract");
    }

    #[test]
    fn frame_groups_split_the_workers_evenly() {
        let r = Roles::grouped(7, true, 2).expect("2 groups of 5 workers");
        assert_eq!((r.group_workers(0), r.group_workers(1)), (2..4, 4..7));
        assert_eq!(r.group_of(1), None);
        assert_eq!(r.group_of(3), Some(0));
        assert_eq!(r.group_of(4), Some(1));
        assert_eq!((r.group_of_frame(4), r.group_of_frame(5)), (0, 1));
        assert_eq!(
            r.describe(),
            "rank 0 reads, rank 1 writes, ranks 2-6 extract in 2 frame groups (2-3, 4-6)"
        );
        let r = Roles::grouped(4, true, 2).expect("one worker per group");
        assert_eq!((r.group_workers(0), r.group_workers(1)), (2..3, 3..4));
        assert_eq!(Roles::grouped(4, false, 1).ok(), Some(Roles::new(4, false)));
        assert_eq!(Roles::grouped(4, true, 1).ok(), Some(Roles::new(4, true)));
        assert_eq!(Roles::new(4, true).group_of_frame(3), 0);
        for (size, async_io, groups) in [(4, false, 2), (2, true, 2), (4, true, 3)] {
            let e = Roles::grouped(size, async_io, groups).expect_err("rejected");
            assert!(e.to_string().contains("--frame-groups"), "{e}");
        }
    }

    #[test]
    fn devices_are_shared_round_robin() {
        assert_eq!(device_for(0, 4), Some(0));
        assert_eq!(device_for(5, 4), Some(1));
        assert_eq!(device_for(3, 1), Some(0));
        assert_eq!(device_for(3, 0), None);
    }

    #[test]
    fn threads_follow_binding_or_share_the_node() {
        // srun -c 2 --cpu-bind=cores on a 128-CPU node
        assert_eq!(default_threads(2, 128, 32), 2);
        // mpiexec --oversubscribe -n 4 on 2 cores, unbound
        assert_eq!(default_threads(2, 2, 4), 1);
        // unbound, 4 ranks on 64 cores
        assert_eq!(default_threads(64, 64, 4), 16);
        // alone
        assert_eq!(default_threads(8, 8, 1), 8);
    }
}
