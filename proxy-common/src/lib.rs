//! The ABI shared by the kernel programs (`proxy-ebpf`) and user space (`proxy-user`).
//!
//! Every type here is a map key or value. Rules (after aya's `integration-common`):
//! `#[repr(C)]`, explicit `_pad` fields so no type has implicit padding, integer flags
//! instead of `bool`, addresses and ports in network byte order exactly as the kernel
//! hands them to a `bpf_sock_addr` program (so no byte swapping happens in the datapath).
//! User-space trait impls (bytemuck, `aya::Pod`) live behind the `user` feature.
//!
//! The maps, each with its key, value and purpose, are listed once, in
//! `docs/ARCHITECTURE.md` ("Maps"); [`map_names::ALL`] names every pinned one, and
//! `proxy-user/tests/docs_agree.rs` checks that the two and `proxy-ebpf/src/maps.rs`
//! agree. The model follows cilium's `lb4_*`/`lb6_*` maps: a frontend's slot 0 holds its
//! backend count and service id, slots `1..=count` name backend ids, backends are shared
//! by id.
#![no_std]

pub mod lookup;
pub mod maglev;

/// Bumped whenever a key, value or map definition changes incompatibly. The loader stores
/// it in the `META` map; pins of an older version are migrated (`proxy-user/src/migrate`).
/// 4: `SOCK_REVNAT4/6` became per-socket storage (`SK_STORAGE`) instead of a node-wide LRU.
pub const ABI_VERSION: u32 = 4;

/// Map names, as they appear in the object file, under the pin directory and in bpftool.
pub mod map_names {
    /// Frontends and their backend slots, IPv4.
    pub const SVC4: &str = "SVC4";
    /// Frontends and their backend slots, IPv6.
    pub const SVC6: &str = "SVC6";
    /// Backend id -> IPv4 backend.
    pub const BACKEND4: &str = "BACKEND4";
    /// Backend id -> IPv6 backend.
    pub const BACKEND6: &str = "BACKEND6";
    /// Service id -> IPv4 frontend.
    pub const REVNAT4: &str = "REVNAT4";
    /// Service id -> IPv6 frontend.
    pub const REVNAT6: &str = "REVNAT6";
    /// Per socket: IPv4 backend -> frontend (socket-local storage).
    pub const SOCK_REVNAT4: &str = "SOCK_REVNAT4";
    /// Per socket: IPv6 backend -> frontend (socket-local storage).
    pub const SOCK_REVNAT6: &str = "SOCK_REVNAT6";
    /// Per-CPU outcome counters indexed by `Reason`.
    pub const STATS: &str = "STATS";
    /// Per-CPU selections per backend id.
    pub const BACKEND_CONNS: &str = "BACKEND_CONNS";
    /// `[ABI_VERSION]`, written by the loader.
    pub const META: &str = "META";
    /// TC connection tracking, IPv4 (LRU).
    pub const CT4: &str = "CT4";
    /// TC connection tracking, IPv6 (LRU).
    pub const CT6: &str = "CT6";
    /// The node's own IPv4 addresses (NodePort frontends answer on them).
    pub const NODE_ADDRS4: &str = "NODE_ADDRS4";
    /// The node's own IPv6 addresses.
    pub const NODE_ADDRS6: &str = "NODE_ADDRS6";
    /// `[NodeConfig]`: SNAT addresses, written by the agent.
    pub const NODE_CONFIG: &str = "NODE_CONFIG";
    /// `loadBalancerSourceRanges` allow-lists, IPv4 (LPM trie keyed by service id + prefix).
    pub const SRC_RANGE4: &str = "SRC_RANGE4";
    /// `loadBalancerSourceRanges` allow-lists, IPv6.
    pub const SRC_RANGE6: &str = "SRC_RANGE6";
    /// `sessionAffinity: ClientIP`: client + service id -> backend (LRU).
    pub const AFFINITY: &str = "AFFINITY";
    /// Per-CPU outcome counters of the XDP hook, indexed by `Reason` like `STATS`.
    pub const XDP_STATS: &str = "XDP_STATS";
    /// Maglev lookup tables: `{service id, chunk}` -> a chunk of backend slots.
    pub const MAGLEV: &str = "MAGLEV";
    /// `[forwarding mode]` (`fwd_mode`): SNAT or DSR for external traffic to a backend on
    /// another node, written by the agent (`--forwarding-mode`).
    pub const FWD_MODE: &str = "FWD_MODE";

