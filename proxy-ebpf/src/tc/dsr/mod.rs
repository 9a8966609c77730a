//! Direct server return (`--forwarding-mode dsr|hybrid`, `FWD_MODE`) for external traffic
//! (eTP=Cluster) to a backend on another node, IPv4 and IPv6.
//!
//! First node (the one the client hit): instead of SNAT, the packet is DNATed only (the
//! client stays its source) and carries the frontend in an IPv4 option of 8 bytes right
//! after the 20-byte header (`proxy_common::dsr_opt`, Cilium's `dsr_opt_v4` layout:
//! type 0x9a, length 8, frontend port, frontend address), wrapped in an IPIP outer
//! header from this node's address (`NODE_CONFIG`'s SNAT address) to the pod, and
//! forwarded by FIB redirect to the backend's node by the route to the pod. The option
//! rides on the packets that can open the flow on the backend's node: every TCP SYN and
//! every UDP datagram (later TCP packets are only DNATed; the backend's node already
//! knows the flow).
//!
//! Backend's node: an IPIP packet from a cluster node (outer source in `DSR_TRUSTED4`)
//! with the option inside gets a reply-direction conntrack entry (backend -> client:
//! source := the frontend, `ct_flags::DSR`), loses the outer header and the option and
//! is delivered with the client as source; from any other source it is dropped
//! (`tc_dsr_untrusted`), and an option without the outer header is not honoured
//! (`tc_dsr_untrusted`, the packet goes on as it is). The backend's reply leaves this
//! node through the usual reply stage (at TC egress of the interface towards the client) with the
//! frontend as source, straight to the client: the first node sees no reply.
//! The option is honoured only when it names a frontend a client could have sent to: a
//! NodePort on a cluster node's address (`DSR_TRUSTED4/6`, written by the agent: the Node
//! objects' addresses and `--dsr-trusted-cidrs`) or a frontend in this node's maps, with
//! the Service's source ranges applied to the client (in addition to the outer source's
//! check); otherwise the packet is dropped (`tc_dsr_untrusted`).
//!
//! IPv6: the same in a Destination Options header of 24 bytes right after the 40-byte
//! header (next header 60; Cilium's `dsr_opt_v6`: option type 0x1b, length 20, frontend
//! address, frontend port, 2 bytes of zero), in an IPv6-in-IPv6 outer header (next header
//! 41) checked against `DSR_TRUSTED6`; the backend's node removes both.
//!
//! MTU: a packet that must carry the option and the outer header and would then exceed
//! the MTU of its route (`bpf_fib_lookup` with `tot_len`) is not given them: a new flow
//! is SNATed instead, a later UDP datagram of a DSR flow is sent without them
//! (`tc_dsr_too_big`).

mod decap;
mod wire;

pub use decap::{unencapsulated, unparsed};

use aya_ebpf::{
    bindings::{
        bpf_adj_room_mode::{BPF_ADJ_ROOM_MAC, BPF_ADJ_ROOM_NET},
        bpf_fib_lookup as FibParams, BPF_FIB_LKUP_RET_FRAG_NEEDED, BPF_F_ADJ_ROOM_ENCAP_L3_IPV4,
        BPF_F_ADJ_ROOM_ENCAP_L3_IPV6,
    },
    helpers::generated::{bpf_csum_diff, bpf_fib_lookup},
    programs::TcContext,
    EbpfContext,
};
use proxy_common::{dsr_opt, fwd_mode, proto, Reason};

use crate::maps::count;
use crate::pkt::{
    family::{Pkt, PktAccess, PktFamily, ETH_HLEN},
    verdict::Step,
};
use wire::{
    fold, lens, mode, set_header, Opt4, Opt6, IP6_HLEN, IP_HLEN, NEXTHDR_DEST, NEXTHDR_IPV6,
    OPT6_LEN, OPT_LEN, TCP_ACK, TCP_SYN,
};

