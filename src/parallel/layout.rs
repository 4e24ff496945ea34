//! Who does what: the rank layout of a run (ranks, nodes, node-local ranks, threads per rank),
//! the roles of the ranks (reader, writer, workers), the split of a frame's patches over the
//! workers and the mapping of a rank to a GPU. Pure functions of a few numbers, so that every
//! rank computes the same answer without talking to the others.

use std::ops::Range;

use super::Comm;
use crate::config::{BackendChoice, JobConfig};
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
    /// Cores of this rank's share of the node, before [`Layout::with_overlap_cap`] caps its
    /// threads: they size the reader and writer threads of `--async-io`, which mostly wait.
    pub cores: usize,
    /// Host name of this rank.
    pub host: String,
    /// Whether spex runs under an MPI launcher (errors then name the rank).
    pub launched: bool,
}

/// The most threads a GPU rank that overlaps its frames takes by default. Its readers,
/// writers and backends' host pools run beside rayon's pool, and past this many they switch
/// more than they work: on a 64-core node, 30 frames in one process on one GPU took 2.61 s
/// with 64 threads and 2.34 s with 32 (desi_proc's form 3.34 and 2.95 s; on four GPUs 3.59
/// and 3.25 s), with 840,000 involuntary context switches against 12,000.
pub const GPU_OVERLAP_THREADS: usize = 32;

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
            cores: threads,
            host: hostname(),
            launched: false,
        }
    }

    /// Finds this rank's place (collective over `world`): node-local rank from a
    /// shared-memory split, node count, and the threads of its CPU backend and host-side work
    /// (`requested`, or [`default_threads`] when 0). Unbound, an extracting rank (`is_worker`)
    /// shares the node's cores with the node's other extracting ranks only, since reader and
    /// writer ranks are idle most of the time; those share them among all the node's ranks.
    pub fn discover(world: &Comm, launched: bool, requested: usize, is_worker: bool) -> Self {
        let node = world.split_shared();
        let (local_rank, local_size) = (node.rank(), node.size());
        let nodes = world.all_sum((local_rank == 0) as u64) as usize;
        let node_workers = node.all_sum(is_worker as u64) as usize;
        let threads = if requested > 0 {
            requested
        } else {
            let (affinity, online) = cpu_counts();
            let sharing = if is_worker { node_workers } else { local_size };
            default_threads(affinity, online, sharing)
        };
        Layout {
            rank: world.rank(),
            size: world.size(),
            local_rank,
            local_size,
            nodes,
            threads,
            cores: threads,
            host: hostname(),
            launched,
        }
    }

    /// Caps the default threads of a rank whose reading, solving and writing overlap
    /// (`--async-io`) beside a GPU at [`GPU_OVERLAP_THREADS`]; a `--threads` the user chose
    /// stays, and so does a rank of a node without GPUs (`node_has_gpus`: see
    /// [`node_has_gpus`](super::node_has_gpus)), whose CPU backend needs every thread.
    pub fn with_overlap_cap(mut self, config: &JobConfig, node_has_gpus: bool) -> Self {
        let gpu = node_has_gpus && config.backend != BackendChoice::Cpu;
        if config.threads == 0 && config.async_io && gpu {
            self.threads = self.threads.min(GPU_OVERLAP_THREADS);
        }
        self
    }

    /// The start of an error line: `spex: rank R: error:` under a launcher, so that the
    /// interleaved stderr of many ranks says which rank failed; `spex: error:` alone.
    pub fn error_prefix(&self) -> String {
        error_prefix(self.launched, self.rank)
    }
}

/// The start of an error line of rank `rank`: `spex: rank R: error:` under a launcher,
/// `spex: error:` alone.
pub fn error_prefix(launched: bool, rank: usize) -> String {
    if launched {
        format!("spex: rank {rank}: error:")
    } else {
        "spex: error:".to_string()
    }
}

/// The tasks of the ranks for a run of frames: the ranks form frame groups, and each group
/// reads, extracts and writes its own frames.
///
/// `--frame-groups N` splits the ranks into N contiguous, balanced groups and gives frame k of
/// the list to group k mod N (one group by default). Groups share nothing but the node: each
/// has its own reader and writer, so the per-frame costs that do not shrink with more workers
/// (reading and decompressing, the broadcast of the pixels, the gather, the assembly and the
/// write) are paid by each group for its own frames, at the same time as the other groups
/// extract theirs. One group per GPU, or two per GPU under MPS, lets a node scale with its
/// GPUs instead of with one writer.
///
/// Inside a group, without `--async-io` (or with 2 ranks in it) its first rank reads each
/// frame, every rank of the group (the first included) solves a share of it, and the first
/// rank writes it. With `--async-io` a group of 3 ranks or more has its first rank only read
/// and its second only write, so that reading frame k+1 and writing frame k-1 overlap the
/// extraction of frame k on the group's other ranks; a group of one rank overlaps the same
/// phases on threads of its own (`overlap`), with several frames in flight.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Roles {
    size: usize,
    groups: usize,
    async_io: bool,
}

