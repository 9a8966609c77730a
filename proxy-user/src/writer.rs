//! The map writer: keeps the service maps equal to a desired set of [`ServiceEntry`]s,
//! writing only what changed, in an order that never shows the datapath a half-written
//! frontend (after katran's `KatranLb` and cilium's service manager).
//!
//! A frontend's `SVC` entry (chunk 0) holds its count, service id, flags and the backend
//! ids of slots `1..=24`; a frontend with more backends has further entries (chunks
//! `c >= 1`) of 24 slots each (`proxy_common::SVC_CHUNK_SLOTS`). Update order for one
//! frontend:
//! 1. new backends (`BACKEND` entries for newly allocated ids);
//! 2. the reverse-NAT entry, for a new frontend;
//! 3. changed or new chunks `>= 1` (slots beyond the live count are invisible to the
//!    datapath; a chunk within it is replaced atomically by one map update, and a chunk
//!    the count shrinks within keeps its ids past the new count until step 5);
//!    then, for a frontend with `svc_flags::MAGLEV`, its Maglev table (`MAGLEV` chunks)
//!    when it changed: it names slots `1..=new_count`, all written by now, and the flag
//!    in the frontend's entry that makes the datapath read it comes next;
//! 4. the frontend's entry with the new count and slots `1..=24`, in one update (growing
//!    makes the new slots visible here, shrinking hides the surplus ones here);
//! 5. surplus chunks deleted, a chunk the count shrank within rewritten without the ids
//!    past it (`Op::PutChunk { trim: true }`);
//! 6. backends no frontend references any more deleted.
//!
//! Removing a frontend deletes its entry first (it disappears atomically, with its first
//! 24 slots), then its further chunks and Maglev table, its reverse-NAT entry and
//! unreferenced backends. Turning Maglev off rewrites the frontend's entry without the
//! flag first, then deletes the table.
//!
//! If a write fails (a full map, say), the writes already made for that frontend are
//! undone in reverse order, the in-memory model is left as it was, and the error names
//! the frontend: a frontend is either fully programmed or left as before.
//!
//! Every write is planned as a [`Plan`]: each op with the op that undoes it.
//!
//! **Batches.** A [`Writer::sync`] that writes many frontends (at least
//! [`BATCH_MIN_FRONTENDS`]: the first sync, a relist, the periodic full re-diff) writes
//! in rounds of [`BATCH_CHUNK_FRONTENDS`] frontends (removals first, then upserts in
//! their order): each round plans its frontends and then writes phase by phase across
//! all of them, one batch call per phase and map (`BPF_MAP_UPDATE_BATCH` /
//! `BPF_MAP_DELETE_BATCH`): removals (frontend entries, their chunks, source ranges,
//! reverse NAT, backends), then the order above (backends, reverse NAT, source ranges,
//! chunks, frontend entries, surplus and trimmed chunks, stale source ranges, backends). A group of at least [`SPLIT_MIN_OPS`]
//! inserts is written as two batch calls at once, on two threads (`split.rs`: the
//! kernel's per-element allocation scales across CPUs); the next phase waits for both. Each frontend's own writes keep the
//! update order (all of a frontend's ops are in one round); ops of different frontends
//! never touch one entry (ids freed during a round are only reused after it). Only one
//! round's ops are held at once. A batch call that fails is finished element by element
//! (`store::write_batch`); an element that fails even alone undoes every write of its
//! round in reverse phase order, the model is brought back to the end of the previous
//! round (restored from before the sync, then the written rounds planned again without
//! writing: planning is deterministic), and the rest of the sync is run frontend by
//! frontend, which names the failing frontend and rolls back just it.

use std::{
    collections::{BTreeMap, BTreeSet},
    net::IpAddr,
};

use crate::fasthash::HashSet;

use proxy_common::limits::MAX_BACKENDS_PER_SERVICE;
use tracing::warn;

use crate::{
    maglev::{self, Params as MaglevParams},
    model::{Backend, Frontend, Proto},
    store::{Dump, FrontendValue, MapStore, Op, Snat, StoreError, WriteCounts},
};

/// A sync writing at least this many frontends writes in batches.
pub const BATCH_MIN_FRONTENDS: usize = 32;

