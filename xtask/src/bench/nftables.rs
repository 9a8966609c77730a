//! kube-proxy's nftables mode, reproduced: the `nft -f -` transactions its full sync and
//! its partial sync (one service's endpoints changed) write, after kube-proxy's
//! `pkg/proxy/nftables/proxier.go` and its golden test (`TestOverallNFTablesRules`).
//!
//! Layout: `table ip kube-proxy`; base chains hooked at prerouting/output (DNAT,
//! priority -100), postrouting (masquerade), forward/input/output (filters); the
//! `service-ips` verdict map `ip daddr . meta l4proto . th dport : goto service-<hash>-ns/name/proto/port`;
//! each service chain marks outside traffic for masquerade and picks an endpoint with
//! `numgen random mod n vmap { 0 : goto endpoint-..., ... }`; each endpoint chain DNATs.
//! Chain names: `service-` / `endpoint-` + the first 8 base32 characters of
//! sha256(base name) + `-` + base name.

use std::fmt::Write as _;

use super::plan::{Port, Service, CLUSTER_CIDR, NODE_CLIENT_SIDE, SERVICE_CIDR};

const T: &str = "ip kube-proxy";

/// `ns/name/proto/port`.
fn service_base(service: &Service, port: &Port) -> String {
    format!(
        "{}/{}/{}",
        service.namespaced(),
        port.proto.lower(),
        port.name
    )
}

pub fn service_chain(service: &Service, port: &Port) -> String {
    let base = service_base(service, port);
    format!(
        "service-{}-{base}",
        kube_rules::hash::chain_hash_string(&base, 8)
    )
}

/// `external-<hash>-ns/name/proto/port`: a NodePort's chain.
pub fn external_chain(service: &Service, port: &Port) -> String {
    let base = service_base(service, port);
    format!(
        "external-{}-{base}",
        kube_rules::hash::chain_hash_string(&base, 8)
    )
}

pub fn endpoint_chain(service: &Service, port: &Port, endpoint: &str) -> String {
    let base = format!(
        "{}__{}",
        service_base(service, port),
        endpoint.replace(':', "/")
    );
    format!(
        "endpoint-{}-{base}",
        kube_rules::hash::chain_hash_string(&base, 8)
    )
}

