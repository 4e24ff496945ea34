"""desi_proc (desispec 0.70.0's desispec.scripts.proc) on a simulated night with spex as its
extraction, through sframe: once without MPI, where desi_proc spawns `desi_extract_spectra`
from PATH and finds spex there, and once over MPI (2 ranks), where desi_proc calls
desispec.scripts.extract.main_gpu_specter in process, replaced by spex.desispec.main. Either
way desi_proc must exit 0, write every file of its steps up to sframe, and its frame must be
the `spex` program's for the job line desi_proc built (bytes apart from checksum and date
keywords).

What desi_proc runs here: the preproc is found done (the simulated one), the trace shifts are
turned off (--no-traceshift: desi_compute_trace_shifts needs specter), the bad-column mask has
no bad-column file to apply, the fiberflat comes from the stub calibration, and the
standard-star fit and flux calibration are turned off (--nostdstarfit --nofluxcalib: they
need DESI's stellar templates and desimodel's data, not on PyPI). Extraction, fiberflat, sky (with
desi_proc's wavelength and LSF adjustments and offsets) and sframe run as in production.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

import night
from conftest import assert_same_frame, mpiexec_command, program_environ, run_program, spex_program

#: desi_proc's options for the steps that can run on PyPI's packages (see the module's doc).
DESI_PROC_ARGS = ["-n", str(night.NIGHT), "-e", str(night.EXPID), "--cameras", night.CAMERA,
                  "--no-traceshift", "--nostdstarfit", "--nofluxcalib"]
#: Each run takes about 30 s on 2 busy cores, most of it desispec's sky fit.
TIMEOUT_S = 600
#: What desi_proc writes for the camera through sframe (the psf and fiberflatexp are links to
#: the calibration's files, as desi_proc makes them without trace shifts and humidity model).
PRODUCTS = ("psf", "frame", "fiberflatexp", "sky", "sframe")


@pytest.fixture(scope="session")
def simulated_night(workdir) -> tuple[Path, Path]:
    return night.simulate(workdir)


def desi_proc(root: Path, simulated, mode: str, environ: dict[str, str],
              launcher: list[str], options: list[str]) -> tuple[night.Night, str]:
    """Lays out the night under `root` and runs desi_proc_job.py `mode` on it; returns the
    night and desi_proc's output, failing the test unless desi_proc exits 0."""
    layout = night.Night(root)
    layout.build(*simulated)
    script = Path(__file__).with_name("desi_proc_job.py")
    env = dict(program_environ(), **layout.environ, **environ)
    env["PYTHONPATH"] = str(script.parent)
    done = subprocess.run([*launcher, sys.executable, str(script), mode, *DESI_PROC_ARGS, *options],
                          capture_output=True, text=True, env=env, timeout=TIMEOUT_S, cwd=root)
    output = done.stdout + done.stderr
    assert done.returncode == 0, f"desi_proc exited {done.returncode}:\n{output[-6000:]}"
    return layout, output


def assert_products(layout: night.Night) -> None:
    from desispec.io import read_frame, read_sky

    missing = [p for p in PRODUCTS if not layout.path(p).exists()]
    assert not missing, f"desi_proc wrote no {missing}"
    sframe = read_frame(str(layout.path("sframe")))
    sky = read_sky(str(layout.path("sky")))
    nwave = night.desi_proc_wave().size
    assert sframe.flux.shape == (night.NFIBERS, nwave)
    assert sky.flux.shape == (night.NFIBERS, nwave)
    assert "IN_SKY" in sframe.meta and "FIBERFLT" in sframe.meta


def assert_frame_is_the_programs(layout: night.Night, output: str, workdir: Path) -> None:
    """desi_proc's frame equals the program's for the job line desi_proc logged, run in the
    night's environment (spex, as desispec, writes input paths relative to SPECPROD)."""
    lines = re.findall(r"RUNNING: (desi_extract_spectra .*)", output)
    assert len(lines) == 1, output[-6000:]
    argv = lines[0].split()[1:]
    at = argv.index("-o") + 1
    assert argv[at].endswith("-no-badcolumn-mask.fits"), argv
    reference = workdir / f"{layout.root.name}-program-frame.fits"
    argv[at] = str(reference)
    run_program(argv, environ=layout.environ)
    assert_same_frame(layout.path("frame"), reference)


def test_desi_proc_without_mpi_runs_spex_as_desi_extract_spectra(simulated_night, tmp_path,
                                                                 workdir):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    wrapper = bin_dir / "desi_extract_spectra"
    wrapper.write_text(f'#!/bin/sh\nexec "{spex_program()}" "$@"\n')
    wrapper.chmod(0o755)
    path = f"{bin_dir}{os.pathsep}{os.environ.get('PATH', '')}"
    layout, output = desi_proc(tmp_path / "plain", simulated_night, "plain", {"PATH": path}, [], [])
    assert "running extractions without MPI parallelism" in output
    assert_products(layout)
    assert_frame_is_the_programs(layout, output, workdir)


def test_desi_proc_over_mpi_calls_spex_desispec_main(simulated_night, tmp_path, workdir):
    ranks = 2
    # desi_proc's CPU extraction groups are of 16 ranks unless told otherwise.
    layout, output = desi_proc(tmp_path / "mpi", simulated_night, "mpi", {},
                               mpiexec_command(ranks), ["--extract-subcomm-size", str(ranks)])
    calls = sorted(re.findall(r"rank (\d): spex calls (\d+)", output))
    assert calls == [(str(r), "1") for r in range(ranks)], output[-6000:]
    assert_products(layout)
    assert_frame_is_the_programs(layout, output, workdir)
