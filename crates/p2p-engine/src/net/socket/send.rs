//! Posting sends: a message is cut into parts, each queued to its
//! stream's send task (on the endpoint's I/O workers) -- or, for a lone
//! small message on an idle stream, and for any message up to 1 MiB while
//! the machine has no CPU idle (`crate::spin::machine_full`), written by
//! the posting thread itself without waking anyone.

use std::collections::HashMap;
use std::io::IoSlice;
use std::net::TcpStream;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use crossbeam_channel::{Receiver, Sender};
use parking_lot::Mutex;

use super::segs::{uniform_kind, Segs};
use super::stage::{Stager, StagingPool};
use super::streams::Grow;
use super::tx::{host_slices, SendReq, SendShared, TxOp, TxQueues, TxTask};
use super::wire::{PartHeader, HDR_LEN};
use super::{split_parts, Lane, SocketConfig, INLINE_MAX, NET};
use crate::error::NetError;
use crate::gpu::staging::StageStep;
use crate::memory::MemKind;
use crate::net::timing::{self, Spent};
use crate::net::{MemRef, MrHandle, ReqId, SendComm, Waker};
use crate::workers::{Home, Workers};

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

/// A stream is given parts while it has less than this queued and not yet
/// written; past it (on every stream) parts wait in the comm's spill for
/// the first stream to drain its own ([`SocketSend::spill`]). Enough for a
/// stream to keep its staging busy (several parts of a large message, 8
/// of a 4 MiB message's 512 KiB ones), little beside a message of several
/// hundred MiB, whose parts are given at once.
const AHEAD: usize = 4 << 20;

/// Messages up to this size are written by the posting thread (what an
/// idle stream's socket takes at once) when the machine has no CPU idle.
/// Measured on the 2-core box with two CPU hogs, host memory, UCCL's loop
/// (`sendrecv_loop.py --shape uccl`): 64 KiB 0.07-0.99 → 3.17-3.58 GB/s,
/// 256 KiB 0.16-0.22 → 1.56-6.04, 1 MiB 0.48-0.66 → 1.25-1.48. Written
/// this way at any size, 10 MiB read lower (2.07-2.91 → 1.48-1.89), so
/// larger messages go to the streams' threads as before.
const FULL_DIRECT_MAX: usize = 1 << 20;

pub(super) struct SocketSend {
    txs: Vec<Sender<TxOp>>,
    socks: Vec<Arc<TcpStream>>,
    /// Each stream's send task: woken when a part is queued to it.
    tasks: Vec<Arc<Home>>,
    /// The I/O workers its streams' tasks run on (kept alive while this
    /// comm is).
    workers: Workers,
    shared: Arc<SendShared>,
    reqs: HashMap<u64, Arc<SendReq>>,
    next_seq: u64,
    /// The posting thread's own pinned slot, for small GPU parts it copies
    /// and writes itself when their stream is idle.
    inline_staging: Stager<()>,
    /// A ring of the streams' pool (one slot of a stream's slice), taken by
    /// the posting thread for a larger GPU part it writes itself when no
    /// CPU is idle, and given back after.
    full_staging: Stager<()>,
    /// When the last `isend` returned: a part is written (a GPU part copied
    /// and written) inline only when it does not follow another post
    /// closely (a lone message, where latency counts); a burst (KV blocks)
    /// goes to the I/O threads, which batch it.
    last_post: Instant,
    /// See [`LONE_GAP`].
    lone_gap: Duration,
    /// Bytes (headers and payloads, [`TxOp::weight`]) queued to and not
    /// yet finished by each stream's I/O thread: a part goes to the stream
    /// with the least ([`least_queued`]).
    queued: Vec<Arc<AtomicUsize>>,
    /// Parts no stream was given (every stream had [`AHEAD`] bytes queued,
    /// or earlier parts wait here), taken by whichever stream drains its
    /// own queue first: a stream whose receiver reads slowly takes fewer.
    spill: Sender<TxOp>,
    spilled: Receiver<TxOp>,
    /// The streams still to come ([`Grow`]).
    streams: Grow,
    cfg: SocketConfig,
    /// Pinned staging the send streams share.
    staging: Arc<StagingPool<()>>,
}

