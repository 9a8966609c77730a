//! Conntrack sized to demand: the tables (`CT4`, `CT6`) start at `--conntrack-start`
//! ([`DEFAULT_START_FLOWS`] per family) and the running agent grows them online toward the
//! ceiling (`--conntrack-max`, or kube-proxy's `conntrack.maxPerCore` x CPUs, at least
//! `conntrack.min`), by two triggers:
//!
//! - **The new-flow rate**, every [`RATE_INTERVAL`]: the entries the programs inserted
//!   ([`inserted`]: one lookup of the per-CPU outcome counter of each outcome that inserts
//!   entries, [`INSERTING`], in `STATS` and `XDP_STATS`) give the rate since the last
//!   reading; the live entries now are estimated as the last occupancy sample's plus every
//!   entry inserted since (an upper bound). When the estimate plus the rate x the lead
//!   ([`lead`]: twice the last resize's time, at least [`MIN_LEAD`], plus one rate
//!   interval) passes [`HIGH_WATER_PERCENT`] of the size, both tables grow at once,
//!   straight to [`rate_size`]: the power of two whose high-water mark holds the estimate
//!   plus [`RATE_HORIZON`] (10 s) of inserts at that rate, at least x2, at most the
//!   ceiling ([`rate_grown`]). A burst of new connections fills a small table in well
//!   under a second, long before the next occupancy sample; this trigger meets it within
//!   a rate interval plus one resize.
//! - **The occupancy**, every [`CHECK_INTERVAL`]: the live entries of both tables
//!   ([`sample`]: a `BPF_MAP_LOOKUP_BATCH` walk in chunks of [`CHUNK`] entries, an entry
//!   live while its idle timeout has not passed, as the datapath judges it), the gauges'
//!   source. When one table's live entries, or those [`projected`] [`AHEAD`] intervals on
//!   at the last interval's growth, pass [`HIGH_WATER_PERCENT`] of its size, both grow x2
//!   (at most to the ceiling).
//!
//! Either way by the staged migration
//! ([`migrate::resize_conntrack`](crate::migrate::resize_conntrack): new tables, flows
//! copied, programs swapped with `BPF_LINK_UPDATE`, copied again, pins renamed; the same
//! crash marker as at a start), on the blocking pool: `/healthz` and the sync loop never
//! wait for it. The tables are LRU: a burst beyond the size before a growth ends evicts
//! the least recently used flows (new flows are never refused), as before.
//!
//! When the fullest table's live entries stay under [`LOW_WATER_PERCENT`] of its size for
//! [`SHRINK_AFTER_SAMPLES`] samples in a row (five minutes), both are halved, never below
//! the start size, by the same migration (only live entries are copied; a shrink is
//! refused, size kept, while the live entries would not fit, or while the halved size
//! would not hold the highest new-flow rate read during those samples: [`holds_rate`],
//! so a shrink does not undo a rate-driven growth while the rate stays high).
//!
//! Nothing in the agent keeps a conntrack map open: the writer holds the service maps
//! (shared, not copied, by a conntrack resize), and map memory, this sampler and
//! `proxyctl` open the pins afresh each time, so they follow the new tables.

use std::{io, os::fd::AsFd, time::Duration};

use aya::Pod;
use proxy_common::{ct_timeouts, map_names, Ct4Key, Ct4Value, Ct6Key, Ct6Value, Reason};

use crate::pins::{Access, PinDir};

/// Default start size in flows per family (`--conntrack-start`): 9 MiB for both tables
/// instead of 72 MiB at kube-proxy's `conntrack.min` (131,072). Safe because the rate
/// trigger grows the tables before a burst fills them: until a growth ends only the
/// table's room absorbs a burst (a full LRU table evicts entries of live flows), and
/// 32,768 entries hold the first rate interval plus a resize of the bench's burst.
/// `cargo xtask bench`'s connections/s rounds (about 25,000 new connections a second
/// through TC and the pod path, about 50,000 entries a second): grown 16,384 -> 131,072
/// within 0.5-1.1 s of the first round, no failed connection at 16,384 with the agent
/// running during its rounds; without the rate trigger this start lost 2-16 connections
/// a round. A bench that stopped the agent (`SIGSTOP`) during its rounds, so the tables
/// could grow only between them, lost 1-20 a run at 16,384 and 32,768 (docs/deploy.md).
pub const DEFAULT_START_FLOWS: u32 = 16_384;
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

