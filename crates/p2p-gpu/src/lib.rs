//! The GPU helpers of tcpx-p2p, shared by the engine and the ncclNet
//! stand-in (`crates/nccl-net-emu`), which does not depend on the engine:
//! CUDA through `cudarc` with dynamic loading, so that everything builds and
//! runs on machines without CUDA, where [`available`] is false and only host
//! memory is used; the unpack kernel ([`unpack`]); the pinned staging ring
//! ([`staging`]); and the switches read from the environment
//! ([`GpuSwitches`]). This crate is one of the raw-memory/FFI edges where
//! `unsafe` is allowed; each block says why it holds.

use std::collections::HashMap;
use std::ffi::c_void;
use std::sync::{Arc, OnceLock};

use cudarc::driver::result as cu;
use cudarc::driver::sys;
use parking_lot::Mutex;

pub mod staging;
pub mod unpack;

/// A failure of the local CUDA driver, or CUDA missing where it is needed.
#[derive(Debug, Clone, thiserror::Error)]
#[non_exhaustive]
pub enum CudaError {
    #[error("CUDA is not available on this machine (no libcuda found)")]
    Unavailable,
    #[error("{call}: {msg}")]
    Driver { call: &'static str, msg: String },
    #[error("NVRTC: {0}")]
    Nvrtc(String),
}

/// CUDA switches for the whole process, read once from the environment:
/// the GPU code consults them wherever it runs (the engine, or the ncclNet
/// stand-in inside NCCL), so they are not per endpoint.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct GpuSwitches {
    /// `TCPX_P2P_DISABLE_CUDA=1`: act as if no GPU were present.
    pub disable_cuda: bool,
    /// `TCPX_P2P_COPY_BATCH=0`: one driver call per copy instead of the
    /// driver's batch copy.
    pub copy_batch: bool,
    /// `TCPX_P2P_COPY_KERNEL=0`: scattered staged copies through the copy
    /// engines only, never the copy kernel.
    pub copy_kernel: bool,
}

impl GpuSwitches {
    /// The switches of this process (the environment is read at the first
    /// call).
    pub fn get() -> GpuSwitches {
        static S: std::sync::OnceLock<GpuSwitches> = std::sync::OnceLock::new();
        *S.get_or_init(|| {
            let is = |k: &str, v: &str| std::env::var(k).is_ok_and(|x| x == v);
            GpuSwitches {
                disable_cuda: is("TCPX_P2P_DISABLE_CUDA", "1"),
                copy_batch: !is("TCPX_P2P_COPY_BATCH", "0"),
                copy_kernel: !is("TCPX_P2P_COPY_KERNEL", "0"),
            }
        })
    }
}

fn drv(call: &'static str, r: Result<(), cu::DriverError>) -> Result<(), CudaError> {
    r.map_err(|e| CudaError::Driver {
        call,
        msg: format!("{e:?}"),
    })
}

fn check(call: &'static str, r: sys::CUresult) -> Result<(), CudaError> {
    drv(call, r.result())
}

/// True when libcuda is present, initialises, and reports at least one GPU.
pub fn available() -> bool {
    static AVAILABLE: OnceLock<bool> = OnceLock::new();
    *AVAILABLE.get_or_init(|| {
        if GpuSwitches::get().disable_cuda {
            return false;
        }
        // SAFETY: only probes whether the library can be opened.
        if !unsafe { sys::is_culib_present() } {
            return false;
        }
        cu::init().is_ok() && cu::device::get_count().map(|n| n > 0).unwrap_or(false)
    })
}

/// Number of GPUs (0 without CUDA).
pub fn device_count() -> usize {
    if !available() {
        return 0;
    }
    cu::device::get_count().map(|n| n as usize).unwrap_or(0)
}

/// One GPU: its primary context, kept retained for the life of the process.
pub struct Device {
    pub ordinal: i32,
    ctx: sys::CUcontext,
    pub bdf: String,
}

// SAFETY: a CUcontext handle may be used from any thread (the driver API is thread-safe).
unsafe impl Send for Device {}
// SAFETY: as above; the handle is never mutated after creation.
unsafe impl Sync for Device {}

impl Device {
    /// The device with this ordinal (cached: one retain per process).
    pub fn get(ordinal: i32) -> Result<Arc<Device>, CudaError> {
        static DEVICES: OnceLock<Mutex<HashMap<i32, Arc<Device>>>> = OnceLock::new();
        if !available() {
            return Err(CudaError::Unavailable);
        }
        let map = DEVICES.get_or_init(Default::default);
        let mut map = map.lock();
        if let Some(d) = map.get(&ordinal) {
            return Ok(d.clone());
        }
        let n = device_count();
        if ordinal < 0 || ordinal as usize >= n {
            return Err(CudaError::Driver {
                call: "cuDeviceGet",
                msg: format!("GPU {ordinal} does not exist ({n} GPUs present)"),
            });
        }
        let dev = cu::device::get(ordinal).map_err(|e| CudaError::Driver {
            call: "cuDeviceGet",
            msg: format!("{e:?}"),
        })?;
        // SAFETY: `dev` is a valid device handle returned just above.
        let ctx = unsafe { cu::primary_ctx::retain(dev) }.map_err(|e| CudaError::Driver {
            call: "cuDevicePrimaryCtxRetain",
            msg: format!("{e:?}"),
        })?;
        let mut buf = [0 as std::ffi::c_char; 32];
        // SAFETY: the buffer is 32 bytes and its length is passed.
        let r = unsafe { sys::cuDeviceGetPCIBusId(buf.as_mut_ptr(), buf.len() as i32, dev) };
        let bdf = if r == sys::CUresult::CUDA_SUCCESS {
            // SAFETY: the driver wrote a NUL-terminated string into `buf`.
            unsafe { std::ffi::CStr::from_ptr(buf.as_ptr()) }
                .to_string_lossy()
                .to_lowercase()
        } else {
            String::new()
        };
        let d = Arc::new(Device { ordinal, ctx, bdf });
        map.insert(ordinal, d.clone());
        Ok(d)
    }

