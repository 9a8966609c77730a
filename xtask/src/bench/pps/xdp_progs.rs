//! Raw `bpf(2)` for the packet-rate bench's own small XDP programs (no object file):
//! the generator (`BPF_PROG_RUN` live frames), the pod's `XDP_DROP` sink and `xdp-fwd`'s
//! plain forwarding to a fixed next hop, loaded and attached by link.

use std::os::fd::{AsRawFd as _, FromRawFd as _, OwnedFd};

use anyhow::{bail, Context as _, Result};

use crate::bench::progstats::Attr;

pub(super) const BPF_PROG_LOAD: i64 = 5;
pub(super) const BPF_PROG_TEST_RUN: i64 = 10;
pub(super) const BPF_LINK_CREATE: i64 = 28;
pub(super) const BPF_PROG_TYPE_XDP: u32 = 6;
pub(super) const BPF_XDP: u32 = 37;
pub(super) const XDP_FLAGS_DRV_MODE: u32 = 1 << 2;
pub(super) const BPF_F_TEST_XDP_LIVE_FRAMES: u32 = 1 << 1;
pub(super) const BPF_FUNC_REDIRECT: i32 = 23;
pub(super) const XDP_DROP: i32 = 1;
pub(super) const XDP_PASS: i32 = 2;

pub(super) type Insn = [u8; 8];

pub(super) fn insn(code: u8, dst: u8, src: u8, off: i16, imm: i32) -> Insn {
    let mut i = [0u8; 8];
    i[0] = code;
    i[1] = (src << 4) | (dst & 0xf);
    i[2..4].copy_from_slice(&off.to_le_bytes());
    i[4..8].copy_from_slice(&imm.to_le_bytes());
    i
}
pub(super) fn mov_imm(dst: u8, imm: i32) -> Insn {
    insn(0xb7, dst, 0, 0, imm) // BPF_ALU64 | BPF_MOV | BPF_K
}
pub(super) fn call(helper: i32) -> Insn {
    insn(0x85, 0, 0, 0, helper) // BPF_JMP | BPF_CALL
}
pub(super) fn exit() -> Insn {
    insn(0x95, 0, 0, 0, 0) // BPF_JMP | BPF_EXIT
}

/// `xdp-fwd`'s program: plain XDP forwarding with the next hop fixed when it is loaded
/// (the pods' interface and MAC addresses, as a cache that never misses): for IPv4, the
/// TTL decremented (incremental checksum update), the MAC addresses rewritten to the
/// next hop's and `bpf_redirect` to its interface; anything else `XDP_PASS`. No FIB
/// lookup, no NAT, no conntrack: what any XDP forwarding of these frames costs at least,
/// so a ceiling of our XDP path (which looks its next hop up in its per-CPU cache,
/// `FIB_HOP4`, and asks the FIB only every 100 ms).
pub(super) fn fixed_forward_program(ifindex: u32, smac: [u8; 6], dmac: [u8; 6]) -> Vec<Insn> {
    /// Jump target: the `XDP_PASS` exit at the end.
    const PASS: bool = true;
    let mut p: Vec<(Insn, bool)> = vec![
        (insn(0x61, 2, 1, 0, 0), false),     // r2 = data
        (insn(0x61, 3, 1, 4, 0), false),     // r3 = data_end
        (insn(0xbf, 4, 2, 0, 0), false),     // r4 = r2
        (insn(0x07, 4, 0, 0, 34), false),    // r4 += 14 + 20
        (insn(0x2d, 4, 3, 0, 0), PASS),      // if r4 > r3: pass
        (insn(0x69, 4, 2, 12, 0), false),    // r4 = eth proto (u16)
        (insn(0x55, 4, 0, 0, 0x0008), PASS), // != htons(ETH_P_IP): pass
        // ip_decrease_ttl(): check += htons(0x0100) with end-around carry, --ttl.
        (insn(0x69, 4, 2, 24, 0), false),
        (insn(0x07, 4, 0, 0, 1), false),
        (insn(0xa5, 4, 0, 1, 0xffff), false),
        (insn(0x07, 4, 0, 0, 1), false),
        (insn(0x6b, 2, 4, 24, 0), false),
        (insn(0x71, 4, 2, 22, 0), false),
        (insn(0x07, 4, 0, 0, -1), false),
        (insn(0x73, 2, 4, 22, 0), false),
    ];
    // Ethernet destination, then source: 16-bit stores of immediates (BPF_ST | BPF_H).
    let macs: Vec<u8> = dmac.iter().chain(smac.iter()).copied().collect();
    for (i, w) in macs.chunks(2).enumerate() {
        let imm = i32::from(u16::from_ne_bytes([w[0], w[1]]));
        p.push((insn(0x6a, 2, 0, (2 * i) as i16, imm), false));
    }
    p.extend([
        (mov_imm(1, ifindex as i32), false),
        (mov_imm(2, 0), false),
        (call(BPF_FUNC_REDIRECT), false),
        (exit(), false),
    ]);
    let pass_at = p.len();
    p.push((mov_imm(0, XDP_PASS), false));
    p.push((exit(), false));
    resolve_pass(&p, pass_at)
}

