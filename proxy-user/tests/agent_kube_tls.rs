//! The agent talking to the API server as a pod does: HTTPS with the cluster's CA, a
//! service-account token from the projected volume the kubelet mounts (found through
//! `KUBERNETES_SERVICE_HOST`/`_PORT`, no kubeconfig), the token rotated and the old one
//! revoked while it watches, RBAC exactly as shipped in `deploy/base/rbac.yaml`; also a
//! kubeconfig with a client certificate, a role that is too narrow (403) and a wrong CA.
//! The fake kube-apiserver (`proxy_testbed::apiserver`, `start_tls`) serves HTTPS with
//! its own CA, answers 401/403 with kube-apiserver's Status bodies and records what each
//! user was allowed and refused. Needs root (cgroup, bpffs, mount namespaces); fails
//! without it.

mod support;

use std::{
    io,
    net::SocketAddr,
    path::Path,
    time::{Duration, Instant},
};

use serde_json::{json, Value};
use support::{
    apiserver::{FakeApiServer, ServiceAccountVolume},
    tcp_ask, unique, AgentProcess, TestEnv, Topology,
};

const TARGET: u16 = 8080;
/// The user a token of the shipped ServiceAccount authenticates as.
const SA_USER: &str = "system:serviceaccount:ebpf-proxy:ebpf-proxy";
/// The ClusterRole and binding as shipped.
const RBAC: &str = include_str!("../../deploy/base/rbac.yaml");

/// Run by `unshare --mount` (a private mount namespace, so nothing here is seen by the
/// machine): the service-account volume bind-mounted read-only where a pod has it. The
/// machine has no `/run/secrets` and the test must not create one, so a small tmpfs over
/// `/run` (`/var/run` is a symlink to it) holds the mount point, in this namespace only.
const MOUNT_SERVICE_ACCOUNT: &str = r#"set -e
mount -t tmpfs -o size=1m,mode=755 ebpf-proxy-test /run
mkdir -p /var/run/secrets/kubernetes.io/serviceaccount
mount --bind "$SA_DIR" /var/run/secrets/kubernetes.io/serviceaccount
mount -o remount,bind,ro /var/run/secrets/kubernetes.io/serviceaccount
exec "$@""#;

fn vip(last: u8) -> SocketAddr {
    SocketAddr::from(([10, 96, 0, last], 80))
}

fn service(name: &str, last: u8) -> Value {
    json!({
        "apiVersion": "v1", "kind": "Service",
        "metadata": {"namespace": "default", "name": name},
        "spec": {"type": "ClusterIP", "clusterIP": format!("10.96.0.{last}"),
                 "clusterIPs": [format!("10.96.0.{last}")],
                 "ports": [{"name": "http", "port": 80, "protocol": "TCP", "targetPort": "http"}]}
    })
}

fn slice(name: &str, service: &str, pods: &[usize]) -> Value {
    let eps: Vec<Value> = pods
        .iter()
        .map(|i| json!({"addresses": [Topology::pod_v4(*i).to_string()], "conditions": {"ready": true}, "nodeName": "node-a"}))
        .collect();
    json!({
        "apiVersion": "discovery.k8s.io/v1", "kind": "EndpointSlice",
        "metadata": {"namespace": "default", "name": name,
                     "labels": {"kubernetes.io/service-name": service}},
        "addressType": "IPv4",
        "ports": [{"name": "http", "port": TARGET, "protocol": "TCP"}],
        "endpoints": eps
    })
}

fn node() -> Value {
    json!({"apiVersion": "v1", "kind": "Node", "metadata": {"name": "node-a", "labels": {"topology.kubernetes.io/zone": "zone-a"}}})
}

/// An API server with the `web` Service on pod1 and this node.
fn api_with_web(api: FakeApiServer) -> FakeApiServer {
    api.apply(service("web", 10));
    api.apply(slice("web-1", "web", &[1]));
    api.apply(node());
    api
}

/// Polls `addr` from the client namespace until a reply comes from `pod` 5 times in a row.
fn until_from(env: &TestEnv, addr: SocketAddr, limit: Duration, pod: &str) -> Duration {
    env.in_client(|| {
        let start = Instant::now();
        let mut streak = 0;
        let mut first = Duration::ZERO;
        while start.elapsed() < limit {
            let at = start.elapsed();
            let reply: io::Result<(String, SocketAddr)> = tcp_ask(addr);
            if matches!(&reply, Ok((p, _)) if p == pod) {
                if streak == 0 {
                    first = at;
                }
                streak += 1;
                if streak == 5 {
                    return first;
                }
            } else {
                streak = 0;
                std::thread::sleep(Duration::from_millis(5));
            }
        }
        panic!("{addr}: no answer from {pod} within {limit:?}");
    })
}

