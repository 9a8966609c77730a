//! `cargo xtask bench --api`: the control plane over the Kubernetes API, the path every
//! cluster uses. The fake kube-apiserver of `proxy-testbed` (paged lists like
//! kube-apiserver's, watches with bookmarks) runs in this process on 127.0.0.1; the real
//! `proxy-agent run --kubeconfig` runs in this machine's network namespace with
//! `--interfaces none --cleanup-kube-proxy=false`, its own bpffs pin directory and its own
//! empty child cgroup (no process joins it: no traffic goes through the bench's hooks).
//!
//! Per N (Services x 10 endpoints, one TCP port each):
//! - **program**: the objects are in the apiserver before the agent starts; timed from the
//!   first byte of the first list page (Services or EndpointSlices, whichever is first) to
//!   the agent's `programmed_frontends` gauge reaching N (the gauge is set after the sync's
//!   map writes), and from the process start to `/healthz` 200;
//! - **memory and CPU**: VmRSS and VmHWM once programmed, CPU time over an idle window;
//! - **changes**: `changes` single endpoint changes, one at a time, spaced past the
//!   agent's minimum sync interval: the agent's `network_programming_duration_seconds`
//!   for each (from its histogram's sum, when exactly one observation was added), and the
//!   time from the apiserver accepting the write to the agent reporting it written;
//! - **restart**: SIGTERM, then a new agent on the same pins: time to healthy and the map
//!   writes of its first sync (the `ops` of its `sync` debug log line);
//! - **side by side** (N within the datapath bench's address plan): the manifests path
//!   (the same agent with `--manifests`), and kube-proxy's iptables (nft backend) and
//!   nftables rule loads at the same N, through the datapath bench's modes.
//!
//! `--nodes K`: K agents against one apiserver holding `churn_services` Services; after all
//! are healthy, endpoint changes at `churn_rate` per second for `churn_secs`, each adding a
//! fresh endpoint address to one Service, so every agent's `programmed_backends` gauge
//! rises by one per change written. A poller thread per agent reads its `/metrics`; a
//! change is "on all K agents" at the first poll of the last agent that shows it. Reported:
//! p50/p90/p99 of apiserver-accepted -> written on all K, and watch bytes per change (all
//! K watches together, bookmarks included).
//!
//! Over 600 lines: one bench part, its five measurements (list, change under a watch,
//! restart on pins, memory, K agents) over one shared fake-apiserver set-up; splitting
//! it per measurement is the next step when it grows.

use std::{
    collections::BTreeMap,
    fs,
    net::Ipv4Addr,
    path::{Path, PathBuf},
    process::{Child, Command, Stdio},
    sync::{
        atomic::{AtomicBool, Ordering},
        Arc, Mutex,
    },
    time::{Duration, Instant, SystemTime, UNIX_EPOCH},
};

use anyhow::{bail, Context as _, Result};
use proxy_testbed::apiserver::FakeApiServer;
use serde::{Deserialize, Serialize};
use serde_json::{json, Value};

use super::{
    log,
    modes::{self, metric, Ctx, Mode},
    plan, report, stats, topo,
};

/// Endpoints per Service.
const ENDPOINTS: usize = 10;
/// Where the objects' node name points (this agent's `--node-name`).
const NODE: &str = "bench-node";
/// Spacing of the single changes: past the agent's default `--min-sync-interval` (50 ms),
/// so each change is synced on its own.
const CHANGE_SPACING: Duration = Duration::from_millis(60);

/// What one `--api` run does.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct ApiConfig {
    pub quick: bool,
    pub scales: Vec<usize>,
    pub changes: usize,
    pub idle_secs: f64,
    pub side_by_side: bool,
    pub nodes: Vec<usize>,
    pub churn_services: usize,
    pub churn_rate: f64,
    pub churn_secs: f64,
    /// The poller interval with a few agents; with K agents max(this, K / 3) ms, so the
    /// pollers do not load the two CPUs more than the agents.
    pub poll_ms: u64,
    pub program_limit_secs: f64,
    /// The bound for the side-by-side modes; a mode over it is not run at larger N.
    pub side_limit_secs: f64,
    /// Whether this bench (and so the fake apiserver serving the lists) was built with
    /// optimizations (`cargo run --release -p xtask`); unoptimized, the apiserver's JSON
    /// encoding slows the list pages down at large N.
    pub optimized: bool,
}

impl ApiConfig {
    pub fn new(
        quick: bool,
        scales: Option<Vec<usize>>,
        nodes: Option<Vec<usize>>,
        side_by_side: bool,
    ) -> Result<Self> {
        let scales = scales.unwrap_or_else(|| {
            if quick {
                vec![1000]
            } else {
                vec![1000, 10_000, 50_000, 100_000]
            }
        });
        if scales.iter().any(|n| *n == 0 || *n > 400_000) {
            bail!("--services: each between 1 and 400,000 with --api");
        }
        let nodes = nodes.unwrap_or_else(|| if quick { vec![2] } else { vec![1, 10, 30] });
        if nodes.iter().any(|k| *k > 64) {
            bail!("--nodes: at most 64 agents");
        }
        Ok(Self {
            quick,
            scales,
            changes: if quick { 20 } else { 200 },
            idle_secs: if quick { 1.0 } else { 5.0 },
            side_by_side,
            nodes,
            churn_services: if quick { 1000 } else { 10_000 },
            churn_rate: if quick { 20.0 } else { 50.0 },
            churn_secs: if quick { 2.0 } else { 10.0 },
            poll_ms: 5,
            program_limit_secs: if quick { 60.0 } else { 600.0 },
            side_limit_secs: if quick { 60.0 } else { 120.0 },
            optimized: !cfg!(debug_assertions),
        })
    }
}

/// A distribution in milliseconds.
#[derive(Clone, Debug, Default, Serialize, Deserialize)]
pub struct Dist {
    pub count: usize,
    pub p50_ms: f64,
    pub p90_ms: f64,
    pub p99_ms: f64,
    pub max_ms: f64,
}

impl Dist {
    fn from_secs(samples: &[f64]) -> Option<Self> {
        let mut ms: Vec<f64> = samples.iter().map(|s| s * 1e3).collect();
        ms.sort_by(f64::total_cmp);
        let p = |q| stats::percentile(&ms, q);
        Some(Self {
            count: ms.len(),
            p50_ms: p(50.0)?,
            p90_ms: p(90.0)?,
            p99_ms: p(99.0)?,
            max_ms: *ms.last()?,
        })
    }
}

