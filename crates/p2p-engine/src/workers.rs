//! The I/O workers an endpoint's peers share: threads that exist while
//! some peer has work, never one per peer.
//!
//! Work is a [`Task`]: a socket stream's receive or send loop, a
//! connection's progress loop, its control reader. A task runs on a
//! worker until it has nothing to do, then says what it waits for
//! ([`Step`]): its socket to become readable (registered with the pool's
//! poller, one `epoll` set for all of them), possibly with a deadline
//! (the poller keeps the deadlines and queues the task at the first of
//! readiness and its deadline), or a [`Home::wake`] from whoever gives it
//! work. A waiting task holds no thread; when what it waits for happens
//! it is queued, and a worker takes it.
//!
//! Workers are made as tasks become ready and none is free, and leave
//! after [`KEEP_IDLE`] without work (at once when as many as there are
//! cores wait already), so the count follows the tasks that are busy at
//! once, not the peers. Four per core come as work asks for them; past
//! that the poller adds a worker only for work that has waited with every
//! worker busy, a wait that doubles with every two workers more
//! ([`growth_stall`]), and only while a busy worker sleeps in the kernel
//! (blocked: [`Inner::a_busy_worker_sleeps`]): busy workers that all run
//! or wait for a core are not helped by another thread, nor are workers
//! whose task lingers ([`lingering`]). The pool has no fixed cap: a task
//! may still block (a part of mixed host and GPU memory, a GPU copy
//! landing), and a cap would let busy tasks on both ends wait for each
//! other's queued ones. A part whose bytes stop coming, or whose socket
//! is full, waits in the poller, not on a worker, host memory and GPU
//! windows alike (see `net::socket::rx`, `net::socket::tx`). Tasks are bounded by the
//! endpoint's admission limits (streams and connections per peer and in
//! all; see `admission`).
//!
//! A task keeps its thread for a while after its work runs out (the
//! caller's linger, e.g. [`crate::net::socket::SocketConfig::linger`]),
//! so a busy peer's next message finds it running, as a thread of its own
//! did: the hand-off through the poller costs tens of microseconds once a
//! peer has been idle for that long, never within a burst. It gives the
//! thread back at once where other work waits for one
//! ([`Workers::work_waiting`]).

use std::collections::{BTreeSet, HashMap};
use std::os::fd::RawFd;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Weak};
use std::thread::Thread;
use std::time::{Duration, Instant};

use crossbeam_channel::{Receiver, RecvTimeoutError, Sender};
use mio::unix::SourceFd;
use mio::{Events, Interest, Poll, Token};
use parking_lot::{Condvar, Mutex};

use crate::spin::Spin;

/// A worker with no task for this long leaves.
pub(crate) const KEEP_IDLE: Duration = Duration::from_secs(2);

/// What a task waits for when it returns from [`Task::run`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Step {
    /// Nothing until this descriptor is readable (or closed).
    Readable(RawFd),
    /// Nothing until this descriptor is readable (or closed) or this
    /// instant has come, whichever is first; the task, run again, sees
    /// which (its read would block and the clock is past the instant).
    ReadableUntil(RawFd, Instant),
    /// Nothing until this descriptor is writable (or closed): a send
    /// whose socket is full waits for room without holding a thread.
    Writable(RawFd),
    /// Nothing until this instant (a back-off).
    Until(Instant),
    /// Nothing until its [`Home`] is woken.
    Idle,
    /// Finished for good.
    Done,
}

/// Work that runs on the pool's workers, a stretch at a time.
pub(crate) trait Task: Send + 'static {
    /// Does what there is to do, then says what to wait for.
    fn run(&mut self) -> Step;
}

enum State {
    /// Waiting in the run queue or for a worker.
    Queued,
    /// On a worker; `woken`: a wake came meanwhile.
    Running { thread: Thread, woken: bool },
    /// Waiting for a wake.
    Idle(Box<dyn Task>),
    /// Waiting for its descriptor (in the poller's set as `token`) or its
    /// deadline; `woken`: a wake came meanwhile (see [`Home::wake_with`]).
    Polling { token: usize, woken: bool },
    /// Finished.
    Done,
}

/// Brings a sleeping worker to spin for jobs ([`Workers::keep_spinning`]).
struct Summons;

impl Task for Summons {
    fn run(&mut self) -> Step {
        Step::Done
    }
}

/// Where a task lives between its stretches: whoever gives it work wakes
/// it here, and whoever owns it waits here for it to finish.
pub(crate) struct Home {
    state: Mutex<State>,
    /// Closed by its owner ([`Home::end_all`]): it never runs again (set
    /// and read under `state`'s lock).
    cancelled: AtomicBool,
    finished: Condvar,
    pool: Weak<Inner>,
}

impl Home {
    /// Gives the task a turn: an idle one is queued; a running one is
    /// unparked (it may be sleeping in `park_timeout`) and runs once more
    /// before it can go idle.
    pub(crate) fn wake(self: &Arc<Self>) {
        self.wake_with(true);
    }

    /// As [`Home::wake`], without unparking a running task (one that waits
    /// on a channel of its own, not in `park_timeout`).
    pub(crate) fn kick(self: &Arc<Self>) {
        self.wake_with(false);
    }

    fn wake_with(self: &Arc<Self>, unpark: bool) {
        let mut st = self.state.lock();
        match &mut *st {
            State::Idle(_) => {
                let State::Idle(task) = std::mem::replace(&mut *st, State::Queued) else {
                    unreachable!("matched Idle above")
                };
                drop(st);
                self.submit(task);
            }
            State::Running { thread, woken } => {
                *woken = true;
                if unpark {
                    thread.unpark();
                }
            }
            // Waiting for its descriptor: taken out of the poller's set
            // and queued. Whoever gave it work may have taken the bytes
            // its descriptor was to announce (a receive's posting thread
            // reading a header for it), and a wake left unseen here kept it
            // waiting for ever. Not in the set yet (being parked): the
            // parking sees `woken` and queues it.
            State::Polling { token, woken } => {
                *woken = true;
                let token = *token;
                drop(st);
                if let Some(pool) = self.pool.upgrade() {
                    pool.unpark_token(token);
                }
            }
            State::Queued | State::Done => {}
        }
    }

    /// The task's state and its pool's, for a warning that it did not end.
    pub(crate) fn describe(&self) -> String {
        let st = match &*self.state.lock() {
            State::Queued => "queued",
            State::Running { .. } => "running",
            State::Idle(_) => "idle",
            State::Polling { .. } => "waiting for its socket or its time",
            State::Done => "done",
        };
        match self.pool.upgrade() {
            Some(p) => format!(
                "{st}; pool: {} workers, {} idle, {} jobs queued",
                p.threads.load(Ordering::SeqCst),
                p.idle.load(Ordering::SeqCst),
                p.jobs.len()
            ),
            None => format!("{st}; its pool is gone"),
        }
    }

    /// Ends a comm's or connection's tasks: wakes each (an idle one runs
    /// once more to see its work closed), then waits for each to finish,
    /// all within `limit`, except the one running on this thread (it is
    /// the one closing them, and ends once it returns). A task still
    /// running at the limit is named in a warning (`what`).
    pub(crate) fn end_all(tasks: &[Arc<Home>], limit: Duration, what: &str) {
        for t in tasks {
            t.cancel();
        }
        let deadline = std::time::Instant::now() + limit;
        for t in tasks {
            if t.runs_here() {
                continue;
            }
            if !t.wait_not_running(deadline) {
                tracing::warn!(
                    "{what}: a task did not end within {limit:?} of the close ({})",
                    t.describe()
                );
            }
        }
    }

    /// Whether the task is running on the calling thread (it must not wait
    /// for itself).
    pub(crate) fn runs_here(&self) -> bool {
        let me = std::thread::current().id();
        matches!(&*self.state.lock(), State::Running { thread, .. } if thread.id() == me)
    }

    /// Whether the task has finished.
    #[cfg(test)]
    pub(crate) fn is_done(&self) -> bool {
        matches!(*self.state.lock(), State::Done)
    }

