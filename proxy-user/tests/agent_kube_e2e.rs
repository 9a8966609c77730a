//! End to end over the Kubernetes API path: the real `proxy-agent` binary with
//! `--kubeconfig` pointing at the fake kube-apiserver (`proxy_testbed::apiserver`, which
//! speaks the real list/watch protocol over HTTP on loopback), pods as network
//! namespaces, a client namespace in the test cgroup. Needs root; fails without it.

mod support;

use std::{
    io,
    net::SocketAddr,
    time::{Duration, Instant},
};

use serde_json::{json, Value};
use support::{apiserver::FakeApiServer, tcp_ask, unique, AgentProcess, TestEnv, Topology};

const TARGET: u16 = 8080;

fn vip(last: u8) -> SocketAddr {
    SocketAddr::from(([10, 96, 0, last], 80))
}

fn service(name: &str, last: u8) -> Value {
    json!({
        "apiVersion": "v1", "kind": "Service",
        "metadata": {"namespace": "default", "name": name},
        "spec": {"type": "ClusterIP", "clusterIP": format!("10.96.0.{last}"),
                 "clusterIPs": [format!("10.96.0.{last}")],
                 "ports": [{"name": "http", "port": 80, "protocol": "TCP", "targetPort": "http"}]}
    })
}

fn slice(name: &str, service: &str, pods: &[usize]) -> Value {
    let eps: Vec<Value> = pods
        .iter()
        .map(|i| json!({"addresses": [Topology::pod_v4(*i).to_string()], "conditions": {"ready": true}, "nodeName": "node-a"}))
        .collect();
    json!({
        "apiVersion": "discovery.k8s.io/v1", "kind": "EndpointSlice",
        "metadata": {"namespace": "default", "name": name,
                     "labels": {"kubernetes.io/service-name": service}},
        "addressType": "IPv4",
        "ports": [{"name": "http", "port": TARGET, "protocol": "TCP"}],
        "endpoints": eps
    })
}

/// How long a change may take to show in traffic: a liveness bound, not a figure (the
/// bench measures the time, `cargo xtask bench --api`). Far above what the change takes
/// on a loaded 2-core machine, and below the agent's 30 s periodic re-diff, so only the
/// watch can have delivered it in time.
const FOLLOW: Duration = Duration::from_secs(20);

/// Polls `addr` from the client namespace until `want` holds 10 times in a row.
fn until(
    env: &TestEnv,
    addr: SocketAddr,
    limit: Duration,
    want: impl Fn(&io::Result<(String, SocketAddr)>) -> bool,
) -> Duration {
    until_n(env, addr, limit, 10, want)
}

/// Polls until `want` holds `n` times in a row; returns the time to the first of them.
fn until_n(
    env: &TestEnv,
    addr: SocketAddr,
    limit: Duration,
    n: usize,
    want: impl Fn(&io::Result<(String, SocketAddr)>) -> bool,
) -> Duration {
    env.in_client(|| {
        let start = Instant::now();
        let mut streak = 0;
        let mut first = Duration::ZERO;
        while start.elapsed() < limit {
            let at = start.elapsed();
            if want(&tcp_ask(addr)) {
                if streak == 0 {
                    first = at;
                }
                streak += 1;
                if streak == n {
                    return first;
                }
            } else {
                streak = 0;
                std::thread::sleep(Duration::from_millis(5));
            }
        }
        panic!("{addr}: condition not reached within {limit:?}");
    })
}

fn from(pods: &'static [&'static str]) -> impl Fn(&io::Result<(String, SocketAddr)>) -> bool {
    move |r| matches!(r, Ok((p, _)) if pods.contains(&p.as_str()))
}

fn unreachable(r: &io::Result<(String, SocketAddr)>) -> bool {
    matches!(r, Err(e) if e.raw_os_error() == Some(libc::ENETUNREACH))
}

fn start_agent(env: &TestEnv, api: &FakeApiServer) -> (AgentProcess, std::path::PathBuf) {
    let kubeconfig = std::env::temp_dir().join(unique("ebpf-proxy-kubeconfig-"));
    api.write_kubeconfig(&kubeconfig);
    let agent = AgentProcess::start(env, &["--kubeconfig", kubeconfig.to_str().expect("utf-8")]);
    (agent, kubeconfig)
}

