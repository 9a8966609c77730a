//! The desired state: which frontends and backends the maps must hold, as pure functions
//! of the Services, EndpointSlices and the node (after kube-proxy's `pkg/proxy`:
//! `CategorizeEndpoints` in topology.go, and linkerd's synchronous index).
//!
//! [`service_entries`] is the rule book, one Service at a time; [`Index`] stores the
//! validated objects, tells which Services an update touched, and evaluates the rules.

use std::{
    collections::{BTreeMap, BTreeSet},
    net::IpAddr,
};

use super::objects::{EndpointInfo, NodeInfo, ObjKey, ServiceInfo, SliceInfo};
use crate::{
    fasthash::HashMap,
    model::{Family, ServiceEntry},
};

mod rules;
pub use rules::{cluster_endpoints, has_any_endpoints, local_endpoints, service_entries};

/// The validated objects, indexed for [`service_entries`]. Keys share their strings with
/// the objects' own keys; a Service's slices are a short sorted list (usually one or
/// two), not a tree.
#[derive(Debug, Default)]
pub struct Index {
    pub node: NodeInfo,
    /// Every Node object seen, by name: its `InternalIP`/`ExternalIP` addresses (the
    /// senders whose DSR option is honoured, `DSR_TRUSTED4/6`). Only this node's Node
    /// unless the source watches all Nodes (`--forwarding-mode dsr|hybrid`).
    pub cluster_nodes: BTreeMap<String, Vec<IpAddr>>,
    /// Every `ServiceCIDR` object's CIDRs, by name (`SVC_CIDR4/6` with
    /// `--service-cluster-ip-range`).
    pub service_cidrs: BTreeMap<ObjKey, Vec<crate::dsr_trust::Prefix>>,
    services: BTreeMap<ObjKey, ServiceInfo>,
    slices: HashMap<ObjKey, SliceInfo>,
    slices_by_service: HashMap<ObjKey, Vec<ObjKey>>,
    /// The Services with a `healthCheckNodePort` (few), so that what runs after every
    /// sync ([`Index::health_check_ports`]) does not walk every Service.
    with_health_check: BTreeSet<ObjKey>,
    /// The Services with a Local traffic policy (internal or external), for
    /// [`Index::no_local_endpoints`] after every sync without walking every Service.
    local_policy: BTreeSet<ObjKey>,
}

/// [`Index::no_local_endpoints`]: Services with a Local policy and no local endpoint, per
/// address family (IPv4, IPv6) and policy.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct NoLocalEndpoints {
    pub internal: [i64; 2],
    pub external: [i64; 2],
}

/// `key` itself, or the equal `own` (which shares its strings with the stored object).
fn shared(key: ObjKey, own: &ObjKey) -> ObjKey {
    if key == *own {
        own.clone()
    } else {
        key
    }
}

impl Index {
    /// Every Service's cluster IPs (the ClusterIP markers of `SVC_CIDR4/6`).
    pub fn cluster_ips(&self) -> impl Iterator<Item = &IpAddr> {
        self.services.values().flat_map(|s| s.cluster_ips.iter())
    }

    /// Every `ServiceCIDR` object's CIDRs.
    pub fn api_service_cidrs(&self) -> impl Iterator<Item = &crate::dsr_trust::Prefix> {
        self.service_cidrs.values().flatten()
    }

    pub fn new(node: NodeInfo) -> Self {
        Self {
            node,
            ..Self::default()
        }
    }

    /// Stores a Service (or forgets it when `info` is None: ignored by design).
    /// Returns the Service whose frontends may have changed.
    pub fn set_service(&mut self, key: ObjKey, info: Option<ServiceInfo>) -> ObjKey {
        match info {
            Some(info) => {
                let key = shared(key, &info.key);
                if info.health_check_node_port.is_some() {
                    self.with_health_check.insert(key.clone());
                } else {
                    self.with_health_check.remove(&key);
                }
                if info.internal_local || info.external_local {
                    self.local_policy.insert(key.clone());
                } else {
                    self.local_policy.remove(&key);
                }
                self.services.insert(key.clone(), info);
                key
            }
            None => {
                self.services.remove(&key);
                self.with_health_check.remove(&key);
                self.local_policy.remove(&key);
                key
            }
        }
    }

