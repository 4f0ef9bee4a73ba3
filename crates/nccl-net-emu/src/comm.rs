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

use parking_lot::{Condvar, Mutex};
use tcpx_p2p::internal::gpu;
use tcpx_p2p::internal::plugin::sys::*;

use crate::config::EmuConfig;
use crate::cuda::{self, HostMem, MappedMem};
use crate::pool::{self, BouncePool, Lease, PoolKind, Rng, BLOCK, PAGE};
use crate::stage::{self, RxStage, TxStage};
use tcpx_p2p::internal::timing::{self, Spent};

/// Requests in flight per comm, as TCPX's MAX_REQUESTS.
pub const MAX_REQUESTS: usize = 16;
/// The largest UNPACK receive TCPX survives (2048 fragments).
pub const MAX_UNPACK_RECV: usize = 4 << 20;
const HANDLE_MAGIC: &[u8; 8] = b"EMUNETv1";
const HELLO_MAGIC: u64 = 0x4f4c_4c45_4855_4d45; // "EMUHELLO"
const MSG_MAGIC: u32 = 0x3155_4d45; // "EMU1"
const HDR: usize = 24;
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
}

pub fn listen(dev: c_int, handle: &mut [u8; NCCL_NET_HANDLE_MAXSIZE]) -> R<usize> {
    if dev != 0 {
        return Err(error(
            NCCL_INVALID_ARGUMENT,
            format!("listen on device {dev}: there is only device 0"),
        ));
    }
    let cfg = EmuConfig::from_env();
    let l = TcpListener::bind(SocketAddr::new(cfg.addr, 0))
        .map_err(|e| error(NCCL_SYSTEM_ERROR, format!("listen: bind {}: {e}", cfg.addr)))?;
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
    crate::info(&format!("listen on {addr} (comm {t:#x})"));
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
    if dev != 0 {
        return Err(error(
            NCCL_INVALID_ARGUMENT,
            format!("connect on device {dev}: there is only device 0"),
        ));
    }
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
        std::thread::Builder::new()
            .name("emu-connect".into())
            .spawn(move || {
                let r = (|| -> Result<TcpStream, String> {
                    let mut s = TcpStream::connect_timeout(&addr, Duration::from_secs(20))
                        .map_err(|e| format!("connect to {addr}: {e}"))?;
                    s.set_nodelay(true).map_err(|e| e.to_string())?;
                    let mut hello = [0u8; 16];
                    hello[0..8].copy_from_slice(&HELLO_MAGIC.to_le_bytes());
                    hello[8..16].copy_from_slice(&listen_id.to_le_bytes());
                    s.write_all(&hello)
                        .map_err(|e| format!("connect to {addr}: {e}"))?;
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
    let Some(sock) = st.ready.take() else {
        return Ok(None);
    };
    drop(st);
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

// ------------------------------------------------------------ send comm

struct SendOp {
    seq: u64,
    addr: u64,
    len: usize,
    kind: MemKind,
    cell: Arc<Cell>,
}

struct SendShared {
    failed: Mutex<Option<String>>,
}

struct SendState {
    q: VecDeque<(u64, usize, Arc<Cell>)>,
    next_seq: u64,
}

pub struct SendComm {
    token: usize,
    cfg: EmuConfig,
    sock: TcpStream,
    tx: Mutex<Option<mpsc::Sender<SendOp>>>,
    thread: Mutex<Option<JoinHandle<()>>>,
    shared: Arc<SendShared>,
    st: Mutex<SendState>,
    mrs: Mutex<HashMap<usize, Mr>>,
}

impl SendComm {
    fn start(token: usize, sock: TcpStream, cfg: EmuConfig) -> R<Arc<SendComm>> {
        let shared = Arc::new(SendShared {
            failed: Mutex::new(None),
        });
        let io = sock
            .try_clone()
            .map_err(|e| error(NCCL_SYSTEM_ERROR, format!("connect: {e}")))?;
        let (tx, rx) = mpsc::channel::<SendOp>();
        let sh = shared.clone();
        let (drop_after, bufs) = (cfg.drop_after, cfg.stage_bufs);
        let thread = std::thread::Builder::new()
            .name("emu-tx".into())
            .spawn(move || {
                let sh2 = sh.clone();
                let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                    tx_loop(io, rx, sh, drop_after, bufs)
                }));
                if r.is_err() {
                    sh2.failed
                        .lock()
                        .get_or_insert_with(|| "send thread panicked".into());
                }
            })
            .map_err(|e| error(NCCL_SYSTEM_ERROR, format!("spawning the send thread: {e}")))?;
        Ok(Arc::new(SendComm {
            token,
            cfg,
            sock,
            tx: Mutex::new(Some(tx)),
            thread: Mutex::new(Some(thread)),
            shared,
            st: Mutex::new(SendState {
                q: VecDeque::new(),
                next_seq: 0,
            }),
            mrs: Mutex::new(HashMap::new()),
        }))
    }
}

/// A send waiting in the send thread: `allowed` of its bytes go out (fewer
/// under fault injection), the copies of `staged` of them out of GPU memory
/// are queued.
struct TxItem {
    op: SendOp,
    allowed: usize,
    staged: usize,
}

/// A send thread's sends in order, and its staging.
struct TxState {
    items: VecDeque<TxItem>,
    stage: Option<TxStage>,
    /// Bytes given to the socket or planned for it, for fault injection.
    planned: u64,
    drop_after: Option<u64>,
    bufs: usize,
}

impl TxState {
    /// Moves the sends posted since into `items` (without waiting).
    fn take_posted(&mut self, rx: &mpsc::Receiver<SendOp>) {
        while let Ok(op) = rx.try_recv() {
            self.push(op);
        }
    }

    fn push(&mut self, op: SendOp) {
        let allowed = self.drop_after.map_or(op.len, |limit| {
            (limit.saturating_sub(self.planned) as usize).min(op.len)
        });
        self.planned += allowed as u64;
        self.items.push_back(TxItem {
            op,
            allowed,
            staged: 0,
        });
    }

    /// Queues copies out of GPU memory for the sends, in order, while the
    /// stage has a free buffer. Stops at a send of another GPU: the stage
    /// is rebuilt for it once everything before it is written.
    fn stage_ahead(&mut self) -> Result<(), String> {
        let Some(stg) = self.stage.as_mut() else {
            return Ok(());
        };
        for it in self.items.iter_mut() {
            let MemKind::Cuda(dev) = it.op.kind else {
                continue;
            };
            if dev != stg.dev() {
                break;
            }
            while it.staged < it.allowed {
                if !stg.has_room() {
                    return Ok(());
                }
                let l = stage::SLOT.min(it.allowed - it.staged);
                // SAFETY: the range lies inside the send's registration and
                // the caller keeps it until the send is reported done, which
                // is after its bytes were written (or the stage was reset).
                unsafe { stg.queue(it.op.addr + it.staged as u64, l) }?;
                it.staged += l;
            }
        }
        Ok(())
    }

    /// Writes the payload of the oldest send: host memory straight from the
    /// buffer, GPU memory from its staged copies, queueing further copies
    /// (of this send and the next) as buffers free up.
    fn write_front(
        &mut self,
        s: &mut &TcpStream,
        rx: &mpsc::Receiver<SendOp>,
    ) -> Result<(), String> {
        let (kind, addr, allowed) = {
            let it = &self.items[0];
            (it.op.kind, it.op.addr, it.allowed)
        };
        match kind {
            MemKind::Host => {
                // SAFETY: the range was checked against the comm's
                // registration and stays valid until the request is
                // reported done.
                let data = unsafe { std::slice::from_raw_parts(addr as *const u8, allowed) };
                s.write_all(data).map_err(|e| e.to_string())?;
                timing::mark(Spent::Socket);
                Ok(())
            }
            MemKind::Cuda(dev) => {
                if self.stage.as_ref().is_none_or(|st| st.dev() != dev) {
                    // Everything staged before was written: nothing is queued.
                    self.stage = None;
                    self.stage = Some(TxStage::new(dev, self.bufs)?);
                }
                let mut written = 0;
                while written < allowed {
                    self.take_posted(rx);
                    self.stage_ahead()?;
                    let stg = self.stage.as_mut().ok_or("staging")?;
                    timing::mark(Spent::Other);
                    let chunk = stg.front()?;
                    timing::mark(Spent::Copies);
                    s.write_all(chunk).map_err(|e| e.to_string())?;
                    timing::mark(Spent::Socket);
                    written += chunk.len();
                    stg.pop();
                }
                Ok(())
            }
        }
    }

    /// No copy may read a send's memory once it is reported.
    fn reset_stage(&mut self) {
        if let Some(st) = self.stage.as_mut() {
            st.reset();
        }
    }
}

fn tx_loop(
    sock: TcpStream,
    rx: mpsc::Receiver<SendOp>,
    sh: Arc<SendShared>,
    drop_after: Option<u64>,
    bufs: usize,
) {
    let mut tx = TxState {
        items: VecDeque::new(),
        stage: None,
        planned: 0,
        drop_after,
        bufs,
    };
    let _account = stage::account(|| {
        let peer = sock.peer_addr().map(|a| a.to_string()).unwrap_or_default();
        format!("emu tx to {peer}")
    });
    let mut s = &sock;
    loop {
        if tx.items.is_empty() {
            timing::mark(Spent::Other);
            let op = rx.recv();
            timing::mark(Spent::Waiting);
            match op {
                Ok(op) => tx.push(op),
                Err(_) => return,
            }
        }
        tx.take_posted(&rx);
        if let Some(f) = sh.failed.lock().clone() {
            tx.reset_stage();
            for it in tx.items.drain(..) {
                it.op.cell.fail(&f);
            }
            continue;
        }
        let (seq, len, allowed) = {
            let it = &tx.items[0];
            (it.op.seq, it.op.len, it.allowed)
        };
        let mut hdr = [0u8; HDR];
        hdr[0..4].copy_from_slice(&MSG_MAGIC.to_le_bytes());
        hdr[8..16].copy_from_slice(&seq.to_le_bytes());
        hdr[16..24].copy_from_slice(&(len as u64).to_le_bytes());
        timing::mark(Spent::Other);
        let r = s.write_all(&hdr).map_err(|e| e.to_string()).and_then(|_| {
            if allowed == 0 {
                Ok(())
            } else {
                tx.write_front(&mut s, &rx)
            }
        });
        let why = match r {
            Err(e) => Some(format!("send: {e}")),
            Ok(()) if allowed < len => {
                crate::warn(&format!(
                    "fault injection: dropping the peer after {} bytes (NCCL_NET_EMU_DROP_AFTER_BYTES)",
                    tx.planned
                ));
                let _ = sock.shutdown(std::net::Shutdown::Both);
                Some(format!(
                    "connection dropped after {} bytes (fault injection)",
                    tx.planned
                ))
            }
            Ok(()) => None,
        };
        let Some(it) = tx.items.pop_front() else {
            continue;
        };
        timing::bytes(HDR + allowed);
        match why {
            None => it.op.cell.done(len, None),
            Some(w) => {
                tx.reset_stage();
                it.op.cell.fail(&w);
                sh.failed.lock().get_or_insert(w);
            }
        }
    }
}

pub fn isend(t: usize, data: u64, size: c_int, mh: usize) -> R<usize> {
    let c = match obj(t, "isend")? {
        Obj::Send(c) => c,
        _ => {
            return Err(violation(
                NCCL_INVALID_ARGUMENT,
                format!("isend on {t:#x}, which is not a send comm"),
            ))
        }
    };
    if size < 0 {
        return Err(violation(
            NCCL_INVALID_ARGUMENT,
            format!("isend of {size} bytes"),
        ));
    }
    if let Some(f) = c.shared.failed.lock().clone() {
        return Err(error(NCCL_REMOTE_ERROR, f));
    }
    let mr = find_mr(&c.mrs, mh, data, size as usize, "isend")?;
    let mut st = c.st.lock();
    if st.q.len() >= MAX_REQUESTS {
        return Err(violation(
            NCCL_INTERNAL_ERROR,
            format!("isend: request {} in flight on send comm {t:#x}; TCPX allows {MAX_REQUESTS} per comm", st.q.len() + 1),
        ));
    }
    let seq = st.next_seq;
    st.next_seq += 1;
    let cell = Cell::new();
    let rt = token();
    registry()
        .lock()
        .reqs
        .insert(rt, ReqOwner::Send(c.clone(), seq));
    st.q.push_back((seq, rt, cell.clone()));
    drop(st);
    let op = SendOp {
        seq,
        addr: data,
        len: size as usize,
        kind: mr.kind,
        cell,
    };
    let sent =
        c.tx.lock()
            .as_ref()
            .map(|tx| tx.send(op).is_ok())
            .unwrap_or(false);
    if !sent {
        return Err(error(NCCL_SYSTEM_ERROR, "isend: the send thread is gone"));
    }
    Ok(rt)
}

fn test_send(c: &Arc<SendComm>, seq: u64) -> R<Option<usize>> {
    let mut st = c.st.lock();
    let Some((head, rt, cell)) = st.q.front().cloned() else {
        return Err(violation(
            NCCL_INTERNAL_ERROR,
            "test of a send request that is not in flight",
        ));
    };
    if head != seq {
        return Err(violation(
            NCCL_INTERNAL_ERROR,
            format!("test of send request #{seq} while #{head} is the oldest; TCPX tests only the FIFO head"),
        ));
    }
    let failed = c.shared.failed.lock().clone();
    match look(&cell, c.cfg.delay, failed)? {
        Seen::NotYet => Ok(None),
        Seen::Done(n) => {
            st.q.pop_front();
            drop(st);
            unregister_reqs(&[rt]);
            Ok(Some(n))
        }
    }
}

fn close_send_comm(c: &Arc<SendComm>) {
    c.shared
        .failed
        .lock()
        .get_or_insert_with(|| "comm closed".into());
    let _ = c.sock.shutdown(std::net::Shutdown::Both);
    c.tx.lock().take();
    join(c.thread.lock().take());
    let tokens: Vec<usize> = c.st.lock().q.drain(..).map(|(_, t, _)| t).collect();
    unregister_reqs(&tokens);
    c.mrs.lock().clear();
}

fn join(t: Option<JoinHandle<()>>) {
    let Some(t) = t else { return };
    let deadline = Instant::now() + Duration::from_secs(5);
    while !t.is_finished() && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(1));
    }
    if t.is_finished() {
        let _ = t.join();
    }
}

