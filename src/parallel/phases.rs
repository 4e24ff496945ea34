//! The phases of a frame as both loops run them (the collective loop of a frame group and
//! the overlapped loop of a group of one rank): a worker's share of the solve, and the
//! writer's assembly, check and write of the frame from the workers' contributions, with the
//! writer's count of what was written and what failed.
//!
//! The phases themselves are `pipeline`'s, the same that a single-process extraction runs;
//! this module adds what several ranks need around them: which block of patches is whose,
//! the timings of the workers, and the failures that any rank may report.

use std::time::Duration;

use super::layout::patch_block;
use super::messages::{decode, Contribution, FrameHeader};
use super::{print_line, FrameCheck};
use crate::backend::{Backend, Progress};
use crate::error::{Error, Result};
use crate::extract::PatchResult;
use crate::frame::FrameValues;
use crate::output::StagedSet;
use crate::pipeline::{self, ExtractRequest, Inputs, Timings};

/// What a writer counts.
#[derive(Debug, Default)]
pub(super) struct Outcome {
    pub written: usize,
    pub failed: usize,
    pub comparison_failed: usize,
}

impl Outcome {
    /// Counts the outcome of [`write_frame`] for `request`, printing the line of its error.
    pub fn record(&mut self, written: Result<Fate>, request: &ExtractRequest, prefix: &str) {
        match written {
            Ok(Fate::Passed) => self.written += 1,
            Ok(Fate::OutsideLimits) => {
                self.written += 1;
                self.comparison_failed += 1;
            }
            Ok(Fate::Failed) => self.failed += 1,
            Err(e) => {
                print_line(&format!("{prefix} frame {}: {e}", request.input.display()));
                self.failed += 1;
            }
        }
    }

    /// Adds another writer's counts.
    pub fn add(&mut self, other: Outcome) {
        self.written += other.written;
        self.failed += other.failed;
        self.comparison_failed += other.comparison_failed;
    }
}

/// What became of a frame at its writer.
pub(super) enum Fate {
    /// Written (and within the limits of the check, if any).
    Passed,
    /// Written, but its check found it outside the limits.
    OutsideLimits,
    /// A rank failed on this frame and reported why: nothing was written.
    Failed,
}

/// Which block of a frame a worker solves.
pub(super) struct Share {
    pub worker: usize,
    pub nworkers: usize,
    /// Index of the frame in the job's list.
    pub frame: usize,
    /// World rank of the worker.
    pub rank: usize,
}

/// Solves a worker's block of patches; a worker that then `writes` the frame has its file's
/// memory mapped meanwhile (the others announce its size, for whichever thread writes it).
/// `values`: the frame's arrays, cleared ahead by a reader of the process that writes the
/// frame; a worker that writes the frame and solves every patch clears them here when none
/// came. They are used only for a solve of every patch ([`pipeline::solve`]).
pub(super) fn solve_share(
    request: &ExtractRequest,
    inputs: &Inputs,
    backend: &mut dyn Backend,
    share: &Share,
    progress: &Progress,
    writes: bool,
    values: Option<FrameValues>,
) -> Result<(Vec<PatchResult>, Option<FrameValues>)> {
    let plan = request.plan_for(inputs)?;
    pipeline::prepare_write(&plan, inputs, writes);
    let block = patch_block(plan.patches.len(), share.nworkers, share.worker);
    let whole = block.len() == plan.patches.len();
    let values =
        values.or_else(|| (writes && whole).then(|| FrameValues::zeros(&plan, inputs.psf.hsizey)));
    tracing::debug!(
        "frame {}: rank {} solves patches {:?} on {}",
        share.frame,
        share.rank,
        block,
        backend.describe()
    );
    fault::inject(share.rank, share.frame)?;
    pipeline::solve(request, inputs, &plan, block, backend, progress, values)
}

/// The contributions of a frame's workers, sorted out by the writer.
struct Delivered {
    /// The frame header forwarded by the first worker, when the writer did not read.
    header: Option<Vec<u8>>,
    results: Vec<PatchResult>,
    placed: Option<Box<FrameValues>>,
    recv_s: Option<f64>,
    solve_s: (f64, f64),
}

