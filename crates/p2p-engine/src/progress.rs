//! The progress thread of one connection: it owns the connection's net comms,
//! posts chunk requests within each comm's window, tests the oldest request
//! of every comm, and completes transfers. Chunks of each transfer are dealt
//! across the channels of a set by a cursor that both peers advance in the
//! same order, so send and receive requests line up on every comm.

use std::collections::{HashMap, VecDeque};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use crossbeam_channel::{Receiver, TryRecvError};
use parking_lot::Mutex;

use crate::error::NetError;
use crate::memory::{MemKind, Region};
use crate::net::{MemRef, MrHandle, Net, RecvComm, RemoteRef, ReqId, SendComm};
use crate::pieces::Pieces;
use crate::transfer::{Ends, Failure, Transfer};

/// The two sets of channels of a connection: two-sided messages, and the
/// one-sided (write/read) data whose order the data's receiver decides.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Set {
    Msg = 0,
    Rma = 1,
}

/// One request's worth of a transfer.
pub struct ChunkOp {
    /// The memory of the request and the region of each piece: one segment,
    /// or several gathered into one message; none for an empty filler.
    pub segs: Pieces,
    pub xfer: Arc<Transfer>,
    /// For receives: the bytes that must arrive (`None`: any up to `mem.len`).
    pub expect: Option<usize>,
    /// A pull ([`RecvComm::ipull`]) or a push ([`SendComm::ipush`]): the
    /// peer's memory the bytes are copied from or into; empty for every
    /// other request.
    pub remote: Vec<RemoteRef>,
    /// Where in its transfer's runs this request lies (our own transfers):
    /// a granted read's pull keys are found from it ([`crate::proto::op_refs`]).
    pub plan: Option<crate::transfer::OpPlan>,
}

pub enum Cmd {
    Send(Set, Vec<ChunkOp>),
    Recv(Set, Vec<ChunkOp>),
    /// Pulls (each op's `remote` set), on the one-sided set's receive
    /// comms: they pair with no send, so they are dealt by a cursor of
    /// their own and leave the receives' order as it is.
    Pull(Vec<ChunkOp>),
    /// Pushes (each op's `remote` set), on the one-sided set's send comms,
    /// likewise dealt by a cursor of their own.
    Push(Vec<ChunkOp>),
    /// A region was deregistered: drop its registrations with the comms.
    DropRegion(u64),
    Shutdown(Failure),
}

enum Comm {
    Send(Box<dyn SendComm>),
    Recv(Box<dyn RecvComm>),
}

struct CommState {
    comm: Comm,
    window: usize,
    pending: VecDeque<ChunkOp>,
    inflight: VecDeque<(ReqId, ChunkOp)>,
    mrs: HashMap<u64, MrHandle>,
    /// A small host buffer registered with the comm, for empty messages.
    scratch: Option<(Box<[u8]>, MrHandle)>,
    /// A short message breaks the pairing of later requests (two-sided set);
    /// on the one-sided set an empty message is a refused read's filler.
    mismatch_is_fatal: bool,
    /// The net may complete requests out of posting order.
    out_of_order: bool,
    /// The oldest request, and since when it has been the oldest (with
    /// the window full: see [`CommState::test`]).
    oldest_since: Option<(ReqId, Instant)>,
    /// Only an oldest request of at most this many bytes counts as stalled
    /// ([`STALL_MAX_BYTES`]).
    stall_max: usize,
}

/// With the window full, an oldest request incomplete this long lets the
/// requests behind it that are done free their slots (nets that complete
/// out of order); every round scans while it stays stalled. Measured on
/// h200-x2 (`…-b4k-8/`): a stream whose receive thread woke 7-30 ms late
/// held every other stream's messages behind the window (4 KiB bursts at
/// 0.2-0.3 GB/s instead of ~1). Scanning at most once per stall period
/// lost that gain (0.12-1.73 GB/s): rounds come only with completions, and
/// a blocked window has none until a timeout.
const OLDEST_STALL: Duration = Duration::from_micros(500);

/// Only an oldest request this small counts as stalled.
const STALL_MAX_BYTES: usize = 1 << 20;

/// Everything the progress thread drives.
pub struct Progress {
    /// `[set][channel]`, send comms and receive comms.
    sends: [Vec<CommState>; 2],
    recvs: [Vec<CommState>; 2],
    send_cursor: [usize; 2],
    recv_cursor: [usize; 2],
    pull_cursor: usize,
    push_cursor: usize,
    cmds: Receiver<Cmd>,
    polling: bool,
    spin: Duration,
    conn: u64,
}

