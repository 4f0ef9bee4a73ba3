//! The plugin path against the stand-in plugin (`crates/nccl-net-emu`):
//!
//! - two endpoints with `NetKind::Plugin` moving bytes (send/recv,
//!   write/read) through the emulator in its UNPACK host mode, so every
//!   receive goes through the bounce pages, the CPU unpack and
//!   `irecvConsumed`;
//! - the TCPX rules, checked directly against the exported table: a 17th
//!   request fails with 3, `test` of a non-head fails, `irecv` with n=2
//!   fails, unaligned GPU `regMr` fails, `irecvConsumed` out of order fails;
//! - the UNPACK contract as the table gives it (device handle, loadMeta);
//! - fault injection (refuse, drop, delay).
//!
//! The emulator library must be built first (`cargo test --workspace` or
//! `cargo build --workspace` do);
//! `NCCL_NET_EMU_PATH` overrides where it is looked for. Without it the
//! tests say so and pass. Tests here run one at a time (they share the
//! process environment the emulator reads).
//!
//! Calling a C function table is FFI: `unsafe` blocks here say why they hold.

use std::ffi::{c_int, c_void, CStr};
use std::sync::{Mutex, MutexGuard};
use std::time::{Duration, Instant};

use tcpx_p2p::internal::plugin::sys::*;
use tcpx_p2p::internal::plugin::PluginNet;
use tcpx_p2p::internal::wire::FifoItem;
use tcpx_p2p::net::Net;
use tcpx_p2p::{Config, Endpoint, NetKind};

mod common;
use common::{buf, emu_path, pattern, reg_buf};

/// Serialises the tests (they share the environment) and finds the
/// emulator; None (with a message) when it is not built.
fn setup() -> Option<(MutexGuard<'static, ()>, String)> {
    static LOCK: Mutex<()> = Mutex::new(());
    let guard = LOCK.lock().unwrap_or_else(|e| e.into_inner());
    tcpx_p2p::init_logging();
    match emu_path() {
        Some(p) => Some((guard, p.to_string_lossy().into_owned())),
        None => {
            eprintln!(
                "SKIPPED: libnccl_net_emu.so not found; run `cargo build --workspace` first (or set NCCL_NET_EMU_PATH)"
            );
            None
        }
    }
}

fn checksum(v: &[u8]) -> u64 {
    v.iter().fold(0xcbf2_9ce4_8422_2325u64, |h, &b| {
        (h ^ u64::from(b)).wrapping_mul(0x100_0000_01b3)
    })
}

// ----------------------------------------------------------- the engine

fn plugin_cfg(path: &str) -> Config {
    Config {
        net: NetKind::Plugin,
        plugin_path: path.to_string(),
        ifname: Some("lo".into()),
        chunk: 1 << 20,
        channels: 2,
        ..Config::default()
    }
}

#[test]
fn plugin_loads_newest_table_and_reports_the_device() {
    let Some((_g, path)) = setup() else { return };
    let net = PluginNet::load(&path, None).unwrap();
    assert_eq!(net.version(), 8, "v8 is preferred over v7");
    assert_eq!(net.name(), "NcclNetEmu");
    let devs = net.plugin_devices();
    assert_eq!(devs.len(), 1);
    assert!(devs[0].props.host_mem && devs[0].props.cuda_mem);
    assert_eq!(devs[0].max_recvs, 1);
    assert!(devs[0].props.speed_mbps > 0);
    assert!(net.needs_polling());
}

#[test]
fn endpoints_send_recv_write_read_over_the_plugin() {
    let Some((_g, path)) = setup() else { return };
    let a = Endpoint::new(None, plugin_cfg(&path)).unwrap();
    let b = Endpoint::new(None, plugin_cfg(&path)).unwrap();
    assert_eq!(a.net_name(), "NcclNetEmu");
    let addr = b.local_addr();
    let ca = a
        .connect(&addr.ip().to_string(), addr.port(), None)
        .unwrap();
    let cb = b.accept(Some(Duration::from_secs(20))).unwrap().conn;

    // Two-sided, many sizes (more chunks than a window of 16 for the largest).
    for &n in &[1usize, 4095, 4096, 100_000, (1 << 20) + 17, 20 << 20] {
        let mut src = pattern(n, 3);
        let mut dst = vec![0u8; n];
        let sb = buf(&a, &mut src);
        let rb = buf(&b, &mut dst);
        let r = b.recv_async(cb, &[rb]).unwrap();
        let s = a.send_async(ca, &[sb]).unwrap();
        assert!(a.wait(s, Some(Duration::from_secs(60))).unwrap());
        assert!(b.wait(r, Some(Duration::from_secs(60))).unwrap());
        assert_eq!(checksum(&dst), checksum(&src), "size {n}");
        assert!(dst == src, "size {n}");
    }

    // One-sided write and read into an advertised range.
    let n = 3 << 20;
    let mut target = vec![0u8; n];
    let tb = buf(&b, &mut target);
    let desc = b.advertise(cb, tb.mr, tb.ptr + 4096, n - 8192).unwrap();
    let meta = FifoItem::decode(&desc).unwrap();
    let mut src = pattern(n - 8192, 9);
    let sb = buf(&a, &mut src);
    let w = a.write_async(ca, &[sb], &[meta]).unwrap();
    assert!(a.wait(w, Some(Duration::from_secs(60))).unwrap());
    assert_eq!(checksum(&target[4096..n - 4096]), checksum(&src));
    assert!(target[..4096].iter().all(|&x| x == 0));
    let mut back = vec![0u8; n - 8192];
    let bb = buf(&a, &mut back);
    let r = a.read_async(ca, &[bb], &[meta]).unwrap();
    assert!(a.wait(r, Some(Duration::from_secs(60))).unwrap());
    assert_eq!(checksum(&back), checksum(&src));
    assert!(back == src);
}

