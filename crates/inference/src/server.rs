//! `troupe.inference`: the InferenceServer actor. It owns one server process (SGLang, vLLM or
//! the reference engine), waits until it serves, and reports where and what it is.
//!
//! The server's whole process tree dies with the actor. If it fails to come up, the spawn fails
//! with the last lines of its log, which is what an operator needs first. It counts as ready only
//! when `/health` answers *and* the listening socket belongs to the child's process group
//! ([`troupe_actors::sockets`]); an answer from any other process is reported as
//! `Address already in use`, which the controller's fork relaunches on fresh ports.

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};
use troupe_wire::Endpoint as _;
use troupe_wire::endpoints as ep;

use std::sync::Arc;

use serde::{Deserialize, Serialize};
use tokio_util::sync::CancellationToken;

use super::command::{self, CommandLine};
use super::rundir;
use super::spec::{LaunchSpec, WorkerType};
use troupe_actors::ActorError;
use troupe_actors::actor::{Actor, ActorContext, Handler, Message, Methods};
use troupe_actors::process::ChildProcess;
use troupe_http::probe::{ProbeError, probe};
use troupe_http::upstream::UpstreamClient;

/// What a running server is, as the controller and router need it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ServerInfo {
    /// `host:port` clients reach the server at.
    pub addr: String,
    /// `http://host:port`.
    pub url: String,
    /// Regular, prefill or decode.
    pub worker_type: WorkerType,
    /// Host decode servers contact for this prefill's KV.
    pub bootstrap_host: Option<String>,
    /// This server's bootstrap port (prefills; decode servers have none).
    pub bootstrap_port: Option<u16>,
    /// GPUs the server occupies.
    pub gpu_count: u32,
    /// The server process's pid.
    pub pid: u32,
    /// Where its log is (in this host process's private run directory unless the launch spec
    /// named one).
    pub log_path: String,
    /// The program and arguments it was launched with (never a secret: those travel in the
    /// environment or a private file), so what runs can be compared with `troupe plan`.
    #[serde(default)]
    pub command: Vec<String>,
    /// How long the server took to come up, in ms: from its process's spawn to its first
    /// healthy answer (a node not waited for: to its spawn). The server's own start time, so
    /// a fork's bring-up can be compared with its slowest server. 0 when not known (a server
    /// reattached from an older state file).
    #[serde(default)]
    pub ready_ms: u64,
}

/// The InferenceServer actor.
pub struct InferenceServer {
    child: Arc<tokio::sync::Mutex<ChildProcess>>,
    client: UpstreamClient,
    info: ServerInfo,
    log: PathBuf,
    /// Cancelled on a requested stop, so the watcher does not report that exit as a failure.
    stopping: CancellationToken,
    /// The server's private config files, removed once it is ready or when the actor ends.
    _secrets: SecretFiles,
}

/// Private files written for one server launch (SGLang's admin-key config), removed when this
/// drops, however the launch ends, or earlier by [`SecretFiles::remove`].
struct SecretFiles(Vec<PathBuf>);

impl SecretFiles {
    fn remove(&mut self) {
        for p in self.0.drain(..) {
            if let Err(e) = std::fs::remove_file(&p)
                && e.kind() != std::io::ErrorKind::NotFound
            {
                tracing::warn!(path = %p.display(), "cannot remove a server's config file: {e}");
            }
        }
    }
}

impl Drop for SecretFiles {
    fn drop(&mut self) {
        self.remove();
    }
}

impl Drop for InferenceServer {
    fn drop(&mut self) {
        // However the actor ends (stop, kill, failure), release the watcher's hold on the child
        // so the last reference drops and `ChildProcess` kills the process tree.
        self.stopping.cancel();
    }
}

/// Waits for the server process to exit on its own and reports the actor failed, so the
/// supervisor restarts it per policy (on the same ports: proxies and the router find it again).
fn watch(
    child: Arc<tokio::sync::Mutex<ChildProcess>>,
    stopping: CancellationToken,
    fail: Option<troupe_actors::FailHandle>,
    name: String,
    log: PathBuf,
) {
    troupe_actors::process::watch_exit(child, stopping, move |status| {
        let why = match status {
            Ok(s) => format!("server {name} exited ({s})"),
            Err(e) => format!("server {name} could not be waited for: {e}"),
        };
        tracing::warn!(%why, "inference server died");
        rundir::keep();
        if let Some(f) = fail {
            f.fail(format!("{why}; last log lines:\n{}", tail(&log, 10)));
        }
    });
}

