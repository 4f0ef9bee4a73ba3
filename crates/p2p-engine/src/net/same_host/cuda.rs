//! CUDA IPC for the same-host paths: the exporter's handle of an allocation
//! (one per allocation, cached), the importer's opened mapping (one per
//! peer and allocation, cached, closed on drop) and the copy between them.
//! `unsafe` is allowed here only.
#![allow(unsafe_code)]

use std::collections::HashMap;
use std::ffi::c_void;
use std::sync::{Arc, OnceLock};

use cudarc::driver::sys;
use parking_lot::Mutex;

use crate::error::CudaError;
use crate::gpu;
use tcpx_p2p_wire::same_host::Export;

fn check(call: &'static str, r: sys::CUresult) -> Result<(), CudaError> {
    r.result().map_err(|e| CudaError::Driver {
        call,
        msg: format!("{e:?}"),
    })
}

/// CUDA's id of the allocation holding `ptr` (reused addresses get new ids).
fn buffer_id(ptr: u64) -> Result<u64, CudaError> {
    let mut id: u64 = 0;
    // SAFETY: the attribute writes one u64; a bad pointer returns an error.
    check("cuPointerGetAttribute(BUFFER_ID)", unsafe {
        sys::cuPointerGetAttribute(
            &mut id as *mut u64 as *mut c_void,
            sys::CUpointer_attribute::CU_POINTER_ATTRIBUTE_BUFFER_ID,
            ptr,
        )
    })?;
    Ok(id)
}

/// How a peer reaches `[addr, …)` of our GPU `dev`: the allocation's IPC
/// handle (made once per allocation) and the offset of `addr` in it.
/// `same_process`: the peer shares our address space and gets `addr` itself.
pub fn export(dev: i32, addr: u64, same_process: bool) -> Result<Export, CudaError> {
    /// Allocation base → (buffer id, IPC handle).
    type Handles = Mutex<HashMap<u64, (u64, [u8; 64])>>;
    static HANDLES: OnceLock<Handles> = OnceLock::new();
    gpu::Device::get(dev)?.bind()?;
    let (base, _) = gpu::allocation_range(addr)?;
    let id = buffer_id(base)?;
    if same_process {
        return Ok(Export {
            handle: [0; 64],
            buffer_id: id,
            offset: addr - base,
            direct: addr,
            gpu: dev,
            record_addr: 0,
            record_len: 0,
        });
    }
    let cache = HANDLES.get_or_init(Default::default);
    let cached = cache
        .lock()
        .get(&base)
        .filter(|(b, _)| *b == id)
        .map(|(_, h)| *h);
    let handle = match cached {
        Some(h) => h,
        None => {
            // SAFETY: zeroed bytes are a valid value of the plain C struct.
            let mut h: sys::CUipcMemHandle = unsafe { std::mem::zeroed() };
            // SAFETY: writes the handle of the allocation at `base`.
            check("cuIpcGetMemHandle", unsafe {
                sys::cuIpcGetMemHandle(&mut h, base)
            })?;
            let bytes: [u8; 64] = h.reserved.map(|c| c as u8);
            let mut map = cache.lock();
            if map.len() >= 4096 {
                map.clear();
            }
            map.insert(base, (id, bytes));
            bytes
        }
    };
    Ok(Export {
        handle,
        buffer_id: id,
        offset: addr - base,
        direct: 0,
        gpu: dev,
        record_addr: 0,
        record_len: 0,
    })
}

/// A peer's allocation opened in our context; closed when the last user drops it.
pub struct Mapping {
    pub base: u64,
    /// Bytes of the mapped allocation (what CUDA says, not the peer).
    pub size: u64,
    dev: i32,
    opened: bool,
}

impl Drop for Mapping {
    fn drop(&mut self) {
        if !self.opened {
            return;
        }
        if let Ok(d) = gpu::Device::get(self.dev) {
            let _ = d.bind();
        }
        // SAFETY: the mapping was opened by cuIpcOpenMemHandle and is closed once.
        let r = unsafe { sys::cuIpcCloseMemHandle(self.base) };
        if r != sys::CUresult::CUDA_SUCCESS {
            tracing::debug!("cuIpcCloseMemHandle: {r:?}");
        }
    }
}

/// Opened allocations of one peer, by handle; bounded. A mapping is
/// shared by every connection of this process that opened the same handle.
#[derive(Default)]
pub struct Imports {
    by_handle: HashMap<[u8; 64], Arc<Mapping>>,
}

const MAX_IMPORTS: usize = 1024;

