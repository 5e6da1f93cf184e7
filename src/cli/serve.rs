//! `troupe serve CONFIG [key.path=value ...]`: bring up what the config describes, print the
//! gateway address, serve until SIGINT/SIGTERM, then tear everything down.

use std::path::PathBuf;

use troupe_controller::serve::config::{SchedulerType, ServeConfig};
use troupe_controller::serve::recover::{self, Settled};
use troupe_controller::serve::setup::{
    admin_key, cluster_builder, cluster_from, configured_admin_key, fork_options,
};
use troupe_controller::serve::state::ServeState;
use troupe_controller::serve::{Deployment, ServingEvent};
use troupe_controller::{Cluster, api};
use troupe_scheduler::AllocationPlan;

use super::Shutdown;

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
    /// A state file of an earlier controller exists and its hosts still run: stop those hosts
    /// (and so their servers) and start afresh, instead of refusing.
    #[arg(long, conflicts_with = "recover")]
    pub discard_state: bool,
}

/// Default state file name (in the working directory).
pub const DEFAULT_STATE_FILE: &str = "troupe-serve.state.json";

/// A `troupe host` process still running at `pid` (checked by its command line, so a reused
/// pid is not mistaken for one).
fn host_alive(pid: u32) -> bool {
    let cmdline = std::fs::read(format!("/proc/{pid}/cmdline")).unwrap_or_default();
    let words: Vec<&[u8]> = cmdline.split(|b| *b == 0).collect();
    words.first().is_some_and(|w| w.ends_with(b"troupe")) && words.contains(&&b"host"[..])
}

/// Starting where an earlier controller left a state file: refuse while its hosts run (they
/// would be orphaned and the file overwritten), unless `discard` says to stop them first. A
/// file whose hosts are all gone is stale and simply replaced.
async fn refuse_or_discard_state(path: &std::path::Path, discard: bool) -> Result<(), String> {
    if !path.exists() {
        return Ok(());
    }
    let st = ServeState::load(path)
        .map_err(|e| format!("{e}; move it away (or pass another --state-file) to start afresh"))?;
    let running: Vec<u32> = st
        .hosts
        .iter()
        .map(|h| h.pid)
        .filter(|p| *p != 0 && host_alive(*p))
        .collect();
    if running.is_empty() {
        let _ = std::fs::remove_file(path);
        return Ok(());
    }
    if !discard {
        return Err(format!(
            "{} records a deployment whose {} host process(es) still run (pids {running:?}); reattach with `troupe serve CONFIG --recover`, or stop them and start afresh with `--discard-state`",
            path.display(),
            running.len()
        ));
    }
    st.check_writer_gone()?;
    eprintln!(
        "discarding {}: stopping host processes {running:?} and their servers",
        path.display()
    );
    for pid in &running {
        let _ = nix::sys::signal::kill(
            nix::unistd::Pid::from_raw(*pid as i32),
            nix::sys::signal::Signal::SIGTERM,
        );
    }
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(20);
    while running.iter().any(|p| host_alive(*p)) && std::time::Instant::now() < deadline {
        tokio::time::sleep(std::time::Duration::from_millis(100)).await;
    }
    for pid in running.iter().filter(|p| host_alive(**p)) {
        let _ = nix::sys::signal::kill(
            nix::unistd::Pid::from_raw(*pid as i32),
            nix::sys::signal::Signal::SIGKILL,
        );
    }
    std::fs::remove_file(path).map_err(|e| format!("cannot remove {}: {e}", path.display()))
}

/// The state file to write, if the hosts can outlive this controller.
fn state_path(a: &ServeArgs, cfg: &ServeConfig) -> Option<PathBuf> {
    match (&a.state_file, cfg.scheduler.kind) {
        (Some(p), _) => Some(p.clone()),
        (None, SchedulerType::Local) => Some(PathBuf::from(DEFAULT_STATE_FILE)),
        // In-process hosts die with the controller; Slurm and Ray hosts stop when its
        // connection closes (a dead controller must not leave a job holding GPUs).
        (None, SchedulerType::Inprocess | SchedulerType::Slurm | SchedulerType::Ray) => None,
    }
}

