//! The jump rules kube-proxy ensures in the built-in chains, as a list and as one
//! `iptables-restore --noflush` input.

use std::fmt::Write as _;

use kube_rules::text::comment;

/// The jump rules kube-proxy ensures (`iptables -C` then `-I`) in the built-in chains:
/// `(table, chain, rule arguments)`.
// Long: kube-proxy's iptables rules as it writes them, one line per rule.
pub fn jump_rules() -> Vec<(&'static str, &'static str, String)> {
    let new = "-m conntrack --ctstate NEW";
    vec![
        (
            "filter",
            "INPUT",
            format!(
                "{new} {} -j KUBE-PROXY-FIREWALL",
                comment("kubernetes load balancer firewall")
            ),
        ),
        (
            "filter",
            "INPUT",
            format!(
                "{} -j KUBE-NODEPORTS",
                comment("kubernetes health check service ports")
            ),
        ),
        (
            "filter",
            "INPUT",
            format!(
                "{new} {} -j KUBE-EXTERNAL-SERVICES",
                comment("kubernetes externally-visible service portals")
            ),
        ),
        (
            "filter",
            "FORWARD",
            format!(
                "{new} {} -j KUBE-PROXY-FIREWALL",
                comment("kubernetes load balancer firewall")
            ),
        ),
        (
            "filter",
            "FORWARD",
            format!("{} -j KUBE-FORWARD", comment("kubernetes forwarding rules")),
        ),
        (
            "filter",
            "FORWARD",
            format!(
                "{new} {} -j KUBE-SERVICES",
                comment("kubernetes service portals")
            ),
        ),
        (
            "filter",
            "FORWARD",
            format!(
                "{new} {} -j KUBE-EXTERNAL-SERVICES",
                comment("kubernetes externally-visible service portals")
            ),
        ),
        (
            "filter",
            "OUTPUT",
            format!(
                "{new} {} -j KUBE-PROXY-FIREWALL",
                comment("kubernetes load balancer firewall")
            ),
        ),
        (
            "filter",
            "OUTPUT",
            format!(
                "{new} {} -j KUBE-SERVICES",
                comment("kubernetes service portals")
            ),
        ),
        (
            "nat",
            "OUTPUT",
            format!("{} -j KUBE-SERVICES", comment("kubernetes service portals")),
        ),
        (
            "nat",
            "PREROUTING",
            format!("{} -j KUBE-SERVICES", comment("kubernetes service portals")),
        ),
        (
            "nat",
            "POSTROUTING",
            format!(
                "{} -j KUBE-POSTROUTING",
                comment("kubernetes postrouting rules")
            ),
        ),
    ]
}

/// The jump rules as one `iptables-restore --noflush` input, with the (still empty)
/// chains they jump to: what kube-proxy's `EnsureChain` and `EnsureRule(Prepend, ..)`
/// leave before its first sync.
pub fn jump_rules_restore() -> String {
    let mut out = String::new();
    for table in ["filter", "nat"] {
        let _ = writeln!(out, "*{table}");
        let mut targets: Vec<&str> = Vec::new();
        let rules = jump_rules();
        for (t, _, rule) in &rules {
            let target = rule.rsplit(' ').next().unwrap_or("");
            if *t == table && !targets.contains(&target) {
                targets.push(target);
                let _ = writeln!(out, ":{target} - [0:0]");
            }
        }
        for (t, chain, rule) in &rules {
            if *t == table {
                let _ = writeln!(out, "-I {chain} {rule}");
            }
        }
        out.push_str("COMMIT\n");
    }
    out
}
