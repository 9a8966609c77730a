//! The bench's objects: the address plan (ClusterIPs, endpoints, fresh endpoints for
//! the changes), the Service and EndpointSlice of Service `i`, and an apiserver loaded
//! with N of them.

use std::net::Ipv4Addr;

use proxy_testbed::apiserver::FakeApiServer;
use serde_json::{json, Value};

use crate::bench::plan;

/// Endpoints per Service.
pub(super) const ENDPOINTS: usize = 10;
/// Where the objects' node name points (this agent's `--node-name`).
pub(super) const NODE: &str = "bench-node";

/// Service `i`'s ClusterIP (10.96.0.16 + i, inside 10.96.0.0/12).
fn vip(i: usize) -> Ipv4Addr {
    Ipv4Addr::from(u32::from(Ipv4Addr::new(10, 96, 0, 16)) + i as u32)
}

/// Service `i`'s endpoint `e` (10.128.0.0/9; never answered: no traffic in this bench).
fn endpoint(i: usize, e: usize) -> Ipv4Addr {
    Ipv4Addr::from(u32::from(Ipv4Addr::new(10, 128, 0, 0)) + (i * ENDPOINTS + e) as u32)
}

/// A fresh endpoint address for change `j` (10.200.0.0/14, used by nothing else).
pub(super) fn fresh(j: usize) -> Ipv4Addr {
    Ipv4Addr::from(u32::from(Ipv4Addr::new(10, 200, 0, 0)) + j as u32)
}

fn name(i: usize) -> String {
    format!("s{i:06}")
}

fn service_obj(i: usize) -> Value {
    json!({
        "apiVersion": "v1", "kind": "Service",
        "metadata": {"namespace": plan::NAMESPACE, "name": name(i)},
        "spec": {"type": "ClusterIP", "clusterIP": vip(i).to_string(), "clusterIPs": [vip(i).to_string()],
                 "ports": [{"name": "http", "protocol": "TCP", "port": 80, "targetPort": 8080}]}
    })
}

pub(super) fn slice_obj(i: usize, endpoints: &[Ipv4Addr]) -> Value {
    let eps: Vec<Value> = endpoints
        .iter()
        .map(|a| json!({"addresses": [a.to_string()], "conditions": {"ready": true}, "nodeName": NODE}))
        .collect();
    json!({
        "apiVersion": "discovery.k8s.io/v1", "kind": "EndpointSlice",
        "metadata": {"namespace": plan::NAMESPACE, "name": format!("{}-abcde", name(i)),
                     "labels": {"kubernetes.io/service-name": name(i)}},
        "addressType": "IPv4",
        "ports": [{"name": "http", "protocol": "TCP", "port": 8080}],
        "endpoints": eps
    })
}

pub(super) fn base_endpoints(i: usize) -> Vec<Ipv4Addr> {
    (0..ENDPOINTS).map(|e| endpoint(i, e)).collect()
}

/// An apiserver holding `n` Services with their slices and this node; its history
/// compacted (the agent lists at the newest version anyway).
pub(super) fn loaded_apiserver(n: usize) -> FakeApiServer {
    let api = FakeApiServer::start();
    api.apply(json!({"apiVersion": "v1", "kind": "Node", "metadata": {"name": NODE}}));
    const BATCH: usize = 5000;
    for start in (0..n).step_by(BATCH) {
        api.apply_many(
            (start..(start + BATCH).min(n))
                .flat_map(|i| [service_obj(i), slice_obj(i, &base_endpoints(i))]),
        );
    }
    api.expire_history();
    api
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn addresses_stay_in_their_ranges_at_the_largest_scale() {
        let n = 400_000;
        assert_eq!(vip(0), Ipv4Addr::new(10, 96, 0, 16));
        // 10.96.0.0/12 ends at 10.111.255.255.
        assert!(vip(n - 1) < Ipv4Addr::new(10, 112, 0, 0));
        assert_eq!(endpoint(0, 0), Ipv4Addr::new(10, 128, 0, 0));
        assert!(endpoint(n - 1, ENDPOINTS - 1) < Ipv4Addr::new(10, 200, 0, 0));
        assert!(fresh(100_000) < Ipv4Addr::new(10, 204, 0, 0));
    }

    #[test]
    fn objects_are_what_the_agent_reads() {
        let s = service_obj(3);
        assert_eq!(s["spec"]["clusterIP"], "10.96.0.19");
        let e = slice_obj(3, &base_endpoints(3));
        assert_eq!(
            e["metadata"]["labels"]["kubernetes.io/service-name"],
            "s000003"
        );
        assert_eq!(e["endpoints"].as_array().map(Vec::len), Some(ENDPOINTS));
    }
}
