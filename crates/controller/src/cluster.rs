//! A cluster: the set of actor hosts one controller drives.
//!
//! Ways to get hosts, one API afterwards: hosts inside this process (tests, laptops), hosts a
//! [`HostLauncher`] starts (`troupe host` child processes on this machine, a Slurm job), or
//! hosts already running elsewhere.

use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use tokio::sync::broadcast;
use troupe_actors::tls::{ClientTls, ServerTls, TlsFiles};
use troupe_actors::{CallError, HostConfig, HostCore, Registry};

use crate::conn::{CallTransport, HostConn};
use crate::grow::{Growth, Reach};
use crate::handle::HostHandle;
use troupe_scheduler::{HostLauncher, LaunchRequest, LaunchedHost, LocalLauncher};

use crate::membership::{ClusterEvent, EventSinks, MembershipEvents, watch_host};

/// How in-process hosts are reached.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum InProcessTransport {
    /// Call the host core directly (fastest; the default).
    #[default]
    Direct,
    /// Serve each host on a loopback gRPC port and go through the network stack.
    Grpc,
}

/// Errors bringing a cluster up.
#[derive(Debug, thiserror::Error)]
pub enum ClusterError {
    /// A host could not be started or reached.
    #[error("host {index}: {source}")]
    Host {
        /// Which host.
        index: usize,
        /// What went wrong.
        source: CallError,
    },
    /// A `troupe host` process could not be launched or did not come up.
    #[error("{0}")]
    Launch(String),
    /// Bad arguments.
    #[error("{0}")]
    Config(String),
}

/// Settings for building a cluster.
#[derive(Clone)]
pub struct ClusterBuilder {
    registry: Registry,
    heartbeat: Duration,
    lost_after: Duration,
    transport: InProcessTransport,
    max_message_bytes: u64,
    binary: Option<PathBuf>,
    startup_timeout: Duration,
    shutdown_grace: Duration,
    token: Option<String>,
    stable_after: Duration,
    tls: TlsFiles,
    calls: CallTransport,
    recovery_file: Option<PathBuf>,
}

impl Default for ClusterBuilder {
    fn default() -> Self {
        ClusterBuilder {
            registry: crate::standard_registry(),
            heartbeat: Duration::from_millis(250),
            lost_after: Duration::from_secs(2),
            transport: InProcessTransport::Direct,
            max_message_bytes: 64 << 20,
            binary: None,
            startup_timeout: Duration::from_secs(30),
            shutdown_grace: Duration::from_secs(5),
            stable_after: Duration::from_secs(60),
            token: std::env::var(troupe_actors::auth::TOKEN_ENV)
                .ok()
                .filter(|t| !t.is_empty()),
            tls: TlsFiles::from_env(),
            calls: CallTransport::default(),
            recovery_file: None,
        }
    }
}

impl ClusterBuilder {
    /// How actor calls travel to hosts reached over the network (default: framed calls
    /// where the host takes them, see [`CallTransport`]).
    pub fn calls(mut self, t: CallTransport) -> Self {
        self.calls = t;
        self
    }

    /// Actor kinds in-process hosts can spawn (default: the built-in kinds).
    pub fn registry(mut self, r: Registry) -> Self {
        self.registry = r;
        self
    }

    /// Heartbeat interval of hosts this builder starts.
    pub fn heartbeat(mut self, d: Duration) -> Self {
        self.heartbeat = d;
        self
    }

    /// How long without a heartbeat before a host is declared lost (default 2 s).
    pub fn lost_after(mut self, d: Duration) -> Self {
        self.lost_after = d;
        self
    }

    /// Transport for in-process hosts.
    pub fn transport(mut self, t: InProcessTransport) -> Self {
        self.transport = t;
        self
    }

    /// Largest call payload hosts accept.
    pub fn max_message_bytes(mut self, n: u64) -> Self {
        self.max_message_bytes = n;
        self
    }

    /// Path of the `troupe` binary for [`ClusterBuilder::local_processes`].
    pub fn binary(mut self, p: impl Into<PathBuf>) -> Self {
        self.binary = Some(p.into());
        self
    }

    /// How long a launched host may take to report its address.
    pub fn startup_timeout(mut self, d: Duration) -> Self {
        self.startup_timeout = d;
        self
    }

