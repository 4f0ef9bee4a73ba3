//! The same-host path: connections between endpoints of one machine that
//! move bytes without the network.
//!
//! **Finding the peer.** Every endpoint listens on abstract Unix sockets
//! named from its identity and our uid: `tcpx-p2p-local:<uid>:<ip>:<port>`
//! (its control address, so a peer's metadata names it exactly), and, when
//! the name is free, `…:gpu:<index>` and `…:bdf:<pci bus id>` (UCCL's
//! `connect_local(remote_gpu_bdf)`; with several endpoints on one GPU the
//! first one owns these two, so such callers connect by metadata).
//!
//! **Handshake.** Magic, version, the digest of `TCPX_P2P_AUTH_TOKEN` (the
//! TCP path's rule), GPU, and a random endpoint identity (a connection to
//! itself is refused). Both sides read the other's uid and pid from the
//! kernel (`SO_PEERCRED`), never from the peer's bytes; another uid is
//! refused unless `TCPX_P2P_LOCAL_ANY_UID=1`.
//!
//! **Data.** A request names the target's own record (an `advertise_ipc`
//! record of this connection, a posted receive, or a registry
//! advertisement) and the requester's address. The target checks every
//! range against that record before a byte moves, then:
//! - host memory: the target copies itself, with cross-memory attach
//!   (`process_vm_readv` from the writer for a write, `process_vm_writev`
//!   into the reader for a read): one copy, kernel to kernel, no staging.
//!   The requester authorised exactly those ranges by naming them. Where
//!   Yama restricts ptrace (scope 1) each side lets its peers attach with
//!   `prctl(PR_SET_PTRACER)` (see [`os::allow_peer`]).
//! - GPU memory: the target answers with the CUDA IPC handle of the
//!   allocation holding the range and the range's offset in it; the
//!   requester opens it once per peer (cached) and copies with
//!   `cuMemcpyAsync` on a copy stream, never through the host. An
//!   `advertise_ipc` record lives as long as its connection, so the
//!   requester caches its resolution and later copies to it skip the round
//!   trip; registry advertisements can be revoked (`dereg`), so those are
//!   asked for every time.
//!
//! **Trust.** CUDA IPC maps the exporter's whole allocation into the
//! importer, and cross-memory attach needs ptrace rights over the peer: a
//! same-host peer of our uid could read or write far more than it was
//! advertised with. The records keep honest peers (and stale or forged
//! descriptors) to the advertised ranges; they do not contain a hostile
//! process of the same uid. Same host means same trust.
//!
//! **Seam.** The endpoint keeps local connections in this module's [`Hub`]
//! beside its TCP connection table; every call that takes a connection id
//! asks the hub first, so `transfer`, `write`, `read`, `send` and `recv`
//! on a local connection take this path with no other change.

/// The same-host path's byte formats.
pub(crate) use tcpx_p2p_wire::same_host as desc;
mod hub;
use crate::net::same_host::{cuda, os};

use std::collections::{HashMap, VecDeque};
use std::io::ErrorKind;
use std::net::IpAddr;
use std::os::linux::net::SocketAddrExt;
use std::os::unix::net::{SocketAddr, UnixListener, UnixStream};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use crossbeam_channel::{Receiver, Sender};
use parking_lot::{Condvar, Mutex, RwLock};

use crate::conn::{read_frame, write_frame};
use crate::error::{Error, Result};
use crate::gpu;
use crate::memory::{random_u64, MemKind, Registry};
use crate::transfer::{Failure, Status, Transfer};
use crate::wire::Token;
use desc::{Export, LocalHello, LocalMsg, ReqItem, Space, LOCAL_VERSION, MAX_ITEMS, MAX_MSG};
pub use desc::{IpcDesc, Placement};

/// Receives a peer may have posted and not yet been sent into.
const MAX_POSTED: usize = 4096;
/// Resolutions of `advertise_ipc` records kept per connection.
const MAX_RESOLVED: usize = 4096;
/// Live `advertise_ipc` records per connection.
const MAX_ADVERTS: usize = 1 << 20;

/// What the endpoint gives its hub.
pub(crate) struct HubParams {
    pub auth: u64,
    pub gpu_index: i32,
    pub gpu_bdf: String,
    pub registry: Arc<Registry>,
    pub timeout: Duration,
    pub ip: IpAddr,
    pub port: u16,
    pub next_conn: Arc<AtomicU64>,
    /// Same-host handshakes in progress and connections held at most
    /// (`TCPX_P2P_MAX_HANDSHAKES`, `TCPX_P2P_MAX_CONNS`).
    pub max_handshakes: usize,
    pub max_conns: usize,
}

/// Which endpoint on this host `connect_local` means.
#[derive(Debug, Clone)]
pub enum LocalPeer {
    /// The endpoint of this GPU index.
    Index(i32),
    /// The endpoint of the GPU with this PCI bus id.
    Bdf(String),
    /// The endpoint whose `get_metadata()` this is.
    Metadata(Vec<u8>),
}

