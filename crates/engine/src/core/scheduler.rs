//! The continuous-batching loop, on its own OS thread.
//!
//! Each iteration: apply queued commands (so weight swaps, pauses and aborts land *between*
//! batches, never inside one), admit waiting requests up to `max_running_requests` and prefill
//! them, run one decode step for every running request (sequences in parallel with rayon, each
//! computed independently so results never depend on batch composition), then publish events.

use std::collections::VecDeque;
use std::sync::mpsc as std_mpsc;
use std::sync::{Arc, Mutex};
use std::time::Instant;

use rayon::prelude::*;
use serde::Serialize;
use tokio::sync::oneshot;

use super::latency::LatencyModel;
use super::request::{Command, FinishReason, PauseMode, Reply, SeqEvent, SeqRequest};
use super::sequence::{PrefillOutcome, Sequence};
use crate::error::EngineError;
use crate::model::Weights;
use crate::pd::KvHandoff;
use crate::pd::room::{RoomState, RoomStore};

/// Static scheduler settings.
#[derive(Debug, Clone)]
pub struct SchedulerConfig {
    /// Most requests decoding at once (`--max-running-requests`).
    pub max_running: usize,
    /// Latency pacing.
    pub latency: LatencyModel,
    /// Initial weight version label.
    pub weight_version: String,
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
}

/// Handle to the scheduler thread.
#[derive(Debug, Clone)]
pub struct EngineCore {
    tx: std_mpsc::Sender<Command>,
    status: Arc<Mutex<EngineStatus>>,
}

/// Marks the engine dead when dropped: held by the scheduler thread for its whole life.
struct MarkDead(Arc<Mutex<EngineStatus>>);

impl Drop for MarkDead {
    fn drop(&mut self) {
        self.0.lock().unwrap_or_else(|p| p.into_inner()).alive = false;
    }
}

impl EngineCore {
    /// Starts the scheduler thread with these weights. `rooms` is set on a PD prefill server.
    pub fn start(
        weights: Weights,
        cfg: SchedulerConfig,
        rooms: Option<Arc<RoomStore>>,
    ) -> Result<Self, EngineError> {
        let (tx, rx) = std_mpsc::channel();
        let status = Arc::new(Mutex::new(EngineStatus {
            alive: true,
            weight_version: cfg.weight_version.clone(),
            ..Default::default()
        }));
        let mut sched = Scheduler {
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
            status: status.clone(),
            counters: EngineStatus::default(),
        };
        let dead = MarkDead(status.clone());
        std::thread::Builder::new()
            .name("troupe-engine-scheduler".into())
            .spawn(move || {
                // However the thread ends (shutdown or a panic), the engine reports it: `/health`
                // turns 503 and `troupe engine` exits non-zero, so supervision restarts it.
                let _dead = dead;
                sched.run(rx)
            })?;
        Ok(Self { tx, status })
    }

    /// Sends a command; fails only if the thread is gone.
    pub fn send(&self, cmd: Command) -> Result<(), EngineError> {
        self.tx.send(cmd).map_err(|_| EngineError::SchedulerStopped)
    }

    /// Sends a command carrying a reply channel and awaits the answer.
    pub async fn call<T>(
        &self,
        make: impl FnOnce(oneshot::Sender<T>) -> Command,
    ) -> Result<T, EngineError> {
        let (tx, rx) = oneshot::channel();
        self.send(make(tx))?;
        rx.await.map_err(|_| EngineError::SchedulerStopped)
    }

    /// The latest status snapshot.
    pub fn status(&self) -> EngineStatus {
        self.status
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clone()
    }

    /// Stops the thread (requests in flight are aborted).
    pub fn shutdown(&self) {
        let _ = self.tx.send(Command::Shutdown);
    }
}

struct Scheduler {
    weights: Option<Weights>,
    backup: Option<Weights>,
    kv_released: bool,
    waiting: VecDeque<Sequence>,
    running: Vec<Sequence>,
    paused: Option<PauseMode>,
    /// Callers of a pending `Drain`: while non-empty, no queued request is admitted.
    drains: Vec<Reply>,
    weight_version: String,
    max_context: usize,
    cfg: SchedulerConfig,
    rooms: Option<Arc<RoomStore>>,
    status: Arc<Mutex<EngineStatus>>,
    counters: EngineStatus,
}

