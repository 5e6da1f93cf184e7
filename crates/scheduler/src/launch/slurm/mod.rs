//! Hosts as one Slurm job: one `troupe host` task per node, each on that node's GPUs.
//!
//! Outside an allocation the launcher submits a generated batch script with `sbatch` (the
//! script runs one `srun` step, one task per node); inside one (`SLURM_JOB_ID` set) it runs
//! that `srun` itself. Every host reports its address through the [`Rendezvous`]. While it
//! waits, the launcher polls `scontrol show job` (no accounting database needed) and fails as
//! soon as the job has ended, with Slurm's own state and reason and the tail of the job's
//! output. Teardown is `scancel`; dropping the launcher without teardown still cancels
//! (synchronously), so a controller that errors out does not leave the job running.
//!
//! A running cluster grows by one more job ([`HostLauncher::grow`]: always `sbatch`, with the
//! same options, its hosts numbered after the others and reporting to a rendezvous of their
//! own) and gives such a job back whole ([`HostLauncher::release`]: its links closed, then
//! `scancel`); teardown and drop cancel the added jobs too.

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::process::Stdio;
use std::sync::Mutex;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use tokio::net::TcpStream;
use tokio::process::{Child, Command};
use tokio::sync::mpsc;

mod grow;

use grow::{Added, release_added};

use super::report::{Arrival, open_reports, routable_ip};
use super::slurm_cmd::{
    JobInfo, SlurmOptions, batch_script_at, parse_job_info, sbatch_args, srun_args,
};
use super::{BoxFuture, Grown, HostLauncher, LaunchError, LaunchRequest, LaunchedHost, tail};

/// How often the job's state is polled while hosts come up.
const POLL: Duration = Duration::from_millis(500);
/// Lines of the job's output quoted in errors.
const TAIL_LINES: usize = 20;
/// How long a COMPLETING job (its processes exiting) is given to settle into its final state
/// before an error reports it as it is.
const SETTLE: Duration = Duration::from_secs(10);
/// How often a running job is checked after start-up.
const WATCH: Duration = Duration::from_secs(2);

/// What the launcher started, for teardown.
#[derive(Default)]
struct Started {
    job: Option<String>,
    srun: Option<Child>,
    output: Option<PathBuf>,
    links: Vec<TcpStream>,
    watcher: Option<tokio::task::JoinHandle<()>>,
    /// Jobs added to the running cluster ([`HostLauncher::grow`]), by job id.
    added: BTreeMap<String, Added>,
}

/// What one wait for host reports watches: a submitted job (`job`), or the launcher's own
/// `srun` step (`job` is `None`); hosts numbered from `base`.
struct Target {
    job: Option<String>,
    output: Option<PathBuf>,
    base: usize,
}

impl Target {
    fn what(&self) -> String {
        match &self.job {
            Some(j) => format!("slurm job {j}"),
            None => "srun".into(),
        }
    }
}

/// Launches hosts as a Slurm job (see the module docs).
pub struct SlurmLauncher {
    opts: SlurmOptions,
    started: Mutex<Started>,
}

impl SlurmLauncher {
    /// A launcher with these settings; nothing runs until [`HostLauncher::launch`].
    pub fn new(opts: SlurmOptions) -> SlurmLauncher {
        SlurmLauncher {
            opts,
            started: Mutex::new(Started::default()),
        }
    }

    /// The id of the job this launcher submitted, if any.
    pub fn job_id(&self) -> Option<String> {
        self.started.lock().ok().and_then(|s| s.job.clone())
    }

    /// The job's current state as Slurm reports it (`None` without a job, or when Slurm no
    /// longer knows it).
    pub async fn job_info(&self) -> Option<JobInfo> {
        let job = self.job_id()?;
        job_info(&job).await
    }

    fn set<T>(&self, f: impl FnOnce(&mut Started) -> T) -> Option<T> {
        self.started.lock().ok().map(|mut s| f(&mut s))
    }

    fn in_allocation(&self) -> Option<String> {
        if !self.opts.use_allocation {
            return None;
        }
        std::env::var("SLURM_JOB_ID").ok().filter(|j| !j.is_empty())
    }

