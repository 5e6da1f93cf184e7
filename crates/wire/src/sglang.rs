//! The typed bodies of SGLang's HTTP control and weight-update endpoints, and the names of the
//! `meta_info` fields Troupe reads from its answers.
//!
//! One definition for every side: the engine parses these requests, the serving crate's
//! `EngineClient` sends them, and the controller's weight sync and gRPC API build them. Field
//! names are SGLang's own (`python/sglang/srt/managers/io_struct.py`), so a real SGLang server
//! and Troupe's reference engine take the same bytes.

use serde::{Deserialize, Serialize};

use crate::PauseMode;

/// `POST /pause_generation`. Unknown fields are refused (a misspelt `mode` would otherwise
/// pause with `abort`, the one mode that loses work).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PauseGeneration {
    /// What happens to requests in flight (absent or null: `abort`).
    #[serde(default, deserialize_with = "null_as_default")]
    pub mode: PauseMode,
}

/// `POST /release_memory_occupation` and `POST /resume_memory_occupation`.
#[derive(Debug, Clone, PartialEq, Eq, Default, Serialize, Deserialize)]
pub struct MemoryTags {
    /// What to release or resume (`weights`, `kv_cache`); absent means everything.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tags: Option<Vec<String>>,
}

/// `POST /init_weights_update_group`: join the trainer's broadcast group as ranks
/// `rank_offset .. rank_offset + gpus`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct InitWeightsUpdateGroup {
    /// Address of the broadcast source (trainer rank 0).
    pub master_address: String,
    /// Its port.
    pub master_port: u16,
    /// This engine's first rank in the group.
    pub rank_offset: u32,
    /// Ranks in the whole group (1 + every engine GPU).
    pub world_size: u32,
    /// The group's name (weight updates name it).
    pub group_name: String,
    /// Collective backend: `nccl` for SGLang on GPUs, `tcp` for the reference engine (absent:
    /// the engine's own, as SGLang defaults to `nccl`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub backend: Option<String>,
    /// Troupe's field for the `tcp` backend: the group's secret (rank 0's
    /// `WeightSender::secret()`, 64 hex digits) that the engine's join must prove, so knowing
    /// the port and group name is not enough to take a rank. The route is admin-keyed, which
    /// is what keeps it secret. Absent for NCCL, whose engines ignore it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub group_secret: Option<String>,
}

/// `POST /destroy_weights_update_group`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct DestroyWeightsUpdateGroup {
    /// The group to leave.
    pub group_name: String,
}

/// `POST /update_weights_from_distributed`: receive one bucket of tensors, in this order, from
/// the group's broadcast.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct UpdateWeightsFromDistributed {
    /// Parameter names, in broadcast order.
    pub names: Vec<String>,
    /// Their dtypes (`bfloat16`, `float32`, `float8_e4m3fn`), same order.
    pub dtypes: Vec<String>,
    /// Their shapes, same order.
    pub shapes: Vec<Vec<usize>>,
    /// The group the bucket arrives on.
    pub group_name: String,
    /// Flush the prefix cache after loading (KV computed with old weights is wrong).
    #[serde(default)]
    pub flush_cache: bool,
    /// The version the engine reports once the bucket is loaded.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub weight_version: Option<String>,
    /// vLLM's packed broadcast (all tensors of the bucket in one flat buffer): only vLLM
    /// engines take it, so it is never sent to SGLang (Troupe's field; absent when false).
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub packed: bool,
    /// Keep the bucket beside the live weights until `/commit_weight_update` (Troupe's field,
    /// sent only to engines whose `/server_info` says `weight_staging`; absent when false). See
    /// [`crate::staging`].
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub stage: bool,
}

/// `POST /abort_request`: one request by id, or every request. Fields SGLang adds in later
/// versions pass through unchanged (`rest`).
#[derive(Debug, Clone, PartialEq, Default, Serialize, Deserialize)]
pub struct AbortRequest {
    /// The request to abort.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub rid: Option<String>,
    /// Abort every request instead (absent or null: false).
    #[serde(
        default,
        deserialize_with = "null_as_default",
        skip_serializing_if = "std::ops::Not::not"
    )]
    pub abort_all: bool,
    /// Any other field, passed on as given.
    #[serde(flatten)]
    pub rest: serde_json::Map<String, serde_json::Value>,
}

