//! The server's state: the objects by kind and key with their resourceVersions (one
//! global counter, like etcd revisions), the history of writes that watches replay and
//! list snapshots are rebuilt from, the open watches' sinks, a write ([`apply_locked`]);
//! and [`Shared`], the store with the request log and the instruments, as every
//! connection sees it.

use std::{
    collections::BTreeMap,
    sync::{
        atomic::{AtomicU64, AtomicUsize, Ordering},
        Arc, Mutex, MutexGuard, PoisonError,
    },
    time::{SystemTime, UNIX_EPOCH},
};

use serde_json::Value;
use tokio::sync::{mpsc, oneshot, watch};

/// [`FakeApiServer::apply`] with the store locked.
// Long: one object's admission as kube-apiserver does it (defaulting, uid, generation,
// resourceVersion, history, watchers); the steps share the store lock.
pub(super) fn apply_locked(store: &mut Store, mut obj: Value) {
    assert!(
        obj.is_object(),
        "FakeApiServer::apply wants a JSON object, got {obj}"
    );
    let kind_name = obj
        .get("kind")
        .and_then(Value::as_str)
        .unwrap_or_default()
        .to_owned();
    let kind = Kind::parse(&kind_name).unwrap_or_else(|| {
        panic!(
            "FakeApiServer::apply: unsupported kind {kind_name:?} (Service, EndpointSlice, Node, ServiceCIDR, Pod, Namespace)"
        )
    });
    if let Some(api_version) = obj.get("apiVersion").and_then(Value::as_str) {
        assert_eq!(
            api_version,
            kind.api_version(),
            "FakeApiServer::apply: wrong apiVersion for {kind_name}"
        );
    }
    obj["apiVersion"] = kind.api_version().into();
    if !obj.get("metadata").is_some_and(Value::is_object) {
        panic!("FakeApiServer::apply: the {kind_name} has no metadata object");
    }
    let meta = &mut obj["metadata"];
    let name = meta
        .get("name")
        .and_then(Value::as_str)
        .filter(|name| !name.is_empty())
        .unwrap_or_else(|| panic!("FakeApiServer::apply: the {kind_name} has no metadata.name"))
        .to_owned();
    let namespace = if kind.namespaced() {
        let namespace = meta
            .get("namespace")
            .and_then(Value::as_str)
            .filter(|ns| !ns.is_empty())
            .unwrap_or("default")
            .to_owned();
        meta["namespace"] = namespace.clone().into();
        namespace
    } else {
        if let Some(meta) = meta.as_object_mut() {
            meta.remove("namespace");
        }
        String::new()
    };

    store.rv += 1;
    let rv = store.rv;
    let key = (kind, namespace, name);
    let before = store.objects.get(&key).cloned();
    let meta = &mut obj["metadata"];
    let kept = |field: &str| {
        before
            .as_ref()
            .and_then(|b| b["metadata"].get(field))
            .filter(|v| v.is_string())
            .cloned()
    };
    if !meta.get("uid").is_some_and(Value::is_string) {
        let uid = match kept("uid") {
            Some(uid) => uid,
            None => {
                store.uids += 1;
                format!("00000000-0000-4000-8000-{:012x}", store.uids).into()
            }
        };
        meta["uid"] = uid;
    }
    if !meta.get("creationTimestamp").is_some_and(Value::is_string) {
        meta["creationTimestamp"] =
            kept("creationTimestamp").unwrap_or_else(|| now_rfc3339().into());
    }
    // The EndpointSlice controller stamps each slice it writes with the time of the
    // Service or Pod change it carries (RFC 3339, nanoseconds): kube-proxy's network
    // programming latency starts there. A slice applied here is that change, now, unless
    // the test set the annotation itself.
    if kind == Kind::EndpointSlice {
        const TRIGGER: &str = "endpoints.kubernetes.io/last-change-trigger-time";
        if !meta.get("annotations").is_some_and(Value::is_object) {
            meta["annotations"] = serde_json::json!({});
        }
        if !meta["annotations"]
            .get(TRIGGER)
            .is_some_and(Value::is_string)
        {
            meta["annotations"][TRIGGER] = rfc3339_nano(SystemTime::now()).into();
        }
    }
    meta["resourceVersion"] = rv.to_string().into();
    // Encoded once here, so list pages are copies of these bytes (the bench measures the
    // agent, not this server's JSON encoding).
    store
        .encoded
        .insert(key.clone(), Arc::from(obj.to_string()));
    store.objects.insert(key, obj.clone());
    store.record(Change {
        rv,
        kind,
        before,
        after: Some(obj),
    });
}

