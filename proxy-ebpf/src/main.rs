//! The kernel side of ebpf-proxy: socket-level load balancing at the cgroup hooks.
//!
//! - `events`: drops and new flows reported to `proxyctl monitor` (ring buffer, off
//!   unless a monitor holds the lease);
//! - `maps`: every map, with its purpose (sizes in `proxy_common::limits`);
//! - `lb`: frontend lookup, equal-weight backend selection and the reverse path,
//!   written once over an address family trait and instantiated for v4 and v6;
//! - `affinity`: `sessionAffinity: ClientIP`, shared by both paths;
//! - `sock`: the eight cgroup `sock_addr` hooks, each a thin shell around `lb`;
//! - `pkt/`: the per-packet datapath's hook-neutral part (NodePort, external and LB
//!   addresses): the stage machine (`stages.rs`), what it asks of its hook (`hook.rs`,
//!   `PktHook`), its decisions (`verdict.rs`), per-family layout (`family.rs`),
//!   conntrack and SNAT ports (`ct.rs`), rewriting (`nat.rs`), scratch types (`state.rs`);
//! - `tc/`: the stage machine at TC: the program shells (`mod.rs`), TC's `PktHook`
//!   (`hook.rs`: FIB redirect), ICMP errors (`icmp.rs`), REJECT answers (`unreach.rs`),
//!   direct server return (`dsr/`);
//! - `xdp`: the same stage machine at XDP on node interfaces (`--acceleration`), ingress
//!   only, handing what it cannot do to TC.
#![no_std]
#![no_main]

mod affinity;
mod events;
mod lb;
mod maglev;
mod maps;
mod pkt;
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
