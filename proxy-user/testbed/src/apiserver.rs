//! A fake kube-apiserver for tests only: it serves Services, EndpointSlices and Nodes over
//! plain HTTP/1.1 on 127.0.0.1 with the real list/watch protocol, so that kube-rs clients
//! (`Api::list`, `Api::watch`, `kube::runtime::watcher`) talk to it as to a real apiserver.
//!
//! What it implements, and how it maps onto kube-apiserver behaviour:
//! - Lists of `/api/v1/services`, `/api/v1/nodes`, `/apis/discovery.k8s.io/v1/endpointslices`
//!   (and the namespaced forms) with `labelSelector` and `fieldSelector`, paged like
//!   kube-apiserver serves them from etcd: `limit=N` returns at most N objects (in key
//!   order, namespace then name) and a `continue` token when more remain; every page of a
//!   list is served from the snapshot at the first page's resourceVersion (the list's
//!   `metadata.resourceVersion` stays that of the first page), and a token whose
//!   snapshot has been compacted away ([`FakeApiServer::expire_history`],
//!   [`FakeApiServer::compact_after_pages`]) gets `410 Expired`, so the client relists.
//!   `resourceVersion` semantics: unset = most recent (paged); `0` = any (served whole,
//!   the limit ignored, as from kube-apiserver's watch cache); `N` with
//!   `resourceVersionMatch=NotOlderThan` (or unset) = at least N (`504` when N is in the
//!   future); `N` with `Exact` = the snapshot at N (`410 Expired` when compacted); a
//!   `continue` together with a `resourceVersion` is a `400`.
//!   Single objects can be read too (`.../services/{name}`), and `/version` answers.
//! - Watches (`watch=true`) with `resourceVersion`, `allowWatchBookmarks`, `timeoutSeconds`
//!   and `sendInitialEvents` (streaming lists: it requires
//!   `resourceVersionMatch=NotOlderThan`, as kube-apiserver does, and ends the initial
//!   ADDED events with a BOOKMARK annotated `k8s.io/initial-events-end`): history after the
//!   given resourceVersion is replayed, then live
//!   events follow, one JSON event per line in a chunked response. An object that starts or
//!   stops matching the selectors is sent as ADDED or DELETED, as the apiserver's watch cache
//!   does. A resourceVersion older than the retained history gets a 410 `Expired` ERROR event.
//! - Resource versions come from one global counter, like etcd revisions.
//!
//! Fault injection: [`FakeApiServer::drop_watches`], [`FakeApiServer::expire_history`],
//! [`FakeApiServer::compact_after_pages`], [`FakeApiServer::stop`] and
//! [`FakeApiServer::restart`].
//!
//! Instruments (for the bench): [`FakeApiServer::list_times`] (when each list page's
//! first byte was written), [`FakeApiServer::watch_bytes`] (bytes written on watch
//! streams) and [`FakeApiServer::apply_many`] (bulk loading).
//!
//! The server runs on its own single-threaded tokio runtime on a background thread, so it
//! works from plain `#[test]` functions and from `#[tokio::test]` ones alike.
//!
//! Over 600 lines on purpose: one server's protocol (lists, paging and continue tokens,
//! watches, bookmarks, streaming lists, 410s), every part over the one store and its
//! history; its own tests are `tests/apiserver_selftest.rs`.

use std::{
    collections::{BTreeMap, HashMap},
    io,
    net::SocketAddr,
    ops::Bound,
    path::Path,
    sync::{
        atomic::{AtomicU64, AtomicUsize, Ordering},
        mpsc as std_mpsc, Arc, Mutex, MutexGuard, PoisonError,
    },
    thread,
    time::{Duration, SystemTime, UNIX_EPOCH},
};

use serde_json::{json, Value};
use tokio::{
    io::{AsyncBufReadExt, AsyncReadExt, AsyncWriteExt, BufReader},
    net::{
        tcp::{OwnedReadHalf, OwnedWriteHalf},
        TcpListener, TcpStream,
    },
    runtime::Handle,
    sync::{mpsc, oneshot, watch},
    time::{interval_at, sleep_until, Instant, MissedTickBehavior},
};

/// Watch length when the client sends no `timeoutSeconds` (the apiserver picks 30-60 min).
const DEFAULT_WATCH_TIMEOUT: Duration = Duration::from_secs(1800);
/// How often watches with `allowWatchBookmarks=true` get a BOOKMARK event.
const BOOKMARK_INTERVAL: Duration = Duration::from_secs(1);
/// How long `stop()` waits for the listener and the connections to go away.
const STOP_TIMEOUT: Duration = Duration::from_secs(5);

/// A fake kube-apiserver listening on `127.0.0.1` (see the module documentation).
pub struct FakeApiServer {
    addr: SocketAddr,
    shared: Arc<Shared>,
    handle: Handle,
    /// `Some` while listening: it fires once the accept loop has dropped the listener.
    listening: Mutex<Option<std_mpsc::Receiver<()>>>,
    shutdown: Option<oneshot::Sender<()>>,
    thread: Option<thread::JoinHandle<()>>,
}

impl FakeApiServer {
    /// Binds 127.0.0.1:0 and serves in the background on its own runtime thread.
    pub fn start() -> Self {
        let (handle_tx, handle_rx) = std_mpsc::channel();
        let (shutdown, shutdown_rx) = oneshot::channel::<()>();
        let thread = thread::Builder::new()
            .name("fake-apiserver".into())
            .spawn(move || {
                let runtime = tokio::runtime::Builder::new_current_thread()
                    .enable_all()
                    .build()
                    .expect("build the fake apiserver's tokio runtime");
                handle_tx
                    .send(runtime.handle().clone())
                    .expect("FakeApiServer::start waits for the runtime handle");
                // Either a message or the sender being dropped means: shut down.
                let _ = runtime.block_on(shutdown_rx);
            })
            .expect("spawn the fake apiserver thread");
        let handle = handle_rx
            .recv()
            .expect("the fake apiserver thread died before its runtime started");

        let listener = std::net::TcpListener::bind("127.0.0.1:0")
            .expect("bind the fake apiserver to 127.0.0.1:0");
        let addr = listener
            .local_addr()
            .expect("local address of the fake apiserver listener");
        let (generation, _) = watch::channel(0);
        let server = Self {
            addr,
            shared: Arc::new(Shared {
                store: Mutex::new(Store::default()),
                requests: Mutex::new(Vec::new()),
                generation,
                connections: AtomicUsize::new(0),
                compact_after_pages: AtomicUsize::new(0),
                watch_bytes: AtomicU64::new(0),
                list_times: Mutex::new(Vec::new()),
            }),
            handle,
            listening: Mutex::new(None),
            shutdown: Some(shutdown),
            thread: Some(thread),
        };
        server.listen(listener);
        server
    }

