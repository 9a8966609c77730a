//! HTTPS, authentication and RBAC, as kube-apiserver does them for a pod's client:
//! - TLS with a CA made per server (rcgen): the server's certificate (for `127.0.0.1`,
//!   `localhost` and `kubernetes.default.svc`) and client certificates are signed by it.
//! - Authentication: a bearer token (`Authorization: Bearer ...`) known to the server, or a
//!   client certificate it issued (user = the certificate's CN, as the x509 authenticator
//!   reads it). Anything else gets `401 Unauthorized` with kube-apiserver's Status body; a
//!   revoked token is unknown from then on.
//! - Authorization: with RBAC enforced ([`super::FakeApiServer::enforce_rbac`]), a
//!   resource request is allowed when a ClusterRole bound to the user (ClusterRoleBinding,
//!   subjects `ServiceAccount` or `User`) has a rule matching its API group, resource and
//!   verb (get, list, watch, create, update, patch, delete, deletecollection; `*`
//!   matches any), else `403 Forbidden` with kube-apiserver's message. Non-resource paths
//!   (`/version`, `/api`, `/apis`, ...) are open to every authenticated user, as the
//!   `system:discovery` role makes them. Users made admins (`grant_all`) are not checked
//!   (like `system:masters`).
//! - Records, per user, which (group, resource, verb) were allowed, and every denied
//!   request, so a test can compare what a client used with what its role grants.

use std::{
    collections::{BTreeMap, BTreeSet, HashMap, HashSet},
    path::{Path, PathBuf},
    sync::Arc,
};

use rcgen::{
    BasicConstraints, CertificateParams, DnType, ExtendedKeyUsagePurpose, IsCa, Issuer, KeyPair,
    KeyUsagePurpose,
};
use rustls::{
    pki_types::{CertificateDer, PrivateKeyDer, PrivatePkcs8KeyDer},
    server::WebPkiClientVerifier,
    RootCertStore, ServerConfig,
};
use serde_json::{json, Value};
use tokio_rustls::TlsAcceptor;

use super::http::{percent_decode, status, Request};

/// (API group, resource, verb), e.g. `("discovery.k8s.io", "endpointslices", "watch")`.
pub type Permission = (String, String, String);

/// The server's TLS material: its CA, the acceptor, and the issuer for client certificates.
pub(super) struct Tls {
    pub(super) acceptor: TlsAcceptor,
    pub(super) ca_pem: String,
    issuer: Issuer<'static, KeyPair>,
}

fn provider() -> Arc<rustls::crypto::CryptoProvider> {
    Arc::new(rustls::crypto::ring::default_provider())
}

impl Tls {
    pub(super) fn new() -> Self {
        let ca_key = KeyPair::generate().expect("generate the fake apiserver's CA key");
        let mut ca = CertificateParams::new(Vec::<String>::new()).expect("CA parameters");
        // Each server's CA its own name, as two clusters' CAs have.
        static SERIAL: std::sync::atomic::AtomicU32 = std::sync::atomic::AtomicU32::new(0);
        let serial = SERIAL.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        ca.distinguished_name.push(
            DnType::CommonName,
            format!("fake-apiserver-ca-{}-{serial}", std::process::id()),
        );
        ca.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
        ca.key_usages = vec![
            KeyUsagePurpose::KeyCertSign,
            KeyUsagePurpose::CrlSign,
            KeyUsagePurpose::DigitalSignature,
        ];
        let ca_cert = ca.self_signed(&ca_key).expect("self-sign the CA");
        let issuer = Issuer::new(ca, ca_key);

        let key = KeyPair::generate().expect("generate the server key");
        let mut params = CertificateParams::new(vec![
            "127.0.0.1".to_owned(),
            "localhost".to_owned(),
            "kubernetes.default.svc".to_owned(),
        ])
        .expect("server certificate parameters");
        params
            .distinguished_name
            .push(DnType::CommonName, "kube-apiserver");
        params.extended_key_usages = vec![ExtendedKeyUsagePurpose::ServerAuth];
        let cert = params
            .signed_by(&key, &issuer)
            .expect("sign the server certificate");

        let mut roots = RootCertStore::empty();
        roots
            .add(ca_cert.der().clone())
            .expect("the CA as a client-certificate root");
        let verifier = WebPkiClientVerifier::builder_with_provider(Arc::new(roots), provider())
            .allow_unauthenticated()
            .build()
            .expect("client certificate verifier");
        let config = ServerConfig::builder_with_provider(provider())
            .with_safe_default_protocol_versions()
            .expect("TLS versions")
            .with_client_cert_verifier(verifier)
            .with_single_cert(
                vec![cert.der().clone()],
                PrivateKeyDer::Pkcs8(PrivatePkcs8KeyDer::from(key.serialize_der())),
            )
            .expect("the server's certificate and key");
        Self {
            acceptor: TlsAcceptor::from(Arc::new(config)),
            ca_pem: ca_cert.pem(),
            issuer,
        }
    }

