//! The Kubernetes API source: list+watch of Services and EndpointSlices (with
//! kube-proxy's label selector) and of this node's Node object, read by [`Reader`] (our
//! own, over kube's `Client`): paged lists decoded straight from their bytes into the
//! fields the proxy reads, then watches with bookmarks. Every (re)list is passed on as
//! one snapshot, so a relist after a `410 Expired` is a full re-diff in which objects
//! deleted meanwhile disappear. A malformed object is logged with its namespace/name,
//! counted and skipped without stopping the list or the watch.
//!
//! `ServiceCIDR` objects (`networking.k8s.io/v1`, GA in 1.33) are read the same way, for
//! `SVC_CIDR4/6`. A server that does not serve them (older than 1.33 or the API off:
//! 404) or forbids them (the role lacks the rule: 403) does not hold the datapath
//! back: the reader passes on an empty list at once, says why, and keeps trying with
//! backoff (kube-proxy's informer retries as well).

use std::time::Duration;

use futures::AsyncBufReadExt as _;
use kube::Client;
use tokio::sync::mpsc;
use tracing::{info, warn};

pub use super::kube_client::{client, client_from, config, host};
use super::{
    api_decode,
    counters::SourceCounters,
    skips::{SkipKind, SkipReason},
};
use super::{objects::label_selector, Kind, Object, Update};

/// The collection's path on the API server.
fn path(kind: Kind) -> &'static str {
    match kind {
        Kind::Service => "/api/v1/services",
        Kind::EndpointSlice => "/apis/discovery.k8s.io/v1/endpointslices",
        Kind::Node => "/api/v1/nodes",
        Kind::ServiceCidr => "/apis/networking.k8s.io/v1/servicecidrs",
        Kind::Pod => "/api/v1/pods",
        Kind::Namespace => "/api/v1/namespaces",
    }
}

/// Objects per list page: client-go's and kube-rs's default (`limit=500` + `continue`), so
/// the apiserver never builds one response of the whole cluster and a relist at 100,000
/// Services arrives in 200 pages.
pub const LIST_PAGE_SIZE: u32 = 500;

/// The server-side watch timeout asked for (kube-rs's and client-go's default range).
const WATCH_TIMEOUT_SECS: u64 = 290;
/// Backoff between failed attempts (kube-rs's default: 0.8 s doubling to 30 s).
const BACKOFF_MIN: Duration = Duration::from_millis(800);
const BACKOFF_MAX: Duration = Duration::from_secs(30);

/// How the three readers read.
#[derive(Clone, Copy, Debug)]
pub struct WatchOptions {
    /// Watch every Node, not only this node's.
    pub all_nodes: bool,
    /// `--api-idle-timeout` (see [`Reader::idle_timeout`]).
    pub idle_timeout: Duration,
}

/// The kinds [`spawn`] reads; the syncer waits for a list of each before its first sync.
pub const KINDS: [Kind; 4] = [
    Kind::Service,
    Kind::EndpointSlice,
    Kind::Node,
    Kind::ServiceCidr,
];

/// Starts the four watches; each sends its updates to `tx` until the receiver goes.
pub fn spawn(
    client: Client,
    host: &str,
    proxy_name: Option<&str>,
    node_name: &str,
    tx: mpsc::Sender<Update>,
    metrics: SourceCounters,
    options: WatchOptions,
) {
    let WatchOptions {
        all_nodes,
        idle_timeout,
    } = options;
    let selector = label_selector(proxy_name);
    // DSR modes need every node's addresses (the senders whose DSR option is honoured);
    // otherwise only this node's Node is read.
    let nodes = if all_nodes {
        String::new()
    } else {
        format!("metadata.name={node_name}")
    };
    for (kind, selector) in [
        (Kind::Service, Selector::Labels(selector.clone())),
        (Kind::EndpointSlice, Selector::Labels(selector)),
        (Kind::Node, Selector::Fields(nodes)),
        (Kind::ServiceCidr, Selector::Fields(String::new())),
    ] {
        let reader = Reader {
            client: client.clone(),
            host: host.to_string(),
            kind,
            selector,
            tx: tx.clone(),
            metrics: metrics.clone(),
            proxy_name: proxy_name.map(str::to_string),
            idle_timeout,
        };
        tokio::spawn(reader.run());
    }
}

