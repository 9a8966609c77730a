//! Adoption: reading the pinned maps back into the writer's model, checking and
//! repairing them (`AdoptReport`).

use std::{collections::BTreeSet, net::IpAddr};

use tracing::warn;

use super::{plan::Plan, AdoptReport, BackendKey, Programmed, Repair, Writer, BATCH_MIN_FRONTENDS};
use crate::{
    fasthash::{HashMap, HashSet},
    maglev::{self, Params as MaglevParams},
    model::Frontend,
    store::{chunk_ids, svc_entries, write_batch, Dump, FrontendValue, MapStore, Op, StoreError},
};

/// The order adoption writes its repairs and deletions in: what nothing reaches first,
/// then rewrites in the update order, unreferenced backends last.
pub(super) fn adopt_phase(op: &Op) -> usize {
    match op {
        Op::DelChunk { .. } | Op::DelMaglev { .. } => 0,
        Op::DelSrcRange { .. } => 1,
        Op::DelRevNat { .. } => 2,
        Op::PutRevNat { .. } => 3,
        Op::PutSrcRange { .. } => 4,
        Op::PutChunk { .. } => 5,
        Op::PutFrontend { .. } => 6,
        Op::DelBackend { .. } => 7,
        _ => 8,
    }
}

impl<S: MapStore> Writer<S> {
    /// A writer over maps that may hold a previous agent's state: reads them back,
    /// rebuilds the model (ids, reference counts) and deletes entries nothing reaches.
    /// Nothing the datapath uses is touched.
    pub fn adopt(store: S) -> Result<(Self, AdoptReport), StoreError> {
        Self::adopt_with_threshold(store, BATCH_MIN_FRONTENDS)
    }

    /// [`Self::adopt`] with the batch threshold set (orphans are deleted in batches when
    /// there are at least that many).
    pub fn adopt_with_threshold(
        store: S,
        batch_min: usize,
    ) -> Result<(Self, AdoptReport), StoreError> {
        Self::adopt_with(store, batch_min, MaglevParams::default())
    }

    /// [`Self::adopt_with_threshold`] with the Maglev parameters the agent uses: an
    /// adopted table equal to the one they give is kept (not rewritten).
    ///
    /// The phases, in order: read the maps; take the backends; give every frontend a
    /// service id of its own and take its slots; keep or mark the Maglev tables; collect
    /// what nothing reaches (slots past a count, reverse-NAT and source-range entries of
    /// no service, unreferenced backends); give a frontend its missing reverse-NAT entry
    /// back; write the repairs and deletions in [`adopt_phase`] order.
    pub fn adopt_with(
        store: S,
        batch_min: usize,
        maglev_params: MaglevParams,
    ) -> Result<(Self, AdoptReport), StoreError> {
        let started = std::time::Instant::now();
        let dump = store.dump()?;
        let read = started.elapsed();
        let mut w = Self::new(store);
        w.batch_min = batch_min;
        w.maglev = maglev_params;
        w.node_addrs = dump.node_addrs.clone();
        w.snat = dump.snat;
        let mut report = AdoptReport::default();
        let mut orphans = Vec::new();

        w.adopt_backends(&dump);
        let owner = service_id_owners(&dump);
        w.adopt_frontends(&dump, &owner, &mut report, &mut orphans);
        w.adopt_maglev(&dump, &owner, &mut report, &mut orphans);
        w.collect_dead_slots(&dump, &mut orphans);
        w.collect_dead_service_entries(&dump, &mut orphans);
        w.restore_revnat(&dump, &mut report, &mut orphans);
        w.collect_unreferenced_backends(&mut orphans);
        tracing::debug!(
            frontends = w.services.len(),
            backends = w.backends.len(),
            read_ms = read.as_secs_f64() * 1e3,
            model_ms = (started.elapsed() - read).as_secs_f64() * 1e3,
            "adoption: the maps read back, the model rebuilt"
        );
        orphans.sort_by_key(adopt_phase);
        w.write_adoption(&orphans)?;
        report.frontends = w.services.len();
        report.backends = w.backends.len();
        w.backends.shrink_to_fit();
        report.orphans_deleted = orphans.iter().filter(|op| is_deletion(op)).count();
        Ok((w, report))
    }

    /// Every backend found, with no reference yet. In id order: the first id of a
    /// backend found twice is its canonical one.
    fn adopt_backends(&mut self, dump: &Dump) {
        self.backends.reserve(dump.backends.len());
        for (id, key) in &dump.backends {
            self.backend_alloc.mark(*id);
            self.backends.insert(*id, *key, 0, false);
        }
        for value in dump.frontends.values() {
            self.service_alloc.mark(value.service_id);
        }
    }

