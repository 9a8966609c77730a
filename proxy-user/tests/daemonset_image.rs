//! The shipped image started as the DaemonSet starts it. The image (`localhost/ebpf-proxy:dev`,
//! built beforehand by `cargo xtask image`) is opened with `buildah from` + `buildah mount`,
//! and its root file system run by hand (podman cannot run containers on this machine:
//! crun's setrlimit is refused), as a container runtime would set it up from
//! `deploy/base/daemonset.yaml`:
//! - the node is a network namespace made by the test (a veth `eth0` with the node's
//!   address; `PROXY_INTERFACES=auto` picks it), the fake kube-apiserver listens inside it
//!   (HTTPS, the shipped RBAC) and the agent finds it through `KUBERNETES_SERVICE_HOST`/
//!   `_PORT` and the service-account volume, as in `agent_kube_tls.rs`;
//! - a private mount namespace; the image's root read-only (`readOnlyRootFilesystem`);
//!   the hostPath volumes: bpffs (a per-run directory of the machine's bpffs mounted at
//!   `/sys/fs/bpf`), the host cgroup (a child cgroup made for the test, read-only at
//!   `/host/sys/fs/cgroup`), the xtables lock (a per-run file at `/run/xtables.lock`), and
//!   `/lib/modules` read-only; `/proc` of the host (`hostPID: true`), a read-only sysfs;
//! - the environment: the ConfigMap's values as they are, `NODE_NAME` (downward API),
//!   nothing else;
//! - the capability bounding set cut with the image's `setpriv` to exactly what the
//!   DaemonSet adds (read from the manifest), after the init container ran with all of them
//!   (it is privileged).
//!
//! kube-proxy's leftovers of each mode (iptables through all four tools, nftables, an IPVS
//! ipset) are in the node first: the agent removes them with the image's own tools.
//! Then ClusterIP and NodePort traffic through it, `/healthz`, `/livez`, `/metrics`,
//! `proxyctl` inside the image reading the pins, SIGTERM, a restart adopting the pins with
//! no failed connection; and without one of the capabilities the agent stops with its
//! own message naming it. Needs root and the image; fails without either.

mod support;

use std::{
    net::SocketAddr,
    path::{Path, PathBuf},
    process::{Child, Command, Stdio},
    sync::{
        atomic::{AtomicBool, AtomicUsize, Ordering},
        Arc,
    },
    time::{Duration, Instant},
};

use serde_json::{json, Value};
use support::{
    apiserver::{FakeApiServer, ServiceAccountVolume},
    http_get, require_root, tcp_ask, unique, Netns, NetnsGuard, TestEnv, Topology,
};

const IMAGE: &str = "localhost/ebpf-proxy:dev";
const DAEMONSET: &str = include_str!("../../deploy/base/daemonset.yaml");
const CONFIGMAP: &str = include_str!("../../deploy/base/configmap.yaml");
const RBAC: &str = include_str!("../../deploy/base/rbac.yaml");
const SA_USER: &str = "system:serviceaccount:ebpf-proxy:ebpf-proxy";
const TARGET: u16 = 8080;
const NODE_V4: &str = "192.0.2.10";
const NODE_PORT: u16 = 30080;

/// Sets up the container's mounts in the private mount namespace it runs in, then execs
/// `chroot ROOTFS "$@"`.
const CONTAINER: &str = r#"set -e
R="$ROOTFS"
# Mount points the runtime would make, in the container's writable layer, before the
# root goes read-only.
# (Under $R/run, not $R/var/run: that is a symlink to the absolute /run, which would
# resolve to the machine's /run out here.)
mkdir -p "$R/host/sys/fs/cgroup" "$R/run/secrets/kubernetes.io/serviceaccount" "$R/lib/modules"
touch "$R/run/xtables.lock"
mount --bind "$R" "$R"
mount -o remount,bind,ro "$R"
mount -t proc proc "$R/proc"
mount -t sysfs -o ro sysfs "$R/sys"
mount -t tmpfs -o mode=755,size=1m tmpfs "$R/dev"
for d in null zero random urandom; do touch "$R/dev/$d"; mount --bind "/dev/$d" "$R/dev/$d"; done
mount --bind "$BPFFS_DIR" "$R/sys/fs/bpf"
mount --bind "$CGROUP_DIR" "$R/host/sys/fs/cgroup"
mount -o remount,bind,ro "$R/host/sys/fs/cgroup"
mount --bind "$XTABLES_LOCK" "$R/run/xtables.lock"
if [ -d /lib/modules ]; then mount --bind /lib/modules "$R/lib/modules"; mount -o remount,bind,ro "$R/lib/modules"; fi
mount --bind "$SA_DIR" "$R/run/secrets/kubernetes.io/serviceaccount"
mount -o remount,bind,ro "$R/run/secrets/kubernetes.io/serviceaccount"
exec chroot "$R" "$@""#;

