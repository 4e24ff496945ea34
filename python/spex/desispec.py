"""desispec's extraction entry points, run by spex.

``main(args, comm=None, coordinator=None)`` takes the namespace of
``desispec.scripts.extract.parse(job_line)`` and writes the frame the ``spex`` program writes
for that job line; it has the signature of ``desispec.scripts.extract.main_gpu_specter`` and
``main_mpi``, so that desi_proc calls it when those names are replaced by it::

    import desispec.scripts.extract, spex.desispec
    desispec.scripts.extract.main_gpu_specter = spex.desispec.main
    desispec.scripts.extract.main_mpi = spex.desispec.main

``main_exposure(list_of_args, comm=None)`` extracts several job lines (every camera of an
exposure) in one call, spread over frame groups as the program's ``--list`` does.

With an mpi4py communicator every rank of it must call in with the same arguments; the
communicator reaches spex as its MPI handle and spex works on a duplicate of it. A failure on
any rank raises on every rank.
"""

from __future__ import annotations

import argparse
import logging
import time
from typing import Any, Iterable, Sequence

from . import _spex

#: desispec's options that take a value: namespace attribute -> spex's option.
VALUE_OPTIONS = {
    "input": "-i",
    "fibermap": "-f",
    "psf": "-p",
    "output": "-o",
    "model": "-m",
    "wavelength": "-w",
    "specmin": "-s",
    "nspec": "-n",
    "regularize": "-r",
    "bundlesize": "--bundlesize",
    "nsubbundles": "--nsubbundles",
    "nwavestep": "--nwavestep",
    "psferr": "--psferr",
    "pixpad_frac": "--pixpad-frac",
    "wavepad_frac": "--wavepad-frac",
}

#: desispec's switches: namespace attribute -> spex's option.
FLAG_OPTIONS = {
    "verbose": "-v",
    "mpi": "--mpi",
    "decorrelate_fibers": "--decorrelate-fibers",
    "no_scores": "--no-scores",
    "barycentric_correction": "--barycentric-correction",
    "use_specter": "--use-specter",
    "no_gpu": "--no-gpu",
}


def job_argv(args: argparse.Namespace | Sequence[str]) -> list[str]:
    """The ``spex extract`` arguments of a job: a desispec namespace's options, or a job
    line's arguments (without the program's name) as they are.

    Floats are written with ``repr``, which reads back as the same double.
    """
    if not isinstance(args, argparse.Namespace):
        if isinstance(args, str):
            raise ValueError("give a job line's arguments as a list of strings, not one string")
        return [str(a) for a in args]
    argv: list[str] = []
    for name, value in vars(args).items():
        if value is None:
            continue
        if name in FLAG_OPTIONS:
            if value:
                argv.append(FLAG_OPTIONS[name])
        elif name in VALUE_OPTIONS:
            argv += [VALUE_OPTIONS[name], repr(value) if isinstance(value, float) else str(value)]
        else:
            raise ValueError(f"desispec option {name!r} is unknown to spex")
    return argv


def main(
    args: argparse.Namespace | Sequence[str],
    comm: Any = None,
    timing: dict | None = None,
    coordinator: Any = None,
) -> None:
    """Extracts the frame of one job line, as ``desispec.scripts.extract.main_gpu_specter``.

    Parameters
    ----------
    args : the namespace of ``desispec.scripts.extract.parse(...)``, or the job line's
        arguments as a list of strings.
    comm : an mpi4py communicator whose ranks all take part (every rank calls in), or None:
        this process alone (unless ``args.mpi``: then ``MPI.COMM_WORLD``, as desispec does).
    timing : a dict that receives desispec's keys, each the ``time.time()`` at which that
        step ended: ``frame-start`` (the call), ``frame-setup`` (the inputs read),
        gpu_specter's keys of :func:`spex.extract_frame`, ``frame-extract`` (the frame
        assembled) and ``frame-write`` (written), on the rank that wrote the frame;
        ``frame-start`` and ``frame-write`` (the call's end) on the others.
    coordinator : a gpu_specter I/O coordinator; its communicator is used, and a
        ``ParallelIOCoordinator`` gives the job dedicated reader and writer ranks
        (``--async-io``), as in desi_proc's GPU layout.

    Raises ValueError on options, OSError / FileNotFoundError on files, RuntimeError when
    the frame failed (the message is the program's), KeyboardInterrupt on Ctrl-C.
    """
    start = time.time()
    argv = job_argv(args)
    comm, async_io = _communicator(args, comm, coordinator)
    if async_io:
        argv.append("--async-io")
    _, _, _, written = _run([argv], comm)
    if isinstance(timing, dict):
        timing.update(frame_timing(written, start, time.time()))


