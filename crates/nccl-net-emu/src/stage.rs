//! Pinned staging of GPU payloads, pipelined.
//!
//! TCPX's NIC reads and writes GPU memory itself; plain sockets cannot, so
//! the stand-in copies GPU payloads through pinned host buffers. Those
//! copies are the stand-in's cost, not TCPX's, and the plugin net is
//! compared with the socket net through them -- so they overlap the socket
//! I/O the way the socket net's own staging does: a send thread copies out
//! the next buffers (of this send and the ones queued after it) while it
//! writes the current one; a receive thread copies a message in while it
//! reads the next, and reports a receive done once its copies have landed.
//! All copies of a thread run on one non-blocking stream, in order, so the
//! completion of one copy implies the completion of all queued before it.
//!
//! Why this is not the engine's staging ring (`tcpx_p2p_gpu::staging::Ring`): that
//! ring has fixed slots of one size, fills one slot with many small pieces,
//! and can hand scattered windows to a copy kernel; this one carries one
//! whole message piece per buffer, grows every buffer to the largest piece
//! (receives here are as large as NCCL posts them) and keeps the outgrown
//! buffers until it is dropped, because freeing pinned memory waits for
//! the whole GPU, where NCCL's kernels may be spinning (a deadlock, see
//! [`Ring::retired`]). Sharing one ring would put growth and retirement
//! into the engine's hot path, or fixed slots into the stand-in's
//! messages; the two share the primitives below it (`gpu::PinnedBuf`,
//! `gpu::Event`, `gpu::Stream`) instead.

use std::collections::VecDeque;

use tcpx_p2p_gpu as gpu;
use tcpx_p2p_timing as timing;

use crate::cuda;

/// Bytes per buffer (receive buffers grow to the largest message piece
/// they carry; see [`RxStage::buf`]).
pub const SLOT: usize = 1 << 20;

struct Buf {
    mem: gpu::PinnedBuf,
    ev: gpu::Event,
    /// A copy from or into `mem` was queued since `ev` was last waited for.
    busy: bool,
}

/// Buffers used in turn, their copies queued on one stream of one GPU.
struct Ring {
    dev: i32,
    stream: gpu::Stream,
    bufs: Vec<Buf>,
    next: usize,
    /// Buffers outgrown, freed with the ring: freeing pinned memory waits
    /// for the whole GPU (`cuMemFreeHost` synchronizes), and NCCL's kernels
    /// may be spinning there until this thread's next receive lands -- a
    /// deadlock (seen with NCCL in UNPACK mode when 128 KiB receives were
    /// followed by 1 MiB ones).
    retired: Vec<gpu::PinnedBuf>,
}

fn cuda_err(e: tcpx_p2p_gpu::CudaError) -> String {
    e.to_string()
}

impl Ring {
    fn new(dev: i32, count: usize, len: usize) -> Result<Ring, String> {
        cuda::bind(dev)?;
        let stream = gpu::Stream::new().map_err(cuda_err)?;
        let bufs = (0..count)
            .map(|_| {
                Ok(Buf {
                    mem: gpu::PinnedBuf::new(len).map_err(cuda_err)?,
                    ev: gpu::Event::new().map_err(cuda_err)?,
                    busy: false,
                })
            })
            .collect::<Result<Vec<_>, String>>()?;
        Ok(Ring {
            dev,
            stream,
            bufs,
            next: 0,
            retired: Vec::new(),
        })
    }

    /// The next buffer in turn, once the copies last queued on it have
    /// completed; it must hold `len` bytes.
    fn take(&mut self, len: usize) -> Result<usize, String> {
        let (i, n) = (self.next, self.bufs.len());
        let b = &mut self.bufs[i];
        if b.mem.len() < len {
            return Err(format!(
                "a staged piece of {len} bytes exceeds its buffer of {}",
                b.mem.len()
            ));
        }
        self.next = (i + 1) % n;
        self.wait(i)?;
        Ok(i)
    }

    /// Waits for every queued copy; every buffer is then idle.
    fn settle(&mut self) -> Result<(), String> {
        self.stream.synchronize().map_err(cuda_err)?;
        for b in &mut self.bufs {
            b.busy = false;
        }
        Ok(())
    }

