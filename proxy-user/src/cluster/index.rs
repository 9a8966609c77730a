//! The desired state: which frontends and backends the maps must hold, as pure functions
//! of the Services, EndpointSlices and the node (after kube-proxy's `pkg/proxy`:
//! `CategorizeEndpoints` in topology.go, and linkerd's synchronous index).
//!
//! [`service_entries`] is the rule book, one Service at a time; [`Index`] stores the
//! validated objects, tells which Services an update touched, and evaluates the rules.

use std::collections::{BTreeMap, BTreeSet, HashMap};

use proxy_common::{backend_flags, svc_flags};

use super::objects::{EndpointInfo, NodeInfo, ObjKey, ServiceInfo, SliceInfo};
use crate::model::{Backend, Family, Frontend, ServiceEntry};

/// Every frontend of one Service with its backends: one entry per cluster IP x port.
/// `slices` are the Service's slices (any family; each frontend takes its own family).
pub fn service_entries(
    svc: &ServiceInfo,
    slices: &[&SliceInfo],
    node: &NodeInfo,
) -> Vec<ServiceEntry> {
    let mut out = Vec::new();
    for ip in &svc.cluster_ips {
        let family = Family::of(ip);
        for port in &svc.ports {
            // Endpoints serving this port: slices of this family whose port of the same
            // name (the service port's targetPort, resolved) has the same protocol.
            let mut candidates: Vec<(EndpointInfo, u16)> = Vec::new();
            for slice in slices.iter().filter(|s| s.family == family) {
                let Some(sp) = slice
                    .ports
                    .iter()
                    .find(|p| p.name == port.name && p.proto == port.proto)
                else {
                    continue;
                };
                for ep in &slice.endpoints {
                    // The same endpoint can sit in two slices while they are rebalanced.
                    if !candidates
                        .iter()
                        .any(|(c, p)| c.addr == ep.addr && *p == sp.port)
                    {
                        candidates.push((ep.clone(), sp.port));
                    }
                }
            }
            let eps: Vec<&EndpointInfo> = candidates.iter().map(|(e, _)| e).collect();
            let chosen = if svc.internal_local {
                local_endpoints(&eps, node)
            } else {
                cluster_endpoints(&eps, node)
            };
            let mut backends: Vec<Backend> = candidates
                .iter()
                .filter(|(e, _)| chosen.iter().any(|c| std::ptr::eq(*c, e)))
                .map(|(e, p)| Backend {
                    addr: std::net::SocketAddr::new(e.addr, *p),
                    flags: if e.terminating {
                        backend_flags::TERMINATING
                    } else {
                        0
                    },
                })
                .collect();
            backends.sort();
            let mut flags = 0;
            if svc.internal_local {
                flags |= svc_flags::LOCAL_ONLY;
            }
            if svc.affinity_timeout.is_some() {
                flags |= svc_flags::AFFINITY;
            }
            let name = if port.name.is_empty() {
                svc.key.to_string()
            } else {
                format!("{}:{}", svc.key, port.name)
            };
            out.push(ServiceEntry {
                frontend: Frontend::new(*ip, port.port, port.proto),
                backends,
                flags,
                affinity_timeout: svc.affinity_timeout.unwrap_or(0),
                name,
            });
        }
    }
    out
}

/// Cluster-wide traffic: the ready endpoints (narrowed by topology hints when they
/// apply); if none is ready, the serving-and-terminating ones.
pub fn cluster_endpoints<'a>(eps: &[&'a EndpointInfo], node: &NodeInfo) -> Vec<&'a EndpointInfo> {
    let ready: Vec<&EndpointInfo> = eps.iter().copied().filter(|e| e.ready).collect();
    if !ready.is_empty() {
        return apply_topology(ready, node);
    }
    eps.iter()
        .copied()
        .filter(|e| e.serving && e.terminating)
        .collect()
}

