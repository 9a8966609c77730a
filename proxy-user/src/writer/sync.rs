//! Syncs: a desired set of entries written as the difference, frontend by frontend or in
//! batches by phase (see the module doc of `writer`).

use std::{
    collections::{BTreeMap, BTreeSet},
    net::IpAddr,
};

use tracing::{error, warn};

use super::{
    plan::{phase, reserve_new, Plan, PHASES},
    SyncReport, Writer,
};

/// The share of a map sized to demand a sync may fill before it is grown: 3/4.
pub const SVC_HIGH_WATER: (usize, usize) = (3, 4);

/// The size the service maps grow to from `size` for `needed` entries: doubled until
/// `needed` is within the high-water mark, at most `ceiling`; `None` when `needed` is
/// within it already, or the maps are at the ceiling.
pub fn svc_grown(size: u32, needed: usize, ceiling: u32) -> Option<u32> {
    crate::loader::grown(size, needed, ceiling, SVC_HIGH_WATER)
}
use crate::{
    maglev,
    model::{Frontend, ServiceEntry},
    store::{write_batch, MapStore, Op, StoreError},
};

impl<S: MapStore> Writer<S> {
    /// Makes the maps hold exactly `desired`: removes frontends not in it, writes the
    /// changed ones. A frontend that fails is reported and left as it was; the rest are
    /// still written. Many frontends to write: in batches (see the module doc).
    pub fn sync(&mut self, desired: impl IntoIterator<Item = ServiceEntry>) -> SyncReport {
        let desired: BTreeMap<Frontend, ServiceEntry> =
            desired.into_iter().map(|e| (e.frontend, e)).collect();
        // Removals first: they free map room for the additions.
        let gone: Vec<Frontend> = self
            .services
            .keys()
            .filter(|fe| !desired.contains_key(fe))
            .copied()
            .collect();
        self.write_many(&gone, desired.values())
    }

