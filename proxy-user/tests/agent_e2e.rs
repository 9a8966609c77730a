//! End to end: the real `proxy-agent` binary with a manifests directory, pods as network
//! namespaces running TCP servers, a client namespace in the test cgroup (see `support`).
//! Needs root; fails without it.
//!
//! Over 600 lines: one suite (the agent end to end over its manifests source). Each file
//! under `tests/` is a test binary of its own that links the whole crate, so a suite is
//! split into modules only when its scenarios stop sharing set-up (shared helpers live in
//! `tests/support/`).

mod support;

use std::{
    fs, io,
    net::{IpAddr, SocketAddr},
    path::{Path, PathBuf},
    sync::{
        atomic::{AtomicBool, AtomicUsize, Ordering},
        Arc,
    },
    time::{Duration, Instant},
};

use support::{
    manifests::{self, ready, service, slice, terminating},
    tcp_ask, unique, AgentProcess, TestEnv, Topology,
};

const TARGET: u16 = 8080;
const VIP: &str = "10.96.0.10";

fn vip() -> SocketAddr {
    SocketAddr::from(([10, 96, 0, 10], 80))
}

fn pod(i: usize) -> String {
    Topology::pod_v4(i).to_string()
}

/// The `web` Service (the VIP, port 80) and its slice: pod 1 only, in one manifest.
fn web_on_pod1() -> String {
    format!(
        "{}---\n{}",
        service("web", VIP, 80),
        slice("web-1", "web", TARGET, &[ready(&pod(1))])
    )
}

/// A manifests directory, removed on drop. Files are replaced atomically (write + rename),
/// as a config-management tool should.
struct Manifests(PathBuf);

impl Manifests {
    fn new() -> Self {
        let p = std::env::temp_dir().join(unique("ebpf-proxy-manifests-"));
        fs::create_dir_all(&p).expect("mkdir");
        Self(p)
    }
    fn write(&self, name: &str, text: &str) {
        let tmp = self.0.join(format!(".{name}.tmp"));
        fs::write(&tmp, text).expect("write");
        fs::rename(&tmp, self.0.join(name)).expect("rename");
    }
    fn remove(&self, name: &str) {
        fs::remove_file(self.0.join(name)).expect("rm");
    }
    fn arg(&self) -> [&str; 2] {
        ["--manifests", self.0.to_str().expect("utf-8")]
    }
}

impl Drop for Manifests {
    fn drop(&mut self) {
        let _ = fs::remove_dir_all(&self.0);
    }
}

/// How long a change may take to show in traffic: a liveness bound, not a figure (the
/// bench measures the time: endpoint change -> visible). Far above what a change takes on
/// a loaded 2-core machine, and below the agent's 30 s periodic re-diff, so only the
/// change's own sync can have applied it in time.
const FOLLOW: Duration = Duration::from_secs(20);

/// Connects until `done(answer)` holds for `streak` connections in a row; returns the
/// time from `since` to the first connection of that streak (at most [`FOLLOW`]).
fn until(
    since: Instant,
    streak: usize,
    done: impl Fn(&io::Result<(String, SocketAddr)>) -> bool,
) -> Duration {
    let mut run = 0;
    let mut first_ok = None;
    while since.elapsed() < FOLLOW {
        let at = Instant::now();
        let r = tcp_ask(vip());
        if done(&r) {
            first_ok.get_or_insert(at);
            run += 1;
            if run == streak {
                return first_ok.expect("set").duration_since(since);
            }
        } else {
            run = 0;
            first_ok = None;
        }
    }
    panic!("condition not reached within {FOLLOW:?}");
}

fn answer_is(r: &io::Result<(String, SocketAddr)>, pods: &[&str]) -> bool {
    matches!(r, Ok((p, _)) if pods.contains(&p.as_str()))
}

fn percentile(sorted: &[Duration], p: f64) -> Duration {
    sorted[((sorted.len() - 1) as f64 * p).round() as usize]
}

#[test]
fn agent_follows_the_manifests_directory() {
    let mut env = TestEnv::without_datapath(3);
    env.serve_all(TARGET);
    let dir = Manifests::new();
    dir.write("web.yaml", &service("web", VIP, 80));
    dir.write(
        "web-slice.yaml",
        &slice("web-1", "web", TARGET, &[ready(&pod(1)), ready(&pod(2))]),
    );
    let mut agent = AgentProcess::start(&env, &dir.arg());
    agent.wait_healthy(Duration::from_secs(20));

    let mut latencies = Vec::new();
    env.in_client(|| {
        // Created: reachable, both pods used.
        until(Instant::now(), 20, |r| answer_is(r, &["pod1", "pod2"]));

        // Scale up: pod3 gets traffic.
        let t0 = Instant::now();
        dir.write(
            "web-slice.yaml",
            &slice(
                "web-1",
                "web",
                TARGET,
                &[ready(&pod(1)), ready(&pod(2)), ready(&pod(3))],
            ),
        );
        latencies.push(until(t0, 1, |r| answer_is(r, &["pod3"])));

        // Scale down: pod1 gets no new connection.
        let t0 = Instant::now();
        dir.write(
            "web-slice.yaml",
            &slice("web-1", "web", TARGET, &[ready(&pod(2)), ready(&pod(3))]),
        );
        latencies.push(until(t0, 40, |r| answer_is(r, &["pod2", "pod3"])));

        // pod3 terminating (still serving) while pod2 is ready: only pod2 gets new ones.
        let t0 = Instant::now();
        dir.write(
            "web-slice.yaml",
            &slice(
                "web-1",
                "web",
                TARGET,
                &[ready(&pod(2)), terminating(&pod(3))],
            ),
        );
        latencies.push(until(t0, 40, |r| answer_is(r, &["pod2"])));

        // More changes, to measure the latency distribution: alternate pod1 and pod3.
        for i in 0..16 {
            let (p, name) = if i % 2 == 0 { (1, "pod1") } else { (3, "pod3") };
            let t0 = Instant::now();
            dir.write(
                "web-slice.yaml",
                &slice("web-1", "web", TARGET, &[ready(&pod(p))]),
            );
            latencies.push(until(t0, 10, |r| answer_is(r, &[name])));
        }

        // Endpoints gone: the Service refuses at once (kube-proxy's REJECT).
        let t0 = Instant::now();
        dir.write("web-slice.yaml", &slice("web-1", "web", TARGET, &[]));
        latencies.push(until(
            t0,
            5,
            |r| matches!(r, Err(e) if e.kind() == io::ErrorKind::ConnectionRefused),
        ));

        // Service deleted: the VIP is not translated any more (no route in the test net).
        let t0 = Instant::now();
        dir.remove("web.yaml");
        let d = until(
            t0,
            5,
            |r| matches!(r, Err(e) if e.raw_os_error() == Some(libc::ENETUNREACH)),
        );
        latencies.push(d);
    });

    let mut sorted = latencies.clone();
    sorted.sort();
    eprintln!(
        "change -> traffic follows (incl. 20 ms polling): n={} p50={:?} p99={:?} max={:?}",
        sorted.len(),
        percentile(&sorted, 0.5),
        percentile(&sorted, 0.99),
        sorted.last().expect("some")
    );
    // Every change was followed (`until`, within FOLLOW); how fast is the bench's figure.
    // The sync's gauges are set after its map writes, so traffic can see the deletion
    // a moment before `/metrics` does (a scrape in between still counts the frontend).
    let t0 = Instant::now();
    let metrics = loop {
        let m = agent.metrics();
        if m.contains("ebpf_proxy_programmed_frontends 0") || t0.elapsed() > FOLLOW {
            break m;
        }
        std::thread::sleep(Duration::from_millis(10));
    };
    assert!(
        metrics.contains("ebpf_proxy_network_programming_duration_seconds_count"),
        "{metrics}"
    );
    assert!(
        metrics.contains("ebpf_proxy_programmed_frontends 0"),
        "the deleted Service's frontend is still counted {FOLLOW:?} later: {metrics}"
    );
    for line in metrics
        .lines()
        .filter(|l| l.contains("network_programming_duration_seconds_"))
    {
        if line.contains("_sum") || line.contains("_count") {
            eprintln!("agent: {line}");
        }
    }
}

#[test]
fn restarting_the_agent_drops_no_connection() {
    let mut env = TestEnv::without_datapath(3);
    env.serve_all(TARGET);
    let dir = Manifests::new();
    dir.write("web.yaml", &service("web", VIP, 80));
    dir.write(
        "web-slice.yaml",
        &slice("web-1", "web", TARGET, &[ready(&pod(1)), ready(&pod(2))]),
    );
    let [m, d] = dir.arg();
    let mut agent = AgentProcess::start(&env, &[m, d, "--conntrack-max", "1000"]);
    agent.wait_healthy(Duration::from_secs(20));
    assert!(
        agent.metrics().contains("ebpf_proxy_conntrack_max 1000\n"),
        "the conntrack tables have the size asked for"
    );

    // A client hammers the VIP from its own thread for the whole test.
    let stop = Arc::new(AtomicBool::new(false));
    let (ok, failed) = (Arc::new(AtomicUsize::new(0)), Arc::new(AtomicUsize::new(0)));
    let client_ns = env.topo.client.path();
    let client = {
        let (stop, ok, failed) = (stop.clone(), ok.clone(), failed.clone());
        std::thread::spawn(move || {
            let _ns = support::NetnsGuard::enter(&client_ns);
            let mut errors = Vec::new();
            while !stop.load(Ordering::Relaxed) {
                match tcp_ask(vip()) {
                    Ok(_) => ok.fetch_add(1, Ordering::Relaxed),
                    Err(e) => {
                        errors.push(e.to_string());
                        failed.fetch_add(1, Ordering::Relaxed)
                    }
                };
            }
            errors
        })
    };
    std::thread::sleep(Duration::from_millis(300));
    let before_stop = ok.load(Ordering::Relaxed);
    agent.stop();
    // No agent: the pinned datapath keeps serving. Edit the manifests meanwhile.
    std::thread::sleep(Duration::from_millis(500));
    let during = ok.load(Ordering::Relaxed) - before_stop;
    dir.write(
        "web-slice.yaml",
        &slice("web-1", "web", TARGET, &[ready(&pod(2)), ready(&pod(3))]),
    );
    // Another size: the pinned tables are resized online at the start (staged
    // migration: the flows copied, the programs swapped) while the client connects.
    let mut agent = AgentProcess::start(&env, &[m, d, "--conntrack-max", "2000"]);
    agent.wait_healthy(Duration::from_secs(20));
    std::thread::sleep(Duration::from_millis(300));
    stop.store(true, Ordering::Relaxed);
    let metrics = agent.metrics();
    assert!(
        metrics.contains("ebpf_proxy_conntrack_max 2000\n"),
        "the pinned tables are resized to the new --conntrack-max: {metrics}"
    );
    for map in ["CT4", "CT6"] {
        assert!(
            metrics.contains(&format!(
                "ebpf_proxy_map_resizes_total{{map=\"{map}\",direction=\"grow\"}} 1\n"
            )),
            "{metrics}"
        );
    }
    let errors = client.join().expect("client");
    eprintln!(
        "connections: {} ok ({during} while no agent ran), {} failed",
        ok.load(Ordering::Relaxed),
        failed.load(Ordering::Relaxed)
    );
    assert!(
        errors.is_empty(),
        "failed connections across the restart: {errors:?}"
    );
    assert!(during > 10, "the client kept connecting while no agent ran");
    let logs = agent.logs();
    assert!(
        logs.contains("resizing the pinned map online") && logs.contains("layout migration done"),
        "{logs}"
    );
    assert!(
        !logs.contains("the pinned conntrack tables keep their size"),
        "{logs}"
    );
    // The edit made while no agent ran is applied by the new one.
    env.in_client(|| until(Instant::now(), 40, |r| answer_is(r, &["pod2", "pod3"])));
}

#[test]
fn bad_manifests_are_reported_and_the_rest_keeps_working() {
    let mut env = TestEnv::without_datapath(1);
    env.serve_all(TARGET);
    let dir = Manifests::new();
    dir.write("good.yaml", &web_on_pod1());
    dir.write("broken.yaml", "kind: Service\nmetadata: {name: broken\n");
    dir.write("bad-ip.yaml", &service("bad-ip", "10.96.0.300", 80));
    dir.write(
        "bad-port.yaml",
        &service("bad-port", "10.96.0.21", 80).replace("port: 80", "port: 70000"),
    );
    dir.write(
        "bad-proto.yaml",
        &service("bad-proto", "10.96.0.22", 80).replace("TCP", "ICMP"),
    );
    dir.write(
        "orphan.yaml",
        &slice("orphan-1", "no-such-service", TARGET, &[ready(&pod(1))]),
    );
    let mut agent = AgentProcess::start(&env, &dir.arg());
    agent.wait_healthy(Duration::from_secs(20));
    env.in_client(|| until(Instant::now(), 10, |r| answer_is(r, &["pod1"])));

    let metrics = agent.metrics();
    for want in [
        "kind=\"file\",reason=\"parse_error\"} 1",
        "kind=\"Service\",reason=\"bad_cluster_ip\"} 1",
        "kind=\"Service\",reason=\"bad_port\"} 1",
        "kind=\"Service\",reason=\"unknown_protocol\"} 1",
        "kind=\"EndpointSlice\",reason=\"service_missing\"} 1",
        "ebpf_proxy_programmed_frontends 1",
    ] {
        assert!(metrics.contains(want), "{want} missing:\n{metrics}");
    }
    // This node's Node object being deleted: /healthz says 503 (load balancers drain
    // the node) and traffic keeps flowing.
    assert_eq!(agent.healthz().0, 200);
    dir.write(
        "node.yaml",
        "apiVersion: v1\nkind: Node\nmetadata: {name: node-a, deletionTimestamp: \"2026-11-30T12:00:00Z\"}\n",
    );
    let body = agent.wait_healthz(503, Duration::from_secs(5));
    assert!(body.contains("the node is being deleted"), "{body}");
    env.in_client(|| until(Instant::now(), 10, |r| answer_is(r, &["pod1"])));
    dir.write(
        "node.yaml",
        "apiVersion: v1\nkind: Node\nmetadata: {name: node-a}\n",
    );
    agent.wait_healthz(200, Duration::from_secs(5));

    let logs = agent.stop();
    for want in [
        "broken.yaml does not parse",
        "skipping Service default/bad-ip: clusterIP \"10.96.0.300\" is not an IP address",
        "skipping Service default/bad-port: port 70000 of port \"http\" is out of range",
        "skipping Service default/bad-proto: unknown protocol \"ICMP\"",
        "EndpointSlice default/orphan-1: Service default/no-such-service not found",
    ] {
        assert!(logs.contains(want), "log line {want:?} missing:\n{logs}");
    }
}

fn big_manifest(path: &Path, services: usize, endpoints: usize) {
    fs::write(path, manifests::many_services(services, endpoints, TARGET)).expect("write");
}

fn rss_kib(pid: u32) -> u64 {
    fs::read_to_string(format!("/proc/{pid}/status"))
        .expect("status")
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.split_whitespace().next()?.parse().ok())
        .expect("VmRSS")
}

