//! Sync-loop logic against the in-memory store, with time passed in.
//!
//! Over 600 lines: tests only.

use std::{
    collections::BTreeSet,
    sync::Arc,
    time::{Duration, Instant},
};

use serde_json::json;

use super::Syncer;
use crate::{
    agent::metrics::Metrics,
    cluster::{
        lb_algorithm::LbAlgorithm,
        manifests::decode,
        objects::{NodeInfo, ObjKey},
        Kind, Object, Update,
    },
    model::{Frontend, Proto},
    store::MemStore,
    writer::Writer,
};

fn svc(name: &str, ip: &str) -> Object {
    decode(
        Kind::Service,
        json!({"apiVersion": "v1", "kind": "Service",
               "metadata": {"namespace": "default", "name": name},
               "spec": {"clusterIP": ip, "ports": [{"name": "http", "port": 80}]}}),
    )
    .expect("service")
}

fn slice(name: &str, svc: &str, ips: &[&str]) -> Object {
    let eps: Vec<_> = ips.iter().map(|ip| json!({"addresses": [ip]})).collect();
    decode(
        Kind::EndpointSlice,
        json!({"apiVersion": "discovery.k8s.io/v1", "kind": "EndpointSlice",
               "metadata": {"namespace": "default", "name": name,
                            "labels": {"kubernetes.io/service-name": svc}},
               "addressType": "IPv4", "ports": [{"name": "http", "port": 8080}], "endpoints": eps}),
    )
    .expect("slice")
}

fn snapshot(kind: Kind, objects: Vec<Object>) -> Update {
    Update::Snapshot {
        kind,
        objects,
        relist: false,
    }
}

fn syncer(store: MemStore) -> (Syncer<MemStore>, Arc<Metrics>) {
    let metrics = Arc::new(Metrics::new());
    let (writer, _) = Writer::adopt(store).expect("adopt");
    let s = Syncer::new(
        writer,
        NodeInfo {
            name: "node-a".into(),
            ..NodeInfo::default()
        },
        None,
        [Kind::Service, Kind::EndpointSlice, Kind::Node],
        metrics.clone(),
    );
    (s, metrics)
}

fn maps(s: &Syncer<MemStore>) -> String {
    s.writer().store().state.render()
}

fn initial(s: &mut Syncer<MemStore>, t: Instant) {
    s.handle(snapshot(Kind::Service, vec![svc("web", "10.96.0.10")]), t);
    s.handle(
        snapshot(
            Kind::EndpointSlice,
            vec![slice("web-1", "web", &["10.0.0.1", "10.0.0.2"])],
        ),
        t,
    );
    s.handle(snapshot(Kind::Node, vec![]), t);
}

#[test]
fn nothing_is_written_before_every_initial_list() {
    let t = Instant::now();
    let (mut s, _) = syncer(MemStore::default());
    s.handle(snapshot(Kind::Service, vec![svc("web", "10.96.0.10")]), t);
    s.handle(snapshot(Kind::EndpointSlice, vec![]), t);
    assert!(!s.ready());
    assert!(!s.sync(t).ran);
    assert_eq!(maps(&s), "");
    s.handle(snapshot(Kind::Node, vec![]), t);
    assert!(s.ready() && s.pending());
    let out = s.sync(t);
    assert!(out.ran && out.full);
    assert_eq!(
        maps(&s),
        "frontend 10.96.0.10:80/tcp id=1 count=0 flags=0x0 affinity=0\nrevnat 1 = 10.96.0.10:80/tcp \"default/web:http\"\n"
    );
}

#[test]
fn incremental_changes_write_only_the_touched_service() {
    let t = Instant::now();
    let (mut s, metrics) = syncer(MemStore::default());
    initial(&mut s, t);
    s.handle(Update::Apply(svc("other", "10.96.0.11")), t);
    s.sync(t);
    // Scale the web slice: only web's slots change.
    let t2 = t + Duration::from_secs(1);
    s.handle(
        Update::Apply(slice("web-1", "web", &["10.0.0.1", "10.0.0.2", "10.0.0.3"])),
        t2,
    );
    assert!(s.pending());
    let log_before = s.writer.store_mut().take_log();
    assert!(!log_before.is_empty());
    let out = s.sync(t2);
    assert!(!out.full);
    assert_eq!(
        s.writer.store_mut().take_log(),
        "\
put backend 3 = 10.0.0.3:8080/tcp
put frontend 10.96.0.10:80/tcp id=1 count=3 flags=0x0 affinity=0 backends [1 2 3]
"
    );
    // A change that flips back writes nothing.
    s.handle(Update::Apply(slice("web-1", "web", &["10.0.0.1"])), t2);
    s.handle(
        Update::Apply(slice("web-1", "web", &["10.0.0.1", "10.0.0.2", "10.0.0.3"])),
        t2,
    );
    assert_eq!(s.sync(t2).ops, 0);
    // Deleting the Service removes its frontend, and only that.
    s.handle(
        Update::Delete {
            kind: Kind::Service,
            key: ObjKey::new("default", "web"),
        },
        t2,
    );
    s.sync(t2);
    assert_eq!(
        maps(&s),
        "frontend 10.96.0.11:80/tcp id=2 count=0 flags=0x0 affinity=0\nrevnat 2 = 10.96.0.11:80/tcp \"default/other:http\"\n"
    );
    let text = metrics.render();
    assert!(text.contains("ebpf_proxy_programmed_frontends 1"), "{text}");
    assert!(
        text.contains("ebpf_proxy_network_programming_duration_seconds_count"),
        "{text}"
    );
}

#[test]
fn a_relist_removes_what_was_deleted_while_disconnected() {
    let t = Instant::now();
    let (mut s, _) = syncer(MemStore::default());
    initial(&mut s, t);
    s.handle(Update::Apply(svc("gone", "10.96.0.99")), t);
    s.sync(t);
    assert!(maps(&s).contains("10.96.0.99"));
    // The watch restarts; "gone" is not in the new list.
    s.handle(
        Update::Snapshot {
            kind: Kind::Service,
            objects: vec![svc("web", "10.96.0.10")],
            relist: true,
        },
        t,
    );
    assert!(s.sync(t).full);
    assert!(!maps(&s).contains("10.96.0.99"), "{}", maps(&s));
    assert!(maps(&s).contains("10.96.0.10:80/tcp id=1 count=2"));
}

