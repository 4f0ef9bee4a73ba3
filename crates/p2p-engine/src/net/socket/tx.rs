//! The send streams' work ([`TxTask`], run by the endpoint's I/O
//! workers while the stream has parts to write): writing the parts queued
//! to it -- host memory straight from the user's buffer (small parts batched into
//! one system call), GPU memory through the stream's pinned staging, the
//! copies of the next windows running while this one is written.

use std::net::TcpStream;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use crossbeam_channel::Receiver;
use parking_lot::Mutex;

use super::segs::{small_gpu_part, uniform_kind, window_copies, windows, Window};
use super::sockio::{
    linger_readable, linger_writable, wait_readable_unless, wait_writable_unless, write_all_slices,
    write_err, write_slices_now, LINGER_SLICE,
};
use super::splice::{LendAt, Splicer};
use super::stage::{Lend, Stager, Staging, StagingPool};
use super::wire::{PartHeader, HDR_LEN};
use super::{Lane, BATCH_BYTES, BATCH_OPS, BATCH_PART, NET};
use crate::error::NetError;
use crate::memory::MemKind;
use crate::net::timing::{self, Spent};
use crate::net::{MemRef, Waker};
use crate::workers::{Step, Task, Workers};

pub(super) struct SendReq {
    pub(super) parts_left: AtomicUsize,
    pub(super) size: usize,
    pub(super) error: Mutex<Option<NetError>>,
}

/// Where a send stream's parts come from: its own queue, the comm's
/// spill (parts given to no stream yet), and the count of bytes it holds
/// (see [`TxOp::weight`]).
pub(super) struct TxQueues {
    pub(super) own: Receiver<TxOp>,
    pub(super) spill: Receiver<TxOp>,
    pub(super) queued: Arc<AtomicUsize>,
}

pub(super) struct TxOp {
    pub(super) head: PartHeader,
    /// `head`, encoded.
    pub(super) hdr: [u8; HDR_LEN],
    /// The part's memory: pieces of the message's segments.
    pub(super) pieces: Vec<MemRef>,
    /// Payload bytes.
    pub(super) len: usize,
    pub(super) req: Arc<SendReq>,
    /// Bytes of header + payload already written by the posting thread.
    pub(super) skip: usize,
    /// The payload itself, when the posting thread already copied it out of
    /// the GPU (then `pieces` is empty).
    pub(super) owned: Option<Vec<u8>>,
}

impl TxOp {
    /// What the op weighs in its stream's queue (header and payload
    /// bytes; never 0, so a queued op always makes its stream busy).
    pub(super) fn weight(&self) -> usize {
        HDR_LEN + self.len
    }
}

pub(super) struct SendShared {
    pub(super) failed: Mutex<Option<NetError>>,
    pub(super) waker: Waker,
}

/// Host memory as bytes.
fn host_slice(m: &MemRef) -> &[u8] {
    if m.len == 0 {
        return &[];
    }
    // SAFETY: the engine checked `[addr, addr+len)` against a registered
    // region that stays registered until this request completes.
    unsafe { std::slice::from_raw_parts(m.addr as *const u8, m.len) }
}

/// The header and payload of a host-memory op, less the first `skip`
/// bytes (already written by the posting thread).
pub(super) fn host_slices(op: &TxOp) -> Vec<&[u8]> {
    let mut v: Vec<&[u8]> = Vec::with_capacity(op.pieces.len() + 1);
    v.push(&op.hdr);
    match &op.owned {
        Some(b) => v.push(b),
        None => v.extend(op.pieces.iter().map(host_slice)),
    }
    let mut skip = op.skip;
    let mut first = 0;
    while skip > 0 && first < v.len() {
        if skip >= v[first].len() {
            skip -= v[first].len();
            first += 1;
        } else {
            v[first] = &v[first][skip..];
            skip = 0;
        }
    }
    v.split_off(first)
}

/// Whether an op's payload is host memory only.
pub(super) fn host_only(op: &TxOp) -> bool {
    op.owned.is_some() || uniform_kind(&op.pieces) == Some(MemKind::Host)
}

/// Host-memory parts being written without blocking (one large part, or a
/// batch of small ones), and how many of their bytes are out: a stream
/// whose socket is full waits for room in the poller, holding no thread
/// (blocked in its writes, streams sending to 64 peers at once took the
/// 2-core machine's pool to 17-19 workers in the first rounds).
struct HostWrite {
    ops: Vec<TxOp>,
    done: usize,
}