    /// Every pinned map.
    pub const ALL: [&str; 22] = [
        SVC4,
        SVC6,
        BACKEND4,
        BACKEND6,
        REVNAT4,
        REVNAT6,
        SOCK_REVNAT4,
        SOCK_REVNAT6,
        STATS,
        BACKEND_CONNS,
        META,
        CT4,
        CT6,
        NODE_ADDRS4,
        NODE_ADDRS6,
        NODE_CONFIG,
        SRC_RANGE4,
        SRC_RANGE6,
        AFFINITY,
        XDP_STATS,
        MAGLEV,
        FWD_MODE,
    ];
}

/// Map sizes. Hash maps are created with `BPF_F_NO_PREALLOC`, so a large limit costs
/// memory only for entries in use (as cilium's lb maps do).
pub mod limits {
    /// Frontend + slot entries per family: 50,000 services x (1 + 10 endpoints) fits twice.
    pub const MAX_SVC_ENTRIES: u32 = 1 << 20;
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
}

/// TC connection-tracking timeouts (nanoseconds), after kube-proxy's conntrack settings.
pub mod ct_timeouts {
    const S: u64 = 1_000_000_000;
    /// A TCP flow that has seen its handshake's first packet only.
    pub const TCP_SYN: u64 = 60 * S;
    /// An established TCP flow (kube-proxy sets nf_conntrack_tcp_timeout_established
    /// to 24 h).
    pub const TCP_ESTABLISHED: u64 = 24 * 3600 * S;
    /// After a FIN or RST: closing flows go quickly.
    pub const TCP_CLOSING: u64 = 10 * S;
    /// UDP (and other) flows: idle time.
    pub const UDP: u64 = 60 * S;
}

/// `CtValue::flags`.
pub mod ct_flags {
    /// This entry belongs to a flow that was source-NATed to the node.
    pub const SNAT: u32 = 1 << 0;
    /// A FIN or RST was seen: the flow times out after `TCP_CLOSING`.
    pub const CLOSING: u32 = 1 << 1;
    /// A packet of the reply direction was seen (TCP: the handshake completed).
    pub const SEEN_REPLY: u32 = 1 << 2;
    /// Direct server return: on the first node, a flow sent to a backend on another node
    /// with the DSR option instead of SNAT; on the backend's node, the reply entry
    /// learnt from that option (the reply leaves with the frontend as source).
    pub const DSR: u32 = 1 << 3;
}

/// `FWD_MODE[0]`: how the TC path forwards external traffic (eTP=Cluster) to a backend
/// on another node (`--forwarding-mode`).
pub mod fwd_mode {
    /// Source NAT to the node's address: replies come back through this node.
    pub const SNAT: u32 = 0;
    /// Direct server return for TCP and UDP: the backend's node learns the client and the
    /// frontend from an IPv4 option (IPv6: a destination option) and replies straight to
    /// the client.
    pub const DSR: u32 = 1;
    /// DSR for TCP, SNAT for UDP (as Cilium's `hybrid`).
    pub const HYBRID: u32 = 2;
}

/// The DSR option (after Cilium's `dsr_opt_v4`/`dsr_opt_v6`). IPv4: 8 bytes right after
/// the 20-byte header, `[type, length, frontend port (2), frontend address (4)]`, network
/// order.
pub mod dsr_opt {
    /// Option type: the copied bit (so fragments keep it) | number 26, Cilium's value.
    pub const TYPE4: u8 = 0x9a;
    /// Option length in bytes (the IPv4 header grows from 20 to 28: IHL 7).
    pub const LEN4: u8 = 8;
    /// IPv6: the option in a Destination Options header of 24 bytes after the 40-byte
    /// header, `[next header, 2, TYPE6, LEN6, frontend address (16), port (2), 0, 0]`
    /// (Cilium's `dsr_opt_v6`). Type 0x1b: the two high bits 0, "skip if unknown".
    pub const TYPE6: u8 = 0x1b;
    /// Option data length: address, port and 2 bytes of zero.
    pub const LEN6: u8 = 20;
}