    /// A client certificate for `user` (CN) signed by the CA: (certificate PEM, key PEM, DER).
    pub(super) fn client_cert(&self, user: &str) -> (String, String, CertificateDer<'static>) {
        let key = KeyPair::generate().expect("generate a client key");
        let mut params = CertificateParams::new(Vec::<String>::new()).expect("client parameters");
        params.distinguished_name.push(DnType::CommonName, user);
        params.extended_key_usages = vec![ExtendedKeyUsagePurpose::ClientAuth];
        let cert = params
            .signed_by(&key, &self.issuer)
            .expect("sign a client certificate");
        (cert.pem(), key.serialize_pem(), cert.der().clone())
    }
}

/// One rule of a ClusterRole.
#[derive(Debug, Clone)]
struct Rule {
    groups: Vec<String>,
    resources: Vec<String>,
    verbs: Vec<String>,
}

impl Rule {
    fn allows(&self, group: &str, resource: &str, verb: &str) -> bool {
        let any = |list: &[String], want: &str| list.iter().any(|v| v == "*" || v == want);
        any(&self.groups, group) && any(&self.resources, resource) && any(&self.verbs, verb)
    }
}

/// ClusterRoles and ClusterRoleBindings as read from manifests.
#[derive(Debug, Default)]
struct Rbac {
    /// user -> the rules of every ClusterRole bound to it.
    rules: HashMap<String, Vec<Rule>>,
}

fn strings(v: &Value) -> Vec<String> {
    v.as_array()
        .map(|a| {
            a.iter()
                .filter_map(|s| s.as_str().map(str::to_owned))
                .collect()
        })
        .unwrap_or_default()
}

impl Rbac {
    /// Reads the ClusterRoles and ClusterRoleBindings of a multi-document YAML.
    fn parse(yaml: &str) -> Result<Self, String> {
        let mut roles: HashMap<String, Vec<Rule>> = HashMap::new();
        let mut bindings: Vec<(String, Vec<String>)> = Vec::new();
        for (i, doc) in serde_yaml::Deserializer::from_str(yaml).enumerate() {
            let doc: Value = serde::Deserialize::deserialize(doc)
                .map_err(|e| format!("RBAC manifest document {i}: {e}"))?;
            let name = doc["metadata"]["name"]
                .as_str()
                .unwrap_or_default()
                .to_owned();
            match doc["kind"].as_str() {
                Some("ClusterRole") => {
                    let rules = doc["rules"]
                        .as_array()
                        .map(|rules| {
                            rules
                                .iter()
                                .map(|r| Rule {
                                    groups: strings(&r["apiGroups"]),
                                    resources: strings(&r["resources"]),
                                    verbs: strings(&r["verbs"]),
                                })
                                .collect()
                        })
                        .unwrap_or_default();
                    roles.insert(name, rules);
                }
                Some("ClusterRoleBinding") => {
                    if doc["roleRef"]["kind"] != "ClusterRole" {
                        return Err(format!(
                            "ClusterRoleBinding {name}: roleRef is not a ClusterRole"
                        ));
                    }
                    let role = doc["roleRef"]["name"]
                        .as_str()
                        .unwrap_or_default()
                        .to_owned();
                    let subjects = doc["subjects"]
                        .as_array()
                        .map(|s| s.iter().filter_map(subject_user).collect())
                        .unwrap_or_default();
                    bindings.push((role, subjects));
                }
                Some("Role") | Some("RoleBinding") => {
                    return Err(format!(
                        "{name}: namespaced RBAC ({}) is not supported by the fake apiserver",
                        doc["kind"]
                    ))
                }
                _ => {}
            }
        }
        let mut rbac = Rbac::default();
        for (role, subjects) in bindings {
            let rules = roles.get(&role).ok_or_else(|| {
                format!("ClusterRoleBinding refers to a missing ClusterRole {role}")
            })?;
            for user in subjects {
                rbac.rules
                    .entry(user)
                    .or_default()
                    .extend(rules.iter().cloned());
            }
        }
        Ok(rbac)
    }
}

/// The user a binding's subject names (ServiceAccounts as the token authenticator names them).
fn subject_user(subject: &Value) -> Option<String> {
    let name = subject["name"].as_str()?;
    match subject["kind"].as_str()? {
        "ServiceAccount" => Some(format!(
            "system:serviceaccount:{}:{name}",
            subject["namespace"].as_str()?
        )),
        "User" => Some(name.to_owned()),
        _ => None,
    }
}

