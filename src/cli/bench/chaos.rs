//! `troupe bench chaos`: steady load through the gateway while a random server is killed
//! (SIGKILL) every few seconds; reports requests sent, answered, retried and lost.
//!
//! Lost means a client got no answer. The gateway's retries (a new prefill/decode pair after a
//! transport error) and the serving watcher (a dead server leaves the router at once and is
//! routed again after its restart) are what keep it at zero; the report shows how much
//! retrying that took. With `--scale`, servers are also added and removed under the load
//! (`chaos/scale.rs`): `chaos.scaled_up`, `chaos.scaled_down`.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use serde_json::json;
use troupe_scheduler::AllocationPlan;
use troupe_wire::Endpoint as _;
use troupe_wire::endpoints as ep;

use troupe_controller::Cluster;
use troupe_controller::serve::{Deployment, ForkOptions};

mod scale;

/// Settings of a chaos run.
#[derive(Debug, Clone, clap::Args)]
pub struct ChaosArgs {
    /// Allocation of the in-process deployment under test.
    #[arg(long, default_value = "troupe:(prefill:d2t1|decode:d2t1)")]
    pub allocation: String,
    /// Seconds of load.
    #[arg(long, default_value_t = 60.0)]
    pub duration_s: f64,
    /// Seconds between kills.
    #[arg(long, default_value_t = 3.0)]
    pub kill_every_s: f64,
    /// Clients sending requests back to back.
    #[arg(long, default_value_t = 8, value_parser = clap::value_parser!(u64).range(1..=1024))]
    pub concurrency: u64,
    /// Tokens per answer.
    #[arg(long, default_value_t = 16, value_parser = clap::value_parser!(u64).range(1..=4096))]
    pub max_new_tokens: u64,
    /// Seed of the victim choice (default: from the clock; printed either way).
    #[arg(long)]
    pub seed: Option<u64>,
    /// Also add and remove servers under the load (alternating, every `--scale-every-s`).
    #[arg(long)]
    pub scale: bool,
    /// Seconds between adding or removing a server (with `--scale`).
    #[arg(long, default_value_t = 4.0)]
    pub scale_every_s: f64,
    /// Print one JSON object instead of one line per figure.
    #[arg(long)]
    pub json: bool,
}

/// What a chaos run counted.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ChaosReport {
    /// Requests sent.
    pub sent: u64,
    /// Requests answered with a success status.
    pub answered: u64,
    /// Attempts the gateway retried on another worker or pair.
    pub retried: u64,
    /// Requests that got an error or no answer.
    pub lost: u64,
    /// Servers killed.
    pub kills: u64,
    /// Servers added and routed under the load (`--scale`).
    pub scaled_up: u64,
    /// Servers drained and stopped under the load (`--scale`).
    pub scaled_down: u64,
    /// The first few errors clients saw (empty when nothing was lost).
    pub errors: Vec<String>,
    /// Adds or removals that failed (`--scale`: no free GPU, a server that did not start).
    pub scale_errors: Vec<String>,
}

impl ChaosReport {
    /// The report as `chaos.*` figures.
    pub fn figures(&self) -> Vec<(String, f64)> {
        [
            ("chaos.sent", self.sent),
            ("chaos.answered", self.answered),
            ("chaos.retried", self.retried),
            ("chaos.lost", self.lost),
            ("chaos.kills", self.kills),
            ("chaos.scaled_up", self.scaled_up),
            ("chaos.scaled_down", self.scaled_down),
        ]
        .into_iter()
        .map(|(k, v)| (k.to_string(), v as f64))
        .collect()
    }
}

/// xorshift64*: enough to pick victims reproducibly from a printed seed.
fn next(state: &mut u64) -> u64 {
    *state ^= *state >> 12;
    *state ^= *state << 25;
    *state ^= *state >> 27;
    state.wrapping_mul(0x2545_F491_4F6C_DD1D)
}

