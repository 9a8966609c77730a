//! The point lookups behind `proxyctl explain` ([`Maps::snapshot_for`]): one frontend, its
//! twins, backends and names, without a full scan.

use std::{
    collections::BTreeMap,
    net::{IpAddr, SocketAddr},
};

use aya::maps::{HashMap, MapData, MapError};
use proxy_common::{map_names as names, Ct4Key, Ct6Key, MaglevKey, SvcEntry};

use super::{
    read::{self, backend, lookup},
    read_err, Error, Maps, Result, Snapshot,
};
use crate::{
    codec::{self, FamilyAbi, Ipv4, Ipv6},
    ctl::snapshot::FlowFacts,
    model::{port_net, v4_word, v6_words, Frontend, Proto},
    pins::PinnedHash,
};

fn ct_get<K: aya::Pod, V: aya::Pod>(
    m: &HashMap<MapData, K, V>,
    k: &K,
    map: &'static str,
) -> Result<Option<V>> {
    match m.get(k, 0) {
        Ok(v) => Ok(Some(v)),
        Err(MapError::KeyNotFound) => Ok(None),
        Err(source) => Err(Error::Read { map, source }),
    }
}

impl Maps {
    /// What `explain` needs for `addr:port/proto`, by point lookups (no full scan on a
    /// node with 50,000 services): the exact frontend and its ext-local twin, the NodePort
    /// frontend on that port (address 0) and its twin, their slots, backends, names,
    /// counters and source ranges, and the node's addresses. Only when nothing matches,
    /// the frontends on the same address are collected by a scan, for a hint.
    ///
    /// With `from` (a client address and port, `explain --from`), also the flow's
    /// conntrack entry and the Maglev tables of the frontends found ([`FlowFacts`]).
    pub fn snapshot_for(
        &self,
        addr: IpAddr,
        port: u16,
        proto: Proto,
        from: Option<SocketAddr>,
    ) -> Result<Snapshot> {
        let mut s = self.empty_snapshot();
        s.node_addrs = self.read_node_addrs()?;
        let any: IpAddr = match addr {
            IpAddr::V4(_) => IpAddr::V4(std::net::Ipv4Addr::UNSPECIFIED),
            IpAddr::V6(_) => IpAddr::V6(std::net::Ipv6Addr::UNSPECIFIED),
        };
        let mut found = false;
        for a in [addr, any] {
            for sc in [
                proxy_common::scope::ALL,
                proxy_common::scope::EXTERNAL_LOCAL,
            ] {
                let fe = Frontend::new(a, port, proto).with_scope(sc);
                found |= self.load_frontend(&mut s, fe)?;
            }
        }
        if !found {
            self.frontends_on(&mut s, addr)?;
        }
        if s.services
            .frontends
            .values()
            .any(|v| v.flags & proxy_common::svc_flags::SOURCE_RANGES != 0)
        {
            s.src_ranges = self.read_src_ranges()?;
        }
        if let Some(from) = from {
            s.flow = Some(self.flow_facts(&s, from, addr, port, proto)?);
        }
        Ok(s)
    }

    /// The conntrack entry of the flow `from` -> `addr:port/proto` (as the packets carry
    /// it: the key the datapath writes for the original direction), and the Maglev
    /// tables of the Maglev frontends in `s`.
    fn flow_facts(
        &self,
        s: &Snapshot,
        from: SocketAddr,
        addr: IpAddr,
        port: u16,
        proto: Proto,
    ) -> Result<FlowFacts> {
        let (sport, dport, proto) = (port_net(from.port()), port_net(port), proto.number());
        let tracked = match (from.ip(), addr, &self.ct4, &self.ct6) {
            (IpAddr::V4(c), IpAddr::V4(d), Some(m), _) => {
                let key = Ct4Key::new(v4_word(c), v4_word(d), sport, dport, proto, 0);
                ct_get(m, &key, names::CT4)?.map(|v| read::ct4_entry(&key, &v))
            }
            (IpAddr::V6(c), IpAddr::V6(d), _, Some(m)) => {
                let key = Ct6Key::new(v6_words(c), v6_words(d), sport, dport, proto, 0);
                ct_get(m, &key, names::CT6)?.map(|v| read::ct6_entry(&key, &v))
            }
            _ => None,
        };
        let mut maglev = BTreeMap::new();
        for v in s.services.frontends.values() {
            if v.flags & proxy_common::svc_flags::MAGLEV != 0 {
                if let Some(t) = self.maglev_table(v.service_id)? {
                    maglev.insert(v.service_id, t);
                }
            }
        }
        Ok(FlowFacts {
            from,
            tracked,
            maglev,
        })
    }

    /// The whole Maglev table of `service_id` (`None`: not pinned, missing, or chunks
    /// of two table sizes: what the datapath would not use either).
    fn maglev_table(&self, service_id: u32) -> Result<Option<Vec<u16>>> {
        let Some(m) = &self.maglev else {
            return Ok(None);
        };
        let get = |chunk: u32| match m.get(&MaglevKey { service_id, chunk }, 0) {
            Ok(c) => Ok(Some(c)),
            Err(MapError::KeyNotFound) => Ok(None),
            Err(source) => Err(Error::Read {
                map: names::MAGLEV,
                source,
            }),
        };
        let Some(first) = get(0)? else {
            return Ok(None);
        };
        let size = first.table_size;
        let mut table = Vec::with_capacity(size as usize);
        for chunk in 0..proxy_common::maglev::chunks(size) {
            let c = if chunk == 0 { Some(first) } else { get(chunk)? };
            match c {
                Some(c) if c.table_size == size => table.extend_from_slice(&c.slots),
                _ => return Ok(None),
            }
        }
        table.truncate(size as usize);
        Ok(Some(table))
    }

