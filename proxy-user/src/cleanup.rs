//! Removal of what kube-proxy leaves on a node (`proxy-agent cleanup-kube-proxy`, and
//! `proxy-agent run --cleanup-kube-proxy` once the first sync has written the maps), in
//! the network namespace of the calling process, with the system tools (`iptables-save`,
//! `iptables-restore`, `nft`, `ipvsadm`, `ipset`, `ip`). It removes kube-proxy's objects
//! and nothing else; what another program wrote stays, and a missing tool or backend is
//! skipped with a note.
//!
//! What counts as kube-proxy's follows upstream's own `CleanupLeftovers`
//! (`pkg/proxy/iptables`, `pkg/proxy/ipvs`, `pkg/proxy/nftables`):
//! - iptables, for `iptables-legacy`, `iptables-nft`, `ip6tables-legacy` and
//!   `ip6tables-nft`: the chains named in [`NAT_CHAINS`], [`FILTER_CHAINS`] and
//!   [`MANGLE_CHAINS`] and the per-service chains ([`SERVICE_CHAIN_PREFIXES`]), flushed and
//!   deleted, and the rules of the built-in chains that jump into them. kubelet's
//!   `KUBE-FIREWALL` and `KUBE-KUBELET-CANARY` stay. A kube-proxy chain that a rule we keep
//!   still jumps to (another program's chain, say) is left whole, with a note, because
//!   deleting it would break that rule. One `iptables-restore --noflush` per table: the
//!   table changes atomically or not at all. Legacy tables are read only when
//!   `/proc/net/ip{,6}_tables_names` lists them (reading creates them otherwise).
//! - nftables: the tables `ip kube-proxy` and `ip6 kube-proxy`.
//! - IPVS: a virtual service is kube-proxy's when its address is on `kube-ipvs0`, or its
//!   `address,proto:port` is in one of kube-proxy's `hash:ip,port` ipsets
//!   (`KUBE-CLUSTER-IP`, `KUBE-EXTERNAL-IP`, `KUBE-LOAD-BALANCER`, ...), or it is a TCP/UDP
//!   service on one of the node's own addresses whose port is in `KUBE-NODE-PORT-TCP/UDP`
//!   (a NodePort). Any other virtual service (keepalived's, say) stays; upstream flushes
//!   them all. IPVS is only looked at when `/proc/net/ip_vs` exists (no module load).
//! - the `kube-ipvs0` link, when it is a dummy (what kube-proxy creates).
//! - ipsets: kube-proxy's own set names ([`IPSET_NAMES`] and their `KUBE-6-` IPv6 forms),
//!   unless a kept iptables rule still matches on them. Other `KUBE-*` sets (kube-router
//!   names its policy sets `KUBE-SRC-*`/`KUBE-DST-*`) stay.
//!
//! Order: read everything first (ipsets and `kube-ipvs0` identify the IPVS services), then
//! iptables (which reference the ipsets), nftables, IPVS services, `kube-ipvs0`, ipsets.
//! If an IPVS service could not be removed, `kube-ipvs0` and the ipsets stay so that a
//! second run still recognises it. Running twice is harmless: the second run finds nothing.

use std::{
    collections::{BTreeMap, BTreeSet, HashSet},
    fmt, fs, io,
    io::Write as _,
    net::IpAddr,
    process::{Command, Stdio},
};

use tracing::{info, warn};

/// kube-proxy's chains in the `nat` table (iptables and IPVS modes).
pub const NAT_CHAINS: &[&str] = &[
    "KUBE-SERVICES",
    "KUBE-NODEPORTS",
    "KUBE-POSTROUTING",
    "KUBE-MARK-MASQ",
    "KUBE-MARK-DROP",
    "KUBE-PROXY-CANARY",
    // IPVS mode.
    "KUBE-NODE-PORT",
    "KUBE-LOAD-BALANCER",
];

/// Prefixes of kube-proxy's per-service and per-endpoint chains (`nat`): cluster and local
/// policy, endpoint, firewall, external, and the pre-1.25 `KUBE-XLB-`.
pub const SERVICE_CHAIN_PREFIXES: &[&str] = &[
    "KUBE-SVC-",
    "KUBE-SVL-",
    "KUBE-SEP-",
    "KUBE-FW-",
    "KUBE-EXT-",
    "KUBE-XLB-",
];

