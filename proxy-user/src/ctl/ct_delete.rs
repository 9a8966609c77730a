//! `proxyctl conntrack delete`: removes TC conntrack entries (`CT4/CT6`) by flow, by
//! backend id or by Service, both directions of each flow. The one map write `proxyctl`
//! makes besides `monitor`'s lease, and only with `--yes`: without it the entries that
//! would go are listed and nothing is changed.
//!
//! A deleted flow's next packet is a new flow to the datapath (a backend chosen afresh,
//! as after kube-proxy's `conntrack -D`); a TCP connection in the middle of a stream
//! then reaches a backend that does not know it and is reset.

use std::net::SocketAddr;

use aya::maps::{HashMap, MapData};
use proxy_common::{map_names as names, Ct4Key, Ct4Value, Ct6Key, Ct6Value};
use serde::Serialize;

use super::{
    conntrack::{flow_view, FlowView},
    error::{Error, Result},
    maps::read::{ct4_entry, ct6_entry},
    schema::SCHEMA,
    snapshot::{CtEntry, Snapshot},
};
use crate::pins::{Access, PinDir};

/// Which flows (at least one selector).
#[derive(Clone, Debug, Default, clap::Args)]
pub struct DeleteArgs {
    /// The flow's client side as a packet of it arrives (`ADDRESS:PORT`); with
    /// `--destination`.
    #[arg(long, requires = "destination")]
    pub source: Option<SocketAddr>,
    /// The flow's destination as a packet of it arrives (the frontend); with `--source`.
    #[arg(long, requires = "source")]
    pub destination: Option<SocketAddr>,
    /// With `--source`/`--destination`: the protocol (`tcp`, `udp`, `sctp`; default tcp).
    #[arg(long, value_parser = super::monitor::parse_proto)]
    pub protocol: Option<u8>,
    /// Every flow to this backend id (`proxyctl backends`).
    #[arg(long)]
    pub backend_id: Option<u32>,
    /// Every flow of this service id (`proxyctl services -o wide`).
    #[arg(long)]
    pub service_id: Option<u32>,
    /// Delete (without it: list what would be deleted, change nothing).
    #[arg(long)]
    pub yes: bool,
}

/// The `conntrack delete` JSON document.
#[derive(Debug, Serialize)]
pub struct DeleteDoc {
    pub schema: u32,
    /// False without `--yes`: `flows` lists what would be deleted.
    pub deleted: bool,
    pub flows: Vec<FlowView>,
}

/// What the selectors pick: an entry of a selected flow, either direction.
pub fn selects(a: &DeleteArgs, e: &CtEntry) -> bool {
    if a.backend_id.is_some_and(|b| b == e.backend_id) {
        return true;
    }
    if a.service_id.is_some_and(|s| s == e.service_id) {
        return true;
    }
    if let (Some(src), Some(dst)) = (a.source, a.destination) {
        let proto = a.protocol.unwrap_or(proxy_common::proto::TCP);
        let key = (proto, src, dst);
        // The original direction, or the reply whose other direction it is.
        return (e.proto, e.src, e.dst) == key || (e.dir == 1 && e.reply_key() == key);
    }
    false
}

/// Runs `conntrack delete`: the selected entries of `CT4`/`CT6`, deleted with `--yes`.
/// `s` names the Services and backends in the listing.
pub fn run(pins: &PinDir, s: &Snapshot, a: &DeleteArgs) -> Result<DeleteDoc> {
    if a.backend_id.is_none() && a.service_id.is_none() && a.source.is_none() {
        return Err(Error::Usage(
            "conntrack delete needs a selector: --source and --destination (one flow), \
             --backend-id or --service-id"
                .into(),
        ));
    }
    let found = delete_where(pins, a.yes, |e| selects(a, e))?;
    Ok(DeleteDoc {
        schema: SCHEMA,
        deleted: a.yes,
        flows: found.iter().flatten().map(|e| flow_view(s, e)).collect(),
    })
}