    /// `http://127.0.0.1:PORT`
    pub fn url(&self) -> String {
        format!("http://{}", self.addr)
    }

    /// Writes a kubeconfig file (no auth, plain http, current-context set, namespace
    /// `default`) pointing at [`Self::url`].
    pub fn write_kubeconfig(&self, path: &Path) {
        let kubeconfig = format!(
            "apiVersion: v1
kind: Config
clusters:
- name: fake
  cluster:
    server: {url}
users:
- name: fake
  user: {{}}
contexts:
- name: fake
  context:
    cluster: fake
    user: fake
    namespace: default
current-context: fake
preferences: {{}}
",
            url = self.url()
        );
        std::fs::write(path, kubeconfig)
            .unwrap_or_else(|e| panic!("write kubeconfig {}: {e}", path.display()));
    }

    /// Creates or updates an object given as JSON: kind `Service` (apiVersion `v1`),
    /// `EndpointSlice` (`discovery.k8s.io/v1`) or `Node` (`v1`). A missing apiVersion is
    /// filled in, a missing namespace of a namespaced kind becomes `default`.
    ///
    /// Sets `metadata.resourceVersion` from the global counter, keeps or assigns
    /// `metadata.uid` and `metadata.creationTimestamp`, and notifies watchers with ADDED or
    /// MODIFIED (or ADDED/DELETED for watches whose selector starts/stops matching).
    ///
    /// Panics on an unsupported kind or a missing `metadata.name`: that is a bug in the test.
    pub fn apply(&self, obj: Value) {
        let mut store = lock(&self.shared.store);
        apply_locked(&mut store, obj);
    }

    /// [`Self::apply`] for many objects under one lock (watchers see them in order), for
    /// loading thousands of objects quickly.
    pub fn apply_many(&self, objects: impl IntoIterator<Item = Value>) {
        let mut store = lock(&self.shared.store);
        for obj in objects {
            apply_locked(&mut store, obj);
        }
    }

    /// Deletes an object (`namespace` is `""` for Nodes); watchers get DELETED with its last
    /// state carrying the new resourceVersion. Deleting a missing object does nothing.
    pub fn delete(&self, kind: &str, namespace: &str, name: &str) {
        let kind = Kind::parse(kind).unwrap_or_else(|| {
            panic!(
                "FakeApiServer::delete: unsupported kind {kind:?} (Service, EndpointSlice, Node)"
            )
        });
        let namespace = if kind.namespaced() { namespace } else { "" };
        let mut store = lock(&self.shared.store);
        let key = (kind, namespace.to_owned(), name.to_owned());
        let Some(last) = store.objects.remove(&key) else {
            return;
        };
        store.encoded.remove(&key);
        store.rv += 1;
        let rv = store.rv;
        store.record(Change {
            rv,
            kind,
            before: Some(last),
            after: None,
        });
    }

    /// Abruptly closes every open watch connection (mid-stream, no final event, no
    /// terminating chunk). Clients reconnect from their last resourceVersion.
    pub fn drop_watches(&self) {
        // Dropping a watcher's channels makes its connection task close the socket.
        lock(&self.shared.store).watchers.clear();
    }

    /// Forgets the event history, as an etcd compaction does: a later watch from a
    /// resourceVersion older than the current one gets "410 Gone" (`Expired`).
    ///
    /// The global resourceVersion is bumped as well (as if other resources had been written
    /// and compacted away), so even a client that had seen every event must relist after its
    /// watch is interrupted. Open watches are not affected.
    pub fn expire_history(&self) {
        lock(&self.shared.store).expire();
    }

    /// Arms a compaction: after each of the next `pages` list pages that carry a
    /// `continue` token, the history is expired (see [`Self::expire_history`]), so that
    /// token is stale and the client's next page gets `410 Expired` (what a client sees
    /// when etcd compacts in the middle of its paged list).
    pub fn compact_after_pages(&self, pages: usize) {
        self.shared
            .compact_after_pages
            .store(pages, Ordering::SeqCst);
    }

    /// When the first byte of every list response (one per page) of `kind` was written,
    /// in order; with [`Self::clear_requests`] forgotten too.
    pub fn list_times(&self, kind: &str) -> Vec<std::time::Instant> {
        let Some(kind) = Kind::parse(kind) else {
            return Vec::new();
        };
        lock(&self.shared.list_times)
            .iter()
            .filter(|(k, _)| *k == kind)
            .map(|(_, t)| *t)
            .collect()
    }

    /// Bytes written on watch streams so far (events and bookmarks, chunk framing
    /// included; the response heads are not counted).
    pub fn watch_bytes(&self) -> u64 {
        self.shared.watch_bytes.load(Ordering::Relaxed)
    }

    /// Stops accepting and closes every connection (watches end abruptly); objects are kept.
    /// While stopped, connections are refused. Returns once the listener and every
    /// connection are closed.
    pub fn stop(&self) {
        if let Err(e) = self.stop_inner() {
            panic!("FakeApiServer::stop: {e}");
        }
    }

    /// Listens again on the same port. Objects are kept; the history is expired first (see
    /// [`Self::expire_history`]) so watches from old resourceVersions get 410 and relist.
    /// Does nothing but the expiry if the server is running.
    pub fn restart(&self) {
        lock(&self.shared.store).expire();
        if lock(&self.listening).is_some() {
            return;
        }
        // The port was ours a moment ago; our closed connections sit in TIME_WAIT, which
        // SO_REUSEADDR (set by std on Unix) allows. Retry briefly for anything transient.
        let deadline = std::time::Instant::now() + STOP_TIMEOUT;
        let listener = loop {
            match std::net::TcpListener::bind(self.addr) {
                Ok(listener) => break listener,
                Err(e) if std::time::Instant::now() < deadline => {
                    eprintln!(
                        "fake apiserver: rebinding {} failed ({e}), retrying",
                        self.addr
                    );
                    thread::sleep(Duration::from_millis(50));
                }
                Err(e) => panic!("FakeApiServer::restart: cannot rebind {}: {e}", self.addr),
            }
        };
        self.listen(listener);
    }

    /// Every request line received so far, e.g.
    /// `GET /api/v1/services?labelSelector=%21service.kubernetes.io%2Fheadless&limit=500 HTTP/1.1`.
    /// The query is as sent (URL-encoded); see [`Self::decoded_requests`].
    pub fn requests(&self) -> Vec<String> {
        lock(&self.shared.requests).clone()
    }

