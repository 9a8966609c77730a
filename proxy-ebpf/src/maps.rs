//! Every map the programs use. The shared state is pinned by name under the agent's pin
//! directory, so the datapath keeps it while the agent restarts (sizes:
//! `proxy_common::limits`); the per-CPU scratch and rate-limit maps at the end are private
//! to the loaded programs (not pinned, not part of the ABI).

use aya_ebpf::{
    bindings::{
        bpf_map_type::BPF_MAP_TYPE_SK_STORAGE, bpf_sock, BPF_F_NO_PREALLOC, BPF_NOEXIST,
        BPF_SK_STORAGE_GET_F_CREATE,
    },
    helpers::generated::bpf_sk_storage_get,
    macros::{btf_map, map},
    maps::{
        lpm_trie::LpmTrie, Array, HashMap, LruHashMap, LruPerCpuHashMap, PerCpuArray,
        PerCpuHashMap, RingBuf,
    },
};
use proxy_common::{
    event::{MonitorCpu, MonitorCtl, RINGBUF_BYTES},
    limits::*,
    AffinityKey, AffinityValue, Backend4, Backend6, Ct4Key, Ct4Value, Ct6Key, Ct6Value, FlowCounts,
    MaglevChunk, MaglevKey, NodeConfig, Reason, RevNat4, RevNat6, SockRevNat4, SockRevNat4V3,
    SockRevNat4V3Key, SockRevNat6, SockRevNat6V3, SockRevNat6V3Key, SrcRange4, SrcRange6, Svc4Key,
    Svc6Key, SvcEntry,
};

use crate::pkt::state::{Bucket, Fib, FibHop, FibHopKey4, FibHopKey6, Scratch};

/// IPv4 frontends (chunk 0: the frontend and its slots 1..=24) and the further chunks
/// of 24 backend slots of frontends with more.
#[map]
pub static SVC4: HashMap<Svc4Key, SvcEntry> = HashMap::pinned(MAX_SVC_ENTRIES, BPF_F_NO_PREALLOC);

/// IPv6 frontends and their backend slots, as `SVC4`.
#[map]
pub static SVC6: HashMap<Svc6Key, SvcEntry> = HashMap::pinned(MAX_SVC_ENTRIES, BPF_F_NO_PREALLOC);

/// Backend id -> IPv4 endpoint, shared by all frontends that use it. An array indexed by
/// the id (ids are dense, one space for both families): an entry of protocol 0 (never
/// written, or freed: the writer writes the zero entry) is no backend, as a missing hash
/// entry was.
#[map]
pub static BACKEND4: Array<Backend4> = Array::pinned(MAX_BACKENDS, 0);

/// Backend id -> IPv6 endpoint (an array, as `BACKEND4`).
#[map]
pub static BACKEND6: Array<Backend6> = Array::pinned(MAX_BACKENDS, 0);

/// Service id -> IPv4 frontend (reply translation, CLI).
#[map]
pub static REVNAT4: HashMap<u32, RevNat4> = HashMap::pinned(MAX_REVNAT, BPF_F_NO_PREALLOC);

/// Service id -> IPv6 frontend.
#[map]
pub static REVNAT6: HashMap<u32, RevNat6> = HashMap::pinned(MAX_REVNAT, BPF_F_NO_PREALLOC);

/// Per socket (socket-local storage, freed with the socket): which frontend it asked for
/// when it was sent to a given IPv4 backend. No socket can evict another's entries.
#[btf_map]
pub static SOCK_REVNAT4: SkStorage<SockRevNat4> = SkStorage::new();

/// Per socket: which frontend it asked for when it was sent to a given IPv6 backend.
#[btf_map]
pub static SOCK_REVNAT6: SkStorage<SockRevNat6> = SkStorage::new();

