"""The GIL is released while spex works, and Ctrl-C (SIGINT) stops a job between frames and
raises KeyboardInterrupt in the caller instead of ending the process; over a communicator,
on the interrupted rank, while the other ranks return."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import spex.desispec
from conftest import job_line, mpiexec_command

#: Frames of the interrupted job: more than can be done between its first write and the
#: signal's arrival a few milliseconds later.
NFRAMES = 12


def test_other_python_threads_run_while_spex_works(inputs, workdir):
    argv = job_line(inputs, "r0", "flat", workdir / "gil.fits").split()[1:]
    done = threading.Event()
    ticks = 0

    def extract():
        spex.desispec.main(argv)
        done.set()

    worker = threading.Thread(target=extract)
    worker.start()
    while not done.is_set():
        ticks += 1
        time.sleep(0.001)
    worker.join()
    # A held GIL would leave this thread one tick per switch interval at most; free, it
    # ticks every millisecond or so while the frame is solved (tenths of a second).
    assert ticks >= 20, ticks


SCRIPT = """
import sys
sys.path.insert(0, {tests!r})
import conftest, spex.desispec
lines = {lines!r}
try:
    spex.desispec.main_exposure([l.split()[1:] for l in lines])
except KeyboardInterrupt:
    sys.exit(3)
"""


def test_ctrl_c_raises_keyboard_interrupt_between_frames(inputs, workdir):
    outs = [workdir / f"interrupt-{k}.fits" for k in range(NFRAMES)]
    lines = [job_line(inputs, "r0", "flat", o) for o in outs]
    script = SCRIPT.format(tests=str(Path(__file__).parent), lines=lines)
    child = subprocess.Popen([sys.executable, "-c", script], stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 300
    while not outs[0].exists() and child.poll() is None and time.monotonic() < deadline:
        time.sleep(0.005)
    assert child.poll() is None, child.stderr.read()
    child.send_signal(signal.SIGINT)
    _, stderr = child.communicate(timeout=300)
    # 3: the script caught KeyboardInterrupt (SIGINT's own exit would be -2).
    assert child.returncode == 3, (child.returncode, stderr)
    written = [o for o in outs if o.exists()]
    assert 1 <= len(written) < NFRAMES, len(written)
    assert not any(p.name.endswith(".tmp") for p in workdir.iterdir())


#: An interrupted job over MPI that hangs fails the test instead of the suite.
MPI_TIMEOUT_S = 300


def interrupt_rank(inputs, workdir, rank: int) -> tuple[list[str], int]:
    """A job of NFRAMES frames over 2 ranks (mpi_job.py interrupt), SIGINT sent to `rank`
    alone once the first frame is written; returns each rank's outcome and the frames
    written."""
    tag = f"mpi-interrupt-{rank}"
    outs = [workdir / f"{tag}-{k}.fits" for k in range(NFRAMES)]
    pids = workdir / tag
    pids.mkdir()
    script = Path(__file__).with_name("mpi_job.py")
    lines = [job_line(inputs, "r0", "flat", o) for o in outs]
    command = [*mpiexec_command(2), sys.executable, str(script), "interrupt", str(pids), *lines]
    env = dict(os.environ, PYTHONPATH=str(script.parent))
    job = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                           env=env)
    try:
        deadline = time.monotonic() + MPI_TIMEOUT_S
        while not outs[0].exists() and job.poll() is None and time.monotonic() < deadline:
            time.sleep(0.005)
        assert job.poll() is None, job.communicate()
        os.kill(int((pids / f"rank-{rank}.pid").read_text()), signal.SIGINT)
        stdout, stderr = job.communicate(timeout=MPI_TIMEOUT_S)
    finally:
        if job.poll() is None:
            job.kill()
    assert job.returncode == 0, (job.returncode, stdout, stderr)
    outcomes = sorted(l for l in stdout.splitlines() if l.startswith("rank "))
    assert len(outcomes) == 2, (stdout, stderr)
    return [o.split(": ", 1)[1] for o in outcomes], sum(o.exists() for o in outs)


def test_ctrl_c_on_the_reading_rank_stops_the_job_on_both(inputs, workdir):
    outcomes, written = interrupt_rank(inputs, workdir, 0)
    assert outcomes[0].startswith("KeyboardInterrupt"), outcomes
    # The reader reads no more frames: they fail on the other rank too.
    assert outcomes[1].startswith("RuntimeError:") and "frames failed" in outcomes[1], outcomes
    assert 1 <= written < NFRAMES, written


def test_ctrl_c_on_another_rank_raises_there_alone(inputs, workdir):
    outcomes, written = interrupt_rank(inputs, workdir, 1)
    assert outcomes[1].startswith("KeyboardInterrupt"), outcomes
    # Rank 0 reads every frame, so the job ends as it would have on both ranks.
    assert outcomes[0] == "ok", outcomes
    assert written == NFRAMES
