//! Recorded agent sessions: each has an id and its own bearer key, and keeps every turn the
//! gateway served it with the exact token ids, logprobs and weight versions, until the session
//! is finished (its trajectory handed out and dropped) or sits idle past its TTL.
//!
//! A new turn is matched to the turn it continues (the newest turn whose messages plus its reply
//! are a prefix of the new request's messages, compared by [`crate::messages::comparable`]), so
//! its prompt can be that turn's tokens plus its output plus the new messages' tokens, with no
//! re-tokenization of the history. A request that edits the history matches nothing and starts a
//! new branch.
//!
//! Memory is bounded by [`SessionLimits`]: open sessions (a new one past the cap is refused
//! until one ends), tokens per session (a turn that would pass it is refused), and the idle TTL.

use std::collections::HashMap;
use std::time::{Duration, Instant};

use parking_lot::Mutex;
use serde_json::Value;

use crate::error::AgentError;
use crate::messages::comparable;
use crate::shared::Shared;

mod chain;
mod durable;
mod latest;
mod log;
mod turn;

pub use durable::Restored;
pub use latest::{Known, Latest};
pub use log::SessionLog;
pub use turn::Turn;

/// The bounds on what sessions hold.
#[derive(Debug, Clone)]
pub struct SessionLimits {
    /// Open sessions at most (default 4096).
    pub max_sessions: usize,
    /// Prompt plus output tokens recorded per session at most, over all its turns (default
    /// 1,048,576: about 16 MiB of ids, logprobs and versions).
    pub max_session_tokens: usize,
    /// A session with no request for this long is dropped, with a log line (default 1 h).
    pub idle_ttl: Duration,
}

impl Default for SessionLimits {
    fn default() -> Self {
        Self {
            max_sessions: 4096,
            max_session_tokens: 1 << 20,
            idle_ttl: Duration::from_secs(3600),
        }
    }
}

/// What a new turn may extend: an earlier turn's messages, reply, tokens and text.
#[derive(Debug, Clone)]
pub struct Base {
    /// The earlier turn's index.
    pub index: usize,
    /// How many of the new request's messages it covers (its messages plus its reply).
    pub covered: usize,
    /// Its messages and reply (to render the covered part with the template).
    pub messages: Vec<Value>,
    /// Its prompt ids followed by its output ids.
    pub ids: Vec<u32>,
    /// Its prompt text followed by its output text.
    pub text: String,
}

/// One session.
#[derive(Debug)]
pub struct Session {
    /// Its id.
    pub id: String,
    /// Its bearer key.
    pub key: String,
    /// Its turns, in order.
    pub turns: Vec<Turn>,
    /// The session's reward (`set_reward` without an interaction id).
    pub reward: Option<f64>,
    /// `end_session` was called (AReaL's lifecycle: export waits for it).
    pub ended: bool,
    tokens: usize,
    /// Tokens held for turns being generated now (their prompt plus their `max_new_tokens`),
    /// so concurrent turns are counted together before any of them generates.
    reserved: usize,
    last: Instant,
    /// The bytes its latest turn's messages were sent as ([`SessionStore::keep_sent`]).
    sent: Option<latest::Sent>,
    /// The engines the gateway's router keeps it on, as (role, worker) pairs, as last written
    /// to the log ([`SessionStore::note_bindings`]); opaque here.
    bindings: Vec<(String, String)>,
}

/// Every open session.
#[derive(Debug, Default)]
pub struct SessionStore {
    limits: SessionLimits,
    inner: Mutex<Inner>,
    /// AReaL's capacity counter: `grant_capacity` adds one, its `start_session` takes one.
    capacity: std::sync::atomic::AtomicI64,
    /// When idle sessions were last looked for.
    swept: Mutex<Option<Instant>>,
    /// Where sessions are written as they change, when they are kept across restarts.
    log: std::sync::OnceLock<std::sync::Arc<dyn SessionLog>>,
}

/// Room held in a session for a turn being generated ([`SessionStore::reserve`]); released
/// when dropped.
#[derive(Debug)]
pub struct Reservation<'a> {
    store: &'a SessionStore,
    id: String,
    tokens: usize,
}

