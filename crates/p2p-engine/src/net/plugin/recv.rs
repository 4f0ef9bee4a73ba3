//! Receive comms of a plugin: posting receives, and for UNPACK comms the
//! unpack of each finished receive's fragments into the user's buffer
//! before it is reported done.

use super::*;

/// Where a receive stands, in order: the stages of the entries of a comm's
/// queue never increase from its front to its back.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Stage {
    /// Ready for the engine (unpacked and consumed).
    Ready,
    /// Unpacked; `irecvConsumed` not yet called.
    Unpacked,
    /// In the unpack kernel's current batch.
    Unpacking,
    /// The plugin said done; fragments read, not yet copied.
    NetDone,
    /// Posted to the plugin.
    Posted,
}

pub(super) struct RecvEntry {
    pub(super) id: u64,
    pub(super) req: *mut c_void,
    pub(super) mem: MemRef,
    pub(super) slot: usize,
    pub(super) stage: Stage,
    pub(super) size: usize,
    pub(super) frags: Vec<LoadMeta>,
    /// A host-memory receive landing on the GPU first (see [`HostLanding`]):
    /// `mem` is its landing slot, this the user's buffer.
    pub(super) host_dst: Option<MemRef>,
}

/// Host-memory receives on a comm whose bounce pages are on the GPU. On A3
/// the flows of a GPU comm are steered to the GPU's devmem queues, so a
/// receive's payload is only ever in GPU bounce pages: a host receive is
/// posted into a landing slot on the GPU (one per request slot, 4 MiB
/// each, registered once), unpacked there by the kernel as any GPU
/// receive, then copied to the user's host buffer before it is reported
/// done. The user sees no difference but speed.
pub(super) struct HostLanding {
    pub(super) mem: gpu::DeviceBuf,
    pub(super) mr: MrHandle,
    pub(super) gpu: i32,
}

impl HostLanding {
    /// Landing slot `slot` for `len` bytes.
    fn slot(&self, slot: usize, len: usize) -> MemRef {
        MemRef {
            addr: self.mem.ptr + (slot * MAX_UNPACK_RECV) as u64,
            len,
            kind: MemKind::Cuda(self.gpu),
        }
    }
}

/// The UNPACK side of a receive comm.
pub(super) struct UnpackState {
    pub(super) meta: *const NetUnpackMeta,
    pub(super) bounce: u64,
    /// The GPU the bounce pool is on (None: host memory).
    pub(super) bounce_gpu: Option<i32>,
    pub(super) unpacker: Option<unpack::Unpacker>,
    pub(super) kernel_unusable: bool,
    pub(super) descs: Vec<unpack::CopyDesc>,
    /// No bounce pool at all (TCPX with its GPU receive pool not imported,
    /// `NCCL_TCPX_RXMEM_IMPORT_USE_GPU_PCI_CLIENT=0`): host receives land
    /// straight in their buffers and their slots count 0 fragments; the
    /// size is the posted one (TCPX's `test` reports none).
    pub(super) direct: bool,
}

