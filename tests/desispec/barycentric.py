"""desispec's barycentric correction factor for header cases written by the Rust test.

    python barycentric.py CASES

CASES holds FITS header cards, one per line, cases separated by a line "END". Each case is
parsed by astropy as desispec reads a preproc header, and one line "factor F" is printed
per case, F being desispec's factor as a Python float repr (round-trips exactly).
"""

import sys

from astropy.io import fits

import client


def main(path):
    client.require_empty_desimodel()
    factor = client.desispec_barycentric_factor()
    with open(path) as f:
        cases = f.read().split("END\n")
    for cards in cases:
        cards = [c for c in cards.splitlines() if c.strip()]
        if not cards:
            continue
        header = fits.Header.fromstring("".join(c.ljust(80) for c in cards))
        print("factor", repr(float(factor(header))))


if __name__ == "__main__":
    main(sys.argv[1])
