//! Whole-map readers: backends, services, counters, node addresses, source ranges,
//! conntrack flows, each decoded into the snapshot's types.

use std::{
    collections::{BTreeMap, BTreeSet},
    net::{IpAddr, SocketAddr},
};

use aya::maps::{
    lpm_trie::{Key as LpmKey, LpmTrie},
    HashMap, MapData, MapError, PerCpuArray,
};
use proxy_common::{map_names as names, Ct4Key, Ct4Value, Ct6Key, Ct6Value, Reason, SvcEntry};

use super::{read_err, Cidr, CtEntry, Error, Maps, Result, Snapshot};
use crate::{
    codec::{self, FamilyAbi, Ipv4, Ipv6},
    model::{port_host, v4_from_word, v6_from_words, Backend, Proto},
    pins::PinnedHash,
};

impl Maps {
    pub(super) fn read_backends(&self, s: &mut Snapshot) -> Result<()> {
        read_backends_of::<Ipv4>(&self.v4.backend, s)?;
        read_backends_of::<Ipv6>(&self.v6.backend, s)
    }

    /// `SVC4/6`, `BACKEND4/6` and `REVNAT4/6` into `s.services` (batch lookups).
    pub(super) fn read_services(&self, s: &mut Snapshot) -> Result<()> {
        self.read_backends(s)?;
        read_svc_of::<Ipv4>(&self.v4.svc, s)?;
        read_svc_of::<Ipv6>(&self.v6.svc, s)?;
        read_revnat_of::<Ipv4>(&self.v4.revnat, s)?;
        read_revnat_of::<Ipv6>(&self.v6.revnat, s)
    }

    /// `BACKEND_CONNS`, summed over CPUs.
    pub fn read_conns(&self) -> Result<BTreeMap<u32, u64>> {
        let ncpus = aya::util::nr_cpus().map_or(1, |n| n.max(1));
        if let Ok(v) =
            crate::batch::lookup_percpu_sum::<u32>(std::os::fd::AsFd::as_fd(&self.conns_fd), ncpus)
        {
            return Ok(v.into_iter().collect());
        }
        let mut out = BTreeMap::new();
        for item in self.conns.iter() {
            let (id, per_cpu) = item.map_err(read_err(names::BACKEND_CONNS))?;
            out.insert(id, per_cpu.iter().sum());
        }
        Ok(out)
    }

    /// `STATS`, summed over CPUs, every `Reason` in order (a reason past the end of an
    /// older build's pinned array reads 0).
    pub fn read_stats(&self) -> Result<Vec<(Reason, u64)>> {
        read_counters(&self.stats, names::STATS)
    }

    /// `XDP_STATS` like `STATS`; empty when it is not pinned (a build without XDP).
    pub fn read_xdp_stats(&self) -> Result<Vec<(Reason, u64)>> {
        match &self.xdp_stats {
            Some(m) => read_counters(m, names::XDP_STATS),
            None => Ok(Vec::new()),
        }
    }

    /// `NODE_ADDRS4/6`; `None` if neither is pinned.
    pub fn read_node_addrs(&self) -> Result<Option<BTreeSet<IpAddr>>> {
        if self.v4.node.is_none() && self.v6.node.is_none() {
            return Ok(None);
        }
        let mut out = BTreeSet::new();
        read_node_addrs_of::<Ipv4>(self.v4.node.as_ref(), &mut out)?;
        read_node_addrs_of::<Ipv6>(self.v6.node.as_ref(), &mut out)?;
        Ok(Some(out))
    }

    /// `SRC_RANGE4/6`: the prefix length counts the 32 bits of the service id first.
    pub fn read_src_ranges(&self) -> Result<BTreeMap<u32, Vec<Cidr>>> {
        let mut out: BTreeMap<u32, Vec<Cidr>> = BTreeMap::new();
        read_src_ranges_of::<Ipv4>(self.v4.src.as_ref(), &mut out)?;
        read_src_ranges_of::<Ipv6>(self.v6.src.as_ref(), &mut out)?;
        for ranges in out.values_mut() {
            ranges.sort();
        }
        Ok(out)
    }

    /// `CT4/6`; `None` if neither is pinned.
    pub fn read_flows(&self) -> Result<Option<Vec<CtEntry>>> {
        if self.ct4.is_none() && self.ct6.is_none() {
            return Ok(None);
        }
        let mut out = Vec::new();
        if let Some(m) = &self.ct4 {
            for item in m.iter() {
                let (k, v) = item.map_err(read_err(names::CT4))?;
                out.push(ct4_entry(&k, &v));
            }
        }
        if let Some(m) = &self.ct6 {
            for item in m.iter() {
                let (k, v) = item.map_err(read_err(names::CT6))?;
                out.push(ct6_entry(&k, &v));
            }
        }
        Ok(Some(out))
    }
}

/// A `CT4` entry in model terms.
pub(crate) fn ct4_entry(k: &Ct4Key, v: &Ct4Value) -> CtEntry {
    let sa = |a: u32, p: u16| SocketAddr::new(IpAddr::V4(v4_from_word(a)), port_host(p));
    CtEntry {
        proto: k.proto,
        dir: k.dir,
        src: sa(k.saddr, k.sport),
        dst: sa(k.daddr, k.dport),
        dnat: (v.dnat_addr != 0).then(|| sa(v.dnat_addr, v.dnat_port)),
        snat: (v.snat_addr != 0).then(|| sa(v.snat_addr, v.snat_port)),
        service_id: v.service_id,
        backend_id: v.backend_id,
        flags: v.flags,
        last_seen_ns: v.last_seen,
        packets: v.packets,
    }
}

