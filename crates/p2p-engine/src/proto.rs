//! A connection's protocol as one state machine with no I/O and no clock,
//! in the manner of quinn-proto: [`Proto`] owns every piece of a
//! connection's protocol state (the [`Book`] of answers awaited and work
//! held for the peer, our writes waiting for clear-to-send, the order of
//! our one-sided receives, our inline reads awaiting their data, the
//! two-sided numbering and acknowledgements, the liveness clocks, the
//! failure). Inputs are the application's calls (post a send, a receive,
//! a write, a read, an inline one, a notification; cancel), control
//! messages from the peer, the ends of the net's work, and timer ticks
//! given the time; outputs are [`Effect`]s queued in order for the caller
//! to drain ([`Proto::poll`]): control frames to send, net requests to
//! post, transfers to complete or fail, notifications to deliver. A
//! peer's breach of the protocol is returned as the [`Failure`] that ends
//! the connection.
//!
//! [`crate::conn::Conn`] holds it behind one lock and carries out its
//! effects; the tests in `crates/p2p-fuzzing` wire two of them together in
//! memory, and fuzz that pair.
//!
//! Generic over `O`, what the caller's own net requests are (the engine's
//! chunk ops; a test's byte ranges): the machine only queues and hands them
//! back. The requests that serve a peer's accepted request are described
//! ([`Serve`]) and built by the caller from that description.

use std::collections::{BTreeSet, HashMap, VecDeque};
use std::sync::Arc;

use crate::handler::{Action, Admitted, Book, Ctx, Limits, ProtocolError};
use crate::lease::{Leases, RunSrc};
use crate::memory::{Region, Registry};
use crate::net::{MemRef, RemoteRef};
use crate::pieces::Pieces;
use crate::progress::Set;
use crate::rma_recvs::RmaRecvs;
use crate::transfer::{Answer, Failure, Gather, OpPlan};
use crate::wire::{Control, Lease, PullRun, RmaItem, Token};

/// Buffers of ours, in order, with their regions: where an inline
/// transfer's bytes come from or land, or what a served request covers.
pub type Landing = Pieces;

/// Inline reads stop while this many await their data: their answers (at
/// most [`crate::wire::MAX_INLINE`] each) stay within the peer's control
/// backlog.
pub const INLINE_READS: usize = 32;

/// Inline writes stop while our control backlog holds this many bytes
/// (see [`Proto::inline_room`]).
pub const INLINE_BACKLOG: usize = 4 << 20;

/// The reason a connection reports when its peer closed it in order.
pub const PEER_CLOSED: &str = "peer closed the connection";

/// A count of net requests (for the empty fillers a cancelled write
/// needs).
pub trait Requests {
    fn count(&self) -> usize;
}

impl<T> Requests for Vec<T> {
    fn count(&self) -> usize {
        self.len()
    }
}

/// A peer's accepted one-sided request, served by net requests over our
/// memory: `plan` over `local`. When they end, tell the machine
/// ([`Proto::served_ended`]) with `xfer`, `weight` and `write`.
#[derive(Debug)]
pub struct Serve {
    /// The peer's transfer id.
    pub xfer: u64,
    pub local: Landing,
    pub plan: Vec<OpPlan>,
    /// What the request holds against [`Limits`], given back at its end.
    pub weight: usize,
    /// A write (we receive or pull, and answer `WriteDone` at the end) or
    /// a read (we send; `ReadAck` went before).
    pub answer: Answer,
}

impl Serve {
    /// The requests serving the peer's admitted request `req`, answered as
    /// `answer` says.
    pub fn of(req: Admitted, answer: Answer) -> Serve {
        let Admitted {
            xfer,
            local,
            plan,
            weight,
        } = req;
        Serve {
            xfer,
            local,
            plan,
            weight,
            answer,
        }
    }
}

/// Net requests to post, in order, on one set and direction.
#[derive(Debug)]
pub enum Requested<O> {
    /// Requests the caller built when it posted one of its own transfers.
    Ours(O),
    /// Requests that serve a peer's accepted request.
    Serve(Serve),
    /// Receives that serve a peer's offered write by copying straight from
    /// its memory (`runs`: one [`PullRun`] per run of `serve.local`). They
    /// pair with no send of the peer's, so they are posted outside the
    /// order of the set's receives.
    Remote { serve: Serve, runs: Vec<PullRun> },
    /// Our offered read `xfer`'s receives, granted: each copies from `src`
    /// (the peer's memory, one [`PullRun`] per run of the read), outside the
    /// order of the set's receives.
    Granted {
        xfer: u64,
        ops: O,
        src: Vec<PullRun>,
    },
    /// This many empty messages: they fill the receives the target posted
    /// for a write we cancelled before its clear-to-send came (the target
    /// then refuses it, and both sides stay in step).
    Fill(usize),
}

/// What the machine asks of its caller, in the order given.
#[derive(Debug)]
pub enum Effect<O> {
    /// Write this control message.
    Send(Control),
    /// Write this control message followed by the bytes of these buffers
    /// (an inline write, or the answer to an inline read).
    SendWithPayload(Control, Landing),
    /// Post these requests on `set`, sends or receives, behind those
    /// posted before.
    Post {
        set: Set,
        send: bool,
        requests: Requested<O>,
    },
    /// One awaited event of our transfer `xfer` happened (an answer of the
    /// peer, an inline read's data landed).
    Complete(u64),
    /// Our transfer `xfer` has all it waits for: the peer confirmed every
    /// byte landed (its net requests may still report later).
    CompleteAll(u64),
    /// Our transfer `xfer` failed.
    Fail(u64, Failure),
    /// These requests of ours will never be posted (the connection ended,
    /// or the transfer was cancelled): their transfers end with the reason.
    Abandon(O, Failure),
    /// Grant the peer's accepted read: send `ReadGrant` with the keys of
    /// `serve.local` and hold it until [`Effect::Release`], or, where the
    /// net gives no key, [`Proto::grant_failed`]. The grant may lease
    /// `tokens`, the advertisements the read names ([`Proto::lease_wanted`]).
    Grant { serve: Serve, tokens: Vec<Token> },
    /// The peer released the read `xfer` we granted.
    Release(u64),
}

