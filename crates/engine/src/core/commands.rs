//! Commands to the scheduler: pause, drain, weights, memory, flush. Each is applied between
//! batches, never inside one: by the scheduler loop ([`super::scheduler`]), or, for the cheap
//! ones while that loop is idle, by the caller holding the scheduler's lock
//! ([`Command::runs_inline`]).

use super::request::{Command, PauseMode};
use super::scheduler::Scheduler;

impl Scheduler {
    /// Handles one command; returns false on shutdown.
    pub(super) fn handle(&mut self, cmd: Command) -> bool {
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
                        for mut s in std::mem::take(&mut self.running).into_iter().rev() {
                            self.release_cache(&mut s);
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
            Command::Continue(Some(versions), reply)
                if !versions.contains(&self.weight_version) =>
            {
                let _ = reply.send(Err(self.weight_version.clone()));
            }
            Command::Continue(_, reply) => {
                self.paused = None;
                for d in self.drains.drain(..) {
                    let _ = d.send(Err(
                        "resumed before the running requests finished; generation is not paused"
                            .into(),
                    ));
                }
                self.publish();
                let _ = reply.send(Ok(()));
            }
            Command::Flush(reply) => {
                let busy = self.running.len() + self.waiting.len();
                let r = if busy == 0 {
                    self.flush_cache();
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
                std::thread::sleep(self.cfg.latency.bucket_load_time());
                let r = self.update_tensors(tensors, version);
                // Published before the answer: a `/get_weight_version` right after it must
                // see the new version (the control plane's resume checks exactly that).
                self.publish();
                let _ = reply.send(r);
            }
            Command::StageTensors {
                tensors,
                version,
                reply,
            } => {
                std::thread::sleep(self.cfg.latency.bucket_load_time());
                let r = self.stage_tensors(tensors, version);
                self.publish();
                let _ = reply.send(r);
            }
            Command::CommitStaged { version, reply } => {
                let r = self.commit_staged(version);
                self.publish();
                let _ = reply.send(r);
            }
            Command::DiscardStaged(reply) => {
                let n = self.discard_staged();
                self.publish();
                let _ = reply.send(n);
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
                    self.flush_cache();
                    Ok(format!(
                        "Succeeded to update model weights (version {}).",
                        self.weight_version
                    ))
                };
                self.publish();
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
                self.flush_cache();
                self.publish();
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
            Command::Wake => {}
        }
        true
    }

    fn bump_version(&mut self, version: Option<String>) {
        if let Some(v) = version {
            self.weight_version = v;
        }
        self.counters.weight_updates_total += 1;
    }

    pub(super) fn update_tensors(
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
        self.flush_cache();
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
            self.flush_cache();
        }
        Ok("Memory released.".into())
    }
}

pub(super) fn released_msg() -> String {
    "weights are released; call /resume_memory_occupation with tags [\"weights\"] first".into()
}

#[cfg(test)]
mod tests {
    use crate::core::EngineCore;
    use crate::core::LatencyModel;
    use crate::core::request::Command;

    /// A scheduler over the tiny model at version `v0`, paced by `latency`.
    fn core(latency: LatencyModel) -> EngineCore {
        EngineCore::for_tests(latency)
    }

    /// A version set through the scheduler is visible the moment the call returns, even while
    /// the scheduler is busy decoding: the control plane's resume may read `/get_weight_version`
    /// right after an update and refuses mixed versions, so a stale snapshot would fail it.
    #[tokio::test]
    async fn a_set_version_is_published_before_the_answer() {
        // Every decode step takes 20 ms, so the loop's next snapshot is far away.
        let core = core(LatencyModel {
            decode_step_ms: Some(20.0),
            ..LatencyModel::default()
        });
        let _keep = core.submit_for_tests("busy", 1000);
        tokio::time::timeout(std::time::Duration::from_secs(30), async {
            for i in 0..5 {
                let v = format!("v{}", i + 1);
                core.call(|reply| Command::SetVersion {
                    version: v.clone(),
                    abort_all: false,
                    reply,
                })
                .await
                .expect("scheduler alive")
                .expect("set");
                assert_eq!(core.status().weight_version, v, "round {i}");
            }
        })
        .await
        .expect("in time");
        core.shutdown();
    }

    /// `stopped` resolves when the scheduler thread ends, for a waiter that started before
    /// and one that starts after (what `troupe engine` exits on instead of polling).
    #[tokio::test]
    async fn stopped_resolves_when_the_scheduler_thread_ends() {
        let core = core(LatencyModel::default());
        let early = tokio::spawn({
            let core = core.clone();
            async move { core.stopped().await }
        });
        let running = tokio::time::timeout(std::time::Duration::from_millis(50), core.stopped());
        assert!(running.await.is_err(), "stopped while the thread runs");
        core.shutdown();
        let wait = std::time::Duration::from_secs(30);
        tokio::time::timeout(wait, early)
            .await
            .expect("the early waiter is woken")
            .expect("joined");
        tokio::time::timeout(wait, core.stopped())
            .await
            .expect("a late waiter returns at once");
        assert!(!core.status().alive);
    }
}