    /// Every frontend with its slots. A frontend sharing its service id with another
    /// (see [`service_id_owners`]) gets a fresh id, rewritten in its entry, its slot
    /// chunks and source ranges.
    fn adopt_frontends(
        &mut self,
        dump: &Dump,
        owner: &HashMap<u32, Frontend>,
        report: &mut AdoptReport,
        orphans: &mut Vec<Op>,
    ) {
        let mut ranges_by_id: HashMap<u32, BTreeSet<(IpAddr, u8)>> = HashMap::default();
        for (id, a, p) in &dump.src_ranges {
            ranges_by_id.entry(*id).or_default().insert((*a, *p));
        }
        for (fe, found) in &dump.frontends {
            let mut value = *found;
            let ranges = ranges_by_id
                .get(&found.service_id)
                .cloned()
                .unwrap_or_default();
            let duplicate = owner.get(&found.service_id) != Some(fe);
            if duplicate {
                value.service_id = self.service_alloc.alloc();
                report.repair(Repair::DuplicateServiceId);
                warn!(
                    frontend = %fe,
                    shared_with = %owner[&found.service_id],
                    old_id = found.service_id,
                    new_id = value.service_id,
                    "adoption: a service id held by two frontends; this one gets a new id"
                );
                for (addr, prefix) in &ranges {
                    orphans.push(Op::PutSrcRange {
                        service_id: value.service_id,
                        addr: *addr,
                        prefix: *prefix,
                    });
                }
            }
            let slots = self.adopt_slots(dump, fe, &value, report);
            if duplicate {
                orphans.push(Op::PutFrontend {
                    frontend: *fe,
                    value,
                    backends: chunk_ids(&slots, 0).into(),
                });
                for chunk in 1..svc_entries(slots.len()) {
                    orphans.push(Op::PutChunk {
                        frontend: *fe,
                        chunk: chunk as u16,
                        backends: chunk_ids(&slots, chunk).into(),
                        service_id: value.service_id,
                        trim: false,
                    });
                }
            }
            self.services.insert(
                *fe,
                Programmed {
                    value,
                    name: String::new(),
                    source_ranges: ranges,
                    slots,
                    maglev: None,
                },
            );
        }
    }

    /// One frontend's slots 1..=count, in order (one tree walk, not a lookup per slot):
    /// a slot missing, dangling or naming a backend of another protocol or family becomes
    /// 0 (a repair); each distinct backend gets one reference.
    fn adopt_slots(
        &mut self,
        dump: &Dump,
        fe: &Frontend,
        value: &FrontendValue,
        report: &mut AdoptReport,
    ) -> Vec<u32> {
        let mut slots = Vec::with_capacity(usize::from(value.count));
        // Distinct ids seen (one reference per frontend even if two slots share one):
        // the slots themselves when few, else a set.
        let mut seen: Option<HashSet<u32>> = (value.count > 32).then(|| {
            HashSet::with_capacity_and_hasher(usize::from(value.count), Default::default())
        });
        let mut found = (value.count > 0)
            .then(|| dump.slots.range((*fe, 1)..=(*fe, value.count)))
            .into_iter()
            .flatten()
            .peekable();
        for slot in 1..=value.count {
            let at = match found.peek() {
                Some(((_, s), id)) if *s == slot => {
                    let id = **id;
                    found.next();
                    Some(id)
                }
                _ => None,
            };
            let id = match self.check_slot(fe, slot, at, report) {
                Some(id) => {
                    let first = match seen.as_mut() {
                        Some(set) => set.insert(id),
                        None => !slots.contains(&id),
                    };
                    if let (true, Some(refs)) = (first, self.backends.refs_mut(id)) {
                        *refs += 1;
                    }
                    id
                }
                None => 0,
            };
            if id == 0 {
                report.missing_slots += 1;
            }
            slots.push(id);
        }
        slots
    }

    /// The backend id a found slot may keep, or `None` (counted as a repair) when the
    /// slot is missing, names no backend, or a backend of another protocol or family.
    fn check_slot(
        &self,
        fe: &Frontend,
        slot: u16,
        at: Option<u32>,
        report: &mut AdoptReport,
    ) -> Option<u32> {
        let Some(id) = at else {
            report.repair(Repair::MissingSlot);
            warn!(frontend = %fe, slot, "adoption: slot missing below the count");
            return None;
        };
        match self.backends.get(id) {
            None => {
                report.repair(Repair::DanglingSlot);
                warn!(frontend = %fe, slot, backend = id, "adoption: slot names a missing backend");
                None
            }
            Some(((b, proto), _)) if proto != fe.proto || b.family() != fe.family() => {
                report.repair(Repair::SlotBackendMismatch);
                warn!(frontend = %fe, slot, backend = id, "adoption: slot names a backend of another protocol or family");
                None
            }
            Some(_) => Some(id),
        }
    }

