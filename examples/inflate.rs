//! Times the inflation of a gzip-compressed FITS file (desi_proc's preproc) as a read does it:
//! on one core, then in chunks on the pool's threads, each `--repeat` times in turn, with the
//! phases of the chunked path on the log.
//!
//! ```text
//! inflate preproc.fits.gz --threads 16 --repeat 3 [--only chunks]
//! ```

use std::path::PathBuf;
use std::time::Instant;

use anyhow::Context;
use clap::Parser;

#[global_allocator]
static GLOBAL: mimalloc::MiMalloc = mimalloc::MiMalloc;

#[derive(Parser)]
struct Args {
    /// The gzip-compressed file.
    file: PathBuf,
    /// Threads of the pool (default: the machine's cores).
    #[arg(long)]
    threads: Option<usize>,
    #[arg(long, default_value_t = 3)]
    repeat: usize,
    /// Only this way of inflating ("serial" or "chunks"), not both in turn.
    #[arg(long, value_parser = ["serial", "chunks"])]
    only: Option<String>,
}

fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    tracing_subscriber::fmt()
        .with_env_filter("spex::fits=debug")
        .with_target(false)
        .init();
    if let Some(threads) = args.threads {
        rayon::ThreadPoolBuilder::new()
            .num_threads(threads)
            .build_global()?;
    }
    let mut lengths = Vec::new();
    for _ in 0..args.repeat {
        let ways = match args.only.as_deref() {
            Some(how) => vec![how],
            None => vec!["serial", "chunks"],
        };
        for how in ways {
            std::env::set_var("SPEX_INFLATE", how);
            let t0 = Instant::now();
            let bytes = spex::fits::inflate_gzip(&args.file)?.context("not gzip-compressed")?;
            println!("{how}: {:.3} s", t0.elapsed().as_secs_f64());
            lengths.push((
                bytes.len(),
                bytes.iter().map(|&b| u64::from(b)).sum::<u64>(),
            ));
        }
    }
    anyhow::ensure!(
        lengths.windows(2).all(|w| w[0] == w[1]),
        "the inflations differ"
    );
    Ok(())
}
