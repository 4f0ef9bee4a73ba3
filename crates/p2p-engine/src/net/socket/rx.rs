//! The receive streams' work ([`RxTask`], run by the endpoint's I/O
//! workers while the stream has bytes): read a part header, match it to
//! the receive posted for it, check it against that receive
//! ([`check_part`]), then land its payload -- host memory read in place,
//! GPU memory through the stream's pinned staging, the part completed once
//! its copies have landed.

use std::net::TcpStream;
use std::os::fd::AsRawFd;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant};

use parking_lot::Mutex;

use super::book::{check_part, claim_part, part_done, Landing, RecvReq, RecvShared};
use super::reader::StreamReader;
use super::segs::{uniform_kind, window_copies, windows, Window};
use super::sockio::{linger_readable, poll_readable, read_err, readable_now, unread};
use super::stage::{Stager, StagingPool};
use super::wire::{PartHeader, HDR_LEN};
use super::{Lane, BATCH_PART, INLINE_MAX, NET, READ_BUF};
use crate::error::NetError;
use crate::gpu::staging::Ring;
use crate::memory::MemKind;
use crate::net::timing::{self, Spent};
use crate::net::MemRef;
use crate::workers::{Step, Task, Workers};

/// How long an I/O thread with spinning allowed waits for a receive to be
/// posted before it blocks in a read.
const IDLE_READ: Duration = Duration::from_millis(50);

/// Completes the parts whose copies have landed (handed back by the ring).
fn complete(shared: &RecvShared, done: &mut Vec<Landing>) {
    for l in done.drain(..) {
        part_done(shared, l);
    }
}

/// A small GPU part: read into the slot being filled, its copy to the
/// device queued, and its completion deferred until that copy has landed
/// (a slot's copies are waited for when the slot is needed again or the
/// stream goes quiet) -- so a run of KV blocks costs one wait per slot,
/// not one per block.
fn rx_gpu_small(
    r: &mut StreamReader,
    dst: &[MemRef],
    h: &PartHeader,
    ring: &mut Ring<Landing>,
    land: Landing,
    shared: &RecvShared,
    done: &mut Vec<Landing>,
) -> Result<(), NetError> {
    let len = h.len as usize;
    timing::mark(Spent::Other);
    tracing::trace!(seq = land.seq, "lat: rx slot wanted");
    ring.next_slot(len, done)?;
    tracing::trace!(seq = land.seq, "lat: rx slot had");
    complete(shared, done);
    timing::mark(Spent::Copies);
    r.read_exact(ring.fill_buf(len)).map_err(read_err)?;
    timing::mark(Spent::Socket);
    timing::bytes(len);
    super::trace_payload("rx", land.seq, h.off, ring.fill_buf(len));
    ring.fill(
        dst.iter().map(|m| (m.addr, m.len)),
        len,
        land.behind_copies(),
    );
    Ok(())
}

/// Reads device pieces through the slots, a slot per window, each
/// window's copy to the device queued as soon as it is read (so the next
/// window -- of this part or the next -- is read while it runs): the
/// device runs of a part of mixed memory, read whole (a part of device
/// memory alone is read as its bytes come: [`GpuIn`]).
fn rx_windows(
    r: &mut StreamReader,
    run: &[MemRef],
    ring: &mut Ring<Landing>,
    shared: &RecvShared,
    done: &mut Vec<Landing>,
) -> Result<(), NetError> {
    for (wlen, pieces) in windows(run, ring.slice()) {
        timing::mark(Spent::Other);
        let k = ring.next_slot(ring.slice(), done)?;
        complete(shared, done);
        timing::mark(Spent::Copies);
        r.read_exact(ring.slot_bytes_mut(k, wlen))
            .map_err(read_err)?;
        timing::mark(Spent::Socket);
        timing::bytes(wlen);
        queue_window(ring, k, &pieces, shared, done)?;
    }
    Ok(())
}

/// A window just read whole into slot `k`: its copies to the device
/// (`pieces`, as [`windows`] cut them) queued behind the slot's event;
/// then the parts whose copies have landed complete now, not when their
/// slot is next needed (a window of another message may come first).
fn queue_window(
    ring: &mut Ring<Landing>,
    k: usize,
    pieces: &[(u64, usize, usize)],
    shared: &RecvShared,
    done: &mut Vec<Landing>,
) -> Result<(), NetError> {
    // Pieces next to each other both in the GPU and in the slot are one
    // copy (a READ of many blocks into one local buffer made a 4 KiB copy
    // per block).
    let ops = window_copies(pieces, ring.slot_addr(k), false);
    // SAFETY: the slot holds the window just read and is not touched again
    // until its event completes (its previous one has: the slot was free);
    // the device ranges lie inside the posted buffer.
    unsafe { ring.queue_copies(k, &ops, true) }?;
    ring.seal(k)?;
    ring.reap(done)?;
    complete(shared, done);
    timing::mark(Spent::Driver);
    Ok(())
}

/// When a part's stall limit falls if a byte comes now (None: never).
fn stall_from_now(lane: &Lane) -> Option<Instant> {
    Some(lane.stall)
        .filter(|d| !d.is_zero())
        .map(|d| Instant::now() + d)
}

