//! Where an I/O thread's time goes, for the engine's socket net and the
//! ncclNet stand-in alike (which keeps its accounts the same way without
//! depending on the engine). A thread opens its account with
//! [`start`]; [`mark`] charges the time since the previous mark to what
//! the thread was doing; the account is logged (`debug`) when the thread
//! ends. Off -- one thread-local lookup per mark -- unless `debug` logging
//! is on for this crate (`TCPX_P2P_LOG=debug`).

use std::cell::RefCell;
use std::fmt::Write as _;
use std::time::{Duration, Instant};

/// What an I/O thread was doing.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Spent {
    /// In socket reads and writes of payload.
    Socket,
    /// Waiting for staged GPU copies to land.
    Copies,
    /// Queueing GPU copies and events with the driver.
    Driver,
    /// Waiting for work: a queued send, a posted receive, the peer's next
    /// part.
    Waiting,
    /// Everything else: matching, bookkeeping, completions.
    Other,
}

/// Every kind, in the order of their discriminants (an account's slots).
const KINDS: [(Spent, &str); 5] = [
    (Spent::Socket, "socket"),
    (Spent::Copies, "copies"),
    (Spent::Driver, "driver"),
    (Spent::Waiting, "waiting"),
    (Spent::Other, "other"),
];

struct Account {
    name: String,
    born: Instant,
    last: Instant,
    spent: [Duration; KINDS.len()],
    bytes: u64,
}

impl Account {
    fn summary(&self) -> String {
        let total = self.last.duration_since(self.born);
        let secs = total.as_secs_f64().max(1e-9);
        let mut s = format!(
            "{}: {:.3} GB in {:.3} s ({:.2} GB/s):",
            self.name,
            self.bytes as f64 / 1e9,
            secs,
            self.bytes as f64 / 1e9 / secs
        );
        for (i, (_, label)) in KINDS.iter().enumerate() {
            let share = 100.0 * self.spent[i].as_secs_f64() / secs;
            let _ = write!(s, " {label} {share:.1}%");
        }
        s
    }
}

thread_local! {
    static ACCOUNT: RefCell<Option<Account>> = const { RefCell::new(None) };
}

/// Closes the thread's account when dropped (see [`start`]).
pub struct Open;

impl Drop for Open {
    fn drop(&mut self) {
        finish();
    }
}

/// Opens this thread's account, named for the log (e.g. "tx stream 3 to
/// 10.0.0.2:40000"), when `debug` logging is on; it is closed and logged
/// when the returned guard is dropped.
#[must_use]
pub fn start(name: impl FnOnce() -> String) -> Open {
    if tracing::enabled!(tracing::Level::DEBUG) {
        open(name());
    }
    Open
}

/// Opens this thread's account whatever the log level, for a caller that
/// takes the summary from [`finish`] itself (the TCPX stand-in writes it
/// to a file).
pub fn open(name: String) {
    let now = Instant::now();
    ACCOUNT.with(|a| {
        *a.borrow_mut() = Some(Account {
            name,
            born: now,
            last: now,
            spent: Default::default(),
            bytes: 0,
        })
    });
}

/// Whether this thread has an account open (see [`start`]).
pub fn is_open() -> bool {
    ACCOUNT.with(|a| a.borrow().is_some())
}

/// Charges the time since the previous mark to `what`.
pub fn mark(what: Spent) {
    ACCOUNT.with(|a| {
        if let Some(a) = a.borrow_mut().as_mut() {
            let now = Instant::now();
            a.spent[what as usize] += now.duration_since(a.last);
            a.last = now;
        }
    });
}

/// Counts bytes this thread moved through its socket (headers included).
pub fn bytes(n: usize) {
    ACCOUNT.with(|a| {
        if let Some(a) = a.borrow_mut().as_mut() {
            a.bytes += n as u64;
        }
    });
}

/// Closes this thread's account (the last stretch, which ends a thread
/// normally waiting for work when its comm closes, counts as waiting),
/// logs it unless it moved nothing, and returns its summary line.
pub fn finish() -> Option<String> {
    mark(Spent::Waiting);
    let a = ACCOUNT.with(|a| a.borrow_mut().take())?;
    let line = a.summary();
    if a.bytes > 0 {
        tracing::debug!("{line}");
    }
    Some(line)
}

/// A clock for the steps of one call (where a posting's time goes, say),
/// read only while `on` (its trace is enabled): off, every reading is zero
/// and no clock is read, so a hot call pays nothing for it.
#[derive(Debug, Clone, Copy)]
pub struct Steps(Option<Instant>);

impl Steps {
    pub fn start(on: bool) -> Self {
        Steps(on.then(Instant::now))
    }

    /// The time since the start (zero while off).
    pub fn at(&self) -> Duration {
        self.0.map_or(Duration::ZERO, |t| t.elapsed())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn steps_read_the_clock_only_while_on() {
        let off = Steps::start(false);
        std::thread::sleep(Duration::from_millis(2));
        assert_eq!(off.at(), Duration::ZERO);
        let on = Steps::start(true);
        std::thread::sleep(Duration::from_millis(2));
        let a = on.at();
        assert!(a >= Duration::from_millis(2), "{a:?}");
        assert!(on.at() >= a);
    }

    #[test]
    fn account_charges_each_stretch_to_its_kind() {
        let mut a = Account {
            name: "tx stream 0".into(),
            born: Instant::now(),
            last: Instant::now(),
            spent: Default::default(),
            bytes: 2_000_000_000,
        };
        a.spent[0] = Duration::from_millis(750);
        a.spent[3] = Duration::from_millis(250);
        a.last = a.born + Duration::from_secs(1);
        let s = a.summary();
        assert!(
            s.starts_with("tx stream 0: 2.000 GB in 1.000 s (2.00 GB/s):"),
            "{s}"
        );
        assert!(
            s.contains("socket 75.0%") && s.contains("waiting 25.0%"),
            "{s}"
        );
        assert!(s.contains("copies 0.0%"), "{s}");
    }

    #[test]
    fn kinds_are_listed_in_discriminant_order() {
        for (i, (k, _)) in KINDS.iter().enumerate() {
            assert_eq!(*k as usize, i, "{k:?}");
        }
    }

    #[test]
    fn marks_charge_the_thread_account() {
        std::thread::spawn(|| {
            mark(Spent::Socket); // no account yet: nothing happens
            open("rx stream 1".into());
            std::thread::sleep(Duration::from_millis(40));
            mark(Spent::Copies);
            std::thread::sleep(Duration::from_millis(10));
            bytes(1_500_000);
            bytes(500_000);
            let s = finish().expect("an open account");
            assert!(s.starts_with("rx stream 1: 0.002 GB in "), "{s}");
            let copies: f64 = s
                .split(" copies ")
                .nth(1)
                .and_then(|r| r.split('%').next())
                .and_then(|v| v.parse().ok())
                .expect("a copies share");
            assert!(copies > 50.0, "{s}");
            assert!(
                !s.contains("waiting 0.0%"),
                "the last stretch is waiting: {s}"
            );
            assert_eq!(finish(), None, "closed once");
        })
        .join()
        .expect("account thread");
    }
}
