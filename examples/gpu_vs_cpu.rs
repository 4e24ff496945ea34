//! Runs the CUDA and CPU backends on the same patches and prints their agreement and the
//! GPU's phase timings.
//!
//! ```text
//! gpu_vs_cpu --psf psf.fits --preproc preproc.fits -w 6000,6400,0.8 -s 0 -n 25
//! gpu_vs_cpu --psf psf.fits --synthetic -w 5760,7620,0.8 -s 0 -n 500 --cpu-patches 100
//! ```
//!
//! `--synthetic` draws a CCD image from the PSF's own spots plus Poisson-like and read noise
//! (seeded), which is enough for timing a full frame; `--cpu-patches` limits the CPU
//! reference to the first patches so that a full frame can be checked in reasonable time.

use std::path::PathBuf;
use std::time::Instant;

use anyhow::{bail, Context};
use clap::Parser;
use rand::{RngExt, SeedableRng};
use rand_distr::{Distribution, Normal};
use rayon::prelude::*;

use spex::backend::cpu::CpuBackend;
use spex::backend::cuda::CudaBackend;
use spex::backend::{Backend, FrameInput, Progress};
use spex::extract::SolveOptions;
use spex::image::{Image, MaskRule};
use spex::plan::{Plan, PlanOptions};
use spex::psf::GaussHermitePsf;

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

/// A CCD image with every fiber's spots at smooth fluxes, read noise 3 e- and Poisson-like
/// noise, plus a few masked cosmic-ray tracks.
fn synthetic(psf: &GaussHermitePsf, plan: &Plan, seed: u64) -> Image {
    let (nrows, ncols) = (psf.npix_y, psf.npix_x);
    let fibers = plan.fibers();
    let waves = &plan.fullwave;
    let (ny, nx) = psf.spot_shape();
    // model, one bundle of fibers at a time, summed into per-thread images by row bands
    type FiberSpots = (Vec<f64>, Vec<(i32, i32)>);
    let per_fiber: Vec<FiberSpots> = fibers
        .clone()
        .into_par_iter()
        .map(|f| {
            let spots = psf.spots(f..f + 1, waves);
            let mut vals = Vec::with_capacity(waves.len() * ny * nx);
            let mut corners = Vec::with_capacity(waves.len());
            for (w, &wl) in waves.iter().enumerate() {
                let flux = 400.0 + 300.0 * (wl / 7.0 + f as f64).sin().abs();
                vals.extend(spots.spot(0, w).iter().map(|v| v * flux));
                corners.push(spots.corners.corner(0, w));
            }
            (vals, corners)
        })
        .collect();
    let mut model = vec![0f64; nrows * ncols];
    for (vals, corners) in &per_fiber {
        for (w, &(xc, yc)) in corners.iter().enumerate() {
            for iy in 0..ny {
                let r = yc as i64 + iy as i64;
                if r < 0 || r >= nrows as i64 {
                    continue;
                }
                for ix in 0..nx {
                    let c = xc as i64 + ix as i64;
                    if c >= 0 && c < ncols as i64 {
                        model[r as usize * ncols + c as usize] += vals[(w * ny + iy) * nx + ix];
                    }
                }
            }
        }
    }
    let read = 3.0f64;
    let mut pix = vec![0f32; nrows * ncols];
    let mut ivar = vec![0f32; nrows * ncols];
    pix.par_chunks_mut(ncols)
        .zip(ivar.par_chunks_mut(ncols))
        .enumerate()
        .for_each(|(r, (p, v))| {
            let mut rng = rand::rngs::StdRng::seed_from_u64(
                seed ^ (r as u64).wrapping_mul(0x9E37_79B9_7F4A_7C15),
            );
            let normal = Normal::new(0.0, 1.0).expect("unit normal");
            for c in 0..ncols {
                let m = model[r * ncols + c];
                let var = m.max(0.0) + read * read;
                p[c] = (m + var.sqrt() * normal.sample(&mut rng)) as f32;
                v[c] = (1.0 / var) as f32;
            }
        });
    // cosmic rays: short masked tracks
    let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
    for _ in 0..(nrows * ncols / 200_000) {
        let (r, c) = (rng.random_range(0..nrows), rng.random_range(0..ncols - 8));
        for k in 0..6 {
            ivar[r * ncols + c + k] = 0.0;
        }
    }
    Image {
        path: "synthetic".into(),
        nrows,
        ncols,
        pix,
        ivar,
        header: Vec::new(),
        has_fibermap: false,
        nmasked: 0,
        nnonfinite: 0,
    }
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
        (None, true) => synthetic(&psf, &plan, args.seed),
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
    };
    let input = FrameInput {
        plan: &plan,
        psf: &psf,
        image: &image,
        options: &options,
    };
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
        let t = Instant::now();
        gpu_results = gpu.extract(input, &plan.patches, &Progress::silent())?;
        let wall = t.elapsed().as_secs_f64();
        let tm = gpu.timings();
        println!(
            "gpu run {rep}: {:.1} ms wall, {} chunks, peak buffers {:.2} GB, device in use {:.2} GB, retried {}, cpu fallback {}, max Jacobi sweeps {}",
            wall * 1e3,
            tm.chunks,
            tm.peak_bytes as f64 / 1e9,
            tm.device_used_bytes as f64 / 1e9,
            tm.retried,
            tm.cpu_fallback,
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