// ------------------------------------------------------------ receive comm

/// The UNPACK resources of one receive comm.
struct UnpackRes {
    pool: Arc<BouncePool>,
    /// Host address of the comm's netUnpackMeta.
    meta: *mut NetUnpackMeta,
    _meta_mem: Box<dyn Send + Sync>,
    /// What goes into the device handle's `handle`: a device pointer to the
    /// unpackNetDeviceHandle (GPU pool) or a host pointer (host pool).
    handle_value: u64,
    _handle_mem: Box<dyn Send + Sync>,
    seed: u64,
}

// SAFETY: `meta` points into `_meta_mem`, owned here; the I/O thread writes a
// slot only while its receive is unfinished, readers read it only after.
unsafe impl Send for UnpackRes {}
// SAFETY: as above.
unsafe impl Sync for UnpackRes {}

struct HostHandle(Box<UnpackNetDeviceHandle>);
// SAFETY: plain data the plugin never mutates after accept.
unsafe impl Send for HostHandle {}
// SAFETY: as above.
unsafe impl Sync for HostHandle {}

fn pools() -> &'static Mutex<HashMap<PoolKind, Arc<BouncePool>>> {
    static P: OnceLock<Mutex<HashMap<PoolKind, Arc<BouncePool>>>> = OnceLock::new();
    P.get_or_init(Default::default)
}

