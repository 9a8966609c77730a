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
use proxy_common::{map_names as names, MaglevChunk, MaglevKey, NodeConfig, Reason, SvcEntry};

use crate::{
    batch,
    codec::{FamilyAbi, Ipv4, Ipv6},
    pins::{Access, PinDir, PinnedBackends, PinnedHash},
    store::{MapStore, StoreError},
};

mod store;

pub(crate) use store::ignore_missing;
use store::map_err;

/// Opening the pinned maps failed (see [`crate::pins::PinError`]).
pub type OpenError = crate::pins::PinError;

type Pair<K, V> = PinnedHash<K, V>;

fn open_pair<K: Pod, V: Pod>(pins: &PinDir, name: &str) -> Result<Pair<K, V>, OpenError> {
    pins.hash(name, Access::ReadWrite)
}

/// The pinned sizes of the maps sized to demand (`None` without a pinned `SVC4`).
fn pinned_sizes(pins: &PinDir) -> Option<crate::loader::Sizes> {
    pins.max_entries(names::SVC4)?;
    Some(crate::loader::Sizes::pinned_or(
        pins,
        crate::loader::Sizes::compiled(),
    ))
}

/// `BACKEND_GEN[0]` := its next generation.
fn bump_gen(map: &mut Array<MapData, u32>) -> Result<u32, MapError> {
    let next = proxy_common::next_backend_gen(map.get(&0, 0)?);
    map.set(0, next, 0)?;
    Ok(next)
}

/// One family's maps (`SVC4`, `BACKEND4`, `REVNAT4`, `NODE_ADDRS4`, `SRC_RANGE4`, or
/// their `*6` twins): the store's code over them is written once (`store.rs`).
struct FamilyMaps<F: FamilyAbi> {
    svc: Pair<F::SvcKey, SvcEntry>,
    backend: PinnedBackends<F::Backend>,
    revnat: Pair<u32, F::RevNat>,
    node: Pair<F::Addr, u8>,
    src_range: LpmTrie<MapData, F::SrcRange, u8>,
}

impl<F: FamilyAbi> FamilyMaps<F> {
    fn open(pins: &PinDir) -> Result<Self, OpenError> {
        Ok(Self {
            svc: open_pair(pins, F::SVC)?,
            backend: pins.backends(F::BACKEND, Access::ReadWrite)?,
            revnat: open_pair(pins, F::REVNAT)?,
            node: open_pair(pins, F::NODE_ADDRS)?,
            src_range: pins.typed(F::SRC_RANGE, Access::ReadWrite)?,
        })
    }
}

/// Every map the writer and the CLI use, opened from the pin directory.
pub struct BpfMaps {
    pins: PinDir,
    v4: FamilyMaps<Ipv4>,
    v6: FamilyMaps<Ipv6>,
    node_config: Array<MapData, NodeConfig>,
    backend_conns: PerCpuHashMap<MapData, u32, u64>,
    backend_conns_fd: OwnedFd,
    stats: PerCpuArray<MapData, u64>,
    maglev: Pair<MaglevKey, MaglevChunk>,
    backend_gen: Array<MapData, u32>,
    /// `SVC_COUNTERS`/`BACKEND_COUNTERS` (`--metrics-per-service`): an id's entry is
    /// deleted whenever the id is assigned or freed. `None`: pins without them.
    counters: Option<crate::counters::CounterMaps>,
    ncpus: usize,
    /// The pinned sizes of the maps sized to demand, read at open and after each growth
    /// (`MapStore::map_sizes`, asked before every sync); `None`: no service map pinned.
    sizes: Option<crate::loader::Sizes>,
}

impl std::fmt::Debug for BpfMaps {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("BpfMaps")
            .field("dir", &self.pins.path())
            .finish()
    }
}

