//! Byte format of a KV handoff on the bootstrap connection.
//!
//! Request (decode → prefill): `b"TRKV"`, `u8 version (=2)`, `u64 room`, 16-byte nonce.
//! With a deployment secret the prefill first answers status 2 + its 16-byte nonce + its
//! 32-byte proof, and the decode replies with its 32-byte proof ([`super::auth`]).
//! Response: `u8 status`; status 1 is followed by `u32 len` + UTF-8 error. Status 0 is followed
//! by `u32 len` + a JSON header (`input_ids`, `first_token`, `first_logprob`, `kv_len`,
//! `num_layers`, `kv_dim`, `weight_version`) and then, per layer, the keys then the values as
//! little-endian f32 (`kv_len × kv_dim` each).

use serde::{Deserialize, Serialize};
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};

use super::KvHandoff;
use crate::model::forward::{KvCache, LayerKv};

/// Request magic.
pub const MAGIC: &[u8; 4] = b"TRKV";
/// Protocol version.
pub const VERSION: u8 = 2;
/// Status of the prefill's authentication challenge.
pub const CHALLENGE: u8 = 2;
const MAX_HEADER: usize = 64 << 20;
const MAX_KV_FLOATS: usize = 1 << 32;
const MAX_LAYERS: usize = 1024;

#[derive(Debug, Serialize, Deserialize)]
struct Header {
    input_ids: Vec<u32>,
    first_token: u32,
    first_logprob: f32,
    kv_len: usize,
    num_layers: usize,
    kv_dim: usize,
    weight_version: String,
}

/// Writes a successful handoff.
pub async fn write_handoff<W: AsyncWrite + Unpin>(w: &mut W, h: &KvHandoff) -> std::io::Result<()> {
    let kv_dim = if h.cache.len == 0 {
        0
    } else {
        h.cache
            .layers
            .first()
            .map_or(0, |l| l.k.len() / h.cache.len)
    };
    let header = Header {
        input_ids: h.input_ids.clone(),
        first_token: h.first_token,
        first_logprob: h.first_logprob,
        kv_len: h.cache.len,
        num_layers: h.cache.layers.len(),
        kv_dim,
        weight_version: h.weight_version.clone(),
    };
    let json = serde_json::to_vec(&header).map_err(std::io::Error::other)?;
    let mut buf = Vec::with_capacity(5 + json.len() + h.cache.bytes());
    buf.push(0);
    buf.extend_from_slice(&(json.len() as u32).to_le_bytes());
    buf.extend_from_slice(&json);
    for layer in &h.cache.layers {
        for v in layer.k.iter().chain(&layer.v) {
            buf.extend_from_slice(&v.to_le_bytes());
        }
    }
    w.write_all(&buf).await?;
    w.flush().await
}

/// Writes a failure.
pub async fn write_error<W: AsyncWrite + Unpin>(w: &mut W, msg: &str) -> std::io::Result<()> {
    let mut buf = vec![1u8];
    buf.extend_from_slice(&(msg.len() as u32).to_le_bytes());
    buf.extend_from_slice(msg.as_bytes());
    w.write_all(&buf).await?;
    w.flush().await
}

/// Reads a handoff (or the prefill's error message).
pub async fn read_handoff<R: AsyncRead + Unpin>(r: &mut R) -> Result<KvHandoff, String> {
    let status = r
        .read_u8()
        .await
        .map_err(|e| format!("bootstrap connection failed: {e}"))?;
    read_handoff_after(status, r).await
}

/// Reads the rest of a handoff whose status byte was already read.
pub async fn read_handoff_after<R: AsyncRead + Unpin>(
    status: u8,
    r: &mut R,
) -> Result<KvHandoff, String> {
    let io = |e: std::io::Error| format!("bootstrap connection failed: {e}");
    let len = r.read_u32_le().await.map_err(io)? as usize;
    if len > MAX_HEADER {
        return Err(format!("bootstrap header of {len} bytes"));
    }
    let mut body = vec![0u8; len];
    r.read_exact(&mut body).await.map_err(io)?;
    if status != 0 {
        return Err(format!(
            "prefill reported: {}",
            String::from_utf8_lossy(&body)
        ));
    }
    let h: Header =
        serde_json::from_slice(&body).map_err(|e| format!("bad bootstrap header: {e}"))?;
    if h.num_layers > MAX_LAYERS {
        return Err(format!("bootstrap header claims {} layers", h.num_layers));
    }
    let per = h
        .kv_len
        .checked_mul(h.kv_dim)
        .filter(|&n| n.saturating_mul(h.num_layers.saturating_mul(2)) <= MAX_KV_FLOATS);
    let Some(per) = per else {
        return Err("bootstrap KV too large".into());
    };
    let mut cache = KvCache {
        layers: Vec::with_capacity(h.num_layers),
        len: h.kv_len,
    };
    let mut raw = vec![0u8; per * 4];
    for _ in 0..h.num_layers {
        r.read_exact(&mut raw).await.map_err(io)?;
        let k = floats(&raw);
        r.read_exact(&mut raw).await.map_err(io)?;
        let v = floats(&raw);
        cache.layers.push(LayerKv { k, v });
    }
    Ok(KvHandoff {
        input_ids: h.input_ids,
        first_token: h.first_token,
        first_logprob: h.first_logprob,
        cache,
        weight_version: h.weight_version,
    })
}

fn floats(raw: &[u8]) -> Vec<f32> {
    raw.chunks_exact(4)
        .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::{ModelConfig, Weights, forward_token};

    #[tokio::test]
    async fn handoff_round_trips_and_errors_carry_the_message() {
        let c = ModelConfig::tiny();
        let w = Weights::init(&c, 1);
        let mut cache = KvCache::new(&c);
        for t in [5u32, 6, 7] {
            forward_token(&w, &mut cache, t, false);
        }
        let h = KvHandoff {
            input_ids: vec![5, 6, 7],
            first_token: 9,
            first_logprob: -1.25,
            cache,
            weight_version: "v1".into(),
        };
        let (mut a, mut b) = tokio::io::duplex(1 << 20);
        write_handoff(&mut a, &h).await.unwrap();
        assert_eq!(read_handoff(&mut b).await.unwrap(), h);
        write_error(&mut a, "room expired").await.unwrap();
        assert!(
            read_handoff(&mut b)
                .await
                .unwrap_err()
                .contains("room expired")
        );
        drop(a);
        assert!(
            read_handoff(&mut b).await.is_err(),
            "a closed connection is an error, not a hang"
        );
    }
}