    /// Stores a slice (or forgets it). Returns the Services it touched (its old and new
    /// owner).
    pub fn set_slice(&mut self, key: ObjKey, info: Option<SliceInfo>) -> Vec<ObjKey> {
        let mut touched = Vec::new();
        if let Some(old) = self.slices.remove(&key) {
            if let Some(set) = self.slices_by_service.get_mut(&old.service) {
                set.retain(|k| *k != key);
                if set.is_empty() {
                    self.slices_by_service.remove(&old.service);
                }
            }
            touched.push(old.service);
        }
        if let Some(info) = info {
            if !touched.contains(&info.service) {
                touched.push(info.service.clone());
            }
            self.link_slice(key, info);
        }
        touched
    }

    /// Puts slice `key` into the tables, under its Service (no copy of it is there: the
    /// caller unlinked it, or the tables are fresh).
    fn link_slice(&mut self, key: ObjKey, info: SliceInfo) {
        let key = shared(key, &info.key);
        let set = self
            .slices_by_service
            .entry(info.service.clone())
            .or_default();
        if let Err(at) = set.binary_search(&key) {
            set.insert(at, key.clone());
        }
        self.slices.insert(key, info);
    }

    /// Replaces every Service at once (initial list or relist). Returns all touched keys.
    pub fn replace_services(&mut self, all: Vec<(ObjKey, ServiceInfo)>) -> Vec<ObjKey> {
        let mut touched: BTreeSet<ObjKey> = self.services.keys().cloned().collect();
        self.services = all
            .into_iter()
            .map(|(k, info)| (shared(k, &info.key), info))
            .collect();
        touched.extend(self.services.keys().cloned());
        self.with_health_check = self
            .services
            .iter()
            .filter(|(_, s)| s.health_check_node_port.is_some())
            .map(|(k, _)| k.clone())
            .collect();
        self.local_policy = self
            .services
            .iter()
            .filter(|(_, s)| s.internal_local || s.external_local)
            .map(|(k, _)| k.clone())
            .collect();
        touched.into_iter().collect()
    }

    /// Replaces every slice at once. Returns the Services touched.
    pub fn replace_slices(&mut self, all: Vec<(ObjKey, SliceInfo)>) -> Vec<ObjKey> {
        // Sorted once at the end (a tree built key by key cost more at 50,000).
        let mut touched: Vec<ObjKey> = self.slices_by_service.keys().cloned().collect();
        self.slices = HashMap::with_capacity_and_hasher(all.len(), Default::default());
        self.slices_by_service = HashMap::with_capacity_and_hasher(all.len(), Default::default());
        for (key, info) in all {
            // Into empty tables: no previous copy to unlink, no touched list per slice (a
            // list of 100,000 slices made as many vectors). A key listed twice (not from
            // the API) goes through `set_slice`, which unlinks the first copy.
            if self.slices.contains_key(&key) {
                self.set_slice(key, Some(info));
            } else {
                self.link_slice(key, info);
            }
        }
        touched.extend(self.slices_by_service.keys().cloned());
        touched.sort_unstable();
        touched.dedup();
        touched
    }

    pub fn service(&self, key: &ObjKey) -> Option<&ServiceInfo> {
        self.services.get(key)
    }

    pub fn slices(&self) -> impl Iterator<Item = (&ObjKey, &SliceInfo)> {
        self.slices.iter()
    }

    pub fn slice(&self, key: &ObjKey) -> Option<&SliceInfo> {
        self.slices.get(key)
    }

