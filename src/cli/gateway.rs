//! `troupe gateway`: Troupe's PD-aware router and gateway as a standalone process, in front
//! of servers someone else started — what `sglang-router --worker-urls ...` (or its
//! `--pd-disaggregation --prefill URL PORT --decode URL` form) is for SGLang users.
//!
//! It prints `gateway listening on URL` when ready and serves until SIGINT/SIGTERM. Workers can
//! also be added and removed later through the SGLang-compatible admin API (`POST /workers`,
//! `DELETE /workers/{id}`). The fleet control endpoints (SGLang's, vLLM's and SkyRL's
//! names; see the README) act on every registered worker at once.

use std::time::Duration;

use troupe_serving::gateway::{self, ControlAuthMode, GatewayConfig};
use troupe_serving::health::{self, HealthConfig};
use troupe_serving::policy::{CacheAwareConfig, PolicyKind, StickyConfig};
use troupe_serving::{RouterConfig, WorkerSpec};

/// Flags of `troupe gateway`.
#[derive(Debug, Clone, clap::Args)]
pub struct GatewayArgs {
    /// Address to listen on (port 0 picks a free port).
    #[arg(long, default_value = "127.0.0.1:30000")]
    pub listen: String,
    /// Regular workers (`http://host:port`), comma-separated or repeated.
    #[arg(long, value_delimiter = ',')]
    pub worker_urls: Vec<String>,
    /// A prefill worker: `URL` or `URL,BOOTSTRAP_PORT` (repeat for more).
    #[arg(long)]
    pub prefill: Vec<String>,
    /// A decode worker URL (repeat for more).
    #[arg(long)]
    pub decode: Vec<String>,
    /// Policy for regular workers, and the default for prefill / decode:
    /// round_robin | random | power_of_two | sticky | sticky_least_loaded | cache_aware (default:
    /// the gateway's,
    /// power_of_two).
    #[arg(long, value_parser = parse_policy)]
    pub policy: Option<PolicyKind>,
    /// Policy for prefill workers (default: --policy).
    #[arg(long, value_parser = parse_policy)]
    pub prefill_policy: Option<PolicyKind>,
    /// Policy for decode workers (default: --policy).
    #[arg(long, value_parser = parse_policy)]
    pub decode_policy: Option<PolicyKind>,
    /// cache_aware: share (0.0-1.0) of a prompt a worker's cache tree must hold for the request
    /// to go there; else the smallest tree takes it (SGLang's flag; default 0.3).
    #[arg(long)]
    pub cache_threshold: Option<f64>,
    /// cache_aware: loads are imbalanced, and the least loaded worker takes the request, when
    /// requests in flight differ by more than this and by --balance-rel-threshold (default 64).
    #[arg(long)]
    pub balance_abs_threshold: Option<usize>,
    /// cache_aware: ... and the largest load exceeds the smallest times this (at least 1;
    /// default 1.5).
    #[arg(long)]
    pub balance_rel_threshold: Option<f64>,
    /// cache_aware: seconds between sweeps evicting least recently used cache-tree entries
    /// (default 60).
    #[arg(long)]
    pub eviction_interval_secs: Option<u64>,
    /// cache_aware: characters each worker's cache tree keeps after a sweep (default 2^26).
    #[arg(long)]
    pub max_tree_size: Option<usize>,
    /// sticky_least_loaded: seconds a session binding may stay unused before it is forgotten
    /// (default 7200, vllm-router's).
    #[arg(long)]
    pub session_ttl_secs: Option<u64>,
    /// sticky_least_loaded: most session bindings kept; past it the least recently used go
    /// (default 262144).
    #[arg(long)]
    pub max_sessions: Option<usize>,
    /// sticky_least_loaded: a bound engine with this many requests in flight passes a turn to
    /// the least loaded engine, and the session re-binds there (default 0: no cap).
    #[arg(long)]
    pub session_max_inflight: Option<usize>,
    /// Retries of a failed request on another worker (pair) (default: the gateway's, 3).
    #[arg(long)]
    pub max_retries: Option<u32>,
    /// Seconds between health probes of each worker (0: no probing).
    #[arg(long, default_value_t = 5.0)]
    pub health_interval_s: f64,
    /// Bearer key the admin endpoints require; required off loopback. Prefer the variable.
    #[arg(long, env = "TROUPE_ADMIN_KEY", hide_env_values = true)]
    pub admin_key: Option<String>,
    /// Bearer key sent to the workers (their `--api-key`; fleet control calls carry it too,
    /// so start the engines with the same admin key).
    #[arg(long, env = "TROUPE_WORKER_API_KEY", hide_env_values = true)]
    pub worker_api_key: Option<String>,
    /// Who may call the fleet control endpoints: `key` (the admin key) or `none` (open; only
    /// on a loopback --listen), for clients such as SkyRL's that send no key.
    #[arg(long, default_value = "key", value_parser = parse_control_auth)]
    pub control_auth: ControlAuthMode,
    /// The read-only control endpoints (versions, server and model info, is_paused) need the
    /// admin key too (default: open, as on SGLang and vLLM).
    #[arg(long)]
    pub key_reads: bool,
    /// Push weights from `/update_weights_from_tensor` FP8 block-quantized.
    #[arg(long)]
    pub weights_fp8: bool,
    /// Send only what changed since the version the engines hold: auto (when an engine is on
    /// another machine), on (always), off (every byte), compress (on, plus XOR + zstd of dense
    /// blocks: links slower than about 1 GB/s).
    #[arg(long, default_value = "auto", value_parser = parse_delta)]
    pub weights_delta: troupe_weights::delta::DeltaMode,
    /// Address the engines dial for this gateway's weight broadcast (default: the --listen host).
    #[arg(long)]
    pub weights_master_host: Option<String>,
    /// Seconds a fleet control call to one engine is waited for; a pause or resume still
    /// unanswered then stays open and its engine is brought to the fleet's state once it
    /// answers (default 120).
    #[arg(long)]
    pub control_timeout_s: Option<f64>,
    /// Threads serving requests, each with its own single-threaded runtime (default: one per
    /// core; 0 serves on the process's multi-threaded runtime).
    #[arg(long, value_parser = clap::value_parser!(u64).range(0..=1024))]
    pub io_threads: Option<u64>,
    /// The agent layer (`--tokenizer`, ...).
    #[command(flatten)]
    pub agent: super::agent_flags::AgentFlags,
}

