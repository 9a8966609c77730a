//! Privileged end-to-end tests of the `proxyctl` binary against real pinned maps.
//!
//! `support::TestEnv` installs the datapath on a child cgroup holding this process, with
//! a per-run pin directory. Services are written with the real `Writer` (names, flags,
//! several backends, none, IPv6, a NodePort with its ext-local twin, a LoadBalancer with
//! source ranges); four connections go through the socket hooks so the counters are
//! real; a node address and conntrack entries are inserted through writable fds (the TC
//! datapath that fills those is tested in `tc_datapath.rs`). Then:
//! - every subcommand's output is compared with a golden transcript (the pin path is
//!   replaced by `<PIN>`; conntrack ages are pinned by writing `last_seen` just before);
//! - the JSON is parsed back and compared with what was written;
//! - proxyctl cannot change anything: an update through a descriptor opened the way it
//!   opens maps fails with EPERM, and every map is byte-identical before and after
//!   running every subcommand;
//! - errors: nothing pinned (3), incompatible ABI (5), not root (4), usage (2);
//! - the kube-proxy rules `explain` prints are what `iptables-save` prints: restored into
//!   a fresh network namespace, every rule comes back byte for byte.
//!
//! IP plan: pod1 = 10.240.1.2 / fd00:240:1::2 (real servers on 8080), other backends in
//! 10.244.9.0/24 and fd00:244::/64 (never contacted), ClusterIPs in 10.96.0.0/16 and
//! fd00:96::/64, node address 192.168.50.1, clients 198.51.100.7 and 2001:db8::7.
//!
//! Needs root; fails (never skips) without it. `PROXYCTL_GOLDEN_OUT=FILE` writes the
//! transcript this run produced, to review and paste into `GOLDEN` after a deliberate
//! change of output.
//!
//! Over 600 lines: one suite (every proxyctl view against live maps, with its golden
//! transcript). Each file under `tests/` is a test binary of its own that links the whole
//! crate, so a suite is split into modules only when its scenarios stop sharing set-up
//! (shared helpers live in `tests/support/`).

mod support;

use std::{
    collections::BTreeMap,
    net::{IpAddr, Ipv4Addr, SocketAddr},
    os::{fd::AsFd as _, unix::process::CommandExt as _},
    path::Path,
    process::Command,
};

use aya::maps::{Array, HashMap, Map, MapData, MapError};
use proxy_common::{
    backend_flags, ct_flags, map_names, proto, scope, svc_flags, Ct4Key, Ct4Value, Ct6Key,
    Ct6Value, Svc4Key, SvcEntry,
};
use proxy_user::{
    ctl::maps::{monotonic_ns, open_pinned_rdonly},
    model::{port_net, v4_word, v6_words},
    Backend, Frontend, Proto, ServiceEntry,
};
use support::{tcp_ask, TestEnv, Topology};

const BIN: &str = env!("CARGO_BIN_EXE_proxyctl");

fn pod() -> Ipv4Addr {
    Topology::pod_v4(1)
}

fn sa(s: &str) -> SocketAddr {
    s.parse().expect("socket address")
}

fn backend(addr: &str, flags: u8) -> Backend {
    Backend {
        addr: sa(addr),
        flags,
    }
}

/// Everything written, in write order (service ids 1..=8 and backend ids follow it).
fn entries() -> Vec<ServiceEntry> {
    let fe = |a: &str, port, proto| Frontend::new(a.parse::<IpAddr>().expect("ip"), port, proto);
    let pod8080 = format!("{}:8080", pod());
    let node_port = fe("0.0.0.0", 30080, Proto::Tcp);
    vec![
        ServiceEntry {
            name: "default/echo".into(),
            ..ServiceEntry::new(fe("10.96.0.20", 8080, Proto::Tcp), [sa(&pod8080)])
        },
        ServiceEntry {
            name: "default/web:http".into(),
            flags: svc_flags::AFFINITY,
            affinity_timeout: 10800,
            backends: vec![
                backend(&pod8080, 0),
                backend("10.244.9.2:8080", backend_flags::TERMINATING),
                backend("10.244.9.3:8080", 0),
            ],
            ..ServiceEntry::new(fe("10.96.0.10", 80, Proto::Tcp), [])
        },
        ServiceEntry {
            name: "kube-system/dns:dns".into(),
            flags: svc_flags::LOCAL_ONLY,
            backends: vec![backend(&format!("{}:53", pod()), backend_flags::LOCAL)],
            ..ServiceEntry::new(fe("10.96.0.53", 53, Proto::Udp), [])
        },
        ServiceEntry {
            name: "default/empty".into(),
            ..ServiceEntry::new(fe("10.96.0.30", 80, Proto::Tcp), [])
        },
        ServiceEntry {
            name: "default/web6:http".into(),
            ..ServiceEntry::new(
                fe("fd00:96::10", 80, Proto::Tcp),
                [
                    SocketAddr::new(IpAddr::V6(Topology::pod_v6(1)), 8080),
                    sa("[fd00:244::7]:8080"),
                ],
            )
        },
        ServiceEntry {
            name: "default/web:http".into(),
            flags: svc_flags::NODE_PORT | svc_flags::ETP_LOCAL,
            backends: vec![
                backend("10.244.9.3:8080", 0),
                backend(&pod8080, backend_flags::LOCAL),
            ],
            ..ServiceEntry::new(node_port, [])
        },
        ServiceEntry {
            name: "default/web:http".into(),
            flags: svc_flags::NODE_PORT | svc_flags::LOCAL_ONLY,
            backends: vec![backend(&pod8080, backend_flags::LOCAL)],
            ..ServiceEntry::new(node_port.with_scope(scope::EXTERNAL_LOCAL), [])
        },
        ServiceEntry {
            name: "default/lb:https".into(),
            flags: svc_flags::LOAD_BALANCER | svc_flags::SOURCE_RANGES,
            source_ranges: vec![(IpAddr::V4(Ipv4Addr::new(203, 0, 113, 0)), 24)],
            ..ServiceEntry::new(fe("192.0.2.10", 443, Proto::Tcp), [sa("10.244.9.4:8443")])
        },
    ]
}

fn writable<K: aya::Pod, V: aya::Pod>(pin: &Path, name: &str) -> HashMap<MapData, K, V> {
    let data = MapData::from_pin(pin.join(name)).expect("open pinned map");
    Map::from_map_data(data)
        .expect("map")
        .try_into()
        .expect("typed map")
}

/// The node's address, as the agent writes it.
fn add_node_address(pin: &Path) {
    let mut m: HashMap<MapData, u32, u8> = writable(pin, map_names::NODE_ADDRS4);
    m.insert(v4_word(Ipv4Addr::new(192, 168, 50, 1)), 1, 0)
        .expect("NODE_ADDRS4");
}

/// Two flows as the TC datapath writes them, last seen 5.5 s ago: a NodePort flow from
/// outside, SNATed to the node, to backend 3 (10.244.9.3:8080); an IPv6 flow routed to
/// the v6 ClusterIP, to backend 6 ([fd00:244::7]:8080), not SNATed.
fn put_flows(pin: &Path) {
    let seen = monotonic_ns() - 5_500_000_000;
    let w = |s: &str| v4_word(s.parse().expect("v4"));
    let mut ct4: HashMap<MapData, Ct4Key, Ct4Value> = writable(pin, map_names::CT4);
    let k4 = |s: &str, d: &str, sp: u16, dp: u16, dir| {
        Ct4Key::new(w(s), w(d), port_net(sp), port_net(dp), proto::TCP, dir)
    };
    let v4 = |dn: (&str, u16), sn: (&str, u16), packets| Ct4Value {
        dnat_addr: w(dn.0),
        snat_addr: w(sn.0),
        dnat_port: port_net(dn.1),
        snat_port: port_net(sn.1),
        service_id: 6,
        backend_id: 3,
        flags: ct_flags::SNAT | ct_flags::SEEN_REPLY,
        last_seen: seen,
        packets,
    };
    ct4.insert(
        k4("198.51.100.7", "192.168.50.1", 51000, 30080, 0),
        v4(("10.244.9.3", 8080), ("192.168.50.1", 40000), 7),
        0,
    )
    .expect("CT4 original");
    ct4.insert(
        k4("10.244.9.3", "192.168.50.1", 8080, 40000, 1),
        v4(("198.51.100.7", 51000), ("192.168.50.1", 30080), 6),
        0,
    )
    .expect("CT4 reply");

    let w6 = |s: &str| v6_words(s.parse().expect("v6"));
    let mut ct6: HashMap<MapData, Ct6Key, Ct6Value> = writable(pin, map_names::CT6);
    let k6 = |s: &str, d: &str, sp: u16, dp: u16, dir| {
        Ct6Key::new(w6(s), w6(d), port_net(sp), port_net(dp), proto::TCP, dir)
    };
    let v6 = |dn: (&str, u16), sn: (&str, u16), packets| Ct6Value {
        dnat_addr: w6(dn.0),
        snat_addr: w6(sn.0),
        dnat_port: port_net(dn.1),
        snat_port: port_net(sn.1),
        service_id: 5,
        backend_id: 6,
        flags: ct_flags::SEEN_REPLY,
        last_seen: seen,
        packets,
    };
    ct6.insert(
        k6("2001:db8::7", "fd00:96::10", 51000, 80, 0),
        v6(("fd00:244::7", 8080), ("::", 0), 3),
        0,
    )
    .expect("CT6 original");
    ct6.insert(
        k6("fd00:244::7", "2001:db8::7", 8080, 51000, 1),
        v6(("::", 0), ("fd00:96::10", 80), 2),
        0,
    )
    .expect("CT6 reply");
}

