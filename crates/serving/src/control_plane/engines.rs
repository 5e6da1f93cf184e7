//! One engine as the control plane sees it: where it is, how many GPUs (weight-group ranks) it
//! spans, and which HTTP dialect its control endpoints speak.

use serde::{Deserialize, Serialize};
use troupe_wire::Backend;

/// The family of control endpoints an engine serves. The reference engine serves both; real
/// SGLang servers speak [`Dialect::Sglang`] and real vLLM servers [`Dialect::Vllm`] (its native
/// RL routes: `/pause`, `/resume`, `/sleep`, `/wake_up`, the four-phase weight transfer).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Dialect {
    /// SGLang's names: `/pause_generation`, `/init_weights_update_group`, ...
    #[default]
    Sglang,
    /// vLLM's names: `/pause?mode=`, `/init_weight_transfer_engine`, ...
    Vllm,
}

impl From<Backend> for Dialect {
    fn from(b: Backend) -> Self {
        match b {
            Backend::Vllm => Dialect::Vllm,
            _ => Dialect::Sglang,
        }
    }
}

impl std::fmt::Display for Dialect {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Dialect::Sglang => "sglang",
            Dialect::Vllm => "vllm",
        })
    }
}

/// One engine of a fleet, in group order: the control plane's unit of fan-out and the weight
/// group's unit of rank assignment.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Engine {
    /// `http://host:port` of the engine's own server (never a proxy or the gateway).
    pub url: String,
    /// GPUs (ranks in a weight group) the engine spans.
    pub gpus: u32,
    /// Which control endpoints it speaks.
    pub dialect: Dialect,
}

impl Engine {
    /// An engine speaking SGLang's endpoints (SGLang or the reference engine).
    pub fn sglang(url: impl Into<String>, gpus: u32) -> Self {
        Engine {
            url: url.into(),
            gpus,
            dialect: Dialect::Sglang,
        }
    }

    /// An engine speaking `dialect`.
    pub fn new(url: impl Into<String>, gpus: u32, dialect: Dialect) -> Self {
        Engine {
            url: url.into(),
            gpus,
            dialect,
        }
    }
}

/// State files written before engines had a dialect stored `[url, gpus]` pairs; both read.
#[derive(Deserialize)]
#[serde(untagged)]
enum EngineRepr {
    Pair(String, u32),
    Full {
        url: String,
        gpus: u32,
        #[serde(default)]
        dialect: Dialect,
    },
}

impl<'de> Deserialize<'de> for Engine {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        Ok(match EngineRepr::deserialize(d)? {
            EngineRepr::Pair(url, gpus) => Engine::sglang(url, gpus),
            EngineRepr::Full { url, gpus, dialect } => Engine { url, gpus, dialect },
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn old_pairs_and_new_records_both_read() {
        let old: Vec<Engine> = serde_json::from_str(r#"[["http://a:1", 2]]"#).unwrap();
        assert_eq!(old, vec![Engine::sglang("http://a:1", 2)]);
        let new: Vec<Engine> =
            serde_json::from_str(r#"[{"url": "http://b:2", "gpus": 1, "dialect": "vllm"}]"#)
                .unwrap();
        assert_eq!(new[0].dialect, Dialect::Vllm);
        let back: Vec<Engine> =
            serde_json::from_str(&serde_json::to_string(&new).unwrap()).unwrap();
        assert_eq!(back, new);
    }
}
