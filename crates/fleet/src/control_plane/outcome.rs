//! What a weight update did to each engine ([`EngineOutcome`]), and whether engines that can
//! stage an update are asked to ([`Staging`]).
//!
//! An update is all or nothing: engines that stage (`troupe_wire::staging`: the reference
//! engine) swap the whole update in on a commit sent only once every engine has every bucket,
//! and drop it on an abort; engines that apply buckets as they arrive (SGLang, vLLM, a user's
//! own) cannot take a half-applied update back, so after a failed update that reached them
//! they are *held out*: kept paused and out of the router until a complete update (the kept
//! catch-up copy, or the next update) reaches them. No engine is resumed on a label its
//! weights do not match.

use serde::{Deserialize, Serialize};

/// Whether engines that can stage an update do (`weights.staging`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Staging {
    /// Stage on every engine whose `/server_info` says `weight_staging` (memory: while an
    /// update is in flight, one extra copy of the tensors it sends on each such engine).
    #[default]
    Auto,
    /// Never stage: every engine applies buckets as they arrive (and is held out after a
    /// failed update that reached it).
    Off,
}

/// What happened to one engine in one update.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Outcome {
    /// Staged every bucket and swapped them in on the commit: serves the new version.
    Committed,
    /// Applied every bucket as it arrived: serves the new version.
    Applied,
    /// Staged some of the update and dropped it on the abort: serves what it served before.
    Discarded,
    /// Nothing reached it (the update failed before its first bucket): serves what it
    /// served before.
    Unchanged,
    /// May hold part of the update (it applies as it receives, or its commit went
    /// unanswered): paused and out of the router until a complete update reaches it.
    HeldOut,
    /// Its process was down; it catches up when it is back.
    Skipped,
}

impl Outcome {
    /// Whether the engine serves the update's version now.
    pub fn took_it(self) -> bool {
        matches!(self, Outcome::Committed | Outcome::Applied)
    }
}

/// One engine's part in an update.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct EngineOutcome {
    /// The engine's URL.
    pub url: String,
    /// Whether it was sent the update staged.
    pub staged: bool,
    /// What happened.
    pub outcome: Outcome,
}

/// `url: outcome` pairs on one line, for error messages.
pub fn describe(outcomes: &[EngineOutcome]) -> String {
    outcomes
        .iter()
        .map(|o| {
            let w = serde_json::to_value(o.outcome)
                .ok()
                .and_then(|v| v.as_str().map(str::to_string))
                .unwrap_or_default();
            format!("{}: {w}", o.url)
        })
        .collect::<Vec<_>>()
        .join(", ")
}
