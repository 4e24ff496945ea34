//! Output files: every file spex writes goes through here, so that bad input or an
//! interrupted run never leaves a partial file or destroys one that was there.
//!
//! - A file is written under a temporary name next to its target (same directory, so the
//!   final rename is atomic; same suffix, so that cfitsio compresses a `.gz` name) and
//!   renamed into place only once complete. Files written together (a frame and its model
//!   image, a simulated image and its truth) are renamed only once all of them are complete.
//! - Errors name the user's file, never the temporary one, and keep the operating system's
//!   cause ("No space left on device").
//! - An existing target that is not a regular file (a directory, a device such as
//!   /dev/null) is refused: renaming over it would replace it.
//! - Files written together are committed together: every target is checked again just
//!   before the first rename, and an existing target is kept (as a hidden hard link) until
//!   every rename succeeded, so that a failed rename puts the old files back.
//! - The temporaries alive in the process are registered; on SIGTERM, SIGINT, SIGHUP,
//!   SIGQUIT or SIGUSR1 a thread removes them and the process exits with status 128 + the
//!   signal. SIGXFSZ is ignored, so that a file-size limit fails the write with "File too
//!   large" instead of killing the process and leaving its temporaries.
//! - [`check_paths`] refuses, before any work, outputs that would replace an input or each
//!   other (same canonical path, or the same file through another name or a hard link).

use std::collections::BTreeMap;
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Mutex, MutexGuard, Once, PoisonError};

use crate::error::{Error, Result};

/// The temporaries of this process that are not yet renamed into place, by id.
static LIVE: Mutex<BTreeMap<u64, PathBuf>> = Mutex::new(BTreeMap::new());
static NEXT_ID: AtomicU64 = AtomicU64::new(0);

fn live() -> MutexGuard<'static, BTreeMap<u64, PathBuf>> {
    LIVE.lock().unwrap_or_else(PoisonError::into_inner)
}

/// Set by a host process that handles SIGINT and SIGTERM itself (Python: KeyboardInterrupt).
static HOST_HANDLES_SIGNALS: std::sync::atomic::AtomicBool =
    std::sync::atomic::AtomicBool::new(false);

/// Leaves SIGINT and SIGTERM to the host process: spex then never exits the process on them.
pub fn leave_signals_to_host() {
    HOST_HANDLES_SIGNALS.store(true, Ordering::Relaxed);
}

/// The signals whose default action would end the process while it writes: they end it
/// too, but after its temporaries are removed.
const ENDING_SIGNALS: [i32; 5] = [
    signal_hook::consts::SIGTERM,
    signal_hook::consts::SIGINT,
    signal_hook::consts::SIGHUP,
    signal_hook::consts::SIGQUIT,
    signal_hook::consts::SIGUSR1,
];

/// Starts, once per process, the thread that removes the live temporaries on one of the
/// [`ENDING_SIGNALS`] and then exits with 128 + the signal's number; and ignores SIGXFSZ,
/// whose default action would kill the process at a file-size limit with its temporaries
/// left behind (ignored, the write fails with EFBIG and the usual clean-up runs).
fn clean_up_on_signals() {
    if HOST_HANDLES_SIGNALS.load(Ordering::Relaxed) {
        return;
    }
    static INSTALLED: Once = Once::new();
    INSTALLED.call_once(|| {
        // SAFETY: sets the disposition of SIGXFSZ to "ignore", which installs no handler.
        unsafe { libc::signal(libc::SIGXFSZ, libc::SIG_IGN) };
        let mut signals = match signal_hook::iterator::Signals::new(ENDING_SIGNALS) {
            Ok(s) => s,
            Err(e) => {
                tracing::warn!("cannot watch for SIGTERM and SIGINT ({e}): an interrupted run may leave temporary files");
                return;
            }
        };
        let spawned = std::thread::Builder::new()
            .name("signal cleanup".into())
            .spawn(move || {
                if let Some(signal) = signals.forever().next() {
                    // Held until the process is gone: no rename or new temporary after this.
                    let live = live();
                    let _open = remove_quickly(live.values());
                    let name = signal_name(signal);
                    // Not eprintln!, which panics when stderr is gone (a launcher that
                    // ended first).
                    let line = format!(
                        "spex: error: stopped by {name}: {} unfinished output file(s) removed\n",
                        live.len()
                    );
                    let _ = std::io::Write::write_all(&mut std::io::stderr(), line.as_bytes());
                    std::process::exit(128 + signal);
                }
            });
        if let Err(e) = spawned {
            tracing::warn!("cannot start the signal cleanup thread: {e}");
        }
    });
}

