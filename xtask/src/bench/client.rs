//! The load generator: a separate process (`cargo xtask bench client`, hidden), so that
//! it can join the bench's child cgroup (where our socket hooks are attached) and the
//! client pod's network namespace before it opens a socket, while the driver stays in
//! neither. It reads a [`Spec`] as JSON on stdin, prints `ready`, runs the tasks one after
//! the other and prints their results as one JSON line.
//!
//! Every loop is bounded in count and in time. Targets are only ever the bench's own
//! addresses (ClusterIPs and pod IPs inside its namespaces).
//!
//! CPUs: the endpoint servers and every sequential task run on CPU 0, the bulk sender on
//! CPU 1, the parallel clients on CPUs 0 and 1 (see [`pin`]).
//!
//! What is timed:
//! - `TcpLatency`: socket + connect + write a one-line request + read the one-line answer
//!   until the server closes (HTTP/1.0 style); one sample per connection, sequential.
//! - `UdpLatency`: a new socket per exchange (as a stub resolver does, so every exchange
//!   is a new flow for conntrack and the proxy), `sendto` + `recvfrom`.
//! - `Cps`: `threads` clients doing the TCP exchange back to back for `secs`.
//! - `Bulk`: one TCP stream writing 128 KiB buffers for `secs`, then shutdown and wait
//!   for the server's close: bytes / time.
//! - `WaitFor`: TCP exchanges every 100 µs until one is answered by `expect` (an endpoint
//!   change took effect); reports the CLOCK_MONOTONIC time it happened.

use std::{
    collections::BTreeMap,
    io::{self, BufRead as _, BufReader, Read as _, Write as _},
    net::{Shutdown, SocketAddr, SocketAddrV4, TcpStream, UdpSocket},
    path::{Path, PathBuf},
    process::{Child, ChildStdout, Command, Stdio},
    time::{Duration, Instant},
};

use anyhow::{bail, Context as _, Result};
use serde::{Deserialize, Serialize};

const CONNECT_TIMEOUT: Duration = Duration::from_secs(2);
const IO_TIMEOUT: Duration = Duration::from_secs(2);
/// Requests are bounded in count and time; no task may run longer than this.
const MAX_TASK: Duration = Duration::from_secs(120);

#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct Spec {
    /// The network namespace to run in (`/var/run/netns/NAME`).
    pub netns: PathBuf,
    /// A cgroup v2 directory to join first (the socket mode's hooks are attached there).
    pub cgroup: Option<PathBuf>,
    pub tasks: Vec<Task>,
}

#[derive(Clone, Debug, Serialize, Deserialize)]
#[serde(tag = "task", rename_all = "snake_case")]
pub enum Task {
    TcpLatency {
        targets: Vec<SocketAddrV4>,
        warmup: usize,
        count: usize,
        max_secs: f64,
    },
    UdpLatency {
        targets: Vec<SocketAddrV4>,
        warmup: usize,
        count: usize,
        max_secs: f64,
    },
    Cps {
        targets: Vec<SocketAddrV4>,
        threads: usize,
        secs: f64,
    },
    Bulk {
        target: SocketAddrV4,
        secs: f64,
    },
    WaitFor {
        targets: Vec<SocketAddrV4>,
        expect: String,
        max_secs: f64,
    },
    /// Connects once and expects "network unreachable" (nothing routes the address).
    ExpectUnreachable {
        target: SocketAddrV4,
    },
}

#[derive(Clone, Debug, Default, Serialize, Deserialize)]
pub struct Outcome {
    /// Latency samples (ns), one per exchange.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub samples_ns: Vec<u64>,
    /// Which endpoint answered, how often.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub answers: BTreeMap<String, u64>,
    pub ok: u64,
    pub errors: u64,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub first_error: Option<String>,
    /// Bytes moved (bulk).
    #[serde(default)]
    pub bytes: u64,
    /// Time the task ran.
    pub secs: f64,
    /// CLOCK_MONOTONIC (ns) when `WaitFor` saw its answer.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub seen_at_ns: Option<u64>,
}

