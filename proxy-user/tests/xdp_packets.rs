//! The XDP program (`xdp_ingress`) on crafted packets through `BPF_PROG_TEST_RUN`, with
//! the TC programs on what it hands on: the same maps (filled by the real writer), the
//! same conntrack. Checks verdicts, the packet bytes out (every checksum recomputed by
//! `Pkt::parse`: XDP computes them itself) and where each outcome was counted
//! (`XDP_STATS` vs `STATS`). Forwarding runs in a test namespace whose routes and
//! permanent neighbour entries give the FIB lookup an answer. Needs root.
//!
//! Plan as in `tc_packets.rs`: client 198.51.100.7 / 2001:db8::7, node 192.0.2.1 /
//! 2001:db8:1::1 (also the SNAT address), local backend 10.1.1.2:8080, remote backends
//! 10.2.1.2:8080 (via a router on the interface the client came in on: `XDP_TX`) and
//! 10.3.1.2:8080 (via another interface: `XDP_REDIRECT`).

mod support;

use proxy_common::prog_names::{TC_EGRESS, TC_INGRESS, XDP_INGRESS};

use std::net::{IpAddr, Ipv4Addr};
use std::time::Duration;

use proxy_common::{svc_flags, Reason};
use proxy_user::{Frontend, Proto};
use support::{
    packets::{
        entry, sa, Bed, ACK, LOCAL, RST, SYN, TC_ACT_OK, TC_ACT_REDIRECT, XDP_DROP, XDP_PASS,
        XDP_REDIRECT, XDP_TX,
    },
    tc::{icmp_error, Pkt},
    unique, Netns,
};

fn ip(s: &str) -> IpAddr {
    s.parse().expect("ip")
}

#[test]
fn a_new_flow_to_a_local_backend_is_translated_at_xdp_and_passed_to_the_stack() {
    let mut bed = Bed::new();
    let fe = Frontend::new(Ipv4Addr::new(10, 96, 0, 10), 80, Proto::Tcp);
    bed.writer
        .upsert(&entry(
            fe,
            &[("10.1.1.2:8080", LOCAL)],
            svc_flags::EXTERNAL_IP,
        ))
        .expect("upsert");
    let dns = Frontend::new(Ipv4Addr::new(10, 96, 0, 10), 53, Proto::Udp);
    bed.writer
        .upsert(&entry(
            dns,
            &[("10.1.1.2:5353", LOCAL)],
            svc_flags::EXTERNAL_IP,
        ))
        .expect("upsert");

    // A SYN: DNAT to the local backend, client kept; handed to the stack, which routes
    // it to the pod.
    let syn = Pkt::tcp("198.51.100.7:40000", "10.96.0.10:80", SYN);
    let (verdict, out) = bed.run(XDP_INGRESS, &syn);
    assert_eq!(verdict, XDP_PASS);
    let want = Pkt {
        dst: sa("10.1.1.2:8080"),
        ..syn.clone()
    };
    assert_eq!(out, want);
    assert_eq!(bed.xdp_counter(Reason::TcNewFlow), 1, "counted at XDP");
    // TC ingress then sees the translated packet: neither a flow nor a frontend.
    let (verdict, again) = bed.run(TC_INGRESS, &out);
    assert_eq!((verdict, again), (TC_ACT_OK, want));
    assert_eq!(bed.counter(Reason::TcNewFlow), 0, "nothing at TC");
    assert_eq!(bed.counter(Reason::TcFlow), 0, "nothing at TC");

    // The next packet of the flow follows its entry, at XDP.
    let (_, out) = bed.run(
        XDP_INGRESS,
        &Pkt {
            flags: ACK,
            ..syn.clone()
        },
    );
    assert_eq!(out.dst, sa("10.1.1.2:8080"));
    assert_eq!(bed.xdp_counter(Reason::TcFlow), 1);
    // The pod's reply leaves through TC egress, restored from the entry XDP wrote.
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

    // UDP: the checksum covers the payload, and a zero (absent) checksum stays zero.
    let q = Pkt::udp("198.51.100.7:5000", "10.96.0.10:53");
    let (verdict, out) = bed.run(XDP_INGRESS, &q);
    assert_eq!(verdict, XDP_PASS);
    assert_eq!(
        out,
        Pkt {
            dst: sa("10.1.1.2:5353"),
            ..q.clone()
        }
    );
    let mut no_csum = Pkt::udp("198.51.100.7:5001", "10.96.0.10:53").build();
    no_csum[40..42].copy_from_slice(&[0, 0]);
    let (_, out) = bed.run_raw(XDP_INGRESS, &no_csum);
    assert_eq!(&out[30..34], &[10, 1, 1, 2], "translated");
    assert_eq!(&out[40..42], &[0, 0], "no UDP checksum before, none after");
    assert_eq!(bed.xdp_counter(Reason::TcNewFlow), 3);

    // Not a frontend: untouched, not counted.
    let other = Pkt::tcp("198.51.100.7:40001", "10.96.0.11:80", SYN);
    assert_eq!(bed.run(XDP_INGRESS, &other), (XDP_PASS, other));
    assert_eq!(bed.xdp_counter(Reason::XdpToStack), 0);
}

