//! Issue 24 item 1: kubeadm's own kube-proxy configuration runs the agent unchanged. The
//! real `proxy-agent` binary gets the arguments of kubeadm's `kube-proxy` DaemonSet
//! (`deploy/overlays/replace-kube-proxy/kube-proxy.yaml`: `--config=... --hostname-override=...`,
//! no subcommand) and the `config.conf` kubeadm writes into the `kube-proxy` ConfigMap
//! (`tests/data/kubeadm-kube-proxy-config.conf`), in a test network namespace; the
//! test-only settings (pin path, cgroup, manifests source, no TC, no kube-proxy cleanup)
//! go through the agent's `PROXY_*` environment variables so the command line stays
//! kubeadm's. It must serve a Service, answer /healthz and /metrics on the addresses the
//! file implies (kube-proxy's defaults), and name the one setting it does not apply.
//!
//! Privileged (root, a netns, a cgroup, BPF).

mod support;

use std::{
    fs,
    net::SocketAddr,
    path::{Path, PathBuf},
    process::{Child, Command, Stdio},
    time::{Duration, Instant},
};

use support::{
    http_get,
    manifests::{ready, service, slice},
    tcp_ask, unique, NetnsGuard, TestEnv, Topology,
};

const KUBEADM_CONFIG: &str = include_str!("data/kubeadm-kube-proxy-config.conf");

/// kubeadm's DaemonSet's command after the program, `$(NODE_NAME)` expanded as the
/// kubelet does and the ConfigMap's mount point moved to `config_dir`.
fn kubeadm_arguments(config_dir: &Path, node: &str) -> Vec<String> {
    let ds: serde_yaml::Value = serde_yaml::from_str(
        &fs::read_to_string(
            Path::new(env!("CARGO_MANIFEST_DIR"))
                .join("../deploy/overlays/replace-kube-proxy/kube-proxy.yaml"),
        )
        .expect("kubeadm's DaemonSet"),
    )
    .expect("YAML");
    let command = ds["spec"]["template"]["spec"]["containers"][0]["command"]
        .as_sequence()
        .expect("the container's command");
    assert_eq!(command[0].as_str(), Some("/usr/local/bin/kube-proxy"));
    command[1..]
        .iter()
        .map(|a| {
            a.as_str()
                .expect("a string")
                .replace("/var/lib/kube-proxy", config_dir.to_str().expect("utf-8"))
                .replace("$(NODE_NAME)", node)
        })
        .collect()
}

struct Agent {
    child: Child,
    log: PathBuf,
    netns: PathBuf,
}

impl Agent {
    fn get(&self, port: u16, path: &str) -> std::io::Result<(u16, String)> {
        let _ns = NetnsGuard::enter(&self.netns);
        http_get(port, path)
    }
    fn logs(&self) -> String {
        fs::read_to_string(&self.log).unwrap_or_default()
    }
}

impl Drop for Agent {
    fn drop(&mut self) {
        // SAFETY: signalling our own child by pid.
        unsafe { libc::kill(self.child.id() as i32, libc::SIGTERM) };
        let start = Instant::now();
        while self.child.try_wait().ok().flatten().is_none() {
            if start.elapsed() > Duration::from_secs(5) {
                let _ = self.child.kill();
                break;
            }
            std::thread::sleep(Duration::from_millis(10));
        }
        let _ = self.child.wait();
        if std::thread::panicking() {
            eprintln!("--- proxy-agent log ---\n{}", self.logs());
        }
        let _ = fs::remove_file(&self.log);
    }
}

struct TempDir(PathBuf);

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = fs::remove_dir_all(&self.0);
    }
}

