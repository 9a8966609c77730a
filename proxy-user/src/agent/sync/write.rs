//! The sync and its write path: which frontends the dirty Services (or all, on a full
//! re-diff) claim, each frontend's owner (`cluster::conflicts`), removals then upserts in
//! write order through the [`Writer`](crate::writer::Writer), and what failed or was
//! refused, reported once and retried or skipped.

use std::{collections::BTreeSet, time::Instant};

use tracing::{debug, info, warn};

use super::syncer::{SyncOutcome, Syncer};
use crate::{
    agent::metrics::ReasonLabel,
    cluster::{
        conflicts::{write_order, Rank},
        objects::ObjKey,
        skips::{SkipKind, SkipReason},
    },
    fasthash::{HashMap, HashSet},
    model::{Frontend, ServiceEntry},
    store::MapStore,
    writer::{SvcGrowth, WriteError},
};

impl<S: MapStore> Syncer<S> {
    /// Writes what is pending. Call when [`Self::ready`] and [`Self::pending`].
    pub fn sync(&mut self, now: Instant) -> SyncOutcome {
        match self.prepare(now) {
            Some(p) => self.sync_prepared(p, now),
            None => SyncOutcome::default(),
        }
    }

    /// The first half of [`Self::sync`]: which Services it covers, each frontend's owner
    /// (the claims), the removals and upserts in write order, nothing written (`None`:
    /// not [`Self::ready`]). A fresh node builds it while its maps are made
    /// (`agent::start`); [`Self::sync_prepared`] writes it, or [`Self::requeue`] puts it
    /// back.
    pub fn prepare(&mut self, now: Instant) -> Option<Prepared> {
        if !self.ready() {
            return None;
        }
        let start = Instant::now();
        let flags = (self.nodes_changed, self.service_cidrs_changed);
        self.nodes_changed = false;
        self.service_cidrs_changed = false;
        let full = self.full_due.is_some();
        let keys: Vec<(ObjKey, Instant)> = if full {
            let since = self.full_due.take().unwrap_or(now);
            self.full_keys(since)
        } else {
            let mut keys: Vec<_> = self.dirty.drain().collect();
            keys.sort();
            keys
        };
        if full {
            self.report_orphans();
        }
        let desired = self.desired(&keys, full);
        Some(Prepared {
            start,
            full,
            flags,
            keys,
            desired,
        })
    }

    /// A prepared sync not written: its Services dirty again (their times kept), a full
    /// re-diff due again if it was one (which builds the claims afresh).
    pub fn requeue(&mut self, p: Prepared) {
        if p.full {
            let since = p
                .keys
                .iter()
                .map(|(_, t)| *t)
                .min()
                .unwrap_or_else(Instant::now);
            self.full_due.get_or_insert(since);
        }
        for (key, t) in p.keys {
            self.dirty.entry(key).or_insert(t);
        }
        self.nodes_changed |= p.flags.0;
        self.service_cidrs_changed |= p.flags.1;
    }

    /// The second half of [`Self::sync`]: writes a prepared sync (nothing else may have
    /// changed the syncer or its writer since [`Self::prepare`]), then what failed or was
    /// refused, the triggers and the metrics.
    // Long: one sync's steps in the order the module doc gives (write, refused, triggers,
    // metrics); each is a few lines over the same outcome.
    pub fn sync_prepared(&mut self, p: Prepared, now: Instant) -> SyncOutcome {
        let Prepared {
            start,
            full,
            keys,
            desired,
            ..
        } = p;
        let mut outcome = SyncOutcome {
            ran: true,
            full,
            ..SyncOutcome::default()
        };
        self.write(desired, now, &mut outcome);
        self.synced_once = true;

        let done = Instant::now();
        for (key, since) in &keys {
            if !self.dirty.contains_key(key) {
                self.metrics
                    .network_programming
                    .observe(done.saturating_duration_since(*since).as_secs_f64());
                // kube-proxy's SLI: from each change's trigger time to programmed.
                for (t, family) in self.triggers.remove(key).into_iter().flatten() {
                    let family = match family {
                        crate::model::Family::V4 => "IPv4",
                        crate::model::Family::V6 => "IPv6",
                    };
                    self.metrics.kube_proxy.programmed(t, family);
                }
            }
        }
        if full {
            // Trigger times of Services that are gone or never written (an orphan
            // slice's) are dropped, not kept for ever.
            let dirty = &self.dirty;
            self.triggers.retain(|k, _| dirty.contains_key(k));
        }
        self.metrics
            .sync_duration
            .observe(done.duration_since(start).as_secs_f64());
        self.metrics
            .kube_proxy
            .set_no_local(self.index.no_local_endpoints());
        self.metrics.kube_proxy.synced(
            full,
            done.duration_since(start).as_secs_f64(),
            outcome.failed == 0,
        );
        self.metrics
            .frontends
            .set(self.writer.frontend_count() as i64);
        self.metrics
            .backends
            .set(self.writer.backend_count() as i64);
        if outcome.failed == 0 {
            self.metrics.mark_synced();
        }
        if outcome.ops > 0 {
            // Maps without preallocation grew (or were grown): memory read again.
            self.metrics.map_memory_changed.notify_one();
        }
        debug!(
            full,
            services = keys.len(),
            ops = outcome.ops,
            failed = outcome.failed,
            took_ms = done.duration_since(start).as_secs_f64() * 1e3,
            "sync"
        );
        outcome
    }

