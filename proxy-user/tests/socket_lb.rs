//! Privileged integration tests of the socket-level load balancer: the real programs in
//! the real kernel, attached to a child cgroup holding this test process, real TCP/UDP
//! servers in pod namespaces, a client in its own namespace (see `support`).
//!
//! Needs root; fails (never skips) without it. Serialized by the fixture's lock.
//!
//! Over 600 lines: one suite (the socket hooks against real sockets). Each file under
//! `tests/` is a test binary of its own that links the whole crate, so a suite is split
//! into modules only when its scenarios stop sharing set-up (shared helpers live in
//! `tests/support/`).

mod support;

use std::{
    collections::BTreeMap,
    io,
    net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr, SocketAddrV6, TcpStream, UdpSocket},
    time::{Duration, Instant},
};

use proxy_common::Reason;
use proxy_user::{loader, BpfMaps, Frontend, MapStore, Proto, ServiceEntry, Writer};
use support::{attached_programs, tcp_ask, udp_ask, TestEnv, Topology, SOCK_ATTACH_TYPES};

const PORT: u16 = 8080;
const VIP4: Ipv4Addr = Ipv4Addr::new(10, 96, 0, 10);

fn vip6() -> Ipv6Addr {
    "fd00:96::10".parse().expect("v6")
}

fn pods_v4(n: usize) -> Vec<SocketAddr> {
    (1..=n)
        .map(|i| SocketAddr::new(IpAddr::V4(Topology::pod_v4(i)), PORT))
        .collect()
}

fn pods_v6(n: usize) -> Vec<SocketAddr> {
    (1..=n)
        .map(|i| SocketAddr::new(IpAddr::V6(Topology::pod_v6(i)), PORT))
        .collect()
}

fn install_service(env: &mut TestEnv, fe: Frontend, backends: Vec<SocketAddr>) {
    env.writer()
        .upsert(&ServiceEntry::new(fe, backends))
        .expect("upsert");
}

/// Connects `n` times to `addr` and counts the answers per pod.
fn spread(addr: SocketAddr, n: usize) -> BTreeMap<String, usize> {
    let mut hits = BTreeMap::new();
    for _ in 0..n {
        let (pod, peer) = tcp_ask(addr).unwrap_or_else(|e| panic!("connect {addr}: {e}"));
        assert_eq!(peer, addr, "getpeername must show the service address");
        *hits.entry(pod).or_insert(0) += 1;
    }
    hits
}

fn counter(maps: &BpfMaps, reason: Reason) -> u64 {
    maps.stats()
        .expect("stats")
        .into_iter()
        .find(|(r, _)| *r == reason)
        .map(|(_, v)| v)
        .expect("reason")
}

/// A Service of 30 endpoints (3 pods x 10 ports): its first 24 backend slots live in the
/// frontend's own `SVC4` entry, slots 25..=30 in a second entry (a chunk). `connect()`
/// reaches every one of them, the ones past slot 24 included; after the count shrinks
/// within the second chunk (30 -> 26) and grows back, only the backends in the count
/// answer and none is refused.
#[test]
fn connect_reaches_every_backend_across_the_chunks_of_a_large_service() {
    let mut env = TestEnv::new(3);
    let pods: Vec<SocketAddr> = (0..10u16)
        .flat_map(|p| {
            (1..=3).map(move |i| SocketAddr::new(IpAddr::V4(Topology::pod_v4(i)), PORT + p))
        })
        .collect();
    for b in &pods {
        let i = (1..=3)
            .find(|i| b.ip() == IpAddr::V4(Topology::pod_v4(*i)))
            .expect("a pod");
        let server = support::Server::tcp(&env.topo.pods[i - 1], *b, &b.to_string());
        env.servers.push(server);
    }
    let fe = Frontend::new(VIP4, 80, Proto::Tcp);
    install_service(&mut env, fe, pods.clone());
    let chunks = |env: &mut TestEnv| -> Vec<u16> {
        let d = env.writer().store().dump().expect("dump");
        let mut c: Vec<u16> = d
            .slots
            .keys()
            .map(|(_, s)| proxy_common::svc_chunk_of(*s).0)
            .collect();
        c.dedup();
        c
    };
    assert_eq!(chunks(&mut env), [0, 1], "slots 1..=24 and 25..=30");
    let answers = |env: &TestEnv, n: usize| {
        env.in_client(|| {
            let mut seen = BTreeMap::new();
            for _ in 0..n {
                let (who, peer) = tcp_ask(fe.socket_addr()).expect("connect to the VIP");
                assert_eq!(peer, fe.socket_addr());
                *seen.entry(who).or_insert(0) += 1;
            }
            seen
        })
    };
    // 20 connections per backend on average: the odds that one is missed by chance are
    // about 1e-7; a slot the datapath cannot read is a refused connection.
    let want: Vec<String> = {
        let mut w: Vec<String> = pods.iter().map(|b| b.to_string()).collect();
        w.sort();
        w
    };
    let seen = answers(&env, 600);
    assert_eq!(seen.keys().cloned().collect::<Vec<_>>(), want, "{seen:?}");
    // 30 -> 26: the count shrinks within the second chunk.
    install_service(&mut env, fe, pods[..26].to_vec());
    let seen = answers(&env, 520);
    let mut want26: Vec<String> = pods[..26].iter().map(|b| b.to_string()).collect();
    want26.sort();
    assert_eq!(seen.keys().cloned().collect::<Vec<_>>(), want26, "{seen:?}");
    // Back to 30.
    install_service(&mut env, fe, pods.clone());
    let seen = answers(&env, 600);
    assert_eq!(seen.keys().cloned().collect::<Vec<_>>(), want, "{seen:?}");
}

