//! kube-proxy's iptables mode, reproduced: the `iptables-restore` input its full sync
//! writes, the partial sync it writes for one changed service, and the jump rules it
//! ensures in the built-in chains. After kube-proxy's `pkg/proxy/iptables/proxier.go`
//! (1.28 and later, `MinimizeIPTablesRestore` on), checked against its golden tests:
//!
//! ```text
//! -A KUBE-SERVICES -m comment --comment "ns/svc:http cluster IP" -m tcp -p tcp -d VIP --dport 80 -j KUBE-SVC-<hash>
//! -A KUBE-SVC-<hash> -m comment --comment "ns/svc:http cluster IP" -m tcp -p tcp -d VIP --dport 80 ! -s <cluster CIDR> -j KUBE-MARK-MASQ
//! -A KUBE-SVC-<hash> -m comment --comment "ns/svc:http -> 10.0.0.1:80" -m statistic --mode random --probability 0.1000000000 -j KUBE-SEP-<hash>
//! ...                                                                (1/n, 1/(n-1), ..., then no statistic match)
//! -A KUBE-SEP-<hash> -m comment --comment ns/svc:http -s 10.0.0.1 -j KUBE-MARK-MASQ
//! -A KUBE-SEP-<hash> -m comment --comment ns/svc:http -m tcp -p tcp -j DNAT --to-destination 10.0.0.1:80
//! ```
//!
//! Chain names are kube-proxy's: `KUBE-SVC-` + base32(sha256(servicePortName + protocol))
//! and `KUBE-SEP-` + base32(sha256(servicePortName + protocol + endpoint)), 16
//! characters. Above 1,000 endpoints kube-proxy runs in "large cluster mode": the
//! per-endpoint comments are left out and stale chains are deleted only once per sync
//! period, which is what [`Rules::large_cluster`] reproduces.

use std::fmt::Write as _;

use kube_rules::{
    chains::{self, MASQ_MARK},
    text::{comment, probability},
};

use super::plan::{self, Port, Service, CLUSTER_CIDR};

/// kube-proxy's `largeClusterEndpointsThreshold`.
pub const LARGE_CLUSTER_ENDPOINTS: usize = 1000;

pub fn svc_chain(service: &Service, port: &Port) -> String {
    chains::service_chain(&service.port_name(port), port.proto.lower())
}

/// `KUBE-EXT-<hash>`: a NodePort's (and external IPs') chain.
pub fn ext_chain(service: &Service, port: &Port) -> String {
    chains::external_chain(&service.port_name(port), port.proto.lower())
}

pub fn sep_chain(service: &Service, port: &Port, endpoint: &str) -> String {
    chains::endpoint_chain(&service.port_name(port), port.proto.lower(), endpoint)
}

/// The jump rules kube-proxy ensures (`iptables -C` then `-I`) in the built-in chains:
/// `(table, chain, rule arguments)`.
pub fn jump_rules() -> Vec<(&'static str, &'static str, String)> {
    let new = "-m conntrack --ctstate NEW";
    vec![
        (
            "filter",
            "INPUT",
            format!(
                "{new} {} -j KUBE-PROXY-FIREWALL",
                comment("kubernetes load balancer firewall")
            ),
        ),
        (
            "filter",
            "INPUT",
            format!(
                "{} -j KUBE-NODEPORTS",
                comment("kubernetes health check service ports")
            ),
        ),
        (
            "filter",
            "INPUT",
            format!(
                "{new} {} -j KUBE-EXTERNAL-SERVICES",
                comment("kubernetes externally-visible service portals")
            ),
        ),
        (
            "filter",
            "FORWARD",
            format!(
                "{new} {} -j KUBE-PROXY-FIREWALL",
                comment("kubernetes load balancer firewall")
            ),
        ),
        (
            "filter",
            "FORWARD",
            format!("{} -j KUBE-FORWARD", comment("kubernetes forwarding rules")),
        ),
        (
            "filter",
            "FORWARD",
            format!(
                "{new} {} -j KUBE-SERVICES",
                comment("kubernetes service portals")
            ),
        ),
        (
            "filter",
            "FORWARD",
            format!(
                "{new} {} -j KUBE-EXTERNAL-SERVICES",
                comment("kubernetes externally-visible service portals")
            ),
        ),
        (
            "filter",
            "OUTPUT",
            format!(
                "{new} {} -j KUBE-PROXY-FIREWALL",
                comment("kubernetes load balancer firewall")
            ),
        ),
        (
            "filter",
            "OUTPUT",
            format!(
                "{new} {} -j KUBE-SERVICES",
                comment("kubernetes service portals")
            ),
        ),
        (
            "nat",
            "OUTPUT",
            format!("{} -j KUBE-SERVICES", comment("kubernetes service portals")),
        ),
        (
            "nat",
            "PREROUTING",
            format!("{} -j KUBE-SERVICES", comment("kubernetes service portals")),
        ),
        (
            "nat",
            "POSTROUTING",
            format!(
                "{} -j KUBE-POSTROUTING",
                comment("kubernetes postrouting rules")
            ),
        ),
    ]
}

