//! `troupe plan CONFIG [overrides] [--json]`: everything `troupe serve` would launch — the
//! allocation plan, each host's GPU bundles, every server's ports, program, argv and
//! environment, each data proxy's backend, the gateway's workers, the weight group's world size
//! and rank offsets, and with Slurm the sbatch script — without starting anything. It runs
//! serve's own code path up to the first launch (`Prepared` → `LaunchPlan`). Hosts are the
//! configured `cluster.n_nodes × cluster.n_gpus_per_node` (none is started to ask).

use std::path::PathBuf;
use std::sync::Arc;

use troupe_controller::ports::PortLedger;
use troupe_controller::serve::Prepared;
use troupe_controller::serve::config::{SchedulerType, ServeConfig};
use troupe_controller::serve::plan::LaunchPlan;
use troupe_controller::serve::setup::{admin_key, cluster_builder, fork_options, slurm_options};
use troupe_scheduler::{AllocationPlan, HostResources};

/// Flags of `troupe plan`.
#[derive(Debug, Clone, clap::Args)]
pub struct PlanArgs {
    /// YAML config (as for `troupe serve`).
    pub config: PathBuf,
    /// Overrides as dotted.key=value.
    pub overrides: Vec<String>,
    /// One JSON document instead of the human-readable plan.
    #[arg(long)]
    pub json: bool,
}

/// The plan for `a`, rendered; config errors name their key.
pub fn run(a: &PlanArgs) -> Result<String, String> {
    let cfg = ServeConfig::load(&a.config, &a.overrides).map_err(|e| e.to_string())?;
    let lp = plan(&cfg)?;
    if a.json {
        serde_json::to_string_pretty(&lp).map_err(|e| e.to_string())
    } else {
        Ok(lp.render())
    }
}

/// What `troupe serve` would launch for `cfg`.
pub fn plan(cfg: &ServeConfig) -> Result<LaunchPlan, String> {
    let alloc =
        AllocationPlan::parse(&cfg.allocation_mode).map_err(|e| format!("allocation_mode: {e}"))?;
    let (n, g) = (cfg.cluster.n_nodes, cfg.cluster.n_gpus_per_node);
    let slurm = matches!(
        cfg.scheduler.kind,
        SchedulerType::Slurm | SchedulerType::Ray
    );
    let hosts: Vec<HostResources> = (0..n)
        .map(|i| {
            // Local hosts run on this machine; Slurm's and Ray's get their nodes' addresses at start.
            let addr = if slurm {
                format!("<node {i}>")
            } else {
                "127.0.0.1".to_string()
            };
            HostResources::new(i, addr, (0..g).collect())
        })
        .collect();
    let opts = fork_options(cfg, admin_key(cfg), Default::default());
    let claims = Arc::new(PortLedger::default()).claims();
    let prepared = Prepared::new(hosts, claims, &alloc, &opts).map_err(|e| e.to_string())?;
    let bin = match &cfg.scheduler.binary {
        Some(b) => b.clone(),
        None => troupe_actors::process::troupe_binary()
            .map(|p| p.display().to_string())
            .unwrap_or_else(|_| "troupe".into()),
    };
    let from = format!(
        "as configured: cluster.n_nodes {n} x cluster.n_gpus_per_node {g}, scheduler {}; ports are drawn again at launch",
        cfg.scheduler.kind.as_str()
    );
    let mut lp =
        LaunchPlan::of(&alloc, &prepared, &opts, &bin, &from).map_err(|e| e.to_string())?;
    if slurm {
        let o = slurm_options(&cfg.scheduler)?;
        let req = cluster_builder(cfg)
            .launch_request(n, g)
            .map_err(|e| e.to_string())?;
        lp.sbatch = Some(troupe_scheduler::launch::batch_script(
            &o,
            &req,
            "<controller address:port, bound at launch>",
        ));
    }
    Ok(lp)
}
