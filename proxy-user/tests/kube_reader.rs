//! The agent's own list+watch reader (`cluster::kube_source::Reader`) against the fake
//! kube-apiserver (`proxy_testbed::apiserver`, the real list/watch protocol over HTTP on
//! 127.0.0.1): what it passes on to the agent (`Update`s) when a paged list's continue
//! token goes stale, when a watch's resourceVersion is compacted, when objects do not
//! decode, when a watch is cut after bookmarks, and when the server goes silent.
//! Unprivileged; each test takes a second or two, the silent server's about 20 s.

use std::{
    collections::BTreeSet,
    sync::atomic::{AtomicUsize, Ordering},
    time::{Duration, Instant},
};

use proxy_testbed::apiserver::FakeApiServer;
use proxy_user::cluster::{
    counters::SourceCounters,
    kube_source::{self, Reader, Selector},
    objects::label_selector,
    Kind, Object, Update,
};
use serde_json::{json, Value};
use tokio::{sync::mpsc, time::timeout};

const STEP: Duration = Duration::from_secs(10);

static KUBECONFIGS: AtomicUsize = AtomicUsize::new(0);

fn service(name: &str, i: usize) -> Value {
    let ip = format!("10.96.{}.{}", i / 250, 1 + i % 250);
    json!({
        "apiVersion": "v1", "kind": "Service",
        "metadata": {"namespace": "default", "name": name,
                     "annotations": {"big": "x".repeat(64)},
                     "managedFields": [{"manager": "kubectl", "operation": "Update"}]},
        "spec": {"type": "ClusterIP", "clusterIP": ip, "clusterIPs": [ip],
                 "ports": [{"name": "http", "port": 80, "protocol": "TCP"}]}
    })
}

/// A Service whose port is a string: it cannot be decoded.
fn undecodable(name: &str) -> Value {
    let mut s = service(name, 0);
    s["spec"]["ports"][0]["port"] = json!("eighty");
    s
}

struct Harness {
    rx: mpsc::Receiver<Update>,
    metrics: SourceCounters,
    /// The API server's host:port, as the reader labels its requests.
    host: String,
    task: tokio::task::JoinHandle<()>,
}

impl Harness {
    async fn start(api: &FakeApiServer) -> Self {
        Self::start_with_idle(api, Duration::from_secs(90)).await
    }

    /// With `--api-idle-timeout` `idle` (the reader's and the client's read timeout, as
    /// the agent sets both).
    async fn start_with_idle(api: &FakeApiServer, idle: Duration) -> Self {
        let path = std::env::temp_dir().join(format!(
            "kube-reader-{}-{}.kubeconfig",
            std::process::id(),
            KUBECONFIGS.fetch_add(1, Ordering::Relaxed)
        ));
        api.write_kubeconfig(&path);
        let mut config = kube_source::config(Some(&path)).await.expect("config");
        config.read_timeout = Some(idle);
        let host = kube_source::host(&config);
        let client = kube_source::client_from(config).expect("client");
        let _ = std::fs::remove_file(&path);
        let (tx, rx) = mpsc::channel(64);
        let metrics = SourceCounters::default();
        let reader = Reader {
            client,
            host: host.clone(),
            kind: Kind::Service,
            selector: Selector::Labels(label_selector(None)),
            tx,
            metrics: metrics.clone(),
            proxy_name: None,
            idle_timeout: idle,
        };
        let task = tokio::spawn(reader.run());
        Self {
            rx,
            metrics,
            host,
            task,
        }
    }

    async fn next(&mut self) -> Update {
        timeout(STEP, self.rx.recv())
            .await
            .expect("an update within 10 s")
            .expect("the reader is running")
    }

    /// Nothing arrives for `d`.
    async fn quiet(&mut self, d: Duration) {
        if let Ok(u) = timeout(d, self.rx.recv()).await {
            panic!("unexpected update: {u:?}");
        }
    }
}

impl Drop for Harness {
    fn drop(&mut self) {
        self.task.abort();
    }
}

fn names(objects: &[Object]) -> BTreeSet<String> {
    objects.iter().map(|o| o.key().to_string()).collect()
}

fn snapshot(u: Update) -> (Vec<Object>, bool) {
    match u {
        Update::Snapshot {
            kind: Kind::Service,
            objects,
            relist,
        } => (objects, relist),
        other => panic!("expected a Service snapshot, got {other:?}"),
    }
}

