//! Golden tests of every view and rendering over one in-memory [`Snapshot`]: the seed
//! article's nginx-service (with its real endpoints, so `explain` must reproduce the
//! article's chain names), a Local-policy DNS service, a Service without endpoints, a
//! NodePort with `externalTrafficPolicy: Local` and affinity, a LoadBalancer with source
//! ranges, an IPv6 Service, a broken frontend, two node addresses and conntrack flows.
//!
//! Over 600 lines: tests only (one golden per view).

use std::{
    collections::BTreeSet,
    fs,
    net::{IpAddr, SocketAddr},
    path::Path,
    time::Duration,
};

use proxy_common::{backend_flags, ct_flags, scope, svc_flags, Reason};

use super::{
    affinity, backends, conntrack, explain, services,
    snapshot::{Cidr, CtEntry, Snapshot},
    stats, watch,
};
use crate::{
    model::{Backend, Frontend, Proto},
    store::FrontendValue,
};

const S: u64 = 1_000_000_000;

fn ip(s: &str) -> IpAddr {
    s.parse().expect("test address")
}

fn sa(s: &str) -> SocketAddr {
    s.parse().expect("test socket address")
}

struct Fixture(Snapshot);

impl Fixture {
    #[allow(
        clippy::too_many_arguments,
        reason = "a test builder mirroring the map fields"
    )]
    fn frontend(
        &mut self,
        fe: Frontend,
        id: u32,
        name: &str,
        flags: u16,
        affinity: u32,
        backends: &[u32],
    ) -> &mut Self {
        let d = &mut self.0.services;
        d.frontends.insert(
            fe,
            FrontendValue {
                service_id: id,
                count: backends.len() as u16,
                flags,
                affinity_timeout: affinity,
            },
        );
        for (i, b) in backends.iter().enumerate() {
            d.slots.insert((fe, i as u16 + 1), *b);
        }
        d.revnat.insert(id, (fe, name.to_string()));
        self
    }

    fn backend(&mut self, id: u32, addr: &str, proto: Proto, flags: u8, conns: u64) -> &mut Self {
        self.0.services.backends.insert(
            id,
            (
                Backend {
                    addr: sa(addr),
                    flags,
                },
                proto,
            ),
        );
        if conns > 0 {
            self.0.conns.insert(id, conns);
        }
        self
    }
}

fn tcp(addr: &str, port: u16) -> Frontend {
    Frontend::new(ip(addr), port, Proto::Tcp)
}

