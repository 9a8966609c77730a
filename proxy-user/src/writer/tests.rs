//! Writer tests against the in-memory store.
//!
//! IP plan: frontends 10.96.0.0/16 (v4) and fd00:96::/64 (v6); pods 10.0.N.M:8080 and
//! fd00:10::N:8080. Every test compares the whole operation log or map dump with a golden
//! text, and every store used here checks after *each* operation that the datapath could
//! not see a half-written frontend.

use std::net::{IpAddr, SocketAddr};

use super::*;
use crate::store::MemStore;

/// A store that, after every operation, checks what the datapath would see: every
/// frontend's slots 1..=count exist and name an existing backend.
#[derive(Debug, Default)]
struct CheckingStore {
    inner: MemStore,
    /// Fail the operation after this many successful ones (once).
    fail_after: Option<usize>,
    /// Skip the consistency check (for maps damaged on purpose).
    lenient: bool,
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
}

fn assert_consistent(d: &Dump, after: &Op) {
    for (fe, v) in &d.frontends {
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

#[test]
fn install_writes_backends_revnat_slots_then_frontend() {
    let mut w = writer();
    let fe = vip("10.96.0.10", 80);
    assert_eq!(w.upsert(&svc(fe, &[A, B, C])).expect("upsert"), 8);
    assert_eq!(
        log(&mut w),
        "\
put backend 1 = 10.0.1.1:8080/tcp
put backend 2 = 10.0.2.1:8080/tcp
put backend 3 = 10.0.3.1:8080/tcp
put revnat 1 = 10.96.0.10:80/tcp
put slot 10.96.0.10:80/tcp #1 -> backend 1
put slot 10.96.0.10:80/tcp #2 -> backend 2
put slot 10.96.0.10:80/tcp #3 -> backend 3
put frontend 10.96.0.10:80/tcp id=1 count=3 flags=0x0 affinity=0
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
}

#[test]
fn grow_writes_new_slot_before_count() {
    let mut w = writer();
    let fe = vip("10.96.0.10", 80);
    w.upsert(&svc(fe, &[A, B, C])).expect("upsert");
    log(&mut w);
    assert_eq!(w.upsert(&svc(fe, &[A, B, C, D])).expect("upsert"), 3);
    assert_eq!(
        log(&mut w),
        "\
put backend 4 = 10.0.4.1:8080/tcp
put slot 10.96.0.10:80/tcp #4 -> backend 4
put frontend 10.96.0.10:80/tcp id=1 count=4 flags=0x0 affinity=0
"
    );
}

#[test]
fn shrink_moves_tail_into_hole_then_count_then_deletes() {
    let mut w = writer();
    let fe = vip("10.96.0.10", 80);
    w.upsert(&svc(fe, &[A, B, C])).expect("upsert");
    log(&mut w);
    w.upsert(&svc(fe, &[A, C])).expect("upsert");
    assert_eq!(
        log(&mut w),
        "\
put slot 10.96.0.10:80/tcp #2 -> backend 3
put frontend 10.96.0.10:80/tcp id=1 count=2 flags=0x0 affinity=0
del slot 10.96.0.10:80/tcp #3
del backend 2 (V4)
"
    );
    // A replacement reuses the freed id and only rewrites one slot.
    w.upsert(&svc(fe, &[A, C, D])).expect("upsert");
    assert_eq!(
        log(&mut w),
        "\
put backend 2 = 10.0.4.1:8080/tcp
put slot 10.96.0.10:80/tcp #3 -> backend 2
put frontend 10.96.0.10:80/tcp id=1 count=3 flags=0x0 affinity=0
"
    );
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
put frontend 10.96.0.10:80/tcp id=1 count=0 flags=0x0 affinity=0
del slot 10.96.0.10:80/tcp #1
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
del slot 10.96.0.10:80/tcp #1
del slot 10.96.0.10:80/tcp #2
del revnat 1 (V4)
del backend 1 (V4)
"
    );
    w.remove(&alt).expect("remove");
    assert_eq!(
        log(&mut w),
        "\
del frontend 10.96.0.11:80/tcp
del slot 10.96.0.11:80/tcp #1
del slot 10.96.0.11:80/tcp #2
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
put slot [fd00:96::10]:80/tcp #1 -> backend 1
put frontend [fd00:96::10]:80/tcp id=1 count=1 flags=0x1 affinity=10800
"
    );
    // The endpoint stops terminating: a new backend id, swapped in one slot write.
    e.backends[0].flags = 0;
    w.upsert(&e).expect("upsert");
    assert_eq!(
        log(&mut w),
        "\
put backend 2 = [fd00:10::1]:8080/tcp
put slot [fd00:96::10]:80/tcp #1 -> backend 2
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
        assert_eq!(err.reason(), reason);
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
    assert_eq!(err.reason(), "too_many_backends");
    assert_eq!(log(&mut w), "");
}

#[test]
fn a_failed_write_rolls_back_and_leaves_the_model_unchanged() {
    let fe = vip("10.96.0.10", 80);
    let other = vip("10.96.0.20", 80);
    // Fail at every possible point of an update and check the result each time.
    let mut failures = 0;
    for fail_at in 0..8 {
        let mut w = writer();
        w.upsert(&svc(fe, &[A, B, C])).expect("upsert");
        w.upsert(&svc(other, &[C])).expect("upsert");
        let before = w.store().dump().expect("dump");
        w.store_mut().fail_after = Some(fail_at);
        let Err(err) = w.upsert(&svc(fe, &[A, C, D])) else {
            // The update has fewer operations than fail_at: it went through.
            assert_eq!(w.store().dump().expect("dump"), w.expected_dump());
            continue;
        };
        failures += 1;
        assert_eq!(err.reason(), "map_full");
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
        w.upsert(&svc(fe, &[A, C, D])).expect("upsert");
        assert_eq!(w.store().dump().expect("dump"), w.expected_dump());
    }
    // put backend D, put slot #2 -> D (B's hole), del backend B: three failure points.
    assert_eq!(failures, 3);
}

#[test]
fn a_full_map_refuses_a_new_frontend_without_leftovers() {
    let mut w = Writer::new(MemStore {
        svc_capacity: Some(4),
        ..MemStore::default()
    });
    w.upsert(&svc(vip("10.96.0.10", 80), &[A, B]))
        .expect("fits: 3 entries");
    let before = w.store().dump().expect("dump");
    let err = w
        .upsert(&svc(vip("10.96.0.11", 80), &[C]))
        .expect_err("needs 2 more");
    assert_eq!(err.reason(), "map_full");
    assert!(err.to_string().contains("10.96.0.11:80/tcp"), "{err}");
    assert_eq!(w.store().dump().expect("dump"), before);
    // The service id and backend id it had reserved are free again.
    w.remove(&vip("10.96.0.10", 80)).expect("remove");
    w.upsert(&svc(vip("10.96.0.11", 80), &[C]))
        .expect("fits now");
    assert_eq!(
        w.store().state.render(),
        "\
frontend 10.96.0.11:80/tcp id=1 count=1 flags=0x0 affinity=0
  slot 1 -> backend 1 (10.0.3.1:8080)
backend 1 = 10.0.3.1:8080/tcp flags=0x0
revnat 1 = 10.96.0.11:80/tcp
"
    );
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
    // Leftovers of an agent that died mid-update: a slot past the count, a backend and a
    // reverse-NAT entry nothing reaches.
    for op in [
        Op::PutBackend {
            id: 9,
            backend: Backend::new(pod(D)),
            proto: Proto::Tcp,
        },
        Op::PutSlot {
            frontend: http,
            slot: 4,
            backend_id: 9,
            service_id: 1,
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
            missing_slots: 0
        }
    );
    assert_eq!(
        log(&mut second),
        "\
del slot 10.96.0.10:80/tcp #4
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
put slot 10.96.0.11:80/tcp #1 -> backend 5
put frontend 10.96.0.11:80/tcp id=3 count=1 flags=0x0 affinity=0
"
    );
}

#[test]
fn adopt_repairs_a_missing_slot_on_the_next_write() {
    let mut first = writer();
    let fe = vip("10.96.0.10", 80);
    first.upsert(&svc(fe, &[A, B])).expect("upsert");
    let mut store = std::mem::take(first.store_mut());
    store.inner.state.slots.remove(&(fe, 2));
    store.lenient = true;
    store.inner.take_log();
    let (mut second, report) = Writer::adopt(store).expect("adopt");
    assert_eq!(report.missing_slots, 1);
    // Backend 2 was only reachable through the lost slot: it is an orphan now.
    assert_eq!(log(&mut second), "del backend 2 (V4)\n");
    second.upsert(&svc(fe, &[A, B])).expect("upsert");
    assert_eq!(
        log(&mut second),
        "put backend 2 = 10.0.2.1:8080/tcp\nput slot 10.96.0.10:80/tcp #2 -> backend 2\n"
    );
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
    let pods: Vec<String> = (0..10).map(|i| format!("10.0.{i}.1:8080")).collect();
    for step in 0..2000 {
        let fe = frontends[rng.below(frontends.len() as u64) as usize];
        if rng.below(5) == 0 {
            w.remove(&fe).expect("remove");
        } else {
            let n = rng.below(7) as usize;
            let chosen: Vec<&str> = (0..n)
                .map(|_| pods[rng.below(pods.len() as u64) as usize].as_str())
                .collect();
            w.upsert(&svc(fe, &chosen)).expect("upsert");
        }
        let actual = w.store().dump().expect("dump");
        assert_eq!(actual, w.expected_dump(), "step {step}");
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
