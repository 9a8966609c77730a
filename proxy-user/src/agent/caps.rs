//! Which of the capabilities the datapath needs the agent lacks, to say so when installing
//! it fails: a container started without the DaemonSet's capabilities gets "lacks CAP_BPF
//! or CAP_SYS_ADMIN (load the programs; create, pin and open maps)" instead of a bare
//! "Operation not permitted" from the kernel.
//!
//! The kernel accepts CAP_SYS_ADMIN in place of each of them (`bpf_capable()`,
//! `perfmon_capable()`, `bpf_net_capable()`), so one counts as missing only when
//! CAP_SYS_ADMIN is missing too.

/// CAP_SYS_ADMIN's number (linux/capability.h).
const SYS_ADMIN: u32 = 21;

/// The capabilities the install uses, with their numbers (linux/capability.h) and why.
const NEEDED: &[(u32, &str, &str)] = &[
    (
        39,
        "CAP_BPF",
        "load the programs; create, pin and open maps",
    ),
    (
        38,
        "CAP_PERFMON",
        "with CAP_BPF, the verifier's pointer rules these programs need",
    ),
    (12, "CAP_NET_ADMIN", "attach the cgroup and TC programs"),
];

/// The effective capability mask from `/proc/self/status` (`CapEff:`), if readable.
fn effective() -> Option<u64> {
    let status = std::fs::read_to_string("/proc/self/status").ok()?;
    parse_cap_eff(&status)
}

fn parse_cap_eff(status: &str) -> Option<u64> {
    let hex = status.lines().find_map(|l| l.strip_prefix("CapEff:"))?;
    u64::from_str_radix(hex.trim(), 16).ok()
}

/// `"; missing CAP_BPF (why), ..."` for each needed capability not in `mask`, or `""`.
fn missing_in(mask: u64) -> String {
    let has = |bit: u32| mask & (1u64 << bit) != 0;
    let missing: Vec<String> = NEEDED
        .iter()
        .filter(|(bit, _, _)| !has(*bit) && !has(SYS_ADMIN))
        .map(|(_, name, why)| format!("{name} or CAP_SYS_ADMIN ({why})"))
        .collect();
    if missing.is_empty() {
        String::new()
    } else {
        format!(
            "; this process lacks {} (the DaemonSet adds them: deploy/base/daemonset.yaml)",
            missing.join(", ")
        )
    }
}

/// What the install's error should add: the missing capabilities, or nothing.
pub fn missing_hint() -> String {
    effective().map(missing_in).unwrap_or_default()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_what_is_missing_and_why() {
        let all = (1u64 << 40) - 1;
        assert_eq!(missing_in(all), "");
        let no_bpf = all & !(1u64 << 39);
        assert_eq!(
            missing_in(no_bpf),
            "",
            "CAP_SYS_ADMIN stands in for CAP_BPF"
        );
        let hint = missing_in(no_bpf & !(1u64 << 21));
        assert!(
            hint.contains("CAP_BPF or CAP_SYS_ADMIN (load the programs"),
            "{hint}"
        );
        assert!(!hint.contains("CAP_NET_ADMIN"), "{hint}");
        assert_eq!(
            parse_cap_eff("Name:\tx\nCapEff:\t000001ffffffffff\n"),
            Some(0x1ff_ffff_ffff)
        );
    }
}
