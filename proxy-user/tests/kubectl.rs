//! A real client against the test apiserver: `kubectl` (/usr/bin/kubectl) over HTTPS with
//! a bearer token creates, gets, lists, watches, patches and deletes Services,
//! EndpointSlices and Nodes, and shows the server's errors (404, 409, 403) as it shows
//! kube-apiserver's. This checks that `proxy_testbed::apiserver` speaks the API where the
//! agent and its tests depend on it. Needs no root; needs kubectl.

mod support;

use std::{
    io::{BufRead, BufReader},
    path::PathBuf,
    process::{Command, Output, Stdio},
    sync::mpsc,
    time::Duration,
};

use serde_json::Value;
use support::{apiserver::FakeApiServer, unique};

const RBAC: &str = include_str!("../../deploy/base/rbac.yaml");

struct Kubectl {
    kubeconfig: PathBuf,
    cache: PathBuf,
}

impl Kubectl {
    fn new(api: &FakeApiServer, token: &str) -> Self {
        let dir = std::env::temp_dir().join(unique("ebpf-proxy-kubectl-"));
        std::fs::create_dir_all(&dir).expect("temp dir");
        let kubeconfig = dir.join("kubeconfig");
        api.write_kubeconfig_with_token(&kubeconfig, token);
        Self {
            kubeconfig,
            cache: dir.join("cache"),
        }
    }

    fn command(&self, args: &[&str]) -> Command {
        let mut cmd = Command::new("kubectl");
        cmd.arg("--kubeconfig")
            .arg(&self.kubeconfig)
            .arg("--cache-dir")
            .arg(&self.cache)
            .args(["--request-timeout", "20s"])
            .args(args)
            .env_remove("KUBECONFIG");
        cmd
    }

    fn run(&self, args: &[&str], stdin: Option<&str>) -> Output {
        let mut child = self
            .command(args)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .expect("kubectl (install it: Debian's kubernetes-client)");
        if let Some(text) = stdin {
            use std::io::Write as _;
            child
                .stdin
                .take()
                .expect("stdin")
                .write_all(text.as_bytes())
                .expect("write stdin");
        }
        drop(child.stdin.take());
        child.wait_with_output().expect("kubectl output")
    }

    /// Runs and requires success; returns stdout.
    fn ok(&self, args: &[&str], stdin: Option<&str>) -> String {
        let out = self.run(args, stdin);
        let (stdout, stderr) = (
            String::from_utf8_lossy(&out.stdout).into_owned(),
            String::from_utf8_lossy(&out.stderr).into_owned(),
        );
        assert!(
            out.status.success(),
            "kubectl {args:?} failed:\nstdout: {stdout}\nstderr: {stderr}"
        );
        stdout
    }

    /// Runs and requires failure; returns stderr.
    fn fails(&self, args: &[&str], stdin: Option<&str>) -> String {
        let out = self.run(args, stdin);
        assert!(
            !out.status.success(),
            "kubectl {args:?} succeeded: {}",
            String::from_utf8_lossy(&out.stdout)
        );
        String::from_utf8_lossy(&out.stderr).into_owned()
    }
}

impl Drop for Kubectl {
    fn drop(&mut self) {
        if let Some(dir) = self.kubeconfig.parent() {
            let _ = std::fs::remove_dir_all(dir);
        }
    }
}

const SERVICE: &str = "apiVersion: v1
kind: Service
metadata:
  name: web
  namespace: default
spec:
  type: ClusterIP
  clusterIP: 10.96.0.10
  clusterIPs: [10.96.0.10]
  ports:
  - name: http
    port: 80
    protocol: TCP
    targetPort: 8080
";

const SLICE: &str = "apiVersion: discovery.k8s.io/v1
kind: EndpointSlice
metadata:
  name: web-1
  namespace: default
  labels:
    kubernetes.io/service-name: web
addressType: IPv4
ports:
- name: http
  port: 8080
  protocol: TCP
endpoints:
- addresses: [10.240.1.2]
  conditions: {ready: true}
";

const NODE: &str = "apiVersion: v1
kind: Node
metadata:
  name: node-a
";

fn json(text: &str) -> Value {
    serde_json::from_str(text).unwrap_or_else(|e| panic!("kubectl's JSON: {e}: {text}"))
}

fn admin() -> (FakeApiServer, Kubectl) {
    which_kubectl();
    let api = FakeApiServer::start_tls();
    let token = unique("admin-token-");
    api.add_token(&token, "kubernetes-admin");
    api.grant_all("kubernetes-admin");
    let kubectl = Kubectl::new(&api, &token);
    (api, kubectl)
}

fn which_kubectl() {
    let found = Command::new("kubectl")
        .args(["version", "--client"])
        .output()
        .is_ok_and(|o| o.status.success());
    assert!(
        found,
        "kubectl is needed (Debian's kubernetes-client, or /usr/bin/kubectl)"
    );
}

