//! The bench's world: per mode, a *stack* of three network namespaces, and the servers,
//! the child cgroup and the commands that run inside them. Everything is removed on
//! drop, also on failure.
//!
//! ```text
//!  client ns                node ns (the mode's rules live here)           pods ns
//!  eth0 10.224.0.2/24 <-veth-> cli0 10.224.0.1/24                       
//!  default via 10.224.0.1      pods0 10.224.1.254/24 <-veth-> eth0 10.224.1.1..11/24
//!                              ip_forward=1, no other route               route 10.224.0.0/24 via .254
//! ```
//!
//! The client is a pod: its traffic to a ClusterIP is *forwarded* by the node, so
//! kube-proxy's rules act at PREROUTING (iptables/nftables DNAT) or LOCAL_IN (IPVS, with
//! the ClusterIPs on `kube-ipvs0`), as for pod-to-service traffic on a real node; our
//! socket hooks act earlier, in the client's own `connect()`/`sendmsg()`. The node has
//! no route for the service CIDR, so a ClusterIP that nothing rewrites gets ICMP "network
//! unreachable" back: clients can only ever reach the bench's namespaces. Each mode
//! has its own stack, so the modes' rules never meet, and every stack has the same
//! addresses (the same rules and manifests serve all).
//!
//! The servers (one epoll thread per stack, in the pods namespace, pinned to CPU 0 like
//! the sequential clients) answer on every
//! target endpoint address: TCP 80 (read the request, answer the endpoint's address,
//! close), UDP 53 (answer the endpoint's address from that address), TCP 5201 (swallow a
//! stream, close at its end).

use std::{
    collections::HashMap,
    fs,
    io::{self, Read as _, Write as _},
    net::{Ipv4Addr, SocketAddr, SocketAddrV4, TcpListener, UdpSocket},
    os::fd::{AsRawFd, RawFd},
    path::{Path, PathBuf},
    process::{Command, Stdio},
    sync::{
        atomic::{AtomicBool, Ordering},
        Arc,
    },
    thread::JoinHandle,
    time::{Duration, Instant},
};

use anyhow::{bail, Context as _, Result};

pub use proxy_testbed::{
    cgroup2_mount, ensure_bpffs, free_ports, http_get, unique, Netns, NetnsGuard,
};

use super::plan::{
    target_endpoint, BULK_PORT, CLIENT_IP, DNS_PORT, HTTP_PORT, NODE_CLIENT_SIDE, NODE_PODS_SIDE,
    TARGET_ADDRESSES,
};

static INTERRUPTED: AtomicBool = AtomicBool::new(false);

extern "C" fn on_signal(_: libc::c_int) {
    INTERRUPTED.store(true, Ordering::SeqCst);
}

/// SIGINT and SIGTERM set a flag that the bench's loops check: they stop, return an
/// error, and the guards remove everything on the way out.
pub fn install_interrupt_handler() {
    for sig in [libc::SIGINT, libc::SIGTERM] {
        // SAFETY: the handler only stores to an atomic (async-signal-safe).
        unsafe {
            libc::signal(
                sig,
                on_signal as extern "C" fn(libc::c_int) as libc::sighandler_t,
            )
        };
    }
}

pub fn check_interrupt() -> Result<()> {
    if INTERRUPTED.load(Ordering::SeqCst) {
        bail!("interrupted: cleaning up");
    }
    Ok(())
}

/// Runs `cmd` (already set up), feeding `input` on stdin, killing it (our own child, by
/// pid) after `limit`. Returns its stdout, or an error naming the command with its
/// stderr; `Ok(None)` when it ran out of time.
pub fn run_bounded(cmd: &mut Command, input: &str, limit: Duration) -> Result<Option<String>> {
    let name = format!(
        "{} {}",
        cmd.get_program().to_string_lossy(),
        cmd.get_args()
            .map(|a| a.to_string_lossy())
            .collect::<Vec<_>>()
            .join(" ")
    );
    let mut child = cmd
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .with_context(|| format!("starting {name} (run `cargo xtask setup`)"))?;
    let mut stdin = child.stdin.take().context("stdin")?;
    let input = input.to_string();
    let writer = std::thread::spawn(move || {
        let _ = stdin.write_all(input.as_bytes());
    });
    let mut stdout = child.stdout.take().context("stdout")?;
    let mut stderr = child.stderr.take().context("stderr")?;
    let out_reader = std::thread::spawn(move || {
        let mut s = String::new();
        let _ = stdout.read_to_string(&mut s);
        s
    });
    let err_reader = std::thread::spawn(move || {
        let mut s = String::new();
        let _ = stderr.read_to_string(&mut s);
        s
    });
    let start = Instant::now();
    let status = loop {
        if let Some(status) = child.try_wait()? {
            break Some(status);
        }
        if start.elapsed() > limit || INTERRUPTED.load(Ordering::SeqCst) {
            let _ = child.kill();
            let _ = child.wait();
            break None;
        }
        std::thread::sleep(Duration::from_millis(2));
    };
    let _ = writer.join();
    let out = out_reader.join().unwrap_or_default();
    let err = err_reader.join().unwrap_or_default();
    check_interrupt()?;
    match status {
        None => Ok(None),
        Some(s) if s.success() => Ok(Some(out)),
        Some(s) => {
            let err: String = err.lines().take(20).collect::<Vec<_>>().join("\n");
            bail!("{name} failed ({s}):\n{err}")
        }
    }
}