// ----------------------------------------------------------- the table

/// The emulator's v8 table, read straight from the library.
struct Table {
    _lib: libloading::Library,
    t: NcclNetV8,
    v7: NcclNetV7,
}

fn table(path: &str) -> Table {
    // SAFETY: loads an ncclNet plugin, whose initialisers are harmless.
    let lib = unsafe { libloading::Library::new(path) }.unwrap();
    // SAFETY: the symbols are the plugin's exported tables (ABI promise);
    // copied while the library is loaded, and the library is kept.
    let (t, v7) = unsafe {
        let p8 = *lib.get::<*const NcclNetV8>(SYMBOL_V8).unwrap();
        let p7 = *lib.get::<*const NcclNetV7>(SYMBOL_V7).unwrap();
        (std::ptr::read(p8), std::ptr::read(p7))
    };
    let init = t.init.unwrap();
    // SAFETY: init without a logger is allowed; it may run more than once.
    assert_eq!(unsafe { init(None) }, NCCL_SUCCESS);
    Table { _lib: lib, t, v7 }
}

/// 64 bytes, 16-byte aligned: what accept's device handle is written into.
#[repr(C, align(16))]
struct Storage([u8; 64]);

struct Pair {
    listen: *mut c_void,
    send: *mut c_void,
    recv: *mut c_void,
    dev: Box<Storage>,
}

impl Table {
    /// Listen, then connect and accept until both give a comm. Checks that
    /// both needed a second call.
    fn pair(&self) -> Pair {
        let t = &self.t;
        let mut handle = [0u8; NCCL_NET_HANDLE_MAXSIZE];
        let mut listen: *mut c_void = std::ptr::null_mut();
        // SAFETY: 128-byte handle buffer, one out-pointer.
        assert_eq!(
            unsafe { t.listen.unwrap()(0, handle.as_mut_ptr() as *mut c_void, &mut listen) },
            0
        );
        let mut dev = Box::new(Storage([0u8; 64]));
        let (mut send, mut recv): (*mut c_void, *mut c_void) =
            (std::ptr::null_mut(), std::ptr::null_mut());
        let (mut connects, mut accepts) = (0, 0);
        let deadline = Instant::now() + Duration::from_secs(10);
        while send.is_null() || recv.is_null() {
            assert!(Instant::now() < deadline, "connect/accept did not finish");
            if send.is_null() {
                let mut sd: *mut NcclNetDeviceHandleV7 = std::ptr::null_mut();
                // SAFETY: the same handle buffer on every call, as required.
                let r = unsafe {
                    t.connect.unwrap()(0, handle.as_mut_ptr() as *mut c_void, &mut send, &mut sd)
                };
                assert_eq!(r, 0);
                connects += 1;
            }
            if recv.is_null() {
                let mut dp = dev.0.as_mut_ptr() as *mut NcclNetDeviceHandleV7;
                // SAFETY: a live listen comm and 64 bytes of aligned storage.
                let r = unsafe { t.accept.unwrap()(listen, &mut recv, &mut dp) };
                assert_eq!(r, 0);
                accepts += 1;
            }
            std::thread::sleep(Duration::from_millis(1));
        }
        assert!(
            connects >= 2,
            "connect is resumable: the first call gives no comm"
        );
        assert!(
            accepts >= 2,
            "accept is resumable: the first call gives no comm"
        );
        Pair {
            listen,
            send,
            recv,
            dev,
        }
    }

    fn reg(&self, comm: *mut c_void, p: *const u8, len: usize, ty: c_int) -> (c_int, *mut c_void) {
        let mut mh: *mut c_void = std::ptr::null_mut();
        // SAFETY: a live comm; the plugin only records the range.
        let r = unsafe { self.t.reg_mr.unwrap()(comm, p as *mut c_void, len, ty, &mut mh) };
        (r, mh)
    }

