//! Metrics (kube-proxy's names where one exists) and health, served over plain HTTP:
//! `/metrics` on the metrics address, `/healthz` and `/livez` on the health address.

use std::{
    net::SocketAddr,
    sync::{
        atomic::{AtomicBool, AtomicUsize, Ordering},
        Arc, Mutex,
    },
    time::{Duration, Instant, SystemTime, UNIX_EPOCH},
};

use prometheus_client::{
    encoding::{text::encode, EncodeLabelSet},
    metrics::{
        counter::Counter,
        family::Family,
        gauge::Gauge,
        histogram::{exponential_buckets, Histogram},
    },
    registry::Registry,
};
use tokio::net::TcpListener;
use tracing::warn;

use crate::cluster::skips::{SkipKind, SkipReason};

pub use crate::cluster::counters::{KindReason, Resource, SourceCounters};

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ReasonLabel {
    pub reason: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct MapLabel {
    pub map: String,
}

/// `mode="batch"` or `mode="single"`.
/// `map="CT4",direction="grow"` (or `"shrink"`).
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ResizeLabel {
    pub map: String,
    pub direction: String,
}

/// `family="ipv4"` (`CT4`) or `"ipv6"` (`CT6`).
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct FamilyLabel {
    pub family: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ModeLabel {
    pub mode: String,
}

/// Every metric the agent exports.
pub struct Metrics {
    registry: Registry,
    /// `sync_proxy_rules_duration_seconds`: one sync, from start to maps written.
    pub sync_duration: Histogram,
    /// `network_programming_duration_seconds`: change received -> maps written.
    pub network_programming: Histogram,
    /// `sync_proxy_rules_last_timestamp_seconds`: last successful sync.
    pub last_sync: Gauge<f64, std::sync::atomic::AtomicU64>,
    /// Frontends (service IP x port) programmed in the maps.
    pub frontends: Gauge,
    /// Distinct backends programmed in the maps.
    pub backends: Gauge,
    /// Services known (after filtering).
    pub services: Gauge,
    /// The ceiling the conntrack tables grow to, in flows (`--conntrack-max`).
    pub conntrack_max: Gauge,
    /// Size of each conntrack table in flows now (grown online toward `conntrack_max`).
    pub conntrack_capacity: Gauge,
    /// Live entries (idle timeout not passed) of each conntrack table, by family.
    pub conntrack_live_entries: Family<FamilyLabel, Gauge>,
    pub service_map_entries: Gauge,
    /// Connected UDP sockets destroyed because their backend left.
    pub stale_udp_sockets: Counter,
    /// Pod interfaces (`--pod-interfaces`) with the TC programs attached.
    pub pod_interfaces: Gauge,
    /// Pod interface attach/detach failures, by `reason` (`attach`, `detach`, `netlink`).
    pub pod_interface_errors: Family<ReasonLabel, Counter>,
    /// Watch restarts (relists) per resource.
    pub watch_restarts: Family<Resource, Counter>,
    /// Watch stream errors per resource.
    pub watch_errors: Family<Resource, Counter>,
    /// Objects not used, by kind and reason.
    pub objects_skipped: Family<KindReason, Counter>,
    /// Failed map writes by cause (`map_full`, `map_write`, `node_addresses`).
    pub map_write_errors: Family<ReasonLabel, Counter>,
    /// Kernel memory of each pinned map (fdinfo `memlock`), charged to the memory cgroup
    /// of the agent that created the maps.
    pub map_memory: Family<MapLabel, Gauge>,
    /// Woken when the maps' memory changed (a sync wrote entries, maps were resized):
    /// the refresher reads it again then, not only every 10 s.
    pub map_memory_changed: tokio::sync::Notify,
    /// Pinned maps resized online at this start, per map and direction.
    pub map_resizes: Family<ResizeLabel, Counter>,
    /// `map_writes_total{mode}`: map elements written by batch calls or one by one.
    pub map_writes: Family<ModeLabel, Counter>,
    /// Batch calls that failed and were finished element by element.
    pub map_batch_fallbacks: Counter,
    /// Broken pinned entries repaired when adopting the maps, by kind.
    pub adoption_repairs: Family<KindLabel, Counter>,
    /// The sources' counters (the same families as `objects_skipped`, `watch_*`).
    pub source: SourceCounters,
    /// kube-proxy's metrics under kube-proxy's names (`kubeproxy_metrics`).
    pub kube_proxy: super::kubeproxy_metrics::KubeProxyMetrics,
    /// `--metrics-per-service`: set at start when on (`per_service::start`).
    pub per_service: std::sync::OnceLock<super::per_service::PerService>,
}

/// `kind="..."`.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct KindLabel {
    pub kind: String,
}

impl std::fmt::Debug for Metrics {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Metrics").finish_non_exhaustive()
    }
}

