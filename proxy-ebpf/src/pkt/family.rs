//! Per-family packet layout and maps of the per-packet datapath, built on [`lb::Family`]
//! (the socket hooks' family trait: frontends, backends, node addresses) with what only a
//! packet path needs (conntrack, SNAT address, source ranges, header offsets).
//!
//! Nothing here depends on the hook's context: packets are read and written through
//! [`PktAccess`], so a second packet datapath (XDP) can reuse the layout, the conntrack
//! and the NAT code by implementing that trait for its own context.

use aya_ebpf::{
    bindings::{bpf_fib_lookup as FibParams, BPF_F_PSEUDO_HDR},
    helpers::generated::bpf_csum_diff,
    maps::lpm_trie::Key as LpmKey,
    EbpfContext,
};
use aya_log_ebpf::warn;
use core::net::{Ipv4Addr, Ipv6Addr};
use proxy_common::{
    affinity_kind, proto, Ct4Key, Ct4Value, Ct6Key, Ct6Value, SrcRange4, SrcRange6,
};

use super::state::{FibHop, FibHopKey4, FibHopKey6, Scratch};
use crate::lb::{Family, V4, V6};
use crate::maps::{
    DSR_TRUSTED4, DSR_TRUSTED6, FIB_HOP4, FIB_HOP6, NODE_CONFIG, SCRATCH4, SCRATCH6, SRC_RANGE4,
    SRC_RANGE6, SVC_CIDR4, SVC_CIDR6,
};

pub const ETH_HLEN: usize = 14;
pub const ETH_P_IP: u16 = 0x0800;
pub const ETH_P_IPV6: u16 = 0x86dd;

/// Reading and writing a packet: what the packet-path code needs from its context (the
/// TC context in `crate::tc::hook`, with the kernel's checksum helpers; the XDP context
/// in `crate::xdp`, with direct packet access and incremental checksum arithmetic).
pub trait PktAccess {
    fn load<T>(&self, off: usize) -> Result<T, ()>;
    fn store<T>(&self, off: usize, v: &T) -> Result<(), ()>;
    /// Replaces `from` by `to` (`size` 2 or 4 bytes) in the IPv4 header checksum at `off`.
    fn l3_csum_replace(&self, off: usize, from: u64, to: u64, size: u64) -> Result<(), ()>;
    /// Replaces `from` by `to` in the L4 checksum at `off` (`flags`: size, pseudo-header,
    /// UDP's mangled zero, as for `bpf_l4_csum_replace`).
    fn l4_csum_replace(&self, off: usize, from: u64, to: u64, flags: u64) -> Result<(), ()>;
    /// Whether the program reads and writes the packet's bytes itself and computes the
    /// checksums (XDP), rather than through the kernel's skb helpers (TC, which keep the
    /// skb's checksum state): then a NAT rewrite sums its changes and updates each
    /// checksum once.
    const DIRECT: bool = false;
}

/// One's-complement addition with end-around carry.
#[inline(always)]
pub fn csum_add(s: u32, v: u32) -> u32 {
    let (r, carry) = s.overflowing_add(v);
    r + u32::from(carry)
}

pub use super::state::Pkt;

/// One address family of the packet path, on top of the socket path's [`Family`].
pub trait PktFamily: Family {
    type Key: Copy;
    type Val: Copy;
    /// `AF_INET` / `AF_INET6`, for the FIB lookup.
    const FAMILY: u8;