/// Removes the names of `paths` in as little time as possible. A launcher kills a rank that
/// is still alive a second after its SIGTERM (Open MPI), and unlinking a file of hundreds of
/// megabytes frees its blocks first, which takes long on a busy machine: each file is opened
/// before the names go, so that each unlink only removes a name, and the files returned are
/// kept open until the process ends: the kernel frees their blocks then, however it ends.
fn remove_quickly<'a>(paths: impl Iterator<Item = &'a PathBuf> + Clone) -> Vec<std::fs::File> {
    let open: Vec<std::fs::File> = paths
        .clone()
        .filter_map(|p| std::fs::File::open(p).ok())
        .collect();
    for path in paths {
        let _ = std::fs::remove_file(path);
    }
    open
}

/// The name of one of the [`ENDING_SIGNALS`], for the line that says what stopped the run.
fn signal_name(signal: i32) -> &'static str {
    match signal {
        signal_hook::consts::SIGTERM => "SIGTERM",
        signal_hook::consts::SIGINT => "SIGINT",
        signal_hook::consts::SIGHUP => "SIGHUP",
        signal_hook::consts::SIGQUIT => "SIGQUIT",
        _ => "SIGUSR1",
    }
}

/// Runs `create`, which makes a file anew at the path of a temporary (cfitsio creating a
/// FITS file, a compressed file replacing the plain one), under the lock of the live
/// temporaries. The signal cleanup holds that lock from the moment it removes them until the
/// process is gone, so a file cannot be created again after it was removed.
pub fn creating<T>(create: impl FnOnce() -> T) -> T {
    let _live = live();
    create()
}

/// The error for `target` with an operating-system cause. The cause is reduced to the
/// system's own text: the errors of `tempfile` append "at path" and the temporary's name,
/// which the user never asked for.
fn io_error(target: &Path, source: std::io::Error) -> Error {
    // tempfile's errors read "<the system's error> at path <temporary>" and keep no code
    let text = source.to_string();
    let source = match text.split_once(" at path ") {
        Some((cause, _)) if source.raw_os_error().is_none() => {
            std::io::Error::new(source.kind(), cause.to_string())
        }
        _ => source,
    };
    Error::Io {
        path: target.into(),
        source,
    }
}

/// The longest file name Linux file systems take (NAME_MAX), in bytes.
const NAME_MAX: usize = 255;

/// The directory a target lives in (`.` for a bare file name).
fn directory_of(target: &Path) -> &Path {
    match target.parent() {
        Some(d) if !d.as_os_str().is_empty() => d,
        _ => Path::new("."),
    }
}

/// Checks that `target` can be written by renaming a file onto it: its directory exists and
/// it is absent or a regular file (a symbolic link is followed).
pub fn check_target(target: &Path) -> Result<()> {
    use std::os::unix::ffi::OsStrExt;
    // `Path` forgets a trailing slash (`model.fits/` has the file name `model.fits`), but a
    // rename onto it fails: such a name is refused before any work.
    let trailing_slash = target.as_os_str().as_bytes().ends_with(b"/");
    let Some(name) = target.file_name().filter(|_| !trailing_slash) else {
        return Err(io_error(
            target,
            std::io::Error::new(std::io::ErrorKind::InvalidInput, "not a file name"),
        ));
    };
    if name.len() > NAME_MAX {
        return Err(io_error(
            target,
            std::io::Error::from_raw_os_error(libc::ENAMETOOLONG),
        ));
    }
    let dir = directory_of(target);
    if !dir.is_dir() {
        return Err(io_error(
            target,
            std::io::Error::new(
                std::io::ErrorKind::NotFound,
                "output directory does not exist",
            ),
        ));
    }
    match std::fs::metadata(target) {
        Ok(m) if !m.is_file() => Err(io_error(
            target,
            std::io::Error::new(
                std::io::ErrorKind::InvalidInput,
                "exists and is not a regular file; refusing to replace it",
            ),
        )),
        _ => Ok(()),
    }
}

