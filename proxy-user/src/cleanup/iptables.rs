//! iptables: kube-proxy's chains and the rules that jump to them, per tool set
//! (`iptables-nft`, `iptables-legacy`, v4 and v6), removed with one
//! `iptables-restore --noflush` per table.

use std::{
    collections::{BTreeMap, BTreeSet, HashSet},
    fs,
};

use kube_rules::chains::{is_kube_proxy_chain, TABLES};

use super::{run, skip_or_fail, CleanupError, CleanupOptions, Item, Report};

/// One iptables tool set (`iptables-nft-save`, `iptables-nft-restore`, ...).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct IptablesToolSet {
    /// `iptables` or `ip6tables`.
    pub tool: &'static str,
    /// `legacy` or `nft`.
    pub mode: &'static str,
}

/// Every tool set kube-proxy may have written to (each family, each iptables backend).
pub const IPTABLES_TOOL_SETS: [IptablesToolSet; 4] = [
    IptablesToolSet {
        tool: "iptables",
        mode: "legacy",
    },
    IptablesToolSet {
        tool: "iptables",
        mode: "nft",
    },
    IptablesToolSet {
        tool: "ip6tables",
        mode: "legacy",
    },
    IptablesToolSet {
        tool: "ip6tables",
        mode: "nft",
    },
];

impl IptablesToolSet {
    pub fn name(&self) -> String {
        format!("{}-{}", self.tool, self.mode)
    }

    /// The legacy backend's list of instantiated tables in this namespace.
    fn legacy_tables_file(&self) -> &'static str {
        if self.tool == "ip6tables" {
            "/proc/net/ip6_tables_names"
        } else {
            "/proc/net/ip_tables_names"
        }
    }
}

/// A user-defined or built-in chain of a saved table.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SavedChain {
    pub name: String,
    /// Built-in chains have a policy; user chains show `-`.
    pub builtin: bool,
}

/// One `-A CHAIN spec` line of `iptables-save`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SavedRule {
    pub chain: String,
    /// Everything after `-A CHAIN `, as `iptables-save` quotes it.
    pub spec: String,
}

impl SavedRule {
    /// The chain the rule jumps or goes to (`-j`/`-g`), if any.
    pub fn target(&self) -> Option<String> {
        let words = split_words(&self.spec);
        words
            .windows(2)
            .find(|w| matches!(w[0].as_str(), "-j" | "--jump" | "-g" | "--goto"))
            .map(|w| w[1].clone())
    }

    /// The ipsets the rule matches on (`--match-set NAME`).
    pub fn match_sets(&self) -> Vec<String> {
        let words = split_words(&self.spec);
        words
            .windows(2)
            .filter(|w| w[0] == "--match-set")
            .map(|w| w[1].clone())
            .collect()
    }

    pub(super) fn line(&self) -> String {
        format!("-A {} {}", self.chain, self.spec)
    }
}

/// One table as `iptables-save -t TABLE` prints it.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct SavedTable {
    pub chains: Vec<SavedChain>,
    pub rules: Vec<SavedRule>,
    /// `iptables-nft-save` could not decode the table (written by a newer tool).
    pub incompatible: bool,
}

/// Parses the output of `iptables-save -t TABLE` (one table).
pub fn parse_save(text: &str) -> SavedTable {
    let mut table = SavedTable::default();
    for line in text.lines() {
        if line.starts_with("# Table `") && line.contains("incompatible") {
            table.incompatible = true;
        } else if let Some(decl) = line.strip_prefix(':') {
            let mut words = decl.split_whitespace();
            if let (Some(name), Some(policy)) = (words.next(), words.next()) {
                table.chains.push(SavedChain {
                    name: name.to_string(),
                    builtin: policy != "-",
                });
            }
        } else if let Some(rest) = line.strip_prefix("-A ") {
            let (chain, spec) = rest.split_once(' ').unwrap_or((rest, ""));
            table.rules.push(SavedRule {
                chain: chain.to_string(),
                spec: spec.to_string(),
            });
        }
    }
    table
}

/// Splits an `iptables-save` rule into words the way `iptables-restore` does: double
/// quotes group, a backslash inside quotes escapes the next character.
pub(super) fn split_words(spec: &str) -> Vec<String> {
    let mut words = Vec::new();
    let mut word = String::new();
    let (mut quoted, mut started) = (false, false);
    let mut chars = spec.chars();
    while let Some(c) = chars.next() {
        match c {
            '\\' if quoted => {
                if let Some(next) = chars.next() {
                    word.push(next);
                }
            }
            '"' => {
                quoted = !quoted;
                started = true;
            }
            c if c.is_whitespace() && !quoted => {
                if started {
                    words.push(std::mem::take(&mut word));
                    started = false;
                }
            }
            c => {
                word.push(c);
                started = true;
            }
        }
    }
    if started {
        words.push(word);
    }
    words
}

/// What to remove from one table.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct TablePlan {
    /// Rules of built-in chains that jump into a chain being removed.
    pub jumps: Vec<SavedRule>,
    /// kube-proxy's chains to flush and delete, with their rule counts.
    pub chains: Vec<(String, usize)>,
    /// kube-proxy's chains left whole, with the rule that still needs them.
    pub kept: Vec<(String, String)>,
    /// ipsets that rules staying in the table match on.
    pub kept_set_refs: BTreeSet<String>,
}

impl TablePlan {
    pub fn is_empty(&self) -> bool {
        self.jumps.is_empty() && self.chains.is_empty()
    }
}

