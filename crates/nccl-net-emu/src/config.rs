//! The stand-in's settings, from environment variables (read at `init` and
//! again whenever a comm is made, so tests can change faults between
//! connections).
//!
//! | variable | meaning | default |
//! |---|---|---|
//! | `NCCL_NET_EMU_UNPACK` | `1`: UNPACK receives (bounce pages + loadMeta), `0`: payload straight into the receive buffer | `1` |
//! | `NCCL_NET_EMU_ADDR` | IP address to listen on | `127.0.0.1` |
//! | `NCCL_NET_EMU_IFNAME` | interface whose IPv4 address to listen on (when no ADDR) | none |
//! | `NCCL_NET_EMU_POOL_MB` | bounce pool per GPU (and the one host pool), MiB | 256 GPU / 64 host |
//! | `NCCL_NET_EMU_SPLIT_PCT` | percent of 4 KiB pieces split into two fragments | 25 |
//! | `NCCL_NET_EMU_SEED` | seed of the page shuffling | fixed |
//! | `NCCL_NET_EMU_CONNECT_NULLS` | calls of connect that return a NULL comm before one is given (≥ 1) | 1 |
//! | `NCCL_NET_EMU_ACCEPT_NULLS` | likewise for accept | 1 |
//! | `NCCL_NET_EMU_REFUSE` | `1`: every connect fails (system error) | off |
//! | `NCCL_NET_EMU_REFUSE_AFTER` | connects after the first N fail | off |
//! | `NCCL_NET_EMU_DELAY_MS` | completions are reported N ms late | 0 |
//! | `NCCL_NET_EMU_DROP_AFTER_BYTES` | a send comm drops its peer after N payload bytes | off |
//! | `NCCL_NET_EMU_STAGE_BUFS` | pinned buffers per I/O thread for GPU payloads (1: each copy waited for before its write / after its read) | 4 |
//! | `NCCL_NET_EMU_LAND_LATE` | `1`: a GPU receive is reported once its copies land, while the next is read; `0`: its copies are waited for at once | `1` |
//! | `NCCL_NET_EMU_STATS` | file each I/O thread appends its time account to when it ends (the `tcpx-p2p-timing` line the engine's socket net writes too: GB, seconds, shares in socket calls / waiting for copies / waiting for work / other) | off |
//! | `NCCL_NET_EMU_TRACE` | `1`: an INFO line per data-path call (isend, irecv, finished test, iflush, irecvConsumed, regMr) | off |
//! | `NCCL_NET_EMU_PCI_PATHS` | `IF=/sys/devices/...,IF2=...`: the PCI path reported for an interface that has none in sysfs (loopback aliases, veth), so GPU → NIC selection by PCI distance runs | from sysfs |
//! | `NCCL_NET_EMU_LENIENT_BACKGROUND_PROGRESS` | `1`: the I/O threads move data without waiting for `test` to schedule it (kinder than TCPX) | off |
//! | `NCCL_NET_EMU_LENIENT_HANDLE_WRITE` | `1`: a receive comm's GPU-resident device handle is written before accept returns (TCPX's copy lands after; the stand-in writes it 2 ms late) | off |
//! | `NCCL_NET_EMU_LENIENT_SOCKET_SETUP_MS` | what connect and accept each spend per socket, in ms (TCPX: 100; less is kinder, for suites that make thousands of connections) | 100 |
//!
//! TCPX's own settings, read as TCPX reads them:
//!
//! | variable | meaning | default |
//! |---|---|---|
//! | `NCCL_GPUDIRECTTCPX_SOCKET_IFNAME` | comma-separated interfaces, one device each, named after the interface (unset: one device on `NCCL_NET_EMU_ADDR`, `NCCL_NET_EMU_IFNAME` or `127.0.0.1`) | unset |
//! | `NCCL_GPUDIRECTTCPX_PROGRAM_FLOW_STEERING_WAIT_MICROS` | how long accept waits for flow steering once its sockets are in (≤ 0: the default) | 5,000,000 |
//! | `NCCL_DYNAMIC_CHUNK_SIZE` | bytes per scheduled task; TCPX's default 0 means sends never finish | 0 |
//! | `NCCL_TCPX_RXMEM_IMPORT_USE_GPU_PCI_CLIENT` | `0`: no receive pool (the device handle's bounce buffer is NULL); host receives land straight in their buffers with 0 fragments, GPU receives fail (TCPX off A3, reference §10) | `1` |
//! | `NCCL_NSOCKS_PERTHREAD`, `NCCL_SOCKET_NTHREADS` | data sockets per comm = their product (≤ 8): each costs connect and accept 100 ms, and each holds up to 6 scheduled tasks | 1, 1 |

