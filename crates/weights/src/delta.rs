//! Delta weight updates: only what changed since the version a receiver holds travels.
//!
//! With the small learning rates of RL post-training most BF16 (and FP8) values do not change
//! from one step to the next, so a sync that sends every byte mostly resends what the engines
//! already hold. Here each tensor of a bucket is sent, per [`codec::BLOCK_BYTES`] block, as
//! whichever is smallest of nothing (unchanged), sparse `(index, value)` pairs, the XOR with the
//! base compressed with zstd (only when [`DeltaMode::Compress`] asks for it: it pays only on
//! links slower than the codec), or the whole block; a tensor whose encoding is not clearly
//! smaller than itself goes whole. FP8 tensors are diffed after quantization, on the quantized
//! bytes and the scales, so the result is bit-identical to a full FP8 update.
//!
//! - [`codec`]: the block encoding and its decoder; `scan` finds what changed in a block.
//! - [`sum`]: the per-tensor checksum of the result, a sum over words that a receiver updates
//!   from the words a delta rewrites (no second pass over the model on every engine).
//! - [`bases`]: what the sender last sent ([`SenderBases`]: the caller's own buffers when it
//!   lends them with `send_bucket_shared`, else one wire-format copy of the weights) and what a
//!   receiver holds ([`ReceiverBases`], the buffers the engine hands back with
//!   `WeightReceiver::recycle`, read-only while lent, so no copy beyond the engine's own).
//!   A tensor whose delta did not pay is sent plain (no base kept, nothing summed) and retried
//!   after 1, 2, 4, then every 8 updates.
//!
//! The transport ([`crate::tcp`]) decides per tensor, keeps bases versioned by *tag* (the
//! checksum of a delta's result, or a fresh random tag for a tensor sent whole), and falls back
//! on its own: a receiver whose bases differ from the sender's (restarted, joined late,
//! re-placed, failed an update) gets tensors whole until it holds them; a delta whose base is
//! not the receiver's, or whose result fails its checksum, is resent whole at once, in the
//! same bucket (never applied silently).

pub mod bases;
pub mod codec;
mod scan;
pub mod sum;

pub use bases::{ReceiverBases, SenderBases, SharedReceiverBases};

/// Whether weight syncs send deltas (`weights.delta` in a deployment's YAML).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, serde::Serialize)]
#[serde(rename_all = "lowercase")]
pub enum DeltaMode {
    /// Deltas when some engine receives over the TCP chain (another machine), where bytes cost
    /// link time; a group whose engines all read rank 0's shared-memory ring gets every byte,
    /// because there a copy is faster than finding what changed.
    #[default]
    Auto,
    /// Deltas for every group, the ring's too: sparse pairs or whole blocks, no compressor.
    On,
    /// Every byte every time; nothing is kept on either side.
    Off,
    /// As `On`, and blocks too dense for sparse pairs are XORed with the base and
    /// zstd-compressed when that is smaller: for links slower than about 1 GB/s.
    Compress,
}

impl DeltaMode {
    /// Parses `auto`, `on`, `off` or `compress` (also `true` for on, `false` for off).
    pub fn parse(s: &str) -> Option<Self> {
        match s.trim().to_ascii_lowercase().as_str() {
            "auto" => Some(Self::Auto),
            "on" | "true" => Some(Self::On),
            "off" | "false" | "none" => Some(Self::Off),
            "compress" | "zstd" => Some(Self::Compress),
            _ => None,
        }
    }

    /// The spelling [`parse`](Self::parse) reads back.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Auto => "auto",
            Self::On => "on",
            Self::Off => "off",
            Self::Compress => "compress",
        }
    }

    /// Whether deltas may be sent at all (bases are kept).
    pub fn enabled(self) -> bool {
        self != Self::Off
    }

    /// Whether a group sends deltas, given whether every engine in it reads the ring.
    pub fn for_group(self, all_on_ring: bool) -> bool {
        match self {
            Self::Off => false,
            Self::Auto => !all_on_ring,
            Self::On | Self::Compress => true,
        }
    }
}

/// Read as [`DeltaMode::parse`] reads it (a YAML `on`/`off` that a loader took for a boolean
/// too), with an error naming the accepted values.
impl<'de> serde::Deserialize<'de> for DeltaMode {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        #[derive(serde::Deserialize)]
        #[serde(untagged)]
        enum Raw {
            Word(String),
            Flag(bool),
        }
        let s = match Raw::deserialize(d)? {
            Raw::Word(s) => s,
            Raw::Flag(b) => b.to_string(),
        };
        Self::parse(&s).ok_or_else(|| {
            serde::de::Error::custom(format!("delta mode {s:?}: use auto, on, off or compress"))
        })
    }
}

/// What some buckets sent: the bytes on a data link against the tensors' own size, and with
/// deltas on, what the encoding did (tensors as deltas, elements that had changed).
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct DeltaStats {
    /// Bytes of the tensors' full encoding (what a full update sends).
    pub full_bytes: u64,
    /// Bytes actually sent for them (frames included), repairs included.
    pub sent_bytes: u64,
    /// Tensors sent as deltas.
    pub delta_tensors: u64,
    /// Tensors sent whole (no base, not eligible, or too dense to pay).
    pub whole_tensors: u64,
    /// Elements compared against a base: all of a delta's, and the probed part of a tensor
    /// that went whole because its delta would not pay.
    pub compared_elems: u64,
    /// Of [`compared_elems`](Self::compared_elems), those that changed.
    pub changed_elems: u64,
    /// Tensors resent whole after a receiver could not apply their delta.
    pub repaired_tensors: u64,
}

impl DeltaStats {
    /// Adds `other` into `self`.
    pub fn add(&mut self, other: &DeltaStats) {
        self.full_bytes += other.full_bytes;
        self.sent_bytes += other.sent_bytes;
        self.delta_tensors += other.delta_tensors;
        self.whole_tensors += other.whole_tensors;
        self.compared_elems += other.compared_elems;
        self.changed_elems += other.changed_elems;
        self.repaired_tensors += other.repaired_tensors;
    }

    /// Fraction of compared elements that changed (`None` when nothing was compared).
    pub fn changed_fraction(&self) -> Option<f64> {
        (self.compared_elems > 0).then(|| self.changed_elems as f64 / self.compared_elems as f64)
    }
}
