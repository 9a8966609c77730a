//! `proxyctl monitor` against the real datapath: the real `proxyctl` binary reads the
//! `EVENTS` ring buffer while the TC programs run on crafted packets (`BPF_PROG_TEST_RUN`,
//! the bed of `tc_packets.rs`) and the socket hooks run on real `connect()` calls (a
//! child cgroup). Each case checks the event's reason, hook and flow (before and after),
//! the JSON lines parse, the rate limit and its lost count, and the lease: on while a
//! monitor runs, off when it exits, and off within the lease when it is killed.
//!
//! Needs root; fails (never skips) without it.

mod support;

use proxy_common::prog_names::TC_INGRESS;

use std::{
    io::{BufRead as _, BufReader, Read as _},
    net::{Ipv4Addr, SocketAddr, TcpStream},
    path::Path,
    process::{Child, ChildStdout, Command, Stdio},
    sync::mpsc,
    time::{Duration, Instant},
};

use aya::maps::{Array, MapData, PerCpuArray};
use proxy_common::{
    event::{MonitorCpu, MonitorCtl},
    map_names, svc_flags, NodeConfig,
};
use proxy_user::{
    ctl::maps::monotonic_ns,
    pins::{Access, PinDir},
    Frontend, Proto,
};
use serde_json::Value;
use support::{
    packets::{entry, sa, Bed, LOCAL, SYN, TC_ACT_OK, TC_ACT_REDIRECT, TC_ACT_SHOT},
    tc::Pkt,
    TestEnv,
};

const BIN: &str = env!("CARGO_BIN_EXE_proxyctl");

/// A running `proxyctl monitor -o json`, its output read line by line (by a thread, so
/// a missing event fails the test after a bound instead of hanging it).
struct Monitor {
    child: Child,
    lines: mpsc::Receiver<String>,
    pins: std::path::PathBuf,
}

fn reader(out: ChildStdout) -> mpsc::Receiver<String> {
    let (tx, rx) = mpsc::channel();
    std::thread::spawn(move || {
        for line in BufReader::new(out).lines() {
            let Ok(line) = line else { break };
            if tx.send(line).is_err() {
                break;
            }
        }
    });
    rx
}

impl Monitor {
    /// Starts it and waits until its lease is in `MONITOR` (reporting on).
    fn start(pins: &Path, args: &[&str]) -> Self {
        let mut child = Command::new(BIN)
            .args([
                "--pin-path",
                pins.to_str().expect("utf-8"),
                "-o",
                "json",
                "monitor",
            ])
            .args(args)
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .expect("spawn proxyctl monitor");
        let lines = reader(child.stdout.take().expect("stdout"));
        let m = Self {
            child,
            lines,
            pins: pins.to_path_buf(),
        };
        let deadline = Instant::now() + Duration::from_secs(20);
        while lease(&m.pins) == 0 {
            assert!(
                Instant::now() < deadline,
                "proxyctl monitor did not take the lease in 20 s"
            );
            std::thread::sleep(Duration::from_millis(20));
        }
        m
    }

    /// The next JSON line (an event or the summary).
    fn line(&mut self) -> Value {
        let s = self
            .lines
            .recv_timeout(Duration::from_secs(20))
            .expect("an event within 20 s");
        serde_json::from_str(&s).unwrap_or_else(|e| panic!("not a JSON line: {s:?}: {e}"))
    }

    /// SIGINT (a normal stop), then every remaining line; the last is the summary.
    fn stop(mut self) -> (Vec<Value>, Value) {
        // SAFETY: our own child's pid.
        unsafe { libc::kill(self.child.id() as i32, libc::SIGINT) };
        let status = self.child.wait().expect("wait");
        let rest: Vec<String> = self.lines.iter().collect();
        let mut err = String::new();
        if let Some(mut e) = self.child.stderr.take() {
            let _ = e.read_to_string(&mut err);
        }
        assert!(status.success(), "monitor failed: {status}: {err}");
        let mut lines: Vec<Value> = rest
            .iter()
            .map(|l| serde_json::from_str(l).unwrap_or_else(|e| panic!("{l:?}: {e}")))
            .collect();
        let summary = lines.pop().expect("a summary line");
        (lines, summary["summary"].clone())
    }
}