    /// [`Self::requests`] with the URL-decoded (`%XX` and `+`) request lines.
    pub fn decoded_requests(&self) -> Vec<String> {
        self.requests().iter().map(|r| percent_decode(r)).collect()
    }

    /// Forgets the recorded requests (and [`Self::list_times`]).
    pub fn clear_requests(&self) {
        lock(&self.shared.requests).clear();
        lock(&self.shared.list_times).clear();
    }

    /// The current global resourceVersion.
    pub fn resource_version(&self) -> u64 {
        lock(&self.shared.store).rv
    }

    /// How many watch connections are currently open (after their history replay was
    /// queued), e.g. to wait until a watcher is connected before injecting a fault.
    pub fn open_watches(&self) -> usize {
        lock(&self.shared.store)
            .watchers
            .iter()
            .filter(|w| !w.events.is_closed())
            .count()
    }

    /// The stored object, if any (`namespace` is `""` for Nodes).
    pub fn get(&self, kind: &str, namespace: &str, name: &str) -> Option<Value> {
        let kind = Kind::parse(kind)?;
        let namespace = if kind.namespaced() { namespace } else { "" };
        lock(&self.shared.store)
            .objects
            .get(&(kind, namespace.to_owned(), name.to_owned()))
            .cloned()
    }

    /// Starts the accept loop on `listener`.
    fn listen(&self, listener: std::net::TcpListener) {
        listener
            .set_nonblocking(true)
            .expect("make the fake apiserver listener non-blocking");
        // Subscribe here, not in the task, so that a stop() right after this sees the loop.
        let generation = self.shared.generation.subscribe();
        let (done_tx, done_rx) = std_mpsc::channel();
        self.handle.spawn(accept_loop(
            Arc::clone(&self.shared),
            listener,
            generation,
            done_tx,
        ));
        *lock(&self.listening) = Some(done_rx);
    }

    fn stop_inner(&self) -> Result<(), String> {
        let Some(done) = lock(&self.listening).take() else {
            return Ok(());
        };
        self.shared.generation.send_modify(|g| *g += 1);
        lock(&self.shared.store).watchers.clear();
        match done.recv_timeout(STOP_TIMEOUT) {
            Ok(()) | Err(std_mpsc::RecvTimeoutError::Disconnected) => {}
            Err(std_mpsc::RecvTimeoutError::Timeout) => {
                return Err("the accept loop did not stop".into())
            }
        }
        let deadline = std::time::Instant::now() + STOP_TIMEOUT;
        while self.shared.connections.load(Ordering::SeqCst) > 0 {
            if std::time::Instant::now() >= deadline {
                return Err("connections still open".into());
            }
            thread::sleep(Duration::from_millis(1));
        }
        Ok(())
    }
}

impl Drop for FakeApiServer {
    fn drop(&mut self) {
        if let Err(e) = self.stop_inner() {
            eprintln!("fake apiserver: stop on drop: {e}");
        }
        if let Some(shutdown) = self.shutdown.take() {
            let _ = shutdown.send(());
        }
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
    }
}

// ---------------------------------------------------------------------------------------
// State

/// [`FakeApiServer::apply`] with the store locked.
fn apply_locked(store: &mut Store, mut obj: Value) {
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
            "FakeApiServer::apply: unsupported kind {kind_name:?} (Service, EndpointSlice, Node)"
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

#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
enum Kind {
    Service,
    EndpointSlice,
    Node,
}

impl Kind {
    fn parse(kind: &str) -> Option<Self> {
        match kind {
            "Service" => Some(Self::Service),
            "EndpointSlice" => Some(Self::EndpointSlice),
            "Node" => Some(Self::Node),
            _ => None,
        }
    }

    fn name(self) -> &'static str {
        match self {
            Self::Service => "Service",
            Self::EndpointSlice => "EndpointSlice",
            Self::Node => "Node",
        }
    }

    /// The resource (plural) name used in paths and error messages.
    fn resource(self) -> &'static str {
        match self {
            Self::Service => "services",
            Self::EndpointSlice => "endpointslices",
            Self::Node => "nodes",
        }
    }

    fn api_version(self) -> &'static str {
        match self {
            Self::Service | Self::Node => "v1",
            Self::EndpointSlice => "discovery.k8s.io/v1",
        }
    }

    fn namespaced(self) -> bool {
        !matches!(self, Self::Node)
    }
}

/// One write, as kept in the history and sent to watchers.
struct Change {
    rv: u64,
    kind: Kind,
    /// State before the write (for a delete: the last state; its DELETED event carries
    /// the delete's resourceVersion, see `event_for`).
    before: Option<Value>,
    /// State after the write (`None` for a delete).
    after: Option<Value>,
}

/// An open watch: dropping this closes the watch connection abruptly.
struct WatchSink {
    events: mpsc::UnboundedSender<Arc<Change>>,
    _kill: oneshot::Sender<()>,
}

#[derive(Default)]
struct Store {
    /// The global resourceVersion: that of the last write.
    rv: u64,
    objects: BTreeMap<(Kind, String, String), Value>,
    /// Each object of `objects` as JSON text.
    encoded: BTreeMap<(Kind, String, String), Arc<str>>,
    /// Every write with resourceVersion > `oldest_rv`.
    history: Vec<Arc<Change>>,
    /// Watches from a resourceVersion below this get 410 Gone.
    oldest_rv: u64,
    watchers: Vec<WatchSink>,
    uids: u64,
}

impl Store {
    fn record(&mut self, change: Change) {
        let change = Arc::new(change);
        self.history.push(Arc::clone(&change));
        self.watchers
            .retain(|w| w.events.send(Arc::clone(&change)).is_ok());
    }

    fn expire(&mut self) {
        self.rv += 1;
        self.history.clear();
        self.oldest_rv = self.rv;
    }
}

struct Shared {
    store: Mutex<Store>,
    requests: Mutex<Vec<String>>,
    /// Bumped by `stop()`: the accept loop and every connection end.
    generation: watch::Sender<u64>,
    /// Open connections (including those whose task has not started yet).
    connections: AtomicUsize,
    /// See [`FakeApiServer::compact_after_pages`].
    compact_after_pages: AtomicUsize,
    /// See [`FakeApiServer::watch_bytes`].
    watch_bytes: AtomicU64,
    /// See [`FakeApiServer::list_times`].
    list_times: Mutex<Vec<(Kind, std::time::Instant)>>,
}

/// Counts an open connection in [`Shared::connections`] for as long as it lives.
struct ConnectionGuard(Arc<Shared>);