/// Keeps the state file current: written now, and again whenever a server is re-placed.
/// Starts the config's `autoscale:` policy, when enabled (its values were checked at load).
fn start_autoscaler(svc: &Deployment, cfg: &ServeConfig) {
    if let Ok(Some(o)) = cfg.autoscale.options()
        && let Err(e) = svc.autoscale(o)
    {
        eprintln!("autoscale: not started: {e}");
    }
}

fn keep_state(
    path: PathBuf,
    svc: &Deployment,
    cluster: &Cluster,
    token: Option<String>,
    config: &ServeConfig,
) -> Result<tokio::task::JoinHandle<()>, String> {
    let source = svc.state_source(cluster);
    let recorded = recover::recorded_config(&config.source);
    let snapshot = move || {
        let mut st = source();
        st.token = token.clone();
        st.config = recorded.clone();
        st
    };
    snapshot().save(&path).map_err(|e| e.to_string())?;
    eprintln!(
        "state: {} (after a controller crash, `troupe serve CONFIG --recover` reattaches)",
        path.display()
    );
    // Re-placements and scaling (a server added, leaving, removed) change the heads and
    // engines, fleet operations the fleet's status (a client's pause): write the state again
    // after each.
    let mut events = svc.serving_events();
    let mut status = svc.plane.watch_status();
    Ok(tokio::spawn(async move {
        loop {
            let changed = tokio::select! {
                e = events.recv() => match e {
                    Ok(
                        ServingEvent::Replaced { .. }
                        | ServingEvent::Added { .. }
                        | ServingEvent::Draining { .. }
                        | ServingEvent::Retired { .. }
                        | ServingEvent::GatewayReplaced { .. },
                    ) => true,

                    Ok(_) | Err(tokio::sync::broadcast::error::RecvError::Lagged(_)) => false,
                    Err(_) => return,
                },
                r = status.changed() => match r {
                    Ok(()) => true,
                    Err(_) => return,
                },
            };
            if changed && let Err(e) = snapshot().save(&path) {
                tracing::warn!("cannot update the state file: {e}");
            }
        }
    }))
}

/// Aborts its task when dropped (the command's end).
struct AbortOnDrop(tokio::task::JoinHandle<()>);

impl Drop for AbortOnDrop {
    fn drop(&mut self) {
        self.0.abort();
    }
}

/// Says on stderr what an operator must act on or will see elsewhere (the watcher only
/// traces it): the gateway's host lost, hosts (a Slurm job) added or given back. Runs until
/// the deployment's events end.
fn announce(svc: &Deployment) -> tokio::task::JoinHandle<()> {
    let mut events = svc.serving_events();
    tokio::spawn(async move {
        loop {
            match events.recv().await {
                Ok(ServingEvent::GatewayLost { host, reason }) => eprintln!(
                    "error: host {host}, which ran the gateway, is lost ({reason}): the gateway no longer answers; restart the deployment"
                ),
                Ok(ServingEvent::GatewayReplaced { lost, host, url }) => eprintln!(
                    "host {lost}, which ran the gateway, is lost: a new gateway serves on host {host}\ngateway: {url}"
                ),
                // The allocation grew or shrank: what an operator sees in squeue.
                Ok(ServingEvent::HostsAdded { unit, hosts }) => {
                    eprintln!("hosts {hosts:?} added for a new server: job {unit}")
                }
                Ok(ServingEvent::HostsReleased { unit, hosts }) => {
                    eprintln!(
                        "hosts {hosts:?} given back (no server left on them): job {unit} cancelled"
                    )
                }
                Ok(_) | Err(tokio::sync::broadcast::error::RecvError::Lagged(_)) => {}
                Err(_) => return,
            }
        }
    })
}

