//! Interfaces and addresses: which IP an endpoint advertises and listens on.
//! (getifaddrs is an FFI edge.)
#![allow(unsafe_code)]

use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};

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
pub fn oob_ip(ifname: Option<&str>) -> Result<IpAddr, String> {
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
            format!(
                "interface {name:?} has no usable address (set TCPX_P2P_IFNAME to one of: {})",
                names(&all)
            )
        });
    }
    Ok(pick(all.iter().filter(|a| a.up && !a.loopback).collect())
        .unwrap_or(IpAddr::V4(Ipv4Addr::LOCALHOST)))
}

fn names(all: &[IfAddr]) -> String {
    let mut v: Vec<&str> = all.iter().map(|a| a.name.as_str()).collect();
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
    devs: &[crate::net::DeviceProps],
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
            let score = |d: &crate::net::DeviceProps| {
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
    use crate::net::DeviceProps;

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