impl Default for Metrics {
    fn default() -> Self {
        Self::new()
    }
}

impl Metrics {
    /// `ebpf_proxy_map_resizes_total` for each map a resize replaced (grow or shrink by
    /// its sizes).
    pub fn count_resizes(&self, resized: &[crate::loader::MapResize]) {
        for r in resized {
            let direction = if r.to > r.from { "grow" } else { "shrink" };
            self.map_resizes
                .get_or_create(&ResizeLabel {
                    map: r.map.to_string(),
                    direction: direction.to_string(),
                })
                .inc();
        }
    }

    /// `ebpf_proxy_map_memory_bytes` per map, from the loader's reading.
    pub fn set_map_memory(&self, maps: &[crate::loader::MapMemory]) {
        for m in maps {
            self.map_memory
                .get_or_create(&MapLabel {
                    map: m.name.to_string(),
                })
                .set(i64::try_from(m.bytes).unwrap_or(i64::MAX));
        }
    }

    // Long: the registry: one registration per metric, in the order of the README's list.
    pub fn new() -> Self {
        // The root has kube-proxy's metrics (`kubeproxy_*`); ours are under `ebpf_proxy_`.
        let mut root = Registry::default();
        let registry = root.sub_registry_with_prefix("ebpf_proxy");
        let sync_duration = Histogram::new(exponential_buckets(0.0001, 2.0, 18));
        let network_programming = Histogram::new(exponential_buckets(0.001, 2.0, 16));
        let source = SourceCounters::default();
        let m = Self {
            sync_duration,
            network_programming,
            last_sync: Gauge::default(),
            frontends: Gauge::default(),
            backends: Gauge::default(),
            services: Gauge::default(),
            conntrack_max: Gauge::default(),
            conntrack_capacity: Gauge::default(),
            conntrack_live_entries: Family::default(),
            service_map_entries: Gauge::default(),
            stale_udp_sockets: Counter::default(),
            pod_interfaces: Gauge::default(),
            pod_interface_errors: Family::default(),
            watch_restarts: source.watch_restarts.clone(),
            watch_errors: source.watch_errors.clone(),
            objects_skipped: source.objects_skipped.clone(),
            map_write_errors: Family::default(),
            map_memory: Family::default(),
            map_memory_changed: tokio::sync::Notify::new(),
            map_resizes: Family::default(),
            map_writes: Family::default(),
            map_batch_fallbacks: Counter::default(),
            adoption_repairs: Family::default(),
            source,
            kube_proxy: Default::default(),
            per_service: std::sync::OnceLock::new(),
            registry: Registry::default(),
        };
        registry.register(
            "sync_proxy_rules_duration_seconds",
            "Time one sync took, from start to the maps written",
            m.sync_duration.clone(),
        );
        registry.register(
            "network_programming_duration_seconds",
            "Time from a Service/EndpointSlice change being received to the maps written",
            m.network_programming.clone(),
        );
        registry.register(
            "sync_proxy_rules_last_timestamp_seconds",
            "Unix time of the last successful sync",
            m.last_sync.clone(),
        );
        registry.register(
            "programmed_frontends",
            "Frontends (service address x port) in the maps",
            m.frontends.clone(),
        );
        registry.register(
            "programmed_backends",
            "Distinct backends in the maps",
            m.backends.clone(),
        );
        registry.register(
            "services",
            "Services known after filtering",
            m.services.clone(),
        );
        registry.register(
            "conntrack_max",
            "Ceiling of each conntrack table (CT4, CT6) in flows: the tables grow online \
             up to it (--conntrack-max)",
            m.conntrack_max.clone(),
        );
        registry.register(
            "conntrack_capacity",
            "Size of each conntrack table (CT4, CT6) in flows now; LRU when full, grown x2 \
             online when its live entries pass 75 % or are projected to (two entries per \
             flow)",
            m.conntrack_capacity.clone(),
        );
        registry.register(
            "conntrack_live_entries",
            "Live entries (idle timeout not passed) of each conntrack table, by family \
             (CT4 ipv4, CT6 ipv6), sampled every 10 s",
            m.conntrack_live_entries.clone(),
        );
        registry.register(
            "service_map_entries",
            "max_entries of each service map (SVC4, SVC6) now: a frontend takes one entry \
             plus one per backend slot; grown online up to --service-map-entries",
            m.service_map_entries.clone(),
        );
        registry.register(
            "stale_udp_sockets_destroyed",
            "Connected UDP sockets destroyed because their backend left the maps",
            m.stale_udp_sockets.clone(),
        );
        registry.register(
            "pod_interfaces",
            "Pod interfaces (--pod-interfaces) with the TC programs attached",
            m.pod_interfaces.clone(),
        );
        registry.register(
            "pod_interface_errors",
            "Pod interface failures by reason (attach, detach, netlink)",
            m.pod_interface_errors.clone(),
        );
        registry.register(
            "watch_restarts",
            "Watch relists per resource",
            m.watch_restarts.clone(),
        );
        registry.register(
            "watch_errors",
            "Watch stream errors per resource",
            m.watch_errors.clone(),
        );
        registry.register(
            "objects_skipped",
            "Objects not used, by kind and reason",
            m.objects_skipped.clone(),
        );
        registry.register(
            "map_write_errors",
            "Failed map writes by reason",
            m.map_write_errors.clone(),
        );
        registry.register(
            "map_memory_bytes",
            "Kernel memory of each pinned BPF map (fdinfo memlock), charged to the memory \
             cgroup of the agent that created it",
            m.map_memory.clone(),
        );
        registry.register(
            "map_resizes",
            "Pinned BPF maps resized online (conntrack or the service maps grown or shrunk \
             while serving, or a start with another --conntrack-start/--conntrack-max or \
             --service-map-entries), per map and direction (grow, shrink)",
            m.map_resizes.clone(),
        );
        registry.register(
            "map_writes",
            "Map elements written, by mode: batch (BPF_MAP_*_BATCH calls) or single (one \
             element per call)",
            m.map_writes.clone(),
        );
        registry.register(
            "map_batch_fallbacks",
            "Batch map calls that failed and whose remaining elements were written one by one",
            m.map_batch_fallbacks.clone(),
        );
        registry.register(
            "adoption_repairs",
            "Broken pinned map entries repaired when adopting the maps, by kind",
            m.adoption_repairs.clone(),
        );
        m.kube_proxy.register(&mut root);
        // client-go's name, as kube-proxy exports it.
        root.register(
            "rest_client_requests",
            "Number of HTTP requests, partitioned by status code, method, and host.",
            m.source.rest_requests.clone(),
        );
        Self {
            registry: root,
            ..m
        }
    }