async fn wait_watches(api: &FakeApiServer, n: usize) {
    let start = Instant::now();
    while api.open_watches() < n {
        assert!(start.elapsed() < STEP, "no watch open");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

fn lists(api: &FakeApiServer) -> Vec<String> {
    api.decoded_requests()
        .into_iter()
        .filter(|r| r.contains("/api/v1/services?") && !r.contains("watch="))
        .collect()
}

fn watches(api: &FakeApiServer) -> Vec<String> {
    api.decoded_requests()
        .into_iter()
        .filter(|r| r.contains("/api/v1/services?") && r.contains("watch=true"))
        .collect()
}

/// etcd compacts in the middle of a paged list: the next page's continue token gets
/// `410 Expired`. The reader lists again from the start and passes on one snapshot of
/// every object (never the half list).
#[tokio::test]
async fn a_stale_continue_token_relists_from_the_start_as_one_snapshot() {
    const N: usize = 1200;
    let api = FakeApiServer::start();
    api.apply_many((0..N).map(|i| service(&format!("s{i:04}"), i)));
    api.compact_after_pages(1);
    let mut h = Harness::start(&api).await;
    let (objects, relist) = snapshot(h.next().await);
    assert!(!relist);
    assert_eq!(objects.len(), N);
    assert_eq!(names(&objects).len(), N, "no object twice");
    // Page 1, page 2 refused (410), then pages 1-3 again.
    let lists = lists(&api);
    assert_eq!(lists.len(), 5, "{lists:#?}");
    assert!(lists.iter().all(|r| r.contains("limit=500")), "{lists:#?}");
    assert!(!lists[2].contains("continue="), "started over: {lists:#?}");
    // Nothing of the API object is kept: each Service was reduced to its compact form
    // as its page was decoded.
    let Object::ReducedService(s) = &objects[0] else {
        panic!("not a reduced Service: {:?}", objects[0])
    };
    let info = s.info.as_ref().expect("valid").as_ref().expect("selected");
    assert_eq!(info.ports.len(), 1);
    // And then it watches from the list's resourceVersion.
    wait_watches(&api, 1).await;
    assert!(
        watches(&api)[0].contains("allowWatchBookmarks=true"),
        "{:#?}",
        watches(&api)
    );
    // rest_client_requests_total{code,method,host}, as client-go counts: the four pages
    // served (200) and the refused one (410), GETs to the server's host:port.
    assert!(h.host.starts_with("127.0.0.1:"), "{}", h.host);
    let count = |code: &str| {
        h.metrics
            .rest_requests
            .get_or_create(&proxy_user::cluster::counters::RestRequest {
                code: code.into(),
                method: "GET".into(),
                host: h.host.clone(),
            })
            .get()
    };
    assert_eq!(count("410"), 1);
    assert!(count("200") >= 4, "{}", count("200"));
}

/// A watch from a compacted resourceVersion gets a `410 Expired` ERROR event: the reader
/// relists and passes the relist on as one snapshot (`relist: true`), in which an object
/// deleted while it was away is missing.
#[tokio::test]
async fn an_expired_watch_relists_and_the_snapshot_drops_what_was_deleted_meanwhile() {
    let api = FakeApiServer::start();
    for (i, name) in ["a", "b", "c"].into_iter().enumerate() {
        api.apply(service(name, i));
    }
    let mut h = Harness::start(&api).await;
    let (objects, relist) = snapshot(h.next().await);
    assert!(!relist);
    assert_eq!(names(&objects).len(), 3);
    wait_watches(&api, 1).await;
    // The server goes away; meanwhile "a" is deleted and the history is compacted
    // (restart() expires it), so the reader's watch from its old version gets 410.
    api.stop();
    api.delete("Service", "default", "a");
    api.restart();
    let (objects, relist) = snapshot(h.next().await);
    assert!(relist);
    assert_eq!(
        names(&objects),
        BTreeSet::from(["default/b".to_string(), "default/c".to_string()])
    );
    assert_eq!(
        h.metrics
            .watch_restarts
            .get_or_create(&proxy_user::cluster::counters::Resource {
                resource: "Service".into()
            })
            .get(),
        1
    );
    // Live again afterwards.
    api.apply(service("d", 4));
    match h.next().await {
        Update::Apply(o) => assert_eq!(o.key().to_string(), "default/d"),
        other => panic!("{other:?}"),
    }
}

/// A malformed object is counted (`decode_error`), named in the log, and skipped, in a
/// list page and in a watch; the rest of the page and the watch go on, and its deletion
/// (which needs only its metadata) still comes through.
#[tokio::test]
async fn a_bad_object_is_skipped_alone_in_lists_and_watches() {
    let api = FakeApiServer::start();
    api.apply(service("a", 1));
    api.apply(undecodable("bad-list"));
    api.apply(service("z", 2));
    let mut h = Harness::start(&api).await;
    let (objects, _) = snapshot(h.next().await);
    assert_eq!(
        names(&objects),
        BTreeSet::from(["default/a".to_string(), "default/z".to_string()])
    );
    assert_eq!(h.metrics.skipped_count("Service", "decode_error"), 1);
    wait_watches(&api, 1).await;
    api.apply(undecodable("bad-watch"));
    api.apply(service("after", 3));
    match h.next().await {
        Update::Apply(o) => assert_eq!(o.key().to_string(), "default/after"),
        other => panic!("the bad object is skipped: {other:?}"),
    }
    assert_eq!(h.metrics.skipped_count("Service", "decode_error"), 2);
    api.delete("Service", "default", "bad-watch");
    match h.next().await {
        Update::Delete { kind, key } => {
            assert_eq!(
                (kind, key.to_string().as_str()),
                (Kind::Service, "default/bad-watch")
            )
        }
        other => panic!("{other:?}"),
    }
    // The watch was never restarted.
    assert_eq!(watches(&api).len(), 1);
    assert_eq!(lists(&api).len(), 1);
}

/// Bookmarks move the reader's resourceVersion on while its own kind is quiet: a watch
/// cut after one resumes from the bookmark's version (not the list's), without a relist.
#[tokio::test]
async fn a_cut_watch_resumes_from_the_last_bookmark() {
    let api = FakeApiServer::start();
    api.apply(service("a", 1));
    let mut h = Harness::start(&api).await;
    let _ = snapshot(h.next().await);
    wait_watches(&api, 1).await;
    let first = watches(&api);
    let listed_at = api.resource_version();
    assert!(
        first[0].contains(&format!("resourceVersion={listed_at}&")),
        "{first:#?}"
    );
    // Another kind changes (the global resourceVersion moves); the next bookmark (every
    // second on the fake server) carries it.
    api.apply(json!({"apiVersion": "v1", "kind": "Node", "metadata": {"name": "n1"}}));
    let bookmarked = api.resource_version();
    assert!(bookmarked > listed_at);
    tokio::time::sleep(Duration::from_millis(1600)).await;
    api.drop_watches();
    let start = Instant::now();
    while watches(&api).len() < 2 {
        assert!(start.elapsed() < STEP, "no new watch");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    let again = watches(&api);
    assert!(
        again[1].contains(&format!("resourceVersion={bookmarked}&")),
        "resumed from the bookmark's version {bookmarked}: {again:#?}"
    );
    assert_eq!(lists(&api).len(), 1, "no relist");
    h.quiet(Duration::from_millis(300)).await;
}

/// The server stops answering (accepts, reads, never answers; watches send nothing) while
/// a watch is open. A quiet but healthy watch is first left alone for several idle
/// timeouts (its bookmarks keep it alive); once the server is silent the reader notices
/// after the idle timeout (not the 295 s it took before `--api-idle-timeout`), counts
/// the failed requests (`rest_client_requests_total{code="<error>"}`, `watch_errors_total`)
/// and retries with backoff; when the server answers again, a change made meanwhile
/// arrives, resumed from the watch's resourceVersion (no relist).
#[tokio::test]
async fn a_silent_apiserver_is_noticed_within_the_idle_timeout_and_the_watch_resumes() {
    const IDLE: Duration = Duration::from_secs(3);
    let api = FakeApiServer::start();
    api.apply(service("a", 1));
    let mut h = Harness::start_with_idle(&api, IDLE).await;
    let _ = snapshot(h.next().await);
    wait_watches(&api, 1).await;

    // Healthy and quiet for over three idle timeouts: bookmarks (every second on the fake
    // server; about every minute on kube-apiserver) keep the one watch open.
    h.quiet(IDLE * 3 + Duration::from_secs(1)).await;
    assert_eq!(
        watches(&api).len(),
        1,
        "a quiet healthy watch was restarted"
    );
    let errors = |h: &Harness| {
        h.metrics
            .rest_requests
            .get_or_create(&proxy_user::cluster::counters::RestRequest {
                code: "<error>".into(),
                method: "GET".into(),
                host: h.host.clone(),
            })
            .get()
    };
    assert_eq!(errors(&h), 0);

    api.go_silent();
    let silent_at = Instant::now();
    // The change waits in the silent server.
    api.apply(service("b", 2));
    let noticed = loop {
        if watches(&api).len() >= 2 {
            break silent_at.elapsed();
        }
        assert!(
            silent_at.elapsed() < IDLE + STEP,
            "the dead watch was not noticed within {:?}",
            IDLE + STEP
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    };
    eprintln!("silent server: dead watch noticed (next watch sent) after {noticed:?}");
    // Not before the idle timeout (less a scheduling margin), and well within the test's
    // bound: the idle timeout plus the first backoff (0.8 s, jittered).
    assert!(noticed >= IDLE - Duration::from_millis(200), "{noticed:?}");
    // Stay silent for a few more idle timeouts: the retries time out too.
    tokio::time::sleep(IDLE * 3).await;
    assert!(errors(&h) >= 2, "failed requests counted: {}", errors(&h));
    api.answer_again();
    let answered_at = Instant::now();
    match timeout(IDLE + Duration::from_secs(35), h.rx.recv()).await {
        Ok(Some(Update::Apply(o))) => assert_eq!(o.key().to_string(), "default/b"),
        other => panic!("expected b's upsert after the server answered again: {other:?}"),
    }
    eprintln!(
        "change arrived {:?} after the server answered again",
        answered_at.elapsed()
    );
    assert_eq!(lists(&api).len(), 1, "resumed without a relist");
}
