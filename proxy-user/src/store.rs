//! The map operations the writer issues ([`Op`]), the storage they go to ([`MapStore`]),
//! and an in-memory store for tests ([`MemStore`]). The real store over pinned BPF maps is
//! `crate::bpf::BpfMaps`.

use std::{
    collections::{BTreeMap, BTreeSet},
    fmt, io,
    net::{IpAddr, Ipv4Addr, Ipv6Addr},
};

use tracing::debug;

use proxy_common::SVC_CHUNK_SLOTS;

use crate::model::{Backend, Family, Frontend, Proto};

/// One map write. The writer plans a list of these per frontend, in the safe update order.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Op {
    /// `BACKEND{4,6}[id] = backend`.
    PutBackend {
        id: u32,
        backend: Backend,
        proto: Proto,
    },
    /// Delete `BACKEND{4,6}[id]` (and its connection counters).
    DelBackend { id: u32, family: Family },
    /// `SVC{4,6}[frontend, chunk] = backends` (chunk >= 1): the backend ids of slots
    /// `24 * chunk + 1 ..` (at most [`SVC_CHUNK_SLOTS`]; the rest of the entry zero).
    PutChunk {
        frontend: Frontend,
        chunk: u16,
        backends: Box<[u32]>,
        service_id: u32,
        /// Written after the frontend's entry (with the surplus deletes): the chunk
        /// rewritten without the ids past a count that shrank within it (before, it
        /// kept them, as the live count still reached them).
        trim: bool,
    },
    /// `SVC{4,6}[frontend, 0] = {count, service_id, flags, affinity}` with the backend ids
    /// of slots `1..=24` (`backends`, at most [`SVC_CHUNK_SLOTS`]): one entry, written at
    /// once.
    PutFrontend {
        frontend: Frontend,
        value: FrontendValue,
        backends: Box<[u32]>,
    },
    /// Delete `SVC{4,6}[frontend, chunk]` (chunk 0 deletes the frontend itself, with its
    /// first 24 slots).
    DelChunk { frontend: Frontend, chunk: u16 },
    /// `REVNAT{4,6}[service_id] = frontend` (with the Service's name).
    PutRevNat {
        service_id: u32,
        frontend: Frontend,
        name: String,
    },
    /// Delete `REVNAT{4,6}[service_id]`.
    DelRevNat { service_id: u32, family: Family },
    /// Allow `addr/prefix` as a source for the frontend with this service id
    /// (`loadBalancerSourceRanges`).
    PutSrcRange {
        service_id: u32,
        addr: std::net::IpAddr,
        prefix: u8,
    },
    /// Remove one allowed source range.
    DelSrcRange {
        service_id: u32,
        addr: std::net::IpAddr,
        prefix: u8,
    },
    /// `NODE_ADDRS{4,6}[addr] = 1`: NodePorts are served on this node address.
    PutNodeAddr { addr: IpAddr },
    /// Delete `NODE_ADDRS{4,6}[addr]`.
    DelNodeAddr { addr: IpAddr },
    /// `NODE_CONFIG[0]`: the addresses the TC path source-NATs to.
    PutNodeConfig { snat: Snat },
    /// `MAGLEV[service_id, chunk] = slots`: one chunk of a frontend's Maglev table.
    PutMaglev {
        service_id: u32,
        chunk: u32,
        value: Box<proxy_common::MaglevChunk>,
        /// Written after the frontend's entry: its table is in use (the flag was set
        /// before), and the entry holds slots `1..=24`, which the new table names.
        late: bool,
    },
    /// Delete `MAGLEV[service_id, chunk]`.
    DelMaglev { service_id: u32, chunk: u32 },
}

/// `NODE_CONFIG[0]` in model terms: the SNAT address of each family (`None`: no SNAT
/// possible for that family; zero in the map).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub struct Snat {
    pub v4: Option<Ipv4Addr>,
    pub v6: Option<Ipv6Addr>,
}

/// Which map an [`Op`] writes and how (update or delete): ops of one group can go to the
/// kernel in one batch call.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Group {
    pub map: MapKind,
    pub family: Family,
    pub delete: bool,
}

/// The maps the writer writes (per family).
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum MapKind {
    Backend,
    Svc,
    RevNat,
    SrcRange,
    NodeAddr,
    NodeConfig,
    Maglev,
}