async fn gateway_retries(client: &reqwest::Client, gateway: &str) -> u64 {
    let Ok(r) = client.get(format!("{gateway}/metrics")).send().await else {
        return 0;
    };
    let text = r.text().await.unwrap_or_default();
    text.lines()
        .find_map(|l| l.strip_prefix("troupe_gateway_retries_total "))
        .and_then(|v| v.trim().parse().ok())
        .unwrap_or(0)
}

/// Load through `svc`'s gateway for `duration`, killing a random routed server every
/// `kill_every` (only one whose kind keeps another server routed, so a kill is a fault to
/// survive, not an outage).
pub async fn run_chaos(
    svc: &Deployment,
    duration: Duration,
    kill_every: Duration,
    concurrency: u64,
    max_new_tokens: u64,
    seed: u64,
) -> ChaosReport {
    run_chaos_scaled(
        svc,
        duration,
        kill_every,
        None,
        concurrency,
        max_new_tokens,
        seed,
    )
    .await
}

/// [`run_chaos`], and with `scale_every` a server added or removed that often (alternating;
/// the deployment needs a free GPU for the adds).
pub async fn run_chaos_scaled(
    svc: &Deployment,
    duration: Duration,
    kill_every: Duration,
    scale_every: Option<Duration>,
    concurrency: u64,
    max_new_tokens: u64,
    seed: u64,
) -> ChaosReport {
    let client = troupe_controller::rollout::http_client();
    let sent = Arc::new(AtomicU64::new(0));
    let answered = Arc::new(AtomicU64::new(0));
    let errors = Arc::new(std::sync::Mutex::new(Vec::<String>::new()));
    let retries_before = gateway_retries(&client, &svc.gateway_url).await;
    let deadline = Instant::now() + duration;
    let clients = (0..concurrency).map(|c| {
        let (client, url) = (client.clone(), svc.gateway_url.clone());
        let (sent, answered, errors) = (sent.clone(), answered.clone(), errors.clone());
        async move {
            let mut i = 0u64;
            while Instant::now() < deadline {
                i += 1;
                sent.fetch_add(1, Ordering::Relaxed);
                let body = json!({
                    "text": format!("chaos client {c} request {i}: "),
                    "sampling_params": {"max_new_tokens": max_new_tokens, "temperature": 0.0},
                });
                let r = client
                    .post(format!("{url}{}", ep::Generate::PATH))
                    .json(&body)
                    .timeout(Duration::from_secs(60))
                    .send()
                    .await;
                let outcome = match r {
                    Ok(r) if r.status().is_success() => match r.bytes().await {
                        Ok(_) => Ok(()),
                        Err(e) => Err(format!("body: {e}")),
                    },
                    Ok(r) => {
                        let s = r.status();
                        Err(format!("{s}: {}", r.text().await.unwrap_or_default()))
                    }
                    Err(e) => Err(format!("transport: {e}")),
                };
                match outcome {
                    Ok(()) => {
                        answered.fetch_add(1, Ordering::Relaxed);
                    }
                    Err(e) => {
                        let mut errs = errors.lock().unwrap_or_else(|p| p.into_inner());
                        if errs.len() < 10 {
                            errs.push(e);
                        }
                    }
                }
            }
        }
    });
    let mut state = seed.max(1);
    let mut scale_state = seed.max(1) ^ 0x9E37_79B9_7F4A_7C15;
    // The killer and the scaler choose under one lock (see `scale.rs`).
    let turn = tokio::sync::Mutex::new(());
    let scaling = async {
        match scale_every {
            Some(every) => {
                scale::scaler(svc, every, deadline, &turn, |n| {
                    (next(&mut scale_state) % n as u64) as usize
                })
                .await
            }
            None => scale::Scaled::default(),
        }
    };
    let killer = async {
        let mut kills = 0u64;
        let mut tick = tokio::time::interval(kill_every);
        tick.tick().await; // the first tick is immediate: let the load start first
        loop {
            tick.tick().await;
            if Instant::now() + kill_every / 2 >= deadline {
                return kills;
            }
            let _turn = turn.lock().await;
            // Routed as the table says: a draining server is no longer counted.
            let rows = svc.instances();
            let is_routed = |url: &str| {
                rows.iter().any(|r| {
                    r.server_url == url
                        && r.state == troupe_controller::serve::instances::InstanceState::Routed
                })
            };
            let servers = svc.servers();
            let heads: Vec<_> = servers.iter().filter(|s| s.node_rank == 0).collect();
            let candidates: Vec<_> = heads
                .iter()
                .filter(|s| is_routed(&s.info.url) && scale::routed(&rows, s.info.worker_type) > 1)
                .collect();
            if candidates.is_empty() {
                continue;
            }
            let victim = candidates[(next(&mut state) % candidates.len() as u64) as usize];
            let pid = match victim
                .actor
                .call(troupe_serving::inference::server::GetInfo)
                .await
            {
                Ok(info) => info.pid,
                Err(_) => continue,
            };
            if nix::sys::signal::kill(
                nix::unistd::Pid::from_raw(pid as i32),
                nix::sys::signal::Signal::SIGKILL,
            )
            .is_ok()
            {
                kills += 1;
                tracing::info!(server = %victim.info.url, pid, "chaos: killed");
            }
        }
    };
    let (_, kills, scaled) = tokio::join!(futures::future::join_all(clients), killer, scaling);
    let retried = gateway_retries(&client, &svc.gateway_url)
        .await
        .saturating_sub(retries_before);
    let sent = sent.load(Ordering::Relaxed);
    let answered = answered.load(Ordering::Relaxed);
    let errors = errors.lock().map(|e| e.clone()).unwrap_or_default();
    ChaosReport {
        sent,
        answered,
        retried,
        lost: sent - answered,
        kills,
        scaled_up: scaled.up,
        scaled_down: scaled.down,
        errors,
        scale_errors: scaled.errors,
    }
}

