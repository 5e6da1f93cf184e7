//! [`VersionWant`]: the weights a request asks to be served by.
//!
//! A client pins a request to a weight version with the `X-Weight-Version` header (`v7`: that
//! version exactly; `>=v7`: that step or a later one), or with Troupe's body fields, the same in
//! SGLang's `/generate` body and in OpenAI-style bodies: `weight_version` (exactly) or
//! `min_weight_version` (at least). The names are the ones engines already answer with
//! (`meta_info.weight_version`). The gateway routes such a request only to engines known to
//! serve a matching version, waits a bounded time when none does yet, and strips the fields
//! before the body reaches an engine (SGLang refuses fields it does not know).

use crate::version::{WeightVersion, step_of};

/// The header a client pins a request with.
pub const HEADER: &str = "x-weight-version";
/// The body field for an exact version.
pub const FIELD_EXACT: &str = "weight_version";
/// The body field for a least version.
pub const FIELD_AT_LEAST: &str = "min_weight_version";

/// What a request asks of the version that serves it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum VersionWant {
    /// This version exactly (the same string).
    Exact(WeightVersion),
    /// This version's step or a later one.
    AtLeast(WeightVersion),
}

impl VersionWant {
    /// Parses the header's form: `v7` (exact) or `>=v7` (at least; spaces after `>=` allowed).
    pub fn parse_header(s: &str) -> Result<Self, String> {
        let s = s.trim();
        match s.strip_prefix(">=") {
            Some(rest) => WeightVersion::new(rest.trim())
                .map(VersionWant::AtLeast)
                .map_err(|e| format!("{HEADER}: {e}")),
            None => WeightVersion::new(s)
                .map(VersionWant::Exact)
                .map_err(|e| format!("{HEADER}: {e} (send a version, or >=version for at least)")),
        }
    }

    /// Whether an engine serving `version` serves this request.
    pub fn accepts(&self, version: &str) -> bool {
        match self {
            VersionWant::Exact(v) => v.as_str() == version,
            VersionWant::AtLeast(v) => step_of(version) >= v.step(),
        }
    }

    /// How it reads in messages: `v7` or `>= v7`.
    pub fn describe(&self) -> String {
        match self {
            VersionWant::Exact(v) => v.to_string(),
            VersionWant::AtLeast(v) => format!(">= {v}"),
        }
    }
}

/// The want named by a JSON body's fields, checked: `weight_version` and
/// `min_weight_version` are strings and not both given. `Ok(None)` when neither is.
pub fn from_body(
    obj: &serde_json::Map<String, serde_json::Value>,
) -> Result<Option<VersionWant>, String> {
    let field = |k: &str| -> Result<Option<WeightVersion>, String> {
        match obj.get(k) {
            None | Some(serde_json::Value::Null) => Ok(None),
            Some(serde_json::Value::String(s)) => WeightVersion::new(s.as_str())
                .map(Some)
                .map_err(|e| format!("{k}: {e}")),
            Some(v) => Err(format!("{k} must be a string, got {v}")),
        }
    };
    match (field(FIELD_EXACT)?, field(FIELD_AT_LEAST)?) {
        (Some(_), Some(_)) => Err(format!(
            "send {FIELD_EXACT} (exactly) or {FIELD_AT_LEAST} (at least), not both"
        )),
        (Some(v), None) => Ok(Some(VersionWant::Exact(v))),
        (None, Some(v)) => Ok(Some(VersionWant::AtLeast(v))),
        (None, None) => Ok(None),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_header_and_the_body_name_the_same_wants() {
        let exact = VersionWant::parse_header("v7").unwrap();
        assert!(exact.accepts("v7") && !exact.accepts("v8") && !exact.accepts("7"));
        let least = VersionWant::parse_header(">= v7").unwrap();
        assert!(least.accepts("v7") && least.accepts("v10") && !least.accepts("v6"));
        assert!(VersionWant::parse_header(">=").is_err());
        assert!(VersionWant::parse_header("").is_err());
        let body = |j: serde_json::Value| from_body(j.as_object().unwrap());
        assert_eq!(
            body(serde_json::json!({"weight_version": "v7"})).unwrap(),
            Some(exact)
        );
        assert_eq!(
            body(serde_json::json!({"min_weight_version": "v7"})).unwrap(),
            Some(least)
        );
        assert_eq!(body(serde_json::json!({"text": "x"})).unwrap(), None);
        assert!(body(serde_json::json!({"weight_version": 7})).is_err());
        assert!(
            body(serde_json::json!({"weight_version": "a", "min_weight_version": "b"})).is_err()
        );
    }
}