    /// Makes this GPU's context current on the calling thread.
    pub fn bind(&self) -> Result<(), CudaError> {
        // SAFETY: the context is retained for the life of the process.
        drv("cuCtxSetCurrent", unsafe { cu::ctx::set_current(self.ctx) })
    }
}

/// Makes GPU `ordinal`'s context current on the calling thread (work that
/// moves between threads, e.g. a stream's on the I/O workers, calls it at
/// the start of each stretch).
pub fn bind_here(ordinal: i32) -> Result<(), CudaError> {
    Device::get(ordinal)?.bind()
}

/// The calling thread's current CUDA context, made current again when
/// dropped: for work that binds a GPU on a thread it does not own (an
/// application's thread that posted a receive and lands it).
pub struct ContextGuard(Option<sys::CUcontext>);

impl ContextGuard {
    /// Saves the current context (none without CUDA).
    pub fn save() -> Self {
        if !available() {
            return ContextGuard(None);
        }
        ContextGuard(
            cu::ctx::get_current()
                .ok()
                .map(|c| c.unwrap_or(std::ptr::null_mut())),
        )
    }
}

impl Drop for ContextGuard {
    fn drop(&mut self) {
        if let Some(ctx) = self.0 {
            // SAFETY: `ctx` was current on this thread when saved (or null,
            // which unbinds); contexts made here are retained for the life
            // of the process.
            if let Err(e) = unsafe { cu::ctx::set_current(ctx) } {
                tracing::debug!("cannot restore the thread's CUDA context: {e:?}");
            }
        }
    }
}

/// Finds the index of the GPU with this PCI bus id (case-insensitive, with or
/// without the domain).
pub fn device_by_bdf(bdf: &str) -> Option<i32> {
    let want = bdf.trim().to_lowercase();
    (0..device_count() as i32).find(|&i| {
        Device::get(i)
            .map(|d| {
                d.bdf == want || d.bdf.ends_with(&format!(":{want}")) || d.bdf.ends_with(&want)
            })
            .unwrap_or(false)
    })
}

/// The GPU that owns `ptr`, or None for host memory (or without CUDA).
pub fn pointer_device(ptr: u64) -> Option<i32> {
    device_allocation(ptr).map(|(d, _)| d)
}

/// Where device pointer `ptr` lives, in one driver call that needs no
/// context current: its GPU and its allocation (base, size). None for host
/// memory (or without CUDA); a driver that gives the device but not the
/// range leaves the range to [`allocation_range`].
pub fn device_allocation(ptr: u64) -> Option<(i32, Option<(u64, usize)>)> {
    if !available() || ptr == 0 {
        return None;
    }
    let mut mem_type: u32 = 0;
    let mut ordinal: i32 = -1;
    let mut base: sys::CUdeviceptr = 0;
    let mut size: usize = 0;
    let mut attrs = [
        sys::CUpointer_attribute::CU_POINTER_ATTRIBUTE_MEMORY_TYPE,
        sys::CUpointer_attribute::CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL,
        sys::CUpointer_attribute::CU_POINTER_ATTRIBUTE_RANGE_START_ADDR,
        sys::CUpointer_attribute::CU_POINTER_ATTRIBUTE_RANGE_SIZE,
    ];
    let mut data: [*mut c_void; 4] = [
        &mut mem_type as *mut u32 as *mut c_void,
        &mut ordinal as *mut i32 as *mut c_void,
        &mut base as *mut sys::CUdeviceptr as *mut c_void,
        &mut size as *mut usize as *mut c_void,
    ];
    // SAFETY: each of the four attributes writes one value of the type its
    // slot points to (u32, int, device pointer, size_t); a pointer CUDA
    // does not know leaves them at their defaults and still succeeds.
    let r = unsafe {
        sys::cuPointerGetAttributes(
            attrs.len() as u32,
            attrs.as_mut_ptr(),
            data.as_mut_ptr(),
            ptr,
        )
    };
    if r != sys::CUresult::CUDA_SUCCESS
        || mem_type != sys::CUmemorytype::CU_MEMORYTYPE_DEVICE as u32
        || ordinal < 0
    {
        return None;
    }
    let range =
        (base != 0 && size > 0 && ptr >= base && ptr - base < size as u64).then_some((base, size));
    Some((ordinal, range))
}

/// The allocation containing device pointer `ptr`: (base, size).
pub fn allocation_range(ptr: u64) -> Result<(u64, usize), CudaError> {
    let mut base: sys::CUdeviceptr = 0;
    let mut size: usize = 0;
    // SAFETY: writes one pointer and one size; bad pointers return an error.
    check("cuMemGetAddressRange", unsafe {
        sys::cuMemGetAddressRange_v2(&mut base, &mut size, ptr)
    })?;
    Ok((base, size))
}

/// Page-locked host memory, freed on drop. The owning device's context must
/// be current on the thread that creates it.
pub struct PinnedBuf {
    ptr: *mut u8,
    len: usize,
    /// For memory mapped here and registered with CUDA (huge pages): the
    /// length of the mapping.
    mapped: Option<usize>,
}

/// Size of a transparent huge page on x86-64.
const HUGE_PAGE: usize = 2 << 20;

// SAFETY: plain memory; access is coordinated by the owner.
unsafe impl Send for PinnedBuf {}

