//! `troupe host`: run an actor host in this process until SIGTERM or SIGINT.
//!
//! With `--report-to` (how launchers such as Slurm start hosts on other nodes) the host first
//! connects to the controller's rendezvous, listens on the IP of that connection (when
//! `--listen` is unspecified, e.g. `0.0.0.0:0`), reports its address, node and GPUs, and stops
//! when the controller closes the connection.

use std::net::SocketAddr;
use std::time::Duration;

use troupe_actors::{HostConfig, HostCore, Registry};
use troupe_scheduler::launch::report::{HostReport, ReportLink, node_name, parse_visible_devices};

use troupe_scheduler::launch::READY_PREFIX;

use super::Shutdown;

/// Flags of `troupe host`.
#[derive(Debug, Clone, clap::Args)]
pub struct HostArgs {
    /// Address to listen on (port 0 picks a free port).
    #[arg(long, default_value = "127.0.0.1:0")]
    pub listen: SocketAddr,
    /// GPU ids this host offers, comma-separated (e.g. 0,1,2,3).
    #[arg(long, value_delimiter = ',')]
    pub gpus: Vec<u32>,
    /// CPU cores this host offers (default: all of this machine's).
    #[arg(long)]
    pub cpus: Option<u32>,
    /// Memory this host offers, in GiB.
    #[arg(long, default_value_t = 0.0)]
    pub memory_gb: f64,
    /// Stable id of this host (default: a fresh uuid).
    #[arg(long)]
    pub host_id: Option<String>,
    /// Interval between heartbeats, in milliseconds.
    #[arg(long, default_value_t = 250, value_parser = clap::value_parser!(u64).range(10..=60_000))]
    pub heartbeat_ms: u64,
    /// Largest call payload accepted, in MiB.
    #[arg(long, default_value_t = 64.0)]
    pub max_message_mb: f64,
    /// Seconds each actor gets to stop on shutdown before it is killed.
    #[arg(long, default_value_t = 5.0)]
    pub shutdown_grace_s: f64,
    /// Control-plane token every gRPC request must carry. Required to listen on a
    /// non-loopback address. Prefer the environment variable (argv is visible to all users).
    #[arg(long, env = "TROUPE_TOKEN", hide_env_values = true)]
    pub token: Option<String>,
    /// Controller rendezvous (`HOST:PORT`) to report this host's address to. With it, an
    /// unspecified --listen IP (`0.0.0.0`) becomes the local IP of the connection to the
    /// controller, --gpus defaults to `$CUDA_VISIBLE_DEVICES`, and the host exits when the
    /// controller goes away.
    #[arg(long)]
    pub report_to: Option<String>,
    /// Position of this host among those launched together (under Slurm: `SLURM_PROCID`).
    #[arg(long, env = "SLURM_PROCID", default_value_t = 0)]
    pub host_index: usize,
    /// Added to --host-index (in the report and the default host id): a job added to a running
    /// cluster numbers its hosts after those already there, though its `SLURM_PROCID`s start
    /// at 0 again.
    #[arg(long, default_value_t = 0)]
    pub index_base: usize,
    /// Stop (with every actor and its processes) when no controller has watched this host for
    /// this many seconds: a host whose controller died never lingers. Off by default for hosts
    /// started by hand; the local launcher sets it (600 s, or `$TROUPE_HOST_ORPHAN_GRACE_S`),
    /// long enough for `troupe serve --recover`.
    #[arg(long, env = "TROUPE_HOST_ORPHAN_GRACE_S")]
    pub orphan_grace_s: Option<f64>,
    /// Serve gRPC over TLS with this certificate chain (PEM); needs --tls-key.
    #[arg(long, env = "TROUPE_TLS_CERT")]
    pub tls_cert: Option<std::path::PathBuf>,
    /// Private key (PEM) of --tls-cert.
    #[arg(long, env = "TROUPE_TLS_KEY")]
    pub tls_key: Option<std::path::PathBuf>,
}

