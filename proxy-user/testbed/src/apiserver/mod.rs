//! A fake kube-apiserver for tests only: it serves Services, EndpointSlices and Nodes over
//! HTTP/1.1 on 127.0.0.1 with the real list/watch protocol, so that kube-rs clients
//! (`Api::list`, `Api::watch`, `kube::runtime::watcher`) talk to it as to a real apiserver.
//! [`FakeApiServer::start`] serves plain HTTP with no authentication;
//! [`FakeApiServer::start_tls`] serves HTTPS with a CA of its own, requires a bearer token
//! or a client certificate it knows (401 otherwise) and can enforce RBAC manifests (403);
//! see `auth.rs`.
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
//! - Writes as kubectl makes them (`write.rs`): create, update, patch (merge and
//!   strategic merge patch, the latter without list merge keys), delete; and the
//!   discovery documents (`/api`, `/apis`, `/api/v1`, `/apis/discovery.k8s.io/v1`, and the
//!   part of `/openapi/v3` kubectl reads). `tests/kubectl.rs` runs the real kubectl.
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
//! [`FakeApiServer::fail_requests`] (429 with Retry-After, 500, ...),
//! [`FakeApiServer::compact_after_pages`], [`FakeApiServer::stop`] and
//! [`FakeApiServer::restart`].
//!
//! Instruments (for the bench): [`FakeApiServer::list_times`] (when each list page's
//! first byte was written), [`FakeApiServer::list_end_times`] (its last byte),
//! [`FakeApiServer::watch_bytes`] (bytes written on watch
//! streams) and [`FakeApiServer::apply_many`] (bulk loading).
//!
//! The server runs on its own single-threaded tokio runtime on a background thread, so it
//! works from plain `#[test]` functions and from `#[tokio::test]` ones alike.
//!
//! Layout: this file is the server's face ([`FakeApiServer`]: start, writes, faults,
//! instruments, stop and restart); `store.rs` the objects, their resourceVersions and
//! history; `selector.rs` label and field selectors; `http.rs` requests read and
//! responses written; `route.rs` which answer a request gets; `list.rs` list pages and
//! continue tokens; `watch.rs` watch streams and bookmarks; `write.rs` writes and
//! discovery; `auth.rs` TLS, authentication and RBAC; `conn.rs` the accept loop and each
//! connection's request loop. Its own tests are `tests/apiserver_selftest.rs`; kubectl's
//! view of it `tests/kubectl.rs`.

mod auth;
mod conn;
mod http;
mod list;
mod route;
mod selector;
mod store;
mod watch;
mod write;

use std::{
    net::SocketAddr,
    path::Path,
    sync::{
        atomic::{AtomicU64, AtomicUsize, Ordering},
        mpsc as std_mpsc, Arc, Mutex,
    },
    thread,
    time::Duration,
};

use serde_json::Value;
use tokio::{runtime::Handle, sync::oneshot};

use auth::Tls;
pub use auth::{Permission, ServiceAccountVolume};
use conn::accept_loop;
use http::percent_decode;
pub use store::rfc3339_nano;
use store::{apply_locked, delete_locked, lock, Kind, Shared, Store};

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
    /// `Some` when serving HTTPS.
    tls: Option<Arc<Tls>>,
}

impl FakeApiServer {
    /// Binds 127.0.0.1:0 and serves plain HTTP, no authentication, in the background on
    /// its own runtime thread.
    pub fn start() -> Self {
        Self::start_with(None)
    }

    /// Like [`Self::start`], but HTTPS with a CA of its own ([`Self::ca_pem`]) and every
    /// request authenticated: a bearer token added with [`Self::add_token`] or a client
    /// certificate from [`Self::client_certificate`], else `401 Unauthorized`.
    pub fn start_tls() -> Self {
        Self::start_with(Some(Arc::new(Tls::new())))
    }

    /// Like [`Self::start`], but listening on 127.0.0.1 inside the network namespace at
    /// `netns` (an agent started there reaches it; a socket keeps the namespace it was
    /// made in). [`Self::restart`] binds in the caller's namespace, so it is not for these.
    pub fn start_in_netns(netns: &Path) -> Self {
        let _in = crate::NetnsGuard::enter(netns);
        Self::start_with(None)
    }

