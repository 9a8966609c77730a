//! kube-proxy's chain names for a service port (`KUBE-SVC-`, `KUBE-EXT-`, `KUBE-SEP-`),
//! and the chains an `iptables-save` holds that the services no longer use.

use kube_rules::chains;

use crate::bench::plan::{Port, Service};

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
