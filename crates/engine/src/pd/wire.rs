//! Byte format of a KV handoff on the bootstrap connection.
//!
//! Request (decode → prefill): `b"TRKV"`, `u8 version (=3)`, `u64 room`, 16-byte nonce.
//! With a deployment secret the prefill first answers status 2 + its 16-byte nonce + its
//! 32-byte proof, and the decode replies with its 32-byte proof ([`super::auth`]).
//! Once the room's KV is ready the prefill offers it: status 3 + `u32 kv_len` + `u32 len` +
//! UTF-8 weight version. The decode answers `u32 have`: how many leading positions it already
//! holds in its own prefix cache for that weight version (0 if none), so only the rest crosses
//! the wire. Then the response: `u8 status`; status 1 is followed by `u32 len` + UTF-8 error
//! (at any stage). Status 0 is followed by `u32 len` + a JSON header (`input_ids`,
//! `first_token`, `first_logprob`, `kv_start` (= have), `kv_len` (positions sent),
//! `num_layers`, `kv_dim`, `weight_version`, `cached_tokens`) and then, per layer, the keys
//! then the values of positions `kv_start..kv_start + kv_len` as little-endian f32.

use serde::{Deserialize, Serialize};
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};

use super::KvHandoff;
use crate::model::forward::{KvCache, LayerKv};

/// Request magic.
pub const MAGIC: &[u8; 4] = b"TRKV";
/// Protocol version.
pub const VERSION: u8 = 3;
/// Status of the prefill's authentication challenge.
pub const CHALLENGE: u8 = 2;
/// Status of the prefill's offer of a ready room.
pub const OFFER: u8 = 3;
const MAX_VERSION_LABEL: usize = 4096;
const MAX_HEADER: usize = 64 << 20;
const MAX_KV_FLOATS: usize = 1 << 32;
const MAX_LAYERS: usize = 1024;

#[derive(Debug, Serialize, Deserialize)]
struct Header {
    input_ids: Vec<u32>,
    first_token: u32,
    first_logprob: f32,
    #[serde(default)]
    kv_start: usize,
    kv_len: usize,
    num_layers: usize,
    kv_dim: usize,
    weight_version: String,
    #[serde(default)]
    cached_tokens: usize,
}

/// Offers a ready room: its KV length and weight version.
pub async fn write_offer<W: AsyncWrite + Unpin>(
    w: &mut W,
    kv_len: usize,
    version: &str,
) -> std::io::Result<()> {
    let mut buf = vec![OFFER];
    buf.extend_from_slice(&(kv_len as u32).to_le_bytes());
    buf.extend_from_slice(&(version.len() as u32).to_le_bytes());
    buf.extend_from_slice(version.as_bytes());
    w.write_all(&buf).await?;
    w.flush().await
}

/// Reads an offer whose status byte was already read: `(kv_len, weight_version)`.
pub async fn read_offer<R: AsyncRead + Unpin>(r: &mut R) -> Result<(usize, String), String> {
    let io = |e: std::io::Error| format!("bootstrap connection failed: {e}");
    let kv_len = r.read_u32_le().await.map_err(io)? as usize;
    let len = r.read_u32_le().await.map_err(io)? as usize;
    if len > MAX_VERSION_LABEL {
        return Err(format!("bootstrap offer with a {len}-byte weight version"));
    }
    let mut label = vec![0u8; len];
    r.read_exact(&mut label).await.map_err(io)?;
    Ok((kv_len, String::from_utf8_lossy(&label).into_owned()))
}

/// Writes a successful handoff, leaving out the first `from` KV positions (the decode holds
/// them already).
pub async fn write_handoff<W: AsyncWrite + Unpin>(
    w: &mut W,
    h: &KvHandoff,
    from: usize,
) -> std::io::Result<()> {
    let from = from.min(h.cache.len);
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
        kv_start: from,
        kv_len: h.cache.len - from,
        num_layers: h.cache.layers.len(),
        kv_dim,
        weight_version: h.weight_version.clone(),
        cached_tokens: h.cached_tokens,
    };
    let json = serde_json::to_vec(&header).map_err(std::io::Error::other)?;
    let mut buf = Vec::with_capacity(5 + json.len() + h.cache.bytes());
    buf.push(0);
    buf.extend_from_slice(&(json.len() as u32).to_le_bytes());
    buf.extend_from_slice(&json);
    for layer in &h.cache.layers {
        let (k, v) = (&layer.k[from * kv_dim..], &layer.v[from * kv_dim..]);
        for v in k.iter().chain(v) {
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

/// Reads a handoff (or the prefill's error message). Its cache holds only the positions sent,
/// `kv_start..`; [`KvHandoff::kv_start`] says where they begin.
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
        cached_tokens: h.cached_tokens,
        kv_start: h.kv_start,
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
            cache: cache.clone(),
            weight_version: "v1".into(),
            cached_tokens: 2,
            kv_start: 0,
        };
        let (mut a, mut b) = tokio::io::duplex(1 << 20);
        write_handoff(&mut a, &h, 0).await.unwrap();
        assert_eq!(read_handoff(&mut b).await.unwrap(), h);
        // Leaving out what the decode holds sends only the tail.
        write_handoff(&mut a, &h, 2).await.unwrap();
        let tail = read_handoff(&mut b).await.unwrap();
        assert_eq!((tail.kv_start, tail.cache.len), (2, 1));
        let d = c.kv_dim();
        assert_eq!(tail.cache.layers[0].k, cache.layers[0].k[2 * d..]);
        write_offer(&mut a, 3, "v1").await.unwrap();
        assert_eq!(b.read_u8().await.unwrap(), OFFER);
        assert_eq!(read_offer(&mut b).await.unwrap(), (3, "v1".to_string()));
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
