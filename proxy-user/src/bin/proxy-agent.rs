//! `proxy-agent`: installs the eBPF datapath and keeps its maps in step with the cluster.

use std::path::PathBuf;

use anyhow::{Context as _, Result};
use clap::{Parser, Subcommand};
use proxy_user::{loader, DEFAULT_PIN_PATH};

#[derive(Parser)]
#[command(
    name = "proxy-agent",
    version,
    about = "eBPF replacement for kube-proxy"
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Load and attach the socket hooks (or adopt pinned ones) and exit; the datapath
    /// keeps running from its pins.
    Install {
        /// bpffs directory for maps and links.
        #[arg(long, env = "PROXY_PIN_PATH", default_value = DEFAULT_PIN_PATH)]
        pin_path: PathBuf,
        /// cgroup v2 directory to attach the socket hooks to (default: the root of the
        /// host's cgroup2 mount).
        #[arg(long, env = "PROXY_CGROUP")]
        cgroup: Option<PathBuf>,
    },
    /// Detach every hook and remove every pin under the pin path.
    Uninstall {
        #[arg(long, env = "PROXY_PIN_PATH", default_value = DEFAULT_PIN_PATH)]
        pin_path: PathBuf,
    },
}

fn main() -> Result<()> {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info")),
        )
        .init();
    match Cli::parse().command {
        Command::Install { pin_path, cgroup } => {
            let r = loader::install(&loader::InstallOptions {
                pin_path: pin_path.clone(),
                cgroup,
            })
            .with_context(|| format!("installing the datapath at {}", pin_path.display()))?;
            println!(
                "attached {} hook(s), adopted {} pinned hook(s) at {}",
                r.attached.len(),
                r.adopted.len(),
                pin_path.display()
            );
        }
        Command::Uninstall { pin_path } => {
            let r = loader::uninstall(&pin_path)
                .with_context(|| format!("removing the datapath at {}", pin_path.display()))?;
            println!(
                "removed {} link(s) and {} map(s) from {}",
                r.links.len(),
                r.maps.len(),
                pin_path.display()
            );
        }
    }
    Ok(())
}
