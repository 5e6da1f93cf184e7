//! The `cache_aware` policy: SGLang router's cache-aware load balancing.
//!
//! Engines reuse the KV cache of a prompt prefix they computed before, so a request is cheapest
//! on the worker that last served its prefix. The policy keeps an approximate picture of every
//! worker's cache (the radix tree of `super::tree`: the texts routed to it, inserted when they
//! are routed) and decides per request, as SGLang's router does:
//!
//! 1. If loads (requests in flight) are imbalanced — `max - min > balance_abs_threshold` and
//!    `max > min * balance_rel_threshold` — the least loaded worker takes it.
//! 2. Otherwise the worker whose tree holds the longest prefix of the request's text takes it
//!    when that prefix is more than `cache_threshold` of the text;
//! 3. else the worker with the smallest tree (the most free cache) takes it, the less loaded
//!    of equal ones.
//!
//! The text is inserted into the chosen worker's tree at once, under the same lock as the
//! choice, so concurrent requests with one prompt — the samples of one GRPO group — all find it
//! and land on that worker while loads stay within the thresholds. A background sweep every
//! `eviction_interval_secs` evicts least recently used leaves until each tree holds at most
//! `max_tree_size` characters; a tree that reaches twice that between sweeps is swept at once,
//! so memory stays bounded whatever the interval.

use std::fmt;
use std::sync::mpsc::{self, RecvTimeoutError};
use std::sync::{Arc, Weak};
use std::time::Duration;

use parking_lot::Mutex;
use serde::{Deserialize, Serialize};

use super::tree::Tree;
use super::{Policy, RouteContext, Worker};

/// Settings of the `cache_aware` policy, with SGLang router's names and defaults (sglang-router
/// 0.3.2, `RouterArgs` in `router_args.py`, which `--cache-threshold` and its siblings default
/// to), so a configuration moves between the two routers unchanged.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct CacheAwareConfig {
    /// Share of a request's text (0.0-1.0) a worker's tree must already hold for the request
    /// to follow it; at or below it the request goes to the worker with the smallest tree.
    /// Default 0.3.
    pub cache_threshold: f64,
    /// Loads are imbalanced when the most and least loaded workers' requests in flight differ
    /// by more than this (and by `balance_rel_threshold`); then the least loaded takes the
    /// request whatever the caches hold. Default 64.
    pub balance_abs_threshold: usize,
    /// Loads are imbalanced when the largest exceeds the smallest times this (and the
    /// difference exceeds `balance_abs_threshold`); at least 1. Default 1.5.
    pub balance_rel_threshold: f64,
    /// Seconds between the sweeps that evict least recently used entries from the trees;
    /// above 0. Default 60.
    pub eviction_interval_secs: u64,
    /// Characters a worker's tree keeps after a sweep; above 0. Default 2^26.
    pub max_tree_size: usize,
}

impl Default for CacheAwareConfig {
    fn default() -> Self {
        Self {
            cache_threshold: 0.3,
            balance_abs_threshold: 64,
            balance_rel_threshold: 1.5,
            eviction_interval_secs: 60,
            max_tree_size: 1 << 26,
        }
    }
}

impl CacheAwareConfig {
    /// Refuses values SGLang refuses (and NaN and infinities, which it lets through): a
    /// `cache_threshold` outside 0-1, a `balance_rel_threshold` below 1, a zero
    /// `eviction_interval_secs` or `max_tree_size`. `key` spells a setting's name the way the
    /// caller's surface does (`gateway.cache_threshold`, `--cache-threshold`), so the message
    /// names what the user wrote.
    pub fn check(&self, key: impl Fn(&str) -> String) -> Result<(), String> {
        let t = self.cache_threshold;
        if !(0.0..=1.0).contains(&t) {
            return Err(format!(
                "{} must be a number from 0.0 to 1.0 (the share of a request's prefix a worker must hold), got {t}",
                key("cache_threshold")
            ));
        }
        let r = self.balance_rel_threshold;
        if !(r.is_finite() && r >= 1.0) {
            return Err(format!(
                "{} must be a finite number of at least 1.0 (max load > min load x it means imbalance), got {r}",
                key("balance_rel_threshold")
            ));
        }
        if self.eviction_interval_secs == 0 {
            return Err(format!(
                "{} must be at least 1 (seconds between cache-tree sweeps)",
                key("eviction_interval_secs")
            ));
        }
        if self.max_tree_size == 0 {
            return Err(format!(
                "{} must be at least 1 (characters each worker's cache tree keeps)",
                key("max_tree_size")
            ));
        }
        Ok(())
    }

