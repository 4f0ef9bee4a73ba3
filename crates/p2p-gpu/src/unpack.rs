//! Unpack: copying the fragments of a received message out of a plugin's
//! bounce pages into the user's buffer. Each fragment is a
//! [`LoadMeta`] (`len` bytes from `bounce + src_off` to `dst + dst_off`).
//!
//! - On the GPU, [`Unpacker`] runs a CUDA C kernel compiled at run time with
//!   NVRTC (once per process, loaded once per GPU): one block per fragment,
//!   16-byte vector copies where the source and destination share their
//!   alignment, byte copies for the rest. One launch covers a batch of
//!   fragments, of any number of receives; an event tells when it is done.
//! - On the host, [`unpack_host`] (bounds-checked slices) and
//!   [`unpack_host_raw`] (a source whose extent only the plugin knows) do
//!   the same with `memcpy`.
//!
//! Raw device and host memory: `unsafe` is allowed here, each block says why.

use std::collections::HashMap;
use std::ffi::{c_void, CString};
use std::sync::{Arc, OnceLock};

use cudarc::driver::result as cu;
use cudarc::driver::sys;
use parking_lot::Mutex;

use super::{check, drv, Device, DeviceBuf, Event, PinnedBuf, Stream};
use crate::CudaError;

/// One fragment of an UNPACK receive: `len` bytes from
/// `bounce_buf + src_off` to `dst + dst_off` (the ncclNet ABI's `loadMeta`,
/// defined and layout-checked with the rest of the ABI mirror).
pub use ncclnet_abi::LoadMeta;

/// A fragment that does not fit where it must go.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum UnpackError {
    #[error("fragment {index} ({len} bytes to offset {dst_off}) overruns the {dst_len}-byte destination")]
    DstOverrun {
        index: usize,
        len: u32,
        dst_off: u64,
        dst_len: usize,
    },
    #[error(
        "fragment {index} ({len} bytes from offset {src_off}) overruns the {src_len}-byte source"
    )]
    SrcOverrun {
        index: usize,
        len: u32,
        src_off: u32,
        src_len: usize,
    },
}

/// Checks that every fragment lands inside a destination of `dst_len`
/// bytes; returns the bytes they carry.
pub fn check_fragments(frags: &[LoadMeta], dst_len: usize) -> Result<usize, UnpackError> {
    let mut total = 0usize;
    for (index, f) in frags.iter().enumerate() {
        let end = f.dst_off.checked_add(u64::from(f.len));
        if end.is_none_or(|e| e > dst_len as u64) {
            return Err(UnpackError::DstOverrun {
                index,
                len: f.len,
                dst_off: f.dst_off,
                dst_len,
            });
        }
        total += f.len as usize;
    }
    Ok(total)
}

/// Copies every fragment from `src` to `dst`, both bounds-checked; returns
/// the bytes copied. Nothing is written when any fragment is out of bounds.
pub fn unpack_host(src: &[u8], dst: &mut [u8], frags: &[LoadMeta]) -> Result<usize, UnpackError> {
    let total = check_fragments(frags, dst.len())?;
    for (index, f) in frags.iter().enumerate() {
        if f.src_off as usize + f.len as usize > src.len() {
            return Err(UnpackError::SrcOverrun {
                index,
                len: f.len,
                src_off: f.src_off,
                src_len: src.len(),
            });
        }
    }
    for f in frags {
        let (s, d, l) = (f.src_off as usize, f.dst_off as usize, f.len as usize);
        dst[d..d + l].copy_from_slice(&src[s..s + l]);
    }
    Ok(total)
}

/// Copies every fragment from `src_base + src_off` into `dst`; the
/// destination is bounds-checked first, nothing is written if a fragment
/// would overrun it. Returns the bytes copied.
///
/// # Safety
/// `src_base + src_off .. + len` must be readable for every fragment (the
/// plugin's bounce pages, held until `irecvConsumed`) and must not overlap
/// `dst`.
pub unsafe fn unpack_host_raw(
    src_base: *const u8,
    dst: &mut [u8],
    frags: &[LoadMeta],
) -> Result<usize, UnpackError> {
    let total = check_fragments(frags, dst.len())?;
    for f in frags {
        // SAFETY: the destination range was checked above; the source is
        // readable by the caller's contract, and the two do not overlap.
        unsafe {
            std::ptr::copy_nonoverlapping(
                src_base.add(f.src_off as usize),
                dst.as_mut_ptr().add(f.dst_off as usize),
                f.len as usize,
            )
        };
    }
    Ok(total)
}