/// `POST /update_weights_from_disk`: load a checkpoint every engine can read. Fields SGLang
/// adds (`load_format`, ...) pass through unchanged (`rest`).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct UpdateWeightsFromDisk {
    /// The checkpoint (a safetensors file or directory).
    pub model_path: String,
    /// The version the engine reports once loaded.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub weight_version: Option<String>,
    /// Abort requests in flight first (absent when false).
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub abort_all_requests: bool,
    /// Any other field, passed on as given.
    #[serde(flatten)]
    pub rest: serde_json::Map<String, serde_json::Value>,
}

/// The answer of `GET /get_weight_version`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct GetWeightVersion {
    /// The version of the weights the engine serves (checked as it is read).
    pub weight_version: crate::WeightVersion,
}

/// A field whose `null` means its default, as SGLang's Python reads `None`.
pub(crate) fn null_as_default<'de, D, T>(d: D) -> Result<T, D::Error>
where
    D: serde::Deserializer<'de>,
    T: Default + Deserialize<'de>,
{
    Ok(Option::<T>::deserialize(d)?.unwrap_or_default())
}

/// JSON pointers of the `meta_info` fields Troupe reads from `/generate` answers.
pub mod meta {
    /// The weight version that finished the request.
    pub const WEIGHT_VERSION: &str = "/meta_info/weight_version";
    /// `finish_reason.type`: `stop`, `length` or `abort`.
    pub const FINISH_TYPE: &str = "/meta_info/finish_reason/type";
    /// `finish_reason.message` (why an abort happened).
    pub const FINISH_MESSAGE: &str = "/meta_info/finish_reason/message";
    /// `finish_reason` as a whole.
    pub const FINISH_REASON: &str = "/meta_info/finish_reason";
    /// Per output token `[logprob, token id, text]` (with `return_logprob`).
    pub const OUTPUT_TOKEN_LOGPROBS: &str = "/meta_info/output_token_logprobs";
    /// Per prompt token logprobs (with `return_logprob`); PD takes them from the prefill.
    pub const INPUT_TOKEN_LOGPROBS: &str = "/meta_info/input_token_logprobs";
    /// Troupe's addition: the weight version that made each output token (the data proxy
    /// stamps it across abort-and-resubmit).
    pub const OUTPUT_TOKEN_WEIGHT_VERSIONS: &str = "/meta_info/output_token_weight_versions";
    /// The `finish_reason.type` of a request aborted by a pause.
    pub const ABORT: &str = "abort";
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn bodies_use_sglang_field_names() {
        let b = UpdateWeightsFromDistributed {
            names: vec!["w".into()],
            dtypes: vec!["bfloat16".into()],
            shapes: vec![vec![2, 3]],
            group_name: "g".into(),
            flush_cache: true,
            weight_version: Some("v1".into()),
            packed: false,
            stage: false,
        };
        assert_eq!(
            serde_json::to_value(&b).unwrap(),
            json!({"names": ["w"], "dtypes": ["bfloat16"], "shapes": [[2, 3]], "group_name": "g", "flush_cache": true, "weight_version": "v1"})
        );
        let p: PauseGeneration = serde_json::from_value(json!({})).unwrap();
        assert_eq!(p.mode, PauseMode::Abort);
        let p: PauseGeneration = serde_json::from_value(json!({"mode": "in_place"})).unwrap();
        assert_eq!(p.mode, PauseMode::InPlace);
        // A misspelt field is refused, not read as the default mode.
        assert!(serde_json::from_value::<PauseGeneration>(json!({"mood": "in_place"})).is_err());
        // An engine's version is checked as it is read.
        let v: GetWeightVersion = serde_json::from_value(json!({"weight_version": "v3"})).unwrap();
        assert_eq!(v.weight_version.step(), 3);
        assert!(serde_json::from_value::<GetWeightVersion>(json!({"weight_version": ""})).is_err());
    }
}
