//! The accept loop of the control listener and of the same-host
//! listeners. When accepting fails (out of file descriptors or buffers) it
//! backs off, doubling from 10 ms to 1 s, and warns at most every 10 s,
//! rather than retrying at once and keeping a core busy while the
//! condition lasts.

use std::io;
use std::time::{Duration, Instant};

const FIRST: Duration = Duration::from_millis(10);
const MOST: Duration = Duration::from_secs(1);
const WARN_EVERY: Duration = Duration::from_secs(10);

/// Accepts from `incoming` for as long as `owner` gives its owner (None:
/// gone or stopping, and the loop ends), handing each accepted stream to
/// `take` with the owner. A failed accept backs off, the owner let go
/// while it waits.
pub(crate) fn accept_loop<S, O>(
    what: &'static str,
    incoming: impl Iterator<Item = io::Result<S>>,
    owner: impl Fn() -> Option<O>,
    mut take: impl FnMut(O, S),
) {
    let mut backoff = Backoff::new(what);
    for s in incoming {
        let Some(o) = owner() else { return };
        match s {
            Ok(s) => {
                backoff.accepted();
                take(o, s);
            }
            Err(e) => {
                if let Some(wait) = backoff.failed(&e) {
                    drop(o);
                    std::thread::sleep(wait);
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
