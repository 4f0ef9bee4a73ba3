//! The transfer lifecycle: a transfer waits for a count of events (chunks
//! done, the peer's acknowledgement) and ends exactly once, done or failed
//! with a reason.

use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;
use std::thread::Thread;
use std::time::Duration;

use parking_lot::{Condvar, Mutex};

use crate::error::{Error, NetError};
use crate::memory::Region;

/// Why a transfer (or the connection it rode) failed.
#[derive(Debug, Clone)]
pub enum Failure {
    /// The peer refused the request (bad descriptor, bounds).
    Refused(String),
    /// The connection broke or was closed.
    Lost(String),
    /// The peer broke the protocol; the connection was ended.
    Protocol(String),
    /// The peer went silent past the deadline; the connection was ended.
    TimedOut(String),
    /// The transport failed: its own error (a local CUDA failure on an I/O
    /// thread, a reset stream, a peer's malformed part header...).
    Net(NetError),
    /// The application cancelled it before its data moved.
    Cancelled,
}

impl Failure {
    /// The caller's error for a transfer on connection `conn`.
    pub fn into_error(self, conn: u64) -> Error {
        match self {
            Failure::Refused(reason) => Error::Refused { conn, reason },
            Failure::Lost(reason) => Error::ConnectionLost { conn, reason },
            Failure::Protocol(reason) => Error::Protocol { conn, reason },
            Failure::TimedOut(reason) => Error::TimedOut { conn, reason },
            Failure::Net(source) => Error::Net { conn, source },
            Failure::Cancelled => Error::Cancelled { conn },
        }
    }
}

/// A connection ended for this reason (closed, broken).
impl From<String> for Failure {
    fn from(reason: String) -> Self {
        Failure::Lost(reason)
    }
}

impl From<NetError> for Failure {
    fn from(e: NetError) -> Self {
        Failure::Net(e)
    }
}

impl std::fmt::Display for Failure {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Failure::Refused(r) => write!(f, "refused by peer: {r}"),
            Failure::Lost(r) | Failure::Protocol(r) | Failure::TimedOut(r) => write!(f, "{r}"),
            Failure::Net(e) => write!(f, "transport failed: {e}"),
            Failure::Cancelled => write!(f, "cancelled before its data moved"),
        }
    }
}

/// Equal when of the same kind with the same text (a transport error is
/// compared by its text).
impl PartialEq for Failure {
    fn eq(&self, other: &Self) -> bool {
        use Failure::*;
        match (self, other) {
            (Refused(a), Refused(b))
            | (Lost(a), Lost(b))
            | (Protocol(a), Protocol(b))
            | (TimedOut(a), TimedOut(b)) => a == b,
            (Net(a), Net(b)) => a.to_string() == b.to_string(),
            (Cancelled, Cancelled) => true,
            _ => false,
        }
    }
}

impl Eq for Failure {}

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Status {
    Pending,
    Done,
    Failed(Failure),
}

/// What a connection's machine must hear of a transfer's end before the
/// end is published (see [`Ends`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Watch {
    /// Our receive number `seq`: counted first among those landed (the
    /// peer is told the count together, [`crate::proto::ACK_EVERY`]).
    Recv { seq: u64 },
    /// The requests serving the peer's accepted request `xfer` (what it
    /// held, `weight`), answered as `answer` says.
    Served {
        xfer: u64,
        weight: usize,
        answer: Answer,
    },
    /// Our read the peer granted (`xfer`): its end, done or failed, is
    /// answered `ReadDone`.
    Granted { xfer: u64 },
    /// Our read or write copied from or into the peer's leases `used`
    /// (token ids): they are free of it, and a revoked one is answered
    /// `Revoked`.
    Leased { used: Vec<u64> },
    /// Regions registered for this transfer alone (the `*_ipc` calls on a
    /// connection of the same-host net): once it has ended, each comm lets
    /// its registration of them go.
    Forget { regions: Vec<u64> },
    /// A notification `msg` from us (`name`) once the transfer is done.
    Notify { name: String, msg: Vec<u8> },
}

/// How the end of the requests serving a peer's accepted one-sided
/// request is answered.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Answer {
    /// A write (we received it, or pulled it): `WriteDone`, or `Refused`.
    Write,
    /// A read whose data we sent: nothing (the reader's receives end it).
    Read,
}