/// kube-proxy's chains in the `filter` table (iptables and IPVS modes).
pub const FILTER_CHAINS: &[&str] = &[
    "KUBE-SERVICES",
    "KUBE-EXTERNAL-SERVICES",
    "KUBE-FORWARD",
    "KUBE-NODEPORTS",
    "KUBE-PROXY-FIREWALL",
    "KUBE-PROXY-CANARY",
    // IPVS mode.
    "KUBE-NODE-PORT",
    "KUBE-SOURCE-RANGES-FIREWALL",
    "KUBE-IPVS-FILTER",
    "KUBE-IPVS-OUT-FILTER",
];

/// kube-proxy's chains in the `mangle` table.
pub const MANGLE_CHAINS: &[&str] = &["KUBE-PROXY-CANARY"];

/// The tables kube-proxy writes to.
pub const TABLES: &[&str] = &["nat", "filter", "mangle"];

/// kube-proxy's IPVS-mode ipsets (IPv4 names; IPv6 ones are [`ipv6_set_name`]).
pub const IPSET_NAMES: &[&str] = &[
    "KUBE-LOOP-BACK",
    "KUBE-CLUSTER-IP",
    "KUBE-EXTERNAL-IP",
    "KUBE-EXTERNAL-IP-LOCAL",
    "KUBE-LOAD-BALANCER",
    "KUBE-LOAD-BALANCER-FW",
    "KUBE-LOAD-BALANCER-LOCAL",
    "KUBE-LOAD-BALANCER-SOURCE-IP",
    "KUBE-LOAD-BALANCER-SOURCE-CIDR",
    "KUBE-NODE-PORT-TCP",
    "KUBE-NODE-PORT-LOCAL-TCP",
    "KUBE-NODE-PORT-UDP",
    "KUBE-NODE-PORT-LOCAL-UDP",
    "KUBE-NODE-PORT-SCTP-HASH",
    "KUBE-NODE-PORT-LOCAL-SCTP-HASH",
    "KUBE-HEALTH-CHECK-NODE-PORT",
    "KUBE-IPVS-IPS",
];

/// kube-proxy's `hash:ip,port` sets whose `address,proto:port` entries are services it
/// programmed in IPVS.
const SERVICE_ADDRESS_SETS: &[&str] = &[
    "KUBE-CLUSTER-IP",
    "KUBE-EXTERNAL-IP",
    "KUBE-EXTERNAL-IP-LOCAL",
    "KUBE-LOAD-BALANCER",
    "KUBE-LOAD-BALANCER-LOCAL",
    "KUBE-LOAD-BALANCER-FW",
    "KUBE-NODE-PORT-SCTP-HASH",
    "KUBE-NODE-PORT-LOCAL-SCTP-HASH",
];

/// kube-proxy's `bitmap:port` sets of NodePorts, with their protocol.
const NODE_PORT_SETS: &[(&str, &str)] = &[
    ("KUBE-NODE-PORT-TCP", "tcp"),
    ("KUBE-NODE-PORT-LOCAL-TCP", "tcp"),
    ("KUBE-NODE-PORT-UDP", "udp"),
    ("KUBE-NODE-PORT-LOCAL-UDP", "udp"),
];

/// The dummy link kube-proxy's IPVS mode binds service addresses to.
pub const IPVS_LINK: &str = "kube-ipvs0";

/// The nftables mode's table name (in the `ip` and `ip6` families).
pub const NFT_TABLE: &str = "kube-proxy";

/// kube-proxy's IPv6 name for an ipset: `KUBE-` becomes `KUBE-6-`, cut to ipset's 31
/// characters (upstream `NewIPSet`).
pub fn ipv6_set_name(name: &str) -> String {
    let mut v6 = match name.strip_prefix("KUBE-") {
        Some(rest) => format!("KUBE-6-{rest}"),
        None => name.to_string(),
    };
    v6.truncate(31);
    v6
}

/// Whether `chain` in `table` is one of kube-proxy's.
pub fn is_kube_proxy_chain(table: &str, chain: &str) -> bool {
    match table {
        "nat" => {
            NAT_CHAINS.contains(&chain)
                || SERVICE_CHAIN_PREFIXES.iter().any(|p| chain.starts_with(p))
        }
        "filter" => FILTER_CHAINS.contains(&chain),
        "mangle" => MANGLE_CHAINS.contains(&chain),
        _ => false,
    }
}