/// IP protocol numbers as they appear in `bpf_sock_addr.protocol` and in IP headers.
pub mod proto {
    /// TCP.
    pub const TCP: u8 = 6;
    /// UDP.
    pub const UDP: u8 = 17;
    /// SCTP.
    pub const SCTP: u8 = 132;
}

/// Frontend flags (slot 0 of `SvcValue::flags`).
pub mod svc_flags {
    /// `sessionAffinity: ClientIP`: the hooks and TC follow the client's `AFFINITY` entry for
    /// `affinity_timeout` seconds after its last connection.
    pub const AFFINITY: u16 = 1 << 0;
    /// The slots hold only node-local endpoints because of a Local traffic policy
    /// (`internalTrafficPolicy` for a ClusterIP, `externalTrafficPolicy` for the
    /// external scope); zero of them means "drop", not "reject".
    pub const LOCAL_ONLY: u16 = 1 << 1;
    /// A NodePort frontend (address 0: any of the node's addresses).
    pub const NODE_PORT: u16 = 1 << 2;
    /// A `spec.externalIPs` frontend.
    pub const EXTERNAL_IP: u16 = 1 << 3;
    /// A `status.loadBalancer.ingress[].ip` frontend.
    pub const LOAD_BALANCER: u16 = 1 << 4;
    /// `externalTrafficPolicy: Local`: traffic from outside the node uses the
    /// `scope::EXTERNAL_LOCAL` entry of the same frontend (local endpoints, client address
    /// preserved).
    pub const ETP_LOCAL: u16 = 1 << 5;
    /// `loadBalancerSourceRanges`: only sources in `SRC_RANGE4/6` for this service id.
    pub const SOURCE_RANGES: u16 = 1 << 6;
    /// Maglev consistent hashing for new TC flows: the backend slot comes from this
    /// frontend's `MAGLEV` table (by its service id), indexed by a hash of the flow's
    /// 5-tuple, so every node picks the same backend for the same flow. Set only once the
    /// table is written; a missing or inconsistent table falls back to random.
    pub const MAGLEV: u16 = 1 << 7;
}

/// `Svc4Key::scope` / `Svc6Key::scope`.
pub mod scope {
    /// The frontend for every client: cluster-wide (or iTP-local) endpoints.
    pub const ALL: u8 = 0;
    /// For traffic from outside the node to a frontend with `ETP_LOCAL`.
    pub const EXTERNAL_LOCAL: u8 = 1;
}

/// Backend flags.
pub mod backend_flags {
    /// The endpoint is terminating (it is only in a slot as serving fallback).
    pub const TERMINATING: u8 = 1 << 0;
    /// The endpoint runs on this node (TC: no SNAT needed for it).
    pub const LOCAL: u8 = 1 << 1;
}

/// Bytes of a service name kept in `REVNAT` values (`namespace/name:port`, truncated).
pub const NAME_LEN: usize = 64;

/// `META` indices.
pub mod meta {
    /// The `ABI_VERSION` the pinned maps were created with.
    pub const ABI_VERSION: u32 = 0;
    /// Kernel id of a loaded hook program, so a later agent can read the programs'
    /// aya-log records (`EbpfLogger::init_from_id`).
    pub const LOG_PROGRAM_ID: u32 = 1;
    /// A hash of the eBPF object whose programs run (0: unknown, pins of an older
    /// build): a new build with another hash swaps its programs in (`migrate.rs`).
    pub const OBJECT_HASH: u32 = 2;
    /// The XDP acceleration the agent installed (`acceleration::*`), for `proxyctl`.
    pub const ACCELERATION: u32 = 3;
}

/// `META[ACCELERATION]`: where the node's north-south traffic is handled first.
pub mod acceleration {
    /// No XDP hook: TC handles it (also what pins of an older build read as).
    pub const OFF: u32 = 0;
    /// XDP in generic (skb) mode, ahead of TC.
    pub const GENERIC: u32 = 1;
    /// XDP in the driver (native mode), ahead of TC.
    pub const NATIVE: u32 = 2;
}