fn parse_control_auth(s: &str) -> Result<ControlAuthMode, String> {
    s.parse()
}

fn parse_policy(name: &str) -> Result<PolicyKind, String> {
    PolicyKind::parse(name).map_err(|e| e.to_string())
}

/// The gateway configuration the flags describe; every bad flag is named.
pub fn config(a: &GatewayArgs) -> Result<GatewayConfig, String> {
    let mut workers: Vec<WorkerSpec> = a.worker_urls.iter().map(WorkerSpec::regular).collect();
    for p in &a.prefill {
        let (url, port) = match p.split_once(',') {
            Some((u, port)) => {
                let port: u16 = port.trim().parse().map_err(|_| {
                    format!("--prefill {p:?}: the bootstrap port must be a number 1-65535 (write URL,PORT)")
                })?;
                (u.trim(), Some(port))
            }
            None => (p.trim(), None),
        };
        workers.push(WorkerSpec::prefill(url, port));
    }
    workers.extend(a.decode.iter().map(WorkerSpec::decode));
    let pd = !a.prefill.is_empty() || !a.decode.is_empty();
    if pd && !a.worker_urls.is_empty() {
        return Err(
            "--worker-urls cannot be mixed with --prefill / --decode: a gateway routes either regular workers or PD pairs"
                .into(),
        );
    }
    if pd && (a.prefill.is_empty() || a.decode.is_empty()) {
        return Err("PD mode needs at least one --prefill and one --decode".into());
    }
    let most = health::MAX_INTERVAL.as_secs_f64();
    if !(a.health_interval_s.is_finite() && (0.0..=most).contains(&a.health_interval_s)) {
        return Err(format!(
            "--health-interval-s must be a non-negative number of seconds, at most {most} (a day)"
        ));
    }
    let c = CacheAwareConfig::default();
    let cache_aware = CacheAwareConfig {
        cache_threshold: a.cache_threshold.unwrap_or(c.cache_threshold),
        balance_abs_threshold: a.balance_abs_threshold.unwrap_or(c.balance_abs_threshold),
        balance_rel_threshold: a.balance_rel_threshold.unwrap_or(c.balance_rel_threshold),
        eviction_interval_secs: a.eviction_interval_secs.unwrap_or(c.eviction_interval_secs),
        max_tree_size: a.max_tree_size.unwrap_or(c.max_tree_size),
    };
    cache_aware.check(|k| format!("--{}", k.replace('_', "-")))?;
    let sd = StickyConfig::default();
    let sessions = StickyConfig {
        session_ttl_secs: a.session_ttl_secs.unwrap_or(sd.session_ttl_secs),
        max_sessions: a.max_sessions.unwrap_or(sd.max_sessions),
        session_max_inflight: a.session_max_inflight.unwrap_or(sd.session_max_inflight),
    };
    sessions.check(|k| format!("--{}", k.replace('_', "-")))?;
    let d = GatewayConfig::default();
    let control_timeout = match a.control_timeout_s {
        None => d.fleet.control_timeout,
        Some(s) => {
            let most = gateway::MAX_CONTROL_TIMEOUT.as_secs_f64();
            if !(s.is_finite() && s > 0.0 && s <= most) {
                return Err(format!(
                    "--control-timeout-s must be a positive number of seconds, at most {most} (an hour)"
                ));
            }
            Duration::from_secs_f64(s)
        }
    };
    let base = a.policy.unwrap_or(d.router.policy);
    Ok(GatewayConfig {
        listen: a.listen.clone(),
        pd,
        router: RouterConfig {
            policy: base,
            prefill_policy: a.prefill_policy.unwrap_or(base),
            decode_policy: a.decode_policy.unwrap_or(base),
            cache_aware,
            sessions,
            health: HealthConfig {
                interval: Duration::from_secs_f64(a.health_interval_s),
                ..d.router.health.clone()
            },
            ..d.router.clone()
        },
        admin_key: a.admin_key.clone().filter(|k| !k.is_empty()),
        worker_api_key: a.worker_api_key.clone().filter(|k| !k.is_empty()),
        max_retries: a.max_retries.unwrap_or(d.max_retries),
        workers,
        control_auth: a.control_auth,
        key_reads: a.key_reads,
        fleet: troupe_serving::FleetConfig {
            control_timeout,
            weights_fp8: a.weights_fp8,
            weights_delta: a.weights_delta,
            weights_master_host: a.weights_master_host.clone(),
        },
        io_threads: a.io_threads.map_or_else(default_io_threads, |n| n as usize),
        // Without --tokenizer, `run` asks the workers for their model (`discover`).
        agent: match &a.agent.tokenizer {
            Some(_) => super::agent_flags::spec(&a.agent)?,
            None => None,
        },
        ..d
    })
}

