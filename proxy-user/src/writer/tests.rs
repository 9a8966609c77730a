//! Writer tests against the in-memory store.
//!
//! IP plan: frontends 10.96.0.0/16 (v4) and fd00:96::/64 (v6); pods 10.0.N.M:8080 and
//! fd00:10::N:8080. Every test compares the whole operation log or map dump with a golden
//! text, and every store used here checks after *each* operation that the datapath could
//! not see a half-written frontend.
//!
//! Over 600 lines: tests only (goldens of the update order).

use std::net::{IpAddr, SocketAddr};

use super::upsert::stable_layout;
use super::*;
use crate::{
    model::ServiceEntry,
    store::{BatchFailed, BatchFault, MemStore},
};

/// A store that, after every operation, checks what the datapath would see: every
/// frontend's slots 1..=count exist and name an existing backend. With `batches`, it
/// takes batch calls too, checked after every element of the batch (the kernel applies
/// a batch element by element: the datapath can see every prefix) and after the batch.
#[derive(Debug, Default)]
struct CheckingStore {
    inner: MemStore,
    /// Fail the operation after this many successful ones (once).
    fail_after: Option<usize>,
    /// Skip the consistency check (for maps damaged on purpose).
    lenient: bool,
    /// Accept batch calls.
    batches: bool,
    /// Make every batch call fail after this many elements (the fallback then writes
    /// the rest one by one).
    batch_fault: Option<BatchFault>,
}

impl MapStore for CheckingStore {
    fn apply(&mut self, op: &Op) -> Result<(), StoreError> {
        if let Some(n) = self.fail_after {
            if n == 0 {
                self.fail_after = None;
                return Err(StoreError::Full { map: "SVC4" });
            }
            self.fail_after = Some(n - 1);
        }
        self.inner.apply(op)?;
        if !self.lenient {
            assert_consistent(&self.inner.state, op);
        }
        Ok(())
    }

    fn dump(&self) -> Result<Dump, StoreError> {
        self.inner.dump()
    }

    fn supports_batch(&self, _: crate::store::Group) -> bool {
        self.batches
    }

    fn apply_batch(&mut self, ops: &[Op]) -> Result<(), BatchFailed> {
        MemStore::check_batch(ops);
        for (i, op) in ops.iter().enumerate() {
            if let Some(f) = self.batch_fault {
                if i == f.after {
                    self.inner.batches.push(i);
                    return Err(BatchFailed {
                        applied: i,
                        error: std::io::Error::from_raw_os_error(f.errno),
                    });
                }
            }
            if let Err(e) = self.apply(op) {
                self.inner.batches.push(i);
                return Err(BatchFailed {
                    applied: i,
                    error: std::io::Error::other(e.to_string()),
                });
            }
        }
        self.inner.batches.push(ops.len());
        if !self.lenient {
            assert_consistent(&self.inner.state, ops.last().expect("a batch has ops"));
        }
        Ok(())
    }
}

fn assert_consistent(d: &Dump, after: &Op) {
    for (fe, v) in &d.frontends {
        // A frontend asking for Maglev has its whole table: every chunk, one table size,
        // every entry within the table a slot number.
        if v.flags & proxy_common::svc_flags::MAGLEV != 0 && v.count > 0 {
            let first = d
                .maglev
                .get(&(v.service_id, 0))
                .unwrap_or_else(|| panic!("after `{after}`: {fe} has the Maglev flag, no table"));
            let m = first.table_size;
            let n = proxy_common::maglev::chunks(m);
            for c in 0..n {
                let chunk = d.maglev.get(&(v.service_id, c)).unwrap_or_else(|| {
                    panic!("after `{after}`: {fe} Maglev chunk {c} of {n} missing")
                });
                assert_eq!(chunk.table_size, m, "after `{after}`: {fe} chunk {c}");
                let used = (m as usize - c as usize * proxy_common::limits::MAGLEV_CHUNK_SLOTS)
                    .min(proxy_common::limits::MAGLEV_CHUNK_SLOTS);
                assert!(
                    chunk.slots[..used].iter().all(|s| *s != 0),
                    "after `{after}`: {fe} chunk {c} has an empty entry"
                );
            }
        }
        for slot in 1..=v.count {
            let id = d
                .slots
                .get(&(*fe, slot))
                .unwrap_or_else(|| panic!("after `{after}`: {fe} slot {slot} missing"));
            assert!(
                d.backends.contains_key(id),
                "after `{after}`: {fe} slot {slot} -> backend {id} missing"
            );
        }
    }
}

fn vip(s: &str, port: u16) -> Frontend {
    Frontend::new(s.parse::<IpAddr>().expect("ip"), port, Proto::Tcp)
}

fn pod(s: &str) -> SocketAddr {
    s.parse().expect("socket address")
}

fn svc(fe: Frontend, pods: &[&str]) -> ServiceEntry {
    ServiceEntry::new(fe, pods.iter().map(|p| pod(p)))
}

fn writer() -> Writer<CheckingStore> {
    Writer::new(CheckingStore::default())
}

fn log(w: &mut Writer<CheckingStore>) -> String {
    w.store_mut().inner.take_log()
}

fn dump(w: &Writer<CheckingStore>) -> String {
    w.store().inner.state.render()
}

const A: &str = "10.0.1.1:8080";
const B: &str = "10.0.2.1:8080";
const C: &str = "10.0.3.1:8080";
const D: &str = "10.0.4.1:8080";

/// Pods `10.0.i.1:8080` for `i` in `range` (pods 1 to 4 are A to D).
fn pods(range: std::ops::RangeInclusive<usize>) -> Vec<String> {
    range.map(|i| format!("10.0.{i}.1:8080")).collect()
}

/// A frontend served by `pods` (as [`svc`], for owned names).
fn svc_of(fe: Frontend, pods: &[String]) -> ServiceEntry {
    ServiceEntry::new(fe, pods.iter().map(|p| pod(p)))
}

/// The backend ids `1..=24` of a frontend's own entry, as a log line shows them.
const IDS_1_TO_24: &str = "[1 2 3 4 5 6 7 8 9 10 11 12 13 14 15 16 17 18 19 20 21 22 23 24]";

#[test]
fn install_writes_backends_revnat_slots_then_frontend() {
    let mut w = writer();
    let fe = vip("10.96.0.10", 80);
    // A Service of at most 24 backends is one SVC entry: its slots go in the frontend's
    // entry, written last.
    assert_eq!(w.upsert(&svc(fe, &[A, B, C])).expect("upsert"), 5);
    assert_eq!(
        log(&mut w),
        "\
put backend 1 = 10.0.1.1:8080/tcp
put backend 2 = 10.0.2.1:8080/tcp
put backend 3 = 10.0.3.1:8080/tcp
put revnat 1 = 10.96.0.10:80/tcp
put frontend 10.96.0.10:80/tcp id=1 count=3 flags=0x0 affinity=0 backends [1 2 3]
"
    );
    assert_eq!(
        dump(&w),
        "\
frontend 10.96.0.10:80/tcp id=1 count=3 flags=0x0 affinity=0
  slot 1 -> backend 1 (10.0.1.1:8080)
  slot 2 -> backend 2 (10.0.2.1:8080)
  slot 3 -> backend 3 (10.0.3.1:8080)
backend 1 = 10.0.1.1:8080/tcp flags=0x0
backend 2 = 10.0.2.1:8080/tcp flags=0x0
backend 3 = 10.0.3.1:8080/tcp flags=0x0
revnat 1 = 10.96.0.10:80/tcp
"
    );
    // The same entry again writes nothing; so does a reordering of its backends.
    assert_eq!(w.upsert(&svc(fe, &[A, B, C])).expect("upsert"), 0);
    assert_eq!(w.upsert(&svc(fe, &[C, A, B])).expect("upsert"), 0);
    assert_eq!(log(&mut w), "");

    // 26 backends: slots 25 and 26 in chunk 1, written before the frontend's entry.
    let mut w = writer();
    let big = vip("10.96.0.20", 80);
    assert_eq!(w.upsert(&svc_of(big, &pods(1..=26))).expect("upsert"), 29);
    let mut want: String = (1..=26)
        .map(|i| format!("put backend {i} = 10.0.{i}.1:8080/tcp\n"))
        .collect();
    want.push_str(&format!(
        "\
put revnat 1 = 10.96.0.20:80/tcp
put slots 10.96.0.20:80/tcp chunk 1 -> backends [25 26]
put frontend 10.96.0.20:80/tcp id=1 count=26 flags=0x0 affinity=0 backends {IDS_1_TO_24}
"
    ));
    assert_eq!(log(&mut w), want);
    assert_eq!(w.store().inner.chunks().len(), 1, "two SVC entries");
    assert_eq!(w.upsert(&svc_of(big, &pods(1..=26))).expect("upsert"), 0);
}

#[test]
fn grow_writes_new_slots_before_the_count() {
    let mut w = writer();
    let fe = vip("10.96.0.10", 80);
    // Within the frontend's own entry: the new slot and the count in one write.
    w.upsert(&svc(fe, &[A, B, C])).expect("upsert");
    log(&mut w);
    assert_eq!(w.upsert(&svc(fe, &[A, B, C, D])).expect("upsert"), 2);
    assert_eq!(
        log(&mut w),
        "\
put backend 4 = 10.0.4.1:8080/tcp
put frontend 10.96.0.10:80/tcp id=1 count=4 flags=0x0 affinity=0 backends [1 2 3 4]
"
    );
    // Past 24: a new chunk is written before the count reaches it ...
    let big = vip("10.96.0.20", 80);
    w.upsert(&svc_of(big, &pods(1..=24))).expect("upsert");
    log(&mut w);
    assert_eq!(w.upsert(&svc_of(big, &pods(1..=26))).expect("upsert"), 4);
    assert_eq!(
        log(&mut w),
        format!(
            "\
put backend 25 = 10.0.25.1:8080/tcp
put backend 26 = 10.0.26.1:8080/tcp
put slots 10.96.0.20:80/tcp chunk 1 -> backends [25 26]
put frontend 10.96.0.20:80/tcp id=2 count=26 flags=0x0 affinity=0 backends {IDS_1_TO_24}
"
        )
    );
    // ... and a chunk that grows is rewritten whole before the count reaches its new
    // slots.
    assert_eq!(w.upsert(&svc_of(big, &pods(1..=30))).expect("upsert"), 6);
    assert_eq!(
        log(&mut w),
        format!(
            "\
put backend 27 = 10.0.27.1:8080/tcp
put backend 28 = 10.0.28.1:8080/tcp
put backend 29 = 10.0.29.1:8080/tcp
put backend 30 = 10.0.30.1:8080/tcp
put slots 10.96.0.20:80/tcp chunk 1 -> backends [25 26 27 28 29 30]
put frontend 10.96.0.20:80/tcp id=2 count=30 flags=0x0 affinity=0 backends {IDS_1_TO_24}
"
        )
    );
}

