//! The map writer: keeps the service maps equal to a desired set of [`ServiceEntry`]s,
//! writing only what changed, in an order that never shows the datapath a half-written
//! frontend (after katran's `KatranLb` and cilium's service manager).
//!
//! Update order for one frontend:
//! 1. new backends (`BACKEND` entries for newly allocated ids);
//! 2. the reverse-NAT entry, for a new frontend;
//! 3. changed or new slots `1..=new_count` (slots beyond the live count are invisible to
//!    the datapath; a slot within it is replaced atomically by one map update);
//! 4. slot 0 with the new count (growing makes the new slots visible here, shrinking
//!    hides the surplus ones here);
//! 5. surplus slots `new_count+1..=old_count` deleted;
//! 6. backends no frontend references any more deleted.
//!
//! Removing a frontend deletes slot 0 first (it disappears atomically), then its slots,
//! its reverse-NAT entry and unreferenced backends.
//!
//! If a write fails (a full map, say), the writes already made for that frontend are
//! undone in reverse order, the in-memory model is left as it was, and the error names
//! the frontend: a frontend is either fully programmed or left as before.

use std::{
    collections::{BTreeMap, BTreeSet, HashMap, HashSet},
    net::IpAddr,
};

use proxy_common::limits::MAX_BACKENDS_PER_SERVICE;

use crate::{
    model::{Backend, Frontend, Proto, ServiceEntry},
    store::{Dump, FrontendValue, MapStore, Op, StoreError},
};

/// Why a frontend could not be programmed. Every variant names the frontend.
#[derive(Debug, thiserror::Error)]
pub enum WriteError {
    #[error("frontend {frontend}: backend {backend} is not of the frontend's address family")]
    FamilyMismatch {
        frontend: Frontend,
        backend: Backend,
    },
    #[error("frontend {frontend}: port 0 is not a valid service port")]
    ZeroPort { frontend: Frontend },
    #[error("frontend {frontend}: backend {backend} has port 0")]
    ZeroBackendPort {
        frontend: Frontend,
        backend: Backend,
    },
    #[error("frontend {frontend}: {count} backends, at most {MAX_BACKENDS_PER_SERVICE} allowed")]
    TooManyBackends { frontend: Frontend, count: usize },
    #[error("frontend {frontend}: {source} (changes for this frontend rolled back{})",
        if *.rollback_failed { " incompletely" } else { "" })]
    Store {
        frontend: Frontend,
        #[source]
        source: StoreError,
        rollback_failed: bool,
    },
}

impl WriteError {
    /// A short machine-readable cause, for metrics labels.
    pub fn reason(&self) -> &'static str {
        match self {
            WriteError::FamilyMismatch { .. } => "family_mismatch",
            WriteError::ZeroPort { .. } | WriteError::ZeroBackendPort { .. } => "zero_port",
            WriteError::TooManyBackends { .. } => "too_many_backends",
            WriteError::Store {
                source: StoreError::Full { .. },
                ..
            } => "map_full",
            WriteError::Store { .. } => "map_write",
        }
    }
}

/// What a frontend looks like in the maps, as the writer last wrote it.
#[derive(Clone, Debug, PartialEq, Eq)]
struct Programmed {
    value: FrontendValue,
    /// The Service name written in the reverse-NAT entry.
    name: String,
    /// Allowed source ranges written for this frontend's service id.
    source_ranges: BTreeSet<(IpAddr, u8)>,
    /// Backend id of slot `i + 1`; 0 marks a slot found missing when adopting.
    slots: Vec<u32>,
}

/// Allocates the lowest free id, starting at 1 (0 means "none" in the maps), in
/// O(log n): ids below `next` that were freed wait in `free`.
#[derive(Debug)]
struct IdAlloc {
    next: u32,
    free: BTreeSet<u32>,
}

impl Default for IdAlloc {
    fn default() -> Self {
        Self {
            next: 1,
            free: BTreeSet::new(),
        }
    }
}

