//! MPI runs and interrupted writes: ranks that disagree on their configuration stop with one
//! line, paths that are not UTF-8 work, and a run stopped during its write (a signal to the
//! launcher, to a rank, or to a `--list` run) exits non-zero with the old outputs intact and
//! no temporary left.
//!
//! The interrupted runs are held at a known point: `SPEX_TEST_HOLD_COMMIT=MARKER` makes spex
//! create MARKER once a frame's files are written under their temporary names, and wait
//! until the test removes it. The test sends its signal while the run is held, so nothing
//! depends on the speed of the machine.

use std::ffi::OsString;
use std::os::unix::ffi::OsStringExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use super::*;

/// The launcher line of these cases (as `run` builds it). Open MPI kills a rank that is
/// still alive one second after its SIGTERM; on a machine whose cores are all busy the
/// rank's signal thread may not have run by then, so the cases give it ten.
fn mpiexec(ranks: usize) -> Command {
    let mut c = crate::common::mpiexec(ranks);
    c.args(["--mca", "odls_base_sigkill_timeout", "10"]);
    c
}

/// A run started in the background whose commits are held (see the module's comment).
struct Held {
    child: Child,
    stderr: std::thread::JoinHandle<String>,
    marker: PathBuf,
    _markers: tempfile::TempDir,
    /// The ranks under the launcher, seen while the run was held.
    ranks: Vec<i32>,
    launched: Option<usize>,
}

impl Held {
    /// Starts `spex args`, under `mpiexec -n ranks` when given.
    fn start(ranks: Option<usize>, args: &[OsString]) -> Held {
        let exe = env!("CARGO_BIN_EXE_spex");
        let mut cmd = match ranks {
            None => Command::new(exe),
            Some(n) => {
                let mut c = mpiexec(n);
                c.arg(exe);
                c
            }
        };
        let markers = tempfile::tempdir().unwrap();
        let marker = markers.path().join("held");
        let mut child = cmd
            .args(args)
            .env("SPEX_TEST_HOLD_COMMIT", &marker)
            .env_remove("SPEX_LOG")
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .expect("cannot start spex (or mpiexec)");
        let stderr = read_in_background(child.stderr.take().unwrap());
        Held {
            child,
            stderr,
            marker,
            _markers: markers,
            ranks: Vec::new(),
            launched: ranks,
        }
    }

    /// Waits until the run holds the files of `target` written under temporary names.
    fn wait_for(&mut self, target: &Path) {
        let t0 = Instant::now();
        let name = target.display().to_string();
        while std::fs::read_to_string(&self.marker).ok().as_deref() != Some(&name) {
            assert!(
                self.child.try_wait().unwrap().is_none(),
                "spex ended before writing {name}"
            );
            assert!(t0.elapsed() < TIMEOUT, "{name} was never written");
            std::thread::sleep(Duration::from_millis(5));
        }
        if let Some(n) = self.launched {
            self.ranks = (0..n).map(|r| self.rank_pid(r)).collect();
        }
    }

    /// Lets the held commit go on.
    fn release(&self) {
        std::fs::remove_file(&self.marker).unwrap();
    }

    /// Sends `signal` to the launcher (or the single process).
    fn signal(&self, signal: i32) {
        // SAFETY: sends a signal to a child process of this test.
        assert_eq!(unsafe { libc::kill(self.child.id() as i32, signal) }, 0);
    }

    /// The process id of rank `rank`, a child of the launcher (Open MPI starts the ranks of
    /// its own node itself and gives each its rank in the environment).
    fn rank_pid(&self, rank: usize) -> i32 {
        let launcher = self.child.id().to_string();
        let tag = format!("OMPI_COMM_WORLD_RANK={rank}");
        for entry in std::fs::read_dir("/proc").unwrap().flatten() {
            let Ok(pid) = entry.file_name().to_string_lossy().parse::<i32>() else {
                continue;
            };
            let stat = std::fs::read_to_string(entry.path().join("stat")).unwrap_or_default();
            // pid (comm) state ppid ...: the fields after the last ')'
            let ppid = stat
                .rsplit_once(')')
                .and_then(|(_, rest)| rest.split_whitespace().nth(1).map(str::to_string));
            if ppid.as_deref() != Some(launcher.as_str()) {
                continue;
            }
            let env = std::fs::read(entry.path().join("environ")).unwrap_or_default();
            if env.split(|&b| b == 0).any(|v| v == tag.as_bytes()) {
                return pid;
            }
        }
        panic!("no process of rank {rank} under the launcher {launcher}")
    }