    pub(super) fn svc_get(&self, fe: &Frontend, chunk: u16) -> Result<Option<SvcEntry>> {
        match codec::svc_key(fe, chunk) {
            codec::SvcKey::V4(k) => lookup(&self.v4.svc, &k, names::SVC4),
            codec::SvcKey::V6(k) => lookup(&self.v6.svc, &k, names::SVC6),
        }
    }

    /// Loads one frontend with its slots, backends, name and counters; false if absent.
    pub(super) fn load_frontend(&self, s: &mut Snapshot, fe: Frontend) -> Result<bool> {
        let Some(v) = self.svc_get(&fe, 0)? else {
            return Ok(false);
        };
        codec::put_svc(&mut s.services, fe, 0, &v);
        let count = usize::from(v.head.count);
        for chunk in 1..crate::store::svc_entries(count) {
            if let Some(c) = self.svc_get(&fe, chunk as u16)? {
                codec::put_svc(&mut s.services, fe, chunk as u16, &c);
            }
        }
        let ids: Vec<u32> = s
            .services
            .slots
            .range((fe, 1)..=(fe, v.head.count))
            .map(|(_, id)| *id)
            .collect();
        for id in ids {
            self.load_backend(s, id)?;
        }
        if let Some(entry) = self.revnat(v.head.service_id, fe.addr.is_ipv4())? {
            s.services.revnat.insert(v.head.service_id, entry);
        }
        Ok(true)
    }

    /// A reverse-NAT entry (frontend and name); `None`: absent or unreadable protocol.
    pub(super) fn revnat(&self, id: u32, v4: bool) -> Result<Option<(Frontend, String)>> {
        Ok(if v4 {
            lookup(&self.v4.revnat, &id, names::REVNAT4)?
                .and_then(|r| codec::decode_revnat::<Ipv4>(&r))
        } else {
            lookup(&self.v6.revnat, &id, names::REVNAT6)?
                .and_then(|r| codec::decode_revnat::<Ipv6>(&r))
        })
    }

    pub(super) fn load_backend(&self, s: &mut Snapshot, id: u32) -> Result<()> {
        if s.services.backends.contains_key(&id) {
            return Ok(());
        }
        // Arrays: a free id (or one past the end) reads as no backend.
        let read = |name| move |source| Error::Read { map: name, source };
        let b = match self.v4.backend.get(id).map_err(read(names::BACKEND4))? {
            Some(b) => backend::<Ipv4>(id, &b, &mut s.warnings),
            None => self
                .v6
                .backend
                .get(id)
                .map_err(read(names::BACKEND6))?
                .and_then(|b| backend::<Ipv6>(id, &b, &mut s.warnings)),
        };
        if let Some(b) = b {
            s.services.backends.insert(id, b);
        }
        match self.conns.get(&id, 0) {
            Ok(per_cpu) => {
                s.conns.insert(id, per_cpu.iter().sum());
            }
            Err(MapError::KeyNotFound) => {}
            Err(e) => {
                return Err(Error::Read {
                    map: names::BACKEND_CONNS,
                    source: e,
                })
            }
        }
        Ok(())
    }

    /// Slot 0 of every frontend on `addr` (any port, protocol, scope), with its name.
    pub(super) fn frontends_on(&self, s: &mut Snapshot, addr: IpAddr) -> Result<()> {
        self.scan_slot0(s, addr)?;
        let ids: Vec<(u32, bool)> = s
            .services
            .frontends
            .iter()
            .map(|(fe, v)| (v.service_id, fe.addr.is_ipv4()))
            .collect();
        for (id, v4) in ids {
            if let Some(entry) = self.revnat(id, v4)? {
                s.services.revnat.insert(id, entry);
            }
        }
        Ok(())
    }

    /// Every frontend on `addr` (any port and protocol): the entry (chunk 0) of each, by
    /// one scan of its family's `SVC` map.
    pub(super) fn scan_slot0(&self, s: &mut Snapshot, addr: IpAddr) -> Result<()> {
        let want = codec::svc_key(&Frontend::new(addr, 0, Proto::Tcp), 0);
        match addr {
            IpAddr::V4(_) => scan_slot0_in::<Ipv4>(&self.v4.svc, want, s),
            IpAddr::V6(_) => scan_slot0_in::<Ipv6>(&self.v6.svc, want, s),
        }
    }
}

/// [`Maps::scan_slot0`] over one family's `SVC` map: the frontends' entries (chunk 0) whose address is
/// the one of `want`.
fn scan_slot0_in<F: FamilyAbi>(
    map: &PinnedHash<F::SvcKey, SvcEntry>,
    want: codec::SvcKey,
    s: &mut Snapshot,
) -> Result<()> {
    let Some(want) = F::svc_key(want) else {
        return Ok(());
    };
    let (want, _) = F::svc_fields(&want);
    for (k, v) in map.read_all().map_err(read_err(F::SVC))? {
        let (f, slot) = F::svc_fields(&k);
        if slot == 0 && f.addr == want.addr {
            if let Some((fe, _)) = codec::decode_svc::<F>(&k) {
                s.services
                    .frontends
                    .insert(fe, codec::decode_frontend_value(&v.head));
            }
        }
    }
    Ok(())
}
