//! Command-line interface: clap structures in the spelling of gpu_specter's `spex` and
//! desispec's `desi_extract_spectra`, and their conversion into validated requests.

use std::path::PathBuf;

use clap::{Args, Parser, Subcommand};

use crate::error::number;
use crate::image::MaskRule;

/// spex: spectro-perfectionism extraction of DESI frames on CPUs and GPUs.
#[derive(Debug, Parser)]
#[command(name = "spex", version, about, propagate_version = true)]
pub struct Cli {
    #[command(subcommand)]
    pub command: Command,
}

#[derive(Debug, Subcommand)]
pub enum Command {
    /// Extract spectra from a preproc image (the default when the first argument is an option).
    Extract(Box<ExtractArgs>),
    /// Simulate a preproc image and its truth from a PSF.
    Simulate(SimulateArgs),
    /// Compare two frames (parity) or a frame with the simulation truth (pulls).
    Compare(CompareArgs),
    /// Draw a quick-look PNG of a frame: flux, ivar, mask and chi2pix, the pulls against a
    /// truth, the residual image of a CCD region.
    Qa(QaArgs),
}

/// Options of `spex simulate`.
#[derive(Debug, Args, Clone)]
pub struct SimulateArgs {
    /// PSF to project the spectra with.
    #[arg(short, long)]
    pub psf: PathBuf,
    /// Output preproc image (IMAGE, IVAR, MASK, READNOISE, FIBERMAP).
    #[arg(short, long)]
    pub output: PathBuf,
    /// Output truth (WAVELENGTH, FLUX in photons per bin).
    #[arg(long)]
    pub truth: PathBuf,
    /// Wavelength grid `wmin,wmax,dw` of the truth (align it with the extraction grid).
    #[arg(short, long, value_parser = parse_simulated_grid, allow_hyphen_values = true)]
    pub wavelength: (f64, f64, f64),
    /// First fiber to simulate.
    #[arg(short, long, default_value_t = 0)]
    pub specmin: usize,
    /// Number of fibers to simulate (default: all fibers of the PSF from specmin).
    #[arg(short, long)]
    pub nspec: Option<usize>,
    /// Random seed: the same seed gives the same files.
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
    /// Read noise in electrons (at most 10^6).
    #[arg(long, default_value_t = 3.0, value_parser = parse_read_noise)]
    pub read_noise: f64,
    /// Write the noiseless image (IVAR unchanged).
    #[arg(long)]
    pub no_noise: bool,
    /// Cosmic-ray tracks per million pixels of the simulated area (0: none; at most 10^5).
    #[arg(long, default_value_t = 50.0, value_parser = parse_cosmic_density)]
    pub cosmic_density: f64,
    /// A bad CCD column (masked, with extra charge).
    #[arg(long)]
    pub bad_column: Option<usize>,
    /// Log level: debug, info, warning, error.
    #[arg(long, default_value = "info")]
    pub loglevel: String,
    /// Fraction of the cosmic-ray tracks left out of the MASK (IVAR kept), as tracks that
    /// preprocessing missed.
    #[arg(long, value_name = "FRACTION", default_value_t = 0.0)]
    pub unmasked_cosmics: f64,
    /// Fraction of the fibers that are sky fibers (OBJTYPE 'SKY', sky light only), each fiber
    /// drawn from its own random stream.
    #[arg(long, value_name = "FRACTION", default_value_t = 0.1, value_parser = parse_fraction)]
    pub sky_fraction: f64,
    /// A flat-lamp exposure (FLAVOR 'flat'): every fiber the same smooth continuum times its
    /// throughput, which a science exposure of the same seed shares.
    #[arg(long)]
    pub flat: bool,
    /// Fibers that receive no light (zero truth), comma-separated PSF indices.
    #[arg(long, value_name = "FIBERS", value_delimiter = ',')]
    pub dead_fibers: Vec<usize>,
    /// Amplifiers whose pixels are all masked (BAD, IVAR 0), comma-separated from A, B, C, D.
    #[arg(long, value_name = "AMPS", value_delimiter = ',', value_parser = parse_amplifier)]
    pub masked_amps: Vec<char>,
    /// EXPID keyword of the preproc.
    #[arg(long, default_value_t = 1)]
    pub expid: i64,
}

