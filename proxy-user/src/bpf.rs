//! The pinned BPF maps, opened by path: the real [`MapStore`] the writer uses (one-element
//! writes through aya, batches through `crate::batch`), and the readers the CLI and tests
//! use (outcome counters, per-backend counters). Opening goes through [`PinDir`], the ABI
//! <-> model conversion through `crate::codec`.

use std::{
    collections::{BTreeMap, HashSet},
    net::IpAddr,
    os::fd::{AsFd as _, OwnedFd},
    path::Path,
};

use aya::{
    maps::{lpm_trie::LpmTrie, Array, MapData, MapError, PerCpuArray, PerCpuHashMap},
    Pod,
};
use proxy_common::{
    map_names as names, Backend4, Backend6, MaglevChunk, MaglevKey, NodeConfig, Reason, RevNat4,
    RevNat6, SrcRange4, SrcRange6, Svc4Key, Svc6Key, SvcValue,
};

use crate::{
    batch, codec,
    codec::{BackendValue, NodeAddrKey, RevNatValue, SrcRangeKey, SvcKey},
    model::Family,
    pins::{Access, PinDir, PinnedHash},
    store::{BatchFailed, Dump, Group, MapKind, MapStore, Op, StoreError},
};

/// Opening the pinned maps failed (see [`crate::pins::PinError`]).
pub type OpenError = crate::pins::PinError;

type Pair<K, V> = PinnedHash<K, V>;

fn open_pair<K: Pod, V: Pod>(pins: &PinDir, name: &str) -> Result<Pair<K, V>, OpenError> {
    pins.hash(name, Access::ReadWrite)
}

/// Every map the writer and the CLI use, opened from the pin directory.
pub struct BpfMaps {
    pins: PinDir,
    svc4: Pair<Svc4Key, SvcValue>,
    svc6: Pair<Svc6Key, SvcValue>,
    backend4: Pair<u32, Backend4>,
    backend6: Pair<u32, Backend6>,
    revnat4: Pair<u32, RevNat4>,
    revnat6: Pair<u32, RevNat6>,
    node4: Pair<u32, u8>,
    node6: Pair<[u32; 4], u8>,
    node_config: Array<MapData, NodeConfig>,
    backend_conns: PerCpuHashMap<MapData, u32, u64>,
    backend_conns_fd: OwnedFd,
    stats: PerCpuArray<MapData, u64>,
    src_range4: LpmTrie<MapData, SrcRange4, u8>,
    src_range6: LpmTrie<MapData, SrcRange6, u8>,
    maglev: Pair<MaglevKey, MaglevChunk>,
    ncpus: usize,
}

impl std::fmt::Debug for BpfMaps {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("BpfMaps")
            .field("dir", &self.pins.path())
            .finish()
    }
}

impl BpfMaps {
    /// Opens the maps pinned under `dir` read-write, checking the ABI version the loader
    /// recorded.
    pub fn open(dir: &Path) -> Result<Self, OpenError> {
        let pins = PinDir::new(dir);
        pins.check_abi(Access::ReadWrite)?;
        let rw = Access::ReadWrite;
        let (backend_conns, backend_conns_fd) = pins.typed_with_fd(names::BACKEND_CONNS, rw)?;
        Ok(Self {
            svc4: open_pair(&pins, names::SVC4)?,
            svc6: open_pair(&pins, names::SVC6)?,
            backend4: open_pair(&pins, names::BACKEND4)?,
            backend6: open_pair(&pins, names::BACKEND6)?,
            revnat4: open_pair(&pins, names::REVNAT4)?,
            revnat6: open_pair(&pins, names::REVNAT6)?,
            node4: open_pair(&pins, names::NODE_ADDRS4)?,
            node6: open_pair(&pins, names::NODE_ADDRS6)?,
            node_config: pins.typed(names::NODE_CONFIG, rw)?,
            backend_conns,
            backend_conns_fd,
            stats: pins.typed(names::STATS, rw)?,
            src_range4: pins.typed(names::SRC_RANGE4, rw)?,
            src_range6: pins.typed(names::SRC_RANGE6, rw)?,
            maglev: open_pair(&pins, names::MAGLEV)?,
            ncpus: aya::util::nr_cpus().map_or(1, |n| n.max(1)),
            pins,
        })
    }

