//! The node's addresses as the datapath sees them: `NODE_ADDRS4/6` and the SNAT
//! addresses (`NodeAddresses`, with kube-proxy's `nodePortAddresses` selection), and the
//! two prefix sets written after every sync beside them: `DSR_TRUSTED4/6` (every Node's
//! addresses) and `SVC_CIDR4/6` (the Service CIDRs and ClusterIPs).

use tracing::info;

use crate::{pins::PinDir, Writer};

/// kube-proxy's `nodePortAddresses`: which node addresses NodePorts answer on.
#[derive(Clone, Debug, PartialEq)]
pub struct NodePortSelection {
    cidrs: Vec<(std::net::IpAddr, u8)>,
    /// `primary`: the node's primary address of each family (here the first, the SNAT
    /// address: an interface's, else the Node object's first).
    primary: bool,
}

impl NodePortSelection {
    /// CIDRs or `primary`; anything else is an error naming it.
    pub fn parse(entries: &[String]) -> Result<Self, String> {
        let mut s = Self {
            cidrs: Vec::new(),
            primary: false,
        };
        for e in entries {
            let e = e.trim();
            if e == "primary" {
                s.primary = true;
                continue;
            }
            let cidr = e
                .contains('/')
                .then(|| crate::cluster::objects::parse_cidr(e))
                .flatten()
                .ok_or_else(|| {
                    format!("--nodeport-addresses {e:?} is neither a CIDR nor \"primary\"")
                })?;
            s.cidrs.push(cidr);
        }
        Ok(s)
    }

    /// The addresses of `all` (in order) it selects.
    pub fn select(&self, all: &[std::net::IpAddr]) -> Vec<std::net::IpAddr> {
        let primary = |a: &std::net::IpAddr| {
            self.primary
                && all
                    .iter()
                    .find(|b| b.is_ipv4() == a.is_ipv4() && !b.is_loopback())
                    == Some(a)
        };
        all.iter()
            .filter(|a| {
                primary(a)
                    || self
                        .cidrs
                        .iter()
                        .any(|c| crate::cluster::objects::cidr_contains(*c, **a))
            })
            .copied()
            .collect()
    }
}

/// The node's addresses in `NODE_ADDRS4/6` (NodePorts are served on them): those of the
/// TC interfaces, then the Node object's `InternalIP`/`ExternalIP` ones not among them,
/// then `127.0.0.1` when NodePorts are served on localhost (the socket hooks see it; TC
/// and XDP never do); only those `--nodeport-addresses` selects, when given. The first
/// IPv4 and IPv6 address of the whole list that is not a loopback address is the SNAT
/// address (selected or not), so an interface's address always wins.
#[derive(Debug)]
pub struct NodeAddresses {
    from_interfaces: Vec<std::net::IpAddr>,
    localhost: bool,
    selection: Option<NodePortSelection>,
    written: Option<Vec<std::net::IpAddr>>,
    /// The pin directory and `DSR_TRUSTED4/6`'s writer (every Node's addresses and
    /// `--dsr-trusted-cidrs`), written after the node addresses.
    dsr_trust: Option<(PinDir, crate::dsr_trust::DsrTrust)>,
    /// The pin directory and `SVC_CIDR4/6`'s writer (`--service-cluster-ip-range` and
    /// every Service's cluster IPs).
    svc_cidrs: Option<(PinDir, crate::svc_cidr::SvcCidrs)>,
}

impl NodeAddresses {
    pub fn new(from_interfaces: Vec<std::net::IpAddr>, localhost: bool) -> Self {
        Self {
            from_interfaces,
            localhost,
            selection: None,
            written: None,
            dsr_trust: None,
            svc_cidrs: None,
        }
    }

    /// Also keeps `SVC_CIDR4/6` under `pin_path` equal to `ranges` and every Service's
    /// cluster IPs ([`Self::update_service_cidrs`]).
    pub fn with_service_cidrs(
        mut self,
        pins: &PinDir,
        ranges: Vec<(std::net::IpAddr, u8)>,
    ) -> Self {
        self.svc_cidrs = Some((pins.clone(), crate::svc_cidr::SvcCidrs::new(ranges)));
        self
    }

