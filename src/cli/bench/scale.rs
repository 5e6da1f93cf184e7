//! `troupe bench scale`: how the controller copes with many hosts and many servers.
//!
//! Brings up `--servers` reference engines (the tiny model, one real child process each) on
//! `--hosts` in-process actor hosts (`--servers / --hosts` GPUs per host), regular or PD, and
//! measures what grows with the fleet on the controller's side. With `--engine stub` each server
//! is instead the benchmark's stand-in ([`super::stub_engine`]), many to a `troupe host`
//! process (the hosts are processes then, so the controller's memory and sockets are its own):
//! 4,096 servers fit on one machine, and the engine figures become the hosts' (`host_rss_mib`,
//! `bringup_hosts_cpu_s`, `fanout_hosts_cpu_ms`); stand-ins take no weights, so the weight
//! updates are replaced by a version change (`version_change_ms`, and `version_seen_all_ms`:
//! until the last stand-in switched, by its own clock reading). Both modes end with 200
//! `/generate` calls through the gateway (`generate_p50_ms`, `generate_p99_ms`). Figures:
//!
//! - `scale.bringup_s`: `Deployment::fork`, from placement to the gateway routing every server;
//!   `scale.slowest_server_s` / `scale.server_start_p50_s`: the servers' own start times (each
//!   server's spawn to its first healthy answer, [`ServerInfo::ready_ms`]); their difference
//!   `scale.bringup_overhead_s` is what the controller adds to the slowest server;
//! - `scale.controller_rss_mib` (VmRSS of this process after bring-up; engines are child
//!   processes and not in it), `scale.controller_peak_rss_mib` (VmHWM at the end) and
//!   `scale.engine_rss_mib` (the mean engine process, for sizing a machine);
//! - `scale.fanout_first_pause_ms` / `scale.fanout_first_resume_ms`: the first pause and resume
//!   of the whole fleet after bring-up, through its control plane, each call a task on the
//!   runtime's workers as the gateway's admin endpoints run it; every engine runs its pause
//!   and resume code for the first time then (page faults, cold caches), which cost about as
//!   much again as the call, once;
//! - `scale.fanout_p50_ms` / `scale.fanout_p99_ms`: the `--rounds` pauses and resumes after
//!   that first round (every call timed; resume includes its version check; 100 rounds by
//!   default, 200 calls, so the p99 is not simply the slowest call, `scale.fanout_max_ms`), and
//!   `scale.fanout_pause_p50_ms` / `scale.fanout_resume_p50_ms` each kind alone;
//! - `scale.weight_update_s`: a tiny-model weight update to every server through the plane
//!   (pause, broadcast group build, buckets, resume), `scale.weight_update_again_s` a second one
//!   over the group already built;
//! - `scale.host_loss_event_ms` / `scale.host_loss_detect_ms`: the last host crashes (its event
//!   stream ends, then its actors and engines stop); the time until the cluster reports it lost,
//!   and until every one of its servers has left the router;
//! - `scale.bringup_servers_ready_s`: from the fork's start until its last server was ready
//!   (the rest of bring-up is the data proxies, the gateway and the control connections);
//! - `scale.teardown_s`;
//! - `scale.time_wait_at_start`: TCP sockets in TIME_WAIT when the run began; a run of 512
//!   servers or more that finds over 2,000 (an earlier run's, within the last minute) first
//!   waits for them to drain, since a machine whose ephemeral ports are mostly held makes
//!   every bind to port 0 slow.
//!
//! [`ServerInfo::ready_ms`]: troupe_serving::inference::ServerInfo::ready_ms

use std::collections::BTreeSet;
use std::time::{Duration, Instant};

use troupe_controller::serve::{Deployment, ForkOptions, ServingEvent};
use troupe_controller::{Cluster, ClusterEvent};
use troupe_scheduler::AllocationPlan;
use troupe_serving::control_plane::HostTensor;
use troupe_wire::PauseMode;

