//! The batch map calls (`BPF_MAP_UPDATE_BATCH`, `BPF_MAP_DELETE_BATCH`,
//! `BPF_MAP_LOOKUP_BATCH`) against the real maps, created by the real loader in a per-run
//! pin directory: round trips on the `BPF_F_NO_PREALLOC` hash maps (reported to fail
//! with ENOMEM on some kernels), a partial failure (a full map), the writer's batched
//! sync read back by the store, by a second writer's adoption and by `proxyctl`'s reader.
//! Needs root.

mod support;

use std::{
    net::{IpAddr, SocketAddr},
    os::fd::AsFd as _,
    time::Instant,
};

use aya::maps::{HashMap, MapData, PerCpuHashMap, PerCpuValues};
use proxy_common::{map_names as names, Backend4, MaglevChunk, MaglevKey, RevNat4};
use proxy_user::{
    batch,
    model::{name_bytes, port_net, v4_word},
    pins::{Access, PinDir as Pins},
    BpfMaps, Frontend, MapStore as _, MemStore, Proto, ServiceEntry, Writer,
};
use support::{require_root, PinDir};

fn load(pins: &PinDir) -> aya::Ebpf {
    let entries = proxy_user::loader::conntrack_entries(1024).expect("size");
    proxy_user::loader::load_object(&proxy_user::pins::PinDir::new(&pins.path), entries)
        .expect("load object")
}

fn backend(i: u32) -> Backend4 {
    Backend4 {
        addr: v4_word(std::net::Ipv4Addr::from(0x0a00_0000 + i)),
        port: port_net(8080),
        proto: proxy_common::proto::TCP,
        flags: 0,
    }
}

fn revnat(i: u32) -> RevNat4 {
    RevNat4 {
        addr: v4_word(std::net::Ipv4Addr::from(0x0a60_0000 + i)),
        port: port_net(80),
        proto: proxy_common::proto::TCP,
        scope: 0,
        name: name_bytes("default/x:http"),
    }
}