/// Who may do what; see the module documentation.
#[derive(Default)]
pub(super) struct Auth {
    /// Off for a plain-HTTP server: every request is allowed.
    required: bool,
    tokens: HashMap<String, String>,
    certs: HashMap<Vec<u8>, String>,
    admins: HashSet<String>,
    rbac: Option<Rbac>,
    pub(super) used: BTreeMap<String, BTreeSet<Permission>>,
    /// `"CODE user: request line: message"` of every 401 and 403.
    pub(super) rejected: Vec<String>,
}

/// What a request asks to do to which resource.
struct Attributes {
    group: String,
    resource: String,
    namespace: Option<String>,
    name: Option<String>,
    verb: &'static str,
}

fn attributes(request: &Request) -> Option<Attributes> {
    let (path, query) = request
        .target
        .split_once('?')
        .unwrap_or((request.target.as_str(), ""));
    let segments: Vec<String> = path
        .trim_matches('/')
        .split('/')
        .map(percent_decode)
        .collect();
    let s: Vec<&str> = segments.iter().map(String::as_str).collect();
    let (group, rest) = match s[..] {
        ["api", _version, ref rest @ ..] => ("", rest),
        ["apis", group, _version, ref rest @ ..] => (group, rest),
        _ => return None,
    };
    let (namespace, rest) = match rest {
        ["namespaces", ns, rest @ ..] if !rest.is_empty() => (Some((*ns).to_owned()), rest),
        _ => (None, rest),
    };
    let (resource, name) = match rest {
        [resource] => (*resource, None),
        [resource, name] => (*resource, Some((*name).to_owned())),
        // Subresources are not served.
        _ => return None,
    };
    let watch = query
        .split('&')
        .any(|p| matches!(p, "watch=true" | "watch=1"));
    let verb = match (request.method.as_str(), name.is_some()) {
        ("GET", true) => "get",
        ("GET", false) if watch => "watch",
        ("GET", false) => "list",
        ("POST", _) => "create",
        ("PUT", _) => "update",
        ("PATCH", _) => "patch",
        ("DELETE", true) => "delete",
        ("DELETE", false) => "deletecollection",
        _ => return None,
    };
    Some(Attributes {
        group: group.to_owned(),
        resource: resource.to_owned(),
        namespace,
        name,
        verb,
    })
}

impl Auth {
    pub(super) fn new(required: bool) -> Self {
        Self {
            required,
            ..Default::default()
        }
    }

    pub(super) fn add_token(&mut self, token: &str, user: &str) {
        self.tokens.insert(token.to_owned(), user.to_owned());
    }

    pub(super) fn revoke_token(&mut self, token: &str) {
        self.tokens.remove(token);
    }

    pub(super) fn add_cert(&mut self, der: &[u8], user: &str) {
        self.certs.insert(der.to_vec(), user.to_owned());
    }

    pub(super) fn grant_all(&mut self, user: &str) {
        self.admins.insert(user.to_owned());
    }

    pub(super) fn enforce_rbac(&mut self, yaml: &str) -> Result<(), String> {
        self.rbac = Some(Rbac::parse(yaml)?);
        Ok(())
    }

    /// What the RBAC rules bound to `user` grant, one entry per (group, resource, verb)
    /// as written (a `*` stays a `*`).
    pub(super) fn granted(&self, user: &str) -> BTreeSet<Permission> {
        let mut out = BTreeSet::new();
        for rule in self.rbac.iter().flat_map(|r| r.rules.get(user)).flatten() {
            for g in &rule.groups {
                for r in &rule.resources {
                    for v in &rule.verbs {
                        out.insert((g.clone(), r.clone(), v.clone()));
                    }
                }
            }
        }
        out
    }

