//! The pinned maps, opened READ-ONLY: every map file is opened with `BPF_OBJ_GET` and
//! `file_flags = BPF_F_RDONLY`, so the kernel refuses any update or delete through these
//! descriptors (EPERM). `proxyctl` can run next to the agent and can never change what
//! the datapath does. Readers here turn map entries into a [`Snapshot`].

use std::{
    collections::BTreeSet,
    io,
    net::IpAddr,
    os::fd::OwnedFd,
    path::{Path, PathBuf},
};

use aya::maps::{lpm_trie::LpmTrie, HashMap, Map, MapData, MapError, PerCpuArray, PerCpuHashMap};
use proxy_common::{
    affinity_kind, map_names as names, AffinityKey, AffinityValue, Ct4Key, Ct4Value, Ct6Key,
    Ct6Value, MaglevChunk, MaglevKey, SvcEntry,
};

use super::{
    error::{Error, Result},
    snapshot::{AffinityClient, AffinityEntry, Cidr, CtEntry, Snapshot},
};
use crate::{
    model::{v4_from_word, v6_from_words},
    pins::{Access, PinDir, PinError, PinnedBackends, PinnedHash},
};

pub use crate::pins::BPF_F_RDONLY;

mod lookup;
pub(crate) mod read;

use crate::codec::{FamilyAbi, Ipv4, Ipv6};

/// Opens a pinned BPF object read-only (`BPF_OBJ_GET` with `BPF_F_RDONLY`).
pub fn open_pinned_rdonly(path: &Path) -> io::Result<OwnedFd> {
    crate::pins::open_pinned(path, Access::ReadOnly)
}

/// A pin-directory error as `proxyctl` reports it (`Ok(None)`: not pinned).
fn from_pin<T>(pins: &PinDir, r: std::result::Result<T, PinError>) -> Result<Option<T>> {
    match r {
        Ok(v) => Ok(Some(v)),
        Err(PinError::Missing { .. }) => Ok(None),
        Err(e) => Err(pin_error(pins, e)),
    }
}

fn pin_error(pins: &PinDir, e: PinError) -> Error {
    match e {
        PinError::Missing { path } => no_pins(pins, &path),
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
    let pins = PinDir::new(path.parent().unwrap_or(Path::new("/")));
    let name = path
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_default();
    from_pin(&pins, pins.open_map(&name, Access::ReadOnly))
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

/// One family's service maps (`SVC`, `BACKEND`, `REVNAT`; `NODE_ADDRS` and `SRC_RANGE`
/// when pinned), read by the generic readers of `read.rs`.
struct FamilyMaps<F: FamilyAbi> {
    svc: PinnedHash<F::SvcKey, SvcEntry>,
    backend: PinnedBackends<F::Backend>,
    revnat: PinnedHash<u32, F::RevNat>,
    node: Option<HashMap<MapData, F::Addr, u8>>,
    src: Option<LpmTrie<MapData, F::SrcRange, u8>>,
}

impl<F: FamilyAbi> FamilyMaps<F> {
    /// Opens one family's maps read-only; an optional one that is not pinned joins
    /// `missing`.
    fn open(pins: &PinDir, missing: &mut BTreeSet<&'static str>) -> Result<Self> {
        let ro = Access::ReadOnly;
        let node = from_pin(pins, pins.typed(F::NODE_ADDRS, ro))?;
        if node.is_none() {
            missing.insert(F::NODE_ADDRS);
        }
        let src = from_pin(pins, pins.typed(F::SRC_RANGE, ro))?;
        if src.is_none() {
            missing.insert(F::SRC_RANGE);
        }
        Ok(Self {
            svc: pins.hash(F::SVC, ro).map_err(|e| pin_error(pins, e))?,
            backend: pins
                .backends(F::BACKEND, ro)
                .map_err(|e| pin_error(pins, e))?,
            revnat: pins.hash(F::REVNAT, ro).map_err(|e| pin_error(pins, e))?,
            node,
            src,
        })
    }
}

/// Every map `proxyctl` reads, opened read-only from one pin directory. The maps of the
/// TC datapath (conntrack, node addresses, source ranges) are optional: a datapath
/// without them still has its services shown.
pub struct Maps {
    dir: PathBuf,
    v4: FamilyMaps<Ipv4>,
    v6: FamilyMaps<Ipv6>,
    stats: PerCpuArray<MapData, u64>,
    xdp_stats: Option<PerCpuArray<MapData, u64>>,
    acceleration: u32,
    socket_lb: u64,
    socket_lb_bypassed: usize,
    conns: PerCpuHashMap<MapData, u32, u64>,
    conns_fd: OwnedFd,
    ct4: Option<HashMap<MapData, Ct4Key, Ct4Value>>,
    ct6: Option<HashMap<MapData, Ct6Key, Ct6Value>>,
    affinity: Option<HashMap<MapData, AffinityKey, AffinityValue>>,
    maglev: Option<HashMap<MapData, MaglevKey, MaglevChunk>>,
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
    /// Opens the maps of `pins` read-only, after checking the ABI version the loader
    /// stored in `META`.
    pub fn open(pins: &PinDir) -> Result<Self> {
        let ro = Access::ReadOnly;
        pins.check_abi(ro).map_err(|e| pin_error(pins, e))?;
        macro_rules! req {
            ($open:expr) => {
                $open.map_err(|e| pin_error(pins, e))?
            };
        }
        let mut missing = BTreeSet::new();
        macro_rules! opt {
            ($name:expr) => {{
                let m = from_pin(pins, pins.typed($name, ro))?;
                if m.is_none() {
                    missing.insert($name);
                }
                m
            }};
        }
        let ct4 = opt!(names::CT4);
        let ct6 = opt!(names::CT6);
        let affinity = opt!(names::AFFINITY);
        let xdp_stats = opt!(names::XDP_STATS);
        let maglev = opt!(names::MAGLEV);
        let acceleration = pins
            .read_meta(proxy_common::meta::ACCELERATION, ro)
            .unwrap_or(proxy_common::acceleration::OFF);
        // Pins of a build without `--socket-lb`: every socket is translated.
        let socket_lb = crate::socklb::get(pins.path())
            .ok()
            .flatten()
            .map_or(proxy_common::socket_lb::ALL, crate::socklb::SocketLb::value);
        let socket_lb_bypassed = crate::socklb::bypassed(pins).unwrap_or(0);
        let (conns, conns_fd) = req!(pins.typed_with_fd(names::BACKEND_CONNS, ro));
        Ok(Self {
            dir: pins.path().to_owned(),
            v4: FamilyMaps::open(pins, &mut missing)?,
            v6: FamilyMaps::open(pins, &mut missing)?,
            stats: req!(pins.typed(names::STATS, ro)),
            xdp_stats,
            acceleration,
            socket_lb,
            socket_lb_bypassed,
            conns,
            conns_fd,
            ct4,
            ct6,
            affinity,
            maglev,
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
            socket_lb: self.socket_lb,
            socket_lb_bypassed: self.socket_lb_bypassed,
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
}

fn no_pins(pins: &PinDir, missing: &Path) -> Error {
    let dir = pins.path();
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
