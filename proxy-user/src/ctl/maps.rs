//! The pinned maps, opened READ-ONLY: every map file is opened with `BPF_OBJ_GET` and
//! `file_flags = BPF_F_RDONLY`, so the kernel refuses any update or delete through these
//! descriptors (EPERM). `proxyctl` can run next to the agent and can never change what
//! the datapath does. Readers here turn map entries into a [`Snapshot`].

use std::{
    collections::{BTreeMap, BTreeSet},
    io,
    net::{IpAddr, SocketAddr},
    os::fd::OwnedFd,
    path::{Path, PathBuf},
};

use aya::maps::{
    lpm_trie::{Key as LpmKey, LpmTrie},
    HashMap, Map, MapData, MapError, PerCpuArray, PerCpuHashMap,
};
use proxy_common::{
    affinity_kind, map_names as names, AffinityKey, AffinityValue, Backend4, Backend6, Ct4Key,
    Ct4Value, Ct6Key, Ct6Value, Reason, RevNat4, RevNat6, SrcRange4, SrcRange6, Svc4Key, Svc6Key,
    SvcValue,
};

use super::{
    error::{Error, Result},
    snapshot::{AffinityClient, AffinityEntry, Cidr, CtEntry, Snapshot},
};
use crate::{
    codec,
    model::{port_host, v4_from_word, v6_from_words, Backend, Frontend, Proto},
    pins::{Access, PinDir, PinError, PinnedHash},
    store::Dump,
};

pub use crate::pins::BPF_F_RDONLY;

/// Opens a pinned BPF object read-only (`BPF_OBJ_GET` with `BPF_F_RDONLY`).
pub fn open_pinned_rdonly(path: &Path) -> io::Result<OwnedFd> {
    crate::pins::open_pinned(path, Access::ReadOnly)
}

/// A pin-directory error as `proxyctl` reports it (`Ok(None)`: not pinned).
fn from_pin<T>(dir: &Path, r: std::result::Result<T, PinError>) -> Result<Option<T>> {
    match r {
        Ok(v) => Ok(Some(v)),
        Err(PinError::Missing { .. }) => Ok(None),
        Err(e) => Err(pin_error(dir, e)),
    }
}

fn pin_error(dir: &Path, e: PinError) -> Error {
    match e {
        PinError::Missing { path } => no_pins(dir, &path),
        // EACCES is also the kernel's answer for a path that is no BPF object (a file
        // outside bpffs, a directory on it): name that cause rather than "run as root".
        PinError::Permission { path } => match not_a_bpf_object(&path) {
            Some(cause) => Error::NotBpf { path, cause },
            None => Error::Permission { path },
        },
        PinError::Open { path, source } => Error::Open { path, source },
        PinError::Map { path, source } => Error::Layout { path, source },
        PinError::Abi {
            dir,
            found,
            expected,
        } => Error::Abi {
            dir,
            found,
            expected,
        },
    }
}

/// Opens one pinned map read-only as an aya [`Map`]. `Ok(None)`: not pinned.
pub fn open_map_rdonly(path: &Path) -> Result<Option<Map>> {
    let dir = path.parent().unwrap_or(Path::new("/"));
    let name = path
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_default();
    from_pin(dir, PinDir::new(dir).open_map(&name, Access::ReadOnly))
}

pub use crate::fs::BPF_FS_MAGIC;

/// Why `BPF_OBJ_GET` answered EACCES, when the cause is not a missing privilege: the
/// kernel also answers EACCES for a path that is not a pinned BPF object (a file outside
/// bpffs, a directory on it). `None`: the path is on bpffs and not a directory, so EACCES
/// is a real permission problem (or the path cannot even be looked at).
pub fn not_a_bpf_object(path: &Path) -> Option<String> {
    let magic = crate::fs::magic(path).ok()?;
    if magic != BPF_FS_MAGIC {
        return Some(format!(
            "not on a bpffs mount (filesystem magic {magic:#x}, bpffs is {BPF_FS_MAGIC:#x}): \
             not a pinned BPF object; the pin path must be a directory on bpffs \
             (mount -t bpf bpf /sys/fs/bpf)"
        ));
    }
    if std::fs::metadata(path).is_ok_and(|m| m.is_dir()) {
        return Some("a directory on bpffs, not a pinned BPF map".into());
    }
    None
}

