//! The pinned BPF maps, opened by path: the real [`MapStore`] the writer uses, and the
//! readers the CLI and tests use (outcome counters, per-backend counters).

use std::{
    collections::BTreeMap,
    net::{IpAddr, SocketAddr},
    path::{Path, PathBuf},
};

use aya::maps::{
    lpm_trie::{Key as LpmKey, LpmTrie},
    Array, HashMap, Map, MapData, MapError, PerCpuArray, PerCpuHashMap,
};
use proxy_common::{
    map_names as names, Backend4, Backend6, Reason, RevNat4, RevNat6, SrcRange4, SrcRange6,
    Svc4Key, Svc6Key, SvcValue,
};

use crate::{
    model::{
        name_bytes, name_from_bytes, port_host, port_net, v4_from_word, v4_word, v6_from_words,
        v6_words, Backend, Family, Frontend, Proto,
    },
    store::{Dump, FrontendValue, MapStore, Op, StoreError},
};

/// Opening the pinned maps failed.
#[derive(Debug, thiserror::Error)]
pub enum OpenError {
    #[error("no pinned map {path}: is proxy-agent installed with this --pin-path?")]
    Missing { path: PathBuf },
    #[error("pinned map {path}: permission denied (run as root or with CAP_BPF)")]
    Permission { path: PathBuf },
    #[error("pinned map {path}: {source}")]
    Map {
        path: PathBuf,
        #[source]
        source: MapError,
    },
    #[error(
        "pinned maps at {dir} have ABI version {found}, this binary speaks {expected}: \
             uninstall the old datapath first (proxy-agent uninstall)"
    )]
    Abi {
        dir: PathBuf,
        found: u32,
        expected: u32,
    },
}

fn open_map(dir: &Path, name: &str) -> Result<Map, OpenError> {
    let path = dir.join(name);
    let data = MapData::from_pin(&path).map_err(|source| classify(&path, source))?;
    Map::from_map_data(data).map_err(|source| OpenError::Map { path, source })
}

fn classify(path: &Path, source: MapError) -> OpenError {
    let errno = match &source {
        MapError::SyscallError(e) => e.io_error.raw_os_error(),
        _ => None,
    };
    match errno {
        Some(libc::ENOENT) => OpenError::Missing {
            path: path.to_owned(),
        },
        Some(libc::EACCES) | Some(libc::EPERM) => OpenError::Permission {
            path: path.to_owned(),
        },
        _ => OpenError::Map {
            path: path.to_owned(),
            source,
        },
    }
}

macro_rules! typed {
    ($dir:expr, $name:expr) => {{
        let path = $dir.join($name);
        open_map($dir, $name)?
            .try_into()
            .map_err(|source| OpenError::Map { path, source })?
    }};
}

/// Every map the writer and the CLI use, opened from the pin directory.
pub struct BpfMaps {
    dir: PathBuf,
    svc4: HashMap<MapData, Svc4Key, SvcValue>,
    svc6: HashMap<MapData, Svc6Key, SvcValue>,
    backend4: HashMap<MapData, u32, Backend4>,
    backend6: HashMap<MapData, u32, Backend6>,
    revnat4: HashMap<MapData, u32, RevNat4>,
    revnat6: HashMap<MapData, u32, RevNat6>,
    backend_conns: PerCpuHashMap<MapData, u32, u64>,
    stats: PerCpuArray<MapData, u64>,
    src_range4: LpmTrie<MapData, SrcRange4, u8>,
    src_range6: LpmTrie<MapData, SrcRange6, u8>,
}

impl std::fmt::Debug for BpfMaps {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("BpfMaps").field("dir", &self.dir).finish()
    }
}

impl BpfMaps {
    /// Opens the maps pinned under `dir`, checking the ABI version the loader recorded.
    pub fn open(dir: &Path) -> Result<Self, OpenError> {
        let found = read_abi_version(dir)?;
        if found != proxy_common::ABI_VERSION {
            return Err(OpenError::Abi {
                dir: dir.to_owned(),
                found,
                expected: proxy_common::ABI_VERSION,
            });
        }
        Ok(Self {
            dir: dir.to_owned(),
            svc4: typed!(dir, names::SVC4),
            svc6: typed!(dir, names::SVC6),
            backend4: typed!(dir, names::BACKEND4),
            backend6: typed!(dir, names::BACKEND6),
            revnat4: typed!(dir, names::REVNAT4),
            revnat6: typed!(dir, names::REVNAT6),
            backend_conns: typed!(dir, names::BACKEND_CONNS),
            stats: typed!(dir, names::STATS),
            src_range4: typed!(dir, names::SRC_RANGE4),
            src_range6: typed!(dir, names::SRC_RANGE6),
        })
    }