#[test]
fn batch_calls_round_trip_on_the_real_no_prealloc_maps() {
    require_root();
    let pins = PinDir::new();
    let _ebpf = load(&pins);
    let dir = Pins::new(&pins.path);
    let fd = dir
        .open_fd(names::REVNAT4, Access::ReadWrite)
        .expect("REVNAT4");

    // Update: 5,000 entries in one call into a BPF_F_NO_PREALLOC hash map.
    let ids: Vec<u32> = (1..=5000).collect();
    let values: Vec<RevNat4> = ids.iter().map(|i| revnat(*i)).collect();
    batch::update(fd.as_fd(), &ids, &values).expect("update batch into a NO_PREALLOC map");
    // Lookup: every entry back, exactly (several chunks of 4,096).
    let mut got = batch::lookup::<u32, RevNat4>(fd.as_fd()).expect("lookup batch");
    got.sort_by_key(|(k, _)| *k);
    assert_eq!(got.len(), 5000);
    assert!(got.iter().all(|(k, v)| *v == revnat(*k)));
    // The typed one-element view agrees.
    let typed: HashMap<MapData, u32, RevNat4> =
        dir.typed(names::REVNAT4, Access::ReadOnly).expect("typed");
    assert_eq!(typed.get(&4321, 0).expect("get"), revnat(4321));

    // Delete: the odd ids plus ids that are not there (skipped, as one-element deletes
    // of absent keys are).
    let mut del: Vec<u32> = ids.iter().copied().filter(|i| i % 2 == 1).collect();
    del.extend([9001, 9002]);
    del.insert(10, 9003);
    batch::delete(fd.as_fd(), &del).expect("delete batch");
    let left: Vec<u32> = batch::lookup::<u32, RevNat4>(fd.as_fd())
        .expect("lookup")
        .into_iter()
        .map(|(k, _)| k)
        .collect();
    assert_eq!(left.len(), 2500);
    assert!(left.iter().all(|k| k % 2 == 0));

    // Through a read-only descriptor the kernel refuses the batch write.
    let ro = dir.open_fd(names::REVNAT4, Access::ReadOnly).expect("ro");
    let err = batch::update(ro.as_fd(), &[1u32], &[revnat(1)]).expect_err("read-only");
    assert_eq!(err.errno(), Some(libc::EPERM), "{:?}", err.error);
    assert_eq!(err.done, 0);

    // A per-CPU hash map (BACKEND_CONNS) reads back summed over CPUs.
    let ncpus = aya::util::nr_cpus().expect("cpus");
    let mut conns: PerCpuHashMap<MapData, u32, u64> = dir
        .typed(names::BACKEND_CONNS, Access::ReadWrite)
        .expect("conns");
    let per_cpu = PerCpuValues::try_from((1..=ncpus as u64).collect::<Vec<u64>>()).expect("vals");
    conns.insert(7, per_cpu, 0).expect("insert");
    let cfd = dir
        .open_fd(names::BACKEND_CONNS, Access::ReadOnly)
        .expect("fd");
    let sums = batch::lookup_percpu_sum::<u32>(cfd.as_fd(), ncpus).expect("per-cpu lookup");
    let n = ncpus as u64;
    assert_eq!(sums, [(7, n * (n + 1) / 2)]);

    // An LPM trie: batch lookup where the kernel has it (6.18 does: generic get-next-key
    // walk), else an "unsupported" error and the readers iterate key by key.
    let mut trie: aya::maps::lpm_trie::LpmTrie<MapData, proxy_common::SrcRange4, u8> = dir
        .typed(names::SRC_RANGE4, Access::ReadWrite)
        .expect("trie");
    for (id, len) in [(1u32, 24u32), (2, 16), (3, 32)] {
        let key = aya::maps::lpm_trie::Key::new(
            32 + len,
            proxy_common::SrcRange4 {
                service_id: id,
                addr: v4_word("192.0.2.0".parse().expect("ip")),
            },
        );
        trie.insert(&key, 1, 0).expect("insert");
    }
    let src = dir
        .open_fd(names::SRC_RANGE4, Access::ReadOnly)
        .expect("trie");
    match batch::lookup_raw(src.as_fd(), 12, 1) {
        Ok((_, values, n)) => {
            assert_eq!(n, 3, "every trie entry");
            assert_eq!(values, [1, 1, 1]);
        }
        Err(e) => assert!(
            matches!(
                e.raw_os_error(),
                Some(batch::ENOTSUPP) | Some(libc::EINVAL) | Some(libc::EOPNOTSUPP)
            ),
            "{e}"
        ),
    }
}

/// `BACKEND4` is an array indexed by backend id: a batch update writes the ids, a
/// "delete" writes the free entry (arrays cannot delete: `BPF_MAP_DELETE_BATCH` fails),
/// and the reader skips the free ids, so a deleted backend reads as absent; an id past
/// the array's end is refused (`E2BIG`: a full map), never half-written.
#[test]
fn backend_arrays_take_batches_and_read_back_only_the_ids_in_use() {
    require_root();
    let pins = PinDir::new();
    let _ebpf = load(&pins);
    let dir = Pins::new(&pins.path);
    let info = dir.map_info(names::BACKEND4).expect("info");
    assert_eq!(
        info.map_type,
        bpf_sys::map_type::ARRAY,
        "BACKEND4 is an array"
    );
    let arr = dir
        .backends::<Backend4>(names::BACKEND4, Access::ReadWrite)
        .expect("BACKEND4");
    assert!(arr.read_all().expect("read").is_empty(), "no id in use");
    let ids: Vec<u32> = (1..=5000).collect();
    let values: Vec<Backend4> = ids.iter().map(|i| backend(*i)).collect();
    batch::update(arr.fd.as_fd(), &ids, &values).expect("update batch into the array");
    let odd: Vec<u32> = ids.iter().copied().filter(|i| i % 2 == 1).collect();
    assert!(
        batch::delete(arr.fd.as_fd(), &odd).is_err(),
        "arrays cannot delete"
    );
    let free = vec![Backend4::FREE; odd.len()];
    batch::update(arr.fd.as_fd(), &odd, &free).expect("free entries written");
    let left = arr.read_all().expect("read");
    assert_eq!(left.len(), 2500);
    assert!(left.iter().all(|(k, v)| k % 2 == 0 && *v == backend(*k)));
    assert_eq!(
        arr.get(4321).expect("get"),
        None,
        "a freed id reads as absent"
    );
    assert_eq!(arr.get(4322).expect("get"), Some(backend(4322)));
    assert_eq!(
        arr.get(info.max_entries).expect("get"),
        None,
        "past the end"
    );
    let err = batch::update(arr.fd.as_fd(), &[info.max_entries], &[backend(1)])
        .expect_err("past the end");
    assert_eq!(err.errno(), Some(libc::E2BIG), "{:?}", err.error);
    assert_eq!(err.done, 0);
}