/// The datapath with every kind of entry, and four real connections to default/echo.
fn populated_env() -> TestEnv {
    let mut env = TestEnv::new(1);
    env.serve_all(8080);
    for e in entries() {
        env.writer().upsert(&e).expect("upsert");
    }
    add_node_address(&env.pins.path);
    let echo = sa("10.96.0.20:8080");
    env.in_client(|| {
        for _ in 0..4 {
            let (answer, peer) = tcp_ask(echo).expect("connect to default/echo");
            assert_eq!((answer.as_str(), peer), ("pod1", echo));
        }
    });
    env
}

struct Run {
    code: i32,
    stdout: String,
    stderr: String,
}

fn proxyctl_cmd(pin: &Path, args: &[&str]) -> Command {
    let mut c = Command::new(BIN);
    c.arg("--pin-path")
        .arg(pin)
        .args(args)
        .env_remove("PROXY_PIN_PATH");
    c
}

fn run(mut cmd: Command) -> Run {
    let out = cmd.output().expect("run proxyctl");
    Run {
        code: out.status.code().unwrap_or(-1),
        stdout: String::from_utf8_lossy(&out.stdout).into_owned(),
        stderr: String::from_utf8_lossy(&out.stderr).into_owned(),
    }
}

/// Runs `proxyctl ARGS`, requires success and a clean stderr, normalizes the pin path.
fn ok(pin: &Path, args: &[&str]) -> String {
    let r = run(proxyctl_cmd(pin, args));
    assert_eq!(
        (r.code, r.stderr.as_str()),
        (0, ""),
        "proxyctl {args:?} failed:\n{}",
        r.stderr
    );
    r.stdout
        .replace(pin.to_str().expect("utf-8 pin path"), "<PIN>")
}

/// Every subcommand, in transcript order (conntrack twice so flows get fresh ages).
const TRANSCRIPT: &[&[&str]] = &[
    &["services"],
    &["services", "-o", "wide"],
    &["backends"],
    &["backends", "-o", "wide"],
    &["stats"],
    &["conntrack"],
    &["conntrack", "-o", "wide", "--addr", "2001:db8::7"],
    &["affinity"],
    &["explain", "10.96.0.20:8080"],
    &["explain", "10.96.0.10:80"],
    &["explain", "192.168.50.1:30080"],
    &["explain", "10.96.0.30:80"],
    &["explain", "10.96.0.53:53/udp"],
    &["explain", "[fd00:96::10]:80"],
    &["explain", "192.0.2.10:443"],
    &["explain", "10.96.0.10:81"],
    &["watch", "--interval", "100ms", "--iterations", "2"],
    &["dump"],
];

fn transcript(pin: &Path, fresh_flows: bool) -> String {
    let mut out = String::new();
    for args in TRANSCRIPT {
        if fresh_flows && args[0] == "conntrack" {
            put_flows(pin);
        }
        out.push_str(&format!("$ proxyctl {}\n", args.join(" ")));
        out.push_str(&ok(pin, args));
        out.push('\n');
    }
    out
}

#[test]
fn every_subcommand_matches_the_golden_transcript_and_changes_nothing() {
    let env = populated_env();
    let pin = env.pins.path.clone();

    let got = transcript(&pin, true);
    // To review a change of output: PROXYCTL_GOLDEN_OUT=/tmp/t.txt, then diff and paste.
    if let Some(path) = std::env::var_os("PROXYCTL_GOLDEN_OUT") {
        std::fs::write(path, &got).expect("write transcript");
    }
    if got != GOLDEN {
        let line = got
            .lines()
            .zip(GOLDEN.lines())
            .position(|(g, w)| g != w)
            .unwrap_or_else(|| got.lines().count().min(GOLDEN.lines().count()));
        panic!(
            "transcript differs from GOLDEN at line {}:\n got: {:?}\nwant: {:?}\n--- got ---\n{got}",
            line + 1,
            got.lines().nth(line),
            GOLDEN.lines().nth(line)
        );
    }

    // Read-only: every map byte for byte the same after running everything again (and
    // the JSON forms).
    let before = raw_dump(&pin);
    let _ = transcript(&pin, false);
    for args in TRANSCRIPT {
        if args[0] != "dump" && args[0] != "watch" {
            let mut json = args.to_vec();
            json.extend(["-o", "json"]);
            let _ = ok(&pin, &json);
        }
    }
    let after = raw_dump(&pin);
    assert_eq!(
        before.keys().count(),
        map_names::ALL.len(),
        "every map pinned"
    );
    assert_eq!(before, after, "running proxyctl changed a map");
}

#[test]
fn json_reads_back_what_was_written() {
    let env = populated_env();
    let pin = env.pins.path.clone();
    put_flows(&pin);
    let parse = |args: &[&str]| -> serde_json::Value {
        let mut a = args.to_vec();
        a.extend(["-o", "json"]);
        serde_json::from_str(&ok(&pin, &a)).expect("valid JSON")
    };

    let doc = parse(&["services"]);
    assert_eq!(doc["schema"], 1);
    let services = doc["services"].as_array().expect("services");
    let written = entries();
    assert_eq!(services.len(), written.len());
    for e in &written {
        let v = services
            .iter()
            .find(|s| s["frontend"] == e.frontend.to_string())
            .unwrap_or_else(|| panic!("{} missing from {doc:#}", e.frontend));
        assert_eq!(v["service"], e.name.as_str(), "{}", e.frontend);
        assert_eq!(v["flags_raw"], e.flags, "{}", e.frontend);
        assert_eq!(v["affinity_timeout_seconds"], e.affinity_timeout);
        assert_eq!(v["backend_count"], e.backends.len());
        assert_eq!(v["problems"].as_array().map(Vec::len), Some(0), "{v:#}");
        let mut got: Vec<(String, bool, bool)> = v["backends"]
            .as_array()
            .expect("backends")
            .iter()
            .map(|b| {
                (
                    b["endpoint"].as_str().expect("endpoint").to_string(),
                    b["state"] == "terminating",
                    b["local"] == true,
                )
            })
            .collect();
        let mut want: Vec<(String, bool, bool)> = e
            .backends
            .iter()
            .map(|b| {
                (
                    b.addr.to_string(),
                    b.flags & backend_flags::TERMINATING != 0,
                    b.flags & backend_flags::LOCAL != 0,
                )
            })
            .collect();
        got.sort();
        want.sort();
        assert_eq!(got, want, "{}", e.frontend);
        let ranges: Vec<String> = e
            .source_ranges
            .iter()
            .map(|(a, l)| format!("{a}/{l}"))
            .collect();
        assert_eq!(v["source_ranges"], serde_json::json!(ranges));
    }
    let kinds: Vec<&str> = services.iter().filter_map(|s| s["kind"].as_str()).collect();
    for k in ["ClusterIP", "NodePort", "LoadBalancer"] {
        assert!(kinds.contains(&k), "{k} in {kinds:?}");
    }

    // The four real connections are counted on pod1's backend.
    let backends = parse(&["backends"]);
    let pod1 = backends["backends"]
        .as_array()
        .expect("backends")
        .iter()
        .find(|b| b["endpoint"] == format!("{}:8080", pod()) && b["local"] == false)
        .expect("pod1 backend");
    assert_eq!(pod1["connections"], 4);
    assert_eq!(pod1["frontends"], 2, "default/echo and default/web");
    let stats = parse(&["stats"]);
    let translated = stats["counters"]
        .as_array()
        .expect("counters")
        .iter()
        .find(|c| c["reason"] == "translated")
        .expect("translated");
    assert_eq!(translated["count"], 4);

    let ex = parse(&["explain", "10.96.0.10:80"]);
    assert_eq!(ex["matched"], true);
    assert_eq!(ex["service"], "default/web:http");
    let probs: Vec<f64> = ex["paths"][0]["backends"]
        .as_array()
        .expect("choices")
        .iter()
        .filter_map(|b| b["probability"].as_f64())
        .collect();
    assert_eq!(probs, [1.0 / 3.0; 3]);
    let np = parse(&["explain", "192.168.50.1:30080"]);
    assert_eq!(
        (np["via_node_port"].clone(), np["kind"].clone()),
        (true.into(), "NodePort".into())
    );
    assert_eq!(
        (
            np["paths"][0]["path"].clone(),
            np["paths"][0]["frontend"].clone()
        ),
        ("socket".into(), "0.0.0.0:30080/tcp".into())
    );
    assert_eq!(
        (
            np["paths"][1]["path"].clone(),
            np["paths"][1]["frontend"].clone()
        ),
        ("tc".into(), "0.0.0.0:30080/tcp/ext-local".into())
    );
    let none = parse(&["explain", "10.96.0.99:80"]);
    assert_eq!(none["matched"], false);

    let ct = parse(&["conntrack"]);
    let flows = ct["flows"].as_array().expect("flows");
    assert_eq!(flows.len(), 4);
    assert_eq!(flows[0]["direction"], "original");
    assert_eq!(flows[0]["rewrite_destination"], "10.244.9.3:8080");
    assert_eq!(flows[0]["rewrite_source"], "192.168.50.1:40000");
    assert_eq!(flows[0]["service"], "default/web:http");
    assert_eq!(flows[1]["direction"], "reply");
    assert_eq!(flows[1]["rewrite_source"], "192.168.50.1:30080");
    let age = flows[0]["age_seconds"].as_f64().expect("age");
    assert!((5.4..60.0).contains(&age), "age {age}");

    // explain --from: the tracked NodePort flow keeps its conntrack entry's backend; a new
    // flow from another port is random (the Service is not Maglev); a v6 client of a v4
    // destination is a usage error naming both.
    let from =
        |client: &str| parse(&["explain", "192.168.50.1:30080", "--from", client])["flow"].clone();
    let tracked = from("198.51.100.7:51000");
    assert_eq!(
        (tracked["by"].clone(), tracked["endpoint"].clone()),
        ("conntrack".into(), "10.244.9.3:8080".into()),
        "{tracked}"
    );
    assert_eq!(from("198.51.100.7:51001")["by"], "random");
    assert!(parse(&["explain", "192.168.50.1:30080"])["flow"].is_null());
    let r = run(proxyctl_cmd(
        &pin,
        &[
            "explain",
            "192.168.50.1:30080",
            "--from",
            "[2001:db8::7]:51000",
        ],
    ));
    assert_eq!(r.code, 2, "{}", r.stderr);
    assert!(
        r.stderr.contains("[2001:db8::7]:51000") && r.stderr.contains("192.168.50.1:30080/tcp"),
        "{}",
        r.stderr
    );

    // watch -o json: one object per frame.
    let w = ok(
        &pin,
        &[
            "watch",
            "--interval",
            "50ms",
            "--iterations",
            "3",
            "-o",
            "json",
        ],
    );
    let frames: Vec<serde_json::Value> = w
        .lines()
        .map(|l| serde_json::from_str(l).expect("frame"))
        .collect();
    assert_eq!(frames.len(), 3);
    assert!(frames[0]["elapsed_seconds"].is_null());
    assert!(frames[2]["elapsed_seconds"]
        .as_f64()
        .is_some_and(|s| s >= 0.05));
}