#[test]
fn ipv6_dnat_at_xdp_with_checksums() {
    let mut bed = Bed::new();
    let fe = Frontend::new(ip("2001:db8:96::10"), 80, Proto::Tcp);
    bed.writer
        .upsert(&entry(
            fe,
            &[("[2001:db8:2::2]:8080", LOCAL)],
            svc_flags::EXTERNAL_IP,
        ))
        .expect("upsert");
    let syn = Pkt::tcp("[2001:db8::7]:40000", "[2001:db8:96::10]:80", SYN);
    let (verdict, out) = bed.run(XDP_INGRESS, &syn);
    assert_eq!(verdict, XDP_PASS);
    assert_eq!(
        out,
        Pkt {
            dst: sa("[2001:db8:2::2]:8080"),
            ..syn
        }
    );
    let fe = Frontend::new(ip("2001:db8:96::10"), 53, Proto::Udp);
    bed.writer
        .upsert(&entry(
            fe,
            &[("[2001:db8:2::2]:5353", LOCAL)],
            svc_flags::EXTERNAL_IP,
        ))
        .expect("upsert");
    let q = Pkt::udp("[2001:db8::7]:5000", "[2001:db8:96::10]:53");
    let (_, out) = bed.run(XDP_INGRESS, &q);
    assert_eq!(out.dst, sa("[2001:db8:2::2]:5353"));
    assert_eq!(bed.xdp_counter(Reason::TcNewFlow), 2);
}

#[test]
fn what_xdp_cannot_do_reaches_tc_untouched() {
    let mut bed = Bed::new();
    let fe = Frontend::new(Ipv4Addr::new(10, 96, 0, 10), 80, Proto::Tcp);
    bed.writer
        .upsert(&entry(
            fe,
            &[("10.1.1.2:8080", LOCAL)],
            svc_flags::EXTERNAL_IP,
        ))
        .expect("upsert");
    let empty = Frontend::new(Ipv4Addr::new(10, 96, 0, 20), 80, Proto::Tcp);
    bed.writer
        .upsert(&entry(empty, &[], svc_flags::EXTERNAL_IP))
        .expect("upsert");

    // An IPv4 fragment (more fragments set) to a frontend.
    let mut frag = Pkt::tcp("198.51.100.7:40000", "10.96.0.10:80", SYN).build();
    frag[20] |= 0x20;
    let c = [frag[24], frag[25]];
    let old = u16::from_be_bytes(c);
    // Header checksum after the flag change (RFC 1624).
    let sum = u32::from(!old) + u32::from(!0x4000u16) + 0x6000;
    let sum = (sum & 0xffff) + (sum >> 16);
    frag[24..26].copy_from_slice(&(!((sum & 0xffff) + (sum >> 16)) as u16).to_be_bytes());
    assert_eq!(bed.run_raw(XDP_INGRESS, &frag), (XDP_PASS, frag.clone()));
    assert_eq!(bed.xdp_counter(Reason::XdpToStack), 1);

    // An ICMP error: TC translates those.
    let err = icmp_error(
        ip("203.0.113.1"),
        ip("10.96.0.10"),
        3,
        &Pkt::tcp("10.96.0.10:80", "198.51.100.7:40000", ACK),
    );
    assert_eq!(bed.run_raw(XDP_INGRESS, &err), (XDP_PASS, err.clone()));
    assert_eq!(bed.xdp_counter(Reason::XdpToStack), 2);

    // A frontend without endpoints: XDP hands the SYN on untouched, TC answers with
    // the RST.
    let syn = Pkt::tcp("198.51.100.7:40001", "10.96.0.20:80", SYN);
    assert_eq!(bed.run(XDP_INGRESS, &syn), (XDP_PASS, syn.clone()));
    assert_eq!(bed.xdp_counter(Reason::XdpToStack), 3);
    assert_eq!(bed.xdp_counter(Reason::TcNoBackend), 0);
    let (verdict, out) = bed.run(TC_INGRESS, &syn);
    assert_eq!(verdict, TC_ACT_REDIRECT);
    assert_eq!(out.flags, RST | ACK);
    assert_eq!(bed.counter(Reason::TcNoBackend), 1, "answered at TC");
}

