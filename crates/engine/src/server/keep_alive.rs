//! What the engine does to every client connection so that it stays quick and reusable.
//!
//! [`accepted`] turns Nagle's algorithm off: with it on, each streamed chunk after the first
//! waits for the client to acknowledge the one before, which clients delay by up to 40 ms, so
//! a 64-token stream took ~42 ms instead of ~2.
//!
//! hyper reuses a connection only once the request's body has been read to its end. When an
//! answer comes before the body was read (`/continue_generation` takes none; an auth check or
//! a 404 answers before any handler), hyper drains what has already arrived and closes the
//! connection if the rest is still on its way. Clients that write the head and the body in two
//! writes (Python's `http.client`, hence `requests` and what is built on it) lose that race
//! often: their next request meets a closed socket (`BrokenPipeError`, `RemoteDisconnected`)
//! or pays a new connection. Reading a small body before routing closes the race for every
//! endpoint at once; larger bodies are read by their handlers, so nothing here holds more than
//! [`READ_AHEAD_BYTES`]. (The gateway's servers read every body before routing already:
//! `troupe_serving::envelope`.)

use axum::body::Body;
use axum::extract::Request;
use axum::http::header::CONTENT_LENGTH;
use axum::response::{IntoResponse, Response};
use tokio::net::TcpStream;

use super::error::ApiError;

/// Called on every accepted connection: TCP_NODELAY on (see the module's doc).
pub fn accepted(tcp: &mut TcpStream) {
    if let Err(e) = tcp.set_nodelay(true) {
        tracing::debug!("TCP_NODELAY not set: {e}");
    }
}

/// Bodies up to this size (by their `Content-Length`) are read whole before routing; every
/// control request and nearly every generation request is smaller.
pub const READ_AHEAD_BYTES: u64 = 64 << 10;

/// Reads a body of a declared size up to [`READ_AHEAD_BYTES`] before the request is routed
/// (the engine's one middleware, [`super::admit`], calls it first). A client that stops
/// mid-body is answered 400 (it is usually gone by then); other requests pass untouched.
pub async fn read_ahead(req: Request) -> Result<Request, Response> {
    let declared = req
        .headers()
        .get(CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.trim().parse::<u64>().ok());
    let Some(len) = declared.filter(|&n| n > 0 && n <= READ_AHEAD_BYTES) else {
        return Ok(req);
    };
    let (parts, body) = req.into_parts();
    match axum::body::to_bytes(body, len as usize).await {
        Ok(bytes) => Ok(Request::from_parts(parts, Body::from(bytes))),
        Err(e) => Err(ApiError::bad_request(format!(
            "could not read the {len}-byte request body ({e}); send the whole body its \
             Content-Length announces"
        ))
        .into_response()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn accepted_connections_send_without_delay() {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let _client = TcpStream::connect(addr).await.unwrap();
        let (mut tcp, _) = listener.accept().await.unwrap();
        assert!(!tcp.nodelay().unwrap(), "the OS default is Nagle on");
        accepted(&mut tcp);
        assert!(tcp.nodelay().unwrap());
    }
}