/// The previous layout's (ABI 3) node-wide socket reverse-NAT LRU, `{socket cookie, IPv4
/// backend}` -> frontend. An ABI 3 -> 4 migration pins the running ABI-3 `SOCK_REVNAT4`
/// here (the same map object: the old `sendmsg` program keeps writing it until its hook
/// is swapped), so a reply to a request the old program translated is still shown from
/// the frontend: `recvmsg`/`getpeername` read it when the socket's own storage has no
/// entry, move the entry into the socket's storage and delete it here. Created with one
/// entry (never written by this layout) when nothing is migrated.
#[map]
pub static SOCK_REVNAT4_V3: LruHashMap<SockRevNat4V3Key, SockRevNat4V3> = LruHashMap::pinned(1, 0);

/// ABI 3's `{socket cookie, IPv6 backend}` -> frontend LRU, kept likewise.
#[map]
pub static SOCK_REVNAT6_V3: LruHashMap<SockRevNat6V3Key, SockRevNat6V3> = LruHashMap::pinned(1, 0);

/// A `BPF_MAP_TYPE_SK_STORAGE` map definition (BTF-defined: the kernel requires BTF for
/// its value), pinned by name like every other map so that programs loaded later (a
/// partial re-install) share it with the adopted ones. aya-ebpf's own `SkStorage` has no
/// `pinning` field.
#[repr(C)]
pub struct SkStorage<V> {
    r#type: *const [i32; BPF_MAP_TYPE_SK_STORAGE as usize],
    key: *const i32,
    value: *const V,
    max_entries: *const [i32; 0],
    map_flags: *const [i32; BPF_F_NO_PREALLOC as usize],
    /// `LIBBPF_PIN_BY_NAME`.
    pinning: *const [i32; 1],
}

// SAFETY: placeholder pointers patched by the loader, never dereferenced.
unsafe impl<V> Sync for SkStorage<V> {}

impl<V> SkStorage<V> {
    pub const fn new() -> Self {
        Self {
            r#type: core::ptr::null(),
            key: core::ptr::null(),
            value: core::ptr::null(),
            max_entries: core::ptr::null(),
            map_flags: core::ptr::null(),
            pinning: core::ptr::null(),
        }
    }

    /// The socket's value; with `create`, a zeroed one is made if there is none (fails
    /// only under memory pressure or the socket's `optmem_max`).
    #[inline(always)]
    pub fn get(&self, sk: *mut bpf_sock, create: bool) -> Option<*mut V> {
        let flags = if create {
            u64::from(BPF_SK_STORAGE_GET_F_CREATE)
        } else {
            0
        };
        // SAFETY: `sk` is the context's socket; the helper checks the map type.
        let p = unsafe {
            bpf_sk_storage_get(
                core::ptr::from_ref(self).cast_mut().cast(),
                sk.cast(),
                core::ptr::null_mut(),
                flags,
            )
        };
        (!p.is_null()).then_some(p.cast())
    }
}

/// Outcome counters, indexed by `Reason`.
#[map]
pub static STATS: PerCpuArray<u64> = PerCpuArray::pinned(Reason::COUNT, 0);

/// Outcome counters of the XDP hook (`xdp_ingress`), indexed by `Reason` like `STATS`:
/// the same stage outcomes, counted where they happened.
#[map]
pub static XDP_STATS: PerCpuArray<u64> = PerCpuArray::pinned(Reason::COUNT, 0);

/// Selections per backend id (connections for TCP and connected UDP, datagrams for
/// unconnected UDP). The writer deletes the entry when it frees the id.
#[map]
pub static BACKEND_CONNS: PerCpuHashMap<u32, u64> =
    PerCpuHashMap::pinned(MAX_BACKENDS, BPF_F_NO_PREALLOC);

/// `--metrics-per-service`: `[0]` = 1 while the agent wants `SVC_COUNTERS` and
/// `BACKEND_COUNTERS` counted; 0 (the default): one branch per counted event.
#[map]
pub static COUNTERS_ON: Array<u32> = Array::pinned(1, 0);

/// Per CPU, service id -> connections and packets of that frontend. A hash map without
/// preallocation: memory only for the ids counted; the agent deletes an id's entry when
/// it assigns the id (a reused id starts from zero).
#[map]
pub static SVC_COUNTERS: PerCpuHashMap<u32, FlowCounts> =
    PerCpuHashMap::pinned(MAX_COUNTED_FRONTENDS, BPF_F_NO_PREALLOC);