/// Whether this packet of a DSR flow must carry the option: a TCP SYN (not SYN-ACK), a
/// UDP datagram.
#[inline(always)]
fn needs_opt<A>(p: &Pkt<A>) -> bool {
    p.proto == proto::UDP
        || (p.proto == proto::TCP && p.tcp_flags & TCP_SYN != 0 && p.tcp_flags & TCP_ACK == 0)
}

/// Whether the mode asks for DSR for this packet's new flow: DSR for TCP and UDP, hybrid
/// for TCP; IPv4 without options only.
#[inline(always)]
pub fn asked<F: PktFamily>(p: &Pkt<F::Addr>) -> bool {
    if p.l4 != ETH_HLEN + lens::<F>().0 {
        return false;
    }
    match mode() {
        fwd_mode::DSR => p.proto == proto::TCP || p.proto == proto::UDP,
        fwd_mode::HYBRID => p.proto == proto::TCP,
        _ => false,
    }
}

/// Whether a new flow to `backend` on another node goes by DSR instead of SNAT: the mode
/// asks for it for this protocol, the packet is IPv4 without options, and the packet
/// with the option fits the MTU of its route (else `tc_dsr_too_big`, SNAT).
#[inline(never)]
pub fn wanted<F: PktFamily>(ctx: &TcContext, p: &Pkt<F::Addr>, backend: F::Addr) -> bool {
    if !asked::<F>(p) {
        return false;
    }
    // The outer header's source is this node's address.
    if F::is_zero(&F::snat_addr()) {
        return false;
    }
    if needs_opt(p) && !fits::<F>(ctx, p, backend) {
        count(Reason::TcDsrTooBig);
        return false;
    }
    true
}

/// The first packet of a new DSR flow, already DNATed: the option added when the packet
/// needs it (IPv4: and the outer header, then forwarded by FIB redirect, as its outer
/// source is this node's address; IPv6: handed to the stack, which routes it to the
/// backend's node).
#[inline(never)]
pub fn first<F: PktFamily>(
    ctx: &TcContext,
    p: &Pkt<F::Addr>,
    backend: F::Addr,
) -> Result<Step<F::Addr>, Reason> {
    if !needs_opt(p) {
        return Ok(Step::pass(Reason::TcNewFlow));
    }
    add_opt::<F>(ctx, p)?;
    encapsulated::<F>(ctx, backend)
}

/// Wraps the packet (with its option) in the outer header from this node to `backend`
/// (IPIP, IPv6-in-IPv6) and forwards it by FIB redirect (its source is now this node's).
#[inline(always)]
fn encapsulated<F: PktFamily>(ctx: &TcContext, backend: F::Addr) -> Result<Step<F::Addr>, Reason> {
    let node = F::snat_addr();
    if F::V6 {
        encap6::<F>(ctx, node, backend)?;
    } else {
        encap4::<F>(ctx, node, backend)?;
    }
    Ok(Step::redirect(node, backend, Reason::TcDsrEncap))
}

/// IPv6-in-IPv6 (next header 41): the outer header from `node` to `backend` (the pod), the
/// inner packet's traffic class and flow label, hop limit 64.
#[inline(never)]
fn encap6<F: PktFamily>(ctx: &TcContext, node: F::Addr, backend: F::Addr) -> Result<(), Reason> {
    let fail = |()| Reason::TcRewriteFailed;
    let inner: [u16; 3] = PktAccess::load(ctx, ETH_HLEN).map_err(fail)?;
    let len = u16::from_be(inner[2])
        .checked_add(IP6_HLEN as u16)
        .ok_or(Reason::TcRewriteFailed)?;
    ctx.adjust_room(
        IP6_HLEN as i32,
        BPF_ADJ_ROOM_MAC,
        u64::from(BPF_F_ADJ_ROOM_ENCAP_L3_IPV6),
    )
    .map_err(|_| Reason::TcRewriteFailed)?;
    let head: [u16; 4] = [
        inner[0],
        inner[1],
        len.to_be(),
        u16::from_be_bytes([NEXTHDR_IPV6, 64]).to_be(),
    ];
    PktAccess::store(ctx, ETH_HLEN, &head).map_err(fail)?;
    PktAccess::store(ctx, ETH_HLEN + 8, &node).map_err(fail)?;
    PktAccess::store(ctx, ETH_HLEN + 24, &backend).map_err(fail)
}

