//! TC's side of the shared stage machine (`crate::pkt::stages`): packet access through
//! the kernel's skb helpers ([`PktAccess`]) and [`PktHook`]: forwarding by FIB lookup and
//! redirect, the REJECT answers (`unreach`), DSR (`dsr`: the option and the outer header
//! make the packet grow or shrink, which only TC can do), counters in `STATS`.

use aya_ebpf::{
    bindings::{
        bpf_fib_lookup as FibParams, BPF_FIB_LKUP_RET_NO_NEIGH, BPF_FIB_LKUP_RET_SUCCESS,
        TC_ACT_OK, TC_ACT_SHOT,
    },
    helpers::generated::{bpf_fib_lookup, bpf_redirect, bpf_redirect_neigh},
    programs::TcContext,
    EbpfContext,
};
use proxy_common::{proto, Reason};

use super::{dsr, unreach};
use crate::{
    maps::count,
    pkt::{
        family::{Pkt, PktAccess, PktFamily},
        hook::PktHook,
        nat::fib_params,
        verdict::{Step, Verdict},
    },
};

const TCP_SYN: u8 = 0x02;
const TCP_ACK: u8 = 0x10;

impl PktAccess for TcContext {
    #[inline(always)]
    fn load<T>(&self, off: usize) -> Result<T, ()> {
        TcContext::load(self, off).map_err(|_| ())
    }

    #[inline(always)]
    fn store<T>(&self, off: usize, v: &T) -> Result<(), ()> {
        TcContext::store(self, off, v, 0).map_err(|_| ())
    }

    #[inline(always)]
    fn l3_csum_replace(&self, off: usize, from: u64, to: u64, size: u64) -> Result<(), ()> {
        TcContext::l3_csum_replace(self, off, from, to, size).map_err(|_| ())
    }

    #[inline(always)]
    fn l4_csum_replace(&self, off: usize, from: u64, to: u64, flags: u64) -> Result<(), ()> {
        TcContext::l4_csum_replace(self, off, from, to, flags).map_err(|_| ())
    }
}

impl PktHook for TcContext {
    const PASS: i32 = TC_ACT_OK as i32;
    const DROP: i32 = TC_ACT_SHOT as i32;
    const EVENT_HOOK: u8 = proxy_common::event::event_hook::TC_INGRESS;

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

    /// TCP SYN: RST; UDP: ICMP port unreachable (rate-limited); other packets dropped.
    #[inline(always)]
    fn reject<F: PktFamily>(&self, p: &Pkt<F::Addr>) -> Option<i32> {
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

    #[inline(always)]
    fn unparsed<F: PktFamily>(&self, ingress: bool) -> Result<Verdict, Reason> {
        dsr::unparsed::<F>(self, ingress)
    }

    #[inline(always)]
    fn parsed<F: PktFamily>(&self, p: &Pkt<F::Addr>) {
        dsr::unencapsulated::<F>(self, p);
    }

    #[inline(always)]
    fn carries_dsr(&self) -> bool {
        true
    }

    #[inline(always)]
    fn dsr_wanted<F: PktFamily>(&self, p: &Pkt<F::Addr>, backend: F::Addr) -> Option<bool> {
        Some(dsr::wanted::<F>(self, p, backend))
    }

    #[inline(always)]
    fn dsr_first<F: PktFamily>(
        &self,
        p: &Pkt<F::Addr>,
        backend: F::Addr,
    ) -> Result<Step<F::Addr>, Reason> {
        dsr::first::<F>(self, p, backend)
    }

    #[inline(always)]
    fn dsr_again<F: PktFamily>(
        &self,
        p: &Pkt<F::Addr>,
        backend: F::Addr,
    ) -> Result<Option<Step<F::Addr>>, Reason> {
        dsr::again::<F>(self, p, backend).map(Some)
    }
}

/// Forwards a packet by FIB lookup and redirect (needed when its source is now one of
/// the node's addresses: the stack would drop it as a martian). Falls back to the stack,
/// counting `tc_fib_miss` (in addition to the packet's outcome, which its path chose).
// Separate BPF functions keep each frame under the verifier's 512-byte stack limit
// ("Looks like the BPF stack limit is exceeded" when everything is inlined).
#[inline(never)]
pub fn fib_redirect<F: PktFamily>(ctx: &TcContext, src: F::Addr, dst: F::Addr, proto: u8) -> i32 {
    let Some(params) = fib_params() else {
        return TC_ACT_OK as i32;
    };
    // SAFETY: this CPU's entry, cleared above.
    let params = unsafe { &mut *params };
    params.family = F::FAMILY;
    params.l4_protocol = proto;
    // SAFETY: the context's skb.
    params.ifindex = unsafe { (*ctx.skb.skb).ingress_ifindex };
    F::fib_set(params, src, dst);
    // SAFETY: valid ctx and params.
    let ret = unsafe {
        bpf_fib_lookup(
            ctx.as_ptr(),
            params as *mut FibParams,
            core::mem::size_of::<FibParams>() as i32,
            0,
        )
    };
    if ret == i64::from(BPF_FIB_LKUP_RET_SUCCESS) {
        if ctx.store(0, &params.dmac, 0).is_err() || ctx.store(6, &params.smac, 0).is_err() {
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
