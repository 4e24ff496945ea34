"""An exposure extracted again and again in one Python process, as a desi_proc job that runs
exposure after exposure calls spex: the frames of LIST (spex's --list format, `INPUT PSF
OUTPUT` per line) through spex.desispec.main_exposure (one process, async I/O), R times. Prints
each call's wall time, when its backends were ready and its frame loop (spex's log lines):
the first call opens the GPUs, the later ones find them kept open.

    python python/bench/repeated.py R LIST [JOB_OPTIONS...]
    e.g. python python/bench/repeated.py 3 list.txt --gpu -w 5760,7620,0.8 --psferr 0.01

Each call writes its frames into a directory of its own beside the first frame's OUTPUT
(r0, r1, ...), which is removed once the call after it has run.
"""

import logging
import re
import shutil
import sys
import time
from pathlib import Path

import spex
import spex.desispec

READY = re.compile(r"backends ready in ([0-9.]+) s")
LOOP = re.compile(r"frames written in ([0-9.]+) s")


def lines_of(listing: Path, out: Path, options: list[str]) -> list[list[str]]:
    jobs = []
    for row in listing.read_text().split("\n"):
        if row.strip():
            inp, psf, output = row.split()
            jobs.append(["-i", inp, "-p", psf, "-o", str(out / Path(output).name), *options])
    return jobs


def main() -> None:
    repeats, listing, options = int(sys.argv[1]), Path(sys.argv[2]), sys.argv[3:]
    first_output = Path(listing.read_text().split()[2])
    records: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda r: records.append(r.getMessage())
    logger = logging.getLogger("spex")
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    before = None
    print(f"{'call':>4} {'frames':>6} {'wall [s]':>8} {'ready [s]':>9} {'loop [s]':>8}")
    for r in range(repeats):
        out = first_output.parent / f"r{r}"
        out.mkdir(parents=True, exist_ok=True)
        jobs = lines_of(listing, out, options)
        records.clear()
        t0 = time.perf_counter()
        written = spex.desispec.main_exposure(jobs, async_io=True)
        wall = time.perf_counter() - t0
        log = "\n".join(records)
        ready = READY.findall(log)
        loop = LOOP.findall(log)
        print(f"{r:>4} {written:>6} {wall:>8.2f} {ready[0] if ready else '-':>9} "
              f"{loop[-1] if loop else '-':>8}", flush=True)
        if before is not None:
            shutil.rmtree(before)
        before = out
    print(f"backends kept open at the end: {spex.release_devices()}")


if __name__ == "__main__":
    main()
