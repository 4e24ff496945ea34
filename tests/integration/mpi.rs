//! Multi-rank runs of the `spex` binary under a real `mpiexec` (Open MPI) on the reference
//! data: the output is the same array for array for any number of ranks, with and without
//! dedicated I/O ranks, and failures end the job quickly, non-zero, with no output file.
//!
//! These tests need `mpiexec` on the PATH (Debian: `openmpi-bin`); without it they fail and
//! say so rather than pass silently. A spex built without the `mpi` feature has no multi-rank
//! runs to test.

use std::io::Read;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use crate::common::data;
use spex::frame::Frame;

/// Longest a run may take: a reference extraction takes a few seconds even on two busy cores;
/// a hang is what this catches.
const TIMEOUT: Duration = Duration::from_secs(120);
/// Longest a failing run may take before it exits.
const FAIL_FAST: Duration = Duration::from_secs(30);

/// The reference case of the tests: bundle 0, 25 fibers, 6000-6400 A, one thread per rank.
fn options() -> Vec<String> {
    [
        "-w",
        "6000,6400,0.8",
        "-s",
        "0",
        "-n",
        "25",
        "--threads",
        "1",
    ]
    .map(String::from)
    .to_vec()
}

fn single(input: &str, output: &Path) -> Vec<String> {
    let mut a = vec![
        "-i".to_string(),
        data(input).display().to_string(),
        "-p".into(),
        data("psf-r0-00067784.fits").display().to_string(),
        "-o".into(),
        output.display().to_string(),
    ];
    a.extend(options());
    a
}

/// How a run ended.
struct Run {
    code: Option<i32>,
    stderr: String,
    elapsed: Duration,
}

impl Run {
    fn ok(&self) -> bool {
        self.code == Some(0)
    }
}

/// Runs `spex` with `args` on `ranks` ranks under mpiexec (`None`: alone, without a launcher)
/// and kills it after `timeout`.
fn spex(ranks: Option<usize>, args: &[String], env: &[(&str, &str)], timeout: Duration) -> Run {
    let exe = env!("CARGO_BIN_EXE_spex");
    let mut cmd = match ranks {
        None => Command::new(exe),
        Some(n) => {
            let mut c = crate::common::mpiexec(n);
            c.arg(exe);
            c
        }
    };
    cmd.args(args)
        .envs(env.iter().copied())
        .env_remove("SPEX_LOG")
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::piped());
    let t0 = Instant::now();
    let mut child = cmd.spawn().expect("cannot start spex");
    let mut pipe = child.stderr.take().expect("stderr");
    let reader = std::thread::spawn(move || {
        let mut s = String::new();
        let _ = pipe.read_to_string(&mut s);
        s
    });
    let status = loop {
        if let Some(status) = child.try_wait().expect("wait") {
            break status;
        }
        if t0.elapsed() > timeout {
            // SIGTERM lets mpiexec take its ranks down with it.
            unsafe { libc::kill(child.id() as i32, libc::SIGTERM) };
            std::thread::sleep(Duration::from_secs(2));
            let _ = child.kill();
            let _ = child.wait();
            panic!(
                "spex {args:?} on {ranks:?} ranks did not finish within {timeout:?}:\n{}",
                reader.join().unwrap_or_default()
            );
        }
        std::thread::sleep(Duration::from_millis(20));
    };
    Run {
        code: status.code(),
        stderr: reader.join().unwrap_or_default(),
        elapsed: t0.elapsed(),
    }
}

fn assert_same_frames(a: &Path, b: &Path) {
    let fa = Frame::read(a).unwrap_or_else(|e| panic!("{}: {e}", a.display()));
    let fb = Frame::read(b).unwrap_or_else(|e| panic!("{}: {e}", b.display()));
    assert_eq!(
        fa.wave,
        fb.wave,
        "{} vs {}: WAVELENGTH",
        a.display(),
        b.display()
    );
    for (name, x, y) in [
        ("FLUX", fa.flux.view().into_dyn(), fb.flux.view().into_dyn()),
        ("IVAR", fa.ivar.view().into_dyn(), fb.ivar.view().into_dyn()),
        (
            "RESOLUTION",
            fa.resolution.view().into_dyn(),
            fb.resolution.view().into_dyn(),
        ),
        (
            "CHI2PIX",
            fa.chi2pix.view().into_dyn(),
            fb.chi2pix.view().into_dyn(),
        ),
    ] {
        let differ = x
            .iter()
            .zip(&y)
            .filter(|(p, q)| p.to_bits() != q.to_bits())
            .count();
        assert!(
            x.shape() == y.shape() && differ == 0,
            "{} vs {}: {name} differs in {differ} of {} values",
            a.display(),
            b.display(),
            x.len()
        );
    }
    assert_eq!(fa.mask, fb.mask, "{} vs {}: MASK", a.display(), b.display());
    assert_eq!(fa, fb);
}