impl CommState {
    fn new(comm: Comm, window: usize, mismatch_is_fatal: bool, out_of_order: bool) -> Self {
        CommState {
            comm,
            window,
            mismatch_is_fatal,
            out_of_order,
            oldest_since: None,
            stall_max: STALL_MAX_BYTES,
            pending: VecDeque::new(),
            inflight: VecDeque::new(),
            mrs: HashMap::new(),
            scratch: None,
        }
    }

    fn scratch_mr(&mut self) -> Result<(u64, MrHandle), Failure> {
        if self.scratch.is_none() {
            let buf = vec![0u8; 4096].into_boxed_slice();
            let mem = MemRef {
                addr: buf.as_ptr() as u64,
                len: buf.len(),
                kind: MemKind::Host,
            };
            let m = match &mut self.comm {
                Comm::Send(c) => c.reg_mr(mem),
                Comm::Recv(c) => c.reg_mr(mem),
            }
            .map_err(Failure::Net)?;
            self.scratch = Some((buf, m));
        }
        let (buf, m) = self
            .scratch
            .as_ref()
            .ok_or_else(|| Failure::Lost("scratch buffer missing".into()))?;
        Ok((buf.as_ptr() as u64, *m))
    }

    /// The comm's registration of region `r` (made on first use).
    fn mr_for(&mut self, r: &Region, kind: MemKind) -> Result<MrHandle, Failure> {
        if let Some(m) = self.mrs.get(&r.id) {
            return Ok(*m);
        }
        let whole = MemRef {
            addr: r.addr,
            len: r.len,
            kind,
        };
        let m = match &mut self.comm {
            Comm::Send(c) => c.reg_mr(whole),
            Comm::Recv(c) => c.reg_mr(whole),
        }
        .map_err(Failure::Net)?;
        self.mrs.insert(r.id, m);
        Ok(m)
    }

    /// Posts what the window allows; true if anything was posted.
    fn post(&mut self) -> Result<bool, Failure> {
        let mut any = false;
        let (mut mems, mut mrs) = (Vec::new(), Vec::new());
        // The last region's handle: a gathered request of a KV list has up
        // to 1,024 segments, mostly of one region (one map lookup, not one
        // per segment).
        let mut last: Option<(u64, MrHandle)> = None;
        while self.inflight.len() < self.window {
            let Some(op) = self.pending.pop_front() else {
                break;
            };
            mems.clear();
            mrs.clear();
            if op.segs.is_empty() {
                // An empty filler message: point it at a small registered
                // buffer of our own (plugins want a registered handle).
                let (addr, m) = self.scratch_mr()?;
                mems.push(MemRef {
                    addr,
                    len: 0,
                    kind: MemKind::Host,
                });
                mrs.push(m);
            }
            for (mem, r) in op.segs.iter() {
                let m = match last {
                    Some((id, m)) if id == r.id => m,
                    _ => {
                        let m = self.mr_for(r, mem.kind)?;
                        last = Some((r.id, m));
                        m
                    }
                };
                mrs.push(m);
                mems.push(*mem);
            }
            // One segment goes to `isend` / `irecv` (the trait's default).
            let posted = match &mut self.comm {
                Comm::Send(c) if !op.remote.is_empty() => c.ipush(&mems, &op.remote),
                Comm::Send(c) => c.isendv(&mems, &mrs),
                Comm::Recv(c) if !op.remote.is_empty() => c.ipull(&mems, &op.remote),
                Comm::Recv(c) => c.irecvv(&mems, &mrs),
            }
            .map_err(Failure::Net)?;
            match posted {
                Some(req) => {
                    self.inflight.push_back((req, op));
                    any = true;
                }
                None => {
                    self.pending.push_front(op);
                    break;
                }
            }
        }
        Ok(any)
    }

