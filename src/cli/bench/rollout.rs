//! `troupe bench rollout`: GRPO-shaped load (each prompt sampled `--group` times, all at once)
//! through an in-process deployment of reference engines whose latency model paces them like
//! GPU servers, once per routing configuration, on a fresh deployment each time.
//!
//! Configurations: `baseline` (round robin, prefix cache off: every sample prefills its whole
//! prompt) and each `--policy` with the prefix cache on. With several `--layout`s each layout
//! runs every configuration. Figures, per configuration `C` (prefixed `rollout.<layout>.` when
//! several layouts run, else `rollout.`):
//! - `C.tokens_per_s`: prompt plus completion tokens of finished samples per second;
//! - `C.cache_hit_rate`: prompt tokens served from a prefix cache / all prompt tokens (from the
//!   answers' `meta_info.cached_tokens`);
//! - `C.prefill_computed_tokens`, `C.prefill_cached_tokens`: prompt KV computed vs copied from
//!   the cache on prefill (or regular) servers;
//! - `C.kv_received_tokens`, `C.kv_local_tokens`: PD decode servers' prompt KV received from
//!   prefills vs taken from their own cache;
//! - `rollout.<layout>.tokens_per_s` (the last configuration on that layout) and
//!   `rollout.speedup` (last configuration over baseline, first layout).

use std::time::{Duration, Instant};

use futures::StreamExt;
use serde_json::{Value, json};
use troupe_controller::serve::Deployment;
use troupe_scheduler::AllocationPlan;
use troupe_serving::policy::PolicyKind;
use troupe_wire::Endpoint as _;

/// Settings of the rollout benchmark.
#[derive(Debug, Clone, clap::Args)]
pub struct RolloutArgs {
    /// Tokens per prompt (bytes: the reference tokenizer is byte-level).
    #[arg(long, default_value_t = 512, value_parser = clap::value_parser!(u64).range(1..=3000))]
    pub prompt_tokens: u64,
    /// Samples per prompt (a GRPO group), sent together.
    #[arg(long, default_value_t = 16, value_parser = clap::value_parser!(u64).range(1..=256))]
    pub group: u64,
    /// Prompts (groups) per configuration.
    #[arg(long, default_value_t = 16, value_parser = clap::value_parser!(u64).range(1..=10_000))]
    pub groups: u64,
    /// Groups in flight at once.
    #[arg(long, default_value_t = 4, value_parser = clap::value_parser!(u64).range(1..=256))]
    pub concurrency: u64,
    /// Tokens per completion.
    #[arg(long, default_value_t = 16, value_parser = clap::value_parser!(u64).range(1..=1000))]
    pub max_new_tokens: u64,
    /// Policies to run with the prefix cache on (after the baseline).
    #[arg(long, value_delimiter = ',', default_value = "cache_aware")]
    pub policy: Vec<String>,
    /// `pd` (2 prefill + 2 decode) and/or `regular` (4 regular servers), comma-separated.
    #[arg(long, value_delimiter = ',', default_value = "pd")]
    pub layout: Vec<String>,
    /// Skip the baseline (round robin, no prefix cache).
    #[arg(long)]
    pub no_baseline: bool,
    /// Latency model: prefill throughput per server, tokens/s.
    #[arg(long, default_value_t = 20_000.0)]
    pub sim_prefill_tokens_per_s: f64,
    /// Latency model: fixed cost of one decode step, ms.
    #[arg(long, default_value_t = 10.0)]
    pub sim_decode_step_ms: f64,
    /// Latency model: extra decode step cost per running request, ms.
    #[arg(long, default_value_t = 0.05)]
    pub sim_decode_per_seq_ms: f64,
    /// Instead of the routing configurations: push new weights every `--update-every-s`
    /// while the rollouts run, stop-the-world (`all`) and/or `rolling`, comma-separated
    /// (`rollout.update_<mode>.tokens_per_s`, `.max_stall_ms`; see `rollout_update.rs`).
    #[arg(long, value_delimiter = ',')]
    pub update: Vec<String>,
    /// Seconds between weight pushes with `--update`.
    #[arg(long, default_value_t = 2.0)]
    pub update_every_s: f64,
    /// Latency model with `--update`: seconds each engine takes to load an update's weights
    /// (`troupe engine --sim-weight-load-s`), as a GPU server loading a large model does; the
    /// tiny model's own load takes milliseconds.
    #[arg(long, default_value_t = 1.0)]
    pub sim_weight_load_s: f64,
    /// Print one JSON object instead of one line per figure.
    #[arg(long)]
    pub json: bool,
}

