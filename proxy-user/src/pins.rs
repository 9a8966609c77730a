//! The pin directory: its layout, its default path, the ABI check against `META`, and
//! opening its maps read-write (agent, loader, migration, tests) or read-only
//! (`proxyctl`). The one way to a pinned object: it owns the layout, reads and writes
//! `META`, reads a map's `max_entries`, and makes and parses the link pin names
//! ([`LinkPin`]). Functions that work on a pin directory take a `&PinDir`.
//!
//! Layout (see `loader` for the links):
//! - one file per map, named as in `proxy_common::map_names`;
//! - `META[meta::ABI_VERSION]`: the map ABI version of the programs that made the maps;
//! - `links/`: the pinned links (cgroup hooks, TCX, XDP) and clsact records ([`LinkPin`]);
//! - `migrate-staging/`: a layout migration's new maps (itself a pin directory, with its
//!   marker), see `migrate`.

use std::{
    io,
    os::fd::{AsFd as _, OwnedFd},
    path::{Path, PathBuf},
};

use aya::{
    maps::{Array, HashMap, Map, MapData, MapError},
    Pod,
};
use proxy_common::{map_names, meta, prog_names, ABI_VERSION};

/// Default pin directory.
pub const DEFAULT_PIN_PATH: &str = "/sys/fs/bpf/ebpf-proxy";

/// Directory of the pinned links, under the pin directory.
pub const LINKS_DIR: &str = "links";

/// Where a layout migration builds the new maps, inside the pin directory (same bpffs
/// mount, so the pins can be renamed into place); see `migrate/`.
pub const MIGRATE_STAGING_DIR: &str = "migrate-staging";

/// The cgroup hooks, by program name ([`prog_names::SOCK`]: the function names in
/// `proxy-ebpf/src/sock.rs`); each one's link is pinned under this name.
pub const SOCK_PROGRAMS: [&str; 8] = prog_names::SOCK;

/// Prefix of the pinned XDP links (`links/xdp-<iface>`).
pub const XDP_PIN_PREFIX: &str = "xdp-";

/// Suffix of the pin that records a clsact filter (`links/tc-<iface>-<dir>-clsact`; not
/// `.clsact`: bpffs refuses names with a dot).
pub const CLSACT_SUFFIX: &str = "-clsact";

/// A pin under `links/`; its name is made ([`Self::name`]) and read ([`Self::parse`])
/// only here.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum LinkPin {
    /// A cgroup socket hook's link, named as its program ([`SOCK_PROGRAMS`]).
    Sock(&'static str),
    /// A TC hook: the TCX link `tc-<iface>-<ingress|egress>`, or with `clsact` the record
    /// of a clsact filter (a pinned program, `tc-<iface>-<dir>-clsact`).
    Tc {
        iface: String,
        ingress: bool,
        clsact: bool,
    },
    /// An XDP link, `xdp-<iface>`.
    Xdp { iface: String },
}

impl LinkPin {
    /// Its file name under `links/`.
    pub fn name(&self) -> String {
        match self {
            LinkPin::Sock(name) => name.to_string(),
            LinkPin::Tc {
                iface,
                ingress,
                clsact,
            } => format!(
                "tc-{iface}-{}{}",
                if *ingress { "ingress" } else { "egress" },
                if *clsact { CLSACT_SUFFIX } else { "" }
            ),
            LinkPin::Xdp { iface } => format!("{XDP_PIN_PREFIX}{iface}"),
        }
    }

    /// Reads a file name under `links/`; `None` for a name this project does not make.
    pub fn parse(name: &str) -> Option<Self> {
        if let Some(p) = SOCK_PROGRAMS.iter().find(|p| **p == name) {
            return Some(LinkPin::Sock(p));
        }
        if let Some(iface) = name.strip_prefix(XDP_PIN_PREFIX) {
            return (!iface.is_empty()).then(|| LinkPin::Xdp {
                iface: iface.to_string(),
            });
        }
        let rest = name.strip_prefix("tc-")?;
        let (rest, clsact) = match rest.strip_suffix(CLSACT_SUFFIX) {
            Some(r) => (r, true),
            None => (rest, false),
        };
        let (iface, ingress) = if let Some(i) = rest.strip_suffix("-ingress") {
            (i, true)
        } else {
            (rest.strip_suffix("-egress")?, false)
        };
        Some(LinkPin::Tc {
            iface: iface.to_string(),
            ingress,
            clsact,
        })
    }