impl Outcome {
    /// When a `WaitFor` saw its endpoint answer; else an error saying that `what` never
    /// answered, with the exchanges made and the first error.
    pub fn seen(&self, what: &str) -> Result<u64> {
        self.seen_at_ns.with_context(|| {
            format!(
                "{what} never answered ({} exchanges{})",
                self.ok,
                self.first_error
                    .as_ref()
                    .map(|e| format!(", error: {e}"))
                    .unwrap_or_default()
            )
        })
    }

    fn error(&mut self, e: impl std::fmt::Display) {
        self.errors += 1;
        if self.first_error.is_none() {
            self.first_error = Some(e.to_string());
        }
    }
}

/// CLOCK_MONOTONIC in nanoseconds: comparable between the driver and a client process.
pub fn monotonic_ns() -> u64 {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: a valid timespec to fill.
    unsafe { libc::clock_gettime(libc::CLOCK_MONOTONIC, &mut ts) };
    ts.tv_sec as u64 * 1_000_000_000 + ts.tv_nsec as u64
}

/// Number of CPUs this process may run on.
pub fn cpus() -> usize {
    std::thread::available_parallelism().map_or(1, usize::from)
}

/// Pins the calling thread to `cpu` (modulo the CPU count). Sequential exchanges run on
/// the CPU the endpoint servers are pinned to (CPU 0), so that a round's latency does
/// not depend on where the scheduler happened to put the client: on a VM a cross-CPU
/// wake-up costs tens of microseconds.
pub fn pin(cpu: usize) {
    let cpu = cpu % cpus();
    // SAFETY: a zeroed cpu_set_t is a valid empty set; CPU_SET writes within it.
    unsafe {
        let mut set: libc::cpu_set_t = std::mem::zeroed();
        libc::CPU_SET(cpu, &mut set);
        libc::sched_setaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), &set);
    }
}

/// One TCP exchange: connect, one-line request, read the answer until EOF.
fn tcp_exchange(target: SocketAddrV4) -> io::Result<String> {
    let mut s = TcpStream::connect_timeout(&SocketAddr::V4(target), CONNECT_TIMEOUT)?;
    s.set_read_timeout(Some(IO_TIMEOUT))?;
    s.write_all(b"GET /\n")?;
    let mut buf = [0u8; 64];
    let mut n = 0;
    loop {
        match s.read(&mut buf[n..])? {
            0 => break,
            k => n += k,
        }
        if n == buf.len() {
            return Err(io::Error::other("answer too long"));
        }
    }
    let answer = String::from_utf8_lossy(&buf[..n]).trim().to_string();
    if answer.is_empty() {
        return Err(io::Error::other("empty answer (connection closed)"));
    }
    Ok(answer)
}

fn udp_exchange(target: SocketAddrV4) -> io::Result<String> {
    let s = UdpSocket::bind("0.0.0.0:0")?;
    s.set_read_timeout(Some(IO_TIMEOUT))?;
    s.send_to(b"who?", target)?;
    let mut buf = [0u8; 64];
    let (n, _) = s.recv_from(&mut buf)?;
    Ok(String::from_utf8_lossy(&buf[..n]).trim().to_string())
}

fn latency(
    targets: &[SocketAddrV4],
    warmup: usize,
    count: usize,
    max_secs: f64,
    exchange: fn(SocketAddrV4) -> io::Result<String>,
) -> Outcome {
    let mut out = Outcome::default();
    if targets.is_empty() {
        out.error("no target");
        return out;
    }
    for i in 0..warmup {
        let _ = exchange(targets[i % targets.len()]);
    }
    let limit = Duration::from_secs_f64(max_secs).min(MAX_TASK);
    let start = Instant::now();
    out.samples_ns.reserve(count);
    for i in 0..count {
        if start.elapsed() > limit {
            break;
        }
        let t = Instant::now();
        match exchange(targets[i % targets.len()]) {
            Ok(answer) => {
                out.samples_ns.push(t.elapsed().as_nanos() as u64);
                out.ok += 1;
                *out.answers.entry(answer).or_default() += 1;
            }
            Err(e) => out.error(e),
        }
    }
    out.secs = start.elapsed().as_secs_f64();
    out
}

