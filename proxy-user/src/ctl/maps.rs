//! The pinned maps, opened READ-ONLY: every map file is opened with `BPF_OBJ_GET` and
//! `file_flags = BPF_F_RDONLY`, so the kernel refuses any update or delete through these
//! descriptors (EPERM). `proxyctl` can run next to the agent and can never change what
//! the datapath does. Readers here turn map entries into a [`Snapshot`].

use std::{
    collections::{BTreeMap, BTreeSet},
    ffi::CString,
    io,
    net::{IpAddr, SocketAddr},
    os::{
        fd::{FromRawFd as _, OwnedFd},
        unix::ffi::OsStrExt as _,
    },
    path::{Path, PathBuf},
};

use aya::maps::{
    lpm_trie::{Key as LpmKey, LpmTrie},
    Array, HashMap, Map, MapData, MapError, PerCpuArray, PerCpuHashMap,
};
use proxy_common::{
    affinity_kind, map_names as names, meta, AffinityKey, AffinityValue, Backend4, Backend6,
    Ct4Key, Ct4Value, Ct6Key, Ct6Value, Reason, RevNat4, RevNat6, SrcRange4, SrcRange6, Svc4Key,
    Svc6Key, SvcValue, ABI_VERSION,
};

use super::{
    error::{Error, Result},
    snapshot::{AffinityClient, AffinityEntry, Cidr, CtEntry, Snapshot},
};
use crate::{
    model::{
        name_from_bytes, port_host, port_net, v4_from_word, v4_word, v6_from_words, v6_words,
        Backend, Frontend, Proto,
    },
    store::{Dump, FrontendValue},
};

/// `bpf(2)` command `BPF_OBJ_GET`.
const BPF_OBJ_GET: libc::c_long = 7;
/// `BPF_F_RDONLY`: the returned descriptor only allows lookups.
pub const BPF_F_RDONLY: u32 = 1 << 3;

/// `union bpf_attr` for `BPF_OBJ_GET`: pathname, bpf_fd, file_flags, path_fd, and zeros
/// (the kernel requires every byte past the command's fields to be zero).
#[repr(C)]
struct ObjGetAttr {
    pathname: u64,
    bpf_fd: u32,
    file_flags: u32,
    path_fd: i32,
    _zero: [u8; 108],
}

/// Opens a pinned BPF object read-only (`BPF_OBJ_GET` with `BPF_F_RDONLY`).
pub fn open_pinned_rdonly(path: &Path) -> io::Result<OwnedFd> {
    let c_path = CString::new(path.as_os_str().as_bytes())
        .map_err(|e| io::Error::new(io::ErrorKind::InvalidInput, e))?;
    let mut attr = ObjGetAttr {
        pathname: c_path.as_ptr() as u64,
        bpf_fd: 0,
        file_flags: BPF_F_RDONLY,
        path_fd: 0,
        _zero: [0; 108],
    };
    // SAFETY: bpf(BPF_OBJ_GET) with a fully initialized, zero-padded attr whose pathname
    // points at a NUL-terminated string that outlives the call.
    let ret = unsafe {
        libc::syscall(
            libc::SYS_bpf,
            BPF_OBJ_GET,
            &mut attr as *mut ObjGetAttr,
            std::mem::size_of::<ObjGetAttr>(),
        )
    };
    if ret < 0 {
        return Err(io::Error::last_os_error());
    }
    let fd = i32::try_from(ret).map_err(|_| io::Error::other("fd out of range"))?;
    // SAFETY: BPF_OBJ_GET returned a new descriptor that nothing else owns.
    Ok(unsafe { OwnedFd::from_raw_fd(fd) })
}

/// Opens one pinned map read-only as an aya [`Map`]. `Ok(None)`: not pinned.
pub fn open_map_rdonly(path: &Path) -> Result<Option<Map>> {
    let fd = match open_pinned_rdonly(path) {
        Ok(fd) => fd,
        Err(e) => {
            return match e.raw_os_error() {
                Some(libc::ENOENT) => Ok(None),
                Some(libc::EACCES) => Err(match not_a_bpf_object(path) {
                    Some(cause) => Error::NotBpf {
                        path: path.to_owned(),
                        cause,
                    },
                    None => Error::Permission {
                        path: path.to_owned(),
                    },
                }),
                Some(libc::EPERM) => Err(Error::Permission {
                    path: path.to_owned(),
                }),
                _ => Err(Error::Open {
                    path: path.to_owned(),
                    source: e,
                }),
            };
        }
    };
    let data = MapData::from_fd(fd).map_err(|source| Error::Layout {
        path: path.to_owned(),
        source,
    })?;
    Map::from_map_data(data)
        .map(Some)
        .map_err(|source| Error::Layout {
            path: path.to_owned(),
            source,
        })
}

