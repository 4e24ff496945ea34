"""Type stubs of the extension module spex._spex (see spex.desispec for the public calls)."""

__version__: str

Phases = list[tuple[str, float, float]]

def run_job(
    argvs: list[list[str]], comm: int | None = None
) -> tuple[int, int, int, list[tuple[str, Phases]]]:
    """Runs the frames of `argvs` (each one job line's `spex extract` arguments) over the
    communicator with Fortran handle `comm` (every rank calls in), or in this process alone.
    Returns (frames, written, failed, [(output, [(phase, start, end)]) of each frame this
    rank wrote]); raises when a frame failed."""

import os
from typing import Any

import numpy as np

class Psf:
    """A GAUSS-HERMITE PSF read by spex."""

    def __init__(self, path: str | os.PathLike) -> None: ...
    @property
    def nfiber(self) -> int: ...
    @property
    def path(self) -> str: ...

def extract_arrays(
    image: np.ndarray,
    ivar: np.ndarray,
    mask: np.ndarray | None,
    psf: Psf,
    options: dict[str, Any],
) -> tuple[dict[str, Any], Phases]:
    """spex.extract_frame's work on C-contiguous float32 image and ivar (int32 mask): the
    frame dictionary and [(phase, start, end)] of the solve and the assembly."""

def keep_devices(on: bool) -> bool:
    """Whether later calls keep their GPU backends open for the calls after them (on from the
    import unless SPEX_KEEP_DEVICES=0); False also frees those open now. Returns the setting
    before."""

def release_devices() -> int:
    """Frees the GPU backends kept open between calls; returns how many there were."""
