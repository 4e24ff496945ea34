//! The `spex` binary: parse the command line, set up logging, run, and map the outcome to an
//! exit status (0 success, 1 error, 2 usage, 3 a comparison outside its limits).

use std::io::IsTerminal;
use std::process::ExitCode;

use anyhow::Context;
use clap::Parser;
use spex::backend::Progress;
use spex::cli::{with_default_subcommand, Cli, Command, CompareArgs, ExtractArgs, SimulateArgs};
use spex::compare::{self, ParityLimits, PullLimits, Truth};
use spex::frame::Frame;
use spex::parallel::exposure::{self, EXIT_COMPARISON_FAILED};
use spex::parallel::{print_line, Layout, Roles, Universe};
use spex::psf::GaussHermitePsf;
use spex::simulate;
use tracing_subscriber::fmt::format::{self, FormatEvent, FormatFields};
use tracing_subscriber::fmt::FmtContext;
use tracing_subscriber::registry::LookupSpan;

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
    match cli.command {
        Command::Extract(args) => extract(&args),
        Command::Simulate(args) => {
            init_logging(&args.loglevel, None, true);
            report(run_simulate(&args))
        }
        Command::Compare(args) => {
            init_logging("info", None, true);
            report(run_compare(&args))
        }
    }
}

/// The exit status of a command that runs in one process, printing its error.
fn report(outcome: anyhow::Result<ExitCode>) -> ExitCode {
    match outcome {
        Ok(code) => code,
        Err(e) => {
            eprintln!("spex: error: {e:#}");
            ExitCode::FAILURE
        }
    }
}

/// `spex extract`: one process, or one rank of an MPI job when a launcher started it.
fn extract(args: &ExtractArgs) -> ExitCode {
    // Locals drop in reverse order: every communicator goes before the universe finalises MPI.
    let universe = Universe::init();
    let world = universe.world();
    let roles = Roles::new(world.size(), args.async_io, args.frame_groups);
    let is_worker = roles.as_ref().map_or(true, |r| r.is_worker(world.rank()));
    // Loading the CUDA libraries and initialising the driver take a few tenths of a second
    // that need nothing from the other ranks: an extracting rank starts them now, while the
    // ranks agree on the work. Errors are reported by the backend's own start.
    if args.use_gpu() && is_worker {
        std::thread::spawn(|| spex::backend::cuda::device_count().ok());
    }
    let layout = Layout::discover(&world, universe.is_mpi(), args.threads, is_worker);
    universe.abort_on_panic(layout.rank);
    // Option values that need no input are usage errors (status 2), found before a thread
    // pool is built or a file is read; as below, rank 0 alone says why.
    if let Err(e) = check_options(args) {
        if layout.rank == 0 {
            print_line(&format!("{} {e}", layout.error_prefix()));
        }
        world.all_max(0);
        return ExitCode::from(2);
    }
    // Every rank reaches the same verdict on bad options on its own, so it needs no message;
    // rank 0 alone says why, and the others wait for its line: a launcher may kill the job as
    // soon as one rank exits non-zero.
    let roles = match roles {
        Ok(roles) => roles,
        Err(e) => {
            if layout.rank == 0 {
                print_line(&format!("{} {e}", layout.error_prefix()));
            }
            world.all_max(0);
            return ExitCode::FAILURE;
        }
    };
    // Data-parallel host work (PSF traces, pixel copies, assembly) runs on rayon's global pool:
    // size it to this rank's share of the node rather than to every core of it.
    if let Err(e) = rayon::ThreadPoolBuilder::new()
        .num_threads(layout.threads)
        .build_global()
    {
        tracing::debug!("rayon's global pool was already built: {e}");
    }
    // Per-frame information comes from the ranks that read and write; the workers log only
    // warnings unless asked for debug output.
    init_logging(
        &args.loglevel,
        layout.launched.then_some(layout.rank),
        roles.is_io_rank(layout.rank),
    );
    ExitCode::from(exposure::run(&world, &layout, &roles, args, &progress))
}

/// The checks of `spex extract`'s option values that read nothing: threads, patch layout,
/// fiber range, wavelength grid, regularization.
fn check_options(args: &ExtractArgs) -> spex::Result<()> {
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    spex::pipeline::check_threads(args.threads, cores)?;
    let none = std::path::PathBuf::new;
    args.request(none(), none(), none(), None)
        .validate_options()
}

/// Logs to stderr at `level` (`SPEX_LOG` overrides), each line prefixed with the rank under
/// MPI. Ranks that are not `verbose` log warnings and errors only, unless `level` is debug or
/// trace.
fn init_logging(level: &str, rank: Option<usize>, verbose: bool) {
    let level = match level {
        "warning" => "warn",
        "critical" => "error",
        "info" if !verbose => "warn",
        l => l,
    };
    let filter = tracing_subscriber::EnvFilter::try_from_env("SPEX_LOG")
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new(format!("spex={level},warn")));
    tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .with_ansi(std::io::stderr().is_terminal())
        .event_format(RankFormat {
            rank,
            inner: tracing_subscriber::fmt::format().with_target(false),
        })
        .init();
}

/// The default log format behind a `[rank R]` prefix, so that the interleaved output of many
/// ranks stays readable.
struct RankFormat<F> {
    rank: Option<usize>,
    inner: F,
}

impl<S, N, F> FormatEvent<S, N> for RankFormat<F>
where
    S: tracing::Subscriber + for<'a> LookupSpan<'a>,
    N: for<'a> FormatFields<'a> + 'static,
    F: FormatEvent<S, N>,
{
    fn format_event(
        &self,
        ctx: &FmtContext<'_, S, N>,
        mut writer: format::Writer<'_>,
        event: &tracing::Event<'_>,
    ) -> std::fmt::Result {
        if let Some(rank) = self.rank {
            write!(writer, "[rank {rank}] ")?;
        }
        self.inner.format_event(ctx, writer, event)
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

fn run_simulate(args: &SimulateArgs) -> anyhow::Result<ExitCode> {
    spex::output::check_paths(&[&args.psf], &[&args.output, &args.truth])?;
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
        if let Some(why) = compare::truth_mismatch(&frame, &truth) {
            return Ok(comparison_failed(&[why]));
        }
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
        if let Some(why) = compare::parity_mismatch(&frame, &other) {
            return Ok(comparison_failed(&[why]));
        }
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
    Ok(comparison_failed(&failures))
}

/// Prints each failure of a comparison; exit status 3 if there is one, else 0.
fn comparison_failed(failures: &[String]) -> ExitCode {
    for f in failures {
        eprintln!("spex: comparison failed: {f}");
    }
    if failures.is_empty() {
        ExitCode::SUCCESS
    } else {
        ExitCode::from(EXIT_COMPARISON_FAILED)
    }
}
