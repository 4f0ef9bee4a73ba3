//! Interfaces and addresses: which IP an endpoint advertises and listens on.
//! (getifaddrs is an FFI edge.)
#![allow(unsafe_code)]

use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};

use crate::error::Error;

/// What a network device offers (a NIC, as a transport reports it).
#[derive(Debug, Clone, PartialEq)]
pub struct DeviceProps {
    pub name: String,
    pub pci_path: Option<String>,
    pub speed_mbps: u32,
    pub host_mem: bool,
    pub cuda_mem: bool,
    pub max_comms: u32,
}

/// One network interface address.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct IfAddr {
    pub name: String,
    pub ip: IpAddr,
    pub up: bool,
    pub loopback: bool,
}

/// Every interface address of this host (IPv4 and IPv6).
pub fn interfaces() -> Vec<IfAddr> {
    let mut out = Vec::new();
    let mut head: *mut libc::ifaddrs = std::ptr::null_mut();
    // SAFETY: getifaddrs fills `head` with a list we free below.
    if unsafe { libc::getifaddrs(&mut head) } != 0 {
        return out;
    }
    let mut cur = head;
    while !cur.is_null() {
        // SAFETY: `cur` is a node of the list getifaddrs returned.
        let ifa = unsafe { &*cur };
        cur = ifa.ifa_next;
        if ifa.ifa_addr.is_null() || ifa.ifa_name.is_null() {
            continue;
        }
        // SAFETY: ifa_name is a NUL-terminated string owned by the list.
        let name = unsafe { std::ffi::CStr::from_ptr(ifa.ifa_name) }
            .to_string_lossy()
            .into_owned();
        // SAFETY: ifa_addr is non-null; its family tells which struct it is.
        let family = unsafe { (*ifa.ifa_addr).sa_family } as i32;
        let ip = match family {
            libc::AF_INET => {
                // SAFETY: AF_INET addresses are sockaddr_in.
                let sin = unsafe { &*(ifa.ifa_addr as *const libc::sockaddr_in) };
                IpAddr::V4(Ipv4Addr::from(u32::from_be(sin.sin_addr.s_addr)))
            }
            libc::AF_INET6 => {
                // SAFETY: AF_INET6 addresses are sockaddr_in6.
                let sin6 = unsafe { &*(ifa.ifa_addr as *const libc::sockaddr_in6) };
                IpAddr::V6(Ipv6Addr::from(sin6.sin6_addr.s6_addr))
            }
            _ => continue,
        };
        let flags = ifa.ifa_flags;
        out.push(IfAddr {
            name,
            ip,
            up: flags & libc::IFF_UP as u32 != 0,
            loopback: flags & libc::IFF_LOOPBACK as u32 != 0,
        });
    }
    // SAFETY: frees the list returned above, once.
    unsafe { libc::freeifaddrs(head) };
    out
}

/// The address to advertise: the named interface's (IPv4 first), else the
/// first non-loopback interface that is up, else 127.0.0.1.
pub fn oob_ip(ifname: Option<&str>) -> Result<IpAddr, Error> {
    let all = interfaces();
    let pick = |v: Vec<&IfAddr>| {
        v.iter()
            .find(|a| a.ip.is_ipv4())
            .or_else(|| {
                v.iter().find(
                    |a| !matches!(a.ip, IpAddr::V6(x) if (x.segments()[0] & 0xffc0) == 0xfe80),
                )
            })
            .map(|a| a.ip)
    };
    if let Some(name) = ifname {
        return pick(all.iter().filter(|a| a.name == name).collect()).ok_or_else(|| {
            Error::Config(format!(
                "interface {name:?} has no usable address (set TCPX_P2P_IFNAME to one of: {})",
                names(&all)
            ))
        });
    }
    Ok(pick(all.iter().filter(|a| a.up && !a.loopback).collect())
        .unwrap_or(IpAddr::V4(Ipv4Addr::LOCALHOST)))
}

fn names(all: &[IfAddr]) -> String {
    // One entry per interface, though each has an address per family.
    let mut v: Vec<&str> = all.iter().map(|a| a.name.as_str()).collect();
    v.sort_unstable();
    v.dedup();
    v.join(", ")
}

