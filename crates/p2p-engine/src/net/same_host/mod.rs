//! The same-host net: comms between two processes of one machine whose
//! bytes move with exactly one copy and never touch a socket. A [`Net`]
//! like `socket` and `plugin`: the engine posts sends and receives, matched
//! in posting order per comm, and tests them.
//!
//! **Channel.** Each comm is one Unix stream between the two processes. A
//! listen comm binds an abstract socket named `tcpx-p2p-net:<uid>:<name>`;
//! its handle carries the name and a random secret, and the connector
//! proves the secret in its first message (abstract names are visible to
//! every process; the handle travels over the connection's authenticated
//! control channel). Both sides read the other's pid and uid from the
//! kernel (`SO_PEERCRED`), never from its bytes, with the rules of the
//! same-host path (`docs/SAME_HOST.md`): the connector dials a name with
//! its own uid and refuses a listener of another uid whatever
//! `TCPX_P2P_LOCAL_ANY_UID` says; a peer of another uid is refused unless
//! that is set, and then only one its uid could attach to itself, whose
//! memory we open when it connects. The peer is pinned to its process by a
//! pidfd ([`os::PeerProcess`]) and checked before every cross-memory
//! access.
//!
//! **Data.** A sender publishes each send it posts on the channel
//! (`Send`: its segments, with the CUDA IPC export of each GPU one); the
//! receiver pairs it with its next posted receive. A send longer than its
//! receive fails both and moves nothing. Then the receiver, which alone
//! knows what it posted, makes the one copy into its own posted memory:
//! host from host by cross-memory attach (`process_vm_readv`, or the
//! pinned `/proc/<pid>/mem`), from GPU memory through the sender's
//! allocation opened once (cached) and `cuMemcpyAsync` on a copy stream;
//! and answers `Done`. Where only the sender can copy (its host memory
//! into the receiver's GPU memory), the receiver answers `Push` with the
//! exports of its own posted segments, the sender copies, and confirms
//! with `Pushed`. Every answer is checked against what this side posted
//! (the oldest open pair, its sequence number, its length); one that does
//! not fit is a protocol error and the comm fails.
//!
//! **Progress.** A comm's channel is read by a task on the I/O workers
//! (holding no thread while nothing comes, lingering a while after a
//! message as the socket net's streams do), which queues what it reads and
//! calls the engine's waker; the comm's own calls read the channel too,
//! under the same lock. The copies run inside the engine's calls (`irecv`
//! and `test`), on its progress task. The net needs no polling.
//!
//! **One-sided copies.** Beside the pairing, a receive comm pulls
//! (`ipull`: a copy from ranges the peer exported, for a write its target
//! copies or a read its reader copies) and a send comm pushes (`ipush`:
//! a copy into ranges the peer leased for writes, its `advertise_ipc`
//! records), each checked against the export it names, with no message
//! on the channel.
//!
//! **Who rides it.** Connections made by `connect_local` / `accept_local`
//! (their control connection the Unix stream of the same-host hello), and,
//! with `TCPX_P2P_SAME_HOST_NET=1`, connections made by `connect` /
//! `accept` between endpoints of this machine.

pub(crate) mod cuda;
pub(crate) mod os;
#[cfg(test)]
mod tests;

use std::collections::VecDeque;
use std::io::{ErrorKind, Read, Write};
use std::os::fd::AsRawFd;
use std::os::linux::net::SocketAddrExt;
use std::os::unix::net::{SocketAddr, UnixListener, UnixStream};
use std::sync::Arc;
use std::time::{Duration, Instant};

use super::{
    DeviceProps, ListenComm, MemRef, MrHandle, Net, NetHandle, RecvComm, RemoteRef, ReqId,
    SendComm, Waker,
};
use crate::error::NetError;
use crate::gpu;
use crate::memory::MemKind;
use crate::wire::same_host_net::{
    decode_pull_key, encode_pull_key, NetHandleV1, NetMsg, Seg, MAX_FRAME, MAX_SEGS,
};
use crate::workers::{Step, Task, Workers};

pub(crate) const NET: &str = "same-host";
/// Requests one comm may have in flight (as the socket net's).
const MAX_REQUESTS: usize = 256;
/// Sends a peer may publish ahead of our receives.
const MAX_OFFERS: usize = 2 * MAX_REQUESTS;
/// The request size connections on this net cut transfers into.
const CHUNK: usize = 1 << 30;
/// Connections a listen comm holds while waiting for their hello.
const MAX_WAITING: usize = 16;

/// Settings of the same-host net.
#[derive(Debug, Clone)]
pub struct SameHostConfig {
    /// Peers of another uid may connect (`TCPX_P2P_LOCAL_ANY_UID=1`).
    pub any_uid: bool,
    /// The endpoint's GPU: GPU copies run on it when set.
    pub gpu: Option<i32>,
    /// A connector must send its hello within this; a blocked write to the
    /// peer fails after it.
    pub timeout: Duration,
    /// A channel's reader keeps its worker this long after a message, so
    /// that a busy comm's next one finds it awake (`TCPX_P2P_IO_LINGER_MS`).
    pub linger: Duration,
    /// One-sided writes: the target copies straight from the writer's
    /// memory ([`Net::export`], [`RecvComm::ipull`]) rather than pairing
    /// a send with a receive (`TCPX_P2P_SAME_HOST_PULL=0` turns it off).
    pub pull: bool,
}

impl SameHostConfig {
    /// The settings the environment gives (`TCPX_P2P_LOCAL_ANY_UID`).
    pub fn from_env(gpu: Option<i32>, timeout: Duration, linger: Duration) -> Self {
        SameHostConfig {
            any_uid: std::env::var("TCPX_P2P_LOCAL_ANY_UID").is_ok_and(|v| v == "1"),
            gpu,
            timeout,
            linger,
            pull: std::env::var("TCPX_P2P_SAME_HOST_PULL").map_or(true, |v| v != "0"),
        }
    }
}

/// The net (see the module doc).
pub struct SameHostNet {
    cfg: SameHostConfig,
    /// Where the comms' channel readers run (made with the first comm
    /// when the net was not given the endpoint's).
    workers: parking_lot::Mutex<Option<Workers>>,
}

impl SameHostNet {
    pub fn new(cfg: SameHostConfig) -> Self {
        SameHostNet {
            cfg,
            workers: parking_lot::Mutex::new(None),
        }
    }

