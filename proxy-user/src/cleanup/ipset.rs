//! ipsets: kube-proxy's IPVS-mode sets, unless a kept iptables rule still uses them.

use std::collections::{BTreeMap, BTreeSet};

use kube_rules::ipvs::{ipv6_set_name, IPSET_NAMES};

use super::{run, skip_or_fail, CleanupOptions, Item, Report};

/// The ipsets of the namespace (`ipset save`): name -> (type, entries).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct IpSets {
    pub sets: BTreeMap<String, (String, Vec<String>)>,
}

/// Parses `ipset save`: `create NAME TYPE ...` and `add NAME ENTRY ...` lines.
pub fn parse_ipset_save(text: &str) -> IpSets {
    let mut out = IpSets::default();
    for line in text.lines() {
        let mut w = line.split_whitespace();
        match (w.next(), w.next(), w.next()) {
            (Some("create"), Some(name), Some(kind)) => {
                out.sets
                    .entry(name.to_string())
                    .or_insert_with(|| (kind.to_string(), Vec::new()));
            }
            (Some("add"), Some(name), Some(entry)) => {
                out.sets
                    .entry(name.to_string())
                    .or_default()
                    .1
                    .push(entry.to_string());
            }
            _ => {}
        }
    }
    out
}

pub(super) fn read_ipsets(report: &mut Report) -> Option<IpSets> {
    match run("ipset", "ipset", &["save"], None) {
        Ok(text) => Some(parse_ipset_save(&text)),
        Err(e) => {
            skip_or_fail(report, e, "ipsets (kube-proxy's IPVS mode)");
            None
        }
    }
}

/// Every name kube-proxy gives its ipsets, IPv4 and IPv6.
pub fn kube_proxy_set_names() -> BTreeSet<String> {
    IPSET_NAMES
        .iter()
        .flat_map(|n| [n.to_string(), ipv6_set_name(n)])
        .collect()
}

pub(super) fn clean_ipsets(
    sets: Option<&IpSets>,
    kept_refs: &BTreeSet<String>,
    opts: &CleanupOptions,
    report: &mut Report,
) {
    let Some(sets) = sets else { return };
    let ours = kube_proxy_set_names();
    for name in sets.sets.keys() {
        if !ours.contains(name) {
            if name.starts_with("KUBE-") {
                report
                    .notes
                    .push(format!("ipset {name}: not one of kube-proxy's sets, left"));
            }
            continue;
        }
        if kept_refs.contains(name) {
            report.kept.push(Item::new(
                "ipset",
                format!("{name}: an iptables rule that stays still matches on it"),
            ));
            continue;
        }
        if !opts.dry_run {
            if let Err(e) = run("ipset", "ipset", &["destroy", name], None) {
                report.errors.push(e);
                continue;
            }
        }
        report.removed.push(Item::new("ipset", name.clone()));
    }
}
