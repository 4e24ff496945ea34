"""desispec's steps downstream of extraction, run on spex's frames of simulated exposures and
checked against what the simulation knows.

    python downstream.py badcolumn FRAME PSF COLUMN OUT
    python downstream.py chain WORKDIR

badcolumn: desi_compute_badcolumn_mask's function (add_badcolumn_mask: the script itself
needs specter, which is not on PyPI, to read the traces) on a frame of an exposure simulated
with a bad column: the bins it flags are those whose fiber trace passes within desispec's
reach of the column (4.5 pixels), every fiber whose trace crosses the column is flagged, and
the frame still vets.

chain: in WORKDIR, spex's frames (frame-NAME.fits) and the truth files (truth-NAME.fits) of
one flat and two science exposures of the same seed, fibers 225..274 (the two bundles about
the amplifier boundary); the second science exposure has amplifiers B and D masked, so the
fibers past the boundary have no usable pixel:

- desi_compute_fiberflat on the flat: the fiberflat is the lamp's relative throughput
  (truth_i / median_j truth_j, desispec sets the median fiberflat to 1) within its errors,
  up to one common scale within the median's standard error;
- desi_compute_sky (--no-extra-variance: the statistical errors alone) on the science frame:
  the sky model of each sky fiber matches the simulated sky, R_i truth_i / (dw flat_i), with
  unbiased pulls;
- sframe (apply_fiberflat + subtract_sky): the sky fibers are left with noise, the targets
  with their object spectra, R_i (truth_i / flat_i - sky / flat_s) / dw, unbiased pulls;
- fully masked fibers enter the sky only through desispec's mean RESOLUTION: with that
  mean taken over the lit fibers, the lit fibers' sky model, sky variance and sframe ivar are
  within 1% of those of the frame without them (with the RESOLUTION as written, the ratio
  of the sky ivars is printed: see masked_fibers);
- frames2spectra + coadd of the two science sframes: one coadded spectrum per target, whose
  ivar is the sum of the exposures' and flux their ivar-weighted mean.

Pull bounds: over n samples of unit-variance pulls the mean has standard error 1/sqrt(n) and
the standard deviation 1/sqrt(2 n); the sky model is one spectrum reconvolved for every fiber
and the extraction correlates neighbouring bins, so n counts independent samples: the number
of bins divided by the resolution's width (2 * ndiag + 1), per spectrum that carries its own
noise. The bounds are 5 standard errors.
"""

import os
import sys
import warnings

import numpy as np

import client

# Pull bounds in standard errors: five keep a false failure below 1e-6 per check.
NSIGMA = 5.0


def read_frame(path):
    from desispec.io import read_frame as read

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        return read(path)


def truth(path):
    import fitsio

    wave = fitsio.read(path, "WAVELENGTH")
    flux, header = fitsio.read(path, "FLUX", header=True)
    return wave, flux, header["FIBERMIN"]


def convolve(frame, spectra):
    """Each fiber's spectrum (electrons per bin) through its resolution, per Angstrom."""
    dw = np.gradient(frame.wave)
    return np.array([frame.R[i].dot(s) for i, s in enumerate(spectra)]) / dw


def pull_check(what, pulls, nindependent):
    pulls = pulls[np.isfinite(pulls)]
    mean, std = float(np.mean(pulls)), float(np.std(pulls))
    mean_bound = NSIGMA / np.sqrt(nindependent)
    std_bound = NSIGMA / np.sqrt(2 * nindependent)
    print(f"{what}: {pulls.size} pulls, {nindependent:.0f} independent, mean {mean:+.4f} "
          f"(bound {mean_bound:.4f}), std {std:.4f} (bound 1 +- {std_bound:.4f})")
    client.check(abs(mean) < mean_bound, f"{what}: pull mean {mean:+.4f}, bound {mean_bound:.4f}")
    client.check(abs(std - 1) < std_bound, f"{what}: pull std {std:.4f}, bound 1 +- {std_bound:.4f}")


def resolution_width(frame):
    return frame.resolution_data.shape[1]


