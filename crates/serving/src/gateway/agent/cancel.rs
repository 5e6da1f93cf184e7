//! Agent turns a client aborted by id. An agent turn resubmits a piece the engine aborted
//! (a weight update's pause aborts what runs, and the turn continues from its tokens), so an
//! abort the client sent (`/abort_request {rid}`, `/abort_requests {request_ids}`) must be told
//! apart from a pause's: the abort route marks the ids it names here, and a turn whose id is
//! marked ends as aborted instead of resubmitting, as a plain `/generate` ends.

use std::collections::HashMap;
use std::sync::Arc;

use parking_lot::Mutex;

/// The ids of the agent turns running now, and whether a client aborted each.
#[derive(Debug, Default)]
pub(crate) struct Cancels {
    /// id → (turns running under it, aborted by a client).
    ids: Mutex<HashMap<String, (usize, bool)>>,
}

/// A running turn's hold on its id: dropping it forgets the id (and its abort) once no other
/// turn runs under it.
#[derive(Debug)]
pub(crate) struct Running {
    cancels: Arc<Cancels>,
    id: String,
}

impl Cancels {
    /// Registers a turn running under `id` until the returned hold is dropped.
    pub(crate) fn begin(self: &Arc<Self>, id: &str) -> Running {
        self.ids
            .lock()
            .entry(id.to_string())
            .or_insert((0, false))
            .0 += 1;
        Running {
            cancels: self.clone(),
            id: id.to_string(),
        }
    }

    /// Marks as aborted the running turns among `ids`; how many it marked.
    pub(crate) fn abort(&self, ids: &[String]) -> usize {
        let mut g = self.ids.lock();
        let mut n = 0;
        for id in ids {
            if let Some(e) = g.get_mut(id) {
                e.1 = true;
                n += 1;
            }
        }
        n
    }
}

impl Running {
    /// Whether a client aborted this turn's id.
    pub(crate) fn aborted(&self) -> bool {
        self.cancels.ids.lock().get(&self.id).is_some_and(|e| e.1)
    }
}

impl Drop for Running {
    fn drop(&mut self) {
        let mut g = self.cancels.ids.lock();
        if let Some(e) = g.get_mut(&self.id) {
            e.0 = e.0.saturating_sub(1);
            if e.0 == 0 {
                g.remove(&self.id);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_running_ids_are_marked_and_forgotten_when_done() {
        let c = Arc::new(Cancels::default());
        let a = c.begin("a");
        let a2 = c.begin("a");
        assert_eq!(c.abort(&["a".into(), "b".into()]), 1);
        assert!(a.aborted() && a2.aborted());
        drop((a, a2));
        assert!(c.ids.lock().is_empty());
        let a = c.begin("a");
        assert!(!a.aborted(), "a new turn under an old id starts unaborted");
    }
}
