//! The approximate radix tree behind the `cache_aware` policy (SGLang's `tree.rs` design).
//!
//! The router cannot see the engines' KV caches, so it keeps its own picture of them: one radix
//! tree of the request texts it routed, each node marked with the workers ("tenants") that were
//! sent a text through that node and when each last was. A worker's tree is the set of nodes
//! marked with it; its size is the number of characters on those nodes, an estimate of how much
//! of its cache the router's requests fill. Texts are matched by characters, not tokens, so no
//! tokenizer is needed.
//!
//! Invariants: every node but the root has at least one tenant, and a child's tenants are a
//! subset of its parent's (an insert marks the whole path; eviction only takes a tenant off a
//! node none of whose children it is on). A node holds the tick of each tenant's last use, and an
//! insert stamps the whole path, so a parent is never older than its children for a tenant:
//! evicting by least recent stamp evicts leaves first.

use std::cmp::Reverse;
use std::collections::{BinaryHeap, HashMap};

/// A tenant's slot in [`Tree::tenants`].
pub(crate) type TenantIx = usize;

/// The root's slot in [`Tree::nodes`].
const ROOT: usize = 0;

/// One node of the arena.
#[derive(Debug, Default)]
struct Node {
    /// The characters this node adds to its parent's prefix (empty for the root and free slots).
    text: Box<str>,
    /// `text`'s length in characters.
    chars: usize,
    /// The parent's slot.
    parent: usize,
    /// Children by their text's first character.
    children: Vec<(char, usize)>,
    /// Tenants holding this node's prefix, in the order they reached it, with the tick each
    /// last used it. Empty only for the root and free slots.
    tenants: Vec<(TenantIx, u64)>,
}

impl Node {
    fn stamp_of(&self, t: TenantIx) -> Option<u64> {
        self.tenants.iter().find(|(x, _)| *x == t).map(|(_, s)| *s)
    }

    fn has(&self, t: TenantIx) -> bool {
        self.tenants.iter().any(|(x, _)| *x == t)
    }
}

/// What matching a text against some tenants found.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Match {
    /// Characters of the text found in the best candidate's tree.
    pub(crate) matched: usize,
    /// Characters in the text.
    pub(crate) total: usize,
    /// Index into the candidates of the tenant holding the longest match (the first to reach
    /// the deepest node when several hold it); `None` when not even one character matched.
    pub(crate) best: Option<usize>,
}

/// A multi-tenant radix tree of routed texts.
#[derive(Debug)]
pub(crate) struct Tree {
    /// The arena; slot [`ROOT`] is the root.
    nodes: Vec<Node>,
    /// Free slots of `nodes`.
    free: Vec<usize>,
    /// Each tenant's size by slot: characters on the nodes marked with it (`None`: a free slot).
    tenants: Vec<Option<usize>>,
    /// Slots by worker id.
    by_id: HashMap<Box<str>, TenantIx>,
    /// The logical clock of stamps (one tick per insert).
    tick: u64,
}

impl Default for Tree {
    fn default() -> Self {
        Self {
            nodes: vec![Node::default()],
            free: Vec::new(),
            tenants: Vec::new(),
            by_id: HashMap::new(),
            tick: 0,
        }
    }
}

/// The common prefix of `a` and `b`: its length in bytes (a character boundary of both) and in
/// characters.
fn common_prefix(a: &str, b: &str) -> (usize, usize) {
    let mut n = a.bytes().zip(b.bytes()).take_while(|(x, y)| x == y).count();
    // Equal bytes up to a boundary of `a` are whole characters of `b` too (UTF-8 is
    // self-synchronizing), so backing off to `a`'s boundary is enough.
    while !a.is_char_boundary(n) {
        n -= 1;
    }
    (n, a[..n].chars().count())
}

impl Tree {
    /// The slot of the worker `id`, if the tree knows it.
    pub(crate) fn tenant(&self, id: &str) -> Option<TenantIx> {
        self.by_id.get(id).copied()
    }