    /// A net whose channel readers run on `workers` (the endpoint's).
    pub(crate) fn with_workers(cfg: SameHostConfig, workers: Workers) -> Self {
        SameHostNet {
            cfg,
            workers: parking_lot::Mutex::new(Some(workers)),
        }
    }

    fn workers(&self) -> Result<Workers, NetError> {
        let mut w = self.workers.lock();
        if let Some(w) = &*w {
            return Ok(w.clone());
        }
        let made =
            Workers::new("tcpx-io", None).map_err(|e| NetError::io(NET, "starting workers", e))?;
        Ok(w.insert(made).clone())
    }

    fn listen_here(&self) -> Result<SameHostListen, NetError> {
        let uid = os::my_uid();
        let secret = random_secret();
        let mut tries = 0;
        loop {
            let name = random_secret();
            let addr = SocketAddr::from_abstract_name(listen_name(uid, name).as_bytes())
                .map_err(|e| NetError::io(NET, "naming the listener", e))?;
            match UnixListener::bind_addr(&addr) {
                Ok(l) => {
                    l.set_nonblocking(true)
                        .map_err(|e| NetError::io(NET, "listener", e))?;
                    return Ok(SameHostListen {
                        workers: self.workers()?,
                        handle: NetHandleV1 { name, secret, uid }.encode(),
                        secret,
                        listener: l,
                        waiting: VecDeque::new(),
                        cfg: self.cfg.clone(),
                        accepted: false,
                    });
                }
                Err(e) if e.kind() == ErrorKind::AddrInUse && tries < 8 => tries += 1,
                Err(e) => return Err(NetError::io(NET, "binding the listener", e)),
            }
        }
    }

    fn connect_here(&self, handle: &NetHandle, waker: Waker) -> Result<SameHostSend, NetError> {
        let h = NetHandleV1::decode(handle).map_err(|e| NetError::Protocol {
            net: NET,
            reason: format!("bad listen handle: {e}"),
        })?;
        // Our own uid, whatever the handle says: a listener of another uid
        // could only be a squatter on the name (refused in `admit`).
        let name = listen_name(os::my_uid(), h.name);
        let addr = SocketAddr::from_abstract_name(name.as_bytes())
            .map_err(|e| NetError::io(NET, "naming the listener", e))?;
        let s = UnixStream::connect_addr(&addr).map_err(|e| NetError::io(NET, "connect", e))?;
        let peer = admit(&s, true, &self.cfg)?;
        let mut ch = Chan::new(Framed::new(s), peer, &self.cfg, &self.workers()?, waker)?;
        ch.send(&NetMsg::Hello { secret: h.secret })?;
        Ok(SameHostSend {
            ch,
            next_seq: 0,
            next_push: 0,
            out: VecDeque::new(),
        })
    }
}

/// The endpoint's net for peers elsewhere, the same-host net for peers on
/// this machine: those whose control connection joins one address to
/// itself, or comes over loopback. Both ends of such a connection see the
/// same and choose alike (the handshake refuses a mismatch).
pub struct SameHostPaths {
    pub default: Arc<dyn Net>,
    pub same_host: Arc<dyn Net>,
}

impl super::DataPaths for SameHostPaths {
    fn default_net(&self) -> &Arc<dyn Net> {
        &self.default
    }

    fn choose(&self, peer: &super::PeerInfo) -> Arc<dyn Net> {
        let (a, b) = (peer.peer.ip(), peer.local.ip());
        if a == b || (a.is_loopback() && b.is_loopback()) {
            self.same_host.clone()
        } else {
            self.default.clone()
        }
    }
}

fn listen_name(uid: u32, name: u64) -> String {
    format!("tcpx-p2p-net:{uid}:{name:016x}")
}

/// 64 random bits from the kernel (the process's hashed counter if it
/// will not say).
fn random_secret() -> u64 {
    let mut b = [0u8; 8];
    match std::fs::File::open("/dev/urandom").and_then(|mut f| f.read_exact(&mut b)) {
        Ok(()) => u64::from_le_bytes(b),
        Err(_) => crate::memory::random_u64(),
    }
}

impl Net for SameHostNet {
    fn name(&self) -> &str {
        NET
    }

    fn devices(&self) -> Vec<DeviceProps> {
        vec![DeviceProps {
            name: "same-host".into(),
            pci_path: None,
            speed_mbps: 400_000,
            host_mem: true,
            cuda_mem: gpu::available(),
            max_comms: 65536,
        }]
    }

    fn listen(&self, _dev: usize) -> Result<Box<dyn ListenComm>, NetError> {
        Ok(Box::new(self.listen_here()?))
    }

    fn connect(
        &self,
        _dev: usize,
        handle: &NetHandle,
        waker: Waker,
    ) -> Result<Option<Box<dyn SendComm>>, NetError> {
        Ok(Some(Box::new(self.connect_here(handle, waker)?)))
    }

    fn needs_polling(&self) -> bool {
        false
    }

    fn max_requests(&self) -> usize {
        MAX_REQUESTS
    }

    fn max_segments(&self) -> usize {
        MAX_SEGS
    }

    /// One copy per request, whatever its size: cutting a transfer into
    /// requests only adds each one's round trip (256 MiB host memory in
    /// 8 MiB requests: 5.6 GB/s; in one: 8.7, as the copy alone).
    fn preferred_chunk(&self) -> Option<usize> {
        Some(CHUNK)
    }

    /// Host memory as it is (the peer reads it by cross-memory attach);
    /// GPU memory with its allocation's IPC handle (a peer in this process
    /// uses the address itself). None where CUDA gives no handle (memory
    /// of its virtual memory API): that write is sent instead.
    fn export(&self, mem: MemRef) -> Option<Vec<u8>> {
        if !self.cfg.pull {
            return None;
        }
        let export = match mem.kind {
            MemKind::Host => None,
            MemKind::Cuda(d) => match cuda::export(d, mem.addr, false) {
                Ok(e) => Some(e),
                Err(e) => {
                    tracing::debug!("no pull of GPU memory at {:#x}: {e}", mem.addr);
                    return None;
                }
            },
        };
        Some(encode_pull_key(&Seg {
            addr: mem.addr,
            len: mem.len as u64,
            export,
        }))
    }

    fn pulls(&self) -> bool {
        self.cfg.pull
    }
}

