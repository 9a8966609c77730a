//! Map sizes and memory: the conntrack size (`--conntrack-max`) and each pinned map's
//! kernel memory.

use std::fs;

use crate::pins::{Access, PinDir};
use proxy_common::map_names;

use super::error::LoadError;

/// Default conntrack size in flows per family (`--conntrack-max`).
pub const DEFAULT_CONNTRACK_FLOWS: u32 = proxy_common::limits::MAX_CT / 2;

/// Map entries for `flows` conntrack flows, checked against the accepted range.
pub fn conntrack_entries(flows: u32) -> Result<u32, LoadError> {
    use proxy_common::limits::{CT_FLOWS_MAX, CT_FLOWS_MIN};
    if !(CT_FLOWS_MIN..=CT_FLOWS_MAX).contains(&flows) {
        return Err(LoadError::ConntrackSize { flows });
    }
    Ok(flows * 2)
}

/// Default `max_entries` of `SVC4`/`SVC6` (`--service-map-entries`).
pub const DEFAULT_SERVICE_ENTRIES: u32 = proxy_common::limits::MAX_SVC_ENTRIES;

/// `max_entries` of `SVC4`/`SVC6` when the agent creates them (or the ceiling, when
/// smaller): the maps grow online toward `--service-map-entries` before a sync whose
/// writes would not fit (`crate::writer`). 256 KiB of bucket array per family instead of
/// 16 MiB at the ceiling's default.
pub const SERVICE_START_ENTRIES: u32 = 1 << 14;

/// The service maps' size at a start: the pinned one (grown online) up to the ceiling
/// `--service-map-entries` (a larger pinned map is shrunk to it at the start, when its
/// entries fit), else [`SERVICE_START_ENTRIES`] up to the ceiling.
pub fn service_start_entries(pinned: Option<u32>, ceiling: u32) -> u32 {
    pinned.unwrap_or(SERVICE_START_ENTRIES).min(ceiling)
}

/// `--service-map-entries` checked against the accepted range.
pub fn service_entries(entries: u32) -> Result<u32, LoadError> {
    use proxy_common::limits::{SVC_ENTRIES_MAX, SVC_ENTRIES_MIN};
    if !(SVC_ENTRIES_MIN..=SVC_ENTRIES_MAX).contains(&entries) {
        return Err(LoadError::ServiceMapSize { entries });
    }
    Ok(entries)
}

/// Kernel memory of one pinned map.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct MapMemory {
    /// Its name (`proxy_common::map_names`).
    pub name: &'static str,
    /// Its `max_entries`.
    pub max_entries: u32,
    /// The `memlock:` figure of its fdinfo: the kernel's own count of the map's memory
    /// (`bpf_map_memory_usage`). Preallocated maps (the LRU tables, arrays) hold all of
    /// it from creation; `BPF_F_NO_PREALLOC` hash maps grow with their entries. It is
    /// charged to the memory cgroup of the process that created the map, for as long as
    /// the map exists (pinned: until `uninstall`).
    pub bytes: u64,
}

/// The memory of every map pinned in `pins` (maps that are not there are left out),
/// read from the kernel: `/proc/self/fdinfo/<fd>`'s `memlock:` line.
pub fn map_memory(pins: impl Into<PinDir>) -> Vec<MapMemory> {
    use std::os::fd::{AsFd, AsRawFd};
    let pins = pins.into();
    map_names::ALL
        .iter()
        .filter_map(|&name| {
            let map = pins.open_fd(name, Access::ReadOnly).ok()?;
            let max_entries = bpf_sys::map_info(map.as_fd()).ok()?.max_entries;
            let fd = map.as_raw_fd();
            let fdinfo = fs::read_to_string(format!("/proc/self/fdinfo/{fd}")).ok()?;
            let bytes = fdinfo_memlock(&fdinfo)?;
            Some(MapMemory {
                name,
                max_entries,
                bytes,
            })
        })
        .collect()
}

/// The `memlock:` value of a BPF map's fdinfo.
fn fdinfo_memlock(fdinfo: &str) -> Option<u64> {
    fdinfo
        .lines()
        .find_map(|l| l.strip_prefix("memlock:"))
        .and_then(|v| v.trim().parse().ok())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn conntrack_size_is_two_entries_per_flow_within_range() {
        assert_eq!(
            conntrack_entries(DEFAULT_CONNTRACK_FLOWS).ok(),
            Some(1 << 18)
        );
        assert_eq!(conntrack_entries(64).ok(), Some(128));
        for bad in [0, 63, (1 << 23) + 1] {
            let err = conntrack_entries(bad).expect_err("out of range");
            assert_eq!(
                err.to_string(),
                format!(
                    "conntrack size {bad} flows is out of range (64..=8388608 flows per \
                     address family)"
                )
            );
        }
    }

    #[test]
    fn memlock_is_read_from_a_map_fdinfo() {
        // As the kernel prints it (kernel/bpf/syscall.c, bpf_map_show_fdinfo).
        let fdinfo = "pos:\t0\nflags:\t02000002\nmnt_id:\t15\nino:\t1057\n\
                      map_type:\t9\nkey_size:\t16\nvalue_size:\t40\n\
                      max_entries:\t262144\nmap_flags:\t0x0\nmap_extra:\t0x0\n\
                      memlock:\t31458240\nmap_id:\t42\nfrozen:\t0\n";
        assert_eq!(fdinfo_memlock(fdinfo), Some(31_458_240));
        assert_eq!(fdinfo_memlock("pos:\t0\n"), None);
    }
}