/// One routing configuration.
struct Config {
    name: String,
    policy: PolicyKind,
    cache: bool,
}

pub(super) fn plan_for(layout: &str) -> Result<AllocationPlan, String> {
    let spec = match layout {
        "pd" => "troupe:(prefill:d2t1|decode:d2t1)",
        "regular" => "troupe:d4t1",
        other => return Err(format!("--layout {other:?}: use pd or regular")),
    };
    AllocationPlan::parse(spec).map_err(|e| e.to_string())
}

/// A prompt of `n` lowercase letters, different per group.
fn prompt(group: u64, n: u64) -> String {
    super::fixture::letters(group.wrapping_mul(0x9E37_79B9_7F4A_7C15), n)
}

/// Totals over the answers of one run.
#[derive(Default)]
pub(super) struct Answers {
    pub(super) prompt: u64,
    pub(super) completion: u64,
    cached: u64,
    /// How long each sample took, send to answer.
    pub(super) latencies: Vec<Duration>,
}

/// Runs the GRPO-shaped load through `url`: the answers' totals and the wall time.
pub(super) async fn load(a: &RolloutArgs, url: &str) -> Result<(Answers, Duration), String> {
    let client = troupe_controller::rollout::http_client();
    let started = Instant::now();
    let results: Vec<Result<Answers, String>> = futures::stream::iter(0..a.groups)
        .map(|g| {
            let (client, text) = (client.clone(), prompt(g, a.prompt_tokens));
            async move {
                let samples = (0..a.group).map(|i| {
                    let body = json!({
                        "text": text,
                        "sampling_params": {"max_new_tokens": a.max_new_tokens,
                                            "temperature": 1.0, "ignore_eos": true,
                                            "sampling_seed": g * 1000 + i},
                    });
                    let client = client.clone();
                    async move {
                        let t0 = Instant::now();
                        let r = client
                            .post(format!("{url}{}", troupe_wire::endpoints::Generate::PATH))
                            .json(&body)
                            .timeout(Duration::from_secs(300))
                            .send()
                            .await
                            .map_err(|e| e.to_string())?;
                        let status = r.status();
                        let v: Value = r.json().await.map_err(|e| e.to_string())?;
                        if !status.is_success() {
                            return Err(format!("{status}: {v}"));
                        }
                        let (prompt, completion, cached) = super::fixture::token_counts(&v);
                        Ok(Answers {
                            prompt,
                            completion,
                            cached,
                            latencies: vec![t0.elapsed()],
                        })
                    }
                });
                let mut sum = Answers::default();
                for r in futures::future::join_all(samples).await {
                    let r = r?;
                    sum.prompt += r.prompt;
                    sum.completion += r.completion;
                    sum.cached += r.cached;
                    sum.latencies.extend(r.latencies);
                }
                Ok(sum)
            }
        })
        .buffer_unordered(a.concurrency as usize)
        .collect()
        .await;
    let wall = started.elapsed();
    let mut total = Answers::default();
    for r in results {
        let r = r?;
        total.prompt += r.prompt;
        total.completion += r.completion;
        total.cached += r.cached;
        total.latencies.extend(r.latencies);
    }
    Ok((total, wall))
}

/// The engines' flags: the latency model's pacing and room for a whole GRPO wave.
pub(super) fn engine_args(a: &RolloutArgs) -> Vec<String> {
    vec![
        "--sim-prefill-tokens-per-s".to_string(),
        a.sim_prefill_tokens_per_s.to_string(),
        "--sim-decode-step-ms".into(),
        a.sim_decode_step_ms.to_string(),
        "--sim-decode-per-seq-ms".into(),
        a.sim_decode_per_seq_ms.to_string(),
        "--max-running-requests".into(),
        "256".into(),
    ]
}

/// Sums an `internal_states` counter over the servers of one kind.
async fn server_counter(svc: &Deployment, kinds: &[&str], key: &str) -> u64 {
    let client = troupe_controller::rollout::http_client();
    let mut sum = 0;
    for s in svc.servers() {
        if !kinds.contains(&s.info.worker_type.as_str()) {
            continue;
        }
        let Ok(r) = client
            .get(format!("{}/server_info", s.info.url))
            .send()
            .await
        else {
            continue;
        };
        let v: Value = r.json().await.unwrap_or_default();
        sum += v["internal_states"][0][key].as_u64().unwrap_or(0);
    }
    sum
}