impl Scheduler {
    fn blocked(&self) -> bool {
        self.paused.is_some() || self.weights.is_none() || self.kv_released
    }

    fn has_work(&self) -> bool {
        let draining = !self.drains.is_empty();
        !self.blocked() && (!self.running.is_empty() || (!draining && !self.waiting.is_empty()))
    }

    /// Completes a pending drain once nothing runs: the engine is then paused in place (the
    /// queued requests stay queued).
    fn finish_drain(&mut self) {
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

    fn run(&mut self, rx: std_mpsc::Receiver<Command>) {
        loop {
            self.finish_drain();
            // Block when idle; otherwise take whatever arrived since the last step.
            if !self.has_work() {
                self.publish();
                match rx.recv() {
                    Ok(cmd) => {
                        if !self.handle(cmd) {
                            return self.stop();
                        }
                    }
                    Err(_) => return self.stop(),
                }
            }
            while let Ok(cmd) = rx.try_recv() {
                if !self.handle(cmd) {
                    return self.stop();
                }
            }
            if self.has_work() {
                self.step();
            }
            self.publish();
        }
    }

    fn stop(&mut self) {
        self.abort_matching(None, "engine shutting down");
        self.publish();
        self.status.lock().unwrap_or_else(|p| p.into_inner()).alive = false;
    }

    /// Handles one command; returns false on shutdown.
    fn handle(&mut self, cmd: Command) -> bool {
        match cmd {
            Command::Submit(req) => self.submit(*req),
            Command::Abort(rid, reply) => {
                let n = self.abort_matching(rid.as_deref(), "aborted by /abort_request");
                self.publish();
                let _ = reply.send(n);
            }
            Command::Pause(mode, reply) => {
                let n = match mode {
                    PauseMode::Abort => self.abort_matching(None, "aborted by pause_generation"),
                    PauseMode::Retract => {
                        let n = self.running.len();
                        for mut s in self.running.drain(..).rev() {
                            s.retract();
                            self.waiting.push_front(s);
                        }
                        n
                    }
                    PauseMode::InPlace => self.running.len(),
                };
                self.paused = Some(mode);
                self.publish();
                let _ = reply.send(n);
                // A pause that lands during a drain ends it: the engine is paused now.
                for d in self.drains.drain(..) {
                    let _ = d.send(Ok(format!("paused ({}) while draining", mode.as_str())));
                }
            }
            Command::Drain(reply) => {
                if self.weights.is_none() && !self.running.is_empty() {
                    let _ = reply.send(Err(format!(
                        "{} running requests cannot finish while the weights are released; wake up (or resume memory) first, or pause with mode abort",
                        self.running.len()
                    )));
                } else {
                    // As vLLM's PAUSED_NEW: requests held by an earlier pause run on and drain.
                    self.paused = None;
                    self.drains.push(reply);
                    self.publish();
                }
            }
            Command::Continue(reply) => {
                self.paused = None;
                for d in self.drains.drain(..) {
                    let _ = d.send(Err(
                        "resumed before the running requests finished; generation is not paused"
                            .into(),
                    ));
                }
                self.publish();
                let _ = reply.send(());
            }
            Command::Flush(reply) => {
                let busy = self.running.len() + self.waiting.len();
                let r = if busy == 0 {
                    Ok("Cache flushed.".to_string())
                } else {
                    Err(format!(
                        "Cache not flushed: {busy} requests are running or waiting; abort them or wait until idle"
                    ))
                };
                let _ = reply.send(r);
            }
            Command::UpdateTensors {
                tensors,
                version,
                reply,
            } => {
                let _ = reply.send(self.update_tensors(tensors, version));
            }
            Command::ReplaceWeights {
                weights,
                version,
                abort_all,
                reply,
            } => {
                let r = if self.weights.is_none() {
                    Err(released_msg())
                } else {
                    if abort_all {
                        self.abort_matching(None, "aborted for a weight update");
                    }
                    self.weights = Some(*weights);
                    self.bump_version(version);
                    Ok(format!(
                        "Succeeded to update model weights (version {}).",
                        self.weight_version
                    ))
                };
                let _ = reply.send(r);
            }
            Command::SetVersion {
                version,
                abort_all,
                reply,
            } => {
                if abort_all {
                    self.abort_matching(None, "aborted by update_weight_version");
                }
                self.weight_version = version;
                let _ = reply.send(Ok(format!(
                    "Weight version updated to {}",
                    self.weight_version
                )));
            }
            Command::Release {
                weights,
                kv_cache,
                reply,
            } => {
                let r = self.release(weights, kv_cache);
                self.publish();
                let _ = reply.send(r);
            }
            Command::Resume {
                weights,
                kv_cache,
                reply,
            } => {
                if weights && let Some(w) = self.backup.take() {
                    self.weights = Some(w);
                }
                if kv_cache {
                    self.kv_released = false;
                }
                self.publish();
                let _ = reply.send(Ok("Memory resumed.".into()));
            }
            Command::Shutdown => return false,
        }
        true
    }

    fn submit(&mut self, req: SeqRequest) {
        self.waiting.push_back(Sequence::new(req, self.max_context));
    }

    fn bump_version(&mut self, version: Option<String>) {
        if let Some(v) = version {
            self.weight_version = v;
        }
        self.counters.weight_updates_total += 1;
    }

    fn update_tensors(
        &mut self,
        tensors: Vec<(String, Vec<f32>)>,
        version: Option<String>,
    ) -> Result<String, String> {
        let Some(w) = self.weights.as_mut() else {
            return Err(released_msg());
        };
        // Validate everything first so a bad update changes nothing.
        for (name, data) in &tensors {
            let t = w
                .get(name)
                .ok_or_else(|| format!("unknown parameter {name:?}"))?;
            if t.numel() != data.len() {
                return Err(format!(
                    "parameter {name}: {} values for {} elements",
                    data.len(),
                    t.numel()
                ));
            }
        }
        let n = tensors.len();
        for (name, data) in tensors {
            w.set(&name, data)?;
        }
        self.bump_version(version);
        Ok(format!(
            "Succeeded to update {n} parameters online (version {}).",
            self.weight_version
        ))
    }

    fn release(&mut self, weights: bool, kv_cache: bool) -> Result<String, String> {
        if kv_cache && !self.running.is_empty() {
            return Err(format!(
                "{} requests hold KV cache; call /pause_generation with mode abort or retract (or wait until idle) before releasing kv_cache",
                self.running.len()
            ));
        }
        if weights && let Some(w) = self.weights.take() {
            self.backup = Some(w);
        }
        if kv_cache {
            self.kv_released = true;
        }
        Ok("Memory released.".into())
    }

    /// Aborts requests with this rid (or all); returns how many.
    fn abort_matching(&mut self, rid: Option<&str>, why: &str) -> usize {
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
        let decoding = self.running.len();
        if !admitted.is_empty() {
            let started = Instant::now();
            let tokens: usize = admitted.iter().map(Sequence::prefill_len).sum();
            let outcomes: Vec<PrefillOutcome> = admitted
                .par_iter_mut()
                .map(|s| s.prefill(weights))
                .collect();
            LatencyModel::pace(self.cfg.latency.prefill_time(tokens), started.elapsed());
            self.counters.prompt_tokens_total += tokens as u64;
            for (s, outcome) in admitted.iter().zip(outcomes) {
                if let PrefillOutcome::Handoff { room, first, cache } = outcome {
                    self.deposit(room, s, first, cache);
                }
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
            })),
        );
    }

    /// Sends the final event for a finished sequence (and fails its room if it was a PD
    /// prefill that never produced a handoff).
    fn emit_done(&mut self, mut s: Sequence) {
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
        });
    }

    fn publish(&self) {
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
            ..self.counters.clone()
        };
    }
}

fn released_msg() -> String {
    "weights are released; call /resume_memory_occupation with tags [\"weights\"] first".into()
}

/// Shorthand used by handlers for replies that carry a user-facing message.
pub type MessageReply = Reply;
