//! The CUDA the stand-in needs beyond `tcpx_p2p_gpu`: which GPU is
//! current on the calling thread (TCPX acts on that one), host memory mapped
//! for the device (the loadMeta queue), and plain aligned host memory.
//! Without CUDA every GPU question answers "none".

use std::alloc::Layout;
use std::ffi::c_void;

use cudarc::driver::result as cu;
use cudarc::driver::sys;
use tcpx_p2p_gpu as gpu;

/// The GPU whose context is current on this thread, if any.
pub fn current_device() -> Option<i32> {
    if !gpu::available() {
        return None;
    }
    cu::ctx::get_current().ok().flatten()?;
    let mut dev: sys::CUdevice = 0;
    // SAFETY: writes one device handle; fails cleanly without a context.
    let r = unsafe { sys::cuCtxGetDevice(&mut dev) };
    (r == sys::CUresult::CUDA_SUCCESS).then_some(dev)
}

/// Makes GPU `dev`'s primary context current on this thread.
pub fn bind(dev: i32) -> Result<(), String> {
    gpu::Device::get(dev)
        .and_then(|d| d.bind())
        .map_err(|e| e.to_string())
}

/// Zeroed host memory, 4 KiB-aligned, freed on drop.
pub struct HostMem {
    ptr: *mut u8,
    layout: Layout,
}

// SAFETY: plain memory; the owner coordinates access.
unsafe impl Send for HostMem {}
// SAFETY: as above.
unsafe impl Sync for HostMem {}

impl HostMem {
    pub fn new(len: usize) -> Result<Self, String> {
        let layout = Layout::from_size_align(len.max(1), 4096).map_err(|e| e.to_string())?;
        // SAFETY: the layout has a non-zero size.
        let ptr = unsafe { std::alloc::alloc_zeroed(layout) };
        if ptr.is_null() {
            return Err(format!("cannot allocate {len} bytes of host memory"));
        }
        Ok(HostMem { ptr, layout })
    }
    pub fn addr(&self) -> u64 {
        self.ptr as u64
    }
}

impl Drop for HostMem {
    fn drop(&mut self) {
        // SAFETY: allocated with this layout, freed once.
        unsafe { std::alloc::dealloc(self.ptr, self.layout) };
    }
}

/// Pinned host memory mapped into the device address space, zeroed, freed
/// on drop. With unified addressing the device address equals the host one;
/// both are kept.
pub struct MappedMem {
    ptr: *mut c_void,
    pub dev_addr: u64,
}

// SAFETY: plain memory; the owner coordinates access.
unsafe impl Send for MappedMem {}
// SAFETY: as above.
unsafe impl Sync for MappedMem {}

impl MappedMem {
    /// Allocates with `dev`'s context made current.
    pub fn new(dev: i32, len: usize) -> Result<Self, String> {
        bind(dev)?;
        let flags = sys::CU_MEMHOSTALLOC_PORTABLE | sys::CU_MEMHOSTALLOC_DEVICEMAP;
        // SAFETY: allocates `len` bytes of mapped pinned memory.
        let ptr = unsafe { cu::malloc_host(len, flags) }
            .map_err(|e| format!("cuMemHostAlloc({len}): {e:?}"))?;
        // SAFETY: `ptr` holds `len` bytes.
        unsafe { std::ptr::write_bytes(ptr as *mut u8, 0, len) };
        let mut dev_addr: sys::CUdeviceptr = 0;
        // SAFETY: `ptr` was allocated with DEVICEMAP just above.
        let r = unsafe { sys::cuMemHostGetDevicePointer_v2(&mut dev_addr, ptr, 0) };
        if r != sys::CUresult::CUDA_SUCCESS {
            // SAFETY: freed once, on this error path.
            let _ = unsafe { cu::free_host(ptr) };
            return Err(format!("cuMemHostGetDevicePointer: {r:?}"));
        }
        Ok(MappedMem { ptr, dev_addr })
    }
    pub fn host_addr(&self) -> u64 {
        self.ptr as u64
    }
}

impl Drop for MappedMem {
    fn drop(&mut self) {
        // SAFETY: allocated with cuMemHostAlloc, freed once.
        let _ = unsafe { cu::free_host(self.ptr) };
    }
}

/// Host → device copy, done when it returns (a context must be current).
/// It never touches the legacy default stream, which would wait for NCCL's
/// kernels -- and they may be spinning until this very payload lands.
///
/// # Safety
/// Both ranges must be valid for `len` bytes.
pub unsafe fn htod(dst: u64, src: *const u8, len: usize) -> Result<(), String> {
    // SAFETY: by the caller's contract.
    unsafe { gpu::copy_sync(dst, src as u64, len) }.map_err(|e| e.to_string())
}

/// Device → host copy, done when it returns (as [`htod`]).
///
/// # Safety
/// Both ranges must be valid for `len` bytes.
pub unsafe fn dtoh(dst: *mut u8, src: u64, len: usize) -> Result<(), String> {
    // SAFETY: by the caller's contract.
    unsafe { gpu::copy_sync(dst as u64, src, len) }.map_err(|e| e.to_string())
}