use super::proc_cpu::{proc_times, run_time};
use super::scale_checks::{api, generate, pct, version_change};

/// How the servers are grouped.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum Layout {
    /// One group of regular servers.
    Regular,
    /// Half prefill, half decode servers behind the PD-aware gateway.
    Pd,
}

/// What serves behind each server's port.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum EngineKind {
    /// The reference engine, one child process per server (the tiny model).
    Reference,
    /// The benchmark's stand-in ([`super::stub_engine`]): many per process on this process's
    /// runtime, answering the control and info routes and `/generate` with a fixed answer, so
    /// thousands of servers fit on one machine and the controller is what is measured.
    Stub,
}

/// Settings of the scale benchmark.
#[derive(Debug, Clone, clap::Args)]
pub struct ScaleArgs {
    /// In-process actor hosts.
    #[arg(long, default_value_t = 64, value_parser = clap::value_parser!(u64).range(1..=4096))]
    pub hosts: u64,
    /// Servers in all (reference engines: one child process each); a multiple of --hosts.
    #[arg(long, default_value_t = 512, value_parser = clap::value_parser!(u64).range(1..=65536))]
    pub servers: u64,
    /// What each server runs: reference engines (processes) or the benchmark's in-process
    /// stand-ins (`stub`; no weights: the weight figures become a version change).
    #[arg(long, value_enum, default_value = "reference")]
    pub engine: EngineKind,
    /// One group of regular servers, or half prefill and half decode.
    #[arg(long, value_enum, default_value = "regular")]
    pub layout: Layout,
    /// Pause + resume rounds timed for the fan-out figures (after a first round timed apart);
    /// at least 50 for a p99 that is not the maximum.
    #[arg(long, default_value_t = 100, value_parser = clap::value_parser!(u64).range(1..=100_000))]
    pub rounds: u64,
    /// How long each server may take to come up, in seconds.
    #[arg(long, default_value_t = 600, value_parser = clap::value_parser!(u64).range(1..=86_400))]
    pub ready_timeout_s: u64,
    /// Print one JSON object instead of one line per figure.
    #[arg(long)]
    pub json: bool,
}

/// The allocation mode for `a`, or why the flags do not make one.
pub fn allocation(a: &ScaleArgs) -> Result<String, String> {
    if a.servers == 0 || a.hosts == 0 {
        return Err("--servers and --hosts must be positive".into());
    }
    if !a.servers.is_multiple_of(a.hosts) {
        return Err(format!(
            "--servers {} is not a multiple of --hosts {}: every host runs the same number of servers",
            a.servers, a.hosts
        ));
    }
    if a.servers / a.hosts > 1024 {
        return Err(format!(
            "{} servers per host is more than the 1024 GPUs a host may advertise: raise --hosts",
            a.servers / a.hosts
        ));
    }
    match a.layout {
        Layout::Regular => Ok(format!("troupe:d{}t1", a.servers)),
        Layout::Pd if a.servers.is_multiple_of(2) => Ok(format!(
            "troupe:(prefill:d{h}t1|decode:d{h}t1)",
            h = a.servers / 2
        )),
        Layout::Pd => Err(format!(
            "--layout pd splits the servers into prefill and decode halves: --servers {} is odd",
            a.servers
        )),
    }
}

/// A `kB` field of `/proc/<pid>/status` (`VmRSS`, `VmHWM`), in MiB.
fn status_mib(pid: &str, field: &str) -> Option<f64> {
    let text = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    let line = text.lines().find(|l| l.starts_with(field))?;
    let kb: f64 = line
        .trim_start_matches(field)
        .trim_start_matches(':')
        .split_whitespace()
        .next()?
        .parse()
        .ok()?;
    Some(kb / 1024.0)
}

