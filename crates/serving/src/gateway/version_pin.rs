//! Requests that ask for a weight version (`troupe_wire::want`): read from the
//! `X-Weight-Version` header or the body's `weight_version` / `min_weight_version` (stripped
//! before an engine sees the body), waited for while no worker serves it (at most
//! `GatewayConfig::version_wait`, then 503 naming what is served), routed only to workers that
//! serve it (`troupe_router::pinned`), and checked against the answer: an answer made by another
//! version (a worker updated between the routing and the answer) is retried elsewhere, never
//! returned.

use std::time::Instant;

use axum::body::Bytes;
use axum::http::HeaderMap;
use serde_json::{Map, Value};
use troupe_wire::want::{self, VersionWant};

use super::GatewayState;
use troupe_http::error::ApiError;

/// The request's want (header, else body) and its body without Troupe's version fields.
/// A header and body that disagree, or a malformed value, are refused naming the field.
pub(super) fn take(
    headers: &HeaderMap,
    obj: &mut Map<String, Value>,
    raw: Bytes,
) -> Result<(Option<VersionWant>, Bytes), ApiError> {
    let header = match headers.get(want::HEADER) {
        None => None,
        Some(h) => {
            let s = h.to_str().map_err(|_| {
                ApiError::bad_request(format!("{} must be visible ASCII", want::HEADER))
            })?;
            Some(VersionWant::parse_header(s).map_err(ApiError::bad_request)?)
        }
    };
    let body = want::from_body(obj).map_err(ApiError::bad_request)?;
    let want = match (header, body) {
        (Some(h), Some(b)) if h != b => {
            return Err(ApiError::bad_request(format!(
                "{} asks for {} but the body asks for {}; send one",
                want::HEADER,
                h.describe(),
                b.describe()
            )));
        }
        (h, b) => h.or(b),
    };
    let had = obj.remove(want::FIELD_EXACT).is_some() | obj.remove(want::FIELD_AT_LEAST).is_some();
    let raw = if had {
        Bytes::from(serde_json::to_vec(&*obj).map_err(|e| ApiError::bad_request(e.to_string()))?)
    } else {
        raw
    };
    Ok((want, raw))
}

/// Waits (bounded by `version_wait`) until some worker (a PD pair in PD mode) serves `want`.
pub(super) async fn wait_for(state: &GatewayState, want: &VersionWant) -> Result<(), ApiError> {
    let deadline = Instant::now() + state.cfg.version_wait;
    loop {
        let changed = state.router.versions_changed();
        tokio::pin!(changed);
        changed.as_mut().enable();
        if state.router.can_serve(state.cfg.pd, want) {
            return Ok(());
        }
        let left = deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            let why = if state.cfg.pd {
                state
                    .router
                    .route_pd_for(&Default::default(), &[], Some(want))
                    .err()
            } else {
                state
                    .router
                    .route_for(
                        troupe_router::worker::WorkerType::Regular,
                        &Default::default(),
                        &[],
                        Some(want),
                    )
                    .err()
            };
            let why = why.map_or_else(String::new, |e| e.to_string());
            return Err(ApiError::unavailable(format!(
                "waited {} s for a worker serving weight version {}: {why}",
                state.cfg.version_wait.as_secs_f64(),
                want.describe()
            )));
        }
        // Health and holds change without a version change: look again at least this often.
        let tick = left.min(std::time::Duration::from_millis(250));
        let _ = tokio::time::timeout(tick, changed).await;
    }
}

/// Every version an answer names for its tokens: `meta_info.weight_version` and
/// `meta_info.output_token_weight_versions` (`/generate`), or the top-level `weight_version`,
/// `metadata.weight_version` and `output_token_weight_versions` (OpenAI routes through the
/// data proxy).
pub(super) fn answered_versions(v: &Value) -> Vec<&str> {
    let mut out = Vec::new();
    for base in [v.get("meta_info"), Some(v), v.get("metadata")]
        .into_iter()
        .flatten()
    {
        if let Some(s) = base.get("weight_version").and_then(Value::as_str) {
            out.push(s);
        }
        if let Some(list) = base
            .get("output_token_weight_versions")
            .and_then(Value::as_array)
        {
            out.extend(list.iter().filter_map(Value::as_str));
        }
    }
    out
}

/// `None` when the answer `v` was made by versions `want` accepts; else the version at fault.
pub(super) fn mismatch<'a>(want: &VersionWant, v: &'a Value) -> Option<&'a str> {
    answered_versions(v).into_iter().find(|s| !want.accepts(s))
}

#[cfg(test)]
mod tests {
    use super::*;
    use axum::http::HeaderValue;
    use serde_json::json;

    fn obj(v: Value) -> Map<String, Value> {
        v.as_object().cloned().unwrap_or_default()
    }

    #[test]
    fn the_fields_are_read_and_stripped_and_disagreement_is_named() {
        let mut h = HeaderMap::new();
        h.insert(want::HEADER, HeaderValue::from_static(">=v3"));
        let mut o = obj(json!({"text": "x", "min_weight_version": "v3"}));
        let (w, raw) = take(&h, &mut o, Bytes::from_static(b"{}")).unwrap();
        assert_eq!(w, Some(VersionWant::parse_header(">=v3").unwrap()));
        assert_eq!(raw, Bytes::from(r#"{"text":"x"}"#));
        let mut o = obj(json!({"text": "x", "weight_version": "v4"}));
        let e = take(&h, &mut o, Bytes::new()).unwrap_err();
        assert!(e.to_string().contains("send one"), "{e}");
        let raw = Bytes::from_static(br#"{"text": "x"}"#);
        let (w, same) = take(
            &HeaderMap::new(),
            &mut obj(json!({"text": "x"})),
            raw.clone(),
        )
        .unwrap();
        assert_eq!((w, same), (None, raw));
    }

    #[test]
    fn an_answer_made_by_another_version_is_found() {
        let w = VersionWant::parse_header("v2").unwrap();
        let ok = json!({"meta_info": {"weight_version": "v2", "output_token_weight_versions": ["v2", "v2"]}});
        assert_eq!(mismatch(&w, &ok), None);
        let mixed = json!({"meta_info": {"weight_version": "v2", "output_token_weight_versions": ["v1", "v2"]}});
        assert_eq!(mismatch(&w, &mixed), Some("v1"));
        let chat = json!({"choices": [], "weight_version": "v3"});
        assert_eq!(mismatch(&w, &chat), Some("v3"));
    }
}
