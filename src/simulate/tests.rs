//! Unit tests of the simulation: determinism, the truth, the image and the files.

use std::path::Path;

use super::spectra::air_to_vacuum;
use super::*;
use crate::error::Error;
use crate::image::{Image, MaskRule};

fn read_psf(name: &str) -> GaussHermitePsf {
    let path = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/data")
        .join(name);
    GaussHermitePsf::read(&path).expect("test PSF")
}

fn psf_a() -> GaussHermitePsf {
    read_psf("psf-r0-00067784.fits")
}

/// A few fibers over a short range: fast, and fully on the CCD.
fn small(seed: u64) -> SimulateOptions {
    let mut o = SimulateOptions::new(10..14, 6250.0, 6350.0);
    o.seed = seed;
    o.cosmic_density = 2000.0;
    o.bad_column = None;
    o
}

#[test]
fn same_seed_same_frame_whatever_the_threads() {
    let psf = psf_a();
    let opts = small(7);
    let run = |threads: usize| {
        rayon::ThreadPoolBuilder::new()
            .num_threads(threads)
            .build()
            .unwrap()
            .install(|| simulate(&psf, &opts).unwrap())
    };
    let a = run(1);
    let b = run(3);
    assert!(a.ncosmic > 0);
    assert_eq!(a.image, b.image);
    assert_eq!(a.ivar, b.ivar);
    assert_eq!(a.mask, b.mask);
    assert_eq!(a.flux, b.flux);
    assert_eq!(a.objtype, b.objtype);

    let c = simulate(&psf, &small(8)).unwrap();
    assert_ne!(a.flux, c.flux);
    let differ = a.image.iter().zip(&c.image).filter(|(x, y)| x != y).count();
    assert!(
        differ > a.rows.len() * a.cols.len() / 2,
        "only {differ} pixels differ"
    );
}

#[test]
fn a_fiber_spectrum_depends_on_the_seed_and_fiber_only() {
    let psf = psf_a();
    let a = simulate(&psf, &small(3)).unwrap();
    let mut o = small(3);
    o.fibers = 12..17;
    let b = simulate(&psf, &o).unwrap();
    for fiber in 12..14 {
        assert_eq!(a.truth(fiber).unwrap(), b.truth(fiber).unwrap());
        assert_eq!(a.objtype[fiber], b.objtype[fiber]);
    }
    assert!(a.truth(9).is_none() && a.truth(14).is_none());
}

#[test]
fn truth_is_realistic() {
    let psf = psf_a();
    let mut o = SimulateOptions::new(0..40, 6250.0, 6400.0);
    o.noise = false;
    o.cosmic_density = 0.0;
    let s = simulate(&psf, &o).unwrap();
    assert_eq!(s.flux.len(), 40 * s.wave.len());
    assert!(s.flux.iter().all(|v| v.is_finite() && *v >= 0.0));
    let nsky = s.objtype[0..40]
        .iter()
        .filter(|t| **t == ObjType::Sky)
        .count();
    assert!(nsky > 0 && nsky < 40, "{nsky} sky fibers");
    // [OI] 6300.30 A (air) is the brightest line of the range in every fiber.
    let line = air_to_vacuum(6300.30);
    let ibin = s.wave.iter().position(|w| (w - line).abs() <= 0.4).unwrap();
    for fiber in 0..40 {
        let t = s.truth(fiber).unwrap();
        let mut sorted = t.to_vec();
        sorted.sort_by(f64::total_cmp);
        let median = sorted[sorted.len() / 2];
        assert!(
            (10.0..1000.0).contains(&median),
            "fiber {fiber}: continuum {median}"
        );
        let peak = t[ibin.saturating_sub(1)..ibin + 2].iter().sum::<f64>();
        assert!(peak > 2000.0, "fiber {fiber}: [OI] {peak}");
        if s.objtype[fiber] == ObjType::Sky {
            // Sky fibers share one spectrum up to the fiber throughput.
            let t0 = s
                .truth(s.objtype.iter().position(|t| *t == ObjType::Sky).unwrap())
                .unwrap();
            let ratio = t[0] / t0[0];
            assert!(t.iter().zip(t0).all(|(a, b)| (a / b - ratio).abs() < 1e-9));
        }
    }
}