/// Files left in a directory (temporary files included).
fn files_in(dir: &Path) -> Vec<String> {
    let mut v: Vec<String> = std::fs::read_dir(dir)
        .expect("read_dir")
        .map(|e| e.expect("entry").file_name().to_string_lossy().into_owned())
        .collect();
    v.sort();
    v
}

#[test]
fn one_to_four_ranks_and_any_threads_give_identical_frames() {
    let dir = tempfile::tempdir().unwrap();
    let serial = dir.path().join("serial.fits");
    let run = spex(None, &single("preproc-bundle0.fits", &serial), &[], TIMEOUT);
    assert!(run.ok(), "serial run failed:\n{}", run.stderr);
    for ranks in 1..=4 {
        let out = dir.path().join(format!("ranks{ranks}.fits"));
        let run = spex(
            Some(ranks),
            &single("preproc-bundle0.fits", &out),
            &[],
            TIMEOUT,
        );
        assert!(run.ok(), "{ranks} ranks failed:\n{}", run.stderr);
        if ranks > 1 {
            assert!(
                run.stderr
                    .contains(&format!("MPI: {ranks} ranks on 1 node")),
                "no layout line:\n{}",
                run.stderr
            );
        }
        assert_same_frames(&serial, &out);
    }
    // Two ranks of two threads each.
    let out = dir.path().join("threads.fits");
    let mut args = single("preproc-bundle0.fits", &out);
    let n = args.len();
    args[n - 1] = "2".into();
    let run = spex(Some(2), &args, &[], TIMEOUT);
    assert!(run.ok(), "2 ranks x 2 threads failed:\n{}", run.stderr);
    assert_same_frames(&serial, &out);
}

/// Writes a list of frames into `dir/<name>.txt` with outputs in `dir/<name>/`.
fn frame_list(dir: &Path, name: &str, inputs: &[&str]) -> (Vec<String>, Vec<PathBuf>) {
    let out = dir.join(name);
    std::fs::create_dir_all(&out).unwrap();
    let psf = data("psf-r0-00067784.fits");
    let mut text = String::from("# input psf output\n");
    let mut outputs = Vec::new();
    for (k, input) in inputs.iter().enumerate() {
        let o = out.join(format!("frame-{k}.fits"));
        let i = if input.starts_with('/') {
            PathBuf::from(input)
        } else {
            data(input)
        };
        text += &format!("{} {} {}\n", i.display(), psf.display(), o.display());
        outputs.push(o);
    }
    let list = dir.join(format!("{name}.txt"));
    std::fs::write(&list, text).unwrap();
    let mut args = vec!["--list".to_string(), list.display().to_string()];
    args.extend(options());
    (args, outputs)
}

/// A failing run: non-zero within seconds, one error line naming `rank`, no output left.
fn assert_fails_cleanly(run: &Run, dir: &Path, rank: usize, cause: &str) {
    assert!(!run.ok(), "the run succeeded:\n{}", run.stderr);
    assert!(
        run.elapsed < FAIL_FAST,
        "the run took {:?} to fail:\n{}",
        run.elapsed,
        run.stderr
    );
    let line = format!("spex: rank {rank}: error:");
    let lines: Vec<&str> = run.stderr.lines().filter(|l| l.contains(&line)).collect();
    assert!(
        lines.len() == 1 && lines[0].contains(cause),
        "expected one line '{line} ...{cause}...':\n{}",
        run.stderr
    );
    let left = files_in(dir);
    assert!(left.is_empty(), "files left behind: {left:?}");
}

