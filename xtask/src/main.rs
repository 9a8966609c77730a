//! `cargo xtask`: everything a person or CI runs.
//!
//! - `setup`: installs what is missing (idempotent); every other command runs it first;
//! - `build`: release binaries `target/release/proxy-agent` and `target/release/proxyctl`;
//! - `demo`: the seed article's example live (see `demo.rs`);
//! - `bench`: the datapath and control plane against kube-proxy's modes (see `bench/`);
//! - `bench-report`: docs/benchmarks.md's tables of the committed run, from its JSON;
//! - `bench-maps`: insert cost and memory per entry of each BPF map kind (see `mapcost.rs`);
//! - `test`: formatting, clippy, unit and privileged integration tests (serially).
//! - `image`: the shipped image from `deploy/Dockerfile` with buildah, no registry
//!   needed (see `image.rs`);
//! - `upgrade-from`: the previous release's `proxy-agent`, for the upgrade test (see
//!   `upgrade_from.rs`; `test` runs it first).

mod bench;
mod demo;
mod image;
mod mapcost;
mod setup;
mod tiers;
mod upgrade_from;

use std::process::Command;

use anyhow::{bail, Context as _, Result};
use clap::{Parser, Subcommand};

#[derive(Parser)]
#[command(name = "cargo xtask", about = "Build, test and demo ebpf-proxy")]
struct Cli {
    #[command(subcommand)]
    command: Cmd,
}

#[derive(Subcommand)]
enum Cmd {
    /// Install what is missing: nightly rust-src, bpf-linker, apt packages, bpffs.
    Setup,
    /// Build everything in release mode.
    Build,
    /// The seed article's nginx-service, live: 3 pods, requests to the ClusterIP, the
    /// spread next to kube-proxy's iptables probabilities, then a scale to 4 (as root).
    Demo {
        /// Requests per pod in each round.
        #[arg(long, default_value_t = 100)]
        requests_per_pod: usize,
    },
    /// Benchmark the eBPF datapath and control plane against kube-proxy's iptables,
    /// nftables and IPVS modes at 1 to 50,000 services (as root; docs/benchmarks.md).
    Bench(bench::Args),
    /// Rewrite the tables of docs/benchmarks.md that quote the committed run
    /// (docs/bench/results.json) from that JSON.
    BenchReport,
    /// What one entry costs in each kind of BPF map on this kernel (insert ns/entry,
    /// memory per entry: fdinfo memlock and the memory cgroup's charge; as root;
    /// docs/deploy.md "Memory").
    BenchMaps(mapcost::Args),
    /// Build the shipped image (deploy/Dockerfile) with buildah, on a Debian base made
    /// locally with debootstrap unless --base names a registry image; prints its size and
    /// digest (as root).
    Image(image::Args),
    /// Run every test: fmt and clippy checks, unit tests, privileged tests (as root).
    /// Build the previous release's `proxy-agent` for the upgrade test (reused once built).
    UpgradeFrom,
    Test {
        /// Skip `cargo fmt --check` and `cargo clippy`.
        #[arg(long)]
        no_lint: bool,
        /// Skip the quick benchmark runs (`cargo xtask bench --quick` and `--api --quick`:
        /// no thresholds on figures, but any error any mode recorded fails them).
        #[arg(long)]
        no_bench: bool,
        /// Which tests: `unprivileged` (unit tests and the integration tests that need no
        /// root: what a workstation can run), `privileged` (real kernel state: namespaces,
        /// cgroups, BPF; as root, one at a time), or `all` (both, the default).
        #[arg(long, value_enum, default_value_t = Tier::All)]
        tier: Tier,
        /// Extra arguments for `cargo test` (a test name filter, say).
        #[arg(last = true)]
        args: Vec<String>,
    },
}

fn main() -> Result<()> {
    let cli = Cli::parse();
    match cli.command {
        Cmd::Setup => setup::ensure(),
        Cmd::Build => {
            setup::ensure()?;
            build()
        }
        Cmd::Demo { requests_per_pod } => {
            setup::ensure()?;
            build()?;
            demo::run(&release_dir(), requests_per_pod)
        }
        Cmd::Bench(args) => bench::main(args),
        Cmd::BenchReport => bench::headline::main(&workspace_root()),
        Cmd::BenchMaps(args) => mapcost::main(&args),
        Cmd::Image(args) => {
            setup::ensure()?;
            image::main(args)
        }
        Cmd::UpgradeFrom => {
            setup::ensure()?;
            let bin = upgrade_from::ensure()?;
            println!("{}={}", upgrade_from::ENV, bin.display());
            Ok(())
        }
        Cmd::Test {
            no_lint,
            no_bench,
            tier,
            args,
        } => {
            setup::ensure()?;
            test(no_lint, no_bench, tier, &args)
        }
    }
}

/// `cargo` with the toolchain's bin directory (bpf-linker) on PATH.
pub fn cargo() -> Command {
    let mut cmd = Command::new(std::env::var("CARGO").unwrap_or_else(|_| "cargo".into()));
    cmd.env("PATH", setup::path_with_cargo_bin());
    cmd.current_dir(workspace_root());
    cmd
}