impl HostWrite {
    /// Writes what is left without blocking; when the socket fills, waits
    /// for room for up to `linger` while no other work waits for a worker
    /// (a send's bytes usually drain quickly), then says so: Ok(false).
    fn write(
        &mut self,
        s: &TcpStream,
        linger: Duration,
        workers: &Workers,
    ) -> Result<bool, NetError> {
        let slices: Vec<&[u8]> = self.ops.iter().flat_map(host_slices).collect();
        let start = Instant::now();
        loop {
            if write_slices_now(s, &slices, &mut self.done).map_err(write_err)? {
                return Ok(true);
            }
            let left = linger.saturating_sub(start.elapsed());
            if !linger_writable(s, left, workers) {
                return Ok(false);
            }
        }
    }
}

fn tx_part(s: &TcpStream, op: &TxOp, stager: &mut Stager<()>) -> Result<(), NetError> {
    write_all_slices(s, &[&op.hdr]).map_err(write_err)?;
    for run in op.pieces.chunk_by(|a, b| a.kind == b.kind) {
        match run[0].kind {
            MemKind::Host => {
                let v: Vec<&[u8]> = run.iter().map(host_slice).collect();
                write_all_slices(s, &v).map_err(write_err)?;
            }
            MemKind::Cuda(dev) => {
                let (st, mut sp) = stager.lending(dev)?;
                let mut pipe = TxPipe::default();
                pipe.push(Vec::new(), windows(run, st.ring.slice()), false);
                while !pipe.is_empty() {
                    // A part of mixed memory (rare) still blocks its
                    // worker while its socket is full.
                    let forever = Duration::from_secs(u32::MAX.into());
                    match pipe.write_next(s, st, sp.as_deref_mut(), false)? {
                        Advance::Wrote(_) => true,
                        Advance::Full => wait_writable_unless(s, forever, || false),
                        Advance::Credit => wait_readable_unless(s, forever, || false),
                    };
                }
            }
        }
    }
    Ok(())
}

/// One part in a [`TxPipe`]: its windows and the ops it completes. One op:
/// a large part, its header before its first window. Several: small parts
/// sharing one window (a batch), each header before its own bytes. None:
/// a piece of a part the caller writes the rest of.
struct PipePart {
    ops: Vec<TxOp>,
    wins: Vec<Window>,
    /// Whether its windows may be lent to the socket (not a batch's).
    lend: bool,
    issued: usize,
    written: usize,
}

impl PipePart {
    /// A batch that small parts may still join: its copy not yet queued.
    fn open_batch(&self) -> bool {
        !self.lend && self.issued == 0 && !self.ops.is_empty() && self.ops.len() < BATCH_OPS
    }
}

/// Device-memory windows written through the pinned slots in order: the
/// copies into the slots run up to `depth` windows ahead of the writes,
/// across part boundaries -- the next part's first windows are copied
/// while this part's last ones are written. (Part by part, a 1 MiB part
/// was one window: its copy, the wait for it and its write ran one after
/// the other on each stream.)
#[derive(Default)]
struct TxPipe {
    parts: std::collections::VecDeque<PipePart>,
    /// Windows whose copies were queued, and windows written, all parts.
    issued: usize,
    written: usize,
    /// How far the oldest window's write (or lend) has come: the socket
    /// filled in the middle of it.
    out: WindowOut,
}

/// The progress of a window's write: bytes of its slices written (a lent
/// window's header), and of its lend.
#[derive(Default)]
struct WindowOut {
    done: usize,
    lend: LendAt,
}

/// What [`TxPipe::write_next`] did.
enum Advance {
    /// Wrote a window (or had none to write); with the part it finished.
    Wrote(Option<PipePart>),
    /// The socket is full in the middle of a window: run again once it
    /// has room.
    Full,
    /// Every window known is written and the next slot is still lent:
    /// run again once the receiver's credit comes (the socket is
    /// readable).
    Credit,
}

impl TxPipe {
    fn push(&mut self, ops: Vec<TxOp>, wins: Vec<Window>, lend: bool) {
        self.parts.push_back(PipePart {
            ops,
            wins,
            lend,
            issued: 0,
            written: 0,
        });
    }