#[test]
fn the_first_sync_collects_pinned_leftovers_without_flushing() {
    // A previous agent left "old" and "web" in the maps.
    let t = Instant::now();
    let (mut prev, _) = syncer(MemStore::default());
    initial(&mut prev, t);
    prev.handle(Update::Apply(svc("old", "10.96.0.50")), t);
    prev.sync(t);
    let mut store = std::mem::take(prev.writer.store_mut());
    store.take_log();

    let (mut s, _) = syncer(store);
    initial(&mut s, t);
    s.sync(t);
    // "web" is untouched (no op rewrote it), "old" is gone.
    assert_eq!(
        s.writer.store_mut().take_log(),
        "\
del frontend 10.96.0.50:80/tcp
del revnat 2 (V4)
"
    );
}

#[test]
fn malformed_objects_are_counted_and_keep_the_last_good_state() {
    let t = Instant::now();
    let (mut s, metrics) = syncer(MemStore::default());
    initial(&mut s, t);
    s.sync(t);
    let bad = decode(
        Kind::Service,
        json!({"apiVersion": "v1", "kind": "Service",
               "metadata": {"namespace": "default", "name": "web"},
               "spec": {"clusterIP": "not-an-ip", "ports": [{"port": 80}]}}),
    )
    .expect("decodes; invalid only semantically");
    s.handle(Update::Apply(bad), t);
    s.sync(t);
    assert!(maps(&s).contains("10.96.0.10:80/tcp id=1 count=2"));
    let orphan = slice("lonely", "missing", &["10.0.0.9"]);
    s.handle(Update::Apply(orphan), t);
    s.sync(t);
    let text = metrics.render();
    assert!(
        text.contains("kind=\"Service\",reason=\"bad_cluster_ip\"} 1"),
        "{text}"
    );
    assert!(
        text.contains("kind=\"EndpointSlice\",reason=\"service_missing\"} 1"),
        "{text}"
    );
}

#[test]
fn two_services_claiming_one_address_do_not_fight() {
    let t = Instant::now();
    let (mut s, metrics) = syncer(MemStore::default());
    initial(&mut s, t);
    s.sync(t);
    // Neither has a creation time: namespace/name decides, and "zz-copy" sorts after
    // "web" (see `conflicts_are_settled_by_age_then_name`).
    s.handle(Update::Apply(svc("zz-copy", "10.96.0.10")), t);
    s.sync(t);
    assert!(
        maps(&s).contains("10.96.0.10:80/tcp id=1 count=2"),
        "web keeps it"
    );
    assert!(metrics.render().contains("reason=\"frontend_conflict\"} 1"));
}

#[test]
fn failed_writes_stay_dirty_and_succeed_on_retry() {
    let t = Instant::now();
    let store = MemStore {
        svc_capacity: Some(1),
        ..MemStore::default()
    };
    let (mut s, metrics) = syncer(store);
    // 26 endpoints: the frontend's own entry and chunk 1.
    let ips: Vec<String> = (1..=26).map(|i| format!("10.0.0.{i}")).collect();
    let ips: Vec<&str> = ips.iter().map(String::as_str).collect();
    s.handle(snapshot(Kind::Service, vec![svc("web", "10.96.0.10")]), t);
    s.handle(
        snapshot(Kind::EndpointSlice, vec![slice("web-1", "web", &ips)]),
        t,
    );
    s.handle(snapshot(Kind::Node, vec![]), t);
    let out = s.sync(t);
    assert_eq!(out.failed, 1, "web needs 2 SVC entries, 1 fits");
    assert!(s.pending(), "kept for a retry");
    assert!(metrics.render().contains("reason=\"map_full\"} 1"));
    assert_eq!(maps(&s), "", "nothing of web left");
    s.writer.store_mut().svc_capacity = None;
    let out = s.sync(t + Duration::from_secs(1));
    assert_eq!(out.failed, 0);
    assert!(maps(&s).contains("10.96.0.10:80/tcp id=1 count=26"));
    assert!(!s.pending());
}

#[test]
fn external_ips_outside_the_allowed_prefixes_are_left_out_and_counted() {
    let t = Instant::now();
    let (s, metrics) = syncer(MemStore::default());
    let mut s = s.with_external_ip_cidrs(Some(vec![("203.0.113.0".parse().expect("ip"), 24)]));
    let web = decode(
        Kind::Service,
        json!({"apiVersion": "v1", "kind": "Service",
               "metadata": {"namespace": "default", "name": "web"},
               "spec": {"clusterIP": "10.96.0.10", "ports": [{"name": "http", "port": 80}],
                        "externalIPs": ["203.0.113.5", "198.51.100.5"]}}),
    )
    .expect("service");
    s.handle(snapshot(Kind::Service, vec![web]), t);
    s.handle(snapshot(Kind::EndpointSlice, vec![]), t);
    s.handle(snapshot(Kind::Node, vec![]), t);
    s.sync(t);
    let state = maps(&s);
    assert!(state.contains("frontend 203.0.113.5:80/tcp"), "{state}");
    assert!(state.contains("frontend 10.96.0.10:80/tcp"), "{state}");
    assert!(!state.contains("198.51.100.5"), "{state}");
    let text = metrics.render();
    assert!(
        text.contains(
            "ebpf_proxy_objects_skipped_total{kind=\"Service\",reason=\"external_ip_not_allowed\"} 1"
        ),
        "{text}"
    );
}

