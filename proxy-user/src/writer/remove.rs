//! One frontend removed: staged as a [`Plan`] (its entry first, then its further slot
//! chunks, Maglev chunks, source ranges, reverse-NAT entry and the backends only it used), applied,
//! committed to the model or undone.

use super::{plan::Plan, upsert::unique, Programmed, WriteError, Writer};
use crate::{
    model::Frontend,
    store::{chunk_ids, svc_entries, MapStore, Op},
};

impl<S: MapStore> Writer<S> {
    /// Removes one frontend. Returns the number of map operations (0 if it was absent).
    pub fn remove(&mut self, fe: &Frontend) -> Result<usize, WriteError> {
        let Some((plan, old)) = self.stage_remove(fe) else {
            return Ok(0);
        };
        if let Err((source, rollback_failed)) = self.apply_all(&plan.ops, &plan.undo) {
            return Err(WriteError::Store {
                frontend: *fe,
                source,
                rollback_failed,
            });
        }
        self.commit_remove(fe, &old);
        Ok(plan.len())
    }

    /// Plans the removal of one frontend: its entry first, then its slot chunks, source ranges,
    /// reverse-NAT entry and the backends only it used.
    pub(super) fn stage_remove(&self, fe: &Frontend) -> Option<(Plan, Programmed)> {
        let old = self.services.get(fe)?.clone();
        let sid = old.value.service_id;
        let mut plan = Plan::default();
        plan.push(
            Op::DelChunk {
                frontend: *fe,
                chunk: 0,
            },
            Op::PutFrontend {
                frontend: *fe,
                value: old.value,
                backends: chunk_ids(&old.slots, 0).into(),
            },
        );
        for chunk in 1..svc_entries(old.slots.len()) {
            plan.push(
                Op::DelChunk {
                    frontend: *fe,
                    chunk: chunk as u16,
                },
                Op::PutChunk {
                    frontend: *fe,
                    chunk: chunk as u16,
                    backends: chunk_ids(&old.slots, chunk).into(),
                    service_id: sid,
                    trim: false,
                },
            );
        }
        self.stage_remove_maglev(&old, &mut plan);
        for (addr, prefix) in &old.source_ranges {
            let (addr, prefix) = (*addr, *prefix);
            plan.push(
                Op::DelSrcRange {
                    service_id: sid,
                    addr,
                    prefix,
                },
                Op::PutSrcRange {
                    service_id: sid,
                    addr,
                    prefix,
                },
            );
        }
        plan.push(
            Op::DelRevNat {
                service_id: sid,
                family: fe.family(),
            },
            Op::PutRevNat {
                service_id: sid,
                frontend: *fe,
                name: old.name.clone(),
            },
        );
        for id in unique(&old.slots) {
            if let Some((key, 1)) = self.backends.get(id) {
                plan.push(
                    Op::DelBackend {
                        id,
                        family: key.0.family(),
                    },
                    Op::PutBackend {
                        id,
                        backend: key.0,
                        proto: key.1,
                    },
                );
            }
        }
        Some((plan, old))
    }

    /// The removal of a Maglev frontend's table chunks, each undone by the chunk the
    /// writer programmed (or its deletion, if that cannot be recomputed).
    fn stage_remove_maglev(&self, old: &Programmed, plan: &mut Plan) {
        let sid = old.value.service_id;
        if let Some((_, n)) = old.maglev {
            let table = self.programmed_table(old);
            for chunk in 0..n {
                let undo = match table.as_ref().and_then(|t| t.get(chunk as usize)) {
                    Some(c) => Op::PutMaglev {
                        service_id: sid,
                        chunk,
                        value: Box::new(*c),
                        late: false,
                    },
                    None => Op::DelMaglev {
                        service_id: sid,
                        chunk,
                    },
                };
                plan.push(
                    Op::DelMaglev {
                        service_id: sid,
                        chunk,
                    },
                    undo,
                );
            }
        }
    }

    pub(super) fn commit_remove(&mut self, fe: &Frontend, old: &Programmed) {
        for id in unique(&old.slots) {
            if id != 0 {
                self.unref_backend(id);
            }
        }
        self.free_service_id(old.value.service_id);
        self.services.remove(fe);
    }
}
