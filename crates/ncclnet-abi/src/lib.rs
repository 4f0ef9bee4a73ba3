//! The ncclNet plugin ABI, v7 and v8, as `#[repr(C)]` definitions: the one
//! copy both the engine's plugin loader (`tcpx-p2p`, `net::plugin`) and the
//! stand-in plugin (`crates/nccl-net-emu`) are built from. It depends on
//! nothing, so the stand-in does not depend on the engine. Facts from
//! `reference/ncclnet-and-tcpx.md`; every layout is checked by the tests at
//! the bottom (x86_64 / aarch64 Linux: LP64).
//!
//! Nothing here does anything: only types and constants.

use std::ffi::{c_char, c_int, c_ulong, c_void};

/// `ncclResult_t`: every plugin function returns one.
pub type NcclResult = c_int;

pub const NCCL_SUCCESS: NcclResult = 0;
pub const NCCL_UNHANDLED_CUDA_ERROR: NcclResult = 1;
pub const NCCL_SYSTEM_ERROR: NcclResult = 2;
pub const NCCL_INTERNAL_ERROR: NcclResult = 3;
pub const NCCL_INVALID_ARGUMENT: NcclResult = 4;
pub const NCCL_INVALID_USAGE: NcclResult = 5;
pub const NCCL_REMOTE_ERROR: NcclResult = 6;
pub const NCCL_IN_PROGRESS: NcclResult = 7;

/// Pointer kinds of `regMr` and `ptrSupport`.
pub const NCCL_PTR_HOST: c_int = 0x1;
pub const NCCL_PTR_CUDA: c_int = 0x2;
pub const NCCL_PTR_DMABUF: c_int = 0x4;

/// Size of the opaque handle `listen` writes and `connect` reads.
pub const NCCL_NET_HANDLE_MAXSIZE: usize = 128;

/// `ncclNetDeviceType`.
pub const NCCL_NET_DEVICE_HOST: c_int = 0;
pub const NCCL_NET_DEVICE_UNPACK: c_int = 1;
/// The only UNPACK version NCCL (2.19 to today) accepts.
pub const NCCL_NET_DEVICE_UNPACK_VERSION: c_int = 0x7;

/// Queue slots of an UNPACK receive comm (one per outstanding receive).
pub const NET_UNPACK_MAX_QUEUE_DEPTH: usize = 16;
/// Fragments one receive may carry.
pub const NET_UNPACK_MAX_SLICE_PAGES: usize = 2048;
/// Bounce pages are 4 KiB.
pub const NET_UNPACK_PAGE_SIZE: usize = 4096;

/// Log levels of `ncclDebugLogger_t`.
pub const NCCL_LOG_NONE: c_int = 0;
pub const NCCL_LOG_VERSION: c_int = 1;
pub const NCCL_LOG_WARN: c_int = 2;
pub const NCCL_LOG_INFO: c_int = 3;
pub const NCCL_LOG_ABORT: c_int = 4;
pub const NCCL_LOG_TRACE: c_int = 5;
/// Log subsystem flags (`ncclDebugLogSubSys`), the two a net plugin uses.
pub const NCCL_INIT: c_ulong = 0x1;
pub const NCCL_NET: c_ulong = 0x10;

/// `ncclDebugLogger_t`: `void (*)(int level, unsigned long flags, const char*
/// file, int line, const char* fmt, ...)`. A caller that passes no variadic
/// arguments must escape `%` in `fmt` as `%%`.
pub type NcclDebugLogger =
    unsafe extern "C" fn(c_int, c_ulong, *const c_char, c_int, *const c_char, ...);

/// `ncclNetProperties_v7_t`.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct NcclNetPropertiesV7 {
    pub name: *mut c_char,
    pub pci_path: *mut c_char,
    pub guid: u64,
    pub ptr_support: c_int,
    /// Mbps.
    pub speed: c_int,
    pub port: c_int,
    pub latency: f32,
    pub max_comms: c_int,
    pub max_recvs: c_int,
    pub net_device_type: c_int,
    pub net_device_version: c_int,
}