/// SCTP is accepted by the API but served by neither datapath here: the SCTP port is left
/// out (said and counted), the Service's TCP port is programmed.
#[test]
fn sctp_ports_are_left_out_and_counted_the_rest_served() {
    let t = Instant::now();
    let (mut s, metrics) = syncer(MemStore::default());
    let web = decode(
        Kind::Service,
        json!({"apiVersion": "v1", "kind": "Service",
               "metadata": {"namespace": "default", "name": "web"},
               "spec": {"clusterIP": "10.96.0.10",
                        "ports": [{"name": "http", "port": 80},
                                  {"name": "sig", "port": 3868, "protocol": "SCTP"}]}}),
    )
    .expect("service");
    s.handle(snapshot(Kind::Service, vec![web]), t);
    s.handle(snapshot(Kind::EndpointSlice, vec![]), t);
    s.handle(snapshot(Kind::Node, vec![]), t);
    s.sync(t);
    let state = maps(&s);
    assert!(state.contains("frontend 10.96.0.10:80/tcp"), "{state}");
    assert!(!state.contains("3868"), "{state}");
    let text = metrics.render();
    assert!(
        text.contains(
            "ebpf_proxy_objects_skipped_total{kind=\"Service\",reason=\"sctp_not_supported\"} 1"
        ),
        "{text}"
    );
}

#[test]
fn cidr_containment() {
    use crate::cluster::objects::{cidr_contains, parse_cidr};
    let c = |s: &str| parse_cidr(s).expect("cidr");
    let ip = |s: &str| s.parse().expect("ip");
    assert!(cidr_contains(c("203.0.113.0/24"), ip("203.0.113.255")));
    assert!(!cidr_contains(c("203.0.113.0/24"), ip("203.0.114.0")));
    assert!(cidr_contains(c("0.0.0.0/0"), ip("192.0.2.1")));
    assert!(cidr_contains(c("192.0.2.7"), ip("192.0.2.7")));
    assert!(!cidr_contains(c("192.0.2.7"), ip("192.0.2.8")));
    assert!(cidr_contains(c("2001:db8::/32"), ip("2001:db8:ffff::1")));
    assert!(!cidr_contains(c("2001:db8::/32"), ip("2001:db9::1")));
    assert!(cidr_contains(c("::/0"), ip("fd00::1")));
    assert!(
        !cidr_contains(c("0.0.0.0/0"), ip("::1")),
        "families never match"
    );
}

fn svc_created(name: &str, ip: &str, created: &str) -> Object {
    decode(
        Kind::Service,
        json!({"apiVersion": "v1", "kind": "Service",
               "metadata": {"namespace": "default", "name": name, "creationTimestamp": created},
               "spec": {"clusterIP": ip, "ports": [{"name": "http", "port": 80}]}}),
    )
    .expect("service")
}

/// `old` (created first) and `new` both claim 10.96.0.10:80, with one endpoint each.
fn two_claimants(s: &mut Syncer<MemStore>, t: Instant, new_first: bool) {
    let mut svcs = vec![
        svc_created("old", "10.96.0.10", "2026-01-01T00:00:00Z"),
        svc_created("new", "10.96.0.10", "2026-06-01T00:00:00Z"),
    ];
    if new_first {
        svcs.reverse();
    }
    s.handle(snapshot(Kind::Service, svcs), t);
    s.handle(
        snapshot(
            Kind::EndpointSlice,
            vec![
                slice("old-1", "old", &["10.0.0.1"]),
                slice("new-1", "new", &["10.0.0.2"]),
            ],
        ),
        t,
    );
    s.handle(snapshot(Kind::Node, vec![]), t);
}

/// The backends in 10.96.0.10:80's slots.
fn backends_of_vip(s: &Syncer<MemStore>) -> Vec<String> {
    maps(s)
        .lines()
        .skip_while(|l| !l.starts_with("frontend 10.96.0.10:80/tcp "))
        .skip(1)
        .take_while(|l| l.starts_with("  slot "))
        .map(|l| {
            l.rsplit('(')
                .next()
                .unwrap_or("")
                .trim_end_matches(')')
                .to_string()
        })
        .collect()
}

#[test]
fn conflicts_are_settled_by_age_then_name() {
    let t = Instant::now();
    for new_first in [false, true] {
        let (mut s, metrics) = syncer(MemStore::default());
        two_claimants(&mut s, t, new_first);
        s.sync(t);
        assert!(
            maps(&s).contains("revnat 1 = 10.96.0.10:80/tcp \"default/old:http\""),
            "the older Service owns it, whatever the order: {}",
            maps(&s)
        );
        // "new" sorts before "old" by name: age comes first.
        let text = metrics.render();
        assert!(
            text.contains("kind=\"Service\",reason=\"frontend_conflict\"} 1"),
            "{text}"
        );
        // Periodic re-diffs report nothing new.
        s.request_full(t);
        s.sync(t);
        assert!(metrics
            .render()
            .contains("kind=\"Service\",reason=\"frontend_conflict\"} 1"));
    }
}

#[test]
fn when_the_owner_goes_the_other_claimant_takes_over_in_the_same_sync() {
    let t = Instant::now();
    let (mut s, _) = syncer(MemStore::default());
    two_claimants(&mut s, t, false);
    s.sync(t);
    assert_eq!(backends_of_vip(&s), ["10.0.0.1:8080"]);
    s.writer.store_mut().take_log();
    s.handle(
        Update::Delete {
            kind: Kind::Service,
            key: ObjKey::new("default", "old"),
        },
        t,
    );
    let out = s.sync(t);
    assert!(!out.full && out.failed == 0);
    assert_eq!(backends_of_vip(&s), ["10.0.0.2:8080"], "{}", maps(&s));
    assert!(maps(&s).contains("\"default/new:http\""), "{}", maps(&s));
    let log = s.writer.store_mut().take_log();
    assert!(
        !log.contains("del frontend 10.96.0.10:80/tcp"),
        "rewritten in place, never removed:\n{log}"
    );
}

#[test]
fn when_the_loser_goes_the_owner_keeps_its_frontend() {
    let t = Instant::now();
    let (mut s, _) = syncer(MemStore::default());
    two_claimants(&mut s, t, true);
    s.sync(t);
    let before = maps(&s);
    s.writer.store_mut().take_log();
    s.handle(
        Update::Delete {
            kind: Kind::Service,
            key: ObjKey::new("default", "new"),
        },
        t,
    );
    let out = s.sync(t);
    assert!(out.failed == 0);
    assert_eq!(maps(&s), before);
    assert_eq!(s.writer.store_mut().take_log(), "", "nothing to write");
    // And the next periodic re-diff finds nothing to change either.
    s.request_full(t);
    assert_eq!(s.sync(t).ops, 0);
}

