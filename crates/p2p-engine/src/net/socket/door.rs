//! The net's one listener: every stream a peer opens to one of this net's
//! receive comms comes in here, whichever comm it is for. Its hello names
//! the comm (the nonce of the comm's listen handle: random, known only to
//! the peer the handle was given to, and the comm's key in our records)
//! and the stream's index. A stream is given to a comm only once its hello
//! checks out against our record of that comm: the nonce is one of ours,
//! the index is below the comm's count and not in yet, and the comm has
//! not had its refusals. Anything else is closed without touching any
//! comm.
//!
//! Hellos are awaited by tasks on the I/O workers, never by a blocked
//! worker, each for at most the net's `hello_timeout`, and at most
//! [`WAITING_PER_ADDR`] at once from one address and [`WAITING_MAX`] in
//! all: past either the oldest waiting connection (of that address, or of
//! the address holding the most) is closed to make room. An honest peer
//! writes its hello as soon as it is connected, so its connections wait
//! for microseconds; a silent one is the oldest. Streams that come for a
//! listen comm not accepted yet wait in its record (at most its count),
//! and join the comm when it is accepted.

use std::collections::HashMap;
use std::io::{self, Read};
use std::net::{IpAddr, SocketAddr, TcpListener, TcpStream};
use std::os::fd::AsRawFd;
use std::sync::{Arc, Weak};
use std::time::{Duration, Instant};

use parking_lot::Mutex;

use super::streams::{RxStreams, MAX_STREAMS};
use super::wire::{Hello, HELLO_LEN};
use super::{SocketConfig, NET};
use crate::accept::Backoff;
use crate::error::NetError;
use crate::workers::{Step, Task, Workers};

/// Streams refused per comm (per allowed stream) before the comm takes no
/// more: a peer that keeps sending bad hellos for its comm gets no more
/// turns.
const REFUSALS_PER_STREAM: usize = 2;

/// Connections awaiting their hello at once, in all.
const WAITING_MAX: usize = 256;
/// Connections awaiting their hello at once from one address.
pub(super) const WAITING_PER_ADDR: usize = 64;

/// The net's listener and its records of the comms it admits streams for.
pub(super) struct Door {
    listener: Arc<TcpListener>,
    addr: SocketAddr,
    hello_timeout: Duration,
    workers: Workers,
    inner: Mutex<DoorInner>,
}

#[derive(Default)]
struct DoorInner {
    /// The receive comms (and listen comms not accepted yet), by nonce.
    comms: HashMap<u64, Comm>,
    /// Connections whose hello has not come, oldest first.
    waiting: Vec<Waiting>,
    next_id: u64,
}

/// Our record of one comm.
struct Comm {
    /// Most streams it may have (its handle's count).
    allowed: usize,
    /// Stream indices given to it so far, a bit each.
    taken: u64,
    /// Streams refused for it (bad or used index).
    refused: usize,
    /// Streams in before the comm was accepted, with their index.
    early: Vec<(usize, Arc<TcpStream>)>,
    /// The accepted comm's streams (None: not accepted yet).
    rx: Option<Weak<RxStreams>>,
}

struct Waiting {
    id: u64,
    ip: IpAddr,
    s: Arc<TcpStream>,
}

impl Door {
    /// Binds the net's listener and starts its task on `workers`.
    pub(super) fn open(cfg: &SocketConfig, workers: &Workers) -> Result<Arc<Self>, NetError> {
        let l = TcpListener::bind(SocketAddr::new(cfg.addr, 0))
            .map_err(|e| NetError::io(NET, "bind", e))?;
        l.set_nonblocking(true)
            .map_err(|e| NetError::io(NET, "listen", e))?;
        let addr = l.local_addr().map_err(|e| NetError::io(NET, "listen", e))?;
        let listener = Arc::new(l);
        let door = Arc::new(Door {
            listener: listener.clone(),
            addr,
            hello_timeout: cfg.hello_timeout,
            workers: workers.clone(),
            inner: Mutex::default(),
        });
        let fd = listener.as_raw_fd();
        let task = AcceptTask {
            door: Arc::downgrade(&door),
            listener,
            backoff: Backoff::new("socket net streams"),
        };
        workers.start_readable(Box::new(task), fd);
        Ok(door)
    }