    /// The pin directory.
    pub fn dir(&self) -> &Path {
        self.pins.path()
    }

    /// Every outcome counter, summed over CPUs.
    pub fn stats(&self) -> Result<Vec<(Reason, u64)>, StoreError> {
        Reason::ALL
            .iter()
            .map(|r| {
                let v = self
                    .stats
                    .get(&(*r as u32), 0)
                    .map_err(|source| StoreError::Map {
                        map: names::STATS,
                        source,
                    })?;
                Ok((*r, v.iter().sum()))
            })
            .collect()
    }

    /// Selections per backend id, summed over CPUs.
    pub fn backend_conns(&self) -> Result<BTreeMap<u32, u64>, StoreError> {
        if let Ok(v) = batch::lookup_percpu_sum::<u32>(self.backend_conns_fd.as_fd(), self.ncpus) {
            return Ok(v.into_iter().collect());
        }
        let mut out = BTreeMap::new();
        for item in self.backend_conns.iter() {
            let (id, per_cpu) = item.map_err(|source| StoreError::Map {
                map: names::BACKEND_CONNS,
                source,
            })?;
            out.insert(id, per_cpu.iter().sum());
        }
        Ok(out)
    }

    /// The ids of `ids` that have per-backend counters.
    fn conns_present(&self, ids: &[u32]) -> Result<Vec<u32>, StoreError> {
        let present: HashSet<u32> = self.backend_conns()?.into_keys().collect();
        Ok(ids
            .iter()
            .copied()
            .filter(|i| present.contains(i))
            .collect())
    }

    /// Deletes the per-backend counters of `ids` (a fresh id starts with fresh counters;
    /// a deleted backend leaves none behind).
    fn clear_conns(&mut self, ids: &[u32]) -> Result<(), StoreError> {
        let present = self.conns_present(ids)?;
        if batch::delete(self.backend_conns_fd.as_fd(), &present).is_err() {
            for id in &present {
                ignore_missing(self.backend_conns.remove(id))
                    .map_err(map_err(names::BACKEND_CONNS))?;
            }
        }
        Ok(())
    }
}

/// Writes the node's addresses (`NODE_ADDRS4/6`, replacing what was there) and the SNAT
/// addresses (`NODE_CONFIG`: the first address of each family), through the store's
/// operations. The agent does this through its writer; this is for tests and tools.
pub fn set_node_addresses(dir: &Path, addrs: &[IpAddr]) -> Result<(), StoreError> {
    let mut maps = BpfMaps::open(dir).map_err(|e| StoreError::Corrupt {
        map: names::NODE_ADDRS4,
        detail: e.to_string(),
    })?;
    let have = maps.dump()?;
    for op in crate::writer::node_address_ops(&have.node_addrs, have.snat, addrs).into_ops() {
        maps.apply(&op)?;
    }
    Ok(())
}

/// Reads `META[ABI_VERSION]` from the pin directory.
pub fn read_abi_version(dir: &Path) -> Result<u32, OpenError> {
    PinDir::new(dir).abi_version(Access::ReadOnly)
}

/// Reads one `META` entry from the pin directory.
pub fn read_meta(dir: &Path, index: u32) -> Result<u32, OpenError> {
    PinDir::new(dir).read_meta(index, Access::ReadOnly)
}

fn map_err(map: &'static str) -> impl Fn(MapError) -> StoreError {
    move |source| {
        let full = matches!(&source, MapError::SyscallError(e)
            if e.io_error.raw_os_error() == Some(libc::E2BIG)
                || e.io_error.raw_os_error() == Some(libc::ENOMEM));
        if full {
            StoreError::Full { map }
        } else {
            StoreError::Map { map, source }
        }
    }
}

/// Deleting an absent key is fine (idempotent cleanup).
fn ignore_missing(r: Result<(), MapError>) -> Result<(), MapError> {
    match r {
        Err(MapError::KeyNotFound) | Err(MapError::ElementNotFound) => Ok(()),
        Err(MapError::SyscallError(e)) if e.io_error.raw_os_error() == Some(libc::ENOENT) => Ok(()),
        other => other,
    }
}

