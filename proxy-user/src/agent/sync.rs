//! The sync half of the agent (after kube-proxy's `servicechangetracker` and
//! `BoundedFrequencyRunner`): updates from the sources only change the index and mark
//! Services dirty; [`Syncer::sync`] then writes what the dirty Services need, through the
//! [`Writer`], which writes only the delta. Nothing is written before every initial list
//! is complete; a relist or a periodic resync is a full re-diff, which also removes what a
//! previous agent left in pinned maps and nobody wants any more.
//!
//! Time is passed in (`now`), so the logic is tested without sleeping.

use std::{
    collections::{BTreeMap, BTreeSet, HashMap},
    net::IpAddr,
    sync::Arc,
    time::{Duration, Instant},
};

use k8s_openapi::api::core::v1::Node;
use tracing::{debug, info, warn};

use crate::{
    agent::metrics::{Metrics, ReasonLabel},
    cluster::{
        index::Index,
        objects::{NodeInfo, ObjKey, ServiceInfo, SliceInfo},
        Kind, Object, Update,
    },
    model::{Frontend, ServiceEntry},
    store::MapStore,
    writer::{WriteError, Writer},
};

/// The result of one sync.
#[derive(Debug, Default)]
pub struct SyncOutcome {
    /// Whether anything was attempted (false while waiting for the initial lists).
    pub ran: bool,
    /// Map operations written.
    pub ops: usize,
    /// Frontends that failed to be written; their Services stay dirty for a retry.
    pub failed: usize,
    /// Whether it was a full re-diff.
    pub full: bool,
}