impl Drop for Monitor {
    /// A failed test does not leave its monitor running (a no-op after `stop`).
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn ctl(pins: &Path) -> Array<MapData, MonitorCtl> {
    PinDir::new(pins)
        .typed(map_names::MONITOR, Access::ReadOnly)
        .expect("MONITOR")
}

fn lease(pins: &Path) -> u64 {
    ctl(pins).get(&0, 0).expect("MONITOR[0]").lease_until_ns
}

fn cpu_counts(pins: &Path) -> MonitorCpu {
    let m: PerCpuArray<MapData, MonitorCpu> = PinDir::new(pins)
        .typed(map_names::MONITOR_CPU, Access::ReadOnly)
        .expect("MONITOR_CPU");
    let v = m.get(&0, 0).expect("MONITOR_CPU[0]");
    v.iter().fold(MonitorCpu::default(), |a, c| MonitorCpu {
        emitted: a.emitted + c.emitted,
        lost_rate: a.lost_rate + c.lost_rate,
        lost_full: a.lost_full + c.lost_full,
        sampled_out: a.sampled_out + c.sampled_out,
        ..a
    })
}

fn field<'a>(v: &'a Value, k: &str) -> &'a str {
    v[k].as_str().unwrap_or_else(|| panic!("{k} in {v}"))
}