/// One scale's figures.
#[derive(Clone, Debug, Default, Serialize, Deserialize)]
pub struct ApiScale {
    pub services: usize,
    /// First list byte -> all frontends in the maps (s).
    pub list_to_programmed_secs: Option<f64>,
    /// Process start -> `/healthz` 200 (s).
    pub start_to_healthy_secs: Option<f64>,
    /// Process start -> all frontends in the maps (s).
    pub start_to_programmed_secs: Option<f64>,
    /// List pages served (Services + EndpointSlices).
    pub list_pages: usize,
    pub rss_mib: Option<f64>,
    pub hwm_mib: Option<f64>,
    /// CPU used at rest, as a share of one CPU (%).
    pub idle_cpu_percent: Option<f64>,
    /// The agent's `network_programming_duration_seconds` per change.
    pub change_agent: Option<Dist>,
    /// Apiserver accepted -> the agent reports the change written.
    pub change_visible: Option<Dist>,
    /// Changes whose own observation could not be told apart (a periodic resync between).
    pub changes_unattributed: usize,
    pub restart_to_healthy_secs: Option<f64>,
    /// Restart: the first list page served to the new agent -> `/healthz` 200 (s).
    #[serde(default)]
    pub restart_list_to_healthy_secs: Option<f64>,
    /// Restart: the last list page served to the new agent -> `/healthz` 200 (s): the
    /// agent's own work once the lists have arrived.
    #[serde(default)]
    pub restart_last_page_to_healthy_secs: Option<f64>,
    /// The restarted agent's VmHWM once healthy (MiB): its lists are read while it
    /// adopts the pins, so both are held at once.
    #[serde(default)]
    pub restart_hwm_mib: Option<f64>,
    /// Map writes of the first sync after the restart (0 = adopted as pinned).
    pub restart_map_writes: Option<u64>,
    /// The same N through the other paths: mode name -> programming seconds (None: did
    /// not finish in the bound, or not run).
    pub side_by_side: BTreeMap<String, Option<f64>>,
    /// The manifests agent's VmRSS at the same N.
    pub manifests_rss_mib: Option<f64>,
    pub errors: Vec<String>,
}

/// One `--nodes K` run.
#[derive(Clone, Debug, Default, Serialize, Deserialize)]
pub struct NodesRun {
    pub agents: usize,
    pub services: usize,
    pub changes: usize,
    pub rate_per_sec: f64,
    /// Apiserver accepted -> written on all K agents.
    pub cluster: Option<Dist>,
    /// Changes not seen on every agent within the bound.
    pub missing: usize,
    pub watch_bytes_per_change: Option<f64>,
    pub poll_ms: u64,
    /// All K agents healthy after start (s).
    pub start_to_all_healthy_secs: Option<f64>,
    pub rss_mib_per_agent: Option<f64>,
    pub errors: Vec<String>,
}

#[derive(Clone, Debug, Default, Serialize, Deserialize)]
pub struct ApiResults {
    pub config: Option<ApiConfig>,
    pub machine: BTreeMap<String, String>,
    pub started_unix: u64,
    pub scales: Vec<ApiScale>,
    pub nodes: Vec<NodesRun>,
}

// ---------------------------------------------------------------------------------

/// Service `i`'s ClusterIP (10.96.0.16 + i, inside 10.96.0.0/12).
fn vip(i: usize) -> Ipv4Addr {
    Ipv4Addr::from(u32::from(Ipv4Addr::new(10, 96, 0, 16)) + i as u32)
}

/// Service `i`'s endpoint `e` (10.128.0.0/9; never answered: no traffic in this bench).
fn endpoint(i: usize, e: usize) -> Ipv4Addr {
    Ipv4Addr::from(u32::from(Ipv4Addr::new(10, 128, 0, 0)) + (i * ENDPOINTS + e) as u32)
}

/// A fresh endpoint address for change `j` (10.200.0.0/14, used by nothing else).
fn fresh(j: usize) -> Ipv4Addr {
    Ipv4Addr::from(u32::from(Ipv4Addr::new(10, 200, 0, 0)) + j as u32)
}

fn name(i: usize) -> String {
    format!("s{i:06}")
}

fn service_obj(i: usize) -> Value {
    json!({
        "apiVersion": "v1", "kind": "Service",
        "metadata": {"namespace": plan::NAMESPACE, "name": name(i)},
        "spec": {"type": "ClusterIP", "clusterIP": vip(i).to_string(), "clusterIPs": [vip(i).to_string()],
                 "ports": [{"name": "http", "protocol": "TCP", "port": 80, "targetPort": 8080}]}
    })
}

fn slice_obj(i: usize, endpoints: &[Ipv4Addr]) -> Value {
    let eps: Vec<Value> = endpoints
        .iter()
        .map(|a| json!({"addresses": [a.to_string()], "conditions": {"ready": true}, "nodeName": NODE}))
        .collect();
    json!({
        "apiVersion": "discovery.k8s.io/v1", "kind": "EndpointSlice",
        "metadata": {"namespace": plan::NAMESPACE, "name": format!("{}-abcde", name(i)),
                     "labels": {"kubernetes.io/service-name": name(i)}},
        "addressType": "IPv4",
        "ports": [{"name": "http", "protocol": "TCP", "port": 8080}],
        "endpoints": eps
    })
}

fn base_endpoints(i: usize) -> Vec<Ipv4Addr> {
    (0..ENDPOINTS).map(|e| endpoint(i, e)).collect()
}

/// An apiserver holding `n` Services with their slices and this node; its history
/// compacted (the agent lists at the newest version anyway).
fn loaded_apiserver(n: usize) -> FakeApiServer {
    let api = FakeApiServer::start();
    api.apply(json!({"apiVersion": "v1", "kind": "Node", "metadata": {"name": NODE}}));
    const BATCH: usize = 5000;
    for start in (0..n).step_by(BATCH) {
        api.apply_many(
            (start..(start + BATCH).min(n))
                .flat_map(|i| [service_obj(i), slice_obj(i, &base_endpoints(i))]),
        );
    }
    api.expire_history();
    api
}

// ---------------------------------------------------------------------------------