#[test]
fn missing_input_fails_fast_on_every_layout() {
    for (ranks, async_io) in [(1, false), (3, false), (4, true)] {
        let dir = tempfile::tempdir().unwrap();
        let out = dir.path().join("frame.fits");
        let mut args = single("no-such-preproc.fits", &out);
        if async_io {
            args.push("--async-io".into());
        }
        let run = spex(Some(ranks), &args, &[], FAIL_FAST);
        assert_fails_cleanly(&run, dir.path(), 0, "no-such-preproc.fits");
    }
}

#[test]
fn an_error_on_one_rank_fails_the_job_without_output() {
    for (ranks, async_io, rank) in [(3, false, 2), (4, true, 3)] {
        let dir = tempfile::tempdir().unwrap();
        let out = dir.path().join("frame.fits");
        let mut args = single("preproc-bundle0.fits", &out);
        if async_io {
            args.push("--async-io".into());
        }
        let fault = format!("error@{rank}");
        let run = spex(
            Some(ranks),
            &args,
            &[("SPEX_TEST_FAULT", &fault)],
            FAIL_FAST,
        );
        assert_eq!(run.code, Some(1), "{}", run.stderr);
        assert_fails_cleanly(&run, dir.path(), rank, "fault injected");
    }
}

#[test]
fn a_rank_that_panics_or_dies_aborts_the_job() {
    // The last case panics on a solver thread of a rank that overlaps its phases.
    for (kind, rank, ranks) in [("panic", 1, 3), ("abort", 2, 3), ("panic", 0, 1)] {
        let dir = tempfile::tempdir().unwrap();
        let out = dir.path().join("frame.fits");
        let fault = format!("{kind}@{rank}");
        let mut args = single("preproc-bundle0.fits", &out);
        if ranks == 1 {
            args.push("--async-io".into());
        }
        let run = spex(
            Some(ranks),
            &args,
            &[("SPEX_TEST_FAULT", &fault)],
            FAIL_FAST,
        );
        assert!(!run.ok(), "{kind}: the run succeeded:\n{}", run.stderr);
        assert!(run.elapsed < FAIL_FAST, "{kind}: took {:?}", run.elapsed);
        if kind == "panic" {
            assert!(
                run.stderr
                    .contains(&format!("spex: rank {rank}: error: fault injected")),
                "{}",
                run.stderr
            );
        }
        let left = files_in(dir.path());
        assert!(left.is_empty(), "{kind}: files left behind: {left:?}");
    }
}

/// Four inputs of a list whose second frame cannot be read (a file missing from `dir`); the
/// others are bundle 1 of the reference case.
fn second_frame_missing(dir: &Path) -> Vec<String> {
    let good = "preproc-bundle1.fits".to_string();
    let missing = dir.join("missing-preproc.fits").display().to_string();
    vec![good.clone(), missing, good.clone(), good]
}

#[test]
fn failed_frames_are_counted_and_the_others_complete() {
    let dir = tempfile::tempdir().unwrap();
    let inputs = second_frame_missing(dir.path());
    let inputs: Vec<&str> = inputs.iter().map(String::as_str).collect();
    // One rank overlaps its phases with two frames in flight; two ranks read, extract and
    // write; four have dedicated reader and writer ranks.
    for (ranks, async_io) in [(1, true), (2, false), (4, true)] {
        let name = format!("run{ranks}");
        let (mut args, outputs) = frame_list(dir.path(), &name, &inputs);
        if async_io {
            args.push("--async-io".into());
        }
        if ranks == 1 {
            args.extend(["--frames-in-flight", "2"].map(String::from));
        }
        // Frame 1 cannot be read; frame 3 fails on the last rank only.
        let fault = format!("error@{}:3", ranks - 1);
        let run = spex(Some(ranks), &args, &[("SPEX_TEST_FAULT", &fault)], TIMEOUT);
        assert_eq!(run.code, Some(2), "{}", run.stderr);
        assert!(
            run.stderr.contains("spex: 2 of 4 frames failed"),
            "{}",
            run.stderr
        );
        assert!(
            outputs[0].is_file() && outputs[2].is_file(),
            "{}",
            run.stderr
        );
        assert!(
            !outputs[1].exists() && !outputs[3].exists(),
            "{}",
            run.stderr
        );
        assert_eq!(files_in(&dir.path().join(&name)).len(), 2);
    }
}