fn fixture() -> Snapshot {
    let mut f = Fixture(Snapshot::default());
    // The seed article: default/nginx-service, 10.96.0.100:80, three pods.
    f.frontend(
        tcp("10.96.0.100", 80),
        1,
        "default/nginx-service",
        0,
        0,
        &[2, 1, 3],
    )
    .backend(1, "192.168.104.146:80", Proto::Tcp, 0, 34)
    .backend(2, "192.168.104.147:80", Proto::Tcp, 0, 33)
    .backend(3, "192.168.238.78:80", Proto::Tcp, 0, 33);
    // internalTrafficPolicy: Local DNS with its one local endpoint.
    f.frontend(
        Frontend::new(ip("10.96.0.10"), 53, Proto::Udp),
        2,
        "kube-system/kube-dns:dns",
        svc_flags::LOCAL_ONLY,
        0,
        &[4],
    )
    .backend(4, "10.244.0.5:53", Proto::Udp, backend_flags::LOCAL, 7);
    // No endpoints at all.
    f.frontend(tcp("10.96.0.200", 80), 3, "default/empty", 0, 0, &[]);
    // NodePort 30080, externalTrafficPolicy: Local, ClientIP affinity: cluster-wide
    // slots (one terminating) and the ext-local twin with the local endpoint.
    let np = tcp("0.0.0.0", 30080);
    f.frontend(
        np,
        4,
        "default/web:http",
        svc_flags::NODE_PORT | svc_flags::ETP_LOCAL | svc_flags::AFFINITY,
        10800,
        &[5, 6],
    )
    .frontend(
        np.with_scope(scope::EXTERNAL_LOCAL),
        5,
        "default/web:http",
        svc_flags::NODE_PORT | svc_flags::LOCAL_ONLY,
        0,
        &[6],
    )
    .backend(
        5,
        "10.244.2.7:8080",
        Proto::Tcp,
        backend_flags::TERMINATING,
        2,
    )
    .backend(6, "10.244.0.9:8080", Proto::Tcp, backend_flags::LOCAL, 5);
    // A LoadBalancer IP with loadBalancerSourceRanges.
    f.frontend(
        tcp("192.0.2.10", 443),
        6,
        "default/lb:https",
        svc_flags::LOAD_BALANCER | svc_flags::SOURCE_RANGES,
        0,
        &[7],
    )
    .backend(7, "10.244.1.9:8443", Proto::Tcp, 0, 0);
    // IPv6.
    f.frontend(tcp("fd00:96::10", 80), 7, "default/web6", 0, 0, &[8])
        .backend(8, "[fd00:244::5]:8080", Proto::Tcp, 0, 1);
    // Broken: count 2, slot 2 missing, no REVNAT entry.
    let broken = tcp("10.96.0.250", 80);
    f.0.services.frontends.insert(
        broken,
        FrontendValue {
            service_id: 8,
            count: 2,
            flags: 0,
            affinity_timeout: 0,
        },
    );
    f.0.services.slots.insert((broken, 1), 1);
    // An orphan backend id with leftover counters.
    f.0.conns.insert(9, 4);

    let mut s = f.0;
    s.src_ranges.insert(
        6,
        vec![Cidr {
            addr: ip("203.0.113.0"),
            len: 24,
        }],
    );
    s.node_addrs = Some(BTreeSet::from([ip("192.168.50.1"), ip("fd00:50::1")]));
    s.stats = Reason::ALL
        .iter()
        .map(|r| {
            let v = match r {
                Reason::Translated => 120,
                Reason::NoService => 4021,
                Reason::NoBackend => 3,
                Reason::RevTranslated => 118,
                Reason::TcNewFlow => 2,
                _ => 0,
            };
            (*r, v)
        })
        .collect();
    s.now_ns = 1000 * S;
    // A SNATed NodePort flow (both directions) and a reply whose original is gone.
    s.flows = Some(vec![
        CtEntry {
            proto: proxy_common::proto::TCP,
            dir: 1,
            src: sa("10.244.2.7:8080"),
            dst: sa("192.168.50.1:40000"),
            dnat: Some(sa("198.51.100.7:51000")),
            snat: Some(sa("192.168.50.1:30080")),
            service_id: 4,
            backend_id: 5,
            flags: ct_flags::SNAT | ct_flags::SEEN_REPLY,
            last_seen_ns: 995 * S,
            packets: 6,
        },
        CtEntry {
            proto: proxy_common::proto::TCP,
            dir: 0,
            src: sa("198.51.100.7:51000"),
            dst: sa("192.168.50.1:30080"),
            dnat: Some(sa("10.244.2.7:8080")),
            snat: Some(sa("192.168.50.1:40000")),
            service_id: 4,
            backend_id: 5,
            flags: ct_flags::SNAT | ct_flags::SEEN_REPLY,
            last_seen_ns: 995 * S,
            packets: 7,
        },
        CtEntry {
            proto: proxy_common::proto::UDP,
            dir: 1,
            src: sa("10.244.0.9:8080"),
            dst: sa("198.51.100.8:5353"),
            dnat: None,
            snat: Some(sa("192.168.50.1:30080")),
            service_id: 5,
            backend_id: 6,
            flags: 0,
            last_seen_ns: 870 * S,
            packets: 1,
        },
    ]);
    s
}

/// Compares `got` with `testdata/NAME`; `UPDATE_GOLDEN=1` rewrites the file instead.
fn golden(name: &str, got: &str) {
    let path = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("src/ctl/testdata")
        .join(name);
    if std::env::var_os("UPDATE_GOLDEN").is_some() {
        fs::write(&path, got).expect("write golden file");
        return;
    }
    let want = fs::read_to_string(&path)
        .unwrap_or_else(|e| panic!("{}: {e} (UPDATE_GOLDEN=1 writes it)", path.display()));
    if got != want {
        let line = got
            .lines()
            .zip(want.lines())
            .position(|(g, w)| g != w)
            .unwrap_or_else(|| got.lines().count().min(want.lines().count()));
        panic!(
            "{name} differs from the golden file at line {}:\n got: {:?}\nwant: {:?}\n\
             (UPDATE_GOLDEN=1 accepts the new output)\n--- got ---\n{got}",
            line + 1,
            got.lines().nth(line),
            want.lines().nth(line)
        );
    }
}

const QUERIES: [&str; 10] = [
    "10.96.0.100:80",
    "192.168.50.1:30080",
    "10.96.0.200:80",
    "10.96.0.10:53/udp",
    "[fd00:96::10]:80",
    "192.0.2.10:443",
    "10.96.0.100:81",
    "192.168.50.2:30080",
    "10.96.0.250:80",
    "[::ffff:10.96.0.100]:80",
];

fn explain_doc(s: &Snapshot, q: &str) -> explain::ExplainDoc {
    explain::explain(s, &explain::parse_query(q).expect("query"))
}

#[test]
fn services_golden() {
    let s = fixture();
    let v = services::build(&s);
    golden("services.txt", &services::render(&v, false));
    golden("services-wide.txt", &services::render(&v, true));
    let doc = services::ServicesDoc {
        schema: super::SCHEMA,
        services: v,
    };
    golden(
        "services.json",
        &(serde_json::to_string_pretty(&doc).expect("json") + "\n"),
    );
    assert_eq!(
        services::render(&[], false),
        "no frontends programmed\n",
        "an empty node says so"
    );
}

