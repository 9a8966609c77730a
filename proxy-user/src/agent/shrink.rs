//! The service-side maps shrunk online: a kind the writer grows (`SVC4/6`, `BACKEND4/6`,
//! `BACKEND_CONNS`, `REVNAT4/6`, `AFFINITY`, `MAGLEV`) whose entries in use (the backend
//! arrays: their highest id in use, plus one) stay under
//! `writer::SVC_LOW_WATER` (a quarter) of its size for [`SHRINK_AFTER`] is resized to the
//! power of two that holds them twice over, never below its floor (`loader::shrunk`);
//! every kind due then shrinks in ONE staged migration (`migrate::resize_maps`, as a
//! growth).
//!
//! It runs in the sync loop's task, between syncs and never while a sync is pending: no
//! write meets a map smaller than what it needs, and the writer's handles follow the new
//! maps before its next write. The use is the writer's own count of what it programmed
//! (the bounds `writer/demand.rs` grows by), read at every check ([`check_interval`]) and,
//! while a kind is under its mark, after every sync that wrote: a sync that takes it over
//! the mark (or a growth) restarts its hold.
//!
//! Why a hold of ten minutes: a shrink costs a migration (every entry copied, the
//! programs loaded twice, 0.5-1 s of one CPU), and a shrink followed by the growth it
//! undoes costs two; the service side changes in bursts (a rollout or a namespace deleted
//! and made again, a CI run that creates and removes hundreds of Services) that come back
//! within minutes. Ten minutes rides those out, and still gives a scaled-down node its
//! memory back soon (the buckets cost 16 B per entry of the size: 1 MiB per 65,536).

use std::{collections::BTreeMap, time::Duration, time::Instant};

use tracing::{info, warn};

use super::sync::Syncer;
use crate::{
    loader::{MapResize, SizedMap},
    store::{MapStore, StoreError},
    writer::Writer,
};

/// How long a kind's use must stay under `writer::SVC_LOW_WATER` before it is shrunk.
pub const SHRINK_AFTER: Duration = Duration::from_secs(600);
/// Test hook: the hold in milliseconds instead of [`SHRINK_AFTER`].
pub const SHRINK_AFTER_ENV: &str = "EBPF_PROXY_SERVICE_SHRINK_AFTER_MS";

/// The hold: [`SHRINK_AFTER_ENV`] when set (a test), else [`SHRINK_AFTER`].
pub fn shrink_after() -> Duration {
    std::env::var(SHRINK_AFTER_ENV)
        .ok()
        .and_then(|v| v.parse::<u64>().ok())
        .filter(|ms| *ms > 0)
        .map_or(SHRINK_AFTER, Duration::from_millis)
}

/// How often the use is checked: a tenth of the hold (a shrink comes at most that late),
/// between 100 ms and a minute.
pub fn check_interval(hold: Duration) -> Duration {
    (hold / 10).clamp(Duration::from_millis(100), Duration::from_secs(60))
}

/// What a check did.
#[derive(Debug)]
pub enum Shrink {
    /// Shrunk: the maps resized.
    Done(Vec<MapResize>),
    /// The resize failed (sizes kept; the hold starts again).
    Failed {
        to: Vec<(SizedMap, u32)>,
        error: StoreError,
    },
}

/// The low-water streaks of the kinds the writer grows.
#[derive(Debug)]
pub struct Shrinker {
    hold: Duration,
    /// Each kind under its mark: since when, at which size.
    under: BTreeMap<SizedMap, (Instant, u32)>,
}

impl Shrinker {
    pub fn new(hold: Duration) -> Self {
        Self {
            hold,
            under: BTreeMap::new(),
        }
    }

    /// After a sync that wrote: a kind no longer under its mark, or resized, loses its
    /// streak (nothing to count while no streak runs).
    pub fn after_sync<S: MapStore>(&mut self, writer: &Writer<S>) {
        if !self.under.is_empty() {
            self.observe(&writer.svc_shrinkable(), None);
        }
    }