impl UnpackState {
    pub(super) fn new(lib: &Lib, dh: &NcclNetDeviceHandleV7) -> Result<Self, NetError> {
        if dh.net_device_version != NCCL_NET_DEVICE_UNPACK_VERSION {
            tracing::warn!(
                "{}: UNPACK device handle version {:#x}, expected {:#x}; reading it anyway",
                lib.name,
                dh.net_device_version,
                NCCL_NET_DEVICE_UNPACK_VERSION
            );
        }
        if lib.api.irecv_consumed.is_none() {
            return Err(misuse(lib.name, "UNPACK plugin without irecvConsumed"));
        }
        let h = dh.handle as u64;
        if h == 0 {
            return Err(protocol(
                lib.name,
                "UNPACK device handle with a NULL handle",
            ));
        }
        let size = std::mem::size_of::<UnpackNetDeviceHandle>();
        // SAFETY: all-zero is a valid value of this plain C struct.
        let mut uh: UnpackNetDeviceHandle = unsafe { std::mem::zeroed() };
        let on_gpu = gpu::pointer_device(h).is_some();
        // TCPX writes the handle into GPU memory with cuMemcpyHtoD from a
        // pageable struct, in its own CUDA context, just before accept
        // returns: that call returns once the bytes are staged, not landed,
        // so a read from our context can come first and see zeros (seen
        // with the real plugin). Read again until meta shows, for a bounded
        // time.
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(1);
        loop {
            if on_gpu {
                // SAFETY: `h` is device memory holding an unpackNetDeviceHandle;
                // `uh` is a host struct of the same size.
                unsafe { gpu::copy_sync(&mut uh as *mut UnpackNetDeviceHandle as u64, h, size) }?;
            } else {
                // SAFETY: a host pointer to the plugin's unpackNetDeviceHandle
                // (the stand-in's host mode), valid for the comm's life.
                uh = unsafe { std::ptr::read_unaligned(h as *const UnpackNetDeviceHandle) };
            }
            if !uh.meta.is_null() || !on_gpu || std::time::Instant::now() >= deadline {
                break;
            }
            std::thread::sleep(std::time::Duration::from_micros(200));
        }
        if uh.meta.is_null() {
            return Err(protocol(lib.name, "UNPACK device handle without meta"));
        }
        let direct = uh.bounce_buf.is_null();
        if direct {
            // Expected off A3 (TCPX without its GPU receive pool): said once
            // per comm at debug level, not as a warning.
            tracing::debug!(
                "{}: UNPACK device handle without a bounce buffer: host receives only, landing straight in their buffers",
                lib.name
            );
        }
        let bounce = uh.bounce_buf as u64;
        let bounce_gpu = gpu::pointer_device(bounce);
        tracing::debug!(
            net = lib.name,
            bounce = format_args!("{bounce:#x}"),
            ?bounce_gpu,
            "UNPACK receive comm"
        );
        // The host's view of the loadMeta queue (the same address under
        // unified addressing).
        let meta = unpack::host_address(uh.meta as u64).unwrap_or(uh.meta as u64);
        Ok(UnpackState {
            meta: meta as *const NetUnpackMeta,
            bounce,
            bounce_gpu,
            unpacker: None,
            kernel_unusable: false,
            descs: Vec::new(),
            direct,
        })
    }

    /// Reads the fragments the plugin wrote for `slot`.
    pub(super) fn fragments(
        &self,
        net: &'static str,
        slot: usize,
    ) -> Result<Vec<LoadMeta>, NetError> {
        // SAFETY: `meta` points at the plugin's netUnpackMeta (host-readable,
        // unified addressing for host-mapped memory) for the comm's life; the
        // slot belongs to a receive the plugin reported done and that has not
        // been consumed, so the plugin does not write it now.
        let cnt = unsafe { std::ptr::addr_of!((*self.meta).cnt[slot]).read_volatile() };
        std::sync::atomic::fence(Ordering::Acquire);
        if cnt as usize > NET_UNPACK_MAX_SLICE_PAGES {
            return Err(protocol(
                net,
                format!("receive slot {slot} claims {cnt} fragments (at most {NET_UNPACK_MAX_SLICE_PAGES})"),
            ));
        }
        Ok((0..cnt as usize)
            // SAFETY: as above, index < 2048.
            .map(|i| unsafe { std::ptr::addr_of!((*self.meta).mem[slot][i]).read_volatile() })
            .collect())
    }
}

pub(super) struct PluginRecv {
    pub(super) lib: Arc<Lib>,
    pub(super) comm: *mut c_void,
    pub(super) gpu: Option<Arc<gpu::Device>>,
    /// The device-handle storage given to accept, kept as long as the comm.
    pub(super) _storage: Option<Box<DevHandleStorage>>,
    pub(super) unpack: Option<UnpackState>,
    pub(super) queue: VecDeque<RecvEntry>,
    pub(super) next_id: u64,
    /// Receives posted so far (the UNPACK slot of the next is `posted % 16`).
    pub(super) posted: u64,
    /// Made at the first host-memory receive on a GPU comm.
    pub(super) landing: Option<HostLanding>,
}

// SAFETY: a plugin comm may be used from any thread, one call at a time; the
// meta pointer is only read.
unsafe impl Send for PluginRecv {}