    /// Tests the oldest request, and the next while they complete. Where
    /// the net allows it and the window is full, an oldest request stalled
    /// for [`OLDEST_STALL`] no longer holds the others: those behind it
    /// that are done free their slots.
    fn test(&mut self) -> Result<bool, Failure> {
        let mut any = false;
        while let Some((req, _)) = self.inflight.front() {
            let Some(n) = self.test_at(0, *req)? else {
                break;
            };
            let (_, op) = self.inflight.pop_front().expect("front exists");
            any = true;
            self.finish(op, n)?;
        }
        let Some((oldest, op)) = self.inflight.front() else {
            self.oldest_since = None;
            return Ok(any);
        };
        let oldest = *oldest;
        // A large request may take this long by itself (8 MiB at 5 GB/s:
        // 1.7 ms), with every stream busy: nothing to gain, a window to test.
        // The cheap conditions first: summing a gathered request's segment
        // lengths (1,024 of them) on every poll showed in profiles.
        if !self.out_of_order || self.inflight.len() < self.window {
            return Ok(any);
        }
        let small = op.segs.total() <= self.stall_max;
        if !small {
            return Ok(any);
        }
        match self.oldest_since {
            Some((r, t)) if r == oldest => {
                if t.elapsed() < OLDEST_STALL {
                    return Ok(any);
                }
            }
            _ => {
                self.oldest_since = Some((oldest, Instant::now()));
                return Ok(any);
            }
        }
        let mut i = 1;
        while i < self.inflight.len() {
            let req = self.inflight[i].0;
            match self.test_at(i, req)? {
                Some(n) => {
                    let (_, op) = self.inflight.remove(i).expect("index in range");
                    any = true;
                    self.finish(op, n)?;
                }
                None => i += 1,
            }
        }
        Ok(any)
    }

    /// Tests request `req`, in flight at index `i`. A failed receive of the
    /// two-sided set fails its transfer saying what the receive could hold:
    /// a message larger than that fails it before any byte lands (the
    /// receive's size is clamped to its registration), and not every net
    /// says why (a plugin returns only a code). The error kind stays the
    /// net's.
    fn test_at(&mut self, i: usize, req: ReqId) -> Result<Option<usize>, Failure> {
        let err = match self.test_one(req) {
            Err(Failure::Net(e)) => e,
            other => return other,
        };
        if let (Comm::Recv(_), true, Some((_, op))) =
            (&self.comm, self.mismatch_is_fatal, self.inflight.get(i))
        {
            let cap = op.segs.total();
            let hint = format!(
                "a receive of at most {cap} bytes failed; a message larger than a receive fails it before any byte lands"
            );
            op.xfer.fail(match &err {
                NetError::Protocol { net, reason } => Failure::Net(NetError::Protocol {
                    net,
                    reason: format!("{reason} ({hint})"),
                }),
                NetError::Plugin { .. } => Failure::Lost(format!("{err} ({hint})")),
                _ => Failure::Net(err.clone()),
            });
        }
        Err(Failure::Net(err))
    }

    fn test_one(&mut self, req: ReqId) -> Result<Option<usize>, Failure> {
        match &mut self.comm {
            Comm::Send(c) => c.test(req),
            Comm::Recv(c) => c.test(req),
        }
        .map_err(Failure::Net)
    }

    /// Completes a request's op with the `n` bytes it moved.
    fn finish(&self, op: ChunkOp, n: usize) -> Result<(), Failure> {
        match op.expect {
            Some(want) if n != want && self.mismatch_is_fatal => {
                op.xfer.fail(Failure::Protocol(format!(
                    "message size mismatch: {n} bytes arrived where {want} were expected (sender and receiver sizes must match)"
                )));
                return Err(Failure::Protocol(format!(
                    "message size mismatch ({n} bytes arrived, {want} expected); the message streams are out of step"
                )));
            }
            Some(want) if n != want => {
                // The refusal message that explains it is on its way.
                op.xfer.poison(Failure::Refused(format!(
                    "the peer sent {n} of {want} bytes (request refused)"
                )));
                op.xfer.complete_one();
            }
            _ => op.xfer.complete_one(),
        }
        Ok(())
    }

    /// Takes every op, posted or not (the connection stops).
    fn take_ops(&mut self, out: &mut Vec<ChunkOp>) {
        out.extend(self.inflight.drain(..).map(|(_, op)| op));
        out.extend(self.pending.drain(..));
    }

    fn drop_region(&mut self, id: u64) {
        if let Some(m) = self.mrs.remove(&id) {
            let r = match &mut self.comm {
                Comm::Send(c) => c.dereg_mr(m),
                Comm::Recv(c) => c.dereg_mr(m),
            };
            if let Err(e) = r {
                tracing::warn!("deregistering region {id}: {e}");
            }
        }
    }
}

