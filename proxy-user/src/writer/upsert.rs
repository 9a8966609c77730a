//! One frontend written or removed: staged as a [`Plan`], applied, committed to the model
//! or undone.

use std::{collections::BTreeSet, net::IpAddr};

use proxy_common::limits::MAX_BACKENDS_PER_SERVICE;

use super::{plan::Plan, BackendKey, Programmed, StagedUpsert, WriteError, Writer};
use crate::{
    fasthash::{HashMap, HashSet},
    maglev,
    model::{Backend, Frontend, ServiceEntry},
    store::{chunk_ids, svc_entries, FrontendValue, MapStore, Op},
};

/// An op and the op that undoes it (planned later with [`Plan::push`]).
type OpAndUndo = (Op, Op);

impl<S: MapStore> Writer<S> {
    /// Installs or updates one frontend. Returns the number of map operations (0 when the
    /// maps already match).
    pub fn upsert(&mut self, entry: &ServiceEntry) -> Result<usize, WriteError> {
        let mut staged = self.stage_upsert(entry)?;
        let plan = std::mem::take(&mut staged.plan);
        if let Err((source, rollback_failed)) = self.apply_all(&plan.ops, &plan.undo) {
            for (id, _) in &staged.new_backend_ids {
                self.backend_alloc.free(*id);
            }
            if staged.new_service_id {
                self.service_alloc.free(staged.service_id);
            }
            return Err(WriteError::Store {
                frontend: staged.fe,
                source,
                rollback_failed,
            });
        }
        self.commit_upsert(staged);
        Ok(plan.len())
    }

    /// Plans one frontend's writes (allocating ids for new backends and a new frontend);
    /// nothing is written and the model is unchanged but for the allocations.
    ///
    /// The plan follows the update order of the module doc, step by step: new backends;
    /// the reverse-NAT entry and new source ranges; the slots, then the Maglev table; slot
    /// 0; surplus slots, then unused table chunks and stale source ranges; backends no
    /// frontend uses any more.
    pub(super) fn stage_upsert(
        &mut self,
        entry: &ServiceEntry,
    ) -> Result<StagedUpsert, WriteError> {
        let fe = entry.frontend;
        let backends = validate(entry)?;
        let old_slots: Vec<u32> = self
            .services
            .get(&fe)
            .map_or_else(Vec::new, |p| p.slots.clone());
        // A new frontend: a backend per backend, reverse NAT, its entry.
        let mut plan = Plan::with_capacity(2 * backends.len() + 2);

        // 1. New backends.
        let (ids, new_backend_ids) = self.stage_new_backends(fe, &backends, &mut plan);
        let (service_id, new_service_id) = match self.services.get(&fe) {
            Some(p) => (p.value.service_id, false),
            None => (self.service_alloc.alloc(), true),
        };
        let old = self.services.get(&fe);
        // 2. The reverse-NAT entry (new frontend or new name), and new source ranges.
        stage_revnat(&mut plan, fe, service_id, old, &entry.name);
        let want_ranges: BTreeSet<(IpAddr, u8)> = entry.source_ranges.iter().copied().collect();
        let old_ranges = old.map(|p| p.source_ranges.clone()).unwrap_or_default();
        stage_ranges(&mut plan, (service_id, true), &want_ranges, &old_ranges);
        // 3. Changed chunks of slots past the frontend's own 24, then the Maglev table
        //    (after the slots it names, before the flag in the frontend's entry; a table
        //    in use after the entry, which holds slots 1..=24).
        let layout = stable_layout(&old_slots, &ids);
        let mut after_entry = stage_chunks(&mut plan, fe, service_id, &old_slots, &layout);
        let (maglev_state, maglev_dels) = self.stage_maglev(
            (&mut plan, &mut after_entry),
            entry,
            service_id,
            old,
            &layout,
            (&ids, &backends),
        );
        // 4. The frontend's entry: the new count and slots 1..=24, at once.
        let value = FrontendValue {
            service_id,
            count: layout.len() as u16,
            flags: entry.flags,
            affinity_timeout: entry.affinity_timeout,
        };
        stage_frontend(&mut plan, fe, old, value, &layout);
        // 5. Surplus chunks; then table chunks no longer used, once the frontend no
        //    longer asks for them; then stale source ranges.
        stage_surplus_chunks(
            &mut plan,
            fe,
            service_id,
            &old_slots,
            layout.len(),
            after_entry,
        );
        for (op, undo) in maglev_dels {
            plan.push(op, undo);
        }
        stage_ranges(&mut plan, (service_id, false), &old_ranges, &want_ranges);
        // 6. Backends this frontend stops using and nobody else uses.
        self.stage_unused_backends(&mut plan, &old_slots, &layout);

        Ok(StagedUpsert {
            fe,
            plan,
            new_backend_ids,
            service_id,
            new_service_id,
            value,
            layout,
            old_slots,
            want_ranges,
            name: entry.name.clone(),
            maglev: maglev_state,
        })
    }

