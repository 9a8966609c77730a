//! The node's own `Node` reduced to [`NodeInfo`].

use k8s_openapi::api::core::v1::Node;
use std::net::IpAddr;

use super::{LABEL_ZONE, TAINT_TO_BE_DELETED};

/// What the proxy knows about the node it runs on.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct NodeInfo {
    pub name: String,
    /// `topology.kubernetes.io/zone`, from the Node object.
    pub zone: Option<String>,
    /// The Node object's `InternalIP` and `ExternalIP` addresses (sorted, unique; unusable
    /// ones such as loopback or link-local left out): NodePorts are served on them too.
    pub addresses: Vec<IpAddr>,
    /// The Node is being deleted (`deletionTimestamp` set) or the cluster autoscaler is
    /// removing it (taint `ToBeDeletedByClusterAutoscaler`): `/healthz` turns 503 so load
    /// balancers drain the node first, as kube-proxy does.
    pub deleting: bool,
}

impl NodeInfo {
    pub fn with_node(name: &str, node: Option<&Node>) -> Self {
        let mut addresses: Vec<IpAddr> = node
            .and_then(|n| n.status.as_ref())
            .and_then(|s| s.addresses.as_ref())
            .into_iter()
            .flatten()
            .filter(|a| a.type_ == "InternalIP" || a.type_ == "ExternalIP")
            .filter_map(|a| a.address.trim().parse::<IpAddr>().ok())
            .filter(crate::node::is_node_address)
            .collect();
        addresses.sort();
        addresses.dedup();
        let deleting = node.is_some_and(|n| {
            n.metadata.deletion_timestamp.is_some()
                || n.spec
                    .as_ref()
                    .and_then(|s| s.taints.as_ref())
                    .is_some_and(|t| t.iter().any(|t| t.key == TAINT_TO_BE_DELETED))
        });
        Self {
            deleting,
            name: name.to_string(),
            zone: node
                .and_then(|n| n.metadata.labels.as_ref())
                .and_then(|l| l.get(LABEL_ZONE))
                .cloned(),
            addresses,
        }
    }
}