/// Starts the socket-LB bypass's two watches (`crate::podbypass`): this node's Pods
/// (`fieldSelector=spec.nodeName=<node>`, what kubelet itself watches) and Namespaces;
/// their updates go to `tx`.
pub fn spawn_pods(
    client: Client,
    host: &str,
    node_name: &str,
    tx: mpsc::Sender<Update>,
    metrics: SourceCounters,
    idle_timeout: Duration,
) {
    for (kind, selector) in [
        (Kind::Pod, format!("spec.nodeName={node_name}")),
        (Kind::Namespace, String::new()),
    ] {
        let reader = Reader {
            client: client.clone(),
            host: host.to_string(),
            kind,
            selector: Selector::Fields(selector),
            tx: tx.clone(),
            metrics: metrics.clone(),
            proxy_name: None,
            idle_timeout,
        };
        tokio::spawn(reader.run());
    }
}

/// A list's or watch's selector.
#[derive(Clone, Debug)]
pub enum Selector {
    Labels(String),
    Fields(String),
}

/// One kind's list+watch, kube-proxy's informer protocol over plain HTTP (kube's
/// `Client` for auth, TLS and the kubeconfig):
/// - a paged list (`limit=500` + `continue`, `resourceVersion` unset: a consistent read),
///   each page decoded straight from its bytes (`api_decode`), every Service and slice
///   reduced to its compact form as its page is decoded (the page's text is dropped
///   before the next is fetched), passed on as one [`Update::Snapshot`];
/// - then a watch from the list's resourceVersion with bookmarks; every event and
///   bookmark advances the resourceVersion, and a watch that ends (its timeout, a cut
///   connection) is re-established from there;
/// - a `410 Expired` (a stale continue token mid-list, or a watch from a compacted
///   version) starts a fresh list, passed on as one snapshot (`relist: true`), in which
///   objects deleted meanwhile are missing;
/// - other errors retry with backoff (0.8 s doubling to 30 s, reset by any success);
/// - an object that does not decode is logged naming it, counted
///   (`objects_skipped_total{reason="decode_error"}`) and skipped; the list or watch goes on.
///
/// Not streaming lists (`sendInitialEvents=true`, KEP-3157): a server without them (the
/// WatchList feature gate off, or older than 1.27) refuses the watch or serves it without
/// the `k8s.io/initial-events-end` bookmark, and there is no way to tell in advance;
/// kube-proxy's informers list-then-watch as well.
pub struct Reader {
    pub client: Client,
    /// The API server's `host[:port]` (`rest_client_requests_total`'s `host`).
    pub host: String,
    pub kind: Kind,
    pub selector: Selector,
    pub tx: mpsc::Sender<Update>,
    pub metrics: SourceCounters,
    /// `--proxy-name`: Services and slices are reduced as they are decoded
    /// (`api_decode::object`), which applies the agent's label selection.
    pub proxy_name: Option<String>,
    /// `--api-idle-timeout`: a watch that delivers nothing (no event, no bookmark) for
    /// this long is dead (the server or the path to it hangs) and is started again from
    /// its resourceVersion. Bookmarks are asked for (`allowWatchBookmarks`), and
    /// kube-apiserver sends one to a quiet watch about every minute, so a healthy quiet
    /// watch is not cut at the default 90 s. Lists get the same limit through the
    /// client's read timeout.
    pub idle_timeout: Duration,
}

/// How a list or watch attempt ended.
enum Failure {
    /// `410 Expired`/`Gone` (its message): list again from scratch.
    Expired(String),
    /// `404` (the server does not serve the resource) or `403` (not allowed to read
    /// it): retried as [`Failure::Other`]; for an optional kind an empty list stands in
    /// meanwhile.
    Unavailable(String),
    /// Anything else: retry (the same step) after a backoff.
    Other(String),
    /// The receiver is gone: stop.
    Closed,
}

