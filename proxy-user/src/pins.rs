//! The pin directory: its layout, its default path, the ABI check against `META`, and
//! opening its maps read-write (agent, loader, tests) or read-only (`proxyctl`). The one
//! place that knows how a pinned map is opened.
//!
//! Layout (see `loader` for the links):
//! - one file per map, named as in `proxy_common::map_names`;
//! - `META[meta::ABI_VERSION]`: the map ABI version of the programs that made the maps;
//! - `links/`: the pinned links (cgroup hooks, TCX) and clsact records.

use std::{
    io,
    os::fd::{AsFd as _, OwnedFd},
    path::{Path, PathBuf},
};

use aya::{
    maps::{Array, HashMap, Map, MapData, MapError},
    Pod,
};
use proxy_common::{map_names, meta, ABI_VERSION};

/// Default pin directory.
pub const DEFAULT_PIN_PATH: &str = "/sys/fs/bpf/ebpf-proxy";

/// Directory of the pinned links, under the pin directory.
pub const LINKS_DIR: &str = "links";

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

    /// `max_entries` of the pinned map `name`, if it is pinned.
    pub fn max_entries(&self, name: &str) -> Option<u32> {
        let fd = self.open_fd(name, Access::ReadOnly).ok()?;
        MapData::from_fd(fd)
            .ok()?
            .info()
            .ok()
            .map(|i| i.max_entries())
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
