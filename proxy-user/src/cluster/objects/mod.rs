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

use crate::model::{Family, Proto};

mod node;
mod pod;
mod service;
mod slice;

pub use node::NodeInfo;
pub use pod::{decode_namespace, decode_pod, NamespaceInfo, PodInfo};
pub use service::{ServiceInfo, ServicePortInfo};
pub use slice::{
    parse_rfc3339, EndpointFields, EndpointInfo, Hints, SliceInfo, SlicePort, TRIGGER_TIME,
};

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
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct ObjKey {
    pub namespace: Atom,
    pub name: Atom,
}

/// By namespace, then name (as derived), without comparing the bytes of strings that
/// are one shared copy (interned namespaces; the clones of one key): the desired state's
/// maps and sets of tens of thousands of keys compare mostly such strings.
impl Ord for ObjKey {
    fn cmp(&self, other: &Self) -> std::cmp::Ordering {
        fn by(a: &Atom, b: &Atom) -> std::cmp::Ordering {
            if Arc::ptr_eq(a, b) {
                std::cmp::Ordering::Equal
            } else {
                a.cmp(b)
            }
        }
        by(&self.namespace, &other.namespace).then_with(|| by(&self.name, &other.name))
    }
}

impl PartialOrd for ObjKey {
    fn partial_cmp(&self, other: &Self) -> Option<std::cmp::Ordering> {
        Some(self.cmp(other))
    }
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
