//! Rollout workflows (AReaL-lite's `RolloutWorkflow`): how one data item becomes a trajectory.
//!
//! A workflow may call the engine several times (multi-turn, tools); it returns `None` to drop
//! the item. [`RlvrWorkflow`] is the common case: n samples per prompt, each its own request,
//! scored by a reward function.

use std::future::Future;
use std::sync::Arc;

use troupe_wire::WeightVersion;

use super::client::{GenerateError, InferenceClient, SamplingSettings};

/// One sampled answer with everything training needs.
#[derive(Debug, Clone, PartialEq)]
pub struct Sample {
    /// Prompt token ids.
    pub prompt_ids: Vec<u32>,
    /// Generated token ids.
    pub output_ids: Vec<u32>,
    /// Rollout log-probabilities of the generated tokens.
    pub logprobs: Vec<f32>,
    /// Weight version that generated each token.
    pub versions: Vec<u64>,
    /// Reward of this answer.
    pub reward: f32,
}

/// What one episode produced: the samples of one prompt (a GRPO group).
#[derive(Debug, Clone, PartialEq)]
pub struct Trajectory {
    /// The samples, in request order.
    pub samples: Vec<Sample>,
}

impl Trajectory {
    /// Oldest weight version any token of this trajectory was generated with.
    pub fn oldest_version(&self) -> Option<u64> {
        self.samples
            .iter()
            .flat_map(|s| s.versions.iter().copied())
            .min()
    }
}

/// Why an episode failed.
#[derive(Debug, Clone, thiserror::Error)]
pub enum RolloutError {
    /// Generation failed.
    #[error(transparent)]
    Generate(#[from] GenerateError),
    /// The workflow's own error.
    #[error("workflow: {0}")]
    Workflow(String),
}

/// Turns one data item into a trajectory.
pub trait RolloutWorkflow: Send + Sync + 'static {
    /// The data item type. `Clone`: the controller keeps the item until its trajectory is
    /// consumed, so an item whose trajectory came out too stale can be generated again.
    type Item: Clone + Send + 'static;

    /// Runs one episode; `Ok(None)` drops the item.
    fn run_episode(
        &self,
        engine: &InferenceClient,
        item: Self::Item,
    ) -> impl Future<Output = Result<Option<Trajectory>, RolloutError>> + Send;
}

/// A prompt with the information its reward needs.
#[derive(Debug, Clone)]
pub struct RlvrItem {
    /// Prompt token ids.
    pub prompt_ids: Vec<u32>,
    /// Seed of this item's samples (sample i uses seed + i).
    pub seed: u64,
}

/// Reward of one answer's token ids.
pub type RewardFn = Arc<dyn Fn(&[u32], &[u32]) -> f32 + Send + Sync>;

/// Reinforcement learning with verifiable rewards: n independent samples per prompt.
pub struct RlvrWorkflow {
    /// Samples per prompt (the GRPO group size).
    pub n_samples: usize,
    /// Sampling settings (the seed is set per sample).
    pub sampling: SamplingSettings,
    /// Reward of (prompt ids, output ids).
    pub reward: RewardFn,
}

/// The number the staleness bound compares for a weight version: its step, by the one rule of
/// [`troupe_wire::WeightVersion::step`] (`"3"`, `"v3"` → 3; `"default"` → 0).
pub fn version_number(v: &str) -> u64 {
    troupe_wire::version::step_of(v)
}

impl RolloutWorkflow for RlvrWorkflow {
    type Item = RlvrItem;

    async fn run_episode(
        &self,
        engine: &InferenceClient,
        item: RlvrItem,
    ) -> Result<Option<Trajectory>, RolloutError> {
        let calls = (0..self.n_samples).map(|i| {
            let mut s = self.sampling.clone();
            s.seed = Some(item.seed.wrapping_mul(1_000_003).wrapping_add(i as u64));
            let prompt = &item.prompt_ids;
            async move { engine.generate(prompt, &s).await }
        });
        let gens = futures::future::try_join_all(calls).await?;
        let samples = gens
            .into_iter()
            .map(|g| Sample {
                reward: (self.reward)(&item.prompt_ids, &g.output_ids),
                prompt_ids: item.prompt_ids.clone(),
                versions: g
                    .versions
                    .iter()
                    .map(|v| v.as_ref().map_or(0, WeightVersion::step))
                    .collect(),
                output_ids: g.output_ids,
                logprobs: g.logprobs,
            })
            .collect();
        Ok(Some(Trajectory { samples }))
    }
}
