//! The modes the bench compares. A mode is one entry in [`all`]: it owns its stack of
//! namespaces (see `topo.rs`), says where its clients send and from which cgroup, and
//! knows how to program N services from nothing, apply one endpoint change and clear
//! everything. Adding a datapath (the TC one, say) is one more [`Mode`] in that list.
//!
//! Only the kernel-programming commands of kube-proxy's modes are timed (the rule text is
//! generated beforehand): kube-proxy's own work before those commands (watching,
//! computing the rules in Go) comes on top, so their figures are lower bounds. Our
//! agent is timed end to end, from the manifest file changing to the maps written (seen
//! from outside through its metrics and through traffic).

use std::{net::SocketAddrV4, path::PathBuf, time::Duration};

use anyhow::{bail, Result};
pub use proxy_testbed::memcg::MemCgroup;
use serde::{Deserialize, Serialize};

use super::{
    plan::{Service, TARGET_VIP},
    topo::{self, Stack},
};

mod kube_proxy;
mod socket;

pub use kube_proxy::{Iptables, IptablesVariant, Ipvs, Nftables};
pub use socket::{metric, Socket};

/// What programming took: the total and its steps (seconds).
#[derive(Clone, Debug, Default, Serialize, Deserialize)]
pub struct Timing {
    pub seconds: f64,
    pub steps: Vec<(String, f64)>,
}

impl Timing {
    fn step(&mut self, name: &str, d: Duration) {
        self.seconds += d.as_secs_f64();
        self.steps.push((name.into(), d.as_secs_f64()));
    }
}

/// What a mode's control plane reports about itself (our agent only).
#[derive(Clone, Debug, Default, Serialize, Deserialize)]
pub struct AgentFigures {
    /// Resident memory after programming (VmRSS), MiB.
    pub rss_mib: Option<f64>,
    /// The peak resident memory up to then (VmHWM), MiB.
    #[serde(default)]
    pub hwm_mib: Option<f64>,
    /// The agent's own `sync_proxy_rules_duration_seconds` for the programming sync.
    pub sync_seconds: Option<f64>,
    /// Time from starting the process to healthy (hooks loaded and attached).
    pub start_seconds: Option<f64>,
}

/// Shared by all modes: where binaries and the bench's own kernel objects are.
pub struct Ctx {
    /// The xtask binary (clients run as `xtask bench client`).
    pub exe: PathBuf,
    /// `target/release` (proxy-agent, proxyctl).
    pub bin_dir: PathBuf,
    /// The run's child cgroup.
    pub cgroup: PathBuf,
    /// The run's bpffs directory (`/sys/fs/bpf/ebpf-proxy-bench-<pid>-<n>`).
    pub pin_path: PathBuf,
    /// The agent's manifests directory.
    pub manifests: PathBuf,
}

/// How a mode's `setup` starts its reason when this machine's kernel lacks what the mode
/// needs (IPVS here): the one kind of "not available" that is not an error of the run.
pub const KERNEL_LACKS: &str = "the kernel has no ";

pub trait Mode {
    fn name(&self) -> &'static str;
    fn describe(&self) -> &'static str;
    /// Makes the mode's stack and checks its tools; `Err` = not available here (why).
    fn setup(&mut self, ctx: &Ctx) -> Result<(), String>;
    fn stack(&self) -> Option<&Stack>;
    /// The cgroup its clients must join.
    fn client_cgroup(&self, _ctx: &Ctx) -> Option<PathBuf> {
        None
    }
    /// kube-proxy's modes: the commands that load rules run in `memcg` from now on (their
    /// kernel memory, charged there, is the rules' memory); `None` stops it.
    fn charge_rules_to(&mut self, _memcg: Option<std::sync::Arc<MemCgroup>>) {}
    /// Where clients send for `port` (the ClusterIP, or the endpoints themselves).
    fn targets(&self, port: u16, endpoints: &[std::net::Ipv4Addr]) -> Vec<SocketAddrV4> {
        let _ = endpoints;
        vec![SocketAddrV4::new(TARGET_VIP, port)]
    }
    /// Whether services are programmed at all (not for `direct`).
    fn programs(&self) -> bool {
        true
    }
    /// Programs `services` from nothing; `Ok(None)` when it did not finish in `limit`.
    fn program(
        &mut self,
        ctx: &Ctx,
        services: &[Service],
        limit: Duration,
    ) -> Result<Option<Timing>>;
    /// Applies the target's endpoint change (`services` holds the new state, the target
    /// last; `old` is the target before). Returns the command's time (`Ok(None)` when it
    /// did not finish in `limit`).
    fn change(
        &mut self,
        ctx: &Ctx,
        services: &[Service],
        old: &Service,
        limit: Duration,
    ) -> Result<Option<Timing>>;
    /// After a change became visible: the mode's own account of it (seconds).
    fn change_reported(&mut self) -> Option<f64> {
        None
    }
    /// Removes every service (the next scale programs from nothing).
    fn clear(&mut self, ctx: &Ctx) -> Result<()>;
    fn agent(&self) -> Option<AgentFigures> {
        None
    }
    /// CPU time (s) the mode's control-plane process has used so far.
    fn cpu_seconds(&self) -> Option<f64> {
        None
    }
    /// Pauses (`true`) or resumes the mode's control-plane process. The datapath rounds
    /// run with it paused: kube-proxy's modes have no process at all in the bench, and
    /// our datapath needs none (the hooks and maps are pinned), so no mode's traffic
    /// competes with a control plane for the two CPUs.
    fn pause(&mut self, _paused: bool) {}
}

/// Every mode, in the order of the tables.
pub fn all() -> Vec<Box<dyn Mode>> {
    vec![
        Box::new(Direct::default()),
        Box::new(Socket::default()),
        Box::new(Socket::tc()),
        Box::new(Socket::pod()),
        Box::new(Iptables::new(IptablesVariant::Legacy)),
        Box::new(Iptables::new(IptablesVariant::Nft)),
        Box::new(Nftables::default()),
        Box::new(Ipvs::default()),
    ]
}

fn new_stack() -> Result<Stack, String> {
    Stack::new().map_err(|e| format!("making the namespaces: {e:#}"))
}

// ---------------------------------------------------------------------------------

/// The client talks to the pod IPs itself: the physical limit.
#[derive(Default)]
pub struct Direct {
    stack: Option<Stack>,
}

impl Mode for Direct {
    fn name(&self) -> &'static str {
        "direct"
    }
    fn describe(&self) -> &'static str {
        "client connects to the pod IPs (no service proxy): the physical limit"
    }
    fn setup(&mut self, _: &Ctx) -> Result<(), String> {
        self.stack = Some(new_stack()?);
        Ok(())
    }
    fn stack(&self) -> Option<&Stack> {
        self.stack.as_ref()
    }
    fn targets(&self, port: u16, endpoints: &[std::net::Ipv4Addr]) -> Vec<SocketAddrV4> {
        topo::endpoint_targets(endpoints, port)
    }
    fn programs(&self) -> bool {
        false
    }
    fn program(&mut self, _: &Ctx, _: &[Service], _: Duration) -> Result<Option<Timing>> {
        Ok(Some(Timing::default()))
    }
    fn change(
        &mut self,
        _: &Ctx,
        _: &[Service],
        _: &Service,
        _: Duration,
    ) -> Result<Option<Timing>> {
        bail!("direct has no services")
    }
    fn clear(&mut self, _: &Ctx) -> Result<()> {
        Ok(())
    }
}
