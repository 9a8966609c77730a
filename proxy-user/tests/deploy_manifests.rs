//! Offline checks of the Kubernetes manifests in `deploy/`: every YAML file parses, is
//! used by a kustomization, and decodes into the Kubernetes types (k8s-openapi) without a
//! field the types do not know (a typo would otherwise be dropped silently); the objects
//! say what the agent needs (host network, the capabilities, the probes on the port the
//! agent serves health on (PROXY_HEALTHZ_ADDR's port; a startup probe that holds the
//! liveness probe off during slow starts), read-only RBAC on exactly the watched resources,
//! maxSurge 0, a grace period for SIGTERM, the memory limit and conntrack size that
//! `tests/memory_limit.rs` runs the real agent under,
//! the bpffs and cgroup mounts the flags point at); and every environment variable the
//! manifests set is one `proxy-agent` reads (taken from `src/bin/proxy-agent.rs`, so the
//! two cannot drift). `kubectl kustomize` (kustomize >= 4; `cargo xtask setup` installs a
//! kubectl when none is found, and the test fails without one) renders the base and both
//! overlays and the rendered objects get the same checks with each overlay's changes; the
//! overlays' patches are also checked one by one.
//!
//! Over 600 lines: one suite (the checks of every shipped manifest and overlay). Each file
//! under `tests/` is a test binary of its own that links the whole crate, so a suite is
//! split into modules only when its scenarios stop sharing set-up (shared helpers live in
//! `tests/support/`).

use std::{
    collections::{BTreeMap, BTreeSet},
    fs,
    net::SocketAddr,
    path::{Path, PathBuf},
    process::Command,
};

use k8s_openapi::{
    api::{
        apps::v1::DaemonSet,
        core::v1::{ConfigMap, Container, Namespace, ServiceAccount},
        rbac::v1::{ClusterRole, ClusterRoleBinding},
    },
    apimachinery::pkg::util::intstr::IntOrString,
    Resource,
};
use serde_yaml::Value;

const NAMESPACE: &str = "ebpf-proxy";

/// Environment variables the manifests may set that are not `proxy-agent` flags.
const OTHER_ENV: &[(&str, &str)] = &[
    ("RUST_LOG", "read by tracing-subscriber's EnvFilter"),
    (
        "KUBERNETES_SERVICE_HOST",
        "read by kube-client's in-cluster config",
    ),
    (
        "KUBERNETES_SERVICE_PORT",
        "read by kube-client's in-cluster config",
    ),
];

/// The capabilities the agent container gets, no more (docs/deploy.md says why).
const CAPABILITIES: &[&str] = &[
    "BPF",
    "NET_ADMIN",
    "NET_RAW",
    "PERFMON",
    "SYS_ADMIN",
    "SYS_PTRACE",
];

fn deploy_dir() -> PathBuf {
    normalize(&Path::new(env!("CARGO_MANIFEST_DIR")).join("../deploy"))
}

// ---------------------------------------------------------------------------------------
// What the agent reads

/// The `env = "NAME"` of every clap argument of proxy-agent, and those parsed as durations.
struct AgentEnv {
    all: BTreeSet<String>,
    durations: BTreeSet<String>,
}

fn agent_env() -> AgentEnv {
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("src/bin/proxy-agent.rs");
    let source =
        fs::read_to_string(&path).unwrap_or_else(|e| panic!("reading {}: {e}", path.display()));
    let mut env = AgentEnv {
        all: BTreeSet::new(),
        durations: BTreeSet::new(),
    };
    for line in source.lines() {
        let mut rest = line;
        while let Some(i) = rest.find("env = \"") {
            rest = &rest[i + 7..];
            let end = rest.find('"').expect("closing quote of env = \"...\"");
            let name = rest[..end].to_string();
            if line.contains("parse_duration") {
                env.durations.insert(name.clone());
            }
            env.all.insert(name);
        }
    }
    for must in ["NODE_NAME", "PROXY_PIN_PATH", "PROXY_CLEANUP_KUBE_PROXY"] {
        assert!(
            env.all.contains(must),
            "{must} not found in {}: the grep broke",
            path.display()
        );
    }
    assert!(env.durations.contains("PROXY_SYNC_INTERVAL"));
    env
}

/// proxy-agent's duration syntax (`parse_duration`): digits and ms, s or m.
fn is_duration(v: &str) -> bool {
    let digits = v.bytes().take_while(u8::is_ascii_digit).count();
    digits > 0 && matches!(&v[digits..], "ms" | "s" | "m")
}

// ---------------------------------------------------------------------------------------
// Reading and typing

/// Every YAML file under `dir`, sorted.
fn yaml_files(dir: &Path) -> Vec<PathBuf> {
    let mut out = Vec::new();
    let mut stack = vec![dir.to_path_buf()];
    while let Some(d) = stack.pop() {
        for entry in fs::read_dir(&d).unwrap_or_else(|e| panic!("{}: {e}", d.display())) {
            let path = entry.expect("directory entry").path();
            if path.is_dir() {
                stack.push(path);
            } else if path.extension().is_some_and(|e| e == "yaml" || e == "yml") {
                out.push(path);
            }
        }
    }
    out.sort();
    out
}

/// The non-empty YAML documents of `text`.
fn documents(text: &str, origin: &str) -> Vec<Value> {
    serde_yaml::Deserializer::from_str(text)
        .map(|d| {
            serde_yaml::with::singleton_map_recursive::deserialize(d)
                .unwrap_or_else(|e| panic!("{origin}: not YAML: {e}"))
        })
        .filter(|v: &Value| !v.is_null())
        .collect()
}

/// One object of the manifests, typed.
#[derive(Debug)]
enum Object {
    Namespace(Namespace),
    ServiceAccount(ServiceAccount),
    ClusterRole(ClusterRole),
    ClusterRoleBinding(ClusterRoleBinding),
    ConfigMap(ConfigMap),
    DaemonSet(Box<DaemonSet>),
}

