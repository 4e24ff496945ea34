//! Runs that could destroy a file the user had: an output naming the `--list` file, and a set
//! of outputs (frame and model, image and truth) whose second file cannot be put in place.

use super::*;

/// The lines of a `--list` file in the case's directory, written as given.
fn list_file(c: &Case, name: &str, lines: &[String]) -> PathBuf {
    let path = c.path(name);
    std::fs::write(&path, lines.join("\n") + "\n").expect("write list");
    path
}

#[test]
fn list_file_named_as_an_output_is_refused() {
    // The list itself, by its own name and through another spelling of its path, as the
    // output of its first or of a later line.
    for (output, line) in [("frames.txt", 0), ("./frames.txt", 1)] {
        let mut c = Case::new();
        let (input, psf) = (c.copy(IMAGE, "in.fits"), c.copy(PSF, "psf.fits"));
        let frame = |out: &str| {
            format!(
                "{} {} {}",
                input.display(),
                psf.display(),
                c.path(out).display()
            )
        };
        let mut lines = vec![frame("a.fits")];
        lines.insert(line, frame(output));
        let list = list_file(&c, "frames.txt", &lines);
        c.seal();
        let mut a = args!["--list", &list];
        a.extend(options());
        let o = spex(a);
        expect(&o, 1, &["frames.txt", "replace the input"]);
        c.unchanged_except(&[]);
    }
}

/// An old frame, then a run whose frame is fine but whose second output (`second`) cannot be
/// renamed into place: exit 1 naming it, and the old frame as it was.
fn old_frame_survives(second: &str, needles: &[&str]) {
    let mut c = Case::new();
    let (input, psf) = (c.copy(IMAGE, "in.fits"), c.copy(PSF, "psf.fits"));
    std::fs::write(c.path("out.fits"), b"OLD").expect("write old frame");
    c.seal();
    let second = c.dir.path().join(second);
    let o = extract(&input, &psf, &c.path("out.fits"), args!["-m", &second]);
    expect(&o, 1, needles);
    c.unchanged_except(&[]);
}

#[test]
fn model_name_with_a_trailing_slash_keeps_the_old_frame() {
    old_frame_survives("model.fits/", &["model.fits/", "not a file name"]);
}

#[test]
fn model_name_too_long_keeps_the_old_frame() {
    let name = format!("{}.fits", "m".repeat(256));
    old_frame_survives(&name, &["File name too long"]);
}

#[test]
fn simulate_truth_with_a_trailing_slash_keeps_the_old_image() {
    let mut c = Case::new();
    let psf = c.copy(PSF, "psf.fits");
    std::fs::write(c.path("img.fits"), b"OLD").expect("write old image");
    c.seal();
    let truth = format!("{}/", c.path("truth.fits").display());
    let o = spex(args![
        "simulate",
        "-p",
        &psf,
        "-o",
        c.path("img.fits"),
        "--truth",
        &truth,
        "-w",
        "6000,6040,0.8",
        "-n",
        "5"
    ]);
    expect(&o, 1, &["truth.fits/", "not a file name"]);
    c.unchanged_except(&[]);
}
