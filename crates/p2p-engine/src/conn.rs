//! One peer: a control connection (handshake, then control messages) and
//! two sets of channels, each channel a send comm and a receive comm of the
//! net. Two-sided messages use the `Msg` set and match in posting order.
//! One-sided data uses the `Rma` set, whose order on each direction the
//! data's receiver decides: it tells the sender (a `WriteCts` for a write,
//! the `ReadReq` itself for a read) while holding the control-connection
//! lock, and the sender posts in arrival order; the receiver posts its
//! receives in the same order, a read's once the sender has accepted it
//! ([`crate::rma_recvs`]).

use std::collections::{BTreeSet, HashMap, VecDeque};
use std::net::{SocketAddr, TcpStream};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, OnceLock, Weak};
use std::thread::Thread;
use std::time::{Duration, Instant};

use crossbeam_channel::Sender;
use parking_lot::Mutex;

use crate::error::{Error, Result};
use crate::handler::{Action, Book, Ctx, Limits, ProtocolError};
use crate::handshake::{self, Role};
use crate::memory::Registry;
use crate::net::{DataPaths, MemRef, Net, PeerInfo, RecvComm, SendComm, Waker};
use crate::notif::{Notif, NotifQueue};
use crate::progress::{ChunkOp, Cmd, Engine, Progress, Set};
use crate::rma;
use crate::rma_recvs::RmaRecvs;
use crate::transfer::{plan_ops, Failure, Gather, OpPlan, Transfer};
use crate::wire::{self, Control, RmaItem};
use crate::workers::{Home, Step, Task, Workers};

/// Inline writes stop while our control backlog holds this many bytes
/// (see [`Conn::inline_room`]).
const INLINE_BACKLOG: usize = 4 << 20;

/// Inline reads stop while this many await their data: their answers (at
/// most [`wire::MAX_INLINE`] each) stay within the peer's control backlog.
const INLINE_READS: usize = 32;

/// Longest a waiting thread sleeps before it looks again by itself.
const WAIT_SLICE: Duration = Duration::from_millis(10);

/// Milliseconds on a process-wide monotonic clock.
pub(crate) fn now_ms() -> u64 {
    static EPOCH: OnceLock<Instant> = OnceLock::new();
    EPOCH.get_or_init(Instant::now).elapsed().as_millis() as u64
}

const PEER_CLOSED: &str = "peer closed the connection";

/// The control framing (defined with the byte formats).
pub(crate) use crate::wire::{read_frame, write_frame};

/// What the endpoint gives every connection.
#[derive(Clone)]
pub(crate) struct ConnParams {
    /// This connection's net: chosen from `paths` by [`ConnParams::for_peer`].
    pub net: Arc<dyn Net>,
    /// The endpoint's data paths (see [`crate::net::DataPaths`]).
    pub paths: Arc<dyn DataPaths>,
    pub registry: Arc<Registry>,
    pub gpu_index: i32,
    pub gpu_bdf: String,
    pub channels: usize,
    pub chunk: usize,
    pub windows: (usize, usize),
    /// The shared secret both sides prove in the handshake (empty: none).
    pub auth_key: Arc<[u8]>,
    /// What a peer may make us hold (see [`Limits`]).
    pub limits: Limits,
    /// Most TCP connections a peer's listen handles may ask us to open.
    pub max_peer_streams: usize,
    /// Most channels per set an accepted peer gets.
    pub max_peer_channels: usize,
    pub timeout: Duration,
    pub spin: Duration,
    pub deadline: Duration,
    /// Net devices for channel i: `devices[i % len]` (never empty).
    pub devices: Vec<usize>,
    /// Where notifications from peers are queued (the endpoint's).
    pub notifs: Arc<NotifQueue>,
    /// One-sided transfers up to this size go inline (`TCPX_P2P_INLINE_MAX`).
    pub inline_max: usize,
    /// The control connection's socket buffers (`TCPX_P2P_SOCKBUF`; 0: the
    /// kernel's).
    pub sockbuf: usize,
    /// The endpoint's I/O workers, which run the connection's tasks.
    pub workers: Workers,
    /// How long a task with nothing to do keeps its worker
    /// (`TCPX_P2P_IO_LINGER_MS`).
    pub linger: Duration,
}

impl ConnParams {
    /// The parameters of a connection over control connection `oob`: its
    /// net chosen for the peer at the other end.
    pub(crate) fn for_peer(&self, oob: &TcpStream) -> ConnParams {
        let (Ok(peer), Ok(local)) = (oob.peer_addr(), oob.local_addr()) else {
            return self.clone();
        };
        ConnParams {
            net: self.paths.choose(&PeerInfo { peer, local }),
            ..self.clone()
        }
    }
}

/// What a connection holds for its peer at one moment (for tests of the
/// limits: a refusal must hold nothing, whatever the request claimed).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Held {
    /// Net requests queued or in flight in the progress engine.
    pub ops: usize,
    /// One-sided receives of ours waiting for their turn (reads not yet
    /// accepted by the peer, and what is behind them).
    pub unposted: usize,
    /// The peer's one-sided requests accepted and not finished, and their
    /// pieces (see [`crate::handler::Limits`]).
    pub requests: usize,
    pub pieces: usize,
}

/// Where an inline read's bytes land: our buffers, in order.
type Landing = Vec<(MemRef, Arc<crate::memory::Region>)>;

/// A write of ours waiting for the target's clear-to-send.
enum PendingWrite {
    /// Its chunk ops, sent when cleared.
    Ops(Vec<ChunkOp>),
    /// Cancelled by the application: when cleared, this many empty
    /// messages fill the target's posted receives (which then refuse the
    /// write), so that both sides stay in step.
    Cancelled(usize),
}

/// Our two-sided receives, numbered in posting order (the order the peer's
/// messages fill them), and how many of them, counted from the first, have
/// landed: what `MsgDone` tells the sender.
#[derive(Default)]
struct RecvAcks {
    next: u64,
    landed: BTreeSet<u64>,
    count: u64,
}

impl RecvAcks {
    /// Receive `seq` landed: the new count to acknowledge, if it grew.
    fn landed(&mut self, seq: u64) -> Option<u64> {
        self.landed.insert(seq);
        let before = self.count;
        while self.landed.remove(&self.count) {
            self.count += 1;
        }
        (self.count > before).then_some(self.count)
    }
}