#[test]
fn shrink_moves_tail_into_hole_then_count_then_deletes() {
    let mut w = writer();
    let fe = vip("10.96.0.10", 80);
    w.upsert(&svc(fe, &[A, B, C])).expect("upsert");
    log(&mut w);
    // Within the frontend's own entry: the tail moved into the hole and the count in one
    // write, then the backend.
    w.upsert(&svc(fe, &[A, C])).expect("upsert");
    assert_eq!(
        log(&mut w),
        "\
put frontend 10.96.0.10:80/tcp id=1 count=2 flags=0x0 affinity=0 backends [1 3]
del backend 2 (V4)
"
    );
    // A replacement reuses the freed id and only rewrites the one entry.
    w.upsert(&svc(fe, &[A, C, D])).expect("upsert");
    assert_eq!(
        log(&mut w),
        "\
put backend 2 = 10.0.4.1:8080/tcp
put frontend 10.96.0.10:80/tcp id=1 count=3 flags=0x0 affinity=0 backends [1 3 2]
"
    );

    // 30 -> 26 backends, a hole at slot 25 (chunk 1): the tail (slot 27) moves into it
    // while chunk 1 keeps the slots past the new count; then the count; then chunk 1
    // loses them; then the backends.
    let mut w = writer();
    let big = vip("10.96.0.20", 80);
    w.upsert(&svc_of(big, &pods(1..=30))).expect("upsert");
    log(&mut w);
    let mut kept = pods(1..=24);
    kept.extend(pods(26..=27));
    assert_eq!(w.upsert(&svc_of(big, &kept)).expect("upsert"), 7);
    assert_eq!(
        log(&mut w),
        format!(
            "\
put slots 10.96.0.20:80/tcp chunk 1 -> backends [27 26 27 28 29 30]
put frontend 10.96.0.20:80/tcp id=1 count=26 flags=0x0 affinity=0 backends {IDS_1_TO_24}
put slots 10.96.0.20:80/tcp chunk 1 -> backends [27 26]
del backend 25 (V4)
del backend 28 (V4)
del backend 29 (V4)
del backend 30 (V4)
"
        )
    );
    // A replacement reuses the lowest freed id and rewrites chunk 1 and the count.
    kept.extend(pods(31..=31));
    assert_eq!(w.upsert(&svc_of(big, &kept)).expect("upsert"), 3);
    assert_eq!(
        log(&mut w),
        format!(
            "\
put backend 25 = 10.0.31.1:8080/tcp
put slots 10.96.0.20:80/tcp chunk 1 -> backends [27 26 25]
put frontend 10.96.0.20:80/tcp id=1 count=27 flags=0x0 affinity=0 backends {IDS_1_TO_24}
"
        )
    );
}

#[test]
fn shrink_out_of_a_chunk_deletes_it_after_the_count() {
    let mut w = writer();
    let fe = vip("10.96.0.10", 80);
    w.upsert(&svc_of(fe, &pods(1..=30))).expect("upsert");
    log(&mut w);
    // 30 -> 20, a hole at slot 3: the tail (slot 21) moves into it in the frontend's
    // entry with the new count; chunk 1 (slots 25..=30) goes after it; then the backends.
    let mut kept = pods(1..=2);
    kept.extend(pods(4..=21));
    assert_eq!(w.upsert(&svc_of(fe, &kept)).expect("upsert"), 12);
    let mut want = "\
put frontend 10.96.0.10:80/tcp id=1 count=20 flags=0x0 affinity=0 \
backends [1 2 21 4 5 6 7 8 9 10 11 12 13 14 15 16 17 18 19 20]
del slots 10.96.0.10:80/tcp chunk 1
del backend 3 (V4)
"
    .to_string();
    for id in 22..=30 {
        want.push_str(&format!("del backend {id} (V4)\n"));
    }
    assert_eq!(log(&mut w), want);
    assert!(w.store().inner.chunks().is_empty());
    assert_eq!(w.store().dump().expect("dump"), w.expected_dump());
}

#[test]
fn zero_backends_keeps_the_frontend_with_count_zero() {
    let mut w = writer();
    let fe = vip("10.96.0.10", 80);
    w.upsert(&svc(fe, &[A])).expect("upsert");
    log(&mut w);
    w.upsert(&svc(fe, &[])).expect("upsert");
    assert_eq!(
        log(&mut w),
        "\
put frontend 10.96.0.10:80/tcp id=1 count=0 flags=0x0 affinity=0 backends []
del backend 1 (V4)
"
    );
    assert_eq!(
        dump(&w),
        "frontend 10.96.0.10:80/tcp id=1 count=0 flags=0x0 affinity=0\nrevnat 1 = 10.96.0.10:80/tcp\n"
    );
}

#[test]
fn shared_backends_are_reference_counted() {
    let mut w = writer();
    let http = vip("10.96.0.10", 80);
    let alt = vip("10.96.0.11", 80);
    w.upsert(&svc(http, &[A, B])).expect("upsert");
    w.upsert(&svc(alt, &[B, C])).expect("upsert");
    log(&mut w);
    assert_eq!(w.backend_count(), 3);
    w.remove(&http).expect("remove");
    assert_eq!(
        log(&mut w),
        "\
del frontend 10.96.0.10:80/tcp
del revnat 1 (V4)
del backend 1 (V4)
"
    );
    w.remove(&alt).expect("remove");
    assert_eq!(
        log(&mut w),
        "\
del frontend 10.96.0.11:80/tcp
del revnat 2 (V4)
del backend 2 (V4)
del backend 3 (V4)
"
    );
    assert_eq!(dump(&w), "");
    assert_eq!(w.remove(&alt).expect("remove absent"), 0);
}

#[test]
fn same_address_under_two_protocols_is_two_backends() {
    let mut w = writer();
    let tcp = vip("10.96.0.10", 53);
    let udp = Frontend::new(tcp.addr, 53, Proto::Udp);
    w.upsert(&svc(tcp, &["10.0.1.1:53"])).expect("upsert");
    w.upsert(&svc(udp, &["10.0.1.1:53"])).expect("upsert");
    assert_eq!(w.backend_count(), 2);
}

#[test]
fn ipv6_frontend_and_flags() {
    let mut w = writer();
    let fe = vip("fd00:96::10", 80);
    let mut e = svc(fe, &["[fd00:10::1]:8080"]);
    e.flags = proxy_common::svc_flags::AFFINITY;
    e.affinity_timeout = 10800;
    e.backends[0].flags = proxy_common::backend_flags::TERMINATING;
    w.upsert(&e).expect("upsert");
    assert_eq!(
        log(&mut w),
        "\
put backend 1 = [fd00:10::1]:8080/tcp flags=0x1
put revnat 1 = [fd00:96::10]:80/tcp
put frontend [fd00:96::10]:80/tcp id=1 count=1 flags=0x1 affinity=10800 backends [1]
"
    );
    // The endpoint stops terminating: a new backend id, swapped in one entry write.
    e.backends[0].flags = 0;
    w.upsert(&e).expect("upsert");
    assert_eq!(
        log(&mut w),
        "\
put backend 2 = [fd00:10::1]:8080/tcp
put frontend [fd00:96::10]:80/tcp id=1 count=1 flags=0x1 affinity=10800 backends [2]
del backend 1 (V6)
"
    );
}

#[test]
fn bad_entries_are_refused_before_any_write() {
    let mut w = writer();
    let fe = vip("10.96.0.10", 80);
    let cases = [
        (
            svc(fe, &[A, "[fd00:10::1]:8080"]),
            "family_mismatch",
            "is not of the frontend's address family",
        ),
        (svc(vip("10.96.0.10", 0), &[A]), "zero_port", "port 0"),
        (svc(fe, &["10.0.1.1:0"]), "zero_port", "has port 0"),
    ];
    for (entry, reason, text) in cases {
        let err = w.upsert(&entry).expect_err("must be refused");
        assert_eq!(err.reason().label(), reason);
        let msg = err.to_string();
        assert!(msg.contains(text), "{msg}");
        assert!(
            msg.contains("10.96.0.10:"),
            "error must name the frontend: {msg}"
        );
    }
    assert_eq!(log(&mut w), "");
    let too_many: Vec<SocketAddr> = (0..=u32::from(u16::MAX))
        .map(|i| SocketAddr::from(([10, 1, (i >> 8) as u8, i as u8], 1 + (i >> 16) as u16)))
        .collect();
    let err = w
        .upsert(&ServiceEntry::new(fe, too_many))
        .expect_err("too many");
    assert_eq!(err.reason().label(), "too_many_backends");
    assert_eq!(log(&mut w), "");
}

#[test]
fn a_failed_write_rolls_back_and_leaves_the_model_unchanged() {
    let fe = vip("10.96.0.10", 80);
    let other = vip("10.96.0.20", 80);
    // 30 backends -> 27: pods 25 and 28..=30 go (30 stays in `other`), pod 31 comes into
    // the hole at slot 25.
    let mut big_after = pods(1..=24);
    big_after.extend(pods(31..=31));
    big_after.extend(pods(26..=27));
    let cases = [
        // put backend D, put frontend (D in B's hole, slot 2), del backend B: three
        // failure points.
        (
            pods(1..=3),
            vec![C.to_string()],
            vec![A.to_string(), C.to_string(), D.to_string()],
            3,
        ),
        // put backend 31, put chunk 1 (31 in slot 25, the slots past 27 kept), put
        // frontend (count 27), put chunk 1 (trimmed), del backends 25, 28, 29: seven.
        (pods(1..=30), pods(30..=30), big_after, 7),
    ];
    for (initial, others, update, points) in cases {
        // Fail at every possible point of an update and check the result each time.
        let mut failures = 0;
        for fail_at in 0..points + 2 {
            let mut w = writer();
            w.upsert(&svc_of(fe, &initial)).expect("upsert");
            w.upsert(&svc_of(other, &others)).expect("upsert");
            let before = w.store().dump().expect("dump");
            w.store_mut().fail_after = Some(fail_at);
            let Err(err) = w.upsert(&svc_of(fe, &update)) else {
                // The update has fewer operations than fail_at: it went through.
                assert_eq!(w.store().dump().expect("dump"), w.expected_dump());
                continue;
            };
            failures += 1;
            assert_eq!(err.reason().label(), "map_full");
            assert!(err
                .to_string()
                .starts_with("frontend 10.96.0.10:80/tcp: map SVC4 is full"));
            assert!(!err.to_string().contains("incompletely"), "{err}");
            assert_eq!(w.store().dump().expect("dump"), before, "fail_at={fail_at}");
            assert_eq!(
                w.expected_dump(),
                before,
                "model changed, fail_at={fail_at}"
            );
            // And the writer still works afterwards.
            w.upsert(&svc_of(fe, &update)).expect("upsert");
            assert_eq!(w.store().dump().expect("dump"), w.expected_dump());
        }
        assert_eq!(failures, points, "{} backends", initial.len());
    }
}

