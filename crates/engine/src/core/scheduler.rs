//! The continuous-batching loop, on its own OS thread.
//!
//! Each iteration: apply queued commands (so weight swaps, pauses and aborts land *between*
//! batches, never inside one), admit waiting requests up to `max_running_requests` and prefill
//! them, run one decode step for every running request (sequences in parallel with rayon, each
//! computed independently so results never depend on batch composition), then publish events.
//!
//! The thread holds the scheduler's lock while it works and lets go of it only to wait for a
//! command; [`super::handle`] starts it and applies cheap commands itself while it waits.

use std::collections::VecDeque;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::mpsc as std_mpsc;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Instant;

use rayon::prelude::*;
use serde::Serialize;

use super::admit::{self, SharedCache};
use super::latency::LatencyModel;
use super::prefix_cache::PrefixCache;
use super::request::{Command, FinishReason, PauseMode, Reply, SeqEvent, SeqRequest};
use super::sequence::{PrefillOutcome, Sequence};
use crate::model::Weights;
use crate::pd::KvHandoff;
use crate::pd::room::{RoomState, RoomStore};

/// The scheduler and what tells a caller whether it may apply a command itself. The loop
/// (`run`) and the handle ([`super::handle`]) share it; it lives here, with the loop, so the
/// loop does not depend on its handle.
pub(super) struct Shared {
    /// Held by the scheduler thread except while it waits for a command.
    pub(super) sched: Mutex<Scheduler>,
    /// Commands sent and not yet taken by the thread: a command may run on its caller's thread
    /// only when this is zero, so it never overtakes one sent before it (a pause must abort a
    /// request submitted just before it).
    pub(super) queued: AtomicUsize,
}

impl std::fmt::Debug for Shared {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Shared")
            .field("queued", &self.queued.load(Ordering::Relaxed))
            .finish_non_exhaustive()
    }
}

/// Takes the scheduler's lock, poisoned or not: only a panic on the scheduler thread itself can
/// poison it (an inline command's panic is caught while its guard is still held, and shuts the
/// engine down), and that thread has ended by then.
pub(super) fn lock(m: &Mutex<Scheduler>) -> MutexGuard<'_, Scheduler> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

/// Static scheduler settings.
#[derive(Debug, Clone)]
pub struct SchedulerConfig {
    /// Most requests decoding at once (`--max-running-requests`).
    pub max_running: usize,
    /// Latency pacing.
    pub latency: LatencyModel,
    /// Initial weight version label.
    pub weight_version: String,
    /// Token budget of the prefix cache (`--max-total-tokens`); `None` turns the cache off
    /// (`--disable-radix-cache`).
    pub prefix_cache_tokens: Option<usize>,
}

/// A snapshot of the scheduler, for `/v1/loads`, `/server_info` and `/metrics`.
#[derive(Debug, Clone, Default, Serialize)]
pub struct EngineStatus {
    /// False once the scheduler thread has stopped.
    pub alive: bool,
    /// Requests decoding.
    pub num_running_reqs: usize,
    /// Requests queued.
    pub num_waiting_reqs: usize,
    /// KV positions held by running requests.
    pub num_used_tokens: usize,
    /// `null`, or the pause mode in effect.
    pub paused: Option<&'static str>,
    /// Current weight version.
    pub weight_version: String,
    /// Whether weights are released (`/release_memory_occupation`).
    pub weights_released: bool,
    /// Whether the KV cache is released.
    pub kv_cache_released: bool,
    /// Prompt tokens prefilled since start.
    pub prompt_tokens_total: u64,
    /// Tokens generated since start.
    pub generation_tokens_total: u64,
    /// Requests finished since start (any reason).
    pub requests_finished_total: u64,
    /// Requests aborted since start.
    pub requests_aborted_total: u64,
    /// Decode throughput of the last step, tokens/s.
    pub last_gen_throughput: f64,
    /// Weight updates applied since start.
    pub weight_updates_total: u64,
    /// Prompt tokens whose KV came from the prefix cache instead of being computed.
    pub cached_tokens_total: u64,
    /// Prompt tokens whose KV was computed here (prefill work actually done).
    pub prefill_computed_tokens_total: u64,
    /// PD decode: prompt KV positions received from prefill servers.
    pub kv_received_tokens_total: u64,
    /// PD decode: prompt KV positions taken from this server's own prefix cache instead.
    pub kv_local_tokens_total: u64,
    /// Tokens held by the prefix cache now.
    pub prefix_cache_tokens: usize,
    /// Tensors received for a staged weight update not committed yet (see `staging`).
    pub weights_staged: usize,
}