fn cps(targets: &[SocketAddrV4], threads: usize, secs: f64) -> Outcome {
    let limit = Duration::from_secs_f64(secs).min(MAX_TASK);
    let start = Instant::now();
    let handles: Vec<_> = (0..threads.max(1))
        .map(|t| {
            let targets = targets.to_vec();
            std::thread::spawn(move || {
                pin(t);
                let mut out = Outcome::default();
                let mut i = t;
                while start.elapsed() < limit && !targets.is_empty() {
                    match tcp_exchange(targets[i % targets.len()]) {
                        Ok(_) => out.ok += 1,
                        Err(e) => out.error(e),
                    }
                    i += 1;
                }
                out
            })
        })
        .collect();
    let mut out = Outcome::default();
    for h in handles {
        match h.join() {
            Ok(o) => {
                out.ok += o.ok;
                out.errors += o.errors;
                if out.first_error.is_none() {
                    out.first_error = o.first_error;
                }
            }
            Err(_) => out.error("client thread panicked"),
        }
    }
    out.secs = start.elapsed().as_secs_f64();
    out
}

fn bulk(target: SocketAddrV4, secs: f64) -> Outcome {
    let mut out = Outcome::default();
    let limit = Duration::from_secs_f64(secs).min(MAX_TASK);
    let run = || -> io::Result<(u64, f64)> {
        let mut s = TcpStream::connect_timeout(&SocketAddr::V4(target), CONNECT_TIMEOUT)?;
        s.set_write_timeout(Some(IO_TIMEOUT))?;
        s.set_read_timeout(Some(IO_TIMEOUT))?;
        let buf = vec![0x5au8; 128 * 1024];
        let start = Instant::now();
        let mut bytes = 0u64;
        while start.elapsed() < limit {
            s.write_all(&buf)?;
            bytes += buf.len() as u64;
        }
        s.shutdown(Shutdown::Write)?;
        // The server closes once it has read everything: the stream has arrived.
        let mut rest = [0u8; 16];
        while s.read(&mut rest)? > 0 {}
        Ok((bytes, start.elapsed().as_secs_f64()))
    };
    match run() {
        Ok((bytes, secs)) => {
            out.ok = 1;
            out.bytes = bytes;
            out.secs = secs;
        }
        Err(e) => out.error(e),
    }
    out
}

fn wait_for(targets: &[SocketAddrV4], expect: &str, max_secs: f64) -> Outcome {
    let mut out = Outcome::default();
    let limit = Duration::from_secs_f64(max_secs).min(MAX_TASK);
    let start = Instant::now();
    let mut i = 0;
    while start.elapsed() < limit && !targets.is_empty() {
        match tcp_exchange(targets[i % targets.len()]) {
            Ok(answer) => {
                out.ok += 1;
                if answer == expect {
                    out.seen_at_ns = Some(monotonic_ns());
                    break;
                }
            }
            Err(e) => out.error(e),
        }
        i += 1;
        std::thread::sleep(Duration::from_micros(100));
    }
    out.secs = start.elapsed().as_secs_f64();
    out
}

fn expect_unreachable(target: SocketAddrV4) -> Outcome {
    let mut out = Outcome::default();
    match TcpStream::connect_timeout(&SocketAddr::V4(target), CONNECT_TIMEOUT) {
        Err(e) if e.raw_os_error() == Some(libc::ENETUNREACH) => out.ok = 1,
        Err(e) => out.error(format!("expected \"network unreachable\", got: {e}")),
        Ok(_) => out.error("expected \"network unreachable\", but it connected"),
    }
    out
}

fn run_task(task: &Task) -> Outcome {
    // Sequential work shares CPU 0 with the servers; the bulk stream's sender gets the
    // other CPU (its packets are processed there, the server copies on CPU 0).
    pin(match task {
        Task::Bulk { .. } => 1,
        _ => 0,
    });
    match task {
        Task::TcpLatency {
            targets,
            warmup,
            count,
            max_secs,
        } => latency(targets, *warmup, *count, *max_secs, tcp_exchange),
        Task::UdpLatency {
            targets,
            warmup,
            count,
            max_secs,
        } => latency(targets, *warmup, *count, *max_secs, udp_exchange),
        Task::Cps {
            targets,
            threads,
            secs,
        } => cps(targets, *threads, *secs),
        Task::Bulk { target, secs } => bulk(*target, *secs),
        Task::WaitFor {
            targets,
            expect,
            max_secs,
        } => wait_for(targets, expect, *max_secs),
        Task::ExpectUnreachable { target } => expect_unreachable(*target),
    }
}