/// What the reader of the control connection must do with the bytes that
/// follow a message, before it reads the next one.
#[derive(Debug)]
pub enum Payload {
    /// Nothing follows.
    Nothing,
    /// The peer's accepted inline write: read the bytes into `local`, then
    /// [`Proto::inline_write_landed`].
    Write {
        xfer: u64,
        local: Landing,
        len: usize,
        weight: usize,
    },
    /// Bytes nobody takes: read and drop `len`; then, for a refused inline
    /// write of the peer's, [`Proto::inline_write_dropped`] with the refusal.
    Drop {
        len: usize,
        refusal: Option<(u64, String)>,
    },
    /// Our inline read's data: read it into `local`, then
    /// [`Proto::inline_read_landed`].
    Read { xfer: u64, local: Landing },
    /// Nothing follows; deliver this notification from the peer to the
    /// endpoint's queue (whose refusal ends the connection) before reading
    /// the next message.
    Notif { name: String, msg: Vec<u8> },
}

/// A write of ours waiting for the target's clear-to-send.
enum PendingWrite<O> {
    /// Its requests, posted when cleared.
    Ours(O),
    /// Its requests, posted if the target answers a clear-to-send rather
    /// than pulling; not cancellable (the target may be copying already).
    Offered(O),
    /// Cancelled by the application: this many empty messages fill the
    /// target's receives when cleared.
    Cancelled(usize),
}

/// Receives that land are acknowledged together (`MsgDone` carries a
/// count): once this many have landed since the last acknowledgement, and
/// sooner with any other frame we write, when a frame of the peer's comes
/// (a sender closing asks so, [`Proto::ask_acks`]), on the watchdog's tick,
/// and at close. The sender needs the count only to close (it waits for
/// it); written as each receive landed, the acknowledgement cost the
/// receiving thread 10-30 µs of a 64-256 KB message's 50-170 µs (one H200,
/// UCCL's benchmark loop), and the sender a wake-up to read it.
pub const ACK_EVERY: u64 = 32;

/// Our two-sided receives, numbered in posting order (the order the peer's
/// messages fill them), how many of them, counted from the first, have
/// landed (what `MsgDone` tells the sender), the count last queued to
/// tell, and the count last written (a count must grow from frame to
/// frame: one queued behind a larger one that went ahead is dropped).
#[derive(Default)]
struct RecvAcks {
    next: u64,
    landed: BTreeSet<u64>,
    count: u64,
    told: u64,
    sent: u64,
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

    /// The count to acknowledge now, if it grew since we last told it.
    fn due(&mut self) -> Option<u64> {
        (self.count > self.told).then(|| {
            self.told = self.count;
            self.count
        })
    }
}

/// What a connection's machine is made with.
#[derive(Clone)]
pub struct Setup {
    /// Our records, against which every request of the peer is resolved.
    pub registry: Arc<Registry>,
    /// The connection's id (advertisements made for it).
    pub conn: u64,
    /// The agreed chunk, and how small items share a request.
    pub chunk: usize,
    pub gather: Gather,
    /// What the peer may make us hold.
    pub limits: Limits,
    /// The connection's net has a one-sided path: the peer's writes may
    /// be pulled ([`Control::WritePull`]).
    pub pull: bool,
    /// The time the connection starts (ms, on the caller's clock).
    pub now: u64,
}

/// One connection's protocol state (see the module's text).
pub struct Proto<O> {
    setup: Setup,
    book: Book,
    failed: Option<Failure>,
    /// Our writes waiting for the target's clear-to-send.
    pending_writes: HashMap<u64, PendingWrite<O>>,
    /// Receives of one-sided data coming to us, waiting for their turn.
    rma_recvs: RmaRecvs<Requested<O>>,
    /// Our inline reads awaiting their `ReadData`: where the bytes land
    /// (None: cancelled, the bytes are read and dropped).
    pending_reads: HashMap<u64, Option<Landing>>,
    /// Our receives' numbering and what we acknowledged.
    recvs: RecvAcks,
    /// Our sends not yet acknowledged: (message number, transfer id), in
    /// order.
    sends: VecDeque<(u64, u64)>,
    /// When we last heard from / wrote to the peer (ms).
    last_rx: u64,
    last_tx: u64,
    out: VecDeque<Effect<O>>,
    /// Advertisements leased to the peer and by it ([`crate::lease`]).
    leases: Leases,
}

fn breach(e: ProtocolError) -> Failure {
    match e {
        ProtocolError::Closed => Failure::Lost(PEER_CLOSED.into()),
        e => Failure::Protocol(e.to_string()),
    }
}

impl<O: Requests> Proto<O> {
    pub fn new(setup: Setup) -> Self {
        Proto {
            book: Book::new(setup.limits),
            last_rx: setup.now,
            last_tx: setup.now,
            setup,
            failed: None,
            pending_writes: HashMap::new(),
            rma_recvs: RmaRecvs::default(),
            pending_reads: HashMap::new(),
            recvs: RecvAcks::default(),
            sends: VecDeque::new(),
            out: VecDeque::new(),
            leases: Leases::default(),
        }
    }

