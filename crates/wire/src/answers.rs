//! What engines answer on their control and info routes, as types: the answer side of
//! [`crate::endpoints`], read by `EngineClient` and written by the reference engine.
//!
//! Each type takes what the three engines Troupe speaks to actually send, read from their
//! servers (SGLang 0.5.23's `entrypoints/http_server.py`, vLLM 0.32's `entrypoints/rl/online`
//! and `serve/dev` routers, the reference engine's `server/`), and keeps every field it does not
//! name (`extra`), because the gateway passes an engine's answer on to its own client: a field
//! an engine sent is never dropped on the way. Serializing an answer gives back what was read.

use serde::{Deserialize, Serialize};
use serde_json::{Map, Value};

/// An engine's acknowledgement of a control call. Engines word these differently:
/// - SGLang: `{success, message}` for weight groups, buckets, disk loads and versions (with
///   `num_paused_requests`, `new_version`); `{message, status: "ok"}` for pause and continue;
///   a text body for `/flush_cache`; an empty body for `/abort_request` and `/health_generate`;
///   `null` for the memory routes;
/// - vLLM: `{status}` for pause, resume, sleep and wake-up (with `level`, `tags`), `{status,
///   aborted}` for aborts, `{message}` for the weight-transfer phases, `{success}` for
///   `/reset_prefix_cache` and `/update_weight_version` (with `new_version`), `{results}` for
///   `/collective_rpc`, an empty body for `/health`;
/// - the reference engine: SGLang's and vLLM's shapes on their routes, `{success, message}`
///   where SGLang's engine answers without a body.
///
/// A JSON object is [`Ack::Fields`]; anything else (text, nothing, `null`) is [`Ack::Other`],
/// as given (an empty body reads as the empty string).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(untagged)]
pub enum Ack {
    /// A JSON object.
    Fields(AckFields),
    /// Text, an empty body, `null`, or an object whose named fields have unexpected types.
    Other(Value),
}

/// The fields of an [`Ack`] object that Troupe names; the rest in `extra`.
#[derive(Debug, Clone, PartialEq, Default, Serialize, Deserialize)]
pub struct AckFields {
    /// SGLang's and the reference engine's outcome (vLLM's `/reset_prefix_cache` answers
    /// `false` with 200 when blocks are still held).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub success: Option<bool>,
    /// What happened, in words.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub message: Option<String>,
    /// vLLM's state word (`paused`, `resumed`, `sleeping`, `awake`, `aborted`) or SGLang's
    /// `ok`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub status: Option<String>,
    /// Every other field, as sent.
    #[serde(flatten)]
    pub extra: Map<String, Value>,
}

impl Ack {
    /// `{"success": true}`: Troupe's answer for a phase the engine's dialect does not have
    /// (SGLang's start of a weight update, vLLM's group teardown), so every engine answers.
    pub fn done() -> Self {
        Ack::Fields(AckFields {
            success: Some(true),
            ..AckFields::default()
        })
    }

    /// The engine's `success`, when it says.
    pub fn success(&self) -> Option<bool> {
        match self {
            Ack::Fields(f) => f.success,
            Ack::Other(_) => None,
        }
    }

    /// The engine's message: its `message` field, or a text answer.
    pub fn message(&self) -> Option<&str> {
        match self {
            Ack::Fields(f) => f.message.as_deref(),
            Ack::Other(v) => v.as_str(),
        }
    }
}

impl Default for Ack {
    fn default() -> Self {
        Ack::Other(Value::Null)
    }
}

/// `GET /server_info`: what an engine says it is. SGLang answers its server arguments, the
/// scheduler's info and `internal_states`; vLLM (in development mode) `{vllm_config,
/// vllm_env, system_env}`; the reference engine SGLang's fields Troupe reads plus its own
/// capabilities. The fields Troupe reads are typed; everything else is in `extra`.
#[derive(Debug, Clone, PartialEq, Default, Serialize, Deserialize)]
pub struct ServerInfo {
    /// Tensor-parallel size (SGLang, the reference engine): its GPUs, with `pp_size`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tp_size: Option<u64>,
    /// Pipeline-parallel size (SGLang).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pp_size: Option<u64>,
    /// The version of the weights it serves (SGLang, the reference engine; vLLM reports it in
    /// `/weight_info` instead).
    /// One that is not a version (empty, control characters) reads as absent.
    #[serde(
        default,
        deserialize_with = "crate::version::lenient",
        skip_serializing_if = "Option::is_none"
    )]
    pub weight_version: Option<crate::WeightVersion>,
    /// The reference engine honours `If-Match: <version>` on `/continue_generation`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub resume_if_match: Option<bool>,
    /// The reference engine keeps staged buckets until a commit ([`crate::staging`]; the
    /// field is [`crate::staging::CAPABILITY`]).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub weight_staging: Option<bool>,
    /// vLLM's configuration (text, or JSON with `?config_format=json`): its presence says the
    /// server speaks vLLM's dialect.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub vllm_config: Option<Value>,
    /// Every other field, as sent.
    #[serde(flatten)]
    pub extra: Map<String, Value>,
}

impl ServerInfo {
    /// Whether the engine says it is paused: the reference engine's
    /// `internal_states[0].paused` (null, or the pause mode). `None`: it does not say (SGLang
    /// 0.5.23 reports no paused state).
    pub fn paused(&self) -> Option<bool> {
        self.extra
            .get("internal_states")
            .and_then(|s| s.get(0))
            .and_then(|s| s.get("paused"))
            .map(|p| !p.is_null())
    }
}