    /// As [`Home::end_all`], then waits (within the same `limit`) until
    /// each task is dropped, with what it holds (a listener's socket): for
    /// tasks their closer has just woken (a parked one is dropped by the
    /// poller as its descriptor turns readable), so that the name or port
    /// they held is free once this returns.
    pub(crate) fn end_all_dropped(tasks: &[Arc<Home>], limit: Duration, what: &str) {
        let deadline = Instant::now() + limit;
        Self::end_all(tasks, limit, what);
        for t in tasks {
            if t.runs_here() {
                continue;
            }
            if !t.wait_while(deadline, |st| !matches!(st, State::Done)) {
                tracing::warn!(
                    "{what}: a task was not let go within {limit:?} of the close ({})",
                    t.describe()
                );
            }
        }
    }

    /// Closes the task: it never runs again. An idle one is dropped here;
    /// a queued or polling one is dropped, unrun, where it would have run
    /// next; a running one ends as its stretch returns. Waiting for every
    /// closed task to *run* once more (to see its work closed) made closing
    /// wait on workers: when a peer with many connections went, every
    /// worker was closing one of them, each waiting for tasks queued behind
    /// the others (60 workers, 1,400 jobs queued, every close its 5 s).
    fn cancel(&self) {
        let mut st = self.state.lock();
        self.cancelled.store(true, Ordering::SeqCst);
        if let State::Idle(_) = &*st {
            let State::Idle(task) = std::mem::replace(&mut *st, State::Done) else {
                unreachable!("matched Idle above")
            };
            drop(st);
            drop(task);
            self.finished.notify_all();
        }
    }

    /// Whether the task was closed ([`Home::cancel`]); with its state lock.
    fn is_cancelled(&self) -> bool {
        self.cancelled.load(Ordering::SeqCst)
    }

    /// Waits until `deadline` for a closed task to leave its stretch on a
    /// worker (it may be touching the buffers of the work it holds); true
    /// once no stretch of it runs or ever will.
    fn wait_not_running(&self, deadline: Instant) -> bool {
        self.wait_while(deadline, |st| matches!(st, State::Running { .. }))
    }

    /// Waits until `deadline` while `busy` holds of the task's state; true
    /// once it does not.
    fn wait_while(&self, deadline: Instant, busy: impl Fn(&State) -> bool) -> bool {
        let mut st = self.state.lock();
        while busy(&st) {
            if self.finished.wait_until(&mut st, deadline).timed_out() {
                return !busy(&st);
            }
        }
        true
    }

    /// Waits up to `limit` for the task to finish; true if it has.
    #[cfg(test)]
    pub(crate) fn wait_done(&self, limit: Duration) -> bool {
        self.wait_while(Instant::now() + limit, |st| !matches!(st, State::Done))
    }

    fn submit(self: &Arc<Self>, task: Box<dyn Task>) {
        match self.pool.upgrade() {
            Some(pool) => pool.submit(Job {
                task,
                home: self.clone(),
            }),
            // The pool is gone (its endpoint was dropped): the task ends.
            None => self.finish(task),
        }
    }

    fn finish(&self, task: Box<dyn Task>) {
        drop(task);
        *self.state.lock() = State::Done;
        self.finished.notify_all();
    }
}

struct Job {
    task: Box<dyn Task>,
    home: Arc<Home>,
}

struct Inner {
    name: &'static str,
    cpus: Option<Arc<[usize]>>,
    queue: Sender<Job>,
    jobs: Receiver<Job>,
    /// Workers waiting for a job.
    idle: AtomicUsize,
    /// Workers alive.
    threads: AtomicUsize,
    /// The poller's registry, and the tasks parked on it by token.
    registry: mio::Registry,
    parked: Mutex<Parked>,
    next_token: AtomicUsize,
    waker: mio::Waker,
    stopping: AtomicBool,
    /// A worker with no task for this long leaves.
    keep_idle: Duration,
    /// Most workers kept waiting for work; more leave at once. Workers
    /// are made on demand at once up to four times this; beyond, only for
    /// work that waits.
    max_idle: usize,
    /// Jobs taken by workers so far (the poller's sign of progress).
    taken: AtomicU64,
    /// How long one idle worker spins for the next job before it sleeps
    /// (ns; 0: none spins).
    spin_ns: AtomicU64,
    /// Whether a worker spins now (at most one does).
    spinning: AtomicBool,
    /// Until when (ns past `epoch`) a caller waiting on a transfer wants a
    /// worker spinning ([`Workers::keep_spinning`]).
    spin_until: AtomicU64,
    /// A worker was woken to spin and has not started yet.
    summoned: AtomicBool,
    epoch: Instant,
    /// Every worker alive: its thread id and whether it runs a task now
    /// (for [`Inner::a_busy_worker_sleeps`]).
    seats: Mutex<Vec<Arc<Seat>>>,
    /// What the pool asks of the machine (a test may answer for it).
    probes: Probes,
}

/// What a pool asks of the machine: the real answers, or a test's.
#[derive(Clone, Copy)]
struct Probes {
    /// Whether a thread sleeps in the kernel ([`thread_sleeps`]).
    sleeps: fn(libc::pid_t) -> bool,
    /// Whether a thread could busy-wait now ([`crate::spin::spinning_pays`]).
    spin_pays: fn() -> bool,
    /// Leave for this thread to busy-wait ([`crate::spin::start`]).
    spin: fn() -> Option<Spin>,
}

impl Probes {
    const REAL: Probes = Probes {
        sleeps: thread_sleeps,
        spin_pays: crate::spin::spinning_pays,
        spin: crate::spin::start,
    };
}

/// A worker as the poller sees it.
struct Seat {
    tid: libc::pid_t,
    busy: AtomicBool,
    /// Its task waits for more of its own work and gives the worker back
    /// as soon as other work waits ([`lingering`]).
    lingering: AtomicBool,
}

thread_local! {
    /// The seat of the worker this thread is (none on other threads).
    static SEAT: std::cell::RefCell<Option<Arc<Seat>>> = const { std::cell::RefCell::new(None) };
}

/// Runs `wait`, a task's wait for more of its own work that ends as soon
/// as [`Workers::work_waiting`] says other work waits (a stream's
/// linger): meanwhile the worker counts as free, not blocked, so the
/// poller adds no thread for the work queued behind it -- the lingering
/// task gives its worker back within a [`LINGER_SLICE`] instead.
/// (Counted as blocked, lingering streams took the 2-core machine's pool
/// to 18-20 workers in the first rounds of sending to 64 peers at once.)
/// On a thread that is no worker it just runs `wait`.
pub(crate) fn lingering<R>(wait: impl FnOnce() -> R) -> R {
    let mark = |on: bool| {
        SEAT.with(|s| {
            if let Some(s) = &*s.borrow() {
                s.lingering.store(on, Ordering::Release);
            }
        })
    };
    mark(true);
    let r = wait();
    mark(false);
    r
}

/// The tasks waiting for their descriptors, and the deadlines of those
/// that have one.
#[derive(Default)]
struct Parked {
    jobs: HashMap<usize, (Job, Option<RawFd>, Option<Instant>)>,
    /// `(deadline, token)` of each parked job with a deadline, earliest
    /// first; an entry leaves with its job.
    timers: BTreeSet<(Instant, usize)>,
}

impl Parked {
    /// Takes the job parked as `token` (and its deadline) out.
    fn take(&mut self, token: usize) -> Option<(Job, Option<RawFd>)> {
        let (job, fd, until) = self.jobs.remove(&token)?;
        if let Some(d) = until {
            self.timers.remove(&(d, token));
        }
        Some((job, fd))
    }
}

/// The pool: cheap to clone (one per endpoint, shared by its comms).
#[derive(Clone)]
pub(crate) struct Workers {
    inner: Arc<Inner>,
}

impl std::fmt::Debug for Workers {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Workers")
            .field("name", &self.inner.name)
            .field("threads", &self.inner.threads.load(Ordering::Relaxed))
            .finish()
    }
}

const WAKE: Token = Token(usize::MAX);

impl Workers {
    /// A pool whose threads are named `name` and pinned to `cpus`. Starts
    /// the poller thread.
    pub(crate) fn new(name: &'static str, cpus: Option<Arc<[usize]>>) -> std::io::Result<Self> {
        Self::with_keep_idle(name, cpus, KEEP_IDLE)
    }

    /// As [`Workers::new`], workers leaving after `keep_idle` without work.
    pub(crate) fn with_keep_idle(
        name: &'static str,
        cpus: Option<Arc<[usize]>>,
        keep_idle: Duration,
    ) -> std::io::Result<Self> {
        Self::build(name, cpus, keep_idle, Probes::REAL)
    }