/// A watched transfer whose end is decided, held for its connection.
pub struct Held {
    pub transfer: Arc<Transfer>,
    pub watch: Vec<Watch>,
    pub status: Status,
}

/// A connection's ends to hear: a watched transfer's end is decided
/// wherever its last event happens, and held here; the connection's own
/// threads take them ([`Ends::take`]) after a round of progress or of its
/// machine, feed them to the machine (an acknowledgement, a served
/// request's answer, a notification leave), and only then publish each
/// end ([`Transfer::finish`]), so that a waiter never acts on an end
/// before what must precede it has left. Nothing is called on the thread
/// that ends a transfer. Once closed (the connection failed or is gone),
/// ends are published at once.
#[derive(Default)]
pub struct Ends {
    held: Mutex<EndsInner>,
    waiting: AtomicBool,
    /// A thread is hearing (see [`Ends::hear`]).
    hearing: AtomicBool,
}

#[derive(Default)]
struct EndsInner {
    closed: bool,
    held: Vec<Held>,
}

impl Ends {
    pub fn new() -> Arc<Self> {
        Arc::new(Ends::default())
    }

    /// Whether ends are held (lock-free).
    pub fn waiting(&self) -> bool {
        self.waiting.load(Ordering::SeqCst)
    }

    /// The held ends, oldest first.
    pub fn take(&self) -> Vec<Held> {
        let mut g = self.held.lock();
        self.waiting.store(false, Ordering::SeqCst);
        std::mem::take(&mut g.held)
    }

    /// Whether ends are held and no thread is hearing them (one that is
    /// looks again before it stops: see [`Ends::hear`]).
    pub fn unheard(&self) -> bool {
        self.waiting() && !self.hearing.load(Ordering::SeqCst)
    }

    /// Hands every held end to `each`, then publishes it, until none is
    /// held. One thread at a time: a thread that finds another hearing
    /// leaves the ends to it, which looks again before it stops, so no
    /// end held meanwhile is left behind.
    pub fn hear(&self, mut each: impl FnMut(&Held)) {
        while self.waiting() {
            if self.hearing.swap(true, Ordering::SeqCst) {
                return;
            }
            for h in self.take() {
                each(&h);
                h.transfer.finish(&h.status);
            }
            self.hearing.store(false, Ordering::SeqCst);
        }
    }

    /// Closes (the connection failed or is gone): what is held is
    /// published as it ended, unheard, and so is every later end. Returns
    /// how many were held.
    pub fn close(&self) -> usize {
        let held = {
            let mut g = self.held.lock();
            g.closed = true;
            self.waiting.store(false, Ordering::SeqCst);
            std::mem::take(&mut g.held)
        };
        for h in &held {
            h.transfer.finish(&h.status);
        }
        held.len()
    }

    /// Holds `h` for the connection to hear; publishes it at once once
    /// closed.
    fn hold(&self, h: Held) {
        {
            let mut g = self.held.lock();
            if !g.closed {
                g.held.push(h);
                self.waiting.store(true, Ordering::SeqCst);
                return;
            }
        }
        h.transfer.finish(&h.status);
    }
}

/// A transfer's end as it is being decided: the outcome (set once, by the
/// first to end it), where it is held before it is published, and the
/// transfer it is a part of.
#[derive(Default)]
struct Ending {
    outcome: Option<Status>,
    watch: Option<(Arc<Ends>, Arc<Transfer>, Vec<Watch>)>,
    whole: Option<Arc<Transfer>>,
}

/// One transfer (user-visible or internal to the engine).
pub struct Transfer {
    pub id: u64,
    pub conn: u64,
    remaining: AtomicUsize,
    ended: AtomicBool,
    status: Mutex<Status>,
    cv: Condvar,
    /// How it ends, once decided, and what runs then (in order), before
    /// the end is published.
    ending: Mutex<Ending>,
    /// Set when a piece went wrong in a way that another event will explain
    /// (a refused read's empty fillers): the transfer then cannot end Done.
    poison: Mutex<Option<Failure>>,
    /// Regions in use: held so that deregistration waits for us, and let
    /// go when the transfer ends (requests still posted to the net hold
    /// their regions on their own, in their chunk ops).
    regions: Mutex<Vec<Arc<Region>>>,
    /// A thread parked until the transfer ends (see `Conn::wait_on`).
    waiter: Mutex<Option<Thread>>,
}

