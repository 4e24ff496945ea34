"""spex: spectro-perfectionism extraction of DESI CCD frames, from Python.

The package runs the same code as the ``spex`` program, in this process:

- :func:`extract_frame` is gpu_specter's ``extract_frame`` on numpy arrays;
- :mod:`spex.desispec` has desispec's entry points (``main``, the drop-in for
  ``desispec.scripts.extract.main_gpu_specter``; ``main_exposure``, every camera of an
  exposure in one call), over an mpi4py communicator or in this process alone.

GPU backends stay open between calls, so that only the first call of the process pays the
device's start (0.4-0.5 s for one GPU, 1.2-2 s for four) and its buffers' set-up; they hold
device and pinned host memory meanwhile. :func:`release_devices` frees them, and
``keep_devices(False)`` stops keeping them (``SPEX_KEEP_DEVICES=0`` in the environment, from
the import on).

Errors raise ValueError (options), OSError / FileNotFoundError (files), RuntimeError (the
rest) with the program's messages; Ctrl-C raises KeyboardInterrupt. Log records go to the
``spex`` logger of :mod:`logging`.
"""

from __future__ import annotations

import logging
import os
from typing import Any

import numpy as np

from ._spex import Psf, __version__, extract_arrays, keep_devices, release_devices
from . import desispec

__all__ = [
    "Psf", "__version__", "desispec", "extract_frame", "keep_devices", "read_psf",
    "release_devices",
]


def read_psf(path: str | os.PathLike) -> Psf:
    """Reads a GAUSS-HERMITE PSF file once, for several calls of :func:`extract_frame`."""
    return Psf(os.fspath(path))


def extract_frame(
    img: dict,
    psf: Psf | str | os.PathLike,
    bundlesize: int,
    specmin: int,
    nspec: int,
    wavelength: str | tuple | np.ndarray | None = None,
    nwavestep: int = 50,
    nsubbundles: int = 1,
    model: bool | None = None,
    regularize: float = 0,
    psferr: float | None = None,
    comm: Any = None,
    gpu: bool | None = None,
    loglevel: str | None = None,
    timing: dict | None = None,
    wavepad: int = 10,
    pixpad_frac: float = 0.8,
    wavepad_frac: float = 0.2,
    batch_subbundle: bool = True,
    ranks_per_bundle: int | None = None,
) -> dict:
    """Extracts 1-D spectra from a 2-D image held in memory (gpu_specter's signature).

    Args:
        img: ``{"image": ..., "ivar": ...}`` 2-D arrays, and optionally ``"mask"``, whose
            bits of desispec's extractmaskval (767) reject a pixel (as ``desi_extract_spectra``
            applies it). Arrays other than C-contiguous float32 (int32 for the mask) are
            converted; the pixels are then copied once, into spex.
        psf: a PSF file's path, or :func:`read_psf`'s object.
        bundlesize, specmin, nspec: fibers per bundle, first fiber, number of fibers.
        wavelength: ``"wmin,wmax,dw"``, a tuple of them, the grid itself, or None (the PSF's
            range at 0.8 Angstrom).
        nwavestep, nsubbundles, wavepad, pixpad_frac, wavepad_frac: the patch layout.
        regularize, psferr: as ``desi_extract_spectra``'s options.
        gpu: True needs a GPU, False never uses one, None uses one when usable.
        loglevel: sets the ``spex`` logger's level when given.
        timing: a dict that receives gpu_specter's keys, each the ``time.time()`` at which
            that step ended: ``init-mpi-comm``, ``init-mpi-bcast`` and ``host-to-device``
            (the start of spex's solve, which holds those steps), ``extracted-bundles`` (its
            end), ``staged-bundles``, ``merged-bundles`` and ``assembled-frame`` (the end of
            the assembly).
        model, comm, batch_subbundle, ranks_per_bundle: accepted for gpu_specter's
            signature; ``model`` and ``comm`` must be None (spex.desispec.main writes model
            images and runs over MPI).

    Returns:
        gpu_specter's frame dictionary: ``wave`` [nwave]; ``specflux``, ``specivar``
        (per Angstrom), ``specmask`` (desispec's specmask bits, uint32), ``pixmask_fraction``,
        ``chi2pix`` [nspec, nwave]; ``Rdiags`` [nspec, 2 ndiag + 1, nwave]; ``modelimage``
        None. Flux, ivar and resolution are those of the program's frame for the same inputs.
    """
    if comm is not None:
        raise ValueError("spex.extract_frame runs in this process; use spex.desispec.main with comm")
    if model:
        raise ValueError("spex.extract_frame computes no model image; use spex.desispec.main with -m")
    if loglevel is not None:
        logging.getLogger("spex").setLevel(loglevel.upper())
    if not isinstance(psf, Psf):
        psf = read_psf(psf)
    image = np.ascontiguousarray(img["image"], dtype=np.float32)
    ivar = np.ascontiguousarray(img["ivar"], dtype=np.float32)
    mask = img.get("mask")
    if mask is not None:
        mask = np.ascontiguousarray(mask, dtype=np.int32)
    options = dict(
        bundlesize=int(bundlesize), specmin=int(specmin), nspec=int(nspec),
        wavelength=_grid(wavelength), nwavestep=int(nwavestep), nsubbundles=int(nsubbundles),
        regularize=float(regularize), psferr=None if psferr is None else float(psferr),
        wavepad=int(wavepad), wavepad_frac=float(wavepad_frac), pixpad_frac=float(pixpad_frac),
        gpu=gpu,
    )
    frame, phases = extract_arrays(image, ivar, mask, psf, options)
    if isinstance(timing, dict):
        timing.update(_core_timing({name: (start, end) for name, start, end in phases}))
    return frame


def _core_timing(phases: dict[str, tuple[float, float]]) -> dict[str, float]:
    """gpu_specter's ``timing`` keys (``time.time()`` as each of its steps ends) from the
    start and end of spex's phases.

    gpu_specter's steps before its bundles (communicator, broadcast of the image, copy to the
    GPU) are part of spex's solve, and its staging and merging of the bundles part of spex's
    gather and assembly: those keys get the start or end of the spex phase that holds them,
    so that the keys keep gpu_specter's order and their differences are spex's phases.
    """
    began, solved = phases["solve"]
    staged = phases.get("gather", phases["solve"])[1]
    assembled = phases["assemble"][1]
    return {
        "init-mpi-comm": began,
        "init-mpi-bcast": began,
        "host-to-device": began,
        "extracted-bundles": solved,
        "staged-bundles": staged,
        "merged-bundles": assembled,
        "assembled-frame": assembled,
    }


def _grid(wavelength) -> tuple[float, float, float] | None:
    """``wmin, wmax, dw`` of gpu_specter's forms of the wavelength argument."""
    if wavelength is None:
        return None
    if isinstance(wavelength, str):
        wmin, wmax, dw = (float(w) for w in wavelength.split(","))
        return wmin, wmax, dw
    if isinstance(wavelength, np.ndarray):
        return float(wavelength[0]), float(wavelength[-1]), float(np.gradient(wavelength)[0])
    wmin, wmax, dw = wavelength
    return float(wmin), float(wmax), float(dw)
