//! Conntrack sized to demand: the tables (`CT4`, `CT6`) start at `--conntrack-start`
//! (131,072 flows per family, kube-proxy's `conntrack.min`) and the running agent grows
//! them online toward the ceiling
//! (`--conntrack-max`, or kube-proxy's `conntrack.maxPerCore` x CPUs, at least
//! `conntrack.min`).
//!
//! Every [`CHECK_INTERVAL`] the agent counts the live entries of both tables ([`sample`]:
//! a `BPF_MAP_LOOKUP_BATCH` walk in chunks of [`CHUNK`] entries, an entry live while its
//! idle timeout has not passed, as the datapath judges it). When one table's live entries,
//! or those [`projected`] [`AHEAD`] intervals on at the last interval's growth (a fast
//! fill is met before the table is full: the next sample and the resize both take time),
//! pass [`HIGH_WATER_PERCENT`] of its size and the size is below the ceiling, both grow
//! x2 (at most to the ceiling) by the staged migration
//! ([`migrate::resize_conntrack`](crate::migrate::resize_conntrack): new tables, flows
//! copied, programs swapped with `BPF_LINK_UPDATE`, copied again, pins renamed; the same
//! crash marker as at a start). Both run on the blocking pool: `/healthz` and the sync
//! loop never wait for them. The tables are LRU: between two checks a burst beyond the
//! size evicts the least recently used flows (new flows are never refused), as before.
//!
//! When the fullest table's live entries stay under [`LOW_WATER_PERCENT`] of its size for
//! [`SHRINK_AFTER_SAMPLES`] samples in a row (five minutes), both are halved, never below
//! the start size, by the same migration (only live entries are copied; a shrink is
//! refused, size kept, while the live entries would not fit).
//!
//! Nothing in the agent keeps a conntrack map open: the writer holds the service maps
//! (shared, not copied, by a conntrack resize), and map memory, this sampler and
//! `proxyctl` open the pins afresh each time, so they follow the new tables.

use std::{io, os::fd::AsFd, time::Duration};

use aya::Pod;
use proxy_common::{ct_timeouts, map_names, Ct4Key, Ct4Value, Ct6Key, Ct6Value};

use crate::pins::{Access, PinDir};

/// Default start size in flows per family (`--conntrack-start`): kube-proxy's
/// `conntrack.min`, the smallest `nf_conntrack_max` kube-proxy ever sets, so a node never
/// starts with less room for flows than under kube-proxy. A smaller start (16,384 was the
/// default for a while) saves memory but is not a safe default: between two samples only
/// the table's room absorbs a burst, and a full LRU table evicts entries of live flows
/// (`cargo xtask bench`'s connections/s rounds at about 25,000 new connections a second
/// lost 2-16 connections a round to resets and timeouts through TC at 16,384, none at
/// 131,072).
pub const DEFAULT_START_FLOWS: u32 = 131_072;
/// A table whose live entries pass this share of its size grows.
pub const HIGH_WATER_PERCENT: u64 = 75;
/// How often the tables are sampled.
pub const CHECK_INTERVAL: Duration = Duration::from_secs(10);
/// Test hook: the sampling period in milliseconds instead of [`CHECK_INTERVAL`].
pub const CHECK_ENV: &str = "EBPF_PROXY_CONNTRACK_CHECK_MS";
/// Entries read per `BPF_MAP_LOOKUP_BATCH` call.
pub const CHUNK: u32 = 1024;

/// The sampling period: [`CHECK_ENV`] when set (a test), else [`CHECK_INTERVAL`].
pub fn check_interval() -> Duration {
    std::env::var(CHECK_ENV)
        .ok()
        .and_then(|v| v.parse::<u64>().ok())
        .filter(|ms| *ms > 0)
        .map_or(CHECK_INTERVAL, Duration::from_millis)
}

/// The size in flows per family the tables get at a start: the pinned size when it lies
/// between the start size and the ceiling (the tables grown online keep their size across
/// restarts), else the nearest bound; `start` (at most `max`) for new tables.
pub fn start_flows(pinned_entries: Option<u32>, start: u32, max: u32) -> u32 {
    let start = start.min(max);
    match pinned_entries {
        None => start,
        Some(entries) => (entries / 2).clamp(start, max),
    }
}

/// The live entries expected [`AHEAD`] samples after one with `live` when the one
/// before had `previous`: the last interval's growth, continued (never below `live`).
pub fn projected(live: u64, previous: u64) -> u64 {
    live + AHEAD * live.saturating_sub(previous)
}

/// How many sampling intervals ahead the growth is projected: the next sample, plus the
/// time the resize itself takes (well under an interval: 0.6-0.9 s measured for 4,096 to
/// 16,384 entries on a loaded 2-core machine, most of it loading the programs twice: with
/// the fallback to the replaced table, then without).
pub const AHEAD: u64 = 2;