/// Refuses `--recover` at once when a host the state file names is gone (a local host whose
/// process no longer runs): nothing could be reattached there, and connecting would only wait
/// for it. Says how to start again, and that recorded agent sessions come back.
fn refuse_lost_hosts(
    st: &ServeState,
    path: &std::path::Path,
    cfg: &ServeConfig,
) -> Result<(), String> {
    let gone: Vec<usize> = (st.hosts.iter().enumerate())
        .filter(|(_, h)| h.pid != 0 && !host_alive(h.pid))
        .map(|(i, _)| i)
        .collect();
    let Some(first) = gone.first() else {
        return Ok(());
    };
    let gateway = if gone.contains(&st.gateway_host()) {
        format!(", host {} with the gateway", st.gateway_host())
    } else {
        String::new()
    };
    let sessions = cfg
        .gateway
        .session_dir
        .as_ref()
        .map(|d| {
            format!(
                "; recorded agent sessions are read back from {}",
                d.display()
            )
        })
        .unwrap_or_default();
    Err(format!(
        "hosts {gone:?} named in {} no longer run (host {first}'s pid was {}{gateway}): --recover reattaches only to a deployment whose hosts all run. `troupe serve CONFIG --discard-state` stops the rest and starts it again{sessions}",
        path.display(),
        st.hosts[*first].pid,
    ))
}

/// `troupe serve --recover`: reattach to what the state file names.
async fn recover(a: &ServeArgs, cfg: &ServeConfig, mut stop: Shutdown) -> Result<(), String> {
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
        SchedulerType::Ray => {
            return Err(
                "--recover needs hosts that outlive the controller: Ray hosts stop when their controller's connection closes, and Ray removes their placement group with the launcher's job; start anew without --recover"
                    .into(),
            );
        }
    }
    let path = a
        .state_file
        .clone()
        .unwrap_or_else(|| PathBuf::from(DEFAULT_STATE_FILE));
    let st = ServeState::load(&path).map_err(|e| e.to_string())?;
    st.check_writer_gone()?;
    recover::check_same_config(&st.config, &cfg.source)?;
    refuse_lost_hosts(&st, &path, cfg)?;
    let mut cluster = cluster_builder(cfg)
        .token(cfg.token().or_else(|| st.token.clone()))
        .connect(&st.host_addresses())
        .await
        .map_err(|e| format!("cannot reach the hosts named in {}: {e}", path.display()))?;
    if cfg.scheduler.kind == SchedulerType::Local {
        cluster.adopt_processes(&st.hosts.iter().map(|h| h.pid).collect::<Vec<_>>());
    }
    let svc = match Deployment::reattach(
        &cluster,
        &st,
        &fork_options(cfg, admin_key(cfg), Default::default()),
    )
    .await
    {
        Ok(s) => s,
        Err(e) => {
            return Err(format!(
                "{e} (hosts were left running; stop them or start without --recover)"
            ));
        }
    };
    let settled = svc.settle_recovered(st.fleet).await;
    let keeper = keep_state(
        path.clone(),
        &svc,
        &cluster,
        cfg.token().or(st.token.clone()),
        cfg,
    )?;
    start_autoscaler(&svc, cfg);
    println!("gateway: {}", svc.gateway_url);
    eprintln!("{}", cfg.gateway.agent_line());
    let _announce = AbortOnDrop(announce(&svc));
    match &settled {
        Settled::Held(m) => eprintln!("warning: {m}"),
        Settled::Serving(m) | Settled::Paused(m) => eprintln!("{m}"),
    }
    eprintln!(
        "recovered {} servers on {} hosts from {}",
        svc.inf_addrs.len(),
        cluster.hosts().len(),
        path.display()
    );
    stop.wait().await;
    eprintln!("shutting down");
    keeper.abort();
    svc.teardown().await;
    cluster.shutdown().await;
    let _ = std::fs::remove_file(&path);
    Ok(())
}