    /// Maglev tables: kept (no write) when equal to what the parameters in use give the
    /// adopted slots; else marked for rewriting. Chunks of no flagged frontend go.
    fn adopt_maglev(
        &mut self,
        dump: &Dump,
        owner: &HashMap<u32, Frontend>,
        report: &mut AdoptReport,
        orphans: &mut Vec<Op>,
    ) {
        let mut maglev_by_id: HashMap<u32, Vec<u32>> = HashMap::default();
        for (sid, chunk) in dump.maglev.keys() {
            maglev_by_id.entry(*sid).or_default().push(*chunk);
        }
        let flagged: Vec<Frontend> = self
            .services
            .iter()
            .filter(|(fe, p)| {
                p.value.flags & proxy_common::svc_flags::MAGLEV != 0
                    && owner.get(&p.value.service_id) == Some(*fe)
            })
            .map(|(fe, _)| *fe)
            .collect();
        let mut kept_ids = HashSet::default();
        for fe in flagged {
            let p = &self.services[&fe];
            let sid = p.value.service_id;
            let Some(found) = maglev_by_id.get(&sid) else {
                continue;
            };
            kept_ids.insert(sid);
            let inputs = Self::maglev_inputs(&p.slots, |id| self.backends.addr(id));
            let want = maglev::chunks(&maglev::table(self.maglev, &inputs));
            let same = found.len() == want.len()
                && want
                    .iter()
                    .enumerate()
                    .all(|(i, c)| dump.maglev.get(&(sid, i as u32)).is_some_and(|d| **d == *c));
            let n = found.iter().max().map_or(0, |m| m + 1);
            let state = if same {
                (maglev::fingerprint(self.maglev, &inputs), n)
            } else {
                report.repair(Repair::MaglevTableStale);
                (0, n)
            };
            self.services.set_maglev(&fe, Some(state));
        }
        for (sid, chunk) in dump.maglev.keys() {
            if !kept_ids.contains(sid) {
                orphans.push(Op::DelMaglev {
                    service_id: *sid,
                    chunk: *chunk,
                });
            }
        }
    }

    /// Slots past their frontend's count go: a chunk wholly past it is deleted, a chunk
    /// the count ends in is rewritten without them (its own entry, for slots 1..=24). In
    /// frontend order, one lookup per frontend.
    fn collect_dead_slots(&self, dump: &Dump, orphans: &mut Vec<Op>) {
        // Entries rewritten already (a frontend given a new service id): not twice.
        let mut rewritten: HashSet<String> = orphans
            .iter()
            .filter(|o| matches!(o, Op::PutFrontend { .. } | Op::PutChunk { .. }))
            .map(Op::key)
            .collect();
        let mut current: Option<(Frontend, usize)> = None;
        let mut done: Option<(Frontend, u16)> = None;
        for (fe, slot) in dump.slots.keys() {
            let count = match current {
                Some((f, n)) if f == *fe => n,
                _ => {
                    let n = self.services.get(fe).map_or(0, |p| p.slots.len());
                    current = Some((*fe, n));
                    n
                }
            };
            let chunk = proxy_common::svc_chunk_of(*slot).0;
            if usize::from(*slot) <= count || done == Some((*fe, chunk)) {
                continue;
            }
            done = Some((*fe, chunk));
            if usize::from(chunk) >= svc_entries(count) {
                orphans.push(Op::DelChunk {
                    frontend: *fe,
                    chunk,
                });
                continue;
            }
            let Some(p) = self.services.get(fe) else {
                continue;
            };
            let backends = chunk_ids(&p.slots, usize::from(chunk)).into();
            let op = if chunk > 0 {
                Op::PutChunk {
                    frontend: *fe,
                    chunk,
                    backends,
                    service_id: p.value.service_id,
                    trim: false,
                }
            } else {
                Op::PutFrontend {
                    frontend: *fe,
                    value: p.value,
                    backends,
                }
            };
            if rewritten.insert(op.key()) {
                orphans.push(op);
            }
        }
    }

