//! The desired state: which frontends and backends the maps must hold, as pure functions
//! of the Services, EndpointSlices and the node (after kube-proxy's `pkg/proxy`:
//! `CategorizeEndpoints` in topology.go, and linkerd's synchronous index).
//!
//! [`service_entries`] is the rule book, one Service at a time; [`Index`] stores the
//! validated objects, tells which Services an update touched, and evaluates the rules.

use std::{
    collections::{BTreeMap, BTreeSet},
    net::{IpAddr, Ipv4Addr, Ipv6Addr},
};

use proxy_common::{backend_flags, svc_flags};

use super::objects::{EndpointInfo, NodeInfo, ObjKey, ServiceInfo, ServicePortInfo, SliceInfo};
use crate::{
    fasthash::{HashMap, HashSet},
    model::{Backend, Family, Frontend, ServiceEntry},
};

/// Every frontend of one Service with its backends: per cluster IP x port, and for the
/// external addresses (NodePort on any node address, `externalIPs`, LoadBalancer ingress
/// IPs) of each port, with the `EXTERNAL_LOCAL` twin under `externalTrafficPolicy: Local`.
/// `slices` are the Service's slices (any family; each frontend takes its own family).
pub fn service_entries(
    svc: &ServiceInfo,
    slices: &[&SliceInfo],
    node: &NodeInfo,
) -> Vec<ServiceEntry> {
    let mut out = Vec::with_capacity(svc.ports.len() * svc.cluster_ips.len());
    for family in families(svc).into_iter().flatten() {
        for port in &svc.ports {
            let candidates = candidates(slices, family, port);
            let eps: Vec<&EndpointInfo> = candidates.iter().map(|(e, _)| *e).collect();
            let backends = |chosen: &[&EndpointInfo]| backends_of(&candidates, chosen, node);
            let local = || backends(&local_endpoints(&eps, node));
            // kube-proxy's `hasEndpoints`: a usable (ready, or serving and terminating)
            // endpoint anywhere. A Local policy without a local endpoint DROPs only then;
            // with no endpoint at all it REJECTs like any Service without endpoints
            // (iptables proxier: `!hasEndpoints` -> REJECT), so LOCAL_ONLY (the datapath's
            // "drop, do not refuse") is left off.
            let has_endpoints = has_any_endpoints(&eps);
            let local_only = if has_endpoints {
                svc_flags::LOCAL_ONLY
            } else {
                0
            };
            let cluster_ips = svc.cluster_ips.iter().filter(|ip| Family::of(ip) == family);
            let external = external_frontends(svc, family, port);
            // The cluster backends and the name, cloned for each entry but the last that
            // takes them (most Service ports have one frontend: no copy).
            let per_external = 1 + usize::from(svc.external_local);
            let mut name = Shared::new(
                entry_name(&svc.key, &port.name),
                cluster_ips.clone().count() + external.len() * per_external,
            );
            let cluster_uses = external.len()
                + if svc.internal_local {
                    0
                } else {
                    cluster_ips.clone().count()
                };
            let mut cluster = Shared::new(
                if cluster_uses > 0 {
                    backends(&cluster_endpoints(&eps, node))
                } else {
                    Vec::new()
                },
                cluster_uses,
            );
            let mut base = 0;
            if svc.affinity_timeout.is_some() {
                base |= svc_flags::AFFINITY;
            }
            let mut entry = |frontend: Frontend, backends: Vec<Backend>, flags: u16| ServiceEntry {
                frontend,
                backends,
                flags: base | flags,
                affinity_timeout: svc.affinity_timeout.unwrap_or(0),
                name: name.take(),
                source_ranges: if flags & svc_flags::SOURCE_RANGES != 0 {
                    svc.source_ranges.clone()
                } else {
                    Vec::new()
                },
            };
            for ip in cluster_ips {
                let fe = Frontend::new(*ip, port.port, port.proto);
                out.push(if svc.internal_local {
                    entry(fe, local(), local_only)
                } else {
                    entry(fe, cluster.take(), 0)
                });
            }
            // External frontends: cluster endpoints for every client the socket hooks
            // see (pods, the node), and the local-only twin for traffic from outside
            // when externalTrafficPolicy is Local.
            for (fe, mut kind) in external {
                // The TC path's choice for traffic from outside (the socket hooks ignore it).
                if svc.maglev {
                    kind |= svc_flags::MAGLEV;
                }
                if svc.external_local {
                    out.push(entry(fe, cluster.take(), kind | svc_flags::ETP_LOCAL));
                    out.push(entry(
                        fe.with_scope(proxy_common::scope::EXTERNAL_LOCAL),
                        local(),
                        kind | local_only,
                    ));
                } else {
                    out.push(entry(fe, cluster.take(), kind));
                }
            }
        }
    }
    out
}