    /// Sends `signal` to rank `rank` and waits until it is gone.
    fn signal_rank(&self, rank: usize, signal: i32) {
        let pid = self.rank_pid(rank);
        // SAFETY: sends a signal to a rank of this test's own job.
        assert_eq!(unsafe { libc::kill(pid, signal) }, 0);
        wait_gone(pid);
    }

    /// Waits for the end of the run.
    fn finish(mut self) -> Outcome {
        let t0 = Instant::now();
        let status = loop {
            if let Some(s) = self.child.try_wait().unwrap() {
                break s;
            }
            if t0.elapsed() > TIMEOUT {
                let _ = self.child.kill();
                panic!("the interrupted run did not end in {TIMEOUT:?}");
            }
            std::thread::sleep(Duration::from_millis(20));
        };
        // The launcher may end before its ranks have cleaned up.
        self.ranks.iter().for_each(|&pid| wait_gone(pid));
        Outcome {
            code: status.code(),
            stderr: self.stderr.join().unwrap(),
            launched: self.launched.is_some(),
        }
    }
}

/// Waits until process `pid` has ended (gone, or a zombie).
fn wait_gone(pid: i32) {
    let t0 = Instant::now();
    let stat = format!("/proc/{pid}/stat");
    let alive = || {
        std::fs::read_to_string(&stat).is_ok_and(|s| {
            s.rsplit_once(')')
                .is_some_and(|(_, rest)| !rest.trim_start().starts_with('Z'))
        })
    };
    while alive() {
        assert!(t0.elapsed() < TIMEOUT, "process {pid} did not end");
        std::thread::sleep(Duration::from_millis(5));
    }
}

/// A case with an input, a PSF, and an old frame and model that an interrupted run must
/// leave as they were; the arguments of its extraction.
fn with_old_outputs() -> (Case, Vec<OsString>) {
    let mut c = Case::new();
    let (input, psf) = (c.copy(IMAGE, "in.fits"), c.copy(PSF, "psf.fits"));
    std::fs::write(c.path("f.fits"), b"previous frame").unwrap();
    std::fs::write(c.path("m.fits"), b"previous model").unwrap();
    c.seal();
    let mut a = args![
        "-i",
        &input,
        "-p",
        &psf,
        "-o",
        c.path("f.fits"),
        "-m",
        c.path("m.fits")
    ];
    a.extend(options());
    (c, a)
}

/// A run that a signal stopped: non-zero, no panic text, and every file of the case as it
/// was (the old outputs intact, no temporary left).
fn assert_stopped(o: &Outcome, c: &Case) {
    assert!(
        !matches!(o.code, Some(0)),
        "the interrupted run exited 0:\n{}",
        o.stderr
    );
    assert!(!o.stderr.contains("panicked"), "{}", o.stderr);
    c.unchanged_except(&[]);
}

#[test]
fn sigterm_or_sigint_to_mpiexec_during_the_write_keeps_the_old_files() {
    for signal in [libc::SIGTERM, libc::SIGINT] {
        let (c, a) = with_old_outputs();
        let mut run = Held::start(Some(2), &a);
        run.wait_for(&c.path("f.fits"));
        run.signal(signal);
        let o = run.finish();
        assert_stopped(&o, &c);
    }
}

/// The writer is released at once after the other rank died: it must not commit, since no
/// rank answered after its write. (Before the agreement it committed before the launcher's
/// kill reached it.)
#[test]
fn a_rank_killed_or_terminated_during_the_write_keeps_the_old_files() {
    for signal in [libc::SIGKILL, libc::SIGTERM] {
        let (c, a) = with_old_outputs();
        let mut run = Held::start(Some(2), &a);
        run.wait_for(&c.path("f.fits"));
        run.signal_rank(1, signal);
        run.release();
        let o = run.finish();
        assert_stopped(&o, &c);
    }
}

