//! Frontend conflicts: two Services claiming one `ip:port/proto` (possible with the
//! manifests source, and in a cluster with `externalIPs` or load-balancer IPs; the API
//! server keeps ClusterIPs unique). kube-proxy has no rule for it (iptables keeps both
//! rules and the first one matching wins); here exactly one Service owns the frontend:
//!
//! - the one that holds it: the claimant the maps serve it for now (its reverse-NAT
//!   entry names the Service, so this survives an agent restart: the pins say who
//!   holds it). A new claimant never takes a live frontend away, whatever its age or
//!   name; otherwise, for a frontend nobody holds (or whose holder stopped claiming it):
//! - the one created first (`metadata.creationTimestamp`, oldest wins), then
//! - the smaller `namespace/name`.
//!
//! A Service without a creation time counts as newer than every Service that has one
//! (the manifests source gives one the time it first read it). Among claimants that
//! nobody holds, the owner depends only on the claimants, never on the order their
//! updates arrived in; it is decided again as soon as any claimant changes or goes
//! (see [`Claims::set`]).

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

    /// The Service owning `fe`, if anyone claims it: the claimant `held_by` names (the
    /// reverse-NAT name the maps hold for `fe`, see [`names_service`]) if it still
    /// claims `fe`, else the strongest.
    pub fn owner(&self, fe: &Frontend, held_by: Option<&str>) -> Option<&ObjKey> {
        let claimants = self.by_frontend.get(fe)?;
        held_by
            .and_then(|name| claimants.iter().find(|r| names_service(name, &r.key)))
            .or_else(|| claimants.first())
            .map(|r| &r.key)
    }

    /// Whether more than one Service claims `fe` (else it has no losers).
    pub fn contested(&self, fe: &Frontend) -> bool {
        self.by_frontend.get(fe).is_some_and(|c| c.len() > 1)
    }

    /// The claimants of `fe` that do not own it (`held_by` as in [`Self::owner`]).
    pub fn losers<'a>(
        &'a self,
        fe: &Frontend,
        held_by: Option<&str>,
    ) -> impl Iterator<Item = &'a ObjKey> + 'a {
        let owner = self.owner(fe, held_by);
        self.by_frontend
            .get(fe)
            .into_iter()
            .flatten()
            .map(|r| &r.key)
            .filter(move |k| Some(*k) != owner)
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

/// Whether `stored`, a reverse-NAT name as the maps hold it (`namespace/name` or
/// `namespace/name:port`, cut at `NAME_LEN` bytes), was written for Service `key`. A
/// name cut short matches every Service whose name starts with it (the strongest such
/// claimant is taken: names that long and alike are not expected).
pub fn names_service(stored: &str, key: &ObjKey) -> bool {
    let full = key.to_string();
    match stored.strip_prefix(full.as_str()) {
        Some(rest) => rest.is_empty() || rest.starts_with(':'),
        None => stored.len() >= proxy_common::NAME_LEN - 3 && full.starts_with(stored),
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
            assert_eq!(c.owner(&fe(10), None).map(|k| &*k.name), Some("z-oldest"));
            let losers: Vec<&str> = c.losers(&fe(10), None).map(|k| &*k.name).collect();
            assert_eq!(losers, ["a", "b", "a-no-time"]);
        }
    }

    #[test]
    fn the_owner_is_decided_again_when_a_claimant_goes() {
        let mut c = Claims::default();
        c.set(rank(Some(1), "old"), [fe(10), fe(11)].into());
        let touched = c.set(rank(Some(2), "new"), [fe(10)].into());
        assert_eq!(touched, [fe(10)].into());
        assert_eq!(c.owner(&fe(10), None).map(|k| &*k.name), Some("old"));
        // The owner drops fe(10): the other claimant takes it over.
        let touched = c.set(rank(Some(1), "old"), [fe(11)].into());
        assert_eq!(touched, [fe(10)].into());
        assert_eq!(c.owner(&fe(10), None).map(|k| &*k.name), Some("new"));
        // The last claimant goes: nobody owns it.
        let touched = c.set(rank(Some(2), "new"), BTreeSet::new());
        assert_eq!(touched, [fe(10)].into());
        assert_eq!(c.owner(&fe(10), None), None);
        assert!(c.of(&ObjKey::new("default", "new")).is_none());
        // Re-claiming the same frontends with the same rank touches nothing.
        assert!(c.set(rank(Some(1), "old"), [fe(11)].into()).is_empty());
    }

    #[test]
    fn the_holder_keeps_its_frontend_whatever_the_newcomer() {
        let mut c = Claims::default();
        c.set(rank(None, "web"), [fe(10)].into());
        // A newcomer that is older and sorts first would win a frontend nobody holds...
        c.set(rank(Some(1), "aaa-copy"), [fe(10)].into());
        assert_eq!(c.owner(&fe(10), None).map(|k| &*k.name), Some("aaa-copy"));
        // ...but the maps serve it for web (as written, or adopted from the pins, cut
        // short or not): web keeps it.
        for held in ["default/web:http", "default/web"] {
            assert_eq!(c.owner(&fe(10), Some(held)).map(|k| &*k.name), Some("web"));
            let losers: Vec<&str> = c.losers(&fe(10), Some(held)).map(|k| &*k.name).collect();
            assert_eq!(losers, ["aaa-copy"]);
        }
        // A holder that no longer claims it: the strongest claimant takes it.
        c.set(rank(None, "web"), BTreeSet::new());
        let held = Some("default/web:http");
        assert_eq!(c.owner(&fe(10), held).map(|k| &*k.name), Some("aaa-copy"));
        assert_eq!(c.losers(&fe(10), held).count(), 0);
    }

    #[test]
    fn a_stored_name_names_its_service_only() {
        let web = ObjKey::new("default", "web");
        assert!(names_service("default/web", &web));
        assert!(names_service("default/web:http", &web));
        assert!(!names_service("default/web2:http", &web));
        assert!(!names_service("default/we", &web));
        assert!(!names_service("other/web", &web));
        // A name the maps cut at NAME_LEN bytes names the Service it starts.
        let long = ObjKey::new("default", "x".repeat(80));
        let stored =
            crate::model::name_from_bytes(&crate::model::name_bytes(&format!("{long}:http")));
        assert_eq!(stored.len(), proxy_common::NAME_LEN);
        assert!(names_service(&stored, &long));
        assert!(!names_service(
            &stored,
            &ObjKey::new("default", "y".repeat(80))
        ));
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
