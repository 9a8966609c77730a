//! The agent's small HTTP/1.x servers (`/metrics`, `/healthz`, the health-check node
//! ports): GET only, one request per connection. They listen where anyone on the network
//! may connect (healthz on every address, as kube-proxy's), so a client must not be able
//! to stop them or the agent:
//!
//! - the request head must arrive within [`Limits::header_timeout`], the reply be taken
//!   within [`Limits::write_timeout`];
//! - at most [`Limits::max_connections`] are open per server; at the cap, the oldest
//!   connection still waiting for its request is closed to make room (a flood of idle
//!   connections cannot keep a prober that sends its request at once from an answer);
//! - the agent raises its soft `RLIMIT_NOFILE` at start (`raise_nofile_limit`), so
//!   the caps of every server together stay far below the descriptors the maps, the
//!   manifests and the API watches need.

use std::{
    collections::VecDeque,
    sync::{
        atomic::{AtomicUsize, Ordering},
        Arc, Mutex,
    },
    time::{Duration, Instant},
};

use tokio::{
    io::{AsyncReadExt, AsyncWriteExt},
    net::TcpListener,
    sync::oneshot,
};
use tracing::{debug, warn};

/// Per-server limits.
#[derive(Clone, Copy, Debug)]
pub struct Limits {
    pub max_connections: usize,
    pub header_timeout: Duration,
    pub write_timeout: Duration,
}

impl Default for Limits {
    fn default() -> Self {
        Self {
            max_connections: 256,
            header_timeout: Duration::from_secs(3),
            write_timeout: Duration::from_secs(3),
        }
    }
}

/// One reply.
#[derive(Debug)]
pub struct Reply {
    pub status: &'static str,
    pub content_type: &'static str,
    /// Extra header lines, each ending in `\r\n`.
    pub headers: &'static str,
    pub body: String,
}

/// Connections waiting for their request head, oldest first: an id and the sender that
/// closes it.
type Waiting = Arc<Mutex<VecDeque<(u64, oneshot::Sender<()>)>>>;

fn forget(waiting: &Waiting, id: u64) {
    let mut w = waiting.lock().unwrap_or_else(|p| p.into_inner());
    if let Some(i) = w.iter().position(|(i, _)| *i == id) {
        w.remove(i);
    }
}

/// Decrements the open-connection count when a connection task ends, however it ends.
struct Open(Arc<AtomicUsize>);

impl Drop for Open {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::Relaxed);
    }
}

