//! kube-proxy's iptables chains: the fixed ones per table, the prefixes of its
//! per-service and per-endpoint chains, and how those names are computed
//! (`pkg/proxy/iptables/proxier.go`):
//!
//! - `portProtoHash(servicePortName, protocol)` = the first 16 characters of
//!   `base32(sha256(servicePortName + protocol))`, where `servicePortName` is
//!   `namespace/name` plus `:portName` when the port has a name, and `protocol` the
//!   lower-case protocol (`tcp`): `KUBE-SVC-`, `KUBE-SVL-`, `KUBE-EXT-`, `KUBE-FW-` + hash;
//! - `servicePortEndpointChainName` = `KUBE-SEP-` + the first 16 characters of
//!   `base32(sha256(servicePortName + protocol + endpoint))`, `endpoint` being
//!   `ip:port` (`[ip]:port` for IPv6).

use crate::hash::chain_hash_string;

/// kube-proxy's chains in the `nat` table (iptables and IPVS modes).
pub const NAT_CHAINS: &[&str] = &[
    "KUBE-SERVICES",
    "KUBE-NODEPORTS",
    "KUBE-POSTROUTING",
    "KUBE-MARK-MASQ",
    "KUBE-MARK-DROP",
    "KUBE-PROXY-CANARY",
    // IPVS mode.
    "KUBE-NODE-PORT",
    "KUBE-LOAD-BALANCER",
];

/// Prefixes of kube-proxy's per-service and per-endpoint chains (`nat`): cluster and local
/// policy, endpoint, firewall, external, and the pre-1.25 `KUBE-XLB-`.
pub const SERVICE_CHAIN_PREFIXES: &[&str] = &[
    "KUBE-SVC-",
    "KUBE-SVL-",
    "KUBE-SEP-",
    "KUBE-FW-",
    "KUBE-EXT-",
    "KUBE-XLB-",
];

/// kube-proxy's chains in the `filter` table (iptables and IPVS modes).
pub const FILTER_CHAINS: &[&str] = &[
    "KUBE-SERVICES",
    "KUBE-EXTERNAL-SERVICES",
    "KUBE-FORWARD",
    "KUBE-NODEPORTS",
    "KUBE-PROXY-FIREWALL",
    "KUBE-PROXY-CANARY",
    // IPVS mode.
    "KUBE-NODE-PORT",
    "KUBE-SOURCE-RANGES-FIREWALL",
    "KUBE-IPVS-FILTER",
    "KUBE-IPVS-OUT-FILTER",
];

/// kube-proxy's chains in the `mangle` table.
pub const MANGLE_CHAINS: &[&str] = &["KUBE-PROXY-CANARY"];

/// The tables kube-proxy writes to.
pub const TABLES: &[&str] = &["nat", "filter", "mangle"];

/// The masquerade mark kube-proxy uses by default (`--iptables-masquerade-bit 14`).
pub const MASQ_MARK: &str = "0x4000";

/// Whether `chain` in `table` is one of kube-proxy's.
pub fn is_kube_proxy_chain(table: &str, chain: &str) -> bool {
    match table {
        "nat" => {
            NAT_CHAINS.contains(&chain)
                || SERVICE_CHAIN_PREFIXES.iter().any(|p| chain.starts_with(p))
        }
        "filter" => FILTER_CHAINS.contains(&chain),
        "mangle" => MANGLE_CHAINS.contains(&chain),
        _ => false,
    }
}

/// The 16-character hash kube-proxy derives chain names from.
pub fn port_proto_hash(service_port_name: &str, protocol: &str) -> String {
    chain_hash_string(&format!("{service_port_name}{protocol}"), 16)
}

/// `KUBE-SVC-*`: the Cluster-policy chain.
pub fn service_chain(service_port_name: &str, protocol: &str) -> String {
    format!("KUBE-SVC-{}", port_proto_hash(service_port_name, protocol))
}

/// `KUBE-SVL-*`: the Local-policy chain.
pub fn local_chain(service_port_name: &str, protocol: &str) -> String {
    format!("KUBE-SVL-{}", port_proto_hash(service_port_name, protocol))
}

/// `KUBE-EXT-*`: external destinations (NodePort, externalIPs, LoadBalancer IPs).
pub fn external_chain(service_port_name: &str, protocol: &str) -> String {
    format!("KUBE-EXT-{}", port_proto_hash(service_port_name, protocol))
}

/// `KUBE-FW-*`: `loadBalancerSourceRanges`.
pub fn firewall_chain(service_port_name: &str, protocol: &str) -> String {
    format!("KUBE-FW-{}", port_proto_hash(service_port_name, protocol))
}

/// `KUBE-SEP-*`: one endpoint of one Service port (`endpoint` as `ip:port`).
pub fn endpoint_chain(service_port_name: &str, protocol: &str, endpoint: &str) -> String {
    format!(
        "KUBE-SEP-{}",
        chain_hash_string(&format!("{service_port_name}{protocol}{endpoint}"), 16)
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn chain_names_are_kube_proxys() {
        // The seed article's nginx-service (shared/seeds): KUBE-SVC-V2OKYYMBY3REGZOG.
        assert_eq!(
            service_chain("default/nginx-service", "tcp"),
            "KUBE-SVC-V2OKYYMBY3REGZOG"
        );
        assert!(
            endpoint_chain("default/nginx-service", "tcp", "10.244.1.2:80")
                .starts_with("KUBE-SEP-")
        );
        assert_eq!(endpoint_chain("a/b", "tcp", "1.2.3.4:80").len(), 25);
    }

    #[test]
    fn kube_proxy_chains_by_table() {
        assert!(is_kube_proxy_chain("nat", "KUBE-SVC-V2OKYYMBY3REGZOG"));
        assert!(is_kube_proxy_chain("nat", "KUBE-SERVICES"));
        assert!(is_kube_proxy_chain("filter", "KUBE-FORWARD"));
        // kubelet's chains are not kube-proxy's.
        assert!(!is_kube_proxy_chain("filter", "KUBE-FIREWALL"));
        assert!(!is_kube_proxy_chain("nat", "KUBE-KUBELET-CANARY"));
        assert!(!is_kube_proxy_chain("raw", "KUBE-SERVICES"));
    }
}