/// The client process: join the cgroup, enter the namespace, say `ready`, run the tasks.
pub fn main() -> Result<()> {
    let mut input = String::new();
    io::stdin().read_to_string(&mut input)?;
    let spec: Spec = serde_json::from_str(&input).context("client spec")?;
    if let Some(cg) = &spec.cgroup {
        let procs = cg.join("cgroup.procs");
        std::fs::write(&procs, std::process::id().to_string())
            .with_context(|| format!("joining {}", procs.display()))?;
    }
    let ns = std::fs::File::open(&spec.netns)
        .with_context(|| format!("opening {}", spec.netns.display()))?;
    // SAFETY: a namespace fd we opened; the process is still single-threaded.
    if unsafe { libc::setns(std::os::fd::AsRawFd::as_raw_fd(&ns), libc::CLONE_NEWNET) } != 0 {
        bail!(
            "setns {}: {}",
            spec.netns.display(),
            io::Error::last_os_error()
        );
    }
    let mut stdout = io::stdout().lock();
    writeln!(stdout, "ready")?;
    stdout.flush()?;
    let results: Vec<Outcome> = spec.tasks.iter().map(run_task).collect();
    writeln!(stdout, "{}", serde_json::to_string(&results)?)?;
    Ok(())
}

/// A running client process (driver side).
pub struct Client {
    child: Child,
    stdout: BufReader<ChildStdout>,
    started: Instant,
}

impl Client {
    /// Starts `exe bench client` with `spec` and waits for its `ready`.
    pub fn start(exe: &Path, spec: &Spec) -> Result<Self> {
        let mut child = Command::new(exe)
            .args(["bench", "client"])
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .with_context(|| format!("starting {} bench client", exe.display()))?;
        let mut stdin = child.stdin.take().context("client stdin")?;
        stdin.write_all(serde_json::to_string(spec)?.as_bytes())?;
        drop(stdin);
        let stdout = BufReader::new(child.stdout.take().context("client stdout")?);
        let mut client = Self {
            child,
            stdout,
            started: Instant::now(),
        };
        let mut line = String::new();
        client.stdout.read_line(&mut line)?;
        if line.trim() != "ready" {
            let err = client.stderr();
            bail!("bench client did not start: {line:?} {err}");
        }
        Ok(client)
    }

    fn stderr(&mut self) -> String {
        let _ = self.child.wait();
        let mut err = String::new();
        if let Some(mut e) = self.child.stderr.take() {
            let _ = e.read_to_string(&mut err);
        }
        err
    }

    /// Waits for the results (one per task).
    pub fn finish(mut self) -> Result<Vec<Outcome>> {
        let mut line = String::new();
        self.stdout.read_line(&mut line)?;
        if line.trim().is_empty() {
            let err = self.stderr();
            bail!(
                "bench client ended without results after {:?}: {err}",
                self.started.elapsed()
            );
        }
        let status = self.child.wait()?;
        if !status.success() {
            bail!("bench client failed: {status}");
        }
        Ok(serde_json::from_str(&line)?)
    }

    /// Runs a spec to the end.
    pub fn run(exe: &Path, spec: &Spec) -> Result<Vec<Outcome>> {
        Self::start(exe, spec)?.finish()
    }
}

impl Drop for Client {
    fn drop(&mut self) {
        // Only reached with the process still running when a result was never read
        // (an error on the driver side): end our own child, by pid.
        if matches!(self.child.try_wait(), Ok(None)) {
            let _ = self.child.kill();
            let _ = self.child.wait();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn specs_round_trip_as_json() {
        let spec = Spec {
            netns: "/var/run/netns/x".into(),
            cgroup: None,
            tasks: vec![
                Task::TcpLatency {
                    targets: vec!["10.96.0.10:80".parse().expect("addr")],
                    warmup: 1,
                    count: 2,
                    max_secs: 1.0,
                },
                Task::ExpectUnreachable {
                    target: "10.96.0.10:80".parse().expect("addr"),
                },
            ],
        };
        let text = serde_json::to_string(&spec).expect("json");
        assert!(text.contains("\"task\":\"tcp_latency\""), "{text}");
        let back: Spec = serde_json::from_str(&text).expect("parse");
        assert_eq!(back.tasks.len(), 2);
    }
}
