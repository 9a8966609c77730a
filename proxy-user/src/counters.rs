//! The per-Service and per-backend counters (`--metrics-per-service`): `COUNTERS_ON`,
//! `SVC_COUNTERS` (service id -> connections, packets; per CPU) and `BACKEND_COUNTERS`
//! (backend id -> the same). The datapath counts only while `COUNTERS_ON[0]` is 1; the
//! writer's store deletes an id's entry whenever the id is (re)assigned or freed
//! ([`CounterMaps::reset`]), so a reused id never carries its previous owner's counts.

use std::{
    collections::HashSet,
    os::fd::{AsFd, OwnedFd},
};

use aya::maps::{Array, MapData, MapError, PerCpuHashMap};
use proxy_common::{map_names as names, FlowCounts};

use crate::{
    batch,
    pins::{Access, PinDir, PinError},
    store::StoreError,
};

/// Which of the two counter maps.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum CounterKind {
    /// `SVC_COUNTERS`, by service id (one frontend).
    Service,
    /// `BACKEND_COUNTERS`, by backend id.
    Backend,
}

impl CounterKind {
    fn map_name(self) -> &'static str {
        match self {
            CounterKind::Service => names::SVC_COUNTERS,
            CounterKind::Backend => names::BACKEND_COUNTERS,
        }
    }
}

/// The three pinned maps, opened read-write.
pub struct CounterMaps {
    on: Array<MapData, u32>,
    svc: (PerCpuHashMap<MapData, u32, FlowCounts>, OwnedFd),
    backend: (PerCpuHashMap<MapData, u32, FlowCounts>, OwnedFd),
    ncpus: usize,
}

impl std::fmt::Debug for CounterMaps {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CounterMaps").finish_non_exhaustive()
    }
}

fn map_err(map: &'static str) -> impl Fn(MapError) -> StoreError {
    move |source| StoreError::Map { map, source }
}

impl CounterMaps {
    /// Opens the maps in `pins`; `Ok(None)` when they are not there (pins of a build
    /// before them: the running programs do not count).
    pub fn open(pins: &PinDir) -> Result<Option<Self>, PinError> {
        let rw = Access::ReadWrite;
        let on = match pins.typed(names::COUNTERS_ON, rw) {
            Ok(m) => m,
            Err(PinError::Missing { .. }) => return Ok(None),
            Err(e) => return Err(e),
        };
        Ok(Some(Self {
            on,
            svc: pins.typed_with_fd(names::SVC_COUNTERS, rw)?,
            backend: pins.typed_with_fd(names::BACKEND_COUNTERS, rw)?,
            ncpus: aya::util::nr_cpus().map_or(1, |n| n.max(1)),
        }))
    }

    /// Turns counting on or off in the datapath (`COUNTERS_ON[0]`). Turning it off also
    /// deletes every entry: no stale series, no memory held.
    pub fn set_on(&mut self, on: bool) -> Result<(), StoreError> {
        self.on
            .set(0, u32::from(on), 0)
            .map_err(map_err(names::COUNTERS_ON))?;
        if !on {
            for kind in [CounterKind::Service, CounterKind::Backend] {
                let ids: Vec<u32> = self.read(kind)?.into_iter().map(|(id, _)| id).collect();
                self.delete(kind, &ids)?;
            }
        }
        Ok(())
    }

    /// Whether the datapath counts (`COUNTERS_ON[0]`).
    pub fn is_on(&self) -> Result<bool, StoreError> {
        Ok(self.on.get(&0, 0).map_err(map_err(names::COUNTERS_ON))? != 0)
    }

    fn map(&self, kind: CounterKind) -> &(PerCpuHashMap<MapData, u32, FlowCounts>, OwnedFd) {
        match kind {
            CounterKind::Service => &self.svc,
            CounterKind::Backend => &self.backend,
        }
    }

    /// Every counted id with its counts summed over CPUs, by batch lookup (key by key
    /// where the kernel has none).
    pub fn read(&self, kind: CounterKind) -> Result<Vec<(u32, FlowCounts)>, StoreError> {
        let (map, fd) = self.map(kind);
        let vs = std::mem::size_of::<FlowCounts>() * self.ncpus;
        if let Ok((keys, values, n)) = batch::lookup_raw(fd.as_fd(), 4, vs) {
            return Ok((0..n)
                .map(|i| {
                    let id =
                        u32::from_ne_bytes(keys[i * 4..i * 4 + 4].try_into().unwrap_or_default());
                    let mut sum = FlowCounts::default();
                    for c in 0..self.ncpus {
                        let at = i * vs + c * 16;
                        let word = |o: usize| {
                            u64::from_ne_bytes(
                                values[at + o..at + o + 8].try_into().unwrap_or_default(),
                            )
                        };
                        sum.conns += word(0);
                        sum.packets += word(8);
                    }
                    (id, sum)
                })
                .collect());
        }
        let mut out = Vec::new();
        for item in map.iter() {
            let (id, per_cpu) = item.map_err(map_err(kind.map_name()))?;
            let mut sum = FlowCounts::default();
            for v in per_cpu.iter() {
                sum.conns += v.conns;
                sum.packets += v.packets;
            }
            out.push((id, sum));
        }
        Ok(out)
    }

    /// Deletes the entries of `ids` (missing ones are skipped).
    fn delete(&mut self, kind: CounterKind, ids: &[u32]) -> Result<(), StoreError> {
        if ids.is_empty() {
            return Ok(());
        }
        let map = match kind {
            CounterKind::Service => &mut self.svc.0,
            CounterKind::Backend => &mut self.backend.0,
        };
        for id in ids {
            crate::store::ignore_missing(map.remove(id)).map_err(map_err(kind.map_name()))?;
        }
        Ok(())
    }

    /// Deletes the counters of ids just assigned or freed: of those of `ids` that have an
    /// entry (one read of the map, then one delete per entry found; nothing when the map
    /// is empty, as it is while counting is off).
    pub fn reset(&mut self, kind: CounterKind, ids: &[u32]) -> Result<(), StoreError> {
        if ids.is_empty() {
            return Ok(());
        }
        if ids.len() == 1 {
            return self.delete(kind, ids);
        }
        let present: HashSet<u32> = self.read(kind)?.into_iter().map(|(id, _)| id).collect();
        let found: Vec<u32> = ids
            .iter()
            .copied()
            .filter(|i| present.contains(i))
            .collect();
        self.delete(kind, &found)
    }
}
