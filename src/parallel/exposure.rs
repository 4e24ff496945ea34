//! A run of frames (one, or a whole exposure from `--list`) over the ranks of the job.
//!
//! For each frame, in the order of the list, the reader reads the PSF and the image, checks
//! the plan and broadcasts a header (the PSF, the image's shape and header cards) and the
//! pixels as raw f32 buffers; each worker solves its block of patches on its backend and
//! returns the results to the writer, which stitches the frame and writes it atomically. All
//! of this is the same code for one process (then one rank is reader, worker and writer).
//!
//! With frame groups (`--async-io --frame-groups N`) frame k goes to the workers of group
//! k mod N only: the reader broadcasts it to that group and the writer gathers it from that
//! group, both in the order of the list, so the groups solve different frames at the same time
//! and the output does not change. Each group has its own broadcast and gather communicators,
//! which a worker touches only for the frames of its group.
//!
//! Errors: a frame that cannot be read, or fails on any worker, is counted by the writer and
//! skipped by every rank that handles it: the reader broadcasts a failure header, a worker
//! returns a failed contribution, so every rank still takes part in the same collectives (those
//! of the frame's group). The rank that had the error prints one line
//! `spex: rank R: error: frame ...: cause`; no output is written for that frame, and the writer
//! writes only after every worker has delivered. What leaves ranks out of step (a malformed
//! message, a buffer that cannot be allocated, a panic) aborts the whole job through
//! `MPI_Abort` after its line. At the end every rank returns the exit status decided by the
//! writer: the number of failed frames (capped at 100), 3 for a failed `--test`.

use std::ops::Range;
use std::time::{Duration, Instant};

use super::exchange::{
    frames_from_words, frames_to_words, pack_box, unpack_box, Contribution, FrameFiles, FrameHeader,
};
use super::layout::{device_for, patch_block, Layout, Roles};
use super::{print_line, Comm};
use crate::backend::{self, Backend, BackendKind, FrameInput, Progress};
use crate::cli::ExtractArgs;
use crate::compare::{self, ParityLimits};
use crate::error::{Error, Result};
use crate::extract::PatchResult;
use crate::frame::Frame;
use crate::pipeline::{self, ExtractRequest, Inputs, Timings};
use crate::plan::Plan;

/// Exit status of a `--test` comparison outside its limits.
pub const EXIT_COMPARISON_FAILED: u8 = 3;