/// Every outcome of a datapath decision: the index into the per-CPU `STATS` array.
/// Each non-success path in the kernel increments exactly one of these.
#[repr(u32)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Reason {
    /// Destination rewritten from a frontend to a backend.
    Translated = 0,
    /// Destination is not a frontend: left alone.
    NoService = 1,
    /// The frontend exists with zero backends: the syscall fails with ECONNREFUSED.
    NoBackend = 2,
    /// Slot or backend entry missing (a writer bug or a racing delete): left alone.
    BackendMissing = 3,
    /// Socket protocol other than TCP/UDP: left alone.
    UnsupportedProto = 4,
    /// Reply source rewritten from a backend back to its frontend.
    RevTranslated = 5,
    /// No reverse-NAT entry for this socket and peer: left alone.
    RevNatMiss = 6,
    /// Reverse-NAT entry whose frontend is gone or reused: deleted, left alone.
    RevNatStale = 7,
    /// The reverse-NAT entry could not be written (map full is not possible: LRU).
    RevNatUpdateFailed = 8,
    /// `internalTrafficPolicy: Local` frontend with no endpoint on this node (kube-proxy
    /// drops): the syscall fails with EHOSTUNREACH at once instead of timing out.
    NoLocalBackend = 9,
    /// TC: a new flow to a frontend, DNATed (and SNATed when needed).
    TcNewFlow = 10,
    /// TC: a packet of a known flow, translated from its conntrack entry.
    TcFlow = 11,
    /// TC: a reply, reverse-translated from its conntrack entry.
    TcReply = 12,
    /// TC: a frontend with no endpoints: TCP answered with RST, UDP with ICMP port
    /// unreachable, other packets dropped.
    TcNoBackend = 13,
    /// TC: a source outside `loadBalancerSourceRanges`: dropped.
    TcSourceDenied = 14,
    /// TC: no free SNAT port or no SNAT address: dropped.
    TcSnatFailed = 15,
    /// TC: `externalTrafficPolicy: Local` with no local endpoint: dropped.
    TcNoLocalBackend = 16,
    /// TC: the FIB had no route for a translated packet; handed to the stack.
    TcFibMiss = 17,
    /// TC: an ICMP error about a NATed flow, translated for its backend or client.
    TcIcmpError = 18,
    /// `sessionAffinity: ClientIP`: the client's previous backend was chosen again.
    AffinityHit = 19,
    /// TC: a UDP flow whose backend is gone (no longer in the maps): balanced afresh,
    /// as kube-proxy's conntrack cleanup for removed UDP endpoints does.
    TcStaleBackend = 20,
    /// TC: an ICMP port unreachable not sent, over the rate limit (1,000/s per CPU after
    /// a burst of 50, the kernel's defaults for its own ICMP errors): dropped.
    TcRejectLimited = 21,
    /// TC: a new flow's conntrack entries could not be written (neither is kept): the
    /// packet is dropped rather than translated one way only.
    TcCtWriteFailed = 22,
    /// TC: a packet (or an ICMP error's quoted header) could not be rewritten, a helper
    /// refused half-way: the packet is dropped rather than sent half-translated.
    TcRewriteFailed = 23,
    /// XDP: a packet XDP leaves untouched to the stack and so to TC, which handles it
    /// whole: an IP fragment, an ICMP error (TC translates those about NATed flows), a
    /// frontend without endpoints (TC sends the REJECT answer), a FIB result XDP cannot
    /// forward by (no neighbour entry yet, no route, local delivery). Counted in
    /// `XDP_STATS` only.
    XdpToStack = 24,
    /// TC, DSR (`--forwarding-mode dsr|hybrid`), first node: a packet sent to a backend
    /// on another node with the DSR option carrying the frontend (client address kept,
    /// no SNAT): a new flow's first packet, every TCP SYN, every UDP datagram.
    TcDsrEncap = 25,
    /// TC, DSR, backend's node: a packet with the DSR option: the reply entry recorded
    /// (backend -> client: source := the frontend), the option removed, delivered.
    TcDsrDecap = 26,
    /// TC, DSR, backend's node: a backend's reply sent straight to the client with the
    /// frontend as source.
    TcDsrReply = 27,
    /// TC, DSR, first node: the option would make the packet exceed the route's MTU: a
    /// new flow is SNATed instead, a later datagram of a DSR flow goes without the
    /// option (the backend's node already knows the flow). Counted in addition to the
    /// packet's outcome.
    TcDsrTooBig = 28,
}