impl Transfer {
    /// A transfer that ends after `events` calls to [`Transfer::complete_one`].
    pub fn new(id: u64, conn: u64, events: usize, regions: Vec<Arc<Region>>) -> Arc<Self> {
        let t = Arc::new(Transfer {
            id,
            conn,
            remaining: AtomicUsize::new(events),
            ended: AtomicBool::new(false),
            status: Mutex::new(Status::Pending),
            cv: Condvar::new(),
            ending: Mutex::new(Ending::default()),
            poison: Mutex::new(None),
            regions: Mutex::new(regions),
            waiter: Mutex::new(None),
        });
        if events == 0 {
            t.end(Status::Done);
        }
        t
    }

    /// Has the transfer's end held in `ends` with `w` before it is
    /// published (see [`Ends`]). True when the end is decided already: it
    /// is held with `w` now (published or not), for the caller to see to.
    pub fn watch(self: &Arc<Self>, ends: &Arc<Ends>, w: Watch) -> bool {
        let outcome = {
            let mut e = self.ending.lock();
            match &e.outcome {
                Some(s) => s.clone(),
                None => {
                    match &mut e.watch {
                        Some((_, _, ws)) => ws.push(w),
                        None => e.watch = Some((ends.clone(), self.clone(), vec![w])),
                    }
                    return false;
                }
            }
        };
        ends.hold(Held {
            transfer: self.clone(),
            watch: vec![w],
            status: outcome,
        });
        true
    }

    /// Makes this transfer one of `whole`'s events: its end counts one of
    /// them, and its failure poisons `whole` (see [`Transfer::poison`]). At
    /// once if it has ended already.
    pub fn part_of(&self, whole: Arc<Transfer>) {
        let outcome = {
            let mut e = self.ending.lock();
            match &e.outcome {
                Some(s) => s.clone(),
                None => {
                    e.whole = Some(whole);
                    return;
                }
            }
        };
        Self::count_into(&whole, &outcome);
    }

    /// A part of `whole` ended with `s`.
    fn count_into(whole: &Transfer, s: &Status) {
        if let Status::Failed(f) = s {
            whole.poison(f.clone());
        }
        whole.complete_one();
    }

    /// Ends the transfer with `s` unless its end is decided already. A
    /// watched transfer's end is held for its connection, which publishes
    /// it ([`Transfer::finish`]) once the machine has heard it (a receive
    /// counted, a notification after a transfer sent), so that nobody
    /// waiting on the transfer acts on its end (exits, closing the
    /// connection) before what must leave first has.
    fn end(&self, s: Status) -> bool {
        let watch = {
            let mut e = self.ending.lock();
            if e.outcome.is_some() {
                return false;
            }
            e.outcome = Some(s.clone());
            e.watch.take()
        };
        if let Some((ends, me, watch)) = watch {
            ends.hold(Held {
                transfer: me,
                watch,
                status: s,
            });
            return true;
        }
        self.finish(&s);
        true
    }

    /// Publishes the transfer's decided end `s` (once; later calls do
    /// nothing): counts it into its whole, wakes its waiters.
    pub fn finish(&self, s: &Status) {
        let whole = self.ending.lock().whole.take();
        if let Some(w) = whole {
            Self::count_into(&w, s);
        }
        {
            let mut st = self.status.lock();
            if *st != Status::Pending {
                return;
            }
            *st = s.clone();
            self.ended.store(true, Ordering::Release);
            self.regions.lock().clear();
            tracing::trace!(xfer = self.id, "lat: ended");
        }
        self.cv.notify_all();
        if let Some(t) = self.waiter.lock().as_ref() {
            t.unpark();
        }
    }

    /// One awaited event happened; the last one ends the transfer.
    pub fn complete_one(&self) {
        let prev = self.remaining.fetch_sub(1, Ordering::AcqRel);
        if prev == 1 {
            self.complete_all();
        }
    }

    /// Ends the transfer now, whatever events it still awaits: the peer has
    /// confirmed that every byte landed (a send's `MsgDone`), so the net's
    /// own completions, still to come, change nothing. (Waiting for them
    /// let a connection closed right after the acknowledgement fail a send
    /// that had landed.) The net's requests hold their regions themselves.
    pub fn complete_all(&self) {
        let poison = self.poison.lock().take();
        self.end(poison.map_or(Status::Done, Status::Failed));
    }