/// No byte came inside a part for a read timeout (`e`): past the stall
/// limit `until` the comm fails, naming the stall; otherwise the worker
/// goes back (`Some(Read::Waiting)`) once other work waits for one, or
/// the linger has passed since `since`.
fn no_byte(
    e: std::io::Error,
    until: Option<Instant>,
    since: Instant,
    lane: &Lane,
    workers: &Workers,
) -> Result<Option<Read>, NetError> {
    if until.is_some_and(|u| Instant::now() >= u) {
        return Err(read_err(e));
    }
    if workers.work_waiting() || since.elapsed() >= lane.linger {
        timing::mark(Spent::Waiting);
        return Ok(Some(Read::Waiting));
    }
    Ok(None)
}

/// A part in host memory, or in host and device memory together: host
/// runs read in place, device runs through the slots; done when this
/// returns.
fn rx_part(
    r: &mut StreamReader,
    dst: &[MemRef],
    stager: &mut Stager<Landing>,
    shared: &RecvShared,
    done: &mut Vec<Landing>,
) -> Result<(), NetError> {
    let mut staged = false;
    for run in dst.chunk_by(|a, b| a.kind == b.kind) {
        match run[0].kind {
            MemKind::Host => {
                let mut bufs: Vec<&mut [u8]> = run
                    .iter()
                    .map(|m| {
                        // SAFETY: the range lies inside the posted receive
                        // buffer, which the engine checked against a
                        // registered region held until completion; the
                        // pieces of one part never overlap.
                        unsafe { std::slice::from_raw_parts_mut(m.addr as *mut u8, m.len) }
                    })
                    .collect();
                timing::mark(Spent::Other);
                r.read_into(&mut bufs).map_err(read_err)?;
                timing::mark(Spent::Socket);
                timing::bytes(run.iter().map(|m| m.len).sum());
            }
            MemKind::Cuda(dev) => {
                // The staging may be remade for this GPU: finish the old.
                stager.flush(done)?;
                complete(shared, done);
                rx_windows(r, run, &mut stager.get(dev)?.ring, shared, done)?;
                staged = true;
            }
        }
    }
    if staged {
        stager.flush(done)?;
        complete(shared, done);
    }
    Ok(())
}

/// A receive thread: its stream, its staging, and the parts handed back
/// by the staging, to complete.
struct Rx {
    r: StreamReader,
    stager: Stager<Landing>,
    shared: Arc<RecvShared>,
    lane: Lane,
    peer: String,
    done: Vec<Landing>,
    /// The last part was large (read the next header alone).
    large_before: bool,
    /// A header read whose receive was not posted yet.
    pending: Option<PartHeader>,
    /// A host-memory part whose bytes are still coming ([`InPart`]).
    inpart: Option<InPart>,
    /// The pool it runs on (whether other work waits for a worker).
    workers: Workers,
}

/// A host-memory part read in place as its bytes come, over as many of
/// the task's runs as that takes: while its sender is slow, the stream
/// waits in the poller, not on a worker (with many peers sending at once
/// a blocked read per stream took a thread each: 109 threads on the
/// 2-core box for 64 peers).
struct InPart {
    land: Landing,
    /// The part's pieces of the receive's memory (host memory; none for a
    /// device-memory part); `at` is the first not full, `off` the bytes of
    /// it read.
    pieces: Vec<MemRef>,
    at: usize,
    off: usize,
    /// No byte by then fails the comm (the stall limit; None: never).
    until: Option<Instant>,
    /// A device-memory part: read through the staging instead of in
    /// place (then `pieces` is empty).
    gpu: Option<GpuIn>,
}

/// A device-memory part read through the staging slots as its bytes come,
/// a window at a time, each window's copy to the device queued once it is
/// read: while its sender is slow the stream waits in the poller with the
/// window half read, not on a worker (a GPU window was read whole, the
/// worker held for as long as the sender took, up to the stall limit).
struct GpuIn {
    dev: i32,
    /// The message offset of the window being read.
    off: u64,
    wins: Vec<Window>,
    /// The window being read, its slot once taken, and its bytes read.
    next: usize,
    slot: Option<usize>,
    got: usize,
}

impl InPart {
    /// Counts `n` bytes read into the pieces; `at` moves past every full
    /// one (empty ones too).
    fn advance(&mut self, mut n: usize) {
        while self.at < self.pieces.len() {
            let room = self.pieces[self.at].len - self.off;
            if n < room {
                self.off += n;
                return;
            }
            n -= room;
            self.at += 1;
            self.off = 0;
        }
    }
}

/// What reading a host part in place came to.
enum Read {
    /// Every byte is in: the part is done.
    Whole,
    /// Bytes are still to come: wait for the socket.
    Waiting,
}

impl Rx {
    /// The peer broke the protocol on this stream.
    fn protocol(&self, what: impl std::fmt::Display) -> NetError {
        NetError::Protocol {
            net: NET,
            reason: format!(
                "receive stream {} from {}: {what}",
                self.lane.index, self.peer
            ),
        }
    }

    /// Completes every part waiting on a copy. Where the copies cannot be
    /// waited for (the device failed), their parts are given up, so that
    /// their receives' failure can be reported.
    fn flush(&mut self) -> Result<(), NetError> {
        let r = self.stager.flush(&mut self.done);
        complete(&self.shared, &mut self.done);
        if r.is_err() {
            self.stager.forget();
        }
        r
    }