#[test]
fn tcp_clusterip_spreads_evenly_over_three_backends() {
    let mut env = TestEnv::new(3);
    env.serve_all(PORT);
    let fe = Frontend::new(VIP4, 80, Proto::Tcp);
    install_service(&mut env, fe, pods_v4(3));

    const N: usize = 3000;
    let hits = env.in_client(|| spread(fe.socket_addr(), N));
    assert_eq!(hits.keys().collect::<Vec<_>>(), ["pod1", "pod2", "pod3"]);
    // Chi-square goodness of fit against equal weights, 2 degrees of freedom:
    // p > 0.001 <=> chi2 < 13.816.
    let expected = N as f64 / 3.0;
    let chi2: f64 = hits
        .values()
        .map(|&o| (o as f64 - expected).powi(2) / expected)
        .sum();
    eprintln!("spread over {N} connections: {hits:?}, chi2 = {chi2:.3}");
    assert!(
        chi2 < 13.816,
        "not equal-weight: {hits:?}, chi2 = {chi2:.3}"
    );

    // The datapath counted every decision: per backend and per outcome.
    let maps = env.writer().store();
    let per_backend: u64 = maps.backend_conns().expect("conns").values().sum();
    assert_eq!(per_backend, N as u64);
    let mut counts: Vec<u64> = maps.backend_conns().expect("conns").into_values().collect();
    counts.sort_unstable();
    let mut observed: Vec<u64> = hits.values().map(|&v| v as u64).collect();
    observed.sort_unstable();
    assert_eq!(
        counts, observed,
        "per-backend counters match what the clients saw"
    );
    assert!(counter(maps, Reason::Translated) >= N as u64);
}

#[test]
fn udp_unconnected_replies_come_from_the_vip() {
    let mut env = TestEnv::new(3);
    env.serve_all(PORT);
    let fe = Frontend::new(VIP4, 53, Proto::Udp);
    install_service(&mut env, fe, pods_v4(3));

    let pods = env.in_client(|| {
        let sock = UdpSocket::bind("0.0.0.0:0").expect("bind");
        sock.set_read_timeout(Some(Duration::from_secs(2)))
            .expect("timeout");
        let mut pods = BTreeMap::new();
        for _ in 0..60 {
            let (pod, from) = udp_ask(&sock, fe.socket_addr()).expect("udp exchange");
            assert_eq!(from, fe.socket_addr(), "the reply's source must be the VIP");
            *pods.entry(pod).or_insert(0) += 1;
        }
        pods
    });
    // Each datagram is balanced on its own (sendmsg hook).
    assert!(pods.len() >= 2, "datagrams all went to one pod: {pods:?}");
    assert!(counter(env.writer().store(), Reason::RevTranslated) >= 60);
}

#[test]
fn connected_udp_and_tcp_getpeername_show_the_vip() {
    let mut env = TestEnv::new(2);
    env.serve_all(PORT);
    let udp = Frontend::new(VIP4, 53, Proto::Udp);
    let tcp = Frontend::new(VIP4, 80, Proto::Tcp);
    install_service(&mut env, udp, pods_v4(2));
    install_service(&mut env, tcp, pods_v4(2));

    env.in_client(|| {
        let sock = UdpSocket::bind("0.0.0.0:0").expect("bind");
        sock.set_read_timeout(Some(Duration::from_secs(2)))
            .expect("timeout");
        sock.connect(udp.socket_addr()).expect("connect udp");
        assert_eq!(sock.peer_addr().expect("peer"), udp.socket_addr());
        // A connected socket keeps its backend: every answer comes from the same pod.
        let mut answers = Vec::new();
        for _ in 0..10 {
            sock.send(b"who?").expect("send");
            let mut buf = [0u8; 64];
            let n = sock.recv(&mut buf).expect("recv");
            answers.push(String::from_utf8_lossy(&buf[..n]).trim().to_string());
        }
        answers.dedup();
        assert_eq!(
            answers.len(),
            1,
            "connected UDP changed backend: {answers:?}"
        );

        let (_, peer) = tcp_ask(tcp.socket_addr()).expect("tcp");
        assert_eq!(peer, tcp.socket_addr());
    });
}

#[test]
fn ipv6_clusterip_tcp_and_udp() {
    let mut env = TestEnv::new(3);
    env.serve_all(PORT);
    let tcp = Frontend::new(vip6(), 80, Proto::Tcp);
    let udp = Frontend::new(vip6(), 53, Proto::Udp);
    install_service(&mut env, tcp, pods_v6(3));
    install_service(&mut env, udp, pods_v6(3));

    env.in_client(|| {
        let hits = spread(tcp.socket_addr(), 300);
        assert_eq!(hits.len(), 3, "all three v6 backends used: {hits:?}");
        let sock = UdpSocket::bind("[::]:0").expect("bind");
        sock.set_read_timeout(Some(Duration::from_secs(2)))
            .expect("timeout");
        for _ in 0..20 {
            let (_, from) = udp_ask(&sock, udp.socket_addr()).expect("udp6");
            assert_eq!(from, udp.socket_addr());
        }
    });
}

#[test]
fn v4_mapped_addresses_on_dual_stack_sockets_take_the_v4_path() {
    let mut env = TestEnv::new(2);
    env.serve_all(PORT);
    let tcp = Frontend::new(VIP4, 80, Proto::Tcp);
    let udp = Frontend::new(VIP4, 53, Proto::Udp);
    install_service(&mut env, tcp, pods_v4(2));
    install_service(&mut env, udp, pods_v4(2));

    let mapped = |port| SocketAddr::V6(SocketAddrV6::new(VIP4.to_ipv6_mapped(), port, 0, 0));
    env.in_client(|| {
        for _ in 0..20 {
            let (pod, peer) = tcp_ask(mapped(80)).expect("tcp over v4-mapped");
            assert!(pod.starts_with("pod"), "{pod}");
            assert_eq!(peer, mapped(80), "getpeername6 shows the v4-mapped VIP");
        }
        let sock = UdpSocket::bind("[::]:0").expect("dual-stack bind");
        sock.set_read_timeout(Some(Duration::from_secs(2)))
            .expect("timeout");
        for _ in 0..20 {
            let (_, from) = udp_ask(&sock, mapped(53)).expect("udp over v4-mapped");
            assert_eq!(from, mapped(53), "recvmsg6 shows the v4-mapped VIP");
        }
    });
}

