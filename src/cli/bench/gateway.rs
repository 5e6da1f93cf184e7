//! `troupe bench gateway`: what the gateway adds to a request.
//!
//! Closed-loop load (`--concurrency` clients, `--requests` in all) against backends that
//! answer SGLang's `/generate` after a fixed latency, measured twice: straight to the backends
//! (client-side round robin), and through the target: by default an in-process gateway started
//! here, or any router given with `--target` (e.g. SGLang's `sglang-router`) that fronts the same
//! backends. The backends this command starts listen on `--backend-port-base`, `+1`, ... when
//! given (so an external router can be launched against them first), and `--register` adds them
//! to the target with `POST /workers`.
//!
//! Non-stream requests measure the whole request; `--stream` measures the time to the first
//! streamed event. Figures: `gateway.<direct|target>.<p50_ms|p99_ms|rps>` and
//! `gateway.added.<p50_ms|p99_ms>` (target minus direct), per concurrency as
//! `gateway.c<N>.…` when `--concurrency` lists several. CPU per request, which a shared machine
//! moves less than latency: `gateway.direct.cpu_us_per_req` (this process during the direct
//! run: the load generator's and the backends' cost of a request, which a proxy repeats, since
//! it is a server and a client in one) and `gateway.target.cpu_us_per_req` (the in-process
//! gateway's threads, or the `--target-pid` process). In a closed loop with more clients than
//! cores the latency a router adds is about `concurrency × its CPU per request / cores`.
//!
//! `--chat` also measures an agent turn: the in-process gateway gets the reference tokenizer and
//! the same load sends OpenAI chat completions through it (the gateway renders the chat template,
//! tokenizes, sends `/generate` with token ids, decodes and parses the answer):
//! `gateway.chat.<p50_ms|rps|cpu_us_per_req>` and `gateway.chat_vs_generate.cpu_ratio`, the
//! gateway's CPU per chat turn over its CPU per plain `/generate`, same run.
//!
//! Backends and the in-process gateway run on their own runtimes so the load generator does
//! not delay their timers.

use std::collections::HashMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};
use troupe_wire::Endpoint as _;
use troupe_wire::endpoints as ep;

use axum::body::Bytes;
use futures::StreamExt;
use serde_json::json;
use troupe_serving::gateway::{self, GatewayConfig};
use troupe_serving::health::HealthConfig;
use troupe_serving::listen::IO_THREAD_PREFIX;
use troupe_serving::policy::PolicyKind;
use troupe_serving::{RouterConfig, WorkerSpec};

use super::gateway_backends::{Side, runtime, start_backends};
use super::proc_cpu::{spent, thread_times};

/// Settings of the gateway benchmark.
#[derive(Debug, Clone, clap::Args)]
pub struct GatewayBenchArgs {
    /// Router URL to measure instead of an in-process gateway; it must front the backends this
    /// command starts (see --backend-port-base and --register).
    #[arg(long)]
    pub target: Option<String>,
    /// Clients in the closed loop; a list (`1,8,32`) measures each in turn, and the figures
    /// are then named `gateway.c<N>.…`.
    #[arg(long, value_delimiter = ',', default_value = "1,8,32", value_parser = clap::value_parser!(u64).range(1..=4096))]
    pub concurrency: Vec<u64>,
    /// Requests per measurement.
    #[arg(long, default_value_t = 2000, value_parser = clap::value_parser!(u64).range(10..=10_000_000))]
    pub requests: u64,
    /// Streamed requests: measure the time to the first event.
    #[arg(long)]
    pub stream: bool,
    /// Print one JSON object instead of one line per figure.
    #[arg(long)]
    pub json: bool,
    /// Fixed backend latency (to the answer, or to the first streamed event), in ms. The
    /// timer has 1 ms granularity; 0 answers at once (the cleanest `added` figure at low
    /// concurrency).
    #[arg(long, default_value_t = 5.0)]
    pub backend_latency_ms: f64,
    /// Number of fixed-latency backends.
    #[arg(long, default_value_t = 2, value_parser = clap::value_parser!(u64).range(1..=64))]
    pub backends: u64,
    /// First port of the backends (default: any free ports).
    #[arg(long)]
    pub backend_port_base: Option<u16>,
    /// Register the backends with --target via `POST /workers`.
    #[arg(long)]
    pub register: bool,
    /// Events per streamed answer.
    #[arg(long, default_value_t = 8, value_parser = clap::value_parser!(u64).range(1..=10_000))]
    pub stream_events: u64,
    /// How long to wait for --target to answer before giving up, in seconds.
    #[arg(long, default_value_t = 120)]
    pub target_wait_s: u64,
    /// Process id of the --target router on this machine: also report the CPU time it spent
    /// per request (`gateway.target.cpu_us_per_req`), the router's own cost whatever else
    /// shares the machine.
    #[arg(long)]
    pub target_pid: Option<u32>,
    /// Also measure chat completions served from token ids (the in-process gateway with the
    /// reference tokenizer) against plain `/generate`.
    #[arg(long)]
    pub chat: bool,
    /// With --chat: also run one recorded session of this many turns (at least 64) and report
    /// the gateway's CPU per turn over its first and last 32 turns, and a recorded turn's CPU
    /// over an unrecorded chat turn's (`gateway.session.*`).
    #[arg(long, default_value_t = 0)]
    pub session_turns: u64,
    /// With --session-turns: run that many sessions, one after another, and take each turn's
    /// median CPU over them (one session's figures swing with a shared machine's noise).
    #[arg(long, default_value_t = 5, value_parser = clap::value_parser!(u64).range(1..=100))]
    pub session_repeat: u64,
    /// With --session-turns: keep the session on disk here (`--session-dir` of `troupe
    /// gateway`), and report the bytes written per turn.
    #[arg(long)]
    pub session_dir: Option<std::path::PathBuf>,
    /// Serving threads of the in-process gateway (default: one per core, as `troupe gateway`).
    #[arg(long, value_parser = clap::value_parser!(u64).range(1..=1024))]
    pub io_threads: Option<u64>,
}

