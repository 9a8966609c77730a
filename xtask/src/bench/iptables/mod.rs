//! kube-proxy's iptables mode, reproduced: the `iptables-restore` input its full sync
//! writes, the partial sync it writes for one changed service, and the jump rules it
//! ensures in the built-in chains. After kube-proxy's `pkg/proxy/iptables/proxier.go`
//! (1.28 and later, `MinimizeIPTablesRestore` on), checked against its golden tests:
//!
//! ```text
//! -A KUBE-SERVICES -m comment --comment "ns/svc:http cluster IP" -m tcp -p tcp -d VIP --dport 80 -j KUBE-SVC-<hash>
//! -A KUBE-SVC-<hash> -m comment --comment "ns/svc:http cluster IP" -m tcp -p tcp -d VIP --dport 80 ! -s <cluster CIDR> -j KUBE-MARK-MASQ
//! -A KUBE-SVC-<hash> -m comment --comment "ns/svc:http -> 10.0.0.1:80" -m statistic --mode random --probability 0.1000000000 -j KUBE-SEP-<hash>
//! ...                                                                (1/n, 1/(n-1), ..., then no statistic match)
//! -A KUBE-SEP-<hash> -m comment --comment ns/svc:http -s 10.0.0.1 -j KUBE-MARK-MASQ
//! -A KUBE-SEP-<hash> -m comment --comment ns/svc:http -m tcp -p tcp -j DNAT --to-destination 10.0.0.1:80
//! ```
//!
//! Chain names are kube-proxy's: `KUBE-SVC-` + base32(sha256(servicePortName + protocol))
//! and `KUBE-SEP-` + base32(sha256(servicePortName + protocol + endpoint)), 16
//! characters. Above 1,000 endpoints kube-proxy runs in "large cluster mode": the
//! per-endpoint comments are left out and stale chains are deleted only once per sync
//! period, which is what [`Rules::large_cluster`] reproduces.
//!
//! Layout: `names.rs` the chain names and the stale ones; `jumps.rs` the jump rules in
//! the built-in chains; `rules.rs` what one sync writes ([`Rules`]); `tests.rs` checks
//! against the seed article and kube-proxy's golden tests.

mod jumps;
mod names;
mod rules;

pub use jumps::jump_rules_restore;
pub use names::stale_chains;
pub use rules::Rules;

#[cfg(test)]
mod tests;
