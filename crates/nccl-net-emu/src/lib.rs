//! `nccl-net-emu`: a stand-in for Google's GPUDirect-TCPX ncclNet plugin,
//! over plain TCP sockets, so that every line of the engine's plugin path
//! (and NCCL itself) can run without A3 hardware.
//!
//! It exports `ncclNetPlugin_v7` only, as TCPX does (with the cargo feature
//! `v8`, a separate build, `ncclNetPlugin_v8` too), both built from the one
//! copy of the ABI that the engine's loader reads too (the `ncclnet-abi`
//! crate; the stand-in does not depend on the engine), and behaves as TCPX
//! does (`reference/ncclnet-and-tcpx.md`), never more kindly unless a
//! setting whose name says `LENIENT` asks for it:
//!
//! - data moves only inside `test`: each call schedules the next bytes of
//!   one request, at most `MAX_TASKS` chunks of `NCCL_DYNAMIC_CHUNK_SIZE`
//!   per data socket beyond what has moved, and the I/O threads move only
//!   those (`comm::Gate`); with TCPX's default chunk size 0, sends never
//!   finish;
//! - connect hands out its comm only after the peer's accept has run;
//!   accept takes 100 ms per socket, then waits for flow steering
//!   (`NCCL_GPUDIRECTTCPX_PROGRAM_FLOW_STEERING_WAIT_MICROS`, 5 s by
//!   default);
//! - one device per interface of `NCCL_GPUDIRECTTCPX_SOCKET_IFNAME`, named
//!   after it, with its PCI path and speed;
//! - `test` writes no size in UNPACK mode; `irecvConsumed` out of order or
//!   before done is internal error (3); a receive comm whose accept got no
//!   device-handle storage fails its first `irecv` (TCPX crashes there);
//! - at most 16 requests per comm, the 17th `isend`/`irecv` fails with
//!   internal error (3); `test` only on a comm's oldest unfinished request;
//!   a receive holds its slot until `irecvConsumed`, which must come in
//!   FIFO order; `irecv` takes `n == 1`; GPU `regMr` needs a 4 KiB-aligned
//!   pointer and a 4 KiB-multiple size; `iflush` is an error in UNPACK mode; connect and accept return
//!   a NULL comm on their first call(s). Each broken rule is logged loudly
//!   (WARN through NCCL's logger, and on stderr).
//! - UNPACK mode (`NCCL_NET_EMU_UNPACK=1`, the default): the payload of a
//!   receive lands in a bounce pool in 4 KiB pages in shuffled order, with
//!   `loadMeta` entries and a count in the comm's `netUnpackMeta` slot
//!   (posting order mod 16). The pool is on the GPU that is current on the
//!   thread calling `accept` (one pool per GPU, shared by all receive
//!   comms), the meta in host memory mapped for that GPU, and the device
//!   handle's `handle` is a device pointer to `{meta, bounce_buf, head=-1}`.
//!   With no GPU current at accept (host mode) the pool and the meta are in
//!   host memory and `handle` is a *host* pointer to the same struct: the
//!   one deviation from TCPX, so that the unpack logic runs without a GPU.
//!   `test` reports no size in UNPACK mode (TCPX does not).
//! - Plain mode (`NCCL_NET_EMU_UNPACK=0`): the payload goes straight into
//!   the receive buffer (a CUDA copy for GPU memory); `test` reports sizes.
//! - GPU payloads cross pinned host buffers (TCPX's NIC reaches GPU
//!   memory directly; a plain socket cannot), pipelined as the socket
//!   net's are (see [`stage`]): copies out run ahead of the writes, copies
//!   in land while the next message is read, so the plugin net is compared
//!   with the socket net without a cost TCPX does not have.
//! - Faults by environment variable: see [`config`].
//!
//! Every entry point catches panics and returns an error code. This crate
//! is an FFI edge: `unsafe` is used throughout, each block says why.

use std::ffi::{c_char, c_int, c_void, CString};
use std::panic::{catch_unwind, AssertUnwindSafe};

use ncclnet_abi::*;
use parking_lot::Mutex;