/// What [`cleanup_kube_proxy`] does.
#[derive(Clone, Copy, Debug, Default)]
pub struct CleanupOptions {
    /// Report what would be removed; change nothing.
    pub dry_run: bool,
}

/// A step that failed. The others still run.
#[derive(Debug, thiserror::Error)]
pub enum CleanupError {
    #[error("{scope}: could not run `{command}`: {source}")]
    Spawn {
        scope: String,
        command: String,
        #[source]
        source: io::Error,
    },
    #[error("{scope}: `{command}` failed ({status}): {stderr}")]
    Failed {
        scope: String,
        command: String,
        status: String,
        stderr: String,
    },
    #[error("{scope}: {detail}")]
    Unreadable { scope: String, detail: String },
}

impl CleanupError {
    /// The tool is not installed.
    fn is_missing_tool(&self) -> bool {
        matches!(self, Self::Spawn { source, .. } if source.kind() == io::ErrorKind::NotFound)
    }

    /// A read failed because the kernel lacks the feature (IPv6 disabled, no nf_tables,
    /// no ip_set): there is nothing of kube-proxy's there either.
    fn is_unavailable_backend(&self) -> bool {
        const SIGNS: &[&str] = &[
            "Address family not supported",
            "Protocol not supported",
            "Operation not supported",
            "Cannot open session to kernel",
        ];
        matches!(self, Self::Failed { stderr, .. } if SIGNS.iter().any(|s| stderr.contains(s)))
    }
}

/// One object: where it lives (`iptables-nft nat`, `nft`, `ipvs`, ...) and what it is.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Item {
    pub scope: String,
    pub what: String,
}

impl Item {
    fn new(scope: impl Into<String>, what: impl Into<String>) -> Self {
        Self {
            scope: scope.into(),
            what: what.into(),
        }
    }
}

impl fmt::Display for Item {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}: {}", self.scope, self.what)
    }
}

/// What a cleanup did (or, in a dry run, would do).
#[derive(Debug, Default)]
pub struct Report {
    pub dry_run: bool,
    /// kube-proxy's objects removed (or that would be).
    pub removed: Vec<Item>,
    /// kube-proxy's objects deliberately left, with the reason.
    pub kept: Vec<Item>,
    /// Skipped tools and backends, other programs' look-alikes left alone.
    pub notes: Vec<String>,
    pub errors: Vec<CleanupError>,
}

impl Report {
    /// Logs every line through `tracing` (the agent's `--cleanup-kube-proxy`).
    pub fn log(&self) {
        let verb = self.verb();
        for item in &self.removed {
            info!(scope = %item.scope, "{verb} kube-proxy leftover: {}", item.what);
        }
        for item in &self.kept {
            info!(scope = %item.scope, "kept: {}", item.what);
        }
        for note in &self.notes {
            info!("kube-proxy cleanup: {note}");
        }
        for e in &self.errors {
            warn!(error = %e, "kube-proxy cleanup step failed");
        }
        let summary = "kube-proxy cleanup finished";
        if self.errors.is_empty() {
            info!(
                removed = self.removed.len(),
                kept = self.kept.len(),
                errors = 0,
                "{summary}"
            );
        } else {
            warn!(
                removed = self.removed.len(),
                kept = self.kept.len(),
                errors = self.errors.len(),
                "{summary} with errors (not fatal; `proxy-agent cleanup-kube-proxy` retries)"
            );
        }
    }

    fn verb(&self) -> &'static str {
        if self.dry_run {
            "would remove"
        } else {
            "removed"
        }
    }
}

impl fmt::Display for Report {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let verb = self.verb();
        for item in &self.removed {
            writeln!(f, "{verb}: {item}")?;
        }
        for item in &self.kept {
            writeln!(f, "kept: {item}")?;
        }
        for note in &self.notes {
            writeln!(f, "note: {note}")?;
        }
        for e in &self.errors {
            writeln!(f, "error: {e}")?;
        }
        if self.removed.is_empty() && self.errors.is_empty() {
            writeln!(f, "nothing of kube-proxy's found")?;
        }
        writeln!(
            f,
            "summary: {} {verb}, {} kept, {} error(s)",
            self.removed.len(),
            self.kept.len(),
            self.errors.len()
        )
    }
}

