//! A list that a session's turns share: a turn that continues an earlier one keeps that turn's
//! list (its messages, its prompt's ids and text) by reference and adds only what is new, so a
//! turn at the end of a long session allocates and copies no more than its new items. Without
//! this, every recorded turn held its whole conversation and prompt afresh, and turn N cost
//! memory (and page faults) in proportion to N.
//!
//! A [`Shared`] is a chain of chunks, the newest last; cloning one is one reference count.
//! It serializes as the plain list (and [`SharedText`] as the plain string), so what is written
//! from it is byte for byte what a `Vec` (a `String`) gave.

use std::sync::Arc;

use serde::{Deserialize, Deserializer, Serialize, Serializer};

/// One chunk: the items after the previous chunk's.
#[derive(Debug)]
struct Chunk<T> {
    prev: Option<Arc<Chunk<T>>>,
    items: Vec<T>,
}

impl<T> Drop for Chunk<T> {
    // A long chain is let go one chunk at a time, not by a recursion as deep as the chain.
    fn drop(&mut self) {
        let mut prev = self.prev.take();
        while let Some(c) = prev {
            match Arc::try_unwrap(c) {
                Ok(mut c) => prev = c.prev.take(),
                Err(_) => break,
            }
        }
    }
}

/// A list made of an earlier list, shared, and items of its own.
#[derive(Debug)]
pub struct Shared<T> {
    last: Option<Arc<Chunk<T>>>,
    len: usize,
}

impl<T> Clone for Shared<T> {
    fn clone(&self) -> Self {
        Self {
            last: self.last.clone(),
            len: self.len,
        }
    }
}

impl<T> Default for Shared<T> {
    fn default() -> Self {
        Self { last: None, len: 0 }
    }
}

impl<T> From<Vec<T>> for Shared<T> {
    fn from(items: Vec<T>) -> Self {
        Self::default().with(items)
    }
}

impl<T> Shared<T> {
    /// How many items.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether there are none.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// This list followed by `items`; this one is shared, not copied.
    pub fn with(&self, items: Vec<T>) -> Self {
        if items.is_empty() {
            return self.clone();
        }
        let len = self.len + items.len();
        Self {
            last: Some(Arc::new(Chunk {
                prev: self.last.clone(),
                items,
            })),
            len,
        }
    }

    /// The chunks, oldest first.
    fn chunks(&self) -> Vec<&[T]> {
        let mut out = Vec::new();
        let mut c = self.last.as_deref();
        while let Some(k) = c {
            out.push(k.items.as_slice());
            c = k.prev.as_deref();
        }
        out.reverse();
        out
    }

    /// The items, in order.
    pub fn iter(&self) -> impl Iterator<Item = &T> {
        self.chunks().into_iter().flatten()
    }

    /// The item at `i` (found from the newest chunk back, so a recent one is found at once).
    pub fn get(&self, i: usize) -> Option<&T> {
        let (mut c, mut end) = (self.last.as_deref(), self.len);
        while let Some(k) = c {
            let start = end - k.items.len();
            if i >= start {
                return k.items.get(i - start);
            }
            end = start;
            c = k.prev.as_deref();
        }
        None
    }

    /// Whether the items from `from` on begin with `s`.
    pub fn has_at(&self, from: usize, s: &[T]) -> bool
    where
        T: PartialEq,
    {
        if from.saturating_add(s.len()) > self.len {
            return false;
        }
        match self.tail_slice(from) {
            Some(t) => t.get(..s.len()) == Some(s),
            None => self.iter().skip(from).take(s.len()).eq(s.iter()),
        }
    }

    /// The items from `from` on, as one slice when they lie in the newest chunk.
    pub fn tail_slice(&self, from: usize) -> Option<&[T]> {
        let c = self.last.as_deref()?;
        let start = from.checked_sub(self.len - c.items.len())?;
        c.items.get(start..)
    }

    /// Whether `prefix`'s items begin this list: at once when this list was made from it.
    pub fn starts_with(&self, prefix: &Shared<T>) -> bool
    where
        T: PartialEq,
    {
        if prefix.len > self.len {
            return false;
        }
        if prefix.len == 0 || self.shares(prefix) {
            return true;
        }
        // A list of one chunk (a turn not shared yet) is compared a chunk of `prefix` at a time.
        if let Some(all) = self.tail_slice(0) {
            let mut at = 0;
            for c in prefix.chunks() {
                if all.get(at..at + c.len()) != Some(c) {
                    return false;
                }
                at += c.len();
            }
            return true;
        }
        self.iter().zip(prefix.iter()).all(|(a, b)| a == b)
    }

    /// Whether this list was made from `prefix` (its items are this list's first ones, known
    /// without comparing them).
    pub fn starts_with_shared(&self, prefix: &Shared<T>) -> bool {
        prefix.len <= self.len && self.shares(prefix)
    }

    /// Whether `prefix` is a chunk boundary of this list's chain (so its items are this list's
    /// first ones without comparing them).
    fn shares(&self, prefix: &Shared<T>) -> bool {
        let Some(p) = &prefix.last else { return true };
        let (mut c, mut len) = (self.last.as_ref(), self.len);
        while let Some(k) = c {
            if len == prefix.len {
                return Arc::ptr_eq(k, p);
            }
            if len < prefix.len {
                return false;
            }
            len -= k.items.len();
            c = k.prev.as_ref();
        }
        false
    }
}

impl<T: Clone> Shared<T> {
    /// The items from `from` on, copied.
    pub fn tail(&self, from: usize) -> Vec<T> {
        if let Some(s) = self.tail_slice(from) {
            return s.to_vec();
        }
        let mut out = Vec::with_capacity(self.len.saturating_sub(from));
        let mut skip = from;
        for c in self.chunks() {
            if skip >= c.len() {
                skip -= c.len();
                continue;
            }
            out.extend_from_slice(&c[skip..]);
            skip = 0;
        }
        out
    }