#[test]
fn kubeadms_kube_proxy_config_and_arguments_run_the_agent() {
    let mut env = TestEnv::without_datapath(1);
    env.serve_all(8080);
    let dir = TempDir(std::env::temp_dir().join(unique("ebpf-proxy-kubeadm-")));
    // kubeadm mounts the ConfigMap at /var/lib/kube-proxy: config.conf, kubeconfig.conf.
    let config_dir = dir.0.join("var-lib-kube-proxy");
    let manifests = dir.0.join("manifests");
    fs::create_dir_all(&config_dir).expect("mkdir");
    fs::create_dir_all(&manifests).expect("mkdir");
    fs::write(config_dir.join("config.conf"), KUBEADM_CONFIG).expect("config.conf");
    let pod1 = Topology::pod_v4(1).to_string();
    fs::write(
        manifests.join("web.yaml"),
        format!(
            "{}---\n{}",
            service("web", "10.96.0.10", 80),
            slice("web-1", "web", 8080, &[ready(&pod1)])
        ),
    )
    .expect("manifests");

    let args = kubeadm_arguments(&config_dir, "Node-A");
    let log = std::env::temp_dir().join(unique("ebpf-proxy-kubeadm-log-"));
    let log_file = fs::File::create(&log).expect("log");
    let netns = env.topo.client.path();
    let child = Command::new("nsenter")
        .arg(format!("--net={}", netns.display()))
        .arg("--")
        .arg(env!("CARGO_BIN_EXE_proxy-agent"))
        .args(&args)
        .env("PROXY_PIN_PATH", &env.pins.path)
        .env("PROXY_CGROUP", &env.cgroup.path)
        .env("PROXY_MANIFESTS", &manifests)
        .env("PROXY_MANIFESTS_POLL", "20ms")
        .env("PROXY_INTERFACES", "none")
        .env("PROXY_CLEANUP_KUBE_PROXY", "false")
        .env_remove("RUST_LOG")
        .env_remove("NODE_NAME")
        .stdin(Stdio::null())
        .stdout(log_file.try_clone().expect("log"))
        .stderr(log_file)
        .spawn()
        .expect("start proxy-agent");
    let mut agent = Agent { child, log, netns };

    // healthzBindAddress "" is kube-proxy's 0.0.0.0:10256, metricsBindAddress ""
    // 127.0.0.1:10249: inside the namespace.
    let start = Instant::now();
    loop {
        if let Some(status) = agent.child.try_wait().expect("wait") {
            panic!(
                "proxy-agent {args:?} exited with {status}:\n{}",
                agent.logs()
            );
        }
        if matches!(agent.get(10256, "/healthz"), Ok((200, _))) {
            break;
        }
        assert!(
            start.elapsed() < Duration::from_secs(30),
            "not healthy on 0.0.0.0:10256 after 30 s:\n{}",
            agent.logs()
        );
        std::thread::sleep(Duration::from_millis(20));
    }

    // It serves: the ClusterIP reaches pod1.
    let vip: SocketAddr = "10.96.0.10:80".parse().expect("addr");
    let answer = env.in_client(|| {
        let start = Instant::now();
        loop {
            match tcp_ask(vip) {
                Ok((who, _)) => return who,
                Err(e) if start.elapsed() > Duration::from_secs(10) => {
                    panic!("{vip}: {e}\n{}", agent.logs())
                }
                Err(_) => std::thread::sleep(Duration::from_millis(20)),
            }
        }
    });
    assert_eq!(answer, "pod1");

    let (code, metrics) = agent
        .get(10249, "/metrics")
        .expect("metrics on 127.0.0.1:10249");
    assert_eq!(code, 200);
    // The one setting of kubeadm's file that does not apply, named; nothing else.
    let ignored: Vec<&str> = metrics
        .lines()
        .filter(|l| l.starts_with("ebpf_proxy_config_fields_ignored{"))
        .collect();
    assert_eq!(
        ignored,
        ["ebpf_proxy_config_fields_ignored{field=\"clusterCIDR\"} 1"],
        "{metrics}"
    );
    for want in [
        "kubeproxy_sync_proxy_rules_last_timestamp_seconds{ip_family=\"IPv4\"}",
        "kubeproxy_proxy_healthz_total{code=\"200\"}",
        "kubeproxy_sync_full_proxy_rules_duration_seconds_count{ip_family=\"IPv4\"}",
    ] {
        assert!(metrics.contains(want), "{want} missing in\n{metrics}");
    }
    let logs = agent.logs();
    assert!(
        logs.contains("kube-proxy settings not applied") && logs.contains("clusterCIDR"),
        "the start log names clusterCIDR:\n{logs}"
    );
    // --hostname-override, lowercased as kube-proxy does, is the node's name.
    assert!(logs.contains("node-a"), "node name node-a in:\n{logs}");
}

/// A typo in the file stops the agent with an error naming the field (kube-proxy's
/// strict decoding), before anything is installed.
#[test]
fn an_unknown_field_in_the_config_stops_the_agent_naming_it() {
    let dir = TempDir(std::env::temp_dir().join(unique("ebpf-proxy-kubeadm-bad-")));
    fs::create_dir_all(&dir.0).expect("mkdir");
    let path = dir.0.join("config.conf");
    fs::write(
        &path,
        KUBEADM_CONFIG.replace("  maxPerCore: null\n", "  maxPerCpu: 8\n"),
    )
    .expect("write");
    let out = Command::new(env!("CARGO_BIN_EXE_proxy-agent"))
        .arg(format!("--config={}", path.display()))
        .arg("--hostname-override=node-a")
        .env("PROXY_PIN_PATH", dir.0.join("pins"))
        .output()
        .expect("run proxy-agent");
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("unknown field `maxPerCpu`") && err.contains("config.conf"),
        "{err}"
    );
    assert!(!dir.0.join("pins").exists(), "nothing installed");
}