fn corrupt(map: &'static str, detail: String) -> StoreError {
    StoreError::Corrupt { map, detail }
}

fn batch_failed(e: batch::BatchError) -> BatchFailed {
    BatchFailed {
        applied: e.done,
        error: e.error,
    }
}

fn unsupported() -> BatchFailed {
    BatchFailed {
        applied: 0,
        error: std::io::Error::from_raw_os_error(batch::ENOTSUPP),
    }
}

impl BpfMaps {
    fn put_svc(&mut self, key: SvcKey, v: SvcValue) -> Result<(), StoreError> {
        match key {
            SvcKey::V4(k) => self.svc4.map.insert(k, v, 0).map_err(map_err(names::SVC4)),
            SvcKey::V6(k) => self.svc6.map.insert(k, v, 0).map_err(map_err(names::SVC6)),
        }
    }

    fn del_svc(&mut self, key: SvcKey) -> Result<(), StoreError> {
        match key {
            SvcKey::V4(k) => ignore_missing(self.svc4.map.remove(&k)).map_err(map_err(names::SVC4)),
            SvcKey::V6(k) => ignore_missing(self.svc6.map.remove(&k)).map_err(map_err(names::SVC6)),
        }
    }

    fn src_range(&mut self, put: bool, key: SrcRangeKey) -> Result<(), StoreError> {
        match key {
            SrcRangeKey::V4(k) => {
                let r = if put {
                    self.src_range4.insert(&k, 1, 0)
                } else {
                    ignore_missing(self.src_range4.remove(&k))
                };
                r.map_err(map_err(names::SRC_RANGE4))
            }
            SrcRangeKey::V6(k) => {
                let r = if put {
                    self.src_range6.insert(&k, 1, 0)
                } else {
                    ignore_missing(self.src_range6.remove(&k))
                };
                r.map_err(map_err(names::SRC_RANGE6))
            }
        }
    }
}

/// The `SVC` key and value an op writes (`PutSlot`, `PutFrontend`) or the key it deletes.
fn svc_entry(op: &Op) -> Option<(SvcKey, Option<SvcValue>)> {
    match op {
        Op::PutSlot {
            frontend,
            slot,
            backend_id,
            service_id,
        } => Some((
            codec::svc_key(frontend, *slot),
            Some(codec::slot_value(*backend_id, *service_id)),
        )),
        Op::PutFrontend { frontend, value } => Some((
            codec::svc_key(frontend, 0),
            Some(codec::frontend_value(value)),
        )),
        Op::DelSlot { frontend, slot } => Some((codec::svc_key(frontend, *slot), None)),
        _ => None,
    }
}

/// Splits per-family keys/values out of a batch (all of one family by contract).
fn keys_values<K, V>(
    ops: &[Op],
    mut f: impl FnMut(&Op) -> Option<(K, Option<V>)>,
) -> (Vec<K>, Vec<V>) {
    let mut keys = Vec::with_capacity(ops.len());
    let mut values = Vec::with_capacity(ops.len());
    for op in ops {
        if let Some((k, v)) = f(op) {
            keys.push(k);
            values.extend(v);
        }
    }
    (keys, values)
}