impl PinnedBuf {
    pub fn new(len: usize) -> Result<Self, CudaError> {
        // SAFETY: allocates `len` bytes of portable pinned memory.
        let p = unsafe { cu::malloc_host(len, sys::CU_MEMHOSTALLOC_PORTABLE) }.map_err(|e| {
            CudaError::Driver {
                call: "cuMemHostAlloc",
                msg: format!("{len} bytes: {e:?}"),
            }
        })?;
        Ok(PinnedBuf {
            ptr: p as *mut u8,
            len,
            mapped: None,
        })
    }

    /// Page-locked memory mapped here (anonymous, advised to use
    /// transparent huge pages, touched) and then registered with CUDA:
    /// ordinary process memory, which the kernel can take page references
    /// to (`vmsplice`), where the driver's own mapping may refuse them.
    /// The staged copies run as fast from it (`copy_contention` on h200-x2:
    /// 28.95 GB/s against 31.86 with the CPU reading each window).
    pub fn new_mapped(len: usize) -> Result<Self, CudaError> {
        let map_len = len.max(1).next_multiple_of(HUGE_PAGE);
        // Room to align the start to a huge page.
        let span = map_len + HUGE_PAGE;
        // SAFETY: an anonymous private mapping; no existing memory is touched.
        let base = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                span,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
                -1,
                0,
            )
        };
        if base == libc::MAP_FAILED {
            return Err(CudaError::Driver {
                call: "mmap",
                msg: format!("{span} bytes: {}", std::io::Error::last_os_error()),
            });
        }
        let addr = base as usize;
        let start = addr.next_multiple_of(HUGE_PAGE);
        // SAFETY: both trimmed ranges lie inside the mapping made above and
        // are not used; what stays is [start, start + map_len).
        unsafe {
            if start > addr {
                libc::munmap(base, start - addr);
            }
            let end = start + map_len;
            if addr + span > end {
                libc::munmap(end as *mut c_void, addr + span - end);
            }
            libc::madvise(start as *mut c_void, map_len, libc::MADV_HUGEPAGE);
            // Fault every page in now, as huge pages where granted.
            std::ptr::write_bytes(start as *mut u8, 0, map_len);
        }
        // SAFETY: registers the mapping made above, which outlives it.
        let r = unsafe {
            sys::cuMemHostRegister_v2(
                start as *mut c_void,
                map_len,
                sys::CU_MEMHOSTREGISTER_PORTABLE,
            )
        };
        if let Err(e) = check("cuMemHostRegister", r) {
            // SAFETY: the mapping is ours and unused.
            unsafe { libc::munmap(start as *mut c_void, map_len) };
            return Err(e);
        }
        Ok(PinnedBuf {
            ptr: start as *mut u8,
            len,
            mapped: Some(map_len),
        })
    }
    pub fn as_ptr(&self) -> *mut u8 {
        self.ptr
    }
    pub fn len(&self) -> usize {
        self.len
    }
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }
    pub fn as_slice(&self, len: usize) -> &[u8] {
        // SAFETY: `len` is clamped to the allocation, which lives as long as self.
        unsafe { std::slice::from_raw_parts(self.ptr, len.min(self.len)) }
    }
    pub fn as_mut_slice(&mut self, len: usize) -> &mut [u8] {
        // SAFETY: as above, and `&mut self` gives exclusive access.
        unsafe { std::slice::from_raw_parts_mut(self.ptr, len.min(self.len)) }
    }
}

impl Drop for PinnedBuf {
    fn drop(&mut self) {
        if let Some(map_len) = self.mapped {
            // SAFETY: registered once in `new_mapped`; unregistered and
            // unmapped once here.
            unsafe {
                let _ = sys::cuMemHostUnregister(self.ptr as *mut c_void);
                libc::munmap(self.ptr as *mut c_void, map_len);
            }
            return;
        }
        // SAFETY: `ptr` came from cuMemHostAlloc and is freed once.
        if let Err(e) = unsafe { cu::free_host(self.ptr as *mut c_void) } {
            tracing::warn!("cuMemFreeHost failed: {e:?}");
        }
    }
}

/// A non-blocking CUDA stream, destroyed on drop.
pub struct Stream(sys::CUstream);
// SAFETY: stream handles may be used from any thread.
unsafe impl Send for Stream {}

impl Stream {
    pub fn new() -> Result<Self, CudaError> {
        cu::stream::create(cu::stream::StreamKind::NonBlocking)
            .map(Stream)
            .map_err(|e| CudaError::Driver {
                call: "cuStreamCreate",
                msg: format!("{e:?}"),
            })
    }
    pub fn raw(&self) -> sys::CUstream {
        self.0
    }
    pub fn synchronize(&self) -> Result<(), CudaError> {
        // SAFETY: the stream is live until drop.
        drv("cuStreamSynchronize", unsafe {
            cu::stream::synchronize(self.0)
        })
    }
    /// Queues a device → host copy of `len` bytes.
    ///
    /// # Safety
    /// `dst` must be pinned host memory of at least `len` bytes and `src` a
    /// device range of `len` bytes, both left alone until the copy is done.
    pub unsafe fn copy_dtoh(&self, dst: *mut u8, src: u64, len: usize) -> Result<(), CudaError> {
        check(
            "cuMemcpyDtoHAsync",
            sys::cuMemcpyDtoHAsync_v2(dst as *mut c_void, src, len, self.0),
        )
    }
    /// Queues a host → device copy of `len` bytes.
    ///
    /// # Safety
    /// As [`Stream::copy_dtoh`], the other way round.
    pub unsafe fn copy_htod(&self, dst: u64, src: *const u8, len: usize) -> Result<(), CudaError> {
        check(
            "cuMemcpyHtoDAsync",
            sys::cuMemcpyHtoDAsync_v2(dst, src as *const c_void, len, self.0),
        )
    }
}

