//! Rule-by-rule tests of the desired state, with builders for Services and slices and
//! golden text of the resulting frontends (as kube-proxy's nftables proxier_test.go does).
//!
//! IP plan: ClusterIPs 172.30.0.0/16 and fd00:30::/64; endpoints 10.180.0.0/16 and
//! fd00:180::/64, target port 8080 ("http") unless said otherwise; this node is "node-a"
//! in zone "zone-a".
//!
//! Over 600 lines: tests only (one table of Service rules).

use k8s_openapi::api::{core::v1::Service, discovery::v1::EndpointSlice};
use serde_json::{json, Value};

use super::*;
use crate::cluster::objects::Skip;

struct Svc(Value);

fn service(ns: &str, name: &str) -> Svc {
    Svc(json!({
        "apiVersion": "v1", "kind": "Service",
        "metadata": {"namespace": ns, "name": name},
        "spec": {"type": "ClusterIP", "ports": []}
    }))
}

impl Svc {
    fn cluster_ips(mut self, ips: &[&str]) -> Self {
        self.0["spec"]["clusterIP"] = json!(ips[0]);
        self.0["spec"]["clusterIPs"] = json!(ips);
        self
    }
    fn port(mut self, name: &str, port: i64, proto: &str) -> Self {
        self.0["spec"]["ports"]
            .as_array_mut()
            .expect("ports")
            .push(json!({"name": name, "port": port, "protocol": proto, "targetPort": name}));
        self
    }
    fn set(mut self, path: &str, v: Value) -> Self {
        self.0["spec"][path] = v;
        self
    }
    fn status(mut self, v: Value) -> Self {
        self.0["status"] = v;
        self
    }
    fn label(mut self, k: &str, v: &str) -> Self {
        self.0["metadata"]["labels"][k] = json!(v);
        self
    }
    fn build(self) -> Service {
        serde_json::from_value(self.0).expect("valid Service")
    }
}

struct Slice(Value);

fn slice(ns: &str, name: &str, svc: &str, family: &str) -> Slice {
    Slice(json!({
        "apiVersion": "discovery.k8s.io/v1", "kind": "EndpointSlice",
        "metadata": {"namespace": ns, "name": name, "labels": {"kubernetes.io/service-name": svc}},
        "addressType": family, "endpoints": [], "ports": []
    }))
}

impl Slice {
    fn port(mut self, name: &str, port: i64, proto: &str) -> Self {
        self.0["ports"]
            .as_array_mut()
            .expect("ports")
            .push(json!({"name": name, "port": port, "protocol": proto}));
        self
    }
    /// An endpoint; `extra` is merged in (conditions, nodeName, hints).
    fn ep(mut self, addr: &str, extra: Value) -> Self {
        let mut e = json!({"addresses": [addr]});
        if let Value::Object(m) = extra {
            for (k, v) in m {
                e[k] = v;
            }
        }
        self.0["endpoints"]
            .as_array_mut()
            .expect("endpoints")
            .push(e);
        self
    }
    fn build(self) -> EndpointSlice {
        serde_json::from_value(self.0).expect("valid EndpointSlice")
    }
}

fn node() -> NodeInfo {
    NodeInfo {
        name: "node-a".into(),
        zone: Some("zone-a".into()),
        addresses: Vec::new(),
        deleting: false,
    }
}

/// Evaluates one Service with its slices and renders the entries, one per line.
fn golden(svc: Service, slices: Vec<EndpointSlice>) -> String {
    let info = ServiceInfo::from_k8s(&svc, None)
        .expect("valid")
        .expect("selected");
    let slices: Vec<SliceInfo> = slices
        .iter()
        .map(|s| {
            SliceInfo::from_k8s(s, None)
                .expect("valid")
                .expect("selected")
        })
        .collect();
    let refs: Vec<&SliceInfo> = slices.iter().collect();
    render(&service_entries(&info, &refs, &node()))
}

fn render(entries: &[ServiceEntry]) -> String {
    let mut out = String::new();
    for e in entries {
        let backends: Vec<String> = e.backends.iter().map(|b| b.to_string()).collect();
        out += &format!(
            "{} flags={:#x} affinity={} -> [{}]\n",
            e.frontend,
            e.flags,
            e.affinity_timeout,
            backends.join(", ")
        );
    }
    out
}

fn basic() -> Svc {
    service("default", "web")
        .cluster_ips(&["172.30.0.10"])
        .port("http", 80, "TCP")
}

const READY: fn() -> Value = || json!({});
fn not_ready() -> Value {
    json!({"conditions": {"ready": false, "serving": false, "terminating": false}})
}
fn terminating(serving: bool) -> Value {
    json!({"conditions": {"ready": false, "serving": serving, "terminating": true}})
}

#[test]
fn ready_endpoints_of_the_matching_port() {
    let out = golden(
        basic().build(),
        vec![slice("default", "web-1", "web", "IPv4")
            .port("http", 8080, "TCP")
            .ep("10.180.0.1", READY())
            .ep("10.180.0.2", json!({"conditions": {"ready": true}}))
            .ep("10.180.0.3", not_ready())
            .build()],
    );
    assert_eq!(
        out,
        "172.30.0.10:80/tcp flags=0x0 affinity=0 -> [10.180.0.1:8080, 10.180.0.2:8080]\n"
    );
}

