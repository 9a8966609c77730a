//! The kernel side of ebpf-proxy: socket-level load balancing at the cgroup hooks.
//!
//! - `maps`: every map, with its purpose (sizes in `proxy_common::limits`);
//! - `lb`: frontend lookup, equal-weight backend selection and the reverse path,
//!   written once over an address family trait and instantiated for v4 and v6;
//! - `affinity`: `sessionAffinity: ClientIP`, shared by both paths;
//! - `sock`: the eight cgroup `sock_addr` hooks, each a thin shell around `lb`;
//! - `tc/`: the per-packet datapath at TC (NodePort, external and LB addresses): shells
//!   and stages (`mod.rs`), per-family layout (`family.rs`), conntrack and SNAT ports
//!   (`ct.rs`), rewriting and FIB (`nat.rs`), ICMP errors (`icmp.rs`), REJECT answers
//!   (`unreach.rs`), and `hook.rs`, what the stage machine asks of the hook it runs in;
//! - `xdp`: the same stage machine at XDP on node interfaces (`--acceleration`), ingress
//!   only, handing what it cannot do to TC.
#![no_std]
#![no_main]

mod affinity;
mod lb;
mod maglev;
mod maps;
mod sock;
mod tc;
mod xdp;

#[cfg(not(test))]
#[panic_handler]
fn panic(_info: &core::panic::PanicInfo) -> ! {
    loop {}
}

/// GPL-compatible so GPL-only helpers stay available.
#[unsafe(link_section = "license")]
#[unsafe(no_mangle)]
static LICENSE: [u8; 13] = *b"Dual MIT/GPL\0";
