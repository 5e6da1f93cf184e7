//! A whole-body HTTP/1.1 exchange on a pooled connection, driven by the caller's own task:
//! [`H1Pool::exchange`] writes the request and reads the whole answer on the socket itself.
//!
//! Why: hyper's pooled client runs every connection as a task of its own; a request is handed
//! to it through a channel, and its answer comes back through another, so each request costs
//! two task wake-ups, a pool checkout keyed by the URI, and a `Request` and `HeaderMap` built
//! and taken apart again. Profiling the gateway at a quarter core put hyper's client at a third
//! of its CPU per request, and the controller's fan-out to 4,096 engines at 37% in its
//! dispatch. An exchange whose body is known up front (every non-streamed inference request
//! and every engine control call) needs none of that: it borrows an idle connection, writes
//! head and body in one `write`, and parses the answer with `httparse` as the bytes arrive.
//! Streamed answers and large bodies still go through hyper ([`super::upstream`]).
//!
//! What it speaks: `Content-Length` and chunked answers (trailers skipped), answers read to the
//! end of the connection, `Connection: close` and HTTP/1.0 keep-alive, 1xx interim answers
//! skipped. A connection goes back to its pool only when its answer was read exactly; one
//! dropped mid-exchange (a timeout, a client gone) is closed. A reused connection that turns
//! out closed by the server (a keep-alive timeout: uvicorn's is 5 s) before any answer byte
//! came is retried once on a new one; connections idle for over [`CHECK_AFTER`] are checked
//! before use and those idle for [`IDLE_LIMIT`] are dropped.

use std::collections::HashMap;
use std::time::{Duration, Instant};

use axum::http::{HeaderValue, Method, StatusCode, Uri};
use bytes::{Bytes, BytesMut};
use parking_lot::Mutex;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

/// Largest request body sent this way; larger ones go through hyper, which reads an answer a
/// server sends before it has read the whole body.
pub const MAX_BODY: usize = 64 * 1024;
/// Largest answer head (status line and headers).
const MAX_HEAD: usize = 64 * 1024;
/// Largest answer body: an engine's answer is at most a few MB; a bigger one is broken.
const MAX_ANSWER: usize = 256 << 20;
/// Most headers an answer may have.
const MAX_HEADERS: usize = 128;
/// Most idle connections kept per server.
const MAX_IDLE: usize = 1024;
/// A connection idle longer than this is checked for a close before it is reused.
pub const CHECK_AFTER: Duration = Duration::from_secs(1);
/// A connection idle this long is dropped.
pub const IDLE_LIMIT: Duration = Duration::from_secs(90);
/// How long opening a connection may take.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(5);

/// One request's head fields beyond the method and URI, each if any.
#[derive(Debug, Default, Clone, Copy)]
pub struct Extra<'a> {
    /// `Content-Type`.
    pub content_type: Option<&'a HeaderValue>,
    /// `Authorization`.
    pub auth: Option<&'a HeaderValue>,
    /// `If-Match`.
    pub if_match: Option<&'a HeaderValue>,
    /// The gateways' hop chain (`x-troupe-via`).
    pub via: Option<&'a HeaderValue>,
}

struct Conn {
    io: TcpStream,
    buf: BytesMut,
    idle_since: Instant,
}

/// Idle connections by server (`host:port`).
#[derive(Default)]
pub struct H1Pool {
    idle: Mutex<HashMap<Box<str>, Vec<Conn>>>,
}

impl std::fmt::Debug for H1Pool {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let n: usize = self.idle.lock().values().map(Vec::len).sum();
        f.debug_struct("H1Pool").field("idle", &n).finish()
    }
}

/// Where a URI's server is, as `host:port`, or why it cannot be reached this way.
fn authority(uri: &Uri) -> Result<String, String> {
    if uri.scheme_str() != Some("http") {
        return Err(format!("{uri}: only http:// URLs are supported"));
    }
    let host = uri.host().ok_or_else(|| format!("{uri}: no host"))?;
    Ok(format!("{host}:{}", uri.port_u16().unwrap_or(80)))
}