pub struct Conn {
    pub id: u64,
    pub peer: SocketAddr,
    pub remote_gpu: i32,
    pub remote_bdf: String,
    pub chunk: usize,
    /// How small items share a request on this connection's net.
    gather: Gather,
    oob: Mutex<crate::oob_out::OobOut>,
    cmds: Sender<Cmd>,
    /// The progress task (on the endpoint's I/O workers): woken for work
    /// the posting thread left.
    progress: Arc<OnceLock<Arc<Home>>>,
    engine: Arc<Engine>,
    registry: Arc<Registry>,
    failed: Mutex<Option<Failure>>,
    closed: AtomicBool,
    /// When we last heard from / wrote to the peer (ms on [`now_ms`]'s clock).
    last_rx: AtomicU64,
    last_tx: AtomicU64,
    /// User transfers of this connection, failed together if it breaks.
    live: Mutex<HashMap<u64, Arc<Transfer>>>,
    /// Writes waiting for the target's clear-to-send.
    pending_writes: Mutex<HashMap<u64, PendingWrite>>,
    /// Receives of one-sided data coming to us, waiting for their turn
    /// (our reads' until the peer accepts them). Taken after `oob`.
    rma_recvs: Mutex<RmaRecvs<Vec<ChunkOp>>>,
    /// The one-sided bookkeeping: answers awaited, work held for the peer.
    book: Mutex<Book>,
    /// Threads blocked in [`Conn::wait_on`]: the net's waker wakes them.
    waiters: Arc<Mutex<Vec<Thread>>>,
    /// The connection's tasks on the I/O workers (progress, control
    /// reader, control writer), waited for at close.
    tasks: Mutex<Vec<Arc<Home>>>,
    /// The endpoint's notification queue.
    notifs: Arc<NotifQueue>,
    /// One-sided transfers up to this size go inline (see [`crate::inline`]).
    inline_max: usize,
    /// Our inline reads awaiting their `ReadData`: where the bytes land
    /// (None: cancelled, the bytes are read and dropped).
    pending_reads: Mutex<HashMap<u64, Option<Landing>>>,
    /// How long an orderly close waits for the peer to acknowledge our
    /// sends (the liveness deadline): a send completes once its bytes are
    /// out of the caller's buffer, and a close delivers what was sent.
    delivery: Duration,
    /// Our receives' numbering and what we acknowledged.
    msg_recvs: Mutex<RecvAcks>,
    /// Our sends not yet acknowledged, by message number, in order. A
    /// send ends at the first of its net requests ending or the peer's
    /// `MsgDone` covering it: once the peer has every byte, a connection
    /// closed before the net reported its requests must not fail it.
    msg_sends: Mutex<VecDeque<(u64, Weak<Transfer>)>>,
}