    /// Removes `removals`, then writes `upserts` in their order (the caller's write order:
    /// an entry's own writes keep the update order whatever the path). Entries equal to
    /// what the maps hold ([`Self::unchanged`]: a restart on unchanged pins, a full
    /// re-diff) are passed over without planning anything. Many frontends to write (at
    /// least the batch threshold): in batches, one call per phase and map (see the module
    /// doc); else, or when a batch fails (everything undone), frontend by frontend. A
    /// frontend that fails is reported (its error names it) and left as it was; the rest
    /// are still written.
    pub fn write_many<'a>(
        &mut self,
        removals: &[Frontend],
        upserts: impl IntoIterator<Item = &'a ServiceEntry>,
    ) -> SyncReport {
        let upserts: Vec<&ServiceEntry> =
            upserts.into_iter().filter(|e| !self.unchanged(e)).collect();
        self.make_room(&upserts);
        let to_write = removals.len() + upserts.len();
        let (mut report, removed, upserted) = if to_write > 0 && to_write >= self.batch_min {
            self.sync_batched(&upserts, removals)
        } else {
            (SyncReport::default(), 0, 0)
        };
        // Frontend by frontend: all of it, or what a failed batched round left.
        for fe in &removals[removed..] {
            match self.remove(fe) {
                Ok(0) => {}
                Ok(n) => {
                    report.ops += n;
                    report.removed += 1;
                }
                Err(e) => report.errors.push(e),
            }
        }
        for entry in &upserts[upserted..] {
            match self.upsert(entry) {
                Ok(0) => {}
                Ok(n) => {
                    report.ops += n;
                    report.changed += 1;
                }
                Err(e) => report.errors.push(e),
            }
        }
        report
    }

    /// Whether `fe` is programmed.
    pub fn is_programmed(&self, fe: &Frontend) -> bool {
        self.services.contains_key(fe)
    }

    /// The Service name the reverse-NAT entry of `fe` holds (`namespace/name[:port]`,
    /// as written or adopted from the pinned maps; cut at `NAME_LEN` bytes), if `fe` is
    /// programmed: who holds the frontend (`cluster::conflicts`).
    pub fn programmed_name(&self, fe: &Frontend) -> Option<&str> {
        self.services.get(fe).map(|p| p.name.as_str())
    }

    /// Number of frontends programmed.
    pub fn frontend_count(&self) -> usize {
        self.services.len()
    }

    /// Whether writing `entry` would write nothing: exactly the entries for which
    /// [`Self::stage_upsert`] plans no op and reports no error (an entry that does not
    /// validate is never unchanged, so its error is still reported). Checked without
    /// allocating for up to [`INLINE_BACKENDS`] backends: this runs for every frontend of
    /// a full re-diff.
    pub(super) fn unchanged(&self, entry: &ServiceEntry) -> bool {
        let fe = entry.frontend;
        let Some(p) = self.services.get(&fe) else {
            return false;
        };
        if fe.port == 0
            || !crate::model::same_stored_name(&p.name, &entry.name)
            || p.value.flags != entry.flags
            || p.value.affinity_timeout != entry.affinity_timeout
            || p.slots.len() != entry.backends.len()
            || usize::from(p.value.count) != p.slots.len()
            || !same_ranges(&entry.source_ranges, &p.source_ranges)
        {
            return false;
        }
        // The slots are a permutation of the entry's backends (each valid, each with an id,
        // no duplicate on either side): `stable_layout` keeps them as they are.
        let n = p.slots.len();
        let mut inline = [0u32; INLINE_BACKENDS];
        let mut heap = Vec::new();
        let ids: &mut [u32] = if n <= INLINE_BACKENDS {
            &mut inline[..n]
        } else {
            heap.resize(n, 0);
            &mut heap
        };
        for (slot, b) in ids.iter_mut().zip(&entry.backends) {
            if b.family() != fe.family() || b.addr.port() == 0 {
                return false;
            }
            match self.backends.id_of(&(*b, fe.proto)) {
                Some(id) => *slot = id,
                None => return false,
            }
        }
        ids.sort_unstable();
        if ids.windows(2).any(|w| w[0] == w[1]) {
            return false;
        }
        if p.slots
            .iter()
            .any(|id| *id == 0 || ids.binary_search(id).is_err())
        {
            return false;
        }
        // Slots distinct: as many as the ids, all among them, none repeated.
        let mut slots_sorted = [0u32; INLINE_BACKENDS];
        if n <= INLINE_BACKENDS {
            slots_sorted[..n].copy_from_slice(&p.slots);
            let s = &mut slots_sorted[..n];
            s.sort_unstable();
            if s.windows(2).any(|w| w[0] == w[1]) {
                return false;
            }
        } else {
            let mut s = p.slots.clone();
            s.sort_unstable();
            if s.windows(2).any(|w| w[0] == w[1]) {
                return false;
            }
        }
        // The Maglev table: the one the current parameters give these slots, or none.
        if entry.flags & proxy_common::svc_flags::MAGLEV != 0 && n > 0 {
            let Some((fp, chunks)) = p.maglev else {
                return false;
            };
            let inputs = Self::maglev_inputs(&p.slots, |id| self.backends.addr(id));
            fp != 0
                && chunks == proxy_common::maglev::chunks(self.maglev.table_size)
                && maglev::fingerprint(self.maglev, &inputs) == fp
        } else {
            p.maglev.is_none()
        }
    }

    /// A batched sync in rounds of `batch_chunk` frontends (removals `gone`, then
    /// `desired`). Returns the report of the rounds written and how many removals and
    /// upserts they covered: all, or (a round failed: its writes undone, the model as
    /// after the previous round) those before the failed round, for the caller to write
    /// frontend by frontend.
    pub(super) fn sync_batched(
        &mut self,
        desired: &[&ServiceEntry],
        gone: &[Frontend],
    ) -> (SyncReport, usize, usize) {
        let saved = self.save();
        let total = gone.len() + desired.len();
        // The backends' table sized once for every new frontend's backends (a bound:
        // repeats counted), not round by round: each growth rehashed every id through
        // the entries (a seventh of a 50,000-Service first sync's planning).
        let new_backends = desired
            .iter()
            .filter(|e| !self.services.contains_key(&e.frontend))
            .map(|e| e.backends.len())
            .sum();
        self.backends.reserve(new_backends);
        let chunk = self.batch_chunk.max(1);
        let mut report = SyncReport::default();
        let mut start = 0;
        // Time planning (the model) and applying (the kernel's batch calls), for the log.
        let (mut plan_s, mut apply_s) = (0f64, 0f64);
        while start < total {
            let end = (start + chunk).min(total);
            let t = std::time::Instant::now();
            let (phases, round) = self.plan_round(gone, desired, start..end);
            let frees = self.deferred_frees.take().unwrap_or_default();
            let planned = std::time::Instant::now();
            plan_s += (planned - t).as_secs_f64();
            let applied = self.apply_phases(phases);
            apply_s += planned.elapsed().as_secs_f64();
            match applied {
                Ok(()) => {
                    self.release(frees);
                    report.ops += round.ops;
                    report.changed += round.changed;
                    report.removed += round.removed;
                    report.errors.extend(round.errors);
                    start = end;
                }
                Err((e, rollback_failed)) => {
                    // Back to the model after the last written round: from before the
                    // sync, the written rounds planned again (deterministic) unwritten.
                    self.restore(saved);
                    let mut at = 0;
                    while at < start {
                        let to = (at + chunk).min(start);
                        let _ = self.plan_round(gone, desired, at..to);
                        let frees = self.deferred_frees.take().unwrap_or_default();
                        self.release(frees);
                        at = to;
                    }
                    if rollback_failed {
                        error!(
                            error = %e,
                            "a batched sync failed and undoing it failed too: the maps may \
                             hold entries the model does not know until the next restart"
                        );
                    } else {
                        warn!(error = %e, "a batched sync failed and was undone; writing frontend by frontend");
                    }
                    let removed = start.min(gone.len());
                    return (report, removed, start - removed);
                }
            }
        }
        tracing::debug!(
            frontends = total,
            plan_ms = plan_s * 1e3,
            apply_ms = apply_s * 1e3,
            "batched sync written"
        );
        (report, gone.len(), desired.len())
    }

    /// Plans (and commits to the model) units `range` of a sync (`gone`, then `desired`),
    /// the ops sorted into phases; ids freed are left in `deferred_frees`.
    fn plan_round(
        &mut self,
        gone: &[Frontend],
        desired: &[&ServiceEntry],
        range: std::ops::Range<usize>,
    ) -> (Vec<Plan>, SyncReport) {
        self.deferred_frees = Some(Vec::new());
        let mut report = SyncReport::default();
        let mut phases: Vec<Plan> = (0..PHASES).map(|_| Plan::default()).collect();
        let removals = range.start.min(gone.len())..range.end.min(gone.len());
        for fe in &gone[removals] {
            if let Some((plan, old)) = self.stage_remove(fe) {
                report.ops += plan.len();
                report.removed += 1;
                for (op, undo) in plan.pairs() {
                    phases[phase(&op, true)].push(op, undo);
                }
                self.commit_remove(fe, &old);
            }
        }
        let upserts = range.start.saturating_sub(gone.len())..range.end.saturating_sub(gone.len());
        self.reserve_new(&mut phases, &desired[upserts.clone()]);
        for entry in &desired[upserts] {
            match self.stage_upsert(entry) {
                Err(e) => report.errors.push(e),
                Ok(mut staged) => {
                    let plan = std::mem::take(&mut staged.plan);
                    if !plan.is_empty() {
                        report.ops += plan.len();
                        report.changed += 1;
                    }
                    for (op, undo) in plan.pairs() {
                        phases[phase(&op, false)].push(op, undo);
                    }
                    self.commit_upsert(staged);
                }
            }
        }
        (phases, report)
    }

    /// Room in the phases for what the new frontends of `entries` write (a backend per
    /// backend, reverse NAT and the frontend's entry each; a first sync's rounds hold
    /// nothing else), and in the backends' table for their backends: reserved once
    /// rather than grown op by op. Programmed frontends reserve nothing (what they
    /// write is their difference, often nothing).
    fn reserve_new(&mut self, phases: &mut [Plan], entries: &[&ServiceEntry]) {
        let (mut frontends, mut backends) = (0, 0);
        for e in entries {
            if !self.services.contains_key(&e.frontend) {
                frontends += 1;
                backends += e.backends.len();
            }
        }
        if frontends == 0 {
            return;
        }
        reserve_new(phases, frontends, backends);
        self.backends.reserve(backends);
    }

    /// Releases ids freed during a written round.
    fn release(&mut self, frees: Vec<(bool, u32)>) {
        for (backend, id) in frees {
            if backend {
                self.backend_alloc.free(id);
            } else {
                self.service_alloc.free(id);
            }
        }
    }

    /// Writes each phase's ops as one batch per map; on a failure undoes everything
    /// written, phase by phase in reverse.
    pub(super) fn apply_phases(&mut self, phases: Vec<Plan>) -> Result<(), (StoreError, bool)> {
        let mut applied: Vec<Vec<Op>> = Vec::with_capacity(phases.len());
        for plan in phases {
            let mut undo_phase = Vec::new();
            for (ops, undo) in plan.by_group() {
                match self.write_group(ops, undo) {
                    Ok(undo) => undo_phase.extend(undo),
                    Err((written, e)) => {
                        undo_phase.extend(written);
                        applied.push(undo_phase);
                        let failed = self.rollback(applied);
                        return Err((e, failed));
                    }
                }
            }
            applied.push(undo_phase);
        }
        Ok(())
    }

    /// Applies the undo ops of each phase, last phase first, in batches. True if any
    /// undo op failed (the others are still applied).
    pub(super) fn rollback(&mut self, applied: Vec<Vec<Op>>) -> bool {
        let mut failed = false;
        for undo in applied.into_iter().rev() {
            let mut plan = Plan::default();
            for op in undo {
                plan.push(op.clone(), op);
            }
            for (ops, _) in plan.by_group() {
                let mut rest = &ops[..];
                while let Err((i, _)) = write_batch(&mut self.store, rest, &mut self.counts) {
                    failed = true;
                    rest = &rest[i + 1..];
                }
            }
        }
        failed
    }
}

/// Backends checked by [`Writer::unchanged`] without a heap allocation.
const INLINE_BACKENDS: usize = 64;

/// `want` (a list, maybe with repeats) holds exactly the ranges of `have`.
fn same_ranges(want: &[(IpAddr, u8)], have: &BTreeSet<(IpAddr, u8)>) -> bool {
    if want.is_empty() || have.is_empty() {
        return want.is_empty() && have.is_empty();
    }
    want.iter().all(|r| have.contains(r))
        && have.len() == want.iter().collect::<BTreeSet<_>>().len()
}