impl SocketSend {
    /// A send comm on its first stream; `grow` opens more as messages
    /// want them.
    pub(super) fn start(
        first: TcpStream,
        grow: Grow,
        cfg: &SocketConfig,
        waker: Waker,
        workers: &Workers,
        staging: &Arc<StagingPool<()>>,
    ) -> Result<Self, NetError> {
        let shared = Arc::new(SendShared {
            failed: Mutex::new(None),
            waker,
        });
        let (spill, spilled) = crossbeam_channel::unbounded::<TxOp>();
        let mut me = SocketSend {
            txs: Vec::new(),
            socks: Vec::new(),
            tasks: Vec::new(),
            workers: workers.clone(),
            shared,
            reqs: HashMap::new(),
            next_seq: 0,
            // Made by the posting thread at its first lone GPU message, not
            // here: making it binds the GPU's context on the calling
            // (application) thread.
            inline_staging: Stager::<()>::lazy(INLINE_MAX, 1),
            full_staging: Stager::pooled(staging.clone(), cfg.staging_slice, 1),
            last_post: Instant::now(),
            lone_gap: if cfg.spin.is_zero() {
                LONE_GAP
            } else {
                LONE_GAP_SPIN
            },
            queued: Vec::new(),
            spill,
            spilled,
            streams: grow,
            cfg: cfg.clone(),
            staging: staging.clone(),
        };
        me.add_stream(first);
        Ok(me)
    }

    /// Takes in the next stream (index `txs.len()`): its send task starts
    /// idle (no thread) until a part is queued to it; it takes staging
    /// from the endpoint's pool at its first GPU part.
    fn add_stream(&mut self, s: TcpStream) {
        let s = Arc::new(s);
        let (tx, rx) = crossbeam_channel::unbounded::<TxOp>();
        let q = Arc::new(AtomicUsize::new(0));
        let task = TxTask::new(
            s.clone(),
            TxQueues {
                own: rx,
                spill: self.spilled.clone(),
                queued: q.clone(),
            },
            self.shared.clone(),
            Lane::new(self.txs.len(), &self.cfg),
            self.staging.clone(),
            self.workers.clone(),
        );
        self.tasks.push(self.workers.start_idle(Box::new(task)));
        self.txs.push(tx);
        self.socks.push(s);
        self.queued.push(q);
    }

    /// Takes in the streams connected since the last look.
    fn take_new_streams(&mut self) {
        for s in self.streams.take_ready() {
            self.add_stream(s);
            tracing::trace!(streams = self.txs.len(), "lat: tx stream taken in");
        }
    }

    /// Streams open now (tests).
    #[cfg(test)]
    pub(super) fn stream_count(&self) -> usize {
        self.txs.len()
    }

    /// Whether no part waits in the spill (tests).
    #[cfg(test)]
    pub(super) fn spilled_is_empty(&self) -> bool {
        self.spilled.is_empty()
    }

    /// Waits for the streams being opened and takes them in (tests).
    #[cfg(test)]
    pub(super) fn settle_streams(&mut self) {
        self.streams.settle();
        self.take_new_streams();
    }
}

impl SocketSend {
    /// A small host part on an idle stream, written without blocking.
    /// Returns it (what was written counted in `skip`) if the socket took
    /// only part of it, or would block, or failed (the stream's thread then
    /// writes the rest, or reports the error).
    fn send_host_inline(&self, k: usize, mut op: TxOp) -> Option<TxOp> {
        let iov: Vec<IoSlice<'_>> = host_slices(&op)
            .into_iter()
            .map(IoSlice::new)
            .take(64)
            .collect();
        let sent = socket2::SockRef::from(&*self.socks[k])
            .send_vectored_with_flags(&iov, libc::MSG_DONTWAIT | libc::MSG_NOSIGNAL);
        match sent {
            Ok(n) if n == HDR_LEN + op.len => return None,
            Ok(n) => op.skip = n,
            Err(_) => {}
        }
        Some(op)
    }

