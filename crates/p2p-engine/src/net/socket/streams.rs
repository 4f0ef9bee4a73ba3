//! Streams that follow the traffic: a comm starts with one TCP stream, and
//! its sender opens more (up to the listen handle's count) when a message
//! is cut into more parts than it has streams. The sender connects them
//! in the background ([`Grow`]), and they carry later messages once in;
//! the receiver keeps the comm's listener open and its task on the I/O
//! workers admits each new stream whose hello checks out ([`RxStreams`]).
//! Streams close only with their comm.

use std::io::{self, Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::os::fd::AsRawFd;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Weak};
use std::time::{Duration, Instant};

use parking_lot::Mutex;

use super::book::{Landing, RecvShared};
use super::rx::{RxHandle, RxTask};
use super::sockio::tune;
use super::stage::StagingPool;
use super::wire::{Hello, HELLO_LEN};
use super::{Lane, SocketConfig, NET};
use crate::error::NetError;
use crate::workers::{Home, Step, Task, Workers};

/// Streams refused per comm (per allowed stream) before its listener
/// closes: a peer that keeps sending bad hellos gets no more turns.
const REFUSALS_PER_STREAM: usize = 2;

/// Connects stream `index` of the comm listening at `addr` and says its
/// hello.
pub(super) fn open_stream(
    addr: SocketAddr,
    nonce: u64,
    index: usize,
    cfg: &SocketConfig,
) -> Result<TcpStream, NetError> {
    let mut s = TcpStream::connect_timeout(&addr, cfg.connect_timeout)
        .map_err(|e| NetError::io(NET, "connect", e))?;
    tune(&s, cfg.sockbuf).map_err(|e| NetError::io(NET, "setsockopt", e))?;
    let hello = Hello {
        nonce,
        stream: index as u64,
    };
    s.write_all(&hello.encode())
        .map_err(|e| NetError::io(NET, "connect", e))?;
    Ok(s)
}

/// Most streams a comm may have: the stream indices in are a bit each of
/// a `u64`.
const MAX_STREAMS: usize = 64;

/// The stream index a hello names, if its nonce is the comm's and the
/// index is one of the comm's `allowed` not `taken` yet (a bit per index).
fn hello_index(hello: &[u8; HELLO_LEN], nonce: u64, allowed: usize, taken: u64) -> Option<usize> {
    let h = Hello::decode(hello).ok()?;
    let idx = usize::try_from(h.stream).ok()?;
    (h.nonce == nonce && idx < allowed.min(MAX_STREAMS) && taken & (1 << idx) == 0).then_some(idx)
}

/// Reads and checks a comm's first stream's hello, waiting at most `wait`
/// (the net's `hello_timeout`; a stream that connected sends its hello at
/// once): its stream index, as [`hello_index`] judges it. Later streams'
/// hellos are awaited without a thread ([`HelloTask`]).
pub(super) fn check_hello(
    s: &mut TcpStream,
    nonce: u64,
    allowed: usize,
    wait: Duration,
) -> Option<usize> {
    s.set_nonblocking(false).ok()?;
    s.set_read_timeout(Some(wait.max(Duration::from_millis(1))))
        .ok()?;
    let mut hello = [0u8; HELLO_LEN];
    s.read_exact(&mut hello).ok()?;
    let idx = hello_index(&hello, nonce, allowed, 0)?;
    s.set_read_timeout(None).ok()?;
    Some(idx)
}

/// The sender's streams still to come: connected in the background, one
/// batch at a time, in index order, and taken in by the posting thread
/// before its next message.
pub(super) struct Grow {
    addr: SocketAddr,
    nonce: u64,
    /// Most streams the comm may have (the listen handle's count).
    max: usize,
    cfg: SocketConfig,
    /// Indices handed to connectors so far.
    asked: usize,
    /// Connected streams not taken in yet, in index order.
    ready: Arc<Mutex<Vec<TcpStream>>>,
    /// A connector is running.
    busy: Arc<AtomicBool>,
    /// A connect failed: the comm keeps the streams it has.
    failed: Arc<AtomicBool>,
}

