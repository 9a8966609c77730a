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
//!
//! One module per tool: [`iptables`], [`nftables`], [`ipvs`] (with `kube-ipvs0`),
//! [`ipset`]; kube-proxy's names come from the `kube-rules` crate.

mod ipset;
mod iptables;
mod ipvs;
mod nftables;

use std::{
    collections::BTreeSet,
    fmt, io,
    io::Write as _,
    process::{Command, Stdio},
};

use tracing::{info, warn};

pub use ipset::{kube_proxy_set_names, parse_ipset_save, IpSets};
pub use iptables::{
    parse_save, plan_table, restore_script, IptablesToolSet, SavedChain, SavedRule, SavedTable,
    TablePlan, IPTABLES_TOOL_SETS,
};
pub use ipvs::{ipvs_owner, parse_ipvsadm_save, parse_links, Link, VirtualService};
pub use kube_rules::{
    chains::{
        is_kube_proxy_chain, FILTER_CHAINS, MANGLE_CHAINS, NAT_CHAINS, SERVICE_CHAIN_PREFIXES,
        TABLES,
    },
    ipvs::{ipv6_set_name, IPSET_NAMES, IPVS_LINK, NODE_PORT_SETS, SERVICE_ADDRESS_SETS},
    NFT_TABLE,
};
pub use nftables::parse_nft_tables;

use ipset::{clean_ipsets, read_ipsets};
use iptables::clean_iptables;
#[cfg(test)]
use iptables::split_words;
use ipvs::{clean_ipvs, clean_link, read_ipvs, read_links};
use nftables::clean_nftables;

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
    for tools in IPTABLES_TOOL_SETS {
        clean_iptables(tools, opts, &mut report, &mut kept_set_refs);
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

#[cfg(test)]
mod tests;
