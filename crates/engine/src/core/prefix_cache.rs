//! The prefix cache: a radix tree of token runs over KV storage, as SGLang's radix cache.
//!
//! KV at position `i` depends only on tokens `0..=i`, so a prompt that starts like an earlier
//! one can copy the earlier KV for the shared part and compute only the rest: the n samples of
//! a GRPO group prefill their prompt once. Each edge holds a run of tokens and their KV; a
//! match that ends inside an edge splits it. Nodes that a running request matched are locked
//! (reference-counted, with their ancestors) and never evicted; the rest are evicted least
//! recently used, leaves first, whenever the tree holds more than its token budget.
//!
//! Every entry was computed by one weight version: a weight update flushes the tree (KV from
//! old weights would be wrong), and locks taken before a flush are ignored afterwards.

use std::collections::HashMap;

use crate::model::forward::LayerKv;
use crate::model::{KvCache, ModelConfig};

const ROOT: usize = 0;

#[derive(Debug, Default)]
struct Node {
    parent: usize,
    /// The token run on the edge from the parent.
    key: Vec<u32>,
    /// KV of those tokens, one entry per layer (`key.len() × kv_dim` each).
    kv: Vec<LayerKv>,
    /// Children by the first token of their run.
    children: HashMap<u32, usize>,
    /// Running requests whose matched prefix ends at or below this node.
    locks: usize,
    /// Logical time of the last match or insert through this node.
    last: u64,
}

/// A running request's hold on the nodes it matched; released by [`PrefixCache::unlock`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CacheLock {
    node: usize,
    generation: u64,
}

/// What a lookup found: the KV of the matched prefix and the lock that keeps it cached.
#[derive(Debug)]
pub struct Hit {
    /// KV of the first `cache.len` tokens, copied out of the tree.
    pub cache: KvCache,
    /// Held until the request finishes; `None` when nothing matched.
    pub lock: Option<CacheLock>,
}

/// The radix tree. `budget` is in tokens (SGLang's `max_total_num_tokens`).
#[derive(Debug)]
pub struct PrefixCache {
    nodes: Vec<Node>,
    free: Vec<usize>,
    layers: usize,
    kv_dim: usize,
    budget: usize,
    tokens: usize,
    tick: u64,
    generation: u64,
    version: String,
}

impl PrefixCache {
    /// An empty tree for this architecture holding at most `budget` tokens of KV computed by
    /// weights labelled `version`.
    pub fn new(config: &ModelConfig, budget: usize, version: &str) -> Self {
        let root = Node {
            kv: vec![LayerKv::default(); config.num_hidden_layers],
            ..Default::default()
        };
        Self {
            nodes: vec![root],
            free: Vec::new(),
            layers: config.num_hidden_layers,
            kv_dim: config.kv_dim(),
            budget,
            tokens: 0,
            tick: 0,
            generation: 0,
            version: version.to_string(),
        }
    }

    /// The weight version every entry was computed with (a PD decode compares it with the
    /// prefill's before using its own entries instead of transferred KV).
    pub fn version(&self) -> &str {
        &self.version
    }

    /// Tokens held.
    pub fn len(&self) -> usize {
        self.tokens
    }

    /// True when nothing is cached.
    pub fn is_empty(&self) -> bool {
        self.tokens == 0
    }

    /// The token budget.
    pub fn budget(&self) -> usize {
        self.budget
    }

    /// Drops everything (weights changed, or `/flush_cache`); locks taken before are void.
    /// Entries from now on are of `version`.
    pub fn clear(&mut self, version: &str) {
        self.version = version.to_string();
        self.nodes.truncate(1);
        self.nodes[ROOT].children.clear();
        self.nodes[ROOT].locks = 0;
        self.free.clear();
        self.tokens = 0;
        self.generation += 1;
    }

    /// The longest cached prefix of `tokens[..limit]`, copied out, and a lock on it.
    pub fn lookup(&mut self, tokens: &[u32], limit: usize) -> Hit {
        let tokens = &tokens[..limit.min(tokens.len())];
        self.tick += 1;
        let (node, len) = self.descend(tokens);
        let mut path = Vec::new();
        let mut n = node;
        while n != ROOT {
            self.nodes[n].last = self.tick;
            path.push(n);
            n = self.nodes[n].parent;
        }
        let mut cache = KvCache {
            layers: (0..self.layers)
                .map(|_| LayerKv {
                    k: Vec::with_capacity(len * self.kv_dim),
                    v: Vec::with_capacity(len * self.kv_dim),
                })
                .collect(),
            len,
        };
        for &n in path.iter().rev() {
            for (dst, src) in cache.layers.iter_mut().zip(&self.nodes[n].kv) {
                dst.k.extend_from_slice(&src.k);
                dst.v.extend_from_slice(&src.v);
            }
        }
        let lock = (node != ROOT).then(|| self.lock(node));
        Hit { cache, lock }
    }

