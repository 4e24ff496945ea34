//! GPU backends kept between the jobs of a long-lived process.
//!
//! Opening a CUDA backend (its context, the kernels' load, its first frame's buffers) takes
//! 0.4-0.5 s for one GPU and 1.2-2.0 s for four, longer than solving a frame. The program runs
//! one job per process and pays it once; a Python caller such as desi_proc calls the library
//! once per exposure or per frame, in the same process. When keeping is on
//! ([`keep_between_jobs`], which the Python package turns on), [`super::create`] hands out
//! CUDA backends wrapped so that dropping them puts them back on a shelf, and the next job on
//! the same device ([`Backend::device`]) takes them from there, warm, with host threads of the
//! new job's share. A backend whose call failed (a device error, an interrupt) or that is
//! dropped by a panic is not kept. [`release`] frees what is kept: the device memory of the
//! buffers, pinned host memory and, with the last backend of a device, its CUDA context.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Mutex, MutexGuard, PoisonError};

use super::{Backend, FrameInput, Progress};
use crate::error::Result;
use crate::extract::PatchResult;
use crate::frame::FrameValues;
use crate::plan::Patch;

static KEEPING: AtomicBool = AtomicBool::new(false);
static SHELF: Mutex<Vec<Box<dyn Backend>>> = Mutex::new(Vec::new());

fn shelf() -> MutexGuard<'static, Vec<Box<dyn Backend>>> {
    SHELF.lock().unwrap_or_else(PoisonError::into_inner)
}

/// Turns keeping GPU backends between jobs on or off (off frees what is kept); returns
/// whether it was on.
pub fn keep_between_jobs(on: bool) -> bool {
    let was = KEEPING.swap(on, Ordering::SeqCst);
    if !on {
        release();
    }
    was
}

/// Whether GPU backends are kept between jobs.
pub fn keeping() -> bool {
    KEEPING.load(Ordering::SeqCst)
}

/// Frees every kept backend; returns how many there were. Backends in use are kept again when
/// their job ends, unless keeping is off by then.
pub fn release() -> usize {
    let kept = std::mem::take(&mut *shelf());
    kept.len()
}

/// How many backends are kept now.
pub fn kept() -> usize {
    shelf().len()
}

/// A kept backend of `device`, if any, with `threads` host threads, wrapped to go back on the
/// shelf.
pub(super) fn take(device: usize, threads: usize) -> Result<Option<Box<dyn Backend>>> {
    let taken = {
        let mut shelf = shelf();
        let Some(i) = shelf.iter().position(|b| b.device() == Some(device)) else {
            return Ok(None);
        };
        shelf.swap_remove(i)
    };
    let mut kept = Kept::new(threads, taken);
    kept.call(|b| b.reuse(threads))?;
    tracing::debug!("{}: kept from an earlier job", kept.describe());
    Ok(Some(Box::new(kept)))
}

/// `backend` with `threads` host threads, wrapped to go back on the shelf when dropped while
/// keeping is on.
pub(super) fn wrap(threads: usize, backend: Box<dyn Backend>) -> Box<dyn Backend> {
    Box::new(Kept::new(threads, backend))
}

/// A backend that goes back on the shelf when dropped, unless one of its calls failed.
struct Kept {
    /// The host threads of its job, which its siblings get.
    threads: usize,
    inner: Option<Box<dyn Backend>>,
    failed: bool,
}

impl Kept {
    fn new(threads: usize, inner: Box<dyn Backend>) -> Self {
        Kept {
            threads,
            inner: Some(inner),
            failed: false,
        }
    }

    fn inner(&self) -> &dyn Backend {
        self.inner
            .as_deref()
            .expect("a kept backend is present until dropped")
    }

    /// Runs `f` on the backend; one failure and it is not kept.
    fn call<T>(&mut self, f: impl FnOnce(&mut dyn Backend) -> Result<T>) -> Result<T> {
        let inner = self
            .inner
            .as_deref_mut()
            .expect("a kept backend is present until dropped");
        let outcome = f(inner);
        self.failed |= outcome.is_err();
        outcome
    }
}

impl Backend for Kept {
    fn describe(&self) -> String {
        self.inner().describe()
    }

    fn device(&self) -> Option<usize> {
        self.inner().device()
    }

    /// A kept backend of the same device if there is one, else a new sibling.
    fn sibling(&self) -> Result<Box<dyn Backend>> {
        let kept = match self.device() {
            Some(device) => take(device, self.threads)?,
            None => None,
        };
        match kept {
            Some(kept) => Ok(kept),
            None => Ok(wrap(self.threads, self.inner().sibling()?)),
        }
    }

    fn one_frame_only(&mut self) {
        if let Some(b) = self.inner.as_mut() {
            b.one_frame_only();
        }
    }

    fn reuse(&mut self, threads: usize) -> Result<()> {
        self.threads = threads;
        self.call(|b| b.reuse(threads))
    }

    fn extract(
        &mut self,
        input: FrameInput<'_>,
        patches: &[Patch],
        progress: &Progress,
    ) -> Result<Vec<PatchResult>> {
        self.call(|b| b.extract(input, patches, progress))
    }

    fn extract_into(
        &mut self,
        input: FrameInput<'_>,
        patches: &[Patch],
        progress: &Progress,
        values: &mut FrameValues,
    ) -> Result<Vec<PatchResult>> {
        self.call(|b| b.extract_into(input, patches, progress, values))
    }
}

