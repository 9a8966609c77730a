//! Fixtures for the privileged tests, on top of the test bed (the `proxy-testbed` crate in
//! `proxy-user/testbed`, re-exported here with its fake apiserver): a per-run
//! bpffs pin directory, the datapath installed on the bed's cgroup, a running
//! `proxy-agent`, manifests. Tests using [`TestEnv`] are serialized by a global lock
//! because the cgroup move is process-wide.

#![allow(
    dead_code,
    unused_imports,
    reason = "each test binary uses a different part of the fixtures"
)]

pub mod packets;
pub mod tc;
pub mod two_nodes;

/// The `BPF_PROG_TEST_RUN` harness and crafted packets, in the library (shared with
/// `bench-prog-run`).
pub use proxy_user::prog_run::{self as progrun, pkt};

pub use proxy_testbed::{self as testbed, apiserver, *};

use std::{
    fs,
    io::{self, Read, Write},
    net::{IpAddr, SocketAddr},
    os::fd::AsRawFd,
    path::{Path, PathBuf},
    process::Command,
    sync::{Mutex, MutexGuard},
    time::Duration,
};

use proxy_user::{loader, BpfMaps, Writer};

static SERIAL: Mutex<()> = Mutex::new(());

/// Privileged tests fail, never skip, without root.
/// The file `cargo xtask test` reads skipped tests from (`name: reason` per line).
pub const SKIPS_ENV: &str = "EBPF_PROXY_TEST_SKIPS";

/// A test that cannot run what it checks here says so and returns: `SKIPPED: name:
/// reason` on stderr, and a line in [`SKIPS_ENV`]'s file, from which `cargo xtask test`
/// counts it as skipped (with the reason) rather than passed.
pub fn skipped(name: &str, reason: &str) {
    eprintln!("SKIPPED: {name}: {reason}");
    if let Some(path) = std::env::var_os(SKIPS_ENV) {
        use std::io::Write as _;
        let mut f = fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(&path)
            .unwrap_or_else(|e| panic!("{}: {e}", std::path::Path::new(&path).display()));
        writeln!(f, "{name}: {reason}").expect("writing the skips file");
    }
}

pub fn require_root() {
    // SAFETY: plain getter.
    let euid = unsafe { libc::geteuid() };
    assert_eq!(
        euid, 0,
        "this test needs root (network namespaces, cgroups, BPF): run `cargo xtask test` as root"
    );
}

/// Program ids attached to `cgroup` for a cgroup attach type (`BPF_PROG_QUERY`).
pub fn attached_programs(cgroup: &Path, attach_type: u32) -> Vec<u32> {
    let dir = fs::File::open(cgroup).expect("cgroup dir");
    bpf_sys::prog_query(std::os::fd::AsFd::as_fd(&dir), attach_type, 64)
        .unwrap_or_else(|e| panic!("BPF_PROG_QUERY: {e}"))
}

/// The cgroup attach types of the eight hooks (connect, sendmsg, recvmsg, getpeername; v4
/// and v6).
pub const SOCK_ATTACH_TYPES: [u32; 8] = [10, 11, 14, 15, 19, 20, 29, 30];
/// A per-run pin directory under /sys/fs/bpf, uninstalled and removed on drop.
pub struct PinDir {
    pub path: PathBuf,
}

/// The prefix of every test run's pin directory; the test process's pid follows it.
const PIN_PREFIX: &str = "ebpf-proxy-test-";

impl PinDir {
    pub fn new() -> Self {
        ensure_bpffs();
        reap_dead_runs_pins(Path::new("/sys/fs/bpf"));
        Self {
            path: PathBuf::from("/sys/fs/bpf").join(unique(PIN_PREFIX)),
        }
    }

    /// The library's handle on this directory (what every pin function takes).
    pub fn dir(&self) -> proxy_user::pins::PinDir {
        proxy_user::pins::PinDir::new(&self.path)
    }
}

impl Drop for PinDir {
    fn drop(&mut self) {
        if self.path.exists() {
            if let Err(e) = loader::uninstall(&proxy_user::pins::PinDir::new(&self.path)) {
                eprintln!("cleanup of {}: {e}", self.path.display());
                let _ = fs::remove_dir_all(&self.path);
            }
        }
    }
}

