//! Host launchers: how the controller gets its actor hosts.
//!
//! Every way of starting `troupe host` processes — inside the controller (in the controller
//! crate, which owns the host runtime), as child processes on this machine ([`LocalLauncher`]),
//! as one Slurm job across nodes ([`SlurmLauncher`]), or as Ray actors on a Ray cluster's
//! placement group ([`RayLauncher`]) — answers the same question: given
//! "N hosts with G GPUs each", start them and say where each one listens. The controller then
//! connects to those addresses the same way whatever started them, and calls
//! [`HostLauncher::teardown`] when it shuts down.
//!
//! The types here are transport-neutral on purpose: this crate knows nothing of gRPC or of the
//! actor runtime, only processes, addresses, Slurm and Ray.

mod local;
mod ray;
pub mod ray_spec;
pub mod report;
mod slurm;
mod slurm_cmd;

use std::future::Future;
use std::path::PathBuf;
use std::pin::Pin;
use std::time::Duration;

pub use local::{LocalLauncher, READY_PREFIX};
pub use ray::RayLauncher;
pub use ray_spec::{RayOptions, RayStrategy};
pub use report::{HostReport, Rendezvous};
pub use slurm::SlurmLauncher;
pub use slurm_cmd::{JobInfo, SlurmOptions, batch_script, parse_job_info};

/// A boxed future, so [`HostLauncher`] can be used as a trait object (`&dyn HostLauncher`).
pub type BoxFuture<'a, T> = Pin<Box<dyn Future<Output = T> + Send + 'a>>;

/// What to launch: the same for every launcher, so a config switches launchers by one key.
#[derive(Debug, Clone)]
pub struct LaunchRequest {
    /// Number of hosts (one per node under Slurm).
    pub n_hosts: usize,
    /// GPUs each host gets (Slurm: `--gres gpu:G`; locally: ids `0..G` on each host).
    pub gpus_per_host: u32,
    /// Control-plane token the hosts require; it reaches them through the environment, never argv.
    pub token: Option<String>,
    /// Heartbeat interval of each host.
    pub heartbeat: Duration,
    /// Largest call payload hosts accept.
    pub max_message_bytes: u64,
    /// Grace each actor gets to stop when its host shuts down.
    pub shutdown_grace: Duration,
    /// How long all hosts together may take to report their addresses.
    pub startup_timeout: Duration,
    /// The `troupe` binary the hosts run (as seen from the nodes).
    pub binary: PathBuf,
    /// More environment for every host (e.g. `TROUPE_TLS_CERT` / `TROUPE_TLS_KEY`: paths, so
    /// they must be valid on the nodes). Through the environment, like the token.
    pub host_env: Vec<(String, String)>,
}

impl LaunchRequest {
    /// Sets the token (or clears an inherited one) and [`LaunchRequest::host_env`] on the
    /// command that starts the hosts.
    pub fn apply_env(&self, cmd: &mut tokio::process::Command) {
        match &self.token {
            Some(t) => cmd.env("TROUPE_TOKEN", t),
            None => cmd.env_remove("TROUPE_TOKEN"),
        };
        cmd.envs(self.host_env.iter().map(|(k, v)| (k, v)));
    }

    /// The `troupe host` flags every launcher passes (besides where to listen / report).
    pub fn host_flags(&self) -> Vec<String> {
        vec![
            "--heartbeat-ms".into(),
            self.heartbeat.as_millis().to_string(),
            "--max-message-mb".into(),
            (self.max_message_bytes as f64 / 1048576.0).to_string(),
            "--shutdown-grace-s".into(),
            self.shutdown_grace.as_secs_f64().to_string(),
        ]
    }
}

/// One host a launcher started: enough to connect to it and to say where it runs.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LaunchedHost {
    /// Position among the launched hosts (Slurm: the task's `SLURM_PROCID`).
    pub index: usize,
    /// The host's id (`host-<index>`).
    pub host_id: String,
    /// Address of the host's gRPC service (`ip:port`).
    pub addr: String,
    /// Node the host runs on (Slurm node name, or this machine's hostname).
    pub node: String,
    /// GPU ids the host offers (from `CUDA_VISIBLE_DEVICES` under Slurm).
    pub gpus: Vec<u32>,
}

