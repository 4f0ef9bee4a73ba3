//! Our own TCP transport. Each comm is several TCP streams, each driven by
//! its own I/O thread with blocking I/O. A message is cut into parts dealt
//! round-robin across the streams; every part carries a small header
//! (message sequence number, offset, length, total, part count) so the
//! receiver places it without knowing the split. GPU memory is staged
//! through pinned host slices, the CUDA copies of one slice overlapped with
//! the network I/O of the others; a sender lends its landed slices to the
//! socket rather than writing them ([`super::splice`]).
//!
//! This module reads and writes raw user memory (the engine has checked the
//! ranges against registered regions), so `unsafe` is allowed here.
#![allow(unsafe_code)]

use std::collections::HashMap;
use std::io::{self, IoSlice, IoSliceMut, Read, Write};
use std::net::{IpAddr, Ipv6Addr, SocketAddr, TcpListener, TcpStream};
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use crossbeam_channel::{Receiver, Sender};
use parking_lot::{Condvar, Mutex};

use super::splice::{CreditBack, Splicer, SPLICED};
use super::timing::{self, Spent};
use super::{
    DeviceProps, ListenComm, MemRef, MrHandle, Net, NetHandle, RecvComm, ReqId, SendComm, Waker,
};
use crate::error::NetError;
use crate::gpu;
use crate::memory::MemKind;
use crate::topo;

const NET: &str = "socket";
const HANDLE_MAGIC: u32 = 0x4b43_4f53; // "SOCK"
const HELLO_MAGIC: u64 = 0x334c_4c45_484b_4353; // "SCKHELL3"
/// Part header: message sequence number, offset, length, message total,
/// part count, and the shape of a gathered message's segments.
const HDR_LEN: usize = 48;
/// Most segments one gathered message may have.
const MAX_SEGS: usize = 1024;

/// Settings of the socket transport.
#[derive(Debug, Clone)]
pub struct SocketConfig {
    pub addr: IpAddr,
    pub streams: usize,
    pub min_part: usize,
    pub sockbuf: usize,
    pub staging_slice: usize,
    pub staging_depth: usize,
    pub connect_timeout: Duration,
    /// Idle I/O threads spin this long before sleeping.
    pub spin: Duration,
    /// CPUs the I/O threads are pinned to (None: not pinned).
    pub cpus: Option<Arc<[usize]>>,
    /// The endpoint's GPU: its pinned staging is made when a comm starts,
    /// not inside the first transfer.
    pub gpu: Option<i32>,
    /// Lend large GPU windows' staging to the socket instead of writing it
    /// (`vmsplice` + `splice`; see [`super::splice`]).
    pub splice: bool,
}

/// The transport: stateless apart from its settings.
pub struct SocketNet {
    cfg: SocketConfig,
}

impl SocketNet {
    pub fn new(cfg: SocketConfig) -> Self {
        SocketNet { cfg }
    }
}

/// How many parts a message of `len` bytes is cut into (at most).
fn part_count(len: usize, streams: usize, min_part: usize) -> usize {
    len.div_ceil(min_part.max(1)).clamp(1, streams.max(1))
}

/// How a message of `len` bytes is cut: `(offset, len)` of each part.
pub fn split_parts(len: usize, streams: usize, min_part: usize) -> Vec<(usize, usize)> {
    let nparts = part_count(len, streams, min_part);
    // Parts are multiples of 4 KiB except the last, so copies stay aligned.
    let per = len.div_ceil(nparts).next_multiple_of(4096).max(1);
    let mut v = Vec::with_capacity(nparts);
    let mut off = 0;
    while v.len() < nparts {
        let l = per.min(len - off);
        v.push((off, l));
        off += l;
        if off == len {
            break;
        }
    }
    v
}

/// The listen handle: magic, address, port, stream count, nonce, and the
/// listener's smallest part, which the connecting side adopts for the comm
/// (the receiver enters each receive on the streams its parts ride).
fn encode_handle(addr: SocketAddr, streams: usize, nonce: u64, min_part: usize) -> NetHandle {
    let mut h = [0u8; super::NET_HANDLE_LEN];
    h[0..4].copy_from_slice(&HANDLE_MAGIC.to_le_bytes());
    let v6 = match addr.ip() {
        IpAddr::V4(a) => a.to_ipv6_mapped(),
        IpAddr::V6(a) => a,
    };
    h[4..20].copy_from_slice(&v6.octets());
    h[20..22].copy_from_slice(&addr.port().to_le_bytes());
    h[22] = streams as u8;
    h[24..32].copy_from_slice(&nonce.to_le_bytes());
    h[32..40].copy_from_slice(&(min_part as u64).to_le_bytes());
    h
}

fn decode_handle(h: &NetHandle) -> Result<(SocketAddr, usize, u64, usize), NetError> {
    let bad = |r: &str| NetError::Protocol {
        net: NET,
        reason: format!("bad listen handle: {r}"),
    };
    if u32::from_le_bytes(h[0..4].try_into().unwrap_or_default()) != HANDLE_MAGIC {
        return Err(bad("magic"));
    }
    let mut ip = [0u8; 16];
    ip.copy_from_slice(&h[4..20]);
    let v6 = Ipv6Addr::from(ip);
    let ip = v6
        .to_ipv4_mapped()
        .map(IpAddr::V4)
        .unwrap_or(IpAddr::V6(v6));
    let port = u16::from_le_bytes([h[20], h[21]]);
    let streams = h[22] as usize;
    if streams == 0 || streams > 64 {
        return Err(bad("stream count"));
    }
    let nonce = u64::from_le_bytes(h[24..32].try_into().unwrap_or_default());
    let min_part = u64::from_le_bytes(h[32..40].try_into().unwrap_or_default());
    if !(1024..=1 << 30).contains(&min_part) {
        return Err(bad("part size"));
    }
    Ok((SocketAddr::new(ip, port), streams, nonce, min_part as usize))
}

fn tune(s: &TcpStream, sockbuf: usize) -> io::Result<()> {
    s.set_nodelay(true)?;
    if sockbuf > 0 {
        let s2 = socket2::SockRef::from(s);
        s2.set_send_buffer_size(sockbuf)?;
        s2.set_recv_buffer_size(sockbuf)?;
    }
    Ok(())
}

impl Net for SocketNet {
    fn name(&self) -> &str {
        NET
    }

    fn devices(&self) -> Vec<DeviceProps> {
        vec![DeviceProps {
            name: format!("tcp:{}", self.cfg.addr),
            pci_path: None,
            speed_mbps: 100_000,
            host_mem: true,
            cuda_mem: gpu::available(),
            max_comms: 65536,
        }]
    }

    fn listen(&self, _dev: usize) -> Result<Box<dyn ListenComm>, NetError> {
        let l = TcpListener::bind(SocketAddr::new(self.cfg.addr, 0))
            .map_err(|e| NetError::io(NET, "bind", e))?;
        l.set_nonblocking(true)
            .map_err(|e| NetError::io(NET, "listen", e))?;
        let addr = l.local_addr().map_err(|e| NetError::io(NET, "listen", e))?;
        let nonce = crate::memory::random_u64();
        Ok(Box::new(SocketListen {
            listener: l,
            handle: encode_handle(addr, self.cfg.streams, nonce, self.cfg.min_part),
            nonce,
            streams: vec![None; self.cfg.streams],
            cfg: self.cfg.clone(),
        }))
    }

    fn connect(
        &self,
        _dev: usize,
        handle: &NetHandle,
        waker: Waker,
    ) -> Result<Option<Box<dyn SendComm>>, NetError> {
        let (addr, streams, nonce, min_part) = decode_handle(handle)?;
        let mut socks = Vec::with_capacity(streams);
        for i in 0..streams {
            let mut s = TcpStream::connect_timeout(&addr, self.cfg.connect_timeout)
                .map_err(|e| NetError::io(NET, "connect", e))?;
            tune(&s, self.cfg.sockbuf).map_err(|e| NetError::io(NET, "setsockopt", e))?;
            let mut hello = [0u8; 24];
            hello[0..8].copy_from_slice(&HELLO_MAGIC.to_le_bytes());
            hello[8..16].copy_from_slice(&nonce.to_le_bytes());
            hello[16..24].copy_from_slice(&(i as u64).to_le_bytes());
            s.write_all(&hello)
                .map_err(|e| NetError::io(NET, "connect", e))?;
            socks.push(s);
        }
        let cfg = SocketConfig {
            min_part,
            ..self.cfg.clone()
        };
        Ok(Some(Box::new(SocketSend::start(socks, &cfg, waker)?)))
    }

    fn needs_polling(&self) -> bool {
        false
    }

    fn completes_out_of_order(&self) -> bool {
        true
    }

    fn max_requests(&self) -> usize {
        256
    }

    fn max_segments(&self) -> usize {
        MAX_SEGS
    }

    fn handle_target(&self, handle: &NetHandle) -> Result<Option<super::HandleTarget>, NetError> {
        let (addr, connections, _, _) = decode_handle(handle)?;
        Ok(Some(super::HandleTarget { addr, connections }))
    }
}

// -------------------------------------------------------------- listening

struct SocketListen {
    listener: TcpListener,
    handle: NetHandle,
    nonce: u64,
    streams: Vec<Option<Arc<TcpStream>>>,
    cfg: SocketConfig,
}

impl ListenComm for SocketListen {
    fn handle(&self) -> NetHandle {
        self.handle
    }

    fn accept(&mut self, waker: Waker) -> Result<Option<Box<dyn RecvComm>>, NetError> {
        loop {
            match self.listener.accept() {
                Ok((mut s, _)) => {
                    s.set_nonblocking(false)
                        .map_err(|e| NetError::io(NET, "accept", e))?;
                    s.set_read_timeout(Some(Duration::from_secs(10)))
                        .map_err(|e| NetError::io(NET, "accept", e))?;
                    let mut hello = [0u8; 24];
                    if s.read_exact(&mut hello).is_err() {
                        continue; // a stray connection: ignore it
                    }
                    let magic = u64::from_le_bytes(hello[0..8].try_into().unwrap_or_default());
                    let nonce = u64::from_le_bytes(hello[8..16].try_into().unwrap_or_default());
                    let idx =
                        u64::from_le_bytes(hello[16..24].try_into().unwrap_or_default()) as usize;
                    if magic != HELLO_MAGIC
                        || nonce != self.nonce
                        || idx >= self.streams.len()
                        || self.streams[idx].is_some()
                    {
                        tracing::warn!("socket net: refused a stream with a bad hello");
                        continue;
                    }
                    s.set_read_timeout(None)
                        .map_err(|e| NetError::io(NET, "accept", e))?;
                    tune(&s, self.cfg.sockbuf).map_err(|e| NetError::io(NET, "setsockopt", e))?;
                    self.streams[idx] = Some(Arc::new(s));
                }
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => break,
                Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
                Err(e) => return Err(NetError::io(NET, "accept", e)),
            }
        }
        if self.streams.iter().all(Option::is_some) {
            let socks: Vec<Arc<TcpStream>> =
                self.streams.iter_mut().filter_map(Option::take).collect();
            Ok(Some(Box::new(SocketRecv::start(socks, &self.cfg, waker)?)))
        } else {
            Ok(None)
        }
    }
}

// ------------------------------------------------ messages in segments

/// The memory of one message: one segment, or several gathered in order.
struct Segs {
    segs: Vec<MemRef>,
    /// Offset of each segment in the message.
    starts: Vec<usize>,
    total: usize,
    /// 0 for one segment (a shorter message may then fill it); for several,
    /// a digest of their lengths, which the sender's must equal (else bytes
    /// would land across block boundaries).
    shape: u64,
}

impl Segs {
    fn new(segs: &[MemRef]) -> Result<Self, NetError> {
        if segs.is_empty() || segs.len() > MAX_SEGS {
            return Err(NetError::Misuse {
                net: NET,
                reason: format!(
                    "a request of {} segments (1 to {MAX_SEGS} allowed)",
                    segs.len()
                ),
            });
        }
        let mut starts = Vec::with_capacity(segs.len());
        let mut total = 0usize;
        for m in segs {
            starts.push(total);
            total = total.checked_add(m.len).ok_or_else(|| NetError::Misuse {
                net: NET,
                reason: "segments whose lengths overflow".into(),
            })?;
        }
        Ok(Segs {
            shape: shape_of(segs),
            segs: segs.to_vec(),
            starts,
            total,
        })
    }

    /// The pieces of segments that bytes `[off, off+len)` of the message
    /// occupy, in order.
    fn pieces(&self, off: usize, len: usize) -> Vec<MemRef> {
        let mut out = Vec::new();
        let mut i = self.starts.partition_point(|&s| s <= off).saturating_sub(1);
        let (mut off, mut left) = (off, len);
        while left > 0 && i < self.segs.len() {
            let m = self.segs[i];
            let inner = off - self.starts[i];
            let take = m.len.saturating_sub(inner).min(left);
            if take > 0 {
                out.push(MemRef {
                    addr: m.addr + inner as u64,
                    len: take,
                    kind: m.kind,
                });
            }
            off += take;
            left -= take;
            i += 1;
        }
        out
    }
}

