//! The ids the writer assigned, with what names them: the labels of the per-Service and
//! per-backend counters (`--metrics-per-service`, `crate::counters`), and the UDP
//! frontends' backends (the agent's conntrack cleanup, `agent::ct_cleanup`).

use std::{collections::HashSet, net::SocketAddr};

use super::Writer;
use crate::{model::Proto, store::MapStore};

/// The ids the writer has assigned ([`Writer::counted_ids`]).
#[derive(Clone, Debug, Default)]
pub struct CountedIds {
    /// `(service id, Service port name `ns/name[:port]`, protocol)`, one per frontend.
    pub services: Vec<(u32, String, Proto)>,
    /// `(backend id, address, protocol)`, one per live backend id.
    pub backends: Vec<(u32, SocketAddr, Proto)>,
}

impl<S: MapStore> Writer<S> {
    /// Every programmed frontend's service id with its Service port name and protocol,
    /// and every live backend id with its address and protocol.
    pub fn counted_ids(&self) -> CountedIds {
        CountedIds {
            services: self
                .services
                .iter()
                .map(|(fe, p)| (p.value.service_id, p.name.clone(), fe.proto))
                .collect(),
            backends: self
                .backends
                .iter()
                .map(|(id, ((b, proto), _))| (id, b.addr, proto))
                .collect(),
        }
    }

    /// `(service id, backend address)` for every slot of every UDP frontend: what a UDP
    /// flow's conntrack entries may name while its Service port and endpoint are there.
    pub fn udp_slots(&self) -> HashSet<(u32, SocketAddr)> {
        let mut out = HashSet::new();
        for (fe, p) in &self.services {
            if fe.proto != Proto::Udp {
                continue;
            }
            for id in &p.slots {
                if let Some(addr) = self.backends.addr(*id) {
                    out.insert((p.value.service_id, addr));
                }
            }
        }
        out
    }
}