#[test]
fn a_full_map_refuses_a_new_frontend_without_leftovers() {
    let mut w = Writer::new(MemStore {
        svc_capacity: Some(2),
        ..MemStore::default()
    });
    w.upsert(&svc(vip("10.96.0.10", 80), &[A, B]))
        .expect("fits: 1 entry");
    let before = w.store().dump().expect("dump");
    w.store_mut().take_log();
    // 26 backends: chunk 1 fits, the frontend's own entry does not.
    let wide = pods(11..=36);
    let err = w
        .upsert(&svc_of(vip("10.96.0.11", 80), &wide))
        .expect_err("needs 2 more");
    assert_eq!(err.reason().label(), "map_full");
    assert!(err.to_string().contains("10.96.0.11:80/tcp"), "{err}");
    assert_eq!(w.store().dump().expect("dump"), before);
    // The chunk written first (slots 25, 26: backend ids 27, 28) is undone.
    let svc_log: Vec<String> = w
        .store_mut()
        .take_log()
        .lines()
        .filter(|l| l.contains(" slots ") || l.contains(" frontend "))
        .map(str::to_string)
        .collect();
    assert_eq!(
        svc_log,
        [
            "put slots 10.96.0.11:80/tcp chunk 1 -> backends [27 28]",
            "del slots 10.96.0.11:80/tcp chunk 1",
        ]
    );
    assert!(w.store().chunks().is_empty());
    // The service id and backend ids it had reserved are free again.
    w.remove(&vip("10.96.0.10", 80)).expect("remove");
    w.upsert(&svc_of(vip("10.96.0.11", 80), &wide))
        .expect("fits now");
    let mut want = "frontend 10.96.0.11:80/tcp id=1 count=26 flags=0x0 affinity=0\n".to_string();
    for i in 1..=26 {
        want.push_str(&format!(
            "  slot {i} -> backend {i} (10.0.{}.1:8080)\n",
            i + 10
        ));
    }
    for i in 1..=26 {
        want.push_str(&format!(
            "backend {i} = 10.0.{}.1:8080/tcp flags=0x0\n",
            i + 10
        ));
    }
    want.push_str("revnat 1 = 10.96.0.11:80/tcp\n");
    assert_eq!(w.store().state.render(), want);
}

#[test]
fn sync_removes_undesired_and_continues_past_errors() {
    let mut w = writer();
    w.upsert(&svc(vip("10.96.0.1", 80), &[A])).expect("upsert");
    w.upsert(&svc(vip("10.96.0.2", 80), &[B])).expect("upsert");
    log(&mut w);
    let report = w.sync(vec![
        svc(vip("10.96.0.2", 80), &[B, C]),
        svc(vip("10.96.0.3", 80), &["[fd00::1]:80"]),
        svc(vip("10.96.0.4", 80), &[D]),
    ]);
    assert_eq!(report.removed, 1);
    assert_eq!(report.changed, 2);
    assert_eq!(report.errors.len(), 1);
    assert!(report.errors[0].to_string().contains("10.96.0.3:80/tcp"));
    let frontends: Vec<String> = w.frontends().map(|f| f.to_string()).collect();
    assert_eq!(frontends, ["10.96.0.2:80/tcp", "10.96.0.4:80/tcp"]);
    assert_eq!(w.store().dump().expect("dump"), w.expected_dump());
}

#[test]
fn adopt_rebuilds_the_model_and_deletes_orphans_only() {
    let mut first = writer();
    let http = vip("10.96.0.10", 80);
    let dns = Frontend::new("10.96.0.53".parse::<IpAddr>().expect("ip"), 53, Proto::Udp);
    first.upsert(&svc(http, &[A, B, C])).expect("upsert");
    first
        .upsert(&ServiceEntry::new(dns, [pod("10.0.1.1:53")]))
        .expect("upsert");
    let mut store = std::mem::take(first.store_mut());
    // Leftovers of an agent that died mid-update: a chunk of slots past the count, a
    // backend and a reverse-NAT entry nothing reaches.
    for op in [
        Op::PutBackend {
            id: 9,
            backend: Backend::new(pod(D)),
            proto: Proto::Tcp,
        },
        Op::PutChunk {
            frontend: http,
            chunk: 1,
            backends: vec![9].into(),
            service_id: 1,
            trim: false,
        },
        Op::PutRevNat {
            service_id: 7,
            frontend: vip("10.96.9.9", 80),
            name: "default/old".into(),
        },
    ] {
        store.inner.apply(&op).expect("apply");
    }
    store.inner.take_log();
    let (mut second, report) = Writer::adopt(store).expect("adopt");
    assert_eq!(
        report,
        AdoptReport {
            frontends: 2,
            backends: 4,
            orphans_deleted: 3,
            missing_slots: 0,
            repairs: BTreeMap::new(),
        }
    );
    assert_eq!(
        log(&mut second),
        "\
del slots 10.96.0.10:80/tcp chunk 1
del revnat 7 (V4)
del backend 9 (V4)
"
    );
    assert_eq!(second.store().dump().expect("dump"), second.expected_dump());
    // The adopted model is exact: re-applying the same state writes nothing, and ids
    // continue where the first writer stopped.
    assert_eq!(second.upsert(&svc(http, &[A, B, C])).expect("upsert"), 0);
    second
        .upsert(&svc(vip("10.96.0.11", 80), &[D]))
        .expect("upsert");
    assert_eq!(
        log(&mut second),
        "\
put backend 5 = 10.0.4.1:8080/tcp
put revnat 3 = 10.96.0.11:80/tcp
put frontend 10.96.0.11:80/tcp id=3 count=1 flags=0x0 affinity=0 backends [5]
"
    );
}

#[test]
fn adopt_repairs_a_missing_slot_on_the_next_write() {
    let mut first = writer();
    let fe = vip("10.96.0.10", 80);
    // And one of 26 backends (ids 3..=28), whose slot 26 (in chunk 1) is lost.
    let big = vip("10.96.0.20", 80);
    let wide = pods(11..=36);
    first.upsert(&svc(fe, &[A, B])).expect("upsert");
    first.upsert(&svc_of(big, &wide)).expect("upsert");
    let mut store = std::mem::take(first.store_mut());
    store.inner.state.slots.remove(&(fe, 2));
    store.inner.state.slots.remove(&(big, 26));
    store.lenient = true;
    store.inner.take_log();
    let (mut second, report) = Writer::adopt(store).expect("adopt");
    assert_eq!(report.missing_slots, 2);
    // Backends 2 and 28 were only reachable through the lost slots: orphans now.
    assert_eq!(
        log(&mut second),
        "del backend 2 (V4)\ndel backend 28 (V4)\n"
    );
    // The next write of each rewrites just the entry that lost a slot.
    second.upsert(&svc(fe, &[A, B])).expect("upsert");
    assert_eq!(
        log(&mut second),
        "\
put backend 2 = 10.0.2.1:8080/tcp
put frontend 10.96.0.10:80/tcp id=1 count=2 flags=0x0 affinity=0 backends [1 2]
"
    );
    second.upsert(&svc_of(big, &wide)).expect("upsert");
    assert_eq!(
        log(&mut second),
        "\
put backend 28 = 10.0.36.1:8080/tcp
put slots 10.96.0.20:80/tcp chunk 1 -> backends [27 28]
"
    );
    assert_eq!(second.store().dump().expect("dump"), second.expected_dump());
}

#[test]
fn stable_layout_keeps_slots_and_stays_dense() {
    assert_eq!(stable_layout(&[], &[3, 1, 2]), [3, 1, 2]);
    assert_eq!(stable_layout(&[1, 2, 3], &[3, 2, 1]), [1, 2, 3]);
    assert_eq!(stable_layout(&[1, 2, 3], &[1, 3]), [1, 3]);
    assert_eq!(stable_layout(&[1, 2, 3], &[2, 3]), [3, 2]);
    assert_eq!(stable_layout(&[1, 2, 3], &[1, 3, 4]), [1, 4, 3]);
    assert_eq!(stable_layout(&[1, 2, 3, 4, 5], &[5]), [5]);
    assert_eq!(stable_layout(&[1, 0, 3], &[1, 2, 3]), [1, 2, 3]);
    assert_eq!(stable_layout(&[1, 2], &[]), Vec::<u32>::new());
}

/// A small deterministic generator (xorshift) so the randomized test needs no crate.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }

    fn below(&mut self, n: u64) -> u64 {
        self.next() % n
    }
}

#[test]
fn random_changes_keep_maps_equal_to_the_model_at_every_step() {
    let mut rng = Rng(0x9e37_79b9_7f4a_7c15);
    let mut w = writer();
    let frontends: Vec<Frontend> = (0..6).map(|i| vip(&format!("10.96.0.{i}"), 80)).collect();
    let pods: Vec<String> = (0..64).map(|i| format!("10.0.{i}.1:8080")).collect();
    for step in 0..2000 {
        let fe = frontends[rng.below(frontends.len() as u64) as usize];
        if rng.below(5) == 0 {
            w.remove(&fe).expect("remove");
        } else {
            // Mostly a few backends; a third of the time up to 80 draws (of 64 pods),
            // past the 24 slots of a frontend's own entry and into further chunks.
            let n = if rng.below(3) == 0 {
                rng.below(80)
            } else {
                rng.below(7)
            } as usize;
            let chosen: Vec<&str> = (0..n)
                .map(|_| pods[rng.below(pods.len() as u64) as usize].as_str())
                .collect();
            w.upsert(&svc(fe, &chosen)).expect("upsert");
        }
        let actual = w.store().dump().expect("dump");
        assert_eq!(actual, w.expected_dump(), "step {step}");
        // The running totals the sizing reads are those of a count of every frontend.
        assert_eq!(w.services.tally, w.services.recount(), "step {step}");
        // No backend is leaked: every backend is in some slot.
        let used: HashSet<u32> = actual.slots.values().copied().collect();
        assert!(
            actual.backends.keys().all(|id| used.contains(id)),
            "step {step}"
        );
    }
    // A second writer adopting the result sees exactly the same state and no orphans.
    let store = std::mem::take(w.store_mut());
    let (second, report) = Writer::adopt(store).expect("adopt");
    assert_eq!(report.orphans_deleted, 0);
    assert_eq!(second.store().dump().expect("dump"), second.expected_dump());
    assert_eq!(second.services.tally, w.services.tally, "adopted totals");
}

