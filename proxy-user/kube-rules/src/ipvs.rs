//! kube-proxy's IPVS mode: its ipsets and the dummy link it binds service addresses to
//! (`pkg/proxy/ipvs`).

/// kube-proxy's IPVS-mode ipsets (IPv4 names; IPv6 ones are [`ipv6_set_name`]).
pub const IPSET_NAMES: &[&str] = &[
    "KUBE-LOOP-BACK",
    "KUBE-CLUSTER-IP",
    "KUBE-EXTERNAL-IP",
    "KUBE-EXTERNAL-IP-LOCAL",
    "KUBE-LOAD-BALANCER",
    "KUBE-LOAD-BALANCER-FW",
    "KUBE-LOAD-BALANCER-LOCAL",
    "KUBE-LOAD-BALANCER-SOURCE-IP",
    "KUBE-LOAD-BALANCER-SOURCE-CIDR",
    "KUBE-NODE-PORT-TCP",
    "KUBE-NODE-PORT-LOCAL-TCP",
    "KUBE-NODE-PORT-UDP",
    "KUBE-NODE-PORT-LOCAL-UDP",
    "KUBE-NODE-PORT-SCTP-HASH",
    "KUBE-NODE-PORT-LOCAL-SCTP-HASH",
    "KUBE-HEALTH-CHECK-NODE-PORT",
    "KUBE-IPVS-IPS",
];

/// kube-proxy's `hash:ip,port` sets whose `address,proto:port` entries are services it
/// programmed in IPVS.
pub const SERVICE_ADDRESS_SETS: &[&str] = &[
    "KUBE-CLUSTER-IP",
    "KUBE-EXTERNAL-IP",
    "KUBE-EXTERNAL-IP-LOCAL",
    "KUBE-LOAD-BALANCER",
    "KUBE-LOAD-BALANCER-LOCAL",
    "KUBE-LOAD-BALANCER-FW",
    "KUBE-NODE-PORT-SCTP-HASH",
    "KUBE-NODE-PORT-LOCAL-SCTP-HASH",
];

/// kube-proxy's `bitmap:port` sets of NodePorts, with their protocol.
pub const NODE_PORT_SETS: &[(&str, &str)] = &[
    ("KUBE-NODE-PORT-TCP", "tcp"),
    ("KUBE-NODE-PORT-LOCAL-TCP", "tcp"),
    ("KUBE-NODE-PORT-UDP", "udp"),
    ("KUBE-NODE-PORT-LOCAL-UDP", "udp"),
];

/// The dummy link kube-proxy's IPVS mode binds service addresses to.
pub const IPVS_LINK: &str = "kube-ipvs0";

/// kube-proxy's IPv6 name for an ipset: `KUBE-` becomes `KUBE-6-`, cut to ipset's 31
/// characters (upstream `NewIPSet`).
pub fn ipv6_set_name(name: &str) -> String {
    let mut v6 = match name.strip_prefix("KUBE-") {
        Some(rest) => format!("KUBE-6-{rest}"),
        None => name.to_string(),
    };
    v6.truncate(31);
    v6
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ipv6_set_names_follow_upstream() {
        assert_eq!(ipv6_set_name("KUBE-CLUSTER-IP"), "KUBE-6-CLUSTER-IP");
        // Cut to ipset's 31 characters.
        assert_eq!(
            ipv6_set_name("KUBE-LOAD-BALANCER-SOURCE-CIDR"),
            "KUBE-6-LOAD-BALANCER-SOURCE-CID"
        );
        assert_eq!(ipv6_set_name("OTHER"), "OTHER");
    }
}