#[test]
fn maps_opened_like_proxyctl_refuse_writes() {
    let env = TestEnv::new(1);
    let pin = env.pins.path.clone();
    // The descriptor proxyctl uses: BPF_OBJ_GET with BPF_F_RDONLY.
    let fd = open_pinned_rdonly(&pin.join(map_names::SVC4)).expect("read-only open");
    let data = MapData::from_fd(fd).expect("map data");
    let mut svc4: HashMap<MapData, Svc4Key, SvcEntry> = Map::from_map_data(data)
        .expect("map")
        .try_into()
        .expect("typed");
    let key = Svc4Key::new(v4_word(Ipv4Addr::new(10, 96, 9, 9)), port_net(80), 6, 0, 0);
    let errno = |r: Result<(), MapError>| match r {
        Err(MapError::SyscallError(e)) => e.io_error.raw_os_error(),
        other => panic!("expected a refused syscall, got {other:?}"),
    };
    assert_eq!(
        errno(svc4.insert(key, SvcEntry::default(), 0)),
        Some(libc::EPERM)
    );
    assert_eq!(errno(svc4.remove(&key)), Some(libc::EPERM));
    assert!(
        matches!(svc4.get(&key, 0), Err(MapError::KeyNotFound)),
        "reads work"
    );

    let fd = open_pinned_rdonly(&pin.join(map_names::META)).expect("read-only open");
    let mut meta: Array<MapData, u32> = Map::from_map_data(MapData::from_fd(fd).expect("data"))
        .expect("map")
        .try_into()
        .expect("typed");
    assert_eq!(errno(meta.set(0, 999, 0)), Some(libc::EPERM));
    assert_eq!(meta.get(&0, 0).expect("abi"), proxy_common::ABI_VERSION);
}

#[test]
fn errors_are_clear_and_have_exit_codes() {
    let env = TestEnv::new(1);
    let pin = env.pins.path.clone();

    // Nothing pinned.
    let missing = Path::new("/sys/fs/bpf").join(support::unique("ebpf-proxy-absent-"));
    let r = run(proxyctl_cmd(&missing, &["services"]));
    assert_eq!(r.code, 3, "{}", r.stderr);
    assert!(
        r.stderr.contains(&format!(
            "is proxy-agent running? looked in {}",
            missing.display()
        )),
        "{}",
        r.stderr
    );
    assert!(r.stdout.is_empty());

    // PROXY_PIN_PATH is honoured.
    let out = Command::new(BIN)
        .arg("stats")
        .env("PROXY_PIN_PATH", &pin)
        .output()
        .expect("run");
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );

    // Maps of another ABI version.
    let mut meta: Array<MapData, u32> =
        Map::from_map_data(MapData::from_pin(pin.join(map_names::META)).expect("META"))
            .expect("map")
            .try_into()
            .expect("typed");
    meta.set(0, 999, 0).expect("set ABI");
    let r = run(proxyctl_cmd(&pin, &["services"]));
    meta.set(0, proxy_common::ABI_VERSION, 0)
        .expect("restore ABI");
    assert_eq!(r.code, 5, "{}", r.stderr);
    assert!(
        r.stderr
            .contains("incompatible ebpf-proxy (map ABI version 999, this proxyctl reads version"),
        "{}",
        r.stderr
    );

    // Not root.
    let mut cmd = proxyctl_cmd(&pin, &["services"]);
    cmd.uid(65534).gid(65534);
    let r = run(cmd);
    assert_eq!(r.code, 4, "{}", r.stderr);
    assert!(
        r.stderr.contains("permission denied: run as root"),
        "{}",
        r.stderr
    );

    // Usage.
    let r = run(proxyctl_cmd(&pin, &["explain", "10.96.0.10"]));
    assert_eq!(r.code, 2, "{}", r.stderr);
    assert!(
        r.stderr.contains("expected ADDRESS:PORT[/PROTO]"),
        "{}",
        r.stderr
    );
    let r = run(proxyctl_cmd(&pin, &["dump", "-o", "json"]));
    assert_eq!(r.code, 2, "{}", r.stderr);
    assert!(ok(&pin, &["services"]).starts_with("no frontends programmed"));
}

/// Root gets EACCES from `BPF_OBJ_GET` for a path that is not a pinned BPF object (a
/// regular file outside bpffs, a directory on bpffs): proxyctl names that cause (exit 3),
/// not "run as root".
#[test]
fn a_pin_path_that_is_not_a_bpf_object_names_the_cause() {
    support::require_root();
    // A regular file named META outside bpffs (tmpfs or ext4 under /tmp).
    let dir = std::env::temp_dir().join(support::unique("proxyctl-not-bpffs-"));
    std::fs::create_dir_all(&dir).expect("mkdir");
    std::fs::write(dir.join(map_names::META), b"not a map").expect("write META");
    let r = run(proxyctl_cmd(&dir, &["services"]));
    let _ = std::fs::remove_dir_all(&dir);
    assert_eq!(r.code, 3, "{}", r.stderr);
    assert!(
        r.stderr
            .contains("META: not on a bpffs mount (filesystem magic 0x")
            && r.stderr.contains("not a pinned BPF object")
            && !r.stderr.contains("run as root"),
        "{}",
        r.stderr
    );
    assert!(r.stdout.is_empty());

    // A directory named META on bpffs.
    let dir = Path::new("/sys/fs/bpf").join(support::unique("proxyctl-dir-meta-"));
    std::fs::create_dir_all(dir.join(map_names::META)).expect("mkdir on bpffs");
    let r = run(proxyctl_cmd(&dir, &["stats"]));
    let _ = std::fs::remove_dir(dir.join(map_names::META));
    let _ = std::fs::remove_dir(&dir);
    assert_eq!(r.code, 3, "{}", r.stderr);
    assert!(
        r.stderr
            .contains("META: a directory on bpffs, not a pinned BPF map")
            && !r.stderr.contains("run as root"),
        "{}",
        r.stderr
    );
}

