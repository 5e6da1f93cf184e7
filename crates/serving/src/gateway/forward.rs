//! Inference forwarding: the retry loop and non-stream attempts (regular and PD). The request
//! is parsed in [`super::request`], the pieces every attempt shares are in [`super::attempt`],
//! and streaming attempts live in [`super::stream`].
//!
//! An attempt ends in one of three ways: a response for the client, a final upstream answer
//! that retrying cannot fix (e.g. a 400 from the engine: passed through unchanged when it is
//! JSON, wrapped in the error envelope with the same status when it is not), or a
//! retryable failure (transport error, status 408/429/5xx, an aborted generation, a prefill
//! that failed) naming the workers at fault, which the next attempt avoids.

use std::sync::Arc;
use std::time::{Duration, Instant};
use troupe_wire::Endpoint as _;
use troupe_wire::endpoints as ep;

use axum::body::{Body, Bytes};
use axum::extract::State;
use axum::http::{HeaderMap, HeaderValue, StatusCode, header};
use axum::response::{IntoResponse, Response};
use serde_json::Value;

use super::GatewayState;
use super::attempt::{Fail, endpoint, pd_attempt, send_full, upstream_error};
use super::request::{InferReq, VLLM_GENERATE};
use super::stream;
use super::vllm_generate;
use troupe_http::error::ApiError;
use troupe_http::upstream::read_body;
use troupe_router::guard::{GuardedBody, LoadGuard};
use troupe_router::metrics::Endpoint;
use troupe_router::pd;
use troupe_router::policy::RouteContext;
use troupe_router::worker::{Worker, WorkerType};
use troupe_wire::EngineDialect;

pub(crate) fn json_response(body: Bytes, guards: Vec<LoadGuard>) -> Response {
    let mut r = Response::new(GuardedBody::new(Body::from(body), guards).into_body());
    r.headers_mut().insert(
        header::CONTENT_TYPE,
        header::HeaderValue::from_static("application/json"),
    );
    r
}

fn parse_value(b: &[u8], w: &Arc<dyn Worker>) -> Result<Value, Fail> {
    serde_json::from_slice(b).map_err(|e| {
        w.record_outcome(false);
        Fail::retry(
            format!("{} {} answered invalid JSON: {e}", w.worker_type(), w.url()),
            w,
        )
    })
}

/// One non-stream attempt on a regular worker.
async fn regular_once(
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
    // A vLLM worker gets vLLM's token route: the client's own vLLM body, or SGLang's
    // `/generate` translated (and its answer translated back).
    let vllm = w.dialect() == EngineDialect::Vllm;
    let mut translated = None;
    let (path, sent) = match (&req.native, vllm) {
        (Some(native), true) => (VLLM_GENERATE, native.clone()),
        (None, true) if req.ep == Endpoint::Generate => {
            let (b, prompt) = vllm_generate::to_vllm(&req.obj)?;
            translated = Some(prompt);
            (VLLM_GENERATE, b)
        }
        _ => (req.ep.path(), req.raw.clone()),
    };
    let mut body = send_full(state, &w, path, sent).await?;
    if let Some(prompt) = translated {
        let v = parse_value(&body, &w)?;
        let Some(s) = vllm_generate::to_sglang(&v, prompt, req.logprob) else {
            w.record_outcome(false);
            return Err(Fail::retry(
                format!(
                    "{} answered /inference/v1/generate without choices: {v}",
                    w.url()
                ),
                &w,
            ));
        };
        body = Bytes::from(s.to_string());
    }
    if !last
        && pd::may_abort(&body)
        && let Some(m) = pd::abort_message(&parse_value(&body, &w)?)
    {
        return Err(Fail::retry(
            format!("regular {} aborted the request: {m}", w.url()),
            &w,
        ));
    }
    pinned_answer(req, &body, &w)?;
    w.record_outcome(true);
    Ok(json_response(body, vec![guard]))
}

/// A request that asks for a version gets only an answer made by a matching one: another
/// means `w` was updated after it was routed, so the gateway learns its version and the
/// request is retried elsewhere (`super::version_pin`).
fn pinned_answer(req: &InferReq, body: &[u8], w: &Arc<dyn Worker>) -> Result<(), Fail> {
    let Some(want) = &req.want else {
        return Ok(());
    };
    let v = parse_value(body, w)?;
    if let Some(got) = super::version_pin::mismatch(want, &v) {
        // One that is not a version (empty, control characters) leaves it unknown.
        w.set_weight_version(troupe_wire::WeightVersion::new(got).ok());
        return Err(Fail::retry(
            format!(
                "{} {} answered with weight version {got}, not {}",
                w.worker_type(),
                w.url(),
                want.describe()
            ),
            w,
        ));
    }
    Ok(())
}

