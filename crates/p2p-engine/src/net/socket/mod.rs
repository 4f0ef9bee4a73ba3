//! Our own TCP transport. Each comm is up to `streams` TCP streams, opened
//! as its messages want them (`streams`), each driven by a task on the
//! endpoint's I/O workers ([`crate::workers`]) with blocking I/O while it
//! has work, and holding no thread while it has none. A message is cut
//! into parts dealt round-robin across the streams open; every part carries a small header
//! ([`wire::PartHeader`]: message sequence number, offset, length, total,
//! part count) so the receiver places it without knowing the split. GPU
//! memory is staged through pinned host slices ([`crate::gpu::staging`]),
//! the CUDA copies of one slice overlapped with the network I/O of the
//! others; a sender lends its landed slices to the socket rather than
//! writing them ([`splice`]).
//!
//! Where things are:
//! - this file: the net, its settings, listening and connecting, and the
//!   sizes every part of it shares;
//! - [`wire`]: the byte formats (listen handle, stream hello, part header);
//! - `segs`: a message's memory in segments, and its staging windows;
//! - `stage`: an I/O thread's staging (made per GPU, lent to the socket);
//! - `send` / `tx`: posting sends, and the send threads that write parts;
//! - `recv` / `book` / `rx`: posting receives, the comm's book of posted
//!   receives (and the checks a header passes before a byte lands), and
//!   the receive threads (read header → match → land);
//! - `streams`: opening further streams (sender) and taking them in
//!   (receiver); `door`: the net's one listener, which every stream to
//!   its receive comms comes in through and which gives each to the comm
//!   its hello names;
//! - `reader`, `sockio`, [`splice`]: buffered reads, system-call helpers,
//!   and lending pinned pages to the socket.
//!
//! The modules below read and write raw user memory (the engine has
//! checked the ranges against registered regions), so `unsafe` is allowed
//! in them, each block with its reason.
#![allow(unsafe_code)]

use std::net::IpAddr;
use std::sync::Arc;
use std::time::Duration;
#[cfg(test)]
use std::time::Instant;

use super::{DeviceProps, ListenComm, Net, NetHandle, RecvComm, SendComm, Waker};
use crate::error::NetError;
use crate::gpu;
use crate::workers::Workers;

mod book;
mod door;
mod reader;
mod recv;
mod rx;
mod segs;
mod send;
mod sockio;
mod streams;

/// Whether a TCP stream has bytes to read, and a bounded spin until it
/// has: the control connection's reader uses them too.
pub(crate) use sockio::{poll_readable, wait_readable};
#[cfg(test)]
mod fuzz_tests;
pub(crate) mod splice;
mod stage;
#[cfg(test)]
mod tests;
mod tx;
pub(crate) mod wire;

#[doc(hidden)]
#[cfg(feature = "fuzzing")]
pub use book::fuzz_part_header;
use book::Landing;
use recv::SocketRecv;
use send::SocketSend;
use stage::StagingPool;
use wire::Handle;

const NET: &str = "socket";

// Sizes, one name each (the engine's `chunk` cuts transfers above these;
// the socket net cuts each request into parts):
/// Most segments one gathered message may have: enough for blocks of
/// 1 KiB to fill a chunk. At 1,024, a list of 4 KiB blocks went as 4 MiB
/// messages, half a chunk: NIXL 131,072 x 4 KiB moved at 0.72-0.76 x one
/// descriptor's rate on the 2-core box, 0.78-0.88 in 8 MiB messages (on
/// 2 x H200 at 0.63-0.73 in 4 MiB ones).
const MAX_SEGS: usize = 8192;
/// Parts up to this size are written by the posting thread when their
/// stream is idle, without waking the stream's I/O thread.
const INLINE_MAX: usize = 64 << 10;
/// Small parts (up to this size) queued together share one system call
/// (host memory) or one staged window (GPU memory).
const BATCH_PART: usize = 256 << 10;
/// Bytes at most in one batch of small host-memory parts.
const BATCH_BYTES: usize = 1 << 20;
/// Parts at most in one batch (host memory: one system call; GPU memory:
/// one staged window).
const BATCH_OPS: usize = 128;
/// A receive thread's read buffer; payloads of at least a quarter of it
/// are read in place.
const READ_BUF: usize = 256 << 10;

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
    /// A stream accepted on the net's listener must have sent its hello
    /// (which comm, which stream) within this, or it is closed.
    pub hello_timeout: Duration,
    /// Idle I/O threads spin this long before sleeping.
    pub spin: Duration,
    /// A stream with nothing to do keeps its I/O worker this long before
    /// giving it back (see [`crate::workers`]).
    pub linger: Duration,
    /// CPUs the I/O threads are pinned to (None: not pinned).
    pub cpus: Option<Arc<[usize]>>,
    /// The endpoint's GPU: the receive streams' shared staging is warmed
    /// for it when the first receive comm starts, not inside the first
    /// transfer.
    pub gpu: Option<i32>,
    /// Lend large GPU windows' staging to the socket instead of writing it
    /// (`vmsplice` + `splice`; see [`super::splice`]).
    pub splice: bool,
    /// A receive stream whose bytes stop coming for this long inside a
    /// part (or a part's header) fails its comm: a peer that sends a
    /// header and then nothing holds an I/O worker at most this long (the
    /// connection's deadline).
    pub stall: Duration,
}