/// The table, sets, maps, base chains and fixed rules, as `setupNFTables` writes them at
/// the start of every sync (base chains are flushed and refilled each time).
// Long: kube-proxy's nftables ruleset as it writes it, one line per rule (the fixture the
// bench loads).
fn base(out: &mut String) {
    let _ = writeln!(
        out,
        "add table {T} {{ comment \"rules for kube-proxy\" ; }}"
    );
    for (name, spec) in [
        (
            "cluster-ips",
            "type ipv4_addr ; comment \"Active ClusterIPs\" ;",
        ),
        (
            "nodeport-ips",
            "type ipv4_addr ; comment \"IPs that accept NodePort traffic\" ;",
        ),
    ] {
        let _ = writeln!(out, "add set {T} {name} {{ {spec} }}");
    }
    for (name, spec) in [
        ("firewall-ips", "type ipv4_addr . inet_proto . inet_service : verdict ; comment \"destinations that are subject to LoadBalancerSourceRanges\" ;"),
        ("no-endpoint-nodeports", "type inet_proto . inet_service : verdict ; comment \"vmap to drop or reject packets to service nodeports with no endpoints\" ;"),
        ("no-endpoint-services", "type ipv4_addr . inet_proto . inet_service : verdict ; comment \"vmap to drop or reject packets to services with no endpoints\" ;"),
        ("service-ips", "type ipv4_addr . inet_proto . inet_service : verdict ; comment \"ClusterIP, ExternalIP and LoadBalancer IP traffic\" ;"),
        ("service-nodeports", "type inet_proto . inet_service : verdict ; comment \"NodePort traffic\" ;"),
    ] {
        let _ = writeln!(out, "add map {T} {name} {{ {spec} }}");
    }
    let chains = [
        ("cluster-ips-check", ""),
        (
            "filter-prerouting-pre-dnat",
            "type filter hook prerouting priority -110 ;",
        ),
        (
            "filter-output-pre-dnat",
            "type filter hook output priority -110 ;",
        ),
        ("filter-forward", "type filter hook forward priority 0 ;"),
        ("filter-input", "type filter hook input priority 0 ;"),
        ("filter-output", "type filter hook output priority 0 ;"),
        ("firewall-check", ""),
        ("mark-for-masquerade", ""),
        ("masquerading", ""),
        ("nat-output", "type nat hook output priority -100 ;"),
        (
            "nat-postrouting",
            "type nat hook postrouting priority 100 ;",
        ),
        ("nat-prerouting", "type nat hook prerouting priority -100 ;"),
        ("nodeport-endpoints-check", ""),
        (
            "reject-chain",
            "comment \"helper for @no-endpoint-services / @no-endpoint-nodeports\" ;",
        ),
        ("services", ""),
        ("service-endpoints-check", ""),
    ];
    for (name, spec) in chains {
        if spec.is_empty() {
            let _ = writeln!(out, "add chain {T} {name}");
        } else {
            let _ = writeln!(out, "add chain {T} {name} {{ {spec} }}");
        }
        let _ = writeln!(out, "flush chain {T} {name}");
    }
    for (chain, rule) in [
        ("cluster-ips-check", "ip daddr @cluster-ips reject comment \"Reject traffic to invalid ports of ClusterIPs\"".to_string()),
        ("cluster-ips-check", format!("ip daddr {{ {SERVICE_CIDR} }} drop comment \"Drop traffic to unallocated ClusterIPs\"")),
        ("filter-prerouting-pre-dnat", "ct state new jump firewall-check".into()),
        ("filter-forward", "ct state new jump service-endpoints-check".into()),
        ("filter-forward", "ct state new jump cluster-ips-check".into()),
        ("filter-input", "ct state new jump nodeport-endpoints-check".into()),
        ("filter-input", "ct state new jump service-endpoints-check".into()),
        ("filter-output", "ct state new jump service-endpoints-check".into()),
        ("filter-output-pre-dnat", "ct state new jump firewall-check".into()),
        ("filter-output", "ct state new jump cluster-ips-check".into()),
        ("firewall-check", "ip daddr . meta l4proto . th dport vmap @firewall-ips".into()),
        ("mark-for-masquerade", "mark set mark or 0x4000".into()),
        ("masquerading", "mark and 0x4000 == 0 return".into()),
        ("masquerading", "mark set mark xor 0x4000".into()),
        ("masquerading", "masquerade fully-random".into()),
        ("nat-output", "jump services".into()),
        ("nat-postrouting", "jump masquerading".into()),
        ("nat-prerouting", "jump services".into()),
        ("nodeport-endpoints-check", "ip daddr @nodeport-ips meta l4proto . th dport vmap @no-endpoint-nodeports".into()),
        ("reject-chain", "reject".into()),
        ("services", "ip daddr . meta l4proto . th dport vmap @service-ips".into()),
        ("services", "ip daddr @nodeport-ips meta l4proto . th dport vmap @service-nodeports".into()),
        ("service-endpoints-check", "ip daddr . meta l4proto . th dport vmap @no-endpoint-services".into()),
    ] {
        let _ = writeln!(out, "add rule {T} {chain} {rule}");
    }
    let _ = writeln!(out, "add element {T} nodeport-ips {{ {NODE_CLIENT_SIDE} }}");
}

