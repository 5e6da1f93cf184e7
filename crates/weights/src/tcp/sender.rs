//! Rank 0's side: accept engines, wire them into a chain, send buckets down it, and decide
//! whether each bucket is committed or which rank failed.

use std::hash::{BuildHasher, Hasher};
use std::net::SocketAddr;
use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream, ToSocketAddrs};
use tokio::task::JoinSet;
use tokio::time::Instant;

use super::control::{Fault, FromEngine, ToEngine, Topology, read_from_engine, write_to_engine};
use super::frame::{encode_end, encode_header, read_short_str, write_status};
use super::link::connect_link;
use super::{DEFAULT_BUCKET_TIMEOUT, MAGIC, TcpError, TensorRef, VERSION};

/// Longest a single connection may take to send its handshake before it is dropped (so one
/// silent client cannot hold up the others).
const HELLO_TIMEOUT: Duration = Duration::from_secs(10);

/// One connected engine, as seen by rank 0.
#[derive(Debug)]
struct Peer {
    rank: u32,
    n_ranks: u32,
    data_addr: String,
    control: TcpStream,
}

/// What one engine said about a bucket (or the chain wiring).
#[derive(Debug)]
enum Outcome {
    Ok,
    Reported {
        fault: Fault,
        rank: u32,
        reason: String,
    },
    Lost(String),
    TimedOut,
}