impl ConnectionGuard {
    fn new(shared: &Arc<Shared>) -> Self {
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
fn lock<T>(mutex: &Mutex<T>) -> MutexGuard<'_, T> {
    mutex.lock().unwrap_or_else(PoisonError::into_inner)
}

// ---------------------------------------------------------------------------------------
// Selectors

#[derive(Debug)]
enum LabelRequirement {
    Exists(String),
    NotExists(String),
    Equals(String, String),
    NotEquals(String, String),
    In(String, Vec<String>),
    NotIn(String, Vec<String>),
}

impl LabelRequirement {
    fn matches(&self, labels: Option<&serde_json::Map<String, Value>>) -> bool {
        let get = |key: &str| labels.and_then(|l| l.get(key)).and_then(Value::as_str);
        match self {
            Self::Exists(key) => get(key).is_some(),
            Self::NotExists(key) => get(key).is_none(),
            Self::Equals(key, value) => get(key) == Some(value.as_str()),
            Self::NotEquals(key, value) => get(key) != Some(value.as_str()),
            Self::In(key, values) => get(key).is_some_and(|v| values.iter().any(|x| x == v)),
            Self::NotIn(key, values) => !get(key).is_some_and(|v| values.iter().any(|x| x == v)),
        }
    }
}

#[derive(Debug)]
enum Field {
    Name,
    Namespace,
}

#[derive(Debug)]
struct FieldRequirement {
    field: Field,
    value: String,
    negated: bool,
}

/// What a list or watch request selects.
#[derive(Debug, Default)]
struct Filter {
    /// From a namespaced path.
    namespace: Option<String>,
    labels: Vec<LabelRequirement>,
    fields: Vec<FieldRequirement>,
}

impl Filter {
    fn matches(&self, obj: &Value) -> bool {
        let meta = &obj["metadata"];
        let name = meta["name"].as_str().unwrap_or_default();
        let namespace = meta["namespace"].as_str().unwrap_or_default();
        if self.namespace.as_deref().is_some_and(|ns| ns != namespace) {
            return false;
        }
        let labels = meta["labels"].as_object();
        self.labels.iter().all(|r| r.matches(labels))
            && self.fields.iter().all(|r| {
                let actual = match r.field {
                    Field::Name => name,
                    Field::Namespace => namespace,
                };
                (actual == r.value) != r.negated
            })
    }
}

/// Splits on commas outside parentheses (`a in (x,y),b` is two terms).
fn split_terms(selector: &str) -> Vec<&str> {
    let mut terms = Vec::new();
    let mut depth = 0usize;
    let mut start = 0;
    for (i, c) in selector.char_indices() {
        match c {
            '(' => depth += 1,
            ')' => depth = depth.saturating_sub(1),
            ',' if depth == 0 => {
                terms.push(&selector[start..i]);
                start = i + 1;
            }
            _ => {}
        }
    }
    terms.push(&selector[start..]);
    terms
        .into_iter()
        .map(str::trim)
        .filter(|t| !t.is_empty())
        .collect()
}

fn valid_label_key(key: &str) -> bool {
    !key.is_empty()
        && key
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.' | '/'))
}

fn valid_label_value(value: &str) -> bool {
    value
        .chars()
        .all(|c| c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.'))
}

fn parse_label_selector(selector: &str) -> Result<Vec<LabelRequirement>, String> {
    let mut requirements = Vec::new();
    for term in split_terms(selector) {
        let bad = || format!("unable to parse requirement: invalid label selector term {term:?}");
        let requirement = if let Some(key) = term.strip_prefix('!') {
            LabelRequirement::NotExists(key.trim().to_owned())
        } else if let Some((key, value)) = term.split_once("!=") {
            LabelRequirement::NotEquals(key.trim().to_owned(), value.trim().to_owned())
        } else if let Some((key, value)) = term.split_once("==") {
            LabelRequirement::Equals(key.trim().to_owned(), value.trim().to_owned())
        } else if let Some((key, value)) = term.split_once('=') {
            LabelRequirement::Equals(key.trim().to_owned(), value.trim().to_owned())
        } else if let Some((head, rest)) = term.split_once('(') {
            let values: Vec<String> = rest
                .strip_suffix(')')
                .ok_or_else(bad)?
                .split(',')
                .map(|v| v.trim().to_owned())
                .collect();
            match head.split_whitespace().collect::<Vec<_>>()[..] {
                [key, "in"] => LabelRequirement::In(key.to_owned(), values),
                [key, "notin"] => LabelRequirement::NotIn(key.to_owned(), values),
                _ => return Err(bad()),
            }
        } else {
            LabelRequirement::Exists(term.to_owned())
        };
        let (key, values): (&str, Vec<&str>) = match &requirement {
            LabelRequirement::Exists(k) | LabelRequirement::NotExists(k) => (k, vec![]),
            LabelRequirement::Equals(k, v) | LabelRequirement::NotEquals(k, v) => (k, vec![v]),
            LabelRequirement::In(k, vs) | LabelRequirement::NotIn(k, vs) => {
                (k, vs.iter().map(String::as_str).collect())
            }
        };
        if !valid_label_key(key) || !values.iter().all(|v| valid_label_value(v)) {
            return Err(bad());
        }
        requirements.push(requirement);
    }
    Ok(requirements)
}

fn parse_field_selector(selector: &str) -> Result<Vec<FieldRequirement>, String> {
    let mut requirements = Vec::new();
    for term in split_terms(selector) {
        let (path, value, negated) = if let Some((p, v)) = term.split_once("!=") {
            (p, v, true)
        } else if let Some((p, v)) = term.split_once("==") {
            (p, v, false)
        } else if let Some((p, v)) = term.split_once('=') {
            (p, v, false)
        } else {
            return Err(format!("invalid field selector term {term:?}"));
        };
        let field = match path.trim() {
            "metadata.name" => Field::Name,
            "metadata.namespace" => Field::Namespace,
            other => {
                return Err(format!(
                    "field label not supported: {other} (the fake apiserver knows metadata.name and metadata.namespace)"
                ))
            }
        };
        requirements.push(FieldRequirement {
            field,
            value: value.trim().to_owned(),
            negated,
        });
    }
    Ok(requirements)
}

// ---------------------------------------------------------------------------------------
// HTTP

struct Request {
    line: String,
    method: String,
    target: String,
    close: bool,
}

/// What to answer.
enum Reply {
    Json(u16, Value),
    /// A list page (200): written like `Json`, its first byte's time recorded.
    List(Kind, String),
    Watch(WatchRequest),
}

struct WatchRequest {
    kind: Kind,
    filter: Filter,
    /// `None`: start with ADDED events for the current state (resourceVersion unset or "0").
    since: Option<u64>,
    bookmarks: bool,
    /// `sendInitialEvents=true`: end the initial state with an `initial-events-end` bookmark.
    initial_events_end: bool,
    timeout: Duration,
}

enum Route {
    Version,
    Collection(Kind, Option<String>),
    Object(Kind, Option<String>, String),
}

fn route(path: &str) -> Option<Route> {
    let segments: Vec<String> = path
        .trim_matches('/')
        .split('/')
        .map(percent_decode)
        .collect();
    let s: Vec<&str> = segments.iter().map(String::as_str).collect();
    let kind_of = |resource: &str| match resource {
        "services" => Some(Kind::Service),
        "nodes" => Some(Kind::Node),
        _ => None,
    };
    Some(match s[..] {
        ["version"] => Route::Version,
        ["api", "v1", "nodes"] => Route::Collection(Kind::Node, None),
        ["api", "v1", "nodes", name] => Route::Object(Kind::Node, None, name.to_owned()),
        ["api", "v1", "services"] => Route::Collection(Kind::Service, None),
        ["api", "v1", "namespaces", ns, resource] => Route::Collection(
            kind_of(resource).filter(|k| k.namespaced())?,
            Some(ns.to_owned()),
        ),
        ["api", "v1", "namespaces", ns, resource, name] => Route::Object(
            kind_of(resource).filter(|k| k.namespaced())?,
            Some(ns.to_owned()),
            name.to_owned(),
        ),
        ["apis", "discovery.k8s.io", "v1", "endpointslices"] => {
            Route::Collection(Kind::EndpointSlice, None)
        }
        ["apis", "discovery.k8s.io", "v1", "namespaces", ns, "endpointslices"] => {
            Route::Collection(Kind::EndpointSlice, Some(ns.to_owned()))
        }
        ["apis", "discovery.k8s.io", "v1", "namespaces", ns, "endpointslices", name] => {
            Route::Object(Kind::EndpointSlice, Some(ns.to_owned()), name.to_owned())
        }
        _ => return None,
    })
}

fn status(code: u16, reason: &str, message: impl Into<String>) -> Value {
    json!({
        "kind": "Status",
        "apiVersion": "v1",
        "metadata": {},
        "status": "Failure",
        "message": message.into(),
        "reason": reason,
        "code": code,
    })
}

fn handle(shared: &Shared, request: &Request) -> Reply {
    let (path, query) = request
        .target
        .split_once('?')
        .unwrap_or((request.target.as_str(), ""));
    let Some(route) = route(path) else {
        return Reply::Json(
            404,
            status(
                404,
                "NotFound",
                "the server could not find the requested resource",
            ),
        );
    };
    if request.method != "GET" {
        return Reply::Json(
            405,
            status(
                405,
                "MethodNotAllowed",
                format!("the fake apiserver only serves GET, not {}", request.method),
            ),
        );
    }
    let params: HashMap<String, String> = query
        .split('&')
        .filter(|p| !p.is_empty())
        .map(|p| {
            let (k, v) = p.split_once('=').unwrap_or((p, ""));
            (percent_decode(k), percent_decode(v))
        })
        .collect();
    let param = |name: &str| params.get(name).map(String::as_str).unwrap_or_default();

    let (kind, namespace) = match route {
        Route::Version => {
            return Reply::Json(
                200,
                json!({
                    "major": "1", "minor": "33", "gitVersion": "v1.33.0-fake",
                    "gitCommit": "0000000000000000000000000000000000000000",
                    "gitTreeState": "clean", "buildDate": "2025-01-01T00:00:00Z",
                    "goVersion": "go1.24.0", "compiler": "gc", "platform": "linux/amd64",
                }),
            )
        }
        Route::Object(kind, namespace, name) => {
            let key = (kind, namespace.unwrap_or_default(), name);
            return match lock(&shared.store).objects.get(&key) {
                Some(obj) => Reply::Json(200, obj.clone()),
                None => {
                    let mut not_found = status(
                        404,
                        "NotFound",
                        format!("{} \"{}\" not found", kind.resource(), key.2),
                    );
                    not_found["details"] = json!({"name": key.2, "kind": kind.resource()});
                    Reply::Json(404, not_found)
                }
            };
        }
        Route::Collection(kind, namespace) => (kind, namespace),
    };

    let labels = match parse_label_selector(param("labelSelector")) {
        Ok(labels) => labels,
        Err(e) => return Reply::Json(400, status(400, "BadRequest", e)),
    };
    let fields = match parse_field_selector(param("fieldSelector")) {
        Ok(fields) => fields,
        Err(e) => return Reply::Json(400, status(400, "BadRequest", e)),
    };
    let filter = Filter {
        namespace,
        labels,
        fields,
    };

    if matches!(param("watch"), "true" | "1") {
        let since = match param("resourceVersion") {
            "" | "0" => None,
            rv => match rv.parse::<u64>() {
                Ok(rv) => Some(rv),
                Err(_) => {
                    return Reply::Json(
                        400,
                        status(400, "BadRequest", format!("invalid resource version: {rv}")),
                    )
                }
            },
        };
        let timeout = match param("timeoutSeconds").parse::<u64>() {
            Ok(secs) if secs > 0 => Duration::from_secs(secs),
            _ => DEFAULT_WATCH_TIMEOUT,
        };
        let initial_events = param("sendInitialEvents") == "true";
        if initial_events && param("resourceVersionMatch") != "NotOlderThan" {
            // kube-apiserver's validation of a watch-list request.
            return Reply::Json(
                422,
                status(
                    422,
                    "Invalid",
                    "sendInitialEvents: Forbidden: sendInitialEvents is forbidden for watch unless resourceVersionMatch is set to NotOlderThan",
                ),
            );
        }
        return Reply::Watch(WatchRequest {
            kind,
            filter,
            // With sendInitialEvents the initial state is sent whatever the version.
            since: if initial_events { None } else { since },
            bookmarks: param("allowWatchBookmarks") == "true",
            initial_events_end: initial_events,
            timeout,
        });
    }

    let mut store = lock(&shared.store);
    let page = match list_page(&store, kind, &filter, &params) {
        Ok(page) => page,
        Err((code, reason, message)) => return Reply::Json(code, status(code, reason, message)),
    };
    let mut metadata = json!({"resourceVersion": page.rv.to_string()});
    if let Some(token) = &page.continue_token {
        metadata["continue"] = token.clone().into();
        if shared
            .compact_after_pages
            .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |n| n.checked_sub(1))
            .is_ok()
        {
            store.expire();
        }
    }
    let mut body = format!(
        r#"{{"kind":"{}List","apiVersion":"{}","metadata":{metadata},"items":["#,
        kind.name(),
        kind.api_version()
    );
    body.reserve(page.items.iter().map(|i| i.len() + 1).sum());
    for (i, item) in page.items.iter().enumerate() {
        if i > 0 {
            body.push(',');
        }
        body.push_str(item);
    }
    body.push_str("]}");
    Reply::List(kind, body)
}

/// One page of a list.
struct Page {
    /// The snapshot it was served from.
    rv: u64,
    /// Each item as JSON text.
    items: Vec<Arc<str>>,
    continue_token: Option<String>,
}

/// A continue token: the snapshot's resourceVersion and the last key served, hex-encoded
/// (opaque to clients, as kube-apiserver's base64 JSON is).
fn encode_continue(rv: u64, namespace: &str, name: &str) -> String {
    format!("{rv}\n{namespace}\n{name}")
        .bytes()
        .map(|b| format!("{b:02x}"))
        .collect()
}

fn decode_continue(token: &str) -> Option<(u64, String, String)> {
    if !token.len().is_multiple_of(2) {
        return None;
    }
    let bytes: Option<Vec<u8>> = (0..token.len())
        .step_by(2)
        .map(|i| u8::from_str_radix(token.get(i..i + 2)?, 16).ok())
        .collect();
    let text = String::from_utf8(bytes?).ok()?;
    let mut parts = text.splitn(3, '\n');
    let rv = parts.next()?.parse().ok()?;
    Some((rv, parts.next()?.to_owned(), parts.next()?.to_owned()))
}

/// An error answer: code, reason, message.
type ListError = (u16, &'static str, String);

fn too_large(rv: u64, current: u64) -> ListError {
    (
        504,
        "Timeout",
        format!("Too large resource version: {rv}, current: {current}"),
    )
}

/// The message kube-apiserver sends with the 410 for a compacted continue token.
const CONTINUE_EXPIRED: &str = "The provided continue parameter is too old to display a consistent list result. You can start a new list without the continue parameter, or use the continue token in this response to retrieve the remainder of the results. Continuing with the provided token results in an inconsistent list - objects that were created, modified, or deleted between the time the first chunk was returned and now may show up in the list.";

/// Which snapshot a list request reads (`at`), from which key on (`after`, exclusive,
/// namespace and name), and whether `limit` applies.
type ListStart = (u64, Option<(String, String)>, bool);

/// The [`ListStart`] of a list request.
fn list_start(store: &Store, params: &HashMap<String, String>) -> Result<ListStart, ListError> {
    let param = |name: &str| params.get(name).map(String::as_str).unwrap_or_default();
    let (rv_param, rv_match, token) = (
        param("resourceVersion"),
        param("resourceVersionMatch"),
        param("continue"),
    );
    let parse_rv = |rv: &str| {
        rv.parse::<u64>()
            .map_err(|_| (400, "BadRequest", format!("invalid resource version: {rv}")))
    };
    if !token.is_empty() {
        if !rv_param.is_empty() {
            return Err((
                400,
                "BadRequest",
                "specifying resource version is not allowed when using continue".into(),
            ));
        }
        let Some((rv, namespace, name)) = decode_continue(token) else {
            return Err((400, "BadRequest", "continue key is not valid".into()));
        };
        if rv < store.oldest_rv {
            return Err((410, "Expired", CONTINUE_EXPIRED.into()));
        }
        return Ok((rv, Some((namespace, name)), true));
    }
    Ok(match (rv_param, rv_match) {
        ("", "") => (store.rv, None, true),
        ("", _) => {
            return Err((
                400,
                "BadRequest",
                "resourceVersionMatch is forbidden unless resourceVersion is provided".into(),
            ))
        }
        // Any version: kube-apiserver serves it from its watch cache, whole.
        ("0", "" | "NotOlderThan") => (store.rv, None, false),
        (rv, "" | "NotOlderThan") => {
            let rv = parse_rv(rv)?;
            if rv > store.rv {
                return Err(too_large(rv, store.rv));
            }
            (store.rv, None, true)
        }
        (rv, "Exact") => {
            let rv = parse_rv(rv)?;
            if rv > store.rv {
                return Err(too_large(rv, store.rv));
            }
            if rv < store.oldest_rv {
                return Err((
                    410,
                    "Expired",
                    format!("too old resource version: {rv} ({})", store.oldest_rv),
                ));
            }
            (rv, None, true)
        }
        (_, other) => {
            return Err((
                400,
                "BadRequest",
                format!("unsupported resourceVersionMatch: {other}"),
            ))
        }
    })
}

/// The page a list request gets (see the module documentation for the semantics).
fn list_page(
    store: &Store,
    kind: Kind,
    filter: &Filter,
    params: &HashMap<String, String>,
) -> Result<Page, ListError> {
    let param = |name: &str| params.get(name).map(String::as_str).unwrap_or_default();
    let limit = match param("limit") {
        "" => None,
        l => match l.parse::<usize>() {
            Ok(0) => None,
            Ok(l) => Some(l),
            Err(_) => return Err((400, "BadRequest", format!("invalid limit: {l}"))),
        },
    };
    let (at, after, paged) = list_start(store, params)?;
    let limit = limit.filter(|_| paged);

    // The snapshot at `at`: the current objects, with every key written after `at` put
    // back to its state before its first write after `at` (None: it did not exist).
    let mut overrides: BTreeMap<(&str, &str), Option<&Value>> = BTreeMap::new();
    let first_after = store.history.partition_point(|c| c.rv <= at);
    for change in store.history[first_after..].iter().rev() {
        if change.kind != kind {
            continue;
        }
        let Some(obj) = change.after.as_ref().or(change.before.as_ref()) else {
            continue;
        };
        let meta = &obj["metadata"];
        let key = (
            meta["namespace"].as_str().unwrap_or_default(),
            meta["name"].as_str().unwrap_or_default(),
        );
        overrides.insert(key, change.before.as_ref());
    }
    let start = match &after {
        Some((namespace, name)) => Bound::Excluded((kind, namespace.clone(), name.clone())),
        None => Bound::Included((kind, String::new(), String::new())),
    };
    let mut current = store
        .objects
        .range((start.clone(), Bound::Unbounded))
        .take_while(|((k, _, _), _)| *k == kind)
        // `encoded` has the same keys as `objects`.
        .zip(store.encoded.range((start, Bound::Unbounded)))
        .map(|(((_, ns, name), v), (_, text))| ((ns.as_str(), name.as_str()), Some(v), Some(text)))
        .peekable();
    let after_key = after
        .as_ref()
        .map(|(ns, name)| (ns.as_str(), name.as_str()));
    let mut older = overrides
        .iter()
        .filter(|(key, _)| after_key.is_none_or(|a| **key > a))
        .map(|(key, v)| (*key, *v, None))
        .peekable();
    let mut items = Vec::new();
    let mut last = None;
    loop {
        // The next key of the snapshot, from whichever side has the smaller one (an
        // override wins over the current state of the same key).
        let next = match (current.peek(), older.peek()) {
            (None, None) => break,
            (Some(c), Some(o)) if c.0 == o.0 => {
                current.next();
                older.next()
            }
            (Some(c), Some(o)) if o.0 < c.0 => older.next(),
            (Some(_), _) => current.next(),
            (None, Some(_)) => older.next(),
        };
        let Some((key, Some(obj), current)) = next else {
            continue;
        };
        if !filter.matches(obj) {
            continue;
        }
        if limit.is_some_and(|l| items.len() >= l) {
            // More remain: the token resumes after the last key served.
            let (ns, name) = last.unwrap_or(key);
            return Ok(Page {
                rv: at,
                items,
                continue_token: Some(encode_continue(at, ns, name)),
            });
        }
        let text = match current {
            Some(text) => Arc::clone(text),
            // An older state of the object (a snapshot before later writes).
            None => Arc::from(obj.to_string()),
        };
        items.push(text);
        last = Some(key);
    }
    Ok(Page {
        rv: at,
        items,
        continue_token: None,
    })
}

async fn accept_loop(
    shared: Arc<Shared>,
    listener: std::net::TcpListener,
    mut generation: watch::Receiver<u64>,
    done: std_mpsc::Sender<()>,
) {
    let listener = match TcpListener::from_std(listener) {
        Ok(listener) => listener,
        Err(e) => {
            eprintln!("fake apiserver: cannot register the listener: {e}");
            let _ = done.send(());
            return;
        }
    };
    loop {
        tokio::select! {
            biased;
            _ = generation.changed() => break,
            accepted = listener.accept() => match accepted {
                Ok((stream, _)) => {
                    // A clone has seen what `generation` has seen, so a stop() that this
                    // loop has not noticed yet still reaches the new connection.
                    let guard = ConnectionGuard::new(&shared);
                    tokio::spawn(serve_connection(
                        Arc::clone(&shared),
                        stream,
                        generation.clone(),
                        guard,
                    ));
                }
                Err(e) => {
                    eprintln!("fake apiserver: accept failed: {e}");
                    tokio::time::sleep(Duration::from_millis(10)).await;
                }
            },
        }
    }
    drop(listener);
    let _ = done.send(());
}

async fn serve_connection(
    shared: Arc<Shared>,
    stream: TcpStream,
    mut generation: watch::Receiver<u64>,
    _guard: ConnectionGuard,
) {
    let _ = stream.set_nodelay(true);
    let (reader, mut writer) = stream.into_split();
    let mut reader = BufReader::new(reader);
    loop {
        let request = tokio::select! {
            biased;
            _ = generation.changed() => return,
            request = read_request(&mut reader) => request,
        };
        let Ok(Some(request)) = request else {
            return;
        };
        lock(&shared.requests).push(request.line.clone());
        let keep_alive = match handle(&shared, &request) {
            Reply::Json(code, body) => write_json(&mut writer, code, &body, request.close)
                .await
                .is_ok(),
            Reply::List(kind, body) => {
                lock(&shared.list_times).push((kind, std::time::Instant::now()));
                write_text(&mut writer, 200, &body, request.close)
                    .await
                    .is_ok()
            }
            Reply::Watch(watch) => tokio::select! {
                biased;
                _ = generation.changed() => false,
                clean = serve_watch(&shared, watch, &mut reader, &mut writer) => clean,
            },
        };
        if !keep_alive || request.close {
            return;
        }
    }
}

/// Reads one request head (and skips a body, if any). `Ok(None)` on a clean EOF.
async fn read_request(reader: &mut BufReader<OwnedReadHalf>) -> io::Result<Option<Request>> {
    let mut line = String::new();
    loop {
        line.clear();
        if reader.read_line(&mut line).await? == 0 {
            return Ok(None);
        }
        if !line.trim().is_empty() {
            break;
        }
    }
    let line = line.trim_end().to_owned();
    let mut parts = line.split(' ');
    let method = parts.next().unwrap_or_default().to_owned();
    let target = parts.next().unwrap_or_default().to_owned();
    let version = parts.next().unwrap_or_default();
    let mut close = version == "HTTP/1.0";
    let mut content_length = 0usize;
    loop {
        let mut header = String::new();
        if reader.read_line(&mut header).await? == 0 {
            return Ok(None);
        }
        let header = header.trim_end();
        if header.is_empty() {
            break;
        }
        if let Some((name, value)) = header.split_once(':') {
            let value = value.trim().to_ascii_lowercase();
            match name.trim().to_ascii_lowercase().as_str() {
                "content-length" => content_length = value.parse().unwrap_or(0),
                "connection" if value.contains("close") => close = true,
                "connection" if value.contains("keep-alive") => close = false,
                _ => {}
            }
        }
    }
    if content_length > 0 {
        let mut body = vec![0; content_length];
        reader.read_exact(&mut body).await?;
    }
    Ok(Some(Request {
        line,
        method,
        target,
        close,
    }))
}

fn reason_phrase(code: u16) -> &'static str {
    match code {
        200 => "OK",
        400 => "Bad Request",
        404 => "Not Found",
        405 => "Method Not Allowed",
        410 => "Gone",
        422 => "Unprocessable Entity",
        504 => "Gateway Timeout",
        _ => "Unknown",
    }
}

async fn write_json(
    writer: &mut OwnedWriteHalf,
    code: u16,
    body: &Value,
    close: bool,
) -> io::Result<()> {
    write_text(writer, code, &body.to_string(), close).await
}

async fn write_text(
    writer: &mut OwnedWriteHalf,
    code: u16,
    body: &str,
    close: bool,
) -> io::Result<()> {
    let response = format!(
        "HTTP/1.1 {code} {}\r\nContent-Type: application/json\r\nCache-Control: no-cache, private\r\nContent-Length: {}\r\n{}\r\n{body}",
        reason_phrase(code),
        body.len(),
        if close { "Connection: close\r\n" } else { "" },
    );
    writer.write_all(response.as_bytes()).await
}

/// One watch event as a chunk of the chunked response: the JSON and a newline.
fn event_chunk(event_type: &str, object: &Value) -> Vec<u8> {
    let line = format!("{}\n", json!({"type": event_type, "object": object}));
    let mut chunk = format!("{:x}\r\n", line.len()).into_bytes();
    chunk.extend_from_slice(line.as_bytes());
    chunk.extend_from_slice(b"\r\n");
    chunk
}

fn bookmark(kind: Kind, rv: u64, initial_events_end: bool) -> Vec<u8> {
    let mut metadata = json!({"resourceVersion": rv.to_string()});
    if initial_events_end {
        metadata["annotations"] = json!({"k8s.io/initial-events-end": "true"});
    }
    event_chunk(
        "BOOKMARK",
        &json!({"kind": kind.name(), "apiVersion": kind.api_version(), "metadata": metadata}),
    )
}

/// The event a watch with `filter` sees for `change`, if any (watch-cache semantics).
fn event_for(kind: Kind, filter: &Filter, change: &Change) -> Option<(&'static str, Value)> {
    if change.kind != kind {
        return None;
    }
    let before = change.before.as_ref().filter(|o| filter.matches(o));
    let after = change.after.as_ref().filter(|o| filter.matches(o));
    match (before, after) {
        (Some(_), Some(after)) => Some(("MODIFIED", after.clone())),
        (None, Some(after)) => Some(("ADDED", after.clone())),
        (Some(before), None) => {
            let mut last = before.clone();
            last["metadata"]["resourceVersion"] = change.rv.to_string().into();
            Some(("DELETED", last))
        }
        (None, None) => None,
    }
}

/// Streams a watch. Returns whether the response ended cleanly (the connection can be
/// reused); `false` means the connection must be closed without further ado.
async fn serve_watch(
    shared: &Shared,
    request: WatchRequest,
    reader: &mut BufReader<OwnedReadHalf>,
    writer: &mut OwnedWriteHalf,
) -> bool {
    const HEAD: &[u8] = b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nCache-Control: no-cache, private\r\nTransfer-Encoding: chunked\r\n\r\n";
    const LAST_CHUNK: &[u8] = b"0\r\n\r\n";
    let kind = request.kind;

    // Take the replay and subscribe under one lock, so no write is missed or sent twice.
    let subscribed = {
        let mut store = lock(&shared.store);
        let mut initial = Vec::new();
        match request.since {
            Some(since) if since < store.oldest_rv => Err(status(
                410,
                "Expired",
                format!("too old resource version: {since} ({})", store.oldest_rv),
            )),
            since => {
                if let Some(since) = since {
                    for change in store.history.iter().filter(|c| c.rv > since) {
                        if let Some((event_type, object)) = event_for(kind, &request.filter, change)
                        {
                            initial.extend(event_chunk(event_type, &object));
                        }
                    }
                } else {
                    for ((k, _, _), obj) in &store.objects {
                        if *k == kind && request.filter.matches(obj) {
                            initial.extend(event_chunk("ADDED", obj));
                        }
                    }
                    if request.initial_events_end {
                        initial.extend(bookmark(kind, store.rv, true));
                    }
                }
                let (events_tx, events) = mpsc::unbounded_channel();
                let (kill_tx, kill) = oneshot::channel();
                store.watchers.push(WatchSink {
                    events: events_tx,
                    _kill: kill_tx,
                });
                // Bookmarks never go back behind what the client asked for.
                let cursor = store.rv.max(since.unwrap_or_default());
                Ok((initial, cursor, events, kill))
            }
        }
    };
    let (mut initial, mut cursor, mut events, mut kill) = match subscribed {
        Ok(subscribed) => subscribed,
        Err(gone) => {
            // What the apiserver does for an expired watch: 200, one ERROR event, the end.
            let mut response = HEAD.to_vec();
            response.extend(event_chunk("ERROR", &gone));
            response.extend_from_slice(LAST_CHUNK);
            return writer.write_all(&response).await.is_ok();
        }
    };

    let count = |bytes: &[u8]| {
        shared
            .watch_bytes
            .fetch_add(bytes.len() as u64, Ordering::Relaxed);
    };
    count(&initial);
    let mut head = HEAD.to_vec();
    head.append(&mut initial);
    if writer.write_all(&head).await.is_err() {
        return false;
    }
    let deadline = Instant::now() + request.timeout;
    let mut bookmarks = interval_at(Instant::now() + BOOKMARK_INTERVAL, BOOKMARK_INTERVAL);
    bookmarks.set_missed_tick_behavior(MissedTickBehavior::Delay);
    let mut scratch = [0u8; 512];
    loop {
        tokio::select! {
            biased;
            // drop_watches() or stop(): end abruptly.
            _ = &mut kill => return false,
            change = events.recv() => {
                let Some(change) = change else { return false };
                cursor = change.rv;
                if let Some((event_type, object)) = event_for(kind, &request.filter, &change) {
                    let chunk = event_chunk(event_type, &object);
                    count(&chunk);
                    if writer.write_all(&chunk).await.is_err() {
                        return false;
                    }
                }
            }
            _ = sleep_until(deadline) => {
                return writer.write_all(LAST_CHUNK).await.is_ok();
            }
            _ = bookmarks.tick(), if request.bookmarks => {
                let chunk = bookmark(kind, cursor, false);
                count(&chunk);
                if writer.write_all(&chunk).await.is_err() {
                    return false;
                }
            }
            // The client went away (or, against the protocol, sent something: ignored).
            read = reader.read(&mut scratch) => {
                if !matches!(read, Ok(n) if n > 0) {
                    return false;
                }
            }
        }
    }
}

// ---------------------------------------------------------------------------------------
// Small helpers

/// Decodes `%XX` escapes and `+` (form encoding, as kube-rs sends queries).
fn percent_decode(s: &str) -> String {
    let bytes = s.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        match bytes[i] {
            b'+' => out.push(b' '),
            b'%' => {
                let hex = s
                    .get(i + 1..i + 3)
                    .and_then(|h| u8::from_str_radix(h, 16).ok());
                match hex {
                    Some(byte) => {
                        out.push(byte);
                        i += 2;
                    }
                    None => out.push(b'%'),
                }
            }
            b => out.push(b),
        }
        i += 1;
    }
    String::from_utf8_lossy(&out).into_owned()
}

/// The current time as RFC 3339 in UTC, second precision (`2025-01-31T12:00:00Z`).
fn now_rfc3339() -> String {
    let secs = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or_default();
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