    fn imbalanced(&self, min: usize, max: usize) -> bool {
        max.saturating_sub(min) > self.balance_abs_threshold
            && max as f64 > min as f64 * self.balance_rel_threshold
    }
}

/// SGLang's cache-aware policy (see the module documentation for the rules).
pub struct CacheAware {
    cfg: CacheAwareConfig,
    tree: Arc<Mutex<Tree>>,
    /// Dropping it (with the policy) stops the sweeper thread at once.
    _sweeper: Option<mpsc::Sender<()>>,
}

impl fmt::Debug for CacheAware {
    // Not the tree: it can hold millions of characters.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("CacheAware")
            .field("cfg", &self.cfg)
            .finish_non_exhaustive()
    }
}

impl CacheAware {
    /// A policy with empty trees, and its sweeper thread (none when `eviction_interval_secs`
    /// is 0, which [`CacheAwareConfig::check`] refuses; the twice-`max_tree_size` bound still
    /// holds then).
    pub fn new(cfg: CacheAwareConfig) -> Self {
        let tree = Arc::new(Mutex::new(Tree::default()));
        let sweeper = spawn_sweeper(Arc::downgrade(&tree), cfg);
        Self {
            cfg,
            tree,
            _sweeper: sweeper,
        }
    }

    /// The settings it runs with.
    pub fn config(&self) -> &CacheAwareConfig {
        &self.cfg
    }

    /// Characters the worker `worker_id`'s tree holds: how much of its cache the policy thinks
    /// the router's requests fill (0 for a worker it never routed to).
    pub fn tree_size(&self, worker_id: &str) -> usize {
        self.tree.lock().size(worker_id)
    }

    /// Runs one eviction sweep now, as the sweeper does every `eviction_interval_secs`.
    pub fn sweep(&self) {
        self.tree.lock().evict(self.cfg.max_tree_size);
    }
}

/// Starts the thread that sweeps `tree` every `eviction_interval_secs`; it ends when the
/// returned sender (held by the policy) is dropped or the tree is gone.
fn spawn_sweeper(tree: Weak<Mutex<Tree>>, cfg: CacheAwareConfig) -> Option<mpsc::Sender<()>> {
    if cfg.eviction_interval_secs == 0 {
        return None;
    }
    let every = Duration::from_secs(cfg.eviction_interval_secs);
    let (tx, rx) = mpsc::channel::<()>();
    let spawned = std::thread::Builder::new()
        .name("troupe-cache-sweep".into())
        .spawn(move || {
            while let Err(RecvTimeoutError::Timeout) = rx.recv_timeout(every) {
                let Some(tree) = tree.upgrade() else { break };
                tree.lock().evict(cfg.max_tree_size);
            }
        });
    match spawned {
        Ok(_) => Some(tx),
        Err(e) => {
            tracing::warn!(error = %e, "cannot start the cache-aware eviction sweeper; trees are swept when they reach twice max_tree_size");
            None
        }
    }
}

