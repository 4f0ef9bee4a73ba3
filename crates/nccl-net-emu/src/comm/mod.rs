//! The comms of the stand-in and the rules it enforces. Every handle given
//! to C (comm, request, memory registration) is a token looked up in one
//! registry, so a stale or foreign pointer is an error, never a crash.
//!
//! Each send comm and receive comm is one TCP connection with one I/O
//! thread (blocking I/O). A message is a 24-byte header (magic, sequence
//! number, length) and its payload; receives match messages in posting
//! order (tags are ignored, as in TCPX).

use std::collections::{HashMap, VecDeque};
use std::ffi::c_int;
use std::io::{IoSliceMut, Read, Write};
use std::net::{IpAddr, Ipv6Addr, SocketAddr, TcpListener, TcpStream};
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering};
use std::sync::mpsc;
use std::sync::{Arc, OnceLock};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use ncclnet_abi::*;
use parking_lot::{Condvar, Mutex};
use tcpx_p2p_gpu as gpu;

mod gate;
mod recv;
mod send;

pub use gate::Gate;

use recv::*;
pub use recv::{irecv, irecv_consumed, test};
pub use send::isend;
use send::*;

use crate::config::EmuConfig;
use crate::cuda::{self, HostMem, MappedMem};
use crate::pool::{self, BouncePool, Lease, PoolKind, Rng, BLOCK, PAGE};
use crate::stage::{self, RxStage, TxStage};
use tcpx_p2p_timing::{self as timing, Spent};

/// Requests in flight per comm, as TCPX's MAX_REQUESTS.
pub const MAX_REQUESTS: usize = 16;
/// The largest UNPACK receive TCPX survives (2048 fragments).
pub const MAX_UNPACK_RECV: usize = 4 << 20;
const HANDLE_MAGIC: &[u8; 8] = b"EMUNETv1";
const HELLO_MAGIC: u64 = 0x4f4c_4c45_4855_4d45; // "EMUHELLO"
/// The byte accept sends once flow steering is programmed; connect hands
/// out its comm only after it.
const ACCEPTED: u8 = 0xac;
/// How long connect's thread waits for the peer's accept.
const ACCEPT_WAIT: Duration = Duration::from_secs(300);
const MSG_MAGIC: u32 = 0x3155_4d45; // "EMU1"
const HDR: usize = 24;
/// The most payload an I/O thread moves per piece it takes from its gate.
const PIECE: usize = 256 << 10;
/// Where connect keeps its progress inside the caller's handle buffer.
const STAGE_AT: usize = 64;

/// Why a call failed: the code to return and a line for the log. `loud`
/// marks a broken TCPX rule.
#[derive(Debug)]
pub struct Fail {
    pub code: NcclResult,
    pub msg: String,
    pub loud: bool,
}

pub fn error(code: NcclResult, msg: impl Into<String>) -> Fail {
    Fail {
        code,
        msg: msg.into(),
        loud: false,
    }
}

/// A broken TCPX rule: the caller's bug.
pub fn violation(code: NcclResult, msg: impl Into<String>) -> Fail {
    Fail {
        code,
        msg: msg.into(),
        loud: true,
    }
}

type R<T> = Result<T, Fail>;

// ------------------------------------------------------------ registry

#[derive(Clone)]
enum Obj {
    Listen(Arc<Listen>),
    Send(Arc<SendComm>),
    Recv(Arc<RecvComm>),
}

#[derive(Clone)]
enum ReqOwner {
    Send(Arc<SendComm>, u64),
    Recv(Arc<RecvComm>, u64),
}

#[derive(Default)]
struct Registry {
    objs: HashMap<usize, Obj>,
    reqs: HashMap<usize, ReqOwner>,
    pending: HashMap<u64, Arc<PendingConnect>>,
}

fn registry() -> &'static Mutex<Registry> {
    static REG: OnceLock<Mutex<Registry>> = OnceLock::new();
    REG.get_or_init(Default::default)
}

