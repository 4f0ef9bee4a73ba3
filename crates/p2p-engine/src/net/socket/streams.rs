//! Streams that follow the traffic: a comm starts with one TCP stream, and
//! its sender opens more (up to the listen handle's count) when a message
//! is cut into more parts than it has streams. The sender connects them
//! in the background ([`Grow`]), and they carry later messages once in.
//! On the receiver every stream comes in through the net's one listener
//! ([`super::door`]), which gives it to the comm its hello names once the
//! hello checks out; the comm takes it in ([`RxStreams`]). Streams close
//! only with their comm.

use std::io::Write;
use std::net::{SocketAddr, TcpStream};
use std::os::fd::AsRawFd;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use parking_lot::Mutex;

use super::book::{Landing, RecvShared};
use super::rx::{Landed, RxHandle, RxTask};
use super::sockio::tune;
use super::stage::StagingPool;
use super::wire::Hello;
use super::{Lane, SocketConfig, NET};
use crate::error::NetError;
use crate::workers::{Home, Workers};

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
pub(super) const MAX_STREAMS: usize = 64;

/// Most threads a net keeps opening send streams ([`Connectors`]).
const CONNECTORS: usize = 4;

/// How long a connector thread waits for more work before it leaves.
const CONNECTOR_IDLE: Duration = Duration::from_secs(1);

/// A batch of streams to open for one comm.
type ConnectJob = Box<dyn FnOnce() + Send>;

/// The threads that open the send streams of every comm of a net: at most
/// [`CONNECTORS`], made when work comes, gone after [`CONNECTOR_IDLE`]
/// without. A connector says a stream's hello the moment its connect
/// completes (the receiver's listener closes a stream whose hello is late).
/// A thread per comm while its streams opened made bursts of 35-48 threads
/// when an endpoint first sent to 64 peers at once.
#[derive(Clone)]
pub(super) struct Connectors(Arc<ConnectorsInner>);

struct ConnectorsInner {
    jobs: crossbeam_channel::Sender<ConnectJob>,
    queue: crossbeam_channel::Receiver<ConnectJob>,
    /// Connector threads alive.
    live: std::sync::atomic::AtomicUsize,
}

impl Connectors {
    pub(super) fn new() -> Self {
        let (jobs, queue) = crossbeam_channel::unbounded();
        Connectors(Arc::new(ConnectorsInner {
            jobs,
            queue,
            live: Default::default(),
        }))
    }

    /// Queues `job` for a connector, starting one if fewer than
    /// [`CONNECTORS`] run. Err when no connector runs and none can start.
    fn run(&self, job: ConnectJob) -> std::io::Result<()> {
        let inner = &self.0;
        // Queued first, counted after: a connector leaving meanwhile either
        // sees the job (and stays) or is seen gone (and one starts).
        // A receiver lives as long as this sender (both are ours).
        let _ = inner.jobs.send(job);
        let live = &inner.live;
        let mut n = live.load(Ordering::SeqCst);
        while n < CONNECTORS {
            match live.compare_exchange(n, n + 1, Ordering::SeqCst, Ordering::SeqCst) {
                Ok(_) => {
                    let me = self.clone();
                    let spawned = std::thread::Builder::new()
                        .name("tcpx-connect".into())
                        .spawn(move || me.serve());
                    if let Err(e) = spawned {
                        if live.fetch_sub(1, Ordering::SeqCst) == 1 {
                            return Err(e);
                        }
                    }
                    break;
                }
                Err(now) => n = now,
            }
        }
        Ok(())
    }

    /// A connector thread: runs jobs until none comes for a while.
    fn serve(&self) {
        let inner = &self.0;
        loop {
            match inner.queue.recv_timeout(CONNECTOR_IDLE) {
                Ok(job) => job(),
                Err(_) => {
                    inner.live.fetch_sub(1, Ordering::SeqCst);
                    // A job queued as this one decided to leave, when the
                    // others left too: stay for it.
                    if inner.queue.is_empty() {
                        return;
                    }
                    inner.live.fetch_add(1, Ordering::SeqCst);
                }
            }
        }
    }
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
    /// The net's connector threads.
    connectors: Connectors,
}