    /// Walks down along `tokens`, splitting the edge where the match ends inside one; returns
    /// the deepest node matched and the number of tokens matched.
    fn descend(&mut self, tokens: &[u32]) -> (usize, usize) {
        let (mut node, mut pos) = (ROOT, 0);
        while pos < tokens.len() {
            let Some(&child) = self.nodes[node].children.get(&tokens[pos]) else {
                break;
            };
            let key = &self.nodes[child].key;
            let common = key
                .iter()
                .zip(&tokens[pos..])
                .take_while(|(a, b)| a == b)
                .count();
            if common < key.len() {
                let mid = self.split(child, common);
                return (mid, pos + common);
            }
            node = child;
            pos += common;
        }
        (node, pos)
    }

    /// Splits `child`'s edge after `at` tokens; returns the new middle node.
    fn split(&mut self, child: usize, at: usize) -> usize {
        let d = self.kv_dim;
        let old = &mut self.nodes[child];
        let tail_key = old.key.split_off(at);
        let mut head_kv = Vec::with_capacity(old.kv.len());
        for l in old.kv.iter_mut() {
            let k = l.k.drain(..at * d).collect();
            let v = l.v.drain(..at * d).collect();
            head_kv.push(LayerKv { k, v });
        }
        let head_key = std::mem::replace(&mut old.key, tail_key);
        let (parent, locks, last) = (old.parent, old.locks, old.last);
        let first_tail = old.key[0];
        let mid = self.alloc(Node {
            parent,
            key: head_key,
            kv: head_kv,
            children: HashMap::from([(first_tail, child)]),
            locks,
            last,
        });
        self.nodes[child].parent = mid;
        let first = self.nodes[mid].key[0];
        self.nodes[parent].children.insert(first, mid);
        mid
    }

    fn alloc(&mut self, node: Node) -> usize {
        match self.free.pop() {
            Some(i) => {
                self.nodes[i] = node;
                i
            }
            None => {
                self.nodes.push(node);
                self.nodes.len() - 1
            }
        }
    }

    fn lock(&mut self, node: usize) -> CacheLock {
        let mut n = node;
        while n != ROOT {
            self.nodes[n].locks += 1;
            n = self.nodes[n].parent;
        }
        CacheLock {
            node,
            generation: self.generation,
        }
    }

    /// Releases a lookup's lock (a lock from before the last flush is ignored).
    pub fn unlock(&mut self, lock: CacheLock) {
        if lock.generation != self.generation {
            return;
        }
        let mut n = lock.node;
        while n != ROOT {
            let node = &mut self.nodes[n];
            node.locks = node.locks.saturating_sub(1);
            n = node.parent;
        }
    }

    /// Caches `tokens` with their KV (the first `tokens.len()` positions of `cache`), keeping
    /// what is already there; then evicts down to the budget, sparing `in_use` tokens of
    /// running requests' own KV.
    pub fn insert(&mut self, tokens: &[u32], cache: &KvCache, in_use: usize) {
        let n = tokens.len().min(cache.len);
        if n == 0 || cache.layers.len() != self.layers {
            return;
        }
        self.tick += 1;
        let (node, pos) = self.descend(&tokens[..n]);
        let mut m = node;
        while m != ROOT {
            self.nodes[m].last = self.tick;
            m = self.nodes[m].parent;
        }
        if pos < n {
            let d = self.kv_dim;
            let kv = cache
                .layers
                .iter()
                .map(|l| LayerKv {
                    k: l.k[pos * d..n * d].to_vec(),
                    v: l.v[pos * d..n * d].to_vec(),
                })
                .collect();
            let leaf = self.alloc(Node {
                parent: node,
                key: tokens[pos..n].to_vec(),
                kv,
                children: HashMap::new(),
                locks: 0,
                last: self.tick,
            });
            self.nodes[node].children.insert(tokens[pos], leaf);
            self.tokens += n - pos;
        }
        self.evict(self.budget.saturating_sub(in_use));
    }

    /// Evicts unlocked leaves, least recently used first, until at most `target` tokens stay.
    pub fn evict(&mut self, target: usize) {
        if self.tokens <= target {
            return;
        }
        let mut leaves: Vec<(u64, usize)> = self.evictable_leaves();
        leaves.sort_unstable();
        let mut i = 0;
        while self.tokens > target && i < leaves.len() {
            let (_, n) = leaves[i];
            i += 1;
            let parent = self.remove_leaf(n);
            // A parent left without children becomes a candidate in LRU order.
            if parent != ROOT && self.is_evictable_leaf(parent) {
                let at = leaves[i..].partition_point(|x| x.0 <= self.nodes[parent].last) + i;
                leaves.insert(at, (self.nodes[parent].last, parent));
            }
        }
    }

