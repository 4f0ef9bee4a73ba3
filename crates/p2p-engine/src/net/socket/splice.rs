//! Sends without the sender's copy: `vmsplice` lends the pages of a pinned
//! staging slot to a pipe and `splice` hands them to the socket, so the
//! kernel references the slot instead of copying it into socket buffers
//! (over loopback the receiver's read is then the only CPU copy of the
//! payload). A lent slot must not be written again until the receiver has
//! read its bytes, which only the receiver knows: it sends back *credits*,
//! the count of lent payload bytes it has read so far.
//!
//! The protocol, per stream: the sender marks the header of each part whose
//! payload it lends (`spliced` in [`super::wire::PartHeader`]); the receiver counts the payload bytes of
//! marked parts as it takes them from the socket and writes the count (8
//! bytes, little-endian) back on the same socket every [`CREDIT_STEP`]
//! bytes, at the end of each marked part, and before any read that would
//! block while bytes are uncredited — so a sender waiting for a credit is
//! always answered. The sender counts the bytes it lends the same way and
//! reuses a slot once the credits reach the count at the end of that slot's
//! bytes.
//!
//! Measured (`benchmarks/results/2026-11-22-h200x2-splice/`): host memory
//! over eight loopback streams (`benchmarks/splice_vs_send.c`) 45.7-61.8
//! GB/s lent vs 31.9-39.3 written on h200-x2; GPU -> GPU through the socket
//! net 21.7-24.1 / 22.5-25.2 GB/s at 16 / 256 MiB lent vs 18.2-21.3 /
//! 18.7-21.6 written. On the 2-core box the host test read 3.4-3.7 lent vs
//! 5.6-6.1 written (the pipe and page references cost more CPU than the
//! copy they save), so only GPU staging is lent: host-memory parts are
//! still written.
//!
//! System calls on raw descriptors and lent memory: `unsafe` is allowed here.
#![allow(unsafe_code)]

use std::io::{self, Write};
use std::net::TcpStream;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::sync::Arc;

/// The receiver credits at least every this many lent bytes read.
pub(super) const CREDIT_STEP: u64 = 512 << 10;

/// How far the lending of one window has come: bytes moved into the pipe,
/// and from it into the socket.
#[derive(Default, Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct LendAt {
    piped: usize,
    sent: usize,
}

/// A stream's pipe and credit count, owned by its send thread.
pub(super) struct Splicer {
    sock: Arc<TcpStream>,
    rd: OwnedFd,
    wr: OwnedFd,
    /// Payload bytes lent so far on this stream.
    lent: u64,
    /// Payload bytes the receiver has read (its latest credit).
    credited: u64,
    /// A credit read in pieces.
    acc: [u8; 8],
    acc_len: usize,
}

fn last_error<T>(what: &str) -> io::Result<T> {
    let e = io::Error::last_os_error();
    Err(io::Error::new(e.kind(), format!("{what}: {e}")))
}

impl Splicer {
    /// A pipe of (up to) `cap` bytes: one staging slot moves in one
    /// `vmsplice` + `splice` pair where the limit allows it
    /// (`/proc/sys/fs/pipe-max-size`); smaller pipes only cost more calls.
    pub(super) fn new(sock: Arc<TcpStream>, cap: usize) -> io::Result<Self> {
        let mut fds = [0; 2];
        // SAFETY: pipe2 writes two descriptors into the array given.
        if unsafe { libc::pipe2(fds.as_mut_ptr(), libc::O_CLOEXEC) } != 0 {
            return last_error("pipe2");
        }
        // SAFETY: both descriptors were just made and are owned only here.
        let (rd, wr) = unsafe { (OwnedFd::from_raw_fd(fds[0]), OwnedFd::from_raw_fd(fds[1])) };
        let want = cap.min(i32::MAX as usize) as libc::c_int;
        // SAFETY: a plain fcntl on our own descriptor; failure leaves the
        // default size, which still works.
        unsafe { libc::fcntl(wr.as_raw_fd(), libc::F_SETPIPE_SZ, want) };
        Ok(Splicer {
            sock,
            rd,
            wr,
            lent: 0,
            credited: 0,
            acc: [0; 8],
            acc_len: 0,
        })
    }