/// Spots are unit-normalised, so the noiseless image holds all of the truth except what
/// falls off the CCD, which is computed here from the spots themselves.
fn check_total(psf: &GaussHermitePsf, mut o: SimulateOptions) -> f64 {
    o.noise = false;
    o.cosmic_density = 0.0;
    let s = simulate(psf, &o).unwrap();
    let spots = psf.spots(o.fibers.clone(), &s.wave);
    let c = &spots.corners;
    let mut expected = 0.0;
    let mut lost = 0.0;
    for f in 0..o.fibers.len() {
        for w in 0..s.wave.len() {
            let (xc, yc) = c.corner(f, w);
            let t = s.flux[f * s.wave.len() + w];
            for iy in 0..c.ny {
                for ix in 0..c.nx {
                    let (x, y) = (xc as i64 + ix as i64, yc as i64 + iy as i64);
                    let v = t * spots.spot(f, w)[iy * c.nx + ix];
                    if x >= 0 && y >= 0 && (x as usize) < s.ncols && (y as usize) < s.nrows {
                        expected += v;
                    } else {
                        lost += v;
                    }
                }
            }
        }
    }
    let total: f64 = s.image.iter().map(|&v| v as f64).sum();
    let truth: f64 = s.flux.iter().sum();
    assert!(
        (expected + lost - truth).abs() < 1e-9 * truth,
        "spots are not unit-normalised"
    );
    assert!(
        (total - expected).abs() < 1e-6 * expected,
        "image {total} vs truth on the CCD {expected}"
    );
    lost / truth
}

#[test]
fn noiseless_image_holds_the_truth() {
    let psf = psf_a();
    let lost = check_total(&psf, SimulateOptions::new(100..104, 6000.0, 6200.0));
    assert_eq!(lost, 0.0);
    // The first fibers at the blue end of the domain run off the CCD.
    let (lo, _) = psf.wave_domain();
    let lost = check_total(&psf, SimulateOptions::new(0..3, lo, lo + 60.0));
    assert!(lost > 0.0 && lost < 1.0, "lost fraction {lost}");
    let other = read_psf("psf-r0-00051060.fits");
    check_total(&other, SimulateOptions::new(250..253, 7400.0, 7500.0));
}

#[test]
fn ivar_follows_the_model_and_the_region_is_masked_outside() {
    let psf = psf_a();
    let mut o = small(1);
    o.noise = false;
    o.cosmic_density = 0.0;
    let s = simulate(&psf, &o).unwrap();
    let rn2 = o.read_noise * o.read_noise;
    for row in 0..s.nrows {
        for col in 0..s.ncols {
            let i = [row, col];
            if s.rows.contains(&row) && s.cols.contains(&col) {
                assert_eq!(s.mask[i], 0);
                let expected = 1.0 / (s.image[i] as f64 + rn2);
                assert!((s.ivar[i] as f64 - expected).abs() < 1e-6 * expected);
            } else {
                assert_eq!((s.image[i], s.ivar[i], s.mask[i]), (0.0, 0.0, MASK_BAD));
            }
        }
    }
    // The margin holds only read noise: the spots are inside the box.
    let row = s.rows.start;
    assert!(s
        .image
        .slice(s![row, s.cols.clone()])
        .iter()
        .all(|&v| v == 0.0));
}

#[test]
fn cosmics_and_bad_column_are_masked_where_they_are() {
    let psf = psf_a();
    let mut clean = small(5);
    clean.cosmic_density = 0.0;
    let a = simulate(&psf, &clean).unwrap();
    let mut dirty = small(5);
    dirty.bad_column = Some(a.cols.start + 7);
    let b = simulate(&psf, &dirty).unwrap();
    assert!(b.ncosmic > 0);
    let column = a.cols.start + 7;
    let mut ncosmic_pixels = 0;
    for (i, _) in a.image.indexed_iter() {
        let (row, col) = i;
        let inside = a.rows.contains(&row) && a.cols.contains(&col);
        if col == column {
            assert_eq!(b.mask[i] & MASK_BAD, MASK_BAD);
            assert_eq!(b.ivar[i], 0.0);
        }
        if b.mask[i] & MASK_COSMIC != 0 {
            assert!(inside);
            assert_eq!(b.ivar[i], 0.0);
            assert!(b.image[i] - a.image[i] >= 149.0);
            ncosmic_pixels += 1;
        } else if col != column {
            assert_eq!(
                (a.image[i], a.ivar[i], a.mask[i]),
                (b.image[i], b.ivar[i], b.mask[i])
            );
        }
    }
    assert!(
        ncosmic_pixels >= 2 * b.ncosmic,
        "{ncosmic_pixels} pixels for {} tracks",
        b.ncosmic
    );
}

