//! The state the TC and XDP programs keep per CPU (`maps::SCRATCH4/6`,
//! `maps::UNREACH_BUCKET`, `maps::FIB`):
//! plain data that uses no map, so `maps.rs` (which declares every map) can name these
//! types without importing the programs that use them.

use aya_ebpf::bindings::{bpf_fib_lookup as FibParams, BPF_F_MARK_MANGLED_0};
use proxy_common::proto;

/// A parsed packet: where its fields are and what they hold (network byte order).
pub struct Pkt<A> {
    pub l4: usize,
    pub proto: u8,
    pub saddr: A,
    pub daddr: A,
    pub sport: u16,
    pub dport: u16,
    pub tcp_flags: u8,
}

impl<A> Pkt<A> {
    pub fn csum_off(&self) -> usize {
        self.l4 + if self.proto == proto::TCP { 16 } else { 6 }
    }

    pub fn l4_flags(&self) -> u64 {
        if self.proto == proto::UDP {
            u64::from(BPF_F_MARK_MANGLED_0)
        } else {
            0
        }
    }
}

/// What a new flow was given: backend, SNAT, ids.
pub struct Chosen<A> {
    pub backend: (A, u16),
    pub snat: (A, u16),
    pub service_id: u32,
    pub backend_id: u32,
    pub flags: u32,
}

/// Per-CPU scratch (one entry per family, `maps::SCRATCH4/6`).
pub struct Scratch<A> {
    pub(crate) pkt: Pkt<A>,
    pub(crate) chosen: Chosen<A>,
    pub(crate) mark: EventMark<A>,
}

/// What the stage machine leaves for `stages::report` (`proxyctl monitor`), written only
/// while a monitor holds the lease: this packet started a new flow (`chosen` is its), or
/// found its UDP flow's backend gone.
pub struct EventMark<A> {
    pub(crate) new_flow: u8,
    pub(crate) stale: u8,
    pub(crate) stale_backend: (A, u16),
    pub(crate) stale_id: u32,
}

/// A token bucket in nanoseconds of credit (`maps::UNREACH_BUCKET`).
pub struct Bucket {
    pub(crate) credit_ns: u64,
    pub(crate) last_ns: u64,
}

/// A `bpf_fib_lookup` argument and result (`maps::FIB`). XDP keeps the result (egress
/// interface, Ethernet addresses) here between the check before the rewrite and the
/// forward after it.
pub struct Fib {
    pub params: FibParams,
}

/// A FIB answer XDP reuses (`FIB_HOP4/6`): where a packet from a source to a
/// destination arriving on an interface leaves, and the MAC addresses to write.
#[repr(C, align(8))]
#[derive(Clone, Copy)]
pub struct FibHop {
    /// The conntrack clock when the FIB gave it.
    pub stamp: u64,
    pub ifindex: u32,
    pub smac: [u8; 6],
    pub dmac: [u8; 6],
}

/// `FIB_HOP4` key: the ingress interface, source and destination.
#[repr(C)]
#[derive(Clone, Copy)]
pub struct FibHopKey4 {
    pub ifindex: u32,
    pub src: u32,
    pub dst: u32,
}

/// `FIB_HOP6` key.
#[repr(C)]
#[derive(Clone, Copy)]
pub struct FibHopKey6 {
    pub ifindex: u32,
    pub src: [u32; 4],
    pub dst: [u32; 4],
}
