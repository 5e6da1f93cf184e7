//! Rank 0's side: accept receivers, send buckets.

use std::net::SocketAddr;
use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream, ToSocketAddrs};

use super::frame::{encode_bucket, read_status, write_status};
use super::{FRAME_CLOSE, MAGIC, TcpError, TensorRef, VERSION};

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