#[test]
fn released_udp_backends_are_those_no_frontend_uses_any_more() {
    let mut w = writer();
    let dns = Frontend::new("10.96.0.10".parse::<IpAddr>().expect("ip"), 53, Proto::Udp);
    let dns2 = Frontend::new("10.96.0.11".parse::<IpAddr>().expect("ip"), 53, Proto::Udp);
    let web = vip("10.96.0.20", 80);
    w.upsert(&svc(dns, &[A, B, C])).expect("dns");
    w.upsert(&svc(dns2, &[C])).expect("dns2");
    w.upsert(&svc(web, &[A])).expect("web");
    assert!(w.take_released_udp().is_empty(), "nothing left yet");
    // A leaves dns (web still uses A over TCP: another backend), C leaves dns but dns2
    // keeps it: only A is released; B stays.
    w.upsert(&svc(dns, &[B])).expect("dns");
    assert_eq!(w.take_released_udp(), [pod(A)]);
    assert!(w.take_released_udp().is_empty(), "taken once");
    // A TCP backend leaving is not reported; a UDP frontend removed releases its own.
    w.remove(&web).expect("web");
    w.remove(&dns2).expect("dns2");
    assert_eq!(w.take_released_udp(), [pod(C)]);
    // Released and back within one batch: not reported.
    w.upsert(&svc(dns, &[])).expect("dns");
    w.upsert(&svc(dns, &[B])).expect("dns");
    assert!(w.take_released_udp().is_empty());
}

/// A frontend's repeated backends are written once each, whether few (found by a scan)
/// or many (a hash set): new, then rewritten unchanged (nothing written), on either path.
#[test]
fn repeated_backends_are_written_once_few_or_many() {
    for n in [3usize, 16, 17, 40] {
        for batched in [false, true] {
            let mut w = if batched { batch_writer() } else { writer() };
            let pods: Vec<String> = (1..=n)
                .map(|i| format!("10.0.{}.{}:8080", i / 200 + 1, i % 200 + 1))
                .collect();
            // Each backend twice, the second time after all the others.
            let repeated: Vec<&str> = pods.iter().chain(&pods).map(String::as_str).collect();
            let fe = vip("10.96.0.1", 80);
            let entry = svc(fe, &repeated);
            let others: Vec<ServiceEntry> = (2..40u8)
                .map(|i| svc(vip(&format!("10.96.0.{i}"), 80), &[A]))
                .collect();
            let report = w.sync(std::iter::once(entry.clone()).chain(others.clone()));
            assert!(report.errors.is_empty(), "n={n}: {:?}", report.errors);
            let state = &w.store().inner.state;
            let slots: Vec<u32> = state
                .slots
                .range((fe, 1)..=(fe, u16::MAX))
                .map(|(_, id)| *id)
                .collect();
            assert_eq!(
                slots.len(),
                n,
                "n={n} batched={batched}: one slot per backend"
            );
            assert_eq!(state.frontends[&fe].count as usize, n);
            let mut ids = slots.clone();
            ids.sort_unstable();
            ids.dedup();
            assert_eq!(ids.len(), n, "n={n}: a backend in two slots");
            let addrs: std::collections::BTreeSet<SocketAddr> =
                ids.iter().map(|id| state.backends[id].0.addr).collect();
            let want: std::collections::BTreeSet<SocketAddr> =
                pods.iter().map(|p| pod(p)).collect();
            assert_eq!(addrs, want, "n={n}");
            let again = w.sync(std::iter::once(entry).chain(others));
            assert_eq!(again.ops, 0, "n={n} batched={batched}: rewritten unchanged");
        }
    }
}

// ---- Batches -------------------------------------------------------------------------

fn batch_writer() -> Writer<CheckingStore> {
    Writer::new(CheckingStore {
        batches: true,
        ..CheckingStore::default()
    })
}

/// `n` frontends 10.96.1.i:80, frontend i with pods `i..i+k` of a pool of 64 (shared
/// backends between neighbours).
fn many(n: usize, k: usize, shift: usize) -> Vec<ServiceEntry> {
    (0..n)
        .map(|i| {
            let fe = vip(&format!("10.96.1.{i}"), 80);
            let pods: Vec<String> = (0..k)
                .map(|j| format!("10.0.{}.1:8080", (i + j + shift) % 64))
                .collect();
            let refs: Vec<&str> = pods.iter().map(String::as_str).collect();
            let mut e = svc(fe, &refs);
            e.name = format!("default/s{i}:http");
            e
        })
        .collect()
}

/// What the datapath serves, independent of ids: per frontend its value (without the
/// id), its backends in slot order, its reverse-NAT name.
fn served(d: &Dump) -> Vec<String> {
    d.frontends
        .iter()
        .map(|(fe, v)| {
            let backends: Vec<String> = (1..=v.count)
                .map(|s| {
                    let id = d.slots.get(&(*fe, s)).expect("slot");
                    d.backends.get(id).expect("backend").0.addr.to_string()
                })
                .collect();
            let name = d.revnat.get(&v.service_id).map(|(f, n)| {
                assert_eq!(f, fe, "reverse NAT of {fe}");
                n.clone()
            });
            format!(
                "{fe} count={} flags={:#x} {:?} {:?}",
                v.count, v.flags, backends, name
            )
        })
        .collect()
}

/// The index in the log of the first and last op matching `f`.
fn span(log: &[Op], f: impl Fn(&Op) -> bool) -> Option<(usize, usize)> {
    let first = log.iter().position(&f)?;
    let last = log.iter().rposition(&f)?;
    Some((first, last))
}

#[test]
fn a_large_sync_writes_one_batch_per_phase_in_the_update_order() {
    let mut w = batch_writer();
    let report = w.sync(many(40, 30, 0));
    assert!(report.errors.is_empty(), "{:?}", report.errors);
    assert_eq!(report.changed, 40);
    // 64 distinct backends, 40 reverse-NAT entries, 40 chunks of slots 25..=30, 40
    // frontends (with slots 1..=24): one batch each, in that order.
    assert_eq!(w.store().inner.batches, [64, 40, 40, 40]);
    let log = w.store().inner.log.clone();
    let log = &log;
    let backends = span(log, |op| matches!(op, Op::PutBackend { .. })).expect("backends");
    let revnat = span(log, |op| matches!(op, Op::PutRevNat { .. })).expect("revnat");
    let chunks = span(log, |op| matches!(op, Op::PutChunk { .. })).expect("chunks");
    let entries = span(log, |op| matches!(op, Op::PutFrontend { .. })).expect("frontends");
    assert!(backends.1 < revnat.0 && revnat.1 < chunks.0 && chunks.1 < entries.0);
    assert_eq!(report.ops, log.len());
    let counts = w.take_write_counts();
    assert_eq!(
        (counts.batch, counts.single, counts.fallbacks),
        (log.len() as u64, 0, 0)
    );
    assert_eq!(w.store().dump().expect("dump"), w.expected_dump());
    // The same as frontend by frontend.
    let mut seq = writer();
    seq.set_batch_threshold(usize::MAX);
    seq.sync(many(40, 30, 0));
    assert!(seq.store().inner.batches.is_empty());
    assert_eq!(
        served(&w.store().dump().expect("dump")),
        served(&seq.store().dump().expect("dump"))
    );
    assert_eq!(
        w.store().dump().expect("dump"),
        seq.store().dump().expect("dump"),
        "same ids too, from empty maps"
    );
    // Services of a few backends: one entry each, no chunk.
    let mut small = batch_writer();
    small.sync(many(40, 3, 0));
    assert_eq!(small.store().inner.batches, [42, 40, 40]);
}

#[test]
fn a_large_shrinking_sync_hides_slots_before_deleting_them_and_backends_last() {
    let mut w = batch_writer();
    w.sync(many(40, 30, 0));
    w.store_mut().inner.log.clear();
    w.store_mut().inner.batches.clear();
    // Ten frontends go away; of the others, ten shrink to 20 backends (out of their
    // chunk 1), twenty lose four (their count shrinks within chunk 1).
    let mut desired = many(30, 26, 0);
    for e in &mut desired[..10] {
        e.backends.truncate(20);
    }
    let report = w.sync(desired);
    assert!(report.errors.is_empty(), "{:?}", report.errors);
    assert_eq!((report.removed, report.changed), (10, 30));
    let log = &w.store().inner.log;
    let is_removed = |fe: &Frontend| match fe.addr {
        IpAddr::V4(a) => a.octets()[3] >= 30,
        IpAddr::V6(_) => false,
    };
    let hide = span(log, |op| matches!(op, Op::DelChunk { chunk: 0, .. })).expect("entry");
    let gone_slots = span(
        log,
        |op| matches!(op, Op::DelChunk { frontend, chunk } if *chunk > 0 && is_removed(frontend)),
    )
    .expect("removed slots");
    let count = span(log, |op| matches!(op, Op::PutFrontend { .. })).expect("counts");
    let trimmed = span(
        log,
        |op| matches!(op, Op::PutChunk { frontend, trim: true, .. } if !is_removed(frontend)),
    )
    .expect("trimmed chunks");
    let surplus = span(
        log,
        |op| matches!(op, Op::DelChunk { frontend, chunk } if *chunk > 0 && !is_removed(frontend)),
    )
    .expect("surplus chunks");
    assert!(
        !log.iter()
            .any(|op| matches!(op, Op::PutChunk { trim: false, .. })),
        "the shrunk chunks keep their ids past the new count until trimmed"
    );
    let del_backend = |op: &Op| matches!(op, Op::DelBackend { .. });
    // Removals: every removed frontend's entry first, then its further chunks, then
    // (before any update) the backends only they used.
    assert!(hide.1 < gone_slots.0);
    let removal_backends = span(&log[..count.0], del_backend).expect("removal backends");
    assert!(gone_slots.1 < removal_backends.0);
    // Shrinking: the counts go down before the chunks lose their surplus ids or go,
    // backends go last.
    assert!(count.1 < trimmed.0 && count.1 < surplus.0);
    let last = trimmed.1.max(surplus.1);
    assert!(!log[count.0..last].iter().any(del_backend));
    assert!(span(&log[last..], del_backend).is_some());
    assert_eq!(w.store().dump().expect("dump"), w.expected_dump());
    // Removals: 10 entries, 10 chunks 1, 10 reverse-NAT entries, the 5 backends only
    // they used (pods 59..=63). Updates: 30 frontend entries, 20 chunks 1 trimmed, 10
    // deleted, the 4 backends no longer used (pods 55..=58).
    assert_eq!(
        w.store().inner.batches,
        [10, 10, 10, 5, 30, 20, 10, 4],
        "{:?}",
        w.store().inner.batches
    );
}

