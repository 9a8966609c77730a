//! The iptables rules kube-proxy (iptables mode) would have written for one Service
//! port, in `iptables-save` form, with the chain names kube-proxy computes
//! (`pkg/proxy/iptables/proxier.go`)
//! (the names and the rule text come from the `kube-rules` crate, shared with the
//! kube-proxy cleanup and the bench).
//!
//! The rule shapes follow `syncProxyRules` and `writeServiceToEndpointRules`: endpoints
//! sorted by their `ip:port` string, a `statistic` rule with probability 1/(n-i) for all
//! but the last endpoint, `recent` rules first for ClientIP affinity, REJECT (no
//! endpoints) or DROP (no local endpoints) in the filter table. Probabilities are printed
//! as `iptables-save` prints them: kube-proxy writes `%0.10f`, iptables keeps a 31-bit
//! fraction and prints it with 11 decimals (`0.3333333333` comes back as `0.33333333349`,
//! the value in `iptables -L` listings). Rules that depend on kube-proxy flags this node
//! does not know (`--cluster-cidr` masquerading, localhost NodePorts) are left out.

use std::net::{IpAddr, SocketAddr};

pub use kube_rules::{
    chains::{
        endpoint_chain, external_chain, firewall_chain, local_chain, port_proto_hash, service_chain,
    },
    text::{listed_probability, save_string},
};

use super::snapshot::{Cidr, Kind};
use crate::model::Proto;

/// One Service port as kube-proxy would see it on this node, rebuilt from a frontend.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ServicePort {
    /// `namespace/name[:port]` (the `REVNAT` name).
    pub name: String,
    pub proto: Proto,
    pub kind: Kind,
    /// The cluster IP, external IP or load-balancer IP; unspecified for a NodePort.
    pub address: IpAddr,
    /// The service port, or the node port.
    pub port: u16,
    /// Endpoints for Cluster policy (the frontend's slots).
    pub cluster_endpoints: Vec<SocketAddr>,
    /// Endpoints for Local policy: the slots of an iTP=Local cluster IP, or of the
    /// ext-local twin of an eTP=Local external frontend.
    pub local_endpoints: Vec<SocketAddr>,
    /// `internalTrafficPolicy: Local` (a cluster IP with `LOCAL_ONLY`).
    pub internal_local: bool,
    /// `externalTrafficPolicy: Local`.
    pub external_local: bool,
    /// ClientIP affinity timeout in seconds.
    pub affinity: Option<u32>,
    pub source_ranges: Vec<Cidr>,
}

/// Rules for the nat and filter tables, in `iptables-save` form.
#[derive(Clone, Debug, Default, PartialEq, Eq, serde::Serialize)]
pub struct Rules {
    /// `ip6tables-save` instead of `iptables-save`.
    pub ipv6: bool,
    pub nat: Vec<String>,
    pub filter: Vec<String>,
}

impl Rules {
    /// The rules as `iptables-save` sections (`*nat`, `*filter`), indented.
    pub fn render(&self, indent: &str) -> String {
        let mut out = String::new();
        for (table, rules) in [("nat", &self.nat), ("filter", &self.filter)] {
            if rules.is_empty() {
                continue;
            }
            out.push_str(&format!("{indent}*{table}\n"));
            for r in rules {
                out.push_str(&format!("{indent}{r}\n"));
            }
        }
        out
    }
}

fn host_cidr(a: IpAddr) -> String {
    match a {
        IpAddr::V4(_) => format!("{a}/32"),
        IpAddr::V6(_) => format!("{a}/128"),
    }
}

fn recent_mask(a: IpAddr) -> &'static str {
    match a {
        IpAddr::V4(_) => "255.255.255.255",
        IpAddr::V6(_) => "ffff:ffff:ffff:ffff:ffff:ffff:ffff:ffff",
    }
}

fn reject(a: IpAddr) -> &'static str {
    match a {
        IpAddr::V4(_) => "REJECT --reject-with icmp-port-unreachable",
        IpAddr::V6(_) => "REJECT --reject-with icmp6-port-unreachable",
    }
}