impl MapStore for BpfMaps {
    fn apply(&mut self, op: &Op) -> Result<(), StoreError> {
        match op {
            Op::PutSrcRange {
                service_id,
                addr,
                prefix,
            } => self.src_range(true, codec::src_range_key(*service_id, *addr, *prefix)),
            Op::DelSrcRange {
                service_id,
                addr,
                prefix,
            } => self.src_range(false, codec::src_range_key(*service_id, *addr, *prefix)),
            Op::PutBackend { id, backend, proto } => {
                // A fresh id starts with fresh counters.
                ignore_missing(self.backend_conns.remove(id))
                    .map_err(map_err(names::BACKEND_CONNS))?;
                match codec::backend_value(backend, *proto) {
                    BackendValue::V4(v) => self
                        .backend4
                        .map
                        .insert(id, v, 0)
                        .map_err(map_err(names::BACKEND4)),
                    BackendValue::V6(v) => self
                        .backend6
                        .map
                        .insert(id, v, 0)
                        .map_err(map_err(names::BACKEND6)),
                }
            }
            Op::DelBackend { id, family } => {
                match family {
                    Family::V4 => ignore_missing(self.backend4.map.remove(id))
                        .map_err(map_err(names::BACKEND4))?,
                    Family::V6 => ignore_missing(self.backend6.map.remove(id))
                        .map_err(map_err(names::BACKEND6))?,
                }
                ignore_missing(self.backend_conns.remove(id)).map_err(map_err(names::BACKEND_CONNS))
            }
            Op::PutSlot { .. } | Op::PutFrontend { .. } | Op::DelSlot { .. } => {
                match svc_entry(op) {
                    Some((k, Some(v))) => self.put_svc(k, v),
                    Some((k, None)) => self.del_svc(k),
                    None => unreachable!("an SVC op"),
                }
            }
            Op::PutRevNat {
                service_id,
                frontend,
                name,
            } => match codec::revnat_value(frontend, name) {
                RevNatValue::V4(v) => self
                    .revnat4
                    .map
                    .insert(service_id, v, 0)
                    .map_err(map_err(names::REVNAT4)),
                RevNatValue::V6(v) => self
                    .revnat6
                    .map
                    .insert(service_id, v, 0)
                    .map_err(map_err(names::REVNAT6)),
            },
            Op::DelRevNat { service_id, family } => match family {
                Family::V4 => ignore_missing(self.revnat4.map.remove(service_id))
                    .map_err(map_err(names::REVNAT4)),
                Family::V6 => ignore_missing(self.revnat6.map.remove(service_id))
                    .map_err(map_err(names::REVNAT6)),
            },
            Op::PutNodeAddr { addr } => match codec::node_addr_key(*addr) {
                NodeAddrKey::V4(k) => self
                    .node4
                    .map
                    .insert(k, 1, 0)
                    .map_err(map_err(names::NODE_ADDRS4)),
                NodeAddrKey::V6(k) => self
                    .node6
                    .map
                    .insert(k, 1, 0)
                    .map_err(map_err(names::NODE_ADDRS6)),
            },
            Op::DelNodeAddr { addr } => {
                match codec::node_addr_key(*addr) {
                    NodeAddrKey::V4(k) => ignore_missing(self.node4.map.remove(&k))
                        .map_err(map_err(names::NODE_ADDRS4)),
                    NodeAddrKey::V6(k) => ignore_missing(self.node6.map.remove(&k))
                        .map_err(map_err(names::NODE_ADDRS6)),
                }
            }
            Op::PutNodeConfig { snat } => self
                .node_config
                .set(0, codec::node_config(snat), 0)
                .map_err(map_err(names::NODE_CONFIG)),
            Op::PutMaglev {
                service_id,
                chunk,
                value,
            } => {
                let key = MaglevKey {
                    service_id: *service_id,
                    chunk: *chunk,
                };
                self.maglev
                    .map
                    .insert(key, **value, 0)
                    .map_err(map_err(names::MAGLEV))
            }
            Op::DelMaglev { service_id, chunk } => {
                let key = MaglevKey {
                    service_id: *service_id,
                    chunk: *chunk,
                };
                ignore_missing(self.maglev.map.remove(&key)).map_err(map_err(names::MAGLEV))
            }
        }
    }

    fn supports_batch(&self, group: Group) -> bool {
        // LPM tries take no batch updates; NODE_CONFIG has one entry.
        // MAGLEV chunks are 4 KB each and few: written one by one.
        !matches!(
            group.map,
            MapKind::SrcRange | MapKind::NodeConfig | MapKind::Maglev
        )
    }