/// Under `--async-io` a dedicated writer (rank 1 of 4) holds the frame; a worker dies.
#[test]
fn a_worker_killed_while_a_dedicated_writer_writes_keeps_the_old_files() {
    let (c, mut a) = with_old_outputs();
    a.push("--async-io".into());
    let mut run = Held::start(Some(4), &a);
    run.wait_for(&c.path("f.fits"));
    run.signal_rank(3, libc::SIGKILL);
    run.release();
    let o = run.finish();
    assert_stopped(&o, &c);
}

#[test]
fn a_held_mpi_run_that_is_released_commits_its_files() {
    let (c, a) = with_old_outputs();
    let mut run = Held::start(Some(2), &a);
    run.wait_for(&c.path("f.fits"));
    assert_eq!(
        std::fs::read(c.path("f.fits")).unwrap(),
        b"previous frame",
        "committed before the agreement"
    );
    run.release();
    let o = run.finish();
    expect(&o, 0, &[]);
    let frame = Frame::read(&c.path("f.fits")).unwrap();
    assert_eq!((frame.nspec, frame.wave.len()), (25, 51));
    assert_ne!(std::fs::read(c.path("m.fits")).unwrap(), b"previous model");
}

/// A `--list` of three frames: the first is committed, the run is stopped while the second
/// is held; the first frame is new, the second old, the third never written.
fn interrupted_list(ranks: Option<usize>, stop: impl FnOnce(&Held)) -> Outcome {
    let mut c = Case::new();
    let (input, psf) = (c.copy(IMAGE, "in.fits"), c.copy(PSF, "psf.fits"));
    std::fs::write(c.path("f2.fits"), b"previous frame").unwrap();
    let list = c.path("frames.txt");
    let line = |out: &str| format!("{} {} {}\n", input.display(), psf.display(), out);
    let text: String = ["f1.fits", "f2.fits", "f3.fits"]
        .iter()
        .map(|o| line(&c.path(o).display().to_string()))
        .collect();
    std::fs::write(&list, text).unwrap();
    c.seal();
    let mut a = args!["--list", &list];
    a.extend(options());
    let mut run = Held::start(ranks, &a);
    run.wait_for(&c.path("f1.fits"));
    run.release();
    run.wait_for(&c.path("f2.fits"));
    stop(&run);
    let o = run.finish();
    assert!(!matches!(o.code, Some(0)), "exited 0:\n{}", o.stderr);
    assert!(!o.stderr.contains("panicked"), "{}", o.stderr);
    c.unchanged_except(&["f1.fits"]);
    let frame = Frame::read(&c.path("f1.fits")).unwrap();
    assert_eq!(frame.nspec, 25);
    o
}

#[test]
fn sigterm_or_sigint_during_a_list_keeps_the_frame_being_written() {
    for (signal, name, code) in [
        (libc::SIGTERM, "SIGTERM", 143),
        (libc::SIGINT, "SIGINT", 130),
    ] {
        let o = interrupted_list(None, |run| run.signal(signal));
        expect(&o, code, &[name, "removed"]);
    }
}

#[test]
fn a_list_under_mpiexec_stopped_mid_write_keeps_the_frame_being_written() {
    interrupted_list(Some(2), |run| run.signal(libc::SIGTERM));
    interrupted_list(Some(2), |run| {
        run.signal_rank(1, libc::SIGTERM);
        run.release();
    });
}

/// Runs `spex` as two ranks of one job with their own arguments (`mpiexec A : B`).
fn two_ranks(rank0: &[OsString], rank1: &[OsString]) -> Outcome {
    let exe = env!("CARGO_BIN_EXE_spex");
    let mut cmd = mpiexec(1);
    cmd.arg(exe)
        .args(rank0)
        .args([":", "-n", "1", exe])
        .args(rank1);
    let out = cmd
        .env_remove("SPEX_LOG")
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .output()
        .expect("cannot start mpiexec");
    Outcome {
        code: out.status.code(),
        stderr: String::from_utf8_lossy(&out.stderr).into_owned(),
        launched: true,
    }
}

