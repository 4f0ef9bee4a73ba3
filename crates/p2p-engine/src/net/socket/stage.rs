//! An I/O thread's GPU staging: a [`Ring`] of pinned slots made for a GPU
//! when first needed (or ahead, for the endpoint's GPU), remade for another
//! GPU; on a send stream, lent to the socket ([`super::splice`]) where that
//! works. `T` is what a receive stream parks on a slot until its copies
//! land (a send stream parks nothing).

use std::io;
use std::net::TcpStream;
use std::sync::Arc;

use super::splice::Splicer;
use crate::error::NetError;
use crate::gpu::staging::Ring;

/// Why a send thread's pipe waited, logged (`debug`) when its staging is
/// dropped: how often the oldest window's copy had not landed when it was
/// due, how far the copies ran ahead then, and why topping the copies up
/// stopped.
#[derive(Default)]
pub(super) struct PipeStats {
    pub(super) on: bool,
    pub(super) windows: u64,
    pub(super) not_landed: u64,
    pub(super) ahead_at_wait: u64,
    pub(super) stop_lent: u64,
    pub(super) stop_dry: u64,
    pub(super) credit_blocks: u64,
}

/// One GPU's staging: the ring, and on a send stream what its slots owe
/// the socket.
pub(super) struct Staging<T> {
    pub(super) ring: Ring<T>,
    /// Its slots are mapped here and registered with CUDA.
    mapped: bool,
    /// Send side, slots lent to the socket: per slot, the lent count at the
    /// end of its last window (the credit it waits for before it is
    /// written again; see [`super::splice`]).
    pub(super) lent: Vec<u64>,
    /// Send side: why the pipe waited (counted with `debug` logging only).
    pub(super) stats: PipeStats,
}

impl<T> Drop for Staging<T> {
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
                depth = self.ring.depth(),
                "tx pipe waits"
            );
        }
    }
}

impl<T> Staging<T> {
    /// `mapped`: slots in memory mapped here and registered with CUDA
    /// rather than allocated by it (see [`Stager::mapped`]).
    fn new(device: i32, slice: usize, depth: usize, mapped: bool) -> Result<Self, NetError> {
        let kernel = crate::config::GpuSwitches::get().copy_kernel;
        Ok(Staging {
            ring: Ring::new(device, slice, depth, mapped, kernel)?,
            mapped,
            lent: vec![0; depth.max(1)],
            stats: PipeStats {
                on: tracing::enabled!(tracing::Level::DEBUG),
                ..PipeStats::default()
            },
        })
    }

    /// Whether every slot can be lent to a pipe.
    fn probe_lend(&self, sp: &Splicer) -> io::Result<()> {
        let slice = self.ring.slice();
        (0..self.ring.depth()).try_for_each(|k| sp.probe(self.ring.slot_bytes(k, slice)))
    }

    /// Whether slot `k` may be written: not lent, or credited since (taking
    /// the credits that have come, without waiting for more).
    pub(super) fn unlent(&mut self, k: usize, sp: Option<&mut Splicer>) -> Result<bool, NetError> {
        let mark = self.lent[k];
        let Some(sp) = sp.filter(|sp| mark > sp.credited()) else {
            return Ok(true);
        };
        sp.poll_credits().map_err(credit_err)?;
        Ok(mark <= sp.credited())
    }

    /// The highest credit any slot waits for.
    fn lent_mark(&self) -> u64 {
        self.lent.iter().copied().max().unwrap_or(0)
    }
}

pub(super) fn credit_err(e: io::Error) -> NetError {
    NetError::io(super::NET, "reading lent-page credits", e)
}

