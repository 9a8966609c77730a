//! The packet-table bed shared by `tc_packets.rs` and `xdp_packets.rs`: the real eBPF
//! object loaded on a per-run pin directory, the maps filled by the real writer, and
//! programs run on crafted frames through `BPF_PROG_TEST_RUN`.

use std::net::{IpAddr, SocketAddr};

use aya::programs::{SchedClassifier, TestRun, TestRunOptions, Xdp};
use proxy_common::{map_names, Reason};
use proxy_user::{bpf, loader, model::Backend, BpfMaps, Frontend, ServiceEntry, Writer};

use super::{require_root, tc::Pkt, PinDir};

pub const TC_ACT_OK: u32 = 0;
pub const TC_ACT_SHOT: u32 = 2;
pub const TC_ACT_REDIRECT: u32 = 7;
pub const XDP_DROP: u32 = 1;
pub const XDP_PASS: u32 = 2;
pub const XDP_TX: u32 = 3;
pub const XDP_REDIRECT: u32 = 4;
pub const SYN: u8 = 0x02;
pub const ACK: u8 = 0x10;
pub const RST: u8 = 0x04;
pub const LOCAL: u8 = proxy_common::backend_flags::LOCAL;

pub struct Bed {
    pub ebpf: aya::Ebpf,
    pub writer: Writer<BpfMaps>,
    pub pins: PinDir,
}

impl Bed {
    pub fn new() -> Self {
        Self::with_conntrack(loader::DEFAULT_CONNTRACK_FLOWS)
    }

    /// With conntrack tables of `flows` flows per family; the TC and XDP programs loaded
    /// (the verifier accepts them), the node 192.0.2.1 / 2001:db8:1::1.
    pub fn with_conntrack(flows: u32) -> Self {
        Self::with(flows, None)
    }

    /// With XDP's FIB answers reused for `ttl` (`xdp::FIB_HOP_TTL_NS`, 100 ms by default).
    pub fn with_fib_hop_ttl(ttl: std::time::Duration) -> Self {
        Self::with(loader::DEFAULT_CONNTRACK_FLOWS, Some(ttl))
    }

    fn with(flows: u32, fib_hop_ttl: Option<std::time::Duration>) -> Self {
        require_root();
        let pins = PinDir::new();
        let ebpf = super::progrun::load_tc_with(
            &proxy_user::pins::PinDir::new(&pins.path),
            flows,
            fib_hop_ttl,
        )
        .expect("load the object; the verifier accepts the TC and XDP programs");
        let addrs: Vec<IpAddr> = vec![
            "192.0.2.1".parse().expect("ip"),
            "2001:db8:1::1".parse().expect("ip"),
        ];
        bpf::set_node_addresses(&proxy_user::pins::PinDir::new(&pins.path), &addrs)
            .expect("node addresses");
        let writer = Writer::new(BpfMaps::open(&pins.path).expect("maps"));
        Self { ebpf, writer, pins }
    }

    /// Runs `prog` on `pkt`; returns the verdict and the packet out, parsed (which checks
    /// every checksum).
    pub fn run(&self, prog: &str, pkt: &Pkt) -> (u32, Pkt) {
        let (verdict, out) = self.run_raw(prog, &pkt.build());
        (verdict, Pkt::parse(&out))
    }

    /// Runs `prog` (a TC classifier or the XDP program) on raw frame bytes.
    pub fn run_raw(&self, prog: &str, data: &[u8]) -> (u32, Vec<u8>) {
        self.run_ctx(prog, data, None)
    }

    /// As [`Bed::run_raw`], XDP programs with `ingress_ifindex` set in their context (a
    /// device of the caller's network namespace, which the FIB lookup then starts from).
    pub fn run_ctx(&self, prog: &str, data: &[u8], ifindex: Option<u32>) -> (u32, Vec<u8>) {
        let mut out = vec![0u8; 512];
        // struct xdp_md: data, data_end, data_meta, ingress_ifindex, rx_queue_index,
        // egress_ifindex (the kernel takes only the last three from user space).
        let mut ctx = [0u8; 24];
        if let Some(i) = ifindex {
            ctx[4..8].copy_from_slice(&(data.len() as u32).to_ne_bytes());
            ctx[12..16].copy_from_slice(&i.to_ne_bytes());
        }
        let opts = TestRunOptions {
            data_in: Some(data),
            data_out: Some(&mut out),
            ctx_in: ifindex.map(|_| &ctx[..]),
            ..TestRunOptions::new()
        };
        let program = self.ebpf.program(prog).expect("program");
        let res = if prog.starts_with("xdp") {
            let p: &Xdp = program.try_into().expect("xdp");
            p.test_run(opts)
        } else {
            let p: &SchedClassifier = program.try_into().expect("classifier");
            p.test_run(opts)
        }
        .expect("test run");
        out.truncate(res.data_size_out as usize);
        (res.return_value, out)
    }

    /// An outcome counter of the TC and socket hooks (`STATS`).
    pub fn counter(&self, reason: Reason) -> u64 {
        self.writer
            .store()
            .stats()
            .expect("stats")
            .into_iter()
            .find(|(r, _)| *r == reason)
            .map(|(_, v)| v)
            .expect("counter")
    }

    /// An outcome counter of the XDP hook (`XDP_STATS`).
    pub fn xdp_counter(&self, reason: Reason) -> u64 {
        let map: aya::maps::PerCpuArray<_, u64> = aya::maps::PerCpuArray::try_from(
            self.ebpf.map(map_names::XDP_STATS).expect("XDP_STATS"),
        )
        .expect("per-CPU array");
        map.get(&(reason as u32), 0).expect("counter").iter().sum()
    }
}

pub fn sa(s: &str) -> SocketAddr {
    s.parse().expect("socket address")
}

pub fn entry(fe: Frontend, backends: &[(&str, u8)], flags: u16) -> ServiceEntry {
    ServiceEntry {
        backends: backends
            .iter()
            .map(|(a, f)| Backend {
                addr: sa(a),
                flags: *f,
            })
            .collect(),
        flags,
        ..ServiceEntry::new(fe, [])
    }
}