#[test]
fn a_thousand_services_with_ten_endpoints_each() {
    let mut env = TestEnv::without_datapath(1);
    env.serve_all(TARGET);
    let dir = Manifests::new();
    big_manifest(&dir.0.join("big.yaml"), 1000, 10);
    dir.write("web.yaml", &web_on_pod1());
    let start = Instant::now();
    let mut agent = AgentProcess::start(&env, &dir.arg());
    agent.wait_healthy(Duration::from_secs(60));
    let programmed = start.elapsed();
    let metrics = agent.metrics();
    assert!(
        metrics.contains("ebpf_proxy_programmed_frontends 1001"),
        "{metrics}"
    );
    assert!(
        metrics.contains("ebpf_proxy_programmed_backends 10001"),
        "{metrics}"
    );
    let rss = rss_kib(agent.child.id());
    eprintln!("1,000 services x 10 endpoints: programmed in {programmed:?} (from process start), agent RSS {} MiB", rss / 1024);
    env.in_client(|| until(Instant::now(), 5, |r| answer_is(r, &["pod1"])));
    // One endpoint change among 1,001 services is applied as a delta.
    let t0 = Instant::now();
    dir.write(
        "web.yaml",
        &format!(
            "{}---\n{}",
            service("web", VIP, 80),
            slice("web-1", "web", TARGET, &[])
        ),
    );
    let d = env.in_client(|| {
        until(
            t0,
            3,
            |r| matches!(r, Err(e) if e.kind() == io::ErrorKind::ConnectionRefused),
        )
    });
    // Applied by its own sync (within FOLLOW, under the 30 s re-diff); the time is logged.
    eprintln!("one endpoint change at 1,001 services took effect in {d:?}");
}

/// `ebpf_proxy_map_memory_bytes{map="SVC4"}` in a metrics text (0 when absent).
fn svc4_memory(metrics: &str) -> u64 {
    map_memory(metrics, "SVC4")
}

/// `ebpf_proxy_map_memory_bytes{map="<map>"}` in a metrics text (0 when absent).
fn map_memory(metrics: &str, map: &str) -> u64 {
    let prefix = format!("ebpf_proxy_map_memory_bytes{{map=\"{map}\"}} ");
    metrics
        .lines()
        .find_map(|l| l.strip_prefix(prefix.as_str()))
        .and_then(|v| v.trim().parse().ok())
        .unwrap_or(0)
}

/// The maps' memory gauge follows a sync that wrote entries within seconds, not at the
/// next 10 s refresh: `SVC4` (no preallocation) grows by its new elements. Three rounds
/// of 1,000 new Services, each read within 4 s of being programmed (a fixed 10 s refresh
/// alone would have to fall inside all three 4 s windows).
#[test]
fn map_memory_follows_a_sync_within_seconds() {
    let mut env = TestEnv::without_datapath(1);
    env.serve_all(TARGET);
    let dir = Manifests::new();
    dir.write("web.yaml", &web_on_pod1());
    let mut agent = AgentProcess::start(&env, &dir.arg());
    agent.wait_healthy(Duration::from_secs(60));
    let mut before = svc4_memory(&wait_metrics(
        &agent,
        &["ebpf_proxy_map_memory_bytes{map=\"SVC4\"}"],
        Duration::from_secs(30),
    ));
    for round in 1..=3usize {
        big_manifest(&dir.0.join("big.yaml"), round * 1000, 2);
        let frontends = format!("ebpf_proxy_programmed_frontends {}", round * 1000 + 1);
        wait_metrics(&agent, &[&frontends], Duration::from_secs(60));
        let programmed = Instant::now();
        // 1,000 frontends and 2,000 slots more: each element is at least its key and value.
        let want = before + 3000 * 48;
        let now = loop {
            let m = svc4_memory(&agent.metrics());
            if m >= want {
                break m;
            }
            assert!(
                programmed.elapsed() < Duration::from_secs(4),
                "round {round}: SVC4's memory gauge still {m} bytes 4 s after {} frontends \
                 were programmed (was {before}, want >= {want})",
                round * 1000 + 1
            );
            std::thread::sleep(Duration::from_millis(100));
        };
        eprintln!(
            "round {round}: SVC4 {before} -> {now} bytes, read {:?} after programming",
            programmed.elapsed()
        );
        before = now;
    }
}

#[test]
fn connected_udp_sockets_to_a_removed_backend_are_closed() {
    let mut env = TestEnv::without_datapath(2);
    env.serve_all(TARGET);
    let dir = Manifests::new();
    let udp = |t: String| t.replace("protocol: TCP", "protocol: UDP");
    dir.write("dns.yaml", &udp(service("dns", VIP, 53)));
    dir.write(
        "dns-slice.yaml",
        &udp(slice("dns-1", "dns", TARGET, &[ready(&pod(1))])),
    );
    let mut agent = AgentProcess::start(&env, &dir.arg());
    agent.wait_healthy(Duration::from_secs(20));

    // A client thread living in the client namespace (as a pod's process does) with a
    // connected UDP socket, rewritten to pod1 at connect().
    let dns = SocketAddr::from(([10, 96, 0, 10], 53));
    let client_ns = env.topo.client.path();
    let (tx, rx) = std::sync::mpsc::channel::<&str>();
    let (done_tx, done_rx) = std::sync::mpsc::channel::<io::Result<String>>();
    let client = std::thread::spawn(move || {
        let _ns = support::NetnsGuard::enter(&client_ns);
        let sock = std::net::UdpSocket::bind("0.0.0.0:0").expect("bind");
        sock.connect(dns).expect("connect");
        sock.set_read_timeout(Some(Duration::from_millis(200)))
            .expect("timeout");
        let ask = |s: &std::net::UdpSocket| -> io::Result<String> {
            s.send(b"who?")?;
            let mut buf = [0u8; 64];
            let n = s.recv(&mut buf)?;
            Ok(String::from_utf8_lossy(&buf[..n]).trim().to_string())
        };
        done_tx.send(ask(&sock)).expect("report");
        // Then ask until the socket fails (or the test gives up).
        while rx.recv().is_ok() {
            done_tx.send(ask(&sock)).expect("report");
        }
    });
    assert_eq!(done_rx.recv().expect("first").expect("answer"), "pod1");

    // pod1 leaves the Service (its server still runs: without the cleanup the socket
    // would keep talking to it).
    dir.write(
        "dns-slice.yaml",
        &udp(slice("dns-1", "dns", TARGET, &[ready(&pod(2))])),
    );
    let start = Instant::now();
    let err = loop {
        tx.send("ask").expect("ask");
        match done_rx.recv().expect("reply") {
            Ok(pod) => {
                assert_eq!(pod, "pod1", "a connected socket keeps its backend");
                assert!(
                    start.elapsed() < FOLLOW,
                    "the stale socket was not closed within {FOLLOW:?}:\n{}",
                    agent.logs()
                );
                std::thread::sleep(Duration::from_millis(50));
            }
            Err(e) => break e,
        }
    };
    drop(tx);
    client.join().expect("client");
    // The socket is disconnected with ECONNABORTED pending: a recv reports that, a send
    // fails first with EDESTADDRREQ (no peer any more). Either way the client reconnects.
    assert!(
        err.kind() == io::ErrorKind::ConnectionAborted
            || err.raw_os_error() == Some(libc::EDESTADDRREQ),
        "{err}"
    );
    assert!(agent
        .metrics()
        .contains("ebpf_proxy_stale_udp_sockets_destroyed_total 1"));
    // A new socket goes to the live backend.
    env.in_client(|| {
        let s = std::net::UdpSocket::bind("0.0.0.0:0").expect("bind");
        s.set_read_timeout(Some(Duration::from_secs(1)))
            .expect("timeout");
        let (pod, from) = support::udp_ask(&s, dns).expect("ask");
        assert_eq!((pod.as_str(), from), ("pod2", dns));
    });
}