/// The process's bounce pool of `kind` (made once, never freed).
fn pool(kind: PoolKind, cfg: &EmuConfig) -> R<Arc<BouncePool>> {
    let mut map = pools().lock();
    if let Some(p) = map.get(&kind) {
        return Ok(p.clone());
    }
    let mut rng = Rng::new(cfg.seed ^ 0x5eed);
    let p = match kind {
        PoolKind::Host => {
            let bytes = cfg.pool_bytes_host;
            let mem = HostMem::new(bytes).map_err(|e| error(NCCL_SYSTEM_ERROR, e))?;
            let base = mem.addr();
            BouncePool::new(kind, base, bytes, Box::new(mem), &mut rng)
        }
        PoolKind::Gpu(d) => {
            let bytes = cfg.pool_bytes_gpu;
            let dev =
                gpu::Device::get(d).map_err(|e| error(NCCL_UNHANDLED_CUDA_ERROR, e.to_string()))?;
            let mem = gpu::DeviceBuf::new(&dev, bytes)
                .map_err(|e| error(NCCL_UNHANDLED_CUDA_ERROR, e.to_string()))?;
            let base = mem.ptr;
            BouncePool::new(kind, base, bytes, Box::new(mem), &mut rng)
        }
    };
    let p = Arc::new(p);
    map.insert(kind, p.clone());
    crate::info(&format!(
        "bounce pool {kind:?}: {} blocks of {BLOCK} bytes",
        p.blocks
    ));
    Ok(p)
}

