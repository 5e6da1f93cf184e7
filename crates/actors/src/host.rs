//! The host core: the actor table, spawn / call / stop / describe, and the restart policy.
//!
//! It is transport-free on purpose. The gRPC service ([`crate::service`]) and the controller's
//! in-process transport both call these same methods, so a test on in-process hosts runs the
//! real host logic, minus the network.

use std::collections::HashMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use parking_lot::{Mutex, RwLock};
use ractor::ActorRef;
use tokio::sync::{broadcast, mpsc, oneshot};
use tokio_util::sync::CancellationToken;
use troupe_wire::v1::{self, host_event::Event};

use crate::actor::ActorContext;
use crate::envelope::Envelope;
use crate::error::CallError;
use crate::events::EventBus;
use crate::hosted::{SupEvent, Supervisor, spawn_hosted};
use crate::registry::{Factory, Registry};

pub use crate::host_config::HostConfig;

/// Restart policy of one actor.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct RestartPolicy {
    /// Restarts allowed before the actor is reported failed for good.
    pub max_restarts: u32,
    /// Delay before the first restart; doubles with each restart that follows quickly (the
    /// actor ran less than the host's `stable_after`), capped at 30 s.
    pub backoff: Duration,
}

impl RestartPolicy {
    fn delay(&self, attempt: u32) -> Duration {
        let factor = 1u32 << attempt.saturating_sub(1).min(16);
        (self.backoff * factor).min(Duration::from_secs(30))
    }
}

enum State {
    Running(ActorRef<Envelope>),
    Restarting,
    Stopping,
}

struct Entry {
    kind: String,
    name: String,
    policy: RestartPolicy,
    args: Arc<Vec<u8>>,
    factory: Factory,
    restarts: u32,
    /// Restarts since the actor last ran stably (drives the back-off; `restarts` is the total).
    backoff_step: u32,
    /// When the running instance started.
    since: std::time::Instant,
    state: State,
    cell: Option<ractor::ActorId>,
}

struct Inner {
    cfg: HostConfig,
    address: RwLock<String>,
    registry: Registry,
    actors: RwLock<HashMap<String, Entry>>,
    cells: Mutex<HashMap<ractor::ActorId, String>>,
    tombstones: Mutex<crate::tombstones::Tombstones>,
    events: EventBus,
    supervisor: ActorRef<()>,
    shutting_down: AtomicBool,
    stop: CancellationToken,
}

/// A running actor host. Cheap to clone; all clones are the same host.
#[derive(Clone)]
pub struct HostCore {
    inner: Arc<Inner>,
}

impl HostCore {
    /// Starts a host: its supervisor, its heartbeat and its event loop.
    pub async fn start(cfg: HostConfig, registry: Registry) -> Result<HostCore, CallError> {
        let (tx, rx) = mpsc::unbounded_channel();
        let (supervisor, _) = ractor::Actor::spawn(None, Supervisor, tx)
            .await
            .map_err(|e| CallError::ActorFailed(format!("cannot start host supervisor: {e}")))?;
        let events = EventBus::new(cfg.host_id.clone());
        let inner = Arc::new(Inner {
            cfg,
            address: RwLock::new(String::new()),
            registry,
            actors: RwLock::new(HashMap::new()),
            cells: Mutex::new(HashMap::new()),
            tombstones: Mutex::new(crate::tombstones::Tombstones::default()),
            events,
            supervisor,
            shutting_down: AtomicBool::new(false),
            stop: CancellationToken::new(),
        });
        let core = HostCore { inner };
        let weak = Arc::downgrade(&core.inner);
        core.inner.events.spawn_heartbeats(
            core.inner.cfg.heartbeat_interval,
            move || {
                weak.upgrade()
                    .map(|i| i.actors.read().len() as u32)
                    .unwrap_or(0)
            },
            core.inner.stop.clone(),
        );
        tokio::spawn(core.clone().supervise(rx));
        Ok(core)
    }

    /// This host's id.
    pub fn host_id(&self) -> &str {
        &self.inner.cfg.host_id
    }

    /// The host's configuration.
    pub fn config(&self) -> &HostConfig {
        &self.inner.cfg
    }

    /// Records the address the host is reachable at (once its listener is bound).
    pub fn set_address(&self, addr: String) {
        *self.inner.address.write() = addr;
    }

