//! After `--recover`: the engines are brought to the state the fleet was in, not left as the
//! dead controller left them.
//!
//! A controller killed in the middle of a weight update (or of any fleet operation) leaves the
//! engines it had paused paused: every `/generate` would wait forever while a fresh control
//! plane reported `is_paused: false`. The state file records the plane's [`Status`] (whether
//! a client paused the fleet); the recovering controller applies it:
//!
//! - a client had paused the fleet: every engine is paused again in that mode (one the dead
//!   controller had not reached yet included), and the fleet reports paused;
//! - otherwise the fleet resumes, on one weight version only (the plane's resume rule): the
//!   engines the dead controller paused serve again;
//! - engines on different weight versions (an update that reached some): the fleet is held,
//!   every engine paused and the fleet reporting paused, and the report says how to go on;
//! - engines that do not answer are reported; the others serve.

use serde_json::Value;
use troupe_serving::control_plane::Status;
use troupe_wire::PauseMode;

use super::deployment::Deployment;

/// What recovery did with the fleet, for the operator.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Settled {
    /// Every engine serves (on one weight version).
    Serving(String),
    /// Every engine is paused, as a client had left the fleet.
    Paused(String),
    /// The fleet is held paused: it cannot serve as it is; the message says why and what to do.
    Held(String),
}

impl Settled {
    /// The line to print.
    pub fn message(&self) -> &str {
        match self {
            Settled::Serving(m) | Settled::Paused(m) | Settled::Held(m) => m,
        }
    }
}

impl Deployment {
    /// Brings every engine to `recorded` (the state file's fleet status).
    pub async fn settle_recovered(&self, recorded: Status) -> Settled {
        if let Some(mode) = recorded.paused {
            return match self.plane.pause(mode, false).await {
                Ok(_) => Settled::Paused(format!(
                    "the fleet was paused ({}) by a client when the last controller stopped: every engine is paused; POST /continue_generation resumes it",
                    mode.as_str()
                )),
                Err(e) => self.hold(format!(
                    "the fleet was paused by a client, and pausing every engine again failed ({})",
                    e.message
                )).await,
            };
        }
        match self.plane.resume().await {
            Ok(_) => Settled::Serving(
                "every engine serves on one weight version (any the last controller had paused were resumed)"
                    .into(),
            ),
            Err(e) if e.status.as_u16() == 409 => self.hold(e.message).await,
            Err(e) => Settled::Serving(format!(
                "the engines that answered serve again on one weight version; {}",
                e.message
            )),
        }
    }

    /// Pauses every engine it can reach and reports the fleet held, saying `why`.
    async fn hold(&self, why: String) -> Settled {
        let paused = match self.plane.pause(PauseMode::InPlace, false).await {
            Ok(_) => "every engine is paused".to_string(),
            Err(e) => format!(
                "pausing every engine failed too ({}): the ones that answered are paused",
                e.message
            ),
        };
        Settled::Held(format!(
            "the fleet is held: {why}; {paused}. Push weights to every engine (the trainer's next update, or POST /update_weights_from_tensor), then POST /continue_generation"
        ))
    }
}

/// The config sections that shape a running deployment: a recovering controller cannot change
/// them, so a config that differs there describes another deployment.
const SHAPING: &[&str] = &[
    "allocation_mode",
    "cluster",
    "scheduler",
    "sglang",
    "vllm",
    "gateway",
    "admin_key",
    "token",
    "tls",
];

/// Keys never written to the state file's copy of the config (the file keeps what it needs
/// of them elsewhere).
const SECRET_KEYS: &[&str] = &["admin_key", "token"];

/// `source` (a loaded config) as the state file records it: secrets replaced by a marker that
/// says only whether they were set.
pub fn recorded_config(source: &Value) -> Value {
    let mut v = source.clone();
    if let Some(o) = v.as_object_mut() {
        for k in SECRET_KEYS {
            if let Some(x) = o.get_mut(*k) {
                *x = Value::String("<set>".into());
            }
        }
    }
    v
}

/// Refuses to recover with `now` when it differs from the config the deployment was started
/// with (`recorded`, from the state file; a file without one is not checked) in a section
/// that shapes the deployment, naming every differing key.
pub fn check_same_config(recorded: &Value, now: &Value) -> Result<(), String> {
    if recorded.is_null() {
        return Ok(());
    }
    let now = recorded_config(now);
    let mut diffs = Vec::new();
    for k in SHAPING {
        diff(k, recorded.get(*k), now.get(*k), &mut diffs);
    }
    if diffs.is_empty() {
        return Ok(());
    }
    Err(format!(
        "the config differs from the one this deployment was started with, at {}: a running deployment cannot change these. Recover with the config it was started with, or stop it and start afresh with --discard-state",
        diffs.join(", ")
    ))
}

/// Appends the dotted paths under `path` where `a` and `b` differ.
fn diff(path: &str, a: Option<&Value>, b: Option<&Value>, out: &mut Vec<String>) {
    match (a, b) {
        (Some(Value::Object(x)), Some(Value::Object(y))) => {
            let keys: std::collections::BTreeSet<&String> = x.keys().chain(y.keys()).collect();
            for k in keys {
                diff(&format!("{path}.{k}"), x.get(k), y.get(k), out);
            }
        }
        (a, b) if a == b => {}
        _ => out.push(path.to_string()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn configs_differing_where_it_matters_are_named() {
        let a = json!({"allocation_mode": "troupe:d1", "gateway": {"policy": "round_robin"}, "train": {"steps": 3}, "admin_key": "k1"});
        let rec = recorded_config(&a);
        assert_eq!(rec["admin_key"], "<set>");
        assert!(check_same_config(&rec, &a).is_ok());
        let mut b = a.clone();
        b["train"]["steps"] = json!(9);
        assert!(
            check_same_config(&rec, &b).is_ok(),
            "training settings do not shape serving"
        );
        b["gateway"]["policy"] = json!("random");
        b["allocation_mode"] = json!("troupe:d2");
        let e = check_same_config(&rec, &b).unwrap_err();
        assert!(
            e.contains("gateway.policy") && e.contains("allocation_mode"),
            "{e}"
        );
        assert!(!e.contains("k1"));
        assert!(
            check_same_config(&Value::Null, &b).is_ok(),
            "an older state file"
        );
    }
}