/// A `proxy-agent run --kubeconfig` process; stopped (pins removed) on drop.
struct ApiAgent {
    child: Option<Child>,
    bin: PathBuf,
    pin_path: PathBuf,
    cgroup: PathBuf,
    kubeconfig: PathBuf,
    healthz: u16,
    metrics: u16,
    log: PathBuf,
    started: Instant,
}

impl ApiAgent {
    fn start(
        bin_dir: &Path,
        kubeconfig: &Path,
        pin_path: &Path,
        cgroup: &Path,
        log: &Path,
    ) -> Result<Self> {
        let mut agent = Self {
            child: None,
            bin: bin_dir.join("proxy-agent"),
            pin_path: pin_path.to_path_buf(),
            cgroup: cgroup.to_path_buf(),
            kubeconfig: kubeconfig.to_path_buf(),
            healthz: 0,
            metrics: 0,
            log: log.to_path_buf(),
            started: Instant::now(),
        };
        agent.spawn()?;
        Ok(agent)
    }

    /// Starts the process (a fresh log, fresh ports).
    fn spawn(&mut self) -> Result<()> {
        let [healthz, metrics] = topo::free_ports();
        let out = fs::File::create(&self.log).with_context(|| format!("{}", self.log.display()))?;
        self.started = Instant::now();
        let child = Command::new(&self.bin)
            .arg("run")
            .arg("--kubeconfig")
            .arg(&self.kubeconfig)
            .arg("--pin-path")
            .arg(&self.pin_path)
            .arg("--cgroup")
            .arg(&self.cgroup)
            .args(["--node-name", NODE])
            // This machine's own namespace: never its interfaces, never its iptables.
            .args(["--interfaces", "none", "--cleanup-kube-proxy=false"])
            .args(["--healthz-addr", &format!("127.0.0.1:{healthz}")])
            .args(["--metrics-addr", &format!("127.0.0.1:{metrics}")])
            // The `sync` lines (with their map write counts) and warnings.
            // `BENCH_AGENT_LOG` adds to it (a profile's timestamps: `proxy_user=info`).
            .env(
                "RUST_LOG",
                match std::env::var("BENCH_AGENT_LOG") {
                    Ok(more) if !more.is_empty() => {
                        format!("warn,proxy_user::agent::sync=debug,{more}")
                    }
                    _ => "warn,proxy_user::agent::sync=debug".to_string(),
                },
            )
            .stdout(out.try_clone()?)
            .stderr(out)
            .spawn()
            .context("starting proxy-agent")?;
        self.child = Some(child);
        (self.healthz, self.metrics) = (healthz, metrics);
        Ok(())
    }

    fn pid(&self) -> u32 {
        self.child.as_ref().map_or(0, Child::id)
    }

    fn check_alive(&mut self) -> Result<()> {
        if let Some(c) = self.child.as_mut() {
            if let Some(status) = c.try_wait()? {
                bail!("proxy-agent exited ({status}):\n{}", self.log_tail());
            }
        }
        Ok(())
    }

    fn log_tail(&self) -> String {
        let log = fs::read_to_string(&self.log).unwrap_or_default();
        let lines: Vec<&str> = log.lines().collect();
        lines[lines.len().saturating_sub(20)..].join("\n")
    }

    /// Waits for `/healthz` 200; returns the time since the process started.
    fn wait_healthy(&mut self, limit: Duration) -> Result<Duration> {
        loop {
            if matches!(topo::http_get(self.healthz, "/healthz"), Ok((200, _))) {
                return Ok(self.started.elapsed());
            }
            self.check_alive()?;
            if self.started.elapsed() > limit {
                bail!(
                    "proxy-agent not healthy after {limit:?}:\n{}",
                    self.log_tail()
                );
            }
            topo::check_interrupt()?;
            std::thread::sleep(Duration::from_millis(5));
        }
    }

    fn metrics_text(&mut self) -> Result<String> {
        let start = Instant::now();
        loop {
            match topo::http_get(self.metrics, "/metrics") {
                Ok((200, body)) => return Ok(body),
                other => {
                    self.check_alive()?;
                    if start.elapsed() > Duration::from_secs(60) {
                        bail!("proxy-agent /metrics: {other:?}");
                    }
                    std::thread::sleep(Duration::from_millis(10));
                }
            }
        }
    }

    /// Polls `/metrics` until `name` satisfies `done`; the time it first did.
    fn wait_metric(
        &mut self,
        name: &str,
        done: impl Fn(f64) -> bool,
        limit: Duration,
    ) -> Result<Option<Instant>> {
        let start = Instant::now();
        loop {
            let m = self.metrics_text()?;
            if metric(&m, name).is_some_and(&done) {
                return Ok(Some(Instant::now()));
            }
            if start.elapsed() > limit {
                return Ok(None);
            }
            topo::check_interrupt()?;
            std::thread::sleep(Duration::from_millis(1));
        }
    }

    /// (VmRSS, VmHWM) in MiB.
    fn memory_mib(&self) -> (Option<f64>, Option<f64>) {
        let status = fs::read_to_string(format!("/proc/{}/status", self.pid())).unwrap_or_default();
        let field = |f: &str| {
            status
                .lines()
                .find_map(|l| l.strip_prefix(f))
                .and_then(|v| v.split_whitespace().next()?.parse::<f64>().ok())
                .map(|kib| kib / 1024.0)
        };
        (field("VmRSS:"), field("VmHWM:"))
    }

    fn cpu_seconds(&self) -> Option<f64> {
        let stat = fs::read_to_string(format!("/proc/{}/stat", self.pid())).ok()?;
        let rest = stat.rsplit_once(')')?.1;
        let f: Vec<&str> = rest.split_whitespace().collect();
        let ticks: f64 = f.get(11)?.parse::<f64>().ok()? + f.get(12)?.parse::<f64>().ok()?;
        // SAFETY: plain sysconf query.
        let hz = unsafe { libc::sysconf(libc::_SC_CLK_TCK) } as f64;
        Some(ticks / hz)
    }

    /// SIGTERM and wait; the datapath stays pinned.
    fn stop(&mut self) {
        if let Some(mut c) = self.child.take() {
            // SAFETY: signalling our own child by pid.
            unsafe { libc::kill(c.id() as i32, libc::SIGTERM) };
            let deadline = Instant::now() + Duration::from_secs(10);
            while matches!(c.try_wait(), Ok(None)) && Instant::now() < deadline {
                std::thread::sleep(Duration::from_millis(10));
            }
            let _ = c.kill();
            let _ = c.wait();
        }
    }

