//! `net::plugin`: drives any ncclNet plugin (Google's GPUDirect-TCPX plugin
//! on A3 hosts, `crates/nccl-net-emu` everywhere else) through the [`Net`]
//! trait, keeping the rules TCPX imposes (`reference/ncclnet-and-tcpx.md`):
//!
//! - the newest table we understand is used (v8, then v7), each read through
//!   its own layout (`sys`, the `ncclnet-abi` crate) and adapted onto one internal table (`table`;
//!   one module per version); the library is loaded once per path and never
//!   unloaded (plugins keep threads);
//! - connect and accept are resumable (`Ok(None)` while the plugin hands back
//!   a NULL comm); connect is given the *same* writable handle buffer on
//!   every call, as plugins keep their progress in it;
//! - accept gets 16-byte-aligned, 64-byte storage for the device handle;
//! - the endpoint's GPU is made current on every thread that calls listen,
//!   connect, accept or regMr; GPU registrations are 4 KiB-aligned (the
//!   aligned-down range inside the same allocation);
//! - `irecv` with `n == 1`, `iflush` never, `test` only on each comm's
//!   oldest request (the engine's windows keep ≤ 16 in flight per comm);
//! - UNPACK receive comms: once the plugin says a receive is done, its
//!   fragments (`cnt[slot]`, `mem[slot][..]`, slot = posting order mod 16)
//!   are copied into the user's buffer — by the CUDA unpack kernel
//!   ([`crate::gpu::unpack`]) when the bounce pool and the buffer are on the
//!   GPU, by a CPU copy when both are in host memory — then `irecvConsumed`
//!   is called in FIFO order, and only then is the receive reported done.
//!
//! Every `ncclResult_t` becomes a [`NetError::Plugin`] in [`check`].
//! This module calls C function pointers and reads plugin memory, so
//! `unsafe` is allowed here; each block says why it holds.
#![allow(unsafe_code)]

/// The ncclNet ABI mirror, shared with the stand-in plugin.
pub(crate) use ncclnet_abi as sys;
mod table;
mod v7;
mod v8;

use std::collections::{HashMap, VecDeque};
use std::ffi::{c_char, c_int, c_ulong, c_void, CStr};
use std::path::Path;
use std::sync::atomic::Ordering;
use std::sync::{Arc, OnceLock};

use parking_lot::Mutex;

use self::recv::*;
use self::sys::*;
use super::{
    DeviceProps, ListenComm, MemRef, MrHandle, Net, NetHandle, RecvComm, ReqId, SendComm, Waker,
};
use crate::error::NetError;
use crate::gpu::{self, unpack};
use crate::memory::MemKind;

/// The versions we read, newest first: (version, exported symbol, reader).
const VERSIONS: &[(u32, &str, table::Reader)] =
    &[(8, SYMBOL_V8, v8::read), (7, SYMBOL_V7, v7::read)];

/// The name used in errors before a plugin's own name is known.
const LOADER: &str = "plugin";
/// GPU registrations must start on a 4 KiB boundary.
const GPU_REG_ALIGN: u64 = 4096;
/// TCPX exits on receives of more than 2048 fragments: at most 4 MiB per
/// receive on an UNPACK comm.
const MAX_UNPACK_RECV: usize = 4 << 20;

/// What a result code means, in NCCL's words.
pub fn result_meaning(code: NcclResult) -> &'static str {
    match code {
        NCCL_SUCCESS => "success",
        NCCL_UNHANDLED_CUDA_ERROR => "unhandled CUDA error",
        NCCL_SYSTEM_ERROR => "system error",
        NCCL_INTERNAL_ERROR => "internal error",
        NCCL_INVALID_ARGUMENT => "invalid argument",
        NCCL_INVALID_USAGE => "invalid usage",
        NCCL_REMOTE_ERROR => "remote error",
        NCCL_IN_PROGRESS => "in progress",
        _ => "unknown result code",
    }
}

