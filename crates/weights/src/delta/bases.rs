//! What each end holds between updates: the sender's copy of what it last sent, and a
//! receiver's tensors as its engine handed them back, each under a *tag* that names its
//! content (the checksum of a delta's result, or a fresh random tag for a tensor sent whole).
//!
//! Both ends sum their tags into a [`digest`](SenderBases::digest); a receiver sends its digest
//! when it joins a group, and one that differs from the sender's gets tensors whole until it
//! holds them, so a restarted, late or re-placed engine never receives a delta it cannot apply.

use std::collections::HashMap;
use std::hash::{BuildHasher, Hasher};
use std::sync::{Arc, Mutex};

use bytes::Bytes;
use xxhash_rust::xxh3::xxh3_64;

use super::codec;

/// How one tensor goes in a bucket.
#[derive(Debug)]
pub(crate) enum Plan {
    /// Whole, and the receiver keeps it under `tag`; `compared` elements were diffed first
    /// (before the delta was found not to pay), `changed` of them differed.
    Whole {
        tag: u64,
        compared: u64,
        changed: u64,
    },
    /// Whole and not kept by anyone (no tag): the tensor changed nearly everywhere lately, so
    /// holding a base of it (and summing it on every engine) would not pay for a while.
    Plain { compared: u64, changed: u64 },
    /// As a delta against the receiver's base `base_tag`; the result's checksum (its new tag).
    Delta {
        base_tag: u64,
        result: u64,
        bytes: Vec<u8>,
        changed: u64,
    },
}

/// The sender's copy of one tensor: its own buffer, updated in place by each delta, or the
/// caller's buffer kept as it was sent (no copy; [`Bytes`] cannot change under it).
enum Stored {
    Own(Vec<u8>),
    Shared(Bytes),
}

impl Stored {
    fn bytes(&self) -> &[u8] {
        match self {
            Stored::Own(v) => v,
            Stored::Shared(b) => b,
        }
    }

    /// Becomes `new`: the caller's buffer when it lends one, else a copy in the buffer held.
    fn replace(&mut self, new: &[u8], shared: Option<&Bytes>) {
        match (shared, &mut *self) {
            (Some(b), _) => *self = Stored::Shared(b.clone()),
            (None, Stored::Own(v)) if v.len() == new.len() => v.copy_from_slice(new),
            (None, _) => *self = Stored::Own(new.to_vec()),
        }
    }

    /// Whether it holds exactly `new` (the same buffer, or equal bytes).
    fn holds(&self, new: &[u8], shared: Option<&Bytes>) -> bool {
        match (self, shared) {
            (Stored::Shared(b), Some(s)) if b.as_ptr() == s.as_ptr() && b.len() == s.len() => true,
            _ => self.bytes() == new,
        }
    }
}

struct SenderBase {
    /// Bytes per element (1, 2 or 4: FP8, BF16, F32 on the wire).
    elem: usize,
    shape: Vec<usize>,
    bytes: Stored,
    tag: u64,
}

/// The sender's copy of every tensor it last sent (one wire-format copy of the model: BF16, or
/// FP8 bytes plus scales), kept across groups so a rebuilt group still sends deltas to engines
/// that kept theirs.
pub struct SenderBases {
    tensors: HashMap<String, SenderBase>,
    /// Tensors whose last delta did not pay: `(updates still to send plain, times in a row)`.
    /// A tensor that keeps changing everywhere is tried again after 1, 2, 4, then every 8
    /// updates.
    dense: HashMap<String, (u32, u32)>,
    digest: u64,
    compress: bool,
    seed: u64,
    next: u64,
}

impl std::fmt::Debug for SenderBases {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SenderBases")
            .field("tensors", &self.tensors.len())
            .field("bytes", &self.bytes())
            .field("compress", &self.compress)
            .finish()
    }
}

fn mix(name: &str, tag: u64) -> u64 {
    xxh3_64(name.as_bytes()) ^ tag.rotate_left(29).wrapping_mul(0x9E37_79B9_7F4A_7C15)
}

impl SenderBases {
    /// Empty bases; `compress` lets dense blocks go XOR + zstd ([`super::DeltaMode::Compress`]).
    pub fn new(compress: bool) -> Self {
        let mut h = std::collections::hash_map::RandomState::new().build_hasher();
        h.write_u64(std::process::id().into());
        SenderBases {
            tensors: HashMap::new(),
            dense: HashMap::new(),
            digest: 0,
            compress,
            seed: h.finish(),
            next: 0,
        }
    }

    /// Summary of every `(name, tag)` held: equal digests mean equal bases.
    pub fn digest(&self) -> u64 {
        self.digest
    }

    /// Bytes held (the memory cost of delta updates on the sender; buffers lent with
    /// `send_bucket_shared` are counted, though the caller may hold them too).
    pub fn bytes(&self) -> u64 {
        self.tensors
            .values()
            .map(|b| b.bytes.bytes().len() as u64)
            .sum()
    }

