//! An engine's side: join a group, read buckets.

use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

use super::frame::{expected_len, read_status, write_status};
use super::{
    FRAME_BUCKET_END, FRAME_CLOSE, FRAME_TENSOR, MAGIC, MAX_NDIM, MAX_TENSOR_BYTES, OwnedTensor,
    TcpError, TensorSpec, VERSION, WireDtype,
};

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
