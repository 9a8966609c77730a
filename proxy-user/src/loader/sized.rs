//! The maps sized to demand: each [`SizedMap`] kind (a map and its other-family twin) is
//! created small (its floor, or what the node serves) and grown online toward its
//! ceiling by the staged migration (`crate::migrate`), several kinds in one migration.
//! [`Sizes`] is the per-kind table of `max_entries` a migration or a load creates them
//! with.

use proxy_common::{limits, map_names as n};

use crate::pins::PinDir;

/// A kind of map sized to demand: its maps share one `max_entries`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum SizedMap {
    /// `CT4`/`CT6`: `crate::ctsize` grows them (`--conntrack-start` .. `--conntrack-max`).
    Conntrack,
    /// `SVC4`/`SVC6`: a frontend's entry and its further chunks of 24 slots (ceiling `--service-map-entries`).
    Service,
    /// `BACKEND4`/`BACKEND6`: arrays indexed by backend id (one id space for both
    /// families): room for the highest id in use, not the count.
    Backend,
    /// `BACKEND_CONNS`: one entry per backend that got a connection, both families.
    BackendConns,
    /// `REVNAT4`/`REVNAT6`: one entry per frontend (service id) of the family.
    RevNat,
    /// `AFFINITY` (LRU, preallocated): small while no frontend has `ClientIP` affinity.
    Affinity,
    /// `MAGLEV`: the chunks of every Maglev frontend's table.
    Maglev,
    /// `SVC_COUNTERS`: one entry while `--metrics-per-service` is off.
    SvcCounters,
    /// `BACKEND_COUNTERS`: one entry while `--metrics-per-service` is off.
    BackendCounters,
}

impl SizedMap {
    pub const ALL: [SizedMap; 9] = [
        SizedMap::Conntrack,
        SizedMap::Service,
        SizedMap::Backend,
        SizedMap::BackendConns,
        SizedMap::RevNat,
        SizedMap::Affinity,
        SizedMap::Maglev,
        SizedMap::SvcCounters,
        SizedMap::BackendCounters,
    ];

    /// Its maps (the IPv4 one first).
    pub const fn maps(self) -> &'static [&'static str] {
        match self {
            SizedMap::Conntrack => &[n::CT4, n::CT6],
            SizedMap::Service => &[n::SVC4, n::SVC6],
            SizedMap::Backend => &[n::BACKEND4, n::BACKEND6],
            SizedMap::BackendConns => &[n::BACKEND_CONNS],
            SizedMap::RevNat => &[n::REVNAT4, n::REVNAT6],
            SizedMap::Affinity => &[n::AFFINITY],
            SizedMap::Maglev => &[n::MAGLEV],
            SizedMap::SvcCounters => &[n::SVC_COUNTERS],
            SizedMap::BackendCounters => &[n::BACKEND_COUNTERS],
        }
    }

    /// The size compiled into the object: the ceiling of the kinds no flag sets, and
    /// the size of maps made by a load that asks for no other (tests, `install`).
    pub const fn compiled(self) -> u32 {
        match self {
            SizedMap::Conntrack => limits::MAX_CT,
            SizedMap::Service => limits::MAX_SVC_ENTRIES,
            SizedMap::Backend | SizedMap::BackendConns => limits::MAX_BACKENDS,
            SizedMap::RevNat => limits::MAX_REVNAT,
            SizedMap::Affinity => limits::MAX_AFFINITY,
            SizedMap::Maglev => limits::MAX_MAGLEV_CHUNKS,
            SizedMap::SvcCounters => limits::MAX_COUNTED_FRONTENDS,
            SizedMap::BackendCounters => limits::MAX_COUNTED_BACKENDS,
        }
    }

    /// The size a fresh node creates the maps at (conntrack and the service maps: their
    /// own start flags). Hash maps without preallocation cost 16 B of bucket array per
    /// entry at creation; the backend arrays 8 / 24 B; `AFFINITY` (LRU) 104 B.
    pub const fn floor(self) -> u32 {
        match self {
            SizedMap::Conntrack
            | SizedMap::Service
            | SizedMap::Backend
            | SizedMap::BackendConns => 1 << 14,
            SizedMap::RevNat => 1 << 12,
            SizedMap::Affinity | SizedMap::Maglev => 1 << 10,
            SizedMap::SvcCounters | SizedMap::BackendCounters => 1,
        }
    }

    /// Where its ceiling comes from (logs).
    pub const fn ceiling_name(self) -> &'static str {
        match self {
            SizedMap::Conntrack => "--conntrack-max",
            SizedMap::Service => "--service-map-entries",
            SizedMap::Backend | SizedMap::BackendConns => "limits::MAX_BACKENDS",
            SizedMap::RevNat => "limits::MAX_REVNAT",
            SizedMap::Affinity => "limits::MAX_AFFINITY",
            SizedMap::Maglev => "limits::MAX_MAGLEV_CHUNKS",
            SizedMap::SvcCounters => "limits::MAX_COUNTED_FRONTENDS",
            SizedMap::BackendCounters => "limits::MAX_COUNTED_BACKENDS",
        }
    }

    /// The kind map `name` belongs to.
    pub fn of_map(name: &str) -> Option<SizedMap> {
        SizedMap::ALL.into_iter().find(|s| s.maps().contains(&name))
    }

    /// The kinds the writer grows before a sync (conntrack is `crate::ctsize`'s; the
    /// counters are sized at a start by `--metrics-per-service`).
    pub const WRITER: [SizedMap; 6] = [
        SizedMap::Service,
        SizedMap::Backend,
        SizedMap::BackendConns,
        SizedMap::RevNat,
        SizedMap::Affinity,
        SizedMap::Maglev,
    ];
}

