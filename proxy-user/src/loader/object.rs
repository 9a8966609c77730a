//! The eBPF object: built in, hashed, loaded with its maps pinned, its `META` entries
//! written; the kernel programs' log records forwarded.

use std::{fs, io};

use aya::{
    maps::{Array, MapData},
    EbpfLoader,
};
use proxy_common::{map_names, meta, ABI_VERSION};
use tracing::warn;

use super::{
    error::{io_err, LoadError},
    sized::{SizedMap, Sizes},
};
use crate::pins::{Access, PinDir};

/// The eBPF object built by `build.rs` (empty when built with the stub switch).
pub(crate) static EBPF_OBJECT: &[u8] =
    aya::include_bytes_aligned!(concat!(env!("OUT_DIR"), "/proxy-ebpf"));

/// A hash of this build's eBPF object (FNV-1a, folded to 32 bits; never 0, which means
/// "none"), recorded in `META[OBJECT_HASH]`: another build's programs are swapped in.
pub fn object_hash() -> u32 {
    static HASH: std::sync::OnceLock<u32> = std::sync::OnceLock::new();
    *HASH.get_or_init(|| {
        let mut h: u64 = 0xcbf2_9ce4_8422_2325;
        for b in EBPF_OBJECT {
            h ^= u64::from(*b);
            h = h.wrapping_mul(0x0100_0000_01b3);
        }
        match (h ^ (h >> 32)) as u32 {
            0 => 1,
            v => v,
        }
    })
}

/// Loads the eBPF object with its maps pinned (or reused) in `pins` and records
/// the ABI version; programs are not loaded into the kernel yet. For `install`, and for
/// tests that run a program with `BPF_PROG_TEST_RUN`.
///
/// `ct_entries` sizes the conntrack tables when they are created here (not when pinned).
pub fn load_object(pins: &PinDir, ct_entries: u32) -> Result<aya::Ebpf, LoadError> {
    load_object_sized(pins, ct_entries, super::memory::DEFAULT_SERVICE_ENTRIES)
}

/// [`load_object`] with `SVC4`/`SVC6` of `svc_entries` (maps created now; pinned maps
/// keep the size they were made with).
pub fn load_object_sized(
    pins: &PinDir,
    ct_entries: u32,
    svc_entries: u32,
) -> Result<aya::Ebpf, LoadError> {
    load_object_with(pins, ct_entries, svc_entries, None)
}

/// [`load_object`] with every map sized to demand made at `sizes` (maps created now;
/// pinned maps keep the size they were made with).
pub fn load_object_sizes(pins: &PinDir, sizes: &Sizes) -> Result<aya::Ebpf, LoadError> {
    load_with_sizes(pins, sizes, None)
}

/// The global in the eBPF object that holds how long XDP reuses a FIB answer
/// (`xdp::FIB_HOP_TTL_NS`, 100 ms unless set here).
pub const FIB_HOP_TTL_GLOBAL: &str = "FIB_HOP_TTL_NS";

/// The global in the eBPF object that turns the conntrack fallback on (`maps::CT_FALLBACK`):
/// set (to 1) only for the programs of a conntrack resize (`migrate`), which look a
/// `CT4`/`CT6` miss up in `CT4_PREV`/`CT6_PREV`, the tables being replaced.
pub const CT_FALLBACK_GLOBAL: &str = "CT_FALLBACK";

/// [`load_object_sized`] with XDP's FIB-answer TTL set to `fib_hop_ttl` (`None`: the
/// object's 100 ms). For tests that check the cache without racing the clock; the agent
/// always runs with the default.
pub fn load_object_with(
    pins: &PinDir,
    ct_entries: u32,
    svc_entries: u32,
    fib_hop_ttl: Option<std::time::Duration>,
) -> Result<aya::Ebpf, LoadError> {
    let sizes = Sizes::compiled()
        .with(SizedMap::Conntrack, ct_entries)
        .with(SizedMap::Service, svc_entries);
    load_with_sizes(pins, &sizes, fib_hop_ttl)
}

fn load_with_sizes(
    pins: &PinDir,
    sizes: &Sizes,
    fib_hop_ttl: Option<std::time::Duration>,
) -> Result<aya::Ebpf, LoadError> {
    let pin_path = pins.path();
    if EBPF_OBJECT.is_empty() {
        return Err(LoadError::NoObject);
    }
    fs::create_dir_all(pin_path).map_err(io_err("creating", pin_path))?;
    let ttl_ns = fib_hop_ttl.map(|t| u64::try_from(t.as_nanos()).unwrap_or(u64::MAX));
    let mut loader = EbpfLoader::new();
    // The kernel's BTF (`/sys/kernel/btf/vmlinux`) serves only CO-RE relocations, and the
    // object has none (`tests::no_co_re_relocations`). aya 0.14.0's `EbpfLoader::new` parsed
    // it regardless (an 18.6 MB heap peak, the agent's at start); the workspace's patched
    // aya (proxy-user/patched/aya/PATCHED.md) reads it only when asked, and this says not to.
    loader.btf(None);
    loader.default_map_pin_directory(pin_path);
    for kind in SizedMap::ALL {
        for map in kind.maps() {
            loader.map_max_entries(map, sizes.get(kind));
        }
    }
    if let Some(ns) = ttl_ns.as_ref() {
        loader.override_global(FIB_HOP_TTL_GLOBAL, ns, true);
    }
    let mut ebpf = loader.load(EBPF_OBJECT)?;
    write_meta(&mut ebpf, meta::ABI_VERSION, ABI_VERSION)?;
    write_meta(&mut ebpf, meta::OBJECT_HASH, object_hash())?;
    Ok(ebpf)
}