#[test]
fn zero_backends_refuse_at_once_and_unknown_vips_stay_unreachable() {
    let mut env = TestEnv::new(1);
    env.serve_all(PORT);
    let tcp = Frontend::new(VIP4, 80, Proto::Tcp);
    let udp = Frontend::new(VIP4, 53, Proto::Udp);
    let tcp6 = Frontend::new(vip6(), 80, Proto::Tcp);
    install_service(&mut env, tcp, vec![]);
    install_service(&mut env, udp, vec![]);
    install_service(&mut env, tcp6, vec![]);

    env.in_client(|| {
        for addr in [tcp.socket_addr(), tcp6.socket_addr()] {
            // Refused, not a hang: a hang ends in the timeout (TimedOut), not in
            // ConnectionRefused; no wall-clock bound needed.
            let err = TcpStream::connect_timeout(&addr, Duration::from_secs(5))
                .expect_err("no backends: refused");
            assert_eq!(
                err.kind(),
                io::ErrorKind::ConnectionRefused,
                "{addr}: {err}"
            );
        }
        let sock = UdpSocket::bind("0.0.0.0:0").expect("bind");
        let err = sock.send_to(b"x", udp.socket_addr()).expect_err("refused");
        assert_eq!(err.kind(), io::ErrorKind::ConnectionRefused, "{err}");

        // Safety net of the test topology: an address that is no service is never
        // rewritten and has no route out of the client namespace.
        let other = SocketAddr::from(([10, 96, 0, 99], 80));
        let err = TcpStream::connect_timeout(&other, Duration::from_secs(2)).expect_err("no route");
        assert_eq!(err.raw_os_error(), Some(libc::ENETUNREACH), "{err}");
    });
    assert!(counter(env.writer().store(), Reason::NoBackend) >= 3);
}

/// Issue #24 item 5: with the Service CIDRs in `SVC_CIDR4/6`, a ClusterIP on a port no
/// Service uses is refused with ECONNREFUSED and an unallocated address inside a range with
/// EPERM, both at once (kube-proxy's nftables mode: reject, drop); node, pod and other
/// addresses are untouched (no wildcard entry, cilium#44430).
#[test]
fn service_cidrs_reject_unused_ports_and_drop_unallocated_addresses_only() {
    let mut env = TestEnv::new(1);
    env.serve_all(PORT);
    let tcp = Frontend::new(VIP4, PORT, Proto::Tcp);
    let tcp6 = Frontend::new(vip6(), PORT, Proto::Tcp);
    install_service(&mut env, tcp, pods_v4(1));
    install_service(&mut env, tcp6, pods_v6(1));
    let ranges = [
        (IpAddr::V4(Ipv4Addr::new(10, 96, 0, 0)), 16),
        ("fd00:96::".parse().expect("v6"), 64),
    ];
    let vips = [IpAddr::V4(VIP4), IpAddr::V6(vip6())];
    proxy_user::svc_cidr::write(
        &env.pins.dir(),
        &proxy_user::svc_cidr::wanted(&ranges, &vips),
    )
    .expect("service cidrs");
    let unused_before = counter(env.writer().store(), Reason::SvcPortUnused);
    let drop_before = counter(env.writer().store(), Reason::SvcCidrUnallocated);

    env.in_client(|| {
        let fails_at_once = |addr: SocketAddr, want: i32| {
            let start = Instant::now();
            let err = TcpStream::connect_timeout(&addr, Duration::from_secs(5))
                .expect_err("refused by the hook");
            assert_eq!(err.raw_os_error(), Some(want), "{addr}: {err}");
            assert!(
                start.elapsed() < Duration::from_millis(500),
                "{addr}: failed at once, not a hang"
            );
        };
        // The ClusterIPs still serve their port.
        for addr in [tcp.socket_addr(), tcp6.socket_addr()] {
            tcp_ask(addr).unwrap_or_else(|e| panic!("{addr}: {e}"));
        }
        // Another port of a ClusterIP: rejected (TCP and UDP, IPv4, IPv6, and v4-mapped on
        // an IPv6 socket).
        let v4_mapped = SocketAddr::new(IpAddr::V6(VIP4.to_ipv6_mapped()), 81);
        for addr in [
            SocketAddr::new(IpAddr::V4(VIP4), 81),
            SocketAddr::new(IpAddr::V6(vip6()), 81),
            v4_mapped,
        ] {
            fails_at_once(addr, libc::ECONNREFUSED);
        }
        let udp = UdpSocket::bind("0.0.0.0:0").expect("bind");
        let err = udp
            .send_to(b"x", SocketAddr::new(IpAddr::V4(VIP4), 53))
            .expect_err("refused");
        assert_eq!(err.raw_os_error(), Some(libc::ECONNREFUSED), "{err}");
        // An unallocated address inside a range: dropped (EPERM at once).
        fails_at_once(SocketAddr::from(([10, 96, 0, 99], PORT)), libc::EPERM);
        fails_at_once(
            SocketAddr::new("fd00:96::99".parse().expect("v6"), PORT),
            libc::EPERM,
        );
        let err = udp
            .send_to(b"x", SocketAddr::from(([10, 96, 200, 1], 53)))
            .expect_err("dropped");
        assert_eq!(err.raw_os_error(), Some(libc::EPERM), "{err}");

        // Untouched: a pod address, a node address (this namespace's own, like SSH to a
        // node), and an address outside the ranges (still no route from here).
        tcp_ask(SocketAddr::new(IpAddr::V4(Topology::pod_v4(1)), PORT)).expect("pod v4");
        tcp_ask(SocketAddr::new(IpAddr::V6(Topology::pod_v6(1)), PORT)).expect("pod v6");
        for node in ["10.240.1.1:0", "[fd00:240:1::1]:0"] {
            let l = std::net::TcpListener::bind(node).expect("node listener");
            let at = l.local_addr().expect("addr");
            TcpStream::connect_timeout(&at, Duration::from_secs(5))
                .unwrap_or_else(|e| panic!("node address {at}: {e}"));
        }
        let outside = SocketAddr::from(([10, 97, 0, 1], PORT));
        let err =
            TcpStream::connect_timeout(&outside, Duration::from_secs(2)).expect_err("no route");
        assert_eq!(err.raw_os_error(), Some(libc::ENETUNREACH), "{err}");
    });
    let store = env.writer().store();
    assert_eq!(counter(store, Reason::SvcPortUnused) - unused_before, 4);
    assert_eq!(counter(store, Reason::SvcCidrUnallocated) - drop_before, 3);

    // Emptied: the same unallocated address is left alone again (no route from here).
    proxy_user::svc_cidr::write(&env.pins.dir(), &Default::default()).expect("empty");
    assert!(proxy_user::svc_cidr::read(&env.pins.dir())
        .expect("read")
        .is_empty());
    env.in_client(|| {
        let addr = SocketAddr::from(([10, 96, 0, 99], PORT));
        let err = TcpStream::connect_timeout(&addr, Duration::from_secs(2)).expect_err("no route");
        assert_eq!(err.raw_os_error(), Some(libc::ENETUNREACH), "{err}");
    });
}

