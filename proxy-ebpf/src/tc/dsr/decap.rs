//! The backend's node: an encapsulated DSR packet from a cluster node taken apart and its
//! flow recorded; an option without the outer header counted, not honoured.

use aya_ebpf::{
    bindings::{bpf_adj_room_mode::BPF_ADJ_ROOM_MAC, TC_ACT_OK, TC_ACT_SHOT},
    helpers::bpf_ktime_get_ns,
    programs::TcContext,
};
use proxy_common::{ct_flags, dsr_opt, fwd_mode, proto, svc_flags, Reason};

use super::wire::{
    mode, set_header, IP6_HLEN, IP_HLEN, NEXTHDR_DEST, NEXTHDR_IPV6, OPT6_LEN, OPT_LEN,
};
use crate::maps::count;
use crate::pkt::{
    family::{Pkt, PktAccess, PktFamily, ETH_HLEN},
    verdict::Verdict,
};

/// A packet the family's parser did not take: on the backend's node a DSR packet (IPIP,
/// IPv6-in-IPv6; an IPv6 Destination Options header before TCP/UDP without one, counted
/// and left as it is) is one; anything else is not ours.
#[inline(never)]
pub fn unparsed<F: PktFamily>(ctx: &TcContext, ingress: bool) -> Result<Verdict, Reason> {
    if !ingress {
        return Ok(Verdict::not_ours(TC_ACT_OK as i32));
    }
    if !F::V6 {
        return Ok(decap_ipip::<F>(ctx)?.unwrap_or(Verdict::not_ours(TC_ACT_OK as i32)));
    }
    if let Ok(NEXTHDR_DEST) = PktAccess::load::<u8>(ctx, ETH_HLEN + 6) {
        // Not honoured without the outer header ([`unencapsulated`]).
        if is_opt6(ctx, ETH_HLEN + IP6_HLEN) && mode() != fwd_mode::SNAT {
            count(Reason::TcDsrUntrusted);
        }
        return Ok(Verdict::not_ours(TC_ACT_OK as i32));
    }
    Ok(decap6::<F>(ctx)?.unwrap_or(Verdict::not_ours(TC_ACT_OK as i32)))
}

/// Whether the Destination Options header at `off` is ours, before TCP or UDP.
#[inline(always)]
fn is_opt6(ctx: &TcContext, off: usize) -> bool {
    let Ok(head) = PktAccess::load::<[u8; 4]>(ctx, off) else {
        return false;
    };
    (head[0] == proto::TCP || head[0] == proto::UDP)
        && head[1..] == [(OPT6_LEN / 8 - 1) as u8, dsr_opt::TYPE6, dsr_opt::LEN6]
}

/// IPv4, the backend's node: an IPIP packet (protocol 4) whose inner packet is TCP or UDP
/// with our option after a 20-byte header. Honoured only when the outer source is a
/// cluster node (`DSR_TRUSTED4`) and the option names a frontend a client could have
/// used ([`option_trusted`]): the reply entry is recorded, the outer header and the
/// option are removed (the inner header moved up, IHL 5), and the stack delivers the
/// inner packet to the pod with the client as source (`tc_dsr_decap`). Otherwise it is
/// dropped (`tc_dsr_untrusted`). `None`: not ours (any other IPIP packet, or SNAT mode).
#[inline(never)]
fn decap_ipip<F: PktFamily>(ctx: &TcContext) -> Result<Option<Verdict>, Reason> {
    const IN: usize = ETH_HLEN + IP_HLEN;
    let Ok(outer) = PktAccess::load::<[u8; 10]>(ctx, ETH_HLEN) else {
        return Ok(None);
    };
    let Ok(inner) = PktAccess::load::<[u8; 10]>(ctx, IN) else {
        return Ok(None);
    };
    let Ok(head) = PktAccess::load::<[u8; 2]>(ctx, IN + IP_HLEN) else {
        return Ok(None);
    };
    let unfragmented = |h: &[u8; 10]| u16::from_be_bytes([h[6], h[7]]) & 0x3fff == 0;
    if outer[0] != 0x45
        || outer[9] != 4
        || !unfragmented(&outer)
        || inner[0] != 0x47
        || (inner[9] != proto::TCP && inner[9] != proto::UDP)
        || !unfragmented(&inner)
        || head != [dsr_opt::TYPE4, dsr_opt::LEN4]
        || mode() == fwd_mode::SNAT
    {
        return Ok(None);
    }
    if !from_node::<F>(ctx, ETH_HLEN + 12) {
        return Ok(Some(untrusted()));
    }
    let fail = |()| Reason::TcRewriteFailed;
    let next = inner[9];
    let saddr: F::Addr = PktAccess::load(ctx, IN + 12).map_err(fail)?;
    let daddr: F::Addr = PktAccess::load(ctx, IN + 16).map_err(fail)?;
    let port: u16 = PktAccess::load(ctx, IN + IP_HLEN + 2).map_err(fail)?;
    let front: F::Addr = PktAccess::load(ctx, IN + IP_HLEN + 4).map_err(fail)?;
    if !option_trusted::<F>(front, port, next, saddr) {
        return Ok(Some(untrusted()));
    }
    let l4 = IN + IP_HLEN + OPT_LEN;
    let sport: u16 = PktAccess::load(ctx, l4).map_err(fail)?;
    let dport: u16 = PktAccess::load(ctx, l4 + 2).map_err(fail)?;
    // SAFETY: no preconditions.
    let now = unsafe { bpf_ktime_get_ns() };
    let key = F::ct_key(daddr, saddr, dport, sport, next, 1);
    record::<F>(&key, &(front, port), now)?;
    // The inner header's 20 bytes moved to just before L4, then the 28 bytes before them
    // (the outer header, the option's room) removed.
    let hdr: [u32; 5] = PktAccess::load(ctx, IN).map_err(fail)?;
    let tot = u16::from_be(PktAccess::load::<u16>(ctx, IN + 2).map_err(fail)?);
    PktAccess::store(ctx, l4 - IP_HLEN, &hdr).map_err(fail)?;
    ctx.adjust_room(-((IP_HLEN + OPT_LEN) as i32), BPF_ADJ_ROOM_MAC, 0)
        .map_err(|_| Reason::TcRewriteFailed)?;
    set_header::<5>(ctx, tot - OPT_LEN as u16)?;
    Ok(Some(Verdict::new(TC_ACT_OK as i32, Reason::TcDsrDecap)))
}

