//! Aborts by id sent to the gateway go to the engines that hold the request.
//!
//! `POST /abort_request {"rid": ID}` (SGLang's) and `POST /abort_requests {"request_ids":
//! [...]}` (vLLM's) name requests the gateway may be relaying right now; the in-flight registry
//! (`troupe_router::inflight`) says which workers hold each. When it knows every id named, the abort goes
//! to those engines only, each in its own dialect and by the id that engine knows the request
//! by (`troupe_router::inflight::engine_id`), and the answer lists them (`"targeted":
//! true`). Otherwise (an id it does not know: finished, sent to an engine directly, or relayed by
//! another gateway) the fleet control route runs as before and reaches every engine. An
//! `abort_all` is never targeted.

use std::collections::BTreeMap;
use std::sync::Arc;
use troupe_wire::Endpoint as _;
use troupe_wire::endpoints as ep;

use axum::body::{Body, Bytes};
use axum::extract::{Request, State};
use axum::http::Method;
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use serde_json::{Map, Value, json};

use super::GatewayState;
use troupe_fleet::engine_client::EngineClient;
use troupe_fleet::engines::Engine;
use troupe_http::error::ApiError;
use troupe_router::worker::Worker;

/// The most bytes an abort body may have (a list of ids).
const MAX_ABORT_BYTES: usize = 1 << 20;

/// The ids an abort body names and what else it carries; `None` for `abort_all`, an empty
/// list, or a body this layer does not read (the control route then answers it).
fn named(path: &str, body: &[u8]) -> Option<(Vec<String>, Map<String, Value>)> {
    let Value::Object(mut obj) = serde_json::from_slice::<Value>(body).ok()? else {
        return None;
    };
    match path {
        ep::AbortRequest::PATH => {
            if obj.get("abort_all").and_then(Value::as_bool) == Some(true) {
                return None;
            }
            let Value::String(rid) = obj.remove("rid")? else {
                return None;
            };
            obj.remove("abort_all");
            (!rid.is_empty()).then(|| (vec![rid], obj))
        }
        ep::AbortRequests::PATH => {
            let ids: Vec<String> = match obj.get("request_ids")? {
                Value::Array(a) => a
                    .iter()
                    .map(|v| v.as_str().map(str::to_string))
                    .collect::<Option<_>>()?,
                _ => return None,
            };
            (!ids.is_empty() && obj.len() == 1).then(|| (ids, Map::new()))
        }
        _ => None,
    }
}

/// The layer in front of the fleet control routes.
pub(super) async fn targeted(
    State(state): State<Arc<GatewayState>>,
    req: Request,
    next: Next,
) -> Response {
    let path = req.uri().path().to_string();
    if req.method() != Method::POST
        || !matches!(
            path.as_str(),
            ep::AbortRequest::PATH | ep::AbortRequests::PATH
        )
    {
        return next.run(req).await;
    }
    let (parts, body) = req.into_parts();
    let bytes: Bytes = match axum::body::to_bytes(body, MAX_ABORT_BYTES).await {
        Ok(b) => b,
        Err(e) => {
            return ApiError::bad_request(format!("cannot read the abort body: {e}"))
                .control()
                .into_response();
        }
    };
    let Some((ids, rest)) = named(&path, &bytes) else {
        return next
            .run(Request::from_parts(parts, Body::from(bytes)))
            .await;
    };
    // An agent turn under one of these ids ends aborted rather than resubmitting the piece
    // its engine aborts (or, between pieces, before sending the next).
    state.agent_cancels.abort(&ids);
    // Every id must be held here; the workers of each, by URL.
    let mut by_worker: BTreeMap<String, (Arc<dyn Worker>, Vec<String>)> = BTreeMap::new();
    for id in &ids {
        let holders = state.inflight.holders(id);
        if holders.is_empty() {
            return next
                .run(Request::from_parts(parts, Body::from(bytes)))
                .await;
        }
        for (w, known_as) in holders {
            by_worker
                .entry(w.url().to_string())
                .or_insert_with(|| (w.clone(), Vec::new()))
                .1
                .push(known_as);
        }
    }
    let client = EngineClient::over(state.upstream.clone(), state.cfg.worker_api_key.clone())
        .with_timeout(state.cfg.fleet.control_timeout);
    let calls = by_worker.into_values().map(|(w, ids)| {
        let (client, rest) = (client.clone(), rest.clone());
        async move {
            let engine = Engine::new(w.url(), 1, w.dialect());
            let r = client.abort(&engine, Some(&ids), &rest).await;
            match r {
                Ok(answer) => json!({"url": w.url(), "success": true, "answer": answer}),
                Err(e) => json!({"url": w.url(), "success": false, "error": e.to_string()}),
            }
        }
    });
    let engines: Vec<Value> = futures::future::join_all(calls).await;
    let ok = engines.iter().all(|e| e["success"] == json!(true));
    let v = json!({"success": ok, "targeted": true, "engines": engines});
    let status = if ok {
        axum::http::StatusCode::OK
    } else {
        axum::http::StatusCode::BAD_GATEWAY
    };
    (status, axum::Json(v)).into_response()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_aborts_by_id_are_read() {
        let (ids, rest) = named("/abort_request", br#"{"rid": "a", "x": 1}"#).unwrap();
        assert_eq!((ids, rest.len()), (vec!["a".to_string()], 1));
        assert!(named("/abort_request", br#"{"abort_all": true}"#).is_none());
        assert!(named("/abort_request", br#"{"rid": ""}"#).is_none());
        let (ids, _) = named("/abort_requests", br#"{"request_ids": ["a", "b"]}"#).unwrap();
        assert_eq!(ids, ["a", "b"]);
        assert!(named("/abort_requests", br#"{"request_ids": []}"#).is_none());
        assert!(named("/abort_requests", br#"{"request_ids": [1]}"#).is_none());
        assert!(named("/abort_requests", b"not json").is_none());
    }
}