/// Per CPU, backend id -> connections and packets sent to that backend.
#[map]
pub static BACKEND_COUNTERS: PerCpuHashMap<u32, FlowCounts> =
    PerCpuHashMap::pinned(MAX_COUNTED_BACKENDS, BPF_F_NO_PREALLOC);

/// `[generation]`: bumped by the agent after it deletes backends. A UDP flow's entry
/// records the generation at which its backend was last found (`ct_flags::GEN_SHIFT`);
/// the backend is looked up again only when the two differ.
#[map]
pub static BACKEND_GEN: Array<u32> = Array::pinned(1, 0);

/// `[ABI_VERSION, ..]`, written by the loader; unused by the programs.
#[map]
pub static META: Array<u32> = Array::pinned(META_ENTRIES, 0);

/// TC connection tracking, IPv4: both directions of every NATed flow (LRU, so a full
/// table evicts old flows rather than refusing new ones).
#[map]
pub static CT4: LruHashMap<Ct4Key, Ct4Value> = LruHashMap::pinned(MAX_CT, 0);

/// TC connection tracking, IPv6.
#[map]
pub static CT6: LruHashMap<Ct6Key, Ct6Value> = LruHashMap::pinned(MAX_CT, 0);

/// The conntrack table a resize replaces, IPv4 (`CT4`'s previous map object): while the
/// programs of a resize run (loaded with [`CT_FALLBACK`] set), a `CT4` miss is looked up
/// here and the entry found is moved into `CT4` ([`ct4_get`]), so a flow the old programs
/// opened after the last copy keeps its translation across the program swap; and every
/// entry they write into `CT4` is written here too ([`ct4_put`], removed from both by
/// [`ct4_del`]), so a hook still running an old program (the hooks are swapped one by
/// one) finds a flow a new program opened on another hook (its reply, its next packet,
/// an ICMP error about it, the SNAT port it holds). The migration pins the old `CT4`
/// here; once its entries are all in `CT4` the programs are swapped again to ones loaded
/// without the fallback, and this is a 1-entry empty map.
#[map]
pub static CT4_PREV: LruHashMap<Ct4Key, Ct4Value> = LruHashMap::pinned(1, 0);

/// The conntrack table a resize replaces, IPv6 (see [`CT4_PREV`]).
#[map]
pub static CT6_PREV: LruHashMap<Ct6Key, Ct6Value> = LruHashMap::pinned(1, 0);

/// Set (to 1) by the loader for the programs of a conntrack resize only (a read-only
/// global: the verifier prunes the fallback lookup and the second write from every other
/// load).
#[unsafe(no_mangle)]
static CT_FALLBACK: u8 = 0;

/// Whether this load's programs look a `CT4`/`CT6` miss up in `CT4_PREV`/`CT6_PREV`.
#[inline(always)]
fn ct_fallback() -> bool {
    // SAFETY: a read of a global the loader may have set (volatile: not folded at build).
    unsafe { core::ptr::read_volatile(&raw const CT_FALLBACK) != 0 }
}

/// The `CT4` entry of `k`; during a resize also an entry of the previous table, moved
/// into `CT4` first (insert-if-absent: another CPU may have moved it meanwhile).
#[inline(always)]
pub fn ct4_get(k: &Ct4Key) -> Option<*mut Ct4Value> {
    if let Some(v) = CT4.get_ptr_mut(k) {
        return Some(v);
    }
    if !ct_fallback() {
        return None;
    }
    ct4_from_prev(k)
}

/// [`ct4_get`]'s fallback (inlined: no frame added to the stack chains; it needs no stack
/// of its own, the value found is handed to the update helper as it is).
#[inline(always)]
fn ct4_from_prev(k: &Ct4Key) -> Option<*mut Ct4Value> {
    let old = CT4_PREV.get_ptr(k)?;
    // SAFETY: a live map value, handed to the update helper as the value to copy.
    let _ = CT4.insert(k, unsafe { &*old }, u64::from(BPF_NOEXIST));
    CT4.get_ptr_mut(k)
}