/// `max_entries` per [`SizedMap`] kind.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Sizes([u32; SizedMap::ALL.len()]);

impl Default for Sizes {
    fn default() -> Self {
        Self::compiled()
    }
}

impl Sizes {
    /// Every kind at its compiled size.
    pub fn compiled() -> Self {
        Self(SizedMap::ALL.map(SizedMap::compiled))
    }

    /// Every kind at its floor.
    pub fn floors() -> Self {
        Self(SizedMap::ALL.map(SizedMap::floor))
    }

    pub fn get(&self, kind: SizedMap) -> u32 {
        self.0[kind as usize]
    }

    pub fn set(&mut self, kind: SizedMap, entries: u32) {
        self.0[kind as usize] = entries;
    }

    pub fn with(mut self, kind: SizedMap, entries: u32) -> Self {
        self.set(kind, entries);
        self
    }

    /// The size of map `name`, when it is sized here.
    pub fn of_map(&self, name: &str) -> Option<u32> {
        SizedMap::of_map(name).map(|k| self.get(k))
    }

    /// The pinned sizes (each kind's first map), `fallback`'s where not pinned.
    pub fn pinned_or(pins: &PinDir, fallback: Sizes) -> Self {
        let mut s = fallback;
        for kind in SizedMap::ALL {
            if let Some(n) = pins.max_entries(kind.maps()[0]) {
                s.set(kind, n);
            }
        }
        s
    }

    /// `(kind, entries)` of every kind whose size differs from `other`'s.
    pub fn changed_from(&self, other: &Sizes) -> Vec<(SizedMap, u32)> {
        SizedMap::ALL
            .into_iter()
            .filter(|k| self.get(*k) != other.get(*k))
            .map(|k| (k, self.get(k)))
            .collect()
    }
}

/// The sizes the maps sized to demand have at an agent's start, conntrack and the service
/// maps aside (their own flags: the caller sets them): a pinned map keeps its size while
/// it lies between its floor and its ceiling (grown online earlier; an upgrade from a
/// release that made it at the compiled size keeps that), else the nearest bound; a
/// fresh map starts at its floor. The per-Service counters: their ceiling with
/// `--metrics-per-service` (a node where it was off grows them at this start), else
/// their pinned size or 1.
pub fn start_sizes(pins: &PinDir, metrics_per_service: bool) -> Sizes {
    let mut s = Sizes::floors();
    for kind in SizedMap::ALL {
        let ceiling = kind.compiled();
        let floor = match kind {
            SizedMap::SvcCounters | SizedMap::BackendCounters if metrics_per_service => ceiling,
            _ => kind.floor(),
        };
        let pinned = pins.max_entries(kind.maps()[0]);
        s.set(kind, pinned.unwrap_or(floor).max(floor).min(ceiling));
    }
    s
}

/// The size a kind grows to from `size` for `needed` entries: doubled until `needed`
/// is within the high-water mark (`high`: numerator, denominator), at most `ceiling`;
/// `None` when `needed` is within it already, or the map is at the ceiling.
pub fn grown(size: u32, needed: usize, ceiling: u32, high: (usize, usize)) -> Option<u32> {
    let within = |n: u32| needed * high.1 <= n as usize * high.0;
    if within(size) || size >= ceiling {
        return None;
    }
    let mut to = size.max(1);
    while !within(to) && to < ceiling {
        to = to.saturating_mul(2);
    }
    Some(to.min(ceiling))
}