pub fn workspace_root() -> std::path::PathBuf {
    std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .expect("xtask lives in the workspace")
        .to_path_buf()
}

/// Runs a command, failing with its name if it fails.
pub fn run(cmd: &mut Command) -> Result<()> {
    let args: Vec<_> = cmd.get_args().map(|a| a.to_string_lossy()).collect();
    eprintln!(
        "+ {} {}",
        cmd.get_program().to_string_lossy(),
        args.join(" ")
    );
    let status = cmd.status().with_context(|| format!("starting {cmd:?}"))?;
    if !status.success() {
        bail!("{cmd:?} failed: {status}");
    }
    Ok(())
}

/// Where cargo puts the release binaries: `$CARGO_TARGET_DIR/release` when set, else
/// `target/release` in the workspace.
pub fn release_dir() -> std::path::PathBuf {
    std::env::var_os("CARGO_TARGET_DIR")
        .map(std::path::PathBuf::from)
        .unwrap_or_else(|| workspace_root().join("target"))
        .join("release")
}

fn build() -> Result<()> {
    run(cargo().args(["build", "--release", "--package", "proxy-user", "--bins"]))?;
    for bin in ["proxy-agent", "proxyctl"] {
        let path = release_dir().join(bin);
        if !path.is_file() {
            bail!("{} was not built", path.display());
        }
        eprintln!("built {}", path.display());
    }
    Ok(())
}

// Long: the test command's stages in the order CI runs them (fmt, clippy, quick bench,
// image, unprivileged, privileged, summary); each is one call.
fn test(no_lint: bool, no_bench: bool, tier: Tier, args: &[String]) -> Result<()> {
    if !no_lint {
        run(cargo().args(["fmt", "--all", "--", "--check"]))?;
        run(cargo().args(["clippy", "--all-targets", "--", "-D", "warnings"]))?;
    }
    // Before the tests, so their summary stays the last line.
    if !no_bench && setup::is_root() && args.is_empty() && tier != Tier::Unprivileged {
        build()?;
        run(cargo()
            .args([
                "run",
                "--quiet",
                "--package",
                "xtask",
                "--",
                "bench",
                "--quick",
            ])
            .args(["--out", "target/bench-quick"]))?;
        // The control plane over the API (fake apiserver, paged lists, 2 agents).
        run(cargo()
            .args([
                "run",
                "--quiet",
                "--package",
                "xtask",
                "--",
                "bench",
                "--api",
                "--quick",
            ])
            .args(["--out", "target/bench-api-quick"]))?;
    }
    if !setup::is_root() && tier != Tier::Unprivileged {
        eprintln!(
            "warning: not root: the privileged tests will fail (they need namespaces, cgroups \
             and BPF); run `sudo -E cargo xtask test`, or `cargo xtask test --tier \
             unprivileged` for the tests that need no root"
        );
    }
    let privileged = tiers::privileged_tests()?;
    let mut total = Counts::default();
    if tier != Tier::Privileged {
        // Unit tests of every crate and the integration tests that need no root.
        let mut cmd = cargo();
        cmd.args([
            "test",
            "--workspace",
            "--exclude",
            "proxy-ebpf",
            "--lib",
            "--bins",
            // Every test binary runs even when one fails: the summary counts them all.
            "--no-fail-fast",
        ]);
        for t in tiers::UNPRIVILEGED {
            cmd.args(["--test", t]);
        }
        cmd.args(args);
        total.add(run_tests(&mut cmd, "unprivileged")?);
    }
    if tier != Tier::Unprivileged {
        // Privileged tests share kernel state (cgroups, bpffs, namespaces): one at a time.
        let mut cmd = cargo();
        // The upgrade test runs the previous release's agent (tests/upgrade.rs).
        cmd.env(upgrade_from::ENV, upgrade_from::ensure()?);
        // tests/memory_limit.rs measures the agent that ships: the release build (built
        // above with the benches; a no-op then).
        if setup::is_root() {
            build()?;
            cmd.env(
                "EBPF_PROXY_SHIPPED_AGENT",
                release_dir().join("proxy-agent"),
            );
        }
        // tests/daemonset_image.rs starts the shipped image: build it (about a minute
        // once the base is cached: buildah reuses the apt layer).
        // A failed build fails that test (it names the missing image), not the others.
        if setup::is_root() {
            if let Err(e) = image::main(image::Args::default()) {
                eprintln!(
                    "xtask test: building the image failed ({e:#}): tests/daemonset_image.rs \
                     will fail"
                );
                // Never an older build in its place.
                let _ = Command::new("buildah")
                    .args(["rmi", "--force", image::IMAGE])
                    .status();
            }
        }
        cmd.args(["test", "--package", "proxy-user", "--no-fail-fast"]);
        for t in &privileged {
            cmd.args(["--test", t]);
        }
        cmd.args(args);
        cmd.args(["--", "--test-threads=1"]);
        total.add(run_tests(&mut cmd, "privileged")?);
    }
    total.finish()
}

