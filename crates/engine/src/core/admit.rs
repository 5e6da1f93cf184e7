//! The prefix cache's part in admission: look each admitted prompt up, hold back requests that
//! would recompute what an earlier request of the same batch is about to cache, and cache the
//! KV that prefill and decoding produced.
//!
//! Holding back is SGLang's in-batch prefix check: the n samples of a GRPO group arrive
//! together, so without it all n would prefill the shared prompt in the same batch. With it,
//! one computes the prompt and the others follow a batch later, copying it.

use std::sync::{Arc, Mutex, MutexGuard};

use super::prefix_cache::PrefixCache;
use super::request::SeqKind;
use super::sequence::Sequence;
use crate::model::KvCache;

/// A request whose uncached part shares at least this many tokens with an earlier request of
/// the same batch waits for the next batch (SGLang's threshold is 32 as well).
pub const IN_BATCH_SHARED: usize = 32;

/// The scheduler's handle on the prefix cache (shared with the HTTP side, where a PD decode
/// server looks up what it already holds before fetching KV).
pub type SharedCache = Arc<Mutex<PrefixCache>>;

/// Locks the cache, tolerating a poisoned lock (the tree is consistent between calls).
pub fn lock(cache: &SharedCache) -> MutexGuard<'_, PrefixCache> {
    cache.lock().unwrap_or_else(|p| p.into_inner())
}

/// Looks up every admitted request; returns the ones to prefill now with their cached prefix,
/// and the ones to put back at the front of the queue (in order).
pub fn lookup(
    cache: &mut PrefixCache,
    admitted: Vec<Sequence>,
) -> (Vec<(Sequence, Option<KvCache>)>, Vec<Sequence>) {
    let mut now: Vec<(Sequence, Option<KvCache>)> = Vec::with_capacity(admitted.len());
    let mut later = Vec::new();
    // Tokens each request prefilling in this batch will add to the cache.
    let mut leaders: Vec<Vec<u32>> = Vec::new();
    for mut s in admitted {
        if matches!(s.req.kind, SeqKind::Decode(_)) {
            now.push((s, None));
            continue;
        }
        let tokens = s.tokens();
        let limit = s.cacheable_len();
        let hit = cache.lookup(&tokens, limit);
        let matched = hit.cache.len;
        let shared = leaders
            .iter()
            .map(|l| common_prefix(l, &tokens[..limit]))
            .max()
            .unwrap_or(0);
        if shared >= matched + IN_BATCH_SHARED {
            if let Some(l) = hit.lock {
                cache.unlock(l);
            }
            later.push(s);
            continue;
        }
        leaders.push(tokens);
        s.cache_lock = hit.lock;
        if s.output.is_empty() {
            s.cached_tokens = matched;
        }
        now.push((s, (matched > 0).then_some(hit.cache)));
    }
    (now, later)
}

/// Caches the KV a sequence holds (prompt and any output fed back so far).
pub fn store(cache: &mut PrefixCache, s: &Sequence, kv: &KvCache, in_use: usize) {
    let tokens = s.tokens();
    let n = kv.len.min(tokens.len());
    cache.insert(&tokens[..n], kv, in_use);
}

/// Releases a finished or retracted sequence's hold on the cache.
pub fn release(cache: &mut PrefixCache, s: &mut Sequence) {
    if let Some(l) = s.cache_lock.take() {
        cache.unlock(l);
    }
}

fn common_prefix(a: &[u32], b: &[u32]) -> usize {
    a.iter().zip(b).take_while(|(x, y)| x == y).count()
}