/// The shape of a message's segments (see [`Segs::shape`]).
fn shape_of(segs: &[MemRef]) -> u64 {
    if segs.len() == 1 {
        return 0;
    }
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for v in std::iter::once(segs.len()).chain(segs.iter().map(|m| m.len)) {
        for b in (v as u64).to_le_bytes() {
            h ^= b as u64;
            h = h.wrapping_mul(0x0100_0000_01b3);
        }
    }
    h | 1
}

/// The one memory kind of `pieces` (host for none), or None when mixed.
fn uniform_kind(pieces: &[MemRef]) -> Option<MemKind> {
    let k = pieces.first().map_or(MemKind::Host, |m| m.kind);
    pieces.iter().all(|m| m.kind == k).then_some(k)
}

/// A staging window: its length, and each piece's (device address, offset
/// in the window, length).
type Window = (usize, Vec<(u64, usize, usize)>);

/// Cuts device pieces into staging windows of at most `slice` bytes.
fn windows(run: &[MemRef], slice: usize) -> Vec<Window> {
    let mut out = Vec::new();
    let (mut cur, mut used) = (Vec::new(), 0);
    for m in run {
        let mut done = 0;
        while done < m.len {
            if used == slice {
                out.push((used, std::mem::take(&mut cur)));
                used = 0;
            }
            let l = (m.len - done).min(slice - used);
            cur.push((m.addr + done as u64, used, l));
            used += l;
            done += l;
        }
    }
    if used > 0 {
        out.push((used, cur));
    }
    out
}

/// The copies between a window's device pieces and a slot at `slot`:
/// into the slot (`to_slot`, sending) or out of it (receiving). With
/// `merge`, pieces that follow each other both in the GPU and in the slot
/// are one copy ([`gpu::push_copy`]; a batch of small parts).
fn window_copies(
    pieces: &[(u64, usize, usize)],
    slot: u64,
    to_slot: bool,
    merge: bool,
) -> Vec<gpu::CopyOp> {
    let mut ops = Vec::with_capacity(pieces.len());
    for &(dev, at, len) in pieces {
        let host = slot + at as u64;
        let (dst, src) = if to_slot { (host, dev) } else { (dev, host) };
        let op = gpu::CopyOp { dst, src, len };
        if merge {
            gpu::push_copy(&mut ops, op);
        } else {
            ops.push(op);
        }
    }
    ops
}

// --------------------------------------------------------- GPU staging

/// Pinned slices and a CUDA stream owned by one I/O thread.
struct Staging {
    device: i32,
    stream: gpu::Stream,
    /// Each slot: its pinned slice, the event recorded after the copies
    /// queued on it, and whether those copies may still be running.
    slots: Vec<(gpu::PinnedBuf, gpu::Event, bool)>,
    /// Receive side: the slot being filled (small parts share one) and its
    /// bytes used.
    fill_slot: usize,
    fill_used: usize,
    /// Receive side: per slot, the parts whose copies out of it are queued
    /// and which complete when those copies have landed.
    landing: Vec<Vec<Landing>>,
    /// Receive side: copies out of the slot being filled, not yet queued
    /// (queued as one batch when the slot is sealed or flushed).
    pending: Vec<gpu::CopyOp>,
    /// Send side, slots lent to the socket: per slot, the lent count at the
    /// end of its last window (the credit it waits for before it is
    /// written again; see [`super::splice`]).
    lent: Vec<u64>,
    /// Send side: why the pipe waited (counted with `debug` logging only).
    stats: PipeStats,
    /// Per slot, the copy kernel (its descriptors reused with the slot):
    /// a window of scattered copies goes in one launch. `None` until first
    /// needed; empty where it cannot load or may not be used (then the
    /// copy engines do every copy).
    kernels: Option<Vec<gpu::unpack::CopyKernel>>,
    /// Slots in memory mapped here and registered with CUDA (the kernel
    /// is used only on the driver's own pinned memory).
    mapped: bool,
}

/// A window of at least this many copies goes through the copy kernel (one
/// launch) rather than the copy engines (one transfer, and the driver's
/// per-copy work, each). Measured on nvidia-h200-x2 with 32 KiB KV blocks
/// scattered, 32 to a 1 MiB window: the driver's work took 23-27 % of the
/// stream threads' busy time on both sides.
const KERNEL_MIN_COPIES: usize = 4;
const KERNEL_MAX_COPIES: usize = 1024;

/// Why a send thread's [`TxPipe`] waited, logged (`debug`) when its
/// staging is dropped: how often the oldest window's copy had not landed
/// when it was due, how far the copies ran ahead then, and why topping
/// the copies up stopped.
#[derive(Default)]
struct PipeStats {
    on: bool,
    windows: u64,
    not_landed: u64,
    ahead_at_wait: u64,
    stop_lent: u64,
    stop_dry: u64,
    credit_blocks: u64,
}

impl Drop for Staging {
    fn drop(&mut self) {
        let p = &self.stats;
        if p.on && p.windows > 0 {
            tracing::debug!(
                windows = p.windows,
                not_landed = p.not_landed,
                mean_ahead_at_wait = p.ahead_at_wait as f64 / p.not_landed.max(1) as f64,
                stop_lent = p.stop_lent,
                stop_dry = p.stop_dry,
                credit_blocks = p.credit_blocks,
                depth = self.slots.len(),
                "tx pipe waits"
            );
        }
    }
}

impl Staging {
    /// `mapped`: slots in memory mapped here and registered with CUDA
    /// rather than allocated by it (see [`Stager::mapped`]).
    fn new(device: i32, slice: usize, depth: usize, mapped: bool) -> Result<Staging, String> {
        let dev = gpu::Device::get(device).map_err(|e| e.to_string())?;
        dev.bind().map_err(|e| e.to_string())?;
        let stream = gpu::Stream::new().map_err(|e| e.to_string())?;
        let mut slots = Vec::with_capacity(depth);
        for _ in 0..depth.max(1) {
            let buf = if mapped {
                gpu::PinnedBuf::new_mapped(slice)
            } else {
                gpu::PinnedBuf::new(slice)
            };
            slots.push((
                buf.map_err(|e| e.to_string())?,
                gpu::Event::new().map_err(|e| e.to_string())?,
                false,
            ));
        }
        Ok(Staging {
            device,
            stream,
            landing: (0..slots.len()).map(|_| Vec::new()).collect(),
            slots,
            fill_slot: 0,
            fill_used: 0,
            pending: Vec::new(),
            lent: vec![0; depth.max(1)],
            stats: PipeStats {
                on: tracing::enabled!(tracing::Level::DEBUG),
                ..PipeStats::default()
            },
            kernels: None,
            mapped,
        })
    }

    fn depth(&self) -> usize {
        self.slots.len()
    }

    fn slice(&self) -> usize {
        self.slots[0].0.len()
    }

    /// Queues `ops` (one window's copies, to or from slot `k`) on the
    /// stream: many of a large part (`large`) in one launch of slot `k`'s
    /// copy kernel, few -- or all, without the kernel -- through the copy
    /// engines. (Small parts' copies stay on the copy engines, where they
    /// were measured.)
    ///
    /// # Safety
    /// Each range must be device memory or this staging's pinned memory,
    /// untouched until slot `k`'s next event completes; slot `k`'s previous
    /// event has completed.
    unsafe fn queue_copies(
        &mut self,
        k: usize,
        ops: &[gpu::CopyOp],
        large: bool,
    ) -> Result<(), String> {
        let many = large && (KERNEL_MIN_COPIES..=KERNEL_MAX_COPIES).contains(&ops.len());
        if many && self.kernels.is_none() {
            let n = self.slots.len();
            self.kernels = Some(if gpu::unpack::copy_kernel_allowed() && !self.mapped {
                gpu::Device::get(self.device)
                    .and_then(|d| {
                        (0..n)
                            .map(|_| gpu::unpack::CopyKernel::new(&d, KERNEL_MAX_COPIES))
                            .collect()
                    })
                    .unwrap_or_else(|e| {
                        tracing::debug!(
                            "copy kernel unavailable, the copy engines do every copy: {e}"
                        );
                        Vec::new()
                    })
            } else {
                Vec::new()
            });
        }
        let kernel = self
            .kernels
            .as_mut()
            .and_then(|v| v.get_mut(k))
            .filter(|_| many);
        // SAFETY: by the caller's contract (the kernel's descriptors belong
        // to slot `k`, whose previous launch has completed).
        let r = unsafe {
            match kernel {
                Some(kn) => kn.launch(&self.stream, ops),
                None => self.stream.copy_batch(ops),
            }
        };
        r.map_err(|e| e.to_string())
    }

    /// Records slot `k`'s event behind the copies queued so far.
    fn seal(&mut self, k: usize) -> Result<(), String> {
        self.slots[k]
            .1
            .record(&self.stream)
            .map_err(|e| e.to_string())?;
        self.slots[k].2 = true;
        Ok(())
    }

    /// Whether every slot can be lent to a pipe.
    fn probe_lend(&self, sp: &Splicer) -> io::Result<()> {
        self.slots
            .iter()
            .try_for_each(|(b, _, _)| sp.probe(b.as_slice(b.len())))
    }

    /// Whether slot `k` may be written: not lent, or credited since (taking
    /// the credits that have come; with `block`, waiting for its own).
    fn unlent(&mut self, k: usize, sp: Option<&mut Splicer>, block: bool) -> Result<bool, String> {
        let mark = self.lent[k];
        let Some(sp) = sp.filter(|sp| mark > sp.credited()) else {
            return Ok(true);
        };
        sp.poll_credits().map_err(|e| e.to_string())?;
        if mark > sp.credited() && block {
            self.stats.credit_blocks += 1;
            timing::mark(Spent::Other);
            sp.wait_credit(mark).map_err(|e| e.to_string())?;
            timing::mark(Spent::Socket);
        }
        Ok(mark <= sp.credited())
    }

    /// The highest credit any slot waits for.
    fn lent_mark(&self) -> u64 {
        self.lent.iter().copied().max().unwrap_or(0)
    }

    /// Waits for slot `k`'s copies, if any are queued.
    fn wait(&mut self, k: usize) -> Result<(), String> {
        if self.slots[k].2 {
            self.slots[k].1.synchronize().map_err(|e| e.to_string())?;
            self.slots[k].2 = false;
        }
        Ok(())
    }
}

/// An I/O thread's staging: made for a GPU when first needed (or ahead,
/// for the endpoint's GPU), remade for another GPU, `depth` slices of
/// `slice` bytes.
struct Stager {
    cur: Option<Staging>,
    slice: usize,
    depth: usize,
    /// Slots in memory mapped here and registered with CUDA: set when the
    /// driver's own pinned memory cannot be lent to a pipe (`vmsplice`).
    mapped: bool,
    /// Send side: lending large GPU windows to the socket.
    lend: Lend,
}

/// Whether a send stream lends its staging to the socket
/// ([`super::splice`]).
enum Lend {
    Off,
    /// Wanted; set up (pipe made, staging probed) at the first large GPU
    /// part.
    Wanted(Arc<TcpStream>),
    On(Splicer),
}

impl Stager {
    /// Staging made later, on first use.
    fn lazy(slice: usize, depth: usize) -> Self {
        Stager {
            cur: None,
            slice,
            depth,
            mapped: false,
            lend: Lend::Off,
        }
    }

    /// Staging for GPU `gpu` made now (pinned allocations take
    /// milliseconds each: measured on h200-x2, the first size of a run read
    /// 4.75 GB/s at 64 KiB where the next read 14.75). A failure is left
    /// for the first GPU message to report.
    fn ahead(gpu: Option<i32>, slice: usize, depth: usize) -> Self {
        let mut st = Stager::lazy(slice, depth);
        if let Some(dev) = gpu {
            if let Err(e) = st.get(dev) {
                tracing::debug!(gpu = dev, "pinned staging not made ahead: {e}");
            }
        }
        st
    }

    /// The staging for GPU `device`, made (or remade) if needed. A receive
    /// side must have flushed the old one first.
    fn get(&mut self, device: i32) -> Result<&mut Staging, String> {
        if let Some(old) = self.cur.as_ref().filter(|s| s.device != device) {
            // Its lent slots go back to the allocator only once read.
            if let Lend::On(sp) = &mut self.lend {
                sp.wait_credit(old.lent_mark()).map_err(|e| e.to_string())?;
            }
            self.cur = None;
        }
        if self.cur.is_none() {
            self.cur = Some(Staging::new(device, self.slice, self.depth, self.mapped)?);
        }
        self.cur.as_mut().ok_or_else(|| "staging".to_string())
    }