impl Drop for Reservation<'_> {
    fn drop(&mut self) {
        if let Some(s) = self.store.inner.lock().sessions.get_mut(&self.id) {
            s.reserved = s.reserved.saturating_sub(self.tokens);
        }
    }
}

#[derive(Debug, Default)]
struct Inner {
    sessions: HashMap<String, Session>,
    keys: HashMap<String, String>,
    /// Per task id, the next index of AReaL's `"{task_id}-{n}"` session ids.
    next: HashMap<String, u64>,
}

fn new_key() -> String {
    use rand::RngCore;
    let mut b = [0u8; 32];
    rand::rng().fill_bytes(&mut b);
    use base64::Engine as _;
    format!(
        "tk-{}",
        base64::engine::general_purpose::URL_SAFE_NO_PAD.encode(b)
    )
}

impl SessionStore {
    /// A store with these limits.
    pub fn new(limits: SessionLimits) -> Self {
        Self {
            limits,
            inner: Mutex::default(),
            capacity: std::sync::atomic::AtomicI64::new(0),
            swept: Mutex::new(None),
            log: std::sync::OnceLock::new(),
        }
    }

    /// Adds one to the capacity AReaL's `start_session` draws on; the count after.
    pub fn grant(&self) -> i64 {
        self.capacity
            .fetch_add(1, std::sync::atomic::Ordering::SeqCst)
            .saturating_add(1)
    }

    /// Takes one from that capacity; false (nothing taken) when there is none.
    pub fn take_capacity(&self) -> bool {
        use std::sync::atomic::Ordering::SeqCst;
        self.capacity
            .fetch_update(SeqCst, SeqCst, |c| (c > 0).then(|| c - 1))
            .is_ok()
    }

    /// Gives back capacity taken for a session that did not open.
    pub fn return_capacity(&self) {
        self.capacity
            .fetch_add(1, std::sync::atomic::Ordering::SeqCst);
    }

    /// The limits.
    pub fn limits(&self) -> &SessionLimits {
        &self.limits
    }

    /// Opens a session: its id (`{task_id}-{n}` when a task id is given, as AReaL names them)
    /// and key (`api_key` when the caller brings one that no open session holds).
    pub fn open(
        &self,
        task_id: Option<&str>,
        api_key: Option<&str>,
    ) -> Result<(String, String), AgentError> {
        self.sweep();
        let mut g = self.inner.lock();
        if g.sessions.len() >= self.limits.max_sessions {
            return Err(AgentError::Full(format!(
                "{} sessions are open, the most this gateway keeps (max_agent_sessions); finish some first",
                g.sessions.len()
            )));
        }
        if let Some(k) = api_key
            && let Some(sid) = g.keys.get(k)
        {
            return Err(AgentError::Conflict(format!(
                "API key is already bound to active session {sid}."
            )));
        }
        let id = match task_id {
            Some(t) => {
                let n = g.next.entry(t.to_string()).or_default();
                let id = format!("{t}-{n}");
                *n += 1;
                id
            }
            None => format!("sess-{}", uuid::Uuid::new_v4().simple()),
        };
        if g.sessions.contains_key(&id) {
            return Err(AgentError::Conflict(format!(
                "session {id} is already open"
            )));
        }
        let key = api_key.map_or_else(new_key, str::to_string);
        if let Some(l) = self.log.get() {
            l.opened(&id, &key)?;
        }
        g.keys.insert(key.clone(), id.clone());
        g.sessions.insert(
            id.clone(),
            Session {
                id: id.clone(),
                key: key.clone(),
                turns: Vec::new(),
                reward: None,
                ended: false,
                tokens: 0,
                reserved: 0,
                last: Instant::now(),
                sent: None,
                bindings: Vec::new(),
            },
        );
        Ok((id, key))
    }

    /// The session a bearer key belongs to.
    pub fn by_key(&self, key: &str) -> Option<String> {
        self.inner.lock().keys.get(key).cloned()
    }