/// Writes the `CT4` entry of `k`; during a resize also into `CT4_PREV`, the table the
/// old programs still running on other hooks use (best effort: a failure there costs
/// only what the fallback alone would). The caller's result is `CT4`'s.
#[inline(always)]
pub fn ct4_put(k: &Ct4Key, v: &Ct4Value) -> Result<(), ()> {
    CT4.insert(k, v, 0).map_err(|_| ())?;
    if ct_fallback() {
        let _ = CT4_PREV.insert(k, v, 0);
    }
    Ok(())
}

/// Removes the `CT4` entry of `k`; during a resize from `CT4_PREV` too ([`ct4_put`]).
#[inline(always)]
pub fn ct4_del(k: &Ct4Key) {
    let _ = CT4.remove(k);
    if ct_fallback() {
        let _ = CT4_PREV.remove(k);
    }
}

/// The IPv6 counterpart of [`ct4_put`].
#[inline(always)]
pub fn ct6_put(k: &Ct6Key, v: &Ct6Value) -> Result<(), ()> {
    CT6.insert(k, v, 0).map_err(|_| ())?;
    if ct_fallback() {
        let _ = CT6_PREV.insert(k, v, 0);
    }
    Ok(())
}

/// The IPv6 counterpart of [`ct4_del`].
#[inline(always)]
pub fn ct6_del(k: &Ct6Key) {
    let _ = CT6.remove(k);
    if ct_fallback() {
        let _ = CT6_PREV.remove(k);
    }
}

/// The IPv6 counterpart of [`ct4_get`].
#[inline(always)]
pub fn ct6_get(k: &Ct6Key) -> Option<*mut Ct6Value> {
    if let Some(v) = CT6.get_ptr_mut(k) {
        return Some(v);
    }
    if !ct_fallback() {
        return None;
    }
    ct6_from_prev(k)
}

/// [`ct6_get`]'s fallback (inlined, as [`ct4_from_prev`]).
#[inline(always)]
fn ct6_from_prev(k: &Ct6Key) -> Option<*mut Ct6Value> {
    let old = CT6_PREV.get_ptr(k)?;
    // SAFETY: as in `ct4_from_prev`.
    let _ = CT6.insert(k, unsafe { &*old }, u64::from(BPF_NOEXIST));
    CT6.get_ptr_mut(k)
}

/// The node's IPv4 addresses: NodePort frontends answer on these.
#[map]
pub static NODE_ADDRS4: HashMap<u32, u8> = HashMap::pinned(MAX_NODE_ADDRS, 0);

/// The node's IPv6 addresses.
#[map]
pub static NODE_ADDRS6: HashMap<[u32; 4], u8> = HashMap::pinned(MAX_NODE_ADDRS, 0);

/// `[NodeConfig]`: where the TC path source-NATs to.
#[map]
pub static NODE_CONFIG: Array<NodeConfig> = Array::pinned(1, 0);

/// `loadBalancerSourceRanges`, IPv4: `{service id, prefix}` -> allowed.
#[map]
pub static SRC_RANGE4: LpmTrie<SrcRange4, u8> = LpmTrie::pinned(MAX_SRC_RANGES, 0);

/// `loadBalancerSourceRanges`, IPv6.
#[map]
pub static SRC_RANGE6: LpmTrie<SrcRange6, u8> = LpmTrie::pinned(MAX_SRC_RANGES, 0);

/// DSR: the IPv4 prefixes whose DSR option the backend's node honours (the cluster's
/// node addresses as /32, `--dsr-trusted-cidrs`), written by the agent. LPM key data:
/// the address in network order.
#[map]
pub static DSR_TRUSTED4: LpmTrie<u32, u8> = LpmTrie::pinned(MAX_DSR_TRUSTED, 0);

/// DSR trusted prefixes, IPv6 (/128 per node address).
#[map]
pub static DSR_TRUSTED6: LpmTrie<[u32; 4], u8> = LpmTrie::pinned(MAX_DSR_TRUSTED, 0);