/// How often the new-flow rate is read ([`inserted`]): the rate trigger. A burst of new
/// connections fills a small table in well under a second (25,000 connections a second,
/// two entries each, fill 32,768 entries in 0.65 s), long before the next occupancy
/// sample; the rate is read from the outcome counters, a few lookups, so it is cheap to
/// read this often.
pub const RATE_INTERVAL: Duration = Duration::from_millis(250);
/// Test hook: the rate interval in milliseconds instead of [`RATE_INTERVAL`]; `0` turns
/// the rate trigger off (the occupancy walk alone grows the tables).
pub const RATE_ENV: &str = "EBPF_PROXY_CONNTRACK_RATE_MS";
/// The time a rate-driven growth sizes the tables for: the new entries of this long at
/// the measured rate, on top of the entries estimated now, fit under the high-water
/// mark. 10 s: a closed TCP flow's entries stay live [`ct_timeouts::TCP_CLOSING`] (10 s)
/// after its FIN, so at a steady rate of short connections the live entries are the
/// rate x 10 s; and it is one occupancy interval, after which the walk sees the real
/// live count.
pub const RATE_HORIZON: Duration = Duration::from_secs(10);
/// The least lead time of the rate trigger: a resize takes 0.6-0.9 s on a loaded 2-core
/// machine (programs loaded twice); the lead is twice the last resize's time, at least
/// this, plus one rate interval (the next reading).
pub const MIN_LEAD: Duration = Duration::from_secs(1);

/// The rate interval: [`RATE_ENV`] when set (a test; `0`: `None`, the trigger off), else
/// [`RATE_INTERVAL`].
pub fn rate_interval() -> Option<Duration> {
    match std::env::var(RATE_ENV)
        .ok()
        .and_then(|v| v.parse::<u64>().ok())
    {
        Some(0) => None,
        Some(ms) => Some(Duration::from_millis(ms)),
        None => Some(RATE_INTERVAL),
    }
}

/// The outcomes that insert conntrack entries, and how many each inserts: a new flow
/// (`tc_new_flow`, at TC and at XDP) writes both of its entries; a DSR flow's first
/// packet on the first node (`tc_dsr_encap`) both of its entries; a DSR packet decapsulated
/// on the backend's node (`tc_dsr_decap`) the flow's reply entry. The two DSR outcomes are
/// also counted for a DSR flow's later SYNs and UDP datagrams, which rewrite an entry
/// already there: the rate errs high (the tables grow early, never late).
pub const INSERTING: [(Reason, u64); 3] = [
    (Reason::TcNewFlow, 2),
    (Reason::TcDsrEncap, 2),
    (Reason::TcDsrDecap, 1),
];

/// Conntrack entries inserted so far by the programs of `pins` (summed over CPUs, over
/// `STATS` and `XDP_STATS`, weighted by [`INSERTING`]): one lookup of the per-CPU
/// counter of each inserting outcome. `ncpus`: the possible CPUs (the per-CPU value's
/// length). Counters not pinned read 0.
pub fn inserted(pins: &PinDir, ncpus: usize) -> io::Result<u64> {
    let mut buf = vec![0u8; 8 * ncpus.max(1)];
    let mut total = 0u64;
    for (map, reasons) in [
        (map_names::STATS, &INSERTING[..]),
        (map_names::XDP_STATS, &INSERTING[..1]),
    ] {
        let Ok(fd) = pins.open_fd(map, Access::ReadOnly) else {
            continue;
        };
        for (reason, entries) in reasons {
            let key = (*reason as u32).to_ne_bytes();
            if !bpf_sys::map_lookup(fd.as_fd(), &key, &mut buf)? {
                continue;
            }
            let count: u64 = buf
                .chunks_exact(8)
                .map(|c| u64::from_ne_bytes(c.try_into().unwrap_or([0; 8])))
                .fold(0, u64::wrapping_add);
            total = total.wrapping_add(count.wrapping_mul(*entries));
        }
    }
    Ok(total)
}

/// Entries a second from two readings of [`inserted`] `elapsed` apart (0 when the
/// counters went back: replaced by a migration).
pub fn rate(before: u64, now: u64, elapsed: Duration) -> u64 {
    let secs = elapsed.as_secs_f64();
    if now < before || secs <= 0.0 {
        return 0;
    }
    ((now - before) as f64 / secs) as u64
}

/// The time ahead the rate trigger looks: twice the last resize's time (at least
/// [`MIN_LEAD`]) plus one rate interval `interval`.
pub fn lead(last_resize: Duration, interval: Duration) -> Duration {
    (last_resize * 2).max(MIN_LEAD) + interval
}