    /// The next effect to carry out, in order. Once the connection has
    /// failed, no frame is asked for: there is no connection to write it on
    /// (an answer decided as the connection fails is dropped here).
    /// An acknowledgement due goes ahead of any other frame (it costs that
    /// write nothing).
    pub fn poll(&mut self) -> Option<Effect<O>> {
        loop {
            let e = self.out.pop_front()?;
            let frame = matches!(e, Effect::Send(_) | Effect::SendWithPayload(..));
            if frame && self.failed.is_some() {
                continue;
            }
            if let Effect::Send(Control::MsgDone { count }) = e {
                if count <= self.recvs.sent {
                    continue; // a larger count went ahead of it
                }
                self.recvs.sent = count;
                return Some(e);
            }
            if frame {
                if let Some(count) = self.recvs.due() {
                    self.recvs.sent = count;
                    self.out.push_front(e);
                    return Some(Effect::Send(Control::MsgDone { count }));
                }
            }
            return Some(e);
        }
    }

    /// Acknowledges the receives landed since we last did, if any.
    fn ack_landed(&mut self) {
        if let Some(count) = self.recvs.due() {
            self.out.push_back(Effect::Send(Control::MsgDone { count }));
        }
    }

    /// Before an orderly close, with messages of ours not acknowledged:
    /// a keep-alive, which has the peer acknowledge what has landed
    /// ([`ACK_EVERY`]).
    pub fn ask_acks(&mut self) {
        if self.failed.is_none() && self.msgs_unacked() > 0 {
            self.out.push_back(Effect::Send(Control::KeepAlive));
        }
    }

    /// Why the connection failed, if it has.
    pub fn failure(&self) -> Option<&Failure> {
        self.failed.as_ref()
    }

    /// The connection fails with `why` (the first reason stays). True the
    /// first time. Nothing is abandoned yet: see [`Proto::abandon`].
    pub fn fail(&mut self, why: Failure) -> bool {
        let first = self.failed.is_none();
        self.failed.get_or_insert(why);
        first
    }

    /// The connection has failed and its net work has stopped: everything
    /// still waiting is let go, our requests with the failure.
    pub fn abandon(&mut self) {
        let why = self
            .failed
            .clone()
            .unwrap_or_else(|| Failure::Lost("connection ended".into()));
        self.pending_reads.clear();
        self.sends.clear();
        // The peer reads from no lease of ours on a connection that ended.
        self.leases = Leases::default();
        for r in self.rma_recvs.clear() {
            if let Requested::Ours(o) = r {
                self.out.push_back(Effect::Abandon(o, why.clone()));
            }
        }
        for (_, w) in self.pending_writes.drain() {
            if let PendingWrite::Ours(o) | PendingWrite::Offered(o) = w {
                self.out.push_back(Effect::Abandon(o, why.clone()));
            }
        }
    }

    /// Control frames were written at `now` (for the keep-alive).
    pub fn wrote(&mut self, now: u64) {
        self.last_tx = now;
    }

    /// A frame was read from the peer at `now` (for the deadline).
    /// The peer may wait for our acknowledgements: they go with the answer
    /// (or alone).
    pub fn heard(&mut self, now: u64) {
        self.last_rx = now;
        self.ack_landed();
    }

    /// A timer tick at `now`: a keep-alive when we have written nothing
    /// for `keepalive` ms; the connection's failure when the peer has been
    /// silent for more than `deadline` ms.
    pub fn tick(&mut self, now: u64, keepalive: u64, deadline: u64) -> Result<(), Failure> {
        if self.failed.is_some() {
            return Ok(());
        }
        self.ack_landed();
        let silent = now.saturating_sub(self.last_rx);
        if silent > deadline {
            return Err(Failure::TimedOut(format!(
                "peer unresponsive: nothing heard for {:.1} s (deadline {:.1} s, TCPX_P2P_DEADLINE_MS)",
                silent as f64 / 1e3,
                deadline as f64 / 1e3
            )));
        }
        if now.saturating_sub(self.last_tx) >= keepalive {
            self.out.push_back(Effect::Send(Control::KeepAlive));
            self.last_tx = now;
        }
        Ok(())
    }

    /// An orderly close: tells the peer.
    pub fn close(&mut self) {
        if self.failed.is_none() {
            self.ack_landed();
            self.out.push_back(Effect::Send(Control::Close));
        }
    }

    /// Our two-sided messages posted and not yet acknowledged (an orderly
    /// close waits for none).
    pub fn msgs_unacked(&self) -> u64 {
        self.book.msgs_unacked()
    }

    /// What we hold: one-sided receives of ours waiting for their turn,
    /// and the peer's accepted requests and their pieces.
    pub fn held(&self) -> (usize, usize, usize) {
        let (requests, pieces) = self.book.held();
        (self.rma_recvs.len(), requests, pieces)
    }

    /// Whether a small one-sided transfer may go inline now. Its bytes ride
    /// the control connection, whose backlog is bounded: a burst of inline
    /// writes posted faster than the target lands them would fill ours
    /// (`backlog`: the bytes it holds), a burst of inline reads the
    /// peer's (their answers). Past [`INLINE_BACKLOG`] bytes, or with
    /// [`INLINE_READS`] inline reads awaiting their data, they take the net.
    pub fn inline_room(&self, read: bool, backlog: usize) -> bool {
        if read {
            self.pending_reads.len() < INLINE_READS
        } else {
            backlog < INLINE_BACKLOG
        }
    }

    /// Our two-sided send `xfer` over `requests`: numbered in posting
    /// order (the order the peer's receives take them).
    pub fn post_send(&mut self, xfer: u64, requests: O) {
        let seq = self.book.msg_posted();
        self.sends.push_back((seq, xfer));
        self.out.push_back(Effect::Post {
            set: Set::Msg,
            send: true,
            requests: Requested::Ours(requests),
        });
    }

