//! `--metrics-per-service`: connections and packets per Service port and per backend in
//! /metrics, read from `SVC_COUNTERS`/`BACKEND_COUNTERS` at each scrape and labelled with
//! what the writer assigned the ids to (set after every sync that wrote something).
//!
//! Series: `ebpf_proxy_service_{connections,packets}_total{namespace,service,port,protocol}`
//! (the frontends of one Service port, ClusterIP, NodePort, load-balancer and external
//! IPs of both families, summed) and `ebpf_proxy_backend_{connections,packets}_total
//! {backend,protocol}`. At most `--metrics-per-service-max-series` of them: Service ports
//! first, then backends, lowest ids first; what is left out is counted in
//! `ebpf_proxy_per_service_series_dropped` (a gauge: at the last scrape). The cost of a
//! scrape is one batch read of each map and a pass over the labels, bounded by the cap.

use std::{
    collections::HashMap,
    fmt::Write as _,
    net::SocketAddr,
    sync::{Arc, Mutex},
};

use proxy_common::FlowCounts;
use tracing::{info, warn};

use crate::{
    counters::{CounterKind, CounterMaps},
    model::Proto,
    pins::PinDir,
    writer::CountedIds,
};

/// After a sync that wrote something: the ids' labels from the writer.
pub fn relabel<S: crate::MapStore>(
    syncer: &super::sync::Syncer<S>,
    out: &super::sync::SyncOutcome,
) {
    if out.ops > 0 || out.full {
        if let Some(ps) = syncer.metrics().per_service.get() {
            ps.set_labels(syncer.writer().counted_ids());
        }
    }
}

/// The counters' maps, the series cap and the labels of the ids.
pub struct PerService {
    maps: CounterMaps,
    max_series: usize,
    labels: Mutex<Arc<CountedIds>>,
}

impl std::fmt::Debug for PerService {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PerService")
            .field("max_series", &self.max_series)
            .finish_non_exhaustive()
    }
}

/// Turns the datapath's counting on (`--metrics-per-service`) or off (the default; what
/// was counted is deleted) in `COUNTERS_ON` of `pins`; when on, the
/// reader the metrics serve (`Metrics::per_service`). Pins without the maps (an older
/// datapath still running) leave it off, with a warning. `max_series`: the
/// `--metrics-per-service-max-series` of `--metrics-per-service`, `None` when off.
pub fn start(pins: &PinDir, max_series: Option<usize>) -> Option<PerService> {
    let mut maps = match CounterMaps::open(pins) {
        Ok(Some(m)) => m,
        Ok(None) => {
            if max_series.is_some() {
                warn!("--metrics-per-service: the running datapath has no counter maps (an older build); not counted");
            }
            return None;
        }
        Err(e) => {
            warn!(error = %e, "opening the per-Service counters; not counted");
            return None;
        }
    };
    if let Err(e) = maps.set_on(max_series.is_some()) {
        warn!(error = %e, "writing COUNTERS_ON; per-Service counters left as they were");
        return None;
    }
    let max_series = max_series?;
    info!(max_series, "per-Service and per-backend counters on");
    Some(PerService {
        maps,
        max_series,
        labels: Mutex::new(Arc::default()),
    })
}

/// One Service port's label values.
#[derive(Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
struct ServicePort {
    namespace: String,
    service: String,
    port: String,
    protocol: Proto,
}

impl ServicePort {
    /// From the writer's name, `namespace/name[:port]` (another form: all of it in
    /// `service`).
    fn parse(name: &str, protocol: Proto) -> Self {
        let (ns_name, port) = name.split_once(':').unwrap_or((name, ""));
        let (namespace, service) = ns_name.split_once('/').unwrap_or(("", ns_name));
        Self {
            namespace: namespace.to_string(),
            service: service.to_string(),
            port: port.to_string(),
            protocol,
        }
    }
}

/// A label value in the exposition format.
fn escape(v: &str) -> String {
    v.replace('\\', "\\\\")
        .replace('"', "\\\"")
        .replace('\n', "\\n")
}

impl PerService {
    /// The ids' labels after a sync.
    pub fn set_labels(&self, ids: CountedIds) {
        *self.labels.lock().unwrap_or_else(|p| p.into_inner()) = Arc::new(ids);
    }

    fn read(&self, kind: CounterKind) -> HashMap<u32, FlowCounts> {
        match self.maps.read(kind) {
            Ok(v) => v.into_iter().collect(),
            Err(e) => {
                warn!(error = %e, "reading the per-Service counters");
                HashMap::new()
            }
        }
    }

