//! The spectra of a simulation: a night-sky continuum with its brightest emission lines, and
//! on object fibers a smooth continuum with redshifted emission lines, drawn from each fiber's
//! own random stream; or, for a flat exposure, the lamp's continuum. Every fiber has a
//! throughput drawn from its stream (3% rms) whatever the exposure, so a flat and a science
//! exposure of the same seed share their fibers' throughputs, as a real flat and science
//! exposure share their fibers.

use rand::RngExt;
use rand_distr::StandardNormal;

use super::{stream_rng, ObjType, SimulateOptions, STREAM_FIBER};

/// The brightest night-sky emission lines between 3600 and 9850 A: air wavelengths (A) of
/// the mercury and sodium street-light lines, [OI] and the OH Meinel bands (after the
/// Osterbrock et al. 1996 atlas), with representative fluxes in photons per fiber in a 900 s
/// exposure. They set realistic positions, spacings and contrasts; they are not a calibrated
/// sky model.
const SKY_LINES: &[(f64, f64)] = &[
    (4046.56, 250.0),
    (4358.34, 500.0),
    (5460.74, 700.0),
    (5577.34, 9000.0),
    (5682.63, 120.0),
    (5688.21, 150.0),
    (5889.95, 1500.0),
    (5895.92, 1100.0),
    (5915.31, 150.0),
    (5932.86, 130.0),
    (5953.42, 110.0),
    (6257.96, 300.0),
    (6287.43, 350.0),
    (6300.30, 3000.0),
    (6306.87, 150.0),
    (6329.93, 200.0),
    (6363.78, 1000.0),
    (6470.91, 200.0),
    (6498.73, 450.0),
    (6533.04, 500.0),
    (6553.62, 450.0),
    (6577.28, 400.0),
    (6596.64, 250.0),
    (6827.46, 250.0),
    (6863.96, 900.0),
    (6912.62, 500.0),
    (6923.19, 600.0),
    (6939.52, 500.0),
    (6948.94, 600.0),
    (7276.41, 500.0),
    (7303.72, 400.0),
    (7316.28, 900.0),
    (7329.15, 500.0),
    (7340.89, 900.0),
    (7358.70, 800.0),
    (7369.25, 500.0),
    (7401.69, 700.0),
    (7524.12, 300.0),
    (7571.75, 500.0),
    (7750.64, 1200.0),
    (7794.11, 1100.0),
    (7821.50, 1300.0),
    (7853.24, 500.0),
    (7913.71, 1500.0),
    (7964.65, 1600.0),
    (7993.33, 1800.0),
    (8344.60, 2500.0),
    (8399.17, 2500.0),
    (8430.17, 2000.0),
    (8465.36, 2600.0),
    (8493.39, 2400.0),
    (8761.32, 2000.0),
    (8767.91, 1800.0),
    (8778.33, 2200.0),
    (8791.19, 2000.0),
    (8827.10, 3000.0),
    (8885.85, 3000.0),
    (8919.63, 1000.0),
    (8943.40, 3500.0),
    (8958.08, 3200.0),
    (8988.38, 2800.0),
    (9313.97, 2000.0),
    (9375.96, 3000.0),
    (9419.72, 1500.0),
    (9439.67, 4000.0),
    (9476.90, 3500.0),
    (9567.09, 2000.0),
    (9622.10, 2500.0),
    (9714.67, 2000.0),
    (9737.86, 3000.0),
    (9793.60, 2000.0),
];

/// Intrinsic width (A, sigma) of the sky lines: unresolved, so almost all of a line's flux
/// falls in one or two bins of the truth.
const SKY_LINE_SIGMA: f64 = 0.2;

/// Vacuum wavelength of an air wavelength (A), inverting Ciddor's refractive index of
/// standard air to 0.01 A: DESI wavelengths are in vacuum.
pub(super) fn air_to_vacuum(air: f64) -> f64 {
    let s2 = (1e4 / air).powi(2);
    let n = 1.0
        + 8.336624212083e-5
        + 2.408926869968e-2 / (130.1065924522 - s2)
        + 1.599740894897e-4 / (38.92568793293 - s2);
    air * n
}

/// The sky line list in vacuum, with line widths.
pub(super) struct SkyLines {
    lines: Vec<(f64, f64)>,
}

impl SkyLines {
    pub(super) fn new() -> Self {
        SkyLines {
            lines: SKY_LINES
                .iter()
                .map(|&(w, f)| (air_to_vacuum(w), f))
                .collect(),
        }
    }
}

/// Night-sky continuum in photons per A for a 900 s exposure: a smooth, slowly varying
/// level of a few tens of photons per A, brighter to the red.
fn sky_continuum(w: f64) -> f64 {
    40.0 * (w / 6500.0).powf(0.7)
        * (1.0 + 0.15 * (2.0 * std::f64::consts::PI * (w - 4000.0) / 3100.0).cos())
}

