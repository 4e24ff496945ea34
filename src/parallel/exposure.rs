//! A run of frames (one, or a whole exposure from `--list`) over the ranks of the job.
//!
//! The ranks form frame groups (`--frame-groups N`, one by default) and frame k of the list
//! goes to group k mod N, which reads, extracts and writes it on its own ranks: the groups
//! share nothing but the list and the final count, so they proceed at their own pace.
//!
//! In a group, for each of its frames in the order of the list, the reader reads the PSF and
//! the image, checks the plan and broadcasts a header (the PSF, the image's shape and header
//! cards) and the pixels as raw f32 buffers; each worker solves its block of patches on its
//! backend and returns the results to the writer, which stitches the frame and writes it
//! atomically. All of this is the same code for one process (then one rank is reader, worker
//! and writer). A group of one rank under `--async-io` runs its frames through `overlap`
//! instead, on threads of its own. The output does not depend on the groups or the ranks.
//!
//! Errors: a frame that cannot be read, or fails on any worker, is counted by the writer and
//! skipped by every rank that handles it: the reader broadcasts a failure header, a worker
//! returns a failed contribution, so every rank of the group still takes part in the same
//! collectives. The rank that had the error prints one line
//! `spex: rank R: error: frame ...: cause`; no output is written for that frame, and the writer
//! writes only after every worker has delivered. What leaves ranks out of step (a malformed
//! message, a buffer that cannot be allocated, a panic) aborts the whole job through
//! `MPI_Abort` after its line. At the end the writers' counts are summed and every rank returns
//! the same exit status: the number of failed frames (capped at 100), 3 for a failed `--test`.

use std::cell::Cell;
use std::ops::Range;
use std::time::{Duration, Instant};

use super::exchange::{
    frames_from_words, frames_to_words, pack_box, unpack_box, Contribution, FrameFiles, FrameHeader,
};
use super::layout::{self, device_for, devices_for, patch_block, Group, Layout, Roles};
use super::{overlap, print_line, Comm};
use crate::backend::{self, Backend, BackendKind, FrameInput, Progress};
use crate::cli::ExtractArgs;
use crate::compare::{self, ParityLimits};
use crate::error::{Error, Result};
use crate::extract::PatchResult;
use crate::pipeline::{self, ExtractRequest, Inputs, Timings};
use crate::plan::Plan;

/// Exit status of a `--test` comparison outside its limits.
pub const EXIT_COMPARISON_FAILED: u8 = 3;

