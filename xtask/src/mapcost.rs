//! `cargo xtask bench-maps`: what one entry costs in each kind of BPF map on this kernel,
//! the figures docs/deploy.md ("Memory") chooses each map's kind and size from.
//!
//! For each map kind the project uses or could use (hash without preallocation, hash
//! preallocated, array, LRU hash) and for the key/value layouts of the real maps
//! (`proxy-common`'s types), a map of `--entries` entries is created and filled through
//! `BPF_MAP_UPDATE_BATCH` in chunks of 4,096 (as the agent's writer does). Reported:
//! - insert cost: ns per entry of the batched fill of an empty map, of a second fill
//!   over the same keys (an update of every entry: the hash without preallocation
//!   allocates a new element for each), and of one `BPF_MAP_UPDATE_ELEM` per entry;
//! - memory: the kernel's own figure (`memlock:` in the map's fdinfo) at creation and
//!   filled, and the memory cgroup's charge (usage of a fresh child memory cgroup this
//!   process moves into for the one map: the kernel charges a map's memory to the
//!   cgroup of the process that creates it), at creation and filled.
//!
//! Needs root (BPF, cgroups); makes nothing but the maps (closed after each) and one
//! child memory cgroup per map (removed after it).

use std::{
    fs,
    os::fd::{AsFd as _, AsRawFd as _, BorrowedFd, OwnedFd},
    time::Instant,
};

use anyhow::{bail, Context as _, Result};
use proxy_common::{Backend4, Ct4Key, Ct4Value, Ct6Key, Ct6Value, Svc4Key, Svc6Key, SvcEntry};
use proxy_testbed::memcg::MemCgroup;

#[derive(clap::Args)]
pub struct Args {
    /// Entries per map (each map is created with exactly this many and filled).
    #[arg(long, default_value_t = 131_072)]
    entries: u32,
}

const HASH: u32 = 1;
const ARRAY: u32 = bpf_sys::map_type::ARRAY;
const LRU_HASH: u32 = 9;
const F_NO_PREALLOC: u32 = 1;
const CHUNK: usize = 4096;

#[derive(Clone, Copy)]
struct Kind {
    name: &'static str,
    map_type: u32,
    flags: u32,
}

const KINDS: [Kind; 4] = [
    Kind {
        name: "hash, no prealloc",
        map_type: HASH,
        flags: F_NO_PREALLOC,
    },
    Kind {
        name: "hash, prealloc",
        map_type: HASH,
        flags: 0,
    },
    Kind {
        name: "LRU hash",
        map_type: LRU_HASH,
        flags: 0,
    },
    Kind {
        name: "array",
        map_type: ARRAY,
        flags: 0,
    },
];

/// A key/value layout of a real map.
struct Shape {
    /// The project's maps with this layout.
    maps: &'static str,
    key: usize,
    value: usize,
}

fn shapes() -> [Shape; 5] {
    use std::mem::size_of;
    [
        Shape {
            maps: "BACKEND4 (u32 id -> Backend4)",
            key: 4,
            value: size_of::<Backend4>(),
        },
        Shape {
            maps: "SVC4 (Svc4Key -> SvcEntry: a frontend and 24 slots)",
            key: size_of::<Svc4Key>(),
            value: size_of::<SvcEntry>(),
        },
        Shape {
            maps: "SVC6 (Svc6Key -> SvcEntry)",
            key: size_of::<Svc6Key>(),
            value: size_of::<SvcEntry>(),
        },
        Shape {
            maps: "CT4 (Ct4Key -> Ct4Value)",
            key: size_of::<Ct4Key>(),
            value: size_of::<Ct4Value>(),
        },
        Shape {
            maps: "CT6 (Ct6Key -> Ct6Value)",
            key: size_of::<Ct6Key>(),
            value: size_of::<Ct6Value>(),
        },
    ]
}

struct Row {
    kind: &'static str,
    shape: &'static str,
    key: usize,
    value: usize,
    filled: usize,
    insert_ns: f64,
    update_ns: f64,
    single_ns: f64,
    /// A walk of every entry by `BPF_MAP_LOOKUP_BATCH` in chunks of 1,024 (keys and
    /// values into fixed buffers), as the agent's conntrack sampler reads CT4/CT6.
    walk_ns: f64,
    memlock_created: u64,
    memlock_filled: u64,
    charge_created: Option<u64>,
    charge_filled: Option<u64>,
}

