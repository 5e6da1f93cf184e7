//! The pieces every attempt is made of, stream or not: how one ends when it does not produce
//! the client's response ([`Fail`]), sending the body to a worker with its failures sorted into
//! retryable and final ([`send`], [`send_full`], [`upstream_error`]), and the start of a PD
//! attempt ([`pd_attempt`]). The non-stream attempts and the retry loop ([`super::forward`])
//! and the streaming attempts ([`super::stream`]) both use them, so they live below both.

use std::sync::Arc;

use axum::body::Bytes;
use axum::http::{StatusCode, header};
use axum::response::{IntoResponse, Response};
use hyper::body::Incoming;
use serde_json::Value;

use super::GatewayState;
use super::request::InferReq;
use troupe_http::error::ApiError;
use troupe_http::upstream::read_body;
use troupe_router::guard::LoadGuard;
use troupe_router::pd;
use troupe_router::worker::Worker;

/// Why an attempt did not produce the client's response.
pub(crate) enum Fail {
    /// Try again elsewhere; `culprits` failed and are avoided next time.
    Retry {
        reason: String,
        culprits: Vec<Arc<dyn Worker>>,
    },
    /// Answer the client with this.
    Final(Box<Response>),
}

impl Fail {
    pub(crate) fn retry(reason: impl Into<String>, w: &Arc<dyn Worker>) -> Self {
        Fail::Retry {
            reason: reason.into(),
            culprits: vec![w.clone()],
        }
    }
}

impl From<ApiError> for Fail {
    fn from(e: ApiError) -> Self {
        Fail::Final(Box::new(e.into_response()))
    }
}

fn retryable(status: StatusCode) -> bool {
    matches!(status.as_u16(), 408 | 429 | 500 | 502 | 503 | 504)
}

/// `path` on `w` as a URI, or the 502 that says it is not one.
pub(super) fn endpoint(w: &Arc<dyn Worker>, path: &str) -> Result<axum::http::Uri, ApiError> {
    w.endpoint(path)
        .ok_or_else(|| ApiError::bad_gateway(format!("{}{path} is not a valid URL", w.url())))
}

/// Sends `body` to `path` on `w`, mapping transport errors and retryable statuses to
/// [`Fail::Retry`] and other error statuses to a [`Fail::Final`] answer ([`upstream_error`]).
pub(crate) async fn send(
    state: &GatewayState,
    w: &Arc<dyn Worker>,
    path: &str,
    body: Bytes,
) -> Result<Response<Incoming>, Fail> {
    let uri = endpoint(w, path)?;
    let resp = match state
        .upstream
        .post(uri, body, state.worker_auth.as_ref())
        .await
    {
        Ok(r) => r,
        Err(e) => {
            w.record_outcome(false);
            return Err(Fail::retry(
                format!("{} {}: {e}", w.worker_type(), w.url()),
                w,
            ));
        }
    };
    let status = resp.status();
    if status.is_success() {
        return Ok(resp);
    }
    let text = read_body(resp).await.unwrap_or_default();
    Err(refused(state, w, status, &text))
}

/// What a worker's answer with an error `status` (and body `text`) makes of the attempt:
/// retryable statuses ([`retryable`]) move the request on, the rest are the client's answer
/// ([`upstream_error`]).
fn refused(state: &GatewayState, w: &Arc<dyn Worker>, status: StatusCode, text: &[u8]) -> Fail {
    if retryable(status) {
        if status.is_server_error() {
            w.record_outcome(false);
        }
        return Fail::retry(
            format!(
                "{} {} answered {status}: {}",
                w.worker_type(),
                w.url(),
                String::from_utf8_lossy(text)
            ),
            w,
        );
    }
    w.record_outcome(true);
    // A 508 says the worker leads into a loop of gateways: it is removed, and the client gets
    // the 508 that says why.
    state.drop_looping(w, status.as_u16());
    Fail::Final(Box::new(upstream_error(w, status, text)))
}

/// A worker's final (non-retryable) error answer for the client: a JSON body passes through
/// unchanged; anything else (an engine's or a web server's plain-text 413, an HTML page) becomes
/// the envelope with the worker's status, its text as the message, so the client always parses
/// one error shape.
pub(crate) fn upstream_error(w: &Arc<dyn Worker>, status: StatusCode, body: &[u8]) -> Response {
    if serde_json::from_slice::<Value>(body).is_ok_and(|v| v.is_object()) {
        return (
            status,
            [(header::CONTENT_TYPE, "application/json")],
            Bytes::copy_from_slice(body),
        )
            .into_response();
    }
    let text = String::from_utf8_lossy(body);
    let text: String = text.trim().chars().take(1000).collect();
    ApiError::new(
        status,
        format!(
            "{} worker {} answered {status}: {}",
            w.worker_type(),
            w.url(),
            if text.is_empty() { "(no body)" } else { &text }
        ),
    )
    .into_response()
}

/// [`send`] and read the whole body, as one exchange on a connection this task drives
/// ([`troupe_http::h1`]): no stream to hand on, so none of hyper's connection task.
pub(crate) async fn send_full(
    state: &GatewayState,
    w: &Arc<dyn Worker>,
    path: &str,
    body: Bytes,
) -> Result<Bytes, Fail> {
    let uri = endpoint(w, path)?;
    let (status, text) = state
        .upstream
        .post_full(uri, body, state.worker_auth.as_ref())
        .await
        .map_err(|e| {
            w.record_outcome(false);
            Fail::retry(format!("{} {}: {e}", w.worker_type(), w.url()), w)
        })?;
    if status.is_success() {
        return Ok(text);
    }
    Err(refused(state, w, status, &text))
}

/// What every PD attempt (stream or not) starts with: a fresh (prefill, decode) pair and room,
/// load guards on both, and the client's body with the bootstrap fields injected.
pub(super) fn pd_attempt(
    state: &GatewayState,
    req: &InferReq,
    avoid: &[String],
) -> Result<(troupe_router::router::PdPair, Vec<LoadGuard>, Bytes), Fail> {
    let pair = state
        .router
        .route_pd_for(&req.ctx(), avoid, req.want.as_ref())
        .map_err(ApiError::from)?;
    let guards = vec![
        LoadGuard::new(pair.prefill.clone()).holding(&state.inflight, req.rid(), req.ep),
        LoadGuard::new(pair.decode.clone()).holding(&state.inflight, req.rid(), req.ep),
    ];
    let rooms = pd::rooms_for(&pair, req.batch);
    let body = pd::inject(&req.raw, &req.obj, &pair, &rooms, req.batch);
    Ok((pair, guards, body))
}