/// `ncclNetProperties_v8_t`: v7 with `regIsGlobal` after `ptrSupport`.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct NcclNetPropertiesV8 {
    pub name: *mut c_char,
    pub pci_path: *mut c_char,
    pub guid: u64,
    pub ptr_support: c_int,
    pub reg_is_global: c_int,
    pub speed: c_int,
    pub port: c_int,
    pub latency: f32,
    pub max_comms: c_int,
    pub max_recvs: c_int,
    pub net_device_type: c_int,
    pub net_device_version: c_int,
}

/// `ncclNetDeviceHandle_v7_t` (also v8's).
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct NcclNetDeviceHandleV7 {
    pub net_device_type: c_int,
    pub net_device_version: c_int,
    /// For UNPACK: a device pointer to an [`UnpackNetDeviceHandle`].
    pub handle: *mut c_void,
    pub size: usize,
    pub needs_proxy_progress: c_int,
}

/// `loadMeta`: one fragment of an UNPACK receive, `len` bytes from
/// `bounce_buf + src_off` to `dst + dst_off` (read by the engine's unpack
/// code, `tcpx-p2p-gpu`'s `unpack`).
#[repr(C, align(16))]
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct LoadMeta {
    pub src_off: u32,
    pub len: u32,
    pub dst_off: u64,
}

/// `netUnpackMeta`: 16 queue slots of up to 2048 fragments, and a count per
/// slot. Lives in memory both host and device can read.
#[repr(C)]
pub struct NetUnpackMeta {
    pub mem: [[LoadMeta; NET_UNPACK_MAX_SLICE_PAGES]; NET_UNPACK_MAX_QUEUE_DEPTH],
    pub cnt: [u64; NET_UNPACK_MAX_QUEUE_DEPTH],
}

/// `unpackNetDeviceHandle`, what an UNPACK device handle's `handle` points at.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct UnpackNetDeviceHandle {
    pub meta: *mut NetUnpackMeta,
    pub bounce_buf: *mut c_void,
    /// Starts at `u64::MAX`; NCCL's kernel increments it before each unpack.
    pub head: u64,
}

type Comm = *mut c_void;
type DevHandle = *mut *mut NcclNetDeviceHandleV7;