/// Index + writer + change tracking.
pub struct Syncer<S> {
    writer: Writer<S>,
    index: Index,
    proxy_name: Option<String>,
    /// `--external-ip-cidrs`: `spec.externalIPs` are programmed only inside these
    /// prefixes (CVE-2020-8554); `None`: all are.
    external_ip_cidrs: Option<Vec<(IpAddr, u8)>>,
    metrics: Arc<Metrics>,
    /// Services whose frontends may differ from the maps, with the time the first
    /// unsynced change to them was received.
    dirty: HashMap<ObjKey, Instant>,
    /// A full re-diff is due (initial sync, relist, periodic resync), since when.
    full_due: Option<Instant>,
    /// Frontends each Service owns in the maps, and the reverse.
    owned: HashMap<ObjKey, BTreeSet<Frontend>>,
    owner: HashMap<Frontend, ObjKey>,
    /// Which initial lists have arrived.
    listed: BTreeSet<Kind>,
    needs: BTreeSet<Kind>,
    /// Slices already reported as waiting for a missing Service (logged once each).
    orphans_reported: BTreeSet<ObjKey>,
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
            external_ip_cidrs: None,
            metrics,
            dirty: HashMap::new(),
            full_due: None,
            owned: HashMap::new(),
            owner: HashMap::new(),
            listed: BTreeSet::new(),
            needs: needs.into_iter().collect(),
            orphans_reported: BTreeSet::new(),
        }
    }

    /// Programs `spec.externalIPs` only inside `cidrs` (`None`: all).
    pub fn with_external_ip_cidrs(mut self, cidrs: Option<Vec<(IpAddr, u8)>>) -> Self {
        self.external_ip_cidrs = cidrs;
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
        self.full_due.is_some() || !self.dirty.is_empty()
    }

    /// Asks for a full re-diff (periodic resync).
    pub fn request_full(&mut self, now: Instant) {
        self.full_due.get_or_insert(now);
    }

    fn touch(&mut self, keys: impl IntoIterator<Item = ObjKey>, now: Instant) {
        for k in keys {
            self.dirty.entry(k).or_insert(now);
        }
    }

    /// Records one update from a source.
    pub fn handle(&mut self, update: Update, now: Instant) {
        match update {
            Update::Snapshot {
                kind,
                objects,
                relist,
            } => {
                if relist {
                    info!(?kind, objects = objects.len(), "relist: full re-diff");
                }
                self.snapshot(kind, objects, now);
                // The first full list of every kind, and every relist, re-diffs all.
                self.full_due.get_or_insert(now);
                self.listed.insert(kind);
            }
            Update::Apply(obj) => self.apply(obj, now),
            Update::Delete { kind, key } => match kind {
                Kind::Service => {
                    let k = self.index.set_service(key, None);
                    self.touch([k], now);
                }
                Kind::EndpointSlice => {
                    let touched = self.index.set_slice(key, None);
                    self.touch(touched, now);
                }
                Kind::Node => {}
            },
        }
        self.metrics.services.set(self.index.service_count() as i64);
    }

    fn service_info(
        &self,
        svc: &k8s_openapi::api::core::v1::Service,
    ) -> Result<Option<ServiceInfo>, ()> {
        let mut info = ServiceInfo::from_k8s(svc, self.proxy_name.as_deref()).map_err(|skip| {
            let key = display_key(&svc.metadata);
            warn!(service = %key, reason = skip.label(), "skipping Service {key}: {skip}");
            self.metrics.skipped("Service", skip.label());
        })?;
        if let (Some(info), Some(allowed)) = (info.as_mut(), &self.external_ip_cidrs) {
            info.external_ips.retain(|ip| {
                let ok = allowed.iter().any(|c| crate::cluster::objects::cidr_contains(*c, *ip));
                if !ok {
                    let key = display_key(&svc.metadata);
                    warn!(
                        service = %key, external_ip = %ip,
                        "Service {key}: externalIP {ip} is outside --external-ip-cidrs; not programmed"
                    );
                    self.metrics.skipped("Service", "external_ip_not_allowed");
                }
                ok
            });
        }
        Ok(info)
    }

    fn slice_info(
        &self,
        s: &k8s_openapi::api::discovery::v1::EndpointSlice,
    ) -> Result<Option<SliceInfo>, ()> {
        SliceInfo::from_k8s(s, self.proxy_name.as_deref()).map_err(|skip| {
            let key = display_key(&s.metadata);
            warn!(endpointslice = %key, reason = skip.label(), "skipping EndpointSlice {key}: {skip}");
            self.metrics.skipped("EndpointSlice", skip.label());
        })
    }

    fn snapshot(&mut self, kind: Kind, objects: Vec<Object>, now: Instant) {
        match kind {
            Kind::Service => {
                let mut all = Vec::new();
                for o in objects {
                    let Object::Service(svc) = o else { continue };
                    let key = obj_key(&svc.metadata);
                    match self.service_info(&svc) {
                        Ok(Some(info)) => all.push((key, info)),
                        Ok(None) => {}
                        // Malformed in a relist: keep the last good version, if any.
                        Err(()) => {
                            if let Some(prev) = self.index.service(&key) {
                                all.push((key, prev.clone()));
                            }
                        }
                    }
                }
                let touched = self.index.replace_services(all);
                self.touch(touched, now);
            }
            Kind::EndpointSlice => {
                let mut all = Vec::new();
                for o in objects {
                    let Object::Slice(s) = o else { continue };
                    let key = obj_key(&s.metadata);
                    match self.slice_info(&s) {
                        Ok(Some(info)) => all.push((key, info)),
                        Ok(None) => {}
                        Err(()) => {
                            if let Some(prev) = self.index.slice(&key) {
                                all.push((key, prev.clone()));
                            }
                        }
                    }
                }
                let touched = self.index.replace_slices(all);
                self.touch(touched, now);
            }
            Kind::Node => {
                let node = objects.into_iter().find_map(|o| match o {
                    Object::Node(n) => Some(n),
                    _ => None,
                });
                self.set_node(node.as_deref(), now);
            }
        }
    }

    fn apply(&mut self, obj: Object, now: Instant) {
        match obj {
            Object::Service(svc) => {
                let key = obj_key(&svc.metadata);
                // Malformed: logged and counted; the last good version stays.
                if let Ok(info) = self.service_info(&svc) {
                    let k = self.index.set_service(key, info);
                    self.touch([k], now);
                }
            }
            Object::Slice(s) => {
                let key = obj_key(&s.metadata);
                if let Ok(info) = self.slice_info(&s) {
                    if self.listed.contains(&Kind::Service) {
                        self.report_orphan(&key, info.as_ref());
                    }
                    let touched = self.index.set_slice(key, info);
                    self.touch(touched, now);
                }
            }
            Object::Node(n) => self.set_node(Some(&n), now),
        }
    }

    /// Logs (once per slice) an EndpointSlice whose Service is not known.
    fn report_orphan(&mut self, key: &ObjKey, info: Option<&SliceInfo>) {
        match info {
            Some(i) if !self.index.has_service(&i.service) => {
                if self.orphans_reported.insert(key.clone()) {
                    self.log_orphan(key, &i.service);
                }
            }
            _ => {
                self.orphans_reported.remove(key);
            }
        }
    }

    /// The same over every slice (full syncs).
    fn report_orphans(&mut self) {
        let orphans: BTreeMap<ObjKey, ObjKey> = self
            .index
            .slices()
            .filter(|(_, s)| !self.index.has_service(&s.service))
            .map(|(k, s)| (k.clone(), s.service.clone()))
            .collect();
        self.orphans_reported.retain(|k| orphans.contains_key(k));
        for (key, service) in orphans {
            if self.orphans_reported.insert(key.clone()) {
                self.log_orphan(&key, &service);
            }
        }
    }

    fn log_orphan(&self, key: &ObjKey, service: &ObjKey) {
        info!(
            endpointslice = %key, service = %service,
            "EndpointSlice {key}: Service {service} not found (yet); its endpoints wait for it"
        );
        self.metrics.skipped("EndpointSlice", "service_missing");
    }

    fn set_node(&mut self, node: Option<&Node>, now: Instant) {
        let name = self.index.node.name.clone();
        let node = node.filter(|n| n.metadata.name.as_deref() == Some(name.as_str()));
        let info = NodeInfo::with_node(&name, node);
        if info != self.index.node {
            info!(node = %name, zone = ?info.zone, addresses = ?info.addresses, "node changed");
            self.index.node = info;
            self.full_due.get_or_insert(now);
        }
    }

    /// Writes what is pending. Call when [`Self::ready`] and [`Self::pending`].
    pub fn sync(&mut self, now: Instant) -> SyncOutcome {
        if !self.ready() {
            return SyncOutcome::default();
        }
        let start = Instant::now();
        let full = self.full_due.is_some();
        let keys: Vec<(ObjKey, Instant)> = if full {
            let since = self.full_due.take().unwrap_or(now);
            let mut all: BTreeMap<ObjKey, Instant> = self
                .index
                .service_keys()
                .chain(self.owned.keys())
                .map(|k| (k.clone(), since))
                .collect();
            for (k, t) in self.dirty.drain() {
                all.insert(k, t);
            }
            all.into_iter().collect()
        } else {
            let mut keys: Vec<_> = self.dirty.drain().collect();
            keys.sort();
            keys
        };

        let mut outcome = SyncOutcome {
            ran: true,
            full,
            ..SyncOutcome::default()
        };
        if full {
            self.full_sync(&keys, &mut outcome);
        } else {
            for (key, since) in &keys {
                if !self.sync_service(key, &mut outcome) {
                    self.dirty.insert(key.clone(), *since);
                }
            }
        }

        let done = Instant::now();
        for (key, since) in &keys {
            if !self.dirty.contains_key(key) {
                self.metrics
                    .network_programming
                    .observe(done.saturating_duration_since(*since).as_secs_f64());
            }
        }
        self.metrics
            .sync_duration
            .observe(done.duration_since(start).as_secs_f64());
        self.metrics.frontends.set(self.owner.len() as i64);
        self.metrics
            .backends
            .set(self.writer.backend_count() as i64);
        if outcome.failed == 0 {
            self.metrics.mark_synced();
        }
        debug!(
            full,
            services = keys.len(),
            ops = outcome.ops,
            failed = outcome.failed,
            took_ms = done.duration_since(start).as_secs_f64() * 1e3,
            "sync"
        );
        outcome
    }

    /// Every Service at once: the writer removes every frontend not desired (also pinned
    /// leftovers of a previous agent) and writes the changed ones.
    fn full_sync(&mut self, keys: &[(ObjKey, Instant)], outcome: &mut SyncOutcome) {
        let mut desired: Vec<ServiceEntry> = Vec::new();
        let mut owner: HashMap<Frontend, ObjKey> = HashMap::new();
        let mut owned: HashMap<ObjKey, BTreeSet<Frontend>> = HashMap::new();
        for (key, _) in keys {
            for entry in self.index.entries(key) {
                if let Some(other) = owner.get(&entry.frontend) {
                    self.conflict(&entry.frontend, key, other);
                    continue;
                }
                owner.insert(entry.frontend, key.clone());
                owned.entry(key.clone()).or_default().insert(entry.frontend);
                desired.push(entry);
            }
        }
        self.report_orphans();
        let report = self.writer.sync(desired);
        outcome.ops += report.ops;
        let mut failed_keys = BTreeSet::new();
        for err in &report.errors {
            if let Some(fe) = err_frontend(err) {
                if let Some(k) = owner.get(fe) {
                    failed_keys.insert(k.clone());
                }
            }
            self.write_failed(err);
        }
        outcome.failed += report.errors.len();
        // The model is what the writer holds now.
        let programmed: BTreeSet<Frontend> = self.writer.frontends().copied().collect();
        owner.retain(|fe, _| programmed.contains(fe));
        for set in owned.values_mut() {
            set.retain(|fe| programmed.contains(fe));
        }
        owned.retain(|_, s| !s.is_empty());
        self.owner = owner;
        self.owned = owned;
        for k in failed_keys {
            self.dirty.insert(k, Instant::now());
        }
    }

    /// One Service. Returns false if a write failed (to be retried).
    fn sync_service(&mut self, key: &ObjKey, outcome: &mut SyncOutcome) -> bool {
        let mut entries = self.index.entries(key);
        // Local-only twins first, so a frontend never carries `ETP_LOCAL` before its twin
        // exists (the datapath also falls back to the frontend itself meanwhile).
        entries.sort_by_key(|e| std::cmp::Reverse(e.frontend.scope));
        let wanted: BTreeSet<Frontend> = entries.iter().map(|e| e.frontend).collect();
        let mut ok = true;
        let before = self.owned.remove(key).unwrap_or_default();
        let mut now_owned = BTreeSet::new();
        for fe in before.difference(&wanted) {
            match self.writer.remove(fe) {
                Ok(n) => {
                    outcome.ops += n;
                    self.owner.remove(fe);
                }
                Err(e) => {
                    ok = false;
                    outcome.failed += 1;
                    self.write_failed(&e);
                    now_owned.insert(*fe);
                }
            }
        }
        for entry in entries {
            match self.owner.get(&entry.frontend) {
                Some(other) if other != key => {
                    let other = other.clone();
                    self.conflict(&entry.frontend, key, &other);
                    continue;
                }
                _ => {}
            }
            match self.writer.upsert(&entry) {
                Ok(n) => {
                    outcome.ops += n;
                    self.owner.insert(entry.frontend, key.clone());
                    now_owned.insert(entry.frontend);
                }
                Err(e) => {
                    outcome.failed += 1;
                    // A store error is worth retrying; a refused entry is not.
                    ok &= !matches!(e, WriteError::Store { .. });
                    self.write_failed(&e);
                    if before.contains(&entry.frontend) {
                        now_owned.insert(entry.frontend);
                    }
                }
            }
        }
        if !now_owned.is_empty() {
            self.owned.insert(key.clone(), now_owned);
        }
        ok
    }

    fn conflict(&self, fe: &Frontend, key: &ObjKey, other: &ObjKey) {
        warn!(
            service = %key, frontend = %fe,
            "Service {key}: frontend {fe} already belongs to Service {other}; skipped"
        );
        self.metrics.skipped("Service", "frontend_conflict");
    }

    fn write_failed(&self, err: &WriteError) {
        warn!(reason = err.reason(), "map write failed: {err}");
        self.metrics
            .map_write_errors
            .get_or_create(&ReasonLabel {
                reason: err.reason().to_string(),
            })
            .inc();
    }
}

