//! Weight synchronization from the trainer (rank 0, this process) to every inference engine,
//! prefill and decode alike, in BF16 or FP8 block-quantized form.
//!
//! Order of one update: pause every server → (re)build the broadcast group if the server set
//! changed → for each bucket, tell every engine what is coming and send it, concurrently →
//! resume every server. Prefill and decode are paused before and resumed after, so no request
//! is ever served by a prefill and a decode on different weight versions.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use bytes::Bytes;

use troupe_weights::bucket::{Bucket, pack_buckets};
use troupe_weights::delta::{DeltaMode, DeltaStats, SenderBases};
use troupe_weights::plan::{EngineGpus, WeightSyncPlan};
use troupe_weights::tcp::{SharedTensorRef, WeightSender};
use troupe_wire::sglang::{InitWeightsUpdateGroup, UpdateWeightsFromDistributed};

use troupe_wire::PauseMode;

use super::catch_up::{CatchUp, ControlHandle};
use super::control::{InferenceControl, all_ok};
use super::tensors::{HostTensor, encode};
use crate::engines::Engine;

pub use super::sync_error::WeightSyncError;

/// Settings of weight sync.
#[derive(Debug, Clone)]
pub struct WeightSyncOptions {
    /// Name of the broadcast group on every engine.
    pub group_name: String,
    /// Address engines reach this process at (the broadcast master).
    pub master_host: String,
    /// Most bytes per bucket.
    pub bucket_bytes: u64,
    /// Quantize 2-D projection weights to FP8 (e4m3, 128×128 blocks) on the way.
    pub fp8: bool,
    /// How generation in flight is paused.
    pub pause_mode: PauseMode,
    /// Flush engines' prefix caches with the last bucket.
    pub flush_cache: bool,
    /// How long engines may take to join the group.
    pub join_timeout: Duration,
    /// Keep the last update's encoded bytes so a server that restarts gets the current
    /// weights at once, before it serves (memory: one encoded copy of the model). Without it
    /// a restarted server waits, unrouted, for the next update.
    pub keep_for_catch_up: bool,
    /// Send only what changed since the version the engines hold (`weights.delta`). The bases
    /// are the last update's encoded buffers themselves (the catch-up copy, when that is kept:
    /// then no extra memory; else one encoded copy of the model), and on each engine the
    /// buffers it already received.
    pub delta: DeltaMode,
}

impl Default for WeightSyncOptions {
    fn default() -> Self {
        WeightSyncOptions {
            group_name: "troupe-weights".into(),
            master_host: "127.0.0.1".into(),
            bucket_bytes: troupe_weights::bucket::DEFAULT_BUCKET_BYTES,
            fp8: false,
            pause_mode: PauseMode::Abort,
            flush_cache: true,
            join_timeout: Duration::from_secs(60),
            keep_for_catch_up: true,
            delta: DeltaMode::Auto,
        }
    }
}

/// What one update did.
#[derive(Debug, Clone)]
pub struct UpdateReport {
    /// The version every engine now serves.
    pub version: String,
    /// Wall time from pause to resume.
    pub seconds: f64,
    /// Buckets sent.
    pub buckets: usize,
    /// Bytes of the encoded weights (what a full update sends to each receiver).
    pub bytes: u64,
    /// Bytes written to each data link, frame headers included (with deltas, usually far
    /// fewer than `bytes`).
    pub sent_bytes: u64,
    /// What was sent and what delta encoding did (no deltas with `weights.delta: off`, or
    /// `auto` when every engine reads the ring).
    pub delta: DeltaStats,
    /// Tensors sent as FP8.
    pub fp8_tensors: usize,
    /// Servers the update skipped because their process was down (they catch up when back).
    pub skipped: Vec<String>,
}

struct Group {
    sender: WeightSender,
    members: Vec<String>,
    generation: u64,
}

/// The last update, encoded, for servers that come back after it.
struct Cached {
    version: String,
    buckets: Vec<Bucket>,
    bytes: HashMap<String, Bytes>,
}