    /// A full re-diff's keys: every Service, the held ones, and the dirty ones (their own
    /// time wins over `since`), sorted, one per key. The index's keys come sorted and
    /// unique: taken in their order with their dirty time; only the few others (held
    /// Services, dirty Services no longer in the index) make a sort (a first sync
    /// sorted 100,000 keys, every Service dirty, at 50,000).
    fn full_keys(&mut self, since: Instant) -> Vec<(ObjKey, Instant)> {
        let dirty = &mut self.dirty;
        let mut all: Vec<(ObjKey, Instant)> = self
            .index
            .service_keys()
            .map(|k| (k.clone(), dirty.remove(k).unwrap_or(since)))
            .collect();
        let mut others: Vec<(ObjKey, Instant)> = self
            .held
            .keys()
            .filter(|k| !self.index.has_service(k))
            .map(|k| (k.clone(), self.dirty.remove(k).unwrap_or(since)))
            .collect();
        others.extend(self.dirty.drain());
        if !others.is_empty() {
            all.extend(others);
            all.sort_by(|a, b| a.0.cmp(&b.0));
        }
        all
    }

    /// What the frontends `keys` claim or claimed need (`full`: every frontend, removing
    /// what nobody claims, pinned leftovers of a previous agent included). Each frontend
    /// gets its owner's entry (`cluster::conflicts`): a change of owner is one rewrite
    /// of the frontend, never a removal followed by an insert.
    // Long: one pass over the claimed frontends: owner, entry, write or remove, and its
    // bookkeeping share the loop's state.
    fn desired(&mut self, keys: &[(ObjKey, Instant)], full: bool) -> Desired {
        let started = Instant::now();
        let mut entries: HashMap<ObjKey, Vec<ServiceEntry>> =
            HashMap::with_capacity_and_hasher(keys.len(), Default::default());
        // A fresh node's entries, computed to size its maps, nothing changed since.
        let mut prepared = self.prepared.take().unwrap_or_default();
        // Gathered, then sorted once (a tree built frontend by frontend cost more).
        let mut touched: Vec<Frontend> = Vec::new();
        if full {
            self.claims.clear();
            touched.extend(self.writer.frontends().copied());
        }
        for (key, _) in keys {
            let (es, fes): (Vec<ServiceEntry>, BTreeSet<Frontend>) = match self.held.get(key) {
                // Held: claims what the pinned maps hold for it, writes nothing.
                Some(h) => (Vec::new(), h.frontends.clone()),
                None => {
                    let es = prepared
                        .remove(key)
                        .unwrap_or_else(|| self.index.entries(key));
                    let fes = es.iter().map(|e| e.frontend).collect();
                    (es, fes)
                }
            };
            let created = self.index.service(key).and_then(|s| s.creation_timestamp);
            // Its own frontends (their entries may have changed) and every frontend whose
            // claimants changed (their owner may have).
            touched.extend(fes.iter().copied());
            touched.extend(self.claims.set(Rank::new(created, key.clone()), fes));
            entries.insert(key.clone(), es);
        }
        if full {
            touched.extend(self.claims.frontends().copied());
        }
        touched.sort_unstable();
        touched.dedup();

        let mut removals = Vec::new();
        let mut upserts: Vec<(ObjKey, ServiceEntry)> = Vec::new();
        for fe in &touched {
            self.report_conflicts(fe);
            let held_by = self.writer.programmed_name(fe);
            let Some(owner) = self.claims.owner(fe, held_by).cloned() else {
                if self.writer.is_programmed(fe) {
                    removals.push(*fe);
                } else {
                    self.refused.remove(fe);
                }
                continue;
            };
            if self.held.contains_key(&owner) {
                continue;
            }
            let es = entries
                .entry(owner.clone())
                .or_insert_with(|| self.index.entries(&owner));
            // Taken out (each frontend is visited once): the entries are not copied.
            if let Some(i) = es.iter().position(|e| e.frontend == *fe) {
                upserts.push((owner, es.remove(i)));
            }
        }
        let (owners, mut list): (Vec<ObjKey>, Vec<ServiceEntry>) = upserts.into_iter().unzip();
        let owner_of: HashMap<Frontend, ObjKey> =
            list.iter().map(|e| e.frontend).zip(owners).collect();
        write_order(&mut list);
        Desired {
            removals,
            list,
            owner_of,
            built_ms: started.elapsed().as_secs_f64() * 1e3,
        }
    }

