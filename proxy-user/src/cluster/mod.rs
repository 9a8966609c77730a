//! The Kubernetes side: objects, the desired-state index, and the two sources of truth
//! (the API server's watches and a manifests directory) that feed it.

pub mod index;
pub mod objects;