/// Errors of `troupe host`.
#[derive(Debug, thiserror::Error)]
pub enum HostCmdError {
    /// A flag value is out of range.
    #[error("{0}")]
    Flag(String),
    /// The host could not start or serve.
    #[error("{0}")]
    Run(String),
}

/// Longest grace any `*-s` flag of `troupe host` takes: a week.
const MAX_GRACE_S: f64 = 7.0 * 24.0 * 3600.0;

fn positive(name: &str, v: f64) -> Result<f64, HostCmdError> {
    if v.is_finite() && v >= 0.0 {
        Ok(v)
    } else {
        Err(HostCmdError::Flag(format!(
            "--{name} must be a non-negative number, got {v}"
        )))
    }
}

/// A duration flag: a finite number of seconds from `min` to [`MAX_GRACE_S`].
fn seconds(name: &str, v: f64, min: f64) -> Result<Duration, HostCmdError> {
    if v.is_finite() && (min..=MAX_GRACE_S).contains(&v) {
        Ok(Duration::from_secs_f64(v))
    } else {
        Err(HostCmdError::Flag(format!(
            "--{name} must be from {min} to {MAX_GRACE_S} seconds (a week), got {v}"
        )))
    }
}

impl HostArgs {
    /// This host's position in the cluster: --host-index plus --index-base.
    pub fn index(&self) -> usize {
        self.host_index.saturating_add(self.index_base)
    }

    /// The host configuration these flags describe.
    pub fn config(&self) -> Result<HostConfig, HostCmdError> {
        let max_mb = positive("max-message-mb", self.max_message_mb)?;
        if max_mb == 0.0 {
            return Err(HostCmdError::Flag(
                "--max-message-mb must be above 0, e.g. --max-message-mb 64".into(),
            ));
        }
        let mut cfg = HostConfig {
            gpu_ids: self.gpus.clone(),
            memory_bytes: (positive("memory-gb", self.memory_gb)? * (1u64 << 30) as f64) as u64,
            heartbeat_interval: Duration::from_millis(self.heartbeat_ms),
            max_message_bytes: (max_mb * 1048576.0) as u64,
            shutdown_grace: seconds("shutdown-grace-s", self.shutdown_grace_s, 0.0)?,
            ..HostConfig::default()
        };
        if let Some(c) = self.cpus {
            cfg.cpus = c;
        }
        if let Some(g) = self.orphan_grace_s {
            cfg.orphan_grace = Some(seconds("orphan-grace-s", g, 0.1)?);
        }
        // Set by the local launcher of `troupe serve`: the state file that could recover us.
        cfg.recovery_file = std::env::var_os(troupe_wire::env::RECOVERY_FILE)
            .filter(|v| !v.is_empty())
            .map(std::path::PathBuf::from);
        let token = self.token.clone().filter(|t| !t.is_empty());
        if token.is_none() && !self.listen.ip().is_loopback() {
            return Err(HostCmdError::Flag(format!(
                "refusing to listen on {} without a control-plane token: anyone who reaches it could spawn processes; set TROUPE_TOKEN (or --token), or listen on 127.0.0.1",
                self.listen
            )));
        }
        cfg.auth_token = token;
        cfg.tls = troupe_actors::tls::TlsFiles {
            cert: self.tls_cert.clone(),
            key: self.tls_key.clone(),
            ca: None,
        }
        .server()
        .map_err(|e| HostCmdError::Flag(e.to_string()))?;
        if let Some(id) = &self.host_id {
            if id.trim().is_empty() {
                return Err(HostCmdError::Flag("--host-id must not be empty".into()));
            }
            cfg.host_id = id.clone();
        }
        Ok(cfg)
    }
}