#[test]
fn a_flat_lights_every_fiber_with_the_lamp_times_the_science_throughput() {
    let psf = psf_a();
    let mut science = small(4);
    science.objects = false;
    science.sky_fraction = 0.0;
    science.cosmic_density = 0.0;
    let mut flat = science.clone();
    flat.flat = true;
    flat.dead_fibers = vec![12];
    let (s, f) = (
        simulate(&psf, &science).unwrap(),
        simulate(&psf, &flat).unwrap(),
    );
    let lamp = |fiber: usize, w: usize| f.truth(fiber).unwrap()[w];
    // every lit fiber is the same lamp up to its throughput
    for fiber in [10, 11, 13] {
        let ratio = lamp(fiber, 0) / lamp(10, 0);
        for w in 0..f.wave.len() {
            assert!((lamp(fiber, w) / lamp(10, w) - ratio).abs() < 1e-12 * ratio);
        }
        // ... which the science exposure of the same seed shares: its fibers carry the
        // same sky times their throughput
        let sky = |fiber: usize| s.truth(fiber).unwrap()[0];
        assert!((sky(fiber) / sky(10) - ratio).abs() < 1e-12 * ratio);
    }
    assert!(f.truth(12).unwrap().iter().all(|&t| t == 0.0));
    assert!(f.objtype.iter().all(|&t| t == ObjType::Target));
    let dir = tempfile::tempdir().unwrap();
    let (image, truth) = (dir.path().join("flat.fits"), dir.path().join("t.fits"));
    f.write(&image, &truth).unwrap();
    let mut fits = Fits::open(&image).unwrap();
    fits.move_to("IMAGE").unwrap();
    assert_eq!(fits.key_str("FLAVOR").unwrap().as_deref(), Some("flat"));
    assert_eq!(fits.key_str("OBSTYPE").unwrap().as_deref(), Some("FLAT"));
    assert_eq!(fits.key_str("SIMDEAD").unwrap().as_deref(), Some("12"));
}

#[test]
fn masked_amplifiers_are_masked_and_the_others_untouched() {
    let psf = psf_a();
    let clean = small(6);
    let mut masked = clean.clone();
    masked.masked_amps = vec!['B', 'C'];
    let (a, b) = (
        simulate(&psf, &clean).unwrap(),
        simulate(&psf, &masked).unwrap(),
    );
    let (hy, hx) = (psf.npix_y / 2, psf.npix_x / 2);
    for ((row, col), &m) in b.mask.indexed_iter() {
        let i = [row, col];
        if (row < hy) != (col < hx) {
            assert_eq!((m & MASK_BAD, b.ivar[i]), (MASK_BAD, 0.0), "{i:?}");
        } else {
            assert_eq!((m, b.ivar[i]), (a.mask[i], a.ivar[i]), "{i:?}");
        }
    }
}