/// Runs every frame `args` asks for on the ranks of `world` in the frame groups of `roles`
/// and returns the exit status, the same on every rank. `progress` makes the progress display
/// of rank 0's own patches.
pub fn run(
    world: &Comm,
    layout: &Layout,
    roles: &Roles,
    args: &ExtractArgs,
    progress: &dyn Fn() -> Progress,
) -> u8 {
    let t_start = Instant::now();
    let me = layout.rank;
    let prefix = layout.error_prefix();
    if roles.async_io_ignored() && me == 0 {
        tracing::warn!(
            "--async-io needs frame groups of 1 rank or of 3 or more: groups of 2 read and \
             write on their first rank"
        );
    }
    let fatal = |e: &dyn std::fmt::Display| -> ! {
        print_line(&format!("{prefix} {e}"));
        world.abort(1)
    };

    // The work: rank 0 reads the list and decides what to skip; everyone gets the result.
    let mut message = Vec::new();
    if me == 0 {
        message = match frames_of(args) {
            Ok(frames) => {
                let mut m = vec![1];
                m.extend(frames_to_words(&frames));
                m
            }
            Err(e) => {
                print_line(&format!("{prefix} {e}"));
                vec![0]
            }
        };
    }
    if let Err(e) = world.broadcast_words(0, &mut message) {
        fatal(&e);
    }
    if message.first() != Some(&1) {
        return 1;
    }
    let requests: Vec<ExtractRequest> = match frames_from_words(&message[1..]) {
        Ok(frames) => frames
            .into_iter()
            .map(|(i, p, o, m)| args.request(i, p, o, m))
            .collect(),
        Err(e) => fatal(&e),
    };
    if !requests.is_empty() && requests.len() < roles.ngroups() && me == 0 {
        tracing::warn!(
            "{} frame groups for {} frame{}: {} group{} will have nothing to do",
            roles.ngroups(),
            requests.len(),
            if requests.len() == 1 { "" } else { "s" },
            roles.ngroups() - requests.len(),
            if roles.ngroups() - requests.len() == 1 {
                ""
            } else {
                "s"
            },
        );
    }
    let group = roles.group_of(me);
    let local = me - group.first;
    // A group of one rank overlaps its frames on threads, with a backend per frame in flight.
    let in_flight = if group.overlapped {
        args.frames_in_flight
    } else {
        1
    };
    let Some(group_comm) = world.split(Some(group.index as u32)) else {
        fatal(&"no communicator for the frame group")
    };
    // The frames of this group, with their index in the list.
    let mine: Vec<(usize, &ExtractRequest)> = requests
        .iter()
        .enumerate()
        .filter(|(k, _)| roles.group_of_frame(*k) == group.index)
        .collect();

    // Backends on the workers only, checked together: one rank that cannot start its device
    // stops the job before any frame is solved. GPUs go to contiguous blocks of the extracting
    // ranks of each node: dedicated reader and writer ranks hold no device. Meanwhile the
    // reader reads its first frames, which takes less time than opening a device.
    let worker = group.worker_index(local);
    let workers_comm = world.split(worker.map(|_| 0));
    let node_workers = workers_comm.as_ref().map(|c| c.split_shared());
    let devices = node_workers
        .as_ref()
        .map(|node| devices_of(args, group.overlapped, node.rank(), node.size()));
    // A rank that solves whole frames reads ahead as many frames as it has devices.
    let read_ahead = match &devices {
        Some(Ok(d)) => d.len().max(1),
        _ => 1,
    };
    let t_run = Cell::new(Instant::now());
    let open = || -> Option<Vec<Box<dyn Backend>>> {
        let started = devices.map(|d| d.and_then(|d| start_backends(args, layout, d, in_flight)));
        let backends = match started {
            Some(Ok(b)) => b,
            Some(Err(e)) => {
                print_line(&format!("{prefix} cannot start the backend: {e}"));
                Vec::new()
            }
            None => Vec::new(),
        };
        if world.all_max((worker.is_some() && backends.is_empty()) as u64) > 0 {
            return None;
        }
        log_layout(world, layout, roles, &backends, in_flight);
        if me == 0 {
            tracing::info!(
                "backends ready in {:.2} s ({})",
                t_start.elapsed().as_secs_f64(),
                age()
            );
        }
        t_run.set(Instant::now());
        Some(backends)
    };

    let outcome = if group.overlapped {
        let shown = if me == 0 {
            progress()
        } else {
            Progress::silent()
        };
        match overlap::run(&mine, open, read_ahead, me, &prefix, args, shown) {
            Some(outcome) => outcome,
            None => return 1,
        }
    } else {
        let first = mine.first().filter(|_| local == group.reader());
        let (first_read, opened) = std::thread::scope(|scope| {
            let reading = first.map(|&(_, request)| scope.spawn(move || read_frame(request)));
            let opened = open();
            let first_read = reading.map(|r| {
                r.join()
                    .unwrap_or_else(|_| Err(Error::Mpi("the reading thread panicked".into())))
            });
            (first_read, opened)
        });
        let Some(mut backends) = opened else {
            return 1;
        };
        let context = GroupContext {
            world,
            comm: &group_comm,
            group: &group,
            local,
            prefix: &prefix,
            args,
            progress,
        };
        let outcome = {
            let backend = backends
                .first_mut()
                .map(|b| -> &mut dyn Backend { b.as_mut() });
            context.run(&mine, first_read, backend)
        };
        let t_release = Instant::now();
        drop(backends);
        tracing::debug!(
            "frames done; backend released in {:.3} s",
            t_release.elapsed().as_secs_f64()
        );
        outcome
    };
    let t_run = t_run.get();

    // Every group's writer counts its frames; the verdict is the job's.
    let is_writer = local == group.writer();
    let count = |n: usize| world.all_sum(if is_writer { n as u64 } else { 0 }) as usize;
    let (written, failed) = (count(outcome.written), count(outcome.failed));
    let comparison_failed = world.all_max((is_writer && outcome.comparison_failed) as u64) > 0;
    let n = requests.len();
    if me == 0 {
        let elapsed = t_run.elapsed().as_secs_f64();
        if n > 1 {
            tracing::info!(
                "{written} of {n} frames written in {elapsed:.2} s ({:.0} frames per hour; {})",
                written as f64 * 3600.0 / elapsed.max(1e-9),
                age()
            );
        }
        if failed > 0 && n > 1 {
            print_line(&format!("spex: {failed} of {n} frames failed"));
        }
    }
    if failed > 0 {
        failed.min(100) as u8
    } else if comparison_failed {
        EXIT_COMPARISON_FAILED
    } else {
        0
    }
}

