//! The counters the sources (the API watches, the manifests directory) and the sync
//! report into: objects skipped by kind and cause, watch relists and errors. They live
//! here, below the agent, so the sources do not depend on it; `agent::metrics` registers
//! them (same Prometheus families) and serves them.

use prometheus_client::{
    encoding::EncodeLabelSet,
    metrics::{counter::Counter, family::Family},
};

use super::skips::{SkipKind, SkipReason};

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct KindReason {
    pub kind: String,
    pub reason: String,
}

/// client-go's `rest_client_requests_total` labels.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct RestRequest {
    pub code: String,
    pub method: String,
    pub host: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct Resource {
    pub resource: String,
}

/// Cheap to clone: every clone counts into the same families.
#[derive(Clone, Debug, Default)]
pub struct SourceCounters {
    /// `objects_skipped_total{kind, reason}`: objects not used.
    pub objects_skipped: Family<KindReason, Counter>,
    /// `watch_restarts_total{resource}`: watch relists.
    pub watch_restarts: Family<Resource, Counter>,
    /// `watch_errors_total{resource}`: watch stream errors.
    pub watch_errors: Family<Resource, Counter>,
    /// `rest_client_requests_total{code, method, host}` (client-go's name): requests to
    /// the API server by HTTP status (`<error>` when none came back).
    pub rest_requests: Family<RestRequest, Counter>,
}

impl SourceCounters {
    /// One API request to `host` answered with `code` (`None`: no answer).
    pub fn rest_request(&self, method: &str, host: &str, code: Option<u16>) {
        self.rest_requests
            .get_or_create(&RestRequest {
                code: code.map_or_else(|| "<error>".to_string(), |c| c.to_string()),
                method: method.to_string(),
                host: host.to_string(),
            })
            .inc();
    }

    /// Counts an object (or a part of it, or a manifests file) not used, under the
    /// labels of [`SkipKind`] and [`SkipReason`] (`objects_skipped_total`).
    pub fn skipped(&self, kind: SkipKind, reason: SkipReason) {
        self.objects_skipped
            .get_or_create(&KindReason {
                kind: kind.label().to_string(),
                reason: reason.label().to_string(),
            })
            .inc();
    }

    /// How many objects of `kind` were skipped for `reason` so far.
    pub fn skipped_count(&self, kind: &str, reason: &str) -> u64 {
        self.objects_skipped
            .get_or_create(&KindReason {
                kind: kind.to_string(),
                reason: reason.to_string(),
            })
            .get()
    }

    pub fn watch_restarted(&self, resource: &str) {
        self.watch_restarts
            .get_or_create(&Resource {
                resource: resource.to_string(),
            })
            .inc();
    }

    pub fn watch_failed(&self, resource: &str) {
        self.watch_errors
            .get_or_create(&Resource {
                resource: resource.to_string(),
            })
            .inc();
    }
}