impl IdAlloc {
    fn alloc(&mut self) -> u32 {
        self.free.pop_first().unwrap_or_else(|| {
            self.next += 1;
            self.next - 1
        })
    }

    fn free(&mut self, id: u32) {
        if id + 1 == self.next {
            self.next -= 1;
            while self.next > 1 && self.free.remove(&(self.next - 1)) {
                self.next -= 1;
            }
        } else if id < self.next {
            self.free.insert(id);
        }
    }

    /// Marks an id found in use (adoption).
    fn mark(&mut self, id: u32) {
        if id >= self.next {
            self.free.extend(self.next..id);
            self.next = id + 1;
        } else {
            self.free.remove(&id);
        }
    }
}

type BackendKey = (Backend, Proto);

/// The result of a [`Writer::sync`].
#[derive(Debug, Default)]
pub struct SyncReport {
    /// Map operations applied.
    pub ops: usize,
    /// Frontends written (new or changed).
    pub changed: usize,
    /// Frontends removed.
    pub removed: usize,
    /// Frontends that could not be programmed (each left as it was).
    pub errors: Vec<WriteError>,
}

/// What adoption found and repaired in maps left by a previous agent.
#[derive(Debug, Default, PartialEq, Eq)]
pub struct AdoptReport {
    pub frontends: usize,
    pub backends: usize,
    /// Entries no frontend reaches (slots past a count, unreferenced backends, reverse-NAT
    /// entries without a frontend), deleted.
    pub orphans_deleted: usize,
    /// Slots missing below a frontend's count; rewritten on the next write of it.
    pub missing_slots: usize,
}

/// Keeps the maps of one [`MapStore`] in step with desired service entries.
#[derive(Debug)]
pub struct Writer<S> {
    store: S,
    services: BTreeMap<Frontend, Programmed>,
    /// Canonical id of each backend.
    backend_ids: HashMap<BackendKey, u32>,
    /// Every live backend id: its backend and how many frontends reference it.
    backend_refs: BTreeMap<u32, (BackendKey, u32)>,
    backend_alloc: IdAlloc,
    service_alloc: IdAlloc,
    /// UDP backends no frontend uses any more, since the last [`Self::take_released_udp`].
    released_udp: Vec<std::net::SocketAddr>,
}

impl<S: MapStore> Writer<S> {
    /// A writer over empty maps.
    pub fn new(store: S) -> Self {
        Self {
            store,
            services: BTreeMap::new(),
            backend_ids: HashMap::new(),
            backend_refs: BTreeMap::new(),
            backend_alloc: IdAlloc::default(),
            service_alloc: IdAlloc::default(),
            released_udp: Vec::new(),
        }
    }

    /// The addresses of the UDP backends that left the maps since the last call and are
    /// not back (connected sockets to them are stale: see `sockdestroy`).
    pub fn take_released_udp(&mut self) -> Vec<std::net::SocketAddr> {
        let mut gone = std::mem::take(&mut self.released_udp);
        gone.sort();
        gone.dedup();
        if !gone.is_empty() {
            let live: HashSet<std::net::SocketAddr> = self
                .backend_ids
                .keys()
                .filter(|(_, p)| *p == Proto::Udp)
                .map(|(b, _)| b.addr)
                .collect();
            gone.retain(|a| !live.contains(a));
        }
        gone
    }