    /// Whether `buf` can be lent at all: memory the kernel cannot take
    /// page references to (some driver mappings) fails here, up front,
    /// rather than in the middle of a transfer.
    pub(super) fn probe(&self, buf: &[u8]) -> io::Result<()> {
        let n = buf.len().min(4096);
        // `buf` outlives the loop below, which drains the pipe again.
        let mut left = self.to_pipe(&buf[..n])?;
        let mut sink = vec![0u8; n];
        while left > 0 {
            // SAFETY: reads into the local buffer, at most its length.
            let m = unsafe {
                libc::read(
                    self.rd.as_raw_fd(),
                    sink.as_mut_ptr() as *mut libc::c_void,
                    left.min(n),
                )
            };
            if m <= 0 {
                return last_error("draining the probe pipe");
            }
            left -= m as usize;
        }
        Ok(())
    }

    /// Payload bytes lent so far.
    pub(super) fn lent(&self) -> u64 {
        self.lent
    }

    /// The receiver's latest credit.
    pub(super) fn credited(&self) -> u64 {
        self.credited
    }

    /// Lends (the start of) `data` to the pipe: the pages are referenced,
    /// not copied, so they must stay unwritten until the bytes have been
    /// read at the far end. Returns how many bytes the pipe took.
    fn to_pipe(&self, data: &[u8]) -> io::Result<usize> {
        let iov = libc::iovec {
            iov_base: data.as_ptr() as *mut libc::c_void,
            iov_len: data.len(),
        };
        // SAFETY: lends pages of `data`; the callers keep them unwritten
        // until their bytes are read (see the module comment).
        let n = unsafe { libc::vmsplice(self.wr.as_raw_fd(), &iov, 1, 0) };
        if n <= 0 {
            return last_error("vmsplice");
        }
        Ok(n as usize)
    }

    /// Lends `data` to the socket without blocking, from where `at` says
    /// the last call stopped: true once all of it is in the socket
    /// ([`Splicer::lent`] is then the credit after which its memory may be
    /// written again), false when the socket is full. `data` must stay
    /// untouched from the first call until that credit. Bytes count as
    /// lent as they enter the socket: the receiver may read and credit
    /// part of a window whose lend the socket cut short.
    pub(super) fn send_now(&mut self, data: &[u8], at: &mut LendAt) -> io::Result<bool> {
        while at.sent < data.len() {
            if at.piped == at.sent {
                // The pipe is empty: it takes the next pages (up to its
                // size) without blocking.
                at.piped += self.to_pipe(&data[at.piped..])?;
            }
            let more = if at.piped < data.len() {
                libc::SPLICE_F_MORE
            } else {
                0
            };
            match self.pipe_to_socket(at.piped - at.sent, more)? {
                Some(m) => {
                    at.sent += m;
                    self.lent += m as u64;
                }
                None => return Ok(false),
            }
        }
        *at = LendAt::default();
        Ok(true)
    }

    /// Moves up to `len` bytes from the pipe to the socket without
    /// blocking (the socket is non-blocking for the call only: the stream's
    /// other writes block); None when the socket is full.
    fn pipe_to_socket(&self, len: usize, more: libc::c_uint) -> io::Result<Option<usize>> {
        let fd = self.sock.as_raw_fd();
        let nonblocking = |on: libc::c_int| {
            // SAFETY: FIONBIO reads one int through the pointer given.
            if unsafe { libc::ioctl(fd, libc::FIONBIO, &on) } != 0 {
                return last_error("setting the socket non-blocking");
            }
            Ok(())
        };
        nonblocking(1)?;
        let r = loop {
            // SAFETY: moves pipe contents to the socket; no user memory is
            // passed.
            let m = unsafe {
                libc::splice(
                    self.rd.as_raw_fd(),
                    std::ptr::null_mut(),
                    fd,
                    std::ptr::null_mut(),
                    len,
                    libc::SPLICE_F_MOVE | libc::SPLICE_F_NONBLOCK | more,
                )
            };
            if m > 0 {
                break Ok(Some(m as usize));
            }
            if m == 0 {
                break Err(io::ErrorKind::WriteZero.into());
            }
            let e = io::Error::last_os_error();
            match e.kind() {
                io::ErrorKind::Interrupted => continue,
                io::ErrorKind::WouldBlock => break Ok(None),
                _ => break Err(io::Error::new(e.kind(), format!("splice: {e}"))),
            }
        };
        nonblocking(0)?;
        r
    }

    /// Takes the credits that have arrived, without blocking.
    pub(super) fn poll_credits(&mut self) -> io::Result<()> {
        self.read_credits(false)
    }

