//! Rank 0's side: accept engines, wire them into a chain, send buckets down it, and decide
//! whether each bucket is committed or which rank failed.

use std::collections::HashSet;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::io::AsyncWriteExt;
use tokio::net::{TcpListener, TcpStream, ToSocketAddrs};
use tokio::task::JoinSet;
use tokio::time::Instant;

use super::auth::GroupSecret;
use super::collect::{Outcome, Peer, culprit, join_collect, spawn_collect};
use super::control::{ToEngine, Topology, write_to_engine};
use super::join::{HELLO_TIMEOUT, Hello, Joined, shake};
use super::link::connect_link;
use super::pending::Handshakes;
use super::ring::RingSender;
use super::shm::{self, DEFAULT_RING_BYTES, MAX_RING_BYTES, MIN_RING_BYTES};
use super::{DEFAULT_BUCKET_TIMEOUT, TcpError};
use crate::delta::{DeltaStats, SenderBases};

/// The default ring size: [`DEFAULT_RING_BYTES`], or none when `TROUPE_SHM_DISABLE=1` (as
/// `NCCL_SHM_DISABLE=1` keeps NCCL off shared memory).
fn ring_from_env() -> Option<usize> {
    ring_unless_disabled(std::env::var("TROUPE_SHM_DISABLE").ok().as_deref())
}

/// [`ring_from_env`] given the variable's value.
pub(crate) fn ring_unless_disabled(shm_disable: Option<&str>) -> Option<usize> {
    match shm_disable {
        Some(v) if v.trim() == "1" => None,
        _ => Some(DEFAULT_RING_BYTES),
    }
}

/// How long rank 0 still waits for engines' reports once a bucket failed (a data link broke, or
/// an engine reported a fault): enough for an engine that died to be seen as gone on its
/// control connection too, and for its neighbours to say what they saw. Engines behind a
/// stalled writer (a ring engine that refused the bucket stops reading; so does a chain engine)
/// would otherwise be waited for until the bucket's deadline.
pub(super) const FAILURE_GRACE: Duration = Duration::from_millis(500);

/// Rank 0 of a weight-update group: listens on `master_port`, admits every engine, wires them
/// into a chain and sends buckets of tensors down it.
#[derive(Debug)]
pub struct WeightSender {
    pub(super) listener: TcpListener,
    pub(super) world_size: u32,
    pub(super) group_name: String,
    /// What every engine and data link must prove it knows ([`secret`](Self::secret)).
    pub(super) secret: Arc<GroupSecret>,
    /// Engines in rank order once wired; in accept order before.
    pub(super) peers: Vec<Peer>,
    /// Whether every engine is linked (by the chain or the ring).
    pub(super) wired: bool,
    /// Data link to the first engine of the chain (`None` when every engine is on the ring).
    pub(super) data: Option<TcpStream>,
    /// The shared-memory ring and its engines, when any engine on this machine mapped it.
    pub(super) ring: Option<RingSender>,
    /// Ring size to offer local engines; `None` keeps every engine on the chain.
    pub(super) ring_bytes: Option<usize>,
    /// Set by the first failure: `(rank, reason)`; the group is unusable afterwards.
    pub(super) broken: Option<(u32, String)>,
    pub(super) bucket_timeout: Duration,
    /// Delta bases, when deltas are on ([`set_delta`](Self::set_delta)).
    pub(super) delta: Option<Arc<Mutex<SenderBases>>>,
    /// Whether every engine joined holding exactly the sender's bases (decided at the first
    /// bucket); if not, tensors go whole until sent whole once in this group.
    pub(super) synced: Option<bool>,
    /// Tensors sent whole (and committed) since the group formed: every engine holds them.
    pub(super) whole_since_join: HashSet<String>,
    /// What was sent since the last [`take_stats`](Self::take_stats).
    pub(super) stats: DeltaStats,
    /// Test hook: flip a byte of the next bucket's first delta on the way out.
    #[cfg(test)]
    pub(crate) corrupt_next_delta: bool,
    /// Test hook: the next streamed bucket's planner waits on this before each tensor after
    /// the first.
    #[cfg(test)]
    pub(crate) plan_gate: Option<std::sync::mpsc::Receiver<()>>,
}