/// The host address of host memory mapped for the device at `ptr` (e.g. a
/// plugin's loadMeta queue), when CUDA knows the pointer. With unified
/// addressing it is `ptr` itself.
pub fn host_address(ptr: u64) -> Option<u64> {
    if !super::available() || ptr == 0 {
        return None;
    }
    let mut host: *mut c_void = std::ptr::null_mut();
    // SAFETY: the attribute query writes one pointer into `host`; an unknown
    // pointer only returns an error code.
    let r = unsafe {
        sys::cuPointerGetAttribute(
            &mut host as *mut *mut c_void as *mut c_void,
            sys::CUpointer_attribute::CU_POINTER_ATTRIBUTE_HOST_POINTER,
            ptr,
        )
    };
    (r == sys::CUresult::CUDA_SUCCESS && !host.is_null()).then_some(host as u64)
}

/// One copy for the kernel: absolute addresses (device, or host memory the
/// device can reach). Layout shared with [`KERNEL_SRC`].
#[repr(C)]
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct CopyDesc {
    pub src: u64,
    pub dst: u64,
    pub len: u32,
    pub pad: u32,
}

/// Appends the copies of `frags` (relative to `src_base` / `dst_base`).
pub fn push_descs(frags: &[LoadMeta], src_base: u64, dst_base: u64, out: &mut Vec<CopyDesc>) {
    out.extend(frags.iter().filter(|f| f.len > 0).map(|f| CopyDesc {
        src: src_base + u64::from(f.src_off),
        dst: dst_base + f.dst_off,
        len: f.len,
        pad: 0,
    }));
}

/// The unpack kernel. One block per fragment (grid-strided); within a
/// fragment, when source and destination share their offset modulo 16, the
/// bytes up to the first 16-byte boundary are copied singly, the body as
/// 16-byte vectors, the tail singly; otherwise every byte singly.
pub const KERNEL_SRC: &str = r#"
struct CopyDesc {
  unsigned long long src;
  unsigned long long dst;
  unsigned int len;
  unsigned int pad;
};

struct alignas(16) Vec16 {
  unsigned long long lo;
  unsigned long long hi;
};

extern "C" __global__ void tcpx_unpack(const CopyDesc* __restrict__ descs, unsigned int n) {
  for (unsigned int f = blockIdx.x; f < n; f += gridDim.x) {
    const CopyDesc d = descs[f];
    const unsigned char* s = (const unsigned char*)d.src;
    unsigned char* t = (unsigned char*)d.dst;
    const unsigned int len = d.len;
    unsigned int body_start = 0;
    unsigned int body_end = 0;
    if (((d.src ^ d.dst) & 15ull) == 0ull) {
      unsigned int head = (16u - (unsigned int)(d.src & 15ull)) & 15u;
      if (head > len) head = len;
      const unsigned int nvec = (len - head) / 16u;
      const Vec16* vs = (const Vec16*)(s + head);
      Vec16* vt = (Vec16*)(t + head);
      for (unsigned int i = threadIdx.x; i < nvec; i += blockDim.x) vt[i] = vs[i];
      body_start = head;
      body_end = head + nvec * 16u;
    }
    for (unsigned int i = threadIdx.x; i < body_start; i += blockDim.x) t[i] = s[i];
    for (unsigned int i = body_end + threadIdx.x; i < len; i += blockDim.x) t[i] = s[i];
  }
}
"#;

const KERNEL_NAME: &str = "tcpx_unpack";
const THREADS: u32 = 256;
const MAX_BLOCKS: usize = 1 << 20;

/// The kernel compiled to PTX once per process (NUL-terminated).
fn ptx() -> Result<&'static [u8], CudaError> {
    static PTX: OnceLock<Result<Vec<u8>, CudaError>> = OnceLock::new();
    PTX.get_or_init(compile)
        .as_ref()
        .map(|v| v.as_slice())
        .map_err(CudaError::clone)
}