/// A batched sync plans and writes this many frontends per round: the ops (and their
/// undo ops) held at once are those of one round, not of the whole sync (2.2 million at
/// 50,000 Services x 10 endpoints), while each batch call still carries tens of
/// thousands of elements.
pub const BATCH_CHUNK_FRONTENDS: usize = 4096;

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
    /// The cause, as metrics count it.
    pub fn reason(&self) -> Refusal {
        match self {
            WriteError::FamilyMismatch { .. } => Refusal::FamilyMismatch,
            WriteError::ZeroPort { .. } | WriteError::ZeroBackendPort { .. } => Refusal::ZeroPort,
            WriteError::TooManyBackends { .. } => Refusal::TooManyBackends,
            WriteError::Store {
                source: StoreError::Full { .. },
                ..
            } => Refusal::MapFull,
            WriteError::Store { .. } => Refusal::MapWrite,
        }
    }
}

/// Why the writer did not program a frontend ([`WriteError::reason`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Refusal {
    FamilyMismatch,
    ZeroPort,
    TooManyBackends,
    MapFull,
    MapWrite,
}

impl Refusal {
    /// The metric label.
    pub fn label(self) -> &'static str {
        match self {
            Refusal::FamilyMismatch => "family_mismatch",
            Refusal::ZeroPort => "zero_port",
            Refusal::TooManyBackends => "too_many_backends",
            Refusal::MapFull => "map_full",
            Refusal::MapWrite => "map_write",
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
    /// The Maglev table written for it: `(fingerprint of what it was computed from,
    /// chunks)`; fingerprint 0 for a table adopted whose content is not the one the
    /// current parameters give (rewritten by the next upsert).
    maglev: Option<(u64, u32)>,
}

/// Allocates the lowest free id, starting at 1 (0 means "none" in the maps), in
/// O(log n): ids below `next` that were freed wait in `free`.
#[derive(Clone, Debug)]
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
    /// Slots missing below a frontend's count, or naming a backend that is missing or of
    /// another protocol or family; rewritten on the next write of it.
    pub missing_slots: usize,
    /// Broken entries repaired, by kind; each is logged.
    pub repairs: BTreeMap<Repair, usize>,
}

impl AdoptReport {
    fn repair(&mut self, kind: Repair) {
        *self.repairs.entry(kind).or_default() += 1;
    }
}

/// A kind of broken pinned entry adoption repairs (`adoption_repairs_total{kind}`).
/// Declared in the order of the labels, so a report lists them as before.
#[derive(Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Repair {
    /// A slot naming a backend that is not there.
    DanglingSlot,
    /// Two frontends with the same service id (one gets a new id).
    DuplicateServiceId,
    /// A Maglev table not computed from what it is found with (rewritten).
    MaglevTableStale,
    /// A slot missing below a frontend's count.
    MissingSlot,
    /// A reverse-NAT entry naming another frontend (rewritten).
    RevnatRewritten,
    /// A slot naming a backend of another protocol or family.
    SlotBackendMismatch,
}

impl Repair {
    /// The metric label.
    pub fn label(self) -> &'static str {
        match self {
            Repair::DanglingSlot => "dangling_slot",
            Repair::DuplicateServiceId => "duplicate_service_id",
            Repair::MaglevTableStale => "maglev_table_stale",
            Repair::MissingSlot => "missing_slot",
            Repair::RevnatRewritten => "revnat_rewritten",
            Repair::SlotBackendMismatch => "slot_backend_mismatch",
        }
    }
}

/// Logged as its label.
impl std::fmt::Debug for Repair {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{:?}", self.label())
    }
}

/// Keeps the maps of one [`MapStore`] in step with desired service entries.
#[derive(Debug)]
pub struct Writer<S> {
    store: S,
    services: Programs,
    /// Every live backend id: its backend and how many frontends reference it; the
    /// canonical id of each backend.
    backends: Backends,
    backend_alloc: IdAlloc,
    service_alloc: IdAlloc,
    /// UDP backends no frontend uses any more, since the last [`Self::take_released_udp`].
    released_udp: Vec<std::net::SocketAddr>,
    /// `NODE_ADDRS4/6` and `NODE_CONFIG` as last written.
    node_addrs: BTreeSet<IpAddr>,
    snat: Snat,
    /// Frontends a sync must write for it to use batches.
    batch_min: usize,
    /// Frontends planned and written per round of a batched sync.
    batch_chunk: usize,
    /// Elements written by batch and one by one, since the last take.
    counts: WriteCounts,
    /// During a batched sync: ids freed (true: backend, false: service), released only
    /// once the sync is written so that no id is deleted and reused within one batch.
    deferred_frees: Option<Vec<(bool, u32)>>,
    /// Table size and seed of the Maglev tables (`--maglev-table-size`, `--maglev-seed`).
    maglev: MaglevParams,
    /// The most entries each map sized to demand may grow to (`--service-map-entries`
    /// for the service maps); `None`: they are never grown.
    ceilings: Option<crate::loader::Sizes>,
    /// Growths of the service maps since the last [`Self::take_svc_growths`].
    svc_growths: Vec<SvcGrowth>,
}