    /// As [`Workers::with_keep_idle`], asking `probes` of the machine.
    fn build(
        name: &'static str,
        cpus: Option<Arc<[usize]>>,
        keep_idle: Duration,
        probes: Probes,
    ) -> std::io::Result<Self> {
        let poll = Poll::new()?;
        let registry = poll.registry().try_clone()?;
        let waker = mio::Waker::new(poll.registry(), WAKE)?;
        let (queue, jobs) = crossbeam_channel::unbounded();
        let inner = Arc::new(Inner {
            name,
            cpus,
            queue,
            jobs,
            idle: AtomicUsize::new(0),
            threads: AtomicUsize::new(0),
            registry,
            parked: Mutex::default(),
            next_token: AtomicUsize::new(0),
            waker,
            stopping: AtomicBool::new(false),
            keep_idle,
            max_idle: std::thread::available_parallelism()
                .map_or(2, |n| n.get())
                .max(2),
            taken: AtomicU64::new(0),
            spin_ns: AtomicU64::new(0),
            spinning: AtomicBool::new(false),
            spin_until: AtomicU64::new(0),
            summoned: AtomicBool::new(false),
            epoch: Instant::now(),
            seats: Mutex::default(),
            probes,
        });
        let weak = Arc::downgrade(&inner);
        let cpus = inner.cpus.clone();
        std::thread::Builder::new()
            .name(format!("{name}-poll"))
            .spawn(move || {
                crate::topo::pin_thread(cpus.as_deref());
                poller(poll, weak)
            })?;
        Ok(Workers { inner })
    }

    /// Lets one idle worker at a time spin for `spin` before it sleeps:
    /// a job that comes meanwhile starts at once, where waking a sleeping
    /// worker took 0.1-3.6 ms on a 32-core VM (measured on 2 × H100, a
    /// receive's task kicked between two blocking receives), which
    /// decided UCCL's benchmark rows. Zero (the default) spins never.
    pub(crate) fn set_spin(&self, spin: Duration) {
        let ns = u64::try_from(spin.as_nanos()).unwrap_or(u64::MAX);
        self.inner.spin_ns.store(ns, Ordering::Relaxed);
    }

    /// Keeps one idle worker spinning for jobs for `d` from now: a caller
    /// waits for a transfer whose next steps are jobs (a stream's task
    /// kicked, the progress task woken), which then start at once rather
    /// than after a sleeping worker's wake-up (up to milliseconds on a
    /// VM). If none spins now, a sleeping worker is woken to (its wake-up
    /// overlaps the wait). Nothing while spinning is off ([`set_spin`]).
    ///
    /// [`set_spin`]: Workers::set_spin
    pub(crate) fn keep_spinning(&self, d: Duration) {
        let inner = &self.inner;
        if d.is_zero() || inner.spin_ns.load(Ordering::Relaxed) == 0 || !(inner.probes.spin_pays)()
        {
            return;
        }
        let until = inner.now_ns().saturating_add(d.as_nanos() as u64);
        inner.spin_until.fetch_max(until, Ordering::AcqRel);
        if !inner.spinning.load(Ordering::Acquire)
            && inner.idle.load(Ordering::SeqCst) > 0
            && !inner.summoned.swap(true, Ordering::AcqRel)
        {
            self.start(Box::new(Summons));
        }
    }

    /// Whether a caller waiting on a transfer wants work taken at once
    /// ([`Workers::keep_spinning`]): a stream's task about to sleep may
    /// watch its socket or queue instead, for the window.
    pub(crate) fn caller_waiting(&self) -> bool {
        let inner = &self.inner;
        // (Whether the machine lets the watching thread spin is asked by
        // it: `crate::spin::start`.)
        inner.spin_ns.load(Ordering::Relaxed) != 0
            && inner.now_ns() < inner.spin_until.load(Ordering::Acquire)
    }

    /// Whether work waits for a worker with none idle: a task lingering
    /// on its socket then gives its worker back at once, rather than have
    /// the poller add a thread for that work (see [`STALL`]).
    pub(crate) fn work_waiting(&self) -> bool {
        !self.inner.jobs.is_empty() && self.inner.idle.load(Ordering::SeqCst) == 0
    }

    /// Starts `task` waiting for `fd` to become readable (a stream with
    /// nothing to read yet holds no thread).
    pub(crate) fn start_readable(&self, task: Box<dyn Task>, fd: RawFd) -> Arc<Home> {
        self.start_parked(task, fd, None)
    }

    /// Starts `task` waiting for `fd` to become readable or for `until`,
    /// whichever comes first (as [`Step::ReadableUntil`]).
    pub(crate) fn start_readable_until(
        &self,
        task: Box<dyn Task>,
        fd: RawFd,
        until: Instant,
    ) -> Arc<Home> {
        self.start_parked(task, fd, Some(until))
    }

    fn start_parked(&self, task: Box<dyn Task>, fd: RawFd, until: Option<Instant>) -> Arc<Home> {
        let token = self.inner.token();
        let home = self.home(State::Polling {
            token,
            woken: false,
        });
        self.inner.park_on(
            Job {
                task,
                home: home.clone(),
            },
            token,
            Some((fd, Interest::READABLE)),
            until,
        );
        home
    }

    /// Starts `task` idle: it runs when its home is woken.
    pub(crate) fn start_idle(&self, task: Box<dyn Task>) -> Arc<Home> {
        self.home(State::Idle(task))
    }

    /// Starts `task` running now.
    pub(crate) fn start(&self, task: Box<dyn Task>) -> Arc<Home> {
        let home = self.home(State::Queued);
        self.inner.submit(Job {
            task,
            home: home.clone(),
        });
        home
    }

    fn home(&self, state: State) -> Arc<Home> {
        Arc::new(Home {
            state: Mutex::new(state),
            cancelled: AtomicBool::new(false),
            finished: Condvar::new(),
            pool: Arc::downgrade(&self.inner),
        })
    }

    /// Worker threads alive now (the poller not counted).
    #[cfg(test)]
    pub(crate) fn threads(&self) -> usize {
        self.inner.threads.load(Ordering::Relaxed)
    }

    /// Workers running a task now (alive and not waiting for one).
    #[cfg(test)]
    pub(crate) fn busy(&self) -> usize {
        self.threads()
            .saturating_sub(self.inner.idle.load(Ordering::SeqCst))
    }
}

impl Drop for Inner {
    fn drop(&mut self) {
        self.stopping.store(true, Ordering::Release);
        let _ = self.waker.wake();
        // Parked tasks end with the pool: their owners see them done.
        let parked = self.parked.get_mut();
        parked.timers.clear();
        for (_, (job, fd, _)) in parked.jobs.drain() {
            if let Some(fd) = fd {
                let _ = self.registry.deregister(&mut SourceFd(&fd));
            }
            job.home.finish(job.task);
        }
    }
}

impl Inner {
    fn submit(self: &Arc<Self>, job: Job) {
        if self.queue.send(job).is_err() {
            return; // cannot happen: `jobs` lives as long as `queue`
        }
        tracing::trace!(
            queued = self.jobs.len(),
            idle = self.idle.load(Ordering::Relaxed),
            threads = self.threads.load(Ordering::Relaxed),
            "lat: job queued"
        );
        // More jobs waiting than workers waiting for them (a burst: a
        // message's parts on several streams): add a worker at once, up to
        // four per core; beyond that the poller adds them if the queue
        // stalls.
        if self.jobs.len() > self.idle.load(Ordering::SeqCst)
            && !self.spawn_worker_below(self.base())
        {
            let _ = self.waker.wake();
        }
    }

    /// Workers made on demand at once, four per core; past this only for
    /// work that waits while a busy worker sleeps.
    fn base(&self) -> usize {
        4 * self.max_idle
    }

