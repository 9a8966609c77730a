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
use tokio::sync::mpsc;
use tracing::{debug, info, warn};

pub use selector::BypassSelector;

use crate::{
    cluster::{
        counters::SourceCounters,
        objects::PodInfo,
        skips::{SkipKind, SkipReason},
        Kind, ObjKey, Object, Update,
    },
    pins::{Access, PinDir},
};

/// How often a selected pod whose cgroup is not there yet is looked for again.
pub const RETRY: Duration = Duration::from_millis(200);

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
            Update::Batch(updates) => {
                for u in updates {
                    self.update(u);
                }
            }
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
/// (`kube_source::spawn_pods`). The agent starts it only when it can matter
/// (`agent::bypass_options`).
pub fn start(
    opts: Options,
    client: &kube::Client,
    host: &str,
    idle_timeout: Duration,
) -> anyhow::Result<()> {
    info!(root = %opts.root.display(), "socket LB bypass: watching this node's Pods and the Namespaces");
    let (tx, rx) = mpsc::channel(1024);
    let (node_name, counters) = (opts.node_name.clone(), opts.counters.clone());
    let bypass = Bypass::new(opts)?;
    crate::cluster::kube_source::spawn_pods(
        client.clone(),
        host,
        &node_name,
        tx,
        counters,
        idle_timeout,
    );
    tokio::spawn(bypass.run(rx));
    Ok(())
}

/// The manifests directory's counterpart of [`start`]: the directory's Pods and
/// Namespaces go to the bypass, everything else to `syncer`. Returns the sender the
/// directory's thread writes to (`syncer` itself when the bypass is off).
pub fn start_manifests(
    opts: Options,
    syncer: mpsc::Sender<Update>,
) -> anyhow::Result<mpsc::Sender<Update>> {
    info!(root = %opts.root.display(), "socket LB bypass: reading Pods and Namespaces from the manifests directory");
    let bypass = Bypass::new(opts)?;
    let (tx, mut rx) = mpsc::channel(4096);
    let (bypass_tx, bypass_rx) = mpsc::channel(1024);
    tokio::spawn(bypass.run(bypass_rx));
    tokio::spawn(async move {
        while let Some(u) = rx.recv().await {
            let (to_bypass, to_syncer) = split(u);
            for (to, u) in [(&bypass_tx, to_bypass), (&syncer, to_syncer)] {
                if let Some(u) = u {
                    if to.send(u).await.is_err() {
                        return;
                    }
                }
            }
        }
    });
    Ok(tx)
}

/// An update of the manifests directory split into the bypass's part (Pods, Namespaces)
/// and the syncer's (the rest); a batch into two batches, each in order.
fn split(u: Update) -> (Option<Update>, Option<Update>) {
    let is_bypass = |u: &Update| {
        let kind = match u {
            Update::Snapshot { kind, .. } | Update::Delete { kind, .. } => *kind,
            Update::Apply(o) => o.kind(),
            Update::Batch(_) => return false,
        };
        matches!(kind, Kind::Pod | Kind::Namespace)
    };
    let updates = match u {
        Update::Batch(updates) => updates,
        u if is_bypass(&u) => return (Some(u), None),
        u => return (None, Some(u)),
    };
    let (bypass, rest): (Vec<Update>, Vec<Update>) = updates.into_iter().partition(is_bypass);
    let batch = |us: Vec<Update>| (!us.is_empty()).then_some(Update::Batch(us));
    (batch(bypass), batch(rest))
}

#[cfg(test)]
mod tests {
    use super::{split, Kind, Update};
    use crate::cluster::objects::ObjKey;

    fn kinds(u: &Option<Update>) -> Vec<String> {
        match u {
            None => Vec::new(),
            Some(Update::Batch(us)) => us
                .iter()
                .flat_map(|u| kinds(&Some(u.clone())))
                .map(|k| format!("batch {k}"))
                .collect(),
            Some(Update::Snapshot { kind, .. }) => vec![format!("snapshot {}", kind.as_str())],
            Some(Update::Delete { kind, .. }) => vec![format!("delete {}", kind.as_str())],
            Some(Update::Apply(o)) => vec![format!("apply {}", o.kind().as_str())],
        }
    }

    #[test]
    fn a_batch_of_the_manifests_directory_is_split_in_order() {
        let delete = |kind| Update::Delete {
            kind,
            key: ObjKey::new("default", "x"),
        };
        let snapshot = |kind| Update::Snapshot {
            kind,
            objects: Vec::new(),
            relist: false,
        };
        let (bypass, syncer) = split(Update::Batch(vec![
            snapshot(Kind::Service),
            delete(Kind::Pod),
            delete(Kind::EndpointSlice),
            snapshot(Kind::Namespace),
        ]));
        assert_eq!(
            kinds(&bypass),
            ["batch delete Pod", "batch snapshot Namespace"]
        );
        assert_eq!(
            kinds(&syncer),
            ["batch snapshot Service", "batch delete EndpointSlice"]
        );
        let (bypass, syncer) = split(Update::Batch(vec![delete(Kind::Service)]));
        assert!(bypass.is_none(), "nothing for the bypass");
        assert_eq!(kinds(&syncer), ["batch delete Service"]);
        let (bypass, syncer) = split(delete(Kind::Namespace));
        assert_eq!(kinds(&bypass), ["delete Namespace"]);
        assert!(syncer.is_none());
    }
}