    /// One check at `now`: streaks started and ended; with `may_shrink` (no sync
    /// pending), the kinds under their mark for the hold shrunk, all in one resize. A
    /// shrink, done or failed, restarts their hold.
    pub fn check<S: MapStore>(
        &mut self,
        writer: &mut Writer<S>,
        now: Instant,
        may_shrink: bool,
    ) -> Option<Shrink> {
        let shrinkable = writer.svc_shrinkable();
        self.observe(&shrinkable, Some(now));
        if !may_shrink {
            return None;
        }
        let due: Vec<(SizedMap, u32)> = shrinkable
            .iter()
            .filter(|(kind, _, _)| {
                self.under
                    .get(kind)
                    .is_some_and(|(since, _)| now.saturating_duration_since(*since) >= self.hold)
            })
            .map(|&(kind, _, to)| (kind, to))
            .collect();
        if due.is_empty() {
            return None;
        }
        for (kind, _) in &due {
            self.under.remove(kind);
        }
        Some(match writer.shrink_maps(&due) {
            Ok(resized) => Shrink::Done(resized),
            Err(error) => Shrink::Failed { to: due, error },
        })
    }

    /// The streaks after a count: ended for the kinds not in `shrinkable` or at another
    /// size; started at `now` (when given) for the others.
    fn observe(&mut self, shrinkable: &[(SizedMap, u32, u32)], now: Option<Instant>) {
        self.under
            .retain(|kind, (_, size)| shrinkable.iter().any(|(k, s, _)| k == kind && s == size));
        if let Some(now) = now {
            for &(kind, size, _) in shrinkable {
                self.under.entry(kind).or_insert((now, size));
            }
        }
    }
}

/// A check of the sync loop: between syncs, none pending. Logged and counted like a
/// growth (`ebpf_proxy_map_resizes_total{direction="shrink"}`,
/// `ebpf_proxy_service_map_entries`; a failure in
/// `ebpf_proxy_map_write_errors_total{reason="service_map_resize"}`).
pub(super) fn check<S: MapStore>(shrinker: &mut Shrinker, syncer: &mut Syncer<S>) {
    if !syncer.ready() {
        return; // the initial lists are not in: the maps are a previous agent's
    }
    let may_shrink = !syncer.pending();
    let hold = shrinker.hold;
    let Some(done) = shrinker.check(syncer.writer_mut(), Instant::now(), may_shrink) else {
        return;
    };
    let metrics = syncer.metrics().clone();
    match done {
        Shrink::Done(resized) => {
            let maps = service_maps_resized(&metrics, &resized);
            metrics.map_memory_changed.notify_one();
            info!(
                ?maps,
                hold_s = hold.as_secs_f64(),
                "service-side maps shrunk online (their use stayed under a quarter of their \
                 size for the hold)"
            );
        }
        Shrink::Failed { to, error } => {
            warn!(to = %crate::store::describe_sizes(&to), error = %error,
                "shrinking the service-side maps failed; kept their sizes");
            metrics.map_write_error("service_map_resize");
        }
    }
}