/// Drops and translations of the TC path, each with its reason and flow: no endpoints,
/// a source-range denial, a SNAT failure, a stale UDP backend (and the new flow that
/// replaces it), a plain new flow; the Service named from its id.
#[test]
fn tc_drops_and_translations_show_with_reason_and_flow() {
    let mut bed = Bed::new();
    let pins = bed.pins.path.clone();
    let ip = |a, b, c, d| Ipv4Addr::new(a, b, c, d);
    let named = |fe: Frontend, backends: &[(&str, u8)], flags: u16, name: &str| {
        let mut e = entry(fe, backends, flags);
        e.name = name.into();
        e
    };
    let empty = named(
        Frontend::new(ip(10, 96, 0, 20), 80, Proto::Tcp),
        &[],
        0,
        "default/empty",
    );
    let mut lb = named(
        Frontend::new(ip(203, 0, 113, 10), 443, Proto::Tcp),
        &[("10.1.1.2:8443", LOCAL)],
        svc_flags::LOAD_BALANCER | svc_flags::SOURCE_RANGES,
        "default/lb:https",
    );
    lb.source_ranges = vec![("198.51.100.0".parse().expect("ip"), 24)];
    let remote = named(
        Frontend::new(ip(10, 96, 0, 30), 80, Proto::Tcp),
        &[("10.2.1.2:8080", 0)],
        0,
        "default/remote",
    );
    let dns_a = named(
        Frontend::new(ip(10, 96, 0, 53), 53, Proto::Udp),
        &[("10.1.1.2:5353", LOCAL)],
        0,
        "kube-system/dns:dns",
    );
    for e in [&empty, &lb, &remote, &dns_a] {
        bed.writer.upsert(e).expect("upsert");
    }
    // Before the monitor: a new flow, not reported (off by default), and nothing counted.
    let (v, _) = bed.run(TC_INGRESS, &Pkt::udp("198.51.100.7:5000", "10.96.0.53:53"));
    assert_eq!(v, TC_ACT_OK);
    assert_eq!(cpu_counts(&pins), MonitorCpu::default(), "reporting is off");
    assert_eq!(lease(&pins), 0);

    let mut m = Monitor::start(&pins, &["--type", "all"]);
    // 1. No endpoints: REJECT (a RST).
    let (v, _) = bed.run(
        TC_INGRESS,
        &Pkt::tcp("198.51.100.7:40000", "10.96.0.20:80", SYN),
    );
    assert_eq!(v, TC_ACT_REDIRECT);
    let e = m.line();
    assert_eq!(
        (field(&e, "type"), field(&e, "reason"), field(&e, "hook")),
        ("drop", "tc_no_backend", TC_INGRESS)
    );
    assert_eq!(
        (field(&e, "source"), field(&e, "destination")),
        ("198.51.100.7:40000", "10.96.0.20:80")
    );
    assert_eq!(field(&e, "new_destination"), "10.96.0.20:80");
    assert_eq!(field(&e, "service"), "default/empty");
    assert_eq!(field(&e, "protocol"), "tcp");
    assert!(field(&e, "meaning").contains("without endpoints"), "{e}");
    assert!(field(&e, "time").ends_with('Z'), "{e}");

    // 2. Source outside loadBalancerSourceRanges.
    let (v, _) = bed.run(
        TC_INGRESS,
        &Pkt::tcp("192.0.2.50:40001", "203.0.113.10:443", SYN),
    );
    assert_eq!(v, TC_ACT_SHOT);
    let e = m.line();
    assert_eq!(
        (field(&e, "type"), field(&e, "reason")),
        ("drop", "tc_source_denied")
    );
    assert_eq!(
        (field(&e, "source"), field(&e, "destination")),
        ("192.0.2.50:40001", "203.0.113.10:443")
    );
    assert_eq!(field(&e, "service"), "default/lb:https");

    // 3. A remote backend with no SNAT address: dropped.
    let cfg_pins = PinDir::new(&pins);
    let mut cfg: Array<MapData, NodeConfig> = cfg_pins
        .typed(map_names::NODE_CONFIG, Access::ReadWrite)
        .expect("NODE_CONFIG");
    let saved = cfg.get(&0, 0).expect("NODE_CONFIG[0]");
    cfg.set(0, NodeConfig::default(), 0)
        .expect("clear SNAT addresses");
    let (v, _) = bed.run(
        TC_INGRESS,
        &Pkt::tcp("198.51.100.7:40002", "10.96.0.30:80", SYN),
    );
    assert_eq!(v, TC_ACT_SHOT);
    let e = m.line();
    assert_eq!(
        (field(&e, "type"), field(&e, "reason")),
        ("drop", "tc_snat_failed")
    );
    assert_eq!(
        (field(&e, "source"), field(&e, "destination")),
        ("198.51.100.7:40002", "10.96.0.30:80")
    );
    assert_eq!(field(&e, "service"), "default/remote");
    cfg.set(0, saved, 0).expect("restore");

    // 4. A new flow SNATed to the remote backend: a translation, before and after.
    let (v, out) = bed.run(
        TC_INGRESS,
        &Pkt::tcp("198.51.100.7:40003", "10.96.0.30:80", SYN),
    );
    assert_ne!(v, TC_ACT_SHOT);
    let e = m.line();
    assert_eq!(
        (field(&e, "type"), field(&e, "reason")),
        ("translate", "tc_new_flow")
    );
    assert_eq!(field(&e, "new_destination"), "10.2.1.2:8080");
    assert_eq!(field(&e, "new_source"), out.src.to_string());
    assert_eq!(field(&e, "new_source").split(':').next(), Some("192.0.2.1"));
    assert!(e["backend_id"].as_u64().expect("backend_id") > 0);

    // 5. The UDP flow of before the monitor: its backend removed, the next datagram finds
    //    it stale (old backend in `new_destination`) and starts a new flow to the other.
    let mut dns_b = dns_a.clone();
    dns_b.backends = vec![proxy_user::Backend {
        addr: sa("10.1.1.3:5353"),
        flags: LOCAL,
    }];
    bed.writer.upsert(&dns_b).expect("replace the backend");
    let (v, out) = bed.run(TC_INGRESS, &Pkt::udp("198.51.100.7:5000", "10.96.0.53:53"));
    assert_eq!((v, out.dst), (TC_ACT_OK, sa("10.1.1.3:5353")));
    let stale = m.line();
    assert_eq!(
        (field(&stale, "type"), field(&stale, "reason")),
        ("translate", "tc_stale_backend")
    );
    assert_eq!(
        (field(&stale, "source"), field(&stale, "destination")),
        ("198.51.100.7:5000", "10.96.0.53:53")
    );
    assert_eq!(field(&stale, "new_destination"), "10.1.1.2:5353");
    assert_eq!(field(&stale, "protocol"), "udp");
    let fresh = m.line();
    assert_eq!(field(&fresh, "reason"), "tc_new_flow");
    assert_eq!(field(&fresh, "new_destination"), "10.1.1.3:5353");
    assert_eq!(field(&fresh, "service"), "kube-system/dns:dns");

    // A packet of a known flow is no event (events are per new flow): the summary counts
    // exactly the six above.
    let (_, _) = bed.run(TC_INGRESS, &Pkt::udp("198.51.100.7:5000", "10.96.0.53:53"));
    let (rest, summary) = m.stop();
    assert!(rest.is_empty(), "{rest:?}");
    assert_eq!(summary["shown"], 6, "{summary}");
    assert_eq!(summary["emitted"], 6, "{summary}");
    assert_eq!(summary["lost_rate_limit"], 0, "{summary}");
    // A normal exit turns reporting off at once.
    assert_eq!(lease(&pins), 0, "lease cleared on exit");
    let before = cpu_counts(&pins);
    bed.run(
        TC_INGRESS,
        &Pkt::tcp("198.51.100.7:40009", "10.96.0.20:80", SYN),
    );
    assert_eq!(
        cpu_counts(&pins),
        before,
        "nothing reported after the monitor exited"
    );
}

