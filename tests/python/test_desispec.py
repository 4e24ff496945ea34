"""spex.desispec.main against the program: desi_proc's job lines through desispec's parser,
written by the Python call and by `spex`, must be the same bytes apart from checksum and
date keywords, and desispec must read them."""

from __future__ import annotations

import logging
import re
import time

import numpy as np
import pytest

import spex
import spex.desispec
from conftest import CAMERAS, DESISPEC_TIMING, KINDS, assert_same_frame, job_line, run_program

import desispec.io
import desispec.scripts.extract as desispec_extract


def parse(line: str):
    return desispec_extract.parse(line.split()[1:])


def test_version_is_the_crates():
    out = run_program(["--version"]).stdout.split()
    assert spex.__version__ == out[-1]


def test_every_option_of_desispecs_parser_maps():
    args = parse("x -i a.fits -p p.fits -o o.fits")
    known = set(spex.desispec.VALUE_OPTIONS) | set(spex.desispec.FLAG_OPTIONS)
    assert set(vars(args)) <= known, set(vars(args)) - known


@pytest.mark.parametrize("camera", list(CAMERAS))
@pytest.mark.parametrize("kind", list(KINDS))
def test_job_line_writes_the_programs_frame(inputs, workdir, camera, kind):
    ours = workdir / f"frame-{camera}-{kind}-python.fits"
    theirs = workdir / f"frame-{camera}-{kind}-program.fits"
    spex.desispec.main(parse(job_line(inputs, camera, kind, ours)))
    run_program(job_line(inputs, camera, kind, theirs).split()[1:])
    assert_same_frame(ours, theirs)
    frame = desispec.io.read_frame(str(ours))
    assert frame.flux.shape == (25, 101)
    assert np.all(np.isfinite(frame.flux)) and np.any(frame.ivar > 0)


def test_options_raise_value_error_with_the_programs_message(inputs, workdir):
    line = job_line(inputs, "r0", "flat", workdir / "never.fits").replace("-n 25", "-n 0")
    program = run_program(line.split()[1:], check=False)
    assert program.returncode == 2
    with pytest.raises(ValueError) as caught:
        spex.desispec.main(parse(line))
    assert str(caught.value) in program.stderr


def test_missing_input_raises_file_not_found(inputs, workdir):
    line = job_line(inputs, "r0", "flat", workdir / "never.fits")
    line = line.replace(str(inputs["r0"][0]), str(workdir / "no-such-preproc.fits"))
    with pytest.raises(FileNotFoundError, match="no-such-preproc.fits"):
        spex.desispec.main(parse(line))
    assert not (workdir / "never.fits").exists()


def test_failed_frame_raises_runtime_error_with_the_programs_message(inputs, workdir):
    bad_psf = workdir / "not-a-psf.fits"
    bad_psf.write_text("not a FITS file")
    line = job_line(inputs, "r0", "flat", workdir / "never.fits")
    line = line.replace(str(inputs["r0"][1]), str(bad_psf))
    program = run_program(line.split()[1:], check=False)
    assert program.returncode == 1
    with pytest.raises(RuntimeError) as caught:
        spex.desispec.main(parse(line))
    error_line = next(l for l in program.stderr.splitlines() if "error" in l)
    # cfitsio's detail in parentheses comes from its error stack, which is shared by the
    # threads that read the PSF and the preproc at once: it may be there or not. The rest of
    # the line is the program's message, and must be there.
    assert error_line.split(" (")[0] in str(caught.value)
    assert "cannot open: error reading from FITS file" in str(caught.value)


def logged_main(args, timing: dict | None = None) -> list[logging.LogRecord]:
    """spex.desispec.main's log records at INFO."""
    records: list[logging.LogRecord] = []
    handler = logging.Handler()
    handler.emit = records.append
    logger = logging.getLogger("spex")
    logger.addHandler(handler)
    old = logger.level
    logger.setLevel(logging.INFO)
    try:
        spex.desispec.main(args, timing=timing)
    finally:
        logger.removeHandler(handler)
        logger.setLevel(old)
    return records


def test_log_records_reach_the_spex_logger(inputs, workdir):
    records = logged_main(parse(job_line(inputs, "r0", "flat", workdir / "logged.fits")))
    patches = [r for r in records if r.getMessage().startswith("patches:")]
    assert patches and all(r.levelno == logging.INFO for r in patches)
    assert any(r.levelno == logging.INFO and "logged.fits" in r.getMessage() for r in records)


def test_timing_receives_desispecs_keys_at_the_logged_phases(inputs, workdir):
    timing: dict = {}
    before = time.time()
    records = logged_main(parse(job_line(inputs, "r0", "flat", workdir / "timed.fits")), timing)
    after = time.time()
    assert list(timing) == DESISPEC_TIMING
    values = [timing[k] for k in DESISPEC_TIMING]
    assert values == sorted(values)
    # The phases are placed on the wall clock from durations measured on the monotonic
    # clock: the two may drift apart by NTP's largest slew (500 ppm) over the call.
    slack = 500e-6 * (after - before)
    assert before - slack <= values[0] and values[-1] <= after + slack
    # Each phase's span is the duration the program logs for it, which the log rounds to ms.
    summary = next(r.getMessage() for r in records
                   if "timed.fits" in r.getMessage() and "write " in r.getMessage())
    logged = {name: float(s) for name, s in re.findall(r"(\w+) ([0-9.]+) s", summary)}
    spans = {"solve": timing["extracted-bundles"] - timing["init-mpi-comm"],
             "assemble": timing["frame-extract"] - timing["staged-bundles"],
             "write": timing["frame-write"] - timing["frame-extract"]}
    for name, span in spans.items():
        assert abs(span - logged[name]) <= 0.0005 + 1e-6, (name, span, summary)


def test_exposure_in_one_call_writes_every_cameras_frame(inputs, workdir):
    lines = [job_line(inputs, c, "flat", workdir / f"exposure-{c}.fits") for c in CAMERAS]
    written = spex.desispec.main_exposure([parse(line) for line in lines], frame_groups=1)
    assert written == len(CAMERAS)
    for camera in CAMERAS:
        theirs = workdir / f"frame-{camera}-flat-program.fits"
        if not theirs.exists():
            run_program(job_line(inputs, camera, "flat", theirs).split()[1:])
        assert_same_frame(workdir / f"exposure-{camera}.fits", theirs)


def test_exposure_goes_on_past_a_camera_without_inputs(inputs, workdir):
    lines = [job_line(inputs, c, "flat", workdir / f"partial-{c}.fits") for c in CAMERAS]
    lines[0] = lines[0].replace(str(inputs["b0"][0]), str(workdir / "no-such-preproc.fits"))
    with pytest.raises(RuntimeError, match="1 of 3 frames failed") as caught:
        spex.desispec.main_exposure([parse(line) for line in lines])
    assert "no-such-preproc.fits" in str(caught.value)
    assert not (workdir / "partial-b0.fits").exists()
    assert (workdir / "partial-r0.fits").exists() and (workdir / "partial-z0.fits").exists()
