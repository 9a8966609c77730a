//! Connections: the accept loop and one connection's request loop (read a request,
//! answer it, keep the connection alive or close it), both ended by `stop()`.

use std::{
    sync::{mpsc as std_mpsc, Arc},
    time::Duration,
};

use tokio::{
    io::BufReader,
    net::{TcpListener, TcpStream},
    sync::watch,
};

use super::{
    http::{read_request, write_json, write_text},
    route::{handle, Reply},
    store::{lock, ConnectionGuard, Shared},
    watch::serve_watch,
};

pub(super) async fn accept_loop(
    shared: Arc<Shared>,
    listener: std::net::TcpListener,
    mut generation: watch::Receiver<u64>,
    done: std_mpsc::Sender<()>,
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
                    tokio::spawn(serve_connection(
                        Arc::clone(&shared),
                        stream,
                        generation.clone(),
                        guard,
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

async fn serve_connection(
    shared: Arc<Shared>,
    stream: TcpStream,
    mut generation: watch::Receiver<u64>,
    _guard: ConnectionGuard,
) {
    let _ = stream.set_nodelay(true);
    let (reader, mut writer) = stream.into_split();
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
        let keep_alive = match handle(&shared, &request) {
            Reply::Json(code, body) => write_json(&mut writer, code, &body, request.close)
                .await
                .is_ok(),
            Reply::List(kind, body) => {
                lock(&shared.list_times).push((kind, std::time::Instant::now()));
                write_text(&mut writer, 200, &body, request.close)
                    .await
                    .is_ok()
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