/// Asserts that two files hold the same bytes, after the array comparison that says where
/// they differ.
fn assert_same_files(a: &Path, b: &Path) {
    assert_same_frames(a, b);
    let (x, y) = (std::fs::read(a).unwrap(), std::fs::read(b).unwrap());
    assert!(x == y, "{} and {} differ", a.display(), b.display());
}

#[test]
fn every_layout_of_a_list_gives_the_files_of_a_serial_run() {
    let dir = tempfile::tempdir().unwrap();
    // Bundle 1 holds fibers 25-49: with -s 0 its frame is fully masked, a cheap distinct frame.
    let inputs = [
        "preproc-bundle0.fits",
        "preproc-bundle1.fits",
        "preproc-bundle0.fits",
    ];
    let (args, serial) = frame_list(dir.path(), "serial", &inputs);
    let run = spex(None, &args, &[], TIMEOUT);
    assert!(run.ok(), "serial run failed:\n{}", run.stderr);
    // One process without a launcher that overlaps its phases on threads.
    let (mut args, outputs) = frame_list(dir.path(), "overlapped", &inputs);
    args.extend(["--async-io", "--frames-in-flight", "2", "--io-threads", "3"].map(String::from));
    let run = spex(None, &args, &[], TIMEOUT);
    assert!(run.ok(), "overlapped run failed:\n{}", run.stderr);
    assert!(
        run.stderr.contains("2 frames in flight")
            && run.stderr.contains("3 reader and 3 writer threads"),
        "not overlapped with 3 readers and writers:\n{}",
        run.stderr
    );
    for (a, b) in serial.iter().zip(&outputs) {
        assert_same_files(a, b);
    }
    // One rank that overlaps its phases on threads, with up to three frames in flight;
    // dedicated I/O ranks; then two frame groups of one rank each (overlapped and not), of
    // two ranks that read, extract and write, and with dedicated I/O ranks and one and two
    // workers.
    let layouts: [(usize, &[&str], &str); 8] = [
        (
            1,
            &["--async-io", "--frames-in-flight", "3"],
            "rank 0 reads, extracts and writes on threads",
        ),
        (
            1,
            &["--async-io", "--frames-in-flight", "1"],
            "rank 0 reads, extracts and writes on threads",
        ),
        (
            2,
            &[
                "--async-io",
                "--frame-groups",
                "2",
                "--frames-in-flight",
                "2",
            ],
            "2 frame groups: [rank 0 reads, extracts and writes on threads] \
             [rank 1 reads, extracts and writes on threads]",
        ),
        (
            3,
            &["--async-io"],
            "rank 0 reads, rank 1 writes, rank 2 extracts",
        ),
        (
            4,
            &["--async-io"],
            "rank 0 reads, rank 1 writes, ranks 2-3 extract",
        ),
        (
            2,
            &["--frame-groups", "2"],
            "2 frame groups: [rank 0 reads and writes, rank 0 extracts] \
             [rank 1 reads and writes, rank 1 extracts]",
        ),
        (
            4,
            &["--frame-groups", "2"],
            "2 frame groups: [rank 0 reads and writes, ranks 0-1 extract] \
             [rank 2 reads and writes, ranks 2-3 extract]",
        ),
        (
            7,
            &["--async-io", "--frame-groups", "2"],
            "2 frame groups: [rank 0 reads, rank 1 writes, rank 2 extracts] \
             [rank 3 reads, rank 4 writes, ranks 5-6 extract]",
        ),
    ];
    for (k, (ranks, extra, layout)) in layouts.into_iter().enumerate() {
        let (mut args, outputs) = frame_list(dir.path(), &format!("layout{k}"), &inputs);
        args.extend(extra.iter().map(|s| s.to_string()));
        let run = spex(Some(ranks), &args, &[], TIMEOUT);
        assert!(
            run.ok(),
            "{extra:?} on {ranks} ranks failed:\n{}",
            run.stderr
        );
        assert!(
            run.stderr.contains(layout),
            "{extra:?} on {ranks} ranks: not the layout '{layout}':\n{}",
            run.stderr
        );
        for (a, b) in serial.iter().zip(&outputs) {
            assert_same_files(a, b);
        }
    }
}

