//! Tests of the PSF: polynomials, edge integrals and exponential against closed forms and
//! libm, pixel integrals against numerical integration, the bundled PSFs' spots.

use std::path::{Path, PathBuf};

use super::*;
use crate::fits::Fits;

fn data(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/data")
        .join(name)
}

#[test]
fn legendre_matches_closed_forms() {
    let mut p = [0.0; 5];
    for &u in &[-1.0, -0.3, 0.0, 0.7, 1.0] {
        legendre_values(u, 4, &mut p);
        let expect = [
            1.0,
            u,
            0.5 * (3.0 * u * u - 1.0),
            0.5 * (5.0 * u * u * u - 3.0 * u),
            (35.0 * u.powi(4) - 30.0 * u * u + 3.0) / 8.0,
        ];
        for (a, b) in p.iter().zip(expect) {
            assert!((a - b).abs() < 1e-14, "P at {u}: {a} vs {b}");
        }
    }
}

#[test]
fn legendre_series_uses_its_own_domain() {
    let l = Legendre {
        wavemin: 5000.0,
        wavemax: 7000.0,
        ncoef: 3,
        coeff: vec![1.0, 2.0, 3.0],
    };
    // u = 0 at the centre: 1 + 0 + 3 * (-1/2)
    assert!((l.eval(0, 6000.0) - (1.0 - 1.5)).abs() < 1e-14);
    // u = 1 at wavemax: 1 + 2 + 3
    assert!((l.eval(0, 7000.0) - 6.0).abs() < 1e-13);
}

#[test]
fn batched_traces_are_the_scalar_ones_bit_for_bit() {
    let psf = GaussHermitePsf::read(&data("psf-r0-00067784.fits")).unwrap();
    // a grid whose length is not a multiple of the lanes, and a single wavelength
    let waves: Vec<f64> = (0..2331).map(|i| 5760.0 + 0.8 * i as f64).collect();
    for fiber in [0, 251, 499] {
        for grid in [&waves[..], &waves[7..8]] {
            let (x, y) = psf.trace(fiber, grid);
            for (i, &w) in grid.iter().enumerate() {
                let (ex, ey) = psf.xy(fiber, w);
                assert_eq!(x[i].to_bits(), ex.to_bits(), "x of fiber {fiber} at {w}");
                assert_eq!(y[i].to_bits(), ey.to_bits(), "y of fiber {fiber} at {w}");
            }
        }
    }
}

#[test]
fn hermite_matches_closed_forms() {
    let mut h = [0.0; 5];
    for &t in &[-2.0, -0.5, 0.0, 1.3] {
        hermite_values(t, 4, &mut h);
        let expect = [
            1.0,
            t,
            t * t - 1.0,
            t.powi(3) - 3.0 * t,
            t.powi(4) - 6.0 * t * t + 3.0,
        ];
        for (a, b) in h.iter().zip(expect) {
            assert!((a - b).abs() < 1e-13);
        }
    }
}

/// Simpson integration of He_k(t) phi(t) over [a, b].
fn integrate(k: usize, a: f64, b: f64) -> f64 {
    let n = 2000;
    let h = (b - a) / n as f64;
    let mut herm = [0.0; 24];
    let f = |t: f64, herm: &mut [f64]| {
        hermite_values(t, k, herm);
        herm[k] * (-0.5 * t * t).exp() / (2.0 * std::f64::consts::PI).sqrt()
    };
    let mut s = f(a, &mut herm) + f(b, &mut herm);
    for i in 1..n {
        let w = if i % 2 == 1 { 4.0 } else { 2.0 };
        s += w * f(a + i as f64 * h, &mut herm);
    }
    s * h / 3.0
}

