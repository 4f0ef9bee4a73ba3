//! Receive comms: posting receives, the I/O thread that reads and lands
//! them (plain, or into the bounce pool for UNPACK), and completion.

use super::*;

/// The UNPACK resources of one receive comm.
pub(super) struct UnpackRes {
    pub(super) pool: Arc<BouncePool>,
    /// Host address of the comm's netUnpackMeta.
    pub(super) meta: *mut NetUnpackMeta,
    pub(super) _meta_mem: Box<dyn Send + Sync>,
    /// What goes into the device handle's `handle`: a device pointer to the
    /// unpackNetDeviceHandle (GPU pool) or a host pointer (host pool).
    pub(super) handle_value: u64,
    pub(super) _handle_mem: Box<dyn Send + Sync>,
    pub(super) seed: u64,
    /// No GPU receive pool imported (`NCCL_TCPX_RXMEM_IMPORT_USE_GPU_PCI_CLIENT=0`):
    /// the handle has no bounce buffer, host receives land straight in their
    /// buffers with 0 fragments, GPU receives cannot happen.
    pub(super) direct: bool,
}

// SAFETY: `meta` points into `_meta_mem`, owned here; the I/O thread writes a
// slot only while its receive is unfinished, readers read it only after.
unsafe impl Send for UnpackRes {}
// SAFETY: as above.
unsafe impl Sync for UnpackRes {}

pub(super) struct HostHandle(Box<UnpackNetDeviceHandle>);
// SAFETY: plain data the plugin never mutates after accept.
unsafe impl Send for HostHandle {}
// SAFETY: as above.
unsafe impl Sync for HostHandle {}

pub(super) fn pools() -> &'static Mutex<HashMap<PoolKind, Arc<BouncePool>>> {
    static P: OnceLock<Mutex<HashMap<PoolKind, Arc<BouncePool>>>> = OnceLock::new();
    P.get_or_init(Default::default)
}