/// How long ago the process started, for the log.
fn age() -> String {
    layout::process_age().map_or_else(
        || "process age unknown".into(),
        |a| format!("process started {a:.2} s ago"),
    )
}

/// What a rank needs to take part in the frames of its group.
struct GroupContext<'a> {
    world: &'a Comm,
    comm: &'a Comm,
    group: &'a Group,
    /// This rank in the group.
    local: usize,
    prefix: &'a str,
    args: &'a ExtractArgs,
    progress: &'a dyn Fn() -> Progress,
}

impl GroupContext<'_> {
    /// Prints the line of an error that leaves the ranks out of step and aborts the job.
    fn fatal(&self, e: &dyn std::fmt::Display) -> ! {
        print_line(&format!("{} {e}", self.prefix));
        self.world.abort(1)
    }

    /// Reads, solves and writes the frames of the group (`(index in the list, request)`, in
    /// the order of the list); `first_read` is the reader's read of the first of them.
    ///
    /// The reader and the workers share the broadcasts, the workers and the writer the
    /// gathers; in both the reader (resp. writer) is rank 0. Without dedicated I/O ranks both
    /// communicators are the whole group.
    fn run(
        &self,
        frames: &[(usize, &ExtractRequest)],
        mut first_read: Option<Result<(Inputs, PixelBox)>>,
        mut backend: Option<&mut dyn Backend>,
    ) -> Outcome {
        let (group, me) = (self.group, self.local);
        let (is_reader, is_writer) = (me == group.reader(), me == group.writer());
        let worker = group.worker_index(me);
        let read_comm = self
            .comm
            .split((is_reader || worker.is_some()).then_some(0));
        let write_comm = self
            .comm
            .split((is_writer || worker.is_some()).then_some(0));
        // World rank of rank j of the write communicator.
        let writer_peer = |j: usize| match (group.async_io, j) {
            (false, _) => group.world(j),
            (true, 0) => group.world(group.writer()),
            (true, _) => group.world(group.workers().start + j - 1),
        };

        let mut outcome = Outcome::default();
        for &(k, request) in frames {
            let frame_name = request.input.display().to_string();

            // 1. Read and distribute.
            let mut inputs: Option<Inputs> = None;
            // The header as broadcast, which worker 0 forwards to a writer that did not read.
            let mut header = Vec::new();
            let mut read_s = 0.0;
            let mut t_recv = Instant::now();
            if let Some(rc) = &read_comm {
                if is_reader {
                    let read = first_read.take().unwrap_or_else(|| read_frame(request));
                    read_s = t_recv.elapsed().as_secs_f64();
                    t_recv = Instant::now();
                    match read {
                        Ok((i, pixel_box)) => {
                            header = vec![1];
                            header
                                .extend(FrameHeader::to_words(&i.psf, &i.image, pixel_box, read_s));
                            inputs = Some(i);
                        }
                        Err(e) => {
                            print_line(&format!("{} frame {frame_name}: {e}", self.prefix));
                            header = vec![0];
                        }
                    }
                }
                rc.wait_quietly();
                let _range = nvtx::LocalRange::new(c"broadcast");
                if let Err(e) = rc.broadcast_words(0, &mut header) {
                    self.fatal(&e);
                }
                if header.first() == Some(&1) {
                    header.remove(0);
                    let received =
                        distribute_pixels(rc, is_reader, &header, inputs.take(), request);
                    inputs = Some(received.unwrap_or_else(|e| self.fatal(&e)));
                }
            }
            let recv_s = t_recv.elapsed().as_secs_f64();

            // 2. Solve this worker's block of the frame.
            let mut own: Option<Contribution> = None;
            if let (Some(wi), Some(backend)) = (worker, backend.as_deref_mut()) {
                own = Some(match &inputs {
                    None => Contribution::Skipped,
                    Some(inputs) => {
                        let rank = group.world(me);
                        let shown = if rank == 0 {
                            (self.progress)()
                        } else {
                            Progress::silent()
                        };
                        let t0 = Instant::now();
                        let share = Share {
                            worker: wi,
                            nworkers: group.nworkers(),
                            frame: k,
                            rank,
                        };
                        match solve_share(request, inputs, backend, &share, &shown) {
                            Ok(results) => Contribution::Solved {
                                // The writer needs the header only when it did not read.
                                header: (wi == 0 && !is_writer)
                                    .then(|| std::mem::take(&mut header)),
                                results,
                                recv_s,
                                solve_s: t0.elapsed().as_secs_f64(),
                            },
                            Err(e) => {
                                print_line(&format!("{} frame {frame_name}: {e}", self.prefix));
                                Contribution::Failed
                            }
                        }
                    }
                });
            }
            // The reader needs nothing more of this frame: with --async-io it reads the next
            // one while the workers solve this one.
            drop(if is_writer { None } else { inputs.take() });

            // 3. Gather on the writer, which stitches and writes only once every worker
            // delivered.
            let Some(wc) = &write_comm else { continue };
            let send = match (&own, is_writer) {
                (Some(c), false) => c.to_words(),
                _ => Vec::new(),
            };
            let t_gather = Instant::now();
            wc.wait_quietly();
            let gathered = {
                let _range = nvtx::LocalRange::new(c"gather");
                wc.gather_words(0, &send).unwrap_or_else(|e| self.fatal(&e))
            };
            let Some(gathered) = gathered else { continue };
            let gather = t_gather.elapsed();
            let mut contributions = Vec::with_capacity(gathered.len());
            for (j, words) in gathered.into_iter().enumerate() {
                let c = if j == 0 {
                    match own.take() {
                        Some(c) => c,
                        None => continue, // a dedicated writer solves nothing
                    }
                } else {
                    Contribution::from_words(&words).unwrap_or_else(|e| {
                        self.fatal(&format!("from rank {}: {e}", writer_peer(j)))
                    })
                };
                contributions.push((writer_peer(j), c));
            }
            let written = write_frame(
                request,
                inputs,
                read_s,
                contributions,
                Some(gather),
                self.args,
                &mut outcome,
            );
            record(&mut outcome, written, request, self.prefix);
        }
        outcome
    }
}

