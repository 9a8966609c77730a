//! The maps sized to demand, from the writer's side: before a sync whose writes would pass
//! [`SVC_HIGH_WATER`] of a map's size, every map that needs it is grown (x2 at a time, to
//! what the sync needs, up to its ceiling) in one online resize of the store
//! ([`MapStore::grow_maps`]: one staged migration), so that no write meets a full map.

use proxy_common::svc_flags;
use tracing::error;

use super::{svc_grown, BackendKey, Writer, SVC_HIGH_WATER};
use crate::{
    loader::{grown, SizedMap, Sizes},
    model::ServiceEntry,
    store::{svc_entries, MapStore},
};

/// The service maps grown (or not) before a sync ([`Writer::take_svc_growths`]).
#[derive(Debug)]
pub enum SvcGrowth {
    /// Grown: the maps resized, and the entries the sync needed.
    Grown {
        resized: Vec<crate::loader::MapResize>,
        needed: usize,
    },
    /// The growth failed: the sizes are kept (what does not fit fails as `map_full`).
    Failed {
        to: Vec<(crate::loader::SizedMap, u32)>,
        error: crate::store::StoreError,
    },
}

impl<S: MapStore> Writer<S> {
    /// The most entries the store's service maps may grow to (`--service-map-entries`);
    /// the other maps the writer grows (backends, reverse NAT, affinity, Maglev) up to
    /// their compiled sizes.
    pub fn set_svc_ceiling(&mut self, entries: u32) {
        self.ceilings = Some(Sizes::compiled().with(SizedMap::Service, entries));
    }

    /// The service-side maps' growths since the last call.
    pub fn take_svc_growths(&mut self) -> Vec<SvcGrowth> {
        std::mem::take(&mut self.svc_growths)
    }

    /// `SVC` entries of each family (IPv4, IPv6) the maps hold: each programmed
    /// frontend's entry and its further chunks of 24 slots.
    pub fn svc_entries(&self) -> [usize; 2] {
        self.services.tally().svc
    }

    /// The entries each map the writer grows holds at most while `upserts` are written
    /// (bounds: removals are not subtracted; both families counted for each family's
    /// map, except the service maps): the service maps, the `SVC` entries of each family
    /// plus each upsert's growth (a new frontend's entry and chunks; a programmed one's
    /// chunks beyond those it has); backends, those programmed plus
    /// the upserts' unknown ones (the backend arrays: the highest id they may reach, one
    /// past it); reverse NAT, the frontends plus the new ones; Maglev,
    /// the chunks of every table plus one table per Maglev upsert; affinity, its
    /// ceiling as soon as one frontend has `ClientIP` affinity (the LRU's demand is its
    /// clients, unknown here), else nothing. Not `exact`: the backends not known are
    /// counted without removing repeats (an upper bound, without the set of a million
    /// keys a first sync would build; [`Self::make_room`] asks for the exact count only
    /// when the bound would grow a map).
    pub(super) fn needed(
        &self,
        upserts: &[&ServiceEntry],
        ceilings: &Sizes,
        exact: bool,
    ) -> Vec<(SizedMap, usize)> {
        // What the maps hold: the writer's running totals (this runs before every
        // sync's writes, and a walk of every frontend cost milliseconds at 100,000).
        let held = self.services.tally();
        let mut svc = held.svc;
        let mut frontends = self.services.len();
        let mut chunks = held.chunks;
        let mut affinity = held.affinity > 0;
        let table = proxy_common::maglev::chunks(self.maglev.table_size) as usize;
        // The new backends, packed, counted without repeats once all are seen (a first
        // sync's upserts name a million backends at 100,000 Services: a sort of packed
        // keys costs a fifth of a set of them, whose table was mostly page faults).
        let mut new_backends = PackedBackends::default();
        let mut unknown = 0usize;
        // A fresh node's first sync (and its sizing): no backend known, none looked up.
        let none_known = self.backends.len() == 0;
        for e in upserts {
            // A new frontend's entry and further slot chunks; a programmed one's chunks
            // beyond those it has.
            let now = self.services.get(&e.frontend);
            if now.is_none() {
                frontends += 1;
            }
            svc[usize::from(e.frontend.addr.is_ipv6())] += svc_entries(e.backends.len())
                .saturating_sub(now.map_or(0, |p| svc_entries(p.slots.len())));
            if e.flags & svc_flags::MAGLEV != 0 {
                chunks += table;
            }
            affinity |= e.flags & svc_flags::AFFINITY != 0;
            for b in &e.backends {
                let key = (*b, e.frontend.proto);
                if none_known || self.backends.id_of(&key).is_none() {
                    if exact {
                        new_backends.push(&key);
                    } else {
                        unknown += 1;
                    }
                }
            }
        }
        let backends = self.backends.len()
            + if exact {
                new_backends.distinct()
            } else {
                unknown
            };
        // `BACKEND4/6` are arrays indexed by id (one id space for both families): they
        // need room for the highest id, which the lowest-free allocation keeps at most
        // the highest allocated now or the live ids plus the new ones (0 is never used).
        let ids = (self.backend_alloc.next as usize).max(backends + 1);
        let affinity = if affinity {
            ceilings.get(SizedMap::Affinity) as usize * SVC_HIGH_WATER.0 / SVC_HIGH_WATER.1 + 1
        } else {
            0
        };
        vec![
            (SizedMap::Service, svc[0].max(svc[1])),
            (SizedMap::Backend, ids),
            (SizedMap::BackendConns, backends),
            (SizedMap::RevNat, frontends),
            (SizedMap::Affinity, affinity),
            (SizedMap::Maglev, chunks),
        ]
    }