/// The branch-free exponential is within two ulps of the correctly rounded one.
#[test]
fn exponential_is_accurate() {
    for i in 0..=200_000 {
        let y = -745.0 * (i as f64 / 200_000.0).powi(2);
        let (got, expect) = (exp_nonpositive(y), libm::exp(y));
        if y >= -700.0 {
            assert!(
                (got - expect).abs() <= 2.0 * f64::EPSILON * expect,
                "exp({y}) = {got:e} vs {expect:e}"
            );
        } else {
            assert!(got <= 1e-304);
        }
    }
    assert_eq!(exp_nonpositive(0.0), 1.0);
    assert_eq!(exp_nonpositive(-800.0), 0.0);
}

/// erf at the edges agrees with libm's to a few units of 1e-16, and the remainder in the
/// tails is erfc to a relative accuracy that only the rounding of `t^2` limits.
#[test]
fn gaussian_edges_match_libm() {
    for i in -40_000..=40_000 {
        let t = i as f64 * 1e-3;
        let x = t * std::f64::consts::FRAC_1_SQRT_2;
        let g = gauss_edge(t);
        let erf = libm::erf(x);
        assert!(
            (g.whole + g.part - erf).abs() <= 2.0 * f64::EPSILON,
            "erf({x}): {} + {} vs {erf}",
            g.whole,
            g.part
        );
        let gauss = libm::exp(-0.5 * t * t);
        assert!(
            (g.gauss - gauss).abs() <= 2.0 * f64::EPSILON * gauss || g.gauss < 1e-303,
            "gauss({t})"
        );
        // (beyond |x| = 26 the Gaussian is held at exp(-700))
        if g.whole != 0.0 && x.abs() < 26.0 {
            let erfc = libm::erfc(x.abs());
            let tol = 8.0 * f64::EPSILON * (1.0 + x * x) * erfc;
            assert!(
                (g.whole * -g.part - erfc).abs() <= tol,
                "erfc({}): {:e} vs {erfc:e}",
                x.abs(),
                -g.whole * g.part
            );
        }
    }
}

#[test]
fn pixel_integrals_match_numerical_integration() {
    let (n, deg, sigma, center) = (11, 6, 1.1, 1234.37);
    let mut out = vec![0.0; (deg + 1) * n];
    pixel_gauss_hermite(center, sigma, deg, n, &mut out);
    let frac = (center + 0.5f64).rem_euclid(1.0) - 0.5;
    for k in 0..=deg {
        for i in 0..n {
            let lo = (i as f64 - (n / 2) as f64 - 0.5 - frac) / sigma;
            let hi = lo + 1.0 / sigma;
            // pixel integral in t of He_k phi, per unit t; degree 0 is the Gaussian's mass
            let expect = integrate(k, lo, hi);
            let got = out[k * n + i];
            // d/dt(-He_{k-1} phi) = He_k phi, so degree k >= 1 values are integrals of He_k phi
            assert!(
                (got - expect).abs() < 1e-10,
                "k={k} i={i}: {got} vs {expect}"
            );
        }
    }
}

#[test]
fn real_psfs_read_with_their_shapes() {
    let a = GaussHermitePsf::read(&data("psf-r0-00067784.fits")).unwrap();
    assert_eq!(
        (a.nfiber, a.legdeg, a.hsizex, a.hsizey, a.ghdegx, a.ghdegy),
        (500, 1, 8, 5, 6, 6)
    );
    assert_eq!((a.npix_x, a.npix_y), (4114, 4128));
    assert_eq!(a.psferr, None);
    let b = GaussHermitePsf::read(&data("psf-r0-00051060.fits")).unwrap();
    assert_eq!((b.nfiber, b.legdeg), (500, 3));
    let (lo, hi) = b.wave_domain();
    assert!(lo < 5800.0 && hi > 7600.0);
}