fn sorted(endpoints: &[SocketAddr]) -> Vec<SocketAddr> {
    let mut v = endpoints.to_vec();
    v.sort_by_key(|e| e.to_string());
    v.dedup();
    v
}

/// The rules kube-proxy would write for `sp`: the entry rules of its kind (a ClusterIP, or
/// an external destination with its external and firewall chains), then the service
/// chains' endpoint rules, then one chain per endpoint.
pub fn rules(sp: &ServicePort) -> Rules {
    let names = ChainNames::of(sp);
    let mut r = Rules {
        ipv6: sp.address.is_ipv6(),
        ..Rules::default()
    };
    let cluster = sorted(&sp.cluster_endpoints);
    let local = sorted(&sp.local_endpoints);
    let (uses_cluster, uses_local) = if sp.kind == Kind::ClusterIP {
        cluster_ip_rules(&mut r, sp, &names, &cluster, &local)
    } else {
        external_rules(&mut r, sp, &names, &cluster, &local)
    };
    let mut sep_endpoints: Vec<SocketAddr> = Vec::new();
    if uses_cluster {
        endpoint_rules(&mut r, sp, &names.svc, &cluster);
        sep_endpoints.extend(&cluster);
    }
    if uses_local {
        endpoint_rules(&mut r, sp, &names.svl, &local);
        sep_endpoints.extend(&local);
    }
    endpoint_chain_rules(&mut r, sp, &names, &sep_endpoints);
    r
}

/// The names one Service port's rules use: its name, protocol, `--dport` match and chains.
struct ChainNames<'a> {
    n: &'a str,
    p: &'a str,
    dport: String,
    /// `KUBE-SVC-...`: the cluster endpoints.
    svc: String,
    /// `KUBE-SVL-...`: the local endpoints.
    svl: String,
    /// `KUBE-EXT-...`: external destinations.
    ext: String,
    /// `KUBE-FW-...`: the load balancer's source ranges.
    fw: String,
}

impl<'a> ChainNames<'a> {
    fn of(sp: &'a ServicePort) -> Self {
        let (n, p) = (sp.name.as_str(), sp.proto.as_str());
        Self {
            n,
            p,
            dport: format!("-m {p} --dport {}", sp.port),
            svc: service_chain(n, p),
            svl: local_chain(n, p),
            ext: external_chain(n, p),
            fw: firewall_chain(n, p),
        }
    }
}

/// A ClusterIP's entry rule (or its reject/drop when it has no endpoints to use).
/// Returns whether the cluster and the local endpoints are used.
fn cluster_ip_rules(
    r: &mut Rules,
    sp: &ServicePort,
    names: &ChainNames,
    cluster: &[SocketAddr],
    local: &[SocketAddr],
) -> (bool, bool) {
    let ChainNames { n, p, dport, .. } = names;
    let c = |s: &str| save_string(s);
    let (chain, has_internal) = if sp.internal_local {
        (&names.svl, !local.is_empty())
    } else {
        (&names.svc, !cluster.is_empty())
    };
    let uses_cluster = !sp.internal_local && !cluster.is_empty();
    let uses_local = sp.internal_local && !local.is_empty();
    let dst = format!("-d {} -p {p}", host_cidr(sp.address));
    if has_internal {
        r.nat.push(format!(
            "-A KUBE-SERVICES {dst} -m comment --comment {} {dport} -j {chain}",
            c(&format!("{n} cluster IP"))
        ));
    } else {
        let (comment, target) = if sp.internal_local {
            (format!("{n} has no local endpoints"), "DROP")
        } else {
            (format!("{n} has no endpoints"), reject(sp.address))
        };
        r.filter.push(format!(
            "-A KUBE-SERVICES {dst} -m comment --comment {} {dport} -j {target}",
            c(&comment)
        ));
    }
    (uses_cluster, uses_local)
}

/// What an external destination (NodePort, external IP, load balancer) has to use.
struct External {
    has_endpoints: bool,
    /// Endpoints the external policy may use (local ones for `Local`).
    has_external: bool,
    /// A load balancer with source ranges and endpoints: the `KUBE-FW-` chain.
    uses_fw: bool,
}