pub(super) struct Scheduler {
    pub(super) weights: Option<Weights>,
    pub(super) backup: Option<Weights>,
    pub(super) kv_released: bool,
    pub(super) waiting: VecDeque<Sequence>,
    pub(super) running: Vec<Sequence>,
    pub(super) paused: Option<PauseMode>,
    /// Callers of a pending `Drain`: while non-empty, no queued request is admitted.
    pub(super) drains: Vec<Reply>,
    pub(super) weight_version: String,
    pub(super) max_context: usize,
    pub(super) cfg: SchedulerConfig,
    pub(super) rooms: Option<Arc<RoomStore>>,
    pub(super) status: Arc<Mutex<EngineStatus>>,
    pub(super) counters: EngineStatus,
    pub(super) prefix: Option<SharedCache>,
    /// Set once the loop has ended: nothing is applied inline after that.
    pub(super) stopped: bool,
    /// A weight update received but not committed (see `super::staging`).
    pub(super) staged: Option<Staged>,
}

/// Tensors received for a staged weight update not yet committed (`super::staging`).
#[derive(Debug, Default)]
pub(super) struct Staged {
    /// The version the buckets were sent as (SGLang's per-bucket `weight_version`); a bucket
    /// of another version starts a new staging, dropping leftovers of an abandoned one.
    pub(super) version: Option<String>,
    /// By name, in the engine's f32.
    pub(super) tensors: std::collections::HashMap<String, Vec<f32>>,
}

impl Scheduler {
    /// A scheduler over these weights, idle; `rooms` is set on a PD prefill server.
    pub(super) fn new(
        weights: Weights,
        cfg: SchedulerConfig,
        rooms: Option<Arc<RoomStore>>,
    ) -> Self {
        let status = Arc::new(Mutex::new(EngineStatus {
            alive: true,
            weight_version: cfg.weight_version.clone(),
            ..Default::default()
        }));
        let prefix = cfg.prefix_cache_tokens.map(|budget| {
            Arc::new(Mutex::new(PrefixCache::new(
                &weights.config,
                budget,
                &cfg.weight_version,
            )))
        });
        Scheduler {
            prefix,
            max_context: weights.config.max_position_embeddings,
            weights: Some(weights),
            backup: None,
            kv_released: false,
            waiting: VecDeque::new(),
            running: Vec::new(),
            paused: None,
            drains: Vec::new(),
            weight_version: cfg.weight_version.clone(),
            cfg,
            rooms,
            status,
            counters: EngineStatus::default(),
            stopped: false,
            staged: None,
        }
    }

    fn blocked(&self) -> bool {
        self.paused.is_some() || self.weights.is_none() || self.kv_released
    }

    pub(super) fn has_work(&self) -> bool {
        let draining = !self.drains.is_empty();
        !self.blocked() && (!self.running.is_empty() || (!draining && !self.waiting.is_empty()))
    }

    /// Completes a pending drain once nothing runs: the engine is then paused in place (the
    /// queued requests stay queued).
    pub(super) fn finish_drain(&mut self) {
        if self.drains.is_empty() || !self.running.is_empty() {
            return;
        }
        if self.paused.is_none() {
            self.paused = Some(PauseMode::InPlace);
        }
        self.publish();
        for d in self.drains.drain(..) {
            let _ = d.send(Ok("drained".into()));
        }
    }

    /// The scheduler thread: holds the lock while it works, lets go only to wait for a command.
    pub(super) fn run(shared: &Shared, rx: std_mpsc::Receiver<Command>) {
        let take = |s: &mut Scheduler, cmd: Command| {
            shared.queued.fetch_sub(1, Ordering::SeqCst);
            s.handle(cmd)
        };
        let mut s = lock(&shared.sched);
        loop {
            s.finish_drain();
            // Block when idle; otherwise take whatever arrived since the last step.
            if !s.has_work() {
                s.publish();
                drop(s);
                let cmd = rx.recv();
                s = lock(&shared.sched);
                let Ok(cmd) = cmd else {
                    return s.stop();
                };
                if !take(&mut s, cmd) {
                    return s.stop();
                }
            }
            while let Ok(cmd) = rx.try_recv() {
                if !take(&mut s, cmd) {
                    return s.stop();
                }
            }
            if s.has_work() {
                s.step();
            }
            s.publish();
        }
    }