#[test]
fn written_files_read_back() {
    let psf = psf_a();
    let mut o = small(11);
    o.bad_column = Some(2000);
    let s = simulate(&psf, &o).unwrap();
    let dir = tempfile::tempdir().unwrap();
    let image_path = dir.path().join("preproc.fits");
    let truth_path = dir.path().join("truth.fits");
    s.write(&image_path, &truth_path).unwrap();
    let names: Vec<_> = std::fs::read_dir(dir.path())
        .unwrap()
        .map(|e| e.unwrap().file_name())
        .collect();
    assert_eq!(names.len(), 2, "{names:?}");

    let mut f = Fits::open(&image_path).unwrap();
    for (name, _) in [("IMAGE", 0), ("IVAR", 1), ("MASK", 2)] {
        f.move_to(name).unwrap();
        assert_eq!(f.image_shape().unwrap(), vec![psf.npix_y, psf.npix_x]);
    }
    f.move_to("IMAGE").unwrap();
    assert_eq!(f.key_str("CAMERA").unwrap().as_deref(), Some("r0"));
    assert_eq!(f.key_i64("SIMSEED").unwrap(), Some(11));
    // what desispec's read_image, Frame.vet() and the barycentric correction read
    assert_eq!(f.key_str("FLAVOR").unwrap().as_deref(), Some("science"));
    assert_eq!(f.key_str("OBSTYPE").unwrap().as_deref(), Some("SCIENCE"));
    for key in ["NIGHT", "EXPID", "TILEID"] {
        assert!(f.key_i64(key).unwrap().is_some(), "{key}");
    }
    for key in [
        "MJD-OBS", "EXPTIME", "TARGTRA", "TARGTDEC", "SKYRA", "TELDEC",
    ] {
        assert!(f.key_f64(key).unwrap().is_some(), "{key}");
    }
    for amp in ["A", "B", "C", "D"] {
        assert_eq!(f.key_f64(&format!("OBSRDN{amp}")).unwrap(), Some(3.0));
        let ccdsec = f.key_str(&format!("CCDSEC{amp}")).unwrap();
        assert!(ccdsec.is_some());
        assert_eq!(f.key_str(&format!("DATASEC{amp}")).unwrap(), ccdsec);
        // desispec finds the amplifiers by their BIASSEC keywords
        assert!(f.key_str(&format!("BIASSEC{amp}")).unwrap().is_some());
    }
    assert_eq!(
        f.key_str("BIASSECB").unwrap().as_deref(),
        Some(
            format!(
                "[{}:{},1:{}]",
                psf.npix_x + 101,
                psf.npix_x + 200,
                psf.npix_y / 2
            )
            .as_str()
        )
    );
    assert_eq!(
        f.key_str("CCDSECD").unwrap().as_deref(),
        Some(
            format!(
                "[{}:{},{}:{}]",
                psf.npix_x / 2 + 1,
                psf.npix_x,
                psf.npix_y / 2 + 1,
                psf.npix_y
            )
            .as_str()
        )
    );
    assert_eq!(
        f.key_str("SIMPSF").unwrap().as_deref(),
        Some("psf-r0-00067784.fits")
    );
    let (_, image) = f.read_image::<f32>().unwrap();
    assert_eq!(image, s.image.as_slice().unwrap());
    f.move_to("MASK").unwrap();
    assert_eq!(f.read_image::<i32>().unwrap().1, s.mask.as_slice().unwrap());
    f.move_to("READNOISE").unwrap();
    let (shape, readnoise) = f.read_image::<f32>().unwrap();
    assert_eq!(shape, vec![psf.npix_y, psf.npix_x]);
    assert!(readnoise.iter().all(|&r| r == 3.0));
    assert!(f.verify_checksums().unwrap().iter().all(|&c| c == (1, 1)));
    f.move_to("FIBERMAP").unwrap();
    assert_eq!(f.nrows().unwrap(), psf.nfiber);
    let (_, fiber) = f.column::<i32>("FIBER").unwrap();
    assert_eq!(fiber, (0..psf.nfiber as i32).collect::<Vec<_>>());
    let (_, targetid) = f.column::<i64>("TARGETID").unwrap();
    let mut unique = targetid.clone();
    unique.sort_unstable();
    unique.dedup();
    assert_eq!(unique.len(), psf.nfiber, "TARGETIDs are unique");
    // every column of desispec's empty_fibermap, in its order
    let cards = f.cards().unwrap();
    let ttypes: Vec<String> = cards
        .iter()
        .filter(|c| c.starts_with("TTYPE"))
        .map(|c| c.split('\'').nth(1).unwrap().trim().to_string())
        .collect();
    let expected: Vec<&str> = FIBERMAP_COLUMNS.iter().map(|c| c.0).collect();
    assert_eq!(ttypes, expected);
    let (_, ra) = f.column::<f64>("TARGET_RA").unwrap();
    assert!(ra.iter().all(|r| (r - 100.0).abs() < 2.0));
    let objtype = f.column_str("OBJTYPE").unwrap();
    let expected: Vec<&str> = s.objtype.iter().map(|t| t.as_str()).collect();
    assert_eq!(objtype, expected);

    let mut t = Fits::open(&truth_path).unwrap();
    t.move_to_primary().unwrap();
    assert_eq!(t.key_i64("FIBERMIN").unwrap(), Some(10));
    t.move_to("WAVELENGTH").unwrap();
    assert_eq!(
        t.read_image::<f64>().unwrap(),
        (vec![s.wave.len()], s.wave.clone())
    );
    t.move_to("FLUX").unwrap();
    assert_eq!(t.key_i64("FIBERMIN").unwrap(), Some(10));
    assert_eq!(
        t.read_image::<f64>().unwrap(),
        (vec![4, s.wave.len()], s.flux.clone())
    );

    // The extraction's reader accepts it and masks what the simulation masked.
    let img = Image::read(&image_path, MaskRule::AnyBit).unwrap();
    assert_eq!((img.nrows, img.ncols), (psf.npix_y, psf.npix_x));
    let nmasked = s.mask.iter().filter(|&&m| m != 0).count();
    assert_eq!(img.nmasked, nmasked);
    assert!(img.has_fibermap);
}