/// The entries of `CT4` and `CT6` (in that order) that `pick` selects, deleted too with
/// `delete`: the one conntrack deletion path, of `proxyctl conntrack delete` and of the
/// agent's own cleanup of stale UDP flows (`agent::ct_cleanup`).
pub fn delete_where(
    pins: &PinDir,
    delete: bool,
    pick: impl Fn(&CtEntry) -> bool,
) -> Result<[Vec<CtEntry>; 2]> {
    let access = if delete {
        Access::ReadWrite
    } else {
        Access::ReadOnly
    };
    let open = |name: &'static str| -> Result<MapOf> {
        let r = if name == names::CT4 {
            pins.typed::<HashMap<MapData, Ct4Key, Ct4Value>>(name, access)
                .map(MapOf::V4)
        } else {
            pins.typed::<HashMap<MapData, Ct6Key, Ct6Value>>(name, access)
                .map(MapOf::V6)
        };
        r.map_err(|e| match e {
            crate::pins::PinError::Missing { path } => Error::Usage(format!(
                "{} is not pinned: this datapath has no TC conntrack",
                path.display()
            )),
            crate::pins::PinError::Permission { path } => Error::Permission { path },
            crate::pins::PinError::Open { path, source } => Error::Open { path, source },
            other => Error::Usage(other.to_string()),
        })
    };
    let mut out = [Vec::new(), Vec::new()];
    for (i, name) in [names::CT4, names::CT6].into_iter().enumerate() {
        out[i] = match &mut open(name)? {
            MapOf::V4(m) => sweep(m, name, delete, &pick, ct4_entry)?,
            MapOf::V6(m) => sweep(m, name, delete, &pick, ct6_entry)?,
        };
    }
    Ok(out)
}

/// The entries of one conntrack table that `pick` selects; deleted too with `delete`
/// (after the walk: a map is not changed under its own iteration).
fn sweep<K: aya::Pod, V: aya::Pod>(
    m: &mut HashMap<MapData, K, V>,
    name: &'static str,
    delete: bool,
    pick: &impl Fn(&CtEntry) -> bool,
    entry: fn(&K, &V) -> CtEntry,
) -> Result<Vec<CtEntry>> {
    let mut hit = Vec::new();
    for item in m.iter() {
        let (k, v) = item.map_err(|source| Error::Read { map: name, source })?;
        let e = entry(&k, &v);
        if pick(&e) {
            hit.push((k, e));
        }
    }
    let mut found = Vec::with_capacity(hit.len());
    for (k, e) in hit {
        if delete {
            delete_entry(m.remove(&k), name)?;
        }
        found.push(e);
    }
    Ok(found)
}

enum MapOf {
    V4(HashMap<MapData, Ct4Key, Ct4Value>),
    V6(HashMap<MapData, Ct6Key, Ct6Value>),
}

/// An entry the datapath removed meanwhile (expired, evicted) is not an error.
fn delete_entry(r: std::result::Result<(), aya::maps::MapError>, map: &'static str) -> Result<()> {
    match r {
        Ok(()) => Ok(()),
        Err(aya::maps::MapError::KeyNotFound) => Ok(()),
        Err(aya::maps::MapError::SyscallError(e))
            if e.io_error.raw_os_error() == Some(libc::ENOENT) =>
        {
            Ok(())
        }
        Err(source) => Err(Error::Read { map, source }),
    }
}

/// The text output: the flows, then what was done.
pub fn render(d: &DeleteDoc, wide: bool) -> String {
    let doc = super::conntrack::ConntrackDoc {
        schema: d.schema,
        available: true,
        flows: d.flows.clone(),
    };
    let mut s = super::conntrack::render(&doc, wide);
    if d.deleted {
        s.push_str(&format!("deleted {} conntrack entries\n", d.flows.len()));
    } else {
        s.push_str(&format!(
            "{} conntrack entries selected; nothing deleted (add --yes to delete them)\n",
            d.flows.len()
        ));
    }
    s
}
