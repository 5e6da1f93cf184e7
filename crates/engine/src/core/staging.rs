//! Staged weight updates: a bucket received with `stage` goes into a copy beside the live
//! weights instead of into them, and the whole update is swapped in by one commit (or dropped
//! by one abort). The control plane commits only after every engine of the fleet has staged
//! every bucket, so an update that fails half-way leaves every engine serving exactly the
//! weights it served before, under the label that made them.
//!
//! Memory: while an update is staged, one extra f32 copy of every tensor it sent (for a full
//! update, one copy of the model); it is freed by the commit or the abort.

use std::collections::HashMap;

use super::scheduler::{Scheduler, Staged};

impl Scheduler {
    /// Checks `tensors` against the model and keeps them for [`Scheduler::commit_staged`];
    /// the live weights and the served version do not change.
    pub(super) fn stage_tensors(
        &mut self,
        tensors: Vec<(String, Vec<f32>)>,
        version: Option<String>,
    ) -> Result<String, String> {
        let Some(w) = self.weights.as_ref() else {
            return Err(super::commands::released_msg());
        };
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
        let fresh = match (&self.staged, &version) {
            (None, _) => true,
            (Some(s), Some(v)) => s.version.as_ref().is_some_and(|old| old != v),
            (Some(_), None) => false,
        };
        if fresh {
            self.staged = Some(Staged {
                version: version.clone(),
                tensors: HashMap::new(),
            });
        }
        let s = self.staged.get_or_insert_with(Staged::default);
        if s.version.is_none() {
            s.version = version;
        }
        let n = tensors.len();
        s.tensors.extend(tensors);
        Ok(format!(
            "Staged {n} parameters ({} staged in all); call /commit_weight_update to serve them.",
            s.tensors.len()
        ))
    }

    /// Swaps every staged tensor in at once and serves `version` (or the staged buckets' own).
    pub(super) fn commit_staged(&mut self, version: Option<String>) -> Result<String, String> {
        if self.weights.is_none() {
            return Err(super::commands::released_msg());
        }
        let Some(s) = self.staged.take() else {
            return Err("no staged weight update to commit; send buckets with stage first".into());
        };
        let version = version.or(s.version);
        let n = s.tensors.len();
        // The latency model's load time (0 unless set): the engine is paused for the update.
        std::thread::sleep(self.cfg.latency.weight_load_time());
        let r = self.update_tensors(s.tensors.into_iter().collect(), version);
        r.map(|_| {
            format!(
                "Committed {n} staged parameters (version {}).",
                self.weight_version
            )
        })
    }

    /// Drops a staged update; how many tensors it held (0 when none was staged).
    pub(super) fn discard_staged(&mut self) -> usize {
        self.staged.take().map_or(0, |s| s.tensors.len())
    }

    /// Whether an update is staged (for `/server_info`).
    pub(super) fn staged_tensors(&self) -> usize {
        self.staged.as_ref().map_or(0, |s| s.tensors.len())
    }
}
