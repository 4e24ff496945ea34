//! The backends of an extracting rank: which CUDA devices it drives, starting a backend (or
//! several, for frames in flight) on each, the fall-back to the CPU when a GPU was not
//! required, and the log of the job's layout once every rank has started.

use std::sync::mpsc::{channel, Receiver};
use std::thread::JoinHandle;

use super::layout::{device_for, devices_for, Layout, Roles};
use super::visible;
use super::Comm;
use crate::backend::{self, Backend, BackendKind};
use crate::config::BackendChoice;
use crate::error::{Error, Result};

/// Where an extracting rank solves.
pub(super) struct DeviceRequest {
    pub choice: BackendChoice,
    /// `--device`: this ordinal, whatever the rank.
    pub device: Option<usize>,
    /// Backends per device (frames in flight; `None`: [`DeviceRequest::in_flight`]'s
    /// default).
    pub per_device: Option<usize>,
    /// Whether the rank solves whole frames, and may so take a block of the node's GPUs.
    pub whole_frames: bool,
    /// The frames of the rank's group: a rank that solves whole frames takes no more GPUs.
    pub frames: usize,
    /// Whether the rank may show the driver only its own GPUs ([`visible`]).
    pub narrow: bool,
}

impl DeviceRequest {
    /// Backends per device on `gpus` GPUs (none: the CPU). Two frames in flight keep a GPU
    /// busy while the host prepares and finishes the other (measured: 63-81 ms per frame
    /// against 77-87 ms with one); only a rank with more frames than GPUs has a second.
    pub(super) fn in_flight(&self, gpus: usize) -> usize {
        let default = if gpus > 0 && self.frames > gpus { 2 } else { 1 };
        self.per_device.unwrap_or(default)
    }
}

/// The CUDA devices of the `node_worker`-th of the node's `node_workers` extracting ranks
/// (empty: the CPU): `--device`, else the one [`device_for`] gives, or for a rank that
/// solves whole frames the block of [`devices_for`]. Without a usable device, a GPU that was
/// not required gives way to the CPU.
pub(super) fn devices_of(
    request: &DeviceRequest,
    node_worker: usize,
    node_workers: usize,
) -> Result<Vec<usize>> {
    let BackendChoice::Gpu { required } = request.choice else {
        return Ok(Vec::new());
    };
    if let Some(d) = request.device {
        return Ok(vec![d]);
    }
    let choose = |n: usize| -> Vec<usize> {
        if request.whole_frames {
            let block = devices_for(node_worker, node_workers, n);
            block.take(request.frames.max(1)).collect()
        } else {
            device_for(node_worker, node_workers, n)
                .into_iter()
                .collect()
        }
    };
    // Counted without the driver where that is sure, so that it starts with the rank's own.
    let unstarted = request.narrow && backend::cuda::driver_unstarted();
    let listed = std::env::var("CUDA_VISIBLE_DEVICES").ok();
    let gpus = unstarted
        .then(|| visible::node_gpus(listed.as_deref(), visible::proc_gpus()))
        .flatten();
    let found = match gpus {
        Some(gpus) => match choose(gpus.len()) {
            d if !d.is_empty() && d.len() < gpus.len() => Ok(visible::narrow(&gpus, &d)),
            d => Ok(d),
        },
        None => backend::cuda::device_count().map(choose),
    }
    .and_then(|devices| {
        if devices.is_empty() {
            return Err(Error::Gpu("no CUDA device is visible to this rank".into()));
        }
        Ok(devices)
    });
    match found {
        Err(e) if !required => {
            tracing::debug!("no usable GPU ({e}); extracting on the CPU");
            Ok(Vec::new())
        }
        found => found,
    }
}

/// A rank's backends as its frames get them: those ready now and, when its GPUs open one
/// after another, the others as they open.
pub(super) struct Opened {
    pub now: Vec<Box<dyn Backend>>,
    pub later: Option<Later>,
}

impl Opened {
    /// No backend: a rank that holds none, or whose backends did not start.
    pub fn none() -> Self {
        Self::ready(Vec::new())
    }

    /// Backends all ready now, none to follow.
    fn ready(now: Vec<Box<dyn Backend>>) -> Self {
        Opened { now, later: None }
    }
}

/// A device's ordinal and its backends, or why they did not start.
pub(super) type DeviceBackends = (usize, Result<Vec<Box<dyn Backend>>>);

/// The backends of a rank's other GPUs, each device's as it opens, in order.
pub(super) struct Later {
    pub opening: Receiver<DeviceBackends>,
    /// `--gpu`: a GPU that does not open fails the job instead of leaving its frames to the
    /// others.
    pub required: bool,
    /// The thread that opens them, joined once they are all open.
    pub opener: JoinHandle<()>,
}