/// A fresh token that looks like an aligned pointer and is never reused.
fn token() -> usize {
    static NEXT: AtomicU64 = AtomicU64::new(0x7e00_0000_1000);
    NEXT.fetch_add(0x40, Ordering::Relaxed) as usize
}

fn obj(t: usize, what: &str) -> R<Obj> {
    registry().lock().objs.get(&t).cloned().ok_or_else(|| {
        violation(
            NCCL_INVALID_ARGUMENT,
            format!("{what}: {t:#x} is not a live comm of this plugin"),
        )
    })
}

fn unregister_reqs(tokens: &[usize]) {
    if tokens.is_empty() {
        return;
    }
    let mut reg = registry().lock();
    for t in tokens {
        reg.reqs.remove(t);
    }
}

// ------------------------------------------------------------ memory

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum MemKind {
    Host,
    Cuda(i32),
}

#[derive(Debug, Clone, Copy)]
struct Mr {
    addr: u64,
    len: usize,
    kind: MemKind,
}

fn reg_mr_in(mrs: &Mutex<HashMap<usize, Mr>>, data: u64, size: usize, ty: c_int) -> R<usize> {
    let kind = match ty {
        NCCL_PTR_HOST => MemKind::Host,
        NCCL_PTR_CUDA => {
            if !data.is_multiple_of(4096) {
                return Err(violation(
                    NCCL_INTERNAL_ERROR,
                    format!("regMr of GPU memory at {data:#x}: not 4 KiB-aligned (TCPX requires 4096-byte-aligned GPU registrations)"),
                ));
            }
            if !size.is_multiple_of(4096) {
                return Err(violation(
                    NCCL_INTERNAL_ERROR,
                    format!("regMr of {size} bytes of GPU memory at {data:#x}: not a multiple of 4 KiB (TCPX's cuMemGetHandleForAddressRange needs a 4096-byte-aligned address and size)"),
                ));
            }
            if !gpu::available() {
                return Err(error(
                    NCCL_SYSTEM_ERROR,
                    "regMr of GPU memory: CUDA is not available",
                ));
            }
            match gpu::pointer_device(data) {
                Some(d) => MemKind::Cuda(d),
                None => {
                    return Err(violation(
                        NCCL_INVALID_ARGUMENT,
                        format!("regMr type CUDA of {data:#x}, which is not device memory"),
                    ))
                }
            }
        }
        other => {
            return Err(error(
                NCCL_INVALID_ARGUMENT,
                format!("regMr with pointer type {other} (only HOST and CUDA are supported)"),
            ))
        }
    };
    let t = token();
    mrs.lock().insert(
        t,
        Mr {
            addr: data,
            len: size,
            kind,
        },
    );
    Ok(t)
}

fn find_mr(
    mrs: &Mutex<HashMap<usize, Mr>>,
    mh: usize,
    data: u64,
    size: usize,
    call: &str,
) -> R<Mr> {
    let mr = mrs.lock().get(&mh).copied().ok_or_else(|| {
        violation(
            NCCL_INVALID_ARGUMENT,
            format!("{call}: memory handle {mh:#x} was not registered with this comm"),
        )
    })?;
    let inside = data >= mr.addr
        && (data - mr.addr)
            .checked_add(size as u64)
            .is_some_and(|e| e <= mr.len as u64);
    if !inside {
        return Err(violation(
            NCCL_INVALID_ARGUMENT,
            format!(
                "{call}: {data:#x}+{size} lies outside its registration {:#x}+{}",
                mr.addr, mr.len
            ),
        ));
    }
    Ok(mr)
}

// ------------------------------------------------------------ completion cells

enum CellState {
    Pending,
    Done {
        at: Instant,
        size: usize,
        lease: Option<Lease>,
    },
    Failed(String),
}

struct Cell(Mutex<CellState>);

