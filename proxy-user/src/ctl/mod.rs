//! `proxyctl`: reads the pinned maps READ-ONLY and answers "where does traffic to this
//! address go, and why". The binary (`src/bin/proxyctl.rs`) only calls [`main`].
//!
//! - `maps`: opens every map with `BPF_OBJ_GET` + `BPF_F_RDONLY` and reads a
//!   [`Snapshot`](snapshot::Snapshot);
//! - one module per subcommand, each a pure function of a snapshot into a serde view
//!   (the stable JSON, documented in docs/proxyctl.md) and a text rendering:
//!   `services`, `backends`, `conntrack`, `stats`, `explain` (with `iptables`: the rules
//!   and chain names kube-proxy would have written), `watch`, `monitor` (the datapath's
//!   events: the one command that writes, its lease in `MONITOR`);
//! - `error`: the causes and their exit codes.

pub mod affinity;
pub mod backends;
pub mod conntrack;
pub mod ct_delete;
pub mod error;
pub mod explain;
pub mod iptables;
pub mod maps;
pub mod monitor;
mod monitor_view;
pub mod schema;
pub mod services;
pub mod snapshot;
pub mod stats;
pub mod table;
pub mod watch;

#[cfg(test)]
mod tests;

use std::{
    io::{self, IsTerminal as _, Write},
    net::{IpAddr, SocketAddr},
    path::PathBuf,
    process::ExitCode,
    time::{Duration, Instant},
};

use clap::{Parser, Subcommand, ValueEnum};
use serde::Serialize;

pub use error::{Error, Result};
pub use maps::Maps;
pub use schema::SCHEMA;
pub use snapshot::Snapshot;

use crate::pins::{PinDir, DEFAULT_PIN_PATH};

/// Output format of every listing.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum Format {
    /// Aligned columns.
    Table,
    /// More columns (ids, raw flags, timeouts).
    Wide,
    /// The stable JSON documented in docs/proxyctl.md (`watch`: one object per line).
    Json,
}

/// Command line.
#[derive(Debug, Parser)]
#[command(
    name = "proxyctl",
    version,
    about = "Show what the ebpf-proxy datapath does: services, backends, flows, counters, \
             and why traffic to an address goes where it goes. Reads the pinned maps \
             read-only; safe while proxy-agent runs.",
    after_help = "Exit codes: 0 ok, 1 read error, 2 usage, 3 nothing pinned at --pin-path, \
                  4 permission denied (run as root), 5 maps of an incompatible version."
)]
pub struct Cli {
    /// bpffs directory proxy-agent pinned its maps in.
    #[arg(long, env = "PROXY_PIN_PATH", default_value = DEFAULT_PIN_PATH, global = true)]
    pub pin_path: PathBuf,
    /// Output format (the last one given wins).
    #[arg(
        short,
        long,
        value_enum,
        default_value_t = Format::Table,
        global = true,
        overrides_with = "output"
    )]
    pub output: Format,
    #[command(subcommand)]
    pub command: Command,
}

/// `conntrack` subcommands.
#[derive(Debug, Subcommand)]
pub enum ConntrackAction {
    /// Deletes flows (both directions) by flow, backend id or service id: only with
    /// `--yes`; without it lists what would be deleted. The one write of proxyctl besides
    /// `monitor`'s lease.
    Delete(ct_delete::DeleteArgs),
}

/// Subcommands.
#[derive(Debug, Subcommand)]
pub enum Command {
    /// One row per frontend (ClusterIP, NodePort, ExternalIP, LoadBalancer) with its
    /// Service, flags and backends.
    #[command(visible_alias = "svc")]
    Services,
    /// Every backend with its state, how many frontends use it, and its connections.
    Backends,
    /// TC-translated flows (CT4/CT6): both directions, rewrites, age, packets.
    #[command(visible_alias = "ct")]
    Conntrack {
        /// Only flows with this address anywhere (source, destination, or a rewrite).
        #[arg(long, value_parser = conntrack::parse_addr)]
        addr: Option<IpAddr>,
        #[command(subcommand)]
        action: Option<ConntrackAction>,
    },
    /// Clients held to a backend by `sessionAffinity: ClientIP` (AFFINITY), and for how
    /// much longer.
    Affinity,
    /// Every outcome counter with its meaning, and connections per backend.
    Stats,
    /// How traffic to ADDRESS:PORT[/PROTO] is handled, next to kube-proxy's rules for it.
    Explain {
        /// `10.96.0.10:53/udp`, `[fd00::10]:80` (protocol defaults to tcp).
        #[arg(value_parser = explain::parse_query)]
        destination: explain::Query,
        /// One flow from outside: the client's `ADDRESS:PORT` (`198.51.100.7:40000`); says
        /// which backend that flow has (conntrack) or a new one would get (Maglev: the
        /// table's slot for its hash; else random).
        #[arg(long, value_parser = explain::parse_client)]
        from: Option<SocketAddr>,
    },
    /// A live view of connections per backend and outcome counters, with rates.
    Watch {
        /// Time between refreshes (`500ms`, `1s`, `2m`).
        #[arg(long, default_value = "1s", value_parser = watch::parse_interval)]
        interval: Duration,
        /// Stop after this many frames (default: until interrupted).
        #[arg(long)]
        iterations: Option<u64>,
    },
    /// The raw service maps, one entry per line (the writer's dump format; text only).
    Dump,
    /// Drops and new flows as the datapath reports them (`-o json`: one object per line),
    /// with the Service and the reason's meaning. Turns reporting on while it runs (a
    /// lease in MONITOR that runs out 3 s after the monitor stops, even when killed).
    Monitor(monitor::MonitorArgs),
}

