//! `cargo xtask demo`: the seed article's example, live. A `nginx-service` ClusterIP
//! Service with three pods (network namespaces running a small HTTP server that answers
//! with its pod name), the real `proxy-agent` following a manifests directory, a client
//! sending requests to the ClusterIP, the spread per pod printed next to the
//! probabilities kube-proxy's iptables chain would have used; then a scale to four pods.
//! Everything it makes (namespaces, a child cgroup, pins, files) is removed at the end,
//! also on failure.

use std::{
    collections::BTreeMap,
    fs,
    net::SocketAddr,
    path::{Path, PathBuf},
    process::{Child, Command, Stdio},
    time::{Duration, Instant},
};

use anyhow::{bail, Context as _, Result};
use proxy_testbed::{
    ensure_bpffs, free_ports, http_ask, http_get, unique, Server, TestCgroup, Topology,
};

const CLUSTER_IP: &str = "10.96.0.100";
const PODS: [&str; 4] = [
    "nginx-deployment-7c79c4bf97-8wv4k",
    "nginx-deployment-7c79c4bf97-l5qnx",
    "nginx-deployment-7c79c4bf97-tg9zr",
    "nginx-deployment-7c79c4bf97-p2hcm",
];

/// The running agent and the pins it owns; stopped and removed on drop.
struct Agent {
    child: Child,
    bin_dir: PathBuf,
    pin_path: PathBuf,
    log: PathBuf,
}

impl Drop for Agent {
    fn drop(&mut self) {
        // SAFETY: signalling our own child by pid.
        unsafe { libc::kill(self.child.id() as i32, libc::SIGTERM) };
        let _ = self.child.wait();
        let _ = Command::new(self.bin_dir.join("proxy-agent"))
            .args(["uninstall", "--pin-path"])
            .arg(&self.pin_path)
            .stdout(Stdio::null())
            .status();
        let _ = fs::remove_file(&self.log);
    }
}

struct TempDir(PathBuf);

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = fs::remove_dir_all(&self.0);
    }
}

fn service_yaml() -> String {
    format!(
        "apiVersion: v1\nkind: Service\nmetadata:\n  name: nginx-service\n  namespace: default\n\
         spec:\n  selector:\n    app: nginx\n  clusterIP: {CLUSTER_IP}\n  ports:\n  - protocol: TCP\n    port: 80\n"
    )
}

fn slice_yaml(pods: usize) -> String {
    let mut y = String::from(
        "apiVersion: discovery.k8s.io/v1\nkind: EndpointSlice\nmetadata:\n  name: nginx-service-abcde\n  namespace: default\n  labels:\n    kubernetes.io/service-name: nginx-service\naddressType: IPv4\nports:\n- port: 80\n  protocol: TCP\nendpoints:\n",
    );
    for (i, pod) in PODS.iter().enumerate().take(pods) {
        y += &format!(
            "- addresses: [\"{}\"]\n  conditions: {{ready: true}}\n  nodeName: demo-node\n  targetRef: {{kind: Pod, namespace: default, name: {pod}}}\n",
            Topology::pod_v4(i + 1)
        );
    }
    y
}

/// Atomic replace, so the agent never reads a half-written file.
fn write(dir: &Path, name: &str, text: &str) -> Result<()> {
    let tmp = dir.join(format!(".{name}.tmp"));
    fs::write(&tmp, text)?;
    fs::rename(&tmp, dir.join(name))?;
    Ok(())
}

/// kube-proxy's iptables chain for n endpoints: rule i matches with probability
/// 1/(n-i), the last one always (`%0.10f` as kube-proxy formats it).
fn iptables_probabilities(n: usize) -> Vec<Option<f64>> {
    (0..n)
        .map(|i| (i + 1 < n).then(|| 1.0 / (n - i) as f64))
        .collect()
}