/// CPU seconds the engine processes `pids` have used so far, all together. Each engine uses a
/// few ms per measurement, under the 10 ms tick of `/proc/<pid>/stat`, so this sums the
/// nanosecond run times of their threads (`/proc/<pid>/task/*/schedstat`; an engine's threads
/// live as long as it does), and uses the ticks only where that file is missing.
fn engines_cpu(pids: &[String]) -> f64 {
    pids.iter()
        .filter_map(|p| run_time(p, None).or_else(|| proc_times(p).map(|t| t.0)))
        .sum()
}

/// The tiny model's parameters as trainer tensors (what every engine serves).
fn tiny_tensors(seed: u64) -> Vec<HostTensor> {
    use troupe_engine::model::{ModelConfig, Weights};
    let w = Weights::init(&ModelConfig::tiny(), seed);
    w.names()
        .into_iter()
        .filter_map(|n| {
            let t = w.get(&n)?;
            Some(HostTensor::f32(n.clone(), t.shape.clone(), t.data.clone()))
        })
        .collect()
}

/// One pause and one resume of the whole fleet through the plane (ms each), each call in a
/// task of its own on the runtime's workers (where the gateway's admin endpoints and the gRPC
/// API run it), not on the thread that blocks on the benchmark.
async fn round(svc: &Deployment) -> Result<(f64, f64), String> {
    let plane = svc.plane.clone();
    let pause = timed("pause", async move {
        plane.pause(PauseMode::Abort, false).await
    })
    .await?;
    let plane = svc.plane.clone();
    let resume = timed("resume", async move { plane.resume().await }).await?;
    Ok((pause, resume))
}

/// `rounds` rounds; each call's time in ms: (pauses, resumes), sorted.
async fn fanout(svc: &Deployment, rounds: u64) -> Result<(Vec<f64>, Vec<f64>), String> {
    let mut pauses = Vec::with_capacity(rounds as usize);
    let mut resumes = Vec::with_capacity(rounds as usize);
    for _ in 0..rounds {
        let (p, r) = round(svc).await?;
        pauses.push(p);
        resumes.push(r);
    }
    pauses.sort_by(f64::total_cmp);
    resumes.sort_by(f64::total_cmp);
    Ok((pauses, resumes))
}

/// Runs one plane call as a task of its own; its time in ms.
async fn timed<T: Send + 'static>(
    what: &str,
    call: impl std::future::Future<Output = Result<T, troupe_wire::ApiError>> + Send + 'static,
) -> Result<f64, String> {
    tokio::spawn(async move {
        let t = Instant::now();
        call.await.map(|_| t.elapsed().as_secs_f64() * 1e3)
    })
    .await
    .map_err(|e| format!("{what} task: {e}"))?
    .map_err(|e| api(what, e))
}

/// Crashes host `victim` and times the cluster's `HostLost` and the router's removal of every
/// server on it (ms each).
async fn host_loss(
    cluster: &Cluster,
    svc: &Deployment,
    victim: usize,
) -> Result<(f64, f64), String> {
    let mut events = cluster.events();
    let mut serving = svc.serving_events();
    let mut left: BTreeSet<String> = svc
        .servers()
        .into_iter()
        .filter(|s| s.host == victim && s.node_rank == 0)
        .map(|s| s.info.url)
        .collect();
    let host_pid = svc
        .servers()
        .into_iter()
        .find(|s| s.host == victim)
        .map(|s| s.info.pid)
        .filter(|&p| p != std::process::id());
    let t0 = Instant::now();
    let watch = async {
        let mut lost_at = None;
        while lost_at.is_none() || !left.is_empty() {
            tokio::select! {
                ev = events.recv(), if lost_at.is_none() => match ev {
                    Ok(ClusterEvent::HostLost { host, .. }) if host == victim => {
                        lost_at = Some(t0.elapsed());
                    }
                    Ok(_) | Err(tokio::sync::broadcast::error::RecvError::Lagged(_)) => {}
                    Err(e) => return Err(format!("cluster events: {e}")),
                },
                ev = serving.recv() => match ev {
                    Ok(ServingEvent::Removed { url, .. }) => {
                        left.remove(&url);
                    }
                    Ok(_) | Err(tokio::sync::broadcast::error::RecvError::Lagged(_)) => {}
                    Err(e) => return Err(format!("serving events: {e}")),
                },
            }
        }
        Ok((lost_at.unwrap_or_default(), t0.elapsed()))
    };
    let crash = async {
        if cluster.crash_host(victim).await {
            return Ok(());
        }
        // A host process (the stub engines' hosts): killed, as a machine that dies.
        let pid = host_pid.ok_or_else(|| format!("host {victim} runs no server to find it by"))?;
        nix::sys::signal::kill(
            nix::unistd::Pid::from_raw(pid as i32),
            nix::sys::signal::SIGKILL,
        )
        .map_err(|e| format!("cannot kill host {victim} (pid {pid}): {e}"))
    };
    let watched = async { tokio::time::timeout(Duration::from_secs(120), watch).await };
    let (crashed, watched) = tokio::join!(crash, watched);
    crashed?;
    let (lost, removed) = watched.map_err(|_| {
        format!("host {victim} crashed, but its servers were still routed after 120 s")
    })??;
    Ok((lost.as_secs_f64() * 1e3, removed.as_secs_f64() * 1e3))
}