impl Reader {
    pub async fn run(self) {
        let kind = self.kind.as_str();
        let mut backoff = BACKOFF_MIN;
        let mut listed = false;
        // The resourceVersion to watch from; `None`: list first.
        let mut rv: Option<String> = None;
        let mut expired_in_a_row = 0u32;
        // An optional kind the server does not serve has been passed on as empty.
        let mut stood_in = false;
        loop {
            let result = match rv.as_mut() {
                None => match self.list().await {
                    Ok((objects, list_rv)) => {
                        if listed {
                            self.metrics.watch_restarted(kind);
                        }
                        info!(
                            kind,
                            objects = objects.len(),
                            relist = listed,
                            "list complete"
                        );
                        let u = Update::Snapshot {
                            kind: self.kind,
                            objects,
                            relist: listed,
                        };
                        if self.tx.send(u).await.is_err() {
                            return;
                        }
                        listed = true;
                        rv = Some(list_rv);
                        Ok(())
                    }
                    Err(e) => Err(e),
                },
                Some(v) => self.watch(v, &mut backoff).await,
            };
            match result {
                Ok(()) => {
                    backoff = BACKOFF_MIN;
                    expired_in_a_row = 0;
                }
                Err(Failure::Closed) => return,
                Err(Failure::Expired(message)) => {
                    warn!(kind, "410 Expired, listing again: {message}");
                    self.metrics.watch_failed(kind);
                    rv = None;
                    expired_in_a_row += 1;
                    // Straight away the first time; a server that keeps answering 410
                    // gets the backoff.
                    if expired_in_a_row > 1 {
                        tokio::time::sleep(jitter(backoff)).await;
                        backoff = (backoff * 2).min(BACKOFF_MAX);
                    }
                }
                Err(Failure::Unavailable(e)) if self.kind == Kind::ServiceCidr && !listed => {
                    self.metrics.watch_failed(kind);
                    if !stood_in {
                        if !self.stand_in(&e).await {
                            return;
                        }
                        stood_in = true;
                    }
                    tokio::time::sleep(jitter(backoff)).await;
                    backoff = (backoff * 2).min(BACKOFF_MAX);
                }
                Err(Failure::Other(e) | Failure::Unavailable(e)) => {
                    warn!(kind, "watch error (retrying with backoff): {e}");
                    self.metrics.watch_failed(kind);
                    tokio::time::sleep(jitter(backoff)).await;
                    backoff = (backoff * 2).min(BACKOFF_MAX);
                }
            }
        }
    }

    /// A `ServiceCIDR` list the server does not serve or allow (`e`): said once, and an
    /// empty list passed on in its place so the first sync does not wait for it. `false`:
    /// the receiver is gone.
    async fn stand_in(&self, e: &str) -> bool {
        warn!(
            kind = self.kind.as_str(),
            "cannot list ServiceCIDRs ({e}): going on with --service-cluster-ip-range \
             alone; retrying with backoff"
        );
        let u = Update::Snapshot {
            kind: self.kind,
            objects: Vec::new(),
            relist: false,
        };
        self.tx.send(u).await.is_ok()
    }

    fn query(&self, extra: &[(&str, &str)]) -> String {
        let mut q = form_urlencoded::Serializer::new(String::new());
        match &self.selector {
            Selector::Labels(s) if !s.is_empty() => {
                q.append_pair("labelSelector", s);
            }
            Selector::Fields(s) if !s.is_empty() => {
                q.append_pair("fieldSelector", s);
            }
            _ => {}
        }
        for (k, v) in extra {
            q.append_pair(k, v);
        }
        format!("{}?{}", path(self.kind), q.finish())
    }