/// A backend array is read chunk by chunk as it arrives (`batch::lookup_each`: one chunk
/// of about 1 MiB held, not the whole array): every index visited exactly once and in
/// order across the chunks' borders, and `read_all` keeps exactly the ids in use, the
/// last index included.
#[test]
fn backend_arrays_are_read_chunk_by_chunk_every_index_once() {
    require_root();
    let pins = PinDir::new();
    let _ebpf = load(&pins);
    let dir = Pins::new(&pins.path);
    let max = dir.map_info(names::BACKEND4).expect("info").max_entries;
    assert!(
        max > 200_000,
        "the array spans several chunks: {max} entries"
    );
    let arr = dir
        .backends::<Backend4>(names::BACKEND4, Access::ReadWrite)
        .expect("BACKEND4");
    // Ids around where chunks of ~87,000 twelve-byte entries end, and the last one.
    let ids: Vec<u32> = (1..max).step_by(997).chain([max - 1]).collect();
    let values: Vec<Backend4> = ids.iter().map(|i| backend(*i)).collect();
    batch::update(arr.fd.as_fd(), &ids, &values).expect("update");
    let mut seen = 0u32;
    batch::lookup_each(
        arr.fd.as_fd(),
        4,
        std::mem::size_of::<Backend4>(),
        |k, _| {
            let k = u32::from_ne_bytes(k.try_into().expect("4 bytes"));
            assert_eq!(k, seen, "every index once, in order");
            seen += 1;
        },
    )
    .expect("lookup");
    assert_eq!(seen, max);
    let got = arr.read_all().expect("read");
    assert_eq!(got.len(), ids.len());
    assert!(got
        .iter()
        .zip(&ids)
        .all(|((k, v), id)| k == id && *v == backend(*id)));
}

/// Large values (`MAGLEV`'s 4 KiB chunks) are read back in calls of about 1 MiB (259
/// chunks each, not 4,096: a zeroed 16.5 MiB buffer even for an empty map), every entry
/// exactly once.
#[test]
fn large_values_are_read_back_in_several_calls_each_entry_once() {
    require_root();
    let pins = PinDir::new();
    let _ebpf = load(&pins);
    let dir = Pins::new(&pins.path);
    let fd = dir
        .open_fd(names::MAGLEV, Access::ReadWrite)
        .expect("MAGLEV");
    assert!(batch::lookup::<MaglevKey, MaglevChunk>(fd.as_fd())
        .expect("lookup of the empty map")
        .is_empty());
    let chunk = |service_id: u32, chunk: u32| {
        let mut slots = [0u16; proxy_common::limits::MAGLEV_CHUNK_SLOTS];
        for (i, s) in slots.iter_mut().enumerate() {
            *s = (service_id as usize + chunk as usize + i) as u16;
        }
        MaglevChunk {
            table_size: 16381,
            _pad: 0,
            slots,
        }
    };
    let keys: Vec<MaglevKey> = (1..=100)
        .flat_map(|service_id| (0..9).map(move |chunk| MaglevKey { service_id, chunk }))
        .collect();
    let values: Vec<MaglevChunk> = keys.iter().map(|k| chunk(k.service_id, k.chunk)).collect();
    batch::update(fd.as_fd(), &keys, &values).expect("update");
    let mut got = batch::lookup::<MaglevKey, MaglevChunk>(fd.as_fd()).expect("lookup");
    got.sort_by_key(|(k, _)| *k);
    assert_eq!(
        got.len(),
        900,
        "every chunk once, over several calls of 259"
    );
    for (k, v) in &got {
        assert_eq!(*v, chunk(k.service_id, k.chunk), "{k:?}");
    }
}

