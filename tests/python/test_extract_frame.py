"""spex.extract_frame on numpy arrays against the program's frame for the same inputs:
flux, ivar and resolution bit for bit (as the frame stores them, float32), the grid exactly."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import fitsio
import numpy as np
import pytest

import spex
from conftest import CAMERAS, run_program

GRID = CAMERAS["r0"][0]


@pytest.fixture(scope="module")
def program_frame(inputs, workdir):
    preproc, psf = inputs["r0"]
    path = workdir / "arrays-program.fits"
    run_program(["-i", str(preproc), "-p", str(psf), "-o", str(path), "-w", GRID,
                 "-n", "25", "--psferr", "0.01", "--no-gpu"])
    with fitsio.FITS(str(path)) as f:
        return {name: f[name].read() for name in ("FLUX", "IVAR", "RESOLUTION", "WAVELENGTH")}


def preproc_arrays(preproc) -> dict:
    return {name.lower(): fitsio.read(str(preproc), name) for name in ("IMAGE", "IVAR", "MASK")}


def assert_matches(out: dict, frame: dict) -> None:
    assert out["specflux"].shape == frame["FLUX"].shape == (25, 101)
    assert np.array_equal(out["wave"], frame["WAVELENGTH"])
    assert np.array_equal(out["specflux"].astype(np.float32), frame["FLUX"])
    assert np.array_equal(out["specivar"].astype(np.float32), frame["IVAR"])
    assert np.array_equal(out["Rdiags"].astype(np.float32), frame["RESOLUTION"])


def test_arrays_and_mask_give_the_programs_frame(inputs, program_frame):
    preproc, psf = inputs["r0"]
    a = preproc_arrays(preproc)
    img = {"image": a["image"], "ivar": a["ivar"], "mask": a["mask"]}
    out = spex.extract_frame(img, str(psf), 25, 0, 25, wavelength=GRID, nsubbundles=5,
                             psferr=0.01, gpu=False)
    assert set(out) == {"wave", "specflux", "specivar", "specmask", "Rdiags",
                        "pixmask_fraction", "chi2pix", "modelimage"}
    assert_matches(out, program_frame)


def test_desispecs_masked_ivar_and_a_psf_object_give_the_same(inputs, program_frame):
    preproc, psf = inputs["r0"]
    a = preproc_arrays(preproc)
    # desispec's main_gpu_specter hands gpu_specter float64 arrays, the mask already applied.
    img = {"image": a["image"].astype(np.float64),
           "ivar": a["ivar"] * ((a["mask"] & 767) == 0)}
    wmin, wmax, dw = (float(w) for w in GRID.split(","))
    wave = np.arange(wmin, wmax + dw / 2, dw)
    out = spex.extract_frame(img, spex.read_psf(psf), 25, 0, 25, wavelength=wave,
                             nsubbundles=5, psferr=0.01, gpu=False)
    assert_matches(out, program_frame)


def test_cpu_calls_keep_no_backend_open(inputs, program_frame):
    # GPU backends stay open between calls (scripts/gpu-check-python checks them); CPU ones,
    # cheap to start, are never kept, whether keeping is on or off.
    preproc, psf = inputs["r0"]
    img = preproc_arrays(preproc)
    spex.release_devices()
    for keep in (True, False, True):
        spex.keep_devices(keep)
        out = spex.extract_frame(img, str(psf), 25, 0, 25, wavelength=GRID, nsubbundles=5,
                                 psferr=0.01, gpu=False)
        assert_matches(out, program_frame)
        assert spex.release_devices() == 0


def test_the_environment_decides_whether_the_import_keeps_backends():
    # keep_devices returns the setting before, so a fresh process tells what its import chose.
    probe = "import spex; print(spex.keep_devices(False), spex.keep_devices(True))"
    env = {k: v for k, v in os.environ.items() if k != "SPEX_KEEP_DEVICES"}
    for value, chosen in ((None, "True"), ("1", "True"), ("0", "False")):
        run_env = env if value is None else {**env, "SPEX_KEEP_DEVICES": value}
        out = subprocess.run([sys.executable, "-c", probe], env=run_env, capture_output=True,
                             text=True, check=True)
        assert out.stdout.split() == [chosen, "False"], (value, out.stdout)
    bad = subprocess.run([sys.executable, "-c", "import spex"],
                         env={**env, "SPEX_KEEP_DEVICES": "yes"}, capture_output=True, text=True)
    assert bad.returncode != 0
    assert 'ValueError: SPEX_KEEP_DEVICES="yes": expected 0' in bad.stderr, bad.stderr


#: gpu_specter's extract_frame timing keys, in the order of the steps they end.
GPU_SPECTER_TIMING = ["init-mpi-comm", "init-mpi-bcast", "host-to-device", "extracted-bundles",
                      "staged-bundles", "merged-bundles", "assembled-frame"]


def test_timing_receives_gpu_specters_keys_in_order(inputs):
    preproc, psf = inputs["r0"]
    timing: dict = {}
    before = time.time()
    spex.extract_frame(preproc_arrays(preproc), str(psf), 25, 0, 25, wavelength=GRID,
                       nsubbundles=5, psferr=0.01, gpu=False, timing=timing)
    after = time.time()
    assert list(timing) == GPU_SPECTER_TIMING
    values = [timing[k] for k in GPU_SPECTER_TIMING]
    assert values == sorted(values)
    # Placed on the wall clock from monotonic durations: NTP may slew them apart by 500 ppm.
    slack = 500e-6 * (after - before)
    assert before - slack <= values[0] and values[-1] <= after + slack
    # The solve of 25 fibers takes time; the reading of the arrays precedes it.
    assert timing["extracted-bundles"] > timing["host-to-device"] > before


def test_options_and_files_raise_value_and_os_errors(inputs, workdir):
    preproc, psf = inputs["r0"]
    img = preproc_arrays(preproc)
    with pytest.raises(ValueError, match="nspec"):
        spex.extract_frame(img, psf, 25, 0, 0, wavelength=GRID, gpu=False)
    with pytest.raises(OSError):
        spex.extract_frame(img, workdir / "no-such-psf.fits", 25, 0, 25, gpu=False)
