//! The plane's one answer to a fleet-wide operation: success with a per-engine breakdown
//! ([`answer`]), or the JSON error envelope (502) naming the engines that failed, with the same
//! breakdown ([`failure`]). Every operation answers through these (`super::plane`,
//! `super::updates`, `super::resume`), so they live below all of them.

use serde::Serialize;
use serde_json::{Map, Value, json};
use troupe_wire::ApiError;

use super::control::ServerResult;

/// `[{url, success, answer | error}]` for a fan-out's results (each engine's answer as it
/// sent it: the typed answers keep every field).
pub(crate) fn breakdown<T: Serialize>(results: &[ServerResult<T>]) -> Value {
    Value::Array(
        results
            .iter()
            .map(|r| match &r.result {
                Ok(v) => json!({"url": r.url, "success": true, "answer": v}),
                Err(e) => json!({"url": r.url, "success": false, "error": e}),
            })
            .collect(),
    )
}

/// The success answer: `{success, message, engines, skipped?, ...extra}`.
pub(crate) fn answer<T: Serialize>(
    op: &str,
    results: &[ServerResult<T>],
    skipped: &[String],
    extra: Map<String, Value>,
) -> Value {
    let mut v = json!({
        "success": true,
        "message": format!("{op} on {} engines", results.len()),
        "engines": breakdown(results),
    });
    if !skipped.is_empty() {
        v["skipped"] = json!(skipped);
    }
    for (k, x) in extra {
        v[k] = x;
    }
    v
}

/// 502 naming the engines that failed, with the whole breakdown.
pub(crate) fn failure<T: Serialize>(
    op: &str,
    results: &[ServerResult<T>],
    skipped: &[String],
    after: &str,
) -> ApiError {
    let failed: Vec<String> = results
        .iter()
        .filter_map(|r| r.result.as_ref().err().map(|e| format!("{}: {e}", r.url)))
        .collect();
    let skip = if skipped.is_empty() {
        String::new()
    } else {
        format!("; skipped (down): {skipped:?}")
    };
    ApiError::bad_gateway(format!(
        "{op} failed on {} of {} engines ({}); {after}{skip}",
        failed.len(),
        results.len(),
        failed.join("; ")
    ))
    .control()
    .with_engines(breakdown(results))
    .with_skipped(skipped)
}

/// [`answer`] if every engine succeeded, else [`failure`].
pub(crate) fn settle<T: Serialize>(
    op: &str,
    results: &[ServerResult<T>],
    skipped: &[String],
    extra: Map<String, Value>,
) -> Result<Value, ApiError> {
    if results.iter().any(|r| r.result.is_err()) {
        let done = results.iter().filter(|r| r.result.is_ok()).count();
        Err(failure(
            op,
            results,
            skipped,
            &format!("{done} engines did it"),
        ))
    } else {
        Ok(answer(op, results, skipped, extra))
    }
}
