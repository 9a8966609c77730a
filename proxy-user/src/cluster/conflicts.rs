//! Frontend conflicts: two Services claiming one `ip:port/proto` (possible with the
//! manifests source, and in a cluster with `externalIPs` or load-balancer IPs; the API
//! server keeps ClusterIPs unique). kube-proxy has no rule for it (iptables keeps both
//! rules and the first one matching wins); here exactly one Service owns the frontend:
//!
//! - the one created first (`metadata.creationTimestamp`, oldest wins), then
//! - the smaller `namespace/name`.
//!
//! A Service without a creation time (a manifest that sets none) counts as newer than
//! every Service that has one. The owner depends only on the claimants, never on the
//! order their updates arrived in, so it is the same after an agent restart; it is
//! decided again as soon as any claimant changes or goes (see [`Claims::set`]).

use std::{cmp::Ordering, collections::BTreeSet};

use crate::fasthash::HashMap;

use super::ObjKey;
use crate::model::{Frontend, ServiceEntry};

/// The order in which claimants win: smaller is stronger.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Rank {
    /// Unix seconds of `creationTimestamp`; `None` sorts after every time.
    pub created: Option<i64>,
    pub key: ObjKey,
}

impl Rank {
    pub fn new(created: Option<i64>, key: ObjKey) -> Self {
        Self { created, key }
    }
}

impl Ord for Rank {
    fn cmp(&self, other: &Self) -> Ordering {
        let created = match (self.created, other.created) {
            (Some(a), Some(b)) => a.cmp(&b),
            (Some(_), None) => Ordering::Less,
            (None, Some(_)) => Ordering::Greater,
            (None, None) => Ordering::Equal,
        };
        created.then_with(|| self.key.cmp(&other.key))
    }
}

impl PartialOrd for Rank {
    fn partial_cmp(&self, other: &Self) -> Option<Ordering> {
        Some(self.cmp(other))
    }
}

/// Who claims which frontend, and so who owns it.
///
/// Compact, as every Service is in it (one claimant per frontend in a cluster whose
/// addresses are unique): a frontend's claimants are a sorted vector (one 48-byte
/// allocation for one claimant; a `BTreeSet` allocated a 540-byte node for it), a
/// Service's frontends a sorted boxed slice.
#[derive(Debug, Default)]
pub struct Claims {
    /// Each frontend's claimants, strongest first, each once.
    by_frontend: HashMap<Frontend, Vec<Rank>>,
    /// Each claimant's rank and frontends (sorted, unique).
    by_service: HashMap<ObjKey, (Rank, Box<[Frontend]>)>,
}

impl Claims {
    /// Records that `rank.key` claims exactly `frontends` now (empty: the Service is
    /// gone). Returns every frontend whose set of claimants changed: their owner may
    /// have changed and must be written again.
    pub fn set(&mut self, rank: Rank, frontends: BTreeSet<Frontend>) -> BTreeSet<Frontend> {
        let mut touched = BTreeSet::new();
        let key = rank.key.clone();
        let old = self.by_service.remove(&key);
        if let Some((old_rank, old_fes)) = &old {
            for fe in old_fes.iter() {
                if old_rank != &rank || !frontends.contains(fe) {
                    self.unclaim(fe, old_rank);
                    touched.insert(*fe);
                }
            }
        }
        for fe in &frontends {
            let unchanged = old
                .as_ref()
                .is_some_and(|(r, f)| r == &rank && f.binary_search(fe).is_ok());
            if !unchanged {
                let claimants = self.by_frontend.entry(*fe).or_default();
                if let Err(at) = claimants.binary_search(&rank) {
                    claimants.insert(at, rank.clone());
                }
                touched.insert(*fe);
            }
        }
        if !frontends.is_empty() {
            // A BTreeSet iterates in order: the slice is sorted.
            self.by_service
                .insert(key, (rank, frontends.into_iter().collect()));
        }
        touched
    }

    fn unclaim(&mut self, fe: &Frontend, rank: &Rank) {
        if let Some(claimants) = self.by_frontend.get_mut(fe) {
            if let Ok(at) = claimants.binary_search(rank) {
                claimants.remove(at);
            }
            if claimants.is_empty() {
                self.by_frontend.remove(fe);
            }
        }
    }

