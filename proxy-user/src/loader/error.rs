//! [`LoadError`]: what loading, attaching or removing the datapath can fail with.

use std::{
    io,
    path::{Path, PathBuf},
};

/// Loading or removing the datapath failed.
#[derive(Debug, thiserror::Error)]
pub enum LoadError {
    #[error(
        "{path} is not on a bpf filesystem: mount one with `mount -t bpf bpf /sys/fs/bpf` \
             (or run `cargo xtask setup`)"
    )]
    NotBpffs { path: PathBuf },
    #[error(
        "this binary was built without the eBPF object (bpf-linker was missing): \
             run `cargo xtask build`"
    )]
    NoObject,
    #[error("{what} {path}: {source}")]
    Io {
        what: &'static str,
        path: PathBuf,
        #[source]
        source: io::Error,
    },
    #[error(transparent)]
    Open(#[from] crate::pins::PinError),
    #[error("loading the eBPF object: {0}")]
    Ebpf(#[from] aya::EbpfError),
    #[error("program {name}: {source}")]
    Program {
        name: &'static str,
        #[source]
        source: aya::programs::ProgramError,
    },
    #[error("map {name}: {source}")]
    Map {
        name: &'static str,
        #[source]
        source: aya::maps::MapError,
    },
    #[error("pinning {path}: {source}")]
    Pin {
        path: PathBuf,
        #[source]
        source: aya::pin::PinError,
    },
    #[error("attaching {what}: {source}")]
    Attach {
        what: String,
        #[source]
        source: aya::programs::ProgramError,
    },
    #[error(
        "conntrack size {flows} flows is out of range ({}..={} flows per address family)",
        proxy_common::limits::CT_FLOWS_MIN,
        proxy_common::limits::CT_FLOWS_MAX
    )]
    ConntrackSize { flows: u32 },
    #[error(
        "service map size {entries} entries is out of range ({}..={} frontend and slot \
         entries per address family)",
        proxy_common::limits::SVC_ENTRIES_MIN,
        proxy_common::limits::SVC_ENTRIES_MAX
    )]
    ServiceMapSize { entries: u32 },
    #[error(
        "TC attach mode tcx needs kernel >= 6.6: use `--tc-attach auto` or `--tc-attach clsact`"
    )]
    TcxUnsupported,
    #[error(
        "native XDP (driver mode) is not available on interface {iface}: {source}; \
         use `--acceleration generic` (or `off`)"
    )]
    XdpNative {
        iface: String,
        #[source]
        source: aya::programs::ProgramError,
    },
    #[error("pinned link {path}: {source}")]
    Link {
        path: PathBuf,
        #[source]
        source: aya::programs::links::LinkError,
    },
}

pub(super) fn io_err(what: &'static str, path: &Path) -> impl FnOnce(io::Error) -> LoadError {
    let path = path.to_owned();
    move |source| LoadError::Io { what, path, source }
}
