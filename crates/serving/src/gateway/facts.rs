//! [`ServerFacts`]: what registering a worker reads from its server's `/server_info`, and no
//! more. The gateway asks a server for its info when it registers it; a controller that already
//! read every server's info at bring-up hands the gateway these facts instead
//! ([`super::GatewayConfig::worker_infos`]), small however much the server's info carries
//! (SGLang's has all its server arguments; vLLM's its whole configuration as text).

use serde::{Deserialize, Serialize};
use serde_json::Value;
use troupe_wire::WeightVersion;
use troupe_wire::answers::ServerInfo;

/// What registration learns of a server: its type, dialect, weight version, context and KV
/// pool.
#[derive(Debug, Clone, PartialEq, Default, Serialize, Deserialize)]
#[serde(default)]
pub struct ServerFacts {
    /// Its `disaggregation_mode` as sent (`"null"`, `"prefill"`, `"decode"`); `None` when its
    /// info has none (then its type is not checked).
    pub mode: Option<Value>,
    /// It speaks vLLM's dialect (its info is vLLM's `{vllm_config, ...}`).
    pub vllm: bool,
    /// The weight version it serves, if its info names one.
    pub weight_version: Option<WeightVersion>,
    /// Its context in tokens (`context_length`, `max_model_len`, or vLLM's config text).
    pub context: Option<u64>,
    /// Its KV pool in tokens (`max_total_num_tokens`).
    pub kv_pool: Option<u64>,
}

impl ServerFacts {
    /// The facts in `info`.
    pub fn of(info: &ServerInfo) -> Self {
        let num = |k: &str| info.extra.get(k).and_then(Value::as_u64);
        ServerFacts {
            mode: info.extra.get("disaggregation_mode").cloned(),
            vllm: info.vllm_config.is_some(),
            weight_version: info.weight_version.clone(),
            context: ["context_length", "max_model_len", "max_context_length"]
                .iter()
                .find_map(|k| num(k))
                .or_else(|| vllm_context(info)),
            kv_pool: num("max_total_num_tokens"),
        }
    }
}

/// vLLM's development `/server_info`: `{"vllm_config": "model='…', …, max_seq_len=1024, …"}`.
fn vllm_context(info: &ServerInfo) -> Option<u64> {
    let text = info.vllm_config.as_ref()?.as_str()?;
    ["max_model_len=", "max_seq_len="].iter().find_map(|k| {
        let rest = &text[text.find(k)? + k.len()..];
        let digits: String = rest.chars().take_while(char::is_ascii_digit).collect();
        digits.parse().ok()
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn facts(v: Value) -> ServerFacts {
        ServerFacts::of(&serde_json::from_value::<ServerInfo>(v).unwrap())
    }

    #[test]
    fn the_facts_are_read_from_each_dialect() {
        let sglang = facts(json!({
            "disaggregation_mode": "prefill", "weight_version": "v3", "context_length": 4096,
            "max_total_num_tokens": 65536, "tp_size": 1, "many_other_server_args": [1, 2, 3],
        }));
        assert_eq!(sglang.mode, Some(json!("prefill")));
        assert!(!sglang.vllm);
        assert_eq!(
            sglang.weight_version.as_ref().map(WeightVersion::as_str),
            Some("v3")
        );
        assert_eq!((sglang.context, sglang.kv_pool), (Some(4096), Some(65536)));
        let vllm = facts(json!({"vllm_config": "model='m', max_seq_len=1024, seed=0"}));
        assert!(vllm.vllm);
        assert_eq!(
            (vllm.mode, vllm.context, vllm.kv_pool),
            (None, Some(1024), None)
        );
        assert_eq!(facts(json!({"other": 1})), ServerFacts::default());
    }

    #[test]
    fn facts_travel_as_json_unchanged() {
        let f = facts(json!({"disaggregation_mode": "decode", "context_length": 8}));
        let back: ServerFacts = serde_json::from_value(serde_json::to_value(&f).unwrap()).unwrap();
        assert_eq!(back, f);
    }
}