/// The one place an `ncclResult_t` becomes a [`NetError`].
pub fn check(net: &'static str, call: &'static str, code: NcclResult) -> Result<(), NetError> {
    if code == NCCL_SUCCESS {
        Ok(())
    } else {
        Err(NetError::Plugin {
            net,
            call,
            code,
            meaning: result_meaning(code),
        })
    }
}

fn misuse(net: &'static str, reason: impl Into<String>) -> NetError {
    NetError::Misuse {
        net,
        reason: reason.into(),
    }
}

fn protocol(net: &'static str, reason: impl Into<String>) -> NetError {
    NetError::Protocol {
        net,
        reason: reason.into(),
    }
}

/// The plugin's log lines, into `tracing`. The C type is variadic; only the
/// format string is printed (its arguments are not read).
unsafe extern "C" fn plugin_log(
    level: c_int,
    _flags: c_ulong,
    file: *const c_char,
    line: c_int,
    fmt: *const c_char,
) {
    let _ = std::panic::catch_unwind(|| {
        let text = |p: *const c_char| {
            if p.is_null() {
                String::new()
            } else {
                // SAFETY: the plugin passes NUL-terminated strings.
                unsafe { CStr::from_ptr(p) }
                    .to_string_lossy()
                    .replace("%%", "%")
            }
        };
        let (msg, file) = (text(fmt), text(file));
        let msg = msg.trim_end();
        match level {
            NCCL_LOG_WARN | NCCL_LOG_ABORT => tracing::warn!("[plugin {file}:{line}] {msg}"),
            NCCL_LOG_INFO | NCCL_LOG_VERSION => tracing::info!("[plugin {file}:{line}] {msg}"),
            _ => tracing::trace!("[plugin {file}:{line}] {msg}"),
        }
    });
}

fn logger() -> NcclDebugLogger {
    let f: unsafe extern "C" fn(c_int, c_ulong, *const c_char, c_int, *const c_char) = plugin_log;
    // SAFETY: on the C ABIs we support (x86_64 and aarch64 Linux) a variadic
    // call passes its named arguments exactly as a non-variadic call does, so
    // a function taking only the five named arguments may be called through
    // the variadic type; it never reads the variadic ones.
    unsafe { std::mem::transmute::<_, NcclDebugLogger>(f) }
}

/// What a plugin device reports, beyond [`DeviceProps`].
#[derive(Debug, Clone, PartialEq)]
pub struct PluginDevice {
    pub props: DeviceProps,
    pub guid: u64,
    pub ptr_support: i32,
    pub max_recvs: i32,
    pub net_device_type: i32,
    pub net_device_version: i32,
    pub reg_is_global: bool,
}

/// A loaded plugin: the library (kept for the process), its functions, its
/// devices.
struct Lib {
    _lib: libloading::Library,
    path: String,
    name: &'static str,
    version: u32,
    /// Every function whose C type the versions share (see
    /// [`table::Table::calls`]).
    api: NcclNetV7,
    /// The functions each version adapts to its own types.
    get_properties: Option<table::GetProperties>,
    reg_mr: Option<table::RegMr>,
    devices: Vec<PluginDevice>,
}

// SAFETY: the library handle and the function table are immutable after
// loading; plugins are called from any thread, as NCCL does.
unsafe impl Send for Lib {}
// SAFETY: as above.
unsafe impl Sync for Lib {}

/// Takes a required function out of the table, or says which is missing.
macro_rules! func {
    ($lib:expr, $field:ident) => {
        match $lib.api.$field {
            Some(f) => f,
            None => {
                return Err(misuse(
                    $lib.name,
                    concat!("the plugin has no ", stringify!($field), " function"),
                ))
            }
        }
    };
}

// Declared after `func!`, which it uses.
mod recv;

