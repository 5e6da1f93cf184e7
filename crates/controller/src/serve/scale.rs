//! An elastic fleet: servers join and leave a running deployment.
//!
//! **Joining** (`Deployment::add_servers`): a new server is launched like a re-placed one
//! (`replace.rs`: the scheduler picks free GPUs under the placement's rules, ports come from the
//! deployment's ledger, a DataProxy goes in front), with the launch settings of a running server
//! of the same role. It joins the table (`Starting`), the control plane's engine list (so the
//! next weight update reaches it) and the fleet, which bumps its generation: the weight sync
//! then rebuilds its broadcast group for the next update, for every member (an NCCL group has a
//! fixed world size, so no transport here adds a rank to a live group). Before any update it
//! is routed at once (everyone serves the initial weights). After one, it is *held*: not
//! routed until the fleet's catch-up hook (the weight sync keeping the last update) brings it
//! to the current version, or the next update reaches it; then the gateway routes it
//! (`AddWorker`).
//!
//! **Leaving** (`Deployment::remove_server`): the server is marked `Draining`, leaves the
//! control plane's list and the fleet (updates no longer wait on it), and the gateway takes it
//! out of routing at once (`DrainWorker`: no new request or session goes to it; requests
//! already on it keep their place). Its in-flight count is polled until 0 or the drain
//! deadline; then its proxy and server stop, it is `Removed` in the table and its GPUs are free
//! for the next server. Its ports stay claimed until teardown (the ledger's cursor never goes
//! back). The last routed server of a role is never removed: add another first.
//!
//! **Outgrowing the allocation** (`super::outgrow`): when no host has free GPUs for a new
//! server, the cluster grows through its launcher (on Slurm: one more job, the nodes the
//! server needs, the first job's options; its hosts join as the first ones did) and the server
//! goes there (`HostsAdded`). A removal that leaves no server on such added hosts gives them
//! back (on Slurm: `scancel`; `HostsReleased`, and no "host lost"); teardown gives back the
//! rest. Launchers of a fixed size (local processes, Ray) refuse, and the answer says so.
//!
//! Both are also `POST /scale` on the gateway ([`troupe_serving::scale`]) and the Python
//! `Service`. Multi-node instances are neither added nor removed here.

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use tokio::sync::broadcast;
use troupe_serving::actors::{AddWorker, DrainWorker};
use troupe_serving::control_plane::{ControlPlane, Fleet, HeadState, InferenceControl};
use troupe_serving::inference::WorkerType;
use troupe_serving::scale::{Scale, ScaleError, ScaleOp};

use super::elastic::Elastic;
use super::events::ServingEvent;
use super::instances::{Instance, InstanceView, Instances, Lifecycle};
use super::replace::{ReplaceError, Replacer};

/// How often a drain polls the gateway for what is still in flight.
const DRAIN_POLL: Duration = Duration::from_millis(50);

/// How many times one added server grows the cluster before it gives up (another server
/// added at once may take the room a growth made).
const MAX_GROWTHS: usize = 2;

/// What grows and shrinks one deployment (see the module docs); the plane's `/scale` calls it.
pub(crate) struct Scaler {
    replacer: Arc<Replacer>,
    instances: Instances,
    gateway: super::gateway_slot::GatewaySlot,
    control: InferenceControl,
    /// The deployment's plane: the engine list changes while no fleet operation runs
    /// (`ControlPlane::quiet`). Weak: the plane holds this scaler.
    plane: std::sync::Weak<ControlPlane>,
    out: broadcast::Sender<ServingEvent>,
    /// The instance index the next added server takes (past every index of the plan).
    next_instance: AtomicUsize,
    /// Removals one at a time: "the last routed server of its role" is decided under it.
    removing: tokio::sync::Mutex<()>,
    /// Growths of the cluster one at a time (`super::outgrow`).
    growing: tokio::sync::Mutex<()>,
    /// The autoscaler's task, when one runs (`super::autoscale`); aborted at teardown.
    autoscaler: std::sync::Mutex<Option<tokio::task::JoinHandle<()>>>,
}

