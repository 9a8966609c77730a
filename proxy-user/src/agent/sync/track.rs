//! Change tracking (after kube-proxy's `servicechangetracker`): each update from a source
//! (a snapshot, an apply, a delete, the node) changes the index and marks the Services it
//! touches dirty; EndpointSlices whose Service is missing are reported once.

use std::{
    collections::{BTreeMap, BTreeSet},
    time::Instant,
};

use k8s_openapi::api::core::v1::Node;
use tracing::{debug, info};

use super::{incoming::Incoming, syncer::Syncer};
use crate::{
    cluster::{
        objects::{NodeInfo, ObjKey, SliceInfo},
        skips::{SkipKind, SkipReason},
        Kind, Object, Update,
    },
    store::MapStore,
};

impl<S: MapStore> Syncer<S> {
    /// Records one update from a source.
    pub fn handle(&mut self, update: Update, now: Instant) {
        // What the entries were computed from changes (or may).
        self.prepared = None;
        match update {
            Update::Batch(updates) => {
                for u in updates {
                    self.handle(u, now);
                }
                return;
            }
            Update::Snapshot {
                kind,
                objects,
                relist,
            } => {
                if relist {
                    info!(?kind, objects = objects.len(), "relist: full re-diff");
                }
                let (began, n) = (Instant::now(), objects.len());
                self.snapshot(kind, objects, now);
                debug!(
                    ?kind,
                    objects = n,
                    took_ms = began.elapsed().as_secs_f64() * 1e3,
                    "list taken in"
                );
                // The first full list of every kind, and every relist, re-diffs all.
                self.full_due.get_or_insert(now);
                self.listed.insert(kind);
            }
            Update::Apply(obj) => {
                match obj.kind() {
                    Kind::Service => self.metrics.kube_proxy.queued(true),
                    Kind::EndpointSlice => self.metrics.kube_proxy.queued(false),
                    Kind::Node | Kind::ServiceCidr | Kind::Pod | Kind::Namespace => {}
                }
                self.apply(obj, now)
            }
            Update::Delete { kind, key } => {
                match kind {
                    Kind::Service => self.metrics.kube_proxy.queued(true),
                    Kind::EndpointSlice => self.metrics.kube_proxy.queued(false),
                    Kind::Node | Kind::ServiceCidr | Kind::Pod | Kind::Namespace => {}
                }
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
                    Kind::Node => {
                        let gone = self.index.cluster_nodes.remove(key.name.as_ref() as &str);
                        self.nodes_changed |= gone.is_some();
                    }
                    Kind::ServiceCidr => {
                        let gone = self.index.service_cidrs.remove(&key);
                        self.service_cidrs_changed |= gone.is_some();
                    }
                    Kind::Pod | Kind::Namespace => {}
                }
            }
        }
        self.metrics.services.set(self.index.service_count() as i64);
    }

    fn snapshot(&mut self, kind: Kind, objects: Vec<Object>, now: Instant) {
        // Held objects missing from a new list, or valid in it, are released below.
        let mut still_invalid: BTreeSet<ObjKey> = BTreeSet::new();
        match kind {
            Kind::Service => self.snapshot_services(objects, &mut still_invalid, now),
            Kind::EndpointSlice => self.snapshot_slices(objects, &mut still_invalid, now),
            Kind::Node => self.snapshot_nodes(objects, now),
            Kind::ServiceCidr => self.snapshot_service_cidrs(objects),
            Kind::Pod | Kind::Namespace => {}
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

    /// A list of Services: a malformed one keeps its last good version (at start: what the
    /// pinned maps hold).
    fn snapshot_services(
        &mut self,
        objects: Vec<Object>,
        still_invalid: &mut BTreeSet<ObjKey>,
        now: Instant,
    ) {
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

    /// A list of EndpointSlices: a malformed one keeps its last good version, or holds its
    /// Service.
    fn snapshot_slices(
        &mut self,
        objects: Vec<Object>,
        still_invalid: &mut BTreeSet<ObjKey>,
        now: Instant,
    ) {
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

    /// A list of Nodes: every node's addresses, and this node's own.
    fn snapshot_nodes(&mut self, objects: Vec<Object>, now: Instant) {
        let name = self.index.node.name.clone();
        let nodes: Vec<Box<Node>> = objects
            .into_iter()
            .filter_map(|o| match o {
                Object::Node(n) => Some(n),
                _ => None,
            })
            .collect();
        let before = std::mem::take(&mut self.index.cluster_nodes);
        for n in &nodes {
            self.record_cluster_node(n);
        }
        self.nodes_changed |= before != self.index.cluster_nodes;
        let own = nodes
            .iter()
            .find(|n| n.metadata.name.as_deref() == Some(name.as_str()));
        self.set_node(own.map(|n| &**n), now);
    }

    /// A list of ServiceCIDRs.
    fn snapshot_service_cidrs(&mut self, objects: Vec<Object>) {
        let all: BTreeMap<ObjKey, Vec<_>> = objects
            .into_iter()
            .filter_map(|o| match o {
                Object::ServiceCidr(c) => Some((c.key, c.cidrs)),
                _ => None,
            })
            .collect();
        self.service_cidrs_changed |= all != self.index.service_cidrs;
        self.index.service_cidrs = all;
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
                    if let Some((t, i)) = info.as_ref().and_then(|i| Some((i.trigger_time?, i))) {
                        if t >= self.started {
                            self.triggers
                                .entry(i.service.clone())
                                .or_default()
                                .push((t, i.family));
                        }
                    }
                    self.release(Kind::EndpointSlice, &key, now);
                    if self.listed.contains(&Kind::Service) {
                        self.report_orphan(&key, info.as_ref());
                    }
                    let touched = self.index.set_slice(key, info);
                    self.touch(touched, now);
                }
            }
            Incoming::ServiceCidr(c) => {
                let before = self.index.service_cidrs.insert(c.key, c.cidrs.clone());
                self.service_cidrs_changed |= before.as_ref() != Some(&c.cidrs);
            }
            Incoming::Node(n) => {
                self.record_cluster_node(&n);
                // Another node's update (all Nodes are watched in DSR modes) is not ours.
                if n.metadata.name.as_deref() == Some(self.index.node.name.as_str()) {
                    self.set_node(Some(&n), now);
                }
            }
            Incoming::NotSynced => {}
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
    pub(super) fn report_orphans(&mut self) {
        if self.index.no_orphan_slices() {
            self.orphans_reported.clear();
            return;
        }
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
        self.metrics
            .skipped(SkipKind::ENDPOINT_SLICE, SkipReason::ServiceMissing);
    }

    /// A Node object's addresses in [`Index::cluster_nodes`].
    fn record_cluster_node(&mut self, node: &Node) {
        if let Some(name) = node.metadata.name.as_deref() {
            let info = NodeInfo::with_node(name, Some(node));
            let before = self
                .index
                .cluster_nodes
                .insert(name.to_string(), info.addresses.clone());
            self.nodes_changed |= before.as_ref() != Some(&info.addresses);
        }
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
}
