//! Kubernetes objects as the proxy needs them: `Service` and `EndpointSlice` (and the
//! node's own `Node`) validated and reduced to [`ServiceInfo`], [`SliceInfo`] and
//! [`NodeInfo`]. Every way an object can be unusable is a [`Skip`] naming the cause, so
//! the caller logs it once with the object's namespace/name and counts it.

use std::{
    collections::{BTreeMap, HashSet},
    fmt,
    net::IpAddr,
    sync::{Arc, Mutex},
};

use k8s_openapi::api::{
    core::v1::{Node, Service},
    discovery::v1::EndpointSlice,
};

use crate::model::{Family, Proto};

/// Label that opts a Service (and its slices) out of the default proxy (KEP-2447).
pub const LABEL_PROXY_NAME: &str = "service.kubernetes.io/service-proxy-name";
/// Label the EndpointSlice controller sets on slices of headless services.
pub const LABEL_HEADLESS: &str = "service.kubernetes.io/headless";
/// Label linking an EndpointSlice to its Service.
pub const LABEL_SERVICE_NAME: &str = "kubernetes.io/service-name";
/// The cluster autoscaler's taint on a node it is removing.
const TAINT_TO_BE_DELETED: &str = "ToBeDeletedByClusterAutoscaler";

/// Node label with the node's zone.
pub const LABEL_ZONE: &str = "topology.kubernetes.io/zone";
/// Default `sessionAffinityConfig.clientIP.timeoutSeconds`.
pub const DEFAULT_AFFINITY_TIMEOUT: u32 = 10800;

/// A shared, immutable string: clones are a reference-count increment.
pub type Atom = Arc<str>;

/// The strings that repeat across thousands of objects (namespaces, node names, zones,
/// port names) are kept once: [`intern`] returns the one shared copy. Entries nobody
/// holds any more are pruned when the table has doubled since the last pruning, so node
/// names of long-gone nodes do not accumulate.
struct Interner {
    set: HashSet<Atom>,
    prune_at: usize,
}

static INTERNER: Mutex<Option<Interner>> = Mutex::new(None);

/// The shared copy of `s`.
pub fn intern(s: &str) -> Atom {
    let mut guard = INTERNER.lock().unwrap_or_else(|e| e.into_inner());
    let t = guard.get_or_insert_with(|| Interner {
        set: HashSet::new(),
        prune_at: 1024,
    });
    if let Some(a) = t.set.get(s) {
        return a.clone();
    }
    if t.set.len() >= t.prune_at {
        t.set.retain(|a| Arc::strong_count(a) > 1);
        t.prune_at = (t.set.len() * 2).max(1024);
    }
    let a: Atom = Arc::from(s);
    t.set.insert(a.clone());
    a
}

/// `namespace/name` of an object: the namespace interned, the name shared by the clones
/// of one key (32 bytes, cloned without allocating).
#[derive(Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct ObjKey {
    pub namespace: Atom,
    pub name: Atom,
}

impl ObjKey {
    pub fn new(namespace: impl AsRef<str>, name: impl AsRef<str>) -> Self {
        Self {
            namespace: intern(namespace.as_ref()),
            name: Arc::from(name.as_ref()),
        }
    }

    fn of(meta: &k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta) -> Self {
        Self::new(
            meta.namespace.as_deref().unwrap_or_default(),
            meta.name.as_deref().unwrap_or_default(),
        )
    }
}

impl fmt::Display for ObjKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.namespace.is_empty() {
            f.write_str(&self.name)
        } else {
            write!(f, "{}/{}", self.namespace, self.name)
        }
    }
}