    async fn submit(&self, req: &LaunchRequest, report_to: &str) -> Result<(), LaunchError> {
        let dir = &self.opts.log_dir;
        std::fs::create_dir_all(dir).map_err(|e| {
            LaunchError::Config(format!(
                "scheduler.log_dir {}: cannot create it: {e}",
                dir.display()
            ))
        })?;
        let stamp = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map(|d| d.as_millis())
            .unwrap_or_default();
        let token_env = |cmd: &mut Command| req.apply_env(cmd);
        if let Some(alloc) = self.in_allocation() {
            let out = dir.join(format!("troupe-hosts-{alloc}-{stamp}.out"));
            let log = std::fs::File::create(&out).map_err(|e| {
                LaunchError::Config(format!("cannot create {}: {e}", out.display()))
            })?;
            let err = log
                .try_clone()
                .map_err(|e| LaunchError::Config(e.to_string()))?;
            let args = srun_args(&self.opts, req, report_to);
            let mut cmd = Command::new("srun");
            cmd.args(&args)
                .stdin(Stdio::null())
                .stdout(log)
                .stderr(err)
                .process_group(0)
                .kill_on_drop(true);
            token_env(&mut cmd);
            let child = cmd.spawn().map_err(|source| LaunchError::Spawn {
                command: "srun".into(),
                source,
            })?;
            self.set(|s| {
                s.srun = Some(child);
                s.output = Some(out);
            });
            return Ok(());
        }
        let (job, output) = self.sbatch(req, report_to, 0).await?;
        self.set(|s| {
            s.job = Some(job);
            s.output = Some(output);
        });
        Ok(())
    }

    /// Submits one job of `req.n_hosts` hosts numbered from `base`: its id and output file.
    async fn sbatch(
        &self,
        req: &LaunchRequest,
        report_to: &str,
        base: usize,
    ) -> Result<(String, PathBuf), LaunchError> {
        let dir = &self.opts.log_dir;
        std::fs::create_dir_all(dir).map_err(|e| {
            LaunchError::Config(format!(
                "scheduler.log_dir {}: cannot create it: {e}",
                dir.display()
            ))
        })?;
        let stamp = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map(|d| d.as_millis())
            .unwrap_or_default();
        let script = dir.join(format!(
            "troupe-hosts-{stamp}-{}-{base}.sbatch",
            std::process::id()
        ));
        std::fs::write(&script, batch_script_at(&self.opts, req, report_to, base))
            .map_err(|e| LaunchError::Config(format!("cannot write {}: {e}", script.display())))?;
        let args = sbatch_args(&self.opts, req, &script);
        let mut cmd = Command::new("sbatch");
        cmd.args(&args).stdin(Stdio::null());
        req.apply_env(&mut cmd);
        let out = cmd.output().await.map_err(|source| LaunchError::Spawn {
            command: "sbatch".into(),
            source,
        })?;
        let stdout = String::from_utf8_lossy(&out.stdout).trim().to_string();
        let stderr = String::from_utf8_lossy(&out.stderr).trim().to_string();
        // `--parsable` prints `JOBID` or `JOBID;CLUSTER`.
        let job = stdout.split(';').next().unwrap_or("").to_string();
        if !out.status.success() || job.is_empty() || !job.chars().all(|c| c.is_ascii_digit()) {
            return Err(LaunchError::Submit {
                command: format!("sbatch {}", args.join(" ")),
                message: if stderr.is_empty() { stdout } else { stderr },
            });
        }
        let output = dir.join(format!("troupe-hosts-{job}.out"));
        Ok((job, output))
    }

    /// Where the first job's (or step's) hosts are awaited.
    fn first_target(&self) -> Target {
        let (job, output) = self
            .set(|s| (s.job.clone(), s.output.clone()))
            .unwrap_or_default();
        Target {
            job,
            output,
            base: 0,
        }
    }

    /// `None` while the job can still bring hosts up; else why it cannot.
    async fn ended(&self, t: &Target) -> Option<String> {
        if let Some(job) = &t.job {
            return match job_info(job).await {
                Some(j) if j.is_finished() => Some(settled(job, j).await.summary()),
                Some(j) if j.is_hopeless() => {
                    let _ = Command::new("scancel").arg(job).output().await;
                    Some(format!(
                        "{} (Slurm will not start it; cancelled)",
                        j.summary()
                    ))
                }
                _ => None,
            };
        }
        let status = self.set(|s| s.srun.as_mut().map(|c| c.try_wait()))??;
        match status {
            Ok(Some(st)) => Some(format!("srun exited ({st})")),
            Ok(None) => None,
            Err(e) => Some(format!("cannot wait for srun: {e}")),
        }
    }

    /// State and output tail, for error messages.
    async fn detail(&self, t: &Target, head: String) -> String {
        let mut d = head;
        if let Some(p) = &t.output {
            let tl = tail(p, TAIL_LINES);
            d.push_str(&format!("\n--- {} (last lines) ---\n{tl}", p.display()));
        }
        d
    }

