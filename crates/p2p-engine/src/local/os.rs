//! The OS edge of the same-host path: peer credentials of a Unix socket,
//! cross-memory attach (`process_vm_readv` / `process_vm_writev`) and the
//! Yama ptrace permission it needs. `unsafe` is allowed here only.
#![allow(unsafe_code)]

use std::io;
use std::os::fd::AsRawFd;
use std::os::unix::net::UnixStream;

/// The process at the other end of a Unix socket, as the kernel recorded it.
#[derive(Debug, Clone, Copy)]
pub struct PeerCred {
    pub pid: i32,
    pub uid: u32,
}

pub fn peer_cred(s: &UnixStream) -> io::Result<PeerCred> {
    let mut c = libc::ucred {
        pid: 0,
        uid: 0,
        gid: 0,
    };
    let mut len = std::mem::size_of::<libc::ucred>() as libc::socklen_t;
    // SAFETY: the option writes at most `len` bytes into `c`, a ucred.
    let r = unsafe {
        libc::getsockopt(
            s.as_raw_fd(),
            libc::SOL_SOCKET,
            libc::SO_PEERCRED,
            &mut c as *mut libc::ucred as *mut libc::c_void,
            &mut len,
        )
    };
    if r != 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(PeerCred {
        pid: c.pid,
        uid: c.uid,
    })
}

pub fn my_uid() -> u32 {
    // SAFETY: getuid cannot fail.
    unsafe { libc::getuid() }
}

/// The Yama ptrace scope (0 when Yama is absent).
pub fn ptrace_scope() -> u32 {
    std::fs::read_to_string("/proc/sys/kernel/yama/ptrace_scope")
        .ok()
        .and_then(|s| s.trim().parse().ok())
        .unwrap_or(0)
}

/// Lets `pid` attach to this process's memory where Yama restricts it
/// (scope 1). Yama keeps one such process per process: a second peer
/// widens it to any process of our uid, which the same-uid check on every
/// connection already bounds.
pub fn allow_peer(pid: i32) {
    use std::sync::atomic::{AtomicI32, Ordering};
    static ALLOWED: AtomicI32 = AtomicI32::new(0);
    if ptrace_scope() != 1 {
        return;
    }
    let prev = ALLOWED.load(Ordering::Acquire);
    let target = if prev == 0 || prev == pid {
        pid as libc::c_ulong
    } else {
        libc::PR_SET_PTRACER_ANY as libc::c_ulong
    };
    // SAFETY: prctl with PR_SET_PTRACER takes a pid (or ANY) and no pointers.
    let r = unsafe { libc::prctl(libc::PR_SET_PTRACER, target, 0, 0, 0) };
    if r != 0 {
        tracing::warn!(
            "prctl(PR_SET_PTRACER, {target}) failed: {}",
            io::Error::last_os_error()
        );
    } else {
        ALLOWED.store(
            if target == pid as libc::c_ulong {
                pid
            } else {
                -1
            },
            Ordering::Release,
        );
    }
}

/// One copy between our memory and the peer's: `len` bytes at our `local`
/// and the peer's `remote`.
#[derive(Debug, Clone, Copy)]
pub struct Span {
    pub local: u64,
    pub remote: u64,
    pub len: u64,
}

/// Copies every span from process `pid` into us (`pull`) or from us into it.
///
/// # Safety
/// Each span's `local` range must be memory of this process that may be
/// written (pull) or read for `len` bytes while the call runs. The remote
/// side is checked by the kernel: a bad remote address is an error.
pub unsafe fn cma(pid: i32, pull: bool, spans: &[Span]) -> io::Result<()> {
    for s in spans {
        let mut done: u64 = 0;
        while done < s.len {
            let n = (s.len - done) as usize;
            let l = libc::iovec {
                iov_base: (s.local + done) as *mut libc::c_void,
                iov_len: n,
            };
            let r = libc::iovec {
                iov_base: (s.remote + done) as *mut libc::c_void,
                iov_len: n,
            };
            // SAFETY: by the caller's contract for the local range; the
            // kernel checks the remote one.
            let k = unsafe {
                if pull {
                    libc::process_vm_readv(pid, &l, 1, &r, 1, 0)
                } else {
                    libc::process_vm_writev(pid, &l, 1, &r, 1, 0)
                }
            };
            if k < 0 {
                let e = io::Error::last_os_error();
                if e.kind() == io::ErrorKind::Interrupted {
                    continue;
                }
                return Err(e);
            }
            if k == 0 {
                return Err(io::Error::new(
                    io::ErrorKind::UnexpectedEof,
                    "cross-memory attach moved no bytes",
                ));
            }
            done += k as u64;
        }
    }
    Ok(())
}