    /// Writes `desired`: removals first (they free map room for the additions), then the
    /// upserts in write order; in batches when there are many (the first sync, a
    /// relist). What failed is retried, what was refused reported.
    fn write(&mut self, desired: Desired, now: Instant, outcome: &mut SyncOutcome) {
        let Desired {
            removals,
            list,
            owner_of,
            built_ms,
        } = desired;
        let planned = Instant::now();
        let report = self.writer.write_many(&removals, &list);
        self.svc_growths();
        debug!(
            frontends = list.len(),
            removals = removals.len(),
            desired_ms = built_ms,
            write_ms = planned.elapsed().as_secs_f64() * 1e3,
            "sync: desired state built, written"
        );
        outcome.ops += report.ops;
        let mut failed: HashSet<Frontend> = HashSet::default();
        for e in report.errors {
            let Some(fe) = err_frontend(&e).copied() else {
                continue;
            };
            failed.insert(fe);
            match owner_of.get(&fe) {
                // A removal: nobody claims it any more, the next full re-diff removes it.
                None => {
                    outcome.failed += 1;
                    self.write_failed(None, &e);
                    self.full_due.get_or_insert(now);
                }
                Some(owner) => match e {
                    WriteError::Store { .. } => {
                        outcome.failed += 1;
                        self.write_failed(Some(owner), &e);
                        self.dirty.entry(owner.clone()).or_insert_with(Instant::now);
                    }
                    _ => {
                        let owner = owner.clone();
                        self.refuse(&owner, &e);
                    }
                },
            }
        }
        if !self.refused.is_empty() {
            for fe in removals.iter().chain(list.iter().map(|e| &e.frontend)) {
                if !failed.contains(fe) {
                    self.refused.remove(fe);
                }
            }
        }
        if list.len() >= FREE_APART {
            // Freed on a thread of its own: a first sync's entries are hundreds of
            // thousands of allocations, off the time to programmed. The heap's free pages
            // are handed back once they are free: the trim after the sync (on the sync's
            // thread) may run before this drop ends, and kept 13 / 32 MiB resident at
            // 50,000 / 100,000 Services.
            let _ = std::thread::Builder::new()
                .name("sync-free".into())
                .spawn(move || {
                    drop((list, owner_of));
                    crate::agent::release_freed_memory();
                });
        }
    }

    /// The service-side maps grown before the write (or their growth failed): logged,
    /// counted (`ebpf_proxy_map_resizes_total`, `ebpf_proxy_service_map_entries`; a
    /// failure in `ebpf_proxy_map_write_errors_total{reason="service_map_resize"}`).
    fn svc_growths(&mut self) {
        for g in self.writer.take_svc_growths() {
            match g {
                SvcGrowth::Grown { resized, needed } => {
                    let maps = crate::agent::shrink::service_maps_resized(&self.metrics, &resized);
                    info!(
                        ?maps,
                        needed, "service-side maps grown online before the sync's writes"
                    );
                }
                SvcGrowth::Failed { .. } => {
                    self.metrics.map_write_error("service_map_resize");
                }
            }
        }
    }