#[test]
fn agent_follows_the_api_server() {
    let mut env = TestEnv::without_datapath(3);
    env.serve_all(TARGET);
    let api = FakeApiServer::start();
    api.apply(service("web", 10));
    api.apply(slice("web-1", "web", &[1]));
    // Ignored by kube-proxy's selector: another proxy's Service, a headless one.
    let mut other = service("other-proxy", 11);
    other["metadata"]["labels"] =
        json!({"service.kubernetes.io/service-proxy-name": "someone-else"});
    api.apply(other);
    api.apply(node());
    let (mut agent, kubeconfig) = start_agent(&env, &api);
    agent.wait_healthy(Duration::from_secs(20));

    until(&env, vip(10), FOLLOW, from(&["pod1"]));
    until(&env, vip(11), FOLLOW, unreachable);
    let reqs = api.decoded_requests();
    assert!(
        reqs.iter().any(|r| r.contains("/api/v1/services?") && r.contains("labelSelector=!service.kubernetes.io/service-proxy-name,!service.kubernetes.io/headless")),
        "the Service watch uses kube-proxy's selector: {reqs:#?}"
    );
    assert!(reqs
        .iter()
        .any(|r| r.contains("/apis/discovery.k8s.io/v1/endpointslices?")));
    assert!(reqs
        .iter()
        .any(|r| r.contains("/api/v1/nodes?") && r.contains("fieldSelector=metadata.name=node-a")));

    // Scale up and down through the API.
    api.apply(slice("web-1", "web", &[1, 2, 3]));
    let up = until_n(&env, vip(10), FOLLOW, 1, from(&["pod3"]));
    api.apply(slice("web-1", "web", &[2]));
    let down = until(&env, vip(10), FOLLOW, from(&["pod2"]));
    // Timed for the log only (a figure belongs to the bench; FOLLOW is the bound).
    eprintln!("API change -> traffic: scale up {up:?}, scale down {down:?}");

    // A malformed object is skipped; the watch goes on.
    let mut bad = service("bad-port", 12);
    bad["spec"]["ports"][0]["port"] = json!(70000);
    api.apply(bad);
    let mut undecodable = service("bad-type", 13);
    undecodable["spec"]["ports"][0]["port"] = json!("eighty");
    api.apply(undecodable);
    api.apply(service("after", 14));
    api.apply(slice("after-1", "after", &[3]));
    until(&env, vip(14), FOLLOW, from(&["pod3"]));
    let metrics = agent.metrics();
    assert!(
        metrics.contains("kind=\"Service\",reason=\"bad_port\"} 1"),
        "{metrics}"
    );
    assert!(
        metrics.contains("kind=\"Service\",reason=\"decode_error\"} 1"),
        "{metrics}"
    );

    // The connection drops mid-watch: later changes still arrive.
    api.drop_watches();
    api.apply(slice("web-1", "web", &[1]));
    until(&env, vip(10), FOLLOW, from(&["pod1"]));

    // Deleting a Service removes its frontend.
    api.delete("Service", "default", "after");
    until(&env, vip(14), FOLLOW, unreachable);
    drop(agent);
    let _ = std::fs::remove_file(kubeconfig);
}

fn node() -> Value {
    json!({"apiVersion": "v1", "kind": "Node", "metadata": {"name": "node-a", "labels": {"topology.kubernetes.io/zone": "zone-a"}}})
}