/// The rate trigger: a table of `entries` with `estimated` live entries now (the last
/// occupancy sample's plus the entries inserted since, [`inserted`]: an upper bound),
/// filling at `rate` entries a second, that would pass [`HIGH_WATER_PERCENT`] within
/// `lead` ([`lead`]: the time a resize takes, with a margin) grows at once, straight to
/// [`rate_size`] (at least x2), at most the ceiling `ceiling`; `None` otherwise or at the
/// ceiling.
pub fn rate_grown(
    entries: u32,
    estimated: u64,
    rate: u64,
    lead: Duration,
    ceiling: u32,
) -> Option<u32> {
    let ahead = estimated.saturating_add(entries_in(rate, lead));
    if entries >= ceiling || ahead.saturating_mul(100) < u64::from(entries) * HIGH_WATER_PERCENT {
        return None;
    }
    let to = rate_size(estimated, rate).max(u64::from(entries) * 2);
    Some(u32::try_from(to).unwrap_or(u32::MAX).min(ceiling))
}

/// The size (entries, a power of two) whose high-water mark holds `estimated` entries
/// plus [`RATE_HORIZON`] of inserts at `rate` entries a second.
pub fn rate_size(estimated: u64, rate: u64) -> u64 {
    let need = estimated.saturating_add(entries_in(rate, RATE_HORIZON));
    need.saturating_mul(100)
        .div_ceil(HIGH_WATER_PERCENT)
        .max(1)
        .checked_next_power_of_two()
        .unwrap_or(u64::MAX)
}

/// Whether a table of `entries` holds [`RATE_HORIZON`] of inserts at `rate` entries a
/// second under its high-water mark: a shrink to `entries` is refused otherwise (it
/// would undo a rate-driven growth while the rate stays high).
pub fn holds_rate(entries: u32, rate: u64) -> bool {
    entries_in(rate, RATE_HORIZON).saturating_mul(100) <= u64::from(entries) * HIGH_WATER_PERCENT
}

/// Entries inserted in `d` at `rate` a second.
fn entries_in(rate: u64, d: Duration) -> u64 {
    (rate as f64 * d.as_secs_f64()) as u64
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
    fn the_rate_trigger_grows_ahead_of_the_fill_straight_to_the_size_the_rate_needs() {
        let lead = lead(Duration::from_millis(800), RATE_INTERVAL);
        assert_eq!(lead, Duration::from_millis(1850), "2 x 0.8 s + 0.25 s");
        assert_eq!(
            super::lead(Duration::ZERO, RATE_INTERVAL),
            Duration::from_millis(1250),
            "at least 1 s"
        );
        // 25,000 new connections a second (50,000 entries) into 32,768 entries with
        // 5,000 live: past 75 % within the lead, straight to the ceiling.
        assert_eq!(
            rate_grown(32_768, 5_000, 50_000, lead, 262_144),
            Some(262_144)
        );
        // 2,000 entries a second: 5,000 + 3,700 stay under 24,576.
        assert_eq!(rate_grown(32_768, 5_000, 2_000, lead, 262_144), None);
        // 1,000 + 2,000 x 1.85 s pass 3,072 of 4,096: (1,000 + 2,000 x 10 s) / 75 %
        // = 28,000 -> 32,768, not x2.
        assert_eq!(rate_grown(4096, 1000, 2000, lead, 1 << 20), Some(32_768));
        assert_eq!(
            rate_grown(4096, 1000, 2000, lead, 16_384),
            Some(16_384),
            "ceiling"
        );
        // Past the mark with no rate: x2 at least.
        assert_eq!(rate_grown(4096, 3100, 0, lead, 1 << 20), Some(8192));
        assert_eq!(rate_grown(262_144, 250_000, 50_000, lead, 262_144), None);
        assert_eq!(rate_size(0, 0), 1);
        assert_eq!(rate_size(1000, 2000), 32_768);
    }

    #[test]
    fn the_rate_comes_from_two_counter_readings() {
        assert_eq!(rate(1000, 3500, Duration::from_millis(250)), 10_000);
        assert_eq!(rate(5000, 10, Duration::from_millis(250)), 0, "replaced");
        assert_eq!(rate(5000, 6000, Duration::ZERO), 0);
    }

    #[test]
    fn a_shrink_keeps_room_for_the_rate() {
        // 2,000 entries a second x 10 s = 20,000 under 75 % of 32,768, not of 16,384.
        assert!(holds_rate(32_768, 2000));
        assert!(!holds_rate(16_384, 2000));
        assert!(holds_rate(2048, 0));
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