/// The jump rules as one `iptables-restore --noflush` input, with the (still empty)
/// chains they jump to: what kube-proxy's `EnsureChain` and `EnsureRule(Prepend, ..)`
/// leave before its first sync.
pub fn jump_rules_restore() -> String {
    let mut out = String::new();
    for table in ["filter", "nat"] {
        let _ = writeln!(out, "*{table}");
        let mut targets: Vec<&str> = Vec::new();
        let rules = jump_rules();
        for (t, _, rule) in &rules {
            let target = rule.rsplit(' ').next().unwrap_or("");
            if *t == table && !targets.contains(&target) {
                targets.push(target);
                let _ = writeln!(out, ":{target} - [0:0]");
            }
        }
        for (t, chain, rule) in &rules {
            if *t == table {
                let _ = writeln!(out, "-I {chain} {rule}");
            }
        }
        out.push_str("COMMIT\n");
    }
    out
}

/// What one sync writes.
#[derive(Debug)]
pub struct Rules {
    /// kube-proxy's large cluster mode (more than 1,000 endpoints).
    pub large_cluster: bool,
}

impl Rules {
    pub fn for_services(services: &[Service]) -> Self {
        Self {
            large_cluster: plan::endpoint_count(services) > LARGE_CLUSTER_ENDPOINTS,
        }
    }

    /// The filter table, written whole by every sync (small: only the fixed chains when
    /// every service has endpoints).
    fn filter(&self, out: &mut String) {
        out.push_str("*filter\n");
        for chain in [
            "KUBE-NODEPORTS",
            "KUBE-SERVICES",
            "KUBE-EXTERNAL-SERVICES",
            "KUBE-FORWARD",
            "KUBE-PROXY-FIREWALL",
        ] {
            let _ = writeln!(out, ":{chain} - [0:0]");
        }
        out.push_str("-A KUBE-FORWARD -m conntrack --ctstate INVALID -j DROP\n");
        let _ = writeln!(
            out,
            "-A KUBE-FORWARD {} -m mark --mark {MASQ_MARK}/{MASQ_MARK} -j ACCEPT",
            comment("kubernetes forwarding rules")
        );
        let _ = writeln!(
            out,
            "-A KUBE-FORWARD {} -m conntrack --ctstate RELATED,ESTABLISHED -j ACCEPT",
            comment("kubernetes forwarding conntrack rule")
        );
        out.push_str("COMMIT\n");
    }