/// `(prefix, suffix)` of the temporary name of `target`: a hidden name made of the target's
/// own (with characters that cfitsio's filename syntax would read replaced) and its suffix,
/// e.g. `.frame-r0.` + random + `.fits.gz`.
fn temporary_affixes(target: &Path) -> (String, String) {
    let name = target
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_default();
    let name = name.trim_start_matches('.');
    let (base, suffix) = match name.find('.') {
        Some(i) => name.split_at(i),
        None => (name, ""),
    };
    let clean = |s: &str, keep: &[char]| -> String {
        s.chars()
            .map(|c| {
                if c.is_ascii_alphanumeric() || keep.contains(&c) {
                    c
                } else {
                    '_'
                }
            })
            .collect()
    };
    let base: String = clean(base, &['-', '_']).chars().take(48).collect();
    let mut suffix = clean(suffix, &['-', '_', '.']);
    // The temporary of a name ending in `.gz` (any case, `.gz` alone included) must end so
    // too: that is what makes its FITS file compressed.
    let gzip = is_gzip_name(target);
    if suffix.len() > 24 || (gzip && !is_gzip_name(Path::new(&suffix))) {
        suffix = if gzip { ".gz" } else { "" }.into();
    }
    (format!(".{base}."), suffix)
}

/// Whether a file of this name is written gzip-compressed: its name ends in `.gz`, in any
/// case (`out.FITS.GZ` as well as `out.fits.gz`).
pub fn is_gzip_name(path: &Path) -> bool {
    use std::os::unix::ffi::OsStrExt;
    let bytes = path.as_os_str().as_bytes();
    bytes.len() >= 3 && bytes[bytes.len() - 3..].eq_ignore_ascii_case(b".gz")
}

/// A file being written: a temporary next to its target, removed unless committed.
pub struct Staged {
    target: PathBuf,
    temp: Option<tempfile::TempPath>,
    id: u64,
}

impl Staged {
    /// Creates the temporary file of `target` (after [`check_target`]).
    pub fn new(target: &Path) -> Result<Self> {
        check_target(target)?;
        clean_up_on_signals();
        let (prefix, suffix) = temporary_affixes(target);
        let id = NEXT_ID.fetch_add(1, Ordering::Relaxed);
        // Registered under the lock, so that a signal never misses a temporary.
        let mut live = live();
        let temp = tempfile::Builder::new()
            .prefix(&prefix)
            .suffix(&suffix)
            .rand_bytes(6)
            .tempfile_in(directory_of(target))
            .map_err(|e| io_error(target, e))?
            .into_temp_path();
        live.insert(id, temp.to_path_buf());
        Ok(Staged {
            target: target.into(),
            temp: Some(temp),
            id,
        })
    }

    /// Where to write.
    pub fn path(&self) -> &Path {
        self.temp.as_deref().unwrap_or(&self.target)
    }

    /// The file the user asked for.
    pub fn target(&self) -> &Path {
        &self.target
    }

    /// An error of writing the temporary file, restated about the target.
    pub fn about_target(&self, error: Error) -> Error {
        let temp = self.path().to_path_buf();
        let rename = |p: PathBuf| if p == temp { self.target.clone() } else { p };
        match error {
            Error::Fits {
                path,
                what,
                message,
            } => Error::Fits {
                path: rename(path),
                what,
                message,
            },
            Error::Io { path, source } => Error::Io {
                path: rename(path),
                source,
            },
            Error::NonFiniteFrame {
                path,
                count,
                fiber,
                bin,
            } => Error::NonFiniteFrame {
                path: rename(path),
                count,
                fiber,
                bin,
            },
            other => other,
        }
    }

    /// Renames the complete file into place.
    pub fn commit(self) -> Result<()> {
        commit_all(vec![self])
    }

    /// Renames the temporary onto the target; the caller holds the lock of the live
    /// temporaries.
    fn persist(&mut self, live: &mut BTreeMap<u64, PathBuf>) -> Result<()> {
        let Some(temp) = self.temp.take() else {
            return Ok(());
        };
        live.remove(&self.id);
        temp.persist(&self.target).map_err(|e| {
            // The temporary goes with the error.
            drop(e.path);
            io_error(&self.target, e.error)
        })
    }
}