impl Imports {
    /// The mapping of `e`'s allocation, opened on GPU `dev` the first time.
    pub fn open(&mut self, dev: i32, e: &Export) -> Result<Arc<Mapping>, CudaError> {
        if e.direct != 0 {
            // Same process (the caller checked): the exporter's own address.
            return Ok(Arc::new(Mapping {
                base: e.direct.wrapping_sub(e.offset),
                size: u64::MAX,
                dev,
                opened: false,
            }));
        }
        if let Some(m) = self.by_handle.get(&e.handle) {
            return Ok(m.clone());
        }
        // CUDA maps a handle once per process: connections share mappings
        // (the last one to let go closes it).
        type Open = Mutex<HashMap<([u8; 64], i32), std::sync::Weak<Mapping>>>;
        static OPEN: OnceLock<Open> = OnceLock::new();
        let mut open = OPEN.get_or_init(Default::default).lock();
        if let Some(m) = open.get(&(e.handle, dev)).and_then(|w| w.upgrade()) {
            self.keep(e.handle, m.clone());
            return Ok(m);
        }
        open.retain(|_, w| w.strong_count() > 0);
        gpu::Device::get(dev)?.bind()?;
        // SAFETY: zeroed bytes are a valid value of the plain C struct.
        let mut h: sys::CUipcMemHandle = unsafe { std::mem::zeroed() };
        h.reserved = e.handle.map(|b| b as std::ffi::c_char);
        let mut base: sys::CUdeviceptr = 0;
        // SAFETY: opens the peer's allocation; writes one device pointer.
        check("cuIpcOpenMemHandle", unsafe {
            sys::cuIpcOpenMemHandle_v2(
                &mut base,
                h,
                sys::CUipcMem_flags::CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS as u32,
            )
        })?;
        // The mapped size bounds the peer's offsets; a driver that will not
        // tell leaves them to the peer's record checks alone.
        let size = match gpu::allocation_range(base) {
            Ok((_, n)) => n as u64,
            Err(err) => {
                tracing::debug!("size of an opened IPC mapping unknown: {err}");
                u64::MAX
            }
        };
        let m = Arc::new(Mapping {
            base,
            size,
            dev,
            opened: true,
        });
        open.insert((e.handle, dev), Arc::downgrade(&m));
        self.keep(e.handle, m.clone());
        Ok(m)
    }

    fn keep(&mut self, handle: [u8; 64], m: Arc<Mapping>) {
        if self.by_handle.len() >= MAX_IMPORTS {
            // Copies in flight hold their own references.
            self.by_handle.clear();
        }
        self.by_handle.insert(handle, m);
    }
}

/// One copy of the GPU path: `len` bytes from `src` to `dst` (device or
/// host addresses of this process, told apart by unified addressing).
#[derive(Debug, Clone, Copy)]
pub struct Copy {
    pub dst: u64,
    pub src: u64,
    pub len: u64,
}

impl Copy {
    /// `len` bytes between our `local` address and the peer's `remote`
    /// one (mapped here): into `local` for a read, out of it for a write.
    pub fn between(local: u64, remote: u64, len: u64, read: bool) -> Self {
        let (dst, src) = if read {
            (local, remote)
        } else {
            (remote, local)
        };
        Copy { dst, src, len }
    }
}

/// Streams one thread keeps per GPU for same-host copies: large copies are
/// cut into pieces on several streams so that several copy engines share
/// them (NVLink peers especially).
const STREAMS: usize = 4;
/// Copies of at least twice this are split, in pieces of at least this.
const PIECE: u64 = 16 << 20;

/// Runs the copies on GPU `dev`'s copy engines and waits for them.
///
/// # Safety
/// Every range must be valid for its length: the caller checked them
/// against the advertisement records and holds the mappings.
pub unsafe fn run(dev: i32, copies: &[Copy]) -> Result<(), CudaError> {
    thread_local! {
        static MINE: std::cell::RefCell<HashMap<i32, Vec<gpu::Stream>>> =
            std::cell::RefCell::new(HashMap::new());
    }
    gpu::Device::get(dev)?.bind()?;
    MINE.with(|cell| {
        let mut map = cell.borrow_mut();
        let ss = match map.entry(dev) {
            std::collections::hash_map::Entry::Occupied(e) => e.into_mut(),
            std::collections::hash_map::Entry::Vacant(e) => e.insert(
                (0..STREAMS)
                    .map(|_| gpu::Stream::new())
                    .collect::<Result<Vec<_>, _>>()?,
            ),
        };
        let mut issued = 0usize;
        let mut err = Ok(());
        'all: for c in copies.iter().filter(|c| c.len > 0) {
            let parts = if c.len >= 2 * PIECE {
                (c.len / PIECE).min(STREAMS as u64)
            } else {
                1
            };
            let step = c.len.div_ceil(parts);
            let mut off = 0;
            while off < c.len {
                let n = step.min(c.len - off);
                let s = &ss[issued % STREAMS];
                // SAFETY: by the caller's contract; the stream is live.
                err = check("cuMemcpyAsync", unsafe {
                    sys::cuMemcpyAsync(c.dst + off, c.src + off, n as usize, s.raw())
                });
                if err.is_err() {
                    break 'all;
                }
                issued += 1;
                off += n;
            }
        }
        // Wait even after an error: the ranges must outlive the copies issued.
        for s in ss.iter().take(issued.min(STREAMS)) {
            let r = s.synchronize();
            if err.is_ok() {
                err = r;
            }
        }
        err
    })
}