#[test]
fn services_report_gaps_as_problems() {
    let s = fixture();
    let broken = services::view(&s, &tcp("10.96.0.250", 80)).expect("broken frontend");
    assert_eq!(
        broken.problems,
        ["slot 2 missing", "no REVNAT entry for service id 8"]
    );
    assert_eq!(broken.backends[1].state, "missing");
    assert_eq!(broken.service, None);
    let nginx = services::view(&s, &tcp("10.96.0.100", 80)).expect("nginx");
    assert!(nginx.problems.is_empty());
    let conns: u64 = nginx.backends.iter().map(|b| b.connections).sum();
    assert_eq!(conns, 100);
}

#[test]
fn backends_golden() {
    let s = fixture();
    let b = backends::build(&s);
    golden("backends.txt", &backends::render(&b, false));
    golden("backends-wide.txt", &backends::render(&b, true));
    // Backend 6 serves the NodePort and its ext-local twin; backend 1 the article's
    // service and the broken frontend.
    let six = b.iter().find(|v| v.id == 6).expect("backend 6");
    assert_eq!(six.frontends, 2);
    assert!(six.local);
}

#[test]
fn stats_golden() {
    let s = fixture();
    let doc = stats::build(&s);
    golden("stats.txt", &stats::render(&doc));
    assert_eq!(doc.counters.len(), Reason::ALL.len());
    assert!(doc.counters.iter().all(|c| !c.meaning.is_empty()));
    assert_eq!(
        doc.backends
            .iter()
            .find(|b| b.id == 9)
            .map(|b| b.endpoint.clone()),
        Some(None),
        "counters of a deleted backend id are still shown"
    );
}

#[test]
fn conntrack_golden_pairs_directions_and_filters() {
    let s = fixture();
    let doc = conntrack::build(&s, None);
    golden("conntrack.txt", &conntrack::render(&doc, false));
    golden("conntrack-wide.txt", &conntrack::render(&doc, true));
    // The original direction is followed by its reply, the lone reply comes last.
    let dirs: Vec<&str> = doc.flows.iter().map(|f| f.direction).collect();
    assert_eq!(dirs, ["original", "reply", "reply"]);
    assert!(
        doc.flows[2].expired,
        "130 s idle UDP is past its 60 s timeout"
    );
    let only = conntrack::build(&s, Some(ip("198.51.100.8")));
    assert_eq!(only.flows.len(), 1);
    let by_backend = conntrack::build(&s, Some(ip("10.244.2.7")));
    assert_eq!(by_backend.flows.len(), 2, "a rewrite target matches too");
    let mut none = s.clone();
    none.flows = None;
    assert!(conntrack::render(&conntrack::build(&none, None), false)
        .starts_with("no conntrack maps pinned"));
}

#[test]
fn affinity_golden_names_clients_services_and_backends() {
    use super::snapshot::{AffinityClient, AffinityEntry};
    let mut s = fixture();
    s.affinity = Some(vec![
        // A pod (its network namespace) held to backend 5 of the NodePort Service,
        // 10 minutes idle of 3 hours.
        AffinityEntry {
            client: AffinityClient::Netns(4097),
            service_id: 4,
            backend_id: 5,
            slot: 1,
            last_used_ns: (1000 - 600) * S,
        },
        // An outside client seen at TC, held to backend 6.
        AffinityEntry {
            client: AffinityClient::Addr(ip("198.51.100.7")),
            service_id: 4,
            backend_id: 6,
            slot: 2,
            last_used_ns: 990 * S,
        },
        // An entry of a Service without affinity now (nginx-service): expired.
        AffinityEntry {
            client: AffinityClient::Addr(ip("2001:db8::7")),
            service_id: 1,
            backend_id: 2,
            slot: 1,
            last_used_ns: 999 * S,
        },
    ]);
    let doc = affinity::build(&s);
    golden("affinity.txt", &affinity::render(&doc, false));
    golden("affinity-wide.txt", &affinity::render(&doc, true));
    let held: Vec<(&str, bool)> = doc
        .entries
        .iter()
        .map(|e| (e.client.as_str(), e.expired))
        .collect();
    assert_eq!(
        held,
        [
            ("2001:db8::7", true),
            ("netns:4097", false),
            ("198.51.100.7", false)
        ]
    );
    assert_eq!(doc.entries[1].backend.as_deref(), Some("10.244.2.7:8080"));
    let mut none = s.clone();
    none.affinity = None;
    assert!(affinity::render(&affinity::build(&none), false).starts_with("no AFFINITY map"));
}