impl Conn {
    /// Runs the handshake on a fresh control connection and starts the
    /// connection's threads. `initiator` is the side that called connect;
    /// an accepting side passes its `gate` (what the endpoint asks of an
    /// accepted handshake: see [`handshake::Gate`]).
    pub(crate) fn establish(
        id: u64,
        mut oob: TcpStream,
        initiator: bool,
        p: &ConnParams,
        gate: Option<&handshake::Gate<'_>>,
    ) -> Result<Arc<Conn>> {
        let peer = oob
            .peer_addr()
            .map_err(|e| Error::io("control connection", e))?;
        let cerr = |reason: String| Error::Connect {
            peer: peer.to_string(),
            reason,
        };
        oob.set_nodelay(true)
            .map_err(|e| Error::io("control connection", e))?;
        // One deadline for the whole handshake and the net's channels,
        // however slowly the peer sends.
        let deadline = crate::timeout::deadline_after(p.timeout).ok_or_else(|| {
            cerr(format!(
                "connect timeout {:?} is beyond the clock",
                p.timeout
            ))
        })?;
        let net = &p.net;
        let ndev = p.devices.len();
        let device = |i: usize, n: usize| p.devices[(i % n) % ndev];
        let local = handshake::Local {
            net: net.as_ref(),
            gpu_index: p.gpu_index,
            gpu_bdf: &p.gpu_bdf,
            // The acceptor's offer is its ceiling: it answers the lower.
            channels: if initiator {
                p.channels
            } else {
                p.max_peer_channels.clamp(1, wire::MAX_CHANNELS as usize)
            },
            chunk: p.chunk,
            key: &p.auth_key,
            max_connections: p.max_peer_streams,
            device: &device,
            gate,
        };
        let role = if initiator {
            Role::Initiator
        } else {
            Role::Acceptor
        };
        let shaken =
            handshake::run(&mut oob, role, &local, deadline).map_err(|e| cerr(e.to_string()))?;
        // The room this connection holds at the endpoint: given back when
        // its progress thread (owner of its net connections) ends.
        let room = shaken.room;
        let theirs = shaken.theirs;
        let listens = shaken.listens;
        let their_handles = shaken.handles;
        let channels = shaken.agreed.channels;
        let chunk = shaken.agreed.chunk;

        // Connect our send comms to their listeners, accept ours; both may
        // need to be called again (resumable, as in ncclNet).
        let progress_thread: Arc<OnceLock<Arc<Home>>> = Arc::new(OnceLock::new());
        let pt = progress_thread.clone();
        let waiters: Arc<Mutex<Vec<Thread>>> = Arc::new(Mutex::new(Vec::new()));
        let wt = waiters.clone();
        // A thread waiting on a transfer runs the round itself; else the
        // progress thread does.
        let waker: Waker = Arc::new(move || {
            let waiting = wt.lock();
            if waiting.is_empty() {
                if let Some(t) = pt.get() {
                    t.wake();
                }
            }
            for t in waiting.iter() {
                t.unpark();
            }
        });
        let mut sends: Vec<Option<Box<dyn SendComm>>> = (0..2 * channels).map(|_| None).collect();
        let mut recvs: Vec<Option<Box<dyn RecvComm>>> = (0..2 * channels).map(|_| None).collect();
        let mut listens = listens;
        loop {
            let mut all = true;
            for (i, slot) in sends.iter_mut().enumerate() {
                if slot.is_none() {
                    *slot = net
                        .connect(
                            p.devices[(i % channels) % p.devices.len()],
                            &their_handles[i],
                            waker.clone(),
                        )
                        .map_err(|e| cerr(format!("net connect (channel {i}): {e}")))?;
                    all &= slot.is_some();
                }
            }
            for (i, slot) in recvs.iter_mut().enumerate() {
                if slot.is_none() {
                    *slot = listens[i]
                        .accept(waker.clone())
                        .map_err(|e| cerr(format!("net accept (channel {i}): {e}")))?;
                    all &= slot.is_some();
                }
            }
            if all {
                break;
            }
            if Instant::now() > deadline {
                return Err(cerr(format!(
                    "net channels not established within {:?}",
                    p.timeout
                )));
            }
            std::thread::sleep(Duration::from_micros(200));
        }
        drop(listens);
        let mut sends: Vec<Box<dyn SendComm>> = sends.into_iter().flatten().collect();
        let mut recvs: Vec<Box<dyn RecvComm>> = recvs.into_iter().flatten().collect();
        let sends_rma = sends.split_off(channels);
        let recvs_rma = recvs.split_off(channels);
        oob.set_read_timeout(None)
            .map_err(|e| Error::io("control connection", e))?;
        if p.sockbuf > 0 {
            let r = socket2::SockRef::from(&oob);
            r.set_send_buffer_size(p.sockbuf)
                .and_then(|()| r.set_recv_buffer_size(p.sockbuf))
                .map_err(|e| Error::io("control connection buffers", e))?;
        }
        // A peer that stops reading must not block our writers forever.
        oob.set_write_timeout(Some(p.deadline))
            .map_err(|e| Error::io("control connection", e))?;

        let (tx, rx) = crossbeam_channel::unbounded();
        let engine = Arc::new(Engine::new(Progress::new(
            id,
            [sends, sends_rma],
            [recvs, recvs_rma],
            p.windows,
            rx,
            net.as_ref(),
            p.spin,
        )));
        let reader = oob
            .try_clone()
            .map_err(|e| Error::io("control connection", e))?;
        let conn = Arc::new(Conn {
            id,
            peer,
            remote_gpu: theirs.gpu_index,
            remote_bdf: theirs.gpu_bdf.clone(),
            chunk,
            gather: Gather::new(chunk, net.max_segments()),
            oob: Mutex::new(crate::oob_out::OobOut::new(oob)),
            cmds: tx,
            progress: progress_thread.clone(),
            engine: engine.clone(),
            registry: p.registry.clone(),
            failed: Mutex::new(None),
            closed: AtomicBool::new(false),
            last_rx: AtomicU64::new(now_ms()),
            last_tx: AtomicU64::new(now_ms()),
            live: Mutex::new(HashMap::new()),
            pending_writes: Mutex::new(HashMap::new()),
            rma_recvs: Mutex::new(RmaRecvs::default()),
            book: Mutex::new(Book::new(p.limits)),
            waiters,
            tasks: Mutex::new(Vec::new()),
            notifs: p.notifs.clone(),
            inline_max: p.inline_max,
            pending_reads: Mutex::new(HashMap::new()),
            delivery: p.deadline,
            msg_recvs: Mutex::new(RecvAcks::default()),
            msg_sends: Mutex::new(VecDeque::new()),
        });
        let ptask = p.workers.start(Box::new(ProgressTask {
            engine,
            conn: Arc::downgrade(&conn),
            _room: room,
            linger: p.linger,
        }));
        let _ = progress_thread.set(ptask.clone());
        let rfd = std::os::fd::AsRawFd::as_raw_fd(&reader);
        let rtask = p.workers.start_readable(
            Box::new(OobReader {
                conn: Arc::downgrade(&conn),
                s: reader,
                spin: p.spin,
                linger: p.linger,
                last: None,
            }),
            rfd,
        );
        let weak = Arc::downgrade(&conn);
        let wtask = conn
            .oob
            .lock()
            .start_writer(&p.workers, move |e| {
                if let Some(c) = weak.upgrade() {
                    c.fail(format!("control connection write failed: {e}"));
                }
            })
            .map_err(|e| Error::io("starting the control writer", e))?;
        conn.tasks.lock().extend([ptask, rtask, wtask]);
        tracing::debug!(conn = id, %peer, channels, chunk, "connection established");
        Ok(conn)
    }

    fn submit(&self, cmd: Cmd) {
        self.enqueue(cmd);
        self.kick();
    }

    /// Queues a command in order; safe under the control-connection lock.
    fn enqueue(&self, cmd: Cmd) {
        if self.cmds.send(cmd).is_err() {
            // The progress thread is gone; the connection has failed already
            // and the transfers are failed by `fail`.
        }
    }

    /// Queues the one-sided receives whose turn has come, in order (the lock
    /// is held while queueing, so that two threads keep that order).
    fn post_due_recvs(&self) {
        let mut r = self.rma_recvs.lock();
        for ops in r.due() {
            self.enqueue(Cmd::Recv(Set::Rma, ops));
        }
    }

    /// Posts at once from this thread when the engine is free, and wakes the
    /// progress thread for what remains (on a net with a waker, requests
    /// posted here call for it when they complete: no wake-up, and on a
    /// small machine no core taken, per message). Never call it holding the
    /// control lock: a round of progress may complete transfers whose
    /// completion writes a control message.
    fn kick(&self) {
        if self.poke() {
            if let Some(t) = self.progress.get() {
                t.wake();
            }
        }
    }

    /// Runs a round of progress on this thread if no other thread is; true
    /// when the progress thread is still needed.
    pub(crate) fn poke(&self) -> bool {
        match self.engine.try_step() {
            Ok(needed) => needed,
            Err(why) => {
                self.fail(why);
                false
            }
        }
    }