/// What runs once the deployment is up (brought up with `bringup_cpu_s` of this process's
/// CPU); the figures it measured.
async fn measure(
    cluster: &Cluster,
    svc: &Deployment,
    a: &ScaleArgs,
    bringup_cpu_s: f64,
    out: &mut Vec<(String, f64)>,
) -> Result<(), String> {
    let mut put = |k: &str, v: f64| out.push((format!("scale.{k}"), v));
    let stub = a.engine == EngineKind::Stub;
    let servers = svc.servers();
    // The engine processes, or with stand-ins the host processes they live in (with the
    // hosts' proxies and the gateway): the `engine_*` figures become `host_*` ones.
    let pids: Vec<String> = servers
        .iter()
        .map(|s| s.info.pid)
        .collect::<BTreeSet<u32>>()
        .into_iter()
        .map(|p| p.to_string())
        .collect();
    let proc_kind = if stub { "host" } else { "engine" };
    let mut starts: Vec<f64> = servers
        .iter()
        .map(|s| s.info.ready_ms as f64 / 1e3)
        .collect();
    starts.sort_by(f64::total_cmp);
    let slowest = starts.last().copied().unwrap_or(0.0);
    let bringup = svc.bring_up.as_secs_f64();
    put("bringup_s", bringup);
    put("slowest_server_s", slowest);
    put("server_start_p50_s", pct(&starts, 0.5));
    put("bringup_overhead_s", bringup - slowest);
    put(
        "controller_rss_mib",
        status_mib("self", "VmRSS").unwrap_or(0.0),
    );
    let engines: Vec<f64> = pids.iter().filter_map(|p| status_mib(p, "VmRSS")).collect();
    put(
        &format!("{proc_kind}_rss_mib"),
        engines.iter().sum::<f64>() / engines.len().max(1) as f64,
    );
    // Where bring-up's CPU went, and how long the controller took to get every process
    // started (process start times have the clock-tick resolution, 10 ms).
    put("bringup_controller_cpu_s", bringup_cpu_s);
    put(&format!("bringup_{proc_kind}s_cpu_s"), engines_cpu(&pids));
    let started: Vec<f64> = pids
        .iter()
        .filter_map(|p| proc_times(p))
        .map(|t| t.1)
        .collect();
    let first = started.iter().copied().fold(f64::INFINITY, f64::min);
    let last = started.iter().copied().fold(f64::NEG_INFINITY, f64::max);
    if !stub {
        put(
            "spawn_spread_s",
            if started.is_empty() {
                0.0
            } else {
                last - first
            },
        );
    }

    // The engines run their pause and resume code for the first time here: timed apart.
    let (first_pause, first_resume) = round(svc).await?;
    put("fanout_first_pause_ms", first_pause);
    put("fanout_first_resume_ms", first_resume);
    let (c0, e0) = (proc_times("self").map_or(0.0, |t| t.0), engines_cpu(&pids));
    let (pauses, resumes) = fanout(svc, a.rounds).await?;
    let mut ms = [pauses.as_slice(), resumes.as_slice()].concat();
    ms.sort_by(f64::total_cmp);
    let calls = ms.len().max(1) as f64;
    put("fanout_p50_ms", pct(&ms, 0.5));
    put("fanout_p99_ms", pct(&ms, 0.99));
    put("fanout_max_ms", pct(&ms, 1.0));
    put("fanout_pause_p50_ms", pct(&pauses, 0.5));
    put("fanout_resume_p50_ms", pct(&resumes, 0.5));
    // CPU per call (a pause or a resume), in ms: the controller's, and every engine's together.
    put(
        "fanout_controller_cpu_ms",
        (proc_times("self").map_or(0.0, |t| t.0) - c0) * 1e3 / calls,
    );
    put(
        &format!("fanout_{proc_kind}s_cpu_ms"),
        (engines_cpu(&pids) - e0) * 1e3 / calls,
    );

    version_change(svc, stub, &mut put).await?;
    let (p50, p99) = generate(svc, 200).await?;
    put("generate_p50_ms", p50);
    put("generate_p99_ms", p99);
    if !stub {
        weight_updates(svc, &mut put).await?;
    }

    let victim = cluster.hosts().len() - 1;
    let (lost_ms, removed_ms) = host_loss(cluster, svc, victim).await?;
    put("host_loss_event_ms", lost_ms);
    put("host_loss_detect_ms", removed_ms);
    Ok(())
}

