//! The shipped DaemonSet's memory limit against the real agent at 10,000 Services x 10
//! endpoints (issue 12 item 1).
//!
//! BPF map memory is charged to the memory cgroup of the process that creates the maps,
//! and stays charged while the maps are pinned. So the test runs the real `proxy-agent`
//! binary in a fresh child memory cgroup whose limit is the one `deploy/base/daemonset.yaml`
//! gives the agent container, with the conntrack ceiling of `deploy/base/configmap.yaml`
//! (`PROXY_CONNTRACK_MAX`; the tables created at it, as the agent grows them under load):
//! a cold start (the agent creates every map) must become healthy with every frontend
//! programmed and no OOM kill; then the agent is stopped and started again *in the same
//! cgroup* (what a container restart in the same pod does: the pinned maps are still
//! charged there) and must be healthy again. Peak memory and the maps' own figures are
//! printed. Needs root; fails without it.
//!
//! The memory controller: cgroup v2 when the unified hierarchy has it; otherwise (this
//! project's hybrid-mode machines: the unified hierarchy at /sys/fs/cgroup/unified has no
//! memory controller) the v1 memory controller, whose charging of kernel memory (BPF maps
//! included) is the same memcg code. The test checks that the maps really are charged
//! there (the cgroup's usage with no agent running covers the maps' memory), so it
//! cannot pass by measuring the wrong hierarchy.
//!
//! Over 600 lines: one suite (the DaemonSet memory limit, measured). Each file under
//! `tests/` is a test binary of its own that links the whole crate, so a suite is split
//! into modules only when its scenarios stop sharing set-up (shared helpers live in
//! `tests/support/`).

mod support;

use std::{
    fs,
    io::Write as _,
    os::{fd::AsRawFd, unix::process::CommandExt as _},
    path::{Path, PathBuf},
    process::Command,
    time::{Duration, Instant},
};

use k8s_openapi::api::{apps::v1::DaemonSet, core::v1::ConfigMap};
use support::{
    free_ports,
    manifests::{many_services, ready, service, slice},
    tcp_ask, unique, AgentProcess, TestEnv, Topology,
};

const SERVICES: usize = 10_000;
const ENDPOINTS: usize = 10;
const TARGET: u16 = 8080;
const MIB: u64 = 1 << 20;