/// The backends of a worker: `per_device` on each of `devices`, device by device, or for the
/// CPU `per_device` backends that share the rank's threads. A GPU that fails to start and was
/// not required gives way to the CPU, with a warning. A rank that solves whole frames on
/// several GPUs gets the first GPU's backends as soon as they are ready and the others'
/// through [`Later`] ([`open_one_by_one`]).
pub(super) fn start_backends(
    request: &DeviceRequest,
    threads: usize,
    devices: Vec<usize>,
) -> Result<Opened> {
    // CPU backends in flight share the rank's threads rather than oversubscribe them.
    let cpu = || {
        let per_device = request.in_flight(0);
        on(
            BackendKind::Cpu,
            (threads / per_device).max(1),
            0,
            per_device,
        )
        .map(Opened::ready)
    };
    let per_device = request.in_flight(devices.len());
    if devices.is_empty() {
        return cpu();
    }
    // So do a rank's GPU backends, for their host work.
    let host_threads = (threads / (devices.len() * per_device)).max(1);
    let required = request.choice == (BackendChoice::Gpu { required: true });
    let opened = if request.whole_frames && devices.len() > 1 {
        open_one_by_one(devices, host_threads, per_device, required)
    } else {
        open_devices(&devices, host_threads, per_device).map(Opened::ready)
    };
    match opened {
        Err(e) if !required => {
            tracing::warn!("the GPU did not start ({e}); extracting on the CPU");
            cpu()
        }
        opened => opened,
    }
}

/// `per_device` backends of `kind`: the first, then its siblings.
fn on(
    kind: BackendKind,
    threads: usize,
    device: usize,
    per_device: usize,
) -> Result<Vec<Box<dyn Backend>>> {
    let first = backend::create(kind, threads, device)?;
    let mut backends = Vec::with_capacity(per_device);
    for _ in 1..per_device {
        backends.push(first.sibling()?);
    }
    backends.insert(0, first);
    Ok(backends)
}

/// Opens the CUDA backends of every device at once and returns when all are open: in practice
/// a rank's only GPU (a rank that shares its frames with other ranks drives one).
fn open_devices(
    devices: &[usize],
    threads: usize,
    per_device: usize,
) -> Result<Vec<Box<dyn Backend>>> {
    let opened: Vec<Result<Vec<Box<dyn Backend>>>> = std::thread::scope(|scope| {
        let opening: Vec<_> = devices
            .iter()
            .map(|&d| scope.spawn(move || on(BackendKind::Cuda, threads, d, per_device)))
            .collect();
        opening
            .into_iter()
            .map(|t| {
                t.join().unwrap_or_else(|_| {
                    Err(Error::Internal("a device-opening thread panicked".into()))
                })
            })
            .collect()
    });
    let mut backends = Vec::new();
    for b in opened {
        backends.extend(b?);
    }
    Ok(backends)
}

/// Opens `devices` one after another on a thread of their own and returns once the first
/// one's backends are ready, with the others to follow. The driver makes one context at a
/// time: on a 4 x H200 node four contexts opened together were all ready 0.44-0.47 s after
/// `cuInit`, and opened in turn the first after 0.11-0.12 s, the next ones 0.12 s apart
/// (docs/benchmarks.md), so the first GPUs solve frames while the last ones open.
fn open_one_by_one(
    devices: Vec<usize>,
    threads: usize,
    per_device: usize,
    required: bool,
) -> Result<Opened> {
    let (tx, opening) = channel();
    let opener = std::thread::Builder::new()
        .name("spex-open".into())
        .spawn(move || {
            for d in devices {
                if tx
                    .send((d, on(BackendKind::Cuda, threads, d, per_device)))
                    .is_err()
                {
                    break;
                }
            }
        })
        .map_err(|e| Error::Gpu(format!("cannot start the thread that opens the GPUs: {e}")))?;
    let (_, first) = opening.recv().unwrap_or_else(|_| {
        let stopped = Error::Internal("the thread opening the GPUs stopped".into());
        (0, Err(stopped))
    });
    match first {
        Ok(now) => Ok(Opened {
            now,
            later: Some(Later {
                opening,
                required,
                opener,
            }),
        }),
        Err(e) => {
            // the opener stops at its next device, which nobody takes any more
            drop(opening);
            join_opener(opener);
            Err(e)
        }
    }
}