/// The model's state, saved before a batched sync (restored if it fails).
struct Saved {
    services: Programs,
    backends: Backends,
    backend_alloc: IdAlloc,
    service_alloc: IdAlloc,
    released_udp: Vec<std::net::SocketAddr>,
}

/// An upsert planned but not yet written.
struct StagedUpsert {
    fe: Frontend,
    plan: Plan,
    new_backend_ids: Vec<(u32, BackendKey)>,
    service_id: u32,
    new_service_id: bool,
    value: FrontendValue,
    layout: Vec<u32>,
    old_slots: Vec<u32>,
    want_ranges: BTreeSet<(IpAddr, u8)>,
    name: String,
    maglev: Option<(u64, u32)>,
}

impl<S: MapStore> Writer<S> {
    /// A writer over empty maps.
    pub fn new(store: S) -> Self {
        Self {
            store,
            services: Programs::default(),
            backends: Backends::default(),
            backend_alloc: IdAlloc::default(),
            service_alloc: IdAlloc::default(),
            released_udp: Vec::new(),
            node_addrs: BTreeSet::new(),
            snat: Snat::default(),
            batch_min: BATCH_MIN_FRONTENDS,
            batch_chunk: BATCH_CHUNK_FRONTENDS,
            counts: WriteCounts::default(),
            deferred_frees: None,
            maglev: MaglevParams::default(),
            ceilings: None,
            svc_growths: Vec::new(),
        }
    }

    /// Sets the Maglev table size and seed (before the first sync or adoption: tables
    /// written with other parameters are rewritten by the next upsert of their frontend).
    pub fn set_maglev_params(&mut self, params: MaglevParams) {
        self.maglev = params;
    }

    /// The Maglev parameters in use.
    pub fn maglev_params(&self) -> MaglevParams {
        self.maglev
    }

    /// The `(backend address, slot)` pairs a frontend's table is computed from, for the
    /// slot layout `layout` (0: a missing slot, skipped); `addr_of` names a backend id.
    fn maglev_inputs(
        layout: &[u32],
        addr_of: impl Fn(u32) -> Option<std::net::SocketAddr>,
    ) -> Vec<(std::net::SocketAddr, u16)> {
        let mut seen = HashSet::default();
        layout
            .iter()
            .enumerate()
            .filter(|(_, id)| **id != 0)
            .filter_map(|(i, id)| addr_of(*id).map(|a| (a, slot_no(i))))
            .filter(|(a, _)| seen.insert(*a))
            .collect()
    }

    /// The table of a programmed frontend as the current parameters give it, if it is
    /// the one written (its fingerprint matches): what undoing a change restores.
    fn programmed_table(&self, p: &Programmed) -> Option<Vec<proxy_common::MaglevChunk>> {
        let (fp, _) = p.maglev?;
        let inputs = Self::maglev_inputs(&p.slots, |id| self.backends.addr(id));
        (fp != 0 && maglev::fingerprint(self.maglev, &inputs) == fp)
            .then(|| maglev::chunks(&maglev::table(self.maglev, &inputs)))
    }

    /// Sets how many frontends a sync must write to use batches (0: always;
    /// `usize::MAX`: never).
    pub fn set_batch_threshold(&mut self, frontends: usize) {
        self.batch_min = frontends;
    }

    /// Sets how many frontends a batched sync plans and writes per round (at least 1).
    pub fn set_batch_chunk(&mut self, frontends: usize) {
        self.batch_chunk = frontends.max(1);
    }

    /// Map elements written by batch calls and one by one since the last call.
    pub fn take_write_counts(&mut self) -> WriteCounts {
        std::mem::take(&mut self.counts)
    }

    /// Writes the node's addresses (`NODE_ADDRS4/6`: NodePorts are served on them) and
    /// the SNAT addresses (`NODE_CONFIG`: the first address of each family), changing
    /// only what differs from what is written. On a failure what was written is undone.
    /// Returns the number of map operations.
    pub fn set_node_addresses(&mut self, addrs: &[IpAddr]) -> Result<usize, StoreError> {
        self.set_node_port_addresses(addrs, addrs)
    }

