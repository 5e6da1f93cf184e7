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
    /// As a delta against the receiver's base `base_tag`; the result's checksum (its new tag).
    Delta {
        base_tag: u64,
        result: u64,
        bytes: Vec<u8>,
        changed: u64,
    },
}

struct SenderBase {
    /// Bytes per element (1, 2 or 4: FP8, BF16, F32 on the wire).
    elem: usize,
    shape: Vec<usize>,
    bytes: Vec<u8>,
    tag: u64,
}

/// The sender's copy of every tensor it last sent (one wire-format copy of the model: BF16, or
/// FP8 bytes plus scales), kept across groups so a rebuilt group still sends deltas to engines
/// that kept theirs.
pub struct SenderBases {
    tensors: HashMap<String, SenderBase>,
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

    /// Bytes held (the memory cost of delta updates on the sender).
    pub fn bytes(&self) -> u64 {
        self.tensors.values().map(|b| b.bytes.len() as u64).sum()
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
    /// sender's base of it) and it pays; whole otherwise.
    pub(crate) fn plan(
        &mut self,
        name: &str,
        shape: &[usize],
        elem: usize,
        bytes: &[u8],
        eligible: bool,
    ) -> Plan {
        let compress = self.compress;
        if let Some(b) = self.tensors.get_mut(name)
            && b.elem == elem
            && b.shape == shape
            && b.bytes.len() == bytes.len()
        {
            let base_tag = b.tag;
            let enc = if eligible {
                codec::encode(&mut b.bytes, bytes, elem, compress)
            } else {
                Err(codec::Dense::default())
            };
            match enc {
                Ok(e) => {
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
                Err(_) if !eligible && b.bytes[..] == bytes[..] => {
                    return Plan::Whole {
                        tag: base_tag,
                        compared: 0,
                        changed: 0,
                    };
                }
                Err(d) => {
                    b.bytes.copy_from_slice(bytes);
                    let tag = self.fresh_tag();
                    self.set_tag(name, tag);
                    return Plan::Whole {
                        tag,
                        compared: d.compared,
                        changed: d.changed,
                    };
                }
            }
        }
        self.forget(name);
        let tag = self.fresh_tag();
        self.tensors.insert(
            name.to_string(),
            SenderBase {
                elem,
                shape: shape.to_vec(),
                bytes: bytes.to_vec(),
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

    /// Takes the base of `name` to apply a delta to, if it is held under `tag` with `len`
    /// bytes; the entry is gone until [`lend`](Self::lend) records the result.
    pub(crate) fn take(&mut self, name: &str, tag: u64, len: usize) -> Option<Vec<u8>> {
        let h = self.held.get(name)?;
        if h.tag != tag || h.bytes.as_ref().is_none_or(|b| b.len() != len) {
            return None;
        }
        let bytes = self.held.get_mut(name).and_then(|h| h.bytes.take());
        self.forget(name);
        bytes
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

    /// Records that the engine now has `name` under `tag`.
    pub(crate) fn lend(&mut self, name: &str, tag: u64) {
        self.forget(name);
        self.held
            .insert(name.to_string(), Held { tag, bytes: None });
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
