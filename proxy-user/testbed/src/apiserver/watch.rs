//! Watch streams: the history after the requested resourceVersion replayed (or the
//! current state as ADDED events, ended by the `initial-events-end` bookmark for a
//! streaming list), then live events and periodic BOOKMARKs as chunks, and the 410
//! `Expired` ERROR event for a resourceVersion older than the history.

use std::{sync::atomic::Ordering, time::Duration};

use serde_json::{json, Value};
use tokio::{
    io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt, BufReader},
    sync::{mpsc, oneshot},
    time::{interval_at, sleep_until, Instant, MissedTickBehavior},
};

use super::{
    http::status,
    selector::Filter,
    store::{lock, Change, Kind, Shared, WatchSink},
};

/// How often watches with `allowWatchBookmarks=true` get a BOOKMARK event.
const BOOKMARK_INTERVAL: Duration = Duration::from_secs(1);

pub(super) struct WatchRequest {
    pub(super) kind: Kind,
    pub(super) filter: Filter,
    /// `None`: start with ADDED events for the current state (resourceVersion unset or "0").
    pub(super) since: Option<u64>,
    pub(super) bookmarks: bool,
    /// `sendInitialEvents=true`: end the initial state with an `initial-events-end` bookmark.
    pub(super) initial_events_end: bool,
    pub(super) timeout: Duration,
}

/// One watch event as a chunk of the chunked response: the JSON and a newline.
fn event_chunk(event_type: &str, object: &Value) -> Vec<u8> {
    let line = format!("{}\n", json!({"type": event_type, "object": object}));
    let mut chunk = format!("{:x}\r\n", line.len()).into_bytes();
    chunk.extend_from_slice(line.as_bytes());
    chunk.extend_from_slice(b"\r\n");
    chunk
}

fn bookmark(kind: Kind, rv: u64, initial_events_end: bool) -> Vec<u8> {
    let mut metadata = json!({"resourceVersion": rv.to_string()});
    if initial_events_end {
        metadata["annotations"] = json!({"k8s.io/initial-events-end": "true"});
    }
    event_chunk(
        "BOOKMARK",
        &json!({"kind": kind.name(), "apiVersion": kind.api_version(), "metadata": metadata}),
    )
}

/// The event a watch with `filter` sees for `change`, if any (watch-cache semantics).
fn event_for(kind: Kind, filter: &Filter, change: &Change) -> Option<(&'static str, Value)> {
    if change.kind != kind {
        return None;
    }
    let before = change.before.as_ref().filter(|o| filter.matches(o));
    let after = change.after.as_ref().filter(|o| filter.matches(o));
    match (before, after) {
        (Some(_), Some(after)) => Some(("MODIFIED", after.clone())),
        (None, Some(after)) => Some(("ADDED", after.clone())),
        (Some(before), None) => {
            let mut last = before.clone();
            last["metadata"]["resourceVersion"] = change.rv.to_string().into();
            Some(("DELETED", last))
        }
        (None, None) => None,
    }
}