    /// The program the pinned link (or clsact record) runs.
    pub fn program(&self) -> &'static str {
        match self {
            LinkPin::Sock(name) => name,
            LinkPin::Tc { ingress: true, .. } => prog_names::TC_INGRESS,
            LinkPin::Tc { ingress: false, .. } => prog_names::TC_EGRESS,
            LinkPin::Xdp { .. } => prog_names::XDP_INGRESS,
        }
    }
}

/// `BPF_F_RDONLY`: the returned descriptor only allows lookups.
pub const BPF_F_RDONLY: u32 = bpf_sys::F_RDONLY;

/// How a pinned map is opened.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Access {
    /// Lookups, updates and deletes.
    ReadWrite,
    /// Lookups only (`BPF_F_RDONLY`): the kernel refuses writes through the descriptor
    /// (EPERM), so a reader can never change what the datapath does.
    ReadOnly,
}

/// Opening a pinned map failed.
#[derive(Debug, thiserror::Error)]
pub enum PinError {
    #[error("no pinned map {path}: is proxy-agent installed with this --pin-path?")]
    Missing { path: PathBuf },
    #[error("pinned map {path}: permission denied (run as root or with CAP_BPF)")]
    Permission { path: PathBuf },
    #[error("pinned map {path}: {source}")]
    Open {
        path: PathBuf,
        #[source]
        source: io::Error,
    },
    #[error("pinned map {path}: {source}")]
    Map {
        path: PathBuf,
        #[source]
        source: MapError,
    },
    #[error(
        "pinned maps at {dir} have ABI version {found}, this binary speaks {expected}: \
             uninstall the old datapath first (proxy-agent uninstall)"
    )]
    Abi {
        dir: PathBuf,
        found: u32,
        expected: u32,
    },
}

/// Opens a pinned BPF object (`BPF_OBJ_GET`, with `BPF_F_RDONLY` for [`Access::ReadOnly`]).
pub fn open_pinned(path: &Path, access: Access) -> io::Result<OwnedFd> {
    bpf_sys::obj_get(
        path,
        match access {
            Access::ReadWrite => 0,
            Access::ReadOnly => BPF_F_RDONLY,
        },
    )
}

/// One pin directory.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PinDir {
    path: PathBuf,
}

impl PinDir {
    pub fn new(path: impl Into<PathBuf>) -> Self {
        Self { path: path.into() }
    }

    /// The directory.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// The file of map `name`.
    pub fn map_path(&self, name: &str) -> PathBuf {
        self.path.join(name)
    }

    /// The directory of the pinned links.
    pub fn links(&self) -> PathBuf {
        self.path.join(LINKS_DIR)
    }

    /// The file of link pin `name` under `links/`.
    pub fn link_path(&self, name: &str) -> PathBuf {
        self.links().join(name)
    }

    /// The pin names under `links/` this project makes ([`LinkPin::parse`]), with their
    /// file names; none when `links/` does not exist.
    pub fn link_pins(&self) -> io::Result<Vec<(String, LinkPin)>> {
        let mut pins = Vec::new();
        match std::fs::read_dir(self.links()) {
            Ok(entries) => {
                for e in entries {
                    let name = e?.file_name().to_string_lossy().into_owned();
                    if let Some(p) = LinkPin::parse(&name) {
                        pins.push((name, p));
                    }
                }
            }
            Err(e) if e.kind() == io::ErrorKind::NotFound => {}
            Err(e) => return Err(e),
        }
        Ok(pins)
    }

    /// Opens the pinned link (or clsact record) `name` under `links/` (`BPF_OBJ_GET`;
    /// links refuse `BPF_F_RDONLY`).
    pub fn open_link(&self, name: &str) -> io::Result<OwnedFd> {
        bpf_sys::obj_get(&self.link_path(name), 0)
    }

    /// The staging pin directory of a layout migration, inside this one.
    pub fn staging(&self) -> PinDir {
        PinDir::new(self.path.join(MIGRATE_STAGING_DIR))
    }

    /// Whether maps were pinned here (`META` exists).
    pub fn has_maps(&self) -> bool {
        self.map_path(map_names::META).exists()
    }

    /// Opens map `name` as a descriptor.
    pub fn open_fd(&self, name: &str, access: Access) -> Result<OwnedFd, PinError> {
        let path = self.map_path(name);
        open_pinned(&path, access).map_err(|source| match source.raw_os_error() {
            Some(libc::ENOENT) => PinError::Missing { path },
            Some(libc::EACCES) | Some(libc::EPERM) => PinError::Permission { path },
            _ => PinError::Open { path, source },
        })
    }

    /// Opens map `name` as an aya [`Map`].
    pub fn open_map(&self, name: &str, access: Access) -> Result<Map, PinError> {
        let fd = self.open_fd(name, access)?;
        let map_err = |source| PinError::Map {
            path: self.map_path(name),
            source,
        };
        let data = MapData::from_fd(fd).map_err(map_err)?;
        Map::from_map_data(data).map_err(map_err)
    }

