//! Encoding of tensor frames and status replies shared by both ends.

use bytes::{BufMut, Bytes, BytesMut};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

use super::{FRAME_BUCKET_END, FRAME_TENSOR, MAX_NDIM, TcpError, TensorRef, WireDtype};

pub(crate) fn expected_len(shape: &[usize], dtype: WireDtype) -> Option<usize> {
    shape
        .iter()
        .try_fold(dtype.elem_size(), |acc, &d| acc.checked_mul(d))
}

/// Encodes one bucket (tensor frames plus the end marker) into a single buffer, so it is built
/// once and written to every receiver.
pub(crate) fn encode_bucket(tensors: &[TensorRef<'_>]) -> Result<Bytes, TcpError> {
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

pub(crate) async fn read_status(stream: &mut TcpStream) -> Result<Result<(), String>, TcpError> {
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

pub(crate) async fn write_status(
    stream: &mut TcpStream,
    result: Result<(), &str>,
) -> std::io::Result<()> {
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