/// Why an object is not used. `label()` is the metric label.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum Skip {
    #[error("clusterIP {0:?} is not an IP address")]
    BadClusterIp(String),
    #[error("port {port} of port {name:?} is out of range 1-65535")]
    BadPort { name: String, port: i64 },
    #[error("unknown protocol {0:?} (expected TCP, UDP or SCTP)")]
    UnknownProtocol(String),
    #[error("sessionAffinityConfig.clientIP.timeoutSeconds {0} is out of range 1-86400")]
    BadAffinityTimeout(i64),
    #[error("no {LABEL_SERVICE_NAME} label")]
    NoServiceLabel,
    #[error("unknown addressType {0:?}")]
    BadAddressType(String),
    #[error("endpoint address {0:?} is not an {1:?} address")]
    BadEndpointAddress(String, Family),
    #[error("could not decode: {0}")]
    Decode(String),
    #[error("no metadata.name")]
    NoName,
    #[error("externalIPs entry {0:?} is not an IP address")]
    BadExternalIp(String),
    #[error("loadBalancerSourceRanges entry {0:?} is not a CIDR")]
    BadSourceRange(String),
    #[error("clusterIPs[{index}] {ip} is not of ipFamilies[{index}] {family}")]
    FamilyMismatch {
        index: usize,
        ip: IpAddr,
        family: String,
    },
}

impl Skip {
    /// Stable snake_case cause for metrics.
    pub fn label(&self) -> &'static str {
        match self {
            Skip::BadClusterIp(_) => "bad_cluster_ip",
            Skip::BadPort { .. } => "bad_port",
            Skip::UnknownProtocol(_) => "unknown_protocol",
            Skip::BadAffinityTimeout(_) => "bad_affinity_timeout",
            Skip::NoServiceLabel => "no_service_label",
            Skip::BadAddressType(_) => "bad_address_type",
            Skip::BadEndpointAddress(..) => "bad_endpoint_address",
            Skip::Decode(_) => "decode_error",
            Skip::NoName => "no_name",
            Skip::BadExternalIp(_) => "bad_external_ip",
            Skip::BadSourceRange(_) => "bad_source_range",
            Skip::FamilyMismatch { .. } => "family_mismatch",
        }
    }
}

/// Whether an object with these labels is ours: kube-proxy's selector
/// `!service.kubernetes.io/service-proxy-name,!service.kubernetes.io/headless`, or
/// `service.kubernetes.io/service-proxy-name=<name>` for a named proxy.
pub fn selected(labels: Option<&BTreeMap<String, String>>, proxy_name: Option<&str>) -> bool {
    let get = |k: &str| labels.and_then(|l| l.get(k)).map(String::as_str);
    if get(LABEL_HEADLESS).is_some() {
        return false;
    }
    match proxy_name {
        None => get(LABEL_PROXY_NAME).is_none(),
        Some(name) => get(LABEL_PROXY_NAME) == Some(name),
    }
}

/// The label selector string for watches (same rule as [`selected`]).
pub fn label_selector(proxy_name: Option<&str>) -> String {
    match proxy_name {
        None => format!("!{LABEL_PROXY_NAME},!{LABEL_HEADLESS}"),
        Some(name) => format!("{LABEL_PROXY_NAME}={name},!{LABEL_HEADLESS}"),
    }
}

/// One `spec.ports[]` entry.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ServicePortInfo {
    /// Port name ("" when unnamed, interned); matched against EndpointSlice port names.
    pub name: Atom,
    pub port: u16,
    pub proto: Proto,
    /// `nodePort` (NodePort and LoadBalancer Services).
    pub node_port: Option<u16>,
}

