//! The `spex` binary: parse the command line, set up logging, run, and map the outcome to an
//! exit status (0 success, 1 error, 2 usage, 3 a comparison outside its limits).

use std::io::IsTerminal;
use std::process::ExitCode;

use std::path::Path;
use std::sync::OnceLock;

use anyhow::Context;
use clap::Parser;
use spex::backend::Progress;
use spex::cli::{
    with_default_subcommand, Cli, Command, CompareArgs, ExtractArgs, QaArgs, SimulateArgs,
};
use spex::compare::{self, ParityLimits, PullLimits, Truth};
use spex::config::JobConfig;
use spex::frame::Frame;
use spex::parallel::startup::{self, Refusal};
use spex::parallel::{job, print_line, FrameCheck, Hooks, JobOutcome, Layout, Roles, Universe};
use spex::pipeline::ExtractRequest;
use spex::psf::GaussHermitePsf;
use spex::qa::{QuickLook, Residual};
use spex::simulate;
use tracing_subscriber::fmt::format::{self, FormatEvent, FormatFields};
use tracing_subscriber::fmt::FmtContext;
use tracing_subscriber::registry::LookupSpan;

/// Exit status of a comparison outside its limits.
const EXIT_COMPARISON_FAILED: u8 = 3;

// Patch solves allocate and free megabyte-sized matrices at a high rate; mimalloc keeps those
// pages mapped instead of returning them to the kernel after every patch.
#[global_allocator]
static GLOBAL: mimalloc::MiMalloc = mimalloc::MiMalloc;

/// mimalloc's `purge_delay` option: its index in `mi_option_e` (the same in mimalloc 2 and 3).
const MI_OPTION_PURGE_DELAY: libmimalloc_sys::mi_option_t = 15;

/// Keeps the pages that the allocator frees mapped for the whole process, unless
/// `MIMALLOC_PURGE_DELAY` says otherwise. By default mimalloc gives pages that stay unused
/// for a second back to the kernel, and the next patches' matrices fault them in again,
/// zeroed: about 5% of a CPU extraction's patch solves. The process keeps its peak memory
/// instead, which it needs again for every frame.
fn keep_freed_pages() {
    if std::env::var_os("MIMALLOC_PURGE_DELAY").is_none() {
        // SAFETY: sets one of the allocator's options, which it reads when it next purges.
        unsafe { libmimalloc_sys::mi_option_set(MI_OPTION_PURGE_DELAY, -1) };
    }
}

fn main() -> ExitCode {
    keep_freed_pages();
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
        Command::Qa(args) => {
            init_logging("info", None, true);
            report(run_qa(&args))
        }
    }
}

/// The exit status of a command that runs in one process, printing its error.
fn report(outcome: anyhow::Result<ExitCode>) -> ExitCode {
    match outcome {
        Ok(code) => code,
        Err(e) => {
            print_line(&format!("spex: error: {}", error_chain(&e)));
            ExitCode::FAILURE
        }
    }
}

/// An error and its causes on one line, each cause once: the library's errors already say
/// their cause ("out.fits: Not a directory"), which `{:#}` would repeat.
fn error_chain(e: &anyhow::Error) -> String {
    let mut text = e.to_string();
    for cause in e.chain().skip(1) {
        let cause = cause.to_string();
        if !text.contains(&cause) {
            text = format!("{text}: {cause}");
        }
    }
    text
}