    /// The staging for GPU `device` and, where this stream lends its large
    /// windows to the socket, the splicer: set up at the first call, the
    /// slots probed (remade in mapped memory if the driver's cannot be
    /// lent; not lent at all if neither can).
    fn lending(&mut self, device: i32) -> Result<(&mut Staging, Option<&mut Splicer>), String> {
        if let Lend::Wanted(sock) = &self.lend {
            let sock = sock.clone();
            self.lend = Lend::Off;
            match Splicer::new(sock, self.slice) {
                Ok(sp) => {
                    let mut probe = self.get(device)?.probe_lend(&sp);
                    if let Err(e) = &probe {
                        tracing::debug!(
                            gpu = device,
                            "staging not lendable ({e}): remade in mapped memory"
                        );
                        self.mapped = true;
                        self.cur = None;
                        probe = self.get(device)?.probe_lend(&sp);
                    }
                    match probe {
                        Ok(()) => self.lend = Lend::On(sp),
                        Err(e) => tracing::info!(
                            gpu = device,
                            "socket net: staging cannot be lent to the socket ({e}); written instead"
                        ),
                    }
                }
                Err(e) => tracing::info!(
                    "socket net: no pipe to lend staging through ({e}); written instead"
                ),
            }
        }
        self.get(device)?;
        let sp = match &mut self.lend {
            Lend::On(sp) => Some(sp),
            _ => None,
        };
        let st = self.cur.as_mut().ok_or_else(|| "staging".to_string())?;
        Ok((st, sp))
    }

    /// Whether parts wait on copies that have not been waited for.
    fn landing(&self) -> bool {
        self.cur.as_ref().is_some_and(|st| st.has_landing())
    }

    /// Completes every part waiting on a copy (see [`Staging::flush`]).
    fn flush(&mut self, shared: &RecvShared) -> Result<(), String> {
        match self.cur.as_mut() {
            Some(st) => st.flush(shared),
            None => Ok(()),
        }
    }
}

impl Staging {
    /// Copies `parts` (device ranges, together at most one slot) back to
    /// back into slot 0 and waits once for all of them; returns the staged
    /// bytes.
    fn stage_out(&self, parts: &[MemRef]) -> Result<&[u8], String> {
        let slot = &self.slots[0];
        let mut off = 0;
        let mut ops = Vec::with_capacity(parts.len());
        for m in parts {
            let dst = slot.0.as_ptr() as u64 + off as u64;
            gpu::push_copy(
                &mut ops,
                gpu::CopyOp {
                    dst,
                    src: m.addr,
                    len: m.len,
                },
            );
            off += m.len;
        }
        timing::mark(Spent::Other);
        // SAFETY: the parts fit the slot together, back to back; each
        // device range was checked by the engine.
        unsafe { self.stream.copy_batch(&ops) }.map_err(|e| e.to_string())?;
        slot.1.record(&self.stream).map_err(|e| e.to_string())?;
        timing::mark(Spent::Driver);
        slot.1.synchronize().map_err(|e| e.to_string())?;
        timing::mark(Spent::Copies);
        Ok(slot.0.as_slice(off))
    }
}

/// The GPU of a device-memory part small enough to share one staged copy
/// (and one wait) with its neighbours, on either side of a stream.
fn small_gpu_part(pieces: &[MemRef], len: usize, slice: usize) -> Option<i32> {
    match uniform_kind(pieces) {
        Some(MemKind::Cuda(d)) if len > 0 && len <= BATCH_PART.min(slice) => Some(d),
        _ => None,
    }
}

// ---------------------------------------------------------------- sending

struct SendReq {
    parts_left: AtomicUsize,
    size: usize,
    error: Mutex<Option<String>>,
}

struct TxOp {
    hdr: [u8; HDR_LEN],
    /// The part's memory: pieces of the message's segments.
    pieces: Vec<MemRef>,
    /// Payload bytes.
    len: usize,
    req: Arc<SendReq>,
    /// Bytes of header + payload already written by the posting thread.
    skip: usize,
    /// The payload itself, when the posting thread already copied it out of
    /// the GPU (then `pieces` is empty).
    owned: Option<Vec<u8>>,
}

/// Parts up to this size are written by the posting thread when their
/// stream is idle, without waking the stream's I/O thread.
const INLINE_MAX: usize = 64 << 10;

/// A post this long after the previous one returned is a lone message,
/// written by the posting thread; closer posts are a burst, for the I/O
/// threads, which batch it. Where threads may spin (8+ cores) the gap is
/// short: a ping-pong's posts come one round trip less one inline write
/// apart — 50-60 µs for 4 KiB of GPU memory or 64 KiB of host memory on
/// h200-x2, so a 50 µs gap sent some of them through the I/O threads
/// (one-way p50 64 KiB host 34-36 → 26 µs, 4 KiB GPU 39-40 → 28-31 with
/// 10 µs; burst throughput unchanged). On a small machine the posting
/// thread's time is what a burst lacks: 10 µs moved 4 KiB host bursts
/// from 0.75-1.02 to 0.72-0.82 GB/s on 2 cores, with latency unchanged.
const LONE_GAP_SPIN: Duration = Duration::from_micros(10);
const LONE_GAP: Duration = Duration::from_micros(50);

struct SendShared {
    failed: Mutex<Option<String>>,
    waker: Waker,
}

struct SocketSend {
    txs: Vec<Sender<TxOp>>,
    socks: Vec<Arc<TcpStream>>,
    threads: Vec<JoinHandle<()>>,
    shared: Arc<SendShared>,
    reqs: HashMap<u64, Arc<SendReq>>,
    next_seq: u64,
    min_part: usize,
    /// The posting thread's own pinned slot, for small GPU parts it copies
    /// and writes itself when their stream is idle.
    inline_staging: Stager,
    /// When the last `isend` returned: a part is written (a GPU part copied
    /// and written) inline only when it does not follow another post
    /// closely (a lone message, where latency counts); a burst (KV blocks)
    /// goes to the I/O threads, which batch it.
    last_post: Instant,
    /// See [`LONE_GAP`].
    lone_gap: Duration,
    /// Ops queued to (and not yet finished by) each stream's I/O thread.
    queued: Vec<Arc<AtomicUsize>>,
}

impl SocketSend {
    fn start(socks: Vec<TcpStream>, cfg: &SocketConfig, waker: Waker) -> Result<Self, NetError> {
        let shared = Arc::new(SendShared {
            failed: Mutex::new(None),
            waker,
        });
        let socks: Vec<Arc<TcpStream>> = socks.into_iter().map(Arc::new).collect();
        let mut txs = Vec::new();
        let mut threads = Vec::new();
        let mut queued = Vec::new();
        for (i, s) in socks.iter().enumerate() {
            let (tx, rx) = crossbeam_channel::unbounded::<TxOp>();
            let s = s.clone();
            let shared = shared.clone();
            let q = Arc::new(AtomicUsize::new(0));
            queued.push(q.clone());
            let lane = Lane::new(i, cfg);
            let cpus = cfg.cpus.clone();
            threads.push(
                std::thread::Builder::new()
                    .name(format!("tcpx-tx{i}"))
                    .spawn(move || {
                        topo::pin_thread(cpus.as_deref());
                        tx_loop(s, rx, shared, q, lane)
                    })
                    .map_err(|e| NetError::io(NET, "spawning an I/O thread", e))?,
            );
            txs.push(tx);
        }
        Ok(SocketSend {
            txs,
            socks,
            threads,
            shared,
            reqs: HashMap::new(),
            next_seq: 0,
            min_part: cfg.min_part,
            // Made by the posting thread at its first lone GPU message, not
            // here: making it binds the GPU's context on the calling
            // (application) thread.
            inline_staging: Stager::lazy(INLINE_MAX, 1),
            last_post: Instant::now(),
            lone_gap: if cfg.spin.is_zero() {
                LONE_GAP
            } else {
                LONE_GAP_SPIN
            },
            queued,
        })
    }
}

