//! Weight synchronization from the trainer (rank 0, this process) to every inference engine,
//! prefill and decode alike, in BF16 or FP8 block-quantized form.
//!
//! Order of one update: pause every server → (re)build the broadcast group if the server set
//! changed → for each bucket, tell every engine what is coming and send it, concurrently (staged
//! on the engines that stage) → commit on the staging engines once every engine has every
//! bucket → resume every server. Prefill and decode are paused before and resumed after, so no
//! request is ever served by a prefill and a decode on different weight versions. A failure
//! takes nothing half-way: staged updates are dropped, and engines that applied buckets as
//! they came are held out until a complete update reaches them (`super::outcome`).

use std::collections::{HashMap, HashSet};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use bytes::Bytes;

use troupe_weights::bucket::{Bucket, pack_buckets};
use troupe_weights::delta::{DeltaMode, DeltaStats, SenderBases};

use troupe_wire::{PauseMode, WeightVersion};

use super::catch_up::{CatchUp, ControlHandle};
use super::control::InferenceControl;
use super::outcome::{EngineOutcome, Outcome, Staging};
use super::tensors::{HostTensor, encode};
use super::weight_group::{BucketSend, Group, Phase, leave, phase, send_bucket};
use crate::engines::Engine;

mod rolling;
mod txn;

pub use rolling::{PartSize, Rollout, parts};

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
    /// Stage updates on engines that can, so a failed update is dropped whole
    /// (`weights.staging`; see [`Staging`]).
    pub staging: Staging,
    /// All engines at once, or a part at a time while the rest serves (`weights.rollout`).
    pub rollout: Rollout,
    /// With a rolling update, how long a part taken out of routing may take to finish the
    /// requests already on it before it is paused all the same (`weights.rolling_drain_s`).
    pub rolling_drain: Duration,
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
            staging: Staging::Auto,
            rollout: Rollout::All,
            rolling_drain: Duration::from_secs(60),
        }
    }
}

/// What one update did.
#[derive(Debug, Clone)]
pub struct UpdateReport {
    /// The version every engine now serves.
    pub version: WeightVersion,
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
    /// What the update did to each engine (committed a staged update, applied it as it came,
    /// held out after a commit went unanswered, or skipped).
    pub engines: Vec<EngineOutcome>,
}

/// One update's tensors encoded for the wire and packed in buckets: made once per update, so a
/// rolling update sends the same bytes to every part (cheap to clone: the bytes are shared).
#[derive(Clone)]
struct Prepared {
    buckets: Vec<Bucket>,
    bytes: HashMap<String, Bytes>,
    /// Bytes of the encoded weights.
    total: u64,
    fp8_tensors: usize,
}