    /// Reverse-NAT and source-range entries of no service go. Service ids in use per
    /// family: a reverse-NAT entry of such an id naming another frontend is rewritten by
    /// [`Self::restore_revnat`], not deleted (a delete and a rewrite of one entry must not
    /// meet in one batch phase).
    fn collect_dead_service_entries(&self, dump: &Dump, orphans: &mut Vec<Op>) {
        let live_sids: HashSet<(u32, crate::model::Family)> = self
            .services
            .iter()
            .map(|(fe, p)| (p.value.service_id, fe.family()))
            .collect();
        for (id, (fe, _)) in &dump.revnat {
            if !live_sids.contains(&(*id, fe.family())) {
                orphans.push(Op::DelRevNat {
                    service_id: *id,
                    family: fe.family(),
                });
            }
        }
        let live_ids: HashSet<u32> = self.services.values().map(|p| p.value.service_id).collect();
        for (id, addr, prefix) in &dump.src_ranges {
            if !live_ids.contains(id) {
                orphans.push(Op::DelSrcRange {
                    service_id: *id,
                    addr: *addr,
                    prefix: *prefix,
                });
            }
        }
    }

    /// A frontend whose reverse-NAT entry is missing (or names another frontend) gets it
    /// back; one whose entry is right takes its Service name from it.
    fn restore_revnat(&mut self, dump: &Dump, report: &mut AdoptReport, orphans: &mut Vec<Op>) {
        for (fe, value, own_name) in self.services.names_mut() {
            match dump.revnat.get(&value.service_id) {
                Some((f, name)) if f == fe => *own_name = name.clone(),
                other => {
                    if let Some((f, _)) = other {
                        report.repair(Repair::RevnatRewritten);
                        warn!(frontend = %fe, service_id = value.service_id, names = %f,
                              "adoption: reverse-NAT entry names another frontend; rewritten");
                    }
                    orphans.push(Op::PutRevNat {
                        service_id: value.service_id,
                        frontend: *fe,
                        name: String::new(),
                    })
                }
            }
        }
    }

    /// Backends no slot references go (their ids freed).
    fn collect_unreferenced_backends(&mut self, orphans: &mut Vec<Op>) {
        let unreferenced: Vec<(u32, BackendKey)> = self
            .backends
            .iter()
            .filter(|(_, (_, refs))| *refs == 0)
            .map(|(id, (key, _))| (id, key))
            .collect();
        for (id, key) in unreferenced {
            self.backends.remove(id);
            self.backend_alloc.free(id);
            orphans.push(Op::DelBackend {
                id,
                family: key.0.family(),
            });
        }
    }

    /// Writes the repairs and deletions (sorted by [`adopt_phase`]): one batch per phase
    /// and map when there are at least `batch_min` (and 2), else one by one.
    fn write_adoption(&mut self, orphans: &[Op]) -> Result<(), StoreError> {
        if orphans.len() >= self.batch_min.max(2) {
            let mut phases: [Vec<Op>; 9] = Default::default();
            for op in orphans {
                phases[adopt_phase(op)].push(op.clone());
            }
            for ops in phases {
                let mut plan = Plan::default();
                for op in ops {
                    plan.push(op.clone(), op);
                }
                for (ops, _) in plan.by_group() {
                    write_batch(&mut self.store, &ops, &mut self.counts).map_err(|(_, e)| e)?;
                }
            }
        } else {
            for op in orphans {
                self.store.apply(op)?;
                self.counts.single += 1;
            }
        }
        Ok(())
    }
}

/// Which frontend keeps each service id. Ids unique: a service id held by two frontends
/// (the second would share the first's reverse NAT) stays with the one its reverse-NAT
/// entry names (else the first); the others get a fresh id.
fn service_id_owners(dump: &Dump) -> HashMap<u32, Frontend> {
    let mut owner: HashMap<u32, Frontend> = HashMap::default();
    for (fe, v) in &dump.frontends {
        let named = dump.revnat.get(&v.service_id).is_some_and(|(f, _)| f == fe);
        match owner.entry(v.service_id) {
            std::collections::hash_map::Entry::Vacant(e) => {
                e.insert(*fe);
            }
            std::collections::hash_map::Entry::Occupied(mut e) if named => {
                e.insert(*fe);
            }
            std::collections::hash_map::Entry::Occupied(_) => {}
        }
    }
    owner
}

/// An adoption write that deletes (counted in `orphans_deleted`).
fn is_deletion(op: &Op) -> bool {
    matches!(
        op,
        Op::DelChunk { .. }
            | Op::DelSrcRange { .. }
            | Op::DelRevNat { .. }
            | Op::DelBackend { .. }
            | Op::DelMaglev { .. }
    )
}
