//! nftables: the `ip kube-proxy` and `ip6 kube-proxy` tables.

use kube_rules::NFT_TABLE;

use super::{run, skip_or_fail, CleanupOptions, Item, Report};

/// `(family, name)` of every table in `nft list tables` output.
pub fn parse_nft_tables(text: &str) -> Vec<(String, String)> {
    text.lines()
        .filter_map(|l| {
            let mut w = l.split_whitespace();
            (w.next()? == "table").then_some(())?;
            Some((w.next()?.to_string(), w.next()?.to_string()))
        })
        .collect()
}

pub(super) fn clean_nftables(opts: &CleanupOptions, report: &mut Report) {
    let scope = "nft";
    let tables = match run(scope, "nft", &["list", "tables"], None) {
        Ok(t) => parse_nft_tables(&t),
        Err(e) => return skip_or_fail(report, e, "nftables (kube-proxy's nftables mode)"),
    };
    for family in ["ip", "ip6"] {
        if !tables.iter().any(|(f, n)| f == family && n == NFT_TABLE) {
            continue;
        }
        let chains = run(scope, "nft", &["list", "table", family, NFT_TABLE], None)
            .map(|t| {
                t.lines()
                    .filter(|l| l.trim_start().starts_with("chain "))
                    .count()
            })
            .unwrap_or(0);
        if !opts.dry_run {
            if let Err(e) = run(scope, "nft", &["delete", "table", family, NFT_TABLE], None) {
                report.errors.push(e);
                continue;
            }
        }
        report.removed.push(Item::new(
            scope,
            format!("table {family} {NFT_TABLE} ({chains} chains)"),
        ));
    }
}