/// Seconds of CPU the router has used so far: the `--target-pid` process, or the in-process
/// gateway's I/O threads (named by [`troupe_serving::listen::serve_on_threads`]);
/// `Ok(None)` for a `--target` without a pid.
fn router_cpu(args: &GatewayBenchArgs) -> Result<Option<HashMap<String, u64>>, String> {
    match (&args.target, args.target_pid) {
        (_, Some(pid)) => thread_times(&pid.to_string(), None)
            .map(Some)
            .ok_or_else(|| format!("--target-pid {pid}: no such process in /proc")),
        (None, None) => Ok(thread_times("self", Some(IO_THREAD_PREFIX))),
        (Some(_), None) => Ok(None),
    }
}

fn client(concurrency: usize) -> Result<reqwest::Client, String> {
    reqwest::Client::builder()
        .tcp_nodelay(true)
        .no_proxy()
        .pool_max_idle_per_host(concurrency * 2)
        .timeout(Duration::from_secs(60))
        .build()
        .map_err(|e| e.to_string())
}

/// What the closed loop sends.
#[derive(Debug, Clone, Copy, PartialEq)]
enum Route {
    Generate,
    Chat,
}

fn chat_body() -> Bytes {
    Bytes::from(
        json!({"model": "tiny", "messages": [{"role": "user", "content": "benchmark prompt"}],
               "max_tokens": 8, "temperature": 0})
        .to_string(),
    )
}

fn body(stream: bool) -> Bytes {
    Bytes::from(
        json!({"text": "benchmark prompt", "sampling_params": {"max_new_tokens": 8, "temperature": 0}, "stream": stream})
            .to_string(),
    )
}

/// One request; returns the latency that counts (whole answer, or first streamed event).
async fn one(
    c: &reqwest::Client,
    url: &str,
    body: Bytes,
    stream: bool,
) -> Result<Duration, String> {
    let t0 = Instant::now();
    let r = c
        .post(url)
        .header("content-type", "application/json")
        .body(body)
        .send()
        .await
        .map_err(|e| format!("{url}: {e}"))?;
    if !r.status().is_success() {
        let st = r.status();
        return Err(format!(
            "{url}: {st}: {}",
            r.text().await.unwrap_or_default()
        ));
    }
    if !stream {
        r.bytes().await.map_err(|e| format!("{url}: {e}"))?;
        return Ok(t0.elapsed());
    }
    let mut s = r.bytes_stream();
    let mut first = None;
    while let Some(chunk) = s.next().await {
        let chunk = chunk.map_err(|e| format!("{url}: {e}"))?;
        if first.is_none() && chunk.windows(5).any(|w| w == b"data:") {
            first = Some(t0.elapsed());
        }
    }
    first.ok_or_else(|| format!("{url}: stream without events"))
}

struct Run {
    p50_ms: f64,
    p99_ms: f64,
    rps: f64,
}