    /// Blocks until `t` (one of ours) ends or `deadline` passes. The net's
    /// waker wakes this thread, which then runs the round of progress that
    /// completes the transfer itself: one thread hand-off per message
    /// (I/O thread to waiter), not two (through the progress thread).
    pub(crate) fn wait_on(&self, t: &Transfer, deadline: Option<Instant>) {
        let me = std::thread::current();
        t.set_waiter(Some(me.clone()));
        self.waiters.lock().push(me.clone());
        while !t.ended() {
            let left = deadline.map(|d| d.saturating_duration_since(Instant::now()));
            if left == Some(Duration::ZERO) {
                break;
            }
            // The bound only guards against a missed wake-up.
            std::thread::park_timeout(left.map_or(WAIT_SLICE, |l| l.min(WAIT_SLICE)));
            tracing::trace!(xfer = t.id, "lat: waiter woke");
            if t.ended() {
                break;
            }
            if let Err(why) = self.engine.step_now() {
                self.fail(why);
            }
        }
        self.waiters.lock().retain(|w| w.id() != me.id());
        t.set_waiter(None);
        // What completed while we were the one to be woken, and what the
        // waker calls for from now on, is the progress thread's.
        self.kick();
    }

    /// The reason this connection is unusable, if it is.
    pub fn failure(&self) -> Option<Failure> {
        self.failed.lock().clone()
    }

    fn check_alive(&self) -> Result<()> {
        match self.failure() {
            Some(f) => Err(f.into_error(self.id)),
            None => Ok(()),
        }
    }

    /// Marks the connection failed and fails everything in flight. No
    /// transfer ends before the progress engine has stopped and closed the
    /// net's comms: until then a posted receive could still take bytes into
    /// its buffers. Called from inside a round of the engine (a transfer's
    /// end), it only marks: the round stops the engine as it returns, and
    /// its caller calls again, which finishes.
    pub(crate) fn fail(&self, why: impl Into<Failure>) {
        let why: Failure = why.into();
        let first = {
            let mut f = self.failed.lock();
            let first = f.is_none();
            f.get_or_insert_with(|| why.clone());
            first
        };
        if first {
            let peer_closed = matches!(&why, Failure::Lost(r) if r == PEER_CLOSED);
            if self.closed.load(Ordering::Acquire) || peer_closed {
                tracing::debug!(conn = self.id, peer = %self.peer, "connection closed: {why}");
            } else {
                tracing::warn!(conn = self.id, peer = %self.peer, "connection failed: {why}");
            }
            let _ = self.cmds.send(Cmd::Shutdown(why.clone()));
            if let Some(t) = self.progress.get() {
                t.wake();
            }
            let oob = self.oob.lock();
            oob.close();
            let _ = oob.stream().shutdown(std::net::Shutdown::Both);
        }
        let fl = self.failed.lock().clone().unwrap_or(why);
        if !self.engine.stop_now(&fl) {
            return;
        }
        let live: Vec<_> = self.live.lock().drain().map(|(_, t)| t).collect();
        for t in live {
            t.fail(fl.clone());
        }
        self.pending_reads.lock().clear();
        self.msg_sends.lock().clear();
        let unposted = self.rma_recvs.lock().clear();
        for op in unposted.into_iter().flatten() {
            op.xfer.fail(fl.clone());
        }
        let writes: Vec<_> = self.pending_writes.lock().drain().collect();
        for (_, w) in writes {
            if let PendingWrite::Ops(ops) = w {
                for op in ops {
                    op.xfer.fail(fl.clone());
                }
            }
        }
        self.registry.forget_conn(self.id);
    }

    /// Orderly close: waits (up to the deadline) until the peer has
    /// acknowledged every message we sent, tells the peer, fails what is
    /// still in flight, joins threads.
    pub(crate) fn close(&self) {
        if self.closed.swap(true, Ordering::AcqRel) {
            return;
        }
        self.deliver_sent();
        if self.failure().is_none() {
            let mut v = Vec::new();
            Control::Close.encode(&mut v);
            let mut oob = self.oob.lock();
            if write_frame(&mut *oob, &v).is_ok() {
                drop(oob);
                // What is queued (the close among it) goes out first.
                self.oob.lock().flush_for(Duration::from_secs(1));
            }
        }
        self.fail(Failure::Lost("closed locally".into()));
        let tasks: Vec<_> = self.tasks.lock().drain(..).collect();
        Home::end_all(
            &tasks,
            self.delivery,
            &format!("connection {} to {}", self.id, self.peer),
        );
    }

    /// A send completes once its bytes are out of the caller's buffer; its
    /// message may still be on its way, or waiting for the peer's receive.
    /// Before an orderly close, wait until the peer's `MsgDone` counts cover
    /// every message we sent, the connection fails, or the deadline passes,
    /// so that a sender may close (or drop its endpoint and exit) right
    /// after `send` returns and lose nothing.
    fn deliver_sent(&self) {
        let until = Instant::now() + self.delivery;
        let mut pause = Duration::from_micros(50);
        while self.failure().is_none() && self.book.lock().msgs_unacked() > 0 {
            if Instant::now() >= until {
                tracing::warn!(
                    conn = self.id,
                    peer = %self.peer,
                    unacked = self.book.lock().msgs_unacked(),
                    "closing with messages the peer has not acknowledged within {:.1} s",
                    self.delivery.as_secs_f64()
                );
                return;
            }
            std::thread::sleep(pause);
            pause = (pause * 2).min(Duration::from_millis(5));
        }
    }

    fn track(self: &Arc<Self>, t: &Arc<Transfer>) {
        self.live.lock().insert(t.id, t.clone());
        let weak: Weak<Conn> = Arc::downgrade(self);
        let id = t.id;
        t.on_end(move |_| {
            if let Some(c) = weak.upgrade() {
                c.live.lock().remove(&id);
            }
        });
        // The connection may have failed while we were registering.
        if let Some(f) = self.failure() {
            t.fail(f);
        }
    }

    /// The requests that carry items of these lengths (see [`plan_ops`]).
    fn plan(&self, lens: impl Iterator<Item = usize>) -> Vec<OpPlan> {
        let lens: Vec<usize> = lens.collect();
        plan_ops(&lens, self.chunk, self.gather)
    }

