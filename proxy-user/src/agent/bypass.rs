//! Whether the socket-LB bypass from labels runs, and with what (`crate::podbypass`):
//! the agent's flags decide.

use tracing::info;

use super::AgentOptions;
use crate::{cluster::counters::SourceCounters, pins::PinDir, podbypass::Options};

/// Whether the bypass runs (see [`bypass_options`]).
pub(super) fn bypass_on(agent: &AgentOptions) -> bool {
    use crate::socklb::SocketLb;
    agent.socket_lb_bypass.is_some()
        && !agent.pod_interfaces.is_empty()
        && matches!(agent.socket_lb, SocketLb::All | SocketLb::Tcp)
}

/// The bypass's options when it can matter: a selector is set, socket LB takes pods'
/// sockets (`all`, `tcp`) and pods have the per-packet path (`--pod-interfaces`);
/// otherwise `None`, said once.
pub(super) fn bypass_options(
    agent: &AgentOptions,
    counters: &SourceCounters,
) -> anyhow::Result<Option<Options>> {
    let Some(selector) = agent.socket_lb_bypass.clone() else {
        return Ok(None);
    };
    if !bypass_on(agent) {
        info!(
            socket_lb = agent.socket_lb.name(),
            "socket LB bypass from labels off: it needs --pod-interfaces and --socket-lb all or tcp"
        );
        return Ok(None);
    }
    let root = match &agent.cgroup {
        Some(c) => c.clone(),
        None => crate::cgroup::cgroup2_mount()?,
    };
    Ok(Some(Options {
        selector,
        root,
        pins: PinDir::new(&agent.pin_path),
        counters: counters.clone(),
        node_name: agent.node_name.clone(),
    }))
}