/// An I/O thread's staging: made for a GPU when first needed (or ahead,
/// for the endpoint's GPU), remade for another GPU, `depth` slices of
/// `slice` bytes.
pub(super) struct Stager<T> {
    pub(super) cur: Option<Staging<T>>,
    /// Where this stream takes its staging from and gives it back to (see
    /// [`StagingPool`]); None: its own, kept.
    pool: Option<Arc<StagingPool<T>>>,
    slice: usize,
    depth: usize,
    /// Slots in memory mapped here and registered with CUDA: set when the
    /// driver's own pinned memory cannot be lent to a pipe (`vmsplice`).
    mapped: bool,
    /// Send side: lending large GPU windows to the socket.
    pub(super) lend: Lend,
}

/// Staging rings that the receive streams (or the send streams) of an
/// endpoint share: a stream takes one when a GPU part comes and gives it
/// back when it waits for work (all its copies landed, all its lent slots
/// read by the peer), so the pinned memory follows the streams busy
/// at once, not the peers (each stream making its own at connect held
/// 4 MiB of pinned memory per stream, 128 MiB per peer, and took
/// milliseconds per stream to make).
pub(super) struct StagingPool<T> {
    free: parking_lot::Mutex<Vec<Staging<T>>>,
    /// Most rings kept free; more are freed.
    keep: usize,
    warmed: std::sync::atomic::AtomicBool,
}

impl<T> StagingPool<T> {
    pub(super) fn new(keep: usize) -> Self {
        StagingPool {
            free: parking_lot::Mutex::new(Vec::new()),
            keep,
            warmed: std::sync::atomic::AtomicBool::new(false),
        }
    }

    /// Makes `n` rings for GPU `device` once, ahead of the first GPU
    /// message (pinned allocations take milliseconds each: measured on
    /// h200-x2, the first size of a run read 4.75 GB/s at 64 KiB where the
    /// next read 14.75). A failure is left for the first GPU message.
    pub(super) fn warm(&self, device: i32, slice: usize, depth: usize, n: usize) {
        if self.warmed.swap(true, std::sync::atomic::Ordering::AcqRel) {
            return;
        }
        for _ in 0..n.min(self.keep) {
            match Staging::new(device, slice, depth, false) {
                Ok(st) => self.put(st),
                Err(e) => {
                    tracing::debug!(gpu = device, "pinned staging not made ahead: {e}");
                    return;
                }
            }
        }
    }

    fn take(&self, device: i32, slice: usize, depth: usize, mapped: bool) -> Option<Staging<T>> {
        let mut free = self.free.lock();
        let i = free.iter().position(|st| {
            st.ring.device() == device
                && st.ring.slice() == slice
                && st.ring.depth() == depth.max(1)
                && st.mapped == mapped
        })?;
        Some(free.swap_remove(i))
    }

    fn put(&self, st: Staging<T>) {
        let extra = {
            let mut free = self.free.lock();
            if free.len() < self.keep {
                free.push(st);
                None
            } else {
                Some(st)
            }
        };
        // One more than the pool keeps is let go outside its lock (freeing
        // pinned memory takes milliseconds).
        drop(extra);
    }
}

/// Whether a send stream lends its staging to the socket
/// ([`super::splice`]).
pub(super) enum Lend {
    Off,
    /// Wanted; set up (pipe made, staging probed) at the first large GPU
    /// part.
    Wanted(Arc<TcpStream>),
    On(Splicer),
}

impl<T> Stager<T> {
    /// Staging made later, on first use.
    pub(super) fn lazy(slice: usize, depth: usize) -> Self {
        Stager {
            cur: None,
            pool: None,
            slice,
            depth,
            mapped: false,
            lend: Lend::Off,
        }
    }

    /// Makes this stream's GPU (if it has staging) current on the calling
    /// thread: a stream's work moves between the I/O workers.
    pub(super) fn bind_here(&self) {
        if let Some(st) = &self.cur {
            if let Err(e) = crate::gpu::bind_here(st.ring.device()) {
                tracing::debug!(gpu = st.ring.device(), "cannot make the GPU current: {e}");
            }
        }
    }

    /// Staging taken from `pool` when first needed and given back with
    /// [`Stager::give_back`].
    pub(super) fn pooled(pool: Arc<StagingPool<T>>, slice: usize, depth: usize) -> Self {
        Stager {
            pool: Some(pool),
            ..Stager::lazy(slice, depth)
        }
    }