/// `CLOCK_MONOTONIC` in nanoseconds: the clock `bpf_ktime_get_ns()` reads.
pub fn monotonic_ns() -> u64 {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: clock_gettime writes into the timespec we own.
    unsafe { libc::clock_gettime(libc::CLOCK_MONOTONIC, &mut ts) };
    (ts.tv_sec as u64) * 1_000_000_000 + ts.tv_nsec as u64
}

/// Every map `proxyctl` reads, opened read-only from one pin directory. The maps of the
/// TC datapath (conntrack, node addresses, source ranges) are optional: a datapath
/// without them still has its services shown.
pub struct Maps {
    dir: PathBuf,
    svc4: PinnedHash<Svc4Key, SvcValue>,
    svc6: PinnedHash<Svc6Key, SvcValue>,
    backend4: PinnedHash<u32, Backend4>,
    backend6: PinnedHash<u32, Backend6>,
    revnat4: PinnedHash<u32, RevNat4>,
    revnat6: PinnedHash<u32, RevNat6>,
    stats: PerCpuArray<MapData, u64>,
    xdp_stats: Option<PerCpuArray<MapData, u64>>,
    acceleration: u32,
    conns: PerCpuHashMap<MapData, u32, u64>,
    conns_fd: OwnedFd,
    ct4: Option<HashMap<MapData, Ct4Key, Ct4Value>>,
    ct6: Option<HashMap<MapData, Ct6Key, Ct6Value>>,
    node4: Option<HashMap<MapData, u32, u8>>,
    node6: Option<HashMap<MapData, [u32; 4], u8>>,
    affinity: Option<HashMap<MapData, AffinityKey, AffinityValue>>,
    src4: Option<LpmTrie<MapData, SrcRange4, u8>>,
    src6: Option<LpmTrie<MapData, SrcRange6, u8>>,
    missing: BTreeSet<&'static str>,
}

impl std::fmt::Debug for Maps {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Maps").field("dir", &self.dir).finish()
    }
}

fn read_err(map: &'static str) -> impl Fn(MapError) -> Error {
    move |source| Error::Read { map, source }
}

impl Maps {
    /// Opens the maps under `dir` read-only, after checking the ABI version the loader
    /// stored in `META`.
    pub fn open(dir: &Path) -> Result<Self> {
        let pins = PinDir::new(dir);
        let ro = Access::ReadOnly;
        pins.check_abi(ro).map_err(|e| pin_error(dir, e))?;
        macro_rules! req {
            ($open:expr) => {
                $open.map_err(|e| pin_error(dir, e))?
            };
        }
        let mut missing = BTreeSet::new();
        macro_rules! opt {
            ($name:expr) => {{
                let m = from_pin(dir, pins.typed($name, ro))?;
                if m.is_none() {
                    missing.insert($name);
                }
                m
            }};
        }
        let ct4 = opt!(names::CT4);
        let ct6 = opt!(names::CT6);
        let node4 = opt!(names::NODE_ADDRS4);
        let node6 = opt!(names::NODE_ADDRS6);
        let affinity = opt!(names::AFFINITY);
        let src4 = opt!(names::SRC_RANGE4);
        let src6 = opt!(names::SRC_RANGE6);
        let xdp_stats = opt!(names::XDP_STATS);
        let acceleration = pins
            .read_meta(proxy_common::meta::ACCELERATION, ro)
            .unwrap_or(proxy_common::acceleration::OFF);
        let (conns, conns_fd) = req!(pins.typed_with_fd(names::BACKEND_CONNS, ro));
        Ok(Self {
            dir: dir.to_owned(),
            svc4: req!(pins.hash(names::SVC4, ro)),
            svc6: req!(pins.hash(names::SVC6, ro)),
            backend4: req!(pins.hash(names::BACKEND4, ro)),
            backend6: req!(pins.hash(names::BACKEND6, ro)),
            revnat4: req!(pins.hash(names::REVNAT4, ro)),
            revnat6: req!(pins.hash(names::REVNAT6, ro)),
            stats: req!(pins.typed(names::STATS, ro)),
            xdp_stats,
            acceleration,
            conns,
            conns_fd,
            ct4,
            ct6,
            node4,
            node6,
            affinity,
            src4,
            src6,
            missing,
        })
    }

