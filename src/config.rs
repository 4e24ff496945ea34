//! The job configuration: what `spex extract` was asked to do, validated, in plain data.
//!
//! The command line (`cli`) is turned into a [`JobConfig`] here, in one place, before any
//! rank does work: the frame list (one `-i -p -o` frame or the lines of `--list`), the
//! extraction options of each frame, the backend, the run's layout options and the
//! `--test` reference. Every rank builds the same configuration from the same arguments;
//! the parallel layer takes it as it is and knows nothing of the command line.
//!
//! Errors here are usage errors (exit status 2), except a `--list` file that cannot be read
//! or is malformed, and outputs that would replace an input (exit status 1):
//! [`ConfigError`] says which.

use std::path::PathBuf;

use crate::cli::ExtractArgs;
use crate::error::Error;
use crate::pipeline::{check_job_paths, check_threads, ExtractRequest};
use crate::plan::PatchLayout;

/// Which backend extracts.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum BackendChoice {
    /// The CPU, on the rank's threads.
    Cpu,
    /// A CUDA GPU. `required`: asked for by `--gpu`, so that a GPU that cannot start is an
    /// error; otherwise (desispec's default: the GPU whenever one is usable) the job falls
    /// back to the CPU with a warning.
    Gpu { required: bool },
}

/// Everything a run of `spex extract` needs, validated.
#[derive(Clone, Debug, PartialEq)]
pub struct JobConfig {
    /// The frames to extract, in the order of the list, without those that `--skip-existing`
    /// skips.
    pub frames: Vec<ExtractRequest>,
    /// Outputs that exist and were skipped (`--skip-existing`), for the log.
    pub skipped: Vec<PathBuf>,
    pub backend: BackendChoice,
    /// `--device`: one CUDA device for every rank instead of the node's blocks.
    pub device: Option<usize>,
    /// Worker threads per rank (0: the cores available to the rank).
    pub threads: usize,
    pub async_io: bool,
    pub frame_groups: usize,
    /// `--frames-in-flight` (`None`: the default of the backend).
    pub frames_in_flight: Option<usize>,
    /// `--io-threads`: reader and writer threads per device of an overlapped rank (`None`:
    /// the default of the backend).
    pub io_threads: Option<usize>,
    /// `--test`: the reference frame that every output is compared with.
    pub test_reference: Option<PathBuf>,
    /// Whether a rank may show the CUDA driver only its own GPUs (`CUDA_VISIBLE_DEVICES`)
    /// before the driver starts. The program may; a library call may not, since the process
    /// that calls it may use CUDA itself.
    pub narrow_devices: bool,
}

/// Why a configuration could not be built.
#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    /// Options that cannot work together or with the files named (exit status 2).
    #[error("{0}")]
    Usage(String),
    /// A file of the configuration could not be read or holds something wrong, or an output
    /// would replace an input (exit status 1).
    #[error(transparent)]
    Input(Error),
}

impl ConfigError {
    /// The exit status of a job that stops on this error.
    pub fn exit_code(&self) -> u8 {
        match self {
            ConfigError::Usage(_) => 2,
            ConfigError::Input(_) => 1,
        }
    }
}

