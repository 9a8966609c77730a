//! The TC and XDP programs under `BPF_PROG_TEST_RUN`, loaded by the real loader on a pin
//! directory, and crafted packets for them ([`pkt`]): shared by the tests
//! (`tests/support` re-exports both; `tc_packets.rs`, `xdp_packets.rs` verdict tables) and
//! `bench-prog-run` (ns per packet). Behind the `prog-run` feature (on by default; the
//! agent does not use it).

pub mod pkt;

use crate::pins::PinDir;

use aya::programs::{SchedClassifier, TestRun, TestRunOptions};

use crate::loader;

/// The TC programs every run loads.
pub const TC_PROGRAMS: [&str; 2] = proxy_common::prog_names::TC;

/// The XDP program (`--acceleration`).
pub const XDP_PROGRAM: &str = proxy_common::prog_names::XDP_INGRESS;

/// The object loaded with its maps pinned under `pins` (conntrack tables of `flows`
/// flows per family), both TC programs and the XDP program through the verifier.
pub fn load_tc(pins: &PinDir, flows: u32) -> anyhow::Result<aya::Ebpf> {
    load_tc_with(pins, flows, None)
}

/// [`load_tc`] with XDP's FIB-answer TTL set to `fib_hop_ttl` (`None`: 100 ms).
pub fn load_tc_with(
    pins: &PinDir,
    flows: u32,
    fib_hop_ttl: Option<std::time::Duration>,
) -> anyhow::Result<aya::Ebpf> {
    let entries = loader::conntrack_entries(flows)?;
    let mut ebpf =
        loader::load_object_with(pins, entries, loader::DEFAULT_SERVICE_ENTRIES, fib_hop_ttl)?;
    load_tc_programs(&mut ebpf)?;
    Ok(ebpf)
}

/// The programs of a conntrack resize, as `migrate` loads them: the object with the
/// `CT_FALLBACK` global set against the maps pinned under `pins`, where the caller has
/// pinned the tables being replaced as `CT4_PREV`/`CT6_PREV` (the new `CT4`/`CT6` of
/// `flows` flows per family, made here unless pinned); both TC programs and the XDP
/// program through the verifier.
pub fn load_tc_resizing(pins: &PinDir, flows: u32) -> anyhow::Result<aya::Ebpf> {
    if loader::EBPF_OBJECT.is_empty() {
        anyhow::bail!("built without the eBPF object");
    }
    let entries = loader::conntrack_entries(flows)?;
    let mut l = aya::EbpfLoader::new();
    l.default_map_pin_directory(pins.path());
    for map in loader::SizedMap::Conntrack.maps() {
        l.map_max_entries(map, entries);
    }
    l.override_global(loader::CT_FALLBACK_GLOBAL, &1u8, true);
    let mut ebpf = l.load(loader::EBPF_OBJECT)?;
    load_tc_programs(&mut ebpf)?;
    Ok(ebpf)
}

/// Both TC programs and the XDP program of `ebpf` through the verifier.
fn load_tc_programs(ebpf: &mut aya::Ebpf) -> anyhow::Result<()> {
    for name in TC_PROGRAMS {
        let prog: &mut SchedClassifier = ebpf
            .program_mut(name)
            .ok_or_else(|| anyhow::anyhow!("no program {name}"))?
            .try_into()?;
        prog.load().map_err(|e| anyhow::anyhow!("{name}: {e}"))?;
    }
    let prog: &mut aya::programs::Xdp = ebpf
        .program_mut(XDP_PROGRAM)
        .ok_or_else(|| anyhow::anyhow!("no program {XDP_PROGRAM}"))?
        .try_into()?;
    prog.load()
        .map_err(|e| anyhow::anyhow!("{XDP_PROGRAM}: {e}"))?;
    Ok(())
}

/// One `BPF_PROG_TEST_RUN` of `prog` (a TC classifier or the XDP program) on `data`, `repeat` times (the same
/// skb each time: what the program writes stays for the next repetition).
pub struct Run {
    pub verdict: u32,
    pub out: Vec<u8>,
    /// The kernel's average per repetition (ns).
    pub duration_ns: u32,
}

pub fn run_classifier(
    ebpf: &aya::Ebpf,
    prog: &str,
    data: &[u8],
    repeat: u32,
) -> anyhow::Result<Run> {
    let program = ebpf
        .program(prog)
        .ok_or_else(|| anyhow::anyhow!("no program {prog}"))?;
    let mut out = vec![0u8; 512];
    let opts = TestRunOptions {
        data_in: Some(data),
        data_out: Some(&mut out),
        repeat,
        ..TestRunOptions::new()
    };
    let res = if prog == XDP_PROGRAM {
        let p: &aya::programs::Xdp = program.try_into()?;
        p.test_run(opts)?
    } else {
        let p: &SchedClassifier = program.try_into()?;
        p.test_run(opts)?
    };
    out.truncate(res.data_size_out as usize);
    Ok(Run {
        verdict: res.return_value,
        out,
        duration_ns: res.duration.as_nanos() as u32,
    })
}