impl UnpackRes {
    fn new(device: Option<i32>, cfg: &EmuConfig, token: usize) -> R<UnpackRes> {
        let meta_len = std::mem::size_of::<NetUnpackMeta>();
        let hsize = std::mem::size_of::<UnpackNetDeviceHandle>();
        let cu = |e: String| error(NCCL_UNHANDLED_CUDA_ERROR, e);
        match device {
            Some(d) => {
                let pool = pool(PoolKind::Gpu(d), cfg)?;
                let meta = MappedMem::new(d, meta_len).map_err(cu)?;
                let dh = UnpackNetDeviceHandle {
                    meta: meta.dev_addr as *mut NetUnpackMeta,
                    bounce_buf: pool.base as *mut std::ffi::c_void,
                    head: u64::MAX,
                };
                let dev = gpu::Device::get(d).map_err(|e| cu(e.to_string()))?;
                let hmem = gpu::DeviceBuf::new(&dev, hsize).map_err(|e| cu(e.to_string()))?;
                // SAFETY: the device buffer holds `hsize` bytes; `dh` is a host
                // struct of that size.
                unsafe {
                    cuda::htod(
                        hmem.ptr,
                        &dh as *const UnpackNetDeviceHandle as *const u8,
                        hsize,
                    )
                }
                .map_err(cu)?;
                Ok(UnpackRes {
                    pool,
                    meta: meta.host_addr() as *mut NetUnpackMeta,
                    handle_value: hmem.ptr,
                    _meta_mem: Box::new(meta),
                    _handle_mem: Box::new(hmem),
                    seed: cfg.seed ^ token as u64,
                })
            }
            None => {
                let pool = pool(PoolKind::Host, cfg)?;
                let meta = HostMem::new(meta_len).map_err(|e| error(NCCL_SYSTEM_ERROR, e))?;
                let h = HostHandle(Box::new(UnpackNetDeviceHandle {
                    meta: meta.addr() as *mut NetUnpackMeta,
                    bounce_buf: pool.base as *mut std::ffi::c_void,
                    head: u64::MAX,
                }));
                let handle_value = &*h.0 as *const UnpackNetDeviceHandle as u64;
                Ok(UnpackRes {
                    pool,
                    meta: meta.addr() as *mut NetUnpackMeta,
                    handle_value,
                    _meta_mem: Box::new(meta),
                    _handle_mem: Box::new(h),
                    seed: cfg.seed ^ token as u64,
                })
            }
        }
    }

    /// Publishes the fragments of `slot`: entries first, then the count.
    fn publish(&self, slot: usize, metas: &[LoadMeta]) {
        for (i, m) in metas.iter().enumerate() {
            // SAFETY: `meta` is this comm's netUnpackMeta; slot < 16 and
            // i < 2048 (plans never exceed it); nobody reads this slot until
            // the receive is reported done.
            unsafe { std::ptr::addr_of_mut!((*self.meta).mem[slot][i]).write_volatile(*m) };
        }
        std::sync::atomic::fence(Ordering::SeqCst);
        // SAFETY: as above.
        unsafe {
            std::ptr::addr_of_mut!((*self.meta).cnt[slot]).write_volatile(metas.len() as u64)
        };
        std::sync::atomic::fence(Ordering::SeqCst);
    }
}

struct PostedRecv {
    seq: u64,
    addr: u64,
    cap: usize,
    kind: MemKind,
    slot: usize,
    cell: Arc<Cell>,
}

struct RecvShared {
    posted: Mutex<VecDeque<PostedRecv>>,
    cv: Condvar,
    closing: AtomicBool,
    failed: Mutex<Option<String>>,
}

struct RecvEntry {
    seq: u64,
    token: usize,
    cell: Arc<Cell>,
    tested: bool,
}

struct RecvState {
    q: VecDeque<RecvEntry>,
    posted: u64,
}

pub struct RecvComm {
    cfg: EmuConfig,
    sock: TcpStream,
    thread: Mutex<Option<JoinHandle<()>>>,
    shared: Arc<RecvShared>,
    st: Mutex<RecvState>,
    mrs: Mutex<HashMap<usize, Mr>>,
    unpack: Option<Arc<UnpackRes>>,
    device: Option<i32>,
}