/// Removes kube-proxy's leftovers from the current network namespace (see the module
/// documentation for what that covers). Never fails as a whole: every step's failure is
/// in [`Report::errors`] and the other steps still run.
pub fn cleanup_kube_proxy(opts: &CleanupOptions) -> Report {
    let mut report = Report {
        dry_run: opts.dry_run,
        ..Report::default()
    };
    // Read first: the ipsets and kube-ipvs0 tell which IPVS services are kube-proxy's,
    // and the iptables step below removes the rules that keep the ipsets in use.
    let links = read_links(&mut report);
    let sets = read_ipsets(&mut report);
    let ipvs = read_ipvs(&mut report);

    let mut kept_set_refs = BTreeSet::new();
    for backend in BACKENDS {
        clean_iptables(backend, opts, &mut report, &mut kept_set_refs);
    }
    clean_nftables(opts, &mut report);
    let ipvs_ok = clean_ipvs(ipvs, links.as_ref(), sets.as_ref(), opts, &mut report);
    if ipvs_ok {
        clean_link(links.as_ref(), opts, &mut report);
        clean_ipsets(sets.as_ref(), &kept_set_refs, opts, &mut report);
    } else {
        report.notes.push(format!(
            "{IPVS_LINK} and kube-proxy's ipsets left because an IPVS service could not be \
             removed: they identify it on the next run"
        ));
    }
    report
}

// ---------------------------------------------------------------------------------------
// Running tools

/// `program args...` with `stdin`; stdout on success.
fn run(
    scope: &str,
    program: &str,
    args: &[&str],
    stdin: Option<&str>,
) -> Result<String, CleanupError> {
    let command = std::iter::once(program)
        .chain(args.iter().copied())
        .collect::<Vec<_>>()
        .join(" ");
    let spawn_err = |source| CleanupError::Spawn {
        scope: scope.to_string(),
        command: command.clone(),
        source,
    };
    let mut child = Command::new(program)
        .args(args)
        .stdin(if stdin.is_some() {
            Stdio::piped()
        } else {
            Stdio::null()
        })
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .map_err(spawn_err)?;
    if let (Some(input), Some(mut pipe)) = (stdin, child.stdin.take()) {
        pipe.write_all(input.as_bytes()).map_err(spawn_err)?;
    }
    let out = child.wait_with_output().map_err(spawn_err)?;
    if !out.status.success() {
        return Err(CleanupError::Failed {
            scope: scope.to_string(),
            command,
            status: out.status.to_string(),
            stderr: String::from_utf8_lossy(&out.stderr).trim().to_string(),
        });
    }
    Ok(String::from_utf8_lossy(&out.stdout).into_owned())
}

/// Records a failed read: a missing tool or kernel feature is a note, anything else an
/// error.
fn skip_or_fail(report: &mut Report, e: CleanupError, what_is_skipped: &str) {
    if e.is_missing_tool() || e.is_unavailable_backend() {
        report
            .notes
            .push(format!("{what_is_skipped} not checked: {e}"));
    } else {
        report.errors.push(e);
    }
}

// ---------------------------------------------------------------------------------------
// iptables

/// One iptables tool set (`iptables-nft-save`, `iptables-nft-restore`, ...).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Backend {
    /// `iptables` or `ip6tables`.
    pub tool: &'static str,
    /// `legacy` or `nft`.
    pub mode: &'static str,
}

/// Every backend kube-proxy may have written to.
pub const BACKENDS: [Backend; 4] = [
    Backend {
        tool: "iptables",
        mode: "legacy",
    },
    Backend {
        tool: "iptables",
        mode: "nft",
    },
    Backend {
        tool: "ip6tables",
        mode: "legacy",
    },
    Backend {
        tool: "ip6tables",
        mode: "nft",
    },
];

impl Backend {
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