/// Writes every byte of `parts` with as few system calls as it takes.
fn write_all_slices(s: &TcpStream, parts: &[&[u8]]) -> io::Result<()> {
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

/// Host memory as bytes.
fn host_slice(m: &MemRef) -> &[u8] {
    if m.len == 0 {
        return &[];
    }
    // SAFETY: the engine checked `[addr, addr+len)` against a registered
    // region that stays registered until this request completes.
    unsafe { std::slice::from_raw_parts(m.addr as *const u8, m.len) }
}

/// The header and payload of a host-memory op, less the first `skip`
/// bytes (already written by the posting thread).
fn host_slices(op: &TxOp) -> Vec<&[u8]> {
    let mut v: Vec<&[u8]> = Vec::with_capacity(op.pieces.len() + 1);
    v.push(&op.hdr);
    match &op.owned {
        Some(b) => v.push(b),
        None => v.extend(op.pieces.iter().map(host_slice)),
    }
    let mut skip = op.skip;
    let mut first = 0;
    while skip > 0 && first < v.len() {
        if skip >= v[first].len() {
            skip -= v[first].len();
            first += 1;
        } else {
            v[first] = &v[first][skip..];
            skip = 0;
        }
    }
    v.split_off(first)
}

/// Whether an op's payload is host memory only.
fn host_only(op: &TxOp) -> bool {
    op.owned.is_some() || uniform_kind(&op.pieces) == Some(MemKind::Host)
}

fn tx_part(s: &TcpStream, op: &TxOp, stager: &mut Stager) -> Result<(), String> {
    if host_only(op) {
        return write_all_slices(s, &host_slices(op)).map_err(|e| e.to_string());
    }
    write_all_slices(s, &[&op.hdr]).map_err(|e| e.to_string())?;
    for run in op.pieces.chunk_by(|a, b| a.kind == b.kind) {
        match run[0].kind {
            MemKind::Host => {
                let v: Vec<&[u8]> = run.iter().map(host_slice).collect();
                write_all_slices(s, &v).map_err(|e| e.to_string())?;
            }
            MemKind::Cuda(dev) => {
                let (st, mut sp) = stager.lending(dev)?;
                let mut pipe = TxPipe::default();
                pipe.push(Vec::new(), windows(run, st.slice()), false);
                while !pipe.is_empty() {
                    pipe.write_next(s, st, sp.as_deref_mut(), false)?;
                }
            }
        }
    }
    Ok(())
}

/// One part in a [`TxPipe`]: its windows and the ops it completes. One op:
/// a large part, its header before its first window. Several: small parts
/// sharing one window (a batch), each header before its own bytes. None:
/// a piece of a part the caller writes the rest of.
struct PipePart {
    ops: Vec<TxOp>,
    wins: Vec<Window>,
    /// Whether its windows may be lent to the socket (not a batch's).
    lend: bool,
    issued: usize,
    written: usize,
}

impl PipePart {
    /// A batch that small parts may still join: its copy not yet queued.
    fn open_batch(&self) -> bool {
        !self.lend && self.issued == 0 && !self.ops.is_empty() && self.ops.len() < BATCH_OPS
    }
}

/// Device-memory windows written through the pinned slots in order: the
/// copies into the slots run up to `depth` windows ahead of the writes,
/// across part boundaries -- the next part's first windows are copied
/// while this part's last ones are written. (Part by part, a 1 MiB part
/// was one window: its copy, the wait for it and its write ran one after
/// the other on each stream.)
#[derive(Default)]
struct TxPipe {
    parts: std::collections::VecDeque<PipePart>,
    /// Windows whose copies were queued, and windows written, all parts.
    issued: usize,
    written: usize,
}

impl TxPipe {
    fn push(&mut self, ops: Vec<TxOp>, wins: Vec<Window>, lend: bool) {
        self.parts.push_back(PipePart {
            ops,
            wins,
            lend,
            issued: 0,
            written: 0,
        });
    }

    /// Adds a whole part of the stream's GPU: a large one on its own
    /// (lendable windows); a small one to the open batch at the tail if it
    /// fits in its window, else as a new batch.
    fn add(&mut self, op: TxOp, slice: usize) {
        if gpu_batchable(&op, slice).is_none() {
            let wins = windows(&op.pieces, slice);
            return self.push(vec![op], wins, true);
        }
        if let Some(t) = self.parts.back_mut().filter(|t| t.open_batch()) {
            if t.wins[0].0 + op.len <= slice {
                let w = &mut t.wins[0];
                for m in &op.pieces {
                    w.1.push((m.addr, w.0, m.len));
                    w.0 += m.len;
                }
                t.ops.push(op);
                return;
            }
        }
        let wins = windows(&op.pieces, slice);
        self.push(vec![op], wins, false);
    }

    /// Whether the pipe takes in another part: while it knows fewer
    /// unwritten windows than slots (see [`TxPipe::wants_more`]), and one
    /// more while the batch at its tail may still grow.
    fn takes_more(&self, depth: usize) -> bool {
        let tail_open = self.parts.back().is_some_and(|t| t.open_batch());
        self.wants_more(depth) || (tail_open && self.wants_more(depth + 1))
    }

    fn is_empty(&self) -> bool {
        self.parts.is_empty()
    }

    /// Whether the pipe knows fewer windows not yet written than it has
    /// slots: the parts queued behind are then taken in, so that their
    /// copies can run ahead. (It used to take one only once every known
    /// window's copy was queued -- which happens inside `write_next`, after
    /// the taking: with one window per part, the usual 1 MiB part, each
    /// copy was queued, waited for and written one at a time; measured on
    /// h200-x2, every window's copy still running when it was due.)
    fn wants_more(&self, depth: usize) -> bool {
        self.parts
            .iter()
            .map(|p| p.wins.len() - p.written)
            .sum::<usize>()
            < depth
    }

    /// Queues the copies of the next windows into the free slots. With
    /// `sp`, a slot still lent to the socket is free once the receiver has
    /// credited it; the pipe blocks for that credit only when it has
    /// nothing else to write.
    fn top_up(&mut self, st: &mut Staging, mut sp: Option<&mut Splicer>) -> Result<(), String> {
        let depth = st.depth();
        while self.issued - self.written < depth {
            let Some(p) = self.parts.iter_mut().find(|p| p.issued < p.wins.len()) else {
                st.stats.stop_dry += 1;
                break;
            };
            let k = self.issued % depth;
            // Block for a lent slot's credit only with nothing staged to
            // write meanwhile.
            if !st.unlent(k, sp.as_deref_mut(), self.issued == self.written)? {
                st.stats.stop_lent += 1;
                break;
            }
            let slot = st.slots[k].0.as_ptr() as u64;
            let ops = window_copies(&p.wins[p.issued].1, slot, true, !p.lend);
            // SAFETY: the window fits the slot, whose previous window was
            // written once its copies had landed (so nothing reads it); the
            // device ranges were checked by the engine.
            unsafe { st.queue_copies(k, &ops, p.lend) }?;
            st.seal(k)?;
            p.issued += 1;
            self.issued += 1;
        }
        Ok(())
    }

    /// Tops the copies up, then writes the oldest window once its copy has
    /// landed (with `lend`: lends it to the socket through `sp`, its part's
    /// header marked [`SPLICED`]); returns the part when that was its last
    /// window. `sp` is the stream's splicer, if any, whose credits free
    /// lent slots.
    fn write_next(
        &mut self,
        s: &TcpStream,
        st: &mut Staging,
        mut sp: Option<&mut Splicer>,
        lend: bool,
    ) -> Result<Option<PipePart>, String> {
        timing::mark(Spent::Other);
        self.top_up(st, sp.as_deref_mut())?;
        timing::mark(Spent::Driver);
        let depth = st.depth();
        let Some(p) = self.parts.front_mut() else {
            return Ok(None);
        };
        let k = self.written % depth;
        if st.stats.on {
            st.stats.windows += 1;
            if st.slots[k].2 && !st.slots[k].1.is_done().unwrap_or(true) {
                st.stats.not_landed += 1;
                st.stats.ahead_at_wait += (self.issued - self.written) as u64;
            }
        }
        st.wait(k)?;
        timing::mark(Spent::Copies);
        let data = st.slots[k].0.as_slice(p.wins[p.written].0);
        match (sp.filter(|_| lend && p.lend), p.ops.as_slice(), p.written) {
            (Some(sp), ops, w) => {
                if let ([op], 0) = (ops, w) {
                    let mut hdr = op.hdr;
                    let field = u64::from_le_bytes(hdr[32..40].try_into().unwrap_or_default());
                    hdr[32..40].copy_from_slice(&(field | SPLICED).to_le_bytes());
                    write_all_slices(s, &[&hdr]).map_err(|e| e.to_string())?;
                }
                timing::mark(Spent::Other);
                st.lent[k] = sp.send(data).map_err(|e| e.to_string())?;
                timing::mark(Spent::Socket);
                timing::bytes(data.len());
            }
            (None, [op], 0) => write_all_slices(s, &[&op.hdr, data]).map_err(|e| e.to_string())?,
            (None, [], _) | (None, [_], _) => {
                write_all_slices(s, &[data]).map_err(|e| e.to_string())?
            }
            (None, ops, _) => {
                // A batch: each part's header, then its bytes.
                let mut at = 0;
                let mut slices: Vec<&[u8]> = Vec::with_capacity(ops.len() * 2);
                for o in ops {
                    slices.push(&o.hdr);
                    slices.push(&data[at..at + o.len]);
                    at += o.len;
                }
                write_all_slices(s, &slices).map_err(|e| e.to_string())?
            }
        }
        p.written += 1;
        self.written += 1;
        if p.written == p.wins.len() {
            return Ok(self.parts.pop_front());
        }
        Ok(None)
    }
}

/// The GPU of a whole device-memory part written through the slots by
/// [`tx_gpu_stream`]: large ones window by window, small ones batched.
fn piped_gpu(op: &TxOp, slice: usize) -> Option<i32> {
    if let Some(d) = gpu_batchable(op, slice) {
        return Some(d);
    }
    if op.skip != 0 || op.owned.is_some() || op.len == 0 {
        return None;
    }
    match uniform_kind(&op.pieces) {
        Some(MemKind::Cuda(d)) => Some(d),
        _ => None,
    }
}

/// Device-memory parts of GPU `dev` through one [`TxPipe`]: `first`, and
/// those `next` hands over (parts queued behind it that join it) while a
/// slot is free for them -- small ones batched into shared windows. Each
/// is finished when written; after a failure, all of them with it.
fn tx_gpu_stream(
    s: &TcpStream,
    first: TxOp,
    dev: i32,
    stager: &mut Stager,
    next: &mut dyn FnMut() -> Option<TxOp>,
    finish: &dyn Fn(&TxOp, &Result<(), String>),
) {
    let (st, mut sp) = match stager.lending(dev) {
        Ok(x) => x,
        Err(e) => return finish(&first, &Err(e)),
    };
    let slice = st.slice();
    let mut pipe = TxPipe::default();
    pipe.add(first, slice);
    let res = loop {
        while pipe.takes_more(st.depth()) {
            let Some(o) = next() else { break };
            pipe.add(o, slice);
        }
        match pipe.write_next(s, st, sp.as_deref_mut(), true) {
            Ok(Some(part)) => {
                for op in &part.ops {
                    finish(op, &Ok(()));
                }
            }
            Ok(None) => {}
            Err(e) => break Err(e),
        }
        if pipe.is_empty() {
            break Ok(());
        }
    };
    if let Err(e) = res {
        for op in pipe.parts.drain(..).flat_map(|p| p.ops) {
            finish(&op, &Err(e.clone()));
        }
    }
}

/// The next op: spins for `spin` after the last one before blocking.
fn next_op(rx: &Receiver<TxOp>, spin: Duration) -> Option<TxOp> {
    let start = Instant::now();
    loop {
        match rx.try_recv() {
            Ok(op) => return Some(op),
            Err(crossbeam_channel::TryRecvError::Disconnected) => return None,
            Err(crossbeam_channel::TryRecvError::Empty) if start.elapsed() < spin => {
                std::hint::spin_loop()
            }
            Err(crossbeam_channel::TryRecvError::Empty) => return rx.recv().ok(),
        }
    }
}

/// Small host-memory parts queued together go out in one system call.
const BATCH_PART: usize = 256 << 10;
const BATCH_BYTES: usize = 1 << 20;
/// Parts at most in one batch (host memory: one system call; GPU memory:
/// one staged window).
const BATCH_OPS: usize = 128;

fn batchable(op: &TxOp) -> bool {
    host_only(op) && op.len <= BATCH_PART && op.skip == 0
}

/// The GPU of a small device-memory part that can share a window of the
/// send pipe (one staged copy, one wait) with the parts queued behind it.
fn gpu_batchable(op: &TxOp, slice: usize) -> Option<i32> {
    small_gpu_part(&op.pieces, op.len, slice).filter(|_| op.skip == 0 && op.owned.is_none())
}

/// `first` (a small host-memory part) and the small host-memory parts
/// queued behind it, up to [`BATCH_OPS`] and while under [`BATCH_BYTES`];
/// the first op that does not join is kept in `held` for the next round.
fn take_host_batch(rx: &Receiver<TxOp>, first: TxOp, held: &mut Option<TxOp>) -> Vec<TxOp> {
    let mut bytes = first.len;
    let mut batch = vec![first];
    while batch.len() < BATCH_OPS && bytes < BATCH_BYTES {
        match rx.try_recv() {
            Ok(o) if batchable(&o) => {
                bytes += o.len;
                batch.push(o);
            }
            Ok(o) => {
                *held = Some(o);
                break;
            }
            Err(_) => break,
        }
    }
    batch
}

fn finish_op(s: &TcpStream, shared: &SendShared, op: &TxOp, r: &Result<(), String>) {
    match r {
        Ok(()) => {
            if op.req.parts_left.fetch_sub(1, Ordering::AcqRel) == 1 {
                (shared.waker)();
            }
        }
        Err(e) => {
            let msg = format!(
                "send stream to {}: {e}",
                s.peer_addr().map(|a| a.to_string()).unwrap_or_default()
            );
            *op.req.error.lock() = Some(msg.clone());
            shared.failed.lock().get_or_insert(msg);
            let _ = s.shutdown(std::net::Shutdown::Both);
            (shared.waker)();
        }
    }
}

fn tx_loop(
    s: Arc<TcpStream>,
    rx: Receiver<TxOp>,
    shared: Arc<SendShared>,
    queued: Arc<AtomicUsize>,
    lane: Lane,
) {
    let Lane {
        slice, depth, spin, ..
    } = lane;
    let _account = timing::start(|| {
        let peer = s.peer_addr().map(|a| a.to_string()).unwrap_or_default();
        format!("tx stream {} to {peer}", lane.index)
    });
    // A lent slot comes back a receiver's read later than a written one:
    // a lending stream keeps twice the slots. Measured on h200-x2, GPU ->
    // GPU, six runs each (`…-splice/`): written 19.82 / 20.20 GB/s at 16 /
    // 256 MiB, lent through 4 slots 22.04 / 21.07, through 8 21.80 / 22.33.
    let depth = if lane.splice { depth * 2 } else { depth };
    let mut stager = Stager::ahead(lane.gpu, slice, depth);
    if lane.splice {
        stager.lend = Lend::Wanted(s.clone());
    }
    let mut held: Option<TxOp> = None;
    let finish = |op: &TxOp, r: &Result<(), String>| {
        queued.fetch_sub(1, Ordering::AcqRel);
        finish_op(&s, &shared, op, r)
    };
    loop {
        timing::mark(Spent::Other);
        let Some(op) = held.take().or_else(|| next_op(&rx, spin)) else {
            return;
        };
        timing::mark(Spent::Waiting);
        if let Some(f) = shared.failed.lock().clone() {
            queued.fetch_sub(1, Ordering::AcqRel);
            *op.req.error.lock() = Some(f);
            (shared.waker)();
            continue;
        }
        if let Some(dev) = piped_gpu(&op, slice) {
            // The parts queued behind it on the same GPU join it; the first
            // that does not (or any, once the comm has failed) is held for
            // this loop.
            let mut next = || {
                if held.is_some() {
                    return None;
                }
                match rx.try_recv() {
                    Ok(o)
                        if piped_gpu(&o, slice) == Some(dev) && shared.failed.lock().is_none() =>
                    {
                        Some(o)
                    }
                    Ok(o) => {
                        held = Some(o);
                        None
                    }
                    Err(_) => None,
                }
            };
            tx_gpu_stream(&s, op, dev, &mut stager, &mut next, &finish);
            continue;
        }
        if !batchable(&op) {
            let r = tx_part(&s, &op, &mut stager);
            finish(&op, &r);
            continue;
        }
        let batch = take_host_batch(&rx, op, &mut held);
        let slices: Vec<&[u8]> = batch.iter().flat_map(host_slices).collect();
        let r = write_all_slices(&s, &slices).map_err(|e| e.to_string());
        tracing::trace!(
            seq = u64::from_le_bytes(batch[0].hdr[..8].try_into().unwrap_or_default()),
            n = batch.len(),
            "lat: tx wrote"
        );
        for o in &batch {
            finish(o, &r);
        }
    }
}

impl SocketSend {
    /// A small GPU part on an idle stream: copied out by this thread and
    /// written without blocking, so that no I/O thread has to wake for it.
    /// Returns what is left for the stream's thread (as host bytes) if the
    /// socket took only part of it.
    fn send_gpu_inline(&mut self, k: usize, dev: i32, op: TxOp) -> Result<Option<TxOp>, NetError> {
        let gpu_err = |e: String| NetError::Protocol {
            net: NET,
            reason: format!("staging a GPU part of {} bytes on GPU {dev}: {e}", op.len),
        };
        let len = op.len;
        let data = self
            .inline_staging
            .get(dev)
            .and_then(|st| st.stage_out(&op.pieces))
            .map_err(gpu_err)?;
        tracing::trace!("lat: staged out");
        let iov = [IoSlice::new(&op.hdr), IoSlice::new(data)];
        let sent = socket2::SockRef::from(&*self.socks[k])
            .send_vectored_with_flags(&iov, libc::MSG_DONTWAIT | libc::MSG_NOSIGNAL)
            .unwrap_or(0);
        if sent == HDR_LEN + len {
            return Ok(None);
        }
        Ok(Some(TxOp {
            hdr: op.hdr,
            pieces: Vec::new(),
            len,
            owned: Some(data.to_vec()),
            req: op.req,
            skip: sent,
        }))
    }
}

impl SendComm for SocketSend {
    fn reg_mr(&mut self, _mem: MemRef) -> Result<MrHandle, NetError> {
        Ok(MrHandle(0))
    }
    fn dereg_mr(&mut self, _mr: MrHandle) -> Result<(), NetError> {
        Ok(())
    }

    fn isend(&mut self, mem: MemRef, mr: MrHandle) -> Result<Option<ReqId>, NetError> {
        self.isendv(&[mem], &[mr])
    }

    fn isendv(&mut self, segs: &[MemRef], _mrs: &[MrHandle]) -> Result<Option<ReqId>, NetError> {
        if let Some(f) = self.shared.failed.lock().clone() {
            return Err(NetError::Protocol {
                net: NET,
                reason: f,
            });
        }
        let segs = Segs::new(segs)?;
        let shape = segs.shape;
        let seq = self.next_seq;
        tracing::trace!(seq, bytes = segs.total, "lat: isend");
        self.next_seq += 1;
        let parts = split_parts(segs.total, self.txs.len(), self.min_part);
        let req = Arc::new(SendReq {
            parts_left: AtomicUsize::new(parts.len()),
            size: segs.total,
            error: Mutex::new(None),
        });
        let lone = self.last_post.elapsed() >= self.lone_gap;
        for (i, &(off, len)) in parts.iter().enumerate() {
            let mut hdr = [0u8; HDR_LEN];
            for (j, v) in [
                seq,
                off as u64,
                len as u64,
                segs.total as u64,
                parts.len() as u64,
                shape,
            ]
            .into_iter()
            .enumerate()
            {
                hdr[j * 8..j * 8 + 8].copy_from_slice(&v.to_le_bytes());
            }
            let mut op = TxOp {
                hdr,
                pieces: segs.pieces(off, len),
                len,
                req: req.clone(),
                skip: 0,
                owned: None,
            };
            // Part i of message `seq` rides stream (seq + i) mod S, which the
            // receiver can tell from the sequence number alone.
            let k = (seq as usize + i) % self.txs.len();
            let idle = self.queued[k].load(Ordering::Acquire) == 0;
            let kind = uniform_kind(&op.pieces);
            if let Some(MemKind::Cuda(dev)) = kind {
                if len <= INLINE_MAX && lone && idle {
                    match self.send_gpu_inline(k, dev, op)? {
                        None => {
                            tracing::trace!(seq, "lat: sent inline");
                            req.parts_left.fetch_sub(1, Ordering::AcqRel);
                            continue;
                        }
                        Some(rest) => op = rest,
                    }
                }
            }
            if kind == Some(MemKind::Host) && len <= INLINE_MAX && lone && idle {
                // The stream is idle: write now, without blocking.
                let iov: Vec<IoSlice<'_>> = host_slices(&op)
                    .into_iter()
                    .map(IoSlice::new)
                    .take(64)
                    .collect();
                let sent = socket2::SockRef::from(&*self.socks[k])
                    .send_vectored_with_flags(&iov, libc::MSG_DONTWAIT | libc::MSG_NOSIGNAL);
                match sent {
                    Ok(n) if n == HDR_LEN + len => {
                        tracing::trace!(seq, "lat: sent inline");
                        req.parts_left.fetch_sub(1, Ordering::AcqRel);
                        continue;
                    }
                    Ok(n) => op.skip = n,
                    Err(_) => {} // would block, or an error the I/O thread reports
                }
            }
            self.queued[k].fetch_add(1, Ordering::AcqRel);
            self.txs[k]
                .send(op)
                .map_err(|_| NetError::Closed { net: NET })?;
        }
        self.reqs.insert(seq, req);
        self.last_post = Instant::now();
        Ok(Some(ReqId(seq)))
    }

    fn test(&mut self, req: ReqId) -> Result<Option<usize>, NetError> {
        let r = self
            .reqs
            .get(&req.0)
            .cloned()
            .ok_or_else(|| NetError::Misuse {
                net: NET,
                reason: format!("test of unknown send request {}", req.0),
            })?;
        if let Some(e) = r.error.lock().clone() {
            self.reqs.remove(&req.0);
            return Err(NetError::Protocol {
                net: NET,
                reason: e,
            });
        }
        if r.parts_left.load(Ordering::Acquire) == 0 {
            let size = r.size;
            self.reqs.remove(&req.0);
            return Ok(Some(size));
        }
        Ok(None)
    }
}

impl Drop for SocketSend {
    fn drop(&mut self) {
        self.txs.clear();
        for s in &self.socks {
            let _ = s.shutdown(std::net::Shutdown::Both);
        }
        for t in self.threads.drain(..) {
            let _ = t.join();
        }
    }
}

// -------------------------------------------------------------- receiving

struct RecvReq {
    segs: Segs,
    parts_done: AtomicUsize,
    /// (total bytes, parts) once the first header has been seen.
    shape: Mutex<Option<(usize, usize)>>,
    done: AtomicBool,
    /// Streams the receive was entered on: those of the parts a message
    /// of its full size would have (a shorter message may have fewer).
    lanes: usize,
}

/// The receives that still expect a part on one stream. Each stream's
/// thread looks only at its own book, so receive threads never contend
/// with each other, and the poster wakes only the streams it concerns.
#[derive(Default)]
struct LaneBook {
    /// seq → the receive and which of its parts rides this stream.
    due: HashMap<u64, (Arc<RecvReq>, usize)>,
    /// Entries whose part is the message's first (whose wait is latency).
    firsts: usize,
}

impl LaneBook {
    fn insert(&mut self, seq: u64, req: Arc<RecvReq>, part: usize) {
        self.firsts += usize::from(part == 0);
        self.due.insert(seq, (req, part));
    }

    fn take(&mut self, seq: u64) -> Option<Arc<RecvReq>> {
        let (req, part) = self.due.remove(&seq)?;
        self.firsts -= usize::from(part == 0);
        Some(req)
    }
}

struct RecvLaneQ {
    book: Mutex<LaneBook>,
    cv: Condvar,
}

struct RecvShared {
    lanes: Vec<RecvLaneQ>,
    /// Receives `0..posted` have been entered on their streams' books.
    posted: AtomicU64,
    closing: AtomicBool,
    failed: Mutex<Option<String>>,
    waker: Waker,
}

impl RecvShared {
    /// Wakes every stream's thread (closing, failing).
    fn notify_all(&self) {
        for q in &self.lanes {
            q.cv.notify_all();
        }
    }
}

struct SocketRecv {
    shared: Arc<RecvShared>,
    min_part: usize,
    socks: Vec<Arc<TcpStream>>,
    threads: Vec<JoinHandle<()>>,
    reqs: HashMap<u64, Arc<RecvReq>>,
    next_seq: u64,
}

impl SocketRecv {
    fn start(
        socks: Vec<Arc<TcpStream>>,
        cfg: &SocketConfig,
        waker: Waker,
    ) -> Result<Self, NetError> {
        let shared = Arc::new(RecvShared {
            lanes: (0..socks.len())
                .map(|_| RecvLaneQ {
                    book: Mutex::new(LaneBook::default()),
                    cv: Condvar::new(),
                })
                .collect(),
            posted: AtomicU64::new(0),
            closing: AtomicBool::new(false),
            failed: Mutex::new(None),
            waker,
        });
        let mut threads = Vec::new();
        for (i, s) in socks.iter().enumerate() {
            let s = s.clone();
            let shared = shared.clone();
            let lane = Lane::new(i, cfg);
            let cpus = cfg.cpus.clone();
            threads.push(
                std::thread::Builder::new()
                    .name(format!("tcpx-rx{i}"))
                    .spawn(move || {
                        topo::pin_thread(cpus.as_deref());
                        rx_loop(s, shared, lane)
                    })
                    .map_err(|e| NetError::io(NET, "spawning an I/O thread", e))?,
            );
        }
        Ok(SocketRecv {
            shared,
            min_part: cfg.min_part,
            socks,
            threads,
            reqs: HashMap::new(),
            next_seq: 0,
        })
    }
}

/// Reads a stream through a buffer, so that headers and small payloads
/// cost one system call for many; large payloads are read in place.
struct StreamReader {
    s: Arc<TcpStream>,
    buf: Box<[u8]>,
    pos: usize,
    end: usize,
    /// How long to poll for bytes before a read that would block (zero:
    /// block at once). Set for the payload of a small message's first
    /// part, whose remainder is usually a few µs behind its start: a
    /// blocked reader's wake-up costs more than that.
    spin: Duration,
    /// Credits owed for lent payload bytes (see [`super::splice`]).
    credit: CreditBack,
}

const READ_BUF: usize = 256 << 10;

impl StreamReader {
    fn new(s: Arc<TcpStream>) -> Self {
        StreamReader {
            s,
            buf: vec![0u8; READ_BUF].into_boxed_slice(),
            pos: 0,
            end: 0,
            spin: Duration::ZERO,
            credit: CreditBack::default(),
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
            self.ready()?;
            match (&*self.s).read(dst) {
                Ok(0) => return Err(io::ErrorKind::UnexpectedEof.into()),
                Ok(n) => {
                    dst = &mut dst[n..];
                    self.credit.taken(&self.s, n)?;
                }
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(e) => return Err(e),
            }
        }
        Ok(())
    }

    /// Reads a header: with `exact` and nothing buffered, only its bytes
    /// (one small read), else through the buffer.
    fn read_head(&mut self, dst: &mut [u8], exact: bool) -> io::Result<()> {
        if exact && self.buffered() == 0 {
            return self.fill(dst);
        }
        self.read_exact(dst)
    }

    /// Fills `bufs` in order: buffered bytes first, then large remainders
    /// straight from the socket with one `readv` for many blocks.
    fn read_into(&mut self, bufs: &mut [&mut [u8]]) -> io::Result<()> {
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
            self.ready()?;
            let n = (&*self.s).read_vectored(&mut iov[..k])?;
            if n == 0 {
                return Err(io::ErrorKind::UnexpectedEof.into());
            }
            IoSliceMut::advance_slices(&mut iov, n);
            self.credit.taken(&self.s, n)?;
        }
        Ok(())
    }

    /// Bytes read from the socket and not yet consumed.
    fn buffered(&self) -> usize {
        self.end - self.pos
    }

    fn read_exact(&mut self, mut dst: &mut [u8]) -> io::Result<()> {
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
                self.ready()?;
                let n = (&*self.s).read(&mut self.buf)?;
                if n == 0 {
                    return Err(io::ErrorKind::UnexpectedEof.into());
                }
                self.pos = 0;
                self.end = n;
            }
        }
        Ok(())
    }
}

