//! Datapath events (`proxyctl monitor`): what one hook decided for one flow, written to
//! the `EVENTS` ring buffer while a monitor holds the lease in `MONITOR[0]`
//! ([`MonitorCtl`]), rate-limited per CPU (`MONITOR_CPU`, [`MonitorCpu`]).
//!
//! Off by default: the hooks read `MONITOR[0].lease_until_ns` and go on when it is 0 (one
//! array lookup and a branch). A monitor writes `now + LEASE_NS` (CLOCK_MONOTONIC, the
//! clock of `bpf_ktime_get_ns`) every second; the hooks honour a lease only while it is
//! in the future (by [`LEASE_TICK_SLACK_NS`]) and clear it when they find it expired, so a
//! monitor that is killed turns reporting off within `LEASE_NS` with nothing left to undo.

/// How long a monitor's lease lasts after its last refresh (it refreshes every second).
pub const LEASE_NS: u64 = 3_000_000_000;
/// The hooks read the lease with CLOCK_MONOTONIC as of the last timer tick
/// (`bpf_ktime_get_coarse_ns`, behind the precise clock by less than a tick: 10 ms at the
/// lowest `CONFIG_HZ`, 100) and end it this much early, so that a lease never outlives its
/// time (a refreshed one is seconds from its end).
pub const LEASE_TICK_SLACK_NS: u64 = 10_000_000;
/// Size of the `EVENTS` ring buffer in bytes (a power of two and a page multiple): about
/// 2,500 events of [`Event`]'s 96 bytes plus the 8-byte record header; what does not fit
/// while the reader is behind is lost, counted in [`MonitorCpu::lost_full`].
pub const RINGBUF_BYTES: u32 = 256 * 1024;
/// Default per-CPU rate limit (events per second) and burst a monitor asks for.
pub const DEFAULT_RATE: u32 = 1000;
pub const DEFAULT_BURST: u32 = 200;

/// `Event::kind` and the bits of `MonitorCtl::types`.
pub mod event_kind {
    /// A packet dropped or refused (a connect() failed, a REJECT answer sent).
    pub const DROP: u8 = 1;
    /// A new flow translated (DNAT, SNAT) or rebalanced.
    pub const TRANSLATE: u8 = 2;
}

/// `Event::hook`: which program reported.
pub mod event_hook {
    /// `cgroup/connect4/6`.
    pub const CONNECT: u8 = 1;
    /// `cgroup/sendmsg4/6` (unconnected UDP).
    pub const SENDMSG: u8 = 2;
    /// `tc_ingress`.
    pub const TC_INGRESS: u8 = 3;
    /// `tc_egress`.
    pub const TC_EGRESS: u8 = 4;
    /// `xdp_ingress`.
    pub const XDP: u8 = 5;

    /// A stable name for the CLI.
    pub const fn name(h: u8) -> &'static str {
        match h {
            CONNECT => "connect",
            SENDMSG => "sendmsg",
            TC_INGRESS => "tc_ingress",
            TC_EGRESS => "tc_egress",
            XDP => "xdp",
            _ => "unknown",
        }
    }
}

/// A flow's addresses and ports as one hook saw them (network byte order; IPv4 in word 0).
/// The socket hooks see no source (`connect()` has not bound yet): zero.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct EventTuple {
    pub saddr: [u32; 4],
    pub daddr: [u32; 4],
    pub sport: u16,
    pub dport: u16,
}

/// One event in `EVENTS`.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Event {
    /// CLOCK_MONOTONIC when it happened, at the last tick (`bpf_ktime_get_coarse_ns`:
    /// up to one tick early; the ring buffer keeps the order).
    pub ts_ns: u64,
    /// The `Reason` (outcome), as counted in `STATS` / `XDP_STATS`.
    pub reason: u32,
    /// The frontend's service id (`REVNAT4/6`), 0 when not known (socket hooks: the CLI
    /// names the Service from the frontend address).
    pub service_id: u32,
    /// The backend id chosen (0: none).
    pub backend_id: u32,
    /// `event_hook::*`.
    pub hook: u8,
    /// `event_kind::*`.
    pub kind: u8,
    /// 4 or 6.
    pub family: u8,
    /// IP protocol number.
    pub proto: u8,
    /// The packet (or `connect()` destination) as it came.
    pub before: EventTuple,
    /// As it left: destination the backend, source the SNAT address when SNATed; equal to
    /// `before` for a drop.
    pub after: EventTuple,
}

/// `MONITOR[0]`: the monitor's lease and what it asked for, written by `proxyctl monitor`.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct MonitorCtl {
    /// Reporting is on while `bpf_ktime_get_ns() < lease_until_ns`; 0: off.
    pub lease_until_ns: u64,
    /// Nanoseconds of credit one event costs (1e9 / per-CPU rate).
    pub cost_ns: u64,
    /// Credit a CPU may bank (burst x `cost_ns`).
    pub burst_ns: u64,
    /// `event_kind` bits wanted.
    pub types: u32,
    /// Report one in `sample` events (0 and 1: every one).
    pub sample: u32,
}

/// `MONITOR_CPU[0]`, per CPU: the token bucket and what happened to the events.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct MonitorCpu {
    pub credit_ns: u64,
    pub last_ns: u64,
    /// Events written to `EVENTS`.
    pub emitted: u64,
    /// Events lost to the rate limit.
    pub lost_rate: u64,
    /// Events lost because the ring buffer was full (the reader fell behind).
    pub lost_full: u64,
    /// Events skipped by sampling (not losses: asked for).
    pub sampled_out: u64,
}
