//! `--forwarding-mode`: how the TC path forwards external traffic (eTP=Cluster) to a
//! backend on another node, written to `FWD_MODE[0]` for the programs
//! (`proxy-ebpf/src/tc/dsr/`).

use aya::maps::{Array, MapData};
use proxy_common::{fwd_mode, map_names};

use crate::pins::{Access, PinDir, PinError};

/// The forwarding mode of the TC path for external traffic to a remote backend.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, clap::ValueEnum)]
pub enum ForwardingMode {
    /// Source NAT to the node's address: replies come back through this node.
    #[default]
    Snat,
    /// Direct server return for TCP and UDP, IPv4 and IPv6: the backend's node replies
    /// straight to the client with the frontend as source.
    Dsr,
    /// DSR for TCP, SNAT for UDP.
    Hybrid,
}

impl ForwardingMode {
    /// The `FWD_MODE[0]` value.
    pub fn value(self) -> u32 {
        match self {
            Self::Snat => fwd_mode::SNAT,
            Self::Dsr => fwd_mode::DSR,
            Self::Hybrid => fwd_mode::HYBRID,
        }
    }

    /// The mode of a `FWD_MODE[0]` value (`None`: unknown).
    pub fn from_value(v: u32) -> Option<Self> {
        match v {
            fwd_mode::SNAT => Some(Self::Snat),
            fwd_mode::DSR => Some(Self::Dsr),
            fwd_mode::HYBRID => Some(Self::Hybrid),
            _ => None,
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            Self::Snat => "snat",
            Self::Dsr => "dsr",
            Self::Hybrid => "hybrid",
        }
    }
}

/// Writes the mode to the pinned `FWD_MODE` map of `pins`.
pub fn set(pins: &PinDir, mode: ForwardingMode) -> Result<(), PinError> {
    let mut map: Array<MapData, u32> = pins.typed(map_names::FWD_MODE, Access::ReadWrite)?;
    map.set(0, mode.value(), 0).map_err(|source| PinError::Map {
        path: pins.map_path(map_names::FWD_MODE),
        source,
    })
}

/// Reads the mode from the pinned `FWD_MODE` map (`Ok(None)`: an unknown value).
pub fn get(pins: &PinDir) -> Result<Option<ForwardingMode>, PinError> {
    let map: Array<MapData, u32> = pins.typed(map_names::FWD_MODE, Access::ReadOnly)?;
    let v = map.get(&0, 0).map_err(|source| PinError::Map {
        path: pins.map_path(map_names::FWD_MODE),
        source,
    })?;
    Ok(ForwardingMode::from_value(v))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn values_round_trip_and_snat_is_zero() {
        for m in [
            ForwardingMode::Snat,
            ForwardingMode::Dsr,
            ForwardingMode::Hybrid,
        ] {
            assert_eq!(ForwardingMode::from_value(m.value()), Some(m));
        }
        // An empty (new) FWD_MODE map means SNAT, today's behaviour.
        assert_eq!(ForwardingMode::from_value(0), Some(ForwardingMode::Snat));
        assert_eq!(ForwardingMode::default(), ForwardingMode::Snat);
        assert_eq!(ForwardingMode::from_value(7), None);
    }
}