    /// A GPU part on an idle stream (a small one, or one up to a stream's
    /// staging slice when no CPU is idle): copied out by this thread and
    /// written without blocking, so that no I/O thread has to wake for it.
    /// Returns what is left for the stream's thread (as host bytes) if the
    /// socket took only part of it.
    fn send_gpu_inline(&mut self, k: usize, dev: i32, op: TxOp) -> Result<Option<TxOp>, NetError> {
        let len = op.len;
        let big = len > INLINE_MAX;
        let stager = if big {
            &mut self.full_staging
        } else {
            &mut self.inline_staging
        };
        let sock = &*self.socks[k];
        let written = stager.get(dev).and_then(|st| {
            let data = st
                .ring
                .stage_out(op.pieces.iter().map(|m| (m.addr, m.len)), |step| {
                    timing::mark(match step {
                        StageStep::Start => Spent::Other,
                        StageStep::Queued => Spent::Driver,
                        StageStep::Landed => Spent::Copies,
                    })
                })?;
            tracing::trace!("lat: staged out");
            let iov = [IoSlice::new(&op.hdr), IoSlice::new(data)];
            let sent = socket2::SockRef::from(sock)
                .send_vectored_with_flags(&iov, libc::MSG_DONTWAIT | libc::MSG_NOSIGNAL)
                .unwrap_or(0);
            Ok((sent < HDR_LEN + len).then(|| TxOp {
                head: op.head,
                hdr: op.hdr,
                pieces: Vec::new(),
                len,
                owned: Some(data.to_vec()),
                req: op.req,
                skip: sent,
            }))
        });
        if big {
            // The ring goes back for the streams (and the next such part),
            // whether or not the copy out succeeded.
            stager.give_back();
        }
        written
    }
}

/// The stream a part goes to: the one with the fewest bytes queued and not
/// yet written, the first such from `turn` (mod the count) among equals --
/// so idle streams take parts in rotation, and a stream whose receiver
/// reads slowly takes fewer. Measured on 2 x H100 (a traced NIXL WRITE of
/// 131,072 x 4 KiB, one part of every message on every stream in turn):
/// seven receive streams had read their parts by 20-24 ms, the eighth, at
/// 250-300 us a part against 100-180, went on to 35 ms, and every message
/// waited for its part there.
pub(super) fn least_queued(queued: &[Arc<AtomicUsize>], turn: usize) -> usize {
    let n = queued.len().max(1);
    (0..n)
        .map(|j| (turn + j) % n)
        .min_by_key(|&k| queued.get(k).map_or(0, |q| q.load(Ordering::Acquire)))
        .unwrap_or(0)
}

impl SendComm for SocketSend {
    fn isend(&mut self, mem: MemRef, mr: MrHandle) -> Result<Option<ReqId>, NetError> {
        self.isendv(&[mem], &[mr])
    }