/// IPv6, the backend's node: an IPv6-in-IPv6 packet (next header 41) whose inner packet
/// has our Destination Options header before TCP or UDP: as [`decap_ipip`], with the
/// outer source checked against `DSR_TRUSTED6`; the outer header and the 24-byte header
/// removed in one step (the inner header moved up to just before L4).
#[inline(never)]
fn decap6<F: PktFamily>(ctx: &TcContext) -> Result<Option<Verdict>, Reason> {
    const IN: usize = ETH_HLEN + IP6_HLEN;
    let Ok(NEXTHDR_IPV6) = PktAccess::load::<u8>(ctx, ETH_HLEN + 6) else {
        return Ok(None);
    };
    let Ok(inner) = PktAccess::load::<[u8; 8]>(ctx, IN) else {
        return Ok(None);
    };
    if inner[0] >> 4 != 6
        || inner[6] != NEXTHDR_DEST
        || !is_opt6(ctx, IN + IP6_HLEN)
        || mode() == fwd_mode::SNAT
    {
        return Ok(None);
    }
    if !from_node::<F>(ctx, ETH_HLEN + 8) {
        return Ok(Some(untrusted()));
    }
    let fail = |()| Reason::TcRewriteFailed;
    let next: u8 = PktAccess::load(ctx, IN + IP6_HLEN).map_err(fail)?;
    let saddr: F::Addr = PktAccess::load(ctx, IN + 8).map_err(fail)?;
    let daddr: F::Addr = PktAccess::load(ctx, IN + 24).map_err(fail)?;
    let front: F::Addr = PktAccess::load(ctx, IN + IP6_HLEN + 4).map_err(fail)?;
    let port: u16 = PktAccess::load(ctx, IN + IP6_HLEN + 20).map_err(fail)?;
    if !option_trusted::<F>(front, port, next, saddr) {
        return Ok(Some(untrusted()));
    }
    let l4 = IN + IP6_HLEN + OPT6_LEN;
    let sport: u16 = PktAccess::load(ctx, l4).map_err(fail)?;
    let dport: u16 = PktAccess::load(ctx, l4 + 2).map_err(fail)?;
    // SAFETY: no preconditions.
    let now = unsafe { bpf_ktime_get_ns() };
    let key = F::ct_key(daddr, saddr, dport, sport, next, 1);
    record::<F>(&key, &(front, port), now)?;
    move_inner6(ctx, next)?;
    Ok(Some(Verdict::new(TC_ACT_OK as i32, Reason::TcDsrDecap)))
}

