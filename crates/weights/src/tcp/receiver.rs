//! An engine's side: join a group (a control connection to rank 0 plus data links to its chain
//! neighbours), read buckets while forwarding them to the next engine.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use bytes::BufMut;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::time::Instant;

use super::assemble::{Assembler, Frames};
use super::auth::GroupSecret;
use super::control::{
    Fault, FromEngine, ToEngine, read_to_engine, read_to_engine_rest, unexpected, write_from_engine,
};
use super::frame::bucket_len;
use super::join::{Hello, send_join};
use super::link::{accept_link, connect_link};
use super::pace::Pace;
use super::ring::{RingFailure, RingReceiver};
use super::{CHUNK_BYTES, OwnedTensor, TcpError, TensorSpec, shm};
use crate::delta::{ReceiverBases, SharedReceiverBases};

/// How long an engine whose neighbour failed waits for rank 0 to say which rank it was.
const VERDICT_GRACE: Duration = Duration::from_secs(10);

/// Why a bucket transfer stopped.
#[derive(Debug)]
pub(super) enum Failure {
    /// This engine refused the bytes (they do not match what it was told to expect).
    Mine(String),
    /// The predecessor's data link broke.
    Upstream(String),
    /// The successor's data link broke.
    Downstream(String),
    /// Rank 0 declared the bucket failed at `rank`.
    Verdict(u32, String),
    /// Rank 0 closed the group.
    Closed,
    /// The control connection to rank 0 broke.
    Lost(String),
    /// The deadline passed.
    Timeout(String),
    /// Test hook: stop as if the process died.
    #[cfg(test)]
    Died,
}

/// An engine's end of a weight-update group, covering ranks `rank..rank + n_ranks`. Only `rank`
/// is a hop of the chain: an engine's tensor-parallel ranks share one process and one copy.
#[derive(Debug)]
pub struct WeightReceiver {
    pub(super) control: TcpStream,
    /// From the predecessor: bucket bytes on the chain, ring positions with a ring.
    pub(super) upstream: TcpStream,
    pub(super) downstream: Option<TcpStream>,
    /// Rank 0's shared-memory ring, when this engine is on its machine and could map it.
    pub(super) ring: Option<RingReceiver>,
    pub(super) rank: u32,
    pub(super) n_ranks: u32,
    pub(super) pred_rank: u32,
    pub(super) succ_rank: Option<u32>,
    pub(super) group_name: String,
    /// Set by the first failure: `(rank, reason)`; the receiver is unusable afterwards.
    pub(super) broken: Option<(u32, String)>,
    /// Buffers handed back with [`recycle`](Self::recycle), filled by the next bucket.
    pub(super) spare: Vec<Vec<u8>>,
    /// The tensors this engine holds as bases of delta updates (shared with the engine's
    /// later receivers).
    pub(super) bases: SharedReceiverBases,
    /// Set by [`pace_link`](Self::pace_link).
    pub(super) pace: Option<Pace>,
    /// Test hook: after this many bucket bytes, drop out as if killed.
    #[cfg(test)]
    pub(crate) die_after: Option<u64>,
}

impl WeightReceiver {
    /// Connects to rank 0 at `addr` (retrying refused connections until `timeout`: the trainer
    /// may bind a moment after telling engines to join), performs the handshake, and waits
    /// until the whole group has joined and this engine's chain links are up, like NCCL's
    /// `init_process_group`. Its own data listener is bound on the interface that reaches rank
    /// 0, on an ephemeral port that is sent to rank 0 in the handshake.
    ///
    /// `secret` is the group's ([`WeightSender::secret`](super::WeightSender::secret), handed
    /// to the engine by the init call): the join proves it, and rank 0 must prove it back.
    pub async fn connect(
        addr: &str,
        group_name: &str,
        secret: &str,
        rank: u32,
        n_ranks: u32,
        timeout: Duration,
    ) -> Result<Self, TcpError> {
        Self::connect_with_bases(
            addr,
            group_name,
            secret,
            rank,
            n_ranks,
            timeout,
            ReceiverBases::shared(),
        )
        .await
    }