#[test]
fn a_list_missing_on_one_rank_stops_the_job_with_that_ranks_line() {
    let mut c = Case::new();
    let (input, psf) = (c.copy(IMAGE, "in.fits"), c.copy(PSF, "psf.fits"));
    let list = c.path("frames.txt");
    let line = format!(
        "{} {} {}\n",
        input.display(),
        psf.display(),
        c.path("f.fits").display()
    );
    std::fs::write(&list, line).unwrap();
    c.seal();
    let mut a = args!["--list", &list];
    a.extend(options());
    let mut b = args!["--list", c.path("missing.txt")];
    b.extend(options());
    let o = two_ranks(&a, &b);
    expect(&o, 1, &["rank 1", "missing.txt"]);
    assert!(!o.stderr.contains("MPI_ERR"), "{}", o.stderr);
    c.unchanged_except(&[]);
}

/// Two ranks given the same extraction, rank 1 with `extra` appended: the job must stop with
/// `status` and one line holding `needles`, in no MPI error and with no file changed.
fn ranks_differing_by(extra: Vec<OsString>, status: i32, needles: &[&str]) {
    let mut c = Case::new();
    let (input, psf) = (c.copy(IMAGE, "in.fits"), c.copy(PSF, "psf.fits"));
    c.seal();
    let mut a = args!["-i", &input, "-p", &psf, "-o", c.path("f.fits")];
    a.extend(options());
    let mut b = a.clone();
    b.extend(extra);
    let o = two_ranks(&a, &b);
    expect(&o, status, needles);
    assert!(!o.stderr.contains("MPI_ERR"), "{}", o.stderr);
    c.unchanged_except(&[]);
}

#[test]
fn a_usage_error_on_one_rank_stops_the_job_with_status_2() {
    ranks_differing_by(
        args!["--frame-groups", "3"],
        2,
        &["rank 1", "--frame-groups 3"],
    );
}

#[test]
fn ranks_given_different_command_lines_stop_before_any_work() {
    ranks_differing_by(args!["--async-io"], 2, &["rank 0", "same command line"]);
}

/// A name that is not UTF-8: Latin-1 bytes, as an old file system or archive may hold.
fn latin1(prefix: &str, suffix: &str) -> OsString {
    let mut bytes = prefix.as_bytes().to_vec();
    bytes.extend([0xe9, 0xff]);
    bytes.extend(suffix.as_bytes());
    OsString::from_vec(bytes)
}

#[test]
fn paths_that_are_not_utf8_work_alone_and_under_mpiexec() {
    for ranks in [None, Some(2)] {
        let mut c = Case::new();
        // The directory's own name is not UTF-8 either.
        let dir = c.dir.path().join(latin1("d", ""));
        std::fs::create_dir(&dir).unwrap();
        let input = dir.join(latin1("in", ".fits"));
        let psf = dir.join(latin1("psf", ".fits"));
        std::fs::copy(data(IMAGE), &input).unwrap();
        std::fs::copy(data(PSF), &psf).unwrap();
        c.seal();
        let (out, model) = (
            dir.join(latin1("f", ".fits")),
            dir.join(latin1("m", ".fits")),
        );
        let mut a = args!["-i", &input, "-p", &psf, "-o", &out, "-m", &model];
        a.extend(options());
        let o = run(ranks, &a, &[]);
        expect(&o, 0, &[]);
        let frame = Frame::read(&out).unwrap();
        assert_eq!((frame.nspec, frame.wave.len()), (25, 51), "{ranks:?}");
        let created: Vec<String> = [&out, &model]
            .iter()
            .map(|p| {
                let name = p.file_name().unwrap().to_string_lossy();
                format!("{}/{name}", dir.file_name().unwrap().to_string_lossy())
            })
            .collect();
        c.unchanged_except(&[&created[0], &created[1]]);
    }
}

#[test]
fn a_missing_input_that_is_not_utf8_is_named_in_its_lossy_form() {
    for ranks in [None, Some(2)] {
        let mut c = Case::new();
        let psf = c.copy(PSF, "psf.fits");
        c.seal();
        let input = c.dir.path().join(latin1("no", ".fits"));
        let mut a = args!["-i", &input, "-p", &psf, "-o", c.path("f.fits")];
        a.extend(options());
        let o = run(ranks, &a, &[]);
        expect(&o, 1, &["no\u{fffd}\u{fffd}.fits"]);
        c.unchanged_except(&[]);
    }
}
