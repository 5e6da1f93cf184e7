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