    /// Whether session `id` is open.
    pub fn contains(&self, id: &str) -> bool {
        self.inner.lock().sessions.contains_key(id)
    }

    /// Whether `key` is session `id`'s key.
    pub fn key_is(&self, id: &str, key: &str) -> bool {
        self.inner
            .lock()
            .sessions
            .get(id)
            .is_some_and(|s| s.key == key)
    }

    /// The turn of session `id` that a request with `messages` continues, if any: the one
    /// covering the most of them.
    pub fn base(&self, id: &str, messages: &Shared<Value>) -> Option<Base> {
        let keys: Vec<Value> = messages.iter().map(comparable).collect();
        let g = self.inner.lock();
        let s = g.sessions.get(id)?;
        s.turns
            .iter()
            .enumerate()
            .filter(|(_, t)| t.keys().len() < keys.len() && keys[..t.keys().len()] == t.keys()[..])
            .max_by_key(|(i, t)| (t.keys().len(), *i))
            .map(|(i, t)| Base {
                index: i,
                covered: t.keys().len(),
                messages: t.messages.iter().chain([&t.reply]).cloned().collect(),
                ids: t.prompt_ids.iter().chain(&t.output_ids).copied().collect(),
                text: format!("{}{}", t.prompt_text, t.output_text),
            })
    }

    /// Whether session `id` can take a turn of `tokens` more tokens.
    pub fn room(&self, id: &str, tokens: usize) -> Result<(), AgentError> {
        let g = self.inner.lock();
        let s = g
            .sessions
            .get(id)
            .ok_or_else(|| AgentError::NotFound(format!("session {id} is not open")))?;
        self.fits(s, s.reserved, tokens)
    }

    fn fits(&self, s: &Session, reserved: usize, tokens: usize) -> Result<(), AgentError> {
        let held = s.tokens.saturating_add(reserved);
        if held.saturating_add(tokens) > self.limits.max_session_tokens {
            let pending = if reserved > 0 {
                format!(" (and {reserved} held for turns being generated)")
            } else {
                String::new()
            };
            return Err(AgentError::BadRequest(format!(
                "session {} holds {} tokens{pending}; this turn's {tokens} would pass the {} a session may record (max_session_tokens); finish it and start another",
                s.id, s.tokens, self.limits.max_session_tokens
            )));
        }
        Ok(())
    }

    /// Holds room for a turn of session `id` that may record up to `tokens` (its prompt plus
    /// its `max_new_tokens`) before it generates: a turn that could not be recorded is refused
    /// before any engine works on it, and turns generating at once on one session are counted
    /// together. The hold ends when the returned guard drops (after the turn is recorded).
    pub fn reserve(&self, id: &str, tokens: usize) -> Result<Reservation<'_>, AgentError> {
        let mut g = self.inner.lock();
        let s = g
            .sessions
            .get_mut(id)
            .ok_or_else(|| AgentError::NotFound(format!("session {id} is not open")))?;
        self.fits(s, s.reserved, tokens)?;
        s.reserved += tokens;
        Ok(Reservation {
            store: self,
            id: id.to_string(),
            tokens,
        })
    }

    /// Records `turn` in session `id`.
    pub fn record(&self, id: &str, mut turn: Turn) -> Result<(), AgentError> {
        {
            let mut g = self.inner.lock();
            let s = g
                .sessions
                .get_mut(id)
                .ok_or_else(|| AgentError::NotFound(format!("session {id} is not open")))?;
            // A reserved turn's tokens are in `reserved` already (its guard still lives): only
            // what is recorded counts here, and the reservation kept the room for it.
            self.fits(s, 0, turn.tokens())?;
            if let Some(p) = turn.parent.and_then(|p| s.turns.get(p)) {
                turn.share_with(p);
            }
            if let Some(l) = self.log.get() {
                l.recorded(id, &turn, turn.parent.and_then(|p| s.turns.get(p)))?;
            }
            s.tokens += turn.tokens();
            s.last = Instant::now();
            s.turns.push(turn);
        }
        // Others' idle sessions go now and then; this one was just used.
        self.sweep_now_and_then();
        Ok(())
    }

    /// Sets a reward: on the turn with id `interaction`, else on the session (and its last
    /// turn, as AReaL does).
    pub fn set_reward(
        &self,
        id: &str,
        interaction: Option<&str>,
        reward: f64,
    ) -> Result<(), AgentError> {
        if !reward.is_finite() {
            return Err(AgentError::BadRequest(format!(
                "reward must be a finite number, got {reward}"
            )));
        }
        let mut g = self.inner.lock();
        let s = g
            .sessions
            .get_mut(id)
            .ok_or_else(|| AgentError::NotFound(format!("session {id} is not open")))?;
        s.last = Instant::now();
        if interaction.is_some_and(|i| !s.turns.iter().any(|t| t.id == i)) {
            return Err(AgentError::BadRequest(format!(
                "Interaction {} not found",
                interaction.unwrap_or_default()
            )));
        }
        if let Some(l) = self.log.get() {
            l.rewarded(id, interaction, reward)?;
        }
        s.apply_reward(interaction, reward);
        Ok(())
    }
}