/// What a finished exchange leaves: the status, the body, and whether the connection may
/// carry another request.
struct Answer {
    status: StatusCode,
    body: Bytes,
    reusable: bool,
}

/// Why an exchange failed, and whether nothing of an answer had come yet (so a reused
/// connection may be retried).
struct Failed {
    reason: String,
    before_answer: bool,
}

impl H1Pool {
    /// Sends `method uri` with `body` and the `extra` headers and reads the whole answer.
    /// `body` must be at most [`MAX_BODY`] bytes.
    pub async fn exchange(
        &self,
        method: &Method,
        uri: &Uri,
        extra: Extra<'_>,
        body: &[u8],
    ) -> Result<(StatusCode, Bytes), String> {
        let key = authority(uri)?;
        let request = encode(method, uri, &key, extra, body);
        let mut fresh = false;
        loop {
            let mut conn = match (!fresh).then(|| self.take(&key)).flatten() {
                Some(c) => c,
                None => {
                    fresh = true;
                    connect(&key).await?
                }
            };
            match round_trip(&mut conn, &request, method == Method::HEAD).await {
                Ok(a) => {
                    if a.reusable && conn.buf.is_empty() {
                        self.put(key, conn);
                    }
                    return Ok((a.status, a.body));
                }
                // A pooled connection the server had closed: once more on a new one.
                Err(f) if f.before_answer && !fresh => fresh = true,
                Err(f) => return Err(f.reason),
            }
        }
    }

    /// An idle connection to `key` that still looks open, newest first.
    fn take(&self, key: &str) -> Option<Conn> {
        let now = Instant::now();
        let mut idle = self.idle.lock();
        let list = idle.get_mut(key)?;
        while let Some(c) = list.pop() {
            let idle_for = now.saturating_duration_since(c.idle_since);
            if idle_for >= IDLE_LIMIT {
                continue;
            }
            if idle_for >= CHECK_AFTER && !looks_open(&c.io) {
                continue;
            }
            return Some(c);
        }
        None
    }

    fn put(&self, key: String, mut conn: Conn) {
        conn.idle_since = Instant::now();
        let mut idle = self.idle.lock();
        let list = idle.entry(key.into_boxed_str()).or_default();
        if list.len() < MAX_IDLE {
            list.push(conn);
        }
    }
}

/// Whether an idle connection has neither been closed nor sent anything unasked.
fn looks_open(io: &TcpStream) -> bool {
    let mut one = [0u8; 1];
    matches!(io.try_read(&mut one), Err(e) if e.kind() == std::io::ErrorKind::WouldBlock)
}

async fn connect(key: &str) -> Result<Conn, String> {
    let io = tokio::time::timeout(CONNECT_TIMEOUT, TcpStream::connect(key))
        .await
        .map_err(|_| format!("connect to {key}: timed out after {CONNECT_TIMEOUT:?}"))?
        .map_err(|e| format!("connect to {key}: {e}"))?;
    io.set_nodelay(true)
        .map_err(|e| format!("connect to {key}: {e}"))?;
    Ok(Conn {
        io,
        buf: BytesMut::with_capacity(8 * 1024),
        idle_since: Instant::now(),
    })
}

/// The request's bytes: head and body in one buffer, so they go in one write.
fn encode(method: &Method, uri: &Uri, host: &str, extra: Extra<'_>, body: &[u8]) -> Vec<u8> {
    let path = uri.path_and_query().map_or("/", |p| p.as_str());
    let mut out = Vec::with_capacity(256 + body.len());
    for part in [
        method.as_str(),
        " ",
        path,
        " HTTP/1.1\r\nhost: ",
        host,
        "\r\n",
    ] {
        out.extend_from_slice(part.as_bytes());
    }
    let headers = [
        ("content-type", extra.content_type),
        ("authorization", extra.auth),
        ("if-match", extra.if_match),
        (crate::hops::VIA_HEADER, extra.via),
    ];
    for (name, value) in headers {
        if let Some(v) = value {
            out.extend_from_slice(name.as_bytes());
            out.extend_from_slice(b": ");
            out.extend_from_slice(v.as_bytes());
            out.extend_from_slice(b"\r\n");
        }
    }
    if !body.is_empty() || !matches!(*method, Method::GET | Method::HEAD) {
        out.extend_from_slice(format!("content-length: {}\r\n", body.len()).as_bytes());
    }
    out.extend_from_slice(b"\r\n");
    out.extend_from_slice(body);
    out
}