/// Waits until `what` holds, or fails naming `condition`.
fn wait_for(limit: Duration, condition: &str, what: impl Fn() -> bool) {
    let start = Instant::now();
    while !what() {
        assert!(start.elapsed() < limit, "not within {limit:?}: {condition}");
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// The agent as a pod runs it: no kubeconfig, the in-cluster environment, the
/// service-account volume mounted at its path in a private mount namespace.
fn start_in_pod(env: &TestEnv, api: &FakeApiServer, sa: &ServiceAccountVolume) -> AgentProcess {
    let port = api.addr().port().to_string();
    AgentProcess::start_wrapped(
        env,
        &[
            "unshare",
            "--mount",
            "--propagation",
            "private",
            "sh",
            "-c",
            MOUNT_SERVICE_ACCOUNT,
            "sh",
        ],
        &[
            ("SA_DIR", sa.dir.to_str().expect("utf-8")),
            ("KUBERNETES_SERVICE_HOST", "127.0.0.1"),
            ("KUBERNETES_SERVICE_PORT", &port),
            // Nothing to fall back on.
            ("KUBECONFIG", "/nonexistent"),
        ],
        // Pod interfaces (a name no interface has: nothing is attached) turn the socket-LB
        // bypass's Pod and Namespace watches on, so the RBAC check covers them.
        &[
            "--socket-lb",
            "all",
            "--pod-interfaces",
            &format!("nopod{}", std::process::id()),
        ],
    )
}

fn rejected_with(api: &FakeApiServer, code: &str) -> Vec<String> {
    api.rejected_requests()
        .into_iter()
        .filter(|r| r.starts_with(code))
        .collect()
}

/// In-cluster config over HTTPS with the shipped RBAC; the token rotated (kubelet-style
/// atomic swap) and the old one revoked mid-watch; then a window with no valid token at
/// all (401s) until the next rotation. The agent follows every change without a restart,
/// uses exactly what its ClusterRole grants and is never refused (403).
#[test]
fn agent_in_cluster_follows_token_rotation_with_the_shipped_rbac() {
    let mut env = TestEnv::without_datapath(3);
    env.serve_all(TARGET);
    let api = api_with_web(FakeApiServer::start_tls());
    api.enforce_rbac(RBAC);
    let tokens = ["token-one", "token-two", "token-three"].map(|t| format!("{t}-{}", unique("")));
    api.add_token(&tokens[0], SA_USER);
    let sa_dir = std::env::temp_dir().join(unique("ebpf-proxy-sa-"));
    let mut sa = ServiceAccountVolume::create(&sa_dir, &tokens[0], &api.ca_pem(), "ebpf-proxy");
    let host_had_secrets = Path::new("/run/secrets").exists();

    let mut agent = start_in_pod(&env, &api, &sa);
    agent.wait_healthy(Duration::from_secs(20));
    until_from(&env, vip(10), Duration::from_secs(5), "pod1");
    assert_eq!(
        Path::new("/run/secrets").exists(),
        host_had_secrets,
        "the service-account mount stays inside the agent's mount namespace"
    );
    assert!(
        api.decoded_requests()
            .iter()
            .all(|r| !r.contains("kubeconfig")),
        "in-cluster config only"
    );

    // Rotation as the kubelet does it, then the old token revoked: the watches are cut
    // (as a restarting apiserver or a load balancer would), so every re-list and re-watch
    // must carry the new token. kube's own auth layer would send the cached old token for
    // up to a minute and get 401s.
    api.add_token(&tokens[1], SA_USER);
    sa.rotate(&tokens[1]);
    api.revoke_token(&tokens[0]);
    api.drop_watches();
    api.apply(slice("web-1", "web", &[2]));
    let after_rotation = until_from(&env, vip(10), Duration::from_secs(10), "pod2");
    eprintln!("token rotated, old one revoked: change -> traffic in {after_rotation:?}");
    assert!(
        rejected_with(&api, "401").is_empty(),
        "the rotated token is used from the first request after the swap: {:#?}",
        api.rejected_requests()
    );
    assert!(
        agent.logs().contains("the API token changed"),
        "{}",
        agent.logs()
    );

    // No valid token for a while: the agent is refused (401), keeps serving what it has,
    // and recovers by itself once the kubelet writes a valid token.
    api.revoke_token(&tokens[1]);
    api.drop_watches();
    wait_for(
        Duration::from_secs(10),
        "the agent's re-watch with a revoked token is answered 401",
        || !rejected_with(&api, "401").is_empty(),
    );
    until_from(&env, vip(10), Duration::from_secs(2), "pod2");
    api.add_token(&tokens[2], SA_USER);
    sa.rotate(&tokens[2]);
    api.apply(slice("web-1", "web", &[3]));
    let recovered = until_from(&env, vip(10), Duration::from_secs(40), "pod3");
    eprintln!("after a 401 window: change -> traffic in {recovered:?}");
    assert!(
        agent.child.try_wait().expect("wait").is_none(),
        "no restart"
    );

    // RBAC as shipped: nothing refused, and every rule used.
    assert!(
        rejected_with(&api, "403").is_empty(),
        "the agent asked for something its ClusterRole does not grant: {:#?}",
        rejected_with(&api, "403")
    );
    let used = api.permissions_used(SA_USER);
    let granted = api.rbac_granted(SA_USER);
    assert_eq!(
        used, granted,
        "deploy/base/rbac.yaml must grant exactly what the agent uses (used, granted)"
    );
    drop(agent);
    let _ = std::fs::remove_dir_all(sa_dir);
}

/// A kubeconfig with a client certificate (the x509 authenticator's user is its CN).
#[test]
fn agent_with_a_client_certificate_kubeconfig() {
    let mut env = TestEnv::without_datapath(2);
    env.serve_all(TARGET);
    let api = api_with_web(FakeApiServer::start_tls());
    let kubeconfig = std::env::temp_dir().join(unique("ebpf-proxy-kubeconfig-cert-"));
    api.write_kubeconfig_with_client_cert(&kubeconfig, "ebpf-proxy-node-a");
    let mut agent =
        AgentProcess::start(&env, &["--kubeconfig", kubeconfig.to_str().expect("utf-8")]);
    agent.wait_healthy(Duration::from_secs(20));
    until_from(&env, vip(10), Duration::from_secs(5), "pod1");
    api.apply(slice("web-1", "web", &[2]));
    until_from(&env, vip(10), Duration::from_secs(5), "pod2");
    assert!(
        api.rejected_requests().is_empty(),
        "{:#?}",
        api.rejected_requests()
    );
    assert!(
        api.permissions_used("ebpf-proxy-node-a").contains(&(
            String::new(),
            "services".into(),
            "watch".into()
        )),
        "requests authenticated as the certificate's CN"
    );
    drop(agent);
    for ext in ["", ".crt", ".key", ".ca.crt"] {
        let _ = std::fs::remove_file(format!("{}{ext}", kubeconfig.display()));
    }
}

/// A role without `watch` on EndpointSlices: the watch is refused with kube-apiserver's
/// 403, the agent says so in its log and does not report itself synced.
#[test]
fn agent_refused_by_a_narrower_role_says_so() {
    let env = TestEnv::without_datapath(1);
    let api = api_with_web(FakeApiServer::start_tls());
    let narrow = RBAC.replace(
        "    resources: [endpointslices]\n    verbs: [list, watch]",
        "    resources: [endpointslices]\n    verbs: [list]",
    );
    assert_ne!(narrow, RBAC, "the test's edit of rbac.yaml applies");
    api.enforce_rbac(&narrow);
    let token = unique("token-");
    api.add_token(&token, SA_USER);
    let kubeconfig = std::env::temp_dir().join(unique("ebpf-proxy-kubeconfig-token-"));
    api.write_kubeconfig_with_token(&kubeconfig, &token);
    let agent = AgentProcess::start(&env, &["--kubeconfig", kubeconfig.to_str().expect("utf-8")]);
    wait_for(
        Duration::from_secs(20),
        "the EndpointSlice watch is refused with 403",
        || !rejected_with(&api, "403").is_empty(),
    );
    let refused = rejected_with(&api, "403");
    assert!(
        refused[0].contains("endpointslices is forbidden: User \"system:serviceaccount:ebpf-proxy:ebpf-proxy\" cannot watch resource \"endpointslices\" in API group \"discovery.k8s.io\" at the cluster scope"),
        "{refused:#?}"
    );
    wait_for(
        Duration::from_secs(10),
        "the agent logs the refusal",
        || agent.logs().contains("forbidden"),
    );
    drop(agent);
    for ext in ["", ".ca.crt"] {
        let _ = std::fs::remove_file(format!("{}{ext}", kubeconfig.display()));
    }
}

/// A CA that did not sign the server's certificate: no request is served, and the agent's
/// log says why.
#[test]
fn agent_refuses_a_server_its_ca_did_not_sign() {
    let env = TestEnv::without_datapath(1);
    let api = api_with_web(FakeApiServer::start_tls());
    let other = FakeApiServer::start_tls();
    let token = unique("token-");
    api.add_token(&token, SA_USER);
    let kubeconfig = std::env::temp_dir().join(unique("ebpf-proxy-kubeconfig-wrong-ca-"));
    api.write_kubeconfig_with_token(&kubeconfig, &token);
    // The kubeconfig's CA file replaced by another cluster's CA.
    std::fs::write(format!("{}.ca.crt", kubeconfig.display()), other.ca_pem()).expect("CA");
    let agent = AgentProcess::start(&env, &["--kubeconfig", kubeconfig.to_str().expect("utf-8")]);
    wait_for(
        Duration::from_secs(20),
        "the agent logs the certificate error",
        || {
            agent
                .logs()
                .contains("invalid peer certificate: UnknownIssuer")
        },
    );
    assert!(api.requests().is_empty(), "{:#?}", api.requests());
    assert_ne!(agent.healthz().0, 200, "not synced without the API");
    drop(agent);
    for ext in ["", ".ca.crt"] {
        let _ = std::fs::remove_file(format!("{}{ext}", kubeconfig.display()));
    }
}

/// For `d`: connections to `addr` from the client, each answered by `pod`, and
/// `/healthz`, each 200; what failed.
fn ride_out(
    env: &TestEnv,
    agent: &AgentProcess,
    addr: SocketAddr,
    pod: &str,
    d: Duration,
) -> (usize, Vec<String>) {
    let start = Instant::now();
    let (mut asked, mut failed) = (0, Vec::new());
    while start.elapsed() < d {
        asked += 1;
        match env.in_client(|| tcp_ask(addr)) {
            Ok((p, _)) if p == pod => {}
            other => failed.push(format!("{:?}: {addr}: {other:?}", start.elapsed())),
        }
        let (code, body) = agent.healthz();
        if code != 200 {
            failed.push(format!("{:?}: /healthz {code} {body}", start.elapsed()));
        }
        std::thread::sleep(Duration::from_millis(100));
    }
    (asked, failed)
}

/// The API server overloaded (429 with Retry-After, as its max-in-flight filter answers),
/// then failing (500s), then restarting (down for 8 s, its history gone) while the agent
/// re-watches: traffic keeps flowing through what is programmed and `/healthz` stays 200
/// throughout (kube-proxy's rule: nothing was queued and left unsynced; with
/// `--sync-interval 2s` its stale limit is 4 s, inside each fault), kube's client waits
/// the Retry-After, the agent backs off after the 500s and relists after the restart,
/// and every change made meanwhile arrives once the server answers again.
#[test]
fn agent_rides_out_429_500_and_a_restart() {
    let mut env = TestEnv::without_datapath(3);
    env.serve_all(TARGET);
    let api = api_with_web(FakeApiServer::start_tls());
    let token = unique("token-");
    api.add_token(&token, SA_USER);
    let kubeconfig = std::env::temp_dir().join(unique("ebpf-proxy-kubeconfig-faults-"));
    api.write_kubeconfig_with_token(&kubeconfig, &token);
    let mut agent = AgentProcess::start(
        &env,
        &[
            "--kubeconfig",
            kubeconfig.to_str().expect("utf-8"),
            "--sync-interval",
            "2s",
        ],
    );
    agent.wait_healthy(Duration::from_secs(20));
    until_from(&env, vip(10), Duration::from_secs(5), "pod1");

    // 429 with Retry-After: 1 for the next 4 requests (the four re-watches: Services,
    // EndpointSlices, Nodes, ServiceCIDRs).
    api.fail_requests(429, 4, Some(1));
    let start = Instant::now();
    api.drop_watches();
    api.apply(slice("web-1", "web", &[2]));
    until_from(&env, vip(10), Duration::from_secs(15), "pod2");
    let after_429 = start.elapsed();
    eprintln!("4 x 429 (Retry-After: 1): change -> traffic in {after_429:?}");
    assert_eq!(api.failed_requests(429), 4, "every 429 was met");
    assert!(
        after_429 >= Duration::from_millis(900),
        "the Retry-After of 1 s was honoured: {after_429:?}"
    );

    // 500s: 12 in a row (three per watch); traffic goes on meanwhile.
    api.fail_requests(500, 12, None);
    api.drop_watches();
    api.apply(slice("web-1", "web", &[3]));
    wait_for(
        Duration::from_secs(10),
        "the 500s are being answered",
        || api.failed_requests(500) >= 3,
    );
    let (asked, failed) = ride_out(&env, &agent, vip(10), "pod2", Duration::from_secs(5));
    eprintln!("during the 500s: {asked} connections and /healthz probes");
    assert!(failed.is_empty(), "during the 500s: {failed:#?}");
    let recovered = until_from(&env, vip(10), Duration::from_secs(40), "pod3");
    eprintln!("12 x 500: traffic moved {recovered:?} after the first 500s were seen");
    assert_eq!(api.failed_requests(500), 12, "every 500 was met");
    assert!(
        agent.logs().contains("500"),
        "the agent logs the server error: {}",
        agent.logs()
    );

    // A restart: down for 8 s (connections refused), back with its history gone (the
    // watches get 410 and relist); a change made while it was down arrives.
    api.stop();
    let (asked, failed) = ride_out(&env, &agent, vip(10), "pod3", Duration::from_secs(8));
    eprintln!("API server down: {asked} connections and /healthz probes");
    assert!(
        failed.is_empty(),
        "while the API server was down: {failed:#?}"
    );
    api.apply(slice("web-1", "web", &[1]));
    api.restart();
    let back = until_from(&env, vip(10), Duration::from_secs(45), "pod1");
    eprintln!("API server restarted: the change reached traffic in {back:?}");
    assert_eq!(agent.healthz().0, 200);
    assert!(
        agent.child.try_wait().expect("wait").is_none(),
        "no restart"
    );
    drop(agent);
    for ext in ["", ".ca.crt"] {
        let _ = std::fs::remove_file(format!("{}{ext}", kubeconfig.display()));
    }
}

/// The sum of `name`'s samples whose labels contain `label` in a `/metrics` text.
fn metric_sum(text: &str, name: &str, label: &str) -> f64 {
    text.lines()
        .filter(|l| l.starts_with(&format!("{name}{{")) && l.contains(label))
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum()
}

/// The API server goes silent (it accepts and reads but answers nothing; its watches
/// send no event and no bookmark), as a hung apiserver or a path dropping its packets
/// looks, for 20 s, four times `--api-idle-timeout 5s` (90 s by default; the issue's
/// 60 s of silence scaled down with it). `--sync-interval 2s` puts `/healthz`'s stale
/// limit at 4 s, far inside the silence. Throughout: the datapath keeps serving what is
/// programmed and `/healthz` stays 200, as kube-proxy's does: its healthz goes stale
/// only when a queued change is not synced in time, and a silent server queues nothing;
/// here the periodic re-diffs keep succeeding. The agent notices the dead watches after
/// the idle timeout and counts the requests that got no answer
/// (`rest_client_requests_total{code="<error>"}`, `ebpf_proxy_watch_errors_total`);
/// once the server answers again, the change made during the silence reaches traffic.
#[test]
fn agent_rides_out_a_silent_apiserver() {
    const IDLE: Duration = Duration::from_secs(5);
    const SILENCE: Duration = Duration::from_secs(20);
    let mut env = TestEnv::without_datapath(2);
    env.serve_all(TARGET);
    let api = api_with_web(FakeApiServer::start_tls());
    let token = unique("token-");
    api.add_token(&token, SA_USER);
    let kubeconfig = std::env::temp_dir().join(unique("ebpf-proxy-kubeconfig-silent-"));
    api.write_kubeconfig_with_token(&kubeconfig, &token);
    let mut agent = AgentProcess::start(
        &env,
        &[
            "--kubeconfig",
            kubeconfig.to_str().expect("utf-8"),
            "--api-idle-timeout",
            "5s",
            "--sync-interval",
            "2s",
        ],
    );
    agent.wait_healthy(Duration::from_secs(20));
    until_from(&env, vip(10), Duration::from_secs(5), "pod1");
    let errors_before = metric_sum(
        &agent.metrics(),
        "rest_client_requests_total",
        "code=\"<error>\"",
    );
    let watches_before = api
        .requests()
        .iter()
        .filter(|r| r.contains("watch=true"))
        .count();

    api.go_silent();
    let silent_at = Instant::now();
    // Made during the silence: the server holds it.
    api.apply(slice("web-1", "web", &[2]));
    let (mut asked, mut failed, mut unhealthy) = (0usize, Vec::new(), Vec::new());
    let mut noticed = None;
    while silent_at.elapsed() < SILENCE {
        asked += 1;
        match env.in_client(|| tcp_ask(vip(10))) {
            Ok((pod, _)) if pod == "pod1" => {}
            other => failed.push(format!("{:?}: {other:?}", silent_at.elapsed())),
        }
        let (code, body) = agent.healthz();
        if code != 200 {
            unhealthy.push(format!("{:?}: {code} {body}", silent_at.elapsed()));
        }
        if noticed.is_none()
            && api
                .requests()
                .iter()
                .filter(|r| r.contains("watch=true"))
                .count()
                > watches_before
        {
            noticed = Some(silent_at.elapsed());
        }
        std::thread::sleep(Duration::from_millis(100));
    }
    eprintln!(
        "{SILENCE:?} silent: {asked} connections, {} failed; /healthz non-200 {} times; \
         first dead watch retried after {noticed:?}",
        failed.len(),
        unhealthy.len()
    );
    assert!(
        failed.is_empty(),
        "the datapath stopped serving: {failed:#?}"
    );
    assert!(unhealthy.is_empty(), "/healthz went stale: {unhealthy:#?}");
    let noticed = noticed.expect("the dead watches were never retried during the silence");
    assert!(
        noticed >= IDLE - Duration::from_millis(200) && noticed < IDLE + Duration::from_secs(10),
        "a dead watch is retried after the idle timeout ({IDLE:?}): {noticed:?}"
    );
    let metrics = agent.metrics();
    let errors = metric_sum(&metrics, "rest_client_requests_total", "code=\"<error>\"");
    assert!(
        errors >= errors_before + 3.0,
        "each reader's unanswered request counted: {errors_before} -> {errors}"
    );
    assert!(
        metric_sum(&metrics, "ebpf_proxy_watch_errors_total", "resource=") >= 3.0,
        "{metrics}"
    );

    api.answer_again();
    let answered_at = Instant::now();
    until_from(&env, vip(10), Duration::from_secs(45), "pod2");
    eprintln!(
        "the change made during the silence reached traffic {:?} after the server answered",
        answered_at.elapsed()
    );
    assert_eq!(agent.healthz().0, 200);
    assert!(
        agent.child.try_wait().expect("wait").is_none(),
        "no restart"
    );
    drop(agent);
    for ext in ["", ".ca.crt"] {
        let _ = std::fs::remove_file(format!("{}{ext}", kubeconfig.display()));
    }
}

/// A role without the ServiceCIDR rule (kube-proxy's own `system:node-proxier` before
/// the API went GA, or a cluster whose apiserver does not serve it): the list is refused
/// with 403, the agent says so once, goes on without the API's Service CIDRs and serves
/// every Service; it is never stuck waiting for them.
#[test]
fn a_role_without_servicecidrs_still_serves_and_says_so() {
    let mut env = TestEnv::without_datapath(1);
    env.serve_all(TARGET);
    let api = api_with_web(FakeApiServer::start_tls());
    let rule = "  - apiGroups: [networking.k8s.io]\n    resources: [servicecidrs]\n    verbs: [list, watch]\n";
    let narrow = RBAC.replace(rule, "");
    assert_ne!(narrow, RBAC, "the test's edit of rbac.yaml applies");
    api.enforce_rbac(&narrow);
    let token = unique("token-");
    api.add_token(&token, SA_USER);
    let kubeconfig = std::env::temp_dir().join(unique("ebpf-proxy-kubeconfig-nocidr-"));
    api.write_kubeconfig_with_token(&kubeconfig, &token);
    let mut agent =
        AgentProcess::start(&env, &["--kubeconfig", kubeconfig.to_str().expect("utf-8")]);
    agent.wait_healthy(Duration::from_secs(20));
    until_from(&env, vip(10), Duration::from_secs(5), "pod1");
    let refused = rejected_with(&api, "403");
    assert!(
        !refused.is_empty() && refused.iter().all(|r| r.contains("servicecidrs")),
        "only the ServiceCIDR list is refused: {refused:#?}"
    );
    assert_eq!(
        agent.logs().matches("cannot list ServiceCIDRs").count(),
        1,
        "said once: {}",
        agent.logs()
    );
    drop(agent);
    for ext in ["", ".ca.crt"] {
        let _ = std::fs::remove_file(format!("{}{ext}", kubeconfig.display()));
    }
}
