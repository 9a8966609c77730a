//! Our agent as a mode: [`Socket`] (the socket hooks, or TC / XDP for the packet rate),
//! programmed by the real `proxy-agent run --manifests` through a manifests file.

use std::{
    path::PathBuf,
    process::{Child, Command, Stdio},
    time::{Duration, Instant},
};

use anyhow::{bail, Context as _, Result};

use super::{new_stack, AgentFigures, Ctx, Mode, Timing};
use crate::bench::{
    plan::{self, Service},
    topo::{self, http_get, write_atomic, Stack},
};

/// ebpf-proxy's socket hooks, programmed by the real `proxy-agent run --manifests`.
#[derive(Default)]
pub struct Socket {
    // The agent goes before the namespaces it may run in (field order is drop order).
    agent: Option<Agent>,
    stack: Option<Stack>,
    figures: AgentFigures,
    before_change: Option<(f64, f64)>,
    /// The TC variant: its own manifests directory and empty cgroup (dropped after the
    /// agent: field order).
    tc: Option<TcDirs>,
    is_tc: bool,
    /// `--acceleration` for the agent (the XDP variant of the TC mode; the packet-rate
    /// part only, `pps.rs`).
    acceleration: Option<&'static str>,
    /// `--lb-algorithm` for the agent (the XDP variant with Maglev, `pps.rs`).
    lb_algorithm: Option<&'static str>,
    /// The pod-path variant of the TC mode: the client's veth on the node (`cli0`) is a
    /// pod interface (`--interfaces none --pod-interfaces cli0`), attached by the agent's
    /// link watcher as a pod's would be.
    pod: bool,
}

/// The TC mode's own directories, removed on drop.
struct TcDirs {
    manifests: PathBuf,
    cgroup: PathBuf,
}

impl Drop for TcDirs {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.manifests);
        let _ = std::fs::remove_dir(&self.cgroup);
    }
}

/// A running `proxy-agent`; stopped and its pins removed on drop.
struct Agent {
    child: Child,
    bin_dir: PathBuf,
    pin_path: PathBuf,
    metrics_port: u16,
    log: PathBuf,
    netns: Option<PathBuf>,
}

/// Where an agent runs and what it owns: the socket mode's is the run's own; the TC
/// mode's agent runs inside the node namespace, with the TC programs on the node's
/// client-facing interface and its socket hooks on an empty cgroup of its own.
struct Place {
    manifests: PathBuf,
    pin_path: PathBuf,
    cgroup: PathBuf,
    netns: Option<PathBuf>,
    interfaces: Option<&'static str>,
    /// `--pod-interfaces` (`None`: `none`).
    pod_interfaces: Option<&'static str>,
    acceleration: Option<&'static str>,
    lb_algorithm: Option<&'static str>,
}