#[test]
fn backend_changes_apply_to_the_next_connection() {
    let mut env = TestEnv::new(3);
    env.serve_all(PORT);
    let fe = Frontend::new(VIP4, 80, Proto::Tcp);
    let pods = pods_v4(3);
    install_service(&mut env, fe, pods.clone());

    // Scale down to pod2 only: every next connection lands there.
    install_service(&mut env, fe, vec![pods[1]]);
    let hits = env.in_client(|| spread(fe.socket_addr(), 50));
    assert_eq!(hits, BTreeMap::from([("pod2".to_string(), 50)]));

    // Replace it with pod3.
    install_service(&mut env, fe, vec![pods[2]]);
    let hits = env.in_client(|| spread(fe.socket_addr(), 50));
    assert_eq!(hits, BTreeMap::from([("pod3".to_string(), 50)]));

    // Scale up to all three: all are used again.
    install_service(&mut env, fe, pods.clone());
    let hits = env.in_client(|| spread(fe.socket_addr(), 300));
    assert_eq!(hits.len(), 3, "{hits:?}");

    // Removing the service: the VIP is no longer rewritten (and unreachable).
    env.writer().remove(&fe).expect("remove");
    env.in_client(|| {
        let err = TcpStream::connect_timeout(&fe.socket_addr(), Duration::from_secs(2))
            .expect_err("service gone");
        assert_eq!(err.raw_os_error(), Some(libc::ENETUNREACH), "{err}");
    });
}

#[test]
fn pinned_datapath_survives_the_agent_and_is_adopted() {
    let mut env = TestEnv::new(3);
    env.serve_all(PORT);
    let fe = Frontend::new(VIP4, 80, Proto::Tcp);
    install_service(&mut env, fe, pods_v4(3));
    let map_id = |env: &TestEnv| {
        aya::maps::MapData::from_pin(env.pins.path.join("SVC4"))
            .expect("pin")
            .info()
            .expect("info")
            .id()
    };
    let svc4_id = map_id(&env);
    let progs_before: Vec<Vec<u32>> = SOCK_ATTACH_TYPES
        .iter()
        .map(|t| attached_programs(&env.cgroup.path, *t))
        .collect();
    assert!(
        progs_before.iter().all(|ids| ids.len() == 1),
        "{progs_before:?}"
    );

    // The "agent" goes away: no writer, no map handles, no program handles.
    env.writer = None;
    let hits = env.in_client(|| spread(fe.socket_addr(), 150));
    assert_eq!(hits.len(), 3, "still balanced with no agent: {hits:?}");

    // A new agent adopts: nothing reloaded or reattached, same maps, same programs.
    let report = env.install();
    assert_eq!(report.adopted.len(), 8);
    assert!(report.attached.is_empty());
    assert_eq!(map_id(&env), svc4_id);
    // It knows where the adopted hooks are (the stale-socket cleanup needs it), from the
    // kernel's record of the link, even when asked for another cgroup (issue 11 item 7).
    assert_eq!(report.cgroup.as_ref(), Some(&env.cgroup.path));
    let elsewhere = loader::install(&loader::InstallOptions {
        pin_path: env.pins.path.clone(),
        cgroup: Some(support::cgroup2_mount()),
        interfaces: Vec::new(),
        conntrack_flows: loader::DEFAULT_CONNTRACK_FLOWS,
        service_entries: loader::DEFAULT_SERVICE_ENTRIES,
        map_sizes: None,
        tc_attach: loader::TcAttachMode::Auto,
        acceleration: loader::Acceleration::Off,
    })
    .expect("adopt again");
    assert_eq!(elsewhere.cgroup.as_ref(), Some(&env.cgroup.path));
    let progs_after: Vec<Vec<u32>> = SOCK_ATTACH_TYPES
        .iter()
        .map(|t| attached_programs(&env.cgroup.path, *t))
        .collect();
    assert_eq!(progs_after, progs_before);
    let (mut writer, adopted) =
        Writer::adopt(BpfMaps::open(&env.pins.path).expect("open")).expect("adopt");
    assert_eq!((adopted.frontends, adopted.backends), (1, 3));
    assert_eq!(adopted.orphans_deleted, 0);
    // The adopted model matches the maps: the same desired state writes nothing.
    assert_eq!(
        writer
            .upsert(&ServiceEntry::new(fe, pods_v4(3)))
            .expect("upsert"),
        0
    );
    assert_eq!(writer.store().dump().expect("dump"), writer.expected_dump());
    // And it can change them.
    writer
        .upsert(&ServiceEntry::new(fe, vec![pods_v4(3)[0]]))
        .expect("upsert");
    let hits = env.in_client(|| spread(fe.socket_addr(), 20));
    assert_eq!(hits, BTreeMap::from([("pod1".to_string(), 20)]));
}

#[test]
fn uninstall_leaves_nothing_behind() {
    let mut env = TestEnv::new(1);
    env.serve_all(PORT);
    let fe = Frontend::new(VIP4, 80, Proto::Tcp);
    install_service(&mut env, fe, pods_v4(1));
    env.in_client(|| tcp_ask(fe.socket_addr()).expect("works before uninstall"));
    env.writer = None;

    let report =
        loader::uninstall(&proxy_user::pins::PinDir::new(&env.pins.path)).expect("uninstall");
    assert_eq!(report.links.len(), 8);
    assert_eq!(report.maps.len(), proxy_common::map_names::ALL.len());
    assert!(!env.pins.path.exists(), "pin directory removed");
    for t in SOCK_ATTACH_TYPES {
        assert_eq!(
            attached_programs(&env.cgroup.path, t),
            Vec::<u32>::new(),
            "attach type {t}"
        );
    }
    env.in_client(|| {
        let err = TcpStream::connect_timeout(&fe.socket_addr(), Duration::from_secs(2))
            .expect_err("no hooks: the VIP is just an unroutable address");
        assert_eq!(err.raw_os_error(), Some(libc::ENETUNREACH), "{err}");
    });
    // Uninstalling again is harmless.
    assert_eq!(
        loader::uninstall(&proxy_user::pins::PinDir::new(&env.pins.path)).expect("again"),
        Default::default()
    );
}