/// `--type drop` and the filters: a translation and a drop of another address are not
/// shown; a flood over the per-CPU rate limit is cut to the bucket, the rest counted lost.
#[test]
fn filters_rate_limit_and_lost_count() {
    let mut bed = Bed::new();
    let pins = bed.pins.path.clone();
    let empty = Frontend::new(Ipv4Addr::new(10, 96, 0, 20), 80, Proto::Tcp);
    bed.writer.upsert(&entry(empty, &[], 0)).expect("upsert");
    let web = Frontend::new(Ipv4Addr::new(10, 96, 0, 10), 80, Proto::Tcp);
    bed.writer
        .upsert(&entry(web, &[("10.1.1.2:8080", LOCAL)], 0))
        .expect("upsert");

    let mut m = Monitor::start(
        &pins,
        &[
            "--type",
            "drop",
            "--addr",
            "198.51.100.7",
            "--rate",
            "1",
            "--burst",
            "5",
        ],
    );
    // Not shown: a translation (type), a drop from another client (address).
    bed.run(
        TC_INGRESS,
        &Pkt::tcp("198.51.100.7:41000", "10.96.0.10:80", SYN),
    );
    bed.run(
        TC_INGRESS,
        &Pkt::tcp("198.51.100.8:41000", "10.96.0.20:80", SYN),
    );
    // A flood of 200 refused SYNs: the bucket lets 5 through per CPU (+1 a second).
    const FLOOD: u64 = 200;
    for port in 0..FLOOD {
        let (v, _) = bed.run(
            TC_INGRESS,
            &Pkt::tcp(
                &format!("198.51.100.7:{}", 42000 + port),
                "10.96.0.20:80",
                SYN,
            ),
        );
        assert_eq!(v, TC_ACT_REDIRECT);
    }
    let first = m.line();
    assert_eq!(field(&first, "source"), "198.51.100.7:42000");
    let (rest, summary) = m.stop();
    let cpus = aya::util::nr_cpus().expect("cpus") as u64;
    let shown = 1 + rest.len() as u64;
    for e in &rest {
        assert_eq!(field(e, "reason"), "tc_no_backend");
        assert_eq!(field(e, "destination"), "10.96.0.20:80");
    }
    // Emitted: the other client's drop (filtered in user space) plus the flood's share.
    let emitted = summary["emitted"].as_u64().expect("emitted");
    let lost = summary["lost_rate_limit"].as_u64().expect("lost");
    assert_eq!(emitted + lost, FLOOD + 1, "{summary}");
    assert_eq!(shown, emitted - 1, "{summary}");
    // At most the burst plus one token a second per CPU (the flood takes well under
    // the time this allows; bound holds under load up to 10 s per CPU).
    assert!(emitted <= cpus * (5 + 10), "{summary}");
    assert!(lost >= FLOOD + 1 - cpus * 15, "{summary}");
    assert_eq!(summary["shown"].as_u64(), Some(shown));
}