/// An IPv4 header without options (network order throughout).
#[repr(C)]
struct Ip4 {
    vihl: u8,
    tos: u8,
    tot: u16,
    id: u16,
    frag: u16,
    ttl: u8,
    proto: u8,
    csum: u16,
    saddr: u32,
    daddr: u32,
}

/// Puts the IPIP outer header (protocol 4) in front of the packet's IPv4 header
/// (`bpf_skb_adjust_room`, `BPF_ADJ_ROOM_MAC`): source `node` (this node's address, which
/// the backend's node checks against `DSR_TRUSTED4`), destination `backend` (the pod, which
/// the network routes to its node), the inner packet's TOS and DF bit, TTL 64.
#[inline(never)]
fn encap4<F: PktFamily>(ctx: &TcContext, node: F::Addr, backend: F::Addr) -> Result<(), Reason> {
    let fail = |()| Reason::TcRewriteFailed;
    let inner: [u16; 4] = PktAccess::load(ctx, ETH_HLEN).map_err(fail)?;
    let tot = u16::from_be(inner[1])
        .checked_add(IP_HLEN as u16)
        .ok_or(Reason::TcRewriteFailed)?;
    let mut h = Ip4 {
        vihl: 0x45,
        tos: inner[0].to_ne_bytes()[1],
        tot: tot.to_be(),
        id: 0,
        frag: inner[3] & 0x4000u16.to_be(),
        ttl: 64,
        proto: 4,
        csum: 0,
        saddr: F::client(node).0[0],
        daddr: F::client(backend).0[0],
    };
    // SAFETY: a 20-byte, 4-aligned struct on the stack.
    let sum = unsafe {
        bpf_csum_diff(
            core::ptr::null_mut(),
            0,
            (&raw mut h).cast::<u32>(),
            IP_HLEN as u32,
            0,
        )
    };
    if sum < 0 {
        return Err(Reason::TcRewriteFailed);
    }
    h.csum = !fold(sum as u64);
    ctx.adjust_room(
        IP_HLEN as i32,
        BPF_ADJ_ROOM_MAC,
        u64::from(BPF_F_ADJ_ROOM_ENCAP_L3_IPV4),
    )
    .map_err(|_| Reason::TcRewriteFailed)?;
    PktAccess::store(ctx, ETH_HLEN, &h).map_err(fail)
}

/// A later packet of a DSR flow, already DNATed: a SYN or a UDP datagram carries the
/// option again (a retransmitted SYN, a backend's node that lost the entry), unless it
/// would then not fit its route (sent without it, `tc_dsr_too_big`).
#[inline(never)]
pub fn again<F: PktFamily>(
    ctx: &TcContext,
    p: &Pkt<F::Addr>,
    backend: F::Addr,
) -> Result<Step<F::Addr>, Reason> {
    if !needs_opt(p) || p.l4 != ETH_HLEN + lens::<F>().0 {
        return Ok(Step::pass(Reason::TcFlow));
    }
    if !fits::<F>(ctx, p, backend) {
        count(Reason::TcDsrTooBig);
        return Ok(Step::pass(Reason::TcFlow));
    }
    add_opt::<F>(ctx, p)?;
    encapsulated::<F>(ctx, backend)
}

