//! The benchmark's services and IP plan, and kube-proxy's names for them. Pure: every
//! mode (our agent's manifests, kube-proxy's iptables/nftables/IPVS rules) is generated
//! from the same [`Service`] list, so all modes hold exactly the same services.
//!
//! IP plan (inside the bench's own network namespaces only, see `topo.rs`):
//! - service CIDR 10.96.0.0/12: the target service's ClusterIP is 10.96.0.10, filler
//!   service `i` has 10.97.0.0 + i;
//! - cluster (pod) CIDR 10.224.0.0/12: the client pod is 10.224.0.2 (its node side
//!   10.224.0.1), the target's endpoints are 10.224.1.1 ..= 10.224.1.11 (node side
//!   10.224.1.254), filler endpoints are 10.228.0.0 + 10 * i + e (never answered: only
//!   the target service gets traffic).
//!
//! With `n` services, `n - 1` fillers come first and the target comes last, in every
//! chain and map order: the worst case for a linear walk such as `KUBE-SERVICES`.

use std::net::Ipv4Addr;

/// The namespace every benchmark Service lives in.
pub const NAMESPACE: &str = "bench";
/// Name of the one service that gets traffic.
pub const TARGET: &str = "target";
/// ClusterIP of the target service.
pub const TARGET_VIP: Ipv4Addr = Ipv4Addr::new(10, 96, 0, 10);
/// kube-proxy's `--cluster-cidr` (its local-traffic detector): traffic from outside is
/// masqueraded, pod traffic is not.
pub const CLUSTER_CIDR: &str = "10.224.0.0/12";
/// The service CIDR (nftables mode drops traffic to unallocated addresses in it).
pub const SERVICE_CIDR: &str = "10.96.0.0/12";
/// The client pod's address (namespace `client`, interface `eth0`).
pub const CLIENT_IP: Ipv4Addr = Ipv4Addr::new(10, 224, 0, 2);
/// The node's address on the client link (the client's default gateway).
pub const NODE_CLIENT_SIDE: Ipv4Addr = Ipv4Addr::new(10, 224, 0, 1);
/// The node's address on the pods link.
pub const NODE_PODS_SIDE: Ipv4Addr = Ipv4Addr::new(10, 224, 1, 254);
/// Endpoints per service.
pub const ENDPOINTS: usize = 10;
/// How many target endpoint addresses the pods namespace holds: 10 in use, plus the one
/// an endpoint change swaps in.
pub const TARGET_ADDRESSES: usize = ENDPOINTS + 1;

/// TCP port answered with the endpoint's address (connect + one request/response).
pub const HTTP_PORT: u16 = 80;
/// UDP port answered with the endpoint's address.
pub const DNS_PORT: u16 = 53;
/// TCP port that swallows a bulk stream.
pub const BULK_PORT: u16 = 5201;
/// The remote-backend target's UDP nodePort (packet-rate part), on the node's address
/// [`NODE_CLIENT_SIDE`].
pub const NODE_PORT: u16 = 30053;

/// The most services the address plan holds (filler VIPs and endpoints stay in their
/// ranges).
pub const MAX_SERVICES: usize = 70_000;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Proto {
    Tcp,
    Udp,
}

impl Proto {
    /// Lower case, as kube-proxy writes it in chain names and rules.
    pub fn lower(self) -> &'static str {
        match self {
            Proto::Tcp => "tcp",
            Proto::Udp => "udp",
        }
    }

    /// As the Kubernetes API writes it.
    pub fn upper(self) -> &'static str {
        match self {
            Proto::Tcp => "TCP",
            Proto::Udp => "UDP",
        }
    }
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Port {
    pub name: &'static str,
    pub proto: Proto,
    pub port: u16,
    pub target_port: u16,
    /// The Service's `nodePort` for this port (a NodePort Service; the packet-rate
    /// part's remote-backend form only).
    pub node_port: Option<u16>,
}

/// One Service with its endpoints (all ready), as every mode programs it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Service {
    pub name: String,
    pub vip: Ipv4Addr,
    pub ports: Vec<Port>,
    pub endpoints: Vec<Ipv4Addr>,
    /// The endpoints are on another node (`nodeName` not the agent's): our datapath SNATs
    /// external traffic to them (eTP=Cluster), as kube-proxy's masquerade does.
    pub remote: bool,
}

impl Service {
    /// `namespace/name`.
    pub fn namespaced(&self) -> String {
        format!("{NAMESPACE}/{}", self.name)
    }

    /// kube-proxy's `ServicePortName.String()`: `ns/name:port` (`ns/name` for an unnamed
    /// port).
    pub fn port_name(&self, port: &Port) -> String {
        if port.name.is_empty() {
            self.namespaced()
        } else {
            format!("{}:{}", self.namespaced(), port.name)
        }
    }
}

