//! Wavelength grids at their edges: a barycentric correction on a grid whose end falls on a
//! bin boundary, grids of one bin (SCORES and pulls per Angstrom of the step), and absurd
//! floats in messages.

use super::files::refused_options;
use super::*;
use spex::compare::{pull_values, Truth};
use spex::plan::output_grid;

/// Extracts `input` on `grid` with `extra` options into `name`: the frame.
fn extract_on(c: &Case, input: &Path, grid: &str, name: &str, extra: &[&str]) -> Frame {
    let mut a = args!["-i", input, "-p", data(PSF), "-o", c.path(name), "-w", grid];
    a.extend(args!["-s", "0", "-n", "25", "--threads", "1"]);
    a.extend(extra.iter().map(OsString::from));
    let o = spex(a);
    expect(&o, 0, &[]);
    Frame::read(&c.path(name)).expect("the frame")
}

fn heliocor(path: &Path) -> f64 {
    let mut f = spex::fits::Fits::open(path).unwrap();
    f.move_to("FLUX").unwrap();
    f.key_f64("HELIOCOR").unwrap().expect("HELIOCOR")
}

/// A requested grid whose divided end would gain or lose a bin is extracted with the bins
/// of the requested grid, as desi_extract_spectra divides its arange, and carries it.
#[test]
fn barycentric_correction_keeps_the_requested_number_of_bins() {
    let c = Case::new();
    let input = pointed_preproc(&c, 20.0, 59197.3, &["IMAGE"]);
    let bary = ["--barycentric-correction"];
    extract_on(&c, &input, "6000,6040,0.8", "probe.fits", &bary);
    let h = heliocor(&c.path("probe.fits"));
    // Grids ending half a bin short of a bin: dividing all three numbers by h changes the
    // count of some (the rounding of the division decides).
    let edge = (10..=60)
        .map(|k| 6000.0 + k as f64 * 0.8 - 0.4)
        .find(|&wmax| {
            let divided = output_grid(6000.0 / h, wmax / h, 0.8 / h).len();
            divided != output_grid(6000.0, wmax, 0.8).len()
        })
        .expect("no grid of 10 to 60 bins changes its count when divided: nothing to test");
    let grid = format!("6000,{edge},0.8");
    let frame = extract_on(&c, &input, &grid, "f.fits", &bary);
    let requested = output_grid(6000.0, edge, 0.8);
    assert_eq!(
        frame.wave, requested,
        "{grid}: the requested grid is carried"
    );
    assert!(frame.flux.iter().all(|f| f.is_finite()));
}

/// A frame of one bin: its SCORES and its pulls against the truth are per Angstrom of the
/// grid's step, as those of any other grid.
#[test]
fn one_bin_scores_and_pulls_are_per_angstrom() {
    let c = Case::new();
    let frame = extract_on(&c, &data(IMAGE), "6020,6020,0.8", "f.fits", &[]);
    assert_eq!(frame.nwave(), 1);
    let truth = Truth::read(&data("truth-bundle0.fits"), None).unwrap();
    let pulls = pull_values(&frame, &truth).unwrap();
    assert!(pulls.len() > 20, "{} pulls", pulls.len());
    assert!(pulls.iter().all(|p| p.is_finite()));
    // The mean of n unit pulls is within 5 / sqrt(n) of 0 but for one run in 10^6. Taking
    // the bin as 1 A wide instead of 0.8 moves each pull by 0.2 flux sqrt(ivar): on average
    // by more than twice that, or this tests nothing.
    let n = pulls.len() as f64;
    let limit = 5.0 / n.sqrt();
    let mean = pulls.iter().sum::<f64>() / n;
    let measured = frame.ivar.iter().filter(|&&iv| iv > 0.0).count() as f64;
    let moved = (frame.flux.iter().zip(&frame.ivar))
        .map(|(f, iv)| 0.2 * f * iv.sqrt())
        .sum::<f64>()
        / measured;
    assert!(
        moved > 2.0 * limit,
        "a unit error moves the mean by {moved} only"
    );
    assert!(mean.abs() < limit, "mean pull {mean} of a one-bin frame");

    // MEDIAN_RAW_COUNT is flux / dw: the per-Angstrom flux over the step.
    let mut f = spex::fits::Fits::open(&c.path("f.fits")).unwrap();
    f.move_to("SCORES").unwrap();
    let (_, counts) = f.column::<f64>("MEDIAN_RAW_COUNT_R").unwrap();
    for (count, flux) in counts.iter().zip(frame.flux.column(0)) {
        // the frame's flux was cast to float32 after the scores were computed
        let tolerance = f64::from(f32::EPSILON) * (flux / 0.8).abs();
        assert!(
            (count - flux / 0.8).abs() <= tolerance,
            "{count} vs {flux} / 0.8"
        );
    }
}

/// Floats in messages are printed short: exponent form beyond 1e16 and below 1e-4.
#[test]
fn absurd_floats_are_printed_short_in_messages() {
    refused_options(
        args!["-w", "6000,6040,1e-300"],
        &["in steps of 1e-300 is more than"],
    );
    refused_options(args!["-w", "1e300,2e300,1"], &["1e300..2e300"]);
    refused_options(
        args!["-w", "6000,6040,-1e-300"],
        &["dw must be positive, got -1e-300"],
    );
    refused_options(args!["-w", "1e300,1,1"], &["wmax 1 is below wmin 1e300"]);
    let o = refused_pointing(20.0, 1e300, &["IMAGE"], &["in.fits", "MJD 1e300"]);
    let longest = o.stderr.lines().map(str::len).max().unwrap_or(0);
    assert!(
        longest < 300,
        "a line of {longest} characters:\n{}",
        o.stderr
    );
}