    /// Counts an object (or a part of it) not used, in `objects_skipped_total`.
    pub fn skipped(&self, kind: SkipKind, reason: SkipReason) {
        self.source.skipped(kind, reason);
    }

    /// Adds the writer's write counts (`Writer::take_write_counts`).
    pub fn record_map_writes(&self, c: &crate::store::WriteCounts) {
        for (mode, n) in [("batch", c.batch), ("single", c.single)] {
            if n > 0 {
                self.map_writes
                    .get_or_create(&ModeLabel { mode: mode.into() })
                    .inc_by(n);
            }
        }
        if c.fallbacks > 0 {
            self.map_batch_fallbacks.inc_by(c.fallbacks);
        }
    }

    pub fn mark_synced(&self) {
        let now = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .unwrap_or_default()
            .as_secs_f64();
        self.last_sync.set(now);
    }

    /// Counts a failed map write of `reason` (`map_write_errors_total{reason}`).
    pub fn map_write_error(&self, reason: &str) {
        self.map_write_errors
            .get_or_create(&ReasonLabel {
                reason: reason.into(),
            })
            .inc();
    }

    /// The Prometheus text exposition.
    pub fn render(&self) -> String {
        let mut out = String::new();
        if let Err(e) = encode(&mut out, &self.registry) {
            warn!(error = %e, "encoding metrics");
        }
        if let Some(ps) = self.per_service.get() {
            // Before the exposition's end marker.
            let eof = out.rfind("# EOF").unwrap_or(out.len());
            let tail = out.split_off(eof);
            ps.render(&mut out);
            out.push_str(&tail);
        }
        out
    }
}