/// Asks for the server's [`ServerInfo`].
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct GetInfo;

impl Message for GetInfo {
    type Reply = ServerInfo;
    const METHOD: &'static str = "info";
}

/// Asks whether the process runs and answers `/health`.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct CheckHealth;

/// Reply to [`CheckHealth`].
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ServerHealth {
    /// The process has not exited.
    pub running: bool,
    /// Its exit code, once exited.
    pub exit_code: Option<i32>,
    /// `/health` answered 200.
    pub healthy: bool,
}

impl Message for CheckHealth {
    type Reply = ServerHealth;
    const METHOD: &'static str = "health";
}

/// Asks for the last `lines` lines of the server's log.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct LogTail {
    /// How many lines.
    pub lines: usize,
}

impl Message for LogTail {
    type Reply = String;
    const METHOD: &'static str = "log_tail";
}

/// The last `n` lines of a log file (empty if unreadable).
pub fn tail(path: &Path, n: usize) -> String {
    let text = std::fs::read_to_string(path).unwrap_or_default();
    let lines: Vec<&str> = text.lines().collect();
    lines[lines.len().saturating_sub(n)..].join("\n")
}

fn troupe_bin(spec: &LaunchSpec) -> Result<String, ActorError> {
    match &spec.troupe_bin {
        Some(p) => Ok(p.display().to_string()),
        None => troupe_actors::process::troupe_binary()
            .map(|p| p.display().to_string())
            .map_err(ActorError::new),
    }
}

async fn healthy(client: &UpstreamClient, url: &str) -> bool {
    for path in [ep::Health::PATH, ep::Ready::PATH] {
        match probe(client, &format!("{url}{path}"), Duration::from_secs(5)).await {
            Ok(s) if s.is_success() => return true,
            // Nothing listens yet: the other path would not connect either.
            Err(ProbeError::Unreachable(_)) => return false,
            Ok(_) | Err(ProbeError::Failed(_)) => {}
        }
    }
    false
}

impl Actor for InferenceServer {
    const KIND: &'static str = "troupe.inference";
    type Args = LaunchSpec;