    /// Our two-sided receive over `requests`: returns its number, to give
    /// back to [`Proto::recv_ended`] when it ends.
    pub fn post_recv(&mut self, requests: O) -> u64 {
        self.recvs.next += 1;
        self.out.push_back(Effect::Post {
            set: Set::Msg,
            send: false,
            requests: Requested::Ours(requests),
        });
        self.recvs.next - 1
    }

    /// Our receive number `seq` ended (`Ok`: it landed). What has landed,
    /// in order, is acknowledged with the next frame, or now once
    /// [`ACK_EVERY`] wait; a failed receive leaves the message streams out
    /// of step, and the connection fails.
    pub fn recv_ended(&mut self, seq: u64, outcome: Result<(), Failure>) -> Result<(), Failure> {
        match outcome {
            Ok(()) => {
                if self.recvs.landed(seq).is_some()
                    && self.recvs.count - self.recvs.told >= ACK_EVERY
                {
                    self.ack_landed();
                }
                Ok(())
            }
            // The connection itself ended (the peer closed or went away, the
            // net failed): that is the reason every other transfer on it
            // reports too, not a protocol breach.
            Err(
                f @ (Failure::Lost(_)
                | Failure::TimedOut(_)
                | Failure::Net(_)
                | Failure::Protocol(_)),
            ) => Err(f),
            Err(f) => Err(Failure::Protocol(format!(
                "receive {seq} on this connection failed ({f}); the message streams are out of step"
            ))),
        }
    }

    /// Our one-sided write `xfer` of `requests` into the peer's `items`
    /// (gathered into `runs`): asks for clear-to-send.
    pub fn post_write(&mut self, xfer: u64, requests: O, items: Vec<RmaItem>, runs: Vec<u32>) {
        self.book.expect(xfer, false);
        self.pending_writes
            .insert(xfer, PendingWrite::Ours(requests));
        self.out
            .push_back(Effect::Send(Control::WriteReq { xfer, items, runs }));
    }

    /// Our one-sided write `xfer` offered for the target to pull: `src`
    /// tells its net where each run lies in our memory. The target
    /// answers `WriteDone` once it has copied it all, or a clear-to-send
    /// (where it cannot pull), and then `requests` are sent as for
    /// [`Proto::post_write`].
    pub fn post_write_pull(
        &mut self,
        xfer: u64,
        requests: O,
        items: Vec<RmaItem>,
        runs: Vec<u32>,
        src: Vec<PullRun>,
    ) {
        self.book.expect_pull(xfer);
        self.pending_writes
            .insert(xfer, PendingWrite::Offered(requests));
        self.out.push_back(Effect::Send(Control::WritePull {
            xfer,
            items,
            runs,
            src,
        }));
    }

    /// Our one-sided read `xfer` offered for us to copy from the peer's
    /// memory (`dst_gpu`: which of our runs are device memory). The
    /// receives `requests` take their place in the order of our requests
    /// for data now; the target answers `ReadGrant` (they then copy from
    /// its memory and we answer `ReadDone` once they end,
    /// [`Proto::granted_ended`]) or `ReadAck` (they are posted as for
    /// [`Proto::post_read`]).
    pub fn post_read_offer(
        &mut self,
        xfer: u64,
        requests: O,
        items: Vec<RmaItem>,
        runs: Vec<u32>,
        dst_gpu: Vec<bool>,
    ) {
        self.book.expect_offer(xfer);
        self.rma_recvs.asked(xfer, Requested::Ours(requests));
        self.out.push_back(Effect::Send(Control::ReadOffer {
            xfer,
            items,
            runs,
            dst_gpu,
        }));
    }

    /// Which of `tokens` a grant should lease ([`Leases::wanted`]).
    pub fn lease_wanted(&self, tokens: &[Token]) -> Vec<Token> {
        if self.failed.is_some() {
            return Vec::new();
        }
        self.leases.wanted(tokens)
    }

    /// A grant going out leases `token`, over `region`.
    pub fn lease_given(&mut self, token: Token, region: Arc<Region>) {
        self.leases.give(token, region);
    }

    /// Leases `lease` (over `region`) unasked: a record made for this
    /// connection alone, leased as it is made (`Leases`).
    pub fn lease_record(&mut self, lease: Lease, region: Arc<Region>) {
        if self.failed.is_some() {
            return;
        }
        self.leases.give(lease.token, region);
        self.out.push_back(Effect::Send(Control::Leases {
            leases: vec![lease],
        }));
    }

    /// Region `id` is being deregistered: `Revoke` for each lease of ours
    /// over it.
    pub fn revoke_region(&mut self, id: u64) {
        for token in self.leases.revoke_region(id) {
            self.out.push_back(Effect::Send(Control::Revoke { token }));
        }
    }

    /// Our read (`write` false) or write of `items` in `runs` (`gpu`: which
    /// runs are our device memory), if the peer's leases cover it: where
    /// each run copies from or to, and the leases it uses until
    /// [`Proto::leased_ended`].
    pub fn leased(
        &mut self,
        write: bool,
        items: &[RmaItem],
        runs: &[u32],
        gpu: &[bool],
    ) -> Option<(Vec<RunSrc>, Vec<u64>)> {
        if self.failed.is_some() {
            return None;
        }
        self.leases.cover(write, items, runs, gpu)
    }

    /// A read or write with leases `used` ended: `Revoked` for each
    /// revoked lease it was the last to use.
    pub fn leased_ended(&mut self, used: &[u64]) {
        for token in self.leases.ended(used) {
            self.out.push_back(Effect::Send(Control::Revoked { token }));
        }
    }

    /// Leases given and held on this connection (for tests).
    #[cfg_attr(not(feature = "fuzzing"), allow(dead_code))]
    pub fn leases(&self) -> (usize, usize) {
        (self.leases.given(), self.leases.held())
    }

