//! The TC programs on crafted packets through `BPF_PROG_TEST_RUN`: a table of packet in
//! -> verdict and packet out, with every checksum verified by recomputing it. The maps are
//! filled by the real writer on a per-run pin directory. Needs root; fails without it.
//!
//! Plan: client 198.51.100.7 / 2001:db8::7, node 192.0.2.1 / 2001:db8:1::1 (also the SNAT
//! address), frontend 10.96.0.10:80 and NodePort 30080, local backend 10.1.1.2:8080,
//! remote backend 10.2.1.2:8080.
//!
//! Over 600 lines: one suite (the TC program, packet by packet through BPF_PROG_RUN). Each
//! file under `tests/` is a test binary of its own that links the whole crate, so a suite
//! is split into modules only when its scenarios stop sharing set-up (shared helpers live
//! in `tests/support/`).

mod support;

use proxy_common::prog_names::{TC_EGRESS, TC_INGRESS};

use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr};

use proxy_common::{map_names, svc_flags, Ct4Key, Ct4Value, Reason};
use proxy_user::{Frontend, Proto};
use support::{
    packets::{entry, sa, Bed, ACK, LOCAL, RST, SYN, TC_ACT_OK, TC_ACT_REDIRECT, TC_ACT_SHOT},
    tc::{icmp_error, parse_icmp_error, Pkt, TCP, UDP},
};

#[test]
fn dnat_reverse_nat_and_checksums_ipv4_tcp_and_udp() {
    let mut bed = Bed::new();
    let fe = Frontend::new(Ipv4Addr::new(10, 96, 0, 10), 80, Proto::Tcp);
    bed.writer
        .upsert(&entry(fe, &[("10.1.1.2:8080", LOCAL)], 0))
        .expect("upsert");
    let dns = Frontend::new(Ipv4Addr::new(10, 96, 0, 10), 53, Proto::Udp);
    bed.writer
        .upsert(&entry(dns, &[("10.1.1.2:5353", LOCAL)], 0))
        .expect("upsert");

    // A SYN to the frontend: DNAT to the local backend, client address kept.
    let syn = Pkt::tcp("198.51.100.7:40000", "10.96.0.10:80", SYN);
    let (verdict, out) = bed.run(TC_INGRESS, &syn);
    assert_eq!(verdict, TC_ACT_OK);
    assert_eq!(
        out,
        Pkt {
            dst: sa("10.1.1.2:8080"),
            ..syn.clone()
        }
    );
    // The same flow again follows its entry.
    let (_, again) = bed.run(
        TC_INGRESS,
        &Pkt {
            flags: ACK,
            ..syn.clone()
        },
    );
    assert_eq!(again.dst, sa("10.1.1.2:8080"));
    // The reply leaving the node: source back to the frontend.
    let reply = Pkt::tcp("10.1.1.2:8080", "198.51.100.7:40000", SYN | ACK);
    let (verdict, out) = bed.run(TC_EGRESS, &reply);
    assert_eq!(verdict, TC_ACT_OK);
    assert_eq!(
        out,
        Pkt {
            src: sa("10.96.0.10:80"),
            ..reply
        }
    );

    // UDP, with a payload (the UDP checksum covers it).
    let q = Pkt::udp("198.51.100.7:5000", "10.96.0.10:53");
    let (_, out) = bed.run(TC_INGRESS, &q);
    assert_eq!(
        out,
        Pkt {
            dst: sa("10.1.1.2:5353"),
            ..q.clone()
        }
    );
    let (_, out) = bed.run(TC_EGRESS, &Pkt::udp("10.1.1.2:5353", "198.51.100.7:5000"));
    assert_eq!(out.src, sa("10.96.0.10:53"));

    // Not a frontend: untouched.
    let other = Pkt::tcp("198.51.100.7:40001", "10.96.0.11:80", SYN);
    assert_eq!(bed.run(TC_INGRESS, &other), (TC_ACT_OK, other));
    drop(bed.pins);
}

/// A frontend holds its first 24 backend slots in its own `SVC4` entry and the rest in
/// further entries of 24 (chunks): new flows reach every backend, those past slot 24
/// included, and after the count shrinks within the second chunk only the backends
/// still there.
#[test]
fn every_backend_slot_is_chosen_across_the_chunks_of_a_large_service() {
    let mut bed = Bed::new();
    let fe = Frontend::new(Ipv4Addr::new(10, 96, 0, 10), 80, Proto::Tcp);
    let pods: Vec<String> = (2..32).map(|i| format!("10.1.1.{i}:8080")).collect();
    let backends =
        |n: usize| -> Vec<(&str, u8)> { pods[..n].iter().map(|p| (p.as_str(), LOCAL)).collect() };
    bed.writer
        .upsert(&entry(fe, &backends(30), 0))
        .expect("upsert");
    let svc4: aya::maps::HashMap<_, proxy_common::Svc4Key, proxy_common::SvcEntry> =
        aya::maps::HashMap::try_from(bed.ebpf.map(map_names::SVC4).expect("SVC4")).expect("map");
    let mut chunks: Vec<u16> = svc4.keys().map(|k| k.expect("key").chunk).collect();
    chunks.sort_unstable();
    assert_eq!(
        chunks,
        [0, 1],
        "30 slots: the frontend's own entry and one chunk"
    );
    let mut sport = 20000u16;
    let mut chosen = |bed: &Bed, n: usize| {
        let mut seen = std::collections::BTreeSet::new();
        for _ in 0..n {
            sport += 1;
            let syn = Pkt::tcp(&format!("198.51.100.7:{sport}"), "10.96.0.10:80", SYN);
            let (verdict, out) = bed.run(TC_INGRESS, &syn);
            assert_eq!(verdict, TC_ACT_OK, "port {sport}");
            seen.insert(out.dst.to_string());
        }
        seen
    };
    // 40 flows per backend on average: a backend never chosen would be a slot the
    // datapath cannot read (odds of missing one by chance: about 1e-16).
    let want: std::collections::BTreeSet<String> = pods.iter().cloned().collect();
    assert_eq!(chosen(&bed, 1200), want, "slots 1..=30, both chunks");
    // 30 -> 26: the count shrinks within the second chunk.
    bed.writer
        .upsert(&entry(fe, &backends(26), 0))
        .expect("upsert");
    let want: std::collections::BTreeSet<String> = pods[..26].iter().cloned().collect();
    assert_eq!(chosen(&bed, 780), want, "slots 1..=26 only");
    drop(bed.pins);
}

#[test]
fn nodeport_to_a_remote_backend_is_source_natted_and_replies_restored() {
    let mut bed = Bed::new();
    let np = Frontend::new(Ipv4Addr::UNSPECIFIED, 30080, Proto::Tcp);
    bed.writer
        .upsert(&entry(np, &[("10.2.1.2:8080", 0)], svc_flags::NODE_PORT))
        .expect("upsert");
    let syn = Pkt::tcp("198.51.100.7:40000", "192.0.2.1:30080", SYN);
    let (verdict, out) = bed.run(TC_INGRESS, &syn);
    // Forwarded by FIB redirect, or handed to the stack when this test context has no
    // route: either way the packet is translated.
    assert!(
        verdict == TC_ACT_OK || verdict == TC_ACT_REDIRECT,
        "{verdict}"
    );
    assert_eq!(out.dst, sa("10.2.1.2:8080"));
    assert_eq!(out.src.ip(), "192.0.2.1".parse::<IpAddr>().expect("ip"));
    let snat_port = out.src.port();
    assert!((32768..61000).contains(&snat_port), "{snat_port}");
    // The backend's reply comes back to the SNAT address: both ends restored.
    let reply = Pkt::tcp(
        "10.2.1.2:8080",
        &format!("192.0.2.1:{snat_port}"),
        SYN | ACK,
    );
    let (_, out) = bed.run(TC_INGRESS, &reply);
    assert_eq!(
        (out.src, out.dst),
        (sa("192.0.2.1:30080"), sa("198.51.100.7:40000"))
    );
    // A NodePort on an address that is not the node's: untouched.
    let stray = Pkt::tcp("198.51.100.7:40002", "192.0.2.99:30080", SYN);
    assert_eq!(bed.run(TC_INGRESS, &stray).1, stray);
}

#[test]
fn ipv6_dnat_and_reverse_nat() {
    let mut bed = Bed::new();
    let fe = Frontend::new(
        "2001:db8:96::10".parse::<IpAddr>().expect("ip"),
        80,
        Proto::Tcp,
    );
    bed.writer
        .upsert(&entry(fe, &[("[2001:db8:2::2]:8080", LOCAL)], 0))
        .expect("upsert");
    let syn = Pkt::tcp("[2001:db8::7]:40000", "[2001:db8:96::10]:80", SYN);
    let (verdict, out) = bed.run(TC_INGRESS, &syn);
    assert_eq!(verdict, TC_ACT_OK);
    assert_eq!(
        out,
        Pkt {
            dst: sa("[2001:db8:2::2]:8080"),
            ..syn
        }
    );
    let reply = Pkt::udp("[2001:db8:2::2]:8080", "[2001:db8::7]:40000");
    // A UDP reply of no known flow is untouched...
    assert_eq!(bed.run(TC_EGRESS, &reply).1, reply);
    // ...the TCP one is restored.
    let reply = Pkt::tcp("[2001:db8:2::2]:8080", "[2001:db8::7]:40000", SYN | ACK);
    let (_, out) = bed.run(TC_EGRESS, &reply);
    assert_eq!(out.src, sa("[2001:db8:96::10]:80"));
}

#[test]
fn no_endpoints_reject_and_source_ranges_deny() {
    let mut bed = Bed::new();
    let empty = Frontend::new(Ipv4Addr::new(10, 96, 0, 20), 80, Proto::Tcp);
    bed.writer.upsert(&entry(empty, &[], 0)).expect("upsert");
    let syn = Pkt::tcp("198.51.100.7:40000", "10.96.0.20:80", SYN);
    let (verdict, out) = bed.run(TC_INGRESS, &syn);
    // Answered in place with a RST|ACK back to the client (kube-proxy's REJECT).
    assert_eq!(verdict, TC_ACT_REDIRECT);
    assert_eq!((out.src, out.dst), (syn.dst, syn.src));
    assert_eq!(out.flags, RST | ACK);
    // UDP: answered with ICMP (v6) port unreachable from the frontend, quoting the
    // datagram's IP and UDP headers (so the client's stack finds its socket), every
    // checksum valid, MAC addresses swapped.
    let ip = |s: &str| s.parse::<IpAddr>().expect("ip");
    for (fe, client, frontend) in [
        (ip("10.96.0.20"), "198.51.100.7:5000", "10.96.0.20:53"),
        (
            ip("2001:db8:96::20"),
            "[2001:db8::7]:5000",
            "[2001:db8:96::20]:53",
        ),
    ] {
        let udp = Frontend::new(fe, 53, Proto::Udp);
        bed.writer.upsert(&entry(udp, &[], 0)).expect("upsert");
        let dgram = Pkt::udp(client, frontend);
        let frame = dgram.build();
        let (verdict, out) = bed.run_raw(TC_INGRESS, &frame);
        assert_eq!(verdict, TC_ACT_REDIRECT, "{frontend}");
        assert_eq!((&out[..6], &out[6..12]), (&frame[6..12], &frame[..6]));
        let v4 = fe.is_ipv4();
        let icmp_at = if v4 { 34 } else { 54 };
        let (kind, code) = if v4 { (3, 3) } else { (1, 4) };
        assert_eq!((out[icmp_at], out[icmp_at + 1]), (kind, code), "{frontend}");
        assert_eq!(
            out.len(),
            icmp_at + 8 + if v4 { 28 } else { 48 },
            "{frontend}: the quote is the IP header and 8 bytes"
        );
        assert_eq!(
            parse_icmp_error(&out),
            (fe, sa(client).ip(), sa(client), sa(frontend)),
            "{frontend}"
        );
    }

    // loadBalancerSourceRanges: 198.51.100.0/24 allowed, others dropped.
    let lb = Frontend::new(Ipv4Addr::new(203, 0, 113, 10), 443, Proto::Tcp);
    let mut e = entry(
        lb,
        &[("10.1.1.2:8443", LOCAL)],
        svc_flags::LOAD_BALANCER | svc_flags::SOURCE_RANGES,
    );
    e.source_ranges = vec![("198.51.100.0".parse().expect("ip"), 24)];
    bed.writer.upsert(&e).expect("upsert");
    let (verdict, out) = bed.run(
        TC_INGRESS,
        &Pkt::tcp("198.51.100.7:40000", "203.0.113.10:443", SYN),
    );
    assert_eq!((verdict, out.dst), (TC_ACT_OK, sa("10.1.1.2:8443")));
    let (verdict, _) = bed.run(
        TC_INGRESS,
        &Pkt::tcp("192.0.2.50:40000", "203.0.113.10:443", SYN),
    );
    assert_eq!(verdict, TC_ACT_SHOT);
}