#[test]
fn multi_port_named_target_ports_and_several_slices() {
    let svc = basic()
        .port("dns", 53, "UDP")
        .port("metrics", 9090, "TCP")
        .build();
    let out = golden(
        svc,
        vec![
            slice("default", "web-1", "web", "IPv4")
                .port("http", 8080, "TCP")
                .port("dns", 5353, "UDP")
                .ep("10.180.0.1", READY())
                .build(),
            // A second slice, with the named port resolved to another number.
            slice("default", "web-2", "web", "IPv4")
                .port("http", 8081, "TCP")
                .port("dns", 5353, "UDP")
                .ep("10.180.0.2", READY())
                .build(),
        ],
    );
    assert_eq!(
        out,
        "\
172.30.0.10:80/tcp flags=0x0 affinity=0 -> [10.180.0.1:8080, 10.180.0.2:8081]
172.30.0.10:53/udp flags=0x0 affinity=0 -> [10.180.0.1:5353, 10.180.0.2:5353]
172.30.0.10:9090/tcp flags=0x0 affinity=0 -> []
"
    );
}

#[test]
fn dual_stack_takes_each_family_from_its_slices() {
    let svc = service("default", "web")
        .cluster_ips(&["172.30.0.10", "fd00:30::10"])
        .port("http", 80, "TCP")
        .build();
    let out = golden(
        svc,
        vec![
            slice("default", "web-v4", "web", "IPv4")
                .port("http", 8080, "TCP")
                .ep("10.180.0.1", READY())
                .build(),
            slice("default", "web-v6", "web", "IPv6")
                .port("http", 8080, "TCP")
                .ep("fd00:180::1", READY())
                .build(),
        ],
    );
    assert_eq!(
        out,
        "\
172.30.0.10:80/tcp flags=0x0 affinity=0 -> [10.180.0.1:8080]
[fd00:30::10]:80/tcp flags=0x0 affinity=0 -> [[fd00:180::1]:8080]
"
    );
}

#[test]
fn terminating_fallback_only_when_nothing_is_ready() {
    let with_ready = slice("default", "web-1", "web", "IPv4")
        .port("http", 8080, "TCP")
        .ep("10.180.0.1", READY())
        .ep("10.180.0.2", terminating(true))
        .build();
    assert_eq!(
        golden(basic().build(), vec![with_ready]),
        "172.30.0.10:80/tcp flags=0x0 affinity=0 -> [10.180.0.1:8080]\n"
    );
    // No ready endpoint: serving+terminating ones carry the traffic (flagged); a
    // terminating endpoint that is not serving never does.
    let draining = slice("default", "web-1", "web", "IPv4")
        .port("http", 8080, "TCP")
        .ep("10.180.0.2", terminating(true))
        .ep("10.180.0.3", terminating(false))
        .ep("10.180.0.4", not_ready())
        .build();
    assert_eq!(
        golden(basic().build(), vec![draining]),
        "172.30.0.10:80/tcp flags=0x0 affinity=0 -> [10.180.0.2:8080 (terminating)]\n"
    );
}

/// publishNotReadyAddresses: the EndpointSlice controller writes `ready: true` for a
/// terminating (even not serving) pod, and kube-proxy selects on `IsReady()` alone
/// (topology.go CategorizeEndpoints), for Cluster and Local policies alike. Upstream e2e:
/// "should be able to connect to terminating and unready endpoints if
/// PublishNotReadyAddresses is true".
#[test]
fn ready_terminating_endpoints_are_used_as_written() {
    let pnra = || json!({"conditions": {"ready": true, "serving": false, "terminating": true}});
    let pnra_on = |node: &str| json!({"nodeName": node, "conditions": {"ready": true, "serving": false, "terminating": true}});
    // Alone: it carries the traffic (flagged terminating for proxyctl).
    let alone = slice("default", "web-1", "web", "IPv4")
        .port("http", 8080, "TCP")
        .ep("10.180.0.5", pnra())
        .build();
    assert_eq!(
        golden(basic().build(), vec![alone]),
        "172.30.0.10:80/tcp flags=0x0 affinity=0 -> [10.180.0.5:8080 (terminating)]\n"
    );
    // Next to a plain ready pod: both are ready, both get traffic.
    let both = slice("default", "web-1", "web", "IPv4")
        .port("http", 8080, "TCP")
        .ep("10.180.0.1", READY())
        .ep("10.180.0.5", pnra())
        .ep("10.180.0.6", terminating(true))
        .build();
    assert_eq!(
        golden(basic().build(), vec![both]),
        "172.30.0.10:80/tcp flags=0x0 affinity=0 -> [10.180.0.1:8080, 10.180.0.5:8080 (terminating)]\n"
    );
    // internalTrafficPolicy Local: a ready local one is used (not dropped), ahead of a
    // local serving+terminating one (which is only a fallback).
    let svc = basic().set("internalTrafficPolicy", json!("Local")).build();
    let local = slice("default", "web-1", "web", "IPv4")
        .port("http", 8080, "TCP")
        .ep("10.180.0.5", pnra_on("node-a"))
        .ep("10.180.0.7", json!({"nodeName": "node-a", "conditions": {"ready": false, "serving": true, "terminating": true}}))
        .ep("10.180.0.2", json!({"nodeName": "node-b"}))
        .build();
    assert_eq!(
        golden(svc, vec![local.clone()]),
        "172.30.0.10:80/tcp flags=0x2 affinity=0 -> [10.180.0.5:8080 (terminating)]\n"
    );
    // externalTrafficPolicy Local: the ext-local twin of the NodePort has it too.
    let svc = basic()
        .set("type", json!("NodePort"))
        .set("externalTrafficPolicy", json!("Local"))
        .build();
    let mut svc = svc;
    svc.spec
        .as_mut()
        .expect("spec")
        .ports
        .as_mut()
        .expect("ports")[0]
        .node_port = Some(30080);
    assert_eq!(
        golden(svc, vec![local]),
        "\
172.30.0.10:80/tcp flags=0x0 affinity=0 -> [10.180.0.2:8080, 10.180.0.5:8080 (terminating)]
0.0.0.0:30080/tcp flags=0x24 affinity=0 -> [10.180.0.2:8080, 10.180.0.5:8080 (terminating)]
0.0.0.0:30080/tcp/ext-local flags=0x6 affinity=0 -> [10.180.0.5:8080 (terminating)]
"
    );
    // The health check NodePort counts it as a ready local endpoint, like kube-proxy.
    let svc = basic()
        .set("type", json!("LoadBalancer"))
        .set("externalTrafficPolicy", json!("Local"))
        .set("healthCheckNodePort", json!(32000))
        .build();
    let mut index = Index::new(node());
    let key = ObjKey::new("default", "web");
    index.set_service(key.clone(), ServiceInfo::from_k8s(&svc, None).expect("ok"));
    index.set_slice(
        ObjKey::new("default", "web-1"),
        SliceInfo::from_k8s(
            &slice("default", "web-1", "web", "IPv4")
                .port("http", 8080, "TCP")
                .ep("10.180.0.5", pnra_on("node-a"))
                .build(),
            None,
        )
        .expect("ok"),
    );
    assert_eq!(
        index.health_check_ports(),
        BTreeMap::from([(32000, (key.clone(), 1))])
    );
    // The port follows the Service: changed to ClusterIP, relisted, deleted.
    let plain = ServiceInfo::from_k8s(&basic().build(), None).expect("ok");
    index.set_service(key.clone(), plain);
    assert_eq!(index.health_check_ports(), BTreeMap::new());
    let info = ServiceInfo::from_k8s(&svc, None)
        .expect("ok")
        .expect("some");
    index.replace_services(vec![(key.clone(), info)]);
    assert_eq!(
        index.health_check_ports(),
        BTreeMap::from([(32000, (key.clone(), 1))])
    );
    index.set_service(key, None);
    assert_eq!(index.health_check_ports(), BTreeMap::new());
}