    /// Where the peers connect.
    pub(super) fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// Records a new listen comm that may have `streams` streams: its
    /// nonce (unused among ours).
    pub(super) fn register(&self, streams: usize) -> u64 {
        let mut inner = self.inner.lock();
        let nonce = loop {
            let n = crate::memory::random_u64();
            if !inner.comms.contains_key(&n) {
                break n;
            }
        };
        inner.comms.insert(
            nonce,
            Comm {
                allowed: streams.clamp(1, MAX_STREAMS),
                taken: 0,
                refused: 0,
                early: Vec::new(),
                rx: None,
            },
        );
        nonce
    }

    /// The comm `nonce` is closed (or its listen comm dropped unaccepted):
    /// streams naming it are refused from now on, and those that came for
    /// it before its accept are closed.
    pub(super) fn forget(&self, nonce: u64) {
        let gone = self.inner.lock().comms.remove(&nonce);
        drop(gone);
    }

    /// Whether a stream has come for the listen comm `nonce`.
    pub(super) fn has_early(&self, nonce: u64) -> bool {
        self.inner
            .lock()
            .comms
            .get(&nonce)
            .is_some_and(|c| !c.early.is_empty())
    }

    /// The listen comm `nonce` is accepted as `rx`: later streams join it
    /// as they come; those that came already are returned, to join it now.
    pub(super) fn attach(
        &self,
        nonce: u64,
        rx: &Arc<RxStreams>,
    ) -> Result<Vec<(usize, Arc<TcpStream>)>, NetError> {
        let mut inner = self.inner.lock();
        let c = inner
            .comms
            .get_mut(&nonce)
            .ok_or_else(|| NetError::Misuse {
                net: NET,
                reason: "accept on a comm this net has no record of".into(),
            })?;
        c.rx = Some(Arc::downgrade(rx));
        Ok(std::mem::take(&mut c.early))
    }

    /// Connections awaiting their hello now (tests).
    #[cfg(test)]
    pub(super) fn waiting(&self) -> usize {
        self.inner.lock().waiting.len()
    }

    /// Takes a connection the listener accepted: its hello is read now if
    /// it has come (the usual case), else awaited by a task of its own
    /// until the net's `hello_timeout`.
    fn admit(self: &Arc<Self>, s: TcpStream, ip: IpAddr) {
        if s.set_nonblocking(true).is_err() {
            return;
        }
        let s = Arc::new(s);
        let mut task = HelloTask {
            door: Arc::downgrade(self),
            id: 0,
            s: s.clone(),
            hello: [0; HELLO_LEN],
            got: 0,
            until: Instant::now() + self.hello_timeout,
        };
        if let Some(done) = task.read_hello() {
            self.give(s, done);
            return;
        }
        {
            let mut inner = self.inner.lock();
            make_room(&mut inner.waiting, ip);
            inner.next_id += 1;
            task.id = inner.next_id;
            inner.waiting.push(Waiting {
                id: task.id,
                ip,
                s: s.clone(),
            });
        }
        let until = task.until;
        self.workers
            .start_readable_until(Box::new(task), s.as_raw_fd(), until);
    }

    /// The connection `id` has said its hello (`Some`: its bytes) or ended
    /// without one (`None`, or its time ran out): given to its comm if the
    /// hello checks out. Nothing if it was closed to make room meanwhile.
    fn hello_done(&self, id: u64, hello: Option<[u8; HELLO_LEN]>) {
        let s = {
            let mut inner = self.inner.lock();
            let Some(at) = inner.waiting.iter().position(|w| w.id == id) else {
                return;
            };
            inner.waiting.remove(at).s
        };
        self.give(s, hello);
    }

    /// Gives a stream to the comm its hello names, if the hello checks out
    /// against our record of it; else the stream is dropped (closed).
    fn give(&self, s: Arc<TcpStream>, hello: Option<[u8; HELLO_LEN]>) {
        let Some(h) = hello.and_then(|h| Hello::decode(&h).ok()) else {
            tracing::warn!("socket net: refused a stream with a bad hello or none");
            return;
        };
        let mut inner = self.inner.lock();
        let Some(c) = inner.comms.get_mut(&h.nonce) else {
            tracing::warn!("socket net: refused a stream naming no comm of ours");
            return;
        };
        let idx = usize::try_from(h.stream)
            .ok()
            .filter(|&i| i < c.allowed && c.taken & (1 << i) == 0);
        let Some(idx) = idx.filter(|_| c.refused < REFUSALS_PER_STREAM * c.allowed) else {
            c.refused += 1;
            tracing::warn!(
                "socket net: refused stream {} of a comm (index out of range or in already, or the comm has had its refusals)",
                h.stream
            );
            return;
        };
        c.taken |= 1 << idx;
        match &c.rx {
            None => c.early.push((idx, s)),
            Some(rx) => {
                let rx = rx.clone();
                drop(inner);
                if let Some(rx) = rx.upgrade() {
                    rx.join(idx, s);
                }
            }
        }
    }
}