    fn start_with(tls: Option<Arc<Tls>>) -> Self {
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
        let (generation, _) = tokio::sync::watch::channel(0);
        let server = Self {
            addr,
            shared: Arc::new(Shared {
                store: Mutex::new(Store::default()),
                auth: Mutex::new(auth::Auth::new(tls.is_some())),
                fail: Mutex::new(None),
                failed: Mutex::new(Default::default()),
                requests: Mutex::new(Vec::new()),
                generation,
                connections: AtomicUsize::new(0),
                compact_after_pages: AtomicUsize::new(0),
                watch_bytes: AtomicU64::new(0),
                list_times: Mutex::new(Vec::new()),
                list_ends: Mutex::new(Vec::new()),
                silent: std::sync::atomic::AtomicBool::new(false),
            }),
            handle,
            listening: Mutex::new(None),
            shutdown: Some(shutdown),
            thread: Some(thread),
            tls,
        };
        server.listen(listener);
        server
    }

    /// `http://127.0.0.1:PORT` (`https://` from [`Self::start_tls`]).
    pub fn url(&self) -> String {
        let scheme = if self.tls.is_some() { "https" } else { "http" };
        format!("{scheme}://{}", self.addr)
    }

    /// The listening address.
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    fn tls(&self, what: &str) -> &Tls {
        self.tls
            .as_deref()
            .unwrap_or_else(|| panic!("FakeApiServer::{what}: the server is not HTTPS (start_tls)"))
    }

    /// The CA certificate (PEM) that signed the server's certificate (HTTPS only).
    pub fn ca_pem(&self) -> String {
        self.tls("ca_pem").ca_pem.clone()
    }

    /// Accepts `Authorization: Bearer {token}` as `user` (e.g.
    /// `system:serviceaccount:ebpf-proxy:ebpf-proxy`, as a service-account token is).
    pub fn add_token(&self, token: &str, user: &str) {
        lock(&self.shared.auth).add_token(token, user);
    }

    /// Forgets a token: requests carrying it get 401 from now on (open watches go on, as
    /// on kube-apiserver, which authenticates a request once).
    pub fn revoke_token(&self, token: &str) {
        lock(&self.shared.auth).revoke_token(token);
    }

    /// A client certificate for `user` (its CN) signed by the server's CA, accepted from
    /// now on: (certificate PEM, private key PEM).
    pub fn client_certificate(&self, user: &str) -> (String, String) {
        let (cert, key, der) = self.tls("client_certificate").client_cert(user);
        lock(&self.shared.auth).add_cert(der.as_ref(), user);
        (cert, key)
    }

    /// Lets `user` do anything, unchecked by RBAC (as `system:masters` is).
    pub fn grant_all(&self, user: &str) {
        lock(&self.shared.auth).grant_all(user);
    }

    /// Enforces the ClusterRoles and ClusterRoleBindings in `yaml` (multi-document; other
    /// kinds are skipped): a resource request of a user without [`Self::grant_all`] is
    /// answered 403 unless a role bound to it allows it. Panics on a manifest it cannot
    /// read (a bug in the test or the manifest).
    pub fn enforce_rbac(&self, yaml: &str) {
        if let Err(e) = lock(&self.shared.auth).enforce_rbac(yaml) {
            panic!("FakeApiServer::enforce_rbac: {e}");
        }
    }

    /// What the enforced RBAC grants `user`: (group, resource, verb) as the rules write them.
    pub fn rbac_granted(&self, user: &str) -> std::collections::BTreeSet<Permission> {
        lock(&self.shared.auth).granted(user)
    }

    /// The (group, resource, verb) of every request of `user` that was allowed.
    pub fn permissions_used(&self, user: &str) -> std::collections::BTreeSet<Permission> {
        lock(&self.shared.auth)
            .used
            .get(user)
            .cloned()
            .unwrap_or_default()
    }

    /// Every request answered 401 or 403: `"CODE user: request line: message"`.
    pub fn rejected_requests(&self) -> Vec<String> {
        lock(&self.shared.auth).rejected.clone()
    }

    /// Writes a kubeconfig file (current-context set, namespace `default`) pointing at
    /// [`Self::url`]: no credentials (for HTTPS, the CA next to it, `PATH.ca.crt`).
    pub fn write_kubeconfig(&self, path: &Path) {
        self.write_kubeconfig_user(path, "{}");
    }