/// The same address:port in two slices of one Service: the non-terminating copy wins
/// whatever the order (endpointslicecache.go addEndpoints: `if !exists || !terminating`).
#[test]
fn duplicate_endpoint_across_slices_the_non_terminating_copy_wins() {
    let draining = slice("default", "web-a", "web", "IPv4")
        .port("http", 8080, "TCP")
        .ep("10.180.0.1", READY())
        .ep("10.180.0.9", terminating(false))
        .build();
    let live = slice("default", "web-b", "web", "IPv4")
        .port("http", 8080, "TCP")
        .ep("10.180.0.9", READY())
        .build();
    let want = "172.30.0.10:80/tcp flags=0x0 affinity=0 -> [10.180.0.1:8080, 10.180.0.9:8080]\n";
    assert_eq!(
        golden(basic().build(), vec![draining.clone(), live.clone()]),
        want
    );
    assert_eq!(golden(basic().build(), vec![live, draining]), want);
    // Through the index, whose slices come in name order.
    let mut index = Index::new(node());
    let key = ObjKey::new("default", "web");
    index.set_service(
        key.clone(),
        ServiceInfo::from_k8s(&basic().build(), None).expect("ok"),
    );
    for (name, s) in [
        (
            "web-a",
            slice("default", "web-a", "web", "IPv4")
                .port("http", 8080, "TCP")
                .ep("10.180.0.9", terminating(true)),
        ),
        (
            "web-b",
            slice("default", "web-b", "web", "IPv4")
                .port("http", 8080, "TCP")
                .ep("10.180.0.9", READY()),
        ),
    ] {
        index.set_slice(
            ObjKey::new("default", name),
            SliceInfo::from_k8s(&s.build(), None).expect("ok"),
        );
    }
    assert_eq!(
        render(&index.entries(&key)),
        "172.30.0.10:80/tcp flags=0x0 affinity=0 -> [10.180.0.9:8080]\n"
    );
    // Two terminating copies: the first one stays (a later terminating copy never
    // replaces an existing one).
    let t1 = slice("default", "web-a", "web", "IPv4")
        .port("http", 8080, "TCP")
        .ep("10.180.0.9", terminating(true))
        .build();
    let t2 = slice("default", "web-b", "web", "IPv4")
        .port("http", 8080, "TCP")
        .ep("10.180.0.9", terminating(false))
        .build();
    assert_eq!(
        golden(basic().build(), vec![t1, t2]),
        "172.30.0.10:80/tcp flags=0x0 affinity=0 -> [10.180.0.9:8080 (terminating)]\n"
    );
}