impl Policy for CacheAware {
    fn name(&self) -> &'static str {
        "cache_aware"
    }

    fn pick(&self, workers: &[Arc<dyn Worker>], ctx: &RouteContext<'_>) -> usize {
        // One lock over the whole decision and the insert: a request routed concurrently with
        // another of the same prompt sees the other's text in the tree.
        let mut tree = self.tree.lock();
        let loads: Vec<usize> = workers.iter().map(|w| w.load()).collect();
        let (min, max) = loads
            .iter()
            .fold((usize::MAX, 0), |(lo, hi), &l| (lo.min(l), hi.max(l)));
        let i = if self.cfg.imbalanced(min, max) {
            tracing::debug!(min, max, "cache_aware: loads imbalanced, least loaded");
            // The first of the least loaded, as SGLang.
            (0..loads.len())
                .min_by_key(|&i| loads[i])
                .unwrap_or_default()
        } else {
            let tenants: Vec<_> = workers.iter().map(|w| tree.tenant(w.id())).collect();
            let m = tree.longest_match(ctx.text.unwrap_or_default(), &tenants);
            let rate = if m.total == 0 {
                0.0
            } else {
                m.matched as f64 / m.total as f64
            };
            match m.best {
                Some(b) if rate > self.cfg.cache_threshold => b,
                // The smallest tree: most free cache; equal ones by load, then order.
                _ => (0..workers.len())
                    .min_by_key(|&i| (tree.size_of(tenants[i]), loads[i]))
                    .unwrap_or_default(),
            }
        };
        if let (Some(text), Some(w)) = (ctx.text, workers.get(i)) {
            let size = tree.insert(text, w.id());
            if size > self.cfg.max_tree_size.saturating_mul(2) {
                tree.evict(self.cfg.max_tree_size);
            }
        }
        i
    }

    fn forget(&self, worker_id: &str) {
        self.tree.lock().remove(worker_id);
    }

    fn needs_text(&self) -> bool {
        true
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn defaults_are_sglangs_and_bad_values_are_named() {
        let d = CacheAwareConfig::default();
        assert_eq!(
            (
                d.cache_threshold,
                d.balance_abs_threshold,
                d.balance_rel_threshold,
                d.eviction_interval_secs,
                d.max_tree_size
            ),
            (0.3, 64, 1.5, 60, 67_108_864)
        );
        assert!(d.check(|k| k.to_owned()).is_ok());
        let edge = CacheAwareConfig {
            cache_threshold: 1.0,
            balance_rel_threshold: 1.0,
            ..d
        };
        assert!(edge.check(|k| k.to_owned()).is_ok());
        for (bad, key) in [
            (
                CacheAwareConfig {
                    cache_threshold: 1.5,
                    ..d
                },
                "x.cache_threshold",
            ),
            (
                CacheAwareConfig {
                    cache_threshold: -0.1,
                    ..d
                },
                "x.cache_threshold",
            ),
            (
                CacheAwareConfig {
                    cache_threshold: f64::NAN,
                    ..d
                },
                "x.cache_threshold",
            ),
            (
                CacheAwareConfig {
                    balance_rel_threshold: 0.5,
                    ..d
                },
                "x.balance_rel_threshold",
            ),
            (
                CacheAwareConfig {
                    balance_rel_threshold: f64::INFINITY,
                    ..d
                },
                "x.balance_rel_threshold",
            ),
            (
                CacheAwareConfig {
                    eviction_interval_secs: 0,
                    ..d
                },
                "x.eviction_interval_secs",
            ),
            (
                CacheAwareConfig {
                    max_tree_size: 0,
                    ..d
                },
                "x.max_tree_size",
            ),
        ] {
            let e = bad.check(|k| format!("x.{k}")).unwrap_err();
            assert!(e.starts_with(key), "{e}");
        }
        let parsed: CacheAwareConfig = serde_json::from_str(r#"{"cache_threshold": 0.5}"#).unwrap();
        assert_eq!(
            parsed,
            CacheAwareConfig {
                cache_threshold: 0.5,
                ..d
            }
        );
        assert!(serde_json::from_str::<CacheAwareConfig>(r#"{"threshold": 0.5}"#).is_err());
    }

    #[test]
    fn the_sweeper_stops_with_the_policy() {
        let p = CacheAware::new(CacheAwareConfig::default());
        let weak = Arc::downgrade(&p.tree);
        drop(p);
        assert!(
            weak.upgrade().is_none(),
            "the sweeper holds no strong reference"
        );
    }
}