impl BpfMaps {
    /// Opens the maps pinned in `pins` read-write, checking the ABI version the loader
    /// recorded. Bumps `BACKEND_GEN` (see [`Self::bump_backend_gen`]): an earlier writer
    /// may have deleted backends and stopped before its own bump.
    pub fn open(pins: impl Into<PinDir>) -> Result<Self, OpenError> {
        let pins: PinDir = pins.into();
        pins.check_abi(Access::ReadWrite)?;
        let rw = Access::ReadWrite;
        let (backend_conns, backend_conns_fd) = pins.typed_with_fd(names::BACKEND_CONNS, rw)?;
        let mut maps = Self {
            v4: FamilyMaps::open(&pins)?,
            v6: FamilyMaps::open(&pins)?,
            node_config: pins.typed(names::NODE_CONFIG, rw)?,
            backend_conns,
            backend_conns_fd,
            stats: pins.typed(names::STATS, rw)?,
            maglev: open_pair(&pins, names::MAGLEV)?,
            backend_gen: pins.typed(names::BACKEND_GEN, rw)?,
            counters: crate::counters::CounterMaps::open(&pins)?,
            ncpus: aya::util::nr_cpus().map_or(1, |n| n.max(1)),
            sizes: pinned_sizes(&pins),
            pins,
        };
        bump_gen(&mut maps.backend_gen).map_err(|source| OpenError::Map {
            path: maps.pins.map_path(names::BACKEND_GEN),
            source,
        })?;
        Ok(maps)
    }

    /// Reopens the handles on the maps sized to demand (after they were resized: new map
    /// objects under the same pins), without bumping `BACKEND_GEN`.
    fn reopen_sized(&mut self) -> Result<(), OpenError> {
        let rw = Access::ReadWrite;
        self.v4 = FamilyMaps::open(&self.pins)?;
        self.v6 = FamilyMaps::open(&self.pins)?;
        let (backend_conns, backend_conns_fd) =
            self.pins.typed_with_fd(names::BACKEND_CONNS, rw)?;
        self.backend_conns = backend_conns;
        self.backend_conns_fd = backend_conns_fd;
        self.maglev = open_pair(&self.pins, names::MAGLEV)?;
        self.counters = crate::counters::CounterMaps::open(&self.pins)?;
        self.sizes = pinned_sizes(&self.pins);
        Ok(())
    }

    /// `BACKEND_GEN[0]` := the next generation, after backends were deleted: every UDP
    /// flow's next packet looks its backend up again (once), and a flow whose backend is
    /// gone is balanced afresh (`proxy-ebpf` `ct::backend_still_there`).
    pub fn bump_backend_gen(&mut self) -> Result<u32, StoreError> {
        bump_gen(&mut self.backend_gen).map_err(map_err(names::BACKEND_GEN))
    }

    /// `BACKEND_GEN[0]`, the backend generation (0: never bumped).
    pub fn backend_gen(&self) -> Result<u32, StoreError> {
        self.backend_gen
            .get(&0, 0)
            .map_err(map_err(names::BACKEND_GEN))
    }

    /// The pin directory.
    pub fn dir(&self) -> &Path {
        self.pins.path()
    }

    /// Every outcome counter, summed over CPUs. A reason past the end of the pinned
    /// array (pins made by an older build of the same ABI, before that reason existed)
    /// reads 0.
    pub fn stats(&self) -> Result<Vec<(Reason, u64)>, StoreError> {
        Reason::ALL
            .iter()
            .map(|r| match self.stats.get(&(*r as u32), 0) {
                Ok(v) => Ok((*r, v.iter().sum())),
                Err(MapError::OutOfBounds { .. }) => Ok((*r, 0)),
                Err(source) => Err(StoreError::Map {
                    map: names::STATS,
                    source,
                }),
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

    /// Deletes the per-Service or per-backend counters of `ids` (assigned or freed).
    fn reset_counters(
        &mut self,
        kind: crate::counters::CounterKind,
        ids: &[u32],
    ) -> Result<(), StoreError> {
        match &mut self.counters {
            Some(c) => c.reset(kind, ids),
            None => Ok(()),
        }
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
        self.reset_counters(crate::counters::CounterKind::Backend, ids)?;
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
pub fn set_node_addresses(pins: &PinDir, addrs: &[IpAddr]) -> Result<(), StoreError> {
    let mut maps = BpfMaps::open(pins).map_err(|e| StoreError::Corrupt {
        map: names::NODE_ADDRS4,
        detail: e.to_string(),
    })?;
    let have = maps.dump()?;
    for op in crate::writer::node_address_ops(&have.node_addrs, have.snat, addrs).into_ops() {
        maps.apply(&op)?;
    }
    Ok(())
}