fn http() -> Port {
    Port {
        name: "http",
        proto: Proto::Tcp,
        port: HTTP_PORT,
        target_port: HTTP_PORT,
        node_port: None,
    }
}

/// Target endpoint `i` (1-based, 1 ..= [`TARGET_ADDRESSES`]).
pub fn target_endpoint(i: usize) -> Ipv4Addr {
    assert!((1..=TARGET_ADDRESSES).contains(&i), "target endpoint {i}");
    Ipv4Addr::new(10, 224, 1, i as u8)
}

/// The target's endpoints in state `swapped`: 1..=9 and either 10 (not swapped) or 11.
/// An endpoint change toggles the state: one endpoint leaves, another arrives.
pub fn target_endpoints(swapped: bool) -> Vec<Ipv4Addr> {
    let last = if swapped { ENDPOINTS + 1 } else { ENDPOINTS };
    (1..ENDPOINTS)
        .chain(std::iter::once(last))
        .map(target_endpoint)
        .collect()
}

/// The target service: HTTP-like TCP, DNS-like UDP and a bulk TCP port.
pub fn target(swapped: bool) -> Service {
    Service {
        name: TARGET.into(),
        vip: TARGET_VIP,
        ports: vec![
            http(),
            Port {
                name: "dns",
                proto: Proto::Udp,
                port: DNS_PORT,
                target_port: DNS_PORT,
                node_port: None,
            },
            Port {
                name: "bulk",
                proto: Proto::Tcp,
                port: BULK_PORT,
                target_port: BULK_PORT,
                node_port: None,
            },
        ],
        endpoints: target_endpoints(swapped),
        remote: false,
    }
}

/// Filler service `i` (0-based): one TCP port, ten endpoints nobody talks to.
pub fn filler(i: usize) -> Service {
    assert!(i < MAX_SERVICES, "filler {i} is outside the address plan");
    let vip = Ipv4Addr::from(u32::from(Ipv4Addr::new(10, 97, 0, 0)) + i as u32);
    let base = u32::from(Ipv4Addr::new(10, 228, 0, 0)) + (i * ENDPOINTS) as u32;
    Service {
        name: format!("svc-{i}"),
        vip,
        ports: vec![http()],
        endpoints: (0..ENDPOINTS as u32)
            .map(|e| Ipv4Addr::from(base + e))
            .collect(),
        remote: false,
    }
}

/// The packet-rate part's remote-backend target: a NodePort Service (UDP 53, nodePort
/// [`NODE_PORT`], eTP=Cluster) whose endpoints are the target's addresses, declared on
/// another node, so external traffic to the NodePort is DNATed and SNATed and leaves the
/// node towards the backend's node.
pub fn remote_target() -> Service {
    Service {
        name: TARGET.into(),
        vip: TARGET_VIP,
        ports: vec![Port {
            name: "dns",
            proto: Proto::Udp,
            port: DNS_PORT,
            target_port: DNS_PORT,
            node_port: Some(NODE_PORT),
        }],
        endpoints: target_endpoints(false),
        remote: true,
    }
}

/// All `n` services: `n - 1` fillers, then the target.
pub fn services(n: usize, swapped: bool) -> Vec<Service> {
    assert!(n >= 1, "at least the target service");
    (0..n - 1)
        .map(filler)
        .chain(std::iter::once(target(swapped)))
        .collect()
}

/// Number of (service port, endpoint) pairs: kube-proxy's iptables mode switches to its
/// "large cluster mode" (no per-endpoint comments, lazy stale-chain cleanup) above 1,000.
pub fn endpoint_count(services: &[Service]) -> usize {
    services
        .iter()
        .map(|s| s.ports.len() * s.endpoints.len())
        .sum()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn services_put_the_target_last_and_stay_in_their_ranges() {
        let all = services(3, false);
        assert_eq!(all.len(), 3);
        assert_eq!(all[2].name, TARGET);
        assert_eq!(all[0].vip, Ipv4Addr::new(10, 97, 0, 0));
        assert_eq!(all[1].endpoints[0], Ipv4Addr::new(10, 228, 0, 10));
        let last = filler(MAX_SERVICES - 1);
        assert!(
            last.vip < Ipv4Addr::new(10, 112, 0, 0),
            "inside 10.96.0.0/12"
        );
        assert!(
            *last.endpoints.last().expect("endpoints") < Ipv4Addr::new(10, 240, 0, 0),
            "inside 10.224.0.0/12"
        );
        assert_eq!(
            target_endpoints(true).last(),
            Some(&Ipv4Addr::new(10, 224, 1, 11))
        );
        assert_eq!(endpoint_count(&services(1, false)), 30);
    }
}