    /// The chunk ops of `plan` over `items`. With `exact` false, a
    /// one-piece message may be shorter than its receive buffer; longer
    /// and gathered messages must match exactly.
    fn ops_for(
        &self,
        xfer: &Arc<Transfer>,
        items: &[(MemRef, Arc<crate::memory::Region>)],
        plan: &[OpPlan],
        exact: bool,
    ) -> Vec<ChunkOp> {
        plan.iter()
            .map(|p| match *p {
                OpPlan::Piece {
                    item,
                    off,
                    len,
                    pieces,
                } => {
                    let (m, r) = &items[item];
                    let mem = MemRef {
                        addr: m.addr + off as u64,
                        len,
                        kind: m.kind,
                    };
                    ChunkOp {
                        segs: vec![(mem, r.clone())],
                        xfer: xfer.clone(),
                        expect: (exact || pieces > 1).then_some(len),
                    }
                }
                OpPlan::Gather { start, end } => {
                    let segs = items[start..end].to_vec();
                    let total = segs.iter().map(|(m, _)| m.len).sum();
                    ChunkOp {
                        segs,
                        xfer: xfer.clone(),
                        expect: Some(total),
                    }
                }
            })
            .collect()
    }

    /// Two-sided send or receive of a list of buffers.
    pub(crate) fn post_msg(
        self: &Arc<Self>,
        xfer_id: u64,
        send: bool,
        items: Vec<(MemRef, Arc<crate::memory::Region>)>,
    ) -> Result<Arc<Transfer>> {
        self.check_alive()?;
        tracing::trace!(xfer = xfer_id, send, "lat: post");
        let regions = distinct_regions(&items);
        let plan = self.plan(items.iter().map(|(m, _)| m.len));
        // A send completes once its requests have: its bytes are out of
        // the caller's buffer. The receiver's acknowledgements (`MsgDone`)
        // are counted, and an orderly close waits for them
        // ([`Conn::deliver_sent`]).
        let events = plan.len();
        let xfer = Transfer::new(xfer_id, self.id, events, regions);
        self.track(&xfer);
        let ops = self.ops_for(&xfer, &items, &plan, false);
        // Numbered and queued under one lock, so that the numbers follow the
        // order in which the engine posts them (and the peer's messages
        // fill them).
        if send {
            let mut book = self.book.lock();
            let seq = book.msg_posted();
            self.msg_sends
                .lock()
                .push_back((seq, Arc::downgrade(&xfer)));
            self.enqueue(Cmd::Send(Set::Msg, ops));
        } else {
            let seq = {
                let mut r = self.msg_recvs.lock();
                r.next += 1;
                self.enqueue(Cmd::Recv(Set::Msg, ops));
                r.next - 1
            };
            let weak = Arc::downgrade(self);
            xfer.on_end(move |s| {
                if let Some(c) = weak.upgrade() {
                    c.recv_ended(seq, s);
                }
            });
        }
        self.kick();
        Ok(xfer)
    }

    /// Our receive number `seq` ended: acknowledge what has landed, in
    /// order; a failed receive leaves the message streams out of step.
    fn recv_ended(&self, seq: u64, s: &crate::transfer::Status) {
        match s {
            crate::transfer::Status::Done => {
                // The lock is held while writing, so that counts go out in
                // the order they grow.
                let mut r = self.msg_recvs.lock();
                if let Some(count) = r.landed(seq) {
                    if let Err(e) = self.send_control(&Control::MsgDone { count }) {
                        drop(r);
                        self.fail(format!("control connection write failed: {e}"));
                    }
                }
            }
            // The connection itself ended (the peer closed or went away, the
            // net failed): that is the reason every other transfer on it
            // reports too, not a protocol breach.
            crate::transfer::Status::Failed(
                f @ (Failure::Lost(_)
                | Failure::TimedOut(_)
                | Failure::Net(_)
                | Failure::Protocol(_)),
            ) => self.fail(f.clone()),
            crate::transfer::Status::Failed(f) => self.fail(Failure::Protocol(format!(
                "receive {seq} on this connection failed ({f}); the message streams are out of step"
            ))),
            crate::transfer::Status::Pending => {}
        }
    }

    /// One-sided write (`read == false`) or read of local buffers into/from
    /// the remote items (`remote_region[i]`: the peer's region id of item
    /// i). Items contiguous on both sides go as one message (a run).
    pub(crate) fn post_rma(
        self: &Arc<Self>,
        xfer_id: u64,
        read: bool,
        local: Vec<(MemRef, Arc<crate::memory::Region>)>,
        remote: Vec<RmaItem>,
        remote_region: &[u64],
    ) -> Result<Arc<Transfer>> {
        self.check_alive()?;
        let regions = distinct_regions(&local);
        let ids: Vec<(MemRef, u64)> = local.iter().map(|(m, r)| (*m, r.id)).collect();
        let runs = rma::plan_runs(&ids, &remote, remote_region);
        let local = rma::merge_runs(local, &runs).map_err(|e| Error::invalid(e.to_string()))?;
        let total = crate::inline::total(&local);
        if total <= self.inline_max && total > 0 && self.inline_room(read) {
            return Ok(self.post_inline(xfer_id, read, local, remote, runs, regions, total));
        }
        let plan = self.plan(local.iter().map(|(m, _)| m.len));
        // +1: the target's WriteDone / ReadAck.
        let xfer = Transfer::new(xfer_id, self.id, plan.len() + 1, regions);
        self.track(&xfer);
        // Its one answer is expected before the request can be answered.
        self.book.lock().expect(xfer_id, read);
        let mut ops = Some(self.ops_for(&xfer, &local, &plan, true));
        let msg = if read {
            Control::ReadReq {
                xfer: xfer_id,
                items: remote,
                runs,
            }
        } else {
            self.pending_writes
                .lock()
                .insert(xfer_id, PendingWrite::Ops(ops.take().unwrap_or_default()));
            Control::WriteReq {
                xfer: xfer_id,
                items: remote,
                runs,
            }
        };
        let mut body = Vec::new();
        msg.encode(&mut body);
        tracing::trace!(xfer = xfer_id, "lat: ctl out {}", msg.kind());
        let mut oob = self.oob.lock();
        if let Some(ops) = ops {
            // A read: its receives take their place in the order of our
            // requests for data, and are posted once the target accepts.
            self.rma_recvs.lock().asked(xfer_id, ops);
        }
        let written = self.write_locked(&mut oob, &body);
        drop(oob);
        if let Err(e) = written {
            self.fail(format!("control connection write failed: {e}"));
        }
        Ok(xfer)
    }

