//! The `tcp` weight-update transport: rank 0 (the trainer) sends named tensors, every engine
//! receives the same tensors in the same order, through a pipelined chain broadcast (and, for
//! engines on rank 0's own machine, a shared-memory ring).
//!
//! This is the reference engine's stand-in for an NCCL broadcast group. The shape of the API
//! mirrors SGLang's: engines *join* a group named `group_name` of `world_size` ranks, where rank 0
//! is the sender and each engine covers `n_ranks` consecutive ranks starting at its
//! `rank_offset` (one per tensor-parallel GPU, so heterogeneous TP needs nothing special).
//!
//! # Topology: a chain, like NCCL's ring
//!
//! Sending every byte from rank 0 to each engine makes a sync take `receivers x size / bandwidth`.
//! Instead the engines form a chain in ascending `rank_offset` order, `0 -> r1 -> r2 -> ...`, and
//! each one forwards every chunk (up to [`CHUNK_BYTES`]) to its successor as soon as it has read
//! it, so a bucket takes about `size / bandwidth + hops x chunk / bandwidth`: nearly flat in the
//! number of engines. An engine with tensor parallelism `k` covers ranks
//! `rank_offset..rank_offset + k` but is **one** hop: its ranks live in one process, so only its
//! first rank is a chain member (the others are bookkeeping that keeps `world_size` and the
//! offsets identical to an NCCL group).
//!
//! # Engines on rank 0's machine: a shared-memory ring
//!
//! On one machine a chain still copies every byte through the kernel twice per engine. So an
//! engine whose control connection comes from rank 0's own address is offered a shared-memory
//! ring ([`shm`]): rank 0 writes each bucket once into it and every such engine copies it out
//! (9 copies for 8 engines instead of 16). Engines that map it are not chain members; the rest
//! (other machines, or any engine that could not map it) chain as above, beside the ring. Their
//! data link from rank 0 carries ring positions instead of bytes, so failures surface as on the
//! chain. `TROUPE_SHM_DISABLE=1` in rank 0's environment, or
//! [`WeightSender::set_shared_memory`]`(None)`, keeps every engine on the chain.
//!
//! Every engine also keeps a *control* connection to rank 0. That is how the chain is wired and
//! how failures are reported: rank 0 learns each engine's listening address in the handshake and,
//! once every rank has joined, tells each engine its predecessor's rank and its successor's
//! address. A bucket is committed only when every engine has confirmed it over its control
//! connection; any failure (a dead engine, a mismatched bucket, a broken link) is reported to rank
//! 0, which tells every engine which rank failed, and the group is then unusable (re-create it).
//!
//! # Wire format (all integers little-endian)
//!
//! Every join and every data link proves the group's secret ([`WeightSender::secret`], 32
//! random bytes per group, handed to engines by the admin-keyed init call): knowing rank 0's
//! port and the group name is not enough to take a rank. The secret never crosses these
//! sockets: each side answers a fresh 32-byte challenge with an HMAC-SHA256 keyed by it
//! (`tag(purpose; parts)` below: the purpose's label, then each part with its `u64` length).
//! Handshakes are read side by side, each with its own deadline (at most 64 at once, the
//! oldest dropped first), so a silent connection holds up no other and no deadline.
//!
//! Control connection (engine -> rank 0), handshake: `b"TRWU"`, `u16 version (=5)`; rank 0
//! answers `u8 0` + a 32-byte challenge (or a rejection, below); the engine sends `u32 rank`,
//! `u32 n_ranks`, `u16 len` + group name, `u16 len` + its data address (`ip:port`), `u64`
//! digest of the delta bases it holds (0: none), its own 32-byte nonce, and `tag(join;
//! challenge, those fields, its nonce)`. Reply: `u8 status` (0 = accepted, then `tag(admit;
//! engine nonce, challenge)`, which the engine checks; 1 = rejected, then `u32 len` + UTF-8
//! reason). A malformed, older or unauthenticated handshake is answered with a rejection
//! saying what was wrong and never takes a rank.
//!
//! Control messages, rank 0 -> engine: `14` ring offer (`u16 len` + path, 16-byte nonce, `u64`
//! ring bytes; only to engines on rank 0's machine, before the topology), `10` topology (`u32
//! predecessor rank`, `u8 has_successor` [, `u32 successor rank`, `u16 len` + address],
//! `u8 on_ring`), `11` group ready, `12` bucket committed, `13` failed (`u32 rank`, `u32
//! len` + reason), `15` repair (`u32 n`, `n x u32` tensor positions: a sub-bucket of those
//! tensors, whole and tagged, follows on the data link), `3` close. Engine -> rank 0: `23` ring
//! answer (`u8` 0 mapped, 1 not, then `u32 len` + why), `20` ready, `21` bucket received, `24`
//! bucket received but these deltas could not be applied (`u32 n`, `n x u32` positions), `22`
//! error (`u8` whose fault: 0 mine, 1 my predecessor's, 2 my successor's; `u32 rank`, `u32 len`
//! + reason).
//!
//! Data link (predecessor -> successor, rank 0 -> first engine): hello `b"TRWD"`, `u16 version`,
//! `u32 from rank`, `u32 to rank`, answered with a status byte as above and, when accepted, a
//! 32-byte challenge; the predecessor sends `tag(link; challenge, from, to)` and gets a final
//! status byte; then per bucket, frames each starting with a `u8` kind:
//! - `1` tensor: `u16 len` + name, `u8 dtype` ([`WireDtype`]), `u8 ndim`, `ndim x u64` dims,
//!   `u64 byte_len`, then the raw bytes (row-major, little-endian elements).
//! - `3` tagged tensor (delta on): as `1`, with a `u64 tag` after `byte_len`; the receiver keeps
//!   the tensor as a base under that tag.
//! - `4` delta (delta on): as `1` (`byte_len` is the tensor's), then `u64 base tag`, `u64`
//!   checksum of the result, `u64 len`, then `len` bytes of blocks ([`crate::delta::codec`]).
//! - `2` end of bucket: `u32 tensor_count`.
//!
//! A ring engine's data link carries `u64` absolute ring positions instead: rank 0 -> engine
//! "written up to", engine -> rank 0 "read up to"; the ring holds the frames above.
//!
//! Every frame says its own length, so data links carry nothing but bucket bytes: a receiver
//! reads frames until the end frame and never past it.