/// `spex extract`: one process, or one rank of an MPI job when a launcher started it.
fn extract(args: &ExtractArgs) -> ExitCode {
    // Locals drop in reverse order: every communicator goes before the universe finalises MPI.
    let universe = Universe::init();
    let world = universe.world();
    // Each rank builds its configuration, then all agree on it (or on why not) before any
    // collective that assumes it: one rank says why the job stops.
    let no_gpu_env = std::env::var_os("DESI_NO_GPU").is_some();
    let local = JobConfig::from_args(args, no_gpu_env)
        .map_err(|e| Refusal {
            message: e.to_string(),
            code: e.exit_code(),
        })
        .and_then(
            |config| match Roles::new(world.size(), config.async_io, config.frame_groups) {
                Ok(roles) => Ok((config, roles)),
                Err(e) => Err(Refusal {
                    message: e.to_string(),
                    code: 2,
                }),
            },
        );
    let fingerprint = startup::fingerprint(&std::env::args_os().collect::<Vec<_>>());
    let (config, roles) = match startup::agree(&world, universe.is_mpi(), local, fingerprint) {
        Ok(agreed) => agreed,
        Err(code) => return ExitCode::from(code),
    };
    // The CUDA driver starts with the backends, beside the first frame's read, once the rank
    // knows its GPUs: started with only those, it starts sooner (parallel::visible).
    let is_worker = roles.is_worker(world.rank());
    let layout = Layout::discover(&world, universe.is_mpi(), config.threads, is_worker)
        .with_overlap_cap(&config, spex::parallel::node_has_gpus());
    universe.abort_on_panic(layout.rank);
    // Data-parallel host work (PSF traces, pixel copies, assembly) runs on rayon's global pool:
    // size it to this rank's share of the node rather than to every core of it.
    if let Err(e) = rayon::ThreadPoolBuilder::new()
        .num_threads(layout.threads)
        .thread_name(|i| format!("spex-pool-{i}"))
        .build_global()
    {
        tracing::debug!("rayon's global pool was already built: {e}");
    }
    // Per-frame information comes from the ranks that read and write; the workers log only
    // warnings unless asked for debug output.
    init_logging(
        args.log_level(),
        layout.launched.then_some(layout.rank),
        roles.is_io_rank(layout.rank),
    );
    if args.use_specter && layout.rank == 0 {
        tracing::info!("--use-specter: spex is the extractor, with specter's equations");
    }
    let reference = config.test_reference.as_deref().map(Reference::new);
    if let Some(reference) = &reference {
        // A reference that cannot be read stops the job before any work; rank 0 reads it.
        let unreadable = layout.rank == 0
            && reference
                .get()
                .map_err(|e| {
                    print_line(&format!("{} {e:#}", layout.error_prefix()));
                })
                .is_err();
        if world.all_max(u64::from(unreadable)) > 0 {
            return ExitCode::FAILURE;
        }
    }
    let check = |request: &ExtractRequest, frame: &Frame| -> spex::Result<bool> {
        reference
            .as_ref()
            .map_or(Ok(true), |r| r.check(request, frame))
    };
    let hooks = Hooks {
        progress: &progress,
        check: reference.is_some().then_some(&check as &FrameCheck<'_>),
    };
    match job::run(&world, &layout, &roles, &config, &hooks) {
        Some(outcome) => exit_status(&outcome, layout.rank),
        None => ExitCode::FAILURE,
    }
}

/// The exit status of a job: the number of failed frames (at most 100), else 3 for a
/// comparison outside its limits, else 0. Rank 0 says how many frames failed.
fn exit_status(outcome: &JobOutcome, rank: usize) -> ExitCode {
    if outcome.failed > 0 {
        if rank == 0 && outcome.frames > 1 {
            print_line(&format!(
                "spex: {} of {} frames failed",
                outcome.failed, outcome.frames
            ));
        }
        ExitCode::from(outcome.failed.min(100) as u8)
    } else if outcome.comparison_failed > 0 {
        ExitCode::from(EXIT_COMPARISON_FAILED)
    } else {
        ExitCode::SUCCESS
    }
}

/// The `--test` reference frame, read once by whichever thread first needs it.
struct Reference<'a> {
    path: &'a Path,
    frame: OnceLock<spex::Result<Frame>>,
}

impl<'a> Reference<'a> {
    fn new(path: &'a Path) -> Self {
        Reference {
            path,
            frame: OnceLock::new(),
        }
    }

    fn get(&self) -> std::result::Result<&Frame, &spex::Error> {
        self.frame.get_or_init(|| Frame::read(self.path)).as_ref()
    }

    /// Compares a frame with the reference, printing the statistics and the failures.
    fn check(&self, request: &ExtractRequest, frame: &Frame) -> spex::Result<bool> {
        let reference = self
            .get()
            .map_err(|e| spex::Error::config(format!("--test {}: {e}", self.path.display())))?;
        if let Some(why) = compare::parity_mismatch(frame, reference) {
            return Err(spex::Error::config(format!(
                "{}: reference frame does not match the extraction: {why}",
                self.path.display()
            )));
        }
        let limits = ParityLimits::default();
        let parity = compare::parity(frame, reference, limits.rel_tolerance)?;
        let report = format!(
            "{} vs {}:\n{parity}",
            request.output.display(),
            self.path.display()
        );
        print_stdout(&report).map_err(|source| spex::Error::Io {
            path: "standard output".into(),
            source,
        })?;
        let failures = parity.failures(&limits);
        for f in &failures {
            print_line(&format!("spex: test failed: {f}"));
        }
        Ok(failures.is_empty())
    }
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
        // A frame without a bin to measure fails the comparison, as a mismatch does.
        let pulls = match compare::pulls(&frame, &truth) {
            Ok(pulls) => pulls,
            Err(spex::Error::Config(why)) => return Ok(comparison_failed(&[why])),
            Err(e) => return Err(e.into()),
        };
        let report = format!(
            "{} vs truth {}:\n{pulls}",
            args.frame.display(),
            args.truth
                .as_ref()
                .map(|p| p.display().to_string())
                .unwrap_or_default()
        );
        print_stdout(&report).context("standard output")?;
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
        let report = format!(
            "{} vs {}:\n{parity}",
            args.frame.display(),
            other_path.display()
        );
        print_stdout(&report).context("standard output")?;
        parity.failures(&ParityLimits {
            min_fraction_1e4: args.min_fraction,
            max_flux: args.max_dflux,
            min_rel_fraction: args.min_fraction,
            rel_tolerance: args.rel_tolerance,
        })
    };
    Ok(comparison_failed(&failures))
}

