//! A frame group of one rank under `--async-io`: the rank overlaps the phases of its frames
//! on threads of its own instead of dedicated reader and writer ranks.
//!
//! Reader threads read the next frames while solver threads, one per backend, solve the
//! frames before them, and writer threads stitch and write each frame as soon as it is
//! solved. A rank may drive several GPUs (all those of the node when it is the node's only
//! extracting rank) and hold several backends per GPU (`--frames-in-flight`): frames go to
//! whichever backend is free, and there are several readers and writers per GPU
//! (`--io-threads`), so that one process can keep a whole node busy: a GPU solves a frame
//! faster than one thread reads or writes it. Nothing is sent between processes: no MPS, broadcasts or
//! gathers. The readers start before the devices open (opening four GPUs in one process
//! took 1.0-1.5 s on a 4 x H100 node, as long as a reader takes for its first two frames);
//! those added for compressed preprocs start once they are open ([`later_readers`]). A rank's
//! GPUs open one after another, and each takes frames as soon as it is open.
//!
//! Errors follow the protocol of the collective loop: a frame that cannot be read or solved
//! is reported on one line, counted and skipped, and the other frames go on.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::mpsc::{sync_channel, Receiver, SyncSender};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Instant;

use super::devices::{join_opener, Later, Opened};
use super::messages::Contribution;
use super::phases::{commit_now, solve_share, write_frame, Outcome, Share};
use super::{print_line, FrameCheck};
use crate::backend::{Backend, Progress};
use crate::error::Result;
use crate::frame::FrameValues;
use crate::pipeline::{self, read_frame, ExtractRequest, Inputs, PixelBox};

/// A frame as read, on its way to a solver.
struct Read<'a> {
    /// Index of the frame in the list.
    k: usize,
    request: &'a ExtractRequest,
    read: Result<(Inputs, PixelBox)>,
    /// The frame's arrays, cleared by the reader ([`pipeline::frame_values`]).
    values: Option<FrameValues>,
    read_s: f64,
}

/// A frame as solved (`None`: it failed and its error was reported), on its way to a writer.
struct Solved<'a> {
    request: &'a ExtractRequest,
    solved: Option<(Inputs, Contribution)>,
    read_s: f64,
}

/// A queue that several threads take from; once every taker is gone, even by a panic, the
/// senders find it closed and stop instead of waiting forever.
type Shared<T> = Arc<Mutex<Receiver<T>>>;

/// How many frames wait read and how many threads read and write them.
pub(super) struct Lanes {
    /// The GPUs the rank is to drive (0: the CPU), which size the readers before the
    /// backends open; as many frames wait read for the solvers (one on the CPU).
    pub gpus: usize,
    /// Readers, and as many writers, per device (`None`: [`default_io_threads`]).
    pub io_threads: Option<usize>,
    /// Cores of this rank (its share of the node), which size the readers and writers.
    pub cores: usize,
    /// The frames the backends take first (one per backend), which the readers read with
    /// every thread of rayon's pool; see [`read_all`].
    pub first: usize,
}

/// Readers (and as many writers) of a rank by default. On the CPU the solve is the slow part
/// and one of each per backend is enough. A GPU solves a full frame in about 60 ms while one
/// thread takes 0.5-0.7 s to read its `.fits.gz` preproc (inflated on one core), so some ten
/// readers keep one GPU fed: the readers take half the rank's cores (its share of the node,
/// not the threads of rayon's pool), up to 16 per GPU and at least three. On a 4 x H200 node
/// of 64 cores, with 32 readers for its 4 GPUs the loop over 30 frames (from the devices ready
/// to the last frame written) took 1.23-1.55 s against 1.64-2.52 s with 16. A writer mostly
/// waits for the parallel deflate of its frame (on the pool), so as many writers as readers
/// cost little.
fn default_io_threads(gpu: bool, devices: usize, cores: usize) -> usize {
    let devices = devices.max(1);
    if gpu {
        (3 * devices).max((cores / 2).min(16 * devices))
    } else {
        devices
    }
}

