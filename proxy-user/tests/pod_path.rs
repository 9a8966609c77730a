//! The per-packet path on pod interfaces (`--pod-interfaces`): the real `proxy-agent` in a
//! "node" network namespace whose pods are namespaces joined by veth pairs the way a CNI
//! makes them (host side `lxc*` without a pod address, pod side `eth0` with a /32, a /32
//! route per pod on the node, the pod's default route through a link-local gateway on
//! the host side). The test process stays outside the agent's cgroup, so no socket hook
//! sees the pods' sockets: what they send takes the TC path on their host-side veth.
//! Needs root.
//!
//! ```text
//!  net 10.100.0.1 ──── 10.100.0.2 (eth0) [node] lxca ── pod a 10.244.0.10 (client)
//!                                               lxcb ── pod b 10.244.0.11
//!                                               lxcc ── pod c 10.244.0.12
//! ```

mod support;

use std::{
    fs,
    io::{BufRead, BufReader, ErrorKind, Write},
    net::{SocketAddr, TcpStream, UdpSocket},
    path::{Path, PathBuf},
    time::{Duration, Instant},
};

use proxy_common::Reason;
use proxy_user::{socklb, BpfMaps};
use serde_json::{json, Value};
use support::{apiserver::FakeApiServer, run, unique, AgentProcess, Netns, Server, TestEnv};

const NODE_ADDR: &str = "10.100.0.2";
const GATEWAY: &str = "169.254.1.1";

fn sysctl(ns: &Netns, key: &str) {
    run("ip", &["netns", "exec", &ns.name, "sysctl", "-qw", key]);
}

/// The node namespace and the network beyond its `eth0`.
struct Node {
    node: Netns,
    _net: Netns,
}

impl Node {
    fn new() -> Self {
        let node = Netns::new(unique("h1n-"));
        let net = Netns::new(unique("h1x-"));
        run(
            "ip",
            &[
                "link", "add", "eth0", "netns", &node.name, "type", "veth", "peer", "name", "eth0",
                "netns", &net.name,
            ],
        );
        node.ip(&["addr", "add", "10.100.0.2/24", "dev", "eth0"]);
        net.ip(&["addr", "add", "10.100.0.1/24", "dev", "eth0"]);
        node.ip(&["link", "set", "eth0", "up"]);
        net.ip(&["link", "set", "eth0", "up"]);
        node.ip(&["route", "add", "default", "via", "10.100.0.1"]);
        sysctl(&node, "net.ipv4.ip_forward=1");
        // Strict reverse-path filtering, as many nodes (and CNIs on their pod veths) have
        // it: a reply translated on the backend's veth must not reach the stack with the
        // frontend as its source on that interface.
        sysctl(&node, "net.ipv4.conf.all.rp_filter=1");
        sysctl(&node, "net.ipv4.conf.default.rp_filter=1");
        Self { node, _net: net }
    }

    /// A pod: namespace, veth `host_if` (node) <-> `eth0` (pod) with `ip`/32, routes both
    /// ways, as a CNI's ptp plugin makes them.
    fn pod(&self, host_if: &str, ip: &str) -> Netns {
        let pod = Netns::new(unique("h1p-"));
        run(
            "ip",
            &[
                "link",
                "add",
                host_if,
                "netns",
                &self.node.name,
                "type",
                "veth",
                "peer",
                "name",
                "eth0",
                "netns",
                &pod.name,
            ],
        );
        self.plumb(&pod, host_if, ip);
        pod
    }

    fn plumb(&self, pod: &Netns, host_if: &str, ip: &str) {
        pod.ip(&["addr", "add", &format!("{ip}/32"), "dev", "eth0"]);
        pod.ip(&["link", "set", "eth0", "up"]);
        pod.ip(&["route", "add", GATEWAY, "dev", "eth0", "scope", "link"]);
        pod.ip(&["route", "add", "default", "via", GATEWAY, "dev", "eth0"]);
        self.node
            .ip(&["addr", "add", &format!("{GATEWAY}/32"), "dev", host_if]);
        self.node.ip(&["link", "set", host_if, "up"]);
        self.node
            .ip(&["route", "add", &format!("{ip}/32"), "dev", host_if]);
    }
}

fn write(dir: &Path, name: &str, text: &str) {
    let tmp = dir.join(format!(".{name}.tmp"));
    fs::write(&tmp, text).expect("write");
    fs::rename(&tmp, dir.join(name)).expect("rename");
}

/// A Service `name` (UDP 53 and TCP 80 -> `target`; NodePorts `node_ports` if given)
/// with `internalTrafficPolicy` `itp`, and its slice over `eps` ((address, node)). Each
/// Service of a test has its own target port: a backend (address, port) shared by two
/// Services stays in the maps while one of them still has it.
fn service(
    name: &str,
    target: u16,
    vip: &str,
    itp: &str,
    node_ports: Option<(u16, u16)>,
    eps: &[(&str, &str)],
) -> String {
    let (ty, udp_np, tcp_np) = match node_ports {
        Some((u, t)) => (
            "NodePort",
            format!(", nodePort: {u}"),
            format!(", nodePort: {t}"),
        ),
        None => ("ClusterIP", String::new(), String::new()),
    };
    let mut y = format!(
        "apiVersion: v1\nkind: Service\nmetadata: {{name: {name}, namespace: default}}\nspec:\n  type: {ty}\n  clusterIP: {vip}\n  clusterIPs: [{vip}]\n  internalTrafficPolicy: {itp}\n  ports:\n  - {{name: dns, port: 53, targetPort: {target}, protocol: UDP{udp_np}}}\n  - {{name: http, port: 80, targetPort: {target}, protocol: TCP{tcp_np}}}\n---\napiVersion: discovery.k8s.io/v1\nkind: EndpointSlice\nmetadata: {{name: {name}-1, namespace: default, labels: {{kubernetes.io/service-name: {name}}}}}\naddressType: IPv4\nports:\n- {{name: dns, port: {target}, protocol: UDP}}\n- {{name: http, port: {target}, protocol: TCP}}\nendpoints:\n"
    );
    if eps.is_empty() {
        y = y.trim_end_matches("endpoints:\n").to_string() + "endpoints: []\n";
    }
    for (addr, node) in eps {
        y += &format!("- {{addresses: [\"{addr}\"], nodeName: {node}}}\n");
    }
    y
}