    /// The tag a tensor is held under.
    pub(crate) fn tag(&self, name: &str) -> Option<u64> {
        self.tensors.get(name).map(|b| b.tag)
    }

    fn fresh_tag(&mut self) -> u64 {
        self.next += 1;
        xxh3_64(&[self.seed.to_le_bytes(), self.next.to_le_bytes()].concat())
    }

    fn set_tag(&mut self, name: &str, tag: u64) {
        if let Some(b) = self.tensors.get_mut(name) {
            self.digest ^= mix(name, b.tag);
            b.tag = tag;
            self.digest ^= mix(name, tag);
        }
    }

    /// Decides how tensor `name` (`shape`, `elem`-byte elements, these `bytes`) goes, and
    /// makes its base equal to `bytes`: a delta when `eligible` (every receiver holds this
    /// sender's base of it) and it pays; whole otherwise. When the caller lends the buffer
    /// (`shared`, the same bytes), it becomes the base as it is: the diff then only reads.
    pub(crate) fn plan(
        &mut self,
        name: &str,
        shape: &[usize],
        elem: usize,
        bytes: &[u8],
        shared: Option<&Bytes>,
        eligible: bool,
    ) -> Plan {
        let compress = self.compress;
        if let Some(b) = self.tensors.get_mut(name)
            && b.elem == elem
            && b.shape == shape
            && b.bytes.bytes().len() == bytes.len()
        {
            let base_tag = b.tag;
            let enc = match (&mut b.bytes, shared) {
                (_, _) if !eligible => Err(codec::Dense::default()),
                (Stored::Own(v), None) => codec::encode(v, bytes, elem, compress),
                (held, _) => codec::encode_against(held.bytes(), bytes, elem, compress),
            };
            let updated_in_place = shared.is_none() && matches!(b.bytes, Stored::Own(_));
            match enc {
                Ok(e) => {
                    self.dense.remove(name);
                    if !updated_in_place {
                        b.bytes.replace(bytes, shared);
                    }
                    self.set_tag(name, e.checksum);
                    return Plan::Delta {
                        base_tag,
                        result: e.checksum,
                        bytes: e.bytes,
                        changed: e.changed,
                    };
                }
                // A tensor resent unchanged (a catch-up, a repeated version) keeps its tag, so
                // engines that were not in this group still match the sender afterwards.
                Err(_) if !eligible && b.bytes.holds(bytes, shared) => {
                    if shared.is_some() {
                        b.bytes.replace(bytes, shared);
                    }
                    return Plan::Whole {
                        tag: base_tag,
                        compared: 0,
                        changed: 0,
                    };
                }
                Err(d) if !eligible => {
                    b.bytes.replace(bytes, shared);
                    let tag = self.fresh_tag();
                    self.set_tag(name, tag);
                    return Plan::Whole {
                        tag,
                        compared: d.compared,
                        changed: d.changed,
                    };
                }
                // Changed nearly everywhere: sent plain, and no base is kept for a while.
                Err(d) => {
                    self.forget(name);
                    let streak = self.dense.get(name).map_or(0, |e| e.1) + 1;
                    let wait = 1u32 << (streak - 1).min(3);
                    self.dense.insert(name.to_string(), (wait, streak));
                    return Plan::Plain {
                        compared: d.compared,
                        changed: d.changed,
                    };
                }
            }
        }
        if let Some(e) = self.dense.get_mut(name)
            && e.0 > 0
        {
            e.0 -= 1;
            return Plan::Plain {
                compared: 0,
                changed: 0,
            };
        }
        self.forget(name);
        let tag = self.fresh_tag();
        let stored = match shared {
            Some(b) => Stored::Shared(b.clone()),
            None => Stored::Own(bytes.to_vec()),
        };
        self.tensors.insert(
            name.to_string(),
            SenderBase {
                elem,
                shape: shape.to_vec(),
                bytes: stored,
                tag,
            },
        );
        self.digest ^= mix(name, tag);
        Plan::Whole {
            tag,
            compared: 0,
            changed: 0,
        }
    }

    /// Drops a tensor's base (its bucket failed: receivers may hold either version).
    pub(crate) fn forget(&mut self, name: &str) {
        if let Some(b) = self.tensors.remove(name) {
            self.digest ^= mix(name, b.tag);
        }
    }
}

/// One tensor a receiver holds: its bytes while the receiver has them, `None` while its engine
/// has them (between `recv_bucket` and `recycle`).
#[derive(Debug)]
struct Held {
    tag: u64,
    /// The checksum ([`super::sum`]) of these bytes, computed from them as they arrived and
    /// kept up to date by every delta applied since.
    sum: u64,
    bytes: Option<Vec<u8>>,
}

/// A receiver's bases: the buffers of the tensors it last received, under their tags. They are
/// the very buffers the engine gets and hands back with `WeightReceiver::recycle`, so keeping
/// them costs no copy; an engine that does not hand a tensor back gets it whole next time.
#[derive(Debug, Default)]
pub struct ReceiverBases {
    held: HashMap<String, Held>,
    digest: u64,
}