/// Prints a report on standard output, as a line. A reader that went away (`| head`, a
/// closed pipe) ends the report quietly, as other command-line tools do; any other failure
/// (a full disk) is an error.
fn print_stdout(report: &str) -> std::io::Result<()> {
    use std::io::Write;
    let mut out = std::io::stdout().lock();
    match writeln!(out, "{report}").and_then(|()| out.flush()) {
        Err(e) if e.kind() == std::io::ErrorKind::BrokenPipe => Ok(()),
        other => other,
    }
}

/// `spex qa`: draws the quick-look picture and prints what its panels measure.
fn run_qa(args: &QaArgs) -> anyhow::Result<ExitCode> {
    let inputs: Vec<&Path> = [Some(&args.frame), args.truth.as_ref(), args.model.as_ref()]
        .into_iter()
        .chain([args.image.as_ref()])
        .flatten()
        .map(|p| p.as_path())
        .collect();
    spex::output::check_paths(&inputs, &[&args.output])?;
    let frame = Frame::read(&args.frame)?;
    let name = args.frame.file_name().unwrap_or_default().to_string_lossy();
    let mut picture = QuickLook::new(name, frame);
    if let Some(path) = &args.truth {
        let truth = Truth::read(path, args.truth_fibermin)?;
        picture = picture
            .with_truth(&truth)
            .with_context(|| format!("{}: pulls against the truth", path.display()))?;
    }
    if let (Some(model), Some(image)) = (&args.model, &args.image) {
        let image = spex::image::Image::read(image, args.mask_bits)?;
        let model = spex::qa::read_model(model)?;
        picture.residual = Some(Residual::new(&image, &model)?);
    }
    picture.write(&args.output)?;
    if let Some(pulls) = picture.pull_stats() {
        print_stdout(&format!("{} vs truth:\n{pulls}", args.frame.display()))
            .context("standard output")?;
    }
    if let Some(r) = &picture.residual {
        let (rms, n) = r.rms();
        if n == 0 {
            tracing::warn!(
                "no pixel of the residual's region has ivar > 0 in {}: is it the image that was extracted?",
                args.image.as_deref().unwrap_or(Path::new("")).display()
            );
        }
        print_stdout(&format!(
            "residual (image - model) sqrt(ivar), CCD rows {:?}, columns {:?}: rms {rms:.4} over {n} pixels",
            r.rows, r.cols
        ))
        .context("standard output")?;
    }
    tracing::info!("wrote {}", args.output.display());
    Ok(ExitCode::SUCCESS)
}

/// Prints each failure of a comparison; exit status 3 if there is one, else 0.
fn comparison_failed(failures: &[String]) -> ExitCode {
    for f in failures {
        print_line(&format!("spex: comparison failed: {f}"));
    }
    if failures.is_empty() {
        ExitCode::SUCCESS
    } else {
        ExitCode::from(EXIT_COMPARISON_FAILED)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The index is mimalloc's purge delay: the option has the documented default of
    /// mimalloc 3, 1000 ms, which none of its neighbours shares, then the value set.
    #[test]
    fn purge_delay_is_the_option_kept_off() {
        // SAFETY: reads one of the allocator's options.
        let get = || unsafe { libmimalloc_sys::mi_option_get(MI_OPTION_PURGE_DELAY) };
        assert_eq!(
            get(),
            1000,
            "run without MIMALLOC_PURGE_DELAY in the environment"
        );
        keep_freed_pages();
        assert_eq!(get(), -1);
    }
}
