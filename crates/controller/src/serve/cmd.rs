//! `troupe serve CONFIG [key.path=value ...]`: bring up what the config describes, print the
//! gateway address, serve until SIGINT/SIGTERM, then tear everything down.

use std::path::PathBuf;
use std::time::Duration;

use troupe_scheduler::AllocationPlan;

use super::config::{SchedulerType, ServeConfig};
use super::fork::{ForkOptions, InferenceService};
use crate::cluster::{Cluster, ClusterBuilder};

/// Flags of `troupe serve`.
#[derive(Debug, Clone, clap::Args)]
pub struct ServeArgs {
    /// YAML config (see examples/configs/pd-local.yaml).
    pub config: PathBuf,
    /// Overrides as dotted.key=value, e.g. rollout.max_concurrent_rollouts=64.
    pub overrides: Vec<String>,
    /// Also serve the controller's gRPC API (weight sync for external trainers) here.
    #[arg(long)]
    pub api_listen: Option<std::net::SocketAddr>,
}

/// Fork options from a config.
pub fn fork_options(cfg: &ServeConfig, admin_key: String, progress: bool) -> ForkOptions {
    let g = &cfg.gateway;
    ForkOptions {
        model: cfg.sglang.model_path.clone(),
        python: cfg.sglang.python.clone(),
        quantization: (!cfg.sglang.quantization.is_empty())
            .then(|| cfg.sglang.quantization.clone()),
        transfer_backend: cfg.sglang.disaggregation_transfer_backend.clone(),
        extra_args: cfg.sglang.extra_args.clone(),
        ready_timeout: Duration::from_secs_f64(cfg.sglang.ready_timeout_s),
        admin_key: Some(admin_key),
        gateway_listen: g.listen.clone(),
        policies: (
            g.policy.clone(),
            g.prefill_policy.clone().unwrap_or_else(|| g.policy.clone()),
            g.decode_policy.clone().unwrap_or_else(|| g.policy.clone()),
        ),
        max_retries: g.max_retries,
        progress,
        server_restarts: 3,
    }
}

/// Cluster settings from a config: its token and TLS files (hosts it starts use the same).
pub fn cluster_builder(cfg: &ServeConfig) -> ClusterBuilder {
    Cluster::builder().token(cfg.token()).tls(cfg.tls())
}

/// The cluster a config asks for, built from `builder`.
pub async fn cluster_from(cfg: &ServeConfig, builder: ClusterBuilder) -> Result<Cluster, String> {
    let (n, g) = (cfg.cluster.n_nodes, cfg.cluster.n_gpus_per_node);
    match cfg.scheduler.kind {
        SchedulerType::Inprocess => builder.in_process(n, g).await,
        SchedulerType::Local => builder.local_processes(n, g).await,
    }
    .map_err(|e| format!("cannot start the cluster: {e}"))
}

/// The cluster a config asks for.
pub async fn cluster_for(cfg: &ServeConfig) -> Result<Cluster, String> {
    cluster_from(cfg, cluster_builder(cfg)).await
}

/// The admin key: the config's, else `$TROUPE_ADMIN_KEY`, else a fresh random one.
pub fn admin_key(cfg: &ServeConfig) -> String {
    cfg.admin_key
        .clone()
        .or_else(|| std::env::var("TROUPE_ADMIN_KEY").ok())
        .filter(|k| !k.is_empty())
        .unwrap_or_else(|| uuid::Uuid::new_v4().simple().to_string())
}

/// Runs `troupe serve`.
pub async fn run(a: &ServeArgs) -> Result<(), String> {
    let cfg = ServeConfig::load(&a.config, &a.overrides).map_err(|e| e.to_string())?;
    let plan =
        AllocationPlan::parse(&cfg.allocation_mode).map_err(|e| format!("allocation_mode: {e}"))?;
    let key = admin_key(&cfg);
    let token = cfg.token();
    // Refuse an unguarded API before anything starts.
    let api_tls = match a.api_listen {
        Some(addr) => {
            crate::api::check_listen(addr, token.as_deref())?;
            cfg.tls().server().map_err(|e| format!("tls: {e}"))?
        }
        None => None,
    };
    let cluster = cluster_for(&cfg).await?;
    let svc = match InferenceService::fork(&cluster, &plan, &fork_options(&cfg, key.clone(), true))
        .await
    {
        Ok(s) => s,
        Err(e) => {
            cluster.shutdown().await;
            return Err(e.to_string());
        }
    };
    println!("gateway: {}", svc.gateway_url);
    if let Some(addr) = a.api_listen {
        let heads: Vec<u32> = svc
            .servers
            .iter()
            .filter(|s| s.node_rank == 0)
            .map(|s| s.info.gpu_count)
            .collect();
        let api = crate::api::ControllerApi::new(svc.control.clone(), heads)?
            .with_token(token)
            .with_tls(api_tls);
        match api.spawn(addr).await {
            Ok(bound) => println!("controller api: {bound}"),
            Err(e) => {
                svc.teardown().await;
                cluster.shutdown().await;
                return Err(e);
            }
        }
    }
    eprintln!(
        "{} servers up in {:.2} s ({}); admin key: {key}",
        svc.inf_addrs.len(),
        svc.bring_up.as_secs_f64(),
        plan
    );
    for s in svc.servers.iter() {
        eprintln!(
            "  {:<8} {}  (host {}, log {})",
            s.info.worker_type.as_str(),
            s.info.url,
            s.host,
            s.info.log_path
        );
    }
    crate::hostcmd::shutdown_signal().await;
    eprintln!("shutting down");
    svc.teardown().await;
    cluster.shutdown().await;
    Ok(())
}
