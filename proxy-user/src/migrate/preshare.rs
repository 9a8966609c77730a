//! The maps an online resize leaves as they are, shared before the staged load.

use std::os::fd::AsFd;

use proxy_common::{map_names, meta, ABI_VERSION};

use super::{
    copy::Convert,
    rules::{converter, force_mode, io_err, Force, PREVIOUS_CT},
    SizedMap, Sizes,
};
use crate::{
    loader::{object_hash, LoadError},
    pins::{Access, PinDir},
};

/// Before the load, when this very object is migrated (same ABI, same object hash:
/// an online resize), every pinned map the resize leaves at its size is pinned into
/// the staging directory as it is, so the load opens it instead of making a map to
/// throw away, and the programs need no second load for it (the maps' layouts are
/// the object's: only the sizes asked for differ). `CT*_PREV` stay out of it when
/// conntrack is resized (`keep_previous_conntrack` puts the replaced tables there).
/// What this leaves, `Migration::share_unchanged` checks after the load. Returns how many.
pub(super) fn pre_share(
    pins: &PinDir,
    staging: &PinDir,
    from: u32,
    sizes: &Sizes,
) -> Result<usize, LoadError> {
    if from != ABI_VERSION || force_mode() == Some(Force::Copy) {
        return Ok(0);
    }
    if pins.read_meta(meta::OBJECT_HASH, Access::ReadOnly).ok() != Some(object_hash()) {
        return Ok(0);
    }
    let size_kept = |kind: SizedMap| {
        kind.maps()
            .iter()
            .all(|m| pins.max_entries(m) == Some(sizes.get(kind)))
    };
    let ct_kept = size_kept(SizedMap::Conntrack);
    let mut shared = Vec::new();
    for name in map_names::ALL {
        if name == map_names::META || (!ct_kept && PREVIOUS_CT.iter().any(|(p, _)| *p == name)) {
            continue;
        }
        if let Some(kind) = SizedMap::ALL.into_iter().find(|k| k.maps().contains(&name)) {
            if pins.max_entries(name) != Some(sizes.get(kind)) {
                continue;
            }
        }
        let Ok(old_fd) = pins.open_fd(name, Access::ReadWrite) else {
            continue; // not pinned: the load makes it
        };
        let info =
            bpf_sys::map_info(old_fd.as_fd()).map_err(io_err("reading", &pins.map_path(name)))?;
        let storage = matches!(
            info.map_type,
            bpf_sys::map_type::SK_STORAGE | bpf_sys::map_type::RINGBUF
        );
        if !storage && !matches!(converter(from, name), Convert::Bytes) {
            continue;
        }
        let new = staging.map_path(name);
        staging
            .pin_map(name, old_fd.as_fd())
            .map_err(io_err("pinning", &new))?;
        shared.push(name);
    }
    tracing::debug!(
        ?shared,
        "maps the resize leaves as they are: shared before the load"
    );
    Ok(shared.len())
}