impl Op {
    /// The map this op writes and whether it deletes.
    pub fn group(&self) -> Group {
        let fam = |a: &IpAddr| Family::of(a);
        let (map, family, delete) = match self {
            Op::PutBackend { backend, .. } => (MapKind::Backend, backend.family(), false),
            Op::DelBackend { family, .. } => (MapKind::Backend, *family, true),
            Op::PutChunk { frontend, .. } | Op::PutFrontend { frontend, .. } => {
                (MapKind::Svc, frontend.family(), false)
            }
            Op::DelChunk { frontend, .. } => (MapKind::Svc, frontend.family(), true),
            Op::PutRevNat { frontend, .. } => (MapKind::RevNat, frontend.family(), false),
            Op::DelRevNat { family, .. } => (MapKind::RevNat, *family, true),
            Op::PutSrcRange { addr, .. } => (MapKind::SrcRange, fam(addr), false),
            Op::DelSrcRange { addr, .. } => (MapKind::SrcRange, fam(addr), true),
            Op::PutNodeAddr { addr } => (MapKind::NodeAddr, fam(addr), false),
            Op::DelNodeAddr { addr } => (MapKind::NodeAddr, fam(addr), true),
            Op::PutNodeConfig { .. } => (MapKind::NodeConfig, Family::V4, false),
            // One map for both families (service ids are unique across them).
            Op::PutMaglev { .. } => (MapKind::Maglev, Family::V4, false),
            Op::DelMaglev { .. } => (MapKind::Maglev, Family::V4, true),
        };
        Group {
            map,
            family,
            delete,
        }
    }

    /// The map entry this op writes, as text (two ops of one batch never share one).
    pub fn key(&self) -> String {
        match self {
            Op::PutBackend { id, .. } | Op::DelBackend { id, .. } => format!("backend {id}"),
            Op::PutChunk {
                frontend, chunk, ..
            }
            | Op::DelChunk { frontend, chunk } => format!("svc {frontend} #{chunk}"),
            Op::PutFrontend { frontend, .. } => format!("svc {frontend} #0"),
            Op::PutRevNat { service_id, .. } | Op::DelRevNat { service_id, .. } => {
                format!("revnat {service_id}")
            }
            Op::PutSrcRange {
                service_id,
                addr,
                prefix,
            }
            | Op::DelSrcRange {
                service_id,
                addr,
                prefix,
            } => format!("src {service_id} {addr}/{prefix}"),
            Op::PutNodeAddr { addr } | Op::DelNodeAddr { addr } => format!("node {addr}"),
            Op::PutNodeConfig { .. } => "node config".into(),
            Op::PutMaglev {
                service_id, chunk, ..
            }
            | Op::DelMaglev { service_id, chunk } => format!("maglev {service_id} #{chunk}"),
        }
    }
}

/// A frontend's own fields (the head of its `SVC` entry, chunk 0).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub struct FrontendValue {
    pub service_id: u32,
    pub count: u16,
    pub flags: u16,
    pub affinity_timeout: u32,
}

impl fmt::Display for Op {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Op::PutBackend { id, backend, proto } => {
                write!(f, "put backend {id} = {}/{proto}", backend.addr)?;
                if backend.flags != 0 {
                    write!(f, " flags={:#x}", backend.flags)?;
                }
                Ok(())
            }
            Op::DelBackend { id, family } => write!(f, "del backend {id} ({family:?})"),
            Op::PutChunk {
                frontend,
                chunk,
                backends,
                ..
            } => write!(
                f,
                "put slots {frontend} chunk {chunk} -> backends {}",
                ids(backends)
            ),
            Op::PutFrontend {
                frontend,
                value,
                backends,
            } => write!(
                f,
                "put frontend {frontend} id={} count={} flags={:#x} affinity={} backends {}",
                value.service_id,
                value.count,
                value.flags,
                value.affinity_timeout,
                ids(backends)
            ),
            Op::DelChunk { frontend, chunk: 0 } => write!(f, "del frontend {frontend}"),
            Op::DelChunk { frontend, chunk } => write!(f, "del slots {frontend} chunk {chunk}"),
            Op::PutRevNat {
                service_id,
                frontend,
                name,
            } => {
                write!(f, "put revnat {service_id} = {frontend}")?;
                if !name.is_empty() {
                    write!(f, " {name:?}")?;
                }
                Ok(())
            }
            Op::DelRevNat { service_id, family } => {
                write!(f, "del revnat {service_id} ({family:?})")
            }
            Op::PutSrcRange {
                service_id,
                addr,
                prefix,
            } => write!(f, "put source range {service_id} {addr}/{prefix}"),
            Op::DelSrcRange {
                service_id,
                addr,
                prefix,
            } => write!(f, "del source range {service_id} {addr}/{prefix}"),
            Op::PutNodeAddr { addr } => write!(f, "put node address {addr}"),
            Op::DelNodeAddr { addr } => write!(f, "del node address {addr}"),
            Op::PutNodeConfig { snat } => write!(f, "put node config {snat}"),
            Op::PutMaglev {
                service_id,
                chunk,
                value,
                ..
            } => write!(
                f,
                "put maglev {service_id} #{chunk} (M={} hash={:016x})",
                value.table_size,
                crate::maglev::chunk_digest(value)
            ),
            Op::DelMaglev { service_id, chunk } => write!(f, "del maglev {service_id} #{chunk}"),
        }
    }
}