    /// The chains of one service (its `KUBE-SVC-*` and `KUBE-SEP-*`), declared in
    /// `chains` and filled in `rules`.
    fn service_chains(&self, service: &Service, chains: &mut String, rules: &mut String) {
        for port in &service.ports {
            let spn = service.port_name(port);
            let proto = port.proto.lower();
            let svc = svc_chain(service, port);
            let _ = writeln!(chains, ":{svc} - [0:0]");
            if let Some(node_port) = port.node_port {
                // eTP=Cluster: everything from outside is masqueraded, then the service
                // chain picks an endpoint (kube-proxy's `externalTrafficChain`).
                let ext = ext_chain(service, port);
                let _ = writeln!(chains, ":{ext} - [0:0]");
                let _ = writeln!(
                    rules,
                    "-A KUBE-NODEPORTS {} -m {proto} -p {proto} --dport {node_port} -j {ext}",
                    comment(&spn)
                );
                let _ = writeln!(
                    rules,
                    "-A {ext} {} -j KUBE-MARK-MASQ",
                    comment(&format!(
                        "masquerade traffic for {spn} external destinations"
                    ))
                );
                let _ = writeln!(rules, "-A {ext} -j {svc}");
            }
            let _ = writeln!(
                rules,
                "-A {svc} {} -m {proto} -p {proto} -d {} --dport {} ! -s {CLUSTER_CIDR} -j KUBE-MARK-MASQ",
                comment(&format!("{spn} cluster IP")),
                service.vip,
                port.port
            );
            let n = service.endpoints.len();
            for (i, ep) in service.endpoints.iter().enumerate() {
                let endpoint = format!("{ep}:{}", port.target_port);
                let sep = sep_chain(service, port, &endpoint);
                let mut jump = format!("-A {svc}");
                if !self.large_cluster {
                    let _ = write!(jump, " {}", comment(&format!("{spn} -> {endpoint}")));
                }
                if i + 1 < n {
                    let _ = write!(
                        jump,
                        " -m statistic --mode random --probability {}",
                        probability(n - i)
                    );
                }
                let _ = writeln!(rules, "{jump} -j {sep}");
                let _ = writeln!(chains, ":{sep} - [0:0]");
                let c = if self.large_cluster {
                    String::new()
                } else {
                    format!(" {}", comment(&spn))
                };
                let _ = writeln!(rules, "-A {sep}{c} -s {ep} -j KUBE-MARK-MASQ");
                let _ = writeln!(
                    rules,
                    "-A {sep}{c} -m {proto} -p {proto} -j DNAT --to-destination {endpoint}"
                );
            }
        }
    }

    /// The `KUBE-SERVICES` rules of one service (one per port).
    fn services_rules(service: &Service, rules: &mut String) {
        for port in &service.ports {
            let proto = port.proto.lower();
            let _ = writeln!(
                rules,
                "-A KUBE-SERVICES {} -m {proto} -p {proto} -d {} --dport {} -j {}",
                comment(&format!("{} cluster IP", service.port_name(port))),
                service.vip,
                port.port,
                svc_chain(service, port)
            );
        }
    }

    /// The nat table around the per-service chains: fixed chains declared, fixed rules
    /// written, `KUBE-SERVICES` written whole (kube-proxy rewrites it on every sync,
    /// partial or not), ending with the NodePorts rule and `tail` (chain deletions).
    fn nat(&self, all: &[Service], rewritten: &[&Service], stale: &[String]) -> String {
        let mut chains = String::new();
        let mut rules = String::new();
        for chain in [
            "KUBE-NODEPORTS",
            "KUBE-SERVICES",
            "KUBE-MARK-MASQ",
            "KUBE-POSTROUTING",
        ] {
            let _ = writeln!(chains, ":{chain} - [0:0]");
        }
        let _ = writeln!(
            rules,
            "-A KUBE-POSTROUTING -m mark ! --mark {MASQ_MARK}/{MASQ_MARK} -j RETURN"
        );
        let _ = writeln!(rules, "-A KUBE-POSTROUTING -j MARK --xor-mark {MASQ_MARK}");
        let _ = writeln!(
            rules,
            "-A KUBE-POSTROUTING {} -j MASQUERADE --random-fully",
            comment("kubernetes service traffic requiring SNAT")
        );
        let _ = writeln!(rules, "-A KUBE-MARK-MASQ -j MARK --or-mark {MASQ_MARK}");
        // kube-proxy walks the services once: each service's KUBE-SERVICES rule, then
        // (if it changed, or in a full sync) its own chains.
        let mut r = 0;
        for service in all {
            Self::services_rules(service, &mut rules);
            if r < rewritten.len() && rewritten[r].name == service.name {
                self.service_chains(rewritten[r], &mut chains, &mut rules);
                r += 1;
            }
        }
        let _ = writeln!(
            rules,
            "-A KUBE-SERVICES {} -m addrtype --dst-type LOCAL -j KUBE-NODEPORTS",
            comment("kubernetes service nodeports; NOTE: this must be the last rule in this chain")
        );
        for chain in stale {
            let _ = writeln!(chains, ":{chain} - [0:0]");
            let _ = writeln!(rules, "-X {chain}");
        }
        format!("*nat\n{chains}{rules}COMMIT\n")
    }