impl Grow {
    /// `have` streams are open (indices `0..have`).
    pub(super) fn new(
        addr: SocketAddr,
        nonce: u64,
        max: usize,
        have: usize,
        cfg: SocketConfig,
    ) -> Self {
        Grow {
            addr,
            nonce,
            max,
            cfg,
            asked: have,
            ready: Arc::default(),
            busy: Arc::default(),
            failed: Arc::default(),
        }
    }

    /// Streams connected since the last call, in index order.
    pub(super) fn take_ready(&mut self) -> Vec<TcpStream> {
        std::mem::take(&mut *self.ready.lock())
    }

    /// A message wants `parts` streams: starts connecting the missing ones
    /// (never more than the handle allows, one connector at a time, none
    /// after a failure). The posting thread does not wait for them.
    pub(super) fn want(&mut self, parts: usize) {
        let target = parts.min(self.max);
        if target <= self.asked
            || self.failed.load(Ordering::Acquire)
            || self.busy.swap(true, Ordering::AcqRel)
        {
            return;
        }
        let (from, addr, nonce, cfg) = (self.asked, self.addr, self.nonce, self.cfg.clone());
        let (ready, busy, failed) = (self.ready.clone(), self.busy.clone(), self.failed.clone());
        self.asked = target;
        let spawned = std::thread::Builder::new()
            .name("tcpx-connect".into())
            .spawn(move || {
                for i in from..target {
                    match open_stream(addr, nonce, i, &cfg) {
                        Ok(s) => ready.lock().push(s),
                        Err(e) => {
                            tracing::debug!("socket net: opening stream {i} failed: {e}");
                            failed.store(true, Ordering::Release);
                            break;
                        }
                    }
                }
                busy.store(false, Ordering::Release);
            });
        if spawned.is_err() {
            self.failed.store(true, Ordering::Release);
            self.busy.store(false, Ordering::Release);
        }
    }

    /// Waits (tests) until no connector runs.
    #[cfg(test)]
    pub(super) fn settle(&self) {
        while self.busy.load(Ordering::Acquire) {
            std::thread::sleep(Duration::from_millis(1));
        }
    }
}

/// A receive comm's streams and the listener that admits more.
pub(super) struct RxStreams {
    shared: Arc<RecvShared>,
    cfg: SocketConfig,
    workers: Workers,
    staging: Arc<StagingPool<Landing>>,
    inner: Mutex<RxInner>,
}

#[derive(Default)]
struct RxInner {
    socks: Vec<Arc<TcpStream>>,
    /// Each stream's receive task.
    tasks: Vec<Arc<Home>>,
    /// Each stream's state, for landing a small part whose header its task
    /// read before the receive was posted ([`RxHandle::land_held`]).
    held: Vec<RxHandle>,
    /// Stream indices in, a bit each.
    taken: u64,
    /// Streams refused (bad hello, or more than allowed).
    refused: usize,
    listener: Option<Arc<TcpListener>>,
    listen_task: Option<Arc<Home>>,
    /// Accepted connections whose hello has not come yet.
    pending: Vec<(Arc<TcpStream>, Arc<Home>)>,
}

impl RxStreams {
    pub(super) fn new(
        shared: Arc<RecvShared>,
        cfg: &SocketConfig,
        workers: &Workers,
        staging: Arc<StagingPool<Landing>>,
    ) -> Arc<Self> {
        Arc::new(RxStreams {
            shared,
            cfg: cfg.clone(),
            workers: workers.clone(),
            staging,
            inner: Mutex::default(),
        })
    }