/// Backend ids as `[1 2 3]`.
fn ids(backends: &[u32]) -> String {
    let v: Vec<String> = backends.iter().map(|id| id.to_string()).collect();
    format!("[{}]", v.join(" "))
}

/// The backend ids of chunk `chunk` of a frontend whose slots `1..` name `slots` (the
/// chunk's part of them: at most [`SVC_CHUNK_SLOTS`], none past the end).
pub fn chunk_ids(slots: &[u32], chunk: usize) -> &[u32] {
    let from = (chunk * SVC_CHUNK_SLOTS).min(slots.len());
    &slots[from..(from + SVC_CHUNK_SLOTS).min(slots.len())]
}

/// The slots `(slot, backend id)` the ids `backends` of chunk `chunk` name (at most
/// [`SVC_CHUNK_SLOTS`]; a 0 is no slot).
pub fn chunk_slots(chunk: u16, backends: &[u32]) -> impl Iterator<Item = (u16, u32)> + '_ {
    let first = usize::from(chunk) * SVC_CHUNK_SLOTS + 1;
    backends
        .iter()
        .take(SVC_CHUNK_SLOTS)
        .enumerate()
        .filter(|(_, id)| **id != 0)
        .filter_map(move |(i, id)| Some((u16::try_from(first + i).ok()?, *id)))
}

/// `SVC` entries of a frontend with `count` slots: its own (slots `1..=24`) and one per
/// further chunk.
pub fn svc_entries(count: usize) -> usize {
    count.div_ceil(SVC_CHUNK_SLOTS).max(1)
}

impl fmt::Display for Snat {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let show = |a: Option<IpAddr>| a.map_or("none".to_string(), |a| a.to_string());
        write!(
            f,
            "snat4={} snat6={}",
            show(self.v4.map(IpAddr::V4)),
            show(self.v6.map(IpAddr::V6))
        )
    }
}

/// A failed map write.
#[derive(Debug, thiserror::Error)]
pub enum StoreError {
    #[error("map {map} is full")]
    Full { map: &'static str },
    #[error("map {map}: {source}")]
    Map {
        map: &'static str,
        #[source]
        source: aya::maps::MapError,
    },
    #[error("map {map}: {detail}")]
    Corrupt { map: &'static str, detail: String },
    #[error("resizing the service-side maps to {to}: {detail}")]
    Grow { to: String, detail: String },
}

/// The service maps' contents, read back (adoption, dumps, tests).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Dump {
    /// Every frontend's own fields (chunk 0).
    pub frontends: BTreeMap<Frontend, FrontendValue>,
    /// Backend slots (`1..`, of every chunk, the frontend's own included), one by one:
    /// `(frontend, slot) -> backend id`.
    pub slots: BTreeMap<(Frontend, u16), u32>,
    /// Backend id -> backend and protocol.
    pub backends: BTreeMap<u32, (Backend, Proto)>,
    /// Service id -> frontend and Service name.
    pub revnat: BTreeMap<u32, (Frontend, String)>,
    /// Allowed source ranges: (service id, address, prefix length).
    pub src_ranges: std::collections::BTreeSet<(u32, std::net::IpAddr, u8)>,
    /// `NODE_ADDRS4/6`: the node's addresses NodePorts are served on.
    pub node_addrs: BTreeSet<IpAddr>,
    /// `NODE_CONFIG[0]`.
    pub snat: Snat,
    /// `MAGLEV`: `(service id, chunk)` -> table chunk.
    pub maglev: BTreeMap<(u32, u32), Box<proxy_common::MaglevChunk>>,
}

impl Dump {
    /// Sets the slots of chunk `chunk` of `fe` to `backends` (its ids in order; a 0 is no
    /// slot), replacing what the chunk held: one `SVC` entry's slots read back.
    pub fn set_chunk(&mut self, fe: Frontend, chunk: u16, backends: &[u32]) {
        self.clear_chunk(fe, chunk);
        for (slot, id) in chunk_slots(chunk, backends) {
            self.slots.insert((fe, slot), id);
        }
    }