/// The size a kind of `size` entries shrinks to with `used` entries in use, when `used`
/// is under the low-water mark `low` (numerator, denominator) of `size`: the power of two
/// that holds `used` twice over (2x headroom: at most half full), at least `floor`;
/// `None` when `used` is not under the mark or that size is not smaller. With a mark of
/// 1/4 the result is at most half of `size`, and `used` lies above a quarter of it
/// (unless at the floor) and at most half: under the growth's 3/4, over the next
/// shrink's 1/4, so a steady use neither grows nor shrinks it again.
pub fn shrunk(size: u32, used: usize, floor: u32, low: (usize, usize)) -> Option<u32> {
    if used.saturating_mul(low.1) >= size as usize * low.0 {
        return None;
    }
    let to = used
        .saturating_mul(2)
        .checked_next_power_of_two()
        .and_then(|n| u32::try_from(n).ok())
        .unwrap_or(u32::MAX)
        .max(floor);
    (to < size).then_some(to)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_kind_has_its_maps_and_a_floor_within_its_ceiling() {
        let mut seen = std::collections::BTreeSet::new();
        for kind in SizedMap::ALL {
            assert!(kind.floor() <= kind.compiled(), "{kind:?}");
            for m in kind.maps() {
                assert!(n::ALL.contains(m), "{m}");
                assert!(seen.insert(*m), "{m} in two kinds");
                assert_eq!(SizedMap::of_map(m), Some(kind));
            }
            assert_eq!(Sizes::compiled().with(kind, 7).get(kind), 7);
        }
        assert_eq!(Sizes::floors().of_map(n::REVNAT6), Some(1 << 12));
        assert_eq!(Sizes::floors().of_map(n::STATS), None);
    }

    #[test]
    fn growth_doubles_to_the_high_water_mark_up_to_the_ceiling() {
        let q = (3, 4);
        assert_eq!(grown(1024, 768, 65536, q), None);
        assert_eq!(grown(1024, 769, 65536, q), Some(2048));
        assert_eq!(grown(1024, 10_000, 65536, q), Some(16384));
        assert_eq!(grown(1024, 10_000, 4096, q), Some(4096));
        assert_eq!(grown(4096, 10_000, 4096, q), None);
        assert_eq!(grown(1, 65536 * 3 / 4 + 1, 65536, q), Some(65536));
    }

    #[test]
    fn shrink_halves_at_least_to_twice_the_use_and_never_below_the_floor() {
        let (q, low) = ((3, 4), (1, 4));
        // At or over the low-water mark (a quarter): kept.
        assert_eq!(shrunk(65_536, 16_384, 1024, low), None);
        assert_eq!(shrunk(65_536, 40_000, 1024, low), None);
        // Under it: the power of two holding the use twice over.
        assert_eq!(shrunk(65_536, 16_383, 1024, low), Some(32_768));
        assert_eq!(shrunk(65_536, 5_000, 1024, low), Some(16_384));
        assert_eq!(shrunk(65_536, 2, 1024, low), Some(1024), "the floor");
        assert_eq!(shrunk(65_536, 0, 16_384, low), Some(16_384));
        // At (or below: a smaller ceiling) the floor: nothing to shrink.
        assert_eq!(shrunk(16_384, 0, 16_384, low), None);
        assert_eq!(shrunk(64, 0, 16_384, low), None);
        // No oscillation: right after a shrink the use is at most half the new size
        // (under the growth's 3/4) and, above the floor, over a quarter (no second
        // shrink); the growth rule would not grow it back.
        for size in [2048u32, 16_384, 65_536, 1 << 20] {
            for used in (0..size as usize / 4).step_by(97) {
                let Some(to) = shrunk(size, used, 1024, low) else {
                    assert!(size <= 1024, "{size} {used}");
                    continue;
                };
                assert!(to <= size / 2 && to >= 1024, "{size} {used} -> {to}");
                assert!(used * 2 <= to as usize, "{size} {used} -> {to}");
                assert_eq!(grown(to, used, size, q), None, "{size} {used} -> {to}");
                if to > 1024 {
                    assert_eq!(shrunk(to, used, 1024, low), None, "{size} {used} -> {to}");
                }
            }
        }
    }
}
