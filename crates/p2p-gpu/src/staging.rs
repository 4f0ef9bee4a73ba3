//! A ring of pinned host slots and one CUDA stream, for the copies between
//! a network stream and GPU memory (one ring per I/O thread). Each slot has
//! an event recorded behind the copies queued on it; a slot is reused only
//! once its event has completed.
//!
//! The ring knows nothing of what the copies are for: a receive side parks
//! a token of its own type `T` on the slot whose copies a piece of work
//! waits for, and [`Ring::reap`], [`Ring::next_slot`] and [`Ring::flush`]
//! hand back the tokens whose copies have landed, for the caller to
//! complete. A send side uses the slots one window at a time and carries
//! no tokens.
//!
//! Raw pinned memory and CUDA copies: `unsafe` is allowed here.

use super::{push_copy, CopyOp, Device, Event, PinnedBuf, Stream};
use crate::CudaError;

/// A window of at least this many copies goes through the copy kernel (one
/// launch) rather than the copy engines (one transfer, and the driver's
/// per-copy work, each). Measured on nvidia-h200-x2 with 32 KiB KV blocks
/// scattered, 32 to a 1 MiB window: the driver's work took 23-27 % of the
/// stream threads' busy time on both sides.
const KERNEL_MIN_COPIES: usize = 4;
const KERNEL_MAX_COPIES: usize = 1024;

/// One slot: its pinned slice, the event recorded after the copies queued
/// on it, and whether those copies may still be running.
type Slot = (PinnedBuf, Event, bool);

/// Pinned slots and a CUDA stream on one GPU; `T` is what a receive side
/// parks on a slot until its copies land.
pub struct Ring<T> {
    device: i32,
    stream: Stream,
    slots: Vec<Slot>,
    /// Receive side: the slot being filled (small pieces share one) and its
    /// bytes used.
    fill_slot: usize,
    fill_used: usize,
    /// Receive side: per slot, the tokens whose copies out of it are queued
    /// and which are handed back when those copies have landed.
    landing: Vec<Vec<T>>,
    /// Receive side: copies out of the slot being filled, not yet queued
    /// (queued as one batch when the slot is sealed or flushed).
    pending: Vec<CopyOp>,
    /// Per slot, the copy kernel (its descriptors reused with the slot):
    /// a window of scattered copies goes in one launch. `None` until first
    /// needed; empty where it cannot load or may not be used (then the
    /// copy engines do every copy).
    kernels: Option<Vec<super::unpack::CopyKernel>>,
    /// Whether the copy kernel may be used at all
    /// ([`crate::GpuSwitches::copy_kernel`]).
    kernel_allowed: bool,
    /// Slots in memory mapped here and registered with CUDA (the kernel
    /// is used only on the driver's own pinned memory).
    mapped: bool,
}

impl<T> Ring<T> {
    /// `depth` slots of `slice` bytes on GPU `device`, allocated by the
    /// driver or (`mapped`) mapped here and registered with CUDA.
    pub fn new(
        device: i32,
        slice: usize,
        depth: usize,
        mapped: bool,
        kernel_allowed: bool,
    ) -> Result<Self, CudaError> {
        let dev = Device::get(device)?;
        dev.bind()?;
        let stream = Stream::new()?;
        let mut slots = Vec::with_capacity(depth);
        for _ in 0..depth.max(1) {
            let buf = if mapped {
                PinnedBuf::new_mapped(slice)
            } else {
                PinnedBuf::new(slice)
            };
            slots.push((buf?, Event::new()?, false));
        }
        Ok(Ring {
            device,
            stream,
            landing: (0..slots.len()).map(|_| Vec::new()).collect(),
            slots,
            fill_slot: 0,
            fill_used: 0,
            pending: Vec::new(),
            kernels: None,
            kernel_allowed,
            mapped,
        })
    }

    pub fn device(&self) -> i32 {
        self.device
    }

    pub fn depth(&self) -> usize {
        self.slots.len()
    }

    pub fn slice(&self) -> usize {
        self.slots[0].0.len()
    }

    /// Slot `k`'s host address.
    pub fn slot_addr(&self, k: usize) -> u64 {
        self.slots[k].0.as_ptr() as u64
    }

    /// The first `len` bytes of slot `k`.
    pub fn slot_bytes(&self, k: usize, len: usize) -> &[u8] {
        self.slots[k].0.as_slice(len)
    }

