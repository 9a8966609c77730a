//! The [`Syncer`]: its state (index, writer, change tracking, claims, what is held and
//! reported), its construction and accessors; and [`SyncOutcome`], what one sync did.

use std::{
    collections::{BTreeMap, BTreeSet},
    net::IpAddr,
    sync::Arc,
    time::Instant,
};

use crate::{
    agent::metrics::Metrics,
    cluster::{
        conflicts::Claims,
        external_ips::ExternalIpPolicy,
        index::Index,
        lb_algorithm::LbAlgorithm,
        objects::{NodeInfo, ObjKey},
        Kind,
    },
    fasthash::HashMap,
    model::Frontend,
    store::MapStore,
    writer::{Refusal, Writer},
};

/// The result of one sync.
#[derive(Debug, Default)]
pub struct SyncOutcome {
    /// Whether anything was attempted (false while waiting for the initial lists).
    pub ran: bool,
    /// Map operations written.
    pub ops: usize,
    /// Map writes that failed and are worth retrying (the store refused them: a full
    /// map, an error of the kernel); their Services stay dirty. Entries the writer
    /// refuses by their content (more backends than a frontend holds, ...) are skipped
    /// objects, not failures: retrying would not help.
    pub failed: usize,
    /// Whether it was a full re-diff.
    pub full: bool,
}

/// What a Service that did not validate when the agent started keeps: the frontends the
/// pinned maps held for it, untouched until a valid version of every object in
/// `objects` arrives (or the object goes).
#[derive(Debug, Default)]
pub(super) struct Held {
    pub(super) objects: BTreeSet<(Kind, ObjKey)>,
    pub(super) frontends: BTreeSet<Frontend>,
}

/// Index + writer + change tracking.
pub struct Syncer<S> {
    pub(super) writer: Writer<S>,
    pub(super) index: Index,
    pub(super) proxy_name: Option<String>,
    pub(super) external_ips: ExternalIpPolicy,
    pub(super) metrics: Arc<Metrics>,
    /// Services whose frontends may differ from the maps, with the time the first
    /// unsynced change to them was received.
    pub(super) dirty: HashMap<ObjKey, Instant>,
    /// A full re-diff is due (initial sync, relist, periodic resync), since when.
    pub(super) full_due: Option<Instant>,
    /// A Node's addresses changed (`Index::cluster_nodes`): nothing to re-diff, but the
    /// next sync runs, and with it the writes that follow it (`DSR_TRUSTED4/6`).
    pub(super) nodes_changed: bool,
    /// A `ServiceCIDR` object changed since the last sync (`SVC_CIDR4/6` are rewritten
    /// after it).
    pub(super) service_cidrs_changed: bool,
    /// Who claims which frontend (and so who owns it).
    pub(super) claims: Claims,
    /// Losing claimants already reported, per frontend (each reported once).
    pub(super) conflicts_reported: HashMap<Frontend, BTreeSet<ObjKey>>,
    /// Frontends the writer refused by content, with the Service and cause (reported
    /// once per Service and cause, until the frontend is written or goes).
    pub(super) refused: HashMap<Frontend, (ObjKey, Refusal)>,
    /// Services kept as the pinned maps hold them (see [`Held`]).
    pub(super) held: BTreeMap<ObjKey, Held>,
    /// The pinned maps' frontends by the Service named in their reverse-NAT entry, read
    /// once when the first invalid object is seen at start.
    pub(super) pinned: Option<HashMap<ObjKey, BTreeSet<Frontend>>>,
    /// Whether a sync has run (before: the maps are a previous agent's).
    pub(super) synced_once: bool,
    /// Which initial lists have arrived.
    pub(super) listed: BTreeSet<Kind>,
    needs: BTreeSet<Kind>,
    /// Slices already reported as waiting for a missing Service (logged once each).
    pub(super) orphans_reported: BTreeSet<ObjKey>,
    /// `--lb-algorithm`: the default for Services without the annotation.
    pub(super) lb_default: LbAlgorithm,
    /// EndpointSlice trigger times (`endpoints.kubernetes.io/last-change-trigger-time`)
    /// per Service, not yet programmed: observed into
    /// `kubeproxy_network_programming_duration_seconds` when the Service is written.
    pub(super) triggers: HashMap<ObjKey, Vec<(std::time::SystemTime, crate::model::Family)>>,
    /// Trigger times before this are not observed (changes from before the agent
    /// started), as kube-proxy's endpoints change tracker does.
    pub(super) started: std::time::SystemTime,
    /// Every Service's entries as [`Self::first_sync_sizes`] computed them, kept for the
    /// first sync (which would compute the same again: a fifth of a fresh node's
    /// programming after its lists); dropped by any update, taken by the next sync.
    pub(super) prepared: Option<HashMap<ObjKey, Vec<crate::model::ServiceEntry>>>,
}

