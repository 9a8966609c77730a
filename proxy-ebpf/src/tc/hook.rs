//! What the stage machine (`tc/mod.rs`) needs from the hook it runs in, beyond reading
//! and writing the packet ([`PktAccess`]): its verdicts, forwarding, the REJECT answers
//! and where outcomes are counted. TC implements it here; XDP in `crate::xdp`. The
//! stages, the frontend lookup, the backend choice, conntrack and NAT are one
//! implementation, generic over this trait.

use aya_ebpf::{
    bindings::{TC_ACT_OK, TC_ACT_SHOT},
    programs::TcContext,
    EbpfContext,
};
use proxy_common::Reason;

use super::{
    family::{Pkt, PktAccess, PktFamily},
    nat::fib_redirect,
    unreach,
};
use crate::maps::count;

/// A packet hook running the shared stage machine.
pub trait PktHook: PktAccess + EbpfContext {
    /// Hands the packet on unchanged by this hook (TC: `TC_ACT_OK`, to the stack; XDP:
    /// `XDP_PASS`, to the stack and so to TC).
    const PASS: i32;
    /// Drops the packet.
    const DROP: i32;
    /// Counts an outcome in this hook's counters (TC: `STATS`, XDP: `XDP_STATS`).
    fn count(r: Reason);
    /// Whether this hook can forward a packet from `src` to `dst` itself. Asked before
    /// the packet or its flow is changed, so a packet the hook cannot forward is handed
    /// on untouched (XDP: a FIB result it cannot act on goes to TC, which then handles the
    /// packet whole). TC: always (it falls back to the stack itself). `now`: the
    /// packet's conntrack clock (XDP reuses a recent FIB answer).
    fn can_forward<F: PktFamily>(&self, src: F::Addr, dst: F::Addr, proto: u8, now: u64) -> bool;
    /// Forwards the translated packet by FIB lookup (after `can_forward`).
    fn forward<F: PktFamily>(&self, src: F::Addr, dst: F::Addr, proto: u8) -> i32;
    /// kube-proxy's REJECT for a frontend without endpoints: the verdict, or `None` when
    /// this hook leaves the answer to the next one (XDP leaves it to TC).
    fn reject<F: PktFamily>(&self, p: &Pkt<F::Addr>) -> Option<i32>;
    /// The TC context, for what only TC can do (DSR's IP option: the packet grows or
    /// shrinks); `None` at XDP, which hands such packets on to TC.
    fn tc(&self) -> Option<&TcContext>;
}

const TCP_SYN: u8 = 0x02;
const TCP_ACK: u8 = 0x10;

impl PktHook for TcContext {
    const PASS: i32 = TC_ACT_OK as i32;
    const DROP: i32 = TC_ACT_SHOT as i32;

    #[inline(always)]
    fn count(r: Reason) {
        count(r);
    }

    #[inline(always)]
    fn can_forward<F: PktFamily>(
        &self,
        _src: F::Addr,
        _dst: F::Addr,
        _proto: u8,
        _now: u64,
    ) -> bool {
        true
    }

    #[inline(always)]
    fn forward<F: PktFamily>(&self, src: F::Addr, dst: F::Addr, proto: u8) -> i32 {
        fib_redirect::<F>(self, src, dst, proto)
    }

    #[inline(always)]
    fn tc(&self) -> Option<&TcContext> {
        Some(self)
    }

    /// TCP SYN: RST; UDP: ICMP port unreachable (rate-limited); other packets dropped.
    #[inline(always)]
    fn reject<F: PktFamily>(&self, p: &Pkt<F::Addr>) -> Option<i32> {
        use proxy_common::proto;
        Some(
            if p.proto == proto::TCP && p.tcp_flags & TCP_SYN != 0 && p.tcp_flags & TCP_ACK == 0 {
                unreach::tcp_rst::<F>(self, p)
            } else if p.proto == proto::UDP && unreach::allowed() {
                unreach::udp::<F>(self)
            } else {
                TC_ACT_SHOT as i32
            },
        )
    }
}