fn typed_as<T>(doc: &Value, origin: &str) -> T
where
    T: serde::de::DeserializeOwned + serde::Serialize,
{
    let typed: T = serde_yaml::from_value(doc.clone())
        .unwrap_or_else(|e| panic!("{origin}: does not decode as its kind: {e}"));
    // Decoding ignores unknown fields: compare what the types kept with what was written.
    let written = serde_json::to_value(doc).expect("YAML as JSON");
    let kept = serde_json::to_value(&typed).expect("typed object as JSON");
    assert_subset(&written, &kept, "", origin);
    typed
}

/// Every field of `written` is in `kept` with the same value.
fn assert_subset(written: &serde_json::Value, kept: &serde_json::Value, at: &str, origin: &str) {
    use serde_json::Value as J;
    match (written, kept) {
        (J::Object(w), J::Object(k)) => {
            for (key, wv) in w {
                let kv = k.get(key).unwrap_or_else(|| {
                    panic!("{origin}: field {at}.{key} is not part of the Kubernetes type (typo?)")
                });
                assert_subset(wv, kv, &format!("{at}.{key}"), origin);
            }
        }
        (J::Array(w), J::Array(k)) => {
            assert_eq!(w.len(), k.len(), "{origin}: {at}: list length changed");
            for (i, (wv, kv)) in w.iter().zip(k).enumerate() {
                assert_subset(wv, kv, &format!("{at}[{i}]"), origin);
            }
        }
        (w, k) => assert_eq!(w, k, "{origin}: {at}: value changed by decoding"),
    }
}

fn typed(doc: &Value, origin: &str) -> Object {
    let api = doc["apiVersion"].as_str().unwrap_or_default();
    let kind = doc["kind"].as_str().unwrap_or_default();
    let origin = format!(
        "{origin} ({api} {kind} {})",
        doc["metadata"]["name"].as_str().unwrap_or("?")
    );
    let is = |t: (&str, &str)| (api, kind) == t;
    if is((Namespace::API_VERSION, Namespace::KIND)) {
        Object::Namespace(typed_as(doc, &origin))
    } else if is((ServiceAccount::API_VERSION, ServiceAccount::KIND)) {
        Object::ServiceAccount(typed_as(doc, &origin))
    } else if is((ClusterRole::API_VERSION, ClusterRole::KIND)) {
        Object::ClusterRole(typed_as(doc, &origin))
    } else if is((ClusterRoleBinding::API_VERSION, ClusterRoleBinding::KIND)) {
        Object::ClusterRoleBinding(typed_as(doc, &origin))
    } else if is((ConfigMap::API_VERSION, ConfigMap::KIND)) {
        Object::ConfigMap(typed_as(doc, &origin))
    } else if is((DaemonSet::API_VERSION, DaemonSet::KIND)) {
        Object::DaemonSet(Box::new(typed_as(doc, &origin)))
    } else {
        panic!("{origin}: unexpected kind (add it to this test with its checks)")
    }
}

/// A kustomization (or component) file: what it pulls in.
#[derive(Debug, Default)]
struct Kustomization {
    dir: PathBuf,
    resources: Vec<PathBuf>,
    components: Vec<PathBuf>,
    /// Patch files, with whether they are JSON patches (a target and a list of ops).
    patches: Vec<PathBuf>,
}

fn kustomization(path: &Path, doc: &Value) -> Kustomization {
    let dir = path.parent().expect("a directory").to_path_buf();
    let list = |key: &str| -> Vec<PathBuf> {
        doc[key]
            .as_sequence()
            .map(|s| {
                s.iter()
                    .map(|v| dir.join(v.as_str().expect("a path")))
                    .collect()
            })
            .unwrap_or_default()
    };
    let patches = doc["patches"]
        .as_sequence()
        .map(|s| {
            s.iter()
                .map(|p| {
                    let file = p["path"].as_str().unwrap_or_else(|| {
                        panic!(
                            "{}: inline patches are not checked: use a file",
                            path.display()
                        )
                    });
                    dir.join(file)
                })
                .collect()
        })
        .unwrap_or_default();
    for unsupported in ["patchesStrategicMerge", "patchesJson6902", "bases"] {
        assert!(
            doc.get(unsupported).is_none(),
            "{}: `{unsupported}` is deprecated: use `patches`/`resources`",
            path.display()
        );
    }
    Kustomization {
        resources: list("resources"),
        components: list("components"),
        patches,
        dir,
    }
}

/// Every kustomization under deploy/ and every other YAML file, as documents.
struct Tree {
    kustomizations: BTreeMap<PathBuf, Kustomization>,
    files: BTreeMap<PathBuf, Vec<Value>>,
}

fn tree() -> Tree {
    let mut tree = Tree {
        kustomizations: BTreeMap::new(),
        files: BTreeMap::new(),
    };
    for path in yaml_files(&deploy_dir()) {
        let text = fs::read_to_string(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
        let docs = documents(&text, &path.display().to_string());
        let is_kustomization = docs.len() == 1
            && matches!(
                docs[0]["kind"].as_str(),
                Some("Kustomization" | "Component")
            );
        if is_kustomization {
            let k = kustomization(&path, &docs[0]);
            tree.kustomizations.insert(k.dir.clone(), k);
        } else {
            tree.files.insert(path, docs);
        }
    }
    tree
}

/// The typed objects of a kustomization's own resource files (not its bases).
fn resource_objects(tree: &Tree, dir: &Path) -> Vec<Object> {
    let k = &tree.kustomizations[dir];
    let mut out = Vec::new();
    for r in &k.resources {
        if r.is_dir() {
            out.extend(resource_objects(tree, &normalize(r)));
        } else {
            let docs = &tree.files[r];
            out.extend(docs.iter().map(|d| typed(d, &r.display().to_string())));
        }
    }
    out
}

/// `a/b/../c` as `a/c` (paths here are built from relative references).
fn normalize(path: &Path) -> PathBuf {
    let mut out = PathBuf::new();
    for c in path.components() {
        match c {
            std::path::Component::ParentDir => {
                out.pop();
            }
            std::path::Component::CurDir => {}
            c => out.push(c),
        }
    }
    out
}

// ---------------------------------------------------------------------------------------
// The checks

/// What differs between the base and the overlays.
#[derive(Debug)]
struct Expect {
    healthz_port: u16,
    metrics_port: u16,
    cleanup: bool,
    node_selector: Option<(&'static str, &'static str)>,
    proxy_name: Option<&'static str>,
}

const BASE: Expect = Expect {
    healthz_port: 10256,
    metrics_port: 10249,
    cleanup: true,
    node_selector: None,
    proxy_name: None,
};

const MIGRATION: Expect = Expect {
    healthz_port: 10356,
    metrics_port: 10349,
    cleanup: false,
    node_selector: Some(("ebpf-proxy.io/enabled", "true")),
    proxy_name: None,
};

const SERVICE_PROXY_NAME: Expect = Expect {
    healthz_port: 10356,
    metrics_port: 10349,
    cleanup: false,
    node_selector: None,
    proxy_name: Some("ebpf-proxy"),
};

fn one<'a, T>(items: impl Iterator<Item = &'a T>, what: &str, origin: &str) -> &'a T {
    let all: Vec<&T> = items.collect();
    assert_eq!(all.len(), 1, "{origin}: expected exactly one {what}");
    all[0]
}