    /// The full sync: every service's chains (the input of `iptables-restore --noflush
    /// --counters` from nothing).
    pub fn full(&self, services: &[Service]) -> String {
        let mut out = String::new();
        self.filter(&mut out);
        let all: Vec<&Service> = services.iter().collect();
        out.push_str(&self.nat(services, &all, &[]));
        out
    }

    /// The partial sync after `changed`'s endpoints changed: the filter table, the fixed
    /// nat chains with `KUBE-SERVICES` whole, and `changed`'s chains; `stale` chains
    /// (found with `iptables-save` outside large cluster mode) are deleted.
    pub fn partial(&self, services: &[Service], changed: &Service, stale: &[String]) -> String {
        let mut out = String::new();
        self.filter(&mut out);
        out.push_str(&self.nat(services, &[changed], stale));
        out
    }
}

/// The `KUBE-SVC-*`/`KUBE-SEP-*` chains named in `iptables-save -t nat` output that the
/// new `services` no longer use (kube-proxy's stale-chain cleanup).
pub fn stale_chains(save: &str, services: &[Service]) -> Vec<String> {
    let mut active = std::collections::HashSet::new();
    for s in services {
        for port in &s.ports {
            active.insert(svc_chain(s, port));
            for ep in &s.endpoints {
                active.insert(sep_chain(s, port, &format!("{ep}:{}", port.target_port)));
            }
        }
    }
    save.lines()
        .filter_map(|l| l.strip_prefix(':'))
        .filter_map(|l| l.split_whitespace().next())
        .filter(|c| c.starts_with("KUBE-SVC-") || c.starts_with("KUBE-SEP-"))
        .filter(|c| !active.contains(*c))
        .map(str::to_string)
        .collect()
}

#[cfg(test)]
mod tests {
    use std::net::Ipv4Addr;

    use super::*;
    use crate::bench::plan::{Proto, NAMESPACE};

    /// The seed article's `default/nginx-service` (unnamed port 80, three pods), with
    /// the chain names kube-proxy gave it there.
    fn nginx() -> Service {
        Service {
            name: "nginx-service".into(),
            vip: Ipv4Addr::new(10, 96, 0, 100),
            ports: vec![Port {
                name: "",
                proto: Proto::Tcp,
                port: 80,
                target_port: 80,
                node_port: None,
            }],
            endpoints: vec![
                Ipv4Addr::new(192, 168, 104, 146),
                Ipv4Addr::new(192, 168, 104, 147),
                Ipv4Addr::new(192, 168, 238, 78),
            ],
            remote: false,
        }
    }

    #[test]
    fn chain_names_match_the_seed_article() {
        // The article's namespace is "default"; ours is fixed, so hash by hand too.
        assert_eq!(
            format!(
                "KUBE-SVC-{}",
                kube_rules::hash::chain_hash_string("default/nginx-servicetcp", 16)
            ),
            "KUBE-SVC-V2OKYYMBY3REGZOG"
        );
        for (ep, want) in [
            ("192.168.104.146:80", "KUBE-SEP-X7WBOA4PTAJA3GNK"),
            ("192.168.104.147:80", "KUBE-SEP-I53TFYWHN2OKR6FH"),
            ("192.168.238.78:80", "KUBE-SEP-WU6475GP2VYJZBGF"),
        ] {
            let text = format!("default/nginx-servicetcp{ep}");
            assert_eq!(
                format!(
                    "KUBE-SEP-{}",
                    kube_rules::hash::chain_hash_string(&text, 16)
                ),
                want
            );
        }
        // kube-proxy's golden tests: ns1/svc1, port p80.
        assert_eq!(
            format!(
                "KUBE-SVC-{}",
                kube_rules::hash::chain_hash_string("ns1/svc1:p80tcp", 16)
            ),
            "KUBE-SVC-XPGD46QRK7WJZT7O"
        );
        assert_eq!(
            format!(
                "KUBE-SEP-{}",
                kube_rules::hash::chain_hash_string("ns1/svc1:p80tcp10.180.0.1:80", 16)
            ),
            "KUBE-SEP-SXIVWICOYRO3J4NJ"
        );
        let s = nginx();
        assert_eq!(
            s.port_name(&s.ports[0]),
            format!("{NAMESPACE}/nginx-service")
        );
    }

