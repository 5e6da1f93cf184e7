//! Connection bounds and request limits of the gateway and the DataProxy, over raw sockets where
//! a well-behaved client would not show them: a held partial request is cut after the header
//! or body read timeout, an idle keep-alive connection is closed, a slow request is not, and
//! every limit or routing error (405, 408, 413, 414, 431) and an upstream's plain-text error
//! come back as the JSON error envelope.

use crate::support;

use std::net::SocketAddr;
use std::time::{Duration, Instant};

use axum::http::StatusCode;
use serde_json::{Value, json};
use support::*;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;
use troupe_serving::gateway::{self, GatewayConfig, GatewayHandle};
use troupe_serving::proxy::{self, ProxyConfig};
use troupe_serving::{ServeLimits, WorkerSpec};

/// A gateway over `workers` with `tune` applied, probing off, no retries.
async fn gw_with(workers: Vec<WorkerSpec>, tune: impl FnOnce(&mut GatewayConfig)) -> GatewayHandle {
    let mut cfg = GatewayConfig {
        workers,
        max_retries: 0,
        retry_backoff: Duration::ZERO,
        ..Default::default()
    };
    cfg.router.health.interval = Duration::ZERO;
    tune(&mut cfg);
    gateway::start(cfg).await.expect("gateway starts")
}

/// Reads until the server closes the connection (EOF or reset).
async fn read_until_closed(s: &mut TcpStream) -> Vec<u8> {
    let mut out = Vec::new();
    let mut buf = [0u8; 8192];
    loop {
        match s.read(&mut buf).await {
            Ok(0) | Err(_) => return out,
            Ok(n) => out.extend_from_slice(&buf[..n]),
        }
    }
}

/// The status and JSON body of the first response in `raw`.
fn parse_response(raw: &[u8]) -> (u16, String, Value) {
    let text = String::from_utf8_lossy(raw).into_owned();
    let (head, body) = text.split_once("\r\n\r\n").unwrap_or((&text, ""));
    let status = head
        .split_whitespace()
        .nth(1)
        .and_then(|s| s.parse().ok())
        .unwrap_or(0);
    let len = head
        .lines()
        .find_map(|l| {
            let (k, v) = l.split_once(':')?;
            k.eq_ignore_ascii_case("content-length")
                .then(|| v.trim().parse::<usize>().ok())?
        })
        .unwrap_or(body.len());
    let body = &body[..len.min(body.len())];
    (
        status,
        head.to_ascii_lowercase(),
        serde_json::from_str(body).unwrap_or(Value::String(body.to_string())),
    )
}

async fn connect(addr: SocketAddr) -> TcpStream {
    TcpStream::connect(addr).await.expect("connect")
}

mod timeouts {
    use super::*;

    #[tokio::test]
    async fn a_held_partial_request_head_is_cut_after_the_header_read_timeout() {
        within(20, async {
            let g = gw_with(vec![], |c| {
                c.limits.header_read_timeout = Duration::from_millis(300);
            })
            .await;
            for partial in [
                &b""[..],
                b"POST /generate HTTP/1.1\r\nHost: x\r\nContent-Le",
            ] {
                let mut s = connect(g.addr()).await;
                s.write_all(partial).await.expect("write");
                let t = Instant::now();
                read_until_closed(&mut s).await;
                let held = t.elapsed();
                assert!(
                    held >= Duration::from_millis(250) && held < Duration::from_secs(5),
                    "closed after {held:?}"
                );
            }
        })
        .await;
    }

    #[tokio::test]
    async fn a_held_partial_body_is_answered_408_and_the_connection_closed() {
        within(20, async {
            let b = fake(|_, _, _| Reply::Json(StatusCode::OK, answer(1))).await;
            let g = gw_with(vec![WorkerSpec::regular(&b.url)], |c| {
                c.limits.body_read_timeout = Duration::from_millis(300);
            })
            .await;
            let mut s = connect(g.addr()).await;
            s.write_all(b"POST /generate HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: 100\r\n\r\n{\"text\":")
                .await
                .expect("write");
            let t = Instant::now();
            let raw = read_until_closed(&mut s).await;
            assert!(t.elapsed() < Duration::from_secs(5));
            let (st, head, v) = parse_response(&raw);
            assert_eq!(st, 408, "{v}");
            assert_envelope(&v, 408);
            assert_eq!(v["type"], "RequestTimeoutError");
            assert!(head.contains("connection: close"), "{head}");
            assert_eq!(b.count("/generate"), 0, "nothing forwarded");
        })
        .await;
    }