#[cfg(test)]
mod tests {
    #[test]
    fn loopback_is_found() {
        assert!(super::interfaces().iter().any(|a| a.loopback));
        assert_eq!(
            super::oob_ip(Some("lo")).unwrap(),
            std::net::IpAddr::from([127, 0, 0, 1])
        );
        assert!(super::oob_ip(Some("no-such-if0")).is_err());
        assert!(super::oob_ip(None).is_ok());
    }
}

/// Parses a static GPU → NIC map such as `0-1:eth1;2-3:eth2;4-5:eth3;6-7:eth4`
/// (GPU indices or ranges, a colon, NIC names separated by commas) and gives
/// the NIC names of `gpu`, if the map names it.
pub fn map_nics(map: &str, gpu: i32) -> Option<Vec<String>> {
    for entry in map.split(';').map(str::trim).filter(|e| !e.is_empty()) {
        let (gpus, nics) = entry.split_once(':')?;
        let hit = gpus.split(',').any(|g| match g.trim().split_once('-') {
            Some((a, b)) => matches!((a.trim().parse::<i32>(), b.trim().parse::<i32>()), (Ok(a), Ok(b)) if (a..=b).contains(&gpu)),
            None => g.trim().parse::<i32>() == Ok(gpu),
        });
        if hit {
            return Some(
                nics.split(',')
                    .map(|n| n.trim().to_string())
                    .filter(|n| !n.is_empty())
                    .collect(),
            );
        }
    }
    None
}

/// Path components two sysfs device paths share (PCI closeness).
fn shared_prefix(a: &str, b: &str) -> usize {
    a.split('/')
        .zip(b.split('/'))
        .take_while(|(x, y)| x == y)
        .count()
}

/// The net devices the channels of an endpoint on `gpu` use, in order
/// (channel i takes entry i mod len): the static map's NICs when it names
/// this GPU; else the devices closest to the GPU on the PCI tree (sysfs);
/// else every device.
pub fn channel_devices(
    devs: &[DeviceProps],
    gpu: i32,
    gpu_bdf: &str,
    map: Option<&str>,
) -> Vec<usize> {
    let all: Vec<usize> = (0..devs.len().max(1)).collect();
    if devs.is_empty() {
        return all;
    }
    if let Some(names) = map.and_then(|m| map_nics(m, gpu)) {
        let picked: Vec<usize> = (0..devs.len())
            .filter(|&i| {
                names
                    .iter()
                    .any(|n| devs[i].name == *n || devs[i].name.ends_with(&format!(":{n}")))
            })
            .collect();
        if !picked.is_empty() {
            return picked;
        }
        tracing::warn!("TCPX_P2P_GPU_NICS names {names:?} for GPU {gpu}, but the net has none of them; using every device");
    }
    if !gpu_bdf.is_empty() {
        let gpu_path = std::fs::canonicalize(format!("/sys/bus/pci/devices/{gpu_bdf}"))
            .map(|p| p.to_string_lossy().into_owned())
            .unwrap_or_default();
        if !gpu_path.is_empty() {
            let score = |d: &DeviceProps| {
                d.pci_path
                    .as_deref()
                    .and_then(|p| std::fs::canonicalize(p).ok())
                    .map(|p| shared_prefix(&gpu_path, &p.to_string_lossy()))
                    .unwrap_or(0)
            };
            let best = devs.iter().map(score).max().unwrap_or(0);
            if best > 0 {
                return (0..devs.len())
                    .filter(|&i| score(&devs[i]) == best)
                    .collect();
            }
        }
    }
    all
}

#[cfg(test)]
mod map_tests {
    use super::*;

    fn dev(name: &str) -> DeviceProps {
        DeviceProps {
            name: name.into(),
            pci_path: None,
            speed_mbps: 200_000,
            host_mem: true,
            cuda_mem: true,
            max_comms: 16,
        }
    }

