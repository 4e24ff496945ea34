//! The phases a call measured, placed on the wall clock: gpu_specter's and desispec's
//! `timing` dictionaries hold `time.time()` values taken as each phase ends, and spex's
//! phases are measured as durations that follow one another (read, solve, gather, assemble,
//! write), so each phase ends where the next one starts, the last one when the call's work
//! ended.

use std::time::{SystemTime, UNIX_EPOCH};

use spex::pipeline::Timings;

/// (phase, start, end) in seconds since the Unix epoch, for each phase in order.
pub type Phases = Vec<(String, f64, f64)>;

/// The [`Phases`] of `timings`, the last one ending at `end`.
pub fn phase_ends(timings: &Timings, end: SystemTime) -> Phases {
    let end = end
        .duration_since(UNIX_EPOCH)
        .map_or(0.0, |d| d.as_secs_f64());
    let mut at = end;
    let mut ends: Phases = timings
        .phases
        .iter()
        .rev()
        .map(|(name, duration)| {
            let start = at - duration.as_secs_f64();
            let this = (name.to_string(), start, at);
            at = start;
            this
        })
        .collect();
    ends.reverse();
    ends
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;

    #[test]
    fn each_phase_ends_where_the_next_begins() {
        let timings = Timings {
            phases: vec![
                ("read", Duration::from_millis(500)),
                ("solve", Duration::from_millis(2000)),
                ("write", Duration::from_millis(250)),
            ],
        };
        let end = UNIX_EPOCH + Duration::from_secs(1000);
        let ends = phase_ends(&timings, end);
        let names: Vec<&str> = ends.iter().map(|(n, _, _)| n.as_str()).collect();
        assert_eq!(names, ["read", "solve", "write"]);
        assert_eq!((ends[2].1, ends[2].2), (999.75, 1000.0));
        assert_eq!((ends[1].1, ends[1].2), (997.75, 999.75));
        assert_eq!((ends[0].1, ends[0].2), (997.25, 997.75));
    }
}