/// A value handed to `uses` takers: a clone to each but the last, which takes it.
struct Shared<T> {
    value: Option<T>,
    left: usize,
}

impl<T: Clone + Default> Shared<T> {
    fn new(value: T, uses: usize) -> Self {
        Self {
            value: Some(value),
            left: uses,
        }
    }

    fn take(&mut self) -> T {
        self.left = self.left.saturating_sub(1);
        if self.left == 0 {
            self.value.take().unwrap_or_default()
        } else {
            self.value.clone().unwrap_or_default()
        }
    }
}

/// The endpoints serving `port` in `family`: from the slices of that family whose port of
/// the same name (the service port's targetPort, resolved) has the same protocol, each
/// address:port once.
fn candidates<'a>(
    slices: &[&'a SliceInfo],
    family: Family,
    port: &ServicePortInfo,
) -> Vec<(&'a EndpointInfo, u16)> {
    // References into the slices, sized once: a first sync computes this for every
    // Service port on two threads, whose clones and regrowths met on the allocator's lock.
    let endpoints = slices.iter().map(|s| s.endpoints.len()).sum::<usize>();
    let mut candidates: Vec<(&EndpointInfo, u16)> = Vec::with_capacity(endpoints);
    // Where each address:port sits in `candidates`: linear in the endpoints, so a
    // Service with tens of thousands of them costs no more than its size.
    // Few endpoints (most Services): found by a scan of the candidates, no map.
    let small = endpoints <= SMALL_SCAN;
    let mut seen: HashMap<(IpAddr, u16), usize> = HashMap::default();
    for slice in slices.iter().filter(|s| s.family == family) {
        let Some(sp) = slice
            .ports
            .iter()
            .find(|p| p.name == port.name && p.proto == port.proto)
        else {
            continue;
        };
        for ep in &slice.endpoints {
            // The same endpoint can sit in two slices while they are rebalanced:
            // one endpoint, and a non-terminating copy replaces a terminating one
            // whatever the order of the slices (endpointslicecache.go
            // addEndpoints: `if !exists || !terminating`).
            let at = if small {
                candidates
                    .iter()
                    .position(|(e, p)| e.addr == ep.addr && *p == sp.port)
            } else {
                seen.get(&(ep.addr, sp.port)).copied()
            };
            match at {
                None => {
                    if !small {
                        seen.insert((ep.addr, sp.port), candidates.len());
                    }
                    candidates.push((ep, sp.port));
                }
                Some(i) if !ep.terminating => candidates[i].0 = ep,
                Some(_) => {}
            }
        }
    }
    candidates
}

/// The external frontends of `port` in `family` and their kind: the NodePort (on any node
/// address), each `externalIPs` address, each LoadBalancer ingress IP (with
/// `SOURCE_RANGES` when the Service has source ranges).
fn external_frontends(
    svc: &ServiceInfo,
    family: Family,
    port: &ServicePortInfo,
) -> Vec<(Frontend, u16)> {
    let mut external: Vec<(Frontend, u16)> = Vec::new();
    if let Some(np) = port.node_port {
        external.push((
            Frontend::new(unspecified(family), np, port.proto),
            svc_flags::NODE_PORT,
        ));
    }
    for ip in svc
        .external_ips
        .iter()
        .filter(|ip| Family::of(ip) == family)
    {
        external.push((
            Frontend::new(*ip, port.port, port.proto),
            svc_flags::EXTERNAL_IP,
        ));
    }
    for ip in svc.lb_ips.iter().filter(|ip| Family::of(ip) == family) {
        let mut f = svc_flags::LOAD_BALANCER;
        if !svc.source_ranges.is_empty() {
            f |= svc_flags::SOURCE_RANGES;
        }
        external.push((Frontend::new(*ip, port.port, port.proto), f));
    }
    external
}

/// The families of the Service's cluster IPs, in their order (at most two).
fn families(svc: &ServiceInfo) -> [Option<Family>; 2] {
    let mut families = [None, None];
    for ip in &svc.cluster_ips {
        let f = Some(Family::of(ip));
        if families[0].is_none() {
            families[0] = f;
        } else if families[0] != f && families[1].is_none() {
            families[1] = f;
        }
    }
    families
}