use std::net::{IpAddr, Ipv4Addr};
use std::time::Duration;

/// A snapshot of the settings.
#[derive(Debug, Clone)]
pub struct EmuConfig {
    pub unpack: bool,
    pub addr: IpAddr,
    pub pool_bytes_gpu: usize,
    pub pool_bytes_host: usize,
    pub split_pct: u32,
    pub seed: u64,
    pub connect_nulls: u32,
    pub accept_nulls: u32,
    pub refuse: bool,
    pub refuse_after: Option<u64>,
    pub delay: Duration,
    pub drop_after: Option<u64>,
    pub trace: bool,
    pub stage_bufs: usize,
    pub land_late: bool,
    /// Bytes per task `test` schedules (`NCCL_DYNAMIC_CHUNK_SIZE`).
    pub chunk: u64,
    /// Data sockets per comm (`NCCL_NSOCKS_PERTHREAD × NCCL_SOCKET_NTHREADS`).
    pub nsocks: u32,
    /// Accept's wait for flow steering.
    pub steer_wait: Duration,
    /// Data moves without `test` (an explicit loosening).
    pub lenient_progress: bool,
    /// What connect and accept spend per socket (TCPX: 100 ms).
    pub per_socket_cost: Duration,
    /// TCPX imports its GPU receive pool (`NCCL_TCPX_RXMEM_IMPORT_USE_GPU_PCI_CLIENT`).
    pub rxmem_import: bool,
    /// A GPU-resident device handle lands this long after accept returned
    /// (TCPX writes it with a pageable `cuMemcpyHtoD` that returns before
    /// the bytes land); zero only by the explicit loosening.
    pub handle_late: Duration,
}

/// How long after accept a GPU-resident device handle lands, by default.
pub const HANDLE_LATE: Duration = Duration::from_millis(2);

/// Tasks each data socket holds, as TCPX's MAX_TASKS.
pub const MAX_TASKS: u64 = 6;
/// What connect and accept each spend per socket (TCPX sleeps 100 ms before
/// each of its data sockets and its control socket).
pub const PER_SOCKET_COST: Duration = Duration::from_millis(100);
/// TCPX's flow-steering wait when the setting is absent or ≤ 0.
pub const DEFAULT_STEER_WAIT: Duration = Duration::from_secs(5);

impl EmuConfig {
    /// The bytes `test` may have scheduled and not yet moved: every socket's
    /// tasks, each one chunk.
    pub fn window(&self) -> u64 {
        MAX_TASKS * u64::from(self.nsocks) * self.chunk
    }

    /// What connect and accept spend on their sockets (data + control).
    pub fn socket_cost(&self) -> Duration {
        self.per_socket_cost * (self.nsocks + 1)
    }
}

fn var(name: &str) -> Option<String> {
    std::env::var(name)
        .ok()
        .map(|v| v.trim().to_string())
        .filter(|v| !v.is_empty())
}

fn num(name: &str) -> Option<u64> {
    let v = var(name)?;
    match v.parse::<u64>() {
        Ok(n) => Some(n),
        Err(_) => {
            crate::warn(&format!("{name}={v:?} is not a number; ignored"));
            None
        }
    }
}

fn signed(name: &str) -> Option<i64> {
    let v = var(name)?;
    match v.parse::<i64>() {
        Ok(n) => Some(n),
        Err(_) => {
            crate::warn(&format!("{name}={v:?} is not a number; ignored"));
            None
        }
    }
}

fn flag(name: &str, default: bool) -> bool {
    match var(name).as_deref() {
        None => default,
        Some("1" | "yes" | "true" | "on") => true,
        Some("0" | "no" | "false" | "off") => false,
        Some(v) => {
            crate::warn(&format!("{name}={v:?}: expected 0 or 1; using {default}"));
            default
        }
    }
}