    /// Blocks until the receiver has credited `upto` bytes.
    pub(super) fn wait_credit(&mut self, upto: u64) -> io::Result<()> {
        while self.credited < upto {
            self.read_credits(true)?;
        }
        Ok(())
    }

    fn read_credits(&mut self, block: bool) -> io::Result<()> {
        let mut buf = [0u8; 256];
        loop {
            let flags = if block { 0 } else { libc::MSG_DONTWAIT };
            // SAFETY: receives into the local buffer, at most its length.
            let n = unsafe {
                libc::recv(
                    self.sock.as_raw_fd(),
                    buf.as_mut_ptr() as *mut libc::c_void,
                    buf.len(),
                    flags,
                )
            };
            if n < 0 {
                let e = io::Error::last_os_error();
                match e.kind() {
                    io::ErrorKind::WouldBlock => return Ok(()),
                    io::ErrorKind::Interrupted => continue,
                    _ => return Err(io::Error::new(e.kind(), format!("reading credits: {e}"))),
                }
            }
            if n == 0 {
                return Err(io::Error::new(
                    io::ErrorKind::UnexpectedEof,
                    "peer closed the stream while lent bytes were uncredited",
                ));
            }
            for &b in &buf[..n as usize] {
                self.acc[self.acc_len] = b;
                self.acc_len += 1;
                if self.acc_len == 8 {
                    let c = u64::from_le_bytes(self.acc);
                    if c > self.lent {
                        return Err(io::Error::new(
                            io::ErrorKind::InvalidData,
                            format!("credit for {c} bytes, only {} lent", self.lent),
                        ));
                    }
                    self.credited = self.credited.max(c);
                    self.acc_len = 0;
                }
            }
            // A blocking read returns what has come; a drain reads on
            // until the socket is empty.
            if block || (n as usize) < buf.len() {
                return Ok(());
            }
        }
    }
}

/// The receiving side's count of lent bytes read, and what it has
/// credited.
#[derive(Default)]
pub(super) struct CreditBack {
    /// Lent payload bytes of the current part still to read.
    left: usize,
    /// Lent payload bytes read.
    read: u64,
    /// The last credit written.
    sent: u64,
}

impl CreditBack {
    /// The next `len` payload bytes belong to a part marked [`SPLICED`].
    pub(super) fn begin(&mut self, len: usize) {
        self.left = len;
    }

    /// `n` payload bytes were taken from the stream: counts those of a lent
    /// part, crediting every [`CREDIT_STEP`] and at the part's end.
    pub(super) fn taken(&mut self, s: &TcpStream, n: usize) -> io::Result<()> {
        let f = n.min(self.left);
        if f == 0 {
            return Ok(());
        }
        self.left -= f;
        self.read += f as u64;
        if self.read - self.sent >= CREDIT_STEP || self.left == 0 {
            self.send(s)?;
        }
        Ok(())
    }

    /// About to read from `s`: credits what is owed if the read may block
    /// (the sender may be waiting for exactly these bytes).
    pub(super) fn before_read(&mut self, s: &TcpStream) -> io::Result<()> {
        if self.read > self.sent && !super::sockio::readable_now(s) {
            self.send(s)?;
        }
        Ok(())
    }