/// Runs a host with every standard actor kind ([`troupe_controller::standard_registry`]: the
/// runtime's, serving's and the reference trainer, so `troupe run` can place its trainer on any
/// host) until SIGTERM or SIGINT, then stops every actor (killing their process trees) and exits.
///
/// With `TROUPE_BENCH_STUB_ENGINE=1` in its environment (set only by `troupe bench scale
/// --engine stub` for the hosts it launches) the host's `troupe.inference` kind is that
/// benchmark's in-process engine stand-in ([`super::bench::stub_engine`]) instead.
pub async fn run(args: HostArgs) -> Result<(), HostCmdError> {
    if std::env::var(super::bench::stub_engine::HOST_ENV).as_deref() == Ok("1") {
        tracing::info!(
            "{}=1: this host serves the scale benchmark's stub engines, not real ones",
            super::bench::stub_engine::HOST_ENV
        );
        return run_with(args, super::bench::stub_engine::registry()).await;
    }
    run_with(args, troupe_controller::standard_registry()).await
}

/// [`run`] with a custom registry (for binaries that embed extra actor kinds).
pub async fn run_with(mut args: HostArgs, registry: Registry) -> Result<(), HostCmdError> {
    let mut stop = Shutdown::listen();
    let mut link = match args.report_to.clone() {
        Some(to) => Some(prepare_report(&mut args, &to).await?),
        None => None,
    };
    let cfg = args.config()?;
    let listener = tokio::net::TcpListener::bind(args.listen)
        .await
        .map_err(|e| HostCmdError::Run(format!("cannot listen on {}: {e}", args.listen)))?;
    let addr = listener
        .local_addr()
        .map_err(|e| HostCmdError::Run(e.to_string()))?;
    let core = HostCore::start(cfg, registry)
        .await
        .map_err(|e| HostCmdError::Run(e.to_string()))?;
    core.set_address(addr.to_string());
    let server = tokio::spawn(troupe_actors::serve(
        core.clone(),
        listener,
        std::future::pending(),
    ));
    if let Some(l) = link.as_mut() {
        let report = HostReport {
            token: args.token.clone().filter(|t| !t.is_empty()),
            index: args.index(),
            host_id: core.host_id().to_string(),
            addr: addr.to_string(),
            node: node_name(),
            gpus: args.gpus.clone(),
        };
        if let Err(e) = l.send(&report).await {
            core.shutdown().await;
            return Err(HostCmdError::Run(e.to_string()));
        }
    }
    println!("{READY_PREFIX}{addr}");
    tracing::info!(host = core.host_id(), %addr, "actor host ready");
    let stopped = core.stopped();
    match link {
        Some(l) => tokio::select! {
            _ = stop.wait() => {}
            _ = stopped.cancelled() => {}
            _ = l.closed() => eprintln!("the controller closed its connection; stopping"),
        },
        None => tokio::select! {
            _ = stop.wait() => {}
            _ = stopped.cancelled() => {}
        },
    }
    tracing::info!("shutting down: stopping actors");
    core.shutdown().await;
    match server.await {
        Ok(Ok(())) => Ok(()),
        Ok(Err(e)) => Err(HostCmdError::Run(format!("gRPC server failed: {e}"))),
        Err(e) => Err(HostCmdError::Run(format!("gRPC server task failed: {e}"))),
    }
}

/// Connects to the controller's rendezvous and fills in what the report mode derives: the
/// listen IP (the interface that reaches the controller), GPUs from `CUDA_VISIBLE_DEVICES`,
/// and the host id from the host index.
async fn prepare_report(args: &mut HostArgs, to: &str) -> Result<ReportLink, HostCmdError> {
    let link = ReportLink::connect(to, Duration::from_secs(60))
        .await
        .map_err(|e| HostCmdError::Run(e.to_string()))?;
    if args.listen.ip().is_unspecified() {
        let ip = link
            .local_ip()
            .map_err(|e| HostCmdError::Run(e.to_string()))?;
        args.listen.set_ip(ip);
    }
    if args.gpus.is_empty()
        && let Ok(v) = std::env::var("CUDA_VISIBLE_DEVICES")
    {
        args.gpus = parse_visible_devices(&v).map_err(HostCmdError::Flag)?;
    }
    if args.host_id.is_none() {
        args.host_id = Some(format!("host-{}", args.index()));
    }
    Ok(link)
}