/// `externalTrafficPolicy: Local` with an empty ext-local twin: DROP when endpoints exist
/// on other nodes (the twin has LOCAL_ONLY), REJECT when there is no endpoint anywhere
/// (the index leaves LOCAL_ONLY off; kube-proxy's iptables proxier: `!hasEndpoints` ->
/// REJECT, else DROP).
#[test]
fn etp_local_without_local_endpoints_drops_without_any_endpoint_rejects() {
    let mut bed = Bed::new();
    let ip = Ipv4Addr::new(203, 0, 113, 30);
    // Endpoints elsewhere: the cluster entry has a remote backend, the twin none.
    let fe = Frontend::new(ip, 80, Proto::Tcp);
    bed.writer
        .upsert(&entry(
            fe,
            &[("10.2.1.2:8080", 0)],
            svc_flags::EXTERNAL_IP | svc_flags::ETP_LOCAL,
        ))
        .expect("upsert");
    bed.writer
        .upsert(&entry(
            fe.with_scope(proxy_common::scope::EXTERNAL_LOCAL),
            &[],
            svc_flags::EXTERNAL_IP | svc_flags::LOCAL_ONLY,
        ))
        .expect("upsert twin");
    let syn = Pkt::tcp("198.51.100.7:40001", "203.0.113.30:80", SYN);
    let (verdict, _) = bed.run(TC_INGRESS, &syn);
    assert_eq!(verdict, TC_ACT_SHOT, "none local: dropped");

    // No endpoint anywhere: both entries empty, the twin without LOCAL_ONLY.
    bed.writer
        .upsert(&entry(
            fe,
            &[],
            svc_flags::EXTERNAL_IP | svc_flags::ETP_LOCAL,
        ))
        .expect("upsert");
    bed.writer
        .upsert(&entry(
            fe.with_scope(proxy_common::scope::EXTERNAL_LOCAL),
            &[],
            svc_flags::EXTERNAL_IP,
        ))
        .expect("upsert twin");
    let (verdict, out) = bed.run(TC_INGRESS, &syn);
    assert_eq!(verdict, TC_ACT_REDIRECT, "no endpoint at all: rejected");
    assert_eq!((out.src, out.dst), (syn.dst, syn.src));
    assert_eq!(out.flags, RST | ACK);
}

#[test]
fn icmp_errors_about_nated_flows_are_translated() {
    let mut bed = Bed::new();
    let ip = |s: &str| s.parse::<IpAddr>().expect("ip");
    // Local backend: a router on the client's path says "fragmentation needed" about our
    // reply (frontend -> client): it is for the backend.
    let fe = Frontend::new(Ipv4Addr::new(10, 96, 0, 10), 80, Proto::Tcp);
    bed.writer
        .upsert(&entry(fe, &[("10.1.1.2:8080", LOCAL)], 0))
        .expect("upsert");
    bed.run(
        TC_INGRESS,
        &Pkt::tcp("198.51.100.7:40000", "10.96.0.10:80", SYN),
    );
    let quoted = Pkt::tcp("10.96.0.10:80", "198.51.100.7:40000", ACK);
    let (verdict, out) = bed.run_raw(
        TC_INGRESS,
        &icmp_error(ip("192.0.2.254"), ip("10.96.0.10"), 3, &quoted),
    );
    assert_eq!(verdict, TC_ACT_OK);
    assert_eq!(
        parse_icmp_error(&out),
        (
            ip("192.0.2.254"),
            ip("10.1.1.2"),
            sa("10.1.1.2:8080"),
            sa("198.51.100.7:40000")
        )
    );

    // Remote backend, SNATed: an error about our SNATed packet (node -> backend) is for
    // the client, about the frontend it used.
    let np = Frontend::new(Ipv4Addr::UNSPECIFIED, 30080, Proto::Tcp);
    bed.writer
        .upsert(&entry(np, &[("10.2.1.2:8080", 0)], svc_flags::NODE_PORT))
        .expect("upsert");
    let (_, fwd) = bed.run(
        TC_INGRESS,
        &Pkt::tcp("198.51.100.7:40001", "192.0.2.1:30080", SYN),
    );
    let quoted = Pkt::tcp(&fwd.src.to_string(), "10.2.1.2:8080", SYN);
    let (_, out) = bed.run_raw(
        TC_INGRESS,
        &icmp_error(ip("10.9.9.9"), ip("192.0.2.1"), 3, &quoted),
    );
    assert_eq!(
        parse_icmp_error(&out),
        (
            ip("10.9.9.9"),
            ip("198.51.100.7"),
            sa("198.51.100.7:40001"),
            sa("192.0.2.1:30080")
        )
    );

    // IPv6 "packet too big" about our reply.
    let fe6 = Frontend::new(ip("2001:db8:96::10"), 80, Proto::Tcp);
    bed.writer
        .upsert(&entry(fe6, &[("[2001:db8:2::2]:8080", LOCAL)], 0))
        .expect("upsert");
    bed.run(
        TC_INGRESS,
        &Pkt::tcp("[2001:db8::7]:40000", "[2001:db8:96::10]:80", SYN),
    );
    let quoted = Pkt::tcp("[2001:db8:96::10]:80", "[2001:db8::7]:40000", ACK);
    let (verdict, out) = bed.run_raw(
        TC_INGRESS,
        &icmp_error(ip("2001:db8:ffff::1"), ip("2001:db8:96::10"), 2, &quoted),
    );
    assert_eq!(verdict, TC_ACT_OK);
    assert_eq!(
        parse_icmp_error(&out),
        (
            ip("2001:db8:ffff::1"),
            ip("2001:db8:2::2"),
            sa("[2001:db8:2::2]:8080"),
            sa("[2001:db8::7]:40000")
        )
    );

    // An error about a flow we do not know is left alone.
    let stray = icmp_error(
        ip("192.0.2.254"),
        ip("10.96.0.10"),
        3,
        &Pkt::tcp("10.96.0.10:80", "198.51.100.8:1", ACK),
    );
    assert_eq!(bed.run_raw(TC_INGRESS, &stray), (TC_ACT_OK, stray));
}

#[test]
fn a_full_conntrack_table_evicts_old_flows_and_never_refuses_new_ones() {
    let flows = 128;
    let mut bed = Bed::with_conntrack(flows);
    let fe = Frontend::new(Ipv4Addr::new(10, 96, 0, 30), 80, Proto::Tcp);
    bed.writer
        .upsert(&entry(fe, &[("10.1.1.2:8080", LOCAL)], 0))
        .expect("upsert");
    let ct: aya::maps::HashMap<_, Ct4Key, Ct4Value> =
        aya::maps::HashMap::try_from(bed.ebpf.map(map_names::CT4).expect("CT4")).expect("map");
    assert_eq!(
        aya::maps::MapInfo::from_pin(bed.pins.path.join(map_names::CT4))
            .expect("pinned CT4")
            .max_entries(),
        2 * flows,
        "the table has the size asked for"
    );
    // Sixteen times as many flows as the table holds: every one is translated.
    let total = 16 * flows as u16;
    for i in 0..total {
        let syn = Pkt::tcp(&format!("198.51.100.7:{}", 10000 + i), "10.96.0.30:80", SYN);
        let (verdict, out) = bed.run(TC_INGRESS, &syn);
        assert_eq!(
            (verdict, out.dst),
            (TC_ACT_OK, sa("10.1.1.2:8080")),
            "flow {i} with the table full"
        );
    }
    let keys: Vec<Ct4Key> = ct.keys().map(|k| k.expect("key")).collect();
    assert!(
        keys.len() <= 2 * flows as usize,
        "{} entries in a table of {}",
        keys.len(),
        2 * flows
    );
    let port = |k: &Ct4Key| u16::from_be(k.sport);
    // The newest flow is tracked, the oldest were evicted.
    let orig: Vec<u16> = keys.iter().filter(|k| k.dir == 0).map(port).collect();
    assert!(orig.contains(&(10000 + total - 1)), "newest flow tracked");
    assert!(!orig.contains(&10000), "oldest flow evicted");
    // A later packet of the newest flow follows its entry.
    let ack = Pkt::tcp(
        &format!("198.51.100.7:{}", 10000 + total - 1),
        "10.96.0.30:80",
        ACK,
    );
    assert_eq!(bed.run(TC_INGRESS, &ack).1.dst, sa("10.1.1.2:8080"));
}

#[test]
fn session_affinity_by_client_address_until_the_timeout() {
    let mut bed = Bed::new();
    let fe = Frontend::new(Ipv4Addr::new(10, 96, 0, 40), 80, Proto::Tcp);
    let backends = [
        ("10.1.1.2:8080", LOCAL),
        ("10.1.1.3:8080", LOCAL),
        ("10.1.1.4:8080", LOCAL),
    ];
    let mut e = entry(fe, &backends, svc_flags::AFFINITY);
    e.affinity_timeout = 1;
    bed.writer.upsert(&e).expect("upsert");
    let syn = |client: &str, port: u16| {
        let pkt = Pkt::tcp(&format!("{client}:{port}"), "10.96.0.40:80", SYN);
        let (verdict, out) = bed.run(TC_INGRESS, &pkt);
        assert_eq!(verdict, TC_ACT_OK);
        out.dst
    };
    // One client: every new flow to the same backend.
    let first = syn("198.51.100.7", 20000);
    for port in 20001..20030 {
        assert_eq!(syn("198.51.100.7", port), first);
    }
    // Different clients are still spread.
    let clients: Vec<String> = (10..40).map(|i| format!("198.51.100.{i}")).collect();
    let chosen: Vec<SocketAddr> = clients.iter().map(|c| syn(c, 20000)).collect();
    let distinct: std::collections::BTreeSet<_> = chosen.iter().collect();
    assert_eq!(distinct.len(), 3, "{chosen:?}");
    // Each keeps its backend within the timeout...
    for (c, b) in clients.iter().zip(&chosen) {
        assert_eq!(syn(c, 20001), *b, "{c}");
    }
    // ...and is balanced afresh after it: over 30 clients some land elsewhere.
    std::thread::sleep(std::time::Duration::from_millis(1300));
    let after: Vec<SocketAddr> = clients.iter().map(|c| syn(c, 20002)).collect();
    let moved = after.iter().zip(&chosen).filter(|(a, b)| a != b).count();
    assert!(moved > 0, "no client was re-balanced after the timeout");
    // The IPv6 path keys by the source address too.
    let fe6 = Frontend::new(
        "2001:db8:96::40".parse::<IpAddr>().expect("ip"),
        80,
        Proto::Udp,
    );
    let mut e = entry(
        fe6,
        &[
            ("[2001:db8:2::2]:53", LOCAL),
            ("[2001:db8:2::3]:53", LOCAL),
            ("[2001:db8:2::4]:53", LOCAL),
        ],
        svc_flags::AFFINITY,
    );
    e.affinity_timeout = 10800;
    bed.writer.upsert(&e).expect("upsert");
    let dgram = |port: u16| {
        let pkt = Pkt::udp(&format!("[2001:db8::7]:{port}"), "[2001:db8:96::40]:80");
        bed.run(TC_INGRESS, &pkt).1.dst
    };
    let first = dgram(5000);
    for port in 5001..5020 {
        assert_eq!(dgram(port), first);
    }
}