/// A received part whose bytes are still being copied to the GPU.
struct Landing {
    req: Arc<RecvReq>,
    seq: u64,
    nparts: usize,
}

/// Counts one part of a receive as done; the last one completes it.
fn part_done(shared: &RecvShared, l: Landing) {
    if l.req.parts_done.fetch_add(1, Ordering::AcqRel) + 1 == l.nparts {
        tracing::trace!(seq = l.seq, "lat: rx done");
        l.req.done.store(true, Ordering::Release);
        // A message shorter than its receive has fewer parts than the
        // streams the receive was entered on: drop those entries.
        let n = shared.lanes.len();
        for i in l.nparts..l.req.lanes {
            shared.lanes[(l.seq as usize + i) % n]
                .book
                .lock()
                .take(l.seq);
        }
        (shared.waker)();
    }
}

impl Staging {
    fn has_landing(&self) -> bool {
        self.landing.iter().any(|l| !l.is_empty())
    }

    /// Queues the copies out of the slot being filled, in one batch.
    fn issue_pending(&mut self) -> Result<(), String> {
        // Small parts' copies stay on the copy engines: the kernel was
        // measured on windows of scattered blocks only.
        // SAFETY: each copy reads bytes already read into the slot, which
        // stay untouched until the slot's next event completes, and writes
        // inside a posted receive buffer.
        let r = unsafe { self.stream.copy_batch(&self.pending) };
        self.pending.clear();
        r.map_err(|e| e.to_string())
    }