    fn send(&mut self, s: &TcpStream) -> io::Result<()> {
        (&*s)
            .write_all(&self.read.to_le_bytes())
            .map_err(|e| io::Error::new(e.kind(), format!("writing a credit: {e}")))?;
        self.sent = self.read;
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Read;
    use std::net::TcpListener;

    fn pair() -> (TcpStream, TcpStream) {
        let l = TcpListener::bind("127.0.0.1:0").unwrap();
        let a = TcpStream::connect(l.local_addr().unwrap()).unwrap();
        let (b, _) = l.accept().unwrap();
        (a, b)
    }

    /// Lends the rest of `data` from `at`, waiting for room whenever the
    /// socket is full; returns how many times it was.
    fn lend_rest(sp: &mut Splicer, data: &[u8], at: &mut LendAt) -> usize {
        let mut full = 0;
        while !sp.send_now(data, at).unwrap() {
            full += 1;
            let sock = sp.sock.clone();
            assert!(super::super::sockio::wait_writable_unless(
                &*sock,
                std::time::Duration::from_secs(10),
                || false
            ));
        }
        full
    }

    /// A sender lends slots of a small ring and rewrites each slot as soon
    /// as its bytes are credited; the receiver must see every message as it
    /// was when lent (a slot rewritten too early shows as another pattern).
    #[test]
    fn lent_slots_are_reused_only_once_credited() {
        const SLOT: usize = 192 << 10;
        const DEPTH: usize = 3;
        const MSGS: usize = 60;
        let (tx, rx) = pair();
        let recv = std::thread::spawn(move || {
            let mut cb = CreditBack::default();
            let mut buf = vec![0u8; SLOT];
            for m in 0..MSGS {
                cb.begin(SLOT);
                // Read in uneven pieces, crediting as the reader goes.
                let mut at = 0;
                while at < SLOT {
                    let piece = (SLOT - at).min(40_000 + 7 * m);
                    cb.before_read(&rx).unwrap();
                    (&rx).read_exact(&mut buf[at..at + piece]).unwrap();
                    cb.taken(&rx, piece).unwrap();
                    at += piece;
                }
                let want = (m % 251) as u8;
                let bad = buf.iter().position(|&b| b != want);
                assert_eq!(bad, None, "message {m}: a byte of another message");
            }
            cb.read
        });
        let mut sp = Splicer::new(Arc::new(tx), SLOT).unwrap();
        let mut ring = vec![vec![0u8; SLOT]; DEPTH];
        let mut mark = [0u64; DEPTH];
        sp.probe(&ring[0]).unwrap();
        for m in 0..MSGS {
            let k = m % DEPTH;
            sp.wait_credit(mark[k]).unwrap();
            ring[k].fill((m % 251) as u8);
            lend_rest(&mut sp, &ring[k], &mut LendAt::default());
            mark[k] = sp.lent();
        }
        sp.wait_credit(sp.lent()).unwrap();
        assert_eq!(recv.join().unwrap(), (SLOT * MSGS) as u64);
        assert_eq!(sp.credited(), (SLOT * MSGS) as u64);
    }

    #[test]
    fn a_credit_beyond_what_was_lent_is_an_error() {
        let (tx, rx) = pair();
        (&rx).write_all(&5u64.to_le_bytes()).unwrap();
        let mut sp = Splicer::new(Arc::new(tx), 4096).unwrap();
        let e = sp.wait_credit(1).unwrap_err();
        assert_eq!(e.kind(), io::ErrorKind::InvalidData);
    }

    #[test]
    fn a_closed_peer_ends_a_wait_for_credit() {
        let (tx, rx) = pair();
        let mut sp = Splicer::new(Arc::new(tx), 4096).unwrap();
        lend_rest(&mut sp, &[7u8; 4096], &mut LendAt::default());
        drop(rx);
        assert!(sp.wait_credit(4096).is_err());
    }

    #[test]
    fn a_lend_into_a_full_socket_stops_there_and_resumes_where_it_stopped() {
        // The receiver reads nothing at first: the lend fills the socket
        // and returns without blocking; read, it resumes, and every byte
        // comes once, in order.
        const N: usize = 8 << 20;
        let (tx, mut rx) = pair();
        socket2::SockRef::from(&tx)
            .set_send_buffer_size(64 << 10)
            .unwrap();
        let data: Vec<u8> = (0..N)
            .map(|i| (i as u8).wrapping_mul(13) ^ (i >> 12) as u8)
            .collect();
        let mut sp = Splicer::new(Arc::new(tx), 1 << 20).unwrap();
        let mut at = LendAt::default();
        assert!(
            !sp.send_now(&data, &mut at).unwrap(),
            "8 MiB fit a full socket"
        );
        assert!(at.sent > 0 && at.sent < N, "stopped at {} of {N}", at.sent);
        assert_eq!(sp.lent(), at.sent as u64, "lent as they entered the socket");
        // What the receiver may credit of the window so far is no error.
        let mut first = vec![0u8; at.sent];
        rx.read_exact(&mut first).unwrap();
        assert!(first == data[..at.sent]);
        rx.write_all(&(at.sent as u64).to_le_bytes()).unwrap();
        sp.wait_credit(at.sent as u64).unwrap();
        let done = at.sent;
        let want = data.clone();
        let reader = std::thread::spawn(move || {
            let mut got = vec![0u8; N - done];
            rx.read_exact(&mut got).unwrap();
            got == want[done..]
        });
        let full = lend_rest(&mut sp, &data, &mut at);
        assert_eq!(sp.lent(), N as u64);
        assert_eq!(at, LendAt::default());
        assert!(reader.join().unwrap(), "the bytes came changed");
        eprintln!("resumed after {full} more full sockets");
    }
}