    #[tokio::test]
    async fn an_idle_keep_alive_connection_is_closed_but_a_slow_request_is_not() {
        within(20, async {
            let slow = fake(|_, _, _| Reply::Hang).await;
            let g = gw_with(vec![WorkerSpec::regular(&slow.url)], |c| {
                c.limits.idle_timeout = Duration::from_millis(300);
                c.request_timeout = Duration::from_millis(900);
            })
            .await;
            // A request that takes three idle timeouts is answered on the same connection.
            let mut s = connect(g.addr()).await;
            let body = r#"{"text":"x"}"#;
            s.write_all(format!("POST /generate HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n{body}", body.len()).as_bytes())
                .await
                .expect("write");
            let mut buf = vec![0u8; 4096];
            let n = s.read(&mut buf).await.expect("answer");
            let (st, _, v) = parse_response(&buf[..n]);
            assert_eq!(st, 504, "the worker's timeout, not the connection's: {v}");
            assert_envelope(&v, 504);
            // Then, idle, it is closed (the 30 s header timeout would take far longer).
            let t = Instant::now();
            read_until_closed(&mut s).await;
            let idle = t.elapsed();
            assert!(idle < Duration::from_secs(5), "closed after {idle:?}");
        })
        .await;
    }

    #[tokio::test]
    async fn the_proxy_cuts_held_requests_too() {
        within(20, async {
            let b = fake(|_, _, _| Reply::Json(StatusCode::OK, answer(1))).await;
            let p = proxy::start(ProxyConfig {
                backends: vec![b.url.clone()],
                limits: ServeLimits {
                    header_read_timeout: Duration::from_millis(300),
                    max_body_bytes: 1024,
                    ..Default::default()
                },
                ..Default::default()
            })
            .await
            .expect("proxy");
            let mut s = connect(p.addr()).await;
            s.write_all(b"GET /health HTTP/1.1\r\nHo")
                .await
                .expect("write");
            let t = Instant::now();
            read_until_closed(&mut s).await;
            assert!(t.elapsed() < Duration::from_secs(5));

            let big = json!({"text": "x".repeat(4096)});
            let (st, v) = post(&format!("{}/generate", p.url()), &big).await;
            assert_eq!(st, 413, "{v}");
            assert_envelope(&v, 413);
            assert_eq!(b.count("/generate"), 0);
        })
        .await;
    }
}

mod envelope {
    use super::*;

    #[tokio::test]
    async fn an_oversized_body_is_refused_at_the_gateway_in_the_envelope() {
        within(20, async {
            let b = fake(|_, _, _| Reply::Json(StatusCode::OK, answer(1))).await;
            let g = gw_with(vec![WorkerSpec::regular(&b.url)], |c| c.limits.max_body_bytes = 1024).await;
            assert_eq!(GatewayConfig::default().limits.max_body_bytes, 32 << 20);
            let big = json!({"text": "x".repeat(4096)});
            let (st, v) = post(&format!("{}/generate", g.url()), &big).await;
            assert_eq!(st, 413, "{v}");
            assert_envelope(&v, 413);
            assert_eq!(v["type"], "PayloadTooLargeError");
            assert!(v["message"].as_str().unwrap_or("").contains("1024"), "{v}");

            // Without a Content-Length (chunked), the limit holds while reading.
            let mut s = connect(g.addr()).await;
            let chunk = "x".repeat(2000);
            s.write_all(format!("POST /generate HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n{:x}\r\n{chunk}\r\n", chunk.len()).as_bytes())
                .await
                .expect("write");
            let (st, _, v) = parse_response(&read_until_closed(&mut s).await);
            assert_eq!(st, 413, "{v}");
            assert_envelope(&v, 413);
            assert_eq!(b.count("/generate"), 0, "nothing forwarded");

            // Under the limit, it is forwarded.
            let (st, _) = post(&format!("{}/generate", g.url()), &json!({"text": "x"})).await;
            assert_eq!(st, 200);
        })
        .await;
    }

    #[tokio::test]
    async fn wrong_method_long_uri_and_large_headers_are_envelopes() {
        within(20, async {
            let g = gw_with(vec![], |_| {}).await;
            let r = client()
                .get(format!("{}/generate", g.url()))
                .send()
                .await
                .expect("sent");
            assert_eq!(r.status().as_u16(), 405);
            assert_eq!(r.headers()["allow"], "POST");
            let v: Value = r.json().await.expect("json");
            assert_envelope(&v, 405);
            assert_eq!(v["type"], "MethodNotAllowedError");
            assert!(
                v["message"]
                    .as_str()
                    .unwrap_or("")
                    .contains("not allowed on /generate"),
                "{v}"
            );
            let (st, v) = post(&format!("{}/workers/w1", g.url()), &json!({})).await;
            assert_eq!(st, 405);
            assert_envelope(&v, 405);

            let (st, v) = get(&format!("{}/health?q={}", g.url(), "a".repeat(9000))).await;
            assert_eq!(st, 414, "{v}");
            assert_envelope(&v, 414);
            assert_eq!(v["type"], "UriTooLongError");

            let mut many = client().get(format!("{}/health", g.url()));
            for i in 0..120 {
                many = many.header(format!("x-h{i}"), "v");
            }
            let r = many.send().await.expect("sent");
            assert_eq!(r.status().as_u16(), 431);
            let v: Value = r.json().await.expect("json");
            assert_envelope(&v, 431);
            assert_eq!(v["type"], "RequestHeaderFieldsTooLargeError");
            let r = client()
                .get(format!("{}/health", g.url()))
                .header("x-big", "b".repeat(70 << 10))
                .send()
                .await
                .expect("sent");
            assert_eq!(r.status().as_u16(), 431);
            assert_envelope(&r.json::<Value>().await.expect("json"), 431);

            assert_eq!(get(&format!("{}/health", g.url())).await.0, 200);
        })
        .await;
    }