    /// Completes the parts whose copies out of slot `k` have landed.
    fn landed(&mut self, k: usize, shared: &RecvShared) {
        for l in self.landing[k].drain(..) {
            part_done(shared, l);
        }
    }

    /// Waits for slot `k`'s copies and completes the parts behind them.
    fn reclaim(&mut self, k: usize, shared: &RecvShared) -> Result<(), String> {
        self.wait(k)?;
        self.landed(k, shared);
        Ok(())
    }

    /// Completes the parts behind the oldest slots whose copies have
    /// landed, without waiting (one stream: they land in order, so it stops
    /// at the first that has not).
    fn reap(&mut self, shared: &RecvShared) -> Result<(), String> {
        let depth = self.depth();
        for step in 1..=depth {
            let j = (self.fill_slot + step) % depth;
            if !self.slots[j].2 {
                continue;
            }
            if !self.slots[j].1.is_done().map_err(|e| e.to_string())? {
                break;
            }
            self.slots[j].2 = false;
            self.landed(j, shared);
        }
        Ok(())
    }

    /// The slot to read the next `need` bytes into: the one being filled
    /// while they fit and it is not sealed, else the next one (its copies
    /// waited for, the parts behind them completed), the filled one sealed
    /// first.
    fn next_slot(&mut self, need: usize, shared: &RecvShared) -> Result<usize, String> {
        let k = self.fill_slot;
        if self.fill_used > 0 && self.fill_used + need > self.slice() {
            self.issue_pending()?;
            self.seal(k)?;
        }
        if self.slots[k].2 {
            let j = (k + 1) % self.depth();
            self.reclaim(j, shared)?;
            self.fill_slot = j;
            self.fill_used = 0;
        }
        Ok(self.fill_slot)
    }

    /// Waits for every queued copy and completes the parts behind them.
    fn flush(&mut self, shared: &RecvShared) -> Result<(), String> {
        if !self.has_landing() && self.pending.is_empty() && !self.slots.iter().any(|s| s.2) {
            return Ok(());
        }
        self.issue_pending()?;
        // One stream: the newest event covers every copy queued before it.
        let k = self.fill_slot;
        self.seal(k)?;
        self.wait(k)?;
        for j in 0..self.depth() {
            self.slots[j].2 = false;
            self.landed(j, shared);
        }
        self.fill_used = 0;
        Ok(())
    }
}

/// Whether the socket has bytes waiting to be read.
pub(super) fn readable_now(s: &TcpStream) -> bool {
    use std::os::fd::AsRawFd;
    let mut n: libc::c_int = 0;
    // SAFETY: FIONREAD writes one int through the pointer given.
    let r = unsafe { libc::ioctl(s.as_raw_fd(), libc::FIONREAD, &mut n) };
    r == 0 && n > 0
}

/// Spins until `s` has bytes to read or `spin` has passed (at once when
/// `spin` is zero).
fn poll_readable(s: &TcpStream, spin: Duration) {
    if spin.is_zero() {
        return;
    }
    let start = Instant::now();
    while !readable_now(s) && start.elapsed() < spin {
        std::hint::spin_loop();
    }
}

/// A small GPU part: read into the slot being filled, its copy to the
/// device queued, and its completion deferred until that copy has landed
/// (a slot's copies are waited for when the slot is needed again or the
/// stream goes quiet) -- so a run of KV blocks costs one wait per slot,
/// not one per block.
fn rx_gpu_small(
    r: &mut StreamReader,
    dst: &[MemRef],
    len: usize,
    st: &mut Staging,
    land: Landing,
    shared: &RecvShared,
) -> Result<(), String> {
    timing::mark(Spent::Other);
    let k = st.next_slot(len, shared)?;
    timing::mark(Spent::Copies);
    let (at, slice) = (st.fill_used, st.slice());
    let buf = &mut st.slots[k].0.as_mut_slice(slice)[at..at + len];
    r.read_exact(buf).map_err(|e| e.to_string())?;
    timing::mark(Spent::Socket);
    timing::bytes(len);
    tracing::trace!(seq = land.seq, "lat: rx payload");
    let mut src = st.slots[k].0.as_ptr() as u64 + at as u64;
    for m in dst {
        gpu::push_copy(
            &mut st.pending,
            gpu::CopyOp {
                dst: m.addr,
                src,
                len: m.len,
            },
        );
        src += m.len as u64;
    }
    st.fill_used += len;
    st.landing[k].push(land);
    Ok(())
}

/// Reads device pieces through the slots, a slot per window, each
/// window's copy to the device queued as soon as it is read (so the next
/// window -- of this part or the next -- is read while it runs).
fn rx_windows(
    r: &mut StreamReader,
    run: &[MemRef],
    st: &mut Staging,
    shared: &RecvShared,
) -> Result<(), String> {
    for (wlen, pieces) in windows(run, st.slice()) {
        timing::mark(Spent::Other);
        let k = st.next_slot(st.slice(), shared)?;
        timing::mark(Spent::Copies);
        r.read_exact(st.slots[k].0.as_mut_slice(wlen))
            .map_err(|e| e.to_string())?;
        timing::mark(Spent::Socket);
        timing::bytes(wlen);
        let ops = window_copies(&pieces, st.slots[k].0.as_ptr() as u64, false, false);
        // SAFETY: the slot holds the window just read and is not touched
        // again until its event completes (its previous one has: the slot
        // was free); the device ranges lie inside the posted buffer.
        unsafe { st.queue_copies(k, &ops, true) }?;
        st.seal(k)?;
        // Parts whose copies have landed complete now, not when their
        // slot is next needed (a window of another message may come first).
        st.reap(shared)?;
        timing::mark(Spent::Driver);
    }
    Ok(())
}

/// A large GPU part: read through the slots ([`rx_windows`]); it completes
/// when its last copy has landed, waited for only when that slot is needed
/// again or the stream goes quiet. (Waiting at the end of each part kept
/// the stream unread while the part's last copy ran.)
fn rx_gpu_large(
    r: &mut StreamReader,
    run: &[MemRef],
    st: &mut Staging,
    land: Landing,
    shared: &RecvShared,
) -> Result<(), String> {
    rx_windows(r, run, st, shared)?;
    if st.slots[st.fill_slot].2 {
        st.landing[st.fill_slot].push(land);
    } else {
        // Its last copy has landed already (reaped after its window).
        part_done(shared, land);
    }
    Ok(())
}

/// A part in host memory, or in host and device memory together: host
/// runs read in place, device runs through the slots; done when this
/// returns.
fn rx_part(
    r: &mut StreamReader,
    dst: &[MemRef],
    stager: &mut Stager,
    shared: &RecvShared,
) -> Result<(), String> {
    let mut staged = false;
    for run in dst.chunk_by(|a, b| a.kind == b.kind) {
        match run[0].kind {
            MemKind::Host => {
                let mut bufs: Vec<&mut [u8]> = run
                    .iter()
                    .map(|m| {
                        // SAFETY: the range lies inside the posted receive
                        // buffer, which the engine checked against a
                        // registered region held until completion; the
                        // pieces of one part never overlap.
                        unsafe { std::slice::from_raw_parts_mut(m.addr as *mut u8, m.len) }
                    })
                    .collect();
                timing::mark(Spent::Other);
                r.read_into(&mut bufs).map_err(|e| e.to_string())?;
                timing::mark(Spent::Socket);
                timing::bytes(run.iter().map(|m| m.len).sum());
            }
            MemKind::Cuda(dev) => {
                // The staging may be remade for this GPU: finish the old.
                stager.flush(shared)?;
                rx_windows(r, run, stager.get(dev)?, shared)?;
                staged = true;
            }
        }
    }
    if staged {
        stager.flush(shared)?;
    }
    Ok(())
}

/// What an I/O thread works with: its stream's index, how long it may
/// spin, its pinned staging (slice size, slices) and the GPU to make it for
/// when it starts.
#[derive(Clone, Copy)]
struct Lane {
    index: usize,
    spin: Duration,
    gpu: Option<i32>,
    slice: usize,
    depth: usize,
    /// Send side: lend large GPU windows to the socket.
    splice: bool,
}

impl Lane {
    fn new(index: usize, cfg: &SocketConfig) -> Self {
        Lane {
            index,
            spin: cfg.spin,
            gpu: cfg.gpu,
            slice: cfg.staging_slice,
            depth: cfg.staging_depth,
            splice: cfg.splice,
        }
    }

    /// With spinning allowed, keeps this thread out of a blocking read
    /// (whose wake-up, 25-65 µs on a busy VM, measured on h200-x2, was the
    /// largest item of a small message's trip): with no receive posted
    /// that has a part on this stream it waits for one; once a receive's
    /// first part is due here it spins (bounded) for the bytes. Only the
    /// first part's stream spins: eight spinning readers per comm, beside
    /// the senders' threads, took more cores than h200-x2 has (1 MiB
    /// one-way p50 went from 200-240 to 285-325 µs). Later parts of large
    /// messages, idle streams and bytes already there go to the read.
    fn spin_for_data(&self, s: &TcpStream, shared: &RecvShared) {
        if self.spin.is_zero() {
            return;
        }
        let q = &shared.lanes[self.index];
        let idle_since = Instant::now();
        let mut book = q.book.lock();
        loop {
            if book.firsts > 0 {
                break;
            }
            if !book.due.is_empty()
                || readable_now(s)
                || shared.closing.load(Ordering::Acquire)
                || idle_since.elapsed() > IDLE_READ
            {
                return;
            }
            q.cv.wait_for(&mut book, Duration::from_micros(100));
        }
        drop(book);
        poll_readable(s, self.spin);
    }
}

/// How long an I/O thread with spinning allowed waits for a receive to be
/// posted before it blocks in a read.
const IDLE_READ: Duration = Duration::from_millis(50);

fn rx_loop(s: Arc<TcpStream>, shared: Arc<RecvShared>, lane: Lane) {
    let mut stager = Stager::ahead(lane.gpu, lane.slice, lane.depth);
    let peer = s.peer_addr().map(|a| a.to_string()).unwrap_or_default();
    let _account = timing::start(|| {
        let at = s.local_addr().map(|a| a.to_string()).unwrap_or_default();
        format!("rx stream {} at {at} from {peer}", lane.index)
    });
    let mut r = StreamReader::new(s);
    let mut large_before = false;
    let fail = |msg: String| {
        // The first failure of the comm is what every receive reports.
        // (`test` reports it for every receive not yet done.)
        shared.failed.lock().get_or_insert(msg);
        shared.closing.store(true, Ordering::Release);
        shared.notify_all();
        (shared.waker)();
    };
    loop {
        // About to wait for the peer: first complete what has landed.
        timing::mark(Spent::Other);
        if stager.landing() && r.buffered() < HDR_LEN && !readable_now(&r.s) {
            let flushed = stager.flush(&shared);
            timing::mark(Spent::Copies);
            if let Err(e) = flushed {
                fail(format!("receive stream from {peer}: {e}"));
                return;
            }
        }
        if r.buffered() == 0 {
            lane.spin_for_data(&r.s, &shared);
        }
        timing::mark(Spent::Waiting);
        r.spin = Duration::ZERO;
        let mut hdr = [0u8; HDR_LEN];
        // After a large part the next is likely large too: read just its
        // header, so that its payload is read in place rather than through
        // the buffer (a copy of up to 256 KiB of it per part).
        if let Err(e) = r.read_head(&mut hdr, large_before) {
            if !shared.closing.load(Ordering::Acquire) {
                let why = if e.kind() == io::ErrorKind::UnexpectedEof {
                    "peer closed the stream".to_string()
                } else {
                    e.to_string()
                };
                fail(format!("receive stream from {peer}: {why}"));
            }
            return;
        }
        let field =
            |i: usize| u64::from_le_bytes(hdr[i * 8..i * 8 + 8].try_into().unwrap_or_default());
        let (seq, off, len, total, nparts, shape) = (
            field(0),
            field(1),
            field(2),
            field(3),
            field(4) & (SPLICED - 1),
            field(5),
        );
        let lent = field(4) & SPLICED != 0;
        tracing::trace!(seq, "lat: rx header");
        timing::mark(Spent::Waiting);
        timing::bytes(HDR_LEN);
        // Wait until the matching receive is posted.
        let q = &shared.lanes[lane.index];
        let req = loop {
            let mut book = q.book.lock();
            if shared.closing.load(Ordering::Acquire) {
                return;
            }
            if let Some(r) = book.take(seq) {
                break r;
            }
            if seq < shared.posted.load(Ordering::Acquire) {
                // Its receive is posted, and not expecting this part here
                // (entries are made before `posted` moves past them).
                drop(book);
                fail(format!(
                    "receive stream {} from {peer}: a part of message {seq} that the receive does not expect on this stream (sent twice, or cut other than the receiver's streams and part size say)",
                    lane.index
                ));
                return;
            }
            if stager.landing() {
                // The receive may be posted only once earlier ones complete.
                drop(book);
                if let Err(e) = stager.flush(&shared) {
                    fail(format!("receive stream from {peer}: {e}"));
                    return;
                }
                continue;
            }
            q.cv.wait_for(&mut book, Duration::from_millis(100));
        };
        timing::mark(Spent::Waiting);
        let bad = off.checked_add(len).is_none_or(|end| end > total)
            || total > req.segs.total as u64
            || nparts == 0
            || nparts > 64;
        if bad {
            fail(format!(
                "receive stream from {peer}: message {seq} of {total} bytes (part {off}+{len}) does not fit the posted {} bytes",
                req.segs.total
            ));
            return;
        }
        if shape != req.segs.shape {
            fail(format!(
                "receive stream from {peer}: message {seq} is gathered from blocks other than the {} the receive scatters into (the sender's and the receiver's block sizes must match)",
                req.segs.segs.len()
            ));
            return;
        }
        {
            let mut shape = req.shape.lock();
            match *shape {
                None => *shape = Some((total as usize, nparts as usize)),
                Some(sh) if sh != (total as usize, nparts as usize) => {
                    drop(shape);
                    fail(format!(
                        "receive stream from {peer}: inconsistent part headers for message {seq}"
                    ));
                    return;
                }
                _ => {}
            }
        }
        let len = len as usize;
        if lent {
            r.credit.begin(len);
        }
        large_before = len >= READ_BUF / 4;
        // A small message's first part: its caller waits on these bytes.
        r.spin = if off == 0 && len <= INLINE_MAX {
            lane.spin
        } else {
            Duration::ZERO
        };
        let dst = req.segs.pieces(off as usize, len);
        let land = Landing {
            req,
            seq,
            nparts: nparts as usize,
        };
        let res = match uniform_kind(&dst) {
            Some(MemKind::Cuda(d)) => {
                // Staging is remade for another GPU: finish the old one first.
                let other = stager.cur.as_ref().is_some_and(|st| st.device != d);
                let flushed = if other { stager.flush(&shared) } else { Ok(()) };
                let small = len <= BATCH_PART.min(lane.slice);
                flushed.and_then(|()| stager.get(d)).and_then(|st| {
                    if small {
                        rx_gpu_small(&mut r, &dst, len, st, land, &shared)
                    } else {
                        rx_gpu_large(&mut r, &dst, st, land, &shared)
                    }
                })
            }
            _ => rx_part(&mut r, &dst, &mut stager, &shared).map(|()| part_done(&shared, land)),
        };
        if let Err(e) = res {
            if !shared.closing.load(Ordering::Acquire) {
                fail(format!("receive stream from {peer}: {e}"));
            }
            return;
        }
    }
}