/// The IPv4 address of interface `name`, if it has one.
fn ifaddr(name: &str) -> Option<IpAddr> {
    let mut head: *mut libc::ifaddrs = std::ptr::null_mut();
    // SAFETY: getifaddrs fills a list that is freed below.
    if unsafe { libc::getifaddrs(&mut head) } != 0 {
        return None;
    }
    let mut found = None;
    let mut cur = head;
    while !cur.is_null() {
        // SAFETY: `cur` is a node of the list getifaddrs returned.
        let ifa = unsafe { &*cur };
        cur = ifa.ifa_next;
        if ifa.ifa_addr.is_null() || ifa.ifa_name.is_null() {
            continue;
        }
        // SAFETY: a NUL-terminated interface name.
        let n = unsafe { std::ffi::CStr::from_ptr(ifa.ifa_name) };
        // SAFETY: ifa_addr is a valid sockaddr.
        let family = unsafe { (*ifa.ifa_addr).sa_family } as i32;
        if n.to_bytes() == name.as_bytes() && family == libc::AF_INET {
            // SAFETY: an AF_INET address is a sockaddr_in.
            let sin = unsafe { &*(ifa.ifa_addr as *const libc::sockaddr_in) };
            found = Some(IpAddr::V4(Ipv4Addr::from(u32::from_be(
                sin.sin_addr.s_addr,
            ))));
            break;
        }
    }
    // SAFETY: frees the list once.
    unsafe { libc::freeifaddrs(head) };
    found
}

impl EmuConfig {
    pub fn from_env() -> Self {
        let pool_mb = num("NCCL_NET_EMU_POOL_MB").filter(|&n| n >= 16);
        let addr = match var("NCCL_NET_EMU_ADDR") {
            Some(a) => a.parse().unwrap_or_else(|_| {
                crate::warn(&format!(
                    "NCCL_NET_EMU_ADDR={a:?} is not an IP address; using 127.0.0.1"
                ));
                IpAddr::V4(Ipv4Addr::LOCALHOST)
            }),
            None => match var("NCCL_NET_EMU_IFNAME") {
                Some(i) => ifaddr(&i).unwrap_or_else(|| {
                    crate::warn(&format!(
                        "NCCL_NET_EMU_IFNAME={i:?} has no IPv4 address; using 127.0.0.1"
                    ));
                    IpAddr::V4(Ipv4Addr::LOCALHOST)
                }),
                None => IpAddr::V4(Ipv4Addr::LOCALHOST),
            },
        };
        EmuConfig {
            unpack: flag("NCCL_NET_EMU_UNPACK", true),
            addr,
            pool_bytes_gpu: pool_mb.map_or(256 << 20, |m| (m as usize) << 20),
            pool_bytes_host: pool_mb.map_or(64 << 20, |m| (m as usize) << 20),
            split_pct: num("NCCL_NET_EMU_SPLIT_PCT").map_or(25, |n| n.min(100) as u32),
            seed: num("NCCL_NET_EMU_SEED").unwrap_or(0x9E37_79B9_7F4A_7C15),
            connect_nulls: num("NCCL_NET_EMU_CONNECT_NULLS").map_or(1, |n| n.clamp(1, 1000) as u32),
            accept_nulls: num("NCCL_NET_EMU_ACCEPT_NULLS").map_or(1, |n| n.clamp(1, 1000) as u32),
            refuse: flag("NCCL_NET_EMU_REFUSE", false),
            refuse_after: num("NCCL_NET_EMU_REFUSE_AFTER"),
            delay: Duration::from_millis(num("NCCL_NET_EMU_DELAY_MS").unwrap_or(0)),
            drop_after: num("NCCL_NET_EMU_DROP_AFTER_BYTES"),
            trace: flag("NCCL_NET_EMU_TRACE", false),
            stage_bufs: num("NCCL_NET_EMU_STAGE_BUFS").map_or(4, |n| n.clamp(1, 64) as usize),
            land_late: flag("NCCL_NET_EMU_LAND_LATE", true),
            chunk: num("NCCL_DYNAMIC_CHUNK_SIZE").unwrap_or(0),
            nsocks: (num("NCCL_NSOCKS_PERTHREAD").unwrap_or(1).max(1)
                * num("NCCL_SOCKET_NTHREADS").unwrap_or(1).max(1))
            .min(8) as u32,
            steer_wait: signed("NCCL_GPUDIRECTTCPX_PROGRAM_FLOW_STEERING_WAIT_MICROS")
                .filter(|&v| v > 0)
                .map_or(DEFAULT_STEER_WAIT, |v| Duration::from_micros(v as u64)),
            lenient_progress: flag("NCCL_NET_EMU_LENIENT_BACKGROUND_PROGRESS", false),
            rxmem_import: flag("NCCL_TCPX_RXMEM_IMPORT_USE_GPU_PCI_CLIENT", true),
            handle_late: if flag("NCCL_NET_EMU_LENIENT_HANDLE_WRITE", false) {
                Duration::ZERO
            } else {
                HANDLE_LATE
            },
            per_socket_cost: num("NCCL_NET_EMU_LENIENT_SOCKET_SETUP_MS")
                .map_or(PER_SOCKET_COST, |ms| {
                    Duration::from_millis(ms).min(PER_SOCKET_COST)
                }),
        }
    }
}

