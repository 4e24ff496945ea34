"""spex.desispec over mpi4py communicators, under `mpiexec -n 4`: COMM_WORLD, desi_proc's
CPU sub-communicators (comm.Split) and GPU group (comm.Create_group with a coordinator), an
exposure in one call, and a missing input raising on every rank. Each frame must be the
program's, byte for byte apart from checksum and date keywords."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from conftest import (DESISPEC_TIMING, assert_same_frame, job_line, mpiexec_command,
                      run_program)

RANKS = 4
#: A hung job fails the test instead of the suite.
TIMEOUT_S = 300


def mpiexec(mode: str, lines: list[str]) -> list[str]:
    """Runs mpi_job.py on RANKS ranks; returns each rank's outcome, in rank order."""
    script = Path(__file__).with_name("mpi_job.py")
    command = [*mpiexec_command(RANKS), sys.executable, str(script), mode, *lines]
    env = dict(os.environ, PYTHONPATH=str(script.parent))
    done = subprocess.run(command, capture_output=True, text=True, timeout=TIMEOUT_S, env=env)
    outcomes = sorted(l for l in done.stdout.splitlines() if l.startswith("rank "))
    assert done.returncode == 0, f"mpiexec exited {done.returncode}:\n{done.stdout}\n{done.stderr}"
    assert len(outcomes) == RANKS, f"{done.stdout}\n{done.stderr}"
    return [o.split(": ", 1)[1] for o in outcomes]


def reference(inputs, workdir, camera: str, kind: str) -> Path:
    path = workdir / f"mpi-reference-{camera}-{kind}.fits"
    if not path.exists():
        run_program(job_line(inputs, camera, kind, path).split()[1:])
    return path


def assert_mode_writes_the_programs_frames(inputs, workdir, mode: str, kind: str,
                                           cameras: list[str]) -> None:
    """mpi_job.py `mode` on the job lines of `cameras`: every rank ok, and each frame the
    program's."""
    outs = [workdir / f"mpi-{mode}-{c}.fits" for c in cameras]
    lines = [job_line(inputs, c, kind, o) for c, o in zip(cameras, outs)]
    assert mpiexec(mode, lines) == ["ok"] * RANKS
    for camera, out in zip(cameras, outs):
        assert_same_frame(out, reference(inputs, workdir, camera, kind))


def test_comm_world(inputs, workdir):
    assert_mode_writes_the_programs_frames(inputs, workdir, "world", "science", ["r0"])


def test_timing_over_a_communicator_on_the_writer_and_the_others(inputs, workdir):
    out = workdir / "mpi-timing-r0.fits"
    outcomes = mpiexec("timing", [job_line(inputs, "r0", "science", out)])
    # Rank 0 writes the frame (no dedicated writer without --async-io).
    assert outcomes[0] == " ".join(["ok", *DESISPEC_TIMING]), outcomes
    assert outcomes[1:] == ["ok frame-start frame-write"] * (RANKS - 1), outcomes
    assert_same_frame(out, reference(inputs, workdir, "r0", "science"))


def test_split_sub_communicators_take_cameras_round_robin(inputs, workdir):
    assert_mode_writes_the_programs_frames(inputs, workdir, "split", "flat", ["b0", "r0", "z0"])


def test_create_group_with_a_coordinator(inputs, workdir):
    assert_mode_writes_the_programs_frames(inputs, workdir, "coordinator", "arc", ["z0"])


def test_exposure_over_two_frame_groups(inputs, workdir):
    assert_mode_writes_the_programs_frames(inputs, workdir, "exposure", "flat",
                                           ["b0", "r0", "z0"])


def test_missing_input_raises_on_every_rank(inputs, workdir):
    line = job_line(inputs, "b0", "flat", workdir / "mpi-never.fits")
    line = line.replace(str(inputs["b0"][0]), str(workdir / "no-such-preproc.fits"))
    outcomes = mpiexec("world", [line])
    assert all(o.startswith("FileNotFoundError:") and "no-such-preproc" in o for o in outcomes), outcomes
    assert not (workdir / "mpi-never.fits").exists()


def test_a_rank_missing_an_input_raises_on_every_rank(inputs, workdir):
    out = workdir / "mpi-never-2.fits"
    line = job_line(inputs, "r0", "flat", out)
    bad = line.replace(str(inputs["r0"][0]), str(workdir / "no-such-preproc.fits"))
    outcomes = mpiexec("one-rank", [line, bad])
    assert outcomes[2].startswith("FileNotFoundError:") and "no-such-preproc" in outcomes[2]
    others = outcomes[:2] + outcomes[3:]
    assert all(o.startswith("RuntimeError:") for o in others), outcomes
    assert not out.exists()


def test_a_frame_failing_on_the_reader_raises_on_every_rank(inputs, workdir):
    bad_psf = workdir / "mpi-not-a-psf.fits"
    bad_psf.write_text("not a FITS file")
    line = job_line(inputs, "r0", "flat", workdir / "mpi-never-3.fits")
    line = line.replace(str(inputs["r0"][1]), str(bad_psf))
    outcomes = mpiexec("world", [line])
    assert all(o.startswith("RuntimeError:") and "mpi-not-a-psf" in o for o in outcomes), outcomes
