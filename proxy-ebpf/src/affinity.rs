//! `sessionAffinity: ClientIP`: a client keeps its backend for the Service's
//! `timeoutSeconds` after its last connection (kube-proxy's `-m recent --rcheck --seconds
//! T` / `--set` pair, one LRU map instead of one recent list per endpoint).
//!
//! An entry names the backend and the slot it had. It is followed only while it is fresh
//! and that slot still names that backend: the writer keeps surviving backends in their
//! slots, so a scale-up or a removal elsewhere keeps the clients' affinity, and a removed
//! backend is never chosen again (its clients are balanced afresh).

use aya_ebpf::helpers::{bpf_get_prandom_u32, bpf_ktime_get_ns};
use proxy_common::{svc_flags, AffinityKey, AffinityValue, Reason, SvcValue};

use crate::maps::{count, AFFINITY};

const NS_PER_S: u64 = 1_000_000_000;

/// The frontend asks for affinity.
#[inline(always)]
fn wanted(front: &SvcValue) -> bool {
    front.flags & svc_flags::AFFINITY != 0 && front.affinity_timeout != 0
}

/// The key for `client` (see `AffinityKey::client`) of kind `kind` at `front`.
#[inline(always)]
pub fn key(front: &SvcValue, client: [u32; 4], kind: u8) -> AffinityKey {
    AffinityKey {
        client,
        service_id: front.service_id,
        kind,
        _pad: [0; 3],
    }
}

/// The client's previous `(slot, backend id)` if it is still valid (and refreshes it);
/// `slot_backend(slot)` reads the backend id a slot names now.
#[inline(always)]
fn lookup(
    front: &SvcValue,
    key: &AffinityKey,
    now: u64,
    slot_backend: impl Fn(u16) -> Option<u32>,
) -> Option<(u16, u32)> {
    let v = AFFINITY.get_ptr_mut(key)?;
    // SAFETY: a live LRU entry; fields are read and written as plain integers.
    let (backend_id, slot, last) = unsafe { ((*v).backend_id, (*v).slot, (*v).last_used_ns) };
    if now.wrapping_sub(last) > u64::from(front.affinity_timeout) * NS_PER_S
        || slot == 0
        || slot > front.count
        || slot_backend(slot)? != backend_id
    {
        return None;
    }
    // SAFETY: as above.
    unsafe { (*v).last_used_ns = now };
    count(Reason::AffinityHit);
    Some((slot, backend_id))
}

/// Records the client's new backend.
#[inline(always)]
fn remember(key: &AffinityKey, slot: u16, backend_id: u32, now: u64) {
    let v = AffinityValue {
        backend_id,
        slot,
        _pad: 0,
        last_used_ns: now,
    };
    // LRU: fails only under memory pressure; the client is then balanced afresh.
    let _ = AFFINITY.insert(key, &v, 0);
}

/// `preferred` when it is one of the frontend's slots (a Maglev choice), else one of the
/// frontend's `count` slots at random (equal weight: one lookup where iptables walks a
/// statistic chain), and the backend id it names.
#[inline(always)]
fn pick_slot(
    front: &SvcValue,
    preferred: u16,
    slot_backend: impl Fn(u16) -> Option<u32>,
) -> Option<(u16, u32)> {
    // Callers have refused an empty frontend; the check keeps a division by zero (a
    // panic path, which the verifier rejects) out of the code.
    if front.count == 0 {
        return None;
    }
    let slot = if preferred != 0 && preferred <= front.count {
        preferred
    } else {
        // SAFETY: helper without preconditions.
        let rnd = unsafe { bpf_get_prandom_u32() };
        (rnd % u32::from(front.count)) as u16 + 1
    };
    Some((slot, slot_backend(slot)?))
}

/// The backend for a new connection of `key`'s client: its previous one while valid,
/// else the `preferred` slot (Maglev's choice; 0: none) or one at random, remembered
/// when the frontend has affinity (`key` is then called).
#[inline(always)]
pub fn choose(
    front: &SvcValue,
    key: impl Fn() -> AffinityKey,
    slot_backend: impl Fn(u16) -> Option<u32> + Copy,
    preferred: u16,
) -> Option<u32> {
    if !wanted(front) {
        return pick_slot(front, preferred, slot_backend).map(|(_, id)| id);
    }
    let key = key();
    let now = now();
    if let Some((_, id)) = lookup(front, &key, now, slot_backend) {
        return Some(id);
    }
    let (slot, id) = pick_slot(front, preferred, slot_backend)?;
    remember(&key, slot, id, now);
    Some(id)
}

/// Monotonic now, for the entries.
#[inline(always)]
fn now() -> u64 {
    // SAFETY: no preconditions.
    unsafe { bpf_ktime_get_ns() }
}
