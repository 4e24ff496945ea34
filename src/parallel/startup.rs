//! What the ranks of a job agree on before their first collective that assumes a common
//! configuration: that every rank could build it, and that they were all given the same.
//!
//! Every rank parses its own command line and reads its own `--list` file. A list file
//! missing on one node, or a launcher that gave ranks different arguments, would otherwise
//! send the ranks into different collectives (MPI_ERR_TRUNCATE, and no line of spex). One
//! small collective settles it: each rank's exit status for its configuration (0: usable)
//! and a fingerprint of its command line, gathered on every rank. Then every rank reaches
//! the same verdict, and one line says why the job stops: the first refusing rank's own
//! (`spex: rank R: error: ...`), which the other ranks do not repeat.

use std::ffi::OsString;
use std::hash::{Hash, Hasher};

use super::layout::error_prefix;
use super::{print_line, Comm};

/// Why a rank cannot run the job: its line and its exit status.
#[derive(Debug)]
pub struct Refusal {
    pub message: String,
    pub code: u8,
}

/// Exit status of ranks that were given different command lines: a usage error.
const EXIT_USAGE: u8 = 2;

/// A fingerprint of the command line (`args`, the program's name first), which decides the
/// ranks' roles and so the job's collectives. The program's name is left out: a launcher
/// may start the same binary under different names.
pub fn fingerprint(args: &[OsString]) -> u64 {
    let mut h = std::collections::hash_map::DefaultHasher::new();
    args.get(1..).unwrap_or_default().hash(&mut h);
    h.finish()
}

/// The configuration of this rank (`local`) if every rank of `world` has a usable one and all
/// were given the same command line (`fingerprint`); else the exit status, the same on every
/// rank, after one line: the message of the first rank that refused, printed by that rank,
/// or rank 0's line on differing command lines.
pub fn agree<T>(
    world: &Comm,
    launched: bool,
    local: Result<T, Refusal>,
    fingerprint: u64,
) -> Result<T, u8> {
    let code = local.as_ref().err().map_or(0, |r| r.code.max(1));
    let codes = world.all_gather(u64::from(code));
    let prints = world.all_gather(fingerprint);
    let me = world.rank();
    let verdict = verdict(&codes, &prints);
    let Some((first, code)) = verdict else {
        return local.map_err(|_| EXIT_USAGE);
    };
    match (&local, first) {
        (Err(refusal), Some(r)) if r == me => {
            print_line(&format!(
                "{} {}",
                error_prefix(launched, me),
                refusal.message
            ));
        }
        (_, None) if me == 0 => print_line(&format!(
            "{} the ranks were not given the same command line; every rank must run the \
             same job",
            error_prefix(launched, 0)
        )),
        _ => {}
    }
    // The lines are out before any rank exits: a launcher may end the job at the first
    // rank that exits non-zero.
    world.all_max(0);
    Err(code)
}

/// What the gathered `codes` and fingerprints `prints` say: `None` to go on, else the rank
/// whose line stops the job (`None`: rank 0's line on differing command lines) and the exit
/// status of every rank.
fn verdict(codes: &[u64], prints: &[u64]) -> Option<(Option<usize>, u8)> {
    if let Some(r) = codes.iter().position(|&c| c != 0) {
        let code = u8::try_from(codes[r]).unwrap_or(1);
        return Some((Some(r), code));
    }
    let same = prints.windows(2).all(|w| w[0] == w[1]);
    (!same).then_some((None, EXIT_USAGE))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_first_refusing_rank_speaks_and_its_status_is_everyones() {
        assert_eq!(verdict(&[0, 0, 0], &[7, 7, 7]), None);
        assert_eq!(verdict(&[0, 2, 1], &[7, 7, 7]), Some((Some(1), 2)));
        assert_eq!(verdict(&[1, 1], &[7, 7]), Some((Some(0), 1)));
        // Refusals come first: a rank that refused may have read other files.
        assert_eq!(verdict(&[0, 1], &[7, 8]), Some((Some(1), 1)));
        assert_eq!(verdict(&[0, 0], &[7, 8]), Some((None, EXIT_USAGE)));
    }

    #[test]
    fn fingerprints_tell_command_lines_apart_but_not_the_programs_name() {
        let args = |a: &[&str]| a.iter().map(OsString::from).collect::<Vec<_>>();
        let a = fingerprint(&args(&["spex", "-i", "a.fits"]));
        assert_eq!(a, fingerprint(&args(&["/usr/bin/spex", "-i", "a.fits"])));
        assert_ne!(a, fingerprint(&args(&["spex", "-i", "b.fits"])));
        assert_ne!(a, fingerprint(&args(&["spex", "-ia.fits"])));
        assert_ne!(a, fingerprint(&args(&["spex", "-i", "a.fits", "-v"])));
    }

    #[test]
    fn a_world_of_one_rank_keeps_its_configuration_or_its_status() {
        let world = Comm::alone();
        assert_eq!(agree(&world, false, Ok::<u8, Refusal>(5), 1).unwrap(), 5);
        let refused = Refusal {
            message: "bad".into(),
            code: 2,
        };
        assert_eq!(agree::<u8>(&world, false, Err(refused), 1).unwrap_err(), 2);
    }
}