    /// Removes the slots of chunk `chunk` of `fe`.
    pub fn clear_chunk(&mut self, fe: Frontend, chunk: u16) {
        let first = usize::from(chunk) * SVC_CHUNK_SLOTS + 1;
        let last = (first + SVC_CHUNK_SLOTS - 1).min(usize::from(u16::MAX));
        let Ok(first) = u16::try_from(first) else {
            return;
        };
        let gone: Vec<u16> = self
            .slots
            .range((fe, first)..=(fe, last as u16))
            .map(|((_, s), _)| *s)
            .collect();
        for s in gone {
            self.slots.remove(&(fe, s));
        }
    }

    /// A stable text rendering, one entry per line (golden files, debugging).
    pub fn render(&self) -> String {
        let mut out = String::new();
        for (fe, v) in &self.frontends {
            out += &format!(
                "frontend {fe} id={} count={} flags={:#x} affinity={}\n",
                v.service_id, v.count, v.flags, v.affinity_timeout
            );
            for ((_, slot), id) in self.slots.range((*fe, 1)..=(*fe, u16::MAX)) {
                let backend = match self.backends.get(id) {
                    Some((b, _)) => b.addr.to_string(),
                    None => "MISSING".to_string(),
                };
                out += &format!("  slot {slot} -> backend {id} ({backend})\n");
            }
        }
        for ((fe, slot), id) in &self.slots {
            if !self.frontends.contains_key(fe) {
                out += &format!("orphan slot {fe} #{slot} -> backend {id}\n");
            }
        }
        for (id, (b, proto)) in &self.backends {
            out += &format!("backend {id} = {}/{proto} flags={:#x}\n", b.addr, b.flags);
        }
        for (id, addr, prefix) in &self.src_ranges {
            out += &format!("source range {id} {addr}/{prefix}\n");
        }
        for (id, (fe, name)) in &self.revnat {
            if name.is_empty() {
                out += &format!("revnat {id} = {fe}\n");
            } else {
                out += &format!("revnat {id} = {fe} {name:?}\n");
            }
        }
        for a in &self.node_addrs {
            out += &format!("node address {a}\n");
        }
        if self.snat != Snat::default() {
            out += &format!("node config {}\n", self.snat);
        }
        for ((id, chunk), v) in &self.maglev {
            out += &format!(
                "maglev {id} #{chunk} M={} hash={:016x}\n",
                v.table_size,
                crate::maglev::chunk_digest(v)
            );
        }
        out
    }
}

/// How many map elements were written by batch calls and one by one (the metric
/// `map_writes_total{mode}`), and how often a batch call fell back.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct WriteCounts {
    /// Elements written by `BPF_MAP_*_BATCH` calls.
    pub batch: u64,
    /// Elements written one by one.
    pub single: u64,
    /// Batch calls made.
    pub batch_calls: u64,
    /// Batch calls that failed and whose remaining elements were written one by one.
    pub fallbacks: u64,
    /// Groups written as two batch calls at once (`writer/split.rs`).
    pub split: u64,
}

impl WriteCounts {
    /// Adds `other` into `self`.
    pub fn add(&mut self, other: &WriteCounts) {
        self.batch += other.batch;
        self.single += other.single;
        self.batch_calls += other.batch_calls;
        self.fallbacks += other.fallbacks;
        self.split += other.split;
    }
}

/// A batch call that did not apply all of its operations: the first `applied` were (in
/// order), then the call failed.
#[derive(Debug)]
pub struct BatchFailed {
    pub applied: usize,
    pub error: io::Error,
}

