//! The bootstrap listener (prefill side) and the KV fetch (decode side).

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::task::JoinHandle;

use super::KvHandoff;
use super::auth::{self, NONCE_LEN, Secret, Side, TAG_LEN};
use super::room::RoomStore;
use super::wire::{self, MAGIC, VERSION};
use crate::model::KvCache;

/// A running bootstrap listener.
#[derive(Debug)]
pub struct BootstrapServer {
    addr: SocketAddr,
    task: JoinHandle<()>,
    sweeper: JoinHandle<()>,
}

impl BootstrapServer {
    /// Serves rooms from `store` on `listener`; each fetch waits up to `wait` for its room.
    /// With `secret`, only decodes that prove they know it get KV ([`super::auth`]).
    pub fn spawn(
        listener: TcpListener,
        store: Arc<RoomStore>,
        wait: Duration,
        secret: Option<Secret>,
    ) -> std::io::Result<Self> {
        let addr = listener.local_addr()?;
        let sweep_store = store.clone();
        let sweeper = tokio::spawn(async move {
            let mut tick = tokio::time::interval(Duration::from_secs(1));
            loop {
                tick.tick().await;
                let dropped = sweep_store.sweep();
                if dropped > 0 {
                    tracing::warn!(
                        dropped,
                        "dropped KV rooms that no decode server fetched in time"
                    );
                }
            }
        });
        let task = tokio::spawn(async move {
            loop {
                let Ok((stream, peer)) = listener.accept().await else {
                    continue;
                };
                let (store, secret) = (store.clone(), secret.clone());
                tokio::spawn(async move {
                    if let Err(e) = serve_one(stream, store, wait, secret).await {
                        tracing::warn!(%peer, error = %e, "bootstrap connection failed");
                    }
                });
            }
        });
        Ok(Self {
            addr,
            task,
            sweeper,
        })
    }

    /// The bound address.
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }
}

impl Drop for BootstrapServer {
    fn drop(&mut self) {
        self.task.abort();
        self.sweeper.abort();
    }
}

async fn serve_one(
    mut stream: TcpStream,
    store: Arc<RoomStore>,
    wait: Duration,
    secret: Option<Secret>,
) -> std::io::Result<()> {
    stream.set_nodelay(true)?;
    let mut magic = [0u8; 4];
    stream.read_exact(&mut magic).await?;
    let version = stream.read_u8().await?;
    if &magic != MAGIC || version != VERSION {
        return wire::write_error(
            &mut stream,
            &format!("not a troupe KV bootstrap request (version {VERSION})"),
        )
        .await;
    }
    let room = stream.read_u64_le().await?;
    let mut theirs = [0u8; NONCE_LEN];
    stream.read_exact(&mut theirs).await?;
    if let Some(secret) = &secret {
        let mine = auth::nonce();
        let mut challenge = vec![wire::CHALLENGE];
        challenge.extend_from_slice(&mine);
        challenge.extend_from_slice(&secret.prove(Side::Prefill, &theirs, room));
        stream.write_all(&challenge).await?;
        let mut proof = [0u8; TAG_LEN];
        stream.read_exact(&mut proof).await?;
        if !secret.check(Side::Decode, &mine, room, &proof) {
            tracing::warn!(
                room,
                "KV fetch refused: the decode did not prove the bootstrap secret"
            );
            return wire::write_error(
                &mut stream,
                "handoff refused: the decode server is not of this prefill's deployment (bootstrap secret mismatch)",
            )
            .await;
        }
    }
    // Stop waiting if the decode side hangs up (it has its own timeout).
    let mut probe = [0u8; 1];
    let taken = tokio::select! {
        r = store.take(room, wait) => r,
        _ = stream.read(&mut probe) => return Ok(()),
    };
    let h = match taken {
        Ok(h) => h,
        Err(msg) => return wire::write_error(&mut stream, &msg).await,
    };
    wire::write_offer(&mut stream, h.cache.len, &h.weight_version).await?;
    let have = stream.read_u32_le().await? as usize;
    if have > h.cache.len {
        return wire::write_error(
            &mut stream,
            &format!(
                "the decode claims {have} cached positions of a {}-position prompt",
                h.cache.len
            ),
        )
        .await;
    }
    wire::write_handoff(&mut stream, &h, have).await
}

