"""A .fits.gz frame written by spex, read by astropy (Python's gzip) and by fitsio (cfitsio's
own inflater), against the same frame written plain.

    python gzip_readers.py FRAME.fits.gz FRAME.fits

spex deflates a .fits.gz by chunks in parallel and joins them into one gzip member; cfitsio
reads only the first member of a file, so a file of several members would lose HDUs or data
there. Checks that the file is one member, and that both readers find the plain file's HDUs
with the same data.
"""

import sys
import zlib

import fitsio
import numpy as np
from astropy.io import fits


def one_member(path):
    with open(path, "rb") as f:
        compressed = f.read()
    member = zlib.decompressobj(wbits=31)
    member.decompress(compressed)
    assert member.eof and member.unused_data == b"", f"{path}: not one gzip member"


def equal(a, b):
    if a.dtype.names:
        return all(np.array_equal(np.asarray(a[c]), np.asarray(b[c])) for c in a.dtype.names)
    return np.array_equal(a, b)


def main(gz, plain):
    one_member(gz)
    with fits.open(plain) as ref, fits.open(gz) as by_astropy, fitsio.FITS(gz) as by_cfitsio:
        names = [h.name for h in ref]
        assert [h.name for h in by_astropy] == names, [h.name for h in by_astropy]
        assert [h.get_extname() or "PRIMARY" for h in by_cfitsio] == names
        for k, hdu in enumerate(ref):
            if hdu.data is None:
                continue
            assert equal(hdu.data, by_astropy[k].data), f"astropy: {names[k]} differs"
            assert equal(hdu.data, by_cfitsio[k].read()), f"fitsio: {names[k]} differs"
    print(f"astropy and fitsio read the {len(names)} HDUs of {gz}")


if __name__ == "__main__":
    main(*sys.argv[1:])