    /// Appends all the items to `out`, a chunk at a time.
    pub fn copy_into(&self, out: &mut Vec<T>) {
        for c in self.chunks() {
            out.extend_from_slice(c);
        }
    }

    /// All the items as one slice: borrowed when they lie in one chunk, else copied.
    pub fn as_cow(&self) -> std::borrow::Cow<'_, [T]> {
        match self.tail_slice(0) {
            Some(s) => std::borrow::Cow::Borrowed(s),
            None if self.is_empty() => std::borrow::Cow::Borrowed(&[]),
            None => std::borrow::Cow::Owned(self.to_vec()),
        }
    }

    /// All the items, copied.
    pub fn to_vec(&self) -> Vec<T> {
        self.tail(0)
    }
}

impl<T: PartialEq> PartialEq for Shared<T> {
    fn eq(&self, other: &Self) -> bool {
        self.len == other.len && self.starts_with(other)
    }
}

impl<T: PartialEq> PartialEq<[T]> for Shared<T> {
    fn eq(&self, other: &[T]) -> bool {
        self.len == other.len() && self.iter().zip(other).all(|(a, b)| a == b)
    }
}

impl<T: Serialize> Serialize for Shared<T> {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.collect_seq(self.iter())
    }
}

impl<'de, T: Deserialize<'de>> Deserialize<'de> for Shared<T> {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        Vec::<T>::deserialize(d).map(Self::from)
    }
}

/// A text a turn shares with the turn it continues: its chunks are whole UTF-8 strings.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct SharedText(Shared<u8>);

impl SharedText {
    /// Its length in bytes.
    pub fn len(&self) -> usize {
        self.0.len()
    }

    /// Whether it is empty.
    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }

    /// This text followed by `s`; this one is shared, not copied.
    pub fn with(&self, s: String) -> Self {
        Self(self.0.with(s.into_bytes()))
    }

    /// Whether `prefix` begins this text: at once when this text was made from it.
    pub fn starts_with(&self, prefix: &SharedText) -> bool {
        self.0.starts_with(&prefix.0)
    }

    /// Whether the text from byte `from` on begins with `s`.
    pub fn has_at(&self, from: usize, s: &str) -> bool {
        self.0.has_at(from, s.as_bytes())
    }

    /// Whether this text was made from `prefix`.
    pub fn starts_with_shared(&self, prefix: &SharedText) -> bool {
        self.0.starts_with_shared(&prefix.0)
    }

    /// Whether it ends with `s`.
    pub fn ends_with(&self, s: &str) -> bool {
        let n = s.len();
        if n > self.len() {
            return false;
        }
        match self.0.tail_slice(self.len() - n) {
            Some(t) => t == s.as_bytes(),
            None => self.0.iter().skip(self.len() - n).eq(s.as_bytes()),
        }
    }

    /// The text from byte `from` on (every chunk boundary is a character boundary; a `from`
    /// inside a character gives that character's rest replaced, never a panic).
    pub fn tail(&self, from: usize) -> String {
        match String::from_utf8(self.0.tail(from)) {
            Ok(s) => s,
            Err(e) => String::from_utf8_lossy(e.as_bytes()).into_owned(),
        }
    }
}

impl From<String> for SharedText {
    fn from(s: String) -> Self {
        Self(Shared::from(s.into_bytes()))
    }
}

impl std::fmt::Display for SharedText {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.tail(0))
    }
}

impl PartialEq<str> for SharedText {
    fn eq(&self, other: &str) -> bool {
        self.0 == *other.as_bytes()
    }
}

impl Serialize for SharedText {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(&self.tail(0))
    }
}

impl<'de> Deserialize<'de> for SharedText {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        String::deserialize(d).map(Self::from)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_shared_list_is_its_items_and_writes_as_a_plain_list() {
        let a = Shared::from(vec![1u32, 2]);
        let b = a.with(vec![3, 4]);
        let c = b.with(vec![5]);
        assert_eq!(c.to_vec(), vec![1, 2, 3, 4, 5]);
        assert_eq!(c.tail(3), vec![4, 5]);
        assert_eq!(c.tail_slice(4), Some(&[5][..]));
        assert_eq!(c.tail_slice(3), None);
        assert!(c.starts_with(&b) && c.starts_with(&a) && !a.starts_with(&b));
        assert!(
            c.starts_with(&Shared::from(vec![1, 2, 3])),
            "compared when not shared"
        );
        assert!(!c.starts_with(&Shared::from(vec![1, 3])));
        assert_eq!(c, Shared::from(vec![1, 2, 3, 4, 5]));
        assert_eq!(serde_json::to_string(&c).unwrap(), "[1,2,3,4,5]");
        let back: Shared<u32> = serde_json::from_str("[1,2,3,4,5]").unwrap();
        assert_eq!(back, c);
        let t = SharedText::from("ab".to_string()).with("cé".into());
        assert_eq!(serde_json::to_string(&t).unwrap(), "\"abcé\"");
        assert!(t.ends_with("bcé") && t.ends_with("é") && !t.ends_with("a"));
        assert_eq!(t.tail(2), "cé");
        assert!(*"abcé" == *t.tail(0).as_str());
    }

    #[test]
    fn a_long_chain_drops_without_a_deep_recursion() {
        let mut s = Shared::from(vec![0u8]);
        for i in 0..200_000u32 {
            s = s.with(vec![(i % 251) as u8]);
        }
        assert_eq!(s.len(), 200_001);
        drop(s);
    }
}