/// `internalTrafficPolicy: Local`: ready endpoints on this node, else this node's
/// serving-and-terminating ones. Topology hints do not apply.
pub fn local_endpoints<'a>(eps: &[&'a EndpointInfo], node: &NodeInfo) -> Vec<&'a EndpointInfo> {
    let local: Vec<&EndpointInfo> = eps
        .iter()
        .copied()
        .filter(|e| e.node.as_deref() == Some(node.name.as_str()))
        .collect();
    let ready: Vec<&EndpointInfo> = local.iter().copied().filter(|e| e.ready).collect();
    if !ready.is_empty() {
        return ready;
    }
    local
        .into_iter()
        .filter(|e| e.serving && e.terminating)
        .collect()
}

/// Topology hints (KEP-2433, KEP-3015): node hints when every ready endpoint has them and
/// one names this node; else zone hints when every ready endpoint has them and one names
/// this node's zone; else no filtering.
fn apply_topology<'a>(ready: Vec<&'a EndpointInfo>, node: &NodeInfo) -> Vec<&'a EndpointInfo> {
    let all_node_hints = ready.iter().all(|e| !e.node_hints.is_empty());
    if all_node_hints && ready.iter().any(|e| e.node_hints.contains(&node.name)) {
        return ready
            .into_iter()
            .filter(|e| e.node_hints.contains(&node.name))
            .collect();
    }
    if let Some(zone) = &node.zone {
        let all_zone_hints = ready.iter().all(|e| !e.zone_hints.is_empty());
        if all_zone_hints && ready.iter().any(|e| e.zone_hints.contains(zone)) {
            return ready
                .into_iter()
                .filter(|e| e.zone_hints.contains(zone))
                .collect();
        }
    }
    ready
}

/// The validated objects, indexed for [`service_entries`].
#[derive(Debug, Default)]
pub struct Index {
    pub node: NodeInfo,
    services: BTreeMap<ObjKey, ServiceInfo>,
    slices: HashMap<ObjKey, SliceInfo>,
    slices_by_service: HashMap<ObjKey, BTreeSet<ObjKey>>,
}

impl Index {
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
            Some(info) => self.services.insert(key.clone(), info),
            None => self.services.remove(&key),
        };
        key
    }

    /// Stores a slice (or forgets it). Returns the Services it touched (its old and new
    /// owner).
    pub fn set_slice(&mut self, key: ObjKey, info: Option<SliceInfo>) -> Vec<ObjKey> {
        let mut touched = Vec::new();
        if let Some(old) = self.slices.remove(&key) {
            if let Some(set) = self.slices_by_service.get_mut(&old.service) {
                set.remove(&key);
                if set.is_empty() {
                    self.slices_by_service.remove(&old.service);
                }
            }
            touched.push(old.service);
        }
        if let Some(info) = info {
            self.slices_by_service
                .entry(info.service.clone())
                .or_default()
                .insert(key.clone());
            if !touched.contains(&info.service) {
                touched.push(info.service.clone());
            }
            self.slices.insert(key, info);
        }
        touched
    }

    /// Replaces every Service at once (initial list or relist). Returns all touched keys.
    pub fn replace_services(&mut self, all: Vec<(ObjKey, ServiceInfo)>) -> Vec<ObjKey> {
        let mut touched: BTreeSet<ObjKey> = self.services.keys().cloned().collect();
        self.services = all.into_iter().collect();
        touched.extend(self.services.keys().cloned());
        touched.into_iter().collect()
    }

    /// Replaces every slice at once. Returns the Services touched.
    pub fn replace_slices(&mut self, all: Vec<(ObjKey, SliceInfo)>) -> Vec<ObjKey> {
        let mut touched: BTreeSet<ObjKey> = self.slices_by_service.keys().cloned().collect();
        self.slices.clear();
        self.slices_by_service.clear();
        for (key, info) in all {
            self.set_slice(key, Some(info));
        }
        touched.extend(self.slices_by_service.keys().cloned());
        touched.into_iter().collect()
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

    pub fn service_keys(&self) -> impl Iterator<Item = &ObjKey> {
        self.services.keys()
    }

    pub fn service_count(&self) -> usize {
        self.services.len()
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