#[test]
fn agent_converges_after_relists_and_server_restarts() {
    let mut env = TestEnv::without_datapath(2);
    env.serve_all(TARGET);
    let api = FakeApiServer::start();
    api.apply(node());
    for (name, last, pods) in [
        ("a", 20, &[1][..]),
        ("b", 21, &[2][..]),
        ("c", 22, &[1, 2][..]),
    ] {
        api.apply(service(name, last));
        api.apply(slice(&format!("{name}-1"), name, pods));
    }
    let (mut agent, kubeconfig) = start_agent(&env, &api);
    agent.wait_healthy(Duration::from_secs(20));
    until(&env, vip(20), FOLLOW, from(&["pod1"]));
    until(&env, vip(21), FOLLOW, from(&["pod2"]));

    // 410 Gone: the history expires while the watches are cut; "a" is deleted in the
    // gap, so only the relist can tell. It must disappear from the maps.
    let wait_watches = |n: usize| {
        let start = Instant::now();
        while api.open_watches() < n && start.elapsed() < Duration::from_secs(10) {
            std::thread::sleep(Duration::from_millis(10));
        }
    };
    wait_watches(3);
    api.drop_watches();
    api.delete("Service", "default", "a");
    api.expire_history();
    until(&env, vip(20), FOLLOW, unreachable);
    let metrics = agent.metrics();
    assert!(
        metrics.contains("ebpf_proxy_watch_restarts_total{resource=\"Service\"}"),
        "{metrics}"
    );

    // The API server restarts; meanwhile "b" is deleted and "c" rescaled.
    api.stop();
    std::thread::sleep(Duration::from_millis(300));
    api.delete("Service", "default", "b");
    api.apply(slice("c-1", "c", &[2]));
    api.restart();
    until(&env, vip(21), Duration::from_secs(20), unreachable);
    until(&env, vip(22), Duration::from_secs(20), from(&["pod2"]));
    let logs = agent.stop();
    assert!(logs.contains("relist: full re-diff"), "{logs}");
    let _ = std::fs::remove_file(kubeconfig);
}

/// At cluster scale the agent's watchers page their lists (`limit=500` + `continue`, as
/// client-go does) with bookmarks on, and when etcd compacts in the middle of a paged list
/// (the next page's token is stale: `410 Expired`) they list again from the start and
/// program every Service.
#[test]
fn agent_pages_large_lists_and_relists_after_a_stale_continue_token() {
    const SERVICES: usize = 1200;
    let mut env = TestEnv::without_datapath(1);
    env.serve_all(TARGET);
    let api = FakeApiServer::start();
    api.apply(node());
    api.apply_many((0..SERVICES).flat_map(|i| {
        let name = format!("s{i:04}");
        let vip = format!("10.96.{}.{}", 10 + i / 250, 1 + i % 250);
        let mut svc = service(&name, 1);
        svc["spec"]["clusterIP"] = json!(vip);
        svc["spec"]["clusterIPs"] = json!([vip]);
        [svc, slice(&format!("{name}-1"), &name, &[1])]
    }));
    // The first page of the first list (whichever kind asks first) is followed by a
    // compaction, so that list's next page gets 410 Expired.
    api.compact_after_pages(1);
    let (mut agent, kubeconfig) = start_agent(&env, &api);
    agent.wait_healthy(Duration::from_secs(60));
    let want = format!("ebpf_proxy_programmed_frontends {SERVICES}");
    let start = Instant::now();
    while !agent.metrics().lines().any(|l| l == want) {
        assert!(
            start.elapsed() < Duration::from_secs(30),
            "not all {SERVICES} frontends programmed: {}",
            agent.metrics()
        );
        std::thread::sleep(Duration::from_millis(50));
    }
    // The last Service (in the last page) answers.
    until(
        &env,
        SocketAddr::from(([10, 96, 14, 200], 80)),
        FOLLOW,
        from(&["pod1"]),
    );

    let reqs = api.decoded_requests();
    let lists = |path: &str| -> Vec<&String> {
        reqs.iter()
            .filter(|r| r.contains(path) && !r.contains("watch="))
            .collect()
    };
    for path in [
        "/api/v1/services?",
        "/apis/discovery.k8s.io/v1/endpointslices?",
    ] {
        let pages = lists(path);
        assert!(
            pages.len() >= 3 && pages.iter().all(|r| r.contains("limit=500")),
            "{path} listed in pages of 500: {pages:#?}"
        );
        assert!(
            pages.iter().filter(|r| r.contains("continue=")).count() >= 2,
            "{pages:#?}"
        );
    }
    assert!(
        reqs.iter()
            .filter(|r| r.contains("watch=true"))
            .all(|r| r.contains("allowWatchBookmarks=true")),
        "watches ask for bookmarks: {reqs:#?}"
    );
    // One kind's list failed on its stale token and was started over: 5 list requests
    // (1 + 1 failed, then 3) for one of the two kinds.
    let relisted = [
        lists("/api/v1/services?").len(),
        lists("/apis/discovery.k8s.io/v1/endpointslices?").len(),
    ];
    assert!(relisted.contains(&5), "a list started over: {relisted:?}");
    let metrics = agent.metrics();
    assert!(
        metrics
            .lines()
            .any(|l| l.starts_with("ebpf_proxy_watch_errors_total{")),
        "the 410 is counted: {metrics}"
    );
    let logs = agent.stop();
    assert!(
        logs.contains("too old to display a consistent list"),
        "the 410's message is logged: {logs}"
    );
    let _ = std::fs::remove_file(kubeconfig);
}