    fn isend(
        &self,
        comm: *mut c_void,
        p: *const u8,
        len: usize,
        mh: *mut c_void,
    ) -> (c_int, *mut c_void) {
        let mut req: *mut c_void = std::ptr::null_mut();
        // SAFETY: the buffer is registered and outlives the request.
        let r =
            unsafe { self.t.isend.unwrap()(comm, p as *mut c_void, len as c_int, 0, mh, &mut req) };
        (r, req)
    }

    fn irecv_n(
        &self,
        comm: *mut c_void,
        n: c_int,
        p: *mut u8,
        len: usize,
        mh: *mut c_void,
    ) -> (c_int, *mut c_void) {
        let mut data = [p as *mut c_void; 2];
        let mut sizes = [len as c_int; 2];
        let mut tags = [0 as c_int; 2];
        let mut mhs = [mh; 2];
        let mut req: *mut c_void = std::ptr::null_mut();
        // SAFETY: arrays of two elements (n ≤ 2); the buffer is registered.
        let r = unsafe {
            self.t.irecv.unwrap()(
                comm,
                n,
                data.as_mut_ptr(),
                sizes.as_mut_ptr(),
                tags.as_mut_ptr(),
                mhs.as_mut_ptr(),
                &mut req,
            )
        };
        (r, req)
    }

    /// `(code, done, reported size)`.
    fn test(&self, req: *mut c_void) -> (c_int, bool, c_int) {
        let mut done: c_int = 0;
        let mut size: c_int = -1;
        // SAFETY: `req` is a request token (the plugin checks it).
        let r = unsafe { self.t.test.unwrap()(req, &mut done, &mut size) };
        (r, done != 0, size)
    }

    fn wait(&self, req: *mut c_void) -> c_int {
        let deadline = Instant::now() + Duration::from_secs(10);
        loop {
            let (r, done, size) = self.test(req);
            assert_eq!(r, 0, "test failed");
            if done {
                return size;
            }
            assert!(Instant::now() < deadline, "request did not complete");
            std::thread::yield_now();
        }
    }

    fn consumed(&self, comm: *mut c_void, req: *mut c_void) -> c_int {
        // SAFETY: a live receive comm; the plugin checks the request.
        unsafe { self.t.irecv_consumed.unwrap()(comm, 1, req) }
    }

    fn close(&self, p: Pair) {
        // SAFETY: each comm is closed once.
        unsafe {
            assert_eq!(self.t.close_send.unwrap()(p.send), 0);
            assert_eq!(self.t.close_recv.unwrap()(p.recv), 0);
            assert_eq!(self.t.close_listen.unwrap()(p.listen), 0);
        }
        drop(p.dev);
    }
}

#[test]
fn tables_match_the_reference() {
    let Some((_g, path)) = setup() else { return };
    let tb = table(&path);
    // SAFETY: table names are static NUL-terminated strings.
    let (n8, n7) = unsafe { (CStr::from_ptr(tb.t.name), CStr::from_ptr(tb.v7.name)) };
    assert_eq!(n8.to_str().unwrap(), "NcclNetEmu");
    assert_eq!(n7.to_str().unwrap(), "NcclNetEmu");
    assert!(tb.t.reg_mr_dma_buf.is_none() && tb.t.irecv_consumed.is_some());
    // SAFETY: all-zero is valid for these C structs; the plugin fills them.
    let (mut p8, mut p7): (NcclNetPropertiesV8, NcclNetPropertiesV7) =
        unsafe { (std::mem::zeroed(), std::mem::zeroed()) };
    // SAFETY: storage for one struct each.
    unsafe {
        assert_eq!(tb.t.get_properties.unwrap()(0, &mut p8), 0);
        assert_eq!(tb.v7.get_properties.unwrap()(0, &mut p7), 0);
        assert_ne!(tb.t.get_properties.unwrap()(1, &mut p8), 0, "only device 0");
    }
    for (ptr, recvs, ty, ver, speed) in [
        (
            p8.ptr_support,
            p8.max_recvs,
            p8.net_device_type,
            p8.net_device_version,
            p8.speed,
        ),
        (
            p7.ptr_support,
            p7.max_recvs,
            p7.net_device_type,
            p7.net_device_version,
            p7.speed,
        ),
    ] {
        assert_eq!(ptr, NCCL_PTR_HOST | NCCL_PTR_CUDA);
        assert_eq!(recvs, 1);
        assert_eq!(ty, NCCL_NET_DEVICE_UNPACK);
        assert_eq!(ver, NCCL_NET_DEVICE_UNPACK_VERSION);
        assert!(speed > 0);
    }
}