/// The Service CIDRs (`svc_cidr::RANGE`) and a /32 per ClusterIP in use
/// (`svc_cidr::CLUSTER_IP`), written by the agent; read on a frontend miss only, by the
/// socket hooks and by the per-packet stages (TC, XDP). LPM key data: the address in
/// network order.
#[map]
pub static SVC_CIDR4: LpmTrie<u32, u8> = LpmTrie::pinned(MAX_SVC_CIDR, 0);

/// Service CIDRs and ClusterIP markers, IPv6 (/128 per ClusterIP).
#[map]
pub static SVC_CIDR6: LpmTrie<[u32; 4], u8> = LpmTrie::pinned(MAX_SVC_CIDR, 0);

/// `sessionAffinity: ClientIP`: the backend each client last used, per service.
#[map]
pub static AFFINITY: LruHashMap<AffinityKey, AffinityValue> = LruHashMap::pinned(MAX_AFFINITY, 0);

/// Maglev tables, in chunks: `{service id, chunk}` -> backend slots. Only frontends
/// with `svc_flags::MAGLEV` have one (`BPF_F_NO_PREALLOC`: memory per table written).
#[map]
pub static MAGLEV: HashMap<MaglevKey, MaglevChunk> =
    HashMap::pinned(MAX_MAGLEV_CHUNKS, BPF_F_NO_PREALLOC);

/// `--socket-lb`: `[mode, host netns cookie]` (`proxy_common::socket_lb`).
#[map]
pub static SOCK_LB: Array<u64> = Array::pinned(2, 0);

/// cgroup ids whose sockets the socket hooks leave alone (per-pod bypass).
#[map]
pub static SOCK_LB_BYPASS: HashMap<u64, u8> = HashMap::pinned(65536, BPF_F_NO_PREALLOC);

/// `[fwd_mode]`: SNAT or DSR for external traffic to a backend on another node.
#[map]
pub static FWD_MODE: Array<u32> = Array::pinned(1, 0);

/// Datapath events for `proxyctl monitor` (`proxy_common::event::Event`), written by
/// `crate::events` while a monitor holds the lease in `MONITOR`.
#[map]
pub static EVENTS: RingBuf = RingBuf::pinned(RINGBUF_BYTES, 0);

/// `[MonitorCtl]`: the monitor's lease (reporting is off without one), the event types,
/// rate and sampling it asked for; written by `proxyctl monitor`.
#[map]
pub static MONITOR: Array<MonitorCtl> = Array::pinned(1, 0);

/// Per CPU `[MonitorCpu]`: the events' token bucket and how many were emitted, lost to
/// the rate limit, lost to a full ring buffer, sampled out.
#[map]
pub static MONITOR_CPU: PerCpuArray<MonitorCpu> = PerCpuArray::pinned(1, 0);

/// TC per-CPU scratch, IPv4: the parsed packet and a new flow's choice, kept off the
/// stack (the verifier counts 512 bytes over the whole call chain).
#[map]
pub static SCRATCH4: PerCpuArray<Scratch<u32>> = PerCpuArray::with_max_entries(1, 0);

/// TC per-CPU scratch, IPv6.
#[map]
pub static SCRATCH6: PerCpuArray<Scratch<[u32; 4]>> = PerCpuArray::with_max_entries(1, 0);

/// Per-CPU `bpf_fib_lookup` argument and result (`pkt::state::Fib`), of TC's redirect and
/// of XDP (kept there between the check before the rewrite and the forward after it):
/// 64 bytes off the stack, whose 512 the verifier counts over the whole call chain.
#[map]
pub static FIB: PerCpuArray<Fib> = PerCpuArray::with_max_entries(1, 0);

/// XDP's recent FIB answers per (ingress interface, source, destination), reused for
/// `xdp::FIB_HOP_TTL_NS`: the FIB lookup was a third of the program's time on a known
/// flow. Per CPU (no shared cache line between CPUs), LRU (a full cache forgets the
/// oldest next hop); not pinned: a cache, empty after every load.
#[map]
pub static FIB_HOP4: LruPerCpuHashMap<FibHopKey4, FibHop> =
    LruPerCpuHashMap::with_max_entries(FIB_HOP_ENTRIES, 0);