/// Readers (and as many writers) for `frames` frames: `--io-threads` per device, else
/// [`default_io_threads`]; no more than the frames.
fn io_threads(lanes: &Lanes, frames: usize) -> usize {
    match lanes.io_threads {
        Some(per_device) => lanes.gpus.max(1) * per_device,
        None => default_io_threads(lanes.gpus > 0, lanes.gpus, lanes.cores),
    }
    .min(frames)
    .max(1)
}

/// Readers started once the backends are ready, on top of the `readers` that read from the
/// start: half as many more for a rank's gzip-compressed preprocs on GPUs, each of which its
/// reader inflates on one core in about three times a plain preproc's read, unless
/// `--io-threads` set the readers. Started with the others, they slowed the GPU's start
/// (30 full r frames in desi_proc's form on one H200 machine of 16 cores, two calls: wall
/// 3.27-3.49 s with 4 such readers against 3.41-3.74 s without; docs/benchmarks.md).
fn later_readers(lanes: &Lanes, frames: &[(usize, &ExtractRequest)], readers: usize) -> usize {
    let compressed = frames
        .first()
        .is_some_and(|(_, request)| crate::fits::is_gzip(&request.input));
    if lanes.gpus == 0 || lanes.io_threads.is_some() || !compressed {
        return 0;
    }
    (readers / 2).min(frames.len().saturating_sub(readers))
}

/// Reads, solves and writes `frames` (`(index in the list, request)`) on this rank alone.
/// `open` starts the backends (collectively with the other ranks; `None` stops the run)
/// while the readers read ahead; backends that open later join as they do. Returns what was
/// written and what failed, or `None` when the backends did not open.
pub(super) fn run(
    frames: &[(usize, &ExtractRequest)],
    open: impl FnOnce() -> Option<Opened>,
    lanes: Lanes,
    rank: usize,
    prefix: &str,
    check: Option<&FrameCheck<'_>>,
    progress: Progress,
) -> Option<Outcome> {
    let next_frame = AtomicUsize::new(0);
    let (read_tx, read_rx) = sync_channel::<Read>(lanes.gpus.max(1));
    let read_rx = Arc::new(Mutex::new(read_rx));
    let next_frame = &next_frame;
    let io_threads = io_threads(&lanes, frames.len());
    std::thread::scope(|scope| {
        let spawn_readers = |numbers: std::ops::Range<usize>| {
            for i in numbers {
                let tx = read_tx.clone();
                spawn_named(scope, format!("spex-read-{i}"), move || {
                    read_all(frames, next_frame, tx, lanes.first)
                });
            }
        };
        spawn_readers(0..io_threads);
        let Some(Opened { now, later }) = open() else {
            drop(read_rx);
            return None;
        };
        let later_readers = later_readers(&lanes, frames, io_threads);
        spawn_readers(io_threads..io_threads + later_readers);
        drop(read_tx);
        tracing::info!(
            "rank {rank}: {} reader and {io_threads} writer threads",
            io_threads + later_readers
        );

        let (solved_tx, solved_rx) = sync_channel::<Solved>(lanes.first.max(now.len()));
        let solvers = Solvers {
            read_rx,
            solved_tx,
            rank,
            prefix,
        };
        // The progress display follows the first solver's frames.
        let ready = now.len();
        solvers.spawn(scope, now, 0, progress);
        let unread =
            scope.spawn(move || solvers.join_later(scope, later, ready, frames, next_frame));

        let solved_rx: Shared<Solved> = Arc::new(Mutex::new(solved_rx));
        let writers: Vec<_> = (0..io_threads)
            .map(|i| {
                let solved_rx = solved_rx.clone();
                spawn_named(scope, format!("spex-write-{i}"), move || {
                    write_all(&solved_rx, rank, prefix, check)
                })
            })
            .collect();
        drop(solved_rx);
        let mut outcome = Outcome::default();
        for w in writers {
            outcome.add(joined(w));
        }
        // Frames left unread because a GPU that had to open did not are failed frames.
        outcome.failed += joined(unread);
        Some(outcome)
    })
}