/// `internalTrafficPolicy: Local` (and the ext-local twin of `externalTrafficPolicy:
/// Local`): DROP (LOCAL_ONLY, EHOSTUNREACH at the socket hooks) only when endpoints exist
/// but none is local; with no usable endpoint anywhere, REJECT like any Service without
/// endpoints (iptables proxier: `!hasEndpoints` -> REJECT, else DROP).
#[test]
fn local_policy_without_any_endpoint_rejects_instead_of_dropping() {
    let itp = || basic().set("internalTrafficPolicy", json!("Local")).build();
    assert_eq!(
        golden(itp(), vec![]),
        "172.30.0.10:80/tcp flags=0x0 affinity=0 -> []\n"
    );
    // Endpoints, none usable (not ready, terminating and not serving): still none.
    let unusable = slice("default", "web-1", "web", "IPv4")
        .port("http", 8080, "TCP")
        .ep("10.180.0.2", json!({"nodeName": "node-b", "conditions": {"ready": false}}))
        .ep("10.180.0.3", json!({"nodeName": "node-a", "conditions": {"ready": false, "serving": false, "terminating": true}}))
        .build();
    assert_eq!(
        golden(itp(), vec![unusable]),
        "172.30.0.10:80/tcp flags=0x0 affinity=0 -> []\n"
    );
    // A serving+terminating remote one counts as an endpoint: none local -> drop.
    let remote_draining = slice("default", "web-1", "web", "IPv4")
        .port("http", 8080, "TCP")
        .ep("10.180.0.2", json!({"nodeName": "node-b", "conditions": {"ready": false, "serving": true, "terminating": true}}))
        .build();
    assert_eq!(
        golden(itp(), vec![remote_draining]),
        "172.30.0.10:80/tcp flags=0x2 affinity=0 -> []\n"
    );
    // externalTrafficPolicy Local: the same rule for the ext-local twin.
    let etp = || {
        let mut svc = basic()
            .set("type", json!("NodePort"))
            .set("externalTrafficPolicy", json!("Local"))
            .build();
        svc.spec
            .as_mut()
            .expect("spec")
            .ports
            .as_mut()
            .expect("ports")[0]
            .node_port = Some(30080);
        svc
    };
    assert_eq!(
        golden(etp(), vec![]),
        "\
172.30.0.10:80/tcp flags=0x0 affinity=0 -> []
0.0.0.0:30080/tcp flags=0x24 affinity=0 -> []
0.0.0.0:30080/tcp/ext-local flags=0x4 affinity=0 -> []
"
    );
    let remote = slice("default", "web-1", "web", "IPv4")
        .port("http", 8080, "TCP")
        .ep("10.180.0.2", json!({"nodeName": "node-b"}))
        .build();
    assert_eq!(
        golden(etp(), vec![remote]),
        "\
172.30.0.10:80/tcp flags=0x0 affinity=0 -> [10.180.0.2:8080]
0.0.0.0:30080/tcp flags=0x24 affinity=0 -> [10.180.0.2:8080]
0.0.0.0:30080/tcp/ext-local flags=0x6 affinity=0 -> []
"
    );
}

/// KEP-1860: only ingress IPs with `ipMode` unset or `VIP` are load-balancer VIPs
/// (kube-proxy pkg/proxy/serviceport.go, `proxyutil.IsVIPMode`); an `ipMode: Proxy` IP
/// is not programmed, so in-cluster traffic to it goes to the external load balancer.
#[test]
fn load_balancer_ingress_ip_mode_proxy_is_not_programmed() {
    let svc = basic()
        .set("type", json!("LoadBalancer"))
        .status(json!({"loadBalancer": {"ingress": [
            {"ip": "203.0.113.1"},
            {"ip": "203.0.113.2", "ipMode": "VIP"},
            {"ip": "203.0.113.3", "ipMode": "Proxy"},
            {"hostname": "lb.example.com"}
        ]}}))
        .build();
    let info = ServiceInfo::from_k8s(&svc, None)
        .expect("valid")
        .expect("selected");
    let ip = |s: &str| s.parse::<IpAddr>().expect("ip");
    assert_eq!(info.lb_ips, vec![ip("203.0.113.1"), ip("203.0.113.2")]);
    let s = slice("default", "web-1", "web", "IPv4")
        .port("http", 8080, "TCP")
        .ep("10.180.0.1", READY())
        .build();
    assert_eq!(
        golden(svc, vec![s]),
        "\
172.30.0.10:80/tcp flags=0x0 affinity=0 -> [10.180.0.1:8080]
203.0.113.1:80/tcp flags=0x10 affinity=0 -> [10.180.0.1:8080]
203.0.113.2:80/tcp flags=0x10 affinity=0 -> [10.180.0.1:8080]
"
    );
}

/// `ipFamilies[i]` names the family of `clusterIPs[i]`; a Service that contradicts it
/// (the API server would reject it; kube-proxy's IPv4 proxier finds no IPv4 family) is
/// skipped with `family_mismatch`.
#[test]
fn cluster_ip_of_the_wrong_family_is_skipped() {
    let svc = service("default", "x")
        .cluster_ips(&["10.96.79.15"])
        .set("ipFamilies", json!(["IPv6"]))
        .port("http", 80, "TCP")
        .build();
    let err = ServiceInfo::from_k8s(&svc, None).expect_err("family mismatch");
    assert_eq!(err.label(), "family_mismatch");
    assert_eq!(
        err.to_string(),
        "clusterIPs[0] 10.96.79.15 is not of ipFamilies[0] IPv6"
    );
    // Dual stack in the wrong order.
    let svc = service("default", "x")
        .cluster_ips(&["10.96.79.15", "fd00:96::15"])
        .set("ipFamilies", json!(["IPv6", "IPv4"]))
        .port("http", 80, "TCP")
        .build();
    assert_eq!(
        ServiceInfo::from_k8s(&svc, None)
            .expect_err("mismatch")
            .label(),
        "family_mismatch"
    );
    // Matching families (and no ipFamilies at all) are fine.
    for fams in [json!(["IPv4", "IPv6"]), json!(null)] {
        let svc = service("default", "x")
            .cluster_ips(&["10.96.79.15", "fd00:96::15"])
            .set("ipFamilies", fams)
            .port("http", 80, "TCP")
            .build();
        assert_eq!(
            ServiceInfo::from_k8s(&svc, None)
                .expect("ok")
                .expect("selected")
                .cluster_ips
                .len(),
            2
        );
    }
}