fn node_with(name: &str, addrs: &[(&str, &str)]) -> Value {
    let addrs: Vec<Value> = addrs
        .iter()
        .map(|(t, a)| json!({"type": t, "address": a}))
        .collect();
    json!({"apiVersion": "v1", "kind": "Node", "metadata": {"name": name},
           "status": {"addresses": addrs}})
}

/// Issue 22 item 10, the API side: in `--forwarding-mode dsr` the agent watches every
/// Node (no field selector) and keeps `DSR_TRUSTED4/6` equal to their InternalIP and
/// ExternalIP addresses plus `--dsr-trusted-cidrs`: a node added, changed or deleted
/// through the API is followed.
#[test]
fn dsr_mode_trusts_every_nodes_addresses_from_the_api() {
    let env = TestEnv::without_datapath(1);
    let api = FakeApiServer::start();
    api.apply(service("web", 10));
    api.apply(slice("web-1", "web", &[1]));
    api.apply(node_with("node-a", &[("InternalIP", "10.0.1.1")]));
    api.apply(node_with(
        "node-b",
        &[("InternalIP", "10.0.2.1"), ("ExternalIP", "fd00:2::1")],
    ));
    let kubeconfig = std::env::temp_dir().join(unique("ebpf-proxy-kubeconfig-"));
    api.write_kubeconfig(&kubeconfig);
    let mut agent = AgentProcess::start(
        &env,
        &[
            "--kubeconfig",
            kubeconfig.to_str().expect("utf-8"),
            "--forwarding-mode",
            "dsr",
            "--dsr-trusted-cidrs",
            "192.0.2.0/24",
        ],
    );
    agent.wait_healthy(Duration::from_secs(20));
    let want = |set: &[(&str, u8)]| -> std::collections::BTreeSet<(std::net::IpAddr, u8)> {
        set.iter()
            .map(|(a, l)| (a.parse().expect("ip"), *l))
            .collect()
    };
    let wait = |what: &str, expected: std::collections::BTreeSet<(std::net::IpAddr, u8)>| {
        let deadline = Instant::now() + Duration::from_secs(5);
        loop {
            let got = proxy_user::dsr_trust::read(&env.pins.dir()).expect("DSR_TRUSTED");
            if got == expected {
                return;
            }
            assert!(
                Instant::now() < deadline,
                "{what}: {got:?}, want {expected:?}"
            );
            std::thread::sleep(Duration::from_millis(50));
        }
    };
    wait(
        "both Nodes and the flag's prefix",
        want(&[
            ("10.0.1.1", 32),
            ("10.0.2.1", 32),
            ("fd00:2::1", 128),
            ("192.0.2.0", 24),
        ]),
    );
    let reqs = api.decoded_requests();
    assert!(
        reqs.iter()
            .any(|r| r.contains("/api/v1/nodes?") && !r.contains("fieldSelector")),
        "every Node is watched: {reqs:#?}"
    );
    // A node changes its address, another joins, one leaves.
    api.apply(node_with("node-b", &[("InternalIP", "10.0.2.9")]));
    api.apply(node_with("node-c", &[("ExternalIP", "203.0.113.3")]));
    wait(
        "node-b's new address and node-c",
        want(&[
            ("10.0.1.1", 32),
            ("10.0.2.9", 32),
            ("203.0.113.3", 32),
            ("192.0.2.0", 24),
        ]),
    );
    api.delete("Node", "", "node-c");
    wait(
        "node-c gone",
        want(&[("10.0.1.1", 32), ("10.0.2.9", 32), ("192.0.2.0", 24)]),
    );
    drop(agent);
    let _ = std::fs::remove_file(kubeconfig);
}