    /// Makes every buffer hold at least `len` bytes, once all queued
    /// copies have completed (their bytes are then no longer needed).
    fn grow_all(&mut self, len: usize) -> Result<(), String> {
        self.settle()?;
        let size = len.next_power_of_two();
        for b in &mut self.bufs {
            if b.mem.len() < size {
                let old =
                    std::mem::replace(&mut b.mem, gpu::PinnedBuf::new(size).map_err(cuda_err)?);
                self.retired.push(old);
            }
        }
        Ok(())
    }

    /// Marks the end of the copies queued on buffer `i`.
    fn seal(&mut self, i: usize) -> Result<(), String> {
        let b = &mut self.bufs[i];
        b.ev.record(&self.stream).map_err(cuda_err)?;
        b.busy = true;
        Ok(())
    }

    fn wait(&mut self, i: usize) -> Result<(), String> {
        let b = &mut self.bufs[i];
        if b.busy {
            b.ev.synchronize().map_err(cuda_err)?;
            b.busy = false;
        }
        Ok(())
    }

    fn is_done(&self, i: usize) -> Result<bool, String> {
        let b = &self.bufs[i];
        Ok(!b.busy || b.ev.is_done().map_err(cuda_err)?)
    }
}

impl Drop for Ring {
    fn drop(&mut self) {
        // The buffers are freed after this: no copy may still use them.
        let _ = self.stream.synchronize();
    }
}

/// A send thread's staging: copies out of GPU memory queued a few buffers
/// ahead of the socket, taken in the order queued.
pub struct TxStage {
    ring: Ring,
    /// Queued copies, oldest first: (buffer, bytes).
    queued: VecDeque<(usize, usize)>,
}

impl TxStage {
    /// Staging through `bufs` buffers for payloads in the memory of GPU
    /// `dev` (bound to this thread from now on).
    pub fn new(dev: i32, bufs: usize) -> Result<TxStage, String> {
        Ok(TxStage {
            ring: Ring::new(dev, bufs.max(1), SLOT)?,
            queued: VecDeque::with_capacity(bufs),
        })
    }

    pub fn dev(&self) -> i32 {
        self.ring.dev
    }

    /// Whether a buffer is free for another copy.
    pub fn has_room(&self) -> bool {
        self.queued.len() < self.ring.bufs.len()
    }

    /// Queues the copy of `len` ≤ [`SLOT`] bytes at device address `src`
    /// into the next free buffer (call only when [`TxStage::has_room`]).
    ///
    /// # Safety
    /// `src` must be a device range of `len` bytes of GPU `dev` that stays
    /// valid and unchanged until the copy has been taken by
    /// [`TxStage::front`] or the stage is reset or dropped.
    pub unsafe fn queue(&mut self, src: u64, len: usize) -> Result<(), String> {
        debug_assert!(self.has_room() && len <= SLOT);
        let i = self.ring.take(len)?;
        let dst = self.ring.bufs[i].mem.as_ptr();
        // SAFETY: the buffer holds ≥ len bytes and no queued copy or socket
        // write uses it (it is not in `queued`); the source is the caller's.
        unsafe { self.ring.stream.copy_dtoh(dst, src, len) }.map_err(cuda_err)?;
        self.ring.seal(i)?;
        self.queued.push_back((i, len));
        Ok(())
    }

    /// The oldest queued copy's bytes, once they have landed.
    pub fn front(&mut self) -> Result<&[u8], String> {
        let (i, len) = *self.queued.front().ok_or("no staged copy is queued")?;
        self.ring.wait(i)?;
        Ok(self.ring.bufs[i].mem.as_slice(len))
    }

    /// Gives the oldest queued buffer back (its bytes were written).
    pub fn pop(&mut self) {
        self.queued.pop_front();
    }

    /// Forgets every queued copy once it has completed (after a failure).
    pub fn reset(&mut self) {
        let _ = self.ring.settle();
        self.queued.clear();
    }
}

/// A receive thread's staging: messages read into pinned buffers, copied
/// into GPU memory on the stream, and reported (`T`, handed to a `done`
/// callback) once their copies have landed -- while the thread reads on.
pub struct RxStage<T> {
    ring: Ring,
    /// Messages whose copies were queued, oldest first: (buffer of their
    /// last copy, what to report).
    landing: VecDeque<(usize, T)>,
}

impl<T> RxStage<T> {
    /// Staging through `bufs` buffers for receives into the memory of GPU
    /// `dev` (bound to this thread from now on).
    pub fn new(dev: i32, bufs: usize) -> Result<RxStage<T>, String> {
        Ok(RxStage {
            ring: Ring::new(dev, bufs.max(1), SLOT)?,
            landing: VecDeque::with_capacity(bufs),
        })
    }

