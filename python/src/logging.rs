//! The library's `tracing` events as records of Python's `logging`, on the `spex` logger, at
//! the program's levels (TRACE 5, DEBUG 10, INFO 20, WARNING 30, ERROR 40), so that the
//! handlers the host set up (desiutil's among them) show them.
//!
//! As in the program, spex's own events pass at the logger's level and other crates' at
//! warning and above; ranks that neither read nor write pass info only at debug level. The
//! logger's effective level is read once per job: Python is called only for records it keeps.

use std::fmt::Write as _;
use std::sync::atomic::{AtomicBool, AtomicU8, Ordering};

use pyo3::prelude::*;
use tracing::field::{Field, Visit};
use tracing::subscriber::Interest;
use tracing::{Event, Level, Metadata, Subscriber};
use tracing_subscriber::layer::{Context, Layer, SubscriberExt};

/// Python's level of the `spex` logger, as read at the start of the job.
static LOGGER_LEVEL: AtomicU8 = AtomicU8::new(WARNING);
/// Whether this rank logs its info records (a reader or writer, or a job of one rank).
static IO_RANK: AtomicBool = AtomicBool::new(true);

const TRACE: u8 = 5;
const DEBUG: u8 = 10;
const INFO: u8 = 20;
const WARNING: u8 = 30;
const ERROR: u8 = 40;

/// Installs, once per process, the subscriber that forwards events to Python, and reads the
/// `spex` logger's level for this job (debug with `-v`, as the program's `--verbose`).
pub fn install(py: Python<'_>, verbose: bool) -> PyResult<()> {
    let logger = py.import("logging")?.call_method1("getLogger", ("spex",))?;
    if verbose {
        logger.call_method1("setLevel", (DEBUG,))?;
    }
    let level: u8 = logger.call_method0("getEffectiveLevel")?.extract()?;
    LOGGER_LEVEL.store(level, Ordering::Relaxed);
    IO_RANK.store(true, Ordering::Relaxed);
    // A host that installed a subscriber of its own keeps it.
    let _ = tracing::subscriber::set_global_default(tracing_subscriber::registry().with(ToPython));
    Ok(())
}

/// Records this rank's role: ranks that only solve keep info records to themselves.
pub fn set_rank(_rank: usize, io_rank: bool) {
    IO_RANK.store(io_rank, Ordering::Relaxed);
}

/// Python's level of a `tracing` level.
fn python_level(level: &Level) -> u8 {
    match *level {
        Level::TRACE => TRACE,
        Level::DEBUG => DEBUG,
        Level::INFO => INFO,
        Level::WARN => WARNING,
        Level::ERROR => ERROR,
    }
}

/// Whether an event of `target` at Python level `level` reaches the logger.
fn passes(target: &str, level: u8) -> bool {
    let logger = LOGGER_LEVEL.load(Ordering::Relaxed);
    let ours = target == "spex" || target.starts_with("spex::");
    // Other crates, and info on ranks that only solve, pass at warning and above.
    let quiet = !ours || (!IO_RANK.load(Ordering::Relaxed) && logger > DEBUG);
    let floor = if quiet { logger.max(WARNING) } else { logger };
    level >= floor
}

/// The layer that hands events to the `spex` logger.
struct ToPython;

impl<S: Subscriber> Layer<S> for ToPython {
    /// Asked at every event (the level can change between jobs), so that events the logger
    /// would drop are never built: the debug events of the solves cost nothing.
    fn register_callsite(&self, _: &'static Metadata<'static>) -> Interest {
        Interest::sometimes()
    }

    fn enabled(&self, meta: &Metadata<'_>, _ctx: Context<'_, S>) -> bool {
        passes(meta.target(), python_level(meta.level()))
    }

    fn on_event(&self, event: &Event<'_>, _ctx: Context<'_, S>) {
        let meta = event.metadata();
        let level = python_level(meta.level());
        if !passes(meta.target(), level) {
            return;
        }
        let mut message = Message::default();
        event.record(&mut message);
        Python::attach(|py| {
            let logged = py
                .import("logging")
                .and_then(|l| l.call_method1("getLogger", ("spex",)))
                .and_then(|logger| logger.call_method1("log", (level, message.text)));
            if let Err(e) = logged {
                e.print(py);
            }
        });
    }
}

/// An event's message followed by its other fields as `name=value`.
#[derive(Default)]
struct Message {
    text: String,
}

impl Visit for Message {
    fn record_debug(&mut self, field: &Field, value: &dyn std::fmt::Debug) {
        if field.name() == "message" {
            let _ = write!(self.text, "{value:?}");
        } else {
            let _ = write!(self.text, " {}={value:?}", field.name());
        }
    }
}
