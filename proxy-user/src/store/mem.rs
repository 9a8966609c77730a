//! [`MemStore`]: the in-memory [`MapStore`] of the writer's and the agent's unit tests.

use std::{collections::BTreeSet, io};

use super::{BatchFailed, Dump, Group, MapStore, Op, StoreError};
use crate::loader::{SizedMap, Sizes};

/// An in-memory [`MapStore`] that records every operation, with an optional capacity on
/// the service map to exercise the "map full" paths.
#[derive(Debug, Default)]
pub struct MemStore {
    pub state: Dump,
    pub log: Vec<Op>,
    /// Maximum number of `SVC` entries (frontends and further chunks together), like
    /// `max_entries`.
    pub svc_capacity: Option<usize>,
    /// The further chunks (`>= 1`) of slots `state` holds, `SVC` entries of their own
    /// (kept by [`MapStore::apply`]; [`Self::with_state`] counts them in a dump).
    pub chunks: BTreeSet<(crate::model::Frontend, u16)>,
    /// Whether [`MapStore::grow_svc`] may raise `svc_capacity` (like the pinned maps):
    /// the sizes grown to, in order.
    pub svc_growable: bool,
    pub svc_grown: Vec<u32>,
    /// The sizes of the other maps sized to demand (compiled by default; the service
    /// maps' is `svc_capacity`), as [`MapStore::map_sizes`] reports them while
    /// `svc_growable`; every growth, in order.
    pub sizes: Sizes,
    pub grown: Vec<Vec<(SizedMap, u32)>>,
    /// The size of every batch applied, in order.
    pub batches: Vec<usize>,
    /// Make every batch call fail after applying this many ops, with this errno (the
    /// per-element fallback then writes the rest).
    pub batch_fault: Option<BatchFault>,
    /// No batch calls at all (like a store or kernel without them).
    pub no_batches: bool,
    /// Large groups are split in two halves ([`MapStore::splits_batches`]; written one
    /// after the other here, each half's result on its own).
    pub split_batches: bool,
}

/// A forced failure of [`MemStore`]'s batch calls.
#[derive(Clone, Copy, Debug)]
pub struct BatchFault {
    pub after: usize,
    pub errno: i32,
}

impl MemStore {
    /// The operation log as text, one op per line, and clears it.
    pub fn take_log(&mut self) -> String {
        let s = self.log.iter().map(|op| format!("{op}\n")).collect();
        self.log.clear();
        s
    }

    fn svc_len(&self) -> usize {
        self.state.frontends.len() + self.chunks.len()
    }

    /// Checks the batch contract: one group, distinct entries.
    pub fn check_batch(ops: &[Op]) {
        let mut keys = BTreeSet::new();
        for op in ops {
            assert_eq!(op.group(), ops[0].group(), "one group per batch: {op}");
            assert!(
                keys.insert(op.key()),
                "two ops on one entry in a batch: {op}"
            );
        }
    }

    /// The backend maps are arrays indexed by id: an id past their size is refused (the
    /// kernel's `E2BIG`), as a full map.
    fn check_backend_room(&self, op: &Op) -> Result<(), StoreError> {
        match op {
            Op::PutBackend { id, .. }
                if self.svc_growable && *id >= self.sizes.get(SizedMap::Backend) =>
            {
                Err(StoreError::Full { map: "BACKEND" })
            }
            _ => Ok(()),
        }
    }

    /// A store holding `state` (maps read back, as a restarted agent finds them).
    pub fn with_state(state: Dump) -> Self {
        let chunks = state
            .slots
            .keys()
            .map(|(fe, slot)| (*fe, proxy_common::svc_chunk_of(*slot).0))
            .filter(|(_, chunk)| *chunk > 0)
            .collect();
        Self {
            state,
            chunks,
            ..Self::default()
        }
    }

    /// The further chunks (`>= 1`) of slots the store holds: `SVC` entries of their own.
    pub fn chunks(&self) -> &BTreeSet<(crate::model::Frontend, u16)> {
        &self.chunks
    }

    /// An `SVC` write: the frontend's entry or a further chunk, its slots into the dump.
    fn apply_svc(&mut self, op: &Op) -> Result<(), StoreError> {
        match op {
            Op::PutChunk {
                frontend,
                chunk,
                backends,
                ..
            } => {
                let exists = self.chunks.contains(&(*frontend, *chunk));
                self.check_svc_room(exists)?;
                self.chunks.insert((*frontend, *chunk));
                self.state.set_chunk(*frontend, *chunk, backends);
            }
            Op::PutFrontend {
                frontend,
                value,
                backends,
            } => {
                let exists = self.state.frontends.contains_key(frontend);
                self.check_svc_room(exists)?;
                self.state.frontends.insert(*frontend, *value);
                self.state.set_chunk(*frontend, 0, backends);
            }
            Op::DelChunk { frontend, chunk } => {
                if *chunk == 0 {
                    self.state.frontends.remove(frontend);
                } else {
                    self.chunks.remove(&(*frontend, *chunk));
                }
                self.state.clear_chunk(*frontend, *chunk);
            }
            _ => {}
        }
        Ok(())
    }