// ---------------------------------------------------------------- peers

/// The process at the other end of a comm's channel.
struct Peer {
    proc: os::PeerProcess,
    same_process: bool,
}

/// Checks the process at the other end of `s` against the same-host rules
/// and pins it (see the module doc). `dialed`: we connected to its name.
fn admit(s: &UnixStream, dialed: bool, cfg: &SameHostConfig) -> Result<Peer, NetError> {
    let refuse = |reason: String| NetError::Protocol { net: NET, reason };
    let cred = os::peer_cred(s).map_err(|e| NetError::io(NET, "SO_PEERCRED", e))?;
    let me = os::my_uid();
    if dialed && cred.uid != me {
        return Err(refuse(format!(
            "the process listening on our same-host name (pid {}) runs as uid {}, not ours ({me}): \
             another user took the name; refused",
            cred.pid, cred.uid
        )));
    }
    if cred.uid != me && !cfg.any_uid {
        return Err(refuse(format!(
            "peer process {} runs as uid {}, not ours ({me}); set TCPX_P2P_LOCAL_ANY_UID=1 to allow it",
            cred.pid, cred.uid
        )));
    }
    let other_uid = cred.uid != me;
    let proc = os::PeerProcess::pin(s, &cred, other_uid)
        .map_err(|e| refuse(format!("pinning peer process {}: {e}", cred.pid)))?;
    if other_uid && !proc.ident.reachable_by(cred.uid, cred.gid) {
        return Err(refuse(format!(
            "peer process {} of uid {} is not one that uid could attach to itself ({:?}: setuid \
             or not dumpable)",
            cred.pid, cred.uid, proc.ident
        )));
    }
    os::allow_peer(cred.pid);
    Ok(Peer {
        proc,
        same_process: cred.pid == std::process::id() as i32,
    })
}

// -------------------------------------------------------------- channel

/// Frames on a Unix stream (`u32` length, then a [`NetMsg`]), read without
/// blocking.
struct Framed {
    s: UnixStream,
    inbuf: Vec<u8>,
    /// Messages read and not yet taken (a hello's followers).
    early: Vec<NetMsg>,
    /// The peer closed its end.
    eof: bool,
}

impl Framed {
    fn new(s: UnixStream) -> Self {
        Framed {
            s,
            inbuf: Vec::new(),
            early: Vec::new(),
            eof: false,
        }
    }

    /// Every whole message that has arrived.
    fn ready(&mut self) -> Result<Vec<NetMsg>, NetError> {
        let mut out = std::mem::take(&mut self.early);
        let mut buf = [0u8; 16 << 10];
        while !self.eof {
            match recv_nowait(&self.s, &mut buf) {
                // A peer that closed with our messages unread resets.
                Ok(0) => self.eof = true,
                Err(e) if e.kind() == ErrorKind::ConnectionReset => self.eof = true,
                Ok(n) => {
                    self.inbuf.extend_from_slice(&buf[..n]);
                    self.parse(&mut out)?;
                }
                Err(e) if e.kind() == ErrorKind::WouldBlock => break,
                Err(e) if e.kind() == ErrorKind::Interrupted => {}
                Err(e) => return Err(NetError::io(NET, "recv", e)),
            }
        }
        Ok(out)
    }

    fn parse(&mut self, out: &mut Vec<NetMsg>) -> Result<(), NetError> {
        let mut at = 0;
        while self.inbuf.len() - at >= 4 {
            let mut n = [0u8; 4];
            n.copy_from_slice(&self.inbuf[at..at + 4]);
            let n = u32::from_le_bytes(n) as usize;
            if n > MAX_FRAME {
                return Err(NetError::Protocol {
                    net: NET,
                    reason: format!("a message of {n} bytes (at most {MAX_FRAME})"),
                });
            }
            if self.inbuf.len() - at < 4 + n {
                break;
            }
            let m = NetMsg::decode(&self.inbuf[at + 4..at + 4 + n]).map_err(|e| {
                NetError::Protocol {
                    net: NET,
                    reason: e.to_string(),
                }
            })?;
            out.push(m);
            at += 4 + n;
        }
        self.inbuf.drain(..at);
        Ok(())
    }
}

/// `recv(MSG_DONTWAIT)`: the stream stays blocking for writes.
#[allow(unsafe_code)] // system-call edge
fn recv_nowait(s: &UnixStream, buf: &mut [u8]) -> std::io::Result<usize> {
    // SAFETY: the kernel writes at most `buf.len()` bytes into `buf`.
    let r = unsafe {
        libc::recv(
            s.as_raw_fd(),
            buf.as_mut_ptr() as *mut libc::c_void,
            buf.len(),
            libc::MSG_DONTWAIT,
        )
    };
    if r < 0 {
        Err(std::io::Error::last_os_error())
    } else {
        Ok(r as usize)
    }
}

/// A comm's reading end and what was read of it and not yet taken. Both
/// the channel's reader task and the comm's own calls read it, under one
/// lock (so frames never interleave): a comm that the engine is testing
/// takes its peer's answer at once, without the hand-off through the
/// reader task.
struct Inbox {
    f: Framed,
    msgs: Vec<NetMsg>,
    /// The peer closed the channel.
    eof: bool,
    /// Reading failed (or the peer broke the framing).
    err: Option<NetError>,
}

impl Inbox {
    /// Reads what has arrived, without blocking.
    fn read(&mut self) {
        if self.eof || self.err.is_some() {
            return;
        }
        match self.f.ready() {
            Ok(ms) => self.msgs.extend(ms),
            Err(e) => self.err = Some(e),
        }
        self.eof |= self.f.eof;
    }
}

/// Reads a comm's channel on the I/O workers when it becomes readable:
/// queues each message and wakes the engine, then waits (no thread) for
/// the next.
struct ChanReader {
    inbox: Arc<parking_lot::Mutex<Inbox>>,
    fd: std::os::fd::RawFd,
    waker: Waker,
    linger: Duration,
}

impl Task for ChanReader {
    fn run(&mut self) -> Step {
        loop {
            let (news, done) = {
                let mut ib = self.inbox.lock();
                let before = ib.msgs.len();
                ib.read();
                let done = ib.eof || ib.err.is_some();
                (ib.msgs.len() > before || done, done)
            };
            if news {
                tracing::trace!("lat: same-host channel read");
                (self.waker)();
            }
            if done {
                return Step::Done;
            }
            // Linger: the next message of a busy comm comes soon, and
            // the hand-off through the poller costs tens of microseconds.
            if self.linger.is_zero() || !wait_readable(self.fd, self.linger) {
                return Step::Readable(self.fd);
            }
        }
    }
}

