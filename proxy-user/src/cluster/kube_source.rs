//! The Kubernetes API source: kube-rs watches on Services and EndpointSlices (with
//! kube-proxy's label selector) and on this node's Node object. Watches restart with
//! backoff; every (re)list is passed on as one snapshot, so a relist after a `410 Gone`
//! or a reconnect is a full re-diff in which objects deleted meanwhile disappear.
//!
//! Objects are watched untyped and decoded one by one, so a malformed object is logged
//! with its namespace/name, counted and skipped without stopping the watch.

use std::path::Path;

use futures::StreamExt as _;
use kube::{
    api::{Api, ApiResource, DynamicObject, GroupVersionKind},
    config::{KubeConfigOptions, Kubeconfig},
    runtime::{watcher, WatchStreamExt as _},
    Client, Config,
};
use tokio::sync::mpsc;
use tracing::{info, warn};

use super::counters::SourceCounters;
use k8s_openapi::{
    api::{
        core::v1::{Node, Service},
        discovery::v1::EndpointSlice,
    },
    apimachinery::pkg::apis::meta::v1::ObjectMeta,
};
use serde::de::DeserializeOwned;
use serde_json::Value;

use super::{objects::label_selector, Kind, ObjKey, Object, Update};

/// A client from `--kubeconfig`, else in-cluster config, else `$KUBECONFIG` /
/// `~/.kube/config`.
pub async fn client(kubeconfig: Option<&Path>) -> anyhow::Result<Client> {
    let config = match kubeconfig {
        Some(path) => {
            let kc = Kubeconfig::read_from(path)
                .map_err(|e| anyhow::anyhow!("reading kubeconfig {}: {e}", path.display()))?;
            Config::from_custom_kubeconfig(kc, &KubeConfigOptions::default()).await?
        }
        // In-cluster first (the DaemonSet case), then $KUBECONFIG / ~/.kube/config.
        None => match Config::incluster() {
            Ok(c) => c,
            Err(_) => Config::infer().await?,
        },
    };
    Ok(Client::try_from(config)?)
}

fn resource(kind: Kind) -> ApiResource {
    let gvk = match kind {
        Kind::Service => GroupVersionKind::gvk("", "v1", "Service"),
        Kind::EndpointSlice => GroupVersionKind::gvk("discovery.k8s.io", "v1", "EndpointSlice"),
        Kind::Node => GroupVersionKind::gvk("", "v1", "Node"),
    };
    ApiResource::from_gvk(&gvk)
}

/// Objects per list page: client-go's and kube-rs's default (`limit=500` + `continue`), so
/// the apiserver never builds one response of the whole cluster and a relist at 100,000
/// Services arrives in 200 pages.
pub const LIST_PAGE_SIZE: u32 = 500;

/// The watchers' configuration: paged list-then-watch from the most recent version
/// (`resourceVersion` unset, a consistent read), with watch bookmarks, so a reconnect
/// resumes from the last bookmark instead of relisting. A `410 Expired` on a continue
/// token (the list's snapshot compacted mid-list) or on a watch makes kube-rs relist from
/// the start, which `watch` passes on as one snapshot.
///
/// Not streaming lists (`sendInitialEvents=true`, KEP-3157): kube-rs 5 has no fallback
/// when the server does not serve them (the WatchList feature gate off, or an apiserver
/// before 1.27: the watch is refused with a 4xx, or served without the
/// `k8s.io/initial-events-end` bookmark, and the watcher retries or waits forever), and it
/// cannot tell in advance; kube-proxy's informers list-then-watch as well.
fn watcher_config() -> watcher::Config {
    watcher::Config::default().page_size(LIST_PAGE_SIZE)
}

/// Starts the three watches; each sends its updates to `tx` until the receiver goes.
pub fn spawn(
    client: Client,
    proxy_name: Option<&str>,
    node_name: &str,
    tx: mpsc::Sender<Update>,
    metrics: SourceCounters,
) {
    let selector = label_selector(proxy_name);
    for (kind, config) in [
        (Kind::Service, watcher_config().labels(&selector)),
        (Kind::EndpointSlice, watcher_config().labels(&selector)),
        (
            Kind::Node,
            watcher_config().fields(&format!("metadata.name={node_name}")),
        ),
    ] {
        tokio::spawn(watch(
            client.clone(),
            kind,
            config,
            tx.clone(),
            metrics.clone(),
        ));
    }
}