/// A Service reduced to what the datapath needs (nothing of the API object is kept:
/// fixed-size addresses, interned port names, boxed slices without spare capacity).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ServiceInfo {
    pub key: ObjKey,
    /// `spec.clusterIPs` (one per family), or `spec.clusterIP`.
    pub cluster_ips: Box<[IpAddr]>,
    pub ports: Box<[ServicePortInfo]>,
    /// `internalTrafficPolicy: Local`.
    pub internal_local: bool,
    /// `sessionAffinity: ClientIP` timeout in seconds.
    pub affinity_timeout: Option<u32>,
    /// `spec.externalIPs`.
    pub external_ips: Vec<IpAddr>,
    /// `status.loadBalancer.ingress[].ip` whose `ipMode` is `VIP` or unset (hostname-only
    /// entries are ignored). With `ipMode: Proxy` (KEP-1860) the load balancer proxies to
    /// the NodePort and the IP is not programmed: in-cluster traffic to it goes out to the
    /// load balancer, as with kube-proxy's `IsVIPMode`.
    pub lb_ips: Vec<IpAddr>,
    /// `externalTrafficPolicy: Local` (NodePort/LoadBalancer Services).
    pub external_local: bool,
    /// `loadBalancerSourceRanges` as (address, prefix length).
    pub source_ranges: Vec<(IpAddr, u8)>,
    /// `healthCheckNodePort` (eTP=Local LoadBalancer Services).
    pub health_check_node_port: Option<u16>,
    /// `metadata.creationTimestamp` in Unix seconds (None when the object has none, as
    /// a manifest may): the first tie-breaker of frontend conflicts (`cluster::conflicts`).
    pub creation_timestamp: Option<i64>,
    /// Maglev for external traffic at TC (`cluster::lb_algorithm`: the annotation, else
    /// the agent's default; resolved by the agent, false as decoded).
    pub maglev: bool,
}

