//! `troupe host` child processes on this machine.
//!
//! Each host starts with `--listen 127.0.0.1:0` and the launcher learns its address from the
//! one line the host prints when it is ready ([`READY_PREFIX`]), so no port is ever guessed.
//! Every child leads its own process group, and the group is killed on teardown or drop.

use std::process::Stdio;
use std::sync::Mutex;
use std::time::Duration;

use nix::sys::signal::{Signal, killpg};
use nix::unistd::Pid;
use tokio::io::{AsyncBufReadExt, BufReader};
use tokio::process::{Child, Command};

use super::{BoxFuture, HostLauncher, LaunchError, LaunchRequest, LaunchedHost};

/// The line a ready host prints on stdout, followed by its address.
pub const READY_PREFIX: &str = "host listening on ";

/// How long a host gets to stop its actors after SIGTERM before the group is killed.
const STOP_GRACE: Duration = Duration::from_secs(10);

/// One child, killed (whole process group) on drop.
struct Group {
    child: Child,
    pgid: i32,
}

impl Group {
    async fn terminate(&mut self) {
        let pg = Pid::from_raw(self.pgid);
        if matches!(self.child.try_wait(), Ok(None)) {
            let _ = killpg(pg, Signal::SIGTERM);
            let _ = tokio::time::timeout(STOP_GRACE, self.child.wait()).await;
        }
        let _ = killpg(pg, Signal::SIGKILL); // stragglers of an exited leader
        let _ = self.child.wait().await;
    }
}

impl Drop for Group {
    fn drop(&mut self) {
        let _ = killpg(Pid::from_raw(self.pgid), Signal::SIGKILL);
    }
}

/// How long a local host waits for a controller to watch it before it stops by itself:
/// `$TROUPE_HOST_ORPHAN_GRACE_S`, else [`DEFAULT_ORPHAN_GRACE_S`]. Local hosts outlive their
/// controller on purpose (so `troupe serve --recover` can reattach), but not forever.
fn orphan_grace() -> String {
    std::env::var("TROUPE_HOST_ORPHAN_GRACE_S")
        .ok()
        .filter(|v| !v.trim().is_empty())
        .unwrap_or_else(|| DEFAULT_ORPHAN_GRACE_S.to_string())
}

/// Default orphan grace of local hosts, in seconds: ten minutes to run `--recover`.
pub const DEFAULT_ORPHAN_GRACE_S: u32 = 600;

/// Launches hosts as child processes of the controller (one machine, several hosts).
#[derive(Default)]
pub struct LocalLauncher {
    children: Mutex<Vec<Group>>,
}

impl LocalLauncher {
    /// A launcher that has started nothing yet.
    pub fn new() -> LocalLauncher {
        LocalLauncher::default()
    }

    async fn one(req: &LaunchRequest, index: usize) -> Result<(LaunchedHost, Group), LaunchError> {
        let host_id = format!("host-{index}");
        let bin = &req.binary;
        let mut cmd = Command::new(bin);
        cmd.arg("host")
            .args(["--listen", "127.0.0.1:0", "--host-id", &host_id])
            .args(req.host_flags())
            .args(["--orphan-grace-s", &orphan_grace()])
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .process_group(0);
        // Through the environment, not argv: argv is visible to every user on the machine.
        req.apply_env(&mut cmd);
        let gpus: Vec<u32> = (0..req.gpus_per_host).collect();
        if !gpus.is_empty() {
            let g: Vec<String> = gpus.iter().map(|g| g.to_string()).collect();
            cmd.args(["--gpus", &g.join(",")]);
        }
        let mut child = cmd.spawn().map_err(|source| LaunchError::Spawn {
            command: format!("{} host", bin.display()),
            source,
        })?;
        let pgid = child
            .id()
            .map(|p| p as i32)
            .ok_or_else(|| LaunchError::Ended {
                what: host_id.clone(),
                detail: "exited before its pid was read".into(),
            })?;
        let out = child.stdout.take();
        let group = Group { child, pgid };
        let out = out.ok_or_else(|| LaunchError::Config("host stdout was not captured".into()))?;
        let mut lines = BufReader::new(out).lines();
        let wait = async {
            while let Ok(Some(line)) = lines.next_line().await {
                if let Some(a) = line.strip_prefix(READY_PREFIX) {
                    return Ok(a.trim().to_string());
                }
            }
            Err(LaunchError::Ended {
                what: host_id.clone(),
                detail: "exited before it was ready (see its stderr above)".into(),
            })
        };
        let addr = tokio::time::timeout(req.startup_timeout, wait)
            .await
            .map_err(|_| LaunchError::Timeout {
                got: 0,
                want: 1,
                waited: req.startup_timeout,
                detail: format!("{host_id} did not print its address"),
            })??;
        // Keep draining stdout so the host never blocks on a full pipe.
        tokio::spawn(async move { while let Ok(Some(_)) = lines.next_line().await {} });
        let host = LaunchedHost {
            index,
            host_id,
            addr,
            node: super::report::node_name(),
            gpus,
        };
        Ok((host, group))
    }

    async fn stop(&self) {
        let groups = self
            .children
            .lock()
            .map(|mut c| std::mem::take(&mut *c))
            .unwrap_or_default();
        futures::future::join_all(groups.into_iter().map(|mut g| async move {
            g.terminate().await;
        }))
        .await;
    }
}

impl HostLauncher for LocalLauncher {
    fn name(&self) -> &'static str {
        "local"
    }

    fn launch<'a>(
        &'a self,
        req: &'a LaunchRequest,
    ) -> BoxFuture<'a, Result<Vec<LaunchedHost>, LaunchError>> {
        Box::pin(async move {
            let started =
                futures::future::join_all((0..req.n_hosts).map(|i| Self::one(req, i))).await;
            let mut hosts = Vec::with_capacity(req.n_hosts);
            let mut first_err = None;
            for r in started {
                match r {
                    Ok((h, g)) => {
                        hosts.push(h);
                        if let Ok(mut c) = self.children.lock() {
                            c.push(g);
                        }
                    }
                    Err(e) => {
                        first_err.get_or_insert(e);
                    }
                }
            }
            if let Some(e) = first_err {
                self.stop().await;
                return Err(e);
            }
            Ok(hosts)
        })
    }

    /// Refused: local hosts stand for the nodes of `cluster.n_nodes`, all on this machine.
    fn grow<'a>(
        &'a self,
        _req: &'a LaunchRequest,
        _first_index: usize,
    ) -> BoxFuture<'a, Result<super::Grown, LaunchError>> {
        Box::pin(async {
            Err(LaunchError::CannotGrow(
                "the local launcher does not add hosts to a running cluster (its hosts stand for cluster.n_nodes nodes, all on this machine): a new server must fit on the free GPUs of those hosts; start with more nodes or GPUs (cluster.n_nodes, cluster.n_gpus_per_node), or remove a server first".into(),
            ))
        })
    }

    fn teardown(&self) -> BoxFuture<'_, ()> {
        Box::pin(self.stop())
    }
}