    /// Step 1: the id of each wanted backend, allocating (and planning a `BACKEND` write
    /// for) those not yet known. Returns the ids in order and the new ones.
    fn stage_new_backends(
        &mut self,
        fe: Frontend,
        backends: &[Backend],
        plan: &mut Plan,
    ) -> (Vec<u32>, Vec<(u32, BackendKey)>) {
        let mut new_backend_ids = Vec::new();
        let mut ids = Vec::with_capacity(backends.len());
        for b in backends {
            let key = (*b, fe.proto);
            let id = match self.backends.id_of(&key) {
                Some(id) => id,
                None => {
                    let id = self.backend_alloc.alloc();
                    new_backend_ids.push((id, key));
                    plan.push(
                        Op::PutBackend {
                            id,
                            backend: *b,
                            proto: fe.proto,
                        },
                        Op::DelBackend {
                            id,
                            family: b.family(),
                        },
                    );
                    id
                }
            };
            ids.push(id);
        }
        (ids, new_backend_ids)
    }

    /// Step 3 (Maglev): the table's chunks when the slots' fingerprint changed (into
    /// `after_entry` when the table is in use already: it names slots the frontend's
    /// entry holds); the chunks no longer used are returned (with their undo) to be
    /// planned after the frontend's entry.
    /// `(ids, backends)`: the wanted backends and their ids, in the same order. Returns
    /// the new table state and those deletions.
    fn stage_maglev(
        &self,
        (plan, after_entry): (&mut Plan, &mut Vec<OpAndUndo>),
        entry: &ServiceEntry,
        service_id: u32,
        old: Option<&Programmed>,
        layout: &[u32],
        (ids, backends): (&[u32], &[Backend]),
    ) -> (Option<(u64, u32)>, Vec<OpAndUndo>) {
        let old_maglev = old.and_then(|p| p.maglev);
        let mut maglev_state = None;
        let mut maglev_dels = Vec::new();
        let old_table = old.and_then(|p| self.programmed_table(p));
        // A table the datapath reads already (the flag set) goes after the frontend's
        // entry: it names the new slots 1..=24, which that entry holds.
        let late = old.is_some_and(|p| p.value.flags & proxy_common::svc_flags::MAGLEV != 0);
        let put_chunk = |chunk: u32, c: &proxy_common::MaglevChunk| Op::PutMaglev {
            service_id,
            chunk,
            value: Box::new(*c),
            late,
        };
        let del_chunk = |chunk: u32| Op::DelMaglev { service_id, chunk };
        let undo_chunk = |chunk: u32| match old_table.as_ref().and_then(|t| t.get(chunk as usize)) {
            Some(c) => put_chunk(chunk, c),
            // Not known (an adopted table of other parameters): undoing leaves no table,
            // and the datapath falls back to random for it.
            None => del_chunk(chunk),
        };
        if entry.flags & proxy_common::svc_flags::MAGLEV != 0 && !layout.is_empty() {
            // The addresses of the ids, built only for a Maglev frontend (planning runs
            // for every frontend of a first sync).
            let addr_of_new: HashMap<u32, std::net::SocketAddr> = ids
                .iter()
                .zip(backends)
                .map(|(id, b)| (*id, b.addr))
                .collect();
            let inputs = Self::maglev_inputs(layout, |id| addr_of_new.get(&id).copied());
            let fp = maglev::fingerprint(self.maglev, &inputs);
            let n = proxy_common::maglev::chunks(self.maglev.table_size);
            if old_maglev.map(|(f, _)| f) != Some(fp) {
                let chunks = maglev::chunks(&maglev::table(self.maglev, &inputs));
                for (i, c) in chunks.iter().enumerate() {
                    let put = (put_chunk(i as u32, c), undo_chunk(i as u32));
                    if late {
                        after_entry.push(put);
                    } else {
                        plan.push(put.0, put.1);
                    }
                }
            }
            if let Some((_, old_n)) = old_maglev {
                maglev_dels.extend(n..old_n);
            }
            maglev_state = Some((fp, n));
        } else if let Some((_, old_n)) = old_maglev {
            maglev_dels.extend(0..old_n);
        }
        let dels = maglev_dels
            .into_iter()
            .map(|chunk| (del_chunk(chunk), undo_chunk(chunk)))
            .collect();
        (maglev_state, dels)
    }