/// One frame group: a contiguous block of world ranks. Ranks inside it are counted from its
/// first rank, as in the group's communicator.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Group {
    /// Index of the group (it handles frames k with k mod groups == index).
    pub index: usize,
    /// World rank of the group's first rank.
    pub first: usize,
    /// Number of ranks in the group.
    pub size: usize,
    /// Whether the group has dedicated reader and writer ranks.
    pub async_io: bool,
    /// Whether the group is one rank that overlaps reading, solving and writing on threads.
    pub overlapped: bool,
}

impl Roles {
    /// The roles of `size` ranks in `groups` frame groups: an error (the same on every rank)
    /// when there are more groups than ranks. `async_io` gives dedicated I/O ranks to the
    /// groups of 3 ranks or more.
    pub fn new(size: usize, async_io: bool, groups: usize) -> Result<Self> {
        let size = size.max(1);
        let groups = groups.max(1);
        if groups > size {
            return Err(Error::config(format!(
                "--frame-groups {groups} is more than the {size} rank{} of the job: every \
                 group needs at least one rank (3 for dedicated I/O ranks with --async-io)",
                if size == 1 { "" } else { "s" }
            )));
        }
        Ok(Roles {
            size,
            groups,
            async_io,
        })
    }

    /// Number of frame groups.
    pub fn ngroups(&self) -> usize {
        self.groups
    }

    /// Frame group `g`.
    pub fn group(&self, g: usize) -> Group {
        let ranks = patch_block(self.size, self.groups, g);
        Group {
            index: g,
            first: ranks.start,
            size: ranks.len(),
            async_io: self.async_io && ranks.len() >= 3,
            overlapped: self.async_io && ranks.len() == 1,
        }
    }

    /// The frame group of world rank `rank`.
    pub fn group_of(&self, rank: usize) -> Group {
        let g = (0..self.groups)
            .find(|&g| patch_block(self.size, self.groups, g).contains(&rank))
            .unwrap_or(self.groups - 1);
        self.group(g)
    }

    /// The group that handles frame `k` of the list.
    pub fn group_of_frame(&self, k: usize) -> usize {
        k % self.groups
    }

    /// Whether `--async-io` was asked for but some group (of 2 ranks) cannot honour it.
    pub fn async_io_ignored(&self) -> bool {
        self.async_io && (0..self.groups).any(|g| self.group(g).size == 2)
    }

    /// Whether world rank `rank` solves patches.
    pub fn is_worker(&self, rank: usize) -> bool {
        let g = self.group_of(rank);
        g.worker_index(rank - g.first).is_some()
    }

    /// Whether world rank `rank` reads or writes frames (the ranks whose log tells the story
    /// of each frame).
    pub fn is_io_rank(&self, rank: usize) -> bool {
        let g = self.group_of(rank);
        let local = rank - g.first;
        local == g.reader() || local == g.writer()
    }

    /// One line for the log.
    pub fn describe(&self) -> String {
        if self.groups == 1 {
            return self.group(0).describe();
        }
        let groups: Vec<String> = (0..self.groups)
            .map(|g| self.group(g))
            .map(|g| format!("[{}]", g.describe()))
            .collect();
        format!("{} frame groups: {}", self.groups, groups.join(" "))
    }
}

impl Group {
    /// Rank in the group that reads the frames.
    pub fn reader(&self) -> usize {
        0
    }

    /// Rank in the group that writes the frames.
    pub fn writer(&self) -> usize {
        usize::from(self.async_io)
    }

    /// Ranks in the group that solve patches; worker `i` is rank `workers().start + i`.
    pub fn workers(&self) -> Range<usize> {
        if self.async_io {
            2..self.size
        } else {
            0..self.size
        }
    }

    pub fn nworkers(&self) -> usize {
        self.workers().len()
    }

    /// Index of group rank `local` among the workers, if it is one.
    pub fn worker_index(&self, local: usize) -> Option<usize> {
        let workers = self.workers();
        workers.contains(&local).then(|| local - workers.start)
    }