/// The rules `explain` prints are real `iptables-save` output: restored into a fresh
/// network namespace, `iptables-save` / `ip6tables-save` print every one of them back
/// byte for byte (ordering of matches, quoting, the listed probability, `recent`).
#[test]
fn kube_proxy_rules_round_trip_through_iptables_save() {
    let env = populated_env();
    let pin = env.pins.path.clone();
    // (nat rules, filter rules) per family, without duplicates.
    let mut families: [(Vec<String>, Vec<String>); 2] = Default::default();
    for dest in [
        "10.96.0.20:8080",
        "10.96.0.10:80",
        "192.168.50.1:30080",
        "10.96.0.30:80",
        "10.96.0.53:53/udp",
        "[fd00:96::10]:80",
        "192.0.2.10:443",
    ] {
        let doc: serde_json::Value =
            serde_json::from_str(&ok(&pin, &["explain", dest, "-o", "json"])).expect("json");
        let rules = &doc["iptables"];
        let fam = &mut families[usize::from(rules["ipv6"] == true)];
        for (table, out) in [("nat", &mut fam.0), ("filter", &mut fam.1)] {
            for r in rules[table].as_array().expect("rules") {
                let r = r.as_str().expect("rule").to_string();
                if !out.contains(&r) {
                    out.push(r);
                }
            }
        }
    }
    for ((nat, filter), tool) in families.iter().zip(["iptables", "ip6tables"]) {
        let mut input = String::new();
        for (table, rules) in [("nat", nat), ("filter", filter)] {
            if rules.is_empty() {
                continue;
            }
            let mut chains: Vec<&str> = Vec::new();
            for r in rules {
                let words: Vec<&str> = r.split_whitespace().collect();
                let targets = words
                    .windows(2)
                    .filter(|w| w[0] == "-j" && w[1].starts_with("KUBE-"))
                    .map(|w| w[1]);
                for c in std::iter::once(words[1]).chain(targets) {
                    if !chains.contains(&c) {
                        chains.push(c);
                    }
                }
            }
            input.push_str(&format!("*{table}\n"));
            for c in chains {
                input.push_str(&format!(":{c} - [0:0]\n"));
            }
            for r in rules {
                input.push_str(&format!("{r}\n"));
            }
            input.push_str("COMMIT\n");
        }
        let file = std::env::temp_dir().join(support::unique("proxyctl-rules-"));
        std::fs::write(&file, &input).expect("rules file");
        let out = Command::new("unshare")
            .args(["-n", "sh", "-c"])
            .arg(format!(
                "{tool}-restore < {} && {tool}-save -t nat && {tool}-save -t filter",
                file.display()
            ))
            .output()
            .expect("unshare (util-linux) and iptables (cargo xtask setup)");
        let _ = std::fs::remove_file(&file);
        assert!(
            out.status.success(),
            "{tool}-restore refused the rules:\n{}\n{input}",
            String::from_utf8_lossy(&out.stderr)
        );
        let saved = String::from_utf8_lossy(&out.stdout);
        for r in nat.iter().chain(filter) {
            assert!(
                saved.lines().any(|l| l == r),
                "{tool}-save does not print back\n  {r}\nit printed:\n{saved}"
            );
        }
        assert!(!nat.is_empty(), "{tool}: rules were checked");
    }
}

/// Raw `(key, value)` bytes of every entry, per map name.
type RawMaps = BTreeMap<&'static str, Vec<(Vec<u8>, Vec<u8>)>>;

/// Every pinned map's raw entries, through plain `bpf(2)` calls (`bpf_sys`, no proxyctl
/// code).
fn raw_dump(pin: &Path) -> RawMaps {
    let cpus = aya::util::nr_cpus().expect("possible cpus");
    let mut out = BTreeMap::new();
    for name in map_names::ALL {
        let path = pin.join(name);
        if !path.exists() {
            continue;
        }
        let fd = open_pinned_rdonly(&path).expect("open");
        let info = bpf_sys::map_info(fd.as_fd()).expect("map info");
        let (map_type, key_size, value_size) = (
            info.map_type,
            info.key_size as usize,
            info.value_size as usize,
        );
        // SK_STORAGE (`SOCK_REVNAT4/6`): values live in sockets, keyed by a socket fd of
        // the caller; the kernel offers no key iteration (ENOTSUPP). Listed, not read.
        // RINGBUF (`EVENTS`): records, no keys (ENOTSUPP) either.
        if map_type == 24 || map_type == 27 {
            out.insert(name, Vec::new());
            continue;
        }
        // PERCPU_HASH, PERCPU_ARRAY, LRU_PERCPU_HASH: one 8-byte aligned value per CPU.
        let value_len = if matches!(map_type, 5 | 6 | 10) {
            value_size.div_ceil(8) * 8 * cpus
        } else {
            value_size
        };
        let mut entries = Vec::new();
        let mut key: Option<Vec<u8>> = None;
        loop {
            let mut next = vec![0u8; key_size];
            match bpf_sys::map_next_key(fd.as_fd(), key.as_deref(), &mut next) {
                Ok(true) => {}
                Ok(false) => break,
                Err(e) => panic!("{name}: next key: {e}"),
            }
            let mut value = vec![0u8; value_len];
            let found = bpf_sys::map_lookup(fd.as_fd(), &next, &mut value)
                .unwrap_or_else(|e| panic!("{name}: lookup: {e}"));
            assert!(found, "{name}: lookup: the key just listed is absent");
            entries.push((next.clone(), value));
            key = Some(next);
        }
        entries.sort();
        out.insert(name, entries);
    }
    out
}

/// The transcript of `TRANSCRIPT` over `entries()` (see the header on regenerating it).
const GOLDEN: &str = r##"$ proxyctl services
FRONTEND                     KIND          SERVICE              BACKENDS  FLAGS                         SLOT  ID  BACKEND               STATE        CONNS
0.0.0.0:30080/tcp            NodePort      default/web:http     2         etp-local                     1     3   10.244.9.3:8080       ready        0
                                                                                                        2     7   10.240.1.2:8080       ready,local  0
0.0.0.0:30080/tcp/ext-local  NodePort      default/web:http     1         local-only                    1     7   10.240.1.2:8080       ready,local  0
10.96.0.10:80/tcp            ClusterIP     default/web:http     3         affinity=10800s               1     1   10.240.1.2:8080       ready        4
                                                                                                        2     2   10.244.9.2:8080       terminating  0
                                                                                                        3     3   10.244.9.3:8080       ready        0
10.96.0.20:8080/tcp          ClusterIP     default/echo         1         -                             1     1   10.240.1.2:8080       ready        4
10.96.0.30:80/tcp            ClusterIP     default/empty        0         -                             -     -   (none: refused)       -            -
10.96.0.53:53/udp            ClusterIP     kube-system/dns:dns  1         local-only                    1     4   10.240.1.2:53         ready,local  0
192.0.2.10:443/tcp           LoadBalancer  default/lb:https     1         source-ranges=203.0.113.0/24  1     8   10.244.9.4:8443       ready        0
[fd00:96::10]:80/tcp         ClusterIP     default/web6:http    2         -                             1     5   [fd00:240:1::2]:8080  ready        0
                                                                                                        2     6   [fd00:244::7]:8080    ready        0

$ proxyctl services -o wide
FRONTEND                     KIND          SERVICE              SVC-ID  BACKENDS  FLAGS                              SLOT  ID  BACKEND               STATE        LOCAL  CONNS
0.0.0.0:30080/tcp            NodePort      default/web:http     6       2         0x24 etp-local                     1     3   10.244.9.3:8080       ready        no     0
                                                                                                                     2     7   10.240.1.2:8080       ready        yes    0
0.0.0.0:30080/tcp/ext-local  NodePort      default/web:http     7       1         0x6 local-only                     1     7   10.240.1.2:8080       ready        yes    0
10.96.0.10:80/tcp            ClusterIP     default/web:http     2       3         0x1 affinity=10800s                1     1   10.240.1.2:8080       ready        no     4
                                                                                                                     2     2   10.244.9.2:8080       terminating  no     0
                                                                                                                     3     3   10.244.9.3:8080       ready        no     0
10.96.0.20:8080/tcp          ClusterIP     default/echo         1       1         0x0 -                              1     1   10.240.1.2:8080       ready        no     4
10.96.0.30:80/tcp            ClusterIP     default/empty        4       0         0x0 -                              -     -   (none: refused)       -            -      -
10.96.0.53:53/udp            ClusterIP     kube-system/dns:dns  3       1         0x2 local-only                     1     4   10.240.1.2:53         ready        yes    0
192.0.2.10:443/tcp           LoadBalancer  default/lb:https     8       1         0x50 source-ranges=203.0.113.0/24  1     8   10.244.9.4:8443       ready        no     0
[fd00:96::10]:80/tcp         ClusterIP     default/web6:http    5       2         0x0 -                              1     5   [fd00:240:1::2]:8080  ready        no     0
                                                                                                                     2     6   [fd00:244::7]:8080    ready        no     0