async fn watch(
    client: Client,
    kind: Kind,
    config: watcher::Config,
    tx: mpsc::Sender<Update>,
    metrics: SourceCounters,
) {
    let ar = resource(kind);
    let api: Api<DynamicObject> = Api::all_with(client, &ar);
    let mut stream = watcher(api, config).default_backoff().boxed();
    let mut buffer: Vec<Object> = Vec::new();
    let mut listed = false;
    while let Some(event) = stream.next().await {
        let update = match event {
            Ok(watcher::Event::Init) => {
                buffer.clear();
                None
            }
            Ok(watcher::Event::InitApply(o)) => {
                buffer.extend(convert(kind, o, &metrics));
                None
            }
            Ok(watcher::Event::InitDone) => {
                if listed {
                    metrics.watch_restarted(kind.as_str());
                }
                info!(
                    kind = kind.as_str(),
                    objects = buffer.len(),
                    relist = listed,
                    "list complete"
                );
                let u = Update::Snapshot {
                    kind,
                    objects: std::mem::take(&mut buffer),
                    relist: listed,
                };
                listed = true;
                Some(u)
            }
            Ok(watcher::Event::Apply(o)) => convert(kind, o, &metrics).map(Update::Apply),
            Ok(watcher::Event::Delete(o)) => Some(Update::Delete {
                kind,
                key: ObjKey::new(
                    o.metadata.namespace.unwrap_or_default(),
                    o.metadata.name.unwrap_or_default(),
                ),
            }),
            Err(e) => {
                warn!(
                    kind = kind.as_str(),
                    "watch error (retrying with backoff): {e}"
                );
                metrics.watch_failed(kind.as_str());
                None
            }
        };
        if let Some(u) = update {
            if tx.send(u).await.is_err() {
                return;
            }
        }
    }
}

/// Decodes one untyped object; a malformed one is logged, counted and dropped.
///
/// Straight from the watcher's object (no re-serialization): the metadata kube-rs decoded
/// is cut down to what the agent reads (name, namespace, labels, creation and deletion
/// times: no annotations, managed fields or owner references are kept while a list is
/// gathered), and only the fields the proxy reads are decoded from the rest.
fn convert(kind: Kind, o: DynamicObject, metrics: &SourceCounters) -> Option<Object> {
    let DynamicObject { metadata, data, .. } = o;
    let key = ObjKey::new(
        metadata.namespace.as_deref().unwrap_or_default(),
        metadata.name.as_deref().unwrap_or_default(),
    );
    match decode_fields(kind, slim(metadata), &data) {
        Ok(obj) => Some(obj),
        Err(e) => {
            warn!(object = %key, reason = "decode_error", "skipping {} {key}: {e}", kind.as_str());
            metrics.skipped(kind.as_str(), "decode_error");
            None
        }
    }
}

/// The metadata fields the agent reads (`cluster::objects`).
fn slim(m: ObjectMeta) -> ObjectMeta {
    ObjectMeta {
        name: m.name,
        namespace: m.namespace,
        labels: m.labels,
        creation_timestamp: m.creation_timestamp,
        deletion_timestamp: m.deletion_timestamp,
        ..ObjectMeta::default()
    }
}

/// `data[name]`, decoded (absent or null: `None`).
fn field<T: DeserializeOwned>(data: &Value, name: &str) -> Result<Option<T>, serde_json::Error> {
    match data.get(name) {
        None | Some(Value::Null) => Ok(None),
        Some(v) => T::deserialize(v).map(Some),
    }
}

/// An object of `kind` from its metadata and the rest of its fields.
pub fn decode_fields(
    kind: Kind,
    metadata: ObjectMeta,
    data: &Value,
) -> Result<Object, serde_json::Error> {
    Ok(match kind {
        Kind::Service => Object::Service(Box::new(Service {
            metadata,
            spec: field(data, "spec")?,
            status: field(data, "status")?,
        })),
        Kind::EndpointSlice => Object::Slice(Box::new(EndpointSlice {
            metadata,
            address_type: field(data, "addressType")?
                .ok_or_else(|| serde::de::Error::missing_field("addressType"))?,
            endpoints: field(data, "endpoints")?.unwrap_or_default(),
            ports: field(data, "ports")?,
        })),
        Kind::Node => Object::Node(Box::new(Node {
            metadata,
            spec: field(data, "spec")?,
            status: field(data, "status")?,
        })),
    })
}