    /// Our granted read `xfer` ended (done or failed): the target may let
    /// its range go.
    pub fn granted_ended(&mut self, xfer: u64) {
        self.out.push_back(Effect::Send(Control::ReadDone { xfer }));
    }

    /// Our grant of the peer's read (`serve`) could not be made: it is
    /// served as a `ReadReq`.
    pub fn grant_failed(&mut self, serve: Serve) {
        self.book.grant_failed(serve.xfer);
        self.accept_read(serve);
    }

    /// Serves the peer's accepted read by sending: `ReadAck`, then sends
    /// for its plan.
    fn accept_read(&mut self, serve: Serve) {
        // The reader posted one receive per request of its plan of the
        // runs' lengths: ours pairs with it request for request.
        self.out
            .push_back(Effect::Send(Control::ReadAck { xfer: serve.xfer }));
        self.out.push_back(Effect::Post {
            set: Set::Rma,
            send: true,
            requests: Requested::Serve(serve),
        });
    }

    /// Our one-sided read `xfer` of the peer's `items` by the receives
    /// `requests`: they take their place in the order of our requests for
    /// data now, and are posted once the peer accepts.
    pub fn post_read(&mut self, xfer: u64, requests: O, items: Vec<RmaItem>, runs: Vec<u32>) {
        self.book.expect(xfer, true);
        self.rma_recvs.asked(xfer, Requested::Ours(requests));
        self.out
            .push_back(Effect::Send(Control::ReadReq { xfer, items, runs }));
    }

    /// Our inline write `xfer` of `local` (at most the inline limit): its
    /// bytes follow the request.
    pub fn post_inline_write(
        &mut self,
        xfer: u64,
        local: Landing,
        items: Vec<RmaItem>,
        runs: Vec<u32>,
    ) {
        let len = local.total() as u32;
        self.book.expect_inline(xfer, false, len);
        self.out.push_back(Effect::SendWithPayload(
            Control::WriteInline {
                xfer,
                items,
                runs,
                len,
            },
            local,
        ));
    }

    /// Our inline read `xfer` into `local` (at most the inline limit).
    pub fn post_inline_read(
        &mut self,
        xfer: u64,
        local: Landing,
        items: Vec<RmaItem>,
        runs: Vec<u32>,
    ) {
        let len = local.total() as u32;
        self.book.expect_inline(xfer, true, len);
        self.pending_reads.insert(xfer, Some(local));
        self.out
            .push_back(Effect::Send(Control::ReadInline { xfer, items, runs }));
    }

    /// A notification for the peer.
    pub fn send_notif(&mut self, name: String, msg: Vec<u8>) {
        self.out
            .push_back(Effect::Send(Control::Notif { name, msg }));
    }

    /// Cancels our transfer `xfer` if none of its data has moved and none
    /// will touch its buffers: a write still waiting for the target's
    /// clear-to-send, or an inline read still waiting for its data. It
    /// then fails as cancelled. False for anything else (data in flight
    /// cannot be called back).
    pub fn cancel(&mut self, xfer: u64) -> bool {
        if let Some(w) = self.pending_writes.get_mut(&xfer) {
            if let PendingWrite::Ours(o) = w {
                let n = o.count();
                if let PendingWrite::Ours(o) = std::mem::replace(w, PendingWrite::Cancelled(n)) {
                    self.out.push_back(Effect::Abandon(o, Failure::Cancelled));
                }
                self.out.push_back(Effect::Fail(xfer, Failure::Cancelled));
                return true;
            }
            return false;
        }
        match self.pending_reads.get_mut(&xfer) {
            Some(l @ Some(_)) => {
                *l = None;
                self.out.push_back(Effect::Fail(xfer, Failure::Cancelled));
                true
            }
            _ => false,
        }
    }

    /// Queues the one-sided receives whose turn has come, in order.
    fn post_due(&mut self) {
        for requests in self.rma_recvs.due() {
            self.out.push_back(Effect::Post {
                set: Set::Rma,
                send: false,
                requests,
            });
        }
    }