    /// The pin directory.
    pub fn dir(&self) -> &Path {
        &self.dir
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
}

/// Writes the node's addresses (`NODE_ADDRS4/6`, replacing what was there) and the SNAT
/// addresses (`NODE_CONFIG`: the first address of each family).
pub fn set_node_addresses(dir: &Path, addrs: &[IpAddr]) -> Result<(), OpenError> {
    use proxy_common::NodeConfig;
    let mut n4: HashMap<MapData, u32, u8> = typed!(dir, names::NODE_ADDRS4);
    let mut n6: HashMap<MapData, [u32; 4], u8> = typed!(dir, names::NODE_ADDRS6);
    let mut cfg: Array<MapData, NodeConfig> = typed!(dir, names::NODE_CONFIG);
    let err = |name: &str| {
        let path = dir.join(name);
        move |source| OpenError::Map { path, source }
    };
    let want4: Vec<u32> = addrs
        .iter()
        .filter_map(|a| match a {
            IpAddr::V4(v) => Some(v4_word(*v)),
            _ => None,
        })
        .collect();
    let want6: Vec<[u32; 4]> = addrs
        .iter()
        .filter_map(|a| match a {
            IpAddr::V6(v) => Some(v6_words(*v)),
            _ => None,
        })
        .collect();
    for a in &want4 {
        n4.insert(a, 1, 0).map_err(err(names::NODE_ADDRS4))?;
    }
    for a in &want6 {
        n6.insert(a, 1, 0).map_err(err(names::NODE_ADDRS6))?;
    }
    let stale4: Vec<u32> = n4
        .keys()
        .filter_map(Result::ok)
        .filter(|k| !want4.contains(k))
        .collect();
    for k in stale4 {
        let _ = n4.remove(&k);
    }
    let stale6: Vec<[u32; 4]> = n6
        .keys()
        .filter_map(Result::ok)
        .filter(|k| !want6.contains(k))
        .collect();
    for k in stale6 {
        let _ = n6.remove(&k);
    }
    let config = NodeConfig {
        snat4: want4.first().copied().unwrap_or(0),
        snat6: want6.first().copied().unwrap_or([0; 4]),
    };
    cfg.set(0, config, 0).map_err(err(names::NODE_CONFIG))
}

/// Reads `META[ABI_VERSION]` from the pin directory.
pub fn read_abi_version(dir: &Path) -> Result<u32, OpenError> {
    read_meta(dir, proxy_common::meta::ABI_VERSION)
}

/// Reads one `META` entry from the pin directory.
pub fn read_meta(dir: &Path, index: u32) -> Result<u32, OpenError> {
    let path = dir.join(names::META);
    let meta: Array<MapData, u32> = typed!(dir, names::META);
    meta.get(&index, 0)
        .map_err(|source| OpenError::Map { path, source })
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

fn svc4_key(fe: &Frontend, slot: u16) -> Option<Svc4Key> {
    match fe.addr {
        IpAddr::V4(a) => Some(Svc4Key::new(
            v4_word(a),
            port_net(fe.port),
            fe.proto.number(),
            fe.scope,
            slot,
        )),
        IpAddr::V6(_) => None,
    }
}

fn svc6_key(fe: &Frontend, slot: u16) -> Option<Svc6Key> {
    match fe.addr {
        IpAddr::V6(a) => Some(Svc6Key::new(
            v6_words(a),
            port_net(fe.port),
            fe.proto.number(),
            fe.scope,
            slot,
        )),
        IpAddr::V4(_) => None,
    }
}

fn slot0(v: &FrontendValue) -> SvcValue {
    SvcValue {
        backend_id: 0,
        service_id: v.service_id,
        count: v.count,
        flags: v.flags,
        affinity_timeout: v.affinity_timeout,
    }
}

fn slot_value(backend_id: u32, service_id: u32) -> SvcValue {
    SvcValue {
        backend_id,
        service_id,
        ..SvcValue::default()
    }
}

impl BpfMaps {
    fn put_svc(&mut self, fe: &Frontend, slot: u16, v: SvcValue) -> Result<(), StoreError> {
        if let Some(k) = svc4_key(fe, slot) {
            self.svc4.insert(k, v, 0).map_err(map_err(names::SVC4))
        } else if let Some(k) = svc6_key(fe, slot) {
            self.svc6.insert(k, v, 0).map_err(map_err(names::SVC6))
        } else {
            unreachable!("a frontend is v4 or v6")
        }
    }

    fn del_svc(&mut self, fe: &Frontend, slot: u16) -> Result<(), StoreError> {
        if let Some(k) = svc4_key(fe, slot) {
            ignore_missing(self.svc4.remove(&k)).map_err(map_err(names::SVC4))
        } else if let Some(k) = svc6_key(fe, slot) {
            ignore_missing(self.svc6.remove(&k)).map_err(map_err(names::SVC6))
        } else {
            unreachable!("a frontend is v4 or v6")
        }
    }
}

impl BpfMaps {
    fn src_range(
        &mut self,
        put: bool,
        service_id: u32,
        addr: IpAddr,
        prefix: u8,
    ) -> Result<(), StoreError> {
        match addr {
            IpAddr::V4(a) => {
                let key = LpmKey::new(
                    32 + u32::from(prefix),
                    SrcRange4 {
                        service_id,
                        addr: v4_word(a),
                    },
                );
                let r = if put {
                    self.src_range4.insert(&key, 1, 0)
                } else {
                    ignore_missing(self.src_range4.remove(&key))
                };
                r.map_err(map_err(names::SRC_RANGE4))
            }
            IpAddr::V6(a) => {
                let key = LpmKey::new(
                    32 + u32::from(prefix),
                    SrcRange6 {
                        service_id,
                        addr: v6_words(a),
                    },
                );
                let r = if put {
                    self.src_range6.insert(&key, 1, 0)
                } else {
                    ignore_missing(self.src_range6.remove(&key))
                };
                r.map_err(map_err(names::SRC_RANGE6))
            }
        }
    }
}

impl MapStore for BpfMaps {
    fn apply(&mut self, op: &Op) -> Result<(), StoreError> {
        match op {
            Op::PutSrcRange {
                service_id,
                addr,
                prefix,
            } => self.src_range(true, *service_id, *addr, *prefix),
            Op::DelSrcRange {
                service_id,
                addr,
                prefix,
            } => self.src_range(false, *service_id, *addr, *prefix),
            Op::PutBackend { id, backend, proto } => {
                // A fresh id starts with fresh counters.
                ignore_missing(self.backend_conns.remove(id))
                    .map_err(map_err(names::BACKEND_CONNS))?;
                match backend.addr {
                    SocketAddr::V4(a) => {
                        let v = Backend4 {
                            addr: v4_word(*a.ip()),
                            port: port_net(a.port()),
                            proto: proto.number(),
                            flags: backend.flags,
                        };
                        self.backend4
                            .insert(id, v, 0)
                            .map_err(map_err(names::BACKEND4))
                    }
                    SocketAddr::V6(a) => {
                        let v = Backend6 {
                            addr: v6_words(*a.ip()),
                            port: port_net(a.port()),
                            proto: proto.number(),
                            flags: backend.flags,
                        };
                        self.backend6
                            .insert(id, v, 0)
                            .map_err(map_err(names::BACKEND6))
                    }
                }
            }
            Op::DelBackend { id, family } => {
                match family {
                    Family::V4 => ignore_missing(self.backend4.remove(id))
                        .map_err(map_err(names::BACKEND4))?,
                    Family::V6 => ignore_missing(self.backend6.remove(id))
                        .map_err(map_err(names::BACKEND6))?,
                }
                ignore_missing(self.backend_conns.remove(id)).map_err(map_err(names::BACKEND_CONNS))
            }
            Op::PutSlot {
                frontend,
                slot,
                backend_id,
                service_id,
            } => self.put_svc(frontend, *slot, slot_value(*backend_id, *service_id)),
            Op::PutFrontend { frontend, value } => self.put_svc(frontend, 0, slot0(value)),
            Op::DelSlot { frontend, slot } => self.del_svc(frontend, *slot),
            Op::PutRevNat {
                service_id,
                frontend,
                name,
            } => match frontend.addr {
                IpAddr::V4(a) => {
                    let v = RevNat4 {
                        addr: v4_word(a),
                        port: port_net(frontend.port),
                        proto: frontend.proto.number(),
                        scope: frontend.scope,
                        name: name_bytes(name),
                    };
                    self.revnat4
                        .insert(service_id, v, 0)
                        .map_err(map_err(names::REVNAT4))
                }
                IpAddr::V6(a) => {
                    let v = RevNat6 {
                        addr: v6_words(a),
                        port: port_net(frontend.port),
                        proto: frontend.proto.number(),
                        scope: frontend.scope,
                        name: name_bytes(name),
                    };
                    self.revnat6
                        .insert(service_id, v, 0)
                        .map_err(map_err(names::REVNAT6))
                }
            },
            Op::DelRevNat { service_id, family } => {
                match family {
                    Family::V4 => ignore_missing(self.revnat4.remove(service_id))
                        .map_err(map_err(names::REVNAT4)),
                    Family::V6 => ignore_missing(self.revnat6.remove(service_id))
                        .map_err(map_err(names::REVNAT6)),
                }
            }
        }
    }

    fn dump(&self) -> Result<Dump, StoreError> {
        let mut d = Dump::default();
        let corrupt = |map: &'static str, detail: String| StoreError::Corrupt { map, detail };

        for item in self.backend4.iter() {
            let (id, b) = item.map_err(map_err(names::BACKEND4))?;
            let proto = Proto::from_number(b.proto).ok_or_else(|| {
                corrupt(names::BACKEND4, format!("backend {id}: proto {}", b.proto))
            })?;
            let addr = SocketAddr::from((v4_from_word(b.addr), port_host(b.port)));
            d.backends.insert(
                id,
                (
                    Backend {
                        addr,
                        flags: b.flags,
                    },
                    proto,
                ),
            );
        }
        for item in self.backend6.iter() {
            let (id, b) = item.map_err(map_err(names::BACKEND6))?;
            let proto = Proto::from_number(b.proto).ok_or_else(|| {
                corrupt(names::BACKEND6, format!("backend {id}: proto {}", b.proto))
            })?;
            let addr = SocketAddr::from((v6_from_words(b.addr), port_host(b.port)));
            d.backends.insert(
                id,
                (
                    Backend {
                        addr,
                        flags: b.flags,
                    },
                    proto,
                ),
            );
        }
        let mut put_svc = |fe: Frontend, slot: u16, v: SvcValue| {
            if slot == 0 {
                d.frontends.insert(
                    fe,
                    FrontendValue {
                        service_id: v.service_id,
                        count: v.count,
                        flags: v.flags,
                        affinity_timeout: v.affinity_timeout,
                    },
                );
            } else {
                d.slots.insert((fe, slot), v.backend_id);
            }
        };
        for item in self.svc4.iter() {
            let (k, v) = item.map_err(map_err(names::SVC4))?;
            let proto = Proto::from_number(k.proto)
                .ok_or_else(|| corrupt(names::SVC4, format!("proto {}", k.proto)))?;
            let fe = Frontend::new(v4_from_word(k.addr), port_host(k.port), proto);
            put_svc(fe.with_scope(k.scope), k.slot, v);
        }
        for item in self.svc6.iter() {
            let (k, v) = item.map_err(map_err(names::SVC6))?;
            let proto = Proto::from_number(k.proto)
                .ok_or_else(|| corrupt(names::SVC6, format!("proto {}", k.proto)))?;
            let fe = Frontend::new(v6_from_words(k.addr), port_host(k.port), proto);
            put_svc(fe.with_scope(k.scope), k.slot, v);
        }
        for item in self.revnat4.iter() {
            let (id, r) = item.map_err(map_err(names::REVNAT4))?;
            let proto = Proto::from_number(r.proto)
                .ok_or_else(|| corrupt(names::REVNAT4, format!("proto {}", r.proto)))?;
            let fe = Frontend::new(v4_from_word(r.addr), port_host(r.port), proto);
            d.revnat
                .insert(id, (fe.with_scope(r.scope), name_from_bytes(&r.name)));
        }
        for item in self.revnat6.iter() {
            let (id, r) = item.map_err(map_err(names::REVNAT6))?;
            let proto = Proto::from_number(r.proto)
                .ok_or_else(|| corrupt(names::REVNAT6, format!("proto {}", r.proto)))?;
            let fe = Frontend::new(v6_from_words(r.addr), port_host(r.port), proto);
            d.revnat
                .insert(id, (fe.with_scope(r.scope), name_from_bytes(&r.name)));
        }
        for item in self.src_range4.iter() {
            let (k, _) = item.map_err(map_err(names::SRC_RANGE4))?;
            let data = k.data();
            let prefix = k.prefix_len().saturating_sub(32) as u8;
            d.src_ranges
                .insert((data.service_id, IpAddr::V4(v4_from_word(data.addr)), prefix));
        }
        for item in self.src_range6.iter() {
            let (k, _) = item.map_err(map_err(names::SRC_RANGE6))?;
            let data = k.data();
            let prefix = k.prefix_len().saturating_sub(32) as u8;
            d.src_ranges.insert((
                data.service_id,
                IpAddr::V6(v6_from_words(data.addr)),
                prefix,
            ));
        }
        Ok(d)
    }
}