class Traces:
    """The x of the PSF's traces (its XTRACE Legendre series), for the frame's fibers: what
    desispec.badcolumn reads of an XYTraceSet. desispec's read_xytraceset builds it with
    specter, which is not on PyPI; desispec indexes it with the frame's row, which is the
    PSF's fiber for desi_proc's frames (fibers 0..499), so the rows are shifted by the frame's
    first fiber here."""

    def __init__(self, psf, fibermin):
        import fitsio

        coef, header = fitsio.read(psf, "XTRACE", header=True)
        self.coef, self.fibermin = coef, fibermin
        self.wmin, self.wmax = header["WAVEMIN"], header["WAVEMAX"]

    def x_vs_wave(self, row, wave):
        from numpy.polynomial.legendre import legval

        u = 2 * (np.asarray(wave) - self.wmin) / (self.wmax - self.wmin) - 1
        return legval(u, self.coef[self.fibermin + row])


def badcolumn(frame_path, psf, column, out):
    """desi_compute_badcolumn_mask's work (desispec.badcolumn.add_badcolumn_mask, which its
    main calls after reading the traces) on a frame of an exposure with a bad column."""
    from astropy.table import Table
    from desispec.badcolumn import add_badcolumn_mask
    from desispec.io import write_frame
    from desispec.maskbits import specmask

    frame = read_frame(frame_path)
    traces = Traces(psf, int(frame.fibermap["FIBER"][0]) % 500)
    # the simulation's excess of 300 electrons over the 900 s exposure
    table = Table({"COLUMN": [column], "ELEC_PER_SEC": [300.0 / 900.0]})
    add_badcolumn_mask(frame, traces, table)
    write_frame(out, frame)
    frame = read_frame(out)
    client.check(frame.vet() == 0, f"{out}: vet() == {frame.vet()}")
    x = np.array([traces.x_vs_wave(f, frame.wave) for f in range(frame.nspec)])
    flagged = (frame.mask & specmask.BADCOLUMN) != 0
    near = np.abs(x - column) < 4.5
    client.check(np.all(near[flagged]), "BADCOLUMN set where no trace passes near the column")
    crossing = np.any(np.abs(x - column) < 0.5, axis=1)
    client.check(np.any(crossing), "no fiber trace crosses the bad column: the test is void")
    client.check(np.all(np.any(flagged, axis=1)[crossing]),
                 "a fiber whose trace crosses the bad column has no BADCOLUMN bin")
    print(f"badcolumn: {flagged.sum()} bins of {np.any(flagged, axis=1).sum()} fibers flagged, "
          f"{crossing.sum()} fibers cross column {column}")


def fiberflat_step(workdir):
    from desispec.io import read_fiberflat
    from desispec.scripts import fiberflat as script

    out = os.path.join(workdir, "fiberflat.fits")
    script.main(script.parse(["-i", os.path.join(workdir, "frame-flat.fits"), "-o", out]))
    flat = read_fiberflat(out)
    _, lamp, _ = truth(os.path.join(workdir, "truth-flat.fits"))
    expected = lamp / np.median(lamp, axis=0)
    good = (flat.ivar > 0) & (flat.mask == 0)
    # desispec sets the median over fibers of the measured fiberflat to 1 at each wavelength;
    # the median of noisy values is not the noisy median of the truth, which leaves one
    # common scale, within the median's standard error 1.2533 sigma / sqrt(nfiber)
    scale = np.sum((flat.fiberflat * expected * flat.ivar)[good]) / np.sum(
        (expected**2 * flat.ivar)[good])
    sigma = np.median(1 / np.sqrt(flat.ivar[good]))
    bound = 1.2533 * sigma / np.sqrt(flat.fiberflat.shape[0])
    print(f"fiberflat: scale {scale:.5f} (bound 1 +- {bound:.5f}), relative error {sigma:.4f}")
    client.check(abs(scale - 1) < bound, f"fiberflat scale {scale}, bound 1 +- {bound}")
    pulls = ((flat.fiberflat - scale * expected) * np.sqrt(flat.ivar))[good]
    frame = read_frame(os.path.join(workdir, "frame-flat.fits"))
    # every fiber carries its own noise
    pull_check("fiberflat", pulls, good.sum() / resolution_width(frame))
    print(f"fiberflat: throughputs {expected[:, 0].min():.3f}..{expected[:, 0].max():.3f}")
    return flat, expected


