//! What one sync writes ([`Rules`]): the filter table, the nat table around the
//! per-service chains, a full sync and the partial sync of one changed service, in
//! kube-proxy's large cluster mode above [`LARGE_CLUSTER_ENDPOINTS`] endpoints.

use std::fmt::Write as _;

use kube_rules::{
    chains::MASQ_MARK,
    text::{comment, probability},
};

use super::names::{ext_chain, sep_chain, svc_chain};
use crate::bench::plan::{self, Service, CLUSTER_CIDR};

/// kube-proxy's `largeClusterEndpointsThreshold`.
pub const LARGE_CLUSTER_ENDPOINTS: usize = 1000;

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