#[test]
fn etp_local_and_source_ranges_at_xdp() {
    let mut bed = Bed::new();
    let lb = Ipv4Addr::new(203, 0, 113, 30);
    let fe = Frontend::new(lb, 80, Proto::Tcp);
    let flags = svc_flags::LOAD_BALANCER | svc_flags::ETP_LOCAL;
    bed.writer
        .upsert(&entry(
            fe,
            &[("10.2.1.2:8080", 0), ("10.1.1.2:8080", LOCAL)],
            flags,
        ))
        .expect("upsert");
    bed.writer
        .upsert(&entry(
            fe.with_scope(proxy_common::scope::EXTERNAL_LOCAL),
            &[("10.1.1.2:8080", LOCAL)],
            svc_flags::LOAD_BALANCER | svc_flags::LOCAL_ONLY,
        ))
        .expect("upsert twin");
    // Local endpoints only, client address kept (no SNAT), every time.
    for port in 41000..41010 {
        let syn = Pkt::tcp(&format!("198.51.100.7:{port}"), "203.0.113.30:80", SYN);
        let (verdict, out) = bed.run(XDP_INGRESS, &syn);
        assert_eq!(verdict, XDP_PASS);
        assert_eq!(
            out,
            Pkt {
                dst: sa("10.1.1.2:8080"),
                ..syn
            }
        );
    }
    // No local endpoint: dropped at XDP.
    bed.writer
        .upsert(&entry(
            fe.with_scope(proxy_common::scope::EXTERNAL_LOCAL),
            &[],
            svc_flags::LOAD_BALANCER | svc_flags::LOCAL_ONLY,
        ))
        .expect("upsert twin");
    let syn = Pkt::tcp("198.51.100.7:42000", "203.0.113.30:80", SYN);
    assert_eq!(bed.run(XDP_INGRESS, &syn).0, XDP_DROP);
    assert_eq!(bed.xdp_counter(Reason::TcNoLocalBackend), 1);
    assert_eq!(bed.counter(Reason::TcNoLocalBackend), 0);

    // loadBalancerSourceRanges: 198.51.100.0/24 allowed, others dropped at XDP.
    let lb = Frontend::new(Ipv4Addr::new(203, 0, 113, 10), 443, Proto::Tcp);
    let mut e = entry(
        lb,
        &[("10.1.1.2:8443", LOCAL)],
        svc_flags::LOAD_BALANCER | svc_flags::SOURCE_RANGES,
    );
    e.source_ranges = vec![(ip("198.51.100.0"), 24)];
    bed.writer.upsert(&e).expect("upsert");
    let (verdict, out) = bed.run(
        XDP_INGRESS,
        &Pkt::tcp("198.51.100.7:40000", "203.0.113.10:443", SYN),
    );
    assert_eq!((verdict, out.dst), (XDP_PASS, sa("10.1.1.2:8443")));
    let denied = Pkt::tcp("192.0.2.50:40000", "203.0.113.10:443", SYN);
    assert_eq!(bed.run(XDP_INGRESS, &denied).0, XDP_DROP);
    assert_eq!(bed.xdp_counter(Reason::TcSourceDenied), 1);
}