impl Lib {
    /// Loads the plugin at `path` once per process (per newest version
    /// allowed).
    fn get(path: &str, newest: u32) -> Result<Arc<Lib>, NetError> {
        type Loaded = Mutex<HashMap<(String, u32), Arc<Lib>>>;
        static LOADED: OnceLock<Loaded> = OnceLock::new();
        let mut map = LOADED.get_or_init(Default::default).lock();
        let key = (path.to_string(), newest);
        if let Some(l) = map.get(&key) {
            return Ok(l.clone());
        }
        let lib = Arc::new(Lib::load(path, newest)?);
        map.insert(key, lib.clone());
        Ok(lib)
    }

    fn load(path: &str, newest: u32) -> Result<Lib, NetError> {
        let fail = |reason: String| NetError::Load {
            net: LOADER,
            reason: format!("{path}: {reason}"),
        };
        if !Path::new(path).is_file() {
            return Err(fail(
                "no such file (set TCPX_P2P_PLUGIN_PATH to the ncclNet plugin, e.g. libnccl-net-tcpx.so or libnccl_net_emu.so)".into(),
            ));
        }
        use libloading::os::unix::{Library as UnixLib, RTLD_LOCAL, RTLD_NOW};
        // SAFETY: loading runs the library's initialisers; an ncclNet plugin
        // is built to be dlopen-ed this way by NCCL.
        let lib: libloading::Library = unsafe { UnixLib::open(Some(path), RTLD_NOW | RTLD_LOCAL) }
            .map_err(|e| fail(format!("dlopen failed: {e}")))?
            .into();
        let found = VERSIONS
            .iter()
            .filter(|(v, _, _)| *v <= newest)
            .find_map(|(_, _, read)| read(&lib));
        let Some(table::Table {
            version,
            calls: api,
            get_properties,
            reg_mr,
        }) = found
        else {
            let symbols: Vec<&str> = VERSIONS.iter().map(|(_, s, _)| *s).collect();
            return Err(fail(format!(
                "exports none of {} (or only NULL tables): not an ncclNet plugin we understand",
                symbols.join(", ")
            )));
        };
        let name: &'static str = if api.name.is_null() {
            "ncclnet-plugin"
        } else {
            // SAFETY: the table's name is a NUL-terminated static string.
            let s = unsafe { CStr::from_ptr(api.name) }
                .to_string_lossy()
                .into_owned();
            // Leaked once per loaded path (the library is never unloaded either).
            Box::leak(s.into_boxed_str())
        };
        let missing: Vec<&str> = [
            ("init", api.init.is_none()),
            ("devices", api.devices.is_none()),
            ("getProperties", get_properties.is_none()),
            ("listen", api.listen.is_none()),
            ("connect", api.connect.is_none()),
            ("accept", api.accept.is_none()),
            ("regMr", reg_mr.is_none()),
            ("deregMr", api.dereg_mr.is_none()),
            ("isend", api.isend.is_none()),
            ("irecv", api.irecv.is_none()),
            ("test", api.test.is_none()),
            ("closeSend", api.close_send.is_none()),
            ("closeRecv", api.close_recv.is_none()),
            ("closeListen", api.close_listen.is_none()),
        ]
        .into_iter()
        .filter_map(|(n, m)| m.then_some(n))
        .collect();
        if !missing.is_empty() {
            return Err(fail(format!(
                "table {name} (v{version}) lacks {}",
                missing.join(", ")
            )));
        }
        let mut lib = Lib {
            _lib: lib,
            path: path.to_string(),
            name,
            version,
            api,
            get_properties,
            reg_mr,
            devices: Vec::new(),
        };
        let init = lib
            .api
            .init
            .ok_or_else(|| fail("no init function".into()))?;
        default_chunk_size();
        // SAFETY: init is called once per loaded library with a logger that
        // stays valid for the process.
        check(name, "init", unsafe { init(Some(logger())) })
            .map_err(|e| fail(format!("init of {name} (v{version}) failed: {e}")))?;
        lib.devices = lib.read_devices().map_err(|e| fail(e.to_string()))?;
        tracing::info!(
            path,
            name,
            version,
            devices = lib.devices.len(),
            "loaded ncclNet plugin"
        );
        Ok(lib)
    }

    fn read_devices(&self) -> Result<Vec<PluginDevice>, NetError> {
        let devices = func!(self, devices);
        let mut n: c_int = 0;
        // SAFETY: writes one int.
        check(self.name, "devices", unsafe { devices(&mut n) })?;
        let mut out = Vec::new();
        for dev in 0..n.max(0) {
            out.push(self.properties(dev)?);
        }
        Ok(out)
    }

    fn properties(&self, dev: c_int) -> Result<PluginDevice, NetError> {
        let f = self
            .get_properties
            .as_ref()
            .ok_or_else(|| misuse(self.name, "no getProperties"))?;
        let mut p = table::Props::default();
        check(self.name, "getProperties", f(dev, &mut p))?;
        Ok(PluginDevice {
            props: DeviceProps {
                name: p.name.unwrap_or_else(|| format!("{}:{dev}", self.name)),
                pci_path: p.pci_path,
                speed_mbps: p.speed.max(0) as u32,
                host_mem: p.ptr_support & NCCL_PTR_HOST != 0,
                cuda_mem: p.ptr_support & NCCL_PTR_CUDA != 0,
                max_comms: p.max_comms.max(0) as u32,
            },
            guid: p.guid,
            ptr_support: p.ptr_support,
            max_recvs: p.max_recvs,
            net_device_type: p.net_device_type,
            net_device_version: p.net_device_version,
            reg_is_global: p.reg_is_global,
        })
    }

    fn reg_mr(
        &self,
        comm: *mut c_void,
        addr: u64,
        len: usize,
        ty: c_int,
    ) -> Result<MrHandle, NetError> {
        let f = self
            .reg_mr
            .as_ref()
            .ok_or_else(|| misuse(self.name, "no regMr"))?;
        let mut mh: *mut c_void = std::ptr::null_mut();
        let code =
            f(comm, addr, len, ty, &mut mh).map_err(|why| misuse(self.name, why.to_string()))?;
        check(self.name, "regMr", code)?;
        Ok(MrHandle(mh as usize))
    }

    fn dereg_mr(&self, comm: *mut c_void, mr: MrHandle) -> Result<(), NetError> {
        let f = func!(self, dereg_mr);
        // SAFETY: `mr` came from regMr on this comm and is deregistered once.
        check(self.name, "deregMr", unsafe {
            f(comm, mr.0 as *mut c_void)
        })
    }

    /// `test` of one request: `Some(reported size or -1)` when done.
    fn test(&self, req: *mut c_void) -> Result<Option<i64>, NetError> {
        let f = func!(self, test);
        let mut done: c_int = 0;
        let mut size: c_int = -1;
        // SAFETY: `req` is the oldest live request of its comm.
        check(self.name, "test", unsafe { f(req, &mut done, &mut size) })?;
        Ok((done != 0).then_some(i64::from(size)))
    }
}