/// Runs `troupe bench chaos`: an in-process deployment, the chaos run, then teardown.
pub async fn run(a: &ChaosArgs) -> Result<Vec<(String, f64)>, String> {
    if !(a.duration_s > 0.0 && a.kill_every_s > 0.0 && a.scale_every_s > 0.0) {
        return Err(
            "--duration-s, --kill-every-s and --scale-every-s must be positive numbers of seconds"
                .into(),
        );
    }
    let plan = AllocationPlan::parse(&a.allocation).map_err(|e| format!("--allocation: {e}"))?;
    let gpus = plan
        .components
        .iter()
        .map(|c| c.world_size())
        .sum::<u64>()
        .clamp(1, 1024) as u32
        // Room for the servers `--scale` adds (one at a time: an add, then a removal).
        + if a.scale { 2 } else { 0 };
    let cluster = Cluster::in_process(1, gpus)
        .await
        .map_err(|e| format!("cannot start the cluster: {e}"))?;
    let opts = ForkOptions {
        server_restarts: u32::MAX,
        ..ForkOptions::default()
    };
    let svc = match Deployment::fork(&cluster, &plan, &opts).await {
        Ok(s) => s,
        Err(e) => {
            cluster.shutdown().await;
            return Err(e.to_string());
        }
    };
    let seed = a.seed.unwrap_or_else(|| {
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_nanos() as u64)
            .unwrap_or(1)
    });
    eprintln!("chaos: seed {seed}");
    let rep = run_chaos_scaled(
        &svc,
        Duration::from_secs_f64(a.duration_s),
        Duration::from_secs_f64(a.kill_every_s),
        a.scale.then(|| Duration::from_secs_f64(a.scale_every_s)),
        a.concurrency,
        a.max_new_tokens,
        seed,
    )
    .await;
    for e in &rep.errors {
        eprintln!("chaos: lost request: {e}");
    }
    for e in &rep.scale_errors {
        eprintln!("chaos: scaling failed: {e}");
    }
    svc.teardown().await;
    cluster.shutdown().await;
    Ok(rep.figures())
}