    /// Step 6: backends the old slots named, the new layout does not, and no other
    /// frontend references.
    fn stage_unused_backends(&self, plan: &mut Plan, old_slots: &[u32], layout: &[u32]) {
        if old_slots.is_empty() {
            return;
        }
        let new_set: HashSet<u32> = layout.iter().copied().collect();
        for id in unique(old_slots) {
            if id == 0 || new_set.contains(&id) {
                continue;
            }
            if let Some((key, 1)) = self.backends.get(id) {
                plan.push(
                    Op::DelBackend {
                        id,
                        family: key.0.family(),
                    },
                    Op::PutBackend {
                        id,
                        backend: key.0,
                        proto: key.1,
                    },
                );
            }
        }
    }

    /// Makes the model say what a staged upsert wrote.
    pub(super) fn commit_upsert(&mut self, s: StagedUpsert) {
        for (id, key) in s.new_backend_ids {
            self.backends.insert(id, key, 0, true);
        }
        if s.old_slots.is_empty() {
            // A new frontend (every frontend of a first sync): each of its backends gains
            // one reference, nothing else changes (no sets to build).
            for id in unique(&s.layout) {
                if let Some(refs) = self.backends.refs_mut(id) {
                    *refs += 1;
                }
            }
        } else {
            let old_set: HashSet<u32> = s.old_slots.iter().copied().collect();
            let new_set: HashSet<u32> = s.layout.iter().copied().collect();
            for id in unique(&s.layout) {
                if !old_set.contains(&id) {
                    if let Some(refs) = self.backends.refs_mut(id) {
                        *refs += 1;
                    }
                }
            }
            for id in unique(&s.old_slots) {
                if id != 0 && !new_set.contains(&id) {
                    self.unref_backend(id);
                }
            }
        }
        self.services.insert(
            s.fe,
            Programmed {
                value: s.value,
                name: s.name,
                source_ranges: s.want_ranges,
                slots: s.layout,
                maglev: s.maglev,
            },
        );
    }
}

/// Step 2: the reverse-NAT entry, for a new frontend or a changed name.
fn stage_revnat(
    plan: &mut Plan,
    fe: Frontend,
    service_id: u32,
    old: Option<&Programmed>,
    name: &str,
) {
    let put_revnat = |name: &str| Op::PutRevNat {
        service_id,
        frontend: fe,
        name: name.to_string(),
    };
    match old {
        None => plan.push(
            put_revnat(name),
            Op::DelRevNat {
                service_id,
                family: fe.family(),
            },
        ),
        Some(p) if !crate::model::same_stored_name(&p.name, name) => {
            plan.push(put_revnat(name), put_revnat(&p.name))
        }
        Some(_) => {}
    }
}