/// A local connection accepted from a peer.
#[derive(Debug, Clone)]
pub struct AcceptedLocal {
    pub conn: u64,
    pub gpu_index: i32,
    pub gpu_bdf: String,
}

/// `0000:4a:00.0`, lower case, with a four-digit domain.
fn normalize_bdf(bdf: &str) -> String {
    let b = bdf.trim().to_ascii_lowercase();
    let parts: Vec<&str> = b.split(':').collect();
    match parts.as_slice() {
        [bus, devfn] => format!("0000:{bus}:{devfn}"),
        [dom, bus, devfn] => {
            let d = u32::from_str_radix(dom, 16).unwrap_or(0);
            format!("{d:04x}:{bus}:{devfn}")
        }
        _ => b,
    }
}

fn prefix() -> String {
    format!("tcpx-p2p-local:{}", os::my_uid())
}

fn name_of(peer: &LocalPeer) -> Result<String> {
    Ok(match peer {
        LocalPeer::Index(i) => format!("{}:gpu:{i}", prefix()),
        LocalPeer::Bdf(b) => match b.trim().parse::<i32>() {
            Ok(i) => format!("{}:gpu:{i}", prefix()),
            Err(_) => format!("{}:bdf:{}", prefix(), normalize_bdf(b)),
        },
        LocalPeer::Metadata(m) => {
            let m = crate::wire::Metadata::decode(m)?;
            format!("{}:{}:{}", prefix(), m.ip, m.port)
        }
    })
}

/// The local connections of one endpoint, and its listeners.
pub(crate) struct Hub {
    p: HubParams,
    nonce: u64,
    conns: RwLock<HashMap<u64, Arc<LocalConn>>>,
    gone: Mutex<VecDeque<(u64, String)>>,
    accepted: Mutex<VecDeque<u64>>,
    accepted_cv: Condvar,
    stopping: AtomicBool,
    names: Vec<String>,
    acceptors: Mutex<Vec<JoinHandle<()>>>,
    /// Same-host handshakes in progress.
    handshaking: AtomicU64,
}

/// Why a same-host request failed, or why its connection must close.
#[derive(Debug, Clone, thiserror::Error)]
enum LocalError {
    /// The target's records refuse the request (forged, stale, out of range).
    #[error("{0}")]
    Refused(String),
    /// A copy failed (cross-memory attach, CUDA).
    #[error("{0}")]
    Copy(String),
    /// The peer broke the protocol: the connection closes.
    #[error("peer broke the protocol: {0}")]
    Protocol(String),
    /// The connection is gone.
    #[error("{0}")]
    Lost(String),
    /// The peer process is no longer the one that connected: the request
    /// is refused and the connection closes.
    #[error("{0}")]
    Identity(String),
}

/// The placement of one of our own addresses.
fn placement_of(addr: u64) -> Placement {
    match gpu::pointer_device(addr) {
        Some(d) => Placement::Gpu(d),
        None => Placement::Host,
    }
}

/// One of our `advertise_ipc` records (or a posted receive).
struct Advert {
    secret: u64,
    addr: u64,
    len: u64,
    placement: Placement,
    /// A posted receive: ends when a send lands in it; used once.
    slot: Option<Arc<Transfer>>,
}

/// One range of a one-sided request, as the requester holds it.
#[derive(Debug, Clone, Copy)]
pub struct Item {
    pub space: Space,
    pub token: Token,
    /// The target's address and length.
    pub remote: u64,
    pub len: u64,
    /// Our address.
    pub local: u64,
    /// The descriptor, for `advertise_ipc` records (their resolution is cached).
    pub desc: Option<IpcDesc>,
}

/// A request waiting for the target's answer.
struct Pending {
    t: Arc<Transfer>,
    read: bool,
    items: Vec<Item>,
    /// A send into the peer's posted receive: tell it when the GPU copy landed.
    slot: Option<Token>,
}

/// A cached resolution of a GPU `advertise_ipc` record of the peer.
struct Resolved {
    mapping: Arc<cuda::Mapping>,
    secret: u64,
    /// The record's range, as the peer confirmed it (not as a descriptor says).
    addr: u64,
    len: u64,
    /// Offset of the record's first byte in the mapped allocation.
    offset: u64,
    dev: i32,
}

enum Job {
    Copy {
        t: Arc<Transfer>,
        dev: i32,
        copies: Vec<cuda::Copy>,
        _keep: Vec<Arc<cuda::Mapping>>,
    },
    Exports {
        p: Pending,
        exports: Vec<Option<Export>>,
    },
}

struct PostedRecv {
    token: Token,
    addr: u64,
    len: u64,
}

struct SendJob {
    t: Arc<Transfer>,
    ptr: u64,
    len: u64,
}

#[derive(Default)]
struct TwoSided {
    posted: VecDeque<PostedRecv>,
    sends: VecDeque<SendJob>,
}

