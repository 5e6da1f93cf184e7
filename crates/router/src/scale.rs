//! Growing and shrinking a running deployment's fleet: what `POST /scale` asks ([`ScaleOp`]),
//! and who does it ([`Scale`]: the controller, which owns the servers).
//!
//! The plane only carries the request: a deployment registers its scaler with
//! `ControlPlane::set_scaler`, the control endpoint (`troupe_serving::control_api`) parses the body
//! and hands it over. A standalone `troupe gateway` has none (it launches nothing; workers are
//! registered with `POST /workers` there), and its `/scale` says so.
//!
//! Body: `{"role": "decode", "add": 2}` launches two more decode servers; `{"remove":
//! "http://host:port"}` drains one (its server URL, or its worker URL as the router lists it)
//! and stops it; `"drain_timeout_s"` bounds the drain (default [`DEFAULT_DRAIN`]).

use std::time::Duration;

use futures::future::BoxFuture;
use serde::Deserialize;

use crate::worker::WorkerType;

/// How long a leaving server's in-flight requests may take to finish when the caller names no
/// bound: past it the server is stopped anyway (and the answer says how many were cut).
pub const DEFAULT_DRAIN: Duration = Duration::from_secs(120);

/// The most servers one call adds (a typo of `add: 1000` should not try to launch them).
pub const MAX_ADD: usize = 64;

/// One fleet change.
#[derive(Debug, Clone, PartialEq)]
pub enum ScaleOp {
    /// Launch `count` more servers of `role`, each routed once it holds the fleet's weights.
    Add {
        /// Regular, prefill or decode.
        role: WorkerType,
        /// How many.
        count: usize,
    },
    /// Drain the server at `url` (server or worker URL) and stop it.
    Remove {
        /// Its server URL or its worker (proxy) URL.
        url: String,
        /// Longest wait for its in-flight requests.
        drain: Duration,
    },
}

/// Why a fleet change was refused or failed, with the HTTP status it answers.
#[derive(Debug, thiserror::Error)]
pub enum ScaleError {
    /// The request makes no sense (unknown server, a role the deployment has none of).
    #[error("{0}")]
    BadRequest(String),
    /// It would leave the fleet unable to serve (the last server of a role), or the
    /// deployment cannot do it (a recovered deployment, a multi-node instance).
    #[error("{0}")]
    Conflict(String),
    /// Launching or stopping failed (no free GPUs, a server that did not start).
    #[error("{0}")]
    Failed(String),
}

/// Who changes the fleet: the controller's deployment.
pub trait Scale: Send + Sync {
    /// Applies `op`; a JSON description of what changed (the new or removed instances).
    fn scale(&self, op: ScaleOp) -> BoxFuture<'_, Result<serde_json::Value, ScaleError>>;
}

/// The body of `POST /scale`, as sent.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct Body {
    #[serde(default)]
    role: Option<WorkerType>,
    #[serde(default)]
    add: Option<usize>,
    #[serde(default)]
    remove: Option<String>,
    #[serde(default)]
    drain_timeout_s: Option<f64>,
}

impl ScaleOp {
    /// The operation a `POST /scale` body asks for; an error naming the field that is wrong.
    pub fn from_json(v: serde_json::Value) -> Result<ScaleOp, String> {
        let b: Body = serde_json::from_value(v).map_err(|e| format!("invalid body: {e}"))?;
        let drain = match b.drain_timeout_s {
            None => DEFAULT_DRAIN,
            Some(s) if (0.0..=86_400.0).contains(&s) => Duration::from_secs_f64(s),
            Some(s) => {
                return Err(format!(
                    "drain_timeout_s: {s} is not a number of seconds between 0 and 86400"
                ));
            }
        };
        match (b.add, b.remove) {
            (Some(_), Some(_)) => Err("add and remove: give one of them per call".into()),
            (None, None) => Err(
                "add or remove: missing (e.g. {\"role\": \"decode\", \"add\": 1} or {\"remove\": \"http://host:port\"})"
                    .into(),
            ),
            (Some(count), None) => {
                let role = b.role.ok_or("role: missing (regular, prefill or decode)")?;
                if !role.serves() {
                    return Err(format!(
                        "role: {role} serves no requests; give regular, prefill or decode"
                    ));
                }
                if count == 0 || count > MAX_ADD {
                    return Err(format!("add: {count} is not between 1 and {MAX_ADD}"));
                }
                Ok(ScaleOp::Add { role, count })
            }
            (None, Some(url)) => {
                if b.role.is_some() {
                    return Err("role: not taken with remove (the server's URL says which)".into());
                }
                if url.trim().is_empty() {
                    return Err("remove: empty; give the server's URL".into());
                }
                Ok(ScaleOp::Remove { url, drain })
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn bodies_parse_and_bad_ones_name_the_field() {
        assert_eq!(
            ScaleOp::from_json(json!({"role": "decode", "add": 2})).unwrap(),
            ScaleOp::Add {
                role: WorkerType::Decode,
                count: 2
            }
        );
        assert_eq!(
            ScaleOp::from_json(json!({"remove": "http://h:1", "drain_timeout_s": 5})).unwrap(),
            ScaleOp::Remove {
                url: "http://h:1".into(),
                drain: Duration::from_secs(5)
            }
        );
        for (body, field) in [
            (json!({"add": 1}), "role"),
            (json!({"role": "train", "add": 1}), "role"),
            (json!({"role": "decode", "add": 0}), "add"),
            (
                json!({"role": "decode", "add": 1, "remove": "x"}),
                "add and remove",
            ),
            (json!({}), "add or remove"),
            (
                json!({"remove": "x", "drain_timeout_s": -1}),
                "drain_timeout_s",
            ),
            (json!({"role": "decode", "remove": "x"}), "role"),
            (json!({"role": "decode", "ad": 1}), "ad"),
        ] {
            let e = ScaleOp::from_json(body.clone()).unwrap_err();
            assert!(e.contains(field), "{body}: {e}");
        }
    }
}