/// The transport: its settings, the I/O workers its comms share, and its
/// one listener.
pub struct SocketNet {
    cfg: SocketConfig,
    workers: LazyWorkers,
    /// Where every stream to this net's receive comms comes in, made with
    /// the first listen comm ([`door`]).
    door: parking_lot::Mutex<Option<Arc<door::Door>>>,
    /// Pinned staging the receive streams share (see [`stage::StagingPool`]).
    rx_staging: Arc<StagingPool<Landing>>,
    /// Pinned staging the send streams share.
    tx_staging: Arc<StagingPool<()>>,
    /// The threads that open the send comms' streams after their first.
    connectors: streams::Connectors,
}

/// Staging rings kept free for the receive streams: four per core (at
/// most as many as streams busy at once want; with fewer kept, 8 peers
/// sending 16 MiB each into one H100 at once made and freed rings on every
/// message, and freeing pinned memory waits for the GPU: 1.2 GB/s in all,
/// against 9.2 for one peer alone).
fn staging_pool<T>() -> Arc<StagingPool<T>> {
    let cores = std::thread::available_parallelism().map_or(2, |n| n.get());
    Arc::new(StagingPool::new(4 * cores.max(2)))
}

/// The comms' I/O workers, started with the first comm (a net that only
/// listens holds none).
#[derive(Clone, Default)]
struct LazyWorkers(Arc<parking_lot::Mutex<Option<Workers>>>);

impl LazyWorkers {
    fn get(&self, cpus: &Option<Arc<[usize]>>, spin: Duration) -> Result<Workers, NetError> {
        let mut w = self.0.lock();
        if let Some(w) = &*w {
            return Ok(w.clone());
        }
        let made = Workers::new("tcpx-io", cpus.clone())
            .map_err(|e| NetError::io(NET, "starting the I/O workers", e))?;
        made.set_spin(spin);
        Ok(w.insert(made).clone())
    }
}

impl SocketNet {
    pub fn new(cfg: SocketConfig) -> Self {
        SocketNet {
            cfg,
            workers: LazyWorkers::default(),
            door: parking_lot::Mutex::new(None),
            rx_staging: staging_pool(),
            tx_staging: staging_pool(),
            connectors: streams::Connectors::new(),
        }
    }

    /// A net whose comms run on `workers` (the endpoint's, shared with its
    /// connections' tasks).
    pub(crate) fn with_workers(cfg: SocketConfig, workers: Workers) -> Self {
        SocketNet {
            cfg,
            workers: LazyWorkers(Arc::new(parking_lot::Mutex::new(Some(workers)))),
            door: parking_lot::Mutex::new(None),
            rx_staging: staging_pool(),
            tx_staging: staging_pool(),
            connectors: streams::Connectors::new(),
        }
    }

    /// The comms' I/O workers, started with the first comm.
    fn workers(&self) -> Result<Workers, NetError> {
        self.workers.get(&self.cfg.cpus, self.cfg.spin)
    }

    /// A send comm to the listener `handle` names.
    fn connect_here(&self, handle: &NetHandle, waker: Waker) -> Result<SocketSend, NetError> {
        let Handle {
            addr,
            streams,
            nonce,
            min_part,
        } = Handle::decode(handle).map_err(|e| NetError::Protocol {
            net: NET,
            reason: format!("bad listen handle: {e}"),
        })?;
        // The listener's count and smallest part: it checks each part
        // against the cut they make.
        let cfg = SocketConfig {
            min_part,
            streams,
            ..self.cfg.clone()
        };
        // One stream now; more as messages want them ([`streams::Grow`]).
        let first = streams::open_stream(addr, nonce, 0, &cfg)?;
        let grow = streams::Grow::new(
            addr,
            nonce,
            streams,
            1,
            cfg.clone(),
            self.connectors.clone(),
        );
        if let Some(gpu) = self.cfg.gpu {
            // A ring per stream, once per endpoint (what the first bulk
            // transfer takes; as the receive side's). Lending streams keep
            // twice the slots (see `TxTask::stager`).
            let depth = self.cfg.staging_depth * if self.cfg.splice { 2 } else { 1 };
            self.tx_staging
                .warm(gpu, self.cfg.staging_slice, depth, streams.max(2));
        }
        SocketSend::start(first, grow, &cfg, waker, &self.workers()?, &self.tx_staging)
    }