/// One copy of a batch: `len` bytes from `src` to `dst` (device or pinned
/// host addresses, told apart by unified addressing).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CopyOp {
    pub dst: u64,
    pub src: u64,
    pub len: usize,
}

/// Adds `op` to a batch, extending the last copy when `op` continues it on
/// both ends (KV blocks back to back in both places become one copy).
pub fn push_copy(batch: &mut Vec<CopyOp>, op: CopyOp) {
    if op.len == 0 {
        return;
    }
    if let Some(last) = batch.last_mut() {
        let n = last.len as u64;
        if last.dst.checked_add(n) == Some(op.dst) && last.src.checked_add(n) == Some(op.src) {
            last.len += op.len;
            return;
        }
    }
    batch.push(op);
}

/// `cuMemcpyBatchAsync` (CUDA 12.8+): many copies in one driver call. Its
/// CUDA 13 form has no failure index.
type BatchV2 = unsafe extern "C" fn(
    *mut sys::CUdeviceptr,
    *mut sys::CUdeviceptr,
    *mut usize,
    usize,
    *mut sys::CUmemcpyAttributes,
    *mut usize,
    usize,
    sys::CUstream,
) -> sys::CUresult;
type BatchV1 = unsafe extern "C" fn(
    *mut sys::CUdeviceptr,
    *mut sys::CUdeviceptr,
    *mut usize,
    usize,
    *mut sys::CUmemcpyAttributes,
    *mut usize,
    usize,
    *mut usize,
    sys::CUstream,
) -> sys::CUresult;

#[derive(Clone, Copy)]
enum BatchFn {
    V2(BatchV2),
    V1(BatchV1),
}

/// The driver's batch copy, unless it lacks one or `TCPX_P2P_COPY_BATCH=0`
/// (then each copy is its own call).
fn batch_fn() -> Option<BatchFn> {
    static F: OnceLock<Option<BatchFn>> = OnceLock::new();
    *F.get_or_init(|| {
        if !GpuSwitches::get().copy_batch || !available() {
            return None;
        }
        // SAFETY: looks symbols up in the loaded driver library; the types
        // are the driver's documented signatures for these names.
        unsafe {
            let lib = sys::culib();
            if let Ok(f) = lib.get::<BatchV2>(b"cuMemcpyBatchAsync_v2\0") {
                return Some(BatchFn::V2(*f));
            }
            lib.get::<BatchV1>(b"cuMemcpyBatchAsync\0")
                .ok()
                .map(|f| BatchFn::V1(*f))
        }
    })
}

/// Whether batches go to the driver in one call.
pub fn batch_copies() -> bool {
    batch_fn().is_some()
}

impl Stream {
    /// Queues every copy of `ops`: one driver call for the lot where the
    /// driver has a batch copy, else one call each.
    ///
    /// # Safety
    /// Each range must be valid for its length (device memory, or pinned
    /// host memory) and left alone until the stream has done the copies.
    pub unsafe fn copy_batch(&self, ops: &[CopyOp]) -> Result<(), CudaError> {
        let f = match (ops.len(), batch_fn()) {
            (0, _) => return Ok(()),
            (1, _) | (_, None) => {
                for op in ops {
                    // SAFETY: by the caller's contract.
                    check("cuMemcpyAsync", unsafe {
                        sys::cuMemcpyAsync(op.dst, op.src, op.len, self.0)
                    })?;
                }
                return Ok(());
            }
            (_, Some(f)) => f,
        };
        let mut dsts: Vec<sys::CUdeviceptr> = ops.iter().map(|o| o.dst).collect();
        let mut srcs: Vec<sys::CUdeviceptr> = ops.iter().map(|o| o.src).collect();
        let mut sizes: Vec<usize> = ops.iter().map(|o| o.len).collect();
        // SAFETY: a plain C struct for which all-zero is a valid value.
        let mut attr: sys::CUmemcpyAttributes = unsafe { std::mem::zeroed() };
        attr.srcAccessOrder = sys::CUmemcpySrcAccessOrder::CU_MEMCPY_SRC_ACCESS_ORDER_STREAM;
        let mut idx = 0usize;
        let mut fail = usize::MAX;
        // SAFETY: the arrays hold `ops.len()` entries each and outlive the
        // call; one attribute applies from copy 0; ranges by the caller.
        let r = unsafe {
            match f {
                BatchFn::V2(f) => f(
                    dsts.as_mut_ptr(),
                    srcs.as_mut_ptr(),
                    sizes.as_mut_ptr(),
                    ops.len(),
                    &mut attr,
                    &mut idx,
                    1,
                    self.0,
                ),
                BatchFn::V1(f) => f(
                    dsts.as_mut_ptr(),
                    srcs.as_mut_ptr(),
                    sizes.as_mut_ptr(),
                    ops.len(),
                    &mut attr,
                    &mut idx,
                    1,
                    &mut fail,
                    self.0,
                ),
            }
        };
        check("cuMemcpyBatchAsync", r)
    }
}

impl Drop for Stream {
    fn drop(&mut self) {
        // SAFETY: the stream is destroyed once; queued work still completes.
        let _ = unsafe { cu::stream::destroy(self.0) };
    }
}

/// A CUDA event without timing, destroyed on drop.
pub struct Event(sys::CUevent);
// SAFETY: event handles may be used from any thread.
unsafe impl Send for Event {}