    /// Adds a whole part of the stream's GPU: a large one on its own
    /// (lendable windows); a small one to the open batch at the tail if it
    /// fits in its window, else as a new batch.
    fn add(&mut self, op: TxOp, slice: usize) {
        if gpu_batchable(&op, slice).is_none() {
            let wins = windows(&op.pieces, slice);
            return self.push(vec![op], wins, true);
        }
        if let Some(t) = self.parts.back_mut().filter(|t| t.open_batch()) {
            if t.wins[0].0 + op.len <= slice {
                let w = &mut t.wins[0];
                for m in &op.pieces {
                    w.1.push((m.addr, w.0, m.len));
                    w.0 += m.len;
                }
                t.ops.push(op);
                return;
            }
        }
        let wins = windows(&op.pieces, slice);
        self.push(vec![op], wins, false);
    }

    /// Whether the pipe takes in another part: while it knows fewer
    /// unwritten windows than slots (see [`TxPipe::wants_more`]), and one
    /// more while the batch at its tail may still grow.
    fn takes_more(&self, depth: usize) -> bool {
        let tail_open = self.parts.back().is_some_and(|t| t.open_batch());
        self.wants_more(depth) || (tail_open && self.wants_more(depth + 1))
    }

    fn is_empty(&self) -> bool {
        self.parts.is_empty()
    }

    /// Whether the pipe knows fewer windows not yet written than it has
    /// slots: the parts queued behind are then taken in, so that their
    /// copies can run ahead. (It used to take one only once every known
    /// window's copy was queued -- which happens inside `write_next`, after
    /// the taking: with one window per part, the usual 1 MiB part, each
    /// copy was queued, waited for and written one at a time; measured on
    /// h200-x2, every window's copy still running when it was due.)
    fn wants_more(&self, depth: usize) -> bool {
        self.parts
            .iter()
            .map(|p| p.wins.len() - p.written)
            .sum::<usize>()
            < depth
    }

    /// Queues the copies of the next windows into the free slots. With
    /// `sp`, a slot still lent to the socket is free once the receiver has
    /// credited it (the credits that have come are taken; none is waited
    /// for: see [`Advance::Credit`]).
    fn top_up(
        &mut self,
        st: &mut Staging<()>,
        mut sp: Option<&mut Splicer>,
    ) -> Result<(), NetError> {
        let depth = st.ring.depth();
        while self.issued - self.written < depth {
            let Some(p) = self.parts.iter_mut().find(|p| p.issued < p.wins.len()) else {
                st.stats.stop_dry += 1;
                break;
            };
            let k = self.issued % depth;
            if !st.unlent(k, sp.as_deref_mut())? {
                st.stats.stop_lent += 1;
                break;
            }
            let slot = st.ring.slot_addr(k);
            let ops = window_copies(&p.wins[p.issued].1, slot, true);
            // SAFETY: the window fits the slot, whose previous window was
            // written once its copies had landed (so nothing reads it); the
            // device ranges were checked by the engine.
            unsafe { st.ring.queue_copies(k, &ops, p.lend) }?;
            st.ring.seal(k)?;
            p.issued += 1;
            self.issued += 1;
        }
        Ok(())
    }