    #[test]
    fn full_sync_has_kube_proxys_structure() {
        let s = nginx();
        let rules = Rules {
            large_cluster: false,
        }
        .full(std::slice::from_ref(&s));
        let svc = svc_chain(&s, &s.ports[0]);
        let seps: Vec<String> = s
            .endpoints
            .iter()
            .map(|e| sep_chain(&s, &s.ports[0], &format!("{e}:80")))
            .collect();
        let want = format!(
            r#"*filter
:KUBE-NODEPORTS - [0:0]
:KUBE-SERVICES - [0:0]
:KUBE-EXTERNAL-SERVICES - [0:0]
:KUBE-FORWARD - [0:0]
:KUBE-PROXY-FIREWALL - [0:0]
-A KUBE-FORWARD -m conntrack --ctstate INVALID -j DROP
-A KUBE-FORWARD -m comment --comment "kubernetes forwarding rules" -m mark --mark 0x4000/0x4000 -j ACCEPT
-A KUBE-FORWARD -m comment --comment "kubernetes forwarding conntrack rule" -m conntrack --ctstate RELATED,ESTABLISHED -j ACCEPT
COMMIT
*nat
:KUBE-NODEPORTS - [0:0]
:KUBE-SERVICES - [0:0]
:KUBE-MARK-MASQ - [0:0]
:KUBE-POSTROUTING - [0:0]
:{svc} - [0:0]
:{s0} - [0:0]
:{s1} - [0:0]
:{s2} - [0:0]
-A KUBE-POSTROUTING -m mark ! --mark 0x4000/0x4000 -j RETURN
-A KUBE-POSTROUTING -j MARK --xor-mark 0x4000
-A KUBE-POSTROUTING -m comment --comment "kubernetes service traffic requiring SNAT" -j MASQUERADE --random-fully
-A KUBE-MARK-MASQ -j MARK --or-mark 0x4000
-A KUBE-SERVICES -m comment --comment "bench/nginx-service cluster IP" -m tcp -p tcp -d 10.96.0.100 --dport 80 -j {svc}
-A {svc} -m comment --comment "bench/nginx-service cluster IP" -m tcp -p tcp -d 10.96.0.100 --dport 80 ! -s 10.224.0.0/12 -j KUBE-MARK-MASQ
-A {svc} -m comment --comment "bench/nginx-service -> 192.168.104.146:80" -m statistic --mode random --probability 0.3333333333 -j {s0}
-A {s0} -m comment --comment bench/nginx-service -s 192.168.104.146 -j KUBE-MARK-MASQ
-A {s0} -m comment --comment bench/nginx-service -m tcp -p tcp -j DNAT --to-destination 192.168.104.146:80
-A {svc} -m comment --comment "bench/nginx-service -> 192.168.104.147:80" -m statistic --mode random --probability 0.5000000000 -j {s1}
-A {s1} -m comment --comment bench/nginx-service -s 192.168.104.147 -j KUBE-MARK-MASQ
-A {s1} -m comment --comment bench/nginx-service -m tcp -p tcp -j DNAT --to-destination 192.168.104.147:80
-A {svc} -m comment --comment "bench/nginx-service -> 192.168.238.78:80" -j {s2}
-A {s2} -m comment --comment bench/nginx-service -s 192.168.238.78 -j KUBE-MARK-MASQ
-A {s2} -m comment --comment bench/nginx-service -m tcp -p tcp -j DNAT --to-destination 192.168.238.78:80
-A KUBE-SERVICES -m comment --comment "kubernetes service nodeports; NOTE: this must be the last rule in this chain" -m addrtype --dst-type LOCAL -j KUBE-NODEPORTS
COMMIT
"#,
            s0 = seps[0],
            s1 = seps[1],
            s2 = seps[2],
        );
        assert_eq!(rules, want);
    }