#[test]
fn full_service_map_is_refused_cleanly() {
    // The kernel's own "map full" answer (E2BIG) reaches the writer as a clear error
    // naming the frontend, and the frontend is not half-written. REVNAT4 is the smallest
    // map, so fill it up to its limit through the writer's store.
    let mut env = TestEnv::new(1);
    let limit = proxy_common::limits::MAX_REVNAT as usize;
    let mut errors = Vec::new();
    for i in 0..=limit {
        let fe = Frontend::new(
            Ipv4Addr::from(u32::from(Ipv4Addr::new(10, 100, 0, 0)) + i as u32),
            80,
            Proto::Tcp,
        );
        // Zero backends keeps each frontend at two entries (its own and revnat).
        if let Err(e) = env.writer().upsert(&ServiceEntry::new(fe, vec![])) {
            errors.push((fe, e));
        }
    }
    assert_eq!(
        errors.len(),
        1,
        "exactly the one frontend over the limit fails"
    );
    let (fe, err) = &errors[0];
    assert_eq!(err.reason().label(), "map_full");
    assert!(err.to_string().contains(&fe.to_string()), "{err}");
    assert!(err.to_string().contains("REVNAT4"), "{err}");
    let w = env.writer();
    assert_eq!(w.store().dump().expect("dump"), w.expected_dump());
}

#[test]
fn session_affinity_keeps_a_client_on_its_backend() {
    let mut env = TestEnv::new(3);
    env.serve_all(PORT);
    let fe = Frontend::new(VIP4, 80, Proto::Tcp);
    let pods = pods_v4(3);
    let affine = |backends: Vec<SocketAddr>| ServiceEntry {
        flags: proxy_common::svc_flags::AFFINITY,
        affinity_timeout: 10800,
        ..ServiceEntry::new(fe, backends)
    };
    env.writer().upsert(&affine(pods.clone())).expect("upsert");
    let before = counter(env.writer().store(), Reason::AffinityHit);

    // Every connection of the client (its network namespace) goes to one pod.
    let hits = env.in_client(|| spread(fe.socket_addr(), 60));
    assert_eq!(hits.len(), 1, "{hits:?}");
    let first = hits.keys().next().expect("one pod").clone();
    assert_eq!(
        counter(env.writer().store(), Reason::AffinityHit) - before,
        59,
        "every connection after the first follows the affinity entry"
    );

    // proxyctl shows the client (its network namespace) held to that pod.
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_proxyctl"))
        .args(["--pin-path", env.pins.path.to_str().expect("utf-8")])
        .args(["affinity", "-o", "json"])
        .output()
        .expect("proxyctl");
    assert!(out.status.success(), "{out:?}");
    let doc: serde_json::Value = serde_json::from_slice(&out.stdout).expect("json");
    let entries = doc["entries"].as_array().expect("entries");
    assert_eq!(entries.len(), 1, "{doc}");
    let pod_no: usize = first.trim_start_matches("pod").parse().expect("podN");
    assert_eq!(
        entries[0]["backend"].as_str(),
        Some(
            SocketAddr::new(IpAddr::V4(Topology::pod_v4(pod_no)), PORT)
                .to_string()
                .as_str()
        ),
        "{doc}"
    );
    assert!(entries[0]["client"]
        .as_str()
        .is_some_and(|c| c.starts_with("netns:")));
    assert_eq!(entries[0]["expired"], false);

    // A scale-up keeps it there (slots of surviving backends do not move).
    let mut more = pods.clone();
    more.push(SocketAddr::new(IpAddr::V4(Topology::pod_v4(9)), PORT));
    env.writer().upsert(&affine(more)).expect("upsert");
    let hits = env.in_client(|| spread(fe.socket_addr(), 20));
    assert_eq!(hits, BTreeMap::from([(first.clone(), 20)]));

    // Its pod removed: the client moves to another one and stays there.
    let rest: Vec<SocketAddr> = pods
        .iter()
        .zip(["pod1", "pod2", "pod3"])
        .filter(|(_, name)| *name != first)
        .map(|(a, _)| *a)
        .collect();
    env.writer().upsert(&affine(rest)).expect("upsert");
    let hits = env.in_client(|| spread(fe.socket_addr(), 40));
    assert_eq!(hits.len(), 1, "{hits:?}");
    assert!(!hits.contains_key(&first), "{hits:?}");

    // Without affinity the same client is spread again.
    install_service(&mut env, fe, pods.clone());
    let hits = env.in_client(|| spread(fe.socket_addr(), 120));
    assert_eq!(hits.len(), 3, "{hits:?}");
}

#[test]
fn nodeports_on_the_node_addresses_are_served_at_connect() {
    let mut env = TestEnv::new(3);
    env.serve_all(PORT);
    let node = Ipv4Addr::new(192, 0, 2, 1);
    proxy_user::bpf::set_node_addresses(
        &proxy_user::pins::PinDir::new(&env.pins.path),
        &[IpAddr::V4(node)],
    )
    .expect("node addresses");
    let np = Frontend::new(Ipv4Addr::UNSPECIFIED, 30080, Proto::Tcp);
    env.writer()
        .upsert(&ServiceEntry {
            flags: proxy_common::svc_flags::NODE_PORT,
            ..ServiceEntry::new(np, pods_v4(3))
        })
        .expect("upsert");
    // A pod (the client namespace) reaching <node address>:<nodePort>: balanced over the
    // three pods, and getpeername shows the address it asked for (checked by spread).
    let target = SocketAddr::new(IpAddr::V4(node), 30080);
    let hits = env.in_client(|| spread(target, 150));
    assert_eq!(hits.len(), 3, "{hits:?}");
    // Any other address on that port is left alone (and is unreachable from there).
    env.in_client(|| {
        let other = SocketAddr::new(IpAddr::V4(Ipv4Addr::new(192, 0, 2, 2)), 30080);
        let err = TcpStream::connect_timeout(&other, Duration::from_secs(2))
            .expect_err("not a node address");
        assert_eq!(err.raw_os_error(), Some(libc::ENETUNREACH), "{err}");
    });
}