pub(super) fn write_meta(ebpf: &mut aya::Ebpf, index: u32, value: u32) -> Result<(), LoadError> {
    let err = |source| LoadError::Map {
        name: map_names::META,
        source,
    };
    let map = ebpf.map_mut(map_names::META).ok_or_else(|| {
        err(aya::maps::MapError::InvalidName {
            name: map_names::META.into(),
        })
    })?;
    let mut meta: Array<&mut MapData, u32> = Array::try_from(map).map_err(err)?;
    meta.set(index, value, 0).map_err(err)
}

/// Forwards the kernel programs' aya-log records (rare warnings) to this process's
/// `log`/`tracing` output until the returned task is dropped. Works for adopted programs
/// too: it finds their ring buffer through the program id the loader recorded.
pub fn spawn_kernel_logger(pins: impl Into<PinDir>) -> Option<tokio::task::JoinHandle<()>> {
    let id = pins
        .into()
        .read_meta(meta::LOG_PROGRAM_ID, Access::ReadOnly)
        .ok()
        .filter(|id| *id != 0)?;
    let logger = match aya_log::EbpfLogger::init_from_id(id) {
        Ok(l) => l,
        Err(e) => {
            warn!(program_id = id, "kernel log records unavailable: {e}");
            return None;
        }
    };
    // SAFETY: the logger owns its ring buffer's fd for its whole life, and the AsyncFd
    // owns the logger.
    let registered = unsafe {
        tokio::io::unix::AsyncFd::register_with_interest(logger, tokio::io::Interest::READABLE)
    };
    let mut fd = match registered {
        Ok(fd) => fd,
        Err(e) => {
            warn!("kernel log records unavailable: {e}");
            return None;
        }
    };
    Some(tokio::spawn(async move {
        loop {
            let Ok(mut guard) = fd.readable_mut().await else {
                return;
            };
            guard.get_inner_mut().flush();
            guard.clear_ready();
        }
    }))
}

/// Raises RLIMIT_MEMLOCK for kernels that still charge BPF memory to it (< 5.11).
/// Newer kernels use memcg accounting; failing here is then harmless.
pub(super) fn bump_memlock_rlimit() {
    let rlim = libc::rlimit {
        rlim_cur: libc::RLIM_INFINITY,
        rlim_max: libc::RLIM_INFINITY,
    };
    // SAFETY: plain syscall with a valid struct.
    if unsafe { libc::setrlimit(libc::RLIMIT_MEMLOCK, &rlim) } != 0 {
        warn!(
            error = %io::Error::last_os_error(),
            "could not raise RLIMIT_MEMLOCK (fine on kernels >= 5.11)"
        );
    }
}

#[cfg(test)]
mod tests {
    use object::{
        Object as _, ObjectSection as _, ObjectSymbol as _, RelocationTarget, SymbolKind,
    };
    use proxy_common::prog_names;

    use super::EBPF_OBJECT;

    /// The functions of the TC and XDP programs a packet of a known flow runs through.
    const KNOWN_FLOW_PATH: &[&str] = &[
        prog_names::TC_INGRESS,
        prog_names::TC_EGRESS,
        prog_names::XDP_INGRESS,
        "4flow",
        "10parse_into",
        "10reply_path",
        "10known_path",
        "12refresh_orig",
        "7rewrite",
        "9fib_check",
        "4send",
        "12fib_redirect",
        "7backend",
        "7for_tc4",
        "7for_tc6",
    ];

    /// For every relocation of the object, the function it is in and the symbol it
    /// names (a map, or a function the BPF target links in).
    fn relocations() -> Vec<(String, String)> {
        assert!(
            !EBPF_OBJECT.is_empty(),
            "built without the eBPF object (PROXY_EBPF_STUB or no bpf-linker): run `cargo xtask setup`"
        );
        let file = object::File::parse(EBPF_OBJECT).expect("the eBPF object parses as ELF");
        let mut out = Vec::new();
        for section in file.sections() {
            let funcs: Vec<_> = file
                .symbols()
                .filter(|s| s.section_index() == Some(section.index()) && s.size() > 0)
                .map(|s| (s.address(), s.size(), s.name().unwrap_or("?").to_string()))
                .collect();
            for (offset, reloc) in section.relocations() {
                let RelocationTarget::Symbol(idx) = reloc.target() else {
                    continue;
                };
                let target = file
                    .symbol_by_index(idx)
                    .and_then(|s| s.name().map(str::to_string))
                    .unwrap_or_default();
                let func = funcs
                    .iter()
                    .find(|(a, size, _)| (*a..a + size).contains(&offset))
                    .map(|(_, _, n)| n.clone())
                    .unwrap_or_default();
                out.push((func, target));
            }
        }
        out
    }