/// Rank 0 of the weight broadcast, and the orchestration around it. Cheap to clone: clones
/// share one group, and updates and catch-ups run one at a time.
#[derive(Clone)]
pub struct WeightSync {
    core: std::sync::Arc<tokio::sync::Mutex<Core>>,
}

struct Core {
    opts: WeightSyncOptions,
    group: Option<Group>,
    last: Option<Cached>,
    /// What the engines were last sent, when deltas are on; outlives groups.
    bases: Option<Arc<Mutex<SenderBases>>>,
}

impl WeightSync {
    /// A weight sync with no group yet (the first update builds it).
    pub fn new(opts: WeightSyncOptions) -> Self {
        WeightSync {
            core: std::sync::Arc::new(tokio::sync::Mutex::new(Core {
                bases: opts.delta.enabled().then(|| {
                    Arc::new(Mutex::new(SenderBases::new(
                        opts.delta == DeltaMode::Compress,
                    )))
                }),
                opts,
                group: None,
                last: None,
            })),
        }
    }

    /// Pushes `tensors` as `version` to every engine behind `control` (in the same order as
    /// `control.engines()`). Engines whose process is
    /// down (see [`super::fleet::Fleet`]) are skipped and listed in the report; every
    /// other engine must take the update or it fails as a whole.
    pub async fn update_weights(
        &self,
        control: &InferenceControl,
        engines: &[Engine],
        version: &str,
        tensors: &[HostTensor],
    ) -> Result<UpdateReport, WeightSyncError> {
        self.update_weights_with(control, engines, version, tensors, false)
            .await
    }

    /// [`WeightSync::update_weights`], leaving the engines paused afterwards when
    /// `keep_paused` (a client paused them and resumes them itself).
    pub async fn update_weights_with(
        &self,
        control: &InferenceControl,
        engines: &[Engine],
        version: &str,
        tensors: &[HostTensor],
        keep_paused: bool,
    ) -> Result<UpdateReport, WeightSyncError> {
        let mut core = self.core.lock().await;
        core.update_weights(control, engines, version, tensors, keep_paused)
            .await
    }

    /// Brings one server that came back after the last update onto that update's weights,
    /// through a group of its own (the next full update rebuilds the shared group). Returns
    /// the version it now holds.
    pub async fn catch_up(
        &self,
        control: &dyn ControlHandle,
        engine: &Engine,
    ) -> Result<String, WeightSyncError> {
        let mut core = self.core.lock().await;
        core.catch_up(control, engine).await
    }

    /// Lets the serving watcher behind `control` catch restarted servers up through this sync.
    pub fn attach(&self, control: &InferenceControl) {
        control
            .fleet()
            .set_catch_up(std::sync::Arc::new(self.clone()));
    }
}

impl CatchUp for WeightSync {
    fn catch_up<'a>(
        &'a self,
        control: &'a dyn ControlHandle,
        engine: &'a Engine,
    ) -> futures::future::BoxFuture<'a, Result<String, String>> {
        Box::pin(async move {
            WeightSync::catch_up(self, control, engine)
                .await
                .map_err(|e| e.to_string())
        })
    }
}

impl Core {
    async fn catch_up(
        &mut self,
        control: &dyn ControlHandle,
        engine: &Engine,
    ) -> Result<String, WeightSyncError> {
        let url = &engine.url;
        let Some(last) = self.last.take() else {
            return Err(WeightSyncError::Group(
                "no update is kept to catch up from (keep_for_catch_up is off, or no update happened yet)".into(),
            ));
        };
        let engines = [engine.clone()];
        let generation = control.generation();
        let r = async {
            self.ensure_group(control, &engines, generation).await?;
            phase(control, &engines, Phase::Start).await?;
            let n = last.buckets.len();
            for (k, b) in last.buckets.iter().enumerate() {
                let flush = k + 1 == n;
                self.send_bucket(control, &engines, b, &last.bytes, &last.version, flush)
                    .await?;
            }
            phase(control, &engines, Phase::Finish(&last.version)).await?;
            Ok::<_, String>(())
        }
        .await;
        let version = last.version.clone();
        self.last = Some(last);
        match r {
            Ok(()) => Ok(version),
            Err(reason) => {
                self.drop_group(control).await;
                Err(WeightSyncError::Update {
                    version,
                    reason,
                    after: format!("{url} stays out of the router until an update reaches it"),
                })
            }
        }
    }