/// Why a GPU buffer has no 4 KiB-aligned registration inside its allocation.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum GpuRangeError {
    #[error("address range overflows")]
    Overflow,
    #[error("{addr:#x}+{len} is not inside its allocation {base:#x}+{size}")]
    Outside {
        addr: u64,
        len: usize,
        base: u64,
        size: usize,
    },
    #[error("{addr:#x} is not 4 KiB-aligned and its allocation starts at {base:#x}, so no aligned range inside it covers the buffer (allocate GPU buffers 4 KiB-aligned)")]
    Unaligned { addr: u64, base: u64 },
}

/// The range to register for `[addr, addr+len)` of a GPU allocation
/// `[base, base+size)`: starts at `addr` rounded down to 4 KiB, ends at the
/// end rounded up to 4 KiB, so that both the address and the size are
/// multiples of 4 KiB as TCPX requires. The rounded tail may pass the
/// allocation's end: CUDA maps device memory in pages of 64 KiB or more
/// (2 MiB for `cudaMalloc`), so it is mapped, and the plugin never touches
/// bytes outside the requests' own buffers.
pub fn aligned_gpu_range(
    addr: u64,
    len: usize,
    base: u64,
    size: usize,
) -> Result<(u64, usize), GpuRangeError> {
    let end = addr
        .checked_add(len as u64)
        .ok_or(GpuRangeError::Overflow)?;
    let alloc_end = base + size as u64;
    if addr < base || end > alloc_end {
        return Err(GpuRangeError::Outside {
            addr,
            len,
            base,
            size,
        });
    }
    let start = addr & !(GPU_REG_ALIGN - 1);
    if start < base {
        return Err(GpuRangeError::Unaligned { addr, base });
    }
    let end = end
        .checked_next_multiple_of(GPU_REG_ALIGN)
        .ok_or(GpuRangeError::Overflow)?;
    Ok((start, (end - start) as usize))
}