/// Serving threads when `--io-threads` is not given: one per core, so the gateway's CPU (the
/// bound under load) grows with the machine. `troupe bench gateway` starts its gateway the same way.
pub fn default_io_threads() -> usize {
    std::thread::available_parallelism().map_or(1, |n| n.get())
}

/// Runs `troupe gateway` until SIGINT/SIGTERM.
pub async fn run(a: &GatewayArgs) -> Result<(), String> {
    let mut stop = super::Shutdown::listen();
    let mut cfg = config(a)?;
    let line = match (&a.agent.tokenizer, &cfg.agent) {
        (None, _) => {
            let urls: Vec<String> = cfg.workers.iter().map(|w| w.url.clone()).collect();
            let (spec, line) =
                super::agent_flags::discover(&a.agent, &urls, cfg.worker_api_key.as_deref())
                    .await?;
            cfg.agent = spec;
            line
        }
        (Some(t), Some(s)) => format!(
            "agent layer: tokenizer {t} (--tokenizer), model {:?}",
            s.model
        ),
        (Some(_), None) => "agent layer: off (--tokenizer none)".into(),
    };
    let handle = gateway::start(cfg).await.map_err(|e| e.to_string())?;
    eprintln!("{line}");
    println!("gateway listening on {}", handle.url());
    stop.wait().await;
    handle.shutdown().await.map_err(|e| e.to_string())
}

