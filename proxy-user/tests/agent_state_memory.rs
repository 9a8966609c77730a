//! How much heap the agent keeps once programmed, per Service and per endpoint, and how
//! high the heap rises during the first sync: a measurement with a counting global
//! allocator, not a timing. The objects are the API bench's (`cargo xtask bench --api`:
//! one namespace, N Services with one TCP port and a slice of 10 ready endpoints on this
//! node), decoded from their JSON by the API reader's own decoder (`api_decode::object`),
//! handed to the agent's `Syncer` as the two initial lists and synced through a store
//! that accepts every write and keeps nothing (the BPF maps are kernel memory, not the
//! agent's heap).
//!
//! Split: the `Syncer` as a whole (desired-state index, conflict claims, the writer's
//! model) and the writer's model alone (a `Writer` given the same entries).
//!
//! Bytes are the sizes asked of the allocator (malloc adds its own 8-16 bytes per
//! allocation, hence the allocation counts next to them). The figures are printed and
//! written in docs/CHANGELOG.md (design notes) and docs/benchmarks.md; the assertions are upper
//! bounds that keep the compact layout from regressing.

use std::{
    alloc::{GlobalAlloc, Layout, System},
    sync::{
        atomic::{AtomicIsize, Ordering},
        Arc,
    },
    time::Instant,
};

use proxy_user::{
    agent::{metrics::Metrics, sync::Syncer},
    cluster::{
        api_decode,
        conflicts::{Claims, Rank},
        objects::NodeInfo,
        Kind, ObjKey, Object, Update,
    },
    store::{BatchFailed, Dump, Group, MapStore, Op, StoreError},
    ServiceEntry, Writer,
};

struct Counting;

static BYTES: AtomicIsize = AtomicIsize::new(0);
static ALLOCS: AtomicIsize = AtomicIsize::new(0);
static PEAK: AtomicIsize = AtomicIsize::new(0);

fn grew(by: isize) {
    let now = BYTES.fetch_add(by, Ordering::Relaxed) + by;
    PEAK.fetch_max(now, Ordering::Relaxed);
}

// SAFETY: forwards to the system allocator; only counts.
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        grew(layout.size() as isize);
        ALLOCS.fetch_add(1, Ordering::Relaxed);
        // SAFETY: same contract as ours.
        unsafe { System.alloc(layout) }
    }
    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        BYTES.fetch_sub(layout.size() as isize, Ordering::Relaxed);
        ALLOCS.fetch_sub(1, Ordering::Relaxed);
        // SAFETY: same contract as ours.
        unsafe { System.dealloc(ptr, layout) }
    }
    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        grew(new_size as isize - layout.size() as isize);
        // SAFETY: same contract as ours.
        unsafe { System.realloc(ptr, layout, new_size) }
    }
}

#[global_allocator]
static GLOBAL: Counting = Counting;

fn live() -> (isize, isize) {
    (
        BYTES.load(Ordering::Relaxed),
        ALLOCS.load(Ordering::Relaxed),
    )
}

/// The peak since the last call, from `base`.
fn peak_since_reset(base: isize) -> isize {
    PEAK.swap(BYTES.load(Ordering::Relaxed), Ordering::Relaxed) - base
}

fn reset_peak() {
    PEAK.store(BYTES.load(Ordering::Relaxed), Ordering::Relaxed);
}

/// Accepts every write, keeps nothing (the maps are the kernel's memory).
struct Discard;

impl MapStore for Discard {
    fn apply(&mut self, _: &Op) -> Result<(), StoreError> {
        Ok(())
    }
    fn dump(&self) -> Result<Dump, StoreError> {
        Ok(Dump::default())
    }
    fn supports_batch(&self, _: Group) -> bool {
        true
    }
    fn apply_batch(&mut self, _: &[Op]) -> Result<(), BatchFailed> {
        Ok(())
    }
}

const SERVICES: usize = 10_000;
const ENDPOINTS: usize = 10;
const NODE: &str = "bench-node";

/// The API bench's Service `i` (`xtask/src/bench/api.rs`).
fn service_json(i: usize) -> String {
    let vip =
        std::net::Ipv4Addr::from(u32::from(std::net::Ipv4Addr::new(10, 96, 0, 16)) + i as u32);
    format!(
        r#"{{"apiVersion":"v1","kind":"Service","metadata":{{"namespace":"bench","name":"s{i:06}","resourceVersion":"{i}"}},"spec":{{"type":"ClusterIP","clusterIP":"{vip}","clusterIPs":["{vip}"],"ports":[{{"name":"http","protocol":"TCP","port":80,"targetPort":8080}}]}}}}"#
    )
}