#[test]
fn ages_and_intervals() {
    assert_eq!(conntrack::format_age(59 * S + S / 2), "59s");
    assert_eq!(conntrack::format_age(125 * S), "2m05s");
    assert_eq!(conntrack::format_age(3 * 3600 * S + 240 * S), "3h04m");
    assert_eq!(conntrack::format_age(50 * 3600 * S), "2d02h");
    assert_eq!(
        watch::parse_interval("250ms"),
        Ok(Duration::from_millis(250))
    );
    assert_eq!(watch::parse_interval("2"), Ok(Duration::from_secs(2)));
    assert_eq!(
        watch::parse_interval("1.5s"),
        Ok(Duration::from_millis(1500))
    );
    assert_eq!(watch::parse_interval("1m"), Ok(Duration::from_secs(60)));
    assert!(watch::parse_interval("0s").is_err());
    assert!(watch::parse_interval("1h").is_err());
    assert_eq!(watch::format_interval(Duration::from_millis(250)), "250ms");
    assert_eq!(watch::format_interval(Duration::from_secs(1)), "1s");
}

#[test]
fn explain_golden() {
    let s = fixture();
    let mut out = String::new();
    for q in QUERIES {
        out.push_str(&format!("$ proxyctl explain {q}\n"));
        out.push_str(&explain::render(&explain_doc(&s, q), false));
        out.push('\n');
    }
    golden("explain.txt", &out);
    golden(
        "explain-nodeport.json",
        &(serde_json::to_string_pretty(&explain_doc(&s, "192.168.50.1:30080")).expect("json")
            + "\n"),
    );
}

#[test]
fn explain_reproduces_the_article_chains() {
    let s = fixture();
    let doc = explain_doc(&s, "10.96.0.100:80");
    assert!(doc.matched);
    assert_eq!(doc.service.as_deref(), Some("default/nginx-service"));
    let rules = doc.iptables.expect("rules");
    let nat = rules.nat.join("\n");
    for name in [
        "KUBE-SVC-V2OKYYMBY3REGZOG",
        "KUBE-SEP-X7WBOA4PTAJA3GNK",
        "KUBE-SEP-I53TFYWHN2OKR6FH",
        "KUBE-SEP-WU6475GP2VYJZBGF",
        "--probability 0.33333333349",
        "--probability 0.50000000000",
    ] {
        assert!(nat.contains(name), "{name} missing from\n{nat}");
    }
    let probs: Vec<f64> = doc.paths[0]
        .backends
        .iter()
        .map(|b| b.probability)
        .collect();
    assert_eq!(probs, [1.0 / 3.0; 3]);
    assert_eq!(
        doc.paths.iter().map(|p| p.path).collect::<Vec<_>>(),
        ["socket", "tc"]
    );
}

#[test]
fn explain_outcomes_and_matches() {
    let s = fixture();
    let np = explain_doc(&s, "192.168.50.1:30080");
    assert!(np.via_node_port && np.node_address == Some(true));
    // Pods and the node's processes through the socket hooks (cluster-wide slots, the
    // peer shown as the node address), traffic from outside through TC (the ext-local
    // twin under externalTrafficPolicy Local).
    let paths: Vec<(&str, &str)> = np
        .paths
        .iter()
        .map(|p| (p.path, p.frontend.as_str()))
        .collect();
    assert_eq!(
        paths,
        [
            ("socket", "0.0.0.0:30080/tcp"),
            ("tc", "0.0.0.0:30080/tcp/ext-local")
        ]
    );
    assert!(np.paths[0]
        .detail
        .contains("show 192.168.50.1:30080 as the peer"));
    assert_eq!(np.frontends.len(), 2, "the frontend and its ext-local twin");

    assert_eq!(
        explain_doc(&s, "10.96.0.200:80").paths[0].outcome,
        "rejected"
    );

    let mut local = s.clone();
    let dns = Frontend::new(ip("10.96.0.10"), 53, Proto::Udp);
    local.services.frontends.get_mut(&dns).expect("dns").count = 0;
    let d = explain_doc(&local, "10.96.0.10:53/udp");
    assert_eq!(
        d.paths[0].outcome, "dropped",
        "Local policy, no local endpoint"
    );
    assert!(d.iptables.expect("rules").filter[0].ends_with("-j DROP"));

    let miss = explain_doc(&s, "10.96.0.100:81");
    assert!(!miss.matched && miss.paths.is_empty() && miss.iptables.is_none());
    let other = explain_doc(&s, "192.168.50.2:30080");
    assert_eq!(other.node_address, Some(false));
    assert!(other.notes[0].contains("not one of this node's addresses"));

    let mut no_nodes = s.clone();
    no_nodes.node_addrs = None;
    let unknown = explain_doc(&no_nodes, "192.168.50.1:30080");
    assert!(!unknown.matched && unknown.node_address.is_none());
    assert!(unknown.notes[0].contains("not pinned"));

    let mapped = explain_doc(&s, "[::ffff:10.96.0.100]:80");
    assert!(mapped.matched && mapped.notes[0].contains("v4-mapped"));
}

