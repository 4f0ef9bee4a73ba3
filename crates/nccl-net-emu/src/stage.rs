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

use std::collections::VecDeque;

use tcpx_p2p::gpu;

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

fn cuda_err(e: tcpx_p2p::error::CudaError) -> String {
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
        if b.busy {
            b.ev.synchronize().map_err(cuda_err)?;
            b.busy = false;
        }
        Ok(i)
    }

    /// Makes every buffer hold at least `len` bytes, once all queued
    /// copies have completed (their bytes are then no longer needed).
    fn grow_all(&mut self, len: usize) -> Result<(), String> {
        self.stream.synchronize().map_err(cuda_err)?;
        let size = len.next_power_of_two();
        for b in &mut self.bufs {
            b.busy = false;
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

    pub fn is_empty(&self) -> bool {
        self.queued.is_empty()
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
        let _ = self.ring.stream.synchronize();
        for b in &mut self.ring.bufs {
            b.busy = false;
        }
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
        self.ring.stream.synchronize().map_err(cuda_err)?;
        for b in &mut self.ring.bufs {
            b.busy = false;
        }
        for (_, w) in self.landing.drain(..) {
            done(w);
        }
        Ok(())
    }

    /// Hands out the messages still landing without reporting them (the
    /// thread gives up); their copies are waited for.
    pub fn abandon(&mut self) -> Vec<T> {
        let _ = self.ring.stream.synchronize();
        self.landing.drain(..).map(|(_, w)| w).collect()
    }
}

/// Where an I/O thread's time went, appended as one line to the file
/// `NCCL_NET_EMU_STATS` names when the thread ends (off when unset): also
/// its active span, from its first message's start to its last one's end,
/// and how much of that span it was busy (waiting for copies or in socket
/// calls) -- near 100 % the thread bounds the comm's rate, well below it
/// the thread waits for its caller.
pub struct Stats {
    path: Option<std::path::PathBuf>,
    what: &'static str,
    born: std::time::Instant,
    mark: std::time::Instant,
    first: Option<std::time::Instant>,
    last: Option<std::time::Instant>,
    /// Seconds: waiting for copies, in socket calls, idle (no request).
    pub copies: f64,
    pub socket: f64,
    pub idle: f64,
    pub msgs: u64,
    pub bytes: u64,
}

/// What the time since the last mark was spent on.
#[derive(Clone, Copy)]
pub enum Spent {
    Copies,
    Socket,
    Idle,
    Other,
}

impl Stats {
    pub fn new(what: &'static str) -> Stats {
        let now = std::time::Instant::now();
        Stats {
            path: std::env::var_os("NCCL_NET_EMU_STATS").map(Into::into),
            what,
            born: now,
            mark: now,
            first: None,
            last: None,
            copies: 0.0,
            socket: 0.0,
            idle: 0.0,
            msgs: 0,
            bytes: 0,
        }
    }

    /// A message begins (its first byte is at hand).
    pub fn begin(&mut self) {
        if self.path.is_some() && self.first.is_none() {
            self.first = Some(std::time::Instant::now());
        }
    }

    /// A message of `bytes` ended.
    pub fn end(&mut self, bytes: usize) {
        self.msgs += 1;
        self.bytes += bytes as u64;
        if self.path.is_some() {
            self.last = Some(std::time::Instant::now());
        }
    }

    /// Charges the time since the last mark to `to`.
    pub fn mark(&mut self, to: Spent) {
        if self.path.is_none() {
            return;
        }
        let now = std::time::Instant::now();
        let dt = (now - self.mark).as_secs_f64();
        self.mark = now;
        match to {
            Spent::Copies => self.copies += dt,
            Spent::Socket => self.socket += dt,
            Spent::Idle => self.idle += dt,
            Spent::Other => {}
        }
    }
}

impl Drop for Stats {
    fn drop(&mut self) {
        let Some(p) = &self.path else { return };
        let life = self.born.elapsed().as_secs_f64();
        let active = match (self.first, self.last) {
            (Some(a), Some(b)) if b > a => (b - a).as_secs_f64(),
            _ => 0.0,
        };
        let busy_pct = if active > 0.0 {
            100.0 * (self.copies + self.socket) / active
        } else {
            0.0
        };
        let line = format!(
            "{} msgs={} bytes={} life_s={life:.3} active_s={active:.3} busy_pct={busy_pct:.1} copies_s={:.3} socket_s={:.3} idle_s={:.3} other_s={:.3}\n",
            self.what,
            self.msgs,
            self.bytes,
            self.copies,
            self.socket,
            self.idle,
            life - self.copies - self.socket - self.idle
        );
        use std::io::Write;
        if let Ok(mut f) = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(p)
        {
            let _ = f.write_all(line.as_bytes());
        }
    }
}
