//! Decoding the API server's list pages and watch events straight from their bytes.
//!
//! A page is read as its `metadata` (resourceVersion, continue token) and its `items`
//! as borrowed raw JSON slices (`&RawValue`: no copy, no tree); each item is then decoded
//! on its own into the fields the proxy reads (serde derive over only those fields,
//! borrowed names, unknown fields skipped), so a malformed object fails alone and is
//! named. No `serde_json::Value`, no buffering of the page as serde `Content` (what a
//! `#[serde(flatten)]` list type costs), no metadata the agent never reads (managed
//! fields, annotations but the one read, owner references).
//!
//! Services and EndpointSlices are reduced here, item by item as each page is decoded,
//! to [`ServiceInfo`]/[`SliceInfo`] ([`Reduced`]): the API object of one item lives only
//! while it is converted, so a list is never held as API objects (every field an
//! `Option<String>`) and again as compact structs.

use std::{borrow::Cow, collections::BTreeMap};

use k8s_openapi::{
    api::{
        core::v1::{Node, NodeSpec, NodeStatus, Service, ServiceSpec, ServiceStatus},
        discovery::v1::{Endpoint, EndpointConditions, EndpointHints, EndpointPort, EndpointSlice},
    },
    apimachinery::pkg::apis::meta::v1::{ObjectMeta, Time},
};
use serde::Deserialize;
use serde_json::value::RawValue;

use super::{objects::ServiceInfo, Kind, ObjKey, Object, Reduced};

/// The metadata fields the agent reads (`cluster::objects`), plus the resourceVersion.
#[derive(Deserialize, Default)]
#[serde(rename_all = "camelCase")]
pub struct Meta<'a> {
    #[serde(borrow)]
    pub name: Option<Cow<'a, str>>,
    #[serde(borrow)]
    pub namespace: Option<Cow<'a, str>>,
    pub labels: Option<BTreeMap<String, String>>,
    /// Only the annotation the agent reads; the others (kubectl's last applied
    /// configuration can be kilobytes) are skipped unread.
    #[serde(borrow)]
    pub annotations: Option<Annotations<'a>>,
    pub creation_timestamp: Option<Time>,
    pub deletion_timestamp: Option<Time>,
    #[serde(borrow)]
    pub resource_version: Option<Cow<'a, str>>,
}

impl Meta<'_> {
    pub fn key(&self) -> ObjKey {
        ObjKey::new(
            self.namespace.as_deref().unwrap_or_default(),
            self.name.as_deref().unwrap_or_default(),
        )
    }

    fn into_object_meta(self) -> ObjectMeta {
        let trigger = self
            .annotations
            .as_ref()
            .and_then(|a| a.trigger_time.as_deref());
        ObjectMeta {
            annotations: trigger.map(|t| {
                BTreeMap::from([(super::objects::TRIGGER_TIME.to_string(), t.to_string())])
            }),
            name: self.name.map(Cow::into_owned),
            namespace: self.namespace.map(Cow::into_owned),
            labels: self.labels,
            creation_timestamp: self.creation_timestamp,
            deletion_timestamp: self.deletion_timestamp,
            ..ObjectMeta::default()
        }
    }
}

/// The annotations the agent reads.
#[derive(Deserialize, Default)]
pub struct Annotations<'a> {
    /// `ebpf-proxy.io/lb-algorithm` ([`super::lb_algorithm::ANNOTATION`]).
    #[serde(borrow, rename = "ebpf-proxy.io/lb-algorithm")]
    pub lb_algorithm: Option<Cow<'a, str>>,
    /// An EndpointSlice's `endpoints.kubernetes.io/last-change-trigger-time`
    /// ([`super::objects::TRIGGER_TIME`]): kube-proxy's network programming latency
    /// starts there.
    #[serde(borrow, rename = "endpoints.kubernetes.io/last-change-trigger-time")]
    pub trigger_time: Option<Cow<'a, str>>,
}

/// Only an object's metadata (a deletion, a bookmark, naming an object that failed).
#[derive(Deserialize)]
struct MetaOnly<'a> {
    #[serde(borrow, default)]
    metadata: Meta<'a>,
}