    /// [`Self::set_node_addresses`] with NodePorts served on `addrs` only (those
    /// `--nodeport-addresses` selects), the SNAT addresses taken from `all`.
    pub fn set_node_port_addresses(
        &mut self,
        addrs: &[IpAddr],
        all: &[IpAddr],
    ) -> Result<usize, StoreError> {
        let plan = plan::node_address_ops_snat_from(&self.node_addrs, self.snat, addrs, all);
        let n = plan.len();
        if n == 0 {
            return Ok(0);
        }
        if let Err((e, rollback_failed)) = self.apply_all(&plan.ops, &plan.undo) {
            if rollback_failed {
                warn!("undoing a failed node-address write failed too");
            }
            return Err(e);
        }
        let mut seen = BTreeSet::new();
        self.node_addrs = addrs.iter().copied().filter(|a| seen.insert(*a)).collect();
        if let Some(Op::PutNodeConfig { snat }) = plan
            .ops
            .iter()
            .find(|op| matches!(op, Op::PutNodeConfig { .. }))
        {
            self.snat = *snat;
        }
        Ok(n)
    }

    /// The addresses of the UDP backends that left the maps since the last call and are
    /// not back (connected sockets to them are stale: see `sockdestroy`).
    pub fn take_released_udp(&mut self) -> Vec<std::net::SocketAddr> {
        let mut gone = std::mem::take(&mut self.released_udp);
        gone.sort();
        gone.dedup();
        if !gone.is_empty() {
            let live: HashSet<std::net::SocketAddr> = self
                .backends
                .keys()
                .filter(|(_, p)| *p == Proto::Udp)
                .map(|(b, _)| b.addr)
                .collect();
            gone.retain(|a| !live.contains(a));
        }
        gone
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
        self.backends.len()
    }

    fn save(&self) -> Saved {
        Saved {
            services: self.services.clone(),
            backends: self.backends.clone(),
            backend_alloc: self.backend_alloc.clone(),
            service_alloc: self.service_alloc.clone(),
            released_udp: self.released_udp.clone(),
        }
    }

    fn restore(&mut self, s: Saved) {
        self.services = s.services;
        self.backends = s.backends;
        self.backend_alloc = s.backend_alloc;
        self.service_alloc = s.service_alloc;
        self.released_udp = s.released_udp;
        self.deferred_frees = None;
    }

    fn free_backend_id(&mut self, id: u32) {
        match &mut self.deferred_frees {
            Some(d) => d.push((true, id)),
            None => self.backend_alloc.free(id),
        }
    }

    fn free_service_id(&mut self, id: u32) {
        match &mut self.deferred_frees {
            Some(d) => d.push((false, id)),
            None => self.service_alloc.free(id),
        }
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
            if let Some(chunks) = self.programmed_table(p) {
                for (i, c) in chunks.into_iter().enumerate() {
                    d.maglev.insert((p.value.service_id, i as u32), Box::new(c));
                }
            }
        }
        for (id, (key, _)) in self.backends.iter() {
            d.backends.insert(id, key);
        }
        d.node_addrs = self.node_addrs.clone();
        d.snat = self.snat;
        d
    }

    fn unref_backend(&mut self, id: u32) {
        let Some(refs) = self.backends.refs_mut(id) else {
            return;
        };
        *refs -= 1;
        if *refs == 0 {
            if let Some(key) = self.backends.remove(id) {
                if key.1 == Proto::Udp {
                    self.released_udp.push(key.0.addr);
                }
            }
            self.free_backend_id(id);
        }
    }

    /// Applies `ops` in order, one by one; on failure undoes the applied ones in reverse
    /// order.
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
            self.counts.single += 1;
        }
        Ok(())
    }
}

mod adopt;
mod backends;
mod counted;
mod demand;
mod plan;
mod programs;
mod remove;
mod split;
mod sync;
mod upsert;

use backends::Backends;
pub use counted::CountedIds;
pub use demand::{first_sync_sizes, SvcGrowth, SVC_LOW_WATER};
pub use plan::{node_address_ops, Plan};
use programs::Programs;
pub use split::SPLIT_MIN_OPS;
pub use sync::{svc_grown, SVC_HIGH_WATER};
use upsert::slot_no;

#[cfg(test)]
mod tests;