/// What a thread of the scope returned; its panic, if it panicked, goes on in the caller
/// (the scope raises only the panics of threads nobody joined).
fn joined<T>(thread: std::thread::ScopedJoinHandle<'_, T>) -> T {
    thread
        .join()
        .unwrap_or_else(|panic| std::panic::resume_unwind(panic))
}

/// What a solver thread takes frames from and hands them to.
struct Solvers<'a> {
    read_rx: Shared<Read<'a>>,
    solved_tx: SyncSender<Solved<'a>>,
    rank: usize,
    prefix: &'a str,
}

impl<'a> Solvers<'a> {
    /// Starts a solver thread for each of `backends`, numbered from `first`; the first one
    /// shows `progress`.
    fn spawn<'scope>(
        &self,
        scope: &'scope std::thread::Scope<'scope, '_>,
        backends: Vec<Box<dyn Backend>>,
        first: usize,
        progress: Progress,
    ) where
        'a: 'scope,
    {
        let mut progress = Some(progress);
        for (i, mut backend) in backends.into_iter().enumerate() {
            let (read_rx, solved_tx) = (self.read_rx.clone(), self.solved_tx.clone());
            let (rank, prefix) = (self.rank, self.prefix);
            let shown = progress.take().unwrap_or_else(Progress::silent);
            spawn_named(scope, format!("spex-solve-{}", first + i), move || {
                solve_all(&read_rx, &solved_tx, backend.as_mut(), rank, prefix, &shown);
                let t0 = Instant::now();
                drop(backend);
                tracing::debug!("backend released in {:.3} s", t0.elapsed().as_secs_f64());
            });
        }
    }

    /// Starts solvers for the backends of `later` as their GPUs open, until they all have
    /// (so the run lasts until then), numbered after the `ready` ones. A GPU that had to
    /// open and did not stops the readers: the frames not yet read are not extracted, and
    /// their count is returned.
    fn join_later<'scope>(
        self,
        scope: &'scope std::thread::Scope<'scope, '_>,
        later: Option<Later>,
        ready: usize,
        frames: &[(usize, &ExtractRequest)],
        next_frame: &AtomicUsize,
    ) -> usize
    where
        'a: 'scope,
    {
        let Some(later) = later else {
            return 0;
        };
        let t0 = Instant::now();
        let mut numbered = ready;
        let mut unread = 0;
        for (device, opened) in later.opening {
            match opened {
                Ok(backends) => {
                    tracing::debug!(
                        "cuda:{device} takes frames {:.2} s after the first GPU",
                        t0.elapsed().as_secs_f64()
                    );
                    let n = backends.len();
                    self.spawn(scope, backends, numbered, Progress::silent());
                    numbered += n;
                }
                Err(e) if later.required => {
                    print_line(&format!(
                        "{} cannot start the backend on CUDA device {device}: {e}; the frames \
                         not yet read are not extracted",
                        self.prefix
                    ));
                    let taken = next_frame.swap(STOPPED, Ordering::Relaxed);
                    unread += frames.len().saturating_sub(taken);
                }
                Err(e) => tracing::warn!(
                    "CUDA device {device} did not start ({e}); the other GPUs take its frames"
                ),
            }
        }
        join_opener(later.opener);
        unread
    }
}

/// The readers' next index once the frames are no longer read: beyond any list, and far
/// from overflowing however many readers still add to it.
const STOPPED: usize = usize::MAX / 2;