    /// A one-sided transfer whose data goes on the control connection:
    /// a write's right after its request, a read's in the answer. Its one
    /// event is the target's `WriteDone`, or the `ReadData` landing.
    /// Whether a small one-sided transfer may go inline now. Its bytes ride
    /// a control connection, whose backlog is bounded
    /// ([`crate::oob_out::MAX_BACKLOG`]): a burst of inline writes posted
    /// faster than the target lands them would fill ours, a burst of
    /// inline reads the peer's (their answers). While our backlog holds
    /// [`INLINE_BACKLOG`] bytes, or [`INLINE_READS`] inline reads await
    /// their data, further ones take the net.
    fn inline_room(&self, read: bool) -> bool {
        if read {
            self.pending_reads.lock().len() < INLINE_READS
        } else {
            self.oob.lock().backlog() < INLINE_BACKLOG
        }
    }

    #[allow(clippy::too_many_arguments)]
    fn post_inline(
        self: &Arc<Self>,
        xfer_id: u64,
        read: bool,
        local: Vec<(MemRef, Arc<crate::memory::Region>)>,
        remote: Vec<RmaItem>,
        runs: Vec<u32>,
        regions: Vec<Arc<crate::memory::Region>>,
        total: usize,
    ) -> Arc<Transfer> {
        tracing::trace!(xfer = xfer_id, read, bytes = total, "lat: post inline");
        let xfer = Transfer::new(xfer_id, self.id, 1, regions);
        self.track(&xfer);
        self.book.lock().expect_inline(xfer_id, read, total as u32);
        let mut body = Vec::new();
        let written = if read {
            self.pending_reads.lock().insert(xfer_id, Some(local));
            Control::ReadInline {
                xfer: xfer_id,
                items: remote,
                runs,
            }
            .encode(&mut body);
            self.write_locked(&mut self.oob.lock(), &body)
        } else {
            Control::WriteInline {
                xfer: xfer_id,
                items: remote,
                runs,
                len: total as u32,
            }
            .encode(&mut body);
            let mut oob = self.oob.lock();
            let r = crate::inline::write_with_payload(&mut *oob, &body, &local);
            tracing::trace!(xfer = xfer_id, "lat: inline write out");
            if r.is_ok() {
                self.last_tx.store(now_ms(), Ordering::Relaxed);
            }
            r
        };
        if let Err(e) = written {
            self.fail(format!("control connection write failed: {e}"));
        }
        xfer
    }

    /// Sends our answer to a peer's message; a failed write loses the
    /// connection.
    fn answer(&self, m: &Control) -> std::result::Result<(), Failure> {
        self.send_control(m)
            .map_err(|e| Failure::Lost(e.to_string()))
    }

    /// The transfer that serves a peer's accepted request over `local` in
    /// `parts` net requests; when it ends, the request's `weight` goes back
    /// to the book.
    fn serving(
        self: &Arc<Self>,
        local: &[(MemRef, Arc<crate::memory::Region>)],
        parts: usize,
        weight: usize,
    ) -> Arc<Transfer> {
        let regions = distinct_regions(local);
        let inner = Transfer::new(0, self.id, parts, regions);
        let weak = Arc::downgrade(self);
        inner.on_end(move |_| {
            if let Some(c) = weak.upgrade() {
                c.book.lock().served_end(weight);
            }
        });
        inner
    }

    fn send_control(&self, m: &Control) -> std::io::Result<()> {
        tracing::trace!("lat: ctl out {}", m.kind());
        let mut body = Vec::new();
        m.encode(&mut body);
        self.write_locked(&mut self.oob.lock(), &body)
    }

    /// Writes a frame on the control connection (its lock held by the caller).
    fn write_locked(&self, oob: &mut crate::oob_out::OobOut, body: &[u8]) -> std::io::Result<()> {
        write_frame(oob, body)?;
        self.last_tx.store(now_ms(), Ordering::Relaxed);
        Ok(())
    }

    /// Liveness, called periodically: sends a keep-alive when we have been
    /// quiet for `keepalive`, and fails the connection when the peer has
    /// been silent for `deadline`.
    pub(crate) fn tick(&self, keepalive: Duration, deadline: Duration) {
        if self.failure().is_some() {
            return;
        }
        let now = now_ms();
        let silent = now.saturating_sub(self.last_rx.load(Ordering::Relaxed));
        if silent > deadline.as_millis() as u64 {
            self.fail(Failure::TimedOut(format!(
                "peer unresponsive: nothing heard for {:.1} s (deadline {:.1} s, TCPX_P2P_DEADLINE_MS)",
                silent as f64 / 1e3,
                deadline.as_secs_f64()
            )));
            return;
        }
        if now.saturating_sub(self.last_tx.load(Ordering::Relaxed)) >= keepalive.as_millis() as u64
        {
            // Never block the watchdog: if someone is writing, that is traffic too.
            if let Some(mut oob) = self.oob.try_lock() {
                let mut body = Vec::new();
                Control::KeepAlive.encode(&mut body);
                if let Err(e) = self.write_locked(&mut oob, &body) {
                    drop(oob);
                    self.fail(format!("control connection write failed: {e}"));
                }
            }
        }
    }