/// A killed monitor leaves its lease behind; the datapath stops reporting when it runs
/// out (3 s) and clears it. A second monitor while one runs is refused.
#[test]
fn a_killed_monitor_stops_reporting_within_the_lease() {
    let mut bed = Bed::new();
    let pins = bed.pins.path.clone();
    let empty = Frontend::new(Ipv4Addr::new(10, 96, 0, 20), 80, Proto::Tcp);
    bed.writer.upsert(&entry(empty, &[], 0)).expect("upsert");
    let mut m = Monitor::start(&pins, &[]);

    let second = Command::new(BIN)
        .args(["--pin-path", pins.to_str().expect("utf-8"), "monitor"])
        .output()
        .expect("run a second monitor");
    assert_eq!(second.status.code(), Some(1), "{second:?}");
    assert!(
        String::from_utf8_lossy(&second.stderr).contains("another proxyctl monitor"),
        "{second:?}"
    );

    bed.run(
        TC_INGRESS,
        &Pkt::tcp("198.51.100.7:40000", "10.96.0.20:80", SYN),
    );
    assert_eq!(field(&m.line(), "reason"), "tc_no_backend");
    // SAFETY: our own child's pid.
    unsafe { libc::kill(m.child.id() as i32, libc::SIGKILL) };
    m.child.wait().expect("wait");
    let left = lease(&pins);
    assert_ne!(left, 0, "a killed monitor cannot clear its lease");
    while monotonic_ns() < left {
        std::thread::sleep(Duration::from_millis(100));
    }
    let before = cpu_counts(&pins);
    bed.run(
        TC_INGRESS,
        &Pkt::tcp("198.51.100.7:40001", "10.96.0.20:80", SYN),
    );
    assert_eq!(
        cpu_counts(&pins),
        before,
        "an expired lease reports nothing"
    );
    assert_eq!(lease(&pins), 0, "the datapath cleared the expired lease");
    // And a new monitor can start (the lock died with the process).
    let m = Monitor::start(&pins, &[]);
    let (_, summary) = m.stop();
    assert_eq!(summary["shown"], 0);
}