/// Uninstalls and removes the pin directories of test processes that no longer run (a
/// test binary killed mid-run never reaches `Drop`). A directory is a test run's when its
/// name is `ebpf-proxy-test-<pid>-<n>` (`unique`); one whose pid is alive is left alone,
/// whoever runs it.
fn reap_dead_runs_pins(bpffs: &Path) {
    let Ok(entries) = fs::read_dir(bpffs) else {
        return;
    };
    for e in entries.flatten() {
        let name = e.file_name().to_string_lossy().into_owned();
        if let Some(pid) = testbed::unique_pid(&name, PIN_PREFIX) {
            if !Path::new("/proc").join(pid.to_string()).exists() {
                let path = e.path();
                eprintln!(
                    "removing the pins of a test run that ended without cleanup: {}",
                    path.display()
                );
                if let Err(err) = loader::uninstall(&proxy_user::pins::PinDir::new(&path)) {
                    eprintln!("cleanup of {}: {err}", path.display());
                }
                let _ = fs::remove_dir_all(&path);
            }
        }
    }
}

/// Everything one socket-LB test needs. Field order is drop order: servers stop, the
/// datapath is removed, the process leaves the cgroup, namespaces go last.
pub struct TestEnv {
    pub servers: Vec<Server>,
    pub writer: Option<Writer<BpfMaps>>,
    pub pins: PinDir,
    pub cgroup: TestCgroup,
    pub topo: Topology,
    _serial: MutexGuard<'static, ()>,
}

impl TestEnv {
    /// `pods` pod namespaces, the process in a fresh child cgroup, the hooks attached to
    /// it and a writer over fresh pinned maps.
    pub fn new(pods: usize) -> Self {
        require_root();
        let serial = SERIAL
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner());
        let topo = Topology::new(pods);
        let cgroup = TestCgroup::new();
        let pins = PinDir::new();
        let mut env = Self {
            servers: Vec::new(),
            writer: None,
            pins,
            cgroup,
            topo,
            _serial: serial,
        };
        env.install();
        env.writer = Some(Writer::new(
            BpfMaps::open(&env.pins.path).expect("open maps"),
        ));
        env
    }

    /// Namespaces, cgroup and a pin path, but no datapath: for tests where the real
    /// `proxy-agent` binary installs it.
    pub fn without_datapath(pods: usize) -> Self {
        require_root();
        let serial = SERIAL
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner());
        let topo = Topology::new(pods);
        let cgroup = TestCgroup::new();
        let pins = PinDir::new();
        Self {
            servers: Vec::new(),
            writer: None,
            pins,
            cgroup,
            topo,
            _serial: serial,
        }
    }

    /// Like [`Self::without_datapath`], but this process stays out of the cgroup, so
    /// its clients play machines outside the node (TC tests).
    pub fn outside_cgroup() -> Self {
        require_root();
        let serial = SERIAL
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner());
        Self {
            servers: Vec::new(),
            writer: None,
            pins: PinDir::new(),
            cgroup: TestCgroup::empty(),
            topo: Topology::new(0),
            _serial: serial,
        }
    }

    /// Installs (or adopts) the datapath at the env's pin path and cgroup.
    pub fn install(&self) -> loader::InstallReport {
        loader::install(&loader::InstallOptions {
            pin_path: self.pins.path.clone(),
            cgroup: Some(self.cgroup.path.clone()),
            interfaces: Vec::new(),
            conntrack_flows: loader::DEFAULT_CONNTRACK_FLOWS,
            service_entries: loader::DEFAULT_SERVICE_ENTRIES,
            map_sizes: None,
            tc_attach: loader::TcAttachMode::Auto,
            acceleration: loader::Acceleration::Off,
        })
        .expect("install")
    }

    pub fn writer(&mut self) -> &mut Writer<BpfMaps> {
        self.writer.as_mut().expect("writer")
    }

    /// Starts a TCP and a UDP server on every pod at `port`, named `pod1`, `pod2`, ...,
    /// on both address families.
    pub fn serve_all(&mut self, port: u16) {
        for (i, pod) in self.topo.pods.iter().enumerate() {
            let name = format!("pod{}", i + 1);
            for ip in [
                IpAddr::V4(Topology::pod_v4(i + 1)),
                IpAddr::V6(Topology::pod_v6(i + 1)),
            ] {
                let addr = SocketAddr::new(ip, port);
                self.servers.push(Server::tcp(pod, addr, &name));
                self.servers.push(Server::udp(pod, addr, &name));
            }
        }
    }

    /// Runs `f` inside the client namespace on the current thread.
    pub fn in_client<T>(&self, f: impl FnOnce() -> T) -> T {
        let _ns = self.topo.client.enter();
        f()
    }
}

/// A running `proxy-agent` process (the real binary), stopped with SIGTERM on drop.
pub struct AgentProcess {
    pub child: std::process::Child,
    pub healthz_port: u16,
    pub metrics_port: u16,
    pub log: PathBuf,
    /// The network namespace it runs in (None: this process's).
    pub netns: Option<PathBuf>,
}