/// What the writer counts.
#[derive(Default)]
pub(super) struct Outcome {
    pub written: usize,
    pub failed: usize,
    pub comparison_failed: bool,
}

/// Counts the outcome of [`write_frame`] for `request`, printing the line of its error.
pub(super) fn record(
    outcome: &mut Outcome,
    written: Result<bool>,
    request: &ExtractRequest,
    prefix: &str,
) {
    match written {
        Ok(true) => outcome.written += 1,
        Ok(false) => outcome.failed += 1,
        Err(e) => {
            print_line(&format!("{prefix} frame {}: {e}", request.input.display()));
            outcome.failed += 1;
        }
    }
}

/// The frames of the run: `(input, psf, output, model)`, without those that exist already
/// under `--skip-existing`.
fn frames_of(args: &ExtractArgs) -> Result<Vec<FrameFiles>> {
    let requests = args.requests()?;
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    pipeline::check_threads(args.threads, cores)?;
    for r in &requests {
        r.validate_options()?;
    }
    pipeline::check_job_paths(&requests, args.test.as_deref())?;
    let mut frames = Vec::new();
    for r in requests {
        if args.skip_existing && r.output.exists() {
            tracing::info!("{} exists, skipped", r.output.display());
            continue;
        }
        frames.push((r.input, r.psf, r.output, r.model));
    }
    Ok(frames)
}

/// The CUDA devices of the `node_worker`-th of the node's `node_workers` extracting ranks
/// (empty for the CPU): `--device`, else the one [`device_for`] gives, or for a rank that
/// solves whole frames (`whole_frames`) the block of [`devices_for`].
fn devices_of(
    args: &ExtractArgs,
    whole_frames: bool,
    node_worker: usize,
    node_workers: usize,
) -> Result<Vec<usize>> {
    if !args.use_gpu() {
        return Ok(Vec::new());
    }
    if let Some(d) = args.device {
        return Ok(vec![d]);
    }
    let n = backend::cuda::device_count()?;
    let devices: Vec<usize> = if whole_frames {
        devices_for(node_worker, node_workers, n).collect()
    } else {
        device_for(node_worker, node_workers, n)
            .into_iter()
            .collect()
    };
    if devices.is_empty() {
        return Err(Error::Gpu("no CUDA device is visible to this rank".into()));
    }
    Ok(devices)
}

