//! The Kubernetes side: objects, the desired-state index, and the two sources of truth
//! (the API server's watches and a manifests directory) that feed the agent.

pub mod api_decode;
pub mod conflicts;
pub mod counters;
pub mod external_ips;
pub mod index;
pub mod kube_client;
pub mod kube_source;
pub mod lb_algorithm;
pub mod manifests;
pub mod objects;
pub mod skips;

use k8s_openapi::api::{
    core::v1::{Node, Service},
    discovery::v1::EndpointSlice,
};

pub use objects::ObjKey;

use objects::{ServiceInfo, Skip, SliceInfo};

/// The kinds of object the agent reads.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Kind {
    Service,
    EndpointSlice,
    Node,
    /// `networking.k8s.io/v1` `ServiceCIDR` (GA in 1.33): the ranges ClusterIPs are
    /// allocated from, read from the API only.
    ServiceCidr,
    /// This node's Pods (`spec.nodeName`), reduced to what the socket-LB bypass reads
    /// ([`crate::podbypass`]); read from the API only, never by the syncer.
    Pod,
    /// Namespaces, reduced to their labels (the socket-LB bypass); API only.
    Namespace,
}

impl Kind {
    pub const fn as_str(self) -> &'static str {
        match self {
            Kind::Service => "Service",
            Kind::EndpointSlice => "EndpointSlice",
            Kind::Node => "Node",
            Kind::ServiceCidr => "ServiceCIDR",
            Kind::Pod => "Pod",
            Kind::Namespace => "Namespace",
        }
    }
}

/// A `ServiceCIDR` as the agent reads it: its name and `spec.cidrs` (one or two, one per
/// family). Like kube-proxy (`pkg/proxy/config` `ServiceCIDRConfig`), every object's
/// CIDRs count, whatever its status: a ServiceCIDR being deleted still has ClusterIPs
/// allocated from it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ServiceCidrInfo {
    pub key: ObjKey,
    pub cidrs: Vec<crate::dsr_trust::Prefix>,
}

/// One object, decoded: an API object (the manifests source; reduced by the agent), or
/// already reduced by the API reader as its list page or watch event was decoded
/// ([`Reduced`]: nothing of the API object is kept).
#[derive(Clone, Debug)]
pub enum Object {
    Service(Box<Service>),
    Slice(Box<EndpointSlice>),
    Node(Box<Node>),
    ReducedService(Box<Reduced<ServiceInfo>>),
    ReducedSlice(Box<Reduced<SliceInfo>>),
    ServiceCidr(Box<ServiceCidrInfo>),
    Pod(Box<objects::PodInfo>),
    Namespace(Box<objects::NamespaceInfo>),
}

/// An object reduced where it was decoded (`cluster::api_decode`): its key, what
/// `ServiceInfo::from_k8s` / `SliceInfo::from_k8s` made of it (`Ok(None)`: ignored by
/// design; `Err`: the cause it is unusable, which the agent logs and counts), and the
/// one string each kind still needs from the API object.
#[derive(Clone, Debug)]
pub struct Reduced<T> {
    pub key: ObjKey,
    pub info: Result<Option<T>, Skip>,
    /// A Service's `ebpf-proxy.io/lb-algorithm` annotation (the agent resolves it: it
    /// knows the default, logs and counts an unknown value); a slice's
    /// `kubernetes.io/service-name` label (a slice that does not validate at start holds
    /// its Service at what the pinned maps hold).
    pub tag: Option<Box<str>>,
}

impl Reduced<SliceInfo> {
    /// An EndpointSlice reduced (`SliceInfo::from_k8s`), with its Service's name as the
    /// tag when it does not validate.
    pub fn slice(key: ObjKey, s: &EndpointSlice, proxy_name: Option<&str>) -> Self {
        Self::slice_parts(
            key,
            &s.metadata,
            &s.address_type,
            s.ports.as_deref(),
            &s.endpoints,
            proxy_name,
        )
    }

    /// [`Self::slice`] over an EndpointSlice's fields (`SliceInfo::from_parts`).
    pub fn slice_parts<E: objects::EndpointFields>(
        key: ObjKey,
        metadata: &k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta,
        address_type: &str,
        ports: Option<&[k8s_openapi::api::discovery::v1::EndpointPort]>,
        endpoints: &[E],
        proxy_name: Option<&str>,
    ) -> Self {
        let info = SliceInfo::from_parts(metadata, address_type, ports, endpoints, proxy_name);
        let tag = match &info {
            Err(_) => metadata
                .labels
                .as_ref()
                .and_then(|l| l.get(objects::LABEL_SERVICE_NAME))
                .map(|n| Box::from(n.as_str())),
            Ok(_) => None,
        };
        Self { key, info, tag }
    }
}

impl Object {
    pub fn kind(&self) -> Kind {
        match self {
            Object::Service(_) | Object::ReducedService(_) => Kind::Service,
            Object::Slice(_) | Object::ReducedSlice(_) => Kind::EndpointSlice,
            Object::Node(_) => Kind::Node,
            Object::ServiceCidr(_) => Kind::ServiceCidr,
            Object::Pod(_) => Kind::Pod,
            Object::Namespace(_) => Kind::Namespace,
        }
    }

    pub fn key(&self) -> ObjKey {
        let meta = match self {
            Object::Service(o) => &o.metadata,
            Object::Slice(o) => &o.metadata,
            Object::Node(o) => &o.metadata,
            Object::ReducedService(r) => return r.key.clone(),
            Object::ReducedSlice(r) => return r.key.clone(),
            Object::ServiceCidr(c) => return c.key.clone(),
            Object::Pod(p) => return p.key.clone(),
            Object::Namespace(n) => return n.key.clone(),
        };
        ObjKey::new(
            meta.namespace.clone().unwrap_or_default(),
            meta.name.clone().unwrap_or_default(),
        )
    }
}

/// What a source tells the agent.
#[derive(Clone, Debug)]
pub enum Update {
    /// Every object of one kind (the initial list, or a relist after a watch restart):
    /// replaces what was known; objects missing from it are deletions.
    Snapshot {
        kind: Kind,
        objects: Vec<Object>,
        relist: bool,
    },
    /// An object was created or changed.
    Apply(Object),
    /// An object was deleted.
    Delete { kind: Kind, key: ObjKey },
    /// Updates taken together, in order, with no sync between them: what one read of
    /// the manifests directory found changed (a file's Services and their slices land
    /// in one sync, and the maps grow once for them).
    Batch(Vec<Update>),
}
