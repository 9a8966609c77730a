//! Health-check NodePorts (`spec.healthCheckNodePort` of `externalTrafficPolicy: Local`
//! LoadBalancer Services), as kube-proxy serves them: cloud load balancers probe
//! `http://<node>:<port>/` and send traffic only to nodes answering 200, which this node
//! does when it has a ready local endpoint (the body names the count); 503 otherwise.

use std::{
    collections::{BTreeMap, HashMap},
    net::{IpAddr, Ipv6Addr, SocketAddr},
    sync::{Arc, Mutex},
};

use tokio::{net::TcpListener, task::JoinHandle};
use tracing::{info, warn};

use crate::cluster::ObjKey;

type State = Arc<Mutex<(ObjKey, usize)>>;

/// The listeners, one per health-check port, updated after every sync.
#[derive(Default)]
pub struct HealthChecks {
    servers: HashMap<u16, (State, JoinHandle<()>)>,
}

impl HealthChecks {
    /// Starts, updates and stops listeners to match `wanted` (port -> Service, local
    /// ready endpoints). A port that cannot be bound is logged and retried next time.
    pub async fn update(&mut self, wanted: BTreeMap<u16, (ObjKey, usize)>) {
        self.servers.retain(|port, (_, task)| {
            let keep = wanted.contains_key(port);
            if !keep {
                task.abort();
                info!(port, "health-check node port closed");
            }
            keep
        });
        for (port, state) in wanted {
            if let Some((s, _)) = self.servers.get(&port) {
                *s.lock().unwrap_or_else(|p| p.into_inner()) = state;
                continue;
            }
            // Dual-stack wildcard: answers on every node address.
            let addr = SocketAddr::new(IpAddr::V6(Ipv6Addr::UNSPECIFIED), port);
            let listener = match TcpListener::bind(addr).await {
                Ok(l) => l,
                Err(e) => {
                    warn!(port, service = %state.0, "health-check node port {port} for Service {}: {e}", state.0);
                    continue;
                }
            };
            info!(port, service = %state.0, "health-check node port open");
            let shared: State = Arc::new(Mutex::new(state));
            let task = tokio::spawn(serve(listener, shared.clone()));
            self.servers.insert(port, (shared, task));
        }
    }
}

impl Drop for HealthChecks {
    fn drop(&mut self) {
        for (_, task) in self.servers.values() {
            task.abort();
        }
    }
}

async fn serve(listener: TcpListener, state: State) {
    super::http::serve(
        listener,
        "health-check node port",
        super::http::Limits::default(),
        move |_path| {
            let (key, local) = state.lock().unwrap_or_else(|p| p.into_inner()).clone();
            let status = if local > 0 {
                "200 OK"
            } else {
                "503 Service Unavailable"
            };
            super::http::Reply {
                status,
                content_type: "application/json",
                headers: "X-Content-Type-Options: nosniff\r\n",
                body: format!(
                    "{{\"service\":{{\"namespace\":\"{}\",\"name\":\"{}\"}},\"localEndpoints\":{local}}}\n",
                    key.namespace, key.name
                ),
            }
        },
    )
    .await;
}