    /// The task ends: the comm failed (here with `e`, or elsewhere) or is
    /// closing. Copies queued into receives land first and their parts
    /// count, so that no receive is reported ended while one can still
    /// write into its memory.
    fn end(&mut self, e: Option<NetError>) -> Step {
        if let Some(e) = e {
            self.fail(e);
        }
        if let Err(e) = self.flush() {
            self.fail(e);
        }
        Step::Done
    }

    /// About to wait for the peer: first complete what has landed.
    fn settle(&mut self) -> Result<(), NetError> {
        timing::mark(Spent::Other);
        if self.stager.landing() && self.r.buffered() < HDR_LEN && !readable_now(&self.r.s) {
            tracing::trace!("lat: rx flush");
            let flushed = self.flush();
            timing::mark(Spent::Copies);
            flushed?;
        }
        Ok(())
    }

    /// Reads the next part header.
    fn read_header(&mut self) -> Result<PartHeader, NetError> {
        if self.r.buffered() == 0 {
            self.lane.spin_for_data(&self.r.s, &self.shared);
        }
        timing::mark(Spent::Waiting);
        self.r.spin = Duration::ZERO;
        let mut hdr = [0u8; HDR_LEN];
        // After a large part the next is likely large too: read just its
        // header, so that its payload is read in place rather than through
        // the buffer (a copy of up to 256 KiB of it per part).
        self.r
            .read_head(&mut hdr, self.large_before)
            .map_err(read_err)?;
        let h = PartHeader::decode(&hdr).map_err(|e| self.protocol(e))?;
        self.shared.moved_past(self.lane.index, h.seq);
        tracing::trace!(seq = h.seq, "lat: rx header");
        timing::mark(Spent::Waiting);
        timing::bytes(HDR_LEN);
        Ok(h)
    }

    /// Waits up to `limit` for the receive of message `seq` to be posted
    /// and takes it from this stream's book.
    fn find_recv(&mut self, seq: u64, limit: Duration) -> Result<Found, NetError> {
        let Rx {
            stager,
            shared,
            done,
            lane,
            ..
        } = self;
        let until = Instant::now() + limit;
        // Where spinning is allowed, the post is first watched for without
        // sleeping (once): a receive posted right after the last one
        // completed then finds this stream awake, not waiting for a
        // condition variable's wake-up (up to milliseconds on a VM).
        let mut spun = lane.spin.is_zero() || limit.is_zero();
        loop {
            let mut book = shared.book.lock();
            if shared.closing.load(Ordering::Acquire) {
                return Ok(Found::Closing);
            }
            if let Some(r) = book.due.get(&seq) {
                return Ok(Found::Recv(r.clone()));
            }
            if seq < shared.posted.load(Ordering::Acquire) {
                // Its receive is posted and has accepted all its parts
                // (entries are made before `posted` moves past them).
                drop(book);
                return Err(self.protocol(format_args!(
                    "a part of message {seq} after all its parts were accepted"
                )));
            }
            if stager.landing() {
                // The receive may be posted only once earlier ones complete.
                drop(book);
                tracing::trace!(seq, "lat: rx flush at find");
                let flushed = stager.flush(done);
                complete(shared, done);
                flushed?;
                continue;
            }
            let now = Instant::now();
            if now >= until {
                return Ok(Found::NotYet);
            }
            if !spun {
                // (Earlier messages' copies have landed: their receives
                // can complete, and the caller post this one.)
                spun = true;
                drop(book);
                let spin_until = now + lane.spin.min(until - now);
                // (As the machine allows: see `crate::spin`; refused, the
                // book is looked at once more before the wait.)
                crate::spin::spin_while(|| {
                    shared.posted.load(Ordering::Acquire) <= seq
                        && !shared.closing.load(Ordering::Acquire)
                        && Instant::now() < spin_until
                });
                continue;
            }
            shared
                .cv
                .wait_for(&mut book, (until - now).min(Duration::from_millis(100)));
        }
    }

    /// Lands a checked part's payload in its receive's memory: true once
    /// it is all there; false while a host part's bytes are still coming
    /// ([`InPart`]).
    fn land(&mut self, h: PartHeader, req: Arc<RecvReq>) -> Result<bool, NetError> {
        let Rx {
            r,
            stager,
            shared,
            lane,
            done,
            large_before,
            ..
        } = self;
        let len = h.len as usize;
        if h.spliced {
            r.credit.begin(len);
        }
        *large_before = len >= READ_BUF / 4;
        // A small message's first part: its caller waits on these bytes.
        r.spin = if h.off == 0 && len <= INLINE_MAX {
            lane.spin
        } else {
            Duration::ZERO
        };
        let dst = req.segs.pieces(h.off as usize, len);
        let land = Landing::new(req, h.seq, h.nparts as usize);
        match uniform_kind(&dst) {
            Some(MemKind::Cuda(d)) => {
                // Staging is remade for another GPU: finish the old one first.
                if stager.cur.as_ref().is_some_and(|st| st.ring.device() != d) {
                    stager.flush(done)?;
                    complete(shared, done);
                }
                let ring = &mut stager.get(d)?.ring;
                // A small part whose bytes are all here shares the slot
                // being filled with the parts around it (a read that
                // cannot block); any other is read a window at a time.
                let here = r.buffered() + unread(&*r.s) >= len;
                if here && len <= BATCH_PART.min(lane.slice) {
                    rx_gpu_small(r, &dst, &h, ring, land, shared, done)?;
                    return Ok(true);
                }
                let gpu = GpuIn {
                    dev: d,
                    off: h.off,
                    wins: windows(&dst, ring.slice()),
                    next: 0,
                    slot: None,
                    got: 0,
                };
                self.begin_part(land, Vec::new(), Some(gpu))
            }
            Some(MemKind::Host) if len > 0 => self.begin_part(land, dst, None),
            _ => {
                rx_part(r, &dst, stager, shared, done)?;
                part_done(shared, land);
                Ok(true)
            }
        }
    }