$ proxyctl backends
ID  BACKEND               PROTO  STATE        FRONTENDS  CONNS
1   10.240.1.2:8080       tcp    ready        2          4
2   10.244.9.2:8080       tcp    terminating  1          0
3   10.244.9.3:8080       tcp    ready        2          0
4   10.240.1.2:53         udp    ready,local  1          0
5   [fd00:240:1::2]:8080  tcp    ready        1          0
6   [fd00:244::7]:8080    tcp    ready        1          0
7   10.240.1.2:8080       tcp    ready,local  2          0
8   10.244.9.4:8443       tcp    ready        1          0

$ proxyctl backends -o wide
ID  BACKEND               PROTO  STATE        LOCAL  FLAGS  FRONTENDS  CONNS  USED-BY
1   10.240.1.2:8080       tcp    ready        no     0x0    2          4      10.96.0.10:80/tcp,10.96.0.20:8080/tcp
2   10.244.9.2:8080       tcp    terminating  no     0x1    1          0      10.96.0.10:80/tcp
3   10.244.9.3:8080       tcp    ready        no     0x0    2          0      0.0.0.0:30080/tcp,10.96.0.10:80/tcp
4   10.240.1.2:53         udp    ready        yes    0x2    1          0      10.96.0.53:53/udp
5   [fd00:240:1::2]:8080  tcp    ready        no     0x0    1          0      [fd00:96::10]:80/tcp
6   [fd00:244::7]:8080    tcp    ready        no     0x0    1          0      [fd00:96::10]:80/tcp
7   10.240.1.2:8080       tcp    ready        yes    0x2    2          0      0.0.0.0:30080/tcp,0.0.0.0:30080/tcp/ext-local
8   10.244.9.4:8443       tcp    ready        no     0x0    1          0      192.0.2.10:443/tcp

$ proxyctl stats
COUNTER                COUNT  MEANING
translated             4      destination rewritten from a frontend to one of its backends
no_service             0      destination is not a frontend: left alone
no_backend             0      frontend without backends: connect()/sendmsg() failed with ECONNREFUSED
backend_missing        0      slot or backend entry missing (racing delete or writer bug): left alone
unsupported_proto      0      socket protocol other than TCP/UDP: left alone
rev_translated         4      reply source (recvmsg) or peer (getpeername) shown as the frontend again
rev_nat_miss           4      no reverse-NAT entry for this socket and peer: left alone
rev_nat_stale          0      reverse-NAT entry of a frontend that is gone or reused: deleted
rev_nat_update_failed  0      the socket's reverse-NAT entry could not be written
no_local_backend       0      Local traffic policy, no endpoint on this node: failed with EHOSTUNREACH
tc_new_flow            0      TC: new flow to a frontend, DNATed (SNATed when the backend is remote)
tc_flow                0      TC: packet of a known flow, translated from its conntrack entry
tc_reply               0      TC: reply reverse-translated from its conntrack entry
tc_no_backend          0      TC: frontend without endpoints: TCP answered with RST, UDP with ICMP port unreachable, others dropped
tc_source_denied       0      TC: source outside loadBalancerSourceRanges: dropped
tc_snat_failed         0      TC: no SNAT address or free SNAT port: dropped
tc_no_local_backend    0      TC: externalTrafficPolicy Local, no endpoint on this node: dropped
tc_fib_miss            0      TC: no FIB route for a translated packet: handed to the stack
tc_icmp_error          0      TC: ICMP error about a NATed flow, translated for its backend or client
affinity_hit           0      sessionAffinity ClientIP: the client's previous backend again
tc_stale_backend       0      TC: UDP flow whose backend is gone: balanced afresh
tc_reject_limited      0      TC: ICMP port unreachable over the rate limit (1000/s per CPU): dropped
tc_ct_write_failed     0      TC: a new flow's conntrack entries not written: dropped
tc_rewrite_failed      0      TC: a packet rewrite refused half-way: dropped
xdp_to_stack           0      XDP: left untouched to the stack and TC (fragment, ICMP error, REJECT answer, FIB result XDP cannot forward by)
tc_dsr_encap           0      TC DSR, first node: sent to a remote backend with the frontend in the DSR option (client address kept, no SNAT)
tc_dsr_decap           0      TC DSR, backend's node: DSR option read (reply entry recorded) and removed
tc_dsr_reply           0      TC DSR, backend's node: reply sent straight to the client from the frontend
tc_dsr_too_big         0      TC DSR: the option would exceed the route's MTU: new flow SNATed, later datagram sent without it
tc_dsr_untrusted       0      TC DSR, backend's node: DSR option from a sender that is not a cluster node: not honoured
svc_port_unused        0      ClusterIP on a port no Service uses: connect()/sendmsg() failed with ECONNREFUSED; TC: REJECT (RST, ICMP port unreachable)
svc_cidr_unallocated   0      address in a Service CIDR that no Service has: connect()/sendmsg() failed with EPERM; TC/XDP: dropped

BACKEND               ID  CONNS
10.240.1.2:8080       1   4
10.244.9.2:8080       2   0
10.244.9.3:8080       3   0
10.240.1.2:53         4   0
[fd00:240:1::2]:8080  5   0
[fd00:244::7]:8080    6   0
10.240.1.2:8080       7   0
10.244.9.4:8443       8   0

$ proxyctl conntrack
PROTO  DIR    SOURCE               DESTINATION          REWRITE                                          SERVICE            PACKETS  AGE  FLAGS
tcp    orig   198.51.100.7:51000   192.168.50.1:30080   dst->10.244.9.3:8080 src->192.168.50.1:40000     default/web:http   7        5s   snat,seen-reply
tcp    reply  10.244.9.3:8080      192.168.50.1:40000   dst->198.51.100.7:51000 src->192.168.50.1:30080  default/web:http   6        5s   snat,seen-reply
tcp    orig   [2001:db8::7]:51000  [fd00:96::10]:80     dst->[fd00:244::7]:8080                          default/web6:http  3        5s   seen-reply
tcp    reply  [fd00:244::7]:8080   [2001:db8::7]:51000  src->[fd00:96::10]:80                            default/web6:http  2        5s   seen-reply

$ proxyctl conntrack -o wide --addr 2001:db8::7
PROTO  DIR    SOURCE               DESTINATION          REWRITE                  SERVICE            SVC-ID  BACKEND                 PACKETS  AGE  TIMEOUT  FLAGS
tcp    orig   [2001:db8::7]:51000  [fd00:96::10]:80     dst->[fd00:244::7]:8080  default/web6:http  5       [fd00:244::7]:8080 (6)  3        5s   1d00h    seen-reply
tcp    reply  [fd00:244::7]:8080   [2001:db8::7]:51000  src->[fd00:96::10]:80    default/web6:http  5       [fd00:244::7]:8080 (6)  2        5s   1d00h    seen-reply

$ proxyctl affinity
no clients held (no Service with sessionAffinity: ClientIP was used)

$ proxyctl explain 10.96.0.20:8080
10.96.0.20:8080/tcp: Service default/echo, ClusterIP
  FRONTEND             KIND       BACKENDS  FLAGS
  10.96.0.20:8080/tcp  ClusterIP  1         -

pods and processes on this node -> 10.96.0.20:8080/tcp via the socket hooks: translated
  connect4/sendmsg4 rewrite the destination at connect() (TCP, connected UDP) or at each sendmsg() (unconnected UDP) to its only backend; recvmsg4/getpeername4 show 10.96.0.20:8080 as the peer
  SLOT  ID  BACKEND          STATE  CHANCE  CONNS
  1     1   10.240.1.2:8080  ready  1       4

packets routed through this node to the cluster IP -> 10.96.0.20:8080/tcp via TC: translated
  the first packet of a flow is DNATed to its only backend, the flow is kept in CT4 (both directions) so its packets keep that backend, replies are translated back; flows to a backend on another node are source-NATed to the node
  (the same slots as above)