    /// Opens map `name` as a typed aya map (key and value sizes checked).
    pub fn typed<T: TryFrom<Map, Error = MapError>>(
        &self,
        name: &str,
        access: Access,
    ) -> Result<T, PinError> {
        T::try_from(self.open_map(name, access)?).map_err(|source| PinError::Map {
            path: self.map_path(name),
            source,
        })
    }

    /// [`Self::typed`], plus a second descriptor of the same map (for the batch calls,
    /// which aya 0.14 has no API for).
    pub fn typed_with_fd<T: TryFrom<Map, Error = MapError>>(
        &self,
        name: &str,
        access: Access,
    ) -> Result<(T, OwnedFd), PinError> {
        let fd = self.open_fd(name, access)?;
        let path = self.map_path(name);
        let dup = fd.try_clone().map_err(|source| PinError::Open {
            path: path.clone(),
            source,
        })?;
        let map_err = |source| PinError::Map {
            path: path.clone(),
            source,
        };
        let data = MapData::from_fd(dup).map_err(map_err)?;
        let typed = T::try_from(Map::from_map_data(data).map_err(map_err)?).map_err(map_err)?;
        Ok((typed, fd))
    }

    /// Opens hash map `name` for one-element calls (aya) and batch calls.
    pub fn hash<K: Pod, V: Pod>(
        &self,
        name: &str,
        access: Access,
    ) -> Result<PinnedHash<K, V>, PinError> {
        let (map, fd) = self.typed_with_fd(name, access)?;
        Ok(PinnedHash { map, fd })
    }

    /// Opens backend array `name` (`BACKEND4/6`) for one-element and batch calls.
    pub fn backends<V: Pod>(
        &self,
        name: &str,
        access: Access,
    ) -> Result<PinnedBackends<V>, PinError> {
        let (map, fd) = self.typed_with_fd(name, access)?;
        Ok(PinnedBackends { map, fd })
    }

    /// Pins the map object `fd` (also) as `name` here (`BPF_OBJ_PIN`).
    pub fn pin_map(&self, name: &str, fd: std::os::fd::BorrowedFd<'_>) -> io::Result<()> {
        bpf_sys::obj_pin(fd, &self.map_path(name))
    }

    /// Type, sizes, flags and id of the pinned map `name` (`BPF_OBJ_GET_INFO_BY_FD`).
    pub fn map_info(&self, name: &str) -> Result<bpf_sys::MapInfo, PinError> {
        let fd = self.open_fd(name, Access::ReadOnly)?;
        bpf_sys::map_info(fd.as_fd()).map_err(|source| PinError::Open {
            path: self.map_path(name),
            source,
        })
    }

    /// `max_entries` of the pinned map `name`, if it is pinned.
    pub fn max_entries(&self, name: &str) -> Option<u32> {
        self.map_info(name).ok().map(|i| i.max_entries)
    }

    /// Writes one `META` entry (the loader's and the migration's records).
    pub fn write_meta(&self, index: u32, value: u32) -> Result<(), PinError> {
        let path = self.map_path(map_names::META);
        let fd = self.open_fd(map_names::META, Access::ReadWrite)?;
        bpf_sys::map_update(
            fd.as_fd(),
            &index.to_ne_bytes(),
            &value.to_ne_bytes(),
            bpf_sys::ANY,
        )
        .map(drop)
        .map_err(|source| PinError::Open { path, source })
    }

    /// Reads one `META` entry.
    pub fn read_meta(&self, index: u32, access: Access) -> Result<u32, PinError> {
        let meta: Array<MapData, u32> = self.typed(map_names::META, access)?;
        meta.get(&index, 0).map_err(|source| PinError::Map {
            path: self.map_path(map_names::META),
            source,
        })
    }

    /// The ABI version the loader recorded in `META`.
    pub fn abi_version(&self, access: Access) -> Result<u32, PinError> {
        self.read_meta(meta::ABI_VERSION, access)
    }

    /// Fails unless `META` holds this binary's ABI version: maps of another layout would
    /// be misread.
    pub fn check_abi(&self, access: Access) -> Result<(), PinError> {
        let found = self.abi_version(access)?;
        if found != ABI_VERSION {
            return Err(PinError::Abi {
                dir: self.path.clone(),
                found,
                expected: ABI_VERSION,
            });
        }
        Ok(())
    }
}

/// A directory path as a pin directory: for the entry points that are handed the
/// `--pin-path` flag's value (the agent's, `proxyctl`'s, the tests').
impl From<&Path> for PinDir {
    fn from(path: &Path) -> Self {
        Self::new(path)
    }
}