#[test]
fn a_udp_flow_whose_backend_is_gone_is_balanced_afresh_tcp_is_not() {
    let mut bed = Bed::new();
    let dns = Frontend::new(Ipv4Addr::new(10, 96, 0, 50), 53, Proto::Udp);
    let web = Frontend::new(Ipv4Addr::new(10, 96, 0, 50), 80, Proto::Tcp);
    bed.writer
        .upsert(&entry(dns, &[("10.1.1.2:5353", LOCAL)], 0))
        .expect("upsert");
    bed.writer
        .upsert(&entry(web, &[("10.1.1.2:8080", LOCAL)], 0))
        .expect("upsert");
    let q = Pkt::udp("198.51.100.7:5000", "10.96.0.50:53");
    let syn = Pkt::tcp("198.51.100.7:40000", "10.96.0.50:80", SYN);
    assert_eq!(bed.run(TC_INGRESS, &q).1.dst, sa("10.1.1.2:5353"));
    assert_eq!(bed.run(TC_INGRESS, &syn).1.dst, sa("10.1.1.2:8080"));
    // Its second datagram finds the backend and records the generation it found it at:
    // later datagrams skip the backend lookup until backends are deleted.
    assert_eq!(bed.run(TC_INGRESS, &q).1.dst, sa("10.1.1.2:5353"));
    let gen = bed.writer.store().backend_gen().expect("BACKEND_GEN");
    assert_ne!(gen, 0, "opening the maps read-write bumps the generation");
    assert_eq!(
        udp_entry_gen(&bed, 5000),
        gen,
        "the flow's entry records the generation its backend was found at"
    );
    // Both endpoints replaced (the old pod is gone from the maps).
    bed.writer
        .upsert(&entry(dns, &[("10.1.1.9:5353", LOCAL)], 0))
        .expect("upsert");
    bed.writer
        .upsert(&entry(web, &[("10.1.1.9:8080", LOCAL)], 0))
        .expect("upsert");
    let after = bed.writer.store().backend_gen().expect("BACKEND_GEN");
    assert_ne!(after, gen, "deleting the old backends bumps the generation");
    // The same UDP flow moves to the live backend, and its replies are restored.
    assert_eq!(bed.run(TC_INGRESS, &q).1.dst, sa("10.1.1.9:5353"));
    let reply = Pkt::udp("10.1.1.9:5353", "198.51.100.7:5000");
    assert_eq!(bed.run(TC_EGRESS, &reply).1.src, sa("10.96.0.50:53"));
    // The TCP flow stays where it was (a removed endpoint may still be draining).
    let ack = Pkt::tcp("198.51.100.7:40000", "10.96.0.50:80", ACK);
    assert_eq!(bed.run(TC_INGRESS, &ack).1.dst, sa("10.1.1.2:8080"));
    // The same through batched syncs: two backends deleted in one batch call.
    bed.writer.set_batch_threshold(1);
    let sync = |bed: &mut Bed, dns_backends: &[(&str, u8)]| {
        let report = bed.writer.sync([
            entry(dns, dns_backends, 0),
            entry(web, &[("10.1.1.9:8080", LOCAL)], 0),
        ]);
        assert!(report.errors.is_empty(), "{report:?}");
        bed.writer.take_write_counts()
    };
    sync(
        &mut bed,
        &[("10.1.1.11:5353", LOCAL), ("10.1.1.12:5353", LOCAL)],
    );
    let on = bed.run(TC_INGRESS, &q).1.dst;
    assert!(
        [sa("10.1.1.11:5353"), sa("10.1.1.12:5353")].contains(&on),
        "{on}"
    );
    assert_eq!(bed.run(TC_INGRESS, &q).1.dst, on);
    let gen = bed.writer.store().backend_gen().expect("BACKEND_GEN");
    assert_eq!(
        udp_entry_gen(&bed, 5000),
        gen,
        "checked at the current generation"
    );
    let counts = sync(
        &mut bed,
        &[("10.1.1.13:5353", LOCAL), ("10.1.1.14:5353", LOCAL)],
    );
    // Two backends written, two deleted: batch calls; the frontend's entry (its count
    // and both slots) is a group of one, written alone.
    assert!(
        counts.batch_calls >= 2 && counts.fallbacks == 0 && counts.single == 1,
        "the sync went through the batch calls: {counts:?}"
    );
    let moved = bed.run(TC_INGRESS, &q).1.dst;
    assert!(
        [sa("10.1.1.13:5353"), sa("10.1.1.14:5353")].contains(&moved),
        "the flow left its deleted backend: {moved}"
    );
}

/// The backend maps are arrays indexed by id: a freed id's entry (the zero entry the
/// writer writes, arrays cannot delete) is no backend, exactly as a missing hash entry
/// was. A slot still naming a freed id (not something the writer's order leaves, forced
/// here) sends no packet to the endpoint that id held, nor to the zero address: a new
/// flow is counted `backend_missing` and passed untranslated, and an existing UDP flow
/// leaves the endpoint; both families.
#[test]
fn a_freed_backend_id_is_no_backend_to_the_datapath() {
    use proxy_user::{model::Family, store::Op, MapStore as _};
    let mut bed = Bed::new();
    for (vip, pod, client, family) in [
        ("10.96.0.60:53", "10.1.1.2:5353", "198.51.100.7", Family::V4),
        (
            "[2001:db8:96::60]:53",
            "[2001:db8:2::2]:5353",
            "2001:db8::7",
            Family::V6,
        ),
    ] {
        let vip_sa = sa(vip);
        let fe = Frontend::new(vip_sa.ip(), 53, Proto::Udp);
        bed.writer
            .upsert(&entry(fe, &[(pod, LOCAL)], 0))
            .expect("upsert");
        let from = |port: u16| SocketAddr::new(client.parse().expect("ip"), port);
        let q = |port: u16| Pkt::udp(&from(port).to_string(), vip);
        assert_eq!(bed.run(TC_INGRESS, &q(5000)).1.dst, sa(pod));
        assert_eq!(bed.run(TC_INGRESS, &q(5000)).1.dst, sa(pod));
        let dump = bed.writer.store().dump().expect("dump");
        let id = *dump.slots.get(&(fe, 1)).expect("slot 1");
        // The id freed under its slot (the zero entry written), as the store frees one.
        bed.writer
            .store_mut()
            .apply(&Op::DelBackend { id, family })
            .expect("free the id");
        assert!(
            !bed.writer
                .store()
                .dump()
                .expect("dump")
                .backends
                .contains_key(&id),
            "a freed id reads back as absent"
        );
        let missing = |bed: &Bed| {
            bed.writer
                .store()
                .stats()
                .expect("stats")
                .into_iter()
                .find(|(r, _)| *r == Reason::BackendMissing)
                .map_or(0, |(_, n)| n)
        };
        let before = missing(&bed);
        let (verdict, out) = bed.run(TC_INGRESS, &q(6000));
        assert_eq!(
            (verdict, out.dst),
            (TC_ACT_OK, vip_sa),
            "a new flow: no backend"
        );
        assert!(missing(&bed) > before, "counted backend_missing");
        let (_, out) = bed.run(TC_INGRESS, &q(5000));
        assert_ne!(out.dst, sa(pod), "the existing flow left the freed backend");
        assert!(!out.dst.ip().is_unspecified(), "{}", out.dst);
    }
}

/// The backend generation kept in the original conntrack entry of the UDP flow from
/// client port `sport` (`ct_flags::GEN_SHIFT`).
fn udp_entry_gen(bed: &Bed, sport: u16) -> u32 {
    let ct: aya::maps::HashMap<_, Ct4Key, Ct4Value> =
        aya::maps::HashMap::try_from(bed.ebpf.map(map_names::CT4).expect("CT4")).expect("map");
    let key = ct
        .keys()
        .map(|k| k.expect("key"))
        .find(|k| k.proto == proxy_common::proto::UDP && k.dir == 0 && k.sport == sport.to_be())
        .expect("the flow's original entry");
    ct.get(&key, 0).expect("entry").flags >> proxy_common::ct_flags::GEN_SHIFT
}

#[test]
fn icmp_port_unreachable_is_rate_limited() {
    let mut bed = Bed::new();
    let udp = Frontend::new(Ipv4Addr::new(10, 96, 0, 60), 53, Proto::Udp);
    bed.writer.upsert(&entry(udp, &[], 0)).expect("upsert");
    let frame = Pkt::udp("198.51.100.7:5000", "10.96.0.60:53").build();
    // One CPU, so one bucket: the bound below is exact (the thread's CPUs are restored
    // at the end).
    // SAFETY: sched_{get,set}affinity/sched_getcpu on this thread with sets we own.
    let before = unsafe {
        let mut all: libc::cpu_set_t = std::mem::zeroed();
        libc::sched_getaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), &mut all);
        all
    };
    // SAFETY: as above.
    unsafe {
        let mut set: libc::cpu_set_t = std::mem::zeroed();
        libc::CPU_SET(libc::sched_getcpu().max(0) as usize, &mut set);
        assert_eq!(
            libc::sched_setaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), &set),
            0,
            "pinning the test thread"
        );
    }
    let n = 500u64;
    let start = std::time::Instant::now();
    let mut answered = 0;
    for _ in 0..n {
        match bed.run_raw(TC_INGRESS, &frame).0 {
            TC_ACT_REDIRECT => answered += 1,
            verdict => assert_eq!(verdict, TC_ACT_SHOT),
        }
    }
    let elapsed_ms = start.elapsed().as_millis() as u64;
    // SAFETY: restoring this thread's own affinity.
    unsafe { libc::sched_setaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), &before) };
    // A burst of 50, then 1 per millisecond: without the limit all 500 would be
    // answered, which this bound refuses unless the loop took over 449 ms.
    assert!(answered >= 50, "{answered} answered");
    assert!(
        answered <= 50 + elapsed_ms + 1,
        "{answered} answered in {elapsed_ms} ms"
    );
    let limited = bed
        .writer
        .store()
        .stats()
        .expect("stats")
        .into_iter()
        .find(|(r, _)| *r == proxy_common::Reason::TcRejectLimited)
        .map(|(_, v)| v)
        .expect("counter");
    assert_eq!(limited, n - answered, "every refusal is counted");
}

/// The TC path's SNAT source ports: the kernel's default ephemeral range.
const SNAT_PORTS: std::ops::Range<u16> = 32768..61000;

/// `CLOCK_MONOTONIC` in nanoseconds: the clock of `bpf_ktime_get_ns`, so of `last_seen`.
fn monotonic_ns() -> u64 {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: a valid timespec to fill.
    assert_eq!(
        unsafe { libc::clock_gettime(libc::CLOCK_MONOTONIC, &mut ts) },
        0
    );
    ts.tv_sec as u64 * 1_000_000_000 + ts.tv_nsec as u64
}