pub mod comm;
pub mod config;
pub mod cuda;
pub mod pool;
pub mod stage;

use comm::{error, Fail};

/// The plugin's name (the `name` of both tables).
pub const PLUGIN_NAME: &str = "NcclNetEmu";

static LOGGER: Mutex<Option<NcclDebugLogger>> = Mutex::new(None);

fn log(level: c_int, msg: &str) {
    let logger = *LOGGER.lock();
    let line = format!("NET/EMU : {msg}");
    match logger {
        Some(f) => {
            let fmt = CString::new(line.replace('%', "%%").replace('\0', " ")).unwrap_or_default();
            // SAFETY: NCCL's logger takes a printf format; `%` is escaped and
            // no variadic argument is passed, so none is read.
            unsafe { f(level, NCCL_NET, c"nccl-net-emu".as_ptr(), 0, fmt.as_ptr()) };
        }
        None if level == NCCL_LOG_WARN => eprintln!("{line}"),
        None => {}
    }
}

pub(crate) fn info(msg: &str) {
    log(NCCL_LOG_INFO, msg);
}

static TRACE: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);

/// One line per data-path call when `NCCL_NET_EMU_TRACE=1` (read at init).
pub(crate) fn trace(msg: impl FnOnce() -> String) {
    if TRACE.load(std::sync::atomic::Ordering::Relaxed) {
        log(NCCL_LOG_INFO, &format!("trace: {}", msg()));
    }
}

pub(crate) fn warn(msg: &str) {
    log(NCCL_LOG_WARN, msg);
}

/// A broken TCPX rule: WARN, and always on stderr.
pub(crate) fn violation_log(msg: &str) {
    let line = format!("TCPX RULE VIOLATION: {msg}");
    if LOGGER.lock().is_some() {
        log(NCCL_LOG_WARN, &line);
    }
    eprintln!("NET/EMU : {line}");
}

/// Runs an entry point: its error becomes a code and a log line, a panic
/// becomes internal error.
fn guard(call: &str, f: impl FnOnce() -> Result<(), Fail>) -> NcclResult {
    match catch_unwind(AssertUnwindSafe(f)) {
        Ok(Ok(())) => NCCL_SUCCESS,
        Ok(Err(fail)) => {
            if fail.loud {
                violation_log(&format!("{call}: {}", fail.msg));
            } else {
                warn(&format!("{call}: {}", fail.msg));
            }
            fail.code
        }
        Err(_) => {
            warn(&format!("{call}: panicked (a bug in the stand-in)"));
            NCCL_INTERNAL_ERROR
        }
    }
}

fn nonnull<T>(p: *mut T, what: &str) -> Result<*mut T, Fail> {
    if p.is_null() {
        Err(error(NCCL_INVALID_ARGUMENT, format!("{what} is NULL")))
    } else {
        Ok(p)
    }
}

unsafe extern "C" fn init(logger: Option<NcclDebugLogger>) -> NcclResult {
    guard("init", || {
        *LOGGER.lock() = logger;
        let cfg = config::EmuConfig::from_env();
        TRACE.store(cfg.trace, std::sync::atomic::Ordering::Relaxed);
        if cfg.chunk == 0 && !cfg.lenient_progress {
            violation_log("NCCL_DYNAMIC_CHUNK_SIZE is unset or 0: as in TCPX, no send will ever finish (GCP sets 524288)");
        }
        let devs: Vec<String> = config::devices()
            .iter()
            .map(|d| format!("{} ({})", d.name, d.addr))
            .collect();
        info(&format!(
            "init: {} mode, devices {}, CUDA {}",
            if cfg.unpack { "UNPACK" } else { "plain" },
            devs.join(", "),
            if tcpx_p2p_gpu::available() {
                "available"
            } else {
                "absent"
            }
        ));
        Ok(())
    })
}

unsafe extern "C" fn devices(ndev: *mut c_int) -> NcclResult {
    guard("devices", || {
        let p = nonnull(ndev, "ndev")?;
        let n = config::devices().len() as c_int;
        // SAFETY: the caller passes a pointer to one int.
        unsafe { p.write(n) };
        Ok(())
    })
}

