//! [`MapStore`] over the pinned maps: one-element writes through aya, batches through
//! `crate::batch`, the dump the writer adopts from.

use super::*;

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

/// Deleting an absent key is fine (idempotent cleanup).
pub(super) fn ignore_missing(r: Result<(), MapError>) -> Result<(), MapError> {
    match r {
        Err(MapError::KeyNotFound) | Err(MapError::ElementNotFound) => Ok(()),
        Err(MapError::SyscallError(e)) if e.io_error.raw_os_error() == Some(libc::ENOENT) => Ok(()),
        other => other,
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

impl BpfMaps {
    pub(super) fn put_svc(&mut self, key: SvcKey, v: SvcValue) -> Result<(), StoreError> {
        match key {
            SvcKey::V4(k) => self.svc4.map.insert(k, v, 0).map_err(map_err(names::SVC4)),
            SvcKey::V6(k) => self.svc6.map.insert(k, v, 0).map_err(map_err(names::SVC6)),
        }
    }

    pub(super) fn del_svc(&mut self, key: SvcKey) -> Result<(), StoreError> {
        match key {
            SvcKey::V4(k) => ignore_missing(self.svc4.map.remove(&k)).map_err(map_err(names::SVC4)),
            SvcKey::V6(k) => ignore_missing(self.svc6.map.remove(&k)).map_err(map_err(names::SVC6)),
        }
    }

    pub(super) fn src_range(&mut self, put: bool, key: SrcRangeKey) -> Result<(), StoreError> {
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
pub(super) fn svc_entry(op: &Op) -> Option<(SvcKey, Option<SvcValue>)> {
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
                // After the delete: flows on this backend are checked on their next packet.
                self.bump_backend_gen()?;
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
                if done > 0 {
                    // After the deletes, once for the batch (see the one-op case).
                    self.bump_backend_gen().map_err(fail)?;
                }
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
        // The large maps are gathered as vectors and built in bulk (`BTreeMap::from_iter`
        // sorts, then builds the tree bottom up): inserting a million entries one by one
        // in hash order was most of the time of adopting 50,000 Services.
        let mut d = Dump::default();
        let mut backends = Vec::new();
        for (id, b) in self.backend4.read_all().map_err(map_err(names::BACKEND4))? {
            let b = codec::decode_backend4(&b).ok_or_else(|| {
                corrupt(names::BACKEND4, format!("backend {id}: proto {}", b.proto))
            })?;
            backends.push((id, b));
        }
        for (id, b) in self.backend6.read_all().map_err(map_err(names::BACKEND6))? {
            let b = codec::decode_backend6(&b).ok_or_else(|| {
                corrupt(names::BACKEND6, format!("backend {id}: proto {}", b.proto))
            })?;
            backends.push((id, b));
        }
        d.backends = backends.into_iter().collect();
        let mut frontends = Vec::new();
        let mut slots = Vec::new();
        for (k, v) in self.svc4.read_all().map_err(map_err(names::SVC4))? {
            let fe = codec::decode_svc4(&k)
                .ok_or_else(|| corrupt(names::SVC4, format!("proto {}", k.proto)))?;
            codec::push_svc(&mut frontends, &mut slots, fe, k.slot, &v);
        }
        for (k, v) in self.svc6.read_all().map_err(map_err(names::SVC6))? {
            let fe = codec::decode_svc6(&k)
                .ok_or_else(|| corrupt(names::SVC6, format!("proto {}", k.proto)))?;
            codec::push_svc(&mut frontends, &mut slots, fe, k.slot, &v);
        }
        d.frontends = frontends.into_iter().collect();
        d.slots = slots.into_iter().collect();
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