impl Bed {
    /// Makes every conntrack entry of `proto` (of direction `dir` if given) look idle
    /// since before its timeout, from user space, as time would: the datapath's own
    /// expiry check then applies.
    fn expire_ct4(&mut self, proto: u8, dir: Option<u8>) -> usize {
        let idle =
            proxy_common::ct_timeouts::UDP.max(proxy_common::ct_timeouts::TCP_SYN) + 5_000_000_000;
        let now = monotonic_ns();
        assert!(
            now > idle,
            "the machine has been up for less than a timeout"
        );
        let mut ct: aya::maps::HashMap<_, Ct4Key, Ct4Value> =
            aya::maps::HashMap::try_from(self.ebpf.map_mut(map_names::CT4).expect("CT4"))
                .expect("map");
        let keys: Vec<Ct4Key> = ct
            .keys()
            .map(|k| k.expect("key"))
            .filter(|k| k.proto == proto && dir.is_none_or(|d| k.dir == d))
            .collect();
        for k in &keys {
            let mut v = ct.get(k, 0).expect("entry");
            v.last_seen = now - idle;
            ct.insert(k, v, 0).expect("rewrite last_seen");
        }
        keys.len()
    }

    /// Opens one flow per client port in `ports` from `client` to `frontend` (NodePort,
    /// remote backend `backend`): the SNAT ports given, and how many flows were lost
    /// (dropped, or not source-NATed into the range).
    fn open_snat_flows(
        &self,
        proto: u8,
        client: &str,
        ports: std::ops::Range<u16>,
        frontend: &str,
        backend: SocketAddr,
    ) -> (std::collections::BTreeSet<u16>, usize) {
        let mut got = std::collections::BTreeSet::new();
        let mut lost = 0;
        for port in ports {
            let src = format!("{client}:{port}");
            let pkt = if proto == TCP {
                Pkt::tcp(&src, frontend, SYN)
            } else {
                Pkt::udp(&src, frontend)
            };
            let (verdict, out) = self.run_raw(TC_INGRESS, &pkt.build());
            if verdict != TC_ACT_OK && verdict != TC_ACT_REDIRECT {
                lost += 1;
                continue;
            }
            let out = Pkt::parse(&out);
            if out.dst != backend
                || out.src.ip() != "192.0.2.1".parse::<IpAddr>().expect("ip")
                || !SNAT_PORTS.contains(&out.src.port())
            {
                lost += 1;
                continue;
            }
            got.insert(out.src.port());
        }
        (got, lost)
    }
}

/// Issue 11 item 1: SNAT to a remote backend never refuses a new flow while a port of the
/// range is free, reclaims the ports of expired flows, and refuses (counted) only when
/// every port is held by a live flow. Per protocol: round 1 opens as many flows as the
/// range has ports (28,232) to one backend address:port, all must succeed with distinct
/// ports; one more is refused and counted; then round 1's entries are made idle past
/// their timeout and round 2 opens 28,232 new flows, which must all succeed again.
#[test]
fn snat_uses_every_free_port_reclaims_expired_flows_and_refuses_only_a_full_range() {
    let mut bed = Bed::with_conntrack(1 << 18);
    let udp = Frontend::new(Ipv4Addr::UNSPECIFIED, 30053, Proto::Udp);
    let tcp = Frontend::new(Ipv4Addr::UNSPECIFIED, 30080, Proto::Tcp);
    bed.writer
        .upsert(&entry(udp, &[("10.2.1.2:5353", 0)], svc_flags::NODE_PORT))
        .expect("upsert");
    bed.writer
        .upsert(&entry(tcp, &[("10.2.1.2:8080", 0)], svc_flags::NODE_PORT))
        .expect("upsert");
    let span = SNAT_PORTS.end - SNAT_PORTS.start;
    let client_ports = 1024..1024 + span;
    let mut figures = Vec::new();
    for (proto, frontend, backend) in [
        (UDP, "192.0.2.1:30053", sa("10.2.1.2:5353")),
        (TCP, "192.0.2.1:30080", sa("10.2.1.2:8080")),
    ] {
        let name = if proto == TCP { "TCP" } else { "UDP" };
        let failed_before = bed.counter(proxy_common::Reason::TcSnatFailed);
        let (ports1, lost1) = bed.open_snat_flows(
            proto,
            "198.51.100.7",
            client_ports.clone(),
            frontend,
            backend,
        );
        // The range is full now: one more flow is refused, and counted.
        let (_, refused) = bed.open_snat_flows(proto, "198.51.100.9", 1..2, frontend, backend);
        let failed_full = bed.counter(proxy_common::Reason::TcSnatFailed) - failed_before;
        let expired = bed.expire_ct4(proto, None);
        let (ports2, lost2) = bed.open_snat_flows(
            proto,
            "198.51.100.8",
            client_ports.clone(),
            frontend,
            backend,
        );
        figures.push(format!(
            "{name}: round 1 {} flows, {lost1} lost, {} ports; full range: {refused} refused, \
             tc_snat_failed +{failed_full}; {expired} entries expired; round 2 {} flows, \
             {lost2} lost, {} ports",
            client_ports.len(),
            ports1.len(),
            client_ports.len(),
            ports2.len(),
        ));
        eprintln!("{}", figures.last().expect("figure"));
        assert_eq!((lost1, ports1.len()), (0, usize::from(span)), "{figures:?}");
        assert_eq!((refused, failed_full), (1, 1), "{figures:?}");
        assert_eq!((lost2, ports2.len()), (0, usize::from(span)), "{figures:?}");
        // A reclaimed port now belongs to its new flow: the backend's reply to it is
        // restored to round 2's client.
        let port = *ports2.iter().next().expect("a port");
        let reply_to = format!("192.0.2.1:{port}");
        let reply = if proto == TCP {
            Pkt::tcp(&backend.to_string(), &reply_to, SYN | ACK)
        } else {
            Pkt::udp(&backend.to_string(), &reply_to)
        };
        let (_, out) = bed.run(TC_INGRESS, &reply);
        assert_eq!(out.src, sa(frontend), "{name}: reply from the frontend");
        assert_eq!(
            out.dst.ip(),
            sa("198.51.100.8:1").ip(),
            "{name}: to round 2's client"
        );
        // A flow whose backend has not answered for a while but whose client still
        // sends keeps its port: with only the reply entries idle, the range is still full.
        bed.expire_ct4(proto, Some(1));
        let failed = bed.counter(proxy_common::Reason::TcSnatFailed);
        let (_, refused) = bed.open_snat_flows(proto, "198.51.100.9", 2..3, frontend, backend);
        assert_eq!(refused, 1, "{name}: a port of a live flow was taken");
        assert_eq!(
            bed.counter(proxy_common::Reason::TcSnatFailed),
            failed + 1,
            "{name}"
        );
    }
}

/// Issue 13: a failure of the TC worker is an outcome, counted and dropped, not a packet
/// passed on half-done and uncounted. A SYN to a frontend cut short inside its TCP header
/// (ports and flags present, checksum missing) starts a flow whose rewrite the checksum
/// helper refuses: dropped and counted as `tc_rewrite_failed`.
#[test]
fn a_rewrite_the_kernel_refuses_is_counted_and_dropped() {
    let mut bed = Bed::new();
    let fe = Frontend::new(Ipv4Addr::new(10, 96, 0, 70), 80, Proto::Tcp);
    bed.writer
        .upsert(&entry(fe, &[("10.1.1.2:8080", LOCAL)], 0))
        .expect("upsert");
    let mut frame = Pkt::tcp("198.51.100.7:40000", "10.96.0.70:80", SYN).build();
    // Ethernet 14 + IPv4 20 + the first 14 bytes of TCP (up to the flags).
    frame.truncate(14 + 20 + 14);
    let before = bed.counter(proxy_common::Reason::TcRewriteFailed);
    let (verdict, _) = bed.run_raw(TC_INGRESS, &frame);
    assert_eq!(verdict, TC_ACT_SHOT, "a half-rewritten packet is dropped");
    assert_eq!(
        bed.counter(proxy_common::Reason::TcRewriteFailed),
        before + 1,
        "and counted"
    );
    // A whole packet of the same kind is translated.
    let (verdict, out) = bed.run(
        TC_INGRESS,
        &Pkt::tcp("198.51.100.7:40001", "10.96.0.70:80", SYN),
    );
    assert_eq!((verdict, out.dst), (TC_ACT_OK, sa("10.1.1.2:8080")));
}

/// The DSR option of an IPv4 frame (IHL 7, `[0x9a, 8, port, addr]` after the 20-byte
/// header), checking the 28-byte header's checksum and total length; returns the
/// frontend it names and the frame without it (IHL 5, length and checksum fixed), which
/// [`Pkt::parse`] then checks (the L4 checksum must be untouched by the option).
fn split_dsr_option(frame: &[u8]) -> (SocketAddr, Vec<u8>) {
    assert_eq!(frame[12..14], [0x08, 0x00], "IPv4");
    assert_eq!(
        frame[14], 0x47,
        "IHL 7: a 20-byte header and the 8-byte option"
    );
    let ip = &frame[14..42];
    assert_eq!(
        support::pkt::fold(support::pkt::sum16(ip)),
        0,
        "IPv4 header checksum over the option"
    );
    let tot = u16::from_be_bytes([ip[2], ip[3]]) as usize;
    assert_eq!(tot, frame.len() - 14, "total length counts the option");
    assert_eq!(ip[20..22], [0x9a, 8], "option type and length");
    let port = u16::from_be_bytes([ip[22], ip[23]]);
    let addr = Ipv4Addr::new(ip[24], ip[25], ip[26], ip[27]);
    let mut plain = frame[..34].to_vec();
    plain.extend(&frame[42..]);
    plain[14] = 0x45;
    plain[16..18].copy_from_slice(&((tot - 8) as u16).to_be_bytes());
    plain[24..26].copy_from_slice(&[0, 0]);
    let c = support::pkt::fold(support::pkt::sum16(&plain[14..34]));
    plain[24..26].copy_from_slice(&c.to_be_bytes());
    (SocketAddr::new(addr.into(), port), plain)
}

/// The IPv6 DSR option: a Destination Options header (next header 60) of 24 bytes after
/// the 40-byte header, `[next, 2, 0x1b, 20, frontend address (16), port (2), 0, 0]`;
/// returns the frontend and the frame without it (next header and payload length back).
fn split_dsr_option6(frame: &[u8]) -> (SocketAddr, Vec<u8>) {
    assert_eq!(frame[12..14], [0x86, 0xdd], "IPv6");
    assert_eq!(frame[20], 60, "next header: destination options");
    let payload = u16::from_be_bytes([frame[18], frame[19]]) as usize;
    assert_eq!(
        payload,
        frame.len() - 54,
        "payload length counts the header"
    );
    let ext = &frame[54..78];
    assert_eq!(
        ext[1..4],
        [2, 0x1b, 20],
        "header length, option type and length"
    );
    assert_eq!(ext[22..24], [0, 0]);
    let addr: [u8; 16] = ext[4..20].try_into().expect("16");
    let port = u16::from_be_bytes([ext[20], ext[21]]);
    let mut plain = frame[..54].to_vec();
    plain.extend(&frame[78..]);
    plain[20] = ext[0];
    plain[18..20].copy_from_slice(&((payload - 24) as u16).to_be_bytes());
    (
        SocketAddr::new(std::net::Ipv6Addr::from(addr).into(), port),
        plain,
    )
}