    /// Marks the transfer as unable to end Done; `why` is its failure unless
    /// a more precise one ends it first.
    pub fn poison(&self, why: Failure) {
        self.poison.lock().get_or_insert(why);
    }

    /// Ends the transfer with `why` unless it has already ended.
    pub fn fail(&self, why: Failure) -> bool {
        self.end(Status::Failed(why))
    }

    /// The thread to unpark when the transfer ends (None: no longer).
    pub fn set_waiter(&self, t: Option<Thread>) {
        *self.waiter.lock() = t;
    }

    /// True once the transfer has ended (lock-free).
    pub fn ended(&self) -> bool {
        self.ended.load(Ordering::Acquire)
    }

    pub fn status(&self) -> Status {
        self.status.lock().clone()
    }

    /// Waits until the transfer ends or `timeout` passes (None = forever).
    pub fn wait(&self, timeout: Option<Duration>) -> Status {
        let deadline = crate::timeout::deadline(timeout);
        let mut st = self.status.lock();
        while *st == Status::Pending {
            match deadline {
                Some(d) => {
                    if self.cv.wait_until(&mut st, d).timed_out() {
                        break;
                    }
                }
                None => self.cv.wait(&mut st),
            }
        }
        st.clone()
    }
}

/// `[addr, addr+len)` cut into pieces of at most `chunk` bytes; an empty range
/// is one empty piece (so that zero-byte messages still match).
pub fn chunks(addr: u64, len: usize, chunk: usize) -> impl Iterator<Item = (u64, usize)> {
    let chunk = chunk.max(1);
    let n = len.div_ceil(chunk).max(1);
    (0..n).map(move |i| {
        let off = i * chunk;
        (addr + off as u64, chunk.min(len - off.min(len)))
    })
}

/// How small items are gathered into one net request (both peers must use
/// the same settings: they follow from the net and the agreed chunk).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Gather {
    /// Items up to this size may share a request.
    pub item_max: usize,
    /// Bytes one gathered request carries at most.
    pub bytes: usize,
    /// Segments one request may carry (1: never gather).
    pub segs: usize,
}

impl Gather {
    /// Items of at most 256 KiB (capped by the chunk), up to a chunk and
    /// `segs` (at most 8,192) of them a request: with the socket net's
    /// 8 MiB chunk a 4,096-block KV transfer of 32 KiB blocks takes 16
    /// requests, not 4,096, each as large as a chunk of one message
    /// (measured on h200-x2: 4 MiB requests moved scattered blocks at
    /// 13-14 GB/s beside 18 for one message).
    pub fn new(chunk: usize, segs: usize) -> Self {
        Gather {
            item_max: (256usize << 10).min(chunk),
            bytes: chunk,
            segs: segs.clamp(1, 8192),
        }
    }
}

/// What one net request carries.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum OpPlan {
    /// `len` bytes of item `item` from offset `off` (of `pieces` pieces).
    Piece {
        item: usize,
        off: usize,
        len: usize,
        pieces: usize,
    },
    /// Items `start..end`, whole, gathered into one message.
    Gather { start: usize, end: usize },
}

/// Plans the requests of a list of items of lengths `lens`: runs of small
/// items are gathered, each other item is cut into chunks. Both peers plan
/// from the same lengths, so their requests pair up.
pub fn plan_ops(lens: &[usize], chunk: usize, g: Gather) -> Vec<OpPlan> {
    let small = |l: usize| g.segs > 1 && l > 0 && l <= g.item_max;
    let mut plan = Vec::new();
    let mut i = 0;
    while i < lens.len() {
        let (mut j, mut bytes) = (i, 0);
        while j < lens.len() && j - i < g.segs && small(lens[j]) && bytes + lens[j] <= g.bytes {
            bytes += lens[j];
            j += 1;
        }
        if j - i >= 2 {
            plan.push(OpPlan::Gather { start: i, end: j });
            i = j;
            continue;
        }
        let pieces = lens[i].div_ceil(chunk.max(1)).max(1);
        plan.extend(chunks(0, lens[i], chunk).map(|(off, len)| OpPlan::Piece {
            item: i,
            off: off as usize,
            len,
            pieces,
        }));
        i += 1;
    }
    plan
}