    /// Word-wise, so no `bcmp` call is emitted.
    fn is_zero(a: &Self::Addr) -> bool;
    fn parse<C: PktAccess>(ctx: &C) -> Option<Pkt<Self::Addr>>;
    /// Replaces the source (`src`) or destination address, fixing the checksums.
    fn set_addr<C: PktAccess>(
        ctx: &C,
        p: &Pkt<Self::Addr>,
        src: bool,
        old: Self::Addr,
        new: Self::Addr,
    ) -> Result<(), ()>;
    fn snat_addr() -> Self::Addr;
    /// Offset of the source (`src`) or destination address in the frame.
    fn addr_off(src: bool) -> usize;
    /// `new` - `old` in one's-complement arithmetic (RFC 1624: ~old + new, word by word),
    /// in the packet's byte order, for a checksum updated by the program.
    fn addr_delta(old: Self::Addr, new: Self::Addr) -> u32;
    fn source_allowed(service_id: u32, a: Self::Addr) -> bool;
    /// DSR: whether a packet from `a` may carry the DSR option (`DSR_TRUSTED4/6`).
    fn dsr_trusted(a: Self::Addr) -> bool;
    /// What a destination that is no frontend falls in (`SVC_CIDR4/6`: `svc_cidr::*`).
    fn svc_cidr(a: Self::Addr) -> Option<u8>;
    fn ct_key(
        s: Self::Addr,
        d: Self::Addr,
        sport: u16,
        dport: u16,
        proto: u8,
        dir: u8,
    ) -> Self::Key;
    fn ct_get(k: &Self::Key) -> Option<*mut Self::Val>;
    fn ct_put(k: &Self::Key, v: &Self::Val) -> Result<(), ()>;
    fn ct_del(k: &Self::Key);
    fn ct_val(
        dnat: (Self::Addr, u16),
        snat: (Self::Addr, u16),
        sid: u32,
        bid: u32,
        flags: u32,
        now: u64,
    ) -> Self::Val;
    /// The backend id of a value.
    fn ct_backend_id(v: &Self::Val) -> u32;
    /// The service id (frontend) of a value.
    fn ct_service_id(v: &Self::Val) -> u32;
    /// `(dnat addr, dnat port), (snat addr, snat port)` of a value.
    fn ct_nat(v: &Self::Val) -> ((Self::Addr, u16), (Self::Addr, u16));
    fn ct_meta(v: *mut Self::Val) -> (*mut u32, *mut u64, *mut u64);
    fn fib_set(p: &mut FibParams, src: Self::Addr, dst: Self::Addr);
    /// XDP's cached FIB answer for a packet from `src` to `dst` arriving on `ifindex`.
    fn fib_hop(ifindex: u32, src: Self::Addr, dst: Self::Addr) -> Option<*const FibHop>;
    /// Caches a FIB answer (a failed insert only costs the next packet a FIB lookup).
    fn fib_hop_put(ifindex: u32, src: Self::Addr, dst: Self::Addr, hop: &FibHop);
    /// Per-CPU scratch space for the parsed packet and a new flow's choice: kept off the
    /// stack, whose 512 bytes the verifier counts over the whole call chain.
    fn scratch() -> Option<*mut Scratch<Self::Addr>>;
    /// IPv6 (an ICMPv6 error answers a refused datagram), else IPv4.
    const V6: bool;
    /// A source address as a session-affinity client.
    fn client(a: Self::Addr) -> ([u32; 4], u8);
    /// Logs that every SNAT port towards a backend is held by a live flow.
    fn warn_ports_full<C: EbpfContext>(ctx: &C, baddr: Self::Addr, bport: u16);
}

/// The backend's address, port and flags. A leaf of its own: keeps the key off the
/// caller's frame.
#[inline(never)]
pub fn backend<F: PktFamily>(id: u32) -> Option<(F::Addr, u16, u8)> {
    F::backend_entry(id)
}

impl PktFamily for V4 {
    type Key = Ct4Key;
    type Val = Ct4Value;
    const FAMILY: u8 = 2; // AF_INET

    #[inline(always)]
    fn is_zero(a: &u32) -> bool {
        *a == 0
    }

    #[inline(always)]
    fn parse<C: PktAccess>(ctx: &C) -> Option<Pkt<u32>> {
        let vihl: u8 = ctx.load(ETH_HLEN).ok()?;
        if vihl >> 4 != 4 {
            return None;
        }
        let ihl = usize::from(vihl & 0x0f) * 4;
        if ihl < 20 {
            return None;
        }
        let frags: u16 = u16::from_be(ctx.load(ETH_HLEN + 6).ok()?);
        if frags & 0x3fff != 0 {
            // A fragment: only the first has ports; not balanced (as in cilium without
            // its fragment map).
            return None;
        }
        let proto: u8 = ctx.load(ETH_HLEN + 9).ok()?;
        if proto != proto::TCP && proto != proto::UDP {
            return None;
        }
        let l4 = ETH_HLEN + ihl;
        Some(Pkt {
            l4,
            proto,
            saddr: ctx.load(ETH_HLEN + 12).ok()?,
            daddr: ctx.load(ETH_HLEN + 16).ok()?,
            sport: ctx.load(l4).ok()?,
            dport: ctx.load(l4 + 2).ok()?,
            tcp_flags: if proto == proto::TCP {
                ctx.load(l4 + 13).ok()?
            } else {
                0
            },
        })
    }

