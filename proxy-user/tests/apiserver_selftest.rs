//! Self-tests of the fake kube-apiserver (`proxy_testbed::apiserver`, in
//! `proxy-user/testbed/src/apiserver/`): kube-rs's real client
//! and `kube::runtime::watcher` must see it as a kube-apiserver (initial list, live events,
//! label selectors, reconnects, 410 relists, server restarts), and the wire format must
//! hold up to a raw HTTP client. Unprivileged; everything binds to 127.0.0.1 only.
//!
//! Over 600 lines: one suite (the test apiserver's kube-apiserver behaviours). Each file
//! under `tests/` is a test binary of its own that links the whole crate, so a suite is
//! split into modules only when its scenarios stop sharing set-up (shared helpers live in
//! `tests/support/`).

use std::{
    collections::BTreeSet,
    fmt::Debug,
    io::{BufRead, BufReader, Read, Write},
    net::TcpStream,
    sync::atomic::{AtomicUsize, Ordering},
    time::Duration,
};

use futures::{Stream, StreamExt};
use k8s_openapi::api::{
    core::v1::{Namespace, Node, Pod, Service},
    discovery::v1::EndpointSlice,
};
use kube::{
    api::{Api, ListParams, WatchEvent, WatchParams},
    config::{KubeConfigOptions, Kubeconfig},
    runtime::{
        watcher::{self, Event},
        WatchStreamExt,
    },
    Client, Resource, ResourceExt,
};
use proxy_testbed::apiserver::FakeApiServer;
use serde::de::DeserializeOwned;
use serde_json::{json, Value};
use tokio::{sync::mpsc, task::JoinHandle, time::timeout};

/// The selector kube-proxy uses for Services.
const SERVICE_SELECTOR: &str =
    "!service.kubernetes.io/headless,!service.kubernetes.io/service-proxy-name";
/// Longest wait for any single watcher event.
const STEP: Duration = Duration::from_secs(10);

static KUBECONFIGS: AtomicUsize = AtomicUsize::new(0);

/// A kube client configured the way a user would: from a kubeconfig file.
async fn client_for(server: &FakeApiServer) -> Client {
    let path = std::env::temp_dir().join(format!(
        "fake-apiserver-{}-{}.kubeconfig",
        std::process::id(),
        KUBECONFIGS.fetch_add(1, Ordering::Relaxed)
    ));
    server.write_kubeconfig(&path);
    let kubeconfig = Kubeconfig::read_from(&path).expect("read the written kubeconfig");
    let _ = std::fs::remove_file(&path);
    let config = kube::Config::from_custom_kubeconfig(kubeconfig, &KubeConfigOptions::default())
        .await
        .expect("kube config from the fake kubeconfig");
    assert_eq!(config.default_namespace, "default");
    Client::try_from(config).expect("kube client for the fake apiserver")
}

fn service(name: &str, labels: Value) -> Value {
    json!({
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": {"name": name, "namespace": "default", "labels": labels},
        "spec": {
            "type": "ClusterIP",
            "clusterIP": "10.96.0.10",
            "clusterIPs": ["10.96.0.10"],
            "ports": [{"name": "http", "port": 80, "protocol": "TCP", "targetPort": 8080}],
        },
    })
}

fn endpoint_slice(name: &str, service: &str, ip: &str) -> Value {
    json!({
        "apiVersion": "discovery.k8s.io/v1",
        "kind": "EndpointSlice",
        "metadata": {
            "name": name,
            "namespace": "default",
            "labels": {"kubernetes.io/service-name": service},
        },
        "addressType": "IPv4",
        "endpoints": [{"addresses": [ip], "conditions": {"ready": true}}],
        "ports": [{"name": "http", "port": 8080, "protocol": "TCP"}],
    })
}

fn node(name: &str) -> Value {
    json!({"apiVersion": "v1", "kind": "Node", "metadata": {"name": name}})
}

/// Runs a watcher stream in a task (so it keeps its watch connected while the test waits)
/// and mirrors what it reports, like a reflector store would.
struct Observed<K> {
    events: mpsc::UnboundedReceiver<Result<Event<K>, watcher::Error>>,
    task: JoinHandle<()>,
    /// `namespace/name` of every object the watcher currently reports.
    state: BTreeSet<String>,
    /// Objects of a relist in progress (between Init and InitDone).
    relist: Option<BTreeSet<String>>,
    /// Every event seen, as text (see [`Observed::next`]).
    log: Vec<String>,
}