/// One device: an interface, as TCPX has one per interface in
/// `NCCL_GPUDIRECTTCPX_SOCKET_IFNAME`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Device {
    /// The interface's name (the device's name, as TCPX reports it).
    pub name: String,
    /// Where its comms listen.
    pub addr: IpAddr,
    /// Its PCI path (sysfs, or `NCCL_NET_EMU_PCI_PATHS`), if it has one.
    pub pci_path: Option<String>,
    /// Its speed in Mbps (sysfs; 100,000 where sysfs has none).
    pub speed_mbps: i32,
}

fn sysfs_pci_path(ifname: &str) -> Option<String> {
    let p = std::fs::canonicalize(format!("/sys/class/net/{ifname}/device")).ok()?;
    Some(p.to_string_lossy().into_owned())
}

fn sysfs_speed(ifname: &str) -> Option<i32> {
    let s = std::fs::read_to_string(format!("/sys/class/net/{ifname}/speed")).ok()?;
    s.trim().parse::<i32>().ok().filter(|&v| v > 0)
}

fn device(name: &str, addr: IpAddr) -> Device {
    // An alias (`lo:1`) has the sysfs entries of its interface.
    let base = name.split(':').next().unwrap_or(name);
    let over = var("NCCL_NET_EMU_PCI_PATHS").and_then(|v| {
        v.split(',').find_map(|kv| {
            let (k, p) = kv.split_once('=')?;
            (k.trim() == name).then(|| p.trim().to_string())
        })
    });
    Device {
        name: name.to_string(),
        addr,
        pci_path: over.or_else(|| sysfs_pci_path(base)),
        speed_mbps: sysfs_speed(base).unwrap_or(100_000),
    }
}

/// The devices, from the environment as it is now.
pub fn devices() -> Vec<Device> {
    if let Some(list) = var("NCCL_GPUDIRECTTCPX_SOCKET_IFNAME") {
        let found: Vec<Device> = list
            .split(',')
            .map(|n| n.trim().trim_start_matches('='))
            .filter(|n| !n.is_empty())
            .filter_map(|n| match ifaddr(n) {
                Some(a) => Some(device(n, a)),
                None => {
                    crate::warn(&format!(
                        "NCCL_GPUDIRECTTCPX_SOCKET_IFNAME: {n:?} has no IPv4 address; skipped"
                    ));
                    None
                }
            })
            .collect();
        if !found.is_empty() {
            return found;
        }
        crate::warn("NCCL_GPUDIRECTTCPX_SOCKET_IFNAME names no usable interface; using one device on the default address");
    }
    let cfg = EmuConfig::from_env();
    let name = var("NCCL_NET_EMU_IFNAME").unwrap_or_else(|| {
        if cfg.addr.is_loopback() {
            "lo".into()
        } else {
            "emu0".into()
        }
    });
    vec![device(&name, cfg.addr)]
}
