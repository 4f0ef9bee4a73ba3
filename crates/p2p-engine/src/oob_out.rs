//! The writing side of a control connection, which no thread ever waits
//! on: each write goes straight to the socket while it takes the bytes,
//! and what it does not take waits in a backlog that a writer thread of its
//! own drains, in order.
//!
//! Two peers whose control threads both write replies to each other (an
//! inline read's answer carries up to 1 MiB) could otherwise fill both
//! sockets' buffers while each reader waits to write and neither reads.
//! Every write is made under the connection's state lock, so the order
//! of frames is the order of the writes, whether a frame went out at once
//! or through the backlog.

use std::collections::VecDeque;
use std::io::{self, IoSlice, Write};
use std::sync::{Arc, Weak};
use std::time::Duration;

use parking_lot::{Condvar, Mutex};

use crate::ctl::Ctl;
use crate::workers::{Home, Step, Task, Workers};

/// Most bytes the backlog holds: a peer that leaves more of our control
/// messages unread loses the connection rather than our memory.
pub(crate) const MAX_BACKLOG: usize = 64 << 20;

/// What the writer thread and the writers share.
#[derive(Default)]
pub(crate) struct Backlog {
    chunks: VecDeque<Vec<u8>>,
    /// Bytes not yet written: the chunks queued and the one the writer
    /// thread is writing. Every write queues behind them while any are.
    bytes: usize,
    closed: bool,
}

impl Backlog {
    fn queue(&mut self, bytes: Vec<u8>, cv: &Condvar) -> io::Result<()> {
        if self.bytes + bytes.len() > MAX_BACKLOG {
            return Err(io::Error::new(
                io::ErrorKind::WouldBlock,
                format!(
                    "the peer left {} bytes of our control messages unread (at most {MAX_BACKLOG} are kept)",
                    self.bytes
                ),
            ));
        }
        self.bytes += bytes.len();
        self.chunks.push_back(bytes);
        cv.notify_all();
        Ok(())
    }
}

/// The control connection's writing end (see the module's text). Held
/// under the connection's state lock.
pub(crate) struct OobOut {
    s: Ctl,
    shared: Arc<(Mutex<Backlog>, Condvar)>,
    /// The writer task, woken when the backlog grows or closes.
    writer: Option<Arc<Home>>,
}

impl OobOut {
    pub(crate) fn new(s: Ctl) -> Self {
        OobOut {
            s,
            shared: Arc::default(),
            writer: None,
        }
    }

    /// The stream written to (for shutting it down).
    pub(crate) fn stream(&self) -> &Ctl {
        &self.s
    }

    /// Starts the writer task (on `workers`) on a clone of the stream;
    /// `failed` is called with what went wrong if a write of the backlog
    /// fails.
    pub(crate) fn start_writer(
        &mut self,
        workers: &Workers,
        failed: impl Fn(io::Error) + Send + 'static,
    ) -> io::Result<Arc<Home>> {
        let s = self.s.try_clone()?;
        let task = Drain {
            s,
            shared: Arc::downgrade(&self.shared),
            failed: Box::new(failed),
        };
        let home = workers.start_idle(Box::new(task));
        self.writer = Some(home.clone());
        Ok(home)
    }

    fn wake_writer(&self) {
        if let Some(w) = &self.writer {
            w.kick();
        }
    }

    /// Ends the writer task once the backlog is written (or at once,
    /// when the stream is shut down).
    pub(crate) fn close(&self) {
        let (m, cv) = &*self.shared;
        m.lock().closed = true;
        cv.notify_all();
        self.wake_writer();
    }

    /// Bytes queued and not yet written.
    pub(crate) fn backlog(&self) -> usize {
        self.shared.0.lock().bytes
    }

    /// Waits up to `limit` for the backlog to be written.
    pub(crate) fn flush_for(&self, limit: Duration) {
        let (m, cv) = &*self.shared;
        let mut b = m.lock();
        let end = crate::timeout::deadline_after(limit);
        while b.bytes > 0 {
            match end {
                Some(end) if std::time::Instant::now() >= end => break,
                Some(end) => {
                    cv.wait_until(&mut b, end);
                }
                None => cv.wait(&mut b),
            }
        }
    }
}

impl Write for OobOut {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        self.write_vectored(&[IoSlice::new(buf)])
    }

    /// Takes every byte given: what the socket does not take now is queued.
    fn write_vectored(&mut self, bufs: &[IoSlice<'_>]) -> io::Result<usize> {
        let total: usize = bufs.iter().map(|b| b.len()).sum();
        let (m, cv) = &*self.shared;
        let mut b = m.lock();
        if b.closed {
            return Err(io::Error::new(
                io::ErrorKind::BrokenPipe,
                "control connection closed",
            ));
        }
        let sent = if b.bytes > 0 {
            0
        } else {
            send_now(&socket2::SockRef::from(&self.s), bufs)?
        };
        if sent < total {
            let mut rest = Vec::with_capacity(total - sent);
            let mut skip = sent;
            for s in bufs {
                if skip >= s.len() {
                    skip -= s.len();
                    continue;
                }
                rest.extend_from_slice(&s[skip..]);
                skip = 0;
            }
            b.queue(rest, cv)?;
            drop(b);
            self.wake_writer();
        }
        Ok(total)
    }

    fn flush(&mut self) -> io::Result<()> {
        Ok(())
    }
}

/// Slices one `sendmsg` takes at most (Linux's `UIO_MAXIOV`; more fail the
/// call with `EMSGSIZE`). An inline write of many small pieces gives one
/// slice per piece.
const IOV_MAX: usize = 1024;