    /// A writer over maps that may hold a previous agent's state: reads them back,
    /// rebuilds the model (ids, reference counts) and deletes entries nothing reaches.
    /// Nothing the datapath uses is touched.
    pub fn adopt(store: S) -> Result<(Self, AdoptReport), StoreError> {
        let dump = store.dump()?;
        let mut w = Self::new(store);
        let mut report = AdoptReport::default();
        let mut orphans = Vec::new();

        for (id, (backend, proto)) in &dump.backends {
            w.backend_alloc.mark(*id);
            w.backend_ids.entry((*backend, *proto)).or_insert(*id);
            w.backend_refs.insert(*id, ((*backend, *proto), 0));
        }
        for (fe, value) in &dump.frontends {
            w.service_alloc.mark(value.service_id);
            let mut slots = Vec::with_capacity(usize::from(value.count));
            for slot in 1..=value.count {
                let id = match dump.slots.get(&(*fe, slot)) {
                    Some(id) if w.backend_refs.contains_key(id) => *id,
                    _ => {
                        report.missing_slots += 1;
                        0
                    }
                };
                if let Some((_, refs)) = w.backend_refs.get_mut(&id) {
                    // One reference per frontend, even if two slots share an id.
                    if !slots.contains(&id) {
                        *refs += 1;
                    }
                }
                slots.push(id);
            }
            w.services.insert(
                *fe,
                Programmed {
                    value: *value,
                    name: String::new(),
                    source_ranges: dump
                        .src_ranges
                        .iter()
                        .filter(|(id, _, _)| *id == value.service_id)
                        .map(|(_, a, p)| (*a, *p))
                        .collect(),
                    slots,
                },
            );
        }
        for (fe, slot) in dump.slots.keys() {
            let live = w
                .services
                .get(fe)
                .is_some_and(|p| usize::from(*slot) <= p.slots.len());
            if !live {
                orphans.push(Op::DelSlot {
                    frontend: *fe,
                    slot: *slot,
                });
            }
        }
        for (id, (fe, _)) in &dump.revnat {
            let live = w
                .services
                .get(fe)
                .is_some_and(|p| p.value.service_id == *id);
            if !live {
                orphans.push(Op::DelRevNat {
                    service_id: *id,
                    family: fe.family(),
                });
            }
        }
        let live_ids: HashSet<u32> = w.services.values().map(|p| p.value.service_id).collect();
        for (id, addr, prefix) in &dump.src_ranges {
            if !live_ids.contains(id) {
                orphans.push(Op::DelSrcRange {
                    service_id: *id,
                    addr: *addr,
                    prefix: *prefix,
                });
            }
        }
        // A frontend whose reverse-NAT entry is missing gets it back.
        for (fe, p) in w.services.iter_mut() {
            match dump.revnat.get(&p.value.service_id) {
                Some((f, name)) if f == fe => p.name = name.clone(),
                _ => orphans.push(Op::PutRevNat {
                    service_id: p.value.service_id,
                    frontend: *fe,
                    name: String::new(),
                }),
            }
        }
        let unreferenced: Vec<(u32, BackendKey)> = w
            .backend_refs
            .iter()
            .filter(|(_, (_, refs))| *refs == 0)
            .map(|(id, (key, _))| (*id, *key))
            .collect();
        for (id, key) in unreferenced {
            w.backend_refs.remove(&id);
            if w.backend_ids.get(&key) == Some(&id) {
                w.backend_ids.remove(&key);
            }
            w.backend_alloc.free(id);
            orphans.push(Op::DelBackend {
                id,
                family: key.0.family(),
            });
        }
        for op in &orphans {
            w.store.apply(op)?;
        }
        report.frontends = w.services.len();
        report.backends = w.backend_refs.len();
        report.orphans_deleted = orphans
            .iter()
            .filter(|op| !matches!(op, Op::PutRevNat { .. }))
            .count();
        Ok((w, report))
    }

    /// The store, for reading counters or dumps.
    pub fn store(&self) -> &S {
        &self.store
    }

    pub fn store_mut(&mut self) -> &mut S {
        &mut self.store
    }

    /// Frontends currently programmed.
    pub fn frontends(&self) -> impl Iterator<Item = &Frontend> {
        self.services.keys()
    }

    /// Number of distinct backends currently programmed.
    pub fn backend_count(&self) -> usize {
        self.backend_refs.len()
    }