    /// Tops the copies up, then writes the oldest window once its copy has
    /// landed (with `lend`: lends it to the socket through `sp`, its part's
    /// header marked spliced), without blocking on the socket: where it
    /// fills, the window's progress is kept for the next call. `sp` is the
    /// stream's splicer, if any, whose credits free lent slots.
    ///
    /// The wait for a window's copy does block: it is the GPU's copy of at
    /// most one slot, tens of microseconds, which no peer can stretch (a
    /// hand-off through the poller costs more).
    fn write_next(
        &mut self,
        s: &TcpStream,
        st: &mut Staging<()>,
        mut sp: Option<&mut Splicer>,
        lend: bool,
    ) -> Result<Advance, NetError> {
        timing::mark(Spent::Other);
        self.top_up(st, sp.as_deref_mut())?;
        timing::mark(Spent::Driver);
        let depth = st.ring.depth();
        let Some(p) = self.parts.front_mut() else {
            return Ok(Advance::Wrote(None));
        };
        if self.issued == self.written {
            st.stats.credit_blocks += 1;
            return Ok(Advance::Credit);
        }
        let k = self.written % depth;
        let fresh = self.out.done == 0 && self.out.lend == LendAt::default();
        if st.stats.on && fresh {
            st.stats.windows += 1;
            if st.ring.still_copying(k) {
                st.stats.not_landed += 1;
                st.stats.ahead_at_wait += (self.issued - self.written) as u64;
            }
        }
        st.ring.wait(k)?;
        timing::mark(Spent::Copies);
        let data = st.ring.slot_bytes(k, p.wins[p.written].0);
        if fresh && tracing::enabled!(tracing::Level::TRACE) {
            // A large part's window lies past its windows written before.
            let before: usize = p.wins[..p.written].iter().map(|w| w.0).sum();
            let mut at = 0;
            for o in &p.ops {
                let n = if p.ops.len() == 1 { data.len() } else { o.len };
                let off = o.head.off + before as u64;
                super::trace_payload("tx", o.head.seq, off, &data[at..at + n]);
                at += n;
            }
        }
        let out = &mut self.out;
        let now = |slices: &[&[u8]], done: &mut usize| write_slices_now(s, slices, done);
        let complete = match (sp.filter(|_| lend && p.lend), p.ops.as_slice(), p.written) {
            (Some(sp), ops, w) => {
                let hdr_out = match (ops, w) {
                    ([op], 0) => {
                        let hdr = PartHeader {
                            spliced: true,
                            ..op.head
                        }
                        .encode();
                        now(&[&hdr], &mut out.done)
                    }
                    _ => Ok(true),
                };
                timing::mark(Spent::Other);
                let lent = hdr_out.map_err(write_err)?
                    && sp
                        .send_now(data, &mut out.lend)
                        .map_err(|e| NetError::io(NET, "lending pages to the socket", e))?;
                timing::mark(Spent::Socket);
                if lent {
                    timing::bytes(data.len());
                    st.lent[k] = sp.lent();
                }
                lent
            }
            (None, [op], 0) => now(&[&op.hdr, data], &mut out.done).map_err(write_err)?,
            (None, [], _) | (None, [_], _) => now(&[data], &mut out.done).map_err(write_err)?,
            (None, ops, _) => {
                // A batch: each part's header, then its bytes.
                let mut at = 0;
                let mut slices: Vec<&[u8]> = Vec::with_capacity(ops.len() * 2);
                for o in ops {
                    slices.push(&o.hdr);
                    slices.push(&data[at..at + o.len]);
                    at += o.len;
                }
                now(&slices, &mut out.done).map_err(write_err)?
            }
        };
        if !complete {
            return Ok(Advance::Full);
        }
        self.out = WindowOut::default();
        p.written += 1;
        self.written += 1;
        if p.written == p.wins.len() {
            return Ok(Advance::Wrote(self.parts.pop_front()));
        }
        Ok(Advance::Wrote(None))
    }
}

/// The GPU of a whole device-memory part written through the slots by
/// [`tx_gpu_stream`]: large ones window by window, small ones batched.
fn piped_gpu(op: &TxOp, slice: usize) -> Option<i32> {
    if let Some(d) = gpu_batchable(op, slice) {
        return Some(d);
    }
    if op.skip != 0 || op.owned.is_some() || op.len == 0 {
        return None;
    }
    match uniform_kind(&op.pieces) {
        Some(MemKind::Cuda(d)) => Some(d),
        _ => None,
    }
}

/// Device-memory parts of one GPU being written through the stream's
/// staging ([`TxPipe`]), kept across the task's runs: where the socket
/// fills, or a lent slot waits for the receiver's credit, the task waits
/// in the poller holding no thread (blocked there, a receiver that stopped
/// reading held the worker for as long as it liked).
struct GpuWrite {
    dev: i32,
    pipe: TxPipe,
}