#[test]
fn watch_golden_and_rates() {
    let s = fixture();
    let first = watch::frame(1, None, &s);
    let mut later = s.clone();
    later.conns.insert(1, 44);
    later.conns.insert(9, 1); // reused id: counters restarted
    later.stats[0].1 += 10;
    let second = watch::frame(2, Some((&s, Duration::from_secs(2))), &later);
    let text = watch::render(&first, Duration::from_secs(2), Some(2))
        + "\n"
        + &watch::render(&second, Duration::from_secs(2), Some(2));
    golden("watch.txt", &text);
    assert_eq!(first.backends[0].delta, None);
    let busiest = &second.backends[0];
    assert_eq!(
        (busiest.id, busiest.delta, busiest.rate),
        (1, Some(10), Some(5.0))
    );
    let reused = second.backends.iter().find(|b| b.id == 9).expect("id 9");
    assert_eq!(reused.delta, Some(1));
    assert_eq!(second.counters[0].rate, Some(5.0));
}

/// docs/proxyctl.md lists every `stats` reason, in index order: the list cannot drift
/// from `proxy_common::Reason::ALL` again (it once lacked four of them).
#[test]
fn stats_reasons_in_the_docs_are_every_reason() {
    let doc = include_str!("../../../docs/proxyctl.md");
    let row = doc
        .lines()
        .find(|l| l.starts_with("| `.reason` |"))
        .expect("docs/proxyctl.md has the `.reason` row of the stats table");
    let list = row
        .split_once("`Reason::name()`:")
        .expect("the row lists Reason::name() values")
        .1;
    let list = list.split(" (").next().expect("list");
    let documented: Vec<&str> = list
        .split('`')
        .skip(1)
        .step_by(2)
        .filter(|n| !n.is_empty())
        .collect();
    let all: Vec<&str> = Reason::ALL.iter().map(|r| r.name()).collect();
    assert_eq!(
        documented, all,
        "docs/proxyctl.md stats reasons vs Reason::ALL"
    );
}

/// A Local traffic policy: `dropped` (EHOSTUNREACH / TC drop, kube-proxy's DROP) only
/// when the frontend carries LOCAL_ONLY (endpoints exist elsewhere); the index leaves
/// the flag off when there is no endpoint anywhere, and explain then says `rejected`
/// (kube-proxy's REJECT), with a REJECT rule in the kube-proxy rendering.
#[test]
fn explain_tells_no_local_endpoint_from_no_endpoint_at_all() {
    let s = fixture();
    let dns = Frontend::new(ip("10.96.0.10"), 53, Proto::Udp);
    let mut none_anywhere = s.clone();
    let v = none_anywhere.services.frontends.get_mut(&dns).expect("dns");
    v.count = 0;
    v.flags &= !svc_flags::LOCAL_ONLY;
    let d = explain_doc(&none_anywhere, "10.96.0.10:53/udp");
    assert_eq!(d.paths[0].outcome, "rejected");
    assert!(
        d.paths[0].detail.contains("no usable endpoint anywhere")
            && d.paths[0].detail.contains("ECONNREFUSED"),
        "{}",
        d.paths[0].detail
    );
    let rules = d.iptables.expect("rules");
    assert!(
        rules
            .filter
            .iter()
            .any(|r| r.contains("has no endpoints") && r.contains("-j REJECT")),
        "{rules:?}"
    );

    // externalTrafficPolicy Local, the ext-local twin empty.
    let twin = tcp("0.0.0.0", 30080).with_scope(scope::EXTERNAL_LOCAL);
    let tc_outcome = |flags: u16| {
        let mut t = s.clone();
        let v = t.services.frontends.get_mut(&twin).expect("twin");
        v.count = 0;
        v.flags = flags;
        let d = explain_doc(&t, "192.168.50.1:30080");
        let p = d.paths.iter().find(|p| p.path == "tc").expect("tc path");
        (p.outcome, p.detail.clone())
    };
    let (outcome, detail) = tc_outcome(svc_flags::NODE_PORT | svc_flags::LOCAL_ONLY);
    assert_eq!(outcome, "dropped");
    assert!(detail.contains("none on this node"), "{detail}");
    let (outcome, detail) = tc_outcome(svc_flags::NODE_PORT);
    assert_eq!(outcome, "rejected");
    assert!(detail.contains("RST"), "{detail}");
}