pub fn main(args: &Args) -> Result<()> {
    if unsafe { libc::geteuid() } != 0 {
        bail!("bench-maps needs root (BPF maps, a child memory cgroup)");
    }
    let n = args.entries as usize;
    // A probe: the memory controller this process can make children in (each map is
    // measured in a fresh child cgroup of its own).
    let memcg = match MemCgroup::new("xtask-mapcost", None) {
        Ok(cg) => {
            let kind = if cg.v2 {
                "cgroup v2"
            } else {
                "cgroup v1 memory controller"
            };
            eprintln!("memory cgroup: below {} ({kind})", cg.path.display());
            true
        }
        Err(e) => {
            eprintln!("no memory cgroup charge figures: {e}");
            false
        }
    };
    let mut rows = Vec::new();
    for shape in shapes() {
        for kind in KINDS {
            // An array is addressed by a dense u32 index: only the layouts with a u32 key.
            if kind.map_type == ARRAY && shape.key != 4 {
                continue;
            }
            let row = measure(kind, &shape, n, memcg)
                .with_context(|| format!("{} / {}", kind.name, shape.maps))?;
            eprintln!(
                "{:<18} {:<32} insert {:>6.0} ns/entry, memlock {} -> {}",
                row.kind, row.shape, row.insert_ns, row.memlock_created, row.memlock_filled
            );
            rows.push(row);
        }
    }
    print_table(&rows, n);
    Ok(())
}

fn measure(kind: Kind, shape: &Shape, n: usize, memcg: bool) -> Result<Row> {
    // Keys: distinct, spread (a hash map's keys in a real map are not sequential); for
    // an array, the dense indexes 0..n. Built before moving into the child cgroup, so
    // that the process's own heap is not charged there.
    let mut keys = vec![0u8; n * shape.key];
    for (i, k) in keys.chunks_exact_mut(shape.key).enumerate() {
        let v = if kind.map_type == ARRAY {
            i as u32
        } else {
            (i as u32).wrapping_mul(0x9e37_79b9)
        };
        k[..4].copy_from_slice(&v.to_ne_bytes());
        if shape.key > 4 {
            k[4..8].copy_from_slice(&(!(i as u32)).to_ne_bytes());
        }
    }
    let values = vec![0x5au8; n * shape.value];

    let cg = memcg
        .then(|| -> Result<MemCgroup> {
            let cg = MemCgroup::new("xtask-mapcost", None)?;
            cg.enter()?;
            Ok(cg)
        })
        .transpose()?;
    let result = (|| -> Result<Row> {
        let before = cg.as_ref().map(MemCgroup::usage).transpose()?;
        let fd = bpf_sys::map_create(
            kind.map_type,
            shape.key as u32,
            shape.value as u32,
            n as u32,
            kind.flags,
        )
        .context("BPF_MAP_CREATE")?;
        let charge_created = charge(cg.as_ref(), before)?;
        let memlock_created = memlock(fd.as_fd())?;

        let insert_ns = fill(&fd, shape, &keys, &values)? / n as f64;
        let filled = count(&fd, shape, n)?;
        let charge_filled = charge(cg.as_ref(), before)?;
        let memlock_filled = memlock(fd.as_fd())?;
        let update_ns = fill(&fd, shape, &keys, &values)? / n as f64;
        let (walked, walk) = walk(&fd, shape)?;
        let walk_ns = walk / walked.max(1) as f64;

        // One syscall per entry, over the first 16,384 (already there: an update).
        let m = n.min(16_384);
        let t = Instant::now();
        for i in 0..m {
            let k = &keys[i * shape.key..(i + 1) * shape.key];
            let v = &values[i * shape.value..(i + 1) * shape.value];
            bpf_sys::map_update(fd.as_fd(), k, v, bpf_sys::ANY).context("BPF_MAP_UPDATE_ELEM")?;
        }
        let single_ns = t.elapsed().as_nanos() as f64 / m as f64;
        drop(fd);
        Ok(Row {
            kind: kind.name,
            shape: shape.maps,
            key: shape.key,
            value: shape.value,
            filled,
            insert_ns,
            update_ns,
            single_ns,
            walk_ns,
            memlock_created,
            memlock_filled,
            charge_created,
            charge_filled,
        })
    })();
    if let Some(cg) = cg {
        cg.leave()?;
    }
    result
}

/// Nanoseconds to write every key through `BPF_MAP_UPDATE_BATCH` in chunks of 4,096.
fn fill(fd: &OwnedFd, shape: &Shape, keys: &[u8], values: &[u8]) -> Result<f64> {
    let t = Instant::now();
    for (k, v) in keys
        .chunks(CHUNK * shape.key)
        .zip(values.chunks(CHUNK * shape.value))
    {
        update_batch(fd.as_fd(), k, v, (k.len() / shape.key) as u32)?;
    }
    Ok(t.elapsed().as_nanos() as f64)
}