    /// Starts reading a part into `pieces` (host memory) or through the
    /// staging (`gpu`), as far as its bytes have come: true once it is
    /// whole ([`Rx::read_in_part`]).
    fn begin_part(
        &mut self,
        land: Landing,
        pieces: Vec<MemRef>,
        gpu: Option<GpuIn>,
    ) -> Result<bool, NetError> {
        self.inpart = Some(InPart {
            land,
            pieces,
            at: 0,
            off: 0,
            until: stall_from_now(&self.lane),
            gpu,
        });
        self.read_in_part().map(|r| matches!(r, Read::Whole))
    }

    /// Reads what has come of the host part in progress. Where its bytes
    /// stop, it waits in place a while (spinning as the lane allows, then
    /// up to the linger: a part's bytes usually follow each other closely)
    /// before handing the wait to the poller. No byte by the stall limit
    /// fails the comm, naming the stall.
    fn read_in_part(&mut self) -> Result<Read, NetError> {
        let since = Instant::now();
        if self.inpart.as_ref().is_some_and(|p| p.gpu.is_some()) {
            return self.read_gpu_in_part(since);
        }
        loop {
            let Some(p) = self.inpart.as_mut() else {
                return Ok(Read::Whole);
            };
            p.advance(0);
            if p.at == p.pieces.len() {
                let p = self.inpart.take().expect("checked above");
                part_done(&self.shared, p.land);
                return Ok(Read::Whole);
            }
            let mut bufs: Vec<&mut [u8]> = p.pieces[p.at..]
                .iter()
                .take(1024)
                .enumerate()
                .map(|(i, m)| {
                    let skip = if i == 0 { p.off } else { 0 };
                    // SAFETY: the range lies inside the posted receive
                    // buffer, which the engine checked against a
                    // registered region held until completion; the pieces
                    // of one part never overlap, and nothing else writes
                    // them while the part is read.
                    unsafe {
                        std::slice::from_raw_parts_mut((m.addr as *mut u8).add(skip), m.len - skip)
                    }
                })
                .collect();
            timing::mark(Spent::Other);
            // Blocks at most the socket's read timeout (`LINGER_SLICE`),
            // after which the worker goes back if other work waits.
            let got = crate::workers::lingering(|| self.r.read_some(&mut bufs));
            drop(bufs);
            match got {
                Ok(n) => {
                    timing::mark(Spent::Socket);
                    timing::bytes(n);
                    let until = stall_from_now(&self.lane);
                    let p = self.inpart.as_mut().expect("checked above");
                    p.advance(n);
                    p.until = until;
                }
                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {
                    let until = self.inpart.as_ref().and_then(|p| p.until);
                    if let Some(w) = no_byte(e, until, since, &self.lane, &self.workers)? {
                        return Ok(w);
                    }
                }
                Err(e) => return Err(read_err(e)),
            }
        }
    }

    /// As [`Rx::read_in_part`], for a device-memory part ([`GpuIn`]):
    /// reads its windows into the slots, queuing each one's copy once it
    /// is whole; the part completes when its last copy has landed (parked
    /// behind it on the ring). `since`: when this stretch began.
    fn read_gpu_in_part(&mut self, since: Instant) -> Result<Read, NetError> {
        let Rx {
            r,
            stager,
            shared,
            lane,
            done,
            inpart,
            workers,
            ..
        } = self;
        let Some(dev) = inpart.as_ref().and_then(|p| p.gpu.as_ref()).map(|g| g.dev) else {
            return Ok(Read::Whole);
        };
        let ring = &mut stager.get(dev)?.ring;
        loop {
            let Some(p) = inpart.as_mut() else {
                return Ok(Read::Whole);
            };
            let Some(g) = p.gpu.as_mut() else {
                return Ok(Read::Whole);
            };
            if g.next == g.wins.len() {
                let p = inpart.take().expect("checked above");
                if let Some(land) = ring.park(p.land.behind_copies()) {
                    // Its last copy has landed already (reaped after its
                    // window).
                    part_done(shared, land);
                }
                return Ok(Read::Whole);
            }
            let k = match g.slot {
                Some(k) => k,
                None => {
                    timing::mark(Spent::Other);
                    let k = ring.next_slot(ring.slice(), done)?;
                    complete(shared, done);
                    timing::mark(Spent::Copies);
                    g.slot = Some(k);
                    k
                }
            };
            let wlen = g.wins[g.next].0;
            let buf = &mut ring.slot_bytes_mut(k, wlen)[g.got..];
            timing::mark(Spent::Other);
            // Blocks at most the socket's read timeout (`LINGER_SLICE`).
            let got = crate::workers::lingering(|| r.read_some(&mut [buf]));
            match got {
                Ok(n) => {
                    timing::mark(Spent::Socket);
                    timing::bytes(n);
                    p.until = stall_from_now(lane);
                    g.got += n;
                    if g.got == wlen {
                        let seq = p.land.seq;
                        super::trace_payload("rx", seq, g.off, ring.slot_bytes(k, wlen));
                        g.off += wlen as u64;
                        queue_window(ring, k, &g.wins[g.next].1, shared, done)?;
                        g.next += 1;
                        g.slot = None;
                        g.got = 0;
                    }
                }
                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {
                    if let Some(w) = no_byte(e, p.until, since, lane, workers)? {
                        return Ok(w);
                    }
                }
                Err(e) => return Err(read_err(e)),
            }
        }
    }