    /// Whether a Service is known (slices of unknown Services wait for it).
    pub fn has_service(&self, key: &ObjKey) -> bool {
        self.services.contains_key(key)
    }

    /// Whether every slice's Service is in the index (no slice waits for its Service):
    /// one hash lookup per Service rather than a search of the Services per slice (every
    /// full re-diff asks; at 50,000 Services the searches cost tens of milliseconds).
    pub fn no_orphan_slices(&self) -> bool {
        self.slices_by_service.len() <= self.services.len()
            && self
                .services
                .keys()
                .filter(|k| self.slices_by_service.contains_key(*k))
                .count()
                == self.slices_by_service.len()
    }

    pub fn service_keys(&self) -> impl Iterator<Item = &ObjKey> {
        self.services.keys()
    }

    pub fn service_count(&self) -> usize {
        self.services.len()
    }

    /// `healthCheckNodePort` -> (Service, ready endpoints on this node, per address
    /// family), for every
    /// Service that has one (eTP=Local LoadBalancer Services).
    pub fn health_check_ports(&self) -> BTreeMap<u16, (ObjKey, usize)> {
        let mut out = BTreeMap::new();
        for key in &self.with_health_check {
            let Some(port) = self
                .services
                .get(key)
                .and_then(|s| s.health_check_node_port)
            else {
                continue;
            };
            let mut local: BTreeSet<IpAddr> = BTreeSet::new();
            for slice in self
                .slices_by_service
                .get(key)
                .into_iter()
                .flatten()
                .filter_map(|k| self.slices.get(k))
            {
                for ep in &slice.endpoints {
                    if ep.ready && ep.node.as_deref() == Some(self.node.name.as_str()) {
                        local.insert(ep.addr);
                    }
                }
            }
            // Endpoints, not addresses: a dual-stack pod is in an IPv4 and an IPv6 slice.
            // kube-proxy reports one family's count; the larger one here.
            let v4 = local.iter().filter(|a| a.is_ipv4()).count();
            out.insert(port, (key.clone(), v4.max(local.len() - v4)));
        }
        out
    }

    /// kube-proxy's `sync_proxy_rules_no_local_endpoints_total`: for each family of its
    /// ClusterIPs, a Service with `internalTrafficPolicy: Local` (`internal`) or
    /// `externalTrafficPolicy: Local` (`external`) whose endpoints of that family include
    /// none usable on this node ([`local_endpoints`]).
    pub fn no_local_endpoints(&self) -> NoLocalEndpoints {
        let mut out = NoLocalEndpoints::default();
        for key in &self.local_policy {
            let Some(svc) = self.services.get(key) else {
                continue;
            };
            let slices: Vec<&SliceInfo> = self
                .slices_by_service
                .get(key)
                .into_iter()
                .flatten()
                .filter_map(|k| self.slices.get(k))
                .collect();
            for (i, family) in [Family::V4, Family::V6].into_iter().enumerate() {
                if !svc.cluster_ips.iter().any(|ip| Family::of(ip) == family) {
                    continue;
                }
                let eps: Vec<&EndpointInfo> = slices
                    .iter()
                    .filter(|s| s.family == family)
                    .flat_map(|s| s.endpoints.iter())
                    .collect();
                if local_endpoints(&eps, &self.node).is_empty() {
                    if svc.internal_local {
                        out.internal[i] += 1;
                    }
                    if svc.external_local {
                        out.external[i] += 1;
                    }
                }
            }
        }
        out
    }

    /// What the maps must hold for one Service (empty when it is gone).
    pub fn entries(&self, key: &ObjKey) -> Vec<ServiceEntry> {
        let Some(svc) = self.services.get(key) else {
            return Vec::new();
        };
        let slices: Vec<&SliceInfo> = self
            .slices_by_service
            .get(key)
            .into_iter()
            .flatten()
            .filter_map(|k| self.slices.get(k))
            .collect();
        service_entries(svc, &slices, &self.node)
    }
}

#[cfg(test)]
mod tests;