/// Requests of at least this many bytes are copied by several threads.
const PARALLEL_MIN: u64 = 4 << 20;

/// As [`cma`], split across up to four threads (the CPUs allowing) when the
/// request is large: one thread's page pinning and copying does not reach
/// the memory's bandwidth.
///
/// # Safety
/// As [`cma`].
pub unsafe fn cma_parallel(pid: i32, pull: bool, spans: &[Span]) -> io::Result<()> {
    let total: u64 = spans.iter().map(|s| s.len).sum();
    let cpus = std::thread::available_parallelism().map_or(1, |n| n.get());
    let parts = cpus.min(4) as u64;
    if total < PARALLEL_MIN || parts < 2 {
        // SAFETY: by the caller's contract.
        return unsafe { cma(pid, pull, spans) };
    }
    // Cut the spans into `parts` groups of about equal bytes.
    let share = total.div_ceil(parts);
    let mut groups: Vec<Vec<Span>> = vec![Vec::new()];
    let mut room = share;
    for s in spans {
        let mut s = *s;
        while s.len > 0 {
            let n = s.len.min(room);
            if let Some(g) = groups.last_mut() {
                g.push(Span {
                    local: s.local,
                    remote: s.remote,
                    len: n,
                });
            }
            s.local += n;
            s.remote += n;
            s.len -= n;
            room -= n;
            if room == 0 {
                groups.push(Vec::new());
                room = share;
            }
        }
    }
    std::thread::scope(|sc| {
        let rest: Vec<_> = groups[1..]
            .iter()
            .filter(|g| !g.is_empty())
            .map(|g| {
                // SAFETY: each group is a disjoint part of the caller's spans.
                sc.spawn(move || unsafe { cma(pid, pull, g) })
            })
            .collect();
        // SAFETY: as above.
        let mut r = unsafe { cma(pid, pull, &groups[0]) };
        for h in rest {
            let x = h
                .join()
                .unwrap_or_else(|_| Err(io::Error::other("copy thread panicked")));
            if r.is_ok() {
                r = x;
            }
        }
        r
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cma_within_this_process() {
        let src: Vec<u8> = (0..100_000u32).map(|i| (i * 7) as u8).collect();
        let mut dst = vec![0u8; src.len()];
        let pid = std::process::id() as i32;
        let span = Span {
            local: dst.as_mut_ptr() as u64,
            remote: src.as_ptr() as u64,
            len: src.len() as u64,
        };
        // SAFETY: dst is ours and writable for its length.
        unsafe { cma(pid, true, &[span]) }.unwrap();
        assert_eq!(dst, src);
        let bad = Span {
            local: dst.as_mut_ptr() as u64,
            remote: 8,
            len: 8,
        };
        // SAFETY: as above; the remote address is invalid on purpose.
        assert!(unsafe { cma(pid, true, &[bad]) }.is_err());
    }

    #[test]
    fn parallel_cma_covers_every_byte() {
        let n = (9 << 20) + 4097;
        let src: Vec<u8> = (0..n as u32).map(|i| (i * 13 + 1) as u8).collect();
        let mut dst = vec![0u8; n];
        let pid = std::process::id() as i32;
        // Three spans of odd sizes, cut across the threads' shares.
        let cut = [0usize, 1 << 20, (5 << 20) + 3, n];
        let spans: Vec<Span> = cut
            .windows(2)
            .map(|w| Span {
                local: dst.as_mut_ptr() as u64 + w[0] as u64,
                remote: src.as_ptr() as u64 + w[0] as u64,
                len: (w[1] - w[0]) as u64,
            })
            .collect();
        // SAFETY: dst is ours and writable for its length.
        unsafe { cma_parallel(pid, true, &spans) }.unwrap();
        assert_eq!(dst, src);
    }

    #[test]
    fn peer_cred_of_a_pair() {
        let (a, _b) = UnixStream::pair().unwrap();
        let c = peer_cred(&a).unwrap();
        assert_eq!(c.pid, std::process::id() as i32);
        assert_eq!(c.uid, my_uid());
    }
}