    /// The net's listener, opened with the first listen comm.
    fn door(&self) -> Result<Arc<door::Door>, NetError> {
        let mut d = self.door.lock();
        if let Some(d) = &*d {
            return Ok(d.clone());
        }
        let made = door::Door::open(&self.cfg, &self.workers()?)?;
        Ok(d.insert(made).clone())
    }

    /// A listening comm: a record in the net's listener, which takes its
    /// streams as they come.
    fn listen_here(&self) -> Result<SocketListen, NetError> {
        let door = self.door()?;
        let nonce = door.register(self.cfg.streams);
        Ok(SocketListen {
            handle: Handle {
                addr: door.addr(),
                streams: self.cfg.streams,
                nonce,
                min_part: self.cfg.min_part,
            }
            .encode(),
            door,
            nonce,
            accepted: false,
            cfg: self.cfg.clone(),
            workers: self.workers.clone(),
            rx_staging: self.rx_staging.clone(),
        })
    }
}

/// While tracing is on, what a staged payload holds (its first eight
/// bytes, whether every byte is zero), where `side` (`tx`, `rx`) saw it:
/// bytes a receive lands wrong can then be traced to the wire or not.
pub(super) fn trace_payload(side: &'static str, seq: u64, off: u64, bytes: &[u8]) {
    if tracing::enabled!(tracing::Level::TRACE) {
        let mut head = [0u8; 8];
        let n = bytes.len().min(8);
        head[..n].copy_from_slice(&bytes[..n]);
        let zero = bytes.iter().all(|&b| b == 0);
        tracing::trace!(
            side,
            seq,
            off,
            len = bytes.len(),
            head = %format_args!("{:016x}", u64::from_be_bytes(head)),
            zero,
            "lat: payload bytes"
        );
    }
}

/// Parts are never cut smaller than this (nor than `min_part`, where that
/// is smaller): 128 KiB parts were tuned on nvidia-h200-x2 (32 cores).
const SPLIT_FLOOR: usize = 128 << 10;

/// How many parts a message of `len` bytes is cut into (at most): a count
/// that grows with the square root of the size, `1 MiB / min_part` parts
/// for 1 MiB, each part at least [`SPLIT_FLOOR`] (or `min_part`, if
/// smaller). Each part's fixed work -- threads woken, copies queued and
/// waited for, on both sides -- adds up where cores are not spare, while
/// its bytes are shared out: `n` parts take about `n·c + len/(n·b)`, least
/// at `n ∝ √len`. Measured on one H100 (16 cores, both sides on it), GPU
/// blocking write: 256 KiB in 2 parts 185 µs p50, in 1 part 235-259; 1 MiB
/// send in 4 parts 255-285, in 8 parts 418-561, and 8 in flight 7.7
/// against 6.7 GB/s.
fn part_count(len: usize, streams: usize, min_part: usize) -> usize {
    let min_part = min_part.max(1);
    let by_size = len.div_ceil(min_part.min(SPLIT_FLOOR));
    // round(p1 · √(len / 1 MiB)) = round(√x) with x = p1² · len / 1 MiB,
    // and round(√x) = (⌊√(4x)⌋ + 1) / 2.
    let p1 = ((1usize << 20) / min_part).max(1) as u128;
    let x4 = (4 * p1 * p1 * len as u128) >> 20;
    let by_root = usize::try_from(x4.isqrt().div_ceil(2)).unwrap_or(usize::MAX);
    by_size.min(by_root).clamp(1, streams.max(1))
}

/// How a message of `len` bytes is cut: every part `per` bytes (a
/// multiple of 4 KiB, so copies stay aligned) but the last, and `count`
/// parts. The receiver checks each part against it ([`book::claim_part`]).
pub(crate) fn split_grid(len: usize, streams: usize, min_part: usize) -> (usize, usize) {
    let nparts = part_count(len, streams, min_part);
    let per = len.div_ceil(nparts).next_multiple_of(4096).max(1);
    (per, len.div_ceil(per).max(1))
}

/// How a message of `len` bytes is cut: `(offset, len)` of each part.
pub fn split_parts(len: usize, streams: usize, min_part: usize) -> Vec<(usize, usize)> {
    let (per, count) = split_grid(len, streams, min_part);
    (0..count)
        .map(|i| (i * per, per.min(len - i * per)))
        .collect()
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
        let h = Handle::decode(handle).map_err(|e| NetError::Protocol {
            net: NET,
            reason: format!("bad listen handle: {e}"),
        })?;
        Ok(Some(super::HandleTarget {
            addr: h.addr,
            connections: h.streams,
        }))
    }
}