#[derive(Deserialize)]
struct ServiceItem<'a> {
    #[serde(borrow, default)]
    metadata: Meta<'a>,
    spec: Option<ServiceSpec>,
    status: Option<ServiceStatus>,
}

/// An EndpointSlice as the API type reads it (every endpoint's strings allocated): what
/// [`SliceItem`] falls back to when it does not decode, for the API type's result and
/// error message.
#[derive(Deserialize)]
#[serde(rename_all = "camelCase")]
struct ApiSliceItem<'a> {
    #[serde(borrow, default)]
    metadata: Meta<'a>,
    address_type: String,
    endpoints: Option<Vec<Endpoint>>,
    ports: Option<Vec<EndpointPort>>,
}

/// An EndpointSlice with its endpoints' strings borrowed from the text (tens of
/// thousands of endpoints in a list: three allocations each, then freed, were most of a
/// slice's decode). Every field the API type reads is read with the same type (an
/// unread one too: a value of the wrong type fails here as there), but it is stricter:
/// a duplicate field, or an escaped string where a borrowed one is read, fails, and the
/// slice is then decoded as [`ApiSliceItem`], whose result and error stand.
#[derive(Deserialize)]
#[serde(rename_all = "camelCase")]
struct SliceItem<'a> {
    #[serde(borrow, default)]
    metadata: Meta<'a>,
    address_type: &'a str,
    #[serde(borrow)]
    endpoints: Option<Vec<EndpointItem<'a>>>,
    ports: Option<Vec<EndpointPort>>,
}

/// `discovery.k8s.io/v1` `Endpoint`, its strings borrowed; the fields the agent does
/// not read are checked (as the API type does) and not kept.
#[derive(Deserialize)]
struct EndpointItem<'a> {
    #[serde(borrow)]
    addresses: Option<FirstAddress<'a>>,
    conditions: Option<EndpointConditions>,
    #[serde(rename = "deprecatedTopology")]
    _deprecated_topology: Option<Checked<BTreeMap<String, String>>>,
    hints: Option<EndpointHints>,
    #[serde(borrow, rename = "hostname")]
    _hostname: Option<Checked<&'a str>>,
    #[serde(borrow, rename = "nodeName")]
    node_name: Option<&'a str>,
    #[serde(borrow, rename = "targetRef")]
    _target_ref: Option<Checked<ReferenceItem<'a>>>,
    #[serde(borrow, rename = "zone")]
    _zone: Option<Checked<&'a str>>,
}

impl super::objects::EndpointFields for EndpointItem<'_> {
    fn first_address(&self) -> Option<&str> {
        self.addresses.as_ref().and_then(|a| a.0)
    }
    fn conditions(&self) -> Option<&EndpointConditions> {
        self.conditions.as_ref()
    }
    fn node_name(&self) -> Option<&str> {
        self.node_name
    }
    fn hints(&self) -> Option<&EndpointHints> {
        self.hints.as_ref()
    }
}

/// An endpoint's `addresses`, every one a string, the first kept (kube-proxy uses only
/// it): no allocation.
struct FirstAddress<'a>(Option<&'a str>);

impl<'de: 'a, 'a> Deserialize<'de> for FirstAddress<'a> {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct Visit<'a>(std::marker::PhantomData<&'a ()>);
        impl<'de: 'a, 'a> serde::de::Visitor<'de> for Visit<'a> {
            type Value = FirstAddress<'a>;
            fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
                f.write_str("a sequence of strings")
            }
            fn visit_seq<A: serde::de::SeqAccess<'de>>(
                self,
                mut seq: A,
            ) -> Result<FirstAddress<'a>, A::Error> {
                let first = seq.next_element::<&'de str>()?;
                while seq.next_element::<&'de str>()?.is_some() {}
                Ok(FirstAddress(first))
            }
        }
        d.deserialize_seq(Visit(std::marker::PhantomData))
    }
}

/// A value decoded as `T` (so of `T`'s type, or an error) and not kept.
struct Checked<T>(std::marker::PhantomData<T>);

impl<'de, T: Deserialize<'de>> Deserialize<'de> for Checked<T> {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        T::deserialize(d).map(|_| Checked(std::marker::PhantomData))
    }
}