/// A connection to an endpoint of this host.
pub(crate) struct LocalConn {
    pub id: u64,
    pub remote_gpu: i32,
    pub remote_bdf: String,
    /// The peer process, pinned (see [`os::PeerProcess`]): every
    /// cross-memory access checks first that it is still the process that
    /// connected.
    peer: os::PeerProcess,
    same_process: bool,
    gpu: i32,
    owner: u64,
    tx: Mutex<UnixStream>,
    registry: Arc<Registry>,
    adverts: Mutex<HashMap<u64, Advert>>,
    next_token: AtomicU64,
    ops: Mutex<HashMap<u64, Pending>>,
    next_op: AtomicU64,
    two: Mutex<TwoSided>,
    imports: Mutex<cuda::Imports>,
    resolved: Mutex<HashMap<u64, Resolved>>,
    failed: Mutex<Option<String>>,
    jobs: Sender<Job>,
    /// To leave the hub's table when the connection fails.
    hub: std::sync::Weak<Hub>,
}

impl LocalConn {
    fn establish(id: u64, mut s: UnixStream, initiator: bool, hub: &Arc<Hub>) -> Result<Arc<Self>> {
        let cerr = |reason: String| Error::Connect {
            peer: "same-host peer".into(),
            reason,
        };
        let cred = os::peer_cred(&s).map_err(|e| Error::io("SO_PEERCRED", e))?;
        // The names we dial carry our uid: the listener must run as it,
        // whatever TCPX_P2P_LOCAL_ANY_UID says. Any process can bind an
        // abstract name first; this way such a squatter is refused, never
        // spoken to.
        if initiator && cred.uid != os::my_uid() {
            return Err(cerr(format!(
                "the process listening on our same-host name (pid {}) runs as uid {}, not ours \
                 ({}): another user took the name; refused",
                cred.pid,
                cred.uid,
                os::my_uid()
            )));
        }
        let any_uid = std::env::var("TCPX_P2P_LOCAL_ANY_UID").is_ok_and(|v| v == "1");
        if cred.uid != os::my_uid() && !any_uid {
            return Err(cerr(format!(
                "peer process {} runs as uid {}, not ours ({}); set TCPX_P2P_LOCAL_ANY_UID=1 to allow it",
                cred.pid,
                cred.uid,
                os::my_uid()
            )));
        }
        // Pin the peer to its process. A peer of another uid gets no more
        // than it could do itself: its process must be one its uid could
        // attach to, and our copies reach only the address space it had
        // now (an exec, setuid or not, leaves them nothing). Pinned before
        // our hello goes out: the peer cannot have finished its handshake.
        let other_uid = cred.uid != os::my_uid();
        let peer = os::PeerProcess::pin(&s, &cred, other_uid)
            .map_err(|e| cerr(format!("pinning peer process {}: {e}", cred.pid)))?;
        if other_uid && !peer.ident.reachable_by(cred.uid, cred.gid) {
            return Err(cerr(format!(
                "peer process {} of uid {} is not one that uid could attach to itself ({:?}: \
                 setuid or not dumpable)",
                cred.pid, cred.uid, peer.ident
            )));
        }
        s.set_read_timeout(Some(hub.p.timeout))
            .map_err(|e| Error::io("same-host socket", e))?;
        let mine = LocalHello {
            version: LOCAL_VERSION,
            auth: hub.p.auth,
            gpu_index: hub.p.gpu_index,
            gpu_bdf: hub.p.gpu_bdf.clone(),
            nonce: hub.nonce,
        };
        let send = |s: &mut UnixStream| {
            let mut v = Vec::new();
            mine.encode(&mut v);
            write_frame(s, &v).map_err(|e| cerr(format!("sending the handshake: {e}")))
        };
        let recv = |s: &mut UnixStream| -> Result<LocalHello> {
            let b = read_frame(s, 256).map_err(|e| cerr(format!("reading the handshake: {e}")))?;
            if b.len() == 1 {
                return Err(cerr(
                    "the peer refused the handshake (auth token or version mismatch; see its log)"
                        .into(),
                ));
            }
            let h = LocalHello::decode(&b).map_err(|e| {
                let _ = write_frame(s, &[0]);
                cerr(format!("bad handshake: {e}"))
            })?;
            if h.auth != hub.p.auth {
                let _ = write_frame(s, &[0]);
                return Err(cerr(
                    "authentication failed: the peer's TCPX_P2P_AUTH_TOKEN differs from ours"
                        .into(),
                ));
            }
            if h.nonce == hub.nonce {
                let _ = write_frame(s, &[0]);
                return Err(cerr("connect_local reached this endpoint itself".into()));
            }
            Ok(h)
        };
        let theirs = if initiator {
            send(&mut s)?;
            recv(&mut s)?
        } else {
            let h = recv(&mut s)?;
            send(&mut s)?;
            h
        };
        s.set_read_timeout(None)
            .map_err(|e| Error::io("same-host socket", e))?;
        os::allow_peer(cred.pid);
        let rx_sock = s
            .try_clone()
            .map_err(|e| Error::io("same-host socket", e))?;
        let (jobs, job_rx) = crossbeam_channel::unbounded();
        let c = Arc::new(LocalConn {
            id,
            remote_gpu: theirs.gpu_index,
            remote_bdf: theirs.gpu_bdf,
            peer,
            same_process: cred.pid == std::process::id() as i32,
            gpu: hub.p.gpu_index,
            owner: hub.nonce,
            tx: Mutex::new(s),
            registry: hub.p.registry.clone(),
            adverts: Mutex::new(HashMap::new()),
            next_token: AtomicU64::new(1),
            ops: Mutex::new(HashMap::new()),
            next_op: AtomicU64::new(1),
            two: Mutex::new(TwoSided::default()),
            imports: Mutex::new(cuda::Imports::default()),
            resolved: Mutex::new(HashMap::new()),
            failed: Mutex::new(None),
            jobs,
            hub: Arc::downgrade(hub),
        });
        let r = c.clone();
        std::thread::Builder::new()
            .name(format!("tcpx-local-rx{id}"))
            .spawn(move || r.reader(rx_sock))
            .map_err(|e| Error::io("spawning a same-host reader", e))?;
        let w = Arc::downgrade(&c);
        std::thread::Builder::new()
            .name(format!("tcpx-local-cp{id}"))
            .spawn(move || copier(w, job_rx))
            .map_err(|e| Error::io("spawning a same-host copier", e))?;
        tracing::info!(
            conn = id,
            peer_pid = cred.pid,
            gpu = c.remote_gpu,
            "same-host connection"
        );
        Ok(c)
    }