/// Answers the prefill's offer: takes what `local` already holds for this weight version and
/// KV length (an empty cache when nothing), says how much that is, reads the rest, and joins
/// them into the whole prompt's KV.
async fn take_offer<S, F>(stream: &mut S, local: F) -> Result<KvHandoff, String>
where
    S: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin,
    F: FnOnce(&str, usize) -> KvCache,
{
    let (kv_len, version) = wire::read_offer(stream).await?;
    let mut prefix = local(&version, kv_len);
    if prefix.len > kv_len {
        prefix = KvCache::default();
    }
    let have = prefix.len;
    stream
        .write_all(&(have as u32).to_le_bytes())
        .await
        .map_err(|e| format!("bootstrap connection failed: {e}"))?;
    let mut tail = wire::read_handoff(stream).await?;
    if tail.kv_start != have || have + tail.cache.len != kv_len {
        return Err(format!(
            "the prefill sent KV positions {}..{} of {kv_len}, not {have}..{kv_len}",
            tail.kv_start,
            tail.kv_start + tail.cache.len
        ));
    }
    if have > 0 {
        if prefix.layers.len() != tail.cache.layers.len() {
            return Err("prefill KV has a different number of layers".into());
        }
        for (p, t) in prefix.layers.iter_mut().zip(&mut tail.cache.layers) {
            p.k.append(&mut t.k);
            p.v.append(&mut t.v);
        }
        prefix.len = kv_len;
        tail.cache = prefix;
    }
    Ok(tail)
}

/// Fetches `room` from the prefill server's bootstrap listener at `host:port`, waiting at most
/// `timeout` overall (connect, the prefill finishing, and the transfer). When the room is
/// ready, `local(weight_version, kv_len)` gives the leading KV this side already holds (the
/// decode's prefix cache); only the rest is transferred, and the handoff carries the whole.
///
/// With `secret`, the prefill must prove it knows it before its KV is taken (and this side
/// proves it in turn); a prefill that does not is refused, so a request's `bootstrap_host`
/// cannot point a decode at another deployment.
pub async fn fetch_kv(
    host: &str,
    port: u16,
    room: u64,
    timeout: Duration,
    secret: Option<&Secret>,
    local: impl FnOnce(&str, usize) -> KvCache,
) -> Result<KvHandoff, String> {
    let addr = if host.contains(':') && !host.starts_with('[') {
        format!("[{host}]:{port}")
    } else {
        format!("{host}:{port}")
    };
    let fut = async {
        let mut stream = TcpStream::connect(&addr)
            .await
            .map_err(|e| format!("cannot reach prefill bootstrap at {addr}: {e}"))?;
        stream.set_nodelay(true).map_err(|e| e.to_string())?;
        let mine = auth::nonce();
        let mut req = Vec::with_capacity(13 + NONCE_LEN);
        req.extend_from_slice(MAGIC);
        req.push(VERSION);
        req.extend_from_slice(&room.to_le_bytes());
        req.extend_from_slice(&mine);
        let io = |e: std::io::Error| format!("bootstrap connection to {addr} failed: {e}");
        stream.write_all(&req).await.map_err(io)?;
        let mut status = stream.read_u8().await.map_err(io)?;
        match (status, secret) {
            (wire::CHALLENGE, Some(secret)) => {
                let mut theirs = [0u8; NONCE_LEN];
                stream.read_exact(&mut theirs).await.map_err(io)?;
                let mut proof = [0u8; TAG_LEN];
                stream.read_exact(&mut proof).await.map_err(io)?;
                if !secret.check(Side::Prefill, &mine, room, &proof) {
                    return Err(format!(
                        "the prefill at {addr} is not of this deployment (bootstrap secret mismatch); refusing its KV"
                    ));
                }
                let answer = secret.prove(Side::Decode, &theirs, room);
                stream.write_all(&answer).await.map_err(io)?;
                status = stream.read_u8().await.map_err(io)?;
            }
            (wire::CHALLENGE, None) => {
                return Err(format!(
                    "the prefill at {addr} requires a bootstrap secret this decode server was not given"
                ));
            }
            (_, Some(_)) => {
                return Err(format!(
                    "the prefill at {addr} did not prove this deployment's bootstrap secret; refusing its KV"
                ));
            }
            _ => {}
        }
        match status {
            wire::OFFER => take_offer(&mut stream, local).await,
            other => wire::read_handoff_after(other, &mut stream).await,
        }
    };
    match tokio::time::timeout(timeout, fut).await {
        Ok(r) => r,
        Err(_) => Err(format!(
            "KV for bootstrap_room {room} did not arrive from {addr} within {timeout:?}"
        )),
    }
}
