//! One `proxy-agent run --kubeconfig` process ([`ApiAgent`]: started, polled for health
//! and metrics, measured, restarted on its pins, stopped) and the run's directories
//! ([`Place`]: pins, child cgroups, logs, kubeconfig).

use std::{
    fs,
    path::{Path, PathBuf},
    process::{Child, Command, Stdio},
    time::{Duration, Instant},
};

use anyhow::{bail, Context as _, Result};
use proxy_testbed::apiserver::FakeApiServer;

use super::objects::{ENDPOINTS, NODE};
use crate::bench::{modes::metric, topo};

/// A `proxy-agent run --kubeconfig` process; stopped (pins removed) on drop.
pub(super) struct ApiAgent {
    child: Option<Child>,
    bin: PathBuf,
    pin_path: PathBuf,
    cgroup: PathBuf,
    kubeconfig: PathBuf,
    healthz: u16,
    pub(super) metrics: u16,
    log: PathBuf,
    service_map_entries: u32,
    /// Starts again after losing a port race (`check_alive`).
    respawns: u32,
    pub(super) started: Instant,
}

/// `--service-map-entries` for `services` Services of [`ENDPOINTS`] endpoints: the
/// agent's default while they fit (a Service's frontend takes one entry and one per
/// endpoint), else the next power of two, as an operator sizing a large cluster would.
pub(super) fn service_map_entries(services: usize) -> u32 {
    const DEFAULT: u32 = 1 << 20;
    let needed = services * (1 + ENDPOINTS);
    if needed <= DEFAULT as usize {
        DEFAULT
    } else {
        u32::try_from(needed.next_power_of_two()).unwrap_or(u32::MAX)
    }
}

impl ApiAgent {
    pub(super) fn start(
        bin_dir: &Path,
        kubeconfig: &Path,
        pin_path: &Path,
        cgroup: &Path,
        log: &Path,
        services: usize,
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
            service_map_entries: service_map_entries(services),
            respawns: 0,
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
            .arg("--service-map-entries")
            .arg(self.service_map_entries.to_string())
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
            // `BENCH_AGENT_ARGS`: more flags for every agent of the run (whitespace-
            // separated), e.g. `--min-sync-interval 10ms` to see what the default costs.
            .args(
                std::env::var("BENCH_AGENT_ARGS")
                    .unwrap_or_default()
                    .split_whitespace(),
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
                // The ports were free when picked, but another process (30 agents
                // opening connections from the same ephemeral range) may take one
                // before this agent binds it: start again on fresh ports, the clock
                // from the new start.
                let log = fs::read_to_string(&self.log).unwrap_or_default();
                if self.respawns < 3
                    && log.contains("binding the")
                    && log.contains("Address already in use")
                {
                    self.respawns += 1;
                    return self.spawn();
                }
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
    pub(super) fn wait_healthy(&mut self, limit: Duration) -> Result<Duration> {
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

    pub(super) fn metrics_text(&mut self) -> Result<String> {
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
    pub(super) fn wait_metric(
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
    pub(super) fn memory_mib(&self) -> (Option<f64>, Option<f64>) {
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

    pub(super) fn cpu_seconds(&self) -> Option<f64> {
        let stat = fs::read_to_string(format!("/proc/{}/stat", self.pid())).ok()?;
        let rest = stat.rsplit_once(')')?.1;
        let f: Vec<&str> = rest.split_whitespace().collect();
        let ticks: f64 = f.get(11)?.parse::<f64>().ok()? + f.get(12)?.parse::<f64>().ok()?;
        // SAFETY: plain sysconf query.
        let hz = unsafe { libc::sysconf(libc::_SC_CLK_TCK) } as f64;
        Some(ticks / hz)
    }

    /// SIGTERM and wait; the datapath stays pinned.
    pub(super) fn stop(&mut self) {
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
    pub(super) fn restart(&mut self) -> Result<()> {
        self.stop();
        self.spawn()
    }

    /// The `ops` of the first `sync` line in the log.
    pub(super) fn first_sync_ops(&self) -> Option<u64> {
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
pub(super) struct Place {
    pub(super) dir: topo::TempDir,
    cgroups: Vec<PathBuf>,
    tag: String,
}

impl Place {
    pub(super) fn new() -> Result<Self> {
        Ok(Self {
            dir: topo::TempDir::new("ebpf-proxy-bench-api-")?,
            cgroups: Vec::new(),
            tag: topo::unique("ebpf-proxy-bench-api-"),
        })
    }

    /// Agent `k`'s pin path and (new, empty) child cgroup.
    pub(super) fn agent(&mut self, k: usize) -> Result<(PathBuf, PathBuf)> {
        let pins = PathBuf::from("/sys/fs/bpf").join(format!("{}-{k}", self.tag));
        let cgroup = topo::cgroup2_mount().join(format!("{}-{k}", self.tag));
        if !cgroup.exists() {
            fs::create_dir(&cgroup).with_context(|| format!("creating {}", cgroup.display()))?;
            self.cgroups.push(cgroup.clone());
        }
        Ok((pins, cgroup))
    }

    pub(super) fn kubeconfig(&self, api: &FakeApiServer) -> PathBuf {
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
