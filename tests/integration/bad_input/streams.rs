//! What spex does when its surroundings fail it: standard output or error full or closed, a
//! file-size limit, and the signals that end a process other than SIGTERM and SIGINT.

use std::os::unix::io::FromRawFd;

use super::regressions::interrupted_write;
use super::*;

const REFERENCE: &str = "reference-frame-bundle0.fits";

/// Runs `spex args` with its standard output and error given; returns how it ended.
fn with_streams(args: Vec<OsString>, stdout: Stdio, stderr: Stdio) -> Outcome {
    let out = Command::new(env!("CARGO_BIN_EXE_spex"))
        .args(args)
        .env_remove("SPEX_LOG")
        .stdin(Stdio::null())
        .stdout(stdout)
        .stderr(stderr)
        .output()
        .expect("run spex");
    Outcome {
        code: out.status.code(),
        stderr: String::from_utf8_lossy(&out.stderr).into_owned(),
        launched: false,
    }
}

fn dev_full() -> Stdio {
    Stdio::from(std::fs::File::create("/dev/full").expect("/dev/full"))
}

/// The writing end of a pipe whose reading end is already closed: the first write fails
/// with EPIPE, as when `head` has gone.
fn closed_pipe() -> Stdio {
    let mut fds = [0; 2];
    // SAFETY: `pipe` fills the two descriptors; the reading one is closed at once and the
    // writing one is owned by the returned file.
    unsafe {
        assert_eq!(libc::pipe(fds.as_mut_ptr()), 0, "pipe");
        libc::close(fds[0]);
        Stdio::from(std::fs::File::from_raw_fd(fds[1]))
    }
}

#[test]
fn full_standard_output_is_an_error_not_a_panic() {
    let mut c = Case::new();
    let a = c.copy(REFERENCE, "a.fits");
    let truth = c.copy("truth-bundle0.fits", "t.fits");
    c.seal();
    for args in [
        args!["compare", &a, &a],
        args!["compare", &a, "--truth", &truth, "--truth-fibermin", "0"],
    ] {
        let o = with_streams(args, dev_full(), Stdio::piped());
        expect(&o, 1, &["standard output", "No space left on device"]);
    }
    c.unchanged_except(&[]);
}

#[test]
fn closed_standard_output_ends_quietly() {
    let mut c = Case::new();
    let a = c.copy(REFERENCE, "a.fits");
    let truth = c.copy("truth-bundle0.fits", "t.fits");
    c.seal();
    let o = with_streams(args!["compare", &a, &a], closed_pipe(), Stdio::piped());
    expect(&o, 0, &[]);
    assert!(o.stderr.trim().is_empty(), "{}", o.stderr);
    // The comparison's own verdict still decides the status.
    let o = with_streams(
        args!["compare", &a, "--truth", &truth, "--max-std", "0"],
        closed_pipe(),
        Stdio::piped(),
    );
    expect(&o, 3, &["comparison failed"]);
    c.unchanged_except(&[]);
}

#[test]
fn full_standard_error_does_not_panic() {
    let mut c = Case::new();
    let a = c.copy(REFERENCE, "a.fits");
    c.seal();
    // A failing comparison and a missing file: their messages cannot be written, the status
    // says what happened.
    let o = with_streams(
        args![
            "compare",
            &a,
            &a,
            "--max-dflux",
            "0",
            "--min-fraction",
            "1.5"
        ],
        Stdio::null(),
        dev_full(),
    );
    assert_eq!(o.code, Some(3));
    let o = with_streams(
        args!["compare", &a, c.path("missing.fits")],
        Stdio::null(),
        dev_full(),
    );
    assert_eq!(o.code, Some(1));
    c.unchanged_except(&[]);
}

#[test]
fn file_size_limit_fails_the_write_and_leaves_nothing() {
    let mut c = Case::new();
    let (input, psf) = (c.copy(IMAGE, "in.fits"), c.copy(PSF, "psf.fits"));
    std::fs::write(c.path("f.fits"), b"previous frame").unwrap();
    c.seal();
    // 100 blocks of 512 bytes: the frame (about 0.4 MB) does not fit, nor the model.
    let mut a = args![
        "-c",
        "ulimit -f 100 && exec \"$@\"",
        "sh",
        env!("CARGO_BIN_EXE_spex"),
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
    let out = Command::new("sh")
        .args(a)
        .env_remove("SPEX_LOG")
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .output()
        .expect("run sh");
    let o = Outcome {
        code: out.status.code(),
        stderr: String::from_utf8_lossy(&out.stderr).into_owned(),
        launched: false,
    };
    expect(&o, 1, &["f.fits", "File too large"]);
    c.unchanged_except(&[]);
}

#[test]
fn sighup_during_write_leaves_no_temporary() {
    interrupted_write("HUP", 129);
}

#[test]
fn sigquit_during_write_leaves_no_temporary() {
    interrupted_write("QUIT", 131);
}

#[test]
fn sigusr1_during_write_leaves_no_temporary() {
    interrupted_write("USR1", 138);
}