impl Scaler {
    /// A scaler over the deployment's table, launching through `replacer`.
    pub fn new(
        replacer: Arc<Replacer>,
        instances: Instances,
        gateway: super::gateway_slot::GatewaySlot,
        plane: &Arc<ControlPlane>,
        out: broadcast::Sender<ServingEvent>,
    ) -> Self {
        let control = plane.control().clone();
        let next = instances
            .all()
            .iter()
            .map(|i| i.head.instance + 1)
            .max()
            .unwrap_or(0);
        Scaler {
            replacer,
            instances,
            gateway,
            control,
            plane: Arc::downgrade(plane),
            out,
            next_instance: AtomicUsize::new(next),
            removing: tokio::sync::Mutex::new(()),
            growing: tokio::sync::Mutex::new(()),
            autoscaler: std::sync::Mutex::new(None),
        }
    }

    fn fleet(&self) -> &Arc<Fleet> {
        self.control.fleet()
    }

    /// Changes the engine list (and the fleet) by `f` while no fleet operation runs.
    async fn between_operations<R>(&self, f: impl FnOnce() -> R) -> R {
        match self.plane.upgrade() {
            Some(p) => {
                let _quiet = p.quiet().await;
                f()
            }
            None => f(),
        }
    }

    fn emit(&self, e: ServingEvent) {
        tracing::info!(event = ?e, "elastic fleet");
        let _ = self.out.send(e);
    }

    fn view(&self, url: &str) -> Option<InstanceView> {
        self.instances
            .view(self.fleet())
            .into_iter()
            .rev()
            .find(|v| v.server_url == url)
    }

    /// Launches `count` servers of `role` at once; each is routed before this returns unless it
    /// waits for the next weight update (no catch-up hook, or the catch-up failed). Their rows.
    pub async fn add(
        &self,
        role: WorkerType,
        count: usize,
    ) -> Result<Vec<InstanceView>, ScaleError> {
        let live = self.instances.live();
        let like: Vec<&Instance> = live
            .iter()
            .filter(|i| i.head.info.worker_type == role && i.life != Lifecycle::Draining)
            .collect();
        let Some(template) = like.iter().find(|i| i.others.is_empty()) else {
            return Err(if like.is_empty() {
                let roles: std::collections::BTreeSet<&str> = live
                    .iter()
                    .map(|i| i.head.info.worker_type.as_str())
                    .collect();
                ScaleError::BadRequest(format!(
                    "role: this deployment has no {role} server to add another of (it serves: {})",
                    roles.into_iter().collect::<Vec<_>>().join(", ")
                ))
            } else {
                ScaleError::Conflict(format!(
                    "its {role} servers span several hosts; multi-node servers are not added to a running deployment"
                ))
            });
        };
        let template = (*template).clone();
        let added = futures::future::join_all((0..count).map(|_| self.add_one(&template))).await;
        let mut rows = Vec::new();
        let mut failed = Vec::new();
        for r in added {
            match r {
                Ok(url) => rows.extend(self.view(&url)),
                Err(e) => failed.push(e.to_string()),
            }
        }
        if !failed.is_empty() {
            let kept = rows
                .iter()
                .map(|r| r.server_url.as_str())
                .collect::<Vec<_>>()
                .join(", ");
            return Err(ScaleError::Failed(format!(
                "{} of {count} {role} servers did not start ({}); started: [{kept}]",
                failed.len(),
                failed.join("; ")
            )));
        }
        Ok(rows)
    }

    async fn add_one(&self, template: &Instance) -> Result<String, ScaleError> {
        let idx = self.next_instance.fetch_add(1, Ordering::Relaxed);
        let h = &template.head;
        let base = format!(
            "{}-c{}g{}i{idx}n0",
            h.info.worker_type.as_str(),
            h.component,
            h.group
        );
        let placed = {
            let _placing = self.replacer.placing.read().await;
            let r = self.place(template, idx, &base).await;
            if let Ok(new) = &r {
                self.instances.add(new.clone());
            }
            r
        };
        let new = match placed {
            Ok(new) => new,
            Err(e) => {
                // Hosts grown for it and left empty go back.
                self.release_idle().await;
                return Err(e);
            }
        };
        let url = new.server_url().to_string();
        // A fresh member: the fleet's generation moves, so the next update rebuilds its group.
        let current = self
            .between_operations(|| {
                let mut engines = self.control.engines();
                engines.push(new.engine());
                self.control.set_engines(engines);
                self.fleet().mark_back(&url)
            })
            .await;
        self.emit(ServingEvent::Added {
            url: url.clone(),
            worker_type: h.info.worker_type,
            host: new.head.host,
        });
        if current {
            self.route(&url).await;
            return Ok(url);
        }
        self.instances.set_running(&url);
        self.emit(ServingEvent::Held { url: url.clone() });
        let Some(c) = self.fleet().catcher() else {
            return Ok(url); // the next weight update reaches it; the watcher routes it then
        };
        let started = Instant::now();
        match c.catch_up(&self.control, &new.engine()).await {
            Ok(version) => {
                tracing::info!(server = %url, %version, ms = started.elapsed().as_millis() as u64, "added server caught up");
                self.emit(ServingEvent::CaughtUp {
                    url: url.clone(),
                    version,
                });
                self.route(&url).await;
            }
            Err(e) => tracing::warn!(
                server = %url,
                "catch-up of an added server failed ({e}); the next weight update will include it"
            ),
        }
        Ok(url)
    }