/// Makes `n` short UDP exchanges with `vip`, each on a fresh socket, from a forked child
/// in the client namespace (the hooked cgroup: a fork stays in its parent's) running as
/// uid/gid 65534 (nobody): an unprivileged process of any pod. Returns the answers it got.
fn flood_as_nobody(client_ns: &std::path::Path, vip: SocketAddrV4Raw, n: u32) -> u32 {
    use std::os::fd::AsRawFd;
    let ns = std::fs::File::open(client_ns).expect("client netns");
    let mut pipe = [0i32; 2];
    // SAFETY: a two-int buffer.
    assert_eq!(unsafe { libc::pipe(pipe.as_mut_ptr()) }, 0, "pipe");
    // SAFETY: the child only makes raw syscalls (no allocation, no locks) and _exits.
    let pid = unsafe { libc::fork() };
    assert!(pid >= 0, "fork: {}", io::Error::last_os_error());
    if pid == 0 {
        // SAFETY (whole block): plain syscalls on our own buffers, then _exit.
        unsafe {
            let mut answered: u32 = 0;
            let ok = libc::setns(ns.as_raw_fd(), libc::CLONE_NEWNET) == 0
                && libc::setgroups(0, std::ptr::null()) == 0
                && libc::setgid(65534) == 0
                && libc::setuid(65534) == 0
                && libc::getuid() == 65534;
            if ok {
                let sa = libc::sockaddr_in {
                    sin_family: libc::AF_INET as libc::sa_family_t,
                    sin_port: vip.port.to_be(),
                    sin_addr: libc::in_addr {
                        s_addr: u32::from_ne_bytes(vip.ip),
                    },
                    sin_zero: [0; 8],
                };
                let tv = libc::timeval {
                    tv_sec: 0,
                    tv_usec: 200_000,
                };
                let mut buf = [0u8; 64];
                for _ in 0..n {
                    let fd = libc::socket(libc::AF_INET, libc::SOCK_DGRAM, 0);
                    if fd < 0 {
                        continue;
                    }
                    libc::setsockopt(
                        fd,
                        libc::SOL_SOCKET,
                        libc::SO_RCVTIMEO,
                        (&raw const tv).cast(),
                        std::mem::size_of::<libc::timeval>() as u32,
                    );
                    let sent = libc::sendto(
                        fd,
                        b"who?".as_ptr().cast(),
                        4,
                        0,
                        (&raw const sa).cast(),
                        std::mem::size_of::<libc::sockaddr_in>() as u32,
                    );
                    if sent == 4 && libc::recv(fd, buf.as_mut_ptr().cast(), buf.len(), 0) > 0 {
                        answered += 1;
                    }
                    libc::close(fd);
                }
            }
            let code = if ok { answered } else { u32::MAX };
            libc::write(pipe[1], (&raw const code).cast(), 4);
            libc::_exit(0);
        }
    }
    // SAFETY: our end of the pipe.
    unsafe { libc::close(pipe[1]) };
    let mut code = 0u32;
    // SAFETY: reading 4 bytes into a u32.
    let r = unsafe { libc::read(pipe[0], (&raw mut code).cast(), 4) };
    let mut status = 0;
    // SAFETY: our own child, by pid.
    unsafe {
        libc::waitpid(pid, &mut status, 0);
        libc::close(pipe[0]);
    }
    assert_eq!(r, 4, "the flood child reported nothing");
    assert_ne!(code, u32::MAX, "the flood child could not become uid 65534");
    code
}

/// A raw IPv4 socket address for the forked child (no allocation there).
#[derive(Clone, Copy)]
struct SocketAddrV4Raw {
    ip: [u8; 4],
    port: u16,
}

/// Issue 11, item 6: one process's flood of short UDP exchanges with a VIP (150,000, as
/// measured in the issue) must not make another process's long-lived sockets show the
/// backend instead of the VIP: in `recvfrom` (an unconnected socket's queued reply, a
/// connected socket's reply) and in `getpeername` (connected UDP, TCP v4 and v6). With
/// the old node-wide LRU of 65,536 `{cookie, backend}` entries the flood evicted them.
#[test]
fn a_flood_of_short_udp_exchanges_does_not_evict_other_sockets_reverse_entries() {
    let mut env = TestEnv::new(2);
    env.serve_all(PORT);
    let udp = Frontend::new(VIP4, 53, Proto::Udp);
    let tcp = Frontend::new(VIP4, 80, Proto::Tcp);
    let tcp6 = Frontend::new(vip6(), 80, Proto::Tcp);
    let udp6 = Frontend::new(vip6(), 53, Proto::Udp);
    install_service(&mut env, udp, pods_v4(2));
    install_service(&mut env, tcp, pods_v4(2));
    install_service(&mut env, tcp6, pods_v6(2));
    install_service(&mut env, udp6, pods_v6(2));
    let client_ns = env.topo.client.path();

    let _ns = env.topo.client.enter();
    // The long-lived sockets, set up before the flood.
    let connected = UdpSocket::bind("0.0.0.0:0").expect("bind");
    connected
        .set_read_timeout(Some(Duration::from_secs(2)))
        .expect("timeout");
    connected.connect(udp.socket_addr()).expect("connect udp");
    connected.send(b"who?").expect("send");
    let mut buf = [0u8; 64];
    let (_, from) = connected.recv_from(&mut buf).expect("first answer");
    assert_eq!(from, udp.socket_addr());
    let connected6 = UdpSocket::bind("[::]:0").expect("bind6");
    connected6
        .set_read_timeout(Some(Duration::from_secs(2)))
        .expect("timeout");
    connected6
        .connect(udp6.socket_addr())
        .expect("connect udp6");
    let unconnected = UdpSocket::bind("0.0.0.0:0").expect("bind");
    unconnected
        .set_read_timeout(Some(Duration::from_secs(2)))
        .expect("timeout");
    // Its reply waits in the queue through the flood: recvfrom translates it afterwards.
    unconnected
        .send_to(b"who?", udp.socket_addr())
        .expect("send_to");
    let stream = std::net::TcpStream::connect(tcp.socket_addr()).expect("tcp");
    let stream6 = std::net::TcpStream::connect(tcp6.socket_addr()).expect("tcp6");
    assert_eq!(stream.peer_addr().expect("peer"), tcp.socket_addr());
    assert_eq!(stream6.peer_addr().expect("peer6"), tcp6.socket_addr());

    const FLOOD: u32 = 150_000;
    let start = Instant::now();
    let vip = SocketAddrV4Raw {
        ip: VIP4.octets(),
        port: 53,
    };
    let answered = flood_as_nobody(&client_ns, vip, FLOOD);
    eprintln!(
        "flood: {answered} of {FLOOD} exchanges answered in {:?}",
        start.elapsed()
    );
    assert!(
        answered > FLOOD * 9 / 10,
        "the flood itself must get through: {answered} of {FLOOD}"
    );

    let (_, from) = unconnected.recv_from(&mut buf).expect("queued answer");
    assert_eq!(
        from,
        udp.socket_addr(),
        "unconnected UDP: recvfrom after the flood"
    );
    connected.send(b"who?").expect("send");
    let (_, from) = connected.recv_from(&mut buf).expect("answer");
    assert_eq!(
        from,
        udp.socket_addr(),
        "connected UDP: recvfrom after the flood"
    );
    assert_eq!(
        connected.peer_addr().expect("peer"),
        udp.socket_addr(),
        "connected UDP: getpeername after the flood"
    );
    connected6.send(b"who?").expect("send6");
    let (_, from) = connected6.recv_from(&mut buf).expect("answer6");
    assert_eq!(
        from,
        udp6.socket_addr(),
        "connected UDP6: recvfrom after the flood"
    );
    assert_eq!(
        stream.peer_addr().expect("peer"),
        tcp.socket_addr(),
        "TCP: getpeername after the flood"
    );
    assert_eq!(
        stream6.peer_addr().expect("peer6"),
        tcp6.socket_addr(),
        "TCP6: getpeername after the flood"
    );
}

