//! Hosts on a Ray cluster: one placement-group bundle per host, a small Ray actor on each
//! running `troupe host --report-to` as its child.
//!
//! Ray's API is Python, so the launcher runs its Python half (`python/troupe/ray_launcher.py`,
//! compiled in as [`LAUNCHER_PY`]) as a child process with the configured interpreter: the
//! launch spec goes in on its stdin (the token and TLS paths only in its environment), events
//! come back on its stdout, and every host reports its address through the same
//! [`Rendezvous`] as under Slurm. While hosts come up, the launcher fails as soon as the Python
//! half reports an error — a placement group Ray finds infeasible (in Ray's words, with what the
//! nodes offer), a binary a node cannot run, a host that exits — rather than at the deadline.
//! After start-up it logs each host whose actor or node Ray reports dead; the controller sees the
//! host go on its own (its event stream ends) and re-places its servers on the hosts that remain.
//! Teardown closes the child's stdin (it stops the hosts, kills the actors and removes the
//! placement group) and waits for it; the child is in its own process group, killed on drop.

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::process::Stdio;
use std::sync::Mutex;
use std::time::Duration;

use nix::sys::signal::{Signal, killpg};
use nix::unistd::Pid;
use tokio::io::{AsyncBufReadExt, AsyncWriteExt, BufReader};
use tokio::net::TcpStream;
use tokio::process::{Child, ChildStdin, Command};
use tokio::sync::mpsc;

use super::ray_spec::{LAUNCHER_PY, RayEvent, RayOptions, parse_event, short_node, spec, work_dir};
use super::report::{Arrival, open_reports, routable_ip};
use super::{BoxFuture, HostLauncher, LaunchError, LaunchRequest, LaunchedHost, tail};

/// Lines of the launcher's log quoted in errors.
const TAIL_LINES: usize = 20;
/// How long teardown waits for the Python half to stop the hosts and remove the group.
const STOP_WAIT: Duration = Duration::from_secs(60);
/// How long teardown waits for it when nothing was placed yet (it exits at once then).
const STOP_WAIT_UNPLACED: Duration = Duration::from_secs(5);

/// What the launcher started, for teardown.
#[derive(Default)]
struct Started {
    child: Option<Child>,
    stdin: Option<ChildStdin>,
    dir: Option<PathBuf>,
    links: Vec<TcpStream>,
    watcher: Option<tokio::task::JoinHandle<()>>,
    placement_group: Option<String>,
    /// Where each host runs: (node id, actor pid, host pid).
    hosts: BTreeMap<usize, (String, u32, u32)>,
}

/// Launches hosts on a Ray cluster (see the module docs).
pub struct RayLauncher {
    opts: RayOptions,
    started: Mutex<Started>,
}

impl RayLauncher {
    /// A launcher with these settings; nothing runs until [`HostLauncher::launch`].
    pub fn new(opts: RayOptions) -> RayLauncher {
        RayLauncher {
            opts,
            started: Mutex::new(Started::default()),
        }
    }

    /// The id of the placement group holding the hosts, once Ray created it.
    pub fn placement_group(&self) -> Option<String> {
        self.set(|s| s.placement_group.clone()).flatten()
    }

    /// Pid of host `index`'s Ray actor (the parent of its `troupe host`), once it started.
    pub fn actor_pid(&self, index: usize) -> Option<u32> {
        self.set(|s| s.hosts.get(&index).map(|h| h.1)).flatten()
    }

    fn set<T>(&self, f: impl FnOnce(&mut Started) -> T) -> Option<T> {
        self.started.lock().ok().map(|mut s| f(&mut s))
    }

    fn log_path(&self) -> Option<PathBuf> {
        self.set(|s| s.dir.as_ref().map(|d| d.join("launcher.log")))
            .flatten()
    }

    fn log_tail(&self) -> String {
        match self.log_path() {
            Some(p) => {
                let t = tail(&p, TAIL_LINES);
                if t.is_empty() {
                    String::new()
                } else {
                    format!("\n--- {} (last lines) ---\n{t}", p.display())
                }
            }
            None => String::new(),
        }
    }