impl AgentProcess {
    /// `proxy-agent run` with the env's pin path and cgroup and the given source args
    /// (`--manifests DIR` or `--kubeconfig FILE`).
    pub fn start(env: &TestEnv, source: &[&str]) -> Self {
        Self::start_in(env, None, source)
    }

    /// The same, inside the network namespace `netns` (through nsenter, which keeps
    /// /sys/fs/bpf visible), for the TC datapath on that namespace's interfaces.
    pub fn start_in(env: &TestEnv, netns: Option<&Netns>, args: &[&str]) -> Self {
        Self::start_as(&env.pins.path, &env.cgroup.path, netns, "node-a", args)
    }

    /// [`Self::start_in`] with its own pin path, cgroup and node name: a second node's
    /// agent in the same test (each node has its own pinned datapath).
    pub fn start_as(
        pins: &Path,
        cgroup: &Path,
        netns: Option<&Netns>,
        node_name: &str,
        args: &[&str],
    ) -> Self {
        Self::spawn(pins, cgroup, netns, node_name, args, &[], &[])
    }

    /// [`Self::start`] through a wrapper command: `wrapper` runs with the agent's path and
    /// arguments appended (e.g. `unshare -m sh -c '...; exec "$@"' sh`) and `envs` set; it
    /// must exec the agent (the pid is signalled on stop).
    pub fn start_wrapped(
        env: &TestEnv,
        wrapper: &[&str],
        envs: &[(&str, &str)],
        args: &[&str],
    ) -> Self {
        Self::spawn(
            &env.pins.path,
            &env.cgroup.path,
            None,
            "node-a",
            args,
            wrapper,
            envs,
        )
    }

    fn spawn(
        pins: &Path,
        cgroup: &Path,
        netns: Option<&Netns>,
        node_name: &str,
        args: &[&str],
        wrapper: &[&str],
        envs: &[(&str, &str)],
    ) -> Self {
        let [healthz_port, metrics_port] = match netns {
            // Inside a fresh namespace every loopback port is free.
            Some(_) => [10256, 10249],
            None => free_ports(),
        };
        let log = std::env::temp_dir().join(unique("ebpf-proxy-agent-log-"));
        let log_file = fs::File::create(&log).expect("log file");
        let mut cmd = match netns {
            Some(ns) => {
                let mut c = Command::new("nsenter");
                c.arg(format!("--net={}", ns.path().display()))
                    .arg("--")
                    .arg(env!("CARGO_BIN_EXE_proxy-agent"));
                c
            }
            None if !wrapper.is_empty() => {
                let mut c = Command::new(wrapper[0]);
                c.args(&wrapper[1..]).arg(env!("CARGO_BIN_EXE_proxy-agent"));
                c
            }
            None => Command::new(env!("CARGO_BIN_EXE_proxy-agent")),
        };
        cmd.envs(envs.iter().copied());
        let source = args;
        let child = cmd
            .arg("run")
            .args(source)
            .args(["--pin-path", pins.to_str().expect("utf-8")])
            .args(["--cgroup", cgroup.to_str().expect("utf-8")])
            .args(["--node-name", node_name])
            .args(["--healthz-addr", &format!("127.0.0.1:{healthz_port}")])
            .args(["--metrics-addr", &format!("127.0.0.1:{metrics_port}")])
            .args(["--min-sync-interval", "10ms", "--manifests-poll", "20ms"])
            // Never touch the test machine's iptables/nftables/IPVS.
            .arg("--cleanup-kube-proxy=false")
            // TC programs only on interfaces a test names (inside its own namespaces).
            .args(if args.contains(&"--interfaces") {
                &[][..]
            } else {
                &["--interfaces", "none"][..]
            })
            .env("RUST_LOG", "info,proxy_user=debug")
            .stdout(log_file.try_clone().expect("log"))
            .stderr(log_file)
            .spawn()
            .expect("start proxy-agent");
        Self {
            child,
            healthz_port,
            metrics_port,
            log,
            netns: netns.map(Netns::path),
        }
    }

    fn get(&self, port: u16, path: &str) -> io::Result<(u16, String)> {
        let _ns = self.netns.as_ref().map(|p| NetnsGuard::enter(p));
        http_get(port, path)
    }