/// Waits up to `limit` for `fd` to have bytes to read (or to be closed);
/// true if it has.
#[allow(unsafe_code)] // system-call edge
fn wait_readable(fd: std::os::fd::RawFd, limit: Duration) -> bool {
    let mut p = libc::pollfd {
        fd,
        events: libc::POLLIN,
        revents: 0,
    };
    let ms = libc::c_int::try_from(limit.as_millis().max(1)).unwrap_or(libc::c_int::MAX);
    loop {
        // SAFETY: one pollfd, passed with its count.
        let r = unsafe { libc::poll(&mut p, 1, ms) };
        if r >= 0 {
            return r > 0;
        }
        if std::io::Error::last_os_error().kind() != ErrorKind::Interrupted {
            return true; // let the read report it
        }
    }
}

/// A comm's channel and its peer: the copies of either side.
struct Chan {
    /// The writing end (a clone of the stream the reader reads).
    s: UnixStream,
    inbox: Arc<parking_lot::Mutex<Inbox>>,
    /// The peer closed the channel (taken from the inbox).
    eof: bool,
    /// The pool the reader runs on (kept while the comm lives).
    _workers: Workers,
    peer: Peer,
    gpu: Option<i32>,
    imports: cuda::Imports,
    /// Set once the comm failed: every later call reports it.
    failed: Option<NetError>,
}

/// One piece of a copy: `len` bytes between our address `local` (of
/// `local_kind`) and the peer's segment `remote` at offset `at` in it.
#[derive(Debug, Clone, Copy)]
struct Piece {
    local: u64,
    local_kind: MemKind,
    remote: usize,
    at: u64,
    len: u64,
}

/// Cuts `len` bytes over our segments and the peer's into pieces that
/// each lie in one segment of both.
fn pieces(ours: &[MemRef], theirs: &[Seg], len: u64) -> Vec<Piece> {
    let mut out = Vec::new();
    let (mut i, mut io) = (0usize, 0u64);
    let (mut j, mut jo) = (0usize, 0u64);
    let mut left = len;
    while left > 0 && i < ours.len() && j < theirs.len() {
        let a = ours[i].len as u64 - io;
        let b = theirs[j].len - jo;
        let n = a.min(b).min(left);
        if n > 0 {
            out.push(Piece {
                local: ours[i].addr + io,
                local_kind: ours[i].kind,
                remote: j,
                at: jo,
                len: n,
            });
        }
        io += n;
        jo += n;
        left -= n;
        if io == ours[i].len as u64 {
            i += 1;
            io = 0;
        }
        if jo == theirs[j].len {
            j += 1;
            jo = 0;
        }
    }
    out
}

/// A pull or push takes 1 to [`MAX_SEGS`] segments of ours and pieces of the
/// peer's.
fn pull_counts(segs: &[MemRef], refs: &[RemoteRef]) -> Result<(), NetError> {
    if segs.is_empty() || segs.len() > MAX_SEGS || refs.is_empty() || refs.len() > MAX_SEGS {
        return Err(NetError::Misuse {
            net: NET,
            reason: format!(
                "a one-sided copy between {} segments and {} pieces of the peer's (1 to {MAX_SEGS} each)",
                segs.len(),
                refs.len()
            ),
        });
    }
    Ok(())
}

fn total(segs: &[MemRef]) -> u64 {
    segs.iter().map(|m| m.len as u64).sum()
}

impl Chan {
    /// A comm's channel over `f` (with what was read of it already),
    /// its reader started on `workers`.
    fn new(
        f: Framed,
        peer: Peer,
        cfg: &SameHostConfig,
        workers: &Workers,
        waker: Waker,
    ) -> Result<Self, NetError> {
        let s =
            f.s.try_clone()
                .map_err(|e| NetError::io(NET, "channel", e))?;
        s.set_write_timeout(Some(cfg.timeout))
            .map_err(|e| NetError::io(NET, "channel", e))?;
        let fd = f.s.as_raw_fd();
        let inbox = Arc::new(parking_lot::Mutex::new(Inbox {
            f,
            msgs: Vec::new(),
            eof: false,
            err: None,
        }));
        // The reader starts at once: bytes may wait already. It ends when
        // the channel closes (the comm shuts it down when dropped).
        workers.start(Box::new(ChanReader {
            inbox: inbox.clone(),
            fd,
            waker,
            linger: cfg.linger,
        }));
        Ok(Chan {
            s,
            inbox,
            eof: false,
            _workers: workers.clone(),
            peer,
            gpu: cfg.gpu,
            imports: cuda::Imports::default(),
            failed: None,
        })
    }

    fn send(&mut self, m: &NetMsg) -> Result<(), NetError> {
        let mut b = vec![0u8; 4];
        m.encode(&mut b);
        let n = (b.len() - 4) as u32;
        b[..4].copy_from_slice(&n.to_le_bytes());
        self.s
            .write_all(&b)
            .map_err(|e| NetError::io(NET, "send", e))
    }

    /// What has arrived: what the reader queued, and what waits on the
    /// channel now.
    fn take(&mut self) -> Result<Vec<NetMsg>, NetError> {
        let mut ib = self.inbox.lock();
        ib.read();
        self.eof |= ib.eof;
        if let Some(e) = ib.err.take() {
            return Err(e);
        }
        Ok(std::mem::take(&mut ib.msgs))
    }

    /// Ends the comm with `e` (its later calls report it) and tells the
    /// peer by closing the channel (which ends the reader too).
    fn fail(&mut self, e: NetError) -> NetError {
        let _ = self.s.shutdown(std::net::Shutdown::Both);
        self.failed.get_or_insert(e).clone()
    }

    fn check(&self) -> Result<(), NetError> {
        match &self.failed {
            Some(e) => Err(e.clone()),
            None => Ok(()),
        }
    }

