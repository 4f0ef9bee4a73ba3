//! System-call helpers on one TCP stream: socket options, vectored writes,
//! and whether bytes wait to be read.

use std::io::{self, IoSlice, Write};
use std::net::TcpStream;
use std::time::{Duration, Instant};

use super::NET;
use crate::error::NetError;
use crate::net::timing::{self, Spent};

/// A failed write on a stream, as the net reports it.
pub(super) fn write_err(e: io::Error) -> NetError {
    NetError::io(NET, "write", e)
}

/// A failed read on a stream, as the net reports it: the peer's close, or
/// the system call's error.
pub(super) fn read_err(e: io::Error) -> NetError {
    match e.kind() {
        io::ErrorKind::UnexpectedEof => NetError::Closed { net: NET },
        // The stream's read timeout (`SocketConfig::stall`) passed.
        io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut => NetError::Protocol {
            net: NET,
            reason: "the sender stalled inside a part: no byte came for the connection's deadline (TCPX_P2P_DEADLINE_MS)".into(),
        },
        _ => NetError::io(NET, "read", e),
    }
}

/// Writes every byte of `parts` with as few system calls as it takes.
pub(super) fn write_all_slices(s: &TcpStream, parts: &[&[u8]]) -> io::Result<()> {
    timing::mark(Spent::Other);
    let (mut idx, mut off) = (0, 0);
    while idx < parts.len() {
        if off == parts[idx].len() {
            idx += 1;
            off = 0;
            continue;
        }
        let iov: Vec<IoSlice<'_>> = std::iter::once(IoSlice::new(&parts[idx][off..]))
            .chain(parts[idx + 1..].iter().take(255).map(|p| IoSlice::new(p)))
            .collect();
        let mut n = (&*s).write_vectored(&iov)?;
        if n == 0 {
            return Err(io::ErrorKind::WriteZero.into());
        }
        while n > 0 && idx < parts.len() {
            let rem = parts[idx].len() - off;
            if n >= rem {
                n -= rem;
                idx += 1;
                off = 0;
            } else {
                off += n;
                n = 0;
            }
        }
    }
    timing::mark(Spent::Socket);
    timing::bytes(parts.iter().map(|p| p.len()).sum());
    Ok(())
}

/// Writes `parts` from byte `done` on (counting what it writes there)
/// without blocking: true once every byte is out, false when the socket
/// is full.
pub(super) fn write_slices_now(
    s: &TcpStream,
    parts: &[&[u8]],
    done: &mut usize,
) -> io::Result<bool> {
    let sock = socket2::SockRef::from(s);
    // Where byte `done` lies: slice `idx`, `off` bytes in.
    let (mut idx, mut off) = (0, *done);
    loop {
        while idx < parts.len() && off >= parts[idx].len() {
            off -= parts[idx].len();
            idx += 1;
        }
        if idx == parts.len() {
            return Ok(true);
        }
        let iov: Vec<IoSlice<'_>> = std::iter::once(IoSlice::new(&parts[idx][off..]))
            .chain(parts[idx + 1..].iter().take(1023).map(|p| IoSlice::new(p)))
            .collect();
        timing::mark(Spent::Other);
        let n = match sock.send_vectored_with_flags(&iov, libc::MSG_DONTWAIT | libc::MSG_NOSIGNAL) {
            Ok(0) => return Err(io::ErrorKind::WriteZero.into()),
            Ok(n) => n,
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => return Ok(false),
            Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
            Err(e) => return Err(e),
        };
        timing::mark(Spent::Socket);
        timing::bytes(n);
        *done += n;
        off += n;
    }
}

pub(super) use crate::workers::LINGER_SLICE;

/// Whether the socket has bytes waiting to be read.
pub(crate) fn readable_now(s: &impl std::os::fd::AsRawFd) -> bool {
    unread(s) > 0
}

/// How many bytes wait in the socket to be read (0 if it cannot tell).
pub(super) fn unread(s: &impl std::os::fd::AsRawFd) -> usize {
    let mut n: libc::c_int = 0;
    // SAFETY: FIONREAD writes one int through the pointer given.
    let r = unsafe { libc::ioctl(s.as_raw_fd(), libc::FIONREAD, &mut n) };
    if r == 0 {
        usize::try_from(n).unwrap_or(0)
    } else {
        0
    }
}