/// The source ranges in `these` and not in `others`, written (`put`: `these` are the
/// wanted ones) or deleted (`these` are the old ones), each undone by the opposite.
fn stage_ranges(
    plan: &mut Plan,
    (service_id, put): (u32, bool),
    these: &BTreeSet<(IpAddr, u8)>,
    others: &BTreeSet<(IpAddr, u8)>,
) {
    for r in these.difference(others) {
        plan.push(
            range_op(service_id, put, *r),
            range_op(service_id, !put, *r),
        );
    }
}

/// A source-range write (`put`) or delete.
fn range_op(service_id: u32, put: bool, (addr, prefix): (IpAddr, u8)) -> Op {
    if put {
        Op::PutSrcRange {
            service_id,
            addr,
            prefix,
        }
    } else {
        Op::DelSrcRange {
            service_id,
            addr,
            prefix,
        }
    }
}

/// Step 3: the chunks `>= 1` of slots `25..=layout.len()` that changed, each undone to
/// what it held (deleted if it is new). A chunk the count shrinks within keeps the ids
/// past the new count (the live count still reaches them): its trim is returned, for
/// step 5.
fn stage_chunks(
    plan: &mut Plan,
    fe: Frontend,
    service_id: u32,
    old_slots: &[u32],
    layout: &[u32],
) -> Vec<OpAndUndo> {
    let mut trims = Vec::new();
    for chunk in 1..svc_entries(layout.len()) {
        let (now, before) = (chunk_ids(layout, chunk), chunk_ids(old_slots, chunk));
        if now == before {
            continue;
        }
        let put = |ids: &[u32], trim: bool| Op::PutChunk {
            frontend: fe,
            chunk: chunk as u16,
            backends: ids.into(),
            service_id,
            trim,
        };
        if before.len() > now.len() {
            let kept: Vec<u32> = now.iter().chain(&before[now.len()..]).copied().collect();
            if kept != before {
                plan.push(put(&kept, false), put(before, false));
            }
            trims.push((put(now, true), put(&kept, false)));
            continue;
        }
        let undo = if before.is_empty() {
            Op::DelChunk {
                frontend: fe,
                chunk: chunk as u16,
            }
        } else {
            put(before, false)
        };
        plan.push(put(now, false), undo);
    }
    trims
}

/// Step 4: the frontend's entry, when its fields or its first 24 slots changed.
fn stage_frontend(
    plan: &mut Plan,
    fe: Frontend,
    old: Option<&Programmed>,
    value: FrontendValue,
    layout: &[u32],
) {
    let first = chunk_ids(layout, 0);
    if let Some(p) = old {
        if p.value == value && chunk_ids(&p.slots, 0) == first {
            return;
        }
    }
    plan.push(
        Op::PutFrontend {
            frontend: fe,
            value,
            backends: first.into(),
        },
        match old {
            Some(p) => Op::PutFrontend {
                frontend: fe,
                value: p.value,
                backends: chunk_ids(&p.slots, 0).into(),
            },
            None => Op::DelChunk {
                frontend: fe,
                chunk: 0,
            },
        },
    );
}

/// Step 5: the chunks past the new count's deleted, then what goes after the frontend's
/// entry (`trims`, from step 3: the chunk the count shrank within trimmed, a Maglev table
/// in use).
fn stage_surplus_chunks(
    plan: &mut Plan,
    fe: Frontend,
    service_id: u32,
    old_slots: &[u32],
    new_count: usize,
    trims: Vec<OpAndUndo>,
) {
    for chunk in svc_entries(new_count)..svc_entries(old_slots.len()) {
        plan.push(
            Op::DelChunk {
                frontend: fe,
                chunk: chunk as u16,
            },
            Op::PutChunk {
                frontend: fe,
                chunk: chunk as u16,
                backends: chunk_ids(old_slots, chunk).into(),
                service_id,
                trim: false,
            },
        );
    }
    for (op, undo) in trims {
        plan.push(op, undo);
    }
}