/// An external destination's rules: the entry rules of its kind, its `KUBE-EXT-` chain,
/// its firewall chain. External destinations: Cluster endpoints are always used
/// (short-circuiting local traffic needs them); Local ones with
/// externalTrafficPolicy: Local. Returns whether the cluster and the local endpoints
/// are used.
fn external_rules(
    r: &mut Rules,
    sp: &ServicePort,
    names: &ChainNames,
    cluster: &[SocketAddr],
    local: &[SocketAddr],
) -> (bool, bool) {
    let has_endpoints = !cluster.is_empty() || !local.is_empty();
    let x = External {
        has_endpoints,
        has_external: if sp.external_local {
            !local.is_empty()
        } else {
            has_endpoints
        },
        uses_fw: has_endpoints && sp.kind == Kind::LoadBalancer && !sp.source_ranges.is_empty(),
    };
    external_entry_rules(r, sp, names, &x);
    if x.has_endpoints {
        external_chain_rules(r, sp, names, x.has_external);
    }
    if x.uses_fw {
        firewall_chain_rules(r, sp, names);
    }
    (!cluster.is_empty(), sp.external_local && !local.is_empty())
}

/// The rules that send an external destination's traffic to its chain (`KUBE-NODEPORTS`,
/// `KUBE-SERVICES`), and the filter rules for it when nothing may serve it.
fn external_entry_rules(r: &mut Rules, sp: &ServicePort, names: &ChainNames, x: &External) {
    let ChainNames {
        n,
        p,
        dport,
        ext,
        fw,
        ..
    } = names;
    let c = |s: &str| save_string(s);
    let filter_comment = if !x.has_endpoints {
        format!("{n} has no endpoints")
    } else {
        format!("{n} has no local endpoints")
    };
    let filter_target = if x.has_endpoints {
        "DROP"
    } else {
        reject(sp.address)
    };
    match sp.kind {
        Kind::NodePort => {
            r.nat.push(
                "-A KUBE-SERVICES -m comment --comment \"kubernetes service nodeports; \
                 NOTE: this must be the last rule in this chain\" -m addrtype --dst-type LOCAL \
                 -j KUBE-NODEPORTS"
                    .to_string(),
            );
            if x.has_endpoints {
                r.nat.push(format!(
                    "-A KUBE-NODEPORTS -p {p} -m comment --comment {} {dport} -j {ext}",
                    c(n)
                ));
            }
            if !x.has_external {
                r.filter.push(format!(
                    "-A KUBE-EXTERNAL-SERVICES -p {p} -m comment --comment {} -m addrtype \
                     --dst-type LOCAL {dport} -j {filter_target}",
                    c(&filter_comment)
                ));
            }
        }
        Kind::ExternalIP | Kind::LoadBalancer => {
            let (what, target) = if sp.kind == Kind::ExternalIP {
                ("external IP", ext)
            } else if x.uses_fw {
                ("loadbalancer IP", fw)
            } else {
                ("loadbalancer IP", ext)
            };
            let dst = format!("-d {} -p {p}", host_cidr(sp.address));
            if x.has_endpoints {
                r.nat.push(format!(
                    "-A KUBE-SERVICES {dst} -m comment --comment {} {dport} -j {target}",
                    c(&format!("{n} {what}"))
                ));
            }
            if x.uses_fw {
                r.filter.push(format!(
                    "-A KUBE-PROXY-FIREWALL {dst} -m comment --comment {} {dport} -j DROP",
                    c(&format!("{n} traffic not accepted by {fw}"))
                ));
            }
            if !x.has_external {
                r.filter.push(format!(
                    "-A KUBE-EXTERNAL-SERVICES {dst} -m comment --comment {} {dport} -j {filter_target}",
                    c(&filter_comment)
                ));
            }
        }
        Kind::ClusterIP => unreachable!("cluster_ip_rules"),
    }
}

