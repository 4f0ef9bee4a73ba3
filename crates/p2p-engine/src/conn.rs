//! One peer: a control connection (handshake, then control messages) and
//! two sets of channels, each channel a send comm and a receive comm of the
//! net. Two-sided messages use the `Msg` set and match in posting order.
//! One-sided data uses the `Rma` set, whose order on each direction the
//! data's receiver decides: it tells the sender (a `WriteCts` for a write,
//! the `ReadReq` itself for a read) in the order its receives take their
//! place, and the sender posts in arrival order; the receiver posts its
//! receives in the same order, a read's once the sender has accepted it
//! ([`crate::rma_recvs`]).
//!
//! Every protocol decision is the connection's machine's
//! ([`crate::proto::Proto`], no I/O, no clock); a `Conn` holds it behind
//! one state lock with the live transfers its ids name, feeds it the
//! application's calls, the control messages its reader takes, the ends of
//! transfers and the watchdog's ticks, and carries out the effects it asks
//! for ([`Conn::drive`]).

use std::collections::{HashMap, HashSet};
use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, OnceLock, Weak};
use std::thread::Thread;
use std::time::{Duration, Instant};

use crossbeam_channel::Sender;
use parking_lot::Mutex;

use crate::ctl::Ctl;
use crate::error::{Error, Result};
use crate::handler::Limits;
use crate::handshake::{self, Role};
use crate::memory::Registry;
use crate::net::{DataPaths, MemRef, Net, PeerInfo, RecvComm, SendComm, Waker};
use crate::notif::{Notif, NotifQueue};
use crate::pieces::Pieces;
use crate::progress::{ChunkOp, Cmd, Engine, Progress, Until};
use crate::proto::{self, Effect, Payload, Proto, Requested, Serve, Setup, PEER_CLOSED};
use crate::rma;
use crate::transfer::{plan_ops, Ends, Failure, Gather, OpPlan, Status, Transfer, Watch};
use crate::wire::{self, Control, PullRun, RmaItem};
use crate::workers::{Home, Step, Task, Workers};

/// Most runs a write offered for pulling may have: their keys (about 110
/// bytes each on the same-host net) stay well inside a control frame.
const PULL_MAX_RUNS: usize = 4096;

/// Longest a waiting thread sleeps before it looks again by itself.
const WAIT_SLICE: Duration = Duration::from_millis(10);