fn err_frontend(e: &WriteError) -> Option<&Frontend> {
    match e {
        WriteError::FamilyMismatch { frontend, .. }
        | WriteError::ZeroPort { frontend }
        | WriteError::ZeroBackendPort { frontend, .. }
        | WriteError::TooManyBackends { frontend, .. }
        | WriteError::Store { frontend, .. } => Some(frontend),
    }
}

fn obj_key(meta: &k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta) -> ObjKey {
    ObjKey::new(
        meta.namespace.clone().unwrap_or_default(),
        meta.name.clone().unwrap_or_default(),
    )
}

fn display_key(meta: &k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta) -> String {
    obj_key(meta).to_string()
}

/// Exponential retry delay after failed syncs.
#[derive(Debug)]
pub struct Backoff {
    next: Duration,
    min: Duration,
    max: Duration,
}

impl Backoff {
    pub fn new(min: Duration, max: Duration) -> Self {
        Self {
            next: min,
            min,
            max,
        }
    }

    /// The delay before the next retry; doubles each time up to `max`.
    pub fn fail(&mut self) -> Duration {
        let d = self.next;
        self.next = (self.next * 2).min(self.max);
        d
    }

    pub fn reset(&mut self) {
        self.next = self.min;
    }
}

#[cfg(test)]
mod tests;