    async fn update_weights(
        &mut self,
        control: &InferenceControl,
        engines: &[Engine],
        version: &str,
        tensors: &[HostTensor],
        keep_paused: bool,
    ) -> Result<UpdateReport, WeightSyncError> {
        let t0 = Instant::now();
        let (metas, bytes, fp8_tensors) = encode(tensors, self.opts.fp8)?;
        let total: u64 = metas.iter().map(|m| m.bytes).sum();
        let buckets = pack_buckets(metas, self.opts.bucket_bytes)
            .map_err(|e| WeightSyncError::Encode(e.to_string()))?;
        let fleet = control.fleet().clone();
        let generation = fleet.generation();
        let (live, skipped) = super::fleet::reachable(&fleet, engines);
        let skipped: Vec<String> = skipped.into_iter().map(String::from).collect();
        if live.is_empty() {
            return Err(WeightSyncError::Update {
                version: version.to_string(),
                reason: format!("every server is down: {skipped:?}"),
                after: "nothing changed".into(),
            });
        }
        let control = &control.subset(live.iter().map(|e| e.url.clone()).collect());
        let engines = &live[..];

        if let Err(e) = all_ok(&control.pause(self.opts.pause_mode).await) {
            // Nothing was sent: the servers that did pause all still hold one version.
            let after = self.recover(control, keep_paused).await;
            return Err(WeightSyncError::Update {
                version: version.to_string(),
                reason: format!("pause failed on {e}"),
                after,
            });
        }
        let sent = async {
            self.ensure_group(control, engines, generation).await?;
            phase(control, engines, Phase::Start).await?;
            let n = buckets.len();
            for (k, b) in buckets.iter().enumerate() {
                let flush = self.opts.flush_cache && k + 1 == n;
                self.send_bucket(control, engines, b, &bytes, version, flush)
                    .await?;
            }
            phase(control, engines, Phase::Finish(version)).await?;
            Ok::<_, String>(n)
        }
        .await;
        let delta = self
            .group
            .as_mut()
            .map(|g| g.sender.take_stats())
            .unwrap_or_default();
        match sent {
            Ok(n) => {
                self.last = self.opts.keep_for_catch_up.then(|| Cached {
                    version: version.to_string(),
                    buckets,
                    bytes,
                });
                let reached: Vec<String> = engines.iter().map(|e| e.url.clone()).collect();
                fleet.updated(version, &reached);
                if !keep_paused {
                    all_ok(&control.resume().await)
                        .map_err(|e| WeightSyncError::Control(format!("resume failed on {e}")))?;
                }
                Ok(UpdateReport {
                    version: version.to_string(),
                    seconds: t0.elapsed().as_secs_f64(),
                    buckets: n,
                    bytes: total,
                    sent_bytes: delta.sent_bytes,
                    delta,
                    fp8_tensors,
                    skipped,
                })
            }
            Err(reason) => {
                // The group is suspect now: rebuild it next time.
                self.drop_group(control).await;
                let after = self.recover(control, keep_paused).await;
                Err(WeightSyncError::Update {
                    version: version.to_string(),
                    reason,
                    after,
                })
            }
        }
    }