impl Drop for Kept {
    fn drop(&mut self) {
        let Some(inner) = self.inner.take() else {
            return;
        };
        if self.failed || std::thread::panicking() || !keeping() {
            tracing::debug!("{}: not kept", inner.describe());
            return;
        }
        shelf().push(inner);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::error::Error;
    use std::sync::atomic::AtomicUsize;
    use std::sync::Arc;

    /// The shelf and its switch are the process's: the tests take turns.
    static TURN: Mutex<()> = Mutex::new(());

    fn turn() -> MutexGuard<'static, ()> {
        let turn = TURN.lock().unwrap_or_else(PoisonError::into_inner);
        KEEPING.store(true, Ordering::SeqCst);
        turn
    }

    /// A backend of device `id / 100` (its siblings numbered one above it) that counts its
    /// drops.
    struct Fake {
        id: usize,
        threads: usize,
        dropped: Arc<AtomicUsize>,
    }

    fn fake(id: usize, dropped: &Arc<AtomicUsize>) -> Box<dyn Backend> {
        Box::new(Fake {
            id,
            threads: 3,
            dropped: Arc::clone(dropped),
        })
    }

    impl Backend for Fake {
        fn describe(&self) -> String {
            format!("fake {} ({} threads)", self.id, self.threads)
        }
        fn device(&self) -> Option<usize> {
            Some(self.id / 100)
        }
        fn sibling(&self) -> Result<Box<dyn Backend>> {
            Ok(Box::new(Fake {
                id: self.id + 1,
                threads: self.threads,
                dropped: Arc::clone(&self.dropped),
            }))
        }
        fn reuse(&mut self, threads: usize) -> Result<()> {
            self.threads = threads;
            Ok(())
        }
        fn extract(
            &mut self,
            _input: FrameInput<'_>,
            _patches: &[Patch],
            _progress: &Progress,
        ) -> Result<Vec<PatchResult>> {
            Ok(Vec::new())
        }
    }

    impl Drop for Fake {
        fn drop(&mut self) {
            self.dropped.fetch_add(1, Ordering::SeqCst);
        }
    }

    fn taken(device: usize, threads: usize) -> Option<Box<dyn Backend>> {
        take(device, threads).expect("the fake's threads are set")
    }

    #[test]
    fn a_dropped_backend_serves_the_next_job_on_its_device() {
        let _turn = turn();
        let dropped = Arc::new(AtomicUsize::new(0));
        drop(wrap(3, fake(1000, &dropped)));
        assert_eq!(dropped.load(Ordering::SeqCst), 0, "kept, not freed");
        assert!(taken(11, 3).is_none(), "another device");
        let again = taken(10, 5).expect("the kept backend");
        assert_eq!(again.describe(), "fake 1000 (5 threads)");
        assert!(taken(10, 5).is_none(), "taken once");
        // a sibling is made when none is kept; both are kept after the job
        let sibling = again.sibling().expect("sibling");
        assert_eq!(sibling.describe(), "fake 1001 (5 threads)");
        drop((again, sibling));
        // a kept backend is taken before a sibling is made, with its first's threads
        let first = taken(10, 2).expect("kept");
        let second = first.sibling().expect("sibling");
        let mut names = [first.describe(), second.describe()];
        names.sort();
        assert_eq!(names, ["fake 1000 (2 threads)", "fake 1001 (2 threads)"]);
        assert_eq!(dropped.load(Ordering::SeqCst), 0);
        drop((first, second));
        assert_eq!(release(), 2);
        assert_eq!(dropped.load(Ordering::SeqCst), 2);
    }

    #[test]
    fn a_backend_whose_call_failed_is_freed() {
        let _turn = turn();
        let dropped = Arc::new(AtomicUsize::new(0));
        let mut kept = Kept::new(1, fake(2000, &dropped));
        assert!(kept.call(|_| Ok(())).is_ok());
        drop(kept);
        assert_eq!(dropped.load(Ordering::SeqCst), 0, "kept after a good call");
        let good = taken(20, 1).expect("kept");
        let mut kept = Kept::new(1, fake(2001, &dropped));
        let failed: Result<()> = kept.call(|_| Err(Error::Gpu("a device error".into())));
        assert!(failed.is_err());
        drop(kept);
        let freed = dropped.load(Ordering::SeqCst);
        assert_eq!(freed, 1, "freed after a failed call");
        assert!(taken(20, 1).is_none());
        drop(good);
        assert_eq!(release(), 1);
        assert_eq!(dropped.load(Ordering::SeqCst), 2);
    }

    #[test]
    fn release_and_keeping_off_free_the_backends() {
        let _turn = turn();
        let dropped = Arc::new(AtomicUsize::new(0));
        drop(wrap(1, fake(3000, &dropped)));
        let in_use = wrap(1, fake(3001, &dropped));
        assert!(kept() >= 1);
        keep_between_jobs(false);
        assert_eq!(kept(), 0);
        assert_eq!(dropped.load(Ordering::SeqCst), 1, "the kept one freed");
        // in use while keeping went off: freed when its job ends
        drop(in_use);
        assert_eq!(dropped.load(Ordering::SeqCst), 2);
        assert!(taken(30, 1).is_none());
        KEEPING.store(true, Ordering::SeqCst);
        drop(wrap(1, fake(3002, &dropped)));
        assert_eq!(release(), 1);
        assert_eq!(dropped.load(Ordering::SeqCst), 3);
    }
}
