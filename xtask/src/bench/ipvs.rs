//! kube-proxy's IPVS mode, reproduced: the ClusterIPs bound to the `kube-ipvs0` dummy
//! interface (so IPVS sees the traffic at LOCAL_IN), one virtual service per service
//! port with the `rr` scheduler and masquerading (`-m`) real servers of weight 1, the
//! `KUBE-CLUSTER-IP` and `KUBE-LOOP-BACK` ipsets, and the few iptables rules that
//! masquerade outside and hairpin traffic. After kube-proxy's `pkg/proxy/ipvs`.
//!
//! kube-proxy talks netlink directly (one message per virtual or real server); the bench
//! feeds the same objects to `ip -batch`, `ipset restore` and `ipvsadm -R`, which send
//! the same messages.

use std::fmt::Write as _;

use super::plan::{Service, CLUSTER_CIDR, TARGET};

/// `ip -batch` input: the dummy interface's addresses (one /32 per ClusterIP).
pub fn addresses(services: &[Service]) -> String {
    let mut out = String::new();
    for s in services {
        let _ = writeln!(out, "address add {}/32 dev kube-ipvs0", s.vip);
    }
    out
}

/// `ipset restore` input: kube-proxy's sets, with the cluster IPs, and hairpin entries for
/// the endpoints on this node (the target's pods; the fillers' endpoints are elsewhere).
pub fn ipsets(services: &[Service]) -> String {
    let mut out = String::new();
    for (name, kind) in [
        ("KUBE-CLUSTER-IP", "hash:ip,port"),
        ("KUBE-LOOP-BACK", "hash:ip,port,ip"),
        ("KUBE-EXTERNAL-IP", "hash:ip,port"),
        ("KUBE-LOAD-BALANCER", "hash:ip,port"),
        ("KUBE-HEALTH-CHECK-NODE-PORT", "bitmap:port range 0-65535"),
        ("KUBE-IPVS-IPS", "hash:ip"),
    ] {
        let _ = writeln!(out, "create {name} {kind} -exist");
    }
    for s in services {
        let _ = writeln!(out, "add KUBE-IPVS-IPS {} -exist", s.vip);
        for port in &s.ports {
            let proto = port.proto.lower();
            let _ = writeln!(
                out,
                "add KUBE-CLUSTER-IP {},{proto}:{} -exist",
                s.vip, port.port
            );
            if s.name != TARGET {
                continue;
            }
            for ep in &s.endpoints {
                let _ = writeln!(
                    out,
                    "add KUBE-LOOP-BACK {ep},{proto}:{},{ep} -exist",
                    port.target_port
                );
            }
        }
    }
    out
}

fn proto_flag(service: &Service, port: &super::plan::Port) -> String {
    let flag = match port.proto {
        super::plan::Proto::Tcp => "-t",
        super::plan::Proto::Udp => "-u",
    };
    format!("{flag} {}:{}", service.vip, port.port)
}

/// `ipvsadm -R` input: virtual services (rr) and their real servers (masquerading,
/// weight 1).
pub fn virtual_servers(services: &[Service]) -> String {
    let mut out = String::new();
    for s in services {
        for port in &s.ports {
            let vs = proto_flag(s, port);
            let _ = writeln!(out, "-A {vs} -s rr");
            for ep in &s.endpoints {
                let _ = writeln!(out, "-a {vs} -r {ep}:{} -m -w 1", port.target_port);
            }
        }
    }
    out
}

/// `ipvsadm -R` input for one endpoint change: the new real server is added, the old
/// one deleted (kube-proxy first sets a leaving server's weight to 0 and deletes it when
/// its connections are gone; with no connections left that is an immediate delete).
pub fn change(old: &Service, new: &Service) -> String {
    let mut out = String::new();
    for port in &new.ports {
        let vs = proto_flag(new, port);
        for ep in &new.endpoints {
            if !old.endpoints.contains(ep) {
                let _ = writeln!(out, "-a {vs} -r {ep}:{} -m -w 1", port.target_port);
            }
        }
        for ep in &old.endpoints {
            if !new.endpoints.contains(ep) {
                let _ = writeln!(out, "-d {vs} -r {ep}:{}", port.target_port);
            }
        }
    }
    out
}