/// `core/v1` `ObjectReference` (an endpoint's `targetRef`), checked and dropped.
#[derive(Deserialize)]
struct ReferenceItem<'a> {
    #[serde(borrow, rename = "apiVersion")]
    _api_version: Option<&'a str>,
    #[serde(borrow, rename = "fieldPath")]
    _field_path: Option<&'a str>,
    #[serde(borrow, rename = "kind")]
    _kind: Option<&'a str>,
    #[serde(borrow, rename = "name")]
    _name: Option<&'a str>,
    #[serde(borrow, rename = "namespace")]
    _namespace: Option<&'a str>,
    #[serde(borrow, rename = "resourceVersion")]
    _resource_version: Option<&'a str>,
    #[serde(borrow, rename = "uid")]
    _uid: Option<&'a str>,
}

#[derive(Deserialize)]
struct ServiceCidrItem<'a> {
    #[serde(borrow, default)]
    metadata: Meta<'a>,
    spec: Option<ServiceCidrSpec>,
}

#[derive(Deserialize)]
struct ServiceCidrSpec {
    #[serde(default)]
    cidrs: Vec<String>,
}

#[derive(Deserialize)]
struct NodeItem<'a> {
    #[serde(borrow, default)]
    metadata: Meta<'a>,
    spec: Option<NodeSpec>,
    status: Option<NodeStatus>,
}

/// One object of `kind`, decoded from its JSON; Services and EndpointSlices reduced at
/// once (for the agent named `proxy_name`, whose label selection they go through).
/// `Err`: it does not decode at all (the caller names it by [`meta`] and skips it).
pub fn object(
    kind: Kind,
    json: &str,
    proxy_name: Option<&str>,
) -> Result<Object, serde_json::Error> {
    decode(kind, json, proxy_name, None)
}

/// [`object`] for an object that may have no `metadata.namespace` (a manifest): a
/// namespaced one without it is in `namespace`.
pub fn object_in(
    kind: Kind,
    json: &str,
    proxy_name: Option<&str>,
    namespace: &str,
) -> Result<Object, serde_json::Error> {
    decode(kind, json, proxy_name, Some(namespace))
}

fn decode(
    kind: Kind,
    json: &str,
    proxy_name: Option<&str>,
    namespace: Option<&str>,
) -> Result<Object, serde_json::Error> {
    let default_ns = |m: &mut Meta<'_>| default_namespace(m, namespace);
    Ok(match kind {
        Kind::Service => {
            let mut s: ServiceItem = serde_json::from_str(json)?;
            default_ns(&mut s.metadata);
            let lb = s
                .metadata
                .annotations
                .as_ref()
                .and_then(|a| a.lb_algorithm.as_deref())
                .map(Box::from);
            let key = s.metadata.key();
            let svc = Service {
                metadata: s.metadata.into_object_meta(),
                spec: s.spec,
                status: s.status,
            };
            Object::ReducedService(Box::new(Reduced {
                key,
                info: ServiceInfo::from_k8s(&svc, proxy_name),
                tag: lb,
            }))
        }
        Kind::EndpointSlice => match borrowed_slice(json, proxy_name, namespace) {
            Some(slice) => slice,
            None => api_slice(json, proxy_name, namespace)?,
        },
        Kind::ServiceCidr => service_cidr(json)?,
        Kind::Pod => {
            let mut pod = super::objects::decode_pod(json)?;
            if let (true, Some(ns)) = (pod.key.namespace.is_empty(), namespace) {
                pod.key = ObjKey::new(ns, &pod.key.name);
            }
            Object::Pod(Box::new(pod))
        }
        Kind::Namespace => Object::Namespace(Box::new(super::objects::decode_namespace(json)?)),
        Kind::Node => {
            let n: NodeItem = serde_json::from_str(json)?;
            Object::Node(Box::new(Node {
                metadata: n.metadata.into_object_meta(),
                spec: n.spec,
                status: n.status,
            }))
        }
    })
}