/// Runs every frame `args` asks for on the ranks of `world` and returns the exit status, the
/// same on every rank. `progress` makes the progress display of rank 0's own patches.
pub fn run(
    world: &Comm,
    layout: &Layout,
    args: &ExtractArgs,
    progress: &dyn Fn() -> Progress,
) -> u8 {
    let me = layout.rank;
    let prefix = layout.error_prefix();
    // Every rank reaches the same verdict on its own, so a bad option needs no message; rank 0
    // alone says why, and the others wait for its line: a launcher may kill the job as soon as
    // one rank exits non-zero.
    let roles = match Roles::grouped(layout.size, args.async_io, args.frame_groups) {
        Ok(roles) => roles,
        Err(e) => {
            if me == 0 {
                print_line(&format!("{prefix} {e}"));
            }
            world.all_max(0);
            return 1;
        }
    };
    if args.async_io && !roles.is_async() && me == 0 {
        tracing::warn!(
            "--async-io needs 3 or more ranks ({} here): rank 0 reads and writes",
            layout.size
        );
    }
    let fatal = |e: &dyn std::fmt::Display| -> ! {
        print_line(&format!("{prefix} {e}"));
        world.abort(1)
    };

    // The work: the reader reads the list and decides what to skip; everyone gets the result.
    let mut message = Vec::new();
    if me == roles.reader {
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
    if let Err(e) = world.broadcast_words(roles.reader, &mut message) {
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

    // Backends on the workers only, checked together: one rank that cannot start its device
    // stops the job before any frame is read.
    let worker = roles.worker_index(me);
    // GPUs go round robin over the extracting ranks of each node: with --async-io the reader
    // and writer ranks hold no device.
    let workers_comm = world.split(worker.map(|_| 0));
    let local_worker = workers_comm.as_ref().map(|c| c.split_shared().rank());
    let mut device = None;
    let mut backend: Option<Box<dyn Backend>> = None;
    if let Some(local_worker) = local_worker {
        match start_backend(args, layout, local_worker) {
            Ok((b, d)) => {
                backend = Some(b);
                device = d;
            }
            Err(e) => print_line(&format!("{prefix} cannot start the backend: {e}")),
        }
    }
    if world.all_max((worker.is_some() && backend.is_none()) as u64) > 0 {
        return 1;
    }
    log_layout(world, layout, &roles, backend.as_deref(), device);

    // Per frame group, the reader and the group's workers share the broadcasts, the group's
    // workers and the writer the gathers; in both the reader (resp. writer) is rank 0. Without
    // dedicated I/O ranks there is one group and both are the whole world. Frame k uses the
    // communicators of group k mod N only, so that the groups' frames proceed concurrently
    // while each communicator still sees its collectives in the order of the list.
    let my_group = roles.group_of(me);
    let read_comms: Vec<Option<Comm>> = (0..roles.groups)
        .map(|g| world.split((me == roles.reader || my_group == Some(g)).then_some(0)))
        .collect();
    let write_comms: Vec<Option<Comm>> = (0..roles.groups)
        .map(|g| world.split((me == roles.writer || my_group == Some(g)).then_some(0)))
        .collect();
    // Rank j of group g's write communicator in the world.
    let world_rank_of_writer_peer = |g: usize, j: usize| match (roles.is_async(), j) {
        (false, _) => j,
        (true, 0) => roles.writer,
        (true, _) => roles.group_workers(g).start + j - 1,
    };

    let mut outcome = Outcome::default();
    let t_run = Instant::now();
    for (k, request) in requests.iter().enumerate() {
        let g = roles.group_of_frame(k);
        let (read_comm, write_comm) = (&read_comms[g], &write_comms[g]);
        if read_comm.is_none() && write_comm.is_none() {
            continue; // a frame of another group
        }
        let frame_name = request.input.display().to_string();

        // 1. Read and distribute.
        let mut inputs: Option<Inputs> = None;
        // The header as broadcast, which worker 0 forwards to a writer that did not read.
        let mut header = Vec::new();
        let mut read_s = 0.0;
        let mut t_recv = Instant::now();
        if let Some(rc) = &read_comm {
            if me == roles.reader {
                let read = read_frame(request);
                read_s = t_recv.elapsed().as_secs_f64();
                t_recv = Instant::now();
                match read {
                    Ok((i, pixel_box)) => {
                        header = vec![1];
                        header.extend(FrameHeader::to_words(&i.psf, &i.image, pixel_box, read_s));
                        inputs = Some(i);
                    }
                    Err(e) => {
                        print_line(&format!("{prefix} frame {frame_name}: {e}"));
                        header = vec![0];
                    }
                }
            }
            rc.wait_quietly();
            let _range = nvtx::LocalRange::new(c"broadcast");
            if let Err(e) = rc.broadcast_words(0, &mut header) {
                fatal(&e);
            }
            if header.first() == Some(&1) {
                header.remove(0);
                let received =
                    distribute_pixels(rc, me == roles.reader, &header, inputs.take(), request);
                inputs = Some(received.unwrap_or_else(|e| fatal(&e)));
            }
        }
        let recv_s = t_recv.elapsed().as_secs_f64();

        // 2. Solve this worker's block of the frame, among the workers of its group.
        let mut own: Option<Contribution> = None;
        let group_workers = roles.group_workers(g);
        let in_group = my_group == Some(g);
        if let (true, Some(backend)) = (in_group, backend.as_deref_mut()) {
            let wi = me - group_workers.start;
            own = Some(match &inputs {
                None => Contribution::Skipped,
                Some(inputs) => {
                    let shown = if me == 0 {
                        progress()
                    } else {
                        Progress::silent()
                    };
                    let t0 = Instant::now();
                    let share = Share {
                        worker: wi,
                        nworkers: group_workers.len(),
                        frame: k,
                        rank: me,
                    };
                    match solve_share(request, inputs, backend, &share, &shown) {
                        Ok(results) => Contribution::Solved {
                            // The writer needs the header only when it did not read the frame.
                            header: (wi == 0 && me != roles.writer)
                                .then(|| std::mem::take(&mut header)),
                            results,
                            recv_s,
                            solve_s: t0.elapsed().as_secs_f64(),
                        },
                        Err(e) => {
                            print_line(&format!("{prefix} frame {frame_name}: {e}"));
                            Contribution::Failed
                        }
                    }
                }
            });
        }
        // The reader needs nothing more of this frame: with --async-io it reads the next one
        // while the workers solve this one.
        drop(if me == roles.writer {
            None
        } else {
            inputs.take()
        });

        // 3. Gather on the writer, which stitches and writes only once every worker delivered.
        let Some(wc) = &write_comm else { continue };
        let send = match (&own, me == roles.writer) {
            (Some(c), false) => c.to_words(),
            _ => Vec::new(),
        };
        let t_gather = Instant::now();
        wc.wait_quietly();
        let gathered = {
            let _range = nvtx::LocalRange::new(c"gather");
            wc.gather_words(0, &send).unwrap_or_else(|e| fatal(&e))
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
                    fatal(&format!(
                        "from rank {}: {e}",
                        world_rank_of_writer_peer(g, j)
                    ))
                })
            };
            contributions.push((world_rank_of_writer_peer(g, j), c));
        }
        let written = write_frame(
            request,
            inputs,
            read_s,
            contributions,
            gather,
            args,
            &mut outcome,
        );
        match written {
            Ok(true) => outcome.written += 1,
            Ok(false) => outcome.failed += 1,
            Err(e) => {
                print_line(&format!("{prefix} frame {frame_name}: {e}"));
                outcome.failed += 1;
            }
        }
    }

    let code = if me == roles.writer {
        let n = requests.len();
        let elapsed = t_run.elapsed().as_secs_f64();
        if n > 1 {
            tracing::info!(
                "{} of {n} frames written in {elapsed:.2} s ({:.0} frames per hour)",
                outcome.written,
                outcome.written as f64 * 3600.0 / elapsed.max(1e-9)
            );
        }
        if outcome.failed > 0 && n > 1 {
            print_line(&format!("spex: {} of {n} frames failed", outcome.failed));
        }
        if outcome.failed > 0 {
            outcome.failed.min(100) as u8
        } else if outcome.comparison_failed {
            EXIT_COMPARISON_FAILED
        } else {
            0
        }
    } else {
        0
    };
    world.broadcast_u64(roles.writer, code as u64) as u8
}