impl RecvComm for SocketRecv {
    fn reg_mr(&mut self, _mem: MemRef) -> Result<MrHandle, NetError> {
        Ok(MrHandle(0))
    }
    fn dereg_mr(&mut self, _mr: MrHandle) -> Result<(), NetError> {
        Ok(())
    }

    fn irecv(&mut self, mem: MemRef, mr: MrHandle) -> Result<Option<ReqId>, NetError> {
        self.irecvv(&[mem], &[mr])
    }

    fn irecvv(&mut self, segs: &[MemRef], _mrs: &[MrHandle]) -> Result<Option<ReqId>, NetError> {
        if let Some(f) = self.shared.failed.lock().clone() {
            return Err(NetError::Protocol {
                net: NET,
                reason: f,
            });
        }
        let segs = Segs::new(segs)?;
        let seq = self.next_seq;
        self.next_seq += 1;
        let n = self.shared.lanes.len();
        let lanes = part_count(segs.total, n, self.min_part);
        let req = Arc::new(RecvReq {
            segs,
            parts_done: AtomicUsize::new(0),
            shape: Mutex::new(None),
            done: AtomicBool::new(false),
            lanes,
        });
        // Part i of message `seq` rides stream (seq + i) mod S.
        for i in 0..lanes {
            let q = &self.shared.lanes[(seq as usize + i) % n];
            q.book.lock().insert(seq, req.clone(), i);
            q.cv.notify_all();
        }
        self.shared.posted.store(seq + 1, Ordering::Release);
        self.reqs.insert(seq, req);
        Ok(Some(ReqId(seq)))
    }

    fn test(&mut self, req: ReqId) -> Result<Option<usize>, NetError> {
        let r = self
            .reqs
            .get(&req.0)
            .cloned()
            .ok_or_else(|| NetError::Misuse {
                net: NET,
                reason: format!("test of unknown receive request {}", req.0),
            })?;
        if r.done.load(Ordering::Acquire) {
            let size = r.shape.lock().map(|s| s.0).unwrap_or(0);
            self.reqs.remove(&req.0);
            return Ok(Some(size));
        }
        if self.shared.closing.load(Ordering::Acquire) {
            if let Some(e) = self.shared.failed.lock().clone() {
                self.reqs.remove(&req.0);
                return Err(NetError::Protocol {
                    net: NET,
                    reason: e,
                });
            }
        }
        Ok(None)
    }
}

impl Drop for SocketRecv {
    fn drop(&mut self) {
        self.shared.closing.store(true, Ordering::Release);
        self.shared.notify_all();
        for s in &self.socks {
            let _ = s.shutdown(std::net::Shutdown::Both);
        }
        let deadline = Instant::now() + Duration::from_secs(5);
        for t in self.threads.drain(..) {
            while !t.is_finished() && Instant::now() < deadline {
                std::thread::sleep(Duration::from_millis(1));
            }
            if t.is_finished() {
                let _ = t.join();
            }
        }
    }
}

/// Settings for tests: loopback, `streams` streams, 4 KiB parts.
#[cfg(test)]
pub(crate) fn test_config(streams: usize) -> SocketConfig {
    SocketConfig {
        addr: "127.0.0.1".parse().unwrap(),
        streams,
        min_part: 4096,
        sockbuf: 0,
        staging_slice: 1 << 20,
        staging_depth: 2,
        connect_timeout: Duration::from_secs(5),
        spin: Duration::from_micros(20),
        cpus: None,
        gpu: None,
        splice: true,
    }
}