/// A C string that lives as long as the process (device names and PCI
/// paths handed out by getProperties; one copy per distinct string).
fn interned(s: &str) -> *mut c_char {
    static STRINGS: Mutex<Vec<CString>> = Mutex::new(Vec::new());
    let mut all = STRINGS.lock();
    let c = CString::new(s.replace('\0', " ")).unwrap_or_default();
    if let Some(k) = all.iter().find(|k| **k == c) {
        return k.as_ptr() as *mut c_char;
    }
    let p = c.as_ptr() as *mut c_char;
    all.push(c);
    p
}

/// A device's properties (v8 layout; v7 drops `regIsGlobal`).
fn props(dev: c_int) -> Result<NcclNetPropertiesV8, Fail> {
    let d = comm::device(dev, "getProperties")?;
    let unpack = config::EmuConfig::from_env().unpack;
    Ok(NcclNetPropertiesV8 {
        name: interned(&d.name),
        pci_path: d.pci_path.as_deref().map_or(std::ptr::null_mut(), interned),
        guid: 0x454d_5530 + dev as u64,
        ptr_support: NCCL_PTR_HOST | NCCL_PTR_CUDA,
        reg_is_global: 0,
        speed: d.speed_mbps,
        port: 0,
        latency: 0.0,
        max_comms: 65536,
        max_recvs: 1,
        net_device_type: if unpack {
            NCCL_NET_DEVICE_UNPACK
        } else {
            NCCL_NET_DEVICE_HOST
        },
        net_device_version: if unpack {
            NCCL_NET_DEVICE_UNPACK_VERSION
        } else {
            0
        },
    })
}

unsafe extern "C" fn get_properties_v7(dev: c_int, out: *mut NcclNetPropertiesV7) -> NcclResult {
    guard("getProperties", || {
        let out = nonnull(out, "props")?;
        let p = props(dev)?;
        let v7 = NcclNetPropertiesV7 {
            name: p.name,
            pci_path: p.pci_path,
            guid: p.guid,
            ptr_support: p.ptr_support,
            speed: p.speed,
            port: p.port,
            latency: p.latency,
            max_comms: p.max_comms,
            max_recvs: p.max_recvs,
            net_device_type: p.net_device_type,
            net_device_version: p.net_device_version,
        };
        // SAFETY: the caller passes storage for one v7 properties struct.
        unsafe { out.write(v7) };
        Ok(())
    })
}

#[cfg(feature = "v8")]
unsafe extern "C" fn get_properties_v8(dev: c_int, out: *mut NcclNetPropertiesV8) -> NcclResult {
    guard("getProperties", || {
        let out = nonnull(out, "props")?;
        let p = props(dev)?;
        // SAFETY: the caller passes storage for one v8 properties struct.
        unsafe { out.write(p) };
        Ok(())
    })
}

unsafe extern "C" fn listen(
    dev: c_int,
    handle: *mut c_void,
    listen_comm: *mut *mut c_void,
) -> NcclResult {
    guard("listen", || {
        let h = nonnull(handle as *mut [u8; NCCL_NET_HANDLE_MAXSIZE], "handle")?;
        let out = nonnull(listen_comm, "listenComm")?;
        // SAFETY: the handle buffer holds NCCL_NET_HANDLE_MAXSIZE bytes.
        let t = comm::listen(dev, unsafe { &mut *h })?;
        // SAFETY: `out` points at one pointer.
        unsafe { out.write(t as *mut c_void) };
        Ok(())
    })
}

unsafe extern "C" fn connect(
    dev: c_int,
    handle: *mut c_void,
    send_comm: *mut *mut c_void,
    _send_dev: *mut *mut NcclNetDeviceHandleV7,
) -> NcclResult {
    guard("connect", || {
        let h = nonnull(handle as *mut [u8; NCCL_NET_HANDLE_MAXSIZE], "handle")?;
        let out = nonnull(send_comm, "sendComm")?;
        // SAFETY: `out` points at one pointer.
        unsafe { out.write(std::ptr::null_mut()) };
        // SAFETY: the handle buffer holds NCCL_NET_HANDLE_MAXSIZE writable bytes.
        if let Some(t) = comm::connect(dev, unsafe { &mut *h })? {
            // SAFETY: as above.
            unsafe { out.write(t as *mut c_void) };
        }
        Ok(())
    })
}

