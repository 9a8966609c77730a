//! What a migration goes by: the oldest ABI it starts from, its steps and test hooks, the
//! maps the datapath itself writes, and each map's conversion ([`converter`]).

use std::{io, path::Path};

use proxy_common::map_names;

use super::{copy::Convert, v3};
use crate::loader::LoadError;

/// The oldest `META` ABI this build migrates from (one release back: 3).
pub const OLDEST_ABI: u32 = 3;
/// Test hook: abort right after the named step.
pub const CRASH_ENV: &str = "EBPF_PROXY_MIGRATE_CRASH_AT";
/// Test hook: the first migration of the process that passes this step ([`STEPS`]) fails
/// there with an error (as a refused allocation or program load would), instead of
/// aborting like [`CRASH_ENV`].
pub const FAIL_ENV: &str = "EBPF_PROXY_MIGRATE_FAIL_AT";
/// Test hook: migrate through the staging directory even at the same ABI.
pub const FORCE_ENV: &str = "EBPF_PROXY_MIGRATE_FORCE";
/// Test hook: a migration's program swap pauses this many milliseconds after each hook
/// swapped but the last, so that hooks running the old and the new programs stay side
/// by side long enough for a test to open flows across them ([`swap_pause`]).
pub const SWAP_PAUSE_ENV: &str = "EBPF_PROXY_MIGRATE_SWAP_PAUSE_MS";

/// The steps [`CRASH_ENV`] can name, in order. `swap-first` and `rename-first` stop
/// after the first hook swapped / the first map renamed (half-done states).
pub const STEPS: [&str; 7] = [
    "staged",
    "filled",
    "swap-first",
    "swapped",
    "recopied",
    "rename-first",
    "meta",
];

/// Maps the datapath itself writes: copied again, insert-if-absent, around the swap
/// (the per-backend selection counters too: a backend's first selection between the
/// copy and the swap is carried over; counts added meanwhile to an entry already copied
/// are not). (Not `SOCK_REVNAT4/6`: from ABI 4 on they live in each socket's storage,
/// which is never copied but kept: [`kept_maps`] and `Migration::share_unchanged`.)
pub(super) const DATAPATH_WRITTEN: [&str; 6] = [
    map_names::CT4,
    map_names::CT6,
    map_names::AFFINITY,
    map_names::BACKEND_CONNS,
    map_names::SVC_COUNTERS,
    map_names::BACKEND_COUNTERS,
];

/// The conversion of map `map` from ABI `from` to this build's layout. **Every map
/// whose key or value changed since `from` needs an arm here** (a function over the
/// old structs of [`v3`]); maps without one are copied as bytes when their sizes still
/// match, and dropped (named and counted in the log) when they do not.
pub fn converter(from: u32, map: &str) -> Convert {
    if force_mode() == Some(Force::Copy) {
        // Test hook: every map as if its layout had changed. The service maps' layout
        // did change since ABI 3: at this ABI they go through a same-layout conversion.
        if from == proxy_common::ABI_VERSION && matches!(map, map_names::SVC4 | map_names::SVC6) {
            return Convert::With(same_svc_entry);
        }
        return v3::convert(map).unwrap_or(Convert::Bytes);
    }
    match (from, map) {
        // ABI 3 -> 4: one arm per map whose key or value changed, through the frozen
        // ABI-3 structs (v3.rs). `STATS` grew (24 reasons) with the same key and value:
        // copied as bytes into the larger array (a different size is never shared).
        (3, map_names::SOCK_REVNAT4 | map_names::SOCK_REVNAT6) => {
            Convert::Drop(v3::SOCK_REVNAT_KEPT)
        }
        // ABI 4 holds a frontend's backend slots 24 to an entry (`SvcEntry`): ABI 3's
        // entry per slot merged into its chunk.
        (3, map_names::SVC4 | map_names::SVC6) => v3::convert(map).unwrap_or(Convert::Bytes),
        _ => Convert::Bytes,
    }
}

