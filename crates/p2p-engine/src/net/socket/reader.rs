//! Buffered reads of one stream, crediting lent payload bytes as they are
//! taken ([`super::splice`]).

use std::io::{self, IoSliceMut, Read};
use std::net::TcpStream;
use std::sync::Arc;
use std::time::{Duration, Instant};

use super::sockio::poll_readable;
use super::splice::CreditBack;
use super::READ_BUF;

/// Reads a stream through a buffer, so that headers and small payloads
/// cost one system call for many; large payloads are read in place.
pub(super) struct StreamReader {
    pub(super) s: Arc<TcpStream>,
    buf: Box<[u8]>,
    pos: usize,
    end: usize,
    /// How long to poll for bytes before a read that would block (zero:
    /// block at once). Set for the payload of a small message's first
    /// part, whose remainder is usually a few µs behind its start: a
    /// blocked reader's wake-up costs more than that.
    pub(super) spin: Duration,
    /// Credits owed for lent payload bytes (see [`super::splice`]).
    pub(super) credit: CreditBack,
    /// No byte for this long inside a read fails it (`WouldBlock`, which
    /// the net reports as the sender's stall); zero: never. The socket's
    /// own read timeout is short ([`super::sockio::LINGER_SLICE`]), so that
    /// a read inside a host part comes back to look whether to give its
    /// worker back; the other reads go on until this.
    stall: Duration,
}

/// Whether a read that failed with `e` timed out (the socket's read
/// timeout) rather than failed.
fn timed_out(e: &io::Error) -> bool {
    matches!(
        e.kind(),
        io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut
    )
}

impl StreamReader {
    pub(super) fn new(s: Arc<TcpStream>, stall: Duration) -> Self {
        StreamReader {
            s,
            buf: vec![0u8; READ_BUF].into_boxed_slice(),
            pos: 0,
            end: 0,
            spin: Duration::ZERO,
            credit: CreditBack::default(),
            stall,
        }
    }