fn pct(sorted: &[Duration], p: f64) -> f64 {
    if sorted.is_empty() {
        return 0.0;
    }
    let i = ((sorted.len() as f64 - 1.0) * p).round() as usize;
    sorted[i.min(sorted.len() - 1)].as_secs_f64() * 1e3
}

/// Closed loop over `urls` (round robin), `requests` in all.
async fn closed_loop(
    c: &reqwest::Client,
    urls: &[String],
    args: &GatewayBenchArgs,
    concurrency: u64,
    requests: usize,
    route: Route,
) -> Result<Run, String> {
    let next = Arc::new(AtomicUsize::new(0));
    let path = match route {
        Route::Generate => ep::Generate::PATH,
        Route::Chat => ep::ChatCompletions::PATH,
    };
    let urls: Arc<Vec<String>> = Arc::new(urls.iter().map(|u| format!("{u}{path}")).collect());
    let b = match route {
        Route::Generate => body(args.stream),
        Route::Chat => chat_body(),
    };
    let t0 = Instant::now();
    let workers = (0..concurrency).map(|_| {
        let (c, next, urls, b, stream) = (
            c.clone(),
            next.clone(),
            urls.clone(),
            b.clone(),
            args.stream,
        );
        tokio::spawn(async move {
            let mut lat = Vec::new();
            loop {
                let i = next.fetch_add(1, Ordering::Relaxed);
                if i >= requests {
                    return Ok::<_, String>(lat);
                }
                lat.push(one(&c, &urls[i % urls.len()], b.clone(), stream).await?);
            }
        })
    });
    let mut all = Vec::with_capacity(requests);
    for w in futures::future::join_all(workers).await {
        all.extend(w.map_err(|e| e.to_string())??);
    }
    let wall = t0.elapsed().as_secs_f64();
    all.sort_unstable();
    Ok(Run {
        p50_ms: pct(&all, 0.5),
        p99_ms: pct(&all, 0.99),
        rps: all.len() as f64 / wall.max(1e-9),
    })
}

async fn wait_for(c: &reqwest::Client, url: &str, stream: bool, secs: u64) -> Result<(), String> {
    let deadline = Instant::now() + Duration::from_secs(secs);
    loop {
        match one(
            c,
            &format!("{url}{}", ep::Generate::PATH),
            body(stream),
            stream,
        )
        .await
        {
            Ok(_) => return Ok(()),
            Err(e) if Instant::now() >= deadline => {
                return Err(format!("target never answered: {e}"));
            }
            Err(_) => tokio::time::sleep(Duration::from_millis(200)).await,
        }
    }
}

async fn register(c: &reqwest::Client, target: &str, backends: &[String]) -> Result<(), String> {
    for b in backends {
        let r = c
            .post(format!("{target}{}", ep::Workers::PATH))
            .json(&json!({"url": b, "worker_type": "regular"}))
            .send()
            .await
            .map_err(|e| format!("POST {target}/workers: {e}"))?;
        if !r.status().is_success() {
            return Err(format!("POST {target}/workers {b}: {}", r.status()));
        }
    }
    Ok(())
}

