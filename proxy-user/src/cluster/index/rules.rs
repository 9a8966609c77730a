//! The rule book: every frontend of one Service with its backends, as pure functions of
//! the Service, its EndpointSlices and the node (after kube-proxy's `pkg/proxy`:
//! `CategorizeEndpoints` in topology.go).

use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};

use proxy_common::{backend_flags, svc_flags};

use crate::{
    cluster::objects::{EndpointInfo, NodeInfo, ObjKey, ServiceInfo, ServicePortInfo, SliceInfo},
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
            port_entries(svc, slices, node, family, port, &mut out);
        }
    }
    out
}

/// The entries of one port of `svc` in `family` (its cluster IPs', then its external
/// frontends'), pushed to `out`.
fn port_entries(
    svc: &ServiceInfo,
    slices: &[&SliceInfo],
    node: &NodeInfo,
    family: Family,
    port: &ServicePortInfo,
    out: &mut Vec<ServiceEntry>,
) {
    let candidates = candidates(slices, family, port);
    let eps: Vec<&EndpointInfo> = candidates.iter().map(|(e, _)| *e).collect();
    let backends = |chosen: &[&EndpointInfo]| backends_of(&candidates, chosen, node);
    let local = || backends(&local_endpoints(&eps, node));
    // kube-proxy's `hasEndpoints`: a usable (ready, or serving and terminating)
    // endpoint anywhere. A Local policy without a local endpoint DROPs only then;
    // with no endpoint at all it REJECTs like any Service without endpoints
    // (iptables proxier: `!hasEndpoints` -> REJECT), so LOCAL_ONLY (the datapath's
    // "drop, do not refuse") is left off.
    let local_only = svc_flags::LOCAL_ONLY * u16::from(has_any_endpoints(&eps));
    let cluster_ips = svc.cluster_ips.iter().filter(|ip| Family::of(ip) == family);
    let n_ips = cluster_ips.clone().count();
    let external = external_frontends(svc, family, port);
    // The cluster backends and the name, cloned for each entry but the last that
    // takes them (most Service ports have one frontend: no copy).
    let cluster_uses = external.len() + if svc.internal_local { 0 } else { n_ips };
    let per_external = 1 + usize::from(svc.external_local);
    let mut name = Shared::new(
        entry_name(&svc.key, &port.name),
        n_ips + external.len() * per_external,
    );
    let chosen = if cluster_uses > 0 {
        cluster_endpoints(&eps, node)
    } else {
        Vec::new()
    };
    let mut cluster = Shared::new(backends(&chosen), cluster_uses);
    let base = svc_flags::AFFINITY * u16::from(svc.affinity_timeout.is_some());
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
    let names =
        |hints: &[crate::cluster::objects::Atom], name: &str| hints.iter().any(|h| &**h == name);
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
