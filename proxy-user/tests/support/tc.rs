//! Looking at the TC hooks of interfaces inside a test namespace: the filters `tc` lists in
//! a clsact qdisc, the programs attached with TCX, the programs pinned under `links/`; and
//! a guard that uninstalls a pin directory from inside the namespace that holds its
//! interfaces (clsact filters are found by interface name). The crafted packets for
//! `BPF_PROG_TEST_RUN` are in `proxy_user::prog_run::pkt` (shared with `bench-prog-run`)
//! and re-exported here.

use proxy_common::prog_names::{TC_EGRESS, TC_INGRESS};
use std::{
    path::{Path, PathBuf},
    process::Command,
};

use aya::programs::{SchedClassifier, TcAttachType};
use proxy_user::loader;

use super::{Netns, NetnsGuard};

pub use super::pkt::{icmp_error, parse_icmp_error, Pkt, TCP, UDP};

/// One filter line of `tc filter show` that names a handle.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TcFilter {
    /// `pref` (priority).
    pub pref: u16,
    /// `bpf`, `u32`, ...
    pub kind: String,
    /// `handle` (bpf filters), as tc prints it (`0x4b50`).
    pub handle: Option<String>,
    /// The program id (bpf filters).
    pub id: Option<u32>,
    /// The program name (bpf filters).
    pub name: Option<String>,
    pub line: String,
}

/// `tc filter show dev IFACE ingress|egress`, run inside `ns`: every filter line that
/// names a handle (bpf: `handle`, u32: `fh`).
pub fn tc_filters(ns: &Netns, iface: &str, ingress: bool) -> Vec<TcFilter> {
    let dir = if ingress { "ingress" } else { "egress" };
    let out = Command::new("nsenter")
        .arg(format!("--net={}", ns.path().display()))
        .args(["--", "tc", "filter", "show", "dev", iface, dir])
        .output()
        .expect("run tc");
    assert!(
        out.status.success(),
        "tc filter show dev {iface} {dir}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout)
        .lines()
        .filter(|l| l.starts_with("filter ") && (l.contains(" handle ") || l.contains(" fh ")))
        .map(|line| {
            let words: Vec<&str> = line.split_whitespace().collect();
            let after = |key: &str| {
                words
                    .iter()
                    .position(|w| *w == key)
                    .and_then(|i| words.get(i + 1))
                    .map(|w| w.to_string())
            };
            let pref: u16 = after("pref").and_then(|p| p.parse().ok()).expect("pref");
            let kind = after(&pref.to_string()).unwrap_or_default();
            TcFilter {
                pref,
                kind,
                handle: after("handle"),
                id: after("id").and_then(|i| i.parse().ok()),
                name: after("name"),
                line: line.to_string(),
            }
        })
        .collect()
}

/// The bpf filters among [`tc_filters`].
pub fn bpf_filters(ns: &Netns, iface: &str, ingress: bool) -> Vec<TcFilter> {
    tc_filters(ns, iface, ingress)
        .into_iter()
        .filter(|f| f.kind == "bpf")
        .collect()
}

/// Asserts that `iface` has exactly one bpf filter on `ingress`/egress, ours (reserved
/// priority and handle, our program's name), and returns its program id.
pub fn our_one_filter(ns: &Netns, iface: &str, ingress: bool) -> u32 {
    let filters = bpf_filters(ns, iface, ingress);
    let [f] = filters.as_slice() else {
        panic!("{iface} ingress={ingress}: want exactly one bpf filter, got {filters:#?}");
    };
    let want_name = if ingress { TC_INGRESS } else { TC_EGRESS };
    assert_eq!(f.pref, loader::CLSACT_PRIORITY, "{f:?}");
    assert_eq!(
        f.handle.as_deref(),
        Some(format!("{:#x}", u32::from(loader::CLSACT_HANDLE)).as_str()),
        "{f:?}"
    );
    assert_eq!(f.name.as_deref(), Some(want_name), "{f:?}");
    assert!(f.line.contains("direct-action"), "{f:?}");
    f.id.expect("program id")
}

/// Programs attached to `iface` with TCX (ids), queried inside `ns`.
pub fn tcx_programs(ns: &Netns, iface: &str, ingress: bool) -> Vec<u32> {
    let _g = ns.enter();
    let kind = if ingress {
        TcAttachType::Ingress
    } else {
        TcAttachType::Egress
    };
    let (_, progs) = SchedClassifier::query_tcx(iface, kind)
        .unwrap_or_else(|e| panic!("query TCX on {iface}: {e}"));
    progs.iter().map(|p| p.id()).collect()
}

/// The id of the program pinned at `path`.
pub fn pinned_program_id(path: &Path) -> u32 {
    let prog = SchedClassifier::from_pin(path)
        .unwrap_or_else(|e| panic!("program pinned at {}: {e}", path.display()));
    prog.info().expect("program info").id()
}

/// `links/tc-<iface>-<dir>-clsact` under `pins`.
pub fn clsact_pin(pins: &Path, iface: &str, ingress: bool) -> PathBuf {
    let dir = if ingress { "ingress" } else { "egress" };
    pins.join("links").join(format!("tc-{iface}-{dir}-clsact"))
}

/// Whether a program with this id is still loaded in the kernel.
pub fn program_loaded(id: u32) -> bool {
    aya::programs::loaded_programs()
        .filter_map(Result::ok)
        .any(|p| p.id() == id)
}

/// Uninstalls `pins` from inside `ns` on drop if it is still there, so that a failing test
/// detaches its clsact filters in its own namespace (never in the host's). Declare it
/// after the namespace so it drops first.
pub struct UninstallIn {
    pub ns: PathBuf,
    pub pins: PathBuf,
}

impl UninstallIn {
    pub fn new(ns: &Netns, pins: &Path) -> Self {
        Self {
            ns: ns.path(),
            pins: pins.to_path_buf(),
        }
    }
}

impl Drop for UninstallIn {
    fn drop(&mut self) {
        if self.pins.exists() {
            let _g = NetnsGuard::enter(&self.ns);
            if let Err(e) = loader::uninstall(&proxy_user::pins::PinDir::new(&self.pins)) {
                eprintln!("cleanup of {}: {e}", self.pins.display());
            }
        }
    }
}