/// One service's chains; `flush` first when they may exist (partial sync). The endpoint
/// chains come first: the service chain's verdict map jumps to them.
fn service_chains(service: &Service, flush: bool, out: &mut String) {
    for port in &service.ports {
        let chain = service_chain(service, port);
        let proto = port.proto.lower();
        let endpoints: Vec<(String, String)> = service
            .endpoints
            .iter()
            .map(|ep| {
                let endpoint = format!("{ep}:{}", port.target_port);
                (endpoint_chain(service, port, &endpoint), endpoint)
            })
            .collect();
        for ((ep_chain, endpoint), ip) in endpoints.iter().zip(&service.endpoints) {
            let _ = writeln!(out, "add chain {T} {ep_chain}");
            if flush {
                let _ = writeln!(out, "flush chain {T} {ep_chain}");
            }
            let _ = writeln!(
                out,
                "add rule {T} {ep_chain} ip saddr {ip} jump mark-for-masquerade"
            );
            let _ = writeln!(
                out,
                "add rule {T} {ep_chain} meta l4proto {proto} dnat to {endpoint}"
            );
        }
        let _ = writeln!(out, "add chain {T} {chain}");
        if flush {
            let _ = writeln!(out, "flush chain {T} {chain}");
        }
        let _ = writeln!(
            out,
            "add rule {T} {chain} ip daddr {} ip saddr != {CLUSTER_CIDR} jump mark-for-masquerade",
            service.vip
        );
        let vmap: Vec<String> = endpoints
            .iter()
            .enumerate()
            .map(|(i, (c, _))| format!("{i} : goto {c}"))
            .collect();
        let _ = writeln!(
            out,
            "add rule {T} {chain} numgen random mod {} vmap {{ {} }}",
            endpoints.len(),
            vmap.join(" , ")
        );
        if port.node_port.is_some() {
            // eTP=Cluster: external traffic is masqueraded, then the service chain.
            let ext = external_chain(service, port);
            let _ = writeln!(out, "add chain {T} {ext}");
            if flush {
                let _ = writeln!(out, "flush chain {T} {ext}");
            }
            let _ = writeln!(out, "add rule {T} {ext} jump mark-for-masquerade");
            let _ = writeln!(out, "add rule {T} {ext} goto {chain}");
        }
    }
}

fn elements(service: &Service, out: &mut String) {
    let _ = writeln!(out, "add element {T} cluster-ips {{ {} }}", service.vip);
    for port in &service.ports {
        let _ = writeln!(
            out,
            "add element {T} service-ips {{ {} . {} . {} : goto {} }}",
            service.vip,
            port.proto.lower(),
            port.port,
            service_chain(service, port)
        );
        if let Some(node_port) = port.node_port {
            let _ = writeln!(
                out,
                "add element {T} service-nodeports {{ {} . {node_port} : goto {} }}",
                port.proto.lower(),
                external_chain(service, port)
            );
        }
    }
}

/// The full sync from nothing: base, then every service's chains and map elements.
pub fn full(services: &[Service]) -> String {
    let mut out = String::new();
    base(&mut out);
    for s in services {
        service_chains(s, false, &mut out);
        elements(s, &mut out);
    }
    out
}