impl PluginRecv {
    /// Tests the plugin's oldest receives, unpacks what is done, consumes in
    /// FIFO order.
    pub(super) fn progress(&mut self) -> Result<(), NetError> {
        let name = self.lib.name;
        // 1. The plugin's FIFO head, and the next ones while they are done.
        let first = self.queue.iter().position(|e| e.stage == Stage::Posted);
        if let Some(first) = first {
            for i in first..self.queue.len() {
                let Some(reported) = self.lib.test(self.queue[i].req)? else {
                    break;
                };
                let e = &mut self.queue[i];
                match &self.unpack {
                    Some(u) if u.direct => {
                        e.size = e.mem.len;
                        e.frags = Vec::new();
                    }
                    Some(u) => {
                        let frags = u.fragments(name, e.slot)?;
                        e.size = unpack::check_fragments(&frags, e.mem.len)
                            .map_err(|err| protocol(name, format!("receive {}: {err}", e.id)))?;
                        e.frags = frags;
                    }
                    None => {
                        e.size = if reported >= 0 {
                            reported as usize
                        } else {
                            e.mem.len
                        };
                        if e.size > e.mem.len {
                            return Err(protocol(
                                name,
                                format!(
                                    "{} bytes reported for a {}-byte receive",
                                    e.size, e.mem.len
                                ),
                            ));
                        }
                    }
                }
                e.stage = if self.unpack.is_some() {
                    Stage::NetDone
                } else {
                    Stage::Unpacked
                };
            }
        }
        // 2. Unpack.
        if self.unpack.is_some() {
            self.unpack_done()?;
        }
        // 3. Consume in FIFO order.
        for e in self.queue.iter_mut() {
            match e.stage {
                Stage::Ready => continue,
                Stage::Unpacked => {
                    if let Some(dst) = e.host_dst {
                        // The landing slot is ours until the 16th receive
                        // after this one: copied out before it is done.
                        bind(&self.gpu)?;
                        // SAFETY: the source is this receive's landing slot
                        // (e.size ≤ its length, checked from the fragments),
                        // the destination the user's host buffer of ≥ e.size
                        // bytes, held by the engine until completion.
                        unsafe { gpu::copy_sync(dst.addr, e.mem.addr, e.size) }?;
                    }
                    if let Some(f) = self.lib.api.irecv_consumed {
                        // SAFETY: the request is the oldest unconsumed receive
                        // of this live comm, reported done by test.
                        check(name, "irecvConsumed", unsafe { f(self.comm, 1, e.req) })?;
                    }
                    e.frags = Vec::new();
                    e.stage = Stage::Ready;
                }
                _ => break,
            }
        }
        Ok(())
    }