impl Cell {
    fn new() -> Arc<Cell> {
        Arc::new(Cell(Mutex::new(CellState::Pending)))
    }
    fn done(&self, size: usize, lease: Option<Lease>) {
        *self.0.lock() = CellState::Done {
            at: Instant::now(),
            size,
            lease,
        };
    }
    fn fail(&self, why: &str) {
        let mut s = self.0.lock();
        if matches!(*s, CellState::Pending) {
            *s = CellState::Failed(why.to_string());
        }
    }
}

/// What `test` sees of a request.
enum Seen {
    NotYet,
    Done(usize),
}

fn look(cell: &Cell, delay: Duration, failed: Option<String>) -> R<Seen> {
    match &*cell.0.lock() {
        CellState::Pending => match failed {
            Some(f) => Err(error(NCCL_REMOTE_ERROR, f)),
            None => Ok(Seen::NotYet),
        },
        CellState::Done { at, size, .. } => Ok(if at.elapsed() >= delay {
            Seen::Done(*size)
        } else {
            Seen::NotYet
        }),
        CellState::Failed(f) => Err(error(NCCL_REMOTE_ERROR, f.clone())),
    }
}

// ------------------------------------------------------------ handles

fn encode_handle(addr: SocketAddr, id: u64) -> [u8; NCCL_NET_HANDLE_MAXSIZE] {
    let mut h = [0u8; NCCL_NET_HANDLE_MAXSIZE];
    h[0..8].copy_from_slice(HANDLE_MAGIC);
    let v6 = match addr.ip() {
        IpAddr::V4(a) => a.to_ipv6_mapped(),
        IpAddr::V6(a) => a,
    };
    h[8..24].copy_from_slice(&v6.octets());
    h[24..26].copy_from_slice(&addr.port().to_le_bytes());
    h[32..40].copy_from_slice(&id.to_le_bytes());
    h
}

fn decode_handle(h: &[u8; NCCL_NET_HANDLE_MAXSIZE]) -> R<(SocketAddr, u64, u64)> {
    if &h[0..8] != HANDLE_MAGIC {
        return Err(violation(
            NCCL_INVALID_ARGUMENT,
            "connect: the handle was not written by this plugin's listen",
        ));
    }
    let mut ip = [0u8; 16];
    ip.copy_from_slice(&h[8..24]);
    let v6 = Ipv6Addr::from(ip);
    let ip = v6
        .to_ipv4_mapped()
        .map(IpAddr::V4)
        .unwrap_or(IpAddr::V6(v6));
    let port = u16::from_le_bytes([h[24], h[25]]);
    let le = |r: std::ops::Range<usize>| {
        let mut b = [0u8; 8];
        b.copy_from_slice(&h[r]);
        u64::from_le_bytes(b)
    };
    Ok((
        SocketAddr::new(ip, port),
        le(32..40),
        le(STAGE_AT..STAGE_AT + 8),
    ))
}

// ------------------------------------------------------------ listen

pub struct Listen {
    id: u64,
    listener: TcpListener,
    st: Mutex<ListenState>,
}

#[derive(Default)]
struct ListenState {
    ready: Option<TcpStream>,
    nulls: u32,
    /// The first accept call of the comm being accepted (TCPX starts its
    /// accept thread there).
    first_call: Option<Instant>,
    /// When its connection came in.
    arrived: Option<Instant>,
}

/// The device `dev` (as listed now), or why there is none.
pub fn device(dev: c_int, call: &str) -> R<crate::config::Device> {
    let devs = crate::config::devices();
    usize::try_from(dev)
        .ok()
        .and_then(|d| devs.get(d).cloned())
        .ok_or_else(|| {
            error(
                NCCL_INVALID_ARGUMENT,
                format!("{call} on device {dev}: there are {} devices", devs.len()),
            )
        })
}