impl JobConfig {
    /// Builds the configuration of `spex extract` from its arguments; `no_gpu_env` is
    /// whether `DESI_NO_GPU` is set.
    pub fn from_args(args: &ExtractArgs, no_gpu_env: bool) -> Result<Self, ConfigError> {
        let usage = |m: String| ConfigError::Usage(m);
        if args.decorrelate_fibers {
            return Err(usage(
                "--decorrelate-fibers is not supported: spex decorrelates each fiber on its \
                 own, as desispec's default extraction does"
                    .into(),
            ));
        }
        let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
        check_threads(args.threads, cores).map_err(|e| usage(e.to_string()))?;
        let requests: Vec<ExtractRequest> = frame_files(args)?
            .into_iter()
            .map(|files| request(args, files))
            .collect();
        for r in &requests {
            r.validate_options().map_err(|e| usage(e.to_string()))?;
        }
        // Outputs that would replace an input or one another are refused before any work.
        check_job_paths(&requests, args.test.as_deref()).map_err(ConfigError::Input)?;
        if let Some(list) = &args.list {
            // The list is an input too: an output line naming it would overwrite it.
            let outputs: Vec<&std::path::Path> = requests
                .iter()
                .flat_map(|r| std::iter::once(r.output.as_path()).chain(r.model.as_deref()))
                .collect();
            crate::output::check_paths(&[list.as_path()], &outputs).map_err(ConfigError::Input)?;
        }
        let mut config = JobConfig {
            frames: Vec::with_capacity(requests.len()),
            skipped: Vec::new(),
            backend: backend_choice(args, no_gpu_env),
            device: args.device,
            threads: args.threads,
            async_io: args.async_io,
            frame_groups: args.frame_groups,
            frames_in_flight: args.frames_in_flight,
            io_threads: args.io_threads,
            test_reference: args.test.clone(),
            narrow_devices: true,
        };
        for request in requests {
            if args.skip_existing && request.output.exists() {
                config.skipped.push(request.output);
            } else {
                config.frames.push(request);
            }
        }
        Ok(config)
    }
}

/// `--no-gpu` or `DESI_NO_GPU` rule the GPU out (as in desispec, even over `--gpu`), `--gpu`
/// requires one, and otherwise a usable GPU is used, as desispec does.
fn backend_choice(args: &ExtractArgs, no_gpu_env: bool) -> BackendChoice {
    if args.no_gpu || no_gpu_env {
        BackendChoice::Cpu
    } else {
        BackendChoice::Gpu { required: args.gpu }
    }
}

/// The files of one frame: input image, PSF, output frame and optional model image.
struct FrameFiles {
    input: PathBuf,
    psf: PathBuf,
    output: PathBuf,
    model: Option<PathBuf>,
}

/// The single `-i -p -o` frame or the `--list` lines.
fn frame_files(args: &ExtractArgs) -> Result<Vec<FrameFiles>, ConfigError> {
    if let Some(list) = &args.list {
        let text = std::fs::read_to_string(list).map_err(|source| {
            ConfigError::Input(Error::Io {
                path: list.clone(),
                source,
            })
        })?;
        let frames = parse_list(&text)
            .map_err(|e| ConfigError::Input(Error::config(format!("{}: {e}", list.display()))))?;
        return Ok(frames
            .into_iter()
            .map(|(input, psf, output)| FrameFiles {
                input,
                psf,
                output,
                model: None,
            })
            .collect());
    }
    match (&args.input, &args.psf, &args.output) {
        (Some(input), Some(psf), Some(output)) => Ok(vec![FrameFiles {
            input: input.clone(),
            psf: psf.clone(),
            output: output.clone(),
            model: args.model.clone(),
        }]),
        _ => Err(ConfigError::Usage(
            "--input, --psf and --output are required without --list".into(),
        )),
    }
}

/// The request for one frame with the options of `args`.
fn request(args: &ExtractArgs, files: FrameFiles) -> ExtractRequest {
    ExtractRequest {
        input: files.input,
        psf: files.psf,
        output: files.output,
        model: files.model,
        fibermap: args.fibermap.clone(),
        wavelength: args.wavelength,
        specmin: args.specmin,
        nspec: args.nspec,
        regularize: args.regularize,
        psferr: args.psferr,
        layout: PatchLayout {
            bundlesize: args.bundlesize,
            nsubbundles: args.nsubbundles,
            nwavestep: args.nwavestep,
            wavepad: args.wavepad,
            wavepad_frac: args.wavepad_frac,
            pixpad_frac: args.pixpad_frac,
        },
        mask_rule: args.mask_bits,
        barycentric_correction: args.barycentric_correction,
        scores: !args.no_scores,
        reject_outliers: args.reject_outliers,
        bad2dfit: args.bad2dfit,
    }
}