#[test]
fn tcpx_rules_are_enforced() {
    let Some((_g, path)) = setup() else { return };
    let tb = table(&path);
    let p = tb.pair();
    let src = pattern(64 << 10, 1);
    let (r, smh) = tb.reg(p.send, src.as_ptr(), src.len(), NCCL_PTR_HOST);
    assert_eq!(r, 0);
    let mut dst = vec![0u8; 64 << 10];
    let (r, rmh) = tb.reg(p.recv, dst.as_ptr(), dst.len(), NCCL_PTR_HOST);
    assert_eq!(r, 0);

    // A GPU registration must be 4 KiB-aligned.
    let unaligned = ((src.as_ptr() as usize + 4096) & !4095) + 1;
    let (r, _) = tb.reg(p.send, unaligned as *const u8, 100, NCCL_PTR_CUDA);
    assert_ne!(r, 0, "unaligned GPU regMr must fail");

    // irecv takes n == 1.
    let (r, req) = tb.irecv_n(p.recv, 2, dst.as_mut_ptr(), 1024, rmh);
    assert_eq!(r, NCCL_INTERNAL_ERROR, "irecv with n=2 must fail");
    assert!(req.is_null());

    // An UNPACK receive takes at most 4 MiB (2048 fragments).
    let mut big = vec![0u8; 5 << 20];
    let (r, bmh) = tb.reg(p.recv, big.as_ptr(), big.len(), NCCL_PTR_HOST);
    assert_eq!(r, 0);
    let (r, _) = tb.irecv_n(p.recv, 1, big.as_mut_ptr(), big.len(), bmh);
    assert_eq!(r, NCCL_INTERNAL_ERROR, "a 5 MiB UNPACK receive must fail");

    // 16 sends in flight; the 17th fails with internal error.
    let mut sends = Vec::new();
    for i in 0..16 {
        let (r, req) = tb.isend(p.send, src[i * 1024..].as_ptr(), 1024, smh);
        assert_eq!(r, 0, "send {i}");
        assert!(!req.is_null());
        sends.push(req);
    }
    let (r, req) = tb.isend(p.send, src.as_ptr(), 1024, smh);
    assert_eq!(r, NCCL_INTERNAL_ERROR, "the 17th isend must fail with 3");
    assert!(req.is_null());

    // test only on the FIFO head.
    assert_eq!(
        tb.test(sends[1]).0,
        NCCL_INTERNAL_ERROR,
        "testing a non-head send must fail"
    );

    // 16 receives in flight; the 17th fails.
    let mut recvs = Vec::new();
    for i in 0..16 {
        let (r, req) = tb.irecv_n(p.recv, 1, dst[i * 4096..].as_mut_ptr(), 4096, rmh);
        assert_eq!(r, 0, "receive {i}");
        recvs.push(req);
    }
    let (r, _) = tb.irecv_n(p.recv, 1, dst.as_mut_ptr(), 4096, rmh);
    assert_eq!(r, NCCL_INTERNAL_ERROR, "the 17th irecv must fail with 3");
    assert_eq!(
        tb.test(recvs[3]).0,
        NCCL_INTERNAL_ERROR,
        "testing a non-head receive must fail"
    );

    // Drain the sends in order.
    for (i, &s) in sends.iter().enumerate() {
        assert_eq!(tb.wait(s), 1024, "send {i} reports its size");
    }
    // Receives: done in order; a receive keeps its slot until consumed.
    let r0 = tb.wait(recvs[0]);
    assert_eq!(r0, -1, "in UNPACK mode test reports no size (as TCPX)");
    tb.wait(recvs[1]);
    assert_eq!(
        tb.consumed(p.recv, recvs[1]),
        NCCL_INVALID_USAGE,
        "irecvConsumed out of FIFO order must fail"
    );
    assert_eq!(
        tb.consumed(p.recv, recvs[2]),
        NCCL_INVALID_USAGE,
        "irecvConsumed before test said done must fail"
    );
    let (r, _) = tb.irecv_n(p.recv, 1, dst.as_mut_ptr(), 4096, rmh);
    assert_eq!(
        r, NCCL_INTERNAL_ERROR,
        "done receives still hold their slots"
    );
    assert_eq!(tb.consumed(p.recv, recvs[0]), 0);
    assert_eq!(tb.consumed(p.recv, recvs[1]), 0);
    for &q in &recvs[2..] {
        tb.wait(q);
        assert_eq!(tb.consumed(p.recv, q), 0);
    }
    // iflush is not for TCPX receive comms.
    let mut fr: *mut c_void = std::ptr::null_mut();
    // SAFETY: a live receive comm; the arrays are not read by the plugin.
    let r = unsafe {
        tb.t.iflush.unwrap()(
            p.recv,
            1,
            std::ptr::null_mut(),
            std::ptr::null_mut(),
            std::ptr::null_mut(),
            &mut fr,
        )
    };
    assert_ne!(r, 0, "iflush must fail on an UNPACK receive comm");
    // Stale tokens are errors, not crashes.
    assert_eq!(tb.test(sends[0]).0, NCCL_INVALID_ARGUMENT);
    tb.close(p);
}

