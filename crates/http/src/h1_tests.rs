use super::*;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use tokio::net::TcpListener;

/// What a scripted server does after reading a request.
#[derive(Clone)]
struct Reply {
    bytes: Vec<u8>,
    /// Close the connection after writing.
    close: bool,
}

fn reply(bytes: &str, close: bool) -> Reply {
    Reply {
        bytes: bytes.as_bytes().to_vec(),
        close,
    }
}

/// A server answering the n-th request (over all connections) with `replies[n]`; counts the
/// connections it accepted and keeps the requests it read.
struct Scripted {
    url: String,
    accepted: Arc<AtomicUsize>,
    seen: Arc<Mutex<Vec<Vec<u8>>>>,
}

async fn read_request(io: &mut TcpStream) -> Option<Vec<u8>> {
    let mut buf = Vec::new();
    loop {
        let mut chunk = [0u8; 4096];
        let n = io.read(&mut chunk).await.ok()?;
        if n == 0 {
            return None;
        }
        buf.extend_from_slice(&chunk[..n]);
        if let Some(end) = buf.windows(4).position(|w| w == b"\r\n\r\n") {
            let head = String::from_utf8_lossy(&buf[..end]).to_lowercase();
            let len: usize = head
                .lines()
                .find_map(|l| l.strip_prefix("content-length: "))
                .and_then(|v| v.trim().parse().ok())
                .unwrap_or(0);
            while buf.len() < end + 4 + len {
                let n = io.read(&mut chunk).await.ok()?;
                if n == 0 {
                    return None;
                }
                buf.extend_from_slice(&chunk[..n]);
            }
            return Some(buf);
        }
    }
}

async fn scripted(replies: Vec<Reply>) -> Scripted {
    let l = TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let url = format!("http://{}", l.local_addr().expect("addr"));
    let accepted = Arc::new(AtomicUsize::new(0));
    let seen = Arc::new(Mutex::new(Vec::new()));
    let next = Arc::new(AtomicUsize::new(0));
    let (a, s) = (accepted.clone(), seen.clone());
    tokio::spawn(async move {
        while let Ok((mut io, _)) = l.accept().await {
            a.fetch_add(1, Ordering::SeqCst);
            let (s, next, replies) = (s.clone(), next.clone(), replies.clone());
            tokio::spawn(async move {
                while let Some(req) = read_request(&mut io).await {
                    s.lock().push(req);
                    let i = next.fetch_add(1, Ordering::SeqCst);
                    let Some(r) = replies.get(i) else { return };
                    if io.write_all(&r.bytes).await.is_err() || r.close {
                        return;
                    }
                }
            });
        }
    });
    Scripted {
        url,
        accepted,
        seen,
    }
}

fn uri(base: &str, path: &str) -> Uri {
    format!("{base}{path}").parse().expect("uri")
}

async fn post(pool: &H1Pool, base: &str, body: &[u8]) -> Result<(StatusCode, Bytes), String> {
    let ct = HeaderValue::from_static("application/json");
    let extra = Extra {
        content_type: Some(&ct),
        ..Extra::default()
    };
    within(pool.exchange(&Method::POST, &uri(base, "/generate"), extra, body)).await
}

async fn within<F: std::future::Future>(f: F) -> F::Output {
    tokio::time::timeout(Duration::from_secs(10), f)
        .await
        .expect("the exchange finished in time")
}

const OK: &str =
    "HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: 7\r\n\r\n{\"a\":1}";

#[tokio::test]
async fn a_sized_answer_is_read_and_its_connection_reused() {
    let s = scripted(vec![reply(OK, false), reply(OK, false)]).await;
    let pool = H1Pool::default();
    let auth = HeaderValue::from_static("Bearer k");
    let via = HeaderValue::from_static("gw1");
    let ct = HeaderValue::from_static("application/json");
    let extra = Extra {
        content_type: Some(&ct),
        auth: Some(&auth),
        if_match: None,
        via: Some(&via),
    };
    let (status, body) = within(pool.exchange(
        &Method::POST,
        &uri(&s.url, "/generate?x=1"),
        extra,
        b"{\"text\":\"hi\"}",
    ))
    .await
    .expect("answer");
    assert_eq!((status, &body[..]), (StatusCode::OK, &b"{\"a\":1}"[..]));
    let (_, again) = post(&pool, &s.url, b"{}").await.expect("second answer");
    assert_eq!(&again[..], b"{\"a\":1}");
    assert_eq!(
        s.accepted.load(Ordering::SeqCst),
        1,
        "one connection, reused"
    );
    let first = String::from_utf8(s.seen.lock()[0].clone()).expect("utf8");
    let host = s.url.trim_start_matches("http://");
    assert!(
        first.starts_with("POST /generate?x=1 HTTP/1.1\r\n"),
        "{first}"
    );
    for h in [
        format!("host: {host}\r\n"),
        "authorization: Bearer k\r\n".into(),
        "x-troupe-via: gw1\r\n".into(),
        "content-type: application/json\r\n".into(),
        "content-length: 13\r\n".into(),
    ] {
        assert!(first.contains(&h), "{h:?} missing from {first}");
    }
    assert!(first.ends_with("\r\n\r\n{\"text\":\"hi\"}"), "{first}");
}

#[tokio::test]
async fn chunked_answers_with_trailers_and_interim_answers_are_read_whole() {
    let chunked = "HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n\
                   3;ext=1\r\n{\"a\r\n4\r\n\":2}\r\n0\r\nx-trailer: t\r\n\r\n";
    let s = scripted(vec![reply(chunked, false), reply(OK, false)]).await;
    let pool = H1Pool::default();
    let (status, body) = post(&pool, &s.url, b"{}").await.expect("answer");
    assert_eq!((status, &body[..]), (StatusCode::OK, &b"{\"a\":2}"[..]));
    post(&pool, &s.url, b"{}").await.expect("reused");
    assert_eq!(s.accepted.load(Ordering::SeqCst), 1);
}