    pub fn failure(&self) -> Option<String> {
        self.failed.lock().clone()
    }

    fn lost(&self) -> Failure {
        Failure::Lost(
            self.failure()
                .unwrap_or_else(|| "same-host connection closed".into()),
        )
    }

    /// Fails everything in flight and closes the socket.
    pub fn close(&self, why: &str) {
        {
            let mut f = self.failed.lock();
            if f.is_none() {
                *f = Some(why.to_string());
            }
        }
        let _ = self.tx.lock().shutdown(std::net::Shutdown::Both);
        let why = self.lost();
        let ops: Vec<Pending> = self.ops.lock().drain().map(|(_, p)| p).collect();
        for p in ops {
            p.t.fail(why.clone());
        }
        let two = std::mem::take(&mut *self.two.lock());
        for s in two.sends {
            s.t.fail(why.clone());
        }
        let adverts: Vec<Advert> = self.adverts.lock().drain().map(|(_, a)| a).collect();
        for a in adverts {
            if let Some(t) = a.slot {
                t.fail(why.clone());
            }
        }
        self.resolved.lock().clear();
        *self.imports.lock() = cuda::Imports::default();
    }

    fn send_msg(&self, m: &LocalMsg) -> Result<()> {
        let mut v = Vec::with_capacity(64);
        m.encode(&mut v);
        let r = write_frame(&mut *self.tx.lock(), &v);
        r.map_err(|e| {
            self.close(&format!("same-host socket: {e}"));
            Error::ConnectionLost {
                conn: self.id,
                reason: format!("same-host socket: {e}"),
            }
        })
    }

    fn alive(&self) -> Result<()> {
        match self.failure() {
            Some(why) => Err(Error::ConnectionLost {
                conn: self.id,
                reason: why,
            }),
            None => Ok(()),
        }
    }

    fn new_advert(&self, addr: u64, len: u64, slot: Option<Arc<Transfer>>) -> Result<IpcDesc> {
        if addr == 0 {
            return Err(Error::invalid("advertise_ipc: null pointer"));
        }
        if addr.checked_add(len).is_none() {
            return Err(Error::invalid(format!(
                "advertise_ipc: {len} bytes at {addr:#x} wrap around the address space"
            )));
        }
        let placement = placement_of(addr);
        if let Placement::Gpu(d) = placement {
            gpu::Device::get(d)?.bind()?;
            let (base, size) = gpu::allocation_range(addr)?;
            if addr + len > base + size as u64 {
                return Err(Error::invalid(format!(
                    "advertise_ipc: {len} bytes at {addr:#x} run past their GPU allocation ({size} bytes at {base:#x})"
                )));
            }
        }
        let token = Token {
            id: self.next_token.fetch_add(1, Ordering::Relaxed),
            secret: random_u64(),
        };
        let mut a = self.adverts.lock();
        if a.len() >= MAX_ADVERTS {
            return Err(Error::invalid(
                "advertise_ipc: too many live advertisements on this connection",
            ));
        }
        a.insert(
            token.id,
            Advert {
                secret: token.secret,
                addr,
                len,
                placement,
                slot,
            },
        );
        Ok(IpcDesc {
            placement,
            token,
            addr,
            len,
            owner: self.owner,
        })
    }

    /// A record of `[addr, addr+len)` for the peer of this connection.
    pub fn advertise(&self, addr: u64, len: u64) -> Result<IpcDesc> {
        self.alive()?;
        self.new_advert(addr, len, None)
    }

