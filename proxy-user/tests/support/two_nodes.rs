//! The two-node topology of `tc_datapath.rs` and `upgrade.rs`, made of network namespaces:
//!
//! ```text
//!  ext 10.100.0.1 ──── 10.100.0.2 [node-a] 10.100.1.1 ──── 10.100.1.2 [node-b]
//!                        │ 10.1.1.1   │ 10.1.2.1               │ 10.2.1.1
//!                      pod1 .2      pod2 .2                  pod3 10.2.1.2
//! ```
//! The external client reaches only node-a (and, through it, the LoadBalancer/external
//! addresses 10.100.50.0/24 routed to node-a); VIPs are never routed anywhere else.
//! Dual-stack ([`Cluster::dual_stack`]), IPv6 mirrors it: fd00:100::/64 ext<->node-a,
//! fd00:101::/64 node-a<->node-b, pods fd00:1:1::2, fd00:1:2::2, fd00:2:1::2. Every pod
//! runs a TCP echo and a UDP peer on port 8080 of each of its addresses, answering with
//! its name (`pod1`..`pod3`).

use std::net::SocketAddr;

use super::{run, unique, Netns, Server};

/// Field order is drop order: servers stop before their namespaces go.
pub struct Cluster {
    pub servers: Vec<Server>,
    pub ext: Netns,
    pub node_a: Netns,
    pub node_b: Netns,
    pub pods: Vec<Netns>,
}

pub fn sysctl(ns: &Netns, key: &str) {
    run("ip", &["netns", "exec", &ns.name, "sysctl", "-qw", key]);
}

/// No duplicate address detection on the links made after this: link-local addresses
/// would stay tentative for a second and IPv6 neighbour discovery with them.
pub fn no_dad(ns: &Netns) {
    sysctl(ns, "net.ipv6.conf.all.accept_dad=0");
    sysctl(ns, "net.ipv6.conf.default.accept_dad=0");
}

/// A veth pair `a_if` (in `a`) <-> `b_if` (in `b`), with these addresses, up.
pub fn link(a: &Netns, a_if: &str, a_addrs: &[&str], b: &Netns, b_if: &str, b_addrs: &[&str]) {
    run(
        "ip",
        &[
            "link", "add", a_if, "netns", &a.name, "type", "veth", "peer", "name", b_if, "netns",
            &b.name,
        ],
    );
    for (ns, ifn, addrs) in [(a, a_if, a_addrs), (b, b_if, b_addrs)] {
        for addr in addrs {
            if addr.contains(':') {
                ns.ip(&["-6", "addr", "add", addr, "dev", ifn, "nodad"]);
            } else {
                ns.ip(&["addr", "add", addr, "dev", ifn]);
            }
        }
        ns.ip(&["link", "set", ifn, "up"]);
    }
}

impl Cluster {
    /// A second client link, straight to node-b (`eth1` 10.100.2.1 / fd00:102::1 <->
    /// `ext0` .2), as a router's other path: reverse-path filtering off on both ends, and
    /// node-b answers the client (10.100.0.1, fd00:100::1) over it, while node-a's
    /// addresses stay behind node-a. Dual-stack clusters only.
    pub fn link_client_to_node_b(&self) {
        for ns in [&self.ext, &self.node_b] {
            sysctl(ns, "net.ipv4.conf.all.rp_filter=0");
            sysctl(ns, "net.ipv4.conf.default.rp_filter=0");
        }
        link(
            &self.ext,
            "eth1",
            &["10.100.2.1/24", "fd00:102::1/64"],
            &self.node_b,
            "ext0",
            &["10.100.2.2/24", "fd00:102::2/64"],
        );
        self.node_b
            .ip(&["route", "add", "10.100.0.1/32", "via", "10.100.2.1"]);
        self.node_b.ip(&[
            "-6",
            "route",
            "add",
            "fd00:100::1/128",
            "via",
            "fd00:102::1",
        ]);
    }

    /// IPv4 and IPv6; namespaces named `<prefix>ext-...`, `<prefix>na-...`, ...
    pub fn dual_stack(prefix: &str) -> Self {
        Self::new(prefix, true)
    }

