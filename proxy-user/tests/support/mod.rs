//! Test fixtures for privileged tests: network namespaces with veth links, a child cgroup
//! holding only this test process, a per-run bpffs pin directory, real TCP/UDP servers.
//!
//! Safety (DEVELOPERS.md): the client runs inside a namespace whose only routes are the
//! links to the test's pod namespaces, so a VIP the datapath fails to rewrite gets
//! "network unreachable"; hooks attach only to the child cgroup; everything is removed in
//! `Drop`, also when a test panics. Tests using [`TestEnv`] are serialized by a global
//! lock because the cgroup move is process-wide.
//!
//! IP plan: pod i (1-based) is reached over veth `vc{i}` (client side 10.240.i.1/24,
//! fd00:240:i::1/64) <-> `eth0` in the pod (10.240.i.2, fd00:240:i::2). VIPs live in
//! 10.96.0.0/16 and fd00:96::/64, which no namespace routes.

#![allow(
    dead_code,
    reason = "each test binary uses a different part of the fixtures"
)]

use std::{
    fs,
    io::{self, Read, Write},
    net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr, TcpListener, TcpStream, UdpSocket},
    os::fd::{AsFd, AsRawFd, OwnedFd},
    path::{Path, PathBuf},
    process::Command,
    sync::{
        atomic::{AtomicBool, AtomicUsize, Ordering},
        Arc, Mutex, MutexGuard,
    },
    thread::JoinHandle,
    time::Duration,
};

use proxy_user::{cgroup, loader, BpfMaps, Writer};

static SERIAL: Mutex<()> = Mutex::new(());
static COUNTER: AtomicUsize = AtomicUsize::new(0);

/// A name unique to this process and call.
pub fn unique(prefix: &str) -> String {
    format!(
        "{prefix}{}-{}",
        std::process::id(),
        COUNTER.fetch_add(1, Ordering::Relaxed)
    )
}

/// Privileged tests fail, never skip, without root.
pub fn require_root() {
    // SAFETY: plain getter.
    let euid = unsafe { libc::geteuid() };
    assert_eq!(
        euid, 0,
        "this test needs root (network namespaces, cgroups, BPF): run `cargo xtask test` as root"
    );
}

