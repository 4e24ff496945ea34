//! Gzip compression of a written FITS file, on every core.
//!
//! desi_proc names its frames `.fits.gz`. cfitsio would compress such a file on one thread
//! when it closes it, which takes longer than extracting the frame on a GPU; instead the
//! plain file is compressed here by independent blocks in parallel (`gzp`, pigz's scheme),
//! into one gzip member that any gzip reader (cfitsio, astropy, fitsio) reads.

use std::io::Write;
use std::path::Path;

use gzp::deflate::Gzip;
use gzp::par::compress::{ParCompress, ParCompressBuilder};
use gzp::{Compression, ZWriter};

use crate::error::{Error, Result};

/// The fastest level: on a full frame the file is 2.5% larger than at zlib's default level 6
/// and written three times faster (0.7 s instead of 2.3 s on two cores).
const LEVEL: u32 = 1;

/// Replaces the plain file at `path` by its gzip compression.
pub(super) fn compress_in_place(path: &Path) -> Result<()> {
    let io = |source: std::io::Error| Error::Io {
        path: path.into(),
        source,
    };
    let plain = std::fs::read(path).map_err(io)?;
    let file = crate::output::creating(|| std::fs::File::create(path)).map_err(io)?;
    let threads = std::thread::available_parallelism().map_or(1, |n| n.get());
    let gzip_error = |e: gzp::GzpError| Error::Fits {
        path: path.into(),
        what: "cannot compress".into(),
        message: e.to_string(),
    };
    let mut writer: ParCompress<Gzip, std::fs::File> = ParCompressBuilder::new()
        .num_threads(threads)
        .map_err(gzip_error)?
        .compression_level(Compression::new(LEVEL))
        .from_writer(file);
    writer.write_all(&plain).map_err(io)?;
    writer.finish().map_err(gzip_error)?;
    Ok(())
}