    /// Starts the Python half; its events arrive on the returned channel.
    async fn spawn(
        &self,
        req: &LaunchRequest,
        report_to: &str,
    ) -> Result<mpsc::Receiver<RayEvent>, LaunchError> {
        let dir = work_dir();
        std::fs::create_dir_all(&dir)
            .map_err(|e| LaunchError::Config(format!("cannot create {}: {e}", dir.display())))?;
        self.set(|s| s.dir = Some(dir.clone()));
        let script = dir.join("ray_launcher.py");
        std::fs::write(&script, LAUNCHER_PY)
            .map_err(|e| LaunchError::Config(format!("cannot write {}: {e}", script.display())))?;
        let log_path = dir.join("launcher.log");
        let log = std::fs::File::create(&log_path).map_err(|e| {
            LaunchError::Config(format!("cannot create {}: {e}", log_path.display()))
        })?;
        let name = dir
            .file_name()
            .map(|n| n.to_string_lossy().to_string())
            .unwrap_or_else(|| "troupe-ray".into());
        let mut cmd = Command::new(&self.opts.python);
        cmd.arg("-u")
            .arg(&script)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(log)
            .process_group(0)
            .kill_on_drop(true);
        // The token and TLS paths: in the environment only (the spec names the variables).
        req.apply_env(&mut cmd);
        let mut child = cmd.spawn().map_err(|source| LaunchError::Spawn {
            command: format!("{} (scheduler.python)", self.opts.python),
            source,
        })?;
        let mut stdin = child
            .stdin
            .take()
            .ok_or_else(|| LaunchError::Config("launcher stdin was not captured".into()))?;
        let stdout = child
            .stdout
            .take()
            .ok_or_else(|| LaunchError::Config("launcher stdout was not captured".into()))?;
        let mut line = spec(&self.opts, req, report_to, &name).to_string();
        line.push('\n');
        let wrote = stdin.write_all(line.as_bytes()).await;
        self.set(|s| {
            s.child = Some(child);
            s.stdin = Some(stdin);
        });
        wrote.map_err(|e| LaunchError::Ended {
            what: "the Ray launcher".into(),
            detail: format!("could not take its spec: {e}{}", self.log_tail()),
        })?;
        let (tx, rx) = mpsc::channel(256);
        tokio::spawn(async move {
            let mut lines = BufReader::new(stdout).lines();
            while let Ok(Some(l)) = lines.next_line().await {
                if let Some(ev) = parse_event(&l)
                    && tx.send(ev).await.is_err()
                {
                    // Nobody listens any more; keep draining so the child never blocks.
                    while let Ok(Some(_)) = lines.next_line().await {}
                    break;
                }
            }
        });
        Ok(rx)
    }

    /// Notes what an event says about the hosts; an error (for start-up) when it ends them.
    fn note(&self, ev: &RayEvent) -> Option<String> {
        match ev {
            RayEvent::Placing { placement_group }
            | RayEvent::Placed {
                placement_group, ..
            } => {
                let pg = placement_group.clone();
                self.set(|s| s.placement_group = Some(pg));
                None
            }
            RayEvent::Started {
                index,
                pid,
                actor_pid,
                node_id,
                ..
            } => {
                let h = (node_id.clone(), *actor_pid, *pid);
                self.set(|s| s.hosts.insert(*index, h));
                None
            }
            RayEvent::Error { message, .. } => Some(message.clone()),
            RayEvent::Exited { index, code, tail } => Some(format!(
                "host {index} exited ({}) before it was ready; its last output:\n{}",
                code.map(|c| format!("code {c}"))
                    .unwrap_or_else(|| "killed by a signal".into()),
                tail.join("\n")
            )),
            RayEvent::Lost { index, why } => Some(format!("host {index}'s Ray actor died: {why}")),
            RayEvent::Done => Some("the Ray launcher stopped".into()),
        }
    }