/// Decides what to remove from `saved` (table `table`): kube-proxy's chains and the
/// built-in chains' jumps into them, except chains a kept rule still reaches.
pub fn plan_table(table: &str, saved: &SavedTable) -> TablePlan {
    let kube: BTreeSet<&str> = saved
        .chains
        .iter()
        .filter(|c| is_kube_proxy_chain(table, &c.name))
        .map(|c| c.name.as_str())
        .collect();
    let builtin: HashSet<&str> = saved
        .chains
        .iter()
        .filter(|c| c.builtin)
        .map(|c| c.name.as_str())
        .collect();

    // Chains a rule we keep jumps to stay, and so does everything they reach.
    let mut protected: BTreeMap<String, String> = BTreeMap::new();
    let mut work = Vec::new();
    for rule in &saved.rules {
        let Some(target) = rule.target() else {
            continue;
        };
        let own = kube.contains(rule.chain.as_str());
        let jump_from_builtin = builtin.contains(rule.chain.as_str());
        if !own
            && !jump_from_builtin
            && kube.contains(target.as_str())
            && !protected.contains_key(&target)
        {
            protected.insert(
                target.clone(),
                format!("still referenced by `{}`", rule.line()),
            );
            work.push(target);
        }
    }
    while let Some(chain) = work.pop() {
        for rule in saved.rules.iter().filter(|r| r.chain == chain) {
            if let Some(target) = rule.target() {
                if kube.contains(target.as_str()) && !protected.contains_key(&target) {
                    protected.insert(target.clone(), format!("reached from kept chain {chain}"));
                    work.push(target);
                }
            }
        }
    }

    let removed: BTreeSet<&str> = kube
        .iter()
        .copied()
        .filter(|c| !protected.contains_key(*c))
        .collect();
    let mut plan = TablePlan::default();
    for rule in &saved.rules {
        let into_removed = rule.target().is_some_and(|t| removed.contains(t.as_str()));
        if builtin.contains(rule.chain.as_str()) && into_removed {
            plan.jumps.push(rule.clone());
        } else if !removed.contains(rule.chain.as_str()) {
            plan.kept_set_refs.extend(rule.match_sets());
        }
    }
    plan.chains = saved
        .chains
        .iter()
        .filter(|c| removed.contains(c.name.as_str()))
        .map(|c| {
            let rules = saved.rules.iter().filter(|r| r.chain == c.name).count();
            (c.name.clone(), rules)
        })
        .collect();
    plan.kept = protected.into_iter().collect();
    plan
}

/// The `iptables-restore --noflush` input that carries out `plan` in one transaction:
/// declaring a chain flushes it, then the jumps are deleted by their exact spec (so a rule
/// inserted meanwhile is never hit), then the chains are deleted.
pub fn restore_script(table: &str, plan: &TablePlan) -> String {
    let mut s = format!("*{table}\n");
    for (chain, _) in &plan.chains {
        s += &format!(":{chain} - [0:0]\n");
    }
    for rule in &plan.jumps {
        s += &format!("-D {} {}\n", rule.chain, rule.spec);
    }
    for (chain, _) in &plan.chains {
        s += &format!("-X {chain}\n");
    }
    s += "COMMIT\n";
    s
}

// Long: one tool's clean-up in kube-proxy's own order (jumps out of the built-in chains,
// then flush and delete its chains, per table), each step logged.
pub(super) fn clean_iptables(
    tools: IptablesToolSet,
    opts: &CleanupOptions,
    report: &mut Report,
    kept_set_refs: &mut BTreeSet<String>,
) {
    let name = tools.name();
    let tables: Vec<&str> = if tools.mode == "legacy" {
        // Reading a legacy table that does not exist creates it: read only those the
        // kernel lists for this namespace.
        match fs::read_to_string(tools.legacy_tables_file()) {
            Ok(list) => {
                let present: Vec<&str> = list.lines().map(str::trim).collect();
                TABLES
                    .iter()
                    .copied()
                    .filter(|t| present.contains(t))
                    .collect()
            }
            Err(_) => {
                report.notes.push(format!(
                    "{name}: no legacy tables in this network namespace ({} absent)",
                    tools.legacy_tables_file()
                ));
                return;
            }
        }
    } else {
        TABLES.to_vec()
    };
    let save = format!("{name}-save");
    let restore = format!("{name}-restore");
    for table in tables {
        let scope = format!("{name} {table}");
        let text = match run(&scope, &save, &["-t", table], None) {
            Ok(t) => t,
            Err(e) => {
                let skip_backend = e.is_missing_tool() || e.is_unavailable_backend();
                skip_or_fail(report, e, &name);
                if skip_backend {
                    return;
                }
                continue;
            }
        };
        let saved = parse_save(&text);
        if saved.incompatible {
            report.errors.push(CleanupError::Unreadable {
                scope,
                detail: format!(
                    "`{save}` cannot decode this table (written by a newer iptables); use nft"
                ),
            });
            continue;
        }
        let plan = plan_table(table, &saved);
        for (chain, why) in &plan.kept {
            report
                .kept
                .push(Item::new(&scope, format!("chain {chain}: {why}")));
        }
        if plan.is_empty() {
            kept_set_refs.extend(plan.kept_set_refs);
            continue;
        }
        if !opts.dry_run {
            let script = restore_script(table, &plan);
            if let Err(e) = run(&scope, &restore, &["--noflush"], Some(&script)) {
                report.errors.push(e);
                // Nothing changed in this table: everything in it still counts as kept.
                kept_set_refs.extend(saved.rules.iter().flat_map(SavedRule::match_sets));
                continue;
            }
        }
        kept_set_refs.extend(plan.kept_set_refs);
        for rule in &plan.jumps {
            report
                .removed
                .push(Item::new(&scope, format!("rule {}", rule.line())));
        }
        for (chain, rules) in &plan.chains {
            report.removed.push(Item::new(
                &scope,
                format!("chain {chain} ({rules} rule(s))"),
            ));
        }
    }
}