/// `nsenter --net=<ns> <program> <args>`: a command inside one of our namespaces
/// (`ip netns exec` would remount /sys and hide /sys/fs/bpf).
pub fn in_ns(ns: &Netns, program: &str, args: &[&str]) -> Command {
    let mut cmd = Command::new("nsenter");
    cmd.arg(format!("--net={}", ns.path().display()))
        .arg(program)
        .args(args);
    cmd
}

/// Runs a short command inside `ns` (30 s at most), failing with its stderr.
pub fn ns_run(ns: &Netns, program: &str, args: &[&str], input: &str) -> Result<String> {
    run_bounded(
        &mut in_ns(ns, program, args),
        input,
        Duration::from_secs(30),
    )?
    .with_context(|| format!("{program} {args:?} took more than 30 s"))
}

fn ip(args: &[&str]) -> Result<()> {
    run_bounded(Command::new("ip").args(args), "", Duration::from_secs(30))?
        .with_context(|| format!("ip {args:?} hung"))?;
    Ok(())
}

/// Client, node and pods namespaces for one mode, with the servers running.
pub struct Stack {
    pub client: Netns,
    pub node: Netns,
    /// The endpoints' namespace (kept alive with the stack; its server runs in it).
    _pods: Netns,
    _server: Server,
}

impl Stack {
    /// The endpoints' namespace.
    pub fn pods(&self) -> &Netns {
        &self._pods
    }

    pub fn new() -> Result<Self> {
        let client = Netns::new(unique("ebpb-c-"));
        let node = Netns::new(unique("ebpb-n-"));
        let pods = Netns::new(unique("ebpb-p-"));
        ip(&[
            "link",
            "add",
            "eth0",
            "netns",
            &client.name,
            "type",
            "veth",
            "peer",
            "name",
            "cli0",
            "netns",
            &node.name,
        ])?;
        ip(&[
            "link", "add", "pods0", "netns", &node.name, "type", "veth", "peer", "name", "eth0",
            "netns", &pods.name,
        ])?;
        client.ip(&["addr", "add", &format!("{CLIENT_IP}/24"), "dev", "eth0"]);
        client.ip(&["link", "set", "eth0", "up"]);
        client.ip(&[
            "route",
            "add",
            "default",
            "via",
            &NODE_CLIENT_SIDE.to_string(),
        ]);
        node.ip(&[
            "addr",
            "add",
            &format!("{NODE_CLIENT_SIDE}/24"),
            "dev",
            "cli0",
        ]);
        node.ip(&[
            "addr",
            "add",
            &format!("{NODE_PODS_SIDE}/24"),
            "dev",
            "pods0",
        ]);
        node.ip(&["link", "set", "cli0", "up"]);
        node.ip(&["link", "set", "pods0", "up"]);
        ns_run(&node, "sysctl", &["-qw", "net.ipv4.ip_forward=1"], "")?;
        for i in 1..=TARGET_ADDRESSES {
            pods.ip(&[
                "addr",
                "add",
                &format!("{}/24", target_endpoint(i)),
                "dev",
                "eth0",
            ]);
        }
        pods.ip(&["link", "set", "eth0", "up"]);
        pods.ip(&[
            "route",
            "add",
            "10.224.0.0/24",
            "via",
            &NODE_PODS_SIDE.to_string(),
        ]);
        let server = Server::start(&pods)?;
        Ok(Self {
            client,
            node,
            _pods: pods,
            _server: server,
        })
    }
}