impl Reason {
    /// Number of counters (size of `STATS`).
    pub const COUNT: u32 = 29;
    /// Every reason in index order.
    pub const ALL: [Reason; Self::COUNT as usize] = [
        Reason::Translated,
        Reason::NoService,
        Reason::NoBackend,
        Reason::BackendMissing,
        Reason::UnsupportedProto,
        Reason::RevTranslated,
        Reason::RevNatMiss,
        Reason::RevNatStale,
        Reason::RevNatUpdateFailed,
        Reason::NoLocalBackend,
        Reason::TcNewFlow,
        Reason::TcFlow,
        Reason::TcReply,
        Reason::TcNoBackend,
        Reason::TcSourceDenied,
        Reason::TcSnatFailed,
        Reason::TcNoLocalBackend,
        Reason::TcFibMiss,
        Reason::TcIcmpError,
        Reason::AffinityHit,
        Reason::TcStaleBackend,
        Reason::TcRejectLimited,
        Reason::TcCtWriteFailed,
        Reason::TcRewriteFailed,
        Reason::XdpToStack,
        Reason::TcDsrEncap,
        Reason::TcDsrDecap,
        Reason::TcDsrReply,
        Reason::TcDsrTooBig,
    ];

    /// A stable snake_case name, used in metrics and CLI output.
    pub const fn name(self) -> &'static str {
        match self {
            Reason::Translated => "translated",
            Reason::NoService => "no_service",
            Reason::NoBackend => "no_backend",
            Reason::BackendMissing => "backend_missing",
            Reason::UnsupportedProto => "unsupported_proto",
            Reason::RevTranslated => "rev_translated",
            Reason::RevNatMiss => "rev_nat_miss",
            Reason::RevNatStale => "rev_nat_stale",
            Reason::RevNatUpdateFailed => "rev_nat_update_failed",
            Reason::NoLocalBackend => "no_local_backend",
            Reason::TcNewFlow => "tc_new_flow",
            Reason::TcFlow => "tc_flow",
            Reason::TcReply => "tc_reply",
            Reason::TcNoBackend => "tc_no_backend",
            Reason::TcSourceDenied => "tc_source_denied",
            Reason::TcSnatFailed => "tc_snat_failed",
            Reason::TcNoLocalBackend => "tc_no_local_backend",
            Reason::TcFibMiss => "tc_fib_miss",
            Reason::TcIcmpError => "tc_icmp_error",
            Reason::AffinityHit => "affinity_hit",
            Reason::TcStaleBackend => "tc_stale_backend",
            Reason::TcRejectLimited => "tc_reject_limited",
            Reason::TcCtWriteFailed => "tc_ct_write_failed",
            Reason::TcRewriteFailed => "tc_rewrite_failed",
            Reason::XdpToStack => "xdp_to_stack",
            Reason::TcDsrEncap => "tc_dsr_encap",
            Reason::TcDsrDecap => "tc_dsr_decap",
            Reason::TcDsrReply => "tc_dsr_reply",
            Reason::TcDsrTooBig => "tc_dsr_too_big",
        }
    }
}

/// `SVC4` key. `port` is in network byte order, `addr` as the 4 bytes of the address.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Svc4Key {
    pub addr: u32,
    pub port: u16,
    /// 0 for the frontend entry, `1..=count` for backend slots.
    pub slot: u16,
    pub proto: u8,
    /// `scope::ALL` or `scope::EXTERNAL_LOCAL`.
    pub scope: u8,
    pub _pad: [u8; 2],
}

/// `SVC6` key; the address as four network-order words, as in `bpf_sock_addr.user_ip6`.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Svc6Key {
    pub addr: [u32; 4],
    pub port: u16,
    pub slot: u16,
    pub proto: u8,
    pub scope: u8,
    pub _pad: [u8; 2],
}

/// `SVC4`/`SVC6` value. In slot 0: `count`, `service_id`, `flags`, `affinity_timeout`.
/// In slot n: `backend_id` (and `service_id`, for dumps).
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub struct SvcValue {
    pub backend_id: u32,
    pub service_id: u32,
    pub count: u16,
    pub flags: u16,
    /// Session affinity timeout in seconds (0: no affinity).
    pub affinity_timeout: u32,
}

/// `BACKEND4` value.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Backend4 {
    pub addr: u32,
    pub port: u16,
    pub proto: u8,
    pub flags: u8,
}

/// `BACKEND6` value.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Backend6 {
    pub addr: [u32; 4],
    pub port: u16,
    pub proto: u8,
    pub flags: u8,
}