    /// Moves finished kernel batches to `Unpacked` and copies the receives
    /// the plugin has finished.
    pub(super) fn unpack_done(&mut self) -> Result<(), NetError> {
        let name = self.lib.name;
        let gpu_dev = self.gpu.clone();
        let Some(u) = self.unpack.as_mut() else {
            return Ok(());
        };
        if u.unpacker.is_some() {
            // Kernel launches and event queries act on the current context.
            bind(&gpu_dev)?;
        }
        if let Some(k) = u.unpacker.as_mut() {
            if k.in_flight() {
                if !k.poll()? {
                    return Ok(());
                }
                for e in self
                    .queue
                    .iter_mut()
                    .filter(|e| e.stage == Stage::Unpacking)
                {
                    e.stage = Stage::Unpacked;
                }
            }
        }
        if !self.queue.iter().any(|e| e.stage == Stage::NetDone) {
            return Ok(());
        }
        // Kernel when the pool and the buffer are on the endpoint's GPU.
        let kernel_dev = match (&gpu_dev, u.bounce_gpu) {
            (Some(d), Some(b)) if d.ordinal == b && !u.kernel_unusable => Some(d.clone()),
            _ => None,
        };
        if let Some(d) = &kernel_dev {
            if u.unpacker.is_none() {
                match unpack::Unpacker::new(d.clone()) {
                    Ok(k) => u.unpacker = Some(k),
                    Err(e) => {
                        tracing::warn!(
                            "{name}: unpack kernel unavailable ({e}); copying fragments one by one"
                        );
                        u.kernel_unusable = true;
                    }
                }
            }
        }
        u.descs.clear();
        let mut batch = false;
        for e in self.queue.iter_mut().filter(|e| e.stage == Stage::NetDone) {
            let on_kernel = u.unpacker.is_some()
                && matches!(e.mem.kind, MemKind::Cuda(g) if Some(g) == u.bounce_gpu);
            if on_kernel {
                unpack::push_descs(&e.frags, u.bounce, e.mem.addr, &mut u.descs);
                e.stage = Stage::Unpacking;
                batch = true;
                continue;
            }
            match (u.bounce_gpu, e.mem.kind) {
                (None, MemKind::Host) => {
                    let dst: &mut [u8] = if e.mem.len == 0 {
                        &mut []
                    } else {
                        // SAFETY: the receive buffer was checked by the engine
                        // against a registered region held until completion.
                        unsafe { std::slice::from_raw_parts_mut(e.mem.addr as *mut u8, e.mem.len) }
                    };
                    // SAFETY: the fragments' sources are the plugin's bounce
                    // pages, valid until irecvConsumed (called after this).
                    unsafe { unpack::unpack_host_raw(u.bounce as *const u8, dst, &e.frags) }
                        .map_err(|err| protocol(name, format!("receive {}: {err}", e.id)))?;
                }
                _ => {
                    // Mixed host / device, or another GPU: one copy per fragment.
                    bind(&gpu_dev)?;
                    for f in &e.frags {
                        // SAFETY: destination checked against the receive
                        // buffer (check_fragments); source in the bounce pool,
                        // valid until irecvConsumed. cuMemcpy infers directions
                        // from unified addresses.
                        unsafe {
                            gpu::copy_sync(
                                e.mem.addr + f.dst_off,
                                u.bounce + u64::from(f.src_off),
                                f.len as usize,
                            )
                        }?;
                    }
                }
            }
            e.stage = Stage::Unpacked;
        }
        if batch {
            if let Some(k) = u.unpacker.as_mut() {
                // SAFETY: sources are bounce pages held until irecvConsumed,
                // which waits for this batch; destinations were checked
                // against the receive buffers, held by the engine until done.
                unsafe { k.launch(&u.descs) }?;
                if k.poll()? {
                    for e in self
                        .queue
                        .iter_mut()
                        .filter(|e| e.stage == Stage::Unpacking)
                    {
                        e.stage = Stage::Unpacked;
                    }
                }
            }
        }
        Ok(())
    }
}

impl PluginRecv {
    /// The comm's GPU landing slots for host receives, made at first use.
    fn landing(&mut self, bounce_gpu: i32) -> Result<&HostLanding, NetError> {
        if self.landing.is_none() {
            let dev = match &self.gpu {
                Some(d) if d.ordinal == bounce_gpu => d.clone(),
                _ => gpu::Device::get(bounce_gpu)?,
            };
            let bytes = MAX_UNPACK_RECV * NET_UNPACK_MAX_QUEUE_DEPTH;
            let mem = gpu::DeviceBuf::new(&dev, bytes)?;
            let mr = register(
                &self.lib,
                self.comm,
                &Some(dev),
                MemRef {
                    addr: mem.ptr,
                    len: bytes,
                    kind: MemKind::Cuda(bounce_gpu),
                },
            )?;
            tracing::debug!(
                net = self.lib.name,
                gpu = bounce_gpu,
                "host receives on a GPU comm land in {} MiB of GPU memory first",
                bytes >> 20
            );
            self.landing = Some(HostLanding {
                mem,
                mr,
                gpu: bounce_gpu,
            });
        }
        self.landing
            .as_ref()
            .ok_or_else(|| misuse(self.lib.name, "host landing"))
    }
}

impl RecvComm for PluginRecv {
    fn reg_mr(&mut self, mem: MemRef) -> Result<MrHandle, NetError> {
        register(&self.lib, self.comm, &self.gpu, mem)
    }

    fn dereg_mr(&mut self, mr: MrHandle) -> Result<(), NetError> {
        self.lib.dereg_mr(self.comm, mr)
    }