/// One unconnected UDP socket talking to several VIPs keeps one reverse entry per
/// backend in its own storage (`SOCK_REVNAT_SLOTS` of them); a new backend beyond that
/// replaces the socket's own oldest entry, never another socket's.
#[test]
fn an_unconnected_udp_socket_keeps_its_newest_reverse_entries() {
    use proxy_common::limits::SOCK_REVNAT_SLOTS;
    let mut env = TestEnv::new(3);
    let ports = [PORT, PORT + 1, PORT + 2];
    for p in ports {
        env.serve_all(p);
    }
    // SOCK_REVNAT_SLOTS + 1 frontends, each with its own backend (pod x port).
    let mut fronts = Vec::new();
    for (i, (pod, port)) in (1..=3)
        .flat_map(|pod| ports.iter().map(move |p| (pod, *p)))
        .take(SOCK_REVNAT_SLOTS + 1)
        .enumerate()
    {
        let fe = Frontend::new(Ipv4Addr::new(10, 96, 1, i as u8 + 1), 53, Proto::Udp);
        let backend = SocketAddr::new(IpAddr::V4(Topology::pod_v4(pod)), port);
        install_service(&mut env, fe, vec![backend]);
        fronts.push((fe.socket_addr(), backend));
    }
    assert_eq!(
        fronts.len(),
        SOCK_REVNAT_SLOTS + 1,
        "enough distinct backends"
    );

    // The socket's own storage, read from user space by its descriptor.
    let storage = aya::maps::Map::from_map_data(
        aya::maps::MapData::from_pin(env.pins.path.join("SOCK_REVNAT4")).expect("pinned"),
    )
    .expect("map");
    let storage: aya::maps::SkStorage<_, proxy_common::SockRevNat4> =
        aya::maps::SkStorage::try_from(storage).expect("an SK_STORAGE map");
    let sources = env.in_client(|| {
        let sock = UdpSocket::bind("0.0.0.0:0").expect("bind");
        sock.set_read_timeout(Some(Duration::from_secs(2)))
            .expect("timeout");
        // Another socket's traffic in between changes nothing for this one.
        let other = UdpSocket::bind("0.0.0.0:0").expect("bind");
        assert!(storage.get(&sock, 0).is_err(), "no storage before a VIP");
        for (vip, _) in &fronts {
            sock.send_to(b"who?", vip).expect("send");
            other.send_to(b"who?", vip).expect("send");
        }
        let v = storage.get(&sock, 0).expect("the socket's entries");
        assert_eq!(
            v.next as usize,
            fronts.len(),
            "one insertion per new backend"
        );
        let held: std::collections::BTreeSet<SocketAddr> = v
            .entries
            .iter()
            .map(|e| {
                SocketAddr::from((
                    Ipv4Addr::from(u32::from_be(e.backend_addr)),
                    u16::from_be(e.backend_port),
                ))
            })
            .collect();
        let newest: std::collections::BTreeSet<SocketAddr> =
            fronts[1..].iter().map(|(_, b)| *b).collect();
        assert_eq!(held, newest, "the oldest entry was replaced");
        let mut buf = [0u8; 64];
        let mut sources = std::collections::BTreeSet::new();
        for _ in 0..fronts.len() {
            let (_, from) = sock.recv_from(&mut buf).expect("answer");
            sources.insert(from);
        }
        sources
    });
    // The oldest backend's entry was replaced by the newest: its reply shows the backend;
    // every other reply shows its VIP.
    let mut want: std::collections::BTreeSet<SocketAddr> =
        fronts[1..].iter().map(|(vip, _)| *vip).collect();
    want.insert(fronts[0].1);
    assert_eq!(sources, want);
}

