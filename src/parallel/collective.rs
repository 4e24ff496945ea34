//! The collective loop of a frame group: for each of the group's frames, in the order of the
//! list, the reader reads the PSF and the image, checks the plan and broadcasts a header (the
//! PSF, the image's shape and header cards) and the pixels of the plan's box as raw f32
//! buffers; each worker solves its block of patches on its backend and returns the results
//! to the writer, which stitches the frame and writes it under temporary names; the writer
//! renames them into place only after every rank of its write communicator answered that it
//! is alive after the write (`agree_and_commit`), so that a rank killed during the write
//! leaves the old files. One process runs the same code (then one rank is reader, worker and
//! writer).
//!
//! Errors: a frame that cannot be read, or fails on any worker, is counted by the writer and
//! skipped by every rank that handles it: the reader broadcasts a failure header, a worker
//! returns a failed contribution, so every rank of the group still takes part in the same
//! collectives. What leaves ranks out of step (a malformed message, a buffer that cannot be
//! allocated) aborts the whole job through `MPI_Abort` after its line.

use std::time::Instant;

use ndarray::Array2;

use super::layout::Group;
use super::messages::{decode, encode, pack_box, unpack_box, Contribution, FrameHeader};
use super::phases::{commit_now, solve_share, write_frame, Fate, Outcome, Ready, Share};
use super::{print_line, Comm, FrameCheck};
use crate::backend::{Backend, Progress};
use crate::error::{Error, Result};
use crate::pipeline::{read_frame, ExtractRequest, Inputs, PixelBox};

/// Releases a backend on a thread of its own: freeing a GPU's buffers and context takes
/// tens of milliseconds, which the last frame's gather and write then hide.
fn release_in_background(backend: Box<dyn Backend>) -> std::thread::JoinHandle<()> {
    std::thread::spawn(move || {
        let t0 = Instant::now();
        drop(backend);
        tracing::debug!("backend released in {:.3} s", t0.elapsed().as_secs_f64());
    })
}

/// What a rank needs to take part in the frames of its group.
pub(super) struct GroupContext<'a> {
    pub world: &'a Comm,
    pub comm: &'a Comm,
    pub group: &'a Group,
    /// This rank in the group.
    pub local: usize,
    pub prefix: &'a str,
    pub progress: &'a dyn Fn() -> Progress,
    pub check: Option<&'a FrameCheck<'a>>,
}

/// A frame as the reader distributed it, on one rank.
struct Received {
    inputs: Option<Inputs>,
    /// The header as broadcast, which worker 0 forwards to a writer that did not read.
    header: Vec<u8>,
    read_s: f64,
    recv_s: f64,
}

