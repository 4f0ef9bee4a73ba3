//! The OS edge of the same-host path: peer credentials of a Unix socket,
//! the peer process pinned by a pidfd ([`PeerProcess`]), cross-memory
//! attach (`process_vm_readv` / `process_vm_writev`, or the pinned
//! process's `/proc/<pid>/mem`) and the Yama ptrace permission it needs.
//! `unsafe` is allowed here only.
#![allow(unsafe_code)]

use std::fs::File;
use std::io;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::os::unix::fs::{FileExt, MetadataExt};
use std::os::unix::net::UnixStream;

/// The process at the other end of a Unix socket, as the kernel recorded it.
#[derive(Debug, Clone, Copy)]
pub struct PeerCred {
    pub pid: i32,
    pub uid: u32,
    pub gid: u32,
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
        gid: c.gid,
    })
}

pub fn my_uid() -> u32 {
    // SAFETY: getuid cannot fail.
    unsafe { libc::getuid() }
}

/// `SO_PEERPIDFD` (Linux 6.5): a pidfd of the socket's peer process, as
/// the kernel recorded it at connect (the value of the generic ABI).
const SO_PEERPIDFD: libc::c_int = 77;

/// What identifies a peer process to us: its user and group ids (real,
/// effective, saved, filesystem), the owner of its `/proc/<pid>` (root
/// when it is not dumpable, as after a setuid exec) and its executable
/// (device, inode; None where we may not look).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Ident {
    pub uids: [u32; 4],
    pub gids: [u32; 4],
    pub owner: (u32, u32),
    pub exe: Option<(u64, u64)>,
}

impl Ident {
    /// Whether a process of `uid` / `gid` could attach to this process
    /// itself (ptrace's rule without capabilities: every id its own, and
    /// dumpable).
    pub fn reachable_by(&self, uid: u32, gid: u32) -> bool {
        self.uids.iter().all(|&u| u == uid)
            && self.gids.iter().all(|&g| g == gid)
            && self.owner == (uid, gid)
    }
}

/// The `Uid:` / `Gid:` lines of a `/proc/<pid>/status`.
fn ids_of(status: &str, key: &str) -> io::Result<[u32; 4]> {
    let bad = || {
        io::Error::new(
            io::ErrorKind::InvalidData,
            format!("no {key} line in status"),
        )
    };
    let line = status
        .lines()
        .find_map(|l| l.strip_prefix(key))
        .ok_or_else(bad)?;
    let v: Vec<u32> = line
        .split_whitespace()
        .map(|x| x.parse().map_err(|_| bad()))
        .collect::<io::Result<_>>()?;
    v.try_into().map_err(|_| bad())
}

/// The peer process of a same-host connection, pinned to the process
/// (not its pid, which the kernel may give to another process once it
/// exits): its pidfd, its `/proc/<pid>` directory opened while the pidfd
/// showed it alive, the identity it had when it connected, and, where we
/// hold rights the peer lacks, its memory as it was then
/// (`/proc/<pid>/mem`, which an exec leaves behind).
pub struct PeerProcess {
    pub pid: i32,
    pidfd: OwnedFd,
    dir: File,
    pub ident: Ident,
    mem: Option<File>,
}

impl PeerProcess {
    /// Pins the process at the other end of `s`. `own_memory`: open its
    /// memory now for every later copy (the copies then reach the address
    /// space it had at this moment, never one an exec gives it).
    pub fn pin(s: &UnixStream, cred: &PeerCred, own_memory: bool) -> io::Result<PeerProcess> {
        let pidfd = peer_pidfd(s).or_else(|_| pidfd_open(cred.pid))?;
        let dir = File::open(format!("/proc/{}", cred.pid))?;
        let mem = if own_memory {
            Some(
                std::fs::OpenOptions::new()
                    .read(true)
                    .write(true)
                    .open(format!("/proc/self/fd/{}/mem", dir.as_raw_fd()))?,
            )
        } else {
            None
        };
        let mut p = PeerProcess {
            pid: cred.pid,
            pidfd,
            dir,
            ident: Ident {
                uids: [0; 4],
                gids: [0; 4],
                owner: (0, 0),
                exe: None,
            },
            mem,
        };
        // The directory (and memory) were opened by pid: they are this
        // process's only if it was still alive after they were opened.
        p.ident = p.read_ident(true)?;
        if !p.alive() {
            return Err(io::Error::new(
                io::ErrorKind::NotFound,
                format!("peer process {} exited", cred.pid),
            ));
        }
        Ok(p)
    }