fn service_cidr(name: &str, cidrs: &[&str]) -> Value {
    json!({
        "apiVersion": "networking.k8s.io/v1", "kind": "ServiceCIDR",
        "metadata": {"name": name},
        "spec": {"cidrs": cidrs}
    })
}

/// Service CIDRs from the API (issue #24 item 5): the `ServiceCIDR` objects (as
/// kube-apiserver 1.33 creates `kubernetes` from its `--service-cluster-ip-range`) are
/// listed and watched; inside them another port of a ClusterIP is refused with
/// ECONNREFUSED and an unallocated address with EPERM, at once; a ServiceCIDR added later
/// counts from its event on, one deleted stops counting; one that would swallow
/// everything (`0.0.0.0/0`) is refused, named and counted, and changes nothing. Outside
/// the CIDRs nothing is touched.
#[test]
fn service_cidrs_from_the_api_are_followed() {
    let mut env = TestEnv::without_datapath(1);
    env.serve_all(TARGET);
    let api = FakeApiServer::start();
    api.apply(service("web", 10));
    api.apply(slice("web-1", "web", &[1]));
    api.apply(node());
    api.apply(service_cidr(
        "kubernetes",
        &["10.96.0.0/16", "fd00:96::/112"],
    ));
    let (mut agent, kubeconfig) = start_agent(&env, &api);
    agent.wait_healthy(Duration::from_secs(20));
    let errno = |want: i32| move |r: &io::Result<(String, SocketAddr)>| matches!(r, Err(e) if e.raw_os_error() == Some(want));
    until(&env, vip(10), FOLLOW, from(&["pod1"]));
    until(
        &env,
        SocketAddr::from(([10, 96, 0, 10], 81)),
        FOLLOW,
        errno(libc::ECONNREFUSED),
    );
    until(&env, vip(99), FOLLOW, errno(libc::EPERM));
    until(
        &env,
        SocketAddr::from(([10, 100, 0, 5], 80)),
        FOLLOW,
        unreachable,
    );
    assert!(
        api.decoded_requests()
            .iter()
            .any(|r| r.contains("/apis/networking.k8s.io/v1/servicecidrs?")),
        "ServiceCIDRs are listed"
    );

    // A second ServiceCIDR, added while the agent runs (a watch event).
    api.apply(service_cidr("extra", &["10.100.0.0/24"]));
    until(
        &env,
        SocketAddr::from(([10, 100, 0, 5], 80)),
        FOLLOW,
        errno(libc::EPERM),
    );
    // One that would cover everything: refused, counted, nothing else changes.
    api.apply(service_cidr("everything", &["0.0.0.0/0"]));
    api.apply(service("after", 14));
    api.apply(slice("after-1", "after", &[1]));
    until(&env, vip(14), FOLLOW, from(&["pod1"]));
    until(
        &env,
        SocketAddr::from(([10, 101, 0, 5], 80)),
        FOLLOW,
        unreachable,
    );
    let metrics = agent.metrics();
    assert!(
        metrics.contains("kind=\"ServiceCIDR\",reason=\"decode_error\"} 1"),
        "{metrics}"
    );
    assert!(
        agent.logs().contains("skipping ServiceCIDR everything")
            && agent.logs().contains("0.0.0.0/0"),
        "the refused ServiceCIDR is named: {}",
        agent.logs()
    );
    // Deleted: its unallocated addresses are left alone again; the other one holds.
    api.delete("ServiceCIDR", "", "kubernetes");
    until(&env, vip(99), FOLLOW, unreachable);
    until(
        &env,
        SocketAddr::from(([10, 100, 0, 5], 80)),
        FOLLOW,
        errno(libc::EPERM),
    );
    let held = proxy_user::svc_cidr::read(&env.pins.dir()).expect("SVC_CIDR4/6");
    assert!(
        held.contains(&("10.100.0.0".parse().expect("ip"), 24))
            && !held
                .iter()
                .any(|(a, len)| *len == 16 && a.to_string() == "10.96.0.0"),
        "{held:?}"
    );
    drop(agent);
    let _ = std::fs::remove_file(kubeconfig);
}
