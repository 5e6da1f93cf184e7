//! The test kit every Troupe test binary uses: a deadline around a test step ([`within`]),
//! polling for the event that shows work happened instead of sleeping for it ([`until`],
//! [`until_some`], [`Poll`]), small HTTP/JSON helpers that answer `(status, body)`
//! ([`client`], [`send`], [`post`], [`get`] and their variants), reading an SSE body
//! ([`sse_data`], [`sse_json`], [`sse_events`]), the error envelope's checks
//! ([`assert_envelope`], [`assert_bad_request`]), [`f32_bytes`] and [`free_port`].
//!
//! It depends on no Troupe crate, so the engine's and serving's own tests can take it as a
//! dev-dependency without a cycle; Troupe-specific helpers (starting a reference engine, a PD
//! deployment) live beside the tests that use them (`tests/common`).

mod sse;
mod wire;

pub use sse::{sse_data, sse_events, sse_json};
pub use wire::{assert_bad_request, assert_envelope, f32_bytes, free_port};

use std::future::Future;
use std::time::Duration;

use serde_json::Value;

/// Runs `f` with a deadline of `secs` seconds and panics when it passes: a test that hangs
/// fails with a message instead of stalling the whole suite. Every async test body runs under
/// one.
pub async fn within<F: Future>(secs: u64, f: F) -> F::Output {
    tokio::time::timeout(Duration::from_secs(secs), f)
        .await
        .unwrap_or_else(|_| panic!("test step exceeded its deadline of {secs} s"))
}

/// How [`until`] and [`until_some`] poll: how often they check and how long before they give
/// up. Polling for the state that shows work happened replaces sleeping "long enough" for it:
/// the test goes on as soon as it holds, and fails with its description when it never does.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Poll {
    /// The pause between two checks.
    pub every: Duration,
    /// How long the condition may take before the test fails ("never: ...").
    pub deadline: Duration,
}

impl Default for Poll {
    /// Every 5 ms for at most a minute: a condition that takes longer means the test is stuck,
    /// not slow.
    fn default() -> Self {
        Poll {
            every: Duration::from_millis(5),
            deadline: Duration::from_secs(60),
        }
    }
}

impl Poll {
    /// Polls every `every` (for checks that are expensive, such as an HTTP request that makes
    /// the server work), with the default deadline.
    pub fn every(every: Duration) -> Self {
        Poll {
            every,
            ..Poll::default()
        }
    }

    /// This poll with a deadline of `secs` seconds (where the test states a tighter bound).
    pub fn secs(self, secs: u64) -> Self {
        Poll {
            deadline: Duration::from_secs(secs),
            ..self
        }
    }

    /// Checks `check` until it holds; panics with `what` when the deadline passes first.
    pub async fn until<F: Future<Output = bool>>(self, what: &str, mut check: impl FnMut() -> F) {
        self.until_some(what, || {
            let f = check();
            async move { f.await.then_some(()) }
        })
        .await
    }

    /// Checks `check` until it answers `Some`, and returns what it answered; panics with
    /// `what` when the deadline passes first.
    pub async fn until_some<T, F: Future<Output = Option<T>>>(
        self,
        what: &str,
        mut check: impl FnMut() -> F,
    ) -> T {
        let deadline = tokio::time::Instant::now() + self.deadline;
        loop {
            if let Some(v) = check().await {
                return v;
            }
            assert!(
                tokio::time::Instant::now() < deadline,
                "never within {:?}: {what}",
                self.deadline
            );
            tokio::time::sleep(self.every).await;
        }
    }
}

/// Polls `check` (an async condition: `|| async { ... }`) with [`Poll::default`] until it
/// holds; panics with `what` after a minute.
pub async fn until<F: Future<Output = bool>>(what: &str, check: impl FnMut() -> F) {
    Poll::default().until(what, check).await
}

/// Polls `check` with [`Poll::default`] until it answers `Some`, and returns the value; panics
/// with `what` after a minute.
pub async fn until_some<T, F: Future<Output = Option<T>>>(
    what: &str,
    check: impl FnMut() -> F,
) -> T {
    Poll::default().until_some(what, check).await
}

/// An HTTP client for tests: no proxy (tests talk to servers on loopback, and a proxy from the
/// environment would intercept them) and a 60 s request timeout (a hung server fails the
/// request, not the suite). Build one per test: a client's pooled connections belong to the
/// runtime that opened them, and each `#[tokio::test]` has its own.
pub fn client() -> reqwest::Client {
    reqwest::Client::builder()
        .no_proxy()
        .timeout(Duration::from_secs(60))
        .build()
        .expect("an HTTP client")
}