impl Agent {
    fn start(ctx: &Ctx, place: &Place) -> Result<(Self, f64)> {
        let [healthz, metrics] = match place.netns {
            // Inside a fresh namespace every loopback port is free.
            Some(_) => [10256, 10249],
            None => topo::free_ports(),
        };
        // Inside the manifests directory (removed with it); the agent reads only
        // .yaml/.yml/.json files there.
        let log = place.manifests.join("agent.log");
        let out = std::fs::File::create(&log)?;
        let start = Instant::now();
        let mut cmd = match &place.netns {
            Some(ns) => {
                let mut c = Command::new("nsenter");
                c.arg(format!("--net={}", ns.display()))
                    .arg("--")
                    .arg(ctx.bin_dir.join("proxy-agent"));
                c
            }
            None => Command::new(ctx.bin_dir.join("proxy-agent")),
        };
        // TC programs only on the bench's own interfaces, never on this machine's.
        cmd.args(["run", "--interfaces", place.interfaces.unwrap_or("none")]);
        cmd.args(["--pod-interfaces", place.pod_interfaces.unwrap_or("none")]);
        if let Some(a) = place.acceleration {
            cmd.args(["--acceleration", a]);
        }
        if let Some(a) = place.lb_algorithm {
            cmd.args(["--lb-algorithm", a]);
        }
        let child = cmd
            .arg("--manifests")
            .arg(&place.manifests)
            .arg("--pin-path")
            .arg(&place.pin_path)
            .arg("--cgroup")
            .arg(&place.cgroup)
            .args(["--node-name", "bench-node"])
            // Never touch this machine's iptables/nftables/IPVS.
            .arg("--cleanup-kube-proxy=false")
            .args(["--healthz-addr", &format!("127.0.0.1:{healthz}")])
            .args(["--metrics-addr", &format!("127.0.0.1:{metrics}")])
            .env("RUST_LOG", "warn")
            .stdout(out.try_clone()?)
            .stderr(out)
            .spawn()
            .context("starting proxy-agent")?;
        let mut agent = Self {
            child,
            bin_dir: ctx.bin_dir.clone(),
            pin_path: place.pin_path.clone(),
            metrics_port: metrics,
            log,
            netns: place.netns.clone(),
        };
        while !matches!(agent.get(healthz, "/healthz"), Ok((200, _))) {
            if let Some(status) = agent.child.try_wait()? {
                bail!("proxy-agent exited ({status}):\n{}", agent.log_tail());
            }
            if start.elapsed() > Duration::from_secs(60) {
                bail!("proxy-agent not healthy after 60 s:\n{}", agent.log_tail());
            }
            topo::check_interrupt()?;
            std::thread::sleep(Duration::from_millis(10));
        }
        Ok((agent, start.elapsed().as_secs_f64()))
    }

    /// `GET` on the agent's loopback address, from inside its namespace.
    fn get(&self, port: u16, path: &str) -> std::io::Result<(u16, String)> {
        let _ns = self.netns.as_ref().map(|p| topo::NetnsGuard::enter(p));
        http_get(port, path)
    }

    fn log_tail(&self) -> String {
        let log = std::fs::read_to_string(&self.log).unwrap_or_default();
        let lines: Vec<&str> = log.lines().collect();
        lines[lines.len().saturating_sub(20)..].join("\n")
    }

    /// `/metrics`. A busy agent may not answer at once (at 50,000 services both threads
    /// of its runtime can be parsing or syncing): retried for a minute while it lives.
    fn metrics(&mut self) -> Result<String> {
        let start = Instant::now();
        loop {
            let err = match self.get(self.metrics_port, "/metrics") {
                Ok((200, body)) => return Ok(body),
                Ok((code, _)) => format!("answered {code}"),
                Err(e) => e.to_string(),
            };
            if let Some(status) = self.child.try_wait()? {
                bail!("proxy-agent exited ({status}):\n{}", self.log_tail());
            }
            if start.elapsed() > Duration::from_secs(60) {
                bail!("proxy-agent /metrics: {err} for 60 s:\n{}", self.log_tail());
            }
            topo::check_interrupt()?;
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    fn rss_mib(&self) -> Option<f64> {
        self.status_mib("VmRSS:")
    }

    /// `field` of `/proc/PID/status` (a `kB` figure) in MiB.
    fn status_mib(&self, field: &str) -> Option<f64> {
        let status = std::fs::read_to_string(format!("/proc/{}/status", self.child.id())).ok()?;
        let kib: f64 = status
            .lines()
            .find_map(|l| l.strip_prefix(field))?
            .split_whitespace()
            .next()?
            .parse()
            .ok()?;
        Some(kib / 1024.0)
    }

    fn cpu_seconds(&self) -> Option<f64> {
        let stat = std::fs::read_to_string(format!("/proc/{}/stat", self.child.id())).ok()?;
        // Fields after the command name (which may hold spaces): utime is the 14th
        // field, stime the 15th, in clock ticks.
        let rest = stat.rsplit_once(')')?.1;
        let f: Vec<&str> = rest.split_whitespace().collect();
        let ticks: f64 = f.get(11)?.parse::<f64>().ok()? + f.get(12)?.parse::<f64>().ok()?;
        // SAFETY: plain sysconf query.
        let hz = unsafe { libc::sysconf(libc::_SC_CLK_TCK) } as f64;
        Some(ticks / hz)
    }
}

impl Agent {
    fn signal(&self, sig: i32) {
        // SAFETY: signalling our own child by pid.
        unsafe { libc::kill(self.child.id() as i32, sig) };
    }
}

impl Drop for Agent {
    fn drop(&mut self) {
        // A paused agent must run again to handle SIGTERM.
        self.signal(libc::SIGCONT);
        self.signal(libc::SIGTERM);
        let deadline = Instant::now() + Duration::from_secs(10);
        while matches!(self.child.try_wait(), Ok(None)) && Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(20));
        }
        let _ = self.child.kill();
        let _ = self.child.wait();
        let _ = Command::new(self.bin_dir.join("proxy-agent"))
            .args(["uninstall", "--pin-path"])
            .arg(&self.pin_path)
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .status();
    }
}