/// Streams a watch. Returns whether the response ended cleanly (the connection can be
/// reused); `false` means the connection must be closed without further ado.
// Long: one watch stream as kube-apiserver serves it (history replay, bookmarks, timeout,
// 410), its state shared by the steps.
pub(super) async fn serve_watch<R: AsyncRead + Unpin, W: AsyncWrite + Unpin>(
    shared: &Shared,
    request: WatchRequest,
    reader: &mut BufReader<R>,
    writer: &mut W,
) -> bool {
    const HEAD: &[u8] = b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nCache-Control: no-cache, private\r\nTransfer-Encoding: chunked\r\n\r\n";
    const LAST_CHUNK: &[u8] = b"0\r\n\r\n";
    let kind = request.kind;

    // Take the replay and subscribe under one lock, so no write is missed or sent twice.
    let subscribed = {
        let mut store = lock(&shared.store);
        let mut initial = Vec::new();
        match request.since {
            Some(since) if since < store.oldest_rv => Err(status(
                410,
                "Expired",
                format!("too old resource version: {since} ({})", store.oldest_rv),
            )),
            since => {
                if let Some(since) = since {
                    for change in store.history.iter().filter(|c| c.rv > since) {
                        if let Some((event_type, object)) = event_for(kind, &request.filter, change)
                        {
                            initial.extend(event_chunk(event_type, &object));
                        }
                    }
                } else {
                    for ((k, _, _), obj) in &store.objects {
                        if *k == kind && request.filter.matches(obj) {
                            initial.extend(event_chunk("ADDED", obj));
                        }
                    }
                    if request.initial_events_end {
                        initial.extend(bookmark(kind, store.rv, true));
                    }
                }
                let (events_tx, events) = mpsc::unbounded_channel();
                let (kill_tx, kill) = oneshot::channel();
                store.watchers.push(WatchSink {
                    events: events_tx,
                    _kill: kill_tx,
                });
                // Bookmarks never go back behind what the client asked for.
                let cursor = store.rv.max(since.unwrap_or_default());
                Ok((initial, cursor, events, kill))
            }
        }
    };
    let (mut initial, mut cursor, mut events, mut kill) = match subscribed {
        Ok(subscribed) => subscribed,
        Err(gone) => {
            // What the apiserver does for an expired watch: 200, one ERROR event, the end.
            let mut response = HEAD.to_vec();
            response.extend(event_chunk("ERROR", &gone));
            response.extend_from_slice(LAST_CHUNK);
            return send(writer, &response).await;
        }
    };

    let count = |bytes: &[u8]| {
        shared
            .watch_bytes
            .fetch_add(bytes.len() as u64, Ordering::Relaxed);
    };
    count(&initial);
    let mut head = HEAD.to_vec();
    head.append(&mut initial);
    if !send(writer, &head).await {
        return false;
    }
    let deadline = Instant::now() + request.timeout;
    let mut bookmarks = interval_at(Instant::now() + BOOKMARK_INTERVAL, BOOKMARK_INTERVAL);
    bookmarks.set_missed_tick_behavior(MissedTickBehavior::Delay);
    let mut scratch = [0u8; 512];
    loop {
        // go_silent(): nothing is sent (events wait in the channel, no bookmark, no end).
        let silent = shared.silent.load(Ordering::SeqCst);
        tokio::select! {
            biased;
            // drop_watches() or stop(): end abruptly.
            _ = &mut kill => return false,
            _ = tokio::time::sleep(Duration::from_millis(20)), if silent => {}
            change = events.recv(), if !silent => {
                let Some(change) = change else { return false };
                // Gone silent while this select waited: the change waits too.
                while shared.silent.load(Ordering::SeqCst) {
                    tokio::select! {
                        biased;
                        _ = &mut kill => return false,
                        _ = tokio::time::sleep(Duration::from_millis(20)) => {}
                    }
                }
                cursor = change.rv;
                if let Some((event_type, object)) = event_for(kind, &request.filter, &change) {
                    let chunk = event_chunk(event_type, &object);
                    count(&chunk);
                    if !send(writer, &chunk).await {
                        return false;
                    }
                }
            }
            _ = sleep_until(deadline), if !silent => {
                if shared.silent.load(Ordering::SeqCst) {
                    continue;
                }
                return send(writer, LAST_CHUNK).await;
            }
            _ = bookmarks.tick(), if request.bookmarks && !silent => {
                if shared.silent.load(Ordering::SeqCst) {
                    continue;
                }
                let chunk = bookmark(kind, cursor, false);
                count(&chunk);
                if !send(writer, &chunk).await {
                    return false;
                }
            }
            // The client went away (or, against the protocol, sent something: ignored).
            read = reader.read(&mut scratch) => {
                if !matches!(read, Ok(n) if n > 0) {
                    return false;
                }
            }
        }
    }
}

/// Writes and flushes (a TLS stream holds records until flushed); false on an error.
async fn send<W: AsyncWrite + Unpin>(writer: &mut W, bytes: &[u8]) -> bool {
    writer.write_all(bytes).await.is_ok() && writer.flush().await.is_ok()
}
