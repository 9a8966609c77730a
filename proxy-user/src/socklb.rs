//! `--socket-lb`: which sockets the socket hooks translate (`SOCK_LB`), and the per-pod
//! bypass (`SOCK_LB_BYPASS`: cgroup ids whose sockets they leave alone, so their traffic
//! reaches the frontend itself and is translated per packet on the pod's interface, where
//! a service mesh sees the ClusterIP).

use std::{io, os::unix::fs::MetadataExt as _, path::Path};

use aya::maps::{Array, HashMap, MapData};
use proxy_common::{map_names, socket_lb};

use crate::pins::{Access, PinDir, PinError};

/// `--socket-lb`.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, clap::ValueEnum)]
pub enum SocketLb {
    /// Every socket, TCP and UDP, pods and host.
    All,
    /// TCP everywhere; UDP in the host's network namespace only: pods' UDP (a connected
    /// socket too) goes per packet on the pod's interface, so it follows a backend
    /// change and is never destroyed.
    #[default]
    Tcp,
    /// Only sockets in the host's network namespace; pods go per packet.
    HostOnly,
    /// None: every pod goes per packet (host processes are not translated).
    Off,
}

impl SocketLb {
    /// The `SOCK_LB[MODE]` value.
    pub fn value(self) -> u64 {
        match self {
            Self::All => socket_lb::ALL,
            Self::Tcp => socket_lb::TCP,
            Self::HostOnly => socket_lb::HOST_ONLY,
            Self::Off => socket_lb::OFF,
        }
    }

    pub fn from_value(v: u64) -> Option<Self> {
        [Self::All, Self::Tcp, Self::HostOnly, Self::Off]
            .into_iter()
            .find(|m| m.value() == v)
    }

    pub fn name(self) -> &'static str {
        match self {
            Self::All => "all",
            Self::Tcp => "tcp",
            Self::HostOnly => "host-only",
            Self::Off => "off",
        }
    }
}

/// The calling thread's network namespace cookie (`SO_NETNS_COOKIE`, kernel >= 5.14).
pub fn own_netns_cookie() -> io::Result<u64> {
    let sock = std::net::UdpSocket::bind("127.0.0.1:0")
        .or_else(|_| std::net::UdpSocket::bind("[::1]:0"))?;
    let mut cookie: u64 = 0;
    let mut len = std::mem::size_of::<u64>() as libc::socklen_t;
    // SAFETY: a valid socket and buffer of `len` bytes.
    let r = unsafe {
        libc::getsockopt(
            std::os::fd::AsRawFd::as_raw_fd(&sock),
            libc::SOL_SOCKET,
            libc::SO_NETNS_COOKIE,
            &mut cookie as *mut u64 as *mut libc::c_void,
            &mut len,
        )
    };
    if r < 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(cookie)
}

/// Writes the mode and `host_netns` (the host's network namespace cookie) to `SOCK_LB`.
pub fn set(pins: impl Into<PinDir>, mode: SocketLb, host_netns: u64) -> Result<(), PinError> {
    let pins = pins.into();
    let mut map: Array<MapData, u64> = pins.typed(map_names::SOCK_LB, Access::ReadWrite)?;
    let err = |source| PinError::Map {
        path: pins.map_path(map_names::SOCK_LB),
        source,
    };
    // The cookie first: a mode that needs it never reads it unset.
    map.set(socket_lb::HOST_NETNS, host_netns, 0).map_err(err)?;
    map.set(socket_lb::MODE, mode.value(), 0).map_err(err)
}

/// Reads the mode from `SOCK_LB` (`Ok(None)`: an unknown value).
pub fn get(pins: impl Into<PinDir>) -> Result<Option<SocketLb>, PinError> {
    let pins = pins.into();
    let map: Array<MapData, u64> = pins.typed(map_names::SOCK_LB, Access::ReadOnly)?;
    let v = map
        .get(&socket_lb::MODE, 0)
        .map_err(|source| PinError::Map {
            path: pins.map_path(map_names::SOCK_LB),
            source,
        })?;
    Ok(SocketLb::from_value(v))
}

/// The id of the cgroup v2 directory `dir` (its inode number, what
/// `bpf_get_current_cgroup_id` returns for a task in it).
pub fn cgroup_id(dir: &Path) -> io::Result<u64> {
    Ok(std::fs::metadata(dir)?.ino())
}

/// Adds (`bypass` true) or removes a cgroup id in `SOCK_LB_BYPASS`: the socket hooks
/// leave that cgroup's sockets alone (a removed id that was not there is fine).
pub fn set_bypass(pins: impl Into<PinDir>, cgroup: u64, bypass: bool) -> Result<(), PinError> {
    let pins = pins.into();
    let mut map: HashMap<MapData, u64, u8> =
        pins.typed(map_names::SOCK_LB_BYPASS, Access::ReadWrite)?;
    let r = if bypass {
        map.insert(cgroup, 1, 0)
    } else {
        match map.remove(&cgroup) {
            Err(aya::maps::MapError::KeyNotFound) => Ok(()),
            other => other,
        }
    };
    r.map_err(|source| PinError::Map {
        path: pins.map_path(map_names::SOCK_LB_BYPASS),
        source,
    })
}

/// How many cgroups are in `SOCK_LB_BYPASS` (the levels entry not counted); `Ok(0)` for
/// pins without the map.
pub fn bypassed(pins: &PinDir) -> Result<usize, PinError> {
    let map: HashMap<MapData, u64, u8> =
        match pins.typed(map_names::SOCK_LB_BYPASS, Access::ReadOnly) {
            Ok(m) => m,
            Err(PinError::Missing { .. }) => return Ok(0),
            Err(e) => return Err(e),
        };
    Ok(map
        .keys()
        .filter_map(Result::ok)
        .filter(|k| *k != socket_lb::BYPASS_LEVELS)
        .count())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn values_round_trip_and_all_is_zero() {
        for m in [
            SocketLb::All,
            SocketLb::Tcp,
            SocketLb::HostOnly,
            SocketLb::Off,
        ] {
            assert_eq!(SocketLb::from_value(m.value()), Some(m));
        }
        // An empty (new) SOCK_LB map reads as `all`: what the hooks did before the flag.
        assert_eq!(SocketLb::from_value(0), Some(SocketLb::All));
        assert_eq!(SocketLb::from_value(9), None);
    }
}
