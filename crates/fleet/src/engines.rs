//! One engine as the control plane sees it: where it is, how many GPUs (weight-group ranks) it
//! spans, and which HTTP dialect its control endpoints speak.

use serde::{Deserialize, Serialize};

use troupe_wire::Backend;
pub use troupe_wire::EngineDialect;

/// One engine of a fleet, in group order: the control plane's unit of fan-out and the weight
/// group's unit of rank assignment.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Engine {
    /// `http://host:port` of the engine's own server (never a proxy or the gateway).
    pub url: String,
    /// GPUs (ranks in a weight group) the engine spans.
    pub gpus: u32,
    /// Which control endpoints it speaks.
    pub dialect: EngineDialect,
    /// Whether `/continue_generation` honours `If-Match: "<weight version>"` (the reference
    /// engine does; SGLang and vLLM ignore the header): the fleet's version check and its
    /// resume are then one call to each engine instead of two.
    pub resume_if_match: bool,
    /// Its role (regular, prefill, decode) where the caller knows it (a deployment does): a
    /// rolling update takes part of each role at a time, so prefill and decode pairs stay.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub role: Option<troupe_wire::WorkerType>,
}

impl Engine {
    /// An engine speaking SGLang's endpoints (SGLang or the reference engine).
    pub fn sglang(url: impl Into<String>, gpus: u32) -> Self {
        Engine {
            url: url.into(),
            gpus,
            dialect: EngineDialect::Sglang,
            resume_if_match: false,
            role: None,
        }
    }

    /// An engine speaking `dialect`.
    pub fn new(url: impl Into<String>, gpus: u32, dialect: EngineDialect) -> Self {
        Engine {
            url: url.into(),
            gpus,
            dialect,
            resume_if_match: false,
            role: None,
        }
    }

    /// A server of `backend` that a deployment started: its dialect, and whether it resumes
    /// conditionally (Troupe's own engine).
    pub fn of_backend(url: impl Into<String>, gpus: u32, backend: Backend) -> Self {
        Engine {
            resume_if_match: backend == Backend::Troupe,
            ..Engine::new(url, gpus, EngineDialect::from(backend))
        }
    }

    /// The same engine, with its role known.
    pub fn with_role(mut self, role: troupe_wire::WorkerType) -> Self {
        self.role = Some(role);
        self
    }

    /// The same engine, marked as resuming conditionally (or not).
    pub fn with_resume_if_match(mut self, yes: bool) -> Self {
        self.resume_if_match = yes;
        self
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
        dialect: EngineDialect,
        #[serde(default)]
        resume_if_match: bool,
        #[serde(default)]
        role: Option<troupe_wire::WorkerType>,
    },
}

impl<'de> Deserialize<'de> for Engine {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        Ok(match EngineRepr::deserialize(d)? {
            EngineRepr::Pair(url, gpus) => Engine::sglang(url, gpus),
            EngineRepr::Full {
                url,
                gpus,
                dialect,
                resume_if_match,
                role,
            } => Engine {
                url,
                gpus,
                dialect,
                resume_if_match,
                role,
            },
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
        assert_eq!(new[0].dialect, EngineDialect::Vllm);
        let back: Vec<Engine> =
            serde_json::from_str(&serde_json::to_string(&new).unwrap()).unwrap();
        assert_eq!(back, new);
    }

    #[test]
    fn only_troupe_engines_resume_conditionally_and_the_mark_survives_a_state_file() {
        let made = [Backend::Troupe, Backend::Sglang, Backend::Vllm]
            .map(|b| Engine::of_backend("http://a:1", 1, b));
        assert_eq!(
            made.each_ref().map(|e| e.resume_if_match),
            [true, false, false]
        );
        assert_eq!(
            made.each_ref().map(|e| e.dialect),
            [
                EngineDialect::Sglang,
                EngineDialect::Sglang,
                EngineDialect::Vllm
            ]
        );
        let back: Engine = serde_json::from_str(&serde_json::to_string(&made[0]).unwrap()).unwrap();
        assert_eq!(back, made[0]);
        let old: Engine =
            serde_json::from_str(r#"{"url": "http://b:2", "gpus": 1, "dialect": "sglang"}"#)
                .unwrap();
        assert!(!old.resume_if_match);
    }
}