/// The socket hooks: a `connect()` to a ClusterIP without endpoints is refused, and the
/// monitor shows it at the `connect` hook with the Service; a connection that is
/// translated shows the backend.
#[test]
fn socket_hook_refusal_and_translation() {
    let mut env = TestEnv::new(1);
    env.serve_all(8080);
    let pod = support::Topology::pod_v4(1);
    let fe = Frontend::new(Ipv4Addr::new(10, 96, 0, 40), 80, Proto::Tcp);
    let mut e = entry(fe, &[], 0);
    e.name = "default/none".into();
    env.writer().upsert(&e).expect("upsert");
    let fe2 = Frontend::new(Ipv4Addr::new(10, 96, 0, 41), 80, Proto::Tcp);
    let mut e2 = entry(fe2, &[(&format!("{pod}:8080"), LOCAL)], 0);
    e2.name = "default/echo".into();
    env.writer().upsert(&e2).expect("upsert");

    let mut m = Monitor::start(&env.pins.path, &[]);
    let err = env
        .in_client(|| TcpStream::connect_timeout(&sa("10.96.0.40:80"), Duration::from_secs(5)))
        .expect_err("refused");
    assert_eq!(err.kind(), std::io::ErrorKind::ConnectionRefused, "{err}");
    let ev = m.line();
    assert_eq!(
        (field(&ev, "hook"), field(&ev, "type"), field(&ev, "reason")),
        ("connect", "drop", "no_backend")
    );
    assert_eq!(field(&ev, "destination"), "10.96.0.40:80");
    assert!(ev["source"].is_null(), "{ev}");
    assert_eq!(field(&ev, "service"), "default/none");

    let to: SocketAddr = sa("10.96.0.41:80");
    env.in_client(|| TcpStream::connect_timeout(&to, Duration::from_secs(5)))
        .expect("connect through the frontend");
    let ev = m.line();
    assert_eq!(
        (field(&ev, "hook"), field(&ev, "reason")),
        ("connect", "translated")
    );
    assert_eq!(field(&ev, "new_destination"), format!("{pod}:8080"));
    assert_eq!(field(&ev, "service"), "default/echo");
    let (_, summary) = m.stop();
    assert_eq!(summary["shown"], 2, "{summary}");
}

fn ct_entries(pins: &Path) -> Vec<(proxy_common::Ct4Key, proxy_common::Ct4Value)> {
    let m: aya::maps::HashMap<MapData, proxy_common::Ct4Key, proxy_common::Ct4Value> =
        PinDir::new(pins)
            .typed(map_names::CT4, Access::ReadOnly)
            .expect("CT4");
    m.iter().map(|r| r.expect("entry")).collect()
}

fn ctl_delete(pins: &Path, args: &[&str]) -> (Option<i32>, Value) {
    let out = Command::new(BIN)
        .args(["--pin-path", pins.to_str().expect("utf-8"), "-o", "json"])
        .args(["conntrack", "delete"])
        .args(args)
        .output()
        .expect("run proxyctl conntrack delete");
    let doc = serde_json::from_slice(&out.stdout).unwrap_or(Value::Null);
    (out.status.code(), doc)
}