fn compile() -> Result<Vec<u8>, CudaError> {
    let nvrtc = CudaError::Nvrtc;
    use cudarc::nvrtc::result as rtc;
    // SAFETY: only probes whether the NVRTC library can be opened.
    if !unsafe { cudarc::nvrtc::sys::is_culib_present() } {
        return Err(nvrtc(
            "libnvrtc not found (install the CUDA toolkit's NVRTC)".into(),
        ));
    }
    let src = CString::new(KERNEL_SRC).map_err(|e| nvrtc(e.to_string()))?;
    let name = CString::new("tcpx_unpack.cu").map_err(|e| nvrtc(e.to_string()))?;
    let prog = rtc::create_program(&src, Some(&name)).map_err(|e| nvrtc(format!("{e:?}")))?;
    let opts = ["--std=c++17", "-default-device"];
    // SAFETY: `prog` was just created and is destroyed once below.
    let compiled = unsafe { rtc::compile_program(prog, &opts) };
    let out = match compiled {
        Ok(()) => {
            // SAFETY: the program compiled.
            unsafe { rtc::get_ptx(prog) }
                .map(|v| v.into_iter().map(|c| c as u8).collect::<Vec<u8>>())
                .map_err(|e| nvrtc(format!("{e:?}")))
        }
        Err(e) => {
            // SAFETY: the program exists; the log is read after compiling.
            let log = unsafe { rtc::get_program_log(prog) }
                .map(|v| {
                    let b: Vec<u8> = v.into_iter().map(|c| c as u8).collect();
                    String::from_utf8_lossy(&b)
                        .trim_end_matches('\0')
                        .to_string()
                })
                .unwrap_or_default();
            Err(nvrtc(format!("compiling the unpack kernel: {e:?}: {log}")))
        }
    };
    // SAFETY: destroyed once, after its last use.
    let _ = unsafe { rtc::destroy_program(prog) };
    let mut out = out?;
    if out.last() != Some(&0) {
        out.push(0);
    }
    Ok(out)
}

/// A loaded kernel function of one GPU.
#[derive(Clone, Copy)]
struct Func(sys::CUfunction);
// SAFETY: a CUfunction handle may be used from any thread; its module is
// never unloaded.
unsafe impl Send for Func {}

/// The kernel loaded in `dev`'s primary context (once per GPU). The
/// context must be current.
fn function(dev: &Device) -> Result<Func, CudaError> {
    static FUNCS: OnceLock<Mutex<HashMap<i32, Func>>> = OnceLock::new();
    let mut map = FUNCS.get_or_init(Default::default).lock();
    if let Some(f) = map.get(&dev.ordinal) {
        return Ok(*f);
    }
    let image = ptx()?;
    // SAFETY: `image` is NUL-terminated PTX that lives for the process.
    let module =
        unsafe { cu::module::load_data(image.as_ptr() as *const c_void) }.map_err(|e| {
            CudaError::Driver {
                call: "cuModuleLoadData",
                msg: format!("{e:?}"),
            }
        })?;
    let name = CString::new(KERNEL_NAME).map_err(|e| CudaError::Nvrtc(e.to_string()))?;
    // SAFETY: the module was just loaded and is kept for the process.
    let f = unsafe { cu::module::get_function(module, name) }.map_err(|e| CudaError::Driver {
        call: "cuModuleGetFunction",
        msg: format!("{e:?}"),
    })?;
    map.insert(dev.ordinal, Func(f));
    Ok(Func(f))
}

/// Many scattered copies between a pinned staging slot and device memory
/// (a window of KV blocks) in one launch of the unpack kernel, instead of
/// a copy-engine transfer -- and the driver's per-copy work -- each. The
/// descriptors live in pinned memory the GPU reads directly; one
/// `CopyKernel` per staging slot, so a launch's descriptors are rewritten
/// only once the slot's previous copies have completed.
pub struct CopyKernel {
    func: Func,
    descs: PinnedBuf,
    cap: usize,
}

impl CopyKernel {
    /// Loads the kernel on `dev` (compiled once per process) with room for
    /// `cap` copies a launch. The device's context must be current.
    pub fn new(dev: &Device, cap: usize) -> Result<Self, CudaError> {
        let cap = cap.max(1);
        Ok(CopyKernel {
            func: function(dev)?,
            descs: PinnedBuf::new(cap * std::mem::size_of::<CopyDesc>())?,
            cap,
        })
    }