    /// Before `upserts` are written: every map the writer grows whose entries would pass
    /// [`SVC_HIGH_WATER`] of its size, when its ceiling allows, is grown first, all in
    /// one resize (the store resizes them online; nothing is written meanwhile). At the
    /// ceiling, or when the growth fails, the sizes are kept: what does not fit fails as
    /// before (`map_full`, the frontend rolled back).
    pub(super) fn make_room(&mut self, upserts: &[&ServiceEntry]) {
        let Some(ceilings) = self.ceilings.filter(|_| !upserts.is_empty()) else {
            return;
        };
        let Some(sizes) = self.store.map_sizes() else {
            return;
        };
        // The bound first: when it fits, the exact count does too.
        let mut needed = self.needed(upserts, &ceilings, false);
        let mut to = growths(&needed, &sizes, &ceilings);
        if to.is_empty() {
            return;
        }
        if to
            .iter()
            .any(|(k, _)| matches!(k, SizedMap::Backend | SizedMap::BackendConns))
        {
            needed = self.needed(upserts, &ceilings, true);
            to = growths(&needed, &sizes, &ceilings);
            if to.is_empty() {
                return;
            }
        }
        let svc = needed[0].1;
        match self.store.grow_maps(&to) {
            Ok(resized) => self.svc_growths.push(SvcGrowth::Grown {
                resized,
                needed: svc,
            }),
            Err(error) => {
                error!(to = %crate::store::describe_sizes(&to), needed = ?needed, error = %error,
                    "growing the service-side maps failed; kept their sizes");
                self.svc_growths.push(SvcGrowth::Failed { to, error });
            }
        }
    }
}

/// The share of a map sized to demand under which it may be shrunk (`agent::shrink`,
/// once the use has stayed under it long enough): 1/4. Shrunk ([`crate::loader::shrunk`])
/// to at least twice what it holds, it is then at most half full: under
/// [`SVC_HIGH_WATER`], so a steady use neither grows nor shrinks it again.
pub const SVC_LOW_WATER: (usize, usize) = (1, 4);