    /// [`Self::write_kubeconfig`] with a bearer token (HTTPS).
    pub fn write_kubeconfig_with_token(&self, path: &Path, token: &str) {
        self.write_kubeconfig_user(path, &format!("\n    token: {token}"));
    }

    /// [`Self::write_kubeconfig`] with a client certificate for `user` from
    /// [`Self::client_certificate`], written next to it (`PATH.crt`, `PATH.key`).
    pub fn write_kubeconfig_with_client_cert(&self, path: &Path, user: &str) {
        let (cert, key) = self.client_certificate(user);
        let cert_path = sibling(path, "crt");
        let key_path = sibling(path, "key");
        write(&cert_path, &cert);
        write(&key_path, &key);
        self.write_kubeconfig_user(
            path,
            &format!(
                "\n    client-certificate: {}\n    client-key: {}",
                cert_path.display(),
                key_path.display()
            ),
        );
    }

    fn write_kubeconfig_user(&self, path: &Path, user: &str) {
        let ca = match &self.tls {
            Some(tls) => {
                let ca_path = sibling(path, "ca.crt");
                write(&ca_path, &tls.ca_pem);
                format!("\n    certificate-authority: {}", ca_path.display())
            }
            None => String::new(),
        };
        let kubeconfig = format!(
            "apiVersion: v1
kind: Config
clusters:
- name: fake
  cluster:
    server: {url}{ca}
users:
- name: fake
  user: {user}
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
        write(path, &kubeconfig);
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
                "FakeApiServer::delete: unsupported kind {kind:?} (Service, EndpointSlice, Node, ServiceCIDR)"
            )
        });
        let namespace = if kind.namespaced() { namespace } else { "" };
        let mut store = lock(&self.shared.store);
        delete_locked(&mut store, &(kind, namespace.to_owned(), name.to_owned()));
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

    /// Answers the next `count` requests for resources (lists, gets, watches, writes; not
    /// discovery or `/version`) with `code` and kube-apiserver's Status body: 429
    /// `TooManyRequests` (with `Retry-After: retry_after` seconds when given, as the
    /// apiserver's max-in-flight filter sends it), 500 `InternalError`, 503
    /// `ServiceUnavailable`, ... See [`Self::failed_requests`].
    pub fn fail_requests(&self, code: u16, count: usize, retry_after: Option<u64>) {
        *lock(&self.shared.fail) = (count > 0).then_some((code, count, retry_after));
    }

    /// Goes silent, as an apiserver that hangs (stopped, or behind a network that drops
    /// its packets) looks from its clients: connections are still accepted and requests
    /// read, but nothing is answered (a request waits), and open watches send nothing
    /// (no events, no bookmarks, no end at their timeout; changes are held). Until
    /// [`Self::answer_again`].
    pub fn go_silent(&self) {
        self.shared.silent.store(true, Ordering::SeqCst);
    }

    /// Ends [`Self::go_silent`]: waiting requests are answered (if their client is still
    /// there), watches send what was held and carry on.
    pub fn answer_again(&self) {
        self.shared.silent.store(false, Ordering::SeqCst);
    }

    /// How many requests were answered with the injected failure `code` so far.
    pub fn failed_requests(&self, code: u16) -> usize {
        lock(&self.shared.failed).get(&code).copied().unwrap_or(0)
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

    /// When the last byte of every list response of `kind` was written (handed to the
    /// connection's socket, flushed), in order; with [`Self::clear_requests`] forgotten too.
    pub fn list_end_times(&self, kind: &str) -> Vec<std::time::Instant> {
        let Some(kind) = Kind::parse(kind) else {
            return Vec::new();
        };
        lock(&self.shared.list_ends)
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

    /// Forgets the recorded requests (and [`Self::list_times`], [`Self::list_end_times`]).
    pub fn clear_requests(&self) {
        lock(&self.shared.requests).clear();
        lock(&self.shared.list_times).clear();
        lock(&self.shared.list_ends).clear();
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
            self.tls.as_ref().map(|tls| tls.acceptor.clone()),
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

/// `PATH.ext` next to `path`.
fn sibling(path: &Path, ext: &str) -> std::path::PathBuf {
    let mut name = path.as_os_str().to_owned();
    name.push(".");
    name.push(ext);
    name.into()
}

fn write(path: &Path, text: &str) {
    std::fs::write(path, text).unwrap_or_else(|e| panic!("write {}: {e}", path.display()));
}