mod apply;
mod assemble;
mod auth;
mod collect;
mod control;
mod cpu;
mod frame;
mod join;
mod link;
pub(crate) mod pace;
mod pending;
mod receive_bucket;
mod receiver;
pub(crate) mod ring;
mod send_bucket;
mod send_stream;
mod sender;
pub mod shm;
mod tensor_bytes;
#[cfg(test)]
mod tests;
#[cfg(test)]
mod tests_auth;
#[cfg(test)]
mod tests_chain;
#[cfg(test)]
mod tests_delta;
#[cfg(test)]
mod tests_shm;

pub use receiver::WeightReceiver;
pub use sender::WeightSender;
pub use tensor_bytes::TensorBytes;

/// Checks that `secret` has the form of a group secret ([`WeightSender::secret`]: 64 hex
/// digits), so a caller can refuse a bad one before changing anything; the join itself is
/// what proves it is the right one.
pub fn check_secret(secret: &str) -> Result<(), TcpError> {
    auth::GroupSecret::parse(secret).map(|_| ())
}

pub(crate) const MAGIC: &[u8; 4] = b"TRWU";
pub(crate) const DATA_MAGIC: &[u8; 4] = b"TRWD";
pub(crate) const VERSION: u16 = 5;
pub(crate) const FRAME_TENSOR: u8 = 1;
pub(crate) const FRAME_BUCKET_END: u8 = 2;
/// A whole tensor the receiver keeps as the base of later deltas, under the tag that follows.
pub(crate) const FRAME_WHOLE_TAGGED: u8 = 3;
/// A tensor as a delta against the receiver's base ([`crate::delta`]).
pub(crate) const FRAME_DELTA: u8 = 4;
/// Upper bound on one tensor's byte length, so a corrupt header cannot make a receiver allocate
/// without limit (64 GiB is far above any single projection matrix).
pub(crate) const MAX_TENSOR_BYTES: u64 = 64 << 30;
pub(crate) const MAX_NDIM: u8 = 8;
/// Most bytes an engine reads before forwarding them to its successor. Small enough that the
/// pipeline fills quickly (8 hops add ~2 MiB of latency) and, likely, that a piece is still in
/// the core's cache when it is written on (on one machine, 8 receivers of 512 MiB: 0.67-0.69 s at
/// 256 KiB against 0.69-0.90 s at 1 MiB and 0.83-0.88 s at 64 KiB), large enough that
/// per-chunk overhead (one read, one write call) is negligible.
pub const CHUNK_BYTES: usize = 256 << 10;
/// How long rank 0 waits, by default, for every engine to confirm a bucket
/// ([`WeightSender::set_bucket_timeout`]).
pub const DEFAULT_BUCKET_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(300);