async fn round_trip(conn: &mut Conn, request: &[u8], head_only: bool) -> Result<Answer, Failed> {
    if let Err(e) = conn.io.write_all(request).await {
        return Err(Failed {
            reason: format!("sending the request: {e}"),
            before_answer: true,
        });
    }
    read_answer(conn, head_only).await
}

/// Reads more bytes into the buffer; `Ok(false)` at the end of the connection.
async fn fill(conn: &mut Conn) -> std::io::Result<bool> {
    conn.buf.reserve(8 * 1024);
    Ok(conn.io.read_buf(&mut conn.buf).await? > 0)
}

/// The head fields the body's framing depends on.
struct Head {
    status: StatusCode,
    len: usize,
    chunked: bool,
    length: Option<usize>,
    keep_alive: bool,
}

/// Parses a complete head at the start of `buf`: `None` while more bytes are needed.
fn parse_head(buf: &[u8]) -> Result<Option<Head>, String> {
    let mut headers = [httparse::EMPTY_HEADER; MAX_HEADERS];
    let mut r = httparse::Response::new(&mut headers);
    let len = match r.parse(buf) {
        Ok(httparse::Status::Complete(n)) => n,
        Ok(httparse::Status::Partial) => return Ok(None),
        Err(e) => return Err(format!("the answer's head does not parse: {e}")),
    };
    let code = r.code.unwrap_or(0);
    let status =
        StatusCode::from_u16(code).map_err(|_| format!("the answer's status {code} is invalid"))?;
    let mut chunked = false;
    let mut length: Option<usize> = None;
    // HTTP/1.1 keeps the connection unless told otherwise; 1.0 only when told to.
    let mut keep_alive = r.version == Some(1);
    for h in r.headers.iter() {
        let value = std::str::from_utf8(h.value).unwrap_or("").trim();
        if h.name.eq_ignore_ascii_case("content-length") {
            let n: usize = value
                .parse()
                .map_err(|_| format!("the answer's content-length {value:?} is not a number"))?;
            if length.is_some_and(|l| l != n) {
                return Err("the answer has two different content-lengths".into());
            }
            length = Some(n);
        } else if h.name.eq_ignore_ascii_case("transfer-encoding") {
            chunked = value
                .rsplit(',')
                .next()
                .is_some_and(|last| last.trim().eq_ignore_ascii_case("chunked"));
        } else if h.name.eq_ignore_ascii_case("connection") {
            for token in value.split(',').map(str::trim) {
                if token.eq_ignore_ascii_case("close") {
                    keep_alive = false;
                } else if token.eq_ignore_ascii_case("keep-alive") {
                    keep_alive = true;
                }
            }
        }
    }
    if length.is_some_and(|n| n > MAX_ANSWER) {
        return Err(format!(
            "the answer's body is over {MAX_ANSWER} bytes (content-length)"
        ));
    }
    Ok(Some(Head {
        status,
        len,
        chunked,
        length,
        keep_alive,
    }))
}

