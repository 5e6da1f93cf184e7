//! Rank 0 sending one bucket: every byte, or (deltas on) each tensor whole or as a delta
//! against what the engines hold (streamed as it is diffed, `send_stream.rs`, when the sender
//! may keep the buffers and there is no ring), then a repair of the deltas an engine could not
//! apply, then the commit.

use bytes::Bytes;
use tokio::io::AsyncWriteExt;
use tokio::time::Instant;

use super::collect::{Outcome, culprit, restore, spawn_collect_until};
use super::control::{ToEngine, write_to_engine};
use super::cpu::cpu_bound;
use super::frame::{encode_end, encode_header, encode_header_with};
use super::send_stream::{Body, Source, plan_one};
use super::sender::FAILURE_GRACE;
use super::{FRAME_WHOLE_TAGGED, SharedTensorRef, TcpError, TensorRef, WeightSender};
use crate::delta::DeltaStats;

/// One piece of a bucket on a data link.
enum Piece {
    /// Bytes made here: a frame header, a delta, the end frame.
    Own(Vec<u8>),
    /// The bytes of the caller's tensor at this position, sent as they lie.
    Tensor(usize),
}

/// A bucket's bytes on a data link, as the pieces written one after another.
#[derive(Default)]
struct Wire {
    pieces: Vec<Piece>,
}

impl Wire {
    fn own(&mut self, bytes: Vec<u8>) {
        self.pieces.push(Piece::Own(bytes));
    }

    fn tensor(&mut self, i: usize) {
        self.pieces.push(Piece::Tensor(i));
    }

    fn pieces<'a>(&'a self, tensors: &'a [TensorRef<'a>]) -> Vec<&'a [u8]> {
        self.pieces
            .iter()
            .map(|p| match p {
                Piece::Own(b) => &b[..],
                Piece::Tensor(i) => tensors[*i].bytes,
            })
            .collect()
    }
}

