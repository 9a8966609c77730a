//! Whole-map readers: backends, services, counters, node addresses, source ranges,
//! conntrack flows, each decoded into the snapshot's types.

use super::*;

impl Maps {
    pub(super) fn read_backends(&self, s: &mut Snapshot) -> Result<()> {
        for (id, b) in self
            .backend4
            .read_all()
            .map_err(read_err(names::BACKEND4))?
        {
            if let Some(b) = backend4(id, &b, &mut s.warnings) {
                s.services.backends.insert(id, b);
            }
        }
        for (id, b) in self
            .backend6
            .read_all()
            .map_err(read_err(names::BACKEND6))?
        {
            if let Some(b) = backend6(id, &b, &mut s.warnings) {
                s.services.backends.insert(id, b);
            }
        }
        Ok(())
    }

    /// `SVC4/6`, `BACKEND4/6` and `REVNAT4/6` into `s.services` (batch lookups).
    pub(super) fn read_services(&self, s: &mut Snapshot) -> Result<()> {
        self.read_backends(s)?;
        let d: &mut Dump = &mut s.services;
        for (k, v) in self.svc4.read_all().map_err(read_err(names::SVC4))? {
            match codec::decode_svc4(&k) {
                Some(fe) => codec::put_svc(d, fe, k.slot, &v),
                None => s
                    .warnings
                    .push(format!("SVC4: unknown protocol {}", k.proto)),
            }
        }
        for (k, v) in self.svc6.read_all().map_err(read_err(names::SVC6))? {
            match codec::decode_svc6(&k) {
                Some(fe) => codec::put_svc(d, fe, k.slot, &v),
                None => s
                    .warnings
                    .push(format!("SVC6: unknown protocol {}", k.proto)),
            }
        }
        for (id, r) in self.revnat4.read_all().map_err(read_err(names::REVNAT4))? {
            match codec::decode_revnat4(&r) {
                Some(entry) => {
                    d.revnat.insert(id, entry);
                }
                None => s
                    .warnings
                    .push(format!("REVNAT4 {id}: unknown protocol {}", r.proto)),
            }
        }
        for (id, r) in self.revnat6.read_all().map_err(read_err(names::REVNAT6))? {
            match codec::decode_revnat6(&r) {
                Some(entry) => {
                    d.revnat.insert(id, entry);
                }
                None => s
                    .warnings
                    .push(format!("REVNAT6 {id}: unknown protocol {}", r.proto)),
            }
        }
        Ok(())
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
        if self.node4.is_none() && self.node6.is_none() {
            return Ok(None);
        }
        let mut out = BTreeSet::new();
        if let Some(m) = &self.node4 {
            for k in m.keys() {
                let k = k.map_err(read_err(names::NODE_ADDRS4))?;
                out.insert(codec::decode_node_addr4(k));
            }
        }
        if let Some(m) = &self.node6 {
            for k in m.keys() {
                let k = k.map_err(read_err(names::NODE_ADDRS6))?;
                out.insert(codec::decode_node_addr6(k));
            }
        }
        Ok(Some(out))
    }

    /// `SRC_RANGE4/6`: the prefix length counts the 32 bits of the service id first.
    pub fn read_src_ranges(&self) -> Result<BTreeMap<u32, Vec<Cidr>>> {
        let mut out: BTreeMap<u32, Vec<Cidr>> = BTreeMap::new();
        if let Some(m) = &self.src4 {
            for k in m.keys() {
                let k: LpmKey<SrcRange4> = k.map_err(read_err(names::SRC_RANGE4))?;
                let (id, addr, len) = codec::decode_src_range4(&k);
                out.entry(id).or_default().push(Cidr { addr, len });
            }
        }
        if let Some(m) = &self.src6 {
            for k in m.keys() {
                let k: LpmKey<SrcRange6> = k.map_err(read_err(names::SRC_RANGE6))?;
                let (id, addr, len) = codec::decode_src_range6(&k);
                out.entry(id).or_default().push(Cidr { addr, len });
            }
        }
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
pub(super) fn ct4_entry(k: &Ct4Key, v: &Ct4Value) -> CtEntry {
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
pub(super) fn ct6_entry(k: &Ct6Key, v: &Ct6Value) -> CtEntry {
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

pub(super) fn backend4(
    id: u32,
    b: &Backend4,
    warnings: &mut Vec<String>,
) -> Option<(Backend, Proto)> {
    let decoded = codec::decode_backend4(b);
    if decoded.is_none() {
        warnings.push(format!("BACKEND4 {id}: unknown protocol {}", b.proto));
    }
    decoded
}

pub(super) fn backend6(
    id: u32,
    b: &Backend6,
    warnings: &mut Vec<String>,
) -> Option<(Backend, Proto)> {
    let decoded = codec::decode_backend6(b);
    if decoded.is_none() {
        warnings.push(format!("BACKEND6 {id}: unknown protocol {}", b.proto));
    }
    decoded
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
