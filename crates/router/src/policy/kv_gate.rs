//! Admission by KV pressure: an engine takes as many sessions at once as its KV pool can hold
//! at full length; the sessions past that wait at the gateway for a slot, instead of every
//! session's turn running at once.
//!
//! An engine's KV pool holds both the running requests' KV and the prefix cache. When more
//! sessions share an engine than its pool holds, every turn's KV evicts another session's
//! prefix, and the engine recomputes most of every prompt (the pool thrashes: least recently
//! used eviction is the worst order for sessions that take turns). Admitting a session holds a
//! slot on its engine until the session goes idle (no turn in flight for `idle_ms`) or is
//! finished (`/finish_session`); a turn of an admitted session never waits, so its prefix is
//! either in use or the most recently cached. A session waiting for its first slot has no KV
//! to lose yet. Sessions waiting on an engine are admitted in the order they came (a ticket
//! each): a freed slot goes to the longest waiting, not to whichever waiter the wake-up
//! happened to run first, so no session waits behind a stream of later ones (the turns' p99).
//! A request without a session key is not gated.
//!
//! The slots come from the engine's `/server_info` at registration: `max_total_num_tokens`
//! (the pool) times the configured share over `context_length` (the longest a session can
//! grow), so admitted sessions fit even at full length; an engine that reports no pool is
//! never gated.

use std::collections::{HashMap, VecDeque};
use std::sync::Arc;
use std::time::Duration;

use parking_lot::Mutex;
use serde::{Deserialize, Serialize};
use tokio::sync::Notify;
use tokio::time::Instant;

/// The admission gate's settings (`router.kv_admission`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default)]
pub struct KvAdmitConfig {
    /// Percent of an engine's KV pool that its admitted sessions may fill at full context
    /// length (1 to 100): slots = pool × percent / 100 / context length, at least one.
    pub pool_percent: u32,
    /// A session with no turn in flight for this long gives its slot back (1 to 3,600,000).
    pub idle_ms: u64,
}

impl Default for KvAdmitConfig {
    fn default() -> Self {
        KvAdmitConfig {
            pool_percent: 100,
            idle_ms: 1000,
        }
    }
}

impl KvAdmitConfig {
    /// Refuses values outside their ranges, naming the key as `name(field)` spells it.
    pub fn check(&self, name: impl Fn(&str) -> String) -> Result<(), String> {
        if !(1..=100).contains(&self.pool_percent) {
            return Err(format!(
                "{} must be 1 to 100 (percent of an engine's KV pool), got {}",
                name("pool_percent"),
                self.pool_percent
            ));
        }
        if !(1..=3_600_000).contains(&self.idle_ms) {
            return Err(format!(
                "{} must be 1 to 3600000 ms, got {}",
                name("idle_ms"),
                self.idle_ms
            ));
        }
        Ok(())
    }
}

#[derive(Debug)]
struct Active {
    inflight: usize,
    idle_since: Instant,
}

#[derive(Debug)]
struct Engine {
    slots: usize,
    active: HashMap<String, Active>,
    /// Woken when a turn ends or a session is finished or dropped.
    changed: Arc<Notify>,
    /// Tickets of the sessions waiting for a slot, oldest first.
    waiting: VecDeque<u64>,
    /// The next ticket.
    next_ticket: u64,
}

impl Engine {
    fn new(slots: usize) -> Self {
        Engine {
            slots: slots.max(1),
            active: HashMap::new(),
            changed: Arc::new(Notify::new()),
            waiting: VecDeque::new(),
            next_ticket: 0,
        }
    }

    /// Whether a session not yet admitted, holding `ticket` (or none yet), may take a slot now:
    /// there is a free slot that no session waiting longer is owed.
    fn may_admit(&self, ticket: Option<u64>) -> bool {
        let free = self.slots.saturating_sub(self.active.len());
        let ahead = match ticket.and_then(|t| self.waiting.iter().position(|w| *w == t)) {
            Some(p) => p,
            None => self.waiting.len(),
        };
        ahead < free
    }

    /// Takes `ticket` out of the queue (admitted, or gave up); the others may move up.
    fn leave(&mut self, ticket: u64) {
        if let Some(p) = self.waiting.iter().position(|w| *w == ticket) {
            self.waiting.remove(p);
            self.changed.notify_waiters();
        }
    }

    /// Drops sessions idle for `idle`; the earliest time another one will be.
    fn expire(&mut self, now: Instant, idle: Duration) -> Option<Instant> {
        self.active
            .retain(|_, a| a.inflight > 0 || now.duration_since(a.idle_since) < idle);
        self.active
            .values()
            .filter(|a| a.inflight == 0)
            .map(|a| a.idle_since + idle)
            .min()
    }
}

type Engines = Arc<Mutex<HashMap<String, Engine>>>;

/// One gate per engine, by worker id.
#[derive(Debug, Default)]
pub struct KvGates {
    cfg: KvAdmitConfig,
    engines: Engines,
}