/// `REVNAT4` value (key: service id): the frontend and, for the CLI, the Service's
/// name (`namespace/name:port`, NUL-padded).
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RevNat4 {
    pub addr: u32,
    pub port: u16,
    pub proto: u8,
    pub scope: u8,
    pub name: [u8; NAME_LEN],
}

/// `REVNAT6` value (key: service id).
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RevNat6 {
    pub addr: [u32; 4],
    pub port: u16,
    pub proto: u8,
    pub scope: u8,
    pub name: [u8; NAME_LEN],
}

/// `CT4` key: a flow's 5-tuple as it appears on the wire in one direction.
/// `dir` 0: the original direction (client -> frontend, before DNAT); 1: the reply
/// direction (backend -> client or node SNAT address, before reverse NAT).
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Ct4Key {
    pub saddr: u32,
    pub daddr: u32,
    pub sport: u16,
    pub dport: u16,
    pub proto: u8,
    pub dir: u8,
    pub _pad: [u8; 2],
}

/// `CT6` key.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Ct6Key {
    pub saddr: [u32; 4],
    pub daddr: [u32; 4],
    pub sport: u16,
    pub dport: u16,
    pub proto: u8,
    pub dir: u8,
    pub _pad: [u8; 2],
}

/// `CT4` value: how to rewrite a packet of this direction. A zero address means "leave
/// it". Original direction: destination := the backend, source := the node's SNAT
/// address and port (eTP=Cluster to a remote backend). Reply direction: source := the
/// frontend, destination := the client (when the flow was SNATed).
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Ct4Value {
    pub dnat_addr: u32,
    pub snat_addr: u32,
    pub dnat_port: u16,
    pub snat_port: u16,
    pub service_id: u32,
    pub backend_id: u32,
    /// `ct_flags`.
    pub flags: u32,
    /// `bpf_ktime_get_ns()` of the last packet.
    pub last_seen: u64,
    /// Packets seen in this direction.
    pub packets: u64,
}

/// `CT6` value (see [`Ct4Value`]).
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Ct6Value {
    pub dnat_addr: [u32; 4],
    pub snat_addr: [u32; 4],
    pub dnat_port: u16,
    pub snat_port: u16,
    pub service_id: u32,
    pub backend_id: u32,
    pub flags: u32,
    pub last_seen: u64,
    pub packets: u64,
}

/// `AffinityKey::kind`: what identifies the client.
pub mod affinity_kind {
    /// The client's network namespace cookie (socket hooks: the source address is not
    /// known at `connect()`; one pod, one namespace).
    pub const NETNS: u8 = 0;
    /// An IPv4 source address (TC), in `client[0]`.
    pub const V4: u8 = 4;
    /// An IPv6 source address (TC).
    pub const V6: u8 = 6;
}

/// `AFFINITY` key.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct AffinityKey {
    /// The client: a namespace cookie in words 0-1 (native order), or its address.
    pub client: [u32; 4],
    pub service_id: u32,
    /// One of [`affinity_kind`].
    pub kind: u8,
    pub _pad: [u8; 3],
}

/// `AFFINITY` value.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct AffinityValue {
    pub backend_id: u32,
    /// The slot the backend had: a hit is used only while that slot still names it.
    pub slot: u16,
    pub _pad: u16,
    /// `bpf_ktime_get_ns` of the last selection through this entry.
    pub last_used_ns: u64,
}

/// `NODE_CONFIG[0]`: addresses the TC path source-NATs to (the node's primary address
/// per family; zero: no SNAT possible for that family).
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub struct NodeConfig {
    pub snat4: u32,
    pub snat6: [u32; 4],
}

/// `SRC_RANGE4` LPM key data (after the 4-byte prefix length): service id, then the
/// address; the prefix length counts 32 bits of service id plus the address prefix.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SrcRange4 {
    pub service_id: u32,
    pub addr: u32,
}

/// `SRC_RANGE6` LPM key data.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SrcRange6 {
    pub service_id: u32,
    pub addr: [u32; 4],
}

/// One reverse entry of a socket: the frontend it asked for when it was sent to this
/// IPv4 backend. `backend_port == 0`: an empty entry (no backend has port 0).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct SockRevNat4Entry {
    pub backend_addr: u32,
    pub backend_port: u16,
    /// The frontend's port.
    pub port: u16,
    /// The frontend's address.
    pub addr: u32,
    pub service_id: u32,
}