    /// The peer's segments that the pieces `refs` name, for a pull into
    /// `ours`: each piece inside what the peer exported,
    /// together exactly as long as `ours`. A key that is no export is a
    /// breach (fatal); a piece past its export, or a length that differs,
    /// a refusal.
    fn remote_segs(&self, ours: &[MemRef], refs: &[RemoteRef]) -> Result<Vec<Seg>, (String, bool)> {
        let mut theirs = Vec::with_capacity(refs.len());
        for (i, r) in refs.iter().enumerate() {
            let seg = decode_pull_key(&r.key)
                .map_err(|e| (format!("piece {i}: the peer's key: {e}"), true))?;
            if r.off.checked_add(r.len).is_none_or(|end| end > seg.len) {
                return Err((
                    format!(
                        "piece {i}: {} bytes at {} of a range the peer exported with {} \
                         (its request's runs and ours differ)",
                        r.len, r.off, seg.len
                    ),
                    false,
                ));
            }
            let export = seg.export.map(|mut e| {
                e.offset = e.offset.wrapping_add(r.off);
                if self.peer.same_process {
                    // One process: the address itself (its handle cannot
                    // be opened where it was made).
                    e.direct = seg.addr + r.off;
                }
                e
            });
            theirs.push(Seg {
                addr: seg.addr + r.off,
                len: r.len,
                export,
            });
        }
        let len: u64 = theirs.iter().map(|s| s.len).sum();
        let room = total(ours);
        if len != room {
            return Err((
                format!("{len} bytes of the peer's against {room} bytes of ours"),
                false,
            ));
        }
        Ok(theirs)
    }

    /// A pull into `ours` from the peer's pieces `refs` (or, `pull`
    /// false, a push of `ours` into them), made now: the request's state,
    /// done or refused. A breach (see [`Chan::remote_segs`],
    /// [`Chan::copy`]) ends the comm.
    fn one_sided(
        &mut self,
        pull: bool,
        ours: &[MemRef],
        refs: &[RemoteRef],
    ) -> Result<St, NetError> {
        let len = total(ours);
        tracing::trace!(len, pull, "lat: same-host one-sided copy");
        let copied = self
            .remote_segs(ours, refs)
            .and_then(|theirs| self.copy(pull, ours, &theirs, len));
        match copied {
            Ok(()) => {
                tracing::trace!(len, pull, "lat: same-host one-sided copy done");
                Ok(St::Done(len as usize))
            }
            Err((reason, true)) => Err(self.fail(protocol(reason))),
            Err((reason, false)) => Ok(St::Failed(reason)),
        }
    }

    /// How the peer maps our segments (GPU ones exported).
    fn publish(&self, segs: &[MemRef]) -> Result<Vec<Seg>, NetError> {
        segs.iter()
            .map(|m| {
                let export = match m.kind {
                    MemKind::Host => None,
                    MemKind::Cuda(d) => Some(cuda::export(d, m.addr, self.peer.same_process)?),
                };
                Ok(Seg {
                    addr: m.addr,
                    len: m.len as u64,
                    export,
                })
            })
            .collect()
    }

    /// The one copy of `len` bytes between our segments and the peer's
    /// published ones: into ours (`pull`) or out of them. Host to host by
    /// cross-memory attach, after checking the peer is still the process
    /// that connected; anything with GPU memory through the peer's
    /// allocation mapped here. Err(refusal, fatal): fatal ends the comm.
    #[allow(unsafe_code)] // raw-memory edge: copies between checked ranges
    fn copy(
        &mut self,
        pull: bool,
        ours: &[MemRef],
        theirs: &[Seg],
        len: u64,
    ) -> Result<(), (String, bool)> {
        let ps = pieces(ours, theirs, len);
        let mut spans = Vec::new();
        let mut copies = Vec::new();
        let mut keep = Vec::new();
        let mut dev = self.gpu.filter(|_| gpu::available());
        for p in &ps {
            let seg = &theirs[p.remote];
            match (&seg.export, p.local_kind) {
                (None, MemKind::Host) => spans.push(os::Span {
                    local: p.local,
                    remote: seg.addr + p.at,
                    len: p.len,
                }),
                // Only a push meets this (a receive mixing host and GPU
                // memory, fed from both): the pair fails, the comm lives.
                (None, MemKind::Cuda(_)) => {
                    return Err((
                        "a request moving host memory into the peer's GPU memory and GPU \
                         memory into its host memory at once"
                            .into(),
                        false,
                    ))
                }
                (Some(e), kind) => {
                    if e.direct != 0 && !self.peer.same_process {
                        return Err((
                            "the peer sent a same-process address from another process".into(),
                            true,
                        ));
                    }
                    let d = dev
                        .or(match kind {
                            MemKind::Cuda(d) => Some(d),
                            MemKind::Host => None,
                        })
                        .unwrap_or(e.gpu);
                    dev = Some(d);
                    let m = self
                        .imports
                        .open(d, e)
                        .map_err(|err| (format!("opening the peer's GPU memory: {err}"), false))?;
                    // The peer's range must lie inside what CUDA mapped.
                    let off = e.offset.checked_add(p.at);
                    if off
                        .and_then(|o| o.checked_add(p.len))
                        .is_none_or(|end| end > m.size)
                    {
                        return Err((
                            format!(
                                "the peer's export ({} bytes at offset {}) lies outside its \
                                 {}-byte allocation",
                                p.len, e.offset, m.size
                            ),
                            true,
                        ));
                    }
                    let remote = m.base.wrapping_add(e.offset + p.at);
                    copies.push(cuda::Copy::between(p.local, remote, p.len, pull));
                    keep.push(m);
                }
            }
        }
        if !spans.is_empty() {
            self.peer.proc.verify().map_err(|e| (e, true))?;
            // SAFETY: each local range is one of the segments the engine
            // posted on this comm (it keeps them valid until the request
            // completes); the kernel checks the peer's.
            unsafe { self.peer.proc.copy(pull, &spans) }.map_err(|e| {
                let hint = match e.raw_os_error() {
                    Some(libc::EPERM) => " (ptrace permission: see kernel.yama.ptrace_scope)",
                    Some(libc::EFAULT) => " (the peer's address is not host memory of the peer)",
                    _ => "",
                };
                (
                    format!(
                        "cross-memory attach with process {}: {e}{hint}",
                        self.peer.proc.pid
                    ),
                    false,
                )
            })?;
        }
        if let (false, Some(d)) = (copies.is_empty(), dev) {
            // SAFETY: our ranges are posted segments, the peer's lie inside
            // its mapped allocations (checked above), held in `keep`.
            unsafe { cuda::run(d, &copies) }.map_err(|e| (format!("CUDA copy: {e}"), false))?;
        }
        drop(keep);
        Ok(())
    }
}

