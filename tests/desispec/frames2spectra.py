"""A spex frame and a desispec-written frame of the same exposure combined by
desispec.pixgroup.frames2spectra, as desi_group_spectra does.

    python frames2spectra.py SPEX_FRAME WORKDIR

The desispec frame is made from the spex frame's arrays for the next spectrograph (camera
letter kept, spectrograph + 1, fibers + 500), with the scores desispec computes, written by
desispec.io.write_frame. Both files are read back as FrameLite and combined; the combined
spectra must hold both frames' fibers, fluxes and SCORES rows in camera order.
"""

import os
import sys
import warnings

import numpy as np

import client


def desispec_frame(spex_path, out_path):
    from desispec.io import read_frame, write_frame
    from desispec.specscore import compute_and_append_frame_scores

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        frame = read_frame(spex_path)
    camera = frame.meta["CAMERA"]
    frame.meta["CAMERA"] = f"{camera[0]}{int(camera[1:]) + 1}"
    # the bundled test images carry no FLAVOR; write_frame vets the frame
    if "FLAVOR" not in frame.meta:
        frame.meta["FLAVOR"] = "science"
    frame.fibermap["FIBER"] += 500
    frame.fibers = frame.fibermap["FIBER"]
    frame.spectrograph = None
    frame.scores, frame.scores_comments = None, None
    compute_and_append_frame_scores(frame, suffix="RAW")
    write_frame(out_path, frame)
    return frame.meta["CAMERA"]


def main(spex_path, workdir):
    client.require_empty_desimodel()
    from desispec.pixgroup import FrameLite, frames2spectra

    other = os.path.join(workdir, "frame-desispec.fits")
    camera = desispec_frame(spex_path, other)
    frames = [FrameLite.read(spex_path), FrameLite.read(other)]
    client.check(frames[1].meta["CAMERA"] == camera, "the desispec frame lost its camera")
    spectra = frames2spectra(frames)
    band = camera[0]
    nspec = frames[0].flux.shape[0]
    client.check(spectra.flux[band].shape[0] == 2 * nspec,
                 f"{spectra.flux[band].shape[0]} spectra, want {2 * nspec}")
    client.check(np.array_equal(spectra.flux[band][:nspec], frames[0].flux),
                 "the spex frame's fluxes are not the first rows")
    client.check(np.array_equal(spectra.fibermap["FIBER"][nspec:], frames[1].fibermap["FIBER"]),
                 "the desispec frame's fibers are not the last rows")
    for name in frames[0].scores.dtype.names:
        combined = np.asarray(spectra.scores[name])
        client.check(np.array_equal(combined[:nspec], frames[0].scores[name])
                     and np.array_equal(combined[nspec:], frames[1].scores[name]),
                     f"combined SCORES {name} are not the two frames' rows")
    print(f"frames2spectra: {2 * nspec} spectra, SCORES columns {frames[0].scores.dtype.names}")


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