    /// The staging goes back to the pool (see [`Stager::give_back`]),
    /// unless a device-memory part is half read into one of its slots.
    fn give_back(&mut self) {
        if self.inpart.as_ref().is_none_or(|p| p.gpu.is_none()) {
            self.stager.give_back();
        }
    }

    /// Goes on with the host part in progress (its receive counted as
    /// landing meanwhile, as in [`Rx::step`]); a comm closed meanwhile
    /// drops it.
    fn resume(&mut self) -> Result<Flow, NetError> {
        let req = match &self.inpart {
            Some(p) => p.land.req.clone(),
            None => return Ok(Flow::Part),
        };
        req.landing.fetch_add(1, Ordering::SeqCst);
        let r = if self.shared.closing.load(Ordering::SeqCst) {
            self.inpart = None;
            Ok(Flow::Closing)
        } else {
            self.read_in_part().map(|r| match r {
                Read::Whole => Flow::Part,
                Read::Waiting => Flow::InPart,
            })
        };
        req.landing.fetch_sub(1, Ordering::SeqCst);
        if self.shared.closing.load(Ordering::SeqCst) {
            (self.shared.waker)();
        }
        r
    }

    /// Gives the worker back while a part's bytes are still coming: the
    /// parts whose copies have landed complete first and the staging goes
    /// back to the pool, as when the stream goes quiet; the task waits for
    /// the socket (and the stall limit).
    fn wait_in_part(&mut self, fd: std::os::fd::RawFd) -> Step {
        if let Err(e) = self.flush() {
            // (Its copies given up: nothing is left to wait for.)
            self.fail(e);
            return Step::Done;
        }
        self.give_back();
        match self.inpart.as_ref().and_then(|p| p.until) {
            Some(u) => Step::ReadableUntil(fd, u),
            None => Step::Readable(fd),
        }
    }

    /// One part: read header → match → check → land. A header whose
    /// receive is not posted within `wait` is kept for the next call.
    fn step(&mut self, wait: Duration) -> Result<Flow, NetError> {
        let h = match self.pending.take() {
            Some(h) => h,
            None => {
                self.settle()?;
                self.read_header()?
            }
        };
        // A small part whose receive is not posted yet is kept without
        // holding the worker: the posting thread lands it itself
        // ([`RxHandle::land_held`]), with no wake-up on the way.
        let wait = if postable(&h) { Duration::ZERO } else { wait };
        let req = match self.find_recv(h.seq, wait)? {
            Found::Recv(req) => req,
            Found::Closing => return Ok(Flow::Closing),
            Found::NotYet => {
                self.await_post(h)?;
                return Ok(Flow::AwaitPost);
            }
        };
        timing::mark(Spent::Waiting);
        let checked = check_part(&h, &req.segs, &mut req.shape.lock());
        checked.map_err(|f| self.protocol(f))?;
        // Counted while its bytes are written into the receive's memory
        // (see `RecvReq::landing`): counted first, then the comm's state
        // looked at, so a failure reported by `test` and a landing never
        // overlap.
        req.landing.fetch_add(1, Ordering::SeqCst);
        let landed = if self.shared.closing.load(Ordering::SeqCst) {
            Ok(Flow::Closing)
        } else {
            self.claim(&h, &req)
                .and_then(|()| self.land(h, req.clone()))
                .map(|whole| if whole { Flow::Part } else { Flow::InPart })
        };
        req.landing.fetch_sub(1, Ordering::SeqCst);
        if self.shared.closing.load(Ordering::SeqCst) {
            (self.shared.waker)();
        }
        landed
    }

    /// Accepts checked part `h` of `req` ([`claim_part`]); the receive
    /// leaves the book once all its parts are accepted.
    fn claim(&self, h: &PartHeader, req: &Arc<RecvReq>) -> Result<(), NetError> {
        let (streams, min_part) = self.shared.split;
        let last = claim_part(h, &req.claimed, streams, min_part).map_err(|f| self.protocol(f))?;
        if last {
            self.shared.book.lock().due.remove(&h.seq);
        }
        Ok(())
    }