    /// Grace each actor gets to stop when its host shuts down (default 5 s).
    pub fn shutdown_grace(mut self, d: Duration) -> Self {
        self.shutdown_grace = d;
        self
    }

    /// How long an actor on an in-process host must run before its restart back-off starts
    /// over from the base delay (default 60 s).
    pub fn stable_after(mut self, d: Duration) -> Self {
        self.stable_after = d;
        self
    }

    /// Control-plane token hosts require and this controller sends (default: `$TROUPE_TOKEN`).
    pub fn token(mut self, t: Option<String>) -> Self {
        self.token = t;
        self
    }

    /// The state file `troupe serve` writes for `--recover` (default: none): launched hosts
    /// wait their orphan grace for a recovering controller only while it exists and names
    /// them, and otherwise stop within seconds of losing their controller.
    pub fn recovery_file(mut self, path: Option<PathBuf>) -> Self {
        // Hosts may run in another directory: give them the absolute path.
        self.recovery_file = path.map(|p| std::path::absolute(&p).unwrap_or(p));
        self
    }

    /// TLS for gRPC (default: `$TROUPE_TLS_CERT`, `$TROUPE_TLS_KEY`, `$TROUPE_TLS_CA`): hosts
    /// this builder starts serve with `cert` / `key`, and every connection is verified against
    /// `ca`. Files are read when the cluster is built; a bad file is an error naming it.
    pub fn tls(mut self, files: TlsFiles) -> Self {
        self.tls = files;
        self
    }

    /// The client side of [`ClusterBuilder::tls`] (and, when `starting` hosts, their identity).
    fn tls_parts(
        &self,
        starting: bool,
    ) -> Result<(Option<ClientTls>, Option<ServerTls>), ClusterError> {
        let bad = |e: troupe_actors::tls::TlsError| ClusterError::Config(e.to_string());
        let client = self.tls.client().map_err(bad)?;
        let server = if starting {
            self.tls.server().map_err(bad)?
        } else {
            None
        };
        if starting && client.is_some() && server.is_none() {
            return Err(ClusterError::Config(
                "tls.ca is set but the hosts to start have no tls.cert / tls.key: they could not serve TLS".into(),
            ));
        }
        Ok((client, server))
    }

    /// `n` hosts inside this process, each advertising `gpus_per_host` GPUs. With the `Grpc`
    /// transport they are launched by [`crate::inproc::InProcessLauncher`], the same path as
    /// any other launcher; `Direct` hosts are called without the network.
    pub async fn in_process(self, n: usize, gpus_per_host: u32) -> Result<Cluster, ClusterError> {
        if self.transport == InProcessTransport::Grpc {
            let (_, server_tls) = self.tls_parts(true)?;
            let launcher = crate::inproc::InProcessLauncher::new(self.registry.clone(), server_tls);
            // No process is started, so no troupe binary is needed; name this one.
            let me = match &self.binary {
                Some(_) => self,
                None => {
                    let exe = std::env::current_exe().unwrap_or_default();
                    self.binary(exe)
                }
            };
            return me.launch(Arc::new(launcher), n, gpus_per_host).await;
        }
        // Every host starts at once.
        let starts = (0..n).map(|i| {
            let cfg = HostConfig {
                host_id: format!("host-{i}"),
                gpu_ids: (0..gpus_per_host).collect(),
                heartbeat_interval: self.heartbeat,
                max_message_bytes: self.max_message_bytes,
                shutdown_grace: self.shutdown_grace,
                auth_token: self.token.clone(),
                stable_after: self.stable_after,
                ..HostConfig::default()
            };
            HostCore::start(cfg, self.registry.clone())
        });
        let mut cores = Vec::with_capacity(n);
        let mut failed = None;
        for (i, started) in futures::future::join_all(starts)
            .await
            .into_iter()
            .enumerate()
        {
            match started {
                Ok(core) => cores.push(core),
                Err(source) => {
                    failed = failed.or(Some(ClusterError::Host { index: i, source }));
                }
            }
        }
        if let Some(e) = failed {
            // The hosts that did start are stopped again: nothing outlives a failed build.
            futures::future::join_all(cores.iter().map(HostCore::shutdown)).await;
            return Err(e);
        }
        let conns = cores
            .iter()
            .enumerate()
            .map(|(i, core)| {
                core.set_address(format!("inproc://host-{i}"));
                (HostConn::direct(core.clone()), core.describe())
            })
            .collect();
        let owned = cores.into_iter().map(Owned::Core).collect();
        Ok(Cluster::assemble(conns, owned, self.lost_after, true).await)
    }