impl RecvComm {
    fn start(
        token: usize,
        sock: TcpStream,
        cfg: EmuConfig,
        device: Option<i32>,
    ) -> R<Arc<RecvComm>> {
        let unpack = if cfg.unpack {
            Some(Arc::new(UnpackRes::new(device, &cfg, token)?))
        } else {
            None
        };
        let shared = Arc::new(RecvShared {
            posted: Mutex::new(VecDeque::new()),
            cv: Condvar::new(),
            closing: AtomicBool::new(false),
            failed: Mutex::new(None),
        });
        let io = sock
            .try_clone()
            .map_err(|e| error(NCCL_SYSTEM_ERROR, format!("accept: {e}")))?;
        let (sh, un, c2) = (shared.clone(), unpack.clone(), cfg.clone());
        let thread = std::thread::Builder::new()
            .name("emu-rx".into())
            .spawn(move || {
                let sh2 = sh.clone();
                let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                    rx_loop(io, sh, un, c2, device)
                }));
                if r.is_err() {
                    fail_recv(&sh2, "receive thread panicked".into());
                }
            })
            .map_err(|e| {
                error(
                    NCCL_SYSTEM_ERROR,
                    format!("spawning the receive thread: {e}"),
                )
            })?;
        Ok(Arc::new(RecvComm {
            cfg,
            sock,
            thread: Mutex::new(Some(thread)),
            shared,
            st: Mutex::new(RecvState {
                q: VecDeque::new(),
                posted: 0,
            }),
            mrs: Mutex::new(HashMap::new()),
            unpack,
            device,
        }))
    }
}

fn fail_recv(sh: &RecvShared, why: String) {
    sh.failed.lock().get_or_insert(why.clone());
    for p in sh.posted.lock().drain(..) {
        p.cell.fail(&why);
    }
    sh.cv.notify_all();
}

/// A received message whose payload is landing in GPU memory: reported
/// (its loadMeta published first, in UNPACK mode) once its copies are in.
struct Arrived {
    p: PostedRecv,
    len: usize,
    lease: Option<Lease>,
    metas: Option<Vec<LoadMeta>>,
}

impl Arrived {
    fn new(p: PostedRecv, len: usize, lease: Option<Lease>, metas: Option<Vec<LoadMeta>>) -> Self {
        Arrived {
            p,
            len,
            lease,
            metas,
        }
    }
}

fn report(un: Option<&UnpackRes>, a: Arrived) {
    if let (Some(u), Some(m)) = (un, &a.metas) {
        u.publish(a.p.slot, m);
    }
    a.p.cell.done(a.len, a.lease);
}

type Landing = Option<RxStage<Arrived>>;

/// Reports every message still landing, once its copies are in.
fn land_all(stage: &mut Landing, done: &mut impl FnMut(Arrived)) -> Result<(), String> {
    match stage.as_mut().filter(|s| s.pending()) {
        Some(st) => st.finish(done),
        None => Ok(()),
    }
}

/// Reports `a` now -- after every message still landing, so that receives
/// complete in order.
fn report_now(
    stage: &mut Landing,
    done: &mut impl FnMut(Arrived),
    a: Arrived,
) -> Result<(), String> {
    land_all(stage, done)?;
    done(a);
    Ok(())
}

/// The receive staging for GPU `dev` (the one before, if for another GPU,
/// finished first).
fn stage_for<'a>(
    stage: &'a mut Landing,
    dev: i32,
    bufs: usize,
    done: &mut impl FnMut(Arrived),
) -> Result<&'a mut RxStage<Arrived>, String> {
    if let Some(st) = stage.as_mut().filter(|s| s.dev() != dev) {
        st.finish(done)?;
        *stage = None;
    }
    if stage.is_none() {
        *stage = Some(RxStage::new(dev, bufs)?);
    }
    stage.as_mut().ok_or_else(|| "staging".to_string())
}

/// Whether bytes (or the end) wait to be read, without waiting.
fn readable(sock: &TcpStream) -> bool {
    use std::os::fd::AsRawFd;
    let mut pfd = libc::pollfd {
        fd: sock.as_raw_fd(),
        events: libc::POLLIN,
        revents: 0,
    };
    // SAFETY: one valid pollfd, no timeout.
    let n = unsafe { libc::poll(&mut pfd, 1, 0) };
    n > 0
}

fn rx_loop(
    sock: TcpStream,
    sh: Arc<RecvShared>,
    un: Option<Arc<UnpackRes>>,
    cfg: EmuConfig,
    device: Option<i32>,
) {
    if let Some(d) = device {
        if let Err(e) = cuda::bind(d) {
            fail_recv(&sh, format!("receive thread: {e}"));
            return;
        }
    }
    let unr = un.as_deref();
    let mut done = |a: Arrived| report(unr, a);
    let mut stage: Landing = None;
    let res = rx_run(&sock, &sh, unr, &cfg, &mut stage, &mut done);
    // The messages read before the end are whole once their copies land.
    if let Some(st) = stage.as_mut() {
        if let Err(e) = st.finish(&mut done) {
            for a in st.abandon() {
                a.p.cell.fail(&e);
            }
        }
    }
    if let Err(why) = res {
        if !sh.closing.load(Ordering::Acquire) {
            fail_recv(&sh, why);
        }
    }
}