/// Solves the frames of `read_rx` on `backend` and hands them to the writers, until none
/// are left or no writer takes them any more.
fn solve_all<'a>(
    read_rx: &Mutex<Receiver<Read<'a>>>,
    solved_tx: &SyncSender<Solved<'a>>,
    backend: &mut dyn Backend,
    rank: usize,
    prefix: &str,
    shown: &Progress,
) {
    let mut idle_since = Instant::now();
    while let Some(frame) = take(read_rx) {
        let (k, taken) = (frame.k, Instant::now());
        let solved = solve(frame, backend, rank, prefix, shown);
        let done = Instant::now();
        if solved_tx.send(solved).is_err() {
            break;
        }
        // Which lane bounds the rate: a solver that waits for readers, or for writers, or
        // neither.
        tracing::debug!(
            "frame {k}: its solver waited {:.1} ms for it, solved it in {:.1} ms and handed \
             it to a writer in {:.1} ms",
            ms(taken - idle_since),
            ms(done - taken),
            ms(done.elapsed())
        );
        idle_since = Instant::now();
    }
}

/// Starts a thread of the scope under `name`, which the system's tools show (e.g. the CPU
/// time of each lane in `/proc/PID/task`); panics where `scope.spawn` would, when no thread
/// can be started.
fn spawn_named<'scope, T: Send + 'scope>(
    scope: &'scope std::thread::Scope<'scope, '_>,
    name: String,
    f: impl FnOnce() -> T + Send + 'scope,
) -> std::thread::ScopedJoinHandle<'scope, T> {
    std::thread::Builder::new()
        .name(name)
        .spawn_scoped(scope, f)
        .expect("cannot start a thread")
}