#[test]
fn batched_and_one_by_one_syncs_serve_the_same_at_every_step() {
    let mut rng = Rng(0x2545_f491_4f6c_dd1d);
    let mut batched = batch_writer();
    batched.set_batch_threshold(0);
    let mut seq = writer();
    seq.set_batch_threshold(usize::MAX);
    for step in 0..150 {
        let n = rng.below(50) as usize;
        // Past 24 backends a frontend's slots take further chunks.
        let k = if rng.below(3) == 0 {
            rng.below(60)
        } else {
            rng.below(6)
        } as usize;
        let shift = rng.below(64) as usize;
        let mut desired = many(n, k, shift);
        // Some frontends keep their previous state, some flip a flag.
        for e in desired.iter_mut() {
            if rng.below(4) == 0 {
                e.flags = proxy_common::svc_flags::AFFINITY;
                e.affinity_timeout = 60;
            }
            if rng.below(5) == 0 {
                e.source_ranges = vec![("192.0.2.0".parse().expect("ip"), 24)];
            }
        }
        let a = batched.sync(desired.clone());
        let b = seq.sync(desired);
        assert!(a.errors.is_empty() && b.errors.is_empty(), "step {step}");
        for w in [&batched.services, &seq.services] {
            assert_eq!(w.tally, w.recount(), "step {step}");
        }
        assert_eq!(
            (a.changed, a.removed),
            (b.changed, b.removed),
            "step {step}"
        );
        let da = batched.store().dump().expect("dump");
        assert_eq!(da, batched.expected_dump(), "step {step}");
        assert_eq!(
            served(&da),
            served(&seq.store().dump().expect("dump")),
            "step {step}"
        );
        // No leaked backend.
        let used: HashSet<u32> = da.slots.values().copied().collect();
        assert!(
            da.backends.keys().all(|id| used.contains(id)),
            "step {step}"
        );
    }
    assert!(batched.take_write_counts().batch > 0);
    // And a writer adopting the result finds no orphans.
    let store = std::mem::take(batched.store_mut());
    let (second, report) = Writer::adopt(store).expect("adopt");
    assert_eq!(report.orphans_deleted, 0);
    assert_eq!(second.store().dump().expect("dump"), second.expected_dump());
}

#[test]
fn a_failing_batch_call_is_finished_element_by_element() {
    for errno in [libc::ENOMEM, libc::EINVAL, crate::batch::ENOTSUPP] {
        let mut w = Writer::new(CheckingStore {
            batches: true,
            batch_fault: Some(BatchFault { after: 5, errno }),
            ..CheckingStore::default()
        });
        let report = w.sync(many(40, 30, 0));
        assert!(report.errors.is_empty(), "{:?}", report.errors);
        let counts = w.take_write_counts();
        // Four batch calls (backends, reverse NAT, chunks 1, frontends), each failing
        // after 5 elements: 20 by batch, the rest alone.
        assert_eq!(counts.batch_calls, 4, "errno {errno}");
        assert_eq!(counts.fallbacks, 4);
        assert_eq!(counts.batch, 20);
        assert_eq!(counts.single, report.ops as u64 - 20);
        assert_eq!(w.store().dump().expect("dump"), w.expected_dump());
        let mut clean = batch_writer();
        clean.sync(many(40, 30, 0));
        assert_eq!(
            w.store().dump().expect("dump"),
            clean.store().dump().expect("dump")
        );
    }
}

#[test]
fn a_failed_element_in_a_batched_sync_undoes_it_and_names_the_frontend() {
    // Room for 40 frontends of 30 slots (2 entries each: their own and chunk 1) but not
    // for a 41st.
    let capacity = 40 * 2;
    let mut w = Writer::new(CheckingStore {
        batches: true,
        inner: MemStore {
            svc_capacity: Some(capacity),
            ..MemStore::default()
        },
        ..CheckingStore::default()
    });
    w.sync(many(40, 30, 0));
    let before = w.store().dump().expect("dump");
    w.take_write_counts();
    w.set_batch_threshold(0);
    // Ten frontends change their backends (pods 23..=29 of each, in slots 24..=30, are
    // replaced: chunk 1 and their own entry rewritten in place) and a 41st comes, which
    // does not fit: its chunk 1 fails in the batch that rewrites the ten chunks 1.
    let mut desired = many(30, 30, 0);
    let mut extra = many(41, 30, 64 - 7);
    desired.extend(extra.drain(30..));
    let report = w.sync(desired.clone());
    // The batched attempt failed on SVC4 and was undone; the one-by-one rerun names the
    // one frontend that does not fit and rolls back just it.
    assert_eq!(report.errors.len(), 1, "{:?}", report.errors);
    let err = report.errors[0].to_string();
    assert!(
        err.starts_with("frontend 10.96.1.40:80/tcp: map SVC is full"),
        "{err}"
    );
    assert!(!err.contains("incompletely"), "{err}");
    assert_eq!(report.errors[0].reason().label(), "map_full");
    assert_eq!(w.store().dump().expect("dump"), w.expected_dump());
    assert_eq!(w.frontends().count(), 40);
    assert_ne!(w.store().dump().expect("dump"), before);
    let counts = w.take_write_counts();
    assert!(counts.batch > 0 && counts.single > 0, "{counts:?}");
    // Exactly what a one-by-one writer does with the same input.
    let mut seq = Writer::new(CheckingStore {
        inner: MemStore {
            svc_capacity: Some(capacity),
            ..MemStore::default()
        },
        ..CheckingStore::default()
    });
    seq.set_batch_threshold(usize::MAX);
    seq.sync(many(40, 30, 0));
    let r = seq.sync(desired);
    assert!(seq.store().inner.batches.is_empty());
    assert_eq!(r.errors.len(), 1);
    assert_eq!(r.errors[0].to_string(), err);
    assert_eq!(
        served(&w.store().dump().expect("dump")),
        served(&seq.store().dump().expect("dump"))
    );
}

#[test]
fn adoption_deletes_many_orphans_in_batches() {
    let mut first = batch_writer();
    first.sync(many(40, 2, 0));
    let mut store = std::mem::take(first.store_mut());
    // An agent died after writing 40 backends and reverse-NAT entries nothing reaches.
    for i in 0..40u32 {
        for op in [
            Op::PutBackend {
                id: 1000 + i,
                backend: Backend::new(pod(&format!("10.9.0.{i}:80"))),
                proto: Proto::Tcp,
            },
            Op::PutRevNat {
                service_id: 1000 + i,
                frontend: vip(&format!("10.96.9.{i}"), 80),
                name: String::new(),
            },
        ] {
            store.inner.apply(&op).expect("apply");
        }
    }
    store.inner.take_log();
    store.inner.batches.clear();
    let (mut second, report) = Writer::adopt(store).expect("adopt");
    assert_eq!(report.orphans_deleted, 80);
    assert_eq!(second.store().inner.batches, [40, 40]);
    let log = second.store().inner.log.clone();
    let log = &log;
    let revnat = span(log, |op| matches!(op, Op::DelRevNat { .. })).expect("revnat");
    let backends = span(log, |op| matches!(op, Op::DelBackend { .. })).expect("backends");
    assert!(revnat.1 < backends.0);
    assert_eq!(second.take_write_counts().batch, 80);
    assert_eq!(second.store().dump().expect("dump"), second.expected_dump());
}

#[test]
fn node_addresses_go_through_the_writer_and_are_adopted() {
    let mut w = writer();
    let a: IpAddr = "192.0.2.10".parse().expect("ip");
    let b: IpAddr = "192.0.2.11".parse().expect("ip");
    let c: IpAddr = "2001:db8::10".parse().expect("ip");
    assert_eq!(w.set_node_addresses(&[a, b, c]).expect("write"), 4);
    assert_eq!(
        log(&mut w),
        "\
put node address 192.0.2.10
put node address 192.0.2.11
put node address 2001:db8::10
put node config snat4=192.0.2.10 snat6=2001:db8::10
"
    );
    assert_eq!(w.set_node_addresses(&[a, b, c]).expect("same"), 0);
    // b becomes the first v4 address: SNAT moves to it; a and c go.
    assert_eq!(w.set_node_addresses(&[b]).expect("write"), 3);
    assert_eq!(
        log(&mut w),
        "\
put node config snat4=192.0.2.11 snat6=none
del node address 192.0.2.10
del node address 2001:db8::10
"
    );
    assert_eq!(w.store().dump().expect("dump"), w.expected_dump());
    // A failed write is undone and the model stays.
    let before = w.store().dump().expect("dump");
    w.store_mut().fail_after = Some(1);
    w.set_node_addresses(&[a, c]).expect_err("fails");
    assert_eq!(w.store().dump().expect("dump"), before);
    assert_eq!(w.expected_dump(), before);
    log(&mut w);
    // A new writer adopts them: nothing to write.
    let store = std::mem::take(w.store_mut());
    let (mut second, _) = Writer::adopt(store).expect("adopt");
    assert_eq!(second.set_node_addresses(&[b]).expect("same"), 0);
    assert_eq!(second.store().dump().expect("dump"), second.expected_dump());
}

#[test]
fn localhost_is_a_node_port_address_never_the_snat_address() {
    let mut w = writer();
    let lo: IpAddr = "127.0.0.1".parse().expect("ip");
    let a: IpAddr = "192.0.2.10".parse().expect("ip");
    w.set_node_addresses(&[lo]).expect("write");
    assert_eq!(
        log(&mut w),
        "put node address 127.0.0.1\n",
        "no SNAT address from loopback"
    );
    w.set_node_addresses(&[lo, a]).expect("write");
    assert_eq!(
        log(&mut w),
        "put node address 192.0.2.10\nput node config snat4=192.0.2.10 snat6=none\n"
    );
}

// ---- Validation on adoption ------------------------------------------------------------

