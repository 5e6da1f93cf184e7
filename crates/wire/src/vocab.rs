//! Backends, roles and worker types: the small closed vocabularies that the allocation language,
//! the launcher, the router and the engine all speak, defined once here.

use std::fmt;

use serde::{Deserialize, Serialize};

/// The engine a component runs on.
///
/// It exists because the backend decides which parallel dimensions are legal (inference engines
/// take only d, t, p; FSDP rejects p and e) and whether prefill/decode groups are possible.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Backend {
    /// SGLang inference servers (PD capable).
    Sglang,
    /// vLLM inference servers.
    Vllm,
    /// Troupe's reference engine, speaking SGLang's protocol (PD capable).
    Troupe,
    /// PyTorch FSDP training.
    Fsdp,
    /// Megatron-LM training (pipeline and expert parallel).
    Megatron,
    /// Archon training (Megatron-like dimensions).
    Archon,
}

impl Backend {
    /// Every backend, inference first, in the order used by help texts.
    pub const ALL: [Backend; 6] = [
        Backend::Sglang,
        Backend::Vllm,
        Backend::Troupe,
        Backend::Fsdp,
        Backend::Megatron,
        Backend::Archon,
    ];

    /// The spelling used in allocation modes and JSON.
    pub fn as_str(self) -> &'static str {
        match self {
            Backend::Sglang => "sglang",
            Backend::Vllm => "vllm",
            Backend::Troupe => "troupe",
            Backend::Fsdp => "fsdp",
            Backend::Megatron => "megatron",
            Backend::Archon => "archon",
        }
    }

    /// Looks a backend up by its exact (lowercase) name.
    pub fn from_name(name: &str) -> Option<Backend> {
        Backend::ALL.into_iter().find(|b| b.as_str() == name)
    }

    /// Whether the component serves rollouts or trains the policy.
    pub fn role(self) -> Role {
        match self {
            Backend::Sglang | Backend::Vllm | Backend::Troupe => Role::Inference,
            Backend::Fsdp | Backend::Megatron | Backend::Archon => Role::Training,
        }
    }

    /// Whether the backend can run prefill/decode disaggregated groups.
    pub fn supports_pd(self) -> bool {
        matches!(self, Backend::Sglang | Backend::Troupe)
    }

    /// Whether the backend runs inference servers (the ones a launcher can start).
    pub fn is_inference(self) -> bool {
        self.role() == Role::Inference
    }

    /// Whether the backend accepts the MoE hybrid `(attn:…|ffn:…)` form: every training
    /// backend, as in AReaL's grammar (FSDP's own rule then refuses `p` and `e` above 1).
    pub fn supports_hybrid(self) -> bool {
        matches!(self, Backend::Fsdp | Backend::Megatron | Backend::Archon)
    }

    /// Comma-separated list of all backend names, for error messages.
    pub fn names() -> String {
        Backend::ALL.map(Backend::as_str).join(", ")
    }
}

impl fmt::Display for Backend {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// What a component is for; decides how its GPUs are split into instances.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Role {
    /// Inference servers: `d` instances of `t·p` GPUs each.
    Inference,
    /// Training ranks: `d·t·p·c` ranks of one GPU each.
    Training,
}

impl Role {
    /// The spelling used in tables and JSON.
    pub fn as_str(self) -> &'static str {
        match self {
            Role::Inference => "inference",
            Role::Training => "training",
        }
    }
}

impl fmt::Display for Role {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// The kind of worker an allocation group's instances are; the launcher, the router and the
/// engine branch on it. The three serving roles are SGLang's `worker_type` of `POST /workers`
/// (and its `--disaggregation-mode`); [`WorkerType::Train`] is a training rank, which no router
/// takes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum WorkerType {
    /// Prefill and decode in one server.
    Regular,
    /// PD prefill server: computes KV and hands it over on its bootstrap port.
    Prefill,
    /// PD decode server: fetches KV from the prefill and generates.
    Decode,
    /// A training rank.
    Train,
}

impl WorkerType {
    /// The spelling used by SGLang, allocation modes, tables and JSON.
    pub fn as_str(self) -> &'static str {
        match self {
            WorkerType::Regular => "regular",
            WorkerType::Prefill => "prefill",
            WorkerType::Decode => "decode",
            WorkerType::Train => "train",
        }
    }

    /// Parses SGLang's spelling of a serving role (`null`/`none`/empty also mean regular, as in
    /// `--disaggregation-mode`). `train` is not a serving role and is refused.
    pub fn parse(s: &str) -> Option<Self> {
        match s {
            "regular" | "null" | "none" | "" => Some(WorkerType::Regular),
            "prefill" => Some(WorkerType::Prefill),
            "decode" => Some(WorkerType::Decode),
            _ => None,
        }
    }

    /// Whether this worker serves requests (regular, prefill or decode).
    pub fn serves(self) -> bool {
        self != WorkerType::Train
    }
}

impl fmt::Display for WorkerType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// Which engine protocol a server speaks: its control routes, their bodies and queries, and
/// its launch flags. The reference engine serves both; real SGLang servers speak
/// [`EngineDialect::Sglang`] and real vLLM servers [`EngineDialect::Vllm`] (its native RL
/// routes: `/pause`, `/resume`, `/sleep`, `/wake_up`, the four-phase weight transfer). The one
/// "SGLang or vLLM" type: the control plane, the engine arguments and the route table use it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum EngineDialect {
    /// SGLang's names: `/pause_generation`, `/init_weights_update_group`, ...
    #[default]
    Sglang,
    /// vLLM's names: `/pause?mode=`, `/init_weight_transfer_engine`, ...
    Vllm,
}

impl From<Backend> for EngineDialect {
    fn from(b: Backend) -> Self {
        match b {
            Backend::Vllm => EngineDialect::Vllm,
            _ => EngineDialect::Sglang,
        }
    }
}

impl std::fmt::Display for EngineDialect {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            EngineDialect::Sglang => "sglang",
            EngineDialect::Vllm => "vllm",
        })
    }
}
