//! The per-packet datapath's hook-neutral part, for traffic no socket hook saw (NodePort,
//! externalIPs and LoadBalancer addresses reached from outside the node, ClusterIP
//! traffic routed through it), run by two hooks: TC (`crate::tc`) and XDP
//! (`crate::xdp`).
//!
//! - `stages`: the stage machine (reply, known flow, new flow; `flow` is its entry);
//! - `hook`: `PktHook`, what the stages ask of the hook they run in (verdicts,
//!   forwarding, REJECT, DSR, counters): each hook implements it;
//! - `verdict`: `Verdict` and `Step`, what the stages decide (a leaf);
//! - `family`: the per-family packet layout and maps (on `lb::Family`), over the
//!   `PktAccess` trait;
//! - `ct`: conntrack and the SNAT port allocator;
//! - `nat`: rewriting, and the per-CPU FIB lookup argument;
//! - `state`: the per-CPU scratch and map value types.
//!
//! Imports run one way: from `stages` down to the others, never from here to a hook, and
//! siblings name each other's modules (nothing is re-exported from this file).

pub(crate) mod ct;
pub(crate) mod family;
pub(crate) mod hook;
pub(crate) mod nat;
pub(crate) mod stages;
pub(crate) mod state;
pub(crate) mod verdict;
