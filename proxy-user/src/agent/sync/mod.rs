//! The sync half of the agent (after kube-proxy's `servicechangetracker`): updates from
//! the sources only change the index and mark Services dirty; [`Syncer::sync`] then
//! writes what the dirty Services need, through the [`Writer`], which writes only the
//! delta. Nothing is written before every initial list is complete; a relist or a
//! periodic resync is a full re-diff, which also removes what a previous agent left in
//! pinned maps and nobody wants any more. When to sync is decided by
//! [`super::schedule::Schedule`].
//!
//! Kubernetes rules applied on the way live in `cluster/`: which externalIPs are allowed
//! (`cluster::external_ips`), who owns a frontend several Services claim and the order
//! twins are written in (`cluster::conflicts`).
//!
//! Time is passed in (`now`), so the logic is tested without sleeping.
//!
//! Layout: `syncer.rs` the [`Syncer`] (its state, construction, accessors) and
//! [`SyncOutcome`]; `track.rs` the updates from the sources (snapshots, applies,
//! deletes, the node, orphaned slices); `incoming.rs` an object as the syncer takes it
//! (reduced, the agent's rules applied); `held.rs` Services kept at their pinned state
//! while an object of theirs does not validate at start; `write.rs` the sync and the
//! write path (claims, owners, write order, failures and refusals). Its tests are
//! `sync/tests.rs`.

mod held;
mod incoming;
mod syncer;
mod track;
mod write;

pub use syncer::{SyncOutcome, Syncer};

#[cfg(test)]
mod tests;