/// Sorts the contributions out; `None` if a worker failed or the frame was never read.
fn delivered(
    request: &ExtractRequest,
    contributions: Vec<(usize, Contribution)>,
) -> Option<Delivered> {
    let mut d = Delivered {
        header: None,
        results: Vec::new(),
        placed: None,
        recv_s: None,
        solve_s: (f64::INFINITY, 0.0),
    };
    let mut failed = Vec::new();
    for (rank, c) in contributions {
        match c {
            Contribution::Solved {
                header,
                results,
                placed,
                recv_s,
                solve_s,
            } => {
                d.header = d.header.or(header);
                d.placed = d.placed.or(placed);
                d.recv_s = d.recv_s.or(Some(recv_s));
                d.results.extend(results);
                d.solve_s = (d.solve_s.0.min(solve_s), d.solve_s.1.max(solve_s));
            }
            Contribution::Failed => failed.push(rank),
            Contribution::Skipped => return None,
        }
    }
    if !failed.is_empty() {
        tracing::debug!(
            "{}: failed on ranks {failed:?}, not written",
            request.input.display()
        );
        return None;
    }
    Some(d)
}

/// A frame written at its writer under temporary names, waiting for its commit.
pub(super) struct Ready {
    files: StagedSet,
    fate: Fate,
}

impl Ready {
    /// Renames the frame's files into place: what becomes of the frame.
    pub fn commit(self) -> Result<Fate> {
        self.files.commit()?;
        Ok(self.fate)
    }
}

/// The fate of a frame that [`write_frame`] staged, once committed at once: for a rank that
/// agrees with nobody (a frame group of one rank).
pub(super) fn commit_now(staged: Result<Option<Ready>>) -> Result<Fate> {
    staged?.map_or(Ok(Fate::Failed), Ready::commit)
}

/// Stitches, checks and writes a frame from the workers' contributions, gathered in `gather`
/// (`None`: solved in this process), under temporary names: the caller commits it.
/// `None`: a rank failed on the frame and said why. `local`: the inputs, if this rank read
/// them.
pub(super) fn write_frame(
    request: &ExtractRequest,
    local: Option<Inputs>,
    read_s: f64,
    contributions: Vec<(usize, Contribution)>,
    gather: Option<Duration>,
    check: Option<&FrameCheck<'_>>,
) -> Result<Option<Ready>> {
    let Some(d) = delivered(request, contributions) else {
        return Ok(None);
    };
    let (inputs, read_s) = match (local, d.header) {
        (Some(i), _) => (i, read_s),
        (None, Some(bytes)) => {
            let h: FrameHeader = decode(&bytes)?;
            let inputs = Inputs {
                psf: h.psf,
                image: h.image,
                heliocor: h.heliocor,
                traces: None,
            };
            (inputs, h.read_s)
        }
        (None, None) => return Err(Error::Internal("no worker sent the frame header".into())),
    };
    let secs = Duration::from_secs_f64;
    let mut timings = Timings::default();
    timings.phases.push(("read", secs(read_s)));
    if let Some(gather) = gather {
        timings
            .phases
            .push(("receive", secs(d.recv_s.unwrap_or(0.0))));
        timings.phases.push(("solve", secs(d.solve_s.1)));
        timings.phases.push(("gather", gather));
    } else {
        timings.phases.push(("solve", secs(d.solve_s.1)));
    }
    let plan = request.plan_for(&inputs)?;
    tracing::info!("{}: {}", request.input.display(), plan.summary());
    let placed = d.placed.map(|values| *values);
    let (frame, _) = pipeline::assemble(request, &plan, &inputs, &d.results, placed, &mut timings)?;
    // The check runs before the write: a reference that cannot be compared leaves no output.
    let passed = check.map(|c| c(request, &frame)).transpose()?;
    let files = pipeline::stage(request, &inputs, &frame, &d.results, &mut timings)?;
    tracing::info!(
        "{}: {timings}; solve per rank {:.3}-{:.3} s",
        request.output.display(),
        d.solve_s.0,
        d.solve_s.1
    );
    let fate = match passed {
        Some(false) => Fate::OutsideLimits,
        _ => Fate::Passed,
    };
    Ok(Some(Ready { files, fate }))
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
            "error" => Err(Error::Internal(format!(
                "fault injected by SPEX_TEST_FAULT={spec}"
            ))),
            "panic" => panic!("fault injected by SPEX_TEST_FAULT={spec}"),
            "abort" => std::process::abort(),
            _ => Ok(()),
        }
    }
}