#[test]
fn a_restarted_agent_keeps_the_same_owner() {
    let t = Instant::now();
    let (mut first, _) = syncer(MemStore::default());
    two_claimants(&mut first, t, false);
    first.sync(t);
    let before = maps(&first);
    let mut store = std::mem::take(first.writer.store_mut());
    store.take_log();
    // The new agent hears of the claimants in the other order.
    let (mut s, _) = syncer(store);
    two_claimants(&mut s, t, true);
    s.sync(t);
    assert_eq!(maps(&s), before);
    assert_eq!(s.writer.store_mut().take_log(), "", "no owner flip");
}

fn bad_slice(name: &str, svc: &str) -> Object {
    decode(
        Kind::EndpointSlice,
        json!({"apiVersion": "discovery.k8s.io/v1", "kind": "EndpointSlice",
               "metadata": {"namespace": "default", "name": name,
                            "labels": {"kubernetes.io/service-name": svc}},
               "addressType": "IPv4", "ports": [{"name": "http", "port": 8080}],
               "endpoints": [{"addresses": ["not-an-ip"]}]}),
    )
    .expect("decodes; invalid only semantically")
}

#[test]
fn after_a_restart_an_invalid_object_keeps_what_the_pinned_maps_hold() {
    let t = Instant::now();
    let (mut prev, _) = syncer(MemStore::default());
    initial(&mut prev, t);
    prev.sync(t);
    let before = maps(&prev);
    assert!(
        before.contains("10.96.0.10:80/tcp id=1 count=2"),
        "{before}"
    );
    let mut store = std::mem::take(prev.writer.store_mut());
    store.take_log();

    // The slice turned invalid while no agent ran.
    let (mut s, metrics) = syncer(store);
    s.handle(snapshot(Kind::Service, vec![svc("web", "10.96.0.10")]), t);
    s.handle(
        snapshot(Kind::EndpointSlice, vec![bad_slice("web-1", "web")]),
        t,
    );
    s.handle(snapshot(Kind::Node, vec![]), t);
    assert_eq!(s.sync(t).failed, 0);
    assert_eq!(maps(&s), before, "the last good backends stay");
    assert!(metrics
        .render()
        .contains("kind=\"EndpointSlice\",reason=\"bad_endpoint_address\"} 1"));
    // Periodic re-diffs keep it too.
    s.request_full(t);
    s.sync(t);
    assert_eq!(maps(&s), before);
    // A valid version arrives: written.
    s.handle(Update::Apply(slice("web-1", "web", &["10.0.0.3"])), t);
    s.sync(t);
    assert!(
        maps(&s).contains("10.96.0.10:80/tcp id=1 count=1"),
        "{}",
        maps(&s)
    );

    // The same for a Service that does not validate at start: its frontend stays until
    // a valid version comes, then follows it.
    let mut store = std::mem::take(s.writer.store_mut());
    store.take_log();
    let (mut s, _) = syncer(store);
    let bad = decode(
        Kind::Service,
        json!({"apiVersion": "v1", "kind": "Service",
               "metadata": {"namespace": "default", "name": "web"},
               "spec": {"clusterIP": "not-an-ip", "ports": [{"name": "http", "port": 80}]}}),
    )
    .expect("decodes");
    s.handle(snapshot(Kind::Service, vec![bad]), t);
    s.handle(
        snapshot(
            Kind::EndpointSlice,
            vec![slice("web-1", "web", &["10.0.0.3"])],
        ),
        t,
    );
    s.handle(snapshot(Kind::Node, vec![]), t);
    s.sync(t);
    assert!(
        maps(&s).contains("10.96.0.10:80/tcp id=1 count=1"),
        "{}",
        maps(&s)
    );
    s.handle(Update::Apply(svc("web", "10.96.0.20")), t);
    s.sync(t);
    assert!(!maps(&s).contains("10.96.0.10"), "{}", maps(&s));
    assert!(
        maps(&s).contains("frontend 10.96.0.20:80/tcp"),
        "{}",
        maps(&s)
    );
}

fn nodeport_svc(name: &str, ip: &str, node_port: u16, algorithm: Option<&str>) -> Object {
    let mut meta = json!({"namespace": "default", "name": name});
    if let Some(a) = algorithm {
        meta["annotations"] = json!({ crate::cluster::lb_algorithm::ANNOTATION: a });
    }
    decode(
        Kind::Service,
        json!({"apiVersion": "v1", "kind": "Service", "metadata": meta,
               "spec": {"type": "NodePort", "clusterIP": ip,
                        "ports": [{"name": "http", "port": 80, "nodePort": node_port}]}}),
    )
    .expect("service")
}

/// `(frontend, flags)` of every frontend in the maps.
fn frontend_flags(s: &Syncer<MemStore>) -> Vec<(String, u16)> {
    s.writer()
        .store()
        .state
        .frontends
        .iter()
        .map(|(fe, v)| (fe.to_string(), v.flags))
        .collect()
}