fn print_chain(n: usize) {
    println!("  kube-proxy (iptables mode) would walk, for every new connection:");
    println!(
        "    -A KUBE-SERVICES -d {CLUSTER_IP}/32 -p tcp --dport 80 -j KUBE-SVC-V2OKYYMBY3REGZOG"
    );
    for (i, p) in iptables_probabilities(n).iter().enumerate() {
        match p {
            Some(p) => println!(
                "    -A KUBE-SVC-V2OKYYMBY3REGZOG -m statistic --mode random --probability {p:.10} -j KUBE-SEP-{}",
                i + 1
            ),
            None => println!("    -A KUBE-SVC-V2OKYYMBY3REGZOG -j KUBE-SEP-{}", i + 1),
        }
    }
    println!("  ebpf-proxy instead: one lookup of {{{CLUSTER_IP}, 80, tcp}} and slot = 1 + random % {n}, at connect().");
}

/// Sends `n` requests from the client namespace and counts the answering pods.
fn requests(topo: &Topology, n: usize) -> Result<BTreeMap<String, usize>> {
    let _ns = topo.client.enter();
    let vip: SocketAddr = format!("{CLUSTER_IP}:80").parse()?;
    let mut hits = BTreeMap::new();
    for _ in 0..n {
        let pod = http_ask(vip).with_context(|| format!("GET http://{vip}/"))?;
        *hits.entry(pod).or_insert(0usize) += 1;
    }
    Ok(hits)
}

fn print_spread(hits: &BTreeMap<String, usize>, pods: usize, total: usize) {
    let probs = iptables_probabilities(pods);
    println!(
        "  {:<36} {:>8} {:>7}   {:>22}   {:>9}",
        "pod", "requests", "share", "iptables rule prob.", "expected"
    );
    for (i, pod) in PODS.iter().enumerate().take(pods) {
        let n = hits.get(*pod).copied().unwrap_or(0);
        let rule = match probs[i] {
            Some(p) => format!("{p:.10}"),
            None => "1 (last rule)".to_string(),
        };
        println!(
            "  {:<36} {:>8} {:>6.1}%   {:>22}   {:>8.1}%",
            pod,
            n,
            100.0 * n as f64 / total as f64,
            rule,
            100.0 / pods as f64
        );
    }
    let expected = total as f64 / pods as f64;
    let chi2: f64 = PODS
        .iter()
        .take(pods)
        .map(|p| {
            let o = hits.get(*p).copied().unwrap_or(0) as f64;
            (o - expected).powi(2) / expected
        })
        .sum();
    println!(
        "  chi-square against equal weights: {chi2:.2} ({} degrees of freedom)",
        pods - 1
    );
}