impl Grow {
    /// `have` streams are open (indices `0..have`).
    pub(super) fn new(
        addr: SocketAddr,
        nonce: u64,
        max: usize,
        have: usize,
        cfg: SocketConfig,
        connectors: Connectors,
    ) -> Self {
        Grow {
            connectors,
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

    /// A message wants `parts` streams: has the net's connectors open the
    /// missing ones (never more than the handle allows, one batch at a time
    /// per comm, none after a failure). The posting thread does not wait
    /// for them.
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
        let queued = self.connectors.run(Box::new(move || {
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
        }));
        if queued.is_err() {
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

/// A receive comm's streams (the net's listener gives it more,
/// [`super::door`]).
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
        // Reads block at most a slice at a time: a read inside a host
        // part then looks whether to give its worker back, and every read
        // gives up once no byte has come for `stall` (the reader's limit),
        // failing the stream's comm rather than holding its worker for
        // good.
        if tune(&s, self.cfg.sockbuf).is_err()
            || s.set_nonblocking(false).is_err()
            || s.set_read_timeout(Some(super::sockio::LINGER_SLICE))
                .is_err()
        {
            return false;
        }
        let (task, held) = RxTask::new(
            s.clone(),
            self.shared.clone(),
            Lane::new(index, &self.cfg),
            self.cfg.linger,
            self.staging.clone(),
            self.workers.clone(),
        );
        inner
            .tasks
            .push(self.workers.start_readable(Box::new(task), s.as_raw_fd()));
        inner.held.push(held);
        inner.socks.push(s);
        inner.taken |= 1 << index;
        tracing::trace!(index, "lat: rx stream joined");
        self.shared.streams.fetch_add(1, Ordering::AcqRel);
        true
    }

    /// Receive `seq` was entered in the book: a stream holding its header
    /// may land it on this thread, and the streams waiting for it go on.
    pub(super) fn posted(&self, seq: u64) {
        let inner = self.inner.lock();
        // Every stream holding a part of it but the first is kicked before
        // the poster lands anything: those tasks land their parts beside
        // it, and a part whose task has not begun when the poster comes to
        // it the poster lands. (One thread landing a 1 MB message's eight
        // parts took 640 µs on 2 × H100; a wake-up 60 µs to milliseconds.)
        // With no CPU idle a kicked task waits for one (a scheduler's
        // slice) and holds its part meanwhile: for a message it may land
        // whole the poster lands every part itself, reading the headers
        // the tasks have not read yet. Not for a larger one: its parts
        // beyond the poster's budget are the tasks' whatever happens, so
        // they are kicked first as above (kicked only after the poster's
        // own part, they would start that much later), and reading their
        // headers would hold up the poster -- the engine's progress.
        // (The message's size is its header's, where a stream holds one:
        // a receive may be posted larger than the message it takes.)
        let fits = |total: usize| total <= super::rx::POSTER_BUDGET;
        let alone = crate::spin::machine_full()
            && (self
                .shared
                .book
                .lock()
                .due
                .get(&seq)
                .is_some_and(|r| fits(r.segs.total))
                || inner
                    .held
                    .iter()
                    .any(|h| h.held_total(seq).is_some_and(fits)));
        if !alone {
            let mut first = true;
            for (h, t) in inner.held.iter().zip(&inner.tasks) {
                if h.holds(seq) {
                    if !first {
                        t.kick();
                    }
                    first = false;
                }
            }
        }
        let mut budget = super::rx::POSTER_BUDGET;
        for (h, t) in inner.held.iter().zip(&inner.tasks) {
            let kick = match h.land_held(seq, &mut budget, alone) {
                Landed::Here { kick } => kick,
                Landed::No => h.awaits(seq),
            };
            if kick {
                t.kick();
            }
        }
    }

    /// Each stream's state in words (tests).
    #[cfg(test)]
    pub(super) fn describe(&self) -> String {
        let inner = self.inner.lock();
        inner
            .held
            .iter()
            .map(|h| h.describe())
            .collect::<Vec<_>>()
            .join(" ")
    }

    /// Whether a stream holds message `seq`'s header (tests).
    #[cfg(test)]
    pub(super) fn holds(&self, seq: u64) -> bool {
        self.inner.lock().held.iter().any(|h| h.holds(seq))
    }

    /// How many streams hold a part of message `seq` whole (tests).
    #[cfg(test)]
    pub(super) fn holders(&self, seq: u64) -> usize {
        self.inner
            .lock()
            .held
            .iter()
            .filter(|h| h.holds(seq))
            .count()
    }

    /// Closes every stream and ends their tasks (the comm's `closing` is
    /// set first).
    pub(super) fn close(&self) {
        let tasks: Vec<Arc<Home>> = {
            let mut inner = self.inner.lock();
            for s in &inner.socks {
                let _ = s.shutdown(std::net::Shutdown::Both);
            }
            std::mem::take(&mut inner.tasks)
        };
        // Closed: none of its tasks runs again (a running one ends here).
        Home::end_all(&tasks, Duration::from_secs(5), "socket net receive comm");
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::AtomicUsize;

    #[test]
    fn connectors_run_every_job_on_at_most_their_bound_of_threads() {
        let c = Connectors::new();
        let (running, most, done) = (
            Arc::new(AtomicUsize::new(0)),
            Arc::new(AtomicUsize::new(0)),
            Arc::new(AtomicUsize::new(0)),
        );
        // 64 comms' batches at once, as when an endpoint first sends to 64
        // peers together.
        for _ in 0..64 {
            let (running, most, done) = (running.clone(), most.clone(), done.clone());
            c.run(Box::new(move || {
                let now = running.fetch_add(1, Ordering::SeqCst) + 1;
                most.fetch_max(now, Ordering::SeqCst);
                std::thread::sleep(Duration::from_millis(5));
                running.fetch_sub(1, Ordering::SeqCst);
                done.fetch_add(1, Ordering::SeqCst);
            }))
            .unwrap();
        }
        let end = std::time::Instant::now() + Duration::from_secs(30);
        while done.load(Ordering::SeqCst) < 64 && std::time::Instant::now() < end {
            std::thread::sleep(Duration::from_millis(2));
        }
        assert_eq!(done.load(Ordering::SeqCst), 64, "every batch ran");
        let most = most.load(Ordering::SeqCst);
        assert!((1..=CONNECTORS).contains(&most), "{most} at once");
        // Idle, they leave; work later brings one back.
        let end = std::time::Instant::now() + Duration::from_secs(30);
        while c.0.live.load(Ordering::SeqCst) > 0 && std::time::Instant::now() < end {
            std::thread::sleep(Duration::from_millis(20));
        }
        assert_eq!(c.0.live.load(Ordering::SeqCst), 0, "idle connectors left");
        let (tx, rx) = crossbeam_channel::bounded(1);
        c.run(Box::new(move || tx.send(()).unwrap())).unwrap();
        rx.recv_timeout(Duration::from_secs(10))
            .expect("a connector came back");
    }
}