pub fn listen(dev: c_int, handle: &mut [u8; NCCL_NET_HANDLE_MAXSIZE]) -> R<usize> {
    let d = device(dev, "listen")?;
    let l = TcpListener::bind(SocketAddr::new(d.addr, 0)).map_err(|e| {
        error(
            NCCL_SYSTEM_ERROR,
            format!("listen: bind {} ({}): {e}", d.addr, d.name),
        )
    })?;
    l.set_nonblocking(true)
        .map_err(|e| error(NCCL_SYSTEM_ERROR, format!("listen: {e}")))?;
    let addr = l
        .local_addr()
        .map_err(|e| error(NCCL_SYSTEM_ERROR, format!("listen: {e}")))?;
    let id = token() as u64;
    *handle = encode_handle(addr, id);
    let t = token();
    registry().lock().objs.insert(
        t,
        Obj::Listen(Arc::new(Listen {
            id,
            listener: l,
            st: Mutex::new(ListenState::default()),
        })),
    );
    crate::info(&format!(
        "listen on device {dev} ({}) at {addr} (comm {t:#x})",
        d.name
    ));
    Ok(t)
}

pub fn close_listen(t: usize) -> R<()> {
    let o = registry().lock().objs.remove(&t);
    match o {
        Some(Obj::Listen(_)) => Ok(()),
        Some(other) => {
            registry().lock().objs.insert(t, other);
            Err(violation(
                NCCL_INVALID_ARGUMENT,
                format!("closeListen of {t:#x}, which is not a listen comm"),
            ))
        }
        None => Err(violation(
            NCCL_INVALID_ARGUMENT,
            format!("closeListen of {t:#x}: not a live comm"),
        )),
    }
}

// ------------------------------------------------------------ connect

struct PendingConnect {
    result: Mutex<Option<Result<TcpStream, String>>>,
    calls: AtomicU32,
}

fn connects_started() -> &'static AtomicU64 {
    static N: AtomicU64 = AtomicU64::new(0);
    &N
}

pub fn connect(dev: c_int, handle: &mut [u8; NCCL_NET_HANDLE_MAXSIZE]) -> R<Option<usize>> {
    device(dev, "connect")?;
    let (addr, listen_id, stage) = decode_handle(handle)?;
    let cfg = EmuConfig::from_env();
    if stage == 0 {
        let n = connects_started().fetch_add(1, Ordering::Relaxed);
        if cfg.refuse || cfg.refuse_after.is_some_and(|k| n >= k) {
            return Err(error(
                NCCL_SYSTEM_ERROR,
                format!("connect to {addr}: refused (fault injection: NCCL_NET_EMU_REFUSE / _REFUSE_AFTER)"),
            ));
        }
        let p = Arc::new(PendingConnect {
            result: Mutex::new(None),
            calls: AtomicU32::new(1),
        });
        let id = token() as u64;
        registry().lock().pending.insert(id, p.clone());
        handle[STAGE_AT..STAGE_AT + 8].copy_from_slice(&id.to_le_bytes());
        let cost = cfg.socket_cost();
        std::thread::Builder::new()
            .name("emu-connect".into())
            .spawn(move || {
                let r = (|| -> Result<TcpStream, String> {
                    // TCPX sleeps 100 ms before each of its sockets.
                    std::thread::sleep(cost);
                    let mut s = TcpStream::connect_timeout(&addr, Duration::from_secs(20))
                        .map_err(|e| format!("connect to {addr}: {e}"))?;
                    s.set_nodelay(true).map_err(|e| e.to_string())?;
                    let mut hello = [0u8; 16];
                    hello[0..8].copy_from_slice(&HELLO_MAGIC.to_le_bytes());
                    hello[8..16].copy_from_slice(&listen_id.to_le_bytes());
                    s.write_all(&hello)
                        .map_err(|e| format!("connect to {addr}: {e}"))?;
                    // As TCPX: the comm is ours only once the peer's accept
                    // has run (and programmed flow steering).
                    let mut ack = [0u8; 1];
                    s.set_read_timeout(Some(ACCEPT_WAIT))
                        .and_then(|_| s.read_exact(&mut ack))
                        .map_err(|e| {
                            format!("connect to {addr}: waiting for the peer's accept: {e}")
                        })?;
                    if ack[0] != ACCEPTED {
                        return Err(format!(
                            "connect to {addr}: the peer's accept answered {:#x}",
                            ack[0]
                        ));
                    }
                    s.set_read_timeout(None).map_err(|e| e.to_string())?;
                    Ok(s)
                })();
                *p.result.lock() = Some(r);
            })
            .map_err(|e| {
                error(
                    NCCL_SYSTEM_ERROR,
                    format!("connect: spawning a thread: {e}"),
                )
            })?;
        // Like TCPX, the first call never returns a comm: call again.
        return Ok(None);
    }
    let p = registry().lock().pending.get(&stage).cloned().ok_or_else(|| {
        violation(
            NCCL_INVALID_ARGUMENT,
            "connect: the handle's connect state is unknown (pass the same handle buffer on every call until a comm is returned)",
        )
    })?;
    let calls = p.calls.fetch_add(1, Ordering::Relaxed) + 1;
    let finished = p.result.lock().take();
    let r = match finished {
        None => return Ok(None),
        Some(r) if calls <= cfg.connect_nulls => {
            *p.result.lock() = Some(r);
            return Ok(None);
        }
        Some(r) => r,
    };
    registry().lock().pending.remove(&stage);
    handle[STAGE_AT..STAGE_AT + 8].fill(0);
    let sock = r.map_err(|e| error(NCCL_SYSTEM_ERROR, e))?;
    let t = token();
    let comm = SendComm::start(t, sock, cfg)?;
    registry().lock().objs.insert(t, Obj::Send(comm));
    crate::info(&format!("connected to {addr} (send comm {t:#x})"));
    Ok(Some(t))
}