impl Progress {
    /// `sends[set]` / `recvs[set]`: one comm per channel.
    pub fn new(
        conn: u64,
        sends: [Vec<Box<dyn SendComm>>; 2],
        recvs: [Vec<Box<dyn RecvComm>>; 2],
        windows: (usize, usize),
        cmds: Receiver<Cmd>,
        net: &dyn Net,
        spin: Duration,
    ) -> Self {
        let (polling, out_of_order) = (net.needs_polling(), net.completes_out_of_order());
        let [s0, s1] = sends;
        let [r0, r1] = recvs;
        let ws = |v: Vec<Box<dyn SendComm>>, fatal| {
            v.into_iter()
                .map(|c| CommState::new(Comm::Send(c), windows.0, fatal, out_of_order))
                .collect()
        };
        let wr = |v: Vec<Box<dyn RecvComm>>, fatal| {
            v.into_iter()
                .map(|c| CommState::new(Comm::Recv(c), windows.1, fatal, out_of_order))
                .collect()
        };
        Progress {
            sends: [ws(s0, true), ws(s1, false)],
            recvs: [wr(r0, true), wr(r1, false)],
            send_cursor: [0; 2],
            recv_cursor: [0; 2],
            pull_cursor: 0,
            push_cursor: 0,
            cmds,
            polling,
            spin,
            conn,
        }
    }

    fn deal(comms: &mut [CommState], cursor: &mut usize, ops: Vec<ChunkOp>) {
        let n = comms.len();
        for op in ops {
            comms[*cursor % n].pending.push_back(op);
            *cursor = (*cursor + 1) % n;
        }
    }

    fn all(&mut self) -> impl Iterator<Item = &mut CommState> {
        let [a, b] = &mut self.sends;
        let [c, d] = &mut self.recvs;
        a.iter_mut()
            .chain(b.iter_mut())
            .chain(c.iter_mut())
            .chain(d.iter_mut())
    }

    /// Handles one command; Err(reason) to stop.
    fn command(&mut self, cmd: Cmd) -> Result<(), Failure> {
        match cmd {
            Cmd::Send(set, ops) => {
                let s = set as usize;
                Self::deal(&mut self.sends[s], &mut self.send_cursor[s], ops)
            }
            Cmd::Recv(set, ops) => {
                let s = set as usize;
                Self::deal(&mut self.recvs[s], &mut self.recv_cursor[s], ops)
            }
            Cmd::Pull(ops) => Self::deal(
                &mut self.recvs[Set::Rma as usize],
                &mut self.pull_cursor,
                ops,
            ),
            Cmd::Push(ops) => Self::deal(
                &mut self.sends[Set::Rma as usize],
                &mut self.push_cursor,
                ops,
            ),
            Cmd::DropRegion(id) => {
                tracing::trace!(region = id, "region let go by the comms");
                self.all().for_each(|c| c.drop_region(id))
            }
            Cmd::Shutdown(why) => return Err(why),
        }
        Ok(())
    }

    /// One round: takes new commands, posts what the windows allow, tests
    /// the oldest request of every comm. Ok(true) if anything happened;
    /// Err(reason) when the connection must stop.
    pub fn step(&mut self) -> Result<bool, Failure> {
        let mut clock = RoundClock::start();
        let mut busy = false;
        loop {
            match self.cmds.try_recv() {
                Ok(c) => {
                    busy = true;
                    self.command(c)?;
                }
                Err(TryRecvError::Empty) => break,
                Err(TryRecvError::Disconnected) => {
                    return Err(Failure::Lost("connection closed".into()))
                }
            }
        }
        clock.lap(Phase::Cmds);
        for c in self.all() {
            let p = c.post()?;
            clock.lap(Phase::Post);
            let t = c.test()?;
            clock.lap(Phase::Test);
            busy |= p || t;
        }
        clock.end();
        Ok(busy)
    }

    /// Whether ops wait for room in a window.
    fn queued(&mut self) -> bool {
        self.all().any(|c| !c.pending.is_empty())
    }

    /// Whether requests are in flight.
    pub fn outstanding(&mut self) -> bool {
        self.all().any(|c| !c.inflight.is_empty())
    }