def sky_step(workdir, name):
    from desispec.io import read_sky
    from desispec.scripts import sky as script

    out = os.path.join(workdir, f"sky-{name}.fits")
    script.main(script.parse(["-i", os.path.join(workdir, f"frame-{name}.fits"),
                              "--fiberflat", os.path.join(workdir, "fiberflat.fits"),
                              "-o", out, "--no-extra-variance"]))
    return read_sky(out)


def sframe(workdir, name, flat, sky):
    from desispec.fiberflat import apply_fiberflat
    from desispec.io import write_frame
    from desispec.sky import subtract_sky

    frame = read_frame(os.path.join(workdir, f"frame-{name}.fits"))
    nspec = frame.nspec
    apply_fiberflat(frame, flat[:nspec])
    subtract_sky(frame, sky)
    path = os.path.join(workdir, f"sframe-{name}.fits")
    write_frame(path, frame)
    return frame, path


def chain(workdir):
    flat, throughput = fiberflat_step(workdir)
    frame = read_frame(os.path.join(workdir, "frame-science.fits"))
    wave, spectra, fibermin = truth(os.path.join(workdir, "truth-science.fits"))
    client.check(np.array_equal(wave, frame.wave), "truth and frame grids differ")
    client.check(fibermin == frame.fibermap["FIBER"][0], "truth and frame fibers differ")
    sky_fibers = np.where(frame.fibermap["OBJTYPE"] == "SKY")[0]
    client.check(len(sky_fibers) >= 10, f"only {len(sky_fibers)} sky fibers")
    width = resolution_width(frame)
    nwave = len(wave)

    sky = sky_step(workdir, "science")
    # the sky each fiber's flat-fielded frame holds, from the sky fibers' truth
    unit_sky = spectra[sky_fibers[0]] / throughput[sky_fibers[0]]
    expected_sky = convolve(frame, [unit_sky] * frame.nspec)
    good = (sky.ivar > 0) & (sky.mask == 0)
    good[np.setdiff1d(np.arange(frame.nspec), sky_fibers)] = False
    pulls = ((sky.flux - expected_sky) * np.sqrt(sky.ivar))[good]
    # one spectrum for all fibers: its bins are the independent samples
    pull_check("sky model", pulls, nwave / width)

    science, science_path = sframe(workdir, "science", flat, sky)
    objects = spectra / throughput - unit_sky
    expected = convolve(frame, objects)
    targets = np.setdiff1d(np.arange(frame.nspec), sky_fibers)
    good = (science.ivar > 0) & (science.mask == 0)
    good[sky_fibers] = False
    pulls = ((science.flux - expected) * np.sqrt(science.ivar))[good]
    pull_check("sframe targets", pulls, len(targets) * nwave / width)

    masked_fibers(workdir, flat)
    sky = sky_step(workdir, "masked")
    sframe(workdir, "masked", flat, sky)
    coadd(workdir, science_path)


def sky_of(frame, flat):
    """desi_compute_sky's work on a frame in memory (apply_fiberflat, compute_sky without
    the extra variance), as for the files above."""
    from desispec.fiberflat import apply_fiberflat
    from desispec.sky import compute_sky

    apply_fiberflat(frame, flat)
    return compute_sky(frame, add_variance=False)


def ivar_ratio(what, with_dead, without):
    ok = without > 0
    ratio = with_dead[ok] / without[ok]
    print(f"{what} with/without the masked fibers: median {np.median(ratio):.6f}, "
          f"range {ratio.min():.6f}..{ratio.max():.6f}")
    return ratio


