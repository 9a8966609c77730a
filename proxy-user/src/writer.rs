//! The map writer: keeps the service maps equal to a desired set of [`ServiceEntry`]s,
//! writing only what changed, in an order that never shows the datapath a half-written
//! frontend (after katran's `KatranLb` and cilium's service manager).
//!
//! Update order for one frontend:
//! 1. new backends (`BACKEND` entries for newly allocated ids);
//! 2. the reverse-NAT entry, for a new frontend;
//! 3. changed or new slots `1..=new_count` (slots beyond the live count are invisible to
//!    the datapath; a slot within it is replaced atomically by one map update);
//!    then, for a frontend with `svc_flags::MAGLEV`, its Maglev table (`MAGLEV` chunks)
//!    when it changed: it names slots `1..=new_count`, all written by now, and the flag
//!    in slot 0 that makes the datapath read it comes next;
//! 4. slot 0 with the new count (growing makes the new slots visible here, shrinking
//!    hides the surplus ones here);
//! 5. surplus slots `new_count+1..=old_count` deleted;
//! 6. backends no frontend references any more deleted.
//!
//! Removing a frontend deletes slot 0 first (it disappears atomically), then its slots and
//! Maglev table, its reverse-NAT entry and unreferenced backends. Turning Maglev off
//! rewrites slot 0 without the flag first, then deletes the table.
//!
//! If a write fails (a full map, say), the writes already made for that frontend are
//! undone in reverse order, the in-memory model is left as it was, and the error names
//! the frontend: a frontend is either fully programmed or left as before.
//!
//! Every write is planned as a [`Plan`]: each op with the op that undoes it.
//!
//! **Batches.** A [`Writer::sync`] that writes many frontends (at least
//! [`BATCH_MIN_FRONTENDS`]: the first sync, a relist, the periodic full re-diff) plans
//! every frontend first and then writes phase by phase across all of them, one batch call
//! per phase and map (`BPF_MAP_UPDATE_BATCH` / `BPF_MAP_DELETE_BATCH`): removals (slot 0,
//! slots, source ranges, reverse NAT, backends), then the order above (backends, reverse
//! NAT, source ranges, slots, slot 0, surplus slots, stale source ranges, backends). Each
//! frontend's own writes keep the update order; ops of different frontends never touch
//! one entry (ids freed during the sync are only reused after it). A batch call that
//! fails is finished element by element (`store::write_batch`); an element that fails
//! even alone undoes every write of the sync in reverse phase order, and the sync is run
//! again frontend by frontend, which names the failing frontend and rolls back just it.

use std::{
    collections::{BTreeMap, BTreeSet},
    net::IpAddr,
};

use crate::fasthash::{HashMap, HashSet};

use proxy_common::limits::MAX_BACKENDS_PER_SERVICE;
use tracing::{error, warn};

use crate::{
    maglev::{self, Params as MaglevParams},
    model::{Backend, Frontend, Proto, ServiceEntry},
    store::{write_batch, Dump, FrontendValue, Group, MapStore, Op, Snat, StoreError, WriteCounts},
};

/// A sync writing at least this many frontends writes in batches.
pub const BATCH_MIN_FRONTENDS: usize = 32;

/// Map operations in order, each with the operation that undoes it.
#[derive(Clone, Debug, Default)]
pub struct Plan {
    ops: Vec<Op>,
    undo: Vec<Op>,
}

impl Plan {
    /// Adds `op`, undone by `undo`.
    pub fn push(&mut self, op: Op, undo: Op) {
        self.ops.push(op);
        self.undo.push(undo);
    }

    pub fn len(&self) -> usize {
        self.ops.len()
    }

    pub fn is_empty(&self) -> bool {
        self.ops.is_empty()
    }

    /// The operations, in order.
    pub fn ops(&self) -> &[Op] {
        &self.ops
    }

    /// The operations, consumed.
    pub fn into_ops(self) -> Vec<Op> {
        self.ops
    }