    /// Takes every op still queued or in flight, and those of commands
    /// that raced with the shutdown.
    pub fn take_ops(&mut self) -> Vec<ChunkOp> {
        let mut ops = Vec::new();
        for c in self.all() {
            c.take_ops(&mut ops);
        }
        while let Ok(c) = self.cmds.try_recv() {
            if let Cmd::Send(_, o) | Cmd::Recv(_, o) | Cmd::Pull(o) | Cmd::Push(o) = c {
                ops.extend(o);
            }
        }
        ops
    }
}

/// A round that held the engine this long is traced with its phases.
const LONG_ROUND: Duration = Duration::from_micros(300);

/// A round's phases (see [`RoundClock`]).
#[derive(Clone, Copy)]
enum Phase {
    Cmds,
    Post,
    Test,
}

/// Where a round's time goes, kept only while tracing is on (no clock is
/// read otherwise): a round over [`LONG_ROUND`] is traced with the time of
/// each phase; what is left passed between them (the thread off its core).
/// Under UCCL's benchmark on 2 × H200, posting rounds took up to 2.4 ms
/// (`benchmarks/results/2026-11-28-h200x2-caller-helps/`).
struct RoundClock {
    start: Option<Instant>,
    last: Option<Instant>,
    spent: [Duration; 3],
}

impl RoundClock {
    fn start() -> Self {
        let now = tracing::enabled!(tracing::Level::TRACE).then(Instant::now);
        RoundClock {
            start: now,
            last: now,
            spent: [Duration::ZERO; 3],
        }
    }

    /// The time since the last lap goes to `phase`.
    fn lap(&mut self, phase: Phase) {
        if let Some(last) = self.last {
            let now = Instant::now();
            self.spent[phase as usize] += now - last;
            self.last = Some(now);
        }
    }

    fn end(&self) {
        let Some(start) = self.start else { return };
        let all = start.elapsed();
        if all > LONG_ROUND {
            let us = |d: Duration| u64::try_from(d.as_micros()).unwrap_or(u64::MAX);
            tracing::trace!(
                us = us(all),
                cmds_us = us(self.spent[Phase::Cmds as usize]),
                post_us = us(self.spent[Phase::Post as usize]),
                test_us = us(self.spent[Phase::Test as usize]),
                "lat: long round"
            );
        }
    }
}

/// A connection's progress engine, shared: its own thread drives it, and so
/// do callers that post work or wait for it when they find it free (which
/// saves the thread hand-offs that dominate small-message latency).
pub struct Engine {
    state: Mutex<Option<Progress>>,
    polling: bool,
    spin: Duration,
    /// The thread running a round or a stop now (0: none): a stop asked
    /// for by that thread itself (a transfer's end, run inside the round,
    /// failing the connection) is left to the round, which stops the
    /// engine when it returns.
    owner: AtomicU64,
    /// Callers' rounds not run since the last one that ran, for the lock
    /// being held (counted and traced only while tracing is on).
    turned_away: AtomicU64,
    /// Why a stop was asked for from inside a round.
    stop_asked: Mutex<Option<Failure>>,
}

/// Why [`Engine::run_until_idle`] returned.
#[derive(Debug)]
pub enum Until {
    /// Nothing outstanding for the linger.
    Idle,
    /// Ends are held for the connection to hear.
    Ends,
    /// The engine stopped, for this reason.
    Stopped(Failure),
}

/// This thread's number for [`Engine::owner`] (never 0).
fn thread_no() -> u64 {
    static NEXT: AtomicU64 = AtomicU64::new(1);
    thread_local!(static NO: u64 = NEXT.fetch_add(1, Ordering::Relaxed));
    NO.with(|n| *n)
}

impl Engine {
    pub fn new(p: Progress) -> Self {
        Engine {
            polling: p.polling,
            spin: p.spin,
            state: Mutex::new(Some(p)),
            owner: AtomicU64::new(0),
            turned_away: AtomicU64::new(0),
            stop_asked: Mutex::new(None),
        }
    }

    /// Stops on the locked state: the net's comms are closed first (their
    /// threads joined, so no byte lands in a posted buffer any more), and
    /// only then do the transfers of the ops they held fail.
    fn stop(&self, slot: &mut Option<Progress>, why: Failure) -> Failure {
        if let Some(mut p) = slot.take() {
            tracing::debug!(conn = p.conn, "failing what is in flight: {why}");
            let xfers: Vec<Arc<Transfer>> = p.take_ops().into_iter().map(|op| op.xfer).collect();
            self.owner.store(thread_no(), Ordering::Release);
            drop(p);
            for x in xfers {
                x.fail(why.clone());
            }
            self.owner.store(0, Ordering::Release);
        }
        why
    }