/// Parses a frame list: `input psf output` per line, blank lines and `#` comments ignored.
pub fn parse_list(text: &str) -> Result<Vec<(PathBuf, PathBuf, PathBuf)>, String> {
    let mut frames = Vec::new();
    for (n, line) in text.lines().enumerate() {
        let line = line.split('#').next().unwrap_or("").trim();
        if line.is_empty() {
            continue;
        }
        let words: Vec<&str> = line.split_whitespace().collect();
        if words.len() != 3 {
            return Err(format!(
                "line {}: expected 'input psf output', got {line:?}",
                n + 1
            ));
        }
        frames.push((words[0].into(), words[1].into(), words[2].into()));
    }
    if frames.is_empty() {
        return Err("no frame listed".into());
    }
    Ok(frames)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cli::{with_default_subcommand, Cli, Command};
    use clap::Parser;

    fn args(words: &[&str]) -> ExtractArgs {
        let mut all = vec!["spex"];
        all.extend_from_slice(words);
        let argv: Vec<std::ffi::OsString> = all.iter().map(Into::into).collect();
        match Cli::try_parse_from(with_default_subcommand(argv))
            .unwrap()
            .command
        {
            Command::Extract(a) => *a,
            _ => panic!("not extract"),
        }
    }

    fn config(words: &[&str]) -> Result<JobConfig, ConfigError> {
        JobConfig::from_args(&args(words), false)
    }

    #[test]
    fn list_lines_need_three_paths() {
        let ok = parse_list("# frames\na.fits p.fits o.fits\n\nb.fits p.fits q.fits # second\n")
            .unwrap();
        assert_eq!(ok.len(), 2);
        assert!(parse_list("a.fits p.fits\n").is_err());
        assert!(parse_list("# nothing\n").is_err());
    }

    #[test]
    fn one_frame_carries_every_option() {
        let c = config(&[
            "-i",
            "in.fits",
            "-p",
            "psf.fits",
            "-o",
            "out.fits",
            "-m",
            "model.fits",
            "-f",
            "fm.fits",
            "-w",
            "5760,7620,0.8",
            "-s",
            "25",
            "-n",
            "50",
            "--nwavestep",
            "30",
            "--barycentric-correction",
            "--no-scores",
            "--psferr",
            "0.04",
        ])
        .unwrap();
        assert_eq!(c.frames.len(), 1);
        let r = &c.frames[0];
        assert_eq!(r.model, Some(PathBuf::from("model.fits")));
        assert_eq!(r.fibermap, Some(PathBuf::from("fm.fits")));
        assert_eq!((r.specmin, r.nspec, r.layout.nwavestep), (25, Some(50), 30));
        assert_eq!(r.psferr, Some(0.04));
        assert!(r.barycentric_correction && !r.scores);
        assert_eq!(r.wavelength, Some((5760.0, 7620.0, 0.8)));
    }

    #[test]
    fn bad2dfit_rule_is_desispec_0_70_unless_asked() {
        let rule = |extra: &[&str]| {
            let mut w = vec!["-i", "a", "-p", "b", "-o", "c"];
            w.extend_from_slice(extra);
            JobConfig::from_args(&args(&w), false).map(|c| c.frames[0].bad2dfit)
        };
        assert_eq!(rule(&[]).unwrap(), crate::frame::Bad2dfit::Above100);
        let median = rule(&["--bad2dfit", "median5"]).unwrap();
        assert_eq!(median, crate::frame::Bad2dfit::Median(5.0));
    }

    #[test]
    fn overlapping_gpu_ranks_take_at_most_32_threads_unless_told() {
        use crate::parallel::layout::{Layout, GPU_OVERLAP_THREADS};
        let threads = |extra: &[&str], cores: usize| {
            let mut w = vec!["-i", "a", "-p", "b", "-o", "c"];
            w.extend_from_slice(extra);
            let config = JobConfig::from_args(&args(&w), false).unwrap();
            Layout::single(cores)
                .with_overlap_cap(&config, true)
                .threads
        };
        assert_eq!(threads(&["--async-io"], 64), GPU_OVERLAP_THREADS);
        assert_eq!(threads(&["--async-io"], 16), 16);
        // the rank's cores, which size its readers and writers, are not capped
        let overlapped = config(&["-i", "a", "-p", "b", "-o", "c", "--async-io"]).unwrap();
        assert_eq!(
            Layout::single(64).with_overlap_cap(&overlapped, true).cores,
            64
        );
        // A choice of the user stays (this machine may have few cores: 4 per core are allowed).
        assert_eq!(threads(&["--async-io", "--threads", "1"], 64), 64);
        assert_eq!(threads(&["--async-io", "--no-gpu"], 64), 64);
        assert_eq!(threads(&[], 64), 64);
        // A node without a GPU extracts on the CPU, with every thread.
        let config = config(&["-i", "a", "-p", "b", "-o", "c", "--async-io"]).unwrap();
        assert_eq!(
            Layout::single(64).with_overlap_cap(&config, false).threads,
            64
        );
    }

    #[test]
    fn the_gpu_is_the_default_unless_ruled_out() {
        let base = ["-i", "a", "-p", "b", "-o", "c"];
        let with = |extra: &[&str], env: bool| {
            let mut w = base.to_vec();
            w.extend_from_slice(extra);
            JobConfig::from_args(&args(&w), env).unwrap().backend
        };
        assert_eq!(with(&[], false), BackendChoice::Gpu { required: false });
        assert_eq!(
            with(&["--gpu"], false),
            BackendChoice::Gpu { required: true }
        );
        assert_eq!(
            with(&["--use-gpu"], false),
            BackendChoice::Gpu { required: true }
        );
        assert_eq!(with(&["--gpu"], true), BackendChoice::Cpu);
        assert_eq!(with(&["--no-gpu"], false), BackendChoice::Cpu);
        assert_eq!(with(&[], true), BackendChoice::Cpu);
    }

    #[test]
    fn usage_errors_and_io_errors_have_their_exit_codes() {
        let e = config(&["-i", "a", "-p", "b", "-o", "c", "--decorrelate-fibers"]).unwrap_err();
        assert_eq!(e.exit_code(), 2);
        assert!(e.to_string().contains("--decorrelate-fibers"), "{e}");
        let e = config(&["-i", "a", "-p", "b", "-o", "c", "--threads", "100000"]).unwrap_err();
        assert_eq!(e.exit_code(), 2);
        let e = config(&["-i", "a", "-p", "b", "-o", "c", "--regularize=-1"]).unwrap_err();
        assert_eq!(e.exit_code(), 2);
        let dir = tempfile::tempdir().unwrap();
        let missing = dir.path().join("frames.txt");
        let e = config(&["--list", missing.to_str().unwrap()]).unwrap_err();
        assert_eq!(e.exit_code(), 1);
        assert!(e.to_string().contains("frames.txt"), "{e}");
    }

    #[test]
    fn skip_existing_leaves_out_outputs_that_exist() {
        let dir = tempfile::tempdir().unwrap();
        let done = dir.path().join("done.fits");
        std::fs::write(&done, b"x").unwrap();
        let list = dir.path().join("frames.txt");
        std::fs::write(
            &list,
            format!("a.fits p.fits {}\nb.fits p.fits new.fits\n", done.display()),
        )
        .unwrap();
        let c = config(&["--list", list.to_str().unwrap(), "--skip-existing"]).unwrap();
        assert_eq!(c.skipped, vec![done]);
        assert_eq!(c.frames.len(), 1);
        assert_eq!(c.frames[0].output, PathBuf::from("new.fits"));
        let c = config(&["--list", list.to_str().unwrap()]).unwrap();
        assert_eq!((c.frames.len(), c.skipped.len()), (2, 0));
    }

    #[test]
    fn reject_outliers_takes_an_optional_nsigma_on_either_backend() {
        let with = |extra: &[&str]| {
            let mut words = vec!["-i", "a", "-p", "b", "-o", "c"];
            words.extend_from_slice(extra);
            config(&words)
        };
        assert_eq!(with(&[]).unwrap().frames[0].reject_outliers, None);
        let c = with(&["--reject-outliers"]).unwrap();
        assert_eq!(c.frames[0].reject_outliers, Some(5.0));
        let c = with(&["--reject-outliers", "4"]).unwrap();
        assert_eq!(c.frames[0].reject_outliers, Some(4.0));
        let c = with(&["--reject-outliers", "--gpu"]).unwrap();
        assert_eq!(c.backend, BackendChoice::Gpu { required: true });
        assert!(matches!(
            with(&["--reject-outliers", "0"]),
            Err(ConfigError::Usage(_))
        ));
    }
}