    /// Adds a worker if fewer than `cap` are alive (counted and started as
    /// one step, so neither callers at once nor the poller beside a
    /// caller go past `cap`); false if there were `cap` already.
    fn spawn_worker_below(self: &Arc<Self>, cap: usize) -> bool {
        let reserved = self
            .threads
            .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |t| {
                (t < cap).then_some(t + 1)
            });
        if reserved.is_ok() {
            self.start_worker();
        }
        reserved.is_ok()
    }

    /// Adds a worker, however many there are.
    fn spawn_worker(self: &Arc<Self>) {
        self.threads.fetch_add(1, Ordering::SeqCst);
        self.start_worker();
    }

    /// Starts the thread of a worker already counted in `threads`.
    fn start_worker(self: &Arc<Self>) {
        let weak = Arc::downgrade(self);
        let jobs = self.jobs.clone();
        let cpus = self.cpus.clone();
        let spawned = std::thread::Builder::new()
            .name(self.name.to_string())
            .spawn(move || {
                crate::topo::pin_thread(cpus.as_deref());
                let seat = Arc::new(Seat {
                    tid: this_thread_id(),
                    busy: AtomicBool::new(false),
                    lingering: AtomicBool::new(false),
                });
                SEAT.with(|s| *s.borrow_mut() = Some(seat.clone()));
                if let Some(p) = weak.upgrade() {
                    p.seats.lock().push(seat.clone());
                }
                worker(weak.clone(), jobs, &seat);
                if let Some(p) = weak.upgrade() {
                    p.seats.lock().retain(|s| !Arc::ptr_eq(s, &seat));
                }
            });
        if let Err(e) = spawned {
            self.threads.fetch_sub(1, Ordering::SeqCst);
            // The job stays queued for the workers there are; with none,
            // the next submit tries again.
            tracing::warn!("I/O pool {}: could not start a worker: {e}", self.name);
        }
    }

    /// Spins for a job for the pool's spin time, if no other worker
    /// spins now (None: none came, or another spins).
    fn spin_for_job(&self, jobs: &Receiver<Job>) -> Option<Job> {
        // Any worker come to wait answers a summons: it spins, or another
        // does (which then spins through the callers' window too).
        self.summoned.store(false, Ordering::Release);
        let spin = self.spin_ns.load(Ordering::Relaxed);
        if spin == 0 || self.spinning.swap(true, Ordering::AcqRel) {
            return None;
        }
        let Some(leave) = (self.probes.spin)() else {
            self.spinning.store(false, Ordering::Release);
            return None;
        };
        let own = self.now_ns().saturating_add(spin);
        let mut got = None;
        while got.is_none() && !self.stopping.load(Ordering::Acquire) && leave.pays() {
            let until = own.max(self.spin_until.load(Ordering::Acquire));
            if self.now_ns() >= until {
                break;
            }
            got = jobs.try_recv().ok();
            std::hint::spin_loop();
        }
        self.spinning.store(false, Ordering::Release);
        got
    }

    /// Nanoseconds since the pool was made.
    fn now_ns(&self) -> u64 {
        u64::try_from(self.epoch.elapsed().as_nanos()).unwrap_or(u64::MAX)
    }

    /// A token for a job to park as ([`Inner::park_on`]).
    fn token(&self) -> usize {
        self.next_token.fetch_add(1, Ordering::Relaxed) % (usize::MAX - 1)
    }

    /// Parks `job` (its home's state `Polling` with `token`) until `fd`
    /// (if given) is ready as its interest says, or `until` (if given) has
    /// come.
    fn park_on(
        self: &Arc<Self>,
        job: Job,
        token: usize,
        fd: Option<(RawFd, Interest)>,
        until: Option<Instant>,
    ) {
        let home = job.home.clone();
        let (earliest, registered) = {
            let mut parked = self.parked.lock();
            parked
                .jobs
                .insert(token, (job, fd.map(|(fd, _)| fd), until));
            let earliest = until.is_some_and(|d| {
                parked.timers.insert((d, token));
                parked.timers.first() == Some(&(d, token))
            });
            // Registered while the job is in the set and before anyone can
            // take it out (and deregister): its descriptor is then never
            // left registered for a job gone. Registering a descriptor that
            // is ready already reports it at once (epoll checks readiness
            // when a descriptor is added); the poller takes the job once
            // this lock is let go.
            let registered = fd.map(|(fd, interest)| {
                self.registry
                    .register(&mut SourceFd(&fd), Token(token), interest)
                    .map_err(|e| (fd, e))
            });
            (earliest, registered)
        };
        if earliest {
            // The poller may be asleep past this deadline: it looks again.
            let _ = self.waker.wake();
        }
        let run_now = match registered {
            Some(Err((fd, e))) => {
                tracing::debug!("I/O pool {}: cannot watch descriptor {fd}: {e}", self.name);
                // Run it: its read will meet the descriptor's error.
                true
            }
            // A wake that came before the job was in the set.
            _ => {
                matches!(*home.state.lock(), State::Polling { token: t, woken: true } if t == token)
            }
        };
        if run_now {
            self.unpark_token(token);
        }
    }
}

/// How long queued work may wait with every worker busy before the poller
/// adds workers (busy tasks may be blocked in a part; more must come).
const STALL: Duration = Duration::from_micros(500);

/// How often a lingering task ([`lingering`]) looks whether other work
/// waits for its worker: the pool's first growth step, so that it gives
/// the worker back before the pool would add one for that work.
pub(crate) const LINGER_SLICE: Duration = STALL;

/// How long queued work must have waited, with every worker busy, before
/// the poller adds workers, given `threads` workers of which `base` come
/// without asking ([`Inner::submit`]'s four per core): [`STALL`], doubled
/// for every two workers beyond the base, up to 256 × [`STALL`]. Busy
/// workers that are not blocked but short of a core (a 2-core machine
/// receiving from 64 peers, the senders on the same cores) leave work
/// waiting as long as blocked ones do; adding a thread for each such
/// stall took the pool to 64-72 workers there (16-20 with this back-off).
/// Blocked ones still get help, later the more threads there are.
fn growth_stall(threads: usize, base: usize) -> Duration {
    let doublings = (threads.saturating_sub(base) / 2).min(8) as u32;
    STALL * (1u32 << doublings)
}

fn poller(mut poll: Poll, pool: Weak<Inner>) {
    let mut events = Events::with_capacity(256);
    let mut last_taken = 0u64;
    // Since when queued work has waited with no worker taking any.
    let mut stalled_since: Option<Instant> = None;
    loop {
        let (waiting, next_deadline) = pool.upgrade().map_or((false, None), |p| {
            let next = p.parked.lock().timers.first().map(|&(d, _)| d);
            (!p.jobs.is_empty(), next)
        });
        let mut timeout = if waiting {
            STALL
        } else {
            Duration::from_secs(1)
        };
        if let Some(d) = next_deadline {
            // mio rounds a timeout up to the next millisecond: never early.
            timeout = timeout.min(d.saturating_duration_since(Instant::now()));
        }
        let polled = poll.poll(&mut events, Some(timeout));
        if let Some(p) = pool.upgrade() {
            // Queued work that no worker has taken for the growth stall:
            // add workers for it. (Measured from when
            // it was first seen waiting: readiness events can end a poll
            // microseconds after the last.)
            let taken = p.taken.load(Ordering::SeqCst);
            let queued = p.jobs.len();
            if queued > 0 && taken == last_taken && p.idle.load(Ordering::SeqCst) == 0 {
                let now = Instant::now();
                let since = *stalled_since.get_or_insert(now);
                let threads = p.threads.load(Ordering::SeqCst);
                let base = p.base();
                if now.duration_since(since) >= growth_stall(threads, base) {
                    // Up to four at a time below the base (never past
                    // it); past it one, and only for a worker that is
                    // blocked (one short of a core is not helped by
                    // another thread).
                    if threads < base {
                        for _ in 0..queued.min(4) {
                            p.spawn_worker_below(base);
                        }
                    } else if p.a_busy_worker_sleeps() {
                        p.spawn_worker();
                    }
                    stalled_since = Some(now);
                }
            } else {
                stalled_since = None;
            }
            last_taken = taken;
        }
        if let Err(e) = polled {
            if e.kind() != std::io::ErrorKind::Interrupted {
                tracing::warn!("I/O pool poller: {e}");
                std::thread::sleep(Duration::from_millis(10));
            }
            continue;
        }
        let Some(p) = pool.upgrade() else { return };
        if p.stopping.load(Ordering::Acquire) {
            return;
        }
        for ev in events.iter() {
            if ev.token() == WAKE {
                continue;
            }
            p.unpark_token(ev.token().0);
        }
        // Jobs whose deadline has come run, readable or not.
        let now = Instant::now();
        loop {
            let due = {
                let mut parked = p.parked.lock();
                match parked.timers.first() {
                    Some(&(d, token)) if d <= now => parked.take(token),
                    _ => break,
                }
            };
            if let Some((job, fd)) = due {
                p.unpark(job, fd);
            }
        }
    }
}

