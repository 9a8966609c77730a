//! Hash maps and sets of the control plane's hot paths (the writer, the sync, the index)
//! with foldhash: each map gets its own seed (from a per-process global seed built from
//! ASLR addresses, as hashbrown's own default; foldhash's `std` feature is left off so no
//! dependency changes), so keys that come from the API cannot be picked offline to
//! collide, and it is several times faster than std's SipHash on the small keys used here
//! (SipHash was a sixth of the agent's CPU in the staging of a 10,000-Service first sync).

/// A `HashMap` with foldhash.
pub type HashMap<K, V> = std::collections::HashMap<K, V, foldhash::fast::RandomState>;
/// A `HashSet` with foldhash.
pub type HashSet<T> = std::collections::HashSet<T, foldhash::fast::RandomState>;