#[test]
fn internal_traffic_policy_local() {
    let svc = || basic().set("internalTrafficPolicy", json!("Local")).build();
    let slices = || {
        slice("default", "web-1", "web", "IPv4")
            .port("http", 8080, "TCP")
            .ep("10.180.0.1", json!({"nodeName": "node-a"}))
            .ep("10.180.0.2", json!({"nodeName": "node-b"}))
            .ep("10.180.0.3", json!({"nodeName": "node-a", "conditions": {"ready": false, "serving": true, "terminating": true}}))
    };
    assert_eq!(
        golden(svc(), vec![slices().build()]),
        "172.30.0.10:80/tcp flags=0x2 affinity=0 -> [10.180.0.1:8080]\n"
    );
    // No ready local endpoint: the local serving+terminating one, even though a remote
    // endpoint is ready (local and cluster fall back independently).
    let only_terminating_local = slice("default", "web-1", "web", "IPv4")
        .port("http", 8080, "TCP")
        .ep("10.180.0.2", json!({"nodeName": "node-b"}))
        .ep("10.180.0.3", json!({"nodeName": "node-a", "conditions": {"ready": false, "serving": true, "terminating": true}}))
        .build();
    assert_eq!(
        golden(svc(), vec![only_terminating_local]),
        "172.30.0.10:80/tcp flags=0x2 affinity=0 -> [10.180.0.3:8080 (terminating)]\n"
    );
    // Nothing local at all: no backends, and the LOCAL_ONLY flag makes the datapath
    // answer "no route to host" (kube-proxy drops) rather than "refused".
    let remote_only = slice("default", "web-1", "web", "IPv4")
        .port("http", 8080, "TCP")
        .ep("10.180.0.2", json!({"nodeName": "node-b"}))
        .build();
    assert_eq!(
        golden(svc(), vec![remote_only]),
        "172.30.0.10:80/tcp flags=0x2 affinity=0 -> []\n"
    );
}

#[test]
fn topology_hints_apply_only_when_every_ready_endpoint_has_them() {
    let zone = |z: &str| json!({"hints": {"forZones": [{"name": z}]}});
    let all_hinted = slice("default", "web-1", "web", "IPv4")
        .port("http", 8080, "TCP")
        .ep("10.180.0.1", zone("zone-a"))
        .ep("10.180.0.2", zone("zone-b"))
        .ep("10.180.0.3", zone("zone-a"))
        .build();
    assert_eq!(
        golden(basic().build(), vec![all_hinted]),
        "172.30.0.10:80/tcp flags=0x0 affinity=0 -> [10.180.0.1:8080, 10.180.0.3:8080]\n"
    );
    let one_unhinted = slice("default", "web-1", "web", "IPv4")
        .port("http", 8080, "TCP")
        .ep("10.180.0.1", zone("zone-a"))
        .ep("10.180.0.2", READY())
        .build();
    assert_eq!(
        golden(basic().build(), vec![one_unhinted]),
        "172.30.0.10:80/tcp flags=0x0 affinity=0 -> [10.180.0.1:8080, 10.180.0.2:8080]\n"
    );
    let no_match = slice("default", "web-1", "web", "IPv4")
        .port("http", 8080, "TCP")
        .ep("10.180.0.1", zone("zone-b"))
        .ep("10.180.0.2", zone("zone-c"))
        .build();
    assert_eq!(
        golden(basic().build(), vec![no_match]),
        "172.30.0.10:80/tcp flags=0x0 affinity=0 -> [10.180.0.1:8080, 10.180.0.2:8080]\n"
    );
    // PreferSameNode: node hints win over zone hints when all carry them.
    let node_hints = slice("default", "web-1", "web", "IPv4")
        .port("http", 8080, "TCP")
        .ep(
            "10.180.0.1",
            json!({"hints": {"forNodes": [{"name": "node-a"}], "forZones": [{"name": "zone-a"}]}}),
        )
        .ep(
            "10.180.0.2",
            json!({"hints": {"forNodes": [{"name": "node-b"}], "forZones": [{"name": "zone-a"}]}}),
        )
        .build();
    assert_eq!(
        golden(basic().build(), vec![node_hints]),
        "172.30.0.10:80/tcp flags=0x0 affinity=0 -> [10.180.0.1:8080]\n"
    );
    // Local traffic policy overrides topology.
    let svc = basic().set("internalTrafficPolicy", json!("Local")).build();
    let local = slice("default", "web-1", "web", "IPv4")
        .port("http", 8080, "TCP")
        .ep(
            "10.180.0.1",
            json!({"nodeName": "node-a", "hints": {"forZones": [{"name": "zone-b"}]}}),
        )
        .ep(
            "10.180.0.2",
            json!({"nodeName": "node-b", "hints": {"forZones": [{"name": "zone-a"}]}}),
        )
        .build();
    assert_eq!(
        golden(svc, vec![local]),
        "172.30.0.10:80/tcp flags=0x2 affinity=0 -> [10.180.0.1:8080]\n"
    );
}

