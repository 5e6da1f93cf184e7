//! `troupe bench agent`: multi-turn agent sessions through an in-process deployment of
//! reference engines (4 regular servers with the prefix cache on and a KV budget that cannot hold
//! every session at once), once per routing policy, on a fresh deployment each time.
//!
//! Each session is one episode: a first prompt, then `--turns` turns, each turn's prompt the
//! previous prompt plus its output plus a tool result of `--tool-tokens` tokens, as an agent
//! framework builds them. Every turn names its session (`X-Session-ID`). All sessions run at once;
//! a session's turns run one after the other. The engines' latency model paces them like GPU
//! servers (as `troupe bench rollout`'s). Figures, per policy `P`:
//! - `agent.P.tokens_per_s`: prompt plus completion tokens of every turn per second;
//! - `agent.P.cache_hit_rate`: prompt tokens served from a prefix cache / all prompt tokens;
//! - `agent.P.turn_p50_ms`, `agent.P.turn_p99_ms`: a turn's latency;
//! - `agent.<last>_vs_<P>.tokens_per_s_ratio` for every other policy `P` (and `vllm_router`):
//!   the last policy's throughput over theirs;
//! - with `--repeat N`, every figure is the median of N rounds (each round runs every policy
//!   and vllm-router once, in turn, so a slow spell of a shared machine hits all alike) and each
//!   ratio the median of the rounds' ratios;
//! - `agent.aborts_sent`, `agent.aborts_targeted`, `agent.aborts_reached`: after the last
//!   policy's sessions, `--aborts` long streamed requests (no id from the client: the gateway
//!   names each in `X-Request-Id`) are aborted by that id through the gateway, alternately in
//!   SGLang's words (`/abort_request {rid}`) and vLLM's (`/abort_requests {request_ids}`);
//!   targeted: the gateway sent the abort to the holding engine only; reached: the request's
//!   stream ended with the engine's `abort` finish before its token budget.

use std::time::{Duration, Instant};
use troupe_wire::Endpoint as _;
use troupe_wire::endpoints as ep;

use futures::StreamExt;
use serde_json::{Value, json};
use troupe_scheduler::AllocationPlan;
use troupe_serving::policy::PolicyKind;

/// Settings of the agent benchmark.
#[derive(Debug, Clone, clap::Args)]
pub struct AgentArgs {
    /// Sessions (episodes), all running at once.
    #[arg(long, default_value_t = 64, value_parser = clap::value_parser!(u64).range(1..=4096))]
    pub sessions: u64,
    /// Turns per session.
    #[arg(long, default_value_t = 10, value_parser = clap::value_parser!(u64).range(1..=100))]
    pub turns: u64,
    /// Tokens of the first prompt (bytes: the reference tokenizer is byte-level).
    #[arg(long, default_value_t = 256, value_parser = clap::value_parser!(u64).range(1..=2000))]
    pub prompt_tokens: u64,
    /// Tokens of the tool result appended after each turn's output.
    #[arg(long, default_value_t = 256, value_parser = clap::value_parser!(u64).range(0..=2000))]
    pub tool_tokens: u64,
    /// Tokens each turn generates.
    #[arg(long, default_value_t = 32, value_parser = clap::value_parser!(u64).range(1..=1000))]
    pub max_new_tokens: u64,
    /// Each server's KV pool in tokens (`--max-total-tokens`): the running requests' KV plus the
    /// prefix cache. The default holds about a quarter of the sessions' final prompts per server.
    #[arg(long, default_value_t = 32_768, value_parser = clap::value_parser!(u64).range(4096..=10_000_000))]
    pub kv_tokens: u64,
    /// Policies, each on a fresh deployment, comma-separated.
    #[arg(
        long,
        value_delimiter = ',',
        default_value = "cache_aware,sticky_least_loaded,kv_sticky"
    )]
    pub policy: Vec<String>,
    /// `kv_sticky`'s share: percent of each engine's KV pool its admitted sessions may fill
    /// at full context length (`router.kv_admission.pool_percent`).
    #[arg(long, default_value_t = 100, value_parser = clap::value_parser!(u32).range(1..=100))]
    pub kv_pool_percent: u32,
    /// Rounds; figures are medians over them.
    #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u64).range(1..=9))]
    pub repeat: u64,
    /// Latency model: prefill throughput per server, tokens/s.
    #[arg(long, default_value_t = 20_000.0)]
    pub sim_prefill_tokens_per_s: f64,
    /// Latency model: fixed cost of one decode step, ms.
    #[arg(long, default_value_t = 10.0)]
    pub sim_decode_step_ms: f64,
    /// Also run the workload through vllm-router's `sticky_least_loaded` (a separate process
    /// in front of the same kind of engines, started from this executable, e.g. the
    /// `vllm-router` of `pip install vllm-router==0.1.17`): figures `agent.vllm_router.*`.
    #[arg(long)]
    pub vllm_router: Option<String>,
    /// Long requests aborted by id through the gateway after the last policy's sessions.
    #[arg(long, default_value_t = 16, value_parser = clap::value_parser!(u64).range(0..=256))]
    pub aborts: u64,
    /// Print one JSON object instead of one line per figure.
    #[arg(long)]
    pub json: bool,
}