/// Everything that can go wrong moving weights over TCP.
#[derive(Debug, thiserror::Error)]
pub enum TcpError {
    /// The socket failed (connection refused, reset, closed early).
    #[error("weight transport I/O error: {0}")]
    Io(#[from] std::io::Error),
    /// The peer sent something that does not follow the wire format, or data that does not
    /// match what the receiver was told to expect.
    #[error("weight transport protocol error: {0}")]
    Protocol(String),
    /// A deadline passed (joining the group, or a bucket that never arrived).
    #[error("weight transport timed out: {0}")]
    Timeout(String),
    /// The other side refused: wrong group name, rank out of range, duplicate rank, bad bucket.
    #[error("weight transport rejected: {0}")]
    Rejected(String),
    /// A member of the group failed (died, refused the bucket, lost a link); every party reports
    /// the same rank, so the operator knows which engine to look at. The group is unusable
    /// afterwards: destroy it and create a new one.
    #[error("weight-update group failed at rank {rank}: {reason}")]
    RankFailed {
        /// The first rank of the engine that failed.
        rank: u32,
        /// What happened there.
        reason: String,
    },
    /// The caller passed something inconsistent (byte length that does not match the shape,
    /// world size of zero, ...). Nothing was sent.
    #[error("invalid weight transport argument: {0}")]
    InvalidArgument(String),
}

/// Element type of a tensor on the wire. FP8 travels as raw bytes so the block codec can be
/// layered on top without changing the transport.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum WireDtype {
    /// bfloat16, 2 bytes per element.
    Bf16,
    /// IEEE float32, 4 bytes per element.
    F32,
    /// float8 e4m3fn (OCP FP8), 1 byte per element.
    F8E4M3,
}

impl WireDtype {
    /// Parses the dtype spellings trainers send (`"bfloat16"`, `"torch.bfloat16"`, `"bf16"`,
    /// `"float32"`, `"float"`, `"f32"`, `"float8_e4m3fn"`, ...). Returns `None` for anything else.
    pub fn parse(s: &str) -> Option<Self> {
        let s = s.strip_prefix("torch.").unwrap_or(s);
        match s {
            "bfloat16" | "bf16" => Some(Self::Bf16),
            "float32" | "float" | "f32" | "fp32" => Some(Self::F32),
            "float8_e4m3fn" | "f8e4m3" | "fp8_e4m3" | "e4m3" => Some(Self::F8E4M3),
            _ => None,
        }
    }

    /// The canonical (PyTorch) name, as used in SGLang's `dtypes` lists.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Bf16 => "bfloat16",
            Self::F32 => "float32",
            Self::F8E4M3 => "float8_e4m3fn",
        }
    }

    /// Bytes per element.
    pub fn elem_size(self) -> usize {
        match self {
            Self::Bf16 => 2,
            Self::F32 => 4,
            Self::F8E4M3 => 1,
        }
    }

    pub(crate) fn code(self) -> u8 {
        match self {
            Self::Bf16 => 1,
            Self::F32 => 2,
            Self::F8E4M3 => 3,
        }
    }

    pub(crate) fn from_code(c: u8) -> Option<Self> {
        match c {
            1 => Some(Self::Bf16),
            2 => Some(Self::F32),
            3 => Some(Self::F8E4M3),
            _ => None,
        }
    }
}

/// A borrowed tensor handed to [`WeightSender::send_bucket`].
#[derive(Debug, Clone, Copy)]
pub struct TensorRef<'a> {
    /// Hugging Face parameter name, e.g. `model.layers.0.self_attn.q_proj.weight`.
    pub name: &'a str,
    /// Element type of `bytes`.
    pub dtype: WireDtype,
    /// Dimensions, row-major.
    pub shape: &'a [usize],
    /// Raw little-endian element bytes; length must be `product(shape) * dtype.elem_size()`.
    pub bytes: &'a [u8],
}

/// A tensor handed to [`WeightSender::send_bucket_shared`] in a buffer the sender may keep
/// (with deltas on, as the base of the tensor's next delta: no copy).
#[derive(Debug, Clone, Copy)]
pub struct SharedTensorRef<'a> {
    /// Hugging Face parameter name.
    pub name: &'a str,
    /// Element type of `bytes`.
    pub dtype: WireDtype,
    /// Dimensions, row-major.
    pub shape: &'a [usize],
    /// Raw little-endian element bytes; length must be `product(shape) * dtype.elem_size()`.
    pub bytes: &'a bytes::Bytes,
}

/// What a receiver is told to expect for one tensor (from `/update_weights_from_distributed`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TensorSpec {
    /// Parameter name.
    pub name: String,
    /// Element type.
    pub dtype: WireDtype,
    /// Dimensions.
    pub shape: Vec<usize>,
}

/// A tensor as received: owned bytes plus the header that described them.
#[derive(Debug, Clone, PartialEq)]
pub struct OwnedTensor {
    /// Parameter name.
    pub name: String,
    /// Element type of `bytes`.
    pub dtype: WireDtype,
    /// Dimensions.
    pub shape: Vec<usize>,
    /// Raw little-endian element bytes (read-only: see [`TensorBytes`]).
    pub bytes: TensorBytes,
}