impl<K> Observed<K>
where
    K: Resource + Clone + DeserializeOwned + Debug + Send + 'static,
{
    fn spawn(
        stream: impl Stream<Item = Result<Event<K>, watcher::Error>> + Send + 'static,
    ) -> Self {
        let (tx, events) = mpsc::unbounded_channel();
        let task = tokio::spawn(async move {
            let mut stream = std::pin::pin!(stream);
            while let Some(item) = stream.next().await {
                if tx.send(item).is_err() {
                    break;
                }
            }
        });
        Self {
            events,
            task,
            state: BTreeSet::new(),
            relist: None,
            log: Vec::new(),
        }
    }

    fn key(obj: &K) -> String {
        format!("{}/{}", obj.namespace().unwrap_or_default(), obj.name_any())
    }

    /// The next event as text: `Init`, `InitApply ns/name`, `InitDone`, `Apply ns/name`,
    /// `Delete ns/name` or `Error: ...`.
    async fn next(&mut self) -> String {
        let item = timeout(STEP, self.events.recv())
            .await
            .unwrap_or_else(|_| panic!("no watcher event within {STEP:?}; so far: {:?}", self.log))
            .expect("the watcher stream ended");
        let text = match item {
            Ok(Event::Init) => {
                self.relist = Some(BTreeSet::new());
                "Init".to_owned()
            }
            Ok(Event::InitApply(obj)) => {
                let key = Self::key(&obj);
                self.relist
                    .as_mut()
                    .expect("InitApply outside Init..InitDone")
                    .insert(key.clone());
                format!("InitApply {key}")
            }
            Ok(Event::InitDone) => {
                self.state = self.relist.take().expect("InitDone without Init");
                "InitDone".to_owned()
            }
            Ok(Event::Apply(obj)) => {
                let key = Self::key(&obj);
                self.state.insert(key.clone());
                format!("Apply {key}")
            }
            Ok(Event::Delete(obj)) => {
                let key = Self::key(&obj);
                self.state.remove(&key);
                format!("Delete {key}")
            }
            Err(e) => format!("Error: {e}"),
        };
        self.log.push(text.clone());
        text
    }

    /// The next event that is not an error.
    async fn next_ok(&mut self) -> String {
        loop {
            let event = self.next().await;
            if !event.starts_with("Error") {
                return event;
            }
        }
    }

    /// The next non-error events must be exactly these.
    async fn expect(&mut self, expected: &[&str]) {
        for want in expected {
            let got = self.next_ok().await;
            assert_eq!(&got, want, "unexpected watcher event; log: {:?}", self.log);
        }
    }

    /// Consumes events until the mirrored state is `expected` and no relist is in progress.
    async fn converge(&mut self, expected: &[&str], within: Duration) {
        let expected: BTreeSet<String> = expected.iter().map(|s| s.to_string()).collect();
        timeout(within, async {
            while self.state != expected || self.relist.is_some() {
                self.next().await;
            }
        })
        .await
        .unwrap_or_else(|_| {
            panic!(
                "watcher state {:?} is not {expected:?} after {within:?}; log: {:?}",
                self.state, self.log
            )
        });
    }

    /// No event arrives for `quiet`.
    async fn expect_quiet(&mut self, quiet: Duration) {
        if let Ok(item) = timeout(quiet, self.events.recv()).await {
            panic!(
                "unexpected watcher event {:?}; log: {:?}",
                item.map(|r| r.map(|e| format!("{e:?}"))),
                self.log
            );
        }
    }
}