/// The process's bounce pool of `kind` (made once, never freed).
pub(super) fn pool(kind: PoolKind, cfg: &EmuConfig) -> R<Arc<BouncePool>> {
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
    pub(super) fn new(device: Option<i32>, cfg: &EmuConfig, token: usize) -> R<UnpackRes> {
        let meta_len = std::mem::size_of::<NetUnpackMeta>();
        let hsize = std::mem::size_of::<UnpackNetDeviceHandle>();
        let cu = |e: String| error(NCCL_UNHANDLED_CUDA_ERROR, e);
        match device {
            Some(d) => {
                let pool = if cfg.rxmem_import {
                    pool(PoolKind::Gpu(d), cfg)?
                } else {
                    pool(PoolKind::Host, cfg)?
                };
                let meta = MappedMem::new(d, meta_len).map_err(cu)?;
                let dh = UnpackNetDeviceHandle {
                    meta: meta.dev_addr as *mut NetUnpackMeta,
                    bounce_buf: if cfg.rxmem_import {
                        pool.base as *mut std::ffi::c_void
                    } else {
                        std::ptr::null_mut()
                    },
                    head: u64::MAX,
                };
                let dev = gpu::Device::get(d).map_err(|e| cu(e.to_string()))?;
                let hmem =
                    Arc::new(gpu::DeviceBuf::new(&dev, hsize).map_err(|e| cu(e.to_string()))?);
                let zeros = vec![0u8; hsize];
                // SAFETY: the device buffer holds `hsize` bytes; `zeros` too.
                unsafe { cuda::htod(hmem.ptr, zeros.as_ptr(), hsize) }.map_err(cu)?;
                // SAFETY: `dh` is a plain C struct of `hsize` bytes, read as bytes.
                let bytes = unsafe {
                    std::slice::from_raw_parts(
                        &dh as *const UnpackNetDeviceHandle as *const u8,
                        hsize,
                    )
                }
                .to_vec();
                let write = move |mem: &gpu::DeviceBuf| {
                    // SAFETY: the device buffer holds `hsize` bytes; so does `bytes`.
                    unsafe { cuda::htod(mem.ptr, bytes.as_ptr(), hsize) }
                };
                if cfg.handle_late.is_zero() {
                    write(&hmem).map_err(cu)?;
                } else {
                    // As TCPX: the handle lands after accept has returned (its
                    // pageable cuMemcpyHtoD returns once the bytes are
                    // staged). Until then the caller reads zeros.
                    let (mem, late) = (hmem.clone(), cfg.handle_late);
                    std::thread::spawn(move || {
                        std::thread::sleep(late);
                        let done = dev
                            .bind()
                            .map_err(|e| e.to_string())
                            .and_then(|()| write(&mem));
                        if let Err(e) = done {
                            crate::warn(&format!("writing a device handle late: {e}"));
                        }
                    });
                }
                Ok(UnpackRes {
                    pool,
                    meta: meta.host_addr() as *mut NetUnpackMeta,
                    handle_value: hmem.ptr,
                    _meta_mem: Box::new(meta),
                    _handle_mem: Box::new(hmem),
                    seed: cfg.seed ^ token as u64,
                    direct: !cfg.rxmem_import,
                })
            }
            None => {
                let pool = pool(PoolKind::Host, cfg)?;
                let meta = HostMem::new(meta_len).map_err(|e| error(NCCL_SYSTEM_ERROR, e))?;
                let h = HostHandle(Box::new(UnpackNetDeviceHandle {
                    meta: meta.addr() as *mut NetUnpackMeta,
                    bounce_buf: if cfg.rxmem_import {
                        pool.base as *mut std::ffi::c_void
                    } else {
                        std::ptr::null_mut()
                    },
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
                    direct: !cfg.rxmem_import,
                })
            }
        }
    }

    /// Publishes the fragments of `slot`: entries first, then the count.
    pub(super) fn publish(&self, slot: usize, metas: &[LoadMeta]) {
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

pub(super) struct PostedRecv {
    pub(super) seq: u64,
    pub(super) addr: u64,
    pub(super) cap: usize,
    pub(super) kind: MemKind,
    pub(super) slot: usize,
    pub(super) cell: Arc<Cell>,
}

pub(super) struct RecvShared {
    pub(super) posted: Mutex<VecDeque<PostedRecv>>,
    pub(super) cv: Condvar,
    pub(super) closing: AtomicBool,
    pub(super) failed: Mutex<Option<String>>,
}

pub(super) struct RecvEntry {
    pub(super) seq: u64,
    pub(super) token: usize,
    pub(super) cell: Arc<Cell>,
    pub(super) tested: bool,
}

pub(super) struct RecvState {
    pub(super) q: VecDeque<RecvEntry>,
    pub(super) posted: u64,
}

pub struct RecvComm {
    pub(super) cfg: EmuConfig,
    pub(super) sock: TcpStream,
    pub(super) thread: Mutex<Option<JoinHandle<()>>>,
    pub(super) shared: Arc<RecvShared>,
    pub(super) st: Mutex<RecvState>,
    pub(super) mrs: Mutex<HashMap<usize, Mr>>,
    pub(super) unpack: Option<Arc<UnpackRes>>,
    pub(super) device: Option<i32>,
    pub(super) gate: Arc<Gate>,
    /// Accept was given no device-handle storage: TCPX then has no receive
    /// queue for this comm and crashes at its first receive.
    pub(super) no_dev_handle: AtomicBool,
}

/// Takes bytes from a receive comm's gate, failing once the comm closes.
pub(super) struct Taker<'a> {
    pub(super) gate: &'a Gate,
    pub(super) closing: &'a AtomicBool,
}

impl Taker<'_> {
    pub(super) fn take(&self, n: usize) -> Result<(), String> {
        self.gate
            .take(n as u64, || self.closing.load(Ordering::Acquire))
    }
}

impl RecvComm {
    pub(super) fn start(
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
        let gate = Arc::new(Gate::new(cfg.window(), cfg.lenient_progress));
        let (sh, un, c2, g) = (shared.clone(), unpack.clone(), cfg.clone(), gate.clone());
        let thread = std::thread::Builder::new()
            .name("emu-rx".into())
            .spawn(move || {
                let sh2 = sh.clone();
                let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                    rx_loop(io, sh, un, c2, device, g)
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
            gate,
            no_dev_handle: AtomicBool::new(false),
        }))
    }
}

pub(super) fn fail_recv(sh: &RecvShared, why: String) {
    sh.failed.lock().get_or_insert(why.clone());
    for p in sh.posted.lock().drain(..) {
        p.cell.fail(&why);
    }
    sh.cv.notify_all();
}

/// A received message whose payload is landing in GPU memory: reported
/// (its loadMeta published first, in UNPACK mode) once its copies are in.
pub(super) struct Arrived {
    pub(super) p: PostedRecv,
    pub(super) len: usize,
    pub(super) lease: Option<Lease>,
    pub(super) metas: Option<Vec<LoadMeta>>,
}

impl Arrived {
    pub(super) fn new(
        p: PostedRecv,
        len: usize,
        lease: Option<Lease>,
        metas: Option<Vec<LoadMeta>>,
    ) -> Self {
        Arrived {
            p,
            len,
            lease,
            metas,
        }
    }
}

pub(super) fn report(un: Option<&UnpackRes>, a: Arrived) {
    match (un, &a.metas) {
        (Some(u), Some(m)) => u.publish(a.p.slot, m),
        (Some(u), None) if u.direct => u.publish(a.p.slot, &[]),
        _ => {}
    }
    a.p.cell.done(a.len, a.lease);
}

pub(super) type Landing = Option<RxStage<Arrived>>;

/// Reports every message still landing, once its copies are in.
pub(super) fn land_all(stage: &mut Landing, done: &mut impl FnMut(Arrived)) -> Result<(), String> {
    match stage.as_mut().filter(|s| s.pending()) {
        Some(st) => st.finish(done),
        None => Ok(()),
    }
}