    /// [`connect`](Self::connect), keeping delta bases in `bases`: an engine passes the same
    /// bases to every group it joins, so a group rebuilt after a fleet change still gets
    /// deltas (the digest of `bases` tells rank 0 what this engine holds).
    pub async fn connect_with_bases(
        addr: &str,
        group_name: &str,
        secret: &str,
        rank: u32,
        n_ranks: u32,
        timeout: Duration,
        bases: SharedReceiverBases,
    ) -> Result<Self, TcpError> {
        let secret = Arc::new(GroupSecret::parse(secret)?);
        let deadline = Instant::now() + timeout;
        // Resolve once, up front: a name that does not resolve will not start resolving by
        // waiting, so it fails now instead of after the whole timeout. Connecting is retried
        // (the sender may not listen yet).
        let targets: Vec<std::net::SocketAddr> =
            match tokio::time::timeout_at(deadline, tokio::net::lookup_host(addr)).await {
                Ok(Ok(found)) => found.collect(),
                Ok(Err(e)) => {
                    return Err(TcpError::Io(std::io::Error::new(
                        e.kind(),
                        format!("cannot resolve weight sender address {addr}: {e}"),
                    )));
                }
                Err(_) => {
                    return Err(TcpError::Timeout(format!(
                        "resolving weight sender address {addr}"
                    )));
                }
            };
        if targets.is_empty() {
            return Err(TcpError::Io(std::io::Error::other(format!(
                "weight sender address {addr} resolves to no address"
            ))));
        }
        let mut control = loop {
            match tokio::time::timeout_at(deadline, TcpStream::connect(&targets[..])).await {
                Ok(Ok(s)) => break s,
                Ok(Err(e)) if Instant::now() < deadline => {
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
        control.set_nodelay(true)?;
        let listener = TcpListener::bind((control.local_addr()?.ip(), 0)).await?;
        let data_addr = listener.local_addr()?.to_string();
        #[cfg(test)]
        super::tests_auth::data_listener_bound(group_name, rank, &data_addr);
        let hello = Hello {
            rank,
            n_ranks,
            group: group_name.to_string(),
            data_addr,
            digest: bases.lock().map_or(0, |b| b.digest()),
        };
        let never = || {
            format!(
                "weight sender at {addr} accepted the connection but never admitted rank {rank}"
            )
        };
        tokio::time::timeout_at(deadline, send_join(&mut control, &secret, &hello, addr))
            .await
            .map_err(|_| TcpError::Timeout(never()))??;
        let mut mapped = None;
        let topo = match read_control(&mut control, deadline, "the chain topology").await? {
            ToEngine::ShmOffer(offer) => {
                let seg = map_offer(&offer, group_name, rank);
                let why_not = seg.as_ref().err().cloned();
                if let Some(why) = &why_not {
                    tracing::debug!(rank, %why, "weight ring not mapped; receiving over TCP");
                }
                write_from_engine(&mut control, &FromEngine::Mapped(why_not)).await?;
                mapped = seg.ok();
                match read_control(&mut control, deadline, "the chain topology").await? {
                    ToEngine::Topology(t) => t,
                    other => return Err(unexpected(other, "the chain topology")),
                }
            }
            ToEngine::Topology(t) => t,
            other => return Err(unexpected(other, "the chain topology")),
        };
        let ring = match (topo.shm, mapped) {
            (true, Some(seg)) => Some(RingReceiver::new(seg)),
            (true, None) => {
                return Err(TcpError::Protocol(
                    "rank 0 put this engine on a shared-memory ring it did not map".into(),
                ));
            }
            (false, _) => None,
        };
        let succ_rank = topo.succ.as_ref().map(|(r, _)| *r);
        let (up, down) = tokio::join!(
            accept_link(&listener, secret.clone(), topo.pred_rank, rank, deadline),
            async {
                match &topo.succ {
                    Some((succ, a)) => connect_link(a, &secret, rank, *succ, deadline)
                        .await
                        .map(Some),
                    None => Ok(None),
                }
            }
        );
        let report = match (&up, &down) {
            (Err(e), _) => FromEngine::Error {
                fault: Fault::Upstream,
                rank: topo.pred_rank,
                reason: e.to_string(),
            },
            (_, Err(e)) => FromEngine::Error {
                fault: Fault::Downstream,
                rank: succ_rank.unwrap_or(rank),
                reason: e.to_string(),
            },
            _ => FromEngine::Ready,
        };
        write_from_engine(&mut control, &report).await?;
        match read_control(&mut control, deadline, "the group to form").await? {
            ToEngine::GroupReady => {}
            other => return Err(unexpected(other, "the group to form")),
        }
        Ok(Self {
            control,
            upstream: up?,
            downstream: down?,
            ring,
            rank,
            n_ranks,
            pred_rank: topo.pred_rank,
            succ_rank,
            group_name: group_name.to_string(),
            broken: None,
            spare: Vec::new(),
            bases,
            pace: None,
            #[cfg(test)]
            die_after: None,
        })
    }

    /// First rank this receiver covers (its place in the chain).
    pub fn rank(&self) -> u32 {
        self.rank
    }

    /// Whether buckets arrive through rank 0's shared-memory ring (this engine runs on rank 0's
    /// machine and could map it) rather than over the TCP chain.
    pub fn uses_shared_memory(&self) -> bool {
        self.ring.is_some()
    }

    /// Number of ranks this receiver covers.
    pub fn n_ranks(&self) -> u32 {
        self.n_ranks
    }

    /// Name of the group joined.
    pub fn group_name(&self) -> &str {
        &self.group_name
    }

    /// Rank this engine receives data from (0 for the first engine of the chain).
    pub fn predecessor_rank(&self) -> u32 {
        self.pred_rank
    }

    /// First rank of the engine this one forwards to (`None` for the last of the chain).
    pub fn successor_rank(&self) -> Option<u32> {
        self.succ_rank
    }

    /// Reads one bucket, forwarding its bytes to the successor as they arrive, and checks that
    /// it holds exactly `expected`, in order (name, dtype and shape). Returns the tensors only
    /// once rank 0 confirms that *every* engine holds the bucket, so engines swap weights all
    /// or none. On a mismatch this engine's error names it; when anything else fails the error
    /// is [`TcpError::RankFailed`] naming the rank at fault. After any error the receiver is
    /// unusable (the group must be re-created).
    pub async fn recv_bucket(
        &mut self,
        expected: &[TensorSpec],
        timeout: Duration,
    ) -> Result<Vec<OwnedTensor>, TcpError> {
        if let Some((rank, reason)) = &self.broken {
            return Err(TcpError::RankFailed {
                rank: *rank,
                reason: format!("the group failed earlier ({reason}); re-join a new group"),
            });
        }
        // Checks the specs (name lengths, dimensions, sizes) before anything is read.
        bucket_len(expected)?;
        let deadline = Instant::now() + timeout;
        match self.receive(expected, deadline).await {
            Ok(tensors) => Ok(tensors),
            Err(f) => Err(self.fail(f).await),
        }
    }

    /// Hands back the tensors of an earlier bucket once the caller is done with them, so the
    /// next bucket is read into memory that is already mapped. A fresh allocation of a large
    /// tensor costs a page fault and a zeroed page per 4 KiB, which was a third of a loopback
    /// broadcast's CPU (`troupe bench broadcast`). Holds at most the buffers of the last call
    /// (one bucket's worth); older spares are freed, and all of them with the receiver.
    ///
    /// Tensors that came in a delta-on bucket are kept as the bases of the next deltas instead
    /// (no copy: these very buffers); a tensor not handed back is sent whole next time.
    pub fn recycle(&mut self, tensors: impl IntoIterator<Item = OwnedTensor>) {
        let mut bases = self.bases.lock().ok();
        self.spare = tensors
            .into_iter()
            .filter(|t| t.bytes.0.capacity() > 0)
            .filter_map(|t| match bases.as_mut() {
                Some(b) => b.give_back(&t.name, t.bytes.0),
                None => Some(t.bytes.0),
            })
            .collect();
    }

    /// Reports `failure` to rank 0 where that helps, waits for the verdict naming the rank at
    /// fault where this engine cannot know it, and turns it into the caller's error.
    async fn fail(&mut self, failure: Failure) -> TcpError {
        let me = self.rank;
        let (report, err) = match failure {
            Failure::Mine(m) => (
                Some((Fault::Mine, me, m.clone())),
                TcpError::Protocol(format!("rank {me} refused the bucket: {m}")),
            ),
            Failure::Upstream(m) => (
                Some((Fault::Upstream, self.pred_rank, m.clone())),
                TcpError::RankFailed {
                    rank: self.pred_rank,
                    reason: m,
                },
            ),
            Failure::Downstream(m) => {
                let succ = self.succ_rank.unwrap_or(me);
                (
                    Some((Fault::Downstream, succ, m.clone())),
                    TcpError::RankFailed {
                        rank: succ,
                        reason: m,
                    },
                )
            }
            Failure::Verdict(rank, reason) => (None, TcpError::RankFailed { rank, reason }),
            Failure::Closed => (None, TcpError::Rejected("sender closed the group".into())),
            Failure::Lost(m) => (
                None,
                TcpError::RankFailed {
                    rank: 0,
                    reason: format!("control connection to rank 0 lost: {m}"),
                },
            ),
            Failure::Timeout(m) => (
                Some((Fault::Upstream, self.pred_rank, m.clone())),
                TcpError::Timeout(m),
            ),
            #[cfg(test)]
            Failure::Died => (None, TcpError::Protocol(format!("rank {me} died (test)"))),
        };
        let neighbour = matches!(&report, Some((Fault::Upstream | Fault::Downstream, ..)))
            && !matches!(err, TcpError::Timeout(_));
        let err = match report {
            Some((fault, rank, reason)) => {
                let msg = FromEngine::Error {
                    fault,
                    rank,
                    reason,
                };
                let sent = write_from_engine(&mut self.control, &msg).await.is_ok();
                if sent && neighbour {
                    let by = Instant::now() + VERDICT_GRACE;
                    match read_control(&mut self.control, by, "the failure verdict").await {
                        Err(verdict @ TcpError::RankFailed { .. }) => verdict,
                        _ => err,
                    }
                } else {
                    err
                }
            }
            None => err,
        };
        let (rank, reason) = match &err {
            TcpError::RankFailed { rank, reason } => (*rank, reason.clone()),
            other => (me, other.to_string()),
        };
        self.broken = Some((rank, reason));
        err
    }

    /// Reads the bucket from the predecessor, forwarding each chunk to the successor as soon
    /// as it is read; watches the control connection for rank 0 calling the bucket off.
    pub(super) async fn transfer(
        &mut self,
        expected: &[TensorSpec],
        deadline: Instant,
    ) -> Result<(Vec<OwnedTensor>, Frames), Failure> {
        // Forwarding is done in place: every piece read is written to the successor before the
        // next read, from the tensor buffer it was read into. Payload is read straight into
        // its tensor, so each byte is copied twice per hop (in from the kernel, out to it), not
        // three times with a copy into the tensor; on one machine that copy was a third of a
        // broadcast's memory traffic. The kernel's socket buffers still overlap the hops.
        let mut down = self.downstream.take();
        let mut down_err: Option<String> = None;
        let writing = AtomicBool::new(false);
        let pred = self.pred_rank;
        #[cfg(test)]
        let die_after = self.die_after;
        let upstream = &mut self.upstream;
        let pace = &mut self.pace;
        let control = &mut self.control;
        let ring = &mut self.ring;
        let spare = std::mem::take(&mut self.spare);
        let mut asm = Assembler::with_spare(expected, spare, self.bases.clone());
        let read = async {
            if let Some(ring) = ring.as_mut() {
                #[cfg(test)]
                let stop = die_after;
                #[cfg(not(test))]
                let stop = None;
                return ring
                    .receive(upstream, &mut asm, stop)
                    .await
                    .map_err(|f| match f {
                        RingFailure::Upstream(m) => Failure::Upstream(m),
                        RingFailure::Mine(m) => Failure::Mine(m),
                        #[cfg(test)]
                        RingFailure::Stopped => Failure::Died,
                        #[cfg(not(test))]
                        RingFailure::Stopped => Failure::Upstream("stopped".into()),
                    });
            }
            let mut header: Vec<u8> = Vec::with_capacity(64);
            let mut got = 0u64;
            let up_err = |got: u64, e: std::io::Error| {
                Failure::Upstream(format!(
                    "data link from rank {pred} failed after {got} bytes of the bucket: {e}"
                ))
            };
            let closed = |got: u64| {
                Failure::Upstream(format!(
                    "rank {pred} closed the data link after {got} bytes of the bucket"
                ))
            };
            // Each read is bounded by what the decoder still wants of the current piece, so
            // nothing past the end frame is read.
            while !asm.is_done() {
                #[cfg(test)]
                if die_after.is_some_and(|n| got >= n) {
                    return Err(Failure::Died);
                }
                let n = match asm.payload_room() {
                    Some((dst, remaining)) => {
                        let want = remaining.min(CHUNK_BYTES);
                        let at = dst.len();
                        let n = upstream
                            .read_buf(&mut (&mut *dst).limit(want))
                            .await
                            .map_err(|e| up_err(got, e))?;
                        if n == 0 {
                            return Err(closed(got));
                        }
                        pass_on(&mut down, &mut down_err, &writing, &dst[at..at + n]).await;
                        asm.filled(n);
                        if let Some(p) = pace.as_mut() {
                            p.wait(n).await;
                        }
                        n
                    }
                    None => {
                        header.clear();
                        let want = asm.header_want();
                        let n = upstream
                            .read_buf(&mut (&mut header).limit(want))
                            .await
                            .map_err(|e| up_err(got, e))?;
                        if n == 0 {
                            return Err(closed(got));
                        }
                        pass_on(&mut down, &mut down_err, &writing, &header[..n]).await;
                        asm.feed(&header[..n]).map_err(Failure::Mine)?;
                        n
                    }
                };
                got += n as u64;
            }
            Ok(())
        };
        let watch = async {
            let kind = control.read_u8().await;
            match kind {
                Ok(k) => match read_to_engine_rest(control, k).await {
                    Ok(ToEngine::Failed { rank, reason }) => Failure::Verdict(rank, reason),
                    Ok(ToEngine::Close) => Failure::Closed,
                    Ok(other) => Failure::Lost(format!("unexpected {other:?} during a bucket")),
                    Err(e) => Failure::Lost(e.to_string()),
                },
                Err(e) => Failure::Lost(e.to_string()),
            }
        };
        tokio::select! {
            r = read => r?,
            f = watch => return Err(f),
            _ = tokio::time::sleep_until(deadline) => {
                let succ = self.succ_rank.unwrap_or(self.rank);
                return Err(Failure::Timeout(if writing.load(Ordering::Relaxed) {
                    format!("rank {succ} did not take the bucket in time")
                } else {
                    format!(
                        "bucket of {} tensors did not arrive from rank {pred} in time",
                        expected.len()
                    )
                }));
            }
        }
        if !asm.is_done() {
            return Err(Failure::Mine("bucket incomplete".into()));
        }
        if let Some(e) = down_err {
            let succ = self.succ_rank.unwrap_or(self.rank);
            return Err(Failure::Downstream(format!(
                "forwarding to rank {succ} failed: {e}"
            )));
        }
        self.downstream = down;
        self.spare = asm.take_spare();
        let frames = asm.take_frames();
        Ok((asm.into_tensors(), frames))
    }
}

/// Writes `bytes` to the successor, if there is one and it has not failed yet; a failure is
/// kept in `err` (reported once this engine has read its own copy) and stops forwarding.
/// `writing` is set while a write waits, so a deadline names the rank that stalled.
async fn pass_on(
    down: &mut Option<TcpStream>,
    err: &mut Option<String>,
    writing: &AtomicBool,
    bytes: &[u8],
) {
    let Some(d) = down.as_mut() else { return };
    if err.is_some() {
        return;
    }
    writing.store(true, Ordering::Relaxed);
    if let Err(e) = d.write_all(bytes).await {
        *err = Some(e.to_string());
    }
    writing.store(false, Ordering::Relaxed);
}

/// Maps rank 0's ring, or says why not.
fn map_offer(offer: &shm::Offer, group: &str, rank: u32) -> Result<shm::Segment, String> {
    #[cfg(test)]
    if super::tests_shm::refuses_ring(group, rank) {
        return Err("refused by the test".into());
    }
    let _ = (group, rank);
    shm::open(offer)
}

/// Reads one control message from rank 0 by `deadline`, turning a failure verdict into
/// [`TcpError::RankFailed`].
pub(super) async fn read_control(
    control: &mut TcpStream,
    deadline: Instant,
    waiting_for: &str,
) -> Result<ToEngine, TcpError> {
    match tokio::time::timeout_at(deadline, read_to_engine(control)).await {
        Ok(Ok(ToEngine::Failed { rank, reason })) => Err(TcpError::RankFailed { rank, reason }),
        Ok(Ok(m)) => Ok(m),
        Ok(Err(e)) => Err(e),
        Err(_) => Err(TcpError::Timeout(format!(
            "rank 0 sent nothing while waiting for {waiting_for}"
        ))),
    }
}
