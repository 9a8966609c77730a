//! Decoding the API server's list pages and watch events straight from their bytes.
//!
//! A page is read as its `metadata` (resourceVersion, continue token) and its `items`
//! as borrowed raw JSON slices (`&RawValue`: no copy, no tree); each item is then decoded
//! on its own into the fields the proxy reads (serde derive over only those fields,
//! borrowed names, unknown fields skipped), so a malformed object fails alone and is
//! named. No `serde_json::Value`, no buffering of the page as serde `Content` (what a
//! `#[serde(flatten)]` list type costs), no metadata the agent never reads (managed
//! fields, annotations, owner references).

use std::{borrow::Cow, collections::BTreeMap};

use k8s_openapi::{
    api::{
        core::v1::{Node, NodeSpec, NodeStatus, Service, ServiceSpec, ServiceStatus},
        discovery::v1::{Endpoint, EndpointPort, EndpointSlice},
    },
    apimachinery::pkg::apis::meta::v1::{ObjectMeta, Time},
};
use serde::Deserialize;
use serde_json::value::RawValue;

use super::{Kind, ObjKey, Object};

/// The metadata fields the agent reads (`cluster::objects`), plus the resourceVersion.
#[derive(Deserialize, Default)]
#[serde(rename_all = "camelCase")]
pub struct Meta<'a> {
    #[serde(borrow)]
    pub name: Option<Cow<'a, str>>,
    #[serde(borrow)]
    pub namespace: Option<Cow<'a, str>>,
    pub labels: Option<BTreeMap<String, String>>,
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
        ObjectMeta {
            name: self.name.map(Cow::into_owned),
            namespace: self.namespace.map(Cow::into_owned),
            labels: self.labels,
            creation_timestamp: self.creation_timestamp,
            deletion_timestamp: self.deletion_timestamp,
            ..ObjectMeta::default()
        }
    }
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

#[derive(Deserialize)]
#[serde(rename_all = "camelCase")]
struct SliceItem<'a> {
    #[serde(borrow, default)]
    metadata: Meta<'a>,
    address_type: String,
    endpoints: Option<Vec<Endpoint>>,
    ports: Option<Vec<EndpointPort>>,
}

#[derive(Deserialize)]
struct NodeItem<'a> {
    #[serde(borrow, default)]
    metadata: Meta<'a>,
    spec: Option<NodeSpec>,
    status: Option<NodeStatus>,
}

/// One object of `kind`, decoded from its JSON.
pub fn object(kind: Kind, json: &str) -> Result<Object, serde_json::Error> {
    Ok(match kind {
        Kind::Service => {
            let s: ServiceItem = serde_json::from_str(json)?;
            Object::Service(Box::new(Service {
                metadata: s.metadata.into_object_meta(),
                spec: s.spec,
                status: s.status,
            }))
        }
        Kind::EndpointSlice => {
            let s: SliceItem = serde_json::from_str(json)?;
            Object::Slice(Box::new(EndpointSlice {
                metadata: s.metadata.into_object_meta(),
                address_type: s.address_type,
                endpoints: s.endpoints.unwrap_or_default(),
                ports: s.ports,
            }))
        }
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
        let Object::Service(a) = object(Kind::Service, items[0].get()).expect("present") else {
            panic!("not a Service");
        };
        assert_eq!(a.metadata.name.as_deref(), Some("a"));
        assert_eq!(a.metadata.labels.as_ref().expect("present")["x"], "y");
        assert!(a.metadata.annotations.is_none() && a.metadata.managed_fields.is_none());
        assert_eq!(
            a.spec.as_ref().expect("present").cluster_ip.as_deref(),
            Some("10.0.0.1")
        );
        // The bad one fails, but its name (escaped) is still readable.
        assert!(object(Kind::Service, items[1].get()).is_err());
        assert_eq!(
            meta(items[1].get()).expect("present").key().to_string(),
            "ns/bA"
        );
    }

    #[test]
    fn a_slice_needs_its_address_type() {
        let ok = r#"{"metadata":{"name":"s"},"addressType":"IPv4","endpoints":null}"#;
        let Object::Slice(s) = object(Kind::EndpointSlice, ok).expect("present") else {
            panic!("not a slice");
        };
        assert!(s.endpoints.is_empty() && s.ports.is_none());
        assert!(object(Kind::EndpointSlice, r#"{"metadata":{"name":"s"}}"#).is_err());
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