    /// Queues `ops` on `stream` as one launch.
    ///
    /// # Safety
    /// Each range must be device memory or pinned host memory the device
    /// reaches at the same address, valid and otherwise untouched until the
    /// stream has run the kernel; this kernel's previous launch must have
    /// completed (its descriptors are rewritten here).
    pub unsafe fn launch(
        &mut self,
        stream: &Stream,
        ops: &[super::CopyOp],
    ) -> Result<(), CudaError> {
        if ops.is_empty() {
            return Ok(());
        }
        if ops.len() > self.cap {
            return Err(CudaError::Driver {
                call: "copy kernel",
                msg: format!("{} copies exceed a launch's {}", ops.len(), self.cap),
            });
        }
        let descs = self.descs.as_ptr() as *mut CopyDesc;
        for (i, op) in ops.iter().enumerate() {
            let len = u32::try_from(op.len).map_err(|_| CudaError::Driver {
                call: "copy kernel",
                msg: format!("a copy of {} bytes exceeds 4 GiB", op.len),
            })?;
            let d = CopyDesc {
                src: op.src,
                dst: op.dst,
                len,
                pad: 0,
            };
            // SAFETY: the buffer holds `cap` descriptors and i < cap; the
            // previous launch has completed (the caller's contract).
            unsafe { descs.add(i).write_unaligned(d) };
        }
        let mut dptr = self.descs.as_ptr() as u64;
        let mut count = ops.len() as u32;
        let mut params = [
            &mut dptr as *mut u64 as *mut c_void,
            &mut count as *mut u32 as *mut c_void,
        ];
        // SAFETY: a function of a loaded module; the parameters match the
        // kernel's (pointer, unsigned int); the descriptors are pinned
        // memory the GPU reads at the same address; the ranges are valid
        // by the caller's contract.
        drv("cuLaunchKernel", unsafe {
            cu::launch_kernel(
                self.func.0,
                (ops.len().min(MAX_BLOCKS) as u32, 1, 1),
                (THREADS, 1, 1),
                0,
                stream.raw(),
                &mut params,
            )
        })
    }
}

/// Runs the unpack kernel on one GPU: a stream, an event, and descriptor
/// buffers (pinned on the host, copied to the device with each launch).
pub struct Unpacker {
    dev: Arc<Device>,
    func: Func,
    stream: Stream,
    event: Event,
    host: PinnedBuf,
    devbuf: DeviceBuf,
    cap: usize,
    in_flight: bool,
}

impl Unpacker {
    /// Compiles (once) and loads the kernel for `dev`.
    pub fn new(dev: Arc<Device>) -> Result<Self, CudaError> {
        dev.bind()?;
        let func = function(&dev)?;
        let cap = 4096;
        let bytes = cap * std::mem::size_of::<CopyDesc>();
        Ok(Unpacker {
            func,
            stream: Stream::new()?,
            event: Event::new()?,
            host: PinnedBuf::new(bytes)?,
            devbuf: DeviceBuf::new(&dev, bytes)?,
            cap,
            in_flight: false,
            dev,
        })
    }

    pub fn device(&self) -> &Arc<Device> {
        &self.dev
    }

    /// True while a launched batch may still run.
    pub fn in_flight(&self) -> bool {
        self.in_flight
    }

    /// Queues the copies of `descs` and records the event after them.
    /// Waits for a batch still in flight first.
    ///
    /// # Safety
    /// Every descriptor's source and destination must be memory the GPU can
    /// access, valid (and not otherwise written) until the batch completes.
    pub unsafe fn launch(&mut self, descs: &[CopyDesc]) -> Result<(), CudaError> {
        if self.in_flight {
            self.wait()?;
        }
        if descs.is_empty() {
            return Ok(());
        }
        self.dev.bind()?;
        let size = std::mem::size_of::<CopyDesc>();
        if descs.len() > self.cap {
            let cap = descs.len().next_power_of_two();
            self.host = PinnedBuf::new(cap * size)?;
            self.devbuf = DeviceBuf::new(&self.dev, cap * size)?;
            self.cap = cap;
        }
        let bytes = std::mem::size_of_val(descs);
        // SAFETY: the pinned buffer holds `cap * size` ≥ `bytes` bytes and is
        // idle (no batch in flight); CopyDesc is plain old data.
        unsafe {
            std::ptr::copy_nonoverlapping(descs.as_ptr() as *const u8, self.host.as_ptr(), bytes)
        };
        // SAFETY: both buffers hold `bytes`; the pinned source stays untouched
        // until the event below completes.
        unsafe {
            self.stream
                .copy_htod(self.devbuf.ptr, self.host.as_ptr(), bytes)
        }?;
        // SAFETY: the descriptors were just queued for upload; the memory
        // they name is valid by the caller's contract.
        unsafe { self.launch_uploaded(descs.len()) }
    }