    /// The pin directory.
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    fn empty_snapshot(&self) -> Snapshot {
        Snapshot {
            now_ns: monotonic_ns(),
            missing_maps: self.missing.clone(),
            acceleration: self.acceleration,
            ..Snapshot::default()
        }
    }

    /// Everything but conntrack: services, backends, counters, node addresses, source
    /// ranges.
    pub fn snapshot(&self) -> Result<Snapshot> {
        let mut s = self.empty_snapshot();
        self.read_services(&mut s)?;
        s.conns = self.read_conns()?;
        s.stats = self.read_stats()?;
        s.xdp_stats = self.read_xdp_stats()?;
        s.node_addrs = self.read_node_addrs()?;
        s.src_ranges = self.read_src_ranges()?;
        s.services.src_ranges = s
            .src_ranges
            .iter()
            .flat_map(|(id, ranges)| ranges.iter().map(move |c| (*id, c.addr, c.len)))
            .collect();
        Ok(s)
    }

    /// The snapshot plus the conntrack tables.
    pub fn snapshot_with_flows(&self) -> Result<Snapshot> {
        let mut s = self.snapshot()?;
        s.flows = self.read_flows()?;
        Ok(s)
    }

    /// The snapshot plus the session-affinity entries.
    pub fn snapshot_with_affinity(&self) -> Result<Snapshot> {
        let mut s = self.snapshot()?;
        s.affinity = self.read_affinity()?;
        Ok(s)
    }

    fn read_affinity(&self) -> Result<Option<Vec<AffinityEntry>>> {
        let Some(m) = &self.affinity else {
            return Ok(None);
        };
        let mut out = Vec::new();
        for item in m.iter() {
            let (k, v) = item.map_err(read_err(names::AFFINITY))?;
            let client = match k.kind {
                affinity_kind::V4 => AffinityClient::Addr(IpAddr::V4(v4_from_word(k.client[0]))),
                affinity_kind::V6 => AffinityClient::Addr(IpAddr::V6(v6_from_words(k.client))),
                _ => AffinityClient::Netns(u64::from(k.client[0]) | (u64::from(k.client[1]) << 32)),
            };
            out.push(AffinityEntry {
                client,
                service_id: k.service_id,
                backend_id: v.backend_id,
                slot: v.slot,
                last_used_ns: v.last_used_ns,
            });
        }
        Ok(Some(out))
    }

    /// Counters and backends only (`watch`, each frame).
    pub fn counters(&self) -> Result<Snapshot> {
        let mut s = self.empty_snapshot();
        self.read_backends(&mut s)?;
        s.conns = self.read_conns()?;
        s.stats = self.read_stats()?;
        s.xdp_stats = self.read_xdp_stats()?;
        Ok(s)
    }

    /// What `explain` needs for `addr:port/proto`, by point lookups (no full scan on a
    /// node with 50,000 services): the exact frontend and its ext-local twin, the NodePort
    /// frontend on that port (address 0) and its twin, their slots, backends, names,
    /// counters and source ranges, and the node's addresses. Only when nothing matches,
    /// the frontends on the same address are collected by a scan, for a hint.
    pub fn snapshot_for(&self, addr: IpAddr, port: u16, proto: Proto) -> Result<Snapshot> {
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
        Ok(s)
    }

    fn svc_get(&self, fe: &Frontend, slot: u16) -> Result<Option<SvcValue>> {
        match codec::svc_key(fe, slot) {
            codec::SvcKey::V4(k) => lookup(&self.svc4, &k, names::SVC4),
            codec::SvcKey::V6(k) => lookup(&self.svc6, &k, names::SVC6),
        }
    }

    /// Loads one frontend with its slots, backends, name and counters; false if absent.
    fn load_frontend(&self, s: &mut Snapshot, fe: Frontend) -> Result<bool> {
        let Some(v) = self.svc_get(&fe, 0)? else {
            return Ok(false);
        };
        s.services
            .frontends
            .insert(fe, codec::decode_frontend_value(&v));
        for slot in 1..=v.count {
            if let Some(sv) = self.svc_get(&fe, slot)? {
                s.services.slots.insert((fe, slot), sv.backend_id);
                self.load_backend(s, sv.backend_id)?;
            }
        }
        if let Some(entry) = self.revnat(v.service_id, fe.addr.is_ipv4())? {
            s.services.revnat.insert(v.service_id, entry);
        }
        Ok(true)
    }