/// `ncclNet_v7_t`, in field order.
#[repr(C)]
#[derive(Clone, Copy)]
pub struct NcclNetV7 {
    pub name: *const c_char,
    pub init: Option<unsafe extern "C" fn(logger: Option<NcclDebugLogger>) -> NcclResult>,
    pub devices: Option<unsafe extern "C" fn(ndev: *mut c_int) -> NcclResult>,
    pub get_properties:
        Option<unsafe extern "C" fn(dev: c_int, props: *mut NcclNetPropertiesV7) -> NcclResult>,
    pub listen: Option<
        unsafe extern "C" fn(dev: c_int, handle: *mut c_void, listen: *mut Comm) -> NcclResult,
    >,
    pub connect: Option<
        unsafe extern "C" fn(
            dev: c_int,
            handle: *mut c_void,
            send: *mut Comm,
            send_dev: DevHandle,
        ) -> NcclResult,
    >,
    pub accept: Option<
        unsafe extern "C" fn(listen: Comm, recv: *mut Comm, recv_dev: DevHandle) -> NcclResult,
    >,
    pub reg_mr: Option<
        unsafe extern "C" fn(
            comm: Comm,
            data: *mut c_void,
            size: c_int,
            ty: c_int,
            mhandle: *mut *mut c_void,
        ) -> NcclResult,
    >,
    pub reg_mr_dma_buf: Option<
        unsafe extern "C" fn(
            comm: Comm,
            data: *mut c_void,
            size: usize,
            ty: c_int,
            offset: u64,
            fd: c_int,
            mhandle: *mut *mut c_void,
        ) -> NcclResult,
    >,
    pub dereg_mr: Option<unsafe extern "C" fn(comm: Comm, mhandle: *mut c_void) -> NcclResult>,
    pub isend: Option<
        unsafe extern "C" fn(
            send: Comm,
            data: *mut c_void,
            size: c_int,
            tag: c_int,
            mhandle: *mut c_void,
            request: *mut *mut c_void,
        ) -> NcclResult,
    >,
    pub irecv: Option<
        unsafe extern "C" fn(
            recv: Comm,
            n: c_int,
            data: *mut *mut c_void,
            sizes: *mut c_int,
            tags: *mut c_int,
            mhandles: *mut *mut c_void,
            request: *mut *mut c_void,
        ) -> NcclResult,
    >,
    pub iflush: Option<
        unsafe extern "C" fn(
            recv: Comm,
            n: c_int,
            data: *mut *mut c_void,
            sizes: *mut c_int,
            mhandles: *mut *mut c_void,
            request: *mut *mut c_void,
        ) -> NcclResult,
    >,
    pub test: Option<
        unsafe extern "C" fn(
            request: *mut c_void,
            done: *mut c_int,
            sizes: *mut c_int,
        ) -> NcclResult,
    >,
    pub close_send: Option<unsafe extern "C" fn(send: Comm) -> NcclResult>,
    pub close_recv: Option<unsafe extern "C" fn(recv: Comm) -> NcclResult>,
    pub close_listen: Option<unsafe extern "C" fn(listen: Comm) -> NcclResult>,
    pub get_device_mr: Option<
        unsafe extern "C" fn(
            comm: Comm,
            mhandle: *mut c_void,
            dptr: *mut *mut c_void,
        ) -> NcclResult,
    >,
    pub irecv_consumed:
        Option<unsafe extern "C" fn(recv: Comm, n: c_int, request: *mut c_void) -> NcclResult>,
}

/// `ncclNet_v8_t`: v7 with v8 properties and a `size_t` size in `regMr`.
#[repr(C)]
#[derive(Clone, Copy)]
pub struct NcclNetV8 {
    pub name: *const c_char,
    pub init: Option<unsafe extern "C" fn(logger: Option<NcclDebugLogger>) -> NcclResult>,
    pub devices: Option<unsafe extern "C" fn(ndev: *mut c_int) -> NcclResult>,
    pub get_properties:
        Option<unsafe extern "C" fn(dev: c_int, props: *mut NcclNetPropertiesV8) -> NcclResult>,
    pub listen: Option<
        unsafe extern "C" fn(dev: c_int, handle: *mut c_void, listen: *mut Comm) -> NcclResult,
    >,
    pub connect: Option<
        unsafe extern "C" fn(
            dev: c_int,
            handle: *mut c_void,
            send: *mut Comm,
            send_dev: DevHandle,
        ) -> NcclResult,
    >,
    pub accept: Option<
        unsafe extern "C" fn(listen: Comm, recv: *mut Comm, recv_dev: DevHandle) -> NcclResult,
    >,
    pub reg_mr: Option<
        unsafe extern "C" fn(
            comm: Comm,
            data: *mut c_void,
            size: usize,
            ty: c_int,
            mhandle: *mut *mut c_void,
        ) -> NcclResult,
    >,
    pub reg_mr_dma_buf: Option<
        unsafe extern "C" fn(
            comm: Comm,
            data: *mut c_void,
            size: usize,
            ty: c_int,
            offset: u64,
            fd: c_int,
            mhandle: *mut *mut c_void,
        ) -> NcclResult,
    >,
    pub dereg_mr: Option<unsafe extern "C" fn(comm: Comm, mhandle: *mut c_void) -> NcclResult>,
    pub isend: Option<
        unsafe extern "C" fn(
            send: Comm,
            data: *mut c_void,
            size: c_int,
            tag: c_int,
            mhandle: *mut c_void,
            request: *mut *mut c_void,
        ) -> NcclResult,
    >,
    pub irecv: Option<
        unsafe extern "C" fn(
            recv: Comm,
            n: c_int,
            data: *mut *mut c_void,
            sizes: *mut c_int,
            tags: *mut c_int,
            mhandles: *mut *mut c_void,
            request: *mut *mut c_void,
        ) -> NcclResult,
    >,
    pub iflush: Option<
        unsafe extern "C" fn(
            recv: Comm,
            n: c_int,
            data: *mut *mut c_void,
            sizes: *mut c_int,
            mhandles: *mut *mut c_void,
            request: *mut *mut c_void,
        ) -> NcclResult,
    >,
    pub test: Option<
        unsafe extern "C" fn(
            request: *mut c_void,
            done: *mut c_int,
            sizes: *mut c_int,
        ) -> NcclResult,
    >,
    pub close_send: Option<unsafe extern "C" fn(send: Comm) -> NcclResult>,
    pub close_recv: Option<unsafe extern "C" fn(recv: Comm) -> NcclResult>,
    pub close_listen: Option<unsafe extern "C" fn(listen: Comm) -> NcclResult>,
    pub get_device_mr: Option<
        unsafe extern "C" fn(
            comm: Comm,
            mhandle: *mut c_void,
            dptr: *mut *mut c_void,
        ) -> NcclResult,
    >,
    pub irecv_consumed:
        Option<unsafe extern "C" fn(recv: Comm, n: c_int, request: *mut c_void) -> NcclResult>,
}

