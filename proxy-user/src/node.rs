//! The node's own addresses and the interfaces that carry them: NodePort frontends answer
//! on these addresses, the TC programs attach to these interfaces, and the first address
//! of each family is where remote-backend traffic is source-NATed to.

use std::{
    ffi::CStr,
    io,
    net::{IpAddr, Ipv4Addr, Ipv6Addr},
};

/// Interface name prefixes of pod-side and virtual devices, never node interfaces.
const NOT_NODE_INTERFACES: &[&str] = &[
    "lo",
    "veth",
    "lxc",
    "cali",
    "cilium",
    "docker",
    "cni",
    "flannel",
    "kube-ipvs",
    "tunl",
    "vxlan",
    "genev",
    "br-",
    "virbr",
    "weave",
    "tap",
];

/// `(interface, address)` for every address on this network namespace's interfaces.
pub fn interface_addresses() -> io::Result<Vec<(String, IpAddr)>> {
    let mut head: *mut libc::ifaddrs = std::ptr::null_mut();
    // SAFETY: getifaddrs fills a list we free below.
    if unsafe { libc::getifaddrs(&mut head) } != 0 {
        return Err(io::Error::last_os_error());
    }
    let mut out = Vec::new();
    let mut cur = head;
    while !cur.is_null() {
        // SAFETY: a node of the list getifaddrs returned.
        let ifa = unsafe { &*cur };
        cur = ifa.ifa_next;
        if ifa.ifa_addr.is_null() || ifa.ifa_name.is_null() {
            continue;
        }
        // SAFETY: NUL-terminated interface name.
        let name = unsafe { CStr::from_ptr(ifa.ifa_name) }
            .to_string_lossy()
            .into_owned();
        // SAFETY: sa_family tells which sockaddr it is.
        let family = i32::from(unsafe { (*ifa.ifa_addr).sa_family });
        let addr = match family {
            libc::AF_INET => {
                // SAFETY: an AF_INET sockaddr.
                let sin = unsafe { &*(ifa.ifa_addr as *const libc::sockaddr_in) };
                IpAddr::V4(Ipv4Addr::from(u32::from_be(sin.sin_addr.s_addr)))
            }
            libc::AF_INET6 => {
                // SAFETY: an AF_INET6 sockaddr.
                let sin6 = unsafe { &*(ifa.ifa_addr as *const libc::sockaddr_in6) };
                IpAddr::V6(Ipv6Addr::from(sin6.sin6_addr.s6_addr))
            }
            _ => continue,
        };
        out.push((name, addr));
    }
    // SAFETY: the list from getifaddrs.
    unsafe { libc::freeifaddrs(head) };
    Ok(out)
}

/// A usable node address: not loopback, link-local, multicast or unspecified.
pub fn is_node_address(a: &IpAddr) -> bool {
    match a {
        IpAddr::V4(v4) => {
            !(v4.is_loopback() || v4.is_link_local() || v4.is_unspecified() || v4.is_multicast())
        }
        IpAddr::V6(v6) => {
            !(v6.is_loopback()
                || v6.is_unspecified()
                || v6.is_multicast()
                || (v6.segments()[0] & 0xffc0) == 0xfe80)
        }
    }
}

/// The node's interfaces and addresses: `interfaces` if given, else every interface that
/// carries a node address and is not a pod-side or virtual device.
pub fn node_interfaces(
    all: &[(String, IpAddr)],
    interfaces: &[String],
) -> (Vec<String>, Vec<IpAddr>) {
    let chosen: Vec<&(String, IpAddr)> = all
        .iter()
        .filter(|(name, addr)| {
            is_node_address(addr)
                && if interfaces.is_empty() {
                    !NOT_NODE_INTERFACES.iter().any(|p| name.starts_with(p))
                } else {
                    interfaces.contains(name)
                }
        })
        .collect();
    let mut names: Vec<String> = Vec::new();
    for (n, _) in &chosen {
        if !names.contains(n) {
            names.push(n.clone());
        }
    }
    // Requested interfaces without a node address are still attached.
    for n in interfaces {
        if !names.contains(n) {
            names.push(n.clone());
        }
    }
    (names, chosen.iter().map(|(_, a)| *a).collect())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn picks_node_interfaces_and_their_addresses() {
        let ip = |s: &str| s.parse::<IpAddr>().expect("ip");
        let all = vec![
            ("lo".to_string(), ip("127.0.0.1")),
            ("eth0".to_string(), ip("192.0.2.10")),
            ("eth0".to_string(), ip("fe80::1")),
            ("eth0".to_string(), ip("2001:db8::10")),
            ("veth12ab".to_string(), ip("10.244.0.1")),
            ("eth1".to_string(), ip("198.51.100.7")),
        ];
        let (ifs, addrs) = node_interfaces(&all, &[]);
        assert_eq!(ifs, ["eth0", "eth1"]);
        assert_eq!(
            addrs,
            [ip("192.0.2.10"), ip("2001:db8::10"), ip("198.51.100.7")]
        );
        let (ifs, addrs) = node_interfaces(&all, &["eth1".to_string()]);
        assert_eq!(ifs, ["eth1"]);
        assert_eq!(addrs, [ip("198.51.100.7")]);
    }

    #[test]
    fn this_namespace_has_a_loopback() {
        let all = interface_addresses().expect("getifaddrs");
        assert!(all.iter().any(|(n, a)| n == "lo" && a.is_loopback()));
    }
}