/// An EndpointSlice decoded as [`SliceItem`] (its strings borrowed) and reduced; `None`
/// if it does not decode so (then [`api_slice`] decides).
fn borrowed_slice(json: &str, proxy_name: Option<&str>, namespace: Option<&str>) -> Option<Object> {
    let mut s = serde_json::from_str::<SliceItem>(json).ok()?;
    default_namespace(&mut s.metadata, namespace);
    let key = s.metadata.key();
    let metadata = s.metadata.into_object_meta();
    Some(Object::ReducedSlice(Box::new(Reduced::slice_parts(
        key,
        &metadata,
        s.address_type,
        s.ports.as_deref(),
        s.endpoints.as_deref().unwrap_or_default(),
        proxy_name,
    ))))
}

/// An EndpointSlice decoded as the API type reads it ([`ApiSliceItem`]) and reduced.
fn api_slice(
    json: &str,
    proxy_name: Option<&str>,
    namespace: Option<&str>,
) -> Result<Object, serde_json::Error> {
    let mut s: ApiSliceItem = serde_json::from_str(json)?;
    default_namespace(&mut s.metadata, namespace);
    let key = s.metadata.key();
    let slice = EndpointSlice {
        metadata: s.metadata.into_object_meta(),
        address_type: s.address_type,
        endpoints: s.endpoints.unwrap_or_default(),
        ports: s.ports,
    };
    Ok(Object::ReducedSlice(Box::new(Reduced::slice(
        key, &slice, proxy_name,
    ))))
}

/// An object without `metadata.namespace` is in `namespace` (a manifest's default).
fn default_namespace(m: &mut Meta<'_>, namespace: Option<&str>) {
    if let (None, Some(ns)) = (&m.namespace, namespace) {
        m.namespace = Some(Cow::Owned(ns.to_string()));
    }
}

/// A `ServiceCIDR`: its key and `spec.cidrs`, each a valid range.
fn service_cidr(json: &str) -> Result<Object, serde_json::Error> {
    let c: ServiceCidrItem = serde_json::from_str(json)?;
    let key = c.metadata.key();
    let cidrs = c
        .spec
        .map(|s| s.cidrs)
        .unwrap_or_default()
        .iter()
        .map(|text| {
            let bad = |why: &str| {
                <serde_json::Error as serde::de::Error>::custom(format!(
                    "spec.cidrs: {text:?} {why}"
                ))
            };
            let p = super::objects::parse_cidr(text).ok_or_else(|| bad("is not a CIDR"))?;
            crate::svc_cidr::check_range(p).map_err(|why| bad(&why))?;
            Ok(p)
        })
        .collect::<Result<Vec<_>, _>>()?;
    Ok(Object::ServiceCidr(Box::new(super::ServiceCidrInfo {
        key,
        cidrs,
    })))
}

/// An object's metadata alone (its key and resourceVersion), however bad the rest is.
pub fn meta(json: &str) -> Result<Meta<'_>, serde_json::Error> {
    serde_json::from_str::<MetaOnly>(json).map(|m| m.metadata)
}

#[derive(Deserialize, Default)]
#[serde(rename_all = "camelCase")]
pub struct ListMeta<'a> {
    #[serde(borrow)]
    pub resource_version: Option<Cow<'a, str>>,
    #[serde(borrow, rename = "continue")]
    pub continue_token: Option<Cow<'a, str>>,
}

/// One page of a list: its metadata and its items, each still raw.
#[derive(Deserialize)]
pub struct Page<'a> {
    #[serde(borrow, default)]
    pub metadata: ListMeta<'a>,
    #[serde(borrow, default)]
    pub items: Option<Vec<&'a RawValue>>,
}

pub fn page(json: &str) -> Result<Page<'_>, serde_json::Error> {
    serde_json::from_str(json)
}

/// One watch event: its type and its object, still raw.
#[derive(Deserialize)]
pub struct Event<'a> {
    #[serde(rename = "type", borrow)]
    pub kind: Cow<'a, str>,
    #[serde(borrow)]
    pub object: &'a RawValue,
}

pub fn event(line: &str) -> Result<Event<'_>, serde_json::Error> {
    serde_json::from_str(line)
}

/// A `metav1.Status` (a watch's ERROR event, an error response).
#[derive(Deserialize, Default, Debug)]
#[serde(default)]
pub struct Status {
    pub code: u16,
    pub reason: String,
    pub message: String,
}

