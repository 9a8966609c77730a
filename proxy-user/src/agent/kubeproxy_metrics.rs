//! kube-proxy's own metrics, under kube-proxy's names, types, labels and buckets
//! (`pkg/proxy/metrics/metrics.go` and the v1.34 metrics reference), so that its
//! dashboards, alerts and the network-programming SLI read this agent unchanged. The
//! agent's own metrics stay under `ebpf_proxy_` (`agent::metrics`).
//!
//! Meanings here:
//! - a *sync* is one write of the maps ([`Syncer::sync`](super::sync::Syncer::sync)):
//!   `full` is the periodic or relist re-diff, `partial` one of dirty Services only;
//! - `ip_family` is each family the node has addresses in (set at start), as kube-proxy's
//!   dual-stack proxier observes each family's sync;
//! - network programming: from the EndpointSlice's
//!   `endpoints.kubernetes.io/last-change-trigger-time` to the maps written.

use std::time::{SystemTime, UNIX_EPOCH};

use prometheus_client::{
    encoding::EncodeLabelSet,
    metrics::{
        counter::Counter,
        family::Family,
        gauge::Gauge,
        histogram::{exponential_buckets, Histogram},
    },
    registry::Registry,
};

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct IpFamily {
    pub ip_family: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct Code {
    pub code: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct TrafficPolicy {
    pub ip_family: String,
    pub traffic_policy: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct Field {
    pub field: String,
}

/// `ExponentialBuckets(0.001, 2, 15)`: the sync histograms.
pub fn sync_buckets() -> Vec<f64> {
    exponential_buckets(0.001, 2.0, 15).collect()
}

/// `MergeBuckets(LinearBuckets(0.25, 0.25, 2), LinearBuckets(1, 1, 59),
/// LinearBuckets(60, 5, 12), LinearBuckets(120, 30, 7))`, with the leading 0 that
/// component-base's `MergeBuckets` starts from.
pub fn network_programming_buckets() -> Vec<f64> {
    let mut b = vec![0.0, 0.25, 0.5];
    b.extend((1..=59).map(f64::from));
    b.extend((0..12).map(|i| 60.0 + 5.0 * f64::from(i)));
    b.extend((0..7).map(|i| 120.0 + 30.0 * f64::from(i)));
    b
}

/// The kube-proxy metrics the agent keeps.
#[derive(Clone)]
pub struct KubeProxyMetrics {
    families: Vec<&'static str>,
    pub sync_rules: Family<IpFamily, Histogram, fn() -> Histogram>,
    pub sync_full: Family<IpFamily, Histogram, fn() -> Histogram>,
    pub sync_partial: Family<IpFamily, Histogram, fn() -> Histogram>,
    pub network_programming: Family<IpFamily, Histogram, fn() -> Histogram>,
    pub last_timestamp: Family<IpFamily, Gauge<f64, std::sync::atomic::AtomicU64>>,
    pub last_queued_timestamp: Family<IpFamily, Gauge<f64, std::sync::atomic::AtomicU64>>,
    pub endpoint_changes_pending: Gauge,
    pub endpoint_changes_total: Counter,
    pub service_changes_pending: Gauge,
    pub service_changes_total: Counter,
    pub no_local_endpoints: Family<TrafficPolicy, Gauge>,
    pub healthz_total: Family<Code, Counter>,
    pub livez_total: Family<Code, Counter>,
    pub config_fields_ignored: Family<Field, Gauge>,
    /// UDP flows whose Service port or endpoint went, deleted from the conntrack tables.
    pub conntrack_deleted: Family<IpFamily, Counter>,
    pub conntrack_reconcile: Family<IpFamily, Histogram, fn() -> Histogram>,
}

fn new_sync_histogram() -> Histogram {
    Histogram::new(sync_buckets())
}

fn new_np_histogram() -> Histogram {
    Histogram::new(network_programming_buckets())
}

impl Default for KubeProxyMetrics {
    fn default() -> Self {
        Self {
            families: vec!["IPv4"],
            sync_rules: Family::new_with_constructor(new_sync_histogram),
            sync_full: Family::new_with_constructor(new_sync_histogram),
            sync_partial: Family::new_with_constructor(new_sync_histogram),
            network_programming: Family::new_with_constructor(new_np_histogram),
            last_timestamp: Family::default(),
            last_queued_timestamp: Family::default(),
            endpoint_changes_pending: Gauge::default(),
            endpoint_changes_total: Counter::default(),
            service_changes_pending: Gauge::default(),
            service_changes_total: Counter::default(),
            no_local_endpoints: Family::default(),
            healthz_total: Family::default(),
            livez_total: Family::default(),
            config_fields_ignored: Family::default(),
            conntrack_deleted: Family::default(),
            conntrack_reconcile: Family::new_with_constructor(new_sync_histogram),
        }
    }
}

fn now_unix() -> f64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap_or_default()
        .as_secs_f64()
}

impl KubeProxyMetrics {
    /// Registers every metric at the root of `registry` (no prefix).
    // Long: a table, one registration per metric with kube-proxy's name and help text.
    pub fn register(&self, registry: &mut Registry) {
        registry.register(
            "kubeproxy_sync_proxy_rules_duration_seconds",
            "SyncProxyRules latency in seconds",
            self.sync_rules.clone(),
        );
        registry.register(
            "kubeproxy_sync_full_proxy_rules_duration_seconds",
            "SyncProxyRules latency in seconds for full resyncs",
            self.sync_full.clone(),
        );
        registry.register(
            "kubeproxy_sync_partial_proxy_rules_duration_seconds",
            "SyncProxyRules latency in seconds for partial resyncs",
            self.sync_partial.clone(),
        );
        registry.register(
            "kubeproxy_network_programming_duration_seconds",
            "In Cluster Network Programming Latency in seconds",
            self.network_programming.clone(),
        );
        registry.register(
            "kubeproxy_sync_proxy_rules_last_timestamp_seconds",
            "The last time proxy rules were successfully synced",
            self.last_timestamp.clone(),
        );
        registry.register(
            "kubeproxy_sync_proxy_rules_last_queued_timestamp_seconds",
            "The last time a sync of proxy rules was queued",
            self.last_queued_timestamp.clone(),
        );
        registry.register(
            "kubeproxy_sync_proxy_rules_endpoint_changes_pending",
            "Pending proxy rules Endpoint changes",
            self.endpoint_changes_pending.clone(),
        );
        registry.register(
            "kubeproxy_sync_proxy_rules_endpoint_changes",
            "Cumulative proxy rules Endpoint changes",
            self.endpoint_changes_total.clone(),
        );
        registry.register(
            "kubeproxy_sync_proxy_rules_service_changes_pending",
            "Pending proxy rules Service changes",
            self.service_changes_pending.clone(),
        );
        registry.register(
            "kubeproxy_sync_proxy_rules_service_changes",
            "Cumulative proxy rules Service changes",
            self.service_changes_total.clone(),
        );
        registry.register(
            "kubeproxy_sync_proxy_rules_no_local_endpoints_total",
            "Number of services with a Local traffic policy and no endpoints",
            self.no_local_endpoints.clone(),
        );
        registry.register(
            "kubeproxy_proxy_healthz",
            "Cumulative proxy healthz HTTP status",
            self.healthz_total.clone(),
        );
        registry.register(
            "kubeproxy_proxy_livez",
            "Cumulative proxy livez HTTP status",
            self.livez_total.clone(),
        );
        registry.register(
            "kubeproxy_conntrack_reconciler_deleted_entries",
            "Cumulative conntrack flows deleted by conntrack reconciler",
            self.conntrack_deleted.clone(),
        );
        registry.register(
            "kubeproxy_conntrack_reconciler_sync_duration_seconds",
            "ReconcileConntrackFlowsLatency latency in seconds",
            self.conntrack_reconcile.clone(),
        );
        registry.register(
            "ebpf_proxy_config_fields_ignored",
            "kube-proxy settings (--config fields, kube-proxy flags) set but not applied, \
             by field (1 each; the reason is in the start log)",
            self.config_fields_ignored.clone(),
        );
    }

    /// The families the node serves (`IPv4`, `IPv6`), from its addresses.
    pub fn set_families(&mut self, v4: bool, v6: bool) {
        self.families.clear();
        if v4 || !v6 {
            self.families.push("IPv4");
        }
        if v6 {
            self.families.push("IPv6");
        }
    }

    fn each_family(&self) -> impl Iterator<Item = IpFamily> + '_ {
        self.families.iter().map(|f| IpFamily {
            ip_family: f.to_string(),
        })
    }

    /// A change was queued (a Service or EndpointSlice event).
    pub fn queued(&self, service: bool) {
        if service {
            self.service_changes_total.inc();
            self.service_changes_pending.inc();
        } else {
            self.endpoint_changes_total.inc();
            self.endpoint_changes_pending.inc();
        }
        let now = now_unix();
        for f in self.each_family() {
            self.last_queued_timestamp.get_or_create(&f).set(now);
        }
    }

    /// One cleanup of stale UDP flows (`agent::ct_cleanup`) in `family` took `seconds`
    /// and deleted `flows`.
    pub fn conntrack_reconciled(&self, family: &str, seconds: f64, flows: u64) {
        let f = IpFamily {
            ip_family: family.to_string(),
        };
        self.conntrack_reconcile.get_or_create(&f).observe(seconds);
        self.conntrack_deleted.get_or_create(&f).inc_by(flows);
    }

    /// One sync took `seconds`; `ok`: everything was written.
    pub fn synced(&self, full: bool, seconds: f64, ok: bool) {
        let now = now_unix();
        for f in self.each_family() {
            self.sync_rules.get_or_create(&f).observe(seconds);
            if full {
                self.sync_full.get_or_create(&f).observe(seconds);
            } else {
                self.sync_partial.get_or_create(&f).observe(seconds);
            }
            if ok {
                self.last_timestamp.get_or_create(&f).set(now);
            }
        }
        self.endpoint_changes_pending.set(0);
        self.service_changes_pending.set(0);
    }

    /// After a sync: Services with a Local policy and no local endpoint.
    pub fn set_no_local(&self, n: crate::cluster::index::NoLocalEndpoints) {
        for (i, family) in ["IPv4", "IPv6"].into_iter().enumerate() {
            if !self.families.contains(&family) {
                continue;
            }
            for (policy, count) in [("internal", n.internal[i]), ("external", n.external[i])] {
                self.no_local_endpoints
                    .get_or_create(&TrafficPolicy {
                        ip_family: family.into(),
                        traffic_policy: policy.into(),
                    })
                    .set(count);
            }
        }
    }

    /// The network programming latency of a change triggered at `trigger` (wall clock,
    /// the EndpointSlice's annotation), programmed now, for a slice of `family`.
    pub fn programmed(&self, trigger: SystemTime, family: &str) {
        let secs = SystemTime::now()
            .duration_since(trigger)
            .unwrap_or_default()
            .as_secs_f64();
        self.network_programming
            .get_or_create(&IpFamily {
                ip_family: family.into(),
            })
            .observe(secs);
    }

    /// A /healthz (`livez`: false) or /livez answer with HTTP `code`.
    pub fn probe(&self, livez: bool, code: u16) {
        let label = Code {
            code: code.to_string(),
        };
        if livez {
            self.livez_total.get_or_create(&label).inc();
        } else {
            self.healthz_total.get_or_create(&label).inc();
        }
    }

    /// The kube-proxy settings not applied (`AgentOptions::config_fields_ignored`).
    pub fn set_ignored(&self, fields: &[String]) {
        for f in fields {
            self.config_fields_ignored
                .get_or_create(&Field { field: f.clone() })
                .set(1);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::agent::metrics::Metrics;

    /// kube-proxy's metrics the agent exports: name, type, label names, buckets. From the
    /// Kubernetes v1.34 metrics reference (names, types, labels) and
    /// `pkg/proxy/metrics/metrics.go` (buckets).
    /// Name, type, label names, bucket layout.
    type Expected = (
        &'static str,
        &'static str,
        &'static [&'static str],
        Option<fn() -> Vec<f64>>,
    );
    const KUBE_PROXY: &[Expected] = &[
        (
            "kubeproxy_sync_proxy_rules_duration_seconds",
            "histogram",
            &["ip_family"],
            Some(sync_buckets),
        ),
        (
            "kubeproxy_sync_full_proxy_rules_duration_seconds",
            "histogram",
            &["ip_family"],
            Some(sync_buckets),
        ),
        (
            "kubeproxy_sync_partial_proxy_rules_duration_seconds",
            "histogram",
            &["ip_family"],
            Some(sync_buckets),
        ),
        (
            "kubeproxy_network_programming_duration_seconds",
            "histogram",
            &["ip_family"],
            Some(network_programming_buckets),
        ),
        (
            "kubeproxy_sync_proxy_rules_last_timestamp_seconds",
            "gauge",
            &["ip_family"],
            None,
        ),
        (
            "kubeproxy_sync_proxy_rules_last_queued_timestamp_seconds",
            "gauge",
            &["ip_family"],
            None,
        ),
        (
            "kubeproxy_sync_proxy_rules_endpoint_changes_pending",
            "gauge",
            &[],
            None,
        ),
        (
            "kubeproxy_sync_proxy_rules_endpoint_changes_total",
            "counter",
            &[],
            None,
        ),
        (
            "kubeproxy_sync_proxy_rules_service_changes_pending",
            "gauge",
            &[],
            None,
        ),
        (
            "kubeproxy_sync_proxy_rules_service_changes_total",
            "counter",
            &[],
            None,
        ),
        (
            "kubeproxy_sync_proxy_rules_no_local_endpoints_total",
            "gauge",
            &["ip_family", "traffic_policy"],
            None,
        ),
        ("kubeproxy_proxy_healthz_total", "counter", &["code"], None),
        ("kubeproxy_proxy_livez_total", "counter", &["code"], None),
        // client-go's (component-base metrics/prometheus/restclient), as kube-proxy serves it.
        (
            "rest_client_requests_total",
            "counter",
            &["code", "method", "host"],
            None,
        ),
    ];

    /// Label names of a sample line (`name{a="x",b="y"} 1`), `le` left out.
    fn label_names(line: &str) -> Vec<String> {
        let Some(open) = line.find('{') else {
            return Vec::new();
        };
        let close = line.rfind('}').expect("a closing brace");
        line[open + 1..close]
            .split(',')
            .filter_map(|kv| kv.split('=').next())
            .filter(|k| *k != "le")
            .map(str::to_string)
            .collect()
    }

    #[test]
    fn every_kube_proxy_metric_has_kube_proxys_name_type_labels_and_buckets() {
        let mut m = Metrics::new();
        m.kube_proxy.set_families(true, true);
        let k = &m.kube_proxy;
        k.queued(true);
        k.queued(false);
        k.synced(true, 0.003, true);
        k.queued(false);
        k.synced(false, 0.0005, true);
        k.programmed(
            SystemTime::now() - std::time::Duration::from_millis(1500),
            "IPv4",
        );
        k.probe(false, 503);
        k.probe(true, 200);
        m.source.rest_request("GET", "10.96.0.1:443", Some(200));
        k.set_no_local(crate::cluster::index::NoLocalEndpoints {
            internal: [1, 0],
            external: [0, 2],
        });
        let text = m.render();
        for (name, kind, labels, buckets) in KUBE_PROXY {
            // OpenMetrics names a counter's family without `_total`.
            let family = if *kind == "counter" {
                name.strip_suffix("_total")
                    .expect("a counter ends in _total")
            } else {
                name
            };
            assert!(
                text.contains(&format!("# TYPE {family} {kind}\n")),
                "{name}: no `# TYPE {family} {kind}` in\n{text}"
            );
            let sample = if *kind == "histogram" {
                format!("{name}_bucket")
            } else {
                name.to_string()
            };
            let lines: Vec<&str> = text
                .lines()
                .filter(|l| {
                    l.starts_with(&format!("{sample}{{")) || l.starts_with(&format!("{sample} "))
                })
                .collect();
            assert!(!lines.is_empty(), "{name}: no sample in\n{text}");
            for l in &lines {
                assert_eq!(label_names(l), *labels, "{name}: labels of {l}");
            }
            if let Some(b) = buckets {
                // One series: the labels after `le` (and the value) as in the first line.
                let rest = |l: &str| {
                    let after = l.split("le=\"").nth(1).unwrap_or("");
                    let after = after.split_once('"').map_or("", |x| x.1);
                    after.split('}').next().unwrap_or("").to_string()
                };
                let series = rest(lines[0]);
                let les: Vec<f64> = lines
                    .iter()
                    .filter(|l| rest(l) == series)
                    .filter_map(|l| l.split("le=\"").nth(1)?.split('"').next())
                    .filter(|v| *v != "+Inf")
                    .map(|v| v.parse().expect("a bucket bound"))
                    .collect();
                assert_eq!(les, b(), "{name}: bucket layout");
            }
        }
        // What happened above, as kube-proxy counts it.
        for want in [
            "kubeproxy_proxy_healthz_total{code=\"503\"} 1",
            "kubeproxy_proxy_livez_total{code=\"200\"} 1",
            "kubeproxy_sync_proxy_rules_endpoint_changes_total 2",
            "kubeproxy_sync_proxy_rules_no_local_endpoints_total{ip_family=\"IPv4\",traffic_policy=\"internal\"} 1",
            "kubeproxy_sync_proxy_rules_no_local_endpoints_total{ip_family=\"IPv6\",traffic_policy=\"external\"} 2",
            "kubeproxy_sync_proxy_rules_service_changes_total 1",
            "kubeproxy_sync_proxy_rules_endpoint_changes_pending 0",
            "kubeproxy_sync_full_proxy_rules_duration_seconds_count{ip_family=\"IPv6\"} 1",
            "kubeproxy_sync_partial_proxy_rules_duration_seconds_count{ip_family=\"IPv4\"} 1",
            "kubeproxy_sync_proxy_rules_duration_seconds_count{ip_family=\"IPv4\"} 2",
            "kubeproxy_network_programming_duration_seconds_bucket{le=\"1.0\",ip_family=\"IPv4\"} 0",
            "kubeproxy_network_programming_duration_seconds_bucket{le=\"2.0\",ip_family=\"IPv4\"} 1",
        ] {
            assert!(text.contains(want), "{want} missing in\n{text}");
        }
        // Ours stay under ebpf_proxy_.
        assert!(text.contains("ebpf_proxy_sync_proxy_rules_duration_seconds_bucket"));
    }

    #[test]
    fn bucket_layouts_are_kube_proxys() {
        let s = sync_buckets();
        assert_eq!(s.len(), 15);
        assert_eq!(s[0], 0.001);
        assert_eq!(s[14], 16.384);
        let n = network_programming_buckets();
        assert_eq!(n.len(), 1 + 2 + 59 + 12 + 7);
        assert_eq!(&n[..4], &[0.0, 0.25, 0.5, 1.0]);
        assert_eq!(n[61], 59.0);
        assert_eq!(n[62], 60.0);
        assert_eq!(n[73], 115.0);
        assert_eq!(*n.last().expect("ok"), 300.0);
    }
}