/// A client thread in the client namespace with one UDP socket connected to `dns`: asks
/// every 20 ms until the socket fails or `for_how_long` passes. Returns every answer with
/// its time, and the error that ended it.
fn connected_udp_client(
    env: &TestEnv,
    dns: SocketAddr,
    for_how_long: Duration,
) -> (
    std::sync::mpsc::Receiver<(Instant, String)>,
    std::thread::JoinHandle<Option<io::Error>>,
) {
    let client_ns = env.topo.client.path();
    let (tx, rx) = std::sync::mpsc::channel();
    let handle = std::thread::spawn(move || {
        let _ns = support::NetnsGuard::enter(&client_ns);
        let sock = std::net::UdpSocket::bind("0.0.0.0:0").expect("bind");
        sock.connect(dns).expect("connect");
        sock.set_read_timeout(Some(Duration::from_millis(200)))
            .expect("timeout");
        let start = Instant::now();
        while start.elapsed() < for_how_long {
            let r = sock.send(b"who?").and_then(|_| {
                let mut buf = [0u8; 64];
                let n = sock.recv(&mut buf)?;
                Ok(String::from_utf8_lossy(&buf[..n]).trim().to_string())
            });
            match r {
                Ok(pod) => {
                    if tx.send((Instant::now(), pod)).is_err() {
                        return None;
                    }
                }
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => {}
                Err(e) => return Some(e),
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        None
    });
    (rx, handle)
}

/// Waits for the client's first answer, which must come from `pod`.
fn first_answer(rx: &std::sync::mpsc::Receiver<(Instant, String)>, pod: &str) {
    let (_, first) = rx
        .recv_timeout(Duration::from_secs(5))
        .expect("first answer");
    assert_eq!(first, pod);
}

/// Ends the client and checks it: the socket failed as a destroyed one does, within the
/// client's window (its liveness bound). How long after `since` the last answer from
/// `removed` came is logged, not asserted (a figure, not behaviour).
fn assert_destroyed(
    rx: std::sync::mpsc::Receiver<(Instant, String)>,
    client: std::thread::JoinHandle<Option<io::Error>>,
    removed: &str,
    since: Instant,
    logs: impl Fn() -> String,
) {
    let err = client.join().expect("client");
    let answers: Vec<(Instant, String)> = rx.try_iter().collect();
    let from_removed: Vec<Duration> = answers
        .iter()
        .filter(|(t, p)| p == removed && *t > since)
        .map(|(t, _)| t.duration_since(since))
        .collect();
    eprintln!(
        "{} answers from {removed} after the change (last {:?} after it)",
        from_removed.len(),
        from_removed.last()
    );
    let err = err.unwrap_or_else(|| panic!("the stale socket was never closed:\n{}", logs()));
    assert!(
        err.kind() == io::ErrorKind::ConnectionAborted
            || err.raw_os_error() == Some(libc::EDESTADDRREQ),
        "{err}"
    );
}

/// Issue 11, item 7: an agent that adopted the pinned hooks after a restart still knows
/// the hooked cgroup, so a UDP backend that leaves while it runs has its connected
/// sockets destroyed, as with a fresh agent.
#[test]
fn a_restarted_agent_destroys_connected_udp_sockets_to_a_removed_backend() {
    let mut env = TestEnv::without_datapath(2);
    env.serve_all(TARGET);
    let dir = Manifests::new();
    let udp = |t: String| t.replace("protocol: TCP", "protocol: UDP");
    dir.write("dns.yaml", &udp(service("dns", VIP, 53)));
    dir.write(
        "dns-slice.yaml",
        &udp(slice("dns-1", "dns", TARGET, &[ready(&pod(1))])),
    );
    let mut agent = AgentProcess::start(&env, &dir.arg());
    agent.wait_healthy(Duration::from_secs(20));
    agent.stop();
    let mut agent = AgentProcess::start(&env, &dir.arg());
    agent.wait_healthy(Duration::from_secs(20));

    let dns = SocketAddr::from(([10, 96, 0, 10], 53));
    let (rx, client) = connected_udp_client(&env, dns, FOLLOW);
    first_answer(&rx, "pod1");
    dir.write(
        "dns-slice.yaml",
        &udp(slice("dns-1", "dns", TARGET, &[ready(&pod(2))])),
    );
    let change = Instant::now();
    assert_destroyed(rx, client, "pod1", change, || agent.logs());
    assert!(agent
        .metrics()
        .contains("ebpf_proxy_stale_udp_sockets_destroyed_total 1"));
    let logs = agent.logs();
    assert!(logs.contains("adopted the pinned datapath"), "{logs}");
    assert!(!logs.contains("cgroup=None"), "{logs}");
}

/// Issue 11, item 7: a UDP backend that left while no agent ran is released by the
/// adopting agent's first full re-diff, and its connected sockets are destroyed then.
#[test]
fn a_udp_backend_removed_while_the_agent_was_down_has_its_sockets_destroyed() {
    let mut env = TestEnv::without_datapath(2);
    env.serve_all(TARGET);
    let dir = Manifests::new();
    let udp = |t: String| t.replace("protocol: TCP", "protocol: UDP");
    dir.write("dns.yaml", &udp(service("dns", VIP, 53)));
    dir.write(
        "dns-slice.yaml",
        &udp(slice("dns-1", "dns", TARGET, &[ready(&pod(1))])),
    );
    let mut agent = AgentProcess::start(&env, &dir.arg());
    agent.wait_healthy(Duration::from_secs(20));

    let dns = SocketAddr::from(([10, 96, 0, 10], 53));
    let (rx, client) = connected_udp_client(&env, dns, FOLLOW * 2); // a restart inside
    first_answer(&rx, "pod1");
    agent.stop();
    dir.write(
        "dns-slice.yaml",
        &udp(slice("dns-1", "dns", TARGET, &[ready(&pod(2))])),
    );
    std::thread::sleep(Duration::from_millis(300));
    let mut agent = AgentProcess::start(&env, &dir.arg());
    agent.wait_healthy(Duration::from_secs(20));
    let synced = Instant::now();
    assert_destroyed(rx, client, "pod1", synced, || agent.logs());
    assert!(agent
        .metrics()
        .contains("ebpf_proxy_stale_udp_sockets_destroyed_total 1"));
}

/// Issue 11, item 7 (related): under endpoint churn, a long-lived *unconnected* UDP socket
/// (each `sendmsg` is balanced afresh) gets no answer from a pod that left the Service
/// more than 1 s earlier.
#[test]
fn an_unconnected_udp_socket_under_churn_never_reaches_a_pod_removed_1s_earlier() {
    unconnected_udp_under_churn(false, false);
}

/// The same after a restart and with `sessionAffinity: ClientIP`: the adopting agent's
/// model of the pinned maps must let it remove what the previous one wrote, and the
/// client's remembered backend must not outlive its removal.
#[test]
fn an_unconnected_udp_socket_under_churn_after_a_restart_never_reaches_a_removed_pod() {
    unconnected_udp_under_churn(true, true);
}

fn unconnected_udp_under_churn(affinity: bool, restart: bool) {
    let mut env = TestEnv::without_datapath(6);
    env.serve_all(TARGET);
    let dir = Manifests::new();
    let udp = |t: String| t.replace("protocol: TCP", "protocol: UDP");
    // Every 500 ms one pod leaves and one joins: each is in the Service for 1 s, then out
    // for 2 s (1 s in which it must get nothing).
    let sets: [[usize; 2]; 6] = [[1, 2], [2, 3], [3, 4], [4, 5], [5, 6], [6, 1]];
    let write = |set: &[usize; 2]| {
        let eps: Vec<String> = set.iter().map(|i| pod(*i)).collect();
        let eps: Vec<_> = eps.iter().map(|a| ready(a)).collect();
        dir.write("dns-slice.yaml", &udp(slice("dns-1", "dns", TARGET, &eps)));
    };
    let mut svc = udp(service("dns", VIP, 53));
    if affinity {
        svc = svc.replace("  ports:\n", "  sessionAffinity: ClientIP\n  ports:\n");
    }
    dir.write("dns.yaml", &svc);
    write(&sets[0]);
    let mut agent = AgentProcess::start(&env, &dir.arg());
    agent.wait_healthy(Duration::from_secs(20));
    if restart {
        agent.stop();
        agent = AgentProcess::start(&env, &dir.arg());
        agent.wait_healthy(Duration::from_secs(20));
    }

    let dns = SocketAddr::from(([10, 96, 0, 10], 53));
    let client_ns = env.topo.client.path();
    let stop = Arc::new(AtomicBool::new(false));
    let client = {
        let stop = stop.clone();
        std::thread::spawn(move || {
            let _ns = support::NetnsGuard::enter(&client_ns);
            let sock = std::net::UdpSocket::bind("0.0.0.0:0").expect("bind");
            sock.set_read_timeout(Some(Duration::from_millis(100)))
                .expect("timeout");
            let mut answers = Vec::new();
            while !stop.load(Ordering::Relaxed) {
                if let Ok((pod, from)) = support::udp_ask(&sock, dns) {
                    assert_eq!(from, dns, "the reply's source is the VIP");
                    answers.push((Instant::now(), pod));
                }
                std::thread::sleep(Duration::from_millis(2));
            }
            answers
        })
    };
    let mut written = vec![(Instant::now(), sets[0])];
    for round in 1..=12 {
        std::thread::sleep(Duration::from_millis(500));
        let set = sets[round % sets.len()];
        write(&set);
        written.push((Instant::now(), set));
    }
    std::thread::sleep(Duration::from_millis(1500));
    stop.store(true, Ordering::Relaxed);
    let answers = client.join().expect("client");

    // A pod may answer at `t` if it was in the Service at some time in [t - 1 s, t].
    let in_service_at = |x: Instant| {
        written
            .iter()
            .rev()
            .find(|(w, _)| *w <= x)
            .map_or(sets[0], |(_, s)| *s)
    };
    let stale: Vec<(Duration, &String)> = answers
        .iter()
        .filter(|(t, pod)| {
            let from = *t - Duration::from_secs(1);
            let n: usize = pod.trim_start_matches("pod").parse().expect("pod name");
            let allowed = in_service_at(from).contains(&n)
                || written
                    .iter()
                    .any(|(w, s)| *w > from && *w <= *t && s.contains(&n));
            !allowed
        })
        .map(|(t, p)| (t.duration_since(written[0].0), p))
        .collect();
    eprintln!(
        "{} answers under churn, {} from a pod removed more than 1 s earlier",
        answers.len(),
        stale.len()
    );
    assert!(answers.len() > 200, "too few answers: {}", answers.len());
    assert!(
        stale.is_empty(),
        "answers from removed pods: {:?}\n{}",
        &stale[..stale.len().min(20)],
        agent.logs()
    );
}

/// Like [`until`], for any destination.
fn until_at(
    dest: SocketAddr,
    streak: usize,
    done: impl Fn(&io::Result<(String, SocketAddr)>) -> bool,
) {
    let since = Instant::now();
    let mut run = 0;
    let mut last = None;
    while since.elapsed() < FOLLOW {
        let r = tcp_ask(dest);
        if done(&r) {
            run += 1;
            if run == streak {
                return;
            }
        } else {
            run = 0;
        }
        last = Some(r);
    }
    panic!("{dest}: condition not reached within {FOLLOW:?} (last answer {last:?})");
}

fn refused(r: &io::Result<(String, SocketAddr)>) -> bool {
    matches!(r, Err(e) if e.kind() == io::ErrorKind::ConnectionRefused)
}

fn no_route_to_host(r: &io::Result<(String, SocketAddr)>) -> bool {
    matches!(r, Err(e) if e.raw_os_error() == Some(libc::EHOSTUNREACH))
}

/// One endpoint as YAML with its node and conditions (for slices the helper cannot make).
fn ep_yaml(addr: &str, node: &str, ready: bool, serving: bool, terminating: bool) -> String {
    format!(
        "- addresses: [\"{addr}\"]\n  nodeName: {node}\n  conditions: {{ready: {ready}, serving: {serving}, terminating: {terminating}}}\n"
    )
}

/// Issue 11 items 2-4 through the real agent and socket hooks (upstream rules: topology.go
/// CategorizeEndpoints selects on IsReady(); endpointslicecache.go keeps the
/// non-terminating copy of a duplicate; the iptables proxier REJECTs a Local-policy
/// Service without any endpoint and DROPs one whose endpoints are all elsewhere).
#[test]
fn endpoint_conditions_duplicates_and_local_policy_without_endpoints() {
    let mut env = TestEnv::without_datapath(2);
    env.serve_all(TARGET);
    let dir = Manifests::new();
    // A slice head without endpoints; `ep_yaml` lines follow.
    let named = |slice_name: &str, svc: &str| {
        slice(slice_name, svc, TARGET, &[]).replace("endpoints: []\n", "endpoints:\n")
    };
    // 11.2: publishNotReadyAddresses writes ready=true for a terminating, not serving pod.
    dir.write("pnra.yaml", &service("pnra", "10.96.0.31", 80));
    dir.write(
        "pnra-slice.yaml",
        &(named("pnra-1", "pnra") + &ep_yaml(&pod(1), "node-a", true, false, true)),
    );
    // 11.3: pod2 terminating (not serving) in the first slice, live in the second.
    dir.write("dup.yaml", &service("dup", "10.96.0.32", 80));
    dir.write(
        "dup-slices.yaml",
        &format!(
            "{}---\n{}",
            named("dup-a", "dup") + &ep_yaml(&pod(2), "node-a", false, false, true),
            named("dup-b", "dup") + &ep_yaml(&pod(2), "node-a", true, true, false)
        ),
    );
    // 11.4: internalTrafficPolicy Local, no endpoints at all; and one with endpoints on
    // another node only.
    let itp = |name: &str, vip: &str| {
        service(name, vip, 80).replace("spec:\n", "spec:\n  internalTrafficPolicy: Local\n")
    };
    dir.write("itp-none.yaml", &itp("itp-none", "10.96.0.33"));
    dir.write(
        "itp-remote.yaml",
        &(itp("itp-remote", "10.96.0.34")
            + "---\n"
            + &named("itp-remote-1", "itp-remote")
            + &ep_yaml(&pod(1), "node-b", true, true, false)),
    );
    let mut agent = AgentProcess::start(&env, &dir.arg());
    agent.wait_healthy(Duration::from_secs(20));
    let at = |vip: [u8; 4]| SocketAddr::from((vip, 80));
    env.in_client(|| {
        until_at(at([10, 96, 0, 31]), 10, |r| answer_is(r, &["pod1"]));
        until_at(at([10, 96, 0, 32]), 10, |r| answer_is(r, &["pod2"]));
        until_at(at([10, 96, 0, 33]), 5, refused);
        until_at(at([10, 96, 0, 34]), 5, no_route_to_host);
        // A plain ready pod next to the ready+terminating one: both get traffic.
        dir.write(
            "pnra-slice.yaml",
            &(named("pnra-1", "pnra")
                + &ep_yaml(&pod(1), "node-a", true, false, true)
                + &ep_yaml(&pod(2), "node-a", true, true, false)),
        );
        let mut seen = std::collections::BTreeSet::new();
        let since = Instant::now();
        while seen.len() < 2 && since.elapsed() < FOLLOW {
            if let Ok((p, _)) = tcp_ask(at([10, 96, 0, 31])) {
                seen.insert(p);
            }
        }
        assert_eq!(
            seen.into_iter().collect::<Vec<_>>(),
            ["pod1", "pod2"],
            "both ready endpoints get traffic"
        );
    });
    let logs = agent.stop();
    assert!(!logs.contains("panicked"), "{logs}");
}

/// Issue 12 item 5: `ipFamilies: [IPv6]` with an IPv4 clusterIP is skipped with
/// `family_mismatch`, counted and logged; the VIP is not programmed.
#[test]
fn a_cluster_ip_of_the_wrong_family_is_skipped_counted_and_logged() {
    let mut env = TestEnv::without_datapath(1);
    env.serve_all(TARGET);
    let dir = Manifests::new();
    dir.write("good.yaml", &web_on_pod1());
    dir.write(
        "v6.yaml",
        &format!(
            "{}---\n{}",
            service("v6", "10.96.79.15", 80).replace("spec:\n", "spec:\n  ipFamilies: [IPv6]\n"),
            slice("v6-1", "v6", TARGET, &[ready(&pod(1))])
        ),
    );
    let mut agent = AgentProcess::start(&env, &dir.arg());
    agent.wait_healthy(Duration::from_secs(20));
    env.in_client(|| {
        until(Instant::now(), 5, |r| answer_is(r, &["pod1"]));
        until_at(
            SocketAddr::from(([10, 96, 79, 15], 80)),
            5,
            |r| matches!(r, Err(e) if e.raw_os_error() == Some(libc::ENETUNREACH)),
        );
    });
    let metrics = agent.metrics();
    assert!(
        metrics.contains("kind=\"Service\",reason=\"family_mismatch\"} 1"),
        "{metrics}"
    );
    assert!(
        metrics.contains("ebpf_proxy_programmed_frontends 1"),
        "{metrics}"
    );
    let logs = agent.stop();
    assert!(
        logs.contains(
            "skipping Service default/v6: clusterIPs[0] 10.96.79.15 is not of ipFamilies[0] IPv6"
        ),
        "{logs}"
    );
}

/// `--service-cluster-ip-range` (issue #24 item 5): another port of a ClusterIP is refused
/// with ECONNREFUSED, an unallocated address in the range with EPERM, both at once; a
/// removed Service's address becomes unallocated; outside the range nothing changes.
#[test]
fn service_cidrs_from_the_flag_reject_and_drop_inside_the_range_only() {
    let mut env = TestEnv::without_datapath(1);
    env.serve_all(TARGET);
    let dir = Manifests::new();
    dir.write("web.yaml", &web_on_pod1());
    let mut args = dir.arg().to_vec();
    args.extend(["--service-cluster-ip-range", "10.96.0.0/16,fd00:96::/112"]);
    let mut agent = AgentProcess::start(&env, &args);
    agent.wait_healthy(Duration::from_secs(20));
    let errno_is = |want: i32| move |r: &io::Result<(String, SocketAddr)>| matches!(r, Err(e) if e.raw_os_error() == Some(want));
    env.in_client(|| {
        until(Instant::now(), 5, |r| answer_is(r, &["pod1"]));
        until_at(
            SocketAddr::from(([10, 96, 0, 10], 81)),
            5,
            errno_is(libc::ECONNREFUSED),
        );
        until_at(
            SocketAddr::from(([10, 96, 0, 99], 80)),
            5,
            errno_is(libc::EPERM),
        );
        until_at(
            SocketAddr::from(([10, 97, 0, 10], 80)),
            5,
            errno_is(libc::ENETUNREACH),
        );
        tcp_ask(SocketAddr::new(IpAddr::V4(Topology::pod_v4(1)), TARGET)).expect("pod");
    });
    dir.remove("web.yaml");
    env.in_client(|| {
        until_at(vip(), 5, errno_is(libc::EPERM));
    });
    let stats = proxy_user::BpfMaps::open(&env.pins.path)
        .expect("maps")
        .stats()
        .expect("stats");
    for reason in [
        proxy_common::Reason::SvcPortUnused,
        proxy_common::Reason::SvcCidrUnallocated,
    ] {
        assert!(
            stats.iter().any(|(r, n)| *r == reason && *n >= 5),
            "{reason:?} counted: {stats:?}"
        );
    }
    // The ranges stay; the removed Service's marker is gone.
    let held = proxy_user::svc_cidr::read(&env.pins.dir()).expect("read");
    assert_eq!(held.len(), 2, "{held:?}");
    agent.stop();
}

// ---------------------------------------------------------------------------------------
// Bad input, conflicts, restarts and floods (issue 12)

/// `service()` with a `metadata.creationTimestamp`.
fn service_created(name: &str, vip: &str, created: &str) -> String {
    service(name, vip, 80).replace(
        "  namespace: default\n",
        &format!("  namespace: default\n  creationTimestamp: \"{created}\"\n"),
    )
}

/// A client connecting to the VIP from the client namespace in a loop, recording every
/// answer (the pod) or error.
struct Hammer {
    stop: Arc<AtomicBool>,
    thread: std::thread::JoinHandle<Vec<Result<String, String>>>,
}

impl Hammer {
    fn start(env: &TestEnv) -> Self {
        let stop = Arc::new(AtomicBool::new(false));
        let client_ns = env.topo.client.path();
        let thread = {
            let stop = stop.clone();
            std::thread::spawn(move || {
                let _ns = support::NetnsGuard::enter(&client_ns);
                let mut out = Vec::new();
                while !stop.load(Ordering::Relaxed) {
                    out.push(tcp_ask(vip()).map(|(p, _)| p).map_err(|e| e.to_string()));
                }
                out
            })
        };
        Self { stop, thread }
    }

    fn stop(self) -> Vec<Result<String, String>> {
        self.stop.store(true, Ordering::Relaxed);
        self.thread.join().expect("client")
    }
}

fn errors(answers: &[Result<String, String>]) -> Vec<&String> {
    answers.iter().filter_map(|a| a.as_ref().err()).collect()
}

/// Issue 24, item 4: a process on the node connecting to `127.0.0.1:<nodePort>` reaches
/// the Service (kube-proxy's iptables mode, `localhostNodePorts`), and sees the address
/// it asked for; not when `--nodeport-addresses` leaves loopback out (as kube-proxy).
#[test]
fn node_ports_answer_on_localhost_unless_nodeport_addresses_leave_it_out() {
    let mut env = TestEnv::without_datapath(2);
    env.serve_all(TARGET);
    let dir = Manifests::new();
    dir.write(
        "web.yaml",
        &format!(
            "{}---\n{}",
            service("web", VIP, 80).replace(
                "    targetPort: http\n",
                "    targetPort: http\n    nodePort: 30080\n  type: NodePort\n"
            ),
            slice("web-1", "web", TARGET, &[ready(&pod(1))])
        ),
    );
    let local = SocketAddr::from(([127, 0, 0, 1], 30080));
    let mut agent = AgentProcess::start(&env, &dir.arg());
    agent.wait_healthy(Duration::from_secs(20));
    env.in_client(|| until(Instant::now(), 10, |r| answer_is(r, &["pod1"])));
    let answers: Vec<_> = env.in_client(|| (0..20).map(|_| tcp_ask(local)).collect());
    for a in &answers {
        let (pod, peer) = a.as_ref().expect("127.0.0.1:30080 answers");
        assert_eq!((pod.as_str(), *peer), ("pod1", local));
    }
    // ::1 is not a NodePort address (kube-proxy serves localhost NodePorts on IPv4 only).
    let _ = agent.stop();

    // Loopback left out: 127.0.0.1:30080 is not translated (nothing listens there).
    let [m, d] = dir.arg();
    let mut agent = AgentProcess::start(&env, &[m, d, "--nodeport-addresses", "192.0.2.0/24"]);
    agent.wait_healthy(Duration::from_secs(20));
    env.in_client(|| until(Instant::now(), 10, |r| answer_is(r, &["pod1"])));
    env.in_client(|| {
        let r = tcp_ask(local);
        assert!(r.is_err(), "127.0.0.1:30080 still served: {r:?}");
    });
}

/// Issue 24, item 3: `--nodeport-addresses` CIDRs: NodePorts answer only on the node
/// addresses they select (a node with two addresses, from its Node object), at the socket
/// hooks (TC and XDP take the same lookup over the same map).
#[test]
fn node_ports_answer_only_on_the_addresses_nodeport_addresses_selects() {
    let mut env = TestEnv::without_datapath(2);
    env.serve_all(TARGET);
    let dir = Manifests::new();
    dir.write(
        "web.yaml",
        &format!(
            "{}---\n{}",
            service("web", VIP, 80).replace(
                "    targetPort: http\n",
                "    targetPort: http\n    nodePort: 30080\n  type: NodePort\n"
            ),
            slice("web-1", "web", TARGET, &[ready(&pod(1))])
        ),
    );
    dir.write(
        "node.yaml",
        "apiVersion: v1\nkind: Node\nmetadata:\n  name: node-a\nstatus:\n  addresses:\n  - {type: InternalIP, address: 192.0.2.1}\n  - {type: ExternalIP, address: 198.51.100.1}\n",
    );
    let internal = SocketAddr::from(([192, 0, 2, 1], 30080));
    let external = SocketAddr::from(([198, 51, 100, 1], 30080));
    let answers = |addr: SocketAddr| {
        let t0 = Instant::now();
        loop {
            let r = env.in_client(|| tcp_ask(addr));
            if r.is_ok() || t0.elapsed() > Duration::from_secs(5) {
                return r;
            }
            std::thread::sleep(Duration::from_millis(50));
        }
    };
    // Without the flag: both addresses.
    let mut agent = AgentProcess::start(&env, &dir.arg());
    agent.wait_healthy(Duration::from_secs(20));
    for a in [internal, external] {
        let (pod, peer) = answers(a).expect("a NodePort on a node address");
        assert_eq!((pod.as_str(), peer), ("pod1", a));
    }
    let _ = agent.stop();

    let [m, d] = dir.arg();
    let mut agent = AgentProcess::start(&env, &[m, d, "--nodeport-addresses", "192.0.2.0/24"]);
    agent.wait_healthy(Duration::from_secs(20));
    let (pod, _) = answers(internal).expect("the selected address");
    assert_eq!(pod, "pod1");
    env.in_client(|| {
        for _ in 0..5 {
            let r = tcp_ask(external);
            assert!(r.is_err(), "198.51.100.1:30080 still served: {r:?}");
        }
    });
    let logs = agent.logs();
    let written = logs
        .lines()
        .rfind(|l| l.contains("node addresses for NodePorts written"))
        .and_then(|l| l.split(" node_addresses=").next())
        .expect("logged");
    assert!(
        written.contains("192.0.2.1") && !written.contains("198.51.100.1"),
        "{written}"
    );
}

/// Waits (10 s at most) for `line` in the agent's log.
fn wait_log(agent: &AgentProcess, line: &str) {
    let t0 = Instant::now();
    while !agent.logs().contains(line) {
        assert!(
            t0.elapsed() < Duration::from_secs(10),
            "not logged: {line}\n{}",
            agent.logs()
        );
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// Issue 24, item 6: a new manifest whose Service has no creation time and sorts first
/// claims the ClusterIP `web` serves: `web` keeps it, before and after a restart (the
/// pinned reverse-NAT entry names the Service holding it), without a failed connection.
#[test]
fn a_new_manifest_does_not_take_a_live_cluster_ip_before_or_after_a_restart() {
    let mut env = TestEnv::without_datapath(2);
    env.serve_all(TARGET);
    let dir = Manifests::new();
    dir.write("web.yaml", &web_on_pod1());
    let mut agent = AgentProcess::start(&env, &dir.arg());
    agent.wait_healthy(Duration::from_secs(20));
    env.in_client(|| until(Instant::now(), 10, |r| answer_is(r, &["pod1"])));

    let conflict =
        "Service default/aaa-copy: frontend 10.96.0.10:80/tcp belongs to Service default/web";
    let all_pod1 = |answers: &[Result<String, String>], when: &str| {
        assert!(answers.len() > 20, "{when}: {}", answers.len());
        let other: Vec<_> = answers
            .iter()
            .filter(|a| a.as_deref() != Ok("pod1"))
            .take(5)
            .collect();
        assert!(
            other.is_empty(),
            "{when}: web keeps its ClusterIP: {other:?}"
        );
    };
    let hammer = Hammer::start(&env);
    std::thread::sleep(Duration::from_millis(200));
    // Same second or later, no timestamps, and "aaa-copy" < "web": without the holder's
    // rule it would take the ClusterIP.
    dir.write(
        "aaa-copy.yaml",
        &format!(
            "{}---\n{}",
            service("aaa-copy", VIP, 80),
            slice("aaa-copy-1", "aaa-copy", TARGET, &[ready(&pod(2))])
        ),
    );
    wait_log(&agent, conflict);
    std::thread::sleep(Duration::from_millis(300));
    all_pod1(&hammer.stop(), "after the new file");

    // A restart reads both files at once (the same first-read time for both): the pins
    // say web holds it.
    let _ = agent.stop();
    let hammer = Hammer::start(&env);
    let mut agent = AgentProcess::start(&env, &dir.arg());
    agent.wait_healthy(Duration::from_secs(20));
    wait_log(&agent, conflict);
    std::thread::sleep(Duration::from_millis(500));
    all_pod1(&hammer.stop(), "across the restart");
    let metrics = agent.metrics();
    assert!(
        metrics.contains(
            "ebpf_proxy_objects_skipped_total{kind=\"Service\",reason=\"frontend_conflict\"} 1"
        ),
        "{metrics}"
    );

    // web goes: aaa-copy takes the ClusterIP over.
    dir.remove("web.yaml");
    env.in_client(|| until(Instant::now(), 10, |r| answer_is(r, &["pod2"])));
}

#[test]
fn frontend_conflicts_have_one_owner_settled_at_once_and_across_restarts() {
    let mut env = TestEnv::without_datapath(2);
    env.serve_all(TARGET);
    let dir = Manifests::new();
    // "old" was created first; "new" sorts before it by name (arrival or name order
    // would give the frontend to "new").
    let old = service_created("old", VIP, "2026-01-01T00:00:00Z");
    let new = service_created("new", VIP, "2026-06-01T00:00:00Z");
    dir.write("old.yaml", &old);
    dir.write(
        "slices.yaml",
        &format!(
            "{}---\n{}",
            slice("old-1", "old", TARGET, &[ready(&pod(1))]),
            slice("new-1", "new", TARGET, &[ready(&pod(2))])
        ),
    );
    let mut agent = AgentProcess::start(&env, &dir.arg());
    agent.wait_healthy(Duration::from_secs(20));
    env.in_client(|| until(Instant::now(), 10, |r| answer_is(r, &["pod1"])));
    dir.write("new.yaml", &new);
    std::thread::sleep(Duration::from_millis(300));
    env.in_client(|| until(Instant::now(), 20, |r| answer_is(r, &["pod1"])));

    // 3. A restart: the same owner (the older one), not the first by name.
    let _ = agent.stop();
    let mut agent = AgentProcess::start(&env, &dir.arg());
    agent.wait_healthy(Duration::from_secs(20));
    let hammer = Hammer::start(&env);
    std::thread::sleep(Duration::from_millis(500));
    let answers = hammer.stop();
    assert!(
        answers.iter().all(|a| a.as_deref() == Ok("pod1")),
        "after a restart the older Service still owns the frontend: {:?}",
        &answers[..answers.len().min(20)]
    );
    assert!(agent.logs().contains(
        "Service default/new: frontend 10.96.0.10:80/tcp belongs to Service default/old"
    ));

    // 1. The owner is deleted: the other claimant takes over at once, without a gap.
    let hammer = Hammer::start(&env);
    std::thread::sleep(Duration::from_millis(200));
    let t0 = Instant::now();
    dir.remove("old.yaml");
    let took = env.in_client(|| until(t0, 10, |r| answer_is(r, &["pod2"])));
    std::thread::sleep(Duration::from_millis(200));
    let answers = hammer.stop();
    // "At once" is what the hammer checks: no connection failed meanwhile.
    eprintln!("owner deleted -> survivor serves after {took:?}");
    assert!(
        errors(&answers).is_empty(),
        "no connection may fail while a claimant exists: {:?}",
        errors(&answers)
    );

    // The older one comes back: "new" holds the frontend now and keeps it (issue 24,
    // item 6: a claimant never takes a live frontend away).
    dir.write("old.yaml", &old);
    wait_log(
        &agent,
        "Service default/old: frontend 10.96.0.10:80/tcp belongs to Service default/new",
    );
    env.in_client(|| until(Instant::now(), 20, |r| answer_is(r, &["pod2"])));

    // 2. The loser is deleted: the owner's frontend stays, not a failed connection.
    let hammer = Hammer::start(&env);
    std::thread::sleep(Duration::from_millis(200));
    dir.remove("old.yaml");
    std::thread::sleep(Duration::from_millis(1000));
    let answers = hammer.stop();
    assert!(answers.len() > 20, "{}", answers.len());
    assert!(
        answers.iter().all(|a| a.as_deref() == Ok("pod2")),
        "the owner keeps its frontend when the loser goes: {:?}",
        answers
            .iter()
            .filter(|a| a.as_deref() != Ok("pod2"))
            .take(5)
            .collect::<Vec<_>>()
    );
    let metrics = agent.metrics();
    assert!(
        metrics.contains("ebpf_proxy_programmed_frontends 1"),
        "{metrics}"
    );
}

#[test]
fn after_a_restart_an_invalid_slice_keeps_the_last_good_backends() {
    let mut env = TestEnv::without_datapath(2);
    env.serve_all(TARGET);
    let dir = Manifests::new();
    dir.write("web.yaml", &service("web", VIP, 80));
    dir.write(
        "web-slice.yaml",
        &slice("web-1", "web", TARGET, &[ready(&pod(1))]),
    );
    let mut agent = AgentProcess::start(&env, &dir.arg());
    agent.wait_healthy(Duration::from_secs(20));
    env.in_client(|| until(Instant::now(), 10, |r| answer_is(r, &["pod1"])));
    let _ = agent.stop();
    // While no agent runs, the slice turns invalid.
    dir.write(
        "web-slice.yaml",
        &slice("web-1", "web", TARGET, &[ready("not-an-ip")]),
    );
    let mut agent = AgentProcess::start(&env, &dir.arg());
    agent.wait_healthy(Duration::from_secs(20));
    std::thread::sleep(Duration::from_millis(300));
    env.in_client(|| {
        for _ in 0..20 {
            let r = tcp_ask(vip());
            assert!(
                answer_is(&r, &["pod1"]),
                "the last good backend must keep serving: {r:?}"
            );
        }
    });
    let metrics = agent.metrics();
    assert!(
        metrics.contains("kind=\"EndpointSlice\",reason=\"bad_endpoint_address\"} 1"),
        "{metrics}"
    );
    assert!(agent
        .logs()
        .contains("Service default/web keeps what the pinned maps hold for it"));
    // A valid version arrives: it is followed.
    dir.write(
        "web-slice.yaml",
        &slice("web-1", "web", TARGET, &[ready(&pod(2))]),
    );
    env.in_client(|| until(Instant::now(), 20, |r| answer_is(r, &["pod2"])));
}

/// `GET /healthz` with a deadline: (status, time taken).
/// The DaemonSet's probes' `timeoutSeconds` (deploy/base/daemonset.yaml): a `/healthz`
/// slower than this fails the kubelet's probe. The bound for the health tests below, the
/// contract rather than a measured figure.
const PROBE_TIMEOUT: Duration = Duration::from_secs(5);

fn probe(port: u16) -> io::Result<(u16, Duration)> {
    use std::io::{Read as _, Write as _};
    let t0 = Instant::now();
    let mut s = std::net::TcpStream::connect_timeout(
        &SocketAddr::from(([127, 0, 0, 1], port)),
        PROBE_TIMEOUT,
    )?;
    s.set_read_timeout(Some(PROBE_TIMEOUT))?;
    s.write_all(b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n")?;
    let mut out = String::new();
    s.read_to_string(&mut out)?;
    let code = out
        .split_whitespace()
        .nth(1)
        .and_then(|c| c.parse().ok())
        .unwrap_or(0);
    Ok((code, t0.elapsed()))
}

#[test]
fn health_answers_while_pathological_manifests_are_read() {
    let mut env = TestEnv::without_datapath(1);
    env.serve_all(TARGET);
    let dir = Manifests::new();
    dir.write("web.yaml", &service("web", VIP, 80));
    dir.write(
        "web-slice.yaml",
        &slice("web-1", "web", TARGET, &[ready(&pod(1))]),
    );
    let mut agent = AgentProcess::start(&env, &dir.arg());
    agent.wait_healthy(Duration::from_secs(20));
    // 196 KiB nested 100,000 levels (refused before parsing), and a large valid file
    // that takes the parser a while: probes keep being answered meanwhile.
    let deep = format!(
        "apiVersion: v1\nkind: Service\nmetadata: {{name: deep}}\nspec: {}{}\n",
        "[".repeat(100_000),
        "]".repeat(100_000)
    );
    dir.write("deep.yaml", &deep);
    big_manifest(&dir.0.join(".big.tmp"), 3000, 10);
    fs::rename(dir.0.join(".big.tmp"), dir.0.join("big.yaml")).expect("rename");
    let t0 = Instant::now();
    let mut worst = Duration::ZERO;
    let mut probes = 0;
    while !agent
        .metrics()
        .contains("ebpf_proxy_programmed_frontends 3001")
    {
        assert!(
            t0.elapsed() < Duration::from_secs(60),
            "big.yaml not programmed:\n{}",
            agent.metrics()
        );
        let (code, took) = probe(agent.healthz_port).expect("/healthz answers");
        assert_eq!(code, 200);
        worst = worst.max(took);
        probes += 1;
        std::thread::sleep(Duration::from_millis(20));
    }
    eprintln!(
        "{probes} probes while 3,000 Services were read and programmed in {:?}: slowest {worst:?}",
        t0.elapsed()
    );
    assert!(probes >= 3, "{probes}");
    assert!(worst < PROBE_TIMEOUT, "{worst:?}");
    let metrics = agent.metrics();
    assert!(
        metrics.contains("kind=\"file\",reason=\"too_deep\"} 1"),
        "{metrics}"
    );
    assert!(agent.logs().contains(
        "deep.yaml skipped, keeping its previous objects: collections nested more than 64 deep"
    ));
    env.in_client(|| until(Instant::now(), 5, |r| answer_is(r, &["pod1"])));
}

#[test]
fn bad_files_are_reported_once_per_change() {
    let mut env = TestEnv::without_datapath(1);
    env.serve_all(TARGET);
    let dir = Manifests::new();
    dir.write("good.yaml", &web_on_pod1());
    fs::write(
        dir.0.join("latin1-a.yaml"),
        b"kind: Service\nmetadata: {name: caf\xe9}\n",
    )
    .expect("write");
    fs::write(
        dir.0.join("latin1-b.yaml"),
        b"kind: Service\nmetadata: {name: \xff}\n",
    )
    .expect("write");
    std::os::unix::fs::symlink(dir.0.join("nowhere.yaml"), dir.0.join("dangling.yaml"))
        .expect("symlink");
    std::os::unix::fs::symlink(dir.0.join("loop-b.yaml"), dir.0.join("loop-a.yaml"))
        .expect("symlink");
    std::os::unix::fs::symlink(dir.0.join("loop-a.yaml"), dir.0.join("loop-b.yaml"))
        .expect("symlink");
    let mut agent = AgentProcess::start(&env, &dir.arg());
    agent.wait_healthy(Duration::from_secs(20));
    // 5 s at a 20 ms poll: 250 scans.
    std::thread::sleep(Duration::from_secs(5));
    let metrics = agent.metrics();
    for want in [
        "kind=\"file\",reason=\"read_error\"} 2",
        "kind=\"file\",reason=\"broken_link\"} 3",
    ] {
        assert!(metrics.contains(want), "{want} missing:\n{metrics}");
    }
    let logs = agent.logs();
    for file in [
        "latin1-a.yaml",
        "latin1-b.yaml",
        "dangling.yaml",
        "loop-a.yaml",
        "loop-b.yaml",
    ] {
        let n = logs
            .lines()
            .filter(|l| l.contains(&format!("{file} skipped")))
            .count();
        assert_eq!(n, 1, "{file} reported {n} times:\n{logs}");
    }
    assert!(logs.contains("not UTF-8"), "{logs}");
    env.in_client(|| until(Instant::now(), 5, |r| answer_is(r, &["pod1"])));
}

/// Sets this process's soft `RLIMIT_NOFILE` (children inherit it).
fn set_soft_nofile(soft: u64) -> u64 {
    let mut lim = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: getrlimit/setrlimit with a valid struct.
    unsafe {
        assert_eq!(libc::getrlimit(libc::RLIMIT_NOFILE, &mut lim), 0);
        let old = lim.rlim_cur;
        lim.rlim_cur = soft.min(lim.rlim_max);
        assert_eq!(libc::setrlimit(libc::RLIMIT_NOFILE, &lim), 0);
        old
    }
}

#[test]
fn a_flood_of_idle_health_connections_stops_neither_probes_nor_syncs() {
    let mut env = TestEnv::without_datapath(2);
    env.serve_all(TARGET);
    let dir = Manifests::new();
    dir.write("web.yaml", &service("web", VIP, 80));
    dir.write(
        "web-slice.yaml",
        &slice("web-1", "web", TARGET, &[ready(&pod(1))]),
    );
    // The agent starts as a container runtime starts it: soft limit 1024.
    let before = set_soft_nofile(1024);
    let mut agent = AgentProcess::start(&env, &dir.arg());
    set_soft_nofile(u64::MAX);
    agent.wait_healthy(Duration::from_secs(20));
    env.in_client(|| until(Instant::now(), 5, |r| answer_is(r, &["pod1"])));

    // 1,500 connections that never send their request, kept up for the whole test: a
    // connection the agent closes is replaced by a new one (at most ~1,000 a second).
    let addr = SocketAddr::from(([127, 0, 0, 1], agent.healthz_port));
    let stop = Arc::new(AtomicBool::new(false));
    let opened = Arc::new(AtomicUsize::new(0));
    let flood = {
        let (stop, opened) = (stop.clone(), opened.clone());
        std::thread::spawn(move || {
            let mut open = std::collections::VecDeque::new();
            while !stop.load(Ordering::Relaxed) {
                if let Ok(s) = std::net::TcpStream::connect_timeout(&addr, Duration::from_secs(1)) {
                    open.push_back(s);
                    opened.fetch_add(1, Ordering::Relaxed);
                }
                if open.len() > 1500 {
                    open.pop_front();
                }
                std::thread::sleep(Duration::from_millis(1));
            }
        })
    };
    while opened.load(Ordering::Relaxed) < 1500 {
        std::thread::sleep(Duration::from_millis(50));
    }
    eprintln!("1,500 idle connections opened");
    let mut worst = Duration::ZERO;
    for _ in 0..20 {
        let (code, took) = probe(agent.healthz_port).expect("/healthz answers during the flood");
        assert_eq!(code, 200);
        worst = worst.max(took);
        std::thread::sleep(Duration::from_millis(100));
    }
    // A change is applied in its usual time.
    let t0 = Instant::now();
    dir.write(
        "web-slice.yaml",
        &slice("web-1", "web", TARGET, &[ready(&pod(2))]),
    );
    let took = env.in_client(|| until(t0, 5, |r| answer_is(r, &["pod2"])));
    eprintln!("during the flood: slowest of 20 probes {worst:?}, change applied in {took:?}");
    // Every probe answered 200 within the kubelet's timeout, and the change was applied
    // (`until`); without the cap and the raised limit the agent ran out of descriptors
    // ("Too many open files", checked below). The times are logged, not asserted.
    assert!(worst < PROBE_TIMEOUT, "{worst:?}");
    assert!(agent
        .metrics()
        .contains("ebpf_proxy_programmed_frontends 1"));
    drop(flood);
    set_soft_nofile(before);
    let logs = agent.stop();
    assert!(!logs.contains("Too many open files"), "{logs}");
    assert!(logs.contains("open file limit"), "{logs}");
}

#[test]
fn a_service_over_the_backend_limit_is_skipped_and_the_node_stays_healthy() {
    let mut env = TestEnv::without_datapath(1);
    env.serve_all(TARGET);
    let dir = Manifests::new();
    dir.write("web.yaml", &web_on_pod1());
    // One Service with 70,000 endpoints (the limit is 65,535 per frontend).
    let mut y = service("huge", "10.96.0.70", 80);
    y += "---\n";
    let addrs: Vec<String> = (0..70_000u32)
        .map(|i| format!("10.{}.{}.{}", 100 + i / 65536, (i / 256) % 256, i % 256))
        .collect();
    let eps: Vec<_> = addrs.iter().map(|a| ready(a)).collect();
    y += &slice("huge-1", "huge", TARGET, &eps);
    fs::write(dir.0.join("huge.yaml"), y).expect("write");
    let [m, d] = dir.arg();
    // Before, the first sync never completed (retried with backoff forever), so the node
    // never turned healthy. Computing this Service's entries takes `cluster::index`
    // about 150 s in a debug build (its endpoint de-duplication is quadratic: 70,000
    // endpoints are 2.5e9 comparisons); one sync only, then: no periodic re-diff.
    let mut agent = AgentProcess::start(&env, &[m, d, "--sync-interval", "30m"]);
    agent.wait_healthy(Duration::from_secs(600));
    env.in_client(|| until(Instant::now(), 5, |r| answer_is(r, &["pod1"])));
    std::thread::sleep(Duration::from_secs(3));
    assert_eq!(agent.healthz().0, 200, "{}", agent.healthz().1);
    let metrics = agent.metrics();
    for want in [
        "kind=\"Service\",reason=\"too_many_backends\"} 1",
        "ebpf_proxy_programmed_frontends 1\n",
    ] {
        assert!(metrics.contains(want), "{want} missing:\n{metrics}");
    }
    let logs = agent.stop();
    let n = logs
        .lines()
        .filter(|l| l.contains("skipping Service default/huge"))
        .count();
    assert_eq!(n, 1, "logged once:\n{logs}");
    assert!(!logs.contains("sync incomplete"), "no retry loop:\n{logs}");
}

/// Waits until the metrics contain every one of `want`; returns them.
fn wait_metrics(agent: &AgentProcess, want: &[&str], timeout: Duration) -> String {
    let t = Instant::now();
    loop {
        // Not listening yet while it starts.
        let m = support::http_get(agent.metrics_port, "/metrics")
            .map_or_else(|e| e.to_string(), |r| r.1);
        if want.iter().all(|w| m.contains(w)) {
            return m;
        }
        assert!(t.elapsed() < timeout, "{want:?} not in the metrics:\n{m}");
        std::thread::sleep(Duration::from_millis(100));
    }
}

/// The frontends (slot 0) and slot entries the pinned `SVC4` holds per VIP.
fn svc4_entries(pins: &Path) -> std::collections::BTreeMap<std::net::IpAddr, usize> {
    use proxy_user::MapStore as _;
    let maps = proxy_user::bpf::BpfMaps::open(pins).expect("open the pinned maps");
    let dump = maps.dump().expect("dump");
    let mut per_vip = std::collections::BTreeMap::new();
    for (fe, v) in &dump.frontends {
        // A frontend's entry holds slots 1..=24, each further entry (chunk) 24 more.
        *per_vip.entry(fe.addr).or_insert(0) += 1;
        for slot in 1..=v.count {
            assert!(
                dump.slots.contains_key(&(*fe, slot)),
                "{fe}: slot {slot} of {} missing (half-written)",
                v.count
            );
        }
    }
    let chunks: std::collections::BTreeSet<_> = dump
        .slots
        .keys()
        .map(|(fe, slot)| (*fe, proxy_common::svc_chunk_of(*slot).0))
        .filter(|(_, chunk)| *chunk > 0)
        .collect();
    for (fe, _) in chunks {
        *per_vip.entry(fe.addr).or_insert(0) += 1;
    }
    per_vip
}

#[test]
fn a_full_service_map_refuses_whole_services_and_the_rest_is_served() {
    let mut env = TestEnv::without_datapath(1);
    env.serve_all(TARGET);
    let dir = Manifests::new();
    // `web`: 1 entry (its frontend, holding its one slot). Six Services of 254
    // endpoints: 11 entries each (the frontend's own with slots 1..=24, then ten chunks
    // of 24). A map of 64 entries holds `web` and five of them (56), not a sixth.
    dir.write("web.yaml", &web_on_pod1());
    let big_vip = |k: usize| format!("10.96.1.{k}");
    let big = |k: usize| {
        let addrs: Vec<String> = (1..=254).map(|i| format!("10.200.{k}.{i}")).collect();
        let eps: Vec<_> = addrs.iter().map(|a| ready(a)).collect();
        format!(
            "{}---\n{}",
            service(&format!("big{k}"), &big_vip(k), 80),
            slice(&format!("big{k}-1"), &format!("big{k}"), TARGET, &eps)
        )
    };
    for k in 1..=6 {
        dir.write(&format!("big{k}.yaml"), &big(k));
    }
    let [m, d] = dir.arg();
    // Out of range: refused at start with the flag's range, before anything is made.
    let mut bad = AgentProcess::start(&env, &[m, d, "--service-map-entries", "10"]);
    let status = bad.child.wait().expect("wait");
    assert!(!status.success());
    let logs = bad.logs();
    assert!(
        logs.contains("service map size 10 entries is out of range (64..=16777216"),
        "{logs}"
    );
    assert!(!env.pins.path.join("SVC4").exists(), "nothing was created");
    // The conntrack bounds likewise, each named (the ceiling is checked although the
    // tables start smaller).
    for (flag, value) in [("--conntrack-max", "9000000"), ("--conntrack-start", "10")] {
        let mut bad = AgentProcess::start(&env, &[m, d, flag, value]);
        let status = bad.child.wait().expect("wait");
        assert!(!status.success());
        let logs = bad.logs();
        assert!(
            logs.contains(flag)
                && logs.contains(&format!("conntrack size {value} flows is out of range")),
            "{logs}"
        );
        assert!(!env.pins.path.join("CT4").exists(), "nothing was created");
    }

    let mut agent = AgentProcess::start(&env, &[m, d, "--service-map-entries", "64"]);
    let metrics = wait_metrics(
        &agent,
        &[
            "ebpf_proxy_service_map_entries 64\n",
            "ebpf_proxy_programmed_frontends 6\n",
            "reason=\"map_full\"}",
        ],
        Duration::from_secs(30),
    );
    eprintln!(
        "{}",
        metrics
            .lines()
            .filter(|l| l.contains("map_write_errors"))
            .collect::<Vec<_>>()
            .join("\n")
    );
    let svc4 = aya::maps::MapData::from_pin(env.pins.path.join("SVC4")).expect("SVC4 pin");
    assert_eq!(svc4.info().expect("info").max_entries(), 64);
    drop(svc4);
    // The Service that did not fit: named with the map, and not in the maps at all.
    let logs = agent.logs();
    let failed: Vec<usize> = (1..=6)
        .filter(|k| {
            logs.lines()
                .any(|l| l.contains(&format!("default/big{k}")) && l.contains("SVC4 is full"))
        })
        .collect();
    assert_eq!(failed.len(), 1, "exactly one Service did not fit:\n{logs}");
    let failed = failed[0];
    let entries = svc4_entries(&env.pins.path);
    let vip_of = |k: usize| big_vip(k).parse::<std::net::IpAddr>().expect("ip");
    assert_eq!(
        entries.get(&vip_of(failed)),
        None,
        "no half-written Service"
    );
    for k in (1..=6).filter(|&k| k != failed) {
        assert_eq!(
            entries.get(&vip_of(k)),
            Some(&11),
            "big{k} whole: {entries:?}"
        );
    }
    // The rest is served; health answers, and says why it is not 200.
    env.in_client(|| until(Instant::now(), 5, |r| answer_is(r, &["pod1"])));
    let (code, body) = agent.healthz();
    assert_eq!(code, 503, "{body}");
    assert!(body.contains("could not write 1 frontend(s)"), "{body}");

    // Room made (another Service deleted): the retry writes the one refused; healthy.
    let other = (1..=6).find(|&k| k != failed).expect("another");
    dir.remove(&format!("big{other}.yaml"));
    agent.wait_healthy(Duration::from_secs(30));
    let entries = svc4_entries(&env.pins.path);
    assert_eq!(entries.get(&vip_of(failed)), Some(&11), "{entries:?}");
    assert_eq!(entries.get(&vip_of(other)), None, "{entries:?}");
    agent.stop();

    // A higher ceiling on a restart: the pinned maps keep their size (64) until a sync
    // needs more: with big{other} back, the first sync needs 67 entries (> 3/4 of 64), so
    // the maps are grown online to 128 before it writes (entries copied, programs
    // swapped): no map_full, every frontend whole, in the larger maps.
    dir.write(&format!("big{other}.yaml"), &big(other));
    let mut agent = AgentProcess::start(&env, &[m, d, "--service-map-entries", "4096"]);
    agent.wait_healthy(Duration::from_secs(30));
    let metrics = agent.metrics();
    assert!(
        metrics.contains("ebpf_proxy_service_map_entries 128\n")
            && metrics
                .contains("ebpf_proxy_map_resizes_total{map=\"SVC4\",direction=\"grow\"} 1\n")
            && !metrics.contains("reason=\"map_full\""),
        "{metrics}"
    );
    let svc4 = aya::maps::MapData::from_pin(env.pins.path.join("SVC4")).expect("SVC4 pin");
    assert_eq!(svc4.info().expect("info").max_entries(), 128);
    drop(svc4);
    let grown = svc4_entries(&env.pins.path);
    let mut want = entries.clone();
    want.insert(vip_of(other), 11);
    assert_eq!(grown, want, "the frontends survive the growth whole");
    env.in_client(|| until(Instant::now(), 5, |r| answer_is(r, &["pod1"])));
    // big{other} gone again before the stop (56 entries in use).
    dir.remove(&format!("big{other}.yaml"));
    let t = Instant::now();
    while svc4_entries(&env.pins.path) != entries {
        assert!(
            t.elapsed() < Duration::from_secs(30),
            "big{other} not removed"
        );
        std::thread::sleep(Duration::from_millis(100));
    }
    let logs = agent.stop();
    assert!(
        logs.contains("resizing the pinned map online while serving")
            && logs.contains("service-side maps grown online")
            && logs.contains("layout migration done"),
        "{logs}"
    );
    // Back down to 64 (the 56 entries in use fit): shrunk online at the start, every
    // frontend whole.
    let mut agent = AgentProcess::start(&env, &[m, d, "--service-map-entries", "64"]);
    agent.wait_healthy(Duration::from_secs(30));
    let metrics = agent.metrics();
    assert!(
        metrics.contains("ebpf_proxy_service_map_entries 64\n")
            && metrics
                .contains("ebpf_proxy_map_resizes_total{map=\"SVC6\",direction=\"shrink\"} 1\n"),
        "{metrics}"
    );
    assert_eq!(
        svc4_entries(&env.pins.path),
        entries,
        "whole after the shrink"
    );
    let logs = agent.stop();
    assert!(logs.contains("resizing the pinned map online"), "{logs}");
}

/// Issue 27, item 2: the service-side maps start small (`SVC4/6` and `BACKEND4/6`,
/// `BACKEND_CONNS` at 16,384, `REVNAT4/6` at 4,096) and grow online, all in one resize
/// before the writes, when a sync of 20,000 new Services with an endpoint each (20,000
/// service entries, backends and frontends) would not fit: no `map_full`, no
/// frontend failed or half-written, every backend and reverse-NAT entry written, and a
/// client connecting to an existing Service the whole time is never refused or
/// misrouted.
#[test]
fn service_maps_grow_online_during_a_sync_of_20000_new_services() {
    let mut env = TestEnv::without_datapath(1);
    env.serve_all(TARGET);
    let dir = Manifests::new();
    dir.write("web.yaml", &web_on_pod1());
    let mut agent = AgentProcess::start(&env, &dir.arg());
    agent.wait_healthy(Duration::from_secs(20));
    env.in_client(|| until(Instant::now(), 5, |r| answer_is(r, &["pod1"])));
    let max_entries = |name: &str| {
        aya::maps::MapData::from_pin(env.pins.path.join(name))
            .expect("pin")
            .info()
            .expect("info")
            .max_entries()
    };
    let start = proxy_user::loader::SERVICE_START_ENTRIES;
    assert_eq!(max_entries("SVC4"), start, "made small");
    assert_eq!(max_entries("SVC6"), start, "made small");
    for (map, floor) in [
        ("BACKEND4", 16_384),
        ("BACKEND6", 16_384),
        ("BACKEND_CONNS", 16_384),
        ("REVNAT4", 4_096),
        ("REVNAT6", 4_096),
    ] {
        assert_eq!(max_entries(map), floor, "{map} made small");
    }
    assert!(
        agent
            .metrics()
            .contains(&format!("ebpf_proxy_service_map_entries {start}\n")),
        "{}",
        agent.metrics()
    );

    let hammer = Hammer::start(&env);
    std::thread::sleep(Duration::from_millis(200));
    let t = Instant::now();
    dir.write("many.yaml", &manifests::many_services(20_000, 1, TARGET));
    let metrics = wait_metrics(
        &agent,
        &[
            "ebpf_proxy_programmed_frontends 20001\n",
            "ebpf_proxy_map_resizes_total{map=\"SVC4\",direction=\"grow\"}",
            "ebpf_proxy_map_resizes_total{map=\"BACKEND4\",direction=\"grow\"}",
            "ebpf_proxy_map_resizes_total{map=\"REVNAT4\",direction=\"grow\"}",
        ],
        Duration::from_secs(180),
    );
    agent.wait_healthy(Duration::from_secs(60));
    eprintln!("20,000 Services programmed in {:?}", t.elapsed());
    std::thread::sleep(Duration::from_millis(300));
    let answers = hammer.stop();
    eprintln!("{} connections to web across the growth", answers.len());

    // The existing Service answered from pod1 throughout, never refused.
    assert!(answers.len() > 10, "{} answers", answers.len());
    let bad: Vec<_> = answers
        .iter()
        .filter(|a| a.as_deref() != Ok("pod1"))
        .take(5)
        .collect();
    assert!(
        bad.is_empty(),
        "{} of {} answers not pod1 across the growth: {bad:?}",
        answers
            .iter()
            .filter(|a| a.as_deref() != Ok("pod1"))
            .count(),
        answers.len()
    );
    // No write failed; the maps grew to the first size 20,001 entries (one per frontend,
    // its slot in it) fit in within 3/4: 32,768.
    let metrics = agent.metrics() + &metrics;
    assert!(!metrics.contains("map_write_errors_total{"), "{metrics}");
    assert!(!metrics.contains("reason=\"map_full\""), "{metrics}");
    assert_eq!(max_entries("SVC4"), 32_768);
    assert_eq!(max_entries("SVC6"), 32_768);
    assert!(
        agent
            .metrics()
            .contains("ebpf_proxy_service_map_entries 32768\n"),
        "{}",
        agent.metrics()
    );
    // Backends and reverse NAT grown with them, in the same resize (x2 steps to the first
    // size 20,001 fits in within 3/4: 32,768).
    for map in [
        "BACKEND4",
        "BACKEND6",
        "BACKEND_CONNS",
        "REVNAT4",
        "REVNAT6",
    ] {
        assert_eq!(max_entries(map), 32_768, "{map}");
    }
    for map in ["SVC4", "BACKEND4", "BACKEND_CONNS", "REVNAT4", "REVNAT6"] {
        assert!(
            metrics.contains(&format!(
                "ebpf_proxy_map_resizes_total{{map=\"{map}\",direction=\"grow\"}}"
            )),
            "{map}: {metrics}"
        );
    }
    // Every frontend whole: its entry with its one slot (web's too), its backend and its
    // reverse-NAT entry.
    let entries = svc4_entries(&env.pins.path);
    assert_eq!(entries.len(), 20_001);
    assert!(entries.values().all(|&n| n == 1), "a frontend half-written");
    {
        use proxy_user::MapStore as _;
        let dump = proxy_user::bpf::BpfMaps::open(&env.pins.path)
            .expect("open")
            .dump()
            .expect("dump");
        assert_eq!(dump.backends.len(), 20_001, "every backend written");
        assert_eq!(dump.revnat.len(), 20_001, "every reverse-NAT entry written");
        assert!(
            dump.slots.values().all(|id| dump.backends.contains_key(id)),
            "a slot names a backend the map lacks"
        );
    }
    let logs = agent.stop();
    assert!(
        logs.contains("service-side maps grown online before the sync's writes"),
        "{logs}"
    );
    // The growth re-makes only the maps it resizes: conntrack and the others are shared
    // before the staged load (no preallocated conntrack table made to be thrown away, no
    // second load of the programs).
    let staged = logs
        .lines()
        .find(|l| l.contains("staged layout loaded"))
        .unwrap_or_else(|| panic!("no staged load in the log: {logs}"));
    assert!(
        staged.contains("shared_after_load=0") && !staged.contains("pre_shared=0"),
        "{staged}"
    );
}

/// Issue 27: on a fresh node (nothing pinned) the agent reads its first lists before it
/// makes the maps, and makes the maps sized to demand at what the first sync needs: 20,000
/// Services x 1 already in the directory at the start are programmed without any growth
/// (no migration, no `ebpf_proxy_map_resizes_total`), the maps made at the sizes the
/// writer would have grown them to (`SVC4/6`, `BACKEND4/6`, `BACKEND_CONNS`, `REVNAT4/6`
/// 32,768 for 20,001 entries, frontends and backends); a restart on those pins keeps them
/// and grows nothing either. The fresh start writes its first sync while the programs
/// load (they attach during the writes): a client connecting to `web` from before the
/// agent starts is, once first answered, never refused or misrouted (no frontend seen
/// half-written), and `/healthz` is 200 only once the hooks are attached.
#[test]
fn a_fresh_node_makes_the_maps_at_the_first_syncs_size_and_grows_none() {
    let mut env = TestEnv::without_datapath(1);
    env.serve_all(TARGET);
    let dir = Manifests::new();
    dir.write("web.yaml", &web_on_pod1());
    // As one JSON `kind: List` (the bench's form, read in place: YAML at 20,000 Services
    // takes longer than the agent waits for its first lists in a debug build).
    let items: Vec<serde_json::Value> = manifests::many_services(20_000, 1, TARGET)
        .split("---\n")
        .filter(|d| !d.trim().is_empty())
        .map(|d| serde_yaml::from_str(d).expect("yaml"))
        .collect();
    let list = serde_json::json!({"apiVersion": "v1", "kind": "List", "items": items});
    dir.write("many.json", &list.to_string());
    let sizes = [
        ("SVC4", 32_768),
        ("SVC6", 32_768),
        ("BACKEND4", 32_768),
        ("BACKEND6", 32_768),
        ("BACKEND_CONNS", 32_768),
        ("REVNAT4", 32_768),
        ("REVNAT6", 32_768),
        ("AFFINITY", 1_024),
        ("MAGLEV", 1_024),
    ];
    for restart in [false, true] {
        let hammer = (!restart).then(|| Hammer::start(&env));
        let mut agent = AgentProcess::start(&env, &dir.arg());
        let metrics = wait_metrics(
            &agent,
            &["ebpf_proxy_programmed_frontends 20001\n"],
            Duration::from_secs(120),
        );
        agent.wait_healthy(Duration::from_secs(60));
        // Healthy: every hook attached, so web answers at once.
        let answered = env.in_client(|| tcp_ask(vip()));
        assert_eq!(
            answered.as_ref().map(|(p, _)| p.as_str()).ok(),
            Some("pod1"),
            "restart {restart}: web did not answer once healthy: {answered:?}"
        );
        if let Some(hammer) = hammer {
            let answers = hammer.stop();
            let served: Vec<_> = answers
                .iter()
                .skip_while(|a| a.as_deref() != Ok("pod1"))
                .collect();
            assert!(!served.is_empty(), "web never answered: {answers:?}");
            let bad: Vec<_> = served
                .iter()
                .filter(|a| a.as_deref() != Ok("pod1"))
                .take(5)
                .collect();
            assert!(
                bad.is_empty(),
                "{} answers after web was first served, not all pod1: {bad:?}",
                served.len()
            );
        }
        let metrics = agent.metrics() + &metrics;
        assert!(
            !metrics.contains("ebpf_proxy_map_resizes_total{"),
            "restart {restart}: {metrics}"
        );
        assert!(!metrics.contains("map_write_errors_total{"), "{metrics}");
        assert!(
            metrics.contains("ebpf_proxy_service_map_entries 32768\n"),
            "restart {restart}: {metrics}"
        );
        for (map, want) in sizes {
            assert_eq!(
                pinned_max_entries(&env.pins.path, map),
                want,
                "{map}, restart {restart}"
            );
        }
        let entries = svc4_entries(&env.pins.path);
        assert_eq!(entries.len(), 20_001);
        assert!(entries.values().all(|&n| n == 1), "a frontend half-written");
        let logs = agent.stop();
        assert!(!logs.contains("grown online"), "restart {restart}: {logs}");
        assert!(
            !logs.contains("layout migration"),
            "restart {restart}: {logs}"
        );
        assert_eq!(
            logs.contains("fresh node: the maps are made at the first sync's sizes"),
            !restart,
            "{logs}"
        );
        // The fresh start wrote the maps before it waited for the programs.
        assert_eq!(
            logs.contains("first sync written while the programs loaded"),
            !restart,
            "{logs}"
        );
    }
}

/// The pinned map `name`'s `max_entries`.
fn pinned_max_entries(pins: &Path, name: &str) -> u32 {
    aya::maps::MapData::from_pin(pins.join(name))
        .expect("pin")
        .info()
        .expect("info")
        .max_entries()
}

/// Issue 27 (maps sized to demand): `AFFINITY` (an LRU, preallocated: 104 B per entry) is
/// made at 1,024 entries while no Service has `sessionAffinity: ClientIP`, `MAGLEV` small
/// while no Maglev frontend, the per-Service counters at 1 entry without
/// `--metrics-per-service`; the first ClientIP Service grows `AFFINITY` online to its
/// ceiling before its frontend is written, and its affinity works: every connection of
/// the client reaches the one pod of three it was first balanced to, `web` unbroken. The
/// Service gone, `AFFINITY` shrinks back to 1,024 once the hold (shortened to 3 s) has
/// passed, and its memory returns to within 8 KiB of its figure before the growth.
#[test]
fn the_first_client_ip_service_grows_affinity_online_and_its_affinity_works() {
    let mut env = TestEnv::without_datapath(3);
    env.serve_all(TARGET);
    let dir = Manifests::new();
    dir.write("web.yaml", &web_on_pod1());
    let hook = [(proxy_user::agent::shrink::SHRINK_AFTER_ENV, "3000")];
    let mut agent = AgentProcess::start_wrapped(&env, &[], &hook, &dir.arg());
    agent.wait_healthy(Duration::from_secs(20));
    env.in_client(|| until(Instant::now(), 5, |r| answer_is(r, &["pod1"])));
    let before = map_memory(
        &wait_metrics(
            &agent,
            &["ebpf_proxy_map_memory_bytes{map=\"AFFINITY\"}"],
            Duration::from_secs(30),
        ),
        "AFFINITY",
    );
    let max_entries = |name: &str| pinned_max_entries(&env.pins.path, name);
    for (map, small) in [
        ("AFFINITY", 1_024),
        ("MAGLEV", 1_024),
        ("SVC_COUNTERS", 1),
        ("BACKEND_COUNTERS", 1),
    ] {
        assert_eq!(max_entries(map), small, "{map} made small");
    }

    let sticky = "10.96.0.20";
    let eps: Vec<String> = (1..=3).map(pod).collect();
    let eps: Vec<_> = eps.iter().map(|a| ready(a)).collect();
    dir.write(
        "sticky.yaml",
        &format!(
            "{}---\n{}",
            service("sticky", sticky, 80)
                .replace("  ports:\n", "  sessionAffinity: ClientIP\n  ports:\n"),
            slice("sticky-1", "sticky", TARGET, &eps)
        ),
    );
    let metrics = wait_metrics(
        &agent,
        &[
            "ebpf_proxy_programmed_frontends 2\n",
            "ebpf_proxy_map_resizes_total{map=\"AFFINITY\",direction=\"grow\"} 1\n",
        ],
        Duration::from_secs(60),
    );
    assert!(!metrics.contains("map_write_errors_total{"), "{metrics}");
    assert_eq!(
        max_entries("AFFINITY"),
        proxy_common::limits::MAX_AFFINITY,
        "grown to its ceiling"
    );
    // Only what the sync needed grew.
    assert_eq!(
        max_entries("SVC4"),
        proxy_user::loader::SERVICE_START_ENTRIES
    );
    assert_eq!(max_entries("REVNAT4"), 4_096);
    let dest = SocketAddr::new(sticky.parse().expect("ip"), 80);
    env.in_client(|| {
        until_at(dest, 1, |r| r.is_ok());
        let first = tcp_ask(dest).expect("sticky answers").0;
        for i in 0..30 {
            let (pod, _) = tcp_ask(dest).expect("sticky answers");
            assert_eq!(pod, first, "connection {i}: affinity to {first} not kept");
        }
        until(Instant::now(), 5, |r| answer_is(r, &["pod1"]));
    });
    // Grown: 104 B per entry of 65,536 (6.5 MiB), once the gauge is read again.
    let t = Instant::now();
    let grown = loop {
        let grown = map_memory(&agent.metrics(), "AFFINITY");
        if grown > 6 << 20 {
            break grown;
        }
        assert!(
            t.elapsed() < Duration::from_secs(30),
            "AFFINITY {grown} bytes grown"
        );
        std::thread::sleep(Duration::from_millis(200));
    };
    // The ClientIP Service gone: shrunk back after the hold, its memory returned.
    dir.remove("sticky.yaml");
    let metrics = wait_metrics(
        &agent,
        &[
            "ebpf_proxy_programmed_frontends 1\n",
            "ebpf_proxy_map_resizes_total{map=\"AFFINITY\",direction=\"shrink\"} 1\n",
        ],
        Duration::from_secs(60),
    );
    assert!(!metrics.contains("map_write_errors_total{"), "{metrics}");
    assert_eq!(max_entries("AFFINITY"), 1_024);
    let t = Instant::now();
    let after = loop {
        let after = map_memory(&agent.metrics(), "AFFINITY");
        if after <= before + 8192 {
            break after;
        }
        assert!(
            t.elapsed() < Duration::from_secs(30),
            "AFFINITY {after} bytes after the shrink, {before} before the growth, {grown} grown"
        );
        std::thread::sleep(Duration::from_millis(200));
    };
    eprintln!("AFFINITY {before} bytes before the growth, {grown} grown, {after} after the shrink");
    env.in_client(|| until(Instant::now(), 5, |r| answer_is(r, &["pod1"])));
    let logs = agent.stop();
    assert!(
        logs.contains("service-side maps grown online before the sync's writes")
            && logs.contains("service-side maps shrunk online"),
        "{logs}"
    );
}

/// An agent started with the migration test hook `hook=step` on a fresh node serving
/// `web`, then 13,000 new Services written (13,001 entries, each frontend's own holding
/// its one slot: past 3/4 of the 16,384-entry start, so the first sync grows the service
/// maps, and with them `REVNAT4/6` and the backend arrays).
fn growth_with_hook(hook: &str, step: &str) -> (TestEnv, Manifests, AgentProcess) {
    let mut env = TestEnv::without_datapath(1);
    env.serve_all(TARGET);
    let dir = Manifests::new();
    dir.write("web.yaml", &web_on_pod1());
    let mut agent = AgentProcess::start_wrapped(&env, &[], &[(hook, step)], &dir.arg());
    agent.wait_healthy(Duration::from_secs(20));
    dir.write("many.yaml", &manifests::many_services(GROWN, 1, TARGET));
    (env, dir, agent)
}

/// A service-map growth that fails with an error after each step
/// (`EBPF_PROXY_MIGRATE_FAIL_AT`: as a refused map allocation or program load would) is
/// rolled back, or finished when a hook was already swapped, at once by the running
/// agent: no staging directory is left to refuse the next growth, the writer's handles
/// follow the maps in use, and every frontend is written whole, `web` answering
/// throughout; the agent never restarts. The outcome is counted as what it is: rolled
/// back (`staged`, `filled`), a failure (`map_write_errors_total{reason=
/// "service_map_resize"} 1`) and the retry's growth (`map_resizes_total{direction=
/// "grow"} 1` per map); finished (every later step), the growth done: counted once as a
/// resize of each map, no write error.
#[test]
fn a_failed_service_map_growth_is_settled_at_once_and_retried() {
    for step in proxy_user::migrate::STEPS {
        let (env, _dir, mut agent) = growth_with_hook(proxy_user::migrate::FAIL_ENV, step);
        let rolled_back = matches!(step, "staged" | "filled");
        let mut want = vec![
            "ebpf_proxy_programmed_frontends 13001\n",
            "ebpf_proxy_map_resizes_total{map=\"SVC4\",direction=\"grow\"} 1\n",
            "ebpf_proxy_map_resizes_total{map=\"SVC6\",direction=\"grow\"} 1\n",
            "ebpf_proxy_map_resizes_total{map=\"REVNAT4\",direction=\"grow\"} 1\n",
        ];
        if rolled_back {
            want.push("ebpf_proxy_map_write_errors_total{reason=\"service_map_resize\"} 1\n");
        }
        wait_metrics(&agent, &want, Duration::from_secs(180));
        agent.wait_healthy(Duration::from_secs(60));
        let metrics = agent.metrics();
        for w in &want {
            assert!(metrics.contains(w), "{step}: {w}\n{metrics}");
        }
        if !rolled_back {
            assert!(
                !metrics.contains("map_write_errors_total{"),
                "{step}: a growth finished by the settling counted as a failure:\n{metrics}"
            );
        }
        assert!(
            agent.child.try_wait().expect("wait").is_none(),
            "{step}: the agent exited:\n{}",
            agent.logs()
        );
        let staging = env.pins.path.join(proxy_user::migrate::STAGING_DIR);
        assert!(
            !staging.exists(),
            "{step}: the failed growth left {} behind",
            staging.display()
        );
        assert_eq!(pinned_max_entries(&env.pins.path, "SVC4"), 32_768, "{step}");
        let entries = svc4_entries(&env.pins.path);
        assert_eq!(entries.len(), GROWN + 1, "{step}");
        assert!(entries.values().all(|&n| n == 1), "{step}: half-written");
        env.in_client(|| until(Instant::now(), 5, |r| answer_is(r, &["pod1"])));
        let logs = agent.logs();
        assert!(
            logs.contains("rolling the resize back (or finishing it) now"),
            "{step}: {logs}"
        );
        assert_eq!(
            logs.contains("was finished: the maps are resized"),
            !rolled_back,
            "{step}: {logs}"
        );
        eprintln!("{step}: settled at once (rolled back: {rolled_back}), 8,001 frontends whole");
    }
}

/// A crash after each step of a service-map growth (`EBPF_PROXY_MIGRATE_CRASH_AT`): the
/// agent aborts in the middle of its first sync of 8,000 new Services; the next start
/// finishes or rolls back the growth, and its first sync writes every frontend whole
/// (growing the maps again after a roll-back), `web` answering. The growth resizes the
/// service maps and reverse NAT in one migration.
#[test]
fn a_crash_at_each_step_of_a_service_map_growth_then_restart() {
    for step in proxy_user::migrate::STEPS {
        let (env, dir, mut agent) = growth_with_hook(proxy_user::migrate::CRASH_ENV, step);
        wait_crash(&mut agent, step);
        drop(agent);
        let mut agent = AgentProcess::start(&env, &dir.arg());
        agent.wait_healthy(Duration::from_secs(120));
        // The service maps and, in the same growth, reverse NAT (13,001 frontends past
        // 3/4 of its 4,096-entry start) and the backend arrays (13,001 ids).
        for map in ["SVC4", "REVNAT4", "REVNAT6", "BACKEND4", "BACKEND6"] {
            assert_eq!(
                pinned_max_entries(&env.pins.path, map),
                32_768,
                "{step}: {map}"
            );
        }
        assert_crash_settled(&env, agent, step, GROWN + 1);
    }
}

/// Waits (up to 120 s) for the agent to die of the crash hook at `step`.
fn wait_crash(agent: &mut AgentProcess, step: &str) {
    let t = Instant::now();
    let status = loop {
        if let Some(s) = agent.child.try_wait().expect("wait") {
            break s;
        }
        assert!(
            t.elapsed() < Duration::from_secs(120),
            "{step}: no crash:\n{}",
            agent.logs()
        );
        std::thread::sleep(Duration::from_millis(50));
    };
    assert!(!status.success(), "{step}: {status}");
}

/// After a start that followed a crash at `step` of a resize: `frontends` frontends (one
/// backend each) written whole, no write error, every slot naming a backend the map has,
/// no staging directory left, `web` answering; the interrupted resize found in the log as
/// rolled back (before any hook swapped: `staged`, `filled`) or resumed (from the swap
/// on). Stops the agent; returns its log and whether the resize was rolled back.
fn assert_crash_settled(
    env: &TestEnv,
    agent: AgentProcess,
    step: &str,
    frontends: usize,
) -> (String, bool) {
    let metrics = agent.metrics();
    assert!(
        metrics.contains(&format!("ebpf_proxy_programmed_frontends {frontends}\n"))
            && !metrics.contains("map_write_errors_total{"),
        "{step}: {metrics}"
    );
    let entries = svc4_entries(&env.pins.path);
    assert_eq!(entries.len(), frontends, "{step}");
    assert!(entries.values().all(|&n| n == 1), "{step}: half-written");
    {
        use proxy_user::MapStore as _;
        let dump = proxy_user::bpf::BpfMaps::open(&env.pins.path)
            .expect("open")
            .dump()
            .expect("dump");
        assert_eq!(dump.revnat.len(), frontends, "{step}: reverse NAT");
        assert_eq!(dump.backends.len(), frontends, "{step}: backends");
        assert!(
            dump.slots.values().all(|id| dump.backends.contains_key(id)),
            "{step}: a slot names a backend the map lacks"
        );
    }
    assert!(
        !env.pins
            .path
            .join(proxy_user::migrate::STAGING_DIR)
            .exists(),
        "{step}: staging directory left"
    );
    env.in_client(|| until(Instant::now(), 5, |r| answer_is(r, &["pod1"])));
    let logs = agent.stop();
    let rolled_back = matches!(step, "staged" | "filled");
    let found = if rolled_back {
        "an interrupted layout migration had not swapped any hook: rolling back"
    } else {
        "resuming an interrupted layout migration"
    };
    assert!(logs.contains(found), "{step}: {logs}");
    (logs, rolled_back)
}

/// Services x 1 endpoint that grow the service-side maps: 13,001 frontends with `web`
/// (one `SVC4` entry each, its slot in it), past 3/4 of `SVC4/6`'s and the backend
/// arrays' 16,384-entry start and of `REVNAT4/6`'s 4,096.
const GROWN: usize = 13_000;

/// The service-side maps that shrink when their use falls (`SVC4/6`, `REVNAT4/6`, the
/// backend arrays and their counters), as [`GROWN`] Services x 1 grow them: `SVC4/6`
/// 16,384 -> 32,768 (13,001 entries), `REVNAT4/6` 4,096 -> 32,768 (13,001 frontends),
/// `BACKEND4/6` and `BACKEND_CONNS` 16,384 -> 32,768 (13,001 backend ids).
const SHRUNK_MAPS: [(&str, u32, u32); 7] = [
    ("SVC4", 16_384, 32_768),
    ("SVC6", 16_384, 32_768),
    ("REVNAT4", 4_096, 32_768),
    ("REVNAT6", 4_096, 32_768),
    ("BACKEND4", 16_384, 32_768),
    ("BACKEND6", 16_384, 32_768),
    ("BACKEND_CONNS", 16_384, 32_768),
];

/// Issue 27, "memory after shrink returns": maps grown by [`GROWN`] Services x 1 (see
/// [`SHRUNK_MAPS`]) are not shrunk while their use stays over a quarter of their size
/// (down to 10,000 Services: 30.5 %, for more than twice the hold), nor before the hold
/// (shortened to 10 s by `EBPF_PROXY_SERVICE_SHRINK_AFTER_MS`) has passed since the sync
/// that took them under it (checked at half the hold: the hold runs from that sync, which
/// comes after the change is written); then, every Service but `web` gone, they shrink
/// in ONE online resize back to their start sizes, and `ebpf_proxy_map_memory_bytes` of
/// each comes back to within 8 KiB of its figure before the growth (the same entries:
/// `web`'s), while a client connects to `web`'s ClusterIP throughout: 0 failures, every
/// answer from its pod. The shrunk sizes stay across a restart (no resize at it).
#[test]
fn service_maps_shrink_online_once_long_under_their_low_water_mark() {
    let hold = Duration::from_secs(10);
    let mut env = TestEnv::without_datapath(1);
    env.serve_all(TARGET);
    let dir = Manifests::new();
    dir.write("web.yaml", &web_on_pod1());
    let hold_ms = hold.as_millis().to_string();
    let hook = [(
        proxy_user::agent::shrink::SHRINK_AFTER_ENV,
        hold_ms.as_str(),
    )];
    let mut agent = AgentProcess::start_wrapped(&env, &[], &hook, &dir.arg());
    agent.wait_healthy(Duration::from_secs(20));
    env.in_client(|| until(Instant::now(), 5, |r| answer_is(r, &["pod1"])));
    let size = |map: &str| pinned_max_entries(&env.pins.path, map);
    let memory_of = |m: &str| SHRUNK_MAPS.map(|(map, _, _)| map_memory(m, map));
    let before = memory_of(&wait_metrics(
        &agent,
        &["ebpf_proxy_map_memory_bytes{map=\"REVNAT6\"}"],
        Duration::from_secs(30),
    ));
    for (map, start, _) in SHRUNK_MAPS {
        assert_eq!(size(map), start, "{map} made small");
    }

    // Grown.
    dir.write("many.yaml", &manifests::many_services(GROWN, 1, TARGET));
    wait_metrics(
        &agent,
        &[
            "ebpf_proxy_programmed_frontends 13001\n",
            "ebpf_proxy_map_resizes_total{map=\"SVC4\",direction=\"grow\"} 1\n",
            "ebpf_proxy_map_resizes_total{map=\"REVNAT4\",direction=\"grow\"} 1\n",
        ],
        Duration::from_secs(180),
    );
    for (map, _, grown) in SHRUNK_MAPS {
        assert_eq!(size(map), grown, "{map} grown");
    }
    std::thread::sleep(Duration::from_secs(2));
    let grown = memory_of(&agent.metrics());

    // Over a quarter of the grown sizes: never shrunk, however long.
    dir.write("many.yaml", &manifests::many_services(10_000, 1, TARGET));
    wait_metrics(
        &agent,
        &["ebpf_proxy_programmed_frontends 10001\n"],
        Duration::from_secs(120),
    );
    std::thread::sleep(hold * 2 + Duration::from_secs(2));
    let metrics = agent.metrics();
    assert!(!metrics.contains("direction=\"shrink\""), "{metrics}");
    for (map, _, grown) in SHRUNK_MAPS {
        assert_eq!(size(map), grown, "{map} shrunk at 30 % of its size");
    }

    // Every Service but `web` gone: under a quarter.
    let hammer = Hammer::start(&env);
    std::thread::sleep(Duration::from_millis(200));
    let removed = Instant::now();
    dir.remove("many.yaml");
    wait_metrics(
        &agent,
        &["ebpf_proxy_programmed_frontends 1\n"],
        Duration::from_secs(120),
    );
    // Not before the hold: half of it after the change was written.
    std::thread::sleep((hold / 2).saturating_sub(removed.elapsed()));
    let metrics = agent.metrics();
    let checked = removed.elapsed();
    assert!(
        checked < hold,
        "the early check came {checked:?} after the change: too late to tell (hold {hold:?})"
    );
    assert!(
        !metrics.contains("direction=\"shrink\""),
        "shrunk {checked:?} after the change, before the hold ({hold:?}):\n{metrics}"
    );
    for (map, _, grown) in SHRUNK_MAPS {
        assert_eq!(size(map), grown, "{map} shrunk before the hold");
    }
    // Then shrunk, all seven in one resize, back to their start sizes.
    let want: Vec<String> = SHRUNK_MAPS
        .iter()
        .map(|(map, _, _)| {
            format!("ebpf_proxy_map_resizes_total{{map=\"{map}\",direction=\"shrink\"}} 1\n")
        })
        .collect();
    let want: Vec<&str> = want.iter().map(String::as_str).collect();
    let metrics = wait_metrics(&agent, &want, hold + Duration::from_secs(60));
    let shrunk_after = removed.elapsed();
    std::thread::sleep(Duration::from_millis(500));
    let answers = hammer.stop();
    assert!(
        metrics.contains("ebpf_proxy_service_map_entries 16384\n")
            && !metrics.contains("map_write_errors_total{"),
        "{metrics}"
    );
    for (map, start, _) in SHRUNK_MAPS {
        assert_eq!(size(map), start, "{map} shrunk to its start size");
    }
    for map in ["AFFINITY", "MAGLEV"] {
        assert!(
            !metrics.contains(&format!("{{map=\"{map}\",direction=")),
            "{map} was at its floor: {metrics}"
        );
    }
    // The memory returns: within 8 KiB of each map's figure before the growth.
    let t = Instant::now();
    let after = loop {
        let after = memory_of(&agent.metrics());
        if before.iter().zip(&after).all(|(b, a)| *a <= b + 8192) {
            break after;
        }
        assert!(
            t.elapsed() < Duration::from_secs(30),
            "map memory {after:?} bytes after the shrink, {before:?} before the growth, \
             {grown:?} grown"
        );
        std::thread::sleep(Duration::from_millis(200));
    };
    eprintln!(
        "{:?} bytes before the growth, {grown:?} grown, {after:?} after the shrink \
         ({shrunk_after:?} after the removal, hold {hold:?})",
        before
    );
    // `web` answered from its pod throughout.
    let bad: Vec<_> = answers
        .iter()
        .filter(|a| a.as_deref() != Ok("pod1"))
        .collect();
    assert!(answers.len() > 10, "{} answers", answers.len());
    assert!(
        bad.is_empty(),
        "{} of {} connections to web failed or misrouted across the shrink: {:?}",
        bad.len(),
        answers.len(),
        &bad[..bad.len().min(5)]
    );
    eprintln!(
        "{} connections to web across the shrink, 0 failed",
        answers.len()
    );
    assert_eq!(
        svc4_entries(&env.pins.path)
            .into_values()
            .collect::<Vec<_>>(),
        [1]
    );
    let logs = agent.stop();
    assert!(logs.contains("service-side maps shrunk online"), "{logs}");

    // The shrunk sizes stay across a restart (the default hold: nothing resized).
    let mut agent = AgentProcess::start(&env, &dir.arg());
    agent.wait_healthy(Duration::from_secs(30));
    env.in_client(|| until(Instant::now(), 5, |r| answer_is(r, &["pod1"])));
    let metrics = agent.metrics();
    assert!(
        !metrics.contains("ebpf_proxy_map_resizes_total{"),
        "{metrics}"
    );
    for (map, start, _) in SHRUNK_MAPS {
        assert_eq!(size(map), start, "{map} after a restart");
    }
    agent.stop();
}

/// A crash after each step of a service-map shrink (`EBPF_PROXY_MIGRATE_CRASH_AT`): maps
/// grown by [`GROWN`] Services ([`SHRUNK_MAPS`]), most of them removed while the agent is
/// down; the next agent (hold 500 ms) removes them at its first sync and aborts in the
/// shrink that follows. The start after it finishes or rolls the shrink back; every
/// Service left (`web` and 100 others) is served whole, and the maps end at their start
/// sizes (a rolled-back shrink is done again after the hold), no staging directory left.
#[test]
fn a_crash_at_each_step_of_a_service_map_shrink_then_restart() {
    let hook = proxy_user::agent::shrink::SHRINK_AFTER_ENV;
    for step in proxy_user::migrate::STEPS {
        let mut env = TestEnv::without_datapath(1);
        env.serve_all(TARGET);
        let dir = Manifests::new();
        dir.write("web.yaml", &web_on_pod1());
        dir.write("many.yaml", &manifests::many_services(GROWN, 1, TARGET));
        let mut agent = AgentProcess::start(&env, &dir.arg());
        wait_metrics(
            &agent,
            &["ebpf_proxy_programmed_frontends 13001\n"],
            Duration::from_secs(180),
        );
        agent.wait_healthy(Duration::from_secs(60));
        for (map, _, grown) in SHRUNK_MAPS {
            assert_eq!(
                pinned_max_entries(&env.pins.path, map),
                grown,
                "{step}: {map}"
            );
        }
        agent.stop();

        dir.write("many.yaml", &manifests::many_services(100, 1, TARGET));
        let hooks = [(proxy_user::migrate::CRASH_ENV, step), (hook, "500")];
        let mut agent = AgentProcess::start_wrapped(&env, &[], &hooks, &dir.arg());
        wait_crash(&mut agent, step);
        let logs = agent.logs();
        assert!(
            logs.contains("wanted_entries=16384") && logs.contains("aborting (test hook)"),
            "{step}: not the shrink's crash:\n{logs}"
        );
        drop(agent);

        let mut agent = AgentProcess::start_wrapped(&env, &[], &[(hook, "500")], &dir.arg());
        agent.wait_healthy(Duration::from_secs(120));
        let t = Instant::now();
        while SHRUNK_MAPS
            .iter()
            .any(|(map, start, _)| pinned_max_entries(&env.pins.path, map) != *start)
        {
            assert!(
                t.elapsed() < Duration::from_secs(60),
                "{step}: not shrunk:\n{}",
                agent.logs()
            );
            std::thread::sleep(Duration::from_millis(100));
        }
        let (logs, rolled_back) = assert_crash_settled(&env, agent, step, 101);
        // Rolled back: shrunk again by this agent; finished: nothing left to shrink, and
        // the start took the sizes of after the resume (nothing resized back).
        assert_eq!(
            logs.contains("service-side maps shrunk online"),
            rolled_back,
            "{step}: {logs}"
        );
        assert!(
            !logs.contains("wanted_entries=32768"),
            "{step}: resized back to the grown size at the start: {logs}"
        );
        eprintln!("{step}: settled at the start, 101 Services whole, maps at their start sizes");
    }
}

/// After a first complete sync, a Service that does not fit is a failed sync, not a sync
/// (kube-proxy's rule): `/healthz` names the failure in its body at once, turns 503 with
/// that reason once the last complete sync is older than twice `--sync-interval`, and is
/// 200 again once the Service is removed.
#[test]
fn a_full_service_map_after_the_first_sync_turns_health_503_with_the_reason() {
    let mut env = TestEnv::without_datapath(1);
    env.serve_all(TARGET);
    let dir = Manifests::new();
    // `web` (2 entries) and five Services of 10 endpoints (11 each): 57 of 64 entries.
    dir.write("web.yaml", &web_on_pod1());
    let big = |k: usize| {
        let addrs: Vec<String> = (1..=254).map(|i| format!("10.200.{k}.{i}")).collect();
        let eps: Vec<_> = addrs.iter().map(|a| ready(a)).collect();
        format!(
            "{}---\n{}",
            service(&format!("big{k}"), &format!("10.96.1.{k}"), 80),
            slice(&format!("big{k}-1"), &format!("big{k}"), TARGET, &eps)
        )
    };
    for k in 1..=5 {
        dir.write(&format!("big{k}.yaml"), &big(k));
    }
    let [m, d] = dir.arg();
    // Health's limit: twice the sync interval, 4 s.
    let mut agent = AgentProcess::start(
        &env,
        &[m, d, "--service-map-entries", "64", "--sync-interval", "2s"],
    );
    agent.wait_healthy(Duration::from_secs(30));
    env.in_client(|| until(Instant::now(), 5, |r| answer_is(r, &["pod1"])));
    let (code, body) = agent.healthz();
    assert_eq!(code, 200, "{body}");
    assert!(!body.contains("could not write"), "{body}");

    // A sixth does not fit.
    dir.write("big6.yaml", &big(6));
    let reason = "could not write 1 frontend(s)";
    let deadline = Instant::now() + Duration::from_secs(60);
    let mut seen_200_with_reason = false;
    let body = loop {
        let (code, body) = agent.healthz();
        match code {
            // Within the limit: still 200, but saying what failed.
            200 if body.contains(reason) => seen_200_with_reason = true,
            200 => {}
            503 => break body,
            other => panic!("/healthz answered {other}: {body}"),
        }
        assert!(
            Instant::now() < deadline,
            "/healthz still 200 after 60 s with big6 unwritten: {body}"
        );
        std::thread::sleep(Duration::from_millis(20));
    };
    assert!(body.contains(reason), "503 names the failure: {body}");
    assert!(body.contains("last successful sync"), "{body}");
    eprintln!("200 with the reason seen before the 503: {seen_200_with_reason}; 503 body: {body}");
    // Still served: what fits stays in the maps.
    env.in_client(|| until(Instant::now(), 5, |r| answer_is(r, &["pod1"])));
    let metrics = agent.metrics();
    assert!(metrics.contains("reason=\"map_full\"}"), "{metrics}");

    // The Service removed: the next sync is complete, healthy again without the reason.
    dir.remove("big6.yaml");
    let body = agent.wait_healthz(200, Duration::from_secs(30));
    assert!(!body.contains("could not write"), "{body}");
    let logs = agent.stop();
    assert!(logs.contains("SVC4 is full"), "{logs}");
}

/// Lines of `text` that are samples of the metric family `name` (`name_total{...} v`).
fn samples<'a>(text: &'a str, name: &str) -> Vec<&'a str> {
    let prefix = format!("{name}_total{{");
    text.lines().filter(|l| l.starts_with(&prefix)).collect()
}

/// `--metrics-per-service` at 10,000 Services (one endpoint each) and `web`: connections
/// through `web` are counted for its Service port and its backend; every Service port and
/// backend has its two series (40,004 in all, under the default cap of 60,000); /metrics
/// and /healthz answer within bounds that hold on a loaded machine while scrapes run. With
/// a lower cap (30,000 series) the agent exports Service ports first, then backends up to
/// the cap, and counts the rest in `ebpf_proxy_per_service_series_dropped`. Without the
/// flag there is no such series.
#[test]
fn per_service_metrics_at_ten_thousand_services() {
    let mut env = TestEnv::without_datapath(1);
    env.serve_all(TARGET);
    let dir = Manifests::new();
    big_manifest(&dir.0.join("big.yaml"), 10_000, 1);
    dir.write("web.yaml", &web_on_pod1());
    let mut args = dir.arg().to_vec();
    args.push("--metrics-per-service");
    let mut agent = AgentProcess::start(&env, &args);
    agent.wait_healthy(Duration::from_secs(120));
    // Five connections through the socket hooks.
    for _ in 0..5 {
        let r = env.in_client(|| tcp_ask(vip()));
        assert!(answer_is(&r, &["pod1"]), "{r:?}");
    }
    let t0 = Instant::now();
    let text = agent.metrics();
    let scrape = t0.elapsed();
    let web = "namespace=\"default\",service=\"web\",port=\"http\",protocol=\"tcp\"";
    assert!(
        text.contains(&format!(
            "ebpf_proxy_service_connections_total{{{web}}} 5\n"
        )),
        "{}",
        samples(&text, "ebpf_proxy_service_connections")
            .iter()
            .filter(|l| l.contains("\"web\""))
            .copied()
            .collect::<Vec<_>>()
            .join("\n")
    );
    let pod1 = format!("backend=\"{}:{TARGET}\",protocol=\"tcp\"", pod(1));
    assert!(
        text.contains(&format!(
            "ebpf_proxy_backend_connections_total{{{pod1}}} 5\n"
        )),
        "{pod1}"
    );
    let families = [
        "ebpf_proxy_service_connections",
        "ebpf_proxy_service_packets",
        "ebpf_proxy_backend_connections",
        "ebpf_proxy_backend_packets",
    ];
    let counts: Vec<usize> = families.iter().map(|f| samples(&text, f).len()).collect();
    assert_eq!(counts, [10_001, 10_001, 10_001, 10_001]);
    assert!(text.contains("ebpf_proxy_per_service_series 40004\n"));
    assert!(text.contains("ebpf_proxy_per_service_series_dropped 0\n"));
    assert!(
        text.trim_end().ends_with("# EOF"),
        "the exposition ends with # EOF"
    );
    // Size: about 100 bytes a series.
    eprintln!(
        "/metrics with 40,004 per-Service series: {} bytes, scraped in {scrape:?}",
        text.len()
    );
    assert!(
        text.len() < 40_004 * 160 + (1 << 20),
        "{} bytes",
        text.len()
    );
    // /healthz answers while scrapes run back to back.
    let stop = Arc::new(AtomicBool::new(false));
    let scraper = {
        let stop = stop.clone();
        let port = agent.metrics_port;
        std::thread::spawn(move || {
            let mut worst = Duration::ZERO;
            while !stop.load(Ordering::Relaxed) {
                let t = Instant::now();
                let (code, _) = support::http_get(port, "/metrics").expect("metrics");
                assert_eq!(code, 200);
                worst = worst.max(t.elapsed());
            }
            worst
        })
    };
    let mut health_worst = Duration::ZERO;
    for _ in 0..20 {
        let t = Instant::now();
        assert_eq!(agent.healthz().0, 200);
        health_worst = health_worst.max(t.elapsed());
        std::thread::sleep(Duration::from_millis(50));
    }
    stop.store(true, Ordering::Relaxed);
    let scrape_worst = scraper.join().expect("scraper");
    eprintln!("under scrapes: /healthz worst {health_worst:?}, /metrics worst {scrape_worst:?}");
    // Liveness bounds (a loaded 2-core machine), far above the figures printed.
    assert!(health_worst < Duration::from_secs(2), "{health_worst:?}");
    assert!(scrape_worst < Duration::from_secs(10), "{scrape_worst:?}");
    agent.stop();

    // A lower cap: Service ports first (20,002 series), then backends up to 30,000.
    let mut capped = dir.arg().to_vec();
    capped.extend([
        "--metrics-per-service",
        "--metrics-per-service-max-series",
        "30000",
    ]);
    let mut agent = AgentProcess::start(&env, &capped);
    agent.wait_healthy(Duration::from_secs(120));
    let text = agent.metrics();
    let counts: Vec<usize> = families.iter().map(|f| samples(&text, f).len()).collect();
    assert_eq!(counts, [10_001, 10_001, 4_999, 4_999]);
    assert!(text.contains("ebpf_proxy_per_service_series 30000\n"));
    assert!(text.contains("ebpf_proxy_per_service_series_dropped 10004\n"));
    agent.stop();

    // Off: no per-Service series, and the datapath counts nothing.
    let mut agent = AgentProcess::start(&env, &dir.arg());
    agent.wait_healthy(Duration::from_secs(120));
    let r = env.in_client(|| tcp_ask(vip()));
    assert!(answer_is(&r, &["pod1"]), "{r:?}");
    let text = agent.metrics();
    for f in families.iter().chain(&["ebpf_proxy_per_service_series"]) {
        assert!(!text.contains(f), "no {f} when off");
    }
    let pins = proxy_user::pins::PinDir::new(&env.pins.path);
    let counters = proxy_user::counters::CounterMaps::open(&pins)
        .expect("open")
        .expect("pinned");
    assert!(!counters.is_on().expect("COUNTERS_ON"));
    assert!(counters
        .read(proxy_user::counters::CounterKind::Service)
        .expect("read")
        .is_empty());
}

/// Issue 27 (maps sized to demand): without `--metrics-per-service` the per-Service
/// counter maps are made at one entry; a restart with the flag resizes them online to
/// their ceilings (32,768 / 65,536) at the start, and connections through `web` are
/// counted for its Service port and backend.
#[test]
fn turning_per_service_metrics_on_at_a_restart_resizes_the_counter_maps() {
    let mut env = TestEnv::without_datapath(1);
    env.serve_all(TARGET);
    let dir = Manifests::new();
    dir.write("web.yaml", &web_on_pod1());
    let mut agent = AgentProcess::start(&env, &dir.arg());
    agent.wait_healthy(Duration::from_secs(20));
    let max_entries = |name: &str| pinned_max_entries(&env.pins.path, name);
    assert_eq!(max_entries("SVC_COUNTERS"), 1);
    assert_eq!(max_entries("BACKEND_COUNTERS"), 1);
    agent.stop();

    let mut args = dir.arg().to_vec();
    args.push("--metrics-per-service");
    let mut agent = AgentProcess::start(&env, &args);
    agent.wait_healthy(Duration::from_secs(30));
    assert_eq!(
        max_entries("SVC_COUNTERS"),
        proxy_common::limits::MAX_COUNTED_FRONTENDS
    );
    assert_eq!(
        max_entries("BACKEND_COUNTERS"),
        proxy_common::limits::MAX_COUNTED_BACKENDS
    );
    for _ in 0..3 {
        let r = env.in_client(|| tcp_ask(vip()));
        assert!(answer_is(&r, &["pod1"]), "{r:?}");
    }
    let web = "namespace=\"default\",service=\"web\",port=\"http\",protocol=\"tcp\"";
    let text = wait_metrics(
        &agent,
        &[
            &format!("ebpf_proxy_service_connections_total{{{web}}} 3\n"),
            "ebpf_proxy_map_resizes_total{map=\"SVC_COUNTERS\",direction=\"grow\"} 1\n",
            "ebpf_proxy_map_resizes_total{map=\"BACKEND_COUNTERS\",direction=\"grow\"} 1\n",
        ],
        Duration::from_secs(30),
    );
    assert!(!text.contains("map_write_errors_total{"), "{text}");
    agent.stop();
}