    /// Takes in stream `index` (hello checked): its task starts on the
    /// I/O workers, waiting for bytes without a thread. False if the comm
    /// is closing (the stream is dropped).
    pub(super) fn join(&self, index: usize, s: Arc<TcpStream>) -> bool {
        let mut inner = self.inner.lock();
        if self.shared.closing.load(Ordering::Acquire) || inner.taken & (1 << index) != 0 {
            return false;
        }
        if tune(&s, self.cfg.sockbuf).is_err() || s.set_nonblocking(false).is_err() {
            return false;
        }
        let (task, held) = RxTask::new(
            s.clone(),
            self.shared.clone(),
            Lane::new(index, &self.cfg),
            self.cfg.linger,
            self.staging.clone(),
        );
        inner
            .tasks
            .push(self.workers.start_readable(Box::new(task), s.as_raw_fd()));
        inner.held.push(held);
        inner.socks.push(s);
        inner.taken |= 1 << index;
        self.shared.streams.fetch_add(1, Ordering::AcqRel);
        true
    }

    /// Keeps `listener` open for the streams the peer opens later; its
    /// task admits them.
    pub(super) fn listen(self: &Arc<Self>, listener: TcpListener, nonce: u64) {
        let l = Arc::new(listener);
        let fd = l.as_raw_fd();
        let task = AcceptTask {
            streams: Arc::downgrade(self),
            listener: l.clone(),
            nonce,
        };
        let mut inner = self.inner.lock();
        inner.listener = Some(l);
        inner.listen_task = Some(self.workers.start_readable(Box::new(task), fd));
    }

    /// Receive `seq` was entered in the book: a stream holding its header
    /// may land it on this thread, and the streams waiting for it go on.
    pub(super) fn posted(&self, seq: u64) {
        let inner = self.inner.lock();
        for (h, t) in inner.held.iter().zip(&inner.tasks) {
            if h.land_held(seq) || h.awaits(seq) {
                t.kick();
            }
        }
    }

    /// Accepted connections still owing their hello (tests).
    #[cfg(test)]
    pub(super) fn pending(&self) -> usize {
        self.inner.lock().pending.len()
    }

    /// Whether a stream holds message `seq`'s header (tests).
    #[cfg(test)]
    pub(super) fn holds(&self, seq: u64) -> bool {
        self.inner.lock().held.iter().any(|h| h.holds(seq))
    }

    /// Closes every stream and the listener, and ends their tasks (the
    /// comm's `closing` is set first).
    pub(super) fn close(&self) {
        let tasks: Vec<Arc<Home>> = {
            let mut inner = self.inner.lock();
            for s in &inner.socks {
                let _ = s.shutdown(std::net::Shutdown::Both);
            }
            if let Some(l) = inner.listener.take() {
                // Wakes its task (the listener turns readable).
                let _ = socket2::SockRef::from(&*l).shutdown(std::net::Shutdown::Both);
            }
            let mut t = std::mem::take(&mut inner.tasks);
            t.extend(inner.listen_task.take());
            for (s, home) in std::mem::take(&mut inner.pending) {
                let _ = s.shutdown(std::net::Shutdown::Both);
                t.push(home);
            }
            t
        };
        // Parked tasks see their stream closed and end; idle ones (waiting
        // for a receive to be posted) are woken to see it.
        Home::end_all(&tasks, Duration::from_secs(5), "socket net receive comm");
    }

    /// Takes a connection the listener accepted: its hello is awaited by a
    /// task of its own on the I/O workers ([`HelloTask`]), never by a
    /// worker blocked on it, for at most the net's `hello_timeout` (then
    /// the connection is closed and counts as refused). At most as many
    /// hellos wait as streams are missing; more connections are refused.
    /// Returns whether the
    /// listener stays open: false once every index is in or the peer has
    /// had its refusals.
    fn admit(self: &Arc<Self>, s: TcpStream, nonce: u64) -> bool {
        let mut inner = self.inner.lock();
        let missing = self
            .allowed()
            .saturating_sub(inner.taken.count_ones() as usize);
        if inner.pending.len() >= missing || s.set_nonblocking(true).is_err() {
            tracing::warn!("socket net: refused a stream beyond the comm's count");
            inner.refused += 1;
        } else {
            let s = Arc::new(s);
            let mut task = HelloTask {
                streams: Arc::downgrade(self),
                s: s.clone(),
                nonce,
                hello: [0; HELLO_LEN],
                got: 0,
                until: Instant::now() + self.cfg.hello_timeout,
            };
            // The hello is usually here already (the peer writes it as
            // soon as it is connected): taken now, no task is woken for it.
            if let Some(done) = task.read_hello() {
                drop(inner);
                self.hello_done(&s, done, nonce);
                return self.listening(&mut self.inner.lock());
            }
            let until = task.until;
            let home = self
                .workers
                .start_readable_until(Box::new(task), s.as_raw_fd(), until);
            inner.pending.push((s, home));
        }
        self.listening(&mut inner)
    }