/// Reports `a` now -- after every message still landing, so that receives
/// complete in order.
pub(super) fn report_now(
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
pub(super) fn stage_for<'a>(
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
pub(super) fn readable(sock: &TcpStream) -> bool {
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

pub(super) fn rx_loop(
    sock: TcpStream,
    sh: Arc<RecvShared>,
    un: Option<Arc<UnpackRes>>,
    cfg: EmuConfig,
    device: Option<i32>,
    gate: Arc<Gate>,
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
    let res = rx_run(&sock, &sh, unr, &cfg, &gate, &mut stage, &mut done);
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
pub(super) fn rx_run(
    sock: &TcpStream,
    sh: &RecvShared,
    un: Option<&UnpackRes>,
    cfg: &EmuConfig,
    gate: &Gate,
    stage: &mut Landing,
    done: &mut impl FnMut(Arrived),
) -> Result<(), String> {
    let taker = Taker {
        gate,
        closing: &sh.closing,
    };
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
        let unused = p.cap - len;
        let res = match un {
            None => recv_plain(&mut r, p, len, cfg, &taker, stage, done),
            Some(u) if u.direct => recv_plain(&mut r, p, len, cfg, &taker, stage, done),
            Some(u) => recv_unpack(&mut r, p, len, u, cfg, &taker, &mut rng, stage, done),
        };
        gate.skip(unused as u64);
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

pub(super) fn recv_plain(
    r: &mut &TcpStream,
    p: PostedRecv,
    len: usize,
    cfg: &EmuConfig,
    taker: &Taker<'_>,
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
                for piece in buf.chunks_mut(PIECE) {
                    taker.take(piece.len())?;
                    r.read_exact(piece).map_err(|e| e.to_string())?;
                }
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
        taker.take(l)?;
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
pub(super) unsafe fn read_frags(
    r: &mut &TcpStream,
    plan: &[pool::Frag],
    taker: &Taker<'_>,
    at: impl Fn(&pool::Frag) -> *mut u8,
) -> Result<(), String> {
    // Pieces of about PIECE bytes, each taken from the gate before it is read.
    let mut from = 0;
    while from < plan.len() {
        let mut to = from;
        let mut bytes = 0;
        while to < plan.len() && (to == from || bytes + plan[to].len as usize <= PIECE) {
            bytes += plan[to].len as usize;
            to += 1;
        }
        taker.take(bytes)?;
        // SAFETY: by the caller's contract.
        unsafe { read_frag_run(r, &plan[from..to], &at) }?;
        from = to;
    }
    Ok(())
}

/// Reads the fragments of `plan` (see [`read_frags`]).
///
/// # Safety
/// As [`read_frags`].
unsafe fn read_frag_run(
    r: &mut &TcpStream,
    plan: &[pool::Frag],
    at: &impl Fn(&pool::Frag) -> *mut u8,
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
pub(super) fn recv_unpack(
    r: &mut &TcpStream,
    p: PostedRecv,
    len: usize,
    u: &UnpackRes,
    cfg: &EmuConfig,
    taker: &Taker<'_>,
    rng: &mut Rng,
    stage: &mut Landing,
    done: &mut impl FnMut(Arrived),
) -> Result<(), String> {
    let closing = taker.closing;
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
                read_frags(r, &plan, taker, |f| {
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
                read_frags(r, &plan, taker, |f| {
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
    if c.no_dev_handle.load(Ordering::Relaxed) {
        return Err(violation(
            NCCL_INTERNAL_ERROR,
            "irecv on a receive comm whose accept was given no device-handle storage: TCPX made no receive queue for it and crashes here (pass storage to accept)",
        ));
    }
    let mr = find_mr(&c.mrs, mh, data, size as usize, "irecv")?;
    if let Some(u) = &c.unpack {
        if size as usize > MAX_UNPACK_RECV {
            return Err(violation(
                NCCL_INTERNAL_ERROR,
                format!("irecv of {size} bytes: TCPX exits when a receive needs more than 2048 fragments; keep receives ≤ 4 MiB"),
            ));
        }
        let fits = match (u.direct, u.pool.kind, mr.kind) {
            (true, _, kind) => kind == MemKind::Host,
            (false, PoolKind::Host, MemKind::Host)
            | (false, PoolKind::Gpu(_), MemKind::Cuda(_)) => true,
            _ => false,
        };
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
    c.gate.post(size as u64);
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

pub(super) fn test_recv(c: &Arc<RecvComm>, seq: u64) -> R<Option<usize>> {
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
    // As tcpxTest: the comm's progress first, then the head.
    c.gate.schedule();
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
        // As tcpxTest: no size, for sends either.
        ReqOwner::Send(c, seq) => Ok(test_send(&c, seq)?.map(|_| None)),
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
        return Err(violation(NCCL_INTERNAL_ERROR, why));
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

pub(super) fn close_recv_comm(c: &Arc<RecvComm>) {
    c.shared.closing.store(true, Ordering::Release);
    c.shared.cv.notify_all();
    c.gate.close();
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