    /// A frontend the writer refused by its content: the Service is skipped (its
    /// frontend keeps what the maps held, if anything), reported once per cause.
    fn refuse(&mut self, key: &ObjKey, err: &WriteError) {
        let Some(fe) = err_frontend(err) else { return };
        let reason = err.reason();
        let known = self.refused.values().any(|(k, r)| k == key && *r == reason);
        if self.refused.insert(*fe, (key.clone(), reason)).is_none() && !known {
            warn!(service = %key, reason = reason.label(), "skipping Service {key}: {err}; the rest is programmed");
            self.metrics
                .skipped(SkipKind::SERVICE, SkipReason::Refused(reason.label()));
        }
    }

    /// Reports each Service that claims `fe` without owning it, once.
    fn report_conflicts(&mut self, fe: &Frontend) {
        // One claimant or none, nothing reported for it: nothing to do (most frontends;
        // the sets below cost a first sync tens of milliseconds at 50,000).
        if !self.claims.contested(fe) && !self.conflicts_reported.contains_key(fe) {
            return;
        }
        let held_by = self.writer.programmed_name(fe);
        let losers: BTreeSet<ObjKey> = self.claims.losers(fe, held_by).cloned().collect();
        let owner = self.claims.owner(fe, held_by).cloned();
        let reported = self.conflicts_reported.entry(*fe).or_default();
        reported.retain(|k| losers.contains(k));
        let mut new = Vec::new();
        for k in &losers {
            if reported.insert(k.clone()) {
                new.push(k.clone());
            }
        }
        if reported.is_empty() {
            self.conflicts_reported.remove(fe);
        }
        if let Some(owner) = owner {
            for key in new {
                self.conflict(fe, &key, &owner);
            }
        }
    }

    fn conflict(&self, fe: &Frontend, key: &ObjKey, other: &ObjKey) {
        warn!(
            service = %key, frontend = %fe,
            "Service {key}: frontend {fe} belongs to Service {other} (it holds the frontend, or was created earlier, or at the same time with a smaller namespace/name); skipped"
        );
        self.metrics
            .skipped(SkipKind::SERVICE, SkipReason::FrontendConflict);
    }

    /// A frontend's write failed (a removal's when `owner` is `None`): logged with the
    /// Service it is written for, counted by cause.
    fn write_failed(&self, owner: Option<&ObjKey>, err: &WriteError) {
        match owner {
            Some(svc) => warn!(
                service = %svc, reason = err.reason().label(),
                "Service {svc}: map write failed: {err}; retrying"
            ),
            None => warn!(
                reason = err.reason().label(),
                "map write failed (a removal): {err}"
            ),
        }
        self.metrics
            .map_write_errors
            .get_or_create(&ReasonLabel {
                reason: err.reason().label().to_string(),
            })
            .inc();
    }
}

/// A sync writing at least this many frontends frees its desired state on a thread of
/// its own.
const FREE_APART: usize = 8192;

/// A sync prepared ([`Syncer::prepare`]), not yet written.
pub struct Prepared {
    start: Instant,
    full: bool,
    /// `nodes_changed`, `service_cidrs_changed` as they were (put back by a requeue).
    flags: (bool, bool),
    keys: Vec<(ObjKey, Instant)>,
    desired: Desired,
}

/// The frontends a sync removes and writes, and who owns each written one.
struct Desired {
    removals: Vec<Frontend>,
    list: Vec<ServiceEntry>,
    owner_of: HashMap<Frontend, ObjKey>,
    built_ms: f64,
}

fn err_frontend(e: &WriteError) -> Option<&Frontend> {
    match e {
        WriteError::FamilyMismatch { frontend, .. }
        | WriteError::ZeroPort { frontend }
        | WriteError::ZeroBackendPort { frontend, .. }
        | WriteError::TooManyBackends { frontend, .. }
        | WriteError::Store { frontend, .. } => Some(frontend),
    }
}
