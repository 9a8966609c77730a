//! Kubernetes objects as the proxy needs them: `Service` and `EndpointSlice` (and the
//! node's own `Node`) validated and reduced to [`ServiceInfo`], [`SliceInfo`] and
//! [`NodeInfo`]. Every way an object can be unusable is a [`Skip`] naming the cause, so
//! the caller logs it once with the object's namespace/name and counts it.

use std::{collections::BTreeMap, fmt, net::IpAddr};

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

/// `namespace/name` of an object.
#[derive(Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct ObjKey {
    pub namespace: String,
    pub name: String,
}

impl ObjKey {
    pub fn new(namespace: impl Into<String>, name: impl Into<String>) -> Self {
        Self {
            namespace: namespace.into(),
            name: name.into(),
        }
    }

    fn of(meta: &k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta) -> Self {
        Self::new(
            meta.namespace.clone().unwrap_or_default(),
            meta.name.clone().unwrap_or_default(),
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
    /// Port name ("" when unnamed); matched against EndpointSlice port names.
    pub name: String,
    pub port: u16,
    pub proto: Proto,
    /// `nodePort` (NodePort and LoadBalancer Services).
    pub node_port: Option<u16>,
}

/// A Service reduced to what the datapath needs.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ServiceInfo {
    pub key: ObjKey,
    /// `spec.clusterIPs` (one per family), or `spec.clusterIP`.
    pub cluster_ips: Vec<IpAddr>,
    pub ports: Vec<ServicePortInfo>,
    /// `internalTrafficPolicy: Local`.
    pub internal_local: bool,
    /// `sessionAffinity: ClientIP` timeout in seconds.
    pub affinity_timeout: Option<u32>,
    /// `spec.externalIPs`.
    pub external_ips: Vec<IpAddr>,
    /// `status.loadBalancer.ingress[].ip` (hostname-only entries are ignored).
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
        let mut ports = Vec::new();
        for p in spec.ports.iter().flatten() {
            let name = p.name.clone().unwrap_or_default();
            let port = u16::try_from(p.port)
                .ok()
                .filter(|p| *p != 0)
                .ok_or(Skip::BadPort {
                    name: name.clone(),
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
                name,
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
        let lb_ips: Vec<IpAddr> = if is_lb {
            svc.status
                .as_ref()
                .and_then(|s| s.load_balancer.as_ref())
                .and_then(|lb| lb.ingress.as_ref())
                .into_iter()
                .flatten()
                .filter_map(|i| i.ip.as_ref()?.parse().ok())
                .collect()
        } else {
            Vec::new()
        };
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
        Ok(Some(Self {
            key,
            cluster_ips,
            ports,
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
/// serving = ready, nil terminating = not terminating).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct EndpointInfo {
    pub addr: IpAddr,
    pub ready: bool,
    pub serving: bool,
    pub terminating: bool,
    pub node: Option<String>,
    pub zone_hints: Vec<String>,
    pub node_hints: Vec<String>,
}

/// One `ports[]` entry of a slice.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SlicePort {
    pub name: String,
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
    pub ports: Vec<SlicePort>,
    pub endpoints: Vec<EndpointInfo>,
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
            let name = p.name.clone().unwrap_or_default();
            // A nil port means "all ports" (headless services only): nothing to balance.
            let Some(port) = p.port else { continue };
            let port = u16::try_from(port)
                .ok()
                .filter(|p| *p != 0)
                .ok_or(Skip::BadPort {
                    name: name.clone(),
                    port: i64::from(port),
                })?;
            ports.push(SlicePort {
                name,
                port,
                proto: parse_proto(p.protocol.as_deref())?,
            });
        }
        let mut endpoints = Vec::new();
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
            let hints = ep.hints.as_ref();
            endpoints.push(EndpointInfo {
                addr,
                // A terminating endpoint is never ready (KEP-1672), whatever it says.
                ready: ready && !terminating,
                serving,
                terminating,
                node: ep.node_name.clone(),
                zone_hints: hints
                    .and_then(|h| h.for_zones.as_ref())
                    .map(|z| z.iter().map(|z| z.name.clone()).collect())
                    .unwrap_or_default(),
                node_hints: hints
                    .and_then(|h| h.for_nodes.as_ref())
                    .map(|n| n.iter().map(|n| n.name.clone()).collect())
                    .unwrap_or_default(),
            });
        }
        Ok(Some(Self {
            service: ObjKey::new(key.namespace.clone(), service_name.clone()),
            key,
            family,
            ports,
            endpoints,
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
