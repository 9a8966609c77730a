//! Test support shared by proxy-user's tests (a dev-dependency) and by `cargo xtask demo`
//! and `cargo xtask bench`: the test bed (this module: network namespaces linked by veth,
//! a child cgroup holding the calling process, TCP/UDP/HTTP servers inside namespaces, and
//! clients) and a fake kube-apiserver ([`apiserver`]). Only `std`, `libc`, `tokio`,
//! `serde_json` (and, for the apiserver's HTTPS and RBAC, `rustls`, `rcgen`, `serde_yaml`):
//! no dependency on the project's crates, so the bench can use it as well.
//!
//! Safety (DEVELOPERS.md): clients that talk to a VIP run inside a namespace whose only
//! routes are the links to the bed's pod namespaces, so a VIP the datapath fails to
//! rewrite gets "network unreachable"; everything is removed in `Drop`, also on panic.
//!
//! IP plan: pod i (1-based) is reached over veth `vc{i}` (client side 10.240.i.1/24,
//! fd00:240:i::1/64) <-> `eth0` in the pod (10.240.i.2, fd00:240:i::2). VIPs live in
//! 10.96.0.0/16 and fd00:96::/64, which no namespace routes.

pub mod apiserver;
pub mod memcg;

use std::{
    fs,
    io::{self, Read, Write},
    net::{Ipv4Addr, Ipv6Addr, SocketAddr, TcpListener, TcpStream, UdpSocket},
    os::fd::{AsFd, AsRawFd, OwnedFd},
    path::{Path, PathBuf},
    process::Command,
    sync::{
        atomic::{AtomicBool, AtomicUsize, Ordering},
        Arc,
    },
    thread::JoinHandle,
    time::Duration,
};

static COUNTER: AtomicUsize = AtomicUsize::new(0);

/// A name unique to this process and call.
pub fn unique(prefix: &str) -> String {
    format!(
        "{prefix}{}-{}",
        std::process::id(),
        COUNTER.fetch_add(1, Ordering::Relaxed)
    )
}

/// The pid in a name `unique(prefix)` made (`<prefix><pid>-<n>`); `None` for any other
/// name, so what another naming scheme made is never taken for a run's.
pub fn unique_pid(name: &str, prefix: &str) -> Option<u32> {
    let (pid, n) = name.strip_prefix(prefix)?.split_once('-')?;
    n.parse::<u64>().ok()?;
    pid.parse().ok()
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
    joined: bool,
}

impl TestCgroup {
    /// A child cgroup that this process does not join (hooks there see no test traffic
    /// unless a process is moved in).
    pub fn empty() -> Self {
        let mount = cgroup2_mount();
        let path = mount.join(unique("ebpf-proxy-test-"));
        fs::create_dir(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
        Self {
            original: path.clone(),
            path,
            joined: false,
        }
    }

    #[allow(
        clippy::new_without_default,
        reason = "it moves the calling process: not what a Default should do"
    )]
    pub fn new() -> Self {
        let mount = cgroup2_mount();
        let path = mount.join(unique("ebpf-proxy-test-"));
        fs::create_dir(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
        let own = fs::read_to_string("/proc/self/cgroup").expect("/proc/self/cgroup");
        let rel = own
            .lines()
            .find_map(|l| l.strip_prefix("0::"))
            .expect("a cgroup v2 entry in /proc/self/cgroup");
        let original = mount.join(rel.trim_start_matches('/'));
        let cg = Self {
            path,
            original,
            joined: true,
        };
        move_self(&cg.path);
        cg
    }
}

impl Drop for TestCgroup {
    fn drop(&mut self) {
        if self.joined {
            move_self(&self.original);
        }
        let _ = fs::remove_dir(&self.path);
    }
}

