//! Services held at their pinned state: at start, an object of a Service that does not
//! validate (and has no earlier version) keeps the frontends the pinned maps hold for
//! that Service until a valid version arrives or the object goes.

use std::{collections::BTreeSet, time::Instant};

use tracing::info;

use super::syncer::Syncer;
use crate::{
    cluster::{objects::ObjKey, Kind},
    fasthash::HashMap,
    model::Frontend,
    store::MapStore,
};

impl<S: MapStore> Syncer<S> {
    /// At start (before the first sync), `object` of Service `service` does not validate
    /// and no earlier version is known: the frontends the pinned maps hold for that
    /// Service stay as they are until a valid version arrives.
    pub(super) fn hold(&mut self, service: ObjKey, object: (Kind, ObjKey)) {
        if self.synced_once {
            return;
        }
        let pinned = self.pinned.get_or_insert_with(|| {
            let mut by_service: HashMap<ObjKey, BTreeSet<Frontend>> = HashMap::default();
            for (fe, name) in self.writer.expected_dump().revnat.into_values() {
                // `namespace/name:port` (see `cluster::index`).
                let svc = name.split(':').next().unwrap_or("");
                if let Some((ns, n)) = svc.split_once('/') {
                    by_service.entry(ObjKey::new(ns, n)).or_default().insert(fe);
                }
            }
            by_service
        });
        let mut frontends = pinned.get(&service).cloned().unwrap_or_default();
        // Names are truncated in the maps: the Service's own frontends, when known.
        let programmed: BTreeSet<Frontend> = self.writer.frontends().copied().collect();
        frontends.extend(
            self.index
                .entries(&service)
                .into_iter()
                .map(|e| e.frontend)
                .filter(|fe| programmed.contains(fe)),
        );
        if frontends.is_empty() {
            return;
        }
        info!(
            service = %service, object = %object.1, frontends = frontends.len(),
            "{} {} does not validate: Service {service} keeps what the pinned maps hold for it until a valid version arrives",
            object.0.as_str(), object.1
        );
        let held = self.held.entry(service).or_default();
        held.objects.insert(object);
        held.frontends.extend(frontends);
    }

    /// A valid version of `key` (or its deletion) arrived: Services held for it are
    /// synced again.
    pub(super) fn release(&mut self, kind: Kind, key: &ObjKey, now: Instant) {
        if self.held.is_empty() {
            return;
        }
        let object = (kind, key.clone());
        let mut freed = Vec::new();
        for (svc, held) in self.held.iter_mut() {
            if held.objects.remove(&object) && held.objects.is_empty() {
                freed.push(svc.clone());
            }
        }
        for svc in freed {
            info!(service = %svc, "Service {svc}: no longer held at its pinned state");
            self.held.remove(&svc);
            self.touch([svc], now);
        }
    }
}