async fn run_one(
    a: &RolloutArgs,
    layout: &str,
    c: &Config,
) -> Result<Vec<(&'static str, f64)>, String> {
    let plan = plan_for(layout)?;
    let mut extra = engine_args(a);
    if !c.cache {
        extra.push("--disable-radix-cache".into());
    }
    let (cluster, svc) = super::fixture::deployment(&plan, extra, c.policy).await?;
    let out = load(a, &svc.gateway_url).await;
    let counters = match &out {
        Ok(_) => Some((
            server_counter(
                &svc,
                &["prefill", "regular"],
                "prefill_computed_tokens_total",
            )
            .await,
            server_counter(&svc, &["prefill", "regular"], "cached_tokens_total").await,
            server_counter(&svc, &["decode"], "kv_received_tokens_total").await,
            server_counter(&svc, &["decode"], "kv_local_tokens_total").await,
        )),
        Err(_) => None,
    };
    svc.teardown().await;
    cluster.shutdown().await;
    let (ans, wall) = out?;
    let (computed, cached, received, local) = counters.unwrap_or_default();
    Ok(vec![
        (
            "tokens_per_s",
            (ans.prompt + ans.completion) as f64 / wall.as_secs_f64().max(1e-9),
        ),
        (
            "cache_hit_rate",
            ans.cached as f64 / ans.prompt.max(1) as f64,
        ),
        ("prefill_computed_tokens", computed as f64),
        ("prefill_cached_tokens", cached as f64),
        ("kv_received_tokens", received as f64),
        ("kv_local_tokens", local as f64),
        ("wall_s", wall.as_secs_f64()),
    ])
}

/// Runs `troupe bench rollout`.
pub async fn run(a: &RolloutArgs) -> Result<Vec<(String, f64)>, String> {
    for (v, flag) in [
        (a.sim_prefill_tokens_per_s, "--sim-prefill-tokens-per-s"),
        (a.sim_decode_step_ms, "--sim-decode-step-ms"),
        (a.sim_decode_per_seq_ms, "--sim-decode-per-seq-ms"),
    ] {
        if !(v.is_finite() && v >= 0.0) {
            return Err(format!("{flag} must be a finite number >= 0, got {v}"));
        }
    }
    for l in &a.layout {
        plan_for(l)?;
    }
    if !a.update.is_empty() {
        if !(a.update_every_s.is_finite() && a.update_every_s > 0.0 && a.update_every_s <= 3600.0) {
            return Err(format!(
                "--update-every-s must be a number of seconds in (0, 3600], got {}",
                a.update_every_s
            ));
        }
        let every = Duration::from_secs_f64(a.update_every_s);
        return super::rollout_update::run(a, &a.update, every).await;
    }
    let mut configs = Vec::new();
    if !a.no_baseline {
        configs.push(Config {
            name: "baseline".into(),
            policy: PolicyKind::RoundRobin,
            cache: false,
        });
    }
    for p in &a.policy {
        let policy = PolicyKind::parse(p).map_err(|e| format!("--policy: {e}"))?;
        configs.push(Config {
            name: p.clone(),
            policy,
            cache: true,
        });
    }
    if configs.is_empty() {
        return Err("nothing to run: --no-baseline with an empty --policy".into());
    }
    let several = a.layout.len() > 1;
    let mut figures = Vec::new();
    let mut first_layout: Option<(f64, f64)> = None;
    for layout in &a.layout {
        let mut baseline = None;
        let mut last = 0.0;
        for c in &configs {
            eprintln!("rollout: {layout} / {}", c.name);
            let figs = run_one(a, layout, c).await?;
            let prefix = if several {
                format!("rollout.{layout}.{}", c.name)
            } else {
                format!("rollout.{}", c.name)
            };
            for (k, v) in &figs {
                figures.push((format!("{prefix}.{k}"), *v));
            }
            let tps = figs
                .iter()
                .find(|(k, _)| *k == "tokens_per_s")
                .map_or(0.0, |(_, v)| *v);
            if c.name == "baseline" {
                baseline = Some(tps);
            }
            last = tps;
        }
        figures.push((format!("rollout.{layout}.tokens_per_s"), last));
        if first_layout.is_none()
            && let Some(b) = baseline
        {
            first_layout = Some((b, last));
        }
    }
    if let Some((b, last)) = first_layout
        && b > 0.0
    {
        figures.push(("rollout.speedup".into(), last / b));
    }
    Ok(figures)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn prompts_differ_per_group_and_have_the_asked_length() {
        assert_eq!(prompt(0, 512).len(), 512);
        assert_ne!(prompt(0, 64), prompt(1, 64));
        assert_eq!(prompt(3, 64), prompt(3, 64));
    }
}