/// A resize of the service-side maps done (a growth before a sync, a shrink between
/// syncs): counted (`ebpf_proxy_map_resizes_total`), `ebpf_proxy_service_map_entries` set
/// to `SVC4`'s new size. Returns the maps as `NAME=from->to`, for the log line.
pub(super) fn service_maps_resized(
    metrics: &super::metrics::Metrics,
    resized: &[crate::loader::MapResize],
) -> Vec<String> {
    metrics.count_resizes(resized);
    if let Some(r) = resized
        .iter()
        .find(|r| r.map == proxy_common::map_names::SVC4)
    {
        metrics.service_map_entries.set(i64::from(r.to));
    }
    resized
        .iter()
        .map(|r| format!("{}={}->{}", r.map, r.from, r.to))
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{
        loader::Sizes,
        model::{Frontend, Proto, ServiceEntry},
        store::MemStore,
    };

    /// `n` Services of the same 25 endpoints (2 `SVC` entries each: the frontend's own,
    /// with slots 1..=24, and chunk 1 with slot 25; 25 backends in all; a frontend each).
    fn services(n: u32) -> Vec<ServiceEntry> {
        (0..n)
            .map(|i| {
                let vip = std::net::Ipv4Addr::from(0x0a60_0000 + i);
                let mut e = ServiceEntry::new(
                    Frontend::new(vip, 80, Proto::Tcp),
                    (0..25).map(|j| {
                        std::net::SocketAddr::from((
                            std::net::Ipv4Addr::from(0x0a80_0000 + j),
                            8080,
                        ))
                    }),
                );
                e.name = format!("default/s{i}:http");
                e
            })
            .collect()
    }

    fn writer() -> Writer<MemStore> {
        let store = MemStore {
            svc_capacity: Some(16_384),
            svc_growable: true,
            sizes: Sizes::floors(),
            ..MemStore::default()
        };
        let mut w = Writer::new(store);
        w.set_svc_ceiling(1 << 20);
        w
    }

    #[test]
    fn kinds_long_under_a_quarter_shrink_together_after_the_hold_and_not_before() {
        let hold = Duration::from_secs(600);
        let mut w = writer();
        let mut s = Shrinker::new(hold);
        let t0 = Instant::now();
        // 10,000 Services: SVC 20,000 entries (grown to 32,768), REVNAT 10,000 (grown to
        // 16,384), the backends 25 (at their floor).
        let many = services(10_000);
        let r = w.sync(many.clone());
        assert!(r.errors.is_empty(), "{:?}", r.errors);
        let sizes = |w: &Writer<MemStore>| w.store().map_sizes().expect("sized");
        assert_eq!(sizes(&w).get(SizedMap::Service), 32_768);
        assert_eq!(sizes(&w).get(SizedMap::RevNat), 16_384);
        // In use over a quarter: nothing shrinks, however long.
        for h in 0..5 {
            assert!(s.check(&mut w, t0 + hold * h, true).is_none());
        }
        // Down to 3,000 Services (6,000 SVC entries: 18 %; 3,000 frontends: 18 %).
        let r = w.sync(many[..3_000].to_vec());
        assert!(r.errors.is_empty());
        s.after_sync(&w);
        let t1 = t0 + hold * 5;
        assert!(s.check(&mut w, t1, true).is_none(), "the hold starts");
        assert!(s.check(&mut w, t1 + hold / 2, true).is_none());
        // Not while a sync is pending, even past the hold.
        assert!(s.check(&mut w, t1 + hold, false).is_none());
        // A sync that takes a kind back over its mark restarts its hold.
        let r = w.sync(many[..6_000].to_vec());
        assert!(r.errors.is_empty());
        s.after_sync(&w);
        let r = w.sync(many[..3_000].to_vec());
        assert!(r.errors.is_empty());
        s.after_sync(&w);
        let t2 = t1 + hold + Duration::from_secs(1);
        assert!(s.check(&mut w, t2, true).is_none(), "the hold restarted");
        assert!(s
            .check(&mut w, t2 + hold - Duration::from_secs(1), true)
            .is_none());
        let Some(Shrink::Done(resized)) = s.check(&mut w, t2 + hold, true) else {
            panic!("no shrink after the hold");
        };
        // Both kinds in one resize: SVC to 16,384 (its floor; 2 x 6,000 fit), REVNAT to
        // 8,192 (2 x 3,000 = 6,000 -> 8,192), nothing else (the backends at their floor).
        assert_eq!(
            w.store().grown.last().expect("resized"),
            &vec![(SizedMap::Service, 16_384), (SizedMap::RevNat, 8_192)]
        );
        assert_eq!(resized.len(), 2);
        assert_eq!(sizes(&w).get(SizedMap::Service), 16_384);
        // Right after: under the growth mark and over the low-water one (no oscillation).
        assert!(w.svc_shrinkable().is_empty(), "{:?}", w.svc_shrinkable());
        for h in 2..6 {
            assert!(s.check(&mut w, t2 + hold * h, true).is_none());
        }
        // Everything written stays whole.
        assert_eq!(w.frontend_count(), 3_000);
        let grown_before = w.store().grown.len();
        let r = w.sync(many[..3_001].to_vec());
        assert!(r.errors.is_empty());
        assert_eq!(w.store().grown.len(), grown_before, "no growth at 3,001");
    }
}