/// `BPF_FS_MAGIC` (`include/uapi/linux/magic.h`): `statfs.f_type` of a bpffs mount.
pub const BPF_FS_MAGIC: i64 = 0xcafe_4a11;

/// Why `BPF_OBJ_GET` answered EACCES, when the cause is not a missing privilege: the
/// kernel also answers EACCES for a path that is not a pinned BPF object (a file outside
/// bpffs, a directory on it). `None`: the path is on bpffs and not a directory, so EACCES
/// is a real permission problem (or the path cannot even be looked at).
pub fn not_a_bpf_object(path: &Path) -> Option<String> {
    let c_path = CString::new(path.as_os_str().as_bytes()).ok()?;
    // SAFETY: statfs writes into the zeroed struct we own; the path is NUL-terminated.
    let mut st: libc::statfs = unsafe { std::mem::zeroed() };
    if unsafe { libc::statfs(c_path.as_ptr(), &mut st) } != 0 {
        return None;
    }
    #[allow(clippy::unnecessary_cast)]
    let magic = st.f_type as i64;
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
    svc4: HashMap<MapData, Svc4Key, SvcValue>,
    svc6: HashMap<MapData, Svc6Key, SvcValue>,
    backend4: HashMap<MapData, u32, Backend4>,
    backend6: HashMap<MapData, u32, Backend6>,
    revnat4: HashMap<MapData, u32, RevNat4>,
    revnat6: HashMap<MapData, u32, RevNat6>,
    stats: PerCpuArray<MapData, u64>,
    conns: PerCpuHashMap<MapData, u32, u64>,
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

fn typed<T: TryFrom<Map, Error = MapError>>(path: &Path, map: Map) -> Result<T> {
    T::try_from(map).map_err(|source| Error::Layout {
        path: path.to_owned(),
        source,
    })
}

fn read_err(map: &'static str) -> impl Fn(MapError) -> Error {
    move |source| Error::Read { map, source }
}

impl Maps {
    /// Opens the maps under `dir` read-only, after checking the ABI version the loader
    /// stored in `META`.
    pub fn open(dir: &Path) -> Result<Self> {
        let required = |name: &'static str| -> Result<(PathBuf, Map)> {
            let path = dir.join(name);
            match open_map_rdonly(&path)? {
                Some(map) => Ok((path, map)),
                None => Err(no_pins(dir, &path)),
            }
        };
        let (path, meta) = required(names::META)?;
        let meta: Array<MapData, u32> = typed(&path, meta)?;
        let found = meta
            .get(&meta::ABI_VERSION, 0)
            .map_err(read_err(names::META))?;
        if found != ABI_VERSION {
            return Err(Error::Abi {
                dir: dir.to_owned(),
                found,
                expected: ABI_VERSION,
            });
        }
        macro_rules! req {
            ($name:expr) => {{
                let (path, map) = required($name)?;
                typed(&path, map)?
            }};
        }
        let mut missing = BTreeSet::new();
        let mut optional = |name: &'static str| -> Result<Option<(PathBuf, Map)>> {
            let path = dir.join(name);
            let map = open_map_rdonly(&path)?;
            if map.is_none() {
                missing.insert(name);
            }
            Ok(map.map(|m| (path, m)))
        };
        macro_rules! opt {
            ($name:expr) => {{
                match optional($name)? {
                    Some((path, map)) => Some(typed(&path, map)?),
                    None => None,
                }
            }};
        }
        let ct4 = opt!(names::CT4);
        let ct6 = opt!(names::CT6);
        let node4 = opt!(names::NODE_ADDRS4);
        let node6 = opt!(names::NODE_ADDRS6);
        let affinity = opt!(names::AFFINITY);
        let src4 = opt!(names::SRC_RANGE4);
        let src6 = opt!(names::SRC_RANGE6);
        Ok(Self {
            dir: dir.to_owned(),
            svc4: req!(names::SVC4),
            svc6: req!(names::SVC6),
            backend4: req!(names::BACKEND4),
            backend6: req!(names::BACKEND6),
            revnat4: req!(names::REVNAT4),
            revnat6: req!(names::REVNAT6),
            stats: req!(names::STATS),
            conns: req!(names::BACKEND_CONNS),
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
        let r = match fe.addr {
            IpAddr::V4(a) => self.svc4.get(
                &Svc4Key::new(
                    v4_word(a),
                    port_net(fe.port),
                    fe.proto.number(),
                    fe.scope,
                    slot,
                ),
                0,
            ),
            IpAddr::V6(a) => self.svc6.get(
                &Svc6Key::new(
                    v6_words(a),
                    port_net(fe.port),
                    fe.proto.number(),
                    fe.scope,
                    slot,
                ),
                0,
            ),
        };
        match r {
            Ok(v) => Ok(Some(v)),
            Err(MapError::KeyNotFound) => Ok(None),
            Err(e) => Err(Error::Read {
                map: if fe.family() == crate::model::Family::V4 {
                    names::SVC4
                } else {
                    names::SVC6
                },
                source: e,
            }),
        }
    }

    /// Loads one frontend with its slots, backends, name and counters; false if absent.
    fn load_frontend(&self, s: &mut Snapshot, fe: Frontend) -> Result<bool> {
        let Some(v) = self.svc_get(&fe, 0)? else {
            return Ok(false);
        };
        s.services.frontends.insert(
            fe,
            FrontendValue {
                service_id: v.service_id,
                count: v.count,
                flags: v.flags,
                affinity_timeout: v.affinity_timeout,
            },
        );
        for slot in 1..=v.count {
            if let Some(sv) = self.svc_get(&fe, slot)? {
                s.services.slots.insert((fe, slot), sv.backend_id);
                self.load_backend(s, sv.backend_id)?;
            }
        }
        let revnat = match fe.addr {
            IpAddr::V4(_) => lookup(&self.revnat4, &v.service_id, names::REVNAT4)?
                .map(|r| (revnat4_frontend(&r), name_from_bytes(&r.name))),
            IpAddr::V6(_) => lookup(&self.revnat6, &v.service_id, names::REVNAT6)?
                .map(|r| (revnat6_frontend(&r), name_from_bytes(&r.name))),
        };
        if let Some((Some(rfe), name)) = revnat {
            s.services.revnat.insert(v.service_id, (rfe, name));
        }
        Ok(true)
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
            let revnat = if v4 {
                lookup(&self.revnat4, &id, names::REVNAT4)?
                    .map(|r| (revnat4_frontend(&r), name_from_bytes(&r.name)))
            } else {
                lookup(&self.revnat6, &id, names::REVNAT6)?
                    .map(|r| (revnat6_frontend(&r), name_from_bytes(&r.name)))
            };
            if let Some((Some(fe), name)) = revnat {
                s.services.revnat.insert(id, (fe, name));
            }
        }
        Ok(())
    }

    fn scan_slot0(&self, s: &mut Snapshot, addr: IpAddr) -> Result<()> {
        match addr {
            IpAddr::V4(a) => {
                for item in self.svc4.iter() {
                    let (k, v) = item.map_err(read_err(names::SVC4))?;
                    if k.slot == 0 && k.addr == v4_word(a) {
                        if let Some(fe) = svc4_frontend(&k) {
                            s.services.frontends.insert(fe, slot0(&v));
                        }
                    }
                }
            }
            IpAddr::V6(a) => {
                for item in self.svc6.iter() {
                    let (k, v) = item.map_err(read_err(names::SVC6))?;
                    if k.slot == 0 && k.addr == v6_words(a) {
                        if let Some(fe) = svc6_frontend(&k) {
                            s.services.frontends.insert(fe, slot0(&v));
                        }
                    }
                }
            }
        }
        Ok(())
    }

    fn read_backends(&self, s: &mut Snapshot) -> Result<()> {
        for item in self.backend4.iter() {
            let (id, b) = item.map_err(read_err(names::BACKEND4))?;
            if let Some(b) = backend4(id, &b, &mut s.warnings) {
                s.services.backends.insert(id, b);
            }
        }
        for item in self.backend6.iter() {
            let (id, b) = item.map_err(read_err(names::BACKEND6))?;
            if let Some(b) = backend6(id, &b, &mut s.warnings) {
                s.services.backends.insert(id, b);
            }
        }
        Ok(())
    }

    /// `SVC4/6`, `BACKEND4/6` and `REVNAT4/6` into `s.services`.
    fn read_services(&self, s: &mut Snapshot) -> Result<()> {
        self.read_backends(s)?;
        let d: &mut Dump = &mut s.services;
        let mut put = |fe: Frontend, slot: u16, v: SvcValue| {
            if slot == 0 {
                d.frontends.insert(fe, slot0(&v));
            } else {
                d.slots.insert((fe, slot), v.backend_id);
            }
        };
        for item in self.svc4.iter() {
            let (k, v) = item.map_err(read_err(names::SVC4))?;
            match svc4_frontend(&k) {
                Some(fe) => put(fe, k.slot, v),
                None => s
                    .warnings
                    .push(format!("SVC4: unknown protocol {}", k.proto)),
            }
        }
        for item in self.svc6.iter() {
            let (k, v) = item.map_err(read_err(names::SVC6))?;
            match svc6_frontend(&k) {
                Some(fe) => put(fe, k.slot, v),
                None => s
                    .warnings
                    .push(format!("SVC6: unknown protocol {}", k.proto)),
            }
        }
        for item in self.revnat4.iter() {
            let (id, r) = item.map_err(read_err(names::REVNAT4))?;
            match revnat4_frontend(&r) {
                Some(fe) => {
                    s.services.revnat.insert(id, (fe, name_from_bytes(&r.name)));
                }
                None => s
                    .warnings
                    .push(format!("REVNAT4 {id}: unknown protocol {}", r.proto)),
            }
        }
        for item in self.revnat6.iter() {
            let (id, r) = item.map_err(read_err(names::REVNAT6))?;
            match revnat6_frontend(&r) {
                Some(fe) => {
                    s.services.revnat.insert(id, (fe, name_from_bytes(&r.name)));
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
        let mut out = BTreeMap::new();
        for item in self.conns.iter() {
            let (id, per_cpu) = item.map_err(read_err(names::BACKEND_CONNS))?;
            out.insert(id, per_cpu.iter().sum());
        }
        Ok(out)
    }

    /// `STATS`, summed over CPUs, every `Reason` in order.
    pub fn read_stats(&self) -> Result<Vec<(Reason, u64)>> {
        Reason::ALL
            .iter()
            .map(|r| {
                let v = self
                    .stats
                    .get(&(*r as u32), 0)
                    .map_err(read_err(names::STATS))?;
                Ok((*r, v.iter().sum()))
            })
            .collect()
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
                out.insert(IpAddr::V4(v4_from_word(k)));
            }
        }
        if let Some(m) = &self.node6 {
            for k in m.keys() {
                let k = k.map_err(read_err(names::NODE_ADDRS6))?;
                out.insert(IpAddr::V6(v6_from_words(k)));
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
                let data = k.data();
                let len = k.prefix_len().saturating_sub(32).min(32) as u8;
                out.entry(data.service_id).or_default().push(Cidr {
                    addr: IpAddr::V4(v4_from_word(data.addr)),
                    len,
                });
            }
        }
        if let Some(m) = &self.src6 {
            for k in m.keys() {
                let k: LpmKey<SrcRange6> = k.map_err(read_err(names::SRC_RANGE6))?;
                let data = k.data();
                let len = k.prefix_len().saturating_sub(32).min(128) as u8;
                out.entry(data.service_id).or_default().push(Cidr {
                    addr: IpAddr::V6(v6_from_words(data.addr)),
                    len,
                });
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
    m: &HashMap<MapData, K, V>,
    k: &K,
    name: &'static str,
) -> Result<Option<V>> {
    match m.get(k, 0) {
        Ok(v) => Ok(Some(v)),
        Err(MapError::KeyNotFound) => Ok(None),
        Err(source) => Err(Error::Read { map: name, source }),
    }
}

fn slot0(v: &SvcValue) -> FrontendValue {
    FrontendValue {
        service_id: v.service_id,
        count: v.count,
        flags: v.flags,
        affinity_timeout: v.affinity_timeout,
    }
}

fn svc4_frontend(k: &Svc4Key) -> Option<Frontend> {
    let proto = Proto::from_number(k.proto)?;
    Some(Frontend::new(v4_from_word(k.addr), port_host(k.port), proto).with_scope(k.scope))
}

fn svc6_frontend(k: &Svc6Key) -> Option<Frontend> {
    let proto = Proto::from_number(k.proto)?;
    Some(Frontend::new(v6_from_words(k.addr), port_host(k.port), proto).with_scope(k.scope))
}

fn revnat4_frontend(r: &RevNat4) -> Option<Frontend> {
    let proto = Proto::from_number(r.proto)?;
    Some(Frontend::new(v4_from_word(r.addr), port_host(r.port), proto).with_scope(r.scope))
}

fn revnat6_frontend(r: &RevNat6) -> Option<Frontend> {
    let proto = Proto::from_number(r.proto)?;
    Some(Frontend::new(v6_from_words(r.addr), port_host(r.port), proto).with_scope(r.scope))
}

fn backend4(id: u32, b: &Backend4, warnings: &mut Vec<String>) -> Option<(Backend, Proto)> {
    let Some(proto) = Proto::from_number(b.proto) else {
        warnings.push(format!("BACKEND4 {id}: unknown protocol {}", b.proto));
        return None;
    };
    let addr = SocketAddr::from((v4_from_word(b.addr), port_host(b.port)));
    Some((
        Backend {
            addr,
            flags: b.flags,
        },
        proto,
    ))
}

fn backend6(id: u32, b: &Backend6, warnings: &mut Vec<String>) -> Option<(Backend, Proto)> {
    let Some(proto) = Proto::from_number(b.proto) else {
        warnings.push(format!("BACKEND6 {id}: unknown protocol {}", b.proto));
        return None;
    };
    let addr = SocketAddr::from((v6_from_words(b.addr), port_host(b.port)));
    Some((
        Backend {
            addr,
            flags: b.flags,
        },
        proto,
    ))
}