// -------------------------------------------------------------- listening

struct SocketListen {
    handle: NetHandle,
    /// The net's listener, and this comm's key in its records.
    door: Arc<door::Door>,
    nonce: u64,
    /// The receive comm is made (it owns the record from then on).
    accepted: bool,
    cfg: SocketConfig,
    workers: LazyWorkers,
    rx_staging: Arc<StagingPool<Landing>>,
}

impl ListenComm for SocketListen {
    fn handle(&self) -> NetHandle {
        self.handle
    }

    fn accept(&mut self, waker: Waker) -> Result<Option<Box<dyn RecvComm>>, NetError> {
        Ok(self
            .accept_here(waker)?
            .map(|r| Box::new(r) as Box<dyn RecvComm>))
    }
}

impl SocketListen {
    /// The receive comm once a first stream has come with a good hello
    /// (the peer opens more as its messages want them; the net's listener
    /// gives them to the comm).
    fn accept_here(&mut self, waker: Waker) -> Result<Option<SocketRecv>, NetError> {
        if self.accepted {
            return Err(NetError::Misuse {
                net: NET,
                reason: "accept on a listen comm that has accepted".into(),
            });
        }
        if !self.door.has_early(self.nonce) {
            return Ok(None);
        }
        if let Some(gpu) = self.cfg.gpu {
            // A ring per stream the comm may have, once per endpoint: with
            // only two made ahead, a connection's first messages (one per
            // stream, landing at once) took a new ring each -- 3-5 ms
            // apiece on H100, stalling every CUDA call of the process.
            self.rx_staging.warm(
                gpu,
                self.cfg.staging_slice,
                self.cfg.staging_depth,
                self.cfg.streams.max(2),
            );
        }
        let r = SocketRecv::start(
            &self.door,
            self.nonce,
            &self.cfg,
            waker,
            &self.workers.get(&self.cfg.cpus, self.cfg.spin)?,
            &self.rx_staging,
        )?;
        self.accepted = true;
        Ok(Some(r))
    }
}

impl Drop for SocketListen {
    fn drop(&mut self) {
        if !self.accepted {
            self.door.forget(self.nonce);
        }
    }
}

/// What an I/O thread works with: its stream's index, how long it may
/// spin, its pinned staging (slice size, slices) and the GPU to make it for
/// when it starts.
#[derive(Clone, Copy)]
struct Lane {
    index: usize,
    spin: Duration,
    slice: usize,
    depth: usize,
    /// Send side: lend large GPU windows to the socket.
    splice: bool,
    /// Nothing to do for this long: the stream gives its worker back.
    linger: Duration,
    /// Receive side: no byte inside a part for this long fails the comm
    /// ([`SocketConfig::stall`]; zero: never).
    stall: Duration,
}

impl Lane {
    fn new(index: usize, cfg: &SocketConfig) -> Self {
        Lane {
            index,
            spin: cfg.spin,
            slice: cfg.staging_slice,
            depth: cfg.staging_depth,
            splice: cfg.splice,
            linger: cfg.linger,
            stall: cfg.stall,
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
        hello_timeout: Duration::from_secs(5),
        spin: Duration::from_micros(20),
        linger: Duration::from_millis(100),
        cpus: None,
        gpu: None,
        splice: true,
        stall: Duration::from_secs(10),
    }
}

/// A connected comm pair (tests): from a net set up as `tx` to one set up
/// as `rx`.
#[cfg(test)]
pub(crate) fn test_pair(
    tx: SocketConfig,
    rx: SocketConfig,
) -> (Box<dyn SendComm>, Box<dyn RecvComm>) {
    let (s, r) = test_pair_here(tx, rx);
    (s, Box::new(r))
}

/// As [`test_pair`], the receive comm as itself.
#[cfg(test)]
fn test_pair_here(tx: SocketConfig, rx: SocketConfig) -> (Box<dyn SendComm>, SocketRecv) {
    let waker: Waker = Arc::new(|| {});
    let mut l = SocketNet::new(rx).listen_here().unwrap();
    let s = SocketNet::new(tx)
        .connect(0, &l.handle(), waker.clone())
        .unwrap()
        .unwrap();
    let deadline = Instant::now() + Duration::from_secs(5);
    loop {
        if let Some(r) = l.accept_here(waker.clone()).unwrap() {
            return (s, r);
        }
        assert!(Instant::now() < deadline);
        std::thread::sleep(Duration::from_millis(1));
    }
}