fn resolve_port(c: &Container, port: &IntOrString) -> u16 {
    match port {
        IntOrString::Int(n) => u16::try_from(*n).expect("a port number"),
        IntOrString::String(name) => c
            .ports
            .iter()
            .flatten()
            .find(|p| p.name.as_deref() == Some(name))
            .map(|p| u16::try_from(p.container_port).expect("a port number"))
            .unwrap_or_else(|| panic!("probe port {name:?} is not a port of {}", c.name)),
    }
}

fn check(objects: &[Object], expect: &Expect, origin: &str) {
    let env = agent_env();
    let allowed: BTreeSet<String> = env
        .all
        .iter()
        .cloned()
        .chain(OTHER_ENV.iter().map(|(n, _)| n.to_string()))
        .collect();

    // Namespace with the privileged Pod Security level.
    let ns = one(
        objects.iter().filter_map(|o| match o {
            Object::Namespace(n) => Some(n),
            _ => None,
        }),
        "Namespace",
        origin,
    );
    assert_eq!(ns.metadata.name.as_deref(), Some(NAMESPACE), "{origin}");
    let labels = ns.metadata.labels.clone().unwrap_or_default();
    assert_eq!(
        labels
            .get("pod-security.kubernetes.io/enforce")
            .map(String::as_str),
        Some("privileged"),
        "{origin}: the namespace must allow hostNetwork/hostPath/capabilities"
    );

    let sa = one(
        objects.iter().filter_map(|o| match o {
            Object::ServiceAccount(s) => Some(s),
            _ => None,
        }),
        "ServiceAccount",
        origin,
    );
    let sa_name = sa.metadata.name.clone().expect("ServiceAccount name");
    assert_eq!(
        sa.metadata.namespace.as_deref(),
        Some(NAMESPACE),
        "{origin}"
    );

    // RBAC: exactly list/watch on services, nodes and endpointslices (what the agent uses,
    // checked against the agent itself by agent_kube_tls).
    let role = one(
        objects.iter().filter_map(|o| match o {
            Object::ClusterRole(r) => Some(r),
            _ => None,
        }),
        "ClusterRole",
        origin,
    );
    let mut granted: BTreeMap<(String, String), BTreeSet<String>> = BTreeMap::new();
    for rule in role.rules.iter().flatten() {
        assert!(
            rule.resource_names.is_none() && rule.non_resource_urls.is_none(),
            "{origin}: unexpected rule {rule:?}"
        );
        for group in rule.api_groups.iter().flatten() {
            for resource in rule.resources.iter().flatten() {
                granted
                    .entry((group.clone(), resource.clone()))
                    .or_default()
                    .extend(rule.verbs.iter().cloned());
            }
        }
    }
    let read: BTreeSet<String> = ["list", "watch"].map(String::from).into();
    let wanted: BTreeMap<(String, String), BTreeSet<String>> = [
        ("", "services"),
        ("", "nodes"),
        // The socket-LB bypass: this node's Pods and the Namespaces (their labels).
        ("", "pods"),
        ("", "namespaces"),
        ("discovery.k8s.io", "endpointslices"),
        ("networking.k8s.io", "servicecidrs"),
    ]
    .into_iter()
    .map(|(g, r)| ((g.to_string(), r.to_string()), read.clone()))
    .collect();
    assert_eq!(granted, wanted, "{origin}: ClusterRole rules");

    let binding = one(
        objects.iter().filter_map(|o| match o {
            Object::ClusterRoleBinding(b) => Some(b),
            _ => None,
        }),
        "ClusterRoleBinding",
        origin,
    );
    assert_eq!(binding.role_ref.kind, "ClusterRole", "{origin}");
    assert_eq!(
        Some(&binding.role_ref.name),
        role.metadata.name.as_ref(),
        "{origin}"
    );
    let subjects = binding.subjects.clone().unwrap_or_default();
    assert_eq!(subjects.len(), 1, "{origin}: one subject");
    assert_eq!(
        (
            subjects[0].kind.as_str(),
            subjects[0].name.as_str(),
            subjects[0].namespace.as_deref()
        ),
        ("ServiceAccount", sa_name.as_str(), Some(NAMESPACE)),
        "{origin}: the binding names the agent's ServiceAccount"
    );

    // The DaemonSet.
    let ds = one(
        objects.iter().filter_map(|o| match o {
            Object::DaemonSet(d) => Some(d),
            _ => None,
        }),
        "DaemonSet",
        origin,
    );
    assert_eq!(
        ds.metadata.namespace.as_deref(),
        Some(NAMESPACE),
        "{origin}"
    );
    let spec = ds.spec.as_ref().expect("DaemonSet spec");
    let strategy = spec.update_strategy.as_ref().expect("updateStrategy");
    assert_eq!(strategy.type_.as_deref(), Some("RollingUpdate"), "{origin}");
    let rolling = strategy.rolling_update.as_ref().expect("rollingUpdate");
    assert_eq!(
        rolling.max_unavailable,
        Some(IntOrString::Int(1)),
        "{origin}"
    );
    assert!(
        matches!(&rolling.max_surge, Some(IntOrString::Int(0)))
            || matches!(&rolling.max_surge, Some(IntOrString::String(s)) if s == "0" || s == "0%"),
        "{origin}: maxSurge must be 0 (two agents must never share the pins): {:?}",
        rolling.max_surge
    );
    let pod = spec.template.spec.as_ref().expect("pod spec");
    assert_eq!(pod.host_network, Some(true), "{origin}: hostNetwork");
    assert_eq!(
        pod.dns_policy.as_deref(),
        Some("Default"),
        "{origin}: the agent must not depend on cluster DNS"
    );
    assert_eq!(
        pod.priority_class_name.as_deref(),
        Some("system-node-critical"),
        "{origin}"
    );
    assert_eq!(
        pod.service_account_name.as_deref(),
        Some(sa_name.as_str()),
        "{origin}"
    );
    assert!(
        pod.tolerations
            .iter()
            .flatten()
            .any(|t| t.operator.as_deref() == Some("Exists")
                && t.key.is_none()
                && t.effect.is_none()),
        "{origin}: a toleration {{operator: Exists}} so that every node runs the agent"
    );
    let grace = pod
        .termination_grace_period_seconds
        .expect("terminationGracePeriodSeconds");
    assert!((1..=60).contains(&grace), "{origin}: grace period {grace}");
    let selector = pod.node_selector.clone().unwrap_or_default();
    match expect.node_selector {
        Some((k, v)) => assert_eq!(
            selector.get(k).map(String::as_str),
            Some(v),
            "{origin}: nodeSelector"
        ),
        None => assert!(
            selector.keys().all(|k| k == "kubernetes.io/os"),
            "{origin}: nodeSelector {selector:?}"
        ),
    }

    let volume_for = |host: &str| -> String {
        pod.volumes
            .iter()
            .flatten()
            .find(|v| v.host_path.as_ref().is_some_and(|h| h.path == host))
            .map(|v| v.name.clone())
            .unwrap_or_else(|| panic!("{origin}: no hostPath volume for {host}"))
    };
    let bpffs = volume_for("/sys/fs/bpf");
    let cgroup = volume_for("/sys/fs/cgroup");
    let xtables = volume_for("/run/xtables.lock");

    let agent = one(pod.containers.iter(), "container", origin);
    assert_eq!(agent.name, "agent", "{origin}");
    let argv: Vec<String> = agent
        .command
        .iter()
        .flatten()
        .chain(agent.args.iter().flatten())
        .cloned()
        .collect();
    assert!(
        argv.iter().any(|a| a == "run"),
        "{origin}: runs `proxy-agent run`: {argv:?}"
    );
    assert!(agent.image.is_some(), "{origin}: image");

    let sc = agent.security_context.as_ref().expect("securityContext");
    assert_eq!(
        sc.privileged,
        Some(false),
        "{origin}: the agent is not privileged"
    );
    assert_eq!(sc.read_only_root_filesystem, Some(true), "{origin}");
    let caps = sc.capabilities.as_ref().expect("capabilities");
    let added: BTreeSet<&str> = caps.add.iter().flatten().map(String::as_str).collect();
    assert_eq!(
        added,
        CAPABILITIES.iter().copied().collect(),
        "{origin}: capabilities"
    );
    assert!(
        caps.drop.iter().flatten().any(|c| c == "ALL"),
        "{origin}: drop ALL first"
    );
    assert_eq!(
        sc.app_armor_profile.as_ref().map(|p| p.type_.as_str()),
        Some("Unconfined"),
        "{origin}: the default AppArmor profile forbids writing pins under /sys"
    );

    let mount = |c: &Container, volume: &str| {
        c.volume_mounts
            .iter()
            .flatten()
            .find(|m| m.name == volume)
            .cloned()
            .unwrap_or_else(|| panic!("{origin}: {} does not mount {volume}", c.name))
    };
    let bpffs_mount = mount(agent, &bpffs);
    assert_eq!(bpffs_mount.mount_path, "/sys/fs/bpf", "{origin}");
    assert_eq!(
        bpffs_mount.mount_propagation.as_deref(),
        Some("HostToContainer"),
        "{origin}: Bidirectional is for privileged containers only"
    );
    let cgroup_mount = mount(agent, &cgroup);
    assert_eq!(cgroup_mount.read_only, Some(true), "{origin}");
    assert_eq!(
        mount(agent, &xtables).mount_path,
        "/run/xtables.lock",
        "{origin}"
    );
    // The init container that makes sure bpffs is mounted on the host.
    let init = one(
        pod.init_containers.iter().flatten(),
        "init container",
        origin,
    );
    let init_sc = init
        .security_context
        .as_ref()
        .expect("init securityContext");
    assert_eq!(
        init_sc.privileged,
        Some(true),
        "{origin}: mounting needs it"
    );
    let init_mount = mount(init, &bpffs);
    assert_eq!(init_mount.mount_path, "/sys/fs/bpf", "{origin}");
    assert_eq!(
        init_mount.mount_propagation.as_deref(),
        Some("Bidirectional"),
        "{origin}"
    );
    assert!(
        init.command
            .iter()
            .flatten()
            .any(|a| a.contains("mount -t bpf bpf /sys/fs/bpf")),
        "{origin}: the init container mounts bpffs"
    );

    // Probes on the health port.
    let live = agent.liveness_probe.as_ref().expect("livenessProbe");
    let ready = agent.readiness_probe.as_ref().expect("readinessProbe");
    let live_get = live.http_get.as_ref().expect("liveness httpGet");
    let ready_get = ready.http_get.as_ref().expect("readiness httpGet");
    assert_eq!(live_get.path.as_deref(), Some("/livez"), "{origin}");
    assert_eq!(ready_get.path.as_deref(), Some("/healthz"), "{origin}");
    assert_eq!(
        resolve_port(agent, &live_get.port),
        expect.healthz_port,
        "{origin}"
    );
    assert_eq!(
        resolve_port(agent, &ready_get.port),
        expect.healthz_port,
        "{origin}"
    );
    let ports: BTreeSet<u16> = agent
        .ports
        .iter()
        .flatten()
        .map(|p| u16::try_from(p.container_port).expect("port"))
        .collect();
    assert_eq!(
        ports,
        [expect.healthz_port, expect.metrics_port].into(),
        "{origin}: declared ports"
    );

    // Resources.
    let resources = agent.resources.as_ref().expect("resources");
    let requests = resources.requests.clone().unwrap_or_default();
    let limits = resources.limits.clone().unwrap_or_default();
    assert!(
        requests.contains_key("cpu") && requests.contains_key("memory"),
        "{origin}: requests {requests:?}"
    );
    assert!(limits.contains_key("memory"), "{origin}: limits {limits:?}");

    // Environment: NODE_NAME from the downward API, the rest from the ConfigMap.
    let container_env = agent.env.clone().unwrap_or_default();
    for e in &container_env {
        assert!(
            allowed.contains(&e.name),
            "{origin}: proxy-agent does not read {}",
            e.name
        );
    }
    let node = container_env
        .iter()
        .find(|e| e.name == "NODE_NAME")
        .unwrap_or_else(|| panic!("{origin}: NODE_NAME"));
    assert_eq!(
        node.value_from
            .as_ref()
            .and_then(|v| v.field_ref.as_ref())
            .map(|f| f.field_path.as_str()),
        Some("spec.nodeName"),
        "{origin}: NODE_NAME from the downward API"
    );
    let config_name = one(
        agent
            .env_from
            .iter()
            .flatten()
            .filter_map(|e| e.config_map_ref.as_ref()),
        "envFrom configMapRef",
        origin,
    )
    .name
    .clone();
    let config = one(
        objects.iter().filter_map(|o| match o {
            Object::ConfigMap(c) if c.metadata.name.as_deref() == Some(config_name.as_str()) => {
                Some(c)
            }
            _ => None,
        }),
        "ConfigMap named by envFrom",
        origin,
    );
    let data = config.data.clone().unwrap_or_default();
    for (key, value) in &data {
        assert!(
            allowed.contains(key),
            "{origin}: proxy-agent does not read {key}"
        );
        if env.durations.contains(key) {
            assert!(
                is_duration(value),
                "{origin}: {key}={value:?} is not a duration"
            );
        }
    }
    let get = |key: &str| {
        data.get(key)
            .map(String::as_str)
            .unwrap_or_else(|| panic!("{origin}: the ConfigMap lacks {key}"))
    };
    let addr = |key: &str| -> SocketAddr {
        get(key)
            .parse()
            .unwrap_or_else(|e| panic!("{origin}: {key}: {e}"))
    };
    assert_eq!(
        addr("PROXY_HEALTHZ_ADDR").port(),
        expect.healthz_port,
        "{origin}"
    );
    assert_eq!(
        addr("PROXY_METRICS_ADDR").port(),
        expect.metrics_port,
        "{origin}"
    );
    assert_eq!(
        get("PROXY_CLEANUP_KUBE_PROXY"),
        if expect.cleanup { "true" } else { "false" },
        "{origin}"
    );
    assert!(
        get("PROXY_PIN_PATH").starts_with("/sys/fs/bpf/"),
        "{origin}: the pin path must be on the bpffs volume"
    );
    assert_eq!(
        get("PROXY_CGROUP"),
        cgroup_mount.mount_path,
        "{origin}: --cgroup must be the host's cgroup2 mount"
    );
    assert_eq!(
        data.get("PROXY_SERVICE_PROXY_NAME").map(String::as_str),
        expect.proxy_name,
        "{origin}"
    );

    // The probes ask the address the ConfigMap gives the agent.
    for (what, get) in [("readiness", ready_get), ("liveness", live_get)] {
        assert_eq!(
            resolve_port(agent, &get.port),
            addr("PROXY_HEALTHZ_ADDR").port(),
            "{origin}: the {what} probe's port is PROXY_HEALTHZ_ADDR's"
        );
    }
    // Readiness gates the rollout: asked often, no delay (the agent answers 503 until its
    // first sync).
    assert!(
        ready.period_seconds.unwrap_or(10) <= 10 && ready.initial_delay_seconds.unwrap_or(0) <= 5,
        "{origin}: readiness {ready:?}"
    );
    // Liveness must never kill a slow start: a startup probe on /livez holds it off for
    // far longer than the starts tests/memory_limit.rs measures at 10,000 Services (5 s to
    // 86 s until /livez answers on a restart), and then it gives up only after a minute.
    let startup = agent.startup_probe.as_ref().expect("startupProbe");
    let startup_get = startup.http_get.as_ref().expect("startup httpGet");
    assert_eq!(startup_get.path.as_deref(), Some("/livez"), "{origin}");
    assert_eq!(
        resolve_port(agent, &startup_get.port),
        addr("PROXY_HEALTHZ_ADDR").port(),
        "{origin}: the startup probe's port is PROXY_HEALTHZ_ADDR's"
    );
    let budget = |p: &k8s_openapi::api::core::v1::Probe| {
        p.initial_delay_seconds.unwrap_or(0)
            + p.period_seconds.unwrap_or(10) * p.failure_threshold.unwrap_or(3)
    };
    assert!(
        budget(startup) >= 240,
        "{origin}: the startup probe gives up after {} s",
        budget(startup)
    );
    assert!(
        budget(live) >= 60,
        "{origin}: liveness gives up after {} s",
        budget(live)
    );
    for (what, p) in [("startup", startup), ("liveness", live)] {
        assert!(
            p.timeout_seconds.unwrap_or(1) >= 5,
            "{origin}: {what} timeout {:?}",
            p.timeout_seconds
        );
    }
    // SIGTERM: the agent stops at once (tests/memory_limit.rs measures it at 10,000
    // Services against this grace period); the kubelet's kill comes only after it.
    assert!(
        (10..=60).contains(&grace),
        "{origin}: terminationGracePeriodSeconds {grace}"
    );

    // Memory: the limit and conntrack size tests/memory_limit.rs runs the real agent
    // under (read from deploy/base) are what every rendering ships, and the
    // request covers at least the preallocated maps.
    let (tested_limit, tested_conntrack) = tested_memory();
    assert_eq!(
        limits.get("memory"),
        Some(&tested_limit),
        "{origin}: the memory limit must be the one tests/memory_limit.rs measures"
    );
    // The request at least covers what stays charged to the pod at 10,000 Services x 10
    // with conntrack grown to the base's ceiling (tests/memory_limit.rs: 117 MiB with no
    // agent running), and never exceeds the limit.
    let request = requests.get("memory").expect("memory request");
    assert!(
        (128 * MIB..=quantity_bytes(&tested_limit.0)).contains(&quantity_bytes(&request.0)),
        "{origin}: memory request {request:?} (limit {tested_limit:?})"
    );
    assert_eq!(
        get("PROXY_CONNTRACK_MAX"),
        tested_conntrack,
        "{origin}: the conntrack size sizes the preallocated maps the memory test measures"
    );
    // The service maps' bucket arrays are charged at creation too: the size shipped is
    // one the agent accepts.
    let svc: u32 = get("PROXY_SERVICE_MAP_ENTRIES")
        .parse()
        .unwrap_or_else(|e| panic!("{origin}: PROXY_SERVICE_MAP_ENTRIES: {e}"));
    assert!(
        proxy_user::loader::service_entries(svc).is_ok(),
        "{origin}: PROXY_SERVICE_MAP_ENTRIES {svc}"
    );
}