#[test]
fn unpack_contract_host_mode() {
    let Some((_g, path)) = setup() else { return };
    let tb = table(&path);
    let p = tb.pair();
    // SAFETY: the plugin wrote a device handle into the storage on accept.
    let dh = unsafe { std::ptr::read(p.dev.0.as_ptr() as *const NcclNetDeviceHandleV7) };
    assert_eq!(dh.net_device_type, NCCL_NET_DEVICE_UNPACK);
    assert_eq!(dh.net_device_version, 0x7);
    assert_eq!(dh.needs_proxy_progress, 1);
    assert_eq!(dh.size, std::mem::size_of::<UnpackNetDeviceHandle>());
    // Host mode: `handle` is a host pointer to {meta, bounce_buf, head}.
    // SAFETY: host mode's handle points at a live unpackNetDeviceHandle.
    let uh = unsafe { std::ptr::read(dh.handle as *const UnpackNetDeviceHandle) };
    assert_eq!(uh.head, u64::MAX);
    assert!(!uh.meta.is_null() && !uh.bounce_buf.is_null());

    let sizes = [0usize, 1, 4096, 5000, 1 << 20, (4 << 20) - 67];
    let srcs: Vec<Vec<u8>> = sizes.iter().map(|&n| pattern(n, n as u8)).collect();
    let mut dsts: Vec<Vec<u8>> = sizes.iter().map(|&n| vec![0u8; n + 64]).collect();
    let mut reqs = Vec::new();
    for (i, d) in dsts.iter_mut().enumerate() {
        let (r, mh) = tb.reg(p.recv, d.as_ptr(), d.len(), NCCL_PTR_HOST);
        assert_eq!(r, 0);
        let (r, q) = tb.irecv_n(p.recv, 1, d.as_mut_ptr(), d.len(), mh);
        assert_eq!(r, 0, "receive {i}");
        reqs.push(q);
    }
    for s in &srcs {
        let (r, mh) = tb.reg(p.send, s.as_ptr(), s.len().max(1), NCCL_PTR_HOST);
        assert_eq!(r, 0);
        let (r, q) = tb.isend(p.send, s.as_ptr(), s.len(), mh);
        assert_eq!(r, 0);
        tb.wait(q);
    }
    for (k, &q) in reqs.iter().enumerate() {
        tb.wait(q);
        let slot = k % 16;
        // SAFETY: the receive is done and not consumed: its slot is stable.
        let cnt = unsafe { std::ptr::addr_of!((*uh.meta).cnt[slot]).read_volatile() } as usize;
        assert!(cnt <= NET_UNPACK_MAX_SLICE_PAGES);
        let frags: Vec<LoadMeta> = (0..cnt)
            // SAFETY: as above, i < cnt ≤ 2048.
            .map(|i| unsafe { std::ptr::addr_of!((*uh.meta).mem[slot][i]).read_volatile() })
            .collect();
        let total: usize = frags.iter().map(|f| f.len as usize).sum();
        assert_eq!(total, sizes[k], "fragments carry the message");
        assert!(
            sizes[k] < 8192
                || frags
                    .iter()
                    .any(|f| f.src_off % 16 != (f.dst_off % 16) as u32),
            "fragments are scattered unaligned"
        );
        let mut out = vec![0u8; sizes[k] + 64];
        // SAFETY: the bounce pages stay valid until irecvConsumed.
        let n = unsafe {
            tcpx_p2p::internal::gpu::unpack::unpack_host_raw(
                uh.bounce_buf as *const u8,
                &mut out,
                &frags,
            )
        }
        .unwrap();
        assert_eq!(n, sizes[k]);
        assert!(
            out[..sizes[k]] == srcs[k][..],
            "unpacked bytes match, size {}",
            sizes[k]
        );
        assert!(
            dsts[k].iter().all(|&b| b == 0),
            "UNPACK leaves the receive buffer alone"
        );
        assert_eq!(tb.consumed(p.recv, q), 0);
    }
    tb.close(p);
}