impl Event {
    pub fn new() -> Result<Self, CudaError> {
        cu::event::create(sys::CUevent_flags::CU_EVENT_DISABLE_TIMING)
            .map(Event)
            .map_err(|e| CudaError::Driver {
                call: "cuEventCreate",
                msg: format!("{e:?}"),
            })
    }
    pub fn record(&self, s: &Stream) -> Result<(), CudaError> {
        // SAFETY: both handles are live.
        drv("cuEventRecord", unsafe { cu::event::record(self.0, s.0) })
    }
    pub fn synchronize(&self) -> Result<(), CudaError> {
        // SAFETY: the event is live.
        drv("cuEventSynchronize", unsafe {
            cu::event::synchronize(self.0)
        })
    }
    /// Whether the work before the event's last record has completed
    /// (without waiting).
    pub fn is_done(&self) -> Result<bool, CudaError> {
        // SAFETY: the event is live.
        match unsafe { sys::cuEventQuery(self.0) } {
            sys::CUresult::CUDA_SUCCESS => Ok(true),
            sys::CUresult::CUDA_ERROR_NOT_READY => Ok(false),
            r => check("cuEventQuery", r).map(|()| false),
        }
    }
}

impl Drop for Event {
    fn drop(&mut self) {
        // SAFETY: destroyed once.
        let _ = unsafe { cu::event::destroy(self.0) };
    }
}

/// A blocking copy of `len` bytes between any two ranges (host or device,
/// told apart by unified addressing), done when it returns.
///
/// It runs on a non-blocking stream of the calling thread's current
/// context, never on the legacy default stream: a plain `cuMemcpy` would
/// wait for every kernel on blocking streams -- a deadlock when such a
/// kernel (NCCL's, say) spins until this very data arrives -- and from
/// pageable memory it may return before its DMA lands.
///
/// # Safety
/// The ranges must be valid for `len` bytes.
pub unsafe fn copy_sync(dst: u64, src: u64, len: usize) -> Result<(), CudaError> {
    thread_local! {
        static STREAMS: std::cell::RefCell<Vec<(usize, Stream)>> = const { std::cell::RefCell::new(Vec::new()) };
    }
    let ctx = cu::ctx::get_current()
        .map_err(|e| CudaError::Driver {
            call: "cuCtxGetCurrent",
            msg: format!("{e:?}"),
        })?
        .ok_or(CudaError::Driver {
            call: "cuCtxGetCurrent",
            msg: "no CUDA context is current on this thread".into(),
        })? as usize;
    STREAMS.with(|cell| {
        let mut streams = cell.borrow_mut();
        let k = match streams.iter().position(|(c, _)| *c == ctx) {
            Some(k) => k,
            None => {
                streams.push((ctx, Stream::new()?));
                streams.len() - 1
            }
        };
        let s = &streams[k].1;
        // SAFETY: by the caller's contract; the stream is live.
        check("cuMemcpyAsync", unsafe {
            sys::cuMemcpyAsync(dst, src, len, s.raw())
        })?;
        s.synchronize()
    })
}

/// Device memory, freed on drop (for tools and tests).
pub struct DeviceBuf {
    pub ptr: u64,
    pub len: usize,
}

impl DeviceBuf {
    pub fn new(dev: &Device, len: usize) -> Result<Self, CudaError> {
        dev.bind()?;
        let mut p: sys::CUdeviceptr = 0;
        // SAFETY: allocates `len` bytes on the current context's device.
        check("cuMemAlloc", unsafe {
            sys::cuMemAlloc_v2(&mut p, len.max(1))
        })?;
        Ok(DeviceBuf { ptr: p, len })
    }
}

