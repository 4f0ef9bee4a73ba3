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