    /// Carries out what [`Book::on_control`] decided about a message.
    fn on_control(
        self: &Arc<Self>,
        m: Control,
        s: &mut TcpStream,
    ) -> std::result::Result<(), Failure> {
        let cx = Ctx {
            registry: &self.registry,
            conn: self.id,
            chunk: self.chunk,
            gather: self.gather,
        };
        let action = self.book.lock().on_control(cx, m).map_err(|e| match e {
            ProtocolError::Closed => Failure::Lost(PEER_CLOSED.into()),
            e => Failure::Protocol(e.to_string()),
        })?;
        match action {
            Action::Nothing => {}
            Action::RefuseWrite { xfer, reason } => {
                tracing::warn!(
                    conn = self.id,
                    "refused a write from {}: {reason}",
                    self.peer
                );
                self.answer(&Control::Refused { xfer, reason })?;
            }
            Action::AcceptWrite {
                xfer,
                local,
                plan,
                weight,
            } => {
                let inner = self.serving(&local, plan.len(), weight);
                let weak = Arc::downgrade(self);
                inner.on_end(move |s| {
                    if let Some(c) = weak.upgrade() {
                        let m = match s {
                            crate::transfer::Status::Done => Control::WriteDone { xfer },
                            crate::transfer::Status::Failed(f) => Control::Refused {
                                xfer,
                                reason: f.to_string(),
                            },
                            crate::transfer::Status::Pending => return,
                        };
                        let _ = c.send_control(&m);
                    }
                });
                let ops = self.ops_for(&inner, &local, &plan, true);
                let mut body = Vec::new();
                Control::WriteCts { xfer }.encode(&mut body);
                tracing::trace!(xfer, "lat: ctl out WriteCts");
                let mut oob = self.oob.lock();
                self.rma_recvs.lock().cleared(ops);
                self.post_due_recvs();
                let written = self.write_locked(&mut oob, &body);
                drop(oob);
                written.map_err(|e| Failure::Lost(e.to_string()))?;
                self.kick();
            }
            Action::AcceptRead {
                xfer,
                local,
                plan,
                weight,
            } => {
                // The reader posted one receive per request of its plan of
                // the runs' lengths: ours pairs with it request for request.
                let inner = self.serving(&local, plan.len(), weight);
                let ops = self.ops_for(&inner, &local, &plan, true);
                self.answer(&Control::ReadAck { xfer })?;
                self.submit(Cmd::Send(Set::Rma, ops));
            }
            Action::RefuseRead { xfer, reason } => {
                tracing::warn!(
                    conn = self.id,
                    "refused a read from {}: {reason}",
                    self.peer
                );
                // The reader posts its receives only once we accept: a
                // refusal is one message, whatever the request claimed.
                self.answer(&Control::Refused { xfer, reason })?;
            }
            Action::SendWrite { xfer } => match self.pending_writes.lock().remove(&xfer) {
                Some(PendingWrite::Ops(ops)) => self.submit(Cmd::Send(Set::Rma, ops)),
                Some(PendingWrite::Cancelled(n)) => {
                    // The target posted n receives: fill each with an empty
                    // message; it refuses the write, which nobody awaits.
                    let inner = Transfer::new(0, self.id, n, vec![]);
                    let ops = (0..n)
                        .map(|_| ChunkOp {
                            segs: vec![],
                            xfer: inner.clone(),
                            expect: None,
                        })
                        .collect();
                    self.submit(Cmd::Send(Set::Rma, ops));
                }
                None => {
                    return Err(Failure::Protocol(format!(
                        "clear-to-send for unknown write {xfer}"
                    )))
                }
            },
            Action::Acked { xfer } => {
                let t = self.live.lock().get(&xfer).cloned();
                if let Some(t) = t {
                    t.complete_one();
                }
            }
            Action::ReadAccepted { xfer } => {
                // Only now may the peer's data land in the read's buffers.
                if !self.rma_recvs.lock().accepted(xfer) {
                    return Err(Failure::Protocol(format!(
                        "acknowledgement of read {xfer}, which awaits none"
                    )));
                }
                self.post_due_recvs();
                self.kick();
                let t = self.live.lock().get(&xfer).cloned();
                if let Some(t) = t {
                    t.complete_one();
                }
            }
            Action::LandWrite {
                xfer,
                local,
                len,
                weight,
            } => {
                tracing::trace!(xfer, bytes = len, "lat: inline write in");
                let landed = crate::inline::land(s, &local);
                self.book.lock().served_end(weight);
                drop(local);
                landed.map_err(|e| Failure::Lost(format!("inline write payload: {e}")))?;
                self.answer(&Control::WriteDone { xfer })?;
            }
            Action::DropWrite { xfer, reason, len } => {
                tracing::warn!(
                    conn = self.id,
                    "refused an inline write from {}: {reason}",
                    self.peer
                );
                crate::inline::drain(s, len)
                    .map_err(|e| Failure::Lost(format!("inline write payload: {e}")))?;
                self.answer(&Control::Refused { xfer, reason })?;
            }
            Action::SendReadData {
                xfer,
                local,
                len,
                weight,
            } => {
                let mut body = Vec::new();
                Control::ReadData {
                    xfer,
                    len: len as u32,
                }
                .encode(&mut body);
                let written = {
                    let mut oob = self.oob.lock();
                    crate::inline::write_with_payload(&mut *oob, &body, &local)
                };
                self.book.lock().served_end(weight);
                written.map_err(|e| Failure::Lost(e.to_string()))?;
                self.last_tx.store(now_ms(), Ordering::Relaxed);
            }
            Action::LandRead { xfer, len } => {
                let local = self.pending_reads.lock().remove(&xfer);
                match local {
                    // Cancelled: the length was checked against our request.
                    Some(None) => crate::inline::drain(s, len)
                        .map_err(|e| Failure::Lost(format!("inline read payload: {e}")))?,
                    Some(Some(local)) if crate::inline::total(&local) == len => {
                        crate::inline::land(s, &local)
                            .map_err(|e| Failure::Lost(format!("inline read payload: {e}")))?;
                        tracing::trace!(xfer, "lat: inline read landed");
                        let t = self.live.lock().get(&xfer).cloned();
                        if let Some(t) = t {
                            t.complete_one();
                        }
                    }
                    _ => {
                        return Err(Failure::Protocol(format!(
                            "inline data for read {xfer}, which awaits none of that length"
                        )))
                    }
                }
            }
            Action::PeerRefused { xfer, reason } => {
                self.pending_reads.lock().remove(&xfer);
                self.pending_writes.lock().remove(&xfer);
                // A refused read's receives were never posted: let them go
                // (and with them its buffers); those behind them may be due.
                let unposted = self.rma_recvs.lock().refused(xfer);
                if unposted.is_some() {
                    drop(unposted);
                    self.post_due_recvs();
                    self.kick();
                }
                let t = self.live.lock().get(&xfer).cloned();
                if let Some(t) = t {
                    t.fail(Failure::Refused(reason));
                }
            }
            // The book counted them (a close waits for that count); the
            // sends they cover have landed, whatever the net says later.
            Action::MsgsLanded { to, .. } => {
                let landed: Vec<_> = {
                    let mut q = self.msg_sends.lock();
                    let n = q.iter().take_while(|(seq, _)| *seq < to).count();
                    q.drain(..n).collect()
                };
                for (_, t) in landed {
                    if let Some(t) = t.upgrade() {
                        t.complete_all();
                    }
                }
            }
            Action::Notif { name, msg } => self
                .notifs
                .push(Notif {
                    from_name: name,
                    conn: self.id,
                    msg,
                })
                .map_err(|e| Failure::Protocol(e.to_string()))?,
        }
        Ok(())
    }