/// The backends of a worker: `per_device` on each of `devices` (opened at the same time),
/// device by device, or for the CPU `per_device` backends that share the rank's threads.
fn start_backends(
    args: &ExtractArgs,
    layout: &Layout,
    devices: Vec<usize>,
    per_device: usize,
) -> Result<Vec<Box<dyn Backend>>> {
    let on = |kind: BackendKind, threads: usize, device: usize| -> Result<Vec<Box<dyn Backend>>> {
        let first = backend::create(kind, threads, device)?;
        let mut backends = Vec::with_capacity(per_device);
        for _ in 1..per_device {
            backends.push(first.sibling()?);
        }
        backends.insert(0, first);
        Ok(backends)
    };
    if !args.use_gpu() {
        // CPU backends in flight share the rank's threads rather than oversubscribe them.
        return on(BackendKind::Cpu, (layout.threads / per_device).max(1), 0);
    }
    let opened: Vec<Result<Vec<Box<dyn Backend>>>> = std::thread::scope(|scope| {
        let opening: Vec<_> = devices
            .iter()
            .map(|&d| scope.spawn(move || on(BackendKind::Cuda, layout.threads, d)))
            .collect();
        opening
            .into_iter()
            .map(|t| {
                t.join()
                    .unwrap_or_else(|_| Err(Error::Gpu("a device-opening thread panicked".into())))
            })
            .collect()
    });
    let mut backends = Vec::new();
    for b in opened {
        backends.extend(b?);
    }
    Ok(backends)
}