#[test]
fn explain_and_stats_show_the_xdp_hook_under_acceleration() {
    let mut s = fixture();
    let paths = |s: &Snapshot, q: &str| -> Vec<&'static str> {
        explain_doc(s, q).paths.iter().map(|p| p.path).collect()
    };
    // Off (and pins of a build without XDP): TC handles traffic from outside.
    assert_eq!(paths(&s, "192.168.50.1:30080"), ["socket", "tc"]);
    assert_eq!(stats::build(&s).acceleration, "off");
    s.acceleration = proxy_common::acceleration::NATIVE;
    s.xdp_stats = Reason::ALL
        .iter()
        .map(|r| (*r, u64::from(*r == Reason::TcNewFlow) * 7))
        .collect();
    let np = explain_doc(&s, "192.168.50.1:30080");
    assert_eq!(
        np.paths.iter().map(|p| p.path).collect::<Vec<_>>(),
        ["socket", "xdp"],
        "external traffic at XDP, pods and the node's processes at the socket hooks"
    );
    assert_eq!(np.paths[1].frontend, "0.0.0.0:30080/tcp/ext-local");
    assert!(np.paths[1].traffic.contains("native mode"));
    assert!(np.paths[1].detail.contains("go on to TC"));
    // Cluster IP traffic routed through the node too: XDP runs the same stages.
    assert_eq!(paths(&s, "10.96.0.100:80"), ["socket", "xdp"]);
    let doc = stats::build(&s);
    assert_eq!(doc.acceleration, "native");
    assert!(doc
        .xdp_counters
        .iter()
        .any(|c| c.reason == "tc_new_flow" && c.count == 7));
    assert!(stats::render(&doc).contains("XDP COUNTER"));
}

/// A Maglev frontend: `services` shows the flag, `explain` says how TC chooses.
#[test]
fn maglev_frontends_are_shown_and_explained() {
    let mut s = fixture();
    let np = tcp("0.0.0.0", 30080);
    let v = s.services.frontends.get_mut(&np).expect("nodeport");
    v.flags |= svc_flags::MAGLEV;
    let d = explain_doc(&s, "192.168.50.1:30080");
    assert!(
        d.notes.iter().any(|n| n.contains("lb-algorithm maglev")),
        "{:?}",
        d.notes
    );
    let plain = explain_doc(&fixture(), "192.168.50.1:30080");
    assert!(!plain.notes.iter().any(|n| n.contains("maglev")));
}

/// The backend generation the packet path keeps in a UDP entry's flags (bits 8..31) is
/// shown as `backend_gen`, not as flag bits; every flag bit has its name.
#[test]
fn conntrack_flag_names_leave_the_backend_generation_out() {
    use super::snapshot::{ct_backend_gen, ct_flag_names};
    let flags = ct_flags::SNAT | ct_flags::SEEN_REPLY | ct_flags::DSR | (7 << ct_flags::GEN_SHIFT);
    assert_eq!(ct_flag_names(flags), ["snat", "seen-reply", "dsr"]);
    assert_eq!(ct_backend_gen(flags), 7);
    assert_eq!(ct_flag_names(ct_flags::CLOSING), ["closing"]);
    assert_eq!(ct_backend_gen(ct_flags::CLOSING), 0);
}