impl GroupContext<'_> {
    /// Prints the line of an error that leaves the ranks out of step and aborts the job.
    fn fatal(&self, e: &dyn std::fmt::Display) -> ! {
        print_line(&format!("{} {e}", self.prefix));
        self.world.abort(1)
    }

    /// Reads, solves and writes the frames of the group (`(index in the list, request)`, in
    /// the order of the list); `first_read` is the reader's read of the first of them, with
    /// the seconds it took.
    ///
    /// The reader and the workers share the broadcasts, the workers and the writer the
    /// gathers; in both the reader (resp. writer) is rank 0. Without dedicated I/O ranks both
    /// communicators are the whole group.
    pub fn run(
        &self,
        frames: &[(usize, &ExtractRequest)],
        mut first_read: Option<(Result<(Inputs, PixelBox)>, f64)>,
        mut backend: Option<Box<dyn Backend>>,
    ) -> Outcome {
        let (group, me) = (self.group, self.local);
        let (is_reader, is_writer) = (me == group.reader(), me == group.writer());
        let worker = group.worker_index(me);
        let read_comm = self
            .comm
            .split((is_reader || worker.is_some()).then_some(0));
        let write_comm = self
            .comm
            .split((is_writer || worker.is_some()).then_some(0));

        let mut outcome = Outcome::default();
        let mut release = None;
        for (i, &(k, request)) in frames.iter().enumerate() {
            let mut received = match &read_comm {
                Some(rc) if is_reader => {
                    let read = first_read.take().unwrap_or_else(|| timed_read(request));
                    self.distribute(rc, request, Some(read))
                }
                Some(rc) => self.distribute(rc, request, None),
                None => Received {
                    inputs: None,
                    header: Vec::new(),
                    read_s: 0.0,
                    recv_s: 0.0,
                },
            };
            let own = match (worker, backend.as_deref_mut()) {
                (Some(wi), Some(backend)) => {
                    let share = Share {
                        worker: wi,
                        nworkers: group.nworkers(),
                        frame: k,
                        rank: group.world(me),
                    };
                    Some(self.solve(request, &mut received, backend, &share, is_writer))
                }
                _ => None,
            };
            if i + 1 == frames.len() {
                release = backend.take().map(release_in_background);
            }
            // The reader needs nothing more of this frame: with --async-io it reads the next
            // one while the workers solve this one.
            if !is_writer {
                received.inputs = None;
            }
            if let Some(wc) = &write_comm {
                let staged = self.gather_and_write(wc, request, received, own);
                if let Some(written) = self.agree_and_commit(wc, staged) {
                    outcome.record(written, request, self.prefix);
                }
            }
        }
        if let Some(thread) = release {
            let _ = thread.join();
        }
        outcome
    }

    /// Broadcasts a frame from the reader (rank 0 of `rc`, which passes its `read` and the
    /// seconds it took) and returns what every rank of `rc` received: on the other ranks a
    /// full-size image that is zero outside the plan's pixel box.
    fn distribute(
        &self,
        rc: &Comm,
        request: &ExtractRequest,
        read: Option<(Result<(Inputs, PixelBox)>, f64)>,
    ) -> Received {
        let mut inputs = None;
        let mut header = Vec::new();
        let mut read_s = 0.0;
        if let Some((read, seconds)) = read {
            read_s = seconds;
            if rc.size() == 1 {
                return self.keep_alone(request, read, read_s);
            }
            match read.and_then(|(i, pixel_box)| {
                let h = encode(&FrameHeader::new(&i, pixel_box, read_s))?;
                Ok((i, h))
            }) {
                Ok((i, h)) => {
                    header = vec![1];
                    header.extend(h);
                    inputs = Some(i);
                }
                Err(e) => {
                    let name = request.input.display();
                    print_line(&format!("{} frame {name}: {e}", self.prefix));
                    header = vec![0];
                }
            }
        }
        let t_recv = Instant::now();
        rc.wait_quietly();
        {
            let _range = nvtx::LocalRange::new(c"broadcast");
            if let Err(e) = rc.broadcast_bytes(0, &mut header) {
                self.fatal(&e);
            }
        }
        if header.first() == Some(&1) {
            header.remove(0);
            let received = distribute_pixels(rc, &header, inputs.take(), request);
            inputs = Some(received.unwrap_or_else(|e| self.fatal(&e)));
        }
        Received {
            inputs,
            header,
            read_s,
            recv_s: t_recv.elapsed().as_secs_f64(),
        }
    }

    /// What a reader alone in its communicator keeps of its read: nothing to broadcast, so
    /// neither the header nor the pixel box is packed.
    fn keep_alone(
        &self,
        request: &ExtractRequest,
        read: Result<(Inputs, PixelBox)>,
        read_s: f64,
    ) -> Received {
        let inputs = match read {
            Ok((inputs, _)) => Some(inputs),
            Err(e) => {
                let name = request.input.display();
                print_line(&format!("{} frame {name}: {e}", self.prefix));
                None
            }
        };
        Received {
            inputs,
            header: Vec::new(),
            read_s,
            recv_s: 0.0,
        }
    }

    /// Solves this worker's block of the frame, if it was read; a failure is reported here
    /// and travels to the writer as a failed contribution.
    fn solve(
        &self,
        request: &ExtractRequest,
        received: &mut Received,
        backend: &mut dyn Backend,
        share: &Share,
        is_writer: bool,
    ) -> Contribution {
        let Some(inputs) = &received.inputs else {
            return Contribution::Skipped;
        };
        let shown = if share.rank == 0 {
            (self.progress)()
        } else {
            Progress::silent()
        };
        let t0 = Instant::now();
        match solve_share(request, inputs, backend, share, &shown, is_writer, None) {
            Ok((results, placed)) => Contribution::Solved {
                // The writer needs the header only when it did not read.
                header: (share.worker == 0 && !is_writer)
                    .then(|| std::mem::take(&mut received.header)),
                results,
                placed: placed.map(Box::new),
                recv_s: received.recv_s,
                solve_s: t0.elapsed().as_secs_f64(),
            },
            Err(e) => {
                let name = request.input.display();
                print_line(&format!("{} frame {name}: {e}", self.prefix));
                Contribution::Failed
            }
        }
    }

    /// Commits the frame that the writer (rank 0 of `wc`) staged, once every rank of `wc` has
    /// shown that it is still alive after the write: the writer says whether it holds the
    /// frame's files, and each rank answers only once it heard that. The answer of a rank
    /// that dies before it gives one never comes: the writer waits in the second collective
    /// until the launcher, which takes the whole job down when one rank dies, stops it, and
    /// its signal handler removes the temporaries (`output`). A single collective would not
    /// do: a rank that entered it early and then died has its share already delivered.
    ///
    /// What remains is the time between the last answer and the rename (and the rest of
    /// the job after it): a rank that dies there leaves a non-zero exit with the new files.
    /// Returns the writer's fate of the frame, `None` on the other ranks.
    fn agree_and_commit(
        &self,
        wc: &Comm,
        staged: Option<Result<Option<Ready>>>,
    ) -> Option<Result<Fate>> {
        if wc.size() > 1 {
            let mut ready = vec![u8::from(matches!(staged, Some(Ok(Some(_)))))];
            wc.wait_quietly();
            if let Err(e) = wc.broadcast_bytes(0, &mut ready) {
                self.fatal(&e);
            }
            if ready.first() == Some(&1) {
                wc.all_max(0);
            }
        }
        staged.map(commit_now)
    }

    /// Gathers the contributions on the writer (rank 0 of `wc`), which stitches the frame,
    /// once every worker delivered, and writes it under temporary names for
    /// [`GroupContext::agree_and_commit`]. `None` on the other ranks.
    fn gather_and_write(
        &self,
        wc: &Comm,
        request: &ExtractRequest,
        received: Received,
        mut own: Option<Contribution>,
    ) -> Option<Result<Option<Ready>>> {
        let group = self.group;
        let is_writer = self.local == group.writer();
        let send = match (&own, is_writer) {
            (Some(c), false) => encode(c).unwrap_or_else(|e| self.fatal(&e)),
            _ => Vec::new(),
        };
        let t_gather = Instant::now();
        wc.wait_quietly();
        let gathered = {
            let _range = nvtx::LocalRange::new(c"gather");
            wc.gather_bytes(0, &send).unwrap_or_else(|e| self.fatal(&e))
        }?;
        let gather = t_gather.elapsed();
        // World rank of rank j of the write communicator.
        let peer = |j: usize| match (group.async_io, j) {
            (false, _) => group.world(j),
            (true, 0) => group.world(group.writer()),
            (true, _) => group.world(group.workers().start + j - 1),
        };
        let mut contributions = Vec::with_capacity(gathered.len());
        for (j, bytes) in gathered.into_iter().enumerate() {
            let c = if j == 0 {
                match own.take() {
                    Some(c) => c,
                    None => continue, // a dedicated writer solves nothing
                }
            } else {
                decode::<Contribution>(&bytes)
                    .unwrap_or_else(|e| self.fatal(&format!("from rank {}: {e}", peer(j))))
            };
            contributions.push((peer(j), c));
        }
        Some(write_frame(
            request,
            received.inputs,
            received.read_s,
            contributions,
            Some(gather),
            self.check,
        ))
    }
}

