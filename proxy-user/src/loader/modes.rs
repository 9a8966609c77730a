//! The attach modes: how the TC programs are attached (`--tc-attach`) and whether XDP runs
//! ahead of them (`--acceleration`).

use aya::programs::XdpMode;
use proxy_common::acceleration;

/// How the TC programs are attached to the interfaces.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, clap::ValueEnum)]
pub enum TcAttachMode {
    /// TCX when the kernel is >= 6.6, clsact otherwise.
    #[default]
    Auto,
    /// TCX links (kernel >= 6.6), pinned as `links/tc-<iface>-<dir>`.
    Tcx,
    /// Netlink filters in the interface's clsact qdisc (added if missing), with the
    /// reserved priority/handle; recorded by the program pinned as
    /// `links/tc-<iface>-<dir>-clsact`.
    Clsact,
}

impl TcAttachMode {
    /// `Tcx` or `Clsact`: what `Auto` means on this kernel.
    pub fn resolve(self) -> Self {
        match self {
            Self::Auto if tcx_supported() => Self::Tcx,
            Self::Auto => Self::Clsact,
            other => other,
        }
    }
}

impl std::fmt::Display for TcAttachMode {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Self::Auto => "auto",
            Self::Tcx => "tcx",
            Self::Clsact => "clsact",
        })
    }
}

/// `--acceleration`: whether north-south traffic is handled at XDP, ahead of TC, on the
/// same interfaces.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, clap::ValueEnum)]
pub enum Acceleration {
    /// TC only.
    #[default]
    Off,
    /// XDP in generic (skb) mode: works on every interface, after the skb is built.
    Generic,
    /// XDP in the driver (native mode); an interface whose driver cannot is an error.
    Native,
}

impl Acceleration {
    /// Its `META[ACCELERATION]` value.
    pub fn meta(self) -> u32 {
        match self {
            Self::Off => acceleration::OFF,
            Self::Generic => acceleration::GENERIC,
            Self::Native => acceleration::NATIVE,
        }
    }

    /// From `META[ACCELERATION]` (unknown values read as off).
    pub fn from_meta(v: u32) -> Self {
        match v {
            acceleration::GENERIC => Self::Generic,
            acceleration::NATIVE => Self::Native,
            _ => Self::Off,
        }
    }

    pub(super) fn xdp_mode(self) -> XdpMode {
        match self {
            Self::Native => XdpMode::Driver,
            _ => XdpMode::Skb,
        }
    }
}

impl std::fmt::Display for Acceleration {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Self::Off => "off",
            Self::Generic => "generic",
            Self::Native => "native",
        })
    }
}

pub(super) fn tcx_supported() -> bool {
    aya::util::KernelVersion::current().is_ok_and(|v| v >= aya::util::KernelVersion::new(6, 6, 0))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn attach_mode_resolves_to_tcx_or_clsact() {
        assert_eq!(TcAttachMode::Tcx.resolve(), TcAttachMode::Tcx);
        assert_eq!(TcAttachMode::Clsact.resolve(), TcAttachMode::Clsact);
        let auto = TcAttachMode::Auto.resolve();
        assert_eq!(
            auto,
            if tcx_supported() {
                TcAttachMode::Tcx
            } else {
                TcAttachMode::Clsact
            }
        );
        assert_eq!(TcAttachMode::default(), TcAttachMode::Auto);
    }
}
