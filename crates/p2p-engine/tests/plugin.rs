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

use ncclnet_abi::*;
use tcpx_p2p::net::Net;
use tcpx_p2p::net::PluginNet;
use tcpx_p2p::FifoItem;
use tcpx_p2p::{Config, Endpoint, NetKind};

mod common;
use common::{buf, emu_path, pattern, reg_buf};

/// The flow-steering wait the tests use (TCPX's default, 5 s, is kept by
/// one test that measures set-up time).
const TEST_STEER_WAIT_MICROS: &str = "1000";

/// Serialises the tests (they share the environment) and finds the
/// emulator; None (with a message) when it is not built. Sets the TCPX
/// settings a user sets: the chunk size, and a short flow-steering wait.
fn setup() -> Option<(MutexGuard<'static, ()>, String)> {
    static LOCK: Mutex<()> = Mutex::new(());
    let guard = LOCK.lock().unwrap_or_else(|e| e.into_inner());
    tcpx_p2p::init_logging();
    std::env::set_var("NCCL_DYNAMIC_CHUNK_SIZE", "524288");
    std::env::set_var(
        "NCCL_GPUDIRECTTCPX_PROGRAM_FLOW_STEERING_WAIT_MICROS",
        TEST_STEER_WAIT_MICROS,
    );
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
    assert_eq!(net.version(), 7, "the stand-in exports v7 only, as TCPX");
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

/// The emulator's v7 table (the only one it exports, as TCPX), read
/// straight from the library.
struct Table {
    lib: libloading::Library,
    t: NcclNetV7,
}

fn table(path: &str) -> Table {
    // SAFETY: loads an ncclNet plugin, whose initialisers are harmless.
    let lib = unsafe { libloading::Library::new(path) }.unwrap();
    // SAFETY: the symbol is the plugin's exported table (ABI promise);
    // copied while the library is loaded, and the library is kept.
    let t = unsafe {
        let p7 = *lib.get::<*const NcclNetV7>(SYMBOL_V7).unwrap();
        std::ptr::read(p7)
    };
    let init = t.init.unwrap();
    // SAFETY: init without a logger is allowed; it may run more than once.
    assert_eq!(unsafe { init(None) }, NCCL_SUCCESS);
    Table { lib, t }
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
        let r =
            unsafe { self.t.reg_mr.unwrap()(comm, p as *mut c_void, len as c_int, ty, &mut mh) };
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

    /// Waits for `req`, testing the heads of `others` (another comm's
    /// requests, oldest first) meanwhile: data moves only inside `test`,
    /// so both sides of a transfer must be tested.
    fn wait_with(
        &self,
        req: *mut c_void,
        others: &mut std::collections::VecDeque<*mut c_void>,
    ) -> c_int {
        let deadline = Instant::now() + Duration::from_secs(10);
        loop {
            let (r, done, size) = self.test(req);
            assert_eq!(r, 0, "test failed");
            if done {
                return size;
            }
            if let Some(&o) = others.front() {
                let (r, done, _) = self.test(o);
                assert_eq!(r, 0, "test failed");
                if done {
                    others.pop_front();
                }
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
    // SAFETY: the table's name is a static NUL-terminated string.
    let n7 = unsafe { CStr::from_ptr(tb.t.name) };
    assert_eq!(n7.to_str().unwrap(), "NcclNetEmu");
    // SAFETY: looking a symbol up only.
    let v8 = unsafe { tb.lib.get::<*const NcclNetV8>(SYMBOL_V8) };
    assert!(
        v8.is_err(),
        "TCPX exports no v8 table; neither does the default build"
    );
    assert!(tb.t.reg_mr_dma_buf.is_none() && tb.t.irecv_consumed.is_some());
    // SAFETY: all-zero is valid for this C struct; the plugin fills it.
    let mut p7: NcclNetPropertiesV7 = unsafe { std::mem::zeroed() };
    // SAFETY: storage for one struct.
    unsafe {
        assert_eq!(tb.t.get_properties.unwrap()(0, &mut p7), 0);
    }
    let mut n: c_int = 0;
    // SAFETY: one int.
    assert_eq!(unsafe { tb.t.devices.unwrap()(&mut n) }, 0);
    // SAFETY: storage for one struct.
    assert_ne!(
        unsafe { tb.t.get_properties.unwrap()(n, &mut p7) },
        0,
        "no device past the last"
    );
    assert_eq!(p7.ptr_support, NCCL_PTR_HOST | NCCL_PTR_CUDA);
    assert_eq!(p7.max_recvs, 1);
    assert_eq!(p7.net_device_type, NCCL_NET_DEVICE_UNPACK);
    assert_eq!(p7.net_device_version, NCCL_NET_DEVICE_UNPACK_VERSION);
    assert!(p7.speed > 0);
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

    // A GPU registration must be 4 KiB-aligned (address and size).
    let aligned = (src.as_ptr() as usize + 4095) & !4095;
    let (r, _) = tb.reg(p.send, (aligned + 1) as *const u8, 4096, NCCL_PTR_CUDA);
    assert_eq!(r, NCCL_INTERNAL_ERROR, "unaligned GPU regMr must fail");
    let (r, _) = tb.reg(p.send, aligned as *const u8, 1000, NCCL_PTR_CUDA);
    assert_eq!(
        r, NCCL_INTERNAL_ERROR,
        "a GPU regMr of 1,000 bytes must fail, aligned or not"
    );

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

    // Drain the sends in order (16 KiB: the socket's buffers take them
    // without the receiver's test).
    for (i, &s) in sends.iter().enumerate() {
        assert_eq!(tb.wait(s), -1, "send {i}: test reports no size (as TCPX)");
    }
    // Receives: done in order; a receive keeps its slot until consumed.
    let r0 = tb.wait(recvs[0]);
    assert_eq!(r0, -1, "in UNPACK mode test reports no size (as TCPX)");
    tb.wait(recvs[1]);
    assert_eq!(
        tb.consumed(p.recv, recvs[1]),
        NCCL_INTERNAL_ERROR,
        "irecvConsumed out of FIFO order must fail with 3"
    );
    assert_eq!(
        tb.consumed(p.recv, recvs[2]),
        NCCL_INTERNAL_ERROR,
        "irecvConsumed before test said done must fail with 3"
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
    let mut sq = std::collections::VecDeque::new();
    for s in &srcs {
        let (r, mh) = tb.reg(p.send, s.as_ptr(), s.len().max(1), NCCL_PTR_HOST);
        assert_eq!(r, 0);
        let (r, q) = tb.isend(p.send, s.as_ptr(), s.len(), mh);
        assert_eq!(r, 0);
        sq.push_back(q);
    }
    for (k, &q) in reqs.iter().enumerate() {
        tb.wait_with(q, &mut sq);
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
            tcpx_p2p_gpu::unpack::unpack_host_raw(uh.bounce_buf as *const u8, &mut out, &frags)
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
    while let Some(q) = sq.pop_front() {
        tb.wait(q);
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
        let mut sends = [sq].into();
        assert_eq!(tb.wait_with(rq, &mut sends), 1000);
        for q in sends.drain(..) {
            tb.wait(q);
        }
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
        let mut sends = [sq].into();
        tb.wait_with(rq, &mut sends);
        for q in sends.drain(..) {
            tb.wait(q);
        }
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

use tcpx_p2p_gpu as gpu;

/// Two endpoints on GPU 0 and GPU 1 (or both on GPU 0 with one GPU).
/// The set-up of the GPU tests over the plugin: the stand-in, 4 MiB chunks,
/// two GPU endpoints connected (`None`, with the reason said, without CUDA
/// or the stand-in).
fn gpu_plugin_pair() -> Option<(MutexGuard<'static, ()>, Endpoint, Endpoint, u64, u64)> {
    let (g, path) = setup()?;
    if !gpu::available() {
        eprintln!("SKIPPED: no CUDA on this machine");
        return None;
    }
    let cfg = Config {
        chunk: 4 << 20,
        ..plugin_cfg(&path)
    };
    let (a, b, ca, cb) = gpu_endpoints(cfg);
    Some((g, a, b, ca, cb))
}

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
    let Some((_g, a, b, ca, cb)) = gpu_plugin_pair() else {
        return;
    };
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
                    chunk: tcpx_p2p::PLUGIN_CHUNK,
                    channels: tcpx_p2p::PLUGIN_CHANNELS,
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
    // Data moves only inside test: both sides' heads are tested together.
    let (mut sq, mut rq): (std::collections::VecDeque<_>, std::collections::VecDeque<_>) =
        (sq.into(), rq.into());
    let mut got = Vec::new();
    let deadline = Instant::now() + Duration::from_secs(10);
    while !sq.is_empty() || !rq.is_empty() {
        if let Some(&q) = sq.front() {
            if let Some(n) = s.test(q).unwrap() {
                assert_eq!(n, sizes[sizes.len() - sq.len()]);
                sq.pop_front();
            }
        }
        if let Some(&q) = rq.front() {
            if let Some(n) = r.test(q).unwrap() {
                got.push(n);
                rq.pop_front();
            }
        }
        assert!(Instant::now() < deadline, "requests did not complete");
        std::thread::yield_now();
    }
    for (i, &n) in got.iter().enumerate() {
        assert_eq!(n, sizes[i], "size reported from the fragments");
        assert!(dsts[i][..sizes[i]] == srcs[i][..], "size {}", sizes[i]);
        assert!(
            dsts[i][sizes[i]..].iter().all(|&b| b == 0),
            "nothing past the message"
        );
    }
}

// ----------------------------------------------------------- as strict as TCPX

/// Reads `v` without letting the compiler assume nobody else writes it.
fn volatile_all_zero(v: &[u8]) -> bool {
    // SAFETY: each index is inside `v`.
    (0..v.len()).all(|i| unsafe { std::ptr::read_volatile(v.as_ptr().add(i)) } == 0)
}

/// Data moves only for work `test` scheduled: a send and a receive posted
/// and never tested move nothing, a send tested alone does not fill the
/// receive, and both tested complete with the right bytes. The explicit
/// loosening (`NCCL_NET_EMU_LENIENT_BACKGROUND_PROGRESS=1`) moves it all
/// with no call of test, as the stand-in did before.
#[test]
fn data_moves_only_inside_test() {
    let Some((_g, path)) = setup() else { return };
    let tb = table(&path);
    let n = 1 << 20;
    let src = pattern(n, 9);
    // Plain mode: the payload lands in the receive buffer, where it shows.
    let _plain = EnvGuard::set(&[("NCCL_NET_EMU_UNPACK", "0")]);
    let mut dst = vec![0u8; n];
    let p = tb.pair();
    let (_, smh) = tb.reg(p.send, src.as_ptr(), n, NCCL_PTR_HOST);
    let (_, rmh) = tb.reg(p.recv, dst.as_ptr(), n, NCCL_PTR_HOST);
    let (r, rq) = tb.irecv_n(p.recv, 1, dst.as_mut_ptr(), n, rmh);
    assert_eq!(r, 0);
    let (r, sq) = tb.isend(p.send, src.as_ptr(), n, smh);
    assert_eq!(r, 0);
    std::thread::sleep(Duration::from_millis(500));
    assert!(volatile_all_zero(&dst), "nothing moves without test");
    // The send alone: its bytes leave (into the kernel's buffers), the
    // receive, never tested, takes none.
    let mut sends = std::collections::VecDeque::from([sq]);
    let t0 = Instant::now();
    while t0.elapsed() < Duration::from_millis(500) && !sends.is_empty() {
        let (r, done, _) = tb.test(sq);
        assert_eq!(r, 0);
        if done {
            sends.clear();
        }
        std::thread::yield_now();
    }
    std::thread::sleep(Duration::from_millis(200));
    assert!(
        volatile_all_zero(&dst),
        "an untested receive takes no bytes"
    );
    tb.wait_with(rq, &mut sends);
    for q in sends.drain(..) {
        tb.wait(q);
    }
    assert_eq!(checksum(&dst), checksum(&src));
    assert_eq!(tb.consumed(p.recv, rq), 0);
    tb.close(p);

    // The explicit loosening.
    let _lenient = EnvGuard::set(&[("NCCL_NET_EMU_LENIENT_BACKGROUND_PROGRESS", "1")]);
    let mut dst = vec![0u8; n];
    let p = tb.pair();
    let (_, smh) = tb.reg(p.send, src.as_ptr(), n, NCCL_PTR_HOST);
    let (_, rmh) = tb.reg(p.recv, dst.as_ptr(), n, NCCL_PTR_HOST);
    let (_, rq) = tb.irecv_n(p.recv, 1, dst.as_mut_ptr(), n, rmh);
    let (_, sq) = tb.isend(p.send, src.as_ptr(), n, smh);
    std::thread::sleep(Duration::from_millis(1000));
    let (r, done, _) = tb.test(rq);
    assert!(r == 0 && done, "lenient: the bytes moved without test");
    assert_eq!(checksum(&dst), checksum(&src));
    assert_eq!(tb.consumed(p.recv, rq), 0);
    tb.wait(sq);
    tb.close(p);
}

/// connect hands out no comm until the peer's accept has run; accept takes
/// 100 ms per socket and then the flow-steering wait.
#[test]
fn connect_waits_for_the_peer_accept_and_accept_for_flow_steering() {
    let Some((_g, path)) = setup() else { return };
    let tb = table(&path);
    let wait = Duration::from_millis(400);
    let _e = EnvGuard::set(&[(
        "NCCL_GPUDIRECTTCPX_PROGRAM_FLOW_STEERING_WAIT_MICROS",
        "400000",
    )]);
    let t = &tb.t;
    let mut handle = [0u8; NCCL_NET_HANDLE_MAXSIZE];
    let mut listen: *mut c_void = std::ptr::null_mut();
    // SAFETY: 128-byte handle buffer, one out-pointer.
    assert_eq!(
        unsafe { t.listen.unwrap()(0, handle.as_mut_ptr() as *mut c_void, &mut listen) },
        0
    );
    let mut send: *mut c_void = std::ptr::null_mut();
    let mut connect = |send: &mut *mut c_void| {
        let mut sd: *mut NcclNetDeviceHandleV7 = std::ptr::null_mut();
        // SAFETY: the same handle buffer on every call, as required.
        let r = unsafe { t.connect.unwrap()(0, handle.as_mut_ptr() as *mut c_void, send, &mut sd) };
        assert_eq!(r, 0);
    };
    let t0 = Instant::now();
    while t0.elapsed() < Duration::from_millis(1500) {
        connect(&mut send);
        assert!(send.is_null(), "no send comm before the peer's accept");
        std::thread::sleep(Duration::from_millis(5));
    }
    let mut dev = Box::new(Storage([0u8; 64]));
    let mut recv: *mut c_void = std::ptr::null_mut();
    let first_accept = Instant::now();
    let (mut accepted, mut connected) = (None, None);
    while accepted.is_none() || connected.is_none() {
        assert!(first_accept.elapsed() < Duration::from_secs(10));
        if recv.is_null() {
            let mut dp = dev.0.as_mut_ptr() as *mut NcclNetDeviceHandleV7;
            // SAFETY: a live listen comm and 64 bytes of aligned storage.
            assert_eq!(unsafe { t.accept.unwrap()(listen, &mut recv, &mut dp) }, 0);
            if !recv.is_null() {
                accepted = Some(first_accept.elapsed());
            }
        }
        if send.is_null() {
            connect(&mut send);
            if !send.is_null() {
                connected = Some(first_accept.elapsed());
                assert!(
                    accepted.is_some(),
                    "connect completed before accept returned"
                );
            }
        }
        std::thread::sleep(Duration::from_millis(1));
    }
    let accepted = accepted.unwrap();
    assert!(
        accepted >= wait + Duration::from_millis(200),
        "accept returned after {accepted:?}: 2 sockets × 100 ms + the flow-steering wait at least"
    );
    assert!(connected.unwrap() >= accepted);
    tb.close(Pair {
        listen,
        send,
        recv,
        dev,
    });
}

/// TCPX makes a receive comm's queue only when accept is given storage for
/// its device handle, and crashes at the first receive otherwise: the
/// stand-in fails that receive with internal error.
#[test]
fn accept_without_device_handle_storage_fails_the_first_receive() {
    let Some((_g, path)) = setup() else { return };
    let tb = table(&path);
    let t = &tb.t;
    let mut handle = [0u8; NCCL_NET_HANDLE_MAXSIZE];
    let mut listen: *mut c_void = std::ptr::null_mut();
    // SAFETY: 128-byte handle buffer, one out-pointer.
    assert_eq!(
        unsafe { t.listen.unwrap()(0, handle.as_mut_ptr() as *mut c_void, &mut listen) },
        0
    );
    let (mut send, mut recv): (*mut c_void, *mut c_void) =
        (std::ptr::null_mut(), std::ptr::null_mut());
    let deadline = Instant::now() + Duration::from_secs(10);
    while send.is_null() || recv.is_null() {
        assert!(Instant::now() < deadline);
        if send.is_null() {
            let mut sd: *mut NcclNetDeviceHandleV7 = std::ptr::null_mut();
            // SAFETY: the same handle buffer on every call.
            unsafe {
                t.connect.unwrap()(0, handle.as_mut_ptr() as *mut c_void, &mut send, &mut sd)
            };
        }
        if recv.is_null() {
            // SAFETY: a live listen comm; no device-handle storage.
            let r = unsafe { t.accept.unwrap()(listen, &mut recv, std::ptr::null_mut()) };
            assert_eq!(r, 0);
        }
        std::thread::sleep(Duration::from_millis(1));
    }
    let mut dst = vec![0u8; 4096];
    let (r, rmh) = tb.reg(recv, dst.as_ptr(), dst.len(), NCCL_PTR_HOST);
    assert_eq!(r, 0);
    let (r, q) = tb.irecv_n(recv, 1, dst.as_mut_ptr(), dst.len(), rmh);
    assert_eq!(r, NCCL_INTERNAL_ERROR);
    assert!(q.is_null());
    tb.close(Pair {
        listen,
        send,
        recv,
        dev: Box::new(Storage([0u8; 64])),
    });
}

/// One device per interface of `NCCL_GPUDIRECTTCPX_SOCKET_IFNAME`, named
/// after it, with its PCI path and a speed; comms listen on the device
/// asked for.
#[test]
fn one_device_per_configured_interface() {
    let Some((_g, path)) = setup() else { return };
    let tb = table(&path);
    let pci = "/sys/devices/pci0000:00/0000:00:04.0";
    let _e = EnvGuard::set(&[
        ("NCCL_GPUDIRECTTCPX_SOCKET_IFNAME", "lo,lo"),
        ("NCCL_NET_EMU_PCI_PATHS", &format!("lo={pci}")),
    ]);
    let mut n: c_int = 0;
    // SAFETY: one int.
    assert_eq!(unsafe { tb.t.devices.unwrap()(&mut n) }, 0);
    assert_eq!(n, 2, "one device per listed interface");
    for d in 0..n {
        // SAFETY: all-zero is valid for this C struct; the plugin fills it.
        let mut p: NcclNetPropertiesV7 = unsafe { std::mem::zeroed() };
        // SAFETY: storage for one struct.
        assert_eq!(unsafe { tb.t.get_properties.unwrap()(d, &mut p) }, 0);
        // SAFETY: the plugin's strings are NUL-terminated and live on.
        let (name, path) = unsafe { (CStr::from_ptr(p.name), CStr::from_ptr(p.pci_path)) };
        assert_eq!(name.to_str().unwrap(), "lo");
        assert_eq!(path.to_str().unwrap(), pci);
        assert!(p.speed > 0);
    }
    let mut handle = [0u8; NCCL_NET_HANDLE_MAXSIZE];
    let mut l: *mut c_void = std::ptr::null_mut();
    // SAFETY: 128-byte handle buffer, one out-pointer.
    unsafe {
        assert_eq!(
            tb.t.listen.unwrap()(1, handle.as_mut_ptr() as *mut c_void, &mut l),
            0
        );
        assert_ne!(
            tb.t.listen.unwrap()(2, handle.as_mut_ptr() as *mut c_void, &mut l),
            0
        );
        assert_eq!(tb.t.close_listen.unwrap()(l), 0);
    }
}

/// With TCPX's default flow-steering wait (5 s per accept), a connection
/// with the plugin net's default channels (2 sets × 8 comms each way) is
/// ready in one wait, not one per comm: the engine calls every connect and
/// accept together. Prints the set-up time.
#[test]
fn set_up_with_the_default_flow_steering_wait_runs_channels_in_parallel() {
    let Some((_g, path)) = setup() else { return };
    std::env::remove_var("NCCL_GPUDIRECTTCPX_PROGRAM_FLOW_STEERING_WAIT_MICROS");
    let cfg = Config {
        channels: tcpx_p2p::PLUGIN_CHANNELS,
        connect_timeout: Duration::from_secs(60),
        ..plugin_cfg(&path)
    };
    let a = Endpoint::new(None, cfg.clone()).unwrap();
    let b = Endpoint::new(None, cfg).unwrap();
    let addr = b.local_addr();
    let t0 = Instant::now();
    let ca = a
        .connect(&addr.ip().to_string(), addr.port(), None)
        .unwrap();
    let cb = b.accept(Some(Duration::from_secs(60))).unwrap().conn;
    let took = t0.elapsed();
    println!(
        "{{\"set_up_s\": {:.3}, \"channels\": {}, \"flow_steering_wait_s\": 5}}",
        took.as_secs_f64(),
        tcpx_p2p::PLUGIN_CHANNELS
    );
    assert!(
        took >= Duration::from_secs(5),
        "the 5 s flow-steering wait was kept: {took:?}"
    );
    assert!(
        took < Duration::from_secs(30),
        "{took:?}: accepts ran one after another (32 comms × 5 s)"
    );
    // And the connection works.
    let n = 3 << 20;
    let mut src = pattern(n, 4);
    let mut dst = vec![0u8; n];
    let sb = buf(&a, &mut src);
    let rb = buf(&b, &mut dst);
    let r = b.recv_async(cb, &[rb]).unwrap();
    let s = a.send_async(ca, &[sb]).unwrap();
    assert!(a.wait(s, Some(Duration::from_secs(60))).unwrap());
    assert!(b.wait(r, Some(Duration::from_secs(60))).unwrap());
    assert_eq!(checksum(&dst), checksum(&src));
}

/// Many connections, each of many comms, some idle while others work, then
/// all at once: the engine's progress loop tests every comm's head, so
/// nothing stalls on a stand-in where data moves only inside test.
#[test]
fn the_progress_loop_tests_every_comm_many_connections_idle_ones_too() {
    let Some((_g, path)) = setup() else { return };
    let cfg = Config {
        channels: 4,
        chunk: 256 << 10,
        ..plugin_cfg(&path)
    };
    let hub = Endpoint::new(None, cfg.clone()).unwrap();
    let peers: Vec<Endpoint> = (0..3)
        .map(|_| Endpoint::new(None, cfg.clone()).unwrap())
        .collect();
    let addr = hub.local_addr();
    let mut conns = Vec::new();
    for p in &peers {
        let c = p
            .connect(&addr.ip().to_string(), addr.port(), None)
            .unwrap();
        let h = hub.accept(Some(Duration::from_secs(20))).unwrap().conn;
        conns.push((c, h));
    }
    let round = |which: &[usize], n: usize, seed: u8| {
        let mut srcs: Vec<Vec<u8>> = which
            .iter()
            .map(|&i| pattern(n + i, seed + i as u8))
            .collect();
        let mut dsts: Vec<Vec<u8>> = which.iter().map(|&i| vec![0u8; n + i]).collect();
        let mut waits = Vec::new();
        for (k, &i) in which.iter().enumerate() {
            let (c, h) = conns[i];
            let sb = buf(&peers[i], &mut srcs[k]);
            let rb = buf(&hub, &mut dsts[k]);
            let r = hub.recv_async(h, &[rb]).unwrap();
            let s = peers[i].send_async(c, &[sb]).unwrap();
            waits.push((i, s, r));
        }
        for (i, s, r) in waits {
            assert!(
                peers[i].wait(s, Some(Duration::from_secs(60))).unwrap(),
                "send on connection {i}"
            );
            assert!(
                hub.wait(r, Some(Duration::from_secs(60))).unwrap(),
                "receive on connection {i}"
            );
        }
        for k in 0..which.len() {
            assert_eq!(
                checksum(&dsts[k]),
                checksum(&srcs[k]),
                "connection {}",
                which[k]
            );
        }
    };
    // One connection works while two stay idle; then another; then all,
    // with messages that use every comm of every channel.
    round(&[0], 5 << 20, 1);
    std::thread::sleep(Duration::from_millis(300));
    round(&[2], 1 << 20, 2);
    round(&[0, 1, 2], 9 << 20, 3);
    for _ in 0..5 {
        round(&[1, 2], 4097, 4);
    }
}

/// Host memory on a plugin-net connection of GPU endpoints: the receive
/// comms' bounce pages are on the GPU (TCPX steers a GPU comm's flows to
/// its devmem queues), so host receives land on the GPU first and are
/// copied out; the user sees the same bytes as with GPU buffers. Two-sided
/// and one-sided, host → host, GPU → host and host → GPU. Skips without
/// CUDA. Before the host landing, every receive into host memory here
/// failed ("a receive into host memory on a comm whose bounce pages are on
/// the GPU").
#[test]
fn host_memory_on_gpu_endpoints_over_the_plugin() {
    let Some((_g, a, b, ca, cb)) = gpu_plugin_pair() else {
        return;
    };
    let second = b.gpu_index();
    for &n in &[1usize, 4095, (1 << 20) + 3, 9 << 20] {
        // host → host
        let mut src = pattern(n, 0x21);
        let mut dst = vec![0u8; n];
        let sb = buf(&a, &mut src);
        let rb = buf(&b, &mut dst);
        let r = b.recv_async(cb, &[rb]).unwrap();
        let x = a.send_async(ca, &[sb]).unwrap();
        assert!(a.wait(x, Some(Duration::from_secs(60))).unwrap());
        assert!(b.wait(r, Some(Duration::from_secs(60))).unwrap());
        assert_eq!(checksum(&dst), checksum(&src), "host → host, size {n}");
        // GPU → host
        let gsrc = pattern(n, 0x43);
        let s = device_buf(0, &gsrc);
        let sb = reg_buf(&a, s.ptr, n);
        let mut hdst = vec![0u8; n];
        let rb = buf(&b, &mut hdst);
        let r = b.recv_async(cb, &[rb]).unwrap();
        let x = a.send_async(ca, &[sb]).unwrap();
        assert!(a.wait(x, Some(Duration::from_secs(60))).unwrap());
        assert!(b.wait(r, Some(Duration::from_secs(60))).unwrap());
        assert_eq!(checksum(&hdst), checksum(&gsrc), "GPU → host, size {n}");
        // host → GPU
        let mut hsrc = pattern(n, 0x65);
        let d = device_buf(second, &vec![0u8; n]);
        let sb = buf(&a, &mut hsrc);
        let rb = reg_buf(&b, d.ptr, n);
        let r = b.recv_async(cb, &[rb]).unwrap();
        let x = a.send_async(ca, &[sb]).unwrap();
        assert!(a.wait(x, Some(Duration::from_secs(60))).unwrap());
        assert!(b.wait(r, Some(Duration::from_secs(60))).unwrap());
        assert_eq!(
            checksum(&read_back(&d, n)),
            checksum(&hsrc),
            "host → GPU, size {n}"
        );
    }
    // One-sided write and read of a host region of the GPU endpoint.
    let n = 5 << 20;
    let mut target = vec![0u8; n];
    let tb = buf(&b, &mut target);
    let desc = b.advertise(cb, tb.mr, tb.ptr, n).unwrap();
    let meta = FifoItem::decode(&desc).unwrap();
    let mut src = pattern(n, 0x17);
    let sb = buf(&a, &mut src);
    let w = a.write_async(ca, &[sb], &[meta]).unwrap();
    assert!(a.wait(w, Some(Duration::from_secs(60))).unwrap());
    assert_eq!(checksum(&target), checksum(&src), "write into host memory");
    let mut back = vec![0u8; n];
    let bb = buf(&a, &mut back);
    let r = a.read_async(ca, &[bb], &[meta]).unwrap();
    assert!(a.wait(r, Some(Duration::from_secs(60))).unwrap());
    assert_eq!(checksum(&back), checksum(&src), "read from host memory");
}

/// TCPX off A3 runs with its GPU receive pool not imported
/// (`NCCL_TCPX_RXMEM_IMPORT_USE_GPU_PCI_CLIENT=0`): the device handle has
/// no bounce buffer, host receives land straight in their buffers with 0
/// fragments and `test` reports no size. The stand-in does the same; the
/// engine moves host memory over it, two-sided and one-sided.
#[test]
fn host_receives_without_a_receive_pool_land_in_place() {
    let Some((_g, path)) = setup() else { return };
    let _e = EnvGuard::set(&[("NCCL_TCPX_RXMEM_IMPORT_USE_GPU_PCI_CLIENT", "0")]);
    let tb = table(&path);
    let p = tb.pair();
    // SAFETY: the plugin wrote a device handle into the storage on accept.
    let dh = unsafe { std::ptr::read(p.dev.0.as_ptr() as *const NcclNetDeviceHandleV7) };
    // SAFETY: without a GPU the handle is a host pointer to the struct.
    let uh = unsafe { std::ptr::read(dh.handle as *const UnpackNetDeviceHandle) };
    assert!(uh.bounce_buf.is_null() && !uh.meta.is_null());
    tb.close(p);

    let a = Endpoint::new(None, plugin_cfg(&path)).unwrap();
    let b = Endpoint::new(None, plugin_cfg(&path)).unwrap();
    let addr = b.local_addr();
    let ca = a
        .connect(&addr.ip().to_string(), addr.port(), None)
        .unwrap();
    let cb = b.accept(Some(Duration::from_secs(20))).unwrap().conn;
    for &n in &[1usize, 4096, (1 << 20) + 5, 9 << 20] {
        let mut src = pattern(n, 0x5a);
        let mut dst = vec![0u8; n];
        let sb = buf(&a, &mut src);
        let rb = buf(&b, &mut dst);
        let r = b.recv_async(cb, &[rb]).unwrap();
        let s = a.send_async(ca, &[sb]).unwrap();
        assert!(a.wait(s, Some(Duration::from_secs(60))).unwrap());
        assert!(b.wait(r, Some(Duration::from_secs(60))).unwrap());
        assert_eq!(checksum(&dst), checksum(&src), "size {n}");
    }
    let n = 3 << 20;
    let mut target = vec![0u8; n];
    let tbuf = buf(&b, &mut target);
    let desc = b.advertise(cb, tbuf.mr, tbuf.ptr, n).unwrap();
    let meta = FifoItem::decode(&desc).unwrap();
    let mut src = pattern(n, 0x3d);
    let sb = buf(&a, &mut src);
    let w = a.write_async(ca, &[sb], &[meta]).unwrap();
    assert!(a.wait(w, Some(Duration::from_secs(60))).unwrap());
    assert_eq!(checksum(&target), checksum(&src));
    let mut back = vec![0u8; n];
    let bb = buf(&a, &mut back);
    let r = a.read_async(ca, &[bb], &[meta]).unwrap();
    assert!(a.wait(r, Some(Duration::from_secs(60))).unwrap());
    assert_eq!(checksum(&back), checksum(&src));
}

/// TCPX's `NCCL_DYNAMIC_CHUNK_SIZE` defaults to 0, and a send's chunks are
/// then 0 bytes: no send ever finishes. The stand-in does the same (the
/// engine's plugin net sets 524288 where the variable is unset).
#[test]
fn a_chunk_size_of_zero_never_sends() {
    let Some((_g, path)) = setup() else { return };
    let tb = table(&path);
    let _e = EnvGuard::set(&[("NCCL_DYNAMIC_CHUNK_SIZE", "0")]);
    let p = tb.pair();
    let src = pattern(4096, 2);
    let mut dst = vec![0u8; 4096];
    let (_, smh) = tb.reg(p.send, src.as_ptr(), src.len(), NCCL_PTR_HOST);
    let (_, rmh) = tb.reg(p.recv, dst.as_ptr(), dst.len(), NCCL_PTR_HOST);
    let (_, rq) = tb.irecv_n(p.recv, 1, dst.as_mut_ptr(), dst.len(), rmh);
    let (_, sq) = tb.isend(p.send, src.as_ptr(), src.len(), smh);
    let t0 = Instant::now();
    while t0.elapsed() < Duration::from_millis(700) {
        let (r1, sent, _) = tb.test(sq);
        let (r2, got, _) = tb.test(rq);
        assert!(r1 == 0 && r2 == 0);
        assert!(!sent && !got, "nothing moves with chunks of 0 bytes");
        std::thread::sleep(Duration::from_millis(1));
    }
    tb.close(p);
}

/// Two devices (`NCCL_GPUDIRECTTCPX_SOCKET_IFNAME=lo,lo`): the loader
/// reports both, named after the interface, and a connection's channels
/// take them in turn (listen and connect on device 1 as well as 0) and
/// move the right bytes. A copy of the library is loaded, as the loader
/// reads a plugin's devices once per path.
#[test]
fn channels_spread_over_several_devices() {
    let Some((_g, path)) = setup() else { return };
    let _e = EnvGuard::set(&[("NCCL_GPUDIRECTTCPX_SOCKET_IFNAME", "lo,lo")]);
    let dir = std::env::temp_dir().join(format!("tcpx-emu-two-devs-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let copy = dir.join("libnccl_net_emu.so");
    std::fs::copy(&path, &copy).unwrap();
    let copy = copy.to_string_lossy().into_owned();
    let net = PluginNet::load(&copy, None).unwrap();
    let devs = net.plugin_devices();
    assert_eq!(devs.len(), 2);
    assert!(
        devs.iter().all(|d| d.props.name == "lo"),
        "named after the interface"
    );
    let cfg = Config {
        channels: 4,
        ..plugin_cfg(&copy)
    };
    let a = Endpoint::new(None, cfg.clone()).unwrap();
    let b = Endpoint::new(None, cfg).unwrap();
    let addr = b.local_addr();
    let ca = a
        .connect(&addr.ip().to_string(), addr.port(), None)
        .unwrap();
    let cb = b.accept(Some(Duration::from_secs(20))).unwrap().conn;
    let n = 9 << 20;
    let mut src = pattern(n, 0x44);
    let mut dst = vec![0u8; n];
    let sb = buf(&a, &mut src);
    let rb = buf(&b, &mut dst);
    let r = b.recv_async(cb, &[rb]).unwrap();
    let s = a.send_async(ca, &[sb]).unwrap();
    assert!(a.wait(s, Some(Duration::from_secs(60))).unwrap());
    assert!(b.wait(r, Some(Duration::from_secs(60))).unwrap());
    assert_eq!(checksum(&dst), checksum(&src));
    let _ = std::fs::remove_dir_all(&dir);
}
