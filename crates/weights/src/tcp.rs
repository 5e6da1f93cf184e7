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

use std::net::SocketAddr;
use std::time::Duration;

use bytes::{BufMut, Bytes, BytesMut};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream, ToSocketAddrs};

const MAGIC: &[u8; 4] = b"TRWU";
const VERSION: u16 = 1;
const FRAME_TENSOR: u8 = 1;
const FRAME_BUCKET_END: u8 = 2;
const FRAME_CLOSE: u8 = 3;
/// Upper bound on one tensor's byte length, so a corrupt header cannot make a receiver allocate
/// without limit (64 GiB is far above any single projection matrix).
const MAX_TENSOR_BYTES: u64 = 64 << 30;
const MAX_NDIM: u8 = 8;

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

fn expected_len(shape: &[usize], dtype: WireDtype) -> Option<usize> {
    shape
        .iter()
        .try_fold(dtype.elem_size(), |acc, &d| acc.checked_mul(d))
}

/// Encodes one bucket (tensor frames plus the end marker) into a single buffer, so it is built
/// once and written to every receiver.
fn encode_bucket(tensors: &[TensorRef<'_>]) -> Result<Bytes, TcpError> {
    let total: usize = tensors
        .iter()
        .map(|t| t.bytes.len() + 64 + t.name.len())
        .sum();
    let mut buf = BytesMut::with_capacity(total + 8);
    for t in tensors {
        let want = expected_len(t.shape, t.dtype).ok_or_else(|| {
            TcpError::InvalidArgument(format!("tensor {}: shape {:?} overflows", t.name, t.shape))
        })?;
        if want != t.bytes.len() {
            return Err(TcpError::InvalidArgument(format!(
                "tensor {}: {} bytes given but shape {:?} of {} needs {}",
                t.name,
                t.bytes.len(),
                t.shape,
                t.dtype.as_str(),
                want
            )));
        }
        let name_len = u16::try_from(t.name.len()).map_err(|_| {
            TcpError::InvalidArgument(format!("tensor name longer than 65535 bytes: {}", t.name))
        })?;
        let ndim = u8::try_from(t.shape.len())
            .ok()
            .filter(|&n| n <= MAX_NDIM)
            .ok_or_else(|| {
                TcpError::InvalidArgument(format!("tensor {}: more than 8 dimensions", t.name))
            })?;
        buf.put_u8(FRAME_TENSOR);
        buf.put_u16_le(name_len);
        buf.put_slice(t.name.as_bytes());
        buf.put_u8(t.dtype.code());
        buf.put_u8(ndim);
        for &d in t.shape {
            buf.put_u64_le(d as u64);
        }
        buf.put_u64_le(t.bytes.len() as u64);
        buf.put_slice(t.bytes);
    }
    buf.put_u8(FRAME_BUCKET_END);
    let count = u32::try_from(tensors.len())
        .map_err(|_| TcpError::InvalidArgument("more than u32::MAX tensors".into()))?;
    buf.put_u32_le(count);
    Ok(buf.freeze())
}

async fn read_status(stream: &mut TcpStream) -> Result<Result<(), String>, TcpError> {
    let status = stream.read_u8().await?;
    if status == 0 {
        return Ok(Ok(()));
    }
    let len = stream.read_u32_le().await? as usize;
    if len > 1 << 20 {
        return Err(TcpError::Protocol(format!("status message of {len} bytes")));
    }
    let mut msg = vec![0u8; len];
    stream.read_exact(&mut msg).await?;
    Ok(Err(String::from_utf8_lossy(&msg).into_owned()))
}

async fn write_status(stream: &mut TcpStream, result: Result<(), &str>) -> std::io::Result<()> {
    match result {
        Ok(()) => stream.write_all(&[0]).await,
        Err(msg) => {
            let mut buf = Vec::with_capacity(5 + msg.len());
            buf.push(1);
            buf.extend_from_slice(&(msg.len() as u32).to_le_bytes());
            buf.extend_from_slice(msg.as_bytes());
            stream.write_all(&buf).await
        }
    }
}

/// One connected receiver, as seen by the sender.
#[derive(Debug)]
struct Peer {
    rank: u32,
    n_ranks: u32,
    stream: TcpStream,
}

/// Rank 0 of a weight-update group: listens on `master_port`, accepts every engine, and sends
/// buckets of tensors to all of them.
#[derive(Debug)]
pub struct WeightSender {
    listener: TcpListener,
    world_size: u32,
    group_name: String,
    peers: Vec<Peer>,
}

impl WeightSender {
    /// Binds the listening socket for a group of `world_size` ranks (rank 0 included). Engines
    /// may connect as soon as this returns; call [`accept_all`](Self::accept_all) to admit them.
    pub async fn bind(
        addr: impl ToSocketAddrs,
        world_size: usize,
        group_name: &str,
    ) -> Result<Self, TcpError> {
        let world_size = u32::try_from(world_size)
            .ok()
            .filter(|&w| w >= 2)
            .ok_or_else(|| {
                TcpError::InvalidArgument(format!(
                    "world_size must be at least 2 (rank 0 plus one engine rank), got {world_size}"
                ))
            })?;
        if group_name.is_empty() {
            return Err(TcpError::InvalidArgument("group_name is empty".into()));
        }
        let listener = TcpListener::bind(addr).await?;
        Ok(Self {
            listener,
            world_size,
            group_name: group_name.to_string(),
            peers: Vec::new(),
        })
    }

    /// The address engines should be told as `master_address:master_port`.
    pub fn local_addr(&self) -> Result<SocketAddr, TcpError> {
        Ok(self.listener.local_addr()?)
    }

    /// The group name engines must present.
    pub fn group_name(&self) -> &str {
        &self.group_name
    }

    /// Ranks `(rank_offset, n_ranks)` of the receivers accepted so far, in accept order.
    pub fn receivers(&self) -> Vec<(u32, u32)> {
        self.peers.iter().map(|p| (p.rank, p.n_ranks)).collect()
    }

    /// Accepts receivers until ranks `1..world_size` are all covered, rejecting wrong group
    /// names, out-of-range and overlapping ranks (those connections get a reason and are
    /// dropped; the wait goes on). Fails with [`TcpError::Timeout`] if the deadline passes.
    pub async fn accept_all(&mut self, timeout: Duration) -> Result<(), TcpError> {
        let deadline = tokio::time::Instant::now() + timeout;
        let mut covered = vec![false; self.world_size as usize];
        covered[0] = true;
        for p in &self.peers {
            for r in p.rank..p.rank + p.n_ranks {
                covered[r as usize] = true;
            }
        }
        while covered.iter().any(|c| !c) {
            let accepted = tokio::time::timeout_at(deadline, self.listener.accept()).await;
            let (mut stream, _) = match accepted {
                Ok(r) => r?,
                Err(_) => {
                    let missing: Vec<usize> = covered
                        .iter()
                        .enumerate()
                        .filter(|(_, c)| !**c)
                        .map(|(i, _)| i)
                        .collect();
                    return Err(TcpError::Timeout(format!(
                        "group {}: ranks {missing:?} never joined",
                        self.group_name
                    )));
                }
            };
            stream.set_nodelay(true)?;
            let hello = tokio::time::timeout_at(deadline, read_hello(&mut stream)).await;
            let (rank, n_ranks, group) = match hello {
                Ok(Ok(h)) => h,
                Ok(Err(e)) => {
                    tracing::warn!(error = %e, "dropping weight receiver with a bad handshake");
                    continue;
                }
                Err(_) => continue,
            };
            let verdict = self.check_join(rank, n_ranks, &group, &covered);
            match verdict {
                Ok(()) => {
                    write_status(&mut stream, Ok(())).await?;
                    for r in rank..rank + n_ranks {
                        covered[r as usize] = true;
                    }
                    self.peers.push(Peer {
                        rank,
                        n_ranks,
                        stream,
                    });
                }
                Err(reason) => {
                    tracing::warn!(%reason, "rejecting weight receiver");
                    let _ = write_status(&mut stream, Err(&reason)).await;
                }
            }
        }
        Ok(())
    }

    fn check_join(
        &self,
        rank: u32,
        n_ranks: u32,
        group: &str,
        covered: &[bool],
    ) -> Result<(), String> {
        if group != self.group_name {
            return Err(format!(
                "group name {group:?} does not match this group {:?}",
                self.group_name
            ));
        }
        let end = rank.saturating_add(n_ranks);
        if rank == 0 || n_ranks == 0 || end > self.world_size {
            return Err(format!(
                "ranks {rank}..{end} are outside 1..{} (world_size {})",
                self.world_size, self.world_size
            ));
        }
        if (rank..end).any(|r| covered[r as usize]) {
            return Err(format!("ranks {rank}..{end} overlap ranks already joined"));
        }
        Ok(())
    }

    /// Sends these tensors, in this order, to every receiver concurrently, and waits until each
    /// one confirms it read the whole bucket. The bucket is encoded once.
    pub async fn send_bucket(&mut self, tensors: &[TensorRef<'_>]) -> Result<(), TcpError> {
        if self.peers.is_empty() {
            return Err(TcpError::InvalidArgument(
                "no receivers: call accept_all first".into(),
            ));
        }
        let payload = encode_bucket(tensors)?;
        let peers = std::mem::take(&mut self.peers);
        let mut tasks = tokio::task::JoinSet::new();
        for (idx, mut peer) in peers.into_iter().enumerate() {
            let payload = payload.clone();
            tasks.spawn(async move {
                let res = async {
                    peer.stream.write_all(&payload).await?;
                    peer.stream.flush().await?;
                    read_status(&mut peer.stream).await
                }
                .await;
                (idx, peer, res)
            });
        }
        let mut back = Vec::new();
        let mut first_err = None;
        while let Some(joined) = tasks.join_next().await {
            let (idx, peer, res) =
                joined.map_err(|e| TcpError::Protocol(format!("sender task failed: {e}")))?;
            match res {
                Ok(Ok(())) => back.push((idx, peer)),
                Ok(Err(reason)) => {
                    first_err.get_or_insert(TcpError::Rejected(format!(
                        "rank {} refused the bucket: {reason}",
                        peer.rank
                    )));
                }
                Err(e) => {
                    first_err.get_or_insert(e);
                }
            }
        }
        back.sort_by_key(|(i, _)| *i);
        self.peers = back.into_iter().map(|(_, p)| p).collect();
        match first_err {
            Some(e) => Err(e),
            None => Ok(()),
        }
    }

    /// Tells every receiver the group is closing and drops the connections.
    pub async fn close(mut self) -> Result<(), TcpError> {
        for p in &mut self.peers {
            let _ = p.stream.write_all(&[FRAME_CLOSE]).await;
            let _ = p.stream.shutdown().await;
        }
        Ok(())
    }
}

async fn read_hello(stream: &mut TcpStream) -> Result<(u32, u32, String), TcpError> {
    let mut magic = [0u8; 4];
    stream.read_exact(&mut magic).await?;
    if &magic != MAGIC {
        return Err(TcpError::Protocol("bad handshake magic".into()));
    }
    let version = stream.read_u16_le().await?;
    if version != VERSION {
        return Err(TcpError::Protocol(format!(
            "handshake version {version}, expected {VERSION}"
        )));
    }
    let rank = stream.read_u32_le().await?;
    let n_ranks = stream.read_u32_le().await?;
    let len = stream.read_u16_le().await? as usize;
    let mut name = vec![0u8; len];
    stream.read_exact(&mut name).await?;
    let name = String::from_utf8(name)
        .map_err(|_| TcpError::Protocol("group name is not UTF-8".into()))?;
    Ok((rank, n_ranks, name))
}

/// An engine's end of a weight-update group: one connection to rank 0 covering ranks
/// `rank..rank + n_ranks`.
#[derive(Debug)]
pub struct WeightReceiver {
    stream: TcpStream,
    rank: u32,
    n_ranks: u32,
    group_name: String,
}

impl WeightReceiver {
    /// Connects to rank 0 at `addr`, retrying refused connections until `timeout` (the trainer
    /// may bind a moment after telling engines to join), then performs the handshake.
    pub async fn connect(
        addr: &str,
        group_name: &str,
        rank: u32,
        n_ranks: u32,
        timeout: Duration,
    ) -> Result<Self, TcpError> {
        let deadline = tokio::time::Instant::now() + timeout;
        let mut stream = loop {
            match tokio::time::timeout_at(deadline, TcpStream::connect(addr)).await {
                Ok(Ok(s)) => break s,
                Ok(Err(e)) if tokio::time::Instant::now() < deadline => {
                    tracing::debug!(error = %e, addr, "weight sender not reachable yet");
                    tokio::time::sleep(Duration::from_millis(50)).await;
                }
                Ok(Err(e)) => return Err(TcpError::Io(e)),
                Err(_) => {
                    return Err(TcpError::Timeout(format!(
                        "could not reach weight sender at {addr}"
                    )));
                }
            }
        };
        stream.set_nodelay(true)?;
        let name_len = u16::try_from(group_name.len())
            .map_err(|_| TcpError::InvalidArgument("group name too long".into()))?;
        let mut hello = Vec::with_capacity(16 + group_name.len());
        hello.extend_from_slice(MAGIC);
        hello.extend_from_slice(&VERSION.to_le_bytes());
        hello.extend_from_slice(&rank.to_le_bytes());
        hello.extend_from_slice(&n_ranks.to_le_bytes());
        hello.extend_from_slice(&name_len.to_le_bytes());
        hello.extend_from_slice(group_name.as_bytes());
        stream.write_all(&hello).await?;
        match tokio::time::timeout_at(deadline, read_status(&mut stream)).await {
            Ok(Ok(Ok(()))) => {}
            Ok(Ok(Err(reason))) => return Err(TcpError::Rejected(reason)),
            Ok(Err(e)) => return Err(e),
            Err(_) => {
                return Err(TcpError::Timeout(format!(
                    "weight sender at {addr} accepted the connection but never admitted rank {rank}"
                )));
            }
        }
        Ok(Self {
            stream,
            rank,
            n_ranks,
            group_name: group_name.to_string(),
        })
    }

    /// First rank this receiver covers.
    pub fn rank(&self) -> u32 {
        self.rank
    }

    /// Number of ranks this receiver covers.
    pub fn n_ranks(&self) -> u32 {
        self.n_ranks
    }

    /// Name of the group joined.
    pub fn group_name(&self) -> &str {
        &self.group_name
    }

    /// Reads one bucket and checks that it holds exactly `expected`, in order (name, dtype and
    /// shape). On success the sender is told the bucket arrived; on a mismatch it is told why and
    /// the error is returned (the caller should then drop this receiver: the stream position is
    /// no longer trustworthy).
    pub async fn recv_bucket(
        &mut self,
        expected: &[TensorSpec],
        timeout: Duration,
    ) -> Result<Vec<OwnedTensor>, TcpError> {
        let res = tokio::time::timeout(timeout, self.read_bucket(expected)).await;
        let res = match res {
            Ok(r) => r,
            Err(_) => {
                return Err(TcpError::Timeout(format!(
                    "bucket of {} tensors did not arrive in {timeout:?}",
                    expected.len()
                )));
            }
        };
        match &res {
            Ok(_) => write_status(&mut self.stream, Ok(())).await?,
            Err(TcpError::Protocol(msg)) => {
                let _ = write_status(&mut self.stream, Err(msg)).await;
            }
            Err(_) => {}
        }
        res
    }

    async fn read_bucket(&mut self, expected: &[TensorSpec]) -> Result<Vec<OwnedTensor>, TcpError> {
        let mut out = Vec::with_capacity(expected.len());
        loop {
            let kind = self.stream.read_u8().await?;
            match kind {
                FRAME_TENSOR => {
                    let idx = out.len();
                    let t = self.read_tensor(expected.get(idx), idx).await?;
                    out.push(t);
                }
                FRAME_BUCKET_END => {
                    let count = self.stream.read_u32_le().await? as usize;
                    if count != out.len() || count != expected.len() {
                        return Err(TcpError::Protocol(format!(
                            "bucket ended after {} tensors (sender counted {count}), expected {}",
                            out.len(),
                            expected.len()
                        )));
                    }
                    return Ok(out);
                }
                FRAME_CLOSE => {
                    return Err(TcpError::Rejected("sender closed the group".into()));
                }
                other => {
                    return Err(TcpError::Protocol(format!("unknown frame kind {other}")));
                }
            }
        }
    }

    /// Reads one tensor frame, checking its header against `spec` before reading (and
    /// allocating for) the payload.
    async fn read_tensor(
        &mut self,
        spec: Option<&TensorSpec>,
        idx: usize,
    ) -> Result<OwnedTensor, TcpError> {
        let s = &mut self.stream;
        let name_len = s.read_u16_le().await? as usize;
        let mut name = vec![0u8; name_len];
        s.read_exact(&mut name).await?;
        let name = String::from_utf8(name)
            .map_err(|_| TcpError::Protocol("tensor name not UTF-8".into()))?;
        let code = s.read_u8().await?;
        let dtype = WireDtype::from_code(code).ok_or_else(|| {
            TcpError::Protocol(format!("tensor {name}: unknown dtype code {code}"))
        })?;
        let ndim = s.read_u8().await?;
        if ndim > MAX_NDIM {
            return Err(TcpError::Protocol(format!(
                "tensor {name}: {ndim} dimensions"
            )));
        }
        let mut shape = Vec::with_capacity(ndim as usize);
        for _ in 0..ndim {
            let d = s.read_u64_le().await?;
            shape.push(usize::try_from(d).map_err(|_| {
                TcpError::Protocol(format!("tensor {name}: dimension {d} too large"))
            })?);
        }
        let byte_len = s.read_u64_le().await?;
        let want = expected_len(&shape, dtype).map(|w| w as u64);
        if byte_len > MAX_TENSOR_BYTES || want != Some(byte_len) {
            return Err(TcpError::Protocol(format!(
                "tensor {name}: {byte_len} bytes for shape {shape:?} of {}",
                dtype.as_str()
            )));
        }
        let Some(spec) = spec else {
            return Err(TcpError::Protocol(format!(
                "sender sent tensor {name} beyond the {idx} expected"
            )));
        };
        if spec.name != name || spec.dtype != dtype || spec.shape != shape {
            return Err(TcpError::Protocol(format!(
                "tensor #{idx}: expected {} {} {:?}, sender sent {name} {} {shape:?}",
                spec.name,
                spec.dtype.as_str(),
                spec.shape,
                dtype.as_str(),
            )));
        }
        let mut bytes = vec![0u8; byte_len as usize];
        s.read_exact(&mut bytes).await?;
        Ok(OwnedTensor {
            name,
            dtype,
            shape,
            bytes,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn spec(name: &str, dtype: WireDtype, shape: &[usize]) -> TensorSpec {
        TensorSpec {
            name: name.into(),
            dtype,
            shape: shape.to_vec(),
        }
    }

    async fn with_timeout<F: std::future::Future>(f: F) -> F::Output {
        tokio::time::timeout(Duration::from_secs(20), f)
            .await
            .expect("test timed out")
    }

    #[tokio::test]
    async fn two_receivers_get_identical_buckets_in_order() {
        with_timeout(async {
            let mut sender = WeightSender::bind("127.0.0.1:0", 4, "g").await.unwrap();
            let addr = sender.local_addr().unwrap().to_string();
            // Receiver A covers ranks 1..3 (TP 2), receiver B covers rank 3.
            let a = tokio::spawn({
                let addr = addr.clone();
                async move { WeightReceiver::connect(&addr, "g", 1, 2, Duration::from_secs(5)).await }
            });
            let b = tokio::spawn({
                let addr = addr.clone();
                async move { WeightReceiver::connect(&addr, "g", 3, 1, Duration::from_secs(5)).await }
            });
            sender.accept_all(Duration::from_secs(5)).await.unwrap();
            let mut a = a.await.unwrap().unwrap();
            let mut b = b.await.unwrap().unwrap();
            let mut rs = sender.receivers();
            rs.sort();
            assert_eq!(rs, vec![(1, 2), (3, 1)]);

            let w: Vec<u8> = (0..24u8).collect();
            let s: Vec<u8> = vec![7, 8];
            let fp8: Vec<u8> = vec![0x38, 0xb8, 0x00];
            let bucket = [
                TensorRef { name: "w", dtype: WireDtype::F32, shape: &[2, 3], bytes: &w },
                TensorRef { name: "s", dtype: WireDtype::Bf16, shape: &[1], bytes: &s },
                TensorRef { name: "q", dtype: WireDtype::F8E4M3, shape: &[3], bytes: &fp8 },
            ];
            let expected = vec![
                spec("w", WireDtype::F32, &[2, 3]),
                spec("s", WireDtype::Bf16, &[1]),
                spec("q", WireDtype::F8E4M3, &[3]),
            ];
            let ra = tokio::spawn(async move {
                let r = a.recv_bucket(&expected, Duration::from_secs(5)).await;
                (a, r)
            });
            let rb = tokio::spawn(async move {
                let exp = vec![
                    spec("w", WireDtype::F32, &[2, 3]),
                    spec("s", WireDtype::Bf16, &[1]),
                    spec("q", WireDtype::F8E4M3, &[3]),
                ];
                b.recv_bucket(&exp, Duration::from_secs(5)).await
            });
            sender.send_bucket(&bucket).await.unwrap();
            let (_a, got_a) = ra.await.unwrap();
            let got_a = got_a.unwrap();
            let got_b = rb.await.unwrap().unwrap();
            assert_eq!(got_a, got_b);
            assert_eq!(got_a[0].bytes, w);
            assert_eq!(got_a[1].bytes, s);
            assert_eq!(got_a[2].bytes, fp8);
            assert_eq!(got_a[2].dtype, WireDtype::F8E4M3);
        })
        .await;
    }

    #[tokio::test]
    async fn wrong_group_and_overlapping_ranks_are_rejected() {
        with_timeout(async {
            let mut sender = WeightSender::bind("127.0.0.1:0", 2, "right").await.unwrap();
            let addr = sender.local_addr().unwrap().to_string();
            let bad = tokio::spawn({
                let addr = addr.clone();
                async move {
                    WeightReceiver::connect(&addr, "wrong", 1, 1, Duration::from_secs(5)).await
                }
            });
            let accept = tokio::spawn(async move {
                let r = sender.accept_all(Duration::from_secs(5)).await;
                (sender, r)
            });
            let err = bad.await.unwrap().unwrap_err();
            assert!(
                matches!(err, TcpError::Rejected(ref m) if m.contains("wrong")),
                "{err}"
            );
            let out_of_range =
                WeightReceiver::connect(&addr, "right", 1, 5, Duration::from_secs(5)).await;
            assert!(matches!(out_of_range, Err(TcpError::Rejected(_))));
            let good = WeightReceiver::connect(&addr, "right", 1, 1, Duration::from_secs(5))
                .await
                .unwrap();
            let (_sender, r) = accept.await.unwrap();
            r.unwrap();
            assert_eq!(good.rank(), 1);
        })
        .await;
    }

    #[tokio::test]
    async fn mismatched_bucket_is_refused_on_both_sides() {
        with_timeout(async {
            let mut sender = WeightSender::bind("127.0.0.1:0", 2, "g").await.unwrap();
            let addr = sender.local_addr().unwrap().to_string();
            let rx = tokio::spawn(async move {
                WeightReceiver::connect(&addr, "g", 1, 1, Duration::from_secs(5)).await
            });
            sender.accept_all(Duration::from_secs(5)).await.unwrap();
            let mut rx = rx.await.unwrap().unwrap();
            let recv = tokio::spawn(async move {
                let exp = vec![spec("a", WireDtype::F32, &[2])];
                rx.recv_bucket(&exp, Duration::from_secs(5)).await
            });
            let bytes = [0u8; 8];
            let sent = sender
                .send_bucket(&[TensorRef {
                    name: "b",
                    dtype: WireDtype::F32,
                    shape: &[2],
                    bytes: &bytes,
                }])
                .await;
            assert!(matches!(sent, Err(TcpError::Rejected(_))), "{sent:?}");
            assert!(matches!(recv.await.unwrap(), Err(TcpError::Protocol(_))));
        })
        .await;
    }

    #[tokio::test]
    async fn bad_arguments_send_nothing() {
        with_timeout(async {
            assert!(matches!(
                WeightSender::bind("127.0.0.1:0", 1, "g").await,
                Err(TcpError::InvalidArgument(_))
            ));
            let bytes = [0u8; 3];
            let err = encode_bucket(&[TensorRef {
                name: "x",
                dtype: WireDtype::Bf16,
                shape: &[2],
                bytes: &bytes,
            }]);
            assert!(matches!(err, Err(TcpError::InvalidArgument(_))));
            let mut sender = WeightSender::bind("127.0.0.1:0", 2, "g").await.unwrap();
            let t = sender.accept_all(Duration::from_millis(100)).await;
            assert!(matches!(t, Err(TcpError::Timeout(_))));
        })
        .await;
    }

    #[test]
    fn dtype_spellings() {
        assert_eq!(WireDtype::parse("torch.bfloat16"), Some(WireDtype::Bf16));
        assert_eq!(WireDtype::parse("float32"), Some(WireDtype::F32));
        assert_eq!(WireDtype::parse("float8_e4m3fn"), Some(WireDtype::F8E4M3));
        assert_eq!(WireDtype::parse("int8"), None);
    }
}