fn deploy_file(name: &str) -> String {
    let path = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../deploy/base")
        .join(name);
    fs::read_to_string(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

/// A Kubernetes quantity as bytes (`256Mi`, `1Gi`, `500M`, `1048576`).
fn quantity_bytes(q: &str) -> u64 {
    let units: [(&str, u64); 8] = [
        ("Ki", 1 << 10),
        ("Mi", 1 << 20),
        ("Gi", 1 << 30),
        ("Ti", 1 << 40),
        ("k", 1_000),
        ("M", 1_000_000),
        ("G", 1_000_000_000),
        ("T", 1_000_000_000_000),
    ];
    for (suffix, factor) in units {
        if let Some(n) = q.strip_suffix(suffix) {
            return n.parse::<u64>().expect("quantity number") * factor;
        }
    }
    q.parse().unwrap_or_else(|e| panic!("quantity {q:?}: {e}"))
}

/// What the shipped manifests give the agent container.
struct Shipped {
    memory_limit: u64,
    conntrack_max: String,
    service_map_entries: String,
    grace: Duration,
    /// The startup probe (on /livez, before the liveness probe runs): initialDelaySeconds +
    /// periodSeconds x failureThreshold.
    startup_budget: Duration,
    /// Liveness: periodSeconds x failureThreshold.
    liveness_window: Duration,
}

fn shipped() -> Shipped {
    let ds: DaemonSet = serde_yaml::from_str(&deploy_file("daemonset.yaml")).expect("DaemonSet");
    let pod = ds.spec.expect("spec").template.spec.expect("pod spec");
    let agent = pod
        .containers
        .iter()
        .find(|c| c.name == "agent")
        .expect("agent container");
    let limit = agent
        .resources
        .as_ref()
        .and_then(|r| r.limits.as_ref())
        .and_then(|l| l.get("memory"))
        .expect("the agent container has a memory limit");
    let live = agent.liveness_probe.as_ref().expect("livenessProbe");
    let cm: ConfigMap = serde_yaml::from_str(&deploy_file("configmap.yaml")).expect("ConfigMap");
    let data = cm.data.expect("ConfigMap data");
    Shipped {
        memory_limit: quantity_bytes(&limit.0),
        conntrack_max: data
            .get("PROXY_CONNTRACK_MAX")
            .expect("PROXY_CONNTRACK_MAX")
            .clone(),
        service_map_entries: data
            .get("PROXY_SERVICE_MAP_ENTRIES")
            .expect("PROXY_SERVICE_MAP_ENTRIES")
            .clone(),
        startup_budget: {
            let p = agent.startup_probe.as_ref().expect("startupProbe");
            Duration::from_secs(
                (p.initial_delay_seconds.unwrap_or(0)
                    + p.period_seconds.unwrap_or(10) * p.failure_threshold.unwrap_or(3))
                    as u64,
            )
        },
        liveness_window: Duration::from_secs(
            (live.period_seconds.unwrap_or(10) * live.failure_threshold.unwrap_or(3)) as u64,
        ),
        grace: Duration::from_secs(
            pod.termination_grace_period_seconds
                .expect("terminationGracePeriodSeconds") as u64,
        ),
    }
}

/// A fresh child memory cgroup with a limit, below this process's own memory cgroup;
/// removed on drop (after the maps charged to it are gone, the kernel moves what is left
/// to the parent).
struct MemCgroup {
    path: PathBuf,
    v2: bool,
}

impl MemCgroup {
    /// cgroup v2 if its hierarchy has the memory controller, else the v1 memory
    /// controller. Both found from /proc/self/mountinfo and /proc/self/cgroup.
    fn new(limit: u64) -> Self {
        let mountinfo = fs::read_to_string("/proc/self/mountinfo").expect("mountinfo");
        let own = fs::read_to_string("/proc/self/cgroup").expect("/proc/self/cgroup");
        // mountinfo: "id parent major:minor root mountpoint opts - fstype source superopts".
        let mounts: Vec<(String, String, String)> = mountinfo
            .lines()
            .filter_map(|l| {
                let (left, right) = l.split_once(" - ")?;
                let mount_point = left.split_whitespace().nth(4)?.to_string();
                let mut r = right.split_whitespace();
                let fstype = r.next()?.to_string();
                let superopts = r.nth(1).unwrap_or("").to_string();
                Some((mount_point, fstype, superopts))
            })
            .collect();
        let v2_mount = mounts
            .iter()
            .find(|(_, t, _)| t == "cgroup2")
            .map(|(m, _, _)| PathBuf::from(m));
        let v2_controllers = v2_mount
            .as_ref()
            .and_then(|m| fs::read_to_string(m.join("cgroup.controllers")).ok())
            .unwrap_or_default();
        let (parent, v2) = if v2_controllers.split_whitespace().any(|c| c == "memory") {
            let mount = v2_mount.expect("cgroup2 mount");
            let rel = own
                .lines()
                .find_map(|l| l.strip_prefix("0::"))
                .expect("0:: line");
            (mount.join(rel.trim_start_matches('/')), true)
        } else {
            let mount = mounts
                .iter()
                .find(|(_, t, o)| t == "cgroup" && o.split(',').any(|x| x == "memory"))
                .map(|(m, _, _)| PathBuf::from(m))
                .unwrap_or_else(|| {
                    panic!(
                        "no memory controller: the cgroup2 hierarchy at {v2_mount:?} has \
                         controllers {v2_controllers:?} and no cgroup v1 memory hierarchy \
                         is mounted"
                    )
                });
            let rel = own
                .lines()
                .find_map(|l| {
                    let mut f = l.splitn(3, ':');
                    let (_, ctrl, path) = (f.next()?, f.next()?, f.next()?);
                    ctrl.split(',').any(|c| c == "memory").then_some(path)
                })
                .expect("a memory line in /proc/self/cgroup");
            eprintln!(
                "cgroup v2 ({}) has no memory controller (controllers: {:?}); using the v1 \
                 memory controller at {}",
                v2_mount
                    .map(|m| m.display().to_string())
                    .unwrap_or_default(),
                v2_controllers.trim(),
                mount.display()
            );
            (mount.join(rel.trim_start_matches('/')), false)
        };
        if v2 {
            // The child's memory files exist only if the parent delegates the controller
            // (refused when the parent holds processes: then memory.max below says so).
            let _ = fs::write(parent.join("cgroup.subtree_control"), "+memory");
        }
        let path = parent.join(unique("ebpf-proxy-memtest-"));
        fs::create_dir(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
        let cg = Self { path, v2 };
        if v2 {
            cg.write("memory.max", &limit.to_string());
            cg.write("memory.swap.max", "0");
        } else {
            cg.write("memory.limit_in_bytes", &limit.to_string());
            // No swap on the machine; if there were, memsw would keep it from hiding
            // memory (may be missing without swap accounting).
            let _ = fs::write(
                cg.path.join("memory.memsw.limit_in_bytes"),
                limit.to_string(),
            );
        }
        assert_eq!(cg.limit(), limit, "the limit took");
        cg
    }

    fn write(&self, file: &str, value: &str) {
        let p = self.path.join(file);
        fs::write(&p, value).unwrap_or_else(|e| panic!("{}: {e}", p.display()));
    }

    fn read(&self, file: &str) -> String {
        let p = self.path.join(file);
        fs::read_to_string(&p).unwrap_or_else(|e| panic!("{}: {e}", p.display()))
    }

    fn read_u64(&self, file: &str) -> u64 {
        self.read(file).trim().parse().expect(file)
    }

    fn limit(&self) -> u64 {
        if self.v2 {
            self.read_u64("memory.max")
        } else {
            self.read_u64("memory.limit_in_bytes")
        }
    }

    fn usage(&self) -> u64 {
        self.read_u64(if self.v2 {
            "memory.current"
        } else {
            "memory.usage_in_bytes"
        })
    }

    /// Highest usage since the last [`Self::reset_peak`] (v2 without a resettable
    /// `memory.peak`: since creation).
    fn peak(&self) -> u64 {
        self.read_u64(if self.v2 {
            "memory.peak"
        } else {
            "memory.max_usage_in_bytes"
        })
    }

    fn reset_peak(&self) {
        let file = if self.v2 {
            "memory.peak"
        } else {
            "memory.max_usage_in_bytes"
        };
        // v2: writing resets it for the writer's fd only (6.12+): harmless, v1: resets.
        let _ = fs::write(self.path.join(file), "0");
    }

    /// OOM kills in this cgroup (`memory.events` / `memory.oom_control`).
    fn oom_kills(&self) -> u64 {
        let text = self.read(if self.v2 {
            "memory.events"
        } else {
            "memory.oom_control"
        });
        text.lines()
            .find_map(|l| l.strip_prefix("oom_kill "))
            .map(|v| v.trim().parse().expect("oom_kill"))
            .unwrap_or(0)
    }

    fn events(&self) -> String {
        if self.v2 {
            self.read("memory.events")
        } else {
            format!(
                "{}failcnt {}",
                self.read("memory.oom_control"),
                self.read("memory.failcnt").trim()
            )
        }
    }

    /// The open `cgroup.procs`: the child writes its pid through it between fork and exec,
    /// so that everything the agent allocates, from its first page, is charged here.
    fn procs(&self) -> fs::File {
        fs::OpenOptions::new()
            .write(true)
            .open(self.path.join("cgroup.procs"))
            .expect("cgroup.procs")
    }
}

impl Drop for MemCgroup {
    fn drop(&mut self) {
        if let Err(e) = fs::remove_dir(&self.path) {
            eprintln!("removing {}: {e}", self.path.display());
        }
    }
}

/// `proxy-agent run` as `AgentProcess::start` runs it, but placed in `memcg` before exec.
fn start_in_memcg(env: &TestEnv, memcg: &MemCgroup, args: &[&str]) -> AgentProcess {
    let [healthz_port, metrics_port] = free_ports();
    let log = std::env::temp_dir().join(unique("ebpf-proxy-agent-log-"));
    let log_file = fs::File::create(&log).expect("log file");
    let procs = memcg.procs();
    let procs_fd = procs.as_raw_fd();
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_proxy-agent"));
    cmd.arg("run")
        .args(args)
        .args(["--pin-path", env.pins.path.to_str().expect("utf-8")])
        .args(["--cgroup", env.cgroup.path.to_str().expect("utf-8")])
        .args(["--node-name", "node-a"])
        .args(["--healthz-addr", &format!("127.0.0.1:{healthz_port}")])
        .args(["--metrics-addr", &format!("127.0.0.1:{metrics_port}")])
        .args(["--min-sync-interval", "10ms", "--manifests-poll", "200ms"])
        // Never touch the test machine's iptables/nftables/IPVS, nor its interfaces.
        .arg("--cleanup-kube-proxy=false")
        .args(["--interfaces", "none"])
        .env("RUST_LOG", "info")
        .stdout(log_file.try_clone().expect("log"))
        .stderr(log_file);
    // SAFETY: between fork and exec only write(2) on an fd opened before the fork
    // ("0" = the calling process), which is async-signal-safe.
    unsafe {
        cmd.pre_exec(move || {
            if libc::write(procs_fd, b"0".as_ptr().cast(), 1) != 1 {
                return Err(std::io::Error::last_os_error());
            }
            Ok(())
        });
    }
    let child = cmd.spawn().expect("start proxy-agent in the memory cgroup");
    drop(procs);
    let procs_now = memcg.read("cgroup.procs");
    assert!(
        procs_now
            .split_whitespace()
            .any(|p| p == child.id().to_string()),
        "the agent runs in the memory cgroup: {procs_now:?}"
    );
    AgentProcess {
        child,
        healthz_port,
        metrics_port,
        log,
        netns: None,
    }
}

/// 10,000 Services x 10 endpoints (the e2e tests' layout), plus `web` (10.96.0.10:80 ->
/// pod1, the one that gets traffic).
fn manifests(dir: &Path) {
    let y = many_services(SERVICES, ENDPOINTS, TARGET);
    fs::write(dir.join("big.yaml"), y).expect("write");
    let pod1 = Topology::pod_v4(1).to_string();
    let mut f = fs::File::create(dir.join("web.yaml")).expect("web.yaml");
    write!(
        f,
        "{}---\n{}",
        service("web", "10.96.0.10", 80),
        slice("web-1", "web", TARGET, &[ready(&pod1)])
    )
    .expect("write");
}

/// How `/livez` answered while the agent started, asked as the liveness probe asks it
/// (a 5 s timeout).
#[derive(Debug, Default)]
struct Liveness {
    /// From the start to its first 200.
    first: Duration,
    /// The longest stretch without a 200 after that.
    longest_gap: Duration,
}

/// Waits for /healthz 200; on an exit (an OOM kill, say) fails with the cgroup's events.
/// Returns the time to healthy and how `/livez` answered meanwhile.
fn wait_healthy(
    agent: &mut AgentProcess,
    memcg: &MemCgroup,
    timeout: Duration,
) -> (Duration, Liveness) {
    let start = Instant::now();
    let mut live = Liveness::default();
    let mut last_live: Option<Instant> = None;
    loop {
        if let Some(status) = agent.child.try_wait().expect("wait") {
            let logs = agent.logs();
            let tail: Vec<&str> = logs.lines().rev().take(20).collect();
            panic!(
                "proxy-agent exited with {status} (peak {} MiB of {} MiB; events:\n{})\n\
                 last log lines:\n{}",
                memcg.peak() / MIB,
                memcg.limit() / MIB,
                memcg.events(),
                tail.into_iter().rev().collect::<Vec<_>>().join("\n")
            );
        }
        if matches!(
            support::http_get(agent.healthz_port, "/livez"),
            Ok((200, _))
        ) {
            let now = Instant::now();
            match last_live {
                None => live.first = now - start,
                Some(t) => live.longest_gap = live.longest_gap.max(now - t),
            }
            last_live = Some(now);
        }
        if matches!(
            support::http_get(agent.healthz_port, "/healthz"),
            Ok((200, _))
        ) {
            return (start.elapsed(), live);
        }
        assert!(
            start.elapsed() < timeout,
            "proxy-agent not healthy after {timeout:?} (peak {} MiB):\n{}",
            memcg.peak() / MIB,
            agent.logs()
        );
        std::thread::sleep(Duration::from_millis(100));
    }
}

fn metric(metrics: &str, name: &str) -> Vec<(String, u64)> {
    metrics
        .lines()
        .filter(|l| l.starts_with(name))
        .filter_map(|l| {
            let (k, v) = l.rsplit_once(' ')?;
            Some((k.to_string(), v.parse::<f64>().ok()? as u64))
        })
        .collect()
}

/// The checks after each start: every frontend and backend programmed, traffic to the
/// VIP, the map memory metric; returns the maps' total from the metric.
fn check_programmed(env: &TestEnv, agent: &AgentProcess) -> u64 {
    let metrics = agent.metrics();
    let frontends = metric(&metrics, "ebpf_proxy_programmed_frontends");
    let backends = metric(&metrics, "ebpf_proxy_programmed_backends");
    assert_eq!(
        frontends,
        [(
            "ebpf_proxy_programmed_frontends".into(),
            SERVICES as u64 + 1
        )],
        "every frontend programmed"
    );
    assert_eq!(
        backends,
        [(
            "ebpf_proxy_programmed_backends".into(),
            (SERVICES * ENDPOINTS) as u64 + 1
        )],
        "every backend programmed"
    );
    let maps = metric(&metrics, "ebpf_proxy_map_memory_bytes{");
    assert!(
        maps.iter().any(|(k, _)| k.contains("map=\"CT4\"")),
        "map_memory_bytes per map: {maps:?}"
    );
    env.in_client(|| {
        let (answer, _) = tcp_ask("10.96.0.10:80".parse().expect("addr")).expect("VIP");
        assert_eq!(answer, "pod1");
    });
    maps.iter().map(|(_, v)| v).sum()
}

/// SIGTERM; the time until the process is gone.
fn stop(agent: &mut AgentProcess) -> Duration {
    let t0 = Instant::now();
    // SAFETY: signalling our own child by pid.
    unsafe { libc::kill(agent.child.id() as i32, libc::SIGTERM) };
    let status = agent.child.wait().expect("wait");
    let took = t0.elapsed();
    assert!(status.success(), "proxy-agent exit on SIGTERM: {status}");
    took
}

#[test]
fn shipped_memory_limit_survives_cold_start_and_restart_at_10k_services() {
    support::require_root();
    let shipped = shipped();
    let memcg = MemCgroup::new(shipped.memory_limit);
    let mut env = TestEnv::without_datapath(1);
    env.serve_all(TARGET);
    let dir = std::env::temp_dir().join(unique("ebpf-proxy-manifests-"));
    fs::create_dir_all(&dir).expect("mkdir");
    struct RmDir(PathBuf);
    impl Drop for RmDir {
        fn drop(&mut self) {
            let _ = fs::remove_dir_all(&self.0);
        }
    }
    let _rm = RmDir(dir.clone());
    manifests(&dir);
    let args = [
        "--manifests",
        dir.to_str().expect("utf-8"),
        "--conntrack-max",
        &shipped.conntrack_max,
        // The tables at their ceiling from the start: the agent grows them to it by
        // itself under load, so the limit must hold them there.
        "--conntrack-start",
        &shipped.conntrack_max,
        "--service-map-entries",
        &shipped.service_map_entries,
    ];
    let before = memcg.usage();
    let test_start = Instant::now();

    // Cold start: this agent creates every map, charged to the cgroup.
    let mut agent = start_in_memcg(&env, &memcg, &args);
    let (cold, live_cold) = wait_healthy(&mut agent, &memcg, Duration::from_secs(300));
    let maps_cold = check_programmed(&env, &agent);
    let peak_cold = memcg.peak();
    let logs = agent.logs();
    assert!(
        logs.contains("BPF map memory"),
        "the agent logs its map memory at start:\n{logs}"
    );
    let stop_took = stop(&mut agent);
    drop(agent);
    assert_eq!(
        memcg.oom_kills(),
        0,
        "no OOM kill on the cold start: {}",
        memcg.events()
    );

    // No agent runs: what stays charged is the pinned maps.
    std::thread::sleep(Duration::from_millis(500));
    let charged_idle = memcg.usage().saturating_sub(before);
    let filled = support_map_memory(&env);
    eprintln!(
        "maps at {SERVICES} x {ENDPOINTS} (fdinfo memlock): {}",
        filled
            .iter()
            .map(|m| format!("{}={}", m.name, m.bytes))
            .collect::<Vec<_>>()
            .join(" ")
    );
    let prealloc: u64 = filled
        .iter()
        .filter(|m| PREALLOCATED.contains(&m.name))
        .map(|m| m.bytes)
        .sum();
    assert!(
        charged_idle >= prealloc * 9 / 10,
        "the pinned maps stay charged to the agent's memory cgroup (else this test measures \
         the wrong hierarchy): {} MiB charged with no agent, preallocated maps {} MiB",
        charged_idle / MIB,
        prealloc / MIB
    );

    // Restart in the same cgroup: the maps are still charged there.
    memcg.reset_peak();
    let mut agent = start_in_memcg(&env, &memcg, &args);
    let (warm, live_warm) = wait_healthy(&mut agent, &memcg, Duration::from_secs(300));
    let maps_warm = check_programmed(&env, &agent);
    let peak_warm = memcg.peak();
    let stop_warm = stop(&mut agent);
    drop(agent);
    assert_eq!(
        memcg.oom_kills(),
        0,
        "no OOM kill on the restart: {}",
        memcg.events()
    );

    let limit = shipped.memory_limit;
    eprintln!(
        "memory cgroup ({}), limit {} MiB, conntrack {} flows/family:\n\
         cold start: healthy in {cold:?} (/livez {live_cold:?}), peak {} MiB, maps {} MiB; SIGTERM -> exit {stop_took:?}\n\
         idle (no agent): {} MiB charged\n\
         restart:    healthy in {warm:?} (/livez {live_warm:?}), peak {} MiB, maps {} MiB; SIGTERM -> exit {stop_warm:?}\n\
         test run {:?}",
        if memcg.v2 { "v2" } else { "v1" },
        limit / MIB,
        shipped.conntrack_max,
        peak_cold / MIB,
        maps_cold / MIB,
        charged_idle / MIB,
        peak_warm / MIB,
        maps_warm / MIB,
        test_start.elapsed()
    );
    // Headroom: both peaks stay under 85% of the limit (more objects per Service, a bigger
    // parse, a slower allocator release all fit).
    for (what, peak) in [("cold start", peak_cold), ("restart", peak_warm)] {
        assert!(
            peak <= limit / 100 * 85,
            "{what}: peak {} MiB leaves less than 15% headroom under {} MiB",
            peak / MIB,
            limit / MIB
        );
    }
    // The probes never kill a start: /livez first answers well inside the startup
    // probe's budget, and no later silence comes near the liveness probe's window.
    for (what, l) in [("cold start", &live_cold), ("restart", &live_warm)] {
        assert!(
            l.first < shipped.startup_budget * 3 / 4 && l.longest_gap < shipped.liveness_window / 2,
            "{what}: /livez {l:?} against a startup budget of {:?} and a liveness window of {:?}",
            shipped.startup_budget,
            shipped.liveness_window
        );
    }
    // SIGTERM finishes well inside the grace period.
    for took in [stop_took, stop_warm] {
        assert!(
            took < shipped.grace / 2,
            "SIGTERM took {took:?}, grace period {:?}",
            shipped.grace
        );
    }
}

/// Maps whose memory is allocated when they are created.
const PREALLOCATED: [&str; 5] = ["CT4", "CT6", "SOCK_REVNAT4", "SOCK_REVNAT6", "AFFINITY"];

fn support_map_memory(env: &TestEnv) -> Vec<proxy_user::loader::MapMemory> {
    proxy_user::loader::map_memory(&env.pins.path)
}
