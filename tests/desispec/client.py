"""What the desispec client checks share: the environment they run in, desispec's own code
for what cannot be imported, and the comparisons.

Every check exits 0 when it holds and 1 with a line starting with "FAIL:" when it does not.
"""

import ast
import importlib.util
import os
import sys


def fail(message):
    print(f"FAIL: {message}", file=sys.stderr)
    sys.exit(1)


def check(condition, message):
    if not condition:
        fail(message)


def require_empty_desimodel():
    """The checks must not depend on desimodel's data: DESIMODEL points to an empty directory,
    so that any read of them fails loudly."""
    path = os.environ.get("DESIMODEL")
    check(path is not None and os.path.isdir(path), "DESIMODEL is not set to a directory")
    check(not os.listdir(path), f"DESIMODEL={path} is not empty")


def desispec_barycentric_factor():
    """desispec.scripts.extract.barycentric_correction_multiplicative_factor, compiled from the
    installed desispec's source.

    Importing desispec.scripts.extract needs specter, which PyPI does not serve under that
    name, so the function is taken from the module's source and run with the names it uses.
    desi_extract_spectra freezes astropy's IERS tables (desiutil.iers.freeze_iers) before it
    computes the factor; so does this.
    """
    from desiutil.iers import freeze_iers
    from desiutil.log import get_logger
    from desispec.heliocentric import barycentric_velocity_multiplicative_corr

    freeze_iers()
    origin = importlib.util.find_spec("desispec.scripts.extract").origin
    with open(origin) as f:
        tree = ast.parse(f.read(), origin)
    name = "barycentric_correction_multiplicative_factor"
    found = [n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == name]
    check(len(found) == 1, f"{origin} does not define {name}")
    namespace = {
        "barycentric_velocity_multiplicative_corr": barycentric_velocity_multiplicative_corr,
        "get_logger": get_logger,
    }
    module = ast.Module(body=found, type_ignores=[])
    exec(compile(module, origin, "exec"), namespace)
    return namespace[name]


def compare_scores(path, frame):
    """The SCORES HDU of `path` (read into `frame.scores` by desispec) against desispec's
    compute_and_append_frame_scores(frame, suffix="RAW") on the frame as desispec read it:
    the same columns in the same order, float64, the comments on the TTYPE cards, no units,
    and the values within 1e-6 relative.

    The file holds FLUX and IVAR as float32; scores computed before that rounding (as
    desi_extract_spectra and spex both do) may differ from these by the rounding, which for
    a sum of values of either sign is bounded by 2^-24 sum|flux| rather than by the sum
    itself: that bound is added to the tolerance of the SUM columns. Returns the largest
    relative difference of each column.
    """
    import fitsio
    import numpy as np
    from desispec.specscore import compute_and_append_frame_scores

    check(frame.scores is not None, f"{path} has no SCORES HDU")
    written = frame.scores
    header = fitsio.read_header(path, "SCORES")
    frame.scores, frame.scores_comments = None, None
    expected, comments = compute_and_append_frame_scores(frame, suffix="RAW")
    names = list(written.dtype.names)
    check(names == list(expected), f"SCORES columns {names}, desispec's {list(expected)}")
    band = names[0][-1].lower()
    lo, hi = {"b": (4000, 5800), "r": (5800, 7600), "z": (7600, 9800)}[band]
    inside = (frame.wave >= lo) & (frame.wave < hi)
    worst = {}
    for i, name in enumerate(names, start=1):
        column = written[name]
        check(column.dtype.kind == "f" and column.dtype.itemsize == 8,
              f"SCORES {name} is {column.dtype}, desispec writes float64")
        check(header.get_comment(f"TTYPE{i}") == comments[name],
              f"TTYPE{i} comment {header.get_comment(f'TTYPE{i}')!r}, desispec's {comments[name]!r}")
        check(f"TUNIT{i}" not in header, f"SCORES {name} has a unit; desispec writes none")
        want = np.asarray(expected[name], dtype=np.float64)
        check(column.shape == want.shape, f"SCORES {name} has {column.shape} rows, want {want.shape}")
        tolerance = 1e-6 * np.abs(want)
        if name.startswith("SUM_"):
            tolerance += 2.0**-24 * np.abs(frame.flux[:, inside]).sum(axis=1)
        diff = np.abs(column - want)
        bad = ~(diff <= tolerance)
        check(not bad.any(),
              f"SCORES {name} differs from desispec's for fibers {np.flatnonzero(bad)[:5]}: "
              f"{column[bad][:5]} vs {want[bad][:5]}")
        worst[name] = float(np.max(diff / np.maximum(np.abs(want), 1e-300)))
    return worst
