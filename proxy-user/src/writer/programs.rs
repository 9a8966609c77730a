//! The frontends the writer programmed ([`Programs`]), with the totals the sizing reads
//! before every sync ([`Tally`]: `SVC` entries per family, Maglev chunks, frontends with
//! `ClientIP` affinity) kept as they change. Counting them by walking every frontend
//! cost 2-4 ms per sync at 50,000-100,000 Services: a single endpoint change paid it.

use std::collections::BTreeMap;

use proxy_common::svc_flags;

use super::Programmed;
use crate::model::Frontend;

/// Totals over the programmed frontends.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub(super) struct Tally {
    /// `SVC` entries of each family (IPv4, IPv6): a frontend's own and one per further
    /// chunk of 24 slots.
    pub svc: [usize; 2],
    /// Maglev chunks written for the frontends' tables.
    pub chunks: usize,
    /// Frontends with `ClientIP` affinity.
    pub affinity: usize,
}

impl Tally {
    fn apply(&mut self, fe: &Frontend, p: &Programmed, add: bool) {
        let svc = crate::store::svc_entries(p.slots.len());
        let chunks = p.maglev.map_or(0, |(_, n)| n as usize);
        let affinity = usize::from(p.value.flags & svc_flags::AFFINITY != 0);
        let family = &mut self.svc[usize::from(fe.addr.is_ipv6())];
        if add {
            *family += svc;
            self.chunks += chunks;
            self.affinity += affinity;
        } else {
            *family -= svc;
            self.chunks -= chunks;
            self.affinity -= affinity;
        }
    }
}

/// The programmed frontends: read as the map they are; changed only through the methods
/// here, which keep the [`Tally`].
#[derive(Clone, Debug, Default)]
pub(super) struct Programs {
    map: BTreeMap<Frontend, Programmed>,
    pub(super) tally: Tally,
}

impl std::ops::Deref for Programs {
    type Target = BTreeMap<Frontend, Programmed>;

    fn deref(&self) -> &Self::Target {
        &self.map
    }
}

impl Programs {
    pub fn insert(&mut self, fe: Frontend, p: Programmed) -> Option<Programmed> {
        self.tally.apply(&fe, &p, true);
        let old = self.map.insert(fe, p);
        if let Some(old) = &old {
            self.tally.apply(&fe, old, false);
        }
        old
    }

    pub fn remove(&mut self, fe: &Frontend) -> Option<Programmed> {
        let old = self.map.remove(fe);
        if let Some(old) = &old {
            self.tally.apply(fe, old, false);
        }
        old
    }

    /// The Maglev table written for `fe` (adoption).
    pub fn set_maglev(&mut self, fe: &Frontend, maglev: Option<(u64, u32)>) {
        if let Some(p) = self.map.get_mut(fe) {
            self.tally.apply(fe, p, false);
            p.maglev = maglev;
            self.tally.apply(fe, p, true);
        }
    }

    /// Each frontend with its value and its reverse-NAT name to set (nothing the tally
    /// counts changes).
    pub fn names_mut(
        &mut self,
    ) -> impl Iterator<Item = (&Frontend, &crate::store::FrontendValue, &mut String)> {
        self.map
            .iter_mut()
            .map(|(fe, p)| (fe, &p.value, &mut p.name))
    }

    /// The totals (checked against a count of every frontend in debug builds: every
    /// test that syncs checks them).
    pub fn tally(&self) -> Tally {
        debug_assert_eq!(self.tally, self.recount(), "the writer's tally drifted");
        self.tally
    }

    /// The totals counted over every frontend.
    pub fn recount(&self) -> Tally {
        let mut t = Tally::default();
        for (fe, p) in &self.map {
            t.apply(fe, p, true);
        }
        t
    }
}

impl<'a> IntoIterator for &'a Programs {
    type Item = (&'a Frontend, &'a Programmed);
    type IntoIter = std::collections::btree_map::Iter<'a, Frontend, Programmed>;

    fn into_iter(self) -> Self::IntoIter {
        self.map.iter()
    }
}