impl SimulateArgs {
    /// The simulator options for a PSF with `nfiber` fibers.
    pub fn options(&self, nfiber: usize) -> crate::simulate::SimulateOptions {
        let (wmin, wmax, dw) = self.wavelength;
        let end = self.nspec.map_or(nfiber, |n| self.specmin + n);
        let mut o = crate::simulate::SimulateOptions::new(self.specmin..end, wmin, wmax);
        o.dw = dw;
        o.seed = self.seed;
        o.read_noise = self.read_noise;
        o.noise = !self.no_noise;
        o.cosmic_density = self.cosmic_density;
        o.bad_column = self.bad_column;
        o.unmasked_cosmics = self.unmasked_cosmics;
        o.sky_fraction = self.sky_fraction;
        o.flat = self.flat;
        o.dead_fibers = self.dead_fibers.clone();
        o.masked_amps = self.masked_amps.clone();
        o.expid = self.expid;
        o
    }
}

/// Options of `spex extract`.
#[derive(Debug, Args, Clone)]
pub struct ExtractArgs {
    /// Input preproc image (IMAGE, IVAR, MASK, optional FIBERMAP).
    #[arg(short, long, required_unless_present = "list")]
    pub input: Option<PathBuf>,
    /// Input PSF (GAUSS-HERMITE).
    #[arg(short, long, required_unless_present = "list")]
    pub psf: Option<PathBuf>,
    /// Output frame.
    #[arg(short, long, required_unless_present = "list")]
    pub output: Option<PathBuf>,
    /// Frames to extract, one `input psf output` line each (`#` starts a comment).
    #[arg(long, conflicts_with_all = ["input", "psf", "output", "model"])]
    pub list: Option<PathBuf>,
    /// Output model image.
    #[arg(short, long)]
    pub model: Option<PathBuf>,
    /// Fibermap to copy into the frame (and to take the pointing from) instead of the
    /// input's FIBERMAP HDU.
    #[arg(short, long, conflicts_with = "list")]
    pub fibermap: Option<PathBuf>,
    /// Wavelength grid `wmin,wmax,dw` in Angstrom (default: the PSF's range at 0.8).
    #[arg(short, long, value_parser = parse_wavelength, allow_hyphen_values = true)]
    pub wavelength: Option<(f64, f64, f64)>,
    /// First spectrum to extract (any fiber; its bundle is solved as in a full extraction).
    #[arg(short, long, default_value_t = 0)]
    pub specmin: usize,
    /// Number of spectra (any positive number; default: all fibers from specmin).
    #[arg(short, long)]
    pub nspec: Option<usize>,
    /// Regularization amount.
    #[arg(short, long, default_value_t = 0.0)]
    pub regularize: f64,
    /// Spectra per bundle.
    #[arg(long, default_value_t = 25)]
    pub bundlesize: usize,
    /// Sub-bundles per bundle (patches are one sub-bundle wide).
    #[arg(long, default_value_t = 5)]
    pub nsubbundles: usize,
    /// Output bins per patch.
    #[arg(long, default_value_t = 50)]
    pub nwavestep: usize,
    /// Wavelength bins of padding on each side of a patch.
    #[arg(long, default_value_t = 10)]
    pub wavepad: usize,
    /// Extra wavelength padding as a fraction of wavepad.
    #[arg(long, default_value_t = 0.2)]
    pub wavepad_frac: f64,
    /// Fraction of the padding rows of a patch that are used.
    #[arg(long, default_value_t = 0.8)]
    pub pixpad_frac: f64,
    /// Fractional PSF error for chi2pix (default: PSFERR of the PSF, else 0.01).
    #[arg(long)]
    pub psferr: Option<f64>,
    /// MASK bits that reject a pixel: a bit mask (default: desispec's extractmaskval, 767,
    /// which keeps BADREADNOISE pixels) or `any` (gpu_specter's rule).
    #[arg(long, default_value = "767", value_parser = parse_mask_bits)]
    pub mask_bits: MaskRule,
    /// Divide the wavelength grid by the barycentric correction factor of the exposure
    /// (from the image header, else the fibermap's) and record it as HELIOCOR.
    #[arg(long)]
    pub barycentric_correction: bool,
    /// Do not compute the SCORES HDU.
    #[arg(long)]
    pub no_scores: bool,
    /// BAD2DFIT rule: `100` (chi2pix > 100, desispec 0.70.0) or `median5` (chi2pix > 5 times
    /// its median over fibers and over wavelengths, desispec 0.71's production rule).
    #[arg(long, default_value = "100")]
    pub bad2dfit: crate::frame::Bad2dfit,
    /// Refused: desispec's default extraction does not decorrelate across fibers either.
    #[arg(long)]
    pub decorrelate_fibers: bool,
    /// Accepted for compatibility with desi_extract_spectra: spex is the extractor.
    #[arg(long)]
    pub use_specter: bool,
    /// Worker threads per rank (default: the cores available to the rank).
    #[arg(long, default_value_t = 0)]
    pub threads: usize,
    /// Require the GPU (also `--use-gpu`): without a usable one the job fails. By default a
    /// usable GPU is used and the CPU otherwise.
    #[arg(long, visible_alias = "use-gpu", conflicts_with = "no_gpu")]
    pub gpu: bool,
    /// Never use a GPU (also set by the DESI_NO_GPU environment variable).
    #[arg(long)]
    pub no_gpu: bool,
    /// CUDA device (default: the node's extracting ranks go to its visible devices in
    /// contiguous blocks).
    #[arg(long)]
    pub device: Option<usize>,
    /// Accepted for compatibility: spex uses MPI whenever it runs under a launcher.
    #[arg(long)]
    pub mpi: bool,
    /// Overlap reading and writing with extraction: dedicated reader and writer ranks in each
    /// frame group of 3 or more ranks, threads in a group of one rank.
    #[arg(long)]
    pub async_io: bool,
    /// Split the ranks into N groups that read, extract and write different frames at the same
    /// time (frame k goes to group k mod N), e.g. one group per GPU.
    #[arg(long, value_name = "N", default_value_t = 1, value_parser = parse_count)]
    pub frame_groups: usize,
    /// Frames a rank that forms a frame group alone solves at the same time on each of its
    /// devices under --async-io, each on a backend of its own (on the CPU they share the
    /// rank's threads). Default: 2 on GPUs when the rank has more frames than GPUs (a GPU's
    /// kernels then overlap the host-side work of its other frame), else 1.
    #[arg(long, value_name = "N", value_parser = parse_count)]
    pub frames_in_flight: Option<usize>,
    /// Reader threads, and as many writer threads, per device of a rank that forms a frame
    /// group alone under --async-io (default: half the rank's cores, at least 3 per GPU, whose
    /// frames are solved faster than one thread reads or writes them; 1 on the CPU).
    #[arg(long, value_name = "N", value_parser = parse_count)]
    pub io_threads: Option<usize>,
    /// Skip frames whose output already exists.
    #[arg(long)]
    pub skip_existing: bool,
    /// Compare the result with this reference frame; exit 3 outside the parity tolerances.
    #[arg(long, value_name = "REF")]
    pub test: Option<PathBuf>,
    /// Log level: debug, info, warning, error.
    #[arg(long, default_value = "info", value_parser = ["trace", "debug", "info", "warning", "warn", "error", "critical"])]
    pub loglevel: String,
    /// Log at debug level (desi_extract_spectra's spelling).
    #[arg(short, long)]
    pub verbose: bool,
    /// Reject pixels whose residual exceeds NSIGMA times the model's noise and solve their
    /// patch again (off by default, NSIGMA 5 when given without a value).
    #[arg(long, value_name = "NSIGMA", num_args = 0..=1, default_missing_value = "5")]
    pub reject_outliers: Option<f64>,
}

