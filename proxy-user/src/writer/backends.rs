//! The writer's backends: every live backend id with its backend and reference count, and
//! the canonical id of each backend. Compact because there are many (500,000 at 50,000
//! Services x 10 endpoints): ids are dense (the lowest free one is allocated), so the
//! entries are a vector indexed by id, 24 bytes each, and the canonical ids are a hash
//! table of bare `u32` ids hashed and compared through that vector (5 bytes a bucket).
//! Before, a `HashMap<(Backend, Proto), u32>` (44-byte buckets: 46 MiB at 50,000, its
//! table one allocation of a power of two) and a `BTreeMap<u32, ((Backend, Proto), u32)>`
//! held the same backends twice.

use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr};

use hashbrown::HashTable;

use crate::model::{Backend, Proto};

use super::BackendKey;

/// A backend as the `BACKEND4/6` maps hold it (address, port, flags, protocol), with
/// its reference count. `tag` 0: a free id.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
struct Packed {
    addr: [u8; 16],
    port: u16,
    flags: u8,
    /// `LIVE | V6 | protocol index`.
    tag: u8,
}

const LIVE: u8 = 0x80;
const V6: u8 = 0x40;

#[derive(Clone, Copy, Debug, Default)]
struct Entry {
    key: Packed,
    refs: u32,
}

impl Packed {
    fn new((b, proto): &BackendKey) -> Self {
        let (addr, v6) = match b.addr.ip() {
            IpAddr::V4(a) => {
                let mut out = [0u8; 16];
                out[..4].copy_from_slice(&a.octets());
                (out, 0)
            }
            IpAddr::V6(a) => (a.octets(), V6),
        };
        let p = match proto {
            Proto::Tcp => 0,
            Proto::Udp => 1,
            Proto::Sctp => 2,
        };
        Self {
            addr,
            port: b.addr.port(),
            flags: b.flags,
            tag: LIVE | v6 | p,
        }
    }

    fn key(&self) -> BackendKey {
        let ip = if self.tag & V6 != 0 {
            IpAddr::V6(Ipv6Addr::from(self.addr))
        } else {
            let mut a = [0u8; 4];
            a.copy_from_slice(&self.addr[..4]);
            IpAddr::V4(Ipv4Addr::from(a))
        };
        let proto = match self.tag & 0x3 {
            0 => Proto::Tcp,
            1 => Proto::Udp,
            _ => Proto::Sctp,
        };
        (
            Backend {
                addr: SocketAddr::new(ip, self.port),
                flags: self.flags,
            },
            proto,
        )
    }

    fn live(&self) -> bool {
        self.tag & LIVE != 0
    }
}

/// Live backend ids, their backends and reference counts; the canonical id per backend.
#[derive(Clone, Default)]
pub(super) struct Backends {
    /// Indexed by id (0 is never used).
    by_id: Vec<Entry>,
    /// The canonical id of each backend (adoption can find one backend under two ids:
    /// the first is canonical, the other is only referenced by the slots naming it).
    ids: HashTable<u32>,
    live: usize,
    hasher: foldhash::fast::RandomState,
}

impl std::fmt::Debug for Backends {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_map().entries(self.iter()).finish()
    }
}

impl Backends {
    fn hash(hasher: &foldhash::fast::RandomState, k: &Packed) -> u64 {
        use std::hash::BuildHasher as _;
        hasher.hash_one(k)
    }

    fn entry(&self, id: u32) -> Option<&Entry> {
        self.by_id.get(id as usize).filter(|e| e.key.live())
    }

    /// The canonical id of `key`.
    pub(super) fn id_of(&self, key: &BackendKey) -> Option<u32> {
        let k = Packed::new(key);
        let by_id = &self.by_id;
        self.ids
            .find(Self::hash(&self.hasher, &k), |id| {
                by_id[*id as usize].key == k
            })
            .copied()
    }

    /// Backend and reference count of a live id.
    pub(super) fn get(&self, id: u32) -> Option<(BackendKey, u32)> {
        self.entry(id).map(|e| (e.key.key(), e.refs))
    }

    /// The address of a live id's backend.
    pub(super) fn addr(&self, id: u32) -> Option<SocketAddr> {
        self.get(id).map(|((b, _), _)| b.addr)
    }

    /// The reference count of a live id, to change.
    pub(super) fn refs_mut(&mut self, id: u32) -> Option<&mut u32> {
        self.by_id
            .get_mut(id as usize)
            .filter(|e| e.key.live())
            .map(|e| &mut e.refs)
    }

    /// Records the free id `id` for `key` with `refs` references; it becomes the
    /// canonical id of `key` if `key` has none (`canonical`: replacing the one it has).
    pub(super) fn insert(&mut self, id: u32, key: BackendKey, refs: u32, canonical: bool) {
        let k = Packed::new(&key);
        let i = id as usize;
        if self.by_id.len() <= i {
            self.by_id.resize(i + 1, Entry::default());
        }
        debug_assert!(!self.by_id[i].key.live(), "backend id {id} in use");
        if self.by_id[i].key.live() {
            self.remove(id);
        }
        self.by_id[i] = Entry { key: k, refs };
        self.live += 1;
        let hash = Self::hash(&self.hasher, &k);
        let (by_id, hasher) = (&self.by_id, &self.hasher);
        match self.ids.find_mut(hash, |j| by_id[*j as usize].key == k) {
            Some(j) if canonical => *j = id,
            Some(_) => {}
            None => {
                self.ids
                    .insert_unique(hash, id, |j| Self::hash(hasher, &by_id[*j as usize].key));
            }
        }
    }