impl<K> Drop for Observed<K> {
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// Waits (asynchronously, so the watcher task can run) until `n` watches are open.
async fn wait_for_watches(server: &FakeApiServer, n: usize) {
    timeout(STEP, async {
        while server.open_watches() < n {
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
    })
    .await
    .unwrap_or_else(|_| {
        panic!(
            "fewer than {n} watches open; requests: {:#?}",
            server.requests()
        )
    });
}

fn service_watcher(client: Client) -> Observed<Service> {
    Observed::spawn(watcher::watcher(
        Api::<Service>::all(client),
        watcher::Config::default().labels(SERVICE_SELECTOR),
    ))
}

#[tokio::test]
async fn initial_list_then_apply_delete_and_label_selector() {
    let server = FakeApiServer::start();
    server.apply(service("a", json!({"app": "a"})));
    server.apply(service(
        "headless",
        json!({"service.kubernetes.io/headless": ""}),
    ));
    server.apply(service(
        "other-proxy",
        json!({"service.kubernetes.io/service-proxy-name": "x"}),
    ));
    let mut services = service_watcher(client_for(&server).await);

    services
        .expect(&["Init", "InitApply default/a", "InitDone"])
        .await;

    server.apply(service("b", json!({})));
    services.expect(&["Apply default/b"]).await;
    server.apply(service("a", json!({"app": "a", "version": "2"})));
    services.expect(&["Apply default/a"]).await;
    server.delete("Service", "default", "b");
    services.expect(&["Delete default/b"]).await;

    // Filtered out: never seen. The next visible change proves nothing came before it.
    server.apply(service(
        "headless-2",
        json!({"service.kubernetes.io/headless": ""}),
    ));
    services.expect_quiet(Duration::from_millis(300)).await;
    server.apply(service("c", json!({})));
    services.expect(&["Apply default/c"]).await;

    // Stops matching -> DELETED; matches again -> ADDED (an Apply).
    server.apply(service("c", json!({"service.kubernetes.io/headless": ""})));
    services.expect(&["Delete default/c"]).await;
    server.apply(service("c", json!({})));
    services.expect(&["Apply default/c"]).await;
    assert_eq!(
        services.state,
        BTreeSet::from(["default/a".to_owned(), "default/c".to_owned()])
    );

    // Objects got what the apiserver sets.
    let stored = server.get("Service", "default", "c").expect("c is stored");
    assert_eq!(
        stored["metadata"]["resourceVersion"],
        server.resource_version().to_string()
    );
    assert!(
        stored["metadata"]["uid"].is_string()
            && stored["metadata"]["creationTimestamp"].is_string()
    );

    // kube-rs 5 sends exactly these (note the empty first parameter: "?&").
    assert_eq!(
        server.decoded_requests(),
        [
            format!("GET /api/v1/services?&labelSelector={SERVICE_SELECTOR}&limit=500 HTTP/1.1"),
            format!(
                "GET /api/v1/services?&watch=true&timeoutSeconds=290&labelSelector={SERVICE_SELECTOR}\
                 &allowWatchBookmarks=true&resourceVersion=3 HTTP/1.1"
            ),
        ]
    );
}

#[tokio::test]
async fn endpointslice_watcher() {
    let server = FakeApiServer::start();
    server.apply(endpoint_slice("a-1", "a", "10.0.0.1"));
    server.apply(endpoint_slice("b-1", "b", "10.0.0.2"));
    server.apply(service("a", json!({}))); // another kind: must not show up
    let client = client_for(&server).await;
    let mut slices: Observed<EndpointSlice> = Observed::spawn(watcher::watcher(
        Api::<EndpointSlice>::all(client.clone()),
        watcher::Config::default().labels("kubernetes.io/service-name"),
    ));
    slices
        .expect(&[
            "Init",
            "InitApply default/a-1",
            "InitApply default/b-1",
            "InitDone",
        ])
        .await;

    server.apply(endpoint_slice("a-1", "a", "10.0.0.3"));
    slices.expect(&["Apply default/a-1"]).await;
    server.delete("EndpointSlice", "default", "b-1");
    slices.expect(&["Delete default/b-1"]).await;

    // What arrives deserializes into the k8s-openapi type with its fields.
    let api = Api::<EndpointSlice>::namespaced(client, "default");
    let slice = api.get("a-1").await.expect("get a-1");
    assert_eq!(slice.endpoints[0].addresses, ["10.0.0.3"]);
    assert_eq!(slice.address_type, "IPv4");
}

/// Issue 24 item 2: as the EndpointSlice controller, the server stamps each slice written
/// with `endpoints.kubernetes.io/last-change-trigger-time` (RFC 3339, sub-second), the
/// time kube-proxy's network programming latency starts from; a slice that carries one
/// keeps it.
#[tokio::test]
async fn endpointslices_carry_the_last_change_trigger_time() {
    const TRIGGER: &str = "endpoints.kubernetes.io/last-change-trigger-time";
    let server = FakeApiServer::start();
    let before = std::time::SystemTime::now();
    server.apply(endpoint_slice("a-1", "a", "10.0.0.1"));
    let mut given = endpoint_slice("b-1", "b", "10.0.0.2");
    given["metadata"]["annotations"] = json!({TRIGGER: "2026-01-02T03:04:05.5Z"});
    server.apply(given);
    let after = std::time::SystemTime::now();
    let api = Api::<EndpointSlice>::namespaced(client_for(&server).await, "default");
    let stamp = |s: &EndpointSlice| {
        s.metadata
            .annotations
            .as_ref()
            .and_then(|a| a.get(TRIGGER))
            .cloned()
            .expect("the trigger-time annotation")
    };
    let a = stamp(&api.get("a-1").await.expect("get a-1"));
    let t = proxy_user::cluster::objects::parse_rfc3339(&a).expect("RFC 3339");
    // Second-truncated bounds: the stamp is within the apply, to the nanosecond.
    let secs = |t: std::time::SystemTime| {
        t.duration_since(std::time::UNIX_EPOCH)
            .expect("after 1970")
            .as_secs_f64()
    };
    assert!(
        secs(before) <= secs(t) && secs(t) <= secs(after),
        "{a} is not between {before:?} and {after:?}"
    );
    assert_eq!(
        stamp(&api.get("b-1").await.expect("get b-1")),
        "2026-01-02T03:04:05.5Z"
    );
}

#[tokio::test]
async fn streaming_lists_work_too() {
    let server = FakeApiServer::start();
    server.apply(service("a", json!({})));
    server.apply(service(
        "headless",
        json!({"service.kubernetes.io/headless": ""}),
    ));
    let mut services = Observed::spawn(watcher::watcher(
        Api::<Service>::all(client_for(&server).await),
        watcher::Config::default()
            .labels(SERVICE_SELECTOR)
            .streaming_lists(),
    ));
    services
        .expect(&["Init", "InitApply default/a", "InitDone"])
        .await;
    server.apply(service("b", json!({})));
    services.expect(&["Apply default/b"]).await;
    let requests = server.decoded_requests();
    assert_eq!(requests.len(), 1, "{requests:#?}");
    assert!(
        requests[0].contains(
            "sendInitialEvents=true&resourceVersionMatch=NotOlderThan&resourceVersion=0 "
        ),
        "{requests:#?}"
    );
}

#[tokio::test]
async fn drop_watches_resumes_from_last_version() {
    let server = FakeApiServer::start();
    server.apply(service("a", json!({})));
    let mut services = service_watcher(client_for(&server).await);
    services
        .expect(&["Init", "InitApply default/a", "InitDone"])
        .await;
    wait_for_watches(&server, 1).await;
    let rv = server.resource_version();

    server.drop_watches();
    assert_eq!(server.open_watches(), 0);
    wait_for_watches(&server, 1).await;
    server.apply(service("b", json!({})));
    // Resumed, not relisted: the very next event is the change.
    services.expect(&["Apply default/b"]).await;

    let watches: Vec<String> = server
        .decoded_requests()
        .into_iter()
        .filter(|r| r.contains("watch=true"))
        .collect();
    assert_eq!(watches.len(), 2, "{watches:#?}");
    assert!(
        watches
            .iter()
            .all(|w| w.contains(&format!("resourceVersion={rv} "))),
        "{watches:#?}"
    );
    let lists = server
        .requests()
        .iter()
        .filter(|r| !r.contains("watch=true"))
        .count();
    assert_eq!(lists, 1);

    // A change made while the watch is down is replayed from history on reconnect.
    server.drop_watches();
    server.apply(service("c", json!({})));
    services.expect(&["Apply default/c"]).await;
    // kube-rs takes the cut-off chunked body as a resumable end of stream, not an error.
    assert_eq!(
        services.log,
        [
            "Init",
            "InitApply default/a",
            "InitDone",
            "Apply default/b",
            "Apply default/c"
        ]
    );
}

#[tokio::test]
async fn expired_history_forces_relist() {
    let server = FakeApiServer::start();
    server.apply(service("a", json!({})));
    server.apply(service("b", json!({})));
    let mut services = service_watcher(client_for(&server).await);
    services
        .expect(&[
            "Init",
            "InitApply default/a",
            "InitApply default/b",
            "InitDone",
        ])
        .await;
    wait_for_watches(&server, 1).await;

    // No await in between: on this single-threaded test runtime the watcher cannot
    // reconnect before b is gone, so it never sees b's DELETED event.
    server.drop_watches();
    server.delete("Service", "default", "b");
    server.expire_history();

    let error = services.next().await;
    assert!(
        error.contains("410") || error.contains("too old"),
        "expected a 410 error, got {error}"
    );
    services
        .expect(&["Init", "InitApply default/a", "InitDone"])
        .await;
    assert!(!services
        .log
        .iter()
        .any(|e| e.contains("default/b") && e.starts_with("Delete")));

    // Even with nothing changed, expiring then dropping the watch makes the watcher relist.
    wait_for_watches(&server, 1).await;
    server.expire_history();
    server.drop_watches();
    let error = services.next().await;
    assert!(
        error.starts_with("Error"),
        "expected a 410 error, got {error}"
    );
    services
        .expect(&["Init", "InitApply default/a", "InitDone"])
        .await;
    // And it works afterwards.
    server.apply(service("d", json!({})));
    services.expect(&["Apply default/d"]).await;
}

#[tokio::test]
async fn stop_and_restart_converge_with_default_backoff() {
    let server = FakeApiServer::start();
    server.apply(service("a", json!({})));
    server.apply(service("b", json!({})));
    let mut services = Observed::spawn(
        watcher::watcher(
            Api::<Service>::all(client_for(&server).await),
            watcher::Config::default().labels(SERVICE_SELECTOR),
        )
        .default_backoff(),
    );
    services
        .expect(&[
            "Init",
            "InitApply default/a",
            "InitApply default/b",
            "InitDone",
        ])
        .await;
    wait_for_watches(&server, 1).await;

    server.stop();
    assert!(
        TcpStream::connect(server.url().trim_start_matches("http://")).is_err(),
        "stopped server accepts connections"
    );
    server.delete("Service", "default", "a");
    server.apply(service("c", json!({})));
    // Let the watcher notice: it gets connection errors and backs off.
    let error = services.next().await;
    assert!(
        error.starts_with("Error"),
        "expected a connection error, got {error}"
    );

    server.restart();
    services
        .converge(&["default/b", "default/c"], Duration::from_secs(25))
        .await;
    println!("log: {:?}", services.log);
    // It converged by relisting (old resourceVersions are gone after a restart).
    assert_eq!(services.log.iter().filter(|e| *e == "Init").count(), 2);

    wait_for_watches(&server, 1).await;
    server.apply(service("d", json!({})));
    services.expect(&["Apply default/d"]).await;
}

/// Pods and Namespaces as kube-apiserver serves them to a node agent: Pods across
/// namespaces selected by `spec.nodeName` (a field selector no other kind takes: 400),
/// Namespaces cluster-scoped with their labels, and a watch that sees a pod's label change.
#[tokio::test]
async fn pods_by_node_name_and_namespaces() {
    let server = FakeApiServer::start();
    let pod = |ns: &str, name: &str, node: &str| {
        json!({"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name, "namespace": ns},
               "spec": {"nodeName": node, "containers": [{"name": "c", "image": "x"}]}})
    };
    server.apply(pod("a", "p1", "node-a"));
    server.apply(pod("b", "p2", "node-a"));
    server.apply(pod("a", "p3", "node-b"));
    server.apply(json!({"apiVersion": "v1", "kind": "Namespace",
        "metadata": {"name": "a", "labels": {"istio.io/dataplane-mode": "ambient"}}}));
    let client = client_for(&server).await;
    let pods = Api::<Pod>::all(client.clone());
    let on_a = ListParams::default().fields("spec.nodeName=node-a");
    let listed = pods.list(&on_a).await.expect("list pods");
    let mut names: Vec<String> = listed.items.iter().map(|p| p.name_any()).collect();
    names.sort();
    assert_eq!(names, ["p1", "p2"]);
    assert!(
        listed.items.iter().all(|p| p.uid().is_some()),
        "uids assigned"
    );
    let namespaces = Api::<Namespace>::all(client.clone());
    let ns = namespaces
        .list(&ListParams::default())
        .await
        .expect("list namespaces");
    assert_eq!(ns.items.len(), 1);
    assert_eq!(ns.items[0].labels()["istio.io/dataplane-mode"], "ambient");
    let err = Api::<Service>::all(client.clone())
        .list(&ListParams::default().fields("spec.nodeName=node-a"))
        .await
        .expect_err("spec.nodeName is a Pod field");
    assert!(
        matches!(err, kube::Error::Api(ref s) if s.code == 400),
        "{err:?}"
    );

    let rv = listed.metadata.resource_version.expect("rv");
    let mut events = pods
        .watch(&WatchParams::default().fields("spec.nodeName=node-a"), &rv)
        .await
        .expect("watch")
        .boxed();
    server.apply(pod("a", "p4", "node-b"));
    let mut p1 = pod("a", "p1", "node-a");
    p1["metadata"]["labels"] = json!({"x": "y"});
    server.apply(p1);
    let event = tokio::time::timeout(Duration::from_secs(5), events.next())
        .await
        .expect("an event")
        .expect("stream open")
        .expect("event");
    match event {
        WatchEvent::Modified(p) => {
            assert_eq!(p.name_any(), "p1", "another node's pod is not sent");
            assert_eq!(p.labels()["x"], "y");
        }
        other => panic!("{other:?}"),
    }
}

#[tokio::test]
async fn api_calls_selectors_and_errors() {
    let server = FakeApiServer::start();
    server.apply(node("n1"));
    server.apply(node("n2"));
    server.apply(service("a", json!({"tier": "web"})));
    server.apply(json!({"kind": "Service", "metadata": {"name": "a", "namespace": "other", "labels": {"tier": "db"}}}));
    let client = client_for(&server).await;

    let nodes = Api::<Node>::all(client.clone());
    let listed = nodes
        .list(&ListParams::default())
        .await
        .expect("list nodes");
    assert_eq!(
        listed
            .items
            .iter()
            .map(|n| n.name_any())
            .collect::<Vec<_>>(),
        ["n1", "n2"]
    );
    assert_eq!(
        listed.metadata.resource_version,
        Some(server.resource_version().to_string())
    );
    let one = nodes
        .list(&ListParams::default().fields("metadata.name=n2"))
        .await
        .expect("list n2");
    assert_eq!(one.items.len(), 1);
    assert_eq!(one.items[0].name_any(), "n2");

    let services = Api::<Service>::all(client.clone());
    let names = |list: kube::core::ObjectList<Service>| {
        list.items
            .iter()
            .map(|s| format!("{}/{}", s.namespace().unwrap_or_default(), s.name_any()))
            .collect::<Vec<_>>()
    };
    let all = services
        .list(&ListParams::default())
        .await
        .expect("list services");
    assert_eq!(names(all), ["default/a", "other/a"]);
    let db = services
        .list(&ListParams::default().labels("tier in (db,cache)"))
        .await
        .expect("list db");
    assert_eq!(names(db), ["other/a"]);
    let not_web = services
        .list(&ListParams::default().labels("tier!=web"))
        .await
        .expect("list !web");
    assert_eq!(names(not_web), ["other/a"]);
    let in_other = Api::<Service>::namespaced(client.clone(), "other")
        .list(&ListParams::default())
        .await
        .expect("list other");
    assert_eq!(names(in_other), ["other/a"]);
    let by_ns = services
        .list(&ListParams::default().fields("metadata.namespace==default"))
        .await
        .expect("list by ns");
    assert_eq!(names(by_ns), ["default/a"]);

    // Errors come back as Status objects.
    let missing = Api::<Service>::namespaced(client.clone(), "default")
        .get("nope")
        .await;
    assert!(
        matches!(missing, Err(kube::Error::Api(ref s)) if s.code == 404 && s.reason == "NotFound"),
        "{missing:?}"
    );
    let configmaps = Api::<k8s_openapi::api::core::v1::ConfigMap>::all(client.clone());
    let unknown = configmaps.list(&ListParams::default()).await;
    assert!(
        matches!(unknown, Err(kube::Error::Api(ref s)) if s.code == 404),
        "{unknown:?}"
    );
    let bad = services
        .list(&ListParams::default().fields("spec.clusterIP=1.2.3.4"))
        .await;
    assert!(
        matches!(bad, Err(kube::Error::Api(ref s)) if s.code == 400),
        "{bad:?}"
    );

    // A raw watch: replay after a version, then an expired version gets a 410 ERROR event.
    let rv_before_b = server.resource_version();
    server.apply(service("b", json!({})));
    let mut stream = services
        .watch(&WatchParams::default().timeout(2), &rv_before_b.to_string())
        .await
        .expect("watch services")
        .boxed();
    let first = timeout(STEP, stream.next())
        .await
        .expect("replayed event")
        .expect("stream open");
    assert!(
        matches!(first, Ok(WatchEvent::Added(ref s)) if s.name_any() == "b"),
        "{first:?}"
    );
    // A bookmark within ~1 s, then the end of the stream after timeoutSeconds=2.
    let second = timeout(STEP, stream.next())
        .await
        .expect("bookmark")
        .expect("stream open");
    assert!(
        matches!(second, Ok(WatchEvent::Bookmark(ref b)) if b.metadata.resource_version == server.resource_version().to_string()),
        "{second:?}"
    );
    let end = timeout(STEP, async {
        while let Some(event) = stream.next().await {
            assert!(matches!(event, Ok(WatchEvent::Bookmark(_))), "{event:?}");
        }
    });
    end.await.expect("the watch ends after timeoutSeconds");

    server.expire_history();
    let mut stream = services
        .watch(&WatchParams::default(), &rv_before_b.to_string())
        .await
        .expect("watch services")
        .boxed();
    let gone = timeout(STEP, stream.next())
        .await
        .expect("error event")
        .expect("stream open");
    assert!(
        matches!(gone, Ok(WatchEvent::Error(ref s)) if s.code == 410 && s.reason == "Expired"),
        "{gone:?}"
    );
    assert!(timeout(STEP, stream.next())
        .await
        .expect("end of stream")
        .is_none());
}

/// One HTTP/1.1 response read off a raw connection: status line, headers, decoded body.
fn read_response(reader: &mut BufReader<TcpStream>) -> (String, Vec<String>, String) {
    let mut line = String::new();
    reader.read_line(&mut line).expect("status line");
    let status = line.trim_end().to_owned();
    let mut headers = Vec::new();
    loop {
        let mut header = String::new();
        reader.read_line(&mut header).expect("header line");
        let header = header.trim_end().to_owned();
        if header.is_empty() {
            break;
        }
        headers.push(header.to_ascii_lowercase());
    }
    let mut body = Vec::new();
    if let Some(length) = headers
        .iter()
        .find_map(|h| h.strip_prefix("content-length: "))
    {
        body.resize(length.parse().expect("numeric content-length"), 0);
        reader.read_exact(&mut body).expect("body");
    } else {
        assert!(
            headers.contains(&"transfer-encoding: chunked".to_owned()),
            "{headers:?}"
        );
        loop {
            let mut size = String::new();
            reader.read_line(&mut size).expect("chunk size");
            let size = usize::from_str_radix(size.trim_end(), 16).expect("hex chunk size");
            let mut chunk = vec![0; size + 2];
            reader.read_exact(&mut chunk).expect("chunk");
            if size == 0 {
                break;
            }
            body.extend_from_slice(&chunk[..size]);
        }
    }
    (
        status,
        headers,
        String::from_utf8(body).expect("utf-8 body"),
    )
}

#[test]
fn raw_http_from_sync_code() {
    let server = FakeApiServer::start();
    server.apply(node("n1"));
    let stream = TcpStream::connect(server.url().trim_start_matches("http://")).expect("connect");
    stream.set_read_timeout(Some(STEP)).expect("read timeout");
    let mut writer = stream.try_clone().expect("clone stream");
    let mut reader = BufReader::new(stream);

    // Several requests on one keep-alive connection.
    writer
        .write_all(b"GET /api/v1/nodes?limit=500&continue= HTTP/1.1\r\nHost: x\r\n\r\n")
        .expect("send list");
    let (status, headers, body) = read_response(&mut reader);
    assert_eq!(status, "HTTP/1.1 200 OK");
    assert!(headers.contains(&"content-type: application/json".to_owned()));
    let list: Value = serde_json::from_str(&body).expect("list JSON");
    assert_eq!(list["kind"], "NodeList");
    assert_eq!(list["apiVersion"], "v1");
    assert_eq!(list["metadata"]["resourceVersion"], "1");
    assert_eq!(list["items"][0]["metadata"]["name"], "n1");
    assert!(list["metadata"].get("continue").is_none());

    writer
        .write_all(b"GET /api/v1/configmaps HTTP/1.1\r\nHost: x\r\n\r\n")
        .expect("send unknown");
    let (status, _, body) = read_response(&mut reader);
    assert!(status.starts_with("HTTP/1.1 404"), "{status}");
    let not_found: Value = serde_json::from_str(&body).expect("Status JSON");
    assert_eq!(not_found["kind"], "Status");
    assert_eq!(not_found["code"], 404);

    // A watch from "0" starts with the current state, then bookmarks, then ends cleanly.
    writer
        .write_all(b"GET /api/v1/nodes?watch=1&resourceVersion=0&allowWatchBookmarks=true&timeoutSeconds=2 HTTP/1.1\r\nHost: x\r\n\r\n")
        .expect("send watch");
    let (status, headers, body) = read_response(&mut reader);
    assert_eq!(status, "HTTP/1.1 200 OK");
    assert!(headers.contains(&"content-type: application/json".to_owned()));
    let events: Vec<Value> = body
        .lines()
        .map(|l| serde_json::from_str(l).expect("event JSON"))
        .collect();
    assert_eq!(events[0]["type"], "ADDED");
    assert_eq!(events[0]["object"]["kind"], "Node");
    assert!(
        events[1..]
            .iter()
            .all(|e| e["type"] == "BOOKMARK" && e["object"]["kind"] == "Node"),
        "{events:?}"
    );
    assert!(events.len() >= 2, "no bookmark in 2 s: {events:?}");

    // The connection is still usable after the watch ended.
    writer
        .write_all(b"GET /version HTTP/1.1\r\nHost: x\r\n\r\n")
        .expect("send version");
    let (status, _, body) = read_response(&mut reader);
    assert_eq!(status, "HTTP/1.1 200 OK");
    assert!(body.contains("gitVersion"));

    assert_eq!(server.requests().len(), 4);
    assert!(server.requests()[2].starts_with("GET /api/v1/nodes?watch=1&"));

    // drop_watches() cuts a watch off mid-stream: no terminating chunk, just EOF.
    server.apply(node("n2"));
    writer
        .write_all(b"GET /api/v1/nodes?watch=true&resourceVersion=1 HTTP/1.1\r\nHost: x\r\n\r\n")
        .expect("send watch");
    let mut head = String::new();
    while !head.ends_with("\r\n\r\n") {
        let mut line = String::new();
        reader.read_line(&mut line).expect("watch response head");
        assert!(!line.is_empty(), "EOF in the response head: {head}");
        head.push_str(&line);
    }
    let mut size = String::new();
    reader.read_line(&mut size).expect("chunk size");
    let mut event = String::new();
    reader.read_line(&mut event).expect("replayed event");
    assert!(
        event.contains(r#""type":"ADDED""#) && event.contains("n2"),
        "{event}"
    );
    server.drop_watches();
    let mut rest = String::new();
    reader.read_to_string(&mut rest).expect("read until EOF");
    assert_eq!(rest, "\r\n", "only the end of the event's chunk");
}

/// `n` Services named `svc-00000` ... (key order = creation order).
fn many_services(n: usize) -> Vec<Value> {
    (0..n)
        .map(|i| service(&format!("svc-{i:05}"), json!({})))
        .collect()
}

fn names<K: Resource>(list: &[K]) -> Vec<String> {
    list.iter()
        .map(|o| o.meta().name.clone().unwrap_or_default())
        .collect()
}

/// kube-apiserver's paging, through kube-rs's `Api::list`: `limit` pages in key order with
/// a `continue` token, every page from the first page's snapshot (writes in between do not
/// show), `410 Expired` for a compacted token, and the resourceVersion rules.
#[tokio::test]
async fn lists_are_paged_from_one_snapshot() {
    let server = FakeApiServer::start();
    server.apply_many(many_services(1203));
    let api = Api::<Service>::all(client_for(&server).await);
    let first = api
        .list(&ListParams::default().limit(500))
        .await
        .expect("first page");
    assert_eq!(first.items.len(), 500);
    let snapshot = first.metadata.resource_version.clone().expect("rv");
    assert_eq!(snapshot, server.resource_version().to_string());
    let token = first.metadata.continue_.clone().expect("a continue token");
    assert_eq!(names(&first.items)[0], "svc-00000");
    assert_eq!(names(&first.items)[499], "svc-00499");

    // Writes after the first page: a delete ahead (svc-00700), an update ahead
    // (svc-00800), a new object at the end; none may show in this list.
    server.delete("Service", "default", "svc-00700");
    let mut changed = service("svc-00800", json!({"changed": "yes"}));
    changed["spec"]["clusterIP"] = json!("10.96.9.9");
    server.apply(changed);
    server.apply(service("svc-99999", json!({})));

    let second = api
        .list(&ListParams::default().limit(500).continue_token(&token))
        .await
        .expect("second page");
    assert_eq!(second.items.len(), 500);
    assert_eq!(
        second.metadata.resource_version.as_deref(),
        Some(&*snapshot)
    );
    assert_eq!(names(&second.items)[0], "svc-00500");
    assert!(names(&second.items).contains(&"svc-00700".to_owned()));
    let old = second
        .items
        .iter()
        .find(|s| s.metadata.name.as_deref() == Some("svc-00800"))
        .expect("svc-00800");
    assert_eq!(
        old.spec.as_ref().and_then(|s| s.cluster_ip.as_deref()),
        Some("10.96.0.10"),
        "the snapshot's version of an object updated after the first page"
    );
    let third = api
        .list(
            &ListParams::default()
                .limit(500)
                .continue_token(second.metadata.continue_.as_deref().expect("token")),
        )
        .await
        .expect("third page");
    assert_eq!(third.items.len(), 203);
    assert!(
        third.metadata.continue_.is_none(),
        "the last page has no token"
    );
    assert!(!names(&third.items).contains(&"svc-99999".to_owned()));
    let all: Vec<String> = [first.items, second.items, third.items]
        .iter()
        .flat_map(|p| names(p))
        .collect();
    let distinct: BTreeSet<&String> = all.iter().collect();
    assert_eq!((all.len(), distinct.len()), (1203, 1203));

    // A fresh list sees the writes.
    let now = api.list(&ListParams::default()).await.expect("list");
    assert_eq!(now.items.len(), 1203);
    assert!(names(&now.items).contains(&"svc-99999".to_owned()));
    // Exact at the old snapshot: the old state, paged.
    let exact = api
        .list(
            &ListParams::default()
                .limit(1000)
                .at(&snapshot)
                .matching(kube::api::VersionMatch::Exact),
        )
        .await
        .expect("exact list");
    assert_eq!(exact.items.len(), 1000);
    assert!(names(&exact.items).contains(&"svc-00700".to_owned()));

    // Compaction: the old token and the old exact version are gone (410 Expired).
    let stale = third_token_of(&api).await;
    server.expire_history();
    let gone = api
        .list(&ListParams::default().limit(500).continue_token(&stale))
        .await
        .expect_err("a compacted continue token");
    assert!(
        matches!(&gone, kube::Error::Api(s) if s.code == 410 && s.reason == "Expired"),
        "{gone:?}"
    );
    let gone = api
        .list(
            &ListParams::default()
                .at(&snapshot)
                .matching(kube::api::VersionMatch::Exact),
        )
        .await
        .expect_err("a compacted exact version");
    assert!(
        matches!(&gone, kube::Error::Api(s) if s.code == 410),
        "{gone:?}"
    );
}

/// A continue token of the current snapshot (after its first page).
async fn third_token_of(api: &Api<Service>) -> String {
    api.list(&ListParams::default().limit(500))
        .await
        .expect("list")
        .metadata
        .continue_
        .expect("token")
}

/// The watcher (kube-rs's default configuration, as the agent uses it) lists 1,201
/// Services in pages of 500, then watches from the list's version.
#[tokio::test]
async fn watcher_lists_in_pages() {
    let server = FakeApiServer::start();
    server.apply_many(many_services(1201));
    let mut services = Observed::spawn(watcher::watcher(
        Api::<Service>::all(client_for(&server).await),
        watcher::Config::default().page_size(500),
    ));
    assert_eq!(services.next_ok().await, "Init");
    for i in 0..1201 {
        assert_eq!(
            services.next_ok().await,
            format!("InitApply default/svc-{i:05}")
        );
    }
    assert_eq!(services.next_ok().await, "InitDone");
    let requests = server.decoded_requests();
    let lists: Vec<&String> = requests.iter().filter(|r| !r.contains("watch=")).collect();
    assert_eq!(lists.len(), 3, "{lists:#?}");
    assert!(lists.iter().all(|r| r.contains("limit=500")), "{lists:#?}");
    assert!(!lists[0].contains("continue="), "{lists:#?}");
    assert!(
        lists[1..].iter().all(|r| r.contains("continue=")),
        "{lists:#?}"
    );
    assert_eq!(server.list_times("Service").len(), 3);
    server.apply(service("late", json!({})));
    services.expect(&["Apply default/late"]).await;
}

/// etcd compacts between two pages: the second page's token is stale, the server answers
/// `410 Expired`, and the watcher starts the list over and ends up with every object.
#[tokio::test]
async fn stale_continue_token_gets_410_and_the_watcher_relists() {
    let server = FakeApiServer::start();
    server.apply_many(many_services(1100));
    server.compact_after_pages(1);
    let mut services = Observed::spawn(watcher::watcher(
        Api::<Service>::all(client_for(&server).await),
        watcher::Config::default(),
    ));
    assert_eq!(services.next().await, "Init");
    for i in 0..500 {
        assert_eq!(
            services.next().await,
            format!("InitApply default/svc-{i:05}")
        );
    }
    let error = services.next().await;
    assert!(
        error.starts_with("Error") && error.contains("too old to display a consistent list"),
        "{error}"
    );
    services
        .converge(
            &(0..1100)
                .map(|i| format!("default/svc-{i:05}"))
                .collect::<Vec<_>>()
                .iter()
                .map(String::as_str)
                .collect::<Vec<_>>(),
            STEP,
        )
        .await;
    assert_eq!(services.log.iter().filter(|e| *e == "Init").count(), 2);
    // The relist: three fresh pages after the two of the failed list.
    let lists: Vec<String> = server
        .decoded_requests()
        .into_iter()
        .filter(|r| !r.contains("watch="))
        .collect();
    assert_eq!(lists.len(), 5, "{lists:#?}");
    assert!(
        !lists[2].contains("continue="),
        "the relist starts over: {lists:#?}"
    );
}

/// What kube-rs never sends or retries, on the wire: `resourceVersion=0` with a `limit` is
/// served whole (kube-apiserver's watch cache), `continue` with a `resourceVersion` is a
/// 400, a resourceVersion from the future a 504.
/// Streaming lists need `resourceVersionMatch=NotOlderThan` (kube-apiserver's validation);
/// with it, the initial events end with the `k8s.io/initial-events-end` bookmark.
#[test]
fn raw_list_rules_and_watch_list() {
    let server = FakeApiServer::start();
    server.apply(node("n1"));
    server.apply(node("n2"));
    server.apply(node("n3"));
    let stream = TcpStream::connect(server.url().trim_start_matches("http://")).expect("connect");
    stream.set_read_timeout(Some(STEP)).expect("read timeout");
    let mut writer = stream.try_clone().expect("clone stream");
    let mut reader = BufReader::new(stream);
    let mut list = |query: &str| {
        writer
            .write_all(format!("GET /api/v1/nodes?{query} HTTP/1.1\r\nHost: x\r\n\r\n").as_bytes())
            .expect("send");
        let (status, _, body) = read_response(&mut reader);
        (status, serde_json::from_str::<Value>(&body).expect("JSON"))
    };
    let (status, page) = list("limit=2");
    assert_eq!(status, "HTTP/1.1 200 OK");
    assert_eq!(page["items"].as_array().map(Vec::len), Some(2));
    let token = page["metadata"]["continue"]
        .as_str()
        .expect("token")
        .to_owned();
    let (status, whole) = list("limit=2&resourceVersion=0");
    assert_eq!(status, "HTTP/1.1 200 OK");
    assert_eq!(whole["items"].as_array().map(Vec::len), Some(3));
    assert!(whole["metadata"].get("continue").is_none());
    let (status, err) = list(&format!("limit=2&continue={token}&resourceVersion=1"));
    assert!(status.starts_with("HTTP/1.1 400"), "{status} {err}");
    let (status, err) = list("limit=2&continue=zz");
    assert!(status.starts_with("HTTP/1.1 400"), "{status} {err}");
    let (status, rest) = list(&format!("limit=2&continue={token}"));
    assert_eq!(status, "HTTP/1.1 200 OK");
    assert_eq!(rest["items"][0]["metadata"]["name"], "n3");
    assert!(rest["metadata"].get("continue").is_none());
    let (status, err) = list("resourceVersionMatch=Exact");
    assert!(status.starts_with("HTTP/1.1 400"), "{status} {err}");
    // A version from the future: 504 (kube-rs retries those, so this is on the wire).
    let (status, err) = list("resourceVersion=99&resourceVersionMatch=NotOlderThan");
    assert!(status.starts_with("HTTP/1.1 504"), "{status} {err}");
    writer
        .write_all(b"GET /api/v1/nodes?watch=1&sendInitialEvents=true&resourceVersion=0 HTTP/1.1\r\nHost: x\r\n\r\n")
        .expect("send");
    let (status, _, body) = read_response(&mut reader);
    assert!(status.starts_with("HTTP/1.1 422"), "{status} {body}");
    writer
        .write_all(b"GET /api/v1/nodes?watch=1&sendInitialEvents=true&resourceVersionMatch=NotOlderThan&resourceVersion=0&allowWatchBookmarks=true&timeoutSeconds=1 HTTP/1.1\r\nHost: x\r\n\r\n")
        .expect("send");
    let (status, _, body) = read_response(&mut reader);
    assert_eq!(status, "HTTP/1.1 200 OK");
    let events: Vec<Value> = body
        .lines()
        .map(|l| serde_json::from_str(l).expect("event JSON"))
        .collect();
    assert!(
        events[..3].iter().all(|e| e["type"] == "ADDED"),
        "{events:?}"
    );
    assert_eq!(events[3]["type"], "BOOKMARK");
    assert_eq!(
        events[3]["object"]["metadata"]["annotations"]["k8s.io/initial-events-end"],
        "true"
    );
    assert_eq!(
        events[3]["object"]["metadata"]["resourceVersion"],
        server.resource_version().to_string()
    );
    // Every event and bookmark line is counted, with its chunk framing.
    assert!(server.watch_bytes() >= body.len() as u64);
}
