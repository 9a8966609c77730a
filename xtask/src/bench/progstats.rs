//! The kernel's run-time statistics of an attached program (`BPF_ENABLE_STATS`, what
//! `bpftool prog` prints as `run_time_ns` / `run_cnt`): the packet-rate part divides the
//! program's time by its runs over a measured interval, the program's own cost per
//! packet under the real flood (warm caches, the real path), which `BPF_PROG_RUN` of one
//! packet per call cannot give for a conntrack hit. The program is found from the
//! agent's pinned link (`<pins>/links/xdp-<iface>`, `links/tc-<iface>-ingress`), so
//! programs of the same name loaded by anything else on the machine are not counted.
//!
//! The `bpf(2)` calls are `bpf_sys`'s (std and libc only: xtask does not link aya, setup
//! must build without the eBPF toolchain).

use std::{
    io,
    os::fd::{AsFd as _, OwnedFd},
    path::Path,
};

/// Run-time statistics are collected for every program while this is alive.
pub struct StatsOn(#[allow(dead_code)] OwnedFd);

pub fn enable() -> io::Result<StatsOn> {
    bpf_sys::enable_stats().map(StatsOn)
}

/// The program id behind a pinned link.
pub fn linked_prog_id(link_pin: &Path) -> io::Result<u32> {
    let link = bpf_sys::obj_get(link_pin, 0)
        .map_err(|e| io::Error::new(e.kind(), format!("{}: {e}", link_pin.display())))?;
    link_prog_id(&link)
}

/// The program id behind a link we hold an fd of.
pub fn link_prog_id(link: &OwnedFd) -> io::Result<u32> {
    Ok(bpf_sys::link_info(link.as_fd())?.prog_id)
}

/// (ns, runs) of program `id` so far.
pub fn run_stats(id: u32) -> io::Result<(u64, u64)> {
    let prog = bpf_sys::prog_get_fd_by_id(id)?;
    bpf_sys::prog_run_stats(prog.as_fd())
}

/// The program's ns per run between two `run_stats` readings, and the runs.
pub fn per_run(before: (u64, u64), after: (u64, u64)) -> Option<(f64, u64)> {
    let runs = after.1.checked_sub(before.1)?;
    (runs > 0).then(|| (after.0.saturating_sub(before.0) as f64 / runs as f64, runs))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn per_run_divides_the_interval() {
        assert_eq!(per_run((1_000, 10), (4_000, 40)), Some((100.0, 30)));
        assert_eq!(per_run((1_000, 10), (1_000, 10)), None);
        assert_eq!(per_run((1_000, 10), (0, 5)), None);
    }
}