/// The IPIP outer header (protocol 4) of an IPv4 DSR frame from the first node: version
/// 4, IHL 5, TTL 64, not fragmented, its checksum and total length right; returns its
/// source and destination and the inner frame (the Ethernet header kept).
fn split_ipip(frame: &[u8]) -> (Ipv4Addr, Ipv4Addr, Vec<u8>) {
    assert_eq!(frame[12..14], [0x08, 0x00], "IPv4");
    let ip = &frame[14..34];
    assert_eq!(ip[0], 0x45, "outer header: IPv4, IHL 5");
    assert_eq!(ip[9], 4, "outer protocol: IPIP");
    assert_eq!(ip[8], 64, "outer TTL");
    assert_eq!(
        u16::from_be_bytes([ip[6], ip[7]]) & 0x3fff,
        0,
        "not fragmented"
    );
    assert_eq!(
        support::pkt::fold(support::pkt::sum16(ip)),
        0,
        "outer header checksum"
    );
    assert_eq!(
        u16::from_be_bytes([ip[2], ip[3]]) as usize,
        frame.len() - 14,
        "outer total length"
    );
    let src = Ipv4Addr::new(ip[12], ip[13], ip[14], ip[15]);
    let dst = Ipv4Addr::new(ip[16], ip[17], ip[18], ip[19]);
    let mut inner = frame[..14].to_vec();
    inner.extend(&frame[34..]);
    (src, dst, inner)
}

/// `inner` (a frame) wrapped in an IPIP outer header from `src` to `dst`.
fn ipip(inner: &[u8], src: Ipv4Addr, dst: Ipv4Addr) -> Vec<u8> {
    let mut h = vec![0x45, 0];
    h.extend(((inner.len() - 14 + 20) as u16).to_be_bytes());
    h.extend([0, 0, 0x40, 0, 64, 4, 0, 0]);
    h.extend(src.octets());
    h.extend(dst.octets());
    let c = support::pkt::fold(support::pkt::sum16(&h));
    h[10..12].copy_from_slice(&c.to_be_bytes());
    let mut f = inner[..14].to_vec();
    f.extend(h);
    f.extend(&inner[14..]);
    f
}

/// The IPv6-in-IPv6 outer header (next header 41) of an IPv6 DSR frame from the first
/// node: version 6, hop limit 64, its payload length right; returns its source and
/// destination and the inner frame (the Ethernet header kept).
fn split_ip6ip6(frame: &[u8]) -> (Ipv6Addr, Ipv6Addr, Vec<u8>) {
    assert_eq!(frame[12..14], [0x86, 0xdd], "IPv6");
    let ip = &frame[14..54];
    assert_eq!(ip[0] >> 4, 6, "outer header: IPv6");
    assert_eq!(ip[6], 41, "outer next header: IPv6");
    assert_eq!(ip[7], 64, "outer hop limit");
    assert_eq!(
        u16::from_be_bytes([ip[4], ip[5]]) as usize,
        frame.len() - 54,
        "outer payload length"
    );
    assert_eq!(
        frame[54..58],
        ip[0..4],
        "traffic class and flow label copied"
    );
    let src = Ipv6Addr::from(<[u8; 16]>::try_from(&ip[8..24]).expect("16"));
    let dst = Ipv6Addr::from(<[u8; 16]>::try_from(&ip[24..40]).expect("16"));
    let mut inner = frame[..14].to_vec();
    inner.extend(&frame[54..]);
    (src, dst, inner)
}

/// `inner` (an IPv6 frame) wrapped in an IPv6-in-IPv6 outer header from `src` to `dst`.
fn ip6ip6(inner: &[u8], src: Ipv6Addr, dst: Ipv6Addr) -> Vec<u8> {
    let mut f = inner[..14].to_vec();
    f.extend([0x60, 0, 0, 0]);
    f.extend(((inner.len() - 14) as u16).to_be_bytes());
    f.extend([41, 64]);
    f.extend(src.octets());
    f.extend(dst.octets());
    f.extend(&inner[14..]);
    f
}

impl Bed {
    fn forwarding_mode(&self, mode: proxy_user::ForwardingMode) {
        proxy_user::fwd::set(&self.pins.dir(), mode).expect("FWD_MODE");
        assert_eq!(
            proxy_user::fwd::get(&self.pins.dir()).expect("read"),
            Some(mode)
        );
    }

    /// `DSR_TRUSTED4/6` as the agent writes them: these node addresses and prefixes.
    fn dsr_trust(&self, nodes: &[&str], cidrs: &[(&str, u8)]) {
        let nodes: Vec<IpAddr> = nodes.iter().map(|a| a.parse().expect("ip")).collect();
        let cidrs: Vec<(IpAddr, u8)> = cidrs
            .iter()
            .map(|(a, l)| (a.parse().expect("ip"), *l))
            .collect();
        let set = proxy_user::dsr_trust::trusted_prefixes(&nodes, &cidrs);
        proxy_user::dsr_trust::write(&self.pins.dir(), &set).expect("DSR_TRUSTED");
    }

    /// The NodePorts of the DSR tests: TCP 30080 and UDP 30081 (IPv4), TCP 30080 (IPv6),
    /// to 10.2.1.2:8080 / [2001:db8:2::2]:8080.
    fn dsr_node_ports(&mut self) {
        let np = Frontend::new(Ipv4Addr::UNSPECIFIED, 30080, Proto::Tcp);
        let np_udp = Frontend::new(Ipv4Addr::UNSPECIFIED, 30081, Proto::Udp);
        let np6 = Frontend::new("::".parse::<IpAddr>().expect("ip"), 30080, Proto::Tcp);
        for (fe, be) in [
            (np, "10.2.1.2:8080"),
            (np_udp, "10.2.1.2:8080"),
            (np6, "[2001:db8:2::2]:8080"),
        ] {
            self.writer
                .upsert(&entry(fe, &[(be, 0)], svc_flags::NODE_PORT))
                .expect("upsert");
        }
    }
}

/// An IPv4 frame with the DSR option whose frontend address is replaced by `front`
/// (the header checksum fixed).
fn with_dsr_front4(frame: &[u8], front: Ipv4Addr) -> Vec<u8> {
    let mut f = frame.to_vec();
    f[38..42].copy_from_slice(&front.octets());
    f[24..26].copy_from_slice(&[0, 0]);
    let ihl = usize::from(f[14] & 0xf) * 4;
    let mut sum: u32 = f[14..14 + ihl]
        .chunks(2)
        .map(|w| u32::from(u16::from_be_bytes([w[0], w[1]])))
        .sum();
    while sum > 0xffff {
        sum = (sum & 0xffff) + (sum >> 16);
    }
    f[24..26].copy_from_slice(&(!(sum as u16)).to_be_bytes());
    f
}

/// An IPv6 frame with the DSR destination option whose frontend address is `front`.
fn with_dsr_front6(frame: &[u8], front: std::net::Ipv6Addr) -> Vec<u8> {
    let mut f = frame.to_vec();
    f[58..74].copy_from_slice(&front.octets());
    f
}