#[derive(Clone, Copy, PartialEq, Eq)]
enum Kind {
    HttpListener,
    BulkListener,
    Udp,
    Http,
    Bulk,
}

/// The endpoints' servers: one epoll thread in the pods namespace.
struct Server {
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

fn epoll_add(ep: RawFd, fd: RawFd) -> io::Result<()> {
    let mut ev = libc::epoll_event {
        events: libc::EPOLLIN as u32,
        u64: fd as u64,
    };
    // SAFETY: valid epoll and socket fds.
    if unsafe { libc::epoll_ctl(ep, libc::EPOLL_CTL_ADD, fd, &mut ev) } != 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}

impl Server {
    fn start(pods: &Netns) -> Result<Self> {
        let stop = Arc::new(AtomicBool::new(false));
        let (tx, rx) = std::sync::mpsc::channel::<Result<(), String>>();
        let (path, flag) = (pods.path(), stop.clone());
        let handle = std::thread::spawn(move || {
            let _ns = NetnsGuard::enter(&path);
            super::client::pin(0);
            let setup = || -> io::Result<(Vec<TcpListener>, Vec<UdpSocket>)> {
                let mut tcp = Vec::new();
                let mut udp = Vec::new();
                for i in 1..=TARGET_ADDRESSES {
                    let ip = target_endpoint(i);
                    for port in [HTTP_PORT, BULK_PORT] {
                        let l = TcpListener::bind(SocketAddrV4::new(ip, port))?;
                        l.set_nonblocking(true)?;
                        tcp.push(l);
                    }
                    let u = UdpSocket::bind(SocketAddrV4::new(ip, DNS_PORT))?;
                    u.set_nonblocking(true)?;
                    udp.push(u);
                }
                Ok((tcp, udp))
            };
            let (tcp, udp) = match setup() {
                Ok(s) => s,
                Err(e) => {
                    let _ = tx.send(Err(e.to_string()));
                    return;
                }
            };
            let _ = tx.send(Ok(()));
            serve(&tcp, &udp, &flag);
        });
        match rx.recv_timeout(Duration::from_secs(10)) {
            Ok(Ok(())) => Ok(Self {
                stop,
                handle: Some(handle),
            }),
            Ok(Err(e)) => bail!("starting the endpoint servers: {e}"),
            Err(_) => bail!("the endpoint servers did not start"),
        }
    }
}

/// The server loop. Connections get the address they were reached at.
// Long: one poll loop over the TCP and UDP sockets of the bench's servers; splitting it
// would pass its buffers and state around.
fn serve(tcp: &[TcpListener], udp: &[UdpSocket], stop: &AtomicBool) {
    // SAFETY: plain syscall.
    let ep = unsafe { libc::epoll_create1(libc::EPOLL_CLOEXEC) };
    if ep < 0 {
        eprintln!(
            "bench server: epoll_create1: {}",
            io::Error::last_os_error()
        );
        return;
    }
    let mut kinds: HashMap<RawFd, (Kind, String)> = HashMap::new();
    let mut conns: HashMap<RawFd, std::net::TcpStream> = HashMap::new();
    for l in tcp {
        let addr = l
            .local_addr()
            .map(|a| a.ip().to_string())
            .unwrap_or_default();
        let kind = match l.local_addr().map(|a| a.port()) {
            Ok(HTTP_PORT) => Kind::HttpListener,
            _ => Kind::BulkListener,
        };
        kinds.insert(l.as_raw_fd(), (kind, addr));
        let _ = epoll_add(ep, l.as_raw_fd());
    }
    let udp_by_fd: HashMap<RawFd, &UdpSocket> = udp.iter().map(|u| (u.as_raw_fd(), u)).collect();
    for u in udp {
        let addr = u
            .local_addr()
            .map(|a| a.ip().to_string())
            .unwrap_or_default();
        kinds.insert(u.as_raw_fd(), (Kind::Udp, addr));
        let _ = epoll_add(ep, u.as_raw_fd());
    }
    let listeners: HashMap<RawFd, &TcpListener> = tcp.iter().map(|l| (l.as_raw_fd(), l)).collect();
    let mut events = vec![libc::epoll_event { events: 0, u64: 0 }; 256];
    let mut buf = vec![0u8; 256 * 1024];
    while !stop.load(Ordering::Relaxed) {
        // SAFETY: a buffer of `events.len()` events.
        let n = unsafe { libc::epoll_wait(ep, events.as_mut_ptr(), events.len() as i32, 100) };
        if n < 0 {
            if io::Error::last_os_error().kind() == io::ErrorKind::Interrupted {
                continue;
            }
            break;
        }
        for ev in &events[..n as usize] {
            let fd = ev.u64 as RawFd;
            let Some((kind, addr)) = kinds.get(&fd).cloned() else {
                continue;
            };
            match kind {
                Kind::HttpListener | Kind::BulkListener => {
                    let Some(l) = listeners.get(&fd) else {
                        continue;
                    };
                    while let Ok((s, _)) = l.accept() {
                        if s.set_nonblocking(true).is_err() {
                            continue;
                        }
                        let cfd = s.as_raw_fd();
                        if epoll_add(ep, cfd).is_ok() {
                            let k = if kind == Kind::HttpListener {
                                Kind::Http
                            } else {
                                Kind::Bulk
                            };
                            kinds.insert(cfd, (k, addr.clone()));
                            conns.insert(cfd, s);
                        }
                    }
                }
                Kind::Udp => {
                    let Some(u) = udp_by_fd.get(&fd) else {
                        continue;
                    };
                    while let Ok((_, from)) = u.recv_from(&mut buf) {
                        let _ = u.send_to(format!("{addr}\n").as_bytes(), from);
                    }
                }
                Kind::Http | Kind::Bulk => {
                    let close = match conns.get_mut(&fd) {
                        None => true,
                        Some(s) => loop {
                            match s.read(&mut buf) {
                                Ok(0) => break true,
                                Ok(_) if kind == Kind::Http => {
                                    let _ = s.write_all(format!("{addr}\n").as_bytes());
                                    break true;
                                }
                                Ok(_) => continue,
                                Err(e) if e.kind() == io::ErrorKind::WouldBlock => break false,
                                Err(_) => break true,
                            }
                        },
                    };
                    if close {
                        // Dropping the stream closes it (and removes it from epoll).
                        conns.remove(&fd);
                        kinds.remove(&fd);
                    }
                }
            }
        }
    }
    conns.clear();
    // SAFETY: our epoll fd.
    unsafe { libc::close(ep) };
}

/// A child cgroup for the run (the socket mode's hooks attach here; only the socket
/// mode's client processes join it). Removed on drop.
pub struct BenchCgroup {
    pub path: PathBuf,
}

impl BenchCgroup {
    pub fn new() -> Result<Self> {
        let path = cgroup2_mount().join(unique("ebpf-proxy-bench-"));
        fs::create_dir(&path).with_context(|| format!("creating {}", path.display()))?;
        Ok(Self { path })
    }
}

impl Drop for BenchCgroup {
    fn drop(&mut self) {
        // The clients have exited; a cgroup with no process can be removed.
        for _ in 0..50 {
            if fs::remove_dir(&self.path).is_ok() {
                return;
            }
            std::thread::sleep(Duration::from_millis(100));
        }
        eprintln!("warning: could not remove {}", self.path.display());
    }
}

/// A directory removed (with its contents) on drop.
pub struct TempDir(pub PathBuf);

impl TempDir {
    pub fn new(prefix: &str) -> Result<Self> {
        let p = std::env::temp_dir().join(unique(prefix));
        fs::create_dir_all(&p)?;
        Ok(Self(p))
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = fs::remove_dir_all(&self.0);
    }
}

/// Writes a file atomically (temporary name, then rename), so a reader never sees half.
pub fn write_atomic(path: &Path, text: &str) -> Result<()> {
    let tmp = path.with_extension("tmp");
    fs::write(&tmp, text).with_context(|| format!("writing {}", tmp.display()))?;
    fs::rename(&tmp, path).with_context(|| format!("renaming to {}", path.display()))?;
    Ok(())
}

/// `addr:port` of every target endpoint in use (the direct mode's targets).
pub fn endpoint_targets(endpoints: &[Ipv4Addr], port: u16) -> Vec<SocketAddrV4> {
    endpoints
        .iter()
        .map(|e| SocketAddrV4::new(*e, port))
        .collect()
}

/// Whether `addr` is one the bench may send to: loopback or inside its namespaces.
pub fn is_bench_address(addr: &SocketAddr) -> bool {
    match addr {
        SocketAddr::V4(a) => {
            let o = a.ip().octets();
            a.ip().is_loopback()
                || (o[0] == 10 && (96..112).contains(&o[1]))
                || (o[0] == 10 && (224..240).contains(&o[1]))
        }
        SocketAddr::V6(a) => a.ip().is_loopback(),
    }
}