#[test]
fn session_affinity_is_carried() {
    let svc = basic().set("sessionAffinity", json!("ClientIP")).build();
    assert_eq!(
        golden(svc, vec![]),
        "172.30.0.10:80/tcp flags=0x1 affinity=10800 -> []\n"
    );
    let svc = basic()
        .set("sessionAffinity", json!("ClientIP"))
        .set(
            "sessionAffinityConfig",
            json!({"clientIP": {"timeoutSeconds": 60}}),
        )
        .build();
    assert_eq!(
        golden(svc, vec![]),
        "172.30.0.10:80/tcp flags=0x1 affinity=60 -> []\n"
    );
}

#[test]
fn ignored_services_and_slices() {
    let external = service("default", "ext")
        .set("type", json!("ExternalName"))
        .set("externalName", json!("example.com"))
        .build();
    assert_eq!(ServiceInfo::from_k8s(&external, None), Ok(None));
    let headless = service("default", "hl")
        .cluster_ips(&["None"])
        .port("http", 80, "TCP")
        .build();
    assert_eq!(ServiceInfo::from_k8s(&headless, None), Ok(None));
    let other_proxy = basic()
        .label("service.kubernetes.io/service-proxy-name", "other")
        .build();
    assert_eq!(ServiceInfo::from_k8s(&other_proxy, None), Ok(None));
    let ours = basic()
        .label("service.kubernetes.io/service-proxy-name", "ebpf")
        .build();
    assert!(ServiceInfo::from_k8s(&ours, Some("ebpf"))
        .expect("ok")
        .is_some());
    assert_eq!(
        ServiceInfo::from_k8s(&basic().build(), Some("ebpf")),
        Ok(None)
    );
    let fqdn = slice("default", "f", "web", "FQDN").build();
    assert_eq!(SliceInfo::from_k8s(&fqdn, None), Ok(None));
}

#[test]
fn malformed_objects_name_the_cause() {
    let bad_ip = service("default", "x")
        .cluster_ips(&["10.0.0.300"])
        .port("a", 80, "TCP")
        .build();
    assert_eq!(
        ServiceInfo::from_k8s(&bad_ip, None),
        Err(Skip::BadClusterIp("10.0.0.300".into()))
    );
    let bad_port = basic().port("big", 70000, "TCP").build();
    let err = ServiceInfo::from_k8s(&bad_port, None).expect_err("bad port");
    assert_eq!(err.label(), "bad_port");
    assert_eq!(
        err.to_string(),
        "port 70000 of port \"big\" is out of range 1-65535"
    );
    let bad_proto = basic().port("x", 81, "ICMP").build();
    assert_eq!(
        ServiceInfo::from_k8s(&bad_proto, None),
        Err(Skip::UnknownProtocol("ICMP".into()))
    );
    let mut no_label = slice("default", "s", "web", "IPv4").build();
    no_label.metadata.labels = None;
    assert_eq!(
        SliceInfo::from_k8s(&no_label, None),
        Err(Skip::NoServiceLabel)
    );
    let wrong_family = slice("default", "s", "web", "IPv4")
        .ep("fd00::1", READY())
        .build();
    assert_eq!(
        SliceInfo::from_k8s(&wrong_family, None)
            .expect_err("family")
            .label(),
        "bad_endpoint_address"
    );
}

/// Slice `default/web-1` of Service `svc`: one ready endpoint `ip`, port "http" 8080.
fn web_1_of(svc: &str, ip: &str) -> SliceInfo {
    SliceInfo::from_k8s(
        &slice("default", "web-1", svc, "IPv4")
            .port("http", 8080, "TCP")
            .ep(ip, READY())
            .build(),
        None,
    )
    .expect("ok")
    .expect("selected")
}

#[test]
fn index_tracks_which_services_an_update_touches() {
    let mut index = Index::new(node());
    let web = ObjKey::new("default", "web");
    let info = ServiceInfo::from_k8s(&basic().build(), None).expect("ok");
    assert_eq!(index.set_service(web.clone(), info), web);
    let s = |svc: &str, ip: &str| Some(web_1_of(svc, ip));
    let slice_key = ObjKey::new("default", "web-1");
    assert_eq!(
        index.set_slice(slice_key.clone(), s("web", "10.180.0.1")),
        std::slice::from_ref(&web)
    );
    assert_eq!(
        render(&index.entries(&web)),
        "172.30.0.10:80/tcp flags=0x0 affinity=0 -> [10.180.0.1:8080]\n"
    );
    // A slice moving to another Service touches both.
    let other = ObjKey::new("default", "other");
    assert_eq!(
        index.set_slice(slice_key.clone(), s("other", "10.180.0.1")),
        [web.clone(), other.clone()]
    );
    assert_eq!(
        render(&index.entries(&web)),
        "172.30.0.10:80/tcp flags=0x0 affinity=0 -> []\n"
    );
    // A relist replaces everything: services that vanished are touched too.
    let touched = index.replace_services(vec![]);
    assert_eq!(touched, std::slice::from_ref(&web));
    assert!(index.entries(&web).is_empty());
    assert_eq!(index.replace_slices(vec![]), [other]);
}