pub fn status(json: &str) -> Result<Status, serde_json::Error> {
    serde_json::from_str(json)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_page_is_decoded_item_by_item_and_a_bad_item_fails_alone() {
        let json = r#"{"kind":"ServiceList","apiVersion":"v1",
            "metadata":{"resourceVersion":"42","continue":"abc","remainingItemCount":3},
            "items":[
              {"metadata":{"name":"a","namespace":"ns","labels":{"x":"y"},
                 "managedFields":[{"manager":"m"}],"annotations":{"k":"v"},
                 "resourceVersion":"40"},
               "spec":{"clusterIP":"10.0.0.1","ports":[{"port":80}],"unknownField":1}},
              {"metadata":{"name":"b\u0041","namespace":"ns"},
               "spec":{"ports":[{"port":"eighty"}]}}
            ]}"#;
        let p = page(json).expect("present");
        assert_eq!(p.metadata.resource_version.as_deref(), Some("42"));
        assert_eq!(p.metadata.continue_token.as_deref(), Some("abc"));
        let items = p.items.expect("present");
        assert_eq!(items.len(), 2);
        // Reduced as it is decoded: nothing of the API object is kept.
        let Object::ReducedService(a) =
            object(Kind::Service, items[0].get(), None).expect("present")
        else {
            panic!("not a reduced Service");
        };
        assert_eq!(a.key.to_string(), "ns/a");
        assert!(a.tag.is_none(), "no lb-algorithm annotation");
        let info = a.info.as_ref().expect("valid").as_ref().expect("selected");
        assert_eq!(
            &*info.cluster_ips,
            &["10.0.0.1".parse::<std::net::IpAddr>().expect("ip")]
        );
        assert_eq!(info.ports[0].port, 80);
        // The bad one fails, but its name (escaped) is still readable.
        assert!(object(Kind::Service, items[1].get(), None).is_err());
        assert_eq!(
            meta(items[1].get()).expect("present").key().to_string(),
            "ns/bA"
        );
    }

    #[test]
    fn the_lb_algorithm_annotation_is_read_and_the_proxy_name_selects() {
        assert_eq!(
            super::super::lb_algorithm::ANNOTATION,
            "ebpf-proxy.io/lb-algorithm",
            "the serde rename of Annotations::lb_algorithm"
        );
        let json = r#"{"metadata":{"name":"m","namespace":"ns",
              "annotations":{"kubectl.kubernetes.io/last-applied-configuration":"{}",
                             "ebpf-proxy.io/lb-algorithm":"maglev"},
              "labels":{"service.kubernetes.io/service-proxy-name":"other"}},
            "spec":{"clusterIP":"10.0.0.2","ports":[{"port":80}]}}"#;
        let Object::ReducedService(r) =
            object(Kind::Service, json, Some("other")).expect("decodes")
        else {
            panic!("not a reduced Service");
        };
        assert_eq!(r.tag.as_deref(), Some("maglev"));
        assert!(matches!(r.info, Ok(Some(_))), "selected by its proxy name");
        // Another agent's: decoded, ignored by design.
        let Object::ReducedService(r) = object(Kind::Service, json, None).expect("decodes") else {
            panic!("not a reduced Service");
        };
        assert!(matches!(r.info, Ok(None)));
        // Unusable (a bad clusterIP): reduced to its cause, for the agent to log and count.
        let bad = r#"{"metadata":{"name":"b","namespace":"ns"},
            "spec":{"clusterIP":"10.0.0.300","ports":[{"port":80}]}}"#;
        let Object::ReducedService(r) = object(Kind::Service, bad, None).expect("decodes") else {
            panic!("not a reduced Service");
        };
        assert_eq!(
            r.info.as_ref().map(|_| ()).expect_err("invalid").label(),
            "bad_cluster_ip"
        );
    }

    #[test]
    fn a_slices_trigger_time_is_read() {
        let json = r#"{"metadata":{"name":"s","namespace":"ns",
              "labels":{"kubernetes.io/service-name":"web"},
              "annotations":{"endpoints.kubernetes.io/last-change-trigger-time":"2026-12-04T13:37:05.25Z",
                             "kubectl.kubernetes.io/last-applied-configuration":"{}"}},
            "addressType":"IPv4","endpoints":null}"#;
        let Object::ReducedSlice(s) = object(Kind::EndpointSlice, json, None).expect("present")
        else {
            panic!("not a slice");
        };
        let info = s.info.as_ref().expect("valid").as_ref().expect("selected");
        let t = info
            .trigger_time
            .expect("the trigger time")
            .duration_since(std::time::UNIX_EPOCH)
            .expect("after 1970");
        assert_eq!(t.as_millis(), 1_796_391_425_250);
        // Not a time: none (the slice itself is fine).
        let bad = json.replace("2026-12-04T13:37:05.25Z", "yesterday");
        let Object::ReducedSlice(s) = object(Kind::EndpointSlice, &bad, None).expect("present")
        else {
            panic!("not a slice");
        };
        let info = s.info.as_ref().expect("valid").as_ref().expect("selected");
        assert_eq!(info.trigger_time, None);
    }

    #[test]
    fn a_slice_needs_its_address_type() {
        let ok = r#"{"metadata":{"name":"s","namespace":"ns",
              "labels":{"kubernetes.io/service-name":"web"}},
            "addressType":"IPv4","endpoints":null}"#;
        let Object::ReducedSlice(s) = object(Kind::EndpointSlice, ok, None).expect("present")
        else {
            panic!("not a slice");
        };
        let info = s.info.as_ref().expect("valid").as_ref().expect("selected");
        assert!(info.endpoints.is_empty() && info.ports.is_empty());
        assert_eq!(info.service.to_string(), "ns/web");
        assert!(object(Kind::EndpointSlice, r#"{"metadata":{"name":"s"}}"#, None).is_err());
        // One that does not validate keeps its Service's name (the agent holds it).
        let bad = r#"{"metadata":{"name":"s","namespace":"ns",
              "labels":{"kubernetes.io/service-name":"web"}},
            "addressType":"IPv4","endpoints":[{"addresses":["fe80::1"]}]}"#;
        let Object::ReducedSlice(s) = object(Kind::EndpointSlice, bad, None).expect("present")
        else {
            panic!("not a slice");
        };
        assert!(s.info.is_err());
        assert_eq!(s.tag.as_deref(), Some("web"));
    }

    /// The slice's reduction, however it was decoded, as text to compare.
    fn reduced(obj: Result<Object, serde_json::Error>) -> String {
        match obj {
            Ok(Object::ReducedSlice(r)) => format!("{} {:?} {:?}", r.key, r.info, r.tag),
            Ok(_) => "not a slice".into(),
            Err(e) => format!("error: {e}"),
        }
    }

    /// The borrowed decode gives the API type's result on every slice, and falls back to
    /// it (its result and error message) where it is stricter: a duplicate field, an
    /// escaped string, a field of the wrong type it does not read.
    #[test]
    fn a_slice_decodes_as_the_api_type_reads_it() {
        let head = r#""metadata":{"name":"s","labels":{"kubernetes.io/service-name":"web"}}"#;
        let ep = r#"{"addresses":["10.0.0.1","10.0.0.2"],"conditions":{"ready":false,"terminating":true},
            "nodeName":"n1","hostname":"h","zone":"z","deprecatedTopology":{"a":"b"},
            "targetRef":{"kind":"Pod","name":"p","namespace":"ns","uid":"u","resourceVersion":"1","apiVersion":"v1","fieldPath":""},
            "hints":{"forZones":[{"name":"z"}],"forNodes":[{"name":"n1"}]},"unknown":[1]}"#;
        let cases: Vec<(String, bool)> = [
            (format!(r#"{{{head},"addressType":"IPv4","endpoints":[{ep},{{"addresses":["10.0.0.3"]}}],"ports":[{{"name":"http","port":80}}]}}"#), true),
            (format!(r#"{{{head},"addressType":"IPv4","endpoints":null}}"#), true),
            (format!(r#"{{{head},"addressType":"IPv4","endpoints":[{{"addresses":null}},{{}},{{"addresses":[]}}]}}"#), true),
            (format!(r#"{{{head},"addressType":"IPv6","endpoints":[{{"addresses":["fd00::1"],"nodeName":null,"conditions":null}}]}}"#), true),
            (format!(r#"{{{head},"addressType":"FQDN","endpoints":[{{"addresses":["x.example"]}}]}}"#), true),
            // Unusable, the same Skip either way.
            (format!(r#"{{{head},"addressType":"IPv4","endpoints":[{{"addresses":["fd00::1"]}}]}}"#), true),
            (format!(r#"{{{head},"addressType":"IPv5","endpoints":[]}}"#), true),
            (r#"{"metadata":{"name":"s"},"addressType":"IPv4","endpoints":[]}"#.to_string(), true),
            // Stricter here: the API type's answer stands.
            (format!(r#"{{{head},"addressType":"IPv4","endpoints":[{{"addresses":["10.0.0.1"],"nodeName":"a","nodeName":"b"}}]}}"#), false),
            (format!(r#"{{{head},"addressType":"IPv4","endpoints":[{{"addresses":["10.0.0.\u0031"],"nodeName":"n\u0031"}}]}}"#), false),
            (format!(r#"{{{head},"addressType":"IPv\u0034","endpoints":[]}}"#), false),
            (format!(r#"{{{head},"addressType":"IPv4","endpoints":[{{"addresses":["10.0.0.1"],"targetRef":{{"name":"a","name":"b"}}}}]}}"#), false),
            // Errors either way, the API type's message.
            (format!(r#"{{{head},"addressType":"IPv4","endpoints":[{{"addresses":["10.0.0.1"],"hostname":5}}]}}"#), false),
            (format!(r#"{{{head},"addressType":"IPv4","endpoints":[{{"addresses":["10.0.0.1"],"targetRef":{{"uid":5}}}}]}}"#), false),
            (format!(r#"{{{head},"addressType":"IPv4","endpoints":[{{"addresses":["10.0.0.1"],"deprecatedTopology":[]}}]}}"#), false),
            (format!(r#"{{{head},"addressType":"IPv4","endpoints":[{{"addresses":[5]}}]}}"#), false),
            (format!(r#"{{{head},"addressType":"IPv4","endpoints":{{}}}}"#), false),
            (format!(r#"{{{head},"endpoints":[]}}"#), false),
        ]
        .into_iter()
        .collect();
        for (json, borrowed) in &cases {
            for ns in [None, Some("manifest-ns")] {
                let want = reduced(api_slice(json, None, ns));
                assert_eq!(
                    borrowed_slice(json, None, ns).is_some(),
                    *borrowed,
                    "borrowed decode of {json}: {want}"
                );
                assert_eq!(
                    reduced(decode(Kind::EndpointSlice, json, None, ns)),
                    want,
                    "{json}"
                );
            }
        }
        // The first case, read as the agent needs it.
        let Ok(Object::ReducedSlice(r)) =
            decode(Kind::EndpointSlice, &cases[0].0, None, Some("ns"))
        else {
            panic!("decodes");
        };
        let info = r.info.as_ref().expect("valid").as_ref().expect("selected");
        assert_eq!(info.key.to_string(), "ns/s");
        assert_eq!(info.endpoints.len(), 2);
        let e = &info.endpoints[0];
        assert_eq!(e.addr.to_string(), "10.0.0.1");
        assert!(!e.ready && !e.serving && e.terminating);
        assert_eq!(e.node.as_deref(), Some("n1"));
        assert_eq!(e.zone_hints().len(), 1);
        assert_eq!(e.node_hints().len(), 1);
        assert!(info.endpoints[1].ready && info.endpoints[1].node.is_none());
    }

    #[test]
    fn events_and_statuses() {
        let e = event(r#"{"type":"BOOKMARK","object":{"metadata":{"resourceVersion":"7"}}}"#)
            .expect("present");
        assert_eq!(e.kind, "BOOKMARK");
        assert_eq!(
            meta(e.object.get())
                .expect("present")
                .resource_version
                .as_deref(),
            Some("7")
        );
        let e = event(
            r#"{"type":"ERROR","object":{"kind":"Status","code":410,"reason":"Expired","message":"too old"}}"#,
        )
        .expect("present");
        let s = status(e.object.get()).expect("present");
        assert_eq!((s.code, s.reason.as_str()), (410, "Expired"));
    }
}