/// `explain DEST --from CLIENT`: a tracked flow keeps its conntrack entry's backend, an
/// expired one is a new flow; a new flow to a Maglev frontend gets the backend of the slot
/// the frontend's table gives its 5-tuple hash; any other new flow is random.
#[test]
fn explain_from_a_client_names_the_flows_backend() {
    use super::snapshot::FlowFacts;
    use crate::maglev;
    let with_from = |q: &str, from: &str| {
        explain::parse_query(q)
            .expect("query")
            .with_from(Some(explain::parse_client(from).expect("client")))
            .expect("same family")
    };
    // A LoadBalancer IP with Maglev over the article's three pods, its table computed as
    // the writer computes it.
    let mut s = fixture();
    let lb = tcp("192.0.2.20", 80);
    let mut f = Fixture(s);
    f.frontend(
        lb,
        10,
        "default/maglev:http",
        svc_flags::LOAD_BALANCER | svc_flags::MAGLEV,
        0,
        &[1, 2, 3],
    );
    s = f.0;
    let params = maglev::Params::new(251, "explain-test").expect("prime");
    let table = maglev::table(
        params,
        &[
            (sa("192.168.104.146:80"), 1),
            (sa("192.168.104.147:80"), 2),
            (sa("192.168.238.78:80"), 3),
        ],
    );
    let mut picked = BTreeSet::new();
    for port in 40000..40064u16 {
        let client = format!("198.51.100.9:{port}");
        let q = with_from("192.0.2.20:80", &client);
        s.flow = Some(FlowFacts {
            from: sa(&client),
            tracked: None,
            maglev: [(10, table.clone())].into(),
        });
        let flow = explain::explain(&s, &q).flow.expect("a flow");
        assert_eq!(flow.by, "maglev", "{flow:?}");
        let h = proxy_common::maglev::flow_hash(
            [
                crate::model::v4_word("198.51.100.9".parse().expect("ip")),
                0,
                0,
                0,
            ],
            [
                crate::model::v4_word("192.0.2.20".parse().expect("ip")),
                0,
                0,
                0,
            ],
            port.to_be(),
            80u16.to_be(),
            6,
        );
        let slot = table[maglev::index(h, 251)];
        assert_eq!(flow.slot, Some(slot), "{flow:?}");
        assert_eq!(
            flow.endpoint.as_deref(),
            Some(
                [
                    "192.168.104.146:80",
                    "192.168.104.147:80",
                    "192.168.238.78:80"
                ][slot as usize - 1]
            )
        );
        picked.insert(slot);
    }
    assert_eq!(picked.len(), 3, "64 clients spread over the three slots");
    // Without a usable table the datapath falls back to random, and says so.
    s.flow = Some(FlowFacts {
        from: sa("198.51.100.9:40000"),
        tracked: None,
        maglev: Default::default(),
    });
    let flow = explain::explain(&s, &with_from("192.0.2.20:80", "198.51.100.9:40000"))
        .flow
        .expect("a flow");
    assert_eq!((flow.by, flow.endpoint), ("random", None));
    assert!(
        flow.detail.contains("falls back to random"),
        "{}",
        flow.detail
    );

    // The fixture's tracked NodePort flow keeps its backend (TCP, even a terminating one).
    let mut s = fixture();
    let tracked = s.flows.as_ref().expect("flows")[1];
    s.flow = Some(FlowFacts {
        from: sa("198.51.100.7:51000"),
        tracked: Some(tracked),
        maglev: Default::default(),
    });
    let q = with_from("192.168.50.1:30080", "198.51.100.7:51000");
    let flow = explain::explain(&s, &q).flow.expect("a flow");
    assert_eq!(flow.by, "conntrack", "{flow:?}");
    assert_eq!(flow.endpoint.as_deref(), Some("10.244.2.7:8080"));
    assert!(explain::render(&explain::explain(&s, &q), false)
        .contains("The flow from 198.51.100.7:51000"));
    // Idle past its timeout: the next packet is a new flow (eTP=Local: the local twin's
    // one backend).
    s.now_ns = tracked.last_seen_ns + proxy_common::ct_timeouts::TCP_ESTABLISHED + S;
    let flow = explain::explain(&s, &q).flow.expect("a flow");
    assert_eq!(flow.by, "random", "{flow:?}");
    assert!(flow.detail.contains("expired"), "{}", flow.detail);
    // A client of the other family is refused, naming both.
    let err = explain::parse_query("192.168.50.1:30080")
        .expect("query")
        .with_from(Some(sa("[2001:db8::7]:5000")))
        .expect_err("v6 client, v4 destination");
    assert!(
        err.contains("[2001:db8::7]:5000") && err.contains("192.168.50.1:30080/tcp"),
        "{err}"
    );
}

#[test]
fn explain_says_which_path_pods_and_the_host_take_under_socket_lb() {
    let mut s = fixture();
    let traffic = |s: &Snapshot, q: &str| -> Vec<(&'static str, String)> {
        explain_doc(s, q)
            .paths
            .iter()
            .map(|p| (p.path, p.traffic.clone()))
            .collect()
    };
    // `all` (and pins without SOCK_LB): the socket hooks for pods and the host.
    let all = traffic(&s, "10.96.0.10:53/udp");
    assert_eq!(all[0].0, "socket");
    assert!(all[0].1.starts_with("pods and processes"), "{all:?}");
    assert!(
        !all.iter().any(|(_, t)| t.contains("host-side veths")),
        "{all:?}"
    );

    s.socket_lb = proxy_common::socket_lb::TCP;
    // UDP: the hooks for the host only, pods per packet on their veths.
    let udp = traffic(&s, "10.96.0.10:53/udp");
    assert!(udp[0].1.starts_with("processes in the host's"), "{udp:?}");
    let pod = udp.last().expect("pod path");
    assert_eq!(pod.0, "tc");
    assert!(
        pod.1.contains("pods' UDP") && pod.1.contains("host-side veths"),
        "{udp:?}"
    );
    let d = explain_doc(&s, "10.96.0.10:53/udp");
    assert!(
        d.paths
            .last()
            .expect("pod")
            .detail
            .contains("no socket is destroyed"),
        "{:?}",
        d.paths
    );
    // TCP: the hooks for everyone; only bypassed pods per packet.
    let tcp = traffic(&s, "10.96.0.100:80");
    assert!(tcp[0].1.starts_with("pods and processes"), "{tcp:?}");
    assert!(
        tcp.last().expect("pod").1.contains("SOCK_LB_BYPASS"),
        "{tcp:?}"
    );

    // `all` with pods bypassed by label: those pods per packet.
    s.socket_lb = proxy_common::socket_lb::ALL;
    s.socket_lb_bypassed = 2;
    let all_bypass = traffic(&s, "10.96.0.100:80");
    assert!(
        all_bypass[0].1.starts_with("pods and processes"),
        "{all_bypass:?}"
    );
    assert!(
        all_bypass
            .last()
            .expect("pod")
            .1
            .contains("the 2 pod(s) in SOCK_LB_BYPASS (--socket-lb-bypass-selector)"),
        "{all_bypass:?}"
    );

    // `off`: no socket path at all.
    s.socket_lb = proxy_common::socket_lb::OFF;
    let off = traffic(&s, "10.96.0.100:80");
    assert!(!off.iter().any(|(p, _)| *p == "socket"), "{off:?}");
    assert!(
        off.last().expect("pod").1.contains("every pod's socket"),
        "{off:?}"
    );
}

