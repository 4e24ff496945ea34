"""spex.extract_frame on numpy arrays against the program's frame for the same inputs:
flux, ivar and resolution bit for bit (as the frame stores them, float32), the grid exactly."""

from __future__ import annotations

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


def test_options_and_files_raise_value_and_os_errors(inputs, workdir):
    preproc, psf = inputs["r0"]
    img = preproc_arrays(preproc)
    with pytest.raises(ValueError, match="nspec"):
        spex.extract_frame(img, psf, 25, 0, 0, wavelength=GRID, gpu=False)
    with pytest.raises(OSError):
        spex.extract_frame(img, workdir / "no-such-psf.fits", 25, 0, 25, gpu=False)