    /// The process's identity now, read through its pinned directory;
    /// `full`: its ids too (`/proc/<pid>/status`, tens of microseconds),
    /// else the recorded ones stand in for them and only the owner of its
    /// directory (its effective ids, or root once it is not dumpable) and
    /// its executable are read (a few microseconds).
    fn read_ident(&self, full: bool) -> io::Result<Ident> {
        let (uids, gids) = if full {
            let status = io::read_to_string(self.open_at(c"status")?)?;
            (ids_of(&status, "Uid:")?, ids_of(&status, "Gid:")?)
        } else {
            (self.ident.uids, self.ident.gids)
        };
        let m = self.dir.metadata()?;
        Ok(Ident {
            uids,
            gids,
            owner: (m.uid(), m.gid()),
            exe: self.exe().ok(),
        })
    }

    /// A file of the pinned directory, looked up from it (one path step,
    /// where `/proc/self/fd/<n>/…` walks four and follows two links).
    fn open_at(&self, name: &std::ffi::CStr) -> io::Result<File> {
        // SAFETY: `name` is NUL-terminated; the descriptor returned is ours.
        let fd = unsafe {
            libc::openat(
                self.dir.as_raw_fd(),
                name.as_ptr(),
                libc::O_RDONLY | libc::O_CLOEXEC,
            )
        };
        if fd < 0 {
            return Err(io::Error::last_os_error());
        }
        // SAFETY: `fd` was just opened and is owned by nothing else.
        Ok(unsafe { File::from_raw_fd(fd) })
    }

    /// The device and inode of the process's executable, through its
    /// pinned directory's `exe` link.
    fn exe(&self) -> io::Result<(u64, u64)> {
        // SAFETY: stat is plain data, written whole by fstatat.
        let mut st: libc::stat = unsafe { std::mem::zeroed() };
        // SAFETY: the name is NUL-terminated, `st` is a valid stat buffer.
        let r = unsafe { libc::fstatat(self.dir.as_raw_fd(), c"exe".as_ptr(), &mut st, 0) };
        if r != 0 {
            return Err(io::Error::last_os_error());
        }
        Ok((st.st_dev, st.st_ino))
    }

    /// Whether the pinned process still runs (a zombie counts as gone).
    pub fn alive(&self) -> bool {
        self.signalable() && !self.zombie()
    }

    /// Whether the pinned process exists (a zombie does).
    fn signalable(&self) -> bool {
        // SAFETY: pidfd_send_signal with signal 0 only checks; no pointers
        // but a null siginfo.
        let r = unsafe {
            libc::syscall(
                libc::SYS_pidfd_send_signal,
                self.pidfd.as_raw_fd(),
                0,
                std::ptr::null::<libc::siginfo_t>(),
                0,
            )
        };
        r == 0
    }

    fn zombie(&self) -> bool {
        self.open_at(c"stat")
            .and_then(io::read_to_string)
            .ok()
            .and_then(|s| s.rsplit_once(") ").map(|(_, r)| r.starts_with('Z')))
            .unwrap_or(true)
    }

    /// Checks, before an access, that the pinned process still runs with
    /// the identity it connected with (not after an exec, not with other
    /// credentials); the reason when not. Where we hold rights the peer
    /// lacks (its memory is pinned), every id is read again; else its
    /// effective ids (through its directory's owner, root once it is not
    /// dumpable, as after a setuid exec) and executable are, and the
    /// kernel's own check on our copies covers the rest (an executable
    /// that still reads through the pinned directory tells a live process
    /// from a zombie or a reaped one, with no further call). About 3 µs.
    pub fn verify(&self) -> Result<(), String> {
        let full = self.mem.is_some();
        let now = self
            .read_ident(full)
            .map_err(|e| format!("peer process {} is gone ({e})", self.pid))?;
        let live = match (&now.exe, &self.ident.exe) {
            // Its executable still reads through its directory: it runs
            // (a zombie's, or a reaped process's, does not read).
            (Some(_), Some(_)) if !full => true,
            _ => self.alive(),
        };
        if !live {
            return Err(format!("peer process {} exited", self.pid));
        }
        if now != self.ident {
            return Err(format!(
                "peer process {} is no longer the process that connected (it ran exec or changed credentials: {:?} then, {:?} now); cross-memory access refused",
                self.pid, self.ident, now
            ));
        }
        Ok(())
    }