const MIB: u64 = 1 << 20;

/// A Kubernetes memory quantity in bytes (`256Mi`, `1Gi`, `500M`, `1048576`).
fn quantity_bytes(q: &str) -> u64 {
    let units: [(&str, u64); 6] = [
        ("Ki", 1 << 10),
        ("Mi", 1 << 20),
        ("Gi", 1 << 30),
        ("k", 1_000),
        ("M", 1_000_000),
        ("G", 1_000_000_000),
    ];
    for (suffix, factor) in units {
        if let Some(n) = q.strip_suffix(suffix) {
            return n.parse::<u64>().expect("quantity number") * factor;
        }
    }
    q.parse().unwrap_or_else(|e| panic!("quantity {q:?}: {e}"))
}

/// The agent container's memory limit in deploy/base/daemonset.yaml and
/// PROXY_CONNTRACK_MAX in deploy/base/configmap.yaml, as tests/memory_limit.rs reads them.
fn tested_memory() -> (
    k8s_openapi::apimachinery::pkg::api::resource::Quantity,
    String,
) {
    let base = deploy_dir().join("base");
    let ds: DaemonSet =
        serde_yaml::from_str(&fs::read_to_string(base.join("daemonset.yaml")).expect("read"))
            .expect("DaemonSet");
    let limit = ds
        .spec
        .and_then(|s| s.template.spec)
        .and_then(|p| p.containers.into_iter().find(|c| c.name == "agent"))
        .and_then(|c| c.resources?.limits?.get("memory").cloned())
        .expect("memory limit");
    let cm: ConfigMap =
        serde_yaml::from_str(&fs::read_to_string(base.join("configmap.yaml")).expect("read"))
            .expect("ConfigMap");
    let ct = cm
        .data
        .and_then(|d| d.get("PROXY_CONNTRACK_MAX").cloned())
        .expect("PROXY_CONNTRACK_MAX");
    (limit, ct)
}