    /// `n` `troupe host` child processes on this machine, each advertising `gpus_per_host` GPUs
    /// (ids `0..g` on every host, as if each were a node with its own cards).
    pub async fn local_processes(
        self,
        n: usize,
        gpus_per_host: u32,
    ) -> Result<Cluster, ClusterError> {
        self.launch(Arc::new(LocalLauncher::new()), n, gpus_per_host)
            .await
    }

    /// The request a launcher gets for `n` hosts of `gpus_per_host` GPUs with these settings.
    pub fn launch_request(
        &self,
        n: usize,
        gpus_per_host: u32,
    ) -> Result<LaunchRequest, ClusterError> {
        let binary = match &self.binary {
            Some(b) => b.clone(),
            None => troupe_actors::process::troupe_binary().map_err(ClusterError::Launch)?,
        };
        Ok(LaunchRequest {
            n_hosts: n,
            gpus_per_host,
            token: self.token.clone(),
            heartbeat: self.heartbeat,
            max_message_bytes: self.max_message_bytes,
            shutdown_grace: self.shutdown_grace,
            startup_timeout: self.startup_timeout,
            binary,
            host_env: [
                (troupe_actors::tls::CERT_ENV, &self.tls.cert),
                (troupe_actors::tls::KEY_ENV, &self.tls.key),
                (troupe_wire::env::RECOVERY_FILE, &self.recovery_file),
            ]
            .into_iter()
            .filter_map(|(k, v)| Some((k.to_string(), v.as_ref()?.display().to_string())))
            .collect(),
        })
    }

    /// `n` hosts started by `launcher` (local processes, a Slurm job, ...), connected over gRPC.
    /// The cluster owns the launcher: [`Cluster::shutdown`] tears its hosts down.
    pub async fn launch(
        self,
        launcher: Arc<dyn HostLauncher>,
        n: usize,
        gpus_per_host: u32,
    ) -> Result<Cluster, ClusterError> {
        let (client_tls, _) = self.tls_parts(true)?;
        let req = self.launch_request(n, gpus_per_host)?;
        let launched = launcher
            .launch(&req)
            .await
            .map_err(|e| ClusterError::Launch(format!("{} launcher: {e}", launcher.name())))?;
        let tries = launched.iter().map(|h| {
            HostConn::grpc(
                &h.addr,
                self.startup_timeout,
                self.token.as_deref(),
                client_tls.as_ref(),
                self.calls,
            )
        });
        let mut conns = Vec::new();
        for (i, c) in futures::future::join_all(tries)
            .await
            .into_iter()
            .enumerate()
        {
            match c {
                Ok(c) => conns.push(c),
                Err(source) => {
                    launcher.teardown().await;
                    return Err(ClusterError::Host { index: i, source });
                }
            }
        }
        let same_process = launcher.in_this_process();
        let mut cluster = Cluster::assemble(
            conns,
            vec![Owned::Launcher(launcher.clone())],
            self.lost_after,
            same_process,
        )
        .await;
        let reach = Reach::new(req, client_tls, self.calls, (self.lost_after, same_process));
        cluster.growth = Growth::launched(launcher, reach, &cluster.events, launched.len());
        cluster.launched = launched;
        Ok(cluster)
    }

    /// Hosts already running at `addrs` (host:port each).
    pub async fn connect(self, addrs: &[String]) -> Result<Cluster, ClusterError> {
        let (client_tls, _) = self.tls_parts(false)?;
        let tries = addrs.iter().map(|a| {
            HostConn::grpc(
                a,
                self.startup_timeout,
                self.token.as_deref(),
                client_tls.as_ref(),
                self.calls,
            )
        });
        let mut conns = Vec::new();
        for (i, c) in futures::future::join_all(tries)
            .await
            .into_iter()
            .enumerate()
        {
            conns.push(c.map_err(|source| ClusterError::Host { index: i, source })?);
        }
        Ok(Cluster::assemble(conns, Vec::new(), self.lost_after, false).await)
    }
}