/// An existing target kept under a hidden name (a hard link: the target itself stays in
/// place) while the files of a set are renamed, so that a failed rename can put it back.
struct Backup {
    target: PathBuf,
    kept: Option<tempfile::TempPath>,
}

impl Backup {
    /// Keeps `target` if it exists. A file system without hard links keeps nothing: the
    /// checks before the first rename are then the only protection.
    fn of(target: &Path) -> Backup {
        let kept = target.is_file().then(|| {
            let (prefix, _) = temporary_affixes(target);
            tempfile::Builder::new()
                .prefix(&prefix)
                .suffix(".keep")
                .rand_bytes(6)
                .make_in(directory_of(target), |p| std::fs::hard_link(target, p))
                .ok()
                .map(tempfile::NamedTempFile::into_temp_path)
        });
        Backup {
            target: target.into(),
            kept: kept.flatten(),
        }
    }

    /// Puts the old file back over a new one (or removes the new one if there was none).
    fn restore(&mut self) {
        match self.kept.take() {
            Some(kept) => {
                let _ = kept.persist(&self.target);
            }
            None => {
                let _ = std::fs::remove_file(&self.target);
            }
        }
    }
}

/// Renames every staged file into place, or none: each target is checked again (a directory
/// may have appeared at its name since the run started), the existing ones are kept until
/// every rename succeeded, and a failed rename restores those already made. Runs under the
/// lock of the live temporaries, which a signal's clean-up takes too: a signal waits for the
/// whole set to be committed or rolled back.
fn commit_all(mut staged: Vec<Staged>) -> Result<()> {
    let mut live = live();
    for s in &staged {
        check_target(&s.target)?;
    }
    let mut backups: Vec<Backup> = staged.iter().map(|s| Backup::of(&s.target)).collect();
    for i in 0..staged.len() {
        if let Err(e) = staged[i].persist(&mut live) {
            backups[..i].iter_mut().for_each(Backup::restore);
            return Err(e);
        }
    }
    Ok(())
}

impl Drop for Staged {
    fn drop(&mut self) {
        if let Some(temp) = self.temp.take() {
            let mut live = live();
            let _ = temp.close();
            live.remove(&self.id);
        }
    }
}

/// Runs `write` on a temporary file next to `target` and renames it into place once
/// complete; on any error the temporary is removed and `target` is left as it was.
pub fn write_atomically(target: &Path, write: impl FnOnce(&Path) -> Result<()>) -> Result<()> {
    write_together(&[target], |paths| write(paths[0]))
}

/// Like [`write_atomically`] for files that belong together: `write` gets one temporary per
/// target, and nothing is renamed into place unless every file was written. If a rename
/// fails after others succeeded, the files they replaced are put back (see [`commit_all`]).
pub fn write_together(targets: &[&Path], write: impl FnOnce(&[&Path]) -> Result<()>) -> Result<()> {
    stage_together(targets, write)?.commit()
}

/// Files written together under their temporary names and not yet renamed into place
/// ([`stage_together`]): dropped, they are removed and the targets left as they were.
pub struct StagedSet(Vec<Staged>);

impl StagedSet {
    /// Renames every file into place, or none (see [`commit_all`]).
    pub fn commit(self) -> Result<()> {
        commit_all(self.0)
    }

    /// The files the user asked for.
    pub fn targets(&self) -> impl Iterator<Item = &Path> {
        self.0.iter().map(Staged::target)
    }
}

/// The first half of [`write_together`]: writes the temporaries and returns them unrenamed,
/// for a caller that must agree with others before the files appear (the ranks of an MPI
/// job: see `parallel::collective`).
pub fn stage_together(
    targets: &[&Path],
    write: impl FnOnce(&[&Path]) -> Result<()>,
) -> Result<StagedSet> {
    check_paths(&[], targets)?;
    let staged: Vec<Staged> = targets
        .iter()
        .map(|t| Staged::new(t))
        .collect::<Result<_>>()?;
    let paths: Vec<&Path> = staged.iter().map(Staged::path).collect();
    if let Err(e) = write(&paths) {
        // The error names one of the temporaries: say which target it was.
        let e = staged.iter().fold(e, |e, s| s.about_target(e));
        return Err(e);
    }
    let set = StagedSet(staged);
    hold::before_commit(&set);
    Ok(set)
}

