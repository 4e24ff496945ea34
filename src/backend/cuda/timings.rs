//! Where the time of an `extract` call goes: phase times from CUDA events around the steps of
//! each wave, host phases from the wall clock, and the counters of the fallbacks.

use cudarc::driver::CudaEvent;

use super::device::Device;
use super::error;
use crate::error::Result;

/// Time spent in each phase, summed over waves (device phases from CUDA events, host phases
/// from the wall clock).
#[derive(Clone, Debug, Default)]
pub struct GpuTimings {
    /// `(phase, milliseconds)` in execution order.
    pub phases: Vec<(&'static str, f64)>,
    /// Wall time of the whole `extract` call, milliseconds.
    pub total_ms: f64,
    /// Peak device memory held by the backend's buffers during the call, bytes.
    pub peak_bytes: usize,
    /// Device memory in use (all of the process, libraries included) at the end of the
    /// largest wave, bytes, from cuMemGetInfo.
    pub device_used_bytes: usize,
    /// Waves in which the device walked the frame.
    pub waves: usize,
    /// Whether the frame was uploaded from pageable host memory (buffers not yet pinned, or
    /// larger than those pinned), during which the host waits for the upload.
    pub pageable_upload: bool,
    pub patches: usize,
    /// Patches whose first factorisation failed and that were retried with regularize 1e-4.
    pub retried: usize,
    /// Patches handed to the CPU reference after the retry failed too.
    pub cpu_fallback: usize,
    /// Largest number of Jacobi sweeps of any block (blocks the polar route gave up on).
    pub max_sweeps: i32,
    /// Core blocks decorrelated by the polar route, and the most steps any of them took.
    pub polar_blocks: usize,
    pub max_polar_steps: i32,
    /// Core blocks the polar route gave up on (not positive definite, or no convergence),
    /// decorrelated by the Jacobi eigensolver instead.
    pub polar_fallback: usize,
    /// Patches the Schur route handed to the CPU reference because their second-neighbour
    /// coupling was not negligible (counted in `cpu_fallback` too).
    pub coupled: usize,
    /// Largest second-neighbour coupling of any patch on the Schur route (|A_ij| of blocks two
    /// fibers apart over sqrt(A_ii A_jj)).
    pub max_coupling: f64,
    /// Re-solves of outlier rejection that started from their patch's kept normal equations
    /// rather than assembling them again (`reject::kept`).
    pub downdated: usize,
    /// Whether steps 2-3 took the dense route (asked for, or blocks too large for the Schur
    /// sweeps).
    pub dense_route: bool,
    /// When the host reached each step of the call (`(step, milliseconds from the call's
    /// start)`): how long the device waited for the host before the frame's first wave and
    /// after its last.
    pub milestones: Vec<(&'static str, f64)>,
    /// When the host had the copies back of the frame's last wave: what it does after them
    /// (unpacking that wave, handing the results over) the device does not hide.
    pub last_back: Option<std::time::Instant>,
}

impl GpuTimings {
    /// Notes that the host reached `step` at `since.elapsed()` into the call.
    pub(crate) fn reached(&mut self, step: &'static str, since: std::time::Instant) {
        self.milestones
            .push((step, since.elapsed().as_secs_f64() * 1e3));
    }

    /// Adds the host's work on the call's critical path (`since` its start) as two phases:
    /// before the device had a wave, and after the last wave's copies back were in.
    pub(crate) fn add_critical_path(&mut self, since: std::time::Instant) {
        let first = self.milestones.iter().find(|m| m.0 == "first wave queued");
        if let (Some(&(_, first)), Some(back)) = (first, self.last_back) {
            self.add("host before the first wave", first);
            let after = since.elapsed().saturating_sub(back.duration_since(since));
            self.add("host after the last wave", after.as_secs_f64() * 1e3);
        }
    }

    pub(crate) fn add(&mut self, phase: &'static str, ms: f64) {
        if let Some(p) = self.phases.iter_mut().find(|p| p.0 == phase) {
            p.1 += ms;
        } else {
            self.phases.push((phase, ms));
        }
    }
}

/// CUDA events around the phases of a wave.
pub(crate) struct PhaseClock<'a> {
    dev: &'a Device,
    marks: Vec<(&'static str, CudaEvent)>,
}

impl<'a> PhaseClock<'a> {
    pub(crate) fn new(dev: &'a Device) -> Self {
        PhaseClock {
            dev,
            marks: Vec::new(),
        }
    }

    /// Marks the end of phase `name` (its start is the previous mark).
    pub(crate) fn mark(&mut self, name: &'static str) -> Result<()> {
        let ev = self
            .dev
            .ctx
            .new_event(Some(cudarc::driver::sys::CUevent_flags::CU_EVENT_DEFAULT))
            .map_err(error::driver("cuEventCreate"))?;
        ev.record(&self.dev.stream)
            .map_err(error::driver("cuEventRecord"))?;
        self.marks.push((name, ev));
        Ok(())
    }

    /// The last mark.
    pub(crate) fn last(&self) -> Option<&CudaEvent> {
        self.marks.last().map(|(_, ev)| ev)
    }

    /// The first mark of phase `name`.
    pub(crate) fn first_of(&self, name: &str) -> Option<&CudaEvent> {
        self.marks
            .iter()
            .find(|(n, _)| *n == name)
            .map(|(_, ev)| ev)
    }

    /// Adds to `t`, as "stream idle", the time between `before` (the last mark of the wave
    /// before, or one set when the call started) and this wave's first mark: time the call's
    /// stream had nothing queued, waiting for the host (once the device has passed both; with
    /// frames in flight, other frames' streams may use the device meanwhile). Returns this
    /// wave's last mark, for the next wave.
    pub(crate) fn idle_since(
        mut self,
        before: Option<CudaEvent>,
        t: &mut GpuTimings,
    ) -> Result<Option<CudaEvent>> {
        if let (Some(b), Some((_, first))) = (&before, self.marks.first()) {
            let ms = b
                .elapsed_ms(first)
                .map_err(error::driver("cuEventElapsedTime"))?;
            t.add("stream idle", ms as f64);
        }
        Ok(self.marks.pop().map(|(_, ev)| ev))
    }

    /// Adds the elapsed times to `t` (once the device has passed the last mark).
    pub(crate) fn collect(&self, t: &mut GpuTimings) -> Result<()> {
        for w in self.marks.windows(2) {
            let ms = w[0]
                .1
                .elapsed_ms(&w[1].1)
                .map_err(error::driver("cuEventElapsedTime"))?;
            t.add(w[1].0, ms as f64);
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use std::time::{Duration, Instant};

    use super::GpuTimings;

    #[test]
    fn milestones_count_from_the_calls_start_in_order() {
        let start = Instant::now();
        let mut t = GpuTimings::default();
        t.reached("frame set up", start);
        std::thread::sleep(Duration::from_millis(5));
        t.reached("first wave queued", start);
        let steps: Vec<&str> = t.milestones.iter().map(|m| m.0).collect();
        assert_eq!(steps, ["frame set up", "first wave queued"]);
        // both from the same start: the second at least the sleep after the first
        assert!(
            t.milestones[1].1 - t.milestones[0].1 >= 5.0,
            "{:?}",
            t.milestones
        );
        assert!(t.milestones[0].1 >= 0.0);
    }

    #[test]
    fn the_critical_path_is_the_host_before_the_first_wave_and_after_the_last() {
        let start = Instant::now();
        let mut t = GpuTimings::default();
        t.add_critical_path(start);
        assert!(
            t.phases.is_empty(),
            "no wave, no critical path: {:?}",
            t.phases
        );
        std::thread::sleep(Duration::from_millis(4));
        t.reached("first wave queued", start);
        std::thread::sleep(Duration::from_millis(20));
        let back = Instant::now();
        t.last_back = Some(back);
        std::thread::sleep(Duration::from_millis(6));
        let to_back = back.duration_since(start).as_secs_f64() * 1e3;
        t.add_critical_path(start);
        let total = start.elapsed().as_secs_f64() * 1e3;
        let ms = |name| t.phases.iter().find(|p| p.0 == name).map(|p| p.1).unwrap();
        let (before, after) = (
            ms("host before the first wave"),
            ms("host after the last wave"),
        );
        // each at least its sleep, and neither holds the 20 ms the device had the waves
        assert!(
            before >= 4.0 && before <= to_back - 20.0,
            "{before} of {to_back}"
        );
        assert!(
            after >= 6.0 && after <= total - to_back,
            "{after} of {total}"
        );
    }
}