/// Health in kube-proxy's sense, one rule at any time: 503 while this node's Node is
/// being deleted, before the first complete sync, and once the last complete sync is
/// older than `stale_after` (twice the resync period, as kube-proxy's healthz timeout is
/// twice its sync period). A sync that leaves frontends unwritten is not a sync (as in
/// kube-proxy, a failed sync does not move "last successful sync"): while syncs keep
/// failing, the node turns 503 at most `stale_after` after the last complete one. The
/// body says why at any time, failures included, also while it is still 200.
pub struct Health {
    synced_once: AtomicBool,
    last_sync: Mutex<Option<Instant>>,
    stale_after: Duration,
    node_deleting: AtomicBool,
    /// Frontends the last sync could not write (0 after a complete one).
    last_failed: AtomicUsize,
    /// The first incomplete sync since the last complete one.
    failing_since: Mutex<Option<Instant>>,
}

impl Health {
    pub fn new(stale_after: Duration) -> Self {
        Self {
            synced_once: AtomicBool::new(false),
            last_sync: Mutex::new(None),
            stale_after,
            node_deleting: AtomicBool::new(false),
            last_failed: AtomicUsize::new(0),
            failing_since: Mutex::new(None),
        }
    }

    /// A sync that left `failed` frontends unwritten (each named in the log and counted
    /// in `map_write_errors_total`): not a successful sync; `check` says why.
    pub fn mark_failed(&self, failed: usize) {
        self.last_failed.store(failed, Ordering::Relaxed);
        self.failing_since
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .get_or_insert_with(Instant::now);
    }

    pub fn mark_synced(&self) {
        self.last_failed.store(0, Ordering::Relaxed);
        *self.failing_since.lock().unwrap_or_else(|p| p.into_inner()) = None;
        self.synced_once.store(true, Ordering::Relaxed);
        *self.last_sync.lock().unwrap_or_else(|p| p.into_inner()) = Some(Instant::now());
    }

    /// This node's Node object is being deleted (or the autoscaler is removing it).
    pub fn set_node_deleting(&self, deleting: bool) {
        self.node_deleting.store(deleting, Ordering::Relaxed);
    }

    /// `Ok(detail)` when healthy, `Err(detail)` otherwise.
    pub fn check(&self) -> Result<String, String> {
        if self.node_deleting.load(Ordering::Relaxed) {
            return Err("the node is being deleted".into());
        }
        let failed = self.last_failed.load(Ordering::Relaxed);
        let failing = (failed > 0).then(|| {
            let since = *self.failing_since.lock().unwrap_or_else(|p| p.into_inner());
            format!(
                "the last sync could not write {failed} frontend(s) (see \
                 map_write_errors_total and the log), syncs incomplete for {:.1} s; retrying",
                since.map_or(0.0, |t| t.elapsed().as_secs_f64())
            )
        });
        if !self.synced_once.load(Ordering::Relaxed) {
            return Err(match failing {
                Some(f) => format!("no complete sync yet: {f}"),
                None => "no sync yet: waiting for the initial lists".into(),
            });
        }
        let last = *self.last_sync.lock().unwrap_or_else(|p| p.into_inner());
        let age = last.map(|t| t.elapsed()).unwrap_or(Duration::MAX);
        let limit = self.stale_after.as_secs_f64();
        if age > self.stale_after {
            return Err(format!(
                "last successful sync {:.1} s ago (limit {limit:.1} s){}",
                age.as_secs_f64(),
                failing.map(|f| format!(": {f}")).unwrap_or_default()
            ));
        }
        Ok(match failing {
            Some(f) => format!(
                "last successful sync {:.3} s ago, but {f} (503 once that sync is {limit:.1} s old)",
                age.as_secs_f64()
            ),
            None => format!("last successful sync {:.3} s ago", age.as_secs_f64()),
        })
    }
}