impl ServiceInfo {
    /// `Ok(None)`: a Service the proxy ignores by design (ExternalName, headless, not
    /// selected by the labels). `Err`: malformed.
    pub fn from_k8s(svc: &Service, proxy_name: Option<&str>) -> Result<Option<Self>, Skip> {
        let key = ObjKey::of(&svc.metadata);
        if key.name.is_empty() {
            return Err(Skip::NoName);
        }
        if !selected(svc.metadata.labels.as_ref(), proxy_name) {
            return Ok(None);
        }
        let Some(spec) = &svc.spec else {
            return Ok(None);
        };
        if spec.type_.as_deref() == Some("ExternalName") {
            return Ok(None);
        }
        let raw_ips: Vec<&str> = match (&spec.cluster_ips, &spec.cluster_ip) {
            (Some(ips), _) if !ips.is_empty() => ips.iter().map(String::as_str).collect(),
            (_, Some(ip)) if !ip.is_empty() => vec![ip.as_str()],
            _ => return Ok(None),
        };
        if raw_ips.iter().any(|ip| ip.eq_ignore_ascii_case("None")) {
            return Ok(None); // headless
        }
        let cluster_ips = raw_ips
            .iter()
            .map(|ip| ip.parse().map_err(|_| Skip::BadClusterIp(ip.to_string())))
            .collect::<Result<Vec<IpAddr>, _>>()?;
        // `ipFamilies[i]` is the family of `clusterIPs[i]` (the API server enforces it;
        // kube-proxy's per-family proxiers pick the cluster IP by its family there). A
        // Service that breaks it is not programmed in either family.
        for (index, (ip, family)) in cluster_ips
            .iter()
            .zip(spec.ip_families.iter().flatten())
            .enumerate()
        {
            let want = match family.as_str() {
                "IPv4" => Family::V4,
                "IPv6" => Family::V6,
                _ => continue,
            };
            if Family::of(ip) != want {
                return Err(Skip::FamilyMismatch {
                    index,
                    ip: *ip,
                    family: family.clone(),
                });
            }
        }
        let mut ports = Vec::new();
        for p in spec.ports.iter().flatten() {
            let name = p.name.as_deref().unwrap_or_default();
            let port = u16::try_from(p.port)
                .ok()
                .filter(|p| *p != 0)
                .ok_or(Skip::BadPort {
                    name: name.to_string(),
                    port: i64::from(p.port),
                })?;
            let node_port = match p.node_port {
                None | Some(0) => None,
                Some(np) => Some(u16::try_from(np).ok().ok_or(Skip::BadPort {
                    name: format!("{name} (nodePort)"),
                    port: i64::from(np),
                })?),
            };
            ports.push(ServicePortInfo {
                name: intern(name),
                port,
                proto: parse_proto(p.protocol.as_deref())?,
                node_port: node_port.filter(|_| {
                    matches!(
                        spec.type_.as_deref(),
                        Some("NodePort") | Some("LoadBalancer")
                    )
                }),
            });
        }
        let external_ips = spec
            .external_ips
            .iter()
            .flatten()
            .map(|ip| ip.parse().map_err(|_| Skip::BadExternalIp(ip.clone())))
            .collect::<Result<Vec<IpAddr>, _>>()?;
        let is_lb = spec.type_.as_deref() == Some("LoadBalancer");
        // kube-proxy (pkg/proxy/serviceport.go) takes an ingress IP as a VIP only when
        // `proxyutil.IsVIPMode`: `ipMode` unset or `VIP`.
        let mut lb_ips: Vec<IpAddr> = Vec::new();
        if is_lb {
            for ing in svc
                .status
                .as_ref()
                .and_then(|s| s.load_balancer.as_ref())
                .and_then(|lb| lb.ingress.as_ref())
                .into_iter()
                .flatten()
            {
                let Some(ip) = ing.ip.as_ref().and_then(|ip| ip.parse::<IpAddr>().ok()) else {
                    continue;
                };
                if matches!(ing.ip_mode.as_deref(), None | Some("VIP")) {
                    lb_ips.push(ip);
                }
            }
        }
        let source_ranges = spec
            .load_balancer_source_ranges
            .iter()
            .flatten()
            .map(|r| parse_cidr(r).ok_or_else(|| Skip::BadSourceRange(r.clone())))
            .collect::<Result<Vec<_>, _>>()?;
        let external_local = spec.external_traffic_policy.as_deref() == Some("Local")
            && matches!(
                spec.type_.as_deref(),
                Some("NodePort") | Some("LoadBalancer")
            );
        let health_check_node_port = spec
            .health_check_node_port
            .and_then(|p| u16::try_from(p).ok())
            .filter(|p| *p != 0 && external_local && is_lb);
        let affinity_timeout = if spec.session_affinity.as_deref() == Some("ClientIP") {
            let t = spec
                .session_affinity_config
                .as_ref()
                .and_then(|c| c.client_ip.as_ref())
                .and_then(|c| c.timeout_seconds);
            match t {
                None => Some(DEFAULT_AFFINITY_TIMEOUT),
                Some(t) if (1..=86400).contains(&t) => Some(t as u32),
                Some(t) => return Err(Skip::BadAffinityTimeout(i64::from(t))),
            }
        } else {
            None
        };
        let mut external_ips = external_ips;
        external_ips.shrink_to_fit();
        lb_ips.shrink_to_fit();
        Ok(Some(Self {
            key,
            cluster_ips: cluster_ips.into_boxed_slice(),
            ports: ports.into_boxed_slice(),
            internal_local: spec.internal_traffic_policy.as_deref() == Some("Local"),
            affinity_timeout,
            external_ips,
            lb_ips,
            external_local,
            source_ranges,
            health_check_node_port,
            creation_timestamp: svc
                .metadata
                .creation_timestamp
                .as_ref()
                .map(|t| t.0.as_second()),
            maglev: false,
        }))
    }
}

/// `10.0.0.0/8`, `2001:db8::/32`, or a bare address (a /32 or /128).
pub fn parse_cidr(s: &str) -> Option<(IpAddr, u8)> {
    let (addr, len) = match s.trim().split_once('/') {
        Some((a, l)) => (a.parse::<IpAddr>().ok()?, l.parse::<u8>().ok()?),
        None => {
            let a: IpAddr = s.trim().parse().ok()?;
            (a, if a.is_ipv4() { 32 } else { 128 })
        }
    };
    let max = if addr.is_ipv4() { 32 } else { 128 };
    (len <= max).then_some((addr, len))
}