    pub(super) fn stop(&mut self) {
        self.stopped = true;
        self.abort_matching(None, "engine shutting down");
        self.publish();
        self.status.lock().unwrap_or_else(|p| p.into_inner()).alive = false;
    }

    pub(super) fn submit(&mut self, req: SeqRequest) {
        self.waiting.push_back(Sequence::new(req, self.max_context));
    }

    /// Aborts requests with this rid (or all); returns how many.
    pub(super) fn abort_matching(&mut self, rid: Option<&str>, why: &str) -> usize {
        let hit = |s: &Sequence| rid.is_none_or(|r| s.req.rid == r);
        let mut n = 0;
        let mut keep_running = Vec::with_capacity(self.running.len());
        let running = std::mem::take(&mut self.running);
        for mut s in running {
            if hit(&s) {
                s.finish(FinishReason::Abort(why.into()));
                n += 1;
                self.emit_done(s);
            } else {
                keep_running.push(s);
            }
        }
        self.running = keep_running;
        let waiting = std::mem::take(&mut self.waiting);
        for mut s in waiting {
            if hit(&s) {
                s.finish(FinishReason::Abort(why.into()));
                n += 1;
                self.emit_done(s);
            } else {
                self.waiting.push_back(s);
            }
        }
        n
    }

    fn step(&mut self) {
        let Some(weights) = self.weights.as_ref() else {
            return;
        };
        // Admit (nothing while draining).
        let room = if self.drains.is_empty() {
            self.cfg.max_running.saturating_sub(self.running.len())
        } else {
            0
        };
        let n_admit = room.min(self.waiting.len());
        let mut admitted: Vec<Sequence> = self.waiting.drain(..n_admit).collect();
        for s in admitted.iter_mut() {
            if let crate::core::SeqKind::Decode(h) = &s.req.kind {
                self.counters.kv_local_tokens_total += h.kv_start as u64;
                self.counters.kv_received_tokens_total +=
                    h.cache.len.saturating_sub(h.kv_start) as u64;
                s.cached_tokens = h.cached_tokens;
            }
        }
        let (batch, later) = match &self.prefix {
            Some(c) => admit::lookup(&mut admit::lock(c), admitted),
            None => (
                admitted.into_iter().map(|s| (s, None)).collect(),
                Vec::new(),
            ),
        };
        for s in later.into_iter().rev() {
            self.waiting.push_front(s);
        }
        let decoding = self.running.len();
        let mut admitted: Vec<Sequence> = Vec::with_capacity(batch.len());
        if !batch.is_empty() {
            let started = Instant::now();
            let tokens: usize = batch.iter().map(|(s, _)| s.prefill_len()).sum();
            let cached: usize = batch
                .iter()
                .map(|(_, p)| p.as_ref().map_or(0, |p| p.len))
                .sum();
            let outcomes: Vec<(Sequence, PrefillOutcome)> = batch
                .into_par_iter()
                .map(|(mut s, prefix)| {
                    let o = s.prefill(weights, prefix);
                    (s, o)
                })
                .collect();
            let computed = tokens - cached.min(tokens);
            LatencyModel::pace(self.cfg.latency.prefill_time(computed), started.elapsed());
            self.counters.prompt_tokens_total += tokens as u64;
            self.counters.cached_tokens_total += cached as u64;
            self.counters.prefill_computed_tokens_total += computed as u64;
            let in_use = self.kv_in_use();
            for (s, outcome) in outcomes {
                match outcome {
                    PrefillOutcome::Handoff { room, first, cache } => {
                        self.cache_kv(&s, &cache, in_use);
                        self.deposit(room, &s, first, cache);
                    }
                    PrefillOutcome::Continue => {
                        if let Some(kv) = &s.cache {
                            self.cache_kv(&s, kv, in_use);
                        }
                    }
                }
                admitted.push(s);
            }
        }
        // One decode step for the requests that were already running.
        if decoding > 0 {
            let started = Instant::now();
            self.running
                .par_iter_mut()
                .filter(|s| s.finished.is_none())
                .for_each(|s| s.decode_step(weights));
            let target = self.cfg.latency.decode_time(decoding);
            LatencyModel::pace(target, started.elapsed());
            let secs = started.elapsed().as_secs_f64();
            if secs > 0.0 {
                self.counters.last_gen_throughput = decoding as f64 / secs;
            }
        }
        self.running.append(&mut admitted);
        // Publish events; retire finished and orphaned requests.
        let running = std::mem::take(&mut self.running);
        for mut s in running {
            let events = std::mem::take(&mut s.pending);
            let mut alive = true;
            for e in events {
                if let SeqEvent::Tokens(t) = &e {
                    self.counters.generation_tokens_total += t.len() as u64;
                }
                alive &= s.req.events.send(e).is_ok();
            }
            if s.finished.is_some() {
                self.emit_done(s);
            } else if !alive {
                s.finish(FinishReason::Abort("client disconnected".into()));
                self.emit_done(s);
            } else {
                self.running.push(s);
            }
        }
    }