impl ExtractArgs {
    /// The log level: `--loglevel`, or debug with `-v`.
    pub fn log_level(&self) -> &str {
        if self.verbose {
            "debug"
        } else {
            &self.loglevel
        }
    }
}

/// Options of `spex compare`.
#[derive(Debug, Args, Clone)]
pub struct CompareArgs {
    /// Frame to examine.
    pub frame: PathBuf,
    /// Second frame for a parity comparison.
    #[arg(required_unless_present = "truth", conflicts_with = "truth")]
    pub other: Option<PathBuf>,
    /// Simulation truth (WAVELENGTH, FLUX in photons per bin) for pull statistics.
    #[arg(long)]
    pub truth: Option<PathBuf>,
    /// Fiber of the truth's first row (default: its FIBERMIN keyword, else 0).
    #[arg(long)]
    pub truth_fibermin: Option<usize>,
    /// Parity: minimum fraction of bins with |df|/sigma < 1e-4.
    #[arg(long, default_value_t = 0.999, value_parser = parse_limit)]
    pub min_fraction: f64,
    /// Parity: largest |df|/sigma allowed.
    #[arg(long, default_value_t = 1e-2, value_parser = parse_limit)]
    pub max_dflux: f64,
    /// Parity: relative tolerance of ivar, resolution and chi2pix.
    #[arg(long, default_value_t = 1e-4, value_parser = parse_limit)]
    pub rel_tolerance: f64,
    /// Pulls: largest |mean| allowed.
    #[arg(long, default_value_t = 0.01, value_parser = parse_limit)]
    pub max_mean: f64,
    /// Pulls: largest standard deviation allowed.
    #[arg(long, default_value_t = 1.02, value_parser = parse_limit)]
    pub max_std: f64,
    /// Pulls: allowed range of the median |pull|, `lo,hi`.
    #[arg(long, default_value = "0.66,0.70", value_parser = parse_pair)]
    pub median_range: (f64, f64),
}