    #[inline(always)]
    fn set_addr<C: PktAccess>(
        ctx: &C,
        p: &Pkt<u32>,
        src: bool,
        old: u32,
        new: u32,
    ) -> Result<(), ()> {
        let off = ETH_HLEN + if src { 12 } else { 16 };
        ctx.l4_csum_replace(
            p.csum_off(),
            u64::from(old),
            u64::from(new),
            u64::from(BPF_F_PSEUDO_HDR) | 4 | p.l4_flags(),
        )?;
        ctx.l3_csum_replace(ETH_HLEN + 10, u64::from(old), u64::from(new), 4)?;
        ctx.store(off, &new)
    }

    #[inline(always)]
    fn addr_off(src: bool) -> usize {
        ETH_HLEN + if src { 12 } else { 16 }
    }

    #[inline(always)]
    fn addr_delta(old: u32, new: u32) -> u32 {
        csum_add(!old, new)
    }

    #[inline(always)]
    fn snat_addr() -> u32 {
        NODE_CONFIG.get(0).map_or(0, |c| c.snat4)
    }

    // A leaf of its own: keeps the key off the caller's frame.
    #[inline(never)]
    fn source_allowed(service_id: u32, a: u32) -> bool {
        let key = LpmKey::new(
            64,
            SrcRange4 {
                service_id,
                addr: a,
            },
        );
        SRC_RANGE4.get(&key).is_some()
    }

    #[inline(never)]
    fn dsr_trusted(a: u32) -> bool {
        DSR_TRUSTED4.get(&LpmKey::new(32, a)).is_some()
    }

    #[inline(never)]
    fn svc_cidr(a: u32) -> Option<u8> {
        SVC_CIDR4.get(&LpmKey::new(32, a)).copied()
    }

    #[inline(always)]
    fn ct_key(s: u32, d: u32, sport: u16, dport: u16, proto: u8, dir: u8) -> Ct4Key {
        Ct4Key::new(s, d, sport, dport, proto, dir)
    }

    #[inline(always)]
    fn ct_get(k: &Ct4Key) -> Option<*mut Ct4Value> {
        crate::maps::ct4_get(k)
    }

    #[inline(always)]
    fn ct_put(k: &Ct4Key, v: &Ct4Value) -> Result<(), ()> {
        crate::maps::ct4_put(k, v)
    }

    #[inline(always)]
    fn ct_del(k: &Ct4Key) {
        crate::maps::ct4_del(k);
    }

    #[inline(always)]
    fn ct_val(
        dnat: (u32, u16),
        snat: (u32, u16),
        sid: u32,
        bid: u32,
        flags: u32,
        now: u64,
    ) -> Ct4Value {
        Ct4Value {
            dnat_addr: dnat.0,
            snat_addr: snat.0,
            dnat_port: dnat.1,
            snat_port: snat.1,
            service_id: sid,
            backend_id: bid,
            flags,
            last_seen: now,
            packets: 0,
        }
    }

    #[inline(always)]
    fn ct_backend_id(v: &Ct4Value) -> u32 {
        v.backend_id
    }

    #[inline(always)]
    fn ct_service_id(v: &Ct4Value) -> u32 {
        v.service_id
    }

    fn ct_nat(v: &Ct4Value) -> ((u32, u16), (u32, u16)) {
        ((v.dnat_addr, v.dnat_port), (v.snat_addr, v.snat_port))
    }

    #[inline(always)]
    fn ct_meta(v: *mut Ct4Value) -> (*mut u32, *mut u64, *mut u64) {
        // SAFETY: field pointers of a map value.
        unsafe {
            (
                &raw mut (*v).flags,
                &raw mut (*v).last_seen,
                &raw mut (*v).packets,
            )
        }
    }