/// A pause between the written temporaries and their commit, for tests only: with
/// `SPEX_TEST_HOLD_COMMIT=MARKER` set, every set of staged files creates the file MARKER
/// (holding the first target's name) and waits until it is removed (at most a minute). A
/// test thus signals a run at a known point of its write, instead of racing it.
mod hold {
    use std::time::{Duration, Instant};

    use super::StagedSet;

    /// Longest a held commit waits for its marker to go.
    const MAX_HOLD: Duration = Duration::from_secs(60);

    pub(super) fn before_commit(set: &StagedSet) {
        let Some(marker) = std::env::var_os("SPEX_TEST_HOLD_COMMIT") else {
            return;
        };
        // A file written into another's temporary is part of that one's write: only the
        // outer set is held.
        let nested = {
            let live = super::live();
            set.targets().any(|t| live.values().any(|p| p == t))
        };
        if nested {
            return;
        }
        let marker = std::path::PathBuf::from(marker);
        let name = set.targets().next().map(|t| t.display().to_string());
        if std::fs::write(&marker, name.unwrap_or_default()).is_err() {
            return;
        }
        let t0 = Instant::now();
        while marker.exists() && t0.elapsed() < MAX_HOLD {
            std::thread::sleep(Duration::from_millis(10));
        }
    }
}

/// What identifies a file: its device and inode when it exists, else its canonical
/// directory and name.
#[derive(Clone, Debug, PartialEq, Eq)]
enum Identity {
    Inode(u64, u64),
    Name(PathBuf),
}

fn identity(path: &Path) -> Identity {
    if let Ok(m) = std::fs::metadata(path) {
        return Identity::Inode(m.dev(), m.ino());
    }
    let dir =
        std::fs::canonicalize(directory_of(path)).unwrap_or_else(|_| directory_of(path).into());
    Identity::Name(dir.join(path.file_name().unwrap_or_default()))
}