/// Which endpoints a listener serves.
#[derive(Clone, Copy, Debug)]
pub enum Endpoints {
    Metrics,
    Health,
}

/// Serves HTTP/1.x GETs on `listener` until the task is dropped (see `agent::http`
/// for the limits that keep slow or idle clients from stopping it).
pub async fn serve(
    listener: TcpListener,
    what: Endpoints,
    metrics: Arc<Metrics>,
    health: Arc<Health>,
) {
    let name = match what {
        Endpoints::Metrics => "metrics",
        Endpoints::Health => "healthz",
    };
    super::http::serve(
        listener,
        name,
        super::http::Limits::default(),
        move |path| {
            let (status, content_type, body) = respond(what, path, &metrics, &health);
            super::http::Reply {
                status,
                content_type,
                headers: "",
                body,
            }
        },
    )
    .await;
}

fn respond(
    what: Endpoints,
    path: &str,
    metrics: &Metrics,
    health: &Health,
) -> (&'static str, &'static str, String) {
    let r = respond_to(what, path, metrics, health);
    // kubeproxy_proxy_healthz_total / _livez_total{code}, as kube-proxy counts them.
    let code =
        r.0.split(' ')
            .next()
            .and_then(|c| c.parse().ok())
            .unwrap_or(0);
    match path {
        "/healthz" => metrics.kube_proxy.probe(false, code),
        "/livez" => metrics.kube_proxy.probe(true, code),
        _ => {}
    }
    r
}

fn respond_to(
    what: Endpoints,
    path: &str,
    metrics: &Metrics,
    health: &Health,
) -> (&'static str, &'static str, String) {
    const TEXT: &str = "text/plain; charset=utf-8";
    match (what, path) {
        (Endpoints::Metrics, "/metrics") => (
            "200 OK",
            "application/openmetrics-text; version=1.0.0; charset=utf-8",
            metrics.render(),
        ),
        (_, "/healthz") | (_, "/readyz") => match health.check() {
            Ok(detail) => ("200 OK", TEXT, format!("ok: {detail}\n")),
            Err(detail) => (
                "503 Service Unavailable",
                TEXT,
                format!("unhealthy: {detail}\n"),
            ),
        },
        (_, "/livez") => ("200 OK", TEXT, "ok\n".to_string()),
        _ => ("404 Not Found", TEXT, "not found\n".to_string()),
    }
}

/// Binds and serves; returns the bound address (port 0 picks one).
pub async fn spawn(
    addr: SocketAddr,
    what: Endpoints,
    metrics: Arc<Metrics>,
    health: Arc<Health>,
) -> std::io::Result<SocketAddr> {
    let listener = TcpListener::bind(addr).await?;
    let local = listener.local_addr()?;
    tokio::spawn(serve(listener, what, metrics, health));
    Ok(local)
}

impl crate::podif::Report for Metrics {
    fn error(&self, reason: &str) {
        self.pod_interface_errors
            .get_or_create(&ReasonLabel {
                reason: reason.into(),
            })
            .inc();
    }