async fn read_answer(conn: &mut Conn, head_only: bool) -> Result<Answer, Failed> {
    let mut got_any = !conn.buf.is_empty();
    let failed = |reason: String, got_any: bool| Failed {
        reason,
        before_answer: !got_any,
    };
    let head = loop {
        match parse_head(&conn.buf) {
            Err(e) => return Err(failed(e, true)),
            Ok(Some(h))
                if h.status.is_informational() && h.status != StatusCode::SWITCHING_PROTOCOLS =>
            {
                // An interim answer (100 Continue, 103 Early Hints): the real one follows.
                let _ = conn.buf.split_to(h.len);
                continue;
            }
            Ok(Some(h)) => break h,
            Ok(None) if conn.buf.len() >= MAX_HEAD => {
                return Err(failed(
                    format!("the answer's head is over {MAX_HEAD} bytes"),
                    true,
                ));
            }
            Ok(None) => match fill(conn).await {
                Ok(true) => got_any = true,
                Ok(false) => {
                    return Err(failed(
                        "the connection closed before an answer".into(),
                        got_any,
                    ));
                }
                Err(e) => return Err(failed(format!("reading the answer: {e}"), got_any)),
            },
        }
    };
    let _ = conn.buf.split_to(head.len);
    let status = head.status;
    let no_body = head_only
        || status.is_informational()
        || status == StatusCode::NO_CONTENT
        || status == StatusCode::NOT_MODIFIED;
    let body_failed = |e: String| failed(format!("reading the answer's body: {e}"), true);
    let (body, reusable) = if no_body {
        (Bytes::new(), head.keep_alive)
    } else if head.chunked {
        (
            read_chunked(conn).await.map_err(body_failed)?,
            head.keep_alive,
        )
    } else if let Some(n) = head.length {
        while conn.buf.len() < n {
            match fill(conn).await {
                Ok(true) => {}
                Ok(false) => {
                    return Err(body_failed(format!(
                        "closed after {} of {n} bytes",
                        conn.buf.len()
                    )));
                }
                Err(e) => return Err(body_failed(e.to_string())),
            }
        }
        (conn.buf.split_to(n).freeze(), head.keep_alive)
    } else {
        // No length: the body runs to the end of the connection.
        loop {
            if conn.buf.len() > MAX_ANSWER {
                return Err(body_failed(format!("over {MAX_ANSWER} bytes")));
            }
            match fill(conn).await {
                Ok(true) => {}
                Ok(false) => break,
                Err(e) => return Err(body_failed(e.to_string())),
            }
        }
        (conn.buf.split().freeze(), false)
    };
    Ok(Answer {
        status,
        body,
        reusable,
    })
}

/// Reads a chunked body to its last chunk and past its trailers.
async fn read_chunked(conn: &mut Conn) -> Result<Bytes, String> {
    let mut out = BytesMut::new();
    loop {
        let (skip, size) = loop {
            match httparse::parse_chunk_size(&conn.buf) {
                Ok(httparse::Status::Complete((skip, size))) => break (skip, size),
                Ok(httparse::Status::Partial) if conn.buf.len() > MAX_HEAD => {
                    return Err("a chunk size line is too long".into());
                }
                Ok(httparse::Status::Partial) => more(conn).await?,
                Err(_) => return Err("a chunk size does not parse".into()),
            }
        };
        let size = usize::try_from(size)
            .ok()
            .filter(|s| out.len().saturating_add(*s) <= MAX_ANSWER)
            .ok_or_else(|| format!("over {MAX_ANSWER} bytes"))?;
        let _ = conn.buf.split_to(skip);
        if size == 0 {
            // Trailers, if any, then the empty line.
            loop {
                if let Some(end) = conn.buf.windows(2).position(|w| w == b"\r\n") {
                    let _ = conn.buf.split_to(end + 2);
                    if end == 0 {
                        return Ok(out.freeze());
                    }
                } else if conn.buf.len() > MAX_HEAD {
                    return Err("the trailers are too long".into());
                } else {
                    more(conn).await?;
                }
            }
        }
        while conn.buf.len() < size + 2 {
            more(conn).await?;
        }
        out.extend_from_slice(&conn.buf[..size]);
        if &conn.buf[size..size + 2] != b"\r\n" {
            return Err("a chunk does not end in CRLF".into());
        }
        let _ = conn.buf.split_to(size + 2);
    }
}

/// [`fill`], where the end of the connection is an error (a body cut short).
async fn more(conn: &mut Conn) -> Result<(), String> {
    match fill(conn).await {
        Ok(true) => Ok(()),
        Ok(false) => Err("the connection closed mid-body".into()),
        Err(e) => Err(e.to_string()),
    }
}

#[cfg(test)]
#[path = "h1_tests.rs"]
mod tests;