/// The calling thread's id: `/proc/thread-self` names its task folder (0
/// where it cannot be read: its state then counts as asleep).
fn this_thread_id() -> libc::pid_t {
    std::fs::read_link("/proc/thread-self")
        .ok()
        .and_then(|p| p.file_name()?.to_str()?.parse().ok())
        .unwrap_or(0)
}

/// Whether thread `tid` of this process sleeps in the kernel: its state
/// in `/proc/self/task/TID/stat` is not `R` (running or runnable). A state
/// that cannot be read counts as asleep.
fn thread_sleeps(tid: libc::pid_t) -> bool {
    let stat = std::fs::read_to_string(format!("/proc/self/task/{tid}/stat"));
    let state = stat.ok().and_then(|t| {
        let after = t.rfind(')')?;
        t[after + 1..].trim_start().chars().next()
    });
    !matches!(state, Some('R'))
}

impl Inner {
    /// Whether some worker running a task sleeps in the kernel (state `S`
    /// or `D` in `/proc/self/task/TID/stat`): blocked on a socket, an
    /// event, a lock -- not lingering ([`lingering`]). Work that waits
    /// while every busy worker is running or runnable waits for a core,
    /// which another thread would not give it. A state that cannot be read
    /// counts as asleep.
    fn a_busy_worker_sleeps(&self) -> bool {
        let seats: Vec<Arc<Seat>> = self.seats.lock().clone();
        seats
            .iter()
            .filter(|s| s.busy.load(Ordering::Acquire) && !s.lingering.load(Ordering::Acquire))
            .any(|s| (self.probes.sleeps)(s.tid))
    }

    /// Queues a job taken off the poller (one closed meanwhile ends here).
    /// Takes the job parked as `token` out of the set, if it is still
    /// there, and queues it.
    fn unpark_token(self: &Arc<Self>, token: usize) {
        let parked = self.parked.lock().take(token);
        if let Some((job, fd)) = parked {
            self.unpark(job, fd);
        }
    }

    fn unpark(self: &Arc<Self>, job: Job, fd: Option<RawFd>) {
        // Deregistered before it can run (and park on it again).
        if let Some(fd) = fd {
            let _ = self.registry.deregister(&mut SourceFd(&fd));
        }
        let mut st = job.home.state.lock();
        if job.home.is_cancelled() {
            drop(st);
            let Job { task, home } = job;
            home.finish(task);
            return;
        }
        *st = State::Queued;
        drop(st);
        self.submit(job);
    }
}

fn worker(pool: Weak<Inner>, jobs: Receiver<Job>, seat: &Seat) {
    let run = |job| {
        seat.busy.store(true, Ordering::Release);
        run_job(&pool, job);
        seat.busy.store(false, Ordering::Release);
    };
    loop {
        let Some(p) = pool.upgrade() else { return };
        // Enough workers wait already (a burst of tasks made more): this
        // one leaves, after one last look for work.
        let max = p.max_idle;
        let joined = p
            .idle
            .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |n| {
                (n < max).then_some(n + 1)
            });
        if joined.is_err() {
            match jobs.try_recv() {
                Ok(job) => {
                    p.taken.fetch_add(1, Ordering::SeqCst);
                    drop(p);
                    run(job);
                    continue;
                }
                Err(_) => {
                    // (A summons it took is void: the idle ones wait.)
                    p.summoned.store(false, Ordering::Release);
                    p.threads.fetch_sub(1, Ordering::SeqCst);
                    return;
                }
            }
        }
        let keep_idle = p.keep_idle;
        let spun = p.spin_for_job(&jobs);
        drop(p); // a waiting worker does not keep the pool alive
        let got = match spun {
            Some(job) => Ok(job),
            None => jobs.recv_timeout(keep_idle),
        };
        let Some(p) = pool.upgrade() else { return };
        p.idle.fetch_sub(1, Ordering::SeqCst);
        let job = match got {
            Ok(job) => job,
            // Leaving: one last look, as a submit that saw this worker
            // idle did not start another.
            Err(RecvTimeoutError::Timeout) => match jobs.try_recv() {
                Ok(job) => job,
                Err(_) => {
                    p.threads.fetch_sub(1, Ordering::SeqCst);
                    return;
                }
            },
            Err(RecvTimeoutError::Disconnected) => return,
        };
        p.taken.fetch_add(1, Ordering::SeqCst);
        drop(p);
        run(job);
    }
}