/// `ip` is inside the prefix `net/len` (of the same family).
pub fn cidr_contains((net, len): (IpAddr, u8), ip: IpAddr) -> bool {
    match (net, ip) {
        (IpAddr::V4(n), IpAddr::V4(a)) => {
            let mask = u32::MAX.checked_shl(32 - u32::from(len)).unwrap_or(0);
            u32::from(n) & mask == u32::from(a) & mask
        }
        (IpAddr::V6(n), IpAddr::V6(a)) => {
            let mask = u128::MAX.checked_shl(128 - u32::from(len)).unwrap_or(0);
            u128::from(n) & mask == u128::from(a) & mask
        }
        _ => false,
    }
}

fn parse_proto(p: Option<&str>) -> Result<Proto, Skip> {
    match p {
        None | Some("TCP") => Ok(Proto::Tcp),
        Some("UDP") => Ok(Proto::Udp),
        Some("SCTP") => Ok(Proto::Sctp),
        Some(other) => Err(Skip::UnknownProtocol(other.to_string())),
    }
}

/// One endpoint of a slice, conditions resolved (KEP-1672: nil ready = ready, nil
/// serving = ready, nil terminating = not terminating). 48 bytes and no allocation of its
/// own: the node name is interned, topology hints (rare) are boxed.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct EndpointInfo {
    pub addr: IpAddr,
    pub ready: bool,
    pub serving: bool,
    pub terminating: bool,
    /// `nodeName`, interned.
    pub node: Option<Atom>,
    /// `hints` (KEP-2433/3015), when the endpoint has any.
    pub hints: Option<Box<Hints>>,
}

/// An endpoint's topology hints, interned.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Hints {
    pub zones: Box<[Atom]>,
    pub nodes: Box<[Atom]>,
}

impl EndpointInfo {
    /// `hints.forZones[].name`.
    pub fn zone_hints(&self) -> &[Atom] {
        self.hints.as_deref().map_or(&[], |h| &h.zones)
    }

    /// `hints.forNodes[].name`.
    pub fn node_hints(&self) -> &[Atom] {
        self.hints.as_deref().map_or(&[], |h| &h.nodes)
    }

    /// Whether the endpoint runs on the node `name`.
    pub fn on_node(&self, name: &str) -> bool {
        self.node.as_deref() == Some(name)
    }
}

/// One `ports[]` entry of a slice.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SlicePort {
    /// Interned.
    pub name: Atom,
    pub port: u16,
    pub proto: Proto,
}

/// An EndpointSlice reduced to what the datapath needs.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SliceInfo {
    pub key: ObjKey,
    /// The Service it belongs to (same namespace, `kubernetes.io/service-name`).
    pub service: ObjKey,
    pub family: Family,
    pub ports: Box<[SlicePort]>,
    pub endpoints: Box<[EndpointInfo]>,
}

