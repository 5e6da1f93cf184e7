//! Why a weight update failed ([`WeightSyncError`]). Its own module because encoding the
//! tensors (`super::tensors`) fails with it as well as the sync that sends them
//! (`super::weight_sync`), and the sync builds on the encoding.

/// Why an update failed; names the engine where one is to blame.
#[derive(Debug, thiserror::Error)]
pub enum WeightSyncError {
    /// A tensor could not be encoded (NaN/inf, bad shape).
    #[error("encoding weights: {0}")]
    Encode(String),
    /// Pausing or resuming failed on some servers.
    #[error("control plane: {0}")]
    Control(String),
    /// Building the group failed.
    #[error("weight group: {0}")]
    Group(String),
    /// A bucket failed; `after` says whether serving continued (on one consistent version),
    /// `engines` what the update did to each engine (none serves any of it).
    #[error("weight update to version {version} failed: {reason}; {after}")]
    Update {
        /// Target version.
        version: troupe_wire::WeightVersion,
        /// Which engine failed and why.
        reason: String,
        /// What state serving was left in.
        after: String,
        /// Per engine: discarded, unchanged, held out or skipped.
        engines: Vec<super::outcome::EngineOutcome>,
    },
}