/// `SOCK_REVNAT4` value (socket-local storage): the socket's reverse entries, the oldest
/// replaced first (`next`, taken modulo [`limits::SOCK_REVNAT_SLOTS`], is where the next
/// new backend goes).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct SockRevNat4 {
    pub next: u32,
    pub entries: [SockRevNat4Entry; limits::SOCK_REVNAT_SLOTS],
}

/// One reverse entry of a socket for an IPv6 backend.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct SockRevNat6Entry {
    pub backend_addr: [u32; 4],
    /// The frontend's address.
    pub addr: [u32; 4],
    pub backend_port: u16,
    /// The frontend's port.
    pub port: u16,
    pub service_id: u32,
}

/// `SOCK_REVNAT6` value (socket-local storage).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct SockRevNat6 {
    pub next: u32,
    pub entries: [SockRevNat6Entry; limits::SOCK_REVNAT_SLOTS],
}

impl Svc4Key {
    /// The key of slot `slot` of frontend `addr:port/proto` in `scope`.
    pub const fn new(addr: u32, port: u16, proto: u8, scope: u8, slot: u16) -> Self {
        Self {
            addr,
            port,
            slot,
            proto,
            scope,
            _pad: [0; 2],
        }
    }
}

impl Ct4Key {
    /// The key of direction `dir` (0 original, 1 reply) of a flow.
    pub const fn new(saddr: u32, daddr: u32, sport: u16, dport: u16, proto: u8, dir: u8) -> Self {
        Self {
            saddr,
            daddr,
            sport,
            dport,
            proto,
            dir,
            _pad: [0; 2],
        }
    }
}

impl Ct6Key {
    /// The key of direction `dir` (0 original, 1 reply) of a flow.
    pub const fn new(
        saddr: [u32; 4],
        daddr: [u32; 4],
        sport: u16,
        dport: u16,
        proto: u8,
        dir: u8,
    ) -> Self {
        Self {
            saddr,
            daddr,
            sport,
            dport,
            proto,
            dir,
            _pad: [0; 2],
        }
    }
}

impl Svc6Key {
    /// The key of slot `slot` of frontend `addr:port/proto` in `scope`.
    pub const fn new(addr: [u32; 4], port: u16, proto: u8, scope: u8, slot: u16) -> Self {
        Self {
            addr,
            port,
            slot,
            proto,
            scope,
            _pad: [0; 2],
        }
    }
}

/// `MAGLEV` key: one chunk of the table of the frontend with `service_id`.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct MaglevKey {
    pub service_id: u32,
    /// Chunk number: slots `chunk * MAGLEV_CHUNK_SLOTS ..` of the table.
    pub chunk: u32,
}

/// `MAGLEV` value: `MAGLEV_CHUNK_SLOTS` entries of a table of `table_size` entries, each
/// a backend slot (`1..=count` of the frontend; 0 past the table's end).
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct MaglevChunk {
    /// M, the whole table's size (the same in every chunk of a table).
    pub table_size: u32,
    pub _pad: u32,
    pub slots: [u16; limits::MAGLEV_CHUNK_SLOTS],
}

#[cfg(feature = "user")]
mod user {
    use super::*;

    macro_rules! pod {
        ($($t:ty),* $(,)?) => {$(
            // SAFETY: #[repr(C)], only integer fields, explicit padding: checked by the
            // layout tests below (size == sum of field sizes).
            unsafe impl bytemuck::Zeroable for $t {}
            unsafe impl bytemuck::Pod for $t {}
            unsafe impl aya::Pod for $t {}
        )*};
    }

    pod!(
        Svc4Key,
        Svc6Key,
        SvcValue,
        Backend4,
        Backend6,
        RevNat4,
        RevNat6,
        SockRevNat4Entry,
        SockRevNat6Entry,
        SockRevNat4,
        SockRevNat6,
        Ct4Key,
        Ct6Key,
        Ct4Value,
        Ct6Value,
        NodeConfig,
        SrcRange4,
        SrcRange6,
        AffinityKey,
        AffinityValue,
        MaglevKey,
        MaglevChunk,
    );
}

#[cfg(test)]
mod tests {
    use super::*;
    use core::mem::{align_of, size_of};