/// Issue 22 item 10: the backend's node honours a DSR option only inside the IPIP (IPv6-in-IPv6)
/// outer header of a cluster node (outer source in `DSR_TRUSTED4`: the Node objects'
/// addresses, `--dsr-trusted-cidrs`), and only when it names a frontend a client could have
/// sent to: a NodePort on a cluster node's address or a frontend of its own maps.
/// Otherwise the packet is dropped (an outer source that is no node's, a forged frontend,
/// a node address on a port that is no NodePort: no reply entry, the pod's reply keeps
/// its own source) or, without an outer header, goes on as it came with the option not
/// honoured; `tc_dsr_untrusted` counts each. IPv6 the same with IPv6-in-IPv6 and the
/// destination option (`DSR_TRUSTED6`).
#[test]
fn dsr_option_is_honoured_only_from_a_cluster_node_for_a_frontend_on_one() {
    use proxy_common::Reason;
    use proxy_user::ForwardingMode;
    let mut first = Bed::new();
    first.forwarding_mode(ForwardingMode::Dsr);
    first.dsr_node_ports();
    let mut backend_node = Bed::new();
    backend_node.forwarding_mode(ForwardingMode::Dsr);
    backend_node.dsr_node_ports();
    // The first node (192.0.2.1, 2001:db8:1::1) is a cluster node.
    backend_node.dsr_trust(&["192.0.2.1", "2001:db8:1::1", "192.0.2.50"], &[]);
    let node = Ipv4Addr::new(192, 0, 2, 1);
    let pod = Ipv4Addr::new(10, 2, 1, 2);

    let syn = Pkt::tcp("198.51.100.7:40000", "192.0.2.1:30080", SYN);
    let (_, encapsulated) = first.run_raw(TC_INGRESS, &syn.build());
    let (from, to, inner) = split_ipip(&encapsulated);
    assert_eq!((from, to), (node, pod), "outer: this node to the pod");
    let (front, plain) = split_dsr_option(&inner);
    assert_eq!(front, sa("192.0.2.1:30080"));
    let reply = Pkt::tcp("10.2.1.2:8080", "198.51.100.7:40000", SYN | ACK);
    let not_honoured = |what: &str, frame: &[u8], verdict: u32, untrusted: u64| {
        let (v, out) = backend_node.run_raw(TC_INGRESS, frame);
        assert_eq!(v, verdict, "{what}");
        if verdict == TC_ACT_OK {
            assert_eq!(out, frame, "{what}: goes on as it came");
        }
        assert_eq!(
            backend_node.counter(Reason::TcDsrUntrusted),
            untrusted,
            "{what}"
        );
        let (_, out) = backend_node.run(TC_EGRESS, &reply);
        assert_eq!(out.src, reply.src, "{what}: no reply entry");
    };

    // Untrusted: the outer source is no cluster node's (the genuine inner packet).
    let stranger = ipip(&inner, Ipv4Addr::new(198, 51, 100, 66), pod);
    not_honoured(
        "an outer source that is no node's",
        &stranger,
        TC_ACT_SHOT,
        1,
    );
    // Untrusted: no outer header at all (the option as the first node used to send it).
    not_honoured("no outer header", &inner, TC_ACT_OK, 2);
    // Untrusted: a cluster node sent it, but the option names an address that is no
    // node's and no frontend.
    let forged = ipip(
        &with_dsr_front4(&inner, Ipv4Addr::new(203, 0, 113, 9)),
        node,
        pod,
    );
    assert_eq!(
        split_dsr_option(&split_ipip(&forged).2).0,
        sa("203.0.113.9:30080")
    );
    not_honoured("a forged frontend", &forged, TC_ACT_SHOT, 3);
    // Untrusted: a cluster node's address, but a port that is no NodePort.
    let mut other_port = inner.clone();
    other_port[36..38].copy_from_slice(&30999u16.to_be_bytes());
    let other_port = ipip(&with_dsr_front4(&other_port, node), node, pod);
    assert_eq!(
        split_dsr_option(&split_ipip(&other_port).2).0,
        sa("192.0.2.1:30999")
    );
    not_honoured("a port that is no NodePort", &other_port, TC_ACT_SHOT, 4);
    assert_eq!(backend_node.counter(Reason::TcDsrDecap), 0);
    assert_eq!(backend_node.counter(Reason::TcDsrReply), 0);

    // Trusted: the first node's own packet, another cluster node's address.
    let (verdict, out) = backend_node.run_raw(TC_INGRESS, &encapsulated);
    assert_eq!(verdict, TC_ACT_OK);
    assert_eq!(
        out, plain,
        "honoured: the inner packet without the option, IHL 5, checksum right"
    );
    assert_eq!(
        Pkt::parse(&out),
        Pkt {
            dst: sa("10.2.1.2:8080"),
            ..syn.clone()
        },
    );
    assert_eq!(backend_node.counter(Reason::TcDsrDecap), 1);
    let (_, out) = backend_node.run(TC_EGRESS, &reply);
    assert_eq!(
        out.src,
        sa("192.0.2.1:30080"),
        "the reply from the frontend"
    );
    let other_node = ipip(
        &with_dsr_front4(&inner, Ipv4Addr::new(192, 0, 2, 50)),
        node,
        pod,
    );
    backend_node.run_raw(TC_INGRESS, &other_node);
    assert_eq!(backend_node.counter(Reason::TcDsrDecap), 2);
    assert_eq!(backend_node.counter(Reason::TcDsrUntrusted), 4);

    // `--dsr-trusted-cidrs`: a prefix trusts its addresses (and the agent's next write
    // replaces the set: 192.0.2.50 is no longer trusted, neither as the option's
    // frontend nor as the outer source).
    backend_node.dsr_trust(&["192.0.2.1", "2001:db8:1::1"], &[("203.0.113.0", 24)]);
    let (_, out) = backend_node.run_raw(TC_INGRESS, &forged);
    assert_eq!(Pkt::parse(&out).dst, sa("10.2.1.2:8080"));
    assert_eq!(backend_node.counter(Reason::TcDsrDecap), 3);
    let (verdict, _) = backend_node.run_raw(TC_INGRESS, &other_node);
    assert_eq!(verdict, TC_ACT_SHOT);
    assert_eq!(backend_node.counter(Reason::TcDsrUntrusted), 5);
    let from_cidr = ipip(&inner, Ipv4Addr::new(203, 0, 113, 77), pod);
    let (verdict, _) = backend_node.run_raw(TC_INGRESS, &from_cidr);
    assert_eq!(
        verdict, TC_ACT_OK,
        "an outer source inside a trusted prefix"
    );
    assert_eq!(backend_node.counter(Reason::TcDsrDecap), 4);
    let from_old = ipip(&inner, Ipv4Addr::new(192, 0, 2, 50), pod);
    let (verdict, _) = backend_node.run_raw(TC_INGRESS, &from_old);
    assert_eq!(verdict, TC_ACT_SHOT, "an outer source no longer trusted");
    assert_eq!(backend_node.counter(Reason::TcDsrUntrusted), 6);
    // Any other IPIP packet (no DSR option inside) is not ours: untouched, not counted.
    let (_, other_ipip) = split_dsr_option(&inner);
    let other_ipip = ipip(&other_ipip, Ipv4Addr::new(198, 51, 100, 66), pod);
    let (verdict, out) = backend_node.run_raw(TC_INGRESS, &other_ipip);
    assert_eq!((verdict, out), (TC_ACT_OK, other_ipip.clone()));
    assert_eq!(backend_node.counter(Reason::TcDsrUntrusted), 6);

    // IPv6: the same with IPv6-in-IPv6 and the destination option.
    let node6: Ipv6Addr = "2001:db8:1::1".parse().expect("ip");
    let pod6: Ipv6Addr = "2001:db8:2::2".parse().expect("ip");
    let syn6 = Pkt::tcp("[2001:db8::7]:40000", "[2001:db8:1::1]:30080", SYN);
    let (_, out6) = first.run_raw(TC_INGRESS, &syn6.build());
    let (from, to, inner6) = split_ip6ip6(&out6);
    assert_eq!((from, to), (node6, pod6));
    let reply6 = Pkt::tcp("[2001:db8:2::2]:8080", "[2001:db8::7]:40000", SYN | ACK);
    let not_honoured6 = |what: &str, frame: &[u8], verdict: u32, untrusted: u64| {
        let (v, out) = backend_node.run_raw(TC_INGRESS, frame);
        assert_eq!(v, verdict, "{what}");
        if verdict == TC_ACT_OK {
            assert_eq!(out, frame, "{what}: goes on as it came");
        }
        assert_eq!(
            backend_node.counter(Reason::TcDsrUntrusted),
            untrusted,
            "{what}"
        );
        let (_, out) = backend_node.run(TC_EGRESS, &reply6);
        assert_eq!(out.src, reply6.src, "{what}: no reply entry");
    };
    let stranger6 = ip6ip6(&inner6, "2001:db8:66::66".parse().expect("ip"), pod6);
    not_honoured6(
        "IPv6: an outer source that is no node's",
        &stranger6,
        TC_ACT_SHOT,
        7,
    );
    not_honoured6("IPv6: no outer header", &inner6, TC_ACT_OK, 8);
    let forged6 = ip6ip6(
        &with_dsr_front6(&inner6, "2001:db8:99::9".parse().expect("ip")),
        node6,
        pod6,
    );
    assert_eq!(
        split_dsr_option6(&split_ip6ip6(&forged6).2).0,
        sa("[2001:db8:99::9]:30080")
    );
    not_honoured6("IPv6: a forged frontend", &forged6, TC_ACT_SHOT, 9);
    let (verdict, out) = backend_node.run_raw(TC_INGRESS, &out6);
    assert_eq!(verdict, TC_ACT_OK);
    assert_eq!(
        out,
        split_dsr_option6(&inner6).1,
        "honoured: the inner packet"
    );
    assert_eq!(Pkt::parse(&out).dst, sa("[2001:db8:2::2]:8080"));
    assert_eq!(backend_node.counter(Reason::TcDsrDecap), 5);
    assert_eq!(backend_node.counter(Reason::TcDsrUntrusted), 9);
    let (_, out) = backend_node.run(TC_EGRESS, &reply6);
    assert_eq!(out.src, sa("[2001:db8:1::1]:30080"));
}

/// Issue 15 item 3, the packets: on the first node (`--forwarding-mode dsr`) a new flow to
/// a backend on another node is DNATed only (the client stays the source, no SNAT) and its
/// SYN carries the frontend in the DSR option; later packets go without it, UDP datagrams
/// each with it. On the backend's node the option is read into a reply entry and removed;
/// the backend's reply then leaves with the frontend as source. IPv6 the same with a
/// Destination Options header. A node in SNAT mode ignores the option.
#[test]
fn dsr_option_added_on_the_first_node_and_removed_on_the_backends_node() {
    use proxy_common::Reason;
    use proxy_user::ForwardingMode;
    let mut first = Bed::new();
    first.forwarding_mode(ForwardingMode::Dsr);
    let np = Frontend::new(Ipv4Addr::UNSPECIFIED, 30080, Proto::Tcp);
    let np_udp = Frontend::new(Ipv4Addr::UNSPECIFIED, 30081, Proto::Udp);
    let np6 = Frontend::new("::".parse::<IpAddr>().expect("ip"), 30080, Proto::Tcp);
    for (fe, be) in [
        (np, "10.2.1.2:8080"),
        (np_udp, "10.2.1.2:8080"),
        (np6, "[2001:db8:2::2]:8080"),
    ] {
        first
            .writer
            .upsert(&entry(fe, &[(be, 0)], svc_flags::NODE_PORT))
            .expect("upsert");
    }

    // The SYN: DNAT, no SNAT, the option names the NodePort the client used, in an IPIP
    // outer header from this node (192.0.2.1) to the pod.
    let syn = Pkt::tcp("198.51.100.7:40000", "192.0.2.1:30080", SYN);
    let (verdict, out) = first.run_raw(TC_INGRESS, &syn.build());
    // Forwarded by FIB redirect, or handed to the stack when this test context has no
    // route.
    assert!(
        verdict == TC_ACT_OK || verdict == TC_ACT_REDIRECT,
        "{verdict}"
    );
    let (from, to, out) = split_ipip(&out);
    assert_eq!(
        (from, to),
        (Ipv4Addr::new(192, 0, 2, 1), Ipv4Addr::new(10, 2, 1, 2))
    );
    let (front, plain) = split_dsr_option(&out);
    assert_eq!(front, sa("192.0.2.1:30080"));
    assert_eq!(
        Pkt::parse(&plain),
        Pkt {
            dst: sa("10.2.1.2:8080"),
            ..syn.clone()
        }
    );
    assert_eq!(first.counter(Reason::TcDsrEncap), 1);
    assert_eq!(first.counter(Reason::TcNewFlow), 0);
    assert_eq!(first.counter(Reason::TcSnatFailed), 0);
    // A retransmitted SYN carries it again; the ACK after the handshake does not.
    let (_, again) = first.run_raw(TC_INGRESS, &syn.build());
    assert_eq!(
        split_dsr_option(&split_ipip(&again).2).0,
        sa("192.0.2.1:30080")
    );
    let ack = Pkt {
        flags: ACK,
        ..syn.clone()
    };
    let (verdict, out) = first.run(TC_INGRESS, &ack);
    assert_eq!(verdict, TC_ACT_OK);
    assert_eq!(
        out,
        Pkt {
            dst: sa("10.2.1.2:8080"),
            ..ack
        }
    );
    assert_eq!(first.counter(Reason::TcDsrEncap), 2, "both SYNs");
    assert_eq!(first.counter(Reason::TcFlow), 1, "the ACK");

    // UDP: every datagram carries the option.
    let q = Pkt::udp("198.51.100.7:5000", "192.0.2.1:30081");
    for n in 1..=2 {
        let (verdict, out) = first.run_raw(TC_INGRESS, &q.build());
        assert!(verdict == TC_ACT_OK || verdict == TC_ACT_REDIRECT);
        let (front, plain) = split_dsr_option(&split_ipip(&out).2);
        assert_eq!(front, sa("192.0.2.1:30081"));
        assert_eq!(
            Pkt::parse(&plain),
            Pkt {
                dst: sa("10.2.1.2:8080"),
                ..q.clone()
            },
            "datagram {n}"
        );
    }
    assert_eq!(first.counter(Reason::TcDsrEncap), 4);

    // IPv6: the same option in a Destination Options header.
    let syn6 = Pkt::tcp("[2001:db8::7]:40000", "[2001:db8:1::1]:30080", SYN);
    let (verdict, out6) = first.run_raw(TC_INGRESS, &syn6.build());
    assert!(verdict == TC_ACT_OK || verdict == TC_ACT_REDIRECT);
    let (from, to, inner6) = split_ip6ip6(&out6);
    assert_eq!(
        (from, to),
        (
            "2001:db8:1::1".parse().expect("ip"),
            "2001:db8:2::2".parse().expect("ip")
        ),
        "outer: this node to the pod"
    );
    let (front, plain) = split_dsr_option6(&inner6);
    assert_eq!(front, sa("[2001:db8:1::1]:30080"));
    assert_eq!(
        Pkt::parse(&plain),
        Pkt {
            dst: sa("[2001:db8:2::2]:8080"),
            ..syn6.clone()
        }
    );
    assert_eq!(first.counter(Reason::TcDsrEncap), 5);
    let plain6 = plain;

    // The backend's node, in DSR mode, with the same NodePorts and the first node among
    // the cluster's nodes: the option is read and removed.
    let mut backend_node = Bed::new();
    backend_node.forwarding_mode(ForwardingMode::Dsr);
    backend_node.dsr_node_ports();
    backend_node.dsr_trust(&["192.0.2.1", "2001:db8:1::1"], &[]);
    let (_, encapsulated) = first.run_raw(TC_INGRESS, &syn.build());
    let (verdict, out) = backend_node.run_raw(TC_INGRESS, &encapsulated);
    assert_eq!(verdict, TC_ACT_OK);
    assert_eq!(
        Pkt::parse(&out),
        Pkt {
            dst: sa("10.2.1.2:8080"),
            ..syn.clone()
        },
        "delivered without the option, the client as source"
    );
    assert_eq!(backend_node.counter(Reason::TcDsrDecap), 1);
    // The backend's reply leaves with the frontend as source, to the client.
    let reply = Pkt::tcp("10.2.1.2:8080", "198.51.100.7:40000", SYN | ACK);
    let (verdict, out) = backend_node.run(TC_EGRESS, &reply);
    assert_eq!(verdict, TC_ACT_OK);
    assert_eq!(
        out,
        Pkt {
            src: sa("192.0.2.1:30080"),
            ..reply.clone()
        }
    );
    assert_eq!(backend_node.counter(Reason::TcDsrReply), 1);
    assert_eq!(backend_node.counter(Reason::TcReply), 0);
    // UDP too.
    let (_, encapsulated) = first.run_raw(TC_INGRESS, &q.build());
    let (_, out) = backend_node.run_raw(TC_INGRESS, &encapsulated);
    assert_eq!(Pkt::parse(&out).dst, sa("10.2.1.2:8080"));
    let answer = Pkt::udp("10.2.1.2:8080", "198.51.100.7:5000");
    let (_, out) = backend_node.run(TC_EGRESS, &answer);
    assert_eq!(out.src, sa("192.0.2.1:30081"));
    assert_eq!(backend_node.counter(Reason::TcDsrDecap), 2);
    assert_eq!(backend_node.counter(Reason::TcDsrReply), 2);
    // IPv6 too.
    let (verdict, out) = backend_node.run_raw(TC_INGRESS, &out6);
    assert_eq!(verdict, TC_ACT_OK);
    assert_eq!(
        out, plain6,
        "delivered without the outer and the options header"
    );
    assert_eq!(
        Pkt::parse(&out),
        Pkt {
            dst: sa("[2001:db8:2::2]:8080"),
            ..syn6.clone()
        },
        "delivered without the header, the client as source"
    );
    let reply6 = Pkt::tcp("[2001:db8:2::2]:8080", "[2001:db8::7]:40000", SYN | ACK);
    let (_, out) = backend_node.run(TC_EGRESS, &reply6);
    assert_eq!(out.src, sa("[2001:db8:1::1]:30080"));
    assert_eq!(backend_node.counter(Reason::TcDsrDecap), 3);
    assert_eq!(backend_node.counter(Reason::TcDsrReply), 3);

    // A node in SNAT mode does not trust the option: the packet goes on as it came.
    let snat_node = Bed::new();
    let (verdict, out) = snat_node.run_raw(TC_INGRESS, &encapsulated);
    assert_eq!((verdict, out), (TC_ACT_OK, encapsulated));
    assert_eq!(snat_node.counter(Reason::TcDsrDecap), 0);
}