/// A connected comm pair (tests): from a net set up as `tx` to one set up
/// as `rx`.
#[cfg(test)]
pub(crate) fn test_pair(
    tx: SocketConfig,
    rx: SocketConfig,
) -> (Box<dyn SendComm>, Box<dyn RecvComm>) {
    let waker: Waker = Arc::new(|| {});
    let mut l = SocketNet::new(rx).listen(0).unwrap();
    let s = SocketNet::new(tx)
        .connect(0, &l.handle(), waker.clone())
        .unwrap()
        .unwrap();
    let deadline = Instant::now() + Duration::from_secs(5);
    loop {
        if let Some(r) = l.accept(waker.clone()).unwrap() {
            return (s, r);
        }
        assert!(Instant::now() < deadline);
        std::thread::sleep(Duration::from_millis(1));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    use super::{test_config as cfg, test_pair as pair_of};

    #[test]
    fn split_covers_every_byte_once() {
        for &(len, s, m) in &[
            (0, 4, 4096),
            (1, 4, 4096),
            (4096, 4, 4096),
            (10_000_000, 8, 131072),
            (12345, 3, 1024),
            (1 << 30, 64, 1),
        ] {
            let p = split_parts(len, s, m);
            assert!(!p.is_empty() && p.len() <= s);
            let mut off = 0;
            for &(o, l) in &p {
                assert_eq!(o, off);
                off += l;
            }
            assert_eq!(off, len);
        }
        assert_eq!(split_parts(100, 8, 4096).len(), 1);
        assert_eq!(split_parts(1 << 20, 4, 4096).len(), 4);
    }

    #[test]
    fn handle_round_trip_and_rejects_garbage() {
        let a: SocketAddr = "127.0.0.1:4242".parse().unwrap();
        let h = encode_handle(a, 4, 99, 128 << 10);
        assert_eq!(decode_handle(&h).unwrap(), (a, 4, 99, 128 << 10));
        assert!(decode_handle(&encode_handle(a, 4, 99, 0)).is_err());
        assert!(decode_handle(&[0u8; 128]).is_err());
    }

    fn pair(streams: usize) -> (Box<dyn SendComm>, Box<dyn RecvComm>) {
        pair_of(cfg(streams), cfg(streams))
    }

    fn wait<F: FnMut() -> Result<Option<usize>, NetError>>(mut f: F) -> usize {
        let deadline = Instant::now() + Duration::from_secs(10);
        loop {
            if let Some(n) = f().unwrap() {
                return n;
            }
            assert!(Instant::now() < deadline, "request did not complete");
            std::thread::yield_now();
        }
    }

    fn host(addr: u64, len: usize) -> MemRef {
        MemRef {
            addr,
            len,
            kind: MemKind::Host,
        }
    }

    #[test]
    fn segments_map_message_offsets_to_pieces() {
        let segs =
            Segs::new(&[host(1000, 10), host(5000, 0), host(2000, 30), host(9000, 5)]).unwrap();
        assert_eq!(segs.total, 45);
        assert_eq!(
            segs.pieces(0, 45)
                .iter()
                .map(|m| (m.addr, m.len))
                .collect::<Vec<_>>(),
            [(1000, 10), (2000, 30), (9000, 5)]
        );
        assert_eq!(
            segs.pieces(8, 4)
                .iter()
                .map(|m| (m.addr, m.len))
                .collect::<Vec<_>>(),
            [(1008, 2), (2000, 2)]
        );
        assert_eq!(
            segs.pieces(10, 30)
                .iter()
                .map(|m| (m.addr, m.len))
                .collect::<Vec<_>>(),
            [(2000, 30)]
        );
        assert_eq!(
            segs.pieces(39, 6)
                .iter()
                .map(|m| (m.addr, m.len))
                .collect::<Vec<_>>(),
            [(2029, 1), (9000, 5)]
        );
        assert!(segs.pieces(45, 0).is_empty());
        // Shape: 0 for one segment; equal only for equal lengths.
        assert_eq!(Segs::new(&[host(1, 7)]).unwrap().shape, 0);
        let a = Segs::new(&[host(1, 4), host(9, 4)]).unwrap().shape;
        assert_ne!(a, 0);
        assert_eq!(a, Segs::new(&[host(100, 4), host(300, 4)]).unwrap().shape);
        assert_ne!(a, Segs::new(&[host(1, 8)]).unwrap().shape);
        assert_ne!(a, Segs::new(&[host(1, 2), host(9, 6)]).unwrap().shape);
        assert!(Segs::new(&[]).is_err());
        assert!(Segs::new(&vec![host(1, 1); MAX_SEGS + 1]).is_err());
    }

    #[test]
    fn windows_cover_pieces_once() {
        let run = [host(0, 300), host(1000, 50), host(5000, 700)];
        let w = windows(&run, 256);
        assert_eq!(
            w.iter().map(|x| x.0).collect::<Vec<_>>(),
            [256, 256, 256, 256, 26]
        );
        assert_eq!(w[1].1, vec![(256, 0, 44), (1000, 44, 50), (5000, 94, 162)]);
        let mut seen: Vec<(u64, usize)> = w
            .iter()
            .flat_map(|x| x.1.iter().map(|&(a, _, l)| (a, l)))
            .collect();
        seen.sort();
        let bytes: usize = seen.iter().map(|x| x.1).sum();
        assert_eq!(bytes, 1050);
    }

    #[test]
    fn send_pipe_takes_parts_until_its_slots_are_covered() {
        // One-window parts (a 1 MiB part through 1 MiB slots): the pipe
        // keeps taking them until it knows a window for every slot, so
        // their copies can be queued ahead of the writes.
        let one = |addr| windows(&[host(addr, 1 << 20)], 1 << 20);
        let mut pipe = TxPipe::default();
        assert!(pipe.wants_more(4));
        for i in 0..3 {
            pipe.push(Vec::new(), one(i << 20), true);
            assert!(pipe.wants_more(4), "{} parts known", i + 1);
        }
        pipe.push(Vec::new(), one(3 << 20), true);
        assert!(!pipe.wants_more(4));
        // Written windows no longer count; a part of several windows does.
        pipe.parts[0].written = 1;
        assert!(pipe.wants_more(4));
        let mut pipe = TxPipe::default();
        pipe.push(Vec::new(), windows(&[host(0, 5 << 20)], 1 << 20), true);
        assert!(!pipe.wants_more(4));
    }

    #[test]
    fn small_gpu_parts_share_windows_in_the_send_pipe() {
        let part = |addr: u64, len: usize| TxOp {
            hdr: [0; HDR_LEN],
            pieces: vec![MemRef {
                addr,
                len,
                kind: MemKind::Cuda(0),
            }],
            len,
            req: Arc::new(SendReq {
                parts_left: AtomicUsize::new(1),
                size: len,
                error: Mutex::new(None),
            }),
            skip: 0,
            owned: None,
        };
        let slice = 1 << 20;
        let mut pipe = TxPipe::default();
        // 128 KiB parts of 1 MiB messages: eight share one 1 MiB window;
        // parts that follow each other in GPU memory are one copy.
        for i in 0..8u64 {
            let addr = if i < 4 {
                i << 17
            } else {
                (10 << 20) + (i << 20)
            };
            pipe.add(part(addr, 128 << 10), slice);
        }
        assert_eq!(pipe.parts.len(), 1);
        let w = &pipe.parts[0].wins[0];
        assert_eq!(w.0, slice);
        assert_eq!(w.1.len(), 8);
        let slot = 1 << 40;
        let copies = window_copies(&w.1, slot, true, !pipe.parts[0].lend);
        assert_eq!(copies.len(), 5, "four contiguous parts, then four apart");
        let copy = |dst: u64, src: u64, len: usize| gpu::CopyOp { dst, src, len };
        assert_eq!(copies[0], copy(slot, 0, 512 << 10));
        assert_eq!(
            copies[1],
            copy(slot + (512 << 10), (10 << 20) + (4 << 20), 128 << 10)
        );
        assert!(!pipe.parts[0].lend, "a batch is written, not lent");
        // A full window: the next one starts a batch of its own, which the
        // pipe keeps filling one window beyond its slots.
        pipe.add(part(1 << 30, 4096), slice);
        assert_eq!(pipe.parts.len(), 2);
        assert!(pipe.takes_more(2) && !pipe.wants_more(2));
        assert!(!pipe.takes_more(1));
        // Once its copy is queued a batch takes no more.
        pipe.parts[1].issued = 1;
        pipe.add(part(2 << 30, 4096), slice);
        assert_eq!(pipe.parts.len(), 3);
        // A large part is a part of its own, lent.
        pipe.add(part(3 << 30, 3 << 20), slice);
        assert_eq!(pipe.parts.len(), 4);
        assert!(pipe.parts[3].lend);
        assert_eq!(pipe.parts[3].wins.len(), 3);
        assert_eq!(pipe.parts.iter().map(|p| p.ops.len()).sum::<usize>(), 11);
    }

    #[test]
    fn gathered_messages_scatter_block_for_block() {
        let (mut s, mut r) = pair(4);
        // 300 blocks of varied sizes, sent from one buffer in order and
        // received into another in reverse order, as one message (its
        // parts cut across blocks), then an ordinary message behind it.
        let sizes: Vec<usize> = (0..300).map(|i| 1 + (i * 4099) % 20_000).collect();
        let total: usize = sizes.iter().sum();
        let src: Vec<u8> = (0..total).map(|i| (i * 31 + 7) as u8).collect();
        let mut dst = vec![0u8; total];
        let (mut so, mut ro) = (Vec::new(), vec![0; sizes.len()]);
        let mut at = 0;
        for &n in &sizes {
            so.push(at);
            at += n;
        }
        let mut at = 0;
        for i in (0..sizes.len()).rev() {
            ro[i] = at;
            at += sizes[i];
        }
        let ssegs: Vec<MemRef> = (0..sizes.len())
            .map(|i| host(src.as_ptr() as u64 + so[i] as u64, sizes[i]))
            .collect();
        let rsegs: Vec<MemRef> = (0..sizes.len())
            .map(|i| host(dst.as_mut_ptr() as u64 + ro[i] as u64, sizes[i]))
            .collect();
        let mrs = vec![MrHandle(0); sizes.len()];
        let tail_src = vec![9u8; 5000];
        let mut tail_dst = vec![0u8; 6000];
        let rq = r.irecvv(&rsegs, &mrs).unwrap().unwrap();
        let rt = r
            .irecv(host(tail_dst.as_mut_ptr() as u64, 6000), MrHandle(0))
            .unwrap()
            .unwrap();
        let sq = s.isendv(&ssegs, &mrs).unwrap().unwrap();
        let st = s
            .isend(host(tail_src.as_ptr() as u64, 5000), MrHandle(0))
            .unwrap()
            .unwrap();
        assert_eq!(wait(|| s.test(sq)), total);
        assert_eq!(wait(|| s.test(st)), 5000);
        assert_eq!(wait(|| r.test(rq)), total);
        assert_eq!(wait(|| r.test(rt)), 5000);
        for i in 0..sizes.len() {
            assert_eq!(
                &dst[ro[i]..ro[i] + sizes[i]],
                &src[so[i]..so[i] + sizes[i]],
                "block {i}"
            );
        }
        assert_eq!(&tail_dst[..5000], &tail_src[..]);
    }

    #[test]
    fn gathered_message_into_other_block_sizes_fails_the_receive() {
        let (mut s, mut r) = pair(2);
        let src = vec![1u8; 8192];
        let mut dst = vec![0u8; 8192];
        let base = dst.as_mut_ptr() as u64;
        let mrs = [MrHandle(0); 2];
        let rq = r
            .irecvv(&[host(base, 2048), host(base + 2048, 6144)], &mrs)
            .unwrap()
            .unwrap();
        let a = src.as_ptr() as u64;
        s.isendv(&[host(a, 4096), host(a + 4096, 4096)], &mrs)
            .unwrap()
            .unwrap();
        let deadline = Instant::now() + Duration::from_secs(10);
        let err = loop {
            match r.test(rq) {
                Err(e) => break e.to_string(),
                Ok(Some(n)) => panic!("received {n} bytes into the wrong blocks"),
                Ok(None) => {}
            }
            assert!(Instant::now() < deadline, "the receive did not fail");
            std::thread::yield_now();
        };
        assert!(err.contains("block sizes must match"), "{err}");
        assert!(dst.iter().all(|&b| b == 0), "no byte may land");
    }

    #[test]
    fn messages_match_in_order_and_arrive_whole() {
        let (mut s, mut r) = pair(3);
        let sizes = [0usize, 1, 4096, 100_000, 3 << 20];
        let srcs: Vec<Vec<u8>> = sizes
            .iter()
            .map(|&n| (0..n).map(|i| (i * 7 + n) as u8).collect())
            .collect();
        let mut dsts: Vec<Vec<u8>> = sizes.iter().map(|&n| vec![0u8; n + 10]).collect();
        let mut rreqs = Vec::new();
        for d in dsts.iter_mut() {
            let m = MemRef {
                addr: d.as_mut_ptr() as u64,
                len: d.len(),
                kind: MemKind::Host,
            };
            rreqs.push(r.irecv(m, MrHandle(0)).unwrap().unwrap());
        }
        let mut sreqs = Vec::new();
        for src in &srcs {
            let m = MemRef {
                addr: src.as_ptr() as u64,
                len: src.len(),
                kind: MemKind::Host,
            };
            sreqs.push(s.isend(m, MrHandle(0)).unwrap().unwrap());
        }
        for (i, q) in sreqs.into_iter().enumerate() {
            assert_eq!(wait(|| s.test(q)), sizes[i]);
        }
        for (i, q) in rreqs.into_iter().enumerate() {
            assert_eq!(wait(|| r.test(q)), sizes[i]);
            assert_eq!(&dsts[i][..sizes[i]], &srcs[i][..]);
        }
    }

    #[test]
    fn peers_with_other_part_sizes_agree_on_streams() {
        // The receiver enters each receive on the streams its parts ride,
        // reckoned with its own smallest part, which the sender adopts.
        let (mut s, mut r) = pair_of(
            SocketConfig {
                min_part: 1024,
                ..cfg(4)
            },
            SocketConfig {
                min_part: 256 << 10,
                ..cfg(4)
            },
        );
        // Messages shorter than their receives (fewer parts than the
        // streams the receive was entered on), and whole ones.
        let sizes = [100_000usize, 1 << 20, 3, 700_000, 2 << 20];
        let srcs: Vec<Vec<u8>> = sizes
            .iter()
            .map(|&n| (0..n).map(|i| (i * 13 + n) as u8).collect())
            .collect();
        let mut dsts: Vec<Vec<u8>> = sizes
            .iter()
            .enumerate()
            .map(|(i, &n)| vec![0u8; if i % 2 == 0 { n + 10 } else { 2 << 20 }])
            .collect();
        let rreqs: Vec<ReqId> = dsts
            .iter_mut()
            .map(|d| {
                r.irecv(host(d.as_mut_ptr() as u64, d.len()), MrHandle(0))
                    .unwrap()
                    .unwrap()
            })
            .collect();
        for src in &srcs {
            let q = s
                .isend(host(src.as_ptr() as u64, src.len()), MrHandle(0))
                .unwrap()
                .unwrap();
            assert_eq!(wait(|| s.test(q)), src.len());
        }
        for (i, q) in rreqs.into_iter().enumerate() {
            assert_eq!(wait(|| r.test(q)), sizes[i]);
            assert_eq!(&dsts[i][..sizes[i]], &srcs[i][..], "message {i}");
        }
    }

    #[test]
    fn part_on_a_stream_its_receive_does_not_expect_fails_the_receive() {
        // A peer that writes a one-part message on the wrong stream: the
        // receive fails with the reason instead of waiting for ever.
        let net = SocketNet::new(cfg(2));
        let waker: Waker = Arc::new(|| {});
        let mut l = net.listen(0).unwrap();
        let (addr, streams, nonce, _) = decode_handle(&l.handle()).unwrap();
        let mut socks = Vec::new();
        for i in 0..streams {
            let mut s = TcpStream::connect(addr).unwrap();
            let mut hello = [0u8; 24];
            hello[0..8].copy_from_slice(&HELLO_MAGIC.to_le_bytes());
            hello[8..16].copy_from_slice(&nonce.to_le_bytes());
            hello[16..24].copy_from_slice(&(i as u64).to_le_bytes());
            s.write_all(&hello).unwrap();
            socks.push(s);
        }
        let mut r = loop {
            if let Some(r) = l.accept(waker.clone()).unwrap() {
                break r;
            }
            std::thread::sleep(Duration::from_millis(1));
        };
        let mut dst = vec![0u8; 100];
        let m = host(dst.as_mut_ptr() as u64, 100);
        let q = r.irecv(m, MrHandle(0)).unwrap().unwrap();
        // Message 0 has one part, which rides stream 0; send it on stream 1.
        let mut hdr = [0u8; HDR_LEN];
        for (j, v) in [0, 0, 100, 100, 1, Segs::new(&[m]).unwrap().shape]
            .into_iter()
            .enumerate()
        {
            hdr[j * 8..j * 8 + 8].copy_from_slice(&v.to_le_bytes());
        }
        socks[1].write_all(&hdr).unwrap();
        socks[1].write_all(&[7u8; 100]).unwrap();
        let deadline = Instant::now() + Duration::from_secs(5);
        let err = loop {
            match r.test(q) {
                Err(e) => break e.to_string(),
                Ok(Some(_)) => panic!("a part on the wrong stream must not complete"),
                Ok(None) => assert!(Instant::now() < deadline, "the receive waited for ever"),
            }
            std::thread::sleep(Duration::from_millis(1));
        };
        assert!(err.contains("does not expect"), "{err}");
        assert!(dst.iter().all(|&b| b == 0), "nothing written");
    }

    #[test]
    fn oversized_message_fails_the_receive() {
        let (mut s, mut r) = pair(2);
        let src = vec![1u8; 10_000];
        let mut dst = vec![0u8; 100];
        let q = r
            .irecv(
                MemRef {
                    addr: dst.as_mut_ptr() as u64,
                    len: 100,
                    kind: MemKind::Host,
                },
                MrHandle(0),
            )
            .unwrap()
            .unwrap();
        s.isend(
            MemRef {
                addr: src.as_ptr() as u64,
                len: src.len(),
                kind: MemKind::Host,
            },
            MrHandle(0),
        )
        .unwrap();
        let deadline = Instant::now() + Duration::from_secs(5);
        loop {
            match r.test(q) {
                Err(_) => break,
                Ok(Some(_)) => panic!("an oversized message must not complete"),
                Ok(None) => assert!(Instant::now() < deadline),
            }
            std::thread::sleep(Duration::from_millis(1));
        }
        assert!(dst.iter().all(|&b| b == 0), "nothing written");
    }

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
            let mut r = StreamReader::new(Arc::new(s));
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

    #[test]
    fn peer_drop_fails_pending_receive() {
        let (s, mut r) = pair(2);
        let mut dst = vec![0u8; 100];
        let q = r
            .irecv(
                MemRef {
                    addr: dst.as_mut_ptr() as u64,
                    len: 100,
                    kind: MemKind::Host,
                },
                MrHandle(0),
            )
            .unwrap()
            .unwrap();
        drop(s);
        let deadline = Instant::now() + Duration::from_secs(5);
        while r.test(q).is_ok() {
            assert!(
                Instant::now() < deadline,
                "receive should fail when the sender goes away"
            );
            std::thread::sleep(Duration::from_millis(1));
        }
    }
}
