"""The GIL is released while spex works, and Ctrl-C (SIGINT) stops a job between frames and
raises KeyboardInterrupt in the caller instead of ending the process."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import spex.desispec
from conftest import job_line

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