/// Whether the packet, 28 (IPv4: option and outer header; IPv6: 64) bytes longer, fits the MTU of its route from the client to
/// `backend` (`BPF_FIB_LKUP_RET_FRAG_NEEDED` otherwise). A failed lookup says "fits":
/// the stack decides.
#[inline(never)]
fn fits<F: PktFamily>(ctx: &TcContext, p: &Pkt<F::Addr>, backend: F::Addr) -> bool {
    // IPv4: the total length; IPv6: the payload length, without the fixed header.
    let Ok(len) = ctx.load::<u16>(ETH_HLEN + if F::V6 { 4 } else { 2 }) else {
        return false;
    };
    let (base, extra) = lens::<F>();
    // The option and the outer header (IPv6: the payload length counts the fixed header).
    let extra = if F::V6 {
        base + extra + IP6_HLEN
    } else {
        extra + IP_HLEN
    };
    let tot = u16::from_be(len).saturating_add(extra as u16);
    // SAFETY: a zeroed plain-data struct.
    let mut params: FibParams = unsafe { core::mem::zeroed() };
    params.family = F::FAMILY;
    params.l4_protocol = p.proto;
    params.sport = p.sport;
    params.dport = p.dport;
    params.__bindgen_anon_1.tot_len = tot;
    // SAFETY: the context's skb.
    params.ifindex = unsafe { (*ctx.skb.skb).ingress_ifindex };
    F::fib_set(&mut params, p.saddr, backend);
    // SAFETY: valid ctx and params.
    let ret = unsafe {
        bpf_fib_lookup(
            ctx.as_ptr(),
            &mut params,
            core::mem::size_of::<FibParams>() as i32,
            0,
        )
    };
    ret != i64::from(BPF_FIB_LKUP_RET_FRAG_NEEDED)
}

/// Inserts the option after the 20-byte header (`bpf_skb_adjust_room`, `BPF_ADJ_ROOM_NET`)
/// with the packet's original destination (the frontend; `p` was parsed before the
/// DNAT), and fixes IHL, total length and the header checksum. The L4 checksum does not
/// change (its pseudo-header has the L4 length).
#[inline(never)]
fn add_opt<F: PktFamily>(ctx: &TcContext, p: &Pkt<F::Addr>) -> Result<(), Reason> {
    if F::V6 {
        return add_opt6::<F>(ctx, p);
    }
    let tot = u16::from_be(
        ctx.load::<u16>(ETH_HLEN + 2)
            .map_err(|_| Reason::TcRewriteFailed)?,
    );
    // The frontend's address: for IPv4 the first word of the family's 4-word form.
    let addr = F::client(p.daddr).0[0];
    ctx.adjust_room(OPT_LEN as i32, BPF_ADJ_ROOM_NET, 0)
        .map_err(|_| Reason::TcRewriteFailed)?;
    let opt = Opt4 {
        kind: dsr_opt::TYPE4,
        len: dsr_opt::LEN4,
        port: p.dport,
        addr,
    };
    PktAccess::store(ctx, ETH_HLEN + IP_HLEN, &opt).map_err(|_| Reason::TcRewriteFailed)?;
    set_header::<7>(ctx, tot + OPT_LEN as u16)
}

/// IPv6: inserts the Destination Options header after the 40-byte header, points the
/// header's next header at it and grows the payload length. The L4 checksum does not
/// change (its pseudo-header has the L4 length and the final destination).
#[inline(never)]
fn add_opt6<F: PktFamily>(ctx: &TcContext, p: &Pkt<F::Addr>) -> Result<(), Reason> {
    let len = u16::from_be(
        PktAccess::load::<u16>(ctx, ETH_HLEN + 4).map_err(|_| Reason::TcRewriteFailed)?,
    );
    ctx.adjust_room(OPT6_LEN as i32, BPF_ADJ_ROOM_NET, 0)
        .map_err(|_| Reason::TcRewriteFailed)?;
    let opt = Opt6 {
        next: p.proto,
        hdr_len: (OPT6_LEN / 8 - 1) as u8,
        kind: dsr_opt::TYPE6,
        len: dsr_opt::LEN6,
        addr: F::client(p.daddr).0,
        port: p.dport,
        pad: 0,
    };
    PktAccess::store(ctx, ETH_HLEN + IP6_HLEN, &opt).map_err(|_| Reason::TcRewriteFailed)?;
    PktAccess::store(ctx, ETH_HLEN + 6, &NEXTHDR_DEST).map_err(|_| Reason::TcRewriteFailed)?;
    PktAccess::store(ctx, ETH_HLEN + 4, &(len + OPT6_LEN as u16).to_be())
        .map_err(|_| Reason::TcRewriteFailed)
}
