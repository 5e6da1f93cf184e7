//! The bootstrap listener (prefill side) and the KV fetch (decode side).

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use tokio::io::AsyncReadExt;
use tokio::net::{TcpListener, TcpStream};
use tokio::task::JoinHandle;

use super::KvHandoff;
use super::room::RoomStore;
use super::wire::{self, MAGIC, VERSION};

/// A running bootstrap listener.
#[derive(Debug)]
pub struct BootstrapServer {
    addr: SocketAddr,
    task: JoinHandle<()>,
    sweeper: JoinHandle<()>,
}

impl BootstrapServer {
    /// Serves rooms from `store` on `listener`; each fetch waits up to `wait` for its room.
    pub fn spawn(
        listener: TcpListener,
        store: Arc<RoomStore>,
        wait: Duration,
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
                let store = store.clone();
                tokio::spawn(async move {
                    if let Err(e) = serve_one(stream, store, wait).await {
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
) -> std::io::Result<()> {
    stream.set_nodelay(true)?;
    let mut magic = [0u8; 4];
    stream.read_exact(&mut magic).await?;
    let version = stream.read_u8().await?;
    if &magic != MAGIC || version != VERSION {
        return wire::write_error(&mut stream, "not a troupe KV bootstrap request (version 1)")
            .await;
    }
    let room = stream.read_u64_le().await?;
    // Stop waiting if the decode side hangs up (it has its own timeout).
    let mut probe = [0u8; 1];
    let taken = tokio::select! {
        r = store.take(room, wait) => r,
        _ = stream.read(&mut probe) => return Ok(()),
    };
    match taken {
        Ok(h) => wire::write_handoff(&mut stream, &h).await,
        Err(msg) => wire::write_error(&mut stream, &msg).await,
    }
}

/// Fetches `room` from the prefill server's bootstrap listener at `host:port`, waiting at most
/// `timeout` overall (connect, the prefill finishing, and the transfer).
pub async fn fetch_kv(
    host: &str,
    port: u16,
    room: u64,
    timeout: Duration,
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
        let mut req = Vec::with_capacity(13);
        req.extend_from_slice(MAGIC);
        req.push(VERSION);
        req.extend_from_slice(&room.to_le_bytes());
        tokio::io::AsyncWriteExt::write_all(&mut stream, &req)
            .await
            .map_err(|e| format!("bootstrap write to {addr} failed: {e}"))?;
        wire::read_handoff(&mut stream).await
    };
    match tokio::time::timeout(timeout, fut).await {
        Ok(r) => r,
        Err(_) => Err(format!(
            "KV for bootstrap_room {room} did not arrive from {addr} within {timeout:?}"
        )),
    }
}