/// Deletes the object at `key`; watchers get DELETED with its last state carrying the
/// new resourceVersion. Returns that last state (`None`: there was none).
pub(super) fn delete_locked(store: &mut Store, key: &(Kind, String, String)) -> Option<Value> {
    let last = store.objects.remove(key)?;
    store.encoded.remove(key);
    store.rv += 1;
    let rv = store.rv;
    store.record(Change {
        rv,
        kind: key.0,
        before: Some(last.clone()),
        after: None,
    });
    Some(last)
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub(super) enum Kind {
    Service,
    EndpointSlice,
    Node,
    ServiceCidr,
    Pod,
    Namespace,
}

impl Kind {
    pub(super) fn parse(kind: &str) -> Option<Self> {
        match kind {
            "Service" => Some(Self::Service),
            "EndpointSlice" => Some(Self::EndpointSlice),
            "Node" => Some(Self::Node),
            "ServiceCIDR" => Some(Self::ServiceCidr),
            "Pod" => Some(Self::Pod),
            "Namespace" => Some(Self::Namespace),
            _ => None,
        }
    }

    pub(super) fn name(self) -> &'static str {
        match self {
            Self::Service => "Service",
            Self::EndpointSlice => "EndpointSlice",
            Self::Node => "Node",
            Self::ServiceCidr => "ServiceCIDR",
            Self::Pod => "Pod",
            Self::Namespace => "Namespace",
        }
    }

    /// The resource (plural) name used in paths and error messages.
    pub(super) fn resource(self) -> &'static str {
        match self {
            Self::Service => "services",
            Self::EndpointSlice => "endpointslices",
            Self::Node => "nodes",
            Self::ServiceCidr => "servicecidrs",
            Self::Pod => "pods",
            Self::Namespace => "namespaces",
        }
    }

    pub(super) fn api_version(self) -> &'static str {
        match self {
            Self::Service | Self::Node | Self::Pod | Self::Namespace => "v1",
            Self::EndpointSlice => "discovery.k8s.io/v1",
            Self::ServiceCidr => "networking.k8s.io/v1",
        }
    }

    pub(super) fn namespaced(self) -> bool {
        !matches!(self, Self::Node | Self::ServiceCidr | Self::Namespace)
    }
}

/// One write, as kept in the history and sent to watchers.
pub(super) struct Change {
    pub(super) rv: u64,
    pub(super) kind: Kind,
    /// State before the write (for a delete: the last state; its DELETED event carries
    /// the delete's resourceVersion, see `event_for`).
    pub(super) before: Option<Value>,
    /// State after the write (`None` for a delete).
    pub(super) after: Option<Value>,
}

/// An open watch: dropping this closes the watch connection abruptly.
pub(super) struct WatchSink {
    pub(super) events: mpsc::UnboundedSender<Arc<Change>>,
    pub(super) _kill: oneshot::Sender<()>,
}

#[derive(Default)]
pub(super) struct Store {
    /// The global resourceVersion: that of the last write.
    pub(super) rv: u64,
    pub(super) objects: BTreeMap<(Kind, String, String), Value>,
    /// Each object of `objects` as JSON text.
    pub(super) encoded: BTreeMap<(Kind, String, String), Arc<str>>,
    /// Every write with resourceVersion > `oldest_rv`.
    pub(super) history: Vec<Arc<Change>>,
    /// Watches from a resourceVersion below this get 410 Gone.
    pub(super) oldest_rv: u64,
    pub(super) watchers: Vec<WatchSink>,
    uids: u64,
}

impl Store {
    pub(super) fn record(&mut self, change: Change) {
        let change = Arc::new(change);
        self.history.push(Arc::clone(&change));
        self.watchers
            .retain(|w| w.events.send(Arc::clone(&change)).is_ok());
    }

