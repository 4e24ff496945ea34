//! The `spex` binary: parse the command line, set up logging, run, and map the outcome to an
//! exit status (0 success, 1 error, 2 usage, 3 a comparison outside its limits).

use std::io::IsTerminal;
use std::process::ExitCode;

use anyhow::Context;
use clap::Parser;
use spex::backend::{self, BackendKind, Progress};
use spex::cli::{with_default_subcommand, Cli, Command, CompareArgs, ExtractArgs, SimulateArgs};
use spex::compare::{self, ParityLimits, PullLimits, Truth};
use spex::frame::Frame;
use spex::pipeline;
use spex::psf::GaussHermitePsf;
use spex::simulate;

/// Exit status of a comparison that ran but fell outside its limits.
const EXIT_COMPARISON_FAILED: u8 = 3;

fn main() -> ExitCode {
    let args = with_default_subcommand(std::env::args_os().collect());
    let cli = match Cli::try_parse_from(args) {
        Ok(cli) => cli,
        Err(e) => {
            let _ = e.print();
            return if e.use_stderr() {
                ExitCode::from(2)
            } else {
                ExitCode::SUCCESS
            };
        }
    };
    let loglevel = match &cli.command {
        Command::Extract(a) => a.loglevel.as_str(),
        Command::Simulate(a) => a.loglevel.as_str(),
        Command::Compare(_) => "info",
    };
    init_logging(loglevel);
    match run(cli) {
        Ok(code) => code,
        Err(e) => {
            eprintln!("spex: error: {e:#}");
            ExitCode::FAILURE
        }
    }
}

fn init_logging(level: &str) {
    let level = match level {
        "warning" => "warn",
        "critical" => "error",
        l => l,
    };
    let filter = tracing_subscriber::EnvFilter::try_from_env("SPEX_LOG")
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new(format!("spex={level},warn")));
    tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .with_target(false)
        .with_ansi(std::io::stderr().is_terminal())
        .init();
}

fn run(cli: Cli) -> anyhow::Result<ExitCode> {
    match cli.command {
        Command::Extract(args) => run_extract(&args),
        Command::Simulate(args) => run_simulate(&args),
        Command::Compare(args) => run_compare(&args),
    }
}

/// A progress bar on a terminal, nothing in a batch log.
fn progress() -> Progress {
    if !std::io::stderr().is_terminal() {
        return Progress::silent();
    }
    let bar = indicatif::ProgressBar::new(0);
    bar.set_style(
        indicatif::ProgressStyle::with_template(
            "{elapsed_precise} [{bar:40}] {pos}/{len} patches ({per_sec}, eta {eta})",
        )
        .unwrap_or_else(|_| indicatif::ProgressStyle::default_bar()),
    );
    Progress::new(move |done, total| {
        bar.set_length(total as u64);
        bar.set_position(done as u64);
        if done >= total {
            bar.finish_and_clear();
        }
    })
}

fn run_extract(args: &ExtractArgs) -> anyhow::Result<ExitCode> {
    let requests = args.requests()?;
    let kind = if args.use_gpu() {
        BackendKind::Cuda
    } else {
        BackendKind::Cpu
    };
    let mut backend = backend::create(kind, args.threads, args.device.unwrap_or(0))
        .context("cannot start the backend")?;
    let mut failed = 0usize;
    let mut comparison_failed = false;
    let nframes = requests.len();
    for request in &requests {
        if args.skip_existing && request.output.exists() {
            tracing::info!("{} exists, skipped", request.output.display());
            continue;
        }
        let outcome = pipeline::extract_frame(request, backend.as_mut(), &progress())
            .with_context(|| format!("frame {}", request.input.display()));
        match outcome {
            Ok(report) => {
                if let Some(reference) = &args.test {
                    let other = Frame::read(reference)?;
                    let parity = compare::parity(
                        &report.frame,
                        &other,
                        ParityLimits::default().rel_tolerance,
                    )?;
                    println!(
                        "{} vs {}:\n{parity}",
                        request.output.display(),
                        reference.display()
                    );
                    let failures = parity.failures(&ParityLimits::default());
                    for f in &failures {
                        eprintln!("spex: test failed: {f}");
                    }
                    comparison_failed |= !failures.is_empty();
                }
            }
            Err(e) if nframes > 1 => {
                eprintln!("spex: error: {e:#}");
                failed += 1;
            }
            Err(e) => return Err(e),
        }
    }
    if failed > 0 {
        eprintln!("spex: {failed} of {nframes} frames failed");
        return Ok(ExitCode::from(failed.min(100) as u8));
    }
    Ok(if comparison_failed {
        ExitCode::from(EXIT_COMPARISON_FAILED)
    } else {
        ExitCode::SUCCESS
    })
}

fn run_simulate(args: &SimulateArgs) -> anyhow::Result<ExitCode> {
    let psf = GaussHermitePsf::read(&args.psf)?;
    let options = args.options(psf.nfiber);
    let t0 = std::time::Instant::now();
    let sim = simulate::simulate(&psf, &options)?;
    sim.write(&args.output, &args.truth)?;
    tracing::info!(
        "simulated fibers {:?}, {} bins, {} cosmic tracks: {} and {} in {:.2} s",
        sim.fibers,
        sim.wave.len(),
        sim.ncosmic,
        args.output.display(),
        args.truth.display(),
        t0.elapsed().as_secs_f64()
    );
    Ok(ExitCode::SUCCESS)
}

fn run_compare(args: &CompareArgs) -> anyhow::Result<ExitCode> {
    let frame = Frame::read(&args.frame)?;
    let failures = if let Some(truth) = &args.truth {
        let truth = Truth::read(truth, args.truth_fibermin)?;
        let pulls = compare::pulls(&frame, &truth)?;
        println!(
            "{} vs truth {}:\n{pulls}",
            args.frame.display(),
            args.truth
                .as_ref()
                .map(|p| p.display().to_string())
                .unwrap_or_default()
        );
        pulls.failures(&PullLimits {
            max_abs_mean: args.max_mean,
            max_std: args.max_std,
            median_abs: args.median_range,
        })
    } else {
        let other_path = args
            .other
            .as_ref()
            .context("a second frame or --truth is required")?;
        let other = Frame::read(other_path)?;
        let parity = compare::parity(&frame, &other, args.rel_tolerance)?;
        println!(
            "{} vs {}:\n{parity}",
            args.frame.display(),
            other_path.display()
        );
        parity.failures(&ParityLimits {
            min_fraction_1e4: args.min_fraction,
            max_flux: args.max_dflux,
            min_rel_fraction: args.min_fraction,
            rel_tolerance: args.rel_tolerance,
        })
    };
    for f in &failures {
        eprintln!("spex: comparison failed: {f}");
    }
    Ok(if failures.is_empty() {
        ExitCode::SUCCESS
    } else {
        ExitCode::from(EXIT_COMPARISON_FAILED)
    })
}
