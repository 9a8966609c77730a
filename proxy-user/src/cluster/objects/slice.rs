//! `EndpointSlice` validated and reduced to [`SliceInfo`] (endpoints with their
//! conditions resolved, topology hints).

use crate::model::Family;
use crate::model::Proto;
use k8s_openapi::api::discovery::v1::{
    Endpoint, EndpointConditions, EndpointHints, EndpointPort, EndpointSlice,
};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
use std::net::IpAddr;
use std::sync::Arc;

use super::{intern, parse_proto, selected, Atom, ObjKey, Skip, LABEL_SERVICE_NAME};

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
    /// `endpoints.kubernetes.io/last-change-trigger-time`, when set and valid: when the
    /// change this version carries happened (the EndpointSlice controller's clock).
    pub trigger_time: Option<std::time::SystemTime>,
}

/// The annotation the EndpointSlice controller sets to the time of the Service or Pod
/// change a slice's version carries (RFC 3339).
pub const TRIGGER_TIME: &str = "endpoints.kubernetes.io/last-change-trigger-time";

/// An RFC 3339 time (`2026-12-04T13:37:05Z`, `2026-12-04T13:37:05.123456789+01:00`);
/// `None` when it is not one.
pub fn parse_rfc3339(s: &str) -> Option<std::time::SystemTime> {
    let t: k8s_openapi::apimachinery::pkg::apis::meta::v1::Time =
        serde_json::from_value(serde_json::Value::String(s.to_string())).ok()?;
    Some(std::time::SystemTime::from(t.0))
}

impl SliceInfo {
    /// `Ok(None)`: ignored by design (FQDN slices, not selected by labels).
    pub fn from_k8s(slice: &EndpointSlice, proxy_name: Option<&str>) -> Result<Option<Self>, Skip> {
        Self::from_parts(
            &slice.metadata,
            &slice.address_type,
            slice.ports.as_deref(),
            &slice.endpoints,
            proxy_name,
        )
    }

    /// [`Self::from_k8s`] over an EndpointSlice's fields, its endpoints of any type that
    /// has an endpoint's fields (the API object's, or the decoder's borrowed one:
    /// `cluster::api_decode`).
    pub fn from_parts<E: EndpointFields>(
        metadata: &ObjectMeta,
        address_type: &str,
        ports: Option<&[EndpointPort]>,
        endpoints: &[E],
        proxy_name: Option<&str>,
    ) -> Result<Option<Self>, Skip> {
        let key = ObjKey::of(metadata);
        if key.name.is_empty() {
            return Err(Skip::NoName);
        }
        if !selected(metadata.labels.as_ref(), proxy_name) {
            return Ok(None);
        }
        let service_name = metadata
            .labels
            .as_ref()
            .and_then(|l| l.get(LABEL_SERVICE_NAME))
            .ok_or(Skip::NoServiceLabel)?;
        let family = match address_type {
            "IPv4" => Family::V4,
            "IPv6" => Family::V6,
            "FQDN" => return Ok(None),
            other => return Err(Skip::BadAddressType(other.to_string())),
        };
        let ports = slice_ports(ports)?;
        // The endpoints of a slice are mostly on a few nodes: the last one's name is
        // reused, not interned again (a lock and a lookup) for each.
        let mut last_node: Option<Atom> = None;
        let endpoints = endpoints
            .iter()
            .filter_map(|ep| endpoint(ep, family, &mut last_node).transpose())
            .collect::<Result<Vec<_>, _>>()?;
        Ok(Some(Self {
            service: ObjKey {
                namespace: key.namespace.clone(),
                name: Arc::from(service_name.as_str()),
            },
            key,
            family,
            ports: ports.into_boxed_slice(),
            endpoints: endpoints.into_boxed_slice(),
            trigger_time: metadata
                .annotations
                .as_ref()
                .and_then(|a| a.get(TRIGGER_TIME))
                .and_then(|t| parse_rfc3339(t)),
        }))
    }
}

/// The slice's ports, each checked (1..=65535); a nil port ("all ports", headless
/// Services only) has nothing to balance and is left out.
fn slice_ports(slice_ports: Option<&[EndpointPort]>) -> Result<Vec<SlicePort>, Skip> {
    let mut ports = Vec::new();
    for p in slice_ports.into_iter().flatten() {
        let name = p.name.as_deref().unwrap_or_default();
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
    Ok(ports)
}

/// One endpoint: its first address (kube-proxy uses the first only; it must be of the
/// slice's family), conditions and hints. `None`: no address.
/// `last_node`: the node name interned last, reused when this endpoint's is the same.
fn endpoint<E: EndpointFields>(
    ep: &E,
    family: Family,
    last_node: &mut Option<Atom>,
) -> Result<Option<EndpointInfo>, Skip> {
    let Some(raw) = ep.first_address() else {
        return Ok(None);
    };
    let addr: IpAddr = raw
        .parse()
        .ok()
        .filter(|a| Family::of(a) == family)
        .ok_or_else(|| Skip::BadEndpointAddress(raw.to_string(), family))?;
    let cond = ep.conditions();
    let ready = cond.and_then(|c| c.ready).unwrap_or(true);
    let serving = cond.and_then(|c| c.serving).unwrap_or(ready);
    let terminating = cond.and_then(|c| c.terminating).unwrap_or(false);
    let hints = ep.hints().map(|h| Hints {
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
    Ok(Some(EndpointInfo {
        addr,
        // Taken as written: with publishNotReadyAddresses the controller writes
        // ready=true for a terminating pod, and kube-proxy selects on IsReady()
        // alone (topology.go CategorizeEndpoints).
        ready,
        serving,
        terminating,
        node: ep.node_name().map(|name| match last_node {
            Some(last) if **last == *name => last.clone(),
            _ => last_node.insert(intern(name)).clone(),
        }),
        hints: hints
            .filter(|h| !h.zones.is_empty() || !h.nodes.is_empty())
            .map(Box::new),
    }))
}

/// The fields of an EndpointSlice's endpoint that [`SliceInfo`] reads.
pub trait EndpointFields {
    /// `addresses[0]` (kube-proxy uses the first only).
    fn first_address(&self) -> Option<&str>;
    fn conditions(&self) -> Option<&EndpointConditions>;
    fn node_name(&self) -> Option<&str>;
    fn hints(&self) -> Option<&EndpointHints>;
}

impl EndpointFields for Endpoint {
    fn first_address(&self) -> Option<&str> {
        self.addresses.first().map(String::as_str)
    }
    fn conditions(&self) -> Option<&EndpointConditions> {
        self.conditions.as_ref()
    }
    fn node_name(&self) -> Option<&str> {
        self.node_name.as_deref()
    }
    fn hints(&self) -> Option<&EndpointHints> {
        self.hints.as_ref()
    }
}