    /// A control message from the peer. Returns what to do with the bytes
    /// that follow it, or the failure that ends the connection.
    pub fn on_control(&mut self, m: Control) -> Result<Payload, Failure> {
        if let Some(f) = &self.failed {
            return Err(f.clone());
        }
        let s = &self.setup;
        let cx = Ctx {
            registry: &s.registry,
            conn: s.conn,
            chunk: s.chunk,
            gather: s.gather,
            pull: s.pull,
        };
        let conn = s.conn;
        let action = self.book.on_control(cx, m).map_err(breach)?;
        match action {
            Action::Nothing => {}
            Action::RefuseWrite { xfer, reason } => {
                tracing::warn!(conn, "refused a write from the peer: {reason}");
                self.out
                    .push_back(Effect::Send(Control::Refused { xfer, reason }));
            }
            Action::AcceptWrite(req) => {
                let xfer = req.xfer;
                // Our receives take their place in the order of our requests
                // for data, before the clear-to-send goes out.
                self.rma_recvs
                    .cleared(Requested::Serve(Serve::of(req, Answer::Write)));
                self.post_due();
                self.out.push_back(Effect::Send(Control::WriteCts { xfer }));
            }
            Action::AcceptRead(req) => self.accept_read(Serve::of(req, Answer::Read)),
            Action::GrantRead { req, tokens } => self.out.push_back(Effect::Grant {
                serve: Serve::of(req, Answer::Read),
                tokens,
            }),
            Action::Revoke { token } => {
                if self.leases.revoke(token) {
                    self.out.push_back(Effect::Send(Control::Revoked { token }));
                }
            }
            Action::Revoked { token } => self.leases.revoked(token).map_err(Failure::Protocol)?,
            Action::Leased { leases } => self.leases.hold(leases),
            Action::ReadReleased { xfer } => self.out.push_back(Effect::Release(xfer)),
            Action::ReadGranted { xfer, src, leases } => {
                self.leases.hold(leases);
                // Our receives held their place for the paired path: they
                // give it up, and copy from the peer's memory instead.
                let Some(Requested::Ours(ops)) = self.rma_recvs.refused(xfer) else {
                    return Err(Failure::Protocol(format!(
                        "a grant for read {xfer}, which waits for none"
                    )));
                };
                self.post_due();
                self.out.push_back(Effect::Complete(xfer));
                self.out.push_back(Effect::Post {
                    set: Set::Rma,
                    send: false,
                    requests: Requested::Granted { xfer, ops, src },
                });
            }
            Action::RefuseRead { xfer, reason } => {
                tracing::warn!(conn, "refused a read from the peer: {reason}");
                // The reader posts its receives only once we accept: a
                // refusal is one message, whatever the request claimed.
                self.out
                    .push_back(Effect::Send(Control::Refused { xfer, reason }));
            }
            Action::SendWrite { xfer } => {
                let requests = match self.pending_writes.remove(&xfer) {
                    Some(PendingWrite::Ours(o) | PendingWrite::Offered(o)) => Requested::Ours(o),
                    // The target posted n receives: fill each with an empty
                    // message; it refuses the write, which nobody awaits.
                    Some(PendingWrite::Cancelled(n)) => Requested::Fill(n),
                    None => {
                        return Err(Failure::Protocol(format!(
                            "clear-to-send for unknown write {xfer}"
                        )))
                    }
                };
                self.out.push_back(Effect::Post {
                    set: Set::Rma,
                    send: true,
                    requests,
                });
            }
            Action::Acked { xfer } => self.out.push_back(Effect::Complete(xfer)),
            // Every byte was copied by the target: the sends it had ready
            // are never posted.
            Action::Pulled { xfer } => {
                self.pending_writes.remove(&xfer);
                self.out.push_back(Effect::CompleteAll(xfer));
            }
            Action::AcceptPull { req, src } => {
                self.out.push_back(Effect::Post {
                    set: Set::Rma,
                    send: false,
                    requests: Requested::Remote {
                        serve: Serve::of(req, Answer::Write),
                        runs: src,
                    },
                });
            }
            Action::ReadAccepted { xfer } => {
                // Only now may the peer's data land in the read's buffers.
                if !self.rma_recvs.accepted(xfer) {
                    return Err(Failure::Protocol(format!(
                        "acknowledgement of read {xfer}, which awaits none"
                    )));
                }
                self.post_due();
                self.out.push_back(Effect::Complete(xfer));
            }
            Action::LandWrite {
                xfer,
                local,
                len,
                weight,
            } => {
                return Ok(Payload::Write {
                    xfer,
                    local,
                    len,
                    weight,
                })
            }
            Action::DropWrite { xfer, reason, len } => {
                tracing::warn!(conn, "refused an inline write from the peer: {reason}");
                return Ok(Payload::Drop {
                    len,
                    refusal: Some((xfer, reason)),
                });
            }
            Action::SendReadData {
                xfer,
                local,
                len,
                weight,
            } => {
                // Queued in order behind what went before; what it holds
                // is given back now (its bytes are copied out as it is
                // written).
                self.book.served_end(weight);
                self.out.push_back(Effect::SendWithPayload(
                    Control::ReadData {
                        xfer,
                        len: len as u32,
                    },
                    local,
                ));
            }
            Action::LandRead { xfer, len } => {
                return match self.pending_reads.remove(&xfer) {
                    // Cancelled: the length was checked against our request.
                    Some(None) => Ok(Payload::Drop { len, refusal: None }),
                    Some(Some(local)) if local.total() == len => Ok(Payload::Read { xfer, local }),
                    _ => Err(Failure::Protocol(format!(
                        "inline data for read {xfer}, which awaits none of that length"
                    ))),
                };
            }
            Action::PeerRefused { xfer, reason } => {
                self.pending_reads.remove(&xfer);
                // A refused write's requests were never posted.
                if let Some(PendingWrite::Ours(o) | PendingWrite::Offered(o)) =
                    self.pending_writes.remove(&xfer)
                {
                    self.out
                        .push_back(Effect::Abandon(o, Failure::Refused(reason.clone())));
                }
                // A refused read's receives were never posted: let them go
                // (and with them its buffers); those behind them may be due.
                if let Some(r) = self.rma_recvs.refused(xfer) {
                    if let Requested::Ours(o) = r {
                        self.out
                            .push_back(Effect::Abandon(o, Failure::Refused(reason.clone())));
                    }
                    self.post_due();
                }
                self.out
                    .push_back(Effect::Fail(xfer, Failure::Refused(reason)));
            }
            // The book counted them (a close waits for that count); the
            // sends they cover have landed, whatever the net says later.
            Action::MsgsLanded { to, .. } => {
                while self.sends.front().is_some_and(|&(seq, _)| seq < to) {
                    if let Some((_, xfer)) = self.sends.pop_front() {
                        self.out.push_back(Effect::CompleteAll(xfer));
                    }
                }
            }
            Action::Notif { name, msg } => return Ok(Payload::Notif { name, msg }),
        }
        Ok(Payload::Nothing)
    }

    /// The peer's inline write `xfer` has landed (`ok`) or failed to: what
    /// it held goes back; a landed one is answered `WriteDone`.
    pub fn inline_write_landed(&mut self, xfer: u64, weight: usize, ok: bool) {
        self.book.served_end(weight);
        if ok {
            self.out
                .push_back(Effect::Send(Control::WriteDone { xfer }));
        }
    }

