//! Runs the CUDA and CPU backends on the same patches and prints their agreement and the
//! GPU's phase timings.
//!
//! ```text
//! gpu_vs_cpu --psf psf.fits --preproc preproc.fits -w 6000,6400,0.8 -s 0 -n 25
//! gpu_vs_cpu --psf psf.fits --synthetic -w 5760,7620,0.8 -s 0 -n 500 --cpu-patches 100
//! ```
//!
//! `--synthetic` simulates the image in memory with `spex::simulate` (seeded), which is enough
//! for timing a full frame; `--cpu-patches` limits the CPU
//! reference to the first patches so that a full frame can be checked in reasonable time.

use std::path::PathBuf;
use std::time::Instant;

use anyhow::{bail, Context};
use clap::Parser;

use spex::backend::cpu::CpuBackend;
use spex::backend::cuda::CudaBackend;
use spex::backend::{Backend, FrameInput, Progress};
use spex::extract::SolveOptions;
use spex::image::{Image, MaskRule};
use spex::plan::{Plan, PlanOptions};
use spex::psf::GaussHermitePsf;
use spex::simulate::{simulate, SimulateOptions};

// The allocator of the spex binary, so that the host's share of a frame is timed as in
// production (with the system allocator, the frame's tables fault in fresh pages every time).
#[global_allocator]
static GLOBAL: mimalloc::MiMalloc = mimalloc::MiMalloc;

#[derive(Parser)]
struct Args {
    #[arg(long)]
    psf: PathBuf,
    #[arg(long, conflicts_with = "synthetic")]
    preproc: Option<PathBuf>,
    /// Simulate the image from the PSF instead of reading one.
    #[arg(long)]
    synthetic: bool,
    /// wmin,wmax,dw
    #[arg(short, long, default_value = "6000,6400,0.8")]
    wave: String,
    #[arg(short, long, default_value_t = 0)]
    specmin: usize,
    #[arg(short, long, default_value_t = 25)]
    nspec: usize,
    #[arg(long, default_value_t = 0.0)]
    regularize: f64,
    /// Also return model images.
    #[arg(long)]
    model: bool,
    /// CPU threads (0: all).
    #[arg(long, default_value_t = 0)]
    threads: usize,
    /// Solve only the first N patches on the CPU (all by default).
    #[arg(long)]
    cpu_patches: Option<usize>,
    /// GPU repetitions (the first one includes library warm-up).
    #[arg(long, default_value_t = 3)]
    repeat: usize,
    #[arg(long, default_value_t = 0)]
    device: usize,
    #[arg(long, default_value_t = 1)]
    seed: u64,
}

fn main() -> anyhow::Result<()> {
    tracing_subscriber::fmt()
        .with_env_filter(tracing_subscriber::EnvFilter::from_default_env())
        .with_writer(std::io::stderr)
        .init();
    let args = Args::parse();
    let w: Vec<f64> = args
        .wave
        .split(',')
        .map(|s| s.trim().parse::<f64>())
        .collect::<Result<_, _>>()
        .context("-w wants wmin,wmax,dw")?;
    if w.len() != 3 {
        bail!("-w wants wmin,wmax,dw");
    }
    let psf = GaussHermitePsf::read(&args.psf)?;
    let plan = Plan::new(PlanOptions::new(w[0], w[1], w[2], args.specmin, args.nspec))?;
    let t = Instant::now();
    let image = match (&args.preproc, args.synthetic) {
        (Some(p), _) => Image::read(p, MaskRule::AnyBit)?,
        (None, true) => {
            let mut o = SimulateOptions::new(
                plan.fibers(),
                plan.fullwave[0],
                plan.fullwave[plan.fullwave.len() - 1],
            );
            o.seed = args.seed;
            simulate(&psf, &o)?.to_image()
        }
        (None, false) => bail!("give --preproc or --synthetic"),
    };
    println!(
        "image {} x {} ready in {:.2} s",
        image.nrows,
        image.ncols,
        t.elapsed().as_secs_f64()
    );
    let options = SolveOptions {
        regularize: args.regularize,
        psferr: psf.psferr.unwrap_or(spex::psf::DEFAULT_PSFERR),
        model: args.model,
        reject_outliers: None,
    };
    let input = FrameInput::new(&plan, &psf, &image, &options);
    println!(
        "{} patches ({} fibers x {} bins, nwavetot {})",
        plan.patches.len(),
        args.nspec,
        plan.nwave(),
        plan.nwavetot
    );

    let t = Instant::now();
    let mut gpu = CudaBackend::new(args.device)?;
    println!(
        "{}: started in {:.2} s (NVRTC included)",
        gpu.describe(),
        t.elapsed().as_secs_f64()
    );
    let mut gpu_results = Vec::new();
    for rep in 0..args.repeat.max(1) {
        // the previous call's results go first: freeing them (some 2-3 ms for a full frame's
        // 4700 patches) is not part of the extraction
        drop(std::mem::take(&mut gpu_results));
        let t = Instant::now();
        gpu_results = gpu.extract(input, &plan.patches, &Progress::silent())?;
        let wall = t.elapsed().as_secs_f64();
        let tm = gpu.timings();
        println!(
            "gpu run {rep}: {:.1} ms wall, {} waves (upload {}), peak buffers {:.2} GB, device in use {:.2} GB, retried {}, cpu fallback {} ({} coupled), polar blocks {} (max {} steps), polar fallback {} (max Jacobi sweeps {})",
            wall * 1e3,
            tm.waves,
            if tm.pageable_upload { "pageable" } else { "pinned" },
            tm.peak_bytes as f64 / 1e9,
            tm.device_used_bytes as f64 / 1e9,
            tm.retried,
            tm.cpu_fallback,
            tm.coupled,
            tm.polar_blocks,
            tm.max_polar_steps,
            tm.polar_fallback,
            tm.max_sweeps
        );
        let phases: Vec<String> = tm
            .phases
            .iter()
            .map(|(p, ms)| format!("{p} {ms:.1}"))
            .collect();
        println!("  phases (ms): {}", phases.join(", "));
    }

    let ncpu = args
        .cpu_patches
        .unwrap_or(plan.patches.len())
        .min(plan.patches.len());
    if ncpu > 0 {
        let mut cpu = CpuBackend::new(args.threads)?;
        let t = Instant::now();
        let cpu_results = cpu.extract(input, &plan.patches[..ncpu], &Progress::silent())?;
        println!(
            "{}: {} patches in {:.2} s",
            cpu.describe(),
            ncpu,
            t.elapsed().as_secs_f64()
        );
        let a = spex::compare::agreement(&gpu_results[..ncpu], &cpu_results)?;
        println!("agreement over {a}");
        let failures = a.failures(1e-6);
        for f in &failures {
            println!("FAILED: {f}");
        }
        if !failures.is_empty() {
            bail!("the GPU and CPU backends disagree");
        }
        let mut statuses = std::collections::BTreeMap::new();
        for r in &gpu_results {
            *statuses.entry(format!("{:?}", r.status)).or_insert(0usize) += 1;
        }
        println!("gpu statuses: {statuses:?}");
    }
    Ok(())
}