#[test]
fn the_lb_algorithm_annotation_overrides_the_default_for_external_frontends_only() {
    use proxy_common::svc_flags::{MAGLEV, NODE_PORT};
    let t = Instant::now();
    let run = |default: LbAlgorithm| {
        let (s, metrics) = syncer(MemStore::default());
        let mut s = s.with_lb_algorithm(default);
        s.handle(
            snapshot(
                Kind::Service,
                vec![
                    nodeport_svc("plain", "10.96.0.10", 30010, None),
                    nodeport_svc("mag", "10.96.0.11", 30011, Some("maglev")),
                    nodeport_svc("rnd", "10.96.0.12", 30012, Some("random")),
                    nodeport_svc("typo", "10.96.0.13", 30013, Some("magelv")),
                ],
            ),
            t,
        );
        s.handle(
            snapshot(
                Kind::EndpointSlice,
                vec![
                    slice("plain-1", "plain", &["10.0.0.1"]),
                    slice("mag-1", "mag", &["10.0.0.2", "10.0.0.3"]),
                    slice("rnd-1", "rnd", &["10.0.0.4"]),
                    slice("typo-1", "typo", &["10.0.0.5"]),
                ],
            ),
            t,
        );
        s.handle(snapshot(Kind::Node, vec![]), t);
        assert!(s.sync(t).ran);
        (frontend_flags(&s), metrics, s)
    };
    let (flags, metrics, s) = run(LbAlgorithm::Random);
    let want = [
        ("0.0.0.0:30010/tcp", NODE_PORT),
        ("0.0.0.0:30011/tcp", NODE_PORT | MAGLEV),
        ("0.0.0.0:30012/tcp", NODE_PORT),
        // The unknown value: programmed with the default, counted.
        ("0.0.0.0:30013/tcp", NODE_PORT),
        // ClusterIPs (east-west at the socket hooks) never get Maglev.
        ("10.96.0.10:80/tcp", 0),
        ("10.96.0.11:80/tcp", 0),
        ("10.96.0.12:80/tcp", 0),
        ("10.96.0.13:80/tcp", 0),
    ];
    let want: Vec<(String, u16)> = want.iter().map(|(a, f)| (a.to_string(), *f)).collect();
    assert_eq!(flags, want);
    let text = metrics.render();
    assert!(
        text.contains(
            "ebpf_proxy_objects_skipped_total{kind=\"Service\",reason=\"lb_algorithm_unknown\"} 1"
        ),
        "{text}"
    );
    // Only the Maglev frontend has a table: 9 chunks at the default size.
    let d = &s.writer().store().state;
    let sids: std::collections::BTreeSet<u32> = d.maglev.keys().map(|(id, _)| *id).collect();
    assert_eq!(sids.len(), 1);
    assert_eq!(d.maglev.len(), 9);

    // Default maglev: every external frontend but the one annotated random.
    let (flags, _, _) = run(LbAlgorithm::Maglev);
    let maglev: Vec<&str> = flags
        .iter()
        .filter(|(_, f)| f & MAGLEV != 0)
        .map(|(a, _)| a.as_str())
        .collect();
    assert_eq!(
        maglev,
        [
            "0.0.0.0:30010/tcp",
            "0.0.0.0:30011/tcp",
            "0.0.0.0:30013/tcp"
        ]
    );
}

/// The first sync of many Services writes in batches (one call per phase and map, each
/// checked by `MemStore` for one op per entry and one map per call), ends in the same maps
/// as frontend-by-frontend writes, and an agent restarted on those maps writes nothing.
#[test]
fn a_large_first_sync_is_batched_and_a_restart_on_its_maps_writes_nothing() {
    let t = Instant::now();
    let n = 300;
    let feed = |s: &mut Syncer<MemStore>| {
        let svcs = (0..n)
            .map(|i| {
                svc(
                    &format!("s{i}"),
                    &format!("10.96.{}.{}", i / 200, i % 200 + 1),
                )
            })
            .collect();
        let slices = (0..n)
            .map(|i| {
                let ips: Vec<String> = (0..3)
                    .map(|e| format!("10.1.{}.{}", i % 250, e + 1))
                    .collect();
                let ips: Vec<&str> = ips.iter().map(String::as_str).collect();
                slice(&format!("s{i}-1"), &format!("s{i}"), &ips)
            })
            .collect();
        s.handle(snapshot(Kind::Service, svcs), t);
        s.handle(snapshot(Kind::EndpointSlice, slices), t);
        s.handle(snapshot(Kind::Node, vec![]), t);
    };
    let (mut batched, _) = syncer(MemStore::default());
    feed(&mut batched);
    let out = batched.sync(t);
    assert!(out.ran && out.full && out.failed == 0, "{out:?}");
    let store = batched.writer().store();
    assert!(
        !store.batches.is_empty() && store.batches.len() < 20,
        "batch calls: {:?}",
        store.batches.len()
    );
    assert_eq!(store.batches.iter().sum::<usize>(), out.ops);
    assert_eq!(batched.writer().frontend_count(), n);

    let (mut single, _) = syncer(MemStore {
        no_batches: true,
        ..MemStore::default()
    });
    feed(&mut single);
    let out1 = single.sync(t);
    assert_eq!(out1.ops, out.ops);
    assert!(single.writer().store().batches.is_empty());
    assert_eq!(maps(&single), maps(&batched));

    // Restart: a new agent adopts these maps and its first sync writes nothing.
    let pinned = MemStore::with_state(batched.writer().store().state.clone());
    let (mut again, _) = syncer(pinned);
    feed(&mut again);
    let out2 = again.sync(t);
    assert!(out2.ran && out2.full);
    assert_eq!(out2.ops, 0, "a restart on unchanged maps writes nothing");
    assert!(again.writer().store().log.is_empty());
    assert_eq!(maps(&again), maps(&batched));
}