impl KvGates {
    /// Gates with these settings (the share clamped to 1–100, the idle time to at least 1 ms).
    pub fn new(cfg: KvAdmitConfig) -> Self {
        KvGates {
            cfg: KvAdmitConfig {
                pool_percent: cfg.pool_percent.clamp(1, 100),
                idle_ms: cfg.idle_ms.max(1),
            },
            engines: Engines::default(),
        }
    }

    /// Records that `worker_id`'s KV pool holds `pool_tokens` tokens and its sessions grow to
    /// at most `context` tokens: its gate admits that many sessions at full length (a gate
    /// learnt again starts afresh).
    pub fn learn(&self, worker_id: &str, pool_tokens: u64, context: u64) {
        let share = pool_tokens.saturating_mul(u64::from(self.cfg.pool_percent)) / 100;
        let slots = usize::try_from(share / context.max(1)).unwrap_or(usize::MAX);
        let old = self
            .engines
            .lock()
            .insert(worker_id.to_string(), Engine::new(slots));
        if let Some(e) = old {
            e.changed.notify_waiters();
        }
    }

    /// Slots `worker_id`'s gate has (`None`: not gated).
    pub fn slots(&self, worker_id: &str) -> Option<usize> {
        self.engines.lock().get(worker_id).map(|e| e.slots)
    }

    /// Drops `worker_id`'s gate; turns waiting on it are let through.
    pub fn forget(&self, worker_id: &str) {
        if let Some(e) = self.engines.lock().remove(worker_id) {
            e.changed.notify_waiters();
        }
    }

    /// Gives `session`'s slots back at once (`/finish_session`) wherever no turn of it runs.
    pub fn finish(&self, session: &str) {
        for e in self.engines.lock().values_mut() {
            if e.active.get(session).is_some_and(|a| a.inflight == 0) {
                e.active.remove(session);
                e.changed.notify_waiters();
            }
        }
    }

    /// Gives every idle slot back (`/clear_sessions`).
    pub fn clear(&self) {
        for e in self.engines.lock().values_mut() {
            e.active.retain(|_, a| a.inflight > 0);
            e.changed.notify_waiters();
        }
    }

    /// What a turn of `session` must wait for on `worker_id`: `None` without a session or
    /// when that engine's pool is unknown.
    pub fn admission(&self, worker_id: &str, session: Option<&str>) -> Option<Admission> {
        let session = session?;
        if !self.engines.lock().contains_key(worker_id) {
            return None;
        }
        Some(Admission {
            engines: self.engines.clone(),
            worker: worker_id.to_string(),
            session: session.to_string(),
            idle: Duration::from_millis(self.cfg.idle_ms),
        })
    }
}

/// What a session's turn must wait for before it is sent: a slot on its engine.
#[derive(Debug)]
pub struct Admission {
    engines: Engines,
    worker: String,
    session: String,
    idle: Duration,
}

impl Admission {
    /// Waits until the session holds a slot on the engine (at once when it already does);
    /// the permit marks the turn in flight until dropped. A gate dropped meanwhile lets it
    /// through.
    pub async fn wait(self) -> KvPermit {
        // This session's place in the engine's queue once it has had to wait; given back when
        // it is admitted or the wait is dropped (the turn given up).
        let mut queued = Queued {
            engines: &self.engines,
            worker: &self.worker,
            ticket: None,
        };
        loop {
            let changed: Arc<Notify>;
            let mut woken;
            let next = {
                let mut engines = self.engines.lock();
                let Some(e) = engines.get_mut(&self.worker) else {
                    return KvPermit(None);
                };
                let now = Instant::now();
                let next = e.expire(now, self.idle);
                // A ticket the engine no longer knows (its gate learnt afresh) counts as none.
                let ticket = queued.ticket.filter(|t| e.waiting.contains(t));
                let admitted = if let Some(a) = e.active.get_mut(&self.session) {
                    a.inflight += 1;
                    true
                } else if e.may_admit(ticket) {
                    let a = Active {
                        inflight: 1,
                        idle_since: now,
                    };
                    e.active.insert(self.session.clone(), a);
                    true
                } else {
                    if ticket.is_none() {
                        queued.ticket = Some(e.next_ticket);
                        e.waiting.push_back(e.next_ticket);
                        e.next_ticket += 1;
                    }
                    false
                };
                if admitted {
                    if let Some(t) = queued.ticket.take() {
                        e.leave(t);
                    }
                    drop(engines);
                    drop(queued);
                    return self.permit();
                }
                // Listening before the lock is let go, so no change after this look is missed.
                changed = e.changed.clone();
                woken = Box::pin(changed.notified());
                woken.as_mut().enable();
                next
            };
            // A slot frees when an idle session expires (`next`) or something changes.
            let until = next.unwrap_or_else(|| Instant::now() + self.idle);
            tokio::select! {
                _ = woken => {}
                _ = tokio::time::sleep_until(until) => {}
            }
        }
    }

    fn permit(self) -> KvPermit {
        KvPermit(Some(Held {
            engines: self.engines,
            worker: self.worker,
            session: self.session,
        }))
    }
}

