//! `troupe.trainer`: the built-in GRPO trainer for the reference engine's model, as an actor.
//!
//! It is what the plan's training component (`fsdp:d1`) runs on the embedded default. Real
//! clusters use an external trainer process instead; this one proves the loop end to end.

use serde::{Deserialize, Serialize};
use troupe_actors::{Actor, ActorContext, ActorError, Handler, Message, Methods};
use troupe_engine::model::{ModelConfig, Weights};
use troupe_engine::train::{AdamOptions, TrainOptions, TrainSample, Trainer};

use troupe_serving::control_plane::HostTensor;

/// Arguments of `troupe.trainer`.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct TrainerArgs {
    /// Model preset (`tiny` or `small`), as the engines run it.
    pub model: String,
    /// Seed the engines initialised their weights from (their `--random-seed`).
    pub init_seed: u64,
    /// Adam learning rate.
    pub lr: f32,
    /// Rollout sampling temperature.
    pub temperature: f32,
}

/// One sample, as it travels to the trainer.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct WireSample {
    /// Prompt tokens.
    pub prompt_ids: Vec<u32>,
    /// Generated tokens.
    pub output_ids: Vec<u32>,
    /// Rollout logprobs of the generated tokens.
    pub logprobs: Vec<f32>,
    /// Advantage.
    pub advantage: f32,
}

/// One GRPO step on a batch.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct TrainStep {
    /// The batch.
    pub samples: Vec<WireSample>,
}

/// What a step did.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct StepReport {
    /// Steps so far.
    pub step: u64,
    /// Loss before the update.
    pub loss: f32,
    /// Mean importance ratio.
    pub mean_ratio: f32,
    /// Fraction of clipped tokens.
    pub clip_fraction: f32,
    /// Output tokens trained on.
    pub tokens: usize,
    /// Seconds the step took.
    pub seconds: f64,
}

impl Message for TrainStep {
    type Reply = StepReport;
    const METHOD: &'static str = "train_step";
}

/// Asks for the current weights (f32, Hugging Face names).
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct GetWeights;

/// A weight tensor on the wire.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct WireTensor {
    /// Name.
    pub name: String,
    /// Shape.
    pub shape: Vec<usize>,
    /// Values.
    pub data: Vec<f32>,
}

impl From<WireTensor> for HostTensor {
    fn from(t: WireTensor) -> Self {
        HostTensor {
            name: t.name,
            shape: t.shape,
            data: t.data.into(),
        }
    }
}

impl Message for GetWeights {
    type Reply = Vec<WireTensor>;
    const METHOD: &'static str = "get_weights";
}

/// The trainer actor.
pub struct TrainerActor {
    trainer: Option<Trainer>,
}

impl TrainerActor {
    fn take(&mut self) -> Result<Trainer, ActorError> {
        self.trainer
            .take()
            .ok_or_else(|| ActorError::new("trainer lost by an earlier failed step"))
    }
}

impl Actor for TrainerActor {
    const KIND: &'static str = "troupe.trainer";
    type Args = TrainerArgs;

    async fn start(a: TrainerArgs, _ctx: &ActorContext) -> Result<Self, ActorError> {
        let cfg = ModelConfig::by_name(&a.model).ok_or_else(|| {
            ActorError::new(format!(
                "model {:?} is not a preset; use tiny or small",
                a.model
            ))
        })?;
        let weights = Weights::init(&cfg, a.init_seed);
        let opts = TrainOptions {
            adam: AdamOptions {
                lr: a.lr,
                ..AdamOptions::default()
            },
            temperature: a.temperature,
            ..TrainOptions::default()
        };
        let trainer = Trainer::new(cfg, weights, opts).map_err(ActorError::new)?;
        Ok(TrainerActor {
            trainer: Some(trainer),
        })
    }

    fn methods(m: &mut Methods<Self>) {
        m.add::<TrainStep>().add::<GetWeights>();
    }
}

impl Handler<TrainStep> for TrainerActor {
    async fn handle(&mut self, m: TrainStep, _c: &ActorContext) -> Result<StepReport, ActorError> {
        let mut trainer = self.take()?;
        let samples: Vec<TrainSample> = m
            .samples
            .into_iter()
            .map(|s| TrainSample {
                prompt_ids: s.prompt_ids,
                output_ids: s.output_ids,
                rollout_logprobs: s.logprobs,
                advantage: s.advantage,
            })
            .collect();
        // The step is CPU-bound: keep it off the async workers.
        let (trainer, r) = tokio::task::spawn_blocking(move || {
            let r = trainer.step(&samples);
            (trainer, r)
        })
        .await
        .map_err(|e| ActorError::new(format!("train step panicked: {e}")))?;
        self.trainer = Some(trainer);
        let s = r.map_err(ActorError::new)?;
        Ok(StepReport {
            step: s.step,
            loss: s.loss,
            mean_ratio: s.mean_ratio,
            clip_fraction: s.clip_fraction,
            tokens: s.tokens,
            seconds: s.seconds,
        })
    }
}

impl Handler<GetWeights> for TrainerActor {
    async fn handle(
        &mut self,
        _m: GetWeights,
        _c: &ActorContext,
    ) -> Result<Vec<WireTensor>, ActorError> {
        let t = self
            .trainer
            .as_ref()
            .ok_or_else(|| ActorError::new("trainer lost by an earlier failed step"))?;
        Ok(t.named_tensors()
            .into_iter()
            .map(|(name, tensor)| WireTensor {
                name,
                shape: tensor.shape.clone(),
                data: tensor.data.clone(),
            })
            .collect())
    }
}