    /// The payload of the peer's refused inline write was dropped.
    pub fn inline_write_dropped(&mut self, xfer: u64, reason: String) {
        self.out
            .push_back(Effect::Send(Control::Refused { xfer, reason }));
    }

    /// Our inline read `xfer` has its data.
    pub fn inline_read_landed(&mut self, xfer: u64) {
        self.out.push_back(Effect::Complete(xfer));
    }

    /// The requests serving the peer's request `xfer` ended (`Ok`: every
    /// one did). What it held goes back; a write is answered.
    pub fn served_ended(
        &mut self,
        xfer: u64,
        weight: usize,
        answer: Answer,
        outcome: Result<(), Failure>,
    ) {
        self.book.served_end(weight);
        let done = match answer {
            Answer::Write => Control::WriteDone { xfer },
            Answer::Read => return,
        };
        self.out.push_back(Effect::Send(match outcome {
            Ok(()) => done,
            Err(f) => Control::Refused {
                xfer,
                reason: f.to_string(),
            },
        }));
    }
}

/// Where each request of `plan` over `items` (a pulled write's runs)
/// copies its bytes from: the peer's run `src[i]` for our run `items[i]`,
/// at the same offsets (the runs of both sides have the same lengths; the
/// peer's net checks its own against the ranges asked of it).
pub fn pull_refs(items: &Pieces, plan: &[OpPlan], src: Vec<PullRun>) -> Vec<Vec<RemoteRef>> {
    let keys: Vec<Arc<[u8]>> = src.into_iter().map(|p| Arc::from(p.key)).collect();
    plan.iter()
        .map(|p| match *p {
            OpPlan::Piece { item, off, len, .. } => vec![RemoteRef {
                key: keys[item].clone(),
                off: off as u64,
                len: len as u64,
            }],
            OpPlan::Gather { start, end } => (start..end)
                .map(|i| RemoteRef {
                    key: keys[i].clone(),
                    off: 0,
                    len: items.mems()[i].len as u64,
                })
                .collect(),
        })
        .collect()
}

/// Where one request of ours (`plan`, over segments of lengths `lens`)
/// copies from, given where each run of its transfer lies (`runs`: a key
/// and the run's offset in it): a piece of one run at its offset, or a
/// gathered request's runs whole. None if the runs do not cover it.
pub fn op_refs(plan: Option<OpPlan>, lens: &[usize], runs: &[RunSrc]) -> Option<Vec<RemoteRef>> {
    match plan? {
        OpPlan::Piece { item, off, len, .. } => {
            let (key, base) = runs.get(item)?;
            Some(vec![RemoteRef {
                key: key.clone(),
                off: base.checked_add(off as u64)?,
                len: len as u64,
            }])
        }
        OpPlan::Gather { start, end } => {
            if end - start != lens.len() {
                return None;
            }
            (start..end)
                .zip(lens)
                .map(|(i, &len)| {
                    let (key, base) = runs.get(i)?;
                    Some(RemoteRef {
                        key: key.clone(),
                        off: *base,
                        len: len as u64,
                    })
                })
                .collect()
        }
    }
}