/// The inner IPv6 header moved to just before L4 (24 bytes on, word by word from its
/// end, as the two overlap; next header := `next`, payload length without the 24-byte
/// header), then the 64 bytes before it (the outer header, the option's room) removed.
/// Eight bytes at a time: a 40-byte copy on the stack put this frame over the verifier's
/// 512 bytes for the whole call chain.
#[inline(never)]
fn move_inner6(ctx: &TcContext, next: u8) -> Result<(), Reason> {
    const IN: usize = ETH_HLEN + IP6_HLEN;
    let fail = |()| Reason::TcRewriteFailed;
    let len = u16::from_be(PktAccess::load::<u16>(ctx, IN + 4).map_err(fail)?)
        .checked_sub(OPT6_LEN as u16)
        .ok_or(Reason::TcRewriteFailed)?;
    for k in (0..IP6_HLEN / 8).rev() {
        let w: u64 = PktAccess::load(ctx, IN + 8 * k).map_err(fail)?;
        PktAccess::store(ctx, IN + OPT6_LEN + 8 * k, &w).map_err(fail)?;
    }
    PktAccess::store(ctx, IN + OPT6_LEN + 4, &len.to_be()).map_err(fail)?;
    PktAccess::store(ctx, IN + OPT6_LEN + 6, &next).map_err(fail)?;
    ctx.adjust_room(-((IP6_HLEN + OPT6_LEN) as i32), BPF_ADJ_ROOM_MAC, 0)
        .map_err(|_| Reason::TcRewriteFailed)
}

/// Whether the outer header's source (at `off`) is a cluster node (`DSR_TRUSTED4/6`).
/// Own frame: the verifier's 512 bytes are counted over the whole call chain.
#[inline(never)]
fn from_node<F: PktFamily>(ctx: &TcContext, off: usize) -> bool {
    PktAccess::load::<F::Addr>(ctx, off).is_ok_and(F::dsr_trusted)
}

/// An encapsulated DSR packet not honoured: dropped, counted.
#[inline(always)]
fn untrusted() -> Verdict {
    Verdict::new(TC_ACT_SHOT as i32, Reason::TcDsrUntrusted)
}

/// Whether the frontend a DSR option names may be honoured: a NodePort on one of the
/// cluster's node addresses (`DSR_TRUSTED4/6`: the Node objects' addresses and
/// `--dsr-trusted-cidrs`; the first node puts the address the client used), or a
/// frontend of this node's own maps (a LoadBalancer IP, an externalIP); and the client
/// inside the Service's `loadBalancerSourceRanges`, which the first node enforced. The
/// sender of the packet cannot be checked (its source is the client's address; that
/// needs the outer header: [`decap_ipip`], [`decap6`] check it first): with this
/// check the option cannot make this node answer from any address that is not a frontend
/// the client could have sent to itself.
#[inline(never)]
fn option_trusted<F: PktFamily>(front: F::Addr, port: u16, proto: u8, client: F::Addr) -> bool {
    let Some((fe, _)) = proxy_common::lookup::frontend(
        front,
        F::zero(),
        |a| F::svc(a, port, proto),
        F::dsr_trusted,
    ) else {
        return false;
    };
    fe.flags & svc_flags::SOURCE_RANGES == 0 || F::source_allowed(fe.service_id, client)
}

/// The backend's node's reply entry of a DSR flow: backend -> client, source := the
/// frontend (own frame: key and value are large for IPv6).
#[inline(never)]
fn record<F: PktFamily>(key: &F::Key, front: &(F::Addr, u16), now: u64) -> Result<(), Reason> {
    let val = F::ct_val((F::zero(), 0), *front, 0, 0, ct_flags::DSR, now);
    F::ct_put(key, &val).map_err(|()| Reason::TcCtWriteFailed)
}

/// On the backend's node (ingress): an IPv4 packet with the DSR option but no outer
/// header. Not honoured: its sender cannot be told (its source is the client's), so anyone
/// could have sent it; only [`decap_ipip`] honours the option, inside the outer header of
/// a cluster node. Counted `tc_dsr_untrusted` (unless this node is in SNAT mode, where no
/// option is ours); the packet goes on as it is.
#[inline(never)]
pub fn unencapsulated<F: PktFamily>(ctx: &TcContext, p: &Pkt<F::Addr>) {
    if F::V6 || p.l4 != ETH_HLEN + IP_HLEN + OPT_LEN {
        return;
    }
    let Ok(head) = PktAccess::load::<[u8; 2]>(ctx, ETH_HLEN + IP_HLEN) else {
        return;
    };
    if head == [dsr_opt::TYPE4, dsr_opt::LEN4] && mode() != fwd_mode::SNAT {
        count(Reason::TcDsrUntrusted);
    }
}