/// The size in entries a table of `entries` grows to, below the ceiling `ceiling`
/// (entries), when `expected` live entries are expected ([`projected`]): x2, at most the
/// ceiling; `None` below the high-water mark or at the ceiling.
pub fn grown(entries: u32, expected: u64, ceiling: u32) -> Option<u32> {
    if entries >= ceiling || expected * 100 < u64::from(entries) * HIGH_WATER_PERCENT {
        return None;
    }
    Some(entries.saturating_mul(2).min(ceiling))
}

/// A table whose live entries stay under this share of its size for
/// [`SHRINK_AFTER_SAMPLES`] samples in a row is halved (toward the start size). Halved,
/// it is under twice that share (50 %), below [`HIGH_WATER_PERCENT`]: no grow-shrink
/// oscillation.
pub const LOW_WATER_PERCENT: u64 = 25;
/// Samples in a row under [`LOW_WATER_PERCENT`] before a shrink: 30, five minutes at the
/// default [`CHECK_INTERVAL`].
pub const SHRINK_AFTER_SAMPLES: u32 = 30;
/// Test hook: [`SHRINK_AFTER_SAMPLES`] replaced by this count.
pub const SHRINK_AFTER_ENV: &str = "EBPF_PROXY_CONNTRACK_SHRINK_AFTER";

/// Samples under the low-water mark before a shrink: [`SHRINK_AFTER_ENV`] when set (a
/// test), else [`SHRINK_AFTER_SAMPLES`].
pub fn shrink_after() -> u32 {
    std::env::var(SHRINK_AFTER_ENV)
        .ok()
        .and_then(|v| v.parse::<u32>().ok())
        .filter(|n| *n > 0)
        .unwrap_or(SHRINK_AFTER_SAMPLES)
}

/// Whether a table of `entries` with `live` live entries is under the low-water mark and
/// above `floor` (the start size, entries): it may shrink.
pub fn under_low_water(entries: u32, live: u64, floor: u32) -> bool {
    entries > floor && live * 100 < u64::from(entries) * LOW_WATER_PERCENT
}

/// The size a table of `entries` shrinks to: half, at least `floor`.
pub fn shrunk(entries: u32, floor: u32) -> u32 {
    (entries / 2).max(floor)
}

/// One sample of both tables.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Occupancy {
    /// `max_entries` of `CT4` (and `CT6`: both have one size).
    pub entries: u32,
    /// Live entries (idle timeout not passed) of `CT4` and `CT6`.
    pub live: [u64; 2],
    /// Every entry read (live or expired, still taking a slot until evicted).
    pub total: [u64; 2],
}

impl Occupancy {
    /// The larger table's live entries.
    pub fn fullest(&self) -> u64 {
        self.live[0].max(self.live[1])
    }
}

/// Both tables of `pins` sampled; `Ok(None)` when they are not pinned (no TC datapath).
pub fn sample(pins: &PinDir) -> io::Result<Option<Occupancy>> {
    let Some(entries) = pins.max_entries(map_names::CT4) else {
        return Ok(None);
    };
    let now = crate::ctl::maps::monotonic_ns();
    let (t4, l4) = count::<Ct4Key, Ct4Value>(pins, map_names::CT4, now, |k, v| {
        (k.proto, v.flags, v.last_seen)
    })?;
    let (t6, l6) = count::<Ct6Key, Ct6Value>(pins, map_names::CT6, now, |k, v| {
        (k.proto, v.flags, v.last_seen)
    })?;
    Ok(Some(Occupancy {
        entries,
        live: [l4, l6],
        total: [t4, t6],
    }))
}

/// Live entries of the conntrack table `name` (`CT4` or `CT6`) of `pins` (0 when not
/// pinned): what a shrink must hold.
pub fn live_entries(pins: &PinDir, name: &str) -> io::Result<u64> {
    let now = crate::ctl::maps::monotonic_ns();
    let (_, live) = if name == map_names::CT6 {
        count::<Ct6Key, Ct6Value>(pins, name, now, |k, v| (k.proto, v.flags, v.last_seen))?
    } else {
        count::<Ct4Key, Ct4Value>(pins, name, now, |k, v| (k.proto, v.flags, v.last_seen))?
    };
    Ok(live)
}

/// Whether the conntrack entry `key`, `value` (bytes of `CT4` or `CT6`, by their sizes)
/// has expired at `now` (monotonic ns), as the datapath judges it: such an entry is not
/// carried into a resized table (the datapath treats it as absent). `false` for bytes of
/// another layout.
pub fn expired_entry(key: &[u8], value: &[u8], now: u64) -> bool {
    use std::mem::size_of;
    fn state<K: Pod, V: Pod>(
        key: &[u8],
        value: &[u8],
        f: impl Fn(&K, &V) -> (u8, u32, u64),
    ) -> (u8, u32, u64) {
        // SAFETY: `K`, `V: Pod`; the lengths were checked by the caller.
        let (k, v): (K, V) = unsafe {
            (
                std::ptr::read_unaligned(key.as_ptr().cast()),
                std::ptr::read_unaligned(value.as_ptr().cast()),
            )
        };
        f(&k, &v)
    }
    let (proto, flags, last_seen) = match (key.len(), value.len()) {
        (k, v) if k == size_of::<Ct4Key>() && v == size_of::<Ct4Value>() => {
            state::<Ct4Key, Ct4Value>(key, value, |k, v| (k.proto, v.flags, v.last_seen))
        }
        (k, v) if k == size_of::<Ct6Key>() && v == size_of::<Ct6Value>() => {
            state::<Ct6Key, Ct6Value>(key, value, |k, v| (k.proto, v.flags, v.last_seen))
        }
        _ => return false,
    };
    now.saturating_sub(last_seen) > ct_timeouts::idle(proto, flags)
}