/// Makes room for one more waiting connection from `ip`: past the bound
/// per address, the oldest of `ip`'s is closed; past the bound in all,
/// the oldest of the address holding the most.
fn make_room(waiting: &mut Vec<Waiting>, ip: IpAddr) {
    let from = |a: IpAddr| waiting.iter().filter(|w| w.ip == a).count();
    let victim = if from(ip) >= WAITING_PER_ADDR {
        Some(ip)
    } else if waiting.len() >= WAITING_MAX {
        waiting.iter().map(|w| w.ip).max_by_key(|&a| from(a))
    } else {
        None
    };
    let Some(victim) = victim else { return };
    if let Some(at) = waiting.iter().position(|w| w.ip == victim) {
        let w = waiting.remove(at);
        tracing::warn!(
            "socket net: closed a connection from {} that had not said its hello, to make room",
            w.ip
        );
        // Wakes its task, which finds it gone and ends (the descriptor
        // goes with it).
        let _ = w.s.shutdown(std::net::Shutdown::Both);
    }
}

impl Drop for Door {
    fn drop(&mut self) {
        // Wakes the listener's task (the listener turns readable) and each
        // waiting connection's: they find the door gone and end.
        let _ = socket2::SockRef::from(&*self.listener).shutdown(std::net::Shutdown::Both);
        for w in self.inner.get_mut().waiting.drain(..) {
            let _ = w.s.shutdown(std::net::Shutdown::Both);
        }
    }
}

/// An accepted connection waiting for its hello, on the I/O workers: it
/// reads what has come each time the socket turns readable, until its
/// deadline; a hello not whole by then is refused (the connection closes
/// as the task ends, and its descriptor goes).
struct HelloTask {
    door: Weak<Door>,
    /// Its entry among the door's waiting connections.
    id: u64,
    s: Arc<TcpStream>,
    hello: [u8; HELLO_LEN],
    got: usize,
    /// The hello must be whole by then.
    until: Instant,
}

impl HelloTask {
    /// Reads what has come of the hello, without waiting: `None` while
    /// more is to come, `Some(Some(hello))` once whole, `Some(None)` if the
    /// connection ended (or failed) before it.
    fn read_hello(&mut self) -> Option<Option<[u8; HELLO_LEN]>> {
        loop {
            match (&*self.s).read(&mut self.hello[self.got..]) {
                Ok(0) => return Some(None),
                Ok(n) => {
                    self.got += n;
                    if self.got == HELLO_LEN {
                        return Some(Some(self.hello));
                    }
                }
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => return None,
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(_) => return Some(None),
            }
        }
    }
}

impl Task for HelloTask {
    fn run(&mut self) -> Step {
        let Some(door) = self.door.upgrade() else {
            return Step::Done;
        };
        match self.read_hello() {
            None if Instant::now() >= self.until => {
                tracing::warn!(
                    "socket net: closing a stream that sent no hello within {:?} (TCPX_P2P_STREAM_HELLO_MS)",
                    door.hello_timeout
                );
                door.hello_done(self.id, None);
                Step::Done
            }
            None => Step::ReadableUntil(self.s.as_raw_fd(), self.until),
            Some(done) => {
                door.hello_done(self.id, done);
                Step::Done
            }
        }
    }
}

/// The net's listener on the I/O workers: takes each connection, waiting
/// for them without a thread; a failing accept (out of descriptors) backs
/// off without a thread too.
struct AcceptTask {
    door: Weak<Door>,
    listener: Arc<TcpListener>,
    backoff: Backoff,
}

impl Task for AcceptTask {
    fn run(&mut self) -> Step {
        loop {
            let Some(door) = self.door.upgrade() else {
                return Step::Done;
            };
            match self.listener.accept() {
                Ok((s, peer)) => {
                    self.backoff.accepted();
                    door.admit(s, peer.ip());
                }
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => {
                    return Step::Readable(self.listener.as_raw_fd());
                }
                Err(e) => {
                    if let Some(wait) = self.backoff.failed(&e) {
                        return Step::Until(Instant::now() + wait);
                    }
                }
            }
        }
    }
}