// ---------------------------------------------------------------------------------------
// Tests

#[test]
fn every_yaml_file_parses_and_a_kustomization_uses_it() {
    let tree = tree();
    assert!(
        tree.kustomizations.contains_key(&deploy_dir()),
        "deploy/kustomization.yaml (kubectl apply -k deploy/)"
    );
    let mut used = BTreeSet::new();
    for k in tree.kustomizations.values() {
        for r in k.resources.iter().chain(&k.components) {
            let r = normalize(r);
            if r.is_dir() {
                assert!(
                    tree.kustomizations.contains_key(&r),
                    "{}: {} has no kustomization.yaml",
                    k.dir.display(),
                    r.display()
                );
            } else {
                let docs = tree
                    .files
                    .get(&r)
                    .unwrap_or_else(|| panic!("{}: missing {}", k.dir.display(), r.display()));
                for d in docs {
                    typed(d, &r.display().to_string());
                }
                used.insert(r);
            }
        }
        for p in &k.patches {
            let p = normalize(p);
            let docs = tree
                .files
                .get(&p)
                .unwrap_or_else(|| panic!("{}: missing patch {}", k.dir.display(), p.display()));
            for d in docs {
                match d {
                    // A JSON patch: a list of operations.
                    Value::Sequence(ops) => {
                        for op in ops {
                            assert!(
                                matches!(
                                    op["op"].as_str(),
                                    Some("add" | "remove" | "replace" | "test")
                                ),
                                "{}: {op:?}",
                                p.display()
                            );
                            assert!(
                                op["path"].as_str().is_some_and(|s| s.starts_with('/')),
                                "{}: {op:?}",
                                p.display()
                            );
                        }
                    }
                    // A strategic-merge patch: a partial object of a known kind.
                    _ => {
                        typed(d, &p.display().to_string());
                    }
                }
            }
            used.insert(p);
        }
    }
    let stray: Vec<_> = tree.files.keys().filter(|f| !used.contains(*f)).collect();
    assert!(
        stray.is_empty(),
        "YAML files no kustomization uses: {stray:?}"
    );
}

