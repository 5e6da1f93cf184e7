//! Why recently gone actors are gone: a caller that calls an actor after it failed or stopped
//! gets "failed: …" with the reason, instead of "unknown actor". Bounded, oldest forgotten first.

use std::collections::{HashMap, VecDeque};

use crate::error::CallError;

/// Why a recently gone actor is gone, so callers get "failed: …" instead of "unknown".
#[derive(Default)]
pub(crate) struct Tombstones {
    order: VecDeque<String>,
    pub(crate) why: HashMap<String, CallError>,
}

const TOMBSTONES: usize = 4096;

impl Tombstones {
    /// Records why `id` is gone, forgetting the oldest beyond the limit.
    pub(crate) fn bury(&mut self, id: String, err: CallError) {
        if self.why.insert(id.clone(), err).is_none() {
            self.order.push_back(id);
        }
        while self.order.len() > TOMBSTONES {
            if let Some(old) = self.order.pop_front() {
                self.why.remove(&old);
            }
        }
    }
}