    /// Waits until /healthz answers 200 (first sync done).
    pub fn wait_healthy(&mut self, timeout: Duration) {
        let start = std::time::Instant::now();
        while start.elapsed() < timeout {
            if let Some(status) = self.child.try_wait().expect("wait") {
                panic!("proxy-agent exited with {status}:\n{}", self.logs());
            }
            if matches!(self.get(self.healthz_port, "/healthz"), Ok((200, _))) {
                return;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        panic!(
            "proxy-agent not healthy after {timeout:?}:\n{}",
            self.logs()
        );
    }

    pub fn metrics(&self) -> String {
        self.get(self.metrics_port, "/metrics").expect("metrics").1
    }

    /// `GET /healthz`: (status, body).
    pub fn healthz(&self) -> (u16, String) {
        self.get(self.healthz_port, "/healthz").expect("healthz")
    }

    /// Waits until `/healthz` answers `status`; returns the body.
    pub fn wait_healthz(&self, status: u16, timeout: Duration) -> String {
        let start = std::time::Instant::now();
        loop {
            let (code, body) = self.healthz();
            if code == status {
                return body;
            }
            assert!(
                start.elapsed() < timeout,
                "/healthz still {code} after {timeout:?}: {body}"
            );
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    pub fn logs(&self) -> String {
        fs::read_to_string(&self.log).unwrap_or_default()
    }

    /// SIGTERM and wait (the datapath stays pinned).
    pub fn stop(mut self) -> String {
        self.terminate();
        self.logs()
    }

    fn terminate(&mut self) {
        if self.child.try_wait().ok().flatten().is_none() {
            // SAFETY: signalling our own child by pid.
            unsafe { libc::kill(self.child.id() as i32, libc::SIGTERM) };
            let start = std::time::Instant::now();
            while self.child.try_wait().ok().flatten().is_none() {
                if start.elapsed() > Duration::from_secs(5) {
                    let _ = self.child.kill();
                    break;
                }
                std::thread::sleep(Duration::from_millis(10));
            }
            let _ = self.child.wait();
        }
    }
}

impl Drop for AgentProcess {
    fn drop(&mut self) {
        self.terminate();
        if std::thread::panicking() {
            eprintln!("--- proxy-agent log ---\n{}", self.logs());
        }
        let _ = fs::remove_file(&self.log);
    }
}

/// Manifests for tests: a Service and its EndpointSlice as YAML.
pub mod manifests {
    /// A ClusterIP Service with one TCP port named "http" and one UDP port "dns".
    pub fn service(name: &str, vip: &str, port: u16) -> String {
        format!(
            "apiVersion: v1\nkind: Service\nmetadata:\n  name: {name}\n  namespace: default\n\
             spec:\n  clusterIP: {vip}\n  clusterIPs: [{vip}]\n  ports:\n  - name: http\n    port: {port}\n    protocol: TCP\n    targetPort: http\n"
        )
    }

    /// One endpoint: (address, ready, serving, terminating).
    pub type Ep<'a> = (&'a str, bool, bool, bool);

    pub fn ready(addr: &str) -> Ep<'_> {
        (addr, true, true, false)
    }

    pub fn terminating(addr: &str) -> Ep<'_> {
        (addr, false, true, true)
    }

    /// `services` Services `svc-<n>` (VIPs from 10.97.0.0) with `endpoints` ready
    /// endpoints each (from 10.128.0.0, distinct per Service) on port `target`: the layout
    /// of the e2e and memory tests' large manifests.
    pub fn many_services(services: usize, endpoints: usize, target: u16) -> String {
        let mut y = String::with_capacity(services * (400 + 90 * endpoints));
        for s in 0..services {
            let vip = format!("10.97.{}.{}", s / 256, s % 256);
            y += &service(&format!("svc-{s}"), &vip, 80);
            y += "---\n";
            let eps: Vec<String> = (0..endpoints)
                .map(|e| {
                    format!(
                        "10.{}.{}.{}",
                        128 + s / 4096,
                        (s / 16) % 256,
                        (s % 16) * 16 + e
                    )
                })
                .collect();
            let eps: Vec<_> = eps.iter().map(|a| ready(a)).collect();
            y += &slice(&format!("svc-{s}-1"), &format!("svc-{s}"), target, &eps);
            y += "---\n";
        }
        y
    }

    /// An EndpointSlice for `service` with the given endpoints on port `target`.
    pub fn slice(name: &str, service: &str, target: u16, eps: &[Ep<'_>]) -> String {
        let mut y = format!(
            "apiVersion: discovery.k8s.io/v1\nkind: EndpointSlice\nmetadata:\n  name: {name}\n  namespace: default\n  labels:\n    kubernetes.io/service-name: {service}\naddressType: IPv4\nports:\n- name: http\n  port: {target}\n  protocol: TCP\nendpoints:\n"
        );
        if eps.is_empty() {
            y = y.replace("endpoints:\n", "endpoints: []\n");
        }
        for (addr, ready, serving, terminating) in eps {
            y += &format!(
                "- addresses: [\"{addr}\"]\n  nodeName: node-a\n  conditions: {{ready: {ready}, serving: {serving}, terminating: {terminating}}}\n"
            );
        }
        y
    }
}