    /// Size equals the sum of the field sizes: no implicit padding anywhere, which the
    /// kernel needs (hash keys are compared byte by byte, padding would be garbage).
    macro_rules! assert_layout {
        ($t:ty, size $size:expr, align $align:expr, fields [$($f:ty),*]) => {
            assert_eq!(size_of::<$t>(), $size, stringify!($t));
            assert_eq!(align_of::<$t>(), $align, stringify!($t));
            assert_eq!(0 $(+ size_of::<$f>())*, $size, concat!(stringify!($t), " has implicit padding"));
        };
    }

    #[test]
    fn abi_sizes_and_no_implicit_padding() {
        assert_layout!(Svc4Key, size 12, align 4, fields [u32, u16, u16, u8, u8, [u8; 2]]);
        assert_layout!(Svc6Key, size 24, align 4, fields [[u32; 4], u16, u16, u8, u8, [u8; 2]]);
        assert_layout!(SvcValue, size 16, align 4, fields [u32, u32, u16, u16, u32]);
        assert_layout!(Backend4, size 8, align 4, fields [u32, u16, u8, u8]);
        assert_layout!(Backend6, size 20, align 4, fields [[u32; 4], u16, u8, u8]);
        assert_layout!(RevNat4, size 72, align 4, fields [u32, u16, u8, u8, [u8; NAME_LEN]]);
        assert_layout!(RevNat6, size 84, align 4, fields [[u32; 4], u16, u8, u8, [u8; NAME_LEN]]);
        assert_layout!(SockRevNat4Entry, size 16, align 4, fields [u32, u16, u16, u32, u32]);
        assert_layout!(SockRevNat6Entry, size 40, align 4, fields [[u32; 4], [u32; 4], u16, u16, u32]);
        assert_layout!(SockRevNat4, size 132, align 4, fields [u32, [SockRevNat4Entry; limits::SOCK_REVNAT_SLOTS]]);
        assert_layout!(SockRevNat6, size 324, align 4, fields [u32, [SockRevNat6Entry; limits::SOCK_REVNAT_SLOTS]]);
        assert_layout!(Ct4Key, size 16, align 4, fields [u32, u32, u16, u16, u8, u8, [u8; 2]]);
        assert_layout!(Ct6Key, size 40, align 4, fields [[u32; 4], [u32; 4], u16, u16, u8, u8, [u8; 2]]);
        assert_layout!(Ct4Value, size 40, align 8, fields [u32, u32, u16, u16, u32, u32, u32, u64, u64]);
        assert_layout!(Ct6Value, size 64, align 8, fields [[u32; 4], [u32; 4], u16, u16, u32, u32, u32, u64, u64]);
        assert_layout!(NodeConfig, size 20, align 4, fields [u32, [u32; 4]]);
        assert_layout!(AffinityKey, size 24, align 4, fields [[u32; 4], u32, u8, [u8; 3]]);
        assert_layout!(AffinityValue, size 16, align 8, fields [u32, u16, u16, u64]);
        assert_layout!(SrcRange4, size 8, align 4, fields [u32, u32]);
        assert_layout!(SrcRange6, size 20, align 4, fields [u32, [u32; 4]]);
        assert_layout!(MaglevKey, size 8, align 4, fields [u32, u32]);
        assert_layout!(MaglevChunk, size 4032, align 4, fields [u32, u32, [u16; limits::MAGLEV_CHUNK_SLOTS]]);
    }

    #[test]
    fn field_offsets_are_fixed() {
        assert_eq!(core::mem::offset_of!(Svc4Key, port), 4);
        assert_eq!(core::mem::offset_of!(Svc4Key, slot), 6);
        assert_eq!(core::mem::offset_of!(Svc4Key, proto), 8);
        assert_eq!(core::mem::offset_of!(Svc6Key, port), 16);
        assert_eq!(core::mem::offset_of!(SvcValue, count), 8);
        assert_eq!(core::mem::offset_of!(SockRevNat6Entry, backend_port), 32);
    }

    #[test]
    fn reasons_are_dense_and_named_uniquely() {
        for (i, r) in Reason::ALL.iter().enumerate() {
            assert_eq!(*r as u32, i as u32);
            for other in &Reason::ALL[i + 1..] {
                assert_ne!(r.name(), other.name());
            }
        }
    }
}