fn manifests_dir() -> PathBuf {
    let p = std::env::temp_dir().join(unique("ebpf-proxy-podpath-"));
    fs::create_dir_all(&p).expect("mkdir");
    p
}

/// A UDP socket made in `pod`, connected to `to`.
fn connected_udp(pod: &Netns, to: SocketAddr) -> UdpSocket {
    let _g = pod.enter();
    let s = UdpSocket::bind("0.0.0.0:0").expect("bind");
    s.connect(to).expect("connect");
    s.set_read_timeout(Some(Duration::from_millis(200)))
        .expect("timeout");
    s
}

/// One exchange over a new TCP connection made in `pod`: (answering pod, the client
/// address it saw).
fn ask_tcp(pod: &Netns, to: SocketAddr) -> std::io::Result<(String, String)> {
    let s = {
        let _g = pod.enter();
        TcpStream::connect_timeout(&to, Duration::from_secs(2))?
    };
    assert_eq!(s.peer_addr()?, to, "getpeername shows the frontend");
    s.set_read_timeout(Some(Duration::from_secs(2)))?;
    (&s).write_all(b"hi\n")?;
    let mut line = String::new();
    BufReader::new(&s).read_line(&mut line)?;
    let mut parts = line.split_whitespace();
    Ok((
        parts.next().unwrap_or_default().to_string(),
        parts.next().unwrap_or_default().to_string(),
    ))
}

/// One datagram from a new socket made in `pod`, with one answer awaited: (answering
/// pod, the client address it saw).
fn ask_udp_once(pod: &Netns, to: SocketAddr) -> std::io::Result<(String, String)> {
    let s = connected_udp(pod, to);
    s.set_read_timeout(Some(Duration::from_secs(2)))?;
    s.send(b"who?")?;
    let mut buf = [0u8; 256];
    let n = s.recv(&mut buf)?;
    let text = String::from_utf8_lossy(&buf[..n]).to_string();
    let mut parts = text.split_whitespace();
    Ok((
        parts.next().unwrap_or_default().to_string(),
        parts.next().unwrap_or_default().to_string(),
    ))
}

/// Sends a datagram every 200 ms on `sock` while `change` runs once (after `before`
/// answers from `old`), until `after` answers from `new` came. Returns the gap between
/// the last answer from `old` and the first from `new`. Any socket error other than a
/// read timeout fails: the application must see none.
fn follow_backend_change(
    sock: &UdpSocket,
    old: &str,
    new: &str,
    change: impl FnOnce(),
) -> Duration {
    let mut change = Some(change);
    let (mut olds, mut news) = (0, 0);
    let mut last_old = None;
    let mut first_new = None;
    let start = Instant::now();
    let mut buf = [0u8; 256];
    while news < 5 {
        assert!(
            start.elapsed() < Duration::from_secs(20),
            "no answers from {new} after 20 s ({olds} from {old})"
        );
        let sent = Instant::now();
        sock.send(b"who?")
            .unwrap_or_else(|e| panic!("send on the connected socket: {e}"));
        match sock.recv(&mut buf) {
            Ok(n) => {
                let text = String::from_utf8_lossy(&buf[..n]).to_string();
                let who = text.split_whitespace().next().unwrap_or_default();
                if who == old {
                    assert!(first_new.is_none(), "{old} answered again after {new}");
                    olds += 1;
                    last_old = Some(Instant::now());
                } else if who == new {
                    news += 1;
                    first_new.get_or_insert_with(Instant::now);
                } else {
                    panic!("unexpected answer {text:?}");
                }
            }
            Err(e) if matches!(e.kind(), ErrorKind::WouldBlock | ErrorKind::TimedOut) => {}
            Err(e) => panic!("the application saw an error on its connected socket: {e}"),
        }
        if olds >= 3 {
            if let Some(c) = change.take() {
                c();
            }
        }
        if let Some(rest) = Duration::from_millis(200).checked_sub(sent.elapsed()) {
            std::thread::sleep(rest);
        }
    }
    let (Some(a), Some(b)) = (last_old, first_new) else {
        panic!("answers: {olds} from {old}, {news} from {new}");
    };
    b - a
}

/// Pods a (client), b and c (backends, UDP peer and TCP echo on 8080-8083), the agent with
/// `--pod-interfaces lxc*` in the node namespace.
struct Bed {
    // Field order is drop order.
    agent: Option<AgentProcess>,
    /// The API source (`Bed::with_api`), listening inside the node namespace.
    api: Option<FakeApiServer>,
    _servers: Vec<Server>,
    pods: Vec<Netns>,
    node: Node,
    dir: PathBuf,
    env: TestEnv,
}

impl Bed {
    /// This process outside the agent's cgroup: no socket hook sees the pods' sockets.
    fn new(manifests: &[(&str, String)]) -> Self {
        Self::with(TestEnv::outside_cgroup(), manifests, &[])
    }

    /// `env` (whose cgroup this process may have joined) and extra agent arguments.
    fn with(env: TestEnv, manifests: &[(&str, String)], extra: &[&str]) -> Self {
        Self::start(env, manifests, None, extra)
    }