    /// Writes the Service CIDRs and every Service's cluster IPs (`SVC_CIDR4/6`).
    pub fn update_service_cidrs(
        &mut self,
        index: &crate::cluster::index::Index,
    ) -> Result<(), crate::pins::PinError> {
        let Some((pins, cidrs)) = self.svc_cidrs.as_mut() else {
            return Ok(());
        };
        if let Some(n) = cidrs.update(pins, index.api_service_cidrs(), index.cluster_ips())? {
            info!(entries = n, "Service CIDRs and cluster IPs written");
        }
        Ok(())
    }

    /// Also keeps `DSR_TRUSTED4/6` under `pin_path` equal to every Node object's
    /// addresses and `cidrs` ([`Self::update_dsr_trust`]).
    pub fn with_dsr_trust(mut self, pins: &PinDir, cidrs: Vec<(std::net::IpAddr, u8)>) -> Self {
        self.dsr_trust = Some((pins.clone(), crate::dsr_trust::DsrTrust::new(cidrs)));
        self
    }

    /// Writes the senders whose DSR option is honoured: every Node object's
    /// `InternalIP`/`ExternalIP` address, this node's, and `--dsr-trusted-cidrs`.
    pub fn update_dsr_trust(
        &mut self,
        index: &crate::cluster::index::Index,
    ) -> Result<(), crate::pins::PinError> {
        let Some((pins, trust)) = self.dsr_trust.as_mut() else {
            return Ok(());
        };
        let addrs = index
            .cluster_nodes
            .values()
            .flatten()
            .chain(index.node.addresses.iter());
        if let Some(set) = trust.update(pins, addrs)? {
            info!(prefixes = set.len(), trusted = ?set, "DSR trusted senders written");
        }
        Ok(())
    }

    pub fn with_selection(mut self, selection: Option<NodePortSelection>) -> Self {
        self.selection = selection;
        self
    }

    /// Writes the union with `from_node` through the writer if it changed.
    pub fn update<S: crate::MapStore>(
        &mut self,
        writer: &mut Writer<S>,
        from_node: &[std::net::IpAddr],
    ) -> Result<(), crate::store::StoreError> {
        let mut all = self.from_interfaces.clone();
        let localhost = self
            .localhost
            .then_some(std::net::IpAddr::V4(std::net::Ipv4Addr::LOCALHOST));
        for a in from_node.iter().chain(localhost.as_ref()) {
            if !all.contains(a) {
                all.push(*a);
            }
        }
        let selected = match &self.selection {
            Some(s) => s.select(&all),
            None => all.clone(),
        };
        if self.written.as_ref() == Some(&all) {
            return Ok(());
        }
        writer.set_node_port_addresses(&selected, &all)?;
        info!(addresses = ?selected, node_addresses = ?all, "node addresses for NodePorts written");
        self.written = Some(all);
        Ok(())
    }
}

#[cfg(test)]
mod nodeport_tests {
    use super::NodePortSelection;
    use std::net::IpAddr;

    fn ips(a: &[&str]) -> Vec<IpAddr> {
        a.iter().map(|s| s.parse().expect("ip")).collect()
    }

    #[test]
    fn nodeport_addresses_select_by_cidr_or_primary() {
        let all = ips(&[
            "192.0.2.1",
            "198.51.100.1",
            "2001:db8::1",
            "2001:db8::2",
            "127.0.0.1",
        ]);
        let sel = |e: &[&str]| {
            let e: Vec<String> = e.iter().map(|s| s.to_string()).collect();
            NodePortSelection::parse(&e).expect("parses").select(&all)
        };
        assert_eq!(sel(&["198.51.100.0/24"]), ips(&["198.51.100.1"]));
        assert_eq!(sel(&["primary"]), ips(&["192.0.2.1", "2001:db8::1"]));
        assert_eq!(
            sel(&["127.0.0.0/8", "2001:db8::2/128"]),
            ips(&["2001:db8::2", "127.0.0.1"])
        );
        assert_eq!(
            sel(&["0.0.0.0/0"]),
            ips(&["192.0.2.1", "198.51.100.1", "127.0.0.1"])
        );
        let err = NodePortSelection::parse(&["192.0.2.1".into()]).expect_err("no prefix");
        assert!(err.contains("\"192.0.2.1\""), "{err}");
    }
}
