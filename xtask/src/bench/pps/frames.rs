//! The packet-rate bench's frames and interfaces: the 64-byte UDP frame, MAC and
//! ifindex lookups, checksums, NAPI threads and CPU pinning.

use std::{io, net::Ipv4Addr};

use anyhow::{bail, Context as _, Result};

use crate::bench::topo::{ns_run, Netns};

/// The generator's CPU and the node's.
pub(super) const GENERATOR_CPU: usize = 0;
pub(super) const NODE_CPU: usize = 1;

/// The generator's source port.
pub(super) const SRC_PORT: u16 = 40_000;
/// Ethernet frame length without FCS: a 64-byte frame on a wire.
pub(super) const FRAME_LEN: usize = 60;

pub(super) fn link_json(ns: &Netns, dev: &str) -> Result<serde_json::Value> {
    let out = ns_run(ns, "ip", &["-j", "link", "show", dev], "")?;
    let v: serde_json::Value = serde_json::from_str(&out).context("ip -j link")?;
    v.get(0).cloned().context("ip -j link: empty")
}

pub(super) fn mac(ns: &Netns, dev: &str) -> Result<String> {
    link_json(ns, dev)?
        .get("address")
        .and_then(|a| a.as_str())
        .map(str::to_string)
        .with_context(|| format!("no MAC address for {dev}"))
}

pub(super) fn ifindex(dev: &str) -> Result<u32> {
    let name = std::ffi::CString::new(dev)?;
    // SAFETY: a valid C string.
    let i = unsafe { libc::if_nametoindex(name.as_ptr()) };
    if i == 0 {
        bail!("no interface {dev}: {}", io::Error::last_os_error());
    }
    Ok(i)
}

pub(super) fn parse_mac(s: &str) -> Result<[u8; 6]> {
    let b: Vec<u8> = s
        .split(':')
        .map(|h| u8::from_str_radix(h, 16))
        .collect::<Result<_, _>>()
        .with_context(|| format!("MAC {s}"))?;
    b.try_into()
        .map_err(|_| anyhow::anyhow!("MAC {s}: not 6 bytes"))
}

pub(super) fn csum_fold(mut sum: u32) -> u16 {
    while sum >> 16 != 0 {
        sum = (sum & 0xffff) + (sum >> 16);
    }
    !(sum as u16)
}

pub(super) fn csum_add(data: &[u8], mut sum: u32) -> u32 {
    for c in data.chunks(2) {
        let w = if c.len() == 2 {
            u16::from_be_bytes([c[0], c[1]])
        } else {
            u16::from_be_bytes([c[0], 0])
        };
        sum += u32::from(w);
    }
    sum
}

/// An Ethernet + IPv4 + UDP frame of [`FRAME_LEN`] bytes with valid checksums.
pub fn udp_frame(
    src_mac: &str,
    dst_mac: &str,
    src: Ipv4Addr,
    dst: Ipv4Addr,
    sport: u16,
    dport: u16,
) -> Result<Vec<u8>> {
    let mut f = vec![0u8; FRAME_LEN];
    f[0..6].copy_from_slice(&parse_mac(dst_mac)?);
    f[6..12].copy_from_slice(&parse_mac(src_mac)?);
    f[12..14].copy_from_slice(&0x0800u16.to_be_bytes());
    let ip_len = FRAME_LEN - 14;
    let udp_len = ip_len - 20;
    {
        let ip = &mut f[14..34];
        ip[0] = 0x45;
        ip[2..4].copy_from_slice(&(ip_len as u16).to_be_bytes());
        ip[6] = 0x40; // DF
        ip[8] = 64;
        ip[9] = 17;
        ip[12..16].copy_from_slice(&src.octets());
        ip[16..20].copy_from_slice(&dst.octets());
        let c = csum_fold(csum_add(ip, 0));
        ip[10..12].copy_from_slice(&c.to_be_bytes());
    }
    f[34..36].copy_from_slice(&sport.to_be_bytes());
    f[36..38].copy_from_slice(&dport.to_be_bytes());
    f[38..40].copy_from_slice(&(udp_len as u16).to_be_bytes());
    for (i, b) in f[42..].iter_mut().enumerate() {
        *b = b'a' + (i % 26) as u8;
    }
    let mut pseudo = Vec::with_capacity(12);
    pseudo.extend_from_slice(&src.octets());
    pseudo.extend_from_slice(&dst.octets());
    pseudo.extend_from_slice(&[0, 17]);
    pseudo.extend_from_slice(&(udp_len as u16).to_be_bytes());
    let mut c = csum_fold(csum_add(&f[34..], csum_add(&pseudo, 0)));
    if c == 0 {
        c = 0xffff;
    }
    f[40..42].copy_from_slice(&c.to_be_bytes());
    Ok(f)
}

/// `napi/<dev>-<id>` kernel threads (every namespace's).
pub(super) fn napi_threads(dev: &str) -> Vec<i32> {
    let prefix = format!("napi/{dev}-");
    let Ok(dir) = std::fs::read_dir("/proc") else {
        return Vec::new();
    };
    dir.filter_map(|e| {
        let e = e.ok()?;
        let pid: i32 = e.file_name().to_str()?.parse().ok()?;
        let comm = std::fs::read_to_string(e.path().join("comm")).ok()?;
        comm.trim().starts_with(&prefix).then_some(pid)
    })
    .collect()
}

/// `SCHED_FIFO` for the NAPI thread: it takes its CPU as soon as it has packets, as a
/// softirq would (under `SCHED_OTHER` it waits for its turn behind whatever else runs
/// on that CPU, while the veth ring of 256 frames overflows).
pub(super) fn set_fifo(pid: i32) -> io::Result<()> {
    let param = libc::sched_param { sched_priority: 50 };
    // SAFETY: a valid sched_param for a pid we checked is a napi kthread.
    if unsafe { libc::sched_setscheduler(pid, libc::SCHED_FIFO, &param) } != 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}

pub(super) fn set_affinity(pid: i32, cpu: usize) -> io::Result<()> {
    let cpu = cpu % super::super::client::cpus();
    // SAFETY: a zeroed cpu_set_t is a valid empty set; CPU_SET writes within it.
    let rc = unsafe {
        let mut set: libc::cpu_set_t = std::mem::zeroed();
        libc::CPU_SET(cpu, &mut set);
        libc::sched_setaffinity(pid, std::mem::size_of::<libc::cpu_set_t>(), &set)
    };
    if rc != 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::bench::plan::{CLIENT_IP, DNS_PORT, TARGET_VIP};

    #[test]
    fn frame_is_64_bytes_on_the_wire_with_valid_checksums() {
        let f = udp_frame(
            "02:00:00:00:00:01",
            "02:00:00:00:00:02",
            CLIENT_IP,
            TARGET_VIP,
            SRC_PORT,
            DNS_PORT,
        )
        .expect("frame");
        assert_eq!(f.len() + 4, 64);
        assert_eq!(&f[0..6], &[2, 0, 0, 0, 0, 2]);
        // A header with its checksum sums to 0xffff.
        assert_eq!(csum_fold(csum_add(&f[14..34], 0)), 0);
        let mut pseudo = Vec::new();
        pseudo.extend_from_slice(&f[26..34]);
        pseudo.extend_from_slice(&[0, 17, 0, 26]);
        assert_eq!(csum_fold(csum_add(&f[34..], csum_add(&pseudo, 0))), 0);
        assert_eq!(u16::from_be_bytes([f[36], f[37]]), 53);
    }
}