/// Refuses outputs that would replace one of the `inputs` or one another, and outputs that
/// cannot be written by a rename (see [`check_target`]). Meant to run once for a whole job,
/// before any work: the error names both files.
pub fn check_paths(inputs: &[&Path], outputs: &[&Path]) -> Result<()> {
    let inputs: Vec<(&Path, Identity)> = inputs
        .iter()
        .filter(|p| p.exists())
        .map(|&p| (p, identity(p)))
        .collect();
    let mut seen: Vec<(&Path, Identity)> = Vec::with_capacity(outputs.len());
    for &output in outputs {
        check_target(output)?;
        let id = identity(output);
        if let Some((input, _)) = inputs.iter().find(|(_, i)| *i == id) {
            return Err(Error::config(format!(
                "{}: the output would replace the input {}",
                output.display(),
                input.display()
            )));
        }
        if let Some((other, _)) = seen.iter().find(|(_, i)| *i == id) {
            return Err(Error::config(format!(
                "{}: the same file is also the output {}; each output must be written once",
                output.display(),
                other.display()
            )));
        }
        seen.push((output, id));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn names(dir: &Path) -> Vec<String> {
        let mut v: Vec<String> = std::fs::read_dir(dir)
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
            .collect();
        v.sort();
        v
    }

    #[test]
    fn temporary_names_are_hidden_keep_the_suffix_and_avoid_cfitsio_syntax() {
        let (p, s) = temporary_affixes(Path::new("/a/frame-r0.fits.gz"));
        assert_eq!((p.as_str(), s.as_str()), (".frame-r0.", ".fits.gz"));
        let (p, s) = temporary_affixes(Path::new("out[1].fits"));
        assert_eq!((p.as_str(), s.as_str()), (".out_1_.", ".fits"));
        let (p, s) = temporary_affixes(Path::new("noext"));
        assert_eq!((p.as_str(), s.as_str()), (".noext.", ""));
        for name in ["out.FITS.GZ", ".gz", "a.Gz"] {
            let (_, s) = temporary_affixes(Path::new(name));
            assert!(is_gzip_name(Path::new(&s)), "{name}: {s}");
        }
    }

    #[test]
    fn a_failed_write_leaves_nothing_and_names_the_target() {
        let dir = tempfile::tempdir().unwrap();
        let target = dir.path().join("out.fits");
        std::fs::write(&target, b"before").unwrap();
        let err = write_atomically(&target, |tmp| {
            std::fs::write(tmp, b"partial").unwrap();
            Err(Error::Io {
                path: tmp.into(),
                source: std::io::Error::from_raw_os_error(28),
            })
        })
        .unwrap_err()
        .to_string();
        assert!(err.starts_with(&target.display().to_string()), "{err}");
        assert!(err.contains("No space left on device"), "{err}");
        assert_eq!(names(dir.path()), vec!["out.fits"]);
        assert_eq!(std::fs::read(&target).unwrap(), b"before");
    }

    #[test]
    fn files_written_together_appear_together() {
        let dir = tempfile::tempdir().unwrap();
        let (a, b) = (dir.path().join("a.fits"), dir.path().join("b.fits"));
        let failed = write_together(&[&a, &b], |t| {
            std::fs::write(t[0], b"a").unwrap();
            Err(Error::config("second file failed"))
        });
        assert!(failed.is_err());
        assert!(names(dir.path()).is_empty());
        write_together(&[&a, &b], |t| {
            std::fs::write(t[0], b"a").unwrap();
            std::fs::write(t[1], b"b").unwrap();
            Ok(())
        })
        .unwrap();
        assert_eq!(names(dir.path()), vec!["a.fits", "b.fits"]);
        assert!(live().is_empty());
    }

    #[test]
    fn a_set_whose_second_target_became_a_directory_keeps_the_old_first_file() {
        let dir = tempfile::tempdir().unwrap();
        let (a, b) = (dir.path().join("a.fits"), dir.path().join("b.fits"));
        std::fs::write(&a, b"old").unwrap();
        let failed = write_together(&[&a, &b], |t| {
            std::fs::write(t[0], b"new a").unwrap();
            std::fs::write(t[1], b"new b").unwrap();
            std::fs::create_dir(&b).unwrap();
            Ok(())
        });
        assert!(failed.unwrap_err().to_string().contains("b.fits"));
        assert_eq!(std::fs::read(&a).unwrap(), b"old");
        assert_eq!(names(dir.path()), vec!["a.fits", "b.fits"]);
        assert!(live().is_empty());
    }

    #[test]
    fn a_restored_backup_puts_the_old_file_back_and_none_removes_the_new_one() {
        let dir = tempfile::tempdir().unwrap();
        let (old, new) = (dir.path().join("old.fits"), dir.path().join("new.fits"));
        std::fs::write(&old, b"old").unwrap();
        let (mut kept, mut nothing) = (Backup::of(&old), Backup::of(&new));
        assert!(kept.kept.is_some() && nothing.kept.is_none());
        std::fs::write(dir.path().join("x"), b"replacement").unwrap();
        std::fs::rename(dir.path().join("x"), &old).unwrap();
        std::fs::write(&new, b"new").unwrap();
        kept.restore();
        nothing.restore();
        assert_eq!(std::fs::read(&old).unwrap(), b"old");
        assert_eq!(names(dir.path()), vec!["old.fits"]);
        // A backup that is not restored goes away, leaving the target.
        drop(Backup::of(&old));
        assert_eq!(names(dir.path()), vec!["old.fits"]);
    }

    #[test]
    fn special_files_and_missing_directories_are_refused() {
        let dir = tempfile::tempdir().unwrap();
        for target in [
            PathBuf::from("/dev/null"),
            dir.path().to_path_buf(),
            dir.path().join("missing/out.fits"),
        ] {
            assert!(check_target(&target).is_err(), "{}", target.display());
            assert!(write_atomically(&target, |_| Ok(())).is_err());
        }
        assert!(names(dir.path()).is_empty());
    }

    #[test]
    fn aliases_of_inputs_and_of_other_outputs_are_refused() {
        let dir = tempfile::tempdir().unwrap();
        let input = dir.path().join("in.fits");
        std::fs::write(&input, b"x").unwrap();
        let link = dir.path().join("link.fits");
        std::fs::hard_link(&input, &link).unwrap();
        let out = dir.path().join("out.fits");
        let dotted = dir.path().join(".").join("out.fits");
        assert!(check_paths(&[&input], &[&out]).is_ok());
        assert!(check_paths(&[&input], &[&input]).is_err());
        assert!(check_paths(&[&input], &[&link]).is_err());
        assert!(check_paths(&[&input], &[&out, &dotted]).is_err());
    }
}