    /// Launches the kernel over the first `n` descriptors already uploaded
    /// (in stream order after the upload) and records the event.
    ///
    /// # Safety
    /// As [`Unpacker::launch`], for the uploaded descriptors.
    unsafe fn launch_uploaded(&mut self, n: usize) -> Result<(), CudaError> {
        let mut dptr = self.devbuf.ptr;
        let mut count = n as u32;
        let mut params = [
            &mut dptr as *mut u64 as *mut c_void,
            &mut count as *mut u32 as *mut c_void,
        ];
        let blocks = n.min(MAX_BLOCKS) as u32;
        // SAFETY: the function comes from a loaded module; the parameters
        // match the kernel's signature (pointer, unsigned int) and live across
        // the call (the driver copies them); the memory the descriptors name
        // is valid by the caller's contract.
        drv("cuLaunchKernel", unsafe {
            cu::launch_kernel(
                self.func.0,
                (blocks, 1, 1),
                (THREADS, 1, 1),
                0,
                self.stream.raw(),
                &mut params,
            )
        })?;
        self.event.record(&self.stream)?;
        self.in_flight = true;
        Ok(())
    }

    /// True once the last batch is done (or none was launched).
    pub fn poll(&mut self) -> Result<bool, CudaError> {
        if !self.in_flight {
            return Ok(true);
        }
        // SAFETY: the event is live until drop.
        let r = unsafe { sys::cuEventQuery(self.event.0) };
        match r {
            sys::CUresult::CUDA_SUCCESS => {
                self.in_flight = false;
                Ok(true)
            }
            sys::CUresult::CUDA_ERROR_NOT_READY => Ok(false),
            other => check("cuEventQuery", other).map(|_| false),
        }
    }

    /// Waits for the last batch.
    pub fn wait(&mut self) -> Result<(), CudaError> {
        if self.in_flight {
            self.event.synchronize()?;
            self.in_flight = false;
        }
        Ok(())
    }

    /// Queues a device-to-device copy on the same stream (for comparisons
    /// with the kernel) and records the event after it.
    ///
    /// # Safety
    /// Both ranges must be device memory of `len` bytes, valid until done.
    pub unsafe fn copy_dtod(&mut self, dst: u64, src: u64, len: usize) -> Result<(), CudaError> {
        self.dev.bind()?;
        // SAFETY: device ranges valid by the caller's contract; queued on our stream.
        check("cuMemcpyDtoDAsync", unsafe {
            sys::cuMemcpyDtoDAsync_v2(dst, src, len, self.stream.raw())
        })?;
        self.event.record(&self.stream)?;
        self.in_flight = true;
        Ok(())
    }
}