impl Drop for Chan {
    /// The peer sees the comm end, and the reader its channel close.
    fn drop(&mut self) {
        let _ = self.s.shutdown(std::net::Shutdown::Both);
    }
}

// ------------------------------------------------------------- listening

struct SameHostListen {
    workers: Workers,
    handle: NetHandle,
    secret: u64,
    listener: UnixListener,
    /// Connections waiting for their hello, and when they must have sent it.
    waiting: VecDeque<(Framed, Instant)>,
    cfg: SameHostConfig,
    accepted: bool,
}

impl ListenComm for SameHostListen {
    fn handle(&self) -> NetHandle {
        self.handle
    }

    fn accept(&mut self, waker: Waker) -> Result<Option<Box<dyn RecvComm>>, NetError> {
        Ok(self
            .accept_here(waker)?
            .map(|r| Box::new(r) as Box<dyn RecvComm>))
    }
}

impl SameHostListen {
    /// The receive comm once a connector has proved the handle's secret;
    /// others are dropped (a process that found the name cannot take the
    /// comm).
    fn accept_here(&mut self, waker: Waker) -> Result<Option<SameHostRecv>, NetError> {
        if self.accepted {
            return Err(NetError::Misuse {
                net: NET,
                reason: "accept on a listen comm that has accepted".into(),
            });
        }
        loop {
            match self.listener.accept() {
                Ok((s, _)) => {
                    if self.waiting.len() >= MAX_WAITING {
                        self.waiting.pop_front();
                    }
                    self.waiting
                        .push_back((Framed::new(s), Instant::now() + self.cfg.timeout));
                }
                Err(e) if e.kind() == ErrorKind::WouldBlock => break,
                Err(e) if e.kind() == ErrorKind::Interrupted => {}
                Err(e) => return Err(NetError::io(NET, "accept", e)),
            }
        }
        let now = Instant::now();
        let mut i = 0;
        while i < self.waiting.len() {
            let (f, deadline) = &mut self.waiting[i];
            let hello = match f.ready() {
                Ok(mut ms) if !ms.is_empty() => {
                    let first = ms.remove(0);
                    f.early = ms;
                    Some(first)
                }
                Ok(_) => None,
                Err(_) => {
                    self.waiting.remove(i);
                    continue;
                }
            };
            match hello {
                Some(NetMsg::Hello { secret }) if secret == self.secret => {
                    let Some((f, _)) = self.waiting.remove(i) else {
                        break;
                    };
                    let peer = match admit(&f.s, false, &self.cfg) {
                        Ok(p) => p,
                        Err(e) => {
                            tracing::warn!("same-host net: connection refused: {e}");
                            continue;
                        }
                    };
                    // What came after the hello is the reader's to give.
                    let ch = Chan::new(f, peer, &self.cfg, &self.workers, waker)?;
                    self.accepted = true;
                    self.waiting.clear();
                    return Ok(Some(SameHostRecv {
                        ch,
                        next_id: 0,
                        expect_seq: 0,
                        posted: VecDeque::new(),
                        offers: VecDeque::new(),
                    }));
                }
                Some(_) => {
                    tracing::warn!("same-host net: a connection without the handle's secret");
                    self.waiting.remove(i);
                }
                None if f.eof || *deadline <= now => {
                    self.waiting.remove(i);
                }
                None => i += 1,
            }
        }
        Ok(None)
    }
}

// ---------------------------------------------------------------- sending

/// Where a posted request stands.
#[derive(Debug, Clone)]
enum St {
    /// Published; the peer has not answered.
    Waiting,
    /// Receive side: the peer is copying into it (after our `Push`).
    Pushing {
        seq: u64,
        len: u64,
    },
    Done(usize),
    Failed(String),
}

/// Whether request `req` of `q` has ended (done or failed).
fn ended<T>(q: &VecDeque<T>, key: impl Fn(&T) -> (u64, &St), req: ReqId) -> bool {
    q.iter().any(|e| {
        let (id, st) = key(e);
        id == req.0 && matches!(st, St::Done(_) | St::Failed(_))
    })
}

/// `test` of request `req` in a comm's queue of `kind` (`key` gives an
/// entry's id and state): its byte count once done, its failure (reported
/// as `failed()` failed), or nothing yet; an ended request leaves the queue.
fn take_ended<T>(
    q: &mut VecDeque<T>,
    key: impl Fn(&T) -> (u64, &St),
    req: ReqId,
    kind: &str,
    failed: impl FnOnce() -> String,
) -> Result<Option<usize>, NetError> {
    let Some(i) = q.iter().position(|e| key(e).0 == req.0) else {
        return Err(NetError::Misuse {
            net: NET,
            reason: format!("test of an unknown {kind} {}", req.0),
        });
    };
    let ended = match key(&q[i]).1 {
        St::Done(n) => Ok(Some(*n)),
        St::Failed(why) => Err(protocol(format!("{} failed: {why}", failed()))),
        St::Waiting | St::Pushing { .. } => return Ok(None),
    };
    q.remove(i);
    ended
}

struct Out {
    seq: u64,
    segs: Vec<MemRef>,
    len: u64,
    st: St,
}

struct SameHostSend {
    ch: Chan,
    next_seq: u64,
    /// The next push's id ([`PUSH_ID`] marks them apart from the sends'
    /// sequence numbers, which the receiver counts).
    next_push: u64,
    out: VecDeque<Out>,
}

/// The bit that marks a push's request id.
const PUSH_ID: u64 = 1 << 63;

fn protocol(reason: String) -> NetError {
    NetError::Protocol { net: NET, reason }
}

impl SameHostSend {
    /// Takes in the receiver's answers.
    fn pump(&mut self) -> Result<(), NetError> {
        self.ch.check()?;
        let msgs = match self.ch.take() {
            Ok(m) => m,
            Err(e) => return Err(self.ch.fail(e)),
        };
        for m in msgs {
            if let Err(e) = self.on_msg(m) {
                return Err(self.ch.fail(e));
            }
        }
        if self.ch.eof && self.out.iter().any(|o| matches!(o.st, St::Waiting)) {
            return Err(self.ch.fail(NetError::Closed { net: NET }));
        }
        Ok(())
    }