    /// Waits until every host of `t` reported: the hosts, and their liveness links (closing
    /// one tells its host to stop).
    async fn wait_reports(
        &self,
        req: &LaunchRequest,
        mut rx: mpsc::Receiver<Result<Arrival, LaunchError>>,
        t: &Target,
    ) -> Result<(Vec<LaunchedHost>, Vec<TcpStream>), LaunchError> {
        let deadline = tokio::time::Instant::now() + req.startup_timeout;
        let mut hosts: BTreeMap<usize, LaunchedHost> = BTreeMap::new();
        let mut links = Vec::new();
        let mut refused: Vec<String> = Vec::new();
        let mut tick = tokio::time::interval(POLL);
        let ours = t.base..t.base + req.n_hosts;
        while hosts.len() < req.n_hosts {
            tokio::select! {
                a = rx.recv() => match a {
                    Some(Ok(Arrival::Report(r, link))) => {
                        if !ours.contains(&r.index) || hosts.contains_key(&r.index) {
                            refused.push(format!("unexpected report {r:?}"));
                            continue;
                        }
                        links.push(link);
                        hosts.insert(r.index, LaunchedHost {
                            index: r.index, host_id: r.host_id, addr: r.addr, node: r.node, gpus: r.gpus,
                        });
                    }
                    Some(Ok(Arrival::Refused(why))) => refused.push(why),
                    Some(Err(e)) => return Err(e),
                    None => return Err(LaunchError::Rendezvous("listener stopped".into())),
                },
                _ = tick.tick() => {
                    if let Some(why) = self.ended(t).await {
                        let mut head = why;
                        if !refused.is_empty() {
                            head.push_str(&format!("; refused reports: {}", refused.join("; ")));
                        }
                        return Err(LaunchError::Ended { what: t.what(), detail: self.detail(t, head).await });
                    }
                }
                _ = tokio::time::sleep_until(deadline) => {
                    let state = match &t.job {
                        Some(j) => job_info(j).await.map(|i| i.summary()).unwrap_or_else(|| "job unknown to scontrol".into()),
                        None => "srun still running".into(),
                    };
                    let mut head = format!("{}: {state}", t.what());
                    if !refused.is_empty() {
                        head.push_str(&format!("; refused reports: {}", refused.join("; ")));
                    }
                    return Err(LaunchError::Timeout {
                        got: hosts.len(), want: req.n_hosts, waited: req.startup_timeout,
                        detail: self.detail(t, head).await,
                    });
                }
            }
        }
        Ok((hosts.into_values().collect(), links))
    }

    /// After start-up, reports (once) when Slurm ends the job under the hosts — a lost node
    /// (`NODE_FAIL`), the time limit (`TIMEOUT`), an admin's `scancel` — in Slurm's words; the
    /// controller separately sees the hosts go (`ClusterEvent::HostLost`).
    fn watch(&self) {
        let Some((Some(job), output)) = self.set(|s| (s.job.clone(), s.output.clone())) else {
            return;
        };
        let task = watch_job(job, output);
        self.set(|s| s.watcher = Some(task));
    }

    async fn stop(&self) {
        let (job, srun, links, watcher, added) = self
            .set(|s| {
                (
                    s.job.take(),
                    s.srun.take(),
                    std::mem::take(&mut s.links),
                    s.watcher.take(),
                    std::mem::take(&mut s.added),
                )
            })
            .unwrap_or_default();
        if let Some(w) = watcher {
            w.abort();
        }
        drop(links); // hosts see the controller go and start stopping their actors
        let added = added.into_iter().map(|(job, a)| release_added(job, a));
        let first = async {
            if let Some(job) = job {
                cancel(&job).await;
            }
        };
        futures::future::join(first, futures::future::join_all(added)).await;
        if let Some(mut child) = srun {
            // srun forwards SIGTERM to every task of the step; SIGKILL only if it hangs.
            if let Some(pid) = child.id() {
                let _ = nix::sys::signal::kill(
                    nix::unistd::Pid::from_raw(pid as i32),
                    nix::sys::signal::Signal::SIGTERM,
                );
            }
            if tokio::time::timeout(Duration::from_secs(30), child.wait())
                .await
                .is_err()
            {
                let _ = child.kill().await;
            }
        }
    }
}

/// `scancel job`, then waits (bounded) until Slurm has taken it down, so "stopped" means
/// stopped.
async fn cancel(job: &str) {
    let _ = Command::new("scancel").arg(job).output().await;
    let until = tokio::time::Instant::now() + Duration::from_secs(30);
    while tokio::time::Instant::now() < until {
        match job_info(job).await {
            Some(j) if !j.is_finished() || j.state == "COMPLETING" => {}
            _ => break,
        }
        tokio::time::sleep(POLL).await;
    }
}