/// What the sessions go through.
#[derive(Debug, Clone)]
enum Via {
    /// Troupe's gateway with this policy.
    Gateway(PolicyKind),
    /// vllm-router (this executable) with its `sticky_least_loaded`.
    VllmRouter(String),
}

/// A router process started for one run; killed when dropped.
struct Peer(tokio::process::Child);

impl Drop for Peer {
    fn drop(&mut self) {
        let _ = self.0.start_kill();
    }
}

/// Starts vllm-router in front of `workers` and waits until it answers `/health`.
async fn start_vllm_router(bin: &str, workers: &[String]) -> Result<(Peer, String), String> {
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .map_err(|e| format!("cannot find a free port: {e}"))?
        .port();
    let mut cmd = tokio::process::Command::new(bin);
    cmd.args(["--host", "127.0.0.1", "--port", &port.to_string()])
        .arg("--worker-urls")
        .args(workers)
        .args(["--policy", "sticky_least_loaded", "--log-level", "warning"])
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .kill_on_drop(true);
    let child = cmd
        .spawn()
        .map_err(|e| format!("cannot start {bin}: {e}; give the vllm-router executable"))?;
    let peer = Peer(child);
    let url = format!("http://127.0.0.1:{port}");
    let client = troupe_controller::rollout::http_client();
    let deadline = Instant::now() + Duration::from_secs(120);
    loop {
        if let Ok(r) = client
            .get(format!("{url}{}", ep::Health::PATH))
            .send()
            .await
            && r.status().is_success()
        {
            return Ok((peer, url));
        }
        if Instant::now() > deadline {
            return Err(format!(
                "{bin} did not answer /health at {url} within 120 s"
            ));
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// Letters for session `s`'s text number `n` (its first prompt is 0, tool results follow),
/// different per session and turn.
fn text(s: u64, n: u64, len: u64) -> String {
    let seed = s.wrapping_mul(0x9E37_79B9_7F4A_7C15) ^ n.wrapping_mul(0xD1B5_4A32_D192_ED03);
    super::fixture::letters(seed, len)
}

/// What one session's turns added up to.
#[derive(Default)]
struct Totals {
    prompt: u64,
    completion: u64,
    cached: u64,
    turns_ms: Vec<f64>,
}

async fn session(
    a: &AgentArgs,
    client: &reqwest::Client,
    url: &str,
    s: u64,
) -> Result<Totals, String> {
    let mut prompt = text(s, 0, a.prompt_tokens);
    let mut t = Totals::default();
    for turn in 0..a.turns {
        let body = json!({
            "text": prompt,
            "sampling_params": {"max_new_tokens": a.max_new_tokens, "temperature": 1.0,
                                "ignore_eos": true, "sampling_seed": s * 1000 + turn},
        });
        let started = Instant::now();
        let r = client
            .post(format!("{url}{}", ep::Generate::PATH))
            .header("X-Session-ID", format!("agent-{s}"))
            .json(&body)
            .timeout(Duration::from_secs(600))
            .send()
            .await
            .map_err(|e| e.to_string())?;
        let status = r.status();
        let v: Value = r.json().await.map_err(|e| e.to_string())?;
        if !status.is_success() {
            return Err(format!("session {s} turn {turn}: {status}: {v}"));
        }
        t.turns_ms.push(started.elapsed().as_secs_f64() * 1e3);
        let (prompt_tokens, completion, cached) = super::fixture::token_counts(&v);
        t.prompt += prompt_tokens;
        t.completion += completion;
        t.cached += cached;
        // The next turn: this prompt, the output, a tool result.
        prompt.push_str(v["text"].as_str().unwrap_or(""));
        prompt.push_str(&text(s, turn + 1, a.tool_tokens));
    }
    Ok(t)
}

fn quantile(sorted: &[f64], q: f64) -> f64 {
    if sorted.is_empty() {
        return 0.0;
    }
    sorted[((sorted.len() - 1) as f64 * q).round() as usize]
}

/// The tokens an aborted request asks for: far more than it gets to make before its abort.
const ABORT_BUDGET: u64 = 3000;

/// One long streamed request aborted by id through the gateway at `url`: (targeted, reached).
async fn abort_one(client: &reqwest::Client, url: &str, i: u64) -> Result<(bool, bool), String> {
    let body = json!({"text": format!("abort {i}"), "stream": true,
                      "sampling_params": {"max_new_tokens": ABORT_BUDGET, "ignore_eos": true}});
    let r = client
        .post(format!("{url}{}", ep::Generate::PATH))
        .json(&body)
        .timeout(Duration::from_secs(600))
        .send()
        .await
        .map_err(|e| e.to_string())?;
    let id = r
        .headers()
        .get("x-request-id")
        .and_then(|h| h.to_str().ok())
        .map(str::to_string)
        .ok_or("the gateway named no request in X-Request-Id")?;
    let (path, abort) = if i.is_multiple_of(2) {
        (ep::AbortRequest::PATH, json!({"rid": id}))
    } else {
        (ep::AbortRequests::PATH, json!({"request_ids": [id]}))
    };
    let answer: Value = client
        .post(format!("{url}{path}"))
        .json(&abort)
        .send()
        .await
        .map_err(|e| e.to_string())?
        .json()
        .await
        .map_err(|e| e.to_string())?;
    let sse = r.text().await.map_err(|e| e.to_string())?;
    let last = sse
        .lines()
        .filter_map(|l| l.strip_prefix("data: "))
        .filter_map(|d| serde_json::from_str::<Value>(d).ok())
        .next_back()
        .unwrap_or(Value::Null);
    let reached = last.pointer("/meta_info/finish_reason/type") == Some(&json!("abort"))
        && last["meta_info"]["completion_tokens"]
            .as_u64()
            .is_some_and(|n| n < ABORT_BUDGET);
    Ok((answer["targeted"] == json!(true), reached))
}

async fn run_one(
    a: &AgentArgs,
    via: &Via,
    aborts: u64,
) -> Result<Vec<(&'static str, f64)>, String> {
    let plan = AllocationPlan::parse("troupe:d4t1").map_err(|e| e.to_string())?;
    let extra = vec![
        "--sim-prefill-tokens-per-s".into(),
        a.sim_prefill_tokens_per_s.to_string(),
        "--sim-decode-step-ms".into(),
        a.sim_decode_step_ms.to_string(),
        "--max-total-tokens".into(),
        a.kv_tokens.to_string(),
        "--max-running-requests".into(),
        "256".into(),
    ];
    // vllm-router is measured in front of the same engines; the gateway's policy then does not
    // matter (nothing goes through it).
    let policy = match via {
        Via::Gateway(p) => *p,
        Via::VllmRouter(_) => PolicyKind::default(),
    };
    let router = troupe_serving::RouterConfig {
        policy,
        prefill_policy: policy,
        decode_policy: policy,
        kv_admission: troupe_serving::policy::KvAdmitConfig {
            pool_percent: a.kv_pool_percent,
            ..Default::default()
        },
        ..Default::default()
    };
    let (cluster, svc) = super::fixture::deployment_with(&plan, extra, router).await?;
    let peer = match via {
        Via::Gateway(_) => Ok(None),
        Via::VllmRouter(bin) => {
            // The same backends as the gateway's: each server's DataProxy, as Troupe's gateway
            // reaches it (the hop costs CPU, so both pay it).
            let workers: Vec<String> = svc
                .servers()
                .into_iter()
                .map(|s| s.proxy_url.unwrap_or(s.info.url))
                .collect();
            start_vllm_router(bin, &workers).await.map(Some)
        }
    };
    let (peer, url) = match peer {
        Ok(Some((p, url))) => (Some(p), url),
        Ok(None) => (None, svc.gateway_url.clone()),
        Err(e) => {
            svc.teardown().await;
            cluster.shutdown().await;
            return Err(e);
        }
    };
    let client = Ok::<_, String>(troupe_controller::rollout::http_client());
    let started = Instant::now();
    let results: Vec<Result<Totals, String>> = match &client {
        Ok(c) => {
            futures::stream::iter(0..a.sessions)
                .map(|s| session(a, c, &url, s))
                .buffer_unordered(a.sessions as usize)
                .collect()
                .await
        }
        Err(e) => vec![Err(e.clone())],
    };
    let wall = started.elapsed().as_secs_f64().max(1e-9);
    let aborted: Vec<Result<(bool, bool), String>> = match &client {
        Ok(c) if aborts > 0 => {
            futures::future::join_all((0..aborts).map(|i| abort_one(c, &url, i))).await
        }
        _ => Vec::new(),
    };
    drop(peer);
    svc.teardown().await;
    cluster.shutdown().await;
    let mut all = Totals::default();
    for r in results {
        let r = r?;
        all.prompt += r.prompt;
        all.completion += r.completion;
        all.cached += r.cached;
        all.turns_ms.extend(r.turns_ms);
    }
    all.turns_ms.sort_by(f64::total_cmp);
    let (mut targeted, mut reached) = (0u64, 0u64);
    for r in &aborted {
        let (t, h) = r.clone()?;
        targeted += u64::from(t);
        reached += u64::from(h);
    }
    let mut figures = vec![
        ("tokens_per_s", (all.prompt + all.completion) as f64 / wall),
        (
            "cache_hit_rate",
            all.cached as f64 / all.prompt.max(1) as f64,
        ),
        ("turn_p50_ms", quantile(&all.turns_ms, 0.5)),
        ("turn_p99_ms", quantile(&all.turns_ms, 0.99)),
        ("wall_s", wall),
    ];
    if aborts > 0 {
        figures.push(("aborts_sent", aborts as f64));
        figures.push(("aborts_targeted", targeted as f64));
        figures.push(("aborts_reached", reached as f64));
    }
    Ok(figures)
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    quantile(&v, 0.5)
}

/// Runs `troupe bench agent`.
pub async fn run(a: &AgentArgs) -> Result<Vec<(String, f64)>, String> {
    for (v, flag) in [
        (a.sim_prefill_tokens_per_s, "--sim-prefill-tokens-per-s"),
        (a.sim_decode_step_ms, "--sim-decode-step-ms"),
    ] {
        if !(v.is_finite() && v >= 0.0) {
            return Err(format!("{flag} must be a finite number >= 0, got {v}"));
        }
    }
    let longest = a.prompt_tokens + a.turns * (a.max_new_tokens + a.tool_tokens);
    if longest > 4000 {
        return Err(format!(
            "a session's last prompt would hold {longest} tokens, past the reference model's 4096-token context; lower --turns, --tool-tokens or --max-new-tokens"
        ));
    }
    let mut runs: Vec<(String, Via)> = a
        .policy
        .iter()
        .map(|p| PolicyKind::parse(p).map(|k| (p.clone(), Via::Gateway(k))))
        .collect::<Result<_, _>>()
        .map_err(|e| format!("--policy: {e}"))?;
    if runs.is_empty() {
        return Err("--policy names no policy".into());
    }
    let last = runs.len() - 1;
    if let Some(bin) = &a.vllm_router {
        runs.push(("vllm_router".into(), Via::VllmRouter(bin.clone())));
    }
    // Per run, per figure: its value in each round (in the order the first round gave them).
    let mut seen: Vec<Vec<(&'static str, Vec<f64>)>> = vec![Vec::new(); runs.len()];
    for round in 0..a.repeat {
        for (i, (name, via)) in runs.iter().enumerate() {
            eprintln!("agent: {name} (round {} of {})", round + 1, a.repeat);
            let aborts = if i == last && round + 1 == a.repeat {
                a.aborts
            } else {
                0
            };
            for (k, v) in run_one(a, via, aborts).await? {
                match seen[i].iter_mut().find(|(n, _)| *n == k) {
                    Some((_, vs)) => vs.push(v),
                    None => seen[i].push((k, vec![v])),
                }
            }
        }
    }
    let tps = |i: usize| -> Vec<f64> {
        seen[i]
            .iter()
            .find(|(k, _)| *k == "tokens_per_s")
            .map_or_else(Vec::new, |(_, v)| v.clone())
    };
    let mut figures = Vec::new();
    for (i, (name, _)) in runs.iter().enumerate() {
        for (k, vs) in &seen[i] {
            let fig = if k.starts_with("aborts_") {
                format!("agent.{k}")
            } else {
                format!("agent.{name}.{k}")
            };
            figures.push((fig, median(vs.clone())));
        }
    }
    let ours = tps(last);
    for (i, (name, _)) in runs.iter().enumerate() {
        let theirs = tps(i);
        if i == last || theirs.len() != ours.len() || theirs.iter().any(|t| *t <= 0.0) {
            continue;
        }
        let ratios: Vec<f64> = ours.iter().zip(&theirs).map(|(o, t)| o / t).collect();
        figures.push((
            format!("agent.{}_vs_{name}.tokens_per_s_ratio", runs[last].0),
            median(ratios),
        ));
    }
    Ok(figures)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn each_session_and_turn_has_its_own_text() {
        assert_eq!(text(1, 0, 16), text(1, 0, 16));
        assert_ne!(text(1, 0, 16), text(2, 0, 16));
        assert_ne!(text(1, 0, 16), text(1, 1, 16));
        assert_eq!(text(3, 2, 40).len(), 40);
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_small_run_reports_every_figure_and_refuses_overlong_sessions() {
        let a = AgentArgs {
            sessions: 3,
            turns: 2,
            prompt_tokens: 16,
            tool_tokens: 8,
            max_new_tokens: 4,
            kv_tokens: 8192,
            policy: vec!["round_robin".into(), "kv_sticky".into()],
            sim_prefill_tokens_per_s: 0.0,
            sim_decode_step_ms: 1.0,
            vllm_router: None,
            aborts: 4,
            kv_pool_percent: 100,
            repeat: 1,
            json: false,
        };
        let figs = tokio::time::timeout(Duration::from_secs(120), run(&a))
            .await
            .expect("in time")
            .expect("runs");
        let names: Vec<&str> = figs.iter().map(|(n, _)| n.as_str()).collect();
        for p in ["round_robin", "kv_sticky"] {
            for f in [
                "tokens_per_s",
                "cache_hit_rate",
                "turn_p50_ms",
                "turn_p99_ms",
            ] {
                let n = format!("agent.{p}.{f}");
                assert!(names.contains(&n.as_str()), "{n} in {names:?}");
            }
        }
        let hit = figs
            .iter()
            .find(|(n, _)| n == "agent.kv_sticky.cache_hit_rate")
            .map(|(_, v)| *v)
            .unwrap_or(0.0);
        assert!(
            hit > 0.0,
            "a sticky session's second turn reuses its first's prefix"
        );
        let fig = |n: &str| figs.iter().find(|(k, _)| k == n).map(|(_, v)| *v);
        assert_eq!(fig("agent.aborts_sent"), Some(4.0));
        assert_eq!(fig("agent.aborts_targeted"), Some(4.0), "{figs:?}");
        assert_eq!(fig("agent.aborts_reached"), Some(4.0), "{figs:?}");
        let long = AgentArgs {
            turns: 100,
            tool_tokens: 2000,
            ..a
        };
        assert!(run(&long).await.unwrap_err().contains("--turns"));
    }
}