    /// Copies every span from the process into us (`pull`) or from us into
    /// it: through its pinned memory where we hold it, else by pid.
    ///
    /// # Safety
    /// As [`cma`].
    pub unsafe fn copy(&self, pull: bool, spans: &[Span]) -> io::Result<()> {
        match &self.mem {
            // SAFETY: by the caller's contract.
            None => unsafe { cma_parallel(self.pid, pull, spans) },
            Some(f) => {
                for s in spans {
                    let mut done: u64 = 0;
                    while done < s.len {
                        let n = (s.len - done).min(1 << 30) as usize;
                        let at = s.remote + done;
                        // SAFETY: by the caller's contract, `len` bytes at
                        // `local` are ours to write (pull) or read.
                        let k = unsafe {
                            if pull {
                                let b =
                                    std::slice::from_raw_parts_mut((s.local + done) as *mut u8, n);
                                f.read_at(b, at)
                            } else {
                                let b =
                                    std::slice::from_raw_parts((s.local + done) as *const u8, n);
                                f.write_at(b, at)
                            }
                        };
                        match k {
                            Ok(0) => {
                                return Err(io::Error::new(
                                    io::ErrorKind::UnexpectedEof,
                                    "the peer's address space is gone (it ran exec or exited)",
                                ))
                            }
                            Ok(k) => done += k as u64,
                            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                            Err(e) => return Err(e),
                        }
                    }
                }
                Ok(())
            }
        }
    }
}

fn peer_pidfd(s: &UnixStream) -> io::Result<OwnedFd> {
    let mut fd: libc::c_int = -1;
    let mut len = std::mem::size_of::<libc::c_int>() as libc::socklen_t;
    // SAFETY: the option writes at most `len` bytes into `fd`, an int.
    let r = unsafe {
        libc::getsockopt(
            s.as_raw_fd(),
            libc::SOL_SOCKET,
            SO_PEERPIDFD,
            &mut fd as *mut libc::c_int as *mut libc::c_void,
            &mut len,
        )
    };
    if r != 0 || fd < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: the kernel just gave us this descriptor; nothing else owns it.
    Ok(unsafe { OwnedFd::from_raw_fd(fd) })
}