    fn line(&self) -> String {
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
fn split_words(spec: &str) -> Vec<String> {
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

fn clean_iptables(
    backend: Backend,
    opts: &CleanupOptions,
    report: &mut Report,
    kept_set_refs: &mut BTreeSet<String>,
) {
    let name = backend.name();
    let tables: Vec<&str> = if backend.mode == "legacy" {
        // Reading a legacy table that does not exist creates it: read only those the
        // kernel lists for this namespace.
        match fs::read_to_string(backend.legacy_tables_file()) {
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
                    backend.legacy_tables_file()
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

// ---------------------------------------------------------------------------------------
// nftables

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

fn clean_nftables(opts: &CleanupOptions, report: &mut Report) {
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

// ---------------------------------------------------------------------------------------
// IPVS, kube-ipvs0, ipsets

/// A network interface with its kind and addresses (`ip -j -d addr show`).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Link {
    pub name: String,
    /// `linkinfo.info_kind` (`dummy`, `veth`, ...), empty for plain devices.
    pub kind: String,
    pub addrs: Vec<IpAddr>,
}

/// Parses `ip -j -d addr show`.
pub fn parse_links(json: &str) -> Result<Vec<Link>, String> {
    let v: serde_json::Value = serde_json::from_str(json).map_err(|e| e.to_string())?;
    let list = v.as_array().ok_or("not a JSON list")?;
    Ok(list
        .iter()
        .map(|l| Link {
            name: l["ifname"].as_str().unwrap_or_default().to_string(),
            kind: l["linkinfo"]["info_kind"]
                .as_str()
                .unwrap_or_default()
                .to_string(),
            addrs: l["addr_info"]
                .as_array()
                .map(|a| {
                    a.iter()
                        .filter_map(|i| i["local"].as_str()?.parse().ok())
                        .collect()
                })
                .unwrap_or_default(),
        })
        .collect())
}

fn read_links(report: &mut Report) -> Option<Vec<Link>> {
    let scope = "ip";
    match run(scope, "ip", &["-j", "-d", "addr", "show"], None) {
        Ok(json) => match parse_links(&json) {
            Ok(links) => Some(links),
            Err(detail) => {
                report.errors.push(CleanupError::Unreadable {
                    scope: scope.into(),
                    detail: format!("`ip -j -d addr show`: {detail}"),
                });
                None
            }
        },
        Err(e) => {
            skip_or_fail(report, e, IPVS_LINK);
            None
        }
    }
}

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

fn read_ipsets(report: &mut Report) -> Option<IpSets> {
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

/// One IPVS virtual service (fwmark services are never kube-proxy's and not listed).
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub struct VirtualService {
    /// `tcp`, `udp` or `sctp`.
    pub proto: String,
    pub addr: IpAddr,
    pub port: u16,
}

impl VirtualService {
    /// `10.96.0.1:443` or `[fd00::1]:443`, as ipvsadm takes it.
    pub fn endpoint(&self) -> String {
        match self.addr {
            IpAddr::V4(a) => format!("{a}:{}", self.port),
            IpAddr::V6(a) => format!("[{a}]:{}", self.port),
        }
    }

    fn proto_flag(&self) -> &'static str {
        match self.proto.as_str() {
            "udp" => "-u",
            "sctp" => "--sctp-service",
            _ => "-t",
        }
    }
}

impl fmt::Display for VirtualService {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{} {}", self.proto.to_uppercase(), self.endpoint())
    }
}

/// Parses `ipvsadm -Sn`: the `-A` lines of TCP, UDP and SCTP services.
pub fn parse_ipvsadm_save(text: &str) -> Vec<VirtualService> {
    text.lines()
        .filter_map(|l| {
            let mut w = l.split_whitespace();
            (w.next()? == "-A").then_some(())?;
            let proto = match w.next()? {
                "-t" | "--tcp-service" => "tcp",
                "-u" | "--udp-service" => "udp",
                "--sctp-service" => "sctp",
                _ => return None,
            };
            let (addr, port) = w.next()?.rsplit_once(':')?;
            let addr = addr.trim_start_matches('[').trim_end_matches(']');
            Some(VirtualService {
                proto: proto.to_string(),
                addr: addr.parse().ok()?,
                port: port.parse().ok()?,
            })
        })
        .collect()
}

/// Why `vs` is kube-proxy's, or `None` when it is not (see the module documentation).
pub fn ipvs_owner(
    vs: &VirtualService,
    ipvs_link_addrs: &[IpAddr],
    sets: &IpSets,
    local_addrs: &[IpAddr],
) -> Option<String> {
    if ipvs_link_addrs.contains(&vs.addr) {
        return Some(format!("address on {IPVS_LINK}"));
    }
    let entry = format!("{},{}:{}", vs.addr, vs.proto, vs.port);
    for base in SERVICE_ADDRESS_SETS {
        for name in [base.to_string(), ipv6_set_name(base)] {
            if sets
                .sets
                .get(&name)
                .is_some_and(|(_, entries)| entries.contains(&entry))
            {
                return Some(format!("in ipset {name}"));
            }
        }
    }
    if local_addrs.contains(&vs.addr) {
        for (base, proto) in NODE_PORT_SETS {
            if *proto != vs.proto {
                continue;
            }
            for name in [base.to_string(), ipv6_set_name(base)] {
                let port = vs.port.to_string();
                if sets
                    .sets
                    .get(&name)
                    .is_some_and(|(_, entries)| entries.contains(&port))
                {
                    return Some(format!("NodePort on a node address, port in ipset {name}"));
                }
            }
        }
    }
    None
}

fn read_ipvs(report: &mut Report) -> Option<Vec<VirtualService>> {
    // Without the module loaded there is nothing, and ipvsadm would try to load it.
    if fs::metadata("/proc/net/ip_vs").is_err() {
        report
            .notes
            .push("ipvs: IPVS is not loaded in this kernel (no /proc/net/ip_vs): no virtual services to check".into());
        return None;
    }
    match run("ipvs", "ipvsadm", &["-S", "-n"], None) {
        Ok(text) => Some(parse_ipvsadm_save(&text)),
        Err(e) => {
            skip_or_fail(report, e, "IPVS virtual services");
            None
        }
    }
}

/// Removes kube-proxy's virtual services; false if one could not be removed.
fn clean_ipvs(
    services: Option<Vec<VirtualService>>,
    links: Option<&Vec<Link>>,
    sets: Option<&IpSets>,
    opts: &CleanupOptions,
    report: &mut Report,
) -> bool {
    let Some(services) = services else {
        return true;
    };
    let empty = IpSets::default();
    let sets = sets.unwrap_or(&empty);
    let links = links.map(Vec::as_slice).unwrap_or_default();
    let ipvs_addrs: Vec<IpAddr> = links
        .iter()
        .filter(|l| l.name == IPVS_LINK)
        .flat_map(|l| l.addrs.iter().copied())
        .collect();
    let local_addrs: Vec<IpAddr> = links
        .iter()
        .filter(|l| l.name != IPVS_LINK)
        .flat_map(|l| l.addrs.iter().copied())
        .collect();
    let mut ok = true;
    let mut others = 0;
    for vs in &services {
        let Some(why) = ipvs_owner(vs, &ipvs_addrs, sets, &local_addrs) else {
            others += 1;
            continue;
        };
        if !opts.dry_run {
            if let Err(e) = run(
                "ipvs",
                "ipvsadm",
                &["-D", vs.proto_flag(), &vs.endpoint()],
                None,
            ) {
                report.errors.push(e);
                ok = false;
                continue;
            }
        }
        report
            .removed
            .push(Item::new("ipvs", format!("virtual service {vs} ({why})")));
    }
    if others > 0 {
        report.notes.push(format!(
            "ipvs: {others} virtual service(s) not kube-proxy's left as they are"
        ));
    }
    ok
}

fn clean_link(links: Option<&Vec<Link>>, opts: &CleanupOptions, report: &mut Report) {
    let Some(link) = links.and_then(|l| l.iter().find(|l| l.name == IPVS_LINK)) else {
        return;
    };
    if link.kind != "dummy" {
        let kind = if link.kind.is_empty() {
            "device"
        } else {
            link.kind.as_str()
        };
        report.kept.push(Item::new(
            "link",
            format!("{IPVS_LINK} is of kind {kind}, not the dummy kube-proxy creates"),
        ));
        return;
    }
    if !opts.dry_run {
        if let Err(e) = run("link", "ip", &["link", "del", IPVS_LINK], None) {
            report.errors.push(e);
            return;
        }
    }
    report.removed.push(Item::new(
        "link",
        format!("{IPVS_LINK} (dummy, {} address(es))", link.addrs.len()),
    ));
}

fn clean_ipsets(
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

#[cfg(test)]
mod tests;