#[test]
fn base_objects_are_what_the_agent_needs() {
    let tree = tree();
    let base = deploy_dir().join("base");
    check(&resource_objects(&tree, &base), &BASE, "deploy/base");
    // `kubectl apply -k deploy/` is the base.
    let top = &tree.kustomizations[&deploy_dir()];
    assert_eq!(
        top.resources
            .iter()
            .map(|r| normalize(r))
            .collect::<Vec<_>>(),
        [normalize(&base)],
        "deploy/kustomization.yaml"
    );
}

#[test]
fn overlays_patch_what_running_beside_kube_proxy_needs() {
    let tree = tree();
    let component = deploy_dir().join("components/beside-kube-proxy");
    for overlay in ["migration", "service-proxy-name"] {
        let dir = deploy_dir().join("overlays").join(overlay);
        let k = &tree.kustomizations[&dir];
        assert_eq!(
            k.resources.iter().map(|r| normalize(r)).collect::<Vec<_>>(),
            [deploy_dir().join("base")],
            "{overlay}: builds on the base"
        );
        assert_eq!(
            k.components
                .iter()
                .map(|r| normalize(r))
                .collect::<Vec<_>>(),
            std::slice::from_ref(&component),
            "{overlay}: uses the beside-kube-proxy component"
        );
    }
    // The component's ConfigMap patch: cleanup off, kube-proxy's ports left alone.
    let config = &tree.files[&component.join("config.yaml")][0];
    assert_eq!(
        config["data"]["PROXY_CLEANUP_KUBE_PROXY"].as_str(),
        Some("false")
    );
    for (key, port) in [("PROXY_HEALTHZ_ADDR", 10356), ("PROXY_METRICS_ADDR", 10349)] {
        let a: SocketAddr = config["data"][key]
            .as_str()
            .and_then(|s| s.parse().ok())
            .unwrap_or_else(|| panic!("{key}"));
        assert_eq!(a.port(), port);
        if key == "PROXY_METRICS_ADDR" {
            assert!(
                a.ip().is_loopback(),
                "{key}: metrics only on loopback, like kube-proxy"
            );
        }
    }
    let migration = &tree.files[&deploy_dir().join("overlays/migration/node-selector.yaml")][0];
    assert_eq!(
        migration["spec"]["template"]["spec"]["nodeSelector"]["ebpf-proxy.io/enabled"].as_str(),
        Some("true")
    );
    let named = &tree.files[&deploy_dir().join("overlays/service-proxy-name/config.yaml")][0];
    assert_eq!(
        named["data"]["PROXY_SERVICE_PROXY_NAME"].as_str(),
        Some("ebpf-proxy")
    );
}

