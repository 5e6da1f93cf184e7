//! Client connections: a keep-alive connection survives any answer, however the client splits
//! its writes, and a streamed answer arrives as it is produced.

use crate::common;

use std::time::Duration;

use common::*;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

/// How many whole `Content-Length` responses `buf` holds (the engine answers these requests
/// with a length, not chunked).
fn whole_responses(buf: &[u8]) -> usize {
    let text = String::from_utf8_lossy(buf);
    let mut rest: &str = &text;
    let mut n = 0;
    while let Some(end) = rest.find("\r\n\r\n") {
        let head = &rest[..end];
        let len: usize = head
            .lines()
            .find_map(|l| {
                let (k, v) = l.split_once(':')?;
                k.eq_ignore_ascii_case("content-length")
                    .then(|| v.trim().parse().ok())?
            })
            .unwrap_or(0);
        let body_end = end + 4 + len;
        if rest.len() < body_end {
            break;
        }
        n += 1;
        rest = &rest[body_end..];
    }
    n
}

/// Sends a POST to `path` the way Python's `http.client` does, head and body in two writes,
/// with the body only after the engine had time to answer the head alone; then a second
/// request on the same connection. Returns how many answers came back before the connection
/// ended (2 when it was kept).
async fn head_then_body(addr: std::net::SocketAddr, path: &str, auth: Option<&str>) -> usize {
    let mut s = TcpStream::connect(addr).await.unwrap();
    let auth = auth.map_or(String::new(), |k| format!("Authorization: Bearer {k}\r\n"));
    let head = format!(
        "POST {path} HTTP/1.1\r\nHost: e\r\n{auth}Content-Type: application/json\r\nContent-Length: 2\r\n\r\n"
    );
    s.write_all(head.as_bytes()).await.unwrap();
    // Without the fix the engine answers the head alone at once and drops the connection
    // before the body below arrives; this wait only gives it the chance to.
    let mut buf = vec![0u8; 0];
    let mut chunk = [0u8; 4096];
    if let Ok(Ok(n)) = tokio::time::timeout(Duration::from_millis(200), s.read(&mut chunk)).await {
        buf.extend_from_slice(&chunk[..n]);
    }
    s.write_all(b"{}").await.unwrap();
    // The peer may have closed: a failed write shows up as fewer answers below.
    let _ = s
        .write_all(b"GET /health HTTP/1.1\r\nHost: e\r\n\r\n")
        .await;
    while whole_responses(&buf) < 2 {
        match s.read(&mut chunk).await {
            Ok(0) | Err(_) => break,
            Ok(n) => buf.extend_from_slice(&chunk[..n]),
        }
    }
    whole_responses(&buf)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_body_sent_after_its_head_keeps_the_connection() {
    within(60, async {
        let e = engine(args("null")).await;
        // A handler that takes no body, one that reads it, and no handler at all.
        for path in [
            "/continue_generation",
            "/pause_generation",
            "/no_such_endpoint",
        ] {
            assert_eq!(head_then_body(e.addr(), path, None).await, 2, "{path}");
        }
        let mut a = args("null");
        a.api_key = Some("k".into());
        let locked = engine(a).await;
        // Refused before any handler runs, and accepted.
        assert_eq!(
            head_then_body(locked.addr(), "/abort_request", None).await,
            2
        );
        assert_eq!(
            head_then_body(locked.addr(), "/continue_generation", Some("k")).await,
            2
        );
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_body_cut_short_is_a_clear_error() {
    within(60, async {
        let e = engine(args("null")).await;
        let mut s = TcpStream::connect(e.addr()).await.unwrap();
        s.write_all(b"POST /pause_generation HTTP/1.1\r\nHost: e\r\nContent-Length: 10\r\n\r\n{}")
            .await
            .unwrap();
        s.shutdown().await.unwrap();
        let mut out = String::new();
        s.read_to_string(&mut out).await.unwrap();
        assert!(out.starts_with("HTTP/1.1 400"), "{out}");
        assert!(out.contains("Content-Length announces"), "{out}");
        // The engine is unharmed.
        assert_eq!(get(&format!("{}/health", e.url())).await.0, 200);
    })
    .await;
}