// ------------------------------------------------------------ accept

/// What accept tells about the receive comm's device handle.
pub struct Accepted {
    pub comm: usize,
    pub unpack: Option<(u64, usize)>,
}

pub fn accept(t: usize) -> R<Option<Accepted>> {
    let l = match obj(t, "accept")? {
        Obj::Listen(l) => l,
        _ => {
            return Err(violation(
                NCCL_INVALID_ARGUMENT,
                format!("accept on {t:#x}, which is not a listen comm"),
            ))
        }
    };
    let cfg = EmuConfig::from_env();
    let mut st = l.st.lock();
    let first_call = *st.first_call.get_or_insert_with(Instant::now);
    if st.ready.is_none() {
        match l.listener.accept() {
            Ok((mut s, peer)) => {
                let ok = s.set_nonblocking(false).is_ok()
                    && s.set_read_timeout(Some(Duration::from_secs(5))).is_ok();
                let mut hello = [0u8; 16];
                let ok = ok && s.read_exact(&mut hello).is_ok();
                let magic = u64::from_le_bytes(hello[0..8].try_into().unwrap_or_default());
                let id = u64::from_le_bytes(hello[8..16].try_into().unwrap_or_default());
                if ok && magic == HELLO_MAGIC && id == l.id {
                    let _ = s.set_read_timeout(None);
                    let _ = s.set_nodelay(true);
                    st.ready = Some(s);
                    st.arrived = Some(Instant::now());
                } else {
                    crate::warn(&format!(
                        "accept: dropped a connection from {peer} without a valid hello"
                    ));
                }
            }
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {}
            Err(e) => return Err(error(NCCL_SYSTEM_ERROR, format!("accept: {e}"))),
        }
    }
    if st.nulls < cfg.accept_nulls {
        // Like TCPX, accept needs to be called again (at least once).
        st.nulls += 1;
        return Ok(None);
    }
    let Some(arrived) = st.ready.as_ref().and(st.arrived) else {
        return Ok(None);
    };
    // As TCPX's accept thread: 100 ms before each socket, then the
    // flow-steering wait once they are all in.
    let ready_at = (first_call + cfg.socket_cost()).max(arrived) + cfg.steer_wait;
    if Instant::now() < ready_at {
        return Ok(None);
    }
    let Some(mut sock) = st.ready.take() else {
        return Ok(None);
    };
    st.first_call = None;
    st.arrived = None;
    st.nulls = 0;
    drop(st);
    sock.write_all(&[ACCEPTED])
        .map_err(|e| error(NCCL_SYSTEM_ERROR, format!("accept: {e}")))?;
    let rt = token();
    let device = cuda::current_device();
    let comm = RecvComm::start(rt, sock, cfg, device)?;
    let unpack = comm
        .unpack
        .as_ref()
        .map(|u| (u.handle_value, std::mem::size_of::<UnpackNetDeviceHandle>()));
    crate::info(&format!(
        "accepted (receive comm {rt:#x}, {})",
        match (&comm.unpack, device) {
            (Some(_), Some(d)) => format!("UNPACK, bounce pool on GPU {d}"),
            (Some(_), None) => "UNPACK, bounce pool in host memory".into(),
            (None, _) => "plain".into(),
        }
    ));
    registry().lock().objs.insert(rt, Obj::Recv(comm));
    Ok(Some(Accepted { comm: rt, unpack }))
}

