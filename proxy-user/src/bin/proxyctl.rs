//! `proxyctl`: reads the pinned maps and shows what the datapath does.

use std::path::PathBuf;

use anyhow::{Context as _, Result};
use clap::{Parser, Subcommand};
use proxy_user::{BpfMaps, MapStore, DEFAULT_PIN_PATH};

#[derive(Parser)]
#[command(
    name = "proxyctl",
    version,
    about = "Inspect the ebpf-proxy datapath maps"
)]
struct Cli {
    /// bpffs directory the agent pinned its maps in.
    #[arg(long, env = "PROXY_PIN_PATH", default_value = DEFAULT_PIN_PATH, global = true)]
    pin_path: PathBuf,
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Every frontend with its slots and backends, as the maps hold them.
    Dump,
    /// Outcome counters and per-backend selection counts.
    Stats,
}

fn main() -> Result<()> {
    let cli = Cli::parse();
    let maps = BpfMaps::open(&cli.pin_path).with_context(|| {
        format!(
            "is proxy-agent running? looked in {}",
            cli.pin_path.display()
        )
    })?;
    match cli.command {
        Command::Dump => print!("{}", maps.dump()?.render()),
        Command::Stats => {
            for (reason, n) in maps.stats()? {
                println!("{:<24} {n}", reason.name());
            }
            for (id, n) in maps.backend_conns()? {
                println!("backend {id:<16} {n}");
            }
        }
    }
    Ok(())
}