/// Direct and through-the-target runs at one concurrency; figures under `prefix`.
#[allow(clippy::too_many_arguments)]
async fn measure(
    c: &reqwest::Client,
    urls: &[String],
    target: &str,
    args: &GatewayBenchArgs,
    conc: u64,
    prefix: &str,
    out: &mut Vec<(String, f64)>,
) -> Result<(), String> {
    let warm = (conc as usize * 4).min(args.requests as usize);
    let n = args.requests as usize;
    let target = [target.to_string()];
    let per_req = |secs: f64| secs * 1e6 / n.max(1) as f64;
    let g = Route::Generate;
    closed_loop(c, urls, args, conc, warm, g).await?;
    let own0 = thread_times("self", None);
    let direct = closed_loop(c, urls, args, conc, n, g).await?;
    let direct_cpu = own0
        .zip(thread_times("self", None))
        .map(|(a, b)| per_req(spent(&a, &b)));
    closed_loop(c, &target, args, conc, warm, g).await?;
    let router0 = router_cpu(args)?;
    let through = closed_loop(c, &target, args, conc, n, g).await?;
    let target_cpu = router0
        .zip(router_cpu(args)?)
        .map(|(a, b)| per_req(spent(&a, &b)));
    for (name, r) in [("direct", &direct), ("target", &through)] {
        out.push((format!("{prefix}.{name}.p50_ms"), r.p50_ms));
        out.push((format!("{prefix}.{name}.p99_ms"), r.p99_ms));
        out.push((format!("{prefix}.{name}.rps"), r.rps));
    }
    out.push((
        format!("{prefix}.added.p50_ms"),
        through.p50_ms - direct.p50_ms,
    ));
    out.push((
        format!("{prefix}.added.p99_ms"),
        through.p99_ms - direct.p99_ms,
    ));
    if let Some(us) = direct_cpu {
        out.push((format!("{prefix}.direct.cpu_us_per_req"), us));
    }
    if let Some(us) = target_cpu {
        out.push((format!("{prefix}.target.cpu_us_per_req"), us));
    }
    if args.chat {
        closed_loop(c, &target, args, conc, warm, Route::Chat).await?;
        let before = router_cpu(args)?;
        let chat = closed_loop(c, &target, args, conc, n, Route::Chat).await?;
        let chat_cpu = before
            .zip(router_cpu(args)?)
            .map(|(a, b)| per_req(spent(&a, &b)));
        out.push((format!("{prefix}.chat.p50_ms"), chat.p50_ms));
        out.push((format!("{prefix}.chat.rps"), chat.rps));
        if let Some(us) = chat_cpu {
            out.push((format!("{prefix}.chat.cpu_us_per_req"), us));
            if let Some(plain) = target_cpu.filter(|p| *p > 0.0) {
                out.push((format!("{prefix}.chat_vs_generate.cpu_ratio"), us / plain));
            }
        }
        if args.session_turns > 0 {
            let cpu = || router_cpu(args);
            super::gateway_session::measure(c, &target[0], args, prefix, chat_cpu, cpu, out)
                .await?;
        }
    }
    Ok(())
}

