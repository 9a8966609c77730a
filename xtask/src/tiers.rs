//! The test tiers of `cargo xtask test`: what needs no root, and what does. Every
//! integration test file of `proxy-user/tests/` is in exactly one tier: the unprivileged
//! ones are named here, every other file is privileged (a new test is privileged until it
//! is named here, so a root-only test can never land in the tier a workstation runs).

use anyhow::{bail, Context as _, Result};

use crate::workspace_root;

/// Integration tests that need no root: files, loopback HTTP, the heap.
pub const UNPRIVILEGED: &[&str] = &[
    "apiserver_selftest",
    "deploy_manifests",
    "desired_state_memory",
    "docs_agree",
    "kubectl",
    "loader_btf",
    "structure",
];

/// `proxy-user/tests/*.rs` less [`UNPRIVILEGED`]: real kernel state (namespaces, cgroups,
/// bpffs, BPF programs), run as root one at a time.
pub fn privileged_tests() -> Result<Vec<String>> {
    let dir = workspace_root().join("proxy-user/tests");
    let mut all = Vec::new();
    for entry in std::fs::read_dir(&dir).with_context(|| format!("reading {}", dir.display()))? {
        let path = entry?.path();
        if path.extension().is_some_and(|e| e == "rs") {
            if let Some(stem) = path.file_stem().and_then(|s| s.to_str()) {
                all.push(stem.to_string());
            }
        }
    }
    for name in UNPRIVILEGED {
        if !all.iter().any(|t| t == name) {
            bail!(
                "tiers.rs names {name}, which is not a file in {}",
                dir.display()
            );
        }
    }
    all.retain(|t| !UNPRIVILEGED.contains(&t.as_str()));
    all.sort();
    Ok(all)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_test_file_is_in_one_tier() {
        let privileged = privileged_tests().expect("tiers");
        assert!(
            privileged.iter().any(|t| t == "socket_lb"),
            "{privileged:?}"
        );
        assert!(privileged.iter().any(|t| t == "upgrade"), "{privileged:?}");
        for t in UNPRIVILEGED {
            assert!(!privileged.iter().any(|p| p == t), "{t} in both tiers");
        }
    }
}