/// The program with every jump marked `true` aimed at `pass_at`.
fn resolve_pass(p: &[(Insn, bool)], pass_at: usize) -> Vec<Insn> {
    p.iter()
        .enumerate()
        .map(|(at, (x, to_pass))| {
            let mut x = *x;
            if *to_pass {
                let off = (pass_at as i64 - at as i64 - 1) as i16;
                x[2..4].copy_from_slice(&off.to_le_bytes());
            }
            x
        })
        .collect()
}

/// The generator's XDP program: writes the whole frame (the pages of live frames are
/// recycled as they come back, with whatever the path wrote into them: the node's MAC
/// rewrite, TTL, DNAT), then `bpf_redirect(ifindex of eth0)`.
pub(super) fn generator_program(frame: &[u8], ifindex: u32) -> Result<Vec<Insn>> {
    if !frame.len().is_multiple_of(4) {
        bail!("frame length {} is not a multiple of 4", frame.len());
    }
    let words = frame.len() / 4;
    let mut p = vec![
        insn(0x61, 2, 1, 0, 0),                  // r2 = ctx->data
        insn(0x61, 3, 1, 4, 0),                  // r3 = ctx->data_end
        insn(0xbf, 4, 2, 0, 0),                  // r4 = r2
        insn(0x07, 4, 0, 0, frame.len() as i32), // r4 += len
        // if r4 > r3: skip the stores and the redirect (to the XDP_ABORTED exit)
        insn(0x2d, 4, 3, (words + 4) as i16, 0),
    ];
    for (i, w) in frame.chunks(4).enumerate() {
        let imm = i32::from_ne_bytes([w[0], w[1], w[2], w[3]]);
        p.push(insn(0x62, 2, 0, (i * 4) as i16, imm)); // *(u32 *)(r2 + 4i) = imm
    }
    p.extend([
        mov_imm(1, ifindex as i32),
        mov_imm(2, 0),
        call(BPF_FUNC_REDIRECT),
        exit(),
        mov_imm(0, 0),
        exit(),
    ]);
    Ok(p)
}

pub(super) fn load_xdp(insns: &[Insn], name: &str) -> Result<OwnedFd> {
    let code: Vec<u8> = insns.iter().flatten().copied().collect();
    let license = b"GPL\0";
    let mut log = vec![0u8; 1 << 20];
    let mut attr = Attr::new();
    attr.u32(0, BPF_PROG_TYPE_XDP)
        .u32(4, insns.len() as u32)
        .u64(8, code.as_ptr() as u64)
        .u64(16, license.as_ptr() as u64)
        .u32(24, 1)
        .u32(28, log.len() as u32)
        .u64(32, log.as_mut_ptr() as u64)
        .u32(68, BPF_XDP);
    let n = name.as_bytes();
    attr.bytes(48, &n[..n.len().min(15)]);
    // Without a log first (a verbose log that does not fit fails the load with ENOSPC
    // even when the program is fine); on failure again with one, for the message.
    let quiet = {
        let mut a = attr.clone();
        a.u32(24, 0).u32(28, 0).u64(32, 0);
        a.sys(BPF_PROG_LOAD)
    };
    let fd = match quiet {
        Ok(fd) => fd,
        Err(_) => attr.sys(BPF_PROG_LOAD).map_err(|e| {
            let end = log.iter().position(|b| *b == 0).unwrap_or(0);
            anyhow::anyhow!(
                "loading XDP program {name}: {e}: {}",
                String::from_utf8_lossy(&log[..end])
            )
        })?,
    };
    // SAFETY: a new fd the kernel gave us.
    Ok(unsafe { OwnedFd::from_raw_fd(fd as i32) })
}

/// A native-mode XDP link on `ifindex` of the calling thread's namespace; detached when
/// the fd closes (also when the process dies).
pub(super) fn attach_xdp(prog: &OwnedFd, ifindex: u32) -> Result<OwnedFd> {
    let mut attr = Attr::new();
    attr.u32(0, prog.as_raw_fd() as u32)
        .u32(4, ifindex)
        .u32(8, BPF_XDP)
        .u32(12, XDP_FLAGS_DRV_MODE);
    let fd = attr.sys(BPF_LINK_CREATE).context("BPF_LINK_CREATE")?;
    // SAFETY: a new fd the kernel gave us.
    Ok(unsafe { OwnedFd::from_raw_fd(fd as i32) })
}

/// `repeat` copies of `frame` through `prog` in live-frames mode (really transmitted).
pub(super) fn test_run_live(prog: &OwnedFd, frame: &[u8], repeat: u32) -> Result<()> {
    let mut attr = Attr::new();
    attr.u32(0, prog.as_raw_fd() as u32)
        .u32(8, frame.len() as u32)
        .u64(16, frame.as_ptr() as u64)
        .u32(32, repeat)
        .u32(64, BPF_F_TEST_XDP_LIVE_FRAMES)
        .u32(72, 64);
    attr.sys(BPF_PROG_TEST_RUN)
        .context("BPF_PROG_RUN (live frames)")?;
    Ok(())
}
