//! The sync half of the agent (after kube-proxy's `servicechangetracker`): updates from
//! the sources only change the index and mark Services dirty; [`Syncer::sync`] then
//! writes what the dirty Services need, through the [`Writer`], which writes only the
//! delta. Nothing is written before every initial list is complete; a relist or a
//! periodic resync is a full re-diff, which also removes what a previous agent left in
//! pinned maps and nobody wants any more. When to sync is decided by
//! [`super::schedule::Schedule`].
//!
//! Kubernetes rules applied on the way live in `cluster/`: which externalIPs are allowed
//! (`cluster::external_ips`), who owns a frontend several Services claim and the order
//! twins are written in (`cluster::conflicts`).
//!
//! Time is passed in (`now`), so the logic is tested without sleeping.
//!
//! Over 600 lines on purpose: one type, `Syncer`, whose change tracking, initial-list gating and
//! write path share its state (the conflict and external-IP rules it applies live in
//! `cluster/`, its tests in `sync/tests.rs`).

use std::{
    collections::{BTreeMap, BTreeSet},
    net::IpAddr,
    sync::Arc,
    time::Instant,
};

use k8s_openapi::api::core::v1::Node;
use tracing::{debug, info, warn};

use crate::{
    agent::metrics::{Metrics, ReasonLabel},
    cluster::{
        conflicts::{write_order, Claims, Rank},
        external_ips::ExternalIpPolicy,
        index::Index,
        lb_algorithm::{self, LbAlgorithm},
        objects::{NodeInfo, ObjKey, ServiceInfo, SliceInfo},
        Kind, Object, Reduced, Update,
    },
    fasthash::{HashMap, HashSet},
    model::{Frontend, Proto, ServiceEntry},
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
struct Held {
    objects: BTreeSet<(Kind, ObjKey)>,
    frontends: BTreeSet<Frontend>,
}

/// Index + writer + change tracking.
pub struct Syncer<S> {
    writer: Writer<S>,
    index: Index,
    proxy_name: Option<String>,
    external_ips: ExternalIpPolicy,
    metrics: Arc<Metrics>,
    /// Services whose frontends may differ from the maps, with the time the first
    /// unsynced change to them was received.
    dirty: HashMap<ObjKey, Instant>,
    /// A full re-diff is due (initial sync, relist, periodic resync), since when.
    full_due: Option<Instant>,
    /// Who claims which frontend (and so who owns it).
    claims: Claims,
    /// Losing claimants already reported, per frontend (each reported once).
    conflicts_reported: HashMap<Frontend, BTreeSet<ObjKey>>,
    /// Frontends the writer refused by content, with the Service and cause (reported
    /// once per Service and cause, until the frontend is written or goes).
    refused: HashMap<Frontend, (ObjKey, &'static str)>,
    /// Services kept as the pinned maps hold them (see [`Held`]).
    held: BTreeMap<ObjKey, Held>,
    /// The pinned maps' frontends by the Service named in their reverse-NAT entry, read
    /// once when the first invalid object is seen at start.
    pinned: Option<HashMap<ObjKey, BTreeSet<Frontend>>>,
    /// Whether a sync has run (before: the maps are a previous agent's).
    synced_once: bool,
    /// Which initial lists have arrived.
    listed: BTreeSet<Kind>,
    needs: BTreeSet<Kind>,
    /// Slices already reported as waiting for a missing Service (logged once each).
    orphans_reported: BTreeSet<ObjKey>,
    /// `--lb-algorithm`: the default for Services without the annotation.
    lb_default: LbAlgorithm,
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
        }
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
            Update::Delete { kind, key } => {
                self.release(kind, &key, now);
                match kind {
                    Kind::Service => {
                        let k = self.index.set_service(key, None);
                        self.touch([k], now);
                    }
                    Kind::EndpointSlice => {
                        let touched = self.index.set_slice(key, None);
                        self.touch(touched, now);
                    }
                    Kind::Node => {}
                }
            }
        }
        self.metrics.services.set(self.index.service_count() as i64);
    }

    /// The Service's algorithm for external traffic: its `ebpf-proxy.io/lb-algorithm`
    /// annotation (`value`), else `--lb-algorithm`. An unknown value is said, counted
    /// (`objects_skipped_total{kind="Service",reason="lb_algorithm_unknown"}`) and the
    /// default used: the Service is still programmed.
    fn lb_algorithm(&self, key: &ObjKey, value: Option<&str>) -> LbAlgorithm {
        match value.map(str::parse::<LbAlgorithm>) {
            Some(Ok(a)) => a,
            None => self.lb_default,
            Some(Err(_)) => {
                let value = value.unwrap_or_default();
                warn!(
                    service = %key, value = %value,
                    "Service {key}: annotation {}: {value:?} is not random or maglev; using the default ({})",
                    lb_algorithm::ANNOTATION, self.lb_default
                );
                self.metrics.skipped("Service", "lb_algorithm_unknown");
                self.lb_default
            }
        }
    }

    /// An object as the syncer takes it: reduced (by the API reader already, else here).
    fn reduce(&self, obj: Object) -> Incoming {
        let proxy = self.proxy_name.as_deref();
        match obj {
            Object::Service(svc) => Incoming::Service(Reduced {
                key: obj_key(&svc.metadata),
                info: ServiceInfo::from_k8s(&svc, proxy),
                tag: svc
                    .metadata
                    .annotations
                    .as_ref()
                    .and_then(|a| a.get(lb_algorithm::ANNOTATION))
                    .map(|v| Box::from(v.as_str())),
            }),
            Object::ReducedService(r) => Incoming::Service(*r),
            Object::Slice(s) => Incoming::Slice(Reduced::slice(obj_key(&s.metadata), &s, proxy)),
            Object::ReducedSlice(r) => Incoming::Slice(*r),
            Object::Node(n) => Incoming::Node(n),
        }
    }

    /// A reduced Service, with the agent's rules applied (its algorithm, the allowed
    /// externalIPs, no SCTP); `Err`: unusable, logged and counted.
    fn service_info(&self, r: Reduced<ServiceInfo>) -> Result<Option<ServiceInfo>, ()> {
        let key = &r.key;
        let mut info = r.info.map_err(|skip| {
            warn!(service = %key, reason = skip.label(), "skipping Service {key}: {skip}");
            self.metrics.skipped("Service", skip.label());
        })?;
        if let Some(info) = info.as_mut() {
            info.maglev = self.lb_algorithm(key, r.tag.as_deref()) == LbAlgorithm::Maglev;
            for ip in self.external_ips.apply(info) {
                warn!(
                    service = %key, external_ip = %ip,
                    "Service {key}: externalIP {ip} is outside --external-ip-cidrs; not programmed"
                );
                self.metrics.skipped("Service", "external_ip_not_allowed");
            }
            // Neither datapath parses SCTP (the TC programs handle TCP and UDP; the kernel
            // here has no SCTP to test the socket hooks with): such a port is left out,
            // said and counted, and the Service's other ports work.
            if info.ports.iter().any(|p| p.proto == Proto::Sctp) {
                for p in info.ports.iter().filter(|p| p.proto == Proto::Sctp) {
                    warn!(
                        service = %key, port = p.port,
                        "Service {key}: port {} is SCTP, which ebpf-proxy does not serve; not programmed",
                        p.port
                    );
                    self.metrics.skipped("Service", "sctp_not_supported");
                }
                info.ports = info
                    .ports
                    .iter()
                    .filter(|p| p.proto != Proto::Sctp)
                    .cloned()
                    .collect();
            }
        }
        Ok(info)
    }

    fn slice_info(&self, r: Reduced<SliceInfo>) -> Result<Option<SliceInfo>, ()> {
        let key = &r.key;
        r.info.map_err(|skip| {
            warn!(endpointslice = %key, reason = skip.label(), "skipping EndpointSlice {key}: {skip}");
            self.metrics.skipped("EndpointSlice", skip.label());
        })
    }

    /// At start (before the first sync), `object` of Service `service` does not validate
    /// and no earlier version is known: the frontends the pinned maps hold for that
    /// Service stay as they are until a valid version arrives.
    fn hold(&mut self, service: ObjKey, object: (Kind, ObjKey)) {
        if self.synced_once {
            return;
        }
        let pinned = self.pinned.get_or_insert_with(|| {
            let mut by_service: HashMap<ObjKey, BTreeSet<Frontend>> = HashMap::default();
            for (fe, name) in self.writer.expected_dump().revnat.into_values() {
                // `namespace/name:port` (see `cluster::index`).
                let svc = name.split(':').next().unwrap_or("");
                if let Some((ns, n)) = svc.split_once('/') {
                    by_service.entry(ObjKey::new(ns, n)).or_default().insert(fe);
                }
            }
            by_service
        });
        let mut frontends = pinned.get(&service).cloned().unwrap_or_default();
        // Names are truncated in the maps: the Service's own frontends, when known.
        let programmed: BTreeSet<Frontend> = self.writer.frontends().copied().collect();
        frontends.extend(
            self.index
                .entries(&service)
                .into_iter()
                .map(|e| e.frontend)
                .filter(|fe| programmed.contains(fe)),
        );
        if frontends.is_empty() {
            return;
        }
        info!(
            service = %service, object = %object.1, frontends = frontends.len(),
            "{} {} does not validate: Service {service} keeps what the pinned maps hold for it until a valid version arrives",
            object.0.as_str(), object.1
        );
        let held = self.held.entry(service).or_default();
        held.objects.insert(object);
        held.frontends.extend(frontends);
    }

    /// A valid version of `key` (or its deletion) arrived: Services held for it are
    /// synced again.
    fn release(&mut self, kind: Kind, key: &ObjKey, now: Instant) {
        if self.held.is_empty() {
            return;
        }
        let object = (kind, key.clone());
        let mut freed = Vec::new();
        for (svc, held) in self.held.iter_mut() {
            if held.objects.remove(&object) && held.objects.is_empty() {
                freed.push(svc.clone());
            }
        }
        for svc in freed {
            info!(service = %svc, "Service {svc}: no longer held at its pinned state");
            self.held.remove(&svc);
            self.touch([svc], now);
        }
    }

    fn snapshot(&mut self, kind: Kind, objects: Vec<Object>, now: Instant) {
        // Held objects missing from a new list, or valid in it, are released below.
        let mut still_invalid: BTreeSet<ObjKey> = BTreeSet::new();
        match kind {
            Kind::Service => {
                let mut all = Vec::with_capacity(objects.len());
                for o in objects {
                    let Incoming::Service(r) = self.reduce(o) else {
                        continue;
                    };
                    let key = r.key.clone();
                    match self.service_info(r) {
                        Ok(Some(info)) => all.push((key, info)),
                        Ok(None) => {}
                        // Malformed in a relist: keep the last good version, if any;
                        // at start, what the pinned maps hold.
                        Err(()) => {
                            if let Some(prev) = self.index.service(&key) {
                                all.push((key, prev.clone()));
                            } else {
                                still_invalid.insert(key.clone());
                                self.hold(key.clone(), (Kind::Service, key));
                            }
                        }
                    }
                }
                let touched = self.index.replace_services(all);
                self.touch(touched, now);
            }
            Kind::EndpointSlice => {
                let mut all = Vec::with_capacity(objects.len());
                let mut invalid = Vec::new();
                for o in objects {
                    let Incoming::Slice(mut r) = self.reduce(o) else {
                        continue;
                    };
                    let key = r.key.clone();
                    let service = r.tag.take();
                    match self.slice_info(r) {
                        Ok(Some(info)) => all.push((key, info)),
                        Ok(None) => {}
                        Err(()) => {
                            if let Some(prev) = self.index.slice(&key) {
                                all.push((key, prev.clone()));
                            } else if let Some(svc) = service {
                                still_invalid.insert(key.clone());
                                invalid.push((ObjKey::new(key.namespace.clone(), svc), key));
                            }
                        }
                    }
                }
                let touched = self.index.replace_slices(all);
                self.touch(touched, now);
                for (svc, key) in invalid {
                    self.hold(svc, (Kind::EndpointSlice, key));
                }
            }
            Kind::Node => {
                let node = objects.into_iter().find_map(|o| match o {
                    Object::Node(n) => Some(n),
                    _ => None,
                });
                self.set_node(node.as_deref(), now);
            }
        }
        let gone: Vec<ObjKey> = self
            .held
            .values()
            .flat_map(|h| h.objects.iter())
            .filter(|(k, key)| *k == kind && !still_invalid.contains(key))
            .map(|(_, key)| key.clone())
            .collect();
        for key in gone {
            self.release(kind, &key, now);
        }
    }

    fn apply(&mut self, obj: Object, now: Instant) {
        match self.reduce(obj) {
            Incoming::Service(r) => {
                let key = r.key.clone();
                // Malformed: logged and counted; the last good version stays.
                if let Ok(info) = self.service_info(r) {
                    self.release(Kind::Service, &key, now);
                    let k = self.index.set_service(key, info);
                    self.touch([k], now);
                }
            }
            Incoming::Slice(r) => {
                let key = r.key.clone();
                if let Ok(info) = self.slice_info(r) {
                    self.release(Kind::EndpointSlice, &key, now);
                    if self.listed.contains(&Kind::Service) {
                        self.report_orphan(&key, info.as_ref());
                    }
                    let touched = self.index.set_slice(key, info);
                    self.touch(touched, now);
                }
            }
            Incoming::Node(n) => self.set_node(Some(&n), now),
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
            // Every Service (the index's keys come sorted), the held ones, and the dirty
            // ones with their own times: sorted, one per key (a dirty key's time wins).
            let mut all: Vec<(ObjKey, Instant, bool)> = self
                .index
                .service_keys()
                .chain(self.held.keys())
                .map(|k| (k.clone(), since, false))
                .chain(self.dirty.drain().map(|(k, t)| (k, t, true)))
                .collect();
            all.sort_by(|a, b| a.0.cmp(&b.0).then(b.2.cmp(&a.2)));
            all.dedup_by(|later, first| later.0 == first.0);
            all.into_iter().map(|(k, t, _)| (k, t)).collect()
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
            self.report_orphans();
        }
        self.write(&keys, full, now, &mut outcome);
        self.synced_once = true;

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
        self.metrics
            .frontends
            .set(self.writer.frontend_count() as i64);
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

    /// Writes the frontends `keys` claim or claimed (`full`: every frontend, removing
    /// what nobody claims, pinned leftovers of a previous agent included). Each frontend
    /// gets its owner's entry (`cluster::conflicts`): a change of owner is one rewrite
    /// of the frontend, never a removal followed by an insert.
    fn write(
        &mut self,
        keys: &[(ObjKey, Instant)],
        full: bool,
        now: Instant,
        outcome: &mut SyncOutcome,
    ) {
        let started = Instant::now();
        let mut entries: HashMap<ObjKey, Vec<ServiceEntry>> = HashMap::default();
        let mut touched: BTreeSet<Frontend> = BTreeSet::new();
        if full {
            self.claims.clear();
            touched.extend(self.writer.frontends().copied());
        }
        for (key, _) in keys {
            let (es, fes): (Vec<ServiceEntry>, BTreeSet<Frontend>) = match self.held.get(key) {
                // Held: claims what the pinned maps hold for it, writes nothing.
                Some(h) => (Vec::new(), h.frontends.clone()),
                None => {
                    let es = self.index.entries(key);
                    let fes = es.iter().map(|e| e.frontend).collect();
                    (es, fes)
                }
            };
            let created = self.index.service(key).and_then(|s| s.creation_timestamp);
            // Its own frontends (their entries may have changed) and every frontend whose
            // claimants changed (their owner may have).
            touched.extend(fes.iter().copied());
            touched.extend(self.claims.set(Rank::new(created, key.clone()), fes));
            entries.insert(key.clone(), es);
        }
        if full {
            touched.extend(self.claims.frontends().copied());
        }

        let mut removals = Vec::new();
        let mut upserts: Vec<(ObjKey, ServiceEntry)> = Vec::new();
        for fe in &touched {
            self.report_conflicts(fe);
            let Some(owner) = self.claims.owner(fe).cloned() else {
                if self.writer.is_programmed(fe) {
                    removals.push(*fe);
                } else {
                    self.refused.remove(fe);
                }
                continue;
            };
            if self.held.contains_key(&owner) {
                continue;
            }
            let es = entries
                .entry(owner.clone())
                .or_insert_with(|| self.index.entries(&owner));
            // Taken out (each frontend is visited once): the entries are not copied.
            if let Some(i) = es.iter().position(|e| e.frontend == *fe) {
                upserts.push((owner, es.remove(i)));
            }
        }
        let (owners, mut list): (Vec<ObjKey>, Vec<ServiceEntry>) = upserts.into_iter().unzip();
        let owner_of: HashMap<Frontend, ObjKey> =
            list.iter().map(|e| e.frontend).zip(owners).collect();
        write_order(&mut list);
        // Removals first (they free map room for the additions), then the upserts in
        // write order; in batches when there are many (the first sync, a relist).
        let planned = Instant::now();
        let report = self.writer.write_many(&removals, &list);
        debug!(
            frontends = list.len(),
            removals = removals.len(),
            desired_ms = planned.duration_since(started).as_secs_f64() * 1e3,
            write_ms = planned.elapsed().as_secs_f64() * 1e3,
            "sync: desired state built, written"
        );
        outcome.ops += report.ops;
        let mut failed: HashSet<Frontend> = HashSet::default();
        for e in report.errors {
            let Some(fe) = err_frontend(&e).copied() else {
                continue;
            };
            failed.insert(fe);
            match owner_of.get(&fe) {
                // A removal: nobody claims it any more, the next full re-diff removes it.
                None => {
                    outcome.failed += 1;
                    self.write_failed(&e);
                    self.full_due.get_or_insert(now);
                }
                Some(owner) => match e {
                    WriteError::Store { .. } => {
                        outcome.failed += 1;
                        self.write_failed(&e);
                        self.dirty.entry(owner.clone()).or_insert_with(Instant::now);
                    }
                    _ => {
                        let owner = owner.clone();
                        self.refuse(&owner, &e);
                    }
                },
            }
        }
        for fe in removals.iter().chain(list.iter().map(|e| &e.frontend)) {
            if !failed.contains(fe) {
                self.refused.remove(fe);
            }
        }
    }

    /// A frontend the writer refused by its content: the Service is skipped (its
    /// frontend keeps what the maps held, if anything), reported once per cause.
    fn refuse(&mut self, key: &ObjKey, err: &WriteError) {
        let Some(fe) = err_frontend(err) else { return };
        let reason = err.reason();
        let known = self.refused.values().any(|(k, r)| k == key && *r == reason);
        if self.refused.insert(*fe, (key.clone(), reason)).is_none() && !known {
            warn!(service = %key, reason, "skipping Service {key}: {err}; the rest is programmed");
            self.metrics.skipped("Service", reason);
        }
    }

    /// Reports each Service that claims `fe` without owning it, once.
    fn report_conflicts(&mut self, fe: &Frontend) {
        let losers: BTreeSet<ObjKey> = self.claims.losers(fe).cloned().collect();
        let owner = self.claims.owner(fe).cloned();
        let reported = self.conflicts_reported.entry(*fe).or_default();
        reported.retain(|k| losers.contains(k));
        let mut new = Vec::new();
        for k in &losers {
            if reported.insert(k.clone()) {
                new.push(k.clone());
            }
        }
        if reported.is_empty() {
            self.conflicts_reported.remove(fe);
        }
        if let Some(owner) = owner {
            for key in new {
                self.conflict(fe, &key, &owner);
            }
        }
    }

    fn conflict(&self, fe: &Frontend, key: &ObjKey, other: &ObjKey) {
        warn!(
            service = %key, frontend = %fe,
            "Service {key}: frontend {fe} belongs to Service {other} (created earlier, or same time and a smaller namespace/name); skipped"
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

/// An object reduced for the syncer.
enum Incoming {
    Service(Reduced<ServiceInfo>),
    Slice(Reduced<SliceInfo>),
    Node(Box<Node>),
}

#[cfg(test)]
mod tests;