/// One non-stream attempt on a PD pair: both requests concurrently; the first failure drops
/// (cancels) the other.
async fn pd_once(
    state: &GatewayState,
    req: &InferReq,
    avoid: &[String],
    last: bool,
) -> Result<Response, Fail> {
    let (pair, guards, body) = pd_attempt(state, req, avoid)?;
    let (p, d) = (&pair.prefill, &pair.decode);
    let prefill = async {
        let b = send_full(state, p, req.ep.path(), body.clone()).await?;
        let v = parse_value(&b, p)?;
        // An abort is the engine's own answer (a weight update's pause), not a fault: it
        // moves the request on without feeding the breaker, as a regular or decode abort does.
        if let Some(m) = pd::abort_message(&v) {
            return Err(Fail::retry(format!("prefill {} aborted: {m}", p.url()), p));
        }
        Ok(v)
    };
    let decode = send_full(state, d, req.ep.path(), body.clone());
    let (pv, db) = futures::future::try_join(prefill, decode).await?;
    let out = if req.logprob || (!last && pd::may_abort(&db)) {
        let mut dv = parse_value(&db, d)?;
        if !last && let Some(m) = pd::abort_message(&dv) {
            return Err(Fail::retry(format!("decode {} aborted: {m}", d.url()), d));
        }
        if req.logprob {
            pd::merge_logprobs(&mut dv, &pv);
            Bytes::from(dv.to_string())
        } else {
            db
        }
    } else {
        db
    };
    pinned_answer(req, &out, d)?;
    p.record_outcome(true);
    d.record_outcome(true);
    Ok(json_response(out, guards))
}

async fn attempt(
    state: &GatewayState,
    req: &InferReq,
    avoid: &[String],
    last: bool,
) -> Result<Response, Fail> {
    match (state.cfg.pd, req.stream) {
        (false, false) => tokio::time::timeout(
            state.cfg.request_timeout,
            regular_once(state, req, avoid, last),
        )
        .await
        .unwrap_or_else(|_| {
            Err(ApiError::new(
                StatusCode::GATEWAY_TIMEOUT,
                "the worker did not answer in time",
            )
            .into())
        }),
        (true, false) => {
            tokio::time::timeout(state.cfg.request_timeout, pd_once(state, req, avoid, last))
                .await
                .unwrap_or_else(|_| {
                    Err(ApiError::new(
                        StatusCode::GATEWAY_TIMEOUT,
                        "the PD pair did not answer in time",
                    )
                    .into())
                })
        }
        (false, true) => stream::regular(state, req, avoid, last).await,
        (true, true) => stream::pd(state, req, avoid, last).await,
    }
}

/// The retry loop shared by every inference endpoint.
pub(super) async fn handle(
    state: Arc<GatewayState>,
    ep: Endpoint,
    headers: HeaderMap,
    raw: Bytes,
) -> Response {
    handle_native(state, ep, headers, raw, None).await
}

/// [`handle`], for a request that arrived in vLLM's dialect: `raw` is its SGLang translation,
/// `native` the client's body, which a vLLM worker gets as it came.
pub(super) async fn handle_native(
    state: Arc<GatewayState>,
    ep: Endpoint,
    headers: HeaderMap,
    raw: Bytes,
    native: Option<Bytes>,
) -> Response {
    let needs_text = state.router.needs_text();
    let parsed = InferReq::parse(ep, &headers, raw, state.cfg.pd, needs_text);
    serve_parsed(state, ep, headers, parsed.map(|r| InferReq { native, ..r })).await
}

/// [`handle`] of a `/generate` body the caller built as an object (the agent layer's, whose
/// prompt is thousands of token ids): not parsed back from its JSON, `raw`.
pub(super) async fn handle_object(
    state: Arc<GatewayState>,
    headers: HeaderMap,
    obj: serde_json::Map<String, serde_json::Value>,
    raw: Bytes,
) -> Response {
    let needs_text = state.router.needs_text();
    let ep = Endpoint::Generate;
    let parsed = InferReq::from_object(ep, &headers, obj, raw, state.cfg.pd, needs_text);
    serve_parsed(state, ep, headers, parsed).await
}