/// `--forwarding-mode hybrid`: DSR for TCP, SNAT for UDP; and `snat` (the default, an
/// empty `FWD_MODE`) adds no option.
#[test]
fn hybrid_mode_is_dsr_for_tcp_and_snat_for_udp() {
    use proxy_common::Reason;
    use proxy_user::ForwardingMode;
    let mut bed = Bed::new();
    for (port, proto) in [(30080, Proto::Tcp), (30081, Proto::Udp)] {
        let fe = Frontend::new(Ipv4Addr::UNSPECIFIED, port, proto);
        bed.writer
            .upsert(&entry(fe, &[("10.2.1.2:8080", 0)], svc_flags::NODE_PORT))
            .expect("upsert");
    }
    let node: IpAddr = "192.0.2.1".parse().expect("ip");
    // SNAT mode (nothing written yet): no option, source NAT.
    let (_, out) = bed.run(
        TC_INGRESS,
        &Pkt::tcp("198.51.100.7:40000", "192.0.2.1:30080", SYN),
    );
    assert_eq!(out.src.ip(), node);
    bed.forwarding_mode(ForwardingMode::Hybrid);
    let syn = Pkt::tcp("198.51.100.7:40001", "192.0.2.1:30080", SYN);
    let (_, out) = bed.run_raw(TC_INGRESS, &syn.build());
    let (front, plain) = split_dsr_option(&split_ipip(&out).2);
    assert_eq!(front, sa("192.0.2.1:30080"));
    assert_eq!(Pkt::parse(&plain).src, syn.src, "TCP: DSR, the client kept");
    let (_, out) = bed.run(
        TC_INGRESS,
        &Pkt::udp("198.51.100.7:5001", "192.0.2.1:30081"),
    );
    assert_eq!(out.src.ip(), node, "UDP: SNAT");
    assert_eq!(out.dst, sa("10.2.1.2:8080"));
    assert_eq!(bed.counter(Reason::TcDsrEncap), 1);
}

/// Service CIDRs known to the datapath (issue #24 item 5), at TC: with `SVC_CIDR4/6`
/// holding 10.96.0.0/16 and 2001:db8:96::/112 and the ClusterIPs in use, a new TCP/UDP
/// flow to a ClusterIP on a port no Service uses gets kube-proxy's REJECT answer (RST,
/// ICMP port unreachable; `svc_port_unused`), one to an unallocated address inside the
/// CIDRs is dropped (`svc_cidr_unallocated`), as kube-proxy's nftables mode does. The
/// node's, a pod's and outside addresses (and the address just past the CIDR) pass
/// untouched and count nothing (cilium#44430). Without the entries nothing is refused.
#[test]
fn a_service_cidr_miss_is_rejected_or_dropped_and_nothing_else_is_touched() {
    let mut bed = Bed::new();
    let fe = Frontend::new(Ipv4Addr::new(10, 96, 0, 10), 80, Proto::Tcp);
    bed.writer
        .upsert(&entry(fe, &[("10.1.1.2:8080", LOCAL)], 0))
        .expect("upsert");
    let fe6 = Frontend::new(
        "2001:db8:96::10".parse::<IpAddr>().expect("ip"),
        80,
        Proto::Tcp,
    );
    bed.writer
        .upsert(&entry(fe6, &[("[2001:db8:2::2]:8080", LOCAL)], 0))
        .expect("upsert");
    let unused_port = Pkt::tcp("198.51.100.7:40000", "10.96.0.10:81", SYN);
    let unallocated = Pkt::tcp("198.51.100.7:40001", "10.96.5.5:80", SYN);

    // No Service CIDR known: neither is refused (they are not ours).
    for p in [&unused_port, &unallocated] {
        let (verdict, out) = bed.run(TC_INGRESS, p);
        assert_eq!((verdict, out.src, out.dst), (TC_ACT_OK, p.src, p.dst));
    }

    let ip = |s: &str| s.parse::<IpAddr>().expect("ip");
    let want = proxy_user::svc_cidr::wanted(
        &[(ip("10.96.0.0"), 16), (ip("2001:db8:96::"), 112)],
        [&ip("10.96.0.10"), &ip("2001:db8:96::10")],
    );
    proxy_user::svc_cidr::write(&bed.pins.dir(), &want).expect("SVC_CIDR4/6");
    let (port0, cidr0) = (
        bed.counter(Reason::SvcPortUnused),
        bed.counter(Reason::SvcCidrUnallocated),
    );

    // The frontend itself is still served.
    let (verdict, out) = bed.run(
        TC_INGRESS,
        &Pkt::tcp("198.51.100.7:40002", "10.96.0.10:80", SYN),
    );
    assert_eq!((verdict, out.dst), (TC_ACT_OK, sa("10.1.1.2:8080")));

    // Another port of the ClusterIP: REJECT (RST|ACK back to the client, in place).
    for p in [
        unused_port.clone(),
        Pkt::tcp("[2001:db8::7]:40000", "[2001:db8:96::10]:81", SYN),
    ] {
        let (verdict, out) = bed.run(TC_INGRESS, &p);
        assert_eq!(verdict, TC_ACT_REDIRECT, "{}", p.dst);
        assert_eq!(
            (out.src, out.dst, out.flags),
            (p.dst, p.src, RST | ACK),
            "{}",
            p.dst
        );
    }
    // UDP to another port of the ClusterIP: ICMP port unreachable from it.
    let frame = Pkt::udp("198.51.100.7:5000", "10.96.0.10:53").build();
    let (verdict, out) = bed.run_raw(TC_INGRESS, &frame);
    assert_eq!(verdict, TC_ACT_REDIRECT);
    assert_eq!((out[34], out[35]), (3, 3), "ICMP port unreachable");
    assert_eq!(bed.counter(Reason::SvcPortUnused), port0 + 3);

    // An unallocated address inside the CIDRs: dropped, TCP and UDP, both families.
    for p in [
        unallocated.clone(),
        Pkt::udp("198.51.100.7:5001", "10.96.255.254:53"),
        Pkt::tcp("[2001:db8::7]:40001", "[2001:db8:96::99]:80", SYN),
    ] {
        let (verdict, _) = bed.run(TC_INGRESS, &p);
        assert_eq!(verdict, TC_ACT_SHOT, "{}", p.dst);
    }
    assert_eq!(bed.counter(Reason::SvcCidrUnallocated), cidr0 + 3);

    // Everything else passes untouched and is counted nowhere: the node (SSH), a pod, the
    // first address past the CIDR, an outside address, the node's IPv6 address.
    for p in [
        Pkt::tcp("198.51.100.7:40003", "192.0.2.1:22", SYN),
        Pkt::tcp("198.51.100.7:40004", "10.1.1.2:8080", SYN),
        Pkt::tcp("198.51.100.7:40005", "10.97.0.0:80", SYN),
        Pkt::udp("198.51.100.7:5002", "203.0.113.99:53"),
        Pkt::tcp("[2001:db8::7]:40002", "[2001:db8:1::1]:22", SYN),
        Pkt::tcp("[2001:db8::7]:40003", "[2001:db8:96::1:0]:80", SYN),
    ] {
        let (verdict, out) = bed.run(TC_INGRESS, &p);
        assert_eq!(
            (verdict, out.src, out.dst),
            (TC_ACT_OK, p.src, p.dst),
            "{}",
            p.dst
        );
    }
    assert_eq!(
        (
            bed.counter(Reason::SvcPortUnused),
            bed.counter(Reason::SvcCidrUnallocated)
        ),
        (port0 + 3, cidr0 + 3)
    );
}

