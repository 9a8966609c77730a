//! Endpoint changes seen in traffic, over the API: the time from the apiserver accepting
//! an EndpointSlice change to the first connection that reaches the endpoint it put in.
//!
//! The datapath bench's namespaces (`topo::Stack`: client -> node -> pods, the pods'
//! server answering each connection with its own address) and its client process
//! (`bench client`, `WaitFor`: a TCP exchange every 100 µs until the expected endpoint
//! answers), run in the agent's own child cgroup, where its socket hooks are attached.
//! A probe Service (its own ClusterIP, port 80 to the server's port 80) is added beside
//! the N Services; each change replaces its one endpoint with another pod address.

use std::{
    net::{Ipv4Addr, SocketAddrV4},
    path::Path,
    time::Duration,
};

use anyhow::{bail, Context as _, Result};
use proxy_testbed::apiserver::FakeApiServer;
use serde_json::{json, Value};

use super::objects::NODE;
use crate::bench::{
    client::{self, Client, Spec, Task},
    modes::Ctx,
    plan::{self, target_endpoint, ENDPOINTS, HTTP_PORT, TARGET_VIP},
    topo,
};

/// The probe Service's name (the N Services are `s000000`...).
const PROBE: &str = "probe";

fn probe_service() -> Value {
    json!({
        "apiVersion": "v1", "kind": "Service",
        "metadata": {"namespace": plan::NAMESPACE, "name": PROBE},
        "spec": {"type": "ClusterIP", "clusterIP": TARGET_VIP.to_string(),
                 "clusterIPs": [TARGET_VIP.to_string()],
                 "ports": [{"name": "http", "protocol": "TCP", "port": HTTP_PORT,
                            "targetPort": HTTP_PORT}]}
    })
}

fn probe_slice(endpoint: Ipv4Addr) -> Value {
    json!({
        "apiVersion": "discovery.k8s.io/v1", "kind": "EndpointSlice",
        "metadata": {"namespace": plan::NAMESPACE, "name": format!("{PROBE}-abcde"),
                     "labels": {"kubernetes.io/service-name": PROBE}},
        "addressType": "IPv4",
        "ports": [{"name": "http", "protocol": "TCP", "port": HTTP_PORT}],
        "endpoints": [{"addresses": [endpoint.to_string()], "conditions": {"ready": true},
                       "nodeName": NODE}]
    })
}

/// `changes` endpoint changes of the probe Service; the seconds from each one's
/// acceptance by the apiserver to the first connection its new endpoint answered.
pub(super) fn traffic_changes(
    ctx: &Ctx,
    api: &FakeApiServer,
    agent_cgroup: &Path,
    changes: usize,
    spacing: Duration,
    max_secs: f64,
) -> Result<Vec<f64>> {
    let stack = topo::Stack::new()?;
    let target = SocketAddrV4::new(TARGET_VIP, HTTP_PORT);
    let spec = |task: Task| Spec {
        netns: stack.client.path(),
        cgroup: Some(agent_cgroup.to_path_buf()),
        tasks: vec![task],
    };
    let wait_for = |endpoint: Ipv4Addr| {
        spec(Task::WaitFor {
            targets: vec![target],
            expect: endpoint.to_string(),
            max_secs,
        })
    };
    // Not a frontend yet: the client's connection to the ClusterIP is not rewritten,
    // and its namespace has no route to it.
    let out = Client::run(&ctx.exe, &spec(Task::ExpectUnreachable { target }))?;
    if out.first().is_none_or(|o| o.ok != 1) {
        bail!(
            "the probe's ClusterIP must be unreachable before it is a frontend: {:?}",
            out.first().and_then(|o| o.first_error.clone())
        );
    }
    // The probe Service on the spare pod address first.
    let first = target_endpoint(ENDPOINTS + 1);
    let watcher = Client::start(&ctx.exe, &wait_for(first))?;
    api.apply(probe_service());
    api.apply(probe_slice(first));
    let out = watcher.finish()?;
    out.first()
        .context("no result from the client")?
        .seen(&format!("the probe Service's first endpoint {first}"))?;
    let mut secs = Vec::with_capacity(changes);
    for k in 0..changes {
        topo::check_interrupt()?;
        // Each change on its own, past the agent's `--min-sync-interval` since the last
        // one (as the single changes of `scale.rs`).
        std::thread::sleep(spacing);
        // 1, 2, ..., 10, 1, ...: never the endpoint it replaces.
        let new = target_endpoint(1 + k % ENDPOINTS);
        let watcher = Client::start(&ctx.exe, &wait_for(new))?;
        api.apply(probe_slice(new));
        let accepted = client::monotonic_ns();
        let out = watcher.finish()?;
        let o = out.first().context("no result from the client")?;
        let seen = o.seen(&format!("change {k}: {new}"))?;
        secs.push(seen.saturating_sub(accepted) as f64 / 1e9);
    }
    Ok(secs)
}