fn json<T: Serialize>(out: &mut dyn Write, doc: &T) -> Result<()> {
    serde_json::to_writer_pretty(&mut *out, doc).map_err(io::Error::from)?;
    out.write_all(b"\n")?;
    Ok(())
}

fn warn(s: &Snapshot) {
    for w in &s.warnings {
        eprintln!("proxyctl: warning: skipped {w}");
    }
}

/// Runs one command, writing to `out`.
pub fn run(cli: &Cli, out: &mut dyn Write) -> Result<()> {
    let maps = Maps::open(&PinDir::new(&cli.pin_path))?;
    let wide = cli.output == Format::Wide;
    let as_json = cli.output == Format::Json;
    match &cli.command {
        Command::Services => {
            let s = maps.snapshot()?;
            warn(&s);
            let views = services::build(&s);
            if as_json {
                json(
                    out,
                    &services::ServicesDoc {
                        schema: SCHEMA,
                        services: views,
                    },
                )?;
            } else {
                out.write_all(services::render(&views, wide).as_bytes())?;
            }
        }
        Command::Backends => {
            let s = maps.snapshot()?;
            warn(&s);
            let views = backends::build(&s);
            if as_json {
                json(
                    out,
                    &backends::BackendsDoc {
                        schema: SCHEMA,
                        backends: views,
                    },
                )?;
            } else {
                out.write_all(backends::render(&views, wide).as_bytes())?;
            }
        }
        Command::Conntrack {
            action: Some(ConntrackAction::Delete(a)),
            ..
        } => {
            let mut s = maps.snapshot()?;
            warn(&s);
            s.now_ns = maps::monotonic_ns();
            let doc = ct_delete::run(&PinDir::new(&cli.pin_path), &s, a)?;
            if as_json {
                json(out, &doc)?;
            } else {
                out.write_all(ct_delete::render(&doc, wide).as_bytes())?;
            }
        }
        Command::Conntrack { addr, action: None } => {
            let s = maps.snapshot_with_flows()?;
            warn(&s);
            let doc = conntrack::build(&s, *addr);
            if as_json {
                json(out, &doc)?;
            } else {
                out.write_all(conntrack::render(&doc, wide).as_bytes())?;
            }
        }
        Command::Affinity => {
            let s = maps.snapshot_with_affinity()?;
            warn(&s);
            let doc = affinity::build(&s);
            if as_json {
                json(out, &doc)?;
            } else {
                out.write_all(affinity::render(&doc, wide).as_bytes())?;
            }
        }
        Command::Stats => {
            let s = maps.counters()?;
            warn(&s);
            let doc = stats::build(&s);
            if as_json {
                json(out, &doc)?;
            } else {
                out.write_all(stats::render(&doc).as_bytes())?;
            }
        }
        Command::Explain {
            destination: q,
            from,
        } => {
            let q = &q.with_from(*from).map_err(Error::Usage)?;
            let s = maps.snapshot_for(q.addr, q.port, q.proto, q.from)?;
            warn(&s);
            let doc = explain::explain(&s, q);
            if as_json {
                json(out, &doc)?;
            } else {
                out.write_all(explain::render(&doc, wide).as_bytes())?;
            }
        }
        Command::Watch {
            interval,
            iterations,
        } => watch_loop(&maps, cli.output, *interval, *iterations, out)?,
        Command::Monitor(a) => {
            monitor::run(&PinDir::new(&cli.pin_path), &maps, a, as_json, wide, out)?
        }
        Command::Dump => {
            if as_json {
                return Err(Error::Usage(
                    "dump prints the raw maps as text only; for JSON use `proxyctl services -o json`"
                        .into(),
                ));
            }
            let s = maps.snapshot()?;
            warn(&s);
            out.write_all(s.services.render().as_bytes())?;
        }
    }
    out.flush()?;
    Ok(())
}

fn watch_loop(
    maps: &Maps,
    format: Format,
    interval: Duration,
    iterations: Option<u64>,
    out: &mut dyn Write,
) -> Result<()> {
    let clear = format != Format::Json && io::stdout().is_terminal();
    let mut prev: Option<(Snapshot, Instant)> = None;
    for n in 1.. {
        let cur = maps.counters()?;
        let at = Instant::now();
        let f = watch::frame(
            n,
            prev.as_ref().map(|(s, t)| (s, at.duration_since(*t))),
            &cur,
        );
        if format == Format::Json {
            serde_json::to_writer(&mut *out, &f).map_err(io::Error::from)?;
            out.write_all(b"\n")?;
        } else {
            if clear {
                out.write_all(b"\x1b[H\x1b[2J")?;
            } else if n > 1 {
                out.write_all(b"\n")?;
            }
            out.write_all(watch::render(&f, interval, iterations).as_bytes())?;
        }
        out.flush()?;
        if iterations.is_some_and(|max| n >= max) {
            break;
        }
        prev = Some((cur, at));
        std::thread::sleep(interval);
    }
    Ok(())
}

/// The `proxyctl` program: parse, run, report errors with their exit codes.
pub fn main() -> ExitCode {
    let cli = Cli::parse();
    let stdout = io::stdout();
    let mut out = stdout.lock();
    match run(&cli, &mut out) {
        Ok(()) => ExitCode::SUCCESS,
        // `proxyctl services | head`: the reader went away, not an error.
        Err(Error::Output(e)) if e.kind() == io::ErrorKind::BrokenPipe => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("proxyctl: {e}");
            ExitCode::from(e.exit_code())
        }
    }
}