impl<S: MapStore> Writer<S> {
    /// The kinds the writer grows that are under [`SVC_LOW_WATER`] now: `(kind, size,
    /// the size it would shrink to)` ([`crate::loader::shrunk`] of what the maps hold,
    /// never below the kind's floor, at most its ceiling). Empty when the store's maps
    /// are not sized to demand. One pass over the programmed frontends.
    pub fn svc_shrinkable(&self) -> Vec<(SizedMap, u32, u32)> {
        let (Some(ceilings), Some(sizes)) = (self.ceilings, self.store.map_sizes()) else {
            return Vec::new();
        };
        self.needed(&[], &ceilings, true)
            .into_iter()
            .filter_map(|(kind, used)| {
                let (size, floor) = (sizes.get(kind), kind.floor().min(ceilings.get(kind)));
                crate::loader::shrunk(size, used, floor, SVC_LOW_WATER).map(|to| (kind, size, to))
            })
            .collect()
    }

    /// Shrinks the maps of each kind of `to` in one online resize (the store's
    /// [`MapStore::grow_maps`], which resizes either way); the caller runs it between
    /// syncs, so no write meets the smaller maps before the writer's handles follow them.
    pub fn shrink_maps(
        &mut self,
        to: &[(SizedMap, u32)],
    ) -> Result<Vec<crate::loader::MapResize>, crate::store::StoreError> {
        self.store.grow_maps(to)
    }
}

/// The kinds of `needed` that pass [`SVC_HIGH_WATER`] of their size in `sizes`, each
/// with the size it grows to (x2 at a time, at most its ceiling).
fn growths(needed: &[(SizedMap, usize)], sizes: &Sizes, ceilings: &Sizes) -> Vec<(SizedMap, u32)> {
    needed
        .iter()
        .filter_map(|&(kind, n)| {
            let (size, ceiling) = (sizes.get(kind), ceilings.get(kind));
            let to = if kind == SizedMap::Service {
                svc_grown(size, n, ceiling)
            } else {
                grown(size, n, ceiling, SVC_HIGH_WATER)
            };
            to.map(|to| (kind, to))
        })
        .collect()
}

/// The sizes a fresh node creates its maps at so that its first sync of `desired`
/// grows nothing: `start` with every kind the first sync would grow (what
/// [`Writer::make_room`] would ask for over empty maps of the `start` sizes) at that
/// size. `ceilings` as [`Writer::set_svc_ceiling`] sets them.
pub fn first_sync_sizes(
    desired: &[&ServiceEntry],
    start: Sizes,
    ceilings: &Sizes,
    maglev: crate::maglev::Params,
) -> Sizes {
    let mut empty = Writer::new(crate::store::MemStore::default());
    empty.set_maglev_params(maglev);
    let needed = empty.needed(desired, ceilings, true);
    growths(&needed, &start, ceilings)
        .into_iter()
        .fold(start, |s, (kind, to)| s.with(kind, to))
}

/// Backend keys packed into integers, to count the distinct ones by sorting: an IPv4
/// backend's address, port, flags and protocol fill a `u64` exactly; an IPv6 one's a
/// `u128` and a `u32`.
#[derive(Default)]
struct PackedBackends {
    v4: Vec<u64>,
    v6: Vec<(u128, u32)>,
}

impl PackedBackends {
    fn push(&mut self, (b, proto): &BackendKey) {
        let low =
            u32::from(b.addr.port()) << 16 | u32::from(b.flags) << 8 | u32::from(proto.number());
        match b.addr.ip() {
            std::net::IpAddr::V4(a) => self.v4.push(u64::from(u32::from(a)) << 32 | u64::from(low)),
            std::net::IpAddr::V6(a) => self.v6.push((u128::from(a), low)),
        }
    }

    /// How many distinct keys were pushed.
    fn distinct(mut self) -> usize {
        self.v4.sort_unstable();
        self.v4.dedup();
        self.v6.sort_unstable();
        self.v6.dedup();
        self.v4.len() + self.v6.len()
    }
}