/// The major version of kustomize inside the installed kubectl, `None` without kubectl.
/// (Debian's own `kubernetes-client` is kubectl 1.20 with kustomize 2, which predates
/// components; `cargo xtask setup` installs a kubectl with kustomize 5 when none is found.)
fn kubectl_kustomize_major() -> Option<u32> {
    let out = match Command::new("kubectl")
        .args(["version", "--client"])
        .output()
    {
        Ok(out) => out,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return None,
        Err(e) => panic!("kubectl: {e}"),
    };
    let text = String::from_utf8_lossy(&out.stdout);
    text.lines()
        .find_map(|l| l.strip_prefix("Kustomize Version: v"))
        .and_then(|v| v.split('.').next()?.parse().ok())
}

/// `kubectl kustomize DIR` parsed into typed objects.
fn kustomize(dir: &Path) -> Vec<Object> {
    let out = Command::new("kubectl")
        .arg("kustomize")
        .arg(dir)
        .output()
        .unwrap_or_else(|e| panic!("kubectl kustomize {}: {e}", dir.display()));
    assert!(
        out.status.success(),
        "kubectl kustomize {}: {}",
        dir.display(),
        String::from_utf8_lossy(&out.stderr)
    );
    let text = String::from_utf8(out.stdout).expect("UTF-8");
    let origin = format!("kubectl kustomize {}", dir.display());
    documents(&text, &origin)
        .iter()
        .map(|d| typed(d, &origin))
        .collect()
}

#[test]
fn kustomize_renders_the_base_and_the_overlays() {
    // No kubectl is a failure, not a pass: `cargo xtask setup` installs one.
    match kubectl_kustomize_major() {
        Some(major) if major >= 4 => {}
        found => panic!(
            "no kubectl with kustomize >= 4 on PATH (found kustomize major {found:?}): the \
             rendered base and overlays cannot be checked; `cargo xtask setup` installs one \
             into $CARGO_HOME/bin"
        ),
    }
    let cases = [
        (deploy_dir(), &BASE),
        (deploy_dir().join("overlays/migration"), &MIGRATION),
        (
            deploy_dir().join("overlays/service-proxy-name"),
            &SERVICE_PROXY_NAME,
        ),
    ];
    for (dir, expect) in cases {
        let objects = kustomize(&dir);
        check(
            &objects,
            expect,
            &format!("kubectl kustomize {}", dir.display()),
        );
    }
}

/// Issue 12 item 8: metrics listen on loopback by default, as kube-proxy's
/// `--metrics-bind-address` (127.0.0.1:10249); only /healthz is meant to be reachable.
/// The binary's own default and the shipped ConfigMap both say so.
#[test]
fn metrics_listen_on_loopback_unless_an_operator_opts_in() {
    let out = Command::new(env!("CARGO_BIN_EXE_proxy-agent"))
        .args(["run", "--help"])
        .output()
        .expect("proxy-agent run --help");
    let help = String::from_utf8_lossy(&out.stdout);
    let line = help
        .lines()
        .skip_while(|l| !l.contains("--metrics-addr"))
        .take_while(|l| !l.trim_start().starts_with("--healthz-addr"))
        .collect::<Vec<_>>()
        .join(" ");
    assert!(
        line.contains("[default: 127.0.0.1:10249]"),
        "the --metrics-addr default: {line}"
    );
    let tree = tree();
    let base = &tree.files[&deploy_dir().join("base/configmap.yaml")][0];
    let a: SocketAddr = base["data"]["PROXY_METRICS_ADDR"]
        .as_str()
        .and_then(|s| s.parse().ok())
        .expect("PROXY_METRICS_ADDR in the base ConfigMap");
    assert_eq!(a, "127.0.0.1:10249".parse().expect("addr"));
}