    #[inline(always)]
    fn scratch() -> Option<*mut Scratch<u32>> {
        SCRATCH4.get_ptr_mut(0)
    }

    const V6: bool = false;

    fn client(a: u32) -> ([u32; 4], u8) {
        ([a, 0, 0, 0], affinity_kind::V4)
    }

    #[inline(never)]
    fn warn_ports_full<C: EbpfContext>(ctx: &C, baddr: u32, bport: u16) {
        warn!(
            ctx,
            "SNAT: every source port towards {:i}:{} is held by a live flow; new flow dropped",
            Ipv4Addr::from(u32::from_be(baddr)),
            u16::from_be(bport)
        );
    }

    fn fib_set(p: &mut FibParams, src: u32, dst: u32) {
        p.__bindgen_anon_3.ipv4_src = src;
        p.__bindgen_anon_4.ipv4_dst = dst;
    }

    #[inline(always)]
    fn fib_hop(ifindex: u32, src: u32, dst: u32) -> Option<*const FibHop> {
        let k = FibHopKey4 { ifindex, src, dst };
        FIB_HOP4.get_ptr(&k)
    }

    #[inline(always)]
    fn fib_hop_put(ifindex: u32, src: u32, dst: u32, hop: &FibHop) {
        let k = FibHopKey4 { ifindex, src, dst };
        let _ = FIB_HOP4.insert(&k, hop, 0);
    }
}

impl PktFamily for V6 {
    type Key = Ct6Key;
    type Val = Ct6Value;
    const FAMILY: u8 = 10; // AF_INET6

    #[inline(always)]
    fn is_zero(a: &[u32; 4]) -> bool {
        (a[0] | a[1] | a[2] | a[3]) == 0
    }

    #[inline(always)]
    fn parse<C: PktAccess>(ctx: &C) -> Option<Pkt<[u32; 4]>> {
        // Extension headers are not walked: a packet whose next header is not TCP/UDP
        // is left to the stack.
        let next: u8 = ctx.load(ETH_HLEN + 6).ok()?;
        if next != proto::TCP && next != proto::UDP {
            return None;
        }
        let l4 = ETH_HLEN + 40;
        Some(Pkt {
            l4,
            proto: next,
            saddr: ctx.load(ETH_HLEN + 8).ok()?,
            daddr: ctx.load(ETH_HLEN + 24).ok()?,
            sport: ctx.load(l4).ok()?,
            dport: ctx.load(l4 + 2).ok()?,
            tcp_flags: if next == proto::TCP {
                ctx.load(l4 + 13).ok()?
            } else {
                0
            },
        })
    }

    #[inline(always)]
    fn set_addr<C: PktAccess>(
        ctx: &C,
        p: &Pkt<[u32; 4]>,
        src: bool,
        old: [u32; 4],
        new: [u32; 4],
    ) -> Result<(), ()> {
        let off = ETH_HLEN + if src { 8 } else { 24 };
        let mut from = old;
        let mut to = new;
        // SAFETY: two 16-byte buffers on the stack.
        let diff = unsafe { bpf_csum_diff(from.as_mut_ptr(), 16, to.as_mut_ptr(), 16, 0) };
        if diff < 0 {
            return Err(());
        }
        ctx.l4_csum_replace(
            p.csum_off(),
            0,
            diff as u64,
            u64::from(BPF_F_PSEUDO_HDR) | p.l4_flags(),
        )?;
        ctx.store(off, &new)
    }

    #[inline(always)]
    fn addr_off(src: bool) -> usize {
        ETH_HLEN + if src { 8 } else { 24 }
    }

    #[inline(always)]
    fn addr_delta(old: [u32; 4], new: [u32; 4]) -> u32 {
        let mut s = csum_add(!old[0], new[0]);
        s = csum_add(s, csum_add(!old[1], new[1]));
        s = csum_add(s, csum_add(!old[2], new[2]));
        csum_add(s, csum_add(!old[3], new[3]))
    }

    #[inline(always)]
    fn snat_addr() -> [u32; 4] {
        NODE_CONFIG.get(0).map_or([0; 4], |c| c.snat6)
    }