    /// After a failed update: resume only if every reachable engine serves one version.
    async fn recover(&self, control: &InferenceControl, keep_paused: bool) -> String {
        if keep_paused {
            return format!(
                "servers stay paused as the caller left them; versions now {:?}",
                control.weight_versions().await.distinct()
            );
        }
        // No version to expect after a failure: read them first.
        match control.resume_on_one_version(None, None).await {
            Ok(r) => {
                let ok = r.results.iter().filter(|r| r.result.is_ok()).count();
                let reached: std::collections::HashSet<&String> = r.reached.iter().collect();
                let unreachable: Vec<String> = control
                    .urls()
                    .into_iter()
                    .filter(|u| !reached.contains(u))
                    .collect();
                format!(
                    "{ok} reachable servers resumed on one weight version {}; unreachable: {unreachable:?}",
                    r.version.unwrap_or_default(),
                )
            }
            Err(m) => format!(
                "servers hold different weight versions {:?}, so they stay paused; call update_weights again to bring every server to one version and resume",
                m.versions
            ),
        }
    }

    /// Forgets a suspect group and has its members leave it (best effort), so the next update
    /// can build a fresh one at once instead of waiting for engines still joined to this one.
    async fn drop_group(&mut self, control: &dyn ControlHandle) {
        let Some(old) = self.group.take() else {
            return;
        };
        leave(control, &old.members, &self.opts.group_name).await;
    }

    /// Builds the group unless one exists for exactly these engines in this fleet generation
    /// (a restarted engine at the same URL is a new process that never joined the old group).
    async fn ensure_group(
        &mut self,
        control: &dyn ControlHandle,
        engines: &[Engine],
        generation: u64,
    ) -> Result<(), String> {
        let members: Vec<String> = engines.iter().map(|e| e.url.clone()).collect();
        if self
            .group
            .as_ref()
            .is_some_and(|g| g.members == members && g.generation == generation)
        {
            return Ok(());
        }
        let name = self.opts.group_name.clone();
        if let Some(old) = self.group.take() {
            leave(control, &old.members, &name).await;
        }
        let plan = WeightSyncPlan::new(
            &name,
            &engines
                .iter()
                .map(|e| EngineGpus {
                    engine: e.url.clone(),
                    gpus: e.gpus,
                })
                .collect::<Vec<_>>(),
            1,
        )
        .map_err(|e| e.to_string())?;
        let world = plan.world_size();
        let mut sender = WeightSender::bind(
            &format!("{}:0", self.opts.master_host),
            world as usize,
            &name,
        )
        .await
        .map_err(|e| format!("cannot open the broadcast master: {e}"))?;
        let port = sender.local_addr().map_err(|e| e.to_string())?.port();
        // Engines prove it to join (the init call is admin-keyed; the port and name are not
        // secret).
        let secret = sender.secret();
        let joins = engines.iter().enumerate().map(|(i, e)| {
            let req = InitWeightsUpdateGroup {
                master_address: self.opts.master_host.clone(),
                master_port: port,
                rank_offset: plan.rank_offset(i).unwrap_or(0),
                world_size: world,
                group_name: name.clone(),
                backend: "tcp".into(),
                group_secret: Some(secret.clone()),
            };
            async move {
                control
                    .client()
                    .init_weight_group(e, &req)
                    .await
                    .map_err(|err| format!("{}: {err}", e.url))
            }
        });
        // Once every engine has answered and one refused, nobody will connect for it: the
        // failure is reported then, not after the whole join timeout.
        let (accepted, joined) = {
            let accept = sender.accept_all(self.opts.join_timeout);
            let joins = futures::future::join_all(joins);
            tokio::pin!(accept, joins);
            tokio::select! {
                joined = &mut joins => {
                    if joined.iter().any(Result::is_err) {
                        (None, joined)
                    } else {
                        (Some(accept.await), joined)
                    }
                }
                accepted = &mut accept => (Some(accepted), joins.await),
            }
        };
        let errs: Vec<String> = joined.into_iter().filter_map(Result::err).collect();
        if !errs.is_empty() {
            return Err(format!(
                "engines failed to join the weight group: {}",
                errs.join("; ")
            ));
        }
        if let Some(accepted) = accepted {
            accepted
                .map_err(|e| format!("engines did not connect to the broadcast master: {e}"))?;
        }
        let all_on_ring = sender.shared_memory_receivers().len() == sender.receivers().len();
        if self.opts.delta.for_group(all_on_ring) {
            sender.set_delta(self.bases.clone());
        }
        self.group = Some(Group {
            sender,
            members,
            generation,
        });
        Ok(())
    }