    fn apply_batch(&mut self, ops: &[Op]) -> Result<(), BatchFailed> {
        let Some(first) = ops.first() else {
            return Ok(());
        };
        let g = first.group();
        let v4 = g.family == Family::V4;
        let fail = |e: StoreError| BatchFailed {
            applied: 0,
            error: std::io::Error::other(e.to_string()),
        };
        match (g.map, g.delete) {
            (MapKind::Backend, false) => {
                let ids: Vec<u32> = ops
                    .iter()
                    .filter_map(|op| match op {
                        Op::PutBackend { id, .. } => Some(*id),
                        _ => None,
                    })
                    .collect();
                self.clear_conns(&ids).map_err(fail)?;
                let vals = ops.iter().filter_map(|op| match op {
                    Op::PutBackend { backend, proto, .. } => {
                        Some(codec::backend_value(backend, *proto))
                    }
                    _ => None,
                });
                if v4 {
                    let v: Vec<Backend4> = vals
                        .filter_map(|b| match b {
                            BackendValue::V4(b) => Some(b),
                            BackendValue::V6(_) => None,
                        })
                        .collect();
                    batch::update(self.backend4.fd.as_fd(), &ids, &v)
                } else {
                    let v: Vec<Backend6> = vals
                        .filter_map(|b| match b {
                            BackendValue::V6(b) => Some(b),
                            BackendValue::V4(_) => None,
                        })
                        .collect();
                    batch::update(self.backend6.fd.as_fd(), &ids, &v)
                }
                .map_err(batch_failed)
            }
            (MapKind::Backend, true) => {
                let ids: Vec<u32> = ops
                    .iter()
                    .filter_map(|op| match op {
                        Op::DelBackend { id, .. } => Some(*id),
                        _ => None,
                    })
                    .collect();
                let fd = if v4 {
                    self.backend4.fd.as_fd()
                } else {
                    self.backend6.fd.as_fd()
                };
                let r = batch::delete(fd, &ids);
                let done = r.as_ref().map_or_else(|e| e.done, |_| ids.len());
                self.clear_conns(&ids[..done]).map_err(fail)?;
                r.map_err(batch_failed)
            }
            (MapKind::Svc, delete) => {
                let res = if v4 {
                    let (k, v) = keys_values(ops, |op| {
                        svc_entry(op).and_then(|(k, v)| match k {
                            SvcKey::V4(k) => Some((k, v)),
                            SvcKey::V6(_) => None,
                        })
                    });
                    if delete {
                        batch::delete(self.svc4.fd.as_fd(), &k)
                    } else {
                        batch::update(self.svc4.fd.as_fd(), &k, &v)
                    }
                } else {
                    let (k, v) = keys_values(ops, |op| {
                        svc_entry(op).and_then(|(k, v)| match k {
                            SvcKey::V6(k) => Some((k, v)),
                            SvcKey::V4(_) => None,
                        })
                    });
                    if delete {
                        batch::delete(self.svc6.fd.as_fd(), &k)
                    } else {
                        batch::update(self.svc6.fd.as_fd(), &k, &v)
                    }
                };
                res.map_err(batch_failed)
            }
            (MapKind::RevNat, delete) => {
                let entry = |op: &Op| match op {
                    Op::PutRevNat {
                        service_id,
                        frontend,
                        name,
                    } => Some((*service_id, Some(codec::revnat_value(frontend, name)))),
                    Op::DelRevNat { service_id, .. } => Some((*service_id, None)),
                    _ => None,
                };
                let res = if v4 {
                    let (k, v) = keys_values(ops, |op| {
                        entry(op).map(|(k, v)| {
                            (
                                k,
                                v.and_then(|v| match v {
                                    RevNatValue::V4(v) => Some(v),
                                    RevNatValue::V6(_) => None,
                                }),
                            )
                        })
                    });
                    if delete {
                        batch::delete(self.revnat4.fd.as_fd(), &k)
                    } else {
                        batch::update(self.revnat4.fd.as_fd(), &k, &v)
                    }
                } else {
                    let (k, v) = keys_values(ops, |op| {
                        entry(op).map(|(k, v)| {
                            (
                                k,
                                v.and_then(|v| match v {
                                    RevNatValue::V6(v) => Some(v),
                                    RevNatValue::V4(_) => None,
                                }),
                            )
                        })
                    });
                    if delete {
                        batch::delete(self.revnat6.fd.as_fd(), &k)
                    } else {
                        batch::update(self.revnat6.fd.as_fd(), &k, &v)
                    }
                };
                res.map_err(batch_failed)
            }
            (MapKind::NodeAddr, delete) => {
                let addrs = ops.iter().filter_map(|op| match op {
                    Op::PutNodeAddr { addr } | Op::DelNodeAddr { addr } => {
                        Some(codec::node_addr_key(*addr))
                    }
                    _ => None,
                });
                let res = if v4 {
                    let k: Vec<u32> = addrs
                        .filter_map(|a| match a {
                            NodeAddrKey::V4(k) => Some(k),
                            NodeAddrKey::V6(_) => None,
                        })
                        .collect();
                    if delete {
                        batch::delete(self.node4.fd.as_fd(), &k)
                    } else {
                        batch::update(self.node4.fd.as_fd(), &k, &vec![1u8; k.len()])
                    }
                } else {
                    let k: Vec<[u32; 4]> = addrs
                        .filter_map(|a| match a {
                            NodeAddrKey::V6(k) => Some(k),
                            NodeAddrKey::V4(_) => None,
                        })
                        .collect();
                    if delete {
                        batch::delete(self.node6.fd.as_fd(), &k)
                    } else {
                        batch::update(self.node6.fd.as_fd(), &k, &vec![1u8; k.len()])
                    }
                };
                res.map_err(batch_failed)
            }
            // LPM tries have no batch operations; NODE_CONFIG has one entry.
            (MapKind::SrcRange, _) | (MapKind::NodeConfig, _) | (MapKind::Maglev, _) => {
                Err(unsupported())
            }
        }
    }