impl<S: MapStore> Syncer<S> {
    /// `needs`: the kinds whose initial list must arrive before anything is written.
    pub fn new(
        writer: Writer<S>,
        node: NodeInfo,
        proxy_name: Option<String>,
        needs: impl IntoIterator<Item = Kind>,
        metrics: Arc<Metrics>,
    ) -> Self {
        Self {
            writer,
            index: Index::new(node),
            proxy_name,
            external_ips: ExternalIpPolicy::default(),
            metrics,
            dirty: HashMap::default(),
            full_due: None,
            nodes_changed: false,
            service_cidrs_changed: false,
            claims: Claims::default(),
            conflicts_reported: HashMap::default(),
            refused: HashMap::default(),
            held: BTreeMap::new(),
            pinned: None,
            synced_once: false,
            listed: BTreeSet::new(),
            needs: needs.into_iter().collect(),
            orphans_reported: BTreeSet::new(),
            lb_default: LbAlgorithm::default(),
            triggers: HashMap::default(),
            started: std::time::SystemTime::now(),
            prepared: None,
        }
    }

    /// The same syncer (index, pending changes, lists received) over `writer`: a fresh
    /// node's agent takes its first lists in before the maps exist (the first sync's
    /// needs size them, [`Self::first_sync_sizes`]), then writes through the maps made.
    /// What the pinned maps hold is read again from `writer`.
    pub fn with_writer<T: MapStore>(self, writer: Writer<T>) -> Syncer<T> {
        Syncer {
            writer,
            index: self.index,
            proxy_name: self.proxy_name,
            external_ips: self.external_ips,
            metrics: self.metrics,
            dirty: self.dirty,
            full_due: self.full_due,
            nodes_changed: self.nodes_changed,
            service_cidrs_changed: self.service_cidrs_changed,
            claims: self.claims,
            conflicts_reported: self.conflicts_reported,
            refused: self.refused,
            held: self.held,
            pinned: None,
            synced_once: self.synced_once,
            listed: self.listed,
            needs: self.needs,
            orphans_reported: self.orphans_reported,
            lb_default: self.lb_default,
            triggers: self.triggers,
            started: self.started,
            prepared: self.prepared,
        }
    }

    /// The sizes a fresh node makes its maps sized to demand at so that the first sync
    /// of what the index holds grows none of them (`writer::first_sync_sizes`: every
    /// Service's entries, a frontend two Services claim counted twice). The entries are
    /// kept for the first sync ([`Self::prepared`]) unless an update comes first.
    pub fn first_sync_sizes(
        &mut self,
        start: crate::loader::Sizes,
        ceilings: &crate::loader::Sizes,
        maglev: crate::maglev::Params,
    ) -> crate::loader::Sizes {
        // Computed on two threads (nothing else runs meanwhile: the maps wait for it).
        let t0 = std::time::Instant::now();
        let keys: Vec<&ObjKey> = self.index.service_keys().collect();
        let index = &self.index;
        let part = |ks: &[&ObjKey]| -> Vec<(ObjKey, Vec<crate::model::ServiceEntry>)> {
            ks.iter()
                .map(|k| ((*k).clone(), index.entries(k)))
                .collect()
        };
        let (a, b) = keys.split_at(keys.len() / 2);
        let (mut first, second) = std::thread::scope(|s| {
            let other = s.spawn(|| part(b));
            let first = part(a);
            (first, other.join())
        });
        // A panic on the other thread: its half computed here instead.
        first.extend(second.unwrap_or_else(|_| part(b)));
        let entries: HashMap<ObjKey, Vec<crate::model::ServiceEntry>> = first.into_iter().collect();
        let refs: Vec<&crate::model::ServiceEntry> = entries.values().flatten().collect();
        let t1 = std::time::Instant::now();
        let sizes = crate::writer::first_sync_sizes(&refs, start, ceilings, maglev);
        tracing::debug!(
            entries_ms = (t1 - t0).as_secs_f64() * 1e3,
            sizes_ms = t1.elapsed().as_secs_f64() * 1e3,
            "first sync sized"
        );
        self.prepared = Some(entries);
        sizes
    }

    /// The algorithm for external traffic of Services without the annotation.
    pub fn with_lb_algorithm(mut self, default: LbAlgorithm) -> Self {
        self.lb_default = default;
        self
    }

    /// Programs `spec.externalIPs` only inside `cidrs` (`None`: all).
    pub fn with_external_ip_cidrs(mut self, cidrs: Option<Vec<(IpAddr, u8)>>) -> Self {
        self.external_ips = ExternalIpPolicy::new(cidrs);
        self
    }

    pub fn writer(&self) -> &Writer<S> {
        &self.writer
    }

    pub fn index(&self) -> &Index {
        &self.index
    }

    pub fn writer_mut(&mut self) -> &mut Writer<S> {
        &mut self.writer
    }

    pub fn metrics(&self) -> &Arc<Metrics> {
        &self.metrics
    }

    /// Every initial list has arrived.
    pub fn ready(&self) -> bool {
        self.needs.is_subset(&self.listed)
    }

    /// Something is waiting to be written.
    pub fn pending(&self) -> bool {
        self.full_due.is_some()
            || !self.dirty.is_empty()
            || self.nodes_changed
            || self.service_cidrs_changed
    }

    /// Asks for a full re-diff (periodic resync).
    pub fn request_full(&mut self, now: Instant) {
        self.full_due.get_or_insert(now);
    }

    pub(super) fn touch(&mut self, keys: impl IntoIterator<Item = ObjKey>, now: Instant) {
        for k in keys {
            self.dirty.entry(k).or_insert(now);
        }
    }
}