    /// Checks our local buffers against the descriptors' placement.
    pub fn ipc_items(&self, bufs: &[(u64, usize)], infos: &[&[u8]]) -> Result<Vec<Item>> {
        if bufs.len() != infos.len() {
            return Err(Error::invalid(format!(
                "{} buffers but {} descriptors",
                bufs.len(),
                infos.len()
            )));
        }
        if bufs.is_empty() || bufs.len() > MAX_ITEMS {
            return Err(Error::invalid(format!(
                "{} buffers (1 to {MAX_ITEMS} per call)",
                bufs.len()
            )));
        }
        bufs.iter()
            .zip(infos)
            .map(|(&(ptr, len), info)| {
                let d = IpcDesc::decode(info)?;
                if d.owner != 0 && d.owner == self.owner {
                    return Err(Error::invalid(
                        "this descriptor was advertised by this endpoint, not by the peer",
                    ));
                }
                if ptr == 0 {
                    return Err(Error::invalid("null local pointer"));
                }
                if len as u64 > d.len {
                    return Err(Error::invalid(format!(
                        "{len} bytes do not fit the {} bytes the peer advertised",
                        d.len
                    )));
                }
                if d.placement == Placement::Host && placement_of(ptr) != Placement::Host {
                    return Err(Error::invalid(
                        "GPU memory into (or from) the peer's host memory is not supported on the same-host path; advertise GPU memory, or use host memory on this side",
                    ));
                }
                Ok(Item {
                    space: Space::Ipc,
                    token: d.token,
                    remote: d.addr,
                    len: len as u64,
                    local: ptr,
                    desc: Some(d),
                })
            })
            .collect()
    }

    /// Starts a one-sided request; `inline`: a copy that needs no answer
    /// from the peer runs on this thread before the call returns.
    #[allow(unsafe_code)] // raw-memory edge: copies between checked ranges
    pub fn rma(&self, t: Arc<Transfer>, read: bool, items: Vec<Item>, inline: bool) -> Result<()> {
        self.alive()?;
        if items.len() > MAX_ITEMS {
            return Err(Error::invalid(format!(
                "{} items in one request (at most {MAX_ITEMS})",
                items.len()
            )));
        }
        if let Some((dev, copies, keep)) = self.cached_copies(read, &items) {
            if inline {
                // SAFETY: the ranges were checked against the peer's record
                // when it was resolved; the mappings are held in `keep`.
                match unsafe { cuda::run(dev, &copies) } {
                    Ok(()) => t.complete_one(),
                    Err(e) => {
                        t.fail(Failure::Lost(format!("CUDA copy: {e}")));
                    }
                }
                drop(keep);
            } else {
                let _ = self.jobs.send(Job::Copy {
                    t,
                    dev,
                    copies,
                    _keep: keep,
                });
            }
            return Ok(());
        }
        self.request(Pending {
            t,
            read,
            items,
            slot: None,
        })
    }

    fn request(&self, p: Pending) -> Result<()> {
        let op = self.next_op.fetch_add(1, Ordering::Relaxed);
        let msg = LocalMsg::Req {
            op,
            read: p.read,
            items: p
                .items
                .iter()
                .map(|i| ReqItem {
                    space: i.space,
                    token: i.token,
                    addr: i.remote,
                    len: i.len,
                    peer: i.local,
                })
                .collect(),
        };
        self.ops.lock().insert(op, p);
        if let Err(e) = self.send_msg(&msg) {
            if let Some(p) = self.ops.lock().remove(&op) {
                p.t.fail(self.lost());
            }
            return Err(e);
        }
        Ok(())
    }

    /// The copies of a request whose every range is in a resolved GPU
    /// record of the peer (None: ask the peer).
    #[allow(clippy::type_complexity)]
    fn cached_copies(
        &self,
        read: bool,
        items: &[Item],
    ) -> Option<(i32, Vec<cuda::Copy>, Vec<Arc<cuda::Mapping>>)> {
        let res = self.resolved.lock();
        let mut dev = -1;
        let mut copies = Vec::with_capacity(items.len());
        let mut keep = Vec::new();
        for i in items {
            let d = i.desc?;
            let r = res
                .get(&d.token.id)
                .filter(|r| r.secret == d.token.secret)?;
            // Within the record's range as the peer confirmed it; anything
            // else goes to the peer (which refuses what its record refuses).
            let inside = i.remote >= r.addr
                && (i.remote - r.addr)
                    .checked_add(i.len)
                    .is_some_and(|e| e <= r.len);
            if !inside {
                return None;
            }
            let remote = r.mapping.base + r.offset + (i.remote - r.addr);
            copies.push(cuda::Copy::between(i.local, remote, i.len, read));
            dev = r.dev;
            keep.push(r.mapping.clone());
        }
        Some((dev, copies, keep))
    }

    /// Two-sided: sends into the peer's receives in posting order.
    pub fn send(&self, t: Arc<Transfer>, ptr: u64, len: u64) -> Result<()> {
        self.alive()?;
        self.two.lock().sends.push_back(SendJob { t, ptr, len });
        self.pair();
        Ok(())
    }