/// Why hosts could not be launched. Slurm's own words are kept verbatim where there are any.
#[derive(Debug, thiserror::Error)]
pub enum LaunchError {
    /// The request or the launcher's settings cannot work.
    #[error("{0}")]
    Config(String),
    /// A command (`sbatch`, `srun`, `troupe host`) could not be run at all.
    #[error("cannot run {command}: {source}")]
    Spawn {
        /// The program.
        command: String,
        /// Why.
        source: std::io::Error,
    },
    /// Slurm refused the submission; `message` is its stderr.
    #[error("{command} failed: {message}")]
    Submit {
        /// The command line that was refused.
        command: String,
        /// Slurm's error output, verbatim.
        message: String,
    },
    /// The job (or local host) ended before every host reported.
    #[error("{what} ended before all hosts were up: {detail}")]
    Ended {
        /// Which job or process.
        what: String,
        /// Slurm's state and reason, plus the tail of the job's output.
        detail: String,
    },
    /// Not every host reported within the deadline.
    #[error("only {got} of {want} hosts reported within {waited:?}; {detail}")]
    Timeout {
        /// Reports received.
        got: usize,
        /// Reports expected.
        want: usize,
        /// The deadline.
        waited: Duration,
        /// The job's state and output tail (what it was waiting for).
        detail: String,
    },
    /// The rendezvous listener failed.
    #[error("host rendezvous: {0}")]
    Rendezvous(String),
    /// This launcher cannot add hosts to (or give hosts back from) a running cluster; the
    /// message says why and what to do instead.
    #[error("{0}")]
    CannotGrow(String),
}

/// Hosts a launcher added to a running cluster ([`HostLauncher::grow`]): one unit it gives
/// back whole ([`HostLauncher::release`]), e.g. one more Slurm job.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Grown {
    /// What to name in [`HostLauncher::release`] (Slurm: the job id).
    pub id: String,
    /// The new hosts, numbered from the `first_index` asked for.
    pub hosts: Vec<LaunchedHost>,
}

/// Starts actor hosts and stops them again.
///
/// Launchers keep whatever they started (child processes, a Slurm job) and release it in
/// [`HostLauncher::teardown`]; implementations also release it on drop, best effort, so a
/// controller that fails half-way leaves nothing running.
pub trait HostLauncher: Send + Sync {
    /// Short name for messages (`local`, `slurm`).
    fn name(&self) -> &'static str;

    /// Whether the hosts run inside the caller's own process. Such hosts live and die with it,
    /// so the controller never declares them lost for a missed heartbeat (which there only
    /// means the process was busy).
    fn in_this_process(&self) -> bool {
        false
    }

    /// Starts `req.n_hosts` hosts and returns them ordered by index, once every one has
    /// reported its address (or fails, having stopped whatever it started).
    fn launch<'a>(
        &'a self,
        req: &'a LaunchRequest,
    ) -> BoxFuture<'a, Result<Vec<LaunchedHost>, LaunchError>>;

    /// Adds `req.n_hosts` hosts to a running cluster, numbered (index and id) from
    /// `first_index` so they never clash with the hosts already there, and returns them once
    /// each reported (or fails, having stopped what it started). What the elastic fleet calls
    /// when a new server finds no free GPUs. [`HostLauncher::teardown`] stops them too.
    /// Launchers whose cluster has a fixed size refuse, saying so.
    fn grow<'a>(
        &'a self,
        req: &'a LaunchRequest,
        first_index: usize,
    ) -> BoxFuture<'a, Result<Grown, LaunchError>> {
        let _ = (req, first_index);
        let name = self.name();
        Box::pin(async move {
            Err(LaunchError::CannotGrow(format!(
                "the {name} launcher cannot add hosts to a running cluster: a new server must fit on the free GPUs of the hosts it has"
            )))
        })
    }

    /// Stops the hosts of one [`HostLauncher::grow`] (`id` is [`Grown::id`]) and gives their
    /// resources back (Slurm: `scancel` of that job); the other hosts keep running.
    fn release<'a>(&'a self, id: &'a str) -> BoxFuture<'a, Result<(), LaunchError>> {
        let name = self.name();
        Box::pin(async move {
            Err(LaunchError::CannotGrow(format!(
                "the {name} launcher added no hosts, so it has nothing ({id}) to give back"
            )))
        })
    }

    /// Stops every host this launcher started (those of [`HostLauncher::grow`] too);
    /// idempotent.
    fn teardown(&self) -> BoxFuture<'_, ()>;

    /// One line about what was launched (e.g. the Slurm job id and its log), if any.
    fn describe(&self) -> Option<String> {
        None
    }
}

/// Last `n` lines of a text file (empty when it cannot be read), for error messages.
pub(crate) fn tail(path: &std::path::Path, n: usize) -> String {
    match std::fs::read(path) {
        Ok(bytes) => {
            let text = String::from_utf8_lossy(&bytes);
            let lines: Vec<&str> = text.lines().collect();
            lines[lines.len().saturating_sub(n)..].join("\n")
        }
        Err(_) => String::new(),
    }
}