/// The iptables rules kube-proxy's IPVS mode keeps (nat and filter), as one
/// `iptables-restore --noflush` input, with the jumps from the built-in chains.
pub fn iptables_rules() -> String {
    format!(
        r#"*nat
:KUBE-SERVICES - [0:0]
:KUBE-POSTROUTING - [0:0]
:KUBE-NODE-PORT - [0:0]
:KUBE-LOAD-BALANCER - [0:0]
:KUBE-MARK-MASQ - [0:0]
-A KUBE-SERVICES -m comment --comment "Kubernetes service cluster ip + port for masquerade purpose" -m set --match-set KUBE-CLUSTER-IP dst,dst ! -s {CLUSTER_CIDR} -j KUBE-MARK-MASQ
-A KUBE-SERVICES -m addrtype --dst-type LOCAL -j KUBE-NODE-PORT
-A KUBE-SERVICES -m set --match-set KUBE-CLUSTER-IP dst,dst -j ACCEPT
-A KUBE-POSTROUTING -m comment --comment "Kubernetes endpoints dst ip:port, source ip for solving hairpin purpose" -m set --match-set KUBE-LOOP-BACK dst,dst,src -j MASQUERADE
-A KUBE-POSTROUTING -m mark ! --mark 0x4000/0x4000 -j RETURN
-A KUBE-POSTROUTING -j MARK --xor-mark 0x4000
-A KUBE-POSTROUTING -m comment --comment "kubernetes service traffic requiring SNAT" -j MASQUERADE --random-fully
-A KUBE-MARK-MASQ -j MARK --or-mark 0x4000
-I PREROUTING -m comment --comment "kubernetes service portals" -j KUBE-SERVICES
-I OUTPUT -m comment --comment "kubernetes service portals" -j KUBE-SERVICES
-I POSTROUTING -m comment --comment "kubernetes postrouting rules" -j KUBE-POSTROUTING
COMMIT
*filter
:KUBE-FORWARD - [0:0]
:KUBE-NODE-PORT - [0:0]
:KUBE-PROXY-FIREWALL - [0:0]
:KUBE-SOURCE-RANGES-FIREWALL - [0:0]
:KUBE-IPVS-FILTER - [0:0]
-A KUBE-FORWARD -m conntrack --ctstate INVALID -j DROP
-A KUBE-FORWARD -m comment --comment "kubernetes forwarding rules" -m mark --mark 0x4000/0x4000 -j ACCEPT
-A KUBE-FORWARD -m comment --comment "kubernetes forwarding conntrack rule" -m conntrack --ctstate RELATED,ESTABLISHED -j ACCEPT
-A KUBE-IPVS-FILTER -m set --match-set KUBE-LOAD-BALANCER dst,dst -j RETURN
-A KUBE-IPVS-FILTER -m set --match-set KUBE-CLUSTER-IP dst,dst -j RETURN
-A KUBE-IPVS-FILTER -m set --match-set KUBE-EXTERNAL-IP dst,dst -j RETURN
-A KUBE-IPVS-FILTER -m set --match-set KUBE-HEALTH-CHECK-NODE-PORT dst -j RETURN
-A KUBE-IPVS-FILTER -m conntrack --ctstate NEW -m set --match-set KUBE-IPVS-IPS dst -j REJECT
-I INPUT -m comment --comment "kubernetes ipvs access filter" -j KUBE-IPVS-FILTER
-I FORWARD -m comment --comment "kubernetes forwarding rules" -j KUBE-FORWARD
COMMIT
"#
    )
}

/// The sysctls kube-proxy's IPVS mode sets (in the node's namespace).
pub const SYSCTLS: &[(&str, &str)] = &[
    ("net.ipv4.vs.conntrack", "1"),
    ("net.ipv4.vs.expire_nodest_conn", "1"),
    ("net.ipv4.vs.expire_quiescent_template", "1"),
];

#[cfg(test)]
mod tests {
    use super::*;
    use crate::bench::plan;

    #[test]
    fn virtual_servers_use_rr_and_masquerading_real_servers() {
        let s = plan::target(false);
        let text = virtual_servers(std::slice::from_ref(&s));
        assert!(text.starts_with(
            "-A -t 10.96.0.10:80 -s rr\n-a -t 10.96.0.10:80 -r 10.224.1.1:80 -m -w 1\n"
        ));
        assert!(text.contains("-A -u 10.96.0.10:53 -s rr\n"));
        assert_eq!(text.lines().filter(|l| l.starts_with("-a ")).count(), 30);
        let c = change(&s, &plan::target(true));
        assert!(c.contains("-a -t 10.96.0.10:80 -r 10.224.1.11:80 -m -w 1\n"));
        assert!(c.contains("-d -u 10.96.0.10:53 -r 10.224.1.10:53\n"));
        assert_eq!(c.lines().count(), 6);
        assert_eq!(
            addresses(&plan::services(2, false)),
            "address add 10.97.0.0/32 dev kube-ipvs0\naddress add 10.96.0.10/32 dev kube-ipvs0\n"
        );
        let sets = ipsets(std::slice::from_ref(&s));
        assert!(sets.contains("add KUBE-CLUSTER-IP 10.96.0.10,udp:53 -exist\n"));
        assert!(sets.contains("add KUBE-LOOP-BACK 10.224.1.1,tcp:80,10.224.1.1 -exist\n"));
        assert!(iptables_rules().contains("! -s 10.224.0.0/12 -j KUBE-MARK-MASQ"));
    }
}