async fn serve_parsed(
    state: Arc<GatewayState>,
    ep: Endpoint,
    headers: HeaderMap,
    parsed: Result<InferReq, ApiError>,
) -> Response {
    let started = Instant::now();
    state.metrics.request(ep);
    let resp = match parsed {
        Ok(mut req) => {
            // The fourth session dialect: a per-session bearer key (AReaL's), once the agent
            // layer has issued it.
            if req.session.is_none()
                && let Some(agent) = &state.agent
            {
                req.session =
                    super::session_key::bearer(&headers).and_then(|k| agent.sessions.by_key(k));
            }
            match req.ensure_rid(&headers) {
                Ok(rid) => {
                    let mut resp = run(&state, &req).await;
                    if let Some(v) = rid.and_then(|r| HeaderValue::from_str(&r).ok()) {
                        resp.headers_mut().entry(REQUEST_ID).or_insert(v);
                    }
                    resp
                }
                Err(e) => e.into_response(),
            }
        }
        Err(e) => e.into_response(),
    };
    state.metrics.observe(started.elapsed());
    if !resp.status().is_success() {
        state.metrics.error(ep);
    }
    resp
}

async fn run(state: &GatewayState, req: &InferReq) -> Response {
    if let Some(want) = &req.want
        && let Err(e) = super::version_pin::wait_for(state, want).await
    {
        return e.into_response();
    }
    let mut avoid: Vec<String> = Vec::new();
    let mut reason = String::new();
    let attempts = state.cfg.max_retries.saturating_add(1);
    for i in 0..attempts {
        let last = i + 1 == attempts;
        match attempt(state, req, &avoid, last).await {
            Ok(r) => return r,
            Err(Fail::Final(r)) => return *r,
            Err(Fail::Retry {
                reason: why,
                culprits,
            }) => {
                tracing::warn!(attempt = i + 1, %why, "attempt failed");
                avoid.extend(culprits.iter().map(|w| w.id().to_string()));
                reason = why;
                if !last {
                    state.metrics.retry();
                    let backoff = state.cfg.retry_backoff.saturating_mul(1 << i.min(10));
                    tokio::time::sleep(backoff.min(Duration::from_secs(1))).await;
                }
            }
        }
    }
    ApiError::bad_gateway(format!(
        "all {attempts} attempts failed; last error: {reason}"
    ))
    .into_response()
}

/// The response header naming the request's id (what `/abort_request {rid}` takes).
const REQUEST_ID: &str = "x-request-id";

/// `POST /generate`.
pub(super) async fn generate(
    State(s): State<Arc<GatewayState>>,
    h: HeaderMap,
    b: Bytes,
) -> Response {
    handle(s, Endpoint::Generate, h, b).await
}

/// `POST /v1/completions`.
pub(super) async fn completions(
    State(s): State<Arc<GatewayState>>,
    h: HeaderMap,
    b: Bytes,
) -> Response {
    handle(s, Endpoint::Completions, h, b).await
}

/// `GET /v1/models`: answered by any available worker that generates (decode or regular).
pub(super) async fn models(State(state): State<Arc<GatewayState>>) -> Response {
    any_worker(&state, ep::Models::PATH, None).await
}

/// Sends one request to any available generating worker (decode in PD mode, else regular) and
/// passes its answer on: GET without a body, POST with one. For endpoints any engine answers
/// alike (`/v1/models`, `/tokenize`, `/detokenize`).
pub(super) async fn any_worker(state: &GatewayState, path: &str, body: Option<Bytes>) -> Response {
    let ty = if state.cfg.pd {
        WorkerType::Decode
    } else {
        WorkerType::Regular
    };
    let w = match state.router.route(ty, &RouteContext::default(), &[]) {
        Ok(w) => w,
        Err(e) => return ApiError::from(e).into_response(),
    };
    let uri = match endpoint(&w, path) {
        Ok(u) => u,
        Err(e) => return e.into_response(),
    };
    let sent = match body {
        Some(b) => {
            state
                .upstream
                .post(uri, b, state.worker_auth.as_ref())
                .await
        }
        None => state.upstream.get(uri, state.worker_auth.as_ref()).await,
    };
    match sent {
        Ok(r) => {
            let status = r.status();
            match read_body(r).await {
                Ok(b) if !status.is_success() => {
                    state.drop_looping(&w, status.as_u16());
                    upstream_error(&w, status, &b)
                }
                Ok(b) => (status, [(header::CONTENT_TYPE, "application/json")], b).into_response(),
                Err(e) => ApiError::bad_gateway(format!("{}: {e}", w.url())).into_response(),
            }
        }
        Err(e) => ApiError::bad_gateway(format!("{}: {e}", w.url())).into_response(),
    }
}