impl SliceInfo {
    /// `Ok(None)`: ignored by design (FQDN slices, not selected by labels).
    pub fn from_k8s(slice: &EndpointSlice, proxy_name: Option<&str>) -> Result<Option<Self>, Skip> {
        let key = ObjKey::of(&slice.metadata);
        if key.name.is_empty() {
            return Err(Skip::NoName);
        }
        if !selected(slice.metadata.labels.as_ref(), proxy_name) {
            return Ok(None);
        }
        let service_name = slice
            .metadata
            .labels
            .as_ref()
            .and_then(|l| l.get(LABEL_SERVICE_NAME))
            .ok_or(Skip::NoServiceLabel)?;
        let family = match slice.address_type.as_str() {
            "IPv4" => Family::V4,
            "IPv6" => Family::V6,
            "FQDN" => return Ok(None),
            other => return Err(Skip::BadAddressType(other.to_string())),
        };
        let mut ports = Vec::new();
        for p in slice.ports.iter().flatten() {
            let name = p.name.as_deref().unwrap_or_default();
            // A nil port means "all ports" (headless services only): nothing to balance.
            let Some(port) = p.port else { continue };
            let port = u16::try_from(port)
                .ok()
                .filter(|p| *p != 0)
                .ok_or(Skip::BadPort {
                    name: name.to_string(),
                    port: i64::from(port),
                })?;
            ports.push(SlicePort {
                name: intern(name),
                port,
                proto: parse_proto(p.protocol.as_deref())?,
            });
        }
        let mut endpoints = Vec::with_capacity(slice.endpoints.len());
        for ep in &slice.endpoints {
            // kube-proxy uses the first address only.
            let Some(raw) = ep.addresses.first() else {
                continue;
            };
            let addr: IpAddr = raw
                .parse()
                .ok()
                .filter(|a| Family::of(a) == family)
                .ok_or_else(|| Skip::BadEndpointAddress(raw.clone(), family))?;
            let cond = ep.conditions.as_ref();
            let ready = cond.and_then(|c| c.ready).unwrap_or(true);
            let serving = cond.and_then(|c| c.serving).unwrap_or(ready);
            let terminating = cond.and_then(|c| c.terminating).unwrap_or(false);
            let hints = ep.hints.as_ref().map(|h| Hints {
                zones: h
                    .for_zones
                    .iter()
                    .flatten()
                    .map(|z| intern(&z.name))
                    .collect(),
                nodes: h
                    .for_nodes
                    .iter()
                    .flatten()
                    .map(|n| intern(&n.name))
                    .collect(),
            });
            endpoints.push(EndpointInfo {
                addr,
                // Taken as written: with publishNotReadyAddresses the controller writes
                // ready=true for a terminating pod, and kube-proxy selects on IsReady()
                // alone (topology.go CategorizeEndpoints).
                ready,
                serving,
                terminating,
                node: ep.node_name.as_deref().map(intern),
                hints: hints
                    .filter(|h| !h.zones.is_empty() || !h.nodes.is_empty())
                    .map(Box::new),
            });
        }
        Ok(Some(Self {
            service: ObjKey {
                namespace: key.namespace.clone(),
                name: Arc::from(service_name.as_str()),
            },
            key,
            family,
            ports: ports.into_boxed_slice(),
            endpoints: endpoints.into_boxed_slice(),
        }))
    }
}

/// What the proxy knows about the node it runs on.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct NodeInfo {
    pub name: String,
    /// `topology.kubernetes.io/zone`, from the Node object.
    pub zone: Option<String>,
    /// The Node object's `InternalIP` and `ExternalIP` addresses (sorted, unique; unusable
    /// ones such as loopback or link-local left out): NodePorts are served on them too.
    pub addresses: Vec<IpAddr>,
    /// The Node is being deleted (`deletionTimestamp` set) or the cluster autoscaler is
    /// removing it (taint `ToBeDeletedByClusterAutoscaler`): `/healthz` turns 503 so load
    /// balancers drain the node first, as kube-proxy does.
    pub deleting: bool,
}

impl NodeInfo {
    pub fn with_node(name: &str, node: Option<&Node>) -> Self {
        let mut addresses: Vec<IpAddr> = node
            .and_then(|n| n.status.as_ref())
            .and_then(|s| s.addresses.as_ref())
            .into_iter()
            .flatten()
            .filter(|a| a.type_ == "InternalIP" || a.type_ == "ExternalIP")
            .filter_map(|a| a.address.trim().parse::<IpAddr>().ok())
            .filter(crate::node::is_node_address)
            .collect();
        addresses.sort();
        addresses.dedup();
        let deleting = node.is_some_and(|n| {
            n.metadata.deletion_timestamp.is_some()
                || n.spec
                    .as_ref()
                    .and_then(|s| s.taints.as_ref())
                    .is_some_and(|t| t.iter().any(|t| t.key == TAINT_TO_BE_DELETED))
        });
        Self {
            deleting,
            name: name.to_string(),
            zone: node
                .and_then(|n| n.metadata.labels.as_ref())
                .and_then(|l| l.get(LABEL_ZONE))
                .cloned(),
            addresses,
        }
    }
}
