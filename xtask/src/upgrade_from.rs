//! The previous release's `proxy-agent`, for the upgrade test (`proxy-user/tests/upgrade.rs`).
//!
//! The upgrade to support is from the release before this one: [`COMMIT`] (ABI 3). Its
//! agent is built once from a `git worktree` of that commit under
//! `<target>/upgrade-from/<commit>/src` (a release build in its own target directory; the
//! registry's crates are shared through `~/.cargo`), copied to
//! `<target>/upgrade-from/<commit>/proxy-agent`, and the worktree and its target removed.
//! Later runs reuse the binary. `cargo xtask test` passes its path to the tests in
//! [`ENV`]; the upgrade test fails without it.

use std::{
    fs,
    path::{Path, PathBuf},
    process::Command,
};

use anyhow::{bail, Context as _, Result};

use crate::{cargo, run, workspace_root};

/// The previous release (ABI 3).
pub const COMMIT: &str = "5dac924629a54f5ebc88036411a7fcde8eba5382";

/// The variable the upgrade test reads the old agent's path from.
pub const ENV: &str = "EBPF_PROXY_UPGRADE_FROM_AGENT";

fn target_dir() -> PathBuf {
    match std::env::var_os("CARGO_TARGET_DIR") {
        Some(dir) => PathBuf::from(dir),
        None => workspace_root().join("target"),
    }
}

fn git(root: &Path) -> Command {
    let mut cmd = Command::new("git");
    cmd.arg("-C").arg(root);
    cmd
}

/// The old agent's path, built if missing.
// Long: one recipe: check out the old release, build it with its own lock file and
// toolchain flags, verify the binary; the steps share the paths.
pub fn ensure() -> Result<PathBuf> {
    let base = target_dir().join("upgrade-from").join(&COMMIT[..12]);
    let bin = base.join("proxy-agent");
    if bin.is_file() {
        eprintln!("previous release's agent: {} (reused)", bin.display());
        return Ok(bin);
    }
    let root = workspace_root();
    let src = base.join("src");
    let started = std::time::Instant::now();
    // The commit may be missing from a shallow clone: fetch just it.
    let have = git(&root)
        .args(["cat-file", "-e", &format!("{COMMIT}^{{commit}}")])
        .status()
        .context("running git")?
        .success();
    if !have {
        run(git(&root).args(["fetch", "--depth=1", "origin", COMMIT]))?;
    }
    if src.exists() {
        let _ = git(&root)
            .args(["worktree", "remove", "--force"])
            .arg(&src)
            .status();
        let _ = fs::remove_dir_all(&src);
    }
    run(git(&root).args(["worktree", "prune"]))?;
    fs::create_dir_all(&base).with_context(|| format!("creating {}", base.display()))?;
    run(git(&root)
        .args(["worktree", "add", "--detach"])
        .arg(&src)
        .arg(COMMIT))?;
    let old_target = base.join("target");
    // Seeded with this build's release artifacts: the registry crates the two releases
    // share (most of them) are then not compiled again, only the workspace's own crates
    // (a few minutes less on 2 cores). A copy, not the same directory, so the old build
    // never overwrites `target/release/proxy-agent`.
    let ours = target_dir().join("release");
    if ours.is_dir() {
        fs::create_dir_all(&old_target)
            .with_context(|| format!("creating {}", old_target.display()))?;
        let _ = std::process::Command::new("cp")
            .args(["-a", "--reflink=auto"])
            .arg(&ours)
            .arg(old_target.join("release"))
            .status();
    }
    let built = run(cargo()
        .current_dir(&src)
        .env("CARGO_TARGET_DIR", &old_target)
        .args([
            "build",
            "--release",
            "--locked",
            "--package",
            "proxy-user",
            "--bin",
            "proxy-agent",
        ]));
    let copied = built.and_then(|()| {
        fs::copy(old_target.join("release/proxy-agent"), &bin)
            .map(drop)
            .context("copying the old agent")
    });
    // The worktree and its build are not needed once the binary is copied.
    let _ = git(&root)
        .args(["worktree", "remove", "--force"])
        .arg(&src)
        .status();
    let _ = fs::remove_dir_all(&old_target);
    copied?;
    if !bin.is_file() {
        bail!("{} was not built", bin.display());
    }
    eprintln!(
        "built the previous release's agent ({}) in {:.0?}: {}",
        &COMMIT[..7],
        started.elapsed(),
        bin.display()
    );
    Ok(bin)
}