#[test]
fn a_batch_into_a_full_map_stops_at_the_first_element_that_does_not_fit() {
    require_root();
    let pins = PinDir::new();
    let _ebpf = load(&pins);
    let dir = Pins::new(&pins.path);
    // REVNAT4: a NO_PREALLOC hash map of MAX_REVNAT entries; one call with 10 more.
    let fd = dir
        .open_fd(names::REVNAT4, Access::ReadWrite)
        .expect("REVNAT4");
    let max = proxy_common::limits::MAX_REVNAT;
    let ids: Vec<u32> = (1..=max + 10).collect();
    let values: Vec<RevNat4> = ids
        .iter()
        .map(|i| RevNat4 {
            addr: *i,
            port: port_net(80),
            proto: proxy_common::proto::TCP,
            scope: 0,
            name: name_bytes("default/x:http"),
        })
        .collect();
    let err = batch::update(fd.as_fd(), &ids, &values).expect_err("the map is full");
    assert_eq!(err.errno(), Some(libc::E2BIG), "{:?}", err.error);
    assert_eq!(
        err.done, max as usize,
        "every element before the full one is written"
    );
    let n = batch::lookup::<u32, RevNat4>(fd.as_fd())
        .expect("lookup")
        .len();
    assert_eq!(n, max as usize);
    // The store's one-element write of the next element names the map as full.
    let mut maps = BpfMaps::open(&pins.path).expect("open");
    let e = maps
        .apply(&proxy_user::store::Op::PutRevNat {
            service_id: max + 1,
            frontend: Frontend::new(std::net::Ipv4Addr::new(10, 96, 0, 1), 80, Proto::Tcp),
            name: String::new(),
        })
        .expect_err("full");
    assert_eq!(e.to_string(), "map REVNAT4 is full");
    batch::delete(fd.as_fd(), &ids).expect("delete everything");
    assert!(batch::lookup::<u32, RevNat4>(fd.as_fd())
        .expect("lookup")
        .is_empty());
}

/// `n` services x `k` endpoints; every 10th one IPv6, every 7th with a source range.
fn services(n: u32, k: u32, shift: u32) -> Vec<ServiceEntry> {
    (0..n)
        .map(|i| {
            let v6 = i % 10 == 9;
            let fe = if v6 {
                Frontend::new(
                    std::net::Ipv6Addr::new(0xfd00, 0x96, 0, 0, 0, 0, 0, i as u16),
                    80,
                    Proto::Tcp,
                )
            } else {
                Frontend::new(std::net::Ipv4Addr::from(0x0a60_0000 + i), 80, Proto::Tcp)
            };
            let pods = (0..k).map(|j| {
                let p = i * k + j + shift;
                if v6 {
                    SocketAddr::new(
                        IpAddr::V6(std::net::Ipv6Addr::new(
                            0xfd00, 0x10, 0, 0, 0, 0, 0, p as u16,
                        )),
                        8080,
                    )
                } else {
                    SocketAddr::new(IpAddr::V4(std::net::Ipv4Addr::from(0x0a01_0000 + p)), 8080)
                }
            });
            let mut e = ServiceEntry::new(fe, pods);
            e.name = format!("ns{}/svc{i}:http", i % 7);
            if i % 7 == 0 && !v6 {
                e.flags |= proxy_common::svc_flags::SOURCE_RANGES;
                e.source_ranges = vec![("192.0.2.0".parse().expect("ip"), 24)];
            }
            e
        })
        .collect()
}