/// `--weights-delta`: `auto`, `on`, `off` or `compress`.
fn parse_delta(s: &str) -> Result<troupe_weights::delta::DeltaMode, String> {
    troupe_weights::delta::DeltaMode::parse(s)
        .ok_or_else(|| format!("{s:?}: use auto, on, off or compress"))
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::Parser;

    #[derive(Parser)]
    struct Cli {
        #[command(flatten)]
        g: GatewayArgs,
    }

    fn parse(args: &[&str]) -> Result<GatewayConfig, String> {
        let cli = Cli::try_parse_from(std::iter::once("gateway").chain(args.iter().copied()))
            .map_err(|e| e.to_string())?;
        config(&cli.g)
    }

    #[test]
    fn flags_become_a_gateway_config_and_bad_ones_are_named() {
        let c = parse(&[
            "--prefill",
            "http://p:30000,8998",
            "--decode",
            "http://d:30001",
            "--decode-policy",
            "round_robin",
        ])
        .unwrap();
        assert!(c.pd);
        assert_eq!(c.workers[0].bootstrap_port, Some(8998));
        assert_eq!(c.router.decode_policy, PolicyKind::RoundRobin);
        assert_eq!(c.router.prefill_policy, PolicyKind::PowerOfTwo);
        let r = parse(&["--worker-urls", "http://a:1,http://b:2"]).unwrap();
        assert!(!r.pd);
        assert_eq!(r.workers.len(), 2);
        assert_eq!(r.router.cache_aware, CacheAwareConfig::default());
        // One serving thread per core unless told otherwise.
        let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
        assert_eq!(r.io_threads, cores);
        let one = parse(&["--worker-urls", "http://a:1", "--io-threads", "0"]).unwrap();
        assert_eq!(one.io_threads, 0);
        let c = parse(&[
            "--worker-urls",
            "http://a:1",
            "--policy",
            "cache_aware",
            "--cache-threshold",
            "0.5",
            "--balance-abs-threshold",
            "32",
            "--balance-rel-threshold",
            "1.1",
            "--eviction-interval-secs",
            "30",
            "--max-tree-size",
            "10000",
        ])
        .unwrap();
        assert_eq!(c.router.policy, PolicyKind::CacheAware);
        assert_eq!(c.router.prefill_policy, PolicyKind::CacheAware);
        assert_eq!(
            c.router.cache_aware,
            CacheAwareConfig {
                cache_threshold: 0.5,
                balance_abs_threshold: 32,
                balance_rel_threshold: 1.1,
                eviction_interval_secs: 30,
                max_tree_size: 10000,
            }
        );
        for (args, needle) in [
            (vec!["--prefill", "http://p:1,port"], "bootstrap port"),
            (vec!["--prefill", "http://p:1"], "--decode"),
            (vec!["--policy", "fastest"], "--policy"),
            (
                vec!["--worker-urls", "http://a:1", "--decode", "http://d:1"],
                "cannot be mixed",
            ),
            (vec!["--health-interval-s=-1"], "non-negative"),
            (vec!["--health-interval-s", "1e300"], "at most"),
            (vec!["--cache-threshold", "1.5"], "--cache-threshold"),
            (vec!["--cache-threshold", "NaN"], "--cache-threshold"),
            (vec!["--cache-threshold=-0.5"], "--cache-threshold"),
            (
                vec!["--balance-abs-threshold=-1"],
                "--balance-abs-threshold",
            ),
            (
                vec!["--balance-rel-threshold", "0.5"],
                "--balance-rel-threshold",
            ),
            (
                vec!["--eviction-interval-secs", "0"],
                "--eviction-interval-secs",
            ),
            (vec!["--max-tree-size", "0"], "--max-tree-size"),
            (vec!["--io-threads", "5000"], "--io-threads"),
            (vec!["--io-threads=-1"], "--io-threads"),
        ] {
            let e = parse(&args).unwrap_err();
            assert!(e.contains(needle), "{args:?}: {e}");
        }
    }
}
