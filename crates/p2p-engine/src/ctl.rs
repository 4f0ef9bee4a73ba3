//! A connection's control connection: TCP between hosts (`connect` /
//! `accept`), a Unix stream between endpoints of one machine
//! (`connect_local` / `accept_local`, whose data then rides the same-host
//! net). The engine reads and writes it alike either way.

use std::io::{self, IoSlice, Read, Write};
use std::net::{IpAddr, Ipv4Addr, Shutdown, SocketAddr, TcpStream};
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, RawFd};
use std::os::unix::net::UnixStream;
use std::time::Duration;

/// The socket a control connection runs on.
#[derive(Debug)]
pub(crate) enum Ctl {
    Tcp(TcpStream),
    Unix(UnixStream),
}

/// The address a Unix stream's peer is named by: this machine (it has no
/// IP address of its own).
const THIS_HOST: SocketAddr = SocketAddr::new(IpAddr::V4(Ipv4Addr::LOCALHOST), 0);

impl Ctl {
    pub(crate) fn try_clone(&self) -> io::Result<Ctl> {
        Ok(match self {
            Ctl::Tcp(s) => Ctl::Tcp(s.try_clone()?),
            Ctl::Unix(s) => Ctl::Unix(s.try_clone()?),
        })
    }

    /// The peer's address; a Unix stream's peer is this machine.
    pub(crate) fn peer_addr(&self) -> io::Result<SocketAddr> {
        match self {
            Ctl::Tcp(s) => s.peer_addr(),
            Ctl::Unix(_) => Ok(THIS_HOST),
        }
    }

    /// Our address; a Unix stream's is this machine.
    pub(crate) fn local_addr(&self) -> io::Result<SocketAddr> {
        match self {
            Ctl::Tcp(s) => s.local_addr(),
            Ctl::Unix(_) => Ok(THIS_HOST),
        }
    }

    /// TCP's no-delay; a Unix stream sends at once anyway.
    pub(crate) fn set_nodelay(&self, on: bool) -> io::Result<()> {
        match self {
            Ctl::Tcp(s) => s.set_nodelay(on),
            Ctl::Unix(_) => Ok(()),
        }
    }

    pub(crate) fn set_read_timeout(&self, t: Option<Duration>) -> io::Result<()> {
        match self {
            Ctl::Tcp(s) => s.set_read_timeout(t),
            Ctl::Unix(s) => s.set_read_timeout(t),
        }
    }

    pub(crate) fn set_write_timeout(&self, t: Option<Duration>) -> io::Result<()> {
        match self {
            Ctl::Tcp(s) => s.set_write_timeout(t),
            Ctl::Unix(s) => s.set_write_timeout(t),
        }
    }

    pub(crate) fn shutdown(&self, how: Shutdown) -> io::Result<()> {
        match self {
            Ctl::Tcp(s) => s.shutdown(how),
            Ctl::Unix(s) => s.shutdown(how),
        }
    }
}

impl Read for Ctl {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        match self {
            Ctl::Tcp(s) => s.read(buf),
            Ctl::Unix(s) => s.read(buf),
        }
    }
}

impl Write for Ctl {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        match self {
            Ctl::Tcp(s) => s.write(buf),
            Ctl::Unix(s) => s.write(buf),
        }
    }

    fn write_vectored(&mut self, bufs: &[IoSlice<'_>]) -> io::Result<usize> {
        match self {
            Ctl::Tcp(s) => s.write_vectored(bufs),
            Ctl::Unix(s) => s.write_vectored(bufs),
        }
    }

    fn flush(&mut self) -> io::Result<()> {
        Ok(())
    }
}

impl AsRawFd for Ctl {
    fn as_raw_fd(&self) -> RawFd {
        match self {
            Ctl::Tcp(s) => s.as_raw_fd(),
            Ctl::Unix(s) => s.as_raw_fd(),
        }
    }
}

impl AsFd for Ctl {
    fn as_fd(&self) -> BorrowedFd<'_> {
        match self {
            Ctl::Tcp(s) => s.as_fd(),
            Ctl::Unix(s) => s.as_fd(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn both_kinds_carry_bytes_and_name_their_peer() {
        let (a, b) = UnixStream::pair().unwrap();
        let (mut a, b) = (Ctl::Unix(a), Ctl::Unix(b));
        a.set_nodelay(true).unwrap();
        a.write_all(b"hello").unwrap();
        let mut got = [0u8; 5];
        b.try_clone().unwrap().read_exact(&mut got).unwrap();
        assert_eq!(&got, b"hello");
        assert_eq!(a.peer_addr().unwrap(), THIS_HOST);
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let t = Ctl::Tcp(TcpStream::connect(l.local_addr().unwrap()).unwrap());
        assert_eq!(t.peer_addr().unwrap(), l.local_addr().unwrap());
        b.shutdown(Shutdown::Both).unwrap();
        assert_eq!(
            a.read(&mut got).unwrap(),
            0,
            "the peer's shutdown reads as the end"
        );
    }
}