    /// The object's CO-RE relocations (`.BTF.ext`'s `core_relo` part, in bytes). The
    /// loader drops the kernel's BTF before loading (`load_with_sizes`): a CO-RE
    /// relocation would then fail the load.
    fn co_re_relocation_bytes() -> u32 {
        let file = object::File::parse(EBPF_OBJECT).expect("the eBPF object parses as ELF");
        let ext = file
            .section_by_name(".BTF.ext")
            .expect("the object has .BTF.ext")
            .data()
            .expect("readable");
        let word = |at: usize| u32::from_le_bytes(ext[at..at + 4].try_into().expect("4 bytes"));
        // btf_ext_header: magic u16, version u8, flags u8, hdr_len u32, then offset/length
        // pairs of func_info and line_info (24 bytes), core_relo's after them (32).
        assert_eq!(
            u16::from_le_bytes([ext[0], ext[1]]),
            0xeb9f,
            "BTF.ext magic"
        );
        if word(4) < 32 {
            return 0;
        }
        word(28)
    }

    #[test]
    fn no_co_re_relocations() {
        assert!(
            !EBPF_OBJECT.is_empty(),
            "built without the eBPF object (PROXY_EBPF_STUB or no bpf-linker): run `cargo xtask setup`"
        );
        assert_eq!(
            co_re_relocation_bytes(),
            0,
            "the object has CO-RE relocations: load_with_sizes must keep the kernel's BTF"
        );
    }

    fn on_known_flow_path(func: &str) -> bool {
        KNOWN_FLOW_PATH.iter().any(|f| func.contains(f))
    }

    /// On the BPF target a zeroed struct, an unaligned array store or another
    /// struct-sized copy can compile to a call of the byte-at-a-time `memset`/`memmove`/
    /// `memcpy` loops the target links in: a 64-byte `memset` per forwarded packet was the
    /// largest item of the XDP program's profile (docs/benchmarks.md, "The per-packet cost
    /// cut"). None may be called on the path of a packet of a known flow.
    #[test]
    fn no_byte_loop_calls_on_the_known_flow_path() {
        let relocs = relocations();
        // The scan sees the path: its functions name the conntrack maps.
        for map in ["CT4", "CT6", "FIB"] {
            assert!(
                relocs
                    .iter()
                    .any(|(f, t)| t == map && on_known_flow_path(f)),
                "no relocation to {map} found in the known-flow functions: the scan is broken"
            );
        }
        let calls: Vec<_> = relocs
            .iter()
            .filter(|(f, t)| {
                ["memset", "memmove", "memcpy", "memcmp", "bcmp"].contains(&t.as_str())
                    && on_known_flow_path(f)
            })
            .collect();
        assert!(
            calls.is_empty(),
            "byte-loop calls on the known-flow path: {calls:#?}"
        );
    }

    /// The programs of the object, as aya finds them: the global functions outside
    /// `.text`, each with its section (`cgroup/connect4`, `classifier`, `xdp`, ...).
    fn programs() -> Vec<(String, String)> {
        assert!(
            !EBPF_OBJECT.is_empty(),
            "built without the eBPF object (PROXY_EBPF_STUB or no bpf-linker): run `cargo xtask setup`"
        );
        let file = object::File::parse(EBPF_OBJECT).expect("the eBPF object parses as ELF");
        let mut out: Vec<(String, String)> = file
            .symbols()
            .filter(|s| s.kind() == SymbolKind::Text && s.is_global() && s.size() > 0)
            .filter_map(|s| {
                let section = file.section_by_index(s.section_index()?).ok()?;
                let section = section.name().ok()?.to_string();
                (section != ".text").then(|| (s.name().unwrap_or("?").to_string(), section))
            })
            .collect();
        out.sort();
        out
    }

    /// The names the loader, the pins and `prog_run` use ([`prog_names::ALL`]) are the
    /// eBPF functions' names, each in the section of its hook: a renamed function fails
    /// here, not at `install`.
    #[test]
    fn program_names_are_the_objects_programs() {
        let programs = programs();
        let mut found: Vec<&str> = programs.iter().map(|(n, _)| n.as_str()).collect();
        let mut want = prog_names::ALL.to_vec();
        found.sort_unstable();
        want.sort_unstable();
        assert_eq!(found, want, "the object's programs: {programs:?}");
        let section = |name: &str| {
            programs
                .iter()
                .find(|(n, _)| n == name)
                .map(|(_, s)| s.as_str())
                .unwrap_or_default()
        };
        for (name, attach) in prog_names::SOCK.iter().zip([
            "connect4",
            "sendmsg4",
            "recvmsg4",
            "getpeername4",
            "connect6",
            "sendmsg6",
            "recvmsg6",
            "getpeername6",
        ]) {
            assert_eq!(section(name), format!("cgroup/{attach}"), "{name}");
        }
        for name in prog_names::TC {
            assert_eq!(section(name), "classifier", "{name}");
        }
        assert_eq!(section(prog_names::XDP_INGRESS), "xdp");
    }
}