unsafe extern "C" fn accept(
    listen_comm: *mut c_void,
    recv_comm: *mut *mut c_void,
    recv_dev: *mut *mut NcclNetDeviceHandleV7,
) -> NcclResult {
    guard("accept", || {
        let out = nonnull(recv_comm, "recvComm")?;
        // SAFETY: `out` points at one pointer.
        unsafe { out.write(std::ptr::null_mut()) };
        let Some(a) = comm::accept(listen_comm as usize)? else {
            return Ok(());
        };
        if let Some((handle, size)) = a.unpack {
            // SAFETY: when non-NULL, `recv_dev` points at the caller's pointer
            // to its device-handle storage.
            let storage = if recv_dev.is_null() {
                std::ptr::null_mut()
            } else {
                unsafe { *recv_dev }
            };
            if storage.is_null() {
                comm::mark_no_dev_handle(a.comm);
                violation_log("accept: no device-handle storage given; TCPX makes no receive queue for the comm and crashes at its first receive, which fails here");
            } else {
                let dh = NcclNetDeviceHandleV7 {
                    net_device_type: NCCL_NET_DEVICE_UNPACK,
                    net_device_version: NCCL_NET_DEVICE_UNPACK_VERSION,
                    handle: handle as *mut c_void,
                    size,
                    needs_proxy_progress: 1,
                };
                // SAFETY: the caller's storage holds a device handle (TCPX asks
                // for ≥ 64 bytes, 16-byte aligned; the struct is 32 bytes).
                unsafe { storage.write(dh) };
            }
        }
        // SAFETY: as above.
        unsafe { out.write(a.comm as *mut c_void) };
        Ok(())
    })
}

fn reg_mr_any(
    comm_: *mut c_void,
    data: *mut c_void,
    size: usize,
    ty: c_int,
    mhandle: *mut *mut c_void,
) -> Result<(), Fail> {
    let out = nonnull(mhandle, "mhandle")?;
    let t = comm::reg_mr(comm_ as usize, data as u64, size, ty)?;
    // SAFETY: `out` points at one pointer.
    unsafe { out.write(t as *mut c_void) };
    Ok(())
}

unsafe extern "C" fn reg_mr_v7(
    comm_: *mut c_void,
    data: *mut c_void,
    size: c_int,
    ty: c_int,
    mhandle: *mut *mut c_void,
) -> NcclResult {
    guard("regMr", || {
        let size = usize::try_from(size)
            .map_err(|_| error(NCCL_INVALID_ARGUMENT, format!("regMr of {size} bytes")))?;
        reg_mr_any(comm_, data, size, ty, mhandle)
    })
}

#[cfg(feature = "v8")]
unsafe extern "C" fn reg_mr_v8(
    comm_: *mut c_void,
    data: *mut c_void,
    size: usize,
    ty: c_int,
    mhandle: *mut *mut c_void,
) -> NcclResult {
    guard("regMr", || {
        reg_mr_any(comm_, data, size, ty, mhandle)?;
        trace(|| format!("regMr comm {comm_:p} {data:p}+{size} type {ty}"));
        Ok(())
    })
}

unsafe extern "C" fn dereg_mr(comm_: *mut c_void, mhandle: *mut c_void) -> NcclResult {
    guard("deregMr", || {
        comm::dereg_mr(comm_ as usize, mhandle as usize)
    })
}

unsafe extern "C" fn isend(
    send_comm: *mut c_void,
    data: *mut c_void,
    size: c_int,
    _tag: c_int,
    mhandle: *mut c_void,
    request: *mut *mut c_void,
) -> NcclResult {
    guard("isend", || {
        let out = nonnull(request, "request")?;
        // SAFETY: `out` points at one pointer.
        unsafe { out.write(std::ptr::null_mut()) };
        let r = comm::isend(send_comm as usize, data as u64, size, mhandle as usize)?;
        trace(|| format!("isend comm {send_comm:p} {data:p}+{size} -> request {r:#x}"));
        // SAFETY: as above.
        unsafe { out.write(r as *mut c_void) };
        Ok(())
    })
}