impl Drop for DeviceBuf {
    fn drop(&mut self) {
        // SAFETY: freed once.
        let _ = unsafe { sys::cuMemFree_v2(self.ptr) };
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn push_copy_joins_only_continuations() {
        let op = |dst, src, len| CopyOp { dst, src, len };
        let mut b = Vec::new();
        push_copy(&mut b, op(100, 1000, 10));
        push_copy(&mut b, op(110, 1010, 5)); // continues both ends
        push_copy(&mut b, op(115, 2000, 5)); // source elsewhere
        push_copy(&mut b, op(300, 2005, 5)); // destination elsewhere
        push_copy(&mut b, op(305, 2010, 0)); // empty: dropped
        assert_eq!(
            b,
            vec![op(100, 1000, 15), op(115, 2000, 5), op(300, 2005, 5)]
        );
    }

    /// GPU 0 for the GPU-only tests below, or None (said so) without one.
    fn gpu0() -> Option<Arc<Device>> {
        if !available() {
            eprintln!("no GPU: skipped");
            return None;
        }
        Some(Device::get(0).unwrap())
    }

    /// One small staged copy, as a lone message's path does it: how long
    /// from queueing it to knowing it landed, by way of queueing and of
    /// waiting, with the pinned side just written by the CPU or not.
    /// GPU only:
    /// `cargo test --release -p tcpx-p2p-gpu tests::copy_latency -- --ignored --nocapture`
    #[test]
    #[ignore]
    fn copy_latency() {
        let Some(dev) = gpu0() else { return };
        dev.bind().unwrap();
        let s = Stream::new().unwrap();
        let ev = Event::new().unwrap();
        let gpu = DeviceBuf::new(&dev, 1 << 20).unwrap();
        let mut host = PinnedBuf::new(1 << 20).unwrap();
        let hp = host.as_ptr();
        let p50 = |f: &mut dyn FnMut()| -> f64 {
            let mut v: Vec<f64> = (0..400)
                .map(|_| {
                    let t = std::time::Instant::now();
                    f();
                    t.elapsed().as_secs_f64() * 1e6
                })
                .collect();
            v.sort_by(|a, b| a.total_cmp(b));
            v[v.len() / 2]
        };
        let h = hp as u64;
        for len in [4usize << 10, 64 << 10] {
            for h2d in [false, true] {
                let (dst, src) = if h2d { (gpu.ptr, h) } else { (h, gpu.ptr) };
                let op = [CopyOp { dst, src, len }];
                // SAFETY (all below): ranges inside the two buffers.
                let generic_event = p50(&mut || {
                    unsafe { s.copy_batch(&op) }.unwrap();
                    ev.record(&s).unwrap();
                    ev.synchronize().unwrap();
                });
                let typed_stream = p50(&mut || {
                    if h2d {
                        unsafe { s.copy_htod(gpu.ptr, hp, len) }.unwrap();
                    } else {
                        unsafe { s.copy_dtoh(hp, gpu.ptr, len) }.unwrap();
                    }
                    s.synchronize().unwrap();
                });
                let touched = p50(&mut || {
                    host.as_mut_slice(len).fill(7);
                    unsafe { s.copy_batch(&op) }.unwrap();
                    ev.record(&s).unwrap();
                    ev.synchronize().unwrap();
                });
                let touch_only = p50(&mut || host.as_mut_slice(len).fill(7));
                eprintln!(
                    "{} {:>3} KiB p50 us: copy+event {generic_event:.1}, typed copy+stream sync {typed_stream:.1}, after a CPU write {touched:.1} (the write alone {touch_only:.1})",
                    if h2d { "H2D" } else { "D2H" },
                    len >> 10
                );
            }
        }
    }

    /// How a copy-rate thread moves its blocks (see [`copy_threads`]).
    #[derive(Clone, Copy, PartialEq)]
    enum How {
        /// Scattered blocks, one driver call each.
        OneCall,
        /// Scattered blocks, batch calls of 32.
        Batch,
        /// Scattered blocks, launches of 32 of the copy kernel.
        Kernel,
        /// Contiguous blocks joined into one copy per 32.
        Joined,
    }

    /// The block size of [`copy_threads`]: `COPY_RATES_BLOCK` bytes (16 to
    /// 1 MiB, a multiple of 16), else 32 KiB.
    fn rates_block() -> usize {
        std::env::var("COPY_RATES_BLOCK")
            .ok()
            .and_then(|v| v.trim().parse::<usize>().ok())
            .filter(|&b| (16..=1 << 20).contains(&b) && b % 16 == 0)
            .unwrap_or(32 << 10)
    }

    /// Threads each copying its share of 128 MiB of blocks ([`rates_block`]) between a GPU
    /// buffer and its own pinned buffer, five rounds, as `plans` say (per
    /// thread: towards the host or not, and how), all started at once.
    /// Returns GB/s summed over the threads of each direction (D2H, H2D),
    /// and the calling threads' time per 1 MiB window of copies spent in
    /// the calls themselves (what a stream thread pays per window), µs.
    fn copy_threads(dev: &Arc<Device>, plans: &[(bool, How)]) -> (f64, f64, f64) {
        // 128 MiB in all, a 1 MiB window's blocks per call or launch.
        let bs = rates_block();
        let (n, rounds) = ((128usize << 20) / bs, 5usize);
        let per_call = ((1usize << 20) / bs).clamp(1, 1024);
        // One GPU buffer per direction: the two never copy the same bytes.
        let bufs = [
            DeviceBuf::new(dev, n * bs).unwrap(),
            DeviceBuf::new(dev, n * bs).unwrap(),
        ];
        let per_dir = |d2h: bool| plans.iter().filter(|p| p.0 == d2h).count();
        let barrier = std::sync::Barrier::new(plans.len());
        let res: Vec<(bool, f64, f64)> = std::thread::scope(|sc| {
            let hs: Vec<_> = plans
                .iter()
                .enumerate()
                .map(|(t, &(d2h, how))| {
                    let (k, barrier) = (per_dir(d2h), &barrier);
                    let base = bufs[usize::from(d2h)].ptr;
                    // This thread's index among those of its direction.
                    let t = plans[..t].iter().filter(|p| p.0 == d2h).count();
                    let dev = dev.clone();
                    sc.spawn(move || {
                        let per = n / k;
                        dev.bind().unwrap();
                        let s = Stream::new().unwrap();
                        let host = PinnedBuf::new(per * bs).unwrap();
                        let ev = Event::new().unwrap();
                        let mut kernels: Vec<(unpack::CopyKernel, Event, bool)> = (0..4)
                            .map(|_| {
                                (
                                    unpack::CopyKernel::new(&dev, per_call).unwrap(),
                                    Event::new().unwrap(),
                                    false,
                                )
                            })
                            .collect();
                        let mut ops = Vec::new();
                        for i in 0..per {
                            let blk = t * per + i;
                            let g = if how == How::Joined {
                                blk
                            } else {
                                (blk * 1031) % n
                            };
                            let h = host.as_ptr() as u64 + (i * bs) as u64;
                            let d = base + (g * bs) as u64;
                            let (dst, src) = if d2h { (h, d) } else { (d, h) };
                            push_copy(&mut ops, CopyOp { dst, src, len: bs });
                        }
                        barrier.wait();
                        let t0 = std::time::Instant::now();
                        let mut calls = std::time::Duration::ZERO;
                        let mut launches = 0usize;
                        for _round in 0..rounds {
                            for c in ops.chunks(if how == How::OneCall { 1 } else { per_call }) {
                                if how == How::Kernel {
                                    let (kn, kev, used) = &mut kernels[launches % 4];
                                    if *used {
                                        // Its descriptors are rewritten below.
                                        kev.synchronize().unwrap();
                                    }
                                    let c0 = std::time::Instant::now();
                                    // SAFETY: ranges inside the two buffers;
                                    // this kernel's previous launch completed.
                                    unsafe { kn.launch(&s, c) }.unwrap();
                                    calls += c0.elapsed();
                                    kev.record(&s).unwrap();
                                    *used = true;
                                    launches += 1;
                                } else {
                                    let c0 = std::time::Instant::now();
                                    // SAFETY: ranges inside the two buffers.
                                    unsafe { s.copy_batch(c) }.unwrap();
                                    calls += c0.elapsed();
                                }
                            }
                            ev.record(&s).unwrap();
                            ev.synchronize().unwrap();
                        }
                        (d2h, t0.elapsed().as_secs_f64(), calls.as_secs_f64())
                    })
                })
                .collect();
            hs.into_iter().map(|h| h.join().unwrap()).collect()
        });
        let rate = |d2h: bool| {
            let wall = res
                .iter()
                .filter(|r| r.0 == d2h)
                .map(|r| r.1)
                .fold(0.0, f64::max);
            if wall > 0.0 {
                (rounds * n * bs) as f64 / wall / 1e9
            } else {
                0.0
            }
        };
        let calls: f64 = res.iter().map(|r| r.2).sum();
        let windows = (rounds * n / per_call) as f64
            * [true, false].iter().filter(|&&d| per_dir(d) > 0).count() as f64;
        (rate(true), rate(false), calls * 1e6 / windows)
    }

    /// Copy rates of 128 MiB of blocks (32 KiB, or `COPY_RATES_BLOCK`
    /// bytes) between GPU memory and pinned memory, from 1 thread and from
    /// 8 at once (as the I/O threads do): scattered blocks one driver call
    /// each, in batch calls of a 1 MiB staging window's blocks, in launches
    /// of a window's blocks of the copy kernel (four kernels in turn, as
    /// the staging slots use them), and contiguous blocks joined into one
    /// copy; beside each rate, the calling thread's time per window spent
    /// in the calls themselves (what a stream thread pays per window: the
    /// reason the kernel is used for scattered windows, see
    /// `unpack::CopyKernel`). Only the copying is timed. GPU only:
    /// `cargo test --release -p tcpx-p2p-gpu tests::copy_rates -- --ignored --nocapture`
    #[test]
    #[ignore]
    fn copy_rates() {
        let Some(dev) = gpu0() else { return };
        eprintln!("batch API present: {}", batch_copies());
        for d2h in [true, false] {
            for k in [1, 8] {
                let r: Vec<(f64, f64)> = [How::OneCall, How::Batch, How::Kernel, How::Joined]
                    .iter()
                    .map(|&h| {
                        let (a, b, calls) = copy_threads(&dev, &vec![(d2h, h); k]);
                        (if d2h { a } else { b }, calls)
                    })
                    .collect();
                eprintln!(
                    "{} {k} thread(s), 128 MiB of {} B blocks scattered: one call each {:.2} GB/s ({:.1} us per 1 MiB window in calls), batch calls of a window {:.2} ({:.1}), copy kernel launches of a window {:.2} ({:.1}); contiguous as one copy {:.2}",
                    if d2h { "D2H" } else { "H2D" },
                    rates_block(),
                    r[0].0, r[0].1, r[1].0, r[1].1, r[2].0, r[2].1, r[3].0,
                );
            }
        }
    }

    /// Both directions at once on one GPU, as a sender's and a receiver's
    /// staging do when both ends of a transfer use the same GPU: 8 threads
    /// copying towards the host beside 8 copying from it, each way alone
    /// and both at once, for scattered 32 KiB blocks through the copy
    /// kernel and through batch calls, and for contiguous 1 MiB windows.
    /// GB/s of each direction. GPU only:
    /// `cargo test --release -p tcpx-p2p-gpu tests::copy_both_ways -- --ignored --nocapture`
    #[test]
    #[ignore]
    fn copy_both_ways() {
        let Some(dev) = gpu0() else { return };
        for how in [How::Kernel, How::Batch, How::Joined] {
            let name = match how {
                How::Kernel => "scattered, copy kernel",
                How::Batch => "scattered, batch calls",
                _ => "contiguous windows",
            };
            let (d2h, _, _) = copy_threads(&dev, &[(true, how); 8]);
            let (_, h2d, _) = copy_threads(&dev, &[(false, how); 8]);
            let mut both = vec![(true, how); 8];
            both.extend([(false, how); 8]);
            let (bd, bh, _) = copy_threads(&dev, &both);
            eprintln!(
                "{name}: D2H alone {d2h:.2} GB/s, H2D alone {h2d:.2}; both at once D2H {bd:.2} + H2D {bh:.2}"
            );
        }
    }

    /// What the staged copies get when the rest of a transfer runs beside
    /// them: 8 threads each copying 1 MiB windows GPU 0 → pinned slots, 4
    /// in flight (as the socket net's send threads do), alone; beside 8
    /// threads copying pinned slots → GPU 1 the same way (the receiver's
    /// copies); and beside both, 16 threads copying host memory as the
    /// kernel's socket copies do (1 MiB memcpy between 4 MiB buffers), with
    /// and without the H2D threads.
    /// GB/s of each kind, summed over its threads. GPU only (two GPUs for
    /// the second and third rows):
    /// `cargo test --release -p tcpx-p2p-gpu tests::copy_contention -- --ignored --nocapture`
    #[test]
    #[ignore]
    fn copy_contention() {
        use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
        if gpu0().is_none() {
            return;
        }
        // Window bytes and slots per thread (`COPY_CONTENTION_WIN`, `..._DEPTH`
        // to try other footprints).
        let env = |k: &str, d: usize| {
            std::env::var(k)
                .ok()
                .and_then(|v| v.trim().parse::<usize>().ok())
                .unwrap_or(d)
        };
        let (win, depth) = (
            env("COPY_CONTENTION_WIN", 1 << 20),
            env("COPY_CONTENTION_DEPTH", 4),
        );
        eprintln!("windows of {win} bytes, {depth} per thread");
        let two = device_count() >= 2;
        let run = |h2d: bool, cpu: usize, touch: bool, huge: bool| -> (f64, f64, f64) {
            let stop = AtomicBool::new(false);
            let moved: [AtomicU64; 3] = Default::default();
            let t0 = std::time::Instant::now();
            std::thread::scope(|sc| {
                let gpu_side = |dev_i: i32, to_host: bool, slot: usize| {
                    let (stop, moved) = (&stop, &moved);
                    sc.spawn(move || {
                        let dev = Device::get(dev_i).unwrap();
                        dev.bind().unwrap();
                        let s = Stream::new().unwrap();
                        let g = DeviceBuf::new(&dev, depth * win).unwrap();
                        let host = if huge {
                            PinnedBuf::new_mapped(depth * win).unwrap()
                        } else {
                            PinnedBuf::new(depth * win).unwrap()
                        };
                        let evs: Vec<Event> = (0..depth).map(|_| Event::new().unwrap()).collect();
                        let mut i = 0usize;
                        while !stop.load(Ordering::Relaxed) {
                            let k = i % depth;
                            if i >= depth {
                                evs[k].synchronize().unwrap();
                                moved[slot].fetch_add(win as u64, Ordering::Relaxed);
                                if touch && to_host {
                                    // Read the window as a socket write would.
                                    let w = &host.as_slice(depth * win)[k * win..(k + 1) * win];
                                    let sum = w.chunks(64).fold(0u8, |a, c| a ^ c[0]);
                                    std::hint::black_box(sum);
                                }
                            }
                            if touch && !to_host {
                                // Fill the window as a socket read would.
                                // SAFETY: the slot's previous copy was
                                // waited for above; the range is inside it.
                                unsafe {
                                    std::ptr::write_bytes(host.as_ptr().add(k * win), i as u8, win)
                                };
                            }
                            let h = host.as_ptr() as u64 + (k * win) as u64;
                            let d = g.ptr + (k * win) as u64;
                            let (dst, src) = if to_host { (h, d) } else { (d, h) };
                            // SAFETY: both ranges lie inside this thread's buffers.
                            unsafe { s.copy_batch(&[CopyOp { dst, src, len: win }]) }.unwrap();
                            evs[k].record(&s).unwrap();
                            i += 1;
                        }
                        s.synchronize().unwrap();
                    });
                };
                for _ in 0..8 {
                    gpu_side(0, true, 0);
                    if h2d {
                        gpu_side(1, false, 1);
                    }
                }
                for _ in 0..cpu {
                    let (stop, moved) = (&stop, &moved);
                    sc.spawn(move || {
                        let a = vec![1u8; depth * win];
                        let mut b = vec![0u8; depth * win];
                        let mut i = 0usize;
                        while !stop.load(Ordering::Relaxed) {
                            let k = (i % depth) * win;
                            b[k..k + win].copy_from_slice(&a[k..k + win]);
                            std::hint::black_box(&b);
                            moved[2].fetch_add(win as u64, Ordering::Relaxed);
                            i += 1;
                        }
                    });
                }
                std::thread::sleep(std::time::Duration::from_millis(2000));
                stop.store(true, Ordering::Relaxed);
            });
            let secs = t0.elapsed().as_secs_f64();
            let r = |i: usize| moved[i].load(Ordering::Relaxed) as f64 / secs / 1e9;
            (r(0), r(1), r(2))
        };
        eprintln!("8 threads D2H (GPU 0), {win} B x {depth} in flight each:");
        // (H2D threads on GPU 1, CPU memcpy threads, windows touched by the
        // CPU as the socket calls do, huge-page pinned memory, what it is).
        #[rustfmt::skip]
        let rows: [(bool, usize, bool, bool, &str); 9] = [
            (false, 0, false, false, "alone"),
            (false, 0, true, false, "each window read by its thread once landed (as a socket write reads it)"),
            (false, 0, false, true, "huge-page pinned memory"),
            (false, 0, true, true, "huge-page pinned memory, each window read once landed"),
            (true, 0, false, false, "beside 8 threads H2D (GPU 1)"),
            (true, 0, true, false, "the same, D2H windows read once landed, H2D windows written before"),
            (true, 0, true, true, "the same in huge-page pinned memory"),
            (false, 16, false, false, "beside 16 threads of CPU memcpy"),
            (true, 16, false, false, "beside H2D and 16 threads of CPU memcpy"),
        ];
        for (h2d, cpu, touch, huge, what) in rows {
            if h2d && !two {
                eprintln!("one GPU: the rows with H2D on GPU 1 need two");
                return;
            }
            let (d, h, c) = run(h2d, cpu, touch, huge);
            let h = if h2d {
                format!(", H2D {h:.2}")
            } else {
                String::new()
            };
            let c = if cpu > 0 {
                format!(", memcpy {c:.2}")
            } else {
                String::new()
            };
            eprintln!("  {what}: D2H {d:.2} GB/s{h}{c}");
        }
    }

    #[test]
    fn no_cuda_is_a_normal_state() {
        // Must not panic whether or not CUDA is here.
        let n = super::device_count();
        if !super::available() {
            assert_eq!(n, 0);
            assert!(super::Device::get(0).is_err());
            assert_eq!(super::pointer_device(0x1000), None);
        }
    }
}