impl GpuWrite {
    /// Writes the pipe's windows, taking in the parts `next` hands over
    /// (those queued behind, on the same GPU) while a slot is free for
    /// them; each part is finished when written, all of them with a
    /// failure. Returns what to wait for when the socket is full or a
    /// credit is due, and has not come within `linger` (or at once when
    /// other work waits for a worker); None once the pipe is empty.
    fn pump(
        &mut self,
        s: &TcpStream,
        stager: &mut Stager<()>,
        next: &mut dyn FnMut() -> Option<TxOp>,
        finish: &dyn Fn(&TxOp, &Result<(), NetError>),
        linger: Duration,
        workers: &Workers,
    ) -> Option<Step> {
        let res = (|| -> Result<Option<Step>, NetError> {
            let (st, mut sp) = stager.lending(self.dev)?;
            let slice = st.ring.slice();
            loop {
                while self.pipe.takes_more(st.ring.depth()) {
                    let Some(o) = next() else { break };
                    self.pipe.add(o, slice);
                }
                let fd = std::os::fd::AsRawFd::as_raw_fd(s);
                let (ready, step) = match self.pipe.write_next(s, st, sp.as_deref_mut(), true)? {
                    Advance::Wrote(part) => {
                        for op in part.iter().flat_map(|p| &p.ops) {
                            finish(op, &Ok(()));
                        }
                        if self.pipe.is_empty() {
                            return Ok(None);
                        }
                        continue;
                    }
                    Advance::Full => (linger_writable(s, linger, workers), Step::Writable(fd)),
                    // The credit comes on the same socket.
                    Advance::Credit => (linger_readable(s, linger, workers), Step::Readable(fd)),
                };
                if !ready {
                    return Ok(Some(step));
                }
            }
        })();
        match res {
            Ok(step) => step,
            Err(e) => {
                for op in self.pipe.parts.drain(..).flat_map(|p| p.ops) {
                    finish(&op, &Err(e.clone()));
                }
                None
            }
        }
    }
}

/// The next op: spins for `spin` after the last one before blocking.
/// What a send stream's queue gave.
enum Next {
    Op(TxOp),
    /// Nothing for the linger: the stream gives its worker back.
    Quiet,
    /// The comm is closing.
    Closed,
}

/// The next op: its own queue's, else a spilled one; spun for up to
/// `spin` (and on while a caller waits on a transfer,
/// [`Workers::caller_waiting`]), then waited for up to `linger`. A stream
/// that did its part of a message spins on through the caller's wait for
/// the message's other parts, so the next message finds it awake:
/// measured on 2 x H100 with UCCL's benchmark at 1 MB, eight parts on
/// eight streams, a stream whose spin had run out woke 0.2-6 ms after its
/// part was queued, and the message waited for it.
fn next_op(
    rx: &Receiver<TxOp>,
    spill: &Receiver<TxOp>,
    queued: &AtomicUsize,
    spin: Duration,
    linger: Duration,
    stager: &mut Stager<()>,
    workers: &Workers,
) -> Next {
    let start = Instant::now();
    let mut gave_back = false;
    let mut linger_end = None;
    let mut leave: Option<crate::spin::Spin> = None;
    loop {
        match rx.try_recv() {
            Ok(op) => return Next::Op(op),
            Err(crossbeam_channel::TryRecvError::Disconnected) => return Next::Closed,
            Err(crossbeam_channel::TryRecvError::Empty) => {}
        }
        if let Some(op) = take_spilled(spill, queued) {
            return Next::Op(op);
        }
        if start.elapsed() < spin || workers.caller_waiting() {
            // (As the machine allows: see `crate::spin`.)
            let spinning = match &leave {
                Some(l) => l.pays(),
                None => {
                    leave = crate::spin::start();
                    leave.is_some()
                }
            };
            if spinning {
                std::hint::spin_loop();
                continue;
            }
        }
        leave = None;
        if !gave_back {
            // The staging goes back to the endpoint's pool while the
            // stream waits (a ring made anew costs milliseconds, and
            // stalls every CUDA call of the process meanwhile).
            stager.give_back();
            gave_back = true;
        }
        // The linger, in slices: the worker goes back at once once other
        // work waits for one.
        let until = *linger_end.get_or_insert_with(|| Instant::now() + linger);
        let slice = until
            .saturating_duration_since(Instant::now())
            .min(LINGER_SLICE);
        if spill.is_empty() {
            // The usual wait: on its own queue alone. A part spilled while
            // it waits is taken by a busy stream once that one drains (a
            // part spills only when every stream had `AHEAD` queued), so it
            // never waits for this one.
            match crate::workers::lingering(|| rx.recv_timeout(slice)) {
                Ok(op) => return Next::Op(op),
                Err(crossbeam_channel::RecvTimeoutError::Timeout) => {}
                Err(crossbeam_channel::RecvTimeoutError::Disconnected) => return Next::Closed,
            }
        } else {
            let mut sel = crossbeam_channel::Select::new();
            sel.recv(rx);
            sel.recv(spill);
            if crate::workers::lingering(|| sel.ready_timeout(slice)).is_ok() {
                continue;
            }
        }
        if Instant::now() >= until || workers.work_waiting() {
            return Next::Quiet;
        }
    }
}