/// A namespace whose FIB answers: `x0` (the node's 192.0.2.1/24, the client and
/// 10.2.0.0/16 behind routers with permanent neighbour entries) and `y0` (10.9.0.1/24,
/// 10.3.0.0/16 behind a router), 10.4.0.0/16 via a router with no neighbour entry.
fn fib_netns() -> (Netns, u32, u32) {
    let ns = Netns::new(unique("ebp-xf-"));
    for (a, b) in [("x0", "x1"), ("y0", "y1")] {
        ns.ip(&["link", "add", a, "type", "veth", "peer", "name", b]);
        ns.ip(&["link", "set", a, "up"]);
        ns.ip(&["link", "set", b, "up"]);
    }
    ns.ip(&["addr", "add", "192.0.2.1/24", "dev", "x0"]);
    ns.ip(&["addr", "add", "10.9.0.1/24", "dev", "y0"]);
    for (via, mac, dev) in [
        ("192.0.2.254", "02:00:00:00:00:fe", "x0"),
        ("192.0.2.253", "02:00:00:00:00:fd", "x0"),
        ("10.9.0.254", "02:00:00:00:09:fe", "y0"),
    ] {
        ns.ip(&[
            "neigh",
            "replace",
            via,
            "lladdr",
            mac,
            "nud",
            "permanent",
            "dev",
            dev,
        ]);
    }
    ns.ip(&["route", "add", "10.2.0.0/16", "via", "192.0.2.254"]);
    ns.ip(&["route", "add", "198.51.100.0/24", "via", "192.0.2.253"]);
    ns.ip(&["route", "add", "10.3.0.0/16", "via", "10.9.0.254"]);
    ns.ip(&["route", "add", "10.4.0.0/16", "via", "192.0.2.250"]);
    support::run(
        "ip",
        &[
            "netns",
            "exec",
            &ns.name,
            "sysctl",
            "-qw",
            "net.ipv4.ip_forward=1",
        ],
    );
    let index = |dev: &str| -> u32 {
        let p = format!("/proc/sys/net/ipv4/conf/{dev}/forwarding");
        let _guard = ns.enter();
        assert!(std::path::Path::new(&p).exists());
        let c = std::ffi::CString::new(dev).expect("name");
        // SAFETY: a valid C string.
        unsafe { libc::if_nametoindex(c.as_ptr()) }
    };
    let (x0, y0) = (index("x0"), index("y0"));
    (ns, x0, y0)
}

fn mac_of(ns: &Netns, dev: &str) -> [u8; 6] {
    let out = std::process::Command::new("ip")
        .args(["-n", &ns.name, "-o", "link", "show", dev])
        .output()
        .expect("ip link");
    let text = String::from_utf8_lossy(&out.stdout);
    let mac = text
        .split("link/ether ")
        .nth(1)
        .and_then(|s| s.split_whitespace().next())
        .expect("mac");
    let b: Vec<u8> = mac
        .split(':')
        .map(|h| u8::from_str_radix(h, 16).expect("hex"))
        .collect();
    b.try_into().expect("6 bytes")
}