#[test]
fn adoption_repairs_corrupted_pins_and_trusts_no_broken_entry() {
    let mut first = writer();
    let web = vip("10.96.0.10", 80);
    let api = vip("10.96.0.11", 443);
    let dns = Frontend::new("10.96.0.53".parse::<IpAddr>().expect("ip"), 53, Proto::Udp);
    let mut e = svc(web, &[A, B]);
    e.name = "default/web:http".into();
    first.upsert(&e).expect("web");
    first.upsert(&svc(api, &[C])).expect("api");
    first
        .upsert(&ServiceEntry::new(dns, [pod("10.0.1.1:53")]))
        .expect("dns");
    let mut store = std::mem::take(first.store_mut());
    let web_id = store.inner.state.frontends[&web].service_id;
    let dns_backend = store.inner.state.slots[&(dns, 1)];
    // Corruption as a crashed or buggy agent could leave it:
    let s = &mut store.inner.state;
    // - a frontend holding web's service id (two services sharing one NAT id), its slot
    //   naming web's first backend;
    let twin = vip("10.96.0.12", 80);
    s.frontends.insert(
        twin,
        FrontendValue {
            service_id: web_id,
            count: 1,
            flags: 0,
            affinity_timeout: 0,
        },
    );
    let web_first = s.slots[&(web, 1)];
    s.slots.insert((twin, 1), web_first);
    // - api's count says 3 but only slot 1 exists, and slot 1 is fine;
    s.frontends.get_mut(&api).expect("api").count = 3;
    // - web's slot 2 names a backend that does not exist (dangling);
    s.slots.insert((web, 2), 99);
    // - a TCP slot naming dns's UDP backend;
    s.slots.insert((api, 2), dns_backend);
    store.lenient = true;
    store.inner.take_log();

    let (mut second, report) = Writer::adopt(store).expect("adopt");
    assert_eq!(
        report.repairs,
        BTreeMap::from([
            (Repair::DanglingSlot, 1),
            (Repair::DuplicateServiceId, 1),
            (Repair::MissingSlot, 1),
            (Repair::SlotBackendMismatch, 1),
        ])
    );
    assert_eq!(report.missing_slots, 3);
    let d = second.store().dump().expect("dump");
    // Ids unique again, every reverse-NAT entry names its frontend, the twin's entry
    // carries its new id.
    let ids: HashSet<u32> = d.frontends.values().map(|v| v.service_id).collect();
    assert_eq!(ids.len(), d.frontends.len(), "{}", d.render());
    for (fe, v) in &d.frontends {
        assert_eq!(
            d.revnat.get(&v.service_id).map(|(f, _)| f),
            Some(fe),
            "{fe}"
        );
    }
    assert_eq!(
        d.revnat[&web_id].1, "default/web:http",
        "web keeps its id and name"
    );
    assert_ne!(d.frontends[&twin].service_id, web_id);
    // The model believes nothing broken: the next sync rewrites every untrusted slot and
    // the maps equal the model, every frontend whole.
    let mut e = svc(web, &[A, B]);
    e.name = "default/web:http".into();
    let r = second.sync(vec![
        e,
        svc(api, &[C, D]),
        svc(twin, &[A]),
        ServiceEntry::new(dns, [pod("10.0.1.1:53")]),
    ]);
    assert!(r.errors.is_empty(), "{:?}", r.errors);
    let d = second.store().dump().expect("dump");
    assert_eq!(d, second.expected_dump());
    assert_consistent(
        &d,
        &Op::DelChunk {
            frontend: web,
            chunk: 0,
        },
    );
    assert_eq!(
        served(&d),
        [
            "10.96.0.10:80/tcp count=2 flags=0x0 [\"10.0.1.1:8080\", \"10.0.2.1:8080\"] Some(\"default/web:http\")",
            "10.96.0.11:443/tcp count=2 flags=0x0 [\"10.0.3.1:8080\", \"10.0.4.1:8080\"] Some(\"\")",
            "10.96.0.12:80/tcp count=1 flags=0x0 [\"10.0.1.1:8080\"] Some(\"\")",
            "10.96.0.53:53/udp count=1 flags=0x0 [\"10.0.1.1:53\"] Some(\"\")",
        ]
    );
    // A clean adoption repairs nothing.
    let store = std::mem::take(second.store_mut());
    let (_, report) = Writer::adopt(store).expect("adopt");
    assert!(report.repairs.is_empty(), "{:?}", report.repairs);
    assert_eq!(report.orphans_deleted, 0);
}

fn maglev_svc(fe: Frontend, pods: &[&str]) -> ServiceEntry {
    let mut e = svc(fe, pods);
    e.flags |= proxy_common::svc_flags::NODE_PORT | proxy_common::svc_flags::MAGLEV;
    e
}

fn small_maglev() -> MaglevParams {
    MaglevParams::new(4093, "test-seed").expect("prime")
}

/// The backend a flow hash gets from the maps of `d` for frontend `fe`: its table entry,
/// then the slot.
fn maglev_backend(d: &Dump, fe: &Frontend, hash: u32) -> SocketAddr {
    let v = d.frontends[fe];
    let m = d.maglev[&(v.service_id, 0)].table_size;
    let (chunk, off) = proxy_common::maglev::locate(hash % m);
    let slot = d.maglev[&(v.service_id, chunk)].slots[off];
    d.backends[&d.slots[&(*fe, slot)]].0.addr
}

#[test]
fn maglev_table_is_written_before_the_flag_and_deleted_after_it() {
    let mut w = writer();
    w.set_maglev_params(small_maglev());
    let fe = vip("10.96.0.10", 80);
    w.upsert(&maglev_svc(fe, &[A, B, C])).expect("upsert");
    let l = log(&mut w);
    let lines: Vec<&str> = l.lines().collect();
    let first_chunk = lines
        .iter()
        .position(|l| l.starts_with("put maglev"))
        .expect("a chunk");
    let frontend = lines
        .iter()
        .position(|l| l.starts_with("put frontend"))
        .expect("the frontend's entry");
    // Three backends: their slots are in the frontend's entry, written with the flag
    // (the datapath takes no table entry past the count).
    assert!(!l.contains("put slots"), "{l}");
    assert!(first_chunk < frontend, "{l}");
    // 4093 entries: 3 chunks.
    assert_eq!(
        lines.iter().filter(|l| l.starts_with("put maglev")).count(),
        3,
        "{l}"
    );
    // The maps give every flow the backend the user-space table gives it.
    let d = w.store().inner.state.clone();
    let slotted: Vec<(SocketAddr, u16)> = [A, B, C].iter().map(|p| pod(p)).zip(1..).collect();
    let t = crate::maglev::table(small_maglev(), &slotted);
    for h in crate::maglev::sample_flows(1000) {
        let want = slotted[usize::from(t[crate::maglev::index(h, 4093)]) - 1].0;
        assert_eq!(maglev_backend(&d, &fe, h), want);
    }

    // Unchanged: nothing written.
    assert_eq!(w.upsert(&maglev_svc(fe, &[C, A, B])).expect("upsert"), 0);
    // A backend leaves: the table in use names slots the frontend's entry holds, so the
    // entry (slots and count) first, then the table (before it, the new table would send
    // flows to slot 2, still B's); most flows stay.
    w.upsert(&maglev_svc(fe, &[A, C])).expect("upsert");
    let l = log(&mut w);
    let frontend = l.find("put frontend").expect("the frontend's entry");
    assert!(frontend < l.find("put maglev").expect("table"), "{l}");
    assert!(
        l.rfind("put maglev").expect("table") < l.find("del backend").expect("B"),
        "{l}"
    );
    let after = w.store().inner.state.clone();
    let flows = crate::maglev::sample_flows(10_000);
    let moved = flows
        .iter()
        .filter(|h| maglev_backend(&d, &fe, **h) != maglev_backend(&after, &fe, **h))
        .count();
    // The flows of B (about a third) move, and few others.
    assert!((2800..=4000).contains(&moved), "{moved} of 10000 moved");
    for h in &flows {
        assert_ne!(maglev_backend(&after, &fe, *h), pod(B));
    }

    // Maglev off: the frontend's entry without the flag first, then the chunks go.
    w.upsert(&svc(fe, &[A, C])).expect("upsert");
    let l = log(&mut w);
    assert!(l.starts_with("put frontend"), "{l}");
    assert_eq!(l.matches("del maglev").count(), 3, "{l}");
    assert!(w.store().inner.state.maglev.is_empty());

    // On again, then removed: the frontend's entry goes first, then the table.
    w.upsert(&maglev_svc(fe, &[A, C])).expect("upsert");
    log(&mut w);
    w.remove(&fe).expect("remove");
    let l = log(&mut w);
    assert!(l.starts_with("del frontend"), "{l}");
    assert_eq!(l.matches("del maglev").count(), 3, "{l}");
    assert!(w.store().inner.state.maglev.is_empty());
    assert_eq!(w.expected_dump(), w.store().inner.state);

    // 26 backends: chunk 1 (slots 25, 26) before the table it names, the table before
    // the flag.
    let big = vip("10.96.0.20", 80);
    let wide = pods(1..=26);
    let wide_refs: Vec<&str> = wide.iter().map(String::as_str).collect();
    w.upsert(&maglev_svc(big, &wide_refs)).expect("upsert");
    let l = log(&mut w);
    let at = |prefix: &str| l.find(prefix).unwrap_or_else(|| panic!("{prefix}: {l}"));
    let rat = |prefix: &str| l.rfind(prefix).unwrap_or_else(|| panic!("{prefix}: {l}"));
    assert!(rat("put slots") < at("put maglev"), "{l}");
    assert!(rat("put maglev") < at("put frontend"), "{l}");
    assert_eq!(l.matches("put maglev").count(), 3, "{l}");
    // Slot 25's backend leaves: slot 26's moves into slot 25 (chunk 1 keeps slot 26 for
    // the count still 26), the count, then chunk 1 loses slot 26 and the table in use
    // (after the slots it names) is rewritten.
    let mut fewer = wide_refs.clone();
    fewer.remove(24);
    w.upsert(&maglev_svc(big, &fewer)).expect("upsert");
    let l = log(&mut w);
    let at = |prefix: &str| l.find(prefix).unwrap_or_else(|| panic!("{prefix}: {l}"));
    let rat = |prefix: &str| l.rfind(prefix).unwrap_or_else(|| panic!("{prefix}: {l}"));
    assert_eq!(l.matches("put slots").count(), 2, "{l}");
    assert!(at("put slots") < at("put frontend"), "{l}");
    assert!(at("put frontend") < rat("put slots"), "{l}");
    assert!(at("put frontend") < at("put maglev"), "{l}");
    assert!(rat("put maglev") < at("del backend"), "{l}");
    assert!(rat("put slots") < at("del backend"), "{l}");
    let d = w.store().inner.state.clone();
    for h in crate::maglev::sample_flows(1000) {
        assert_ne!(maglev_backend(&d, &big, h), pod(wide_refs[24]));
    }
    // Removed: the frontend's entry first, then chunk 1 and the table.
    w.remove(&big).expect("remove");
    let l = log(&mut w);
    assert!(l.starts_with("del frontend"), "{l}");
    assert_eq!(l.matches("del slots").count(), 1, "{l}");
    assert_eq!(l.matches("del maglev").count(), 3, "{l}");
    assert!(w.store().inner.state.maglev.is_empty());
    assert_eq!(w.expected_dump(), w.store().inner.state);
}