def frame_timing(written: list, start: float, end: float) -> dict[str, float]:
    """desispec's ``timing`` keys of ``main_gpu_specter`` (``time.time()`` as each step
    ends) from the phases of the frame this rank wrote, with gpu_specter's keys between
    ``frame-setup`` and ``frame-extract`` (see :func:`spex._core_timing`). A rank that wrote
    no frame (another rank of the communicator did) has the call's start and end alone."""
    if not written:
        return {"frame-start": start, "frame-write": end}
    from . import _core_timing

    phases = {name: (begin, finish) for name, begin, finish in written[0][1]}
    timing = {"frame-start": start, "frame-setup": phases["read"][1]}
    timing.update(_core_timing(phases))
    timing["frame-extract"] = phases["assemble"][1]
    timing["frame-write"] = phases["write"][1]
    return timing


def main_exposure(
    list_of_args: Iterable[argparse.Namespace | Sequence[str]],
    comm: Any = None,
    frame_groups: int = 1,
    async_io: bool = False,
) -> int:
    """Extracts every job line of ``list_of_args`` (e.g. the 30 cameras of an exposure) in
    one job over ``comm``, as the program's ``--list`` does: frame k goes to frame group
    k mod ``frame_groups``; ``async_io`` gives each group of 3 or more ranks dedicated reader
    and writer ranks. The layout options (threads, GPU) are the first line's.

    Returns the number of frames written; raises RuntimeError, after every other frame was
    done, when some failed.
    """
    argvs = [job_argv(a) for a in list_of_args]
    if not argvs:
        raise ValueError("no job line to run")
    argvs[0] += ["--frame-groups", str(int(frame_groups))]
    if async_io:
        argvs[0].append("--async-io")
    comm = _mpi_world(comm) if _asks_mpi(list_of_args) else comm
    frames, written, failed, _ = _run(argvs, comm)
    return written


def _asks_mpi(list_of_args: Iterable[Any]) -> bool:
    return any(getattr(a, "mpi", False) for a in list_of_args if isinstance(a, argparse.Namespace))


def _mpi_world(comm: Any) -> Any:
    if comm is not None:
        return comm
    from mpi4py import MPI

    return MPI.COMM_WORLD


def _communicator(args: Any, comm: Any, coordinator: Any) -> tuple[Any, bool]:
    """The communicator of a call, and whether the coordinator asks for dedicated I/O ranks."""
    if coordinator is not None:
        comm = getattr(coordinator, "comm", None)
        parallel_io = "Parallel" in type(coordinator).__name__
        return comm, parallel_io and comm is not None and comm.Get_size() >= 3
    if getattr(args, "mpi", False):
        comm = _mpi_world(comm)
    return comm, False


def _run(argvs: list[list[str]], comm: Any) -> tuple[int, int, int, list]:
    _adopt_desiutil_logging()
    handle = None if comm is None else comm.py2f()
    return _spex.run_job(argvs, handle)


def _adopt_desiutil_logging() -> None:
    """Gives the ``spex`` logger desiutil's handlers and level, when desiutil is there and
    the logger has no handler of its own, so that spex's records read like desispec's."""
    logger = logging.getLogger("spex")
    if logger.handlers:
        return
    try:
        from desiutil.log import get_logger
    except ImportError:
        return
    desi = get_logger()
    for handler in desi.handlers:
        logger.addHandler(handler)
    logger.setLevel(desi.getEffectiveLevel())
    logger.propagate = False