    /// Cancelled when the host shuts down: streams and servers end on it.
    pub fn stopped(&self) -> CancellationToken {
        self.inner.stop.clone()
    }

    /// Subscribes to this host's lifecycle events and heartbeats.
    pub fn watch(&self) -> broadcast::Receiver<v1::HostEvent> {
        self.inner.events.subscribe()
    }

    /// A heartbeat event stamped now: sent first to a new watcher so it hears from us at once.
    pub fn heartbeat_now(&self) -> v1::HostEvent {
        let live = self.inner.actors.read().len() as u32;
        self.inner.events.event(crate::events::heartbeat(
            0,
            live,
            self.inner.cfg.heartbeat_interval,
        ))
    }

    /// Who we are, what we offer, what runs here.
    pub fn describe(&self) -> v1::HostDescription {
        let cfg = &self.inner.cfg;
        let actors = self
            .inner
            .actors
            .read()
            .iter()
            .map(|(id, e)| v1::ActorInfo {
                actor_id: id.clone(),
                kind: e.kind.clone(),
                name: e.name.clone(),
                restarts: e.restarts,
            })
            .collect();
        v1::HostDescription {
            host_id: cfg.host_id.clone(),
            address: self.inner.address.read().clone(),
            resources: Some(v1::Resources {
                gpu_ids: cfg.gpu_ids.clone(),
                cpus: cfg.cpus,
                memory_bytes: cfg.memory_bytes,
            }),
            actors,
            kinds: self.inner.registry.kind_names(),
            max_message_bytes: cfg.max_message_bytes,
            pid: std::process::id(),
            // `serve` takes framed calls on every plaintext listener.
            framed_calls: cfg.tls.is_none(),
        }
    }

    fn ctx(&self, actor_id: &str, name: &str, restarts: u32) -> ActorContext {
        ActorContext {
            actor_id: actor_id.to_string(),
            name: name.to_string(),
            host_id: self.inner.cfg.host_id.clone(),
            host_gpus: self.inner.cfg.gpu_ids.clone(),
            restarts,
            fail: None,
        }
    }

    /// Spawns an actor of a registered kind; returns its id once it has started.
    pub async fn spawn(
        &self,
        kind: &str,
        name: &str,
        args: Vec<u8>,
        policy: RestartPolicy,
    ) -> Result<String, CallError> {
        if self.inner.shutting_down.load(Ordering::Acquire) {
            return Err(CallError::HostShuttingDown);
        }
        if kind.is_empty() {
            return Err(CallError::BadRequest(
                "spawn needs a kind, e.g. \"troupe.diag\"".into(),
            ));
        }
        self.check_size(args.len())?;
        let factory = self.inner.registry.factory(kind)?;
        let id = uuid::Uuid::new_v4().to_string();
        let args = Arc::new(args);
        let r = spawn_hosted(
            self.inner.supervisor.get_cell(),
            factory.clone(),
            args.clone(),
            self.ctx(&id, name, 0),
        )
        .await?;
        let cell = r.get_id();
        self.inner.cells.lock().insert(cell, id.clone());
        self.inner.actors.write().insert(
            id.clone(),
            Entry {
                kind: kind.to_string(),
                name: name.to_string(),
                policy,
                args,
                factory,
                restarts: 0,
                backoff_step: 0,
                since: std::time::Instant::now(),
                state: State::Running(r),
                cell: Some(cell),
            },
        );
        self.inner.events.emit(Event::Started(v1::ActorStarted {
            actor: Some(v1::ActorInfo {
                actor_id: id.clone(),
                kind: kind.to_string(),
                name: name.to_string(),
                restarts: 0,
            }),
        }));
        Ok(id)
    }

    fn check_size(&self, n: usize) -> Result<(), CallError> {
        let limit = self.inner.cfg.max_message_bytes;
        if n as u64 > limit {
            return Err(CallError::MessageTooLarge {
                size: n as u64,
                limit,
            });
        }
        Ok(())
    }

    fn gone(&self, actor_id: &str) -> CallError {
        match self.inner.tombstones.lock().why.get(actor_id) {
            Some(e) => e.clone(),
            None => CallError::UnknownActor(actor_id.to_string()),
        }
    }

