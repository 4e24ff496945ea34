"""A frame written by spex, read by desispec: its SCORES against desispec's own computation,
and its arrays against the file.

    python frame_scores.py FRAME

Checks that desispec.io.read_frame reads the frame (FLUX, IVAR, MASK, WAVELENGTH,
RESOLUTION, FIBERMAP and SCORES), that what it read is what the file holds, that vet()
passes once the FLAVOR the test image lacks is supplied, and that the
SCORES columns are those desispec computes on that frame (see client.compare_scores).
Prints the largest relative difference of each SCORES column.
"""

import sys
import warnings

import fitsio
import numpy as np

import client


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
    for name, rel in worst.items():
        print(f"{name}: max relative difference {rel:.3e}")


if __name__ == "__main__":
    main(sys.argv[1])