/// Joins the thread that opened a rank's GPUs; a panic there is the rank's, as on its other
/// threads.
pub(super) fn join_opener(opener: JoinHandle<()>) {
    if let Err(panic) = opener.join() {
        std::panic::resume_unwind(panic);
    }
}

/// Logs the layout once, on rank 0: ranks, nodes, ranks per node, threads, roles and which
/// backend each rank drives. Collective.
pub(super) fn log_layout(
    world: &Comm,
    layout: &Layout,
    roles: &Roles,
    backends: &[Box<dyn Backend>],
) {
    let threads = world.all_gather(layout.threads as u64);
    let local = world.all_gather(layout.local_rank as u64);
    // The devices of a rank as a bit set (ordinals beyond 63 are left out of the map).
    let mask = backends
        .iter()
        .filter_map(|b| b.device())
        .map(visible::node_index)
        .filter(|&d| d < 64)
        .fold(0u64, |m, d| m | 1 << d);
    let devices = world.all_gather(mask);
    if layout.rank != 0 {
        return;
    }
    log_own_backends(backends);
    if layout.launched {
        log_ranks(layout, roles, &threads, &local);
        log_device_map(&devices);
    }
}

/// Rank 0's backends: the backend that runs is named in the log.
fn log_own_backends(backends: &[Box<dyn Backend>]) {
    if backends.is_empty() {
        return;
    }
    let mut names: Vec<String> = backends.iter().map(|b| b.describe()).collect();
    names.dedup();
    let per_device = backends.len() / names.len();
    let in_flight = match per_device {
        1 => String::new(),
        n if names.len() == 1 => format!(", {n} frames in flight"),
        n => format!(", {n} frames in flight on each"),
    };
    tracing::info!("rank 0 extracts on {}{in_flight}", names.join(", "));
}

/// Ranks, nodes, threads and roles of an MPI job.
fn log_ranks(layout: &Layout, roles: &Roles, threads: &[u64], local: &[u64]) {
    let range = |v: &[u64]| {
        let lo = v.iter().min().copied().unwrap_or(0);
        let hi = v.iter().max().copied().unwrap_or(0);
        if lo == hi {
            format!("{lo}")
        } else {
            format!("{lo}-{hi}")
        }
    };
    let per_node = local.iter().max().copied().unwrap_or(0) + 1;
    tracing::info!(
        "MPI: {} ranks on {} node{} ({} ranks per node, node-local ranks 0-{}), threads per rank: {}; {}",
        layout.size,
        layout.nodes,
        if layout.nodes == 1 { "" } else { "s" },
        if layout.nodes == 1 {
            layout.local_size.to_string()
        } else {
            format!("up to {per_node}")
        },
        per_node - 1,
        range(threads),
        roles.describe()
    );
}

/// Which GPUs each rank drives, from every rank's device bit set.
fn log_device_map(devices: &[u64]) {
    if devices.iter().all(|&m| m == 0) {
        return;
    }
    let map: Vec<String> = devices
        .iter()
        .enumerate()
        .filter(|(_, &m)| m != 0)
        .map(|(r, &m)| {
            let ordinals: Vec<String> = (0..64)
                .filter(|d| m >> d & 1 == 1)
                .map(|d| d.to_string())
                .collect();
            format!("{r}:cuda:{}", ordinals.join(","))
        })
        .collect();
    tracing::info!(
        "rank to GPU (blocks of a node's extracting ranks): {}",
        map.join(" ")
    );
}

#[cfg(test)]
mod tests {
    use super::{start_backends, DeviceRequest};
    use crate::config::BackendChoice;

    /// A rank that solves whole frames on GPUs of ordinals no machine has, so that none opens.
    fn on_missing_gpus(required: bool) -> (DeviceRequest, Vec<usize>) {
        let request = DeviceRequest {
            choice: BackendChoice::Gpu { required },
            device: None,
            per_device: Some(1),
            whole_frames: true,
            frames: 4,
            narrow: false,
        };
        (request, vec![1000, 1001])
    }

    #[test]
    fn gpus_opened_in_turn_that_fail_give_way_to_the_cpu_unless_required() {
        // the first GPU fails: its opener stops and is joined, and the rank goes to the CPU
        let (request, devices) = on_missing_gpus(false);
        let opened = start_backends(&request, 2, devices).expect("the CPU instead");
        assert!(opened.later.is_none());
        let names: Vec<String> = opened.now.iter().map(|b| b.describe()).collect();
        assert!(names.len() == 1 && names[0].starts_with("cpu"), "{names:?}");
        // under --gpu it is the job's error
        let (request, devices) = on_missing_gpus(true);
        assert!(start_backends(&request, 2, devices).is_err());
    }
}