/// Two tiny-model weight updates to every reference engine through the plane.
async fn weight_updates(svc: &Deployment, put: &mut impl FnMut(&str, f64)) -> Result<(), String> {
    let tensors = tiny_tensors(7);
    for (name, version) in [
        ("weight_update_s", "scale-1"),
        ("weight_update_again_s", "scale-2"),
    ] {
        let t = Instant::now();
        let rep = svc
            .plane
            .update_from_tensors(version, &tensors)
            .await
            .map_err(|e| api("weight update", e))?;
        put(name, t.elapsed().as_secs_f64());
        if !rep.skipped.is_empty() {
            return Err(format!(
                "the weight update skipped servers that were down: {:?}",
                rep.skipped
            ));
        }
    }
    Ok(())
}

/// Runs `troupe bench scale`: cluster, deployment, the measurements, teardown.
pub async fn run(a: &ScaleArgs) -> Result<Vec<(String, f64)>, String> {
    let mode = allocation(a)?;
    let plan = AllocationPlan::parse(&mode).map_err(|e| format!("{mode}: {e}"))?;
    let per_host = (a.servers / a.hosts) as u32;
    let time_wait = super::scale_checks::quiet_ports(a.servers).await;
    let cluster = match a.engine {
        EngineKind::Reference => Cluster::in_process(a.hosts as usize, per_host).await,
        // Host processes, so the controller's own memory and sockets are what is measured
        // (in-process hosts would put every proxy, the gateway and both ends of their
        // connections in this process: past 20,000 descriptors at 4,096 servers).
        EngineKind::Stub => {
            let hosts =
                super::stub_engine::StubHosts(troupe_scheduler::launch::LocalLauncher::new());
            // 512 host processes share this machine's cores with the controller: a heartbeat
            // may well be late here without the host being gone (a killed host is lost when
            // its event stream ends, which is what the host-loss figure times).
            Cluster::builder()
                .lost_after(Duration::from_secs(30))
                .launch(std::sync::Arc::new(hosts), a.hosts as usize, per_host)
                .await
        }
    }
    .map_err(|e| format!("cannot start the cluster: {e}"))?;
    // When the fork's last server reported ready: bring-up before it is the servers', after it
    // the data proxies', the gateway's and the control connections'.
    let all_ready = std::sync::Arc::new(std::sync::Mutex::new(None::<Instant>));
    let ready_at = all_ready.clone();
    let opts = ForkOptions {
        model: "tiny".into(),
        ready_timeout: Duration::from_secs(a.ready_timeout_s),
        // A server that dies is a failure to report, not something to restart around.
        server_restarts: 0,
        progress: troupe_controller::serve::fork::Progress::to(move |p| {
            if p.ready == p.total {
                *ready_at.lock().unwrap_or_else(|e| e.into_inner()) = Some(Instant::now());
            }
        }),
        ..ForkOptions::default()
    };
    let cpu0 = proc_times("self").map_or(0.0, |t| t.0);
    let fork_started = Instant::now();
    let svc = match Deployment::fork(&cluster, &plan, &opts).await {
        Ok(s) => s,
        Err(e) => {
            cluster.shutdown().await;
            return Err(format!("bring-up of {} servers: {e}", a.servers));
        }
    };
    let mut out = vec![
        ("scale.hosts".to_string(), a.hosts as f64),
        ("scale.servers".to_string(), a.servers as f64),
        ("scale.time_wait_at_start".to_string(), time_wait as f64),
    ];
    let bringup_cpu_s = proc_times("self").map_or(0.0, |t| t.0) - cpu0;
    if let Some(t) = *all_ready.lock().unwrap_or_else(|e| e.into_inner()) {
        out.push((
            "scale.bringup_servers_ready_s".into(),
            t.duration_since(fork_started).as_secs_f64(),
        ));
    }
    let measured = measure(&cluster, &svc, a, bringup_cpu_s, &mut out).await;
    let t = Instant::now();
    svc.teardown().await;
    cluster.shutdown().await;
    measured?;
    out.push(("scale.teardown_s".into(), t.elapsed().as_secs_f64()));
    out.push((
        "scale.controller_peak_rss_mib".into(),
        status_mib("self", "VmHWM").unwrap_or(0.0),
    ));
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn args(hosts: u64, servers: u64, layout: Layout) -> ScaleArgs {
        ScaleArgs {
            hosts,
            servers,
            layout,
            engine: EngineKind::Reference,
            rounds: 1,
            ready_timeout_s: 60,
            json: false,
        }
    }

    #[test]
    fn engines_that_are_gone_count_as_nothing() {
        assert_eq!(engines_cpu(&["no-such-process".to_string()]), 0.0);
    }

    #[test]
    fn flags_become_an_allocation_or_a_clear_error() {
        assert_eq!(
            allocation(&args(64, 512, Layout::Regular)).unwrap(),
            "troupe:d512t1"
        );
        assert_eq!(
            allocation(&args(2, 4, Layout::Pd)).unwrap(),
            "troupe:(prefill:d2t1|decode:d2t1)"
        );
        let e = allocation(&args(3, 4, Layout::Regular)).unwrap_err();
        assert!(e.contains("not a multiple of --hosts 3"), "{e}");
        let e = allocation(&args(1, 3, Layout::Pd)).unwrap_err();
        assert!(e.contains("odd"), "{e}");
        assert!(allocation(&args(0, 0, Layout::Regular)).is_err());
        assert!(allocation(&args(1, 2048, Layout::Regular)).is_err());
        for a in [args(64, 512, Layout::Regular), args(2, 4, Layout::Pd)] {
            let mode = allocation(&a).unwrap();
            let plan = AllocationPlan::parse(&mode).unwrap();
            let servers: u64 = plan.components.iter().map(|c| c.world_size()).sum();
            assert_eq!(servers, a.servers, "{mode}");
        }
    }

    #[test]
    fn status_fields_read_in_mib() {
        assert!(status_mib("self", "VmRSS").is_some_and(|m| m > 0.0));
        assert_eq!(status_mib("self", "NoSuchField"), None);
        assert_eq!(pct(&[1.0, 2.0, 3.0], 0.5), 2.0);
        assert_eq!(pct(&[], 0.5), 0.0);
    }
}
