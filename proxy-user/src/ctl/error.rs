//! Why a `proxyctl` command failed, with the exit code each cause maps to.

use std::path::PathBuf;

/// Exit codes (documented in docs/proxyctl.md). clap itself exits with 2 on a usage error.
pub mod exit {
    /// Success.
    pub const OK: u8 = 0;
    /// Reading a map failed, or output could not be written.
    pub const FAILURE: u8 = 1;
    /// Bad arguments (clap's code; also used for an unparsable `explain` address).
    pub const USAGE: u8 = 2;
    /// Nothing pinned at the pin path (or what is there is not a pinned BPF object).
    pub const NO_PINS: u8 = 3;
    /// Permission denied (not root / no CAP_BPF).
    pub const PERMISSION: u8 = 4;
    /// The pinned maps have another ABI version or layout.
    pub const INCOMPATIBLE: u8 = 5;
}

/// A failed `proxyctl` command.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error(
        "no ebpf-proxy maps pinned ({missing} not found): is proxy-agent running? \
         looked in {dir} (set --pin-path or PROXY_PIN_PATH)",
        missing = missing.display(),
        dir = dir.display()
    )]
    NoPins { dir: PathBuf, missing: PathBuf },
    #[error(
        "{}: permission denied: run as root (reading BPF maps needs CAP_BPF or CAP_SYS_ADMIN)",
        path.display()
    )]
    Permission { path: PathBuf },
    /// The kernel answered EACCES to root because the path is not a pinned BPF object.
    #[error(
        "{}: {cause}: is --pin-path (PROXY_PIN_PATH) the agent's pin directory?",
        path.display()
    )]
    NotBpf { path: PathBuf, cause: String },
    #[error(
        "the maps in {} were created by an incompatible ebpf-proxy (map ABI version {found}, \
         this proxyctl reads version {expected}): use the proxyctl shipped with the running agent",
        dir.display()
    )]
    Abi {
        dir: PathBuf,
        found: u32,
        expected: u32,
    },
    #[error(
        "map {}: not the layout this proxyctl reads ({source}): the maps come from an \
         incompatible ebpf-proxy version",
        path.display()
    )]
    Layout {
        path: PathBuf,
        #[source]
        source: aya::maps::MapError,
    },
    #[error("opening map {}: {source}", path.display())]
    Open {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("reading map {map}: {source}")]
    Read {
        map: &'static str,
        #[source]
        source: aya::maps::MapError,
    },
    #[error("{0}")]
    Usage(String),
    /// Another `proxyctl monitor` reads the events.
    #[error("{0}")]
    Busy(String),
    #[error("writing output: {0}")]
    Output(#[from] std::io::Error),
}

impl Error {
    /// The process exit code for this error.
    pub fn exit_code(&self) -> u8 {
        match self {
            Error::NoPins { .. } | Error::NotBpf { .. } => exit::NO_PINS,
            Error::Permission { .. } => exit::PERMISSION,
            Error::Abi { .. } | Error::Layout { .. } => exit::INCOMPATIBLE,
            Error::Usage(_) => exit::USAGE,
            Error::Open { .. } | Error::Read { .. } | Error::Output(_) | Error::Busy(_) => {
                exit::FAILURE
            }
        }
    }
}

/// `Result` with [`Error`].
pub type Result<T, E = Error> = std::result::Result<T, E>;