/// The chunk size GCP qualified for TCPX on A3 (`NCCL_DYNAMIC_CHUNK_SIZE`).
pub const TCPX_CHUNK_SIZE: &str = "524288";

/// TCPX reads `NCCL_DYNAMIC_CHUNK_SIZE` at init and its default, 0, means
/// sends never finish: where it is unset (or 0), it is set to GCP's value
/// before the plugin's init, with a log line. Runs before the plugin has
/// threads of its own, under the loader's lock.
fn default_chunk_size() {
    const VAR: &str = "NCCL_DYNAMIC_CHUNK_SIZE";
    let set = std::env::var(VAR)
        .ok()
        .and_then(|v| v.trim().parse::<u64>().ok())
        .is_some_and(|v| v > 0);
    if !set {
        tracing::info!(
            "{VAR} unset or 0 (TCPX would never finish a send): using {TCPX_CHUNK_SIZE}"
        );
        std::env::set_var(VAR, TCPX_CHUNK_SIZE);
    }
}

/// Makes the endpoint's GPU current on this thread (nothing without one).
fn bind(gpu: &Option<Arc<gpu::Device>>) -> Result<(), NetError> {
    if let Some(d) = gpu {
        d.bind()?;
    }
    Ok(())
}

fn register(
    lib: &Lib,
    comm: *mut c_void,
    gpu_dev: &Option<Arc<gpu::Device>>,
    mem: MemRef,
) -> Result<MrHandle, NetError> {
    match mem.kind {
        MemKind::Host => lib.reg_mr(comm, mem.addr, mem.len, NCCL_PTR_HOST),
        MemKind::Cuda(_) => {
            bind(gpu_dev)?;
            // TCPX's cuMemGetHandleForAddressRange needs the address and the
            // size 4 KiB-aligned, even for an aligned buffer of 1,000 bytes.
            let (start, len) = if mem.addr.is_multiple_of(GPU_REG_ALIGN)
                && mem.len.is_multiple_of(GPU_REG_ALIGN as usize)
            {
                (mem.addr, mem.len)
            } else {
                let (base, size) = gpu::allocation_range(mem.addr)?;
                aligned_gpu_range(mem.addr, mem.len, base, size)
                    .map_err(|r| misuse(lib.name, format!("GPU registration: {r}")))?
            };
            lib.reg_mr(comm, start, len, NCCL_PTR_CUDA)
        }
    }
}

/// Storage for the device handle the plugin fills on accept: 64 bytes,
/// 16-byte aligned, as TCPX requires.
#[repr(C, align(16))]
struct DevHandleStorage([u8; 64]);

/// A connect handle buffer the plugin may write its progress into.
#[repr(C, align(16))]
struct HandleBuf(NetHandle);

/// A net over an ncclNet plugin.
pub struct PluginNet {
    lib: Arc<Lib>,
    gpu: Option<Arc<gpu::Device>>,
    /// Connects in progress, by the peer's handle: the buffer passed on every
    /// call, which the plugin may write into.
    pending: Mutex<HashMap<NetHandle, Box<HandleBuf>>>,
}

impl PluginNet {
    /// Loads (once per process) and initialises the plugin at `path`. `gpu`:
    /// the GPU made current around listen / connect / accept / regMr (None:
    /// host memory only).
    pub fn load(path: &str, gpu: Option<i32>) -> Result<Self, NetError> {
        Self::load_version(path, gpu, 8)
    }

