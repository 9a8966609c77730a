//! The agent's conntrack cleanup, where kube-proxy flushes conntrack (upstream
//! `pkg/proxy/conntrack`): the UDP flows of an endpoint that left a Service port, and of a
//! Service port (a frontend) that was removed, are deleted from `CT4`/`CT6` after the sync
//! that removed them, so their next packet is balanced afresh instead of following the old
//! entry. TCP flows are left alone (a removed endpoint may still be draining them), as
//! kube-proxy does.
//!
//! After every sync that wrote something, the writer's `(service id, backend address)`
//! pairs of UDP frontends ([`crate::Writer::udp_slots`]) are compared with the previous
//! ones; the entries naming a pair that went (an original-direction entry by its DNAT
//! target, a reply entry by its source) are deleted by `ctl::ct_delete::delete_where` (the
//! deletion of `proxyctl conntrack delete`) on the blocking pool, never on the async
//! runtime. Counted in kube-proxy's `kubeproxy_conntrack_reconciler_deleted_entries_total`
//! (flows, per family) and `kubeproxy_conntrack_reconciler_sync_duration_seconds`.
//!
//! A pair that went while no agent ran is not known to the next one (it starts from the
//! pairs of its first sync): those flows are still found by the datapath's own check
//! (`BACKEND_GEN`: a UDP flow whose backend is gone is balanced afresh on its next packet).

use std::{
    collections::{HashMap, HashSet},
    net::SocketAddr,
    sync::Arc,
    time::Instant,
};

use proxy_common::proto;
use tracing::{info, warn};

use super::{
    metrics::Metrics,
    sync::{SyncOutcome, Syncer},
};
use crate::{
    ctl::{ct_delete, snapshot::CtEntry},
    pins::PinDir,
    store::MapStore,
};

/// The UDP frontends' `(service id, backend)` pairs as of the last sync.
#[derive(Debug)]
pub struct StaleUdp {
    pins: PinDir,
    current: HashSet<(u32, SocketAddr)>,
}

impl StaleUdp {
    pub fn new(pins: PinDir) -> Self {
        Self {
            pins,
            current: HashSet::new(),
        }
    }

    /// After a sync: deletes the UDP flows of the pairs that went, off the runtime.
    pub fn after_sync<S: MapStore>(&mut self, syncer: &Syncer<S>, out: &SyncOutcome) {
        if out.ops == 0 && !out.full {
            return;
        }
        let now = syncer.writer().udp_slots();
        let gone: HashSet<(u32, SocketAddr)> = self.current.difference(&now).copied().collect();
        self.current = now;
        if gone.is_empty() {
            return;
        }
        let (pins, metrics) = (self.pins.clone(), syncer.metrics().clone());
        tokio::task::spawn_blocking(move || delete_stale(&pins, &gone, &metrics));
    }
}

/// Whether `e` is an entry of a UDP flow of one of the pairs `gone`.
fn is_stale(e: &CtEntry, gone: &HashSet<(u32, SocketAddr)>) -> bool {
    let backend = if e.dir == 0 {
        e.dnat.unwrap_or(e.dst)
    } else {
        e.src
    };
    e.proto == proto::UDP && gone.contains(&(e.service_id, backend))
}

/// Flows among deleted entries: each original-direction entry, and each reply entry whose
/// original was not among them.
fn flows(entries: &[CtEntry]) -> u64 {
    let originals: HashSet<_> = entries
        .iter()
        .filter(|e| e.dir == 0)
        .map(|e| (e.proto, e.src, e.dst))
        .collect();
    let orphans = entries
        .iter()
        .filter(|e| e.dir == 1 && !originals.contains(&e.reply_key()))
        .count();
    (originals.len() + orphans) as u64
}

fn delete_stale(pins: &PinDir, gone: &HashSet<(u32, SocketAddr)>, metrics: &Arc<Metrics>) {
    let t = Instant::now();
    match ct_delete::delete_where(pins, true, |e| is_stale(e, gone)) {
        Ok([v4, v6]) => {
            let seconds = t.elapsed().as_secs_f64();
            let mut by_family = HashMap::new();
            for (family, entries) in [("IPv4", &v4), ("IPv6", &v6)] {
                let n = flows(entries);
                metrics.kube_proxy.conntrack_reconciled(family, seconds, n);
                by_family.insert(family, n);
            }
            info!(pairs = gone.len(), flows = ?by_family, entries = v4.len() + v6.len(),
                  "conntrack entries of removed UDP endpoints and Service ports deleted");
        }
        Err(e) => warn!(error = %e, "deleting the conntrack entries of removed UDP endpoints"),
    }
}
