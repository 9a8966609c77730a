//! [`MapStore`] over the pinned maps: one-element writes through aya, batches through
//! `crate::batch`, the dump the writer adopts from.

use std::os::fd::AsFd as _;

use aya::maps::MapError;
use proxy_common::{map_names as names, MaglevKey, SvcEntry};

use super::{BpfMaps, FamilyMaps};
use crate::{
    batch,
    codec::{self, FamilyAbi, SvcKey},
    counters::CounterKind,
    model::{Backend, Family, Frontend, Proto},
    pins::BackendEntry as _,
    store::{BatchFailed, Dump, FrontendValue, Group, MapKind, MapStore, Op, StoreError},
};

pub(super) fn map_err(map: &'static str) -> impl Fn(MapError) -> StoreError {
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

pub(crate) use crate::store::ignore_missing;

/// An error of a `BACKEND4/6` write: an id past the array's end (aya refuses it before
/// the kernel would with `E2BIG`) is a full map, like a hash map's `E2BIG`.
fn backend_err<F: FamilyAbi>(id: u32) -> impl Fn(MapError) -> StoreError {
    move |source| match source {
        MapError::OutOfBounds { .. } => {
            tracing::debug!(id, map = F::BACKEND, "backend id past the array's end");
            StoreError::Full { map: F::BACKEND }
        }
        source => map_err(F::BACKEND)(source),
    }
}

pub(super) fn corrupt(map: &'static str, detail: String) -> StoreError {
    StoreError::Corrupt { map, detail }
}

pub(super) fn batch_failed(e: batch::BatchError) -> BatchFailed {
    BatchFailed {
        applied: e.done,
        error: e.error,
    }
}

pub(super) fn unsupported() -> BatchFailed {
    BatchFailed {
        applied: 0,
        error: std::io::Error::from_raw_os_error(batch::ENOTSUPP),
    }
}

/// The `SVC` key and value an op writes (`PutChunk`, `PutFrontend`) or the key it deletes.
pub(super) fn svc_entry(op: &Op) -> Option<(SvcKey, Option<SvcEntry>)> {
    match op {
        Op::PutChunk {
            frontend,
            chunk,
            backends,
            service_id,
            ..
        } => Some((
            codec::svc_key(frontend, *chunk),
            Some(codec::chunk_value(*service_id, backends)),
        )),
        Op::PutFrontend {
            frontend,
            value,
            backends,
        } => Some((
            codec::svc_key(frontend, 0),
            Some(codec::frontend_value(value, backends)),
        )),
        Op::DelChunk { frontend, chunk } => Some((codec::svc_key(frontend, *chunk), None)),
        _ => None,
    }
}

/// Splits per-family keys/values out of a batch (all of one family by contract).
pub(super) fn keys_values<K, V>(
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

/// An op handed to the maps of a family it is not of (a bug: `Op::group` names the
/// family every op is routed by).
fn misrouted<F: FamilyAbi>(op: &Op) -> StoreError {
    corrupt(
        F::SVC,
        format!("{op:?} is no op of the {:?} maps", F::FAMILY),
    )
}

/// The backend ids a `BACKEND` batch writes or deletes.
fn backend_ids(ops: &[Op]) -> Vec<u32> {
    ops.iter()
        .filter_map(|op| match op {
            Op::PutBackend { id, .. } | Op::DelBackend { id, .. } => Some(*id),
            _ => None,
        })
        .collect()
}

/// One family's part of the store: every op but `NODE_CONFIG`'s and `MAGLEV`'s, one by
/// one or in batches, and the family's part of the dump.
impl<F: FamilyAbi> FamilyMaps<F> {
    /// One op on this family's maps (a backend's counters and generation are the
    /// caller's).
    fn apply(&mut self, op: &Op) -> Result<(), StoreError> {
        match op {
            Op::PutSrcRange {
                service_id,
                addr,
                prefix,
            }
            | Op::DelSrcRange {
                service_id,
                addr,
                prefix,
            } => {
                let key = F::src_range_key(codec::src_range_key(*service_id, *addr, *prefix))
                    .ok_or_else(|| misrouted::<F>(op))?;
                let r = if matches!(op, Op::PutSrcRange { .. }) {
                    self.src_range.insert(&key, 1, 0)
                } else {
                    ignore_missing(self.src_range.remove(&key))
                };
                r.map_err(map_err(F::SRC_RANGE))
            }
            Op::PutBackend { id, backend, proto } => {
                let v = F::backend_value(codec::backend_value(backend, *proto))
                    .ok_or_else(|| misrouted::<F>(op))?;
                self.backend
                    .map
                    .set(*id, v, 0)
                    .map_err(backend_err::<F>(*id))
            }
            // An array cannot delete: the free id's entry is written (an id past the
            // array's end holds nothing).
            Op::DelBackend { id, .. } => match self.backend.map.set(*id, F::Backend::FREE, 0) {
                Err(MapError::OutOfBounds { .. }) => Ok(()),
                r => r.map_err(backend_err::<F>(*id)),
            },
            Op::PutChunk { .. } | Op::PutFrontend { .. } | Op::DelChunk { .. } => {
                let Some((k, v)) = svc_entry(op) else {
                    unreachable!("an SVC op")
                };
                let k = F::svc_key(k).ok_or_else(|| misrouted::<F>(op))?;
                match v {
                    Some(v) => self.svc.map.insert(k, v, 0),
                    None => ignore_missing(self.svc.map.remove(&k)),
                }
                .map_err(map_err(F::SVC))
            }
            Op::PutRevNat {
                service_id,
                frontend,
                name,
            } => {
                let v = F::revnat_value(codec::revnat_value(frontend, name))
                    .ok_or_else(|| misrouted::<F>(op))?;
                self.revnat
                    .map
                    .insert(service_id, v, 0)
                    .map_err(map_err(F::REVNAT))
            }
            Op::DelRevNat { service_id, .. } => {
                ignore_missing(self.revnat.map.remove(service_id)).map_err(map_err(F::REVNAT))
            }
            Op::PutNodeAddr { addr } | Op::DelNodeAddr { addr } => {
                let k = F::node_addr_key(codec::node_addr_key(*addr))
                    .ok_or_else(|| misrouted::<F>(op))?;
                if matches!(op, Op::PutNodeAddr { .. }) {
                    self.node.map.insert(k, 1, 0)
                } else {
                    ignore_missing(self.node.map.remove(&k))
                }
                .map_err(map_err(F::NODE_ADDRS))
            }
            Op::PutNodeConfig { .. } | Op::PutMaglev { .. } | Op::DelMaglev { .. } => {
                Err(misrouted::<F>(op))
            }
        }
    }

    /// One batch call on this family's map of `group` (all ops of that group; the maps
    /// without batch operations are refused by the caller).
    fn apply_batch(&self, group: Group, ops: &[Op]) -> Result<(), batch::BatchError> {
        let delete = group.delete;
        match group.map {
            MapKind::Backend if delete => {
                // An array cannot delete (`BPF_MAP_DELETE_BATCH` fails on one): the free
                // ids' entries are written.
                let ids = backend_ids(ops);
                let free = vec![F::Backend::FREE; ids.len()];
                batch::update(self.backend.fd.as_fd(), &ids, &free)
            }
            MapKind::Backend => {
                let (ids, vals) = keys_values(ops, |op| match op {
                    Op::PutBackend { id, backend, proto } => {
                        Some((*id, F::backend_value(codec::backend_value(backend, *proto))))
                    }
                    _ => None,
                });
                batch::update(self.backend.fd.as_fd(), &ids, &vals)
            }
            MapKind::Svc => {
                let (k, v) = keys_values(ops, |op| {
                    svc_entry(op).and_then(|(k, v)| Some((F::svc_key(k)?, v)))
                });
                if delete {
                    batch::delete(self.svc.fd.as_fd(), &k)
                } else {
                    batch::update(self.svc.fd.as_fd(), &k, &v)
                }
            }
            MapKind::RevNat => {
                let (k, v) = keys_values(ops, |op| match op {
                    Op::PutRevNat {
                        service_id,
                        frontend,
                        name,
                    } => Some((
                        *service_id,
                        F::revnat_value(codec::revnat_value(frontend, name)),
                    )),
                    Op::DelRevNat { service_id, .. } => Some((*service_id, None)),
                    _ => None,
                });
                if delete {
                    batch::delete(self.revnat.fd.as_fd(), &k)
                } else {
                    batch::update(self.revnat.fd.as_fd(), &k, &v)
                }
            }
            MapKind::NodeAddr => {
                let k: Vec<F::Addr> = ops
                    .iter()
                    .filter_map(|op| match op {
                        Op::PutNodeAddr { addr } | Op::DelNodeAddr { addr } => {
                            F::node_addr_key(codec::node_addr_key(*addr))
                        }
                        _ => None,
                    })
                    .collect();
                if delete {
                    batch::delete(self.node.fd.as_fd(), &k)
                } else {
                    batch::update(self.node.fd.as_fd(), &k, &vec![1u8; k.len()])
                }
            }
            MapKind::SrcRange | MapKind::NodeConfig | MapKind::Maglev => {
                unreachable!("refused by BpfMaps::apply_batch")
            }
        }
    }

    /// `BACKEND4/6` read back, into `out`.
    fn read_backends(&self, out: &mut Vec<(u32, (Backend, Proto))>) -> Result<(), StoreError> {
        // The ids in use (a free id's entry is skipped).
        for (id, b) in self.backend.read_all().map_err(map_err(F::BACKEND))? {
            let b = codec::decode_backend::<F>(&b).ok_or_else(|| {
                let proto = codec::backend_proto::<F>(&b);
                corrupt(F::BACKEND, format!("backend {id}: proto {proto}"))
            })?;
            out.push((id, b));
        }
        Ok(())
    }

    /// `SVC4/6` read back: each frontend's fields into `frontends`, every chunk's slots
    /// into `slots`.
    fn read_svc(
        &self,
        frontends: &mut Vec<(Frontend, FrontendValue)>,
        slots: &mut Vec<((Frontend, u16), u32)>,
    ) -> Result<(), StoreError> {
        for (k, v) in self.svc.read_all().map_err(map_err(F::SVC))? {
            let (fe, chunk) = codec::decode_svc::<F>(&k)
                .ok_or_else(|| corrupt(F::SVC, format!("proto {}", codec::svc_proto::<F>(&k))))?;
            codec::push_svc(frontends, slots, fe, chunk, &v);
        }
        Ok(())
    }

    /// `REVNAT4/6` read back into the dump.
    fn read_revnat(&self, d: &mut Dump) -> Result<(), StoreError> {
        for (id, r) in self.revnat.read_all().map_err(map_err(F::REVNAT))? {
            let entry = codec::decode_revnat::<F>(&r).ok_or_else(|| {
                corrupt(F::REVNAT, format!("proto {}", codec::revnat_proto::<F>(&r)))
            })?;
            d.revnat.insert(id, entry);
        }
        Ok(())
    }

    /// `SRC_RANGE4/6` read back into the dump.
    fn read_src_ranges(&self, d: &mut Dump) -> Result<(), StoreError> {
        for k in self.src_range.keys() {
            let k = k.map_err(map_err(F::SRC_RANGE))?;
            d.src_ranges.insert(codec::decode_src_range::<F>(&k));
        }
        Ok(())
    }

    /// `NODE_ADDRS4/6` read back into the dump.
    fn read_node_addrs(&self, d: &mut Dump) -> Result<(), StoreError> {
        for (k, _) in self.node.read_all().map_err(map_err(F::NODE_ADDRS))? {
            d.node_addrs.insert(codec::decode_node_addr::<F>(k));
        }
        Ok(())
    }
}

impl BpfMaps {
    /// One op on the maps of its family.
    fn apply_family(&mut self, op: &Op) -> Result<(), StoreError> {
        match op.group().family {
            Family::V4 => self.v4.apply(op),
            Family::V6 => self.v6.apply(op),
        }
    }
}

/// Runs `f`, a long blocking step (a map resize: program loads, copies), telling a
/// multi-threaded tokio runtime first (`block_in_place`: its other tasks, /healthz and
/// /metrics among them, move to other workers meanwhile); plainly elsewhere.
fn off_runtime<T>(f: impl FnOnce() -> T) -> T {
    use tokio::runtime::{Handle, RuntimeFlavor};
    match Handle::try_current() {
        Ok(h) if h.runtime_flavor() == RuntimeFlavor::MultiThread => tokio::task::block_in_place(f),
        _ => f(),
    }
}

impl MapStore for BpfMaps {
    fn map_sizes(&self) -> Option<crate::loader::Sizes> {
        // Read at open and after each growth: this store is those maps' only writer and
        // only grower (conntrack's size, which `crate::ctsize` changes, is not used here).
        self.sizes
    }

    fn grow_maps(
        &mut self,
        to: &[(crate::loader::SizedMap, u32)],
    ) -> Result<Vec<crate::loader::MapResize>, StoreError> {
        let grow_err = |detail: String| StoreError::Grow {
            to: crate::store::describe_sizes(to),
            detail,
        };
        let pins = self.pins.clone();
        let resized = match off_runtime(|| crate::migrate::resize_maps(&pins, to)) {
            Ok(r) => r,
            Err(e) => {
                // A failed resize is rolled back or finished at once: the handles follow
                // whichever maps the pins hold now.
                let _ = self.reopen_sized();
                return Err(grow_err(e.to_string()));
            }
        };
        // The handles follow the new maps (every other map was shared: its handles stay).
        self.reopen_sized().map_err(|e| grow_err(e.to_string()))?;
        Ok(resized)
    }

    fn apply(&mut self, op: &Op) -> Result<(), StoreError> {
        match op {
            Op::PutBackend { id, .. } => {
                // A fresh id starts with fresh counters.
                ignore_missing(self.backend_conns.remove(id))
                    .map_err(map_err(names::BACKEND_CONNS))?;
                self.reset_counters(CounterKind::Backend, &[*id])?;
                self.apply_family(op)
            }
            Op::DelBackend { id, .. } => {
                self.apply_family(op)?;
                // After the delete: flows on this backend are checked on their next packet.
                self.bump_backend_gen()?;
                self.reset_counters(CounterKind::Backend, &[*id])?;
                ignore_missing(self.backend_conns.remove(id)).map_err(map_err(names::BACKEND_CONNS))
            }
            // A service id's reverse-NAT entry is written when the id is assigned (or the
            // frontend passes to another Service) and deleted when it is freed: its
            // per-Service counters start from zero at each.
            Op::PutRevNat { service_id, .. } | Op::DelRevNat { service_id, .. } => {
                self.reset_counters(CounterKind::Service, &[*service_id])?;
                self.apply_family(op)
            }
            Op::PutNodeConfig { snat } => self
                .node_config
                .set(0, codec::node_config(snat), 0)
                .map_err(map_err(names::NODE_CONFIG)),
            Op::PutMaglev {
                service_id,
                chunk,
                value,
                ..
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
            _ => self.apply_family(op),
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
        if !self.supports_batch(g) {
            return Err(unsupported());
        }
        let fail = |e: StoreError| BatchFailed {
            applied: 0,
            error: std::io::Error::other(e.to_string()),
        };
        if g.map == MapKind::RevNat {
            self.reset_counters(CounterKind::Service, &revnat_ids(ops))
                .map_err(fail)?;
        }
        let backends = g.map == MapKind::Backend;
        let ids = if backends {
            backend_ids(ops)
        } else {
            Vec::new()
        };
        if backends && !g.delete {
            self.clear_conns(&ids).map_err(fail)?;
        }
        let r = match g.family {
            Family::V4 => self.v4.apply_batch(g, ops),
            Family::V6 => self.v6.apply_batch(g, ops),
        };
        if backends && g.delete {
            let done = r.as_ref().map_or_else(|e| e.done, |_| ids.len());
            if done > 0 {
                // After the deletes, once for the batch (see the one-op case).
                self.bump_backend_gen().map_err(fail)?;
            }
            self.clear_conns(&ids[..done]).map_err(fail)?;
        }
        r.map_err(batch_failed)
    }

    fn splits_batches(&self, group: Group) -> bool {
        // The large groups of a first sync: new frontends, slots, backends, reverse NAT.
        !group.delete && matches!(group.map, MapKind::Svc | MapKind::Backend | MapKind::RevNat)
    }

    fn apply_batch_pair(&mut self, a: &[Op], b: &[Op]) -> [Result<(), BatchFailed>; 2] {
        let g = match a.first().or(b.first()) {
            Some(op) if self.splits_batches(op.group()) => op.group(),
            _ => return [self.apply_batch(a), self.apply_batch(b)],
        };
        // What `apply_batch` does before its call, once for both halves.
        let before = match g.map {
            MapKind::RevNat => {
                let mut ids = revnat_ids(a);
                ids.extend(revnat_ids(b));
                self.reset_counters(CounterKind::Service, &ids)
            }
            MapKind::Backend => {
                let mut ids = backend_ids(a);
                ids.extend(backend_ids(b));
                self.clear_conns(&ids)
            }
            _ => Ok(()),
        };
        if let Err(e) = before {
            let fail = || BatchFailed {
                applied: 0,
                error: std::io::Error::other(e.to_string()),
            };
            return [Err(fail()), Err(fail())];
        }
        let one = |ops: &[Op]| match g.family {
            Family::V4 => self.v4.apply_batch(g, ops),
            Family::V6 => self.v6.apply_batch(g, ops),
        };
        // Two kernel batch calls at once: the inserts' per-element allocations and
        // memory-cgroup charges run on two CPUs.
        let (ra, rb) = std::thread::scope(|s| {
            let other = s.spawn(|| one(b));
            let ra = one(a);
            let rb = other.join().unwrap_or_else(|_| {
                Err(batch::BatchError {
                    done: 0,
                    error: std::io::Error::other("the batch thread panicked"),
                })
            });
            (ra, rb)
        });
        [ra.map_err(batch_failed), rb.map_err(batch_failed)]
    }

    fn dump(&self) -> Result<Dump, StoreError> {
        // The large maps are gathered as vectors and built in bulk (`BTreeMap::from_iter`
        // sorts, then builds the tree bottom up): inserting a million entries one by one
        // in hash order was most of the time of adopting 50,000 Services.
        let mut d = Dump::default();
        let mut backends = Vec::new();
        self.v4.read_backends(&mut backends)?;
        self.v6.read_backends(&mut backends)?;
        d.backends = backends.into_iter().collect();
        let mut frontends = Vec::new();
        let mut slots = Vec::new();
        self.v4.read_svc(&mut frontends, &mut slots)?;
        self.v6.read_svc(&mut frontends, &mut slots)?;
        d.frontends = frontends.into_iter().collect();
        d.slots = slots.into_iter().collect();
        self.v4.read_revnat(&mut d)?;
        self.v6.read_revnat(&mut d)?;
        self.v4.read_src_ranges(&mut d)?;
        self.v6.read_src_ranges(&mut d)?;
        self.v4.read_node_addrs(&mut d)?;
        self.v6.read_node_addrs(&mut d)?;
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

/// The service ids of reverse-NAT ops.
fn revnat_ids(ops: &[Op]) -> Vec<u32> {
    ops.iter()
        .filter_map(|op| match op {
            Op::PutRevNat { service_id, .. } | Op::DelRevNat { service_id, .. } => {
                Some(*service_id)
            }
            _ => None,
        })
        .collect()
}