/// Sends what the socket takes now without waiting, [`IOV_MAX`] slices a
/// call: the bytes sent, from the start of `bufs`.
fn send_now(sock: &socket2::SockRef<'_>, bufs: &[IoSlice<'_>]) -> io::Result<usize> {
    let mut sent = 0;
    for chunk in bufs.chunks(IOV_MAX) {
        let want: usize = chunk.iter().map(|b| b.len()).sum();
        let n = loop {
            match sock.send_vectored_with_flags(chunk, libc::MSG_DONTWAIT | libc::MSG_NOSIGNAL) {
                Ok(n) => break n,
                Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => return Ok(sent),
                Err(e) => return Err(e),
            }
        };
        sent += n;
        if n < want {
            break;
        }
    }
    Ok(sent)
}

impl Drop for OobOut {
    fn drop(&mut self) {
        // The writer task ends once it sees the backlog gone.
        self.close();
    }
}

/// The writer task: writes the backlog's chunks in order, blocking (up to
/// the stream's write timeout) on each; idle (no thread) while the backlog
/// is empty.
struct Drain {
    s: Ctl,
    shared: Weak<(Mutex<Backlog>, Condvar)>,
    failed: Box<dyn Fn(io::Error) + Send>,
}

impl Task for Drain {
    fn run(&mut self) -> Step {
        loop {
            let Some(sh) = self.shared.upgrade() else {
                return Step::Done;
            };
            let chunk = {
                let mut b = sh.0.lock();
                match b.chunks.pop_front() {
                    Some(c) => c,
                    None if b.closed => return Step::Done,
                    None => return Step::Idle,
                }
            };
            drop(sh);
            let r = self.s.write_all(&chunk);
            let Some(sh) = self.shared.upgrade() else {
                return Step::Done;
            };
            let (m, cv) = &*sh;
            let mut b = m.lock();
            b.bytes -= chunk.len();
            if let Err(e) = r {
                b.closed = true;
                cv.notify_all();
                drop(b);
                (self.failed)(e);
                return Step::Done;
            }
            cv.notify_all();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Read;
    use std::net::{TcpListener, TcpStream};
    use std::os::unix::net::UnixStream;

    #[test]
    fn writes_never_wait_and_arrive_in_order() {
        // On a Unix stream (a same-host connection's control connection).
        let (a, mut b) = UnixStream::pair().unwrap();
        a.set_write_timeout(Some(Duration::from_secs(30))).unwrap();
        let mut out = OobOut::new(Ctl::Unix(a));
        let w = Workers::new("test-io", None).unwrap();
        let h = out.start_writer(&w, |e| panic!("{e}")).unwrap();
        // Far more than the socket buffers hold, written while nobody
        // reads: every write returns at once.
        let frame = |i: u32| {
            let mut v = i.to_le_bytes().to_vec();
            v.resize(256 << 10, (i % 251) as u8);
            v
        };
        let t = std::time::Instant::now();
        for i in 0..128u32 {
            out.write_all(&frame(i)).unwrap();
        }
        assert!(t.elapsed() < Duration::from_secs(5), "a write waited");
        let mut got = vec![0u8; 256 << 10];
        for i in 0..128u32 {
            b.read_exact(&mut got).unwrap();
            assert!(got == frame(i), "frame {i} out of order or damaged");
        }
        out.flush_for(Duration::from_secs(5));
        out.close();
        assert!(h.wait_done(Duration::from_secs(5)));
    }

    #[test]
    fn a_write_of_more_slices_than_one_system_call_takes_arrives_whole() {
        // An inline write of 3,000 small pieces: one slice each.
        let (a, mut b) = UnixStream::pair().unwrap();
        let mut out = OobOut::new(Ctl::Unix(a));
        let w = Workers::new("test-io", None).unwrap();
        let h = out.start_writer(&w, |e| panic!("{e}")).unwrap();
        let pieces: Vec<Vec<u8>> = (0..3000u32)
            .map(|i| vec![(i % 251) as u8; 1 + (i % 7) as usize])
            .collect();
        let slices: Vec<IoSlice<'_>> = pieces.iter().map(|p| IoSlice::new(p)).collect();
        let total: usize = pieces.iter().map(|p| p.len()).sum();
        assert_eq!(out.write_vectored(&slices).unwrap(), total);
        let mut got = vec![0u8; total];
        b.read_exact(&mut got).unwrap();
        assert_eq!(got, pieces.concat());
        out.flush_for(Duration::from_secs(5));
        out.close();
        assert!(h.wait_done(Duration::from_secs(5)));
    }

    #[test]
    fn a_peer_that_never_reads_hits_the_cap() {
        let l = TcpListener::bind("127.0.0.1:0").unwrap();
        let a = TcpStream::connect(l.local_addr().unwrap()).unwrap();
        let (_b, _) = l.accept().unwrap();
        a.set_write_timeout(Some(Duration::from_secs(30))).unwrap();
        let mut out = OobOut::new(Ctl::Tcp(a));
        let w = Workers::new("test-io", None).unwrap();
        let _h = out.start_writer(&w, |_| {}).unwrap();
        let chunk = vec![7u8; 1 << 20];
        let mut err = None;
        for _ in 0..(MAX_BACKLOG >> 20) + 64 {
            if let Err(e) = out.write_all(&chunk) {
                err = Some(e);
                break;
            }
        }
        let e = err.expect("the backlog is bounded");
        assert!(e.to_string().contains("unread"), "{e}");
        out.close();
    }
}
