//! The transfer lifecycle: a transfer waits for a count of events (chunks
//! done, the peer's acknowledgement) and ends exactly once, done or failed
//! with a reason.

use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use parking_lot::{Condvar, Mutex};

use crate::memory::Region;

/// Why a transfer failed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Failure {
    /// The peer refused the request (bad descriptor, bounds).
    Refused(String),
    /// The connection broke or was closed.
    Lost(String),
}

impl std::fmt::Display for Failure {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Failure::Refused(r) => write!(f, "refused by peer: {r}"),
            Failure::Lost(r) => write!(f, "{r}"),
        }
    }
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Status {
    Pending,
    Done,
    Failed(Failure),
}

type OnEnd = Box<dyn FnOnce(&Status) + Send>;

/// One transfer (user-visible or internal to the engine).
pub struct Transfer {
    pub id: u64,
    pub conn: u64,
    remaining: AtomicUsize,
    ended: AtomicBool,
    status: Mutex<Status>,
    cv: Condvar,
    on_end: Mutex<Option<OnEnd>>,
    /// Set when a piece went wrong in a way that another event will explain
    /// (a refused read's empty fillers): the transfer then cannot end Done.
    poison: Mutex<Option<Failure>>,
    /// Regions in use: held so that deregistration waits for us.
    _regions: Vec<Arc<Region>>,
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
            on_end: Mutex::new(None),
            poison: Mutex::new(None),
            _regions: regions,
        });
        if events == 0 {
            t.end(Status::Done);
        }
        t
    }

    /// Runs `f` when the transfer ends (at once if it already has).
    pub fn on_end(&self, f: impl FnOnce(&Status) + Send + 'static) {
        let status = self.status.lock().clone();
        if status != Status::Pending {
            f(&status);
            return;
        }
        *self.on_end.lock() = Some(Box::new(f));
        // It may have ended between the two locks.
        let status = self.status.lock().clone();
        if status != Status::Pending {
            if let Some(f) = self.on_end.lock().take() {
                f(&status);
            }
        }
    }

    fn end(&self, s: Status) -> bool {
        {
            let mut st = self.status.lock();
            if *st != Status::Pending {
                return false;
            }
            *st = s.clone();
            self.ended.store(true, Ordering::Release);
        }
        self.cv.notify_all();
        if let Some(f) = self.on_end.lock().take() {
            f(&s);
        }
        true
    }

    /// One awaited event happened; the last one ends the transfer.
    pub fn complete_one(&self) {
        let prev = self.remaining.fetch_sub(1, Ordering::AcqRel);
        if prev == 1 {
            let poison = self.poison.lock().take();
            self.end(poison.map_or(Status::Done, Status::Failed));
        }
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

    /// True once the transfer has ended (lock-free).
    pub fn ended(&self) -> bool {
        self.ended.load(Ordering::Acquire)
    }

    pub fn status(&self) -> Status {
        self.status.lock().clone()
    }

    /// Waits until the transfer ends or `timeout` passes (None = forever).
    pub fn wait(&self, timeout: Option<Duration>) -> Status {
        let deadline = timeout.map(|t| Instant::now() + t);
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ends_exactly_once() {
        let t = Transfer::new(1, 1, 2, vec![]);
        let fired = Arc::new(AtomicUsize::new(0));
        let f2 = fired.clone();
        t.on_end(move |s| {
            assert_eq!(*s, Status::Done);
            f2.fetch_add(1, Ordering::SeqCst);
        });
        t.complete_one();
        assert_eq!(t.status(), Status::Pending);
        t.complete_one();
        assert_eq!(t.status(), Status::Done);
        assert!(!t.fail(Failure::Lost("late".into())));
        assert_eq!(t.status(), Status::Done);
        assert_eq!(fired.load(Ordering::SeqCst), 1);
    }

    #[test]
    fn failure_wins_over_later_completion() {
        let t = Transfer::new(1, 1, 1, vec![]);
        assert!(t.fail(Failure::Refused("no".into())));
        t.complete_one();
        assert_eq!(t.status(), Status::Failed(Failure::Refused("no".into())));
        let ran = Arc::new(AtomicBool::new(false));
        let r2 = ran.clone();
        t.on_end(move |_| r2.store(true, Ordering::SeqCst));
        assert!(
            ran.load(Ordering::SeqCst),
            "on_end after the end runs at once"
        );
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
}