    #[test]
    fn a3_high_map() {
        let m = "0-1:eth1;2-3:eth2;4-5:eth3;6-7:eth4";
        assert_eq!(map_nics(m, 0), Some(vec!["eth1".to_string()]));
        assert_eq!(map_nics(m, 5), Some(vec!["eth3".to_string()]));
        assert_eq!(map_nics(m, 8), None);
        assert_eq!(
            map_nics("0,2:eth1,eth2", 2),
            Some(vec!["eth1".into(), "eth2".into()])
        );
        assert_eq!(map_nics("garbage", 0), None);
        let devs = [dev("eth1"), dev("eth2"), dev("eth3"), dev("eth4")];
        assert_eq!(channel_devices(&devs, 3, "", Some(m)), vec![1]);
        assert_eq!(channel_devices(&devs, 6, "", Some(m)), vec![3]);
        // Not in the map, no PCI information: every device, in order.
        assert_eq!(channel_devices(&devs, 9, "", Some(m)), vec![0, 1, 2, 3]);
        assert_eq!(
            channel_devices(&devs, 0, "", Some("0:eth9")),
            vec![0, 1, 2, 3]
        );
        assert_eq!(channel_devices(&[], 0, "", None), vec![0]);
        assert_eq!(
            shared_prefix(
                "/sys/devices/pci0000:00/0000:00:01.0/a",
                "/sys/devices/pci0000:00/0000:00:01.0/b"
            ),
            5
        );
    }
}

/// Where the engine's I/O threads run (`TCPX_P2P_CPU_AFFINITY`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum CpuAffinity {
    /// The CPUs of the endpoint GPU's NUMA node (as NCCL places its
    /// threads); no pinning for host-memory endpoints.
    Gpu,
    /// Wherever the scheduler puts them.
    Off,
    /// These CPUs.
    List(Vec<usize>),
}

/// Parses a Linux CPU list such as `0-3,8,10-11`.
pub fn parse_cpulist(s: &str) -> Option<Vec<usize>> {
    let mut v = Vec::new();
    for part in s.trim().split(',').map(str::trim).filter(|p| !p.is_empty()) {
        // A single CPU is the range from it to itself.
        let (a, b) = part.split_once('-').unwrap_or((part, part));
        let (a, b) = (
            a.trim().parse::<usize>().ok()?,
            b.trim().parse::<usize>().ok()?,
        );
        if a > b || b >= libc::CPU_SETSIZE as usize {
            return None;
        }
        v.extend(a..=b);
    }
    v.sort_unstable();
    v.dedup();
    (!v.is_empty()).then_some(v)
}

/// Writes a CPU list compactly (`0-3,8`), for logs.
pub fn format_cpulist(cpus: &[usize]) -> String {
    let mut out: Vec<String> = Vec::new();
    let mut i = 0;
    while i < cpus.len() {
        let mut j = i;
        while j + 1 < cpus.len() && cpus[j + 1] == cpus[j] + 1 {
            j += 1;
        }
        out.push(if i == j {
            cpus[i].to_string()
        } else {
            format!("{}-{}", cpus[i], cpus[j])
        });
        i = j + 1;
    }
    out.join(",")
}

/// The CPUs this process may run on.
pub fn allowed_cpus() -> Vec<usize> {
    // SAFETY: cpu_set_t is plain data; all zeroes is the empty set.
    let mut set: libc::cpu_set_t = unsafe { std::mem::zeroed() };
    // SAFETY: `set` is a valid cpu_set_t of the size passed.
    let r = unsafe { libc::sched_getaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), &mut set) };
    if r != 0 {
        return Vec::new();
    }
    (0..libc::CPU_SETSIZE as usize)
        // SAFETY: `c` is below CPU_SETSIZE, the set's size.
        .filter(|&c| unsafe { libc::CPU_ISSET(c, &set) })
        .collect()
}

/// The CPUs of a PCI device's NUMA node (sysfs `local_cpulist`); `bdf` as
/// CUDA writes it (`0000:18:00.0`, any domain width).
pub fn pci_local_cpus(bdf: &str) -> Option<Vec<usize>> {
    let (domain, rest) = bdf.trim().split_once(':')?;
    let domain = u32::from_str_radix(domain, 16).ok()?;
    let path = format!(
        "/sys/bus/pci/devices/{domain:04x}:{}/local_cpulist",
        rest.to_lowercase()
    );
    parse_cpulist(&std::fs::read_to_string(path).ok()?)
}