kube-proxy (iptables mode) would have written (iptables-save):
  *nat
  -A KUBE-SERVICES -d 10.96.0.20/32 -p tcp -m comment --comment "default/echo cluster IP" -m tcp --dport 8080 -j KUBE-SVC-HV6DMF63W6MGLRDE
  -A KUBE-SVC-HV6DMF63W6MGLRDE -m comment --comment "default/echo -> 10.240.1.2:8080" -j KUBE-SEP-IL4VJWN5MLWXOYV7
  -A KUBE-SEP-IL4VJWN5MLWXOYV7 -s 10.240.1.2/32 -m comment --comment "default/echo" -j KUBE-MARK-MASQ
  -A KUBE-SEP-IL4VJWN5MLWXOYV7 -p tcp -m comment --comment "default/echo" -m tcp -j DNAT --to-destination 10.240.1.2:8080
  kube-proxy: every new connection walks KUBE-SERVICES rule by rule to this Service's rule, then jumps to the only endpoint.
  ebpf-proxy: one hash lookup of {10.96.0.20, 8080, tcp} (the frontend's entry, with slots 1..=24); slot 1; then the slot's backend id (in that entry up to slot 24) and the backend: a few lookups, whatever the number of services.

$ proxyctl explain 10.96.0.10:80
10.96.0.10:80/tcp: Service default/web:http, ClusterIP
  FRONTEND           KIND       BACKENDS  FLAGS
  10.96.0.10:80/tcp  ClusterIP  3         affinity=10800s

pods and processes on this node -> 10.96.0.10:80/tcp via the socket hooks: translated
  connect4/sendmsg4 rewrite the destination at connect() (TCP, connected UDP) or at each sendmsg() (unconnected UDP) to one of 3 backends, picked at random with equal weight; recvmsg4/getpeername4 show 10.96.0.10:80 as the peer
  SLOT  ID  BACKEND          STATE        CHANCE  CONNS
  1     1   10.240.1.2:8080  ready        1/3     4
  2     2   10.244.9.2:8080  terminating  1/3     0
  3     3   10.244.9.3:8080  ready        1/3     0

packets routed through this node to the cluster IP -> 10.96.0.10:80/tcp via TC: translated
  the first packet of a flow is DNATed to one of 3 backends, picked at random with equal weight, the flow is kept in CT4 (both directions) so its packets keep that backend, replies are translated back; flows to a backend on another node are source-NATed to the node
  (the same slots as above)

kube-proxy (iptables mode) would have written (iptables-save):
  *nat
  -A KUBE-SERVICES -d 10.96.0.10/32 -p tcp -m comment --comment "default/web:http cluster IP" -m tcp --dport 80 -j KUBE-SVC-CDGGSHYLG3RE2FKL
  -A KUBE-SVC-CDGGSHYLG3RE2FKL -m comment --comment "default/web:http -> 10.240.1.2:8080" -m recent --rcheck --seconds 10800 --reap --name KUBE-SEP-JWGHTP2YGQV536JN --mask 255.255.255.255 --rsource -j KUBE-SEP-JWGHTP2YGQV536JN
  -A KUBE-SVC-CDGGSHYLG3RE2FKL -m comment --comment "default/web:http -> 10.244.9.2:8080" -m recent --rcheck --seconds 10800 --reap --name KUBE-SEP-V64ASQASJCAAA46J --mask 255.255.255.255 --rsource -j KUBE-SEP-V64ASQASJCAAA46J
  -A KUBE-SVC-CDGGSHYLG3RE2FKL -m comment --comment "default/web:http -> 10.244.9.3:8080" -m recent --rcheck --seconds 10800 --reap --name KUBE-SEP-C5FLLS3IQGBRARSU --mask 255.255.255.255 --rsource -j KUBE-SEP-C5FLLS3IQGBRARSU
  -A KUBE-SVC-CDGGSHYLG3RE2FKL -m comment --comment "default/web:http -> 10.240.1.2:8080" -m statistic --mode random --probability 0.33333333349 -j KUBE-SEP-JWGHTP2YGQV536JN
  -A KUBE-SVC-CDGGSHYLG3RE2FKL -m comment --comment "default/web:http -> 10.244.9.2:8080" -m statistic --mode random --probability 0.50000000000 -j KUBE-SEP-V64ASQASJCAAA46J
  -A KUBE-SVC-CDGGSHYLG3RE2FKL -m comment --comment "default/web:http -> 10.244.9.3:8080" -j KUBE-SEP-C5FLLS3IQGBRARSU
  -A KUBE-SEP-JWGHTP2YGQV536JN -s 10.240.1.2/32 -m comment --comment "default/web:http" -j KUBE-MARK-MASQ
  -A KUBE-SEP-JWGHTP2YGQV536JN -p tcp -m comment --comment "default/web:http" -m recent --set --name KUBE-SEP-JWGHTP2YGQV536JN --mask 255.255.255.255 --rsource -m tcp -j DNAT --to-destination 10.240.1.2:8080
  -A KUBE-SEP-V64ASQASJCAAA46J -s 10.244.9.2/32 -m comment --comment "default/web:http" -j KUBE-MARK-MASQ
  -A KUBE-SEP-V64ASQASJCAAA46J -p tcp -m comment --comment "default/web:http" -m recent --set --name KUBE-SEP-V64ASQASJCAAA46J --mask 255.255.255.255 --rsource -m tcp -j DNAT --to-destination 10.244.9.2:8080
  -A KUBE-SEP-C5FLLS3IQGBRARSU -s 10.244.9.3/32 -m comment --comment "default/web:http" -j KUBE-MARK-MASQ
  -A KUBE-SEP-C5FLLS3IQGBRARSU -p tcp -m comment --comment "default/web:http" -m recent --set --name KUBE-SEP-C5FLLS3IQGBRARSU --mask 255.255.255.255 --rsource -m tcp -j DNAT --to-destination 10.244.9.3:8080
  kube-proxy: every new connection walks KUBE-SERVICES rule by rule to this Service's rule, then the statistic rules in order (1/3, then 1/2 of the rest, ..., the last takes what is left): 1/3 each.
  ebpf-proxy: one hash lookup of {10.96.0.10, 80, tcp} (the frontend's entry, with slots 1..=24); slot = 1 + random % 3; then the slot's backend id (in that entry up to slot 24) and the backend: a few lookups, whatever the number of services.

note: sessionAffinity ClientIP (10800s): a client (its network namespace at the socket hooks, its source address at TC) goes back to the backend it used last while it reconnects within that time (`proxyctl affinity` lists them)

$ proxyctl explain 192.168.50.1:30080
192.168.50.1:30080/tcp: Service default/web:http, NodePort (node port 30080 on this node's address 192.168.50.1)
  FRONTEND                     KIND      BACKENDS  FLAGS
  0.0.0.0:30080/tcp            NodePort  2         etp-local
  0.0.0.0:30080/tcp/ext-local  NodePort  1         local-only

pods and processes on this node -> 0.0.0.0:30080/tcp via the socket hooks: translated
  connect4/sendmsg4 rewrite the destination at connect() (TCP, connected UDP) or at each sendmsg() (unconnected UDP) to one of 2 backends, picked at random with equal weight; recvmsg4/getpeername4 show 192.168.50.1:30080 as the peer
  SLOT  ID  BACKEND          STATE        CHANCE  CONNS
  1     3   10.244.9.3:8080  ready        1/2     0
  2     7   10.240.1.2:8080  ready,local  1/2     0

packets arriving from outside the node -> 0.0.0.0:30080/tcp/ext-local via TC: translated
  the first packet of a flow is DNATed to its only backend, the flow is kept in CT4 (both directions) so its packets keep that backend, replies are translated back; externalTrafficPolicy Local: this node's backends only, client address kept
  SLOT  ID  BACKEND          STATE        CHANCE  CONNS
  1     7   10.240.1.2:8080  ready,local  1       0

kube-proxy (iptables mode) would have written (iptables-save):
  *nat
  -A KUBE-SERVICES -m comment --comment "kubernetes service nodeports; NOTE: this must be the last rule in this chain" -m addrtype --dst-type LOCAL -j KUBE-NODEPORTS
  -A KUBE-NODEPORTS -p tcp -m comment --comment "default/web:http" -m tcp --dport 30080 -j KUBE-EXT-CDGGSHYLG3RE2FKL
  -A KUBE-EXT-CDGGSHYLG3RE2FKL -m comment --comment "masquerade LOCAL traffic for default/web:http external destinations" -m addrtype --src-type LOCAL -j KUBE-MARK-MASQ
  -A KUBE-EXT-CDGGSHYLG3RE2FKL -m comment --comment "route LOCAL traffic for default/web:http external destinations" -m addrtype --src-type LOCAL -j KUBE-SVC-CDGGSHYLG3RE2FKL
  -A KUBE-EXT-CDGGSHYLG3RE2FKL -j KUBE-SVL-CDGGSHYLG3RE2FKL
  -A KUBE-SVC-CDGGSHYLG3RE2FKL -m comment --comment "default/web:http -> 10.240.1.2:8080" -m statistic --mode random --probability 0.50000000000 -j KUBE-SEP-JWGHTP2YGQV536JN
  -A KUBE-SVC-CDGGSHYLG3RE2FKL -m comment --comment "default/web:http -> 10.244.9.3:8080" -j KUBE-SEP-C5FLLS3IQGBRARSU
  -A KUBE-SVL-CDGGSHYLG3RE2FKL -m comment --comment "default/web:http -> 10.240.1.2:8080" -j KUBE-SEP-JWGHTP2YGQV536JN
  -A KUBE-SEP-JWGHTP2YGQV536JN -s 10.240.1.2/32 -m comment --comment "default/web:http" -j KUBE-MARK-MASQ
  -A KUBE-SEP-JWGHTP2YGQV536JN -p tcp -m comment --comment "default/web:http" -m tcp -j DNAT --to-destination 10.240.1.2:8080
  -A KUBE-SEP-C5FLLS3IQGBRARSU -s 10.244.9.3/32 -m comment --comment "default/web:http" -j KUBE-MARK-MASQ
  -A KUBE-SEP-C5FLLS3IQGBRARSU -p tcp -m comment --comment "default/web:http" -m tcp -j DNAT --to-destination 10.244.9.3:8080
  kube-proxy: every new connection walks all of KUBE-SERVICES (the node-port jump is its last rule), then KUBE-NODEPORTS rule by rule to this port's rule, then jumps to the only endpoint.
  ebpf-proxy: {192.168.50.1, 30080, tcp} misses, 192.168.50.1 is in NODE_ADDRS4, {0.0.0.0, 30080, tcp} matches, its ext-local twin holds the slots; slot 1; then the slot's backend id (in that entry up to slot 24) and the backend: a few lookups, whatever the number of services.

note: a NodePort frontend has address 0.0.0.0: TC and the socket hooks match it on every node address (NODE_ADDRS4) after the exact address missed

$ proxyctl explain 10.96.0.30:80
10.96.0.30:80/tcp: Service default/empty, ClusterIP
  FRONTEND           KIND       BACKENDS  FLAGS
  10.96.0.30:80/tcp  ClusterIP  0         -

pods and processes on this node -> 10.96.0.30:80/tcp via the socket hooks: rejected
  no usable endpoint anywhere (whatever the traffic policy): connect()/sendmsg() fail with ECONNREFUSED (kube-proxy: REJECT)

packets routed through this node to the cluster IP -> 10.96.0.30:80/tcp via TC: rejected
  no backend: a TCP SYN is answered with RST, a UDP datagram with ICMP port unreachable, other packets are dropped (kube-proxy: REJECT)

kube-proxy (iptables mode) would have written (iptables-save):
  *filter
  -A KUBE-SERVICES -d 10.96.0.30/32 -p tcp -m comment --comment "default/empty has no endpoints" -m tcp --dport 80 -j REJECT --reject-with icmp-port-unreachable

$ proxyctl explain 10.96.0.53:53/udp
10.96.0.53:53/udp: Service kube-system/dns:dns, ClusterIP
  FRONTEND           KIND       BACKENDS  FLAGS
  10.96.0.53:53/udp  ClusterIP  1         local-only

pods and processes on this node -> 10.96.0.53:53/udp via the socket hooks: translated
  connect4/sendmsg4 rewrite the destination at connect() (TCP, connected UDP) or at each sendmsg() (unconnected UDP) to its only backend; recvmsg4/getpeername4 show 10.96.0.53:53 as the peer; a connected UDP socket keeps its backend: when that backend leaves, the agent destroys the socket (counted in ebpf_proxy_stale_udp_sockets_destroyed_total) and the application's next recv() fails with ECONNABORTED (a send() with EDESTADDRREQ): it must reconnect (kube-proxy instead flushes the conntrack entries and the same socket is re-balanced)
  SLOT  ID  BACKEND        STATE        CHANCE  CONNS
  1     4   10.240.1.2:53  ready,local  1       0

packets routed through this node to the cluster IP -> 10.96.0.53:53/udp via TC: translated
  the first packet of a flow is DNATed to its only backend, the flow is kept in CT4 (both directions) so its packets keep that backend, replies are translated back; flows to a backend on another node are source-NATed to the node
  (the same slots as above)

kube-proxy (iptables mode) would have written (iptables-save):
  *nat
  -A KUBE-SERVICES -d 10.96.0.53/32 -p udp -m comment --comment "kube-system/dns:dns cluster IP" -m udp --dport 53 -j KUBE-SVL-2KKYJRIGYGQNRODB
  -A KUBE-SVL-2KKYJRIGYGQNRODB -m comment --comment "kube-system/dns:dns -> 10.240.1.2:53" -j KUBE-SEP-5EBKPBC6FIMK7SEO
  -A KUBE-SEP-5EBKPBC6FIMK7SEO -s 10.240.1.2/32 -m comment --comment "kube-system/dns:dns" -j KUBE-MARK-MASQ
  -A KUBE-SEP-5EBKPBC6FIMK7SEO -p udp -m comment --comment "kube-system/dns:dns" -m udp -j DNAT --to-destination 10.240.1.2:53
  kube-proxy: every new connection walks KUBE-SERVICES rule by rule to this Service's rule, then jumps to the only endpoint.
  ebpf-proxy: one hash lookup of {10.96.0.53, 53, udp} (the frontend's entry, with slots 1..=24); slot 1; then the slot's backend id (in that entry up to slot 24) and the backend: a few lookups, whatever the number of services.

$ proxyctl explain [fd00:96::10]:80
[fd00:96::10]:80/tcp: Service default/web6:http, ClusterIP
  FRONTEND              KIND       BACKENDS  FLAGS
  [fd00:96::10]:80/tcp  ClusterIP  2         -

pods and processes on this node -> [fd00:96::10]:80/tcp via the socket hooks: translated
  connect6/sendmsg6 rewrite the destination at connect() (TCP, connected UDP) or at each sendmsg() (unconnected UDP) to one of 2 backends, picked at random with equal weight; recvmsg6/getpeername6 show [fd00:96::10]:80 as the peer
  SLOT  ID  BACKEND               STATE  CHANCE  CONNS
  1     5   [fd00:240:1::2]:8080  ready  1/2     0
  2     6   [fd00:244::7]:8080    ready  1/2     0

packets routed through this node to the cluster IP -> [fd00:96::10]:80/tcp via TC: translated
  the first packet of a flow is DNATed to one of 2 backends, picked at random with equal weight, the flow is kept in CT6 (both directions) so its packets keep that backend, replies are translated back; flows to a backend on another node are source-NATed to the node
  (the same slots as above)

kube-proxy (iptables mode) would have written (ip6tables-save):
  *nat
  -A KUBE-SERVICES -d fd00:96::10/128 -p tcp -m comment --comment "default/web6:http cluster IP" -m tcp --dport 80 -j KUBE-SVC-VB6W3Y75GEBXG6TR
  -A KUBE-SVC-VB6W3Y75GEBXG6TR -m comment --comment "default/web6:http -> [fd00:240:1::2]:8080" -m statistic --mode random --probability 0.50000000000 -j KUBE-SEP-7WFET2RH2PFNRVGI
  -A KUBE-SVC-VB6W3Y75GEBXG6TR -m comment --comment "default/web6:http -> [fd00:244::7]:8080" -j KUBE-SEP-RS7H6OHFSHUFGCJS
  -A KUBE-SEP-7WFET2RH2PFNRVGI -s fd00:240:1::2/128 -m comment --comment "default/web6:http" -j KUBE-MARK-MASQ
  -A KUBE-SEP-7WFET2RH2PFNRVGI -p tcp -m comment --comment "default/web6:http" -m tcp -j DNAT --to-destination [fd00:240:1::2]:8080
  -A KUBE-SEP-RS7H6OHFSHUFGCJS -s fd00:244::7/128 -m comment --comment "default/web6:http" -j KUBE-MARK-MASQ
  -A KUBE-SEP-RS7H6OHFSHUFGCJS -p tcp -m comment --comment "default/web6:http" -m tcp -j DNAT --to-destination [fd00:244::7]:8080
  kube-proxy: every new connection walks KUBE-SERVICES rule by rule to this Service's rule, then the statistic rules in order (1/2, then 1/1 of the rest, ..., the last takes what is left): 1/2 each.
  ebpf-proxy: one hash lookup of {fd00:96::10, 80, tcp} (the frontend's entry, with slots 1..=24); slot = 1 + random % 2; then the slot's backend id (in that entry up to slot 24) and the backend: a few lookups, whatever the number of services.

$ proxyctl explain 192.0.2.10:443
192.0.2.10:443/tcp: Service default/lb:https, LoadBalancer
  FRONTEND            KIND          BACKENDS  FLAGS
  192.0.2.10:443/tcp  LoadBalancer  1         source-ranges=203.0.113.0/24

pods and processes on this node -> 192.0.2.10:443/tcp via the socket hooks: translated
  connect4/sendmsg4 rewrite the destination at connect() (TCP, connected UDP) or at each sendmsg() (unconnected UDP) to its only backend; recvmsg4/getpeername4 show 192.0.2.10:443 as the peer
  SLOT  ID  BACKEND          STATE  CHANCE  CONNS
  1     8   10.244.9.4:8443  ready  1       0

packets arriving from outside the node -> 192.0.2.10:443/tcp via TC: translated
  the first packet of a flow is DNATed to its only backend, the flow is kept in CT4 (both directions) so its packets keep that backend, replies are translated back; flows to a backend on another node are source-NATed to the node
  (the same slots as above)

kube-proxy (iptables mode) would have written (iptables-save):
  *nat
  -A KUBE-SERVICES -d 192.0.2.10/32 -p tcp -m comment --comment "default/lb:https loadbalancer IP" -m tcp --dport 443 -j KUBE-FW-WMXB4IV4XJUTQTS2
  -A KUBE-EXT-WMXB4IV4XJUTQTS2 -m comment --comment "masquerade traffic for default/lb:https external destinations" -j KUBE-MARK-MASQ
  -A KUBE-EXT-WMXB4IV4XJUTQTS2 -j KUBE-SVC-WMXB4IV4XJUTQTS2
  -A KUBE-FW-WMXB4IV4XJUTQTS2 -s 203.0.113.0/24 -m comment --comment "default/lb:https loadbalancer IP" -j KUBE-EXT-WMXB4IV4XJUTQTS2
  -A KUBE-FW-WMXB4IV4XJUTQTS2 -m comment --comment "other traffic to default/lb:https will be dropped by KUBE-PROXY-FIREWALL"
  -A KUBE-SVC-WMXB4IV4XJUTQTS2 -m comment --comment "default/lb:https -> 10.244.9.4:8443" -j KUBE-SEP-QDGB3Y3XTU2ISCYV
  -A KUBE-SEP-QDGB3Y3XTU2ISCYV -s 10.244.9.4/32 -m comment --comment "default/lb:https" -j KUBE-MARK-MASQ
  -A KUBE-SEP-QDGB3Y3XTU2ISCYV -p tcp -m comment --comment "default/lb:https" -m tcp -j DNAT --to-destination 10.244.9.4:8443
  *filter
  -A KUBE-PROXY-FIREWALL -d 192.0.2.10/32 -p tcp -m comment --comment "default/lb:https traffic not accepted by KUBE-FW-WMXB4IV4XJUTQTS2" -m tcp --dport 443 -j DROP
  kube-proxy: every new connection walks KUBE-SERVICES rule by rule to this Service's rule, then jumps to the only endpoint.
  ebpf-proxy: one hash lookup of {192.0.2.10, 443, tcp} (the frontend's entry, with slots 1..=24); slot 1; then the slot's backend id (in that entry up to slot 24) and the backend: a few lookups, whatever the number of services.

note: loadBalancerSourceRanges: only sources in 203.0.113.0/24 are accepted from outside

$ proxyctl explain 10.96.0.10:81
10.96.0.10:81/tcp: not a service. No frontend matches, so traffic to it is not translated (the socket hooks count it as no_service and leave it alone).
  note: 10.96.0.10 is a service address, but only for 80/tcp (default/web:http)

$ proxyctl watch --interval 100ms --iterations 2
proxyctl watch: every 100ms, frame 1 of 2

BACKEND               ID  CONNS  DELTA  RATE/S
10.240.1.2:8080       1   4      -      -
10.244.9.2:8080       2   0      -      -
10.244.9.3:8080       3   0      -      -
10.240.1.2:53         4   0      -      -
[fd00:240:1::2]:8080  5   0      -      -
[fd00:244::7]:8080    6   0      -      -
10.240.1.2:8080       7   0      -      -
10.244.9.4:8443       8   0      -      -

COUNTER                COUNT  DELTA  RATE/S
translated             4      -      -
no_service             0      -      -
no_backend             0      -      -
backend_missing        0      -      -
unsupported_proto      0      -      -
rev_translated         4      -      -
rev_nat_miss           4      -      -
rev_nat_stale          0      -      -
rev_nat_update_failed  0      -      -
no_local_backend       0      -      -
tc_new_flow            0      -      -
tc_flow                0      -      -
tc_reply               0      -      -
tc_no_backend          0      -      -
tc_source_denied       0      -      -
tc_snat_failed         0      -      -
tc_no_local_backend    0      -      -
tc_fib_miss            0      -      -
tc_icmp_error          0      -      -
affinity_hit           0      -      -
tc_stale_backend       0      -      -
tc_reject_limited      0      -      -
tc_ct_write_failed     0      -      -
tc_rewrite_failed      0      -      -
xdp_to_stack           0      -      -
tc_dsr_encap           0      -      -
tc_dsr_decap           0      -      -
tc_dsr_reply           0      -      -
tc_dsr_too_big         0      -      -
tc_dsr_untrusted       0      -      -
svc_port_unused        0      -      -
svc_cidr_unallocated   0      -      -

proxyctl watch: every 100ms, frame 2 of 2

BACKEND               ID  CONNS  DELTA  RATE/S
10.240.1.2:8080       1   4      +0     0.0
10.244.9.2:8080       2   0      +0     0.0
10.244.9.3:8080       3   0      +0     0.0
10.240.1.2:53         4   0      +0     0.0
[fd00:240:1::2]:8080  5   0      +0     0.0
[fd00:244::7]:8080    6   0      +0     0.0
10.240.1.2:8080       7   0      +0     0.0
10.244.9.4:8443       8   0      +0     0.0

COUNTER                COUNT  DELTA  RATE/S
translated             4      +0     0.0
no_service             0      +0     0.0
no_backend             0      +0     0.0
backend_missing        0      +0     0.0
unsupported_proto      0      +0     0.0
rev_translated         4      +0     0.0
rev_nat_miss           4      +0     0.0
rev_nat_stale          0      +0     0.0
rev_nat_update_failed  0      +0     0.0
no_local_backend       0      +0     0.0
tc_new_flow            0      +0     0.0
tc_flow                0      +0     0.0
tc_reply               0      +0     0.0
tc_no_backend          0      +0     0.0
tc_source_denied       0      +0     0.0
tc_snat_failed         0      +0     0.0
tc_no_local_backend    0      +0     0.0
tc_fib_miss            0      +0     0.0
tc_icmp_error          0      +0     0.0
affinity_hit           0      +0     0.0
tc_stale_backend       0      +0     0.0
tc_reject_limited      0      +0     0.0
tc_ct_write_failed     0      +0     0.0
tc_rewrite_failed      0      +0     0.0
xdp_to_stack           0      +0     0.0
tc_dsr_encap           0      +0     0.0
tc_dsr_decap           0      +0     0.0
tc_dsr_reply           0      +0     0.0
tc_dsr_too_big         0      +0     0.0
tc_dsr_untrusted       0      +0     0.0
svc_port_unused        0      +0     0.0
svc_cidr_unallocated   0      +0     0.0

$ proxyctl dump
frontend 0.0.0.0:30080/tcp id=6 count=2 flags=0x24 affinity=0
  slot 1 -> backend 3 (10.244.9.3:8080)
  slot 2 -> backend 7 (10.240.1.2:8080)
frontend 0.0.0.0:30080/tcp/ext-local id=7 count=1 flags=0x6 affinity=0
  slot 1 -> backend 7 (10.240.1.2:8080)
frontend 10.96.0.10:80/tcp id=2 count=3 flags=0x1 affinity=10800
  slot 1 -> backend 1 (10.240.1.2:8080)
  slot 2 -> backend 2 (10.244.9.2:8080)
  slot 3 -> backend 3 (10.244.9.3:8080)
frontend 10.96.0.20:8080/tcp id=1 count=1 flags=0x0 affinity=0
  slot 1 -> backend 1 (10.240.1.2:8080)
frontend 10.96.0.30:80/tcp id=4 count=0 flags=0x0 affinity=0
frontend 10.96.0.53:53/udp id=3 count=1 flags=0x2 affinity=0
  slot 1 -> backend 4 (10.240.1.2:53)
frontend 192.0.2.10:443/tcp id=8 count=1 flags=0x50 affinity=0
  slot 1 -> backend 8 (10.244.9.4:8443)
frontend [fd00:96::10]:80/tcp id=5 count=2 flags=0x0 affinity=0
  slot 1 -> backend 5 ([fd00:240:1::2]:8080)
  slot 2 -> backend 6 ([fd00:244::7]:8080)
backend 1 = 10.240.1.2:8080/tcp flags=0x0
backend 2 = 10.244.9.2:8080/tcp flags=0x1
backend 3 = 10.244.9.3:8080/tcp flags=0x0
backend 4 = 10.240.1.2:53/udp flags=0x2
backend 5 = [fd00:240:1::2]:8080/tcp flags=0x0
backend 6 = [fd00:244::7]:8080/tcp flags=0x0
backend 7 = 10.240.1.2:8080/tcp flags=0x2
backend 8 = 10.244.9.4:8443/tcp flags=0x0
source range 8 203.0.113.0/24
revnat 1 = 10.96.0.20:8080/tcp "default/echo"
revnat 2 = 10.96.0.10:80/tcp "default/web:http"
revnat 3 = 10.96.0.53:53/udp "kube-system/dns:dns"
revnat 4 = 10.96.0.30:80/tcp "default/empty"
revnat 5 = [fd00:96::10]:80/tcp "default/web6:http"
revnat 6 = 0.0.0.0:30080/tcp "default/web:http"
revnat 7 = 0.0.0.0:30080/tcp/ext-local "default/web:http"
revnat 8 = 192.0.2.10:443/tcp "default/lb:https"

"##;
