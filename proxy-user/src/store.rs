//! The map operations the writer issues ([`Op`]), the storage they go to ([`MapStore`]),
//! and an in-memory store for tests ([`MemStore`]). The real store over pinned BPF maps is
//! `crate::bpf::BpfMaps`.

use std::{collections::BTreeMap, fmt};

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
    /// `SVC{4,6}[frontend, slot] = backend_id` (slot >= 1).
    PutSlot {
        frontend: Frontend,
        slot: u16,
        backend_id: u32,
        service_id: u32,
    },
    /// `SVC{4,6}[frontend, 0] = {count, service_id, flags, affinity}`.
    PutFrontend {
        frontend: Frontend,
        value: FrontendValue,
    },
    /// Delete `SVC{4,6}[frontend, slot]` (slot 0 deletes the frontend itself).
    DelSlot { frontend: Frontend, slot: u16 },
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
}

/// What slot 0 holds.
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
            Op::PutSlot {
                frontend,
                slot,
                backend_id,
                ..
            } => write!(f, "put slot {frontend} #{slot} -> backend {backend_id}"),
            Op::PutFrontend { frontend, value } => write!(
                f,
                "put frontend {frontend} id={} count={} flags={:#x} affinity={}",
                value.service_id, value.count, value.flags, value.affinity_timeout
            ),
            Op::DelSlot { frontend, slot: 0 } => write!(f, "del frontend {frontend}"),
            Op::DelSlot { frontend, slot } => write!(f, "del slot {frontend} #{slot}"),
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
        }
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
}

/// The service maps' contents, read back (adoption, dumps, tests).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Dump {
    /// Slot 0 of every frontend.
    pub frontends: BTreeMap<Frontend, FrontendValue>,
    /// Slots >= 1: `(frontend, slot) -> backend id`.
    pub slots: BTreeMap<(Frontend, u16), u32>,
    /// Backend id -> backend and protocol.
    pub backends: BTreeMap<u32, (Backend, Proto)>,
    /// Service id -> frontend and Service name.
    pub revnat: BTreeMap<u32, (Frontend, String)>,
    /// Allowed source ranges: (service id, address, prefix length).
    pub src_ranges: std::collections::BTreeSet<(u32, std::net::IpAddr, u8)>,
}

impl Dump {
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
        out
    }
}

/// Where the writer's operations go.
pub trait MapStore {
    /// Applies one operation. Deleting a missing key is not an error.
    fn apply(&mut self, op: &Op) -> Result<(), StoreError>;
    /// Reads back everything the writer owns.
    fn dump(&self) -> Result<Dump, StoreError>;
}

/// An in-memory [`MapStore`] that records every operation, with an optional capacity on
/// the service map to exercise the "map full" paths.
#[derive(Debug, Default)]
pub struct MemStore {
    pub state: Dump,
    pub log: Vec<Op>,
    /// Maximum number of `SVC` entries (slot 0 and slots together), like `max_entries`.
    pub svc_capacity: Option<usize>,
}

impl MemStore {
    /// The operation log as text, one op per line, and clears it.
    pub fn take_log(&mut self) -> String {
        let s = self.log.iter().map(|op| format!("{op}\n")).collect();
        self.log.clear();
        s
    }

    fn svc_len(&self) -> usize {
        self.state.frontends.len() + self.state.slots.len()
    }

    fn check_svc_room(&self, exists: bool) -> Result<(), StoreError> {
        match self.svc_capacity {
            Some(cap) if !exists && self.svc_len() >= cap => Err(StoreError::Full { map: "SVC" }),
            _ => Ok(()),
        }
    }
}

impl MapStore for MemStore {
    fn apply(&mut self, op: &Op) -> Result<(), StoreError> {
        let s = &mut self.state;
        match op {
            Op::PutBackend { id, backend, proto } => {
                s.backends.insert(*id, (*backend, *proto));
            }
            Op::DelBackend { id, .. } => {
                s.backends.remove(id);
            }
            Op::PutSlot {
                frontend,
                slot,
                backend_id,
                ..
            } => {
                let exists = self.state.slots.contains_key(&(*frontend, *slot));
                self.check_svc_room(exists)?;
                self.state.slots.insert((*frontend, *slot), *backend_id);
            }
            Op::PutFrontend { frontend, value } => {
                let exists = self.state.frontends.contains_key(frontend);
                self.check_svc_room(exists)?;
                self.state.frontends.insert(*frontend, *value);
            }
            Op::DelSlot { frontend, slot: 0 } => {
                s.frontends.remove(frontend);
            }
            Op::DelSlot { frontend, slot } => {
                s.slots.remove(&(*frontend, *slot));
            }
            Op::PutRevNat {
                service_id,
                frontend,
                name,
            } => {
                s.revnat.insert(*service_id, (*frontend, name.clone()));
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
        }
        self.log.push(op.clone());
        Ok(())
    }

    fn dump(&self) -> Result<Dump, StoreError> {
        Ok(self.state.clone())
    }
}