/// Spins until `s` has bytes to read or `spin` has passed (at once when
/// `spin` is zero).
pub(crate) fn poll_readable(s: &impl std::os::fd::AsRawFd, spin: Duration) {
    if spin.is_zero() {
        return;
    }
    let start = Instant::now();
    crate::spin::spin_while(|| !readable_now(s) && start.elapsed() < spin);
}

/// Waits up to `limit` for `s` to have bytes to read (or to be closed);
/// true if it has.
pub(crate) fn wait_readable(s: &impl std::os::fd::AsRawFd, limit: Duration) -> bool {
    wait_for(s, libc::POLLIN, limit)
}

/// Waits up to `limit` for `s` to be ready for `events` (`POLLIN`: bytes
/// to read or closed; `POLLOUT`: room to write); true if it is. A wait
/// that fails counts as ready (the read or write reports it); an
/// interrupted one starts again.
fn wait_for(s: &impl std::os::fd::AsRawFd, events: libc::c_short, limit: Duration) -> bool {
    let mut p = libc::pollfd {
        fd: s.as_raw_fd(),
        events,
        revents: 0,
    };
    let ts = libc::timespec {
        tv_sec: libc::time_t::try_from(limit.as_secs()).unwrap_or(libc::time_t::MAX),
        tv_nsec: limit.subsec_nanos() as _,
    };
    loop {
        // SAFETY: one pollfd, passed with its count; a valid timespec; no
        // signal mask.
        let r = unsafe { libc::ppoll(&mut p, 1, &ts, std::ptr::null()) };
        if r >= 0 {
            return r > 0;
        }
        if io::Error::last_os_error().kind() != io::ErrorKind::Interrupted {
            return true; // let the read report it
        }
    }
}

/// Waits up to `limit` for `s` to have bytes to read (or to be closed),
/// giving up early (false) once `give_up` says so: it is asked every
/// [`LINGER_SLICE`].
pub(crate) fn wait_readable_unless(
    s: &impl std::os::fd::AsRawFd,
    limit: Duration,
    give_up: impl Fn() -> bool,
) -> bool {
    wait_unless(s, libc::POLLIN, limit, give_up)
}

/// As [`wait_readable_unless`], for room to write.
pub(super) fn wait_writable_unless(
    s: &impl std::os::fd::AsRawFd,
    limit: Duration,
    give_up: impl Fn() -> bool,
) -> bool {
    wait_unless(s, libc::POLLOUT, limit, give_up)
}

/// A task's linger on its socket: waits up to `limit` for bytes to read
/// (or a close), given up as soon as other work waits for a worker, the
/// worker counting as free meanwhile ([`crate::workers::lingering`]);
/// true if they came.
pub(super) fn linger_readable(
    s: &impl std::os::fd::AsRawFd,
    limit: Duration,
    workers: &crate::workers::Workers,
) -> bool {
    crate::workers::lingering(|| wait_readable_unless(s, limit, || workers.work_waiting()))
}

/// As [`linger_readable`], for room to write.
pub(super) fn linger_writable(
    s: &impl std::os::fd::AsRawFd,
    limit: Duration,
    workers: &crate::workers::Workers,
) -> bool {
    crate::workers::lingering(|| wait_writable_unless(s, limit, || workers.work_waiting()))
}

fn wait_unless(
    s: &impl std::os::fd::AsRawFd,
    events: libc::c_short,
    limit: Duration,
    give_up: impl Fn() -> bool,
) -> bool {
    let until = Instant::now() + limit;
    loop {
        let left = until.saturating_duration_since(Instant::now());
        if left.is_zero() || give_up() {
            return wait_for(s, events, Duration::ZERO);
        }
        if wait_for(s, events, left.min(LINGER_SLICE)) {
            return true;
        }
    }
}

pub(super) fn tune(s: &TcpStream, sockbuf: usize) -> io::Result<()> {
    s.set_nodelay(true)?;
    if sockbuf > 0 {
        let s2 = socket2::SockRef::from(s);
        s2.set_send_buffer_size(sockbuf)?;
        s2.set_recv_buffer_size(sockbuf)?;
    }
    Ok(())
}
