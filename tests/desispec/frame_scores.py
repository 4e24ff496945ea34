"""A frame written by spex, read by desispec: its SCORES against desispec's own computation,
and its arrays against the file.

    python frame_scores.py FRAME

Checks that desispec.io.read_frame reads the frame (FLUX, IVAR, MASK, WAVELENGTH,
RESOLUTION, FIBERMAP and SCORES), that what it read is what the file holds, that vet()
passes once the FLAVOR the test image lacks is supplied, that the SCORES columns are those
desispec computes on that frame (see client.compare_scores), and that the SCORES header is
the one desispec.io.write_frame writes for that frame.
Prints the largest relative difference of each SCORES column.
"""

import sys
import warnings

import fitsio
import numpy as np

import client


def compare_scores_header(path, frame):
    """The SCORES header cards of the file against those of the same frame written by
    desispec.io.write_frame (its checksums aside): same keywords and values, and the same
    comments on the column names (the comments of structural cards are the FITS writer's)."""
    import tempfile

    from desispec.io import write_frame

    with tempfile.TemporaryDirectory() as tmp:
        written = write_frame(f"{tmp}/frame.fits", frame)
        want = fitsio.read_header(written, "SCORES")
    got = fitsio.read_header(path, "SCORES")
    skip = {"CHECKSUM", "DATASUM"}
    want_keys = [k for k in want.keys() if k not in skip]
    got_keys = [k for k in got.keys() if k not in skip]
    client.check(got_keys == want_keys, f"SCORES keywords {got_keys}, desispec's {want_keys}")
    for key in want_keys:
        same_comment = not key.startswith("TTYPE") or got.get_comment(key) == want.get_comment(key)
        client.check(got[key] == want[key] and same_comment,
                     f"SCORES {key} = {got[key]!r} / {got.get_comment(key)!r}, desispec's "
                     f"{want[key]!r} / {want.get_comment(key)!r}")


def main(path):
    client.require_empty_desimodel()
    from desispec.io import read_frame

    with warnings.catch_warnings():
        # The bundled test images carry no FLAVOR, so vet() warns; the pipeline checks
        # assert vet() == 0 on frames of complete preproc files.
        warnings.simplefilter("ignore", UserWarning)
        frame = read_frame(path)
    nspec, nwave = frame.flux.shape
    for name, array in [("FLUX", frame.flux), ("IVAR", frame.ivar), ("MASK", frame.mask)]:
        on_disk = fitsio.read(path, name)
        client.check(on_disk.shape == (nspec, nwave), f"{name} shape {on_disk.shape}")
        client.check(np.array_equal(array, on_disk), f"read_frame's {name} differs from the file")
    client.check(np.array_equal(frame.wave, fitsio.read(path, "WAVELENGTH")),
                 "read_frame's wavelengths differ from the file")
    resolution = fitsio.read(path, "RESOLUTION")
    client.check(frame.resolution_data.shape == resolution.shape,
                 f"RESOLUTION shape {frame.resolution_data.shape}, file {resolution.shape}")
    client.check(np.array_equal(frame.fibers, fitsio.read(path, "FIBERMAP")["FIBER"]),
                 "read_frame's fibers are not the FIBERMAP's")
    # spex carries the preproc header through; the bundled test images have no FLAVOR, which
    # is vet()'s only complaint about such a frame: with it supplied, vet() must pass.
    if "FLAVOR" not in frame.meta:
        frame.meta["FLAVOR"] = "science"
    client.check(frame.vet() == 0, f"{path}: vet() == {frame.vet()} with FLAVOR supplied")
    worst = client.compare_scores(path, frame)
    compare_scores_header(path, frame)
    for name, rel in worst.items():
        print(f"{name}: max relative difference {rel:.3e}")


if __name__ == "__main__":
    main(sys.argv[1])