    #[tokio::test]
    async fn an_upstream_plain_text_error_is_wrapped_with_its_status() {
        within(20, async {
            let b = fake(|path, _, _| match path {
                "/generate" => Reply::Text(StatusCode::PAYLOAD_TOO_LARGE, "length limit exceeded"),
                "/v1/models" => Reply::Text(StatusCode::FORBIDDEN, "<html>forbidden</html>"),
                _ => Reply::Json(StatusCode::BAD_REQUEST, json!({"object": "error", "message": "engine says no", "type": "BadRequestError", "param": null, "code": 400})),
            })
            .await;
            let g = gw_with(vec![WorkerSpec::regular(&b.url)], |_| {}).await;
            let (st, v) = post(&format!("{}/generate", g.url()), &json!({"text": "x"})).await;
            assert_eq!(st, 413, "{v}");
            assert_envelope(&v, 413);
            let msg = v["message"].as_str().unwrap_or("");
            assert!(msg.contains("length limit exceeded") && msg.contains(&b.url), "{msg}");

            let (st, v) = get(&format!("{}/v1/models", g.url())).await;
            assert_eq!(st, 403, "{v}");
            assert_envelope(&v, 403);

            // A JSON error passes through as the engine wrote it.
            let (st, v) = post(&format!("{}/v1/completions", g.url()), &json!({"prompt": "x"})).await;
            assert_eq!(st, 400);
            assert_eq!(v["message"], "engine says no");
        })
        .await;
    }
}

/// Keyed routes are refused from the request head: a client without the key never gets the
/// gateway to read (and hold) its body, however large it announces it to be.
mod auth_before_body {
    use super::*;

    /// Sends a head announcing `len` body bytes plus the first 16 of them, and reads the answer
    /// (the server closes the connection after it).
    async fn announce(
        addr: SocketAddr,
        path: &str,
        auth: Option<&str>,
        len: u64,
    ) -> (u16, String, Value) {
        let mut s = connect(addr).await;
        let auth = auth.map_or(String::new(), |a| format!("Authorization: {a}\r\n"));
        s.write_all(
            format!(
                "POST {path} HTTP/1.1\r\nHost: x\r\n{auth}Content-Type: application/octet-stream\r\nContent-Length: {len}\r\n\r\n0123456789abcdef"
            )
            .as_bytes(),
        )
        .await
        .expect("write");
        parse_response(&read_until_closed(&mut s).await)
    }

    #[tokio::test]
    async fn unauthenticated_bodies_on_keyed_routes_are_refused_before_they_are_read() {
        // The body read timeout is far past the test's deadline: an answer in time means the
        // body was never waited for.
        within(20, async {
            let own = gw_with(vec![], |c| {
                c.admin_key = Some("adm".into());
                c.limits.body_read_timeout = Duration::from_secs(600);
            })
            .await;
            let fwd = gw_with(vec![], |c| {
                c.admin_key = Some("adm".into());
                c.limits.body_read_timeout = Duration::from_secs(600);
                c.control_upstream = Some("http://127.0.0.1:9".into());
            })
            .await;
            for g in [&own, &fwd] {
                for (path, len) in [
                    ("/update_weights_from_tensor", 1u64 << 30),
                    ("/update_weights_from_distributed", 1 << 20),
                    ("/workers", 1 << 20),
                ] {
                    for auth in [None, Some("Bearer wrong"), Some("Basic adm")] {
                        let t = Instant::now();
                        let (st, head, v) = announce(g.addr(), path, auth, len).await;
                        assert_eq!(st, 401, "{path} {auth:?}: {v}");
                        assert_eq!(v["code"], 401, "{v}");
                        assert_eq!(v["type"], "AuthenticationError", "{v}");
                        assert!(head.contains("connection: close"), "{head}");
                        assert!(t.elapsed() < Duration::from_secs(10), "{path}");
                    }
                }
            }
        })
        .await;
    }

    #[tokio::test]
    async fn the_bearer_scheme_is_case_insensitive() {
        within(20, async {
            let g = gw_with(vec![], |c| c.admin_key = Some("adm".into())).await;
            let client = client();
            for scheme in ["Bearer", "bearer", "BEARER"] {
                let r = client
                    .get(format!("{}/workers", g.url()))
                    .header("authorization", format!("{scheme} adm"))
                    .send()
                    .await
                    .expect("send");
                assert_eq!(r.status(), 200, "{scheme}");
            }
            let r = client
                .get(format!("{}/workers", g.url()))
                .header("authorization", "Bearer Adm")
                .send()
                .await
                .expect("send");
            assert_eq!(r.status(), 401, "the key itself is exact");
        })
        .await;
    }
}