#[test]
fn maglev_tables_survive_adoption_without_writes_and_stale_ones_are_rewritten() {
    let mut w = writer();
    w.set_maglev_params(small_maglev());
    let fe = vip("10.96.0.10", 80);
    let fe2 = vip("10.96.0.11", 80);
    let desired = vec![maglev_svc(fe, &[A, B, C]), maglev_svc(fe2, &[B, D])];
    assert!(w.sync(desired.clone()).errors.is_empty());
    let before = w.store().inner.state.clone();
    assert_eq!(w.expected_dump(), before);

    // A restart with the same parameters: the same desired state writes nothing.
    let store = std::mem::take(&mut w.store_mut().inner);
    let (mut w2, report) =
        Writer::adopt_with(store, BATCH_MIN_FRONTENDS, small_maglev()).expect("adopt");
    assert!(report.repairs.is_empty(), "{report:?}");
    assert_eq!(report.orphans_deleted, 0);
    // The adopted totals are the writer's: the tables' chunks counted.
    assert_eq!(w2.services.tally, w.services.tally);
    // Two frontends of at most 24 backends: one SVC entry each.
    assert!(w2.services.tally.chunks > 0 && w2.services.tally.svc[0] == 2);
    w2.store_mut().log.clear();
    let r = w2.sync(desired.clone());
    assert_eq!(r.ops, 0, "{}", w2.store_mut().take_log());
    assert_eq!(w2.store().state, before);

    // A restart with another seed: the tables are rewritten (each chunk once).
    let store = std::mem::take(w2.store_mut());
    let other = MaglevParams::new(4093, "another-seed").expect("prime");
    let (mut w3, report) = Writer::adopt_with(store, usize::MAX, other).expect("adopt");
    assert_eq!(
        report.repairs.get(&Repair::MaglevTableStale),
        Some(&2),
        "{report:?}"
    );
    w3.store_mut().log.clear();
    let r = w3.sync(desired);
    assert!(r.errors.is_empty());
    let l = w3.store_mut().take_log();
    assert_eq!(l.matches("put maglev").count(), 6, "{l}");
    assert_eq!(l.lines().count(), 6, "{l}");
    assert_eq!(w3.expected_dump(), w3.store().state);
}

#[test]
fn maglev_in_a_batched_sync_keeps_the_order() {
    let mut w = Writer::new(CheckingStore {
        batches: true,
        ..Default::default()
    });
    w.set_maglev_params(small_maglev());
    w.set_batch_threshold(0);
    let desired: Vec<ServiceEntry> = (0..5)
        .map(|i| maglev_svc(vip(&format!("10.96.1.{i}"), 80), &[A, B, C]))
        .collect();
    let r = w.sync(desired.clone());
    assert!(r.errors.is_empty());
    assert_eq!(w.store().inner.state.maglev.len(), 15);
    assert_eq!(w.expected_dump(), w.store().inner.state);
    // Remove all: the frontends' entries first (checked after every op by the store),
    // tables after.
    let r = w.sync(Vec::new());
    assert!(r.errors.is_empty());
    assert!(w.store().inner.state.maglev.is_empty());
}

// ---- Batched syncs in rounds ---------------------------------------------------------

#[test]
fn a_batched_sync_in_rounds_holds_one_round_and_writes_what_one_round_writes() {
    // Rounds of 7 frontends: the checking store checks every element of every batch.
    let mut w = batch_writer();
    w.set_batch_chunk(7);
    let mut whole = batch_writer();
    for (step, desired) in [many(40, 3, 0), many(33, 3, 5), many(40, 2, 9)]
        .into_iter()
        .enumerate()
    {
        w.store_mut().inner.batches.clear();
        let a = w.sync(desired.clone());
        let b = whole.sync(desired);
        assert!(a.errors.is_empty(), "step {step}: {:?}", a.errors);
        assert_eq!(
            (a.ops, a.changed, a.removed),
            (b.ops, b.changed, b.removed),
            "step {step}"
        );
        // No batch carries more than one round's ops (3 backends and an entry a
        // frontend, or its removal): the rounds are really separate.
        let batches = &w.store().inner.batches;
        assert!(batches.len() > 4, "step {step}: {batches:?}");
        assert!(
            batches.iter().all(|n| *n <= 7 * 3),
            "step {step}: {batches:?}"
        );
        assert_eq!(
            w.store().dump().expect("dump"),
            w.expected_dump(),
            "step {step}"
        );
        // The same service as in one round; from empty maps the same ids too (later,
        // ids freed in one round are reused by the next, where one round reuses them
        // only after the sync).
        assert_eq!(
            served(&w.store().dump().expect("dump")),
            served(&whole.store().dump().expect("dump")),
            "step {step}"
        );
        if step == 0 {
            assert_eq!(
                w.store().dump().expect("dump"),
                whole.store().dump().expect("dump")
            );
        }
    }
}

#[test]
fn a_failed_round_is_undone_and_the_rest_written_one_by_one() {
    // Room for 40 frontends of 30 slots (2 entries each: their own and chunk 1) but not
    // for a 41st.
    let capacity = 40 * 2;
    let store = || CheckingStore {
        batches: true,
        inner: MemStore {
            svc_capacity: Some(capacity),
            ..MemStore::default()
        },
        ..CheckingStore::default()
    };
    let mut w = Writer::new(store());
    w.set_batch_chunk(8);
    w.sync(many(40, 30, 0));
    w.set_batch_threshold(0);
    w.take_write_counts();
    // 4 frontends removed (round 1), 36 changed, 5 new in the last round: the last new
    // one does not fit, after 5 rounds written.
    let mut desired = many(36, 30, 3);
    let mut extra = many(45, 30, 7);
    desired.extend(extra.drain(40..));
    let report = w.sync(desired.clone());
    assert_eq!(report.errors.len(), 1, "{:?}", report.errors);
    let err = report.errors[0].to_string();
    assert!(err.contains("map SVC is full"), "{err}");
    assert!(!err.contains("incompletely"), "{err}");
    // The model after the replayed rounds is the maps.
    assert_eq!(w.store().dump().expect("dump"), w.expected_dump());
    let counts = w.take_write_counts();
    assert!(counts.batch > 0 && counts.single > 0, "{counts:?}");
    // What a one-by-one writer serves with the same input.
    let mut seq = Writer::new(store());
    seq.set_batch_threshold(usize::MAX);
    seq.sync(many(40, 30, 0));
    let r = seq.sync(desired);
    assert_eq!(r.errors.len(), 1);
    assert_eq!(r.errors[0].to_string(), err);
    assert_eq!(
        served(&w.store().dump().expect("dump")),
        served(&seq.store().dump().expect("dump"))
    );
    // And the next sync still writes nothing more than needed.
    let again = w.sync(many(30, 30, 4));
    assert!(again.errors.is_empty(), "{:?}", again.errors);
    assert_eq!(w.store().dump().expect("dump"), w.expected_dump());
}

#[test]
fn svc_growth_doubles_to_the_high_water_mark_within_the_ceiling() {
    // Within 3/4: no growth.
    assert_eq!(svc_grown(64, 48, 4096), None);
    assert_eq!(svc_grown(64, 49, 4096), Some(128));
    // 440 entries: 512 x 3/4 = 384 < 440, 1024 x 3/4 = 768.
    assert_eq!(svc_grown(64, 440, 4096), Some(1024));
    // At most the ceiling; none at it.
    assert_eq!(svc_grown(64, 440, 256), Some(256));
    assert_eq!(svc_grown(64, 440, 100), Some(100));
    assert_eq!(svc_grown(256, 440, 256), None);
    // The default start and ceiling at 20,000 Services x 10 endpoints.
    assert_eq!(svc_grown(16_384, 220_000, 1 << 20), Some(1 << 19));
}

#[test]
fn a_sync_that_would_not_fit_grows_the_service_maps_first() {
    // 64 entries, growable up to 4,096; 100 frontends x 50 backends (3 entries each:
    // their own and chunks 1 and 2) need 300.
    let mut w = Writer::new(MemStore {
        svc_capacity: Some(64),
        svc_growable: true,
        ..MemStore::default()
    });
    w.set_svc_ceiling(4096);
    let report = w.sync(many(100, 50, 0));
    assert!(report.errors.is_empty(), "{:?}", report.errors);
    assert_eq!(w.frontends().count(), 100);
    assert_eq!(w.store().dump().expect("dump"), w.expected_dump());
    // One growth, before any write: x2 until 300 is within 3/4 (256 x 3/4 = 192, 512 x
    // 3/4 = 384).
    assert_eq!(w.store().svc_grown, vec![512]);
    let growths = w.take_svc_growths();
    assert!(
        matches!(&growths[..], [SvcGrowth::Grown { resized, needed: 300 }] if resized[0].to == 512),
        "{growths:?}"
    );
    assert_eq!(w.svc_entries(), [300, 0]);
    // Unchanged: nothing grows. 29 more need 387 > 384: x2 again.
    w.sync(many(100, 50, 0));
    assert!(w.take_svc_growths().is_empty());
    let report = w.sync(many(129, 50, 0));
    assert!(report.errors.is_empty(), "{:?}", report.errors);
    assert_eq!(w.store().svc_grown, vec![512, 1024]);
    assert_eq!(w.store().dump().expect("dump"), w.expected_dump());
}

#[test]
fn at_the_ceiling_what_does_not_fit_is_refused_whole_as_before() {
    // Ceiling 256: grown to it, then the frontends that do not fit fail as map_full,
    // each rolled back (never half-written).
    let mut w = Writer::new(MemStore {
        svc_capacity: Some(64),
        svc_growable: true,
        ..MemStore::default()
    });
    w.set_svc_ceiling(256);
    let report = w.sync(many(100, 50, 0));
    assert_eq!(w.store().svc_grown, vec![256]);
    // 85 frontends of 3 entries fit in 256; the next ones' chunks 1 fit in the last
    // entry, their chunks 2 not: each refused whole.
    assert_eq!(w.frontends().count(), 85);
    assert_eq!(report.errors.len(), 15, "{:?}", report.errors);
    assert!(report
        .errors
        .iter()
        .all(|e| e.reason().label() == "map_full"));
    assert_eq!(w.store().dump().expect("dump"), w.expected_dump());
    // No ceiling set (a store of fixed size): never grown.
    let mut fixed = Writer::new(MemStore {
        svc_capacity: Some(64),
        svc_growable: true,
        ..MemStore::default()
    });
    fixed.sync(many(100, 50, 0));
    assert!(fixed.store().svc_grown.is_empty());
    assert_eq!(fixed.frontends().count(), 21);
    assert_eq!(fixed.store().dump().expect("dump"), fixed.expected_dump());
}

#[test]
fn one_growth_carries_every_map_the_sync_would_overfill() {
    use crate::loader::{SizedMap, Sizes};
    // Service maps of 64 entries, backends 32, reverse NAT 16, the rest at their floors:
    // 40 frontends x 50 backends (64 distinct; 3 SVC entries each) need 120, 64 and 40.
    let mut w = Writer::new(MemStore {
        svc_capacity: Some(64),
        svc_growable: true,
        sizes: Sizes::floors()
            .with(SizedMap::Backend, 32)
            .with(SizedMap::RevNat, 16),
        ..MemStore::default()
    });
    w.set_svc_ceiling(4096);
    let report = w.sync(many(40, 50, 0));
    assert!(report.errors.is_empty(), "{:?}", report.errors);
    assert_eq!(w.store().dump().expect("dump"), w.expected_dump());
    // One growth, before any write, of the three that need it (x2 to within 3/4).
    assert_eq!(
        w.store().grown,
        vec![vec![
            (SizedMap::Service, 256),
            (SizedMap::Backend, 128),
            (SizedMap::RevNat, 64),
        ]]
    );
    let growths = w.take_svc_growths();
    assert!(
        matches!(&growths[..], [SvcGrowth::Grown { resized, .. }] if resized.len() == 3),
        "{growths:?}"
    );
    // The first ClientIP frontend: AFFINITY (at its 1,024 floor) grows to its ceiling,
    // alone (the rest fits).
    let mut sticky = many(41, 50, 0);
    sticky[40].flags |= proxy_common::svc_flags::AFFINITY;
    sticky[40].affinity_timeout = 10_800;
    let report = w.sync(sticky.clone());
    assert!(report.errors.is_empty(), "{:?}", report.errors);
    assert_eq!(
        w.store().grown[1..],
        [vec![(
            SizedMap::Affinity,
            proxy_common::limits::MAX_AFFINITY
        )]]
    );
    // Nothing more grows while the demand is met.
    w.sync(sticky);
    assert_eq!(w.store().grown.len(), 2);
    assert_eq!(w.store().dump().expect("dump"), w.expected_dump());
}

