//! A job: the frames of a [`JobConfig`] (one, or a whole exposure from a list) over the ranks
//! of the world, and the final vote on what was written and what failed.
//!
//! The ranks form frame groups (`--frame-groups N`, one by default) and frame k of the list
//! goes to group k mod N, which reads, extracts and writes it on its own ranks: the groups
//! share nothing but the list and the final count, so they proceed at their own pace. A
//! group of several ranks runs the collective loop (`collective`); a group of one rank under
//! `--async-io` overlaps its phases on threads (`overlap`). The output does not depend on the
//! groups or the ranks.
//!
//! Start-up: every extracting rank starts its backends, and one rank that cannot stops the
//! job before any frame is solved; meanwhile each group's reader reads its first frame. At
//! the end the writers' counts are summed and every rank returns the same [`JobOutcome`].

use std::cell::Cell;
use std::time::Instant;

use super::collective::{timed_read, GroupContext};
use super::devices::{devices_of, log_layout, start_backends, DeviceRequest, Opened};
use super::layout::{self, Layout, Roles};
use super::messages::{decode, encode};
use super::phases::Outcome;
use super::{overlap, print_line, Comm, Hooks, JobOutcome};
use crate::backend::{Backend, Progress};
use crate::config::JobConfig;
use crate::error::Error;
use crate::pipeline::ExtractRequest;

/// Runs the frames of `config` on the ranks of `world` in the frame groups of `roles`.
/// Returns the job's outcome, the same on every rank, or `None` when the job stopped before
/// its frames (a backend did not start; every rank said why).
pub fn run(
    world: &Comm,
    layout: &Layout,
    roles: &Roles,
    config: &JobConfig,
    hooks: &Hooks<'_>,
) -> Option<JobOutcome> {
    let t_start = Instant::now();
    let me = layout.rank;
    let prefix = layout.error_prefix();
    let fatal = |e: &dyn std::fmt::Display| -> ! {
        print_line(&format!("{prefix} {e}"));
        world.abort(1)
    };
    let requests = share_frames(world, config).unwrap_or_else(|e| fatal(&e));
    if me == 0 {
        log_plan(roles, config, requests.len());
    }
    let group = roles.group_of(me);
    let local = me - group.first;
    let Some(group_comm) = world.split(Some(group.index as u32)) else {
        fatal(&"no communicator for the frame group")
    };
    // The frames of this group, with their index in the list.
    let mine: Vec<(usize, &ExtractRequest)> = requests
        .iter()
        .enumerate()
        .filter(|(k, _)| roles.group_of_frame(*k) == group.index)
        .collect();
    // A rank that reads frames ahead is bound by its host's work: it inflates its .fits.gz
    // preprocs on one core each (30 frames on a 4-GPU node took as long or longer with the
    // first one in chunks); a rank with one frame waits for its read, which takes all its
    // threads.
    crate::fits::inflate_in_chunks(mine.len() <= 1);

    // Backends on the workers only, checked together. GPUs go to contiguous blocks of the
    // extracting ranks of each node: dedicated reader and writer ranks hold no device.
    let worker = group.worker_index(local);
    let workers_comm = world.split(worker.map(|_| 0));
    let node_workers = workers_comm.as_ref().map(|c| c.split_shared());
    let request = DeviceRequest {
        choice: config.backend,
        device: config.device,
        // A group of one rank overlaps its frames on threads, with a backend per frame in
        // flight.
        per_device: if group.overlapped {
            config.frames_in_flight
        } else {
            Some(1)
        },
        whole_frames: group.overlapped,
        frames: mine.len(),
        narrow: config.narrow_devices,
    };
    let devices = node_workers
        .as_ref()
        .map(|node| devices_of(&request, node.rank(), node.size()));
    // A rank that solves whole frames reads ahead as many frames as it has devices, with
    // readers sized by them.
    let gpus = match &devices {
        Some(Ok(d)) => d.len(),
        _ => 0,
    };
    let t_run = Cell::new(Instant::now());
    let open = || -> Option<Opened> {
        let started = devices.map(|d| d.and_then(|d| start_backends(&request, layout.threads, d)));
        let mut opened = match started {
            Some(Ok(opened)) => opened,
            Some(Err(e)) => {
                print_line(&format!("{prefix} cannot start the backend: {e}"));
                Opened::none()
            }
            None => Opened::none(),
        };
        if world.all_max((worker.is_some() && opened.now.is_empty()) as u64) > 0 {
            return None;
        }
        // A group with one frame gives each backend one frame (or its share of one). Such a
        // rank opens one GPU at most (`devices_for`), so no backend is still to come.
        if mine.len() <= 1 {
            debug_assert!(opened.later.is_none(), "a one-frame rank opens one GPU");
            opened.now.iter_mut().for_each(|b| b.one_frame_only());
        }
        log_layout(world, layout, roles, &opened.now);
        if me == 0 {
            let others = if opened.later.is_some() {
                "; the other GPUs open meanwhile"
            } else {
                ""
            };
            tracing::info!(
                "backends ready in {:.2} s ({}{others})",
                t_start.elapsed().as_secs_f64(),
                age()
            );
        }
        t_run.set(Instant::now());
        Some(opened)
    };

    let outcome = if group.overlapped {
        let shown = if me == 0 {
            (hooks.progress)()
        } else {
            Progress::silent()
        };
        overlap::run(
            &mine,
            open,
            overlap::Lanes {
                gpus,
                io_threads: config.io_threads,
                cores: layout.cores,
                first: gpus.max(1) * request.in_flight(gpus),
            },
            me,
            &prefix,
            hooks.check,
            shown,
        )?
    } else {
        let context = GroupContext {
            world,
            comm: &group_comm,
            group: &group,
            local,
            prefix: &prefix,
            progress: hooks.progress,
            check: hooks.check,
        };
        // a group of several ranks opens its GPUs together (no `later`)
        run_collective(&context, &mine, || open().map(|o| o.now))?
    };
    Some(vote(
        world,
        layout,
        &outcome,
        local == group.writer(),
        requests.len(),
        t_run.get(),
    ))
}

