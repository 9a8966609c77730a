//! Map sizes. Hash maps are created with `BPF_F_NO_PREALLOC`, so a large limit costs
//! memory only for entries in use (as cilium's lb maps do).

/// Frontend + slot entries per family, as compiled: 50,000 services x (1 + 10 endpoints)
/// fits twice. The agent sizes `SVC4`/`SVC6` at load time (`--service-map-entries`).
pub const MAX_SVC_ENTRIES: u32 = 1 << 20;
/// The smallest and largest `--service-map-entries` the agent accepts. The bucket array
/// (16 B per entry of `max_entries`, rounded up to a power of two) is charged at creation:
/// 16 MiB per family at the default, 256 MiB at the largest.
pub const SVC_ENTRIES_MIN: u32 = 64;
pub const SVC_ENTRIES_MAX: u32 = 1 << 24;
/// Distinct backends (pod address + port) per family.
pub const MAX_BACKENDS: u32 = 1 << 20;
/// Frontends (service ids) per family.
pub const MAX_REVNAT: u32 = 1 << 18;
/// Reverse entries per socket (`SOCK_REVNAT4/6`, socket-local storage): a connected
/// socket needs one; an unconnected UDP socket one per backend it has been sent to
/// recently (its own oldest is replaced: other sockets cannot evict it).
pub const SOCK_REVNAT_SLOTS: usize = 8;
// The datapath takes `next % SOCK_REVNAT_SLOTS` as a mask.
const _: () = assert!(SOCK_REVNAT_SLOTS.is_power_of_two());
/// The largest number of backends one frontend may have (a slot is a `u16`).
pub const MAX_BACKENDS_PER_SERVICE: u32 = u16::MAX as u32;
/// Entries in `META`.
pub const META_ENTRIES: u32 = 4;
/// TC connection-tracking entries per family (two per flow: original and reply),
/// as compiled; the agent sizes the tables at load time (`--conntrack-max`).
/// LRU: a full table evicts the least recently used flows instead of refusing new ones.
pub const MAX_CT: u32 = 1 << 18;
/// The smallest and largest table the agent accepts, in flows per family.
pub const CT_FLOWS_MIN: u32 = 64;
pub const CT_FLOWS_MAX: u32 = 1 << 23;
/// Node addresses per family.
pub const MAX_NODE_ADDRS: u32 = 256;
/// Trusted DSR senders (`DSR_TRUSTED4/6`): node addresses and `--dsr-trusted-cidrs`
/// prefixes per family.
pub const MAX_DSR_TRUSTED: u32 = 1 << 14;
/// Source-range prefixes per family, all services together.
pub const MAX_SRC_RANGES: u32 = 1 << 14;
/// Session-affinity entries (client x service), both families (LRU: an evicted
/// client is balanced afresh on its next connection).
pub const MAX_AFFINITY: u32 = 1 << 16;
/// Backend slots in one `MAGLEV` chunk. Chosen so that one element of the
/// `BPF_F_NO_PREALLOC` hash map is exactly one 4 KiB kmalloc object: the kernel's
/// `htab_elem` header (48 B) + key (8 B) + value (8 B header + 2 x 2,012 B) + the
/// allocator's list node (8 B) = 4,096 B. A table of M slots takes ceil(M / 2,012)
/// chunks: 9 (36 KiB) at the default M = 16,381.
pub const MAGLEV_CHUNK_SLOTS: usize = 2012;
/// `MAGLEV` entries (chunks), all tables together: 14,563 tables at M = 16,381,
/// 1,985 at M = 131,071. The bucket array costs 16 B per entry (2 MiB) at creation;
/// the chunks only when written.
pub const MAX_MAGLEV_CHUNKS: u32 = 1 << 17;
/// The Maglev table size: default and the allowed range (primes only).
pub const MAGLEV_TABLE_DEFAULT: u32 = 16381;
pub const MAGLEV_TABLE_MIN: u32 = 251;
pub const MAGLEV_TABLE_MAX: u32 = 131071;

/// Service CIDRs and ClusterIP markers (`SVC_CIDR4/6`): one /32 (/128) per ClusterIP in
/// use plus the ranges.
pub const MAX_SVC_CIDR: u32 = 1 << 16;

/// Frontends (service ids) and backends with per-CPU counters (`SVC_COUNTERS`,
/// `BACKEND_COUNTERS`, `--metrics-per-service`): hash maps without preallocation, so the
/// cost when off is the bucket arrays (16 B per entry: 512 KiB and 1 MiB); past these a
/// new id is not counted (the agent says so in `per_service_series_dropped`).
pub const MAX_COUNTED_FRONTENDS: u32 = 1 << 15;
pub const MAX_COUNTED_BACKENDS: u32 = 1 << 16;