/// (entries, live entries) of one table, by batch lookups into fixed buffers.
fn count<K: Pod, V: Pod>(
    pins: &PinDir,
    name: &str,
    now: u64,
    state: impl Fn(&K, &V) -> (u8, u32, u64),
) -> io::Result<(u64, u64)> {
    let fd = match pins.open_fd(name, Access::ReadOnly) {
        Ok(fd) => fd,
        Err(_) => return Ok((0, 0)),
    };
    let (ks, vs) = (std::mem::size_of::<K>(), std::mem::size_of::<V>());
    let mut live = 0u64;
    let total = bpf_sys::map_walk_batch(fd.as_fd(), ks, vs, CHUNK, |keys, values, got| {
        for i in 0..got as usize {
            // SAFETY: `K`, `V: Pod` and the buffers hold `got` of each.
            let (k, v): (K, V) = unsafe {
                (
                    std::ptr::read_unaligned(keys[i * ks..].as_ptr().cast()),
                    std::ptr::read_unaligned(values[i * vs..].as_ptr().cast()),
                )
            };
            let (proto, flags, last_seen) = state(&k, &v);
            if now.saturating_sub(last_seen) <= ct_timeouts::idle(proto, flags) {
                live += 1;
            }
        }
    })?;
    Ok((total, live))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn shrinks_by_half_under_the_low_water_mark_never_below_the_start() {
        assert!(under_low_water(8192, 2047, 4096));
        assert!(!under_low_water(8192, 2048, 4096), "25 % is not under");
        assert!(!under_low_water(4096, 0, 4096), "at the start size");
        assert_eq!(shrunk(8192, 4096), 4096);
        assert_eq!(shrunk(8192, 2048), 4096, "halved, not to the floor at once");
        assert_eq!(shrunk(6144, 4096), 4096);
        // Halved, a table just under the low-water mark stays under the high-water one.
        let (entries, live) = (8192u32, 2047u64);
        assert_eq!(grown(shrunk(entries, 4096), live, 1 << 20), None);
    }

    #[test]
    fn start_size_is_the_pinned_one_within_start_and_ceiling() {
        assert_eq!(start_flows(None, 16_384, 131_072), 16_384);
        assert_eq!(start_flows(None, 16_384, 1000), 1000, "start <= max");
        assert_eq!(
            start_flows(Some(65_536), 16_384, 131_072),
            32_768,
            "grown: kept"
        );
        assert_eq!(
            start_flows(Some(2048), 16_384, 131_072),
            16_384,
            "below start"
        );
        assert_eq!(
            start_flows(Some(524_288), 16_384, 131_072),
            131_072,
            "above max"
        );
    }

    #[test]
    fn grows_x2_past_the_high_water_mark_up_to_the_ceiling() {
        assert_eq!(grown(2048, 1535, 16_384), None);
        assert_eq!(grown(2048, 1536, 16_384), Some(4096));
        assert_eq!(grown(2048, 5000, 16_384), Some(4096), "one step at a time");
        assert_eq!(
            grown(12_288, 12_000, 16_384),
            Some(16_384),
            "at most the ceiling"
        );
        assert_eq!(grown(16_384, 16_384, 16_384), None, "at the ceiling");
    }

    #[test]
    fn a_fast_fill_is_projected_ahead() {
        assert_eq!(
            projected(1000, 600),
            1800,
            "400 more per interval, two ahead"
        );
        assert_eq!(projected(1000, 1200), 1000, "shrinking: the live count");
        // 900 of 2,048 live, 500 more each interval: grown before the table fills.
        assert_eq!(grown(2048, projected(900, 400), 16_384), Some(4096));
        assert_eq!(grown(2048, projected(900, 880), 16_384), None, "steady");
    }

    #[test]
    fn timeouts_follow_the_datapath() {
        use proxy_common::{ct_flags, proto};
        assert_eq!(ct_timeouts::idle(proto::UDP, 0), ct_timeouts::UDP);
        assert_eq!(
            ct_timeouts::idle(proto::TCP, ct_flags::SEEN_REPLY),
            ct_timeouts::TCP_ESTABLISHED
        );
        assert_eq!(
            ct_timeouts::idle(proto::TCP, ct_flags::SEEN_REPLY | ct_flags::CLOSING),
            ct_timeouts::TCP_CLOSING
        );
        assert_eq!(ct_timeouts::idle(proto::TCP, 0), ct_timeouts::TCP_SYN);
    }
}
