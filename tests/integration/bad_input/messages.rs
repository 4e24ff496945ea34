//! What the user reads: messages that name the user's file (never a temporary) and say each
//! cause once; inputs refused with a message instead of a hang or a misleading one; option
//! bounds checked before anything is read; outputs named in any case written as asked.

use super::*;

fn occurrences(text: &str, needle: &str) -> usize {
    text.matches(needle).count()
}

#[test]
fn read_only_directory_names_the_output_without_a_temporary() {
    let disk = Tmpfs::mount(64, true);
    let mut c = Case::new();
    let (input, psf) = (c.copy(IMAGE, "in.fits"), c.copy(PSF, "psf.fits"));
    c.seal();
    for extra in [args![], args!["-m", disk.path("model.fits")]] {
        let o = extract(&input, &psf, &disk.path("frame.fits"), extra);
        expect(&o, 1, &["frame.fits", "Read-only file system"]);
        for temporary in [".frame.", "at path"] {
            assert!(
                !o.stderr.contains(temporary),
                "{temporary} in: {}",
                o.stderr
            );
        }
    }
    c.unchanged_except(&[]);
}

#[test]
fn simulate_errors_say_their_cause_once() {
    let mut c = Case::new();
    let psf = c.copy(PSF, "psf.fits");
    c.seal();
    for (output, cause) in [
        (c.path("missing/img.fits"), "does not exist"),
        (c.path("psf.fits/img.fits"), "does not exist"),
    ] {
        let o = spex(args![
            "simulate",
            "-p",
            &psf,
            "-o",
            &output,
            "--truth",
            c.path("t.fits"),
            "-w",
            "6000,6040,0.8",
            "-n",
            "5"
        ]);
        expect(&o, 1, &["img.fits", cause]);
        assert_eq!(occurrences(&o.stderr, cause), 1, "{}", o.stderr);
    }
    c.unchanged_except(&[]);
}

#[test]
fn simulate_bounds_are_usage_errors_before_the_psf_is_read() {
    let mut c = Case::new();
    c.seal();
    // The PSF does not exist: a bound refused first proves nothing was read.
    for (option, value, needle) in [
        ("--cosmic-density", "1e6", "--cosmic-density"),
        ("--read-noise", "1e39", "--read-noise"),
        ("--read-noise", "nan", "--read-noise"),
        ("-w", "6000,7000,1e-9", "wavelength bins"),
    ] {
        let mut a = args![
            "simulate",
            "-p",
            c.path("absent.fits"),
            "-o",
            c.path("img.fits"),
            "--truth",
            c.path("t.fits"),
            option,
            value
        ];
        if option != "-w" {
            a.extend(args!["-w", "6000,6040,0.8"]);
        }
        let o = spex(a);
        expect(&o, 2, &[needle]);
    }
    c.unchanged_except(&[]);
}

#[test]
fn gz_output_names_in_any_case_are_compressed() {
    for name in ["out.FITS.GZ", ".gz", "out.fits.Gz"] {
        let mut c = Case::new();
        let (input, psf) = (c.copy(IMAGE, "in.fits"), c.copy(PSF, "psf.fits"));
        c.seal();
        let o = extract(&input, &psf, &c.path(name), vec![]);
        expect(&o, 0, &[]);
        c.unchanged_except(&[name]);
        let bytes = std::fs::read(c.path(name)).unwrap();
        assert_eq!(bytes[..2], [0x1f, 0x8b], "{name} is not gzip-compressed");
        assert!(Frame::read(&c.path(name)).is_ok());
    }
}

#[test]
fn damaged_gzip_inputs_say_so() {
    let mut c = Case::new();
    let psf = c.copy(PSF, "psf.fits");
    // A gzip header alone, and a stream whose deflate data are garbage.
    let header = [0x1f, 0x8b, 8, 0, 0, 0, 0, 0, 0, 3];
    std::fs::write(c.path("ten.fits.gz"), header).unwrap();
    let mut garbage = header.to_vec();
    garbage.extend((0..5000u32).map(|i| (i * 7919 % 251) as u8));
    std::fs::write(c.path("bad.fits.gz"), garbage).unwrap();
    c.seal();
    for name in ["ten.fits.gz", "bad.fits.gz"] {
        let o = extract(&c.path(name), &psf, &c.path("f.fits"), vec![]);
        expect(&o, 1, &[name, "damaged gzip stream"]);
    }
    c.unchanged_except(&[]);
}

#[test]
fn fifo_input_is_refused_without_waiting() {
    let mut c = Case::new();
    let psf = c.copy(PSF, "psf.fits");
    let fifo = c.path("in.fits");
    let made = Command::new("mkfifo").arg(&fifo).status().expect("mkfifo");
    assert!(made.success());
    let list = c.path("frames.txt");
    std::fs::write(
        &list,
        format!(
            "{} {} {}\n",
            fifo.display(),
            psf.display(),
            c.path("g.fits").display()
        ),
    )
    .unwrap();
    c.seal();
    let t0 = Instant::now();
    let o = extract(&fifo, &psf, &c.path("f.fits"), vec![]);
    expect(&o, 1, &["in.fits", "not a regular file"]);
    let mut a = args!["--list", &list];
    a.extend(options());
    let o = spex(a);
    expect(&o, 1, &["in.fits", "not a regular file"]);
    assert!(t0.elapsed() < Duration::from_secs(60), "waited on the FIFO");
    c.unchanged_except(&[]);
}

#[test]
fn blank_card_of_the_input_is_not_copied_into_the_frame() {
    let mut c = Case::new();
    let (input, psf) = (c.path("in.fits"), c.copy(PSF, "psf.fits"));
    write_image(&input, false, |_, _| 10.0, unit);
    {
        let mut f = fitsio::FitsFile::edit(&input).unwrap();
        let h = f.hdu("IMAGE").unwrap();
        h.write_key(&mut f, "BLANK", -32768i64).unwrap();
    }
    c.seal();
    let o = extract(&input, &psf, &c.path("f.fits"), vec![]);
    expect(&o, 0, &[]);
    let mut frame = spex::fits::Fits::open(&c.path("f.fits")).unwrap();
    frame.move_to("FLUX").unwrap();
    let cards = frame.cards().unwrap();
    assert!(
        !cards.iter().any(|card| card.starts_with("BLANK ")),
        "{cards:?}"
    );
}

#[test]
fn declination_outside_the_sphere_refuses_the_barycentric_correction() {
    let hdus = ["IMAGE", "FIBERMAP"];
    refused_pointing(135.0, 60100.0, &hdus, &["in.fits", "declination 135"]);
}