impl Drop for Unpacker {
    fn drop(&mut self) {
        // Never free descriptor buffers under a running kernel.
        if let Err(e) = self.wait() {
            tracing::warn!("unpack kernel did not finish cleanly: {e}");
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::{Rng, SeedableRng};

    /// A receive's worth of fragments: the destination `[0, dst_len)` cut
    /// into pieces of 1 B – 4 KiB, each placed in its own 4 KiB page of the
    /// source (pages in shuffled order) at a random offset.
    pub(crate) fn random_fragments(rng: &mut impl Rng, dst_len: usize) -> (Vec<LoadMeta>, usize) {
        let mut pieces = Vec::new();
        let mut off = 0usize;
        while off < dst_len {
            let l = rng.random_range(1..=4096usize).min(dst_len - off);
            pieces.push((off, l));
            off += l;
        }
        let mut pages: Vec<usize> = (0..pieces.len()).collect();
        for i in (1..pages.len()).rev() {
            pages.swap(i, rng.random_range(0..=i));
        }
        let frags = pieces
            .iter()
            .zip(&pages)
            .map(|(&(d, l), &p)| LoadMeta {
                src_off: (p * 4096 + rng.random_range(0..=4096 - l)) as u32,
                len: l as u32,
                dst_off: d as u64,
            })
            .collect();
        (frags, pieces.len() * 4096)
    }

    fn reference(src: &[u8], dst: &mut [u8], frags: &[LoadMeta]) {
        for f in frags {
            for i in 0..f.len as usize {
                dst[f.dst_off as usize + i] = src[f.src_off as usize + i];
            }
        }
    }

    #[test]
    fn host_unpack_matches_a_byte_copy() {
        let mut rng = rand::rngs::StdRng::seed_from_u64(7);
        for round in 0..40 {
            let dst_len = match round {
                0 => 0,
                1 => 1,
                2 => 4096,
                _ => rng.random_range(1..(1usize << 20)),
            };
            let (frags, src_len) = random_fragments(&mut rng, dst_len);
            let src: Vec<u8> = (0..src_len).map(|_| rng.random()).collect();
            let mut want = vec![0xEEu8; dst_len + 7];
            reference(&src, &mut want, &frags);
            let mut got = vec![0xEEu8; dst_len + 7];
            assert_eq!(unpack_host(&src, &mut got, &frags).unwrap(), dst_len);
            assert_eq!(got, want, "round {round}");
            let mut raw = vec![0xEEu8; dst_len + 7];
            // SAFETY: every fragment's source lies inside `src`.
            let n = unsafe { unpack_host_raw(src.as_ptr(), &mut raw, &frags) }.unwrap();
            assert_eq!(n, dst_len);
            assert_eq!(raw, want, "round {round} (raw)");
        }
    }

    #[test]
    fn out_of_bounds_fragments_are_refused_and_nothing_written() {
        let src = vec![1u8; 8192];
        let mut dst = vec![0u8; 100];
        let frags = [
            LoadMeta {
                src_off: 0,
                len: 10,
                dst_off: 0,
            },
            LoadMeta {
                src_off: 0,
                len: 10,
                dst_off: 95,
            },
        ];
        assert!(matches!(
            unpack_host(&src, &mut dst, &frags),
            Err(UnpackError::DstOverrun { index: 1, .. })
        ));
        assert!(dst.iter().all(|&b| b == 0));
        let frags = [LoadMeta {
            src_off: 8190,
            len: 10,
            dst_off: 0,
        }];
        assert!(matches!(
            unpack_host(&src, &mut dst, &frags),
            Err(UnpackError::SrcOverrun { .. })
        ));
        let huge = [LoadMeta {
            src_off: 0,
            len: 1,
            dst_off: u64::MAX,
        }];
        assert!(check_fragments(&huge, 100).is_err());
        // SAFETY: refused before any copy.
        assert!(unsafe { unpack_host_raw(src.as_ptr(), &mut dst, &huge) }.is_err());
    }

    #[test]
    fn descriptors_are_absolute_and_skip_empty_fragments() {
        let frags = [
            LoadMeta {
                src_off: 5,
                len: 3,
                dst_off: 9,
            },
            LoadMeta {
                src_off: 0,
                len: 0,
                dst_off: 0,
            },
        ];
        let mut v = Vec::new();
        push_descs(&frags, 1000, 2000, &mut v);
        assert_eq!(
            v,
            vec![CopyDesc {
                src: 1005,
                dst: 2009,
                len: 3,
                pad: 0
            }]
        );
        assert_eq!(std::mem::size_of::<CopyDesc>(), 24);
    }

    /// Uploads `src`, unpacks `frags` on the GPU, returns the destination.
    fn gpu_unpack(
        u: &mut Unpacker,
        src: &[u8],
        dst_init: &[u8],
        frags: &[LoadMeta],
    ) -> Result<Vec<u8>, CudaError> {
        let dev = u.device().clone();
        let s = DeviceBuf::new(&dev, src.len())?;
        let d = DeviceBuf::new(&dev, dst_init.len())?;
        // SAFETY: both device buffers hold the lengths copied.
        unsafe {
            super::super::copy_sync(s.ptr, src.as_ptr() as u64, src.len())?;
            super::super::copy_sync(d.ptr, dst_init.as_ptr() as u64, dst_init.len())?;
        }
        let mut descs = Vec::new();
        push_descs(frags, s.ptr, d.ptr, &mut descs);
        // SAFETY: the descriptors stay inside `s` and `d`, alive until `wait`.
        unsafe { u.launch(&descs) }?;
        u.wait()?;
        let mut out = vec![0u8; dst_init.len()];
        // SAFETY: `out` holds the device buffer's length.
        unsafe { super::super::copy_sync(out.as_mut_ptr() as u64, d.ptr, out.len()) }?;
        Ok(out)
    }

    /// An unpacker on GPU 0, or None (said so) without CUDA or NVRTC.
    fn gpu_unpacker() -> Option<Unpacker> {
        if !super::super::available() {
            eprintln!("skipped: no CUDA on this machine");
            return None;
        }
        match Unpacker::new(Device::get(0).unwrap()) {
            Ok(u) => Some(u),
            Err(CudaError::Nvrtc(e)) => {
                eprintln!("skipped: NVRTC unavailable: {e}");
                None
            }
            Err(e) => panic!("{e}"),
        }
    }

    /// The GPU unpack of `frags` from `src` over `init` equals the host's.
    fn assert_matches_host(
        u: &mut Unpacker,
        src: &[u8],
        init: &[u8],
        frags: &[LoadMeta],
        what: &str,
    ) {
        let mut want = init.to_vec();
        unpack_host(src, &mut want, frags).unwrap();
        let got = gpu_unpack(u, src, init, frags).unwrap();
        assert!(got == want, "{what}: GPU unpack differs from the host copy");
    }

    /// Fragments of up to 200 KiB (each block loops over many widths of
    /// its threads), at offsets that share their 16-byte phase or not,
    /// copied as the host copy does.
    #[test]
    fn gpu_unpack_of_large_fragments_matches_host_unpack() {
        let Some(mut u) = gpu_unpacker() else { return };
        let mut rng = rand::rngs::StdRng::seed_from_u64(12);
        for round in 0..10 {
            let (mut frags, mut dst_off, mut src_off) = (Vec::new(), 0u64, 0u32);
            for _ in 0..rng.random_range(1..40) {
                let len = rng.random_range(1..(200u32 << 10));
                // Half the fragments keep source and destination on the
                // same 16-byte phase; the rest are shifted apart.
                let skew = if rng.random() {
                    0
                } else {
                    rng.random_range(1..16)
                };
                src_off += rng.random_range(0..64u32) * 16 + skew;
                dst_off += rng.random_range(0..64u64) * 16;
                frags.push(LoadMeta {
                    src_off,
                    len,
                    dst_off,
                });
                src_off += len;
                dst_off += u64::from(len);
            }
            let src: Vec<u8> = (0..src_off as usize).map(|_| rng.random()).collect();
            let init = vec![0xA5u8; dst_off as usize + 31];
            assert_matches_host(
                &mut u,
                &src,
                &init,
                &frags,
                &format!("round {round}, large fragments"),
            );
        }
    }

    #[test]
    fn gpu_unpack_matches_host_unpack() {
        let Some(mut u) = gpu_unpacker() else { return };
        let mut rng = rand::rngs::StdRng::seed_from_u64(11);
        for round in 0..20 {
            let dst_len = rng.random_range(1..(4usize << 20));
            let (frags, src_len) = random_fragments(&mut rng, dst_len);
            let src: Vec<u8> = (0..src_len).map(|_| rng.random()).collect();
            let init = vec![0x5Au8; dst_len + 13];
            assert_matches_host(&mut u, &src, &init, &frags, &format!("round {round}"));
        }
    }

    /// The GPU check of `benchmarks/gpu_plugin_check.sh`: correctness on
    /// random fragment lists, then the kernel's GB/s beside a device-to-device
    /// memcpy of the same bytes. Writes JSON to `$UNPACK_CHECK_OUT` (or prints it).
    #[test]
    #[ignore = "needs a GPU; run by benchmarks/gpu_plugin_check.sh"]
    fn gpu_unpack_check_and_bandwidth() {
        use std::fmt::Write as _;
        use std::time::Instant;
        let mut json = String::from("{\n");
        if !super::super::available() {
            json.push_str("  \"skipped\": \"no CUDA\"\n}\n");
            emit(&json);
            return;
        }
        let dev = Device::get(0).unwrap();
        let mut u = Unpacker::new(dev.clone()).expect("unpacker");
        let mut rng = rand::rngs::StdRng::seed_from_u64(2024);
        // Correctness: 50 random receives up to 4 MiB.
        let mut checked = 0usize;
        for _ in 0..50 {
            let dst_len = rng.random_range(1..=(4usize << 20));
            let (frags, src_len) = random_fragments(&mut rng, dst_len);
            let src: Vec<u8> = (0..src_len).map(|_| rng.random()).collect();
            let init = vec![0xA5u8; dst_len + 64];
            let mut want = init.clone();
            unpack_host(&src, &mut want, &frags).unwrap();
            let got = gpu_unpack(&mut u, &src, &init, &frags).unwrap();
            assert!(got == want, "GPU unpack differs from the host copy");
            checked += 1;
        }
        let _ = writeln!(json, "  \"device\": \"GPU 0 ({})\",", dev.bdf);
        let _ = writeln!(json, "  \"correctness_receives_checked\": {checked},");
        let _ = writeln!(json, "  \"correct\": true,");
        let _ = writeln!(json, "  \"bandwidth\": [");
        // Bandwidth: a batch of 16 receives of `each` bytes in one launch.
        let cases: [(usize, &str); 3] = [
            (4 << 20, "random 1B-4KiB fragments, unaligned"),
            (4 << 20, "whole 4 KiB pages, aligned"),
            (512 << 10, "random 1B-4KiB fragments, unaligned"),
        ];
        for (ci, &(each, what)) in cases.iter().enumerate() {
            let nrecv = 16;
            let mut all = Vec::new();
            let mut src_len = 0usize;
            for r in 0..nrecv {
                let (mut frags, sl) = if what.starts_with("whole") {
                    let n = each / 4096;
                    let mut pages: Vec<usize> = (0..n).collect();
                    for i in (1..n).rev() {
                        pages.swap(i, rng.random_range(0..=i));
                    }
                    let f = (0..n)
                        .map(|i| LoadMeta {
                            src_off: (pages[i] * 4096) as u32,
                            len: 4096,
                            dst_off: (i * 4096) as u64,
                        })
                        .collect::<Vec<_>>();
                    (f, n * 4096)
                } else {
                    random_fragments(&mut rng, each)
                };
                for f in &mut frags {
                    f.src_off += src_len as u32;
                    f.dst_off += (r * each) as u64;
                }
                src_len += sl;
                all.extend(frags);
            }
            let total = nrecv * each;
            let s = DeviceBuf::new(&dev, src_len).unwrap();
            let d = DeviceBuf::new(&dev, total).unwrap();
            let d2 = DeviceBuf::new(&dev, total).unwrap();
            let mut descs = Vec::new();
            push_descs(&all, s.ptr, d.ptr, &mut descs);
            let iters = 50;
            // SAFETY: descriptors stay inside `s` and `d`, alive throughout.
            unsafe { u.launch(&descs) }.unwrap();
            u.wait().unwrap();
            let t = Instant::now();
            for _ in 0..iters {
                // SAFETY: relaunches the descriptors uploaded just above.
                unsafe { u.launch_uploaded(descs.len()) }.unwrap();
            }
            u.wait().unwrap();
            let kernel = t.elapsed().as_secs_f64();
            // SAFETY: `d2` holds `total` bytes and `s` holds `src_len` ≥ `total`.
            unsafe { u.copy_dtod(d2.ptr, s.ptr, total) }.unwrap();
            u.wait().unwrap();
            let t = Instant::now();
            for _ in 0..iters {
                // SAFETY: as above.
                unsafe { u.copy_dtod(d2.ptr, s.ptr, total) }.unwrap();
            }
            u.wait().unwrap();
            let memcpy = t.elapsed().as_secs_f64();
            let gbs = |secs: f64| (total * iters) as f64 / secs / 1e9;
            let _ = writeln!(
                json,
                "    {{\"case\": \"{what}\", \"bytes_per_launch\": {total}, \"fragments_per_launch\": {}, \"receives_per_launch\": {nrecv}, \"unpack_kernel_gbps\": {:.2}, \"memcpy_dtod_gbps\": {:.2}}}{}",
                descs.len(),
                gbs(kernel),
                gbs(memcpy),
                if ci + 1 < cases.len() { "," } else { "" }
            );
        }
        json.push_str("  ]\n}\n");
        emit(&json);
    }

    fn emit(json: &str) {
        match std::env::var("UNPACK_CHECK_OUT") {
            Ok(p) if !p.is_empty() => std::fs::write(&p, json).expect("writing the JSON"),
            _ => {}
        }
        println!("{json}");
    }
}