    /// The rows to export: Service ports (their frontends summed, ordered by their lowest
    /// id), then backends by id, within the series cap; and the series left out.
    fn rows(&self) -> Rows {
        let labels = self
            .labels
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clone();
        let svc_counts = self.read(CounterKind::Service);
        let backend_counts = self.read(CounterKind::Backend);
        let mut ports: HashMap<ServicePort, (u32, FlowCounts)> = HashMap::new();
        for (id, name, proto) in &labels.services {
            let e = ports
                .entry(ServicePort::parse(name, *proto))
                .or_insert((*id, FlowCounts::default()));
            e.0 = e.0.min(*id);
            if let Some(c) = svc_counts.get(id) {
                e.1.conns += c.conns;
                e.1.packets += c.packets;
            }
        }
        let mut ports: Vec<_> = ports.into_iter().collect();
        ports.sort_by_key(|(_, (id, _))| *id);
        let mut backends: Vec<(u32, SocketAddr, Proto)> = labels.backends.clone();
        backends.sort_by_key(|(id, _, _)| *id);
        let budget = self.max_series / 2;
        let svc_kept = ports.len().min(budget);
        let backend_kept = backends.len().min(budget - svc_kept);
        let dropped = 2 * (ports.len() - svc_kept + backends.len() - backend_kept);
        ports.truncate(svc_kept);
        backends.truncate(backend_kept);
        Rows {
            services: ports.into_iter().map(|(p, (_, c))| (p, c)).collect(),
            backends: backends
                .into_iter()
                .map(|(id, addr, proto)| {
                    let c = backend_counts.get(&id).copied().unwrap_or_default();
                    (addr, proto, c)
                })
                .collect(),
            dropped,
        }
    }

    /// The families in the exposition format (OpenMetrics text, without `# EOF`).
    pub fn render(&self, out: &mut String) {
        let rows = self.rows();
        let svc_label = |p: &ServicePort| {
            format!(
                "namespace=\"{}\",service=\"{}\",port=\"{}\",protocol=\"{}\"",
                escape(&p.namespace),
                escape(&p.service),
                escape(&p.port),
                p.protocol
            )
        };
        let backend_label =
            |addr: &SocketAddr, proto: &Proto| format!("backend=\"{addr}\",protocol=\"{proto}\"");
        family(
            out,
            "ebpf_proxy_service_connections",
            "Backend selections per Service port: new flows at TC/XDP, connect() translations, UDP datagrams translated at sendmsg().",
            rows.services.iter().map(|(p, c)| (svc_label(p), c.conns)),
        );
        family(
            out,
            "ebpf_proxy_service_packets",
            "Packets to a Service port translated per packet (TC/XDP, the client's direction).",
            rows.services.iter().map(|(p, c)| (svc_label(p), c.packets)),
        );
        family(
            out,
            "ebpf_proxy_backend_connections",
            "Selections of a backend (as ebpf_proxy_service_connections).",
            rows.backends
                .iter()
                .map(|(a, p, c)| (backend_label(a, p), c.conns)),
        );
        family(
            out,
            "ebpf_proxy_backend_packets",
            "Packets sent to a backend, translated per packet (TC/XDP).",
            rows.backends
                .iter()
                .map(|(a, p, c)| (backend_label(a, p), c.packets)),
        );
        let _ = write!(
            out,
            "# HELP ebpf_proxy_per_service_series Series of --metrics-per-service in this exposition.\n\
             # TYPE ebpf_proxy_per_service_series gauge\n\
             ebpf_proxy_per_service_series {}\n\
             # HELP ebpf_proxy_per_service_series_dropped Series of --metrics-per-service left out at --metrics-per-service-max-series.\n\
             # TYPE ebpf_proxy_per_service_series_dropped gauge\n\
             ebpf_proxy_per_service_series_dropped {}\n",
            2 * (rows.services.len() + rows.backends.len()),
            rows.dropped
        );
    }
}

/// What one exposition holds.
struct Rows {
    services: Vec<(ServicePort, FlowCounts)>,
    backends: Vec<(SocketAddr, Proto, FlowCounts)>,
    /// Series left out at the cap.
    dropped: usize,
}

/// One counter family.
fn family(out: &mut String, name: &str, help: &str, samples: impl Iterator<Item = (String, u64)>) {
    let _ = writeln!(out, "# HELP {name} {help}\n# TYPE {name} counter");
    for (labels, v) in samples {
        let _ = writeln!(out, "{name}_total{{{labels}}} {v}");
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn service_port_names_split_into_labels() {
        assert_eq!(
            ServicePort::parse("default/web:http", Proto::Tcp),
            ServicePort {
                namespace: "default".into(),
                service: "web".into(),
                port: "http".into(),
                protocol: Proto::Tcp,
            }
        );
        let p = ServicePort::parse("kube-system/dns", Proto::Udp);
        assert_eq!(
            (p.namespace.as_str(), p.service.as_str(), p.port.as_str()),
            ("kube-system", "dns", "")
        );
        assert_eq!(escape("a\"b\\c"), "a\\\"b\\\\c");
    }
}