#[test]
fn node_addresses_come_from_internal_and_external_ips() {
    let node: k8s_openapi::api::core::v1::Node = serde_json::from_value(json!({
        "apiVersion": "v1", "kind": "Node",
        "metadata": {"name": "node-a", "labels": {"topology.kubernetes.io/zone": "zone-a"}},
        "status": {"addresses": [
            {"type": "Hostname", "address": "node-a"},
            {"type": "InternalIP", "address": "10.0.0.5"},
            {"type": "InternalIP", "address": "fd00::5"},
            {"type": "ExternalIP", "address": "203.0.113.5"},
            {"type": "ExternalIP", "address": "10.0.0.5"},
            {"type": "InternalIP", "address": "not-an-ip"},
            {"type": "InternalIP", "address": "127.0.0.1"},
            {"type": "InternalDNS", "address": "node-a.internal"}
        ]}
    }))
    .expect("node");
    let info = NodeInfo::with_node("node-a", Some(&node));
    let ip = |s: &str| s.parse::<std::net::IpAddr>().expect("ip");
    assert_eq!(
        info.addresses,
        vec![ip("10.0.0.5"), ip("203.0.113.5"), ip("fd00::5")]
    );
    assert_eq!(info.zone.as_deref(), Some("zone-a"));
    assert!(NodeInfo::with_node("node-a", None).addresses.is_empty());
}

#[test]
fn a_node_being_deleted_or_scaled_down_is_marked() {
    let node = |extra: Value| -> k8s_openapi::api::core::v1::Node {
        let mut v = json!({"apiVersion": "v1", "kind": "Node", "metadata": {"name": "node-a"}});
        for (k, x) in extra.as_object().expect("object") {
            if k == "deletionTimestamp" {
                v["metadata"][k] = x.clone();
            } else {
                v[k] = x.clone();
            }
        }
        serde_json::from_value(v).expect("node")
    };
    let deleting = |n| NodeInfo::with_node("node-a", Some(&n)).deleting;
    assert!(!deleting(node(json!({}))));
    assert!(deleting(node(
        json!({"deletionTimestamp": "2026-11-30T12:00:00Z"})
    )));
    assert!(deleting(node(json!({"spec": {"taints": [
        {"key": "ToBeDeletedByClusterAutoscaler", "value": "1732968000", "effect": "NoSchedule"}
    ]}}))));
    assert!(!deleting(node(json!({"spec": {"taints": [
        {"key": "node.kubernetes.io/unschedulable", "effect": "NoSchedule"}
    ]}}))));
}

/// The compact layout of the desired state (issue 14 item 2): fixed sizes that the
/// memory measurement in tests/desired_state_memory.rs relies on.
#[test]
fn desired_state_types_stay_compact() {
    use std::mem::size_of;
    assert_eq!(size_of::<ObjKey>(), 32);
    assert!(
        size_of::<EndpointInfo>() <= 48,
        "{}",
        size_of::<EndpointInfo>()
    );
    // Interned strings are shared: the same node name twice is one allocation.
    let s = SliceInfo::from_k8s(
        &slice("default", "web-1", "web", "IPv4")
            .port("http", 8080, "TCP")
            .ep("10.180.0.1", json!({"nodeName": "node-z"}))
            .ep("10.180.0.2", json!({"nodeName": "node-z"}))
            .build(),
        None,
    )
    .expect("valid")
    .expect("selected");
    let (a, b) = (&s.endpoints[0].node, &s.endpoints[1].node);
    assert!(std::sync::Arc::ptr_eq(
        a.as_ref().expect("node"),
        b.as_ref().expect("node")
    ));
    assert!(std::sync::Arc::ptr_eq(
        &s.key.namespace,
        &s.service.namespace
    ));
}

/// kube-proxy's `sync_proxy_rules_no_local_endpoints_total`: Services with a Local policy
/// and no usable endpoint on this node, per family of their ClusterIPs and per policy;
/// updated as slices and Services change.
#[test]
fn no_local_endpoints_counts_local_policies_without_a_local_endpoint() {
    let mut index = Index::new(node());
    let set_svc = |index: &mut Index, svc: Service| {
        let info = ServiceInfo::from_k8s(&svc, None)
            .expect("valid")
            .expect("selected");
        index.set_service(info.key.clone(), Some(info));
    };
    let set_slice = |index: &mut Index, s: EndpointSlice| {
        let info = SliceInfo::from_k8s(&s, None)
            .expect("valid")
            .expect("selected");
        index.set_slice(info.key.clone(), Some(info));
    };
    // Dual-stack, internalTrafficPolicy Local; only a remote IPv4 endpoint.
    set_svc(
        &mut index,
        basic()
            .cluster_ips(&["172.30.0.10", "fd00:30::10"])
            .set("internalTrafficPolicy", json!("Local"))
            .build(),
    );
    set_slice(
        &mut index,
        slice("default", "web-1", "web", "IPv4")
            .port("http", 8080, "TCP")
            .ep("10.180.0.2", json!({"nodeName": "node-b"}))
            .build(),
    );
    // A Cluster-policy Service without endpoints does not count.
    set_svc(
        &mut index,
        service("default", "other")
            .cluster_ips(&["172.30.0.11"])
            .port("http", 80, "TCP")
            .build(),
    );
    assert_eq!(
        index.no_local_endpoints(),
        NoLocalEndpoints {
            internal: [1, 1],
            external: [0, 0]
        }
    );
    // A local IPv4 endpoint: IPv4 is served locally, IPv6 still is not.
    set_slice(
        &mut index,
        slice("default", "web-1", "web", "IPv4")
            .port("http", 8080, "TCP")
            .ep("10.180.0.1", json!({"nodeName": "node-a"}))
            .build(),
    );
    assert_eq!(
        index.no_local_endpoints(),
        NoLocalEndpoints {
            internal: [0, 1],
            external: [0, 0]
        }
    );
    // Back to the Cluster policy: nothing counts.
    set_svc(
        &mut index,
        basic().cluster_ips(&["172.30.0.10", "fd00:30::10"]).build(),
    );
    assert_eq!(index.no_local_endpoints(), NoLocalEndpoints::default());
}

