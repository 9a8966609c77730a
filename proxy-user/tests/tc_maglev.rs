//! Maglev through the real TC program (`BPF_PROG_TEST_RUN`): two datapaths loaded
//! separately on two pin directories are two nodes; each got the same Service's backends
//! in another order and history (so their slot numbers differ), and both must send every
//! flow to the backend the user-space table computes, while conntrack still pins a flow
//! that is established. Needs root; fails without it.
//!
//! Plan: clients 198.51.100.0/24 and 2001:db8::/64, LoadBalancer IP 203.0.113.10:80 and
//! [2001:db8:96::10]:80, backends 10.1.0.N:8080 / [2001:db8:2::N]:8080.

mod support;

use proxy_common::prog_names::TC_INGRESS;

use std::net::{IpAddr, SocketAddr};

use aya::programs::{SchedClassifier, TestRun, TestRunOptions};
use proxy_common::{backend_flags, svc_flags};
use proxy_user::{
    bpf, loader, maglev,
    model::{v4_word, v6_words, Backend},
    BpfMaps, Frontend, Proto, ServiceEntry, Writer,
};
use support::{
    require_root,
    tc::{Pkt, TCP},
    PinDir,
};

const SYN: u8 = 0x02;
const ACK: u8 = 0x10;

/// One node: its own maps and programs.
struct Node {
    ebpf: aya::Ebpf,
    writer: Writer<BpfMaps>,
    _pins: PinDir,
}

impl Node {
    fn new(params: maglev::Params) -> Self {
        require_root();
        let pins = PinDir::new();
        let entries = loader::conntrack_entries(loader::DEFAULT_CONNTRACK_FLOWS).expect("size");
        let mut ebpf = loader::load_object(&proxy_user::pins::PinDir::new(&pins.path), entries)
            .expect("load object");
        let prog: &mut SchedClassifier = ebpf
            .program_mut(TC_INGRESS)
            .expect("program")
            .try_into()
            .expect("classifier");
        prog.load().expect("verifier accepts the TC program");
        let addrs: Vec<IpAddr> = vec!["192.0.2.1".parse().expect("ip")];
        bpf::set_node_addresses(&proxy_user::pins::PinDir::new(&pins.path), &addrs)
            .expect("node addresses");
        let mut writer = Writer::new(BpfMaps::open(&pins.path).expect("maps"));
        writer.set_maglev_params(params);
        Self {
            ebpf,
            writer,
            _pins: pins,
        }
    }

    /// The destination `tc_ingress` rewrites `pkt` to.
    fn dst(&self, pkt: &Pkt) -> SocketAddr {
        let p: &SchedClassifier = self
            .ebpf
            .program(TC_INGRESS)
            .expect("program")
            .try_into()
            .expect("classifier");
        let data = pkt.build();
        let mut out = vec![0u8; 512];
        let res = p
            .test_run(TestRunOptions {
                data_in: Some(&data),
                data_out: Some(&mut out),
                ..TestRunOptions::new()
            })
            .expect("test run");
        out.truncate(res.data_size_out as usize);
        assert_eq!(res.return_value, 0, "TC_ACT_OK for {pkt:?}");
        Pkt::parse(&out).dst
    }
}

fn entry(fe: Frontend, backends: &[SocketAddr], maglev: bool) -> ServiceEntry {
    let mut flags = svc_flags::LOAD_BALANCER;
    if maglev {
        flags |= svc_flags::MAGLEV;
    }
    ServiceEntry {
        backends: backends
            .iter()
            .map(|a| Backend {
                addr: *a,
                flags: backend_flags::LOCAL,
            })
            .collect(),
        flags,
        ..ServiceEntry::new(fe, [])
    }
}

