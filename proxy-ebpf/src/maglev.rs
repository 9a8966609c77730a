//! Maglev table lookup for a new flow (cilium's `lb4_select_backend_id_maglev`, katran's
//! `get_packet_dst` ring lookup): the frontend's table in `MAGLEV`, chunk by chunk,
//! indexed by `proxy_common::maglev::flow_hash` of the 5-tuple modulo the table size.
//! Used by whichever datapath chooses a backend for an external flow (TC, and XDP through
//! the same `choose`).

use proxy_common::{limits::MAGLEV_CHUNK_SLOTS, maglev::locate, MaglevKey};

use crate::maps::MAGLEV;

/// The backend slot (`1..=count`) the table of `service_id` gives `hash`, or 0 when there
/// is no usable table (missing chunk, chunks of two table sizes while the writer replaces
/// a table, a slot past the count): the caller then falls back to random.
#[inline(never)]
pub fn slot(service_id: u32, count: u16, hash: u32) -> u16 {
    let key = MaglevKey {
        service_id,
        chunk: 0,
    };
    // SAFETY: read-only access to a live map value.
    let Some(first) = (unsafe { MAGLEV.get(&key) }) else {
        return 0;
    };
    let m = first.table_size;
    if m == 0 {
        return 0;
    }
    let (chunk, off) = locate(hash % m);
    let c = if chunk == 0 {
        first
    } else {
        let key = MaglevKey { service_id, chunk };
        // SAFETY: as above.
        match unsafe { MAGLEV.get(&key) } {
            Some(c) if c.table_size == m => c,
            _ => return 0,
        }
    };
    // LLVM knows `off < MAGLEV_CHUNK_SLOTS` (a remainder) and drops the bounds check; the
    // verifier cannot follow that arithmetic. A volatile reload hides the value's origin
    // so the explicit check stays in the program.
    // SAFETY: a read of a local.
    let off = unsafe { core::ptr::read_volatile(&off) };
    if off >= MAGLEV_CHUNK_SLOTS {
        return 0;
    }
    match c.slots.get(off) {
        Some(&s) if s != 0 && s <= count => s,
        _ => 0,
    }
}