#[test]
fn kubectl_creates_gets_patches_and_deletes() {
    let (api, kubectl) = admin();
    assert_eq!(
        kubectl.ok(&["create", "-f", "-"], Some(SERVICE)).trim(),
        "service/web created"
    );
    assert_eq!(
        kubectl.ok(&["create", "-f", "-"], Some(SLICE)).trim(),
        "endpointslice.discovery.k8s.io/web-1 created"
    );
    assert_eq!(
        kubectl.ok(&["create", "-f", "-"], Some(NODE)).trim(),
        "node/node-a created"
    );
    assert!(api.get("Service", "default", "web").is_some());

    let svc = json(&kubectl.ok(
        &["get", "service", "web", "-n", "default", "-o", "json"],
        None,
    ));
    assert_eq!(svc["spec"]["clusterIP"], "10.96.0.10");
    assert!(svc["metadata"]["resourceVersion"].is_string());
    let list = kubectl.ok(&["get", "services", "-A"], None);
    assert!(list.contains("web"), "{list}");
    let slices = json(&kubectl.ok(
        &[
            "get",
            "endpointslices",
            "-n",
            "default",
            "-l",
            "kubernetes.io/service-name=web",
            "-o",
            "json",
        ],
        None,
    ));
    assert_eq!(
        slices["items"].as_array().map(Vec::len),
        Some(1),
        "{slices}"
    );
    let nodes = kubectl.ok(&["get", "nodes", "-o", "name"], None);
    assert_eq!(nodes.trim(), "node/node-a");

    // Patches: strategic (kubectl's default) and merge.
    assert_eq!(
        kubectl
            .ok(
                &[
                    "patch",
                    "service",
                    "web",
                    "-n",
                    "default",
                    "-p",
                    r#"{"metadata":{"labels":{"tier":"front"}}}"#
                ],
                None
            )
            .trim(),
        "service/web patched"
    );
    assert_eq!(
        api.get("Service", "default", "web").expect("web")["metadata"]["labels"]["tier"],
        "front"
    );
    kubectl.ok(
        &[
            "patch",
            "node",
            "node-a",
            "--type",
            "merge",
            "-p",
            r#"{"metadata":{"labels":{"topology.kubernetes.io/zone":"zone-a"}}}"#,
        ],
        None,
    );
    assert_eq!(
        api.get("Node", "", "node-a").expect("node")["metadata"]["labels"]
            ["topology.kubernetes.io/zone"],
        "zone-a"
    );
    kubectl.ok(
        &[
            "patch",
            "endpointslice",
            "web-1",
            "-n",
            "default",
            "--type",
            "merge",
            "-p",
            r#"{"endpoints":[{"addresses":["10.240.2.2"],"conditions":{"ready":true}}]}"#,
        ],
        None,
    );
    assert_eq!(
        api.get("EndpointSlice", "default", "web-1").expect("slice")["endpoints"][0]["addresses"]
            [0],
        "10.240.2.2"
    );

    // Errors as kube-apiserver's.
    let missing = kubectl.fails(&["get", "service", "missing", "-n", "default"], None);
    assert!(
        missing.contains(r#"Error from server (NotFound): services "missing" not found"#),
        "{missing}"
    );
    let exists = kubectl.fails(&["create", "-f", "-"], Some(SERVICE));
    assert!(
        exists.contains(r#"Error from server (AlreadyExists): error when creating "STDIN": services "web" already exists"#),
        "{exists}"
    );

    for (what, kind, ns, name) in [
        (
            vec!["delete", "service", "web", "-n", "default"],
            "Service",
            "default",
            "web",
        ),
        (
            vec!["delete", "endpointslice", "web-1", "-n", "default"],
            "EndpointSlice",
            "default",
            "web-1",
        ),
        (vec!["delete", "node", "node-a"], "Node", "", "node-a"),
    ] {
        let out = kubectl.ok(&what, None);
        assert!(out.contains("deleted"), "{out}");
        assert!(api.get(kind, ns, name).is_none(), "{kind} {name} deleted");
    }
}

#[test]
fn kubectl_watches() {
    let (api, kubectl) = admin();
    kubectl.ok(&["create", "-f", "-"], Some(SERVICE));
    let mut child = kubectl
        .command(&["get", "services", "-n", "default", "--watch", "-o", "name"])
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("kubectl get --watch");
    let stdout = child.stdout.take().expect("stdout");
    let (tx, rx) = mpsc::channel();
    std::thread::spawn(move || {
        for line in BufReader::new(stdout).lines().map_while(Result::ok) {
            if tx.send(line).is_err() {
                break;
            }
        }
    });
    let next = || {
        rx.recv_timeout(Duration::from_secs(20))
            .expect("a line from kubectl get --watch")
    };
    assert_eq!(next(), "service/web", "the initial list");
    let mut other: Value = serde_yaml::from_str(SERVICE).expect("yaml");
    other["metadata"]["name"] = "api".into();
    api.apply(other);
    assert_eq!(next(), "service/api", "a watch event");
    api.delete("Service", "default", "web");
    assert_eq!(next(), "service/web", "the deletion, as an event");
    let _ = child.kill();
    let _ = child.wait();
}

#[test]
fn kubectl_shows_the_shipped_role_refusing_writes() {
    which_kubectl();
    let api = FakeApiServer::start_tls();
    api.enforce_rbac(RBAC);
    let token = unique("sa-token-");
    api.add_token(&token, "system:serviceaccount:ebpf-proxy:ebpf-proxy");
    let kubectl = Kubectl::new(&api, &token);
    let list = kubectl.ok(&["get", "services", "-A", "-o", "name"], None);
    assert_eq!(list.trim(), "");
    let refused = kubectl.fails(&["create", "-f", "-"], Some(SERVICE));
    assert!(
        refused.contains(r#"Error from server (Forbidden): error when creating "STDIN": services is forbidden: User "system:serviceaccount:ebpf-proxy:ebpf-proxy" cannot create resource "services" in API group "" in the namespace "default""#),
        "{refused}"
    );
    let bad = Kubectl::new(&api, "not-a-token");
    let unauthorized = bad.fails(&["get", "services", "-A"], None);
    assert!(
        // What kubectl 1.32 prints for kube-apiserver's 401 too (its discovery client
        // words it; the Status body says "Unauthorized").
        unauthorized.contains(
            "error: You must be logged in to the server (the server has asked for the client to provide credentials)"
        ),
        "{unauthorized}"
    );
}