/// A restart on pins that are no longer current (while no agent ran: one Service's
/// endpoint replaced, one Service gone, one new, one switched to Maglev by its
/// annotation) writes exactly the difference: the same ops and the same maps as an
/// agent that stayed up and applied the changes, and no op on a frontend that did not
/// change. The objects are reduced as the API reader reduces them (`api_decode`), so the
/// annotation goes through that path, and the unchanged frontends (Maglev ones among
/// them) go through `Writer::unchanged`.
#[test]
fn a_restart_on_changed_pins_writes_exactly_the_difference() {
    use crate::{cluster::api_decode, store::Op};
    let t = Instant::now();
    let n = 120;
    let service = |i: usize, maglev: bool| {
        let mut v = json!({"metadata": {"namespace": "default", "name": format!("s{i}")},
            "spec": {"type": "NodePort", "clusterIP": format!("10.96.{}.{}", i / 200, i % 200 + 1),
                     "ports": [{"name": "http", "port": 80, "nodePort": 30000 + i}]}});
        if maglev {
            v["metadata"]["annotations"] = json!({"ebpf-proxy.io/lb-algorithm": "maglev"});
        }
        api_decode::object(Kind::Service, &v.to_string(), None).expect("decodes")
    };
    let endpoints = |i: usize, changed: bool| {
        let eps: Vec<_> = (0..3)
            .map(|e| {
                let last = if changed && e == 1 { 200 } else { e + 1 };
                json!({"addresses": [format!("10.1.{}.{}", i % 250, last)]})
            })
            .collect();
        let v = json!({"metadata": {"namespace": "default", "name": format!("s{i}-1"),
                                    "labels": {"kubernetes.io/service-name": format!("s{i}")}},
            "addressType": "IPv4", "ports": [{"name": "http", "port": 8080}], "endpoints": eps});
        api_decode::object(Kind::EndpointSlice, &v.to_string(), None).expect("decodes")
    };
    // s3 is Maglev from the start (its table is adopted and kept); after the change s5
    // has a new endpoint, s6 is gone, s120 is new, s7 turns Maglev.
    let before = |i: usize| i < n;
    let after = |i: usize| i != 6 && i <= n;
    let feed = |s: &mut Syncer<MemStore>, changed: bool| {
        let keep = |i: &usize| if changed { after(*i) } else { before(*i) };
        let svcs = (0..=n)
            .filter(keep)
            .map(|i| service(i, i == 3 || (changed && i == 7)))
            .collect();
        let slices = (0..=n)
            .filter(keep)
            .map(|i| endpoints(i, changed && i == 5))
            .collect();
        s.handle(snapshot(Kind::Service, svcs), t);
        s.handle(snapshot(Kind::EndpointSlice, slices), t);
        s.handle(snapshot(Kind::Node, vec![]), t);
    };
    let (mut up, _) = syncer(MemStore::default());
    feed(&mut up, false);
    let out = up.sync(t);
    assert!(out.ran && out.failed == 0 && out.ops > 0, "{out:?}");
    let pinned = up.writer().store().state.clone();
    up.writer_mut().store_mut().log.clear();

    // The agent that stayed up gets the changes as watch events.
    up.handle(Update::Apply(endpoints(5, true)), t);
    up.handle(
        Update::Delete {
            kind: Kind::EndpointSlice,
            key: ObjKey::new("default", "s6-1"),
        },
        t,
    );
    up.handle(
        Update::Delete {
            kind: Kind::Service,
            key: ObjKey::new("default", "s6"),
        },
        t,
    );
    up.handle(Update::Apply(service(n, false)), t);
    up.handle(Update::Apply(endpoints(n, false)), t);
    up.handle(Update::Apply(service(7, true)), t);
    let expected = up.sync(t);
    assert!(expected.ops > 0 && expected.failed == 0, "{expected:?}");
    let expected_log = up.writer_mut().store_mut().take_log();

    // A new agent on the old pins, with the new lists.
    let (mut restarted, _) = syncer(MemStore::with_state(pinned));
    feed(&mut restarted, true);
    let out = restarted.sync(t);
    assert!(out.ran && out.full && out.failed == 0, "{out:?}");
    assert_eq!(maps(&restarted), maps(&up), "the same maps");
    // Which hold the changes (not only what the agent that stayed up holds).
    let m = maps(&restarted);
    assert!(
        m.contains("(10.1.5.200:8080)") && !m.contains("(10.1.5.2:8080)"),
        "{m}"
    );
    assert!(
        !m.contains("10.96.0.7:80/tcp") && !m.contains("(10.1.6.1:8080)"),
        "{m}"
    );
    assert!(m.contains("frontend 10.96.0.121:80/tcp"), "{m}");
    let flags = |port: u16| {
        let fe = Frontend::new(std::net::Ipv4Addr::UNSPECIFIED, port, Proto::Tcp);
        restarted.writer().store().state.frontends[&fe].flags
    };
    use proxy_common::svc_flags::MAGLEV;
    assert!(flags(30007) & MAGLEV != 0 && flags(30003) & MAGLEV != 0);
    assert!(flags(30008) & MAGLEV == 0);
    assert_eq!(
        out.ops, expected.ops,
        "the same number of writes as the agent that stayed up:\n{expected_log}"
    );
    let changed: BTreeSet<u16> = [5, 6, 7, n].iter().map(|i| 30000 + *i as u16).collect();
    let changed_ips: BTreeSet<String> = [5, 6, 7, n]
        .iter()
        .map(|i| format!("10.96.{}.{}", i / 200, i % 200 + 1))
        .collect();
    for op in &restarted.writer().store().log {
        let fe = match op {
            Op::PutChunk { frontend, .. }
            | Op::DelChunk { frontend, .. }
            | Op::PutFrontend { frontend, .. }
            | Op::PutRevNat { frontend, .. } => frontend,
            _ => continue,
        };
        assert!(
            changed.contains(&fe.port) || changed_ips.contains(&fe.addr.to_string()),
            "an op on an unchanged frontend: {op}"
        );
    }
    // And a second restart on the now current pins writes nothing.
    let (mut again, _) = syncer(MemStore::with_state(
        restarted.writer().store().state.clone(),
    ));
    feed(&mut again, true);
    assert_eq!(again.sync(t).ops, 0);
    assert!(again.writer().store().log.is_empty());
}

/// Kubernetes names are up to 63 characters (namespace and Service alike), so
/// "namespace/name:port" can be longer than the `NAME_LEN` bytes a `REVNAT` entry keeps;
/// the maps hold it truncated (`MemStore` too, like the kernel's map). A restart on
/// unchanged pins must still write nothing (issue 14: restart with pins, 0 map writes),
/// and a full re-diff of the agent that stayed up too.
#[test]
fn a_restart_on_unchanged_pins_writes_nothing_for_names_longer_than_the_map_keeps() {
    use crate::cluster::api_decode;
    let t = Instant::now();
    let ns = "n".repeat(63);
    let name = |i: usize| format!("{}{i:03}", "s".repeat(60));
    let feed = |s: &mut Syncer<MemStore>| {
        let svcs = (0..3)
            .map(|i| {
                let v = json!({"metadata": {"namespace": ns, "name": name(i)},
                    "spec": {"clusterIP": format!("10.96.7.{}", i + 1),
                             "ports": [{"name": "https-metrics", "port": 443}]}});
                api_decode::object(Kind::Service, &v.to_string(), None).expect("decodes")
            })
            .collect();
        let slices = (0..3)
            .map(|i| {
                let v = json!({"metadata": {"namespace": ns, "name": format!("{}-1", name(i)),
                                            "labels": {"kubernetes.io/service-name": name(i)}},
                    "addressType": "IPv4", "ports": [{"name": "https-metrics", "port": 8443}],
                    "endpoints": [{"addresses": [format!("10.1.7.{}", i + 1)]}]});
                api_decode::object(Kind::EndpointSlice, &v.to_string(), None).expect("decodes")
            })
            .collect();
        s.handle(snapshot(Kind::Service, svcs), t);
        s.handle(snapshot(Kind::EndpointSlice, slices), t);
        s.handle(snapshot(Kind::Node, vec![]), t);
    };
    let (mut up, _) = syncer(MemStore::default());
    feed(&mut up);
    let out = up.sync(t);
    assert!(out.ran && out.failed == 0 && out.ops > 0, "{out:?}");
    let stored: Vec<String> = up
        .writer()
        .store()
        .state
        .revnat
        .values()
        .map(|(_, n)| n.clone())
        .collect();
    assert!(
        stored.len() == 3 && stored.iter().all(|n| n.len() <= proxy_common::NAME_LEN),
        "the names are kept truncated: {stored:?}"
    );
    assert!(
        format!("{ns}/{}:https-metrics", name(0)).len() > proxy_common::NAME_LEN,
        "the test's names must be longer than the map keeps"
    );

    let (mut restarted, _) = syncer(MemStore::with_state(up.writer().store().state.clone()));
    feed(&mut restarted);
    let out = restarted.sync(t);
    assert!(out.ran && out.full && out.failed == 0, "{out:?}");
    assert_eq!(
        out.ops,
        0,
        "a restart on unchanged pins rewrote: {:?}",
        restarted.writer().store().log
    );
    assert_eq!(maps(&restarted), maps(&up));
}