    /// Makes the maps hold exactly `desired`: removes frontends not in it, writes the
    /// changed ones. A frontend that fails is reported and left as it was; the rest are
    /// still written.
    pub fn sync(&mut self, desired: impl IntoIterator<Item = ServiceEntry>) -> SyncReport {
        let desired: BTreeMap<Frontend, ServiceEntry> =
            desired.into_iter().map(|e| (e.frontend, e)).collect();
        let mut report = SyncReport::default();
        // Removals first: they free map room for the additions.
        let gone: Vec<Frontend> = self
            .services
            .keys()
            .filter(|fe| !desired.contains_key(fe))
            .copied()
            .collect();
        for fe in gone {
            match self.remove(&fe) {
                Ok(n) => {
                    report.ops += n;
                    report.removed += 1;
                }
                Err(e) => report.errors.push(e),
            }
        }
        for entry in desired.values() {
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

    /// Installs or updates one frontend. Returns the number of map operations (0 when the
    /// maps already match).
    pub fn upsert(&mut self, entry: &ServiceEntry) -> Result<usize, WriteError> {
        let fe = entry.frontend;
        let backends = validate(entry)?;
        let old = self.services.get(&fe).cloned();
        let old_slots: &[u32] = old.as_ref().map_or(&[], |p| &p.slots);

        let mut ops = Vec::new();
        let mut undo = Vec::new();
        let mut new_backend_ids = Vec::new();
        let mut ids = Vec::with_capacity(backends.len());
        for b in &backends {
            let key = (*b, fe.proto);
            let id = match self.backend_ids.get(&key) {
                Some(id) => *id,
                None => {
                    let id = self.backend_alloc.alloc();
                    new_backend_ids.push((id, key));
                    ops.push(Op::PutBackend {
                        id,
                        backend: *b,
                        proto: fe.proto,
                    });
                    undo.push(Op::DelBackend {
                        id,
                        family: b.family(),
                    });
                    id
                }
            };
            ids.push(id);
        }

        let (service_id, new_service_id) = match &old {
            Some(p) => (p.value.service_id, false),
            None => (self.service_alloc.alloc(), true),
        };
        match &old {
            None => {
                ops.push(Op::PutRevNat {
                    service_id,
                    frontend: fe,
                    name: entry.name.clone(),
                });
                undo.push(Op::DelRevNat {
                    service_id,
                    family: fe.family(),
                });
            }
            Some(p) if p.name != entry.name => {
                ops.push(Op::PutRevNat {
                    service_id,
                    frontend: fe,
                    name: entry.name.clone(),
                });
                undo.push(Op::PutRevNat {
                    service_id,
                    frontend: fe,
                    name: p.name.clone(),
                });
            }
            Some(_) => {}
        }

        let want_ranges: BTreeSet<(IpAddr, u8)> = entry.source_ranges.iter().copied().collect();
        let old_ranges = old
            .as_ref()
            .map(|p| p.source_ranges.clone())
            .unwrap_or_default();
        for (addr, prefix) in want_ranges.difference(&old_ranges) {
            ops.push(Op::PutSrcRange {
                service_id,
                addr: *addr,
                prefix: *prefix,
            });
            undo.push(Op::DelSrcRange {
                service_id,
                addr: *addr,
                prefix: *prefix,
            });
        }

        let layout = stable_layout(old_slots, &ids);
        for (i, id) in layout.iter().enumerate() {
            let slot = slot_no(i);
            let before = old_slots.get(i).copied();
            if before == Some(*id) {
                continue;
            }
            ops.push(Op::PutSlot {
                frontend: fe,
                slot,
                backend_id: *id,
                service_id,
            });
            undo.push(match before {
                Some(prev) if prev != 0 => Op::PutSlot {
                    frontend: fe,
                    slot,
                    backend_id: prev,
                    service_id,
                },
                _ => Op::DelSlot { frontend: fe, slot },
            });
        }

        let value = FrontendValue {
            service_id,
            count: layout.len() as u16,
            flags: entry.flags,
            affinity_timeout: entry.affinity_timeout,
        };
        if old.as_ref().map(|p| p.value) != Some(value) {
            ops.push(Op::PutFrontend {
                frontend: fe,
                value,
            });
            undo.push(match &old {
                Some(p) => Op::PutFrontend {
                    frontend: fe,
                    value: p.value,
                },
                None => Op::DelSlot {
                    frontend: fe,
                    slot: 0,
                },
            });
        }

        for (i, old_id) in old_slots.iter().enumerate().skip(layout.len()) {
            let slot = slot_no(i);
            ops.push(Op::DelSlot { frontend: fe, slot });
            undo.push(Op::PutSlot {
                frontend: fe,
                slot,
                backend_id: *old_id,
                service_id,
            });
        }

        for (addr, prefix) in old_ranges.difference(&want_ranges) {
            ops.push(Op::DelSrcRange {
                service_id,
                addr: *addr,
                prefix: *prefix,
            });
            undo.push(Op::PutSrcRange {
                service_id,
                addr: *addr,
                prefix: *prefix,
            });
        }

        // Backends this frontend stops using and nobody else uses.
        let new_set: HashSet<u32> = layout.iter().copied().collect();
        let mut released = Vec::new();
        for id in unique(old_slots) {
            if id == 0 || new_set.contains(&id) {
                continue;
            }
            if let Some((key, refs)) = self.backend_refs.get(&id) {
                if *refs == 1 {
                    released.push(id);
                    ops.push(Op::DelBackend {
                        id,
                        family: key.0.family(),
                    });
                    undo.push(Op::PutBackend {
                        id,
                        backend: key.0,
                        proto: key.1,
                    });
                }
            }
        }

        if let Err((source, rollback_failed)) = self.apply_all(&ops, &undo) {
            for (id, _) in &new_backend_ids {
                self.backend_alloc.free(*id);
            }
            if new_service_id {
                self.service_alloc.free(service_id);
            }
            return Err(WriteError::Store {
                frontend: fe,
                source,
                rollback_failed,
            });
        }

        // Commit the model.
        for (id, key) in new_backend_ids {
            self.backend_ids.insert(key, id);
            self.backend_refs.insert(id, (key, 0));
        }
        let old_set: HashSet<u32> = old_slots.iter().copied().collect();
        for id in unique(&layout) {
            if !old_set.contains(&id) {
                if let Some((_, refs)) = self.backend_refs.get_mut(&id) {
                    *refs += 1;
                }
            }
        }
        for id in unique(old_slots) {
            if id != 0 && !new_set.contains(&id) {
                self.unref_backend(id);
            }
        }
        debug_assert!(released
            .iter()
            .all(|id| !self.backend_refs.contains_key(id)));
        self.services.insert(
            fe,
            Programmed {
                value,
                name: entry.name.clone(),
                source_ranges: want_ranges,
                slots: layout,
            },
        );
        Ok(ops.len())
    }

    /// Removes one frontend. Returns the number of map operations (0 if it was absent).
    pub fn remove(&mut self, fe: &Frontend) -> Result<usize, WriteError> {
        let Some(old) = self.services.get(fe).cloned() else {
            return Ok(0);
        };
        let sid = old.value.service_id;
        let mut ops = vec![Op::DelSlot {
            frontend: *fe,
            slot: 0,
        }];
        let mut undo = vec![Op::PutFrontend {
            frontend: *fe,
            value: old.value,
        }];
        for (i, id) in old.slots.iter().enumerate() {
            ops.push(Op::DelSlot {
                frontend: *fe,
                slot: slot_no(i),
            });
            undo.push(Op::PutSlot {
                frontend: *fe,
                slot: slot_no(i),
                backend_id: *id,
                service_id: sid,
            });
        }
        for (addr, prefix) in &old.source_ranges {
            ops.push(Op::DelSrcRange {
                service_id: sid,
                addr: *addr,
                prefix: *prefix,
            });
            undo.push(Op::PutSrcRange {
                service_id: sid,
                addr: *addr,
                prefix: *prefix,
            });
        }
        ops.push(Op::DelRevNat {
            service_id: sid,
            family: fe.family(),
        });
        undo.push(Op::PutRevNat {
            service_id: sid,
            frontend: *fe,
            name: old.name.clone(),
        });
        for id in unique(&old.slots) {
            if let Some((key, 1)) = self.backend_refs.get(&id) {
                ops.push(Op::DelBackend {
                    id,
                    family: key.0.family(),
                });
                undo.push(Op::PutBackend {
                    id,
                    backend: key.0,
                    proto: key.1,
                });
            }
        }
        if let Err((source, rollback_failed)) = self.apply_all(&ops, &undo) {
            return Err(WriteError::Store {
                frontend: *fe,
                source,
                rollback_failed,
            });
        }
        for id in unique(&old.slots) {
            if id != 0 {
                self.unref_backend(id);
            }
        }
        self.service_alloc.free(sid);
        self.services.remove(fe);
        Ok(ops.len())
    }

    /// The maps as the model believes them to be (compare with `store().dump()`).
    pub fn expected_dump(&self) -> Dump {
        let mut d = Dump::default();
        for (fe, p) in &self.services {
            d.frontends.insert(*fe, p.value);
            d.revnat.insert(p.value.service_id, (*fe, p.name.clone()));
            for (a, pfx) in &p.source_ranges {
                d.src_ranges.insert((p.value.service_id, *a, *pfx));
            }
            for (i, id) in p.slots.iter().enumerate() {
                d.slots.insert((*fe, slot_no(i)), *id);
            }
        }
        for (id, (key, _)) in &self.backend_refs {
            d.backends.insert(*id, *key);
        }
        d
    }

    fn unref_backend(&mut self, id: u32) {
        let Some((key, refs)) = self.backend_refs.get_mut(&id) else {
            return;
        };
        *refs -= 1;
        if *refs == 0 {
            let key = *key;
            if key.1 == Proto::Udp {
                self.released_udp.push(key.0.addr);
            }
            self.backend_refs.remove(&id);
            if self.backend_ids.get(&key) == Some(&id) {
                self.backend_ids.remove(&key);
            }
            self.backend_alloc.free(id);
        }
    }

    /// Applies `ops` in order; on failure undoes the applied ones in reverse order.
    fn apply_all(&mut self, ops: &[Op], undo: &[Op]) -> Result<(), (StoreError, bool)> {
        debug_assert_eq!(ops.len(), undo.len());
        for (i, op) in ops.iter().enumerate() {
            if let Err(e) = self.store.apply(op) {
                let mut rollback_failed = false;
                for u in undo[..i].iter().rev() {
                    rollback_failed |= self.store.apply(u).is_err();
                }
                return Err((e, rollback_failed));
            }
        }
        Ok(())
    }
}

/// Checks an entry before anything is written; returns its backends without duplicates,
/// in the given order.
fn validate(entry: &ServiceEntry) -> Result<Vec<Backend>, WriteError> {
    let fe = entry.frontend;
    if fe.port == 0 {
        return Err(WriteError::ZeroPort { frontend: fe });
    }
    let mut seen = HashSet::new();
    let mut out = Vec::with_capacity(entry.backends.len());
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
        if seen.insert(*b) {
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
fn stable_layout(old: &[u32], wanted: &[u32]) -> Vec<u32> {
    let wanted_set: HashSet<u32> = wanted.iter().copied().collect();
    let mut layout: Vec<Option<u32>> = old
        .iter()
        .map(|id| (*id != 0 && wanted_set.contains(id)).then_some(*id))
        .collect();
    // Keep the first occurrence only (an adopted map could repeat an id).
    let mut placed = HashSet::new();
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

fn slot_no(index: usize) -> u16 {
    // validate() bounds the number of backends to u16::MAX.
    (index + 1) as u16
}

fn unique(ids: &[u32]) -> Vec<u32> {
    let mut seen = HashSet::new();
    ids.iter().copied().filter(|id| seen.insert(*id)).collect()
}

#[cfg(test)]
mod tests;