    /// Enqueues a call in the actor's mailbox and returns where its reply will arrive.
    ///
    /// Synchronous on purpose: the order in which callers invoke this is the order the actor
    /// sees, which is how per-caller ordering is kept over a stream.
    pub fn dispatch(
        &self,
        actor_id: &str,
        method: String,
        payload: Vec<u8>,
    ) -> Result<oneshot::Receiver<Result<Vec<u8>, CallError>>, CallError> {
        self.check_size(payload.len())?;
        if method.starts_with("__troupe.") {
            return Err(CallError::UnknownMethod(format!(
                "{method:?}: names starting with __troupe. are reserved"
            )));
        }
        let (tx, rx) = oneshot::channel();
        let actors = self.inner.actors.read();
        match actors.get(actor_id).map(|e| &e.state) {
            Some(State::Running(r)) => r
                .send_message(Envelope {
                    method,
                    payload,
                    reply: tx,
                })
                .map_err(|_| CallError::ActorFailed("actor is not running".into()))?,
            Some(State::Restarting) => {
                return Err(CallError::ActorFailed(
                    "actor is restarting after a failure; retry shortly".into(),
                ));
            }
            Some(State::Stopping) => {
                return Err(CallError::ActorFailed("actor is stopping".into()));
            }
            None => {
                drop(actors);
                return Err(self.gone(actor_id));
            }
        }
        Ok(rx)
    }

    /// Waits for a dispatched call's reply, within an optional deadline.
    pub async fn await_reply(
        &self,
        rx: oneshot::Receiver<Result<Vec<u8>, CallError>>,
        deadline: Option<Duration>,
    ) -> Result<Vec<u8>, CallError> {
        let died = || CallError::ActorFailed("the actor died before replying".into());
        let out = match deadline {
            Some(d) => match tokio::time::timeout(d, rx).await {
                Ok(r) => r.map_err(|_| died())?,
                Err(_) => return Err(CallError::DeadlineExceeded(d)),
            },
            None => rx.await.map_err(|_| died())?,
        }?;
        self.check_size(out.len())?;
        Ok(out)
    }

    /// One call: dispatch, then wait for the reply.
    pub async fn call(
        &self,
        actor_id: &str,
        method: String,
        payload: Vec<u8>,
        deadline: Option<Duration>,
    ) -> Result<Vec<u8>, CallError> {
        let rx = self.dispatch(actor_id, method, payload)?;
        self.await_reply(rx, deadline).await
    }

    /// Stops an actor: gracefully within `grace`, then by force. Returns whether it was graceful.
    pub async fn stop(&self, actor_id: &str, grace: Duration) -> Result<bool, CallError> {
        let r = {
            let mut actors = self.inner.actors.write();
            let Some(e) = actors.get_mut(actor_id) else {
                drop(actors);
                return Err(self.gone(actor_id));
            };
            match std::mem::replace(&mut e.state, State::Stopping) {
                State::Running(r) => Some(r),
                State::Restarting => None,
                State::Stopping => {
                    return Err(CallError::BadRequest(format!(
                        "actor {actor_id} is already stopping"
                    )));
                }
            }
        };
        let graceful = match r {
            None => true,
            Some(r) => {
                let graceful = r
                    .stop_and_wait(Some("stop requested".into()), Some(grace))
                    .await
                    .is_ok();
                if !graceful {
                    let _ = r.kill_and_wait(Some(Duration::from_secs(5))).await;
                }
                graceful
            }
        };
        self.finish(
            actor_id,
            CallError::UnknownActor(format!("{actor_id} (stopped)")),
        );
        let reason = if graceful {
            "stopped on request"
        } else {
            "killed after the grace period"
        };
        self.inner.events.emit(Event::Stopped(v1::ActorStopped {
            actor_id: actor_id.to_string(),
            reason: reason.into(),
        }));
        Ok(graceful)
    }

    fn finish(&self, actor_id: &str, why: CallError) {
        if let Some(e) = self.inner.actors.write().remove(actor_id)
            && let Some(c) = e.cell
        {
            self.inner.cells.lock().remove(&c);
        }
        self.inner.tombstones.lock().bury(actor_id.to_string(), why);
    }