    /// Every object, page by page; and the list's resourceVersion.
    async fn list(&self) -> Result<(Vec<Object>, String), Failure> {
        let limit = LIST_PAGE_SIZE.to_string();
        let mut objects = Vec::new();
        let mut token: Option<String> = None;
        let mut list_rv = None;
        loop {
            let mut params = vec![("limit", limit.as_str())];
            if let Some(t) = &token {
                params.push(("continue", t.as_str()));
            }
            let text = self.get(&self.query(&params)).await?;
            let page = api_decode::page(&text)
                .map_err(|e| Failure::Other(format!("{} list page: {e}", self.kind.as_str())))?;
            for item in page.items.iter().flatten() {
                objects.extend(self.decode(item.get()));
            }
            if list_rv.is_none() {
                list_rv = page.metadata.resource_version.map(|v| v.into_owned());
            }
            match page.metadata.continue_token {
                Some(t) if !t.is_empty() => token = Some(t.into_owned()),
                _ => break,
            }
        }
        let rv = list_rv.ok_or_else(|| {
            Failure::Other(format!(
                "{} list without a resourceVersion",
                self.kind.as_str()
            ))
        })?;
        Ok((objects, rv))
    }

    async fn get(&self, uri: &str) -> Result<String, Failure> {
        let req = http::Request::get(uri)
            .body(Vec::new())
            .map_err(|e| Failure::Other(e.to_string()))?;
        let r = self.client.request_text(req).await;
        self.count(&r);
        r.map_err(failure)
    }

    /// `rest_client_requests_total` for one GET (lists and watches are GETs).
    fn count<T>(&self, r: &Result<T, kube::Error>) {
        let code = match r {
            Ok(_) => Some(200),
            Err(kube::Error::Api(s)) => Some(s.code),
            Err(_) => None,
        };
        self.metrics.rest_request("GET", &self.host, code);
    }

    /// One watch from `rv` until it ends; `rv` follows every event and bookmark. `Ok`: it
    /// ended cleanly (its timeout) or was cut after delivering events: watch again.
    async fn watch(&self, rv: &mut String, backoff: &mut Duration) -> Result<(), Failure> {
        let timeout = WATCH_TIMEOUT_SECS.to_string();
        let uri = self.query(&[
            ("watch", "true"),
            ("resourceVersion", rv.as_str()),
            ("allowWatchBookmarks", "true"),
            ("timeoutSeconds", timeout.as_str()),
        ]);
        let req = http::Request::get(uri)
            .body(Vec::new())
            .map_err(|e| Failure::Other(e.to_string()))?;
        let body = self.client.request_stream(req).await;
        self.count(&body);
        let mut body = body.map_err(failure)?;
        let idle = self.idle_timeout;
        let mut line = Vec::new();
        let mut got_events = false;
        loop {
            line.clear();
            let read = tokio::time::timeout(idle, body.read_until(b'\n', &mut line)).await;
            match read {
                Err(_) => {
                    return Err(Failure::Other(format!(
                        "watch silent for {:?} (--api-idle-timeout: no event, no bookmark)",
                        idle
                    )))
                }
                Ok(Ok(0)) => return Ok(()),
                Ok(Ok(_)) => {}
                Ok(Err(e)) if got_events => {
                    // Cut mid-stream after delivering: resume from the last version.
                    warn!(kind = self.kind.as_str(), "watch cut ({e}): resuming");
                    return Ok(());
                }
                Ok(Err(e)) => return Err(Failure::Other(format!("watch stream: {e}"))),
            }
            let text = match std::str::from_utf8(&line) {
                Ok(t) => t.trim(),
                Err(e) => return Err(Failure::Other(format!("watch event not UTF-8: {e}"))),
            };
            if text.is_empty() {
                continue;
            }
            let update = self.event_update(text, rv)?;
            if !got_events {
                got_events = true;
                *backoff = BACKOFF_MIN;
            }
            if let Some(u) = update {
                if self.tx.send(u).await.is_err() {
                    return Err(Failure::Closed);
                }
            }
        }
    }

