//! The `tcp` weight-update transport: rank 0 (the trainer) sends named tensors, every engine
//! receives the same tensors in the same order.
//!
//! This is the reference engine's stand-in for an NCCL broadcast group. The shape of the API
//! mirrors SGLang's: engines *join* a group named `group_name` of `world_size` ranks, where rank 0
//! is the sender and each engine covers `n_ranks` consecutive ranks starting at its
//! `rank_offset` (one per tensor-parallel GPU, so heterogeneous TP needs nothing special).
//!
//! # Wire format (all integers little-endian)
//!
//! Handshake, receiver → sender: `b"TRWU"`, `u16 version (=1)`, `u32 rank`, `u32 n_ranks`,
//! `u16 len` + group name bytes. Sender → receiver: `u8 status` (0 = accepted, 1 = rejected, then
//! `u32 len` + UTF-8 reason).
//!
//! Frames, sender → receiver, each starting with a `u8` kind:
//! - `1` tensor: `u16 len` + name, `u8 dtype` ([`WireDtype`]), `u8 ndim`, `ndim × u64` dims,
//!   `u64 byte_len`, then the raw bytes (row-major, little-endian elements).
//! - `2` end of bucket: `u32 tensor_count`. The receiver answers with `u8 status` (0 = ok,
//!   1 = error + `u32 len` + reason) so the sender knows every engine holds the bucket.
//! - `3` close: the group is being torn down.
//!
//! The frame kind byte and the handshake version leave room for a later pipelined chain
//! broadcast (a receiver forwarding frames to the next one) without changing the tensor frame.

mod frame;
mod receiver;
mod sender;
#[cfg(test)]
mod tests;

pub use receiver::WeightReceiver;
pub use sender::WeightSender;

pub(crate) const MAGIC: &[u8; 4] = b"TRWU";
pub(crate) const VERSION: u16 = 1;
pub(crate) const FRAME_TENSOR: u8 = 1;
pub(crate) const FRAME_BUCKET_END: u8 = 2;
pub(crate) const FRAME_CLOSE: u8 = 3;
/// Upper bound on one tensor's byte length, so a corrupt header cannot make a receiver allocate
/// without limit (64 GiB is far above any single projection matrix).
pub(crate) const MAX_TENSOR_BYTES: u64 = 64 << 30;
pub(crate) const MAX_NDIM: u8 = 8;

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

    fn code(self) -> u8 {
        match self {
            Self::Bf16 => 1,
            Self::F32 => 2,
            Self::F8E4M3 => 3,
        }
    }

    fn from_code(c: u8) -> Option<Self> {
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
    /// Raw little-endian element bytes.
    pub bytes: Vec<u8>,
}