#[test]
fn a_batched_sync_reads_back_through_the_store_adoption_and_proxyctl() {
    require_root();
    let pins = PinDir::new();
    let _ebpf = load(&pins);
    let mut w = Writer::new(BpfMaps::open(&pins.path).expect("open"));
    // The same steps on the in-memory store (with its batch semantics): the same plans,
    // so the same ids, so the real maps must read back exactly as the model's.
    let mut mem = Writer::new(MemStore::default());
    let addrs: Vec<IpAddr> = vec!["192.0.2.1".parse().expect("ip")];
    w.set_node_addresses(&addrs).expect("node addresses");
    mem.set_node_addresses(&addrs).expect("node addresses");
    // 10 endpoints (one SVC entry each), 26 (a frontend's own entry and a second chunk
    // of slots), 12 (the second chunks deleted).
    for (step, (n, k, shift)) in [(2000, 10, 0), (1500, 26, 3), (1800, 12, 5)]
        .into_iter()
        .enumerate()
    {
        let r = w.sync(services(n, k, shift));
        assert!(r.errors.is_empty(), "step {step}: {:?}", r.errors);
        let m = mem.sync(services(n, k, shift));
        assert_eq!((r.ops, r.changed, r.removed), (m.ops, m.changed, m.removed));
        let counts = w.take_write_counts();
        // Everything but the source ranges (LPM tries: no batches) went by batch.
        assert!(counts.batch > counts.single * 10, "step {step}: {counts:?}");
        // No batch call failed: batches into the NO_PREALLOC maps work on this kernel.
        assert_eq!(counts.fallbacks, 0, "step {step}: {counts:?}");
        if step == 0 {
            // The new frontends' backends (1,800 IPv4 frontends x 10): the group in two
            // halves written at once (`writer/split.rs`), read back below exactly as the
            // model and the in-memory store say. (Their slots are in the frontends'
            // own entries: 1,800, one batch.)
            assert!(n as usize * 9 / 10 * k as usize >= proxy_user::writer::SPLIT_MIN_OPS);
            assert!(counts.split >= 1, "step {step}: {counts:?}");
        }
        let dump = w.store().dump().expect("dump");
        assert!(
            dump == w.expected_dump(),
            "step {step}: maps differ from the model"
        );
        assert!(
            dump == mem.store().dump().expect("mem dump"),
            "step {step}: maps differ from the in-memory store's"
        );
        assert_eq!(dump.frontends.len(), n as usize);
    }
    let dump = w.store().dump().expect("dump");

    // A second agent adopts the maps (read back by batch lookups): nothing to delete,
    // nothing to write for the same desired state.
    drop(w);
    let (mut second, report) =
        Writer::adopt(BpfMaps::open(&pins.path).expect("open")).expect("adopt");
    assert_eq!(report.orphans_deleted, 0);
    assert_eq!(report.frontends, 1800);
    assert!(second.expected_dump() == dump, "adopted model differs");
    assert_eq!(second.sync(services(1800, 12, 5)).ops, 0);
    assert_eq!(second.set_node_addresses(&addrs).expect("same"), 0);

    // proxyctl's read-only reader sees the same services.
    let snap = proxy_user::ctl::Maps::open(&proxy_user::pins::PinDir::new(&pins.path))
        .expect("proxyctl open")
        .snapshot()
        .expect("snapshot");
    assert!(snap.services.frontends == dump.frontends);
    assert!(snap.services.slots == dump.slots);
    assert!(snap.services.backends == dump.backends);
    assert!(snap.services.revnat == dump.revnat);
    assert_eq!(snap.node_addrs, Some(dump.node_addrs.clone()));
}

/// Not a test of speed (no timing is asserted): prints how long the first sync of
/// 10,000 Services x 10 endpoints takes with batches and one element at a time, as an
/// indication. `cargo test -p proxy-user --test map_batch -- --ignored --nocapture`.
#[test]
#[ignore = "a measurement, run by hand"]
fn measure_first_sync_with_and_without_batches() {
    require_root();
    for batched in [true, false] {
        let pins = PinDir::new();
        let _ebpf = load(&pins);
        let mut w = Writer::new(BpfMaps::open(&pins.path).expect("open"));
        w.set_batch_threshold(if batched { 0 } else { usize::MAX });
        let desired = services(10_000, 10, 0);
        let t = Instant::now();
        let r = w.sync(desired);
        let took = t.elapsed();
        assert!(r.errors.is_empty());
        let counts = w.take_write_counts();
        println!(
            "batched={batched}: {} ops in {:.3} s ({counts:?})",
            r.ops,
            took.as_secs_f64()
        );
        let t = Instant::now();
        let (_, report) = Writer::adopt(BpfMaps::open(&pins.path).expect("open")).expect("adopt");
        println!(
            "  adoption read back {} frontends in {:.3} s",
            report.frontends,
            t.elapsed().as_secs_f64()
        );
    }
}
