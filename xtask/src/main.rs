//! `cargo xtask`: everything a person or CI runs.
//!
//! - `setup`: installs what is missing (idempotent); every other command runs it first;
//! - `build`: release binaries `target/release/proxy-agent` and `target/release/proxyctl`;
//! - `demo`: the seed article's example live (see `demo.rs`);
//! - `bench`: the datapath and control plane against kube-proxy's modes (see `bench/`);
//! - `test`: formatting, clippy, unit and privileged integration tests (serially).
//! - `upgrade-from`: the previous release's `proxy-agent`, for the upgrade test (see
//!   `upgrade_from.rs`; `test` runs it first).

mod bench;
mod demo;
mod setup;
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
    /// Run every test: fmt and clippy checks, unit tests, privileged tests (as root).
    /// Build the previous release's `proxy-agent` for the upgrade test (reused once built).
    UpgradeFrom,
    Test {
        /// Skip `cargo fmt --check` and `cargo clippy`.
        #[arg(long)]
        no_lint: bool,
        /// Skip the quick benchmark run (`cargo xtask bench --quick`, no thresholds: it
        /// only keeps the benchmark from rotting).
        #[arg(long)]
        no_bench: bool,
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
        Cmd::UpgradeFrom => {
            setup::ensure()?;
            let bin = upgrade_from::ensure()?;
            println!("{}={}", upgrade_from::ENV, bin.display());
            Ok(())
        }
        Cmd::Test {
            no_lint,
            no_bench,
            args,
        } => {
            setup::ensure()?;
            test(no_lint, no_bench, &args)
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

fn test(no_lint: bool, no_bench: bool, args: &[String]) -> Result<()> {
    if !no_lint {
        run(cargo().args(["fmt", "--all", "--", "--check"]))?;
        run(cargo().args(["clippy", "--all-targets", "--", "-D", "warnings"]))?;
    }
    // Before the tests, so their summary stays the last line.
    if !no_bench && setup::is_root() && args.is_empty() {
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
    if !setup::is_root() {
        eprintln!(
            "warning: not root: the privileged tests will fail (they need namespaces, cgroups \
             and BPF); run `sudo -E cargo xtask test`"
        );
    }
    // Privileged tests share kernel state (cgroups, bpffs, namespaces): one at a time.
    let mut cmd = cargo();
    // The upgrade test runs the previous release's agent (tests/upgrade.rs).
    cmd.env(upgrade_from::ENV, upgrade_from::ensure()?);
    cmd.args(["test", "--workspace", "--exclude", "proxy-ebpf"]);
    cmd.args(args);
    cmd.args(["--", "--test-threads=1"]);
    run_tests(&mut cmd)
}

/// Runs `cargo test`, echoing its output, and closes with one summary line over every
/// test binary (`summary: N passed, N failed`).
fn run_tests(cmd: &mut Command) -> Result<()> {
    use std::io::{BufRead as _, BufReader};
    let args: Vec<_> = cmd.get_args().map(|a| a.to_string_lossy()).collect();
    eprintln!("+ cargo {}", args.join(" "));
    let mut child = cmd
        .stdout(std::process::Stdio::piped())
        .spawn()
        .context("starting cargo test")?;
    let stdout = child.stdout.take().context("cargo test stdout")?;
    let (mut passed, mut failed, mut ignored) = (0u64, 0u64, 0u64);
    for line in BufReader::new(stdout).lines() {
        let line = line?;
        println!("{line}");
        if let Some(rest) = line.strip_prefix("test result: ") {
            for part in rest.split([';', '.']) {
                let mut words = part.split_whitespace();
                if let (Some(n), Some(what)) = (words.next(), words.next()) {
                    let n: u64 = n.parse().unwrap_or(0);
                    match what {
                        "passed" => passed += n,
                        "failed" => failed += n,
                        "ignored" => ignored += n,
                        _ => {}
                    }
                }
            }
        }
    }
    let status = child.wait()?;
    let skipped = if ignored > 0 {
        format!(", {ignored} skipped")
    } else {
        String::new()
    };
    println!("summary: {passed} passed, {failed} failed{skipped}");
    if !status.success() || failed > 0 {
        bail!("tests failed: {status}");
    }
    if passed == 0 {
        bail!("no test ran");
    }
    Ok(())
}