impl WeightSender {
    /// Binds the listening socket for a group of `world_size` ranks (rank 0 included), with a
    /// fresh random group secret ([`secret`](Self::secret)) that every engine must prove it
    /// knows to join. Engines may connect as soon as this returns; call
    /// [`accept_all`](Self::accept_all) to admit them.
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
        let secret = Arc::new(GroupSecret::generate()?);
        let listener = TcpListener::bind(addr).await?;
        Ok(Self {
            listener,
            world_size,
            group_name: group_name.to_string(),
            secret,
            peers: Vec::new(),
            wired: false,
            data: None,
            ring: None,
            ring_bytes: ring_from_env(),
            broken: None,
            bucket_timeout: DEFAULT_BUCKET_TIMEOUT,
            delta: None,
            synced: None,
            whole_since_join: HashSet::new(),
            stats: DeltaStats::default(),
            #[cfg(test)]
            corrupt_next_delta: false,
            #[cfg(test)]
            plan_gate: None,
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

    /// The group secret (64 hex digits) every engine must be handed to join: the port and the
    /// group name are not secret, so without it anyone who reaches the port could take a rank
    /// and read the weights. Give it only over an authenticated channel (the admin-keyed init
    /// call's `group_secret`); it never crosses the weight transport itself.
    pub fn secret(&self) -> String {
        self.secret.to_hex()
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

    /// Whether engines on this machine may read buckets from a shared-memory ring of
    /// `ring_bytes` (default [`DEFAULT_RING_BYTES`], or `None` when the environment has
    /// `TROUPE_SHM_DISABLE=1`) instead of the TCP chain; `None` keeps every engine on the chain. Takes effect at [`accept_all`](Self::accept_all); engines
    /// elsewhere, and any that cannot map the ring, stay on the chain either way.
    pub fn set_shared_memory(&mut self, ring_bytes: Option<usize>) -> Result<(), TcpError> {
        if let Some(n) = ring_bytes
            && !(MIN_RING_BYTES..=MAX_RING_BYTES).contains(&n)
        {
            return Err(TcpError::InvalidArgument(format!(
                "shared-memory ring of {n} bytes: give between {MIN_RING_BYTES} and \
                 {MAX_RING_BYTES} bytes, or None to keep every engine on the TCP chain"
            )));
        }
        self.ring_bytes = ring_bytes;
        Ok(())
    }

    /// First ranks of the engines that read from the shared-memory ring (empty before
    /// [`accept_all`](Self::accept_all), or when none could).
    pub fn shared_memory_receivers(&self) -> Vec<u32> {
        self.ring.iter().flat_map(|r| r.ranks()).collect()
    }

    /// Accepts engines until ranks `1..world_size` are all covered, rejecting joins that do
    /// not prove the group secret, wrong group names, malformed handshakes, out-of-range and
    /// overlapping ranks (those connections get a reason and are dropped; the wait goes on;
    /// handshakes are read side by side, so a silent connection delays no other); then wires the chain in ascending rank order
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
        if self.wired {
            return Ok(());
        }
        self.admit(deadline).await?;
        self.wire_chain(deadline).await
    }

    /// Admits engines until every rank is covered. Each connection's handshake is read in its
    /// own task ([`Handshakes`]), so a silent or slow stranger delays neither the real engines
    /// nor the deadline; one that does not prove the secret never gets near a rank.
    async fn admit(&mut self, deadline: Instant) -> Result<(), TcpError> {
        let mut covered = vec![false; self.world_size as usize];
        covered[0] = true;
        for p in &self.peers {
            for r in p.rank..p.rank + p.n_ranks {
                covered[r as usize] = true;
            }
        }
        let mut pending = Handshakes::new(HELLO_TIMEOUT);
        while covered.iter().any(|c| !c) {
            let secret = self.secret.clone();
            let next = pending
                .next(&self.listener, deadline, move |stream, from, by| {
                    shake(stream, from, by, secret.clone())
                })
                .await;
            let Some(mut joined) = next else {
                let missing: Vec<usize> = (0..covered.len()).filter(|&i| !covered[i]).collect();
                return Err(TcpError::Timeout(format!(
                    "group {}: ranks {missing:?} never joined",
                    self.group_name
                )));
            };
            if let Err(reason) = self.check_join(&joined.hello, &covered) {
                joined.refuse(&reason).await;
                continue;
            }
            if let Err(e) = joined.admit().await {
                tracing::warn!(from = %joined.from, error = %e, "admitted engine went away");
                continue;
            }
            let Joined {
                stream,
                local,
                hello: h,
                ..
            } = joined;
            for r in h.rank..h.rank + h.n_ranks {
                covered[r as usize] = true;
            }
            self.peers.push(Peer {
                rank: h.rank,
                n_ranks: h.n_ranks,
                data_addr: h.data_addr,
                control: stream,
                local,
                on_ring: false,
                digest: h.digest,
            });
        }
        Ok(())
    }

    fn check_join(&self, h: &Hello, covered: &[bool]) -> Result<(), String> {
        let (rank, n_ranks, group) = (h.rank, h.n_ranks, &h.group);
        // An empty name is a receiver that joined through a route naming no group (vLLM's
        // `/init_weight_transfer_engine`): it takes whichever group its master runs. It has
        // proved this group's secret already, so that is this group.
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

    /// Offers the ring to engines on this machine, tells each engine its place (on the ring,
    /// or in the chain of the others, in ascending rank order), links rank 0 to the first
    /// chain engine and to every ring engine, and waits for every engine to report its links up.
    async fn wire_chain(&mut self, deadline: Instant) -> Result<(), TcpError> {
        self.peers.sort_by_key(|p| p.rank);
        let seg = self.offer_ring(deadline).await?;
        let chain: Vec<usize> = (0..self.peers.len())
            .filter(|&i| !self.peers[i].on_ring)
            .collect();
        let mut targets = Vec::new();
        // Peers are in rank order, so chain members come up in chain order: `k` is the place of
        // the next one.
        let mut k = 0;
        for i in 0..self.peers.len() {
            let p = &self.peers[i];
            let topo = if p.on_ring {
                Topology {
                    pred_rank: 0,
                    succ: None,
                    shm: true,
                }
            } else {
                let topo = Topology {
                    pred_rank: if k == 0 {
                        0
                    } else {
                        self.peers[chain[k - 1]].rank
                    },
                    succ: chain
                        .get(k + 1)
                        .map(|&j| (self.peers[j].rank, self.peers[j].data_addr.clone())),
                    shm: false,
                };
                k += 1;
                topo
            };
            if p.on_ring || chain.first() == Some(&i) {
                targets.push((p.rank, p.data_addr.clone(), p.on_ring));
            }
            let sent = write_to_engine(&mut self.peers[i].control, &ToEngine::Topology(topo)).await;
            if let Err(e) = sent {
                let rank = self.peers[i].rank;
                return self
                    .fail(rank, format!("lost while wiring the chain: {e}"))
                    .await;
            }
        }
        let mut tasks = spawn_collect(std::mem::take(&mut self.peers), deadline);
        let mut connects = JoinSet::new();
        for (rank, addr, on_ring) in targets {
            let secret = self.secret.clone();
            connects.spawn(async move {
                let link = connect_link(&addr, &secret, 0, rank, deadline).await;
                (rank, on_ring, link)
            });
        }
        let mut links = Vec::new();
        let mut link_err = None;
        while let Some(j) = connects.join_next().await {
            match j {
                Ok((rank, on_ring, Ok(link))) => links.push((rank, on_ring, link)),
                Ok((rank, _, Err(e))) => link_err = link_err.or(Some((rank, e.to_string()))),
                Err(e) => link_err = link_err.or(Some((0, format!("link task: {e}")))),
            }
        }
        let outcomes = join_collect(&mut tasks, &mut self.peers).await;
        if let Some((rank, reason)) = culprit(&outcomes, link_err) {
            return self.fail(rank, reason).await;
        }
        links.sort_by_key(|(rank, ..)| *rank);
        let mut ring_links = Vec::new();
        for (rank, on_ring, link) in links {
            if on_ring {
                ring_links.push((rank, link));
            } else {
                self.data = Some(link);
            }
        }
        for p in &mut self.peers {
            write_to_engine(&mut p.control, &ToEngine::GroupReady).await?;
        }
        self.ring = seg
            .filter(|_| !ring_links.is_empty())
            .map(|seg| RingSender::new(seg, ring_links));
        self.wired = true;
        Ok(())
    }

    /// Offers a shared-memory ring to the engines on this machine (when allowed and possible)
    /// and marks those that mapped it; returns the ring if any did. An engine that cannot map
    /// it stays on the chain; one that does not answer fails the group, naming it.
    async fn offer_ring(&mut self, deadline: Instant) -> Result<Option<shm::Segment>, TcpError> {
        let Some(bytes) = self.ring_bytes else {
            return Ok(None);
        };
        if !self.peers.iter().any(|p| p.local) {
            return Ok(None);
        }
        let (seg, offer) = match shm::create(bytes) {
            Ok(made) => made,
            Err(e) => {
                tracing::debug!(error = %e, "no shared-memory weight ring; every engine on TCP");
                return Ok(None);
            }
        };
        let (local, rest): (Vec<Peer>, Vec<Peer>) = std::mem::take(&mut self.peers)
            .into_iter()
            .partition(|p| p.local);
        self.peers = rest;
        let mut offered = Vec::new();
        for mut p in local {
            let sent = write_to_engine(&mut p.control, &ToEngine::ShmOffer(offer.clone())).await;
            let rank = p.rank;
            offered.push(p);
            if let Err(e) = sent {
                self.peers.append(&mut offered);
                return self
                    .fail(rank, format!("lost while offering the weight ring: {e}"))
                    .await;
            }
        }
        let mut tasks = spawn_collect(offered, deadline);
        let mut outcomes = join_collect(&mut tasks, &mut self.peers).await;
        self.peers.sort_by_key(|p| p.rank);
        for (rank, o) in &mut outcomes {
            match o {
                Outcome::Mapped(None) => {
                    if let Some(p) = self.peers.iter_mut().find(|p| p.rank == *rank) {
                        p.on_ring = true;
                    }
                    *o = Outcome::Ok;
                }
                Outcome::Mapped(Some(why)) => {
                    tracing::info!(rank = *rank, %why, "engine on this machine stays on TCP");
                    *o = Outcome::Ok;
                }
                Outcome::Ok => *o = Outcome::Lost("answered the ring offer out of turn".into()),
                _ => {}
            }
        }
        if let Some((rank, reason)) = culprit(&outcomes, None) {
            return self.fail(rank, reason).await;
        }
        Ok(self.peers.iter().any(|p| p.on_ring).then_some(seg))
    }

    /// Marks the group failed at `rank`, tells every engine still connected, and returns the
    /// error every caller sees.
    pub(super) async fn fail<T>(&mut self, rank: u32, reason: String) -> Result<T, TcpError> {
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
        self.ring = None;
        self.broken = Some((rank, reason.clone()));
        Err(TcpError::RankFailed { rank, reason })
    }

    /// Sends deltas against `bases` from now on (`None`: every byte, as before). The bases
    /// outlive the group: pass the same ones to the next group's sender, so engines that kept
    /// theirs keep getting deltas.
    pub fn set_delta(&mut self, bases: Option<Arc<Mutex<SenderBases>>>) {
        self.delta = bases;
    }

    /// What the buckets committed since the last call sent (bytes on a data link, and with
    /// deltas what the encoding did).
    pub fn take_stats(&mut self) -> DeltaStats {
        std::mem::take(&mut self.stats)
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
        self.ring = None;
        Ok(())
    }
}