fn node(name: &str, addrs: &[(&str, &str)]) -> Object {
    let addrs: Vec<_> = addrs
        .iter()
        .map(|(t, a)| json!({"type": t, "address": a}))
        .collect();
    decode(
        Kind::Node,
        json!({"apiVersion": "v1", "kind": "Node", "metadata": {"name": name},
               "status": {"addresses": addrs}}),
    )
    .expect("node")
}

/// Issue 22 item 10: every Node object's InternalIP/ExternalIP addresses are kept by name
/// (the DSR trusted senders); another node's update or deletion does not touch this
/// node's own `NodeInfo`.
#[test]
fn every_nodes_addresses_are_kept_and_other_nodes_leave_this_ones_info_alone() {
    let t = Instant::now();
    let (mut s, _) = syncer(MemStore::default());
    s.handle(
        snapshot(
            Kind::Node,
            vec![
                node("node-b", &[("InternalIP", "10.0.2.1")]),
                node(
                    "node-a",
                    &[("InternalIP", "10.0.1.1"), ("ExternalIP", "fd00::1")],
                ),
                node(
                    "node-c",
                    &[("Hostname", "c"), ("ExternalIP", "203.0.113.3")],
                ),
            ],
        ),
        t,
    );
    let ip = |s: &str| s.parse::<std::net::IpAddr>().expect("ip");
    let own = vec![ip("10.0.1.1"), ip("fd00::1")];
    assert_eq!(s.index().node.addresses, own, "this node's, found by name");
    let all: Vec<(&str, Vec<std::net::IpAddr>)> = s
        .index()
        .cluster_nodes
        .iter()
        .map(|(n, a)| (n.as_str(), a.clone()))
        .collect();
    assert_eq!(
        all,
        vec![
            ("node-a", own.clone()),
            ("node-b", vec![ip("10.0.2.1")]),
            ("node-c", vec![ip("203.0.113.3")]),
        ]
    );
    // Another node changes: recorded; this node's info stays.
    s.handle(
        Update::Apply(node("node-b", &[("InternalIP", "10.0.2.9")])),
        t,
    );
    assert_eq!(s.index().cluster_nodes["node-b"], vec![ip("10.0.2.9")]);
    assert_eq!(s.index().node.addresses, own);
    // Another node goes: forgotten.
    s.handle(
        Update::Delete {
            kind: Kind::Node,
            key: ObjKey::new("", "node-c"),
        },
        t,
    );
    assert!(!s.index().cluster_nodes.contains_key("node-c"));
    assert_eq!(s.index().node.addresses, own);
}

/// A Node's new address makes the next sync run (the DSR trusted senders are written
/// after it), with nothing to re-diff; the same Node again does not.
#[test]
fn a_nodes_address_change_makes_a_sync_run() {
    let t = Instant::now();
    let (mut s, _) = syncer(MemStore::default());
    initial(&mut s, t);
    s.sync(t);
    assert!(!s.pending());
    s.handle(
        Update::Apply(node("node-b", &[("InternalIP", "10.0.2.1")])),
        t,
    );
    assert!(s.pending(), "a new Node's addresses");
    let out = s.sync(t);
    assert!(out.ran && !out.full && out.ops == 0, "{out:?}");
    assert!(!s.pending());
    s.handle(
        Update::Apply(node("node-b", &[("InternalIP", "10.0.2.1")])),
        t,
    );
    assert!(!s.pending(), "the same addresses again");
    s.handle(
        Update::Delete {
            kind: Kind::Node,
            key: ObjKey::new("", "node-b"),
        },
        t,
    );
    assert!(s.pending(), "a Node gone");
}

/// RFC 3339 (UTC, nanoseconds) of `t`, as the EndpointSlice controller writes it (the
/// test apiserver's formatter).
use proxy_testbed::apiserver::rfc3339_nano as rfc3339;

fn slice_triggered(name: &str, svc: &str, ips: &[&str], trigger: &str) -> Object {
    let eps: Vec<_> = ips.iter().map(|ip| json!({"addresses": [ip]})).collect();
    decode(
        Kind::EndpointSlice,
        json!({"apiVersion": "discovery.k8s.io/v1", "kind": "EndpointSlice",
               "metadata": {"namespace": "default", "name": name,
                            "labels": {"kubernetes.io/service-name": svc},
                            "annotations": {"endpoints.kubernetes.io/last-change-trigger-time": trigger}},
               "addressType": "IPv4", "ports": [{"name": "http", "port": 8080}], "endpoints": eps}),
    )
    .expect("slice")
}