    /// Nothing to read or land: every landed part completed, no bytes
    /// buffered or waiting.
    fn quiet(&mut self) -> Result<bool, NetError> {
        self.settle()?;
        // (Whether bytes wait in the socket is the wait's own first look.)
        Ok(self.pending.is_none()
            && self.inpart.is_none()
            && self.r.buffered() == 0
            && !self.stager.landing())
    }

    /// The comm's first failure, seen by every receive.
    fn fail(&self, e: NetError) {
        if !self.shared.closing.load(Ordering::Acquire) {
            tracing::debug!("socket net: receive stream from {} failed: {e}", self.peer);
        }
        self.shared.fail(e);
    }

    /// Keeps header `h`, whose receive is not posted yet, until it is: the
    /// stream reads nothing more meanwhile. Fails where every stream has
    /// now gone past a posted receive that still lacks parts (none can
    /// come for it: without this it would wait for ever, the peer's close
    /// unseen by streams that read nothing).
    fn await_post(&mut self, h: PartHeader) -> Result<(), NetError> {
        self.pending = Some(h);
        match self.shared.stranded(0) {
            Some(e) => Err(e),
            None => Ok(()),
        }
    }

    /// The header kept of message `seq`'s part, if that part is small and
    /// all its bytes have arrived (what the posting thread may land).
    fn held_part(&self, seq: u64) -> Option<PartHeader> {
        self.pending
            .filter(|h| h.seq == seq && postable(h))
            .filter(|h| self.r.buffered() + unread(&self.r.s) >= h.len as usize)
    }

    /// On the posting thread, after it landed a part: reads the next
    /// part's header if all of it is here, and keeps it for its receive
    /// as the task would (true). False: no whole header is here, or its
    /// receive is posted already -- the task has work (reading, landing).
    fn read_ahead(&mut self) -> Result<bool, NetError> {
        if self.pending.is_some() || self.r.buffered() + unread(&self.r.s) < HDR_LEN {
            return Ok(false);
        }
        let h = self.read_header()?;
        let posted = h.seq < self.shared.posted.load(Ordering::Acquire);
        if posted {
            self.pending = Some(h);
        } else {
            self.await_post(h)?;
        }
        Ok(!posted)
    }
}

/// What [`Rx::find_recv`] found.
enum Found {
    Recv(Arc<RecvReq>),
    /// Not posted yet.
    NotYet,
    /// The comm is closing.
    Closing,
}

/// What [`RxHandle::land_held`] did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Landed {
    /// Nothing: the part is left to the stream's task.
    No,
    /// Landed the part (or failed the comm trying); `kick`: the task has
    /// work now (bytes to read, or a receive posted for the header kept).
    Here { kick: bool },
}

/// What one [`Rx::step`] did.
enum Flow {
    /// Landed a part.
    Part,
    /// A host part's bytes are still coming: wait for the socket.
    InPart,
    /// Read a header whose receive is not posted yet (kept).
    AwaitPost,
    /// The comm is closing.
    Closing,
}

/// A part the posting thread may land (within its [`POSTER_BUDGET`]): its
/// header read before its receive was posted, its payload not lent by the
/// sender.
fn postable(h: &PartHeader) -> bool {
    !h.spliced && h.len as usize <= POSTER_BUDGET
}

/// Bytes the posting thread lands of one receive whose parts arrived
/// before it was posted (the rest is left to the streams' tasks). A part's
/// landing there costs its read and its copy to the device, tens of µs;
/// a worker's wake-up cost 0.2-6 ms on a 2 × H100 VM (UCCL's benchmark, a
/// sender running ahead of blocking receives of 256 KB and 1 MB, whose
/// rows read 0.1-2 GB/s).
pub(super) const POSTER_BUDGET: usize = 1 << 20;

/// A receive stream's work on the I/O workers: it reads and lands parts
/// while the stream has bytes, and gives its worker back (waiting for the
/// stream to become readable) once none has come for `linger`. Its state
/// is shared with the posting thread ([`RxHandle`]), which takes it only
/// while the task is not running.
pub(super) struct RxTask {
    rx: Arc<Mutex<Rx>>,
    linger: Duration,
}

/// The posting thread's hold on one receive stream (see
/// [`RxHandle::land_held`]).
pub(super) struct RxHandle(Arc<Mutex<Rx>>);

impl RxTask {
    pub(super) fn new(
        s: Arc<TcpStream>,
        shared: Arc<RecvShared>,
        lane: Lane,
        linger: Duration,
        staging: Arc<StagingPool<Landing>>,
        workers: Workers,
    ) -> (Self, RxHandle) {
        let peer = s.peer_addr().map(|a| a.to_string()).unwrap_or_default();
        let rx = Arc::new(Mutex::new(Rx {
            r: StreamReader::new(s, lane.stall),
            stager: Stager::pooled(staging, lane.slice, lane.depth),
            shared,
            lane,
            peer,
            done: Vec::new(),
            large_before: false,
            pending: None,
            inpart: None,
            workers,
        }));
        (
            RxTask {
                rx: rx.clone(),
                linger,
            },
            RxHandle(rx),
        )
    }
}

