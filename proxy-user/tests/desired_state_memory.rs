//! How much heap the desired state (the `Index` of validated Services and EndpointSlices)
//! holds per Service and per endpoint: a measurement with a counting global allocator,
//! not a timing. 10,000 Services (20 namespaces, one TCP port) with one EndpointSlice of
//! 10 endpoints each (100 nodes, ready, no hints), decoded from JSON the way the sources
//! do; the decoded k8s-openapi objects are dropped before counting, so what is counted
//! is what the agent keeps between updates.
//!
//! Bytes are the sizes asked of the allocator (malloc adds its own 8-16 bytes per
//! allocation, hence the allocation counts next to them). The figures are printed and
//! written in docs/CHANGELOG.md (design notes); the assertions are upper bounds that keep the compact
//! layout from regressing.

use std::{
    alloc::{GlobalAlloc, Layout, System},
    sync::atomic::{AtomicIsize, Ordering},
};

use k8s_openapi::api::{core::v1::Service, discovery::v1::EndpointSlice};
use proxy_user::cluster::{
    index::Index,
    objects::{NodeInfo, ObjKey, ServiceInfo, SliceInfo},
};
use serde_json::json;

struct Counting;

static BYTES: AtomicIsize = AtomicIsize::new(0);
static ALLOCS: AtomicIsize = AtomicIsize::new(0);

// SAFETY: forwards to the system allocator; only counts.
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        BYTES.fetch_add(layout.size() as isize, Ordering::Relaxed);
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
        BYTES.fetch_add(
            new_size as isize - layout.size() as isize,
            Ordering::Relaxed,
        );
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

const SERVICES: usize = 10_000;
const ENDPOINTS: usize = 10;

fn service(i: usize) -> Service {
    serde_json::from_value(json!({
        "apiVersion": "v1", "kind": "Service",
        "metadata": {"namespace": format!("ns-{}", i % 20), "name": format!("svc-{i}"),
                     "uid": format!("00000000-0000-0000-0000-{i:012}"),
                     "resourceVersion": "12345", "creationTimestamp": "2026-11-30T12:00:00Z",
                     "labels": {"app": format!("svc-{i}")}},
        "spec": {"type": "ClusterIP", "clusterIP": format!("10.96.{}.{}", i / 250, i % 250 + 1),
                 "clusterIPs": [format!("10.96.{}.{}", i / 250, i % 250 + 1)],
                 "ipFamilies": ["IPv4"], "ipFamilyPolicy": "SingleStack",
                 "sessionAffinity": "None", "internalTrafficPolicy": "Cluster",
                 "selector": {"app": format!("svc-{i}")},
                 "ports": [{"name": "http", "port": 80, "protocol": "TCP", "targetPort": 8080}]},
        "status": {"loadBalancer": {}}
    }))
    .expect("Service")
}

fn slice(i: usize) -> EndpointSlice {
    let endpoints: Vec<_> = (0..ENDPOINTS)
        .map(|e| {
            let n = i * ENDPOINTS + e;
            json!({"addresses": [format!("10.{}.{}.{}", 128 + n / 65536, (n / 256) % 256, n % 256)],
                   "conditions": {"ready": true, "serving": true, "terminating": false},
                   "nodeName": format!("node-{}", n % 100),
                   "targetRef": {"kind": "Pod", "namespace": format!("ns-{}", i % 20),
                                 "name": format!("svc-{i}-pod-{e}"), "uid": "x"}})
        })
        .collect();
    serde_json::from_value(json!({
        "apiVersion": "discovery.k8s.io/v1", "kind": "EndpointSlice",
        "metadata": {"namespace": format!("ns-{}", i % 20), "name": format!("svc-{i}-x7k2p"),
                     "labels": {"kubernetes.io/service-name": format!("svc-{i}"),
                                "endpointslice.kubernetes.io/managed-by": "endpointslice-controller.k8s.io"}},
        "addressType": "IPv4",
        "ports": [{"name": "http", "port": 8080, "protocol": "TCP"}],
        "endpoints": endpoints
    }))
    .expect("EndpointSlice")
}

#[test]
fn desired_state_bytes_per_service_and_per_endpoint() {
    let node = NodeInfo {
        name: "node-1".into(),
        zone: Some("zone-a".into()),
        addresses: Vec::new(),
        deleting: false,
    };
    let mut index = Index::new(node);
    // Warm up whatever is allocated once (the interner's table, hash seeds).
    let warm = ServiceInfo::from_k8s(&service(0), None)
        .expect("valid")
        .expect("selected");
    drop(warm);

    let before = live();
    let mut all = Vec::with_capacity(SERVICES);
    for i in 0..SERVICES {
        let svc = service(i);
        let info = ServiceInfo::from_k8s(&svc, None)
            .expect("valid")
            .expect("selected");
        all.push((
            ObjKey::new(format!("ns-{}", i % 20), format!("svc-{i}")),
            info,
        ));
    }
    drop(index.replace_services(all));
    let services = live();

    let mut all = Vec::with_capacity(SERVICES);
    for i in 0..SERVICES {
        let s = slice(i);
        let info = SliceInfo::from_k8s(&s, None)
            .expect("valid")
            .expect("selected");
        all.push((
            ObjKey::new(format!("ns-{}", i % 20), format!("svc-{i}-x7k2p")),
            info,
        ));
    }
    drop(index.replace_slices(all));
    let slices = live();
    assert_eq!(index.service_count(), SERVICES);
    assert_eq!(
        index.entries(&ObjKey::new("ns-3", "svc-23"))[0]
            .backends
            .len(),
        ENDPOINTS
    );

    let per_service = (services.0 - before.0) as f64 / SERVICES as f64;
    let per_service_allocs = (services.1 - before.1) as f64 / SERVICES as f64;
    let per_endpoint = (slices.0 - services.0) as f64 / (SERVICES * ENDPOINTS) as f64;
    let per_endpoint_allocs = (slices.1 - services.1) as f64 / (SERVICES * ENDPOINTS) as f64;
    let total = (slices.0 - before.0) as f64 / SERVICES as f64;
    eprintln!(
        "desired state, {SERVICES} Services x {ENDPOINTS} endpoints: {per_service:.0} B \
         ({per_service_allocs:.1} allocations) per Service; {per_endpoint:.1} B \
         ({per_endpoint_allocs:.2} allocations) per endpoint, its slice's share included; \
         {total:.0} B per Service with its slice; {:.1} MiB in all",
        (slices.0 - before.0) as f64 / (1024.0 * 1024.0)
    );
    // Regression bounds (the layout before compaction measured 485 B per Service and
    // 282 B per endpoint).
    assert!(per_service < 400.0, "{per_service:.0} B per Service");
    assert!(per_endpoint < 128.0, "{per_endpoint:.1} B per endpoint");
    drop(index);
}
