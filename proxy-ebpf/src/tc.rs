//! The per-packet datapath at TC on node interfaces, for traffic no socket hook saw:
//! NodePort, externalIPs and LoadBalancer addresses reached from outside the node, and
//! ClusterIP traffic routed through it.
//!
//! Ingress, per packet (IPv4 and IPv6, TCP and UDP):
//! 1. a reply of a known flow (`CT` entry in the reply direction) is reverse-translated:
//!    source := the frontend, destination := the client when the flow was SNATed;
//! 2. a packet of a known flow (original direction) follows its entry: the same backend
//!    for the life of the flow, whatever happens to the backend set;
//! 3. otherwise a packet to a frontend (or to a node address on a NodePort) starts a
//!    flow: source ranges checked, the local-only twin used under
//!    `externalTrafficPolicy: Local`, a backend chosen with equal weight, DNAT, SNAT to the
//!    node's address when the backend is on another node, both conntrack entries written;
//!    a frontend without endpoints answers a TCP SYN with RST and a UDP datagram with
//!    ICMP port unreachable (`unreach`), as kube-proxy's REJECT does.
//!
//! Packets whose source became one of the node's own addresses (SNATed flows, and replies
//! restored to a node-address frontend) are forwarded with a FIB lookup and redirect,
//! because the stack would drop them as martians. Egress only reverse-translates replies
//! of flows to local backends on their way back to the client.
//!
//! Checksums are updated incrementally: the IPv4 header with `l3_csum_replace`, L4 with
//! `l4_csum_replace` (`BPF_F_PSEUDO_HDR` for addresses, `BPF_F_MARK_MANGLED_0` for UDP).

use core::{
    ffi::c_void,
    net::{Ipv4Addr, Ipv6Addr},
};

use aya_ebpf::{
    bindings::{
        bpf_fib_lookup as FibParams, BPF_FIB_LKUP_RET_NO_NEIGH, BPF_FIB_LKUP_RET_SUCCESS,
        BPF_F_MARK_MANGLED_0, BPF_F_PSEUDO_HDR, TC_ACT_OK, TC_ACT_SHOT,
    },
    helpers::{
        bpf_get_prandom_u32, bpf_ktime_get_ns,
        generated::{
            bpf_csum_diff, bpf_fib_lookup, bpf_loop, bpf_redirect, bpf_redirect_neigh,
        },
    },
    macros::{classifier, map},
    maps::lpm_trie::Key as LpmKey,
    maps::PerCpuArray,
    programs::TcContext,
    EbpfContext,
};
use aya_log_ebpf::warn;
use proxy_common::{
    affinity_kind, backend_flags, ct_flags, ct_timeouts, proto, scope, svc_flags, Ct4Key, Ct4Value,
    Ct6Key, Ct6Value, Reason, SrcRange4, SrcRange6, Svc4Key, Svc6Key, SvcValue,
};

use crate::affinity;
use crate::maps::{
    count, count_backend, BACKEND4, BACKEND6, CT4, CT6, NODE_ADDRS4, NODE_ADDRS6, NODE_CONFIG,
    SRC_RANGE4, SRC_RANGE6, SVC4, SVC6,
};

const ETH_HLEN: usize = 14;
const ETH_P_IP: u16 = 0x0800;
const ETH_P_IPV6: u16 = 0x86dd;
const TCP_FIN: u8 = 0x01;
const TCP_SYN: u8 = 0x02;
const TCP_RST: u8 = 0x04;
const TCP_ACK: u8 = 0x10;
/// First and number of SNAT ports (the kernel's default ephemeral range).
const SNAT_PORT_MIN: u32 = 32768;
const SNAT_PORT_SPAN: u32 = 28232;
const SNAT_TRIES: u32 = 4;

#[classifier]
pub fn tc_ingress(ctx: TcContext) -> i32 {
    match try_tc(&ctx, true) {
        Ok(verdict) => verdict,
        Err(()) => TC_ACT_OK as i32,
    }
}

#[classifier]
pub fn tc_egress(ctx: TcContext) -> i32 {
    match try_tc(&ctx, false) {
        Ok(verdict) => verdict,
        Err(()) => TC_ACT_OK as i32,
    }
}

/// A parsed packet: where its fields are and what they hold (network byte order).
pub struct Pkt<A> {
    l4: usize,
    proto: u8,
    saddr: A,
    daddr: A,
    sport: u16,
    dport: u16,
    tcp_flags: u8,
}

impl<A> Pkt<A> {
    fn csum_off(&self) -> usize {
        self.l4 + if self.proto == proto::TCP { 16 } else { 6 }
    }

    fn l4_flags(&self) -> u64 {
        if self.proto == proto::UDP {
            u64::from(BPF_F_MARK_MANGLED_0)
        } else {
            0
        }
    }
}

