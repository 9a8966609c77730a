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
//!
//! Layout: the stage machine (reply, known flow, new flow) and what it works with
//! (packet layout, conntrack, NAT) are hook-neutral, in `crate::pkt`. Here: this file
//! holds the two program shells; `hook` is TC's `PktAccess`/`PktHook` (the kernel's skb
//! helpers, the FIB redirect, the REJECT answers, DSR); `icmp` ICMP errors about NATed
//! flows, `unreach` the REJECT answers, `dsr` direct server return (instead of SNAT,
//! `--forwarding-mode dsr|hybrid`). The frontend lookup is `lb::frontend`, the rule the socket hooks and `proxyctl
//! explain` use too. Each stage returns the outcome to count; the shells count it, so a
//! failure (a conntrack entry not written, a rewrite a helper refused) is counted and the
//! packet dropped, never passed on silently.

pub(crate) mod dsr;
mod hook;
mod icmp;
mod unreach;

use aya_ebpf::{
    bindings::{TC_ACT_OK, TC_ACT_SHOT},
    macros::classifier,
    programs::TcContext,
};
use proxy_common::Reason;

use crate::{
    events,
    lb::{V4, V6},
    maps::count,
    pkt::{
        family::{PktAccess, ETH_P_IP, ETH_P_IPV6},
        stages,
        verdict::Verdict,
    },
};

#[classifier]
pub fn tc_ingress(ctx: TcContext) -> i32 {
    shell(&ctx, true)
}

#[classifier]
pub fn tc_egress(ctx: TcContext) -> i32 {
    shell(&ctx, false)
}

/// Runs the worker and counts its outcome. A failure drops the packet (it may be
/// half-rewritten, or its flow half-recorded).
#[inline(always)]
fn shell(ctx: &TcContext, ingress: bool) -> i32 {
    match try_tc(ctx, ingress) {
        Ok(v) => {
            if let Some(r) = v.reason {
                count(r);
            }
            v.code
        }
        Err(r) => {
            count(r);
            TC_ACT_SHOT as i32
        }
    }
}

#[inline(always)]
fn try_tc(ctx: &TcContext, ingress: bool) -> Result<Verdict, Reason> {
    let Ok(eth_proto) = PktAccess::load::<u16>(ctx, 12) else {
        return Ok(Verdict::not_ours(TC_ACT_OK as i32));
    };
    match u16::from_be(eth_proto) {
        ETH_P_IP => match ingress.then(|| icmp::icmp4(ctx)).flatten() {
            Some(r) => r.map(|code| Verdict::new(code, Reason::TcIcmpError)),
            None => {
                let r = stages::flow::<TcContext, V4>(ctx, ingress);
                if events::on() {
                    stages::report::<TcContext, V4>(&r, ingress);
                }
                r
            }
        },
        ETH_P_IPV6 => match ingress.then(|| icmp::icmp6(ctx)).flatten() {
            Some(r) => r.map(|code| Verdict::new(code, Reason::TcIcmpError)),
            None => {
                let r = stages::flow::<TcContext, V6>(ctx, ingress);
                if events::on() {
                    stages::report::<TcContext, V6>(&r, ingress);
                }
                r
            }
        },
        _ => Ok(Verdict::not_ours(TC_ACT_OK as i32)),
    }
}