/// Serves `listener` until the task is dropped; `respond` maps a request path to a reply.
// Long: one accept loop with its limits (connection cap, header timeout, keep-alive) around
// one request handler; split, the limits would travel through every step.
pub async fn serve<F>(listener: TcpListener, name: &'static str, limits: Limits, respond: F)
where
    F: Fn(&str) -> Reply + Send + Sync + 'static,
{
    let respond = Arc::new(respond);
    let open = Arc::new(AtomicUsize::new(0));
    let waiting: Waiting = Arc::default();
    let mut next_id = 0u64;
    let mut last_error_log: Option<Instant> = None;
    loop {
        let (mut stream, peer) = match listener.accept().await {
            Ok(s) => s,
            Err(e) => {
                // EMFILE and the like: say so now and then, not once per attempt.
                if last_error_log.is_none_or(|t| t.elapsed() > Duration::from_secs(10)) {
                    warn!(server = name, error = %e, "accepting an HTTP connection");
                    last_error_log = Some(Instant::now());
                }
                tokio::time::sleep(Duration::from_millis(50)).await;
                continue;
            }
        };
        if open.load(Ordering::Relaxed) >= limits.max_connections {
            // Close the oldest connection still waiting for its request, if any.
            let oldest = waiting
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .pop_front();
            match oldest {
                Some((_, close)) => {
                    let _ = close.send(());
                    debug!(server = name, %peer, "at the connection cap: closed the oldest idle one");
                }
                None => {
                    debug!(server = name, %peer, "at the connection cap: refused");
                    drop(stream);
                    continue;
                }
            }
        }
        open.fetch_add(1, Ordering::Relaxed);
        let guard = Open(open.clone());
        let id = next_id;
        next_id += 1;
        let (close_tx, mut close_rx) = oneshot::channel();
        waiting
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .push_back((id, close_tx));
        let (respond, waiting) = (respond.clone(), waiting.clone());
        tokio::spawn(async move {
            let _guard = guard;
            let mut buf = vec![0u8; 4096];
            let mut len = 0;
            // Read the request head (any body is ignored) before the deadline, unless
            // closed to make room.
            let deadline = tokio::time::Instant::now() + limits.header_timeout;
            let complete = loop {
                tokio::select! {
                    _ = &mut close_rx => break false,
                    r = tokio::time::timeout_at(deadline, stream.read(&mut buf[len..])) => match r {
                        Ok(Ok(0)) | Err(_) | Ok(Err(_)) => break false,
                        Ok(Ok(n)) => len += n,
                    },
                }
                if buf[..len].windows(4).any(|w| w == b"\r\n\r\n") || len == buf.len() {
                    break true;
                }
            };
            forget(&waiting, id);
            if !complete {
                return;
            }
            let head = String::from_utf8_lossy(&buf[..len]);
            let path = head
                .split_whitespace()
                .nth(1)
                .unwrap_or("/")
                .split('?')
                .next()
                .unwrap_or("/")
                .to_string();
            let reply = respond(&path);
            debug!(server = name, %peer, %path, status = reply.status, "http");
            let text = format!(
                "HTTP/1.1 {}\r\nContent-Type: {}\r\n{}Content-Length: {}\r\nConnection: close\r\n\r\n{}",
                reply.status,
                reply.content_type,
                reply.headers,
                reply.body.len(),
                reply.body
            );
            let _ = tokio::time::timeout(limits.write_timeout, async {
                stream.write_all(text.as_bytes()).await?;
                stream.shutdown().await
            })
            .await;
        });
    }
}

/// Raises the soft `RLIMIT_NOFILE` to the hard limit (container runtimes start processes
/// with a soft limit of 1024 and a much higher hard one). Returns (before, after).
pub fn raise_nofile_limit() -> std::io::Result<(u64, u64)> {
    let mut lim = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: getrlimit/setrlimit with a valid struct.
    if unsafe { libc::getrlimit(libc::RLIMIT_NOFILE, &mut lim) } != 0 {
        return Err(std::io::Error::last_os_error());
    }
    let before = lim.rlim_cur;
    if lim.rlim_cur < lim.rlim_max {
        lim.rlim_cur = lim.rlim_max;
        // SAFETY: as above.
        if unsafe { libc::setrlimit(libc::RLIMIT_NOFILE, &lim) } != 0 {
            return Err(std::io::Error::last_os_error());
        }
    }
    Ok((before, lim.rlim_cur))
}

#[cfg(test)]
mod tests {
    use super::*;

    async fn get(addr: std::net::SocketAddr) -> std::io::Result<String> {
        let mut s = tokio::net::TcpStream::connect(addr).await?;
        s.write_all(b"GET /x HTTP/1.1\r\nHost: x\r\n\r\n").await?;
        let mut out = String::new();
        s.read_to_string(&mut out).await?;
        Ok(out)
    }

    #[tokio::test]
    async fn idle_connections_at_the_cap_do_not_keep_a_request_from_an_answer() {
        let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
        let addr = listener.local_addr().expect("addr");
        let limits = Limits {
            max_connections: 16,
            header_timeout: Duration::from_secs(60),
            write_timeout: Duration::from_secs(5),
        };
        tokio::spawn(serve(listener, "test", limits, |path| Reply {
            status: "200 OK",
            content_type: "text/plain",
            headers: "",
            body: format!("{path}\n"),
        }));
        // Far more idle connections than the cap, none sending anything.
        let mut idle = Vec::new();
        for _ in 0..100 {
            idle.push(tokio::net::TcpStream::connect(addr).await.expect("connect"));
        }
        for _ in 0..5 {
            let r = tokio::time::timeout(Duration::from_secs(2), get(addr))
                .await
                .expect("answered in time")
                .expect("answer");
            assert!(
                r.starts_with("HTTP/1.1 200 OK") && r.ends_with("/x\n"),
                "{r}"
            );
        }
        // The oldest idle ones were closed to make room.
        let mut closed = 0;
        for s in &mut idle {
            let mut b = [0u8; 1];
            if let Ok(Ok(0)) = tokio::time::timeout(Duration::from_millis(20), s.read(&mut b)).await
            {
                closed += 1;
            }
        }
        assert!(closed >= 100 - 16, "{closed} closed");
    }

    #[tokio::test]
    async fn a_request_head_that_never_comes_is_timed_out() {
        let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
        let addr = listener.local_addr().expect("addr");
        let limits = Limits {
            header_timeout: Duration::from_millis(200),
            ..Limits::default()
        };
        tokio::spawn(serve(listener, "test", limits, |_| Reply {
            status: "200 OK",
            content_type: "text/plain",
            headers: "",
            body: String::new(),
        }));
        let mut s = tokio::net::TcpStream::connect(addr).await.expect("connect");
        s.write_all(b"GET /slow").await.expect("write");
        let mut b = [0u8; 16];
        let n = tokio::time::timeout(Duration::from_secs(3), s.read(&mut b))
            .await
            .expect("closed by the server")
            .unwrap_or(0);
        assert_eq!(n, 0, "closed without an answer");
    }
}
