//! Times the write of a frame as desi_proc's line writes it: the arrays of an existing frame,
//! the preproc's header and FIBERMAP, the SCORES table, to a `.fits` or `.fits.gz` output,
//! a few times in one process. Prints per write the wall time, the CPU time of the process and
//! that of the calling thread (the write's serial part: rayon's threads and the gzip writer
//! do the rest).
//!
//! ```text
//! write_frame --frame frame.fits --preproc preproc.fits.gz -o out.fits.gz -n 3
//! ```

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Instant;

use clap::Parser;

use spex::frame::{ExtraHdu, Frame, FrameMeta};
use spex::image::{Image, MaskRule};
use spex::scores::ScoresHdu;

// The allocator of the spex binary, so that the frame's buffers are reused as in production.
#[global_allocator]
static GLOBAL: mimalloc::MiMalloc = mimalloc::MiMalloc;

#[derive(Parser)]
struct Args {
    /// A frame written by spex (its arrays are written again).
    #[arg(long)]
    frame: PathBuf,
    /// The preproc it was extracted from (header and FIBERMAP).
    #[arg(long)]
    preproc: PathBuf,
    /// Where to write (replaced at each write).
    #[arg(short, long)]
    output: PathBuf,
    /// Number of writes.
    #[arg(short, default_value_t = 3)]
    n: usize,
}

/// CPU time (user and system) of `who`, in seconds.
fn cpu_seconds(who: libc::c_int) -> f64 {
    // SAFETY: getrusage fills the zeroed struct it is given.
    let usage = unsafe {
        let mut usage: libc::rusage = std::mem::zeroed();
        libc::getrusage(who, &mut usage);
        usage
    };
    let seconds = |t: libc::timeval| t.tv_sec as f64 + t.tv_usec as f64 * 1e-6;
    seconds(usage.ru_utime) + seconds(usage.ru_stime)
}

fn main() -> anyhow::Result<()> {
    tracing_subscriber::fmt()
        .with_env_filter(tracing_subscriber::EnvFilter::from_env("SPEX_LOG"))
        .with_writer(std::io::stderr)
        .init();
    let args = Args::parse();
    let frame = Frame::read(&args.frame)?;
    let image = Image::read(&args.preproc, MaskRule::Bits(767))?;
    let step = frame.grid().2;
    let meta = FrameMeta {
        header: image.header.clone(),
        input: Some(args.preproc.clone()),
        fibermap_from: image.has_fibermap.then(|| args.preproc.clone()),
        grid: Some(frame.grid()),
        extra_hdus: vec![Arc::new(ScoresHdu { step }) as Arc<dyn ExtraHdu>],
        ..FrameMeta::default()
    };
    for _ in 0..args.n {
        // A new file each time, as a frame usually is: not the rename over an old one.
        match std::fs::remove_file(&args.output) {
            Err(e) if e.kind() != std::io::ErrorKind::NotFound => return Err(e.into()),
            _ => {}
        }
        let (cpu, thread, t0) = (
            cpu_seconds(libc::RUSAGE_SELF),
            cpu_seconds(libc::RUSAGE_THREAD),
            Instant::now(),
        );
        frame.write(&args.output, &meta)?;
        println!(
            "{}: wall {:.3} s, CPU {:.3} s, calling thread {:.3} s",
            args.output.display(),
            t0.elapsed().as_secs_f64(),
            cpu_seconds(libc::RUSAGE_SELF) - cpu,
            cpu_seconds(libc::RUSAGE_THREAD) - thread,
        );
    }
    Ok(())
}