    /// The world rank of group rank `local`.
    pub fn world(&self, local: usize) -> usize {
        self.first + local
    }

    /// One line for the log, in world ranks.
    pub fn describe(&self) -> String {
        let w = self.workers();
        let (a, b) = (self.world(w.start), self.world(w.end - 1));
        let workers = if a == b {
            format!("rank {a} extracts")
        } else {
            format!("ranks {a}-{b} extract")
        };
        if self.async_io {
            format!(
                "rank {} reads, rank {} writes, {workers}",
                self.world(self.reader()),
                self.world(self.writer())
            )
        } else if self.overlapped {
            format!(
                "rank {} reads, extracts and writes on threads",
                self.world(0)
            )
        } else {
            format!("rank {} reads and writes, {workers}", self.world(0))
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

/// The GPU of the `worker`-th of a node's `workers` extracting ranks (in rank order) among
/// the `ndevices` it sees (`None` without devices): contiguous blocks of ranks share a GPU,
/// several ranks per GPU under CUDA MPS. Blocks rather than round robin, so that the workers
/// of one frame group (contiguous ranks) land on one GPU.
pub fn device_for(worker: usize, workers: usize, ndevices: usize) -> Option<usize> {
    (ndevices > 0).then(|| {
        let workers = workers.max(worker + 1);
        if workers <= ndevices {
            worker
        } else {
            worker * ndevices / workers
        }
    })
}

/// The GPUs of the `worker`-th of a node's `workers` extracting ranks when a rank may drive
/// several (a frame group of one rank, which solves whole frames): a contiguous block of the
/// `ndevices` when there are more GPUs than ranks, so that every GPU of the node works (one
/// process may drive a whole node), else the one GPU of [`device_for`]. Empty without
/// devices.
pub fn devices_for(worker: usize, workers: usize, ndevices: usize) -> Range<usize> {
    let workers = workers.max(worker + 1);
    if workers < ndevices {
        patch_block(ndevices, workers, worker)
    } else {
        device_for(worker, workers, ndevices).map_or(0..0, |d| d..d + 1)
    }
}

/// Worker threads per rank when the user did not choose (`--threads 0`).
///
/// A launcher that binds ranks to cores (`srun --cpu-bind=cores -c N`, Open MPI's default for
/// few ranks) leaves each rank an affinity mask narrower than the node: use all of it. An
/// unbound rank sees the whole node: share the cores among the node's `sharing` ranks so
/// that they do not oversubscribe it.
pub fn default_threads(affinity_cpus: usize, online_cpus: usize, sharing: usize) -> usize {
    let affinity_cpus = affinity_cpus.max(1);
    if affinity_cpus < online_cpus {
        affinity_cpus
    } else {
        (affinity_cpus / sharing.max(1)).max(1)
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

/// Seconds since this process started (Linux), to tell in the log how long the launcher, MPI
/// and the devices took before the first frame.
pub fn process_age() -> Option<f64> {
    let stat = std::fs::read_to_string("/proc/self/stat").ok()?;
    // Fields after the command name, which is in parentheses and may hold spaces; the start
    // time is field 22 of the whole line, in clock ticks since boot.
    let rest = stat.get(stat.rfind(')')? + 2..)?;
    let start: f64 = rest.split_whitespace().nth(19)?.parse().ok()?;
    let uptime: f64 = std::fs::read_to_string("/proc/uptime")
        .ok()?
        .split_whitespace()
        .next()?
        .parse()
        .ok()?;
    // SAFETY: sysconf only reads a system constant.
    let ticks = unsafe { libc::sysconf(libc::_SC_CLK_TCK) };
    (ticks > 0).then(|| uptime - start / ticks as f64)
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
        let roles = |size, async_io| Roles::new(size, async_io, 1).expect("one group");
        let g = roles(1, true).group(0);
        assert!(!g.async_io && g.overlapped);
        assert_eq!(g.workers(), 0..1);
        assert!(!roles(1, true).async_io_ignored());
        assert_eq!(
            roles(1, true).describe(),
            "rank 0 reads, extracts and writes on threads"
        );
        assert!(!roles(1, false).group(0).overlapped);
        let g = roles(2, true).group(0);
        assert!(!g.async_io && !g.overlapped);
        assert!(roles(2, true).async_io_ignored());
        assert_eq!(g.workers(), 0..2);
        let r = roles(4, true);
        assert!(!r.async_io_ignored());
        let g = r.group_of(3);
        assert!(g.async_io);
        assert_eq!((g.reader(), g.writer(), g.workers()), (0, 1, 2..4));
        assert_eq!(g.worker_index(1), None);
        assert_eq!(g.worker_index(3), Some(1));
        assert!(r.is_io_rank(1) && !r.is_io_rank(2));
        assert!(!r.is_worker(1) && r.is_worker(2));
        assert_eq!(
            r.describe(),
            "rank 0 reads, rank 1 writes, ranks 2-3 extract"
        );
        let r = roles(4, false);
        assert_eq!(r.group(0).worker_index(0), Some(0));
        assert!(r.is_io_rank(0) && !r.is_io_rank(1));
        assert_eq!(r.describe(), "rank 0 reads and writes, ranks 0-3 extract");
    }

    #[test]
    fn frame_groups_split_the_ranks_evenly_and_each_has_its_own_io() {
        let r = Roles::new(7, true, 2).expect("groups of 3 and 4 ranks");
        let (g0, g1) = (r.group(0), r.group(1));
        assert_eq!((g0.first, g0.size, g1.first, g1.size), (0, 3, 3, 4));
        assert_eq!(r.group_of(2), g0);
        assert_eq!(r.group_of(3), g1);
        assert_eq!((g1.world(g1.reader()), g1.world(g1.writer())), (3, 4));
        assert_eq!(g1.workers(), 2..4);
        assert!(r.is_io_rank(3) && r.is_io_rank(4) && !r.is_io_rank(5));
        assert_eq!((r.group_of_frame(4), r.group_of_frame(5)), (0, 1));
        assert_eq!(
            r.describe(),
            "2 frame groups: [rank 0 reads, rank 1 writes, rank 2 extracts] \
             [rank 3 reads, rank 4 writes, ranks 5-6 extract]"
        );
        // Groups too small for dedicated I/O read, extract and write on their own ranks.
        let r = Roles::new(4, true, 2).expect("groups of 2 ranks");
        assert!(r.async_io_ignored());
        assert_eq!(r.group(1).workers(), 0..2);
        assert_eq!(
            r.describe(),
            "2 frame groups: [rank 0 reads and writes, ranks 0-1 extract] \
             [rank 2 reads and writes, ranks 2-3 extract]"
        );
        let r = Roles::new(4, false, 4).expect("one rank per group");
        assert_eq!(r.group_of(3).world(0), 3);
        assert!(!r.group(0).overlapped);
        let r = Roles::new(4, true, 4).expect("one rank per group, overlapped");
        assert!(r.group_of(3).overlapped && !r.async_io_ignored());
        assert_eq!(
            r.describe(),
            "4 frame groups: [rank 0 reads, extracts and writes on threads] \
             [rank 1 reads, extracts and writes on threads] \
             [rank 2 reads, extracts and writes on threads] \
             [rank 3 reads, extracts and writes on threads]"
        );
        assert_eq!(r.group_of_frame(6), 2);
        for (size, groups) in [(1, 2), (4, 5)] {
            let e = Roles::new(size, true, groups).expect_err("rejected");
            assert!(e.to_string().contains("--frame-groups"), "{e}");
        }
    }

    #[test]
    fn devices_go_to_contiguous_blocks_of_workers() {
        assert_eq!(device_for(0, 4, 4), Some(0));
        assert_eq!(device_for(3, 4, 4), Some(3));
        // two workers per GPU: those of one frame group share a GPU
        let map: Vec<_> = (0..8).filter_map(|w| device_for(w, 8, 4)).collect();
        assert_eq!(map, [0, 0, 1, 1, 2, 2, 3, 3]);
        // fewer workers than GPUs each get their own
        assert_eq!(device_for(1, 2, 4), Some(1));
        assert_eq!(device_for(3, 6, 1), Some(0));
        assert_eq!(device_for(3, 6, 0), None);
        // ranks that can drive several GPUs share them out
        assert_eq!(devices_for(0, 1, 4), 0..4);
        assert_eq!(devices_for(1, 2, 4), 2..4);
        assert_eq!((devices_for(0, 3, 4), devices_for(2, 3, 4)), (0..1, 2..4));
        assert_eq!(devices_for(3, 4, 4), 3..4);
        assert_eq!(devices_for(5, 8, 4), 2..3);
        assert_eq!(devices_for(0, 1, 0), 0..0);
    }

    #[test]
    fn process_age_is_small_and_grows() {
        let a = process_age().expect("Linux /proc");
        assert!((0.0..3600.0).contains(&a), "{a}");
        std::thread::sleep(std::time::Duration::from_millis(20));
        assert!(process_age().expect("Linux /proc") >= a);
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