/// Runs `troupe serve`.
pub async fn run(a: &ServeArgs) -> Result<(), String> {
    let mut stop = Shutdown::listen();
    let mut cfg = ServeConfig::load(&a.config, &a.overrides).map_err(|e| e.to_string())?;
    // A deployment that keeps a state file keeps its recorded sessions beside it.
    if cfg.gateway.session_dir.is_none()
        && cfg.gateway.tokenizer.is_some()
        && let Some(p) = state_path(a, &cfg)
    {
        cfg.gateway.session_dir = Some(p.with_extension("sessions"));
    }
    if a.recover {
        return recover(a, &cfg, stop).await;
    }
    let plan =
        AllocationPlan::parse(&cfg.allocation_mode).map_err(|e| format!("allocation_mode: {e}"))?;
    let key = admin_key(&cfg);
    let token = cfg.token();
    // Hosts the local scheduler starts listen on this machine, where any user could reach
    // them: each run gets a fresh control-plane token unless one is configured (it is kept in
    // the 0600 state file for --recover). In-process hosts need none; Slurm makes its own.
    if cfg.scheduler.kind == SchedulerType::Local && cfg.token.is_none() && token.is_none() {
        cfg.token = Some(uuid::Uuid::new_v4().simple().to_string());
    }
    let host_token = cfg.token();
    // Refuse an unguarded API before anything starts.
    let api_tls = match a.api_listen {
        Some(addr) => {
            api::check_listen(addr, token.as_deref())?;
            cfg.tls().server().map_err(|e| format!("tls: {e}"))?
        }
        None => None,
    };
    if let Some(p) = state_path(a, &cfg) {
        refuse_or_discard_state(&p, a.discard_state).await?;
    }
    // A signal while hosts come up drops the launch, and with it (synchronously) whatever the
    // launcher started, e.g. the Slurm job.
    let builder = cluster_builder(&cfg).recovery_file(state_path(a, &cfg));
    let cluster = tokio::select! {
        c = cluster_from(&cfg, builder) => c?,
        _ = stop.wait() => return Err("interrupted while starting hosts".into()),
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
    let opts = fork_options(&cfg, key.clone(), super::run::bring_up_bar());
    let forked = tokio::select! {
        f = Deployment::fork(&cluster, &plan, &opts) => Some(f),
        _ = stop.wait() => None,
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
        Some(p) => match keep_state(p.clone(), &svc, &cluster, host_token.clone(), &cfg) {
            Ok(k) => Some(k),
            Err(e) => {
                svc.teardown().await;
                cluster.shutdown().await;
                return Err(e);
            }
        },
        None => None,
    };
    start_autoscaler(&svc, &cfg);
    println!("gateway: {}", svc.gateway_url);
    eprintln!("{}", cfg.gateway.agent_line());
    let _announce = AbortOnDrop(announce(&svc));
    // Serves until shutdown below: it stops before the deployment it controls is torn down.
    let mut api_server = None;
    if let Some(addr) = a.api_listen {
        let api = api::ControllerApi::new(svc.plane.clone())
            .with_token(token)
            .with_tls(api_tls);
        match api.spawn(addr).await {
            Ok(server) => {
                println!("controller api: {}", server.addr());
                api_server = Some(server);
            }
            Err(e) => {
                svc.teardown().await;
                cluster.shutdown().await;
                return Err(e);
            }
        }
    }
    // A key this run generated is shown once, so its user can call the control endpoints; a
    // configured one is the user's already and never printed.
    let shown = if configured_admin_key(&cfg).is_some() {
        "configured (admin_key / TROUPE_ADMIN_KEY)".to_string()
    } else {
        format!("{key} (generated for this run)")
    };
    eprintln!(
        "{} servers up in {:.2} s ({}); admin key: {shown}",
        svc.inf_addrs.len(),
        svc.bring_up.as_secs_f64(),
        plan
    );
    for s in svc.servers().iter() {
        eprintln!(
            "  {:<8} {}  (host {}, log {})",
            s.info.worker_type.as_str(),
            s.info.url,
            s.host,
            s.info.log_path
        );
    }
    stop.wait().await;
    eprintln!("shutting down");
    drop(api_server);
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