/// How many requests [`plan_ops`] would plan for items of lengths `lens`,
/// counted without allocating and without overflow (a list of huge items
/// plans more requests than could be held: counted first, refused before
/// planned).
pub fn plan_len(lens: &[usize], chunk: usize, g: Gather) -> u64 {
    let small = |l: usize| g.segs > 1 && l > 0 && l <= g.item_max;
    let mut n = 0u64;
    let mut i = 0;
    while i < lens.len() {
        let (mut j, mut bytes) = (i, 0usize);
        while j < lens.len()
            && j - i < g.segs
            && small(lens[j])
            && bytes.saturating_add(lens[j]) <= g.bytes
        {
            bytes += lens[j];
            j += 1;
        }
        if j - i >= 2 {
            n = n.saturating_add(1);
            i = j;
            continue;
        }
        n = n.saturating_add(lens[i].div_ceil(chunk.max(1)).max(1) as u64);
        i += 1;
    }
    n
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::error::{CudaError, ErrorKind, NetError};

    #[test]
    fn failures_keep_their_kind_up_to_the_caller() {
        // A CUDA failure on an I/O thread is a local CUDA failure, not a
        // lost connection; a peer's bad header is the peer's fault.
        let cuda = NetError::Cuda(CudaError::Driver {
            call: "cuEventSynchronize",
            msg: "CUDA_ERROR_ILLEGAL_ADDRESS".into(),
        });
        let e = Failure::Net(cuda).into_error(7);
        assert!(matches!(e, Error::Net { conn: 7, .. }));
        assert_eq!(e.kind(), ErrorKind::LocalCuda);
        let proto = NetError::Protocol {
            net: "socket",
            reason: "bad part".into(),
        };
        assert_eq!(
            Failure::Net(proto).into_error(1).kind(),
            ErrorKind::Protocol
        );
        let closed = Failure::Net(NetError::Closed { net: "socket" });
        assert_eq!(closed.into_error(1).kind(), ErrorKind::Lost);
        let kinds = [
            (Failure::Refused("no".into()), ErrorKind::Refused),
            (Failure::Lost("gone".into()), ErrorKind::Lost),
            (Failure::Protocol("bad".into()), ErrorKind::Protocol),
            (Failure::TimedOut("silent".into()), ErrorKind::TimedOut),
        ];
        for (f, k) in kinds {
            assert_eq!(f.clone().into_error(3).kind(), k, "{f}");
        }
        let io = NetError::io(
            "socket",
            "read",
            std::io::Error::from(std::io::ErrorKind::TimedOut),
        );
        assert_eq!(io.kind(), ErrorKind::TimedOut);
    }

    #[test]
    fn ends_exactly_once() {
        let t = Transfer::new(1, 1, 2, vec![]);
        t.complete_one();
        assert_eq!(t.status(), Status::Pending);
        t.complete_one();
        assert_eq!(t.status(), Status::Done);
        assert!(!t.fail(Failure::Lost("late".into())));
        assert_eq!(t.status(), Status::Done);
    }

    #[test]
    fn an_ended_transfer_lets_its_regions_go() {
        let r = Arc::new(Region {
            id: 1,
            addr: 4096,
            len: 4096,
            kind: crate::memory::MemKind::Host,
        });
        let t = Transfer::new(1, 1, 1, vec![r.clone()]);
        assert_eq!(Arc::strong_count(&r), 2, "held while pending");
        t.complete_one();
        assert_eq!(Arc::strong_count(&r), 1, "let go once ended");
        let t = Transfer::new(2, 1, 1, vec![r.clone()]);
        t.fail(Failure::Lost("gone".into()));
        assert_eq!(Arc::strong_count(&r), 1);
    }

    #[test]
    fn failure_wins_over_later_completion() {
        let t = Transfer::new(1, 1, 1, vec![]);
        assert!(t.fail(Failure::Refused("no".into())));
        t.complete_one();
        assert_eq!(t.status(), Status::Failed(Failure::Refused("no".into())));
    }

    #[test]
    fn parts_count_into_their_whole_which_ends_after_the_last_failed_if_any_did() {
        let whole = Transfer::new(9, 1, 3, vec![]);
        let parts: Vec<_> = (0..3).map(|i| Transfer::new(i, 1, 1, vec![])).collect();
        parts[0].part_of(whole.clone());
        parts[1].part_of(whole.clone());
        parts[0].complete_one();
        parts[1].fail(Failure::Refused("part 2's descriptor".into()));
        assert!(!whole.ended(), "a part is still running");
        // A part that ended before it was attached counts at once.
        parts[2].complete_one();
        parts[2].part_of(whole.clone());
        assert!(whole.ended());
        assert_eq!(
            whole.status(),
            Status::Failed(Failure::Refused("part 2's descriptor".into()))
        );
        // Whole of parts that all succeed: done.
        let whole = Transfer::new(10, 1, 2, vec![]);
        for i in 0..2 {
            let p = Transfer::new(i, 1, 1, vec![]);
            p.part_of(whole.clone());
            p.complete_one();
        }
        assert_eq!(whole.status(), Status::Done);
    }

    #[test]
    fn a_watched_end_is_held_for_its_connection_until_it_is_finished() {
        // A receive must be counted (and a notification after a transfer
        // leave) before its waiter can see it done (and exit, closing the
        // connection under it): the end waits in the connection's ends,
        // unpublished.
        let ends = Ends::new();
        let t = Transfer::new(1, 1, 1, vec![]);
        assert!(!t.watch(&ends, Watch::Recv { seq: 4 }));
        let note = Watch::Notify {
            name: "a".into(),
            msg: b"m".to_vec(),
        };
        assert!(!t.watch(&ends, note.clone()));
        assert!(!ends.waiting());
        t.complete_one();
        assert!(ends.waiting());
        assert!(!t.ended(), "held, not published");
        assert_eq!(t.status(), Status::Pending);
        assert!(!t.fail(Failure::Lost("late".into())), "decided already");
        let held = ends.take();
        assert!(!ends.waiting());
        assert_eq!(held.len(), 1);
        assert_eq!(held[0].watch, vec![Watch::Recv { seq: 4 }, note]);
        assert_eq!(held[0].status, Status::Done);
        held[0].transfer.finish(&held[0].status);
        assert!(t.ended());
        assert_eq!(t.status(), Status::Done);
        held[0].transfer.finish(&Status::Failed(Failure::Cancelled));
        assert_eq!(t.status(), Status::Done, "published once");
        // Watched once its end is decided: held at once, with its outcome.
        assert!(t.watch(&ends, Watch::Recv { seq: 5 }));
        let held = ends.take();
        assert_eq!(held.len(), 1);
        assert_eq!(held[0].status, Status::Done);
        // Closed (the connection is gone): published at once.
        let t = Transfer::new(2, 1, 1, vec![]);
        t.watch(&ends, Watch::Recv { seq: 6 });
        let u = Transfer::new(3, 1, 1, vec![]);
        u.watch(&ends, Watch::Recv { seq: 7 });
        u.fail(Failure::Lost("gone".into()));
        assert_eq!(ends.close(), 1, "what was held is published by the close");
        assert!(u.ended());
        assert_eq!(u.status(), Status::Failed(Failure::Lost("gone".into())));
        t.complete_one();
        assert!(t.ended());
        assert!(!ends.waiting());
    }

    #[test]
    fn ends_held_from_many_threads_are_each_heard_and_published_once() {
        // Threads end watched transfers and hear, as a connection's
        // threads do, each hearing slowly (as a machine writing its frames
        // does): whoever hears, every end is heard once and then
        // published, and none is left held once the last thread is done.
        // In step (a barrier each round), so that the last ends come
        // while another thread hears.
        let ends = Ends::new();
        let heard = Arc::new(Mutex::new(Vec::new()));
        let step = Arc::new(std::sync::Barrier::new(6));
        let threads: Vec<_> = (0..6u64)
            .map(|k| {
                let (ends, heard, step) = (ends.clone(), heard.clone(), step.clone());
                std::thread::spawn(move || {
                    let mut mine = Vec::new();
                    for i in 0..300u64 {
                        step.wait();
                        let t = Transfer::new(k * 10_000 + i, 1, 1, vec![]);
                        t.watch(&ends, Watch::Recv { seq: t.id });
                        t.complete_one();
                        ends.hear(|h| {
                            assert!(!h.transfer.ended(), "heard before published");
                            heard.lock().push(h.transfer.id);
                            std::thread::sleep(Duration::from_micros(20));
                        });
                        mine.push(t);
                    }
                    mine
                })
            })
            .collect();
        let all: Vec<Arc<Transfer>> = threads
            .into_iter()
            .flat_map(|t| t.join().unwrap())
            .collect();
        assert!(!ends.waiting(), "an end was left held");
        let mut heard = heard.lock().clone();
        heard.sort_unstable();
        let mut ids: Vec<u64> = all.iter().map(|t| t.id).collect();
        ids.sort_unstable();
        assert_eq!(heard, ids, "each end heard exactly once");
        assert!(all.iter().all(|t| t.status() == Status::Done));
    }

    #[test]
    fn ends_held_while_a_thread_hears_are_its_to_hear() {
        // The progress task hears only ends no thread is hearing: one
        // held while another thread hears is taken by that thread before
        // it stops.
        let ends = Ends::new();
        let first = Transfer::new(1, 1, 1, vec![]);
        first.watch(&ends, Watch::Recv { seq: 1 });
        first.complete_one();
        assert!(ends.unheard());
        let (inside, go) = (
            Arc::new(std::sync::Barrier::new(2)),
            Arc::new(std::sync::Barrier::new(2)),
        );
        let hearer = {
            let (ends, inside, go) = (ends.clone(), inside.clone(), go.clone());
            std::thread::spawn(move || {
                let mut heard = Vec::new();
                ends.hear(|h| {
                    if h.transfer.id == 1 {
                        inside.wait();
                        go.wait();
                    }
                    heard.push(h.transfer.id);
                });
                heard
            })
        };
        inside.wait();
        let second = Transfer::new(2, 1, 1, vec![]);
        second.watch(&ends, Watch::Recv { seq: 2 });
        second.complete_one();
        assert!(ends.waiting());
        assert!(!ends.unheard(), "the hearing thread takes it");
        ends.hear(|_| panic!("another thread is hearing"));
        go.wait();
        assert_eq!(hearer.join().unwrap(), vec![1, 2]);
        assert!(!ends.waiting() && !ends.unheard());
        assert!(first.ended() && second.ended());
    }

    #[test]
    fn a_watched_whole_is_held_after_its_last_part() {
        let ends = Ends::new();
        let whole = Transfer::new(9, 1, 2, vec![]);
        whole.watch(
            &ends,
            Watch::Notify {
                name: "a".into(),
                msg: vec![],
            },
        );
        let parts: Vec<_> = (0..2).map(|i| Transfer::new(i, 1, 1, vec![])).collect();
        for p in &parts {
            p.part_of(whole.clone());
        }
        parts[0].complete_one();
        assert!(!ends.waiting());
        parts[1].complete_one();
        assert!(parts[1].ended());
        assert!(!whole.ended());
        let held = ends.take();
        assert_eq!(held.len(), 1);
        held[0].transfer.finish(&held[0].status);
        assert_eq!(whole.status(), Status::Done);
    }

    #[test]
    fn an_acknowledged_transfer_ends_before_its_net_events() {
        let t = Transfer::new(1, 1, 3, vec![]);
        t.complete_one();
        t.complete_all();
        assert_eq!(t.status(), Status::Done);
        // The net's late completions and the connection's loss change nothing.
        t.complete_one();
        t.complete_one();
        assert!(!t.fail(Failure::Lost("peer closed the connection".into())));
        assert_eq!(t.status(), Status::Done);
    }

    #[test]
    fn wait_times_out_and_wakes() {
        let t = Transfer::new(1, 1, 1, vec![]);
        assert_eq!(t.wait(Some(Duration::from_millis(5))), Status::Pending);
        let t2 = t.clone();
        let h = std::thread::spawn(move || t2.wait(None));
        std::thread::sleep(Duration::from_millis(5));
        t.complete_one();
        assert_eq!(h.join().unwrap(), Status::Done);
        assert_eq!(Transfer::new(2, 1, 0, vec![]).status(), Status::Done);
    }

    #[test]
    fn chunk_arithmetic() {
        let v: Vec<_> = chunks(100, 0, 10).collect();
        assert_eq!(v, vec![(100, 0)]);
        let v: Vec<_> = chunks(100, 25, 10).collect();
        assert_eq!(v, vec![(100, 10), (110, 10), (120, 5)]);
        let v: Vec<_> = chunks(0, 20, 10).collect();
        assert_eq!(v, vec![(0, 10), (10, 10)]);
        let total: usize = chunks(7, (1 << 30) + 3, 8 << 20).map(|c| c.1).sum();
        assert_eq!(total, (1 << 30) + 3);
    }

    /// Every byte of every item is covered once, in order, by the plan.
    fn covered(lens: &[usize], plan: &[OpPlan]) -> Vec<(usize, usize, usize)> {
        let mut v = Vec::new();
        for p in plan {
            match *p {
                OpPlan::Piece { item, off, len, .. } => v.push((item, off, len)),
                OpPlan::Gather { start, end } => v.extend((start..end).map(|i| (i, 0, lens[i]))),
            }
        }
        v
    }

    #[test]
    fn small_items_gather_large_ones_chunk() {
        let g = Gather::new(8 << 20, 1024);
        let k32 = 32 << 10;
        // 4,096 blocks of 32 KiB: 8 MiB (256 blocks) a request.
        let lens = vec![k32; 4096];
        let plan = plan_ops(&lens, 8 << 20, g);
        assert_eq!(plan.len(), 16);
        assert_eq!(plan[0], OpPlan::Gather { start: 0, end: 256 });
        assert_eq!(
            covered(&lens, &plan),
            (0..4096).map(|i| (i, 0, k32)).collect::<Vec<_>>()
        );
        // A large item breaks a run; it is chunked; a lone small item is a
        // piece of its own; empty items never gather.
        let lens = [k32, k32, 20 << 20, k32, 0, k32, k32, k32];
        let plan = plan_ops(&lens, 8 << 20, g);
        assert_eq!(
            plan,
            vec![
                OpPlan::Gather { start: 0, end: 2 },
                OpPlan::Piece {
                    item: 2,
                    off: 0,
                    len: 8 << 20,
                    pieces: 3
                },
                OpPlan::Piece {
                    item: 2,
                    off: 8 << 20,
                    len: 8 << 20,
                    pieces: 3
                },
                OpPlan::Piece {
                    item: 2,
                    off: 16 << 20,
                    len: 4 << 20,
                    pieces: 3
                },
                OpPlan::Piece {
                    item: 3,
                    off: 0,
                    len: k32,
                    pieces: 1
                },
                OpPlan::Piece {
                    item: 4,
                    off: 0,
                    len: 0,
                    pieces: 1
                },
                OpPlan::Gather { start: 5, end: 8 },
            ]
        );
        // vLLM's 131,072 blocks of 4 KiB through the socket net (8,192
        // segments a message): a chunk a request, as one descriptor of the
        // same bytes would be cut.
        let plan = plan_ops(&[4096; 131_072], 8 << 20, Gather::new(8 << 20, 8192));
        assert_eq!(plan.len(), 64);
        assert!(plan
            .iter()
            .all(|p| matches!(p, OpPlan::Gather { start, end } if end - start == 2048)));
        // Segment limit, and a net that never gathers.
        let plan = plan_ops(&[4096; 10], 8 << 20, Gather::new(8 << 20, 4));
        assert_eq!(plan.len(), 3);
        let plan = plan_ops(&[4096; 10], 8 << 20, Gather::new(8 << 20, 1));
        assert_eq!(plan.len(), 10);
        assert!(plan
            .iter()
            .all(|p| matches!(p, OpPlan::Piece { len: 4096, .. })));
        // The byte limit follows the chunk.
        let plan = plan_ops(&[64 << 10; 64], 1 << 20, Gather::new(1 << 20, 1024));
        assert_eq!(plan.len(), 4);
    }

    #[test]
    fn plan_len_counts_what_plan_ops_plans() {
        use rand::{Rng, SeedableRng};
        let mut rng = rand::rngs::StdRng::seed_from_u64(3);
        for _ in 0..2000 {
            let n = rng.random_range(0..40);
            let lens: Vec<usize> = (0..n)
                .map(|_| match rng.random_range(0..4) {
                    0 => 0,
                    1 => rng.random_range(1..5000),
                    2 => rng.random_range(1..70_000),
                    _ => rng.random_range(1..300_000),
                })
                .collect();
            let chunk = [4096, 65536, 1 << 20][rng.random_range(0..3)];
            let g = Gather::new(chunk, [1, 4, 1024][rng.random_range(0..3)]);
            assert_eq!(
                plan_len(&lens, chunk, g),
                plan_ops(&lens, chunk, g).len() as u64
            );
        }
        assert_eq!(plan_len(&[1 << 62], 4096, Gather::new(4096, 64)), 1 << 50);
        assert_eq!(
            plan_len(&[usize::MAX, usize::MAX], 1, Gather::new(1, 1)),
            u64::MAX
        );
    }
}