/// `monitor`'s JSON: docs/proxyctl.md's field tables list exactly the fields an event and
/// the summary serialize to, and its example lines parse into them.
#[test]
fn monitor_event_schema_in_the_docs_is_the_code() {
    use super::monitor::{view, Names, Summary};
    use proxy_common::event::{event_hook, event_kind, Event, EventTuple};
    let doc = include_str!("../../../docs/proxyctl.md");
    let section = doc.split("\n## monitor").nth(1).expect("a monitor section");
    let fields = |header: &str| -> Vec<String> {
        section
            .lines()
            .skip_while(|l| !l.starts_with(header))
            .skip(2)
            .take_while(|l| l.starts_with('|'))
            .map(|l| l.split('`').nth(1).expect("a backticked field").to_string())
            .collect()
    };
    let w = |a: [u8; 4]| [u32::from_ne_bytes(a), 0, 0, 0];
    let e = Event {
        ts_ns: 5,
        reason: Reason::TcNewFlow as u32,
        service_id: 1,
        backend_id: 7,
        hook: event_hook::TC_INGRESS,
        kind: event_kind::TRANSLATE,
        family: 4,
        proto: 6,
        before: EventTuple {
            saddr: w([198, 51, 100, 7]),
            daddr: w([10, 96, 0, 10]),
            sport: 40000u16.to_be(),
            dport: 80u16.to_be(),
        },
        after: EventTuple {
            saddr: w([192, 0, 2, 1]),
            daddr: w([10, 1, 1, 2]),
            sport: 33000u16.to_be(),
            dport: 8080u16.to_be(),
        },
    };
    let v = view(&e, &Names::default(), 1_000_000_000);
    assert_eq!(
        (v.source.as_deref(), v.destination.as_str()),
        (Some("198.51.100.7:40000"), "10.96.0.10:80")
    );
    assert_eq!(
        (v.new_source.as_deref(), v.new_destination.as_str()),
        (Some("192.0.2.1:33000"), "10.1.1.2:8080")
    );
    assert_eq!(v.time, "1970-01-01T00:00:01.000000005Z");
    assert_eq!(
        (v.hook, v.kind, v.reason),
        ("tc_ingress", "translate", "tc_new_flow")
    );
    let json = serde_json::to_value(&v).expect("json");
    let keys: Vec<String> = json.as_object().expect("object").keys().cloned().collect();
    let mut documented = fields("| field |");
    documented.sort();
    let mut keys = keys;
    keys.sort();
    assert_eq!(
        documented, keys,
        "docs/proxyctl.md monitor event fields vs EventView"
    );
    let summary = serde_json::to_value(Summary::default()).expect("json");
    let mut skeys: Vec<String> = summary
        .as_object()
        .expect("object")
        .keys()
        .cloned()
        .collect();
    skeys.sort();
    let mut sdoc = fields("| summary field |");
    sdoc.sort();
    assert_eq!(
        sdoc, skeys,
        "docs/proxyctl.md monitor summary fields vs Summary"
    );
    // The example lines parse, with the documented fields.
    let example: Vec<serde_json::Value> = section
        .lines()
        .filter(|l| l.starts_with('{'))
        .map(|l| serde_json::from_str(l).expect("example JSON line"))
        .collect();
    assert_eq!(example.len(), 2);
    let mut ex_keys: Vec<String> = example[0].as_object().expect("o").keys().cloned().collect();
    ex_keys.sort();
    assert_eq!(ex_keys, keys);
    // Every event reason the docs list is a reason.
    let listed = section
        .split("Which reasons are events")
        .nth(1)
        .expect("the reasons paragraph");
    for name in listed.split('`').skip(1).step_by(2) {
        assert!(
            Reason::ALL.iter().any(|r| r.name() == name),
            "{name} is not a reason"
        );
    }
}

#[test]
fn monitor_rfc3339_utc() {
    use super::monitor::rfc3339_utc;
    assert_eq!(rfc3339_utc(0), "1970-01-01T00:00:00.000000000Z");
    // 2026-12-04T17:02:11.5Z
    assert_eq!(
        rfc3339_utc(1_796_403_731_500_000_000),
        "2026-12-04T17:02:11.500000000Z"
    );
    assert_eq!(
        rfc3339_utc(951_782_400 * 1_000_000_000),
        "2000-02-29T00:00:00.000000000Z"
    );
}