/// Parses `wmin,wmax,dw`.
pub fn parse_wavelength(s: &str) -> std::result::Result<(f64, f64, f64), String> {
    let parts: Vec<&str> = s.split(',').map(str::trim).collect();
    if parts.len() != 3 {
        return Err(format!("expected wmin,wmax,dw, got {s:?}"));
    }
    let v: Vec<f64> = parts
        .iter()
        .map(|p| {
            p.parse::<f64>()
                .map_err(|_| format!("{p:?} is not a number"))
        })
        .collect::<std::result::Result<_, _>>()?;
    if let Some(p) = v.iter().position(|x| !x.is_finite()) {
        let name = ["wmin", "wmax", "dw"][p];
        return Err(format!("{name} must be finite, got {}", number(v[p])));
    }
    if !(v[2] > 0.0) {
        return Err(format!("dw must be positive, got {}", number(v[2])));
    }
    if !(v[1] >= v[0]) {
        let (wmax, wmin) = (number(v[1]), number(v[0]));
        return Err(format!("wmax {wmax} is below wmin {wmin}"));
    }
    Ok((v[0], v[1], v[2]))
}

/// Parses `simulate`'s grid: [`parse_wavelength`], and at most as many bins as an extraction
/// may have (each bin is a spectrum sample of every fiber: an unbounded grid would fill the
/// memory before anything is written).
pub fn parse_simulated_grid(s: &str) -> std::result::Result<(f64, f64, f64), String> {
    let (wmin, wmax, dw) = parse_wavelength(s)?;
    crate::plan::check_grid(wmin, wmax, dw).map_err(|e| match e {
        crate::error::Error::Config(m) => m,
        e => e.to_string(),
    })?;
    Ok((wmin, wmax, dw))
}