unsafe extern "C" fn irecv(
    recv_comm: *mut c_void,
    n: c_int,
    data: *mut *mut c_void,
    sizes: *mut c_int,
    _tags: *mut c_int,
    mhandles: *mut *mut c_void,
    request: *mut *mut c_void,
) -> NcclResult {
    guard("irecv", || {
        let out = nonnull(request, "request")?;
        // SAFETY: `out` points at one pointer.
        unsafe { out.write(std::ptr::null_mut()) };
        if n != 1 {
            return Err(comm::violation(
                NCCL_INTERNAL_ERROR,
                format!("irecv with n={n}; TCPX takes exactly one buffer (n == 1)"),
            ));
        }
        let data = nonnull(data, "data")?;
        let sizes = nonnull(sizes, "sizes")?;
        let mhandles = nonnull(mhandles, "mhandles")?;
        // SAFETY: with n == 1 each array holds one element.
        let (d, s, m) = unsafe { (*data, *sizes, *mhandles) };
        let r = comm::irecv(recv_comm as usize, n, d as u64, s, m as usize)?;
        trace(|| format!("irecv comm {recv_comm:p} {d:p}+{s} -> request {r:#x}"));
        // SAFETY: as above.
        unsafe { out.write(r as *mut c_void) };
        Ok(())
    })
}

unsafe extern "C" fn iflush(
    recv_comm: *mut c_void,
    _n: c_int,
    _data: *mut *mut c_void,
    _sizes: *mut c_int,
    _mhandles: *mut *mut c_void,
    request: *mut *mut c_void,
) -> NcclResult {
    guard("iflush", || {
        let out = nonnull(request, "request")?;
        // SAFETY: `out` points at one pointer.
        unsafe { out.write(std::ptr::null_mut()) };
        if comm::is_unpack_recv(recv_comm as usize)? {
            return Err(comm::violation(
                NCCL_INTERNAL_ERROR,
                "iflush must not be called on a TCPX (UNPACK) receive comm",
            ));
        }
        // Plain mode: nothing to flush; a NULL request means done.
        trace(|| format!("iflush comm {recv_comm:p}: nothing to flush"));
        Ok(())
    })
}

unsafe extern "C" fn test(request: *mut c_void, done: *mut c_int, sizes: *mut c_int) -> NcclResult {
    guard("test", || {
        let done = nonnull(done, "done")?;
        // SAFETY: `done` points at one int.
        unsafe { done.write(0) };
        if let Some(size) = comm::test(request as usize)? {
            // SAFETY: as above.
            unsafe { done.write(1) };
            trace(|| format!("test request {request:p}: done, size {size:?}"));
            if let (Some(n), false) = (size, sizes.is_null()) {
                // SAFETY: a non-NULL `sizes` has room for one int (n == 1).
                unsafe { sizes.write(n as c_int) };
            }
        }
        Ok(())
    })
}

unsafe extern "C" fn close_send(send_comm: *mut c_void) -> NcclResult {
    guard("closeSend", || comm::close(send_comm as usize, true))
}

unsafe extern "C" fn close_recv(recv_comm: *mut c_void) -> NcclResult {
    guard("closeRecv", || comm::close(recv_comm as usize, false))
}

unsafe extern "C" fn close_listen(listen_comm: *mut c_void) -> NcclResult {
    guard("closeListen", || comm::close_listen(listen_comm as usize))
}

unsafe extern "C" fn get_device_mr(
    _comm: *mut c_void,
    _mhandle: *mut c_void,
    _dptr: *mut *mut c_void,
) -> NcclResult {
    // As TCPX: nothing to do.
    NCCL_SUCCESS
}

unsafe extern "C" fn irecv_consumed(
    recv_comm: *mut c_void,
    n: c_int,
    request: *mut c_void,
) -> NcclResult {
    guard("irecvConsumed", || {
        comm::irecv_consumed(recv_comm as usize, n, request as usize)?;
        trace(|| format!("irecvConsumed comm {recv_comm:p} request {request:p}"));
        Ok(())
    })
}