#[test]
fn spots_are_normalised_nonnegative_and_centred() {
    let psf = GaussHermitePsf::read(&data("psf-r0-00051060.fits")).unwrap();
    let waves = [5800.0, 6500.3, 7600.0];
    let spots = psf.spots(10..13, &waves);
    for f in 0..3 {
        for (w, &wave) in waves.iter().enumerate() {
            let s = spots.spot(f, w);
            let sum: f64 = s.iter().sum();
            assert!((sum - 1.0).abs() < 1e-12);
            assert!(s.iter().all(|&v| v >= 0.0));
            // the centroid lies within half a pixel of the trace
            let (nx, ny) = (spots.corners.nx, spots.corners.ny);
            let (xc, yc) = spots.corners.corner(f, w);
            let cx: f64 = (0..ny * nx)
                .map(|i| s[i] * (xc as f64 + (i % nx) as f64))
                .sum();
            let cy: f64 = (0..ny * nx)
                .map(|i| s[i] * (yc as f64 + (i / nx) as f64))
                .sum();
            let (x, y) = psf.xy(10 + f, wave);
            assert!(
                (cx - x).abs() < 0.5 && (cy - y).abs() < 0.5,
                "centroid ({cx}, {cy}) vs trace ({x}, {y})"
            );
        }
    }
    assert_eq!(psf.corners(10..13, &waves), spots.corners);
}

/// Log lines written while `f` runs, captured by a subscriber of this thread only.
fn logged<T>(f: impl FnOnce() -> T) -> (T, String) {
    use std::sync::{Arc, Mutex};
    #[derive(Clone, Default)]
    struct Sink(Arc<Mutex<Vec<u8>>>);
    impl std::io::Write for Sink {
        fn write(&mut self, b: &[u8]) -> std::io::Result<usize> {
            self.0.lock().unwrap().extend_from_slice(b);
            Ok(b.len())
        }
        fn flush(&mut self) -> std::io::Result<()> {
            Ok(())
        }
    }
    let sink = Sink::default();
    let writer = sink.clone();
    let subscriber = tracing_subscriber::fmt()
        .with_writer(move || writer.clone())
        .with_ansi(false)
        .finish();
    let out = tracing::subscriber::with_default(subscriber, f);
    let text = String::from_utf8(sink.0.lock().unwrap().clone()).unwrap();
    (out, text)
}

#[test]
fn psf_with_tails_gets_one_warning() {
    let (psf, log) = logged(|| GaussHermitePsf::read(&data("psf-r0-00067784.fits")));
    let psf = psf.unwrap();
    assert_eq!(psf.tail_amplitude, 0.0);
    assert!(!log.contains("TAILAMP"), "{log}");
    assert_eq!(
        psf.orig_psf.as_deref(),
        Some("SPECPROD/calibnight/20201214/psfnight-r0-20201214.fits")
    );

    // The same PSF with a tail amplitude on one fiber.
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("psf-tails.fits");
    std::fs::copy(data("psf-r0-00067784.fits"), &path).unwrap();
    let row = {
        let mut f = Fits::open(&path).unwrap();
        f.move_to("PSF").unwrap();
        let names = f.column_str("PARAM").unwrap();
        names.iter().position(|n| n.trim() == "TAILAMP").unwrap()
    };
    {
        let mut f = fitsio::FitsFile::edit(&path).unwrap();
        let hdu = f.hdu("PSF").unwrap();
        hdu.write_col_range(&mut f, "COEFF", &[0.02f64], &(row..row + 1))
            .unwrap();
    }
    let (psf, log) = logged(|| GaussHermitePsf::read(&path));
    assert_eq!(psf.unwrap().tail_amplitude, 0.02);
    assert_eq!(log.matches("tails are not modelled").count(), 1, "{log}");
    assert!(log.contains("WARN"), "{log}");
}

#[test]
fn missing_or_wrong_files_are_reported_by_name() {
    let err = GaussHermitePsf::read(Path::new("/nonexistent/psf.fits")).unwrap_err();
    assert!(err.to_string().contains("/nonexistent/psf.fits"));
    // a preproc image has no PSF HDU
    let err = GaussHermitePsf::read(&data("preproc-bundle0.fits")).unwrap_err();
    assert!(err.to_string().contains("PSF"), "{err}");
}