    /// The Service owning `fe`, if anyone claims it.
    pub fn owner(&self, fe: &Frontend) -> Option<&ObjKey> {
        self.by_frontend
            .get(fe)
            .and_then(|s| s.first())
            .map(|r| &r.key)
    }

    /// The claimants of `fe` that do not own it.
    pub fn losers(&self, fe: &Frontend) -> impl Iterator<Item = &ObjKey> {
        self.by_frontend
            .get(fe)
            .into_iter()
            .flat_map(|s| s.iter().skip(1))
            .map(|r| &r.key)
    }

    /// Every claimed frontend.
    pub fn frontends(&self) -> impl Iterator<Item = &Frontend> {
        self.by_frontend.keys()
    }

    /// The frontends a Service claims (sorted).
    pub fn of(&self, key: &ObjKey) -> Option<&[Frontend]> {
        self.by_service.get(key).map(|(_, f)| &**f)
    }

    pub fn clear(&mut self) {
        self.by_frontend.clear();
        self.by_service.clear();
    }
}

/// The order frontends are written in: the local-only twins of `externalTrafficPolicy:
/// Local` frontends first, so a frontend never carries `ETP_LOCAL` before its twin exists
/// (the datapath also falls back to the frontend itself meanwhile); otherwise stable.
pub fn write_order(entries: &mut [ServiceEntry]) {
    entries.sort_by_key(|e| std::cmp::Reverse(e.frontend.scope));
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::Proto;

    fn fe(last: u8) -> Frontend {
        Frontend::new([10, 96, 0, last], 80, Proto::Tcp)
    }

    fn rank(t: Option<i64>, name: &str) -> Rank {
        Rank::new(t, ObjKey::new("default", name))
    }

    #[test]
    fn the_oldest_then_the_smallest_name_wins_whatever_the_arrival_order() {
        let claimants = [
            rank(None, "a-no-time"),
            rank(Some(200), "b"),
            rank(Some(100), "z-oldest"),
            rank(Some(200), "a"),
        ];
        let orders: [[usize; 4]; 3] = [[0, 1, 2, 3], [3, 2, 1, 0], [1, 3, 0, 2]];
        for order in orders {
            let mut c = Claims::default();
            for i in order {
                c.set(claimants[i].clone(), [fe(10)].into());
            }
            assert_eq!(c.owner(&fe(10)).map(|k| &*k.name), Some("z-oldest"));
            let losers: Vec<&str> = c.losers(&fe(10)).map(|k| &*k.name).collect();
            assert_eq!(losers, ["a", "b", "a-no-time"]);
        }
    }

    #[test]
    fn the_owner_is_decided_again_when_a_claimant_goes() {
        let mut c = Claims::default();
        c.set(rank(Some(1), "old"), [fe(10), fe(11)].into());
        let touched = c.set(rank(Some(2), "new"), [fe(10)].into());
        assert_eq!(touched, [fe(10)].into());
        assert_eq!(c.owner(&fe(10)).map(|k| &*k.name), Some("old"));
        // The owner drops fe(10): the other claimant takes it over.
        let touched = c.set(rank(Some(1), "old"), [fe(11)].into());
        assert_eq!(touched, [fe(10)].into());
        assert_eq!(c.owner(&fe(10)).map(|k| &*k.name), Some("new"));
        // The last claimant goes: nobody owns it.
        let touched = c.set(rank(Some(2), "new"), BTreeSet::new());
        assert_eq!(touched, [fe(10)].into());
        assert_eq!(c.owner(&fe(10)), None);
        assert!(c.of(&ObjKey::new("default", "new")).is_none());
        // Re-claiming the same frontends with the same rank touches nothing.
        assert!(c.set(rank(Some(1), "old"), [fe(11)].into()).is_empty());
    }

    #[test]
    fn twins_are_written_first() {
        let main = ServiceEntry::new(fe(10), []);
        let twin = ServiceEntry::new(fe(10).with_scope(proxy_common::scope::EXTERNAL_LOCAL), []);
        let other = ServiceEntry::new(fe(11), []);
        let mut v = vec![main.clone(), other.clone(), twin.clone()];
        write_order(&mut v);
        assert_eq!(v, [twin, main, other]);
    }
}