    /// Two-sided: posts a receive into `[ptr, ptr+len)`.
    pub fn recv(&self, t: Arc<Transfer>, ptr: u64, len: u64) -> Result<()> {
        self.alive()?;
        let d = self.new_advert(ptr, len, Some(t))?;
        self.send_msg(&LocalMsg::RecvPosted {
            token: d.token,
            addr: ptr,
            len,
        })
    }

    /// Matches queued sends with the peer's posted receives, in order.
    fn pair(&self) {
        loop {
            let (s, r) = {
                let mut two = self.two.lock();
                if two.sends.is_empty() || two.posted.is_empty() {
                    return;
                }
                let (Some(s), Some(r)) = (two.sends.pop_front(), two.posted.pop_front()) else {
                    return;
                };
                (s, r)
            };
            if s.len > r.len {
                let why = format!(
                    "send of {} bytes is larger than the peer's posted receive of {}",
                    s.len, r.len
                );
                s.t.fail(Failure::Refused(why.clone()));
                let _ = self.send_msg(&LocalMsg::Landed {
                    token: r.token,
                    ok: false,
                    reason: why,
                });
                continue;
            }
            let p = Pending {
                t: s.t,
                read: false,
                items: vec![Item {
                    space: Space::Ipc,
                    token: r.token,
                    remote: r.addr,
                    len: s.len,
                    local: s.ptr,
                    desc: None,
                }],
                slot: Some(r.token),
            };
            if self.request(p).is_err() {
                return;
            }
        }
    }

    fn reader(self: Arc<Self>, mut s: UnixStream) {
        let why = loop {
            let b = match read_frame(&mut s, MAX_MSG) {
                Ok(b) => b,
                Err(e) if e.kind() == ErrorKind::UnexpectedEof => {
                    break "peer closed the same-host connection".to_string()
                }
                Err(e) => break format!("same-host socket: {e}"),
            };
            let m = match LocalMsg::decode(&b) {
                Ok(m) => m,
                Err(e) => break format!("peer broke the protocol: {e}"),
            };
            if let Err(why) = self.handle(m) {
                break why.to_string();
            }
            if let Some(why) = self.failure() {
                break why;
            }
        };
        tracing::info!(conn = self.id, "{why}");
        self.close(&why);
        self.leave_hub();
    }

    /// A failed connection releases its socket and threads; its id keeps
    /// answering with the reason.
    fn leave_hub(&self) {
        if let Some(h) = self.hub.upgrade() {
            let removed = h.conns.write().remove(&self.id);
            if removed.is_some() {
                h.bury(self.id, self.failure().unwrap_or_default());
            }
        }
    }

    /// One message from the peer; Err: the connection must close.
    fn handle(&self, m: LocalMsg) -> std::result::Result<(), LocalError> {
        match m {
            LocalMsg::Req { op, read, items } => {
                let served = self.serve(read, &items);
                let answer = match &served {
                    Ok(exports) => LocalMsg::Done {
                        op,
                        exports: exports.clone(),
                    },
                    Err(e) => LocalMsg::Refused {
                        op,
                        reason: e.to_string(),
                    },
                };
                self.send_msg(&answer)
                    .map_err(|e| LocalError::Lost(e.to_string()))?;
                match served {
                    Err(e @ LocalError::Identity(_)) => Err(e),
                    _ => Ok(()),
                }
            }
            LocalMsg::Done { op, exports } => {
                let Some(p) = self.ops.lock().remove(&op) else {
                    return Err(LocalError::Protocol(format!(
                        "answer to unknown request {op}"
                    )));
                };
                if exports.len() != p.items.len() {
                    p.t.fail(Failure::Refused(format!(
                        "answer has {} items, the request {}",
                        exports.len(),
                        p.items.len()
                    )));
                    return Ok(());
                }
                if exports.iter().all(Option::is_none) {
                    p.t.complete_one();
                } else {
                    let _ = self.jobs.send(Job::Exports { p, exports });
                }
                Ok(())
            }
            LocalMsg::Refused { op, reason } => {
                if let Some(p) = self.ops.lock().remove(&op) {
                    p.t.fail(Failure::Refused(reason));
                }
                Ok(())
            }
            LocalMsg::RecvPosted { token, addr, len } => {
                {
                    let mut two = self.two.lock();
                    if two.posted.len() >= MAX_POSTED {
                        return Err(LocalError::Protocol(format!(
                            "peer posted more than {MAX_POSTED} receives ahead of our sends"
                        )));
                    }
                    two.posted.push_back(PostedRecv { token, addr, len });
                }
                self.pair();
                Ok(())
            }
            LocalMsg::Landed { token, ok, reason } => {
                let mut a = self.adverts.lock();
                let is_slot = a
                    .get(&token.id)
                    .is_some_and(|r| r.secret == token.secret && r.slot.is_some());
                if !is_slot {
                    // Stale or forged: nothing of ours changes.
                    tracing::debug!(conn = self.id, "landing notice for an unknown receive");
                    return Ok(());
                }
                let t = a.remove(&token.id).and_then(|r| r.slot);
                drop(a);
                if let Some(t) = t {
                    if ok {
                        t.complete_one();
                    } else {
                        t.fail(Failure::Refused(reason));
                    }
                }
                Ok(())
            }
        }
    }