    fn isendv(&mut self, segs: &[MemRef], _mrs: &[MrHandle]) -> Result<Option<ReqId>, NetError> {
        if let Some(f) = self.shared.failed.lock().clone() {
            return Err(f);
        }
        let segs = Segs::new(segs)?;
        let shape = segs.shape;
        let seq = self.next_seq;
        tracing::trace!(seq, bytes = segs.total, "lat: isend");
        self.next_seq += 1;
        // Streams connected since the last message carry this one; a
        // message cut into more parts than there are streams asks for more
        // (for later messages: this one is not held up).
        self.take_new_streams();
        let parts = split_parts(segs.total, self.cfg.streams, self.cfg.min_part);
        if parts.len() > self.txs.len() {
            self.streams.want(parts.len());
        }
        let req = Arc::new(SendReq {
            parts_left: AtomicUsize::new(parts.len()),
            size: segs.total,
            error: Mutex::new(None),
        });
        let lone = self.last_post.elapsed() >= self.lone_gap;
        // With no CPU idle, a part handed to a stream's task waits for a
        // CPU (a scheduler's slice); this thread has one: it writes what
        // an idle stream's socket takes of a message up to FULL_DIRECT_MAX
        // itself (larger ones gain more from the streams' threads writing
        // at once than they lose to their wake-ups).
        let full = segs.total <= FULL_DIRECT_MAX && crate::spin::machine_full();
        // Parts follow parts already spilled (a stream takes its parts in
        // the order they were posted: a part never goes ahead of an
        // earlier message's on one stream).
        let mut spilling = !self.spilled.is_empty();
        for (i, &(off, len)) in parts.iter().enumerate() {
            let head = PartHeader {
                seq,
                off: off as u64,
                len: len as u64,
                total: segs.total as u64,
                nparts: parts.len() as u64,
                shape,
                spliced: false,
            };
            let mut op = TxOp {
                head,
                hdr: head.encode(),
                pieces: segs.pieces(off, len),
                len,
                req: req.clone(),
                skip: 0,
                owned: None,
            };
            // The stream with the fewest bytes still queued carries the
            // part, the rotation's turn (seq + i) among equals; the
            // receiver takes parts from any stream.
            let k = least_queued(&self.queued, seq as usize + i);
            let weight = op.weight();
            if spilling || self.queued[k].load(Ordering::Acquire) >= AHEAD {
                spilling = true;
                self.spill
                    .send(op)
                    .map_err(|_| NetError::Closed { net: NET })?;
                continue;
            }
            let kind = uniform_kind(&op.pieces);
            // A lone small part -- or, with no CPU idle, a part of a message
            // up to FULL_DIRECT_MAX (a GPU one up to a staging slice) -- is
            // written by this thread when its stream is idle: the stream is
            // held (its count taken from 0) so that its task does not take a
            // spilled part and write meanwhile.
            let direct = match kind {
                Some(MemKind::Host) => (len <= INLINE_MAX && lone) || full,
                Some(MemKind::Cuda(_)) => {
                    (len <= INLINE_MAX && lone) || (full && len <= self.cfg.staging_slice)
                }
                _ => false,
            } && self.queued[k]
                .compare_exchange(0, weight, Ordering::AcqRel, Ordering::Acquire)
                .is_ok();
            if direct {
                // Accounted as the stream's own writes are (`timing`, with
                // debug logging): this thread's share of its bytes.
                let _account = (!timing::is_open()).then(|| super::tx::account(&self.socks[k], k));
                let written = match kind {
                    Some(MemKind::Cuda(dev)) => self.send_gpu_inline(k, dev, op),
                    _ => Ok(self.send_host_inline(k, op)),
                };
                timing::mark(Spent::Socket);
                timing::bytes(match &written {
                    Ok(None) => HDR_LEN + len,
                    Ok(Some(rest)) => rest.skip,
                    Err(_) => 0,
                });
                match written {
                    Ok(None) => {
                        tracing::trace!(seq, "lat: sent inline");
                        self.queued[k].fetch_sub(weight, Ordering::AcqRel);
                        req.parts_left.fetch_sub(1, Ordering::AcqRel);
                        continue;
                    }
                    Ok(Some(rest)) => op = rest,
                    Err(e) => {
                        self.queued[k].fetch_sub(weight, Ordering::AcqRel);
                        return Err(e);
                    }
                }
            } else {
                self.queued[k].fetch_add(weight, Ordering::AcqRel);
            }
            // (Counted above: the rest of a part written in part weighs
            // what the part does.)
            self.txs[k]
                .send(op)
                .map_err(|_| NetError::Closed { net: NET })?;
            self.tasks[k].kick();
        }
        if spilling {
            // Every stream was busy. One that drains looks at the spill
            // before it waits; one that had started to wait on its own
            // queue just before the part spilled is run again, by this
            // kick, once its wait ends (the busy streams take the part
            // first as they drain).
            for t in &self.tasks {
                t.kick();
            }
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
            return Err(e);
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
        // Its tasks are closed: none runs again; a running one ends here.
        Home::end_all(&self.tasks, Duration::from_secs(5), "socket net send comm");
    }
}