/// Where the writer's operations go.
pub trait MapStore {
    /// Applies one operation. Deleting a missing key is not an error.
    fn apply(&mut self, op: &Op) -> Result<(), StoreError>;
    /// Reads back everything the writer owns.
    fn dump(&self) -> Result<Dump, StoreError>;
    /// Whether [`Self::apply_batch`] is worth calling for ops of this group.
    fn supports_batch(&self, group: Group) -> bool {
        let _ = group;
        false
    }
    /// Applies `ops` - all of one [`Op::group`], each on its own map entry, safe in any
    /// order - in as few calls as possible (a `BPF_MAP_*_BATCH` per map), in order. On a
    /// failure the ops before `applied` are written and the rest are not; the caller
    /// writes the rest one by one ([`write_batch`]).
    fn apply_batch(&mut self, ops: &[Op]) -> Result<(), BatchFailed> {
        let _ = ops;
        Err(BatchFailed {
            applied: 0,
            error: io::Error::from_raw_os_error(crate::batch::ENOTSUPP),
        })
    }
    /// Whether [`Self::apply_batch_pair`] writes its two halves at once (on two CPUs) for
    /// ops of this group: the writer then splits a large group in two
    /// ([`crate::writer::SPLIT_MIN_OPS`]).
    fn splits_batches(&self, group: Group) -> bool {
        let _ = group;
        false
    }
    /// Applies `a` and `b` - both of one [`Op::group`], every op on its own map entry
    /// (none in both), so safe in any order and at once - as [`Self::apply_batch`] each:
    /// the result of each half, its `applied` counted within that half (the other half
    /// may be written whatever this one did). Default: one after the other.
    fn apply_batch_pair(&mut self, a: &[Op], b: &[Op]) -> [Result<(), BatchFailed>; 2] {
        let first = self.apply_batch(a);
        [first, self.apply_batch(b)]
    }
    /// `max_entries` of each map sized to demand, when the store has such limits and can
    /// grow them ([`Self::grow_maps`]); `None`: it cannot.
    fn map_sizes(&self) -> Option<crate::loader::Sizes> {
        None
    }
    /// Grows the maps of each kind in `to` to its entries, all in one step, while the
    /// datapath serves (no write of the writer's runs meanwhile: it is the caller); the
    /// store's handles follow the new maps. Returns the maps resized.
    fn grow_maps(
        &mut self,
        to: &[(crate::loader::SizedMap, u32)],
    ) -> Result<Vec<crate::loader::MapResize>, StoreError> {
        Err(StoreError::Grow {
            to: describe_sizes(to),
            detail: "this store's maps cannot grow".into(),
        })
    }
}

/// `to` as text, for errors and logs: `Service=32768 Backend=32768`.
pub fn describe_sizes(to: &[(crate::loader::SizedMap, u32)]) -> String {
    to.iter()
        .map(|(k, n)| format!("{k:?}={n}"))
        .collect::<Vec<_>>()
        .join(" ")
}

/// Writes `ops` (one [`Op::group`], distinct entries) as one batch when the store has
/// batches and there is more than one op; what a failed batch call did not apply is
/// written one by one (the per-element fallback). `Err((i, e))`: `ops[i]` failed with
/// `e` (written one by one, so `e` is that element's own error), `ops[..i]` are written.
pub fn write_batch<S: MapStore + ?Sized>(
    store: &mut S,
    ops: &[Op],
    counts: &mut WriteCounts,
) -> Result<(), (usize, StoreError)> {
    let mut from = 0;
    if ops.len() > 1 && store.supports_batch(ops[0].group()) {
        debug_assert!(ops.iter().all(|op| op.group() == ops[0].group()));
        counts.batch_calls += 1;
        match store.apply_batch(ops) {
            Ok(()) => {
                counts.batch += ops.len() as u64;
                return Ok(());
            }
            Err(f) => {
                debug!(
                    group = ?ops[0].group(),
                    ops = ops.len(),
                    applied = f.applied,
                    error = %f.error,
                    "batch call failed; writing the rest one by one"
                );
                counts.batch += f.applied as u64;
                counts.fallbacks += 1;
                from = f.applied.min(ops.len());
            }
        }
    }
    for (i, op) in ops.iter().enumerate().skip(from) {
        store.apply(op).map_err(|e| (i, e))?;
        counts.single += 1;
    }
    Ok(())
}

mod mem;

pub use mem::{BatchFault, MemStore};

/// Deleting an absent key is fine (idempotent cleanup).
pub(crate) fn ignore_missing(
    r: Result<(), aya::maps::MapError>,
) -> Result<(), aya::maps::MapError> {
    match r {
        Err(aya::maps::MapError::KeyNotFound) | Err(aya::maps::MapError::ElementNotFound) => Ok(()),
        Err(aya::maps::MapError::SyscallError(e))
            if e.io_error.raw_os_error() == Some(libc::ENOENT) =>
        {
            Ok(())
        }
        other => other,
    }
}