    /// A hello has come (`Some`: its bytes) or the connection ended
    /// without one (`None`): the stream joins if the hello checks out.
    fn hello_done(&self, s: &Arc<TcpStream>, hello: Option<[u8; HELLO_LEN]>, nonce: u64) {
        let taken = {
            let mut inner = self.inner.lock();
            inner.pending.retain(|(p, _)| !Arc::ptr_eq(p, s));
            inner.taken
        };
        let idx = hello.and_then(|h| hello_index(&h, nonce, self.cfg.streams, taken));
        let joined = idx.is_some_and(|i| self.join(i, s.clone()));
        let mut inner = self.inner.lock();
        if !joined {
            tracing::warn!("socket net: refused a stream with a bad hello");
            inner.refused += 1;
        }
        self.listening(&mut inner);
    }

    /// Most streams this comm may have.
    fn allowed(&self) -> usize {
        self.cfg.streams.min(MAX_STREAMS)
    }

    /// Whether the listener stays open; if not, it is shut (its task sees
    /// it and ends, and the descriptor goes).
    fn listening(&self, inner: &mut RxInner) -> bool {
        let allowed = self.allowed();
        let full = inner.taken.count_ones() as usize >= allowed;
        let open = !full && inner.refused < REFUSALS_PER_STREAM * allowed;
        if !open {
            if let Some(l) = inner.listener.take() {
                let _ = socket2::SockRef::from(&*l).shutdown(std::net::Shutdown::Both);
            }
        }
        open
    }
}

/// An accepted connection waiting for its hello, on the I/O workers: it
/// reads what has come each time the socket turns readable, until its
/// deadline; a hello not whole by then is refused (the connection closes
/// as the task ends, and its descriptor goes).
struct HelloTask {
    streams: Weak<RxStreams>,
    s: Arc<TcpStream>,
    nonce: u64,
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
        let Some(streams) = self.streams.upgrade() else {
            return Step::Done;
        };
        if streams.shared.closing.load(Ordering::Acquire) {
            return Step::Done;
        }
        match self.read_hello() {
            None if Instant::now() >= self.until => {
                tracing::warn!(
                    "socket net: closing a stream that sent no hello within {:?} (TCPX_P2P_STREAM_HELLO_MS)",
                    streams.cfg.hello_timeout
                );
                streams.hello_done(&self.s, None, self.nonce);
                Step::Done
            }
            None => Step::ReadableUntil(self.s.as_raw_fd(), self.until),
            Some(done) => {
                streams.hello_done(&self.s, done, self.nonce);
                Step::Done
            }
        }
    }
}

/// The receive comm's listener on the I/O workers: admits the streams the
/// peer opens after the first, waiting for connections without a thread.
struct AcceptTask {
    streams: Weak<RxStreams>,
    listener: Arc<TcpListener>,
    nonce: u64,
}

impl Task for AcceptTask {
    fn run(&mut self) -> Step {
        loop {
            let Some(streams) = self.streams.upgrade() else {
                return Step::Done;
            };
            if streams.shared.closing.load(Ordering::Acquire) {
                return Step::Done;
            }
            match self.listener.accept() {
                Ok((s, _)) => {
                    if !streams.admit(s, self.nonce) {
                        return Step::Done;
                    }
                }
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => {
                    return Step::Readable(self.listener.as_raw_fd());
                }
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(e) => {
                    tracing::debug!("socket net: accepting streams ended: {e}");
                    return Step::Done;
                }
            }
        }
    }
}