    /// A new process on the same pins, cgroup and kubeconfig.
    fn restart(&mut self) -> Result<()> {
        self.stop();
        self.spawn()
    }

    /// The `ops` of the first `sync` line in the log.
    fn first_sync_ops(&self) -> Option<u64> {
        let log = fs::read_to_string(&self.log).ok()?;
        log.lines()
            .filter(|l| l.contains(" sync") && l.contains("ops="))
            .find_map(|l| {
                l.split_whitespace()
                    .find_map(|w| w.strip_prefix("ops="))?
                    .parse()
                    .ok()
            })
    }
}

impl Drop for ApiAgent {
    fn drop(&mut self) {
        self.stop();
        let _ = Command::new(&self.bin)
            .args(["uninstall", "--pin-path"])
            .arg(&self.pin_path)
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .status();
    }
}

/// The run's directories: pins, cgroups, logs, kubeconfig; removed on drop.
struct Place {
    dir: topo::TempDir,
    cgroups: Vec<PathBuf>,
    tag: String,
}

impl Place {
    fn new() -> Result<Self> {
        Ok(Self {
            dir: topo::TempDir::new("ebpf-proxy-bench-api-")?,
            cgroups: Vec::new(),
            tag: topo::unique("ebpf-proxy-bench-api-"),
        })
    }

    /// Agent `k`'s pin path and (new, empty) child cgroup.
    fn agent(&mut self, k: usize) -> Result<(PathBuf, PathBuf)> {
        let pins = PathBuf::from("/sys/fs/bpf").join(format!("{}-{k}", self.tag));
        let cgroup = topo::cgroup2_mount().join(format!("{}-{k}", self.tag));
        if !cgroup.exists() {
            fs::create_dir(&cgroup).with_context(|| format!("creating {}", cgroup.display()))?;
            self.cgroups.push(cgroup.clone());
        }
        Ok((pins, cgroup))
    }

    fn kubeconfig(&self, api: &FakeApiServer) -> PathBuf {
        let path = self.dir.0.join("kubeconfig");
        api.write_kubeconfig(&path);
        path
    }
}

impl Drop for Place {
    fn drop(&mut self) {
        for cg in &self.cgroups {
            for _ in 0..50 {
                if fs::remove_dir(cg).is_ok() || !cg.exists() {
                    break;
                }
                std::thread::sleep(Duration::from_millis(100));
            }
        }
    }
}

// ---------------------------------------------------------------------------------

pub fn run(cfg: &ApiConfig, ctx: &Ctx, out_dir: &Path) -> Result<()> {
    let start = Instant::now();
    let mut results = ApiResults {
        config: Some(cfg.clone()),
        machine: super::machine(),
        started_unix: SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map(|d| d.as_secs())
            .unwrap_or(0),
        ..ApiResults::default()
    };
    let mut gave_up = BTreeMap::new();
    for &n in &cfg.scales {
        log(
            start,
            format!("== API: {} services ==", report::thousands(n)),
        );
        let mut scale = ApiScale {
            services: n,
            ..ApiScale::default()
        };
        if let Err(e) = one_scale(cfg, ctx, n, &mut scale, &mut gave_up, start) {
            log(start, format!("  failed: {e:#}"));
            scale.errors.push(format!("{e:#}"));
        }
        results.scales.push(scale);
        save(&results, out_dir)?;
    }
    for &k in &cfg.nodes {
        log(
            start,
            format!(
                "== API: {k} agents, {} services, {} changes/s ==",
                report::thousands(cfg.churn_services),
                cfg.churn_rate
            ),
        );
        let mut run = NodesRun {
            agents: k,
            services: cfg.churn_services,
            rate_per_sec: cfg.churn_rate,
            poll_ms: cfg.poll_ms.max(k as u64 / 3),
            ..NodesRun::default()
        };
        if let Err(e) = nodes(cfg, ctx, k, &mut run, start) {
            log(start, format!("  failed: {e:#}"));
            run.errors.push(format!("{e:#}"));
        }
        results.nodes.push(run);
        save(&results, out_dir)?;
    }
    let md = markdown(&results);
    println!("{md}");
    log(start, format!("results in {}", out_dir.display()));
    Ok(())
}

fn save(results: &ApiResults, dir: &Path) -> Result<()> {
    fs::create_dir_all(dir)?;
    fs::write(
        dir.join("api-results.json"),
        serde_json::to_string_pretty(results)?,
    )?;
    fs::write(dir.join("api-results.md"), markdown(results))?;
    fs::write(dir.join("api-scaling.svg"), svg(results))?;
    Ok(())
}

