//! The listeners of an endpoint (its control listener, its same-host
//! listeners, the socket net's) as tasks of its I/O workers. When
//! accepting fails (out of file descriptors or buffers) a listener backs
//! off, doubling from 10 ms to 1 s, and warns at most every 10 s, rather
//! than retrying at once and keeping a core busy while the condition
//! lasts.

use std::io;
use std::net::{TcpListener, TcpStream};
use std::os::fd::{AsRawFd, RawFd};
use std::os::unix::net::{UnixListener, UnixStream};
use std::sync::Arc;
use std::time::{Duration, Instant};

use crate::workers::{Home, Step, Task, Workers};

const FIRST: Duration = Duration::from_millis(10);
const MOST: Duration = Duration::from_secs(1);
const WARN_EVERY: Duration = Duration::from_secs(10);

/// A listener whose connections a [`Listening`] task takes.
pub(crate) trait Listener: AsRawFd + Send + 'static {
    type Stream;
    /// Makes the listener's own accepts non-blocking.
    fn accept_without_waiting(&self) -> io::Result<()>;
    /// The next waiting connection, blocking (its handshake blocks,
    /// bounded by its deadlines, on a thread of its own).
    fn next(&self) -> io::Result<Self::Stream>;
}

impl Listener for TcpListener {
    type Stream = TcpStream;
    fn accept_without_waiting(&self) -> io::Result<()> {
        self.set_nonblocking(true)
    }
    fn next(&self) -> io::Result<TcpStream> {
        let (s, _) = self.accept()?;
        s.set_nonblocking(false)?;
        Ok(s)
    }
}

impl Listener for UnixListener {
    type Stream = UnixStream;
    fn accept_without_waiting(&self) -> io::Result<()> {
        self.set_nonblocking(true)
    }
    fn next(&self) -> io::Result<UnixStream> {
        let (s, _) = self.accept()?;
        s.set_nonblocking(false)?;
        Ok(s)
    }
}

/// Starts `listener` as a task of `workers` ([`Listening`]): each
/// connection goes to `take` with what `owner` gives, until `owner` gives
/// none (its owner gone or stopping). `what` names the connections in
/// the back-off's warnings.
pub(crate) fn listen_on<L: Listener, O: 'static>(
    workers: &Workers,
    listener: L,
    what: &'static str,
    owner: impl Fn() -> Option<O> + Send + 'static,
    take: impl FnMut(O, L::Stream) + Send + 'static,
) -> io::Result<Arc<Home>> {
    listener.accept_without_waiting()?;
    let fd = listener.as_raw_fd();
    let task = Listening {
        fd,
        listener,
        owner: Box::new(owner),
        take: Box::new(take),
        backoff: Backoff::new(what),
    };
    Ok(workers.start_readable(Box::new(task), fd))
}

/// A listener as a task of the I/O workers: it takes every connection
/// waiting, hands each to `take` with its owner, and then waits for the
/// next without a thread; a failing accept backs off ([`Backoff`]),
/// without a thread too. It ends once `owner` gives none, its listener
/// with it.
struct Listening<L: Listener, O> {
    /// The listener's descriptor, watched for connections.
    fd: RawFd,
    listener: L,
    owner: Box<dyn Fn() -> Option<O> + Send>,
    take: Box<dyn FnMut(O, L::Stream) + Send>,
    backoff: Backoff,
}

impl<L: Listener, O: 'static> Task for Listening<L, O> {
    fn run(&mut self) -> Step {
        loop {
            let Some(o) = (self.owner)() else {
                return Step::Done;
            };
            match self.listener.next() {
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