/// Rank 0 of a weight-update group: listens on `master_port`, admits every engine, wires them
/// into a chain and sends buckets of tensors down it.
#[derive(Debug)]
pub struct WeightSender {
    listener: TcpListener,
    world_size: u32,
    group_name: String,
    token: u64,
    /// Engines in chain order (ascending rank) once wired; in accept order before.
    peers: Vec<Peer>,
    /// Data link to the first engine of the chain.
    data: Option<TcpStream>,
    /// Set by the first failure: `(rank, reason)`; the group is unusable afterwards.
    broken: Option<(u32, String)>,
    bucket_timeout: Duration,
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
        let mut h = std::collections::hash_map::RandomState::new().build_hasher();
        h.write(group_name.as_bytes());
        Ok(Self {
            listener,
            world_size,
            group_name: group_name.to_string(),
            token: h.finish(),
            peers: Vec::new(),
            data: None,
            broken: None,
            bucket_timeout: DEFAULT_BUCKET_TIMEOUT,
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

    /// Ranks `(rank_offset, n_ranks)` of the engines admitted so far: in chain order (ascending
    /// rank) once [`accept_all`](Self::accept_all) has succeeded.
    pub fn receivers(&self) -> Vec<(u32, u32)> {
        self.peers.iter().map(|p| (p.rank, p.n_ranks)).collect()
    }

    /// How long [`send_bucket`](Self::send_bucket) waits for every engine to confirm a bucket
    /// (default [`DEFAULT_BUCKET_TIMEOUT`]). An engine that is never asked to read the bucket
    /// stalls the chain behind it; this bounds how long that goes unnoticed.
    pub fn set_bucket_timeout(&mut self, timeout: Duration) {
        self.bucket_timeout = timeout;
    }

    /// Accepts engines until ranks `1..world_size` are all covered, rejecting wrong group
    /// names, malformed handshakes, out-of-range and overlapping ranks (those connections get a
    /// reason and are dropped; the wait goes on); then wires the chain in ascending rank order
    /// and waits until every link is up. Fails with [`TcpError::Timeout`] if ranks are still
    /// missing at the deadline, or [`TcpError::RankFailed`] if an engine could not be linked
    /// (every engine is told which).
    pub async fn accept_all(&mut self, timeout: Duration) -> Result<(), TcpError> {
        let deadline = Instant::now() + timeout;
        if let Some((rank, reason)) = &self.broken {
            return Err(TcpError::RankFailed {
                rank: *rank,
                reason: format!("the group failed earlier ({reason}); bind a new sender"),
            });
        }
        if self.data.is_some() {
            return Ok(());
        }
        self.admit(deadline).await?;
        self.wire_chain(deadline).await
    }

    async fn admit(&mut self, deadline: Instant) -> Result<(), TcpError> {
        let mut covered = vec![false; self.world_size as usize];
        covered[0] = true;
        for p in &self.peers {
            for r in p.rank..p.rank + p.n_ranks {
                covered[r as usize] = true;
            }
        }
        while covered.iter().any(|c| !c) {
            let (mut stream, from) = match tokio::time::timeout_at(deadline, self.listener.accept())
                .await
            {
                Ok(r) => r?,
                Err(_) => {
                    let missing: Vec<usize> = (0..covered.len()).filter(|&i| !covered[i]).collect();
                    return Err(TcpError::Timeout(format!(
                        "group {}: ranks {missing:?} never joined",
                        self.group_name
                    )));
                }
            };
            stream.set_nodelay(true)?;
            let hello_by = deadline.min(Instant::now() + HELLO_TIMEOUT);
            let verdict = match tokio::time::timeout_at(hello_by, read_hello(&mut stream)).await {
                Ok(Ok(h)) => self.check_join(&h, &covered).map(|()| h),
                Ok(Err(e)) => Err(format!("bad handshake: {e}")),
                Err(_) => Err("no handshake within 10 s".to_string()),
            };
            match verdict {
                Ok(h) => {
                    write_status(&mut stream, Ok(())).await?;
                    for r in h.rank..h.rank + h.n_ranks {
                        covered[r as usize] = true;
                    }
                    self.peers.push(Peer {
                        rank: h.rank,
                        n_ranks: h.n_ranks,
                        data_addr: h.data_addr,
                        control: stream,
                    });
                }
                Err(reason) => {
                    tracing::warn!(%from, %reason, "rejecting weight receiver");
                    let _ = write_status(&mut stream, Err(&reason)).await;
                }
            }
        }
        Ok(())
    }

    fn check_join(&self, h: &Hello, covered: &[bool]) -> Result<(), String> {
        let (rank, n_ranks, group) = (h.rank, h.n_ranks, &h.group);
        // An empty name is a receiver that joined through a route naming no group (vLLM's
        // `/init_weight_transfer_engine`): it takes whichever group its master runs.
        if !group.is_empty() && *group != self.group_name {
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

    /// Tells each engine its place in the chain, links rank 0 to the first one, and waits for
    /// every engine to report its links up.
    async fn wire_chain(&mut self, deadline: Instant) -> Result<(), TcpError> {
        self.peers.sort_by_key(|p| p.rank);
        let n = self.peers.len();
        for i in 0..n {
            let topo = Topology {
                pred_rank: if i == 0 { 0 } else { self.peers[i - 1].rank },
                succ: self.peers.get(i + 1).map(|p| (p.rank, p.data_addr.clone())),
                token: self.token,
            };
            let sent = write_to_engine(&mut self.peers[i].control, &ToEngine::Topology(topo)).await;
            if let Err(e) = sent {
                let rank = self.peers[i].rank;
                return self
                    .fail(rank, format!("lost while wiring the chain: {e}"))
                    .await;
            }
        }
        let (first_rank, first_addr) = (self.peers[0].rank, self.peers[0].data_addr.clone());
        let mut tasks = spawn_collect(std::mem::take(&mut self.peers), deadline);
        let link = connect_link(&first_addr, self.token, 0, first_rank, deadline).await;
        let outcomes = join_collect(&mut tasks, &mut self.peers).await;
        let link_err = link.as_ref().err().map(|e| e.to_string());
        if let Some((rank, reason)) = culprit(&outcomes, link_err.map(|e| (first_rank, e))) {
            return self.fail(rank, reason).await;
        }
        let data = link?;
        data.set_nodelay(true)?;
        for p in &mut self.peers {
            write_to_engine(&mut p.control, &ToEngine::GroupReady).await?;
        }
        self.data = Some(data);
        Ok(())
    }

    /// Marks the group failed at `rank`, tells every engine still connected, and returns the
    /// error every caller sees.
    async fn fail<T>(&mut self, rank: u32, reason: String) -> Result<T, TcpError> {
        let msg = ToEngine::Failed {
            rank,
            reason: reason.clone(),
        };
        for p in &mut self.peers {
            let _ = write_to_engine(&mut p.control, &msg).await;
        }
        if let Some(mut d) = self.data.take() {
            let _ = d.shutdown().await;
        }
        self.broken = Some((rank, reason.clone()));
        Err(TcpError::RankFailed { rank, reason })
    }

    /// Sends these tensors, in this order, down the chain, and returns once every engine has
    /// confirmed the whole bucket (then every engine is told it is committed). Tensors are
    /// checked first: an inconsistent one sends nothing. If any engine fails, every engine and
    /// the caller get [`TcpError::RankFailed`] naming the same rank, and the group is unusable.
    pub async fn send_bucket(&mut self, tensors: &[TensorRef<'_>]) -> Result<(), TcpError> {
        if let Some((rank, reason)) = &self.broken {
            return Err(TcpError::RankFailed {
                rank: *rank,
                reason: format!(
                    "the group failed earlier ({reason}); destroy it and create a new one"
                ),
            });
        }
        if self.peers.is_empty() || self.data.is_none() {
            return Err(TcpError::InvalidArgument(
                "no receivers: call accept_all first".into(),
            ));
        }
        let headers = tensors
            .iter()
            .map(encode_header)
            .collect::<Result<Vec<_>, _>>()?;
        let end = encode_end(tensors.len())?;
        let deadline = Instant::now() + self.bucket_timeout;
        let first_rank = self.peers[0].rank;
        let mut tasks = spawn_collect(std::mem::take(&mut self.peers), deadline);
        let Some(data) = self.data.as_mut() else {
            return Err(TcpError::InvalidArgument("no data link".into()));
        };
        let write = async {
            for (h, t) in headers.iter().zip(tensors) {
                data.write_all(h).await?;
                data.write_all(t.bytes).await?;
            }
            data.write_all(&end).await?;
            data.flush().await
        };
        // Boxed so it can be dropped (ending its borrow of the data link) before `fail`.
        let mut write = Box::pin(write);
        let mut write_res: Option<std::io::Result<()>> = None;
        let mut outcomes = Vec::new();
        loop {
            tokio::select! {
                r = &mut write, if write_res.is_none() => write_res = Some(r),
                j = tasks.join_next() => match j {
                    None => break,
                    Some(Ok((i, p, o))) => outcomes.push((i, p, o)),
                    Some(Err(e)) => return Err(TcpError::Protocol(format!("collector task: {e}"))),
                },
            }
        }
        if write_res.is_none() && outcomes.iter().all(|(_, _, o)| matches!(o, Outcome::Ok)) {
            write_res = Some((&mut write).await);
        }
        drop(write);
        let outcomes = restore(outcomes, &mut self.peers);
        let link_err = match write_res {
            Some(Err(e)) => Some((first_rank, format!("data link to rank {first_rank}: {e}"))),
            _ => None,
        };
        if let Some((rank, reason)) = culprit(&outcomes, link_err) {
            return self.fail(rank, reason).await;
        }
        for p in &mut self.peers {
            write_to_engine(&mut p.control, &ToEngine::Commit).await?;
        }
        Ok(())
    }

    /// Tells every engine the group is closing and drops the connections.
    pub async fn close(mut self) -> Result<(), TcpError> {
        for p in &mut self.peers {
            let _ = write_to_engine(&mut p.control, &ToEngine::Close).await;
            let _ = p.control.shutdown().await;
        }
        if let Some(mut d) = self.data.take() {
            let _ = d.shutdown().await;
        }
        Ok(())
    }
}

type Collected = (usize, Peer, Outcome);

/// Reads one report from every engine concurrently, each bounded by `deadline`.
fn spawn_collect(peers: Vec<Peer>, deadline: Instant) -> JoinSet<Collected> {
    let mut tasks = JoinSet::new();
    for (i, mut p) in peers.into_iter().enumerate() {
        tasks.spawn(async move {
            let o = match tokio::time::timeout_at(deadline, read_from_engine(&mut p.control)).await
            {
                Err(_) => Outcome::TimedOut,
                Ok(Ok(FromEngine::Ready | FromEngine::Ack)) => Outcome::Ok,
                Ok(Ok(FromEngine::Error {
                    fault,
                    rank,
                    reason,
                })) => Outcome::Reported {
                    fault,
                    rank,
                    reason,
                },
                Ok(Err(e)) => Outcome::Lost(e.to_string()),
            };
            (i, p, o)
        });
    }
    tasks
}

async fn join_collect(
    tasks: &mut JoinSet<Collected>,
    peers: &mut Vec<Peer>,
) -> Vec<(u32, Outcome)> {
    let mut got = Vec::new();
    while let Some(j) = tasks.join_next().await {
        // A collector only panics if the runtime is shutting down; that engine counts as lost.
        if let Ok(c) = j {
            got.push(c);
        }
    }
    restore(got, peers)
}

/// Puts the peers back in chain order and returns `(rank, outcome)` in the same order.
fn restore(mut got: Vec<Collected>, peers: &mut Vec<Peer>) -> Vec<(u32, Outcome)> {
    got.sort_by_key(|(i, _, _)| *i);
    let mut out = Vec::with_capacity(got.len());
    for (_, p, o) in got {
        out.push((p.rank, o));
        peers.push(p);
    }
    out
}

/// Which rank to blame, if anything failed: an engine whose control connection died first (in
/// chain order), then one that refused the bucket itself, then whatever a neighbour reported,
/// then a failed data link from rank 0, then the first engine that never answered.
fn culprit(outcomes: &[(u32, Outcome)], link_err: Option<(u32, String)>) -> Option<(u32, String)> {
    let lost = outcomes.iter().find_map(|(r, o)| match o {
        Outcome::Lost(e) => Some((*r, format!("rank {r} went away: {e}"))),
        _ => None,
    });
    let mine = outcomes.iter().find_map(|(r, o)| match o {
        Outcome::Reported {
            fault: Fault::Mine,
            reason,
            ..
        } => Some((*r, format!("rank {r} refused the bucket: {reason}"))),
        _ => None,
    });
    let neighbour = outcomes.iter().find_map(|(r, o)| match o {
        Outcome::Reported { rank, reason, .. } => {
            Some((*rank, format!("reported by rank {r}: {reason}")))
        }
        _ => None,
    });
    let silent = outcomes.iter().find_map(|(r, o)| match o {
        Outcome::TimedOut => Some((
            *r,
            format!(
                "rank {r} did not confirm in time; is /update_weights_from_distributed (or \
                 /init_weights_update_group) being called on that engine with the same names, \
                 dtypes and shapes?"
            ),
        )),
        _ => None,
    });
    lost.or(mine).or(neighbour).or(link_err).or(silent)
}

/// A receiver's handshake.
#[derive(Debug)]
struct Hello {
    rank: u32,
    n_ranks: u32,
    group: String,
    data_addr: String,
}

async fn read_hello(stream: &mut TcpStream) -> Result<Hello, TcpError> {
    let mut magic = [0u8; 4];
    stream.read_exact(&mut magic).await?;
    if &magic != MAGIC {
        return Err(TcpError::Protocol(format!(
            "magic {magic:?} is not {MAGIC:?}: this port is a troupe weight sender, connect \
             with troupe_weights::tcp::WeightReceiver"
        )));
    }
    let version = stream.read_u16_le().await?;
    if version != VERSION {
        return Err(TcpError::Protocol(format!(
            "handshake version {version}, this sender speaks {VERSION}; run the same troupe \
             version on trainer and engines"
        )));
    }
    let rank = stream.read_u32_le().await?;
    let n_ranks = stream.read_u32_le().await?;
    let group = read_short_str(stream, "group name").await?;
    let data_addr = read_short_str(stream, "data address").await?;
    if data_addr.parse::<SocketAddr>().is_err() {
        return Err(TcpError::Protocol(format!(
            "data address {data_addr:?} is not ip:port"
        )));
    }
    Ok(Hello {
        rank,
        n_ranks,
        group,
        data_addr,
    })
}
