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
//! | `NCCL_NET_EMU_STATS` | file each I/O thread appends its time account to when it ends (the engine's `net::timing` line: GB, seconds, shares in socket calls / waiting for copies / waiting for work / other) | off |
//! | `NCCL_NET_EMU_TRACE` | `1`: an INFO line per data-path call (isend, irecv, finished test, iflush, irecvConsumed, regMr) | off |

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
        }
    }
}