/// The backend user space says a flow gets: the table over the backends (slot numbers
/// are irrelevant to the answer), indexed by the shared flow hash.
fn expected(params: maglev::Params, backends: &[SocketAddr], pkt: &Pkt) -> SocketAddr {
    let with: Vec<(SocketAddr, u16)> = backends.iter().copied().zip(1..).collect();
    let table = maglev::table(params, &with);
    let words = |a: IpAddr| match a {
        IpAddr::V4(v) => [v4_word(v), 0, 0, 0],
        IpAddr::V6(v) => v6_words(v),
    };
    let h = proxy_common::maglev::flow_hash(
        words(pkt.src.ip()),
        words(pkt.dst.ip()),
        pkt.src.port().to_be(),
        pkt.dst.port().to_be(),
        pkt.proto,
    );
    let slot = table[maglev::index(h, params.table_size)];
    with[usize::from(slot) - 1].0
}

/// What `proxyctl explain DEST --from CLIENT` says of `pkt`'s flow: how its backend is
/// chosen, and which.
fn flow_of(maps: &proxy_user::ctl::Maps, pkt: &Pkt) -> (&'static str, Option<SocketAddr>) {
    use proxy_user::ctl::explain;
    let q = explain::parse_query(&format!("{}/tcp", pkt.dst))
        .expect("query")
        .with_from(Some(pkt.src))
        .expect("same family");
    let s = maps
        .snapshot_for(q.addr, q.port, q.proto, q.from)
        .expect("snapshot");
    let flow = explain::explain(&s, &q).flow.expect("a flow");
    (flow.by, flow.endpoint.map(|e| e.parse().expect("endpoint")))
}

fn backends4(n: u8) -> Vec<SocketAddr> {
    (1..=n)
        .map(|i| format!("10.1.0.{i}:8080").parse().expect("addr"))
        .collect()
}

#[test]
fn two_nodes_pick_the_backend_user_space_computes_and_conntrack_pins_flows() {
    let params = maglev::Params::default();
    let a = Node::new(params);
    let b = Node::new(params);
    let (mut a, mut b) = (a, b);
    let fe = Frontend::new(
        "203.0.113.10".parse::<IpAddr>().expect("ip"),
        80,
        Proto::Tcp,
    );
    let all = backends4(10);
    // Node A: the ten in order. Node B: another history (a subset first, then the rest in
    // reverse), so its slot numbers differ from A's.
    a.writer.upsert(&entry(fe, &all, true)).expect("upsert A");
    b.writer
        .upsert(&entry(fe, &all[5..], true))
        .expect("upsert B");
    let mut rev = all.clone();
    rev.reverse();
    b.writer.upsert(&entry(fe, &rev, true)).expect("upsert B");
    let slots = |w: &Writer<BpfMaps>| {
        let d = proxy_user::store::MapStore::dump(w.store()).expect("dump");
        (1..=10u16)
            .map(|s| d.backends[&d.slots[&(fe, s)]].0.addr)
            .collect::<Vec<_>>()
    };
    assert_ne!(
        slots(&a.writer),
        slots(&b.writer),
        "the two nodes' slots should differ"
    );

    let flows: Vec<Pkt> = (0..300u32)
        .map(|i| {
            Pkt::tcp(
                &format!("198.51.100.{}:{}", 1 + i % 250, 20000 + i),
                "203.0.113.10:80",
                SYN,
            )
        })
        .collect();
    let mut per_backend = std::collections::BTreeMap::new();
    let maps = proxy_user::ctl::Maps::open(&proxy_user::pins::PinDir::new(&a._pins.path))
        .expect("proxyctl opens node A's maps");
    for (i, f) in flows.iter().enumerate() {
        let want = expected(params, &all, f);
        // `proxyctl explain --from` names the backend before the flow exists (Maglev)
        // and after (conntrack), on the first flows.
        if i < 40 {
            assert_eq!(
                flow_of(&maps, f),
                ("maglev", Some(want)),
                "explain before, {f:?}"
            );
        }
        assert_eq!(a.dst(f), want, "node A, {f:?}");
        assert_eq!(b.dst(f), want, "node B, {f:?}");
        if i < 40 {
            assert_eq!(
                flow_of(&maps, f),
                ("conntrack", Some(want)),
                "explain after, {f:?}"
            );
        }
        *per_backend.entry(want).or_insert(0) += 1;
    }
    // Spread over all ten.
    assert_eq!(per_backend.len(), 10, "{per_backend:?}");

    // A backend leaves on both nodes. Established flows keep their backend (conntrack);
    // new flows follow the new table, on both nodes alike.
    let gone = all[3];
    let rest: Vec<SocketAddr> = all.iter().copied().filter(|x| *x != gone).collect();
    a.writer.upsert(&entry(fe, &rest, true)).expect("upsert A");
    b.writer.upsert(&entry(fe, &rest, true)).expect("upsert B");
    for f in &flows {
        let ack = Pkt {
            flags: ACK,
            ..f.clone()
        };
        let before = expected(params, &all, f);
        if before != gone {
            assert_eq!(a.dst(&ack), before, "established flow moved on A");
        }
    }
    let mut moved = 0;
    for (i, f) in flows.iter().enumerate() {
        // New flows: other source ports, same clients.
        let f = Pkt {
            src: SocketAddr::new(f.src.ip(), 40000 + i as u16),
            ..f.clone()
        };
        let want = expected(params, &rest, &f);
        assert_eq!(a.dst(&f), want, "node A after the change, {f:?}");
        assert_eq!(b.dst(&f), want, "node B after the change, {f:?}");
        if expected(params, &all, &f) != want {
            moved += 1;
        }
    }
    // About a tenth of new flows land elsewhere than before the change (the ones of the
    // backend that left, and a few more).
    assert!((10..=60).contains(&moved), "{moved} of 300 moved");
}