/// The test tiers `cargo xtask test` runs.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
enum Tier {
    Unprivileged,
    Privileged,
    All,
}

/// Tests counted over the `test result:` lines of one or more `cargo test` runs, less the
/// tests that reported themselves skipped (`SKIPS_ENV`).
#[derive(Clone, Debug, Default)]
struct Counts {
    passed: u64,
    failed: u64,
    ignored: u64,
    /// `name: reason` of each test that returned without running what it checks (a
    /// kernel without IPVS, say): libtest counts those as passed; here they are skipped.
    skipped: Vec<String>,
    ok: bool,
    runs: u32,
}

/// The file a test appends `name: reason` to when it skips itself
/// (`proxy-user/tests/support`'s `skipped`).
const SKIPS_ENV: &str = "EBPF_PROXY_TEST_SKIPS";

impl Counts {
    fn add(&mut self, c: Counts) {
        self.passed += c.passed;
        self.failed += c.failed;
        self.ignored += c.ignored;
        self.skipped.extend(c.skipped);
        self.ok = (self.runs == 0 || self.ok) && c.ok;
        self.runs += 1;
    }

    /// Tests that reported themselves skipped (lines of the skips file) move from
    /// passed to skipped.
    fn take_skips(&mut self, text: &str) {
        for line in text.lines().filter(|l| !l.trim().is_empty()) {
            self.skipped.push(line.trim().to_string());
            self.passed = self.passed.saturating_sub(1);
        }
    }

    /// The summary line over every test binary (`summary: N passed, N failed, N
    /// skipped`), after the reason of each skip.
    fn line(&self) -> String {
        let skipped = self.ignored + self.skipped.len() as u64;
        let skipped = if skipped > 0 {
            format!(", {skipped} skipped")
        } else {
            String::new()
        };
        format!(
            "summary: {} passed, {} failed{skipped}",
            self.passed, self.failed
        )
    }

    fn finish(self) -> Result<()> {
        for s in &self.skipped {
            println!("skipped: {s}");
        }
        println!("{}", self.line());
        if !self.ok || self.failed > 0 {
            bail!("tests failed");
        }
        if self.passed == 0 {
            bail!("no test ran");
        }
        Ok(())
    }
}

/// Runs `cargo test` for one tier, echoing its output, and counts its `test result:`
/// lines. A failing tier does not stop the next one: the summary covers both.
fn run_tests(cmd: &mut Command, tier: &str) -> Result<Counts> {
    use std::io::{BufRead as _, BufReader};
    let args: Vec<_> = cmd.get_args().map(|a| a.to_string_lossy()).collect();
    eprintln!("+ ({tier} tests) cargo {}", args.join(" "));
    let skips = std::env::temp_dir().join(format!(
        "ebpf-proxy-test-skips-{tier}-{}",
        std::process::id()
    ));
    let _ = std::fs::remove_file(&skips);
    let mut child = cmd
        .env(SKIPS_ENV, &skips)
        .stdout(std::process::Stdio::piped())
        .spawn()
        .context("starting cargo test")?;
    let stdout = child.stdout.take().context("cargo test stdout")?;
    let mut c = Counts::default();
    for line in BufReader::new(stdout).lines() {
        let line = line?;
        println!("{line}");
        if let Some(rest) = line.strip_prefix("test result: ") {
            for part in rest.split([';', '.']) {
                let mut words = part.split_whitespace();
                if let (Some(n), Some(what)) = (words.next(), words.next()) {
                    let n: u64 = n.parse().unwrap_or(0);
                    match what {
                        "passed" => c.passed += n,
                        "failed" => c.failed += n,
                        "ignored" => c.ignored += n,
                        _ => {}
                    }
                }
            }
        }
    }
    let status = child.wait()?;
    c.take_skips(&std::fs::read_to_string(&skips).unwrap_or_default());
    let _ = std::fs::remove_file(&skips);
    c.ok = status.success();
    if !c.ok {
        eprintln!("{tier} tests: cargo test exited with {status}");
    }
    Ok(c)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A test that skipped itself is counted as skipped, with its reason, not as passed.
    #[test]
    fn self_skipped_tests_are_skipped_not_passed() {
        let mut c = Counts {
            passed: 5,
            ok: true,
            ..Counts::default()
        };
        c.take_skips("ipvs_part: this kernel lacks IPVS (CONFIG_IP_VS)\n");
        let mut total = Counts::default();
        total.add(c);
        total.add(Counts {
            passed: 2,
            ignored: 1,
            ok: true,
            ..Counts::default()
        });
        assert_eq!(total.line(), "summary: 6 passed, 0 failed, 2 skipped");
        assert_eq!(
            total.skipped,
            vec!["ipvs_part: this kernel lacks IPVS (CONFIG_IP_VS)".to_string()]
        );
        assert!(total.finish().is_ok());
    }
}