def masked_fibers(workdir, flat):
    """The sky and sframe of the lit fibers of the masked exposure, with the fully masked
    fibers and without them (the same frame less their rows).

    desispec's sky variance is that of the deconvolved sky convolved with the mean RESOLUTION
    of all the frame's fibers (desispec/sky.py, compute_sky), dead ones included, and the
    identity that desispec writes for them (as spex does) lets the deconvolution's
    high-frequency variance through: that effect is desispec's and is printed. Checked: the
    dead fibers' IVAR and MASK keep them out of the sky fit, so with their RESOLUTION set to
    the lit fibers' mean the lit fibers' sky model, sky ivar and sframe ivar are those of the
    frame without them (within 1%)."""
    from desispec.resolution import Resolution
    from desispec.sky import subtract_sky

    path = os.path.join(workdir, "frame-masked.fits")
    # desispec's value for bins no pixel constrains: the regularisation's ivar, far below 1e-10
    dead = np.all(read_frame(path).ivar < 1e-10, axis=1)
    client.check(dead.sum() >= 10, f"only {dead.sum()} fully masked fibers")
    lit = np.where(~dead)[0]
    without_frame = read_frame(path)[lit]
    without = sky_of(without_frame, flat[lit])
    subtract_sky(without_frame, without)

    as_written = sky_of(read_frame(path), flat)
    ivar_ratio(f"sky ivar of {len(lit)} lit fibers, {dead.sum()} masked fibers' RESOLUTION "
               "as written", as_written.ivar[lit], without.ivar)

    frame = read_frame(path)
    frame.resolution_data[dead] = frame.resolution_data[lit].mean(axis=0)
    frame.R = np.array([Resolution(r) for r in frame.resolution_data])
    sky = sky_of(frame, flat)
    ratio = ivar_ratio("sky ivar, masked fibers' RESOLUTION the lit mean", sky.ivar[lit],
                       without.ivar)
    client.check(np.all(np.abs(ratio - 1) < 0.01), "the masked fibers change the lit fibers' sky ivar")
    ok = without.ivar > 0
    pulls = (sky.flux[lit] - without.flux)[ok] * np.sqrt(without.ivar[ok])
    client.check(np.max(np.abs(pulls)) < 0.01, "the masked fibers change the lit fibers' sky model")
    subtract_sky(frame, sky)
    ratio = ivar_ratio("sframe ivar", frame.ivar[lit], without_frame.ivar)
    client.check(np.all(np.abs(ratio - 1) < 0.01), "the masked fibers change the lit fibers' sframe ivar")


def coadd(workdir, science_path):
    from desispec.coaddition import coadd as coadd_spectra
    from desispec.pixgroup import FrameLite, frames2spectra

    masked_path = os.path.join(workdir, "sframe-masked.fits")
    frames = [FrameLite.read(science_path), FrameLite.read(masked_path)]
    spectra = frames2spectra(frames)
    band = frames[0].meta["CAMERA"][0]
    nspec = frames[0].flux.shape[0]
    client.check(spectra.flux[band].shape[0] == 2 * nspec, "frames2spectra lost spectra")
    coadd_spectra(spectra)
    client.check(spectra.flux[band].shape[0] == nspec,
                 f"{spectra.flux[band].shape[0]} coadded spectra, want {nspec}")
    client.check(np.array_equal(spectra.fibermap["TARGETID"], frames[0].fibermap["TARGETID"]),
                 "coadded TARGETIDs are not the frame's")
    ivar = [f.ivar * (f.mask == 0) for f in frames]
    want_ivar = ivar[0] + ivar[1]
    want_flux = (frames[0].flux * ivar[0] + frames[1].flux * ivar[1]) / (want_ivar + (want_ivar == 0))
    ok = want_ivar > 0
    eps = np.finfo(np.float32).eps
    client.check(np.allclose(spectra.ivar[band][ok], want_ivar[ok], rtol=8 * eps, atol=0),
                 "coadded ivar is not the sum of the exposures'")
    scale = np.abs(want_flux[ok]) + 1 / np.sqrt(want_ivar[ok])
    client.check(np.all(np.abs(spectra.flux[band][ok] - want_flux[ok]) <= 8 * eps * scale),
                 "coadded flux is not the ivar-weighted mean")
    print(f"coadd: {nspec} targets from {len(frames)} exposures, ivar and flux as expected")


def main(argv):
    client.require_empty_desimodel()
    if argv[1] == "badcolumn":
        badcolumn(argv[2], argv[3], float(argv[4]), argv[5])
    elif argv[1] == "chain":
        chain(argv[2])
    else:
        client.fail(f"unknown command {argv[1]}")


if __name__ == "__main__":
    main(sys.argv)