#[test]
fn failed_frames_of_either_group_are_counted_and_the_others_written() {
    let dir = tempfile::tempdir().unwrap();
    let inputs = second_frame_missing(dir.path());
    let inputs: Vec<&str> = inputs.iter().map(String::as_str).collect();
    let (mut args, outputs) = frame_list(dir.path(), "groups", &inputs);
    args.extend(["--async-io", "--frame-groups", "2"].map(String::from));
    // Groups: ranks 0-2 (frames 0, 2; rank 2 extracts) and ranks 3-5 (frames 1, 3). Frame 1
    // cannot be read by rank 3; frame 2 fails on rank 2, the only worker of group 0.
    let run = spex(
        Some(6),
        &args,
        &[("SPEX_TEST_FAULT", "error@2:2")],
        FAIL_FAST,
    );
    assert_eq!(run.code, Some(2), "{}", run.stderr);
    assert!(run.elapsed < FAIL_FAST, "took {:?}", run.elapsed);
    assert!(
        run.stderr.contains("spex: 2 of 4 frames failed"),
        "{}",
        run.stderr
    );
    for (rank, cause) in [(3, "missing-preproc.fits"), (2, "SPEX_TEST_FAULT")] {
        assert!(
            run.stderr.lines().any(
                |l| l.starts_with(&format!("spex: rank {rank}: error: frame")) && l.contains(cause)
            ),
            "no error line of rank {rank}:\n{}",
            run.stderr
        );
    }
    for (k, written) in [(0, true), (1, false), (2, false), (3, true)] {
        assert_eq!(outputs[k].is_file(), written, "frame {k}:\n{}", run.stderr);
    }
    assert_eq!(files_in(&dir.path().join("groups")).len(), 2);
}

#[test]
fn more_frame_groups_than_ranks_are_rejected() {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("frame.fits");
    for (ranks, groups, cause) in [
        (Some(2), "3", "more than the 2 ranks"),
        (None, "2", "more than the 1 rank"),
    ] {
        let mut args = single("preproc-bundle0.fits", &out);
        args.extend(["--async-io", "--frame-groups", groups].map(String::from));
        let run = spex(ranks, &args, &[], FAIL_FAST);
        assert_eq!(run.code, Some(2), "{groups} groups:\n{}", run.stderr);
        let lines: Vec<&str> = run
            .stderr
            .lines()
            .filter(|l| l.starts_with("spex:"))
            .collect();
        assert!(
            lines.len() == 1 && lines[0].contains("--frame-groups") && lines[0].contains(cause),
            "{groups} groups: expected one line about --frame-groups ({cause}):\n{}",
            run.stderr
        );
        assert!(files_in(dir.path()).is_empty());
    }
}

#[test]
fn groups_without_frames_or_async_io_say_so() {
    let dir = tempfile::tempdir().unwrap();
    let (mut args, outputs) = frame_list(
        dir.path(),
        "idle",
        &["preproc-bundle0.fits", "preproc-bundle1.fits"],
    );
    args.extend(["--frame-groups", "3"].map(String::from));
    let run = spex(Some(3), &args, &[], TIMEOUT);
    assert!(run.ok(), "3 groups for 2 frames failed:\n{}", run.stderr);
    assert!(
        run.stderr
            .contains("3 frame groups for 2 frames: 1 group will have nothing to do"),
        "no warning about the idle group:\n{}",
        run.stderr
    );
    for o in &outputs {
        assert!(o.is_file(), "{} missing:\n{}", o.display(), run.stderr);
    }
    // A group of 2 ranks cannot honour --async-io: it says so and runs without.
    let out = dir.path().join("pair.fits");
    let mut args = single("preproc-bundle0.fits", &out);
    args.push("--async-io".into());
    let run = spex(Some(2), &args, &[], TIMEOUT);
    assert!(run.ok(), "2 ranks with --async-io failed:\n{}", run.stderr);
    assert!(
        run.stderr
            .contains("--async-io needs frame groups of 1 rank or of 3 or more"),
        "no warning about the group of 2:\n{}",
        run.stderr
    );
    assert!(out.is_file(), "{}", run.stderr);
}