/// The CPUs an endpoint's I/O threads are pinned to, or None to leave them
/// to the scheduler: the wanted CPUs that this process may use, unless that
/// is every CPU it may use (nothing to choose).
pub fn io_cpus(want: &CpuAffinity, gpu_bdf: &str) -> Option<std::sync::Arc<[usize]>> {
    let wanted = match want {
        CpuAffinity::Off => return None,
        CpuAffinity::Gpu if gpu_bdf.is_empty() => return None,
        CpuAffinity::Gpu => pci_local_cpus(gpu_bdf)?,
        CpuAffinity::List(v) => v.clone(),
    };
    let allowed = allowed_cpus();
    let cpus: Vec<usize> = wanted.into_iter().filter(|c| allowed.contains(c)).collect();
    if cpus.is_empty() {
        tracing::warn!(
            "TCPX_P2P_CPU_AFFINITY: none of the CPUs asked for is allowed to this process ({}); I/O threads are not pinned",
            format_cpulist(&allowed)
        );
        return None;
    }
    if cpus.len() == allowed.len() {
        return None;
    }
    tracing::info!(cpus = %format_cpulist(&cpus), gpu = gpu_bdf, "I/O threads pinned");
    Some(cpus.into())
}

/// Pins the calling thread to `cpus` (no-op for None). A failure is logged,
/// never fatal: placement is a speed matter.
pub fn pin_thread(cpus: Option<&[usize]>) {
    let Some(cpus) = cpus else { return };
    // SAFETY: cpu_set_t is plain data; all zeroes is the empty set.
    let mut set: libc::cpu_set_t = unsafe { std::mem::zeroed() };
    for &c in cpus.iter().filter(|&&c| c < libc::CPU_SETSIZE as usize) {
        // SAFETY: `c` is below CPU_SETSIZE, the set's size.
        unsafe { libc::CPU_SET(c, &mut set) };
    }
    // SAFETY: `set` is a valid cpu_set_t of the size passed; 0 = this thread.
    let r = unsafe { libc::sched_setaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), &set) };
    if r != 0 {
        tracing::warn!(
            cpus = %format_cpulist(cpus),
            "could not pin an I/O thread: {}",
            std::io::Error::last_os_error()
        );
    }
}

#[cfg(test)]
mod cpu_tests {
    use super::*;

    #[test]
    fn cpulists() {
        assert_eq!(
            parse_cpulist("0-3,8,10-11\n"),
            Some(vec![0, 1, 2, 3, 8, 10, 11])
        );
        assert_eq!(parse_cpulist("5"), Some(vec![5]));
        assert_eq!(parse_cpulist("3,1-2,2"), Some(vec![1, 2, 3]));
        assert_eq!(parse_cpulist(""), None);
        assert_eq!(parse_cpulist("4-2"), None);
        assert_eq!(parse_cpulist("x"), None);
        assert_eq!(parse_cpulist("0-99999"), None);
        assert_eq!(format_cpulist(&[0, 1, 2, 3, 8, 10, 11]), "0-3,8,10-11");
        assert_eq!(format_cpulist(&[]), "");
    }

    #[test]
    fn pinning_a_thread_takes_effect() {
        let allowed = allowed_cpus();
        assert!(!allowed.is_empty());
        let last = *allowed.last().unwrap();
        // One CPU asked for out of several: pinned there.
        let got = std::thread::spawn(move || {
            let cpus = io_cpus(&CpuAffinity::List(vec![last]), "");
            pin_thread(cpus.as_deref());
            (cpus.is_some(), allowed_cpus())
        })
        .join()
        .unwrap();
        if allowed.len() > 1 {
            assert_eq!(got, (true, vec![last]));
        } else {
            // The only CPU there is: nothing to choose, left alone.
            assert_eq!(got, (false, allowed.clone()));
        }
        // Off, a host-memory endpoint, and CPUs not allowed: not pinned.
        assert!(io_cpus(&CpuAffinity::Off, "0000:18:00.0").is_none());
        assert!(io_cpus(&CpuAffinity::Gpu, "").is_none());
        assert!(
            io_cpus(&CpuAffinity::List(vec![libc::CPU_SETSIZE as usize - 1]), "").is_none()
                || allowed.contains(&(libc::CPU_SETSIZE as usize - 1))
        );
        // The calling thread is untouched.
        assert_eq!(allowed_cpus(), allowed);
    }
}