/// What the writer counts.
#[derive(Default)]
struct Outcome {
    written: usize,
    failed: usize,
    comparison_failed: bool,
}

/// The frames of the run: `(input, psf, output, model)`, without those that exist already
/// under `--skip-existing`.
fn frames_of(args: &ExtractArgs) -> Result<Vec<FrameFiles>> {
    let mut frames = Vec::new();
    for r in args.requests()? {
        if args.skip_existing && r.output.exists() {
            tracing::info!("{} exists, skipped", r.output.display());
            continue;
        }
        frames.push((r.input, r.psf, r.output, r.model));
    }
    Ok(frames)
}

/// The backend of a worker and, for the GPU, its device: `--device`, else the worker's rank
/// among the node's workers (its node-local rank without dedicated I/O ranks) modulo the
/// devices it sees.
fn start_backend(
    args: &ExtractArgs,
    layout: &Layout,
    local_worker: usize,
) -> Result<(Box<dyn Backend>, Option<usize>)> {
    if !args.use_gpu() {
        return Ok((backend::create(BackendKind::Cpu, layout.threads, 0)?, None));
    }
    let device = match args.device {
        Some(d) => d,
        None => {
            let n = backend::cuda::device_count()?;
            device_for(local_worker, n)
                .ok_or_else(|| Error::Gpu("no CUDA device is visible to this rank".into()))?
        }
    };
    Ok((
        backend::create(BackendKind::Cuda, layout.threads, device)?,
        Some(device),
    ))
}

/// Logs the layout once, on rank 0: ranks, nodes, ranks per node, threads, roles and, for the
/// GPU, which device each rank drives. Collective.
fn log_layout(
    world: &Comm,
    layout: &Layout,
    roles: &Roles,
    backend: Option<&dyn Backend>,
    device: Option<usize>,
) {
    let threads = world.all_gather(layout.threads as u64);
    let local = world.all_gather(layout.local_rank as u64);
    let devices = world.all_gather(device.map_or(u64::MAX, |d| d as u64));
    if layout.rank != 0 {
        return;
    }
    if let Some(b) = backend {
        tracing::info!("rank 0 extracts on {}", b.describe());
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
    if devices.iter().any(|&d| d != u64::MAX) {
        let map: Vec<String> = devices
            .iter()
            .enumerate()
            .filter(|(_, &d)| d != u64::MAX)
            .map(|(r, d)| format!("{r}:cuda:{d}"))
            .collect();
        tracing::info!(
            "rank to GPU (node-local worker rank mod devices): {}",
            map.join(" ")
        );
    }
}

/// A box of CCD rows and columns.
type PixelBox = (Range<usize>, Range<usize>);

/// Reads a frame and checks what can be checked before anyone solves (the output directory,
/// the inputs, the plan); returns the inputs and the box of pixels the plan's patches can use.
fn read_frame(request: &ExtractRequest) -> Result<(Inputs, PixelBox)> {
    let _range = nvtx::LocalRange::new(c"read");
    request.check_outputs()?;
    let inputs = pipeline::read_inputs(request)?;
    let plan = request.plan(&inputs.psf)?;
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
struct Share {
    worker: usize,
    nworkers: usize,
    frame: usize,
    rank: usize,
}

/// Solves a worker's block of patches.
fn solve_share(
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

/// Stitches and writes a frame from the workers' contributions. `Ok(false)`: a rank failed on
/// this frame (it reported why).
fn write_frame(
    request: &ExtractRequest,
    local: Option<Inputs>,
    read_s: f64,
    contributions: Vec<(usize, Contribution)>,
    gather: Duration,
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
    timings
        .phases
        .push(("receive", secs(recv_s.unwrap_or(0.0))));
    timings.phases.push(("solve", secs(solve_max)));
    timings.phases.push(("gather", gather));
    let plan = request.plan(&inputs.psf)?;
    tracing::info!("{}: {}", request.input.display(), plan.summary());
    let (frame, _) = pipeline::finish(request, &plan, &inputs, &results, &mut timings)?;
    tracing::info!(
        "{}: {timings}; solve per rank {:.3}-{:.3} s",
        request.output.display(),
        solve_min,
        solve_max
    );
    if let Some(reference) = &args.test {
        let other = Frame::read(reference)?;
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