/// Milliseconds on a process-wide monotonic clock.
pub(crate) fn now_ms() -> u64 {
    static EPOCH: OnceLock<Instant> = OnceLock::new();
    EPOCH.get_or_init(Instant::now).elapsed().as_millis() as u64
}

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
    pub(crate) fn for_peer(&self, oob: &Ctl) -> ConnParams {
        let (Ok(peer), Ok(local)) = (oob.peer_addr(), oob.local_addr()) else {
            return self.clone();
        };
        self.with_net(self.paths.choose(&PeerInfo { peer, local }))
    }

    /// The parameters of a connection whose data rides `net`.
    pub(crate) fn with_net(&self, net: Arc<dyn Net>) -> ConnParams {
        ConnParams {
            chunk: net
                .preferred_chunk()
                .map_or(self.chunk, |c| c.min(net.max_message())),
            net,
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

/// A connection's protocol machine and the transfers its ids name: the
/// one lock of a connection's state (taken before the control
/// connection's writing end, never after).
struct State {
    proto: Proto<Vec<ChunkOp>>,
    /// User transfers of this connection, by id: completed and failed as
    /// the machine says, failed together if the connection breaks.
    live: Live,
    /// The peer's reads we granted, by its transfer id: each holds the
    /// granted range's regions until the peer's `ReadDone` (or the
    /// connection's end) completes it.
    grants: HashMap<u64, Arc<Transfer>>,
}

/// A connection's user transfers by id. Ended ones are let go as new ones
/// come (a sweep when the map has doubled since the last), not by a
/// callback at each end: no lock is taken and nothing runs when a
/// transfer ends, and what is kept stays within twice what is running
/// (or [`Live::SWEEP_MIN`]).
#[derive(Default)]
struct Live {
    map: HashMap<u64, Arc<Transfer>>,
    sweep_at: usize,
}

impl Live {
    const SWEEP_MIN: usize = 64;

    fn insert(&mut self, t: &Arc<Transfer>) {
        if t.ended() {
            return;
        }
        self.map.insert(t.id, t.clone());
        if self.map.len() >= self.sweep_at.max(Self::SWEEP_MIN) {
            self.map.retain(|_, t| !t.ended());
            self.sweep_at = 2 * self.map.len();
        }
    }

    /// Transfer `id`, if it has not ended.
    fn get(&self, id: u64) -> Option<&Arc<Transfer>> {
        self.map.get(&id).filter(|t| !t.ended())
    }

    /// Every transfer kept (the connection ends).
    fn take_all(&mut self) -> Vec<Arc<Transfer>> {
        self.map.drain().map(|(_, t)| t).collect()
    }
}

/// What is left to do once the state lock is let go: ending a watched
/// transfer holds its end for the machine (see [`Conn::hear_ends`]).
enum Later {
    Complete(Arc<Transfer>),
    CompleteAll(Arc<Transfer>),
    Fail(Arc<Transfer>, Failure),
    Abandon(Vec<ChunkOp>, Failure),
}

/// What carrying out a batch of effects left to do after the lock.
#[derive(Default)]
struct Done {
    /// Control frames to write, in order (with the bytes that follow
    /// some), once the writing end is held and the state let go.
    frames: Vec<(Control, Option<proto::Landing>)>,
    later: Vec<Later>,
    /// Requests were queued for progress.
    posted: bool,
    /// A control write failed: the connection is lost.
    broken: Option<std::io::Error>,
}

pub struct Conn {
    pub id: u64,
    pub peer: SocketAddr,
    pub remote_gpu: i32,
    pub remote_bdf: String,
    /// The name of the net this connection's data rides.
    pub net: String,
    /// The net, where it has a one-sided path: our writes are offered to
    /// the target to pull, and reads granted ([`Conn::keys`]).
    exporter: Option<Arc<dyn Net>>,
    /// Regions registered on the caller's behalf by `advertise_ipc` on this
    /// connection: they live as long as it does.
    ipc_regions: Mutex<HashSet<u64>>,
    pub chunk: usize,
    /// How small items share a request on this connection's net.
    gather: Gather,
    /// The control connection's writing end: frames are written in the
    /// order the machine gives them, under the state lock.
    oob: Mutex<crate::oob_out::OobOut>,
    cmds: Sender<Cmd>,
    /// The progress task (on the endpoint's I/O workers): woken for work
    /// the posting thread left.
    progress: Arc<OnceLock<Arc<Home>>>,
    engine: Arc<Engine>,
    registry: Arc<Registry>,
    closed: AtomicBool,
    /// Set once the machine has failed: a post checks it without the state
    /// lock (the machine's own check, under the lock, decides).
    broken: AtomicBool,
    /// The protocol machine and the live transfers (see [`State`]).
    state: Mutex<State>,
    /// Ends of watched transfers (our receives, the requests serving the
    /// peer's, transfers with a notification after them), held until the
    /// machine has heard them ([`Conn::hear_ends`]).
    ends: Arc<Ends>,
    /// Threads blocked in [`Conn::wait_on`]: the net's waker wakes them.
    waiters: Arc<Mutex<Vec<Thread>>>,
    /// The connection's tasks on the I/O workers (progress, control
    /// reader, control writer), waited for at close.
    tasks: Mutex<Vec<Arc<Home>>>,
    /// The endpoint's notification queue.
    notifs: Arc<NotifQueue>,
    /// One-sided transfers up to this size go inline (see [`crate::inline`]).
    inline_max: usize,
    /// How long an orderly close waits for the peer to acknowledge our
    /// sends (the liveness deadline): a send completes once its bytes are
    /// out of the caller's buffer, and a close delivers what was sent.
    delivery: Duration,
}

impl Conn {
    /// Runs the handshake on a fresh control connection and starts the
    /// connection's threads. `initiator` is the side that called connect;
    /// an accepting side passes its `gate` (what the endpoint asks of an
    /// accepted handshake: see [`handshake::Gate`]).
    pub(crate) fn establish(
        id: u64,
        mut oob: Ctl,
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
        let ends = Ends::new();
        let conn = Arc::new(Conn {
            id,
            peer,
            remote_gpu: theirs.gpu_index,
            remote_bdf: theirs.gpu_bdf.clone(),
            net: net.name().to_string(),
            exporter: net.pulls().then(|| net.clone()),
            ipc_regions: Mutex::new(HashSet::new()),
            chunk,
            gather: Gather::new(chunk, net.max_segments()),
            oob: Mutex::new(crate::oob_out::OobOut::new(oob)),
            cmds: tx,
            progress: progress_thread.clone(),
            engine: engine.clone(),
            registry: p.registry.clone(),
            closed: AtomicBool::new(false),
            broken: AtomicBool::new(false),
            state: Mutex::new(State {
                proto: Proto::new(Setup {
                    registry: p.registry.clone(),
                    conn: id,
                    chunk,
                    gather: Gather::new(chunk, net.max_segments()),
                    limits: p.limits,
                    now: now_ms(),
                    pull: net.pulls(),
                }),
                live: Live::default(),
                grants: HashMap::new(),
            }),
            ends: ends.clone(),
            waiters,
            tasks: Mutex::new(Vec::new()),
            notifs: p.notifs.clone(),
            inline_max: p.inline_max,
            delivery: p.deadline,
        });
        let ptask = p.workers.start(Box::new(ProgressTask {
            engine,
            ends,
            conn: Arc::downgrade(&conn),
            _room: room,
            linger: p.linger,
            workers: p.workers.clone(),
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
                workers: p.workers.clone(),
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
    /// Runs `f` on the machine under the state lock and carries out the
    /// effects it queued: requests queued for progress while the lock is
    /// held (the command queue never waits), frames written in the
    /// machine's order under the writing end's lock, taken before the state
    /// is let go; then transfers ended, the progress engine kicked for
    /// what was queued, the connection failed if a control write failed,
    /// and the ends held for the machine heard ([`Conn::hear_ends`]).
    fn drive<R>(&self, f: impl FnOnce(&mut State, &mut Done) -> R) -> R {
        let mut done = Done::default();
        let (r, oob) = {
            let mut st = self.state.lock();
            let r = f(&mut st, &mut done);
            self.carry_out(&mut st, &mut done);
            // The writing end is taken before the state is let go, so that
            // frames leave in the machine's order; the state is let go
            // before the socket is written, so that the answer to a frame
            // (on the control reader) never waits for the write's end.
            let oob = (!done.frames.is_empty()).then(|| {
                st.proto.wrote(now_ms());
                self.oob.lock()
            });
            (r, oob)
        };
        if let Some(mut oob) = oob {
            tracing::trace!(frames = done.frames.len(), "lat: ctl writer taken");
            for (m, payload) in done.frames.drain(..) {
                let frame = m.to_frame();
                let written = match &payload {
                    None => std::io::Write::write_all(&mut *oob, &frame),
                    Some(local) => crate::inline::write_with_payload(&mut *oob, &frame, local),
                };
                tracing::trace!(xfer = m.xfer().unwrap_or(0), "lat: ctl out {}", m.kind());
                if let Err(e) = written {
                    done.broken = Some(e);
                    break;
                }
            }
        }
        self.after(done);
        r
    }

    /// Carries out the machine's queued effects (the state lock held):
    /// requests are queued for progress at once, frames gathered for
    /// [`Conn::drive`] to write.
    fn carry_out(&self, st: &mut State, done: &mut Done) {
        while let Some(e) = st.proto.poll() {
            match e {
                Effect::Send(m) => done.frames.push((m, None)),
                Effect::SendWithPayload(m, local) => done.frames.push((m, Some(local))),
                Effect::Post {
                    set,
                    send,
                    requests,
                } => {
                    let ops = match requests {
                        Requested::Ours(ops) => ops,
                        Requested::Serve(s) => self.serving(s, None, done),
                        // Pulls pair with no send of the peer's: dealt
                        // outside the set's order.
                        Requested::Remote { serve, runs } => {
                            let ops = self.serving(serve, Some(runs), done);
                            self.enqueue(Cmd::Pull(ops));
                            done.posted = true;
                            continue;
                        }
                        Requested::Granted { xfer, ops, src } => {
                            self.granted(st, xfer, ops, src, done);
                            continue;
                        }
                        Requested::Fill(n) => {
                            let inner = Transfer::new(0, self.id, n, vec![]);
                            (0..n)
                                .map(|_| ChunkOp {
                                    segs: Pieces::default(),
                                    xfer: inner.clone(),
                                    expect: None,
                                    remote: vec![],
                                    plan: None,
                                })
                                .collect()
                        }
                    };
                    self.enqueue(if send {
                        Cmd::Send(set, ops)
                    } else {
                        Cmd::Recv(set, ops)
                    });
                    done.posted = true;
                }
                Effect::Complete(x) => {
                    if let Some(t) = st.live.get(x) {
                        done.later.push(Later::Complete(t.clone()));
                    }
                }
                Effect::CompleteAll(x) => {
                    if let Some(t) = st.live.get(x) {
                        done.later.push(Later::CompleteAll(t.clone()));
                    }
                }
                Effect::Fail(x, f) => {
                    if let Some(t) = st.live.get(x) {
                        done.later.push(Later::Fail(t.clone(), f));
                    }
                }
                Effect::Abandon(ops, f) => done.later.push(Later::Abandon(ops, f)),
                Effect::Grant { serve, tokens } => self.grant(st, serve, &tokens, done),
                Effect::Release(xfer) => {
                    if let Some(t) = st.grants.remove(&xfer) {
                        done.later.push(Later::Complete(t));
                    }
                }
            }
        }
    }

    /// What [`Conn::carry_out`] left for after the lock.
    fn after(&self, done: Done) {
        for l in done.later {
            match l {
                Later::Complete(t) => t.complete_one(),
                Later::CompleteAll(t) => t.complete_all(),
                Later::Fail(t, f) => {
                    t.fail(f);
                }
                Later::Abandon(ops, f) => {
                    for op in ops {
                        op.xfer.fail(f.clone());
                    }
                }
            }
        }
        if let Some(e) = done.broken {
            self.fail(format!("control connection write failed: {e}"));
        }
        if done.posted {
            self.kick();
        }
        self.hear_ends();
    }

    /// Feeds the machine the ends held for it (see [`Ends`]), then
    /// publishes each: a receive is counted, and a served request's
    /// answer and a notification after a transfer leave, before anyone
    /// waiting on the transfer sees it end (one thread at a time:
    /// [`Ends::hear`]).
    fn hear_ends(&self) {
        self.ends.hear(|h| {
            let outcome = match &h.status {
                Status::Failed(f) => Err(f.clone()),
                _ => Ok(()),
            };
            for w in &h.watch {
                self.hear(w, &outcome);
            }
        });
    }

    /// The machine hears one watched end (`outcome`).
    fn hear(&self, w: &Watch, outcome: &std::result::Result<(), Failure>) {
        match w {
            // Our receive ended: the machine acknowledges what has landed,
            // in order, or fails the connection.
            Watch::Recv { seq } => {
                if let Err(f) = self.drive(|st, _| st.proto.recv_ended(*seq, outcome.clone())) {
                    self.fail(f);
                }
            }
            Watch::Served {
                xfer,
                weight,
                answer,
            } => self.drive(|st, _| {
                st.proto
                    .served_ended(*xfer, *weight, *answer, outcome.clone())
            }),
            Watch::Granted { xfer } => self.drive(|st, _| st.proto.granted_ended(*xfer)),
            Watch::Leased { used } => self.drive(|st, _| st.proto.leased_ended(used)),
            Watch::Forget { regions } => {
                for &id in regions {
                    self.drop_region(id);
                }
            }
            Watch::Notify { name, msg } => {
                if outcome.is_ok() {
                    if let Err(e) = self.send_notif(name, msg) {
                        tracing::warn!(
                            conn = self.id,
                            "notification after a transfer not sent: {e}"
                        );
                    }
                }
            }
        }
    }

    /// Has `t`'s end held with `w` until the machine has heard it (see
    /// [`Conn::hear_ends`]); heard now if it has ended already.
    pub(crate) fn watch(&self, t: &Arc<Transfer>, w: Watch) {
        if t.watch(&self.ends, w) {
            self.hear_ends();
        }
    }

    /// Grants the peer's accepted read: `ReadGrant` with the keys of its
    /// runs, and a transfer holding the range's regions until the peer's
    /// `ReadDone`, whose end the machine hears ([`Watch::Served`]). Where
    /// the net gives no key for a run (or the keys would not fit one
    /// frame), the read is served by sending instead. The grant also
    /// leases what it can of `tokens`, the advertisements the read names
    /// ([`Conn::leases`]).
    fn grant(&self, st: &mut State, serve: Serve, tokens: &[wire::Token], done: &mut Done) {
        let Some(src) = self.keys(&serve.local, 0) else {
            st.proto.grant_failed(serve);
            return;
        };
        let key_bytes = src.iter().map(|p| p.key.len()).sum();
        let room = wire::MAX_FRAME.saturating_sub(wire::pull_frame_len(0, src.len(), key_bytes));
        let leases = self.leases(st, tokens, room);
        let held = Transfer::new(0, self.id, 1, serve.local.regions());
        held.watch(
            &self.ends,
            Watch::Served {
                xfer: serve.xfer,
                weight: serve.weight,
                answer: serve.answer,
            },
        );
        st.grants.insert(serve.xfer, held);
        done.frames.push((
            Control::ReadGrant {
                xfer: serve.xfer,
                src,
                leases,
            },
            None,
        ));
    }

    /// Leases of the advertisements `tokens` for a grant, within `room`
    /// bytes of its frame: each still ours for this peer, exported whole,
    /// and recorded by the machine, which holds its region until the
    /// peer's `Revoked` (see [`crate::lease`]).
    fn leases(&self, st: &mut State, tokens: &[wire::Token], room: usize) -> Vec<wire::Lease> {
        let mut out: Vec<wire::Lease> = Vec::new();
        // The leases' count, then each lease (`wire::leases_len`).
        let mut used = wire::leases_len(&[]);
        for token in st.proto.lease_wanted(tokens) {
            let Some((lease, region)) = self.lease_of(token) else {
                continue;
            };
            let len = wire::lease_len(&lease);
            if used + len > room {
                break;
            }
            used += len;
            st.proto.lease_given(token, region);
            out.push(lease);
        }
        out
    }

    /// The lease of our advertisement `token` to the peer, and its region:
    /// the whole advertised range, exported; writable where it is an
    /// `advertise_ipc` record of this connection (never revoked, it lives
    /// as long as the connection). None where the net exports nothing.
    /// Looked up under the state lock: a deregistration that removed the
    /// advertisement already has revoked what it found, and finds this
    /// lease if it comes after.
    fn lease_of(&self, token: wire::Token) -> Option<(wire::Lease, Arc<crate::memory::Region>)> {
        let net = self.exporter.as_ref()?;
        let (addr, len, region) = self.registry.leasable(token, self.id).ok()?;
        let mem = MemRef {
            addr,
            len: len as usize,
            kind: region.kind,
        };
        let key = net.export(mem).filter(|k| k.len() <= wire::MAX_PULL_KEY)?;
        let lease = wire::Lease {
            token,
            addr,
            len,
            gpu: matches!(region.kind, crate::memory::MemKind::Cuda(_)),
            write: self.ipc_regions.lock().contains(&region.id),
            key,
        };
        Some((lease, region))
    }

    /// Leases the `advertise_ipc` record `token` to the peer now (for
    /// reads and writes), within the connection's bound of leases: the
    /// peer's first call on it needs no request either.
    pub(crate) fn lease_ipc(&self, token: wire::Token) {
        self.drive(|st, _| {
            if st.proto.lease_wanted(&[token]).is_empty() {
                return;
            }
            if let Some((lease, region)) = self.lease_of(token) {
                st.proto.lease_record(lease, region);
            }
        });
    }

    /// Region `id` is being deregistered: the machine revokes the peer's
    /// leases over it (their holds end when it answers `Revoked`).
    pub(crate) fn revoke_region(&self, id: u64) {
        self.drive(|st, _| st.proto.revoke_region(id));
    }

    /// Our read (`write` false) of `remote` (in `runs`) into `local`, or
    /// write of `local` into it, where leases the peer gave cover it: its
    /// requests copy straight between the peer's memory and ours (a read's
    /// are pulls, a write's pushes), with no request and no answer, and
    /// its end tells the machine which leases it no longer uses
    /// ([`Watch::Leased`]). `gpu`: which of our runs are device memory.
    /// None where leases do not cover it.
    fn post_leased(
        &self,
        xfer_id: u64,
        write: bool,
        local: &Pieces,
        remote: &[RmaItem],
        runs: &[u32],
        gpu: &[bool],
    ) -> Option<Arc<Transfer>> {
        let (srcs, used) = self.drive(|st, _| st.proto.leased(write, remote, runs, gpu))?;
        let plan = self.plan(local.mems().iter().map(|m| m.len));
        let xfer = Transfer::new(xfer_id, self.id, plan.len(), local.regions());
        let mut ops = Self::ops_for(&xfer, local, &plan, true);
        if point_at(&mut ops, &srcs).is_err() {
            self.drive(|st, _| st.proto.leased_ended(&used));
            return None;
        }
        tracing::trace!(xfer = xfer_id, write, leases = used.len(), "lat: leased");
        self.watch(&xfer, Watch::Leased { used });
        self.drive(|st, done| {
            if Self::track(st, &xfer, done) {
                self.enqueue(if write {
                    Cmd::Push(ops)
                } else {
                    Cmd::Pull(ops)
                });
                done.posted = true;
            }
        });
        Some(xfer)
    }

    /// Our offered read `xfer` was granted: its receives `ops` copy from
    /// the peer's memory (`src`, a key per run of the read), and its end is
    /// answered `ReadDone` ([`Watch::Granted`]). A grant whose keys do not
    /// match the read's runs fails it.
    fn granted(
        &self,
        st: &mut State,
        xfer: u64,
        mut ops: Vec<ChunkOp>,
        src: Vec<PullRun>,
        done: &mut Done,
    ) {
        if let Some(t) = st.live.get(xfer) {
            t.watch(&self.ends, Watch::Granted { xfer });
        }
        let keys: Vec<crate::lease::RunSrc> =
            src.into_iter().map(|p| (Arc::from(p.key), 0)).collect();
        if let Err(p) = point_at(&mut ops, &keys) {
            let why = Failure::Protocol(format!(
                "the peer granted read {xfer} {} keys, which do not cover its request {p:?}",
                keys.len()
            ));
            done.later.push(Later::Abandon(ops, why));
            return;
        }
        self.enqueue(Cmd::Pull(ops));
        done.posted = true;
    }

    /// The requests that serve a peer's accepted request, under a transfer
    /// whose end the machine hears ([`Watch::Served`]). It waits for one
    /// more event than its requests, given after the state lock is let go.
    /// With `remote`, each request pulls from the peer's memory there.
    fn serving(&self, s: Serve, remote: Option<Vec<PullRun>>, done: &mut Done) -> Vec<ChunkOp> {
        let inner = Transfer::new(0, self.id, s.plan.len() + 1, s.local.regions());
        inner.watch(
            &self.ends,
            Watch::Served {
                xfer: s.xfer,
                weight: s.weight,
                answer: s.answer,
            },
        );
        let mut refs = remote
            .map(|runs| proto::pull_refs(&s.local, &s.plan, runs))
            .unwrap_or_default()
            .into_iter();
        let ops = proto::requests(&s.local, &s.plan, true, |segs, expect| ChunkOp {
            segs,
            xfer: inner.clone(),
            expect,
            remote: refs.next().unwrap_or_default(),
            plan: None,
        });
        done.later.push(Later::Complete(inner));
        ops
    }

    /// Queues a command in order; safe under the state lock.
    fn enqueue(&self, cmd: Cmd) {
        if self.cmds.send(cmd).is_err() {
            // The progress thread is gone; the connection has failed already
            // and the transfers are failed by `fail`.
        }
    }

    /// Posts at once from this thread when the engine is free, and wakes the
    /// progress thread for what remains (on a net with a waker, requests
    /// posted here call for it when they complete: no wake-up, and on a
    /// small machine no core taken, per message). Never call it holding the
    /// state lock: a round of progress may complete transfers whose
    /// completion comes back to the machine.
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
        let r = self.engine.try_step();
        self.hear_ends();
        match r {
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
            let r = self.engine.step_now();
            // The round may have ended `t`: it is published once heard.
            self.hear_ends();
            if let Err(why) = r {
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
        self.state.lock().proto.failure().cloned()
    }

    fn check_alive(&self) -> Result<()> {
        if !self.broken.load(Ordering::Acquire) {
            return Ok(());
        }
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
        let (first, fl) = {
            let mut st = self.state.lock();
            let first = st.proto.fail(why.clone());
            self.broken.store(true, Ordering::Release);
            (first, st.proto.failure().cloned().unwrap_or(why))
        };
        if first {
            let peer_closed = matches!(&fl, Failure::Lost(r) if r == PEER_CLOSED);
            if self.closed.load(Ordering::Acquire) || peer_closed {
                tracing::debug!(conn = self.id, peer = %self.peer, "connection closed: {fl}");
            } else {
                tracing::warn!(conn = self.id, peer = %self.peer, "connection failed: {fl}");
            }
            let _ = self.cmds.send(Cmd::Shutdown(fl.clone()));
            if let Some(t) = self.progress.get() {
                t.wake();
            }
            let oob = self.oob.lock();
            oob.close();
            let _ = oob.stream().shutdown(std::net::Shutdown::Both);
        }
        if !self.engine.stop_now(&fl) {
            return;
        }
        let (live, abandoned) = {
            let mut st = self.state.lock();
            st.proto.abandon();
            let mut abandoned = Vec::new();
            while let Some(e) = st.proto.poll() {
                if let Effect::Abandon(ops, _) = e {
                    abandoned.push(ops);
                }
            }
            let mut live = st.live.take_all();
            live.extend(st.grants.drain().map(|(_, t)| t));
            (live, abandoned)
        };
        for t in live {
            t.fail(fl.clone());
        }
        // The machine has failed: what is held is published as it ended,
        // and later ends at once.
        self.ends.close();
        for op in abandoned.into_iter().flatten() {
            op.xfer.fail(fl.clone());
        }
        self.registry.forget_conn(self.id);
        for id in std::mem::take(&mut *self.ipc_regions.lock()) {
            self.registry.forget(id);
        }
    }

    /// Keeps region `id` (registered by `advertise_ipc`) until the
    /// connection ends; at most [`MAX_IPC_REGIONS`].
    pub(crate) fn keep_ipc_region(&self, id: u64) -> Result<()> {
        let mut v = self.ipc_regions.lock();
        if v.len() >= MAX_IPC_REGIONS {
            return Err(Error::invalid(format!(
                "connection {}: {MAX_IPC_REGIONS} advertise_ipc records already; they live as long as the connection",
                self.id
            )));
        }
        if self.broken.load(Ordering::Acquire) || self.closed.load(Ordering::Acquire) {
            return Err(Error::invalid(format!("connection {} has ended", self.id)));
        }
        v.insert(id);
        Ok(())
    }

    /// Orderly close: waits (up to the deadline) until the peer has
    /// acknowledged every message we sent, tells the peer, fails what is
    /// still in flight, joins threads.
    pub(crate) fn close(self: &Arc<Self>) {
        if self.closed.swap(true, Ordering::AcqRel) {
            return;
        }
        self.deliver_sent();
        if self.failure().is_none() {
            self.drive(|st, _| st.proto.close());
            if self.failure().is_none() {
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
    /// after `send` returns and lose nothing. The peer acknowledges
    /// together ([`crate::proto::ACK_EVERY`]): each look that finds
    /// messages unacknowledged asks it for its count.
    fn deliver_sent(&self) {
        let until = Instant::now() + self.delivery;
        let mut pause = Duration::from_micros(50);
        loop {
            let unacked = {
                let st = self.state.lock();
                if st.proto.failure().is_some() {
                    return;
                }
                st.proto.msgs_unacked()
            };
            if unacked == 0 {
                return;
            }
            self.drive(|st, _| st.proto.ask_acks());
            if Instant::now() >= until {
                tracing::warn!(
                    conn = self.id,
                    peer = %self.peer,
                    unacked,
                    "closing with messages the peer has not acknowledged within {:.1} s",
                    self.delivery.as_secs_f64()
                );
                return;
            }
            std::thread::sleep(pause);
            pause = (pause * 2).min(Duration::from_millis(5));
        }
    }

    /// Makes `t` one of the connection's live transfers (the state lock
    /// held): false, and `t` failed after the lock, if the connection has
    /// failed. (A transfer of no events has ended already: it is not
    /// kept.)
    fn track(st: &mut State, t: &Arc<Transfer>, done: &mut Done) -> bool {
        if let Some(f) = st.proto.failure() {
            done.later.push(Later::Fail(t.clone(), f.clone()));
            return false;
        }
        st.live.insert(t);
        true
    }

    /// The requests that carry items of these lengths (see [`plan_ops`]).
    fn plan(&self, lens: impl Iterator<Item = usize>) -> Vec<OpPlan> {
        let lens: Vec<usize> = lens.collect();
        plan_ops(&lens, self.chunk, self.gather)
    }

    /// The chunk ops of `plan` over `items` for our transfer `xfer`.
    fn ops_for(xfer: &Arc<Transfer>, items: &Pieces, plan: &[OpPlan], exact: bool) -> Vec<ChunkOp> {
        let mut ops = proto::requests(items, plan, exact, |segs, expect| ChunkOp {
            segs,
            xfer: xfer.clone(),
            expect,
            remote: vec![],
            plan: None,
        });
        for (op, p) in ops.iter_mut().zip(plan) {
            op.plan = Some(*p);
        }
        ops
    }

    /// Two-sided send or receive of a list of buffers.
    pub(crate) fn post_msg(
        self: &Arc<Self>,
        xfer_id: u64,
        send: bool,
        items: Pieces,
    ) -> Result<Arc<Transfer>> {
        self.check_alive()?;
        tracing::trace!(xfer = xfer_id, send, "lat: post");
        let regions = items.regions();
        let plan = self.plan(items.mems().iter().map(|m| m.len));
        // A send completes once its requests have: its bytes are out of
        // the caller's buffer. The receiver's acknowledgements (`MsgDone`)
        // are counted, and an orderly close waits for them
        // ([`Conn::deliver_sent`]).
        let events = plan.len();
        let xfer = Transfer::new(xfer_id, self.id, events, regions);
        let ops = Self::ops_for(&xfer, &items, &plan, false);
        // Numbered and queued under the state lock, so that the numbers
        // follow the order in which the engine posts them (and the peer's
        // messages fill them).
        // A receive's end is watched before its requests can be posted
        // (they are, once the state lock is let go).
        let ends = &self.ends;
        self.drive(|st, done| {
            if !Self::track(st, &xfer, done) {
                return;
            }
            if send {
                st.proto.post_send(xfer_id, ops);
            } else {
                let seq = st.proto.post_recv(ops);
                xfer.watch(ends, Watch::Recv { seq });
            }
        });
        Ok(xfer)
    }

    /// One-sided write (`read == false`) or read of local buffers into/from
    /// the remote items (`remote_region[i]`: the peer's region id of item
    /// i). Items contiguous on both sides go as one message (a run).
    pub(crate) fn post_rma(
        self: &Arc<Self>,
        xfer_id: u64,
        read: bool,
        local: Pieces,
        remote: Vec<RmaItem>,
        remote_region: &[u64],
    ) -> Result<Arc<Transfer>> {
        self.check_alive()?;
        if remote.len() > crate::wire::MAX_RMA_ITEMS {
            // The peer would end the connection over such a request.
            return Err(Error::invalid(format!(
                "{} items in one one-sided request; at most {}",
                remote.len(),
                crate::wire::MAX_RMA_ITEMS
            )));
        }
        // Where a large list's posting time goes, step by step (traced):
        // the runs, the requests' ops, the keys, letting go of our list of
        // runs (a region handle per run of them in one region), the state
        // machine.
        let clock = crate::net::timing::Steps::start(tracing::enabled!(tracing::Level::TRACE));
        let regions = local.regions();
        let runs = rma::plan_runs(&local, &remote, remote_region);
        let local = rma::merge_runs(local, &runs).map_err(|e| Error::invalid(e.to_string()))?;
        let total = local.total();
        // On a net with a one-sided path a read is offered (`dst_gpu`: which
        // of our runs are device memory), never inline: its grant costs the
        // same round trip, and leases what it names for the reads after
        // it. A read the peer's leases cover needs no request at all, nor
        // does a write into records it leased for writes.
        let ours_gpu = self.exporter.is_some().then(|| device_runs(&local));
        if let (Some(gpu), true) = (&ours_gpu, total > 0) {
            if let Some(t) = self.post_leased(xfer_id, !read, &local, &remote, &runs, gpu) {
                return Ok(t);
            }
        }
        let dst_gpu = ours_gpu.filter(|_| read);
        if total <= self.inline_max && total > 0 && dst_gpu.is_none() && self.inline_room(read) {
            // A one-sided transfer whose data goes on the control
            // connection: a write's right after its request, a read's in
            // the answer. Its one event is the target's `WriteDone`, or the
            // `ReadData` landing.
            tracing::trace!(xfer = xfer_id, read, bytes = total, "lat: post inline");
            let xfer = Transfer::new(xfer_id, self.id, 1, regions);
            self.drive(|st, done| {
                if Self::track(st, &xfer, done) {
                    if read {
                        st.proto.post_inline_read(xfer_id, local, remote, runs);
                    } else {
                        st.proto.post_inline_write(xfer_id, local, remote, runs);
                    }
                }
            });
            return Ok(xfer);
        }
        let t_runs = clock.at();
        let plan = self.plan(local.mems().iter().map(|m| m.len));
        // +1: the target's WriteDone / ReadAck.
        let xfer = Transfer::new(xfer_id, self.id, plan.len() + 1, regions);
        let ops = Self::ops_for(&xfer, &local, &plan, true);
        let t_ops = clock.at();
        // A write is offered with our keys, for the target to pull; a read
        // is offered for us to copy from keys the target grants (our
        // memory is written by us alone: see `Net::export`).
        let ours = if read {
            None
        } else {
            self.keys(&local, remote.len())
        };
        let offer_read = dst_gpu.filter(|_| remote.len() <= PULL_MAX_RUNS);
        let t_keys = clock.at();
        drop(local);
        let (t_drop, items) = (clock.at(), remote.len());
        // The request and, for a read, its receives' place in the order of
        // our requests for data are made under the state lock, in the order
        // the requests leave.
        self.drive(|st, done| {
            if Self::track(st, &xfer, done) {
                match (ours, offer_read) {
                    (_, Some(dst_gpu)) => st
                        .proto
                        .post_read_offer(xfer_id, ops, remote, runs, dst_gpu),
                    _ if read => st.proto.post_read(xfer_id, ops, remote, runs),
                    (Some(src), _) => st.proto.post_write_pull(xfer_id, ops, remote, runs, src),
                    (None, _) => st.proto.post_write(xfer_id, ops, remote, runs),
                }
            }
        });
        tracing::trace!(
            xfer = xfer_id,
            items,
            runs_us = t_runs.as_micros() as u64,
            ops_us = (t_ops - t_runs).as_micros() as u64,
            keys_us = (t_keys - t_ops).as_micros() as u64,
            release_us = (t_drop - t_keys).as_micros() as u64,
            state_us = clock.at().saturating_sub(t_drop).as_micros() as u64,
            "lat: request posted"
        );
        Ok(xfer)
    }

    /// Where the peer may copy these runs of ours from, on a net with a
    /// one-sided path: one key per run (a write's, for its target; a
    /// granted read's, for its reader). None sends the data: the net
    /// exports nothing here, or the runs are too many for one frame of
    /// `items` items more (the peer takes no longer one).
    fn keys(&self, runs: &Pieces, items: usize) -> Option<Vec<PullRun>> {
        let net = self.exporter.as_ref()?;
        if runs.len() > PULL_MAX_RUNS {
            return None;
        }
        let src: Vec<PullRun> = runs
            .mems()
            .iter()
            .map(|m| {
                let key = net.export(*m)?;
                (key.len() <= wire::MAX_PULL_KEY).then_some(PullRun {
                    gpu: matches!(m.kind, crate::memory::MemKind::Cuda(_)),
                    key,
                })
            })
            .collect::<Option<_>>()?;
        let keys = src.iter().map(|p| p.key.len()).sum();
        (wire::pull_frame_len(items, src.len(), keys) <= wire::MAX_FRAME).then_some(src)
    }

    /// Whether a small one-sided transfer may go inline now (see
    /// [`Proto::inline_room`]).
    fn inline_room(&self, read: bool) -> bool {
        if read {
            self.state.lock().proto.inline_room(true, 0)
        } else {
            // A write's room is the backlog's alone: no need of the state.
            self.oob.lock().backlog() < proto::INLINE_BACKLOG
        }
    }

    /// Liveness, called periodically: the machine sends a keep-alive when
    /// we have been quiet for `keepalive`, and fails the connection when
    /// the peer has been silent for `deadline`.
    pub(crate) fn tick(self: &Arc<Self>, keepalive: Duration, deadline: Duration) {
        let (k, d) = (keepalive.as_millis() as u64, deadline.as_millis() as u64);
        if let Err(why) = self.drive(|st, _| st.proto.tick(now_ms(), k, d)) {
            self.fail(why);
        }
    }

    /// Hands a control message from the peer to the machine and reads what
    /// follows it on `s` as the machine says.
    fn on_control(
        self: &Arc<Self>,
        m: Control,
        s: &mut Ctl,
        now: u64,
    ) -> std::result::Result<(), Failure> {
        let payload = self.drive(|st, _| {
            st.proto.heard(now);
            st.proto.on_control(m)
        })?;
        match payload {
            Payload::Nothing => {}
            Payload::Write {
                xfer,
                local,
                len,
                weight,
            } => {
                tracing::trace!(xfer, bytes = len, "lat: inline write in");
                let landed = crate::inline::land(s, &local);
                tracing::trace!(xfer, "lat: inline write landed");
                drop(local);
                let ok = landed.is_ok();
                self.drive(|st, _| st.proto.inline_write_landed(xfer, weight, ok));
                landed.map_err(|e| Failure::Lost(format!("inline write payload: {e}")))?;
            }
            Payload::Drop { len, refusal } => {
                crate::inline::drain(s, len)
                    .map_err(|e| Failure::Lost(format!("inline payload: {e}")))?;
                if let Some((xfer, reason)) = refusal {
                    self.drive(|st, _| st.proto.inline_write_dropped(xfer, reason));
                }
            }
            Payload::Notif { name, msg } => self
                .notifs
                .push(Notif {
                    from_name: name,
                    conn: self.id,
                    msg,
                })
                .map_err(|e| Failure::Protocol(e.to_string()))?,
            Payload::Read { xfer, local } => {
                crate::inline::land(s, &local)
                    .map_err(|e| Failure::Lost(format!("inline read payload: {e}")))?;
                tracing::trace!(xfer, "lat: inline read landed");
                self.drive(|st, _| st.proto.inline_read_landed(xfer));
            }
        }
        Ok(())
    }

    /// What this connection holds for its peer (see [`Held`]).
    pub(crate) fn held(&self) -> Held {
        let (unposted, requests, pieces) = self.state.lock().proto.held();
        Held {
            ops: self.engine.ops(),
            unposted,
            requests,
            pieces,
        }
    }

    /// Sends a notification on the control connection (the caller checked
    /// its size against [`wire::MAX_NOTIF`]).
    pub(crate) fn send_notif(&self, name: &str, msg: &[u8]) -> Result<()> {
        self.check_alive()?;
        self.drive(|st, _| st.proto.send_notif(name.to_string(), msg.to_vec()));
        // A failed write has failed the connection.
        self.check_alive()
    }

    /// Tells the progress thread a region is gone.
    pub(crate) fn drop_region(&self, id: u64) {
        self.enqueue(Cmd::DropRegion(id));
        self.kick();
    }

    /// Cancels our transfer `t` if none of its data has moved and none will
    /// touch its buffers: a write still waiting for the target's
    /// clear-to-send, or an inline read still waiting for its data. It
    /// then ends at once, failed as cancelled, and its buffers are free.
    /// Returns false for anything else (data in flight cannot be called
    /// back: it runs to its end).
    pub(crate) fn cancel(self: &Arc<Self>, t: &Transfer) -> bool {
        self.drive(|st, _| st.proto.cancel(t.id))
    }
}

/// A connection let go with ends still held (its machine never failed):
/// they are published as they ended, so that no waiter waits on them.
impl Drop for Conn {
    fn drop(&mut self) {
        self.ends.close();
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
    /// The connection's held ends: a round that holds some returns for
    /// the connection to hear them.
    ends: Arc<Ends>,
    conn: Weak<Conn>,
    /// The admission room the connection holds until its engine ends.
    _room: Option<Box<dyn std::any::Any + Send>>,
    linger: Duration,
    workers: Workers,
}

impl Task for ProgressTask {
    fn run(&mut self) -> Step {
        loop {
            let workers = &self.workers;
            let why = match self
                .engine
                .run_until_idle(self.linger, &self.ends, &|| workers.work_waiting())
            {
                Until::Idle => return Step::Idle,
                Until::Ends => match self.conn.upgrade() {
                    Some(c) => {
                        c.hear_ends();
                        continue;
                    }
                    None => {
                        // The connection is gone: nothing to tell.
                        self.ends.close();
                        continue;
                    }
                },
                Until::Stopped(why) => why,
            };
            if let Some(c) = self.conn.upgrade() {
                c.fail(why);
            }
            return Step::Done;
        }
    }
}

/// `advertise_ipc` records one connection may hold (as a same-host
/// connection's).
const MAX_IPC_REGIONS: usize = 1 << 20;

/// The control connection's reader on the I/O workers: reads and handles
/// frames while they come, then waits (no thread) for the next.
struct OobReader {
    conn: Weak<Conn>,
    s: Ctl,
    spin: Duration,
    linger: Duration,
    /// When the last frame was read.
    last: Option<Instant>,
    workers: Workers,
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
                // One wait for the whole linger, not given up part-way: on
                // the 2-core box, host memory, a reader that waited in
                // slices of `LINGER_SLICE` (to give its worker back once
                // other work waited) took the blocking 4 KiB / 64 KiB
                // write's p50 from 26-38 / 31-33 µs to 39-51 / 40-51. Only
                // where other work waits already does it not linger.
                let linger = if self.workers.work_waiting() {
                    Duration::ZERO
                } else {
                    self.linger
                };
                if !wait_readable(&self.s, linger) {
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
                        tracing::trace!(xfer = m.xfer().unwrap_or(0), "lat: ctl in {}", m.kind());
                        c.on_control(m, &mut self.s, now_ms())
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

/// Which of `runs` are device memory.
fn device_runs(runs: &Pieces) -> Vec<bool> {
    runs.mems()
        .iter()
        .map(|m| matches!(m.kind, crate::memory::MemKind::Cuda(_)))
        .collect()
}

/// Points each of our requests `ops` at where its pieces lie in the peer's
/// memory (`srcs`: a key and the run's offset in it, per run of the
/// transfer; see [`proto::op_refs`]); Err names a request they do not
/// cover.
fn point_at(
    ops: &mut [ChunkOp],
    srcs: &[crate::lease::RunSrc],
) -> std::result::Result<(), Option<OpPlan>> {
    for op in ops {
        let lens: Vec<usize> = op.segs.mems().iter().map(|m| m.len).collect();
        op.remote = proto::op_refs(op.plan, &lens, srcs).ok_or(op.plan)?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn live_transfers_let_go_of_ended_ones_as_new_ones_come() {
        let mut live = Live::default();
        let mut running = Vec::new();
        for id in 0..10_000u64 {
            let t = Transfer::new(id, 1, 1, vec![]);
            live.insert(&t);
            if id % 100 == 0 {
                running.push(t); // these stay running
            } else {
                t.complete_one();
                assert!(live.get(id).is_none(), "an ended transfer is not looked up");
            }
            // Kept: at most twice what runs (the newest counted, which was
            // running when it came), or the sweep's minimum.
            assert!(live.map.len() <= (2 * (running.len() + 1)).max(Live::SWEEP_MIN));
        }
        for t in &running {
            assert!(Arc::ptr_eq(live.get(t.id).unwrap(), t));
        }
        // A transfer that has ended already is not kept at all.
        let t = Transfer::new(20_000, 1, 0, vec![]);
        live.insert(&t);
        assert!(!live.map.contains_key(&20_000));
        // The connection ends: every transfer kept is handed back, the
        // running ones among them.
        let kept = live.map.len();
        let all = live.take_all();
        assert_eq!(all.len(), kept);
        assert!(live.map.is_empty());
        assert!(running
            .iter()
            .all(|r| all.iter().any(|t| Arc::ptr_eq(t, r))));
    }
}
