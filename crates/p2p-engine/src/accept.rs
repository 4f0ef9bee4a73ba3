//! The listeners of an endpoint (its control listener, its same-host
//! listeners, the socket net's) as tasks of its I/O workers. When
//! accepting fails (out of file descriptors or buffers) a listener backs
//! off, doubling from 10 ms to 1 s, and warns at most every 10 s, rather
//! than retrying at once and keeping a core busy while the condition
//! lasts.

use std::io;
use std::os::fd::RawFd;
use std::time::{Duration, Instant};

use crate::workers::{Step, Task};

const FIRST: Duration = Duration::from_millis(10);
const MOST: Duration = Duration::from_secs(1);
const WARN_EVERY: Duration = Duration::from_secs(10);

/// A listener as a task of the I/O workers: it takes every connection
/// waiting, hands each to `take` with its owner, and then waits for the
/// next without a thread (`accept` must not block: a non-blocking
/// listener); a failing accept backs off ([`Backoff`]), without a thread
/// too. It ends once `owner` gives none (its owner gone or
/// stopping), its listener with it.
pub(crate) struct Listening<S, O> {
    /// The listener's descriptor, watched for connections.
    pub fd: RawFd,
    /// The next connection (the listener's `accept`).
    pub accept: Box<dyn FnMut() -> io::Result<S> + Send>,
    pub owner: Box<dyn Fn() -> Option<O> + Send>,
    pub take: Box<dyn FnMut(O, S) + Send>,
    pub backoff: Backoff,
}

impl<S: 'static, O: 'static> Task for Listening<S, O> {
    fn run(&mut self) -> Step {
        loop {
            let Some(o) = (self.owner)() else {
                return Step::Done;
            };
            match (self.accept)() {
                Ok(s) => {
                    self.backoff.accepted();
                    (self.take)(o, s);
                }
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => return Step::Readable(self.fd),
                Err(e) => {
                    if let Some(wait) = self.backoff.failed(&e) {
                        return Step::Until(Instant::now() + wait);
                    }
                }
            }
        }
    }
}

/// How long a failing accept loop waits before it tries again, and its
/// warnings (the socket net's listener task uses it too).
pub(crate) struct Backoff {
    /// Which listener, for the warning.
    what: &'static str,
    delay: Duration,
    last_warn: Option<Instant>,
    /// Warnings written (for tests).
    warned: u64,
}

impl Backoff {
    pub(crate) fn new(what: &'static str) -> Self {
        Backoff {
            what,
            delay: Duration::ZERO,
            last_warn: None,
            warned: 0,
        }
    }

    /// An accept succeeded: the next failure starts from the shortest wait.
    pub(crate) fn accepted(&mut self) {
        self.delay = Duration::ZERO;
    }

    /// An accept failed with `e`: how long to wait before the next one
    /// (None: at once -- a signal, or a peer that gave up while queued).
    pub(crate) fn failed(&mut self, e: &io::Error) -> Option<Duration> {
        if matches!(
            e.kind(),
            io::ErrorKind::Interrupted | io::ErrorKind::ConnectionAborted
        ) {
            return None;
        }
        self.delay = (self.delay * 2).clamp(FIRST, MOST);
        if self.last_warn.is_none_or(|t| t.elapsed() > WARN_EVERY) {
            tracing::warn!(
                "accepting {} failed: {e} (out of file descriptors? raise `ulimit -n`); \
                 retrying in {:?}",
                self.what,
                self.delay
            );
            self.last_warn = Some(Instant::now());
            self.warned += 1;
        }
        Some(self.delay)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn doubles_up_to_a_second_warns_once_and_resets() {
        let mut b = Backoff::new("test connections");
        let emfile = io::Error::from_raw_os_error(24);
        let waits: Vec<_> = (0..9).map(|_| b.failed(&emfile).unwrap()).collect();
        let ms: Vec<u128> = waits.iter().map(|d| d.as_millis()).collect();
        assert_eq!(ms, [10, 20, 40, 80, 160, 320, 640, 1000, 1000]);
        assert_eq!(b.warned, 1, "one warning per 10 s, not one per retry");
        b.accepted();
        assert_eq!(b.failed(&emfile), Some(FIRST));
        let intr = io::Error::from(io::ErrorKind::Interrupted);
        assert_eq!(b.failed(&intr), None);
        let aborted = io::Error::from(io::ErrorKind::ConnectionAborted);
        assert_eq!(b.failed(&aborted), None);
    }
}