enum Owned {
    Core(HostCore),
    Launcher(Arc<dyn HostLauncher>),
    /// A host process on this machine that an earlier controller started (`--recover`).
    Adopted(u32),
}

/// SIGTERM, then SIGKILL after `grace`, for a process that is not our child (no wait()).
async fn terminate_pid(pid: u32, grace: Duration) {
    use nix::sys::signal::{Signal, kill};
    let p = nix::unistd::Pid::from_raw(pid as i32);
    if kill(p, Signal::SIGTERM).is_err() {
        return; // already gone
    }
    let deadline = tokio::time::Instant::now() + grace;
    while tokio::time::Instant::now() < deadline {
        if kill(p, None).is_err() {
            return;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let _ = kill(p, Signal::SIGKILL);
}

/// The hosts one controller drives, and the events they report.
pub struct Cluster {
    hosts: Vec<HostHandle>,
    ports: Arc<crate::ports::PortLedger>,
    events: EventSinks,
    owned: Vec<Owned>,
    closing: Arc<AtomicBool>,
    launched: Vec<LaunchedHost>,
    growth: Arc<Growth>, // hosts added while it runs (`crate::grow`)
}

impl Cluster {
    /// Settings for a new cluster.
    pub fn builder() -> ClusterBuilder {
        ClusterBuilder::default()
    }

    /// `n` in-process hosts with the built-in actor kinds.
    pub async fn in_process(n: usize, gpus_per_host: u32) -> Result<Cluster, ClusterError> {
        Cluster::builder().in_process(n, gpus_per_host).await
    }

    /// `n` `troupe host` child processes with default settings.
    pub async fn local_processes(n: usize, gpus_per_host: u32) -> Result<Cluster, ClusterError> {
        Cluster::builder().local_processes(n, gpus_per_host).await
    }

    /// Hosts already running at `addrs`.
    pub async fn connect(addrs: &[String]) -> Result<Cluster, ClusterError> {
        Cluster::builder().connect(addrs).await
    }

    async fn assemble(
        conns: Vec<(Arc<HostConn>, troupe_wire::v1::HostDescription)>,
        owned: Vec<Owned>,
        lost_after: Duration,
        same_process: bool,
    ) -> Cluster {
        let events = EventSinks::new(4096);
        let closing = Arc::new(AtomicBool::new(false));
        let streams = futures::future::join_all(
            conns
                .iter()
                .map(|(c, _)| async move { c.watch().await.map_err(|e| e.to_string()) }),
        )
        .await;
        let hosts = conns
            .into_iter()
            .zip(streams)
            .enumerate()
            .map(|(index, ((conn, desc), opened))| {
                tokio::spawn(watch_host(
                    index,
                    conn.clone(),
                    opened,
                    events.clone(),
                    (lost_after, same_process),
                    closing.clone(),
                ));
                HostHandle { index, conn, desc }
            })
            .collect::<Vec<_>>();
        Cluster {
            growth: Growth::fixed(&events, hosts.len()),
            hosts,
            ports: Arc::default(),
            events,
            owned,
            closing,
            launched: Vec::new(),
        }
    }

    /// The ports this cluster's deployments hold ([`crate::ports`]): shared by every
    /// deployment's port allocator (fork and re-placement alike), so two deployments on this
    /// cluster never pick the same port; each releases its claims at teardown, and
    /// [`Cluster::shutdown`] releases whatever is left.
    pub fn ports(&self) -> &Arc<crate::ports::PortLedger> {
        &self.ports
    }

    /// Hosts added to the running cluster and given back (`crate::grow`): not in `hosts()`.
    pub(crate) fn growth(&self) -> &Arc<Growth> {
        &self.growth
    }

    /// All hosts, in order.
    pub fn hosts(&self) -> &[HostHandle] {
        &self.hosts
    }

    /// Host `i`. Panics if out of range, like slice indexing (the caller chose `i`).
    pub fn host(&self, i: usize) -> &HostHandle {
        &self.hosts[i]
    }

    /// Where a launcher put each host (node, address, GPUs), in host order; empty for
    /// in-process and connected hosts.
    pub fn launched(&self) -> &[LaunchedHost] {
        &self.launched
    }

    /// What the launchers of this cluster started (e.g. `slurm job 12 (output ...)`).
    pub fn launch_info(&self) -> Vec<String> {
        self.owned
            .iter()
            .filter_map(|o| match o {
                Owned::Launcher(l) => l.describe(),
                Owned::Core(_) | Owned::Adopted(_) => None,
            })
            .collect()
    }

    /// The address of this machine that the hosts reach it at: the local end of a route to
    /// the first host with a network address (`127.0.0.1` when every host is on loopback or
    /// in-process). Services the hosts' processes must dial back — the weight broadcast
    /// master — listen here.
    pub fn controller_ip(&self) -> std::net::IpAddr {
        let loopback = std::net::IpAddr::from([127, 0, 0, 1]);
        let remote = self.hosts.iter().find_map(|h| {
            let a: std::net::SocketAddr = h.address().parse().ok()?;
            (!a.ip().is_loopback()).then_some(a)
        });
        let Some(remote) = remote else {
            return loopback;
        };
        // A connected UDP socket sends nothing; it only asks the kernel for the route.
        let unspecified: std::net::SocketAddr = if remote.is_ipv6() {
            "[::]:0".parse().unwrap_or(remote)
        } else {
            "0.0.0.0:0".parse().unwrap_or(remote)
        };
        std::net::UdpSocket::bind(unspecified)
            .and_then(|s| {
                s.connect(remote)?;
                s.local_addr()
            })
            .map(|a| a.ip())
            .unwrap_or(loopback)
    }

    /// Subscribes to cluster events (host lost, actor lifecycle). A receiver that reads too
    /// slowly lags past 4,096 events and loses the oldest; [`Cluster::membership_events`] loses
    /// none.
    pub fn events(&self) -> broadcast::Receiver<ClusterEvent> {
        self.events.subscribe()
    }

    /// Subscribes to every cluster event from now on, none lost however late they are read
    /// (an unbounded queue): for what must react to every host or actor lost, like the
    /// serving watcher, which reads only after a bring-up that reports an event per actor.
    pub fn membership_events(&self) -> MembershipEvents {
        self.events.subscribe_lossless()
    }

    /// Takes over host processes on this machine that an earlier controller started (found
    /// again through its state file): [`Cluster::shutdown`] stops them as if this cluster had
    /// started them.
    pub fn adopt_processes(&mut self, pids: &[u32]) {
        self.owned.extend(pids.iter().map(|p| Owned::Adopted(*p)));
    }

    /// Crashes in-process host `i` as a host crash looks to the controller: its event stream
    /// ends at once (the cluster reports it lost, its pending calls fail), then its actors stop
    /// and their processes with them. For benchmarks and fault drills without host processes
    /// to kill. False, doing nothing, when host `i` is not an in-process (direct) host of this
    /// cluster.
    pub async fn crash_host(&self, i: usize) -> bool {
        let Some(id) = self.hosts.get(i).map(|h| h.id().to_string()) else {
            return false;
        };
        let core = self.owned.iter().find_map(|o| match o {
            Owned::Core(c) if c.host_id() == id => Some(c.clone()),
            _ => None,
        });
        let Some(core) = core else {
            return false;
        };
        core.stopped().cancel();
        core.shutdown().await;
        true
    }

    /// Stops everything this cluster started: in-process hosts shut down their actors,
    /// launchers tear their hosts down (host processes get SIGTERM, then SIGKILL; a Slurm job
    /// is cancelled), adopted host processes get SIGTERM. Connected hosts are left running.
    pub async fn shutdown(self) {
        self.closing.store(true, Ordering::Release);
        self.growth.close();
        // Nothing of this cluster keeps a port once its hosts are stopped.
        self.ports.release_all();
        let stops = self.owned.into_iter().map(|o| async move {
            match o {
                Owned::Core(c) => c.shutdown().await,
                Owned::Launcher(l) => l.teardown().await,
                Owned::Adopted(pid) => terminate_pid(pid, Duration::from_secs(10)).await,
            }
        });
        futures::future::join_all(stops).await;
    }
}