impl WeightSender {
    /// Sends these tensors, in this order, down the chain (and through the ring), and returns
    /// once every engine has confirmed the whole bucket (then every engine is told it is
    /// committed). Tensors are checked first: an inconsistent one sends nothing. If any engine
    /// fails, every engine and the caller get [`TcpError::RankFailed`] naming the same rank,
    /// and the group is unusable.
    ///
    /// With deltas on ([`set_delta`](Self::set_delta)), a tensor every engine holds the base
    /// of goes as a delta when that is clearly smaller; an engine that cannot apply one (its
    /// base is not the one named, or the result fails its checksum) gets it whole in the same
    /// call, before the commit.
    pub async fn send_bucket(&mut self, tensors: &[TensorRef<'_>]) -> Result<(), TcpError> {
        self.send_tensors(tensors, None).await
    }

    /// [`send_bucket`](Self::send_bucket) for tensors in buffers the sender may keep: with
    /// deltas on, each becomes the base of its next delta as it is, instead of being copied
    /// into the sender's own (one copy of the model less on the trainer, and no write to it
    /// while diffing). [`Bytes`] cannot change, so the base cannot drift from what was sent.
    pub async fn send_bucket_shared(
        &mut self,
        tensors: &[SharedTensorRef<'_>],
    ) -> Result<(), TcpError> {
        let refs: Vec<TensorRef<'_>> = tensors
            .iter()
            .map(|t| TensorRef {
                name: t.name,
                dtype: t.dtype,
                shape: t.shape,
                bytes: t.bytes,
            })
            .collect();
        let owners: Vec<&Bytes> = tensors.iter().map(|t| t.bytes).collect();
        self.send_tensors(&refs, Some(&owners)).await
    }

    async fn send_tensors(
        &mut self,
        tensors: &[TensorRef<'_>],
        owners: Option<&[&Bytes]>,
    ) -> Result<(), TcpError> {
        if let Some((rank, reason)) = &self.broken {
            return Err(TcpError::RankFailed {
                rank: *rank,
                reason: format!(
                    "the group failed earlier ({reason}); destroy it and create a new one"
                ),
            });
        }
        if self.peers.is_empty() || !self.wired {
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
        let mut stats = DeltaStats {
            full_bytes: tensors.iter().map(|t| t.bytes.len() as u64).sum(),
            ..DeltaStats::default()
        };
        let Some(bases) = self.delta.clone() else {
            let mut wire = Wire::default();
            for (i, h) in headers.into_iter().enumerate() {
                wire.own(h);
                wire.tensor(i);
            }
            wire.own(end.to_vec());
            let pieces = wire.pieces(tensors);
            stats.sent_bytes = pieces.iter().map(|p| p.len() as u64).sum();
            self.transmit(Source::Pieces(&pieces), deadline).await?;
            self.commit().await?;
            self.stats.add(&stats);
            return Ok(());
        };
        if let Some(owners) = owners
            && self.ring.is_none()
        {
            return self
                .send_streamed(tensors, owners, &bases, end.to_vec(), deadline, stats)
                .await;
        }
        let mut wire = Wire::default();
        let mut whole = Vec::new();
        let mut hooks = self.take_hooks();
        // The diff reads both versions of the bucket: seconds for a large model, off the
        // runtime's other tasks.
        cpu_bound(|| -> Result<(), TcpError> {
            let mut b = bases
                .lock()
                .map_err(|_| TcpError::InvalidArgument("delta bases poisoned".into()))?;
            let synced = self.synced_with(b.digest());
            for (i, t) in tensors.iter().enumerate() {
                hooks.before(i);
                let eligible = synced || self.whole_since_join.contains(t.name);
                let shared = owners.and_then(|o| o.get(i).copied());
                let (header, body) = plan_one(&mut b, t, shared, eligible, &mut stats, &mut whole)?;
                wire.own(header);
                match body {
                    Body::Tensor => wire.tensor(i),
                    Body::Delta(mut d) => {
                        hooks.delta(&mut d);
                        wire.own(d);
                    }
                }
            }
            Ok(())
        })?;
        wire.own(end.to_vec());
        let sent = self
            .send_checked(tensors, &wire, deadline, &mut stats)
            .await;
        self.settle(tensors, &bases, sent.map(|()| whole), stats)
    }

    /// Sends a delta-on bucket, then the repair any engine asks for, then the commit.
    async fn send_checked(
        &mut self,
        tensors: &[TensorRef<'_>],
        wire: &Wire,
        deadline: Instant,
        stats: &mut DeltaStats,
    ) -> Result<(), TcpError> {
        let pieces = wire.pieces(tensors);
        stats.sent_bytes += pieces.iter().map(|p| p.len() as u64).sum::<u64>();
        let outcomes = self.transmit(Source::Pieces(&pieces), deadline).await?;
        self.repair_then_commit(tensors, &outcomes, deadline, stats)
            .await
    }

    /// Resends whole the deltas an engine could not apply (`outcomes` of the bucket), then
    /// commits the bucket.
    pub(super) async fn repair_then_commit(
        &mut self,
        tensors: &[TensorRef<'_>],
        outcomes: &[(u32, Outcome)],
        deadline: Instant,
        stats: &mut DeltaStats,
    ) -> Result<(), TcpError> {
        let mut need: Vec<u32> = outcomes
            .iter()
            .filter_map(|(_, o)| match o {
                Outcome::Need(l) => Some(l.iter().copied()),
                _ => None,
            })
            .flatten()
            .filter(|&i| (i as usize) < tensors.len())
            .collect();
        need.sort_unstable();
        need.dedup();
        if need.is_empty() {
            return self.commit().await;
        }
        let asked: Vec<u32> = outcomes
            .iter()
            .filter(|(_, o)| matches!(o, Outcome::Need(_)))
            .map(|(r, _)| *r)
            .collect();
        tracing::warn!(ranks = ?asked, tensors = need.len(), "resending deltas engines could not apply, whole");
        let mut repair = Wire::default();
        let bases = self.delta.clone();
        for &i in &need {
            let t = &tensors[i as usize];
            let tag = bases
                .as_ref()
                .and_then(|b| b.lock().ok().and_then(|b| b.tag(t.name)))
                .unwrap_or(0);
            repair.own(encode_header_with(t, FRAME_WHOLE_TAGGED, &[tag])?);
            repair.tensor(i as usize);
        }
        repair.own(encode_end(need.len())?.to_vec());
        for p in &mut self.peers {
            write_to_engine(&mut p.control, &ToEngine::Repair(need.clone())).await?;
        }
        let pieces = repair.pieces(tensors);
        stats.sent_bytes += pieces.iter().map(|p| p.len() as u64).sum::<u64>();
        stats.repaired_tensors += need.len() as u64;
        let outcomes = self.transmit(Source::Pieces(&pieces), deadline).await?;
        if let Some((rank, _)) = outcomes.iter().find(|(_, o)| matches!(o, Outcome::Need(_))) {
            let rank = *rank;
            return self
                .fail(
                    rank,
                    format!("rank {rank} could not take tensors even when resent whole"),
                )
                .await;
        }
        self.commit().await
    }

    /// Tells every engine the bucket is committed.
    async fn commit(&mut self) -> Result<(), TcpError> {
        for p in &mut self.peers {
            write_to_engine(&mut p.control, &ToEngine::Commit).await?;
        }
        Ok(())
    }

    /// Writes the bucket's bytes (`source`) down the chain and through the ring and collects
    /// every engine's answer; a failure anywhere fails the group, naming the rank at fault. A
    /// streamed bucket goes down the chain only (the ring is written from pieces).
    pub(super) async fn transmit(
        &mut self,
        source: Source<'_>,
        deadline: Instant,
    ) -> Result<Vec<(u32, Outcome)>, TcpError> {
        let first_rank = self.peers.iter().find(|p| !p.on_ring).map_or(0, |p| p.rank);
        // Engines on the ring do not notice when rank 0 stops writing to it, so once a data link
        // fails, rank 0 waits only briefly for the others' reports before deciding.
        let (cancel, cancelled) = tokio::sync::watch::channel(false);
        let mut tasks =
            spawn_collect_until(std::mem::take(&mut self.peers), deadline, Some(cancelled));
        let (data, ring) = (&mut self.data, &mut self.ring);
        let ring_pieces = match &source {
            Source::Pieces(p) => Some(*p),
            Source::Stream(_) => None,
        };
        let chain = async {
            let Some(data) = data.as_mut() else {
                return Ok(());
            };
            let link =
                |e: std::io::Error| (first_rank, format!("data link to rank {first_rank}: {e}"));
            match source {
                Source::Pieces(pieces) => {
                    for p in pieces {
                        data.write_all(p).await.map_err(link)?;
                    }
                }
                Source::Stream(mut planned) => {
                    let mut ended = false;
                    while let Some(p) = planned.recv().await {
                        data.write_all(&p.header).await.map_err(link)?;
                        if let Some(b) = &p.body {
                            data.write_all(b).await.map_err(link)?;
                        }
                        ended |= p.body.is_none();
                    }
                    if !ended {
                        return Err((0, "rank 0 stopped encoding the bucket".to_string()));
                    }
                }
            }
            data.flush().await.map_err(link)
        };
        let shared = async {
            match (ring.as_mut(), ring_pieces) {
                (Some(ring), Some(pieces)) => ring.send(pieces).await,
                (Some(_), None) => Err((0, "a streamed bucket cannot go through the ring".into())),
                (None, _) => Ok(()),
            }
        };
        let write = async {
            let (a, b) = tokio::join!(chain, shared);
            a.and(b)
        };
        // Boxed so it can be dropped (ending its borrow of the links) before `fail`.
        let mut write = Box::pin(write);
        let mut write_res: Option<Result<(), (u32, String)>> = None;
        let mut outcomes = Vec::new();
        // Armed by the first failure (a data link, or an engine's report): engines that can
        // no longer finish the bucket are not waited for past it.
        let grace = tokio::time::sleep_until(deadline);
        tokio::pin!(grace);
        let mut failing = false;
        let answered = |o: &Outcome| matches!(o, Outcome::Ok | Outcome::Need(_));
        loop {
            tokio::select! {
                r = &mut write, if write_res.is_none() => {
                    if r.is_err() && !failing {
                        failing = true;
                        grace.as_mut().reset(Instant::now() + FAILURE_GRACE);
                    }
                    write_res = Some(r);
                }
                () = &mut grace, if failing => {
                    let _ = cancel.send(true);
                }
                j = tasks.join_next() => match j {
                    None => break,
                    Some(Ok((i, p, o))) => {
                        if !answered(&o) && !failing {
                            failing = true;
                            grace.as_mut().reset(Instant::now() + FAILURE_GRACE);
                        }
                        outcomes.push((i, p, o));
                    }
                    Some(Err(e)) => return Err(TcpError::Protocol(format!("collector task: {e}"))),
                },
            }
        }
        if write_res.is_none() && outcomes.iter().all(|(_, _, o)| answered(o)) {
            write_res = Some((&mut write).await);
        }
        drop(write);
        let outcomes = restore(outcomes, &mut self.peers);
        let link_err = write_res.and_then(Result::err);
        if let Some((rank, reason)) = culprit(&outcomes, link_err) {
            return self.fail(rank, reason).await;
        }
        Ok(outcomes)
    }
}