/// Reads frames, taking the next index from `next` (shared by the readers), until none are
/// left or nobody takes them any more.
///
/// The `first` frames, which the backends wait for, are read with every thread of rayon's
/// pool. The later ones are read ahead while the backends solve, each on its reader's thread
/// alone: fanned out over the pool, the readers' bursts took the cores from the backends'
/// host work, whose waves then reached the device late (30 full r frames on one H200
/// machine of 16 cores: loop 1.66-1.69 s against 1.78-1.86 s, docs/benchmarks.md).
fn read_all<'a>(
    frames: &[(usize, &'a ExtractRequest)],
    next: &AtomicUsize,
    read_tx: SyncSender<Read<'a>>,
    first: usize,
) {
    // a rank with no frame to read ahead (a single-frame run) starts no thread for it
    let alone = (frames.len() > first).then(one_thread).flatten();
    loop {
        let i = next.fetch_add(1, Ordering::Relaxed);
        let Some(&(k, request)) = frames.get(i) else {
            break;
        };
        let t0 = Instant::now();
        let read_one = || {
            let read = read_frame(request);
            let read_s = t0.elapsed().as_secs_f64();
            let values = read
                .as_ref()
                .ok()
                .and_then(|(inputs, _)| pipeline::frame_values(request, inputs));
            (read, read_s, values)
        };
        let (read, read_s, values) = on_lane(alone.as_ref(), i >= first, read_one);
        let frame = Read {
            k,
            request,
            read,
            values,
            read_s,
        };
        let read_at = Instant::now();
        if read_tx.send(frame).is_err() {
            break;
        }
        tracing::debug!(
            "frame {k}: read in {:.1} ms, waited {:.1} ms for a solver",
            ms(read_at - t0),
            ms(read_at.elapsed())
        );
    }
}

/// Runs `work` on `alone` when it reads ahead, else where called (rayon's pool).
fn on_lane<T: Send>(
    alone: Option<&rayon::ThreadPool>,
    ahead: bool,
    work: impl FnOnce() -> T + Send,
) -> T {
    match alone {
        Some(pool) if ahead => pool.install(work),
        _ => work(),
    }
}

/// A pool of the calling thread's own, of one thread, on which rayon's parallel loops run
/// in turn; `None` (rayon's pool, then) when no thread can be started.
fn one_thread() -> Option<rayon::ThreadPool> {
    let name = std::thread::current().name().unwrap_or("spex").to_owned();
    rayon::ThreadPoolBuilder::new()
        .num_threads(1)
        .thread_name(move |_| format!("{name}-alone"))
        .build()
        .inspect_err(|e| tracing::debug!("a reader reads on rayon's pool: {e}"))
        .ok()
}

/// The next item of a shared queue, for whichever thread asks first; `None` once it is empty
/// and closed.
fn take<T>(queue: &Mutex<Receiver<T>>) -> Option<T> {
    queue
        .lock()
        .unwrap_or_else(PoisonError::into_inner)
        .recv()
        .ok()
}

/// Writes solved frames until none are left; counts what was written and what failed.
fn write_all(
    solved: &Mutex<Receiver<Solved<'_>>>,
    rank: usize,
    prefix: &str,
    check: Option<&FrameCheck<'_>>,
) -> Outcome {
    let mut outcome = Outcome::default();
    let mut idle_since = Instant::now();
    while let Some(frame) = take(solved) {
        tracing::debug!(
            "a writer waited {:.1} ms for a solved frame",
            ms(idle_since.elapsed())
        );
        let Some((inputs, contribution)) = frame.solved else {
            outcome.failed += 1;
            idle_since = Instant::now();
            continue;
        };
        let staged = write_frame(
            frame.request,
            Some(inputs),
            frame.read_s,
            vec![(rank, contribution)],
            None,
            check,
        );
        outcome.record(commit_now(staged), frame.request, prefix);
        idle_since = Instant::now();
    }
    outcome
}

/// Milliseconds of a duration, for the log.
fn ms(d: std::time::Duration) -> f64 {
    d.as_secs_f64() * 1e3
}

/// Solves a whole frame on `backend`, reporting a failure to read or to solve it.
fn solve<'a>(
    frame: Read<'a>,
    backend: &mut dyn Backend,
    rank: usize,
    prefix: &str,
    progress: &Progress,
) -> Solved<'a> {
    let Read {
        k,
        request,
        read,
        values,
        read_s,
    } = frame;
    let failed = |e: &dyn std::fmt::Display| {
        print_line(&format!("{prefix} frame {}: {e}", request.input.display()));
        Solved {
            request,
            solved: None,
            read_s,
        }
    };
    let inputs = match read {
        Ok((inputs, _)) => inputs,
        Err(e) => return failed(&e),
    };
    let share = Share {
        worker: 0,
        nworkers: 1,
        frame: k,
        rank,
    };
    let t0 = Instant::now();
    match solve_share(request, &inputs, backend, &share, progress, false, values) {
        Ok((results, placed)) => Solved {
            request,
            solved: Some((
                inputs,
                Contribution::Solved {
                    header: None,
                    results,
                    placed: placed.map(Box::new),
                    recv_s: 0.0,
                    solve_s: t0.elapsed().as_secs_f64(),
                },
            )),
            read_s,
        },
        Err(e) => failed(&e),
    }
}

#[cfg(test)]
mod tests {
    use super::{
        default_io_threads, io_threads, later_readers, on_lane, one_thread, run, Lanes, Outcome,
    };
    use crate::backend::{self, Backend, BackendKind, Progress};
    use crate::error::{Error, Result};
    use crate::parallel::devices::{Later, Opened};
    use crate::parallel::FrameCheck;
    use crate::pipeline::ExtractRequest;
    use std::path::Path;

    /// `n` extractions of fibers 0-24 of the bundled preproc 0 (a small grid), into `dir`.
    fn bundle_frames(dir: &Path, n: usize) -> Vec<ExtractRequest> {
        let data = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/data");
        (0..n)
            .map(|k| {
                let mut r = ExtractRequest::new(
                    data.join("preproc-bundle0.fits"),
                    data.join("psf-r0-00067784.fits"),
                    dir.join(format!("frame-{k}.fits")),
                );
                r.wavelength = Some((6000.0, 6100.0, 0.8));
                r.nspec = Some(25);
                r
            })
            .collect()
    }