impl From<&PathBuf> for PinDir {
    fn from(path: &PathBuf) -> Self {
        Self::new(path)
    }
}

impl From<PathBuf> for PinDir {
    fn from(path: PathBuf) -> Self {
        Self::new(path)
    }
}

impl From<&PinDir> for PinDir {
    fn from(pins: &PinDir) -> Self {
        pins.clone()
    }
}

/// A pinned hash map: the typed aya map for one-element calls, and a descriptor of the
/// same map for the batch calls (`crate::batch`).
pub struct PinnedHash<K, V> {
    pub map: HashMap<MapData, K, V>,
    pub fd: OwnedFd,
}

impl<K: Pod, V: Pod> PinnedHash<K, V> {
    /// Every entry: by batch lookups, else (a kernel or map type without them) key by key.
    pub fn read_all(&self) -> Result<Vec<(K, V)>, MapError> {
        match crate::batch::lookup::<K, V>(self.fd.as_fd()) {
            Ok(v) => Ok(v),
            Err(e) => {
                tracing::debug!(error = %e, "batch lookup failed; iterating key by key");
                self.map.iter().collect()
            }
        }
    }
}

/// A `BACKEND4`/`BACKEND6` value: the maps are arrays indexed by backend id, where the
/// entry of a free id is [`Self::FREE`] (protocol 0).
pub trait BackendEntry: Pod + PartialEq {
    /// The entry of a free id (never written, or freed: what "deleting" writes).
    const FREE: Self;
    /// Whether the id holds a backend (the datapath's test too).
    fn in_use(&self) -> bool;
}

impl BackendEntry for proxy_common::Backend4 {
    const FREE: Self = Self::FREE;
    fn in_use(&self) -> bool {
        Self::in_use(self)
    }
}

impl BackendEntry for proxy_common::Backend6 {
    const FREE: Self = Self::FREE;
    fn in_use(&self) -> bool {
        Self::in_use(self)
    }
}

/// A pinned backend array (`BACKEND4/6`): the typed aya array for one-element calls, and
/// a descriptor of the same map for the batch calls. Reads skip the free ids.
pub struct PinnedBackends<V: Pod> {
    pub map: Array<MapData, V>,
    pub fd: OwnedFd,
}

impl<V: BackendEntry> PinnedBackends<V> {
    /// The backend of id `id`: `None` for a free id or one past the array's end.
    pub fn get(&self, id: u32) -> Result<Option<V>, MapError> {
        match self.map.get(&id, 0) {
            Ok(v) => Ok(v.in_use().then_some(v)),
            Err(MapError::OutOfBounds { .. }) => Ok(None),
            Err(e) => Err(e),
        }
    }

    /// Every id in use with its backend: by batch lookups, else index by index.
    pub fn read_all(&self) -> Result<Vec<(u32, V)>, MapError> {
        // The free ids left out as they are read: an array sized for growth is mostly free.
        match crate::batch::lookup_where::<u32, V>(self.fd.as_fd(), |_, v| v.in_use()) {
            Ok(v) => Ok(v),
            Err(e) => {
                tracing::debug!(error = %e, "batch lookup failed; reading index by index");
                let mut out = Vec::new();
                for (id, v) in self.map.iter().enumerate() {
                    let v = v?;
                    if v.in_use() {
                        out.push((id as u32, v));
                    }
                }
                Ok(out)
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn link_pin_names_parse_back_and_foreign_names_do_not() {
        let mut pins: Vec<LinkPin> = SOCK_PROGRAMS.iter().map(|p| LinkPin::Sock(p)).collect();
        for (iface, ingress, clsact) in [
            ("eth0", true, false),
            ("eth0", false, true),
            ("br-ex-egress", true, true),
        ] {
            pins.push(LinkPin::Tc {
                iface: iface.into(),
                ingress,
                clsact,
            });
        }
        pins.push(LinkPin::Xdp {
            iface: "veth-1".into(),
        });
        for p in pins {
            let name = p.name();
            assert!(!name.contains('.'), "bpffs refuses dots: {name}");
            assert_eq!(LinkPin::parse(&name), Some(p));
        }
        for foreign in [
            "SVC4",
            "xdp-",
            "tc-eth0-sideways",
            "tc-eth0-sideways-clsact",
        ] {
            assert_eq!(LinkPin::parse(foreign), None, "{foreign}");
        }
        assert_eq!(
            LinkPin::parse("tc-eth0-egress-clsact").map(|p| p.program()),
            Some(prog_names::TC_EGRESS)
        );
    }
}