    /// Applies supervision events: restart per policy, or report the actor failed.
    async fn supervise(self, mut rx: mpsc::UnboundedReceiver<SupEvent>) {
        while let Some(ev) = rx.recv().await {
            let (cell, reason, failed) = match ev {
                SupEvent::Failed(c, r) => (c, r, true),
                SupEvent::Terminated(c, r) => (c, r, false),
            };
            let Some(id) = self.inner.cells.lock().remove(&cell) else {
                continue; // a stop already cleaned up, or a start that never registered
            };
            if self.inner.shutting_down.load(Ordering::Acquire) {
                continue;
            }
            let attempt = {
                let mut actors = self.inner.actors.write();
                let Some(e) = actors.get_mut(&id) else {
                    continue;
                };
                if matches!(e.state, State::Stopping) {
                    continue; // stop() reports it
                }
                e.cell = None;
                if e.restarts < e.policy.max_restarts {
                    e.restarts += 1;
                    if e.since.elapsed() >= self.inner.cfg.stable_after {
                        e.backoff_step = 0;
                    }
                    e.backoff_step += 1;
                    e.state = State::Restarting;
                    Some((
                        e.restarts,
                        e.policy.delay(e.backoff_step),
                        e.factory.clone(),
                        e.args.clone(),
                        e.name.clone(),
                    ))
                } else {
                    None
                }
            };
            let reason = if failed {
                reason
            } else {
                format!("actor exited on its own: {reason}")
            };
            match attempt {
                Some((count, delay, factory, args, name)) => {
                    self.inner
                        .events
                        .emit(Event::Restarting(v1::ActorRestarting {
                            actor_id: id.clone(),
                            count,
                            reason: reason.clone(),
                            delay_ms: delay.as_millis() as u64,
                        }));
                    tokio::spawn(
                        self.clone()
                            .restart(id, count, delay, factory, args, name, reason),
                    );
                }
                None => self.fail(&id, reason, true),
            }
        }
    }

    fn fail(&self, id: &str, reason: String, exhausted: bool) {
        let max = self
            .inner
            .actors
            .read()
            .get(id)
            .map(|e| e.policy.max_restarts)
            .unwrap_or(0);
        let reason = if exhausted && max > 0 {
            format!("{reason} (restart budget of {max} exhausted)")
        } else {
            reason
        };
        self.finish(id, CallError::ActorFailed(reason.clone()));
        self.inner.events.emit(Event::Failed(v1::ActorFailed {
            actor_id: id.to_string(),
            reason,
        }));
    }

    #[allow(clippy::too_many_arguments)]
    async fn restart(
        self,
        id: String,
        count: u32,
        delay: Duration,
        factory: Factory,
        args: Arc<Vec<u8>>,
        name: String,
        reason: String,
    ) {
        tokio::time::sleep(delay).await;
        if self.inner.shutting_down.load(Ordering::Acquire) {
            return;
        }
        let ctx = self.ctx(&id, &name, count);
        match spawn_hosted(self.inner.supervisor.get_cell(), factory, args, ctx).await {
            Ok(r) => {
                let cell = r.get_id();
                let mut actors = self.inner.actors.write();
                match actors.get_mut(&id) {
                    Some(e) if matches!(e.state, State::Restarting) => {
                        e.state = State::Running(r);
                        e.since = std::time::Instant::now();
                        e.cell = Some(cell);
                        self.inner.cells.lock().insert(cell, id.clone());
                    }
                    _ => {
                        // Stopped while we were restarting it.
                        r.kill();
                        return;
                    }
                }
                drop(actors);
                self.inner.events.emit(Event::Restarted(v1::ActorRestarted {
                    actor_id: id,
                    count,
                    reason,
                }));
            }
            Err(e) => self.fail(&id, format!("{reason}; restart {count} failed: {e}"), false),
        }
    }

    /// Stops every actor (each with the configured grace) and the host's background tasks.
    pub async fn shutdown(&self) {
        if self.inner.shutting_down.swap(true, Ordering::AcqRel) {
            self.inner.stop.cancelled().await;
            return;
        }
        let ids: Vec<String> = self.inner.actors.read().keys().cloned().collect();
        let grace = self.inner.cfg.shutdown_grace;
        futures::future::join_all(ids.iter().map(|id| self.stop(id, grace))).await;
        self.inner.supervisor.stop(None);
        self.inner.stop.cancel();
    }

    /// True once [`HostCore::shutdown`] has begun.
    pub fn is_shutting_down(&self) -> bool {
        self.inner.shutting_down.load(Ordering::Acquire)
    }
}