/// A waiting session's ticket, taken out of its engine's queue when dropped.
struct Queued<'a> {
    engines: &'a Engines,
    worker: &'a str,
    ticket: Option<u64>,
}

impl Drop for Queued<'_> {
    fn drop(&mut self) {
        if let Some(t) = self.ticket.take()
            && let Some(e) = self.engines.lock().get_mut(self.worker)
        {
            e.leave(t);
        }
    }
}

#[derive(Debug)]
struct Held {
    engines: Engines,
    worker: String,
    session: String,
}

/// A turn's hold on its session's slot, marking it in flight until dropped.
#[derive(Debug)]
pub struct KvPermit(Option<Held>);

impl Drop for KvPermit {
    fn drop(&mut self) {
        let Some(h) = self.0.take() else {
            return;
        };
        let mut engines = h.engines.lock();
        if let Some(e) = engines.get_mut(&h.worker) {
            if let Some(a) = e.active.get_mut(&h.session) {
                a.inflight = a.inflight.saturating_sub(1);
                if a.inflight == 0 {
                    a.idle_since = Instant::now();
                }
            }
            e.changed.notify_waiters();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use futures::FutureExt;

    #[tokio::test(start_paused = true)]
    async fn sessions_past_the_slots_wait_until_one_goes_idle_or_finishes() {
        troupe_testkit::within(30, past_the_slots()).await;
    }

    async fn past_the_slots() {
        let g = KvGates::new(KvAdmitConfig {
            pool_percent: 100,
            idle_ms: 1000,
        });
        assert!(
            g.admission("w", Some("a")).is_none(),
            "unknown pool: no gate"
        );
        // A pool of 8,192 tokens, sessions up to 4,096: two at once.
        g.learn("w", 8192, 4096);
        assert_eq!(g.slots("w"), Some(2));
        assert!(g.admission("w", None).is_none(), "no session: not gated");
        let a = g.admission("w", Some("a")).expect("gated").wait().await;
        let b = g.admission("w", Some("b")).expect("gated").wait().await;
        // A second turn of an admitted session never waits.
        let a2 = g.admission("w", Some("a")).expect("gated").wait().await;
        let mut c = Box::pin(g.admission("w", Some("c")).expect("gated").wait());
        assert!((&mut c).now_or_never().is_none(), "both slots are taken");
        drop((a, a2));
        assert!(
            (&mut c).now_or_never().is_none(),
            "a's turns ended, but a keeps its slot until idle"
        );
        tokio::time::advance(Duration::from_millis(1001)).await;
        let _c = c.await;
        // b finished explicitly: its slot is free at once.
        drop(b);
        g.finish("b");
        let _d = g.admission("w", Some("d")).expect("gated").wait().await;
    }

    #[tokio::test(start_paused = true)]
    async fn waiting_sessions_are_admitted_in_the_order_they_came() {
        troupe_testkit::within(30, in_order()).await;
    }

    async fn in_order() {
        let g = KvGates::new(KvAdmitConfig {
            pool_percent: 100,
            idle_ms: 1000,
        });
        g.learn("w", 4096, 4096);
        let a = g.admission("w", Some("a")).expect("gated").wait().await;
        // b, then c, then d wait for the one slot.
        let mut b = Box::pin(g.admission("w", Some("b")).expect("gated").wait());
        let mut c = Box::pin(g.admission("w", Some("c")).expect("gated").wait());
        let mut d = Box::pin(g.admission("w", Some("d")).expect("gated").wait());
        for w in [&mut b, &mut c, &mut d] {
            assert!(w.as_mut().now_or_never().is_none());
        }
        // c gives up: its place is given back.
        drop(c);
        drop(a);
        g.finish("a");
        // The freed slot is b's, the longest waiting, even when d looks first.
        assert!(d.as_mut().now_or_never().is_none(), "d came after b");
        let b = b.await;
        assert!(d.as_mut().now_or_never().is_none(), "b holds the slot");
        // A new session does not overtake d.
        let mut e = Box::pin(g.admission("w", Some("e")).expect("gated").wait());
        drop(b);
        g.finish("b");
        assert!(e.as_mut().now_or_never().is_none(), "e came after d");
        let _d = d.await;
        assert_eq!(g.engines.lock()["w"].waiting.len(), 1, "only e waits");
        drop(e);
        assert!(
            g.engines.lock()["w"].waiting.is_empty(),
            "a dropped wait leaves the queue"
        );
    }

    #[test]
    fn bad_settings_are_refused_by_name() {
        let n = |k: &str| format!("router.kv_admission.{k}");
        for bad in [
            KvAdmitConfig {
                pool_percent: 0,
                ..KvAdmitConfig::default()
            },
            KvAdmitConfig {
                idle_ms: 0,
                ..KvAdmitConfig::default()
            },
        ] {
            assert!(
                bad.check(n)
                    .unwrap_err()
                    .starts_with("router.kv_admission.")
            );
        }
    }
}
