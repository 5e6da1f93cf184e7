//! The typed bodies of vLLM's native RL control endpoints (the routes SkyRL's
//! `RemoteInferenceClient` calls): the four-phase weight transfer and the answers of
//! `/is_paused` and `/get_world_size`. Field names are vLLM's own, so a real vLLM server, the
//! reference engine and Troupe's gateway take the same bytes.

use serde::{Deserialize, Serialize};

/// `init_info` of `POST /init_weight_transfer_engine`: where rank 0 is and which ranks this
/// server takes (`rank_offset .. rank_offset + its GPUs`).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct WeightTransferInit {
    /// Address of the broadcast source (trainer rank 0).
    pub master_address: String,
    /// Its port.
    pub master_port: u16,
    /// This server's first rank.
    pub rank_offset: u32,
    /// Ranks in the whole group (1 + every engine GPU).
    pub world_size: u32,
    /// Troupe's field for its `tcp` transport: the group's secret (rank 0's
    /// `WeightSender::secret()`) the server's join must prove. Absent for vLLM's own engines.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub group_secret: Option<String>,
}

/// `POST /init_weight_transfer_engine`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct InitWeightTransferEngine {
    /// The group to join.
    pub init_info: WeightTransferInit,
}

/// `update_info` of `POST /update_weights`: one bucket's tensors, in broadcast order.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct UpdateInfo {
    /// Parameter names.
    pub names: Vec<String>,
    /// Their torch dtype names (`bfloat16`, `float32`, `float8_e4m3fn`).
    pub dtype_names: Vec<String>,
    /// Their shapes.
    pub shapes: Vec<Vec<usize>>,
    /// Whether the tensors arrive packed into one flat buffer.
    #[serde(default)]
    pub packed: bool,
    /// Keep the bucket beside the live weights until `/commit_weight_update` (Troupe's field,
    /// as SGLang's `stage`; absent when false). See [`crate::staging`].
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub stage: bool,
}

/// `POST /update_weights`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct UpdateWeights {
    /// The bucket.
    pub update_info: UpdateInfo,
}

/// `POST /finish_weight_update`: Troupe's optional version the server reports afterwards.
#[derive(Debug, Clone, PartialEq, Eq, Default, Serialize, Deserialize)]
pub struct FinishWeightUpdate {
    /// The version of the weights just loaded.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub weight_version: Option<String>,
}

/// The answer of `GET /is_paused`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct IsPaused {
    /// Whether generation is paused.
    pub is_paused: bool,
}

/// The answer of `GET /get_world_size`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct WorldSize {
    /// GPUs (ranks) behind the server.
    pub world_size: u32,
}

/// `POST /abort_requests`: these requests, or every request when the list is empty.
#[derive(Debug, Clone, PartialEq, Eq, Default, Serialize, Deserialize)]
pub struct AbortRequests {
    /// Request ids.
    #[serde(default)]
    pub request_ids: Vec<String>,
}

/// `POST /collective_rpc`: runs one worker method on every rank of a vLLM server (served only
/// with `VLLM_SERVER_DEV_MODE=1`). vLLM passes `args` and `kwargs` to the method as given; the
/// answer is `{"results": [...]}`, one entry per rank.
///
/// Read from vLLM 0.32's `vllm/entrypoints/serve/dev/rpc/api_router.py`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct CollectiveRpc {
    /// The worker method (e.g. [`RELOAD_WEIGHTS`]).
    pub method: String,
    /// Positional arguments.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub args: Vec<serde_json::Value>,
    /// Keyword arguments.
    #[serde(default, skip_serializing_if = "serde_json::Map::is_empty")]
    pub kwargs: serde_json::Map<String, serde_json::Value>,
    /// Seconds the call may take (vLLM's own limit; none by default).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub timeout: Option<f64>,
}

/// The worker method that reloads every weight in place from a checkpoint directory
/// (`kwargs.weights_path`): how a vLLM server loads a trainer's checkpoint from disk, the
/// counterpart of SGLang's `/update_weights_from_disk` (vLLM 0.32:
/// `GPUModelRunner.reload_weights(weights_iterator, weights_path, is_checkpoint_format)`, also
/// what the CPU worker runs).
pub const RELOAD_WEIGHTS: &str = "reload_weights";

impl CollectiveRpc {
    /// `reload_weights` from the checkpoint at `path` (a directory of safetensors files).
    pub fn reload_weights(path: &str) -> Self {
        let mut kwargs = serde_json::Map::new();
        kwargs.insert("weights_path".into(), serde_json::Value::from(path));
        CollectiveRpc {
            method: RELOAD_WEIGHTS.into(),
            args: Vec::new(),
            kwargs,
            timeout: None,
        }
    }
}

/// `POST /update_weight_version`: the version the server reports from now on (vLLM 0.32's
/// `rl/online/api_router.py`; SGLang's route of the same name takes the same body).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct UpdateWeightVersion {
    /// The new version label.
    pub new_version: String,
    /// Abort requests in flight first (SGLang's field; absent when false; null: false).
    #[serde(
        default,
        deserialize_with = "crate::sglang::null_as_default",
        skip_serializing_if = "std::ops::Not::not"
    )]
    pub abort_all_requests: bool,
}

/// vLLM's pause modes (`POST /pause?mode=`), spelled once for the engine, the gateway and the
/// client.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum PauseMode {
    /// Requests in flight end now (finish reason `abort`).
    #[default]
    Abort,
    /// Running requests finish first; queued ones stay queued.
    Wait,
    /// Requests stay where they are and continue after `/resume`.
    Keep,
}

impl PauseMode {
    /// Every mode, in the order help texts list them.
    pub const ALL: [PauseMode; 3] = [PauseMode::Abort, PauseMode::Wait, PauseMode::Keep];

    /// vLLM's spelling.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Abort => "abort",
            Self::Wait => "wait",
            Self::Keep => "keep",
        }
    }

    /// Parses vLLM's spelling.
    pub fn parse(s: &str) -> Option<Self> {
        Self::ALL.into_iter().find(|m| m.as_str() == s)
    }
}

/// `POST /pause?mode=` (a query, not a body).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
pub struct Pause {
    /// What happens to requests in flight (vLLM's default: `abort`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub mode: Option<PauseMode>,
}

/// `POST /sleep?level=&tags=` (a query, not a body).
#[derive(Debug, Clone, PartialEq, Eq, Default, Serialize, Deserialize)]
pub struct Sleep {
    /// vLLM's sleep level (1: offload the weights, drop the KV cache).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub level: Option<u32>,
    /// What to release (the reference engine reads them; vLLM 0.32 does not).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub tags: Vec<String>,
}

/// `POST /wake_up?tags=` (a query, not a body; no tags: everything).
#[derive(Debug, Clone, PartialEq, Eq, Default, Serialize, Deserialize)]
pub struct WakeUp {
    /// What to take back.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub tags: Vec<String>,
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::routes::query_string;

    #[test]
    fn queries_are_vllms() {
        assert_eq!(query_string(&Pause::default()).unwrap(), "");
        let keep = Pause {
            mode: Some(PauseMode::Keep),
        };
        assert_eq!(query_string(&keep).unwrap(), "?mode=keep");
        let s = Sleep {
            level: Some(1),
            tags: vec!["weights".into(), "kv_cache".into()],
        };
        assert_eq!(
            query_string(&s).unwrap(),
            "?level=1&tags=weights&tags=kv_cache"
        );
        assert_eq!(query_string(&WakeUp::default()).unwrap(), "");
        for m in PauseMode::ALL {
            assert_eq!(PauseMode::parse(m.as_str()), Some(m));
        }
    }
}
