"""Shared inputs of the Python package's tests: the `spex` program (the reference every
Python call is compared with), simulated preprocs of 25 fibers for the b, r and z cameras,
desi_proc's job lines for them, and a byte comparison of FITS files that ignores only the
keywords that change from one write to the next."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import types
import tempfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
DATA = REPO / "tests" / "data"

#: A grid per camera inside desi_proc's and inside the band of desispec's scores, desi_proc's
#: psferr, and the PSF's domain for b and z (the bundled r PSF with its domain moved, so its
#: traces land on the same pixels). The grids are cut to 80 Angstrom to keep the tests short.
CAMERAS = {
    "b0": ("4000.0,4080.0,0.8", "0.04", (3500.0, 5900.0)),
    "r0": ("5800.0,5880.0,0.8", "0.01", None),
    "z0": ("7600.0,7680.0,0.8", "0.01", (7450.0, 9900.0)),
}

#: desi_proc's lines: science (and sky) frames carry --barycentric-correction, flats and arcs
#: do not.
KINDS = {"science": ["--barycentric-correction"], "flat": [], "arc": []}

#: desispec's main_gpu_specter timing keys, gpu_specter's between frame-setup and
#: frame-extract, in the order of the steps they end.
DESISPEC_TIMING = ["frame-start", "frame-setup", "init-mpi-comm", "init-mpi-bcast",
                   "host-to-device", "extracted-bundles", "staged-bundles", "merged-bundles",
                   "assembled-frame", "frame-extract", "frame-write"]


#: Keywords that differ between two writes of the same frame.
VOLATILE = (b"CHECKSUM=", b"DATASUM =", b"DATE    =")


def _stand_in_for_specter() -> None:
    """desispec imports specter (not on PyPI) for its specter path and its quick-look
    extraction, which these tests never take: where specter is missing, empty modules stand in
    for the modules desispec imports, each name in them a function that refuses to run, so
    that desispec's extraction and desi_proc load."""
    try:
        import specter  # noqa: F401
        return
    except ImportError:
        pass

    def refuse(*args, **kwargs):
        raise RuntimeError("specter is not installed")

    def module(name: str) -> types.ModuleType:
        stand_in = types.ModuleType(name)
        stand_in.__path__ = []
        stand_in.__version__ = "not installed"

        def attribute(attr: str):
            if attr.startswith("_"):
                raise AttributeError(attr)
            return refuse

        stand_in.__getattr__ = attribute
        return stand_in

    names = ["specter", "specter.psf", "specter.extract", "specter.util", "specter.util.traceset"]
    modules = {name: module(name) for name in names}
    for name, stand_in in modules.items():
        parent, _, child = name.rpartition(".")
        if parent:
            setattr(modules[parent], child, stand_in)
    sys.modules.update(modules)


_stand_in_for_specter()
# desispec imports need no desimodel data for these tests: an empty directory, removed when
# the process ends.
if "DESIMODEL" not in os.environ:
    _EMPTY_DESIMODEL = tempfile.TemporaryDirectory(prefix="desimodel-")
    os.environ["DESIMODEL"] = _EMPTY_DESIMODEL.name


def spex_program() -> Path:
    """The release build of the program (SPEX_BIN overrides)."""
    path = Path(os.environ.get("SPEX_BIN", REPO / "target" / "release" / "spex"))
    if not path.is_file():
        pytest.fail(f"{path} is missing: build it with `cargo build --release` first")
    return path


def run_program(args: list[str], check: bool = True,
                environ: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    """Runs `spex` with `args` in a process of its own (never under this test's MPI), with
    `environ` added to the environment."""
    done = subprocess.run(
        [str(spex_program()), *args], capture_output=True, text=True,
        env=dict(program_environ(), **(environ or {})), timeout=600,
    )
    if check and done.returncode != 0:
        pytest.fail(f"spex {' '.join(args)} exited {done.returncode}:\n{done.stderr}")
    return done


def program_environ() -> dict[str, str]:
    """This process's environment without the variables of an MPI launcher, for processes
    that must not join this test's MPI job."""
    return {k: v for k, v in os.environ.items() if not k.startswith(("OMPI_", "PMIX_", "PMI_"))}


def mpiexec_command(ranks: int) -> list[str]:
    """Open MPI's launcher of `ranks` processes, on however many cores there are."""
    launcher = shutil.which("mpiexec")
    assert launcher, "mpiexec is missing: install openmpi-bin (scripts/setup does)"
    command = [launcher, "-n", str(ranks), "--oversubscribe"]
    if os.geteuid() == 0:
        command.append("--allow-run-as-root")
    return command


def camera_psf(camera: str, workdir: Path) -> Path:
    r = DATA / "psf-r0-00067784.fits"
    domain = CAMERAS[camera][2]
    if domain is None:
        return r
    import fitsio

    path = workdir / f"psf-{camera}.fits"
    shutil.copy(r, path)
    with fitsio.FITS(str(path), "rw") as fits:
        for hdu in ("PSF", "XTRACE", "YTRACE"):
            fits[hdu].write_key("WAVEMIN", domain[0])
            fits[hdu].write_key("WAVEMAX", domain[1])
        fits["PSF"].write_key("CAMERA", camera)
    return path


@pytest.fixture(scope="session")
def workdir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("spex-python")


@pytest.fixture(scope="session")
def inputs(workdir) -> dict[str, tuple[Path, Path]]:
    """(preproc, psf) of each camera: 25 simulated fibers over the camera's test grid."""
    made = {}
    for camera, (grid, _, _) in CAMERAS.items():
        psf = camera_psf(camera, workdir)
        preproc = workdir / f"preproc-{camera}.fits"
        truth = workdir / f"truth-{camera}.fits"
        run_program(["simulate", "-p", str(psf), "-o", str(preproc), "--truth", str(truth),
                     "-w", grid, "-n", "25"])
        made[camera] = (preproc, psf)
    return made


def job_line(inputs, camera: str, kind: str, output: Path) -> str:
    """desi_proc's extraction line for `camera` (with `-n 25` and the short grid)."""
    preproc, psf = inputs[camera]
    grid, psferr, _ = CAMERAS[camera]
    words = ["desi_extract_spectra", "-w", grid, "-i", str(preproc), "-p", str(psf),
             "-o", str(output), "--psferr", psferr, "--no-gpu", "-n", "25", *KINDS[kind]]
    return " ".join(words)


def masked_bytes(path: Path) -> bytes:
    """A FITS file's bytes with the cards of VOLATILE blanked (cards are 80-byte records
    aligned on 80 bytes from the start of the file)."""
    data = bytearray(Path(path).read_bytes())
    for at in range(0, len(data), 80):
        if data[at:at + 9] in VOLATILE:
            data[at:at + 80] = b" " * 80
    return bytes(data)


def assert_same_frame(a: Path, b: Path) -> None:
    """Two frame files hold the same bytes apart from checksum and date keywords."""
    ma, mb = masked_bytes(a), masked_bytes(b)
    assert len(ma) == len(mb), f"{a} has {len(ma)} bytes, {b} {len(mb)}"
    if ma != mb:
        first = next(i for i in range(len(ma)) if ma[i] != mb[i])
        pytest.fail(f"{a} and {b} differ first at byte {first} (record {first // 80}): "
                    f"{ma[first // 80 * 80:first // 80 * 80 + 80]!r} vs "
                    f"{mb[first // 80 * 80:first // 80 * 80 + 80]!r}")