    fn attached(&self, interfaces: usize) {
        self.pod_interfaces
            .set(i64::try_from(interfaces).unwrap_or(i64::MAX));
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cluster::objects::Skip;
    use tokio::io::{AsyncReadExt, AsyncWriteExt};

    #[test]
    fn health_is_503_until_the_first_sync_and_when_stale() {
        let h = Health::new(Duration::from_millis(50));
        assert!(h.check().is_err());
        h.mark_synced();
        assert!(h.check().is_ok());
        std::thread::sleep(Duration::from_millis(80));
        let err = h.check().expect_err("stale");
        assert!(
            err.contains("limit 0.1 s") || err.contains("limit 0.0 s") || err.contains("ago"),
            "{err}"
        );
    }

    #[test]
    fn health_says_why_while_syncs_fail_to_write() {
        let h = Health::new(Duration::from_secs(60));
        assert_eq!(
            h.check(),
            Err("no sync yet: waiting for the initial lists".to_string())
        );
        h.mark_failed(3);
        let err = h.check().expect_err("an incomplete sync is not a sync");
        assert!(err.contains("could not write 3 frontend(s)"), "{err}");
        h.mark_synced();
        assert!(h.check().is_ok());
    }

    /// After a first complete sync, a failed one is not a sync: the body says why at
    /// once (still 200 within the limit), and 503 with the same reason past the limit.
    #[test]
    fn health_says_why_when_syncs_fail_after_the_first_complete_one() {
        let h = Health::new(Duration::from_secs(3600));
        h.mark_synced();
        h.mark_failed(1);
        let ok = h.check().expect("within the limit");
        assert!(ok.contains("could not write 1 frontend(s)"), "{ok}");
        h.mark_synced();
        assert_eq!(h.check().map(|d| d.contains("could not")), Ok(false));

        let h = Health::new(Duration::from_millis(50));
        h.mark_synced();
        h.mark_failed(2);
        // Sleeps only past the limit: a lower bound, true under any load.
        std::thread::sleep(Duration::from_millis(80));
        h.mark_failed(2);
        let err = h
            .check()
            .expect_err("a failed sync does not refresh health");
        assert!(err.contains("last successful sync"), "{err}");
        assert!(err.contains("could not write 2 frontend(s)"), "{err}");
        h.mark_synced();
        assert!(h.check().is_ok());
    }

    #[test]
    fn health_is_503_while_the_node_is_being_deleted() {
        let h = Health::new(Duration::from_secs(60));
        h.mark_synced();
        h.set_node_deleting(true);
        assert_eq!(h.check(), Err("the node is being deleted".to_string()));
        h.set_node_deleting(false);
        assert!(h.check().is_ok());
    }

    #[test]
    fn metrics_render_with_kube_proxy_names() {
        let m = Metrics::new();
        m.sync_duration.observe(0.002);
        m.skipped(
            SkipKind::SERVICE,
            SkipReason::Object(&Skip::BadPort {
                name: "http".into(),
                port: 0,
            }),
        );
        m.frontends.set(3);
        let text = m.render();
        for name in [
            "ebpf_proxy_sync_proxy_rules_duration_seconds_bucket",
            "ebpf_proxy_network_programming_duration_seconds_count",
            "ebpf_proxy_objects_skipped_total{kind=\"Service\",reason=\"bad_port\"} 1",
            "ebpf_proxy_programmed_frontends 3",
        ] {
            assert!(text.contains(name), "{name} missing in:\n{text}");
        }
    }

    #[tokio::test]
    async fn http_endpoints_answer() {
        let m = Arc::new(Metrics::new());
        let h = Arc::new(Health::new(Duration::from_secs(60)));
        let addr = spawn(
            "127.0.0.1:0".parse().expect("addr"),
            Endpoints::Health,
            m.clone(),
            h.clone(),
        )
        .await
        .expect("bind");
        let get = |path: &'static str| async move {
            let mut s = tokio::net::TcpStream::connect(addr).await.expect("connect");
            s.write_all(format!("GET {path} HTTP/1.1\r\nHost: x\r\n\r\n").as_bytes())
                .await
                .expect("write");
            let mut out = String::new();
            s.read_to_string(&mut out).await.expect("read");
            out
        };
        assert!(get("/healthz").await.starts_with("HTTP/1.1 503"));
        assert!(get("/livez").await.starts_with("HTTP/1.1 200"));
        h.mark_synced();
        let ok = get("/healthz").await;
        assert!(
            ok.starts_with("HTTP/1.1 200") && ok.contains("ok: last successful sync"),
            "{ok}"
        );
        assert!(
            get("/metrics").await.starts_with("HTTP/1.1 404"),
            "metrics only on the metrics address"
        );
    }
}
