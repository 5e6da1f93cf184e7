//! `sticky_least_loaded`: multi-turn sessions stay on the engine that holds their prefix, new
//! sessions go where the fewest sessions live.
//!
//! An agent episode is tens of turns, each turn's prompt the previous one's plus its output plus
//! a tool result, so the engine that served turn *n* holds most of turn *n + 1*'s KV. vllm-router's
//! policy of this name (what SkyRL and prime-rl run) binds a session to the engine with the
//! fewest active sessions and keeps it there; this one does the same and adds what that one
//! lacks: ties between engines with as many sessions go to the one with fewer requests in flight,
//! a bound engine over the admission cap (requests in flight) passes the turn to the least loaded
//! engine and the session re-binds there, bindings idle past the TTL are forgotten, a session can
//! be finished (`POST /finish_session`) or all of them cleared, an engine that leaves drops its
//! bindings (their next turn binds anew), and the table is bounded (the least recently used
//! sessions go first: at most `max_sessions` bindings, about 100 bytes plus the key each).
//! Requests without a session key go to the least loaded engine.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use parking_lot::Mutex;
use serde::{Deserialize, Serialize};
// Tokio's clock (the same as std's outside a runtime, and in one unless paused): tests of the
// TTL move a paused clock instead of sleeping through it (`crates/serving/tests/sessions.rs`).
use tokio::time::Instant;

use super::{Policy, RouteContext, least_loaded};
use crate::worker::Worker;

/// The policy's settings (`troupe gateway --session-*`, `gateway.session_*`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default)]
pub struct StickyConfig {
    /// A binding unused this many seconds is forgotten (vllm-router's: two hours).
    pub session_ttl_secs: u64,
    /// Most bindings kept; past it the least recently used are dropped (each costs about
    /// 100 bytes plus its key, at most 512 bytes: 2^18 bindings stay under 160 MiB).
    pub max_sessions: usize,
    /// A bound engine with this many requests in flight or more does not take the turn: it
    /// goes to the least loaded engine, which the session re-binds to (0: no cap).
    pub session_max_inflight: usize,
}

impl Default for StickyConfig {
    fn default() -> Self {
        StickyConfig {
            session_ttl_secs: 2 * 3600,
            max_sessions: 1 << 18,
            session_max_inflight: 0,
        }
    }
}

/// The longest idle time a binding may be given (a week): beyond it, sessions never end.
pub const MAX_SESSION_TTL_SECS: u64 = 7 * 24 * 3600;

/// The most bindings a table may be given (2^24: a few GiB at most).
pub const MAX_SESSIONS: usize = 1 << 24;

impl StickyConfig {
    /// Refuses settings the policy cannot run with, naming the key as `name(field)` spells it.
    pub fn check(&self, name: impl Fn(&str) -> String) -> Result<(), String> {
        if self.session_ttl_secs == 0 || self.session_ttl_secs > MAX_SESSION_TTL_SECS {
            return Err(format!(
                "{} must be 1 to {MAX_SESSION_TTL_SECS} seconds (a week), got {}",
                name("session_ttl_secs"),
                self.session_ttl_secs
            ));
        }
        if self.max_sessions == 0 || self.max_sessions > MAX_SESSIONS {
            return Err(format!(
                "{} must be 1 to {MAX_SESSIONS}, got {}",
                name("max_sessions"),
                self.max_sessions
            ));
        }
        Ok(())
    }

    fn ttl(&self) -> Duration {
        Duration::from_secs(self.session_ttl_secs)
    }
}

#[derive(Debug)]
struct Binding {
    worker: String,
    used: Instant,
}

#[derive(Debug, Default)]
struct Table {
    bindings: HashMap<String, Binding>,
    /// Live bindings per worker id (kept with `bindings`).
    per_worker: HashMap<String, usize>,
    /// When idle bindings were last dropped.
    swept: Option<Instant>,
}

/// How often a new session sweeps idle bindings out of the counts (a pass over the table).
const SWEEP_EVERY: Duration = Duration::from_secs(10);

impl Table {
    fn unbind(&mut self, session: &str) -> bool {
        let Some(b) = self.bindings.remove(session) else {
            return false;
        };
        if let Some(n) = self.per_worker.get_mut(&b.worker) {
            *n = n.saturating_sub(1);
            if *n == 0 {
                self.per_worker.remove(&b.worker);
            }
        }
        true
    }

    fn bind(&mut self, session: &str, worker: &str, now: Instant) {
        self.unbind(session);
        *self.per_worker.entry(worker.to_string()).or_default() += 1;
        self.bindings.insert(
            session.to_string(),
            Binding {
                worker: worker.to_string(),
                used: now,
            },
        );
    }

    fn sessions_on(&self, worker: &str) -> usize {
        self.per_worker.get(worker).copied().unwrap_or(0)
    }

    /// Drops bindings idle past `ttl`, at most once per [`SWEEP_EVERY`] unless `force`d, so
    /// idle sessions stop counting against their engine.
    fn expire(&mut self, now: Instant, ttl: Duration, force: bool) {
        if !force
            && self
                .swept
                .is_some_and(|s| now.duration_since(s) < SWEEP_EVERY)
        {
            return;
        }
        self.swept = Some(now);
        let expired: Vec<String> = self
            .bindings
            .iter()
            .filter(|(_, b)| now.duration_since(b.used) >= ttl)
            .map(|(k, _)| k.clone())
            .collect();
        for k in expired {
            self.unbind(&k);
        }
    }