/// Bases shared by an engine's successive receivers (a group is rebuilt when the fleet
/// changes; the engine's weights are the same).
pub type SharedReceiverBases = Arc<Mutex<ReceiverBases>>;

impl ReceiverBases {
    /// Empty bases, shareable across groups.
    pub fn shared() -> SharedReceiverBases {
        Arc::new(Mutex::new(ReceiverBases::default()))
    }

    /// Summary of every `(name, tag)` held (what the sender's must equal).
    pub fn digest(&self) -> u64 {
        self.digest
    }

    /// Tensors held (lent out or not).
    pub fn len(&self) -> usize {
        self.held.len()
    }

    /// Whether nothing is held.
    pub fn is_empty(&self) -> bool {
        self.held.is_empty()
    }

    /// Bytes held right now (tensors lent to the engine excluded).
    pub fn bytes(&self) -> u64 {
        self.held
            .values()
            .filter_map(|h| h.bytes.as_ref())
            .map(|b| b.len() as u64)
            .sum()
    }

    /// Takes the base of `name` and its checksum to apply a delta to, if it is held under
    /// `tag` with `len` bytes; the entry is gone until [`lend`](Self::lend) records the result.
    pub(crate) fn take(&mut self, name: &str, tag: u64, len: usize) -> Option<(Vec<u8>, u64)> {
        let h = self.held.get(name)?;
        if h.tag != tag || h.bytes.as_ref().is_none_or(|b| b.len() != len) {
            return None;
        }
        let sum = h.sum;
        let bytes = self.held.get_mut(name).and_then(|h| h.bytes.take());
        self.forget(name);
        bytes.map(|b| (b, sum))
    }

    /// Takes the buffer of `name`'s base whatever its tag, if it holds at least `len` bytes
    /// (the tensor is coming whole, so the base is replaced anyway).
    pub(crate) fn take_any(&mut self, name: &str, len: usize) -> Option<Vec<u8>> {
        let h = self.held.get_mut(name)?;
        if h.bytes.as_ref().is_none_or(|b| b.capacity() < len) {
            return None;
        }
        let bytes = h.bytes.take();
        self.forget(name);
        bytes
    }

    /// Records that the engine now has `name` under `tag`, its bytes summing to `sum`.
    pub(crate) fn lend(&mut self, name: &str, tag: u64, sum: u64) {
        self.forget(name);
        self.held.insert(
            name.to_string(),
            Held {
                tag,
                sum,
                bytes: None,
            },
        );
        self.digest ^= mix(name, tag);
    }

    /// Forgets `name` (its content is no longer known).
    pub(crate) fn forget(&mut self, name: &str) {
        if let Some(h) = self.held.remove(name) {
            self.digest ^= mix(name, h.tag);
        }
    }

    /// Takes back a tensor the engine is done with; returns it when it is not a base (the
    /// caller keeps it as a spare buffer).
    pub(crate) fn give_back(&mut self, name: &str, bytes: Vec<u8>) -> Option<Vec<u8>> {
        match self.held.get_mut(name) {
            Some(h) if h.bytes.is_none() => {
                h.bytes = Some(bytes);
                None
            }
            _ => Some(bytes),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn kind(p: &Plan) -> &'static str {
        match p {
            Plan::Whole { .. } => "whole",
            Plan::Plain { .. } => "plain",
            Plan::Delta { .. } => "delta",
        }
    }

    #[test]
    fn a_tensor_that_keeps_changing_everywhere_is_sent_plain_and_retried_less_often() {
        let mut b = SenderBases::new(false);
        let mut v = vec![0u8; 1 << 16];
        let mut seen = Vec::new();
        for step in 0..12u8 {
            v.iter_mut().for_each(|x| *x = x.wrapping_add(1));
            let p = b.plan("w", &[1 << 15], 2, &v, None, true);
            seen.push(kind(&p));
            if step == 0 {
                assert!(b.tag("w").is_some());
            }
        }
        // Kept whole at first, dense (plain) when tried, then tried again after 1, 2, 4 plain.
        assert_eq!(
            seen,
            [
                "whole", "plain", "plain", "whole", "plain", "plain", "plain", "whole", "plain",
                "plain", "plain", "plain"
            ]
        );
        assert_eq!(b.tag("w"), None, "no base is kept while it goes plain");
        // Once a delta pays again, the tensor is a regular delta.
        let mut b = SenderBases::new(false);
        let mut v = vec![0u8; 1 << 16];
        b.plan("w", &[1 << 15], 2, &v, None, true);
        v.iter_mut().for_each(|x| *x = x.wrapping_add(1));
        assert_eq!(kind(&b.plan("w", &[1 << 15], 2, &v, None, true)), "plain");
        assert_eq!(kind(&b.plan("w", &[1 << 15], 2, &v, None, true)), "plain");
        assert_eq!(kind(&b.plan("w", &[1 << 15], 2, &v, None, true)), "whole");
        v[10] ^= 1;
        assert_eq!(kind(&b.plan("w", &[1 << 15], 2, &v, None, true)), "delta");
        assert!(b.dense.is_empty());
    }
}