    fn on_msg(&mut self, m: NetMsg) -> Result<(), NetError> {
        // Answers come in posting order: each is for the oldest send not
        // yet answered.
        let head = self.out.iter_mut().find(|o| matches!(o.st, St::Waiting));
        let (seq, want) = match &m {
            NetMsg::Done { seq, .. } | NetMsg::Refused { seq, .. } | NetMsg::Push { seq, .. } => {
                (*seq, head.as_ref().map(|o| o.seq))
            }
            other => return Err(protocol(format!("a receiver sent {}", kind(other)))),
        };
        let Some(o) = head.filter(|_| want == Some(seq)) else {
            return Err(protocol(format!(
                "an answer for send {seq}, the oldest open one is {want:?}"
            )));
        };
        match m {
            NetMsg::Done { len, .. } if len == o.len => {
                tracing::trace!(seq, "lat: same-host send done");
                o.st = St::Done(len as usize)
            }
            NetMsg::Done { len, .. } => {
                return Err(protocol(format!(
                    "send {seq} of {} bytes reported done with {len}",
                    o.len
                )))
            }
            NetMsg::Refused { reason, .. } => o.st = St::Failed(reason),
            NetMsg::Push { segs, .. } => {
                let room: u64 = segs.iter().map(|s| s.len).sum();
                if room < o.len {
                    return Err(protocol(format!(
                        "a push target of {room} bytes for a send of {}",
                        o.len
                    )));
                }
                let (segs_out, len) = (o.segs.clone(), o.len);
                match self.ch.copy(false, &segs_out, &segs, len) {
                    Ok(()) => {
                        self.ch.send(&NetMsg::Pushed { seq })?;
                        if let Some(o) = self.out.iter_mut().find(|o| o.seq == seq) {
                            o.st = St::Done(len as usize);
                        }
                    }
                    Err((reason, fatal)) => {
                        self.ch.send(&NetMsg::Refused {
                            seq,
                            reason: reason.clone(),
                        })?;
                        if fatal {
                            return Err(protocol(reason));
                        }
                        if let Some(o) = self.out.iter_mut().find(|o| o.seq == seq) {
                            o.st = St::Failed(reason);
                        }
                    }
                }
            }
            _ => {}
        }
        Ok(())
    }
}

fn kind(m: &NetMsg) -> &'static str {
    match m {
        NetMsg::Hello { .. } => "a hello",
        NetMsg::Send { .. } => "a send",
        NetMsg::Done { .. } => "a completion",
        NetMsg::Refused { .. } => "a refusal",
        NetMsg::Push { .. } => "a push",
        NetMsg::Pushed { .. } => "a pushed",
    }
}

impl SendComm for SameHostSend {
    fn isend(&mut self, mem: MemRef, mr: MrHandle) -> Result<Option<ReqId>, NetError> {
        self.isendv(&[mem], &[mr])
    }

    fn isendv(&mut self, segs: &[MemRef], _mrs: &[MrHandle]) -> Result<Option<ReqId>, NetError> {
        self.pump()?;
        if segs.is_empty() || segs.len() > MAX_SEGS {
            return Err(NetError::Misuse {
                net: NET,
                reason: format!("a send of {} segments (1 to {MAX_SEGS})", segs.len()),
            });
        }
        if self.out.len() >= MAX_REQUESTS {
            return Ok(None);
        }
        let seq = self.next_seq;
        let published = self.ch.publish(segs)?;
        if let Err(e) = self.ch.send(&NetMsg::Send {
            seq,
            segs: published,
        }) {
            return Err(self.ch.fail(e));
        }
        tracing::trace!(seq, "lat: same-host send published");
        self.next_seq += 1;
        self.out.push_back(Out {
            seq,
            segs: segs.to_vec(),
            len: total(segs),
            st: St::Waiting,
        });
        Ok(Some(ReqId(seq)))
    }

    /// The copy is made here, at once, as a pull's is; the request is then
    /// done (or failed) when tested. The peer sees nothing of it: the
    /// engine pushes only into what the peer leased for writes.
    fn ipush(&mut self, segs: &[MemRef], dst: &[RemoteRef]) -> Result<Option<ReqId>, NetError> {
        self.ch.check()?;
        pull_counts(segs, dst)?;
        if self.out.len() >= MAX_REQUESTS {
            return Ok(None);
        }
        let st = self.ch.one_sided(false, segs, dst)?;
        let id = PUSH_ID | self.next_push;
        self.next_push += 1;
        self.out.push_back(Out {
            seq: id,
            segs: segs.to_vec(),
            len: total(segs),
            st,
        });
        Ok(Some(ReqId(id)))
    }

    fn test(&mut self, req: ReqId) -> Result<Option<usize>, NetError> {
        // A push ended when it was posted: nothing of the peer's is needed
        // to tell (its messages wait for the next test that needs them).
        if ended(&self.out, |o| (o.seq, &o.st), req) {
            self.ch.check()?;
        } else {
            self.pump()?;
        }
        take_ended(
            &mut self.out,
            |o| (o.seq, &o.st),
            req,
            "send",
            || format!("send {}", req.0),
        )
    }
}

// -------------------------------------------------------------- receiving

struct In {
    id: u64,
    segs: Vec<MemRef>,
    st: St,
}

struct SameHostRecv {
    ch: Chan,
    next_id: u64,
    /// The sequence number the sender's next publication must carry.
    expect_seq: u64,
    posted: VecDeque<In>,
    /// Sends published and not yet paired with a receive, in order.
    offers: VecDeque<(u64, Vec<Seg>)>,
}

impl SameHostRecv {
    /// Takes in the sender's messages and pairs sends with receives.
    fn pump(&mut self) -> Result<(), NetError> {
        self.ch.check()?;
        let msgs = match self.ch.take() {
            Ok(m) => m,
            Err(e) => return Err(self.ch.fail(e)),
        };
        for m in msgs {
            if let Err(e) = self.on_msg(m) {
                return Err(self.ch.fail(e));
            }
        }
        if let Err(e) = self.pair() {
            return Err(self.ch.fail(e));
        }
        let open = |i: &In| matches!(i.st, St::Waiting | St::Pushing { .. });
        if self.ch.eof && self.posted.iter().any(open) {
            return Err(self.ch.fail(NetError::Closed { net: NET }));
        }
        Ok(())
    }