    fn cpu_backend() -> Vec<Box<dyn Backend>> {
        vec![backend::create(BackendKind::Cpu, 1, 0).expect("a CPU backend")]
    }

    /// Runs `requests` with `now` backends and `later` ones, as a rank of one GPU would.
    fn run_with(
        requests: &[ExtractRequest],
        now: Vec<Box<dyn Backend>>,
        later: Vec<Result<Vec<Box<dyn Backend>>>>,
        required: bool,
    ) -> Outcome {
        run_checked(requests, now, later, required, None)
    }

    /// [`run_with`], each frame written passed to `check`.
    fn run_checked(
        requests: &[ExtractRequest],
        now: Vec<Box<dyn Backend>>,
        later: Vec<Result<Vec<Box<dyn Backend>>>>,
        required: bool,
        check: Option<&FrameCheck<'_>>,
    ) -> Outcome {
        let (tx, opening) = std::sync::mpsc::channel();
        for (d, opened) in later.into_iter().enumerate() {
            tx.send((d + 1, opened)).expect("queued");
        }
        drop(tx);
        let later = Later {
            opening,
            required,
            opener: std::thread::spawn(|| ()),
        };
        let frames: Vec<_> = requests.iter().enumerate().collect();
        let lanes = Lanes {
            gpus: 1,
            io_threads: Some(1),
            cores: 2,
            first: 1,
        };
        let open = || {
            Some(Opened {
                now,
                later: Some(later),
            })
        };
        run(&frames, open, lanes, 0, "test:", check, Progress::silent()).expect("backends")
    }

    #[test]
    fn readers_follow_the_cores_of_a_gpu_rank() {
        // one process on a 4-GPU node of 64 cores, and a rank per GPU of 16 cores each
        assert_eq!(default_io_threads(true, 4, 64), 32);
        assert_eq!(default_io_threads(true, 1, 16), 8);
        // one GPU of that node: no more than 16
        assert_eq!(default_io_threads(true, 1, 64), 16);
        // never fewer than three per GPU, as before, on a rank with few cores
        assert_eq!(default_io_threads(true, 1, 2), 3);
        assert_eq!(default_io_threads(true, 2, 4), 6);
        // on the CPU one per backend's device, whatever the cores
        assert_eq!(default_io_threads(false, 1, 64), 1);
        assert_eq!(default_io_threads(false, 0, 64), 1);
    }

    #[test]
    fn frames_read_ahead_are_read_on_one_thread() {
        let pool = rayon::ThreadPoolBuilder::new()
            .num_threads(4)
            .build()
            .expect("a pool");
        let alone = one_thread().expect("a thread of its own");
        let threads =
            |ahead| pool.install(|| on_lane(Some(&alone), ahead, rayon::current_num_threads));
        assert_eq!(threads(false), 4);
        assert_eq!(threads(true), 1);
        // without a thread of its own, a reader reads on the pool
        assert_eq!(
            pool.install(|| on_lane(None, true, rayon::current_num_threads)),
            4
        );
    }

    #[test]
    fn compressed_preprocs_get_readers_once_the_gpus_are_ready() {
        let dir = tempfile::tempdir().expect("a directory");
        let gz = dir.path().join("preproc.fits.gz");
        let plain = dir.path().join("preproc.fits");
        std::fs::write(&gz, [0x1f, 0x8b, 8, 0]).expect("a gzip file");
        std::fs::write(&plain, b"SIMPLE  =").expect("a FITS file");
        let lanes = |gpus, io_threads| Lanes {
            gpus,
            io_threads,
            cores: 16,
            first: 2,
        };
        let (gz, plain) = (
            ExtractRequest::new(&gz, "psf.fits", "frame.fits.gz"),
            ExtractRequest::new(&plain, "psf.fits", "frame.fits"),
        );
        let list = |request, n| vec![(0, request); n];
        // half as many more on a GPU, for gzip-compressed preprocs only
        assert_eq!(later_readers(&lanes(1, None), &list(&gz, 30), 8), 4);
        assert_eq!(later_readers(&lanes(1, None), &list(&plain, 30), 8), 0);
        // never on the CPU, nor where --io-threads set the readers
        assert_eq!(later_readers(&lanes(0, None), &list(&gz, 30), 1), 0);
        assert_eq!(later_readers(&lanes(1, Some(8)), &list(&gz, 30), 8), 0);
        // no more readers than frames
        assert_eq!(later_readers(&lanes(1, None), &list(&gz, 10), 8), 2);
        assert_eq!(later_readers(&lanes(1, None), &list(&gz, 5), 5), 0);
    }

