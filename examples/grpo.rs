//! A single-controller GRPO script on the public API: the AReaL-lite pattern in Rust.
//!
//! `prepare_batch` → advantages → train step → `update_weights` → `set_version`, with PD rollout
//! serving (1 prefill + 2 decode reference engines) and FP8 weight sync, all on this machine.
//!
//! Run: `cargo run --release --example grpo`

use std::sync::Arc;
use std::time::Duration;

use troupe::controller::rollout::{
    InferenceClient, RlvrWorkflow, RolloutController, RolloutOptions, SamplingSettings,
    staleness_of,
};
use troupe::controller::run::job::Summary;
use troupe::controller::run::task;
use troupe::controller::run::trainer_actor::{
    GetWeights, TrainStep, TrainerActor, TrainerArgs, WireSample,
};
use troupe::controller::serve::{Deployment, ForkOptions};
use troupe::engine::train::grpo_advantages;
use troupe::scheduler::AllocationPlan;
use troupe::serving::control_plane::{HostTensor, WeightSync, WeightSyncOptions};
use troupe::{Cluster, Registry};

const STEPS: usize = 30;
const PROMPTS_PER_STEP: usize = 4;
const SAMPLES_PER_PROMPT: usize = 16;
const MAX_NEW_TOKENS: usize = 16;
const TARGET: u8 = b'a';

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    // 1. Hosts, and the allocation: PD inference groups plus one trainer.
    let cluster = Cluster::builder()
        .registry(Registry::builtin().with::<TrainerActor>())
        .in_process(1, 4)
        .await?;
    let plan = AllocationPlan::parse("troupe:(prefill:d1t1|decode:d2t1)+fsdp:d1")?;

    // 2. Rollout serving: every server forked in parallel, behind the PD-aware gateway.
    let opts = ForkOptions {
        quantization: Some("fp8".into()),
        progress: troupe::cli::run::bring_up_bar(),
        ..ForkOptions::default()
    };
    let svc = Deployment::fork(&cluster, &plan, &opts).await?;
    println!("gateway at {}", svc.gateway_url);
    let engines = svc.control.engines();

    // 3. The trainer, where the plan put the training rank.
    let trainer = cluster
        .host(svc.train_host().unwrap_or(0))
        .spawn::<TrainerActor>(
            "trainer",
            &TrainerArgs {
                model: "tiny".into(),
                init_seed: 0,
                lr: 0.01,
                temperature: 1.0,
            },
        )
        .await?;

    // 4. Rollouts: n samples per prompt, rewarded by how many target bytes they produce.
    let rollout = RolloutController::new(
        InferenceClient::new(svc.gateway_url.clone()),
        RolloutOptions {
            max_concurrent: 16,
            max_staleness: 1,
            batch_size: PROMPTS_PER_STEP,
        },
    );
    let workflow = Arc::new(RlvrWorkflow {
        n_samples: SAMPLES_PER_PROMPT,
        sampling: SamplingSettings {
            max_new_tokens: MAX_NEW_TOKENS,
            ignore_eos: true,
            ..SamplingSettings::default()
        },
        reward: Arc::new(|_prompt: &[u32], out: &[u32]| task::reward(out, TARGET, MAX_NEW_TOKENS)),
    });
    let mut data = task::prompts(TARGET, 7);
    let sync = WeightSync::new(WeightSyncOptions {
        fp8: true,
        ..Default::default()
    });

    // 5. The loop (its curves go to `--plot FILE.svg` through the same call as `troupe run`).
    let plot = std::env::args()
        .skip_while(|a| a != "--plot")
        .nth(1)
        .map(std::path::PathBuf::from);
    let mut summary = Summary {
        steps: STEPS,
        baseline_reward: 0.0,
        final_reward: 0.0,
        rewards: Vec::new(),
        sync_seconds: Vec::new(),
        sync_bytes_sent: Vec::new(),
        sync_bytes_full: 0,
        changed_fraction: Vec::new(),
        weights_delta: "auto".into(),
        tokens_per_s: Vec::new(),
        staleness: Vec::new(),
        max_staleness_seen: 0,
        stale_dropped: 0,
        weight_format: "fp8".into(),
        total_seconds: 0.0,
    };
    let started = std::time::Instant::now();
    let mut tokens = 0usize;
    for step in 0..STEPS {
        let version = step as u64;
        let batch = rollout
            .prepare_batch(&mut data, workflow.clone(), Duration::from_secs(300))
            .await?;
        let mut samples = Vec::new();
        let mut rewards = Vec::new();
        for traj in &batch {
            let r: Vec<f32> = traj.samples.iter().map(|s| s.reward).collect();
            let adv = grpo_advantages(&r, r.len())?;
            for (s, a) in traj.samples.iter().zip(adv) {
                samples.push(WireSample {
                    prompt_ids: s.prompt_ids.clone(),
                    output_ids: s.output_ids.clone(),
                    logprobs: s.logprobs.clone(),
                    advantage: a,
                });
            }
            rewards.extend(r);
        }
        let stats = trainer.call(TrainStep { samples }).await?;
        let weights: Vec<HostTensor> = trainer
            .call(GetWeights)
            .await?
            .into_iter()
            .map(HostTensor::from)
            .collect();
        let report = sync
            .update_weights(&svc.control, &engines, &(version + 1).into(), &weights)
            .await?;
        rollout.set_version(version + 1);
        let mean = rewards.iter().sum::<f32>() / rewards.len().max(1) as f32;
        tokens += batch
            .iter()
            .flat_map(|t| &t.samples)
            .map(|s| s.output_ids.len())
            .sum::<usize>();
        summary.rewards.push(mean);
        summary.sync_seconds.push(report.seconds);
        summary.sync_bytes_sent.push(report.sent_bytes);
        summary.sync_bytes_full = report.bytes;
        summary
            .changed_fraction
            .push(report.delta.changed_fraction());
        summary
            .tokens_per_s
            .push(tokens as f64 / started.elapsed().as_secs_f64().max(1e-6));
        summary.staleness.push(staleness_of(&batch, version));
        println!(
            "step {:>2}: reward {:.3}, loss {:+.4}, sync {:.3}s, staleness {}",
            step + 1,
            rewards.iter().sum::<f32>() / rewards.len() as f32,
            stats.loss,
            report.seconds,
            staleness_of(&batch, version)
        );
    }

    summary.baseline_reward = summary.rewards.first().copied().unwrap_or(0.0);
    summary.final_reward = summary.rewards.last().copied().unwrap_or(0.0);
    summary.max_staleness_seen = summary.staleness.iter().copied().max().unwrap_or(0);
    summary.stale_dropped = rollout.stats().stale_dropped;
    summary.total_seconds = started.elapsed().as_secs_f64();
    if let Some(p) = &plot {
        troupe::cli::plot::write_svg(&summary, p).map_err(anyhow::Error::msg)?;
        println!("curves written to {}", p.display());
    }
    rollout.shutdown(); // episodes still in flight end quietly with serving
    svc.teardown().await;
    cluster.shutdown().await;
    Ok(())
}