    fn check_svc_room(&self, exists: bool) -> Result<(), StoreError> {
        match self.svc_capacity {
            Some(cap) if !exists && self.svc_len() >= cap => Err(StoreError::Full { map: "SVC" }),
            _ => Ok(()),
        }
    }
}

impl MapStore for MemStore {
    fn map_sizes(&self) -> Option<Sizes> {
        let svc = self.svc_capacity.filter(|_| self.svc_growable)?;
        Some(
            self.sizes
                .with(SizedMap::Service, u32::try_from(svc).unwrap_or(u32::MAX)),
        )
    }

    fn grow_maps(
        &mut self,
        to: &[(SizedMap, u32)],
    ) -> Result<Vec<crate::loader::MapResize>, StoreError> {
        let from = self.map_sizes().ok_or(StoreError::Grow {
            to: super::describe_sizes(to),
            detail: "not growable".into(),
        })?;
        let mut resized = Vec::new();
        for &(kind, entries) in to {
            self.sizes.set(kind, entries);
            if kind == SizedMap::Service {
                self.svc_capacity = Some(entries as usize);
                self.svc_grown.push(entries);
            }
            resized.push(crate::loader::MapResize {
                map: kind.maps()[0],
                from: from.get(kind),
                to: entries,
            });
        }
        self.grown.push(to.to_vec());
        Ok(resized)
    }

    fn apply(&mut self, op: &Op) -> Result<(), StoreError> {
        self.check_backend_room(op)?;
        let s = &mut self.state;
        match op {
            Op::PutBackend { id, backend, proto } => {
                s.backends.insert(*id, (*backend, *proto));
            }
            Op::DelBackend { id, .. } => {
                s.backends.remove(id);
            }
            Op::PutChunk { .. } | Op::PutFrontend { .. } | Op::DelChunk { .. } => {
                self.apply_svc(op)?;
            }
            Op::PutRevNat {
                service_id,
                frontend,
                name,
            } => {
                // Truncated as the kernel's map keeps it (`NAME_LEN` bytes).
                let kept = crate::model::name_from_bytes(&crate::model::name_bytes(name));
                s.revnat.insert(*service_id, (*frontend, kept));
            }
            Op::DelRevNat { service_id, .. } => {
                s.revnat.remove(service_id);
            }
            Op::PutSrcRange {
                service_id,
                addr,
                prefix,
            } => {
                s.src_ranges.insert((*service_id, *addr, *prefix));
            }
            Op::DelSrcRange {
                service_id,
                addr,
                prefix,
            } => {
                s.src_ranges.remove(&(*service_id, *addr, *prefix));
            }
            Op::PutNodeAddr { addr } => {
                s.node_addrs.insert(*addr);
            }
            Op::DelNodeAddr { addr } => {
                s.node_addrs.remove(addr);
            }
            Op::PutNodeConfig { snat } => s.snat = *snat,
            Op::PutMaglev {
                service_id,
                chunk,
                value,
                ..
            } => {
                s.maglev.insert((*service_id, *chunk), value.clone());
            }
            Op::DelMaglev { service_id, chunk } => {
                s.maglev.remove(&(*service_id, *chunk));
            }
        }
        self.log.push(op.clone());
        Ok(())
    }

    fn dump(&self) -> Result<Dump, StoreError> {
        Ok(self.state.clone())
    }

    fn supports_batch(&self, _: Group) -> bool {
        !self.no_batches
    }

    fn splits_batches(&self, _: Group) -> bool {
        self.split_batches && !self.no_batches
    }

    fn apply_batch(&mut self, ops: &[Op]) -> Result<(), BatchFailed> {
        Self::check_batch(ops);
        let stop = self.batch_fault.map(|f| (f.after.min(ops.len()), f.errno));
        for (i, op) in ops.iter().enumerate() {
            if let Some((after, errno)) = stop {
                if i == after {
                    self.batches.push(i);
                    return Err(BatchFailed {
                        applied: i,
                        error: io::Error::from_raw_os_error(errno),
                    });
                }
            }
            if self.apply(op).is_err() {
                self.batches.push(i);
                return Err(BatchFailed {
                    applied: i,
                    error: io::Error::from_raw_os_error(libc::E2BIG),
                });
            }
        }
        self.batches.push(ops.len());
        Ok(())
    }
}