#[test]
fn remote_backends_are_snatted_and_forwarded_by_xdp_tx_or_redirect_after_a_fib_lookup() {
    let mut bed = Bed::new();
    let (ns, x0, y0) = fib_netns();
    let x0_mac = mac_of(&ns, "x0");
    let np = Frontend::new(Ipv4Addr::UNSPECIFIED, 30080, Proto::Tcp);
    bed.writer
        .upsert(&entry(np, &[("10.2.1.2:8080", 0)], svc_flags::NODE_PORT))
        .expect("upsert");
    let np2 = Frontend::new(Ipv4Addr::UNSPECIFIED, 30081, Proto::Udp);
    bed.writer
        .upsert(&entry(np2, &[("10.3.1.2:8080", 0)], svc_flags::NODE_PORT))
        .expect("upsert");
    let np3 = Frontend::new(Ipv4Addr::UNSPECIFIED, 30082, Proto::Tcp);
    bed.writer
        .upsert(&entry(np3, &[("10.4.1.2:8080", 0)], svc_flags::NODE_PORT))
        .expect("upsert");
    let _in_ns = ns.enter();
    let run = |pkt: &Pkt, ifindex: u32| {
        let (v, out) = bed.run_ctx(XDP_INGRESS, &pkt.build(), Some(ifindex));
        (v, Pkt::parse(&out), out)
    };

    // NodePort TCP, backend behind the router on the client's interface: SNAT to the
    // node's address and a free port, Ethernet addresses from the FIB, XDP_TX.
    let syn = Pkt::tcp("198.51.100.7:40000", "192.0.2.1:30080", SYN);
    let (verdict, out, raw) = run(&syn, x0);
    assert_eq!(verdict, XDP_TX);
    assert_eq!(out.dst, sa("10.2.1.2:8080"));
    assert_eq!(out.src.ip(), ip("192.0.2.1"));
    let snat_port = out.src.port();
    assert!((32768..61000).contains(&snat_port), "{snat_port}");
    assert_eq!(&raw[0..6], &[2, 0, 0, 0, 0, 0xfe], "to the router");
    assert_eq!(&raw[6..12], &x0_mac, "from x0");
    assert_eq!(bed.xdp_counter(Reason::TcNewFlow), 1);
    // The backend's reply, to the SNAT address: both ends restored, sent back to the
    // client's router.
    let reply = Pkt::tcp(
        "10.2.1.2:8080",
        &format!("192.0.2.1:{snat_port}"),
        SYN | ACK,
    );
    let (verdict, out, raw) = run(&reply, x0);
    assert_eq!(verdict, XDP_TX);
    assert_eq!(
        (out.src, out.dst),
        (sa("192.0.2.1:30080"), sa("198.51.100.7:40000"))
    );
    assert_eq!(&raw[0..6], &[2, 0, 0, 0, 0, 0xfd], "to the client's router");
    assert_eq!(bed.xdp_counter(Reason::TcReply), 1);
    // The client's next packet: the same SNAT port, from the entry.
    let (verdict, out, _) = run(&Pkt { flags: ACK, ..syn }, x0);
    assert_eq!(verdict, XDP_TX);
    assert_eq!(out.src, sa(&format!("192.0.2.1:{snat_port}")));
    assert_eq!(bed.xdp_counter(Reason::TcFlow), 1);

    // UDP, backend behind another interface: XDP_REDIRECT.
    let q = Pkt::udp("198.51.100.7:5000", "192.0.2.1:30081");
    let (verdict, out, raw) = run(&q, x0);
    assert_eq!(verdict, XDP_REDIRECT, "to y0 ({y0})");
    assert_eq!(out.dst, sa("10.3.1.2:8080"));
    assert_eq!(out.src.ip(), ip("192.0.2.1"));
    assert_eq!(&raw[0..6], &[2, 0, 0, 0, 9, 0xfe]);

    // No neighbour entry for the router yet: XDP cannot send it; the packet reaches TC
    // untouched and TC handles the whole flow (its redirect resolves the neighbour).
    let syn = Pkt::tcp("198.51.100.7:40002", "192.0.2.1:30082", SYN);
    let (verdict, out, _) = run(&syn, x0);
    assert_eq!((verdict, out), (XDP_PASS, syn.clone()));
    assert_eq!(bed.xdp_counter(Reason::XdpToStack), 1);
    assert_eq!(
        bed.xdp_counter(Reason::TcNewFlow),
        2,
        "not a new flow at XDP"
    );
    let (_, out) = bed.run(TC_INGRESS, &syn);
    assert_eq!(out.dst, sa("10.4.1.2:8080"));
    assert_eq!(out.src.ip(), ip("192.0.2.1"));
    assert_eq!(bed.counter(Reason::TcNewFlow), 1, "a new flow at TC");
}

/// Pins the calling thread to the CPU it runs on (the FIB cache is per CPU); returns the
/// affinity to restore.
fn pin_to_this_cpu() -> libc::cpu_set_t {
    // SAFETY: sched_{get,set}affinity/sched_getcpu on this thread with sets we own.
    unsafe {
        let mut before: libc::cpu_set_t = std::mem::zeroed();
        libc::sched_getaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), &mut before);
        let mut set: libc::cpu_set_t = std::mem::zeroed();
        libc::CPU_SET(libc::sched_getcpu().max(0) as usize, &mut set);
        assert_eq!(
            libc::sched_setaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), &set),
            0,
            "pinning the test thread"
        );
        before
    }
}

/// The router's MAC address in `fib_netns` changes to 02:00:00:00:09:ee.
fn replace_router_mac(ns: &Netns) {
    ns.ip(&[
        "neigh",
        "replace",
        "10.9.0.254",
        "lladdr",
        "02:00:00:00:09:ee",
        "nud",
        "permanent",
        "dev",
        "y0",
    ]);
}