/// Every frontend of a Service port carries the port's name and the backends its rule
/// gives, however many frontends share them: dual-stack cluster IPs, a NodePort,
/// `externalIPs`, LoadBalancer ingress IPs, and the ext-local twins of
/// `externalTrafficPolicy: Local`, on two ports (one unnamed).
#[test]
fn every_frontend_of_a_port_gets_its_name_and_backends() {
    let svc = service("shop", "web")
        .cluster_ips(&["172.30.0.10", "fd00:30::10"])
        .port("http", 80, "TCP")
        .port("", 81, "TCP")
        .set("type", json!("LoadBalancer"))
        .set("ipFamilies", json!(["IPv4", "IPv6"]))
        .set("externalTrafficPolicy", json!("Local"))
        .set("externalIPs", json!(["192.0.2.7", "2001:db8::7"]))
        .status(json!({"loadBalancer": {"ingress": [
            {"ip": "203.0.113.1"}, {"ip": "2001:db8:1::1"}
        ]}}))
        .build();
    let mut svc = svc;
    for (i, p) in svc
        .spec
        .as_mut()
        .expect("spec")
        .ports
        .as_mut()
        .expect("ports")
        .iter_mut()
        .enumerate()
    {
        p.node_port = Some(30080 + i as i32);
    }
    let info = ServiceInfo::from_k8s(&svc, None)
        .expect("valid")
        .expect("selected");
    let v4 = slice("shop", "web-4", "web", "IPv4")
        .port("http", 8080, "TCP")
        .port("", 8081, "TCP")
        .ep("10.180.0.1", json!({"nodeName": "node-a"}))
        .ep("10.180.0.2", json!({"nodeName": "node-b"}))
        .build();
    let v6 = slice("shop", "web-6", "web", "IPv6")
        .port("http", 8080, "TCP")
        .port("", 8081, "TCP")
        .ep("fd00:180::1", json!({"nodeName": "node-b"}))
        .build();
    let slices: Vec<SliceInfo> = [v4, v6]
        .iter()
        .map(|s| {
            SliceInfo::from_k8s(s, None)
                .expect("valid")
                .expect("selected")
        })
        .collect();
    let refs: Vec<&SliceInfo> = slices.iter().collect();
    let entries = service_entries(&info, &refs, &node());
    // Per family and port: the cluster IP, the NodePort, one external IP, one LB IP,
    // and the ext-local twins of the last three: 7; x 2 ports x 2 families.
    assert_eq!(entries.len(), 28, "{}", render(&entries));
    for e in &entries {
        let port = e.frontend.port;
        let second = port == 81 || port == 30081;
        let want = if second { "shop/web" } else { "shop/web:http" };
        assert_eq!(e.name, want, "{:?}", e.frontend);
        let target = if second { 8081 } else { 8080 };
        let ext_local = e.frontend.scope == proxy_common::scope::EXTERNAL_LOCAL;
        let got: Vec<String> = e.backends.iter().map(|b| b.addr.to_string()).collect();
        let want: Vec<String> = match (e.frontend.addr.is_ipv6(), ext_local) {
            (false, false) => vec![
                format!("10.180.0.1:{target}"),
                format!("10.180.0.2:{target}"),
            ],
            (false, true) => vec![format!("10.180.0.1:{target}")],
            (true, false) => vec![format!("[fd00:180::1]:{target}")],
            (true, true) => vec![],
        };
        assert_eq!(got, want, "{:?}", e.frontend);
    }
}

/// A list that names one slice twice (a manifests directory can): the last copy holds,
/// under its own Service only, as a watch would leave it.
#[test]
fn a_slice_listed_twice_is_kept_once_under_its_last_service() {
    let mut index = Index::new(node());
    let web = ObjKey::new("default", "web");
    let other = ObjKey::new("default", "other");
    let info = |name: &str| {
        ServiceInfo::from_k8s(
            &service("default", name)
                .cluster_ips(&[if name == "web" {
                    "172.30.0.10"
                } else {
                    "172.30.0.11"
                }])
                .port("http", 80, "TCP")
                .build(),
            None,
        )
        .expect("ok")
        .expect("selected")
    };
    index.replace_services(vec![
        (web.clone(), info("web")),
        (other.clone(), info("other")),
    ]);
    let s = web_1_of;
    let key = ObjKey::new("default", "web-1");
    let touched = index.replace_slices(vec![
        (key.clone(), s("web", "10.180.0.1")),
        (key.clone(), s("other", "10.180.0.2")),
    ]);
    // Touched: the Services whose slices differ from before the list (web had none).
    assert_eq!(touched, std::slice::from_ref(&other));
    assert_eq!(
        render(&index.entries(&web)),
        "172.30.0.10:80/tcp flags=0x0 affinity=0 -> []\n"
    );
    assert_eq!(
        render(&index.entries(&other)),
        "172.30.0.11:80/tcp flags=0x0 affinity=0 -> [10.180.0.2:8080]\n"
    );
    assert_eq!(index.slices().count(), 1);
}
