//! The Kubernetes API client the source reads with: from `--kubeconfig`, the in-cluster
//! service account, or `$KUBECONFIG`, with a token file read on every request.

use std::{
    path::{Path, PathBuf},
    sync::{Mutex, PoisonError},
};

use kube::{
    client::ClientBuilder,
    config::{KubeConfigOptions, Kubeconfig},
    Client, Config,
};
use tracing::{info, warn};

/// A client from `--kubeconfig`, else in-cluster config, else `$KUBECONFIG` /
/// `~/.kube/config`.
///
/// A token file (the in-cluster service-account token, or a kubeconfig's `tokenFile`) is
/// read on every request rather than by kube's own auth layer, which caches it for up to
/// a minute (kube-client 5.0's `TokenFile`, like client-go's cached file token source):
/// when the kubelet rotates the token and the old one stops being accepted, the next
/// request (a re-list or re-watch) already carries the new one.
pub async fn client(kubeconfig: Option<&Path>) -> anyhow::Result<Client> {
    client_from(config(kubeconfig).await?)
}

/// The API server's `host[:port]`, as client-go labels `rest_client_requests_total`.
pub fn host(config: &Config) -> String {
    config
        .cluster_url
        .authority()
        .map(|a| a.to_string())
        .unwrap_or_default()
}

/// The client's configuration (see [`client`]).
pub async fn config(kubeconfig: Option<&Path>) -> anyhow::Result<Config> {
    let config = match kubeconfig {
        Some(path) => {
            let kc = Kubeconfig::read_from(path)
                .map_err(|e| anyhow::anyhow!("reading kubeconfig {}: {e}", path.display()))?;
            Config::from_custom_kubeconfig(kc, &KubeConfigOptions::default()).await?
        }
        // In-cluster first (the DaemonSet case), then $KUBECONFIG / ~/.kube/config.
        None => match Config::incluster() {
            Ok(c) => c,
            Err(_) => Config::infer().await?,
        },
    };
    Ok(config)
}

/// A client over `config` whose token file, if any, is read on every request (see
/// [`client`]).
pub fn client_from(mut config: Config) -> anyhow::Result<Client> {
    // An inline token has precedence over the file in kube, and never changes.
    let token_file = match config.auth_info.token {
        Some(_) => None,
        None => config.auth_info.token_file.take(),
    };
    let builder = ClientBuilder::try_from(config)?;
    Ok(match token_file {
        None => builder.build(),
        Some(path) => {
            let token = std::sync::Arc::new(TokenFile::open(PathBuf::from(path))?);
            builder
                .with_layer(&tower::util::MapRequestLayer::new(
                    move |mut request: http::Request<kube::client::Body>| {
                        if let Some(header) = token.header() {
                            request
                                .headers_mut()
                                .insert(http::header::AUTHORIZATION, header);
                        }
                        request
                    },
                ))
                .build()
        }
    })
}

/// A bearer token file read on every request (see [`client`]). A read that fails keeps
/// the last token (as client-go does: a file removed after start must not break the
/// client); the first read must succeed.
struct TokenFile {
    path: PathBuf,
    last: Mutex<String>,
}

impl TokenFile {
    fn open(path: PathBuf) -> anyhow::Result<Self> {
        let token = std::fs::read_to_string(&path)
            .map_err(|e| anyhow::anyhow!("reading the API token file {}: {e}", path.display()))?;
        Ok(Self {
            path,
            last: Mutex::new(token.trim().to_owned()),
        })
    }

    /// `Bearer <token>`, re-read from the file. A small blocking read (a few hundred
    /// bytes, usually tmpfs) once per list page or watch start, not per event.
    fn header(&self) -> Option<http::HeaderValue> {
        let mut last = self.last.lock().unwrap_or_else(PoisonError::into_inner);
        match std::fs::read_to_string(&self.path) {
            Ok(token) if !token.trim().is_empty() => {
                let token = token.trim();
                if *last != token {
                    info!(path = %self.path.display(), "the API token changed (rotated): using the new one");
                    *last = token.to_owned();
                }
            }
            Ok(_) => {
                warn!(path = %self.path.display(), "the API token file is empty: keeping the last token")
            }
            Err(e) => {
                warn!(path = %self.path.display(), "reading the API token file failed ({e}): keeping the last token")
            }
        }
        let mut header = http::HeaderValue::from_str(&format!("Bearer {last}")).ok()?;
        header.set_sensitive(true);
        Some(header)
    }
}