/// Receives messages until the comm closes (Ok) or fails (Err: why).
fn rx_run(
    sock: &TcpStream,
    sh: &RecvShared,
    un: Option<&UnpackRes>,
    cfg: &EmuConfig,
    stage: &mut Landing,
    done: &mut impl FnMut(Arrived),
) -> Result<(), String> {
    let peer = sock.peer_addr().map(|a| a.to_string()).unwrap_or_default();
    let mut r = sock;
    let mut rng = Rng::new(un.map_or(cfg.seed, |u| u.seed));
    let mut expect: u64 = 0;
    let _account = stage::account(|| format!("emu rx from {peer}"));
    loop {
        // Report what has landed; before waiting on a quiet socket, all.
        timing::mark(Spent::Other);
        if let Some(st) = stage.as_mut().filter(|s| s.pending()) {
            st.poll(done)?;
            if st.pending() && !readable(sock) {
                st.finish(done)?;
            }
        }
        timing::mark(Spent::Copies);
        let mut hdr = [0u8; HDR];
        let got = r.read_exact(&mut hdr);
        timing::mark(Spent::Waiting);
        if let Err(e) = got {
            if sh.closing.load(Ordering::Acquire) {
                return Ok(());
            }
            return Err(if e.kind() == std::io::ErrorKind::UnexpectedEof {
                format!("the peer {peer} closed the connection")
            } else {
                format!("receiving from {peer}: {e}")
            });
        }
        let magic = u32::from_le_bytes(hdr[0..4].try_into().unwrap_or_default());
        let seq = u64::from_le_bytes(hdr[8..16].try_into().unwrap_or_default());
        let len = u64::from_le_bytes(hdr[16..24].try_into().unwrap_or_default()) as usize;
        if magic != MSG_MAGIC || seq != expect {
            return Err(format!(
                "protocol error from {peer}: message #{seq} (expected #{expect})"
            ));
        }
        expect += 1;
        // The matching receive: the oldest posted one.
        let p = loop {
            let mut posted = sh.posted.lock();
            if sh.closing.load(Ordering::Acquire) {
                return Ok(());
            }
            if let Some(p) = posted.pop_front() {
                break p;
            }
            // The application may wait for the receives still landing
            // before it posts another.
            if stage.as_ref().is_some_and(|s| s.pending()) {
                drop(posted);
                land_all(stage, done)?;
                continue;
            }
            sh.cv.wait_for(&mut posted, Duration::from_millis(50));
        };
        timing::mark(Spent::Waiting);
        debug_assert_eq!(p.seq, seq);
        if len > p.cap {
            let why = format!(
                "a message of {len} bytes arrived for a receive of {} bytes",
                p.cap
            );
            crate::violation_log(&why);
            p.cell.fail(&why);
            return Err(why);
        }
        let cell = p.cell.clone();
        let res = match un {
            None => recv_plain(&mut r, p, len, cfg, stage, done),
            Some(u) => recv_unpack(&mut r, p, len, u, cfg, &mut rng, stage, done, &sh.closing),
        };
        timing::bytes(HDR + len);
        // Without late landing, each receive is reported once its copies
        // are in, before the next is read.
        let res = res.and_then(|()| {
            if cfg.land_late {
                Ok(())
            } else {
                land_all(stage, done)
            }
        });
        if let Err(e) = res {
            if sh.closing.load(Ordering::Acquire) {
                return Ok(());
            }
            let why = format!("receiving from {peer}: {e}");
            cell.fail(&why);
            return Err(why);
        }
    }
}

fn recv_plain(
    r: &mut &TcpStream,
    p: PostedRecv,
    len: usize,
    cfg: &EmuConfig,
    stage: &mut Landing,
    done: &mut impl FnMut(Arrived),
) -> Result<(), String> {
    let dev = match p.kind {
        MemKind::Cuda(dev) if len > 0 => dev,
        _ => {
            if len > 0 {
                // SAFETY: the receive buffer was checked against its
                // registration and belongs to the plugin until the receive
                // is reported done.
                let buf = unsafe { std::slice::from_raw_parts_mut(p.addr as *mut u8, len) };
                r.read_exact(buf).map_err(|e| e.to_string())?;
                timing::mark(Spent::Socket);
            }
            return report_now(stage, done, Arrived::new(p, len, None, None));
        }
    };
    let st = stage_for(stage, dev, cfg.stage_bufs, done)?;
    let addr = p.addr;
    let mut p = Some(p);
    let mut off = 0;
    while off < len {
        let l = stage::SLOT.min(len - off);
        let (i, buf) = st.buf(l, done)?;
        timing::mark(Spent::Copies);
        // SAFETY: the buffer holds ≥ l bytes and is ours until sealed.
        r.read_exact(unsafe { std::slice::from_raw_parts_mut(buf, l) })
            .map_err(|e| e.to_string())?;
        timing::mark(Spent::Socket);
        // SAFETY: l bytes were read into the buffer; the device range lies
        // inside the receive buffer, the plugin's until reported done.
        unsafe { st.queue(i, 0, addr + off as u64, l) }?;
        off += l;
        let last = (off == len)
            .then(|| p.take())
            .flatten()
            .map(|p| Arrived::new(p, len, None, None));
        st.seal(i, last)?;
    }
    timing::mark(Spent::Copies);
    Ok(())
}

