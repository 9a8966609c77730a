//! Connections: the accept loop and one connection's request loop (read a request,
//! answer it, keep the connection alive or close it), both ended by `stop()`.

use std::{
    sync::{atomic::Ordering, mpsc as std_mpsc, Arc},
    time::Duration,
};

use tokio::{
    io::{AsyncRead, AsyncWrite, BufReader},
    net::{TcpListener, TcpStream},
    sync::watch,
};
use tokio_rustls::TlsAcceptor;

use super::{
    http::{read_request, status, write_json, write_text, write_text_with, Request},
    route::{handle, Reply},
    store::{lock, ConnectionGuard, Shared},
    watch::serve_watch,
};

pub(super) async fn accept_loop(
    shared: Arc<Shared>,
    listener: std::net::TcpListener,
    mut generation: watch::Receiver<u64>,
    done: std_mpsc::Sender<()>,
    tls: Option<TlsAcceptor>,
) {
    let listener = match TcpListener::from_std(listener) {
        Ok(listener) => listener,
        Err(e) => {
            eprintln!("fake apiserver: cannot register the listener: {e}");
            let _ = done.send(());
            return;
        }
    };
    loop {
        tokio::select! {
            biased;
            _ = generation.changed() => break,
            accepted = listener.accept() => match accepted {
                Ok((stream, _)) => {
                    // A clone has seen what `generation` has seen, so a stop() that this
                    // loop has not noticed yet still reaches the new connection.
                    let guard = ConnectionGuard::new(&shared);
                    tokio::spawn(accept_connection(
                        Arc::clone(&shared),
                        stream,
                        generation.clone(),
                        guard,
                        tls.clone(),
                    ));
                }
                Err(e) => {
                    eprintln!("fake apiserver: accept failed: {e}");
                    tokio::time::sleep(Duration::from_millis(10)).await;
                }
            },
        }
    }
    drop(listener);
    let _ = done.send(());
}

/// The TLS handshake (when serving HTTPS), then the connection's request loop.
async fn accept_connection(
    shared: Arc<Shared>,
    stream: TcpStream,
    mut generation: watch::Receiver<u64>,
    guard: ConnectionGuard,
    tls: Option<TlsAcceptor>,
) {
    let _ = stream.set_nodelay(true);
    let Some(tls) = tls else {
        let (reader, writer) = stream.into_split();
        return serve_connection(shared, reader, writer, None, generation, guard).await;
    };
    let handshake = tokio::select! {
        biased;
        _ = generation.changed() => return,
        handshake = tls.accept(stream) => handshake,
    };
    let stream = match handshake {
        Ok(stream) => stream,
        Err(e) => {
            // What kube-apiserver logs: "http: TLS handshake error from ...".
            eprintln!("fake apiserver: TLS handshake error: {e}");
            return;
        }
    };
    let peer_cert = stream
        .get_ref()
        .1
        .peer_certificates()
        .and_then(|certs| certs.first())
        .map(|cert| cert.as_ref().to_vec());
    let (reader, writer) = tokio::io::split(stream);
    serve_connection(shared, reader, writer, peer_cert, generation, guard).await;
}

// Long: one HTTP/1.1 connection loop (read, authenticate, route, write, keep-alive), its
// state shared by the steps.
async fn serve_connection<R: AsyncRead + Unpin, W: AsyncWrite + Unpin>(
    shared: Arc<Shared>,
    reader: R,
    mut writer: W,
    peer_cert: Option<Vec<u8>>,
    mut generation: watch::Receiver<u64>,
    _guard: ConnectionGuard,
) {
    let mut reader = BufReader::new(reader);
    loop {
        let request = tokio::select! {
            biased;
            _ = generation.changed() => return,
            request = read_request(&mut reader) => request,
        };
        let Ok(Some(request)) = request else {
            return;
        };
        lock(&shared.requests).push(request.line.clone());
        // go_silent(): the request waits, unanswered.
        while shared.silent.load(Ordering::SeqCst) {
            tokio::select! {
                biased;
                _ = generation.changed() => return,
                _ = tokio::time::sleep(Duration::from_millis(20)) => {}
            }
        }
        let checked = lock(&shared.auth).check(&request, peer_cert.as_deref());
        if checked.is_ok() {
            if let Some((code, retry_after)) = injected_failure(&shared, &request) {
                let reason = match code {
                    429 => "TooManyRequests",
                    500 => "InternalError",
                    503 => "ServiceUnavailable",
                    _ => "Unknown",
                };
                let message = match code {
                    429 => "Too many requests, please try again later.".to_owned(),
                    _ => format!("injected failure ({code})"),
                };
                let mut body = status(code, reason, message);
                let mut headers = String::new();
                if let Some(secs) = retry_after {
                    body["details"] = serde_json::json!({"retryAfterSeconds": secs});
                    headers = format!("Retry-After: {secs}\r\n");
                }
                let written = write_text_with(
                    &mut writer,
                    code,
                    &body.to_string(),
                    request.close,
                    &headers,
                )
                .await;
                if written.is_err() || request.close {
                    return;
                }
                continue;
            }
        }
        let reply = match checked {
            Ok(()) => handle(&shared, &request),
            Err((code, body)) => Reply::Json(code, body),
        };
        let keep_alive = match reply {
            Reply::Json(code, body) => write_json(&mut writer, code, &body, request.close)
                .await
                .is_ok(),
            Reply::List(kind, body) => {
                lock(&shared.list_times).push((kind, std::time::Instant::now()));
                let written = write_text(&mut writer, 200, &body, request.close)
                    .await
                    .is_ok();
                if written {
                    lock(&shared.list_ends).push((kind, std::time::Instant::now()));
                }
                written
            }
            Reply::Watch(watch) => tokio::select! {
                biased;
                _ = generation.changed() => false,
                clean = serve_watch(&shared, watch, &mut reader, &mut writer) => clean,
            },
        };
        if !keep_alive || request.close {
            return;
        }
    }
}

/// The failure armed by `fail_requests` for this request, if any (resource paths only),
/// counted: (code, Retry-After).
fn injected_failure(shared: &Shared, request: &Request) -> Option<(u16, Option<u64>)> {
    let path = request.target.split('?').next().unwrap_or_default();
    let segments = path.trim_matches('/').split('/').count();
    let resource =
        (path.starts_with("/api/") && segments > 2) || (path.starts_with("/apis/") && segments > 3);
    if !resource {
        return None;
    }
    let mut fail = lock(&shared.fail);
    let (code, left, retry_after) = (*fail)?;
    *fail = (left > 1).then_some((code, left - 1, retry_after));
    *lock(&shared.failed).entry(code).or_default() += 1;
    Some((code, retry_after))
}
