//! `Service` validated and reduced to [`ServiceInfo`] (its ports, IPs, policies).

use crate::model::Family;
use crate::model::Proto;
use k8s_openapi::api::core::v1::{Service, ServiceSpec};
use std::net::IpAddr;

use super::{
    intern, parse_cidr, parse_proto, selected, Atom, ObjKey, Skip, DEFAULT_AFFINITY_TIMEOUT,
};

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
        let Some(cluster_ips) = cluster_ips(spec)? else {
            return Ok(None);
        };
        let is_lb = spec.type_.as_deref() == Some("LoadBalancer");
        let external_local = spec.external_traffic_policy.as_deref() == Some("Local")
            && matches!(
                spec.type_.as_deref(),
                Some("NodePort") | Some("LoadBalancer")
            );
        let mut external_ips = spec
            .external_ips
            .iter()
            .flatten()
            .map(|ip| ip.parse().map_err(|_| Skip::BadExternalIp(ip.clone())))
            .collect::<Result<Vec<IpAddr>, _>>()?;
        external_ips.shrink_to_fit();
        let source_ranges = spec
            .load_balancer_source_ranges
            .iter()
            .flatten()
            .map(|r| parse_cidr(r).ok_or_else(|| Skip::BadSourceRange(r.clone())))
            .collect::<Result<Vec<_>, _>>()?;
        Ok(Some(Self {
            key,
            cluster_ips: cluster_ips.into_boxed_slice(),
            ports: ports(spec)?.into_boxed_slice(),
            internal_local: spec.internal_traffic_policy.as_deref() == Some("Local"),
            affinity_timeout: affinity_timeout(spec)?,
            external_ips,
            lb_ips: if is_lb { lb_ips(svc) } else { Vec::new() },
            external_local,
            source_ranges,
            health_check_node_port: spec
                .health_check_node_port
                .and_then(|p| u16::try_from(p).ok())
                .filter(|p| *p != 0 && external_local && is_lb),
            creation_timestamp: svc
                .metadata
                .creation_timestamp
                .as_ref()
                .map(|t| t.0.as_second()),
            maglev: false,
        }))
    }
}

/// The cluster IPs (`clusterIPs`, else `clusterIP`), each of the family `ipFamilies`
/// gives it; `None`: none (not proxied) or headless.
fn cluster_ips(spec: &ServiceSpec) -> Result<Option<Vec<IpAddr>>, Skip> {
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
    Ok(Some(cluster_ips))
}

/// The ports, each checked (1..=65535; a node port only for NodePort/LoadBalancer).
fn ports(spec: &ServiceSpec) -> Result<Vec<ServicePortInfo>, Skip> {
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
    Ok(ports)
}

/// A LoadBalancer's ingress IPs that are VIPs: kube-proxy (pkg/proxy/serviceport.go)
/// takes one only when `proxyutil.IsVIPMode`: `ipMode` unset or `VIP`.
fn lb_ips(svc: &Service) -> Vec<IpAddr> {
    let mut lb_ips: Vec<IpAddr> = svc
        .status
        .as_ref()
        .and_then(|s| s.load_balancer.as_ref())
        .and_then(|lb| lb.ingress.as_ref())
        .into_iter()
        .flatten()
        .filter(|ing| matches!(ing.ip_mode.as_deref(), None | Some("VIP")))
        .filter_map(|ing| ing.ip.as_ref().and_then(|ip| ip.parse::<IpAddr>().ok()))
        .collect();
    lb_ips.shrink_to_fit();
    lb_ips
}

/// `sessionAffinity: ClientIP`'s timeout (default 10,800 s; 1..=86,400 accepted).
fn affinity_timeout(spec: &ServiceSpec) -> Result<Option<u32>, Skip> {
    if spec.session_affinity.as_deref() != Some("ClientIP") {
        return Ok(None);
    }
    let t = spec
        .session_affinity_config
        .as_ref()
        .and_then(|c| c.client_ip.as_ref())
        .and_then(|c| c.timeout_seconds);
    match t {
        None => Ok(Some(DEFAULT_AFFINITY_TIMEOUT)),
        Some(t) if (1..=86400).contains(&t) => Ok(Some(t as u32)),
        Some(t) => Err(Skip::BadAffinityTimeout(i64::from(t))),
    }
}
