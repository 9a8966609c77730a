//! HTTP/1.1 on the wire: one request head read, a response written, the API's `Status`
//! body for errors, and URL decoding of paths and queries.

use std::io;

use serde_json::{json, Value};
use tokio::io::{AsyncBufReadExt, AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt, BufReader};

pub(super) struct Request {
    pub(super) line: String,
    pub(super) method: String,
    pub(super) target: String,
    pub(super) close: bool,
    /// The `Authorization` header, as sent.
    pub(super) authorization: Option<String>,
    /// The `Content-Type` header (lower case), for writes.
    pub(super) content_type: String,
    /// The body (create, update, patch).
    pub(super) body: Vec<u8>,
}

pub(super) fn status(code: u16, reason: &str, message: impl Into<String>) -> Value {
    json!({
        "kind": "Status",
        "apiVersion": "v1",
        "metadata": {},
        "status": "Failure",
        "message": message.into(),
        "reason": reason,
        "code": code,
    })
}

/// Reads one request head (and skips a body, if any). `Ok(None)` on a clean EOF.
pub(super) async fn read_request<R: AsyncRead + Unpin>(
    reader: &mut BufReader<R>,
) -> io::Result<Option<Request>> {
    let mut line = String::new();
    loop {
        line.clear();
        if reader.read_line(&mut line).await? == 0 {
            return Ok(None);
        }
        if !line.trim().is_empty() {
            break;
        }
    }
    let line = line.trim_end().to_owned();
    let mut parts = line.split(' ');
    let method = parts.next().unwrap_or_default().to_owned();
    let target = parts.next().unwrap_or_default().to_owned();
    let version = parts.next().unwrap_or_default();
    let mut close = version == "HTTP/1.0";
    let mut content_length = 0usize;
    let mut authorization = None;
    let mut content_type = String::new();
    loop {
        let mut header = String::new();
        if reader.read_line(&mut header).await? == 0 {
            return Ok(None);
        }
        let header = header.trim_end();
        if header.is_empty() {
            break;
        }
        if let Some((name, value)) = header.split_once(':') {
            if name.trim().eq_ignore_ascii_case("authorization") {
                authorization = Some(value.trim().to_owned());
                continue;
            }
            let value = value.trim().to_ascii_lowercase();
            match name.trim().to_ascii_lowercase().as_str() {
                "content-length" => content_length = value.parse().unwrap_or(0),
                "content-type" => content_type = value,
                "connection" if value.contains("close") => close = true,
                "connection" if value.contains("keep-alive") => close = false,
                _ => {}
            }
        }
    }
    let mut body = vec![0; content_length];
    if content_length > 0 {
        reader.read_exact(&mut body).await?;
    }
    Ok(Some(Request {
        line,
        method,
        target,
        close,
        authorization,
        content_type,
        body,
    }))
}

fn reason_phrase(code: u16) -> &'static str {
    match code {
        200 => "OK",
        201 => "Created",
        409 => "Conflict",
        415 => "Unsupported Media Type",
        400 => "Bad Request",
        401 => "Unauthorized",
        403 => "Forbidden",
        404 => "Not Found",
        405 => "Method Not Allowed",
        410 => "Gone",
        422 => "Unprocessable Entity",
        429 => "Too Many Requests",
        500 => "Internal Server Error",
        503 => "Service Unavailable",
        504 => "Gateway Timeout",
        _ => "Unknown",
    }
}

pub(super) async fn write_json<W: AsyncWrite + Unpin>(
    writer: &mut W,
    code: u16,
    body: &Value,
    close: bool,
) -> io::Result<()> {
    write_text(writer, code, &body.to_string(), close).await
}

pub(super) async fn write_text<W: AsyncWrite + Unpin>(
    writer: &mut W,
    code: u16,
    body: &str,
    close: bool,
) -> io::Result<()> {
    write_text_with(writer, code, body, close, "").await
}

/// [`write_text`] with extra header lines (each ending in `\r\n`).
pub(super) async fn write_text_with<W: AsyncWrite + Unpin>(
    writer: &mut W,
    code: u16,
    body: &str,
    close: bool,
    headers: &str,
) -> io::Result<()> {
    let response = format!(
        "HTTP/1.1 {code} {}\r\nContent-Type: application/json\r\nCache-Control: no-cache, private\r\n{headers}Content-Length: {}\r\n{}\r\n{body}",
        reason_phrase(code),
        body.len(),
        if close { "Connection: close\r\n" } else { "" },
    );
    writer.write_all(response.as_bytes()).await?;
    // A TLS stream holds records until flushed.
    writer.flush().await
}

/// Decodes `%XX` escapes and `+` (form encoding, as kube-rs sends queries).
pub(super) fn percent_decode(s: &str) -> String {
    let bytes = s.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        match bytes[i] {
            b'+' => out.push(b' '),
            b'%' => {
                let hex = s
                    .get(i + 1..i + 3)
                    .and_then(|h| u8::from_str_radix(h, 16).ok());
                match hex {
                    Some(byte) => {
                        out.push(byte);
                        i += 2;
                    }
                    None => out.push(b'%'),
                }
            }
            b => out.push(b),
        }
        i += 1;
    }
    String::from_utf8_lossy(&out).into_owned()
}