struct EnvGuard(Vec<&'static str>);

impl EnvGuard {
    fn set(vars: &[(&'static str, &str)]) -> Self {
        for (k, v) in vars {
            std::env::set_var(k, v);
        }
        EnvGuard(vars.iter().map(|(k, _)| *k).collect())
    }
}

impl Drop for EnvGuard {
    fn drop(&mut self) {
        for k in &self.0 {
            std::env::remove_var(k);
        }
    }
}

#[test]
fn plain_mode_and_injected_faults() {
    let Some((_g, path)) = setup() else { return };
    let tb = table(&path);
    let mut dst = vec![0u8; 1 << 16];
    let src = pattern(1 << 16, 5);

    // Plain mode: the payload lands in the buffer; test reports the size.
    {
        let _e = EnvGuard::set(&[("NCCL_NET_EMU_UNPACK", "0")]);
        let p = tb.pair();
        // SAFETY: the storage is ours; plain mode writes nothing into it.
        let dh = unsafe { std::ptr::read(p.dev.0.as_ptr() as *const NcclNetDeviceHandleV7) };
        assert_eq!(dh.net_device_type, NCCL_NET_DEVICE_HOST);
        let (_, smh) = tb.reg(p.send, src.as_ptr(), src.len(), NCCL_PTR_HOST);
        let (_, rmh) = tb.reg(p.recv, dst.as_ptr(), dst.len(), NCCL_PTR_HOST);
        let (_, rq) = tb.irecv_n(p.recv, 1, dst.as_mut_ptr(), dst.len(), rmh);
        let (_, sq) = tb.isend(p.send, src.as_ptr(), 1000, smh);
        assert_eq!(tb.wait(sq), 1000);
        assert_eq!(tb.wait(rq), 1000);
        assert_eq!(dst[..1000], src[..1000]);
        assert_eq!(tb.consumed(p.recv, rq), 0);
        tb.close(p);
    }

    // Refused connections.
    {
        let _e = EnvGuard::set(&[("NCCL_NET_EMU_REFUSE", "1")]);
        let mut handle = [0u8; NCCL_NET_HANDLE_MAXSIZE];
        let mut l: *mut c_void = std::ptr::null_mut();
        let mut s: *mut c_void = std::ptr::null_mut();
        let mut sd: *mut NcclNetDeviceHandleV7 = std::ptr::null_mut();
        // SAFETY: handle buffer and out-pointers as the ABI wants.
        unsafe {
            assert_eq!(
                tb.t.listen.unwrap()(0, handle.as_mut_ptr() as *mut c_void, &mut l),
                0
            );
            let r = tb.t.connect.unwrap()(0, handle.as_mut_ptr() as *mut c_void, &mut s, &mut sd);
            assert_eq!(r, NCCL_SYSTEM_ERROR, "a refused connect fails");
            assert!(s.is_null());
            assert_eq!(tb.t.close_listen.unwrap()(l), 0);
        }
    }

    // Completions reported late.
    {
        let _e = EnvGuard::set(&[("NCCL_NET_EMU_DELAY_MS", "300")]);
        let p = tb.pair();
        let (_, smh) = tb.reg(p.send, src.as_ptr(), src.len(), NCCL_PTR_HOST);
        let (_, rmh) = tb.reg(p.recv, dst.as_ptr(), dst.len(), NCCL_PTR_HOST);
        let t0 = Instant::now();
        let (_, rq) = tb.irecv_n(p.recv, 1, dst.as_mut_ptr(), dst.len(), rmh);
        let (_, sq) = tb.isend(p.send, src.as_ptr(), 10, smh);
        tb.wait(sq);
        tb.wait(rq);
        assert!(
            t0.elapsed() >= Duration::from_millis(300),
            "completions are delayed"
        );
        assert_eq!(tb.consumed(p.recv, rq), 0);
        tb.close(p);
    }

    // The peer is dropped after N bytes: both sides' requests fail.
    {
        let _e = EnvGuard::set(&[("NCCL_NET_EMU_DROP_AFTER_BYTES", "1000")]);
        let p = tb.pair();
        let (_, smh) = tb.reg(p.send, src.as_ptr(), src.len(), NCCL_PTR_HOST);
        let (_, rmh) = tb.reg(p.recv, dst.as_ptr(), dst.len(), NCCL_PTR_HOST);
        let (_, rq) = tb.irecv_n(p.recv, 1, dst.as_mut_ptr(), dst.len(), rmh);
        let (_, sq) = tb.isend(p.send, src.as_ptr(), 4096, smh);
        let deadline = Instant::now() + Duration::from_secs(10);
        let fails = |q| loop {
            let (r, done, _) = tb.test(q);
            if r != 0 {
                return r;
            }
            assert!(!done, "a dropped transfer must not complete");
            assert!(Instant::now() < deadline, "the drop was not noticed");
            std::thread::sleep(Duration::from_millis(1));
        };
        assert_eq!(fails(sq), NCCL_REMOTE_ERROR);
        assert_eq!(fails(rq), NCCL_REMOTE_ERROR);
        tb.close(p);
    }
}

// ----------------------------------------------------------- GPU (skipped without CUDA)

use tcpx_p2p::internal::gpu;

/// Two endpoints on GPU 0 and GPU 1 (or both on GPU 0 with one GPU).
fn gpu_endpoints(cfg: Config) -> (Endpoint, Endpoint, u64, u64) {
    let second = if gpu::device_count() > 1 { 1 } else { 0 };
    let a = Endpoint::new(Some(0), cfg.clone()).unwrap();
    let b = Endpoint::new(Some(second), cfg).unwrap();
    let addr = b.local_addr();
    let ca = a
        .connect(&addr.ip().to_string(), addr.port(), None)
        .unwrap();
    let cb = b.accept(Some(Duration::from_secs(20))).unwrap().conn;
    (a, b, ca, cb)
}

/// A device buffer filled from `init`.
fn device_buf(ordinal: i32, init: &[u8]) -> gpu::DeviceBuf {
    let dev = gpu::Device::get(ordinal).unwrap();
    // TCPX registers GPU memory only 4 KiB-aligned; small cuMemAlloc
    // allocations share pages, so take at least 2 MiB (page-aligned).
    let b = gpu::DeviceBuf::new(&dev, init.len().max(2 << 20)).unwrap();
    // SAFETY: the device buffer holds `init.len()` bytes.
    unsafe { gpu::copy_sync(b.ptr, init.as_ptr() as u64, init.len()) }.unwrap();
    b
}

fn read_back(b: &gpu::DeviceBuf, len: usize) -> Vec<u8> {
    let mut v = vec![0u8; len];
    // SAFETY: the device buffer holds at least `len` bytes.
    unsafe { gpu::copy_sync(v.as_mut_ptr() as u64, b.ptr, len) }.unwrap();
    v
}

#[test]
fn gpu_buffers_over_the_plugin_go_through_the_unpack_kernel() {
    let Some((_g, path)) = setup() else { return };
    if !gpu::available() {
        eprintln!("SKIPPED: no CUDA on this machine");
        return;
    }
    let cfg = Config {
        chunk: 4 << 20,
        ..plugin_cfg(&path)
    };
    let (a, b, ca, cb) = gpu_endpoints(cfg);
    let second = b.gpu_index();
    for &n in &[1usize, 4095, 1 << 20, (4 << 20) + 3, 64 << 20] {
        let src = pattern(n, 0x3c);
        let s = device_buf(0, &src);
        let d = device_buf(second, &vec![0u8; n]);
        let sb = reg_buf(&a, s.ptr, n);
        let rb = reg_buf(&b, d.ptr, n);
        let r = b.recv_async(cb, &[rb]).unwrap();
        let x = a.send_async(ca, &[sb]).unwrap();
        assert!(a.wait(x, Some(Duration::from_secs(60))).unwrap());
        assert!(b.wait(r, Some(Duration::from_secs(60))).unwrap());
        let got = read_back(&d, n);
        assert_eq!(checksum(&got), checksum(&src), "size {n}");
        assert!(got == src, "size {n}");
        a.dereg(sb.mr).unwrap();
        b.dereg(rb.mr).unwrap();
    }
}

/// GPU → GPU throughput, plugin net (the emulator, UNPACK through the
/// kernel) beside the socket net, for 16 MiB and 256 MiB. Writes JSON to
/// `$PLUGIN_BENCH_OUT` (or prints it). Run by benchmarks/gpu_plugin_check.sh.
#[test]
#[ignore = "needs GPUs; run by benchmarks/gpu_plugin_check.sh"]
fn gpu_throughput_plugin_vs_socket() {
    let Some((_g, path)) = setup() else { return };
    let mut rows = Vec::new();
    if gpu::available() {
        let nets = [
            (
                "plugin",
                // What a user of the plugin net gets by default.
                Config {
                    chunk: tcpx_p2p::internal::PLUGIN_CHUNK,
                    channels: tcpx_p2p::internal::PLUGIN_CHANNELS,
                    ..plugin_cfg(&path)
                },
            ),
            (
                "socket",
                Config {
                    ifname: Some("lo".into()),
                    ..Config::default()
                },
            ),
        ];
        for (name, cfg) in nets {
            let (a, b, ca, cb) = gpu_endpoints(cfg);
            let second = b.gpu_index();
            for &(n, iters) in &[(16usize << 20, 20), (256usize << 20, 4)] {
                let src = pattern(n, 7);
                let s = device_buf(0, &src);
                let d = device_buf(second, &vec![0u8; n]);
                let sb = reg_buf(&a, s.ptr, n);
                let rb = reg_buf(&b, d.ptr, n);
                let once = || {
                    let r = b.recv_async(cb, &[rb]).unwrap();
                    let x = a.send_async(ca, &[sb]).unwrap();
                    assert!(a.wait(x, Some(Duration::from_secs(120))).unwrap());
                    assert!(b.wait(r, Some(Duration::from_secs(120))).unwrap());
                };
                once();
                let t = Instant::now();
                for _ in 0..iters {
                    once();
                }
                let secs = t.elapsed().as_secs_f64();
                let ok = read_back(&d, n) == src;
                rows.push(format!(
                    "    {{\"net\": \"{name}\", \"bytes\": {n}, \"iters\": {iters}, \"gbps\": {:.3}, \"correct\": {ok}, \"gpus\": [0, {second}]}}",
                    (n * iters) as f64 / secs / 1e9
                ));
                a.dereg(sb.mr).unwrap();
                b.dereg(rb.mr).unwrap();
            }
        }
    }
    let json = if rows.is_empty() {
        "{\"skipped\": \"no CUDA\"}\n".to_string()
    } else {
        format!("{{\"throughput\": [\n{}\n]}}\n", rows.join(",\n"))
    };
    if let Ok(p) = std::env::var("PLUGIN_BENCH_OUT") {
        std::fs::write(p, &json).unwrap();
    }
    println!("{json}");
}

#[test]
fn loader_refuses_receives_tcpx_cannot_take() {
    use tcpx_p2p::net::{MemRef, NetHandle};
    use tcpx_p2p::MemKind;
    let Some((_g, path)) = setup() else { return };
    let net = PluginNet::load(&path, None).unwrap();
    let waker: tcpx_p2p::net::Waker = std::sync::Arc::new(|| {});
    let mut l = net.listen(0).unwrap();
    let h: NetHandle = l.handle();
    let (mut s, mut r) = (None, None);
    let deadline = Instant::now() + Duration::from_secs(10);
    while s.is_none() || r.is_none() {
        assert!(Instant::now() < deadline);
        if s.is_none() {
            s = net.connect(0, &h, waker.clone()).unwrap();
        }
        if r.is_none() {
            r = l.accept(waker.clone()).unwrap();
        }
    }
    let mut r = r.unwrap();
    let mut big = vec![0u8; (4 << 20) + 1];
    let mem = MemRef {
        addr: big.as_mut_ptr() as u64,
        len: big.len(),
        kind: MemKind::Host,
    };
    let mr = r.reg_mr(mem).unwrap();
    let e = r
        .irecv(mem, mr)
        .expect_err("a receive over 4 MiB must be refused");
    assert!(e.to_string().contains("4 MiB"), "{e}");
    let ok = MemRef {
        len: 4 << 20,
        ..mem
    };
    assert!(r.irecv(ok, mr).unwrap().is_some(), "4 MiB is fine");
}

#[test]
fn the_v7_table_moves_bytes_as_tcpx_exports_it() {
    use tcpx_p2p::net::MemRef;
    use tcpx_p2p::MemKind;
    let Some((_g, path)) = setup() else { return };
    let net = PluginNet::load_version(&path, None, 7).unwrap();
    assert_eq!(net.version(), 7);
    assert_eq!(
        net.plugin_devices()[0].net_device_type,
        NCCL_NET_DEVICE_UNPACK
    );
    let waker: tcpx_p2p::net::Waker = std::sync::Arc::new(|| {});
    let mut l = net.listen(0).unwrap();
    let h = l.handle();
    let (mut s, mut r) = (None, None);
    let deadline = Instant::now() + Duration::from_secs(10);
    while s.is_none() || r.is_none() {
        assert!(Instant::now() < deadline);
        if s.is_none() {
            s = net.connect(0, &h, waker.clone()).unwrap();
        }
        if r.is_none() {
            r = l.accept(waker.clone()).unwrap();
        }
    }
    let (mut s, mut r) = (s.unwrap(), r.unwrap());
    let sizes = [0usize, 3, 4096, 123_457, 4 << 20];
    let srcs: Vec<Vec<u8>> = sizes.iter().map(|&n| pattern(n, 0x71)).collect();
    let mut dsts: Vec<Vec<u8>> = sizes.iter().map(|_| vec![0u8; 4 << 20]).collect();
    let mut rq = Vec::new();
    for d in dsts.iter_mut() {
        let m = MemRef {
            addr: d.as_mut_ptr() as u64,
            len: d.len(),
            kind: MemKind::Host,
        };
        let mr = r.reg_mr(m).unwrap();
        rq.push(r.irecv(m, mr).unwrap().unwrap());
    }
    let mut sq = Vec::new();
    for src in &srcs {
        let m = MemRef {
            addr: src.as_ptr() as u64,
            len: src.len(),
            kind: MemKind::Host,
        };
        let mr = s
            .reg_mr(MemRef {
                len: m.len.max(1),
                ..m
            })
            .unwrap();
        sq.push(s.isend(m, mr).unwrap().unwrap());
    }
    let wait = |f: &mut dyn FnMut() -> Option<usize>| {
        let deadline = Instant::now() + Duration::from_secs(10);
        loop {
            if let Some(n) = f() {
                return n;
            }
            assert!(Instant::now() < deadline, "request did not complete");
            std::thread::yield_now();
        }
    };
    for (i, q) in sq.into_iter().enumerate() {
        assert_eq!(wait(&mut || s.test(q).unwrap()), sizes[i]);
    }
    for (i, q) in rq.into_iter().enumerate() {
        assert_eq!(
            wait(&mut || r.test(q).unwrap()),
            sizes[i],
            "size reported from the fragments"
        );
        assert!(dsts[i][..sizes[i]] == srcs[i][..], "size {}", sizes[i]);
        assert!(
            dsts[i][sizes[i]..].iter().all(|&b| b == 0),
            "nothing past the message"
        );
    }
}