    pub fn dev(&self) -> i32 {
        self.ring.dev
    }

    /// Whether received messages wait for their copies to land.
    pub fn pending(&self) -> bool {
        !self.landing.is_empty()
    }

    /// The next buffer in turn, of at least `len` bytes, to read into: its
    /// index and address. Reports the messages whose copies completed
    /// while waiting for it.
    ///
    /// A piece larger than the buffers grows all of them at once (to a
    /// power of two; the old ones are kept until the ring is dropped), so
    /// that the pieces after it -- likely as large -- find them grown:
    /// allocating pinned memory is slow, and freeing it waits for the whole
    /// GPU; one buffer at a time, on every comm, that cost came message
    /// after message (p99 of 16 MiB 10-15 ms on h200-x2).
    pub fn buf(
        &mut self,
        len: usize,
        done: &mut impl FnMut(T),
    ) -> Result<(usize, *mut u8), String> {
        if self.ring.bufs[self.ring.next].mem.len() < len {
            self.ring.grow_all(len)?;
        }
        let i = self.ring.take(len)?;
        // Every copy queued up to buffer i's last one has completed.
        self.poll(done)?;
        Ok((i, self.ring.bufs[i].mem.as_ptr()))
    }

    /// Queues the copy of `len` bytes at `off` in buffer `i` to device
    /// address `dst`.
    ///
    /// # Safety
    /// `off + len` must lie inside the buffer as [`RxStage::buf`] sized it
    /// and `dst` must be a device range of `len` bytes of GPU `dev` that
    /// nothing else writes until the copy is reported.
    pub unsafe fn queue(
        &mut self,
        i: usize,
        off: usize,
        dst: u64,
        len: usize,
    ) -> Result<(), String> {
        let src = self.ring.bufs[i].mem.as_ptr().wrapping_add(off);
        // SAFETY: by the caller's contract; the buffer is not reused before
        // this copy completes (`take` waits for its event).
        unsafe { self.ring.stream.copy_htod(dst, src, len) }.map_err(cuda_err)
    }

    /// Ends the copies out of buffer `i`; `what`, when given, is reported
    /// once they (and all queued before them) have landed.
    pub fn seal(&mut self, i: usize, what: Option<T>) -> Result<(), String> {
        self.ring.seal(i)?;
        if let Some(w) = what {
            self.landing.push_back((i, w));
        }
        Ok(())
    }

    /// Reports the messages whose copies have landed, without waiting.
    pub fn poll(&mut self, done: &mut impl FnMut(T)) -> Result<(), String> {
        while let Some(&(i, _)) = self.landing.front() {
            if !self.ring.is_done(i)? {
                break;
            }
            if let Some((_, w)) = self.landing.pop_front() {
                done(w);
            }
        }
        Ok(())
    }

    /// Waits for every queued copy and reports every message.
    pub fn finish(&mut self, done: &mut impl FnMut(T)) -> Result<(), String> {
        self.ring.settle()?;
        for (_, w) in self.landing.drain(..) {
            done(w);
        }
        Ok(())
    }

    /// Hands out the messages still landing without reporting them (the
    /// thread gives up); their copies are waited for.
    pub fn abandon(&mut self) -> Vec<T> {
        let _ = self.ring.settle();
        self.landing.drain(..).map(|(_, w)| w).collect()
    }
}

/// With `NCCL_NET_EMU_STATS=FILE`, an I/O thread's time account -- the
/// engine's own (`tcpx_p2p_timing`: bytes, seconds, and the shares
/// spent in socket calls, waiting for copies, waiting for work, other) --
/// whose summary line is appended to FILE when the thread ends (the
/// stand-in has no log of its own to carry it). The thread charges its
/// time with `timing::mark`.
pub struct Account(Option<std::path::PathBuf>);

/// Opens this thread's account if `NCCL_NET_EMU_STATS` names a file.
pub fn account(name: impl FnOnce() -> String) -> Account {
    let path = std::env::var_os("NCCL_NET_EMU_STATS").map(std::path::PathBuf::from);
    if path.is_some() {
        timing::open(name());
    }
    Account(path)
}

impl Drop for Account {
    fn drop(&mut self) {
        let Some(p) = &self.0 else { return };
        let Some(line) = timing::finish() else { return };
        use std::io::Write;
        if let Ok(mut f) = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(p)
        {
            let _ = writeln!(f, "{line}");
        }
    }
}