    async fn send_bucket(
        &mut self,
        control: &dyn ControlHandle,
        engines: &[Engine],
        b: &Bucket,
        bytes: &HashMap<String, Bytes>,
        version: &str,
        flush: bool,
    ) -> Result<(), String> {
        let group = self.group.as_mut().ok_or("no weight group")?;
        let req = UpdateWeightsFromDistributed {
            names: b.names().into_iter().map(String::from).collect(),
            dtypes: b.dtypes().into_iter().map(String::from).collect(),
            shapes: b.shapes(),
            group_name: self.opts.group_name.clone(),
            flush_cache: flush,
            weight_version: Some(version.to_string()),
            packed: false,
        };
        let mut refs = Vec::with_capacity(b.tensors.len());
        for t in &b.tensors {
            let data = bytes
                .get(&t.name)
                .ok_or_else(|| format!("internal: no bytes for {}", t.name))?;
            refs.push(SharedTensorRef {
                name: &t.name,
                dtype: t.dtype,
                shape: &t.shape,
                bytes: data,
            });
        }
        let http = futures::future::join_all(engines.iter().map(|e| {
            let req = &req;
            async move {
                control
                    .client()
                    .update_weights(e, req)
                    .await
                    .map_err(|err| format!("{}: {err}", e.url))
            }
        }));
        // An engine that refuses the bucket (an unknown name, a wrong shape) never reads it, so
        // the broadcast would wait for it forever: a refusal ends the send at once (the group
        // is rebuilt next time; the engines changed nothing).
        let send = group.sender.send_bucket_shared(&refs);
        tokio::pin!(send);
        tokio::pin!(http);
        let mut sent = None;
        let answers = loop {
            tokio::select! {
                answers = &mut http => break answers,
                r = &mut send, if sent.is_none() => sent = Some(r),
            }
        };
        let errs: Vec<String> = answers.into_iter().filter_map(Result::err).collect();
        if !errs.is_empty() {
            return Err(errs.join("; "));
        }
        let sent = match sent {
            Some(r) => r,
            None => send.await,
        };
        sent.map_err(|e| format!("broadcast failed: {e}"))
    }
}

/// Has every engine of `control` that is one of `members` leave group `name`, all at once
/// (best effort).
async fn leave(control: &dyn ControlHandle, members: &[String], name: &str) {
    let members: std::collections::HashSet<&str> = members.iter().map(String::as_str).collect();
    let all = control.engines();
    futures::future::join_all(
        all.iter()
            .filter(|e| members.contains(e.url.as_str()))
            .map(|e| control.client().destroy_weight_group(e, name)),
    )
    .await;
}

/// The phases around the buckets that only vLLM's dialect has (a no-op for SGLang engines).
#[derive(Clone, Copy)]
enum Phase<'a> {
    Start,
    Finish(&'a str),
}

async fn phase(
    control: &dyn ControlHandle,
    engines: &[Engine],
    p: Phase<'_>,
) -> Result<(), String> {
    let calls = engines.iter().map(|e| async move {
        let r = match p {
            Phase::Start => control.client().start_weight_update(e).await,
            Phase::Finish(v) => control.client().finish_weight_update(e, Some(v)).await,
        };
        r.map_err(|err| format!("{}: {err}", e.url))
    });
    let errs: Vec<String> = futures::future::join_all(calls)
        .await
        .into_iter()
        .filter_map(Result::err)
        .collect();
    if errs.is_empty() {
        Ok(())
    } else {
        Err(errs.join("; "))
    }
}