/// One address family's packet layout and maps.
trait Fam {
    type Addr: Copy + PartialEq;
    type Key: Copy;
    type Val: Copy;
    const FAMILY: u8;

    fn zero() -> Self::Addr;
    /// Word-wise, so no `bcmp` call is emitted.
    fn is_zero(a: &Self::Addr) -> bool;
    fn parse(ctx: &TcContext) -> Option<Pkt<Self::Addr>>;
    fn set_addr(
        ctx: &TcContext,
        p: &Pkt<Self::Addr>,
        src: bool,
        old: Self::Addr,
        new: Self::Addr,
    ) -> Result<(), ()>;
    fn svc(addr: Self::Addr, port: u16, proto: u8, scope: u8, slot: u16) -> Option<SvcValue>;
    fn backend(id: u32) -> Option<(Self::Addr, u16, u8)>;
    fn is_node_addr(a: Self::Addr) -> bool;
    fn snat_addr() -> Self::Addr;
    fn source_allowed(service_id: u32, a: Self::Addr) -> bool;
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
    /// `(dnat addr, dnat port, snat addr, snat port)` of a value.
    fn ct_nat(v: &Self::Val) -> ((Self::Addr, u16), (Self::Addr, u16));
    fn ct_meta(v: *mut Self::Val) -> (*mut u32, *mut u64, *mut u64);
    fn fib_set(p: &mut FibParams, src: Self::Addr, dst: Self::Addr);
    /// Per-CPU scratch space for the parsed packet and a new flow's choice: kept off the
    /// stack, whose 512 bytes the verifier counts over the whole call chain.
    fn scratch() -> Option<*mut Scratch<Self::Addr>>;
    /// Answers the UDP datagram at `ctx` with an ICMP port unreachable.
    fn reject_udp(ctx: &TcContext) -> i32;
    /// A source address as a session-affinity client.
    fn client(a: Self::Addr) -> ([u32; 4], u8);
    /// Logs that every SNAT port towards a backend is held by a live flow.
    fn warn_ports_full(ctx: &TcContext, baddr: Self::Addr, bport: u16);
}

/// Per-CPU scratch (one entry per family).
pub struct Scratch<A> {
    pkt: Pkt<A>,
    chosen: Chosen<A>,
}

#[map]
static SCRATCH4: PerCpuArray<Scratch<u32>> = PerCpuArray::with_max_entries(1, 0);

#[map]
static SCRATCH6: PerCpuArray<Scratch<[u32; 4]>> = PerCpuArray::with_max_entries(1, 0);

struct V4;
struct V6;

impl Fam for V4 {
    type Addr = u32;
    type Key = Ct4Key;
    type Val = Ct4Value;
    const FAMILY: u8 = 2; // AF_INET

    fn zero() -> u32 {
        0
    }

    #[inline(always)]
    fn is_zero(a: &u32) -> bool {
        *a == 0
    }