/// The backends of the `chosen` endpoints, in the order of `candidates` (the chosen
/// endpoints are references into it).
fn backends_of(
    candidates: &[(&EndpointInfo, u16)],
    chosen: &[&EndpointInfo],
    node: &NodeInfo,
) -> Vec<Backend> {
    // The chosen endpoints come in the candidates' order (every rule filters them in
    // order): one walk, no set; a set only if that ever did not hold.
    let mut b: Vec<Backend> = Vec::with_capacity(chosen.len());
    let mut next = chosen.iter().peekable();
    for (e, p) in candidates {
        if next.next_if(|c| std::ptr::eq(**c, *e)).is_some() {
            b.push(backend(e, *p, node));
        }
    }
    if next.peek().is_some() {
        let chosen: HashSet<*const EndpointInfo> =
            chosen.iter().map(|c| *c as *const EndpointInfo).collect();
        b = candidates
            .iter()
            .filter(|(e, _)| chosen.contains(&(*e as *const EndpointInfo)))
            .map(|(e, p)| backend(e, *p, node))
            .collect();
    }
    b.sort();
    b
}

/// `namespace/name` or `namespace/name:port`, the name an entry carries, in one allocation.
fn entry_name(key: &ObjKey, port: &str) -> String {
    use std::fmt::Write;
    let mut name = String::with_capacity(key.namespace.len() + key.name.len() + port.len() + 2);
    let _ = write!(name, "{key}");
    if !port.is_empty() {
        name.push(':');
        name.push_str(port);
    }
    name
}

/// Up to this many endpoints, [`candidates`] finds repeats by a scan (no hash map).
const SMALL_SCAN: usize = 16;

fn unspecified(family: Family) -> IpAddr {
    match family {
        Family::V4 => IpAddr::V4(Ipv4Addr::UNSPECIFIED),
        Family::V6 => IpAddr::V6(Ipv6Addr::UNSPECIFIED),
    }
}

fn backend(e: &EndpointInfo, port: u16, node: &NodeInfo) -> Backend {
    let mut flags = 0;
    if e.terminating {
        flags |= backend_flags::TERMINATING;
    }
    if e.node.as_deref() == Some(node.name.as_str()) {
        flags |= backend_flags::LOCAL;
    }
    Backend {
        addr: std::net::SocketAddr::new(e.addr, port),
        flags,
    }
}

/// Whether any endpoint is usable anywhere: ready, or serving and terminating
/// (kube-proxy's `hasAnyEndpoints` from `CategorizeEndpoints`).
pub fn has_any_endpoints(eps: &[&EndpointInfo]) -> bool {
    eps.iter().any(|e| e.ready || (e.serving && e.terminating))
}

/// Cluster-wide traffic: the ready endpoints (narrowed by topology hints when they
/// apply); if none is ready, the serving-and-terminating ones.
pub fn cluster_endpoints<'a>(eps: &[&'a EndpointInfo], node: &NodeInfo) -> Vec<&'a EndpointInfo> {
    let mut ready: Vec<&EndpointInfo> = Vec::with_capacity(eps.len());
    ready.extend(eps.iter().copied().filter(|e| e.ready));
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
    let names = |hints: &[super::objects::Atom], name: &str| hints.iter().any(|h| &**h == name);
    let all_node_hints = ready.iter().all(|e| !e.node_hints().is_empty());
    if all_node_hints && ready.iter().any(|e| names(e.node_hints(), &node.name)) {
        return ready
            .into_iter()
            .filter(|e| names(e.node_hints(), &node.name))
            .collect();
    }
    if let Some(zone) = &node.zone {
        let all_zone_hints = ready.iter().all(|e| !e.zone_hints().is_empty());
        if all_zone_hints && ready.iter().any(|e| names(e.zone_hints(), zone)) {
            return ready
                .into_iter()
                .filter(|e| names(e.zone_hints(), zone))
                .collect();
        }
    }
    ready
}

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
            let key = shared(key, &info.key);
            let set = self
                .slices_by_service
                .entry(info.service.clone())
                .or_default();
            if let Err(at) = set.binary_search(&key) {
                set.insert(at, key.clone());
            }
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
            self.set_slice(key, Some(info));
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
