//! Troupe's staged weight updates, the same in both dialects: buckets sent with `stage: true`
//! (SGLang's `/update_weights_from_distributed`, vLLM's `update_info`) are kept beside the live
//! weights; `POST /commit_weight_update` swaps all of them in at once, `POST
//! /abort_weight_update` drops them. An engine says it can (`"weight_staging": true` in
//! `/server_info`); the control plane stages only on such engines, commits once every engine
//! has every bucket, and aborts otherwise, so a failed update leaves no engine serving part of
//! it. Engines without it (SGLang, vLLM) apply buckets as they arrive.

use serde::{Deserialize, Serialize};

/// `POST`: swap every staged bucket in at once.
pub const COMMIT_PATH: &str = "/commit_weight_update";
/// `POST`: drop what is staged.
pub const ABORT_PATH: &str = "/abort_weight_update";

/// The capability key in `/server_info`.
pub const CAPABILITY: &str = "weight_staging";

/// `POST /commit_weight_update`.
#[derive(Debug, Clone, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct CommitWeightUpdate {
    /// The version served from the commit on (else the one the staged buckets carried).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub weight_version: Option<String>,
}

/// `POST /abort_weight_update` (no fields).
#[derive(Debug, Clone, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct AbortWeightUpdate {}

/// The answer of `/abort_weight_update`.
#[derive(Debug, Clone, PartialEq, Eq, Default, Serialize, Deserialize)]
pub struct Discarded {
    /// Always true: nothing staged is not an error.
    pub success: bool,
    /// How many staged tensors were dropped.
    pub discarded: usize,
}