    /// Target side of a request: checks every range against our records,
    /// then copies host ranges and exports GPU ones. Nothing moves unless
    /// every range passed.
    #[allow(unsafe_code)] // raw-memory edge: copies between checked ranges
    fn serve(
        &self,
        read: bool,
        items: &[ReqItem],
    ) -> std::result::Result<Vec<Option<Export>>, LocalError> {
        struct Ok1 {
            addr: u64,
            len: u64,
            peer: u64,
            placement: Placement,
            slot: Option<u64>,
            /// The record's whole range (IPC records only; else this range).
            record: (u64, u64),
        }
        let mut checked = Vec::with_capacity(items.len());
        let mut regions = Vec::new();
        for it in items {
            match it.space {
                Space::Ipc => {
                    let a = self.adverts.lock();
                    let r = a
                        .get(&it.token.id)
                        .filter(|r| r.secret == it.token.secret)
                        .ok_or_else(|| {
                            LocalError::Refused(format!(
                                "unknown or stale IPC descriptor (token {})",
                                it.token.id
                            ))
                        })?;
                    if r.slot.is_some() && read {
                        return Err(LocalError::Refused(
                            "a posted receive cannot be read".into(),
                        ));
                    }
                    let inside = it.addr >= r.addr
                        && (it.addr - r.addr)
                            .checked_add(it.len)
                            .is_some_and(|e| e <= r.len);
                    if !inside {
                        let why = format!(
                            "{} bytes at {:#x} lie outside the advertised {} bytes at {:#x}",
                            it.len, it.addr, r.len, r.addr
                        );
                        if let Some(t) = r.slot.clone() {
                            drop(a);
                            self.adverts.lock().remove(&it.token.id);
                            t.fail(Failure::Refused(why.clone()));
                        }
                        return Err(LocalError::Refused(why));
                    }
                    checked.push(Ok1 {
                        addr: it.addr,
                        len: it.len,
                        peer: it.peer,
                        placement: r.placement,
                        slot: r.slot.as_ref().map(|_| it.token.id),
                        record: (r.addr, r.len),
                    });
                }
                Space::Registry => {
                    let r = self
                        .registry
                        .resolve(it.token, it.addr, it.len, self.id)
                        .map_err(LocalError::Refused)?;
                    checked.push(Ok1 {
                        addr: it.addr,
                        len: it.len,
                        peer: it.peer,
                        placement: match r.kind {
                            MemKind::Host => Placement::Host,
                            MemKind::Cuda(d) => Placement::Gpu(d),
                        },
                        slot: None,
                        record: (it.addr, it.len),
                    });
                    regions.push(r);
                }
            }
        }
        // Every range passed: move the host ones, export the GPU ones.
        let spans: Vec<os::Span> = checked
            .iter()
            .filter(|c| c.placement == Placement::Host)
            .map(|c| os::Span {
                local: c.addr,
                remote: c.peer,
                len: c.len,
            })
            .collect();
        if !spans.is_empty() {
            self.peer.verify().map_err(LocalError::Identity)?;
            // SAFETY: each local range lies inside one of our live records
            // (checked above); `regions` keeps registry regions registered.
            let moved = unsafe { self.peer.copy(!read, &spans) };
            if moved.is_err() {
                // A posted receive this request was meant for fails with it.
                for id in checked.iter().filter_map(|c| c.slot) {
                    if let Some(t) = self.adverts.lock().remove(&id).and_then(|a| a.slot) {
                        t.fail(Failure::Refused("the send into it failed".into()));
                    }
                }
            }
            moved.map_err(|e| {
                let hint = if e.raw_os_error() == Some(libc::EPERM) {
                    " (ptrace permission: see kernel.yama.ptrace_scope)"
                } else if e.raw_os_error() == Some(libc::EFAULT) {
                    " (the peer's address is not host memory of the peer)"
                } else {
                    ""
                };
                LocalError::Copy(format!(
                    "cross-memory attach with process {}: {e}{hint}",
                    self.peer.pid
                ))
            })?;
        }
        let mut exports = Vec::with_capacity(checked.len());
        for c in &checked {
            exports.push(match c.placement {
                Placement::Host => None,
                Placement::Gpu(d) => {
                    let mut e = cuda::export(d, c.addr, self.same_process)
                        .map_err(|e| LocalError::Copy(format!("exporting GPU memory: {e}")))?;
                    (e.record_addr, e.record_len) = c.record;
                    Some(e)
                }
            });
        }
        // Host receives are complete now; GPU ones when the sender says so.
        for c in checked.iter().filter(|c| c.placement == Placement::Host) {
            if let Some(id) = c.slot {
                if let Some(t) = self.adverts.lock().remove(&id).and_then(|a| a.slot) {
                    t.complete_one();
                }
            }
        }
        drop(regions);
        Ok(exports)
    }