// SAFETY: a table is immutable after construction: a pointer to a static
// NUL-terminated name and plain function pointers, safe to share.
unsafe impl Sync for NcclNetV7 {}
// SAFETY: as above.
unsafe impl Send for NcclNetV7 {}
// SAFETY: as above.
unsafe impl Sync for NcclNetV8 {}
// SAFETY: as above.
unsafe impl Send for NcclNetV8 {}

/// The exported symbol names, newest first.
pub const SYMBOL_V8: &str = "ncclNetPlugin_v8";
pub const SYMBOL_V7: &str = "ncclNetPlugin_v7";

#[cfg(test)]
mod tests {
    use super::*;
    use std::mem::{align_of, offset_of, size_of};

    #[test]
    fn properties_v7_layout() {
        assert_eq!(size_of::<NcclNetPropertiesV7>(), 56);
        assert_eq!(offset_of!(NcclNetPropertiesV7, name), 0);
        assert_eq!(offset_of!(NcclNetPropertiesV7, pci_path), 8);
        assert_eq!(offset_of!(NcclNetPropertiesV7, guid), 16);
        assert_eq!(offset_of!(NcclNetPropertiesV7, ptr_support), 24);
        assert_eq!(offset_of!(NcclNetPropertiesV7, speed), 28);
        assert_eq!(offset_of!(NcclNetPropertiesV7, port), 32);
        assert_eq!(offset_of!(NcclNetPropertiesV7, latency), 36);
        assert_eq!(offset_of!(NcclNetPropertiesV7, max_comms), 40);
        assert_eq!(offset_of!(NcclNetPropertiesV7, max_recvs), 44);
        assert_eq!(offset_of!(NcclNetPropertiesV7, net_device_type), 48);
        assert_eq!(offset_of!(NcclNetPropertiesV7, net_device_version), 52);
    }

    #[test]
    fn properties_v8_layout() {
        assert_eq!(size_of::<NcclNetPropertiesV8>(), 64);
        assert_eq!(offset_of!(NcclNetPropertiesV8, ptr_support), 24);
        assert_eq!(offset_of!(NcclNetPropertiesV8, reg_is_global), 28);
        assert_eq!(offset_of!(NcclNetPropertiesV8, speed), 32);
        assert_eq!(offset_of!(NcclNetPropertiesV8, port), 36);
        assert_eq!(offset_of!(NcclNetPropertiesV8, latency), 40);
        assert_eq!(offset_of!(NcclNetPropertiesV8, max_comms), 44);
        assert_eq!(offset_of!(NcclNetPropertiesV8, max_recvs), 48);
        assert_eq!(offset_of!(NcclNetPropertiesV8, net_device_type), 52);
        assert_eq!(offset_of!(NcclNetPropertiesV8, net_device_version), 56);
    }

