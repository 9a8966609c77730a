//! The per-pod bypass of socket LB, resolved from labels (`--socket-lb-bypass-selector`):
//! the agent watches this node's Pods (`fieldSelector=spec.nodeName`) and the
//! Namespaces, finds each selected pod's cgroup where kubelet makes it ([`cgroups`]) and
//! writes its id to `SOCK_LB_BYPASS`, with the cgroup's level in the entry
//! `socket_lb::BYPASS_LEVELS`. The socket hooks look up the caller's ancestor at each
//! such level, so every container of the pod (a child cgroup the runtime makes later) is
//! covered from its first socket, with nothing to track per container. Such a pod's
//! sockets reach the ClusterIP themselves and are translated per packet on its interface
//! (`--pod-interfaces`), where a mesh's node proxy sees the ClusterIP.
//!
//! A selected pod whose cgroup does not exist yet (the label is seen before kubelet made
//! the cgroup) is retried every [`RETRY`] until it does; an entry of a pod that is gone,
//! finished or no longer selected is removed; entries left by an earlier agent that no
//! pod accounts for are removed after the first lists.

pub mod cgroups;
pub mod selector;

use std::{
    collections::{BTreeMap, HashMap, HashSet},
    path::PathBuf,
    time::Duration,
};

use aya::maps::{HashMap as BpfHash, MapData};
use proxy_common::{map_names, socket_lb};
use serde::Deserialize;
use tokio::sync::mpsc;
use tracing::{debug, info, warn};

pub use selector::BypassSelector;

use crate::{
    cluster::{
        counters::SourceCounters,
        skips::{SkipKind, SkipReason},
        Kind, ObjKey, Object, Update,
    },
    pins::{Access, PinDir},
};

/// How often a selected pod whose cgroup is not there yet is looked for again.
pub const RETRY: Duration = Duration::from_millis(200);

/// A Pod as the bypass reads it: nothing but its key, uid, labels and whether it has
/// finished (its cgroup is gone).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PodInfo {
    pub key: ObjKey,
    pub uid: String,
    pub labels: BTreeMap<String, String>,
    /// `status.phase` is `Succeeded` or `Failed`.
    pub finished: bool,
    /// `spec.nodeName` (the API watch selects this node's; a manifests directory may
    /// hold any node's).
    pub node: Option<String>,
    /// `spec.hostNetwork`: its sockets are in the host's network namespace, whose traffic
    /// has no pod interface to be translated on, so it is never bypassed.
    pub host_network: bool,
}

/// A Namespace as the bypass reads it: its name (the key's name) and labels.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct NamespaceInfo {
    pub key: ObjKey,
    pub labels: BTreeMap<String, String>,
}

#[derive(Deserialize)]
struct Item {
    #[serde(default)]
    metadata: ItemMeta,
    spec: Option<ItemSpec>,
    status: Option<ItemStatus>,
}

#[derive(Deserialize)]
#[serde(rename_all = "camelCase")]
struct ItemSpec {
    #[serde(default)]
    host_network: bool,
    node_name: Option<String>,
}

#[derive(Deserialize, Default)]
struct ItemMeta {
    name: Option<String>,
    namespace: Option<String>,
    uid: Option<String>,
    labels: Option<BTreeMap<String, String>>,
}

#[derive(Deserialize)]
struct ItemStatus {
    phase: Option<String>,
}

/// A Pod from its JSON: only metadata's name, namespace, uid, labels and `status.phase`
/// are decoded (the spec, annotations and the rest are skipped unread).
pub fn decode_pod(json: &str) -> Result<PodInfo, serde_json::Error> {
    let item: Item = serde_json::from_str(json)?;
    let m = item.metadata;
    let uid = m
        .uid
        .filter(|u| !u.is_empty())
        .ok_or_else(|| <serde_json::Error as serde::de::Error>::custom("metadata.uid missing"))?;
    let phase = item.status.and_then(|s| s.phase);
    Ok(PodInfo {
        key: ObjKey::new(m.namespace.unwrap_or_default(), m.name.unwrap_or_default()),
        uid,
        labels: m.labels.unwrap_or_default(),
        finished: matches!(phase.as_deref(), Some("Succeeded" | "Failed")),
        host_network: item.spec.as_ref().is_some_and(|s| s.host_network),
        node: item.spec.and_then(|s| s.node_name),
    })
}

/// A Namespace from its JSON: its name and labels.
pub fn decode_namespace(json: &str) -> Result<NamespaceInfo, serde_json::Error> {
    let item: Item = serde_json::from_str(json)?;
    Ok(NamespaceInfo {
        key: ObjKey::new("", item.metadata.name.unwrap_or_default()),
        labels: item.metadata.labels.unwrap_or_default(),
    })
}