/// Runs the benchmark; returns the figures.
pub async fn run(args: &GatewayBenchArgs) -> Result<Vec<(String, f64)>, String> {
    if !(args.backend_latency_ms.is_finite() && args.backend_latency_ms >= 0.0) {
        return Err("--backend-latency-ms must be a non-negative number".into());
    }
    if args.session_turns > 0 && !args.chat {
        return Err("--session-turns measures recorded chat turns: add --chat".into());
    }
    if args.chat && (args.target.is_some() || args.stream) {
        return Err(
            "--chat measures the in-process gateway's chat path: drop --target and --stream".into(),
        );
    }
    let (_backends, urls) = start_backends(args).await?;
    let most = args.concurrency.iter().copied().max().unwrap_or(1);
    let c = client(most as usize)?;
    let mut _gw_side = None;
    let target = match &args.target {
        Some(t) => {
            let t = t.trim_end_matches('/').to_string();
            if args.register {
                register(&c, &t, &urls).await?;
            }
            t
        }
        None => {
            // The gateway serves on threads of its own, as many as `troupe gateway` starts;
            // its runtime here only starts it and probes health.
            let rt = runtime(1, "bench-gateway")?;
            let cfg = GatewayConfig {
                io_threads: args
                    .io_threads
                    .map_or_else(crate::cli::gateway::default_io_threads, |n| n as usize),
                workers: urls.iter().map(WorkerSpec::regular).collect(),
                router: RouterConfig {
                    policy: PolicyKind::RoundRobin,
                    health: HealthConfig {
                        interval: Duration::ZERO,
                        ..Default::default()
                    },
                    ..Default::default()
                },
                agent: if args.chat {
                    let o = troupe_controller::serve::agent_spec::AgentOptions {
                        tokenizer: Some("reference".into()),
                        session_dir: args.session_dir.clone(),
                        ..Default::default()
                    };
                    troupe_controller::serve::agent_spec::agent_spec(&o, |k| format!("--{k}"))?
                } else {
                    None
                },
                ..Default::default()
            };
            let handle = rt
                .spawn(gateway::start(cfg))
                .await
                .map_err(|e| e.to_string())?
                .map_err(|e| format!("gateway: {e}"))?;
            let url = handle.url();
            // The handle lives (and the gateway serves) as long as its runtime.
            rt.spawn(async move {
                futures::future::pending::<()>().await;
                drop(handle);
            });
            _gw_side = Some(Side { rt: Some(rt) });
            url
        }
    };
    wait_for(&c, &target, args.stream, args.target_wait_s).await?;
    let mut out = Vec::new();
    for &conc in &args.concurrency {
        let prefix = if args.concurrency.len() > 1 {
            format!("gateway.c{conc}")
        } else {
            "gateway".to_string()
        };
        measure(&c, &urls, &target, args, conc, &prefix, &mut out).await?;
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn small(concurrency: Vec<u64>, requests: u64) -> GatewayBenchArgs {
        GatewayBenchArgs {
            target: None,
            concurrency,
            requests,
            stream: false,
            json: false,
            backend_latency_ms: 1.0,
            backends: 2,
            backend_port_base: None,
            register: false,
            stream_events: 3,
            target_wait_s: 10,
            target_pid: None,
            io_threads: Some(2),
            chat: false,
            session_turns: 0,
            session_repeat: 1,
            session_dir: None,
        }
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn chat_turns_are_measured_beside_plain_generates() {
        let a = GatewayBenchArgs {
            chat: true,
            ..small(vec![2], 20)
        };
        let figs = tokio::time::timeout(Duration::from_secs(60), run(&a))
            .await
            .expect("in time")
            .expect("runs");
        let get = |n: &str| figs.iter().find(|(k, _)| k == n).map(|(_, v)| *v);
        assert!(get("gateway.chat.rps").is_some_and(|r| r > 0.0), "{figs:?}");
        assert!(
            get("gateway.chat.cpu_us_per_req").is_some_and(|c| c > 0.0),
            "{figs:?}"
        );
        assert!(
            get("gateway.chat_vs_generate.cpu_ratio").is_some(),
            "{figs:?}"
        );
        let bad = GatewayBenchArgs { stream: true, ..a };
        assert!(run(&bad).await.unwrap_err().contains("--chat"));
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_recorded_session_is_measured_turn_by_turn() {
        let dir = tempfile::tempdir().unwrap();
        let a = GatewayBenchArgs {
            chat: true,
            session_turns: 64,
            session_repeat: 2,
            session_dir: Some(dir.path().to_path_buf()),
            ..small(vec![1], 10)
        };
        let figs = tokio::time::timeout(Duration::from_secs(120), run(&a))
            .await
            .expect("in time")
            .expect("runs");
        let get = |n: &str| figs.iter().find(|(k, _)| k == n).map(|(_, v)| *v);
        for name in [
            "gateway.session.first32.cpu_us_per_turn",
            "gateway.session.last32.cpu_us_per_turn",
            "gateway.session.last_vs_first.cpu_ratio",
            "gateway.session.recorded_vs_chat.cpu_ratio",
            "gateway.session.bytes_per_turn",
        ] {
            assert!(get(name).is_some_and(|v| v > 0.0), "{name}: {figs:?}");
        }
        let no_chat = GatewayBenchArgs { chat: false, ..a };
        assert!(run(&no_chat).await.unwrap_err().contains("--chat"));
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn in_process_run_reports_every_figure() {
        let args = small(vec![4], 40);
        for stream in [false, true] {
            let a = GatewayBenchArgs {
                stream,
                ..args.clone()
            };
            let figs = tokio::time::timeout(Duration::from_secs(60), run(&a))
                .await
                .expect("in time")
                .expect("runs");
            let names: Vec<&str> = figs.iter().map(|(n, _)| n.as_str()).collect();
            assert_eq!(
                names,
                [
                    "gateway.direct.p50_ms",
                    "gateway.direct.p99_ms",
                    "gateway.direct.rps",
                    "gateway.target.p50_ms",
                    "gateway.target.p99_ms",
                    "gateway.target.rps",
                    "gateway.added.p50_ms",
                    "gateway.added.p99_ms",
                    "gateway.direct.cpu_us_per_req",
                    "gateway.target.cpu_us_per_req"
                ]
            );
            for (n, v) in &figs {
                assert!(v.is_finite(), "{n}");
            }
            // Both sides did work for every request: the gateway's own threads included.
            assert!(figs[8].1 > 0.0 && figs[9].1 > 0.0, "{figs:?}");
            assert!(
                figs[0].1 >= 1.0,
                "the backend latency is part of every request"
            );
        }
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_concurrency_list_reports_each_under_its_own_name() {
        let args = small(vec![1, 4], 20);
        let figs = tokio::time::timeout(Duration::from_secs(60), run(&args))
            .await
            .expect("in time")
            .expect("runs");
        for c in [1, 4] {
            for f in ["direct.rps", "target.rps", "added.p50_ms", "added.p99_ms"] {
                let name = format!("gateway.c{c}.{f}");
                assert!(
                    figs.iter().any(|(n, v)| *n == name && v.is_finite()),
                    "{name}"
                );
            }
        }
        assert_eq!(figs.len(), 20);
    }
}
