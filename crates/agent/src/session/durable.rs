//! Sessions kept across gateway restarts: a log attached to the store, and the sessions it
//! held read back into a fresh store, with the store's own bounds.

use std::sync::Arc;
use std::time::Instant;

use super::{Session, SessionLog, SessionStore, Turn};
use crate::error::AgentError;

/// A session as a log read it back.
#[derive(Debug, Clone, Default)]
pub struct Restored {
    /// Its id.
    pub id: String,
    /// Its bearer key.
    pub key: String,
    /// Its turns, in order.
    pub turns: Vec<Turn>,
    /// Rewards in the order they were given: (turn id or none for the session, reward).
    pub rewards: Vec<(Option<String>, f64)>,
    /// Whether it had ended.
    pub ended: bool,
    /// The engines the router had kept it on, as (role, worker) pairs (the last written).
    pub bindings: Vec<(String, String)>,
}

impl Turn {
    /// A turn read back: its comparison keys are computed again when first needed.
    pub fn rekeyed(mut self) -> Self {
        self.keys = std::sync::OnceLock::new();
        self
    }
}

impl SessionStore {
    /// Writes every later change to `log` (once: a second log is refused).
    pub fn attach(&self, log: Arc<dyn SessionLog>) -> Result<(), AgentError> {
        self.log
            .set(log)
            .map_err(|_| AgentError::Config("the session store has a log already".into()))
    }

    /// Puts sessions read back from a log into the store (before it serves), within its
    /// bounds: past `max_sessions`, or past `max_session_tokens`, or clashing with an open id
    /// or key, a session is left out and named in the answer (the caller warns, with where
    /// the log keeps it). AReaL's `{task_id}-{n}` counters continue past the ids read back.
    pub fn restore(&self, sessions: Vec<Restored>) -> Vec<(String, String)> {
        let mut skipped = Vec::new();
        let mut g = self.inner.lock();
        for r in sessions {
            let tokens: usize = r.turns.iter().map(Turn::tokens).sum();
            let why = if g.sessions.len() >= self.limits.max_sessions {
                Some(format!(
                    "{} sessions are open already (max_agent_sessions)",
                    g.sessions.len()
                ))
            } else if tokens > self.limits.max_session_tokens {
                Some(format!(
                    "it holds {tokens} tokens, more than max_session_tokens {}",
                    self.limits.max_session_tokens
                ))
            } else if g.sessions.contains_key(&r.id) || g.keys.contains_key(&r.key) {
                Some("its id or key is open already".to_string())
            } else {
                None
            };
            if let Some(w) = why {
                skipped.push((r.id, w));
                continue;
            }
            if let Some((task, n)) = r.id.rsplit_once('-')
                && let Ok(n) = n.parse::<u64>()
            {
                let next = g.next.entry(task.to_string()).or_default();
                *next = (*next).max(n.saturating_add(1));
            }
            let mut s = Session {
                id: r.id.clone(),
                key: r.key.clone(),
                turns: r.turns.into_iter().map(Turn::rekeyed).collect(),
                reward: None,
                ended: r.ended,
                tokens,
                reserved: 0,
                last: Instant::now(),
                sent: None,
                bindings: r.bindings,
            };
            for (i, reward) in &r.rewards {
                s.apply_reward(i.as_deref(), *reward);
            }
            g.keys.insert(r.key, r.id.clone());
            g.sessions.insert(r.id, s);
        }
        skipped
    }

    /// Records that the router keeps session `id` on `bindings` ((role, worker) pairs); a change
    /// is written to the log first, so a restarted gateway routes the session's next turn
    /// where its prefix is cached. Unchanged bindings, or an unknown session, cost a lookup.
    pub fn note_bindings(
        &self,
        id: &str,
        bindings: Vec<(String, String)>,
    ) -> Result<(), AgentError> {
        let mut g = self.inner.lock();
        let Some(s) = g.sessions.get_mut(id) else {
            return Ok(());
        };
        if s.bindings == bindings {
            return Ok(());
        }
        if let Some(log) = self.log.get() {
            log.bound(id, &bindings)?;
        }
        s.bindings = bindings;
        Ok(())
    }

    /// Every open session's bindings that are known (read back from a log, or noted since).
    pub fn bindings(&self) -> Vec<(String, Vec<(String, String)>)> {
        self.inner
            .lock()
            .sessions
            .values()
            .filter(|s| !s.bindings.is_empty())
            .map(|s| (s.id.clone(), s.bindings.clone()))
            .collect()
    }

    /// The ids of the open sessions (for a report of what was read back).
    pub fn ids(&self) -> Vec<String> {
        self.inner.lock().sessions.keys().cloned().collect()
    }
}

/// Logprobs read back: JSON writes a non-finite number as `null`, read here as -inf (a token
/// the model gave no probability) rather than refusing the turn.
pub(super) fn lenient_f64s<'de, D: serde::Deserializer<'de>>(d: D) -> Result<Vec<f64>, D::Error> {
    let v: Vec<Option<f64>> = serde::Deserialize::deserialize(d)?;
    Ok(v.into_iter()
        .map(|x| x.unwrap_or(f64::NEG_INFINITY))
        .collect())
}
