//! desispec's entry points: the options of one or more job lines (turned into `spex extract`'s
//! arguments by `spex.desispec`) run as the program runs them, on the ranks of the host's
//! communicator or in this process alone.
//!
//! Every rank of the communicator calls in with the same arguments, builds the same
//! configuration, and takes the job's one outcome home: a failure on any rank raises on every
//! rank. The job runs on a thread of its own while the calling thread waits outside the GIL
//! and checks for signals, so that Ctrl-C stops the job between frames and raises
//! KeyboardInterrupt, over a communicator on the interrupted rank (the host's MPI must allow
//! MPI calls from another thread: mpi4py's default, MPI_THREAD_MULTIPLE, does).

use std::sync::{Condvar, Mutex, MutexGuard, PoisonError};
use std::time::Duration;

use clap::Parser;
use pyo3::prelude::*;
use spex::cli::{Cli, Command, ExtractArgs};
use spex::config::JobConfig;
use spex::parallel::{self, job, Comm, Hooks, JobOutcome, Layout, Roles};
use spex::{output, pipeline};

use crate::errors::Failure;
use crate::logging;
use crate::timing::{phase_ends, Phases};

/// How often the calling thread checks for signals while a job without a communicator runs.
const SIGNAL_POLL: Duration = Duration::from_millis(50);

/// The frames this process wrote in a call: each one's output path and the start and end of
/// each of its phases on the wall clock (see [`phase_ends`]).
type WrittenPhases = Vec<(String, Phases)>;

/// Runs the frames of `argvs` (each the arguments of one `spex extract` job line, without the
/// program's name) over the communicator whose Fortran handle is `comm` (`None`: this process
/// alone). Returns (frames, written, failed, the frames this rank wrote with their phases)
/// when every frame was written.
#[pyfunction]
#[pyo3(signature = (argvs, comm=None))]
pub fn run_job(
    py: Python<'_>,
    argvs: Vec<Vec<String>>,
    comm: Option<i32>,
) -> PyResult<(usize, usize, usize, WrittenPhases)> {
    let config = configure(&argvs)?;
    let verbose = argvs
        .iter()
        .any(|a| a.iter().any(|s| s == "-v" || s == "--verbose"));
    logging::install(py, verbose)?;
    output::leave_signals_to_host();
    pipeline::set_interrupted(false);
    pipeline::record_written_frames(true);
    let outcome = run_interruptible(py, || match comm {
        Some(handle) => {
            // SAFETY: the handle comes from mpi4py's `py2f()` of a live communicator, and the
            // host keeps MPI initialised until it exits.
            let world = unsafe { Comm::from_fortran_handle(handle) }.map_err(Failure::Spex)?;
            execute(&world, true, &config)
        }
        None => execute(&Comm::alone(), false, &config),
    });
    let outcome = match outcome {
        Ok(outcome) => outcome,
        Err(interrupt) => {
            pipeline::record_written_frames(false);
            return Err(interrupt);
        }
    };
    let written = pipeline::take_written_frames();
    pipeline::record_written_frames(false);
    let outcome = outcome?;
    let phases = written
        .iter()
        .map(|w| {
            let output = w.output.display().to_string();
            (output, phase_ends(&w.timings, w.written_at))
        })
        .collect();
    Ok((outcome.frames, outcome.written, outcome.failed, phases))
}

/// Parses each job line as the program does and joins their frames into one configuration,
/// whose layout options are the first line's.
fn configure(argvs: &[Vec<String>]) -> Result<JobConfig, Failure> {
    let no_gpu_env = std::env::var_os("DESI_NO_GPU").is_some();
    let mut config: Option<JobConfig> = None;
    for argv in argvs {
        let args = parse(argv)?;
        let next = JobConfig::from_args(&args, no_gpu_env)?;
        match &mut config {
            None => config = Some(next),
            Some(c) => {
                c.frames.extend(next.frames);
                c.skipped.extend(next.skipped);
            }
        }
    }
    let mut config = config.ok_or_else(|| Failure::Usage("no job line to run".into()))?;
    // The interpreter may use CUDA itself (CuPy) before or after this call.
    config.narrow_devices = false;
    spex::pipeline::check_job_paths(&config.frames, config.test_reference.as_deref())
        .map_err(Failure::Spex)?;
    Ok(config)
}

/// `spex extract`'s options from one job line.
fn parse(argv: &[String]) -> Result<ExtractArgs, Failure> {
    let full = ["spex", "extract"]
        .into_iter()
        .map(String::from)
        .chain(argv.iter().cloned());
    match Cli::try_parse_from(full) {
        Ok(Cli {
            command: Command::Extract(args),
        }) => Ok(*args),
        Ok(_) => Err(Failure::Usage("not an extraction job line".into())),
        Err(e) => Err(Failure::Usage(e.to_string().trim_end().to_string())),
    }
}