    /// As [`PluginNet::load`], using no table newer than `newest` (7 reads
    /// the v7 table as the TCPX plugin exports it, even where v8 exists).
    pub fn load_version(path: &str, gpu: Option<i32>, newest: u32) -> Result<Self, NetError> {
        let lib = Lib::get(path, newest)?;
        let gpu = match gpu {
            Some(i) if i >= 0 && gpu::available() => Some(gpu::Device::get(i)?),
            _ => None,
        };
        Ok(PluginNet {
            lib,
            gpu,
            pending: Mutex::new(HashMap::new()),
        })
    }

    /// The table version in use (8 or 7).
    pub fn version(&self) -> u32 {
        self.lib.version
    }

    pub fn path(&self) -> &str {
        &self.lib.path
    }

    /// The plugin's devices with everything they report.
    pub fn plugin_devices(&self) -> &[PluginDevice] {
        &self.lib.devices
    }

    fn dev(&self, dev: usize) -> Result<c_int, NetError> {
        if dev >= self.lib.devices.len() {
            return Err(misuse(
                self.lib.name,
                format!(
                    "device {dev} does not exist ({} devices)",
                    self.lib.devices.len()
                ),
            ));
        }
        Ok(dev as c_int)
    }
}

impl Net for PluginNet {
    fn name(&self) -> &str {
        self.lib.name
    }

    fn devices(&self) -> Vec<DeviceProps> {
        self.lib.devices.iter().map(|d| d.props.clone()).collect()
    }

    fn listen(&self, dev: usize) -> Result<Box<dyn ListenComm>, NetError> {
        let d = self.dev(dev)?;
        bind(&self.gpu)?;
        let listen = func!(self.lib, listen);
        let mut handle = HandleBuf([0u8; NCCL_NET_HANDLE_MAXSIZE]);
        let mut comm: *mut c_void = std::ptr::null_mut();
        // SAFETY: the handle buffer holds NCCL_NET_HANDLE_MAXSIZE bytes.
        check(self.lib.name, "listen", unsafe {
            listen(d, handle.0.as_mut_ptr() as *mut c_void, &mut comm)
        })?;
        if comm.is_null() {
            return Err(protocol(self.lib.name, "listen returned no comm"));
        }
        Ok(Box::new(PluginListen {
            lib: self.lib.clone(),
            comm,
            handle: handle.0,
            gpu: self.gpu.clone(),
            storage: None,
        }))
    }

    fn connect(
        &self,
        dev: usize,
        handle: &NetHandle,
        _waker: Waker,
    ) -> Result<Option<Box<dyn SendComm>>, NetError> {
        let d = self.dev(dev)?;
        bind(&self.gpu)?;
        let connect = func!(self.lib, connect);
        let mut buf = self
            .pending
            .lock()
            .remove(handle)
            .unwrap_or_else(|| Box::new(HandleBuf(*handle)));
        let mut comm: *mut c_void = std::ptr::null_mut();
        let mut dev_handle: *mut NcclNetDeviceHandleV7 = std::ptr::null_mut();
        // SAFETY: the buffer holds the 128-byte handle and is the same one on
        // every call for this peer handle; the plugin sets at most the comm.
        let code = unsafe {
            connect(
                d,
                buf.0.as_mut_ptr() as *mut c_void,
                &mut comm,
                &mut dev_handle,
            )
        };
        check(self.lib.name, "connect", code)?;
        if comm.is_null() {
            self.pending.lock().insert(*handle, buf);
            return Ok(None);
        }
        Ok(Some(Box::new(PluginSend {
            lib: self.lib.clone(),
            comm,
            gpu: self.gpu.clone(),
            reqs: VecDeque::new(),
            next_id: 0,
        })))
    }

    fn needs_polling(&self) -> bool {
        true
    }

    fn max_message(&self) -> usize {
        MAX_UNPACK_RECV
    }
}