fn one_scale(
    cfg: &ApiConfig,
    ctx: &Ctx,
    n: usize,
    scale: &mut ApiScale,
    gave_up: &mut BTreeMap<String, String>,
    start: Instant,
) -> Result<()> {
    let limit = Duration::from_secs_f64(cfg.program_limit_secs);
    let t = Instant::now();
    let api = loaded_apiserver(n);
    log(
        start,
        format!("  apiserver loaded in {:.1} s", t.elapsed().as_secs_f64()),
    );
    let mut place = Place::new()?;
    let (pins, cgroup) = place.agent(0)?;
    let kubeconfig = place.kubeconfig(&api);
    let log_path = place.dir.0.join("agent-0.log");
    api.clear_requests();
    let mut agent = ApiAgent::start(&ctx.bin_dir, &kubeconfig, &pins, &cgroup, &log_path)?;
    let spawned = agent.started;
    let healthy = agent.wait_healthy(limit)?;
    scale.start_to_healthy_secs = Some(healthy.as_secs_f64());
    let programmed = agent
        .wait_metric(
            "ebpf_proxy_programmed_frontends",
            |v| v >= n as f64,
            limit.saturating_sub(healthy),
        )?
        .context("not all frontends programmed in the bound")?;
    let first_list = ["Service", "EndpointSlice"]
        .iter()
        .filter_map(|k| api.list_times(k).first().copied())
        .min()
        .context("no list was served")?;
    scale.list_pages = api.list_times("Service").len() + api.list_times("EndpointSlice").len();
    scale.list_to_programmed_secs = Some(programmed.duration_since(first_list).as_secs_f64());
    scale.start_to_programmed_secs = Some(programmed.duration_since(spawned).as_secs_f64());
    log(
        start,
        format!(
            "  healthy after {:.2} s; first list byte -> {n} frontends {:.3} s ({} pages)",
            healthy.as_secs_f64(),
            scale.list_to_programmed_secs.unwrap_or_default(),
            scale.list_pages
        ),
    );

    // At rest.
    std::thread::sleep(Duration::from_millis(500));
    let cpu0 = agent.cpu_seconds();
    let t = Instant::now();
    std::thread::sleep(Duration::from_secs_f64(cfg.idle_secs));
    let cpu1 = agent.cpu_seconds();
    if let (Some(a), Some(b)) = (cpu0, cpu1) {
        scale.idle_cpu_percent = Some((b - a) / t.elapsed().as_secs_f64() * 100.0);
    }
    (scale.rss_mib, scale.hwm_mib) = agent.memory_mib();
    log(
        start,
        format!(
            "  VmRSS {:.1} MiB, VmHWM {:.1} MiB, CPU at rest {:.2} %",
            scale.rss_mib.unwrap_or_default(),
            scale.hwm_mib.unwrap_or_default(),
            scale.idle_cpu_percent.unwrap_or_default()
        ),
    );

    // Single endpoint changes.
    let name = "ebpf_proxy_network_programming_duration_seconds";
    let (mut agent_secs, mut visible_secs) = (Vec::new(), Vec::new());
    for j in 0..cfg.changes {
        topo::check_interrupt()?;
        let i = (j * 7919 + n / 2) % n;
        let mut eps = base_endpoints(i);
        eps[j % ENDPOINTS] = fresh(j);
        let m = agent.metrics_text()?;
        let (sum0, count0) = (
            metric(&m, &format!("{name}_sum")).unwrap_or(0.0),
            metric(&m, &format!("{name}_count")).unwrap_or(0.0),
        );
        api.apply(slice_obj(i, &eps));
        let accepted = Instant::now();
        let Some(seen) = agent.wait_metric(
            &format!("{name}_count"),
            |c| c > count0,
            Duration::from_secs(30),
        )?
        else {
            scale
                .errors
                .push(format!("change {j} not reported in 30 s"));
            continue;
        };
        visible_secs.push(seen.duration_since(accepted).as_secs_f64());
        let m = agent.metrics_text()?;
        let (sum1, count1) = (
            metric(&m, &format!("{name}_sum")).unwrap_or(0.0),
            metric(&m, &format!("{name}_count")).unwrap_or(0.0),
        );
        if count1 == count0 + 1.0 {
            agent_secs.push(sum1 - sum0);
        } else {
            scale.changes_unattributed += 1;
        }
        std::thread::sleep(CHANGE_SPACING);
    }
    scale.change_agent = Dist::from_secs(&agent_secs);
    scale.change_visible = Dist::from_secs(&visible_secs);
    if let (Some(a), Some(v)) = (&scale.change_agent, &scale.change_visible) {
        log(
            start,
            format!(
                "  {} changes: agent p50 {:.2} ms p99 {:.2} ms; accepted -> written p50 {:.2} ms p99 {:.2} ms",
                v.count, a.p50_ms, a.p99_ms, v.p50_ms, v.p99_ms
            ),
        );
    }

    // Restart on the pins.
    agent.stop();
    api.clear_requests();
    agent.restart()?;
    let healthy = agent.wait_healthy(limit)?;
    let healthy_at = Instant::now();
    scale.restart_to_healthy_secs = Some(healthy.as_secs_f64());
    scale.restart_map_writes = agent.first_sync_ops();
    let pages: Vec<Instant> = ["Service", "EndpointSlice"]
        .iter()
        .flat_map(|k| api.list_times(k))
        .filter(|t| *t <= healthy_at)
        .collect();
    let since = |t: Option<&Instant>| t.map(|t| healthy_at.duration_since(*t).as_secs_f64());
    scale.restart_list_to_healthy_secs = since(pages.iter().min());
    scale.restart_last_page_to_healthy_secs = since(pages.iter().max());
    scale.restart_hwm_mib = agent.memory_mib().1;
    log(
        start,
        format!(
            "  restart on the pins: healthy after {:.2} s ({:.2} s after the first list page, {:.2} s after the last), {:?} map writes, VmHWM {:.1} MiB",
            healthy.as_secs_f64(),
            scale.restart_list_to_healthy_secs.unwrap_or_default(),
            scale.restart_last_page_to_healthy_secs.unwrap_or_default(),
            scale.restart_map_writes,
            scale.restart_hwm_mib.unwrap_or_default()
        ),
    );
    if std::env::var_os("BENCH_AGENT_LOG").is_some() {
        // The restarted agent's log, kept for its timestamps (the run's directory goes).
        let keep = std::env::temp_dir().join(format!("bench-api-agent-{n}.log"));
        if fs::copy(&log_path, &keep).is_ok() {
            log(start, format!("  agent log kept at {}", keep.display()));
        }
    }
    drop(agent);
    drop(api);

    if cfg.side_by_side {
        let side_limit = Duration::from_secs_f64(cfg.side_limit_secs);
        side_by_side(ctx, n, scale, side_limit, gave_up, start);
    }
    Ok(())
}

/// The manifests path and kube-proxy's rule loads at the same N (within the datapath
/// bench's address plan).
fn side_by_side(
    ctx: &Ctx,
    n: usize,
    scale: &mut ApiScale,
    limit: Duration,
    gave_up: &mut BTreeMap<String, String>,
    start: Instant,
) {
    if n > plan::MAX_SERVICES {
        scale.errors.push(format!(
            "side by side: {} services exceed the datapath bench's address plan ({})",
            report::thousands(n),
            report::thousands(plan::MAX_SERVICES)
        ));
        return;
    }
    let services = plan::services(n, false);
    let mut others: Vec<Box<dyn Mode>> = vec![
        Box::new(modes::Socket::default()),
        Box::new(modes::Iptables::new(modes::IptablesVariant::Nft)),
        Box::new(modes::Nftables::default()),
    ];
    for mode in &mut others {
        let label = match mode.name() {
            "socket" => "manifests".to_string(),
            other => other.to_string(),
        };
        if let Some(why) = gave_up.get(&label) {
            scale.errors.push(format!("{label}: not run ({why})"));
            continue;
        }
        if let Err(why) = mode.setup(ctx) {
            scale.errors.push(format!("{label}: not available: {why}"));
            continue;
        }
        match mode.program(ctx, &services, limit) {
            Ok(t) => {
                let secs = t.map(|t| t.seconds);
                log(start, format!("  {label}: {secs:?} s"));
                if secs.is_none() {
                    gave_up.insert(
                        label.clone(),
                        format!(
                            "over the {:.0} s bound at {}",
                            limit.as_secs_f64(),
                            report::thousands(n)
                        ),
                    );
                }
                scale.side_by_side.insert(label.clone(), secs);
                if label == "manifests" {
                    scale.manifests_rss_mib = mode.agent().and_then(|a| a.rss_mib);
                }
            }
            Err(e) => scale.errors.push(format!("{label}: {e:#}")),
        }
        if let Err(e) = mode.clear(ctx) {
            scale.errors.push(format!("{label}: clear: {e:#}"));
        }
    }
}

