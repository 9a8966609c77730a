//! The `proxy-agent` binary's small helpers, kept out of it: flag value parsers
//! (durations, CIDR lists, the Maglev table size), the node name, kube-proxy's
//! subcommand-less command line, malloc's arenas and the log subscriber.

use std::time::Duration;

use tracing::{info, warn};

/// `--maglev-table-size`: a prime in the allowed range.
pub fn parse_table_size(s: &str) -> Result<u32, String> {
    let m: u32 = s.trim().parse().map_err(|e| format!("{s:?}: {e}"))?;
    crate::maglev::validate_table_size(m)?;
    Ok(m)
}

/// A parsed `--external-ip-cidrs` or `--dsr-trusted-cidrs`.
#[derive(Clone, Debug)]
pub struct CidrList(pub Vec<(std::net::IpAddr, u8)>);

/// `10.0.0.0/8,2001:db8::/32`, or `none`.
pub fn parse_cidrs(s: &str) -> Result<CidrList, String> {
    if s.trim() == "none" {
        return Ok(CidrList(Vec::new()));
    }
    s.split(',')
        .filter(|p| !p.trim().is_empty())
        .map(|p| {
            crate::cluster::objects::parse_cidr(p)
                .ok_or_else(|| format!("{p:?} is not a CIDR (like 10.0.0.0/8 or 2001:db8::/32)"))
        })
        .collect::<Result<Vec<_>, _>>()
        .map(CidrList)
}

/// `250ms`, `2s`, `1m`.
pub fn parse_duration(s: &str) -> Result<Duration, String> {
    let (num, unit) = s
        .find(|c: char| !c.is_ascii_digit())
        .map(|i| s.split_at(i))
        .ok_or_else(|| format!("{s:?}: missing a unit (ms, s or m)"))?;
    let n: u64 = num.parse().map_err(|_| format!("{s:?}: not a number"))?;
    match unit {
        "ms" => Ok(Duration::from_millis(n)),
        "s" => Ok(Duration::from_secs(n)),
        "m" => Ok(Duration::from_secs(60 * n)),
        _ => Err(format!("{s:?}: unknown unit (ms, s or m)")),
    }
}

pub fn node_name(flag: Option<String>) -> String {
    flag.or_else(|| {
        std::fs::read_to_string("/proc/sys/kernel/hostname")
            .ok()
            .map(|h| h.trim().to_string())
    })
    .unwrap_or_else(|| "localhost".into())
}

/// glibc's malloc: one arena (`M_ARENA_MAX`), unless `MALLOC_ARENA_MAX` is set (the
/// operator's choice wins). By default glibc gives a thread that allocates while another
/// holds the lock an arena of its own, up to 8 per CPU; the list readers decode on the
/// runtime's workers and the sync runs on the main thread, so the desired state ended
/// up spread over three or more arenas, each keeping its own free space and partly used
/// pages after the first sync. Measured with `cargo xtask bench --api` (the same binary
/// with `MALLOC_ARENA_MAX` set, docs/benchmarks.md "Where the resident memory is"):
/// VmRSS once programmed 62.1 / 52.7 / 47.2 MiB at 10,000 Services x 10 with 16 (the
/// default here) / 2 / 1 arenas, 202.8 / 194.1 / 162.0 MiB at 50,000, with no slower
/// programming (the agent's allocating work is mostly one thread at a time).
/// Must run before any other thread starts.
pub fn limit_malloc_arenas() {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    if std::env::var_os("MALLOC_ARENA_MAX").is_none() {
        // SAFETY: mallopt has no preconditions; called before other threads exist.
        unsafe {
            libc::mallopt(libc::M_ARENA_MAX, 1);
        }
    }
}

pub fn init_tracing(default: &str) {
    use std::io::IsTerminal as _;
    tracing_subscriber::fmt()
        .with_writer(std::io::stderr)
        .with_ansi(std::io::stderr().is_terminal())
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new(default)),
        )
        .init();
}

/// kube-proxy's command line has no subcommand (`kube-proxy --config=...`): one that
/// starts with a flag other than help/version is `run`'s, so kubeadm's DaemonSet
/// arguments work unchanged.
pub fn with_run_subcommand(mut argv: Vec<std::ffi::OsString>) -> Vec<std::ffi::OsString> {
    let first = argv.get(1).and_then(|a| a.to_str()).unwrap_or("");
    if first.starts_with('-') && !matches!(first, "-h" | "--help" | "-V" | "--version") {
        argv.insert(1, "run".into());
    }
    argv
}

/// Container runtimes start processes with a soft limit of 1024 descriptors; the
/// servers' connection caps, the maps, the manifests and the watches need more room.
pub fn raise_open_file_limit() {
    match super::http::raise_nofile_limit() {
        Ok((before, after)) => info!(before, after, "open file limit (RLIMIT_NOFILE, soft)"),
        Err(e) => warn!(error = %e, "raising the open file limit"),
    }
}