    /// Requester side: copies through the target's exports.
    #[allow(unsafe_code)] // raw-memory edge: copies between checked ranges
    fn copy_exports(
        &self,
        p: &Pending,
        exports: &[Option<Export>],
    ) -> std::result::Result<(), LocalError> {
        let mut copies = Vec::new();
        let mut keep = Vec::new();
        let mut dev = -1;
        for (i, e) in p.items.iter().zip(exports) {
            let Some(e) = e else { continue };
            if e.direct != 0 && !self.same_process {
                return Err(LocalError::Protocol(
                    "the peer sent a same-process address from another process".into(),
                ));
            }
            let d = if self.gpu >= 0 && gpu::available() {
                self.gpu
            } else {
                e.gpu
            };
            let m =
                self.imports.lock().open(d, e).map_err(|err| {
                    LocalError::Copy(format!("opening the peer's GPU memory: {err}"))
                })?;
            // The peer's offset must stay inside the allocation CUDA mapped.
            if e.offset.checked_add(i.len).is_none_or(|end| end > m.size) {
                return Err(LocalError::Protocol(format!(
                    "the peer's export ({} bytes at offset {}) lies outside its {}-byte allocation",
                    i.len, e.offset, m.size
                )));
            }
            let remote = m.base.wrapping_add(e.offset);
            copies.push(cuda::Copy::between(i.local, remote, i.len, p.read));
            // An `advertise_ipc` record (not a one-shot receive) is cached
            // with the range the peer says it covers.
            let rec_off = i
                .remote
                .checked_sub(e.record_addr)
                .and_then(|k| e.offset.checked_sub(k))
                .filter(|o| o.checked_add(e.record_len).is_some_and(|end| end <= m.size));
            if let (Some(desc), Some(rec_off)) = (i.desc, rec_off) {
                let mut res = self.resolved.lock();
                if res.len() >= MAX_RESOLVED {
                    res.clear();
                }
                res.insert(
                    desc.token.id,
                    Resolved {
                        mapping: m.clone(),
                        secret: desc.token.secret,
                        addr: e.record_addr,
                        len: e.record_len,
                        offset: rec_off,
                        dev: d,
                    },
                );
            }
            keep.push(m);
            dev = d;
        }
        // SAFETY: the peer checked each range against its record before
        // exporting it; the mappings are held in `keep`.
        unsafe { cuda::run(dev, &copies) }.map_err(|e| LocalError::Copy(format!("CUDA copy: {e}")))
    }
}

#[allow(unsafe_code)] // raw-memory edge: copies between checked ranges
fn copier(conn: std::sync::Weak<LocalConn>, jobs: Receiver<Job>) {
    while let Ok(job) = jobs.recv() {
        match job {
            Job::Copy { t, dev, copies, .. } => {
                // SAFETY: as in `LocalConn::rma`.
                match unsafe { cuda::run(dev, &copies) } {
                    Ok(()) => t.complete_one(),
                    Err(e) => {
                        t.fail(Failure::Lost(format!("CUDA copy: {e}")));
                    }
                }
            }
            Job::Exports { p, exports } => {
                let Some(c) = conn.upgrade() else {
                    p.t.fail(Failure::Lost("same-host connection closed".into()));
                    continue;
                };
                let r = c.copy_exports(&p, &exports);
                if let Some(token) = p.slot {
                    let (ok, reason) = match &r {
                        Ok(()) => (true, String::new()),
                        Err(e) => (false, e.to_string()),
                    };
                    let _ = c.send_msg(&LocalMsg::Landed { token, ok, reason });
                }
                match r {
                    Ok(()) => p.t.complete_one(),
                    Err(e @ LocalError::Refused(_)) => {
                        p.t.fail(Failure::Refused(e.to_string()));
                    }
                    Err(e) => {
                        p.t.fail(Failure::Lost(e.to_string()));
                    }
                }
            }
        }
    }
}

/// The outcome of an ended transfer as the endpoint reports it.
pub(crate) fn outcome(t: &Transfer, s: Status) -> Result<()> {
    match s {
        Status::Done => Ok(()),
        Status::Pending => Err(Error::invalid("transfer still running")),
        Status::Failed(f) => Err(f.into_error(t.conn)),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bdf_forms() {
        assert_eq!(normalize_bdf("0000:4A:00.0"), "0000:4a:00.0");
        assert_eq!(normalize_bdf("4a:00.0"), "0000:4a:00.0");
        assert_eq!(normalize_bdf("00000000:4a:00.0"), "0000:4a:00.0");
        let a = name_of(&LocalPeer::Bdf("00000000:4A:00.0".into())).unwrap();
        let b = name_of(&LocalPeer::Bdf("4a:00.0".into())).unwrap();
        assert_eq!(a, b);
        let i = name_of(&LocalPeer::Bdf("3".into())).unwrap();
        assert_eq!(i, name_of(&LocalPeer::Index(3)).unwrap());
        assert!(name_of(&LocalPeer::Metadata(vec![1, 2])).is_err());
    }
}