    /// IPv4 only.
    pub fn ipv4(prefix: &str) -> Self {
        Self::new(prefix, false)
    }

    fn new(prefix: &str, v6: bool) -> Self {
        // The IPv6 addresses of each link, left out in an IPv4-only cluster.
        let six = |addrs: [&'static str; 2]| -> Vec<&'static str> {
            if v6 {
                addrs.to_vec()
            } else {
                addrs[..1].to_vec()
            }
        };
        let ext = Netns::new(unique(&format!("{prefix}ext-")));
        let node_a = Netns::new(unique(&format!("{prefix}na-")));
        let node_b = Netns::new(unique(&format!("{prefix}nb-")));
        if v6 {
            for n in [&ext, &node_a, &node_b] {
                no_dad(n);
            }
        }
        link(
            &ext,
            "eth0",
            &six(["10.100.0.1/24", "fd00:100::1/64"]),
            &node_a,
            "ext0",
            &six(["10.100.0.2/24", "fd00:100::2/64"]),
        );
        link(
            &node_a,
            "nb0",
            &six(["10.100.1.1/24", "fd00:101::1/64"]),
            &node_b,
            "na0",
            &six(["10.100.1.2/24", "fd00:101::2/64"]),
        );
        // The client routes only the LoadBalancer/external range to node-a.
        ext.ip(&["route", "add", "10.100.50.0/24", "via", "10.100.0.2"]);
        node_a.ip(&["route", "add", "10.2.0.0/16", "via", "10.100.1.2"]);
        node_b.ip(&["route", "add", "10.100.0.0/24", "via", "10.100.1.1"]);
        if v6 {
            ext.ip(&["-6", "route", "add", "fd00:150::/64", "via", "fd00:100::2"]);
            node_a.ip(&["-6", "route", "add", "fd00:2::/32", "via", "fd00:101::2"]);
            node_b.ip(&["-6", "route", "add", "fd00:100::/64", "via", "fd00:101::1"]);
        }
        for n in [&node_a, &node_b] {
            sysctl(n, "net.ipv4.ip_forward=1");
            if v6 {
                sysctl(n, "net.ipv6.conf.all.forwarding=1");
            }
        }
        let mut pods = Vec::new();
        let mut servers = Vec::new();
        for (i, (node, net4, net6)) in [
            (&node_a, "10.1.1", "fd00:1:1"),
            (&node_a, "10.1.2", "fd00:1:2"),
            (&node_b, "10.2.1", "fd00:2:1"),
        ]
        .into_iter()
        .enumerate()
        {
            let pod = Netns::new(unique(&format!("{prefix}pod-")));
            if v6 {
                no_dad(&pod);
            }
            let ifn = format!("pod{}", i + 1);
            let (node_addrs, pod_addrs) = (
                [format!("{net4}.1/24"), format!("{net6}::1/64")],
                [format!("{net4}.2/24"), format!("{net6}::2/64")],
            );
            let n = if v6 { 2 } else { 1 };
            let node_addrs: Vec<&str> = node_addrs[..n].iter().map(String::as_str).collect();
            let pod_addrs: Vec<&str> = pod_addrs[..n].iter().map(String::as_str).collect();
            link(node, &ifn, &node_addrs, &pod, "eth0", &pod_addrs);
            pod.ip(&["route", "add", "default", "via", &format!("{net4}.1")]);
            if v6 {
                pod.ip(&[
                    "-6",
                    "route",
                    "add",
                    "default",
                    "via",
                    &format!("{net6}::1"),
                ]);
            }
            let name = format!("pod{}", i + 1);
            for ip in [format!("{net4}.2"), format!("{net6}::2")].iter().take(n) {
                let addr = SocketAddr::new(ip.parse().expect("ip"), 8080);
                servers.push(Server::tcp_echo(&pod, addr, &name));
                servers.push(Server::udp_peer(&pod, addr, &name));
            }
            pods.push(pod);
        }
        Self {
            servers,
            ext,
            node_a,
            node_b,
            pods,
        }
    }
}