    /// Characters held for tenant `t` (0 for `None`, a worker never routed to).
    pub(crate) fn size_of(&self, t: Option<TenantIx>) -> usize {
        t.and_then(|t| self.tenants.get(t))
            .copied()
            .flatten()
            .unwrap_or(0)
    }

    /// Characters held for the worker `id`.
    pub(crate) fn size(&self, id: &str) -> usize {
        self.size_of(self.tenant(id))
    }

    fn intern(&mut self, id: &str) -> TenantIx {
        if let Some(t) = self.by_id.get(id) {
            return *t;
        }
        let t = match self.tenants.iter().position(Option::is_none) {
            Some(t) => {
                self.tenants[t] = Some(0);
                t
            }
            None => {
                self.tenants.push(Some(0));
                self.tenants.len() - 1
            }
        };
        self.by_id.insert(id.into(), t);
        t
    }

    fn grow(&mut self, t: TenantIx, by: usize) {
        if let Some(Some(size)) = self.tenants.get_mut(t) {
            *size += by;
        }
    }

    fn shrink(&mut self, t: TenantIx, by: usize) {
        if let Some(Some(size)) = self.tenants.get_mut(t) {
            *size = size.saturating_sub(by);
        }
    }

    fn child(&self, n: usize, c: char) -> Option<usize> {
        self.nodes[n]
            .children
            .iter()
            .find(|(k, _)| *k == c)
            .map(|(_, i)| *i)
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

    /// Stamps `t` on node `n` with `now`; true when `t` was not on it before.
    fn stamp(&mut self, n: usize, t: TenantIx, now: u64) -> bool {
        let node = &mut self.nodes[n];
        match node.tenants.iter_mut().find(|(x, _)| *x == t) {
            Some(e) => {
                e.1 = now;
                false
            }
            None => {
                node.tenants.push((t, now));
                true
            }
        }
    }

    /// Splits node `n` after its first `bytes` bytes (`chars` characters, fewer than all): a new
    /// node takes the head and `n`'s place under its parent, with `n`'s tenants; `n` keeps the
    /// tail under it. Sizes do not change: each tenant holds the same characters as before.
    fn split(&mut self, n: usize, bytes: usize, chars: usize) -> usize {
        let old = &mut self.nodes[n];
        let head: Box<str> = old.text[..bytes].into();
        let tail: Box<str> = old.text[bytes..].into();
        let first = tail.chars().next().unwrap_or_default();
        old.text = tail;
        old.chars -= chars;
        let parent = old.parent;
        let tenants = old.tenants.clone();
        let mid = self.alloc(Node {
            text: head,
            chars,
            parent,
            children: vec![(first, n)],
            tenants,
        });
        self.nodes[n].parent = mid;
        for e in &mut self.nodes[parent].children {
            if e.1 == n {
                e.1 = mid;
            }
        }
        mid
    }

    /// Records that `text` was routed to the worker `id`: marks (and stamps) every node of its
    /// path with it, splitting and adding nodes as needed. Returns the worker's new size.
    pub(crate) fn insert(&mut self, text: &str, id: &str) -> usize {
        let t = self.intern(id);
        self.tick += 1;
        let now = self.tick;
        self.stamp(ROOT, t, now);
        let mut node = ROOT;
        let mut rest = text;
        while let Some(c) = rest.chars().next() {
            let Some(child) = self.child(node, c) else {
                let chars = rest.chars().count();
                let leaf = self.alloc(Node {
                    text: rest.into(),
                    chars,
                    parent: node,
                    children: Vec::new(),
                    tenants: vec![(t, now)],
                });
                self.nodes[node].children.push((c, leaf));
                self.grow(t, chars);
                break;
            };
            // At least the first character is common: the child is keyed by it.
            let (bytes, chars) = common_prefix(rest, &self.nodes[child].text);
            let child = if bytes < self.nodes[child].text.len() {
                self.split(child, bytes, chars)
            } else {
                child
            };
            if self.stamp(child, t, now) {
                let n = self.nodes[child].chars;
                self.grow(t, n);
            }
            node = child;
            rest = &rest[bytes..];
        }
        self.size_of(Some(t))
    }

    /// The longest prefix of `text` held by any of `candidates` (a tenant slot per candidate,
    /// `None` for a worker the tree does not know), and which candidate holds it. A partial
    /// match inside a node counts, as in SGLang.
    pub(crate) fn longest_match(&self, text: &str, candidates: &[Option<TenantIx>]) -> Match {
        let total = text.chars().count();
        let held = |n: usize| {
            self.nodes[n]
                .tenants
                .iter()
                .any(|(t, _)| candidates.contains(&Some(*t)))
        };
        let mut node = ROOT;
        let mut rest = text;
        let mut matched = 0;
        while let Some(c) = rest.chars().next() {
            let Some(child) = self.child(node, c).filter(|&ch| held(ch)) else {
                break;
            };
            let (bytes, chars) = common_prefix(rest, &self.nodes[child].text);
            matched += chars;
            node = child;
            if bytes < self.nodes[child].text.len() {
                break;
            }
            rest = &rest[bytes..];
        }
        // The first of the node's tenants (in the order they reached it) among the candidates:
        // SGLang's choice, the worker that first held the prefix, which keeps a prompt on one
        // worker after a request of it went elsewhere while loads were imbalanced.
        let best = (node != ROOT)
            .then(|| {
                self.nodes[node]
                    .tenants
                    .iter()
                    .find_map(|(t, _)| candidates.iter().position(|c| *c == Some(*t)))
            })
            .flatten();
        Match {
            matched,
            total,
            best,
        }
    }

    fn is_leaf_for(&self, n: usize, t: TenantIx) -> bool {
        !self.nodes[n]
            .children
            .iter()
            .any(|&(_, c)| self.nodes[c].has(t))
    }

    /// Takes node `n` (which has no tenants and therefore no children) off its parent and frees
    /// its slot.
    fn unlink(&mut self, n: usize) {
        let parent = self.nodes[n].parent;
        self.nodes[parent].children.retain(|&(_, c)| c != n);
        self.nodes[n] = Node::default();
        self.free.push(n);
    }

    /// Evicts least recently used leaves of every tenant holding more than `max_size`
    /// characters until it holds at most that many (SGLang's `evict_tenant_by_size`). A node
    /// left with no tenant is removed.
    pub(crate) fn evict(&mut self, max_size: usize) {
        let over: Vec<bool> = self
            .tenants
            .iter()
            .map(|x| x.is_some_and(|size| size > max_size))
            .collect();
        if !over.contains(&true) {
            return;
        }
        let mut heap = BinaryHeap::new();
        for n in 1..self.nodes.len() {
            for &(t, stamp) in &self.nodes[n].tenants {
                if over[t] && self.is_leaf_for(n, t) {
                    heap.push(Reverse((stamp, t, n)));
                }
            }
        }
        while let Some(Reverse((_, t, n))) = heap.pop() {
            if self.size_of(Some(t)) <= max_size || !self.nodes[n].has(t) || !self.is_leaf_for(n, t)
            {
                continue;
            }
            self.nodes[n].tenants.retain(|(x, _)| *x != t);
            let chars = self.nodes[n].chars;
            self.shrink(t, chars);
            let parent = self.nodes[n].parent;
            if self.nodes[n].tenants.is_empty() {
                self.unlink(n);
            }
            if parent != ROOT
                && let Some(stamp) = self.nodes[parent].stamp_of(t)
                && self.is_leaf_for(parent, t)
            {
                heap.push(Reverse((stamp, t, parent)));
            }
        }
    }

    /// Forgets the worker `id`: takes it off every node, removes the nodes left with no tenant
    /// and frees its slot.
    pub(crate) fn remove(&mut self, id: &str) {
        let Some(t) = self.by_id.remove(id) else {
            return;
        };
        // Every node holding `t` hangs under nodes holding `t`, so a walk through them finds all.
        let mut stack = vec![ROOT];
        while let Some(n) = stack.pop() {
            let kids: Vec<usize> = self.nodes[n].children.iter().map(|&(_, c)| c).collect();
            for c in kids {
                if !self.nodes[c].has(t) {
                    continue;
                }
                self.nodes[c].tenants.retain(|(x, _)| *x != t);
                if self.nodes[c].tenants.is_empty() {
                    // Its whole subtree held only `t`.
                    self.free_subtree(c);
                } else {
                    stack.push(c);
                }
            }
        }
        self.nodes[ROOT].tenants.retain(|(x, _)| *x != t);
        self.tenants[t] = None;
    }

    fn free_subtree(&mut self, n: usize) {
        let parent = self.nodes[n].parent;
        self.nodes[parent].children.retain(|&(_, c)| c != n);
        let mut stack = vec![n];
        while let Some(x) = stack.pop() {
            stack.extend(self.nodes[x].children.iter().map(|&(_, c)| c));
            self.nodes[x] = Node::default();
            self.free.push(x);
        }
    }

    /// Nodes in use, the root included (tests and debugging).
    #[cfg(test)]
    fn live_nodes(&self) -> usize {
        self.nodes.len() - self.free.len()
    }

    /// Panics unless the invariants hold and every size equals a recount.
    #[cfg(test)]
    fn check(&self) {
        let mut sizes = vec![0usize; self.tenants.len()];
        let mut stack = vec![ROOT];
        let mut seen = 1;
        while let Some(n) = stack.pop() {
            for &(c, k) in &self.nodes[n].children {
                let child = &self.nodes[k];
                seen += 1;
                assert_eq!(child.parent, n);
                assert_eq!(child.text.chars().next(), Some(c));
                assert_eq!(child.chars, child.text.chars().count());
                assert!(!child.tenants.is_empty(), "a node with no tenant");
                for &(t, stamp) in &child.tenants {
                    let up = self.nodes[n].stamp_of(t);
                    assert!(up.is_some(), "child tenants are a subset of the parent's");
                    assert!(n == ROOT || up >= Some(stamp), "a parent is never older");
                    sizes[t] += child.chars;
                }
                stack.push(k);
            }
        }
        assert_eq!(seen, self.live_nodes());
        for (t, x) in self.tenants.iter().enumerate() {
            assert_eq!(x.unwrap_or(0), sizes[t], "size of {t}");
        }
        let mut slots: Vec<TenantIx> = self.by_id.values().copied().collect();
        slots.sort_unstable();
        let used: Vec<TenantIx> = (0..self.tenants.len())
            .filter(|&t| self.tenants[t].is_some())
            .collect();
        assert_eq!(slots, used, "one id per used slot");
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cands(tree: &Tree, ids: &[&str]) -> Vec<Option<TenantIx>> {
        ids.iter().map(|id| tree.tenant(id)).collect()
    }

    #[test]
    fn inserted_texts_match_by_longest_prefix() {
        let mut t = Tree::default();
        assert_eq!(t.insert("hello world", "a"), 11);
        assert_eq!(t.insert("hello there", "b"), 11);
        t.check();
        let c = cands(&t, &["a", "b"]);
        let m = t.longest_match("hello world!", &c);
        assert_eq!((m.matched, m.total, m.best), (11, 12, Some(0)));
        let m = t.longest_match("hello thx", &c);
        assert_eq!(
            (m.matched, m.best),
            (8, Some(1)),
            "a partial match inside a node counts"
        );
        let m = t.longest_match("goodbye", &c);
        assert_eq!((m.matched, m.best), (0, None));
        assert_eq!(t.longest_match("", &c).total, 0);
        // "hello " is shared: a and b each hold 11 characters, the tree 6 + 5 + 5.
        assert_eq!((t.size("a"), t.size("b")), (11, 11));
        assert_eq!(t.live_nodes(), 4);
    }

    #[test]
    fn only_candidates_count_and_the_first_holder_wins() {
        let mut t = Tree::default();
        t.insert("abcdef", "a");
        t.insert("abcxyz", "b");
        let only_b = cands(&t, &["b"]);
        let m = t.longest_match("abcdef", &only_b);
        assert_eq!((m.matched, m.best), (3, Some(0)), "b holds only abc of it");
        let m = t.longest_match("abcdef", &[None, t.tenant("zzz")]);
        assert_eq!(m.best, None);
        t.insert("abcdef", "b");
        let both = cands(&t, &["a", "b"]);
        assert_eq!(
            t.longest_match("abcdef", &both).best,
            Some(0),
            "a held it first"
        );
        let reversed = cands(&t, &["b", "a"]);
        assert_eq!(t.longest_match("abcdef", &reversed).best, Some(1));
        t.remove("a");
        let both = cands(&t, &["a", "b"]);
        assert_eq!(t.longest_match("abcdef", &both).best, Some(1));
        t.check();
    }

    #[test]
    fn multibyte_characters_split_on_boundaries() {
        let mut t = Tree::default();
        t.insert("héllo wörld", "a");
        t.insert("héllo wâld", "a");
        t.insert("hé", "b");
        t.check();
        let c = cands(&t, &["a", "b"]);
        let m = t.longest_match("héllo wörst", &c);
        assert_eq!((m.matched, m.total, m.best), (9, 11, Some(0)));
        assert_eq!(t.size("a"), 7 + 4 + 3);
        assert_eq!(t.size("b"), 2);
        assert_eq!(common_prefix("aé", "aè"), (1, 1));
    }

    #[test]
    fn eviction_keeps_each_tenant_under_the_limit_dropping_least_recent_leaves() {
        let mut t = Tree::default();
        for i in 0..10 {
            t.insert(&format!("prefix-{i}-{}", "x".repeat(20)), "a");
        }
        t.insert("other", "b");
        let before = t.size("a");
        assert_eq!(before, 7 + 10 * 22);
        t.evict(100);
        t.check();
        assert!(t.size("a") <= 100, "{}", t.size("a"));
        assert_eq!(t.size("b"), 5, "tenants under the limit are untouched");
        let a = cands(&t, &["a"]);
        let newest = t.longest_match(&format!("prefix-9-{}", "x".repeat(20)), &a);
        assert_eq!(newest.matched, newest.total, "the most recent text stays");
        let oldest = t.longest_match(&format!("prefix-0-{}", "x".repeat(20)), &a);
        assert_eq!(
            oldest.matched, 7,
            "the oldest lost all but the shared prefix"
        );
        // Evicting below the shared prefix empties a's tree and frees its nodes; b's 5 stay.
        t.evict(5);
        t.check();
        assert_eq!(t.size("a"), 0);
        assert_eq!(t.live_nodes(), 2, "the root and b's node");
    }

    #[test]
    fn removing_a_tenant_forgets_it_and_frees_its_nodes() {
        let mut t = Tree::default();
        t.insert("shared prefix one", "a");
        t.insert("shared prefix two", "b");
        t.insert("only a", "a");
        t.remove("a");
        t.check();
        assert_eq!(t.tenant("a"), None);
        assert_eq!(t.size("a"), 0);
        assert_eq!(t.live_nodes(), 3, "root, the shared prefix, b's tail");
        let m = t.longest_match("only a", &cands(&t, &["b"]));
        assert_eq!(m.best, None);
        assert_eq!(t.size("b"), 17);
        t.remove("a");
        // The slot is reused, with a fresh size.
        t.insert("c", "c");
        t.check();
        assert_eq!(t.size("c"), 1);
        assert_eq!(
            t.longest_match("shared prefix two", &cands(&t, &["b"]))
                .matched,
            17
        );
    }
}
