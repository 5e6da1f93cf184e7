//! A streamed turn's head sent when it starts generating. The turn's events are sent whole once
//! it is done (`docs/agents.md`), but the head, with the `X-Request-Id` a client aborts it by,
//! goes out as soon as the prompt is made and the session's room held, as a plain streamed
//! `/generate`'s head does. A turn refused before then is answered with its API's error and
//! status; one that fails after is ended with the API's error event. A client that leaves takes
//! the turn with it (its generation is dropped, so the engine aborts it).

use std::convert::Infallible;
use std::sync::Arc;

use axum::body::{Body, Bytes};
use axum::http::{HeaderMap, HeaderValue, StatusCode, header};
use axum::response::{IntoResponse, Response};
use troupe_agent::Agent;

use super::super::GatewayState;
use super::turn::{self, TurnError, TurnOut, TurnSpec};

/// Aborts a spawned turn when the answer (or its body) is dropped.
struct AbortOnDrop(tokio::task::AbortHandle);

impl Drop for AbortOnDrop {
    fn drop(&mut self) {
        self.0.abort();
    }
}

/// An event stream answer of `text`, with the turn's id in `X-Request-Id`.
pub(super) fn events(rid: &str, text: String) -> Response {
    let mut r = ([(header::CONTENT_TYPE, "text/event-stream")], text).into_response();
    with_id(&mut r, rid);
    r
}

/// Puts the turn's id in the answer's `X-Request-Id`.
pub(super) fn with_id(r: &mut Response, rid: &str) {
    if let Ok(v) = HeaderValue::from_str(rid) {
        r.headers_mut().insert("x-request-id", v);
    }
}

fn joined(
    r: Result<Result<TurnOut, TurnError>, tokio::task::JoinError>,
) -> Result<TurnOut, TurnError> {
    r.unwrap_or_else(|e| {
        Err(TurnError {
            status: 500,
            message: format!("the turn did not finish: {e}"),
        })
    })
}

/// Runs `spec` as a streamed turn: `Err` when it is refused before it generates (answer it
/// with the API's error), else the event stream, whose text `text` makes from the finished turn
/// and `failed` from an error after the head went out.
pub(super) async fn streamed(
    state: &Arc<GatewayState>,
    agent: &Arc<Agent>,
    headers: HeaderMap,
    mut spec: TurnSpec,
    text: impl FnOnce(TurnOut) -> String + Send + 'static,
    failed: impl FnOnce(TurnError) -> String + Send + 'static,
) -> Result<Response, TurnError> {
    let rid = spec.rid.clone();
    let (tx, rx) = tokio::sync::oneshot::channel();
    spec.started = Some(tx);
    let (s, a) = (state.clone(), agent.clone());
    let mut task = tokio::spawn(async move { turn::run(&s, &a, &headers, spec).await });
    let abort = AbortOnDrop(task.abort_handle());
    let started = tokio::select! {
        biased;
        done = &mut task => return joined(done).map(|out| events(&rid, text(out))),
        r = rx => r.is_ok(),
    };
    if !started {
        // Refused before generating: the spec (and its sender) went with the error.
        return joined(task.await).map(|out| events(&rid, text(out)));
    }
    let body = futures::stream::once(async move {
        let _abort = abort;
        let t = match joined(task.await) {
            Ok(out) => text(out),
            Err(e) => failed(e),
        };
        Ok::<_, Infallible>(Bytes::from(t))
    });
    let mut r = Response::builder()
        .status(StatusCode::OK)
        .header(header::CONTENT_TYPE, "text/event-stream")
        .body(Body::from_stream(body))
        .unwrap_or_else(|_| StatusCode::INTERNAL_SERVER_ERROR.into_response());
    with_id(&mut r, &rid);
    Ok(r)
}