    fn dump(&self) -> Result<Dump, StoreError> {
        let mut d = Dump::default();
        for (id, b) in self.backend4.read_all().map_err(map_err(names::BACKEND4))? {
            let b = codec::decode_backend4(&b).ok_or_else(|| {
                corrupt(names::BACKEND4, format!("backend {id}: proto {}", b.proto))
            })?;
            d.backends.insert(id, b);
        }
        for (id, b) in self.backend6.read_all().map_err(map_err(names::BACKEND6))? {
            let b = codec::decode_backend6(&b).ok_or_else(|| {
                corrupt(names::BACKEND6, format!("backend {id}: proto {}", b.proto))
            })?;
            d.backends.insert(id, b);
        }
        for (k, v) in self.svc4.read_all().map_err(map_err(names::SVC4))? {
            let fe = codec::decode_svc4(&k)
                .ok_or_else(|| corrupt(names::SVC4, format!("proto {}", k.proto)))?;
            codec::put_svc(&mut d, fe, k.slot, &v);
        }
        for (k, v) in self.svc6.read_all().map_err(map_err(names::SVC6))? {
            let fe = codec::decode_svc6(&k)
                .ok_or_else(|| corrupt(names::SVC6, format!("proto {}", k.proto)))?;
            codec::put_svc(&mut d, fe, k.slot, &v);
        }
        for (id, r) in self.revnat4.read_all().map_err(map_err(names::REVNAT4))? {
            let entry = codec::decode_revnat4(&r)
                .ok_or_else(|| corrupt(names::REVNAT4, format!("proto {}", r.proto)))?;
            d.revnat.insert(id, entry);
        }
        for (id, r) in self.revnat6.read_all().map_err(map_err(names::REVNAT6))? {
            let entry = codec::decode_revnat6(&r)
                .ok_or_else(|| corrupt(names::REVNAT6, format!("proto {}", r.proto)))?;
            d.revnat.insert(id, entry);
        }
        for k in self.src_range4.keys() {
            let k = k.map_err(map_err(names::SRC_RANGE4))?;
            d.src_ranges.insert(codec::decode_src_range4(&k));
        }
        for k in self.src_range6.keys() {
            let k = k.map_err(map_err(names::SRC_RANGE6))?;
            d.src_ranges.insert(codec::decode_src_range6(&k));
        }
        for (k, _) in self.node4.read_all().map_err(map_err(names::NODE_ADDRS4))? {
            d.node_addrs.insert(codec::decode_node_addr4(k));
        }
        for (k, _) in self.node6.read_all().map_err(map_err(names::NODE_ADDRS6))? {
            d.node_addrs.insert(codec::decode_node_addr6(k));
        }
        let cfg = self
            .node_config
            .get(&0, 0)
            .map_err(map_err(names::NODE_CONFIG))?;
        d.snat = codec::decode_node_config(&cfg);
        for (k, v) in self.maglev.read_all().map_err(map_err(names::MAGLEV))? {
            d.maglev.insert((k.service_id, k.chunk), Box::new(v));
        }
        Ok(d)
    }
}