#[test]
fn ipv6_and_the_random_default_differ_from_maglev_only_by_the_flag() {
    let params = maglev::Params::new(251, "ipv6-test").expect("prime");
    let (mut a, mut b) = (Node::new(params), Node::new(params));
    let fe = Frontend::new(
        "2001:db8:96::10".parse::<IpAddr>().expect("ip"),
        80,
        Proto::Tcp,
    );
    let all: Vec<SocketAddr> = (1..=5)
        .map(|i| format!("[2001:db8:2::{i}]:8080").parse().expect("addr"))
        .collect();
    let mut rev = all.clone();
    rev.reverse();
    a.writer.upsert(&entry(fe, &all, true)).expect("upsert");
    b.writer.upsert(&entry(fe, &rev, true)).expect("upsert");
    let flows: Vec<Pkt> = (0..100u16)
        .map(|i| {
            Pkt::tcp(
                &format!("[2001:db8::7]:{}", 30000 + i),
                "[2001:db8:96::10]:80",
                SYN,
            )
        })
        .collect();
    for f in &flows {
        let want = expected(params, &all, f);
        assert_eq!(a.dst(f), want, "{f:?}");
        assert_eq!(b.dst(f), want, "{f:?}");
    }
    // Without the flag (the default `random`), node B's choices for new flows no longer
    // follow the table: over 100 flows and 5 backends some differ.
    b.writer.upsert(&entry(fe, &rev, false)).expect("upsert");
    let differ = flows
        .iter()
        .map(|f| Pkt {
            src: SocketAddr::new(f.src.ip(), f.src.port() + 1000),
            ..f.clone()
        })
        .filter(|f| b.dst(f) != expected(params, &all, f))
        .count();
    assert!(
        differ > 20,
        "random choice matched Maglev for {} of 100",
        100 - differ
    );
    let _ = TCP;
}