/// A spilled part for a stream whose own queue is empty: taken while the
/// stream's count is held above 0, so that the posting thread, which
/// writes to an idle stream itself, does not write to it meanwhile. None
/// when nothing is spilled, or the stream is not idle (a part of its own
/// is on its way, or the posting thread is writing).
fn take_spilled(spill: &Receiver<TxOp>, queued: &AtomicUsize) -> Option<TxOp> {
    if spill.is_empty() {
        return None;
    }
    queued
        .compare_exchange(0, 1, Ordering::AcqRel, Ordering::Acquire)
        .ok()?;
    let op = take_spilled_busy(spill, queued);
    queued.fetch_sub(1, Ordering::AcqRel);
    op
}

/// A spilled part for a stream whose count is above 0 already (a part in
/// hand, or held by [`take_spilled`]): counted to it.
fn take_spilled_busy(spill: &Receiver<TxOp>, queued: &AtomicUsize) -> Option<TxOp> {
    let op = spill.try_recv().ok()?;
    queued.fetch_add(op.weight(), Ordering::AcqRel);
    Some(op)
}

pub(super) fn batchable(op: &TxOp) -> bool {
    host_only(op) && op.len <= BATCH_PART && op.skip == 0
}

/// The GPU of a small device-memory part that can share a window of the
/// send pipe (one staged copy, one wait) with the parts queued behind it.
fn gpu_batchable(op: &TxOp, slice: usize) -> Option<i32> {
    small_gpu_part(&op.pieces, op.len, slice).filter(|_| op.skip == 0 && op.owned.is_none())
}

/// `first` (a small host-memory part) and the small host-memory parts
/// queued behind it, up to [`BATCH_OPS`] and while under [`BATCH_BYTES`];
/// the first op that does not join is kept in `held` for the next round.
fn take_host_batch(rx: &Receiver<TxOp>, first: TxOp, held: &mut Option<TxOp>) -> Vec<TxOp> {
    let mut bytes = first.len;
    let mut batch = vec![first];
    while batch.len() < BATCH_OPS && bytes < BATCH_BYTES {
        match rx.try_recv() {
            Ok(o) if batchable(&o) => {
                bytes += o.len;
                batch.push(o);
            }
            Ok(o) => {
                *held = Some(o);
                break;
            }
            Err(_) => break,
        }
    }
    batch
}

/// Opens this thread's time account for the writes to send stream
/// `index` (`s`), as its task and the posting thread writing for it name
/// it.
pub(super) fn account(s: &TcpStream, index: usize) -> timing::Open {
    timing::start(|| {
        let peer = s.peer_addr().map(|a| a.to_string()).unwrap_or_default();
        format!("tx stream {index} to {peer}")
    })
}

fn finish_op(s: &TcpStream, shared: &SendShared, op: &TxOp, r: &Result<(), NetError>) {
    match r {
        Ok(()) => {
            if op.req.parts_left.fetch_sub(1, Ordering::AcqRel) == 1 {
                (shared.waker)();
            }
        }
        Err(e) => {
            let peer = s.peer_addr().map(|a| a.to_string()).unwrap_or_default();
            tracing::debug!("socket net: send stream to {peer} failed: {e}");
            *op.req.error.lock() = Some(e.clone());
            shared.failed.lock().get_or_insert_with(|| e.clone());
            let _ = s.shutdown(std::net::Shutdown::Both);
            (shared.waker)();
        }
    }
}

/// A send stream's work on the I/O workers: it writes the parts queued
/// to it, and gives its worker back once none has come for `linger`.
pub(super) struct TxTask {
    s: Arc<TcpStream>,
    rx: Receiver<TxOp>,
    shared: Arc<SendShared>,
    queued: Arc<AtomicUsize>,
    /// The comm's parts not given to any stream yet, for whichever stream
    /// drains its own queue first ([`take_spilled`]).
    spill: Receiver<TxOp>,
    lane: Lane,
    /// Its staging: taken from the endpoint's pool at a GPU part (not at
    /// connect: an idle peer holds no pinned memory) and given back when
    /// the stream waits.
    stager: Stager<()>,
    /// An op taken from the queue that did not join the batch before it.
    held: Option<TxOp>,
    /// Host parts whose socket filled while they were written.
    writing: Option<HostWrite>,
    /// Device-memory parts being written through the staging.
    gpu: Option<GpuWrite>,
    workers: Workers,
}