    fn irecv(&mut self, mem: MemRef, mr: MrHandle) -> Result<Option<ReqId>, NetError> {
        let irecv = func!(self.lib, irecv);
        let mut size = c_int::try_from(mem.len).map_err(|_| {
            misuse(
                self.lib.name,
                format!(
                    "a receive of {} bytes exceeds the plugin's 2 GiB limit",
                    mem.len
                ),
            )
        })?;
        if self
            .unpack
            .as_ref()
            .is_some_and(|u| u.direct && mem.kind != MemKind::Host)
        {
            return Err(misuse(
                self.lib.name,
                "a GPU receive on a comm without a bounce pool (the plugin imported no GPU receive memory)",
            ));
        }
        if self.unpack.is_some() && mem.len > MAX_UNPACK_RECV {
            return Err(misuse(
                self.lib.name,
                format!(
                    "a receive of {} bytes on an UNPACK comm: TCPX takes at most 4 MiB per receive (2048 fragments) and exits beyond; set TCPX_P2P_CHUNK=4M or less",
                    mem.len
                ),
            ));
        }
        let slot = (self.posted % NET_UNPACK_MAX_QUEUE_DEPTH as u64) as usize;
        let (mem, mr, host_dst) = match self.unpack.as_ref().and_then(|u| u.bounce_gpu) {
            Some(g) if mem.kind == MemKind::Host => {
                let l = self.landing(g)?;
                (l.slot(slot, mem.len), l.mr, Some(mem))
            }
            _ => (mem, mr, None),
        };
        let mut data = mem.addr as *mut c_void;
        let mut tag: c_int = 0;
        let mut mh = mr.0 as *mut c_void;
        let mut req: *mut c_void = std::ptr::null_mut();
        // SAFETY: n == 1 and every array holds one element; the buffer lies in
        // the region `mr` registers, held by the engine until completion.
        check(self.lib.name, "irecv", unsafe {
            irecv(
                self.comm, 1, &mut data, &mut size, &mut tag, &mut mh, &mut req,
            )
        })?;
        if req.is_null() {
            return Ok(None);
        }
        let id = self.next_id;
        self.next_id += 1;
        self.posted += 1;
        self.queue.push_back(RecvEntry {
            id,
            req,
            mem,
            slot,
            stage: Stage::Posted,
            size: 0,
            frags: Vec::new(),
            host_dst,
        });
        Ok(Some(ReqId(id)))
    }

    fn test(&mut self, req: ReqId) -> Result<Option<usize>, NetError> {
        match self.queue.front() {
            None => {
                return Err(misuse(
                    self.lib.name,
                    format!("test of unknown receive request {}", req.0),
                ))
            }
            Some(e) if e.id != req.0 => {
                return Err(misuse(
                    self.lib.name,
                    format!(
                        "test of receive request {} while {} is the oldest",
                        req.0, e.id
                    ),
                ))
            }
            Some(_) => {}
        }
        self.progress()?;
        match self.queue.front() {
            Some(e) if e.stage == Stage::Ready => {
                let size = e.size;
                self.queue.pop_front();
                Ok(Some(size))
            }
            _ => Ok(None),
        }
    }
}

impl Drop for PluginRecv {
    fn drop(&mut self) {
        // Never close (and free bounce pages) under a running kernel.
        if let Some(k) = self.unpack.as_mut().and_then(|u| u.unpacker.as_mut()) {
            if let Err(e) = k.wait() {
                tracing::warn!("{}: {e}", self.lib.name);
            }
        }
        if let Some(l) = self.landing.take() {
            if let Err(e) = self.lib.dereg_mr(self.comm, l.mr) {
                tracing::warn!("{e}");
            }
            // Device memory is freed with the GPU's context current.
            let _ = gpu::Device::get(l.gpu).and_then(|d| d.bind());
            drop(l.mem);
        }
        if let Some(f) = self.lib.api.close_recv {
            // SAFETY: the receive comm is closed once.
            if let Err(e) = check(self.lib.name, "closeRecv", unsafe { f(self.comm) }) {
                tracing::warn!("{e}");
            }
        }
    }
}