/// The `FIB_HOP4` key of a packet arriving on `ifindex` from `src` to `dst`.
fn fib_hop_key(ifindex: u32, src: [u8; 4], dst: [u8; 4]) -> [u8; 12] {
    let mut key = [0u8; 12];
    key[0..4].copy_from_slice(&ifindex.to_ne_bytes());
    key[4..8].copy_from_slice(&src);
    key[8..12].copy_from_slice(&dst);
    key
}

/// XDP reuses a FIB answer for 100 ms (`xdp::FIB_HOP_TTL_NS`) and then asks the FIB
/// again: a neighbour's new MAC address and a changed route are followed once it has
/// passed. (That the cached answer is really used within the TTL is checked without the
/// clock by `a_cached_next_hop_is_used_until_its_ttl_and_dropped_when_removed`.)
#[test]
fn a_cached_next_hop_follows_neighbour_and_route_changes_within_its_ttl() {
    let mut bed = Bed::new();
    let (ns, x0, y0) = fib_netns();
    let np = Frontend::new(Ipv4Addr::UNSPECIFIED, 30081, Proto::Udp);
    bed.writer
        .upsert(&entry(np, &[("10.3.1.2:8080", 0)], svc_flags::NODE_PORT))
        .expect("upsert");
    let _in_ns = ns.enter();
    let before = pin_to_this_cpu();
    let q = Pkt::udp("198.51.100.7:5000", "192.0.2.1:30081");
    let send = || {
        let (v, out) = bed.run_ctx(XDP_INGRESS, &q.build(), Some(x0));
        (v, out[0..6].to_vec())
    };
    let ttl = Duration::from_millis(100);
    // Past the TTL, with the kernel's coarse clock a tick or two behind.
    let past_ttl = ttl + Duration::from_millis(60);

    let (v, dmac) = send();
    assert_eq!((v, dmac), (XDP_REDIRECT, vec![2, 0, 0, 0, 9, 0xfe]));
    // The answer is in this CPU's cache: (x0, the SNAT address, the backend) -> y0 and
    // the router's MAC (`FibHop`: stamp, ifindex, smac, dmac).
    {
        let map = bed.ebpf.map("FIB_HOP4").expect("FIB_HOP4");
        let hops: aya::maps::PerCpuHashMap<_, [u8; 12], [u8; 24]> =
            aya::maps::PerCpuHashMap::try_from(map).expect("per-CPU hash");
        let key = fib_hop_key(x0, [192, 0, 2, 1], [10, 3, 1, 2]);
        let per_cpu = hops.get(&key, 0).expect("the FIB answer is cached");
        assert!(
            per_cpu
                .iter()
                .any(|h| h[8..12] == y0.to_ne_bytes() && h[18..24] == [2, 0, 0, 0, 9, 0xfe]),
            "a CPU's cached hop is y0 and the router's MAC"
        );
    }
    replace_router_mac(&ns);
    std::thread::sleep(past_ttl);
    let (v, dmac) = send();
    assert_eq!(
        (v, dmac),
        (XDP_REDIRECT, vec![2, 0, 0, 0, 9, 0xee]),
        "the new MAC address once the TTL has passed"
    );
    // The route moves to the client's side: XDP_TX out of x0 to its router.
    ns.ip(&["route", "replace", "10.3.0.0/16", "via", "192.0.2.254"]);
    std::thread::sleep(past_ttl);
    let (v, dmac) = send();
    assert_eq!((v, dmac), (XDP_TX, vec![2, 0, 0, 0, 0, 0xfe]));
    // The route goes: XDP hands the packet to TC untouched, after the TTL.
    ns.ip(&["route", "del", "10.3.0.0/16"]);
    std::thread::sleep(past_ttl);
    let frame = q.build();
    let (v, out) = bed.run_ctx(XDP_INGRESS, &frame, Some(x0));
    // SAFETY: restoring this thread's own affinity.
    unsafe { libc::sched_setaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), &before) };
    assert_eq!((v, out), (XDP_PASS, frame), "no route: to TC untouched");
}