    async fn wait_reports(
        &self,
        req: &LaunchRequest,
        mut arrivals: mpsc::Receiver<Result<Arrival, LaunchError>>,
        events: &mut mpsc::Receiver<RayEvent>,
    ) -> Result<Vec<LaunchedHost>, LaunchError> {
        let deadline = tokio::time::Instant::now() + req.startup_timeout;
        let mut hosts: BTreeMap<usize, LaunchedHost> = BTreeMap::new();
        let mut refused: Vec<String> = Vec::new();
        // Every host reported and the launcher said where each one's actor runs (a host may
        // report before the launcher has read its actor's answer).
        let started = || self.set(|s| s.hosts.len()).unwrap_or(0);
        while hosts.len() < req.n_hosts || started() < req.n_hosts {
            tokio::select! {
                a = arrivals.recv() => match a {
                    Some(Ok(Arrival::Report(r, link))) => {
                        if r.index >= req.n_hosts || hosts.contains_key(&r.index) {
                            refused.push(format!("unexpected report {r:?}"));
                            continue;
                        }
                        self.set(|s| s.links.push(link));
                        hosts.insert(r.index, LaunchedHost {
                            index: r.index, host_id: r.host_id, addr: r.addr, node: r.node, gpus: r.gpus,
                        });
                    }
                    Some(Ok(Arrival::Refused(why))) => refused.push(why),
                    Some(Err(e)) => return Err(e),
                    None => return Err(LaunchError::Rendezvous("listener stopped".into())),
                },
                ev = events.recv() => match ev {
                    Some(ev) => {
                        if let Some(why) = self.note(&ev) {
                            let mut detail = why;
                            if !refused.is_empty() {
                                detail.push_str(&format!("; refused reports: {}", refused.join("; ")));
                            }
                            detail.push_str(&self.log_tail());
                            return Err(LaunchError::Ended { what: self.what(), detail });
                        }
                    }
                    None => {
                        let status = self.set(|s| s.child.as_mut().map(|c| c.try_wait())).flatten();
                        let head = match status {
                            Some(Ok(Some(st))) => format!("it exited ({st})"),
                            _ => "it closed its output".into(),
                        };
                        return Err(LaunchError::Ended { what: self.what(), detail: format!("{head}{}", self.log_tail()) });
                    }
                },
                _ = tokio::time::sleep_until(deadline) => {
                    let mut head = format!("{} of {} hosts started by Ray", self.set(|s| s.hosts.len()).unwrap_or(0), req.n_hosts);
                    match self.placement_group() {
                        Some(pg) => head.push_str(&format!(" (placement group {pg})")),
                        None => head.push_str(&format!(
                            "; the launcher was still connecting to the Ray cluster at {} (scheduler.address)",
                            self.opts.address
                        )),
                    }
                    if !refused.is_empty() {
                        head.push_str(&format!("; refused reports: {}", refused.join("; ")));
                    }
                    head.push_str(&self.log_tail());
                    return Err(LaunchError::Timeout { got: hosts.len(), want: req.n_hosts, waited: req.startup_timeout, detail: head });
                }
            }
        }
        // Name each host's node by Ray's node id: several Ray nodes may share one machine
        // (and one hostname), and the node id is what `ray` tools show.
        let nodes = self.set(|s| s.hosts.clone()).unwrap_or_default();
        Ok(hosts
            .into_values()
            .map(|mut h| {
                if let Some((node, _, _)) = nodes.get(&h.index) {
                    h.node = short_node(node);
                }
                h
            })
            .collect())
    }

    fn what(&self) -> String {
        format!("the Ray launcher (cluster {})", self.opts.address)
    }

    /// After start-up, logs each host that Ray reports gone (its actor killed, its node lost);
    /// the controller sees the host go on its own and re-places its servers.
    fn watch(&self, mut events: mpsc::Receiver<RayEvent>) {
        let task = tokio::spawn(async move {
            while let Some(ev) = events.recv().await {
                match ev {
                    RayEvent::Lost { index, why } => {
                        tracing::error!("ray: host {index}'s actor died under it: {why}")
                    }
                    RayEvent::Exited { index, code, tail } => tracing::error!(
                        "ray: host {index} exited ({code:?}); last output:\n{}",
                        tail.join("\n")
                    ),
                    RayEvent::Error { message, .. } => tracing::error!("ray: {message}"),
                    _ => {}
                }
            }
        });
        self.set(|s| s.watcher = Some(task));
    }

