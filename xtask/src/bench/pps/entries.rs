//! The entries of the packet-rate tables: the datapath bench's own modes, plus `xdp-fwd`
//! ([`XdpFwd`], plain XDP forwarding), each with our agent's pin directory and why it
//! cannot run in this build, if so.

use std::{net::Ipv4Addr, path::PathBuf, process::Command, time::Duration};

use anyhow::Result;

use super::results::Form;
use crate::bench::{
    modes::{self, Ctx, Mode, Timing},
    plan::Service,
    topo::Stack,
};

/// Whether this build's agent has `--acceleration` (XDP).
fn agent_has_xdp(ctx: &Ctx) -> bool {
    Command::new(ctx.bin_dir.join("proxy-agent"))
        .args(["run", "--help"])
        .output()
        .map(|o| String::from_utf8_lossy(&o.stdout).contains("--acceleration"))
        .unwrap_or(false)
}

/// Plain XDP forwarding, next hop fixed: `direct`'s stack, with `fixed_forward_program` attached to
/// `cli0` by [`prepare`]; the frames go to the pod IP.
#[derive(Default)]
struct XdpFwd(modes::Direct);

impl Mode for XdpFwd {
    fn name(&self) -> &'static str {
        "xdp-fwd"
    }
    fn describe(&self) -> &'static str {
        "plain XDP forwarding to the pod IP, next hop fixed (TTL, MACs, bpf_redirect; no FIB lookup, no NAT): the XDP ceiling"
    }
    fn setup(&mut self, ctx: &Ctx) -> Result<(), String> {
        self.0.setup(ctx)
    }
    fn stack(&self) -> Option<&Stack> {
        self.0.stack()
    }
    fn targets(&self, port: u16, endpoints: &[Ipv4Addr]) -> Vec<std::net::SocketAddrV4> {
        self.0.targets(port, endpoints)
    }
    fn programs(&self) -> bool {
        false
    }
    fn program(&mut self, ctx: &Ctx, s: &[Service], l: Duration) -> Result<Option<Timing>> {
        self.0.program(ctx, s, l)
    }
    fn change(
        &mut self,
        ctx: &Ctx,
        s: &[Service],
        old: &Service,
        l: Duration,
    ) -> Result<Option<Timing>> {
        self.0.change(ctx, s, old, l)
    }
    fn clear(&mut self, ctx: &Ctx) -> Result<()> {
        self.0.clear(ctx)
    }
}

/// One entry of a table: the mode, our agent's pin directory (for its counters), and
/// why it cannot run in this build, if so.
pub(super) struct Entry {
    pub(super) mode: Box<dyn Mode>,
    pub(super) pins: Option<PathBuf>,
    pub(super) unavailable: Option<String>,
}

/// The modes of one form, in the table's order.
pub(super) fn pps_modes(ctx: &Ctx, form: Form) -> Vec<Entry> {
    let has_xdp = agent_has_xdp(ctx);
    let plain = |mode: Box<dyn Mode>| Entry {
        mode,
        pins: None,
        unavailable: None,
    };
    let ours = |s: modes::Socket, xdp: bool| Entry {
        pins: Some(s.pin_path(ctx)),
        unavailable: (xdp && !has_xdp).then(|| {
            "not available in this build (proxy-agent run has no --acceleration)".to_string()
        }),
        mode: Box::new(s),
    };
    let mut v = vec![plain(Box::<modes::Direct>::default())];
    if form == Form::Remote {
        v.push(plain(Box::<XdpFwd>::default()));
    }
    v.push(plain(Box::new(modes::Iptables::new(
        modes::IptablesVariant::Legacy,
    ))));
    v.push(plain(Box::<modes::Nftables>::default()));
    v.push(ours(modes::Socket::tc(), false));
    v.push(ours(modes::Socket::xdp(), true));
    if form == Form::Remote {
        v.push(ours(modes::Socket::xdp_maglev(), true));
    }
    v
}