    // A leaf of its own: keeps the key off the caller's frame.
    #[inline(never)]
    fn source_allowed(service_id: u32, a: [u32; 4]) -> bool {
        let key = LpmKey::new(
            160,
            SrcRange6 {
                service_id,
                addr: a,
            },
        );
        SRC_RANGE6.get(&key).is_some()
    }

    #[inline(never)]
    fn dsr_trusted(a: [u32; 4]) -> bool {
        DSR_TRUSTED6.get(&LpmKey::new(128, a)).is_some()
    }

    #[inline(never)]
    fn svc_cidr(a: [u32; 4]) -> Option<u8> {
        SVC_CIDR6.get(&LpmKey::new(128, a)).copied()
    }

    #[inline(always)]
    fn ct_key(s: [u32; 4], d: [u32; 4], sport: u16, dport: u16, proto: u8, dir: u8) -> Ct6Key {
        Ct6Key::new(s, d, sport, dport, proto, dir)
    }

    #[inline(always)]
    fn ct_get(k: &Ct6Key) -> Option<*mut Ct6Value> {
        crate::maps::ct6_get(k)
    }

    #[inline(always)]
    fn ct_put(k: &Ct6Key, v: &Ct6Value) -> Result<(), ()> {
        crate::maps::ct6_put(k, v)
    }

    #[inline(always)]
    fn ct_del(k: &Ct6Key) {
        crate::maps::ct6_del(k);
    }

    #[inline(always)]
    fn ct_val(
        dnat: ([u32; 4], u16),
        snat: ([u32; 4], u16),
        sid: u32,
        bid: u32,
        flags: u32,
        now: u64,
    ) -> Ct6Value {
        Ct6Value {
            dnat_addr: dnat.0,
            snat_addr: snat.0,
            dnat_port: dnat.1,
            snat_port: snat.1,
            service_id: sid,
            backend_id: bid,
            flags,
            last_seen: now,
            packets: 0,
        }
    }

    #[inline(always)]
    fn ct_backend_id(v: &Ct6Value) -> u32 {
        v.backend_id
    }

    #[inline(always)]
    fn ct_service_id(v: &Ct6Value) -> u32 {
        v.service_id
    }

    fn ct_nat(v: &Ct6Value) -> (([u32; 4], u16), ([u32; 4], u16)) {
        ((v.dnat_addr, v.dnat_port), (v.snat_addr, v.snat_port))
    }

    #[inline(always)]
    fn ct_meta(v: *mut Ct6Value) -> (*mut u32, *mut u64, *mut u64) {
        // SAFETY: field pointers of a map value.
        unsafe {
            (
                &raw mut (*v).flags,
                &raw mut (*v).last_seen,
                &raw mut (*v).packets,
            )
        }
    }

    #[inline(always)]
    fn scratch() -> Option<*mut Scratch<[u32; 4]>> {
        SCRATCH6.get_ptr_mut(0)
    }

    const V6: bool = true;

    fn client(a: [u32; 4]) -> ([u32; 4], u8) {
        (a, affinity_kind::V6)
    }

    #[inline(never)]
    fn warn_ports_full<C: EbpfContext>(ctx: &C, baddr: [u32; 4], bport: u16) {
        // SAFETY: 16 bytes either way; the words hold the address in network order.
        let bytes: [u8; 16] = unsafe { core::mem::transmute(baddr) };
        warn!(
            ctx,
            "SNAT: every source port towards [{:i}]:{} is held by a live flow; new flow dropped",
            Ipv6Addr::from(bytes),
            u16::from_be(bport)
        );
    }

    fn fib_set(p: &mut FibParams, src: [u32; 4], dst: [u32; 4]) {
        p.__bindgen_anon_3.ipv6_src = src;
        p.__bindgen_anon_4.ipv6_dst = dst;
    }

    #[inline(always)]
    fn fib_hop(ifindex: u32, src: [u32; 4], dst: [u32; 4]) -> Option<*const FibHop> {
        let k = FibHopKey6 { ifindex, src, dst };
        FIB_HOP6.get_ptr(&k)
    }

    #[inline(always)]
    fn fib_hop_put(ifindex: u32, src: [u32; 4], dst: [u32; 4], hop: &FibHop) {
        let k = FibHopKey6 { ifindex, src, dst };
        let _ = FIB_HOP6.insert(&k, hop, 0);
    }
}