    #[test]
    fn device_handle_layout() {
        assert_eq!(size_of::<NcclNetDeviceHandleV7>(), 32);
        assert_eq!(offset_of!(NcclNetDeviceHandleV7, net_device_type), 0);
        assert_eq!(offset_of!(NcclNetDeviceHandleV7, net_device_version), 4);
        assert_eq!(offset_of!(NcclNetDeviceHandleV7, handle), 8);
        assert_eq!(offset_of!(NcclNetDeviceHandleV7, size), 16);
        assert_eq!(offset_of!(NcclNetDeviceHandleV7, needs_proxy_progress), 24);
    }

    #[test]
    fn unpack_layouts() {
        assert_eq!(size_of::<LoadMeta>(), 16);
        assert_eq!(align_of::<LoadMeta>(), 16);
        assert_eq!(offset_of!(LoadMeta, src_off), 0);
        assert_eq!(offset_of!(LoadMeta, len), 4);
        assert_eq!(offset_of!(LoadMeta, dst_off), 8);
        assert_eq!(offset_of!(NetUnpackMeta, mem), 0);
        assert_eq!(offset_of!(NetUnpackMeta, cnt), 16 * 2048 * 16);
        assert_eq!(size_of::<NetUnpackMeta>(), 16 * 2048 * 16 + 16 * 8);
        assert_eq!(size_of::<UnpackNetDeviceHandle>(), 24);
        assert_eq!(offset_of!(UnpackNetDeviceHandle, meta), 0);
        assert_eq!(offset_of!(UnpackNetDeviceHandle, bounce_buf), 8);
        assert_eq!(offset_of!(UnpackNetDeviceHandle, head), 16);
    }

    #[test]
    fn table_layouts() {
        // 19 pointer-sized fields, in the reference's order.
        assert_eq!(size_of::<NcclNetV7>(), 19 * 8);
        assert_eq!(size_of::<NcclNetV8>(), 19 * 8);
        assert_eq!(offset_of!(NcclNetV7, name), 0);
        assert_eq!(offset_of!(NcclNetV7, init), 8);
        assert_eq!(offset_of!(NcclNetV7, devices), 16);
        assert_eq!(offset_of!(NcclNetV7, get_properties), 24);
        assert_eq!(offset_of!(NcclNetV7, listen), 32);
        assert_eq!(offset_of!(NcclNetV7, connect), 40);
        assert_eq!(offset_of!(NcclNetV7, accept), 48);
        assert_eq!(offset_of!(NcclNetV7, reg_mr), 56);
        assert_eq!(offset_of!(NcclNetV7, reg_mr_dma_buf), 64);
        assert_eq!(offset_of!(NcclNetV7, dereg_mr), 72);
        assert_eq!(offset_of!(NcclNetV7, isend), 80);
        assert_eq!(offset_of!(NcclNetV7, irecv), 88);
        assert_eq!(offset_of!(NcclNetV7, iflush), 96);
        assert_eq!(offset_of!(NcclNetV7, test), 104);
        assert_eq!(offset_of!(NcclNetV7, close_send), 112);
        assert_eq!(offset_of!(NcclNetV7, close_recv), 120);
        assert_eq!(offset_of!(NcclNetV7, close_listen), 128);
        assert_eq!(offset_of!(NcclNetV7, get_device_mr), 136);
        assert_eq!(offset_of!(NcclNetV7, irecv_consumed), 144);
        assert_eq!(offset_of!(NcclNetV8, reg_mr), 56);
        assert_eq!(offset_of!(NcclNetV8, irecv_consumed), 144);
        // Nullable function pointers are one pointer wide.
        assert_eq!(size_of::<Option<NcclDebugLogger>>(), 8);
    }
}