    #[test]
    fn readers_are_sized_before_the_devices_open() {
        let lanes = |gpus, io_threads| Lanes {
            gpus,
            io_threads,
            cores: 64,
            first: 1,
        };
        // from the GPUs to be driven, known before any backend starts
        assert_eq!(io_threads(&lanes(4, None), 100), 32);
        assert_eq!(io_threads(&lanes(0, None), 100), 1);
        assert_eq!(io_threads(&lanes(4, Some(2)), 100), 8);
        assert_eq!(io_threads(&lanes(0, Some(3)), 100), 3);
        // never more than the frames, never none
        assert_eq!(io_threads(&lanes(4, None), 5), 5);
        assert_eq!(io_threads(&lanes(1, None), 0), 1);
    }

    #[test]
    fn backends_that_open_later_take_frames() {
        // no backend at first: every frame waits for the one that opens later
        let dir = tempfile::tempdir().expect("a directory");
        let requests = bundle_frames(dir.path(), 3);
        let outcome = run_with(&requests, Vec::new(), vec![Ok(cpu_backend())], true);
        assert_eq!((outcome.written, outcome.failed), (3, 0));
        assert!(requests.iter().all(|r| r.output.exists()));
    }

    #[test]
    fn a_gpu_that_was_not_required_leaves_its_frames_to_the_others() {
        let dir = tempfile::tempdir().expect("a directory");
        let requests = bundle_frames(dir.path(), 3);
        let failed = Err(Error::Gpu("the device is lost".into()));
        let outcome = run_with(&requests, cpu_backend(), vec![failed], false);
        assert_eq!((outcome.written, outcome.failed), (3, 0));
    }

    #[test]
    fn a_required_gpu_that_does_not_open_stops_the_reading() {
        let dir = tempfile::tempdir().expect("a directory");
        let requests = bundle_frames(dir.path(), 8);
        crate::parallel::capture_lines();
        let failed = Err(Error::Gpu("the device is lost".into()));
        let outcome = run_with(&requests, cpu_backend(), vec![failed], true);
        let lines = crate::parallel::take_captured_lines();
        // The frames read before it failed are written; one reader, one frame waiting and
        // one being solved stop the reading within three frames, long before the eighth.
        assert_eq!(outcome.written + outcome.failed, 8);
        assert!(outcome.failed >= 1, "{outcome:?}");
        let written = requests.iter().filter(|r| r.output.exists()).count();
        assert_eq!(written, outcome.written);
        assert!(
            lines
                .iter()
                .any(|l| l.contains("CUDA device 1") && l.contains("the device is lost")),
            "{lines:?}"
        );
    }

    #[test]
    #[should_panic(expected = "a writer's check panics")]
    fn a_writer_that_panics_panics_the_run() {
        // joined by the run, its panic would be lost if the run did not raise it again
        let dir = tempfile::tempdir().expect("a directory");
        let requests = bundle_frames(dir.path(), 2);
        let check = |_: &ExtractRequest, _: &crate::frame::Frame| -> Result<bool> {
            panic!("a writer's check panics")
        };
        run_checked(&requests, cpu_backend(), Vec::new(), true, Some(&check));
    }
}