    /// Like [`Self::with`], but the agent reads the test apiserver (started in the node
    /// namespace, objects applied by `setup` before the agent starts) instead of a
    /// manifests directory.
    fn with_api(env: TestEnv, setup: impl FnOnce(&FakeApiServer), extra: &[&str]) -> Self {
        Self::start(env, &[], Some(Box::new(setup)), extra)
    }

    #[allow(clippy::type_complexity, reason = "a one-off set-up callback")]
    fn start(
        env: TestEnv,
        manifests: &[(&str, String)],
        api_setup: Option<Box<dyn FnOnce(&FakeApiServer) + '_>>,
        extra: &[&str],
    ) -> Self {
        let node = Node::new();
        let mut pods = Vec::new();
        let mut servers = Vec::new();
        for (host_if, ip, name) in [
            ("lxca", "10.244.0.10", "poda"),
            ("lxcb", "10.244.0.11", "podb"),
            ("lxcc", "10.244.0.12", "podc"),
        ] {
            let pod = node.pod(host_if, ip);
            for port in 8080..=8083 {
                let addr: SocketAddr = format!("{ip}:{port}").parse().expect("addr");
                servers.push(Server::udp_peer(&pod, addr, name));
                servers.push(Server::tcp_echo(&pod, addr, name));
            }
            pods.push(pod);
        }
        let dir = manifests_dir();
        for (name, text) in manifests {
            write(&dir, name, text);
        }
        let dir_s = dir.to_str().expect("utf-8").to_string();
        let kubeconfig = dir.join("kubeconfig");
        let kubeconfig_s = kubeconfig.to_str().expect("utf-8").to_string();
        let api = api_setup.map(|setup| {
            let api = FakeApiServer::start_in_netns(&node.node.path());
            api.write_kubeconfig(&kubeconfig);
            setup(&api);
            api
        });
        let mut args = match api {
            Some(_) => vec!["--kubeconfig", &kubeconfig_s],
            None => vec!["--manifests", &dir_s],
        };
        args.extend_from_slice(&["--pod-interfaces", "lxc*"]);
        args.extend_from_slice(extra);
        let mut agent = AgentProcess::start_in(&env, Some(&node.node), &args);
        agent.wait_healthy(Duration::from_secs(30));
        Self {
            agent: Some(agent),
            api,
            _servers: servers,
            pods,
            node,
            dir,
            env,
        }
    }

    fn pin_exists(&self, iface: &str, ingress: bool) -> bool {
        let dir = if ingress { "ingress" } else { "egress" };
        self.env
            .pins
            .path
            .join("links")
            .join(format!("tc-{iface}-{dir}"))
            .exists()
    }

    fn logs(&self) -> String {
        self.agent.as_ref().map(|a| a.logs()).unwrap_or_default()
    }
}

impl Drop for Bed {
    fn drop(&mut self) {
        let _ = fs::remove_dir_all(&self.dir);
    }
}

/// A pod's long-lived connected UDP socket follows its backend's replacement (ClusterIP,
/// NodePort on the node's address, `internalTrafficPolicy: Local`): answers resume from
/// the new backend within 1 s of the last from the old one, the application sees no
/// error, and the peer stays the frontend. TCP and hairpin through the same path.
#[test]
fn pod_connected_udp_follows_backend_change() {
    let b = ("10.244.0.11", "node-a");
    let c = ("10.244.0.12", "node-a");
    // An endpoint on another node: never chosen under internalTrafficPolicy Local (it
    // would not answer: nothing routes 10.244.1.0/24).
    let remote = ("10.244.1.5", "node-b");
    let bed = Bed::new(&[
        (
            "cip.yaml",
            service("cip", 8080, "10.96.0.10", "Cluster", None, &[b]),
        ),
        (
            "np.yaml",
            service(
                "np",
                8081,
                "10.96.0.11",
                "Cluster",
                Some((30053, 30080)),
                &[b],
            ),
        ),
        (
            "itp.yaml",
            service("itp", 8082, "10.96.0.12", "Local", None, &[b, remote]),
        ),
        (
            "self.yaml",
            service("self", 8083, "10.96.0.13", "Cluster", None, &[b]),
        ),
    ]);
    for iface in ["lxca", "lxcb", "lxcc"] {
        for ingress in [true, false] {
            assert!(bed.pin_exists(iface, ingress), "{iface}: {}", bed.logs());
        }
    }
    let client = &bed.pods[0];

    for (file, name, target, vip, np, itp, eps_after) in [
        (
            "cip.yaml",
            "cip",
            8080,
            "10.96.0.10:53",
            None,
            "Cluster",
            vec![c],
        ),
        (
            "np.yaml",
            "np",
            8081,
            "10.100.0.2:30053",
            Some((30053, 30080)),
            "Cluster",
            vec![c],
        ),
        (
            "itp.yaml",
            "itp",
            8082,
            "10.96.0.12:53",
            None,
            "Local",
            vec![c, remote],
        ),
    ] {
        let to: SocketAddr = vip.parse().expect("addr");
        let sock = connected_udp(client, to);
        let vip_ip = if np.is_some() {
            "10.96.0.11"
        } else {
            vip.split(':').next().expect("vip")
        };
        let gap = follow_backend_change(&sock, "podb", "podc", || {
            write(
                &bed.dir,
                file,
                &service(name, target, vip_ip, itp, np, &eps_after),
            );
        });
        eprintln!("{name}: last answer from podb to first from podc: {gap:?}");
        assert!(
            gap < Duration::from_secs(1),
            "{name}: answers resumed from the new backend after {gap:?}\n{}",
            bed.logs()
        );
        assert_eq!(
            sock.peer_addr().expect("peer"),
            to,
            "getpeername: the frontend"
        );
        // The client's own address reached the backend (no SNAT for a local backend).
        let (who, seen) = ask_udp_once(client, to).expect("udp");
        assert_eq!((who.as_str(), seen.as_str()), ("podc", "10.244.0.10"));
    }

    // TCP from the pod, per packet: to the ClusterIP and the NodePort.
    for to in ["10.96.0.10:80", "10.100.0.2:30080"] {
        let to: SocketAddr = to.parse().expect("addr");
        let (who, seen) = ask_tcp(client, to).expect("tcp");
        assert_eq!(
            (who.as_str(), seen.as_str()),
            ("podc", "10.244.0.10"),
            "{to}"
        );
    }

    // Hairpin: pod b to its own Service, balanced to itself; it sees the node's address
    // as the source (as kube-proxy masquerades hairpin traffic), and the frontend as the
    // peer.
    let podb = &bed.pods[1];
    let to: SocketAddr = "10.96.0.13:53".parse().expect("addr");
    let (who, seen) = ask_udp_once(podb, to).expect("hairpin udp");
    assert_eq!((who.as_str(), seen.as_str()), ("podb", NODE_ADDR));
    let to: SocketAddr = "10.96.0.13:80".parse().expect("addr");
    let (who, seen) = ask_tcp(podb, to).expect("hairpin tcp");
    assert_eq!((who.as_str(), seen.as_str()), ("podb", NODE_ADDR));

    let metrics = bed.agent.as_ref().expect("agent").metrics();
    assert!(
        metrics.contains("ebpf_proxy_pod_interfaces 3"),
        "pod interface gauge: {metrics}"
    );
}