/// Issue 24 item 2: kubeproxy_network_programming_duration_seconds runs from the
/// EndpointSlice's last-change-trigger-time to the maps written, as kube-proxy measures
/// the SLI; a trigger from before the agent started is not observed (kube-proxy's
/// tracker start time).
#[test]
fn network_programming_runs_from_the_slices_trigger_time() {
    let t = Instant::now();
    let (mut s, metrics) = syncer(MemStore::default());
    // As if the agent had started a minute ago.
    s.started = std::time::SystemTime::now() - Duration::from_secs(60);
    initial(&mut s, t);
    s.sync(t);
    let count = |text: &str| {
        text.lines()
            .find(|l| {
                l.starts_with(
                    "kubeproxy_network_programming_duration_seconds_count{ip_family=\"IPv4\"}",
                )
            })
            .map(|l| l.rsplit(' ').next().unwrap_or("").to_string())
    };
    // Before the agent started: not observed.
    let old = rfc3339(std::time::SystemTime::now() - Duration::from_secs(3600));
    s.handle(
        Update::Apply(slice_triggered("web-1", "web", &["10.0.0.7"], &old)),
        t,
    );
    s.sync(t);
    assert_eq!(count(&metrics.render()), None, "{}", metrics.render());
    // Changed 2 s ago: observed at 2.x s.
    let recent = rfc3339(std::time::SystemTime::now() - Duration::from_secs(2));
    s.handle(
        Update::Apply(slice_triggered("web-1", "web", &["10.0.0.8"], &recent)),
        t,
    );
    s.sync(t);
    let text = metrics.render();
    assert_eq!(count(&text).as_deref(), Some("1"), "{text}");
    for (le, n) in [("2.0", 0), ("3.0", 1)] {
        let want = format!(
            "kubeproxy_network_programming_duration_seconds_bucket{{le=\"{le}\",ip_family=\"IPv4\"}} {n}"
        );
        assert!(text.contains(&want), "{want} missing in\n{text}");
    }
}

#[test]
fn the_service_holding_a_frontend_keeps_it_from_an_older_claimant_across_restarts() {
    let t = Instant::now();
    let (mut s, metrics) = syncer(MemStore::default());
    let web = || svc_created("web", "10.96.0.10", "2026-06-01T00:00:00Z");
    // Older than web and sorting first: it would win a frontend nobody held.
    let copy = || svc_created("aaa-copy", "10.96.0.10", "2026-01-01T00:00:00Z");
    let slices = || {
        vec![
            slice("web-1", "web", &["10.0.0.1"]),
            slice("aaa-copy-1", "aaa-copy", &["10.0.0.2"]),
        ]
    };
    s.handle(snapshot(Kind::Service, vec![web()]), t);
    s.handle(snapshot(Kind::EndpointSlice, slices()), t);
    s.handle(snapshot(Kind::Node, vec![]), t);
    s.sync(t);
    assert_eq!(backends_of_vip(&s), ["10.0.0.1:8080"]);
    s.handle(Update::Apply(copy()), t);
    s.sync(t);
    assert_eq!(backends_of_vip(&s), ["10.0.0.1:8080"], "web keeps it");
    assert!(metrics
        .render()
        .contains("kind=\"Service\",reason=\"frontend_conflict\"} 1"));
    s.request_full(t);
    s.sync(t);
    assert_eq!(backends_of_vip(&s), ["10.0.0.1:8080"], "a re-diff too");
    let before = maps(&s);

    // A restarted agent hears of both at once, the newcomer first: the pinned
    // reverse-NAT entry names web, which keeps it.
    let mut store = std::mem::take(s.writer.store_mut());
    store.take_log();
    let (mut s, _) = syncer(store);
    s.handle(snapshot(Kind::Service, vec![copy(), web()]), t);
    s.handle(snapshot(Kind::EndpointSlice, slices()), t);
    s.handle(snapshot(Kind::Node, vec![]), t);
    s.sync(t);
    assert_eq!(maps(&s), before);
    assert_eq!(s.writer.store_mut().take_log(), "", "no owner flip");

    // web lets it go: the other claimant takes it over.
    s.handle(
        Update::Delete {
            kind: Kind::Service,
            key: ObjKey::new("default", "web"),
        },
        t,
    );
    s.sync(t);
    assert_eq!(backends_of_vip(&s), ["10.0.0.2:8080"], "{}", maps(&s));
}

/// Three Services with their slices, and the Node list (every initial list in).
fn three(s: &mut Syncer<MemStore>, t: Instant) {
    let svcs = vec![
        svc("web", "10.96.0.10"),
        svc("api", "10.96.0.11"),
        svc("db", "10.96.0.12"),
    ];
    let slices = vec![
        slice("web-1", "web", &["10.0.0.1", "10.0.0.2"]),
        slice("api-1", "api", &["10.0.1.1"]),
        slice("db-1", "db", &["10.0.2.1", "10.0.2.2", "10.0.2.3"]),
    ];
    s.handle(snapshot(Kind::Service, svcs), t);
    s.handle(snapshot(Kind::EndpointSlice, slices), t);
    s.handle(snapshot(Kind::Node, vec![]), t);
}

#[test]
fn a_fresh_nodes_first_sync_writes_the_sized_entries_unless_an_update_came_first() {
    let t = Instant::now();
    let start = crate::loader::Sizes::compiled();
    let (mut plain, _) = syncer(MemStore::default());
    three(&mut plain, t);
    plain.sync(t);
    // Sized first (the entries computed on two threads, kept for the first sync): the
    // same maps as without.
    let (mut sized, _) = syncer(MemStore::default());
    three(&mut sized, t);
    sized.first_sync_sizes(start, &start, Default::default());
    assert_eq!(sized.prepared.as_ref().map(|p| p.len()), Some(3));
    sized.sync(t);
    assert!(sized.prepared.is_none());
    assert_eq!(maps(&sized), maps(&plain));
    // An update between the sizing and the first sync: written as it is now.
    let (mut late, _) = syncer(MemStore::default());
    three(&mut late, t);
    late.first_sync_sizes(start, &start, Default::default());
    late.handle(Update::Apply(slice("web-1", "web", &["10.0.0.3"])), t);
    assert!(late.prepared.is_none());
    late.sync(t);
    assert_eq!(backends_of_vip(&late), ["10.0.0.3:8080"], "{}", maps(&late));
}
