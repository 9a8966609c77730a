//! Pinned state broken the way a crashed or buggy agent could leave it (two frontends
//! sharing one service id, a slot naming a missing backend, a count past the slots),
//! adopted by a new writer: every broken entry is repaired (counted), and after the first
//! sync real connections reach the right pods with the right peer address. Needs root.

mod support;

use std::{
    collections::BTreeMap,
    net::{IpAddr, Ipv4Addr, SocketAddr},
};

use proxy_user::{
    store::{FrontendValue, Op},
    writer::Repair,
    BpfMaps, Frontend, MapStore as _, Proto, ServiceEntry, Writer,
};
use support::{tcp_ask, TestEnv, Topology};

const PORT: u16 = 8080;

fn pod(i: usize) -> SocketAddr {
    SocketAddr::new(IpAddr::V4(Topology::pod_v4(i)), PORT)
}

/// Connects `n` times to `addr` and counts the answers per pod; every connection's peer
/// must be the service address (reverse NAT of the right service).
fn spread(addr: SocketAddr, n: usize) -> BTreeMap<String, usize> {
    let mut hits = BTreeMap::new();
    for _ in 0..n {
        let (pod, peer) = tcp_ask(addr).unwrap_or_else(|e| panic!("connect {addr}: {e}"));
        assert_eq!(peer, addr, "getpeername must show the service address");
        *hits.entry(pod).or_insert(0) += 1;
    }
    hits
}

#[test]
fn corrupted_pins_are_repaired_on_adoption_and_traffic_is_right_afterwards() {
    let mut env = TestEnv::new(3);
    env.serve_all(PORT);
    let web = Frontend::new(Ipv4Addr::new(10, 96, 0, 10), 80, Proto::Tcp);
    let api = Frontend::new(Ipv4Addr::new(10, 96, 0, 11), 80, Proto::Tcp);
    let desired = vec![
        ServiceEntry::new(web, [pod(1), pod(2)]),
        ServiceEntry::new(api, [pod(3)]),
    ];
    for e in &desired {
        env.writer().upsert(e).expect("upsert");
    }
    let maps = env.writer().store_mut();
    let d = maps.dump().expect("dump");
    let web_sid = d.frontends[&web].service_id;
    let api_backend = d.slots[&(api, 1)];
    let web_first = d.slots[&(web, 1)];
    for op in [
        // api takes web's service id, and claims two slots of which only one exists
        // (slots 1..=24 live in the frontend's own entry); web's second slot names a
        // backend that does not exist.
        Op::PutFrontend {
            frontend: api,
            value: FrontendValue {
                service_id: web_sid,
                count: 2,
                ..d.frontends[&api]
            },
            backends: vec![api_backend].into(),
        },
        Op::PutFrontend {
            frontend: web,
            value: d.frontends[&web],
            backends: vec![web_first, 999].into(),
        },
    ] {
        maps.apply(&op).expect("corrupt");
    }
    // The agent goes away; a new one adopts.
    env.writer = None;
    let (mut w, report) =
        Writer::adopt(BpfMaps::open(&env.pins.path).expect("open")).expect("adopt");
    assert_eq!(
        report.repairs,
        BTreeMap::from([
            (Repair::DanglingSlot, 1),
            (Repair::DuplicateServiceId, 1),
            (Repair::MissingSlot, 1),
        ])
    );
    let d = w.store().dump().expect("dump");
    assert_ne!(d.frontends[&api].service_id, d.frontends[&web].service_id);
    for (fe, v) in &d.frontends {
        assert_eq!(
            d.revnat.get(&v.service_id).map(|(f, _)| f),
            Some(fe),
            "{fe}"
        );
    }
    // The first sync rewrites what adoption did not trust.
    let r = w.sync(desired);
    assert!(r.errors.is_empty(), "{:?}", r.errors);
    assert_eq!(w.store().dump().expect("dump"), w.expected_dump());
    let hits = env.in_client(|| spread(web.socket_addr(), 60));
    assert_eq!(
        hits.keys().cloned().collect::<Vec<_>>(),
        ["pod1", "pod2"],
        "{hits:?}"
    );
    let hits = env.in_client(|| spread(api.socket_addr(), 20));
    assert_eq!(hits, BTreeMap::from([("pod3".to_string(), 20)]));
}