/// What the bypass needs to run.
pub struct Options {
    pub selector: BypassSelector,
    /// The node's cgroup root, where kubelet's `kubepods` hierarchy is (the socket
    /// hooks' cgroup).
    pub root: PathBuf,
    pub pins: PinDir,
    pub counters: SourceCounters,
    /// This node's name: only its pods are bypassed.
    pub node_name: String,
}

/// An entry written for a pod.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Applied {
    cgroup: u64,
    level: u32,
}

/// The bypass's state: what the watches said, and what is in `SOCK_LB_BYPASS`.
pub struct Bypass {
    opts: Options,
    pods: HashMap<ObjKey, PodInfo>,
    namespaces: HashMap<String, BTreeMap<String, String>>,
    listed: HashSet<Kind>,
    /// By pod uid.
    applied: HashMap<String, Applied>,
    /// Selected pods whose cgroup was not found (said once each).
    pending: HashSet<String>,
    /// Pods refused (their cgroup too deep; said and counted once each).
    refused: HashSet<String>,
    /// Ids found in the map at start, removed after the first lists unless a pod has them.
    stale: Option<Vec<u64>>,
    /// What `SOCK_LB_BYPASS[BYPASS_LEVELS]` holds (0: absent).
    levels: u8,
    /// The last reconcile failed: retried every [`RETRY`].
    failed: bool,
}

impl Bypass {
    pub fn new(opts: Options) -> anyhow::Result<Self> {
        let map = bypass_map(&opts.pins)?;
        let stale: Vec<u64> = map
            .keys()
            .filter_map(Result::ok)
            .filter(|k| *k != socket_lb::BYPASS_LEVELS)
            .collect();
        // Absent reads as 0 (no level): the hooks' fast path.
        let levels = map.get(&socket_lb::BYPASS_LEVELS, 0).unwrap_or(0);
        Ok(Self {
            opts,
            pods: HashMap::new(),
            namespaces: HashMap::new(),
            listed: HashSet::new(),
            applied: HashMap::new(),
            pending: HashSet::new(),
            refused: HashSet::new(),
            stale: Some(stale),
            levels,
            failed: false,
        })
    }

    /// Takes one watch update.
    pub fn update(&mut self, u: Update) {
        match u {
            Update::Snapshot { kind, objects, .. } => {
                match kind {
                    Kind::Pod => self.pods.clear(),
                    Kind::Namespace => self.namespaces.clear(),
                    _ => return,
                }
                self.listed.insert(kind);
                for o in objects {
                    self.apply(o);
                }
            }
            Update::Apply(o) => self.apply(o),
            Update::Delete { kind, key } => match kind {
                Kind::Pod => {
                    self.pods.remove(&key);
                }
                Kind::Namespace => {
                    self.namespaces.remove(&*key.name);
                }
                _ => {}
            },
        }
    }

    fn apply(&mut self, o: Object) {
        match o {
            Object::Pod(p) => {
                self.pods.insert(p.key.clone(), *p);
            }
            Object::Namespace(n) => {
                self.namespaces.insert(n.key.name.to_string(), n.labels);
            }
            _ => {}
        }
    }

    /// Whether both lists are in (before that, nothing is written).
    pub fn synced(&self) -> bool {
        self.listed.contains(&Kind::Pod) && self.listed.contains(&Kind::Namespace)
    }

    /// Pods whose cgroup is being waited for.
    pub fn pending(&self) -> usize {
        self.pending.len()
    }

