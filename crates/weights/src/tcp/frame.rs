//! Encoding of tensor frames and status replies shared by both ends.

use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};

use super::{FRAME_BUCKET_END, FRAME_TENSOR, MAX_NDIM, TcpError, TensorRef, TensorSpec, WireDtype};

/// Longest reason string accepted in a status or error message.
pub(crate) const MAX_MESSAGE: usize = 1 << 20;

pub(crate) fn expected_len(shape: &[usize], dtype: WireDtype) -> Option<usize> {
    shape
        .iter()
        .try_fold(dtype.elem_size(), |acc, &d| acc.checked_mul(d))
}

/// Bytes of a tensor frame's header (kind byte to `byte_len`, inclusive).
fn header_len(name: &str, ndim: usize) -> usize {
    1 + 2 + name.len() + 1 + 1 + 8 * ndim + 8
}

/// Bytes of the end-of-bucket frame.
pub(crate) const END_LEN: usize = 5;

/// Checks one tensor and encodes its frame header, so nothing is sent for a bucket holding an
/// inconsistent tensor.
pub(crate) fn encode_header(t: &TensorRef<'_>) -> Result<Vec<u8>, TcpError> {
    encode_header_with(t, FRAME_TENSOR, &[])
}

/// [`encode_header`] for a frame of `kind` whose header carries `extra` words after `byte_len`
/// (a tag; or a delta's base tag, result checksum and length).
pub(crate) fn encode_header_with(
    t: &TensorRef<'_>,
    kind: u8,
    extra: &[u64],
) -> Result<Vec<u8>, TcpError> {
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
    let mut buf = Vec::with_capacity(header_len(t.name, t.shape.len()) + 8 * extra.len());
    buf.push(kind);
    buf.extend_from_slice(&name_len.to_le_bytes());
    buf.extend_from_slice(t.name.as_bytes());
    buf.push(t.dtype.code());
    buf.push(ndim);
    for &d in t.shape {
        buf.extend_from_slice(&(d as u64).to_le_bytes());
    }
    buf.extend_from_slice(&(t.bytes.len() as u64).to_le_bytes());
    for w in extra {
        buf.extend_from_slice(&w.to_le_bytes());
    }
    Ok(buf)
}

/// The end-of-bucket frame for `count` tensors.
pub(crate) fn encode_end(count: usize) -> Result<[u8; END_LEN], TcpError> {
    let count = u32::try_from(count)
        .map_err(|_| TcpError::InvalidArgument("more than u32::MAX tensors".into()))?;
    let c = count.to_le_bytes();
    Ok([FRAME_BUCKET_END, c[0], c[1], c[2], c[3]])
}

/// Exact bytes a bucket holding `expected` occupies on a data link: the receiver reads exactly
/// this much, so it never reads into the next bucket.
pub(crate) fn bucket_len(expected: &[TensorSpec]) -> Result<u64, TcpError> {
    let mut total = END_LEN as u64;
    for s in expected {
        if s.name.len() > usize::from(u16::MAX) || s.shape.len() > usize::from(MAX_NDIM) {
            return Err(TcpError::InvalidArgument(format!(
                "tensor {}: name over 65535 bytes or more than 8 dimensions",
                s.name
            )));
        }
        let payload = expected_len(&s.shape, s.dtype).ok_or_else(|| {
            TcpError::InvalidArgument(format!("tensor {}: shape {:?} overflows", s.name, s.shape))
        })?;
        total = total
            .checked_add((header_len(&s.name, s.shape.len()) + payload) as u64)
            .ok_or_else(|| TcpError::InvalidArgument("bucket size overflows u64".into()))?;
    }
    Ok(total)
}

/// Reads a length-prefixed (`u32`) UTF-8 message, refusing absurd lengths.
pub(crate) async fn read_message<S: AsyncRead + Unpin>(stream: &mut S) -> Result<String, TcpError> {
    let len = stream.read_u32_le().await? as usize;
    if len > MAX_MESSAGE {
        return Err(TcpError::Protocol(format!("message of {len} bytes")));
    }
    let mut msg = vec![0u8; len];
    stream.read_exact(&mut msg).await?;
    Ok(String::from_utf8_lossy(&msg).into_owned())
}

/// Appends a length-prefixed (`u32`) message, truncated to [`MAX_MESSAGE`].
pub(crate) fn put_message(buf: &mut Vec<u8>, msg: &str) {
    let mut end = msg.len().min(MAX_MESSAGE);
    while !msg.is_char_boundary(end) {
        end -= 1;
    }
    buf.extend_from_slice(&(end as u32).to_le_bytes());
    buf.extend_from_slice(&msg.as_bytes()[..end]);
}

/// Reads a handshake reply: `Ok(Ok(()))` accepted, `Ok(Err(reason))` rejected.
pub(crate) async fn read_status<S: AsyncRead + Unpin>(
    stream: &mut S,
) -> Result<Result<(), String>, TcpError> {
    match stream.read_u8().await? {
        0 => Ok(Ok(())),
        1 => Ok(Err(read_message(stream).await?)),
        other => Err(TcpError::Protocol(format!("status byte {other}"))),
    }
}

/// Writes a handshake reply.
pub(crate) async fn write_status<S: AsyncWrite + Unpin>(
    stream: &mut S,
    result: Result<(), &str>,
) -> std::io::Result<()> {
    match result {
        Ok(()) => stream.write_all(&[0]).await,
        Err(msg) => {
            let mut buf = vec![1];
            put_message(&mut buf, msg);
            stream.write_all(&buf).await
        }
    }
}

/// Reads a `u16`-length-prefixed UTF-8 string (group names, addresses, tensor names).
pub(crate) async fn read_short_str<S: AsyncRead + Unpin>(
    stream: &mut S,
    what: &str,
) -> Result<String, TcpError> {
    let len = stream.read_u16_le().await? as usize;
    let mut buf = vec![0u8; len];
    stream.read_exact(&mut buf).await?;
    String::from_utf8(buf).map_err(|_| TcpError::Protocol(format!("{what} is not UTF-8")))
}

/// Appends a `u16`-length-prefixed string; the caller has checked the length.
pub(crate) fn put_short_str(buf: &mut Vec<u8>, s: &str) -> Result<(), TcpError> {
    let len = u16::try_from(s.len())
        .map_err(|_| TcpError::InvalidArgument(format!("string longer than 65535 bytes: {s}")))?;
    buf.extend_from_slice(&len.to_le_bytes());
    buf.extend_from_slice(s.as_bytes());
    Ok(())
}