/// `--metrics-per-service` in the datapath: with `COUNTERS_ON` off (a new datapath's
/// state) nothing is counted; on, a new flow counts one connection and one packet for its
/// frontend and its backend, each further packet of the client's direction one packet,
/// replies nothing; a service id and a backend id freed and given to another frontend
/// and backend start from zero (the store deletes their entries); off again deletes
/// every entry and counts nothing.
#[test]
fn per_service_counters_count_only_when_on_and_start_from_zero_for_a_reused_id() {
    use proxy_common::FlowCounts;
    use proxy_user::counters::{CounterKind, CounterMaps};
    let mut bed = Bed::new();
    let fe = Frontend::new(Ipv4Addr::new(10, 96, 0, 10), 80, Proto::Tcp);
    bed.writer
        .upsert(&entry(fe, &[("10.1.1.2:8080", LOCAL)], 0))
        .expect("upsert");
    let pins = proxy_user::pins::PinDir::new(&bed.pins.path);
    let mut counters = CounterMaps::open(&pins)
        .expect("open")
        .expect("the counter maps are pinned");
    let read = |c: &CounterMaps, kind| c.read(kind).expect("read");
    let flow =
        |sport: u16, flags: u8| Pkt::tcp(&format!("198.51.100.7:{sport}"), "10.96.0.10:80", flags);
    // Off: a new flow and a known one, nothing counted.
    assert!(!counters.is_on().expect("COUNTERS_ON"));
    assert_eq!(
        bed.run(TC_INGRESS, &flow(40000, SYN)).1.dst,
        sa("10.1.1.2:8080")
    );
    bed.run(TC_INGRESS, &flow(40000, ACK));
    assert!(read(&counters, CounterKind::Service).is_empty());
    assert!(read(&counters, CounterKind::Backend).is_empty());

    counters.set_on(true).expect("on");
    // A new flow (connection + packet), two more of its packets, one packet of the flow
    // from before, and a reply (not counted).
    assert_eq!(
        bed.run(TC_INGRESS, &flow(40001, SYN)).1.dst,
        sa("10.1.1.2:8080")
    );
    bed.run(TC_INGRESS, &flow(40001, ACK));
    bed.run(TC_INGRESS, &flow(40001, ACK));
    bed.run(TC_INGRESS, &flow(40000, ACK));
    let reply = Pkt::tcp("10.1.1.2:8080", "198.51.100.7:40001", ACK);
    assert_eq!(bed.run(TC_EGRESS, &reply).1.src, sa("10.96.0.10:80"));
    let d = bed.writer.expected_dump();
    let sid = d.frontends[&fe].service_id;
    let bid = *d.backends.keys().next().expect("one backend");
    let want = FlowCounts {
        conns: 1,
        packets: 4,
    };
    assert_eq!(read(&counters, CounterKind::Service), [(sid, want)]);
    assert_eq!(read(&counters, CounterKind::Backend), [(bid, want)]);

    // The frontend and its backend go; another frontend and backend take both ids.
    bed.writer.remove(&fe).expect("remove");
    let fe2 = Frontend::new(Ipv4Addr::new(10, 96, 0, 11), 80, Proto::Tcp);
    bed.writer
        .upsert(&entry(fe2, &[("10.1.1.3:8080", LOCAL)], 0))
        .expect("upsert");
    let d = bed.writer.expected_dump();
    assert_eq!(d.frontends[&fe2].service_id, sid, "the id is reused");
    assert_eq!(
        *d.backends.keys().next().expect("one"),
        bid,
        "the id is reused"
    );
    assert!(
        read(&counters, CounterKind::Service).is_empty(),
        "no counts carried over"
    );
    assert!(
        read(&counters, CounterKind::Backend).is_empty(),
        "no counts carried over"
    );
    let to_fe2 = Pkt::tcp("198.51.100.7:40002", "10.96.0.11:80", SYN);
    assert_eq!(bed.run(TC_INGRESS, &to_fe2).1.dst, sa("10.1.1.3:8080"));
    let one = FlowCounts {
        conns: 1,
        packets: 1,
    };
    assert_eq!(read(&counters, CounterKind::Service), [(sid, one)]);

    // Off again: every entry deleted, nothing counted.
    counters.set_on(false).expect("off");
    assert!(read(&counters, CounterKind::Service).is_empty());
    bed.run(
        TC_INGRESS,
        &Pkt::tcp("198.51.100.7:40003", "10.96.0.11:80", SYN),
    );
    assert!(read(&counters, CounterKind::Service).is_empty());
    assert!(read(&counters, CounterKind::Backend).is_empty());
}

/// Every entry of the pinned conntrack map `name` under `pins`.
fn ct_dump<K: aya::Pod + Eq + std::hash::Hash, V: aya::Pod>(
    pins: &std::path::Path,
    name: &str,
) -> std::collections::HashMap<K, V> {
    let data = aya::maps::MapData::from_pin(pins.join(name)).expect("pinned map");
    let map: aya::maps::HashMap<_, K, V> =
        aya::maps::HashMap::try_from(aya::maps::Map::LruHashMap(data)).expect("hash map");
    map.iter().map(|e| e.expect("entry")).collect()
}

/// The programs of a conntrack resize (the `CT_FALLBACK` global set, the running tables
/// pinned as `CT4_PREV`/`CT6_PREV` beside every other map shared, as `migrate` stages
/// them) write a new flow's entries into the table being replaced as well as into the
/// new one: while the hooks are swapped one by one, a hook still running an old program
/// translates the flow's reply and follows its next packet (same backend, same SNAT
/// port) instead of missing them (IPv4: a NodePort flow SNATed to a remote backend,
/// reply through ingress; IPv6: a local backend, reply through egress). Without that the
/// old program passes the reply untranslated (the client never sees its SYN-ACK). The
/// old programs, loaded without the fallback, write their own table only: the 1-entry
/// `CT4_PREV`/`CT6_PREV` beside it stay empty.
#[test]
fn a_resize_writes_new_flows_into_the_table_being_replaced_too() {
    use proxy_common::{Ct6Key, Ct6Value};
    let mut bed = Bed::new();
    let np = Frontend::new(Ipv4Addr::UNSPECIFIED, 30080, Proto::Tcp);
    bed.writer
        .upsert(&entry(np, &[("10.2.1.2:8080", 0)], svc_flags::NODE_PORT))
        .expect("upsert");
    let fe6 = Frontend::new(
        "2001:db8:96::10".parse::<IpAddr>().expect("ip"),
        80,
        Proto::Tcp,
    );
    bed.writer
        .upsert(&entry(fe6, &[("[2001:db8:2::2]:8080", LOCAL)], 0))
        .expect("upsert");
    // A flow of the old programs: in their table only.
    let before = Pkt::tcp("198.51.100.7:40001", "192.0.2.1:30080", SYN);
    assert_eq!(bed.run(TC_INGRESS, &before).1.dst, sa("10.2.1.2:8080"));
    let old = &bed.pins.path;
    assert_eq!(ct_dump::<Ct4Key, Ct4Value>(old, map_names::CT4).len(), 2);
    assert!(ct_dump::<Ct4Key, Ct4Value>(old, map_names::CT4_PREV).is_empty());
    assert!(ct_dump::<Ct6Key, Ct6Value>(old, map_names::CT6_PREV).is_empty());

    // The resize's staging: every map shared but conntrack, whose running tables are
    // the new programs' `CT*_PREV`.
    let staged = support::PinDir::new();
    std::fs::create_dir_all(&staged.path).expect("mkdir");
    let (from, to) = (bed.pins.dir(), staged.dir());
    let ct = [
        map_names::CT4,
        map_names::CT6,
        map_names::CT4_PREV,
        map_names::CT6_PREV,
    ];
    for e in std::fs::read_dir(old).expect("pins") {
        let e = e.expect("pin");
        let name = e.file_name().to_string_lossy().into_owned();
        if !e.file_type().expect("type").is_file() || ct.contains(&name.as_str()) {
            continue;
        }
        let fd = from
            .open_fd(&name, proxy_user::pins::Access::ReadWrite)
            .expect("open");
        to.pin_map(&name, std::os::fd::AsFd::as_fd(&fd))
            .expect("share");
    }
    for (prev, running) in [
        (map_names::CT4_PREV, map_names::CT4),
        (map_names::CT6_PREV, map_names::CT6),
    ] {
        let fd = from
            .open_fd(running, proxy_user::pins::Access::ReadWrite)
            .expect("open");
        to.pin_map(prev, std::os::fd::AsFd::as_fd(&fd))
            .expect("keep the running table");
    }
    let resize =
        support::progrun::load_tc_resizing(&to, 2 * proxy_user::loader::DEFAULT_CONNTRACK_FLOWS)
            .expect("the resize's programs load; the verifier accepts them");
    let run_new = |prog: &str, p: &Pkt| {
        let r = support::progrun::run_classifier(&resize, prog, &p.build(), 1).expect("run");
        (r.verdict, Pkt::parse(&r.out))
    };

    // IPv4: a new flow opened by a new program (ingress).
    let syn = Pkt::tcp("198.51.100.7:40000", "192.0.2.1:30080", SYN);
    let (verdict, out) = run_new(TC_INGRESS, &syn);
    assert!(
        verdict == TC_ACT_OK || verdict == TC_ACT_REDIRECT,
        "{verdict}"
    );
    assert_eq!(out.dst, sa("10.2.1.2:8080"));
    let snat = out.src;
    let new4 = ct_dump::<Ct4Key, Ct4Value>(&staged.path, map_names::CT4);
    let old4 = ct_dump::<Ct4Key, Ct4Value>(old, map_names::CT4);
    assert_eq!(new4.len(), 2, "the new flow's two entries: {new4:?}");
    for (k, v) in &new4 {
        assert_eq!(
            old4.get(k),
            Some(v),
            "written into the replaced table too: {k:?}"
        );
    }
    // Its reply through a hook still running an old program: both ends restored.
    let reply = Pkt::tcp("10.2.1.2:8080", &snat.to_string(), SYN | ACK);
    let (_, out) = bed.run(TC_INGRESS, &reply);
    assert_eq!(
        (out.src, out.dst),
        (sa("192.0.2.1:30080"), sa("198.51.100.7:40000")),
        "the reply of a new program's flow, on an old program's hook"
    );
    // Its next packet on an old program: the same backend and SNAT port.
    let ack = Pkt {
        flags: ACK,
        ..syn.clone()
    };
    let (_, out) = bed.run(TC_INGRESS, &ack);
    assert_eq!((out.src, out.dst), (snat, sa("10.2.1.2:8080")));

    // IPv6: a local backend; the reply leaves through an old program's egress.
    let syn6 = Pkt::tcp("[2001:db8::7]:40000", "[2001:db8:96::10]:80", SYN);
    let (verdict, out) = run_new(TC_INGRESS, &syn6);
    assert_eq!(verdict, TC_ACT_OK);
    assert_eq!(out.dst, sa("[2001:db8:2::2]:8080"));
    let new6 = ct_dump::<Ct6Key, Ct6Value>(&staged.path, map_names::CT6);
    let old6 = ct_dump::<Ct6Key, Ct6Value>(old, map_names::CT6);
    assert_eq!(new6.len(), 2, "{new6:?}");
    for (k, v) in &new6 {
        assert_eq!(
            old6.get(k),
            Some(v),
            "written into the replaced table too: {k:?}"
        );
    }
    let reply6 = Pkt::tcp("[2001:db8:2::2]:8080", "[2001:db8::7]:40000", SYN | ACK);
    let (_, out) = bed.run(TC_EGRESS, &reply6);
    assert_eq!(out.src, sa("[2001:db8:96::10]:80"));

    // The copy after the swap carries into the new tables the state only the old
    // programs saw (the replies: `SEEN_REPLY`, else the new tables' entries would keep
    // the SYN timeout); the entries the old programs made alone are copied.
    let seen = |f: u32| f & proxy_common::ct_flags::SEEN_REPLY != 0;
    let flow4 = ct_dump::<Ct4Key, Ct4Value>(&staged.path, map_names::CT4);
    assert!(flow4.values().all(|v| !seen(v.flags)), "{flow4:?}");
    let count = proxy_user::migrate::copy_map(
        &from,
        &to,
        map_names::CT4,
        proxy_user::migrate::Convert::Bytes,
        true,
    )
    .expect("copy CT4");
    assert_eq!((count.copied, count.merged), (2, 2), "{count:?}");
    let new4 = ct_dump::<Ct4Key, Ct4Value>(&staged.path, map_names::CT4);
    assert_eq!(new4.len(), 4);
    assert!(flow4.keys().all(|k| seen(new4[k].flags)), "{new4:?}");
    let count = proxy_user::migrate::copy_map(
        &from,
        &to,
        map_names::CT6,
        proxy_user::migrate::Convert::Bytes,
        true,
    )
    .expect("copy CT6");
    assert_eq!((count.copied, count.merged), (0, 2), "{count:?}");
    let new6 = ct_dump::<Ct6Key, Ct6Value>(&staged.path, map_names::CT6);
    assert!(new6.values().all(|v| seen(v.flags)), "{new6:?}");

    // The old programs never wrote their own 1-entry `CT*_PREV`.
    assert!(ct_dump::<Ct4Key, Ct4Value>(old, map_names::CT4_PREV).is_empty());
    assert!(ct_dump::<Ct6Key, Ct6Value>(old, map_names::CT6_PREV).is_empty());
}
