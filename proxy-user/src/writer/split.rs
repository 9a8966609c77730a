//! One group of a batched sync's phase written ([`Writer::write_group`]): a large group
//! in two halves at once when the store writes them on two CPUs
//! ([`MapStore::splits_batches`]; the kernel's hash-map inserts, each a per-element
//! allocation and memory-cgroup charge, scale across CPUs), else as one batch. The ops
//! of one group in one phase are on distinct entries (see the module doc of `writer`),
//! so the halves may land in any order; the phases stay in order (each waits for both
//! halves), so no frontend is ever visible half-written.

use super::Writer;
use crate::store::{write_batch, BatchFailed, MapStore, Op, StoreError};

/// A group of at least this many ops is written in two halves at once (when the store
/// splits batches): below it, a second thread costs more than it saves.
pub const SPLIT_MIN_OPS: usize = 4096;

impl<S: MapStore> Writer<S> {
    /// Writes `ops` (one group, distinct entries; `undo[i]` undoes `ops[i]`): `Ok(undo)`.
    /// `Err`: the undo ops of exactly the ops that were written (the caller undoes
    /// them), and the error of the op that failed (written one by one, its own error).
    pub(super) fn write_group(
        &mut self,
        ops: Vec<Op>,
        undo: Vec<Op>,
    ) -> Result<Vec<Op>, (Vec<Op>, StoreError)> {
        let split = ops.len() >= SPLIT_MIN_OPS
            && ops
                .first()
                .is_some_and(|op| self.store.splits_batches(op.group()));
        if !split {
            return match write_batch(&mut self.store, &ops, &mut self.counts) {
                Ok(()) => Ok(undo),
                Err((i, e)) => Err((undo.into_iter().take(i).collect(), e)),
            };
        }
        let mid = ops.len() / 2;
        let (a, b) = ops.split_at(mid);
        let results = self.store.apply_batch_pair(a, b);
        self.counts.split += 1;
        // Each half: what its batch call applied, then the rest one by one (as
        // `write_batch` finishes a failed batch).
        let mut written: [usize; 2] = [0, 0];
        let mut failure = None;
        for (h, (half, result)) in [a, b].into_iter().zip(results).enumerate() {
            self.counts.batch_calls += 1;
            let from = match result {
                Ok(()) => half.len(),
                Err(BatchFailed { applied, error }) => {
                    tracing::debug!(group = ?half[0].group(), ops = half.len(), applied, %error,
                        "batch call (one half) failed; writing the rest one by one");
                    self.counts.fallbacks += 1;
                    applied.min(half.len())
                }
            };
            self.counts.batch += from as u64;
            written[h] = from;
            if failure.is_some() {
                continue;
            }
            for op in &half[from..] {
                match self.store.apply(op) {
                    Ok(()) => {
                        self.counts.single += 1;
                        written[h] += 1;
                    }
                    Err(e) => {
                        failure = Some(e);
                        break;
                    }
                }
            }
        }
        match failure {
            None => Ok(undo),
            Some(e) => {
                let mut applied: Vec<Op> = undo[..written[0]].to_vec();
                applied.extend_from_slice(&undo[mid..mid + written[1]]);
                Err((applied, e))
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{
        model::{Frontend, Proto, ServiceEntry},
        store::{BatchFault, MemStore},
    };

    /// `n` frontends of one backend each, none shared: every group of a first sync
    /// (backends, reverse NAT, the frontends' entries with their one slot) holds n ops.
    fn entries(n: u32) -> Vec<ServiceEntry> {
        (0..n)
            .map(|i| {
                let fe = Frontend::new(std::net::Ipv4Addr::from(0x0a60_0000 + i), 80, Proto::Tcp);
                let pods = [std::net::SocketAddr::from((
                    std::net::Ipv4Addr::from(0x0a01_0000 + i),
                    8080,
                ))];
                let mut e = ServiceEntry::new(fe, pods);
                e.name = format!("default/s{i}:http");
                e
            })
            .collect()
    }

    fn store(split: bool, capacity: Option<usize>, fault: Option<BatchFault>) -> MemStore {
        MemStore {
            split_batches: split,
            svc_capacity: capacity,
            batch_fault: fault,
            ..MemStore::default()
        }
    }

    #[test]
    fn split_groups_write_what_one_batch_writes() {
        // One round of frontends, every group of it large enough to be split.
        let n = 4096;
        assert!(n as usize >= SPLIT_MIN_OPS, "every group must be split");
        assert!(
            n as usize <= crate::writer::BATCH_CHUNK_FRONTENDS,
            "one round"
        );
        let mut split = Writer::new(store(true, None, None));
        let mut whole = Writer::new(store(false, None, None));
        let a = split.sync(entries(n));
        let b = whole.sync(entries(n));
        assert!(a.errors.is_empty() && b.errors.is_empty());
        assert_eq!((a.ops, a.changed), (b.ops, b.changed));
        let d = split.store().dump().expect("dump");
        assert_eq!(d, split.expected_dump());
        assert_eq!(d, whole.store().dump().expect("dump"));
        // The backend, reverse-NAT and SVC groups went in two calls each.
        let (sc, wc) = (split.take_write_counts(), whole.take_write_counts());
        assert_eq!(wc.batch_calls, 3, "{wc:?}");
        assert_eq!(sc.batch_calls, wc.batch_calls + 3, "{sc:?} {wc:?}");
        assert_eq!((sc.split, wc.split), (3, 0));
        assert_eq!((sc.batch, sc.single), (wc.batch, wc.single));
        // Batches of at most half a group: the groups were split.
        assert!(split.store().batches.iter().all(|b| *b <= n as usize / 2));
    }

    /// A map that fills up in the middle of a split group: the writes of BOTH halves
    /// are undone (not only a prefix), the sync goes on frontend by frontend, and the
    /// maps end exactly as the model says and as without splitting.
    #[test]
    fn a_split_group_that_fails_undoes_exactly_what_both_halves_wrote() {
        let n = 4096;
        let cases = [
            // The second half's batch of the frontends' entries fills the map: the first
            // half is whole.
            (n as usize / 2 + 1000, None),
            // The first half's one-by-one tail fills the map after both halves' batch
            // calls stopped early: the second half's batch part must be undone too.
            (
                2000,
                Some(BatchFault {
                    after: 500,
                    errno: libc::ENOMEM,
                }),
            ),
        ];
        for (capacity, fault) in cases {
            let mut split = Writer::new(store(true, Some(capacity), fault));
            let mut whole = Writer::new(store(false, Some(capacity), fault));
            let a = split.sync(entries(n));
            let b = whole.sync(entries(n));
            assert!(!a.errors.is_empty(), "capacity {capacity}: nothing failed");
            assert_eq!(a.errors.len(), b.errors.len(), "capacity {capacity}");
            let d = split.store().dump().expect("dump");
            assert_eq!(d, split.expected_dump(), "capacity {capacity}");
            assert_eq!(
                d,
                whole.store().dump().expect("dump"),
                "capacity {capacity}"
            );
            // Every frontend that fits is programmed (one entry each).
            assert_eq!(d.frontends.len(), capacity, "capacity {capacity}");
        }
    }
}
