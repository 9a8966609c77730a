//! What kube-proxy writes on a node, in one place: the names of its chains, ipsets,
//! nftables table and IPVS link, the hash its per-service chain names are made of, and
//! the text of its iptables rules. Used by `proxyctl explain` (the rules kube-proxy would
//! have written), `proxy-agent cleanup-kube-proxy` (what counts as kube-proxy's) and
//! `cargo xtask bench` (kube-proxy's iptables/nftables modes reproduced).
//!
//! Everything here follows upstream's `pkg/proxy/iptables`, `pkg/proxy/ipvs` and
//! `pkg/proxy/nftables`; the tests pin names from kube-proxy's own golden tests.

pub mod chains;
pub mod hash;
pub mod ipvs;
pub mod text;

/// The nftables mode's table name (in the `ip` and `ip6` families).
pub const NFT_TABLE: &str = "kube-proxy";