/// `proxyctl conntrack delete`: by flow (both directions), by backend id, by service id;
/// nothing changes without `--yes` (the entries are listed); a deleted UDP flow's next
/// datagram is a new flow.
#[test]
fn conntrack_delete_by_flow_backend_and_service() {
    let mut bed = Bed::new();
    let pins = bed.pins.path.clone();
    let web = Frontend::new(Ipv4Addr::new(10, 96, 0, 10), 80, Proto::Tcp);
    bed.writer
        .upsert(&entry(
            web,
            &[("10.1.1.2:8080", LOCAL), ("10.1.1.3:8080", LOCAL)],
            0,
        ))
        .expect("upsert");
    let dns = Frontend::new(Ipv4Addr::new(10, 96, 0, 53), 53, Proto::Udp);
    bed.writer
        .upsert(&entry(dns, &[("10.1.1.4:5353", LOCAL)], 0))
        .expect("upsert");
    // 20 TCP flows to web (both backends), 2 UDP flows to dns.
    let mut backends = std::collections::BTreeSet::new();
    for port in 0..20u16 {
        let (_, out) = bed.run(
            TC_INGRESS,
            &Pkt::tcp(
                &format!("198.51.100.7:{}", 40000 + port),
                "10.96.0.10:80",
                SYN,
            ),
        );
        backends.insert(out.dst);
    }
    assert_eq!(backends.len(), 2, "both backends chosen in 20 flows");
    for port in [5000, 5001] {
        bed.run(
            TC_INGRESS,
            &Pkt::udp(&format!("198.51.100.7:{port}"), "10.96.0.53:53"),
        );
    }
    assert_eq!(ct_entries(&pins).len(), 44, "two entries per flow");

    // Usage: no selector, and --source without --destination.
    let (code, _) = ctl_delete(&pins, &["--yes"]);
    assert_eq!(code, Some(2));
    let (code, _) = ctl_delete(&pins, &["--source", "198.51.100.7:5000", "--yes"]);
    assert_eq!(code, Some(2));

    // One UDP flow: without --yes listed (both directions), nothing deleted.
    let flow = [
        "--source",
        "198.51.100.7:5000",
        "--destination",
        "10.96.0.53:53",
        "--protocol",
        "udp",
    ];
    let (code, doc) = ctl_delete(&pins, &flow);
    assert_eq!(code, Some(0), "{doc}");
    assert_eq!(doc["deleted"], false);
    let dirs: Vec<&str> = doc["flows"]
        .as_array()
        .expect("flows")
        .iter()
        .map(|f| f["direction"].as_str().expect("direction"))
        .collect();
    assert_eq!(dirs.len(), 2, "{doc}");
    assert!(
        dirs.contains(&"original") && dirs.contains(&"reply"),
        "{doc}"
    );
    assert_eq!(ct_entries(&pins).len(), 44, "a dry run deletes nothing");
    let mut yes = flow.to_vec();
    yes.push("--yes");
    let (code, doc) = ctl_delete(&pins, &yes);
    assert_eq!(
        (code, &doc["deleted"]),
        (Some(0), &Value::Bool(true)),
        "{doc}"
    );
    let left = ct_entries(&pins);
    assert_eq!(left.len(), 42);
    let client = u32::from(Ipv4Addr::new(198, 51, 100, 7)).to_be();
    assert!(
        !left
            .iter()
            .any(|(k, v)| (k.saddr == client && k.sport == 5000u16.to_be())
                || (k.dir == 1 && v.dnat_port == 0 && k.dport == 5000u16.to_be())),
        "both directions of the flow are gone"
    );
    // Its next datagram is a new flow again (and the other UDP flow was left alone).
    let new_before = bed.counter(proxy_common::Reason::TcNewFlow);
    bed.run(TC_INGRESS, &Pkt::udp("198.51.100.7:5000", "10.96.0.53:53"));
    assert_eq!(bed.counter(proxy_common::Reason::TcNewFlow), new_before + 1);
    assert_eq!(ct_entries(&pins).len(), 44);

    // By backend id: every flow of one web backend, both directions.
    let (_, v) = ct_entries(&pins)
        .into_iter()
        .find(|(_, v)| v.dnat_port == 8080u16.to_be())
        .expect("a web flow");
    let id = v.backend_id;
    let of_backend = ct_entries(&pins)
        .iter()
        .filter(|(_, v)| v.backend_id == id)
        .count();
    assert!(of_backend >= 2 && of_backend % 2 == 0, "{of_backend}");
    let (code, doc) = ctl_delete(&pins, &["--backend-id", &id.to_string(), "--yes"]);
    assert_eq!(code, Some(0), "{doc}");
    assert_eq!(doc["flows"].as_array().expect("flows").len(), of_backend);
    assert!(!ct_entries(&pins).iter().any(|(_, v)| v.backend_id == id));
    assert_eq!(ct_entries(&pins).len(), 44 - of_backend);

    // By service id: all of web's remaining flows; dns's stay.
    let sid = v.service_id;
    let (code, _) = ctl_delete(&pins, &["--service-id", &sid.to_string(), "--yes"]);
    assert_eq!(code, Some(0));
    let left = ct_entries(&pins);
    assert_eq!(left.len(), 4, "only the two UDP flows are left");
    assert!(left.iter().all(|(_, v)| v.service_id != sid));
}