/// The largest read noise `simulate` takes, in electrons: beyond a CCD's full well by an
/// order of magnitude, and far from float32's range, where the image would overflow.
pub const MAX_READ_NOISE: f64 = 1e6;

/// Parses `simulate --read-noise`: a number in `0..=MAX_READ_NOISE`.
pub fn parse_read_noise(s: &str) -> std::result::Result<f64, String> {
    let v = parse_limit(s)?;
    if v > MAX_READ_NOISE {
        return Err(format!(
            "read noise must be at most {MAX_READ_NOISE:e} electrons, got {s}"
        ));
    }
    Ok(v)
}

/// Parses `simulate --cosmic-density`: a number in `0..=MAX_COSMIC_DENSITY`.
pub fn parse_cosmic_density(s: &str) -> std::result::Result<f64, String> {
    use crate::simulate::MAX_COSMIC_DENSITY;
    let v = parse_limit(s)?;
    if v > MAX_COSMIC_DENSITY {
        return Err(format!(
            "cosmic-ray density must be at most {MAX_COSMIC_DENSITY:e} tracks per million pixels, got {s}"
        ));
    }
    Ok(v)
}

/// Parses a count of groups or frames: a positive integer.
pub fn parse_count(s: &str) -> std::result::Result<usize, String> {
    match s.trim().parse::<usize>() {
        Ok(n) if n > 0 => Ok(n),
        _ => Err(format!("expected a positive integer, got {s:?}")),
    }
}

/// Parses a comparison limit: a finite number, not negative. A NaN limit would make every
/// comparison with it pass.
pub fn parse_limit(s: &str) -> std::result::Result<f64, String> {
    let v: f64 = s
        .trim()
        .parse()
        .map_err(|_| format!("{s:?} is not a number"))?;
    if !v.is_finite() || v < 0.0 {
        return Err(format!("a limit must be finite and not negative, got {s}"));
    }
    Ok(v)
}

/// Parses `simulate --sky-fraction`: a number in `0..=1`.
pub fn parse_fraction(s: &str) -> std::result::Result<f64, String> {
    let v = parse_limit(s)?;
    if v > 1.0 {
        return Err(format!("a fraction must be in 0..1, got {s}"));
    }
    Ok(v)
}

/// Parses one amplifier of `simulate --masked-amps`: A, B, C or D.
pub fn parse_amplifier(s: &str) -> std::result::Result<char, String> {
    match s.trim() {
        "A" => Ok('A'),
        "B" => Ok('B'),
        "C" => Ok('C'),
        "D" => Ok('D'),
        _ => Err(format!("an amplifier is A, B, C or D, got {s:?}")),
    }
}

/// Parses `lo,hi`: finite numbers, `lo <= hi`.
pub fn parse_pair(s: &str) -> std::result::Result<(f64, f64), String> {
    let (a, b) = s
        .split_once(',')
        .ok_or_else(|| format!("expected lo,hi, got {s:?}"))?;
    let a = a
        .trim()
        .parse::<f64>()
        .map_err(|_| format!("{a:?} is not a number"))?;
    let b = b
        .trim()
        .parse::<f64>()
        .map_err(|_| format!("{b:?} is not a number"))?;
    if !(a.is_finite() && b.is_finite() && a <= b) {
        return Err(format!("expected finite lo <= hi, got {s}"));
    }
    Ok((a, b))
}

/// Parses `any` or a bit mask (decimal or 0x hexadecimal).
pub fn parse_mask_bits(s: &str) -> std::result::Result<MaskRule, String> {
    let s = s.trim();
    if s.eq_ignore_ascii_case("any") {
        return Ok(MaskRule::AnyBit);
    }
    let bits = if let Some(hex) = s.strip_prefix("0x") {
        u32::from_str_radix(hex, 16)
    } else {
        s.parse::<u32>()
    }
    .map_err(|_| format!("{s:?} is neither 'any' nor a bit mask"))?;
    Ok(MaskRule::Bits(bits))
}

