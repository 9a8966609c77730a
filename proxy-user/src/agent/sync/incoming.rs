//! An object as the syncer takes it: reduced (by the API reader already, else here),
//! then the agent's rules applied to a Service (its load-balancing algorithm, the
//! allowed externalIPs, no SCTP); what does not validate is logged and counted.

use k8s_openapi::api::core::v1::Node;
use tracing::warn;

use super::syncer::Syncer;
use crate::{
    cluster::{
        lb_algorithm::{self, LbAlgorithm},
        objects::{ObjKey, ServiceInfo, SliceInfo},
        skips::{SkipKind, SkipReason},
        Object, Reduced,
    },
    model::Proto,
    store::MapStore,
};

impl<S: MapStore> Syncer<S> {
    /// The Service's algorithm for external traffic: its `ebpf-proxy.io/lb-algorithm`
    /// annotation (`value`), else `--lb-algorithm`. An unknown value is said, counted
    /// (`objects_skipped_total{kind="Service",reason="lb_algorithm_unknown"}`) and the
    /// default used: the Service is still programmed.
    fn lb_algorithm(&self, key: &ObjKey, value: Option<&str>) -> LbAlgorithm {
        match value.map(str::parse::<LbAlgorithm>) {
            Some(Ok(a)) => a,
            None => self.lb_default,
            Some(Err(_)) => {
                let value = value.unwrap_or_default();
                warn!(
                    service = %key, value = %value,
                    "Service {key}: annotation {}: {value:?} is not random or maglev; using the default ({})",
                    lb_algorithm::ANNOTATION, self.lb_default
                );
                self.metrics
                    .skipped(SkipKind::SERVICE, SkipReason::LbAlgorithmUnknown);
                self.lb_default
            }
        }
    }

    /// An object as the syncer takes it: reduced (by the API reader already, else here).
    pub(super) fn reduce(&self, obj: Object) -> Incoming {
        let proxy = self.proxy_name.as_deref();
        match obj {
            Object::Service(svc) => Incoming::Service(Reduced {
                key: obj_key(&svc.metadata),
                info: ServiceInfo::from_k8s(&svc, proxy),
                tag: svc
                    .metadata
                    .annotations
                    .as_ref()
                    .and_then(|a| a.get(lb_algorithm::ANNOTATION))
                    .map(|v| Box::from(v.as_str())),
            }),
            Object::ReducedService(r) => Incoming::Service(*r),
            Object::Slice(s) => Incoming::Slice(Reduced::slice(obj_key(&s.metadata), &s, proxy)),
            Object::ReducedSlice(r) => Incoming::Slice(*r),
            Object::Node(n) => Incoming::Node(n),
            Object::ServiceCidr(c) => Incoming::ServiceCidr(c),
            // The socket-LB bypass's kinds go to `crate::podbypass`, never to the syncer.
            Object::Pod(_) | Object::Namespace(_) => Incoming::NotSynced,
        }
    }

    /// A reduced Service, with the agent's rules applied (its algorithm, the allowed
    /// externalIPs, no SCTP); `Err`: unusable, logged and counted.
    pub(super) fn service_info(&self, r: Reduced<ServiceInfo>) -> Result<Option<ServiceInfo>, ()> {
        let key = &r.key;
        let mut info = r.info.map_err(|skip| {
            warn!(service = %key, reason = skip.label(), "skipping Service {key}: {skip}");
            self.metrics
                .skipped(SkipKind::SERVICE, SkipReason::Object(&skip));
        })?;
        if let Some(info) = info.as_mut() {
            info.maglev = self.lb_algorithm(key, r.tag.as_deref()) == LbAlgorithm::Maglev;
            for ip in self.external_ips.apply(info) {
                warn!(
                    service = %key, external_ip = %ip,
                    "Service {key}: externalIP {ip} is outside --external-ip-cidrs; not programmed"
                );
                self.metrics
                    .skipped(SkipKind::SERVICE, SkipReason::ExternalIpNotAllowed);
            }
            // Neither datapath parses SCTP (the TC programs handle TCP and UDP; the kernel
            // here has no SCTP to test the socket hooks with): such a port is left out,
            // said and counted, and the Service's other ports work.
            if info.ports.iter().any(|p| p.proto == Proto::Sctp) {
                for p in info.ports.iter().filter(|p| p.proto == Proto::Sctp) {
                    warn!(
                        service = %key, port = p.port,
                        "Service {key}: port {} is SCTP, which ebpf-proxy does not serve; not programmed",
                        p.port
                    );
                    self.metrics
                        .skipped(SkipKind::SERVICE, SkipReason::SctpNotSupported);
                }
                info.ports = info
                    .ports
                    .iter()
                    .filter(|p| p.proto != Proto::Sctp)
                    .cloned()
                    .collect();
            }
        }
        Ok(info)
    }

    pub(super) fn slice_info(&self, r: Reduced<SliceInfo>) -> Result<Option<SliceInfo>, ()> {
        let key = &r.key;
        r.info.map_err(|skip| {
            warn!(endpointslice = %key, reason = skip.label(), "skipping EndpointSlice {key}: {skip}");
            self.metrics.skipped(SkipKind::ENDPOINT_SLICE, SkipReason::Object(&skip));
        })
    }
}

fn obj_key(meta: &k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta) -> ObjKey {
    ObjKey::new(
        meta.namespace.clone().unwrap_or_default(),
        meta.name.clone().unwrap_or_default(),
    )
}

/// An object reduced for the syncer.
pub(super) enum Incoming {
    Service(Reduced<ServiceInfo>),
    Slice(Reduced<SliceInfo>),
    Node(Box<Node>),
    ServiceCidr(Box<crate::cluster::ServiceCidrInfo>),
    /// A kind the syncer does not read (Pods, Namespaces).
    NotSynced,
}