    async fn start(spec: LaunchSpec, ctx: &ActorContext) -> Result<Self, ActorError> {
        // A vLLM server's Python is asked once (a process start): off the runtime's threads.
        let spec = if super::vllm_plugin::wants_backend(&spec) {
            tokio::task::spawn_blocking(move || {
                let mut spec = spec;
                super::vllm_plugin::choose_backend(&mut spec);
                spec
            })
            .await
            .map_err(|e| ActorError::new(format!("choosing the weight-transfer backend: {e}")))?
        } else {
            spec
        };
        let run_dir = rundir::get().map_err(ActorError::new)?;
        let cl = command::build(&spec, &troupe_bin(&spec)?, run_dir)
            .map_err(|e| ActorError::new(format!("bad launch spec: {e}")))?;
        let log = spec.log_path.clone().unwrap_or_else(|| {
            let short: String = ctx.actor_id.chars().take(8).collect();
            run_dir.join(format!("{}-{short}.log", rundir::file_stem(&ctx.name)))
        });
        let mut secrets = SecretFiles(command::write_files(&cl).map_err(ActorError::new)?);
        let CommandLine { program, args, .. } = &cl;
        let spawned = Instant::now();
        let mut child = ChildProcess::spawn(command::command(&cl), Some(&log))
            .map_err(|e| ActorError::new(format!("cannot start {program}: {e}")))?;
        tracing::info!(server = %ctx.name, %program, ?args, log = %log.display(), "server starting");

        let url = spec.url();
        let client = UpstreamClient::new();
        let deadline = Instant::now() + Duration::from_secs_f64(spec.ready_timeout_s.max(0.1));
        loop {
            if let Some(status) = child.try_status()? {
                rundir::keep();
                return Err(ActorError::new(format!(
                    "server {} exited during startup ({status}); last log lines from {}:\n{}",
                    ctx.name,
                    log.display(),
                    tail(&log, 30)
                )));
            }
            if !spec.wait_ready {
                break;
            }
            if healthy(&client, &url).await {
                // Ready only if the answer came from our child: with another deployment on this
                // machine, its engine may answer on this port while our child fails to bind.
                // Asked of the kernel off the async workers: hundreds of servers start at once.
                let (pgid, port) = (child.pid(), spec.port);
                let ours = tokio::task::spawn_blocking(move || {
                    troupe_actors::sockets::group_listens_on(pgid, port)
                })
                .await
                .unwrap_or(None);
                if ours == Some(false) {
                    let _ = child.terminate(Duration::from_secs(5)).await;
                    return Err(ActorError::new(format!(
                        "server {}: port {} answers, but not from the server launched here: Address already in use (another process listens on it); relaunch it on other ports",
                        ctx.name, spec.port
                    )));
                }
                // Read once at start: the secret need not outlive it on disk.
                secrets.remove();
                break;
            }
            if Instant::now() > deadline {
                rundir::keep();
                let _ = child.terminate(Duration::from_secs(5)).await;
                return Err(ActorError::new(format!(
                    "server {} not ready within {:.0} s at {url}; last log lines from {}:\n{}",
                    ctx.name,
                    spec.ready_timeout_s,
                    log.display(),
                    tail(&log, 30)
                )));
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        let pd = spec.worker_type != WorkerType::Regular;
        let info = ServerInfo {
            addr: format!("{}:{}", spec.advertise_host, spec.port),
            url,
            worker_type: spec.worker_type,
            bootstrap_host: pd.then(|| spec.advertise_host.clone()),
            bootstrap_port: if pd { spec.bootstrap_port } else { None },
            gpu_count: spec.gpu_count(),
            pid: child.pid(),
            log_path: log.display().to_string(),
            command: std::iter::once(cl.program.clone())
                .chain(cl.args.iter().cloned())
                .collect(),
            ready_ms: u64::try_from(spawned.elapsed().as_millis()).unwrap_or(u64::MAX),
        };
        let child = Arc::new(tokio::sync::Mutex::new(child));
        let stopping = CancellationToken::new();
        watch(
            child.clone(),
            stopping.clone(),
            ctx.fail_handle(),
            ctx.name.clone(),
            log.clone(),
        );
        Ok(InferenceServer {
            child,
            client,
            info,
            log,
            stopping,
            _secrets: secrets,
        })
    }

    fn methods(m: &mut Methods<Self>) {
        m.add::<GetInfo>().add::<CheckHealth>().add::<LogTail>();
    }

    async fn stopping(&mut self, _ctx: &ActorContext) {
        self.stopping.cancel();
        let _ = self
            .child
            .lock()
            .await
            .terminate(Duration::from_secs(10))
            .await;
    }
}

impl Handler<GetInfo> for InferenceServer {
    async fn handle(&mut self, _m: GetInfo, _c: &ActorContext) -> Result<ServerInfo, ActorError> {
        Ok(self.info.clone())
    }
}

impl Handler<CheckHealth> for InferenceServer {
    async fn handle(
        &mut self,
        _m: CheckHealth,
        _c: &ActorContext,
    ) -> Result<ServerHealth, ActorError> {
        let status = match self.child.try_lock() {
            Ok(mut c) => c.try_status()?,
            // The watcher holds the lock only while the process runs.
            Err(_) => None,
        };
        let healthy = status.is_none() && healthy(&self.client, &self.info.url).await;
        Ok(ServerHealth {
            running: status.is_none(),
            exit_code: status.and_then(|s| s.code()),
            healthy,
        })
    }
}

impl Handler<LogTail> for InferenceServer {
    async fn handle(&mut self, m: LogTail, _c: &ActorContext) -> Result<String, ActorError> {
        Ok(tail(&self.log, m.lines.min(10_000)))
    }
}