    fn on_msg(&mut self, m: NetMsg) -> Result<(), NetError> {
        match m {
            NetMsg::Send { seq, segs } => {
                if seq != self.expect_seq {
                    return Err(protocol(format!(
                        "send {seq} published, {} expected",
                        self.expect_seq
                    )));
                }
                if self.offers.len() >= MAX_OFFERS {
                    return Err(protocol(format!(
                        "more than {MAX_OFFERS} sends published ahead of our receives"
                    )));
                }
                self.expect_seq += 1;
                self.offers.push_back((seq, segs));
            }
            NetMsg::Pushed { seq } | NetMsg::Refused { seq, .. } => {
                let head = self
                    .posted
                    .iter_mut()
                    .find(|i| matches!(i.st, St::Pushing { .. }));
                let Some(i) =
                    head.filter(|i| matches!(i.st, St::Pushing { seq: s, .. } if s == seq))
                else {
                    return Err(protocol(format!("{} for send {seq}, not pushed", kind(&m))));
                };
                let St::Pushing { len, .. } = i.st else {
                    return Err(protocol("no push in flight".into()));
                };
                i.st = match m {
                    NetMsg::Refused { reason, .. } => St::Failed(reason),
                    _ => St::Done(len as usize),
                };
            }
            other => return Err(protocol(format!("a sender sent {}", kind(&other)))),
        }
        Ok(())
    }

    /// Pairs the oldest unpaired receive with the oldest published send,
    /// while both exist, and makes (or asks for) the copy.
    fn pair(&mut self) -> Result<(), NetError> {
        loop {
            let Some(i) = self.posted.iter().position(|i| matches!(i.st, St::Waiting)) else {
                return Ok(());
            };
            let Some((seq, theirs)) = self.offers.pop_front() else {
                return Ok(());
            };
            let ours = self.posted[i].segs.clone();
            let room = total(&ours);
            let len: u64 = theirs.iter().map(|s| s.len).sum();
            if len > room {
                let why = format!("a send of {len} bytes into a receive of {room}");
                self.ch.send(&NetMsg::Refused {
                    seq,
                    reason: why.clone(),
                })?;
                self.posted[i].st = St::Failed(why);
                continue;
            }
            // Only the sender can copy its host memory into our GPU memory.
            let push = pieces(&ours, &theirs, len)
                .iter()
                .any(|p| theirs[p.remote].export.is_none() && p.local_kind != MemKind::Host);
            if push {
                let mine = self.ch.publish(&ours)?;
                self.ch.send(&NetMsg::Push { seq, segs: mine })?;
                self.posted[i].st = St::Pushing { seq, len };
                continue;
            }
            tracing::trace!(seq, len, "lat: same-host paired");
            match self.ch.copy(true, &ours, &theirs, len) {
                Ok(()) => {
                    tracing::trace!(seq, "lat: same-host copied");
                    self.ch.send(&NetMsg::Done { seq, len })?;
                    self.posted[i].st = St::Done(len as usize);
                }
                Err((reason, fatal)) => {
                    let _ = self.ch.send(&NetMsg::Refused {
                        seq,
                        reason: reason.clone(),
                    });
                    if fatal {
                        return Err(protocol(reason));
                    }
                    self.posted[i].st = St::Failed(reason);
                }
            }
        }
    }
}

impl RecvComm for SameHostRecv {
    fn irecv(&mut self, mem: MemRef, mr: MrHandle) -> Result<Option<ReqId>, NetError> {
        self.irecvv(&[mem], &[mr])
    }

    fn irecvv(&mut self, segs: &[MemRef], _mrs: &[MrHandle]) -> Result<Option<ReqId>, NetError> {
        self.ch.check()?;
        if segs.is_empty() || segs.len() > MAX_SEGS {
            return Err(NetError::Misuse {
                net: NET,
                reason: format!("a receive of {} segments (1 to {MAX_SEGS})", segs.len()),
            });
        }
        if self.posted.len() >= MAX_REQUESTS {
            return Ok(None);
        }
        let id = self.next_id;
        self.next_id += 1;
        self.posted.push_back(In {
            id,
            segs: segs.to_vec(),
            st: St::Waiting,
        });
        // A send already published lands now.
        self.pump()?;
        Ok(Some(ReqId(id)))
    }

    /// The copy is made here, at once, as a paired receive's is; the
    /// request is then done (or failed) when tested.
    fn ipull(&mut self, segs: &[MemRef], src: &[RemoteRef]) -> Result<Option<ReqId>, NetError> {
        self.ch.check()?;
        pull_counts(segs, src)?;
        if self.posted.len() >= MAX_REQUESTS {
            return Ok(None);
        }
        let st = self.ch.one_sided(true, segs, src)?;
        let id = self.next_id;
        self.next_id += 1;
        self.posted.push_back(In {
            id,
            segs: segs.to_vec(),
            st,
        });
        Ok(Some(ReqId(id)))
    }

    fn test(&mut self, req: ReqId) -> Result<Option<usize>, NetError> {
        // A pull ended when it was posted (see the send side's `test`).
        if ended(&self.posted, |p| (p.id, &p.st), req) {
            self.ch.check()?;
        } else {
            self.pump()?;
        }
        take_ended(
            &mut self.posted,
            |p| (p.id, &p.st),
            req,
            "receive",
            || "receive".to_string(),
        )
    }
}

/// A connected comm pair (tests): a send comm and its receive comm.
#[cfg(test)]
pub(crate) fn test_pair() -> (Box<dyn SendComm>, Box<dyn RecvComm>) {
    let net = SameHostNet::new(SameHostConfig {
        any_uid: false,
        gpu: None,
        timeout: Duration::from_secs(5),
        linger: Duration::from_millis(5),
        pull: true,
    });
    let waker: Waker = Arc::new(|| {});
    let mut l = net.listen_here().expect("listen");
    let s = net
        .connect_here(&l.handle(), waker.clone())
        .expect("connect");
    let deadline = Instant::now() + Duration::from_secs(5);
    loop {
        if let Some(r) = l.accept_here(waker.clone()).expect("accept") {
            return (Box::new(s), Box::new(r));
        }
        assert!(Instant::now() < deadline, "no accept within 5 s");
        std::thread::sleep(Duration::from_millis(1));
    }
}
