//! How busy a device was: the union of the stretches in which any of its backends' compute
//! streams ran a wave's kernels, timed by CUDA events on the device's own clock, and logged
//! once, when the last backend on the device is released.
//!
//! A backend's "stream idle" counts only its own stream's gaps; with frames in flight another
//! backend's stream may fill them, so the device's idle time is what none of its streams
//! covered. Waves are timed from the end of their uploads (a stream waiting for its copies is
//! not computing) to the end of their gathering.

use std::sync::{Arc, Mutex, PoisonError};

use cudarc::driver::sys::CUevent_flags;
use cudarc::driver::{CudaContext, CudaEvent, CudaStream};

use super::error;
use crate::error::Result;

/// Spans kept before they are merged into fewer: a run adds some ten a frame.
const MERGE_AT: usize = 4096;

/// The waves' stretches of one device, in milliseconds after an event recorded when the
/// device opened.
pub(crate) struct BusyLog {
    origin: CudaEvent,
    gpu: String,
    spans: Mutex<Vec<(f64, f64)>>,
}

impl BusyLog {
    /// A log for device `gpu` (its name in the node), its clock started on `stream` now.
    pub(crate) fn start(ctx: &Arc<CudaContext>, stream: &CudaStream, gpu: &str) -> Result<Self> {
        let origin = ctx
            .new_event(Some(CUevent_flags::CU_EVENT_DEFAULT))
            .map_err(error::driver("cuEventCreate"))?;
        origin
            .record(stream)
            .map_err(error::driver("cuEventRecord"))?;
        Ok(BusyLog {
            origin,
            gpu: gpu.to_owned(),
            spans: Mutex::new(Vec::new()),
        })
    }

    /// Notes that a stream of the device computed from `from` to `to`, two events it has
    /// passed.
    pub(crate) fn record(&self, from: &CudaEvent, to: &CudaEvent) -> Result<()> {
        let at = |e: &CudaEvent| {
            self.origin
                .elapsed_ms(e)
                .map(f64::from)
                .map_err(error::driver("cuEventElapsedTime"))
        };
        let span = (at(from)?, at(to)?);
        let mut spans = self.spans.lock().unwrap_or_else(PoisonError::into_inner);
        spans.push(span);
        if spans.len() >= MERGE_AT {
            let merged = merge(std::mem::take(&mut *spans));
            *spans = merged;
        }
        Ok(())
    }
}

impl Drop for BusyLog {
    fn drop(&mut self) {
        let spans = merge(std::mem::take(
            self.spans.get_mut().unwrap_or_else(PoisonError::into_inner),
        ));
        if let Some(b) = Busy::of(&spans) {
            tracing::info!(
                "GPU {}: kernels running {:.2} s of the {:.2} s from its first wave to its last \
                 ({:.0}%; idle {:.2} s)",
                self.gpu,
                b.busy_ms / 1e3,
                b.span_ms / 1e3,
                100.0 * b.busy_ms / b.span_ms.max(f64::MIN_POSITIVE),
                (b.span_ms - b.busy_ms) / 1e3
            );
        }
    }
}

/// `spans` sorted and with the overlapping or touching ones joined.
fn merge(mut spans: Vec<(f64, f64)>) -> Vec<(f64, f64)> {
    spans.sort_by(|a, b| a.0.total_cmp(&b.0));
    let mut merged: Vec<(f64, f64)> = Vec::with_capacity(spans.len());
    for (from, to) in spans {
        match merged.last_mut() {
            Some(last) if from <= last.1 => last.1 = last.1.max(to),
            _ => merged.push((from, to)),
        }
    }
    merged
}

/// Time covered by merged spans, and from the first one's start to the last one's end.
#[derive(Debug, PartialEq)]
struct Busy {
    busy_ms: f64,
    span_ms: f64,
}

impl Busy {
    fn of(merged: &[(f64, f64)]) -> Option<Self> {
        let (first, last) = (merged.first()?, merged.last()?);
        Some(Busy {
            busy_ms: merged.iter().map(|(from, to)| to - from).sum(),
            span_ms: last.1 - first.0,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn overlapping_streams_count_once_and_gaps_not_at_all() {
        // two streams: 0-10 and 5-12 overlap, 12-15 touches them, 20-30 after a gap of 5
        let merged = merge(vec![(20.0, 30.0), (5.0, 12.0), (0.0, 10.0), (12.0, 15.0)]);
        assert_eq!(merged, vec![(0.0, 15.0), (20.0, 30.0)]);
        let busy = Busy::of(&merged).unwrap();
        assert_eq!(
            busy,
            Busy {
                busy_ms: 25.0,
                span_ms: 30.0
            }
        );
    }

    #[test]
    fn a_span_inside_another_adds_nothing_and_no_span_is_no_figure() {
        let merged = merge(vec![(0.0, 10.0), (2.0, 3.0), (4.0, 9.0)]);
        assert_eq!(merged, vec![(0.0, 10.0)]);
        assert_eq!(Busy::of(&merged).unwrap().busy_ms, 10.0);
        assert!(Busy::of(&merge(Vec::new())).is_none());
    }
}