    fn pairs(self) -> impl Iterator<Item = (Op, Op)> {
        self.ops.into_iter().zip(self.undo)
    }

    /// The ops split by [`Op::group`] (each group in order), with their undo ops.
    fn by_group(self) -> Vec<(Vec<Op>, Vec<Op>)> {
        let mut groups: BTreeMap<Group, (Vec<Op>, Vec<Op>)> = BTreeMap::new();
        for (op, undo) in self.pairs() {
            let g = groups.entry(op.group()).or_default();
            g.0.push(op);
            g.1.push(undo);
        }
        groups.into_values().collect()
    }
}

/// The node-address ops that turn `have` (addresses, SNAT config) into `want`: new
/// addresses first, then the SNAT addresses (the first of each family in `want`), then
/// the addresses that left.
pub fn node_address_ops(have: &BTreeSet<IpAddr>, have_snat: Snat, want: &[IpAddr]) -> Plan {
    let mut plan = Plan::default();
    let mut seen = BTreeSet::new();
    for a in want {
        if seen.insert(*a) && !have.contains(a) {
            plan.push(Op::PutNodeAddr { addr: *a }, Op::DelNodeAddr { addr: *a });
        }
    }
    let snat = Snat {
        v4: want.iter().find_map(|a| match a {
            IpAddr::V4(v) => Some(*v),
            IpAddr::V6(_) => None,
        }),
        v6: want.iter().find_map(|a| match a {
            IpAddr::V6(v) => Some(*v),
            IpAddr::V4(_) => None,
        }),
    };
    if snat != have_snat {
        plan.push(
            Op::PutNodeConfig { snat },
            Op::PutNodeConfig { snat: have_snat },
        );
    }
    for a in have {
        if !seen.contains(a) {
            plan.push(Op::DelNodeAddr { addr: *a }, Op::PutNodeAddr { addr: *a });
        }
    }
    plan
}

/// Phases of a batched sync: removals, then updates (see the module doc).
const PHASES: usize = 14;

fn phase(op: &Op, removal: bool) -> usize {
    if removal {
        return match op {
            Op::DelSlot { slot: 0, .. } => 0,
            Op::DelSlot { .. } | Op::DelMaglev { .. } => 1,
            Op::DelSrcRange { .. } => 2,
            Op::DelRevNat { .. } => 3,
            _ => 4,
        };
    }
    5 + match op {
        Op::PutBackend { .. } => 0,
        Op::PutRevNat { .. } => 1,
        Op::PutSrcRange { .. } => 2,
        Op::PutSlot { .. } => 3,
        Op::PutMaglev { .. } => 4,
        Op::PutFrontend { .. } => 5,
        Op::DelSlot { .. } | Op::DelMaglev { .. } => 6,
        Op::DelSrcRange { .. } => 7,
        _ => 8,
    }
}

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
    /// Broken entries repaired, by kind (`duplicate_service_id`, `dangling_slot`,
    /// `slot_backend_mismatch`, `missing_slot`, `revnat_rewritten`); each is logged.
    pub repairs: BTreeMap<&'static str, usize>,
}

impl AdoptReport {
    fn repair(&mut self, kind: &'static str) {
        *self.repairs.entry(kind).or_default() += 1;
    }
}

/// The order adoption writes its repairs and deletions in: what nothing reaches first,
/// then rewrites in the update order, unreferenced backends last.
fn adopt_phase(op: &Op) -> usize {
    match op {
        Op::DelSlot { .. } | Op::DelMaglev { .. } => 0,
        Op::DelSrcRange { .. } => 1,
        Op::DelRevNat { .. } => 2,
        Op::PutRevNat { .. } => 3,
        Op::PutSrcRange { .. } => 4,
        Op::PutSlot { .. } => 5,
        Op::PutFrontend { .. } => 6,
        Op::DelBackend { .. } => 7,
        _ => 8,
    }
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
    /// `NODE_ADDRS4/6` and `NODE_CONFIG` as last written.
    node_addrs: BTreeSet<IpAddr>,
    snat: Snat,
    /// Frontends a sync must write for it to use batches.
    batch_min: usize,
    /// Elements written by batch and one by one, since the last take.
    counts: WriteCounts,
    /// During a batched sync: ids freed (true: backend, false: service), released only
    /// once the sync is written so that no id is deleted and reused within one batch.
    deferred_frees: Option<Vec<(bool, u32)>>,
    /// Table size and seed of the Maglev tables (`--maglev-table-size`, `--maglev-seed`).
    maglev: MaglevParams,
}

