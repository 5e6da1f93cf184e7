//! From a `troupe serve` / `troupe run` config to what the library needs: the cluster it asks
//! for, the fork options, the admin key. The binary's `serve` and `run` commands and the
//! library's GRPO job share these, so a config means the same thing everywhere.

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use troupe_scheduler::launch::{RayLauncher, RayOptions, RayStrategy};
use troupe_scheduler::{HostLauncher, SlurmLauncher, SlurmOptions};

use super::config::{SchedulerConfig, SchedulerType, ServeConfig};
use super::options::{ForkOptions, Progress};
use crate::cluster::{Cluster, ClusterBuilder};

/// Fork options from a config.
pub fn fork_options(cfg: &ServeConfig, admin_key: String, progress: Progress) -> ForkOptions {
    ForkOptions {
        model: cfg.sglang.model_path.clone(),
        python: cfg.sglang.python.clone(),
        quantization: (!cfg.sglang.quantization.is_empty())
            .then(|| cfg.sglang.quantization.clone()),
        weights_delta: cfg.weights.delta,
        weights_bucket_bytes: cfg.weights.bucket_bytes(),
        weights_staging: cfg.weights.staging,
        weights_rollout: cfg.weights.rollout(),
        weights_rolling_drain: Duration::from_secs_f64(cfg.weights.rolling_drain_s),
        transfer_backend: cfg.sglang.disaggregation_transfer_backend.clone(),
        extra_args: cfg.sglang.extra_args.clone(),
        // Checked when the config loaded; an error here cannot happen for a loaded config.
        sglang_args: cfg
            .engine_flags(troupe_wire::engine_args::EngineDialect::Sglang)
            .unwrap_or_default(),
        vllm_args: cfg
            .engine_flags(troupe_wire::engine_args::EngineDialect::Vllm)
            .unwrap_or_default(),
        vllm_env: cfg.engine_env(troupe_wire::engine_args::EngineDialect::Vllm),
        vllm_python: cfg.vllm.python.clone(),
        vllm_cpu: cfg.vllm.device == super::config::VllmDevice::Cpu,
        ready_timeout: Duration::from_secs_f64(cfg.sglang.ready_timeout_s),
        admin_key: Some(admin_key),
        gateway: cfg.gateway.to_gateway(),
        progress,
        server_restarts: 3,
    }
}

/// The Slurm launcher's settings from `scheduler.*`.
pub fn slurm_options(s: &SchedulerConfig) -> Result<SlurmOptions, String> {
    let log_dir = PathBuf::from(&s.log_dir);
    let log_dir = if log_dir.is_absolute() {
        log_dir
    } else {
        std::env::current_dir()
            .map_err(|e| format!("scheduler.log_dir: cannot resolve {}: {e}", s.log_dir))?
            .join(log_dir)
    };
    let report_ip = match s.report_address.as_str() {
        "auto" => None,
        a => Some(
            a.parse()
                .map_err(|_| format!("scheduler.report_address: not an IP address: {a:?}"))?,
        ),
    };
    Ok(SlurmOptions {
        partition: s.partition.clone(),
        account: s.account.clone(),
        time: s.time.clone(),
        extra_args: s.extra_args.clone(),
        container_prefix: s.container_prefix.to_vec(),
        log_dir,
        report_ip,
        use_allocation: s.use_allocation,
    })
}

/// The Ray launcher's settings from `scheduler.*`.
pub fn ray_options(s: &SchedulerConfig) -> Result<RayOptions, String> {
    let d = RayOptions::default();
    let report_ip = match s.report_address.as_str() {
        "auto" => None,
        a => Some(
            a.parse()
                .map_err(|_| format!("scheduler.report_address: not an IP address: {a:?}"))?,
        ),
    };
    Ok(RayOptions {
        python: s.python.clone().unwrap_or(d.python),
        address: s.address.clone().unwrap_or(d.address),
        namespace: s.namespace.clone(),
        strategy: match &s.placement_strategy {
            Some(p) => RayStrategy::parse(p)?,
            None => RayStrategy::default(),
        },
        cpus_per_host: s.cpus_per_host.unwrap_or(d.cpus_per_host),
        resources: s.resources.clone(),
        runtime_env: s.runtime_env.clone(),
        report_ip,
        fail_infeasible: !s.wait_for_autoscaler,
    })
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
        SchedulerType::Slurm => {
            let launcher = Arc::new(SlurmLauncher::new(slurm_options(&cfg.scheduler)?));
            remote(cfg, builder, launcher).await
        }
        SchedulerType::Ray => {
            let launcher = Arc::new(RayLauncher::new(ray_options(&cfg.scheduler)?));
            remote(cfg, builder, launcher).await
        }
    }
    .map_err(|e| format!("cannot start the cluster: {e}"))
}

/// Hosts on other nodes (Slurm, Ray) listen on routable addresses: they always get a token (the
/// config's or $TROUPE_TOKEN, else a fresh one for this run), and `scheduler.binary` and
/// `scheduler.startup_timeout_s` apply.
async fn remote(
    cfg: &ServeConfig,
    builder: ClusterBuilder,
    launcher: Arc<dyn HostLauncher>,
) -> Result<Cluster, crate::cluster::ClusterError> {
    let (n, g) = (cfg.cluster.n_nodes, cfg.cluster.n_gpus_per_node);
    let s = &cfg.scheduler;
    let token = cfg
        .token()
        .unwrap_or_else(|| uuid::Uuid::new_v4().simple().to_string());
    let mut b = builder
        .token(Some(token))
        .startup_timeout(Duration::from_secs_f64(s.startup_timeout_s));
    if let Some(bin) = &s.binary {
        b = b.binary(bin);
    }
    b.launch(launcher, n, g).await
}

/// The cluster a config asks for.
pub async fn cluster_for(cfg: &ServeConfig) -> Result<Cluster, String> {
    cluster_from(cfg, cluster_builder(cfg)).await
}

/// The admin key the user gave: the config's, else `$TROUPE_ADMIN_KEY` (never printed).
pub fn configured_admin_key(cfg: &ServeConfig) -> Option<String> {
    cfg.admin_key
        .clone()
        .or_else(|| std::env::var("TROUPE_ADMIN_KEY").ok())
        .filter(|k| !k.is_empty())
}

/// The admin key: the one configured ([`configured_admin_key`]), else a fresh random one.
pub fn admin_key(cfg: &ServeConfig) -> String {
    configured_admin_key(cfg).unwrap_or_else(|| uuid::Uuid::new_v4().simple().to_string())
}