/// A `SVC4/6` entry of this layout, converted to itself (checked: an entry of another size
/// is refused).
fn same_svc_entry(k: &[u8], v: &[u8]) -> Option<(Vec<u8>, Vec<u8>)> {
    (v.len() == size_of::<proxy_common::SvcEntry>()).then(|| (k.to_vec(), v.to_vec()))
}

/// Maps of this layout that are an older layout's map object kept as it is under another
/// name ([`Migration::keep_old`](super::state)): `(this layout's name, the pin it comes
/// from)` for a migration from ABI `from`. ABI 3's node-wide socket reverse-NAT LRUs
/// cannot become per-socket storage from user space (a socket's storage is reached only
/// through the socket), so the running maps live on as `SOCK_REVNAT4/6_V3`, which the new
/// `recvmsg`/`getpeername` programs read for sockets the old programs translated: the
/// old `sendmsg` keeps writing the same map object until its hook is swapped, so no
/// reply straddling the swap misses its entry. From ABI 4 on they are kept under their
/// own names.
pub(super) fn kept_maps(from: u32) -> [(&'static str, &'static str); 2] {
    if from == 3 {
        [
            (map_names::SOCK_REVNAT4_V3, map_names::SOCK_REVNAT4),
            (map_names::SOCK_REVNAT6_V3, map_names::SOCK_REVNAT6),
        ]
    } else {
        [
            (map_names::SOCK_REVNAT4_V3, map_names::SOCK_REVNAT4_V3),
            (map_names::SOCK_REVNAT6_V3, map_names::SOCK_REVNAT6_V3),
        ]
    }
}

/// The map of this layout that the old layout's `name` is kept as ([`kept_maps`]).
pub(super) fn kept_as(from: u32, name: &str) -> Option<&'static str> {
    kept_maps(from)
        .into_iter()
        .find(|(_, old)| *old == name)
        .map(|(new, _)| new)
}

/// [`FORCE_ENV`]: `1` migrates through the staging directory (sharing the maps whose
/// layout is unchanged), `copy` also copies every map through its conversion function.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Force {
    Staged,
    Copy,
}

pub(super) fn force_mode() -> Option<Force> {
    match std::env::var(FORCE_ENV).ok()?.as_str() {
        "1" => Some(Force::Staged),
        "copy" => Some(Force::Copy),
        _ => None,
    }
}

pub(super) fn io_err(what: &'static str, path: &Path) -> impl FnOnce(io::Error) -> LoadError {
    let path = path.to_owned();
    move |source| LoadError::Io { what, path, source }
}

pub(super) fn crash_point(step: &str) -> Result<(), crate::loader::LoadError> {
    if std::env::var(CRASH_ENV).is_ok_and(|s| s == step) {
        eprintln!("{CRASH_ENV}={step}: aborting (test hook)");
        std::process::abort();
    }
    if std::env::var(FAIL_ENV).is_ok_and(|s| s == step)
        && !FAILED_ONCE.swap(true, std::sync::atomic::Ordering::AcqRel)
    {
        return Err(crate::loader::LoadError::Io {
            what: "test hook EBPF_PROXY_MIGRATE_FAIL_AT: failing the migration after step",
            path: std::path::PathBuf::from(step),
            source: std::io::Error::other("injected failure"),
        });
    }
    Ok(())
}

/// [`SWAP_PAUSE_ENV`]: the pause between two hooks of a migration's swap (`None`: none,
/// the default; an unparsable value is none too).
pub(super) fn swap_pause() -> Option<std::time::Duration> {
    let ms: u64 = std::env::var(SWAP_PAUSE_ENV).ok()?.parse().ok()?;
    (ms > 0).then(|| std::time::Duration::from_millis(ms))
}

/// [`FAIL_ENV`] fails one migration per process (the first to pass the step).
static FAILED_ONCE: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);

/// `(CT*_PREV, CT*)`: where a resize keeps each conntrack table it replaces.
pub(super) const PREVIOUS_CT: [(&str, &str); 2] = [
    (map_names::CT4_PREV, map_names::CT4),
    (map_names::CT6_PREV, map_names::CT6),
];