// ------------------------------------------------------------ common

pub fn reg_mr(t: usize, data: u64, size: usize, ty: c_int) -> R<usize> {
    match obj(t, "regMr")? {
        Obj::Send(c) => reg_mr_in(&c.mrs, data, size, ty),
        Obj::Recv(c) => reg_mr_in(&c.mrs, data, size, ty),
        Obj::Listen(_) => Err(violation(NCCL_INVALID_ARGUMENT, "regMr on a listen comm")),
    }
}

pub fn dereg_mr(t: usize, mh: usize) -> R<()> {
    let removed = match obj(t, "deregMr")? {
        Obj::Send(c) => c.mrs.lock().remove(&mh),
        Obj::Recv(c) => c.mrs.lock().remove(&mh),
        Obj::Listen(_) => None,
    };
    removed.map(|_| ()).ok_or_else(|| {
        violation(
            NCCL_INVALID_ARGUMENT,
            format!("deregMr of {mh:#x}: not registered with this comm"),
        )
    })
}

pub fn close(t: usize, want_send: bool) -> R<()> {
    let o = registry().lock().objs.remove(&t);
    match (o, want_send) {
        (Some(Obj::Send(c)), true) => {
            close_send_comm(&c);
            crate::info(&format!("closed send comm {:#x}", c.token));
            Ok(())
        }
        (Some(Obj::Recv(c)), false) => {
            close_recv_comm(&c);
            crate::info(&format!("closed receive comm {t:#x}"));
            Ok(())
        }
        (Some(other), _) => {
            registry().lock().objs.insert(t, other);
            Err(violation(
                NCCL_INVALID_ARGUMENT,
                format!(
                    "{} of {t:#x}, which is another kind of comm",
                    if want_send { "closeSend" } else { "closeRecv" }
                ),
            ))
        }
        (None, _) => Err(violation(
            NCCL_INVALID_ARGUMENT,
            format!("close of {t:#x}: not a live comm"),
        )),
    }
}

/// Accept of receive comm `t` was given no device-handle storage.
pub fn mark_no_dev_handle(t: usize) {
    if let Ok(Obj::Recv(c)) = obj(t, "accept") {
        c.no_dev_handle.store(true, Ordering::Relaxed);
    }
}

/// Whether `t` is a receive comm in UNPACK mode (for iflush).
pub fn is_unpack_recv(t: usize) -> R<bool> {
    match obj(t, "iflush")? {
        Obj::Recv(c) => Ok(c.unpack.is_some()),
        _ => Err(violation(
            NCCL_INVALID_ARGUMENT,
            format!("iflush on {t:#x}, which is not a receive comm"),
        )),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn handles_round_trip() {
        let a: SocketAddr = "127.0.0.1:4242".parse().unwrap();
        let h = encode_handle(a, 77);
        let (b, id, stage) = decode_handle(&h).unwrap();
        assert_eq!((b, id, stage), (a, 77, 0));
        assert!(decode_handle(&[0u8; 128]).is_err());
    }
}