impl RxHandle {
    /// Lands the part of message `seq` whose header this stream's task
    /// read before the receive was posted (the task went idle keeping it),
    /// on the calling -- posting -- thread, if all its bytes have arrived
    /// and it fits in `budget` (the bytes the poster still lands for this
    /// receive, [`POSTER_BUDGET`]; what it lands is taken off): the
    /// receive then completes without an I/O worker being woken for it (a
    /// wake-up cost 60-110 µs per message on 2 × H100 when a sender runs
    /// ahead of blocking receives, and up to milliseconds on a busy VM).
    /// The next part's header, where it is here too, is read: another part
    /// of the same message, whole, is landed the same way (a message of
    /// several parts sent on one stream, as a sender with no CPU idle
    /// writes them, had its second part handed to the task: a wake-up
    /// that waited behind PyTorch's spinning OpenMP team); a later
    /// message's is kept, so that a run of messages sent ahead of their
    /// receives lands on the posting thread one after another with no
    /// worker woken at all. With `read` (no CPU idle, and a receive the
    /// poster may land whole) the first header too is read here when the
    /// task has not read it (it waits for a CPU). (On one H200 in UCCL's
    /// shape, 256 KB read 10-13 % faster with it on two machines and
    /// 14-16 % slower on a third.) Never waits: not for the task, nor for
    /// bytes.
    pub(super) fn land_held(&self, seq: u64, budget: &mut usize, read: bool) -> Landed {
        let Some(mut rx) = self.0.try_lock() else {
            return Landed::No; // the task is running: it finds the receive
        };
        // The application's GPU context is put back after the copies.
        let mut ctx = None;
        let mut landed = false;
        // Stopping before a part: whatever else there is, the task does
        // (kicked once something was landed here).
        let left = |landed: bool| {
            if landed {
                Landed::Here { kick: true }
            } else {
                Landed::No
            }
        };
        // With `read`, a header the task has not read yet (it waits for a
        // CPU) is read here when all of it has arrived. A header so read of
        // a posted receive, and not landed here, is the task's to act on:
        // it is kicked (one of a receive not posted yet is kept, as the
        // task keeps it).
        let mut read_here = false;
        let outcome = loop {
            if read && rx.pending.is_none() && rx.inpart.is_none() {
                match rx.read_ahead() {
                    Ok(kept) => read_here = rx.pending.is_some() && !kept,
                    Err(e) => break Err(e),
                }
            }
            // Another part's header is here, its bytes still coming, or too
            // many for the poster, or the comm closing: the task goes on.
            let Some(h) = rx.held_part(seq).filter(|h| {
                h.len as usize <= *budget && !rx.shared.closing.load(Ordering::Acquire)
            }) else {
                break Ok(left(landed || read_here));
            };
            *budget -= h.len as usize;
            read_here = false;
            tracing::trace!(seq, stream = rx.lane.index, "lat: poster lands");
            if ctx.is_none() {
                ctx = Some(crate::gpu::ContextGuard::save());
                rx.stager.bind_here();
                tracing::trace!(seq, "lat: poster bound");
            }
            // A part's copy to the device runs while the next part is read.
            let next = rx.step(Duration::ZERO).and_then(|flow| match flow {
                Flow::Part => {
                    tracing::trace!(seq, "lat: rx landed by the poster");
                    // Kept for a receive not posted yet: nothing for the
                    // task. Otherwise another part of this message may be
                    // here whole (the loop looks), or the task has work.
                    rx.read_ahead()
                        .map(|kept| kept.then_some(Landed::Here { kick: false }))
                }
                // Bytes the poster was told were here are not all there:
                // the task reads the rest.
                Flow::InPart => Ok(Some(Landed::Here { kick: true })),
                Flow::AwaitPost | Flow::Closing => Ok(Some(left(landed || read_here))),
            });
            match next {
                Ok(Some(done)) => break Ok(done),
                Ok(None) => landed = true,
                Err(e) => break Err(e),
            }
        };
        // Where a part was landed, its copies to the device (if any) are
        // waited for here: the task is idle and would not complete them.
        let outcome = if ctx.is_some() {
            let flushed = rx.flush();
            rx.give_back();
            outcome.and_then(|landed| flushed.map(|()| landed))
        } else {
            outcome
        };
        match outcome {
            Ok(landed) => landed,
            Err(e) => {
                rx.fail(e);
                Landed::Here { kick: true }
            }
        }
    }

    /// The size of message `seq` as the header this stream's task keeps
    /// for it says, if it keeps one (and is not running).
    pub(super) fn held_total(&self, seq: u64) -> Option<usize> {
        let rx = self.0.try_lock()?;
        let h = rx.pending.filter(|h| h.seq == seq)?;
        usize::try_from(h.total).ok()
    }

    /// Bytes of this stream in its buffer or waiting in its socket (tests).
    #[cfg(test)]
    pub(super) fn bytes_waiting(&self) -> usize {
        let rx = self.0.lock();
        rx.r.buffered() + unread(&rx.r.s)
    }

    /// The stream's state in words (tests): `busy` while its task runs.
    #[cfg(test)]
    pub(super) fn describe(&self) -> String {
        let Some(rx) = self.0.try_lock() else {
            return "[busy]".into();
        };
        format!(
            "[stream {}: past {:?}, pending {:?}, in part {:?}, copies landing {}, bytes here {}]",
            rx.lane.index,
            rx.shared.past_of(rx.lane.index),
            rx.pending.map(|h| (h.seq, h.off, h.len, h.total)),
            rx.inpart
                .as_ref()
                .map(|p| (p.land.seq, p.gpu.is_some(), p.at, p.off)),
            rx.stager.landing(),
            rx.r.buffered() + unread(&rx.r.s)
        )
    }