    #[inline(always)]
    fn parse(ctx: &TcContext) -> Option<Pkt<u32>> {
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
    fn set_addr(ctx: &TcContext, p: &Pkt<u32>, src: bool, old: u32, new: u32) -> Result<(), ()> {
        let off = ETH_HLEN + if src { 12 } else { 16 };
        ctx.l4_csum_replace(
            p.csum_off(),
            u64::from(old),
            u64::from(new),
            u64::from(BPF_F_PSEUDO_HDR) | 4 | p.l4_flags(),
        )
        .map_err(|_| ())?;
        ctx.l3_csum_replace(ETH_HLEN + 10, u64::from(old), u64::from(new), 4)
            .map_err(|_| ())?;
        ctx.store(off, &new, 0).map_err(|_| ())
    }

    #[inline(always)]
    fn svc(addr: u32, port: u16, proto: u8, scope: u8, slot: u16) -> Option<SvcValue> {
        // SAFETY: copied out at once.
        unsafe {
            SVC4.get(&Svc4Key::new(addr, port, proto, scope, slot))
                .copied()
        }
    }

    // A leaf of its own: keeps the key off the caller's frame.
    #[inline(never)]
    fn backend(id: u32) -> Option<(u32, u16, u8)> {
        // SAFETY: copied out at once.
        unsafe { BACKEND4.get(&id).map(|b| (b.addr, b.port, b.flags)) }
    }

    // A leaf of its own: keeps the key off the caller's frame.
    #[inline(never)]
    fn is_node_addr(a: u32) -> bool {
        // SAFETY: presence check only.
        unsafe { NODE_ADDRS4.get(&a).is_some() }
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

    #[inline(always)]
    fn ct_key(s: u32, d: u32, sport: u16, dport: u16, proto: u8, dir: u8) -> Ct4Key {
        Ct4Key::new(s, d, sport, dport, proto, dir)
    }

    #[inline(always)]
    fn ct_get(k: &Ct4Key) -> Option<*mut Ct4Value> {
        CT4.get_ptr_mut(k)
    }

    #[inline(always)]
    fn ct_put(k: &Ct4Key, v: &Ct4Value) -> Result<(), ()> {
        CT4.insert(k, v, 0).map_err(|_| ())
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

    #[inline(always)]
    fn reject_udp(ctx: &TcContext) -> i32 {
        crate::unreach::udp4(ctx)
    }

    fn client(a: u32) -> ([u32; 4], u8) {
        ([a, 0, 0, 0], affinity_kind::V4)
    }

    #[inline(never)]
    fn warn_ports_full(ctx: &TcContext, baddr: u32, bport: u16) {
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
}

impl Fam for V6 {
    type Addr = [u32; 4];
    type Key = Ct6Key;
    type Val = Ct6Value;
    const FAMILY: u8 = 10; // AF_INET6

    fn zero() -> [u32; 4] {
        [0; 4]
    }

    #[inline(always)]
    fn is_zero(a: &[u32; 4]) -> bool {
        (a[0] | a[1] | a[2] | a[3]) == 0
    }

    #[inline(always)]
    fn parse(ctx: &TcContext) -> Option<Pkt<[u32; 4]>> {
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
    fn set_addr(
        ctx: &TcContext,
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
        )
        .map_err(|_| ())?;
        ctx.store(off, &new, 0).map_err(|_| ())
    }

    #[inline(always)]
    fn svc(addr: [u32; 4], port: u16, proto: u8, scope: u8, slot: u16) -> Option<SvcValue> {
        // SAFETY: copied out at once.
        unsafe {
            SVC6.get(&Svc6Key::new(addr, port, proto, scope, slot))
                .copied()
        }
    }

    // A leaf of its own: keeps the key off the caller's frame.
    #[inline(never)]
    fn backend(id: u32) -> Option<([u32; 4], u16, u8)> {
        // SAFETY: copied out at once.
        unsafe { BACKEND6.get(&id).map(|b| (b.addr, b.port, b.flags)) }
    }

    // A leaf of its own: keeps the key off the caller's frame.
    #[inline(never)]
    fn is_node_addr(a: [u32; 4]) -> bool {
        // SAFETY: presence check only.
        unsafe { NODE_ADDRS6.get(&a).is_some() }
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

    #[inline(always)]
    fn ct_key(s: [u32; 4], d: [u32; 4], sport: u16, dport: u16, proto: u8, dir: u8) -> Ct6Key {
        Ct6Key::new(s, d, sport, dport, proto, dir)
    }

    #[inline(always)]
    fn ct_get(k: &Ct6Key) -> Option<*mut Ct6Value> {
        CT6.get_ptr_mut(k)
    }

    #[inline(always)]
    fn ct_put(k: &Ct6Key, v: &Ct6Value) -> Result<(), ()> {
        CT6.insert(k, v, 0).map_err(|_| ())
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

    #[inline(always)]
    fn reject_udp(ctx: &TcContext) -> i32 {
        crate::unreach::udp6(ctx)
    }

    fn client(a: [u32; 4]) -> ([u32; 4], u8) {
        (a, affinity_kind::V6)
    }

    #[inline(never)]
    fn warn_ports_full(ctx: &TcContext, baddr: [u32; 4], bport: u16) {
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
}

#[inline(always)]
fn try_tc(ctx: &TcContext, ingress: bool) -> Result<i32, ()> {
    let eth_proto = u16::from_be(ctx.load::<u16>(12).map_err(|_| ())?);
    match eth_proto {
        ETH_P_IP => match ingress.then(|| crate::icmp::icmp4(ctx)).flatten() {
            Some(v) => Ok(v),
            None => flow::<V4>(ctx, ingress),
        },
        ETH_P_IPV6 => match ingress.then(|| crate::icmp::icmp6(ctx)).flatten() {
            Some(v) => Ok(v),
            None => flow::<V6>(ctx, ingress),
        },
        _ => Ok(TC_ACT_OK as i32),
    }
}

/// How long an entry lives after its last packet.
#[inline(always)]
fn timeout(proto: u8, flags: u32) -> u64 {
    if proto != proto::TCP {
        ct_timeouts::UDP
    } else if flags & ct_flags::CLOSING != 0 {
        ct_timeouts::TCP_CLOSING
    } else if flags & ct_flags::SEEN_REPLY != 0 {
        ct_timeouts::TCP_ESTABLISHED
    } else {
        ct_timeouts::TCP_SYN
    }
}

/// Whether an entry last seen at `last_seen` has expired at `now`.
#[inline(always)]
fn expired(proto: u8, flags: u32, last_seen: u64, now: u64) -> bool {
    now.saturating_sub(last_seen) > timeout(proto, flags)
}

/// The flow's backend id still names the backend it was translated to.
#[inline(always)]
fn backend_is<F: Fam>(v: *mut F::Val, dnat: (F::Addr, u16)) -> bool {
    // SAFETY: a live map value.
    let id = F::ct_backend_id(unsafe { &*v });
    matches!(F::backend(id), Some((a, port, _)) if a == dnat.0 && port == dnat.1)
}

/// Marks a packet on an entry: refreshes it, counts it, notes FIN/RST. Returns false if
/// the entry had expired (and should be replaced).
#[inline(always)]
fn touch<F: Fam>(v: *mut F::Val, proto: u8, tcp_flags: u8, reply: bool, now: u64) -> bool {
    let (flags, last_seen, packets) = F::ct_meta(v);
    // SAFETY: pointers into a live map value.
    unsafe {
        let mut f = *flags;
        if expired(proto, f, *last_seen, now) {
            return false;
        }
        if tcp_flags & (TCP_FIN | TCP_RST) != 0 {
            f |= ct_flags::CLOSING;
        }
        if reply {
            f |= ct_flags::SEEN_REPLY;
        }
        *flags = f;
        *last_seen = now;
        *packets += 1;
    }
    true
}

// Not inlined: each path would otherwise carry two copies of its address buffers.
#[inline(never)]
fn rewrite<F: Fam>(
    ctx: &TcContext,
    p: &Pkt<F::Addr>,
    nat: &((F::Addr, u16), (F::Addr, u16)),
) -> Result<(), ()> {
    let (dnat, snat) = *nat;
    if !F::is_zero(&dnat.0) {
        F::set_addr(ctx, p, false, p.daddr, dnat.0)?;
        if dnat.1 != p.dport {
            ctx.l4_csum_replace(
                p.csum_off(),
                u64::from(p.dport),
                u64::from(dnat.1),
                2 | p.l4_flags(),
            )
            .map_err(|_| ())?;
            ctx.store(p.l4 + 2, &dnat.1, 0).map_err(|_| ())?;
        }
    }
    if !F::is_zero(&snat.0) {
        F::set_addr(ctx, p, true, p.saddr, snat.0)?;
        if snat.1 != p.sport {
            ctx.l4_csum_replace(
                p.csum_off(),
                u64::from(p.sport),
                u64::from(snat.1),
                2 | p.l4_flags(),
            )
            .map_err(|_| ())?;
            ctx.store(p.l4, &snat.1, 0).map_err(|_| ())?;
        }
    }
    Ok(())
}

/// Forwards a packet by FIB lookup and redirect (needed when its source is now one of
/// the node's addresses: the stack would drop it as a martian). Falls back to the stack.
// Separate BPF functions keep each frame under the verifier's 512-byte stack limit
// ("Looks like the BPF stack limit is exceeded" when everything is inlined).
#[inline(never)]
fn fib_redirect<F: Fam>(ctx: &TcContext, src: F::Addr, dst: F::Addr, proto: u8) -> i32 {
    // SAFETY: a zeroed plain-data struct.
    let mut params: FibParams = unsafe { core::mem::zeroed() };
    params.family = F::FAMILY;
    params.l4_protocol = proto;
    // SAFETY: the context's skb.
    params.ifindex = unsafe { (*ctx.skb.skb).ingress_ifindex };
    F::fib_set(&mut params, src, dst);
    // SAFETY: valid ctx and params.
    let ret = unsafe {
        bpf_fib_lookup(
            ctx.as_ptr(),
            &mut params,
            core::mem::size_of::<FibParams>() as i32,
            0,
        )
    };
    if ret == i64::from(BPF_FIB_LKUP_RET_SUCCESS) {
        let macs: [u8; 12] = {
            let mut m = [0u8; 12];
            m[..6].copy_from_slice(&params.dmac);
            m[6..].copy_from_slice(&params.smac);
            m
        };
        if ctx.store(0, &macs, 0).is_err() {
            return TC_ACT_OK as i32;
        }
        // SAFETY: plain helper.
        return unsafe { bpf_redirect(params.ifindex, 0) } as i32;
    }
    if ret == i64::from(BPF_FIB_LKUP_RET_NO_NEIGH) {
        // SAFETY: the kernel resolves the neighbour itself.
        return unsafe { bpf_redirect_neigh(params.ifindex, core::ptr::null_mut(), 0, 0) } as i32;
    }
    count(Reason::TcFibMiss);
    TC_ACT_OK as i32
}

/// What to do with a packet after translation. Returned up to [`flow`], so the FIB
/// redirect's frame is not stacked on top of the path that chose it (the verifier limits
/// the stack of a whole call chain to 512 bytes: "combined stack size ... Too large").
enum Action<A> {
    Verdict(i32),
    /// Forward by FIB lookup from `src` to `dst`.
    Redirect(A, A),
}

#[inline(never)]
fn flow<F: Fam>(ctx: &TcContext, ingress: bool) -> Result<i32, ()> {
    let scratch = F::scratch().ok_or(())?;
    // SAFETY: this CPU's scratch entry; a TC program is not preempted on its CPU.
    let p = unsafe { &mut (*scratch).pkt };
    if !parse_into::<F>(ctx, p) {
        return Ok(TC_ACT_OK as i32);
    }
    let p = &*p;
    // SAFETY: no preconditions.
    let now = unsafe { bpf_ktime_get_ns() };
    let action = match reply_path::<F>(ctx, p, ingress, now)? {
        Some(a) => a,
        None if !ingress => Action::Verdict(TC_ACT_OK as i32),
        None => match known_path::<F>(ctx, p, now)? {
            Some(a) => a,
            None => {
                // SAFETY: this CPU's scratch entry, a field apart from the packet.
                let chosen = unsafe { &mut (*scratch).chosen };
                match pick::<F>(ctx, p, chosen)? {
                    Some(a) => a,
                    None => commit_flow::<F>(ctx, p, chosen, now)?,
                }
            }
        },
    };
    Ok(match action {
        Action::Verdict(v) => v,
        Action::Redirect(src, dst) => fib_redirect::<F>(ctx, src, dst, p.proto),
    })
}

/// Parses in its own frame (every `load` keeps its own stack slot).
#[inline(never)]
fn parse_into<F: Fam>(ctx: &TcContext, out: &mut Pkt<F::Addr>) -> bool {
    match F::parse(ctx) {
        Some(p) => {
            *out = p;
            true
        }
        None => false,
    }
}

/// 1. A reply of a known flow: source := the frontend, destination := the client if the
/// flow was SNATed.
#[inline(never)]
fn reply_path<F: Fam>(
    ctx: &TcContext,
    p: &Pkt<F::Addr>,
    ingress: bool,
    now: u64,
) -> Result<Option<Action<F::Addr>>, ()> {
    let rkey = F::ct_key(p.saddr, p.daddr, p.sport, p.dport, p.proto, 1);
    let Some(v) = F::ct_get(&rkey) else {
        return Ok(None);
    };
    // SAFETY: copied out.
    let (dnat, snat) = F::ct_nat(unsafe { &*v });
    if !touch::<F>(v, p.proto, p.tcp_flags, true, now) {
        return Ok(None);
    }
    // Keep the original direction's entry alive and mark the reply seen.
    let client = if F::is_zero(&dnat.0) {
        (p.daddr, p.dport)
    } else {
        dnat
    };
    refresh_orig::<F>(p, &client, &snat, now);
    rewrite::<F>(ctx, p, &(dnat, snat))?;
    count(Reason::TcReply);
    // At ingress the new source may be one of the node's addresses: forward it directly.
    if ingress && (!F::is_zero(&dnat.0) || F::is_node_addr(snat.0)) {
        return Ok(Some(Action::Redirect(snat.0, client.0)));
    }
    Ok(Some(Action::Verdict(TC_ACT_OK as i32)))
}

/// 2. A packet of a known flow follows its entry (same backend for the flow's life).
#[inline(never)]
fn known_path<F: Fam>(
    ctx: &TcContext,
    p: &Pkt<F::Addr>,
    now: u64,
) -> Result<Option<Action<F::Addr>>, ()> {
    let okey = F::ct_key(p.saddr, p.daddr, p.sport, p.dport, p.proto, 0);
    let Some(v) = F::ct_get(&okey) else {
        return Ok(None);
    };
    // SAFETY: copied out.
    let (dnat, snat) = F::ct_nat(unsafe { &*v });
    // A UDP flow whose backend is gone starts over (kube-proxy deletes the UDP conntrack
    // entries of removed endpoints). TCP keeps its backend: a removed endpoint may still
    // be draining its connections.
    if p.proto == proto::UDP && !backend_is::<F>(v, dnat) {
        count(Reason::TcStaleBackend);
        return Ok(None);
    }
    if !touch::<F>(v, p.proto, p.tcp_flags, false, now) {
        return Ok(None);
    }
    rewrite::<F>(ctx, p, &(dnat, snat))?;
    count(Reason::TcFlow);
    if F::is_zero(&snat.0) {
        return Ok(Some(Action::Verdict(TC_ACT_OK as i32)));
    }
    Ok(Some(Action::Redirect(snat.0, dnat.0)))
}

/// What a new flow was given: backend, SNAT, ids.
pub struct Chosen<A> {
    backend: (A, u16),
    snat: (A, u16),
    service_id: u32,
    backend_id: u32,
    flags: u32,
}

/// 3. A new flow to a frontend (or to a node address on a NodePort)? `Ok(None)`: a
/// backend was chosen into `out`; `Ok(Some(action))`: not ours, or refused.
#[inline(never)]
fn pick<F: Fam>(
    ctx: &TcContext,
    p: &Pkt<F::Addr>,
    out: &mut Chosen<F::Addr>,
) -> Result<Option<Action<F::Addr>>, ()> {
    let mut front = F::svc(p.daddr, p.dport, p.proto, scope::ALL, 0);
    let mut fe_addr = p.daddr;
    if front.is_none() && F::is_node_addr(p.daddr) {
        front = F::svc(F::zero(), p.dport, p.proto, scope::ALL, 0);
        fe_addr = F::zero();
    }
    let Some(mut front) = front else {
        return Ok(Some(Action::Verdict(TC_ACT_OK as i32)));
    };
    if front.flags & svc_flags::SOURCE_RANGES != 0 && !F::source_allowed(front.service_id, p.saddr)
    {
        count(Reason::TcSourceDenied);
        return Ok(Some(Action::Verdict(TC_ACT_SHOT as i32)));
    }
    let mut slot_scope = scope::ALL;
    // The local-only twin. While a policy change is being written the flag and the twin
    // can disagree for a moment; without a twin the frontend's own entry serves.
    if front.flags & svc_flags::ETP_LOCAL != 0 {
        if let Some(local) = F::svc(fe_addr, p.dport, p.proto, scope::EXTERNAL_LOCAL, 0) {
            if local.count == 0 {
                count(Reason::TcNoLocalBackend);
                return Ok(Some(Action::Verdict(TC_ACT_SHOT as i32)));
            }
            front = local;
            slot_scope = scope::EXTERNAL_LOCAL;
        }
    }
    if front.count == 0 {
        count(Reason::TcNoBackend);
        if p.proto == proto::TCP && p.tcp_flags & TCP_SYN != 0 && p.tcp_flags & TCP_ACK == 0 {
            return Ok(Some(Action::Verdict(reject_tcp::<F>(ctx, p))));
        }
        if p.proto == proto::UDP {
            if !crate::unreach::allowed() {
                return Ok(Some(Action::Verdict(TC_ACT_SHOT as i32)));
            }
            return Ok(Some(Action::Verdict(F::reject_udp(ctx))));
        }
        return Ok(Some(Action::Verdict(TC_ACT_SHOT as i32)));
    }
    let Some(backend_id) = choose::<F>(p, &front, fe_addr, slot_scope) else {
        count(Reason::BackendMissing);
        return Ok(Some(Action::Verdict(TC_ACT_OK as i32)));
    };
    let Some((baddr, bport, bflags)) = F::backend(backend_id) else {
        count(Reason::BackendMissing);
        return Ok(Some(Action::Verdict(TC_ACT_OK as i32)));
    };

    // SNAT when the backend is on another node, unless the client address must be kept.
    let mut snat = (F::zero(), 0u16);
    let mut flags = 0;
    if bflags & backend_flags::LOCAL == 0 && slot_scope == scope::ALL {
        let addr = F::snat_addr();
        if F::is_zero(&addr) {
            count(Reason::TcSnatFailed);
            return Ok(Some(Action::Verdict(TC_ACT_SHOT as i32)));
        }
        let Some(port) = snat_port::<F>(baddr, bport, addr, p.proto) else {
            count(Reason::TcSnatFailed);
            if crate::maps::warn_allowed() {
                F::warn_ports_full(ctx, baddr, bport);
            }
            return Ok(Some(Action::Verdict(TC_ACT_SHOT as i32)));
        };
        snat = (addr, port);
        flags = ct_flags::SNAT;
    }

    *out = Chosen {
        backend: (baddr, bport),
        snat,
        service_id: front.service_id,
        backend_id,
        flags,
    };
    Ok(None)
}

/// The backend for a new flow: the client's previous one under session affinity (the
/// client is its source address), else one at random with equal weight.
#[inline(never)]
fn choose<F: Fam>(p: &Pkt<F::Addr>, front: &SvcValue, fe_addr: F::Addr, sc: u8) -> Option<u32> {
    let slot_backend = |s: u16| F::svc(fe_addr, p.dport, p.proto, sc, s).map(|e| e.backend_id);
    let client = || {
        let (addr, kind) = F::client(p.saddr);
        affinity::key(front, addr, kind)
    };
    affinity::choose(front, client, slot_backend)
}

/// A free SNAT source port towards `backend:bport` from `addr`, if any port of the range
/// is free: a few random probes (the common case, a sparse range), then a scan of the
/// whole range from a random start with `bpf_loop` (one verifier-checked callback, so the
/// scan costs no verifier budget per port). A port is free when no reply-direction entry
/// holds it, or when the flow that holds it has expired (`port_free`): expired flows are
/// reclaimed, not left to the LRU. `None` only when every port is held by a live flow.
/// (Netfilter's `nf_nat_l4proto_unique_tuple` gives up after 128+64+32+16 probes and
/// cilium's `snat_v4_new_mapping` after 32: both can refuse with ports free.)
#[inline(never)]
fn snat_port<F: Fam>(baddr: F::Addr, bport: u16, addr: F::Addr, proto: u8) -> Option<u16> {
    let mut scan = PortScan {
        baddr,
        addr,
        // SAFETY: no preconditions.
        now: unsafe { bpf_ktime_get_ns() },
        // SAFETY: no preconditions.
        start: unsafe { bpf_get_prandom_u32() } % SNAT_PORT_SPAN,
        found: 0,
        bport,
        proto,
    };
    let mut i = 0;
    while i < SNAT_TRIES {
        // SAFETY: no preconditions.
        let r = unsafe { bpf_get_prandom_u32() };
        let port = ((SNAT_PORT_MIN + r % SNAT_PORT_SPAN) as u16).to_be();
        if port_free::<F>(&scan, port) {
            return Some(port);
        }
        i += 1;
    }
    // SAFETY: the callback is a BPF subprogram taking this stack context.
    let ret = unsafe {
        bpf_loop(
            SNAT_PORT_SPAN,
            scan_port::<F> as *const () as *mut c_void,
            &raw mut scan as *mut c_void,
            0,
        )
    };
    if ret < 0 || scan.found == 0 {
        return None;
    }
    Some(scan.found as u16)
}

/// A search for a SNAT port towards `baddr:bport` from `addr`: on the stack, where
/// `bpf_loop` wants its context.
#[repr(C)]
struct PortScan<A> {
    baddr: A,
    addr: A,
    now: u64,
    /// Offset of the first port scanned.
    start: u32,
    /// `0x1_0000 | port` (network order) once a free port is found.
    found: u32,
    bport: u16,
    proto: u8,
}

/// One step of the scan: port `SNAT_PORT_MIN + (start + i) % SNAT_PORT_SPAN`. Returns 1
/// (stop) at the first free port.
#[inline(never)]
extern "C" fn scan_port<F: Fam>(i: u64, ctx: *mut c_void) -> i64 {
    // SAFETY: `ctx` is the caller's `PortScan<F::Addr>`.
    let s = unsafe { &mut *(ctx as *mut PortScan<F::Addr>) };
    let off = (s.start + i as u32) % SNAT_PORT_SPAN;
    let port = ((SNAT_PORT_MIN + off) as u16).to_be();
    if port_free::<F>(s, port) {
        s.found = 0x1_0000 | u32::from(port);
        return 1;
    }
    0
}

/// Whether SNAT port `port` (network order) of search `s` is free: no reply-direction
/// entry holds it, or that entry has expired and so has its flow's original-direction
/// entry (a UDP flow whose backend never answers refreshes only the latter), or that
/// entry no longer uses this port.
#[inline(never)]
fn port_free<F: Fam>(s: &PortScan<F::Addr>, port: u16) -> bool {
    let Some(v) = F::ct_get(&F::ct_key(s.baddr, s.addr, s.bport, port, s.proto, 1)) else {
        return true;
    };
    let (flags, last_seen, _) = F::ct_meta(v);
    // SAFETY: fields of a live map value.
    if !expired(s.proto, unsafe { *flags }, unsafe { *last_seen }, s.now) {
        return false;
    }
    // The reply entry of a SNATed flow: `dnat` is the client, `snat` the frontend.
    // SAFETY: copied out of a live map value.
    let (client, front) = F::ct_nat(unsafe { &*v });
    if F::is_zero(&client.0) {
        return true;
    }
    let okey = F::ct_key(client.0, front.0, client.1, front.1, s.proto, 0);
    let Some(o) = F::ct_get(&okey) else {
        return true;
    };
    let (oflags, olast, _) = F::ct_meta(o);
    // SAFETY: copied out of a live map value.
    let (_, osnat) = F::ct_nat(unsafe { &*o });
    // SAFETY: fields of a live map value.
    expired(s.proto, unsafe { *oflags }, unsafe { *olast }, s.now)
        || osnat.0 != s.addr
        || osnat.1 != port
}

/// Writes both conntrack entries of a new flow and translates its first packet:
/// original direction (client -> frontend) and reply direction (backend -> client or
/// the SNAT address), which restores the frontend the client used.
#[inline(never)]
fn commit_flow<F: Fam>(
    ctx: &TcContext,
    p: &Pkt<F::Addr>,
    c: &Chosen<F::Addr>,
    now: u64,
) -> Result<Action<F::Addr>, ()> {
    let snatted = c.flags & ct_flags::SNAT != 0;
    put_orig::<F>(p, c, now)?;
    put_reply::<F>(p, c, now)?;
    count_backend(c.backend_id);
    rewrite::<F>(ctx, p, &(c.backend, c.snat))?;
    count(Reason::TcNewFlow);
    if snatted {
        return Ok(Action::Redirect(c.snat.0, c.backend.0));
    }
    Ok(Action::Verdict(TC_ACT_OK as i32))
}

/// The original-direction entry of a new flow (own frame: keys and values are large).
#[inline(never)]
fn put_orig<F: Fam>(p: &Pkt<F::Addr>, c: &Chosen<F::Addr>, now: u64) -> Result<(), ()> {
    let val = F::ct_val(c.backend, c.snat, c.service_id, c.backend_id, c.flags, now);
    F::ct_put(
        &F::ct_key(p.saddr, p.daddr, p.sport, p.dport, p.proto, 0),
        &val,
    )
}

/// The reply-direction entry of a new flow: restores the frontend the client used, and
/// the client itself when the flow was SNATed.
#[inline(never)]
fn put_reply<F: Fam>(p: &Pkt<F::Addr>, c: &Chosen<F::Addr>, now: u64) -> Result<(), ()> {
    let (reply_to, client) = if c.flags & ct_flags::SNAT != 0 {
        (c.snat, (p.saddr, p.sport))
    } else {
        ((p.saddr, p.sport), (F::zero(), 0))
    };
    let val = F::ct_val(
        client,
        (p.daddr, p.dport),
        c.service_id,
        c.backend_id,
        c.flags,
        now,
    );
    let key = F::ct_key(c.backend.0, reply_to.0, c.backend.1, reply_to.1, p.proto, 1);
    F::ct_put(&key, &val)
}

/// Refreshes the original-direction entry of a flow whose reply was seen.
#[inline(never)]
fn refresh_orig<F: Fam>(
    p: &Pkt<F::Addr>,
    client: &(F::Addr, u16),
    front: &(F::Addr, u16),
    now: u64,
) {
    let okey = F::ct_key(client.0, front.0, client.1, front.1, p.proto, 0);
    if let Some(o) = F::ct_get(&okey) {
        touch::<F>(o, p.proto, p.tcp_flags, true, now);
    }
}

/// Answers a SYN to a frontend without endpoints with a RST (kube-proxy's REJECT), sent
/// back out of the interface it came in on: swap MACs, addresses and ports, RST|ACK with
/// ack = seq + 1.
#[inline(never)]
fn reject_tcp<F: Fam>(ctx: &TcContext, p: &Pkt<F::Addr>) -> i32 {
    let Ok(seq) = ctx.load::<u32>(p.l4 + 4) else {
        return TC_ACT_SHOT as i32;
    };
    let Ok(old_ack) = ctx.load::<u32>(p.l4 + 8) else {
        return TC_ACT_SHOT as i32;
    };
    let ack = (u32::from_be(seq).wrapping_add(1)).to_be();
    let Ok(old_word) = ctx.load::<u16>(p.l4 + 12) else {
        return TC_ACT_SHOT as i32;
    };
    // Keep the data offset, set flags to RST|ACK.
    let new_word = ((u16::from_be(old_word) & 0xff00) | u16::from(TCP_RST | TCP_ACK)).to_be();
    let csum = p.csum_off();
    // Addresses: swapping keeps the pseudo-header sum; store both.
    let ok = F::set_addr(ctx, p, true, p.saddr, p.daddr).is_ok()
        && F::set_addr(ctx, p, false, p.daddr, p.saddr).is_ok()
        && ctx.store(p.l4, &p.dport, 0).is_ok()
        && ctx.store(p.l4 + 2, &p.sport, 0).is_ok()
        && ctx.l4_csum_replace(csum, u64::from(seq), 0, 4).is_ok()
        && ctx.store(p.l4 + 4, &0u32, 0).is_ok()
        && ctx
            .l4_csum_replace(csum, u64::from(old_ack), u64::from(ack), 4)
            .is_ok()
        && ctx.store(p.l4 + 8, &ack, 0).is_ok()
        && ctx
            .l4_csum_replace(csum, u64::from(old_word), u64::from(new_word), 2)
            .is_ok()
        && ctx.store(p.l4 + 12, &new_word, 0).is_ok();
    if !ok {
        return TC_ACT_SHOT as i32;
    }
    crate::unreach::bounce(ctx)
}