impl TxTask {
    pub(super) fn new(
        s: Arc<TcpStream>,
        queues: TxQueues,
        shared: Arc<SendShared>,
        lane: Lane,
        pool: Arc<StagingPool<()>>,
        workers: Workers,
    ) -> Self {
        // A lent slot comes back a receiver's read later than a written
        // one: a lending stream keeps twice the slots. Measured on h200-x2,
        // GPU -> GPU, six runs each (`…-splice/`): written 19.82 / 20.20
        // GB/s at 16 / 256 MiB, lent through 4 slots 22.04 / 21.07, through
        // 8 21.80 / 22.33.
        let depth = if lane.splice {
            lane.depth * 2
        } else {
            lane.depth
        };
        let mut stager = Stager::pooled(pool, lane.slice, depth);
        if lane.splice {
            stager.lend = Lend::Wanted(s.clone());
        }
        let TxQueues {
            own: rx,
            spill,
            queued,
        } = queues;
        TxTask {
            s,
            rx,
            shared,
            queued,
            spill,
            lane,
            stager,
            held: None,
            writing: None,
            gpu: None,
            workers,
        }
    }
}

impl Task for TxTask {
    fn run(&mut self) -> Step {
        let Lane { slice, spin, .. } = self.lane;
        let TxTask {
            s,
            rx,
            shared,
            queued,
            spill,
            lane,
            stager,
            held,
            writing,
            gpu,
            workers,
        } = self;
        stager.bind_here();
        let _account = account(s, lane.index);
        let finish = |op: &TxOp, r: &Result<(), NetError>| {
            queued.fetch_sub(op.weight(), Ordering::AcqRel);
            finish_op(s, shared, op, r)
        };
        loop {
            if let Some(w) = writing.as_mut() {
                let r = match w.write(s, lane.linger, workers) {
                    Ok(false) => return Step::Writable(std::os::fd::AsRawFd::as_raw_fd(&**s)),
                    Ok(true) => Ok(()),
                    Err(e) => Err(e),
                };
                let w = writing.take().expect("checked above");
                tracing::trace!(seq = w.ops[0].head.seq, n = w.ops.len(), "lat: tx wrote");
                for o in &w.ops {
                    finish(o, &r);
                }
            }
            if let Some(g) = gpu.as_mut() {
                let dev = g.dev;
                // The parts queued behind on the same GPU join the pipe;
                // the first that does not (or any, once the comm has
                // failed) is held for this loop.
                let mut next = || {
                    if held.is_some() {
                        return None;
                    }
                    // Its own parts first (they are older than any spilled
                    // one), then the comm's spilled parts: this stream is
                    // busy (the parts in the pipe are counted), so it takes
                    // them without holding the stream.
                    let got = rx
                        .try_recv()
                        .ok()
                        .or_else(|| take_spilled_busy(spill, queued));
                    match got {
                        Some(o)
                            if piped_gpu(&o, slice) == Some(dev)
                                && shared.failed.lock().is_none() =>
                        {
                            Some(o)
                        }
                        Some(o) => {
                            *held = Some(o);
                            None
                        }
                        None => None,
                    }
                };
                if let Some(step) = g.pump(s, stager, &mut next, &finish, lane.linger, workers) {
                    return step;
                }
                *gpu = None;
                tracing::trace!(stream = lane.index, "lat: tx gpu parts out");
            }
            timing::mark(Spent::Other);
            let op = match held.take() {
                Some(op) => op,
                None => match next_op(rx, spill, queued, spin, lane.linger, stager, workers) {
                    Next::Op(op) => op,
                    Next::Quiet => return Step::Idle,
                    Next::Closed => return Step::Done,
                },
            };
            timing::mark(Spent::Waiting);
            if let Some(f) = shared.failed.lock().clone() {
                queued.fetch_sub(op.weight(), Ordering::AcqRel);
                *op.req.error.lock() = Some(f);
                (shared.waker)();
                continue;
            }
            if let Some(dev) = piped_gpu(&op, slice) {
                let mut pipe = TxPipe::default();
                pipe.add(op, slice);
                *gpu = Some(GpuWrite { dev, pipe });
                continue;
            }
            if !host_only(&op) {
                let r = tx_part(s, &op, stager);
                finish(&op, &r);
                continue;
            }
            let ops = if batchable(&op) {
                take_host_batch(rx, op, held)
            } else {
                vec![op]
            };
            *writing = Some(HostWrite { ops, done: 0 });
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::gpu;

    fn host(addr: u64, len: usize) -> MemRef {
        MemRef {
            addr,
            len,
            kind: MemKind::Host,
        }
    }

    #[test]
    fn send_pipe_takes_parts_until_its_slots_are_covered() {
        // One-window parts (a 1 MiB part through 1 MiB slots): the pipe
        // keeps taking them until it knows a window for every slot, so
        // their copies can be queued ahead of the writes.
        let one = |addr| windows(&[host(addr, 1 << 20)], 1 << 20);
        let mut pipe = TxPipe::default();
        assert!(pipe.wants_more(4));
        for i in 0..3 {
            pipe.push(Vec::new(), one(i << 20), true);
            assert!(pipe.wants_more(4), "{} parts known", i + 1);
        }
        pipe.push(Vec::new(), one(3 << 20), true);
        assert!(!pipe.wants_more(4));
        // Written windows no longer count; a part of several windows does.
        pipe.parts[0].written = 1;
        assert!(pipe.wants_more(4));
        let mut pipe = TxPipe::default();
        pipe.push(Vec::new(), windows(&[host(0, 5 << 20)], 1 << 20), true);
        assert!(!pipe.wants_more(4));
    }

    #[test]
    fn small_gpu_parts_share_windows_in_the_send_pipe() {
        let part = |addr: u64, len: usize| TxOp {
            head: PartHeader::default(),
            hdr: [0; HDR_LEN],
            pieces: vec![MemRef {
                addr,
                len,
                kind: MemKind::Cuda(0),
            }],
            len,
            req: Arc::new(SendReq {
                parts_left: AtomicUsize::new(1),
                size: len,
                error: Mutex::new(None),
            }),
            skip: 0,
            owned: None,
        };
        let slice = 1 << 20;
        let mut pipe = TxPipe::default();
        // 128 KiB parts of 1 MiB messages: eight share one 1 MiB window;
        // parts that follow each other in GPU memory are one copy.
        for i in 0..8u64 {
            let addr = if i < 4 {
                i << 17
            } else {
                (10 << 20) + (i << 20)
            };
            pipe.add(part(addr, 128 << 10), slice);
        }
        assert_eq!(pipe.parts.len(), 1);
        let w = &pipe.parts[0].wins[0];
        assert_eq!(w.0, slice);
        assert_eq!(w.1.len(), 8);
        let slot = 1 << 40;
        let copies = window_copies(&w.1, slot, true);
        assert_eq!(copies.len(), 5, "four contiguous parts, then four apart");
        let copy = |dst: u64, src: u64, len: usize| gpu::CopyOp { dst, src, len };
        assert_eq!(copies[0], copy(slot, 0, 512 << 10));
        assert_eq!(
            copies[1],
            copy(slot + (512 << 10), (10 << 20) + (4 << 20), 128 << 10)
        );
        assert!(!pipe.parts[0].lend, "a batch is written, not lent");
        // A full window: the next one starts a batch of its own, which the
        // pipe keeps filling one window beyond its slots.
        pipe.add(part(1 << 30, 4096), slice);
        assert_eq!(pipe.parts.len(), 2);
        assert!(pipe.takes_more(2) && !pipe.wants_more(2));
        assert!(!pipe.takes_more(1));
        // Once its copy is queued a batch takes no more.
        pipe.parts[1].issued = 1;
        pipe.add(part(2 << 30, 4096), slice);
        assert_eq!(pipe.parts.len(), 3);
        // A large part is a part of its own, lent.
        pipe.add(part(3 << 30, 3 << 20), slice);
        assert_eq!(pipe.parts.len(), 4);
        assert!(pipe.parts[3].lend);
        assert_eq!(pipe.parts[3].wins.len(), 3);
        assert_eq!(pipe.parts.iter().map(|p| p.ops.len()).sum::<usize>(), 11);
    }
}
