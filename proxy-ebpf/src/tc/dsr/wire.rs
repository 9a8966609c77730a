//! The DSR option's wire layout and the mode, shared by both ends: the first node (`super`)
//! and the backend's node (`super::decap`).

use aya_ebpf::{helpers::generated::bpf_csum_diff, programs::TcContext};
use proxy_common::{dsr_opt, fwd_mode, Reason};

use crate::maps::FWD_MODE;
use crate::pkt::family::{PktAccess, PktFamily, ETH_HLEN};

pub(super) const TCP_SYN: u8 = 0x02;
pub(super) const TCP_ACK: u8 = 0x10;
/// The IPv4 header without options, and the DSR option.
pub(super) const IP_HLEN: usize = 20;
pub(super) const OPT_LEN: usize = dsr_opt::LEN4 as usize;
/// The IPv6 header, and the Destination Options header with the DSR option.
pub(super) const IP6_HLEN: usize = 40;
pub(super) const OPT6_LEN: usize = 24;
pub(super) const NEXTHDR_DEST: u8 = 60;
/// IPv6-in-IPv6.
pub(super) const NEXTHDR_IPV6: u8 = 41;

/// The family's fixed header length and the bytes the option adds.
#[inline(always)]
pub(super) fn lens<F: PktFamily>() -> (usize, usize) {
    if F::V6 {
        (IP6_HLEN, OPT6_LEN)
    } else {
        (IP_HLEN, OPT_LEN)
    }
}

/// The IPv6 Destination Options header carrying the DSR option.
#[repr(C)]
pub(super) struct Opt6 {
    pub(super) next: u8,
    /// In 8-byte units after the first 8: 2.
    pub(super) hdr_len: u8,
    pub(super) kind: u8,
    pub(super) len: u8,
    pub(super) addr: [u32; 4],
    pub(super) port: u16,
    pub(super) pad: u16,
}

/// The option as it sits in the packet (network order throughout).
#[repr(C)]
pub(super) struct Opt4 {
    pub(super) kind: u8,
    pub(super) len: u8,
    pub(super) port: u16,
    pub(super) addr: u32,
}

#[inline(always)]
pub(super) fn mode() -> u32 {
    FWD_MODE.get(0).copied().unwrap_or(fwd_mode::SNAT)
}

/// A 64-bit one's-complement sum folded to 16 bits.
#[inline(always)]
pub(super) fn fold(mut s: u64) -> u16 {
    s = (s & 0xffff) + (s >> 16);
    s = (s & 0xffff) + (s >> 16);
    s = (s & 0xffff) + (s >> 16);
    s as u16
}

/// Writes IHL `WORDS` and total length `tot` and recomputes the IPv4 header checksum
/// over the `WORDS * 4` header bytes.
#[inline(always)]
pub(super) fn set_header<const WORDS: usize>(ctx: &TcContext, tot: u16) -> Result<(), Reason> {
    PktAccess::store(ctx, ETH_HLEN, &(0x40u8 | WORDS as u8))
        .map_err(|_| Reason::TcRewriteFailed)?;
    PktAccess::store(ctx, ETH_HLEN + 2, &tot.to_be()).map_err(|_| Reason::TcRewriteFailed)?;
    PktAccess::store(ctx, ETH_HLEN + 10, &0u16).map_err(|_| Reason::TcRewriteFailed)?;
    let mut words: [u32; WORDS] =
        PktAccess::load(ctx, ETH_HLEN).map_err(|_| Reason::TcRewriteFailed)?;
    // SAFETY: a buffer of `WORDS * 4` bytes on the stack.
    let sum = unsafe {
        bpf_csum_diff(
            core::ptr::null_mut(),
            0,
            words.as_mut_ptr(),
            (WORDS * 4) as u32,
            0,
        )
    };
    if sum < 0 {
        return Err(Reason::TcRewriteFailed);
    }
    PktAccess::store(ctx, ETH_HLEN + 10, &!fold(sum as u64)).map_err(|_| Reason::TcRewriteFailed)
}