/// The previous layout's (ABI 3) reverse entries, kept after an upgrade as
/// `SOCK_REVNAT4/6_V3` (`{socket cookie, backend}` -> frontend): a socket whose own storage
/// has no entry for its peer is shown the frontend from there, and the entry is moved
/// into the socket's storage (deleted from the kept map); an entry whose frontend is gone
/// (another service id) is not used, deleted and counted stale. IPv4 and IPv6.
#[test]
fn reverse_entries_of_the_previous_layout_are_read_moved_and_deleted() {
    use proxy_common::{
        map_names, scope, SockRevNat4V3, SockRevNat4V3Key, SockRevNat6V3, SockRevNat6V3Key,
        Svc4Key, Svc6Key, SvcEntry,
    };
    let mut env = TestEnv::new(1);
    env.serve_all(PORT);
    let fe4 = Frontend::new(VIP4, 80, Proto::Tcp);
    let fe6 = Frontend::new(vip6(), 80, Proto::Tcp);
    install_service(&mut env, fe4, pods_v4(1));
    install_service(&mut env, fe6, pods_v6(1));
    let pins = env.pins.path.clone();
    let open = |name: &str| aya::maps::MapData::from_pin(pins.join(name)).expect("pinned");
    let v4_word = |a: Ipv4Addr| u32::from_ne_bytes(a.octets());
    let v6_words = |a: Ipv6Addr| {
        let o = a.octets();
        std::array::from_fn(|i| {
            u32::from_ne_bytes([o[4 * i], o[4 * i + 1], o[4 * i + 2], o[4 * i + 3]])
        })
    };
    let svc4: aya::maps::HashMap<_, Svc4Key, SvcEntry> =
        aya::maps::HashMap::try_from(aya::maps::Map::HashMap(open(map_names::SVC4))).expect("SVC4");
    let svc6: aya::maps::HashMap<_, Svc6Key, SvcEntry> =
        aya::maps::HashMap::try_from(aya::maps::Map::HashMap(open(map_names::SVC6))).expect("SVC6");
    let id4 = svc4
        .get(
            &Svc4Key::new(v4_word(VIP4), 80u16.to_be(), 6, scope::ALL, 0),
            0,
        )
        .expect("frontend")
        .head
        .service_id;
    let id6 = svc6
        .get(
            &Svc6Key::new(v6_words(vip6()), 80u16.to_be(), 6, scope::ALL, 0),
            0,
        )
        .expect("frontend")
        .head
        .service_id;
    let mut kept4: aya::maps::HashMap<_, SockRevNat4V3Key, SockRevNat4V3> =
        aya::maps::HashMap::try_from(aya::maps::Map::LruHashMap(open(map_names::SOCK_REVNAT4_V3)))
            .expect("SOCK_REVNAT4_V3");
    let mut kept6: aya::maps::HashMap<_, SockRevNat6V3Key, SockRevNat6V3> =
        aya::maps::HashMap::try_from(aya::maps::Map::LruHashMap(open(map_names::SOCK_REVNAT6_V3)))
            .expect("SOCK_REVNAT6_V3");
    let stale_before = counter(env.writer().store(), Reason::RevNatStale);
    let (pod4, pod6) = (pods_v4(1)[0], pods_v6(1)[0]);
    env.in_client(|| {
        // Connected to the pod itself: no translation, so no entry in the socket's
        // storage; the kept map then names the frontend, as ABI 3's connect() left it.
        let s4 = TcpStream::connect_timeout(&pod4, Duration::from_secs(2)).expect("pod v4");
        let s6 = TcpStream::connect_timeout(&pod6, Duration::from_secs(2)).expect("pod v6");
        assert_eq!(s4.peer_addr().expect("peer"), pod4, "nothing kept: the pod");
        let key4 = SockRevNat4V3Key {
            cookie: cookie(&s4),
            addr: v4_word(Topology::pod_v4(1)),
            port: PORT.to_be(),
            _pad: 0,
        };
        let key6 = SockRevNat6V3Key {
            cookie: cookie(&s6),
            addr: v6_words(Topology::pod_v6(1)),
            port: PORT.to_be(),
            _pad: [0; 6],
        };
        let val4 = SockRevNat4V3 {
            addr: v4_word(VIP4),
            port: 80u16.to_be(),
            _pad: 0,
            service_id: id4,
        };
        let val6 = SockRevNat6V3 {
            addr: v6_words(vip6()),
            port: 80u16.to_be(),
            _pad: 0,
            service_id: id6,
        };
        kept4.insert(key4, val4, 0).expect("write SOCK_REVNAT4_V3");
        kept6.insert(key6, val6, 0).expect("write SOCK_REVNAT6_V3");
        assert_eq!(
            s4.peer_addr().expect("peer"),
            fe4.socket_addr(),
            "v4: from the kept map"
        );
        assert_eq!(
            s6.peer_addr().expect("peer"),
            fe6.socket_addr(),
            "v6: from the kept map"
        );
        assert!(
            kept4.get(&key4, 0).is_err(),
            "v4: moved out of the kept map"
        );
        assert!(
            kept6.get(&key6, 0).is_err(),
            "v6: moved out of the kept map"
        );
        // Now from the socket's own storage.
        assert_eq!(
            s4.peer_addr().expect("peer"),
            fe4.socket_addr(),
            "v4: from storage"
        );
        assert_eq!(
            s6.peer_addr().expect("peer"),
            fe6.socket_addr(),
            "v6: from storage"
        );

        // A kept entry of a frontend that is gone (another service id): not used.
        let s4b = TcpStream::connect_timeout(&pod4, Duration::from_secs(2)).expect("pod v4");
        let stale = SockRevNat4V3Key {
            cookie: cookie(&s4b),
            ..key4
        };
        let gone = SockRevNat4V3 {
            service_id: id4.wrapping_add(1000),
            ..val4
        };
        kept4.insert(stale, gone, 0).expect("write SOCK_REVNAT4_V3");
        assert_eq!(
            s4b.peer_addr().expect("peer"),
            pod4,
            "a stale kept entry is not used"
        );
        assert!(
            kept4.get(&stale, 0).is_err(),
            "the stale kept entry is deleted"
        );
    });
    assert!(
        counter(env.writer().store(), Reason::RevNatStale) > stale_before,
        "the stale kept entry is counted"
    );
}

/// `SO_COOKIE` of a socket (the key of ABI 3's reverse entries).
fn cookie(s: &impl std::os::fd::AsRawFd) -> u64 {
    let mut cookie = 0u64;
    let mut len = size_of::<u64>() as libc::socklen_t;
    // SAFETY: a u64 out-parameter of the size passed.
    let r = unsafe {
        libc::getsockopt(
            s.as_raw_fd(),
            libc::SOL_SOCKET,
            libc::SO_COOKIE,
            (&raw mut cookie).cast(),
            &mut len,
        )
    };
    assert_eq!(r, 0, "SO_COOKIE: {}", io::Error::last_os_error());
    cookie
}