// ---------------------------------------------------------------- listen

struct PluginListen {
    lib: Arc<Lib>,
    comm: *mut c_void,
    handle: NetHandle,
    gpu: Option<Arc<gpu::Device>>,
    storage: Option<Box<DevHandleStorage>>,
}

// SAFETY: a plugin comm may be used from any thread, one call at a time
// (`&mut self` guarantees that).
unsafe impl Send for PluginListen {}

impl ListenComm for PluginListen {
    fn handle(&self) -> NetHandle {
        self.handle
    }

    fn accept(&mut self, _waker: Waker) -> Result<Option<Box<dyn RecvComm>>, NetError> {
        bind(&self.gpu)?;
        let accept = func!(self.lib, accept);
        let storage = self
            .storage
            .get_or_insert_with(|| Box::new(DevHandleStorage([0u8; 64])));
        let mut dev_handle = storage.0.as_mut_ptr() as *mut NcclNetDeviceHandleV7;
        let mut comm: *mut c_void = std::ptr::null_mut();
        // SAFETY: the listen comm is live; the device-handle pointer names 64
        // bytes of 16-byte-aligned storage that outlives the receive comm.
        check(self.lib.name, "accept", unsafe {
            accept(self.comm, &mut comm, &mut dev_handle)
        })?;
        if comm.is_null() {
            return Ok(None);
        }
        let storage = self.storage.take();
        let dh = if dev_handle.is_null() {
            None
        } else {
            // SAFETY: the plugin filled (or pointed at) a device handle.
            Some(unsafe { std::ptr::read(dev_handle) })
        };
        let mut recv = PluginRecv {
            lib: self.lib.clone(),
            comm,
            gpu: self.gpu.clone(),
            _storage: storage,
            unpack: None,
            queue: VecDeque::new(),
            next_id: 0,
            posted: 0,
            landing: None,
        };
        if let Some(dh) = dh.filter(|d| d.net_device_type == NCCL_NET_DEVICE_UNPACK) {
            recv.unpack = Some(UnpackState::new(&self.lib, &dh)?);
        }
        Ok(Some(Box::new(recv)))
    }
}

impl Drop for PluginListen {
    fn drop(&mut self) {
        if let Some(f) = self.lib.api.close_listen {
            // SAFETY: the listen comm is closed once.
            if let Err(e) = check(self.lib.name, "closeListen", unsafe { f(self.comm) }) {
                tracing::warn!("{e}");
            }
        }
    }
}

// ---------------------------------------------------------------- send

struct PluginSend {
    lib: Arc<Lib>,
    comm: *mut c_void,
    gpu: Option<Arc<gpu::Device>>,
    reqs: VecDeque<(u64, *mut c_void, usize)>,
    next_id: u64,
}

// SAFETY: a plugin comm may be used from any thread, one call at a time.
unsafe impl Send for PluginSend {}

impl SendComm for PluginSend {
    fn reg_mr(&mut self, mem: MemRef) -> Result<MrHandle, NetError> {
        register(&self.lib, self.comm, &self.gpu, mem)
    }

    fn dereg_mr(&mut self, mr: MrHandle) -> Result<(), NetError> {
        self.lib.dereg_mr(self.comm, mr)
    }

    fn isend(&mut self, mem: MemRef, mr: MrHandle) -> Result<Option<ReqId>, NetError> {
        let isend = func!(self.lib, isend);
        let size = c_int::try_from(mem.len).map_err(|_| {
            misuse(
                self.lib.name,
                format!(
                    "a send of {} bytes exceeds the plugin's 2 GiB limit",
                    mem.len
                ),
            )
        })?;
        let mut req: *mut c_void = std::ptr::null_mut();
        // SAFETY: the comm is live; the memory lies inside the region `mr`
        // registers, held by the engine until this request completes.
        check(self.lib.name, "isend", unsafe {
            isend(
                self.comm,
                mem.addr as *mut c_void,
                size,
                0,
                mr.0 as *mut c_void,
                &mut req,
            )
        })?;
        if req.is_null() {
            return Ok(None);
        }
        let id = self.next_id;
        self.next_id += 1;
        self.reqs.push_back((id, req, mem.len));
        Ok(Some(ReqId(id)))
    }