/// The model's state, saved before a batched sync (restored if it fails).
struct Saved {
    services: BTreeMap<Frontend, Programmed>,
    backend_ids: HashMap<BackendKey, u32>,
    backend_refs: BTreeMap<u32, (BackendKey, u32)>,
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
            services: BTreeMap::new(),
            backend_ids: HashMap::default(),
            backend_refs: BTreeMap::new(),
            backend_alloc: IdAlloc::default(),
            service_alloc: IdAlloc::default(),
            released_udp: Vec::new(),
            node_addrs: BTreeSet::new(),
            snat: Snat::default(),
            batch_min: BATCH_MIN_FRONTENDS,
            counts: WriteCounts::default(),
            deferred_frees: None,
            maglev: MaglevParams::default(),
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
        let inputs = Self::maglev_inputs(&p.slots, |id| {
            self.backend_refs.get(&id).map(|((b, _), _)| b.addr)
        });
        (fp != 0 && maglev::fingerprint(self.maglev, &inputs) == fp)
            .then(|| maglev::chunks(&maglev::table(self.maglev, &inputs)))
    }

    /// Sets how many frontends a sync must write to use batches (0: always;
    /// `usize::MAX`: never).
    pub fn set_batch_threshold(&mut self, frontends: usize) {
        self.batch_min = frontends;
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
        let plan = node_address_ops(&self.node_addrs, self.snat, addrs);
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
    pub fn adopt_with(
        store: S,
        batch_min: usize,
        maglev_params: MaglevParams,
    ) -> Result<(Self, AdoptReport), StoreError> {
        let dump = store.dump()?;
        let mut w = Self::new(store);
        w.batch_min = batch_min;
        w.maglev = maglev_params;
        w.node_addrs = dump.node_addrs.clone();
        w.snat = dump.snat;
        let mut report = AdoptReport::default();
        let mut orphans = Vec::new();

        for (id, (backend, proto)) in &dump.backends {
            w.backend_alloc.mark(*id);
            w.backend_ids.entry((*backend, *proto)).or_insert(*id);
            w.backend_refs.insert(*id, ((*backend, *proto), 0));
        }
        // Ids unique: a service id held by two frontends (the second would share the
        // first's reverse NAT) stays with the one its reverse-NAT entry names (else the
        // first); the others get a fresh id, rewritten in their slots and slot 0.
        for value in dump.frontends.values() {
            w.service_alloc.mark(value.service_id);
        }
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
                value.service_id = w.service_alloc.alloc();
                report.repair("duplicate_service_id");
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
            let mut slots = Vec::with_capacity(usize::from(value.count));
            let mut seen = HashSet::default();
            for slot in 1..=value.count {
                let id = match dump.slots.get(&(*fe, slot)) {
                    None => {
                        report.repair("missing_slot");
                        warn!(frontend = %fe, slot, "adoption: slot missing below the count");
                        0
                    }
                    Some(id) => match w.backend_refs.get(id) {
                        None => {
                            report.repair("dangling_slot");
                            warn!(frontend = %fe, slot, backend = id, "adoption: slot names a missing backend");
                            0
                        }
                        Some(((b, proto), _))
                            if *proto != fe.proto || b.family() != fe.family() =>
                        {
                            report.repair("slot_backend_mismatch");
                            warn!(frontend = %fe, slot, backend = id, "adoption: slot names a backend of another protocol or family");
                            0
                        }
                        Some(_) => *id,
                    },
                };
                if id == 0 {
                    report.missing_slots += 1;
                } else if let Some((_, refs)) = w.backend_refs.get_mut(&id) {
                    // One reference per frontend, even if two slots share an id.
                    if seen.insert(id) {
                        *refs += 1;
                    }
                }
                if duplicate && id != 0 {
                    orphans.push(Op::PutSlot {
                        frontend: *fe,
                        slot,
                        backend_id: id,
                        service_id: value.service_id,
                    });
                }
                slots.push(id);
            }
            if duplicate {
                orphans.push(Op::PutFrontend {
                    frontend: *fe,
                    value,
                });
            }
            w.services.insert(
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
        // Maglev tables: kept (no write) when equal to what the parameters in use give the
        // adopted slots; else marked for rewriting. Chunks of no flagged frontend go.
        let mut maglev_by_id: HashMap<u32, Vec<u32>> = HashMap::default();
        for (sid, chunk) in dump.maglev.keys() {
            maglev_by_id.entry(*sid).or_default().push(*chunk);
        }
        let flagged: Vec<Frontend> = w
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
            let p = &w.services[&fe];
            let sid = p.value.service_id;
            let Some(found) = maglev_by_id.get(&sid) else {
                continue;
            };
            kept_ids.insert(sid);
            let inputs = Self::maglev_inputs(&p.slots, |id| {
                w.backend_refs.get(&id).map(|((b, _), _)| b.addr)
            });
            let want = maglev::chunks(&maglev::table(w.maglev, &inputs));
            let same = found.len() == want.len()
                && want
                    .iter()
                    .enumerate()
                    .all(|(i, c)| dump.maglev.get(&(sid, i as u32)).is_some_and(|d| **d == *c));
            let n = found.iter().max().map_or(0, |m| m + 1);
            let state = if same {
                (maglev::fingerprint(w.maglev, &inputs), n)
            } else {
                report.repair("maglev_table_stale");
                (0, n)
            };
            if let Some(p) = w.services.get_mut(&fe) {
                p.maglev = Some(state);
            }
        }
        for (sid, chunk) in dump.maglev.keys() {
            if !kept_ids.contains(sid) {
                orphans.push(Op::DelMaglev {
                    service_id: *sid,
                    chunk: *chunk,
                });
            }
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
        // Service ids in use per family: an entry of such an id naming another frontend is
        // rewritten below, not deleted (a delete and a rewrite of one entry must not meet
        // in one batch phase).
        let live_sids: HashSet<(u32, crate::model::Family)> = w
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
                other => {
                    if let Some((f, _)) = other {
                        report.repair("revnat_rewritten");
                        warn!(frontend = %fe, service_id = p.value.service_id, names = %f,
                              "adoption: reverse-NAT entry names another frontend; rewritten");
                    }
                    orphans.push(Op::PutRevNat {
                        service_id: p.value.service_id,
                        frontend: *fe,
                        name: String::new(),
                    })
                }
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
        orphans.sort_by_key(adopt_phase);
        if orphans.len() >= w.batch_min.max(2) {
            // One batch per phase and map.
            let mut phases: [Vec<Op>; 9] = Default::default();
            for op in &orphans {
                phases[adopt_phase(op)].push(op.clone());
            }
            for ops in phases {
                let mut plan = Plan::default();
                for op in ops {
                    plan.push(op.clone(), op);
                }
                for (ops, _) in plan.by_group() {
                    write_batch(&mut w.store, &ops, &mut w.counts).map_err(|(_, e)| e)?;
                }
            }
        } else {
            for op in &orphans {
                w.store.apply(op)?;
                w.counts.single += 1;
            }
        }
        report.frontends = w.services.len();
        report.backends = w.backend_refs.len();
        report.orphans_deleted = orphans
            .iter()
            .filter(|op| {
                matches!(
                    op,
                    Op::DelSlot { .. }
                        | Op::DelSrcRange { .. }
                        | Op::DelRevNat { .. }
                        | Op::DelBackend { .. }
                        | Op::DelMaglev { .. }
                )
            })
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
    /// an entry's own writes keep the update order whatever the path). Many frontends to
    /// write (at least the batch threshold, counting only entries that differ from the
    /// maps): in batches, one call per phase and map (see the module doc); else, or when a
    /// batch fails (everything undone), frontend by frontend. A frontend that fails is
    /// reported (its error names it) and left as it was; the rest are still written.
    pub fn write_many<'a>(
        &mut self,
        removals: &[Frontend],
        upserts: impl IntoIterator<Item = &'a ServiceEntry> + Clone,
    ) -> SyncReport {
        let to_write = removals.len()
            + upserts
                .clone()
                .into_iter()
                .filter(|e| self.needs_write(e))
                .count();
        if to_write > 0 && to_write >= self.batch_min {
            if let Some(report) = self.sync_batched(upserts.clone(), removals) {
                return report;
            }
        }
        let mut report = SyncReport::default();
        for fe in removals {
            match self.remove(fe) {
                Ok(0) => {}
                Ok(n) => {
                    report.ops += n;
                    report.removed += 1;
                }
                Err(e) => report.errors.push(e),
            }
        }
        for entry in upserts {
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

    /// Number of frontends programmed.
    pub fn frontend_count(&self) -> usize {
        self.services.len()
    }

    /// Whether `entry` differs from what is programmed (an estimate for choosing batches:
    /// a duplicate backend, say, counts as a change).
    fn needs_write(&self, entry: &ServiceEntry) -> bool {
        let Some(p) = self.services.get(&entry.frontend) else {
            return true;
        };
        if p.name != entry.name
            || p.value.flags != entry.flags
            || p.value.affinity_timeout != entry.affinity_timeout
            || p.slots.len() != entry.backends.len()
            || p.source_ranges.len() != entry.source_ranges.len()
            || entry
                .source_ranges
                .iter()
                .any(|r| !p.source_ranges.contains(r))
        {
            return true;
        }
        let slots: HashSet<u32> = p.slots.iter().copied().collect();
        entry.backends.iter().any(|b| {
            self.backend_ids
                .get(&(*b, entry.frontend.proto))
                .is_none_or(|id| !slots.contains(id))
        })
    }

    /// One batched sync; `None` if a write failed (everything undone, the model as
    /// before): the caller then syncs frontend by frontend.
    fn sync_batched<'a>(
        &mut self,
        desired: impl IntoIterator<Item = &'a ServiceEntry>,
        gone: &[Frontend],
    ) -> Option<SyncReport> {
        let saved = self.save();
        self.deferred_frees = Some(Vec::new());
        let mut report = SyncReport::default();
        let mut phases: Vec<Plan> = (0..PHASES).map(|_| Plan::default()).collect();
        for fe in gone {
            if let Some((plan, old)) = self.stage_remove(fe) {
                report.ops += plan.len();
                report.removed += 1;
                for (op, undo) in plan.pairs() {
                    phases[phase(&op, true)].push(op, undo);
                }
                self.commit_remove(fe, &old);
            }
        }
        for entry in desired {
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
        let frees = self.deferred_frees.take().unwrap_or_default();
        match self.apply_phases(phases) {
            Ok(()) => {
                for (backend, id) in frees {
                    if backend {
                        self.backend_alloc.free(id);
                    } else {
                        self.service_alloc.free(id);
                    }
                }
                Some(report)
            }
            Err((e, rollback_failed)) => {
                self.restore(saved);
                if rollback_failed {
                    error!(
                        error = %e,
                        "a batched sync failed and undoing it failed too: the maps may \
                         hold entries the model does not know until the next restart"
                    );
                } else {
                    warn!(error = %e, "a batched sync failed and was undone; writing frontend by frontend");
                }
                None
            }
        }
    }

    /// Writes each phase's ops as one batch per map; on a failure undoes everything
    /// written, phase by phase in reverse.
    fn apply_phases(&mut self, phases: Vec<Plan>) -> Result<(), (StoreError, bool)> {
        let mut applied: Vec<Vec<Op>> = Vec::with_capacity(phases.len());
        for plan in phases {
            let mut undo_phase = Vec::new();
            for (ops, undo) in plan.by_group() {
                if let Err((i, e)) = write_batch(&mut self.store, &ops, &mut self.counts) {
                    undo_phase.extend(undo.into_iter().take(i));
                    applied.push(undo_phase);
                    let failed = self.rollback(applied);
                    return Err((e, failed));
                }
                undo_phase.extend(undo);
            }
            applied.push(undo_phase);
        }
        Ok(())
    }

    /// Applies the undo ops of each phase, last phase first, in batches. True if any
    /// undo op failed (the others are still applied).
    fn rollback(&mut self, applied: Vec<Vec<Op>>) -> bool {
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

    fn save(&self) -> Saved {
        Saved {
            services: self.services.clone(),
            backend_ids: self.backend_ids.clone(),
            backend_refs: self.backend_refs.clone(),
            backend_alloc: self.backend_alloc.clone(),
            service_alloc: self.service_alloc.clone(),
            released_udp: self.released_udp.clone(),
        }
    }

    fn restore(&mut self, s: Saved) {
        self.services = s.services;
        self.backend_ids = s.backend_ids;
        self.backend_refs = s.backend_refs;
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
    fn stage_upsert(&mut self, entry: &ServiceEntry) -> Result<StagedUpsert, WriteError> {
        let fe = entry.frontend;
        let backends = validate(entry)?;
        let old = self.services.get(&fe);
        let old_slots: Vec<u32> = old.map_or_else(Vec::new, |p| p.slots.clone());

        let mut plan = Plan::default();
        let mut new_backend_ids = Vec::new();
        let mut ids = Vec::with_capacity(backends.len());
        for b in &backends {
            let key = (*b, fe.proto);
            let id = match self.backend_ids.get(&key) {
                Some(id) => *id,
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

        let old = self.services.get(&fe);
        let (service_id, new_service_id) = match old {
            Some(p) => (p.value.service_id, false),
            None => (self.service_alloc.alloc(), true),
        };
        let old = self.services.get(&fe);
        let put_revnat = |name: &str| Op::PutRevNat {
            service_id,
            frontend: fe,
            name: name.to_string(),
        };
        match old {
            None => plan.push(
                put_revnat(&entry.name),
                Op::DelRevNat {
                    service_id,
                    family: fe.family(),
                },
            ),
            Some(p) if p.name != entry.name => {
                plan.push(put_revnat(&entry.name), put_revnat(&p.name))
            }
            Some(_) => {}
        }

        let want_ranges: BTreeSet<(IpAddr, u8)> = entry.source_ranges.iter().copied().collect();
        let old_ranges = old.map(|p| p.source_ranges.clone()).unwrap_or_default();
        let range = |put: bool, (addr, prefix): (IpAddr, u8)| {
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
        };
        for r in want_ranges.difference(&old_ranges) {
            plan.push(range(true, *r), range(false, *r));
        }

        let layout = stable_layout(&old_slots, &ids);
        for (i, id) in layout.iter().enumerate() {
            let slot = slot_no(i);
            let before = old_slots.get(i).copied();
            if before == Some(*id) {
                continue;
            }
            plan.push(
                Op::PutSlot {
                    frontend: fe,
                    slot,
                    backend_id: *id,
                    service_id,
                },
                match before {
                    Some(prev) if prev != 0 => Op::PutSlot {
                        frontend: fe,
                        slot,
                        backend_id: prev,
                        service_id,
                    },
                    _ => Op::DelSlot { frontend: fe, slot },
                },
            );
        }

        // The Maglev table, after the slots it names and before the flag in slot 0.
        let addr_of_new: HashMap<u32, std::net::SocketAddr> = ids
            .iter()
            .zip(&backends)
            .map(|(id, b)| (*id, b.addr))
            .collect();
        let old_maglev = old.and_then(|p| p.maglev);
        let mut maglev_state = None;
        let mut maglev_dels = Vec::new();
        let old_table = old.and_then(|p| self.programmed_table(p));
        let put_chunk = |chunk: u32, c: &proxy_common::MaglevChunk| Op::PutMaglev {
            service_id,
            chunk,
            value: Box::new(*c),
        };
        let del_chunk = |chunk: u32| Op::DelMaglev { service_id, chunk };
        let undo_chunk = |chunk: u32| match old_table.as_ref().and_then(|t| t.get(chunk as usize)) {
            Some(c) => put_chunk(chunk, c),
            // Not known (an adopted table of other parameters): undoing leaves no table,
            // and the datapath falls back to random for it.
            None => del_chunk(chunk),
        };
        if entry.flags & proxy_common::svc_flags::MAGLEV != 0 && !layout.is_empty() {
            let inputs = Self::maglev_inputs(&layout, |id| addr_of_new.get(&id).copied());
            let fp = maglev::fingerprint(self.maglev, &inputs);
            let n = proxy_common::maglev::chunks(self.maglev.table_size);
            if old_maglev.map(|(f, _)| f) != Some(fp) {
                let chunks = maglev::chunks(&maglev::table(self.maglev, &inputs));
                for (i, c) in chunks.iter().enumerate() {
                    plan.push(put_chunk(i as u32, c), undo_chunk(i as u32));
                }
            }
            if let Some((_, old_n)) = old_maglev {
                maglev_dels.extend(n..old_n);
            }
            maglev_state = Some((fp, n));
        } else if let Some((_, old_n)) = old_maglev {
            maglev_dels.extend(0..old_n);
        }

        let value = FrontendValue {
            service_id,
            count: layout.len() as u16,
            flags: entry.flags,
            affinity_timeout: entry.affinity_timeout,
        };
        if old.map(|p| p.value) != Some(value) {
            plan.push(
                Op::PutFrontend {
                    frontend: fe,
                    value,
                },
                match old {
                    Some(p) => Op::PutFrontend {
                        frontend: fe,
                        value: p.value,
                    },
                    None => Op::DelSlot {
                        frontend: fe,
                        slot: 0,
                    },
                },
            );
        }

        for (i, old_id) in old_slots.iter().enumerate().skip(layout.len()) {
            let slot = slot_no(i);
            plan.push(
                Op::DelSlot { frontend: fe, slot },
                Op::PutSlot {
                    frontend: fe,
                    slot,
                    backend_id: *old_id,
                    service_id,
                },
            );
        }

        // Table chunks no longer used, once slot 0 no longer asks for them.
        for chunk in maglev_dels {
            plan.push(del_chunk(chunk), undo_chunk(chunk));
        }

        for r in old_ranges.difference(&want_ranges) {
            plan.push(range(false, *r), range(true, *r));
        }

        // Backends this frontend stops using and nobody else uses.
        let new_set: HashSet<u32> = layout.iter().copied().collect();
        for id in unique(&old_slots) {
            if id == 0 || new_set.contains(&id) {
                continue;
            }
            if let Some((key, 1)) = self.backend_refs.get(&id) {
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

    /// Makes the model say what a staged upsert wrote.
    fn commit_upsert(&mut self, s: StagedUpsert) {
        for (id, key) in s.new_backend_ids {
            self.backend_ids.insert(key, id);
            self.backend_refs.insert(id, (key, 0));
        }
        let old_set: HashSet<u32> = s.old_slots.iter().copied().collect();
        let new_set: HashSet<u32> = s.layout.iter().copied().collect();
        for id in unique(&s.layout) {
            if !old_set.contains(&id) {
                if let Some((_, refs)) = self.backend_refs.get_mut(&id) {
                    *refs += 1;
                }
            }
        }
        for id in unique(&s.old_slots) {
            if id != 0 && !new_set.contains(&id) {
                self.unref_backend(id);
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

    /// Removes one frontend. Returns the number of map operations (0 if it was absent).
    pub fn remove(&mut self, fe: &Frontend) -> Result<usize, WriteError> {
        let Some((plan, old)) = self.stage_remove(fe) else {
            return Ok(0);
        };
        if let Err((source, rollback_failed)) = self.apply_all(&plan.ops, &plan.undo) {
            return Err(WriteError::Store {
                frontend: *fe,
                source,
                rollback_failed,
            });
        }
        self.commit_remove(fe, &old);
        Ok(plan.len())
    }

    /// Plans the removal of one frontend: slot 0 first, then its slots, source ranges,
    /// reverse-NAT entry and the backends only it used.
    fn stage_remove(&self, fe: &Frontend) -> Option<(Plan, Programmed)> {
        let old = self.services.get(fe)?.clone();
        let sid = old.value.service_id;
        let mut plan = Plan::default();
        plan.push(
            Op::DelSlot {
                frontend: *fe,
                slot: 0,
            },
            Op::PutFrontend {
                frontend: *fe,
                value: old.value,
            },
        );
        for (i, id) in old.slots.iter().enumerate() {
            plan.push(
                Op::DelSlot {
                    frontend: *fe,
                    slot: slot_no(i),
                },
                Op::PutSlot {
                    frontend: *fe,
                    slot: slot_no(i),
                    backend_id: *id,
                    service_id: sid,
                },
            );
        }
        if let Some((_, n)) = old.maglev {
            let table = self.programmed_table(&old);
            for chunk in 0..n {
                let undo = match table.as_ref().and_then(|t| t.get(chunk as usize)) {
                    Some(c) => Op::PutMaglev {
                        service_id: sid,
                        chunk,
                        value: Box::new(*c),
                    },
                    None => Op::DelMaglev {
                        service_id: sid,
                        chunk,
                    },
                };
                plan.push(
                    Op::DelMaglev {
                        service_id: sid,
                        chunk,
                    },
                    undo,
                );
            }
        }
        for (addr, prefix) in &old.source_ranges {
            let (addr, prefix) = (*addr, *prefix);
            plan.push(
                Op::DelSrcRange {
                    service_id: sid,
                    addr,
                    prefix,
                },
                Op::PutSrcRange {
                    service_id: sid,
                    addr,
                    prefix,
                },
            );
        }
        plan.push(
            Op::DelRevNat {
                service_id: sid,
                family: fe.family(),
            },
            Op::PutRevNat {
                service_id: sid,
                frontend: *fe,
                name: old.name.clone(),
            },
        );
        for id in unique(&old.slots) {
            if let Some((key, 1)) = self.backend_refs.get(&id) {
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
        Some((plan, old))
    }

    fn commit_remove(&mut self, fe: &Frontend, old: &Programmed) {
        for id in unique(&old.slots) {
            if id != 0 {
                self.unref_backend(id);
            }
        }
        self.free_service_id(old.value.service_id);
        self.services.remove(fe);
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
        for (id, (key, _)) in &self.backend_refs {
            d.backends.insert(*id, *key);
        }
        d.node_addrs = self.node_addrs.clone();
        d.snat = self.snat;
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

/// Checks an entry before anything is written; returns its backends without duplicates,
/// in the given order.
fn validate(entry: &ServiceEntry) -> Result<Vec<Backend>, WriteError> {
    let fe = entry.frontend;
    if fe.port == 0 {
        return Err(WriteError::ZeroPort { frontend: fe });
    }
    let mut seen = HashSet::default();
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

fn slot_no(index: usize) -> u16 {
    // validate() bounds the number of backends to u16::MAX.
    (index + 1) as u16
}

fn unique(ids: &[u32]) -> Vec<u32> {
    let mut seen = HashSet::default();
    ids.iter().copied().filter(|id| seen.insert(*id)).collect()
}

#[cfg(test)]
mod tests;