fn pidfd_open(pid: i32) -> io::Result<OwnedFd> {
    // SAFETY: pidfd_open takes a pid and flags, no pointers.
    let fd = unsafe { libc::syscall(libc::SYS_pidfd_open, pid, 0) };
    if fd < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: as above: a fresh descriptor that nothing else owns.
    Ok(unsafe { OwnedFd::from_raw_fd(fd as libc::c_int) })
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

/// The cores the calling thread may run on, asked once per thread: the
/// standard library reads the cgroup's files on every call (seven reads
/// and three opens, tens of microseconds: more than a 4 KiB copy). Per
/// thread, because the answer is the thread's own affinity: an I/O worker
/// pinned to one core (pinned when it starts, before any copy) copies on
/// its own rather than splitting a copy onto that same core.
fn cpus() -> usize {
    thread_local! {
        static CPUS: usize = std::thread::available_parallelism().map_or(1, |n| n.get());
    }
    CPUS.with(|n| *n)
}

/// As [`cma`], split across up to four threads (the CPUs allowing) when the
/// request is large: one thread's page pinning and copying does not reach
/// the memory's bandwidth.
///
/// # Safety
/// As [`cma`].
pub unsafe fn cma_parallel(pid: i32, pull: bool, spans: &[Span]) -> io::Result<()> {
    let total: u64 = spans.iter().map(|s| s.len).sum();
    let cpus = cpus();
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
    fn a_pinned_peer_is_verified_and_a_changed_identity_refused() {
        let (a, _b) = UnixStream::pair().unwrap();
        let c = peer_cred(&a).unwrap();
        let mut p = PeerProcess::pin(&a, &c, true).unwrap();
        assert_eq!(p.pid, std::process::id() as i32);
        assert!(p.alive());
        assert_eq!(p.verify(), Ok(()));
        assert!(p.ident.exe.is_some());
        // Copies through the pinned memory land.
        let src: Vec<u8> = (0..70_000u32).map(|i| (i * 3) as u8).collect();
        let mut dst = vec![0u8; src.len()];
        let span = Span {
            local: dst.as_mut_ptr() as u64,
            remote: src.as_ptr() as u64,
            len: src.len() as u64,
        };
        // SAFETY: dst is ours and writable for its length.
        unsafe { p.copy(true, &[span]) }.unwrap();
        assert_eq!(dst, src);
        // What an exec or a setuid exec changes is refused.
        let real = p.ident.clone();
        for changed in [
            Ident {
                exe: Some((1, 1)),
                ..real.clone()
            },
            Ident {
                uids: [real.uids[0], real.uids[1] ^ 1, real.uids[2], real.uids[3]],
                ..real.clone()
            },
            Ident {
                owner: (0, 0),
                uids: [12345; 4],
                ..real.clone()
            },
        ] {
            p.ident = changed;
            let e = p.verify().unwrap_err();
            assert!(e.contains("no longer the process that connected"), "{e}");
        }
        p.ident = real.clone();
        // Without pinned memory (a peer of our uid), the quick check reads
        // the owner and the executable: what any exec changes.
        let mut q = PeerProcess::pin(&a, &c, false).unwrap();
        assert_eq!(q.verify(), Ok(()));
        let real = q.ident.clone();
        for changed in [
            Ident {
                exe: Some((1, 1)),
                ..real.clone()
            },
            Ident {
                owner: (real.owner.0 ^ 1, real.owner.1),
                ..real.clone()
            },
        ] {
            q.ident = changed;
            assert!(q.verify().is_err());
        }
        // Another uid could reach only a process all of its own.
        assert!(Ident {
            uids: [7; 4],
            gids: [8; 4],
            owner: (7, 8),
            exe: None
        }
        .reachable_by(7, 8));
        assert!(!Ident {
            uids: [7, 0, 0, 7],
            gids: [8; 4],
            owner: (0, 0),
            exe: None
        }
        .reachable_by(7, 8));
        assert!(!Ident {
            uids: [7; 4],
            gids: [8; 4],
            owner: (0, 0),
            exe: None
        }
        .reachable_by(7, 8));
    }

    #[test]
    fn status_ids() {
        let s = "Name:\tx\nUid:\t1000\t0\t0\t0\nGid:\t5\t5\t5\t5\n";
        assert_eq!(ids_of(s, "Uid:").unwrap(), [1000, 0, 0, 0]);
        assert_eq!(ids_of(s, "Gid:").unwrap(), [5; 4]);
        assert!(ids_of("Uid:\t1 2\n", "Uid:").is_err());
    }

    #[test]
    fn peer_cred_of_a_pair() {
        let (a, _b) = UnixStream::pair().unwrap();
        let c = peer_cred(&a).unwrap();
        assert_eq!(c.pid, std::process::id() as i32);
        assert_eq!(c.uid, my_uid());
    }
}

#[cfg(test)]
mod cost {
    use super::*;
    /// What the check before each access costs (printed).
    #[test]
    #[ignore = "a measurement: prints figures"]
    fn verify_cost() {
        let (a, _b) = UnixStream::pair().unwrap();
        let c = peer_cred(&a).unwrap();
        for full in [false, true] {
            let p = PeerProcess::pin(&a, &c, full).unwrap();
            let t = std::time::Instant::now();
            for _ in 0..2000 {
                p.verify().unwrap();
            }
            eprintln!("verify (all ids: {full}): {:?} each", t.elapsed() / 2000);
        }
    }
}