/// Within its TTL the cached FIB answer is what XDP forwards by, not a new lookup: with
/// the object loaded with a TTL of an hour (`loader::load_object_with`, the same global
/// the agent leaves at 100 ms), a neighbour's new MAC address and a route moved away are
/// not seen while the entry is in the cache, whatever the time between the packets; once
/// the entry is removed from `FIB_HOP4` the next packet asks the FIB and follows them.
/// Fails if the cache is not used (or not keyed as `FIB_HOP4` says).
#[test]
fn a_cached_next_hop_is_used_until_its_ttl_and_dropped_when_removed() {
    let mut bed = Bed::with_fib_hop_ttl(Duration::from_secs(3600));
    let (ns, x0, _y0) = fib_netns();
    let np = Frontend::new(Ipv4Addr::UNSPECIFIED, 30081, Proto::Udp);
    bed.writer
        .upsert(&entry(np, &[("10.3.1.2:8080", 0)], svc_flags::NODE_PORT))
        .expect("upsert");
    let _in_ns = ns.enter();
    let before = pin_to_this_cpu();
    let q = Pkt::udp("198.51.100.7:5000", "192.0.2.1:30081");
    let send = |bed: &Bed| {
        let (v, out) = bed.run_ctx(XDP_INGRESS, &q.build(), Some(x0));
        (v, out[0..6].to_vec())
    };
    let forget = |bed: &mut Bed| {
        let map = bed.ebpf.map_mut("FIB_HOP4").expect("FIB_HOP4");
        let mut hops: aya::maps::PerCpuHashMap<_, [u8; 12], [u8; 24]> =
            aya::maps::PerCpuHashMap::try_from(map).expect("per-CPU hash");
        hops.remove(&fib_hop_key(x0, [192, 0, 2, 1], [10, 3, 1, 2]))
            .expect("the FIB answer was cached");
    };

    assert_eq!(send(&bed), (XDP_REDIRECT, vec![2, 0, 0, 0, 9, 0xfe]));
    replace_router_mac(&ns);
    // The kernel's neighbour table has the new address; XDP still uses its cached one.
    let neigh = std::process::Command::new("ip")
        .args(["-n", &ns.name, "neigh", "show", "10.9.0.254", "dev", "y0"])
        .output()
        .expect("ip neigh show");
    let neigh = String::from_utf8_lossy(&neigh.stdout);
    assert!(neigh.contains("02:00:00:00:09:ee"), "{neigh}");
    assert_eq!(
        send(&bed),
        (XDP_REDIRECT, vec![2, 0, 0, 0, 9, 0xfe]),
        "within the TTL the cached answer is used after the MAC address changed"
    );
    ns.ip(&["route", "replace", "10.3.0.0/16", "via", "192.0.2.254"]);
    assert_eq!(
        send(&bed),
        (XDP_REDIRECT, vec![2, 0, 0, 0, 9, 0xfe]),
        "within the TTL the cached answer is used after the route moved"
    );
    // Without the entry the FIB is asked again: the moved route (XDP_TX to x0's router).
    forget(&mut bed);
    assert_eq!(send(&bed), (XDP_TX, vec![2, 0, 0, 0, 0, 0xfe]));
    // SAFETY: restoring this thread's own affinity.
    unsafe { libc::sched_setaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), &before) };
}