    /// The stream goes quiet: its staging (every copy landed, no token
    /// left) goes back to its pool for any stream to take.
    pub(super) fn give_back(&mut self) {
        if self.landing() {
            return;
        }
        let (Some(pool), Some(st)) = (&self.pool, self.cur.as_mut()) else {
            return;
        };
        if let Lend::On(sp) = &mut self.lend {
            // Slots lent to this stream's socket are its until the peer
            // has read them: kept until every one is credited.
            let owed = st.lent.iter().copied().max().unwrap_or(0);
            if owed > sp.credited() && (sp.poll_credits().is_err() || owed > sp.credited()) {
                return;
            }
        }
        // Lent counts are this stream's socket's: none is owed any more.
        st.lent.iter_mut().for_each(|l| *l = 0);
        if let Some(st) = self.cur.take() {
            pool.put(st);
        }
    }

    /// The staging for GPU `device`, made (or remade) if needed. A receive
    /// side must have flushed the old one first.
    pub(super) fn get(&mut self, device: i32) -> Result<&mut Staging<T>, NetError> {
        if let Some(old) = self.cur.as_ref().filter(|s| s.ring.device() != device) {
            // Its lent slots go back to the allocator only once read.
            if let Lend::On(sp) = &mut self.lend {
                sp.wait_credit(old.lent_mark()).map_err(credit_err)?;
            }
            self.cur = None;
        }
        let pooled = || {
            self.pool
                .as_ref()
                .and_then(|p| p.take(device, self.slice, self.depth, self.mapped))
        };
        let st = match self.cur.take() {
            Some(st) => st,
            None => match pooled() {
                // Made on another thread: its GPU current on this one.
                Some(st) => {
                    tracing::trace!("lat: staging from the pool");
                    crate::gpu::bind_here(device)?;
                    st
                }
                None => {
                    let t = std::time::Instant::now();
                    let st = Staging::new(device, self.slice, self.depth, self.mapped)?;
                    tracing::trace!(us = t.elapsed().as_micros() as u64, "lat: staging made");
                    st
                }
            },
        };
        Ok(self.cur.insert(st))
    }

    /// The staging for GPU `device` and, where this stream lends its large
    /// windows to the socket, the splicer: set up at the first call, the
    /// slots probed (remade in mapped memory if the driver's cannot be
    /// lent; not lent at all if neither can).
    pub(super) fn lending(
        &mut self,
        device: i32,
    ) -> Result<(&mut Staging<T>, Option<&mut Splicer>), NetError> {
        if let Lend::Wanted(sock) = &self.lend {
            let t = std::time::Instant::now();
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
            tracing::trace!(us = t.elapsed().as_micros() as u64, "lat: lending set up");
        }
        self.get(device)?;
        let sp = match &mut self.lend {
            Lend::On(sp) => Some(sp),
            _ => None,
        };
        let st = self.cur.as_mut().ok_or(NetError::Misuse {
            net: super::NET,
            reason: "staging missing".into(),
        })?;
        Ok((st, sp))
    }

    /// Whether tokens wait on copies that have not been waited for.
    pub(super) fn landing(&self) -> bool {
        self.cur.as_ref().is_some_and(|st| st.ring.has_landing())
    }

    /// Gives up the tokens behind queued copies without waiting (see
    /// [`Ring::forget`]): after a flush failed.
    pub(super) fn forget(&mut self) {
        if let Some(st) = self.cur.as_mut() {
            drop(st.ring.forget());
        }
    }

    /// Waits for every queued copy; the tokens behind them go to `out`
    /// (see [`Ring::flush`]).
    pub(super) fn flush(&mut self, out: &mut Vec<T>) -> Result<(), NetError> {
        match self.cur.as_mut() {
            Some(st) => Ok(st.ring.flush(out)?),
            None => Ok(()),
        }
    }
}