/// One poller's samples: when the agent's backends gauge took each new value.
type Samples = Arc<Mutex<Vec<(Instant, f64)>>>;

/// One plotted line: label, colour, points (N, value), panel.
type Line<'a> = (&'a str, &'a str, Vec<(f64, f64)>, usize);

/// `--nodes K` (see the module documentation).
fn nodes(cfg: &ApiConfig, ctx: &Ctx, k: usize, run: &mut NodesRun, start: Instant) -> Result<()> {
    let n = cfg.churn_services;
    let limit = Duration::from_secs_f64(cfg.program_limit_secs);
    let api = loaded_apiserver(n);
    let mut place = Place::new()?;
    let kubeconfig = place.kubeconfig(&api);
    let mut agents = Vec::new();
    let t = Instant::now();
    for a in 0..k {
        let (pins, cgroup) = place.agent(a)?;
        let log_path = place.dir.0.join(format!("agent-{a}.log"));
        agents.push(ApiAgent::start(
            &ctx.bin_dir,
            &kubeconfig,
            &pins,
            &cgroup,
            &log_path,
        )?);
    }
    for agent in &mut agents {
        agent.wait_healthy(limit)?;
    }
    let want = (n * ENDPOINTS) as f64;
    for agent in &mut agents {
        agent
            .wait_metric("ebpf_proxy_programmed_backends", |v| v >= want, limit)?
            .context("backends not all programmed")?;
    }
    run.start_to_all_healthy_secs = Some(t.elapsed().as_secs_f64());
    let rss: Vec<f64> = agents.iter().filter_map(|a| a.memory_mib().0).collect();
    run.rss_mib_per_agent = stats::median(&rss);
    log(
        start,
        format!(
            "  {k} agents programmed in {:.1} s, VmRSS {:.0} MiB each",
            t.elapsed().as_secs_f64(),
            run.rss_mib_per_agent.unwrap_or_default()
        ),
    );

    // Pollers: per agent, when its backends gauge first reached each value.
    let stop = Arc::new(AtomicBool::new(false));
    let seen: Vec<Samples> = (0..k).map(|_| Arc::new(Mutex::new(Vec::new()))).collect();
    let mut threads = Vec::new();
    for (agent, seen) in agents.iter().zip(&seen) {
        let (port, stop, seen, poll) = (
            agent.metrics,
            stop.clone(),
            seen.clone(),
            Duration::from_millis(cfg.poll_ms.max(k as u64 / 3)),
        );
        threads.push(std::thread::spawn(move || {
            let mut last = -1.0;
            while !stop.load(Ordering::Relaxed) {
                if let Ok((200, body)) = topo::http_get(port, "/metrics") {
                    if let Some(v) = metric(&body, "ebpf_proxy_programmed_backends") {
                        if v != last {
                            last = v;
                            if let Ok(mut s) = seen.lock() {
                                s.push((Instant::now(), v));
                            }
                        }
                    }
                }
                std::thread::sleep(poll);
            }
        }));
    }

    let changes = (cfg.churn_rate * cfg.churn_secs).round() as usize;
    run.changes = changes;
    let bytes0 = api.watch_bytes();
    let spacing = Duration::from_secs_f64(1.0 / cfg.churn_rate);
    let mut accepted = Vec::with_capacity(changes);
    let churn_start = Instant::now();
    for j in 0..changes {
        let due = churn_start + spacing * j as u32;
        if let Some(wait) = due.checked_duration_since(Instant::now()) {
            std::thread::sleep(wait);
        }
        // A fresh 11th endpoint: every agent's distinct backends rise by one.
        let i = (j * 7919 + 1) % n;
        let mut eps = base_endpoints(i);
        eps.push(fresh(j));
        api.apply(slice_obj(i, &eps));
        accepted.push(Instant::now());
    }
    // Wait until every agent has every change (or the bound).
    let target = want + changes as f64;
    let deadline = Instant::now() + Duration::from_secs(60);
    while Instant::now() < deadline
        && !seen.iter().all(|s| {
            s.lock()
                .map(|v| v.last().is_some_and(|(_, b)| *b >= target))
                .unwrap_or(false)
        })
    {
        std::thread::sleep(Duration::from_millis(20));
    }
    // Let the last bookmarks of the churn window pass before counting bytes.
    let bytes = api.watch_bytes() - bytes0;
    stop.store(true, Ordering::Relaxed);
    for t in threads {
        let _ = t.join();
    }
    run.watch_bytes_per_change = Some(bytes as f64 / changes.max(1) as f64);

    // Change j is on an agent from its first sample with backends >= want + j + 1 (a
    // change may also have re-used an address of an earlier one: none here, all fresh).
    let mut latencies = Vec::new();
    for (j, at) in accepted.iter().enumerate() {
        let need = want + (j + 1) as f64;
        let mut worst: Option<Instant> = None;
        let mut everywhere = true;
        for s in &seen {
            let s = s.lock().map(|v| v.clone()).unwrap_or_default();
            match s.iter().find(|(_, b)| *b >= need) {
                Some((t, _)) => worst = Some(worst.map_or(*t, |w| w.max(*t))),
                None => everywhere = false,
            }
        }
        match worst {
            Some(w) if everywhere => latencies.push(w.saturating_duration_since(*at).as_secs_f64()),
            _ => run.missing += 1,
        }
    }
    run.cluster = Dist::from_secs(&latencies);
    if let Some(d) = &run.cluster {
        log(
            start,
            format!(
                "  {changes} changes: accepted -> on all {k}: p50 {:.1} ms p90 {:.1} ms p99 {:.1} ms; {:.0} watch bytes per change",
                d.p50_ms,
                d.p90_ms,
                d.p99_ms,
                run.watch_bytes_per_change.unwrap_or_default()
            ),
        );
    }
    drop(agents);
    Ok(())
}