/// Sends `req` and answers `(status, body)`: the body as JSON, or as a JSON string when it is
/// not JSON (an error page, an SSE stream), so a test can assert on either without a parse
/// failure hiding the status.
pub async fn send(req: reqwest::RequestBuilder) -> (u16, Value) {
    let r = req.send().await.expect("request sent");
    let status = r.status().as_u16();
    let text = r.text().await.expect("body read");
    (
        status,
        serde_json::from_str(&text).unwrap_or(Value::String(text)),
    )
}

/// `POST url` with a JSON body on a fresh [`client`] (a connection of its own); see [`send`].
pub async fn post(url: &str, body: &Value) -> (u16, Value) {
    post_with(&client(), url, body).await
}

/// `POST url` with a JSON body on `client` (reusing its connections); see [`send`].
pub async fn post_with(client: &reqwest::Client, url: &str, body: &Value) -> (u16, Value) {
    send(client.post(url).json(body)).await
}

/// `POST url` with `body` sent as is under `content-type: application/json` (malformed JSON,
/// exact bytes); see [`send`].
pub async fn post_raw(url: &str, body: &str) -> (u16, Value) {
    post_raw_auth(url, body, None).await
}

/// [`post_raw`] with `Authorization: Bearer key` when `key` is given.
pub async fn post_raw_auth(url: &str, body: &str, key: Option<&str>) -> (u16, Value) {
    let req = client()
        .post(url)
        .header("content-type", "application/json")
        .body(body.to_string());
    send(bearer(req, key)).await
}

/// `GET url` on a fresh [`client`]; see [`send`].
pub async fn get(url: &str) -> (u16, Value) {
    get_with(&client(), url).await
}

/// `GET url` on `client`; see [`send`].
pub async fn get_with(client: &reqwest::Client, url: &str) -> (u16, Value) {
    send(client.get(url)).await
}

/// [`get`] with `Authorization: Bearer key` when `key` is given.
pub async fn get_auth(url: &str, key: Option<&str>) -> (u16, Value) {
    send(bearer(client().get(url), key)).await
}

/// `req` with `Authorization: Bearer key` when `key` is given, unchanged otherwise (tests that
/// try the same call with no key, a wrong one and the right one).
pub fn bearer(req: reqwest::RequestBuilder, key: Option<&str>) -> reqwest::RequestBuilder {
    match key {
        Some(k) => req.bearer_auth(k),
        None => req,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn until_returns_once_the_condition_holds() {
        within(10, async {
            let n = std::sync::atomic::AtomicU32::new(0);
            let at = until_some("the third check", || async {
                let i = n.fetch_add(1, std::sync::atomic::Ordering::SeqCst) + 1;
                (i == 3).then_some(i)
            })
            .await;
            assert_eq!(at, 3);
            until("it still holds", || async { true }).await;
        })
        .await
    }

    #[tokio::test]
    #[should_panic(expected = "never within 20ms: a thing that never happens")]
    async fn until_fails_with_its_description_at_the_deadline() {
        let p = Poll {
            every: Duration::from_millis(1),
            deadline: Duration::from_millis(20),
        };
        within(
            10,
            p.until("a thing that never happens", || async { false }),
        )
        .await;
    }

    #[tokio::test]
    #[should_panic(expected = "deadline of 0 s")]
    async fn within_fails_a_step_that_outlives_its_deadline() {
        within(0, std::future::pending::<()>()).await;
    }

    #[tokio::test]
    async fn send_reads_a_non_json_body_as_a_string() {
        within(10, async {
            let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
            let url = format!("http://{}/x", l.local_addr().unwrap());
            tokio::spawn(async move {
                use tokio::io::{AsyncReadExt, AsyncWriteExt};
                let (mut s, _) = l.accept().await.unwrap();
                let mut buf = [0u8; 1024];
                let _ = s.read(&mut buf).await;
                let body = "not json";
                let head = format!(
                    "HTTP/1.1 502 Bad Gateway\r\ncontent-length: {}\r\nconnection: close\r\n\r\n",
                    body.len()
                );
                s.write_all(head.as_bytes()).await.unwrap();
                s.write_all(body.as_bytes()).await.unwrap();
            });
            assert_eq!(get(&url).await, (502, Value::String("not json".into())));
        })
        .await
    }
}