    /// Whether the task is idle keeping message `seq`'s header, all the
    /// part's bytes arrived (what [`RxHandle::land_held`] lands).
    pub(super) fn holds(&self, seq: u64) -> bool {
        self.0
            .try_lock()
            .is_some_and(|rx| rx.held_part(seq).is_some())
    }

    /// Whether the task may be waiting for receive `seq` to be posted: it
    /// is idle keeping that message's header, or running (a kick costs it
    /// nothing).
    pub(super) fn awaits(&self, seq: u64) -> bool {
        self.0
            .try_lock()
            .is_none_or(|rx| rx.pending.is_some_and(|h| h.seq == seq))
    }
}

impl Task for RxTask {
    fn run(&mut self) -> Step {
        let rx = &mut *self.rx.lock();
        let fd = rx.r.s.as_raw_fd();
        tracing::trace!(stream = rx.lane.index, "lat: rx task runs");
        rx.stager.bind_here();
        let _account = timing::start(|| {
            let at =
                rx.r.s
                    .local_addr()
                    .map(|a| a.to_string())
                    .unwrap_or_default();
            format!("rx stream {} at {at} from {}", rx.lane.index, rx.peer)
        });
        loop {
            if rx.inpart.is_some() {
                match rx.resume() {
                    Ok(Flow::InPart) => return rx.wait_in_part(fd),
                    Ok(Flow::Closing) => return rx.end(None),
                    Ok(_) => {}
                    Err(e) => return rx.end(Some(e)),
                }
            }
            match rx.quiet() {
                Ok(true) if !rx.shared.closing.load(Ordering::Acquire) => {
                    // Its staging goes back to the pool while it waits
                    // (every copy has landed): a stream that waits holds
                    // none, so a few rings serve many streams in turn (a
                    // ring made anew cost 3-5 ms on H100).
                    rx.stager.give_back();
                    // Spin or wait as a thread of its own would (see
                    // `spin_for_data`), then linger before giving the
                    // worker back.
                    rx.lane.spin_for_data(&rx.r.s, &rx.shared);
                    rx.watch_while_a_caller_waits();
                    if !linger_readable(&*rx.r.s, self.linger, &rx.workers) {
                        return Step::Readable(fd);
                    }
                }
                Ok(_) => {}
                Err(e) => return rx.end(Some(e)),
            }
            match rx.step(self.linger) {
                Ok(Flow::Part) => {}
                Ok(Flow::InPart) => return rx.wait_in_part(fd),
                // Woken by the receive's post (or the comm's close); a
                // small part may be landed by the poster meanwhile.
                Ok(Flow::AwaitPost) => {
                    rx.stager.give_back();
                    return Step::Idle;
                }
                Ok(Flow::Closing) => return rx.end(None),
                Err(e) => return rx.end(Some(e)),
            }
        }
    }
}

impl Rx {
    /// While a caller waits on a transfer ([`Workers::caller_waiting`])
    /// and this comm has a receive due, watches the socket rather than
    /// sleeping in `poll`: the next part is read as it comes, not after
    /// this thread's wake-up (0.7-3.6 ms measured on a 2 x H100 VM, which
    /// a 10-message row of UCCL's benchmark cannot absorb).
    fn watch_while_a_caller_waits(&self) {
        if !self.workers.caller_waiting() || self.shared.book.lock().due.is_empty() {
            return;
        }
        // (As the machine allows: see `crate::spin`.)
        crate::spin::spin_while(|| {
            self.workers.caller_waiting()
                && !readable_now(&self.r.s)
                && !self.shared.closing.load(Ordering::Acquire)
        });
    }
}

impl Lane {
    /// With spinning allowed, keeps this thread out of a blocking read
    /// (whose wake-up, 25-65 µs on a busy VM, measured on h200-x2, was the
    /// largest item of a small message's trip): with no receive posted
    /// that has a part on this stream it waits for one; once a receive's
    /// first part is due here it spins (bounded) for the bytes. Only the
    /// first part's stream spins: eight spinning readers per comm, beside
    /// the senders' threads, took more cores than h200-x2 has (1 MiB
    /// one-way p50 went from 200-240 to 285-325 µs). Later parts of large
    /// messages, idle streams and bytes already there go to the read.
    fn spin_for_data(&self, s: &TcpStream, shared: &RecvShared) {
        if self.spin.is_zero() {
            return;
        }
        let idle_since = Instant::now();
        let mut book = shared.book.lock();
        loop {
            if book.first_due_on(self.index, shared.streams.load(Ordering::Acquire)) {
                break;
            }
            if !book.due.is_empty()
                || readable_now(s)
                || shared.closing.load(Ordering::Acquire)
                || idle_since.elapsed() > IDLE_READ
            {
                return;
            }
            shared.cv.wait_for(&mut book, Duration::from_micros(100));
        }
        drop(book);
        poll_readable(s, self.spin);
    }
}