    /// Launches a server like `template` as instance `idx` on free GPUs; when no host has
    /// room, on hosts the cluster grows by (see the module docs).
    async fn place(
        &self,
        template: &Instance,
        idx: usize,
        base: &str,
    ) -> Result<Instance, ScaleError> {
        let name = |attempt: usize| match attempt {
            0 => base.to_string(),
            n => format!("{base}-r{n}"),
        };
        let failed = |e: ReplaceError| ScaleError::Failed(e.to_string());
        let mut grown = 0;
        loop {
            match self.replacer.place_like(template, idx, name).await {
                Ok(i) => return Ok(i),
                Err(e) if e.no_room() && grown < MAX_GROWTHS => {}
                Err(e) => return Err(failed(e)),
            }
            let _one = self.growing.lock().await;
            // A growth that finished while this one waited may have made room.
            let no_room = match self.replacer.place_like(template, idx, name).await {
                Ok(i) => return Ok(i),
                Err(e) if e.no_room() => e,
                Err(e) => return Err(failed(e)),
            };
            let role = template.head.info.worker_type;
            let added = self.replacer.outgrow(template).await.map_err(|why| {
                ScaleError::Failed(format!(
                    "no host has free GPUs for another {role} server ({no_room}), and the cluster cannot grow: {why}"
                ))
            })?;
            grown += 1;
            self.emit(ServingEvent::HostsAdded {
                unit: added.unit.clone(),
                hosts: added.hosts.clone(),
            });
            match self.replacer.place_like(template, idx, name).await {
                Ok(i) => return Ok(i),
                Err(e) if e.no_room() => continue,
                Err(e) => return Err(failed(e)),
            }
        }
    }

    /// Gives back the added hosts no server runs on any more.
    async fn release_idle(&self) {
        for o in self.replacer.release_idle().await {
            self.emit(ServingEvent::HostsReleased {
                unit: o.unit,
                hosts: o.hosts,
            });
        }
    }

    /// Puts `url` in the router (unless it died or started leaving meanwhile).
    async fn route(&self, url: &str) {
        let Some(i) = self.instances.by_url(url) else {
            return;
        };
        let Some(worker) = i.worker else {
            return;
        };
        if i.life == Lifecycle::Draining || self.fleet().state(url) == HeadState::Down {
            return;
        }
        match self.gateway.call(AddWorker(worker.clone())).await {
            Ok(_) => {}
            Err(e) if e.to_string().contains("already registered") => {}
            Err(e) => {
                tracing::warn!(worker = %worker.url, "cannot register the added server: {e}");
                return;
            }
        }
        self.fleet().mark_serving(url);
        self.instances.set_running(url);
        self.emit(ServingEvent::Readmitted {
            url: url.to_string(),
        });
    }