    /// One watch event's line: the update it makes (`None`: a bookmark, a deletion that
    /// does not decode, an unknown type), `rv` advanced past it; an `ERROR` event ends
    /// the watch.
    fn event_update(&self, text: &str, rv: &mut String) -> Result<Option<Update>, Failure> {
        let event =
            api_decode::event(text).map_err(|e| Failure::Other(format!("watch event: {e}")))?;
        let object = event.object.get();
        let update = match event.kind.as_ref() {
            "ERROR" => {
                let s = api_decode::status(object).unwrap_or_default();
                if s.code == 410 || s.reason == "Expired" || s.reason == "Gone" {
                    return Err(Failure::Expired(s.message));
                }
                return Err(Failure::Other(format!(
                    "watch ERROR {} {}: {}",
                    s.code, s.reason, s.message
                )));
            }
            "BOOKMARK" => {
                if let Some(v) = api_decode::meta(object)
                    .ok()
                    .and_then(|m| m.resource_version)
                {
                    *rv = v.into_owned();
                }
                None
            }
            "ADDED" | "MODIFIED" => {
                if let Some(v) = api_decode::meta(object)
                    .ok()
                    .and_then(|m| m.resource_version)
                {
                    *rv = v.into_owned();
                }
                self.decode(object).map(Update::Apply)
            }
            "DELETED" => match api_decode::meta(object) {
                Ok(m) => {
                    if let Some(v) = &m.resource_version {
                        *rv = v.to_string();
                    }
                    Some(Update::Delete {
                        kind: self.kind,
                        key: m.key(),
                    })
                }
                Err(e) => {
                    warn!(
                        kind = self.kind.as_str(),
                        reason = "decode_error",
                        "skipping a deletion: {e}"
                    );
                    self.metrics
                        .skipped(SkipKind::Object(self.kind), SkipReason::DecodeError);
                    None
                }
            },
            other => {
                warn!(
                    kind = self.kind.as_str(),
                    "unknown watch event type {other:?}: ignored"
                );
                None
            }
        };
        Ok(update)
    }

    /// One object; a malformed one is logged naming it, counted and dropped.
    fn decode(&self, json: &str) -> Option<Object> {
        match api_decode::object(self.kind, json, self.proxy_name.as_deref()) {
            Ok(o) => Some(o),
            Err(e) => {
                let key = api_decode::meta(json)
                    .map(|m| m.key().to_string())
                    .unwrap_or_else(|_| "(no readable metadata)".into());
                let kind = self.kind.as_str();
                warn!(object = %key, reason = "decode_error", "skipping {kind} {key}: {e}");
                self.metrics
                    .skipped(SkipKind::Object(self.kind), SkipReason::DecodeError);
                None
            }
        }
    }
}

/// `410 Expired`/`Gone` or another error.
fn failure(e: kube::Error) -> Failure {
    match e {
        kube::Error::Api(s) if s.code == 410 || s.reason == "Expired" || s.reason == "Gone" => {
            Failure::Expired(s.message)
        }
        kube::Error::Api(s) if s.code == 404 || s.code == 403 => {
            Failure::Unavailable(format!("{} {}: {}", s.code, s.reason, s.message))
        }
        e => Failure::Other(with_sources(&e)),
    }
}

/// The error and its sources: kube's `client error (Connect)` alone does not say that the
/// server's certificate is not signed by the configured CA (`invalid peer certificate:
/// UnknownIssuer`), or that the connection was refused.
fn with_sources(e: &dyn std::error::Error) -> String {
    let mut text = e.to_string();
    let mut source = e.source();
    while let Some(s) = source {
        let s_text = s.to_string();
        if !text.contains(&s_text) {
            text.push_str(": ");
            text.push_str(&s_text);
        }
        source = s.source();
    }
    text
}

/// `d` plus up to a quarter of it, so agents that lost the server together do not all
/// come back in the same instant.
fn jitter(d: Duration) -> Duration {
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|t| t.subsec_nanos())
        .unwrap_or(0);
    d + d / 4 * (nanos % 1000) / 1000
}