    /// Stops the engine for good, its comms closed, before the caller ends
    /// any transfer (see [`Engine::stop`]). False when called from inside a
    /// round on this thread: that round stops the engine as it returns,
    /// and its caller fails the connection again, which finishes then.
    pub fn stop_now(&self, why: &Failure) -> bool {
        if self.owner.load(Ordering::Acquire) == thread_no() {
            self.stop_asked.lock().get_or_insert_with(|| why.clone());
            return false;
        }
        self.stop(&mut self.state.lock(), why.clone());
        true
    }

    /// One step on the locked state, this thread marked as its owner; a
    /// stop asked for meanwhile stops the engine.
    fn owned_step(&self, slot: &mut Option<Progress>) -> Option<Result<bool, Failure>> {
        let p = slot.as_mut()?;
        self.owner.store(thread_no(), Ordering::Release);
        let r = p.step();
        self.owner.store(0, Ordering::Release);
        if r.is_ok() {
            if let Some(why) = self.stop_asked.lock().take() {
                return Some(Err(self.stop(slot, why)));
            }
        }
        Some(r)
    }

    /// One round on the locked state. Ok(true) when the progress thread is
    /// still needed: ops wait for room in a window, or the net progresses
    /// only when polled (else the net's waker calls for it when a request
    /// completes). Err(reason) when the connection stopped in this round.
    fn round(&self, slot: &mut Option<Progress>) -> Result<bool, Failure> {
        match self.owned_step(slot) {
            None => Ok(false),
            Some(Ok(_)) => Ok(slot
                .as_mut()
                .is_some_and(|p| p.queued() || (self.polling && p.outstanding()))),
            Some(Err(why)) => Err(self.stop(slot, why)),
        }
    }

    /// Net requests queued or in flight, on every comm (0 once stopped).
    pub fn ops(&self) -> usize {
        self.state.lock().as_mut().map_or(0, |p| {
            p.all().map(|c| c.pending.len() + c.inflight.len()).sum()
        })
    }

    /// Runs one round if no other thread is running one (see `round`; a
    /// round not run here needs the progress thread).
    pub fn try_step(&self) -> Result<bool, Failure> {
        match self.state.try_lock() {
            Some(mut g) => {
                if tracing::enabled!(tracing::Level::TRACE) {
                    let away = self.turned_away.swap(0, Ordering::Relaxed);
                    if away > 0 {
                        tracing::trace!(away, "lat: engine was busy");
                    }
                }
                self.round(&mut g)
            }
            None => {
                // Counted only while traced: no shared write per call else.
                if tracing::enabled!(tracing::Level::TRACE) {
                    self.turned_away.fetch_add(1, Ordering::Relaxed);
                }
                Ok(true)
            }
        }
    }

    /// Runs one round on this thread, waiting for the lock if another
    /// thread holds it. Err(reason) when the connection stopped.
    pub fn step_now(&self) -> Result<(), Failure> {
        self.round(&mut self.state.lock()).map(|_| ())
    }