    /// What this connection holds for its peer (see [`Held`]).
    pub(crate) fn held(&self) -> Held {
        let (requests, pieces) = self.book.lock().held();
        Held {
            ops: self.engine.ops(),
            unposted: self.rma_recvs.lock().len(),
            requests,
            pieces,
        }
    }

    /// Sends a notification on the control connection (the caller checked
    /// its size against [`wire::MAX_NOTIF`]).
    pub(crate) fn send_notif(&self, name: &str, msg: &[u8]) -> Result<()> {
        self.check_alive()?;
        let m = Control::Notif {
            name: name.to_string(),
            msg: msg.to_vec(),
        };
        if let Err(e) = self.send_control(&m) {
            let why = format!("control connection write failed: {e}");
            self.fail(why.clone());
            return Err(Error::ConnectionLost {
                conn: self.id,
                reason: why,
            });
        }
        Ok(())
    }

    /// Tells the progress thread a region is gone.
    pub(crate) fn drop_region(&self, id: u64) {
        self.submit(Cmd::DropRegion(id));
    }

    /// Cancels our transfer `t` if none of its data has moved and none will
    /// touch its buffers: a write still waiting for the target's
    /// clear-to-send, or an inline read still waiting for its data. It
    /// then ends at once, failed as cancelled, and its buffers are free.
    /// Returns false for anything else (data in flight cannot be called
    /// back: it runs to its end).
    pub(crate) fn cancel(&self, t: &Transfer) -> bool {
        let cancelled = {
            let mut w = self.pending_writes.lock();
            let n = match w.get(&t.id) {
                Some(PendingWrite::Ops(ops)) => Some(ops.len()),
                _ => None,
            };
            n.map(|n| w.insert(t.id, PendingWrite::Cancelled(n)))
                .is_some()
        } || {
            let mut r = self.pending_reads.lock();
            match r.get_mut(&t.id) {
                Some(l @ Some(_)) => {
                    *l = None;
                    true
                }
                _ => false,
            }
        };
        if cancelled {
            t.fail(Failure::Cancelled);
        }
        cancelled
    }
}

/// The control connection's reader. While the peer speaks often (its last
/// frame came within `spin`), it spins up to `spin` for the next frame
/// before sleeping in the read: a blocking read's wake-up is one of the
/// larger steps of a small transfer's trip. Alternated on one H100, three
/// rounds: blocking GPU `write` 64 KiB p50 72.9-96.6 → 58.6-62.6 µs, 4 KiB
/// 52.9-64.1 → 38.5-49.2, `read` 4 KiB 54.1-56.0 → 42.4-44.9 (measured
/// with the reader also spinning whenever a transfer of ours was in
/// flight; that part was dropped: with large transfers in flight, frames
/// come milliseconds apart and the spin only takes cores from the I/O
/// threads).
/// The connection's progress loop on the I/O workers: rounds while there
/// is work, idle (no thread) once nothing has been outstanding for
/// `linger`; woken by the net's waker and by posts it must finish.
struct ProgressTask {
    engine: Arc<Engine>,
    conn: Weak<Conn>,
    /// The admission room the connection holds until its engine ends.
    _room: Option<Box<dyn std::any::Any + Send>>,
    linger: Duration,
}

impl Task for ProgressTask {
    fn run(&mut self) -> Step {
        let Some(why) = self.engine.run_until_idle(self.linger) else {
            return Step::Idle;
        };
        if let Some(c) = self.conn.upgrade() {
            c.fail(why);
        }
        Step::Done
    }
}

/// The control connection's reader on the I/O workers: reads and handles
/// frames while they come, then waits (no thread) for the next.
struct OobReader {
    conn: Weak<Conn>,
    s: TcpStream,
    spin: Duration,
    linger: Duration,
    /// When the last frame was read.
    last: Option<Instant>,
}

impl Task for OobReader {
    fn run(&mut self) -> Step {
        use crate::net::socket::wait_readable;
        loop {
            {
                if self.last.is_some_and(|t| t.elapsed() < self.spin) {
                    crate::net::socket::poll_readable(&self.s, self.spin);
                }
                // Returns at once when bytes wait (one system call, as the
                // read's own wait would be).
                if !wait_readable(&self.s, self.linger) {
                    if self.conn.strong_count() == 0 {
                        return Step::Done;
                    }
                    return Step::Readable(std::os::fd::AsRawFd::as_raw_fd(&self.s));
                }
            }
            let r = read_frame(&mut self.s, wire::MAX_FRAME);
            self.last = Some(Instant::now());
            let Some(c) = self.conn.upgrade() else {
                return Step::Done;
            };
            if r.is_ok() {
                c.last_rx.store(now_ms(), Ordering::Relaxed);
            }
            let res = match r {
                Err(e) => {
                    if e.kind() == std::io::ErrorKind::UnexpectedEof {
                        Err(Failure::Lost(
                            "peer went away (control connection closed)".to_string(),
                        ))
                    } else {
                        Err(Failure::Lost(format!("control connection: {e}")))
                    }
                }
                Ok(b) => match Control::decode(&b) {
                    Err(e) => Err(Failure::Protocol(format!(
                        "peer sent a malformed control message: {e}"
                    ))),
                    Ok(m) => {
                        tracing::trace!("lat: ctl in {}", m.kind());
                        c.on_control(m, &mut self.s)
                    }
                },
            };
            if let Err(why) = res {
                c.fail(why);
                return Step::Done;
            }
        }
    }
}

/// The regions of `items`, each once per run of items in it (what a
/// transfer holds until it ends): a list of 131,072 blocks in one region
/// holds it once, not 131,072 times.
fn distinct_regions(
    items: &[(MemRef, Arc<crate::memory::Region>)],
) -> Vec<Arc<crate::memory::Region>> {
    let mut out: Vec<Arc<crate::memory::Region>> = Vec::new();
    for (_, r) in items {
        if !out.last().is_some_and(|l| Arc::ptr_eq(l, r)) {
            out.push(r.clone());
        }
    }
    out
}