#[test]
fn maglev_frontends_grow_the_maglev_map_by_their_tables() {
    use crate::loader::{SizedMap, Sizes};
    // MAGLEV at 16 chunks: a table of the default M (16,381 slots) is 9 chunks, so the
    // second Maglev frontend (18 > 12) grows it: x2 to within 3/4 (32: 18 <= 24).
    let mut w = Writer::new(MemStore {
        svc_capacity: Some(1 << 14),
        svc_growable: true,
        sizes: Sizes::floors().with(SizedMap::Maglev, 16),
        ..MemStore::default()
    });
    w.set_svc_ceiling(1 << 14);
    let mut es = many(2, 3, 0);
    for e in &mut es {
        e.flags |= proxy_common::svc_flags::MAGLEV;
    }
    let report = w.sync(es[..1].to_vec());
    assert!(report.errors.is_empty(), "{:?}", report.errors);
    assert!(w.store().grown.is_empty(), "9 chunks fit within 3/4 of 16");
    let report = w.sync(es);
    assert!(report.errors.is_empty(), "{:?}", report.errors);
    assert_eq!(w.store().grown, vec![vec![(SizedMap::Maglev, 32)]]);
    assert_eq!(w.store().dump().expect("dump").maglev.len(), 18);
}

#[test]
fn maps_made_at_the_first_syncs_sizes_grow_nothing_at_that_sync() {
    use crate::loader::{SizedMap, Sizes};
    // What the writer grows maps of the start sizes to at the first sync of 40 frontends
    // x 50 backends (3 SVC entries each) ...
    let start = Sizes::floors()
        .with(SizedMap::Service, 64)
        .with(SizedMap::Backend, 32)
        .with(SizedMap::RevNat, 16);
    let ceilings = Sizes::compiled().with(SizedMap::Service, 4096);
    let store = |sizes: Sizes| MemStore {
        svc_capacity: Some(sizes.get(SizedMap::Service) as usize),
        svc_growable: true,
        sizes,
        ..MemStore::default()
    };
    let mut grown = Writer::new(store(start));
    grown.set_svc_ceiling(4096);
    grown.sync(many(40, 50, 0));
    let [to] = &grown.store().grown[..] else {
        panic!("{:?}", grown.store().grown);
    };
    assert!(
        to.iter().any(|(kind, _)| *kind == SizedMap::Service),
        "the service maps grow too: {to:?}"
    );
    // ... is what a fresh node makes them at ...
    let desired = many(40, 50, 0);
    let refs: Vec<&ServiceEntry> = desired.iter().collect();
    let first = super::first_sync_sizes(&refs, start, &ceilings, Default::default());
    assert_eq!(
        first.changed_from(&start),
        *to,
        "the sizes the writer would grow to"
    );
    // ... and a first sync over maps of those sizes grows none, and writes everything.
    let mut made = Writer::new(store(first));
    made.set_svc_ceiling(4096);
    let report = made.sync(desired);
    assert!(report.errors.is_empty(), "{:?}", report.errors);
    assert!(made.store().grown.is_empty(), "{:?}", made.store().grown);
    assert!(made.take_svc_growths().is_empty());
    assert_eq!(made.store().dump().expect("dump"), made.expected_dump());
    // Nothing to write: the start sizes.
    assert_eq!(
        super::first_sync_sizes(&[], start, &ceilings, Default::default()),
        start
    );
}

/// `n` frontends of one backend each, all distinct: `10.96.x.y` -> `10.1.x.y:8080`.
fn distinct(n: usize) -> Vec<ServiceEntry> {
    (0..n)
        .map(|i| {
            let (a, b) = (i / 256, i % 256);
            svc(
                vip(&format!("10.96.{a}.{b}"), 80),
                &[&format!("10.1.{a}.{b}:8080")],
            )
        })
        .collect()
}

#[test]
fn backend_arrays_keep_room_for_the_highest_id_of_either_family() {
    use crate::loader::{SizedMap, Sizes};
    // `BACKEND4/6` are arrays indexed by backend id, one id space for both families.
    let mut w = Writer::new(MemStore {
        svc_capacity: Some(1 << 17),
        svc_growable: true,
        sizes: Sizes::floors().with(SizedMap::Backend, 1 << 16),
        ..MemStore::default()
    });
    w.set_svc_ceiling(1 << 17);
    let mut desired = distinct(20_000);
    // IPv6 frontends after them: their backends take ids past 20,000, in BACKEND6.
    for i in 0..10 {
        desired.push(svc(
            vip(&format!("fd00::96:{i}"), 80),
            &[&format!("[fd00::1:{i}]:8080")],
        ));
    }
    let report = w.sync(desired.clone());
    assert!(report.errors.is_empty(), "{:?}", report.errors);
    let dump = w.store().dump().expect("dump");
    let v6_ids: Vec<u32> = dump
        .backends
        .iter()
        .filter(|(_, (b, _))| b.addr.is_ipv6())
        .map(|(id, _)| *id)
        .collect();
    assert_eq!(v6_ids.len(), 10);
    assert!(v6_ids.iter().all(|id| *id > 20_000), "{v6_ids:?}");
    // Most IPv4 frontends go: 5,010 backends live, the highest id still 20,010. A shrink
    // to what is live (under 1/4 of 65,536) would leave ids past the arrays' end.
    let kept = desired.split_off(15_000);
    let report = w.sync(kept);
    assert!(report.errors.is_empty(), "{:?}", report.errors);
    assert_eq!(w.store().dump().expect("dump").backends.len(), 5_010);
    let shrink = w.svc_shrinkable();
    assert!(
        shrink
            .iter()
            .all(|(kind, _, to)| *kind != SizedMap::Backend || *to > 20_010),
        "{shrink:?}"
    );
}

#[test]
fn an_id_past_the_backend_arrays_at_their_ceiling_is_a_counted_full_map() {
    use crate::loader::{SizedMap, Sizes};
    let mut w = Writer::new(MemStore {
        svc_capacity: Some(1 << 14),
        svc_growable: true,
        sizes: Sizes::floors().with(SizedMap::Backend, 32),
        ..MemStore::default()
    });
    w.set_svc_ceiling(1 << 14);
    // The arrays may grow to 64 entries: ids 1..=63.
    w.ceilings = w.ceilings.map(|c| c.with(SizedMap::Backend, 64));
    let report = w.sync(distinct(70));
    // Grown first, to the ceiling; the 7 frontends whose backend id would pass it fail,
    // each left unprogrammed (no frontend half-written), the others are served.
    assert_eq!(w.store().grown, vec![vec![(SizedMap::Backend, 64)]]);
    assert_eq!(report.errors.len(), 7, "{:?}", report.errors);
    assert!(
        report.errors.iter().all(|e| e.to_string().contains("full")),
        "{:?}",
        report.errors
    );
    let dump = w.store().dump().expect("dump");
    assert_eq!(dump, w.expected_dump());
    assert_eq!(dump.frontends.len(), 63);
    assert!(dump.backends.keys().all(|id| *id < 64));
}

#[test]
fn the_exact_backend_count_counts_each_address_port_protocol_and_flags_once() {
    use crate::loader::{SizedMap, Sizes};
    // A backend is `{addr, port, protocol, flags}`: the same pod port behind two
    // Services is one backend; another port, protocol, family or flags is another.
    let sa = |s: &str| s.parse::<SocketAddr>().expect("addr");
    let entry = |fe: Frontend, backends: &[(&str, u8)]| ServiceEntry {
        backends: backends
            .iter()
            .map(|&(a, flags)| crate::model::Backend { addr: sa(a), flags })
            .collect(),
        ..ServiceEntry::new(fe, [])
    };
    let udp = |s: &str, port| Frontend::new(s.parse::<IpAddr>().expect("ip"), port, Proto::Udp);
    let terminating = proxy_common::backend_flags::TERMINATING;
    let desired = [
        entry(
            vip("10.96.0.1", 80),
            &[("10.1.0.1:8080", 0), ("10.1.0.2:8080", 0)],
        ),
        // The same two again, behind another Service: no new backend.
        entry(
            vip("10.96.0.2", 80),
            &[("10.1.0.2:8080", 0), ("10.1.0.1:8080", 0)],
        ),
        // Another port of a known address: new.
        entry(vip("10.96.0.3", 80), &[("10.1.0.1:9090", 0)]),
        // The same address and port over UDP: new.
        entry(udp("10.96.0.4", 53), &[("10.1.0.1:8080", 0)]),
        // Terminating: new (its flags differ).
        entry(vip("10.96.0.5", 80), &[("10.1.0.1:8080", terminating)]),
        // IPv6, twice the same and one more.
        entry(
            vip("fd00::1", 80),
            &[("[fd01::1]:8080", 0), ("[fd01::2]:8080", 0)],
        ),
        entry(vip("fd00::2", 80), &[("[fd01::1]:8080", 0)]),
        // An IPv4-mapped IPv6 address is not the IPv4 one.
        entry(vip("fd00::3", 80), &[("[::ffff:10.1.0.1]:8080", 0)]),
    ];
    let refs: Vec<&ServiceEntry> = desired.iter().collect();
    let w = Writer::new(MemStore::default());
    let needed = w.needed(&refs, &Sizes::compiled(), true);
    let of = |kind| needed.iter().find(|(k, _)| *k == kind).map(|(_, n)| *n);
    // 10.1.0.1:8080, 10.1.0.2:8080, 10.1.0.1:9090, UDP 10.1.0.1:8080, terminating
    // 10.1.0.1:8080, [fd01::1]:8080, [fd01::2]:8080, [::ffff:10.1.0.1]:8080.
    assert_eq!(of(SizedMap::BackendConns), Some(8));
    assert_eq!(
        of(SizedMap::Backend),
        Some(9),
        "ids 1..=8, one past the highest"
    );
    // The bound counts every one named (11).
    let bound = w.needed(&refs, &Sizes::compiled(), false);
    assert_eq!(
        bound
            .iter()
            .find(|(k, _)| *k == SizedMap::BackendConns)
            .map(|(_, n)| *n),
        Some(11)
    );
}