/// The requests of `plan` over `items`, each built by `make` from its
/// segments and the bytes it must carry exactly (`None`: a one-piece
/// receive may take a shorter message). With `exact` false, a one-piece
/// message may be shorter than its receive buffer; longer and gathered
/// messages must match exactly.
pub fn requests<T>(
    items: &Pieces,
    plan: &[OpPlan],
    exact: bool,
    mut make: impl FnMut(Pieces, Option<usize>) -> T,
) -> Vec<T> {
    plan.iter()
        .map(|p| match *p {
            OpPlan::Piece {
                item,
                off,
                len,
                pieces,
            } => {
                let (m, r) = items.get(item).expect("a plan covers its items");
                let mem = MemRef {
                    addr: m.addr + off as u64,
                    len,
                    kind: m.kind,
                };
                make(
                    Pieces::one(mem, r.clone()),
                    (exact || pieces > 1).then_some(len),
                )
            }
            OpPlan::Gather { start, end } => {
                let segs = items.slice(start..end);
                let total = segs.total();
                make(segs, Some(total))
            }
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn machine() -> Proto<Vec<u8>> {
        Proto::new(Setup {
            registry: Arc::new(Registry::new()),
            conn: 1,
            chunk: 1 << 20,
            gather: Gather::new(1 << 20, 64),
            limits: Limits::default(),
            now: 0,
            pull: false,
        })
    }

    /// The frames among the machine's effects, in order.
    fn frames(p: &mut Proto<Vec<u8>>) -> Vec<Control> {
        std::iter::from_fn(|| p.poll())
            .filter_map(|e| match e {
                Effect::Send(m) => Some(m),
                _ => None,
            })
            .collect()
    }

    #[test]
    fn landed_receives_are_acknowledged_together_and_with_any_frame() {
        let mut p = machine();
        let n = ACK_EVERY * 2 + 8;
        for _ in 0..n {
            p.post_recv(vec![]);
        }
        assert!(frames(&mut p).is_empty());
        // Fewer than ACK_EVERY landed: nothing told yet.
        for seq in 0..ACK_EVERY - 1 {
            p.recv_ended(seq, Ok(())).unwrap();
        }
        assert!(frames(&mut p).is_empty());
        // The ACK_EVERY-th: the count, once.
        p.recv_ended(ACK_EVERY - 1, Ok(())).unwrap();
        assert_eq!(frames(&mut p), vec![Control::MsgDone { count: ACK_EVERY }]);
        // Out of order: the count grows only once the gap lands.
        p.recv_ended(ACK_EVERY + 1, Ok(())).unwrap();
        p.send_notif("a".into(), b"x".to_vec());
        let f = frames(&mut p);
        assert!(matches!(f[..], [Control::Notif { .. }]), "{f:?}");
        p.recv_ended(ACK_EVERY, Ok(())).unwrap();
        // Any other frame we write carries the count ahead of it.
        p.send_notif("a".into(), b"y".to_vec());
        let f = frames(&mut p);
        assert_eq!(
            f[0],
            Control::MsgDone {
                count: ACK_EVERY + 2
            }
        );
        assert!(matches!(f[1..], [Control::Notif { .. }]), "{f:?}");
        // A frame of the peer's (a closing sender asks with a keep-alive)
        // is answered with the count; nothing when it has not grown.
        p.recv_ended(ACK_EVERY + 2, Ok(())).unwrap();
        p.heard(5);
        p.on_control(Control::KeepAlive).unwrap();
        assert_eq!(
            frames(&mut p),
            vec![Control::MsgDone {
                count: ACK_EVERY + 3
            }]
        );
        p.heard(6);
        assert!(frames(&mut p).is_empty());
        // The watchdog's tick tells it (no keep-alive due yet).
        p.recv_ended(ACK_EVERY + 3, Ok(())).unwrap();
        p.tick(7, 1_000, 60_000).unwrap();
        assert_eq!(
            frames(&mut p),
            vec![Control::MsgDone {
                count: ACK_EVERY + 4
            }]
        );
        // So does an orderly close, ahead of its `Close`.
        p.recv_ended(ACK_EVERY + 4, Ok(())).unwrap();
        p.close();
        assert_eq!(
            frames(&mut p),
            vec![
                Control::MsgDone {
                    count: ACK_EVERY + 5
                },
                Control::Close
            ]
        );
    }

    #[test]
    fn counts_leave_growing_when_one_queued_is_overtaken() {
        // A frame queued first, then ACK_EVERY receives landing (their
        // count queued behind it), then one more: the frame carries the
        // larger count ahead of it, and the smaller one queued is dropped
        // (the peer refuses a count that does not grow).
        let mut p = machine();
        for _ in 0..ACK_EVERY + 1 {
            p.post_recv(vec![]);
        }
        let _ = frames(&mut p);
        p.send_notif("a".into(), b"x".to_vec());
        for seq in 0..=ACK_EVERY {
            p.recv_ended(seq, Ok(())).unwrap();
        }
        let f = frames(&mut p);
        assert_eq!(
            f[0],
            Control::MsgDone {
                count: ACK_EVERY + 1
            }
        );
        assert!(matches!(f[1..], [Control::Notif { .. }]), "{f:?}");
    }

    #[test]
    fn a_closing_sender_asks_for_the_count_only_while_messages_are_unacknowledged() {
        let mut p = machine();
        p.ask_acks();
        assert!(frames(&mut p).is_empty(), "nothing sent: nothing to ask");
        for x in 0..3 {
            p.post_send(x, vec![]);
        }
        let _ = frames(&mut p);
        p.ask_acks();
        assert_eq!(frames(&mut p), vec![Control::KeepAlive]);
        p.on_control(Control::MsgDone { count: 3 }).unwrap();
        let _ = frames(&mut p);
        p.ask_acks();
        assert!(frames(&mut p).is_empty());
    }

    fn keys(n: usize) -> Vec<RunSrc> {
        (0..n).map(|i| (Arc::from(vec![i as u8; 4]), 0)).collect()
    }

    #[test]
    fn a_request_finds_its_pieces_of_the_granted_runs_from_its_place_in_the_plan() {
        let k = keys(3);
        // A piece of run 1 at offset 4096.
        let piece = OpPlan::Piece {
            item: 1,
            off: 4096,
            len: 1000,
            pieces: 2,
        };
        let r = op_refs(Some(piece), &[1000], &k).unwrap();
        assert_eq!(r.len(), 1);
        assert_eq!((&*r[0].key, r[0].off, r[0].len), (&*k[1].0, 4096, 1000));
        // Runs 1 and 2 gathered whole.
        let gather = OpPlan::Gather { start: 1, end: 3 };
        let r = op_refs(Some(gather), &[10, 20], &k).unwrap();
        let got: Vec<(&[u8], u64, u64)> = r.iter().map(|p| (&*p.key, p.off, p.len)).collect();
        assert_eq!(got, vec![(&*k[1].0, 0, 10), (&*k[2].0, 0, 20)]);
        // Runs that lie inside a lease start at their offsets in it.
        let mut k = k;
        k[1].1 = 100;
        k[2].1 = 7;
        let r = op_refs(Some(piece), &[1000], &k).unwrap();
        assert_eq!(r[0].off, 4196);
        let r = op_refs(Some(gather), &[10, 20], &k).unwrap();
        assert_eq!((r[0].off, r[1].off), (100, 7));
        k[1].1 = u64::MAX;
        assert!(
            op_refs(Some(piece), &[1000], &k).is_none(),
            "no offset past the end"
        );
    }

    #[test]
    fn a_grant_that_does_not_cover_a_request_finds_nothing() {
        let k = keys(2);
        let piece = OpPlan::Piece {
            item: 2,
            off: 0,
            len: 8,
            pieces: 1,
        };
        assert!(op_refs(Some(piece), &[8], &k).is_none(), "no key for run 2");
        let gather = OpPlan::Gather { start: 0, end: 3 };
        assert!(op_refs(Some(gather), &[1, 2, 3], &k).is_none());
        // A gathered request whose segments are not its runs'.
        let gather = OpPlan::Gather { start: 0, end: 2 };
        assert!(op_refs(Some(gather), &[1], &k).is_none());
        // A request with no place in a plan (not one of ours).
        assert!(op_refs(None, &[8], &k).is_none());
    }
}