    /// Forgets a live id (and its backend's canonical id, if it is that one).
    pub(super) fn remove(&mut self, id: u32) -> Option<BackendKey> {
        let e = *self.entry(id)?;
        let hash = Self::hash(&self.hasher, &e.key);
        if let Ok(found) = self.ids.find_entry(hash, |j| *j == id) {
            found.remove();
        }
        self.by_id[id as usize] = Entry::default();
        self.live -= 1;
        // Keep the vector as short as the highest live id (ids are allocated lowest
        // first, so it only has holes of ids freed meanwhile).
        while self.by_id.last().is_some_and(|e| !e.key.live()) {
            self.by_id.pop();
        }
        Some(e.key.key())
    }

    pub(super) fn len(&self) -> usize {
        self.live
    }

    /// Every live id in id order, with its backend and reference count.
    pub(super) fn iter(&self) -> impl Iterator<Item = (u32, (BackendKey, u32))> + '_ {
        self.by_id
            .iter()
            .enumerate()
            .filter(|(_, e)| e.key.live())
            .map(|(id, e)| (id as u32, (e.key.key(), e.refs)))
    }

    /// The backends of the canonical ids (every distinct backend once).
    pub(super) fn keys(&self) -> impl Iterator<Item = BackendKey> + '_ {
        self.ids.iter().map(|id| self.by_id[*id as usize].key.key())
    }

    /// Room for `n` more backends.
    pub(super) fn reserve(&mut self, n: usize) {
        // Ids are dense: the entries grow by about as many.
        self.by_id.reserve(n);
        let (by_id, hasher) = (&self.by_id, &self.hasher);
        self.ids
            .reserve(n, |j| Self::hash(hasher, &by_id[*j as usize].key));
    }

    /// Gives back the slack of a bulk build (adoption).
    pub(super) fn shrink_to_fit(&mut self) {
        self.by_id.shrink_to_fit();
        let (by_id, hasher) = (&self.by_id, &self.hasher);
        self.ids
            .shrink_to_fit(|j| Self::hash(hasher, &by_id[*j as usize].key));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn key(s: &str, proto: Proto, flags: u8) -> BackendKey {
        (
            Backend {
                addr: s.parse().expect("a socket address"),
                flags,
            },
            proto,
        )
    }

    #[test]
    fn keys_round_trip_and_canonical_ids_follow_removals() {
        let mut b = Backends::default();
        let a = key("10.0.0.1:80", Proto::Tcp, 0);
        let a_udp = key("10.0.0.1:80", Proto::Udp, 0);
        let a_term = key("10.0.0.1:80", Proto::Tcp, 1);
        let v6 = key("[fd00::1]:8080", Proto::Sctp, 3);
        b.insert(1, a, 0, false);
        b.insert(2, a_udp, 2, false);
        b.insert(3, a_term, 0, false);
        b.insert(5, v6, 1, false);
        assert_eq!(b.len(), 4);
        for (id, k) in [(1, a), (2, a_udp), (3, a_term), (5, v6)] {
            assert_eq!(b.id_of(&k), Some(id));
            assert_eq!(b.get(id).map(|(k, _)| k), Some(k));
        }
        assert_eq!(b.get(2), Some((a_udp, 2)));
        assert_eq!(b.get(4), None);
        assert_eq!(b.get(9), None);
        // A second id of one backend (adoption): not canonical unless asked.
        b.insert(4, a, 0, false);
        assert_eq!(b.id_of(&a), Some(1));
        assert_eq!(b.remove(4), Some(a));
        assert_eq!(
            b.id_of(&a),
            Some(1),
            "removing the other id keeps the canonical one"
        );
        b.insert(4, a, 0, false);
        assert_eq!(b.remove(1), Some(a));
        assert_eq!(
            b.id_of(&a),
            None,
            "the canonical id removed: none until a new one"
        );
        assert_eq!(b.get(4).map(|(k, _)| k), Some(a));
        *b.refs_mut(5).expect("live") += 1;
        assert_eq!(b.get(5), Some((v6, 2)));
        assert_eq!(
            b.iter().map(|(id, _)| id).collect::<Vec<_>>(),
            vec![2, 3, 4, 5]
        );
        assert_eq!(b.remove(5), Some(v6));
        assert_eq!(b.remove(5), None);
        assert_eq!(b.by_id.len(), 5, "trailing free ids are dropped");
        let mut keys: Vec<_> = b.keys().collect();
        keys.sort();
        assert_eq!(keys, {
            let mut k = vec![a_udp, a_term];
            k.sort();
            k
        });
    }
}