/// A metric's value from Prometheus text (the first sample with that exact name).
pub fn metric(text: &str, name: &str) -> Option<f64> {
    text.lines().filter(|l| !l.starts_with('#')).find_map(|l| {
        let (n, v) = l.rsplit_once(' ')?;
        (n == name).then(|| v.parse().ok()).flatten()
    })
}

const FILLERS_FILE: &str = "services.json";
const TARGET_FILE: &str = "target.json";

fn service_json(s: &Service) -> String {
    let ports: Vec<String> = s
        .ports
        .iter()
        .map(|p| {
            format!(
                r#"{{"name":"{}","protocol":"{}","port":{},"targetPort":{}{}}}"#,
                p.name,
                p.proto.upper(),
                p.port,
                p.target_port,
                p.node_port
                    .map(|n| format!(r#","nodePort":{n}"#))
                    .unwrap_or_default()
            )
        })
        .collect();
    let kind = if s.ports.iter().any(|p| p.node_port.is_some()) {
        "NodePort"
    } else {
        "ClusterIP"
    };
    // The agent runs with --node-name bench-node; a remote target's endpoints are on
    // another node (SNAT for external traffic, eTP=Cluster).
    let node = if s.remote {
        "bench-node-2"
    } else {
        "bench-node"
    };
    let slice_ports: Vec<String> = s
        .ports
        .iter()
        .map(|p| {
            format!(
                r#"{{"name":"{}","protocol":"{}","port":{}}}"#,
                p.name,
                p.proto.upper(),
                p.target_port
            )
        })
        .collect();
    let endpoints: Vec<String> = s
        .endpoints
        .iter()
        // On this node (the agent runs with --node-name bench-node): no SNAT on the TC path,
        // like iptables' DNAT for pod-to-service traffic.
        .map(|e| {
            format!(r#"{{"addresses":["{e}"],"conditions":{{"ready":true}},"nodeName":"{node}"}}"#)
        })
        .collect();
    format!(
        concat!(
            r#"{{"apiVersion":"v1","kind":"Service","metadata":{{"name":"{name}","namespace":"{ns}"}},"#,
            r#""spec":{{"type":"{kind}","clusterIP":"{vip}","clusterIPs":["{vip}"],"ports":[{ports}]}}}},"#,
            r#"{{"apiVersion":"discovery.k8s.io/v1","kind":"EndpointSlice","metadata":{{"name":"{name}-abcde","namespace":"{ns}","#,
            r#""labels":{{"kubernetes.io/service-name":"{name}"}}}},"addressType":"IPv4","ports":[{sports}],"endpoints":[{eps}]}}"#
        ),
        name = s.name,
        ns = plan::NAMESPACE,
        kind = kind,
        vip = s.vip,
        ports = ports.join(","),
        sports = slice_ports.join(","),
        eps = endpoints.join(",")
    )
}

/// Services and their EndpointSlices as one `kind: List` JSON document (the agent reads
/// JSON and YAML; JSON is what the API server sends).
pub fn manifests_json(services: &[Service]) -> String {
    let items: Vec<String> = services.iter().map(service_json).collect();
    format!(
        "{{\"apiVersion\":\"v1\",\"kind\":\"List\",\"items\":[\n{}\n]}}\n",
        items.join(",\n")
    )
}

fn frontends(services: &[Service]) -> usize {
    services.iter().map(|s| s.ports.len()).sum()
}

impl Socket {
    /// ebpf-proxy's per-packet TC datapath: the same agent and manifests, but the client
    /// outside any hooked cgroup, so its traffic is translated at TC on the node.
    pub fn tc() -> Self {
        Self {
            is_tc: true,
            ..Self::default()
        }
    }

    /// The per-packet path on pod interfaces: the client's veth on the node is a pod
    /// interface (`--pod-interfaces cli0`), no node interface has TC.
    pub fn pod() -> Self {
        Self {
            is_tc: true,
            pod: true,
            ..Self::default()
        }
    }

    /// The TC mode's agent with `--acceleration native` (XDP on the node's client-facing
    /// interface), for the packet-rate part.
    pub fn xdp() -> Self {
        Self {
            is_tc: true,
            acceleration: Some("native"),
            ..Self::default()
        }
    }

    /// [`Socket::xdp`] with `--lb-algorithm maglev` (external frontends choose their
    /// backend by Maglev), for the packet-rate part.
    pub fn xdp_maglev() -> Self {
        Self {
            lb_algorithm: Some("maglev"),
            ..Self::xdp()
        }
    }

    /// The agent's pin directory (the TC variants'; the socket mode's is the run's).
    pub fn pin_path(&self, ctx: &Ctx) -> PathBuf {
        if self.is_tc {
            PathBuf::from(format!("{}-{}", ctx.pin_path.display(), self.name()))
        } else {
            ctx.pin_path.clone()
        }
    }

    fn place(&self, ctx: &Ctx) -> Result<Place> {
        Ok(match &self.tc {
            Some(dirs) => Place {
                manifests: dirs.manifests.clone(),
                pin_path: self.pin_path(ctx),
                cgroup: dirs.cgroup.clone(),
                netns: Some(self.stack.as_ref().context("no stack")?.node.path()),
                interfaces: (!self.pod).then_some("cli0"),
                pod_interfaces: self.pod.then_some("cli0"),
                acceleration: self.acceleration,
                lb_algorithm: self.lb_algorithm,
            },
            None => Place {
                manifests: ctx.manifests.clone(),
                pin_path: ctx.pin_path.clone(),
                cgroup: ctx.cgroup.clone(),
                netns: None,
                interfaces: None,
                pod_interfaces: None,
                acceleration: None,
                lb_algorithm: None,
            },
        })
    }

    fn agent_mut(&mut self) -> Result<&mut Agent> {
        self.agent.as_mut().context("proxy-agent is not running")
    }

    /// Polls `/metrics` until `name` satisfies `done`.
    fn wait_metric(
        &mut self,
        name: &str,
        done: impl Fn(f64) -> bool,
        limit: Duration,
    ) -> Result<bool> {
        let start = Instant::now();
        loop {
            let m = self.agent_mut()?.metrics()?;
            if metric(&m, name).is_some_and(&done) {
                return Ok(true);
            }
            if start.elapsed() > limit {
                return Ok(false);
            }
            topo::check_interrupt()?;
            std::thread::sleep(Duration::from_millis(2));
        }
    }
}

impl Mode for Socket {
    fn name(&self) -> &'static str {
        if self.lb_algorithm == Some("maglev") {
            "xdp-maglev"
        } else if self.acceleration.is_some() {
            "xdp"
        } else if self.pod {
            "pod"
        } else if self.is_tc {
            "tc"
        } else {
            "socket"
        }
    }
    fn describe(&self) -> &'static str {
        if self.lb_algorithm == Some("maglev") {
            "ebpf-proxy: the XDP mode's agent with --lb-algorithm maglev (external frontends pick their backend from the Maglev table)"
        } else if self.acceleration.is_some() {
            "ebpf-proxy: the TC mode's agent with --acceleration native (XDP on the node's client-facing interface)"
        } else if self.pod {
            "ebpf-proxy: the per-packet pod path (--pod-interfaces: TC on the client pod's host-side veth, attached on its link event), client outside the hooked cgroup"
        } else if self.is_tc {
            "ebpf-proxy: per-packet TC datapath on the node's client-facing interface (DNAT, conntrack, reverse NAT), client outside the hooked cgroup"
        } else {
            "ebpf-proxy: cgroup connect4/sendmsg4/recvmsg4 hooks, maps written by proxy-agent"
        }
    }
    fn setup(&mut self, ctx: &Ctx) -> Result<(), String> {
        let agent = ctx.bin_dir.join("proxy-agent");
        if !agent.is_file() {
            return Err(format!(
                "{} is missing (cargo xtask build)",
                agent.display()
            ));
        }
        self.stack = Some(new_stack()?);
        if self.is_tc {
            // Per variant (tc, xdp, xdp-maglev may run side by side in the packet-rate
            // part): pins, manifests and cgroup of their own.
            let manifests = PathBuf::from(format!("{}-{}", ctx.manifests.display(), self.name()));
            let cgroup = PathBuf::from(format!("{}-{}", ctx.cgroup.display(), self.name()));
            std::fs::create_dir_all(&manifests)
                .map_err(|e| format!("{}: {e}", manifests.display()))?;
            std::fs::create_dir_all(&cgroup).map_err(|e| format!("{}: {e}", cgroup.display()))?;
            self.tc = Some(TcDirs { manifests, cgroup });
        }
        Ok(())
    }
    fn stack(&self) -> Option<&Stack> {
        self.stack.as_ref()
    }
    fn client_cgroup(&self, ctx: &Ctx) -> Option<PathBuf> {
        (!self.is_tc).then(|| ctx.cgroup.clone())
    }
    fn program(
        &mut self,
        ctx: &Ctx,
        services: &[Service],
        limit: Duration,
    ) -> Result<Option<Timing>> {
        // From nothing: a fresh agent on an empty directory (hooks attached, maps empty),
        // then the manifests appear.
        self.agent = None;
        let place = self.place(ctx)?;
        for f in [FILLERS_FILE, TARGET_FILE] {
            let _ = std::fs::remove_file(place.manifests.join(f));
        }
        let (agent, start_secs) = Agent::start(ctx, &place)?;
        self.agent = Some(agent);
        self.figures = AgentFigures {
            start_seconds: Some(start_secs),
            ..AgentFigures::default()
        };
        let sync_before = metric(
            &self.agent_mut()?.metrics()?,
            "ebpf_proxy_sync_proxy_rules_duration_seconds_sum",
        )
        .unwrap_or(0.0);
        let (fillers, target) = services.split_at(services.len() - 1);
        let fillers_text = (!fillers.is_empty()).then(|| manifests_json(fillers));
        let target_text = manifests_json(target);
        let want = frontends(services) as f64;
        let t = Instant::now();
        if let Some(text) = &fillers_text {
            write_atomic(&place.manifests.join(FILLERS_FILE), text)?;
        }
        write_atomic(&place.manifests.join(TARGET_FILE), &target_text)?;
        let done = self.wait_metric("ebpf_proxy_programmed_frontends", |v| v >= want, limit)?;
        let took = t.elapsed();
        if !done {
            return Ok(None);
        }
        let mut timing = Timing::default();
        timing.step("manifests written -> all frontends in the maps", took);
        // Let the sync's allocations settle before reading the resident memory.
        std::thread::sleep(Duration::from_millis(200));
        let agent = self.agent_mut()?;
        let m = agent.metrics()?;
        let rss = agent.rss_mib();
        self.figures.hwm_mib = agent.status_mib("VmHWM:");
        self.figures.sync_seconds =
            metric(&m, "ebpf_proxy_sync_proxy_rules_duration_seconds_sum").map(|s| s - sync_before);
        self.figures.rss_mib = rss;
        Ok(Some(timing))
    }
    fn change(
        &mut self,
        ctx: &Ctx,
        services: &[Service],
        _old: &Service,
        _: Duration,
    ) -> Result<Option<Timing>> {
        let m = self.agent_mut()?.metrics()?;
        let name = "ebpf_proxy_network_programming_duration_seconds";
        self.before_change = Some((
            metric(&m, &format!("{name}_sum")).unwrap_or(0.0),
            metric(&m, &format!("{name}_count")).unwrap_or(0.0),
        ));
        let t = Instant::now();
        let target = &services[services.len() - 1..];
        let place = self.place(ctx)?;
        write_atomic(&place.manifests.join(TARGET_FILE), &manifests_json(target))?;
        let mut timing = Timing::default();
        timing.step("manifest written", t.elapsed());
        Ok(Some(timing))
    }
    fn change_reported(&mut self) -> Option<f64> {
        let (sum0, count0) = self.before_change.take()?;
        let name = "ebpf_proxy_network_programming_duration_seconds";
        // The sync has happened (the change is visible); its metric follows at once.
        let count_name = format!("{name}_count");
        self.wait_metric(&count_name, |c| c > count0, Duration::from_secs(30))
            .ok()?;
        let m = self.agent_mut().ok()?.metrics().ok()?;
        let sum = metric(&m, &format!("{name}_sum"))?;
        let count = metric(&m, &count_name)?;
        // Exactly one observation: the target service's. More means a periodic full
        // resync (one observation per service) landed in between: not attributable.
        (count == count0 + 1.0).then_some(sum - sum0)
    }
    fn clear(&mut self, ctx: &Ctx) -> Result<()> {
        self.agent = None;
        let place = self.place(ctx)?;
        for f in [FILLERS_FILE, TARGET_FILE] {
            let _ = std::fs::remove_file(place.manifests.join(f));
        }
        Ok(())
    }
    fn agent(&self) -> Option<AgentFigures> {
        Some(self.figures.clone())
    }
    fn cpu_seconds(&self) -> Option<f64> {
        self.agent.as_ref()?.cpu_seconds()
    }
    fn pause(&mut self, paused: bool) {
        if let Some(a) = &self.agent {
            a.signal(if paused { libc::SIGSTOP } else { libc::SIGCONT });
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn metrics_are_read_by_exact_name() {
        let text = "# HELP x\nebpf_proxy_programmed_frontends 12\nebpf_proxy_network_programming_duration_seconds_sum 0.25\nebpf_proxy_network_programming_duration_seconds_count 3\n";
        assert_eq!(metric(text, "ebpf_proxy_programmed_frontends"), Some(12.0));
        assert_eq!(
            metric(
                text,
                "ebpf_proxy_network_programming_duration_seconds_count"
            ),
            Some(3.0)
        );
        assert_eq!(metric(text, "ebpf_proxy_programmed"), None);
    }

    #[test]
    fn manifests_are_json_lists_the_agent_reads() {
        let text = manifests_json(&plan::services(2, false));
        let v: serde_json::Value = serde_json::from_str(&text).expect("valid JSON");
        let items = v["items"].as_array().expect("items");
        assert_eq!(items.len(), 4, "a Service and a slice per service");
        assert_eq!(items[2]["spec"]["clusterIP"], "10.96.0.10");
        assert_eq!(items[3]["endpoints"].as_array().map(Vec::len), Some(10));
        assert_eq!(items[3]["ports"][1]["protocol"], "UDP");
        assert_eq!(
            items[1]["metadata"]["labels"]["kubernetes.io/service-name"],
            "svc-0"
        );
    }
}