/// Broadcasts the pixel box of a frame from the reader (rank 0 of `rc`, which passes its
/// inputs) and returns every rank's inputs: on the other ranks a full-size image that is zero
/// outside the box.
/// Reads a frame; with the seconds it took.
pub(super) fn timed_read(request: &ExtractRequest) -> (Result<(Inputs, PixelBox)>, f64) {
    let t0 = Instant::now();
    let read = read_frame(request);
    (read, t0.elapsed().as_secs_f64())
}

fn distribute_pixels(
    rc: &Comm,
    header: &[u8],
    read: Option<Inputs>,
    request: &ExtractRequest,
) -> Result<Inputs> {
    let h: FrameHeader = decode(header)?;
    let npix = h.npix();
    let (rows, cols) = (&h.rows, &h.cols);
    let full = rows.len() == h.image.nrows && cols.len() == h.image.ncols;
    if rc.rank() == 0 {
        let mut inputs = read.ok_or_else(|| Error::Internal("reader without inputs".into()))?;
        let image = &mut inputs.image;
        for buf in [&mut image.pix, &mut image.ivar] {
            match buf.as_slice_mut() {
                Some(all) if full => rc.broadcast_f32(0, all),
                _ => rc.broadcast_f32(0, &mut pack_box(buf.view(), rows, cols)),
            }
        }
        return Ok(inputs);
    }
    let mut image = h.image;
    image.path = request.input.clone();
    let shape = (image.nrows, image.ncols);
    let mut band = Vec::new();
    for buf in [&mut image.pix, &mut image.ivar] {
        // Zeroed pages come from the kernel untouched: only the box is ever written.
        *buf = Array2::zeros(shape);
        match buf.as_slice_mut() {
            Some(all) if full => rc.broadcast_f32(0, all),
            _ => {
                band.resize(npix, 0.0);
                rc.broadcast_f32(0, &mut band);
                unpack_box(&band, buf.view_mut(), rows, cols)?;
            }
        }
    }
    Ok(Inputs {
        psf: h.psf,
        image,
        heliocor: h.heliocor,
        traces: None,
    })
}