/// The last update, encoded, for servers that come back after it.
struct Cached {
    version: WeightVersion,
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
    /// Whether each engine stages, by URL, as read under a fleet generation (a restart may
    /// bring another engine to the same URL).
    stages: HashMap<String, (u64, bool)>,
    /// Engines held out after a failed update: paused with part of it; resumed once a
    /// catch-up brings them to a complete version.
    tainted: HashSet<String>,
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
                stages: HashMap::new(),
                tainted: HashSet::new(),
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
        version: &WeightVersion,
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
        version: &WeightVersion,
        tensors: &[HostTensor],
        keep_paused: bool,
    ) -> Result<UpdateReport, WeightSyncError> {
        let mut core = self.core.lock().await;
        match core.opts.rollout {
            // A caller that paused the fleet itself wants it updated as it stands.
            Rollout::Rolling(size) if !keep_paused => {
                core.update_rolling(control, engines, version, tensors, size)
                    .await
            }
            _ => {
                let prepared = core.prepare(tensors)?;
                core.update_weights(control, engines, version, prepared, keep_paused)
                    .await
            }
        }
    }

    /// Brings one server that came back after the last update onto that update's weights,
    /// through a group of its own (the next full update rebuilds the shared group). Returns
    /// the version it now holds.
    pub async fn catch_up(
        &self,
        control: &dyn ControlHandle,
        engine: &Engine,
    ) -> Result<WeightVersion, WeightSyncError> {
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
    ) -> futures::future::BoxFuture<'a, Result<WeightVersion, String>> {
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
    ) -> Result<WeightVersion, WeightSyncError> {
        let url = &engine.url;
        let Some(last) = self.last.take() else {
            return Err(WeightSyncError::Group(
                "no update is kept to catch up from (keep_for_catch_up is off, or no update happened yet)".into(),
            ));
        };
        let engines = [engine.clone()];
        let generation = control.generation();
        let none = HashSet::new();
        let r = async {
            self.ensure_group(control, &engines, generation).await?;
            phase(control, &engines, Phase::Start).await?;
            let n = last.buckets.len();
            let how = |k: usize| BucketSend {
                group_name: &self.opts.group_name,
                version: &last.version,
                flush: k + 1 == n,
                staged: &none,
            };
            for (k, b) in last.buckets.iter().enumerate() {
                let how = how(k);
                let group = self.group.as_mut().ok_or("no weight group")?;
                send_bucket(group, control, &engines, b, &last.bytes, &how).await?;
            }
            phase(control, &engines, Phase::Finish(&last.version, &none)).await?;
            // Held out after a failed update, it was left paused: it serves again now that it
            // holds a complete version.
            if self.tainted.contains(url) {
                control
                    .client()
                    .resume(engine)
                    .await
                    .map_err(|e| format!("{url}: resume after the catch-up: {e}"))?;
                self.tainted.remove(url);
            }
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
                    engines: vec![EngineOutcome {
                        url: url.clone(),
                        staged: false,
                        outcome: Outcome::HeldOut,
                    }],
                })
            }
        }
    }

    /// Encodes `tensors` (BF16, or FP8 blocks when configured) and packs them in buckets.
    fn prepare(&self, tensors: &[HostTensor]) -> Result<Prepared, WeightSyncError> {
        let (metas, bytes, fp8_tensors) = encode(tensors, self.opts.fp8)?;
        let total: u64 = metas.iter().map(|m| m.bytes).sum();
        let buckets = pack_buckets(metas, self.opts.bucket_bytes)
            .map_err(|e| WeightSyncError::Encode(e.to_string()))?;
        Ok(Prepared {
            buckets,
            bytes,
            total,
            fp8_tensors,
        })
    }

    async fn update_weights(
        &mut self,
        control: &InferenceControl,
        engines: &[Engine],
        version: &WeightVersion,
        prepared: Prepared,
        keep_paused: bool,
    ) -> Result<UpdateReport, WeightSyncError> {
        let t0 = Instant::now();
        let Prepared {
            buckets,
            bytes,
            total,
            fp8_tensors,
        } = prepared;
        let fleet = control.fleet().clone();
        let generation = fleet.generation();
        let (live, skipped) = super::fleet::reachable(&fleet, engines);
        let skipped: Vec<String> = skipped.into_iter().map(String::from).collect();
        let outcome = |url: &str, staged: bool, outcome: Outcome| EngineOutcome {
            url: url.to_string(),
            staged,
            outcome,
        };
        let skipped_outcomes: Vec<EngineOutcome> = skipped
            .iter()
            .map(|u| outcome(u, false, Outcome::Skipped))
            .collect();
        if live.is_empty() {
            return Err(WeightSyncError::Update {
                version: version.clone(),
                reason: format!("every server is down: {skipped:?}"),
                after: "nothing changed".into(),
                engines: skipped_outcomes,
            });
        }
        let live_urls: Vec<String> = live.iter().map(|e| e.url.clone()).collect();
        let control = &control.subset(live_urls.clone());
        let engines = &live[..];
        // From the pause on, what each engine serves is unknown until the commit says.
        fleet.tell_versions(&live_urls, None).await;

        if let Err(e) = super::control::all_ok(&control.pause(self.opts.pause_mode).await) {
            // Nothing was sent: the servers that did pause all still hold one version.
            let (after, on) = self.recover(control, keep_paused).await;
            fleet.tell_versions(&live_urls, on.as_ref()).await;
            let mut all: Vec<EngineOutcome> = engines
                .iter()
                .map(|e| outcome(&e.url, false, Outcome::Unchanged))
                .collect();
            all.extend(skipped_outcomes);
            return Err(WeightSyncError::Update {
                version: version.clone(),
                reason: format!("pause failed on {e}"),
                after,
                engines: all,
            });
        }
        let staged = self.staging_engines(control, engines, generation).await;
        let group_name = self.opts.group_name.clone();
        let flush_cache = self.opts.flush_cache;
        // Whether any bucket went out: an engine that applies as it receives may hold part of
        // the update from then on.
        let mut began = false;
        let sent = async {
            self.clear_staged(control, engines, &staged).await?;
            self.ensure_group(control, engines, generation).await?;
            phase(control, engines, Phase::Start).await?;
            let n = buckets.len();
            for (k, b) in buckets.iter().enumerate() {
                began = true;
                let how = BucketSend {
                    group_name: &group_name,
                    version,
                    flush: flush_cache && k + 1 == n,
                    staged: &staged,
                };
                let group = self.group.as_mut().ok_or("no weight group")?;
                send_bucket(group, control, engines, b, &bytes, &how).await?;
            }
            phase(control, engines, Phase::Finish(version, &staged)).await?;
            Ok::<_, String>(n)
        }
        .await;
        let delta = self
            .group
            .as_mut()
            .map(|g| g.sender.take_stats())
            .unwrap_or_default();
        let Ok(n) = sent else {
            let reason = sent.err().unwrap_or_default();
            // The group is suspect now: rebuild it next time.
            self.drop_group(control).await;
            let outcomes = self.abandon(control, engines, &staged, began, &fleet).await;
            let clean: Vec<String> = outcomes
                .iter()
                .filter(|o| o.outcome != Outcome::HeldOut)
                .map(|o| o.url.clone())
                .collect();
            let (mut after, on) = self
                .recover(&control.subset(clean.clone()), keep_paused)
                .await;
            fleet.tell_versions(&clean, on.as_ref()).await;
            let held: Vec<&str> = outcomes
                .iter()
                .filter(|o| o.outcome == Outcome::HeldOut)
                .map(|o| o.url.as_str())
                .collect();
            if !held.is_empty() {
                after.push_str(&format!(
                    "; held out (paused, unrouted) until a complete update reaches them, as they apply buckets as they arrive: {held:?}"
                ));
            }
            let mut all = outcomes;
            all.extend(skipped_outcomes);
            return Err(WeightSyncError::Update {
                version: version.clone(),
                reason,
                after,
                engines: all,
            });
        };
        let outcomes = self
            .commit(control, engines, &staged, version, &fleet)
            .await;
        let reached: Vec<String> = outcomes
            .iter()
            .filter(|o| o.outcome.took_it())
            .map(|o| o.url.clone())
            .collect();
        self.last = self.opts.keep_for_catch_up.then(|| Cached {
            version: version.clone(),
            buckets,
            bytes,
        });
        for u in &reached {
            self.tainted.remove(u);
        }
        fleet.updated(version, &reached);
        // Before they resume: no request asking for a version reaches one the router has not
        // been told about.
        fleet.tell_versions(&reached, Some(version)).await;
        if !keep_paused {
            super::control::all_ok(&control.subset(reached).resume().await)
                .map_err(|e| WeightSyncError::Control(format!("resume failed on {e}")))?;
        }
        let mut all = outcomes;
        all.extend(skipped_outcomes);
        Ok(UpdateReport {
            version: version.clone(),
            seconds: t0.elapsed().as_secs_f64(),
            buckets: n,
            bytes: total,
            sent_bytes: delta.sent_bytes,
            delta,
            fp8_tensors,
            skipped,
            engines: all,
        })
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
        let mut sender = super::weight_group::build(
            control,
            engines,
            &name,
            &self.opts.master_host,
            self.opts.join_timeout,
        )
        .await?;
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
}