/// `BPF_MAP_UPDATE_BATCH` over raw key/value bytes (the layouts are only sizes here).
fn update_batch(fd: BorrowedFd<'_>, keys: &[u8], values: &[u8], count: u32) -> Result<()> {
    bpf_sys::map_update_batch_raw(fd, keys, values, count).map_err(|f| {
        anyhow::anyhow!(
            "BPF_MAP_UPDATE_BATCH: {} after {} of {count}",
            f.error,
            f.count
        )
    })
}

/// (entries read, nanoseconds) of a walk of the whole map by `BPF_MAP_LOOKUP_BATCH`,
/// 1,024 entries per call, into fixed buffers (arrays: their slots).
fn walk(fd: &OwnedFd, shape: &Shape) -> Result<(usize, f64)> {
    const WALK: u32 = 1024;
    let t = Instant::now();
    let read = bpf_sys::map_walk_batch(fd.as_fd(), shape.key, shape.value, WALK, |_, _, _| {})
        .context("BPF_MAP_LOOKUP_BATCH")? as usize;
    Ok((read, t.elapsed().as_nanos() as f64))
}

/// Entries in the map after the fill (an LRU hash may have evicted some to make room).
fn count(fd: &OwnedFd, shape: &Shape, n: usize) -> Result<usize> {
    let mut key = vec![0u8; shape.key];
    let mut next = vec![0u8; shape.key];
    let mut found = 0;
    let mut first = true;
    while bpf_sys::map_next_key(fd.as_fd(), (!first).then_some(&key[..]), &mut next)
        .context("BPF_MAP_GET_NEXT_KEY")?
    {
        first = false;
        found += 1;
        std::mem::swap(&mut key, &mut next);
        if found > n {
            break;
        }
    }
    Ok(found)
}

/// The `memlock:` line of the map's fdinfo: the kernel's own count of its memory.
fn memlock(fd: BorrowedFd<'_>) -> Result<u64> {
    let path = format!("/proc/self/fdinfo/{}", fd.as_raw_fd());
    let text = fs::read_to_string(&path).with_context(|| path.clone())?;
    text.lines()
        .find_map(|l| l.strip_prefix("memlock:"))
        .and_then(|v| v.trim().parse().ok())
        .with_context(|| format!("no memlock line in {path}"))
}

fn charge(cg: Option<&MemCgroup>, before: Option<u64>) -> Result<Option<u64>> {
    match (cg, before) {
        (Some(cg), Some(b)) => Ok(Some(cg.usage()?.saturating_sub(b))),
        _ => Ok(None),
    }
}

fn mib(b: u64) -> String {
    format!("{:.2}", b as f64 / (1024.0 * 1024.0))
}

fn per_entry(b: u64, n: usize) -> String {
    format!("{:.0}", b as f64 / n as f64)
}

fn print_table(rows: &[Row], n: usize) {
    println!(
        "{} entries per map; {} CPUs; kernel {}",
        n,
        std::thread::available_parallelism().map_or(0, |p| p.get()),
        fs::read_to_string("/proc/sys/kernel/osrelease")
            .unwrap_or_default()
            .trim()
    );
    println!();
    println!(
        "| layout (key + value B) | kind | insert ns/entry (batch, empty map) | update ns/entry (batch) | update ns/entry (one syscall each) | walk ns/entry (lookup batch, 1,024) | memlock at creation MiB | memlock filled MiB | B/entry filled (memlock) | memcg charge at creation MiB | memcg charge filled MiB | B/entry filled (memcg) |"
    );
    println!("| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |");
    for r in rows {
        let opt = |c: Option<u64>| c.map_or("-".to_string(), mib);
        let opt_pe = |c: Option<u64>| c.map_or("-".to_string(), |c| per_entry(c, n));
        let filled = if r.filled == n {
            String::new()
        } else {
            format!(" ({} kept)", r.filled)
        };
        println!(
            "| {} ({} + {}) | {}{} | {:.0} | {:.0} | {:.0} | {:.0} | {} | {} | {} | {} | {} | {} |",
            r.shape,
            r.key,
            r.value,
            r.kind,
            filled,
            r.insert_ns,
            r.update_ns,
            r.single_ns,
            r.walk_ns,
            mib(r.memlock_created),
            mib(r.memlock_filled),
            per_entry(r.memlock_filled, n),
            opt(r.charge_created),
            opt(r.charge_filled),
            opt_pe(r.charge_filled),
        );
    }
}