impl Session {
    /// A reward given to a turn (`interaction`, known to exist) or to the session and its last
    /// turn: what [`SessionStore::set_reward`] records, and what reading it back repeats.
    fn apply_reward(&mut self, interaction: Option<&str>, reward: f64) {
        let s = self;
        match interaction {
            Some(i) => {
                if let Some(t) = s.turns.iter_mut().find(|t| t.id == i) {
                    t.reward = Some(reward);
                }
            }
            None => {
                s.reward = Some(reward);
                if let Some(t) = s.turns.last_mut() {
                    t.reward = Some(reward);
                }
            }
        }
    }
}

impl SessionStore {
    /// Marks session `id` ended (its trajectory may be exported).
    pub fn end(&self, id: &str) -> Result<usize, AgentError> {
        let mut g = self.inner.lock();
        let s = g
            .sessions
            .get_mut(id)
            .ok_or_else(|| AgentError::Gone(format!("Session {id} already ended or expired")))?;
        if !s.ended
            && let Some(l) = self.log.get()
        {
            l.ended(id)?;
        }
        s.ended = true;
        Ok(s.turns.len())
    }

    /// Whether session `id` has ended (`None`: it is not open).
    pub fn ended(&self, id: &str) -> Option<bool> {
        self.inner.lock().sessions.get(id).map(|s| s.ended)
    }

    /// Removes session `id` and hands it out.
    pub fn take(&self, id: &str) -> Option<Session> {
        let mut g = self.inner.lock();
        let s = g.sessions.remove(id)?;
        g.keys.remove(&s.key);
        if let Some(l) = self.log.get() {
            l.removed(id);
        }
        Some(s)
    }

    /// Open sessions.
    pub fn len(&self) -> usize {
        self.inner.lock().sessions.len()
    }

    /// Whether none is open.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// [`SessionStore::sweep`] when the last one is older than the TTL (at most once a minute),
    /// so idle sessions go while turns of others are recorded, at no cost per turn.
    fn sweep_now_and_then(&self) {
        let every = self.limits.idle_ttl.min(std::time::Duration::from_secs(60));
        let due = {
            let mut last = self.swept.lock();
            let due = last.is_none_or(|t| t.elapsed() >= every);
            if due {
                *last = Some(Instant::now());
            }
            due
        };
        if due {
            self.sweep();
        }
    }

    /// Drops sessions idle past the TTL, each with a log line.
    pub fn sweep(&self) {
        let ttl = self.limits.idle_ttl;
        let mut g = self.inner.lock();
        let old: Vec<String> = g
            .sessions
            .values()
            .filter(|s| s.last.elapsed() > ttl)
            .map(|s| s.id.clone())
            .collect();
        for id in old {
            if let Some(s) = g.sessions.remove(&id) {
                g.keys.remove(&s.key);
                if let Some(l) = self.log.get() {
                    l.removed(&id);
                }
                tracing::warn!(session = %id, turns = s.turns.len(), ?ttl, "agent session idle past its TTL; dropped with its trajectory");
            }
        }
    }
}

#[cfg(test)]
mod tests;
