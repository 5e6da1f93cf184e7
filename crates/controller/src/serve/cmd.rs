//! `troupe serve CONFIG [key.path=value ...]`: bring up what the config describes, print the
//! gateway address, serve until SIGINT/SIGTERM, then tear everything down.

use std::path::PathBuf;
use std::time::Duration;

use troupe_scheduler::AllocationPlan;

use std::sync::Arc;

use troupe_scheduler::{SlurmLauncher, SlurmOptions};

use super::config::{SchedulerConfig, SchedulerType, ServeConfig};
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
    /// Where to keep the state a restarted controller reattaches from (written by default
    /// for the `local` scheduler, whose hosts outlive the controller:
    /// `troupe-serve.state.json` in the working directory).
    #[arg(long)]
    pub state_file: Option<PathBuf>,
    /// Reattach to the hosts, servers and gateway in the state file instead of launching.
    #[arg(long)]
    pub recover: bool,
}

/// Default state file name (in the working directory).
pub const DEFAULT_STATE_FILE: &str = "troupe-serve.state.json";

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
            let s = &cfg.scheduler;
            let launcher = Arc::new(SlurmLauncher::new(slurm_options(s)?));
            // Hosts on other nodes listen on routable addresses: they always get a token
            // (the config's or $TROUPE_TOKEN, else a fresh one for this run).
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

/// The state file to write, if the hosts can outlive this controller.
fn state_path(a: &ServeArgs, cfg: &ServeConfig) -> Option<PathBuf> {
    match (&a.state_file, cfg.scheduler.kind) {
        (Some(p), _) => Some(p.clone()),
        (None, SchedulerType::Local) => Some(PathBuf::from(DEFAULT_STATE_FILE)),
        // In-process hosts die with the controller; Slurm hosts stop when its connection
        // closes (a dead controller must not leave a job holding GPUs).
        (None, SchedulerType::Inprocess | SchedulerType::Slurm) => None,
    }
}

/// Keeps the state file current: written now, and again whenever a server is re-placed.
fn keep_state(
    path: PathBuf,
    svc: &InferenceService,
    cluster: &Cluster,
) -> Result<tokio::task::JoinHandle<()>, String> {
    svc.state(cluster).save(&path).map_err(|e| e.to_string())?;
    eprintln!(
        "state: {} (after a controller crash, `troupe serve CONFIG --recover` reattaches)",
        path.display()
    );
    // Re-placements change the heads and engines: write the state again after each.
    let mut events = svc.serving_events();
    let snapshot = svc.state_source(cluster);
    Ok(tokio::spawn(async move {
        loop {
            match events.recv().await {
                Ok(super::ServingEvent::Replaced { .. }) => {
                    if let Err(e) = snapshot().save(&path) {
                        tracing::warn!("cannot update the state file: {e}");
                    }
                }
                Ok(_) | Err(tokio::sync::broadcast::error::RecvError::Lagged(_)) => {}
                Err(_) => return,
            }
        }
    }))
}

/// `troupe serve --recover`: reattach to what the state file names.
async fn recover(a: &ServeArgs, cfg: &ServeConfig) -> Result<(), String> {
    match cfg.scheduler.kind {
        SchedulerType::Local => {}
        SchedulerType::Inprocess => {
            return Err(
                "--recover needs hosts that outlive the controller: in-process hosts died with it; use scheduler.type=local"
                    .into(),
            );
        }
        SchedulerType::Slurm => {
            return Err(
                "--recover needs hosts that outlive the controller: Slurm hosts stop when their controller's connection closes (so a dead controller never leaves a job holding GPUs); start a new job without --recover"
                    .into(),
            );
        }
    }
    let path = a
        .state_file
        .clone()
        .unwrap_or_else(|| PathBuf::from(DEFAULT_STATE_FILE));
    let st = super::state::ServeState::load(&path).map_err(|e| e.to_string())?;
    st.check_writer_gone()?;
    let mut cluster = cluster_builder(cfg)
        .connect(&st.host_addresses())
        .await
        .map_err(|e| format!("cannot reach the hosts named in {}: {e}", path.display()))?;
    if cfg.scheduler.kind == SchedulerType::Local {
        cluster.adopt_processes(&st.hosts.iter().map(|h| h.pid).collect::<Vec<_>>());
    }
    let svc = match InferenceService::reattach(&cluster, &st, 3).await {
        Ok(s) => s,
        Err(e) => {
            return Err(format!(
                "{e} (hosts were left running; stop them or start without --recover)"
            ));
        }
    };
    let keeper = keep_state(path.clone(), &svc, &cluster)?;
    println!("gateway: {}", svc.gateway_url);
    eprintln!(
        "recovered {} servers on {} hosts from {}",
        svc.inf_addrs.len(),
        cluster.hosts().len(),
        path.display()
    );
    crate::hostcmd::shutdown_signal().await;
    eprintln!("shutting down");
    keeper.abort();
    svc.teardown().await;
    cluster.shutdown().await;
    let _ = std::fs::remove_file(&path);
    Ok(())
}

/// Runs `troupe serve`.
pub async fn run(a: &ServeArgs) -> Result<(), String> {
    let cfg = ServeConfig::load(&a.config, &a.overrides).map_err(|e| e.to_string())?;
    if a.recover {
        return recover(a, &cfg).await;
    }
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
    // A signal while hosts come up drops the launch, and with it (synchronously) whatever the
    // launcher started, e.g. the Slurm job.
    let cluster = tokio::select! {
        c = cluster_for(&cfg) => c?,
        _ = crate::hostcmd::shutdown_signal() => return Err("interrupted while starting hosts".into()),
    };
    for line in cluster.launch_info() {
        eprintln!("{line}");
    }
    for h in cluster.launched() {
        let gpus: Vec<String> = h.gpus.iter().map(|g| g.to_string()).collect();
        eprintln!(
            "  host {} on node {} at {} (gpus {})",
            h.index,
            h.node,
            h.addr,
            gpus.join(",")
        );
    }
    let opts = fork_options(&cfg, key.clone(), true);
    let forked = tokio::select! {
        f = InferenceService::fork(&cluster, &plan, &opts) => Some(f),
        _ = crate::hostcmd::shutdown_signal() => None,
    };
    let svc = match forked {
        Some(Ok(s)) => s,
        Some(Err(e)) => {
            cluster.shutdown().await;
            return Err(e.to_string());
        }
        None => {
            cluster.shutdown().await;
            return Err("interrupted while starting servers".into());
        }
    };
    // The state file exists before anyone is told the gateway is up.
    let state = state_path(a, &cfg);
    let keeper = match &state {
        Some(p) => match keep_state(p.clone(), &svc, &cluster) {
            Ok(k) => Some(k),
            Err(e) => {
                svc.teardown().await;
                cluster.shutdown().await;
                return Err(e);
            }
        },
        None => None,
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
    if let Some(k) = keeper {
        k.abort();
    }
    svc.teardown().await;
    cluster.shutdown().await;
    if let Some(p) = state {
        let _ = std::fs::remove_file(p);
    }
    Ok(())
}