    /// Makes room for one more binding under `max`: idle ones first, then the least recently
    /// used eighth.
    fn make_room(&mut self, now: Instant, ttl: Duration, max: usize) {
        self.expire(now, ttl, true);
        if self.bindings.len() < max {
            return;
        }
        let mut ages: Vec<(Instant, String)> = self
            .bindings
            .iter()
            .map(|(k, b)| (b.used, k.clone()))
            .collect();
        let drop = (ages.len() / 8).max(1).min(ages.len());
        ages.select_nth_unstable_by_key(drop - 1, |(t, _)| *t);
        for (_, k) in ages.into_iter().take(drop) {
            self.unbind(&k);
        }
    }
}

/// Session-sticky routing balanced by sessions per engine (see the module).
#[derive(Debug, Default)]
pub struct StickyLeastLoaded {
    cfg: StickyConfig,
    ttl: Option<Duration>,
    table: Mutex<Table>,
}

impl StickyLeastLoaded {
    /// A policy with these settings (checked by [`StickyConfig::check`]; a `max_sessions` of
    /// 0 counts as 1).
    pub fn new(cfg: StickyConfig) -> Self {
        StickyLeastLoaded {
            cfg: StickyConfig {
                max_sessions: cfg.max_sessions.max(1),
                ..cfg
            },
            ttl: None,
            table: Mutex::default(),
        }
    }

    /// A policy whose bindings expire after `ttl` (finer than the config's seconds: tests).
    pub fn with_ttl(cfg: StickyConfig, ttl: Duration) -> Self {
        let mut p = Self::new(cfg);
        p.ttl = Some(ttl);
        p
    }

    fn ttl(&self) -> Duration {
        self.ttl.unwrap_or_else(|| self.cfg.ttl())
    }

    /// Bindings held now (expired ones included until the next new session sweeps them).
    pub fn sessions(&self) -> usize {
        self.table.lock().bindings.len()
    }

    /// The engine with the fewest bound sessions, ties by requests in flight, among those under
    /// the admission cap when any is (else among all).
    fn fewest_sessions(&self, workers: &[Arc<dyn Worker>], t: &Table) -> usize {
        let under = |w: &Arc<dyn Worker>| {
            self.cfg.session_max_inflight == 0 || w.load() < self.cfg.session_max_inflight
        };
        let any_under = workers.iter().any(under);
        workers
            .iter()
            .enumerate()
            .filter(|(_, w)| !any_under || under(w))
            .min_by_key(|(_, w)| (t.sessions_on(w.id()), w.load()))
            .map_or(0, |(i, _)| i)
    }
}

impl Policy for StickyLeastLoaded {
    fn name(&self) -> &'static str {
        "sticky_least_loaded"
    }

    fn pick(&self, workers: &[Arc<dyn Worker>], ctx: &RouteContext<'_>) -> usize {
        let Some(session) = ctx.session else {
            return least_loaded(workers);
        };
        let now = Instant::now();
        let mut t = self.table.lock();
        if let Some(b) = t.bindings.get_mut(session)
            && now.duration_since(b.used) < self.ttl()
            && let Some(i) = workers.iter().position(|w| w.id() == b.worker)
        {
            let over = self.cfg.session_max_inflight > 0
                && workers[i].load() >= self.cfg.session_max_inflight;
            if !over {
                b.used = now;
                return i;
            }
            // Over the cap: this turn goes to the least loaded engine, and the session follows.
            let j = least_loaded(workers);
            if j != i {
                let id = workers[j].id().to_string();
                t.bind(session, &id, now);
                return j;
            }
            b.used = now;
            return i;
        }
        t.expire(now, self.ttl(), false);
        if !t.bindings.contains_key(session) && t.bindings.len() >= self.cfg.max_sessions {
            t.make_room(now, self.ttl(), self.cfg.max_sessions);
        }
        let i = self.fewest_sessions(workers, &t);
        let id = workers[i].id().to_string();
        t.bind(session, &id, now);
        i
    }

    fn forget(&self, worker_id: &str) {
        let mut t = self.table.lock();
        let gone: Vec<String> = t
            .bindings
            .iter()
            .filter(|(_, b)| b.worker == worker_id)
            .map(|(k, _)| k.clone())
            .collect();
        for k in gone {
            t.unbind(&k);
        }
    }

    fn finish_session(&self, session: &str) -> bool {
        self.table.lock().unbind(session)
    }

    fn clear_sessions(&self) -> usize {
        let mut t = self.table.lock();
        let n = t.bindings.len();
        *t = Table::default();
        n
    }

    fn binding(&self, session: &str) -> Option<String> {
        self.table
            .lock()
            .bindings
            .get(session)
            .map(|b| b.worker.clone())
    }

    fn restore_binding(&self, session: &str, worker_id: &str) {
        let now = Instant::now();
        let mut t = self.table.lock();
        if !t.bindings.contains_key(session) && t.bindings.len() >= self.cfg.max_sessions {
            t.make_room(now, self.ttl(), self.cfg.max_sessions);
        }
        t.bind(session, worker_id, now);
    }
}
