//! The version of every JSON document `proxyctl` writes; a leaf every subcommand imports.

/// Version of every JSON document (`"schema"`): bumped only on an incompatible change;
/// new fields may appear without a bump.
pub const SCHEMA: u32 = 1;