/// Reads a message's fragments, in order, each to `at(fragment)`, with as
/// few system calls as the kernel allows (readv of up to IOV_MAX slices at
/// a time). TCPX's receive lands each page where it belongs inside the
/// kernel; one read per 4 KiB fragment capped a comm near 2 GB/s, an
/// overhead TCPX does not have.
///
/// # Safety
/// `at` must give, for each fragment, memory of its length that nothing
/// else touches during the read, no two fragments overlapping.
unsafe fn read_frags(
    r: &mut &TcpStream,
    plan: &[pool::Frag],
    at: impl Fn(&pool::Frag) -> *mut u8,
) -> Result<(), String> {
    const IOV_MAX: usize = 1024;
    let mut all: Vec<IoSliceMut<'_>> = plan
        .iter()
        // SAFETY: by the caller's contract.
        .map(|f| IoSliceMut::new(unsafe { std::slice::from_raw_parts_mut(at(f), f.len as usize) }))
        .collect();
    let mut dsts = &mut all[..];
    while !dsts.is_empty() {
        let k = dsts.len().min(IOV_MAX);
        let n = match r.read_vectored(&mut dsts[..k]) {
            Ok(0) => return Err("the peer closed the connection inside a message".into()),
            Ok(n) => n,
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
            Err(e) => return Err(e.to_string()),
        };
        IoSliceMut::advance_slices(&mut dsts, n);
    }
    Ok(())
}

#[allow(clippy::too_many_arguments)]
fn recv_unpack(
    r: &mut &TcpStream,
    p: PostedRecv,
    len: usize,
    u: &UnpackRes,
    cfg: &EmuConfig,
    rng: &mut Rng,
    stage: &mut Landing,
    done: &mut impl FnMut(Arrived),
    closing: &AtomicBool,
) -> Result<(), String> {
    let plan = pool::plan(len, cfg.split_pct, rng).inspect_err(|e| crate::violation_log(e))?;
    let blocks = pool::blocks_for(&plan);
    let lease = match u.pool.try_take(blocks)? {
        Some(l) => l,
        None => {
            // Messages still landing hold blocks until they are consumed.
            land_all(stage, done)?;
            let l = u.pool.take(blocks, closing)?;
            timing::mark(Spent::Waiting);
            l
        }
    };
    // The buffer the pages went through, for a GPU pool.
    let staged = match u.pool.kind {
        PoolKind::Host => {
            let base = u.pool.base;
            // SAFETY: each fragment has a page of its own (no two overlap)
            // in a block this message holds (leased), inside the pool's
            // memory; nobody else touches it until irecvConsumed returns
            // the lease.
            unsafe {
                read_frags(r, &plan, |f| {
                    let off = pool::page_offset(&lease.blocks, f.page) + f.in_page as usize;
                    (base + off as u64) as *mut u8
                })
            }?;
            timing::mark(Spent::Socket);
            None
        }
        PoolKind::Gpu(dev) => {
            // The leased pages as one image in a pinned buffer, then one
            // copy per block, landing while the next message is read.
            let st = stage_for(stage, dev, cfg.stage_bufs, done)?;
            timing::mark(Spent::Other);
            let (i, base) = st.buf(plan.len() * PAGE, done)?;
            timing::mark(Spent::Copies);
            // SAFETY: the buffer holds plan.len() pages and each fragment
            // lies inside a page of its own (no overlap); the buffer is ours
            // until sealed.
            unsafe {
                read_frags(r, &plan, |f| {
                    base.wrapping_add(f.page as usize * PAGE + f.in_page as usize)
                })
            }?;
            timing::mark(Spent::Socket);
            for (k, &b) in lease.blocks.iter().enumerate() {
                let pages = (plan.len() - k * pool::BLOCK_PAGES).min(pool::BLOCK_PAGES);
                // SAFETY: the buffer holds ≥ (k*64 + pages) pages; the
                // destination is a block of the pool held by this lease.
                unsafe {
                    st.queue(
                        i,
                        k * BLOCK,
                        u.pool.base + (b as usize * BLOCK) as u64,
                        pages * PAGE,
                    )
                }?;
            }
            Some(i)
        }
    };
    let metas = pool::load_metas(&plan, &lease.blocks, rng);
    let a = Arrived::new(p, len, Some(lease), Some(metas));
    match staged {
        Some(i) => stage.as_mut().ok_or("staging")?.seal(i, Some(a)),
        None => report_now(stage, done, a),
    }
}