// ---------------------------------------------------------------------------------

fn f(v: Option<f64>, decimals: usize) -> String {
    v.map_or("-".into(), |v| format!("{v:.decimals$}"))
}

pub fn markdown(r: &ApiResults) -> String {
    let mut md = String::from("## Control plane over the API (`cargo xtask bench --api`)\n\n");
    if let Some(c) = &r.config {
        md += &format!(
            "{} run; bench (and fake apiserver) built {}; {} single changes per N; machine: {} CPUs, {} MiB.\n\n",
            if c.quick { "Quick" } else { "Full" },
            if c.optimized { "with optimizations" } else { "without optimizations (list pages are served slower)" },
            c.changes,
            r.machine.get("nproc").map_or("?", String::as_str),
            r.machine.get("mem_mib").map_or("?", String::as_str),
        );
    }
    md += "| Services x 10 | first list byte -> all frontends (s) | start -> /healthz 200 (s) | list pages | VmRSS (MiB) | VmHWM (MiB) | CPU at rest (%) | change, agent p50 / p99 (ms) | change, accepted -> written p50 / p99 (ms) | restart on pins -> healthy (s) | restart, first / last list page -> healthy (s) | map writes on restart |\n";
    md += "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|\n";
    for s in &r.scales {
        let d = |d: &Option<Dist>| {
            d.as_ref().map_or("-".into(), |d| {
                format!("{:.2} / {:.2} (n={})", d.p50_ms, d.p99_ms, d.count)
            })
        };
        md += &format!(
            "| {} | {} | {} | {} | {} | {} | {} | {} | {} | {} | {} / {} | {} |\n",
            report::thousands(s.services),
            f(s.list_to_programmed_secs, 3),
            f(s.start_to_healthy_secs, 2),
            s.list_pages,
            f(s.rss_mib, 1),
            f(s.hwm_mib, 1),
            f(s.idle_cpu_percent, 2),
            d(&s.change_agent),
            d(&s.change_visible),
            f(s.restart_to_healthy_secs, 2),
            f(s.restart_list_to_healthy_secs, 2),
            f(s.restart_last_page_to_healthy_secs, 2),
            s.restart_map_writes.map_or("-".into(), |w| w.to_string()),
        );
    }
    let names: Vec<String> = {
        let mut v: Vec<String> = r
            .scales
            .iter()
            .flat_map(|s| s.side_by_side.keys().cloned())
            .collect();
        v.sort();
        v.dedup();
        v
    };
    if !names.is_empty() {
        md += "\n### Programming N Services from nothing, side by side (s)\n\n| Services x 10 | API (first list byte -> all frontends) |";
        for n in &names {
            md += &format!(" {n} |");
        }
        md += " VmRSS API / manifests (MiB) |\n|---:|---:|";
        md += &"---:|".repeat(names.len() + 1);
        md += "\n";
        for s in &r.scales {
            md += &format!(
                "| {} | {} |",
                report::thousands(s.services),
                f(s.list_to_programmed_secs, 3)
            );
            let bound = r.config.as_ref().map_or(0.0, |c| c.side_limit_secs);
            for n in &names {
                md += &match s.side_by_side.get(n) {
                    Some(Some(secs)) => format!(" {secs:.3} |"),
                    Some(None) => format!(" > {bound:.0} |"),
                    None => " - |".into(),
                };
            }
            md += &format!(" {} / {} |\n", f(s.rss_mib, 1), f(s.manifests_rss_mib, 1));
        }
    }
    if !r.nodes.is_empty() {
        md += "\n### Cluster-wide network programming latency (`--nodes K`)\n\n| agents | Services x 10 | changes (rate/s) | accepted -> written on all agents p50 / p90 / p99 (ms) | missing | watch bytes per change (all agents) | VmRSS per agent (MiB) | poll interval (ms) |\n|---:|---:|---:|---:|---:|---:|---:|---:|\n";
        for n in &r.nodes {
            md += &format!(
                "| {} | {} | {} ({}) | {} | {} | {} | {} | {} |\n",
                n.agents,
                report::thousands(n.services),
                n.changes,
                n.rate_per_sec,
                n.cluster.as_ref().map_or("-".into(), |d| format!(
                    "{:.1} / {:.1} / {:.1}",
                    d.p50_ms, d.p90_ms, d.p99_ms
                )),
                n.missing,
                f(n.watch_bytes_per_change, 0),
                f(n.rss_mib_per_agent, 0),
                n.poll_ms
            );
        }
    }
    let errors: Vec<String> = r
        .scales
        .iter()
        .flat_map(|s| {
            s.errors.iter().map(move |e| {
                let e = e.lines().take(2).collect::<Vec<_>>().join(" ");
                format!("- {}: {e}", report::thousands(s.services))
            })
        })
        .chain(r.nodes.iter().flat_map(|n| {
            n.errors
                .iter()
                .map(move |e| format!("- {} agents: {e}", n.agents))
        }))
        .collect();
    if !errors.is_empty() {
        md += "\nNotes and errors:\n\n";
        md += &errors.join("\n");
        md += "\n";
    }
    md
}