/// The v8 table (NCCL ≥ 2.20 and our loader take this one), only in the
/// build with the `v8` feature: TCPX has none.
#[cfg(feature = "v8")]
#[no_mangle]
#[allow(non_upper_case_globals)]
pub static ncclNetPlugin_v8: NcclNetV8 = NcclNetV8 {
    name: c"NcclNetEmu".as_ptr(),
    init: Some(init),
    devices: Some(devices),
    get_properties: Some(get_properties_v8),
    listen: Some(listen),
    connect: Some(connect),
    accept: Some(accept),
    reg_mr: Some(reg_mr_v8),
    reg_mr_dma_buf: None,
    dereg_mr: Some(dereg_mr),
    isend: Some(isend),
    irecv: Some(irecv),
    iflush: Some(iflush),
    test: Some(test),
    close_send: Some(close_send),
    close_recv: Some(close_recv),
    close_listen: Some(close_listen),
    get_device_mr: Some(get_device_mr),
    irecv_consumed: Some(irecv_consumed),
};

/// The v7 table, as the TCPX plugin exports it.
#[no_mangle]
#[allow(non_upper_case_globals)]
pub static ncclNetPlugin_v7: NcclNetV7 = NcclNetV7 {
    name: c"NcclNetEmu".as_ptr(),
    init: Some(init),
    devices: Some(devices),
    get_properties: Some(get_properties_v7),
    listen: Some(listen),
    connect: Some(connect),
    accept: Some(accept),
    reg_mr: Some(reg_mr_v7),
    reg_mr_dma_buf: None,
    dereg_mr: Some(dereg_mr),
    isend: Some(isend),
    irecv: Some(irecv),
    iflush: Some(iflush),
    test: Some(test),
    close_send: Some(close_send),
    close_recv: Some(close_recv),
    close_listen: Some(close_listen),
    get_device_mr: Some(get_device_mr),
    irecv_consumed: Some(irecv_consumed),
};

/// The v8 adapter, in the build that has it (`--features v8`).
#[cfg(all(test, feature = "v8"))]
mod v8_tests {
    use super::*;

    #[test]
    fn the_v8_table_adapts_properties_and_registration() {
        let t = &ncclNetPlugin_v8;
        // SAFETY: init without a logger; the out-pointers are ours.
        unsafe {
            assert_eq!(t.init.unwrap()(None), NCCL_SUCCESS);
            let mut p: NcclNetPropertiesV8 = std::mem::zeroed();
            assert_eq!(t.get_properties.unwrap()(0, &mut p), NCCL_SUCCESS);
            assert_eq!(p.reg_is_global, 0);
            assert_eq!(p.max_recvs, 1);
            assert!(p.speed > 0);
            let mut v7: NcclNetPropertiesV7 = std::mem::zeroed();
            assert_eq!(
                ncclNetPlugin_v7.get_properties.unwrap()(0, &mut v7),
                NCCL_SUCCESS
            );
            assert_eq!(
                (v7.ptr_support, v7.max_recvs, v7.speed),
                (p.ptr_support, p.max_recvs, p.speed),
                "both tables describe the same device"
            );
        }
        // regMr takes a size_t in v8: a registration past 2 GiB is no
        // negative int. Records the range only (host memory).
        let mut h = [0u8; NCCL_NET_HANDLE_MAXSIZE];
        let l = comm::listen(0, &mut h).unwrap();
        let mut mh: *mut c_void = std::ptr::null_mut();
        // SAFETY: a listen comm is refused by regMr (no memory is touched).
        let r = unsafe {
            t.reg_mr.unwrap()(
                l as *mut c_void,
                h.as_mut_ptr() as *mut c_void,
                3 << 30,
                NCCL_PTR_HOST,
                &mut mh,
            )
        };
        assert_eq!(
            r, NCCL_INVALID_ARGUMENT,
            "regMr on a listen comm is refused"
        );
        comm::close_listen(l).unwrap();
    }
}