    /// A reverse-NAT entry (frontend and name); `None`: absent or unreadable protocol.
    fn revnat(&self, id: u32, v4: bool) -> Result<Option<(Frontend, String)>> {
        Ok(if v4 {
            lookup(&self.revnat4, &id, names::REVNAT4)?.and_then(|r| codec::decode_revnat4(&r))
        } else {
            lookup(&self.revnat6, &id, names::REVNAT6)?.and_then(|r| codec::decode_revnat6(&r))
        })
    }

    fn load_backend(&self, s: &mut Snapshot, id: u32) -> Result<()> {
        if s.services.backends.contains_key(&id) {
            return Ok(());
        }
        let b = match lookup(&self.backend4, &id, names::BACKEND4)? {
            Some(b) => backend4(id, &b, &mut s.warnings),
            None => lookup(&self.backend6, &id, names::BACKEND6)?
                .and_then(|b| backend6(id, &b, &mut s.warnings)),
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
    fn frontends_on(&self, s: &mut Snapshot, addr: IpAddr) -> Result<()> {
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

    fn scan_slot0(&self, s: &mut Snapshot, addr: IpAddr) -> Result<()> {
        match addr {
            IpAddr::V4(a) => {
                let want = codec::svc_key(&Frontend::new(a, 0, Proto::Tcp), 0);
                let codec::SvcKey::V4(want) = want else {
                    return Ok(());
                };
                for (k, v) in self.svc4.read_all().map_err(read_err(names::SVC4))? {
                    if k.slot == 0 && k.addr == want.addr {
                        if let Some(fe) = codec::decode_svc4(&k) {
                            s.services
                                .frontends
                                .insert(fe, codec::decode_frontend_value(&v));
                        }
                    }
                }
            }
            IpAddr::V6(a) => {
                let want = codec::svc_key(&Frontend::new(a, 0, Proto::Tcp), 0);
                let codec::SvcKey::V6(want) = want else {
                    return Ok(());
                };
                for (k, v) in self.svc6.read_all().map_err(read_err(names::SVC6))? {
                    if k.slot == 0 && k.addr == want.addr {
                        if let Some(fe) = codec::decode_svc6(&k) {
                            s.services
                                .frontends
                                .insert(fe, codec::decode_frontend_value(&v));
                        }
                    }
                }
            }
        }
        Ok(())
    }

    fn read_backends(&self, s: &mut Snapshot) -> Result<()> {
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
    fn read_services(&self, s: &mut Snapshot) -> Result<()> {
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
                let sa =
                    |a: u32, p: u16| SocketAddr::new(IpAddr::V4(v4_from_word(a)), port_host(p));
                out.push(CtEntry {
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
                });
            }
        }
        if let Some(m) = &self.ct6 {
            for item in m.iter() {
                let (k, v) = item.map_err(read_err(names::CT6))?;
                let sa = |a: [u32; 4], p: u16| {
                    SocketAddr::new(IpAddr::V6(v6_from_words(a)), port_host(p))
                };
                out.push(CtEntry {
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
                });
            }
        }
        Ok(Some(out))
    }
}

fn no_pins(dir: &Path, missing: &Path) -> Error {
    // A directory we may not even look into is a permission problem, not a missing pin.
    match std::fs::metadata(dir) {
        Err(e) if e.kind() == io::ErrorKind::PermissionDenied => Error::Permission {
            path: dir.to_owned(),
        },
        _ => Error::NoPins {
            dir: dir.to_owned(),
            missing: missing.to_owned(),
        },
    }
}

fn lookup<K: aya::Pod, V: aya::Pod>(
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

fn backend4(id: u32, b: &Backend4, warnings: &mut Vec<String>) -> Option<(Backend, Proto)> {
    let decoded = codec::decode_backend4(b);
    if decoded.is_none() {
        warnings.push(format!("BACKEND4 {id}: unknown protocol {}", b.proto));
    }
    decoded
}

fn backend6(id: u32, b: &Backend6, warnings: &mut Vec<String>) -> Option<(Backend, Proto)> {
    let decoded = codec::decode_backend6(b);
    if decoded.is_none() {
        warnings.push(format!("BACKEND6 {id}: unknown protocol {}", b.proto));
    }
    decoded
}

/// A `Reason`-indexed per-CPU counter array, summed over CPUs; a reason past its end
/// (pins of an older build of the same ABI) reads 0.
fn read_counters(
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