/// Two log-log panels: programming time and VmRSS against N.
pub fn svg(r: &ApiResults) -> String {
    let mut series: Vec<Line> = Vec::new();
    let pts = |f: &dyn Fn(&ApiScale) -> Option<f64>| -> Vec<(f64, f64)> {
        r.scales
            .iter()
            .filter_map(|s| Some((s.services as f64, f(s)?)))
            .filter(|(_, v)| *v > 0.0)
            .collect()
    };
    series.push((
        "API (list -> frontends)",
        "#d62728",
        pts(&|s| s.list_to_programmed_secs),
        0,
    ));
    for (name, colour) in [
        ("manifests", "#ff7f0e"),
        ("iptables-nft", "#1f77b4"),
        ("nftables", "#2ca02c"),
    ] {
        series.push((
            name,
            colour,
            pts(&|s| s.side_by_side.get(name).copied().flatten()),
            0,
        ));
    }
    series.push(("API VmRSS", "#d62728", pts(&|s| s.rss_mib), 1));
    series.push(("API VmHWM", "#9467bd", pts(&|s| s.hwm_mib), 1));
    series.push((
        "manifests VmRSS",
        "#ff7f0e",
        pts(&|s| s.manifests_rss_mib),
        1,
    ));
    let (w, h, pw) = (1200.0, 520.0, 560.0);
    let mut out = format!(
        r#"<svg xmlns="http://www.w3.org/2000/svg" width="{w}" height="{h}" font-family="sans-serif" font-size="13"><rect width="100%" height="100%" fill="white"/>"#
    );
    for (panel, title, unit) in [
        (
            0,
            "Programming N Services x 10 endpoints from nothing",
            "seconds",
        ),
        (1, "Agent memory after programming", "MiB"),
    ] {
        let ox = 20.0 + panel as f64 * (pw + 40.0);
        let (left, top, pwid, phei) = (ox + 60.0, 40.0, pw - 80.0, h - 120.0);
        let data: Vec<&Line> = series
            .iter()
            .filter(|s| s.3 == panel && !s.2.is_empty())
            .collect();
        let xs: Vec<f64> = data.iter().flat_map(|s| s.2.iter().map(|p| p.0)).collect();
        let ys: Vec<f64> = data.iter().flat_map(|s| s.2.iter().map(|p| p.1)).collect();
        let range = |v: &[f64]| {
            let lo = v.iter().copied().fold(f64::MAX, f64::min);
            let hi = v.iter().copied().fold(f64::MIN, f64::max);
            if lo > hi {
                (0.0, 1.0)
            } else {
                ((lo.log10() - 0.2).floor(), (hi.log10() + 0.2).ceil())
            }
        };
        let (x0, x1) = range(&xs);
        let (y0, y1) = range(&ys);
        let px = |x: f64| left + (x.log10() - x0) / (x1 - x0).max(1e-9) * pwid;
        let py = |y: f64| top + phei - (y.log10() - y0) / (y1 - y0).max(1e-9) * phei;
        out += &format!(
            r##"<text x="{}" y="22" font-size="15" font-weight="bold">{title}</text><rect x="{left}" y="{top}" width="{pwid}" height="{phei}" fill="none" stroke="#888"/>"##,
            ox + 10.0
        );
        for e in (x0 as i32)..=(x1 as i32) {
            let x = px(10f64.powi(e));
            out += &format!(
                r##"<line x1="{x}" y1="{top}" x2="{x}" y2="{}" stroke="#eee"/><text x="{x}" y="{}" text-anchor="middle">{}</text>"##,
                top + phei,
                top + phei + 18.0,
                report::thousands(10usize.pow(e.max(0) as u32))
            );
        }
        for e in (y0 as i32)..=(y1 as i32) {
            let y = py(10f64.powi(e));
            out += &format!(
                r##"<line x1="{left}" y1="{y}" x2="{}" y2="{y}" stroke="#eee"/><text x="{}" y="{}" text-anchor="end">{}</text>"##,
                left + pwid,
                left - 6.0,
                y + 4.0,
                10f64.powi(e)
            );
        }
        out += &format!(
            r#"<text x="{}" y="{}" text-anchor="middle">Services (log scale)</text><text x="{}" y="{}" transform="rotate(-90 {} {})" text-anchor="middle">{unit} (log scale)</text>"#,
            left + pwid / 2.0,
            top + phei + 40.0,
            ox + 14.0,
            top + phei / 2.0,
            ox + 14.0,
            top + phei / 2.0
        );
        for (li, (label, colour, points, _)) in data.iter().enumerate() {
            let path: Vec<String> = points
                .iter()
                .map(|(x, y)| format!("{:.1},{:.1}", px(*x), py(*y)))
                .collect();
            out += &format!(
                r#"<polyline points="{}" fill="none" stroke="{colour}" stroke-width="2.5"/>"#,
                path.join(" ")
            );
            for (x, y) in points {
                out += &format!(
                    r#"<circle cx="{:.1}" cy="{:.1}" r="4" fill="{colour}"/>"#,
                    px(*x),
                    py(*y)
                );
            }
            let ly = h - 50.0 + (li / 2) as f64 * 18.0;
            let lx = left + (li % 2) as f64 * 240.0;
            out += &format!(
                r#"<line x1="{lx}" y1="{ly}" x2="{}" y2="{ly}" stroke="{colour}" stroke-width="3"/><text x="{}" y="{}">{label}</text>"#,
                lx + 24.0,
                lx + 30.0,
                ly + 4.0
            );
        }
    }
    out += "</svg>\n";
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn addresses_stay_in_their_ranges_at_the_largest_scale() {
        let n = 400_000;
        assert_eq!(vip(0), Ipv4Addr::new(10, 96, 0, 16));
        // 10.96.0.0/12 ends at 10.111.255.255.
        assert!(vip(n - 1) < Ipv4Addr::new(10, 112, 0, 0));
        assert_eq!(endpoint(0, 0), Ipv4Addr::new(10, 128, 0, 0));
        assert!(endpoint(n - 1, ENDPOINTS - 1) < Ipv4Addr::new(10, 200, 0, 0));
        assert!(fresh(100_000) < Ipv4Addr::new(10, 204, 0, 0));
    }

    #[test]
    fn objects_are_what_the_agent_reads() {
        let s = service_obj(3);
        assert_eq!(s["spec"]["clusterIP"], "10.96.0.19");
        let e = slice_obj(3, &base_endpoints(3));
        assert_eq!(
            e["metadata"]["labels"]["kubernetes.io/service-name"],
            "s000003"
        );
        assert_eq!(e["endpoints"].as_array().map(Vec::len), Some(ENDPOINTS));
    }

    #[test]
    fn tables_and_plot_render() {
        let r = ApiResults {
            scales: vec![ApiScale {
                services: 1000,
                list_to_programmed_secs: Some(0.2),
                rss_mib: Some(30.0),
                change_agent: Dist::from_secs(&[0.001, 0.002, 0.003]),
                ..ApiScale::default()
            }],
            ..ApiResults::default()
        };
        let md = markdown(&r);
        assert!(md.contains("| 1,000 | 0.200 |"), "{md}");
        assert!(md.contains("2.00 / 3.00 (n=3)"), "{md}");
        assert!(svg(&r).contains("<polyline"));
    }
}