    pub(super) fn expire(&mut self) {
        self.rv += 1;
        self.history.clear();
        self.oldest_rv = self.rv;
    }
}

pub(super) struct Shared {
    pub(super) store: Mutex<Store>,
    /// Armed by [`super::FakeApiServer::fail_requests`]: (code, how many more, Retry-After).
    pub(super) fail: Mutex<Option<(u16, usize, Option<u64>)>>,
    /// How many requests were answered with each injected failure code.
    pub(super) failed: Mutex<BTreeMap<u16, usize>>,
    /// Authentication and RBAC (off for plain HTTP).
    pub(super) auth: Mutex<super::auth::Auth>,
    pub(super) requests: Mutex<Vec<String>>,
    /// Bumped by `stop()`: the accept loop and every connection end.
    pub(super) generation: watch::Sender<u64>,
    /// Open connections (including those whose task has not started yet).
    pub(super) connections: AtomicUsize,
    /// See [`FakeApiServer::compact_after_pages`].
    pub(super) compact_after_pages: AtomicUsize,
    /// See [`FakeApiServer::watch_bytes`].
    pub(super) watch_bytes: AtomicU64,
    /// See [`FakeApiServer::list_times`].
    pub(super) list_times: Mutex<Vec<(Kind, std::time::Instant)>>,
    /// See [`FakeApiServer::list_end_times`].
    pub(super) list_ends: Mutex<Vec<(Kind, std::time::Instant)>>,
    /// See [`FakeApiServer::go_silent`].
    pub(super) silent: std::sync::atomic::AtomicBool,
}

/// Counts an open connection in [`Shared::connections`] for as long as it lives.
pub(super) struct ConnectionGuard(Arc<Shared>);

impl ConnectionGuard {
    pub(super) fn new(shared: &Arc<Shared>) -> Self {
        shared.connections.fetch_add(1, Ordering::SeqCst);
        Self(Arc::clone(shared))
    }
}

impl Drop for ConnectionGuard {
    fn drop(&mut self) {
        self.0.connections.fetch_sub(1, Ordering::SeqCst);
    }
}

/// Locks, ignoring poisoning: a panicking test thread must not wedge the server.
pub(super) fn lock<T>(mutex: &Mutex<T>) -> MutexGuard<'_, T> {
    mutex.lock().unwrap_or_else(PoisonError::into_inner)
}

/// The current time as RFC 3339 in UTC, second precision (`2025-01-31T12:00:00Z`).
fn now_rfc3339() -> String {
    let secs = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or_default();
    rfc3339_secs(secs)
}

/// `t` as RFC 3339 in UTC with nanoseconds (`2025-01-31T12:00:00.123456789Z`), as Go's
/// `time.RFC3339Nano` writes it (trailing zeros of the fraction dropped).
/// RFC 3339 (UTC, nanoseconds) of `t`, as the EndpointSlice controller writes
/// `endpoints.kubernetes.io/last-change-trigger-time`.
pub fn rfc3339_nano(t: SystemTime) -> String {
    let d = t.duration_since(UNIX_EPOCH).unwrap_or_default();
    let whole = rfc3339_secs(d.as_secs());
    let frac = format!("{:09}", d.subsec_nanos());
    let frac = frac.trim_end_matches('0');
    if frac.is_empty() {
        whole
    } else {
        format!("{}.{frac}Z", whole.trim_end_matches('Z'))
    }
}

/// Seconds since 1970 as RFC 3339 in UTC, second precision.
fn rfc3339_secs(secs: u64) -> String {
    // Days to civil date (Howard Hinnant's algorithm), for days since 1970-01-01 >= 0.
    let days = secs / 86_400;
    let z = days + 719_468;
    let era = z / 146_097;
    let doe = z - era * 146_097;
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let day = doy - (153 * mp + 2) / 5 + 1;
    let month = if mp < 10 { mp + 3 } else { mp - 9 };
    let year = yoe + era * 400 + u64::from(month <= 2);
    let rem = secs % 86_400;
    format!(
        "{year:04}-{month:02}-{day:02}T{:02}:{:02}:{:02}Z",
        rem / 3600,
        rem % 3600 / 60,
        rem % 60
    )
}