#[tokio::test]
async fn answers_that_end_their_connection_are_not_pooled() {
    let to_eof = "HTTP/1.1 503 Service Unavailable\r\nconnection: close\r\n\r\nbusy";
    let closing = "HTTP/1.1 200 OK\r\nconnection: close\r\ncontent-length: 2\r\n\r\n{}";
    let old = "HTTP/1.0 200 OK\r\ncontent-length: 2\r\n\r\n{}";
    let s = scripted(vec![
        reply(to_eof, true),
        reply(closing, true),
        reply(old, false),
        reply(OK, false),
    ])
    .await;
    let pool = H1Pool::default();
    let (status, body) = post(&pool, &s.url, b"{}").await.expect("answer");
    assert_eq!((status.as_u16(), &body[..]), (503, &b"busy"[..]));
    post(&pool, &s.url, b"{}").await.expect("closing answer");
    post(&pool, &s.url, b"{}").await.expect("HTTP/1.0 answer");
    post(&pool, &s.url, b"{}").await.expect("last");
    assert_eq!(
        s.accepted.load(Ordering::SeqCst),
        4,
        "none of the first three connections was reused"
    );
}

#[tokio::test]
async fn a_pooled_connection_the_server_closed_is_retried_on_a_new_one() {
    // The server answers, then drops the connection as a keep-alive timeout would.
    let s = scripted(vec![reply(OK, true), reply(OK, false)]).await;
    let pool = H1Pool::default();
    post(&pool, &s.url, b"{}").await.expect("first");
    // Let the close arrive, so the pooled connection is dead when reused.
    let deadline = Instant::now() + Duration::from_secs(5);
    while pool
        .idle
        .lock()
        .values()
        .all(|l| l.iter().all(|c| looks_open(&c.io)))
    {
        assert!(
            Instant::now() < deadline,
            "the server's close never arrived"
        );
        tokio::task::yield_now().await;
    }
    let (status, _) = post(&pool, &s.url, b"{}").await.expect("retried");
    assert_eq!(status, StatusCode::OK);
    assert_eq!(s.accepted.load(Ordering::SeqCst), 2);
    assert_eq!(
        s.seen.lock().len(),
        2,
        "the request reached the server once"
    );
}

#[tokio::test]
async fn broken_answers_are_errors_that_say_what_is_wrong() {
    let cases = [
        (
            "HTTP/1.1 200 OK\r\ncontent-length: x\r\n\r\n",
            "not a number",
        ),
        (
            "HTTP/1.1 200 OK\r\ncontent-length: 1\r\ncontent-length: 2\r\n\r\n",
            "two different",
        ),
        (
            "HTTP/1.1 200 OK\r\ncontent-length: 10\r\n\r\n{}",
            "closed after 2 of 10",
        ),
        (
            "HTTP/1.1 200 OK\r\ncontent-length: 999999999999\r\n\r\n",
            "over",
        ),
        (
            "HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\nzz\r\n",
            "chunk size",
        ),
        ("NOT HTTP\r\n\r\n", "does not parse"),
        ("HTTP/1.1 20", "closed before an answer"),
    ];
    for (answer, says) in cases {
        let s = scripted(vec![reply(answer, true)]).await;
        let e = post(&H1Pool::default(), &s.url, b"{}")
            .await
            .expect_err(answer);
        assert!(e.contains(says), "{answer:?}: {e}");
    }
    let e = post(&H1Pool::default(), "https://127.0.0.1:1", b"{}")
        .await
        .expect_err("https");
    assert!(e.contains("only http://"), "{e}");
}

#[tokio::test]
async fn a_refused_connection_names_its_cause() {
    let l = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
    let addr = l.local_addr().expect("addr");
    drop(l);
    let e = post(&H1Pool::default(), &format!("http://{addr}"), b"{}")
        .await
        .expect_err("refused");
    assert!(e.contains("connect to") && e.contains("onnect"), "{e}");
}

#[tokio::test]
async fn it_speaks_to_a_hyper_server() {
    use axum::routing::post as route;
    let app = axum::Router::new().route(
        "/echo",
        route(|body: Bytes| async move { body }).get(|| async { "got" }),
    );
    let l = TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let base = format!("http://{}", l.local_addr().expect("addr"));
    tokio::spawn(async move { axum::serve(l, app).await });
    let pool = H1Pool::default();
    for i in 0..3 {
        let body = format!("{{\"i\":{i}}}");
        let (status, got) = within(pool.exchange(
            &Method::POST,
            &uri(&base, "/echo"),
            Extra::default(),
            body.as_bytes(),
        ))
        .await
        .expect("echo");
        assert_eq!((status, &got[..]), (StatusCode::OK, body.as_bytes()));
    }
    let (status, got) =
        within(pool.exchange(&Method::GET, &uri(&base, "/echo"), Extra::default(), b""))
            .await
            .expect("get");
    assert_eq!((status, &got[..]), (StatusCode::OK, &b"got"[..]));
    let (status, _) =
        within(pool.exchange(&Method::GET, &uri(&base, "/missing"), Extra::default(), b""))
            .await
            .expect("404");
    assert_eq!(status, StatusCode::NOT_FOUND);
    assert_eq!(
        pool.idle.lock().values().map(Vec::len).sum::<usize>(),
        1,
        "every exchange went over one connection"
    );
}