fn run_job(pool: &Weak<Inner>, job: Job) {
    let Job { mut task, home } = job;
    {
        let mut st = home.state.lock();
        if home.is_cancelled() {
            // Closed while it waited for a worker: dropped unrun (before it
            // counts as done: what it holds is let go by then).
            drop(st);
            home.finish(task);
            return;
        }
        *st = State::Running {
            thread: std::thread::current(),
            woken: false,
        };
    }
    tracing::trace!("lat: job starts");
    let step = task.run();
    tracing::trace!(?step, "lat: job stops");
    let mut st = home.state.lock();
    let woken = matches!(*st, State::Running { woken: true, .. });
    // Closed while it ran: this stretch was its last.
    let step = if home.is_cancelled() {
        Step::Done
    } else {
        step
    };
    let (fd, until) = match step {
        Step::Done => {
            // Dropped before it counts as done: what it holds (a listener's
            // socket) is let go by then.
            drop(st);
            home.finish(task);
            return;
        }
        Step::Idle if woken => {
            *st = State::Queued;
            drop(st);
            home.submit(task);
            return;
        }
        Step::Idle => {
            *st = State::Idle(task);
            return;
        }
        Step::Readable(fd) => (Some((fd, Interest::READABLE)), None),
        Step::ReadableUntil(fd, d) => (Some((fd, Interest::READABLE)), Some(d)),
        Step::Writable(fd) => (Some((fd, Interest::WRITABLE)), None),
        Step::Until(d) => (None, Some(d)),
    };
    let Some(p) = pool.upgrade() else {
        drop(st);
        home.finish(task);
        return;
    };
    let token = p.token();
    *st = State::Polling {
        token,
        woken: false,
    };
    drop(st);
    p.park_on(
        Job {
            task,
            home: home.clone(),
        },
        token,
        fd,
        until,
    );
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::{Read, Write};
    use std::net::{TcpListener, TcpStream};
    use std::os::fd::AsRawFd;
    use std::sync::atomic::AtomicU64;

    /// The machine answered as having CPUs to spare, so that spinning is
    /// tested whatever else runs beside the tests.
    const SPIN_PAYS: Probes = Probes {
        spin_pays: || true,
        spin: || Some(Spin::uncounted()),
        ..Probes::REAL
    };

    #[test]
    fn the_pool_grows_past_its_base_ever_more_slowly() {
        let base = 8;
        assert_eq!(growth_stall(2, base), STALL);
        assert_eq!(growth_stall(base + 1, base), STALL);
        assert_eq!(growth_stall(base + 2, base), STALL * 2);
        assert_eq!(growth_stall(base + 8, base), STALL * 16);
        // Capped: work that waits on blocked workers is helped, at the
        // latest after 256 stalls (128 ms).
        assert_eq!(growth_stall(base + 16, base), STALL * 256);
        assert_eq!(growth_stall(10_000, base), STALL * 256);
    }

    /// Spins for its time, then ends (work that wants a core).
    struct Spinner(Duration);

    impl Task for Spinner {
        fn run(&mut self) -> Step {
            let end = Instant::now() + self.0;
            while Instant::now() < end {
                std::hint::spin_loop();
            }
            Step::Done
        }
    }

    /// Blocks until its channel gives (or drops), then ends.
    struct Blocker(crossbeam_channel::Receiver<()>);

    impl Task for Blocker {
        fn run(&mut self) -> Step {
            let _ = self.0.recv();
            Step::Done
        }
    }

    #[test]
    fn the_pool_does_not_grow_past_its_base_for_tasks_that_want_a_core() {
        // Three times the base of tasks that want a core: those past the
        // base wait for a worker, and no worker sleeps in the kernel (the
        // test answers for the kernel, which would otherwise report a
        // worker asleep for a moment on a lock or a page), so none is
        // added. Each new worker used to be added for such a wait.
        let probes = Probes {
            sleeps: |_| false,
            ..Probes::REAL
        };
        let w = Workers::build("test-io", None, Duration::from_secs(5), probes).unwrap();
        let base = w.inner.base();
        let homes: Vec<_> = (0..3 * base)
            .map(|_| w.start(Box::new(Spinner(Duration::from_millis(100)))))
            .collect();
        let mut most = 0;
        assert!(until(Duration::from_secs(60), || {
            most = most.max(w.threads());
            homes.iter().all(|h| h.is_done())
        }));
        assert!(
            most <= base,
            "{most} workers for {} spinning tasks (base {base})",
            3 * base
        );
    }

    #[test]
    fn the_pool_grows_past_its_base_for_blocked_workers() {
        // Blocked tasks, the kernel asked: every one of them gets a
        // worker, past the base.
        let w = Workers::with_keep_idle("test-io", None, Duration::from_secs(5)).unwrap();
        let base = w.inner.base();
        let (tx, rx) = crossbeam_channel::unbounded();
        let n = base + 4;
        let homes: Vec<_> = (0..n)
            .map(|_| w.start(Box::new(Blocker(rx.clone()))))
            .collect();
        assert!(
            until(Duration::from_secs(10), || w.busy() == n),
            "{} of {n} blocked tasks got a worker",
            w.busy()
        );
        drop(tx);
        for h in &homes {
            assert!(h.wait_done(Duration::from_secs(10)));
        }
    }

    #[test]
    fn a_thread_blocked_on_a_channel_sleeps_and_a_spinning_one_does_not() {
        let tid = this_thread_id;
        let (tx, rx) = crossbeam_channel::bounded::<libc::pid_t>(1);
        let (stop_tx, stop_rx) = crossbeam_channel::bounded::<()>(0);
        let blocked = std::thread::spawn(move || {
            tx.send(tid()).unwrap();
            let _ = stop_rx.recv();
        });
        let b = rx.recv().unwrap();
        assert!(
            until(Duration::from_secs(10), || thread_sleeps(b)),
            "a thread waiting on a channel never read as asleep"
        );
        let stop = Arc::new(AtomicBool::new(false));
        let (tx, rx) = crossbeam_channel::bounded::<libc::pid_t>(1);
        let spinning = {
            let stop = stop.clone();
            std::thread::spawn(move || {
                tx.send(tid()).unwrap();
                while !stop.load(Ordering::Relaxed) {
                    std::hint::spin_loop();
                }
            })
        };
        let s = rx.recv().unwrap();
        // Running or runnable nearly always; a page fault may catch it
        // once, twenty times in a row never.
        let running = (0..20).filter(|_| !thread_sleeps(s)).count();
        stop.store(true, Ordering::Relaxed);
        drop(stop_tx);
        spinning.join().unwrap();
        blocked.join().unwrap();
        assert!(running > 0, "a spinning thread read as asleep 20 times");
        // A state that cannot be read (no such task: the id a worker has
        // where its own could not be read) counts as asleep. (A thread
        // just joined is no such case: it may still be running its exit.)
        assert!(thread_sleeps(0));
    }

    /// Waits for its channel in [`lingering`] (a stream's linger), then
    /// ends.
    struct Lingerer(crossbeam_channel::Receiver<()>);

    impl Task for Lingerer {
        fn run(&mut self) -> Step {
            let _ = lingering(|| self.0.recv());
            Step::Done
        }
    }

    #[test]
    fn the_pool_does_not_grow_for_lingering_workers() {
        // As many lingering tasks as the base and more queued behind them:
        // the lingering workers count as free (their tasks give them back
        // as soon as work waits), so the poller adds none, where it adds
        // one for each blocked task (the test above).
        let w = Workers::with_keep_idle("test-io", None, Duration::from_secs(5)).unwrap();
        let base = w.inner.base();
        let (tx, rx) = crossbeam_channel::unbounded();
        let homes: Vec<_> = (0..base + 4)
            .map(|_| w.start(Box::new(Lingerer(rx.clone()))))
            .collect();
        assert!(until(Duration::from_secs(10), || w.busy() == base));
        std::thread::sleep(Duration::from_millis(200));
        assert_eq!(w.threads(), base, "workers added for lingering ones");
        drop(tx);
        for h in &homes {
            assert!(h.wait_done(Duration::from_secs(10)));
        }
    }

    /// Writes its bytes to a socket without blocking, waiting for room as
    /// [`Step::Writable`]; ends when all are out.
    struct Filler {
        s: TcpStream,
        data: Arc<Vec<u8>>,
        at: usize,
        parked: Arc<AtomicU64>,
    }

    impl Task for Filler {
        fn run(&mut self) -> Step {
            self.s.set_nonblocking(true).unwrap();
            while self.at < self.data.len() {
                match self.s.write(&self.data[self.at..]) {
                    Ok(n) => self.at += n,
                    Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {
                        self.parked.fetch_add(1, Ordering::SeqCst);
                        return Step::Writable(self.s.as_raw_fd());
                    }
                    Err(e) => panic!("write: {e}"),
                }
            }
            Step::Done
        }
    }

    #[test]
    fn a_task_waiting_for_room_to_write_holds_no_worker_and_runs_when_there_is_room() {
        let w = Workers::with_keep_idle("test-io", None, Duration::from_secs(5)).unwrap();
        let (a, mut b) = pair();
        socket2::SockRef::from(&a)
            .set_send_buffer_size(64 << 10)
            .unwrap();
        let data: Arc<Vec<u8>> = Arc::new((0..8 << 20).map(|i: usize| (i % 253) as u8).collect());
        let parked = Arc::new(AtomicU64::new(0));
        let home = w.start(Box::new(Filler {
            s: a,
            data: data.clone(),
            at: 0,
            parked: parked.clone(),
        }));
        assert!(until(Duration::from_secs(10), || parked
            .load(Ordering::SeqCst)
            > 0));
        // Nothing reads the socket until the task has given its worker
        // back: one blocked in a write would hold it for good.
        assert!(
            until(Duration::from_secs(10), || w.busy() == 0),
            "the full socket's task holds a worker: {} busy",
            w.busy()
        );
        assert!(!home.is_done());
        let mut got = Vec::with_capacity(data.len());
        let mut buf = vec![0u8; 1 << 16];
        while got.len() < data.len() {
            let n = b.read(&mut buf).unwrap();
            assert!(n > 0, "closed early");
            got.extend_from_slice(&buf[..n]);
        }
        assert!(got == *data, "other bytes came");
        assert!(home.wait_done(Duration::from_secs(10)));
        assert!(
            parked.load(Ordering::SeqCst) > 1,
            "it waited for room more than once"
        );
    }

    /// Runs once, noting that it ran.
    struct Once(Arc<AtomicBool>);

    impl Task for Once {
        fn run(&mut self) -> Step {
            self.0.store(true, Ordering::SeqCst);
            Step::Done
        }
    }

    /// What a [`Closer`] saw: how long its close took, and whether its
    /// task had run when the close returned.
    type Seen = Arc<Mutex<Option<(Duration, bool)>>>;

    /// Closes a task of its own, as a comm dropped on a worker does: starts
    /// it (queued behind whatever waits), then closes it.
    struct Closer {
        w: Workers,
        ran: Arc<AtomicBool>,
        seen: Seen,
    }

    impl Task for Closer {
        fn run(&mut self) -> Step {
            let child = self.w.start(Box::new(Once(self.ran.clone())));
            let t = Instant::now();
            Home::end_all(&[child], Duration::from_secs(20), "test closer");
            *self.seen.lock() = Some((t.elapsed(), self.ran.load(Ordering::SeqCst)));
            Step::Done
        }
    }

    #[test]
    fn closing_tasks_queued_behind_every_worker_waits_for_none_and_they_never_run() {
        // Far more closers than the base: every worker closes a task that
        // waits in the queue behind the other closers. Closing used to wait
        // for each to run once more: here, for workers the poller adds over
        // seconds, and in a real pool for 5 s each.
        let w = Workers::with_keep_idle("test-io", None, Duration::from_secs(5)).unwrap();
        let n = w.inner.base() + 48;
        let runs: Vec<(Arc<AtomicBool>, Seen)> = (0..n).map(|_| Default::default()).collect();
        let homes: Vec<_> = runs
            .iter()
            .map(|(ran, seen)| {
                w.start(Box::new(Closer {
                    w: w.clone(),
                    ran: ran.clone(),
                    seen: seen.clone(),
                }))
            })
            .collect();
        for h in &homes {
            assert!(h.wait_done(Duration::from_secs(60)));
        }
        std::thread::sleep(Duration::from_millis(100));
        for (ran, seen) in &runs {
            let (took, ran_then) = seen.lock().expect("the closer ran");
            assert!(took < Duration::from_secs(10), "a close took {took:?}");
            assert_eq!(
                ran.load(Ordering::SeqCst),
                ran_then,
                "a closed task ran after its close returned"
            );
        }
        // The closed tasks have all left the pool: none is queued.
        assert!(until(Duration::from_secs(10), || w.inner.jobs.is_empty()));
    }

    fn pair() -> (TcpStream, TcpStream) {
        let l = TcpListener::bind("127.0.0.1:0").unwrap();
        let a = TcpStream::connect(l.local_addr().unwrap()).unwrap();
        let (b, _) = l.accept().unwrap();
        (a, b)
    }

    /// Reads what is there, adds it up, waits again; ends at EOF.
    struct Summer {
        s: TcpStream,
        sum: Arc<AtomicU64>,
        bytes: Arc<AtomicU64>,
    }

    impl Task for Summer {
        fn run(&mut self) -> Step {
            self.s.set_nonblocking(true).unwrap();
            let mut buf = [0u8; 4096];
            loop {
                match self.s.read(&mut buf) {
                    Ok(0) => return Step::Done,
                    Ok(n) => {
                        let add: u64 = buf[..n].iter().map(|&b| u64::from(b)).sum();
                        self.sum.fetch_add(add, Ordering::SeqCst);
                        self.bytes.fetch_add(n as u64, Ordering::SeqCst);
                    }
                    Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {
                        return Step::Readable(self.s.as_raw_fd())
                    }
                    Err(_) => return Step::Done,
                }
            }
        }
    }

    fn until(limit: Duration, mut f: impl FnMut() -> bool) -> bool {
        let end = Instant::now() + limit;
        while Instant::now() < end {
            if f() {
                return true;
            }
            std::thread::sleep(Duration::from_millis(2));
        }
        f()
    }

    #[test]
    fn many_waiting_streams_hold_no_worker_and_every_byte_is_read() {
        let w = Workers::with_keep_idle("test-io", None, Duration::from_millis(100)).unwrap();
        let sum = Arc::new(AtomicU64::new(0));
        let bytes = Arc::new(AtomicU64::new(0));
        let mut writers = Vec::new();
        let mut homes = Vec::new();
        for _ in 0..200 {
            let (a, b) = pair();
            let fd = b.as_raw_fd();
            let t = Summer {
                s: b,
                sum: sum.clone(),
                bytes: bytes.clone(),
            };
            homes.push(w.start_readable(Box::new(t), fd));
            writers.push(a);
        }
        assert_eq!(w.threads(), 0, "200 streams with nothing to read");
        let mut want_sum = 0u64;
        for (i, a) in writers.iter_mut().enumerate() {
            let data: Vec<u8> = (0..1000u32)
                .map(|k| ((k as usize * 7 + i) % 251) as u8)
                .collect();
            want_sum += data.iter().map(|&b| u64::from(b)).sum::<u64>();
            a.write_all(&data).unwrap();
        }
        assert!(until(Duration::from_secs(20), || bytes
            .load(Ordering::SeqCst)
            == 200_000));
        assert_eq!(sum.load(Ordering::SeqCst), want_sum);
        // Idle again: the workers leave.
        assert!(
            until(Duration::from_secs(10), || w.threads() == 0),
            "{} workers left",
            w.threads()
        );
        drop(writers); // EOF: every task ends
        for h in &homes {
            assert!(h.wait_done(Duration::from_secs(10)));
        }
    }

    /// Counts its turns; idles after each.
    struct Counter(Arc<AtomicU64>);
    impl Task for Counter {
        fn run(&mut self) -> Step {
            self.0.fetch_add(1, Ordering::SeqCst);
            std::thread::sleep(Duration::from_millis(1));
            Step::Idle
        }
    }

    #[test]
    fn a_wake_is_never_lost() {
        let w = Workers::with_keep_idle("test-io", None, Duration::from_millis(50)).unwrap();
        let n = Arc::new(AtomicU64::new(0));
        let home = w.start_idle(Box::new(Counter(n.clone())));
        assert_eq!(
            n.load(Ordering::SeqCst),
            0,
            "an idle task waits for its wake"
        );
        for i in 1..=50u64 {
            home.kick();
            // Every wake is followed by a turn that starts after it.
            assert!(until(Duration::from_secs(10), || n.load(Ordering::SeqCst) >= i));
        }
        // Wakes while it runs: at least one more turn after the last.
        let before = n.load(Ordering::SeqCst);
        for _ in 0..100 {
            home.wake();
        }
        assert!(until(Duration::from_secs(10), || n.load(Ordering::SeqCst)
            > before));
        assert!(until(Duration::from_secs(10), || matches!(
            *home.state.lock(),
            State::Idle(_)
        )));
    }

    /// Waits for its socket until its deadline; says how the wait ended:
    /// `Some(true)` timed out (nothing to read at or after the deadline),
    /// `Some(false)` read bytes.
    struct Timed {
        s: TcpStream,
        until: Instant,
        turns: Arc<AtomicU64>,
        ended: Arc<Mutex<Option<(bool, Instant)>>>,
    }

    impl Task for Timed {
        fn run(&mut self) -> Step {
            self.turns.fetch_add(1, Ordering::SeqCst);
            self.s.set_nonblocking(true).unwrap();
            let mut buf = [0u8; 64];
            let timed_out = match self.s.read(&mut buf) {
                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {
                    if Instant::now() < self.until {
                        return Step::ReadableUntil(self.s.as_raw_fd(), self.until);
                    }
                    true
                }
                _ => false,
            };
            *self.ended.lock() = Some((timed_out, Instant::now()));
            Step::Done
        }
    }

    /// Its turns and how it ended (see [`Timed`]).
    type TimedSeen = (Arc<AtomicU64>, Arc<Mutex<Option<(bool, Instant)>>>);

    /// A [`Timed`] task waiting for a new socket until `until`; the
    /// socket's other end (to write to), its descriptor, and what it saw.
    fn timed(until: Instant) -> (TcpStream, Box<Timed>, RawFd, TimedSeen) {
        let (a, b) = pair();
        let seen: TimedSeen = (Arc::new(AtomicU64::new(0)), Arc::new(Mutex::new(None)));
        let fd = b.as_raw_fd();
        let t = Timed {
            s: b,
            until,
            turns: seen.0.clone(),
            ended: seen.1.clone(),
        };
        (a, Box::new(t), fd, seen)
    }

    #[test]
    fn a_waiting_task_runs_at_its_deadline_or_when_readable_and_holds_no_worker() {
        let w = Workers::with_keep_idle("test-io", None, Duration::from_millis(50)).unwrap();
        // Let the poller go to sleep first: each new earliest deadline must
        // wake it.
        std::thread::sleep(Duration::from_millis(50));
        let start = Instant::now();
        let mut silent = Vec::new();
        // Later-made tasks have earlier deadlines, all well after the
        // count of workers below (a loaded machine, or valgrind, took
        // longer than 115 ms to make them, and the first had run).
        for i in 0..20u64 {
            let until = start + Duration::from_millis(1500 - 15 * i);
            let (a, t, fd, (turns, ended)) = timed(until);
            let home = w.start_readable_until(t, fd, until);
            silent.push((a, until, turns, ended, home));
        }
        // One that is written to long before its deadline.
        let far = Instant::now() + Duration::from_secs(600);
        let (mut a, t, fd, (turns, ended)) = timed(far);
        let busy = w.start_readable_until(t, fd, far);
        assert_eq!(w.threads(), 0, "21 waiting tasks hold no worker");
        a.write_all(b"now").unwrap();
        assert!(busy.wait_done(Duration::from_secs(10)));
        assert_eq!(ended.lock().map(|e| e.0), Some(false), "it read its bytes");
        assert_eq!(turns.load(Ordering::SeqCst), 1);
        for (_, until, turns, ended, home) in &silent {
            assert!(
                home.wait_done(Duration::from_secs(10)),
                "ran at its deadline"
            );
            let (timed_out, at) = ended.lock().expect("ended");
            assert!(timed_out, "nothing was written: its deadline woke it");
            assert!(at >= *until, "never before its deadline");
            assert_eq!(turns.load(Ordering::SeqCst), 1, "one turn, at its deadline");
        }
        // Every deadline has left with its task (the one that was read too).
        let parked = w.inner.parked.lock();
        assert!(parked.timers.is_empty() && parked.jobs.is_empty());
    }

    #[test]
    fn a_wake_reaches_a_task_waiting_for_its_descriptor() {
        // Whoever gives a waiting task work may have taken the bytes its
        // descriptor was to announce (a receive's posting thread reads a
        // header for a stream's task): the wake alone must give it a
        // turn. It was left unseen, and the task waited for ever.
        let w = Workers::with_keep_idle("test-io", None, Duration::from_millis(50)).unwrap();
        let far = Instant::now() + Duration::from_secs(600);
        let (mut a, t, fd, (turns, ended)) = timed(far);
        let home = w.start_readable_until(t, fd, far);
        for i in 1..=50u64 {
            home.kick();
            // A turn after each wake, nothing to read: it waits again (at
            // times while it is being parked, or still running).
            assert!(
                until(Duration::from_secs(10), || turns.load(Ordering::SeqCst)
                    >= i),
                "wake {i}: no turn"
            );
        }
        assert!(ended.lock().is_none(), "it read nothing");
        // Still watching its descriptor: bytes end it.
        a.write_all(b"now").unwrap();
        assert!(home.wait_done(Duration::from_secs(10)));
        assert_eq!(ended.lock().map(|e| e.0), Some(false), "it read its bytes");
        let parked = w.inner.parked.lock();
        assert!(parked.timers.is_empty() && parked.jobs.is_empty());
    }

    /// Backs off once until its time, then ends.
    struct Sleeper {
        until: Instant,
        turns: Arc<Mutex<Vec<Instant>>>,
    }

    impl Task for Sleeper {
        fn run(&mut self) -> Step {
            let now = Instant::now();
            self.turns.lock().push(now);
            if now < self.until {
                Step::Until(self.until)
            } else {
                Step::Done
            }
        }
    }

    #[test]
    fn a_task_that_backs_off_runs_again_at_its_time_holding_no_worker() {
        let w = Workers::with_keep_idle("test-io", None, Duration::from_millis(20)).unwrap();
        let at = Instant::now() + Duration::from_millis(500);
        let turns = Arc::new(Mutex::new(Vec::new()));
        let home = w.start(Box::new(Sleeper {
            until: at,
            turns: turns.clone(),
        }));
        assert!(until(Duration::from_secs(5), || turns.lock().len() == 1));
        assert!(
            until(Duration::from_millis(400), || w.threads() == 0),
            "the waiting task holds no worker"
        );
        assert!(home.wait_done(Duration::from_secs(10)));
        let turns = turns.lock();
        assert_eq!(turns.len(), 2, "one turn at the start, one at its time");
        assert!(turns[1] >= at);
    }

    #[test]
    fn a_spinning_worker_takes_every_wake_and_stops_spinning() {
        // One idle worker spins for the next job: wakes that come while it
        // spins, and after it gave up and slept, each give a turn.
        let w = Workers::build("test-io", None, Duration::from_millis(50), SPIN_PAYS).unwrap();
        w.set_spin(Duration::from_millis(20));
        let n = Arc::new(AtomicU64::new(0));
        let home = w.start_idle(Box::new(Counter(n.clone())));
        for i in 1..=40u64 {
            home.kick();
            assert!(until(Duration::from_secs(10), || n.load(Ordering::SeqCst) >= i));
            if i % 10 == 0 {
                // Past the spin: the worker sleeps, and is woken.
                std::thread::sleep(Duration::from_millis(30));
                assert!(
                    until(Duration::from_secs(1), || !w
                        .inner
                        .spinning
                        .load(Ordering::SeqCst)),
                    "still spinning"
                );
            }
        }
        // A dropped pool's spinner leaves; the idle task ends at its wake.
        drop(w);
        home.kick();
        assert!(until(Duration::from_secs(10), || home.is_done()));
    }

    #[test]
    fn a_waiting_caller_keeps_a_worker_spinning_for_its_window() {
        let w = Workers::build("test-io", None, Duration::from_secs(5), SPIN_PAYS).unwrap();
        let n = Arc::new(AtomicU64::new(0));
        let home = w.start_idle(Box::new(Counter(n.clone())));
        // Spinning off: nothing is summoned.
        w.keep_spinning(Duration::from_secs(1));
        assert!(!w.inner.summoned.load(Ordering::SeqCst));
        w.set_spin(Duration::from_micros(100));
        home.kick(); // a worker now exists, and goes idle after its turn
        assert!(until(Duration::from_secs(10), || n.load(Ordering::SeqCst) == 1));
        assert!(until(Duration::from_secs(10), || !w
            .inner
            .spinning
            .load(Ordering::SeqCst)));
        // A caller's window: a sleeping worker comes to spin through it,
        // takes the wakes meanwhile, and stops once it has passed.
        w.keep_spinning(Duration::from_millis(300));
        assert!(until(Duration::from_secs(10), || w
            .inner
            .spinning
            .load(Ordering::SeqCst)));
        for i in 2..=5u64 {
            home.kick();
            assert!(until(Duration::from_secs(10), || n.load(Ordering::SeqCst) >= i));
        }
        assert!(until(Duration::from_secs(10), || !w
            .inner
            .spinning
            .load(Ordering::SeqCst)));
        assert!(!w.inner.summoned.load(Ordering::SeqCst));
    }

    #[test]
    fn a_callers_window_is_seen_while_it_lasts_and_only_with_spinning_on() {
        let w = Workers::build("test-io", None, Duration::from_secs(5), SPIN_PAYS).unwrap();
        w.keep_spinning(Duration::from_secs(30));
        assert!(!w.caller_waiting(), "spinning off: no window");
        w.set_spin(Duration::from_micros(100));
        assert!(!w.caller_waiting(), "no caller yet");
        w.keep_spinning(Duration::from_millis(50));
        assert!(w.caller_waiting(), "inside the window");
        std::thread::sleep(Duration::from_millis(300));
        assert!(!w.caller_waiting(), "the window has passed");
    }

    #[test]
    fn nothing_spins_where_spinning_does_not_pay() {
        let probes = Probes {
            spin_pays: || false,
            spin: || None,
            ..Probes::REAL
        };
        let w = Workers::build("test-io", None, Duration::from_secs(5), probes).unwrap();
        w.set_spin(Duration::from_micros(100));
        w.keep_spinning(Duration::from_secs(30));
        assert!(!w.caller_waiting(), "no window kept");
        assert!(
            !w.inner.summoned.load(Ordering::SeqCst),
            "no worker summoned"
        );
        let n = Arc::new(AtomicU64::new(0));
        let home = w.start_idle(Box::new(Counter(n.clone())));
        home.kick();
        assert!(until(Duration::from_secs(10), || n.load(Ordering::SeqCst) == 1));
        // The worker goes to sleep rather than spin for the next job.
        std::thread::sleep(Duration::from_millis(50));
        assert!(!w.inner.spinning.load(Ordering::SeqCst));
    }

    #[test]
    fn a_dropped_pool_ends_its_waiting_tasks() {
        let w = Workers::new("test-io", None).unwrap();
        let (a, b) = pair();
        let fd = b.as_raw_fd();
        let home = w.start_readable(
            Box::new(Summer {
                s: b,
                sum: Arc::new(AtomicU64::new(0)),
                bytes: Arc::new(AtomicU64::new(0)),
            }),
            fd,
        );
        let idle = w.start_idle(Box::new(Counter(Arc::new(AtomicU64::new(0)))));
        drop(w);
        assert!(home.wait_done(Duration::from_secs(5)));
        idle.kick(); // its pool is gone: it ends instead of running
        assert!(idle.is_done());
        drop(a);
    }
}
