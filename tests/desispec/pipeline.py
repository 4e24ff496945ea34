"""desispec's view of the files of spex's integrated command line (issue 11): the simulated
preproc images and the frames of desi_proc's job lines run through spex.

    python pipeline.py read-image PREPROC
    python pipeline.py job-line FRAME PREPROC WMIN,WMAX,DW [--barycentric]
    python pipeline.py vet FRAME

read-image: desispec.io.read_image and read_fibermap read the image, with the keywords
desispec needs (CAMERA, FLAVOR, OBSTYPE, NIGHT, EXPID, TILEID, MJD-OBS, EXPTIME, a read
noise per amplifier) and a pointing the barycentric correction can use.

job-line: a frame written by `spex -w WMIN,WMAX,DW -i PREPROC -p PSF -o FRAME --psferr 0.01
[--barycentric-correction]`, as desi_extract_spectra would have written it: read_frame reads
it and vet() == 0; WAVELENGTH is desispec's grid bit for bit and WAVEMIN/WAVEMAX/WAVESTEP the
requested values; HELIOCOR is desispec's factor for the preproc (to the bit) with
--barycentric, absent without; MASK is uint32; every HDU has a valid CHECKSUM and DATASUM; a
.gz name holds gzip data; the provenance names spex; SCORES are desispec's.
"""

import sys
import warnings

import numpy as np

import client


def read_image(preproc):
    from desispec.io import read_fibermap, read_image

    image = read_image(preproc)
    for key in ["CAMERA", "FLAVOR", "OBSTYPE", "NIGHT", "EXPID", "TILEID", "MJD-OBS", "EXPTIME"]:
        client.check(key in image.meta, f"{preproc}: read_image's header lacks {key}")
    client.check(np.all(np.isfinite(image.readnoise)) and np.all(image.readnoise > 0),
                 f"{preproc}: read noise {np.unique(image.readnoise)}")
    client.check(image.pix.shape == image.ivar.shape == image.mask.shape,
                 f"{preproc}: IMAGE/IVAR/MASK shapes differ")
    fibermap = read_fibermap(preproc)
    client.check(len(fibermap) > 0 and "TARGETID" in fibermap.colnames,
                 f"{preproc}: read_fibermap found no TARGETID column")
    factor = extraction_factor(preproc)
    client.check(abs(factor - 1) < 1e-3, f"{preproc}: barycentric factor {factor}")
    print(f"read_image: {image.camera} {image.pix.shape}, fibermap {len(fibermap)} rows, "
          f"barycentric factor {factor!r}")


def extraction_factor(preproc):
    """desi_extract_spectra's choice of header for the barycentric factor: the image's when
    it has RA or TARGTRA, else the fibermap's."""
    from desispec.io import read_fibermap, read_image

    factor = client.desispec_barycentric_factor()
    meta = read_image(preproc).meta
    if "RA" in meta or "TARGTRA" in meta:
        return factor(meta)
    return factor(read_fibermap(preproc).meta)


def vet(path):
    from desispec.io import read_frame

    with warnings.catch_warnings():
        # read_frame only warns when vet() fails; the check below fails instead
        warnings.simplefilter("ignore", UserWarning)
        frame = read_frame(path)
    client.check(frame.vet() == 0, f"{path}: vet() == {frame.vet()}")
    return frame


def job_line(path, preproc, grid, barycentric):
    import fitsio
    from astropy.io import fits
    from desiutil.depend import getdep, hasdep

    wmin, wmax, dw = map(float, grid.split(","))
    if path.endswith(".gz"):
        with open(path, "rb") as f:
            client.check(f.read(2) == b"\x1f\x8b", f"{path} is not gzip-compressed")
    frame = vet(path)
    meta = frame.meta
    client.check(np.array_equal(frame.wave, np.arange(wmin, wmax + 0.5 * dw, dw)),
                 f"{path}: WAVELENGTH is not desispec's np.arange grid bit for bit")
    for key, want in [("WAVEMIN", wmin), ("WAVEMAX", wmax), ("WAVESTEP", dw)]:
        client.check(meta.get(key) == want, f"{path}: {key} = {meta.get(key)!r}, want {want!r}")
    client.check(meta.get("BUNIT") == "electron/Angstrom", f"{path}: BUNIT {meta.get('BUNIT')!r}")
    client.check(meta.get("NSPEC") == frame.flux.shape[0], f"{path}: NSPEC {meta.get('NSPEC')}")
    client.check(hasdep(meta, "spex"), f"{path}: DEPNAM/DEPVER do not name spex")
    # the keywords spex writes beyond desispec's (vet() passed above with them)
    client.check(meta.get("SPECTER") == getdep(meta, "spex"), f"{path}: SPECTER {meta.get('SPECTER')!r}")
    client.check("SPECMIN" in meta, f"{path}: no SPECMIN")
    if barycentric:
        want = extraction_factor(preproc)
        got = meta.get("HELIOCOR")
        client.check(got == want, f"{path}: HELIOCOR {got!r}, desispec's factor {want!r}")
        print(f"HELIOCOR {got!r}, desispec's factor to the bit")
    else:
        client.check("HELIOCOR" not in meta, f"{path}: HELIOCOR without barycentric correction")
    client.check(fitsio.read(path, "MASK").dtype == np.uint32, f"{path}: MASK is not uint32")
    with fits.open(path, checksum=True) as hdus:
        for hdu in hdus:
            client.check("CHECKSUM" in hdu.header and hdu.verify_checksum() == 1,
                         f"{path}: HDU {hdu.name} has no valid CHECKSUM")
            client.check("DATASUM" in hdu.header and hdu.verify_datasum() == 1,
                         f"{path}: HDU {hdu.name} has no valid DATASUM")
    worst = client.compare_scores(path, frame)
    print(f"{path}: vet 0, SCORES max relative difference {max(worst.values()):.2e}")


def main(argv):
    client.require_empty_desimodel()
    command = argv[1]
    if command == "read-image":
        read_image(argv[2])
    elif command == "job-line":
        job_line(argv[2], argv[3], argv[4], "--barycentric" in argv[5:])
    elif command == "vet":
        vet(argv[2])
        print(f"{argv[2]}: vet 0")
    else:
        client.fail(f"unknown command {command}")


if __name__ == "__main__":
    main(sys.argv)