pub fn irecv(t: usize, n: c_int, data: u64, size: c_int, mh: usize) -> R<usize> {
    if n != 1 {
        return Err(violation(
            NCCL_INTERNAL_ERROR,
            format!("irecv with n={n}; TCPX takes exactly one buffer (n == 1)"),
        ));
    }
    let c = match obj(t, "irecv")? {
        Obj::Recv(c) => c,
        _ => {
            return Err(violation(
                NCCL_INVALID_ARGUMENT,
                format!("irecv on {t:#x}, which is not a receive comm"),
            ))
        }
    };
    if size < 0 {
        return Err(violation(
            NCCL_INVALID_ARGUMENT,
            format!("irecv of {size} bytes"),
        ));
    }
    if let Some(f) = c.shared.failed.lock().clone() {
        return Err(error(NCCL_REMOTE_ERROR, f));
    }
    let mr = find_mr(&c.mrs, mh, data, size as usize, "irecv")?;
    if let Some(u) = &c.unpack {
        if size as usize > MAX_UNPACK_RECV {
            return Err(violation(
                NCCL_INTERNAL_ERROR,
                format!("irecv of {size} bytes: TCPX exits when a receive needs more than 2048 fragments; keep receives ≤ 4 MiB"),
            ));
        }
        let fits = matches!(
            (u.pool.kind, mr.kind),
            (PoolKind::Host, MemKind::Host) | (PoolKind::Gpu(_), MemKind::Cuda(_))
        );
        if !fits {
            return Err(violation(
                NCCL_INTERNAL_ERROR,
                format!(
                    "irecv into {:?} memory on a receive comm whose bounce pool is {:?} (TCPX lands payload only in the GPU memory of the GPU current at accept)",
                    mr.kind, u.pool.kind
                ),
            ));
        }
    }
    let mut st = c.st.lock();
    if st.q.len() >= MAX_REQUESTS {
        return Err(violation(
            NCCL_INTERNAL_ERROR,
            format!(
                "irecv: request {} on receive comm {t:#x}; TCPX allows {MAX_REQUESTS} per comm (a receive holds its slot until irecvConsumed)",
                st.q.len() + 1
            ),
        ));
    }
    let seq = st.posted;
    st.posted += 1;
    let slot = (seq % NET_UNPACK_MAX_QUEUE_DEPTH as u64) as usize;
    let cell = Cell::new();
    let rt = token();
    registry()
        .lock()
        .reqs
        .insert(rt, ReqOwner::Recv(c.clone(), seq));
    st.q.push_back(RecvEntry {
        seq,
        token: rt,
        cell: cell.clone(),
        tested: false,
    });
    c.shared.posted.lock().push_back(PostedRecv {
        seq,
        addr: data,
        cap: size as usize,
        kind: mr.kind,
        slot,
        cell,
    });
    drop(st);
    c.shared.cv.notify_all();
    Ok(rt)
}

fn test_recv(c: &Arc<RecvComm>, seq: u64) -> R<Option<usize>> {
    let mut st = c.st.lock();
    let Some(head) = st.q.iter_mut().find(|e| !e.tested) else {
        return Err(violation(
            NCCL_INTERNAL_ERROR,
            format!("test of receive request #{seq}, which is done already"),
        ));
    };
    if head.seq != seq {
        return Err(violation(
            NCCL_INTERNAL_ERROR,
            format!("test of receive request #{seq} while #{} is the oldest; TCPX tests only the FIFO head", head.seq),
        ));
    }
    let failed = c.shared.failed.lock().clone();
    match look(&head.cell, c.cfg.delay, failed)? {
        Seen::NotYet => Ok(None),
        Seen::Done(n) => {
            head.tested = true;
            Ok(Some(n))
        }
    }
}

/// `test`: done and the size to report (None: TCPX reports no size).
pub fn test(req: usize) -> R<Option<Option<usize>>> {
    let owner = registry().lock().reqs.get(&req).cloned().ok_or_else(|| {
        violation(
            NCCL_INVALID_ARGUMENT,
            format!("test of {req:#x}, which is not a live request"),
        )
    })?;
    match owner {
        ReqOwner::Send(c, seq) => Ok(test_send(&c, seq)?.map(Some)),
        ReqOwner::Recv(c, seq) => {
            let unpack = c.unpack.is_some();
            Ok(test_recv(&c, seq)?.map(|n| (!unpack).then_some(n)))
        }
    }
}

pub fn irecv_consumed(t: usize, n: c_int, req: usize) -> R<()> {
    let c = match obj(t, "irecvConsumed")? {
        Obj::Recv(c) => c,
        _ => {
            return Err(violation(
                NCCL_INVALID_ARGUMENT,
                format!("irecvConsumed on {t:#x}, which is not a receive comm"),
            ))
        }
    };
    if n != 1 {
        return Err(violation(
            NCCL_INTERNAL_ERROR,
            format!("irecvConsumed with n={n} (TCPX: n == 1)"),
        ));
    }
    let mut st = c.st.lock();
    let ok = st.q.front().is_some_and(|e| e.token == req && e.tested);
    if !ok {
        let why = match st.q.iter().find(|e| e.token == req) {
            None => format!("irecvConsumed of {req:#x}, which is not a live receive of this comm"),
            Some(e) if !e.tested => format!(
                "irecvConsumed of receive #{} before test reported it done",
                e.seq
            ),
            Some(e) => format!(
                "irecvConsumed of receive #{} out of order: #{} must be consumed first (FIFO)",
                e.seq,
                st.q.front().map_or(0, |f| f.seq)
            ),
        };
        return Err(violation(NCCL_INVALID_USAGE, why));
    }
    let e = st.q.pop_front();
    drop(st);
    if let Some(e) = e {
        // Return the bounce pages.
        if let CellState::Done { lease, .. } = &mut *e.cell.0.lock() {
            lease.take();
        }
        unregister_reqs(&[e.token]);
    }
    Ok(())
}

fn close_recv_comm(c: &Arc<RecvComm>) {
    c.shared.closing.store(true, Ordering::Release);
    c.shared.cv.notify_all();
    let _ = c.sock.shutdown(std::net::Shutdown::Both);
    join(c.thread.lock().take());
    fail_recv(&c.shared, "comm closed".into());
    let tokens: Vec<usize> = c.st.lock().q.drain(..).map(|e| e.token).collect();
    unregister_reqs(&tokens);
    c.mrs.lock().clear();
    if let Some(d) = c.device {
        // Device memory is freed with a context current.
        let _ = cuda::bind(d);
    }
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