    /// KV positions held by running requests (they count against the cache's budget).
    fn kv_in_use(&self) -> usize {
        self.running.iter().map(Sequence::kv_tokens).sum()
    }

    /// Offers a sequence's KV to the prefix cache.
    fn cache_kv(&self, s: &Sequence, kv: &crate::model::KvCache, in_use: usize) {
        if let Some(c) = &self.prefix {
            admit::store(&mut admit::lock(c), s, kv, in_use);
        }
    }

    pub(super) fn release_cache(&self, s: &mut Sequence) {
        if let Some(c) = &self.prefix {
            admit::release(&mut admit::lock(c), s);
        }
    }

    /// Empties the prefix cache; its entries are of the current weights from now on.
    pub(super) fn flush_cache(&self) {
        if let Some(c) = &self.prefix {
            admit::lock(c).clear(&self.weight_version);
        }
    }

    fn deposit(&self, room: u64, s: &Sequence, first: (u32, f32), cache: crate::model::KvCache) {
        let Some(store) = &self.rooms else {
            return;
        };
        store.deposit(
            room,
            RoomState::Ready(Arc::new(KvHandoff {
                input_ids: s.req.input_ids.clone(),
                first_token: first.0,
                first_logprob: first.1,
                cache,
                weight_version: self.weight_version.clone(),
                cached_tokens: s.cached_tokens,
                kv_start: 0,
            })),
        );
    }

    /// Sends the final event for a finished sequence (and fails its room if it was a PD
    /// prefill that never produced a handoff).
    pub(super) fn emit_done(&mut self, mut s: Sequence) {
        self.release_cache(&mut s);
        if let Some(kv) = s.cache.take() {
            // Prompt and output stay cached for a follow-up turn that extends them.
            let in_use = self.kv_in_use();
            self.cache_kv(&s, &kv, in_use);
        }
        let reason = s
            .finished
            .take()
            .unwrap_or_else(|| FinishReason::Abort("finished without a reason".into()));
        if let FinishReason::Abort(msg) = &reason {
            self.counters.requests_aborted_total += 1;
            if let (crate::core::SeqKind::Prefill { room }, Some(store)) =
                (&s.req.kind, &self.rooms)
            {
                store.deposit(*room, RoomState::Failed(format!("prefill aborted: {msg}")));
            }
        }
        self.counters.requests_finished_total += 1;
        for e in std::mem::take(&mut s.pending) {
            let _ = s.req.events.send(e);
        }
        let _ = s.req.events.send(SeqEvent::Finished {
            reason,
            weight_version: self.weight_version.clone(),
            cached_tokens: s.cached_tokens,
        });
    }

    pub(super) fn publish(&self) {
        let mut st = self.status.lock().unwrap_or_else(|p| p.into_inner());
        *st = EngineStatus {
            alive: true,
            num_running_reqs: self.running.len(),
            num_waiting_reqs: self.waiting.len(),
            num_used_tokens: self.running.iter().map(Sequence::kv_tokens).sum(),
            paused: self.paused.map(PauseMode::as_str),
            weight_version: self.weight_version.clone(),
            weights_released: self.weights.is_none(),
            kv_cache_released: self.kv_released,
            weights_staged: self.staged_tensors(),
            ..self.counters.clone()
        };
    }
}

/// Shorthand used by handlers for replies that carry a user-facing message.
pub type MessageReply = Reply;