    /// Brings `SOCK_LB_BYPASS` to what the pods and namespaces select.
    pub fn reconcile(&mut self) -> anyhow::Result<()> {
        let mut map = bypass_map(&self.opts.pins)?;
        let wanted: HashMap<&str, &PodInfo> = self
            .pods
            .values()
            .filter(|p| {
                !p.finished
                    && !p.host_network
                    && p.node.as_deref() == Some(self.opts.node_name.as_str())
            })
            .filter(|p| {
                self.opts
                    .selector
                    .bypasses(&p.labels, self.namespaces.get(&*p.key.namespace))
            })
            .map(|p| (p.uid.as_str(), p))
            .collect();
        // Entries of pods no longer selected (or gone) first.
        let gone: Vec<String> = self
            .applied
            .keys()
            .filter(|uid| !wanted.contains_key(uid.as_str()))
            .cloned()
            .collect();
        for uid in gone {
            if let Some(a) = self.applied.remove(&uid) {
                remove(&mut map, a.cgroup)?;
                info!(uid, cgroup = a.cgroup, "socket LB applies again to the pod");
            }
        }
        self.pending.retain(|uid| wanted.contains_key(uid.as_str()));
        self.refused.retain(|uid| wanted.contains_key(uid.as_str()));
        for (uid, pod) in &wanted {
            if self.applied.contains_key(*uid) || self.refused.contains(*uid) {
                continue;
            }
            let Some(dir) = cgroups::find(&self.opts.root, uid) else {
                if self.pending.insert(uid.to_string()) {
                    debug!(pod = %pod.key, uid, "socket LB bypass: the pod's cgroup is not there yet; retrying");
                }
                continue;
            };
            self.pending.remove(*uid);
            let level = cgroups::level(&dir)?;
            if level > socket_lb::BYPASS_MAX_LEVEL {
                warn!(
                    pod = %pod.key,
                    cgroup = %dir.display(),
                    level,
                    reason = "too_deep",
                    "socket LB bypass refused: the pod's cgroup is deeper than level {} in the hierarchy",
                    socket_lb::BYPASS_MAX_LEVEL
                );
                self.opts
                    .counters
                    .skipped(SkipKind::Object(Kind::Pod), SkipReason::TooDeep);
                self.refused.insert(uid.to_string());
                continue;
            }
            let cgroup = crate::socklb::cgroup_id(&dir)?;
            // The level first: an id the hooks cannot reach yet is harmless.
            let levels = self.levels | 1u8 << level;
            write_levels(&mut map, &mut self.levels, levels)?;
            map.insert(cgroup, 1, 0)?;
            info!(pod = %pod.key, cgroup = %dir.display(), id = cgroup, level, "socket LB bypassed for the pod");
            self.applied
                .insert(uid.to_string(), Applied { cgroup, level });
        }
        self.finish(&mut map)
    }

    /// The end of a reconcile: entries of an earlier agent that no pod accounts for
    /// removed (the first time), the levels entry rewritten for the pods bypassed now.
    fn finish(&mut self, map: &mut BpfHash<MapData, u64, u8>) -> anyhow::Result<()> {
        if let Some(stale) = self.stale.take() {
            let ours: HashSet<u64> = self.applied.values().map(|a| a.cgroup).collect();
            for id in stale.into_iter().filter(|id| !ours.contains(id)) {
                remove(map, id)?;
                info!(id, "socket LB bypass: removed an entry no pod accounts for");
            }
        }
        let levels = self
            .applied
            .values()
            .fold(0u8, |acc, a| acc | 1u8 << a.level);
        write_levels(map, &mut self.levels, levels)
    }

    /// Runs until `rx` closes: takes updates, and reconciles after each batch of them and
    /// every [`RETRY`] while a pod's cgroup is awaited.
    pub async fn run(mut self, mut rx: mpsc::Receiver<Update>) {
        let mut retry = tokio::time::interval(RETRY);
        retry.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            let changed = tokio::select! {
                u = rx.recv() => match u {
                    Some(u) => {
                        self.update(u);
                        while let Ok(u) = rx.try_recv() {
                            self.update(u);
                        }
                        true
                    }
                    None => return,
                },
                _ = retry.tick() => self.pending() > 0 || self.failed,
            };
            if changed && self.synced() {
                let r = self.reconcile();
                if let Err(e) = &r {
                    warn!("socket LB bypass: writing SOCK_LB_BYPASS failed (retrying): {e:#}");
                }
                self.failed = r.is_err();
            }
        }
    }
}

fn bypass_map(pins: &PinDir) -> anyhow::Result<BpfHash<MapData, u64, u8>> {
    Ok(pins.typed(map_names::SOCK_LB_BYPASS, Access::ReadWrite)?)
}

/// Writes `SOCK_LB_BYPASS[BYPASS_LEVELS]` (removed when 0: the hooks' fast path) if it
/// changed from `written`.
fn write_levels(
    map: &mut BpfHash<MapData, u64, u8>,
    written: &mut u8,
    levels: u8,
) -> anyhow::Result<()> {
    if levels == *written {
        return Ok(());
    }
    if levels == 0 {
        remove(map, socket_lb::BYPASS_LEVELS)?;
    } else {
        map.insert(socket_lb::BYPASS_LEVELS, levels, 0)?;
    }
    *written = levels;
    Ok(())
}

fn remove(map: &mut BpfHash<MapData, u64, u8>, key: u64) -> anyhow::Result<()> {
    match map.remove(&key) {
        Ok(()) | Err(aya::maps::MapError::KeyNotFound) => Ok(()),
        Err(e) => Err(e.into()),
    }
}