/// Reports (once) when Slurm ends `job` under its hosts (see `SlurmLauncher::watch`).
fn watch_job(job: String, output: Option<PathBuf>) -> tokio::task::JoinHandle<()> {
    tokio::spawn(async move {
        loop {
            tokio::time::sleep(WATCH).await;
            if let Some(j) = job_info(&job).await
                && j.state != "RUNNING"
            {
                let j = settled(&job, j).await;
                let out = output
                    .as_deref()
                    .map(|p| tail(p, TAIL_LINES))
                    .unwrap_or_default();
                tracing::error!(
                    "slurm job {job} ended under its hosts: {}\n{out}",
                    j.summary()
                );
                return;
            }
        }
    })
}

/// `j` once it has left COMPLETING (within [`SETTLE`]): an error then says how the job ended
/// (FAILED, COMPLETED, CANCELLED, with Slurm's reason), not that it was ending.
async fn settled(job: &str, mut j: JobInfo) -> JobInfo {
    let until = tokio::time::Instant::now() + SETTLE;
    while j.state == "COMPLETING" && tokio::time::Instant::now() < until {
        tokio::time::sleep(POLL).await;
        match job_info(job).await {
            Some(now) => j = now,
            None => break,
        }
    }
    j
}

async fn job_info(job: &str) -> Option<JobInfo> {
    let out = Command::new("scontrol")
        .args(["show", "job", "-o", job])
        .output()
        .await
        .ok()?;
    parse_job_info(&String::from_utf8_lossy(&out.stdout))
}

impl HostLauncher for SlurmLauncher {
    fn name(&self) -> &'static str {
        "slurm"
    }

    fn launch<'a>(
        &'a self,
        req: &'a LaunchRequest,
    ) -> BoxFuture<'a, Result<Vec<LaunchedHost>, LaunchError>> {
        Box::pin(async move {
            let ip = self.opts.report_ip.unwrap_or_else(routable_ip);
            let (report_to, rx, accept) = open_reports(ip, req, "Slurm").await?;
            let result = match self.submit(req, &report_to).await {
                Ok(()) => {
                    let t = self.first_target();
                    match self.wait_reports(req, rx, &t).await {
                        Ok((hosts, links)) => {
                            self.set(|s| s.links.extend(links));
                            Ok(hosts)
                        }
                        Err(e) => Err(e),
                    }
                }
                Err(e) => Err(e),
            };
            accept.abort();
            match &result {
                Ok(_) => self.watch(),
                Err(_) => self.stop().await,
            }
            result
        })
    }

    /// One more job (always `sbatch`, also inside an allocation: a step cannot outgrow it).
    fn grow<'a>(
        &'a self,
        req: &'a LaunchRequest,
        first_index: usize,
    ) -> BoxFuture<'a, Result<Grown, LaunchError>> {
        Box::pin(self.grow_job(req, first_index))
    }

    fn release<'a>(&'a self, id: &'a str) -> BoxFuture<'a, Result<(), LaunchError>> {
        Box::pin(async move {
            let Some(a) = self.set(|s| s.added.remove(id)).flatten() else {
                return Err(LaunchError::Config(format!(
                    "slurm job {id} is not one this launcher added to the cluster"
                )));
            };
            release_added(id.to_string(), a).await;
            Ok(())
        })
    }

    fn teardown(&self) -> BoxFuture<'_, ()> {
        Box::pin(self.stop())
    }

    fn describe(&self) -> Option<String> {
        let (job, output, added) = self.set(|s| {
            let added: Vec<String> = s
                .added
                .iter()
                .map(|(j, a)| format!("{j} (output {})", a.output.display()))
                .collect();
            (s.job.clone(), s.output.clone(), added)
        })?;
        let out = output.map(|p| p.display().to_string()).unwrap_or_default();
        let mut d = match job {
            Some(j) => format!("slurm job {j} (output {out})"),
            None => format!(
                "srun in allocation {} (output {out})",
                self.in_allocation().unwrap_or_default()
            ),
        };
        if !added.is_empty() {
            d.push_str(&format!("; added jobs: {}", added.join(", ")));
        }
        Some(d)
    }
}

impl Drop for SlurmLauncher {
    fn drop(&mut self) {
        // Best effort and synchronous: there may be no runtime left to await anything.
        let mut jobs: Vec<String> = Vec::new();
        if let Ok(s) = self.started.get_mut() {
            jobs.extend(s.job.take());
            jobs.extend(std::mem::take(&mut s.added).into_keys());
        }
        for job in jobs {
            let _ = std::process::Command::new("scancel")
                .arg(&job)
                .stdin(Stdio::null())
                .stdout(Stdio::null())
                .stderr(Stdio::null())
                .status();
        }
    }
}
