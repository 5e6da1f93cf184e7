//! Streaming attempts.
//!
//! The upstream SSE is split into whole events and relayed whole ([`super::relay`]: a burst of
//! events that arrived together goes out in one frame). Before
//! the first event reaches the client nothing is committed, so a failure up to then (transport
//! error, error status, an aborted first event, a failed prefill) is retried on a new worker or
//! pair; after it, a failure becomes one JSON error event followed by `data: [DONE]`, so the
//! client always sees a well-formed stream.
//!
//! In PD mode the decode stream is the answer. The prefill's (short) stream is read in full
//! concurrently; the response starts only once both the prefill finished and decode produced
//! its first event (decode cannot produce one before the KV handoff anyway, so this costs no
//! time to first token), and with `return_logprob` every decode event gets prefill's
//! `input_token_logprobs` prepended (per `index` for batches).

use std::sync::Arc;

use axum::body::{Body, Bytes};
use axum::http::header;
use axum::response::Response;
use http_body_util::BodyExt;
use serde_json::Value;

use super::GatewayState;
use super::attempt::{Fail, pd_attempt, send, send_full};
use super::relay::{Relay, Upstream};
use super::request::InferReq;
use troupe_http::coalesce::Coalesced;
use troupe_http::error::ApiError;
use troupe_http::sse::{self, EventSplitter};
use troupe_router::guard::{GuardedBody, LoadGuard};
use troupe_router::pd;
use troupe_router::worker::{Worker, WorkerType};

/// Opens a stream on `w` and waits for its first data event.
async fn open(
    state: &GatewayState,
    w: &Arc<dyn Worker>,
    req: &InferReq,
    body: Bytes,
    last: bool,
) -> Result<(Bytes, Upstream), Fail> {
    let resp = send(state, w, req.ep.path(), body).await?;
    let mut up = Upstream::new(Box::pin(resp.into_body().into_data_stream()), w);
    loop {
        match up.next().await {
            Ok(Some(ev)) => {
                let Some(data) = sse::data(&ev) else { continue };
                if data.trim() == "[DONE]" {
                    w.record_outcome(false);
                    return Err(Fail::retry(
                        format!(
                            "{} {} ended the stream without an event",
                            w.worker_type(),
                            w.url()
                        ),
                        w,
                    ));
                }
                if !last
                    && pd::may_abort(data.as_bytes())
                    && let Ok(v) = serde_json::from_str::<Value>(&data)
                    && let Some(m) = pd::abort_message(&v)
                {
                    return Err(Fail::retry(
                        format!("{} {} aborted: {m}", w.worker_type(), w.url()),
                        w,
                    ));
                }
                return Ok((ev, up));
            }
            Ok(None) => {
                w.record_outcome(false);
                return Err(Fail::retry(
                    format!(
                        "{} {} closed the stream before any event",
                        w.worker_type(),
                        w.url()
                    ),
                    w,
                ));
            }
            Err(e) => {
                w.record_outcome(false);
                return Err(Fail::retry(e, w));
            }
        }
    }
}

/// Prefill's answer as one value (an array by `index` for batches), from SSE or JSON.
fn prefill_value(body: &[u8], batch: Option<usize>) -> Option<Value> {
    let trimmed = body
        .iter()
        .position(|b| !b.is_ascii_whitespace())
        .map(|i| &body[i..])?;
    if trimmed.starts_with(b"{") || trimmed.starts_with(b"[") {
        return serde_json::from_slice(trimmed).ok();
    }
    let mut split = EventSplitter::default();
    split.push(body);
    split.push(b"\n\n");
    let mut items: Vec<Value> = vec![Value::Null; batch.unwrap_or(1)];
    while let Some(ev) = split.next_event() {
        let Some(d) = sse::data(&ev) else { continue };
        let Ok(v) = serde_json::from_str::<Value>(&d) else {
            continue;
        };
        let i = v.get("index").and_then(Value::as_u64).unwrap_or(0) as usize;
        if let Some(slot) = items.get_mut(i) {
            *slot = v;
        }
    }
    Some(match batch {
        Some(_) => Value::Array(items),
        None => items.pop().unwrap_or(Value::Null),
    })
}

/// The client's response: `first`, then the rest of `up` ([`Relay`]; bursts in one write,
/// [`Coalesced`]), holding `guards` until the body is sent or dropped.
fn relay(
    first: Bytes,
    up: Upstream,
    prefill: Option<Arc<Value>>,
    guards: Vec<LoadGuard>,
) -> Response {
    let body = Body::new(Coalesced::new(Body::from_stream(Relay::new(
        first, up, prefill,
    ))));
    let mut r = Response::new(GuardedBody::new(body, guards).into_body());
    let h = r.headers_mut();
    h.insert(
        header::CONTENT_TYPE,
        header::HeaderValue::from_static("text/event-stream"),
    );
    h.insert(
        header::CACHE_CONTROL,
        header::HeaderValue::from_static("no-cache"),
    );
    r
}

/// One streaming attempt on a regular worker.
pub(super) async fn regular(
    state: &GatewayState,
    req: &InferReq,
    avoid: &[String],
    last: bool,
) -> Result<Response, Fail> {
    let w = state
        .router
        .route_for(WorkerType::Regular, &req.ctx(), avoid, req.want.as_ref())
        .map_err(ApiError::from)?;
    let guard = LoadGuard::new(w.clone())
        .holding(&state.inflight, req.rid(), req.ep)
        .admitted(state.router.admission(&w, &req.ctx()))
        .await;
    let (first, up) = open(state, &w, req, req.raw.clone(), last).await?;
    Ok(relay(first, up, None, vec![guard]))
}

/// One streaming attempt on a PD pair.
pub(super) async fn pd(
    state: &GatewayState,
    req: &InferReq,
    avoid: &[String],
    last: bool,
) -> Result<Response, Fail> {
    let (pair, guards, body) = pd_attempt(state, req, avoid)?;
    let p = &pair.prefill;
    let prefill = async {
        let b = send_full(state, p, req.ep.path(), body.clone()).await?;
        let v = prefill_value(&b, req.batch).unwrap_or(Value::Null);
        // An abort (a weight update's pause) is not a fault: no breaker failure.
        if let Some(m) = pd::abort_message(&v) {
            return Err(Fail::retry(format!("prefill {} aborted: {m}", p.url()), p));
        }
        if let Some(e) = v.get("error") {
            p.record_outcome(false);
            return Err(Fail::retry(format!("prefill {} failed: {e}", p.url()), p));
        }
        p.record_outcome(true);
        Ok(v)
    };
    let decode = open(state, &pair.decode, req, body.clone(), last);
    let (pv, (first, up)) = futures::future::try_join(prefill, decode).await?;
    let merge = req.logprob.then(|| Arc::new(pv));
    Ok(relay(first, up, merge, guards))
}
