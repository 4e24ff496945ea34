"""What a Python call adds to a frame: the same job line run by the `spex` program (a process
each time) and by spex.desispec.main in this process, alternately, N times each; then K copies
of the line as one job, through the program's --list and through spex.desispec.main_exposure.
Prints medians of the wall times and of the frames' own phases (read, solve, write, as spex
logs them), and the time outside the phases per frame.

    python python/bench/overhead.py PROGRAM N K JOB_LINE...    (JOB_LINE's -o is replaced)
"""

import logging
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import spex.desispec

TOTAL = re.compile(r"\(total ([0-9.]+) s\)")


def with_output(line, path):
    out = list(line)
    out[out.index("-o") + 1] = str(path)
    return out


def main():
    program, n, k, line = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4:]
    work = Path(tempfile.mkdtemp())
    records = []
    handler = logging.Handler()
    handler.emit = lambda r: records.append(r.getMessage())
    logger = logging.getLogger("spex")
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    runs = {"program": ([], []), "python": ([], [])}
    for i in range(n):
        t0 = time.perf_counter()
        done = subprocess.run([program, *with_output(line, work / f"p{i}.fits")],
                              capture_output=True, text=True, check=True)
        runs["program"][0].append(time.perf_counter() - t0)
        runs["program"][1].append(sum(map(float, TOTAL.findall(done.stderr))))
        records.clear()
        t0 = time.perf_counter()
        spex.desispec.main(with_output(line, work / f"y{i}.fits"))
        runs["python"][0].append(time.perf_counter() - t0)
        runs["python"][1].append(sum(map(float, TOTAL.findall("\n".join(records)))))
    for name, (walls, totals) in runs.items():
        report(f"one frame, {name}", walls, totals, 1)

    lines = [with_output(line, work / f"list{j}.fits") for j in range(k)]
    listing = work / "frames.txt"
    rest = [a for a in with_output(line, "x") if a not in ("-i", "-p", "-o")]
    io = {o: line[line.index(o) + 1] for o in ("-i", "-p")}
    listing.write_text("".join(f"{io['-i']} {io['-p']} {work / f'l{j}.fits'}\n" for j in range(k)))
    rest = [a for a in rest if a not in (io["-i"], io["-p"], "x")]
    t0 = time.perf_counter()
    done = subprocess.run([program, "--list", str(listing), *rest], capture_output=True, text=True, check=True)
    wall = time.perf_counter() - t0
    report(f"{k} frames, program --list", [wall], [sum(map(float, TOTAL.findall(done.stderr)))], k)
    records.clear()
    t0 = time.perf_counter()
    spex.desispec.main_exposure(lines)
    wall = time.perf_counter() - t0
    report(f"{k} frames, main_exposure", [wall], [sum(map(float, TOTAL.findall("\n".join(records))))], k)


def report(name, walls, totals, frames):
    wall, total = statistics.median(walls), statistics.median(totals)
    print(f"{name}: wall {wall * 1e3:.1f} ms, frame phases {total * 1e3:.1f} ms, outside them "
          f"{(wall - total) * 1e3 / frames:.1f} ms per frame (median of {len(walls)})")


main()