/// Issue 12 item 10: the README counts and names the capabilities the DaemonSet adds,
/// and says why each is needed.
#[test]
fn the_readme_names_every_capability_the_daemonset_adds() {
    let readme = fs::read_to_string(Path::new(env!("CARGO_MANIFEST_DIR")).join("../README.md"))
        .expect("README.md");
    // As a reader sees it: line breaks are spaces.
    let readme = readme.split_whitespace().collect::<Vec<_>>().join(" ");
    let words = [
        "zero", "one", "two", "three", "four", "five", "six", "seven", "eight",
    ];
    let count = format!("{} capabilities", words[CAPABILITIES.len()]);
    assert!(readme.contains(&count), "README should say \"{count}\"");
    for cap in CAPABILITIES {
        assert!(
            readme.contains(&format!("`{cap}` (")),
            "README: `{cap}` and why it is needed"
        );
    }
}

/// Issue 24 item 1: `deploy/overlays/replace-kube-proxy` takes over kubeadm's
/// `kube-proxy` DaemonSet: it swaps the image and the command's program, keeps
/// kube-proxy's arguments (the agent reads them), and adds only the bpffs and host cgroup
/// mounts the datapath needs. Everything else (name, selector, ServiceAccount, the
/// ConfigMap volume, tolerations, update strategy) is kubeadm's, rendered by kustomize.
#[test]
fn replace_kube_proxy_swaps_the_image_and_command_of_kubeadms_daemonset() {
    use k8s_openapi::api::apps::v1::DaemonSet;
    let dir = deploy_dir().join("overlays/replace-kube-proxy");
    let original: DaemonSet = serde_yaml::from_str(
        &fs::read_to_string(dir.join("kube-proxy.yaml")).expect("kube-proxy.yaml"),
    )
    .expect("kubeadm's DaemonSet");
    match kubectl_kustomize_major() {
        Some(major) if major >= 4 => {}
        found => panic!("kubectl with kustomize >= 4 is needed to render the overlay: {found:?}"),
    }
    let out = Command::new("kubectl")
        .arg("kustomize")
        .arg(&dir)
        .output()
        .expect("kubectl kustomize");
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let rendered: Vec<DaemonSet> =
        serde_yaml::Deserializer::from_str(std::str::from_utf8(&out.stdout).expect("UTF-8"))
            .map(|d| serde::Deserialize::deserialize(d).expect("a DaemonSet"))
            .collect();
    assert_eq!(rendered.len(), 1, "the overlay renders the DaemonSet only");
    let mut ds = rendered.into_iter().next().expect("one");
    assert_eq!(ds.metadata.name.as_deref(), Some("kube-proxy"));
    assert_eq!(ds.metadata.namespace.as_deref(), Some("kube-system"));
    let spec = ds.spec.as_mut().expect("spec");
    let pod = spec.template.spec.as_mut().expect("pod spec");
    let c = &mut pod.containers[0];
    assert_eq!(c.name, "kube-proxy");
    assert_eq!(c.image.as_deref(), Some("ebpf-proxy:latest"));
    let cmd = c.command.clone().expect("command");
    let kubeadm_cmd = original
        .spec
        .as_ref()
        .expect("spec")
        .template
        .spec
        .as_ref()
        .expect("pod spec")
        .containers[0]
        .command
        .clone()
        .expect("kubeadm's command");
    assert_eq!(cmd[0], "/usr/local/bin/proxy-agent");
    assert_eq!(
        cmd[1..],
        kubeadm_cmd[1..],
        "kube-proxy's arguments, unchanged"
    );
    // Take the additions back out: what is left must be kubeadm's DaemonSet.
    let added = ["bpffs", "host-cgroup"];
    c.image = Some("registry.k8s.io/kube-proxy:v1.33.0".into());
    c.command = Some(kubeadm_cmd);
    c.env
        .as_mut()
        .expect("env")
        .retain(|e| !e.name.starts_with("PROXY_"));
    c.volume_mounts
        .as_mut()
        .expect("mounts")
        .retain(|m| !added.contains(&m.name.as_str()));
    pod.volumes
        .as_mut()
        .expect("volumes")
        .retain(|v| !added.contains(&v.name.as_str()));
    assert_eq!(
        serde_json::to_value(&ds).expect("json"),
        serde_json::to_value(&original).expect("json"),
        "the overlay changed more than the image, the command and the datapath mounts"
    );

    // kubeadm's newer template (upstream after v1.33: NET_ADMIN and SYS_MODULE instead of
    // privileged, and a CriticalAddonsOnly toleration): the overlay over it still yields a
    // privileged container (BPF, the Bidirectional bpffs mount) and kubeadm's arguments.
    let mut newer = serde_json::to_value(&original).expect("json");
    let container = &mut newer["spec"]["template"]["spec"]["containers"][0];
    container["securityContext"] =
        serde_json::json!({"capabilities": {"add": ["NET_ADMIN", "SYS_MODULE"]}});
    newer["spec"]["template"]["spec"]["tolerations"] = serde_json::json!([
        {"key": "CriticalAddonsOnly", "operator": "Exists"},
        {"operator": "Exists"}
    ]);
    let tmp = std::env::temp_dir().join(format!("ebpf-proxy-kustomize-{}", std::process::id()));
    fs::create_dir_all(&tmp).expect("temp dir");
    fs::write(
        tmp.join("kube-proxy.yaml"),
        serde_yaml::to_string(&newer).expect("yaml"),
    )
    .expect("write");
    for f in ["agent.yaml", "kustomization.yaml"] {
        fs::copy(dir.join(f), tmp.join(f)).expect("copy");
    }
    let out = Command::new("kubectl")
        .arg("kustomize")
        .arg(&tmp)
        .output()
        .expect("kubectl kustomize");
    let _ = fs::remove_dir_all(&tmp);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let ds: DaemonSet = serde_yaml::from_str(std::str::from_utf8(&out.stdout).expect("UTF-8"))
        .expect("a DaemonSet");
    let pod = ds.spec.expect("spec").template.spec.expect("pod spec");
    let c = &pod.containers[0];
    assert_eq!(
        c.security_context.as_ref().and_then(|s| s.privileged),
        Some(true),
        "privileged over kubeadm's capability-only template: {:?}",
        c.security_context
    );
    assert_eq!(c.command.as_ref().expect("command")[1..], cmd[1..]);
    assert_eq!(
        pod.tolerations.expect("tolerations").len(),
        2,
        "kubeadm's kept"
    );
}