    /// The progress task: runs rounds until the engine stops
    /// ([`Until::Stopped`]), transfer ends are held with no thread hearing
    /// them ([`Until::Ends`]: hear them, then run it again), or nothing
    /// has needed it for `linger` ([`Until::Idle`]: to be run again when
    /// the transport's waker or a new command calls for it). Requests in
    /// flight need it only on a net that progresses when polled; another
    /// net's waker calls for it when one completes, so a connection whose
    /// transfer is in flight holds no thread (it held one for the whole
    /// transfer, napping a millisecond at a time: a worker per busy
    /// peer). It lingers in [`crate::workers::lingering`], and returns
    /// early once `give_back` says other work waits for its thread.
    pub fn run_until_idle(
        &self,
        linger: Duration,
        ends: &Ends,
        give_back: &dyn Fn() -> bool,
    ) -> Until {
        let mut last_busy = Instant::now();
        loop {
            let (busy, outstanding) = {
                let asked = tracing::enabled!(tracing::Level::TRACE).then(Instant::now);
                let mut g = self.state.lock();
                if let Some(waited) = asked.map(|t| t.elapsed()).filter(|w| *w > LONG_ROUND) {
                    tracing::trace!(us = waited.as_micros() as u64, "lat: engine lock waited");
                }
                match self.owned_step(&mut g) {
                    None => return Until::Stopped(Failure::Lost("stopped".into())),
                    Some(Ok(b)) => (b, g.as_mut().is_some_and(|p| p.outstanding())),
                    Some(Err(why)) => return Until::Stopped(self.stop(&mut g, why)),
                }
            };
            if ends.unheard() {
                return Until::Ends;
            }
            if busy {
                last_busy = Instant::now();
            } else if outstanding && (self.polling || last_busy.elapsed() < self.spin) {
                std::thread::yield_now();
            } else if last_busy.elapsed() >= linger || give_back() {
                return Until::Idle;
            } else {
                // Woken by the transport's waker or by a new command.
                let nap = linger
                    .saturating_sub(last_busy.elapsed())
                    .min(crate::workers::LINGER_SLICE);
                crate::workers::lingering(|| std::thread::park_timeout(nap));
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_rounds_clock_reads_no_clock_without_tracing_and_gives_each_lap_to_its_phase() {
        // Timed only while tracing is on (as `TCPX_P2P_LOG=trace` sets it);
        // off, no lap reads the clock.
        let tracing_on = tracing::enabled!(tracing::Level::TRACE);
        let mut clock = RoundClock::start();
        assert_eq!(clock.start.is_some(), tracing_on);
        std::thread::sleep(Duration::from_millis(1));
        clock.lap(Phase::Post);
        assert_eq!(clock.spent[Phase::Post as usize].is_zero(), !tracing_on);
        // Timed: each lap's time goes to the phase it names, and only there.
        let t = Instant::now();
        let mut on = RoundClock {
            start: Some(t),
            last: Some(t),
            spent: [Duration::ZERO; 3],
        };
        std::thread::sleep(Duration::from_millis(2));
        on.lap(Phase::Post);
        on.lap(Phase::Test);
        assert!(on.spent[Phase::Post as usize] >= Duration::from_millis(2));
        assert_eq!(on.spent[Phase::Cmds as usize], Duration::ZERO);
        assert!(on.spent[Phase::Test as usize] < Duration::from_millis(2));
        on.end();
    }
    use crate::net::socket::{test_config, test_pair};
    use crate::transfer::Status;

    fn host_region(id: u64, buf: &[u8]) -> Arc<Region> {
        Arc::new(Region {
            id,
            addr: buf.as_ptr() as u64,
            len: buf.len(),
            kind: MemKind::Host,
        })
    }

    fn host(buf: &[u8]) -> MemRef {
        MemRef {
            addr: buf.as_ptr() as u64,
            len: buf.len(),
            kind: MemKind::Host,
        }
    }

    /// The receiving comm of the tests below, shared by the comm state and
    /// the test: the test sees which requests the net has completed
    /// (`arrived`) without taking them from the comm state, and holds the
    /// completion of one request (`held`) until it opens the gate.
    struct Gate {
        inner: Box<dyn RecvComm>,
        /// Completions taken from the net, not yet handed out.
        done: HashMap<ReqId, usize>,
        held: Option<ReqId>,
        open: bool,
    }

    impl Gate {
        fn arrived(&mut self, req: ReqId) -> bool {
            if self.done.contains_key(&req) {
                return true;
            }
            match self.inner.test(req).unwrap() {
                Some(n) => {
                    self.done.insert(req, n);
                    true
                }
                None => false,
            }
        }
    }

    struct Gated(Arc<Mutex<Gate>>);

    impl RecvComm for Gated {
        fn reg_mr(&mut self, mem: MemRef) -> Result<MrHandle, crate::error::NetError> {
            self.0.lock().inner.reg_mr(mem)
        }
        fn dereg_mr(&mut self, mr: MrHandle) -> Result<(), crate::error::NetError> {
            self.0.lock().inner.dereg_mr(mr)
        }
        fn irecv(
            &mut self,
            mem: MemRef,
            mr: MrHandle,
        ) -> Result<Option<ReqId>, crate::error::NetError> {
            self.0.lock().inner.irecv(mem, mr)
        }
        fn test(&mut self, req: ReqId) -> Result<Option<usize>, crate::error::NetError> {
            let mut g = self.0.lock();
            if !g.arrived(req) || (g.held == Some(req) && !g.open) {
                return Ok(None);
            }
            Ok(g.done.remove(&req))
        }
    }

    /// Three receives fill a window of three; the first message is large
    /// (one part, stream 0), the next two small (streams 1 and 2). The test
    /// holds the large receive's completion (a gate) until the small ones
    /// have arrived and the comm state has been tested for several stall
    /// periods with the window full: then whether a small one ended first is
    /// the policy's doing, not the machine's timing. Returns that, after
    /// opening the gate and checking every received byte. `stall_max`: the
    /// largest oldest request that counts as stalled.
    fn small_ends_first(out_of_order: bool, stall_max: usize) -> bool {
        let mut c = test_config(3);
        c.min_part = 1 << 30; // every message one part
        let (mut tx, rx) = test_pair(c.clone(), c);
        let gate = Arc::new(Mutex::new(Gate {
            inner: rx,
            done: HashMap::new(),
            held: None,
            open: false,
        }));
        let mut cs = CommState::new(
            Comm::Recv(Box::new(Gated(gate.clone()))),
            3,
            true,
            out_of_order,
        );
        cs.stall_max = stall_max;
        // Larger than STALL_MAX_BYTES.
        let sizes = [2 * STALL_MAX_BYTES, 4096, 4096];
        let src: Vec<Vec<u8>> = sizes
            .iter()
            .enumerate()
            .map(|(i, &n)| (0..n).map(|j| (j * 7 + i * 13) as u8).collect())
            .collect();
        let dst: Vec<Vec<u8>> = sizes.iter().map(|&n| vec![0u8; n]).collect();
        let xfers: Vec<Arc<Transfer>> = (0..3)
            .map(|i| {
                let r = host_region(i as u64, &dst[i]);
                let x = Transfer::new(i as u64, 0, 1, vec![r.clone()]);
                cs.pending.push_back(ChunkOp {
                    segs: Pieces::one(host(&dst[i]), r),
                    xfer: x.clone(),
                    expect: Some(sizes[i]),
                    remote: vec![],
                    plan: None,
                });
                x
            })
            .collect();
        assert!(cs.post().unwrap());
        assert_eq!(cs.inflight.len(), 3);
        let reqs: Vec<ReqId> = cs.inflight.iter().map(|(r, _)| *r).collect();
        gate.lock().held = Some(reqs[0]);
        let sent: Vec<ReqId> = src
            .iter()
            .map(|b| tx.isend(host(b), MrHandle(0)).unwrap().unwrap())
            .collect();
        let deadline = Instant::now() + Duration::from_secs(60);
        let until = |what: &str, done: &mut dyn FnMut() -> bool| {
            while !done() {
                assert!(Instant::now() < deadline, "{what}: not within 60 s");
                std::thread::yield_now();
            }
        };
        until("the small messages arriving", &mut || {
            let mut g = gate.lock();
            g.arrived(reqs[1]) && g.arrived(reqs[2])
        });
        // The gate is closed: the large receive stays incomplete. Test for
        // four stall periods after the first test (which starts the oldest's
        // stall clock; longer under load, never shorter), or until both
        // small receives have ended.
        cs.test().unwrap();
        let t0 = Instant::now();
        until("four stall periods", &mut || {
            cs.test().unwrap();
            assert!(!xfers[0].ended(), "the held receive ended");
            (xfers[1].ended() && xfers[2].ended()) || t0.elapsed() > 4 * OLDEST_STALL
        });
        let small_first = xfers[1].ended() || xfers[2].ended();
        gate.lock().open = true;
        until("every receive ending", &mut || {
            cs.test().unwrap();
            xfers.iter().all(|x| x.ended())
        });
        for (i, x) in xfers.iter().enumerate() {
            assert!(matches!(x.status(), Status::Done), "receive {i}");
            assert!(
                dst[i] == src[i],
                "receive {i}: bytes differ from those sent"
            );
        }
        for r in sent {
            until("the sends completing", &mut || {
                tx.test(r).unwrap().is_some()
            });
        }
        small_first
    }

    #[test]
    fn a_stalled_oldest_request_frees_the_window_where_the_net_allows_it() {
        assert!(small_ends_first(true, usize::MAX));
    }

    #[test]
    fn requests_complete_in_posting_order_otherwise() {
        assert!(!small_ends_first(false, usize::MAX));
    }

    #[test]
    fn a_large_oldest_request_is_slow_not_stalled() {
        assert!(!small_ends_first(true, STALL_MAX_BYTES));
    }
}