/// The flat lamp's continuum in photons per A: smooth, the same for every fiber, and bright
/// enough (a few thousand photons per A) that a fiberflat made from it is far less noisy
/// than the sky spectra it corrects.
fn flat_lamp(w: f64) -> f64 {
    5000.0 * (w / 6500.0).powf(1.5)
}

/// Adds a Gaussian line of total `flux` photons centred at `center` with width `sigma` (A) to
/// the bins of `wave` (each bin `dw` wide, centred on its wavelength), integrating the
/// Gaussian over each bin; only bins within 8 sigma are touched.
fn add_line(spectrum: &mut [f64], wave: &[f64], dw: f64, center: f64, sigma: f64, flux: f64) {
    let (Some(&w0), n) = (wave.first(), wave.len()) else {
        return;
    };
    let reach = 8.0 * sigma + dw;
    let lo = (((center - reach - w0) / dw).floor().max(0.0) as usize).min(n);
    let hi = (((center + reach - w0) / dw).ceil().max(0.0) as usize + 1).min(n);
    let scale = 1.0 / (sigma * std::f64::consts::SQRT_2);
    for i in lo..hi {
        let a = (wave[i] - 0.5 * dw - center) * scale;
        let b = (wave[i] + 0.5 * dw - center) * scale;
        spectrum[i] += flux * 0.5 * (libm::erf(b) - libm::erf(a));
    }
}

/// Rest-frame vacuum wavelengths (A) of the strong emission lines of galaxies, with their
/// flux relative to H-alpha.
const OBJECT_LINES: &[(f64, f64)] = &[
    (3727.09, 0.35), // [OII]
    (3729.88, 0.45), // [OII]
    (4862.68, 0.35), // H-beta
    (4960.30, 0.17), // [OIII]
    (5008.24, 0.50), // [OIII]
    (6549.86, 0.10), // [NII]
    (6564.61, 1.00), // H-alpha
    (6585.27, 0.30), // [NII]
    (6718.29, 0.15), // [SII]
    (6732.67, 0.11), // [SII]
];

/// The spectrum of one fiber (photons per bin) and its kind. The random choices come from the
/// fiber's own stream, so they depend on the seed and the fiber number only.
pub(super) fn fiber_spectrum(
    fiber: usize,
    wave: &[f64],
    sky: &SkyLines,
    opts: &SimulateOptions,
) -> (ObjType, Vec<f64>) {
    let dw = opts.dw;
    let mut rng = stream_rng(opts.seed, STREAM_FIBER, fiber as u64);
    // Draw everything in a fixed order whatever the switches, so that switching the sky or
    // the objects off leaves the other component unchanged.
    let is_sky = rng.random_bool(opts.sky_fraction);
    let throughput = 1.0 + 0.03 * rng.sample::<f64, _>(StandardNormal);
    let amplitude = 10f64.powf(rng.random_range(1.0..2.2)); // photons per A at 6500 A
    let slope = rng.random_range(-2.0..1.5);
    let curvature = rng.random_range(-0.3..0.3);
    let redshift = rng.random_range(0.0..1.1);
    let halpha = 10f64.powf(rng.random_range(2.5..3.8)); // photons
    let has_lines = rng.random_bool(0.7);
    let dispersion = rng.random_range(40.0..200.0); // km/s

    let mut spectrum = vec![0.0; wave.len()];
    if opts.dead_fibers.contains(&fiber) {
        return (ObjType::Target, spectrum);
    }
    if opts.flat {
        for (s, &w) in spectrum.iter_mut().zip(wave) {
            *s = flat_lamp(w) * dw * throughput;
        }
        return (ObjType::Target, spectrum);
    }
    if opts.sky {
        for (s, &w) in spectrum.iter_mut().zip(wave) {
            *s = sky_continuum(w) * dw;
        }
        for &(center, flux) in &sky.lines {
            add_line(&mut spectrum, wave, dw, center, SKY_LINE_SIGMA, flux);
        }
        spectrum.iter_mut().for_each(|s| *s *= throughput);
    }
    // Fibers without an object are sky fibers, even when the sky itself is switched off.
    let kind = if opts.objects && !is_sky {
        ObjType::Target
    } else {
        ObjType::Sky
    };
    if opts.objects && !is_sky {
        for (s, &w) in spectrum.iter_mut().zip(wave) {
            let x = (w / 6500.0).ln();
            *s += amplitude * (slope * x + curvature * x * x).exp() * dw;
        }
        if has_lines {
            for &(rest, ratio) in OBJECT_LINES {
                let center = rest * (1.0 + redshift);
                let sigma = center * dispersion / 299_792.458;
                add_line(&mut spectrum, wave, dw, center, sigma, halpha * ratio);
            }
        }
    }
    (kind, spectrum)
}