/// `--acceleration native` on an interface whose driver has no native XDP (a bridge,
/// made in a test namespace) fails with an error naming the interface, and leaves no
/// hook of this install behind; `generic` attaches there (skb mode) and is pinned.
#[test]
fn native_acceleration_without_driver_support_is_refused_naming_the_interface() {
    let env = support::TestEnv::outside_cgroup();
    let ns = Netns::new(unique("ebp-xn-"));
    ns.ip(&["link", "add", "br0", "type", "bridge"]);
    ns.ip(&["link", "set", "br0", "up"]);
    let _cleanup = support::tc::UninstallIn::new(&ns, &env.pins.path);
    let install = |acceleration| {
        let _g = ns.enter();
        proxy_user::loader::install(&proxy_user::loader::InstallOptions {
            pin_path: env.pins.path.clone(),
            cgroup: Some(env.cgroup.path.clone()),
            interfaces: vec!["br0".into()],
            conntrack_flows: proxy_user::loader::DEFAULT_CONNTRACK_FLOWS,
            service_entries: proxy_user::loader::DEFAULT_SERVICE_ENTRIES,
            map_sizes: None,
            tc_attach: proxy_user::loader::TcAttachMode::Auto,
            acceleration,
        })
    };
    let e = install(proxy_user::loader::Acceleration::Native).expect_err("no native XDP");
    let text = e.to_string();
    assert!(
        text.contains("native XDP") && text.contains("br0") && text.contains("generic"),
        "{text}"
    );
    let links = env.pins.path.join("links");
    let left: Vec<_> = std::fs::read_dir(&links)
        .map(|d| d.flatten().map(|e| e.file_name()).collect())
        .unwrap_or_default();
    assert!(left.is_empty(), "rolled back: {left:?}");

    let r = install(proxy_user::loader::Acceleration::Generic).expect("generic XDP");
    assert!(r.attached.contains(&"xdp-br0".to_string()), "{r:?}");
    let out = std::process::Command::new("ip")
        .args(["-n", &ns.name, "-d", "link", "show", "br0"])
        .output()
        .expect("ip");
    assert!(String::from_utf8_lossy(&out.stdout).contains("xdpgeneric"));
    assert_eq!(
        proxy_user::pins::PinDir::new(&env.pins.path)
            .read_meta(
                proxy_common::meta::ACCELERATION,
                proxy_user::pins::Access::ReadOnly
            )
            .expect("META"),
        proxy_common::acceleration::GENERIC
    );
}

/// Service CIDRs at XDP (issue #24 item 5): an unallocated address inside a Service CIDR
/// is dropped at XDP (`svc_cidr_unallocated` in `XDP_STATS`); a ClusterIP's unused port
/// is handed to TC untouched (`xdp_to_stack`), which answers the REJECT; the node's
/// address and anything outside the CIDRs pass untouched, counted nowhere.
#[test]
fn a_service_cidr_miss_is_dropped_at_xdp_or_handed_to_tc_for_the_reject() {
    let mut bed = Bed::new();
    let fe = Frontend::new(Ipv4Addr::new(10, 96, 0, 10), 80, Proto::Tcp);
    bed.writer
        .upsert(&entry(fe, &[("10.1.1.2:8080", LOCAL)], 0))
        .expect("upsert");
    let want = proxy_user::svc_cidr::wanted(&[(ip("10.96.0.0"), 16)], [&ip("10.96.0.10")]);
    proxy_user::svc_cidr::write(&bed.pins.dir(), &want).expect("SVC_CIDR4");
    let to_stack = bed.xdp_counter(Reason::XdpToStack);
    let dropped = bed.xdp_counter(Reason::SvcCidrUnallocated);

    let unallocated = Pkt::tcp("198.51.100.7:40001", "10.96.5.5:80", SYN);
    let (verdict, _) = bed.run(XDP_INGRESS, &unallocated);
    assert_eq!(verdict, XDP_DROP);
    assert_eq!(bed.xdp_counter(Reason::SvcCidrUnallocated), dropped + 1);

    let unused_port = Pkt::tcp("198.51.100.7:40000", "10.96.0.10:81", SYN);
    let (verdict, out) = bed.run(XDP_INGRESS, &unused_port);
    assert_eq!(
        (verdict, out.src, out.dst),
        (XDP_PASS, unused_port.src, unused_port.dst)
    );
    assert_eq!(bed.xdp_counter(Reason::XdpToStack), to_stack + 1);
    // ... and TC, next, answers it.
    let (verdict, out) = bed.run(TC_INGRESS, &unused_port);
    assert_eq!((verdict, out.flags), (TC_ACT_REDIRECT, RST | ACK));

    for p in [
        Pkt::tcp("198.51.100.7:40003", "192.0.2.1:22", SYN),
        Pkt::tcp("198.51.100.7:40005", "10.97.0.0:80", SYN),
    ] {
        let (verdict, out) = bed.run(XDP_INGRESS, &p);
        assert_eq!(
            (verdict, out.src, out.dst),
            (XDP_PASS, p.src, p.dst),
            "{}",
            p.dst
        );
    }
    assert_eq!(
        (
            bed.xdp_counter(Reason::XdpToStack),
            bed.xdp_counter(Reason::SvcCidrUnallocated)
        ),
        (to_stack + 1, dropped + 1)
    );
}