/// Inserts the default `extract` subcommand when the first argument is an option, so that
/// gpu_specter job lines (`spex -i ... -p ... -o ...`) run unchanged.
pub fn with_default_subcommand(mut args: Vec<std::ffi::OsString>) -> Vec<std::ffi::OsString> {
    let first = args.get(1).and_then(|a| a.to_str()).unwrap_or("");
    let passthrough = ["-h", "--help", "-V", "--version"];
    if first.starts_with('-') && !passthrough.contains(&first) {
        args.insert(1, "extract".into());
    }
    args
}

/// Options of `spex qa`.
#[derive(Debug, Args, Clone)]
pub struct QaArgs {
    /// Frame to draw.
    pub frame: PathBuf,
    /// Output picture (PNG).
    #[arg(short, long)]
    pub output: PathBuf,
    /// Simulation truth (WAVELENGTH, FLUX in photons per bin): adds the pull histogram.
    #[arg(long)]
    pub truth: Option<PathBuf>,
    /// Fiber of the truth's first row (default: its FIBERMIN keyword, else 0).
    #[arg(long)]
    pub truth_fibermin: Option<usize>,
    /// Model image of the extraction (`spex extract -m`): with --image, adds the residual.
    #[arg(long, requires = "image")]
    pub model: Option<PathBuf>,
    /// Preproc image that was extracted: with --model, adds the residual.
    #[arg(long, requires = "model")]
    pub image: Option<PathBuf>,
    /// MASK bits of the image that give a pixel no weight in the residual, as in extract.
    #[arg(long, default_value = "767", value_parser = parse_mask_bits)]
    pub mask_bits: MaskRule,
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(args: &[&str]) -> std::result::Result<Cli, clap::Error> {
        let args: Vec<std::ffi::OsString> = args.iter().map(Into::into).collect();
        Cli::try_parse_from(with_default_subcommand(args))
    }

    #[test]
    fn gpu_specter_command_lines_parse_without_subcommand() {
        let cli = parse(&[
            "spex",
            "-i",
            "in.fits",
            "-p",
            "psf.fits",
            "-o",
            "out.fits",
            "-w",
            "6000,6400,0.8",
            "-s",
            "25",
            "-n",
            "25",
            "--mpi",
            "--use-gpu",
        ])
        .unwrap();
        let Command::Extract(a) = cli.command else {
            panic!("not extract")
        };
        assert_eq!(a.wavelength, Some((6000.0, 6400.0, 0.8)));
        assert_eq!((a.specmin, a.nspec), (25, Some(25)));
        assert!(a.gpu && a.mpi);
        assert_eq!(a.nwavestep, 50);
        assert_eq!(a.mask_bits, MaskRule::Bits(767));
    }

    #[test]
    fn gpu_and_no_gpu_conflict() {
        assert!(parse(&["spex", "-i", "a", "-p", "b", "-o", "c", "--gpu", "--no-gpu"]).is_err());
    }

    #[test]
    fn wavelength_must_be_three_numbers_with_positive_step() {
        assert!(parse_wavelength("6000,6400").is_err());
        assert!(parse_wavelength("6000,6400,0").is_err());
        assert!(parse_wavelength("6000,6400,-0.8").is_err());
        assert!(parse_wavelength("6400,6000,0.8").is_err());
        assert!(parse_wavelength("a,b,c").is_err());
        assert_eq!(
            parse_wavelength("5760, 7620, 0.8"),
            Ok((5760.0, 7620.0, 0.8))
        );
    }