/// The frame list as rank 0 decided it: under `--skip-existing` the ranks could disagree on
/// which outputs exist, so rank 0's list is everyone's.
fn share_frames(world: &Comm, config: &JobConfig) -> crate::Result<Vec<ExtractRequest>> {
    let mut message = if world.rank() == 0 {
        encode(&config.frames)?
    } else {
        Vec::new()
    };
    world.broadcast_bytes(0, &mut message)?;
    decode(&message)
}

/// Rank 0's word on the plan of the job: what was skipped, groups with nothing to do.
fn log_plan(roles: &Roles, config: &JobConfig, nframes: usize) {
    for path in &config.skipped {
        tracing::info!("{} exists, skipped", path.display());
    }
    if roles.async_io_ignored() {
        tracing::warn!(
            "--async-io needs frame groups of 1 rank or of 3 or more: groups of 2 read and \
             write on their first rank"
        );
    }
    let idle = roles.ngroups().saturating_sub(nframes);
    if idle > 0 && nframes > 0 {
        let s = |n: usize| if n == 1 { "" } else { "s" };
        tracing::warn!(
            "{} frame groups for {nframes} frame{}: {idle} group{} will have nothing to do",
            roles.ngroups(),
            s(nframes),
            s(idle),
        );
    }
}

/// The collective loop of a group of several ranks (or of one rank without `--async-io`):
/// the reader reads its first frame while the backends open.
fn run_collective(
    context: &GroupContext<'_>,
    mine: &[(usize, &ExtractRequest)],
    open: impl FnOnce() -> Option<Vec<Box<dyn Backend>>>,
) -> Option<Outcome> {
    let first = mine
        .first()
        .filter(|_| context.local == context.group.reader());
    let (first_read, opened) = std::thread::scope(|scope| {
        let reading = first.map(|&(_, request)| scope.spawn(move || timed_read(request)));
        let opened = open();
        let first_read = reading.map(|r| {
            r.join().unwrap_or_else(|_| {
                let panicked = Error::Internal("the reading thread panicked".into());
                (Err(panicked), 0.0)
            })
        });
        (first_read, opened)
    });
    // The loop uses one backend and releases it after its last solve.
    let backend = opened?.into_iter().next();
    Some(context.run(mine, first_read, backend))
}

/// Every group's writer counts its frames; the verdict is the job's, on every rank.
fn vote(
    world: &Comm,
    layout: &Layout,
    outcome: &Outcome,
    is_writer: bool,
    frames: usize,
    t_run: Instant,
) -> JobOutcome {
    let count = |n: usize| world.all_sum(if is_writer { n as u64 } else { 0 }) as usize;
    let job = JobOutcome {
        frames,
        written: count(outcome.written),
        failed: count(outcome.failed),
        comparison_failed: count(outcome.comparison_failed),
    };
    if layout.rank == 0 && frames > 1 {
        let elapsed = t_run.elapsed().as_secs_f64();
        tracing::info!(
            "{} of {frames} frames written in {elapsed:.2} s ({:.0} frames per hour; {})",
            job.written,
            job.written as f64 * 3600.0 / elapsed.max(1e-9),
            age()
        );
    }
    job
}

/// How long ago the process started, for the log.
fn age() -> String {
    layout::process_age().map_or_else(
        || "process age unknown".into(),
        |a| format!("process started {a:.2} s ago"),
    )
}