/// A pod made after the agent started is handled from its first datagram (the attach
/// follows the link event before the CNI has finished plumbing); deleting its interface
/// removes its pins and leaves no link behind.
#[test]
fn late_pod_first_packet_and_removal() {
    let bed = Bed::new(&[(
        "cip.yaml",
        service(
            "cip",
            8080,
            "10.96.0.10",
            "Cluster",
            None,
            &[("10.244.0.11", "node-a")],
        ),
    )]);
    let node = &bed.node;
    let pod = Netns::new(unique("h1p-"));
    let made = Instant::now();
    run(
        "ip",
        &[
            "link",
            "add",
            "lxcd",
            "netns",
            &node.node.name,
            "type",
            "veth",
            "peer",
            "name",
            "eth0",
            "netns",
            &pod.name,
        ],
    );
    let created = made.elapsed();
    // The window: from the veth's creation to both hooks pinned (measured in parallel
    // with the plumbing, as a CNI would go on).
    let watch = {
        let pins = bed.env.pins.path.join("links");
        std::thread::spawn(move || {
            let start = Instant::now();
            while start.elapsed() < Duration::from_secs(10) {
                if pins.join("tc-lxcd-ingress").exists() && pins.join("tc-lxcd-egress").exists() {
                    return Some(start.elapsed());
                }
                std::thread::sleep(Duration::from_micros(200));
            }
            None
        })
    };
    node.plumb(&pod, "lxcd", "10.244.0.13");
    let plumbed = made.elapsed();
    // The first packet the pod ever sends: one datagram, no retry.
    let (who, seen) = ask_udp_once(&pod, "10.96.0.10:53".parse().expect("addr"))
        .unwrap_or_else(|e| panic!("the new pod's first datagram: {e}\n{}", bed.logs()));
    assert_eq!((who.as_str(), seen.as_str()), ("podb", "10.244.0.13"));
    let window = watch
        .join()
        .expect("watch")
        .expect("lxcd hooks pinned within 10 s");
    eprintln!(
        "late pod: veth made in {created:?}; hooks pinned {window:?} after that; CNI plumbing done {plumbed:?} after the start"
    );

    // The link ids behind the pins, then the interface goes.
    let ids: Vec<u32> = [true, false]
        .iter()
        .map(|ingress| {
            let dir = if *ingress { "ingress" } else { "egress" };
            link_id(
                &bed.env
                    .pins
                    .path
                    .join("links")
                    .join(format!("tc-lxcd-{dir}")),
            )
        })
        .collect();
    node.node.ip(&["link", "del", "lxcd"]);
    let start = Instant::now();
    while bed.pin_exists("lxcd", true) || bed.pin_exists("lxcd", false) {
        assert!(
            start.elapsed() < Duration::from_secs(5),
            "lxcd's pins still there 5 s after it was deleted\n{}",
            bed.logs()
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    for id in ids {
        assert!(
            !link_exists(id),
            "link {id} of the deleted interface remains"
        );
    }
    // The others are untouched.
    assert!(bed.pin_exists("lxca", true) && bed.pin_exists("lxcb", false));
    let metrics = bed.agent.as_ref().expect("agent").metrics();
    assert!(
        metrics.contains("ebpf_proxy_pod_interfaces 3"),
        "pod interface gauge back to 3: {metrics}"
    );
    assert!(
        !metrics.contains("ebpf_proxy_pod_interface_errors_total{"),
        "no pod interface errors: {metrics}"
    );
}

/// The id of the BPF link pinned at `path` (`BPF_OBJ_GET` + `BPF_OBJ_GET_INFO_BY_FD`).
fn link_id(path: &Path) -> u32 {
    use aya::programs::links::PinnedLink;
    let link = PinnedLink::from_pin(path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    let fd: aya::programs::links::FdLink = link.into();
    let info = fd.info().expect("link info");
    info.id()
}

/// Whether a BPF link with this id exists (`BPF_LINK_GET_FD_BY_ID`).
fn link_exists(id: u32) -> bool {
    #[repr(C)]
    struct Attr {
        id: u32,
        next_id: u32,
        open_flags: u32,
        _pad: [u32; 13],
    }
    let attr = Attr {
        id,
        next_id: 0,
        open_flags: 0,
        _pad: [0; 13],
    };
    const BPF_LINK_GET_FD_BY_ID: i64 = 30;
    // SAFETY: a valid attr of the size passed.
    let fd = unsafe {
        libc::syscall(
            libc::SYS_bpf,
            BPF_LINK_GET_FD_BY_ID,
            &attr as *const Attr,
            std::mem::size_of::<Attr>() as u32,
        )
    };
    if fd >= 0 {
        // SAFETY: our fd.
        unsafe { libc::close(fd as i32) };
        return true;
    }
    false
}

/// An outcome counter of the socket and TC hooks (`STATS`).
fn counter(pins: &Path, reason: Reason) -> u64 {
    BpfMaps::open(pins)
        .expect("open maps")
        .stats()
        .expect("stats")
        .into_iter()
        .find(|(r, _)| *r == reason)
        .map(|(_, v)| v)
        .expect("counter")
}

/// `--socket-lb tcp` with this process in the hooked cgroup: a pod's connected UDP socket
/// is left to the per-packet path (it follows a backend change and is never destroyed),
/// its TCP is translated at connect(); the host's (the agent's namespace) UDP keeps socket
/// LB; a pod whose cgroup is in `SOCK_LB_BYPASS` sends to the ClusterIP itself (seen on
/// its interface) and is still balanced, per packet.
#[test]
fn socket_lb_tcp_mode_and_bypass() {
    let bed = Bed::with(
        TestEnv::without_datapath(0),
        &[(
            "cip.yaml",
            service(
                "cip",
                8080,
                "10.96.0.10",
                "Cluster",
                None,
                &[("10.244.0.11", "node-a")],
            ),
        )],
        &["--socket-lb", "tcp"],
    );
    let pins = bed.env.pins.path.clone();
    assert_eq!(
        socklb::get(pins.as_path()).expect("SOCK_LB"),
        Some(socklb::SocketLb::Tcp)
    );
    let client = &bed.pods[0];
    let to: SocketAddr = "10.96.0.10:53".parse().expect("addr");

    // A pod's connected UDP socket: not translated at connect() (its peer is the
    // frontend in the kernel too), follows the backend's replacement; had the socket hook
    // translated it, the agent would destroy it when podb leaves and send() would fail.
    let translated = counter(&pins, Reason::Translated);
    let sock = connected_udp(client, to);
    let gap = follow_backend_change(&sock, "podb", "podc", || {
        write(
            &bed.dir,
            "cip.yaml",
            &service(
                "cip",
                8080,
                "10.96.0.10",
                "Cluster",
                None,
                &[("10.244.0.12", "node-a")],
            ),
        );
    });
    eprintln!("socket-lb tcp, pod UDP: last answer from podb to first from podc: {gap:?}");
    assert!(gap < Duration::from_secs(1), "{gap:?}\n{}", bed.logs());
    assert_eq!(sock.peer_addr().expect("peer"), to);
    assert_eq!(
        counter(&pins, Reason::Translated),
        translated,
        "a pod's UDP socket was translated by the socket hooks in tcp mode"
    );
    let metrics = bed.agent.as_ref().expect("agent").metrics();
    assert!(
        metrics.contains("ebpf_proxy_stale_udp_sockets_destroyed_total 0"),
        "no socket destroyed: {metrics}"
    );

    // The pod's TCP: translated at connect(), no TC flow.
    let (translated, tc_flows) = (
        counter(&pins, Reason::Translated),
        counter(&pins, Reason::TcNewFlow),
    );
    let (who, seen) = ask_tcp(client, "10.96.0.10:80".parse().expect("addr")).expect("tcp");
    assert_eq!((who.as_str(), seen.as_str()), ("podc", "10.244.0.10"));
    assert_eq!(counter(&pins, Reason::Translated), translated + 1);
    assert_eq!(counter(&pins, Reason::TcNewFlow), tc_flows);

    // The host's UDP (the agent's network namespace): socket LB, no TC flow.
    let (translated, tc_flows) = (
        counter(&pins, Reason::Translated),
        counter(&pins, Reason::TcNewFlow),
    );
    let (who, _) = ask_udp_once(&bed.node.node, to).expect("host udp");
    assert_eq!(who, "podc");
    assert_eq!(counter(&pins, Reason::Translated), translated + 1);
    assert_eq!(counter(&pins, Reason::TcNewFlow), tc_flows);

    // A bypass pod: a process of pod a in a child cgroup listed in SOCK_LB_BYPASS.
    let bypass = bed.env.cgroup.path.join("bypass");
    fs::create_dir(&bypass).expect("bypass cgroup");
    let _rm = RemoveDir(bypass.clone());
    socklb::set_bypass(
        pins.as_path(),
        socklb::cgroup_id(&bypass).expect("id"),
        true,
    )
    .expect("bypass");
    let capture = Capture::start(&bed.node.node, "lxca");
    let (translated, tc_flows) = (
        counter(&pins, Reason::Translated),
        counter(&pins, Reason::TcNewFlow),
    );
    let out = in_cgroup(
        &bypass,
        client,
        "import socket; s = socket.create_connection(('10.96.0.10', 80), timeout=3); \
         s.sendall(b'hi\\n'); print(s.recv(100).decode().split()[0], s.getpeername()[0])",
    );
    assert_eq!(out.trim(), "podc 10.96.0.10", "bypass pod: answer and peer");
    let syn = capture.wait_for(|f| {
        f.proto == 6 && f.dst == [10, 96, 0, 10] && f.dport == 80 && f.src == [10, 244, 0, 10]
    });
    assert!(
        syn,
        "no packet to the ClusterIP seen on lxca from the bypass pod"
    );
    assert_eq!(
        counter(&pins, Reason::Translated),
        translated,
        "bypass: no socket translation"
    );
    assert_eq!(
        counter(&pins, Reason::TcNewFlow),
        tc_flows + 1,
        "bypass: one TC flow"
    );
    socklb::set_bypass(
        pins.as_path(),
        socklb::cgroup_id(&bypass).expect("id"),
        false,
    )
    .expect("bypass off");
}

struct RemoveDir(PathBuf);

impl Drop for RemoveDir {
    fn drop(&mut self) {
        let _ = fs::remove_dir(&self.0);
    }
}

/// Runs a Python snippet in `cgroup` and `pod`'s network namespace; its stdout.
fn in_cgroup(cgroup: &Path, pod: &Netns, script: &str) -> String {
    use std::os::unix::process::CommandExt as _;
    let procs = cgroup.join("cgroup.procs");
    let mut cmd = std::process::Command::new("nsenter");
    cmd.arg(format!("--net={}", pod.path().display())).args([
        "--",
        "/usr/bin/python3",
        "-c",
        script,
    ]);
    // SAFETY: only a write(2) to a file between fork and exec.
    unsafe {
        cmd.pre_exec(move || fs::write(&procs, "0"));
    }
    let out = cmd.output().expect("python3");
    assert!(
        out.status.success(),
        "python3 in the bypass cgroup: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// An IPv4 TCP/UDP packet's header fields.
struct Frame {
    proto: u8,
    src: [u8; 4],
    dst: [u8; 4],
    dport: u16,
}

/// An AF_PACKET capture on an interface of a namespace (what `tcpdump -i` sees: ingress
/// before TC), running in a thread.
struct Capture {
    frames: std::sync::mpsc::Receiver<Frame>,
}

impl Capture {
    fn start(ns: &Netns, iface: &str) -> Self {
        let (tx, rx) = std::sync::mpsc::channel();
        let (ready_tx, ready_rx) = std::sync::mpsc::channel();
        let path = ns.path();
        let iface = std::ffi::CString::new(iface).expect("name");
        std::thread::spawn(move || {
            let _g = support::NetnsGuard::enter(&path);
            // SAFETY: plain syscalls on our own descriptor and buffers.
            unsafe {
                let fd = libc::socket(
                    libc::AF_PACKET,
                    libc::SOCK_RAW,
                    i32::from((libc::ETH_P_ALL as u16).to_be()),
                );
                assert!(fd >= 0, "AF_PACKET socket");
                let mut sll: libc::sockaddr_ll = std::mem::zeroed();
                sll.sll_family = libc::AF_PACKET as u16;
                sll.sll_protocol = (libc::ETH_P_ALL as u16).to_be();
                sll.sll_ifindex = libc::if_nametoindex(iface.as_ptr()) as i32;
                assert!(sll.sll_ifindex > 0, "capture interface");
                let r = libc::bind(
                    fd,
                    &sll as *const _ as *const libc::sockaddr,
                    std::mem::size_of::<libc::sockaddr_ll>() as u32,
                );
                assert_eq!(r, 0, "bind AF_PACKET");
                let tv = libc::timeval {
                    tv_sec: 0,
                    tv_usec: 200_000,
                };
                libc::setsockopt(
                    fd,
                    libc::SOL_SOCKET,
                    libc::SO_RCVTIMEO,
                    &tv as *const _ as *const libc::c_void,
                    std::mem::size_of::<libc::timeval>() as u32,
                );
                let _ = ready_tx.send(());
                let start = Instant::now();
                let mut buf = [0u8; 2048];
                while start.elapsed() < Duration::from_secs(15) {
                    let n = libc::recv(fd, buf.as_mut_ptr() as *mut libc::c_void, buf.len(), 0);
                    if n < 34 || buf[12..14] != [0x08, 0x00] {
                        continue;
                    }
                    let ip = &buf[14..n as usize];
                    let ihl = usize::from(ip[0] & 0xf) * 4;
                    if ip.len() < ihl + 4 {
                        continue;
                    }
                    let f = Frame {
                        proto: ip[9],
                        src: ip[12..16].try_into().expect("4"),
                        dst: ip[16..20].try_into().expect("4"),
                        dport: u16::from_be_bytes([ip[ihl + 2], ip[ihl + 3]]),
                    };
                    if tx.send(f).is_err() {
                        break;
                    }
                }
                libc::close(fd);
            }
        });
        ready_rx
            .recv_timeout(Duration::from_secs(5))
            .expect("capture started");
        Self { frames: rx }
    }

    /// Whether a frame matching `want` was captured (waits up to 5 s).
    fn wait_for(&self, want: impl Fn(&Frame) -> bool) -> bool {
        let start = Instant::now();
        while start.elapsed() < Duration::from_secs(5) {
            match self.frames.recv_timeout(Duration::from_millis(200)) {
                Ok(f) if want(&f) => return true,
                Ok(_) | Err(std::sync::mpsc::RecvTimeoutError::Timeout) => {}
                Err(_) => return false,
            }
        }
        false
    }
}

/// The ClusterIP Service of the bypass test (TCP 80 -> 8080 on pod b), as API objects.
fn api_service() -> [Value; 2] {
    [
        json!({"apiVersion": "v1", "kind": "Service",
            "metadata": {"name": "cip", "namespace": "default"},
            "spec": {"type": "ClusterIP", "clusterIP": "10.96.0.10", "clusterIPs": ["10.96.0.10"],
                     "ports": [{"name": "http", "port": 80, "targetPort": 8080, "protocol": "TCP"}]}}),
        json!({"apiVersion": "discovery.k8s.io/v1", "kind": "EndpointSlice",
            "metadata": {"name": "cip-1", "namespace": "default",
                         "labels": {"kubernetes.io/service-name": "cip"}},
            "addressType": "IPv4",
            "ports": [{"name": "http", "port": 8080, "protocol": "TCP"}],
            "endpoints": [{"addresses": ["10.244.0.11"], "nodeName": "node-a",
                           "conditions": {"ready": true}}]}),
    ]
}

const AMBIENT: &str = "istio.io/dataplane-mode";

fn api_pod(namespace: &str, name: &str, node: &str, ambient: bool) -> Value {
    let labels = if ambient {
        json!({"app": name, AMBIENT: "ambient"})
    } else {
        json!({"app": name})
    };
    json!({"apiVersion": "v1", "kind": "Pod",
        "metadata": {"name": name, "namespace": namespace, "labels": labels},
        "spec": {"nodeName": node, "containers": [{"name": "c", "image": "x"}]},
        "status": {"phase": "Running"}})
}

fn api_namespace(name: &str, ambient: bool) -> Value {
    let labels = if ambient {
        json!({AMBIENT: "ambient"})
    } else {
        json!({})
    };
    json!({"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": name, "labels": labels}})
}

/// kubelet-like cgroups under the test's cgroup: a pod's directory and one container's
/// child in it, removed (children first) on drop.
struct PodCgroup {
    pod: PathBuf,
    container: PathBuf,
    made: Vec<PathBuf>,
}

impl PodCgroup {
    /// `rel` is the pod's directory under the cgroup root, as kubelet names it.
    fn new(root: &Path, rel: &str) -> Self {
        let pod = root.join(rel);
        let mut made = Vec::new();
        let mut dir = root.to_path_buf();
        for part in Path::new(rel).components() {
            dir.push(part);
            if !dir.exists() {
                fs::create_dir(&dir).unwrap_or_else(|e| panic!("{}: {e}", dir.display()));
                made.push(dir.clone());
            }
        }
        let container = pod.join("cri-containerd-0123abcd.scope");
        fs::create_dir(&container).expect("container cgroup");
        made.push(container.clone());
        Self {
            pod,
            container,
            made,
        }
    }
}

impl Drop for PodCgroup {
    fn drop(&mut self) {
        for d in self.made.iter().rev() {
            let _ = fs::remove_dir(d);
        }
    }
}

/// Waits until the agent's log has `n` lines containing `what` (10 s).
fn wait_log(bed: &Bed, what: &str, n: usize) {
    let start = Instant::now();
    while bed.logs().matches(what).count() < n {
        assert!(
            start.elapsed() < Duration::from_secs(10),
            "no {n}x {what:?} in the agent's log after 10 s:\n{}",
            bed.logs()
        );
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// One TCP exchange with the ClusterIP from a process in `cgroup` (a container's) and
/// pod a's network namespace; whether the socket hooks translated it (else TC did, per
/// packet: asserted either way, with the answer from the backend and the frontend as
/// the peer). With `capture`, the ClusterIP must also be seen on the pod's interface.
fn exchange(bed: &Bed, cgroup: &Path, capture: bool) -> bool {
    let pins = bed.env.pins.path.clone();
    let cap = capture.then(|| Capture::start(&bed.node.node, "lxca"));
    let (translated, tc_flows) = (
        counter(&pins, Reason::Translated),
        counter(&pins, Reason::TcNewFlow),
    );
    let out = in_cgroup(
        cgroup,
        &bed.pods[0],
        "import socket; s = socket.create_connection(('10.96.0.10', 80), timeout=3); \
         s.sendall(b'hi\\n'); print(s.recv(100).decode().split()[0], s.getpeername()[0])",
    );
    assert_eq!(out.trim(), "podb 10.96.0.10", "answer and peer");
    let by_socket = counter(&pins, Reason::Translated) - translated;
    let by_tc = counter(&pins, Reason::TcNewFlow) - tc_flows;
    assert_eq!(
        (by_socket + by_tc, by_socket.min(by_tc)),
        (1, 0),
        "one translation, socket or TC: {by_socket} socket, {by_tc} TC"
    );
    if let Some(cap) = cap {
        assert!(
            cap.wait_for(|f| f.proto == 6
                && f.dst == [10, 96, 0, 10]
                && f.dport == 80
                && f.src == [10, 244, 0, 10]),
            "no packet to the ClusterIP seen on lxca"
        );
    }
    by_socket == 1
}

/// The socket-LB bypass from labels, through the API (what ships): the agent watches
/// this node's Pods and the Namespaces and puts a selected pod's kubelet cgroup in
/// `SOCK_LB_BYPASS`; a process in a container's cgroup (a child of the pod's, which the
/// hooks reach through its ancestor) then sends to the ClusterIP itself (seen on the
/// pod's interface) and is balanced per packet. A pod labelled before kubelet made its
/// cgroup is bypassed once the cgroup appears; removing the label returns it to socket
/// LB; a namespace label works the same (systemd and cgroupfs layouts); an unlabelled
/// pod, a labelled pod of another node and a labelled host-network pod keep socket LB.
#[test]
fn socket_lb_bypass_from_pod_and_namespace_labels() {
    let bed = Bed::with_api(
        TestEnv::without_datapath(0),
        |api| {
            api.apply_many(api_service());
            api.apply(api_namespace("default", false));
            api.apply(api_namespace("mesh", true));
            api.apply(api_pod("default", "client", "node-a", true));
            api.apply(api_pod("default", "plain", "node-a", false));
            api.apply(api_pod("mesh", "inmesh", "node-a", false));
            api.apply(api_pod("default", "remote", "node-b", true));
            let mut hostnet = api_pod("default", "hostnet", "node-a", true);
            hostnet["spec"]["hostNetwork"] = true.into();
            api.apply(hostnet);
        },
        &["--socket-lb", "tcp"],
    );
    let api = bed.api.as_ref().expect("api");
    let uid = |ns: &str, name: &str| {
        api.get("Pod", ns, name).expect("pod")["metadata"]["uid"]
            .as_str()
            .expect("uid")
            .to_string()
    };
    let root = bed.env.cgroup.path.clone();
    let (client, plain, inmesh, remote, hostnet) = (
        uid("default", "client"),
        uid("default", "plain"),
        uid("mesh", "inmesh"),
        uid("default", "remote"),
        uid("default", "hostnet"),
    );
    // The labelled pod's cgroup does not exist yet: the agent waits for it.
    wait_log(&bed, "the pod's cgroup is not there yet", 2);
    let systemd = |qos: &str, uid: &str| {
        format!(
            "kubepods.slice/kubepods-{qos}.slice/kubepods-{qos}-pod{}.slice",
            uid.replace('-', "_")
        )
    };
    let client_cg = PodCgroup::new(&root, &systemd("burstable", &client));
    let plain_cg = PodCgroup::new(
        &root,
        &format!(
            "kubepods.slice/kubepods-pod{}.slice",
            plain.replace('-', "_")
        ),
    );
    let inmesh_cg = PodCgroup::new(&root, &format!("kubepods/besteffort/pod{inmesh}"));
    // Another node's pod: never watched (fieldSelector spec.nodeName), whatever its cgroup.
    let remote_cg = PodCgroup::new(&root, &systemd("besteffort", &remote));
    // A host-network pod: its traffic has no pod interface to be translated on.
    let hostnet_cg = PodCgroup::new(&root, &systemd("besteffort", &hostnet));
    wait_log(&bed, "socket LB bypassed for the pod", 2);

    assert!(
        !exchange(&bed, &client_cg.container, true),
        "a labelled pod's container: per packet"
    );
    assert!(
        !exchange(&bed, &inmesh_cg.container, true),
        "a pod of a labelled namespace: per packet"
    );
    assert!(
        exchange(&bed, &plain_cg.container, false),
        "an unlabelled pod keeps socket LB"
    );
    assert!(
        exchange(&bed, &remote_cg.container, false),
        "another node's pod is not this agent's"
    );
    assert!(
        exchange(&bed, &hostnet_cg.container, false),
        "a host-network pod keeps socket LB"
    );
    assert!(
        !exchange(&bed, &client_cg.pod, false),
        "the pod's own cgroup too"
    );

    // The label removed from the pod, then from the namespace: socket LB again.
    api.apply(api_pod("default", "client", "node-a", false));
    wait_log(&bed, "socket LB applies again to the pod", 1);
    assert!(
        exchange(&bed, &client_cg.container, false),
        "the pod without its label"
    );
    api.apply(api_namespace("mesh", false));
    wait_log(&bed, "socket LB applies again to the pod", 2);
    assert!(
        exchange(&bed, &inmesh_cg.container, false),
        "the namespace without its label"
    );
    // Labelled again, then the pod deleted: its entry goes.
    api.apply(api_pod("default", "client", "node-a", true));
    wait_log(&bed, "socket LB bypassed for the pod", 3);
    assert!(!exchange(&bed, &client_cg.container, false));
    api.delete("Pod", "default", "client");
    wait_log(&bed, "socket LB applies again to the pod", 3);
    assert!(exchange(&bed, &client_cg.container, false));
    assert!(
        !bed.logs().contains(&remote),
        "the other node's pod was never seen"
    );
}

fn manifest_pod(name: &str, uid: &str, node: &str, ambient: bool) -> String {
    let label = if ambient {
        ", istio.io/dataplane-mode: ambient"
    } else {
        ""
    };
    format!(
        "apiVersion: v1\nkind: Pod\nmetadata: {{name: {name}, namespace: default, uid: {uid}, labels: {{app: {name}{label}}}}}\nspec: {{nodeName: {node}, containers: [{{name: c, image: x}}]}}\n"
    )
}

/// The same bypass from a manifests directory (tests and demos without an API server):
/// its Pods (this node's only) and Namespaces go to the bypass, the rest to the syncer.
#[test]
fn socket_lb_bypass_from_a_manifests_directory() {
    let (uid, other) = (
        "0b0e0001-aaaa-4bbb-8ccc-000000000001",
        "0b0e0001-aaaa-4bbb-8ccc-000000000002",
    );
    let bed = Bed::with(
        TestEnv::without_datapath(0),
        &[
            (
                "cip.yaml",
                service(
                    "cip",
                    8080,
                    "10.96.0.10",
                    "Cluster",
                    None,
                    &[("10.244.0.11", "node-a")],
                ),
            ),
            ("pod.yaml", manifest_pod("client", uid, "node-a", true)),
            (
                "other.yaml",
                manifest_pod("elsewhere", other, "node-b", true),
            ),
        ],
        &["--socket-lb", "tcp"],
    );
    let root = bed.env.cgroup.path.clone();
    let client_cg = PodCgroup::new(&root, &format!("kubepods/burstable/pod{uid}"));
    let other_cg = PodCgroup::new(&root, &format!("kubepods/burstable/pod{other}"));
    wait_log(&bed, "socket LB bypassed for the pod", 1);
    assert!(!exchange(&bed, &client_cg.container, true), "per packet");
    assert!(
        exchange(&bed, &other_cg.container, false),
        "another node's pod"
    );
    write(
        &bed.dir,
        "pod.yaml",
        &manifest_pod("client", uid, "node-a", false),
    );
    wait_log(&bed, "socket LB applies again to the pod", 1);
    assert!(
        exchange(&bed, &client_cg.container, false),
        "the label removed"
    );
    assert_eq!(
        bed.logs().matches("socket LB bypassed for the pod").count(),
        1
    );
}