/// Runs `job` on a thread of its own while the calling thread waits outside the GIL and
/// checks for signals between waits. An interruption lets the frame in progress finish,
/// fails those not started on this rank, and raises KeyboardInterrupt here once the job has
/// returned. Over a communicator the job runs its MPI calls on that thread (mpi4py
/// initialises MPI for threads), and the other ranks go on as when this rank's frames fail:
/// where this rank reads the frames, the rest of the job fails on every rank; elsewhere the
/// job ends as it would have, and only this rank raises.
fn run_interruptible<F>(py: Python<'_>, job: F) -> PyResult<Result<JobOutcome, Failure>>
where
    F: FnOnce() -> Result<JobOutcome, Failure> + Send,
{
    let done = (Mutex::new(false), Condvar::new());
    std::thread::scope(|scope| {
        let worker = scope.spawn(|| {
            let outcome = job();
            *lock(&done.0) = true;
            done.1.notify_all();
            outcome
        });
        let finished = || {
            let guard = lock(&done.0);
            let (guard, _) = done
                .1
                .wait_timeout_while(guard, SIGNAL_POLL, |d| !*d)
                .unwrap_or_else(PoisonError::into_inner);
            *guard
        };
        let mut interrupt: Option<PyErr> = None;
        while !py.detach(finished) {
            if interrupt.is_none() {
                if let Err(e) = py.check_signals() {
                    pipeline::set_interrupted(true);
                    interrupt = Some(e);
                }
            }
        }
        let outcome = worker.join().unwrap_or_else(|_| {
            Err(Failure::Frames(
                "spex: error: the extraction thread panicked".into(),
            ))
        });
        match interrupt {
            Some(e) => Err(e),
            None => Ok(outcome),
        }
    })
}

/// The program's `extract` after its configuration: roles, layout, the parallel layer's job,
/// and the verdict, the same on every rank of `world`.
fn execute(world: &Comm, launched: bool, config: &JobConfig) -> Result<JobOutcome, Failure> {
    // A job of several frames goes on past one whose inputs are missing, as `--list` does.
    if config.frames.len() == 1 {
        check_inputs(world, config)?;
    }
    let roles = Roles::new(world.size(), config.async_io, config.frame_groups)
        .map_err(|e| Failure::Usage(e.to_string()))?;
    let is_worker = roles.is_worker(world.rank());
    let layout = Layout::discover(world, launched, config.threads, is_worker)
        .with_overlap_cap(config, parallel::node_has_gpus());
    logging::set_rank(layout.rank, roles.is_io_rank(layout.rank));
    // The first job of the process sizes rayon's pool, as the program does.
    let _ = rayon::ThreadPoolBuilder::new()
        .num_threads(layout.threads)
        .thread_name(|i| format!("spex-pool-{i}"))
        .build_global();
    parallel::capture_lines();
    let progress = spex::backend::Progress::silent;
    let hooks = Hooks {
        progress: &progress,
        check: None,
    };
    let outcome = job::run(world, &layout, &roles, config, &hooks);
    let lines = shared_lines(world, parallel::take_captured_lines());
    match outcome {
        Some(o) if o.failed == 0 => Ok(o),
        Some(_) if pipeline::interrupted() => Err(Failure::Spex(spex::Error::Interrupted)),
        Some(o) => Err(Failure::Frames(frame_failures(&lines, &o))),
        None => Err(Failure::Frames(if lines.is_empty() {
            "spex: error: the job stopped before its frames".into()
        } else {
            lines
        })),
    }
}

/// The message of a job whose frames failed: what the ranks said, and the count.
fn frame_failures(lines: &str, outcome: &JobOutcome) -> String {
    let count = format!(
        "spex: {} of {} frames failed",
        outcome.failed, outcome.frames
    );
    if lines.is_empty() {
        count
    } else {
        format!("{lines}\n{count}")
    }
}

/// Refuses, on every rank, a job of one frame whose input files are missing: FileNotFoundError where one
/// is missing, RuntimeError on the ranks that saw them all.
fn check_inputs(world: &Comm, config: &JobConfig) -> Result<(), Failure> {
    let missing = config.frames.iter().find_map(|r| {
        [Some(&r.input), Some(&r.psf), r.fibermap.as_ref()]
            .into_iter()
            .flatten()
            .find_map(|path| {
                std::fs::metadata(path)
                    .err()
                    .map(|e| std::io::Error::new(e.kind(), format!("{}: {e}", path.display())))
            })
    });
    let anywhere = world.all_max(u64::from(missing.is_some())) > 0;
    match missing {
        Some(e) => Err(Failure::Io(e)),
        None if anywhere => Err(Failure::Frames(
            "spex: error: another rank cannot read an input of the job".into(),
        )),
        None => Ok(()),
    }
}

/// Every rank's captured lines, joined in rank order, on every rank.
fn shared_lines(world: &Comm, mine: Vec<String>) -> String {
    let joined = mine.join("\n");
    let mut all = match world.gather_bytes(0, joined.as_bytes()) {
        Ok(Some(parts)) => parts
            .into_iter()
            .filter(|p| !p.is_empty())
            .map(|p| String::from_utf8_lossy(&p).into_owned())
            .collect::<Vec<_>>()
            .join("\n")
            .into_bytes(),
        _ => Vec::new(),
    };
    if world.broadcast_bytes(0, &mut all).is_err() {
        return joined;
    }
    String::from_utf8_lossy(&all).into_owned()
}

fn lock(m: &Mutex<bool>) -> MutexGuard<'_, bool> {
    m.lock().unwrap_or_else(PoisonError::into_inner)
}
