//! `troupe bench rollout --update all,rolling`: GRPO-shaped rollouts while the trainer pushes
//! new weights every few seconds, once with stop-the-world updates (`all`: every server pauses)
//! and once with rolling updates (`rolling`: a part of each role at a time, the rest serving),
//! each on a fresh PD deployment. Figures, per mode `M`:
//! - `rollout.update_M.tokens_per_s`: prompt plus completion tokens of finished samples per
//!   second over the whole run;
//! - `rollout.update_M.max_stall_ms`: the most extra time one sample took over the run's
//!   median sample (what a client sees of an update's pause: its request held or aborted and
//!   resubmitted);
//! - `rollout.update_M.updates`, `rollout.update_M.update_s`: updates done, and their mean
//!   wall time.
//!
//! Each engine's load of an update takes `--sim-weight-load-s` (the engine's latency model,
//! default 1 s: a GPU server loading a large model), since the tiny model's own takes
//! milliseconds and would hide what a pause costs.

use std::sync::Arc;
use std::time::{Duration, Instant};

use troupe_engine::model::{ModelConfig, Weights};
use troupe_serving::control_plane::{HostTensor, PartSize, Rollout, WeightSync, WeightSyncOptions};
use troupe_serving::policy::PolicyKind;

use super::rollout::RolloutArgs;

/// The tiny model's weights from `seed`, as the trainer holds them.
fn tensors(seed: u64) -> Vec<HostTensor> {
    let w = Weights::init(&ModelConfig::tiny(), seed);
    w.names()
        .into_iter()
        .filter_map(|n| {
            let t = w.get(&n)?;
            Some(HostTensor {
                name: n.clone(),
                shape: t.shape.clone(),
                data: t.data.clone().into(),
            })
        })
        .collect()
}

/// The most one latency exceeds the median one.
fn max_stall(mut lat: Vec<Duration>) -> Duration {
    lat.sort();
    let (Some(median), Some(max)) = (lat.get(lat.len() / 2), lat.last()) else {
        return Duration::ZERO;
    };
    max.saturating_sub(*median)
}

async fn run_mode(
    a: &RolloutArgs,
    mode: &str,
    every: Duration,
) -> Result<Vec<(String, f64)>, String> {
    let rollout = match mode {
        "all" => Rollout::All,
        "rolling" => Rollout::Rolling(PartSize::Fraction(0.5)),
        other => return Err(format!("--update {other:?}: use all and/or rolling")),
    };
    let plan = super::rollout::plan_for("pd")?;
    let mut extra = super::rollout::engine_args(a);
    extra.extend([
        "--sim-weight-load-s".into(),
        a.sim_weight_load_s.to_string(),
    ]);
    let (cluster, svc) = super::fixture::deployment(&plan, extra, PolicyKind::CacheAware).await?;
    let sync = WeightSync::new(WeightSyncOptions {
        rollout,
        ..WeightSyncOptions::default()
    });
    let finished = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let updater = {
        let (control, finished) = (svc.control.clone(), finished.clone());
        async move {
            let mut times = Vec::new();
            let mut k = 0u64;
            loop {
                tokio::time::sleep(every).await;
                if finished.load(std::sync::atomic::Ordering::Relaxed) {
                    return Ok::<_, String>(times);
                }
                k += 1;
                let t0 = Instant::now();
                let v = troupe_wire::WeightVersion::new(format!("v{k}"))?;
                sync.update_weights(&control, &control.engines(), &v, &tensors(k))
                    .await
                    .map_err(|e| e.to_string())?;
                times.push(t0.elapsed());
            }
        }
    };
    let started = Instant::now();
    let work = async {
        let r = super::rollout::load(a, &svc.gateway_url).await;
        finished.store(true, std::sync::atomic::Ordering::Relaxed);
        r
    };
    let (loaded, updates) = tokio::join!(work, updater);
    let wall = started.elapsed();
    svc.teardown().await;
    cluster.shutdown().await;
    let (answers, _) = loaded?;
    let tokens = answers.prompt + answers.completion;
    let done = answers.latencies;
    let updates = updates?;
    let n = updates.len();
    let mean = updates
        .iter()
        .map(Duration::as_secs_f64)
        .fold(0.0, |s, x| s + x)
        / n.max(1) as f64;
    let p = format!("rollout.update_{mode}");
    Ok(vec![
        (
            format!("{p}.tokens_per_s"),
            tokens as f64 / wall.as_secs_f64().max(1e-9),
        ),
        (
            format!("{p}.max_stall_ms"),
            max_stall(done).as_secs_f64() * 1e3,
        ),
        (format!("{p}.updates"), n as f64),
        (format!("{p}.update_s"), mean),
    ])
}

/// Runs every mode of `--update` in turn.
pub async fn run(
    a: &RolloutArgs,
    modes: &[String],
    every: Duration,
) -> Result<Vec<(String, f64)>, String> {
    if let Some(m) = modes
        .iter()
        .find(|m| !["all", "rolling"].contains(&m.as_str()))
    {
        return Err(format!("--update {m:?}: use all and/or rolling"));
    }
    let mut out = Vec::new();
    for m in modes {
        eprintln!("rollout: updates {m}");
        out.extend(run_mode(a, m, every).await?);
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_stall_is_the_slowest_sample_over_the_median() {
        let ms = Duration::from_millis;
        assert_eq!(max_stall(vec![ms(30), ms(10), ms(12)]), ms(18));
        assert_eq!(max_stall(Vec::new()), Duration::ZERO);
    }
}