    async fn stop(&self) {
        let wait = if self.placement_group().is_some() {
            STOP_WAIT
        } else {
            STOP_WAIT_UNPLACED
        };
        let (child, stdin, links, watcher, dir) = self
            .set(|s| {
                (
                    s.child.take(),
                    s.stdin.take(),
                    std::mem::take(&mut s.links),
                    s.watcher.take(),
                    s.dir.take(),
                )
            })
            .unwrap_or_default();
        // Hosts exiting from here on are the teardown's doing, not news.
        if let Some(w) = watcher {
            w.abort();
        }
        drop(links); // hosts see the controller go and start stopping their actors
        drop(stdin); // the Python half stops the hosts, kills the actors, removes the group
        if let Some(mut child) = child {
            if tokio::time::timeout(wait, child.wait()).await.is_err() {
                tracing::warn!(
                    "the Ray launcher did not stop within {wait:?}; killing it (Ray removes its actors and placement group with its job)"
                );
            }
            if let Some(pid) = child.id() {
                let _ = killpg(Pid::from_raw(pid as i32), Signal::SIGKILL);
            }
            let _ = child.wait().await;
        }
        if let Some(d) = dir {
            let _ = std::fs::remove_dir_all(d);
        }
    }
}

impl HostLauncher for RayLauncher {
    fn name(&self) -> &'static str {
        "ray"
    }

    fn launch<'a>(
        &'a self,
        req: &'a LaunchRequest,
    ) -> BoxFuture<'a, Result<Vec<LaunchedHost>, LaunchError>> {
        Box::pin(async move {
            let ip = self.opts.report_ip.unwrap_or_else(routable_ip);
            let (report_to, rx, accept) = open_reports(ip, req, "Ray").await?;
            let result = match self.spawn(req, &report_to).await {
                Ok(mut events) => match self.wait_reports(req, rx, &mut events).await {
                    Ok(hosts) => {
                        self.watch(events);
                        Ok(hosts)
                    }
                    Err(e) => Err(e),
                },
                Err(e) => Err(e),
            };
            accept.abort();
            if result.is_err() {
                self.stop().await;
            }
            result
        })
    }

    /// Refused: the hosts are the bundles of one placement group, whose size Ray fixes when it
    /// is created.
    fn grow<'a>(
        &'a self,
        _req: &'a LaunchRequest,
        _first_index: usize,
    ) -> BoxFuture<'a, Result<super::Grown, LaunchError>> {
        Box::pin(async {
            Err(LaunchError::CannotGrow(
                "the Ray launcher does not add hosts to a running cluster (its hosts are the bundles of one placement group, whose size Ray fixes at creation): a new server must fit on the free GPUs of those hosts; start with more (cluster.n_nodes, cluster.n_gpus_per_node), or remove a server first".into(),
            ))
        })
    }

    fn teardown(&self) -> BoxFuture<'_, ()> {
        Box::pin(self.stop())
    }

    fn describe(&self) -> Option<String> {
        let pg = self.placement_group()?;
        let hosts = self.set(|s| s.hosts.clone()).unwrap_or_default();
        let actors: Vec<String> = hosts
            .iter()
            .map(|(i, (node, actor, host))| {
                format!(
                    "host {i}: node {} actor pid {actor} host pid {host}",
                    short_node(node)
                )
            })
            .collect();
        Some(format!(
            "ray placement group {pg} on cluster {} ({})",
            self.opts.address,
            actors.join(", ")
        ))
    }
}

impl Drop for RayLauncher {
    fn drop(&mut self) {
        // Best effort and synchronous: the Python half's process group goes; Ray then removes
        // its job's actors and placement group, and the hosts die with their actors.
        if let Ok(s) = self.started.get_mut() {
            if let Some(pid) = s.child.as_ref().and_then(|c| c.id()) {
                let _ = killpg(Pid::from_raw(pid as i32), Signal::SIGKILL);
            }
            if let Some(d) = s.dir.take() {
                let _ = std::fs::remove_dir_all(d);
            }
        }
    }
}