/// `--maglev-fill bounded`: the datapath reads the bounded table as it reads Maglev's
/// (two nodes with other histories send every flow where user space computes), and when
/// one of ten backends leaves, new flows move little more than those it held.
#[test]
fn the_bounded_fill_is_followed_by_the_datapath_on_both_nodes() {
    let params = maglev::Params::new(4093, "bounded-test")
        .expect("prime")
        .with_fill(maglev::Fill::Bounded);
    let (mut a, mut b) = (Node::new(params), Node::new(params));
    let fe = Frontend::new(
        "203.0.113.10".parse::<IpAddr>().expect("ip"),
        80,
        Proto::Tcp,
    );
    let all = backends4(10);
    let mut rev = all.clone();
    rev.reverse();
    a.writer.upsert(&entry(fe, &all, true)).expect("upsert A");
    b.writer.upsert(&entry(fe, &rev, true)).expect("upsert B");
    let flows: Vec<Pkt> = (0..200u32)
        .map(|i| {
            Pkt::tcp(
                &format!("198.51.100.{}:{}", 1 + i % 200, 21000 + i),
                "203.0.113.10:80",
                SYN,
            )
        })
        .collect();
    for f in &flows {
        let want = expected(params, &all, f);
        assert_eq!(a.dst(f), want, "node A, {f:?}");
        assert_eq!(b.dst(f), want, "node B, {f:?}");
    }
    let gone = all[6];
    let rest: Vec<SocketAddr> = all.iter().copied().filter(|x| *x != gone).collect();
    a.writer.upsert(&entry(fe, &rest, true)).expect("upsert A");
    b.writer.upsert(&entry(fe, &rest, true)).expect("upsert B");
    let (mut moved, mut held) = (0, 0);
    for (i, f) in flows.iter().enumerate() {
        let f = Pkt {
            src: SocketAddr::new(f.src.ip(), 50000 + i as u16),
            ..f.clone()
        };
        let want = expected(params, &rest, &f);
        assert_eq!(a.dst(&f), want, "node A after the change, {f:?}");
        assert_eq!(b.dst(&f), want, "node B after the change, {f:?}");
        let before = expected(params, &all, &f);
        held += usize::from(before == gone);
        moved += usize::from(before != want);
    }
    // The flows of the backend that left move, and only a few others (1.2 x theirs).
    assert!(
        held > 0 && moved >= held,
        "{moved} moved, {held} were on it"
    );
    assert!(
        moved * 10 <= held * 12 + 10,
        "{moved} of 200 moved, {held} were on it"
    );
}

/// The kernel's own count (`memlock` of the map's fdinfo, `htab_map_mem_usage`) of what
/// the Maglev tables cost: 100 Maglev frontends at the default M = 16,381, compared with
/// the map before them. The figure the design notes in docs/CHANGELOG.md state.
#[test]
fn a_maglev_frontend_costs_nine_4_kib_elements_at_the_default_table_size() {
    let params = maglev::Params::default();
    let mut node = Node::new(params);
    let pins = node._pins.path.clone();
    let maglev_bytes = || {
        loader::map_memory(&pins)
            .into_iter()
            .find(|m| m.name == proxy_common::map_names::MAGLEV)
            .expect("MAGLEV pinned")
            .bytes
    };
    let before = maglev_bytes();
    let backends = backends4(20);
    let n = 100u32;
    for i in 0..n {
        let fe = Frontend::new(std::net::Ipv4Addr::from(0xcb00_7100 + i), 80, Proto::Tcp);
        node.writer
            .upsert(&entry(fe, &backends, true))
            .expect("upsert");
    }
    let after = maglev_bytes();
    let per = (after - before) / u64::from(n);
    eprintln!("MAGLEV: {before} B empty, {per} B per Maglev frontend at M = 16381");
    assert_eq!(per, 9 * 4096, "9 chunks of one 4 KiB element each");
    // The empty map: its bucket array (16 B x 2^17) and little else.
    assert!(before < 3 << 20, "{before} B for the empty map");
    // A random frontend costs nothing in MAGLEV.
    let fe = Frontend::new(std::net::Ipv4Addr::new(203, 0, 114, 1), 80, Proto::Tcp);
    node.writer
        .upsert(&entry(fe, &backends, false))
        .expect("upsert");
    assert_eq!(maglev_bytes(), after);
}