// Long: the demo's steps in the order it shows them (set-up, traffic, chi-square,
// clean-up), each printed as it runs; one script read top to bottom.
pub fn run(bin_dir: &Path, requests_per_pod: usize) -> Result<()> {
    if !crate::setup::is_root() {
        bail!("the demo needs root (network namespaces, a cgroup, BPF): sudo -E cargo xtask demo");
    }
    ensure_bpffs();
    println!("== ebpf-proxy demo: the article's nginx-service, live ==");
    let topo = Topology::new(PODS.len());
    let _servers: Vec<Server> = PODS
        .iter()
        .enumerate()
        .map(|(i, name)| {
            Server::http(
                &topo.pods[i],
                SocketAddr::new(Topology::pod_v4(i + 1).into(), 80),
                name,
            )
        })
        .collect();
    let cgroup = TestCgroup::new();
    let manifests = TempDir(std::env::temp_dir().join(unique("ebpf-proxy-demo-")));
    fs::create_dir_all(&manifests.0)?;
    write(&manifests.0, "nginx-service.yaml", &service_yaml())?;
    write(&manifests.0, "nginx-endpointslice.yaml", &slice_yaml(3))?;

    let pin_path = PathBuf::from("/sys/fs/bpf").join(unique("ebpf-proxy-demo-"));
    let [healthz, metrics] = free_ports();
    let log = std::env::temp_dir().join(unique("ebpf-proxy-demo-agent-"));
    let child = Command::new(bin_dir.join("proxy-agent"))
        .arg("run")
        .arg("--manifests")
        .arg(&manifests.0)
        .arg("--pin-path")
        .arg(&pin_path)
        .arg("--cgroup")
        .arg(&cgroup.path)
        .args(["--node-name", "demo-node"])
        // The demo must never touch this machine's iptables/nftables/IPVS.
        .arg("--cleanup-kube-proxy=false")
        // ...nor attach TC programs to its interfaces (the demo is socket-level).
        .args(["--interfaces", "none"])
        .args(["--healthz-addr", &format!("127.0.0.1:{healthz}")])
        .args(["--metrics-addr", &format!("127.0.0.1:{metrics}")])
        .stdout(fs::File::create(&log)?)
        .stderr(fs::File::create(&log)?)
        .spawn()
        .context("starting proxy-agent")?;
    let mut agent = Agent {
        child,
        bin_dir: bin_dir.to_path_buf(),
        pin_path: pin_path.clone(),
        log: log.clone(),
    };
    let start = Instant::now();
    while !matches!(http_get(healthz, "/healthz"), Ok((200, _))) {
        if let Some(status) = agent.child.try_wait()? {
            bail!(
                "proxy-agent exited ({status}):\n{}",
                fs::read_to_string(&log).unwrap_or_default()
            );
        }
        if start.elapsed() > Duration::from_secs(20) {
            bail!(
                "proxy-agent not healthy after 20 s:\n{}",
                fs::read_to_string(&log).unwrap_or_default()
            );
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    println!(
        "proxy-agent is running (pid {}), programmed from {} in {:?}; pods are network namespaces, the client is another.",
        agent.child.id(),
        manifests.0.display(),
        start.elapsed()
    );

    println!("\n-- Service default/nginx-service, ClusterIP {CLUSTER_IP}:80, 3 pods --");
    print_chain(3);
    let n = 3 * requests_per_pod;
    let hits = requests(&topo, n)?;
    println!("\n  {n} requests to http://{CLUSTER_IP}/ from the client namespace:");
    print_spread(&hits, 3, n);

    // What the maps hold and how traffic to the ClusterIP is handled, read back
    // (read-only) from the running agent's pins.
    let explain = format!("{CLUSTER_IP}:80");
    for args in [vec!["services"], vec!["explain", explain.as_str()]] {
        println!("\n  $ proxyctl {}", args.join(" "));
        let out = Command::new(bin_dir.join("proxyctl"))
            .arg("--pin-path")
            .arg(&pin_path)
            .args(&args)
            .output()?;
        if !out.status.success() {
            bail!(
                "proxyctl {}: {}",
                args.join(" "),
                String::from_utf8_lossy(&out.stderr)
            );
        }
        for line in String::from_utf8_lossy(&out.stdout).lines() {
            println!("    {line}");
        }
    }

    println!("\n-- scale to 4 pods (the EndpointSlice file is rewritten) --");
    let t0 = Instant::now();
    write(&manifests.0, "nginx-endpointslice.yaml", &slice_yaml(4))?;
    // Wait for the fourth pod to answer once: the change is live.
    {
        let _ns = topo.client.enter();
        let vip: SocketAddr = format!("{CLUSTER_IP}:80").parse()?;
        while http_ask(vip)? != PODS[3] {
            if t0.elapsed() > Duration::from_secs(5) {
                bail!("the fourth pod got no traffic within 5 s");
            }
        }
    }
    println!(
        "  the new pod took traffic {:?} after the file changed",
        t0.elapsed()
    );
    print_chain(4);
    let n = 4 * requests_per_pod;
    let hits = requests(&topo, n)?;
    println!("\n  {n} requests:");
    print_spread(&hits, 4, n);
    let m = http_get(metrics, "/metrics")
        .map(|(_, b)| b)
        .unwrap_or_default();
    if let Some(line) = m
        .lines()
        .find(|l| l.starts_with("ebpf_proxy_network_programming_duration_seconds_count"))
    {
        println!("\n  agent metric: {line}");
    }
    drop(agent);
    drop(cgroup);
    println!("\ncleaned up: agent stopped, hooks detached, pins, namespaces and cgroup removed.");
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn iptables_probabilities_match_kube_proxy() {
        let p: Vec<String> = iptables_probabilities(3)
            .iter()
            .map(|p| p.map_or("last".into(), |p| format!("{p:.10}")))
            .collect();
        assert_eq!(p, ["0.3333333333", "0.5000000000", "last"]);
        // Each endpoint's overall chance is 1/n.
        let n = 4;
        let mut left = 1.0;
        for p in iptables_probabilities(n) {
            let take = p.unwrap_or(1.0);
            assert!((left * take - 0.25).abs() < 1e-12);
            left *= 1.0 - take;
        }
    }
}