/// Starts the bypass on its own task, fed by the Pod and Namespace watches
/// (`kube_source::spawn_pods`), when it can matter: a selector is set, socket LB takes
/// pods' sockets (`all`, `tcp`) and pods have the per-packet path (`--pod-interfaces`).
/// Otherwise it says why not and watches nothing.
pub fn start(
    agent: &crate::agent::AgentOptions,
    counters: &SourceCounters,
    client: &kube::Client,
    host: &str,
) -> anyhow::Result<()> {
    let Some(opts) = options(agent, counters)? else {
        return Ok(());
    };
    info!(root = %opts.root.display(), "socket LB bypass: watching this node's Pods and the Namespaces");
    let bypass = Bypass::new(opts)?;
    let (tx, rx) = mpsc::channel(1024);
    crate::cluster::kube_source::spawn_pods(
        client.clone(),
        host,
        &agent.node_name,
        tx,
        counters.clone(),
        agent.api_idle_timeout,
    );
    tokio::spawn(bypass.run(rx));
    Ok(())
}

/// The manifests directory's counterpart of [`start`]: the directory's Pods and
/// Namespaces go to the bypass, everything else to `syncer`. Returns the sender the
/// directory's thread writes to (`syncer` itself when the bypass is off).
pub fn start_manifests(
    agent: &crate::agent::AgentOptions,
    counters: &SourceCounters,
    syncer: mpsc::Sender<Update>,
) -> anyhow::Result<mpsc::Sender<Update>> {
    let Some(opts) = options(agent, counters)? else {
        return Ok(syncer);
    };
    info!(root = %opts.root.display(), "socket LB bypass: reading Pods and Namespaces from the manifests directory");
    let bypass = Bypass::new(opts)?;
    let (tx, mut rx) = mpsc::channel(4096);
    let (bypass_tx, bypass_rx) = mpsc::channel(1024);
    tokio::spawn(bypass.run(bypass_rx));
    tokio::spawn(async move {
        while let Some(u) = rx.recv().await {
            let kind = match &u {
                Update::Snapshot { kind, .. } | Update::Delete { kind, .. } => *kind,
                Update::Apply(o) => o.kind(),
            };
            let to = match kind {
                Kind::Pod | Kind::Namespace => &bypass_tx,
                _ => &syncer,
            };
            if to.send(u).await.is_err() {
                return;
            }
        }
    });
    Ok(tx)
}

/// The bypass's options when it can matter: a selector is set, socket LB takes pods'
/// sockets (`all`, `tcp`) and pods have the per-packet path (`--pod-interfaces`);
/// otherwise `None`, said once.
fn options(
    agent: &crate::agent::AgentOptions,
    counters: &SourceCounters,
) -> anyhow::Result<Option<Options>> {
    use crate::socklb::SocketLb;
    let Some(selector) = agent.socket_lb_bypass.clone() else {
        return Ok(None);
    };
    if agent.pod_interfaces.is_empty() || !matches!(agent.socket_lb, SocketLb::All | SocketLb::Tcp)
    {
        info!(
            socket_lb = agent.socket_lb.name(),
            "socket LB bypass from labels off: it needs --pod-interfaces and --socket-lb all or tcp"
        );
        return Ok(None);
    }
    let root = match &agent.cgroup {
        Some(c) => c.clone(),
        None => crate::cgroup::cgroup2_mount()?,
    };
    Ok(Some(Options {
        selector,
        root,
        pins: PinDir::new(&agent.pin_path),
        counters: counters.clone(),
        node_name: agent.node_name.clone(),
    }))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_pod_is_decoded_to_its_key_uid_labels_phase_and_host_network() {
        let p = decode_pod(
            r#"{"metadata": {"name": "p", "namespace": "n", "uid": "u-1",
                "labels": {"a": "b"}, "annotations": {"big": "x"}},
                "spec": {"hostNetwork": true, "containers": []},
                "status": {"phase": "Succeeded", "qosClass": "BestEffort"}}"#,
        )
        .expect("decodes");
        assert_eq!(p.key, ObjKey::new("n", "p"));
        assert_eq!(p.uid, "u-1");
        assert_eq!(p.labels.get("a").map(String::as_str), Some("b"));
        assert!(p.finished && p.host_network);
        let running = decode_pod(
            r#"{"metadata": {"name": "p", "uid": "u"}, "status": {"phase": "Running"}}"#,
        )
        .expect("decodes");
        assert!(!running.finished && !running.host_network);
        let e = decode_pod(r#"{"metadata": {"name": "p"}}"#).expect_err("no uid");
        assert!(e.to_string().contains("metadata.uid"), "{e}");
        let ns = decode_namespace(r#"{"metadata": {"name": "mesh", "labels": {"k": "v"}}}"#)
            .expect("decodes");
        assert_eq!(ns.key.name.as_ref() as &str, "mesh");
        assert_eq!(ns.labels.len(), 1);
    }
}
