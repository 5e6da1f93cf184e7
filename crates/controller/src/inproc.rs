//! The in-process [`HostLauncher`]: actor hosts inside the controller process, each served on
//! its own loopback gRPC port.
//!
//! It is the third launcher beside local processes and Slurm, so a test or a laptop run goes
//! through exactly the launch path a cluster does (launch, connect over gRPC, teardown) with
//! no process to start. [`crate::cluster::ClusterBuilder::in_process`] uses it for the `Grpc`
//! transport; the `Direct` transport skips the network and needs no launcher.

use std::sync::Mutex;

use futures::future::BoxFuture;
use troupe_actors::tls::ServerTls;
use troupe_actors::{HostConfig, HostCore, Registry};
use troupe_scheduler::{HostLauncher, LaunchError, LaunchRequest, LaunchedHost};

/// Starts hosts as [`HostCore`]s in this process, each on a loopback gRPC listener.
pub struct InProcessLauncher {
    registry: Registry,
    tls: Option<ServerTls>,
    cores: Mutex<Vec<HostCore>>,
}

impl InProcessLauncher {
    /// Hosts that can spawn the kinds in `registry`, serving TLS when `tls` is given.
    pub fn new(registry: Registry, tls: Option<ServerTls>) -> Self {
        InProcessLauncher {
            registry,
            tls,
            cores: Mutex::new(Vec::new()),
        }
    }

    fn cores(&self) -> std::sync::MutexGuard<'_, Vec<HostCore>> {
        self.cores.lock().unwrap_or_else(|p| p.into_inner())
    }

    async fn one(&self, req: &LaunchRequest, index: usize) -> Result<LaunchedHost, LaunchError> {
        let host_id = format!("host-{index}");
        let gpus: Vec<u32> = (0..req.gpus_per_host).collect();
        let cfg = HostConfig {
            host_id: host_id.clone(),
            gpu_ids: gpus.clone(),
            heartbeat_interval: req.heartbeat,
            max_message_bytes: req.max_message_bytes,
            shutdown_grace: req.shutdown_grace,
            auth_token: req.token.clone(),
            tls: self.tls.clone(),
            ..HostConfig::default()
        };
        let core = HostCore::start(cfg, self.registry.clone())
            .await
            .map_err(|e| LaunchError::Config(format!("{host_id}: {e}")))?;
        self.cores().push(core.clone());
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
            .await
            .map_err(|e| LaunchError::Config(format!("{host_id}: cannot bind loopback: {e}")))?;
        let addr = listener
            .local_addr()
            .map_err(|e| LaunchError::Config(format!("{host_id}: {e}")))?;
        core.set_address(addr.to_string());
        // The server stops when the core shuts down (teardown).
        tokio::spawn(troupe_actors::serve(core, listener, std::future::pending()));
        Ok(LaunchedHost {
            index,
            host_id,
            addr: addr.to_string(),
            node: troupe_scheduler::launch::report::node_name(),
            gpus,
        })
    }
}

impl HostLauncher for InProcessLauncher {
    fn name(&self) -> &'static str {
        "inprocess"
    }

    fn in_this_process(&self) -> bool {
        true
    }

    fn launch<'a>(
        &'a self,
        req: &'a LaunchRequest,
    ) -> BoxFuture<'a, Result<Vec<LaunchedHost>, LaunchError>> {
        Box::pin(async move {
            // Every host starts at once; if one fails, the ones that started are torn down.
            let started =
                futures::future::join_all((0..req.n_hosts).map(|i| self.one(req, i))).await;
            let mut hosts = Vec::with_capacity(req.n_hosts);
            for h in started {
                match h {
                    Ok(h) => hosts.push(h),
                    Err(e) => {
                        self.teardown().await;
                        return Err(e);
                    }
                }
            }
            Ok(hosts)
        })
    }

    fn teardown(&self) -> BoxFuture<'_, ()> {
        Box::pin(async move {
            let cores: Vec<HostCore> = std::mem::take(&mut *self.cores());
            futures::future::join_all(cores.iter().map(|c| c.shutdown())).await;
        })
    }

    fn describe(&self) -> Option<String> {
        let n = self.cores().len();
        (n > 0).then(|| format!("{n} in-process hosts on loopback gRPC"))
    }
}