/// The image's root file system, mounted; unmounted and removed on drop.
struct ImageRoot {
    container: String,
    path: PathBuf,
}

fn buildah(args: &[&str]) -> String {
    let out = Command::new("buildah")
        .args(args)
        .output()
        .unwrap_or_else(|e| {
            panic!("buildah {args:?}: {e} (is buildah installed? cargo xtask image)")
        });
    assert!(
        out.status.success(),
        "buildah {args:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).trim().to_owned()
}

impl ImageRoot {
    fn open() -> Self {
        let present = Command::new("buildah")
            .args(["inspect", "--type", "image", IMAGE])
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .status()
            .is_ok_and(|s| s.success());
        assert!(
            present,
            "the image {IMAGE} is not in the local storage: build it first with `cargo xtask image`"
        );
        let container = buildah(&[
            "from",
            "--pull-never",
            "--name",
            &unique("ebpf-proxy-test-"),
            IMAGE,
        ]);
        let path = PathBuf::from(buildah(&["mount", &container]));
        Self { container, path }
    }
}

impl Drop for ImageRoot {
    fn drop(&mut self) {
        let _ = Command::new("buildah")
            .args(["umount", &self.container])
            .output();
        let _ = Command::new("buildah")
            .args(["rm", &self.container])
            .output();
    }
}

/// The agent container's added capabilities, as `setpriv --bounding-set` takes them.
fn daemonset_capabilities() -> Vec<String> {
    let ds: Value = serde_yaml::from_str(DAEMONSET).expect("daemonset.yaml");
    let agent = ds["spec"]["template"]["spec"]["containers"]
        .as_array()
        .expect("containers")
        .iter()
        .find(|c| c["name"] == "agent")
        .expect("the agent container");
    assert_eq!(
        agent["securityContext"]["capabilities"]["drop"],
        json!(["ALL"])
    );
    assert_eq!(
        agent["securityContext"]["readOnlyRootFilesystem"],
        json!(true),
        "the test mounts the root read-only because the DaemonSet does"
    );
    agent["securityContext"]["capabilities"]["add"]
        .as_array()
        .expect("capabilities.add")
        .iter()
        .map(|c| c.as_str().expect("a capability name").to_ascii_lowercase())
        .collect()
}

/// The init container's script, as written in the DaemonSet.
fn init_script() -> String {
    let ds: Value = serde_yaml::from_str(DAEMONSET).expect("daemonset.yaml");
    let init = &ds["spec"]["template"]["spec"]["initContainers"][0];
    assert_eq!(init["name"], "mount-bpffs");
    assert_eq!(init["command"][0], "/bin/sh");
    init["command"][2]
        .as_str()
        .expect("the init script")
        .to_owned()
}

/// The ConfigMap's data as `KEY=VALUE`.
fn configmap_env() -> Vec<String> {
    let cm: Value = serde_yaml::from_str(CONFIGMAP).expect("configmap.yaml");
    cm["data"]
        .as_object()
        .expect("data")
        .iter()
        .map(|(k, v)| format!("{k}={}", v.as_str().expect("string values")))
        .collect()
}

/// Everything one container start needs.
struct Node {
    netns: Netns,
    root: ImageRoot,
    bpffs_dir: PathBuf,
    xtables_lock: PathBuf,
    sa: ServiceAccountVolume,
    api_port: u16,
}

impl Node {
    /// `chroot ROOTFS argv...` in the node's network namespace and a private mount
    /// namespace with the container's mounts; env: only the container's.
    fn command(&self, env: &TestEnv, argv: &[String]) -> Command {
        let mut cmd = Command::new("nsenter");
        cmd.arg(format!("--net={}", self.netns.path().display()))
            .args([
                "--",
                "unshare",
                "--mount",
                "--propagation",
                "private",
                "sh",
                "-c",
                CONTAINER,
                "sh",
            ])
            .args(argv)
            .env_clear()
            .env("PATH", "/usr/sbin:/usr/bin:/sbin:/bin")
            .env("ROOTFS", &self.root.path)
            .env("BPFFS_DIR", &self.bpffs_dir)
            .env("CGROUP_DIR", &env.cgroup.path)
            .env("XTABLES_LOCK", &self.xtables_lock)
            .env("SA_DIR", &self.sa.dir);
        cmd
    }

    /// The container's process: `env -i` with the container's environment, then `setpriv`
    /// with the bounding set `caps` (and no inheritable or ambient ones), then `argv`.
    fn container_argv(&self, caps: Option<&[String]>, argv: &[&str]) -> Vec<String> {
        let mut out = vec!["/usr/bin/env".to_owned(), "-i".to_owned()];
        out.push("PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin".into());
        out.extend(configmap_env());
        out.push("NODE_NAME=node-a".into());
        out.push("KUBERNETES_SERVICE_HOST=127.0.0.1".into());
        out.push(format!("KUBERNETES_SERVICE_PORT={}", self.api_port));
        // `None`: privileged (the init container), every capability.
        if let Some(caps) = caps {
            out.push("/usr/bin/setpriv".into());
            let set: Vec<String> = caps.iter().map(|c| format!("+{c}")).collect();
            out.push(format!("--bounding-set=-all,{}", set.join(",")));
            out.push("--inh-caps=-all".into());
            out.push("--".into());
        }
        out.extend(argv.iter().map(|s| (*s).to_owned()));
        out
    }

    fn start_agent(&self, env: &TestEnv, caps: &[String], log: &Path) -> Child {
        let log_file = std::fs::File::create(log).expect("log");
        self.command(
            env,
            &self.container_argv(Some(caps), &["/usr/local/bin/proxy-agent", "run"]),
        )
        .stdout(log_file.try_clone().expect("log"))
        .stderr(log_file)
        .spawn()
        .expect("start the container")
    }

    fn run(&self, env: &TestEnv, caps: Option<&[String]>, argv: &[&str]) -> (bool, String) {
        let out = self
            .command(env, &self.container_argv(caps, argv))
            .output()
            .expect("run in the container");
        let text = format!(
            "{}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
        (out.status.success(), text)
    }

    fn get(&self, port: u16, path: &str) -> std::io::Result<(u16, String)> {
        let _ns = NetnsGuard::enter(&self.netns.path());
        http_get(port, path)
    }
}

fn service() -> Value {
    json!({
        "apiVersion": "v1", "kind": "Service",
        "metadata": {"namespace": "default", "name": "web"},
        "spec": {"type": "NodePort", "clusterIP": "10.96.0.10", "clusterIPs": ["10.96.0.10"],
                 "ports": [{"name": "http", "port": 80, "protocol": "TCP", "targetPort": "http", "nodePort": NODE_PORT}]}
    })
}

fn slice(pods: &[usize]) -> Value {
    let eps: Vec<Value> = pods
        .iter()
        .map(|i| json!({"addresses": [Topology::pod_v4(*i).to_string()], "conditions": {"ready": true}, "nodeName": "node-a"}))
        .collect();
    json!({
        "apiVersion": "discovery.k8s.io/v1", "kind": "EndpointSlice",
        "metadata": {"namespace": "default", "name": "web-1", "labels": {"kubernetes.io/service-name": "web"}},
        "addressType": "IPv4",
        "ports": [{"name": "http", "port": TARGET, "protocol": "TCP"}],
        "endpoints": eps
    })
}

fn wait_for(limit: Duration, what: &str, mut ok: impl FnMut() -> bool) {
    let start = Instant::now();
    while !ok() {
        assert!(start.elapsed() < limit, "not within {limit:?}: {what}");
        std::thread::sleep(Duration::from_millis(50));
    }
}

fn from_pod(env: &TestEnv, addr: SocketAddr) -> Option<String> {
    env.in_client(|| tcp_ask(addr).ok().map(|(pod, _)| pod))
}

fn setup(env: &TestEnv) -> (Node, FakeApiServer) {
    let netns = Netns::new(unique("ebpf-proxy-node-"));
    // No dummy driver on this kernel: a veth pair, both ends in the node.
    netns.ip(&[
        "link", "add", "eth0", "type", "veth", "peer", "name", "eth1",
    ]);
    netns.ip(&["addr", "add", &format!("{NODE_V4}/24"), "dev", "eth0"]);
    netns.ip(&["link", "set", "eth1", "up"]);
    netns.ip(&["link", "set", "eth0", "up"]);
    // The API server inside the node's namespace: its listener is made there.
    let api = {
        let _ns = netns.enter();
        FakeApiServer::start_tls()
    };
    api.enforce_rbac(RBAC);
    let token = unique("sa-token-");
    api.add_token(&token, SA_USER);
    api.apply(json!({"apiVersion": "v1", "kind": "Node", "metadata": {"name": "node-a"}}));
    let sa_dir = std::env::temp_dir().join(unique("ebpf-proxy-sa-"));
    let sa = ServiceAccountVolume::create(&sa_dir, &token, &api.ca_pem(), "ebpf-proxy");
    let bpffs_dir = env.pins.path.clone();
    std::fs::create_dir_all(&bpffs_dir).expect("the per-run bpffs directory");
    let xtables_lock = std::env::temp_dir().join(unique("ebpf-proxy-xtables-lock-"));
    std::fs::write(&xtables_lock, "").expect("xtables lock");
    let node = Node {
        netns,
        root: ImageRoot::open(),
        bpffs_dir,
        xtables_lock,
        sa,
        api_port: api.addr().port(),
    };
    (node, api)
}

/// kube-proxy's iptables mode, in short, with the match and target extensions it uses
/// (comment, conntrack, mark/MARK, addrtype, statistic, tcp/udp, DNAT, MASQUERADE,
/// REJECT): the image's iptables tools must load each (its `xtables` modules and their
/// libraries) to read and remove it. `{A}`/`{P}`/`{H}`: an endpoint, the pod range, the
/// host prefix length, per family.
const KUBE_IPTABLES: &str = r#"*filter
:KUBE-FORWARD - [0:0]
:KUBE-EXTERNAL-SERVICES - [0:0]
-I FORWARD 1 -m comment --comment "kubernetes forwarding rules" -j KUBE-FORWARD
-I INPUT 1 -m conntrack --ctstate NEW -m comment --comment "kubernetes externally-visible service portals" -j KUBE-EXTERNAL-SERVICES
-A KUBE-FORWARD -m conntrack --ctstate INVALID -j DROP
-A KUBE-FORWARD -m comment --comment "kubernetes forwarding rules" -m mark --mark 0x4000/0x4000 -j ACCEPT
-A KUBE-EXTERNAL-SERVICES -p tcp -m comment --comment "default/empty:http has no endpoints" -m addrtype --dst-type LOCAL -m tcp --dport 30050 -j REJECT
COMMIT
*nat
:KUBE-SERVICES - [0:0]
:KUBE-POSTROUTING - [0:0]
:KUBE-MARK-MASQ - [0:0]
:KUBE-SVC-TCOU7JCQXEZGVUNU - [0:0]
:KUBE-SEP-IT2ZTR26TO4XFPTO - [0:0]
-I PREROUTING 1 -m comment --comment "kubernetes service portals" -j KUBE-SERVICES
-I OUTPUT 1 -m comment --comment "kubernetes service portals" -j KUBE-SERVICES
-I POSTROUTING 1 -m comment --comment "kubernetes postrouting rules" -j KUBE-POSTROUTING
-A KUBE-POSTROUTING -m mark ! --mark 0x4000/0x4000 -j RETURN
-A KUBE-POSTROUTING -j MARK --xor-mark 0x4000
-A KUBE-POSTROUTING -m comment --comment "kubernetes service traffic requiring SNAT" -j MASQUERADE --random-fully
-A KUBE-MARK-MASQ -j MARK --or-mark 0x4000
-A KUBE-SERVICES -d {D}/{H} -p udp -m comment --comment "kube-system/kube-dns:dns cluster IP" -m udp --dport 53 -j KUBE-SVC-TCOU7JCQXEZGVUNU
-A KUBE-SVC-TCOU7JCQXEZGVUNU ! -s {P} -d {D}/{H} -p udp -m comment --comment "kube-system/kube-dns:dns cluster IP" -m udp --dport 53 -j KUBE-MARK-MASQ
-A KUBE-SVC-TCOU7JCQXEZGVUNU -m comment --comment "kube-system/kube-dns:dns -> {E}:53" -m statistic --mode random --probability 0.50000000000 -j KUBE-SEP-IT2ZTR26TO4XFPTO
-A KUBE-SEP-IT2ZTR26TO4XFPTO -s {A}/{H} -m comment --comment "kube-system/kube-dns:dns" -j KUBE-MARK-MASQ
-A KUBE-SEP-IT2ZTR26TO4XFPTO -p udp -m comment --comment "kube-system/kube-dns:dns" -m udp -j DNAT --to-destination {E}:53
COMMIT
"#;

/// (tool, {D} the DNS ClusterIP, {P} pods, {A} the endpoint, {E} it as DNAT writes it, {H}).
const KUBE_IPTABLES_TOOLS: [(&str, [&str; 5]); 4] = [
    (
        "iptables-legacy",
        [
            "10.96.0.53",
            "10.244.0.0/16",
            "10.244.1.2",
            "10.244.1.2",
            "32",
        ],
    ),
    (
        "iptables-nft",
        [
            "10.96.0.53",
            "10.244.0.0/16",
            "10.244.1.2",
            "10.244.1.2",
            "32",
        ],
    ),
    (
        "ip6tables-legacy",
        [
            "fd00:96::35",
            "fd00:244::/56",
            "fd00:244:1::2",
            "[fd00:244:1::2]",
            "128",
        ],
    ),
    (
        "ip6tables-nft",
        [
            "fd00:96::35",
            "fd00:244::/56",
            "fd00:244:1::2",
            "[fd00:244:1::2]",
            "128",
        ],
    ),
];

/// kube-proxy's nftables mode (a table of its own) and IPVS mode's ipsets, in short.
const KUBE_NFT: &str = "table ip kube-proxy {\n\tcomment \"rules for kube-proxy\"\n\
    \tchain nat-prerouting { type nat hook prerouting priority -100; policy accept; }\n}\n";
const KUBE_IPSET: &str =
    "create KUBE-CLUSTER-IP hash:ip,port family inet hashsize 1024 maxelem 65536 comment\n\
    add KUBE-CLUSTER-IP 10.96.0.53,udp:53 comment \"kube-system/kube-dns:dns\"\n";

impl Node {
    /// `program args` of the machine (not the image's) in the node's network namespace.
    fn host_tool(&self, program: &str, args: &[&str], stdin: Option<&str>) -> String {
        let mut child = Command::new("nsenter")
            .arg(format!("--net={}", self.netns.path().display()))
            .arg(program)
            .args(args)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap_or_else(|e| panic!("nsenter {program}: {e}"));
        let mut pipe = child.stdin.take().expect("stdin");
        std::io::Write::write_all(&mut pipe, stdin.unwrap_or_default().as_bytes()).expect("stdin");
        drop(pipe);
        let out = child.wait_with_output().expect("wait");
        assert!(
            out.status.success(),
            "{program} {args:?} in the node: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        String::from_utf8_lossy(&out.stdout).into_owned()
    }

    /// kube-proxy's leftovers of each mode, written with the machine's tools.
    fn add_kube_proxy_leftovers(&self) {
        for (tool, [d, p, a, e, h]) in KUBE_IPTABLES_TOOLS {
            let rules = KUBE_IPTABLES
                .replace("{D}", d)
                .replace("{P}", p)
                .replace("{A}", a)
                .replace("{E}", e)
                .replace("{H}", h);
            self.host_tool(&format!("{tool}-restore"), &["--noflush"], Some(&rules));
        }
        self.host_tool("nft", &["-f", "-"], Some(KUBE_NFT));
        self.host_tool("ipset", &["restore"], Some(KUBE_IPSET));
    }

    /// What is left of kube-proxy's objects in the node, read with the machine's tools.
    fn kube_proxy_leftovers(&self) -> Vec<String> {
        let mut left = Vec::new();
        for (tool, _) in KUBE_IPTABLES_TOOLS {
            let saved = self.host_tool(&format!("{tool}-save"), &[], None);
            left.extend(
                saved
                    .lines()
                    .filter(|l| l.contains("KUBE-"))
                    .map(|l| format!("{tool}: {l}")),
            );
        }
        let nft = self.host_tool("nft", &["list", "tables"], None);
        left.extend(
            nft.lines()
                .filter(|l| l.contains("kube-proxy"))
                .map(|l| format!("nft: {l}")),
        );
        let sets = self.host_tool("ipset", &["list", "-n"], None);
        left.extend(
            sets.lines()
                .filter(|l| l.starts_with("KUBE-"))
                .map(|l| format!("ipset: {l}")),
        );
        left
    }
}

fn cleanup(node: &Node) {
    let pins = node.bpffs_dir.join("ebpf-proxy");
    if pins.exists() {
        if let Err(e) = proxy_user::loader::uninstall(&proxy_user::PinDir::new(&pins)) {
            eprintln!("uninstall {}: {e}", pins.display());
        }
    }
    let _ = std::fs::remove_file(&node.xtables_lock);
    let _ = std::fs::remove_dir_all(&node.sa.dir);
}

fn stop(child: &mut Child) -> Duration {
    let start = Instant::now();
    // SAFETY: signalling our own child by pid (nsenter execs unshare, which execs sh,
    // which execs chroot, which execs env, setpriv and the agent: one pid).
    unsafe { libc::kill(child.id() as i32, libc::SIGTERM) };
    loop {
        if let Some(status) = child.try_wait().expect("wait") {
            assert!(status.success(), "the agent's exit on SIGTERM: {status}");
            return start.elapsed();
        }
        if start.elapsed() > Duration::from_secs(30) {
            let _ = child.kill();
            panic!("the agent did not exit within the DaemonSet's 30 s grace period");
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

#[test]
fn image_runs_as_the_daemonset_starts_it() {
    require_root();
    let mut env = TestEnv::without_datapath(2);
    env.serve_all(TARGET);
    let (node, api) = setup(&env);
    api.apply(service());
    api.apply(slice(&[1]));
    let caps = daemonset_capabilities();
    let log = std::env::temp_dir().join(unique("ebpf-proxy-container-log-"));

    // The init container first (privileged: every capability).
    let (ok, out) = node.run(&env, None, &["/bin/sh", "-ec", &init_script()]);
    assert!(ok, "init container: {out}");
    assert!(
        out.contains("bpffs already mounted at /sys/fs/bpf"),
        "{out}"
    );

    // kube-proxy's leftovers in the node: the agent removes them with the image's tools
    // (PROXY_CLEANUP_KUBE_PROXY is on in the ConfigMap).
    node.add_kube_proxy_leftovers();
    assert!(!node.kube_proxy_leftovers().is_empty());

    let mut agent = node.start_agent(&env, &caps, &log);
    let logs = || std::fs::read_to_string(&log).unwrap_or_default();
    wait_for(Duration::from_secs(60), "/healthz 200", || {
        if let Some(status) = agent.try_wait().expect("wait") {
            panic!("the agent exited with {status}:\n{}", logs());
        }
        matches!(node.get(10256, "/healthz"), Ok((200, _)))
    });
    wait_for(
        Duration::from_secs(30),
        "kube-proxy cleanup finished",
        || logs().contains("kube-proxy cleanup finished"),
    );
    let text = logs();
    assert!(
        !text.contains("kube-proxy cleanup step failed"),
        "the image's tools failed:\n{text}"
    );
    let left = node.kube_proxy_leftovers();
    assert!(
        left.is_empty(),
        "kube-proxy's objects left: {left:#?}\n{text}"
    );
    assert!(matches!(node.get(10256, "/livez"), Ok((200, _))));
    let (code, metrics) = node.get(10249, "/metrics").expect("metrics");
    assert_eq!(code, 200);
    assert!(metrics.contains("# TYPE"), "{metrics}");

    let cluster_ip: SocketAddr = "10.96.0.10:80".parse().expect("addr");
    let node_port: SocketAddr = format!("{NODE_V4}:{NODE_PORT}").parse().expect("addr");
    wait_for(Duration::from_secs(10), "ClusterIP -> pod1", || {
        from_pod(&env, cluster_ip).as_deref() == Some("pod1")
    });
    wait_for(Duration::from_secs(10), "NodePort -> pod1", || {
        from_pod(&env, node_port).as_deref() == Some("pod1")
    });
    api.apply(slice(&[2]));
    wait_for(
        Duration::from_secs(10),
        "ClusterIP -> pod2 after the API change",
        || from_pod(&env, cluster_ip).as_deref() == Some("pod2"),
    );

    // proxyctl inside the image, with the DaemonSet's capabilities, reads the pins.
    let (ok, out) = node.run(&env, Some(&caps), &["/usr/local/bin/proxyctl", "services"]);
    assert!(ok, "proxyctl: {out}");
    assert!(
        out.contains("10.96.0.10") && out.contains(&NODE_PORT.to_string()),
        "{out}"
    );

    // SIGTERM and a restart of the container while a client keeps connecting.
    let stop_flag = Arc::new(AtomicBool::new(false));
    let (ok_count, failed) = (Arc::new(AtomicUsize::new(0)), Arc::new(AtomicUsize::new(0)));
    let client = {
        let (stop_flag, ok_count, failed) = (stop_flag.clone(), ok_count.clone(), failed.clone());
        let client_ns = env.topo.client.path();
        std::thread::spawn(move || {
            let _ns = NetnsGuard::enter(&client_ns);
            while !stop_flag.load(Ordering::SeqCst) {
                match tcp_ask(cluster_ip) {
                    Ok((pod, _)) if pod == "pod2" => ok_count.fetch_add(1, Ordering::SeqCst),
                    _ => failed.fetch_add(1, Ordering::SeqCst),
                };
                std::thread::sleep(Duration::from_millis(2));
            }
        })
    };
    let exit = stop(&mut agent);
    eprintln!("SIGTERM -> exit in {exit:?}");
    let first_log = logs();
    agent = node.start_agent(&env, &caps, &log);
    wait_for(
        Duration::from_secs(60),
        "/healthz 200 after the restart",
        || {
            if let Some(status) = agent.try_wait().expect("wait") {
                panic!("the restarted agent exited with {status}:\n{}", logs());
            }
            matches!(node.get(10256, "/healthz"), Ok((200, _)))
        },
    );
    std::thread::sleep(Duration::from_millis(300));
    stop_flag.store(true, Ordering::SeqCst);
    client.join().expect("client thread");
    let (ok_n, failed_n) = (
        ok_count.load(Ordering::SeqCst),
        failed.load(Ordering::SeqCst),
    );
    eprintln!("during SIGTERM and restart: {ok_n} connections answered by pod2, {failed_n} failed");
    assert_eq!(failed_n, 0, "connections failed across the restart");
    assert!(ok_n > 0);
    let restart_log = logs();
    assert!(
        restart_log.contains("adopted=") && !restart_log.contains("adopted=0"),
        "the restart adopts the pins:\n{restart_log}"
    );
    assert!(
        api.rejected_requests().is_empty(),
        "{:#?}",
        api.rejected_requests()
    );
    stop(&mut agent);
    eprintln!("first run's log:\n{first_log}");
    cleanup(&node);
    let _ = std::fs::remove_file(&log);
}

#[test]
fn without_cap_bpf_and_cap_sys_admin_the_agent_says_which_capability_is_missing() {
    require_root();
    let env = TestEnv::without_datapath(1);
    let (node, _api) = setup(&env);
    let caps: Vec<String> = daemonset_capabilities()
        .into_iter()
        // CAP_SYS_ADMIN stands in for CAP_BPF, CAP_PERFMON and CAP_NET_ADMIN alike (the
        // kernel's bpf_capable(), perfmon_capable(), bpf_net_capable()): removing any one
        // of those three alone changes nothing while CAP_SYS_ADMIN is there.
        .filter(|c| c != "bpf" && c != "sys_admin")
        .collect();
    let log = std::env::temp_dir().join(unique("ebpf-proxy-container-log-"));
    let mut agent = node.start_agent(&env, &caps, &log);
    let start = Instant::now();
    let status = loop {
        if let Some(status) = agent.try_wait().expect("wait") {
            break status;
        }
        assert!(
            start.elapsed() < Duration::from_secs(60),
            "the agent kept running without CAP_BPF and CAP_SYS_ADMIN"
        );
        std::thread::sleep(Duration::from_millis(50));
    };
    let text = std::fs::read_to_string(&log).unwrap_or_default();
    assert!(!status.success(), "{text}");
    assert!(
        text.contains(
            "lacks CAP_BPF or CAP_SYS_ADMIN (load the programs; create, pin and open maps)"
        ),
        "the agent's own message names the capability and what it is for:\n{text}"
    );
    cleanup(&node);
    let _ = std::fs::remove_file(&log);
}