/// A `CT6` entry in model terms.
pub(crate) fn ct6_entry(k: &Ct6Key, v: &Ct6Value) -> CtEntry {
    let sa = |a: [u32; 4], p: u16| SocketAddr::new(IpAddr::V6(v6_from_words(a)), port_host(p));
    CtEntry {
        proto: k.proto,
        dir: k.dir,
        src: sa(k.saddr, k.sport),
        dst: sa(k.daddr, k.dport),
        dnat: (v.dnat_addr != [0; 4]).then(|| sa(v.dnat_addr, v.dnat_port)),
        snat: (v.snat_addr != [0; 4]).then(|| sa(v.snat_addr, v.snat_port)),
        service_id: v.service_id,
        backend_id: v.backend_id,
        flags: v.flags,
        last_seen_ns: v.last_seen,
        packets: v.packets,
    }
}

pub(super) fn lookup<K: aya::Pod, V: aya::Pod>(
    m: &PinnedHash<K, V>,
    k: &K,
    name: &'static str,
) -> Result<Option<V>> {
    match m.map.get(k, 0) {
        Ok(v) => Ok(Some(v)),
        Err(MapError::KeyNotFound) => Ok(None),
        Err(source) => Err(Error::Read { map: name, source }),
    }
}

/// A `BACKEND4/6` value decoded; an unknown protocol is a warning.
pub(super) fn backend<F: FamilyAbi>(
    id: u32,
    b: &F::Backend,
    warnings: &mut Vec<String>,
) -> Option<(Backend, Proto)> {
    let decoded = codec::decode_backend::<F>(b);
    if decoded.is_none() {
        let proto = codec::backend_proto::<F>(b);
        warnings.push(format!("{} {id}: unknown protocol {proto}", F::BACKEND));
    }
    decoded
}

/// One family's `BACKEND` map into `s.services` (the ids in use: a free id's entry is
/// skipped).
fn read_backends_of<F: FamilyAbi>(
    map: &crate::pins::PinnedBackends<F::Backend>,
    s: &mut Snapshot,
) -> Result<()> {
    for (id, b) in map.read_all().map_err(read_err(F::BACKEND))? {
        if let Some(b) = backend::<F>(id, &b, &mut s.warnings) {
            s.services.backends.insert(id, b);
        }
    }
    Ok(())
}

/// One family's `SVC` map into `s.services`; an unknown protocol is a warning.
fn read_svc_of<F: FamilyAbi>(
    map: &PinnedHash<F::SvcKey, SvcEntry>,
    s: &mut Snapshot,
) -> Result<()> {
    for (k, v) in map.read_all().map_err(read_err(F::SVC))? {
        match codec::decode_svc::<F>(&k) {
            Some((fe, chunk)) => codec::put_svc(&mut s.services, fe, chunk, &v),
            None => s.warnings.push(format!(
                "{}: unknown protocol {}",
                F::SVC,
                codec::svc_proto::<F>(&k)
            )),
        }
    }
    Ok(())
}

/// One family's `REVNAT` map into `s.services`; an unknown protocol is a warning.
fn read_revnat_of<F: FamilyAbi>(map: &PinnedHash<u32, F::RevNat>, s: &mut Snapshot) -> Result<()> {
    for (id, r) in map.read_all().map_err(read_err(F::REVNAT))? {
        match codec::decode_revnat::<F>(&r) {
            Some(entry) => {
                s.services.revnat.insert(id, entry);
            }
            None => s.warnings.push(format!(
                "{} {id}: unknown protocol {}",
                F::REVNAT,
                codec::revnat_proto::<F>(&r)
            )),
        }
    }
    Ok(())
}

/// One family's `NODE_ADDRS` map (when pinned) into `out`.
fn read_node_addrs_of<F: FamilyAbi>(
    map: Option<&HashMap<MapData, F::Addr, u8>>,
    out: &mut BTreeSet<IpAddr>,
) -> Result<()> {
    for k in map.into_iter().flat_map(|m| m.keys()) {
        let k = k.map_err(read_err(F::NODE_ADDRS))?;
        out.insert(codec::decode_node_addr::<F>(k));
    }
    Ok(())
}

/// One family's `SRC_RANGE` trie (when pinned) into `out`, by service id.
fn read_src_ranges_of<F: FamilyAbi>(
    map: Option<&LpmTrie<MapData, F::SrcRange, u8>>,
    out: &mut BTreeMap<u32, Vec<Cidr>>,
) -> Result<()> {
    for k in map.into_iter().flat_map(|m| m.keys()) {
        let k: LpmKey<F::SrcRange> = k.map_err(read_err(F::SRC_RANGE))?;
        let (id, addr, len) = codec::decode_src_range::<F>(&k);
        out.entry(id).or_default().push(Cidr { addr, len });
    }
    Ok(())
}

/// A `Reason`-indexed per-CPU counter array, summed over CPUs; a reason past its end
/// (pins of an older build of the same ABI) reads 0.
pub(super) fn read_counters(
    map: &PerCpuArray<MapData, u64>,
    name: &'static str,
) -> Result<Vec<(Reason, u64)>> {
    Reason::ALL
        .iter()
        .map(|r| match map.get(&(*r as u32), 0) {
            Ok(v) => Ok((*r, v.iter().sum())),
            Err(MapError::OutOfBounds { .. }) => Ok((*r, 0)),
            Err(e) => Err(read_err(name)(e)),
        })
        .collect()
}