    /// Authenticates and authorizes `request` (arriving with the client certificate
    /// `peer_cert`, if any): `Err((code, Status))` to answer instead of serving it.
    pub(super) fn check(
        &mut self,
        request: &Request,
        peer_cert: Option<&[u8]>,
    ) -> Result<(), (u16, Value)> {
        if !self.required {
            return Ok(());
        }
        let bearer = request
            .authorization
            .as_deref()
            .and_then(|a| a.strip_prefix("Bearer "))
            .map(str::trim);
        let user = match bearer {
            // A token that is sent is checked, whatever else the request carries.
            Some(token) => self.tokens.get(token).cloned(),
            None => peer_cert.and_then(|der| self.certs.get(der).cloned()),
        };
        let Some(user) = user else {
            self.rejected
                .push(format!("401 anonymous: {}: Unauthorized", request.line));
            return Err((401, status(401, "Unauthorized", "Unauthorized")));
        };
        let Some(attrs) = attributes(request) else {
            // Non-resource URLs: discovery and /version, open to authenticated users.
            return Ok(());
        };
        let permission = (
            attrs.group.clone(),
            attrs.resource.clone(),
            attrs.verb.to_owned(),
        );
        let allowed = self.admins.contains(&user)
            || match &self.rbac {
                None => true,
                Some(rbac) => rbac.rules.get(&user).is_some_and(|rules| {
                    rules
                        .iter()
                        .any(|r| r.allows(&attrs.group, &attrs.resource, attrs.verb))
                }),
            };
        if allowed {
            self.used.entry(user).or_default().insert(permission);
            return Ok(());
        }
        let what = match &attrs.name {
            Some(name) => format!("{} \"{name}\"", attrs.resource),
            None => attrs.resource.clone(),
        };
        let scope = match &attrs.namespace {
            Some(ns) => format!("in the namespace \"{ns}\""),
            None => "at the cluster scope".to_owned(),
        };
        let message = format!(
            "{what} is forbidden: User \"{user}\" cannot {} resource \"{}\" in API group \"{}\" {scope}",
            attrs.verb, attrs.resource, attrs.group
        );
        self.rejected
            .push(format!("403 {user}: {}: {message}", request.line));
        let mut body = status(403, "Forbidden", message);
        let mut details = json!({"kind": attrs.resource});
        if let Some(name) = attrs.name {
            details["name"] = name.into();
        }
        if !attrs.group.is_empty() {
            details["group"] = attrs.group.into();
        }
        body["details"] = details;
        Err((403, body))
    }
}

/// A service-account volume laid out as the kubelet lays a projected volume: the files
/// (`token`, `ca.crt`, `namespace`) in a timestamped directory `..<time>`, a `..data`
/// symlink to it, and `token -> ..data/token` (etc.) at the top. [`Self::rotate`] writes
/// a new timestamped directory and swaps `..data` atomically (symlink + rename), as the
/// kubelet's atomic writer does, then removes the old directory.
pub struct ServiceAccountVolume {
    pub dir: PathBuf,
    generation: u32,
    ca_pem: String,
    namespace: String,
}

impl ServiceAccountVolume {
    /// Creates the volume in `dir` (made if missing).
    pub fn create(dir: &Path, token: &str, ca_pem: &str, namespace: &str) -> Self {
        std::fs::create_dir_all(dir)
            .unwrap_or_else(|e| panic!("create the service-account dir {}: {e}", dir.display()));
        let mut volume = Self {
            dir: dir.to_owned(),
            generation: 0,
            ca_pem: ca_pem.to_owned(),
            namespace: namespace.to_owned(),
        };
        volume.write(token);
        for file in ["token", "ca.crt", "namespace"] {
            std::os::unix::fs::symlink(format!("..data/{file}"), dir.join(file))
                .unwrap_or_else(|e| panic!("symlink {file} in {}: {e}", dir.display()));
        }
        volume
    }

    /// Replaces the token (the CA and namespace stay) with the kubelet's atomic swap.
    pub fn rotate(&mut self, token: &str) {
        let old = self.data_dir();
        self.write(token);
        std::fs::remove_dir_all(self.dir.join(&old))
            .unwrap_or_else(|e| panic!("remove the old {old}: {e}"));
    }

    fn data_dir(&self) -> String {
        format!(
            "..2026_01_01_00_00_{:02}.{}",
            self.generation,
            std::process::id()
        )
    }

    fn write(&mut self, token: &str) {
        self.generation += 1;
        let data = self.data_dir();
        let fail = |what: &str, e: std::io::Error| -> ! {
            panic!("service-account volume {}: {what}: {e}", self.dir.display())
        };
        let target = self.dir.join(&data);
        std::fs::create_dir(&target).unwrap_or_else(|e| fail("mkdir", e));
        std::fs::write(target.join("token"), token).unwrap_or_else(|e| fail("token", e));
        std::fs::write(target.join("ca.crt"), &self.ca_pem).unwrap_or_else(|e| fail("ca.crt", e));
        std::fs::write(target.join("namespace"), &self.namespace)
            .unwrap_or_else(|e| fail("namespace", e));
        let tmp = self.dir.join("..data_tmp");
        let _ = std::fs::remove_file(&tmp);
        std::os::unix::fs::symlink(&data, &tmp).unwrap_or_else(|e| fail("symlink ..data_tmp", e));
        std::fs::rename(&tmp, self.dir.join("..data")).unwrap_or_else(|e| fail("rename ..data", e));
    }
}