    fn test(&mut self, req: ReqId) -> Result<Option<usize>, NetError> {
        let Some(&(id, r, len)) = self.reqs.front() else {
            return Err(misuse(
                self.lib.name,
                format!("test of unknown send request {}", req.0),
            ));
        };
        if id != req.0 {
            return Err(misuse(
                self.lib.name,
                format!("test of send request {} while {id} is the oldest", req.0),
            ));
        }
        match self.lib.test(r)? {
            Some(size) => {
                self.reqs.pop_front();
                Ok(Some(if size >= 0 { size as usize } else { len }))
            }
            None => Ok(None),
        }
    }
}

impl Drop for PluginSend {
    fn drop(&mut self) {
        if let Some(f) = self.lib.api.close_send {
            // SAFETY: the send comm is closed once; its requests die with it.
            if let Err(e) = check(self.lib.name, "closeSend", unsafe { f(self.comm) }) {
                tracing::warn!("{e}");
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn result_codes_become_plugin_errors() {
        assert!(check("x", "test", NCCL_SUCCESS).is_ok());
        match check("x", "isend", NCCL_INTERNAL_ERROR) {
            Err(NetError::Plugin {
                call: "isend",
                code: 3,
                meaning: "internal error",
                ..
            }) => {}
            other => panic!("{other:?}"),
        }
        assert_eq!(result_meaning(42), "unknown result code");
    }

    #[test]
    fn gpu_registration_is_aligned_inside_the_allocation() {
        let base = 0x7000_0000_0000u64;
        // Aligned already.
        assert_eq!(
            aligned_gpu_range(base, 100, base, 1 << 20).unwrap(),
            (base, 4096)
        );
        // Unaligned start: rounded down, end rounded up.
        assert_eq!(
            aligned_gpu_range(base + 5000, 10_000, base, 1 << 20).unwrap(),
            (base + 4096, 12288)
        );
        // The size is a multiple of 4 KiB even past the allocation's end.
        assert_eq!(
            aligned_gpu_range(base + 5000, 1000, base, 6500).unwrap(),
            (base + 4096, 4096)
        );
        for (addr, len) in [(base, 1000), (base + 4096, 4097), (base + 100, 1)] {
            let (s, l) = aligned_gpu_range(addr, len, base, 1 << 20).unwrap();
            assert!(
                s % 4096 == 0 && l % 4096 == 0 && s <= addr && s + l as u64 >= addr + len as u64
            );
        }
        // An allocation that does not start on 4 KiB cannot give an aligned start.
        assert!(aligned_gpu_range(base + 512 + 10, 10, base + 512, 1 << 20).is_err());
        // Outside its allocation.
        assert!(aligned_gpu_range(base + 10, 1 << 21, base, 1 << 20).is_err());
    }

    #[test]
    fn missing_or_foreign_libraries_are_clear_errors() {
        let e = PluginNet::load("/nonexistent/libnccl-net.so", None)
            .err()
            .expect("must fail")
            .to_string();
        assert!(
            e.contains("/nonexistent/libnccl-net.so") && e.contains("no such file"),
            "{e}"
        );
        // A real shared library that is no ncclNet plugin.
        let libc = [
            "/lib/x86_64-linux-gnu/libc.so.6",
            "/lib/aarch64-linux-gnu/libc.so.6",
            "/usr/lib64/libc.so.6",
        ]
        .into_iter()
        .find(|p| Path::new(p).is_file());
        if let Some(p) = libc {
            let e = PluginNet::load(p, None)
                .err()
                .expect("must fail")
                .to_string();
            assert!(
                e.contains("ncclNetPlugin_v8") && e.contains("ncclNetPlugin_v7"),
                "{e}"
            );
        }
    }
}