    #[test]
    fn mask_bits_accept_any_decimal_and_hex() {
        assert_eq!(parse_mask_bits("any"), Ok(MaskRule::AnyBit));
        assert_eq!(parse_mask_bits("767"), Ok(MaskRule::Bits(767)));
        assert_eq!(parse_mask_bits("0x2ff"), Ok(MaskRule::Bits(767)));
        assert!(parse_mask_bits("some").is_err());
    }

    #[test]
    fn inputs_are_required_without_a_list() {
        assert!(parse(&["spex", "-i", "a", "-p", "b"]).is_err());
        assert!(parse(&["spex", "extract", "--list", "frames.txt"]).is_ok());
    }

    #[test]
    fn simulate_options_follow_the_flags() {
        let cli = parse(&[
            "spex",
            "simulate",
            "-p",
            "psf.fits",
            "-o",
            "img.fits",
            "--truth",
            "t.fits",
            "-w",
            "5760,7620,0.8",
            "-s",
            "25",
            "-n",
            "50",
            "--seed",
            "7",
            "--bad-column",
            "2000",
        ])
        .unwrap();
        let Command::Simulate(a) = cli.command else {
            panic!("not simulate")
        };
        let o = a.options(500);
        assert_eq!(o.fibers, 25..75);
        assert_eq!((o.seed, o.bad_column, o.noise), (7, Some(2000), true));
        assert!(parse(&["spex", "simulate", "-p", "psf.fits", "-o", "img.fits"]).is_err());
    }

    #[test]
    fn simulate_exposure_kinds_follow_the_flags() {
        let base = [
            "spex",
            "simulate",
            "-p",
            "p.fits",
            "-o",
            "i.fits",
            "--truth",
            "t.fits",
            "-w",
            "6000,6100,0.8",
        ];
        let options = |extra: &[&str]| {
            let args: Vec<&str> = base.iter().chain(extra).copied().collect();
            let Command::Simulate(a) = parse(&args).unwrap().command else {
                panic!("not simulate")
            };
            a.options(500)
        };
        let o = options(&[]);
        assert_eq!((o.flat, o.sky_fraction, o.expid), (false, 0.1, 1));
        assert!(o.dead_fibers.is_empty() && o.masked_amps.is_empty());
        let o = options(&[
            "--flat",
            "--sky-fraction",
            "0.3",
            "--dead-fibers",
            "3,7",
            "--masked-amps",
            "B,D",
            "--expid",
            "2",
        ]);
        assert_eq!((o.flat, o.sky_fraction, o.expid), (true, 0.3, 2));
        assert_eq!((o.dead_fibers, o.masked_amps), (vec![3, 7], vec!['B', 'D']));
        for bad in [["--sky-fraction", "1.5"], ["--masked-amps", "B,E"]] {
            let args: Vec<&str> = base.iter().chain(&bad).copied().collect();
            assert!(parse(&args).is_err(), "{bad:?}");
        }
    }

    #[test]
    fn compare_needs_a_second_frame_or_the_truth() {
        assert!(parse(&["spex", "compare", "a.fits"]).is_err());
        assert!(parse(&["spex", "compare", "a.fits", "b.fits"]).is_ok());
        assert!(parse(&["spex", "compare", "a.fits", "--truth", "t.fits"]).is_ok());
    }

    #[test]
    fn qa_needs_an_output_and_the_model_with_the_image() {
        assert!(parse(&["spex", "qa", "f.fits"]).is_err());
        assert!(parse(&["spex", "qa", "f.fits", "-o", "qa.png"]).is_ok());
        assert!(parse(&["spex", "qa", "f.fits", "-o", "q.png", "--model", "m.fits"]).is_err());
        assert!(parse(&["spex", "qa", "f.fits", "-o", "q.png", "--image", "i.fits"]).is_err());
        let both = [
            "--model", "m.fits", "--image", "i.fits", "--truth", "t.fits",
        ];
        let mut args = vec!["spex", "qa", "f.fits", "-o", "q.png"];
        args.extend(both);
        assert!(parse(&args).is_ok());
    }
}