    /// One read from the socket into `bufs` (blocking up to the socket's
    /// read timeout): the bytes read; `UnexpectedEof` at the peer's close;
    /// a timeout as `WouldBlock`.
    fn read_once(&mut self, bufs: &mut [IoSliceMut<'_>]) -> io::Result<usize> {
        loop {
            self.ready()?;
            match (&*self.s).read_vectored(bufs) {
                Ok(0) if bufs.iter().any(|b| !b.is_empty()) => {
                    return Err(io::ErrorKind::UnexpectedEof.into())
                }
                Ok(n) => return Ok(n),
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(e) if timed_out(&e) => return Err(io::ErrorKind::WouldBlock.into()),
                Err(e) => return Err(e),
            }
        }
    }

    /// As [`StreamReader::read_once`], going on through the socket's
    /// timeouts until a byte comes or the stall limit passes without one.
    fn read_blocking(&mut self, bufs: &mut [IoSliceMut<'_>]) -> io::Result<usize> {
        let since = Instant::now();
        loop {
            match self.read_once(bufs) {
                Err(e) if timed_out(&e) => {
                    if !self.stall.is_zero() && since.elapsed() >= self.stall {
                        return Err(e);
                    }
                }
                r => return r,
            }
        }
    }

    /// Before a read: credits what a read that blocks would leave owed,
    /// then polls (up to `spin`) until the socket has bytes to read.
    fn ready(&mut self) -> io::Result<()> {
        self.credit.before_read(&self.s)?;
        poll_readable(&self.s, self.spin);
        Ok(())
    }

    /// Reads from the socket into `dst` until it is full.
    fn fill(&mut self, mut dst: &mut [u8]) -> io::Result<()> {
        while !dst.is_empty() {
            let n = self.read_blocking(&mut [IoSliceMut::new(dst)])?;
            dst = &mut dst[n..];
            self.credit.taken(&self.s, n)?;
        }
        Ok(())
    }

    /// Reads a header: with `exact` and nothing buffered, only its bytes
    /// (one small read), else through the buffer.
    pub(super) fn read_head(&mut self, dst: &mut [u8], exact: bool) -> io::Result<()> {
        if exact && self.buffered() == 0 {
            return self.fill(dst);
        }
        self.read_exact(dst)
    }

    /// Fills `bufs` in order: buffered bytes first, then large remainders
    /// straight from the socket with one `readv` for many blocks.
    pub(super) fn read_into(&mut self, bufs: &mut [&mut [u8]]) -> io::Result<()> {
        let mut i = 0;
        while i < bufs.len() && self.pos < self.end {
            let n = bufs[i].len().min(self.end - self.pos);
            bufs[i][..n].copy_from_slice(&self.buf[self.pos..self.pos + n]);
            self.pos += n;
            self.credit.taken(&self.s, n)?;
            if n < bufs[i].len() {
                let rest = std::mem::take(&mut bufs[i]);
                bufs[i] = &mut rest[n..];
            } else {
                i += 1;
            }
        }
        let rest = &mut bufs[i..];
        let left: usize = rest.iter().map(|b| b.len()).sum();
        if left < READ_BUF / 4 {
            return rest.iter_mut().try_for_each(|b| self.read_exact(b));
        }
        let mut iov: Vec<IoSliceMut<'_>> = rest.iter_mut().map(|b| IoSliceMut::new(b)).collect();
        let mut iov = &mut iov[..];
        while !iov.is_empty() {
            let k = iov.len().min(1024);
            let n = self.read_blocking(&mut iov[..k])?;
            IoSliceMut::advance_slices(&mut iov, n);
            self.credit.taken(&self.s, n)?;
        }
        Ok(())
    }

    /// Fills `bufs` in order as far as bytes come: buffered bytes first,
    /// else one read, waiting at most the socket's read timeout (through
    /// the buffer when little is left, so that the next header comes with
    /// it; else in place, up to 1,024 pieces). The bytes taken, at least
    /// one; `WouldBlock` when none came, `UnexpectedEof` at the peer's
    /// close.
    pub(super) fn read_some(&mut self, bufs: &mut [&mut [u8]]) -> io::Result<usize> {
        let left: usize = bufs.iter().map(|b| b.len()).sum();
        if left == 0 {
            return Ok(0);
        }
        if self.pos == self.end && left < READ_BUF / 4 {
            self.refill(false)?;
        }
        if self.pos < self.end {
            let mut got = 0;
            for b in bufs.iter_mut() {
                let n = b.len().min(self.end - self.pos);
                b[..n].copy_from_slice(&self.buf[self.pos..self.pos + n]);
                self.pos += n;
                got += n;
                if self.pos == self.end {
                    break;
                }
            }
            self.credit.taken(&self.s, got)?;
            return Ok(got);
        }
        let mut iov: Vec<IoSliceMut<'_>> = bufs
            .iter_mut()
            .filter(|b| !b.is_empty())
            .take(1024)
            .map(|b| IoSliceMut::new(b))
            .collect();
        let n = self.read_once(&mut iov)?;
        self.credit.taken(&self.s, n)?;
        Ok(n)
    }

    /// Bytes read from the socket and not yet consumed.
    pub(super) fn buffered(&self) -> usize {
        self.end - self.pos
    }

    pub(super) fn read_exact(&mut self, mut dst: &mut [u8]) -> io::Result<()> {
        while !dst.is_empty() {
            if self.pos < self.end {
                let n = dst.len().min(self.end - self.pos);
                dst[..n].copy_from_slice(&self.buf[self.pos..self.pos + n]);
                self.pos += n;
                dst = &mut dst[n..];
                self.credit.taken(&self.s, n)?;
            } else if dst.len() >= READ_BUF / 4 {
                return self.fill(dst);
            } else {
                self.refill(true)?;
            }
        }
        Ok(())
    }

    /// Reads into the emptied buffer: one read (`blocking`: on through
    /// the socket's timeouts, as [`StreamReader::read_blocking`]).
    fn refill(&mut self, blocking: bool) -> io::Result<()> {
        let mut buf = std::mem::take(&mut self.buf);
        let got = if blocking {
            self.read_blocking(&mut [IoSliceMut::new(&mut buf)])
        } else {
            self.read_once(&mut [IoSliceMut::new(&mut buf)])
        };
        self.buf = buf;
        let n = got?;
        self.pos = 0;
        self.end = n;
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Write;
    use std::net::TcpListener;

    #[test]
    fn polling_reader_gets_a_payload_that_arrives_in_pieces() {
        // A small first part's reader polls between reads instead of
        // blocking; bytes that come late, in pieces, still all arrive in
        // order, through the buffer and in place, polling or not.
        for spin in [Duration::ZERO, Duration::from_millis(50)] {
            let l = TcpListener::bind("127.0.0.1:0").unwrap();
            let addr = l.local_addr().unwrap();
            let data: Vec<u8> = (0..200_000u32).map(|i| (i * 7 % 251) as u8).collect();
            let sent = data.clone();
            let writer = std::thread::spawn(move || {
                let mut w = TcpStream::connect(addr).unwrap();
                for piece in sent.chunks(70_000) {
                    w.write_all(piece).unwrap();
                    std::thread::sleep(Duration::from_millis(5));
                }
            });
            let (s, _) = l.accept().unwrap();
            let mut r = StreamReader::new(Arc::new(s), Duration::ZERO);
            r.spin = spin;
            let mut head = [0u8; 100];
            r.read_head(&mut head, true).unwrap();
            let mut small = vec![0u8; 1_000];
            r.read_exact(&mut small).unwrap();
            let mut rest = vec![0u8; data.len() - 1_100];
            r.read_into(&mut [&mut rest[..]]).unwrap();
            writer.join().unwrap();
            assert_eq!(&head[..], &data[..100]);
            assert_eq!(&small[..], &data[100..1_100]);
            assert!(rest == data[1_100..], "spin {spin:?}: payload differs");
        }
    }
}