    /// The first `len` bytes of slot `k`, to read into.
    pub fn slot_bytes_mut(&mut self, k: usize, len: usize) -> &mut [u8] {
        self.slots[k].0.as_mut_slice(len)
    }

    /// Whether slot `k`'s copies are queued and have not landed yet (a
    /// query that fails counts as landed).
    pub fn still_copying(&self, k: usize) -> bool {
        self.slots[k].2 && !self.slots[k].1.is_done().unwrap_or(true)
    }

    /// Queues `ops` (one window's copies, to or from slot `k`) on the
    /// stream: many of a large part (`large`) in one launch of slot `k`'s
    /// copy kernel, few -- or all, without the kernel -- through the copy
    /// engines. (Small parts' copies stay on the copy engines, where they
    /// were measured.)
    ///
    /// # Safety
    /// Each range must be device memory or this ring's pinned memory,
    /// untouched until slot `k`'s next event completes; slot `k`'s previous
    /// event has completed.
    pub unsafe fn queue_copies(
        &mut self,
        k: usize,
        ops: &[CopyOp],
        large: bool,
    ) -> Result<(), CudaError> {
        let many = large && (KERNEL_MIN_COPIES..=KERNEL_MAX_COPIES).contains(&ops.len());
        if many && self.kernels.is_none() {
            let n = self.slots.len();
            self.kernels = Some(if self.kernel_allowed && !self.mapped {
                Device::get(self.device)
                    .and_then(|d| {
                        (0..n)
                            .map(|_| super::unpack::CopyKernel::new(&d, KERNEL_MAX_COPIES))
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
        unsafe {
            match kernel {
                Some(kn) => kn.launch(&self.stream, ops),
                None => self.stream.copy_batch(ops),
            }
        }
    }

    /// Records slot `k`'s event behind the copies queued so far.
    pub fn seal(&mut self, k: usize) -> Result<(), CudaError> {
        self.slots[k].1.record(&self.stream)?;
        self.slots[k].2 = true;
        Ok(())
    }

    /// Waits for slot `k`'s copies, if any are queued.
    pub fn wait(&mut self, k: usize) -> Result<(), CudaError> {
        if self.slots[k].2 {
            self.slots[k].1.synchronize()?;
            self.slots[k].2 = false;
        }
        Ok(())
    }

    /// Copies `parts` (device ranges `(address, length)`, together at most
    /// one slot) back to back into slot 0 and waits once for all of them;
    /// returns the staged bytes. `mark` is called between the steps (time
    /// accounting): after the copies are queued and after they landed.
    pub fn stage_out(
        &self,
        parts: impl IntoIterator<Item = (u64, usize)>,
        mut mark: impl FnMut(StageStep),
    ) -> Result<&[u8], CudaError> {
        let slot = &self.slots[0];
        let mut off = 0;
        let mut ops = Vec::new();
        for (src, len) in parts {
            let dst = slot.0.as_ptr() as u64 + off as u64;
            push_copy(&mut ops, CopyOp { dst, src, len });
            off += len;
        }
        mark(StageStep::Start);
        // SAFETY: the parts fit the slot together, back to back; each
        // device range was checked by the caller.
        unsafe { self.stream.copy_batch(&ops) }?;
        slot.1.record(&self.stream)?;
        mark(StageStep::Queued);
        slot.1.synchronize()?;
        mark(StageStep::Landed);
        Ok(slot.0.as_slice(off))
    }

    // ----------------------------------------------------- receive side

    /// Whether tokens wait on copies that have not been waited for.
    pub fn has_landing(&self) -> bool {
        self.landing.iter().any(|l| !l.is_empty())
    }

    /// The next `len` bytes of the slot being filled, to read into.
    pub fn fill_buf(&mut self, len: usize) -> &mut [u8] {
        let (k, at, slice) = (self.fill_slot, self.fill_used, self.slice());
        &mut self.slots[k].0.as_mut_slice(slice)[at..at + len]
    }

    /// Takes the `len` bytes just read into [`Ring::fill_buf`]: their
    /// copies to `dst` (device ranges `(address, length)`, in order) are
    /// batched with the slot's other pending copies, and `token` is handed
    /// back once they have landed.
    pub fn fill(&mut self, dst: impl IntoIterator<Item = (u64, usize)>, len: usize, token: T) {
        let k = self.fill_slot;
        let mut src = self.slot_addr(k) + self.fill_used as u64;
        for (addr, n) in dst {
            push_copy(
                &mut self.pending,
                CopyOp {
                    dst: addr,
                    src,
                    len: n,
                },
            );
            src += n as u64;
        }
        self.fill_used += len;
        self.landing[k].push(token);
    }

    /// Parks `token` behind the copies queued on the slot being filled;
    /// returns it at once when those copies have landed already.
    pub fn park(&mut self, token: T) -> Option<T> {
        if self.slots[self.fill_slot].2 {
            self.landing[self.fill_slot].push(token);
            None
        } else {
            Some(token)
        }
    }

    /// Queues the copies out of the slot being filled, in one batch.
    fn issue_pending(&mut self) -> Result<(), CudaError> {
        // Small parts' copies stay on the copy engines: the kernel was
        // measured on windows of scattered blocks only.
        // SAFETY: each copy reads bytes already read into the slot, which
        // stay untouched until the slot's next event completes, and writes
        // inside device memory the caller checked.
        let r = unsafe { self.stream.copy_batch(&self.pending) };
        self.pending.clear();
        r
    }

    /// Hands back the tokens whose copies out of slot `k` have landed.
    fn landed(&mut self, k: usize, out: &mut Vec<T>) {
        out.append(&mut self.landing[k]);
    }

    /// Waits for slot `k`'s copies and hands back the tokens behind them.
    fn reclaim(&mut self, k: usize, out: &mut Vec<T>) -> Result<(), CudaError> {
        self.wait(k)?;
        self.landed(k, out);
        Ok(())
    }

    /// Hands back (into `out`) the tokens behind the oldest slots whose
    /// copies have landed, without waiting (one stream: they land in order,
    /// so it stops at the first that has not).
    pub fn reap(&mut self, out: &mut Vec<T>) -> Result<(), CudaError> {
        let depth = self.depth();
        for step in 1..=depth {
            let j = (self.fill_slot + step) % depth;
            if !self.slots[j].2 {
                continue;
            }
            if !self.slots[j].1.is_done()? {
                break;
            }
            self.slots[j].2 = false;
            self.landed(j, out);
        }
        Ok(())
    }

    /// The slot to read the next `need` bytes into: the one being filled
    /// while they fit and it is not sealed, else the next one (its copies
    /// waited for, the tokens behind them handed back into `out`), the
    /// filled one sealed first.
    pub fn next_slot(&mut self, need: usize, out: &mut Vec<T>) -> Result<usize, CudaError> {
        let k = self.fill_slot;
        if self.fill_used > 0 && self.fill_used + need > self.slice() {
            self.issue_pending()?;
            self.seal(k)?;
        }
        if self.slots[k].2 {
            let j = (k + 1) % self.depth();
            self.reclaim(j, out)?;
            self.fill_slot = j;
            self.fill_used = 0;
        }
        Ok(self.fill_slot)
    }

    /// Gives up every token (returned) and the copies not yet queued,
    /// without waiting: only where the stream can no longer be waited on
    /// (its device failed).
    pub fn forget(&mut self) -> Vec<T> {
        self.pending.clear();
        self.fill_used = 0;
        self.landing.iter_mut().flat_map(std::mem::take).collect()
    }

    /// Waits for every queued copy and hands back every token (into
    /// `out`).
    pub fn flush(&mut self, out: &mut Vec<T>) -> Result<(), CudaError> {
        if !self.has_landing() && self.pending.is_empty() && !self.slots.iter().any(|s| s.2) {
            return Ok(());
        }
        self.issue_pending()?;
        // One stream: the newest event covers every copy queued before it.
        let k = self.fill_slot;
        self.seal(k)?;
        tracing::trace!("lat: rx copy queued");
        self.wait(k)?;
        tracing::trace!("lat: rx copy landed");
        for j in 0..self.depth() {
            self.slots[j].2 = false;
            self.landed(j, out);
        }
        self.fill_used = 0;
        Ok(())
    }
}

/// The steps of [`Ring::stage_out`], for the caller's time accounts.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum StageStep {
    /// Before the copies are queued.
    Start,
    /// The copies are queued (driver work done).
    Queued,
    /// The copies have landed.
    Landed,
}