#[test]
fn failed_write_leaves_nothing() {
    let psf = psf_a();
    let mut o = small(2);
    o.fibers = 0..1;
    o.wmax = 6260.0;
    let s = simulate(&psf, &o).unwrap();
    let dir = tempfile::tempdir().unwrap();
    let image_path = dir.path().join("preproc.fits");
    let truth_path = dir.path().join("missing").join("truth.fits");
    assert!(s.write(&image_path, &truth_path).is_err());
    assert_eq!(std::fs::read_dir(dir.path()).unwrap().count(), 0);
    assert!(matches!(
        s.write(&image_path, &image_path),
        Err(Error::Config(_))
    ));
}

type Change = Box<dyn Fn(&mut SimulateOptions)>;

#[test]
fn invalid_options_are_rejected() {
    let psf = psf_a();
    let (lo, hi) = psf.wave_domain();
    let base = SimulateOptions::new(0..5, 6000.0, 6100.0);
    let cases: Vec<(&str, Change)> = vec![
        ("below the domain", Box::new(move |o| o.wmin = lo - 10.0)),
        ("above the domain", Box::new(move |o| o.wmax = hi + 10.0)),
        (
            "reversed range",
            Box::new(|o| (o.wmin, o.wmax) = (6100.0, 6000.0)),
        ),
        ("NaN", Box::new(|o| o.wmin = f64::NAN)),
        ("zero step", Box::new(|o| o.dw = 0.0)),
        ("negative step", Box::new(|o| o.dw = -0.8)),
        ("fibers beyond the PSF", Box::new(|o| o.fibers = 498..501)),
        ("no fibers", Box::new(|o| o.fibers = 3..3)),
        ("negative read noise", Box::new(|o| o.read_noise = -1.0)),
        (
            "negative cosmic density",
            Box::new(|o| o.cosmic_density = -1.0),
        ),
        ("sky fraction", Box::new(|o| o.sky_fraction = 1.5)),
        ("bad column", Box::new(|o| o.bad_column = Some(5000))),
        ("nothing", Box::new(|o| (o.sky, o.objects) = (false, false))),
    ];
    for (what, change) in cases {
        let mut o = base.clone();
        change(&mut o);
        match simulate(&psf, &o) {
            Err(Error::Config(message)) => assert!(!message.is_empty()),
            other => panic!(
                "{what}: expected a configuration error, got {:?}",
                other.map(|s| s.fibers)
            ),
        }
    }
    // The whole domain is fine.
    let mut o = SimulateOptions::new(0..1, lo, hi);
    o.dw = 20.0;
    assert!(simulate(&psf, &o).is_ok());
}