/// The partial sync after `changed`'s endpoints changed from `old`: the base is
/// re-asserted, the service's chains are flushed and rewritten, the endpoint chains
/// that left are flushed (kube-proxy deletes stale chains in a later sync, once no map
/// element can still point at them). The service-ips element does not change.
pub fn partial(changed: &Service, old: &Service) -> String {
    let mut out = String::new();
    base(&mut out);
    service_chains(changed, true, &mut out);
    for port in &old.ports {
        for ep in &old.endpoints {
            if !changed.endpoints.contains(ep) {
                let endpoint = format!("{ep}:{}", port.target_port);
                let _ = writeln!(
                    out,
                    "flush chain {T} {}",
                    endpoint_chain(old, port, &endpoint)
                );
            }
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use std::net::Ipv4Addr;

    use super::*;
    use crate::bench::plan::{self, Proto};

    #[test]
    fn chain_names_match_kube_proxys_golden_test() {
        // `ns1/svc1` port `p80` in kube-proxy's TestOverallNFTablesRules.
        assert_eq!(
            format!(
                "service-{}-ns1/svc1/tcp/p80",
                kube_rules::hash::chain_hash_string("ns1/svc1/tcp/p80", 8)
            ),
            "service-ULMVA6XW-ns1/svc1/tcp/p80"
        );
        assert_eq!(
            kube_rules::hash::chain_hash_string("ns1/svc1/tcp/p80__10.180.0.1/80", 8),
            "5OJB2KTY"
        );
        let s = plan::target(false);
        let c = endpoint_chain(&s, &s.ports[0], "10.224.1.1:80");
        assert!(c.ends_with("-bench/target/tcp/http__10.224.1.1/80"), "{c}");
    }

    /// kube-proxy's NodePort shape for eTP=Cluster (its golden test's `svc2`): a
    /// `service-nodeports` element going to the `external-` chain, which marks for
    /// masquerade and goes to the service chain.
    #[test]
    fn a_node_port_gets_kube_proxys_external_chain() {
        let s = crate::bench::plan::remote_target();
        let text = full(std::slice::from_ref(&s));
        let ext = external_chain(&s, &s.ports[0]);
        let svc = service_chain(&s, &s.ports[0]);
        assert!(
            ext.starts_with("external-") && ext.ends_with("-bench/target/udp/dns"),
            "{ext}"
        );
        for line in [
            format!("add chain {T} {ext}"),
            format!("add rule {T} {ext} jump mark-for-masquerade"),
            format!("add rule {T} {ext} goto {svc}"),
            format!("add element {T} service-nodeports {{ udp . 30053 : goto {ext} }}"),
        ] {
            assert!(text.lines().any(|l| l == line), "missing {line}:\n{text}");
        }
    }

    #[test]
    fn full_sync_has_kube_proxys_structure() {
        let s = Service {
            name: "svc1".into(),
            vip: Ipv4Addr::new(10, 96, 0, 41),
            ports: vec![Port {
                name: "p80",
                proto: Proto::Tcp,
                port: 80,
                target_port: 80,
                node_port: None,
            }],
            endpoints: vec![Ipv4Addr::new(10, 180, 0, 1), Ipv4Addr::new(10, 180, 0, 2)],
            remote: false,
        };
        let text = full(std::slice::from_ref(&s));
        let svc = service_chain(&s, &s.ports[0]);
        let e1 = endpoint_chain(&s, &s.ports[0], "10.180.0.1:80");
        let e2 = endpoint_chain(&s, &s.ports[0], "10.180.0.2:80");
        let tail = format!(
            "add chain ip kube-proxy {e1}
add rule ip kube-proxy {e1} ip saddr 10.180.0.1 jump mark-for-masquerade
add rule ip kube-proxy {e1} meta l4proto tcp dnat to 10.180.0.1:80
add chain ip kube-proxy {e2}
add rule ip kube-proxy {e2} ip saddr 10.180.0.2 jump mark-for-masquerade
add rule ip kube-proxy {e2} meta l4proto tcp dnat to 10.180.0.2:80
add chain ip kube-proxy {svc}
add rule ip kube-proxy {svc} ip daddr 10.96.0.41 ip saddr != 10.224.0.0/12 jump mark-for-masquerade
add rule ip kube-proxy {svc} numgen random mod 2 vmap {{ 0 : goto {e1} , 1 : goto {e2} }}
add element ip kube-proxy cluster-ips {{ 10.96.0.41 }}
add element ip kube-proxy service-ips {{ 10.96.0.41 . tcp . 80 : goto {svc} }}
"
        );
        assert!(text.ends_with(&tail), "{text}");
        for line in [
            "add table ip kube-proxy { comment \"rules for kube-proxy\" ; }",
            "add chain ip kube-proxy nat-prerouting { type nat hook prerouting priority -100 ; }",
            "add rule ip kube-proxy services ip daddr . meta l4proto . th dport vmap @service-ips",
            "add rule ip kube-proxy masquerading masquerade fully-random",
            "add rule ip kube-proxy cluster-ips-check ip daddr { 10.96.0.0/12 } drop comment \"Drop traffic to unallocated ClusterIPs\"",
        ] {
            assert!(text.lines().any(|l| l == line), "{line} missing");
        }
    }

    #[test]
    fn partial_sync_rewrites_one_service_and_flushes_the_endpoint_that_left() {
        let old = plan::target(false);
        let new = plan::target(true);
        let text = partial(&new, &old);
        assert!(!text.contains("add element ip kube-proxy service-ips"));
        assert_eq!(
            text.lines()
                .filter(|l| l.starts_with("add rule") && l.contains("numgen random mod 10"))
                .count(),
            3,
            "one vmap rule per port"
        );
        let gone = endpoint_chain(&old, &old.ports[0], "10.224.1.10:80");
        assert!(text.contains(&format!("flush chain ip kube-proxy {gone}\n")));
        assert!(!text.contains(&format!("add chain ip kube-proxy {gone}\n")));
        assert!(text.contains("dnat to 10.224.1.11:80"));
    }
}