/// Logs the layout once, on rank 0: ranks, nodes, ranks per node, threads, roles and, for the
/// GPU, which devices each rank drives. Collective.
fn log_layout(
    world: &Comm,
    layout: &Layout,
    roles: &Roles,
    backends: &[Box<dyn Backend>],
    per_device: usize,
) {
    let threads = world.all_gather(layout.threads as u64);
    let local = world.all_gather(layout.local_rank as u64);
    // The devices of a rank as a bit set (ordinals beyond 63 are left out of the map).
    let mask = backends
        .iter()
        .filter_map(|b| b.device())
        .filter(|&d| d < 64)
        .fold(0u64, |m, d| m | 1 << d);
    let devices = world.all_gather(mask);
    if layout.rank != 0 {
        return;
    }
    if !backends.is_empty() {
        let mut names: Vec<String> = backends.iter().map(|b| b.describe()).collect();
        names.dedup();
        let in_flight = match per_device {
            1 => String::new(),
            n if names.len() == 1 => format!(", {n} frames in flight"),
            n => format!(", {n} frames in flight on each"),
        };
        tracing::info!("rank 0 extracts on {}{in_flight}", names.join(", "));
    }
    if !layout.launched {
        return;
    }
    let range = |v: &[u64]| {
        let lo = v.iter().min().copied().unwrap_or(0);
        let hi = v.iter().max().copied().unwrap_or(0);
        if lo == hi {
            format!("{lo}")
        } else {
            format!("{lo}-{hi}")
        }
    };
    let per_node: Vec<u64> = local.iter().map(|&l| l + 1).collect();
    tracing::info!(
        "MPI: {} ranks on {} node{} ({} ranks per node, node-local ranks 0-{}), threads per rank: {}; {}",
        layout.size,
        layout.nodes,
        if layout.nodes == 1 { "" } else { "s" },
        if layout.nodes == 1 {
            layout.local_size.to_string()
        } else {
            format!("up to {}", per_node.iter().max().copied().unwrap_or(1))
        },
        per_node.iter().max().copied().unwrap_or(1) - 1,
        range(&threads),
        roles.describe()
    );
    if devices.iter().any(|&m| m != 0) {
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
}

/// A box of CCD rows and columns.
pub(super) type PixelBox = (Range<usize>, Range<usize>);

/// Reads a frame and checks what can be checked before anyone solves (the output directory,
/// the inputs, the plan); returns the inputs and the box of pixels the plan's patches can use.
pub(super) fn read_frame(request: &ExtractRequest) -> Result<(Inputs, PixelBox)> {
    let _range = nvtx::LocalRange::new(c"read");
    request.check_outputs()?;
    let inputs = pipeline::read_inputs(request)?;
    let plan = request.plan(&inputs.psf)?;
    pipeline::warn_unusable_fibers(&inputs.psf, &plan, &inputs.image);
    let pixel_box = plan_box(&plan, &inputs);
    Ok((inputs, pixel_box))
}

/// The CCD box covered by every spot of every fiber of the plan on its padded wavelength grid,
/// clipped to the image. Patch pixel boxes lie inside it, so workers need no other pixel: a
/// frame of a few bundles or a short wavelength range broadcasts a small part of the CCD.
fn plan_box(plan: &Plan, inputs: &Inputs) -> PixelBox {
    let corners = inputs.psf.corners(plan.fibers(), &plan.fullwave);
    let (ny, nx) = (corners.ny as i64, corners.nx as i64);
    let bounds = |v: &[i32], n: i64, limit: usize| -> Range<usize> {
        let lo = v.iter().copied().min().map_or(0, i64::from);
        let hi = v.iter().copied().max().map_or(0, |m| i64::from(m) + n);
        let clip = |x: i64| x.clamp(0, limit as i64) as usize;
        clip(lo)..clip(hi).max(clip(lo))
    };
    (
        bounds(&corners.yc, ny, inputs.image.nrows),
        bounds(&corners.xc, nx, inputs.image.ncols),
    )
}

/// Broadcasts the pixel box of a frame from the reader (rank 0 of `rc`, which passes its
/// inputs) and returns every rank's inputs: on the other ranks a full-size image that is zero
/// outside the box.
fn distribute_pixels(
    rc: &Comm,
    is_reader: bool,
    header: &[u64],
    read: Option<Inputs>,
    request: &ExtractRequest,
) -> Result<Inputs> {
    let h = FrameHeader::from_words(header)?;
    let npix = h.npix();
    let (rows, cols) = (&h.rows, &h.cols);
    let full = rows.len() == h.image.nrows && cols.len() == h.image.ncols;
    if is_reader {
        let mut inputs = read.ok_or_else(|| Error::Mpi("reader without inputs".into()))?;
        let image = &mut inputs.image;
        if full {
            rc.broadcast_f32(0, &mut image.pix);
            rc.broadcast_f32(0, &mut image.ivar);
        } else {
            for buf in [&image.pix, &image.ivar] {
                rc.broadcast_f32(0, &mut pack_box(buf, image.ncols, rows, cols));
            }
        }
        return Ok(inputs);
    }
    let mut image = h.image;
    image.path = request.input.clone();
    let n = image.nrows * image.ncols;
    let mut band = Vec::new();
    for buf in [&mut image.pix, &mut image.ivar] {
        // Zeroed pages come from the kernel untouched: only the box is ever written.
        *buf = vec![0.0; n];
        if full {
            rc.broadcast_f32(0, buf);
        } else {
            band.resize(npix, 0.0);
            rc.broadcast_f32(0, &mut band);
            unpack_box(&band, buf, image.ncols, rows, cols);
        }
    }
    Ok(Inputs { psf: h.psf, image })
}

/// Which block of a frame a worker solves.
pub(super) struct Share {
    pub worker: usize,
    pub nworkers: usize,
    pub frame: usize,
    pub rank: usize,
}

/// Solves a worker's block of patches.
pub(super) fn solve_share(
    request: &ExtractRequest,
    inputs: &Inputs,
    backend: &mut dyn Backend,
    share: &Share,
    progress: &Progress,
) -> Result<Vec<PatchResult>> {
    let _range = nvtx::LocalRange::new(c"extract");
    let plan = request.plan(&inputs.psf)?;
    let options = request.solve_options(&inputs.psf);
    let block = patch_block(plan.patches.len(), share.nworkers, share.worker);
    let patches = &plan.patches[block];
    tracing::debug!(
        "frame {}: rank {} solves patches {}..{} on {}",
        share.frame,
        share.rank,
        patches.first().map_or(0, |p| p.index),
        patches.last().map_or(0, |p| p.index + 1),
        backend.describe()
    );
    fault::inject(share.rank, share.frame)?;
    let input = FrameInput {
        plan: &plan,
        psf: &inputs.psf,
        image: &inputs.image,
        options: &options,
    };
    progress.start(patches.len());
    backend.extract(input, patches, progress)
}

/// Stitches and writes a frame from the workers' contributions, gathered in `gather` (`None`:
/// solved in this process). `Ok(false)`: a rank failed on this frame (it reported why).
pub(super) fn write_frame(
    request: &ExtractRequest,
    local: Option<Inputs>,
    read_s: f64,
    contributions: Vec<(usize, Contribution)>,
    gather: Option<Duration>,
    args: &ExtractArgs,
    outcome: &mut Outcome,
) -> Result<bool> {
    let mut header = None;
    let mut results = Vec::new();
    let (mut solve_min, mut solve_max, mut recv_s) = (f64::INFINITY, 0.0f64, None);
    let mut failed = Vec::new();
    for (rank, c) in contributions {
        match c {
            Contribution::Solved {
                header: h,
                results: r,
                recv_s: rs,
                solve_s,
            } => {
                header = header.or(h);
                recv_s = recv_s.or(Some(rs));
                results.extend(r);
                solve_min = solve_min.min(solve_s);
                solve_max = solve_max.max(solve_s);
            }
            Contribution::Failed => failed.push(rank),
            Contribution::Skipped => return Ok(false),
        }
    }
    if !failed.is_empty() {
        tracing::debug!(
            "{}: failed on ranks {failed:?}, not written",
            request.input.display()
        );
        return Ok(false);
    }
    let (inputs, read_s) = match (local, header) {
        (Some(i), _) => (i, read_s),
        (None, Some(words)) => {
            let h = FrameHeader::from_words(&words)?;
            let inputs = Inputs {
                psf: h.psf,
                image: h.image,
            };
            (inputs, h.read_s)
        }
        (None, None) => return Err(Error::Mpi("no worker sent the frame header".into())),
    };
    let secs = Duration::from_secs_f64;
    let mut timings = Timings::default();
    timings.phases.push(("read", secs(read_s)));
    if let Some(gather) = gather {
        timings
            .phases
            .push(("receive", secs(recv_s.unwrap_or(0.0))));
        timings.phases.push(("solve", secs(solve_max)));
        timings.phases.push(("gather", gather));
    } else {
        timings.phases.push(("solve", secs(solve_max)));
    }
    let plan = request.plan(&inputs.psf)?;
    tracing::info!("{}: {}", request.input.display(), plan.summary());
    // The reference is read before the frame is written: a missing or mismatched one fails
    // the frame without leaving its output behind.
    let reference = match &args.test {
        Some(path) => Some(compare::read_reference(
            path,
            plan.options.nspec,
            &plan.wave,
            inputs.psf.hsizey,
        )?),
        None => None,
    };
    let (frame, _) = pipeline::finish(request, &plan, &inputs, &results, &mut timings)?;
    tracing::info!(
        "{}: {timings}; solve per rank {:.3}-{:.3} s",
        request.output.display(),
        solve_min,
        solve_max
    );
    if let (Some(reference), Some(other)) = (&args.test, reference) {
        let parity = compare::parity(&frame, &other, ParityLimits::default().rel_tolerance)?;
        println!(
            "{} vs {}:\n{parity}",
            request.output.display(),
            reference.display()
        );
        let failures = parity.failures(&ParityLimits::default());
        for f in &failures {
            print_line(&format!("spex: test failed: {f}"));
        }
        outcome.comparison_failed |= !failures.is_empty();
    }
    Ok(true)
}

/// Failures on demand, to test that a failing rank never hangs the job:
/// `SPEX_TEST_FAULT=KIND@RANK[:FRAME]` makes rank RANK fail on frame FRAME (every frame if
/// omitted) before it solves, with KIND `error` (an ordinary error), `panic` or `abort` (the
/// process dies, as when the kernel kills it for memory).
mod fault {
    use crate::error::{Error, Result};

    pub fn inject(rank: usize, frame: usize) -> Result<()> {
        let Ok(spec) = std::env::var("SPEX_TEST_FAULT") else {
            return Ok(());
        };
        let Some((kind, at)) = spec.split_once('@') else {
            return Ok(());
        };
        let (r, f) = match at.split_once(':') {
            Some((r, f)) => (r.parse::<usize>().ok(), f.parse::<usize>().ok()),
            None => (at.parse::<usize>().ok(), None),
        };
        if r != Some(rank) || f.is_some_and(|f| f != frame) {
            return Ok(());
        }
        match kind {
            "error" => Err(Error::Mpi(format!(
                "fault injected by SPEX_TEST_FAULT={spec}"
            ))),
            "panic" => panic!("fault injected by SPEX_TEST_FAULT={spec}"),
            "abort" => std::process::abort(),
            _ => Ok(()),
        }
    }
}