/// IPv6 counterpart of `FIB_HOP4`.
#[map]
pub static FIB_HOP6: LruPerCpuHashMap<FibHopKey6, FibHop> =
    LruPerCpuHashMap::with_max_entries(FIB_HOP_ENTRIES, 0);

/// Next hops each FIB cache holds (per CPU): backends and clients a node forwards to
/// in one TTL.
const FIB_HOP_ENTRIES: u32 = 4096;

/// Per-CPU token bucket of the ICMP port unreachable answers (`tc::unreach`).
#[map]
pub static UNREACH_BUCKET: PerCpuArray<Bucket> = PerCpuArray::with_max_entries(1, 0);

/// When this CPU last logged a datapath warning (`bpf_ktime_get_ns`); not pinned.
#[map]
static WARN_LAST: PerCpuArray<u64> = PerCpuArray::with_max_entries(1, 0);

/// At most one warning a second per CPU: a condition met by every packet of a flood
/// (a full SNAT range) is counted for each, logged once a second.
#[inline(never)]
pub fn warn_allowed() -> bool {
    let Some(last) = WARN_LAST.get_ptr_mut(0) else {
        return false;
    };
    // SAFETY: no preconditions.
    let now = unsafe { aya_ebpf::helpers::bpf_ktime_get_ns() };
    // SAFETY: this CPU's entry; the program is not preempted on its CPU.
    unsafe {
        if *last != 0 && now.saturating_sub(*last) < 1_000_000_000 {
            return false;
        }
        *last = now;
    }
    true
}

/// Counts one outcome.
#[inline(always)]
pub fn count(reason: Reason) {
    if let Some(c) = STATS.get_ptr_mut(reason as u32) {
        // SAFETY: per-CPU slot, this program is not preempted on its CPU.
        unsafe { *c += 1 };
    }
}

/// Counts one outcome of the XDP hook.
#[inline(always)]
pub fn count_xdp(reason: Reason) {
    if let Some(c) = XDP_STATS.get_ptr_mut(reason as u32) {
        // SAFETY: per-CPU slot, this program is not preempted on its CPU.
        unsafe { *c += 1 };
    }
}

/// Counts one selection of `backend_id`.
#[inline(always)]
pub fn count_backend(backend_id: u32) {
    match BACKEND_CONNS.get_ptr_mut(backend_id) {
        // SAFETY: per-CPU value.
        Some(c) => unsafe { *c += 1 },
        None => {
            let _ = BACKEND_CONNS.insert(backend_id, 1, 0);
        }
    }
}

/// Whether the agent asked for the per-Service counters (`COUNTERS_ON[0]`).
#[inline(always)]
pub fn counters_on() -> bool {
    match COUNTERS_ON.get_ptr(0) {
        // SAFETY: the array's one entry, read.
        Some(on) => unsafe { *on != 0 },
        None => false,
    }
}

/// Adds a connection (`conns`) and `packets` to the counters of a frontend and its
/// backend (`--metrics-per-service`, called only when [`counters_on`]). An id the full
/// map has no room for is not counted. In a frame of its own (the per-packet call
/// chains are close to the verifier's 512 bytes).
#[inline(never)]
pub fn count_flow(service_id: u32, backend_id: u32, conns: u64, packets: u64) {
    add_counts(&SVC_COUNTERS, service_id, conns, packets);
    add_counts(&BACKEND_COUNTERS, backend_id, conns, packets);
}

#[inline(always)]
fn add_counts(map: &PerCpuHashMap<u32, FlowCounts>, id: u32, conns: u64, packets: u64) {
    if id == 0 {
        return;
    }
    match map.get_ptr_mut(&id) {
        // SAFETY: this CPU's value; the program is not preempted on its CPU.
        Some(c) => unsafe {
            (*c).conns += conns;
            (*c).packets += packets;
        },
        None => {
            let _ = map.insert(&id, &FlowCounts { conns, packets }, 0);
        }
    }
}