/// The API bench's slice of Service `i`.
fn slice_json(i: usize) -> String {
    let eps: Vec<String> = (0..ENDPOINTS)
        .map(|e| {
            let a = std::net::Ipv4Addr::from(
                u32::from(std::net::Ipv4Addr::new(10, 128, 0, 0)) + (i * ENDPOINTS + e) as u32,
            );
            format!(r#"{{"addresses":["{a}"],"conditions":{{"ready":true}},"nodeName":"{NODE}"}}"#)
        })
        .collect();
    format!(
        r#"{{"apiVersion":"discovery.k8s.io/v1","kind":"EndpointSlice","metadata":{{"namespace":"bench","name":"s{i:06}-abcde","resourceVersion":"{i}","labels":{{"kubernetes.io/service-name":"s{i:06}"}}}},"addressType":"IPv4","ports":[{{"name":"http","protocol":"TCP","port":8080}}],"endpoints":[{}]}}"#,
        eps.join(",")
    )
}

fn decoded(kind: Kind, json: impl Fn(usize) -> String) -> Vec<Object> {
    (0..SERVICES)
        .map(|i| api_decode::object(kind, &json(i), None).expect("decodes"))
        .collect()
}

fn mib(b: isize) -> f64 {
    b as f64 / (1024.0 * 1024.0)
}

#[test]
fn agent_state_bytes_per_service_and_per_endpoint() {
    let node = NodeInfo {
        name: NODE.into(),
        ..NodeInfo::default()
    };
    let metrics = Arc::new(Metrics::new());
    let mut syncer = Syncer::new(
        Writer::new(Discard),
        node,
        None,
        [Kind::Service, Kind::EndpointSlice],
        metrics,
    );
    // Warm up what is allocated once (the interner, hash seeds, the metrics' families).
    drop(decoded(Kind::Service, |_| service_json(0)).pop());

    let before = live();
    reset_peak();
    let services = decoded(Kind::Service, service_json);
    let slices = decoded(Kind::EndpointSlice, slice_json);
    let now = Instant::now();
    syncer.handle(
        Update::Snapshot {
            kind: Kind::Service,
            objects: services,
            relist: false,
        },
        now,
    );
    syncer.handle(
        Update::Snapshot {
            kind: Kind::EndpointSlice,
            objects: slices,
            relist: false,
        },
        now,
    );
    let out = syncer.sync(now);
    assert!(out.ran && out.failed == 0, "{out:?}");
    assert_eq!(syncer.writer().frontend_count(), SERVICES);
    assert_eq!(syncer.writer().backend_count(), SERVICES * ENDPOINTS);
    let after = live();
    let sync_peak = peak_since_reset(before.0);

    // The writer's model alone, from the same entries.
    let entries: Vec<ServiceEntry> = (0..SERVICES)
        .flat_map(|i| {
            syncer
                .index()
                .entries(&ObjKey::new("bench", format!("s{i:06}")))
        })
        .collect();
    // The conflict claims alone (one frontend per Service, no conflict).
    let c0 = live();
    let mut claims = Claims::default();
    for e in &entries {
        let key = ObjKey::new("bench", &e.name[6..e.name.len() - 5]);
        claims.set(Rank::new(None, key), [e.frontend].into());
    }
    let c1 = live();
    assert_eq!(claims.frontends().count(), SERVICES);
    let mut writer = Writer::new(Discard);
    let w0 = live();
    reset_peak();
    let report = writer.write_many(&[], &entries);
    assert!(report.errors.is_empty(), "{:?}", report.errors);
    let w1 = live();
    let writer_peak = peak_since_reset(w0.0);
    drop(entries);

    let total = after.0 - before.0;
    let total_allocs = after.1 - before.1;
    let model = w1.0 - w0.0;
    let model_allocs = w1.1 - w0.1;
    let claimed = c1.0 - c0.0;
    let n = SERVICES as f64;
    let e = (SERVICES * ENDPOINTS) as f64;
    eprintln!(
        "agent state, {SERVICES} Services x {ENDPOINTS} endpoints, once programmed: \
         {:.1} MiB ({:.0} B, {:.1} allocations per Service with its slice); \
         peak during the lists and the first sync {:.1} MiB",
        mib(total),
        total as f64 / n,
        total_allocs as f64 / n,
        mib(sync_peak),
    );
    eprintln!(
        "  the writer's model: {:.1} MiB ({:.0} B, {:.1} allocations per frontend; \
         {:.1} B per backend if all of it were the backends'); its peak while writing \
         +{:.1} MiB",
        mib(model),
        model as f64 / n,
        model_allocs as f64 / n,
        model as f64 / e,
        mib(writer_peak),
    );
    eprintln!(
        "  the conflict claims: {:.1} MiB ({:.0} B, {:.1} allocations per Service)",
        mib(claimed),
        claimed as f64 / n,
        (c1.1 - c0.1) as f64 / n
    );
    eprintln!(
        "  the rest (the desired-state index, the syncer): {:.1} MiB ({:.0} B per Service)",
        mib(total - model - claimed),
        (total - model - claimed) as f64 / n
    );
    // Regression bounds. The layout before compaction measured, at 10,000 x 10: the
    // writer's model 1,851 B per frontend (a `HashMap<(Backend, Proto), u32>` and a
    // `BTreeMap<u32, ((Backend, Proto), u32)>` of every backend), the claims 1,076 B per
    // Service (a `BTreeSet` node per frontend and per Service), 4,258 B per Service in
    // all; compact: 712, 477 and 2,519 B.
    let per_frontend = model as f64 / n;
    let claims_per_service = claimed as f64 / n;
    let per_service = total as f64 / n;
    assert!(
        per_frontend < 1000.0,
        "writer: {per_frontend:.0} B per frontend"
    );
    assert!(
        claims_per_service < 700.0,
        "claims: {claims_per_service:.0} B per Service"
    );
    assert!(
        per_service < 3200.0,
        "in all: {per_service:.0} B per Service"
    );
    drop((syncer, writer, claims));
}