fn move_self(cgroup: &Path) {
    let procs = cgroup.join("cgroup.procs");
    fs::write(&procs, std::process::id().to_string())
        .unwrap_or_else(|e| panic!("{}: {e}", procs.display()));
}

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
    /// Runs a server thread inside `ns`: `bind` makes its socket there, then `handle` is
    /// called whenever the socket is readable, until the server is dropped.
    fn spawn<T: AsRawFd + 'static>(
        ns: &Netns,
        bind: impl FnOnce() -> T + Send + 'static,
        mut handle: impl FnMut(&T, &Arc<AtomicBool>) + Send + 'static,
    ) -> Self {
        let stop = Arc::new(AtomicBool::new(false));
        let (tx, rx) = std::sync::mpsc::channel();
        let (path, flag) = (ns.path(), stop.clone());
        let handle = std::thread::spawn(move || {
            let _ns = NetnsGuard::enter(&path);
            let sock = bind();
            tx.send(()).expect("ready");
            while !flag.load(Ordering::Relaxed) {
                if readable(sock.as_raw_fd()) {
                    handle(&sock, &flag);
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

    /// A TCP server in `ns` at `addr` that answers every connection with `name\n` and
    /// closes it (a one-line HTTP-like exchange).
    pub fn tcp(ns: &Netns, addr: SocketAddr, name: &str) -> Self {
        let name = name.to_string();
        Self::spawn(
            ns,
            move || TcpListener::bind(addr).expect("bind tcp"),
            move |l, _| {
                if let Ok((mut s, _)) = l.accept() {
                    let _ = s.write_all(format!("{name}\n").as_bytes());
                }
            },
        )
    }

    /// A minimal HTTP server in `ns` at `addr`: every request gets `200 OK` with body
    /// `name\n` (like the article's nginx pods, but telling which pod answered).
    pub fn http(ns: &Netns, addr: SocketAddr, name: &str) -> Self {
        let name = name.to_string();
        Self::spawn(
            ns,
            move || TcpListener::bind(addr).expect("bind http"),
            move |l, _| {
                let Ok((mut s, _)) = l.accept() else { return };
                let _ = s.set_read_timeout(Some(Duration::from_secs(2)));
                let mut head = Vec::new();
                let mut buf = [0u8; 1024];
                while !head.windows(4).any(|w| w == b"\r\n\r\n") {
                    match s.read(&mut buf) {
                        Ok(0) | Err(_) => break,
                        Ok(n) => head.extend_from_slice(&buf[..n]),
                    }
                }
                let body = format!("{name}\n");
                let _ = write!(
                    s,
                    "HTTP/1.1 200 OK\r\nContent-Type: text/plain\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
                    body.len()
                );
            },
        )
    }

    /// A TCP server in `ns` at `addr` that keeps each connection open and answers every
    /// line it receives with `name peer-address\n` (one thread per connection), so a test
    /// sees which pod answered, from which client address, over a long-lived connection.
    pub fn tcp_echo(ns: &Netns, addr: SocketAddr, name: &str) -> Self {
        let name = name.to_string();
        Self::spawn(
            ns,
            move || TcpListener::bind(addr).expect("bind tcp"),
            move |l, stop| {
                let Ok((s, peer)) = l.accept() else { return };
                let (name, stop) = (name.clone(), stop.clone());
                std::thread::spawn(move || {
                    let _ = s.set_read_timeout(Some(Duration::from_millis(100)));
                    let Ok(r) = s.try_clone() else { return };
                    let mut reader = io::BufReader::new(r);
                    let mut s = s;
                    let mut line = String::new();
                    while !stop.load(Ordering::Relaxed) {
                        line.clear();
                        match io::BufRead::read_line(&mut reader, &mut line) {
                            Ok(0) => return,
                            Ok(_) => {
                                if writeln!(s, "{name} {}", peer.ip()).is_err() {
                                    return;
                                }
                            }
                            Err(e)
                                if matches!(
                                    e.kind(),
                                    io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut
                                ) => {}
                            Err(_) => return,
                        }
                    }
                });
            },
        )
    }

    /// A UDP server in `ns` at `addr` answering every datagram with `name peer-address\n`.
    pub fn udp_peer(ns: &Netns, addr: SocketAddr, name: &str) -> Self {
        let name = name.to_string();
        Self::udp_with(ns, addr, move |from| format!("{name} {}\n", from.ip()))
    }

    /// A UDP server in `ns` at `addr` answering every datagram with `name\n`.
    pub fn udp(ns: &Netns, addr: SocketAddr, name: &str) -> Self {
        let name = name.to_string();
        Self::udp_with(ns, addr, move |_| format!("{name}\n"))
    }

    /// A UDP server in `ns` at `addr` answering every datagram with `reply(sender)`.
    fn udp_with(
        ns: &Netns,
        addr: SocketAddr,
        reply: impl Fn(SocketAddr) -> String + Send + 'static,
    ) -> Self {
        Self::spawn(
            ns,
            move || UdpSocket::bind(addr).expect("bind udp"),
            move |sock, _| {
                let mut buf = [0u8; 1500];
                if let Ok((_, from)) = sock.recv_from(&mut buf) {
                    let _ = sock.send_to(reply(from).as_bytes(), from);
                }
            },
        )
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

/// `GET /` to `addr` (from the current thread's namespace); returns the body's first line.
pub fn http_ask(addr: SocketAddr) -> io::Result<String> {
    let mut s = TcpStream::connect_timeout(&addr, Duration::from_secs(2))?;
    s.set_read_timeout(Some(Duration::from_secs(2)))?;
    write!(
        s,
        "GET / HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\n\r\n"
    )?;
    let mut out = String::new();
    s.read_to_string(&mut out)?;
    if !out.starts_with("HTTP/1.1 200") {
        return Err(io::Error::other(format!("unexpected answer: {out:?}")));
    }
    let body = out.split_once("\r\n\r\n").map(|(_, b)| b).unwrap_or("");
    Ok(body.lines().next().unwrap_or("").to_string())
}

/// Sends one datagram from an unconnected socket and returns the answer and its source.
pub fn udp_ask(sock: &UdpSocket, addr: SocketAddr) -> io::Result<(String, SocketAddr)> {
    sock.send_to(b"who?", addr)?;
    let mut buf = [0u8; 1500];
    let (n, from) = sock.recv_from(&mut buf)?;
    Ok((String::from_utf8_lossy(&buf[..n]).trim().to_string(), from))
}

/// The cgroup v2 mount point, from /proc/self/mountinfo.
pub fn cgroup2_mount() -> PathBuf {
    let info = fs::read_to_string("/proc/self/mountinfo").expect("mountinfo");
    info.lines()
        .find_map(|l| {
            let (left, right) = l.split_once(" - ")?;
            (right.split_whitespace().next()? == "cgroup2")
                .then(|| left.split_whitespace().nth(4).map(PathBuf::from))
                .flatten()
        })
        .expect("a cgroup2 mount (cgroup v2 is required)")
}

#[cfg(test)]
mod tests {
    use super::{unique, unique_pid};

    #[test]
    fn unique_pid_reads_back_only_what_unique_made() {
        let name = unique("ebpf-proxy-test-");
        assert_eq!(
            unique_pid(&name, "ebpf-proxy-test-"),
            Some(std::process::id())
        );
        // Another scheme's names under the same prefix, and near misses.
        assert_eq!(
            unique_pid("ebpf-proxy-test-kpc-4242-7", "ebpf-proxy-test-"),
            None
        );
        assert_eq!(unique_pid("ebpf-proxy-test-4242", "ebpf-proxy-test-"), None);
        assert_eq!(unique_pid("ebpf-proxy-4242-7", "ebpf-proxy-test-"), None);
    }
}