    /// Drains the server at `url` (its server or worker URL) for at most `drain`, then stops
    /// it; its row.
    pub async fn remove(&self, url: &str, drain: Duration) -> Result<InstanceView, ScaleError> {
        let _one = self.removing.lock().await;
        let want = url.trim_end_matches('/');
        let live = self.instances.live();
        let Some(i) = live
            .iter()
            .find(|i| i.server_url() == want || i.worker.as_ref().is_some_and(|w| w.url == want))
        else {
            let known: Vec<&str> = live.iter().map(Instance::server_url).collect();
            return Err(ScaleError::BadRequest(format!(
                "remove: no server of this deployment is at {url:?} (its servers: {})",
                known.join(", ")
            )));
        };
        let server = i.server_url().to_string();
        if i.life == Lifecycle::Draining {
            return Err(ScaleError::Conflict(format!("{server} is already leaving")));
        }
        if !i.others.is_empty() {
            return Err(ScaleError::Conflict(format!(
                "{server} spans several hosts; multi-node servers are not removed from a running deployment"
            )));
        }
        let role = i.head.info.worker_type;
        let routed_peers = live
            .iter()
            .filter(|o| o.server_url() != server && o.head.info.worker_type == role)
            .filter(|o| {
                o.life == Lifecycle::Running
                    && self.fleet().state(o.server_url()) == HeadState::Serving
            })
            .count();
        if routed_peers == 0 {
            return Err(ScaleError::Conflict(format!(
                "{server} is the last routed {role} server: removing it would stop serving; add another first ({{\"role\": \"{role}\", \"add\": 1}})"
            )));
        }
        self.instances.set_life(&server, Lifecycle::Draining);
        // Out of fleet operations (after the one in progress, if any): no update waits on it,
        // and the next one rebuilds its group without it.
        self.between_operations(|| {
            let engines = self
                .control
                .engines()
                .into_iter()
                .filter(|e| e.url != server)
                .collect();
            self.control.set_engines(engines);
            self.fleet().forget(&server);
        })
        .await;
        let worker = i.worker.as_ref().map(|w| w.url.clone());
        let mut left = self.in_flight(worker.as_deref()).await;
        self.emit(ServingEvent::Draining {
            url: server.clone(),
            in_flight: left,
        });
        let deadline = Instant::now() + drain;
        while left > 0 && Instant::now() < deadline {
            tokio::time::sleep(DRAIN_POLL).await;
            left = self.in_flight(worker.as_deref()).await;
        }
        if left > 0 {
            tracing::warn!(server = %server, left, "drain deadline passed: stopping with requests in flight");
        }
        self.instances.set_life(&server, Lifecycle::Removed);
        if let Some(p) = &i.proxy {
            let _ = p.stop(Duration::from_secs(5)).await;
        }
        futures::future::join_all(i.nodes().map(|n| n.actor.stop(Duration::from_secs(15)))).await;
        self.emit(ServingEvent::Retired {
            url: server.clone(),
            cut: left,
        });
        self.release_idle().await;
        self.view(&server)
            .ok_or_else(|| ScaleError::Failed(format!("{server} left the table")))
    }

    /// Requests still in flight on `worker` (taking it out of routing on the first call); 0
    /// when the router does not know it (it was held or down, so nothing was sent to it).
    async fn in_flight(&self, worker: Option<&str>) -> usize {
        let Some(w) = worker else {
            return 0;
        };
        match self
            .gateway
            .call(DrainWorker {
                worker: w.to_string(),
            })
            .await
        {
            Ok(info) => info.load,
            Err(e) => {
                tracing::debug!(worker = w, "drain: {e}");
                0
            }
        }
    }
}

impl Scale for Scaler {
    fn scale(
        &self,
        op: ScaleOp,
    ) -> futures::future::BoxFuture<'_, Result<serde_json::Value, ScaleError>> {
        Box::pin(async move {
            match op {
                ScaleOp::Add { role, count } => {
                    let rows = self.add(role, count).await?;
                    Ok(serde_json::json!({ "added": rows }))
                }
                ScaleOp::Remove { url, drain } => {
                    let row = self.remove(&url, drain).await?;
                    Ok(serde_json::json!({ "removed": row }))
                }
            }
        })
    }
}

impl Elastic for Scaler {
    fn add(
        &self,
        role: WorkerType,
        count: usize,
    ) -> futures::future::BoxFuture<'_, Result<Vec<InstanceView>, ScaleError>> {
        Box::pin(Scaler::add(self, role, count))
    }

    fn remove<'a>(
        &'a self,
        url: &'a str,
        drain: Duration,
    ) -> futures::future::BoxFuture<'a, Result<InstanceView, ScaleError>> {
        Box::pin(Scaler::remove(self, url, drain))
    }

    /// `task` is the autoscaler now (one already running is stopped).
    fn set_autoscaler(&self, task: tokio::task::JoinHandle<()>) {
        let mut a = self.autoscaler.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(old) = a.replace(task) {
            old.abort();
        }
    }

    /// Stops the autoscaler, if one runs (teardown).
    fn stop_autoscaler(&self) {
        let mut a = self.autoscaler.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(t) = a.take() {
            t.abort();
        }
    }

    fn release_hosts(&self) -> futures::future::BoxFuture<'_, ()> {
        Box::pin(self.replacer.release_all())
    }
}