/// Runs a command, panicking with its output on failure.
pub fn run(cmd: &str, args: &[&str]) {
    let out = Command::new(cmd)
        .args(args)
        .output()
        .unwrap_or_else(|e| panic!("{cmd} {args:?}: {e} (run `cargo xtask setup`)"));
    assert!(
        out.status.success(),
        "{cmd} {args:?} failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
}

/// Mounts bpffs at /sys/fs/bpf if nothing is mounted there (what `cargo xtask setup` does).
pub fn ensure_bpffs() {
    let bpffs = Path::new("/sys/fs/bpf");
    let mounted = fs::read_to_string("/proc/self/mountinfo")
        .expect("mountinfo")
        .lines()
        .any(|l| l.contains(" /sys/fs/bpf ") && l.contains(" - bpf "));
    if !mounted {
        run(
            "mount",
            &["-t", "bpf", "bpf", bpffs.to_str().expect("path")],
        );
    }
}

/// A network namespace made for the test, deleted on drop.
pub struct Netns {
    pub name: String,
}

impl Netns {
    pub fn new(name: String) -> Self {
        run("ip", &["netns", "add", &name]);
        let ns = Self { name };
        ns.ip(&["link", "set", "lo", "up"]);
        ns
    }

    /// `ip -n <ns> ...`
    pub fn ip(&self, args: &[&str]) {
        let mut all = vec!["-n", self.name.as_str()];
        all.extend_from_slice(args);
        run("ip", &all);
    }

    pub fn path(&self) -> PathBuf {
        PathBuf::from("/var/run/netns").join(&self.name)
    }

    /// Switches the calling thread into this namespace until the guard drops.
    pub fn enter(&self) -> NetnsGuard {
        NetnsGuard::enter(&self.path())
    }
}

impl Drop for Netns {
    fn drop(&mut self) {
        let _ = Command::new("ip")
            .args(["netns", "del", &self.name])
            .status();
    }
}

/// The calling thread's network namespace, switched and restored on drop (aya's
/// `NetNsGuard`). Namespaces are per thread, so other threads are unaffected.
pub struct NetnsGuard {
    previous: OwnedFd,
}

impl NetnsGuard {
    pub fn enter(path: &Path) -> Self {
        let previous: OwnedFd = fs::File::open("/proc/thread-self/ns/net")
            .expect("own netns")
            .into();
        let target = fs::File::open(path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
        setns(target.as_fd().as_raw_fd());
        Self { previous }
    }
}

impl Drop for NetnsGuard {
    fn drop(&mut self) {
        setns(self.previous.as_raw_fd());
    }
}

fn setns(fd: i32) {
    // SAFETY: a namespace fd we opened.
    let r = unsafe { libc::setns(fd, libc::CLONE_NEWNET) };
    assert_eq!(r, 0, "setns: {}", io::Error::last_os_error());
}

/// A child cgroup (v2) holding this test process while it lives.
pub struct TestCgroup {
    pub path: PathBuf,
    original: PathBuf,
}

impl TestCgroup {
    pub fn new() -> Self {
        let mount = cgroup::cgroup2_mount().expect("cgroup2 mount");
        let path = mount.join(unique("ebpf-proxy-test-"));
        fs::create_dir(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
        let own = fs::read_to_string("/proc/self/cgroup").expect("/proc/self/cgroup");
        let rel = own
            .lines()
            .find_map(|l| l.strip_prefix("0::"))
            .expect("a cgroup v2 entry in /proc/self/cgroup");
        let original = mount.join(rel.trim_start_matches('/'));
        let cg = Self { path, original };
        move_self(&cg.path);
        cg
    }
}

impl Drop for TestCgroup {
    fn drop(&mut self) {
        move_self(&self.original);
        let _ = fs::remove_dir(&self.path);
    }
}

fn move_self(cgroup: &Path) {
    let procs = cgroup.join("cgroup.procs");
    fs::write(&procs, std::process::id().to_string())
        .unwrap_or_else(|e| panic!("{}: {e}", procs.display()));
}

/// Program ids attached to `cgroup` for a cgroup attach type (`BPF_PROG_QUERY`).
pub fn attached_programs(cgroup: &Path, attach_type: u32) -> Vec<u32> {
    #[repr(C)]
    struct QueryAttr {
        target_fd: u32,
        attach_type: u32,
        query_flags: u32,
        attach_flags: u32,
        prog_ids: u64,
        prog_cnt: u32,
        _pad: [u8; 108],
    }
    const BPF_PROG_QUERY: libc::c_long = 16;
    let dir = fs::File::open(cgroup).expect("cgroup dir");
    let mut ids = [0u32; 64];
    let mut attr = QueryAttr {
        target_fd: dir.as_raw_fd() as u32,
        attach_type,
        query_flags: 0,
        attach_flags: 0,
        prog_ids: ids.as_mut_ptr() as u64,
        prog_cnt: ids.len() as u32,
        _pad: [0; 108],
    };
    // SAFETY: bpf(BPF_PROG_QUERY) with a zero-padded attr and a valid id buffer.
    let r = unsafe {
        libc::syscall(
            libc::SYS_bpf,
            BPF_PROG_QUERY,
            &mut attr as *mut QueryAttr,
            std::mem::size_of::<QueryAttr>(),
        )
    };
    assert_eq!(r, 0, "BPF_PROG_QUERY: {}", io::Error::last_os_error());
    ids[..attr.prog_cnt as usize].to_vec()
}

/// The cgroup attach types of the eight hooks (connect, sendmsg, recvmsg, getpeername; v4
/// and v6).
pub const SOCK_ATTACH_TYPES: [u32; 8] = [10, 11, 14, 15, 19, 20, 29, 30];

/// A client namespace linked to `n` pod namespaces.
pub struct Topology {
    pub client: Netns,
    pub pods: Vec<Netns>,
}

impl Topology {
    pub fn new(n: usize) -> Self {
        let client = Netns::new(unique("ebp-c-"));
        let mut pods = Vec::new();
        for i in 1..=n {
            let pod = Netns::new(unique("ebp-p-"));
            let veth = format!("vc{i}");
            run(
                "ip",
                &[
                    "link",
                    "add",
                    &veth,
                    "netns",
                    &client.name,
                    "type",
                    "veth",
                    "peer",
                    "name",
                    "eth0",
                    "netns",
                    &pod.name,
                ],
            );
            client.ip(&["addr", "add", &format!("10.240.{i}.1/24"), "dev", &veth]);
            client.ip(&[
                "-6",
                "addr",
                "add",
                &format!("fd00:240:{i}::1/64"),
                "dev",
                &veth,
                "nodad",
            ]);
            client.ip(&["link", "set", &veth, "up"]);
            pod.ip(&["addr", "add", &format!("10.240.{i}.2/24"), "dev", "eth0"]);
            pod.ip(&[
                "-6",
                "addr",
                "add",
                &format!("fd00:240:{i}::2/64"),
                "dev",
                "eth0",
                "nodad",
            ]);
            pod.ip(&["link", "set", "eth0", "up"]);
            pods.push(pod);
        }
        Self { client, pods }
    }

    /// Pod `i`'s (1-based) IPv4 address.
    pub fn pod_v4(i: usize) -> Ipv4Addr {
        Ipv4Addr::new(10, 240, i as u8, 2)
    }

    /// Pod `i`'s IPv6 address.
    pub fn pod_v6(i: usize) -> Ipv6Addr {
        format!("fd00:240:{i}::2").parse().expect("v6")
    }
}

/// A server thread inside a namespace; stops and joins on drop.
pub struct Server {
    stop: Arc<AtomicBool>,
    handle: Option<JoinHandle<()>>,
}

impl Drop for Server {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        if let Some(h) = self.handle.take() {
            let _ = h.join();
        }
    }
}

/// Waits until `fd` is readable or 50 ms pass.
fn readable(fd: i32) -> bool {
    let mut p = libc::pollfd {
        fd,
        events: libc::POLLIN,
        revents: 0,
    };
    // SAFETY: one valid pollfd.
    unsafe { libc::poll(&mut p, 1, 50) > 0 }
}

impl Server {
    /// A TCP server in `ns` at `addr` that answers every connection with `name\n` and
    /// closes it (a one-line HTTP-like exchange).
    pub fn tcp(ns: &Netns, addr: SocketAddr, name: &str) -> Self {
        let stop = Arc::new(AtomicBool::new(false));
        let (tx, rx) = std::sync::mpsc::channel();
        let (path, name, flag) = (ns.path(), name.to_string(), stop.clone());
        let handle = std::thread::spawn(move || {
            let _ns = NetnsGuard::enter(&path);
            let listener = TcpListener::bind(addr).expect("bind tcp");
            tx.send(()).expect("ready");
            while !flag.load(Ordering::Relaxed) {
                if !readable(listener.as_raw_fd()) {
                    continue;
                }
                if let Ok((mut s, _)) = listener.accept() {
                    let _ = s.write_all(format!("{name}\n").as_bytes());
                }
            }
        });
        rx.recv_timeout(Duration::from_secs(5))
            .expect("server ready");
        Self {
            stop,
            handle: Some(handle),
        }
    }

    /// A UDP server in `ns` at `addr` answering every datagram with `name\n`.
    pub fn udp(ns: &Netns, addr: SocketAddr, name: &str) -> Self {
        let stop = Arc::new(AtomicBool::new(false));
        let (tx, rx) = std::sync::mpsc::channel();
        let (path, name, flag) = (ns.path(), name.to_string(), stop.clone());
        let handle = std::thread::spawn(move || {
            let _ns = NetnsGuard::enter(&path);
            let sock = UdpSocket::bind(addr).expect("bind udp");
            tx.send(()).expect("ready");
            let mut buf = [0u8; 1500];
            while !flag.load(Ordering::Relaxed) {
                if !readable(sock.as_raw_fd()) {
                    continue;
                }
                if let Ok((_, from)) = sock.recv_from(&mut buf) {
                    let _ = sock.send_to(format!("{name}\n").as_bytes(), from);
                }
            }
        });
        rx.recv_timeout(Duration::from_secs(5))
            .expect("server ready");
        Self {
            stop,
            handle: Some(handle),
        }
    }
}

/// `N` distinct free loopback ports (all bound at once, then released).
pub fn free_ports<const N: usize>() -> [u16; N] {
    let listeners: Vec<TcpListener> = (0..N)
        .map(|_| TcpListener::bind("127.0.0.1:0").expect("bind"))
        .collect();
    std::array::from_fn(|i| listeners[i].local_addr().expect("addr").port())
}

/// `GET path` on 127.0.0.1:port; returns (status code, body).
pub fn http_get(port: u16, path: &str) -> io::Result<(u16, String)> {
    let mut s = TcpStream::connect(("127.0.0.1", port))?;
    s.set_read_timeout(Some(Duration::from_secs(5)))?;
    write!(
        s,
        "GET {path} HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\n\r\n"
    )?;
    let mut out = String::new();
    s.read_to_string(&mut out)?;
    let code = out
        .split_whitespace()
        .nth(1)
        .and_then(|c| c.parse().ok())
        .unwrap_or(0);
    let body = out
        .split_once("\r\n\r\n")
        .map(|(_, b)| b.to_string())
        .unwrap_or_default();
    Ok((code, body))
}

/// Connects to `addr` (from the current thread's namespace) and returns the server's
/// one-line answer and the peer address the socket reports.
pub fn tcp_ask(addr: SocketAddr) -> io::Result<(String, SocketAddr)> {
    let mut s = TcpStream::connect_timeout(&addr, Duration::from_secs(2))?;
    let peer = s.peer_addr()?;
    s.set_read_timeout(Some(Duration::from_secs(2)))?;
    let mut out = String::new();
    s.read_to_string(&mut out)?;
    Ok((out.trim().to_string(), peer))
}

/// Sends one datagram from an unconnected socket and returns the answer and its source.
pub fn udp_ask(sock: &UdpSocket, addr: SocketAddr) -> io::Result<(String, SocketAddr)> {
    sock.send_to(b"who?", addr)?;
    let mut buf = [0u8; 1500];
    let (n, from) = sock.recv_from(&mut buf)?;
    Ok((String::from_utf8_lossy(&buf[..n]).trim().to_string(), from))
}

/// A per-run pin directory under /sys/fs/bpf, uninstalled and removed on drop.
pub struct PinDir {
    pub path: PathBuf,
}

impl PinDir {
    pub fn new() -> Self {
        ensure_bpffs();
        Self {
            path: PathBuf::from("/sys/fs/bpf").join(unique("ebpf-proxy-test-")),
        }
    }
}

impl Drop for PinDir {
    fn drop(&mut self) {
        if self.path.exists() {
            if let Err(e) = loader::uninstall(&self.path) {
                eprintln!("cleanup of {}: {e}", self.path.display());
                let _ = fs::remove_dir_all(&self.path);
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

    /// Installs (or adopts) the datapath at the env's pin path and cgroup.
    pub fn install(&self) -> loader::InstallReport {
        loader::install(&loader::InstallOptions {
            pin_path: self.pins.path.clone(),
            cgroup: Some(self.cgroup.path.clone()),
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
}

impl AgentProcess {
    /// `proxy-agent run` with the env's pin path and cgroup and the given source args
    /// (`--manifests DIR` or `--kubeconfig FILE`).
    pub fn start(env: &TestEnv, source: &[&str]) -> Self {
        let [healthz_port, metrics_port] = free_ports();
        let log = std::env::temp_dir().join(unique("ebpf-proxy-agent-log-"));
        let log_file = fs::File::create(&log).expect("log file");
        let child = Command::new(env!("CARGO_BIN_EXE_proxy-agent"))
            .arg("run")
            .args(source)
            .args(["--pin-path", env.pins.path.to_str().expect("utf-8")])
            .args(["--cgroup", env.cgroup.path.to_str().expect("utf-8")])
            .args(["--node-name", "node-a"])
            .args(["--healthz-addr", &format!("127.0.0.1:{healthz_port}")])
            .args(["--metrics-addr", &format!("127.0.0.1:{metrics_port}")])
            .args(["--min-sync-interval", "10ms", "--manifests-poll", "20ms"])
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
        }
    }

    /// Waits until /healthz answers 200 (first sync done).
    pub fn wait_healthy(&mut self, timeout: Duration) {
        let start = std::time::Instant::now();
        while start.elapsed() < timeout {
            if let Some(status) = self.child.try_wait().expect("wait") {
                panic!("proxy-agent exited with {status}:\n{}", self.logs());
            }
            if matches!(http_get(self.healthz_port, "/healthz"), Ok((200, _))) {
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
        http_get(self.metrics_port, "/metrics").expect("metrics").1
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