    #[test]
    fn large_cluster_mode_drops_endpoint_comments_and_partial_sync_keeps_services_whole() {
        let services = plan::services(120, false);
        let r = Rules::for_services(&services);
        assert!(r.large_cluster, "1,209 endpoints > 1,000");
        let full = r.full(&services);
        assert!(!full.contains(" -> "), "no per-endpoint comments");
        assert_eq!(
            full.lines()
                .filter(|l| l.starts_with("-A KUBE-SERVICES"))
                .count(),
            119 + 3 + 1,
            "one rule per service port and the NodePorts rule"
        );
        // The target is last in KUBE-SERVICES (before the NodePorts rule).
        let last_svc = full
            .lines()
            .filter(|l| l.starts_with("-A KUBE-SERVICES"))
            .nth(119)
            .expect("rule");
        assert!(last_svc.contains("-d 10.96.0.10 --dport 80"), "{last_svc}");
        // Ten endpoints: probabilities 1/10 .. 1/2, then the unconditional jump.
        let target = plan::target(false);
        let svc = svc_chain(&target, &target.ports[0]);
        let probs: Vec<&str> = full
            .lines()
            .filter(|l| l.starts_with(&format!("-A {svc} ")) && l.contains("KUBE-SEP-"))
            .map(|l| {
                l.split("--probability ")
                    .nth(1)
                    .map_or("last", |p| p.split(' ').next().unwrap_or(""))
            })
            .collect();
        assert_eq!(
            probs,
            [
                "0.1000000000",
                "0.1111111111",
                "0.1250000000",
                "0.1428571429",
                "0.1666666667",
                "0.2000000000",
                "0.2500000000",
                "0.3333333333",
                "0.5000000000",
                "last"
            ]
        );

        let swapped = plan::services(120, true);
        let old = sep_chain(&target, &target.ports[0], "10.224.1.10:80");
        let partial = r.partial(&swapped, &swapped[119], std::slice::from_ref(&old));
        assert_eq!(
            partial
                .lines()
                .filter(|l| l.starts_with("-A KUBE-SERVICES"))
                .count(),
            123,
            "KUBE-SERVICES is rewritten whole"
        );
        let declared: Vec<&str> = partial
            .lines()
            .filter(|l| l.starts_with(":KUBE-SVC-"))
            .collect();
        assert_eq!(declared.len(), 3, "only the changed service's chains");
        assert!(partial.contains("10.224.1.11:80"));
        assert!(!partial.contains("10.224.1.10:80"));
        assert!(partial.contains(&format!("-X {old}\n")));
        // Stale chains come from iptables-save output.
        let save = format!(":KUBE-SERVICES - [0:0]\n:{old} - [0:0]\n:{svc} - [0:0]\n");
        assert_eq!(stale_chains(&save, &swapped), vec![old]);
    }

    /// kube-proxy's NodePort rules for eTP=Cluster (its golden test's `ns2b/svc2b`
    /// shape): KUBE-NODEPORTS jumps to KUBE-EXT, which marks for masquerade and goes to
    /// the service chain.
    #[test]
    fn a_node_port_gets_kube_proxys_external_chain() {
        let s = plan::remote_target();
        let text = Rules::for_services(std::slice::from_ref(&s)).full(std::slice::from_ref(&s));
        let ext = ext_chain(&s, &s.ports[0]);
        let svc = svc_chain(&s, &s.ports[0]);
        assert!(
            ext.starts_with("KUBE-EXT-") && ext[9..] == svc[9..],
            "{ext} {svc}"
        );
        for line in [
            format!(":{ext} - [0:0]"),
            format!("-A KUBE-NODEPORTS -m comment --comment bench/target:dns -m udp -p udp --dport 30053 -j {ext}"),
            format!("-A {ext} -m comment --comment \"masquerade traffic for bench/target:dns external destinations\" -j KUBE-MARK-MASQ"),
            format!("-A {ext} -j {svc}"),
        ] {
            assert!(text.lines().any(|l| l == line), "missing {line}:\n{text}");
        }
        // No NodePort rule for a ClusterIP-only service.
        let plain = plan::services(1, false);
        assert!(!Rules::for_services(&plain)
            .full(&plain)
            .contains("KUBE-EXT-"));
    }

    #[test]
    fn jump_rules_cover_the_built_in_chains() {
        let text = jump_rules_restore();
        assert!(text.contains(
            "-I PREROUTING -m comment --comment \"kubernetes service portals\" -j KUBE-SERVICES"
        ));
        assert!(text.contains("-I POSTROUTING -m comment --comment \"kubernetes postrouting rules\" -j KUBE-POSTROUTING"));
        assert_eq!(text.matches("COMMIT").count(), 2);
        assert!(text.contains("*nat\n:KUBE-SERVICES - [0:0]\n:KUBE-POSTROUTING - [0:0]\n"));
    }
}