/// Checks an entry before anything is written; returns its backends without duplicates,
/// in the given order.
pub(super) fn validate(entry: &ServiceEntry) -> Result<Vec<Backend>, WriteError> {
    let fe = entry.frontend;
    if fe.port == 0 {
        return Err(WriteError::ZeroPort { frontend: fe });
    }
    let mut seen = HashSet::default();
    // Few backends (most Services): duplicates found by a scan of those kept, no set.
    let small = entry.backends.len() <= SMALL;
    let mut out: Vec<Backend> = Vec::with_capacity(entry.backends.len());
    for b in &entry.backends {
        if b.family() != fe.family() {
            return Err(WriteError::FamilyMismatch {
                frontend: fe,
                backend: *b,
            });
        }
        if b.addr.port() == 0 {
            return Err(WriteError::ZeroBackendPort {
                frontend: fe,
                backend: *b,
            });
        }
        let new = if small {
            !out.contains(b)
        } else {
            seen.insert(*b)
        };
        if new {
            out.push(*b);
        }
    }
    if out.len() > MAX_BACKENDS_PER_SERVICE as usize {
        return Err(WriteError::TooManyBackends {
            frontend: fe,
            count: out.len(),
        });
    }
    Ok(out)
}

/// The new slot order: backends that stay keep their slot, newcomers fill the holes
/// left by departed ones and then go at the end, and the tail is moved into remaining
/// holes so slots stay dense. Minimises rewritten slots.
pub(super) fn stable_layout(old: &[u32], wanted: &[u32]) -> Vec<u32> {
    if old.is_empty() {
        // A new frontend: every wanted id a newcomer, in order (what the steps below
        // give without old slots).
        return wanted.to_vec();
    }
    let wanted_set: HashSet<u32> = wanted.iter().copied().collect();
    let mut layout: Vec<Option<u32>> = old
        .iter()
        .map(|id| (*id != 0 && wanted_set.contains(id)).then_some(*id))
        .collect();
    // Keep the first occurrence only (an adopted map could repeat an id).
    let mut placed = HashSet::default();
    for s in layout.iter_mut() {
        if let Some(id) = *s {
            if !placed.insert(id) {
                *s = None;
            }
        }
    }
    let mut newcomers = wanted.iter().filter(|id| !placed.contains(*id)).copied();
    for s in layout.iter_mut() {
        if s.is_none() {
            *s = newcomers.next();
        }
    }
    layout.extend(newcomers.map(Some));
    // Compact: move the last entries into holes.
    let mut i = 0;
    while i < layout.len() {
        if layout[i].is_none() {
            while matches!(layout.last(), Some(None)) {
                layout.pop();
            }
            if i < layout.len() {
                layout.swap_remove(i);
            }
        }
        i += 1;
    }
    while matches!(layout.last(), Some(None)) {
        layout.pop();
    }
    layout.into_iter().flatten().collect()
}

pub(super) fn slot_no(index: usize) -> u16 {
    // validate() bounds the number of backends to u16::MAX.
    (index + 1) as u16
}

pub(super) fn unique(ids: &[u32]) -> Vec<u32> {
    if ids.len() <= SMALL {
        let mut out: Vec<u32> = Vec::with_capacity(ids.len());
        for id in ids {
            if !out.contains(id) {
                out.push(*id);
            }
        }
        return out;
    }
    let mut seen = HashSet::default();
    ids.iter().copied().filter(|id| seen.insert(*id)).collect()
}

/// Up to this many ids or backends, duplicates are found by scanning those kept (no hash
/// set: the writer plans every frontend of a first sync, most with a few backends).
const SMALL: usize = 16;
