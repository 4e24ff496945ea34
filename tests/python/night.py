"""A simulated night for desi_proc: the DESI_SPECTRO_DATA / DESI_SPECTRO_REDUX layout of one
science exposure of camera r0, with stub calibration, in a directory of the test's own.

desi_proc (desispec.scripts.proc) finds everything through desispec.io.findfile and
desispec.calibfinder; what is placed here is what it reads:

- the raw file ``desi-EXPID.fits.fz``: only its headers are read (SPEC: the exposure; R0: the
  camera), since the preproc is already there; its time stamp is older than the preproc's,
  so that desi_proc's ``runcmd`` skips ``desi_preproc`` as done;
- the preproc written by ``spex simulate`` (25 fibers over desi_proc's r grid), with SPECID
  and the amplifiers' DATASEC / BIASSEC added to its header and every fifth fiber made a sky fiber in its FIBERMAP, and the
  exposure's fibermap file beside it (so that ``desi_assemble_fibermap`` is not needed);
- ``DESI_SPECTRO_CALIB``: a yaml for the simulated detector naming the PSF (the bundled r PSF
  cut to its first 25 fibers, so that the extraction desi_proc asks for covers 25 fibers, not
  500) and a fiberflat of ones on desi_proc's r grid. It has no FIBERFLATVSHUMIDITY, SKYCORR,
  SKYGRADPCA or TPCORRPARAM entry: desispec then links the fiberflat as it is and fits the
  sky without those models, as it does for calibration data that lack them. Nor OFFCOLS:
  the sky step's CCD sectors read the PSF's traces with specter, which is not on PyPI.
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np

from conftest import DATA, run_program

NIGHT = 20201214
EXPID = 1234
CAMERA = "r0"
NFIBERS = 25
#: desi_proc's extraction grid for the r cameras (desispec/scripts/proc.py).
GRID = (5760.0, 7620.0, 0.8)
#: The simulated detector's spectrograph serial number: after 20191211 desispec's calibration
#: finder looks the yaml up by it.
SPECID = 4
SKY_EVERY = 5
#: The raw file's data and overscan sections of each amplifier (DESI's layout), which desispec's
#: sky step looks for in the frame's header to list the amplifiers.
AMPLIFIER_SECTIONS = {
    "A": ("[8:2064,4:2067]", "[2065:2164,4:2067]"),
    "B": ("[2265:4321,4:2067]", "[2165:2264,4:2067]"),
    "C": ("[8:2064,2132:4195]", "[2065:2164,2132:4195]"),
    "D": ("[2265:4321,2132:4195]", "[2165:2264,2132:4195]"),
}
#: Keywords fitsio writes itself from the data.
STRUCTURAL = {"SIMPLE", "XTENSION", "BITPIX", "NAXIS", "NAXIS1", "NAXIS2", "EXTEND", "PCOUNT",
              "GCOUNT", "TFIELDS", "CHECKSUM", "DATASUM"}


def cut_psf(path: Path, nfibers: int) -> None:
    """The bundled r PSF restricted to its first `nfibers` fibers."""
    import fitsio

    with fitsio.FITS(str(DATA / "psf-r0-00067784.fits")) as source, \
            fitsio.FITS(str(path), "rw", clobber=True) as out:
        for hdu in ("XTRACE", "YTRACE", "PSF"):
            data = source[hdu].read()
            data = data[:nfibers] if hdu != "PSF" else _cut_table(data, nfibers)
            header = [r for r in source[hdu].read_header().records()
                      if r["name"] not in STRUCTURAL and not r["name"].startswith(("TTYPE", "TFORM", "TDIM"))]
            out.write(data, header=header, extname=hdu)
            out[hdu].write_key("FIBERMAX", nfibers - 1)


def _cut_table(table: np.ndarray, nfibers: int) -> np.ndarray:
    dtype = [(n, table.dtype[n].base, (nfibers, table.dtype[n].shape[1])) if n == "COEFF"
             else (n, table.dtype[n]) for n in table.dtype.names]
    cut = np.zeros(len(table), dtype=dtype)
    for name in table.dtype.names:
        cut[name] = table[name][:, :nfibers] if name == "COEFF" else table[name]
    return cut


class Night:
    """The night directory under `root`; `environ` is what desi_proc needs to find it."""

    def __init__(self, root: Path):
        self.root = root
        self.environ = {
            "DESI_SPECTRO_DATA": str(root / "spectro" / "data"),
            "DESI_SPECTRO_REDUX": str(root / "spectro" / "redux"),
            "SPECPROD": "test",
            "DESI_SPECTRO_CALIB": str(root / "calib"),
            # Plain FITS: the simulated preproc is 270 MB uncompressed.
            "DESI_COMPRESSION": "NONE",
        }

    def path(self, filetype: str, **kw) -> Path:
        """desispec's path of a file of this night's exposure."""
        from desispec.io import findfile

        saved = {k: os.environ.get(k) for k in self.environ}
        os.environ.update(self.environ)
        try:
            return Path(findfile(filetype, night=NIGHT, expid=EXPID, camera=CAMERA, **kw))
        finally:
            for k, v in saved.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v

    def build(self, preproc: Path, psf: Path) -> None:
        """Lays out the night with the (already patched) `preproc` and `psf`."""
        raw = self.path("raw")
        raw.parent.mkdir(parents=True, exist_ok=True)
        self._write_raw(raw, preproc)
        old = raw.stat().st_mtime - 3600
        os.utime(raw, (old, old))
        target = self.path("preproc")
        target.parent.mkdir(parents=True, exist_ok=True)
        os.symlink(preproc, target)
        import fitsio

        fitsio.write(str(self.path("fibermap")), fitsio.read(str(preproc), "FIBERMAP"),
                     extname="FIBERMAP")
        self._write_calib(psf)

    def _write_raw(self, raw: Path, preproc: Path) -> None:
        import fitsio

        image = fitsio.read_header(str(preproc), "IMAGE")
        exposure = {k: image[k] for k in ("EXPID", "NIGHT", "OBSTYPE", "FLAVOR", "TILEID",
                                          "DATE-OBS", "MJD-OBS", "EXPTIME")}
        camera = {"CAMERA": CAMERA, "DETECTOR": image["DETECTOR"], "SPECID": SPECID,
                  "NIGHT": NIGHT, "DATE-OBS": image["DATE-OBS"], "EXPID": EXPID}
        with fitsio.FITS(str(raw), "rw", clobber=True) as out:
            out.write(None, header=exposure, extname="SPEC")
            out.write(np.zeros((2, 2), dtype=np.int16), header=camera, extname=CAMERA.upper())

    def _write_calib(self, psf: Path) -> None:
        from desispec.fiberflat import FiberFlat
        from desispec.io import write_fiberflat

        calib = Path(self.environ["DESI_SPECTRO_CALIB"])
        spec = calib / "spec" / f"sm{SPECID}"
        spec.mkdir(parents=True)
        (calib / "psf").mkdir()
        os.symlink(psf, calib / "psf" / psf.name)
        wave = desi_proc_wave()
        ones = np.ones((NFIBERS, wave.size))
        flat = FiberFlat(wave, ones, ivar=1e4 * ones, mask=np.zeros(ones.shape, dtype=np.uint32),
                         meanspec=np.ones(wave.size),
                         header={"CAMERA": CAMERA, "NIGHT": NIGHT, "EXPID": 1})
        write_fiberflat(str(calib / "fiberflat.fits"), flat)
        camera_id = f"sm{SPECID}-{CAMERA[0]}"
        (spec / f"{camera_id}.yaml").write_text(
            f"{camera_id}:\n"
            f"  V1:\n"
            f"    DATE-OBS-BEGIN: 20191211\n"
            f"    DETECTOR: sim\n"
            f"    PSF: psf/{psf.name}\n"
            f"    FIBERFLAT: fiberflat.fits\n"
        )


def desi_proc_wave() -> np.ndarray:
    wmin, wmax, dw = GRID
    return np.linspace(wmin, wmax, int(round((wmax - wmin) / dw)) + 1)


def simulate(workdir: Path) -> tuple[Path, Path]:
    """The 25-fiber PSF and the preproc simulated with it over desi_proc's r grid, the
    preproc's header and FIBERMAP completed for desispec's calibration finder and sky step."""
    import fitsio

    psf = workdir / f"psf-{CAMERA}-{NFIBERS}fibers.fits"
    cut_psf(psf, NFIBERS)
    preproc = workdir / f"night-preproc-{CAMERA}.fits"
    grid = ",".join(str(g) for g in GRID)
    run_program(["simulate", "-p", str(psf), "-o", str(preproc), "--truth",
                 str(workdir / "night-truth.fits"), "-w", grid, "--seed", "7",
                 "--loglevel", "warning"])
    with fitsio.FITS(str(preproc), "rw") as fits:
        fits["IMAGE"].write_key("SPECID", SPECID)
        fits["IMAGE"].write_key("EXPID", EXPID)
        for amp, (datasec, biassec) in AMPLIFIER_SECTIONS.items():
            fits["IMAGE"].write_key(f"DATASEC{amp}", datasec)
            fits["IMAGE"].write_key(f"BIASSEC{amp}", biassec)
        fibermap = fits["FIBERMAP"].read()
        fibermap["OBJTYPE"][::SKY_EVERY] = "SKY"
        fits["FIBERMAP"].write(fibermap, firstrow=0)
    return preproc, psf