/// The `KUBE-EXT-` chain: masquerade (all traffic, or LOCAL traffic with the `Local`
/// policy, which also routes it to the cluster endpoints), then the policy's chain.
fn external_chain_rules(r: &mut Rules, sp: &ServicePort, names: &ChainNames, has_external: bool) {
    let ChainNames {
        n, ext, svc, svl, ..
    } = names;
    let c = |s: &str| save_string(s);
    if sp.external_local {
        r.nat.push(format!(
            "-A {ext} -m comment --comment {} -m addrtype --src-type LOCAL -j KUBE-MARK-MASQ",
            c(&format!(
                "masquerade LOCAL traffic for {n} external destinations"
            ))
        ));
        r.nat.push(format!(
            "-A {ext} -m comment --comment {} -m addrtype --src-type LOCAL -j {svc}",
            c(&format!(
                "route LOCAL traffic for {n} external destinations"
            ))
        ));
    } else {
        r.nat.push(format!(
            "-A {ext} -m comment --comment {} -j KUBE-MARK-MASQ",
            c(&format!("masquerade traffic for {n} external destinations"))
        ));
    }
    if has_external {
        let policy = if sp.external_local { svl } else { svc };
        r.nat.push(format!("-A {ext} -j {policy}"));
    }
}

/// The `KUBE-FW-` chain: each source range to the external chain, the rest marked for
/// `KUBE-PROXY-FIREWALL`'s drop.
fn firewall_chain_rules(r: &mut Rules, sp: &ServicePort, names: &ChainNames) {
    let ChainNames { n, ext, fw, .. } = names;
    let c = |s: &str| save_string(s);
    for range in &sp.source_ranges {
        r.nat.push(format!(
            "-A {fw} -s {range} -m comment --comment {} -j {ext}",
            c(&format!("{n} loadbalancer IP"))
        ));
    }
    r.nat.push(format!(
        "-A {fw} -m comment --comment {}",
        c(&format!(
            "other traffic to {n} will be dropped by KUBE-PROXY-FIREWALL"
        ))
    ));
}

/// One `KUBE-SEP-` chain per endpoint used (sorted): masquerade hairpin traffic, then
/// DNAT (recording the client for session affinity).
fn endpoint_chain_rules(
    r: &mut Rules,
    sp: &ServicePort,
    names: &ChainNames,
    endpoints: &[SocketAddr],
) {
    let ChainNames { n, p, .. } = names;
    let c = |s: &str| save_string(s);
    for ep in sorted(endpoints) {
        let sep = endpoint_chain(n, p, &ep.to_string());
        r.nat.push(format!(
            "-A {sep} -s {} -m comment --comment {} -j KUBE-MARK-MASQ",
            host_cidr(ep.ip()),
            c(n)
        ));
        let recent = match sp.affinity {
            Some(_) => format!(
                " -m recent --set --name {sep} --mask {} --rsource",
                recent_mask(ep.ip())
            ),
            None => String::new(),
        };
        r.nat.push(format!(
            "-A {sep} -p {p} -m comment --comment {}{recent} -m {p} -j DNAT --to-destination {ep}",
            c(n)
        ));
    }
}

fn endpoint_rules(r: &mut Rules, sp: &ServicePort, chain: &str, endpoints: &[SocketAddr]) {
    let n = &sp.name;
    let p = sp.proto.as_str();
    if let Some(timeout) = sp.affinity {
        for ep in endpoints {
            let sep = endpoint_chain(n, p, &ep.to_string());
            r.nat.push(format!(
                "-A {chain} -m comment --comment {} -m recent --rcheck --seconds {timeout} --reap \
                 --name {sep} --mask {} --rsource -j {sep}",
                save_string(&format!("{n} -> {ep}")),
                recent_mask(ep.ip())
            ));
        }
    }
    let count = endpoints.len();
    for (i, ep) in endpoints.iter().enumerate() {
        let sep = endpoint_chain(n, p, &ep.to_string());
        let comment = save_string(&format!("{n} -> {ep}"));
        if i + 1 < count {
            r.nat.push(format!(
                "-A {chain} -m comment --comment {comment} -m statistic --mode random \
                 --probability {} -j {sep}",
                listed_probability(count - i)
            ));
        } else {
            r.nat.push(format!(
                "-A {chain} -m comment --comment {comment} -j {sep}"
            ));
        }
    }
}

#[cfg(test)]
mod tests;
