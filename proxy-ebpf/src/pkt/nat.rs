//! Packet rewriting (DNAT/SNAT and their reverse, checksums updated incrementally) over
//! any [`PktAccess`] context, and the per-CPU `bpf_fib_lookup` argument both hooks
//! forward with (the forwarding itself is the hook's: `PktHook::forward`).

use aya_ebpf::bindings::bpf_fib_lookup as FibParams;
use proxy_common::Reason;

use super::family::{csum_add, Pkt, PktAccess, PktFamily, ETH_HLEN};
use crate::maps::FIB;

/// Rewrites a packet: destination := `dnat`, source := `snat` (zero addresses: leave
/// that end alone), ports included. A failure may leave the packet half-rewritten: the
/// caller drops it.
// Not inlined: each path would otherwise carry two copies of its address buffers.
#[inline(never)]
pub fn rewrite<F: PktFamily, C: PktAccess>(
    ctx: &C,
    p: &Pkt<F::Addr>,
    nat: &((F::Addr, u16), (F::Addr, u16)),
) -> Result<(), Reason> {
    if C::DIRECT {
        return rewrite_direct::<F, C>(ctx, p, nat);
    }
    let (dnat, snat) = *nat;
    let fail = |()| Reason::TcRewriteFailed;
    if !F::is_zero(&dnat.0) {
        F::set_addr(ctx, p, false, p.daddr, dnat.0).map_err(fail)?;
        if dnat.1 != p.dport {
            ctx.l4_csum_replace(
                p.csum_off(),
                u64::from(p.dport),
                u64::from(dnat.1),
                2 | p.l4_flags(),
            )
            .map_err(fail)?;
            ctx.store(p.l4 + 2, &dnat.1).map_err(fail)?;
        }
    }
    if !F::is_zero(&snat.0) {
        F::set_addr(ctx, p, true, p.saddr, snat.0).map_err(fail)?;
        if snat.1 != p.sport {
            ctx.l4_csum_replace(
                p.csum_off(),
                u64::from(p.sport),
                u64::from(snat.1),
                2 | p.l4_flags(),
            )
            .map_err(fail)?;
            ctx.store(p.l4, &snat.1).map_err(fail)?;
        }
    }
    Ok(())
}

/// [`rewrite`] where the program computes the checksums (`PktAccess::DIRECT`, XDP): the
/// changes are summed first (the addresses count in the IPv4 header and in the L4
/// pseudo-header, the ports in L4), then each checksum is updated once and the fields
/// stored: two checksum updates and up to four stores, where field by field took six
/// updates.
#[inline(always)]
fn rewrite_direct<F: PktFamily, C: PktAccess>(
    ctx: &C,
    p: &Pkt<F::Addr>,
    nat: &((F::Addr, u16), (F::Addr, u16)),
) -> Result<(), Reason> {
    let (dnat, snat) = *nat;
    let fail = |()| Reason::TcRewriteFailed;
    let port = |old: u16, new: u16| csum_add(u32::from(!old), u32::from(new));
    let (new_dst, new_src) = (!F::is_zero(&dnat.0), !F::is_zero(&snat.0));
    if !new_dst && !new_src {
        return Ok(());
    }
    let mut l3 = 0u32;
    let mut l4 = 0u32;
    if new_dst {
        l3 = F::addr_delta(p.daddr, dnat.0);
        if dnat.1 != p.dport {
            l4 = port(p.dport, dnat.1);
        }
    }
    if new_src {
        l3 = csum_add(l3, F::addr_delta(p.saddr, snat.0));
        if snat.1 != p.sport {
            l4 = csum_add(l4, port(p.sport, snat.1));
        }
    }
    // Size 0: the sum folded in as it is (what `bpf_csum_diff` would return).
    ctx.l4_csum_replace(p.csum_off(), 0, u64::from(csum_add(l4, l3)), p.l4_flags())
        .map_err(fail)?;
    if !F::V6 {
        ctx.l3_csum_replace(ETH_HLEN + 10, 0, u64::from(l3), 0)
            .map_err(fail)?;
    }
    if new_dst {
        ctx.store(F::addr_off(false), &dnat.0).map_err(fail)?;
        if dnat.1 != p.dport {
            ctx.store(p.l4 + 2, &dnat.1).map_err(fail)?;
        }
    }
    if new_src {
        ctx.store(F::addr_off(true), &snat.0).map_err(fail)?;
        if snat.1 != p.sport {
            ctx.store(p.l4, &snat.1).map_err(fail)?;
        }
    }
    Ok(())
}

// `fib_params` clears the argument as sixteen aligned 4-byte words.
const _: () =
    assert!(core::mem::size_of::<FibParams>() == 64 && core::mem::align_of::<FibParams>() == 4);

/// This CPU's `bpf_fib_lookup` argument (`maps::FIB`), all zero. Cleared with sixteen
/// 4-byte stores: a zeroed struct on the stack (`mem::zeroed()`) compiled to a call of
/// the BPF target's byte-at-a-time `memset`, a 64-iteration loop per packet and the
/// largest single item of the XDP program's profile. Volatile, so LLVM does not fold the
/// stores back into that call.
#[inline(always)]
pub fn fib_params() -> Option<*mut FibParams> {
    let p = FIB.get_ptr_mut(0)?;
    // SAFETY: this CPU's entry (a program is not preempted on its CPU); sixteen aligned
    // words inside its 64 bytes; all-zero bytes are a valid `bpf_fib_lookup`.
    unsafe {
        let params = &raw mut (*p).params;
        let w = params as *mut u32;
        macro_rules! clear {
            ($($i:literal)*) => { $(w.add($i).write_volatile(0);)* };
        }
        clear!(0 1 2 3 4 5 6 7 8 9 10 11 12 13 14 15);
        Some(params)
    }
}