/// SGLang's `GET /model_info` (`model_path`, `tokenizer_path`, `is_generation`,
/// `weight_version`, ...), the reference engine's the same way.
#[derive(Debug, Clone, PartialEq, Default, Serialize, Deserialize)]
pub struct ModelInfo {
    /// The checkpoint the engine serves.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub model_path: Option<String>,
    /// The version of its weights.
    /// One that is not a version (empty, control characters) reads as absent.
    #[serde(
        default,
        deserialize_with = "crate::version::lenient",
        skip_serializing_if = "Option::is_none"
    )]
    pub weight_version: Option<crate::WeightVersion>,
    /// Every other field, as sent.
    #[serde(flatten)]
    pub extra: Map<String, Value>,
}

/// OpenAI's `GET /v1/models`: `{object: "list", data: [{id, ...}]}`.
#[derive(Debug, Clone, PartialEq, Default, Serialize, Deserialize)]
pub struct ModelList {
    /// `list`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub object: Option<String>,
    /// One entry per served model.
    #[serde(default)]
    pub data: Vec<Value>,
    /// Every other field, as sent.
    #[serde(flatten)]
    pub extra: Map<String, Value>,
}

/// What model an engine serves, in its dialect: SGLang's `/model_info`, or vLLM's
/// `/v1/models` (vLLM has no `/model_info`).
/// Only serialized: the client knows which it asked for.
#[derive(Debug, Clone, PartialEq, Serialize)]
#[serde(untagged)]
pub enum EngineModel {
    /// SGLang's `/model_info`.
    Sglang(ModelInfo),
    /// vLLM's `/v1/models`.
    Vllm(ModelList),
}

/// vLLM's `GET /version`: `{"version": "0.32.0"}`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct VllmVersion {
    /// vLLM's release.
    pub version: String,
}

macro_rules! into_json {
    ($($t:ty),*) => {$(
        impl From<$t> for Value {
            /// The answer as the engine sent it (every field kept), for passing it on.
            fn from(a: $t) -> Value {
                // Serializing maps of JSON values cannot fail.
                serde_json::to_value(a).unwrap_or(Value::Null)
            }
        }
    )*};
}
into_json!(Ack, ServerInfo, ModelInfo, ModelList, EngineModel);

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn round_trip<T: Serialize + for<'de> Deserialize<'de>>(v: Value) -> T {
        let t: T = serde_json::from_value(v.clone()).unwrap();
        assert_eq!(serde_json::to_value(&t).unwrap(), v, "lossless");
        t
    }

    #[test]
    fn acks_take_every_engines_shape_and_keep_it() {
        // SGLang.
        let a: Ack =
            round_trip(json!({"message": "Generation paused successfully.", "status": "ok"}));
        assert_eq!(a.message(), Some("Generation paused successfully."));
        let a: Ack = round_trip(
            json!({"success": true, "message": "m", "num_paused_requests": 0, "new_version": "v2"}),
        );
        assert_eq!(a.success(), Some(true));
        let a: Ack = round_trip(json!("Cache flushed.\n"));
        assert_eq!(a.message(), Some("Cache flushed.\n"));
        round_trip::<Ack>(json!(""));
        round_trip::<Ack>(Value::Null);
        // vLLM.
        round_trip::<Ack>(json!({"status": "aborted", "aborted": 3}));
        round_trip::<Ack>(json!({"status": "awake", "tags": null}));
        round_trip::<Ack>(json!({"results": [null, null]}));
        let a: Ack = round_trip(json!({"success": false}));
        assert_eq!(a.success(), Some(false));
        // Unexpected types are kept as given.
        let a: Ack = round_trip(json!({"success": "yes", "message": 3}));
        assert_eq!(a.success(), None);
        assert_eq!(Value::from(Ack::done()), json!({"success": true}));
    }

    #[test]
    fn server_info_types_what_troupe_reads_and_keeps_the_rest() {
        let i: ServerInfo = round_trip(json!({
            "tp_size": 2, "pp_size": 1, "weight_version": "v3", "resume_if_match": true,
            "weight_staging": true, "internal_states": [{"paused": "in_place"}],
            "context_length": 128, "api_key": "k"
        }));
        assert_eq!(i.tp_size, Some(2));
        assert_eq!(
            i.weight_staging,
            Some(true),
            "{}",
            crate::staging::CAPABILITY
        );
        assert_eq!(crate::staging::CAPABILITY, "weight_staging");
        assert_eq!(i.paused(), Some(true));
        assert_eq!(i.weight_version.as_ref().map(|v| v.step()), Some(3));
        // A version that is not one reads as absent; the rest of the answer still counts.
        let odd: ServerInfo =
            serde_json::from_value(json!({"weight_version": "", "tp_size": 1})).unwrap();
        assert_eq!((odd.weight_version, odd.tp_size), (None, Some(1)));
        assert_eq!(i.extra["context_length"], json!(128));
        let v: ServerInfo = round_trip(json!({"vllm_config": "model='m'", "vllm_env": {}}));
        assert!(v.vllm_config.is_some() && v.paused().is_none());
        let m: ModelInfo = round_trip(json!({"model_path": "/m", "is_generation": true}));
        assert_eq!(m.model_path.as_deref(), Some("/m"));
        let l: ModelList = round_trip(json!({"object": "list", "data": [{"id": "m"}]}));
        assert_eq!(
            Value::from(EngineModel::Vllm(l)),
            json!({"object": "list", "data": [{"id": "m"}]})
        );
    }
}