    fn is_evictable_leaf(&self, n: usize) -> bool {
        let node = &self.nodes[n];
        node.children.is_empty() && node.locks == 0 && !node.key.is_empty()
    }

    fn evictable_leaves(&self) -> Vec<(u64, usize)> {
        let mut out = Vec::new();
        let mut stack = vec![ROOT];
        while let Some(n) = stack.pop() {
            stack.extend(self.nodes[n].children.values().copied());
            if n != ROOT && self.is_evictable_leaf(n) {
                out.push((self.nodes[n].last, n));
            }
        }
        out
    }

    fn remove_leaf(&mut self, n: usize) -> usize {
        let node = std::mem::take(&mut self.nodes[n]);
        self.tokens -= node.key.len();
        if let Some(&first) = node.key.first() {
            self.nodes[node.parent].children.remove(&first);
        }
        self.free.push(n);
        node.parent
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::{Weights, forward_token};

    fn kv(w: &Weights, tokens: &[u32]) -> KvCache {
        let mut c = KvCache::new(&w.config);
        for &t in tokens {
            forward_token(w, &mut c, t, false);
        }
        c
    }

    #[test]
    fn a_shared_prefix_is_copied_bit_for_bit_and_splits_edges() {
        let cfg = ModelConfig::tiny();
        let w = Weights::init(&cfg, 3);
        let mut pc = PrefixCache::new(&cfg, 10_000, "v");
        let a = [5u32, 6, 7, 8, 9, 10];
        pc.insert(&a, &kv(&w, &a), 0);
        assert_eq!(pc.len(), 6);
        // Ends inside the edge: the edge splits, and the copy equals a fresh computation.
        let b = [5u32, 6, 7, 20, 21];
        let hit = pc.lookup(&b, b.len());
        assert_eq!(hit.cache.len, 3);
        assert_eq!(hit.cache, kv(&w, &b[..3]));
        pc.insert(&b, &kv(&w, &b), 0);
        assert_eq!(pc.len(), 8, "only the new suffix is stored");
        let again = pc.lookup(&a, 5);
        assert_eq!(again.cache, kv(&w, &a[..5]), "limit caps the match");
        let none = pc.lookup(&[99, 5], 2);
        assert_eq!((none.cache.len, none.lock), (0, None));
    }

    #[test]
    fn eviction_is_lru_and_spares_locked_prefixes() {
        let cfg = ModelConfig::tiny();
        let w = Weights::init(&cfg, 3);
        let mut pc = PrefixCache::new(&cfg, 8, "v");
        let a = [1u32, 2, 3, 4];
        let b = [9u32, 8, 7, 6];
        pc.insert(&a, &kv(&w, &a), 0);
        pc.insert(&b, &kv(&w, &b), 0);
        let held = pc.lookup(&a, 4).lock.expect("a is cached");
        // `a` is older but locked: inserting a third run evicts `b` instead.
        let c = [4u32, 4, 4, 4];
        pc.insert(&c, &kv(&w, &c), 0);
        let probe = |pc: &mut PrefixCache, t: &[u32]| {
            let hit = pc.lookup(t, t.len());
            if let Some(l) = hit.lock {
                pc.unlock(l);
            }
            hit.cache.len
        };
        assert_eq!(probe(&mut pc, &a), 4);
        assert_eq!(probe(&mut pc, &b), 0);
        assert!(pc.len() <= 8);
        // Running requests' own KV counts against the budget: a full pool keeps only locked runs.
        pc.insert(&b, &kv(&w, &b), 8);
        assert_eq!(pc.len(), 4);
        assert_eq!(probe(&mut pc, &a), 4);
        pc.unlock(held);
        pc.evict(0);
        assert!(pc.is_empty(), "unlocked, it goes too");
    }

    #[test]
    fn clear_voids_old_locks() {
        let cfg = ModelConfig::tiny();
        let w = Weights::init(&cfg, 3);
        let mut pc = PrefixCache::new(&cfg, 100, "v");
        let a = [1u32, 2, 3];
        pc.insert(&a, &kv(&w, &a), 0);
        let lock = pc.lookup(&a, 3).lock.expect("cached");
        pc.clear("v2");
        assert!(pc.is_empty());
        pc.insert(&a, &kv(&w, &a), 0);
        pc.unlock(lock);
        pc.evict(0);
        assert!(pc.is_empty(), "a stale lock does not pin the new entry");
    }
}
